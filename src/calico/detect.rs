//! Which Calico API group serves `IPReservation` here, decided the way Calico decides:
//! `projectcalico.org/v3` when it is served and `crd.projectcalico.org/v1` is not.
//!
//! Where both are served, whether they are two stores or one: calico-apiserver (an
//! aggregated API server, behind `APIService v3.projectcalico.org` with a Service) serves
//! `projectcalico.org/v3` as a view of the `crd.projectcalico.org/v1` objects, so every
//! object has two names; native `projectcalico.org/v3` CRDs beside the v1 ones (a cluster
//! moving to Calico 3.32's v3 CRDs) are objects of their own. capo watches and writes
//! one group where they are one store, both where they are two.
//!
//! Calico's datastore migration (3.33's `DatastoreMigration`, v1 behind calico-apiserver →
//! native v3 CRDs) moves what Calico's components read while both groups stay served: it
//! locks the v1 datastore (`ClusterInformation default`, `spec.datastoreReady: false`),
//! removes calico-apiserver's APIService, copies every object to its v3 CRD and unlocks v3;
//! v1 stays locked for good. So where v3 is native and both are served, Calico reads v3
//! once v1 is locked and v3's `ClusterInformation` is ready ([`reads`]); [`follow`]
//! watches for that at run time.
//!
//! Only a definite answer counts: a discovery request that fails for another reason than
//! "not found" (the API server restarting, throttling) is asked again, so a transient
//! error cannot pick the wrong group for the life of the process.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use capo_api::CalicoApiGroup;
use kube::Client;
use tracing::{info, warn};

use super::index::ReservationIndex;
use super::writing::WritingGroup;

/// How often discovery is asked before capo decides with what it knows.
const ATTEMPTS: u32 = 8;

