//! capo's Kubernetes API: the `CapoPolicy` and `ReservedIP` custom resources,
//! bindings for Calico's `IPReservation` in both of its API groups, and the
//! well-known labels and annotations capo reads and writes.

// kube-derive takes one `printcolumn(...)` per column; clippy reads the repeats as duplicates.
#![allow(clippy::duplicated_attributes)]

pub mod calico;
pub mod crds;
pub mod duration;
pub mod keys;
pub mod policy;
pub mod reserved_ip;
pub mod selector;

pub use calico::CalicoApiGroup;
pub use duration::{Duration, DurationError};
pub use policy::{CapoPolicy, CapoPolicySpec, CapoPolicyStatus, HoldFailureAction, ReleaseEarly, Sticky};
pub use reserved_ip::{
    ControllerRef, HoldTrigger, ManualAction, ManualChange, PodRef, ReservedIP, ReservedIPSpec, ReservedIPStatus,
    StickyClaim,
};
pub use selector::{LabelSelector, LabelSet, Labels, Operator, SelectorRequirement};
