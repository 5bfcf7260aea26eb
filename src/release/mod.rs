//! The leader's work on held IPs: count each hold down from the moment its Pod is gone,
//! release it on time (TTL, cap, manual, Pod kept, workload gone), paced; repair
//! reservations and records against each other.
//!
//! The pure parts decide with no I/O — [`decide`] (one hold), [`cap`] (one policy),
//! [`repair`] (one reservation), [`pacer`] (release slots) — and are unit-tested; the
//! [`controller`] runs them per key from a [`queue`], every write fenced by the Lease
//! ([`writes`], [`crate::calico`]).

pub mod announce;
pub mod cap;
pub mod consistency;
pub mod controller;
pub mod decide;
pub mod pacer;
pub mod queue;
pub mod repair;
pub mod writes;

pub use controller::{EngineSettings, ReleaseEngine};
pub use decide::{PlanSettings, ReleaseReason};
