//! The validating admission webhook on Pod DELETE and `pods/eviction` CREATE, and the
//! mutating one on Pod CREATE (sticky IPs).
//!
//! Decides from memory (compiled policies, cached Namespaces and Pods), writes the hold
//! when a selected Pod goes, and only then answers. Every known condition is answered
//! with an AdmissionReview; only a malformed request gets an HTTP error (400).

mod deadline;
mod handler;
mod intake;
mod respond;
mod review;
mod sticky;

pub use deadline::budget;
pub use handler::{Admission, AdmissionSettings, Caller, REVIEW_PATH, router};
pub use intake::{LARGE_REVIEW_BYTES, ReviewLimits};
pub use sticky::STICKY_PATH;