async fn serves_ip_reservations(client: &Client, group: CalicoApiGroup) -> Result<bool, kube::Error> {
    match client.list_api_group_resources(&group.api_version()).await {
        Ok(list) => Ok(list.resources.iter().any(|r| r.name == "ipreservations")),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Calico's rule on definite answers.
fn choose(v1: bool, v3: bool) -> CalicoApiGroup {
    if v3 && !v1 { CalicoApiGroup::V3 } else { CalicoApiGroup::CrdV1 }
}

/// What Calico's components read: the group, and whether a datastore migration holds it
/// locked (Calico's CNI ADD and DEL wait; no address is given or freed meanwhile).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CalicoReads {
    pub group: CalicoApiGroup,
    pub locked: bool,
}

/// A `ClusterInformation default`'s `spec.datastoreReady`: `None` when there is none, a
/// missing field counting as ready.
pub type Ready = Option<bool>;

/// The group Calico's components read, from what is served and the two groups'
/// `ClusterInformation`: where v3 is native beside v1 (a cluster in or after a datastore
/// migration), v3 once v1 is locked and v3 is not; v1 (locked) while the migration copies.
pub fn reads(v1: bool, v3: bool, v3_native: bool, v1_ready: Ready, v3_ready: Ready) -> CalicoReads {
    let locked = |r: Ready| r == Some(false);
    if v1 && v3 && v3_native {
        if locked(v1_ready) && v3_ready == Some(true) {
            return CalicoReads { group: CalicoApiGroup::V3, locked: false };
        }
        return CalicoReads { group: CalicoApiGroup::CrdV1, locked: locked(v1_ready) };
    }
    let group = choose(v1, v3);
    let ready = if group == CalicoApiGroup::V3 { v3_ready } else { v1_ready };
    CalicoReads { group, locked: locked(ready) }
}

/// `ClusterInformation default` of `group`: its `spec.datastoreReady` (see [`Ready`]).
async fn datastore_ready(client: &Client, group: CalicoApiGroup) -> Result<Ready, kube::Error> {
    let ar = kube::api::ApiResource {
        group: group.group().into(),
        version: group.version().into(),
        api_version: group.api_version(),
        kind: "ClusterInformation".into(),
        plural: "clusterinformations".into(),
    };
    let api = kube::Api::<kube::api::DynamicObject>::all_with(client.clone(), &ar);
    match api.get_opt("default").await {
        Ok(Some(ci)) => Ok(Some(ci.data.pointer("/spec/datastoreReady").and_then(|v| v.as_bool()).unwrap_or(true))),
        Ok(None) => Ok(None),
        // Not served, or not readable: no migration capo can see.
        Err(kube::Error::Api(s)) if matches!(s.code, 403 | 404) => Ok(None),
        Err(e) => Err(e),
    }
}

/// One look at the cluster: what Calico reads now, and whether v3 is calico-apiserver's
/// view of v1 (one store).
pub async fn look(client: &Client) -> Result<(CalicoReads, bool), kube::Error> {
    let v1 = serves_ip_reservations(client, CalicoApiGroup::CrdV1).await?;
    let v3 = serves_ip_reservations(client, CalicoApiGroup::V3).await?;
    let aggregated = v3
        && v3_is_aggregated(client).await.or_else(|e| match e {
            kube::Error::Api(s) if s.code == 403 => Ok(true),
            e => Err(e),
        })?;
    // A migration needs v3 served (calico-apiserver's, or the native CRDs): a cluster
    // serving v1 alone is not asked for its lock.
    let v1_ready = if v1 && v3 { datastore_ready(client, CalicoApiGroup::CrdV1).await? } else { None };
    let v3_ready = if v3 && !aggregated { datastore_ready(client, CalicoApiGroup::V3).await? } else { None };
    Ok((reads(v1, v3, v3 && !aggregated, v1_ready, v3_ready), v1 && aggregated))
}

/// The group capo writes holds in, and every group that serves IPReservations (capo
/// releases holds from all of them: holds made before a switch stay where they are).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Detected {
    pub chosen: CalicoApiGroup,
    pub served: Vec<CalicoApiGroup>,
    /// `projectcalico.org/v3` is served by an aggregated API server (calico-apiserver) as
    /// a view of the `crd.projectcalico.org/v1` objects: both groups name one store.
    pub one_store: bool,
}

impl Detected {
    /// Only `group` is served, and it is its own store.
    pub fn only(group: CalicoApiGroup) -> Self {
        Self { chosen: group, served: vec![group], one_store: false }
    }

    /// The groups capo watches: where both name one store, the chosen one alone (each
    /// object once); else every served group, and the chosen one.
    pub fn watched(&self) -> Vec<CalicoApiGroup> {
        if self.one_store {
            return vec![self.chosen];
        }
        let mut watched = self.served.clone();
        if !watched.contains(&self.chosen) {
            watched.push(self.chosen);
        }
        watched
    }

    /// Where both groups name one store: (the other group, the chosen one).
    pub fn alias(&self) -> Option<(CalicoApiGroup, CalicoApiGroup)> {
        let other = match self.chosen {
            CalicoApiGroup::CrdV1 => CalicoApiGroup::V3,
            CalicoApiGroup::V3 => CalicoApiGroup::CrdV1,
        };
        self.one_store.then_some((other, self.chosen))
    }
}

/// The APIService that serves `projectcalico.org/v3`.
const V3_API_SERVICE: &str = "v3.projectcalico.org";

