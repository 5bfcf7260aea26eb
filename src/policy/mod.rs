//! CapoPolicies: compiled into a [`Matcher`] that the admission path reads without locks,
//! swapped atomically whenever a policy changes.

mod compile;
mod controller;
mod matcher;

pub use compile::{CompiledPolicy, PolicyError};
pub use controller::{PolicyController, SharedMatcher};
pub use matcher::{Consideration, Decision, HoldPlan, Matcher, OptIn, RequestContext, SkipReason};
