//! The leader's work on held IPs: count them down from the moment their Pod is gone,
//! release them on time (TTL, cap, manual, Pod kept, workload gone) and paced, repair
//! reservations and records against each other, and hold selected Pods that terminate
//! without passing through the webhook (the safety net).
//!
//! [`plan`] decides with no I/O; [`engine`] watches, plans and carries the plan out
//! through [`writes`], every write fenced by the Lease.

pub mod engine;
pub mod plan;
pub mod watches;
pub mod writes;

pub use engine::{EngineSettings, ReleaseEngine};
pub use plan::{PlanSettings, ReleaseReason};
