//! Kubernetes Events the leader publishes: on Pods (a hold, a deferred release, a hold the
//! safety net lost) and on CapoPolicies (a cap reached, a failed release, a burst of holds).

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tracing::debug;

use crate::policy::SharedMatcher;

/// Publishes Events as `capo` (this replica's identity as the instance). A failure to
/// publish is logged and otherwise ignored: an Event never fails the work it reports.
#[derive(Clone)]
pub struct Events {
    recorder: Recorder,
    /// The compiled policies, for the UID of a CapoPolicy an Event is about.
    policies: Option<SharedMatcher>,
}

impl Events {
    pub fn new(client: Client, identity: &str) -> Self {
        let reporter = Reporter { controller: "capo".into(), instance: Some(identity.to_string()) };
        Self { recorder: Recorder::new(client, reporter), policies: None }
    }

    /// Events about a CapoPolicy carry its UID from `policies`: `kubectl describe
    /// capopolicy` lists only the Events whose object has the policy's UID.
    pub fn naming_policies_by_uid(mut self, policies: SharedMatcher) -> Self {
        self.policies = Some(policies);
        self
    }

    pub async fn publish(
        &self,
        reference: &ObjectReference,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let ev =
            Event { type_, reason: reason.into(), note: Some(fit_note(note)), action: action.into(), secondary: None };
        let reference = &self.with_policy_uid(reference);
        if let Err(e) = self.recorder.publish(&ev, reference).await {
            debug!(error = %e, reason, "could not publish an Event");
        }
    }
}

impl Events {
    fn with_policy_uid(&self, reference: &ObjectReference) -> ObjectReference {
        let mut reference = reference.clone();
        if reference.kind.as_deref() == Some(POLICY_KIND)
            && reference.uid.is_none()
            && let (Some(policies), Some(name)) = (&self.policies, reference.name.as_deref())
        {
            reference.uid = policies.load().get(name).and_then(|p| p.uid.clone());
        }
        reference
    }
}

const POLICY_KIND: &str = "CapoPolicy";

/// The API server refuses an Event whose note is longer than 1024 bytes (an API error
/// quoted in full can be): cut at a character boundary, marked with an ellipsis.
fn fit_note(mut note: String) -> String {
    const MAX: usize = 1024;
    if note.len() <= MAX {
        return note;
    }
    let mut end = MAX - '…'.len_utf8();
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    note.truncate(end);
    note.push('…');
    note
}

pub fn policy_ref(name: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("capo.io/v1alpha1".into()),
        kind: Some(POLICY_KIND.into()),
        name: Some(name.into()),
        ..Default::default()
    }
}

pub fn pod_ref(namespace: &str, name: &str, uid: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        uid: (!uid.is_empty()).then(|| uid.into()),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::fit_note;

    /// A note quoting an API error in full would get the Event refused (1024 bytes).
    #[test]
    fn event_notes_fit_the_api_servers_limit() {
        assert_eq!(fit_note("short".into()), "short");
        let long = fit_note("é".repeat(2000));
        assert!(long.len() <= 1024 && long.ends_with('…'), "{}", long.len());
        assert_eq!(fit_note("x".repeat(1024)).len(), 1024);
    }
}
