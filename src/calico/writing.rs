//! The API group capo writes new holds to, and the group Calico was last seen reading.
//! The first is chosen when capo starts ([`super::detect`]) and moved at run time by
//! [`super::follow`] when Calico's datastore migration moves what Calico reads. Every
//! holder of a clone sees a move at once; a hold in progress keeps the group it started
//! with ([`super::Reservations::pinned`]), so its record and its entry name one group.

use std::sync::Arc;

use capo_api::CalicoApiGroup;
use tokio::sync::watch;

/// Where capo writes and where Calico reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Groups {
    writes: CalicoApiGroup,
    /// What Calico reads, unlocked, as last seen (`None`: not looked at, or locked).
    reads: Option<CalicoApiGroup>,
}

impl Groups {
    /// The group Calico's IPAM keeps its pools and blocks in, as far as capo knows: the one
    /// it was seen reading, else (not looked at yet, or locked by a migration) the one new
    /// holds go to.
    pub fn calico_ipam(&self) -> CalicoApiGroup {
        self.reads.unwrap_or(self.writes)
    }
}

#[derive(Clone)]
pub struct WritingGroup(Arc<watch::Sender<Groups>>);

impl WritingGroup {
    pub fn new(group: CalicoApiGroup) -> Self {
        Self(Arc::new(watch::Sender::new(Groups { writes: group, reads: None })))
    }

    pub fn get(&self) -> CalicoApiGroup {
        self.0.borrow().writes
    }

    /// Moves new holds to `group`; whether that changed anything.
    pub fn set(&self, group: CalicoApiGroup) -> bool {
        self.0.send_if_modified(|g| std::mem::replace(&mut g.writes, group) != group)
    }

    /// Calico was seen reading `group`, unlocked (`None`: locked, or not known).
    pub fn calico_reads(&self, group: Option<CalicoApiGroup>) {
        self.0.send_if_modified(|g| std::mem::replace(&mut g.reads, group) != group);
    }

    /// Whether Calico was last seen reading, unlocked, the group new holds go to: holds
    /// still only in another group are then in a group Calico no longer reads.
    pub fn calico_reads_where_capo_writes(&self) -> bool {
        let g = *self.0.borrow();
        g.reads == Some(g.writes)
    }

    /// Told of every change of either.
    pub fn subscribe(&self) -> watch::Receiver<Groups> {
        self.0.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_is_seen_by_every_clone_and_told_once() {
        let writing = WritingGroup::new(CalicoApiGroup::CrdV1);
        let other = writing.clone();
        let mut told = writing.subscribe();
        assert!(!writing.set(CalicoApiGroup::CrdV1), "no move");
        assert!(!told.has_changed().unwrap());
        assert!(writing.set(CalicoApiGroup::V3));
        assert_eq!(other.get(), CalicoApiGroup::V3);
        assert!(told.has_changed().unwrap());
        told.mark_unchanged();
        assert!(!other.calico_reads_where_capo_writes(), "not looked at yet");
        other.calico_reads(Some(CalicoApiGroup::V3));
        assert!(writing.calico_reads_where_capo_writes());
        assert!(told.has_changed().unwrap());
    }
}
