//! capo's Calico `IPReservation`s: the one module that reads and writes them, for both
//! API groups — parsing and checking entries ([`entry`]), spreading a policy's holds over
//! shards ([`shards`]), the watched copy ([`index`]) and the conflict-free, fenced write
//! protocol ([`writer`]). Which group the cluster serves is detected the way Calico does
//! ([`detect`]).

pub mod datastore;
mod detect;
pub mod entry;
pub mod etcd;
pub mod index;
pub mod pools;
pub mod shards;
mod writer;
pub mod writing;

pub use datastore::Datastore;
pub use detect::{CalicoReads, Detected, Follow, FollowGauges, detect_calico_api, follow};
pub use index::{IndexEvent, ReservationIndex, ShardKey, ShardView};
pub use writer::{CalicoError, Reservations, is_type_not_served};
pub use writing::WritingGroup;
