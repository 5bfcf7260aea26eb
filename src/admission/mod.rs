//! The validating admission webhook on Pod DELETE and `pods/eviction` CREATE.
//!
//! Decides from memory (compiled policies, cached Namespaces and Pods), writes the hold
//! when a selected Pod goes, and only then answers. Every known condition is answered
//! with an AdmissionReview; only a malformed request gets an HTTP error (400).

mod deadline;
mod handler;
mod intake;
mod respond;
mod review;

pub use deadline::budget;
pub use handler::{Admission, AdmissionSettings, Caller, REVIEW_PATH, router};
pub use intake::{LARGE_REVIEW_BYTES, ReviewLimits};