/// Whether `projectcalico.org/v3` is served by an aggregated API server (its APIService
/// names a Service) rather than by CRDs in the API server itself (`service: null`).
async fn v3_is_aggregated(client: &Client) -> Result<bool, kube::Error> {
    let ar = kube::api::ApiResource {
        group: "apiregistration.k8s.io".into(),
        version: "v1".into(),
        api_version: "apiregistration.k8s.io/v1".into(),
        kind: "APIService".into(),
        plural: "apiservices".into(),
    };
    let api = kube::Api::<kube::api::DynamicObject>::all_with(client.clone(), &ar);
    match api.get(V3_API_SERVICE).await {
        Ok(svc) => Ok(svc.data.pointer("/spec/service").is_some_and(|s| !s.is_null())),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Whether both served groups name one store. Unknown (the APIService cannot be read)
/// counts as one store: that is what clusters serving both run (calico-apiserver), and
/// taking one store for two would make capo remove its own entries as duplicates.
async fn one_store(client: &Client) -> bool {
    let mut delay = Duration::from_millis(200);
    for attempt in 1..=ATTEMPTS {
        match v3_is_aggregated(client).await {
            Ok(aggregated) => return aggregated,
            Err(kube::Error::Api(s)) if s.code == 403 => {
                warn!(
                    apiservice = V3_API_SERVICE,
                    "cannot read the APIService (forbidden); taking projectcalico.org/v3 for calico-apiserver's view of crd.projectcalico.org/v1"
                );
                return true;
            }
            Err(e) => {
                warn!(attempt, apiservice = V3_API_SERVICE, error = %e, "reading the APIService failed; asking again");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }
    warn!(apiservice = V3_API_SERVICE, "reading the APIService kept failing; taking both groups for one store");
    true
}

/// Asks discovery which groups serve IPReservations; `forced` (`--calico-api`) overrides
/// the choice but not what is watched.
pub async fn detect_calico_api(client: &Client, forced: Option<CalicoApiGroup>) -> Detected {
    let mut delay = Duration::from_millis(200);
    for attempt in 1..=ATTEMPTS {
        let v1 = serves_ip_reservations(client, CalicoApiGroup::CrdV1).await;
        let v3 = serves_ip_reservations(client, CalicoApiGroup::V3).await;
        match (v1, v3) {
            (Ok(v1), Ok(v3)) => {
                let one_store = v1 && v3 && one_store(client).await;
                let (v1_ready, v3_ready) = if v1 && v3 && !one_store {
                    let ready = |g| async move { datastore_ready(client, g).await.unwrap_or(None) };
                    (ready(CalicoApiGroup::CrdV1).await, ready(CalicoApiGroup::V3).await)
                } else {
                    (None, None)
                };
                let calico = reads(v1, v3, v3 && !one_store, v1_ready, v3_ready);
                let chosen = forced.unwrap_or(calico.group);
                let served: Vec<CalicoApiGroup> = [(CalicoApiGroup::CrdV1, v1), (CalicoApiGroup::V3, v3)]
                    .into_iter()
                    .filter(|(_, s)| *s)
                    .map(|(g, _)| g)
                    .collect();
                info!(crd_v1 = v1, v3, one_store, locked = calico.locked, calico_reads = %calico.group, chosen = %chosen, "detected the Calico API");
                return Detected { chosen, served, one_store };
            }
            (v1, v3) => {
                let error = v1.err().or(v3.err()).map(|e| e.to_string()).unwrap_or_default();
                warn!(attempt, error, "Calico API discovery failed; asking again");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }
    let chosen = forced.unwrap_or(CalicoApiGroup::CrdV1);
    warn!(chosen = %chosen, "Calico API discovery kept failing; set --calico-api to choose");
    Detected::only(chosen)
}

/// How often [`follow`] looks at Calico's datastore.
pub const FOLLOW_INTERVAL: Duration = Duration::from_secs(5);

/// Gauges of what [`follow`] saw.
#[derive(Clone)]
pub struct FollowGauges {
    /// 1 while a datastore migration holds Calico's datastore locked.
    pub locked: prometheus::IntGauge,
    /// 1 while Calico's components read another group than capo writes holds to.
    pub moved: prometheus::IntGauge,
}

/// What [`follow`] needs besides the client: what it moves when Calico's reads move.
pub struct Follow {
    pub client: Client,
    /// Where new holds go; moved to the group Calico reads once a migration converges.
    pub writing: WritingGroup,
    pub index: Arc<ReservationIndex>,
    /// The groups the index is kept from already (their watches run elsewhere).
    pub watched: Vec<CalicoApiGroup>,
    /// The operator chose the group (`--calico-api`): it is said where Calico reads, never
    /// moved.
    pub forced: bool,
    pub gauges: FollowGauges,
}

/// The watches [`follow`] started, stopped with it.
#[derive(Default)]
struct Watches(HashMap<CalicoApiGroup, tokio::task::JoinHandle<()>>);

impl Drop for Watches {
    fn drop(&mut self) {
        for task in self.0.values() {
            task.abort();
        }
    }
}

/// How long [`follow`] waits for a newly watched group's first list before it moves new
/// holds there (it tries again at the next look).
const SYNC_BOUND: Duration = Duration::from_secs(30);

/// Looks at Calico's datastore every [`FOLLOW_INTERVAL`] for the life of the process and
/// follows a datastore migration (a log line on each change, the gauges):
/// - calico-apiserver's APIService goes (v3 served by Calico's own CRDs): the two groups
///   are stores of their own, and v3 is watched too (the migration's copies come in);
/// - v1 locked and v3 ready (the migration converged): new holds go to v3, where Calico
///   reads (the leader then re-asserts there what was written to v1 after the copy);
/// - the APIService comes back before that (a cancelled migration): one store again.
///
/// During the lock new holds stay in v1: a v3 object written before the migration copies
/// its source would be a conflict that keeps the whole datastore locked. A look that fails
/// changes nothing.
pub async fn follow(f: Follow) {
    let Follow { client, writing, index, mut watched, forced, gauges } = f;
    let mut watches = Watches::default();
    let mut ended: Option<(CalicoApiGroup, CalicoApiGroup)> = None;
    let mut last: Option<CalicoReads> = None;
    let start_watch = |group: CalicoApiGroup, watched: &mut Vec<CalicoApiGroup>, watches: &mut Watches| {
        if !watched.contains(&group) {
            watched.push(group);
            watches.0.insert(group, tokio::spawn(index.clone().watch(client.clone(), group)));
        }
    };
    loop {
        match look(&client).await {
            Ok((now, one_store)) => {
                if !one_store && let Some(alias) = index.alias() {
                    index.end_alias();
                    ended = Some(alias);
                    info!(group = %alias.0, "{} is served by Calico's own CRDs now (calico-apiserver's APIService went: a datastore migration); watching it as a store of its own", alias.0);
                    start_watch(alias.0, &mut watched, &mut watches);
                }
                if one_store && let Some((view, stored)) = ended.take() {
                    if let Some(task) = watches.0.remove(&view) {
                        task.abort();
                        watched.retain(|g| *g != view);
                    }
                    index.alias_again(view, stored);
                    info!(group = %view, "calico-apiserver's APIService is back (a cancelled datastore migration): {view} is its view of {stored} again");
                }
                // Where both groups name one store (capo forced to write through the other
                // name), they are not two places.
                let elsewhere = |a: CalicoApiGroup, b: CalicoApiGroup| index.canonical(a) != index.canonical(b);
                let holds_in = writing.get();
                if !forced && elsewhere(now.group, holds_in) && !now.locked && !one_store {
                    start_watch(now.group, &mut watched, &mut watches);
                    if tokio::time::timeout(SYNC_BOUND, index.synced(now.group)).await.is_ok() {
                        writing.set(now.group);
                        info!(
                            calico_reads = %now.group, before = %holds_in,
                            "Calico reads {} now (a datastore migration converged): new holds go there; the leader re-asserts there every hold still only in {holds_in}",
                            now.group
                        );
                    } else {
                        warn!(group = %now.group, bound = ?SYNC_BOUND, "Calico reads {} now, but its IPReservations could not be listed; capo holds in {holds_in} meanwhile and tries again", now.group);
                    }
                }
                let holds_in = writing.get();
                writing.calico_reads((!now.locked).then_some(now.group));
                let moved = elsewhere(now.group, holds_in);
                if last != Some(now) {
                    if moved {
                        tracing::error!(
                            calico_reads = %now.group, capo_writes = %holds_in, locked = now.locked,
                            "Calico reads another group than capo holds in: capo's holds in {holds_in} do not keep addresses from Calico's IPAM"
                        );
                    } else if now.locked {
                        warn!(calico_reads = %now.group, "Calico's datastore is locked (a datastore migration is running): Calico gives and frees no address until it ends; capo holds as before");
                    } else if last.is_some() {
                        info!(calico_reads = %now.group, "Calico's datastore is unlocked");
                    }
                    last = Some(now);
                }
                gauges.locked.set(i64::from(now.locked));
                gauges.moved.set(i64::from(moved));
            }
            Err(e) => tracing::debug!(error = %e, "looking at Calico's datastore failed; asking again"),
        }
        tokio::time::sleep(FOLLOW_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calicos_rule() {
        assert_eq!(choose(true, true), CalicoApiGroup::CrdV1);
        assert_eq!(choose(true, false), CalicoApiGroup::CrdV1);
        assert_eq!(choose(false, true), CalicoApiGroup::V3);
        assert_eq!(choose(false, false), CalicoApiGroup::CrdV1);
    }

    #[test]
    fn after_a_datastore_migration_calico_reads_v3() {
        use CalicoApiGroup::{CrdV1, V3};
        let r = |group, locked| CalicoReads { group, locked };
        // Before: v1 behind calico-apiserver (v3 its view), or native v3 CRDs installed early.
        assert_eq!(reads(true, true, false, Some(true), None), r(CrdV1, false));
        assert_eq!(reads(true, true, true, Some(true), None), r(CrdV1, false));
        // Locked: v1 locked, v3 not there yet or locked too.
        assert_eq!(reads(true, true, false, Some(false), None), r(CrdV1, true));
        assert_eq!(reads(true, true, true, Some(false), None), r(CrdV1, true));
        assert_eq!(reads(true, true, true, Some(false), Some(false)), r(CrdV1, true));
        // Converged: v1 locked for good, v3 ready.
        assert_eq!(reads(true, true, true, Some(false), Some(true)), r(V3, false));
        // A cancelled migration: v1 unlocked again (whatever v3 holds).
        assert_eq!(reads(true, true, true, Some(true), Some(true)), r(CrdV1, false));
        // One group only.
        assert_eq!(reads(false, true, true, None, Some(true)), r(V3, false));
        assert_eq!(reads(false, true, true, None, Some(false)), r(V3, true));
        assert_eq!(reads(true, false, false, None, None), r(CrdV1, false));
    }

    #[test]
    fn one_store_is_watched_once_through_the_chosen_group() {
        let both = vec![CalicoApiGroup::CrdV1, CalicoApiGroup::V3];
        let apiserver = Detected { chosen: CalicoApiGroup::CrdV1, served: both.clone(), one_store: true };
        assert_eq!(apiserver.watched(), vec![CalicoApiGroup::CrdV1]);
        assert_eq!(apiserver.alias(), Some((CalicoApiGroup::V3, CalicoApiGroup::CrdV1)));
        let forced = Detected { chosen: CalicoApiGroup::V3, served: both.clone(), one_store: true };
        assert_eq!(forced.watched(), vec![CalicoApiGroup::V3]);
        assert_eq!(forced.alias(), Some((CalicoApiGroup::CrdV1, CalicoApiGroup::V3)));
        let two = Detected { chosen: CalicoApiGroup::CrdV1, served: both.clone(), one_store: false };
        assert_eq!(two.watched(), both);
        assert_eq!(two.alias(), None);
        assert_eq!(Detected::only(CalicoApiGroup::V3).watched(), vec![CalicoApiGroup::V3]);
    }
}
