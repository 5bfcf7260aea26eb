//! The leader's work on held IPs: count each hold down from the moment its Pod is gone,
//! release it on time (TTL, cap, manual, Pod kept, workload gone), paced; repair
//! reservations and records against each other.
//!
//! The pure parts decide with no I/O — [`decide`] (one hold), [`cap`] (one policy),
//! [`repair`] (one reservation), [`pacer`] (release slots) — and are unit-tested; the
//! [`leader`] runs them per key from a [`queue`], one module per kind of work, every write
//! fenced by the Lease ([`writes`], [`crate::calico`]); [`announce`] and
//! [`crate::events`] say what it did.

pub mod announce;
pub mod cap;
pub mod consistency;
pub mod countdowns;
pub mod decide;
pub mod leader;
pub mod pacer;
pub mod queue;
pub mod repair;
pub mod writes;

pub use decide::{PlanSettings, ReleaseReason};
pub use leader::{DEFAULT_MAX_POOL_SHARE, EngineSettings, ReleaseEngine};
