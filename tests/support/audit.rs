//! The API server's audit log (a control plane started with `audit`): every write to
//! IPReservations, ReservedIPs and Leases as the API server saw it, so tests count writes
//! on the server's side — a write retried, or sent by a replica that no longer leads,
//! shows up here even if its client never learned the outcome.

use std::path::Path;

use k8s_openapi::jiff::Timestamp;
use serde_json::Value;

#[derive(Clone, Debug)]
pub struct AuditEvent {
    pub verb: String,
    pub resource: String,
    pub subresource: String,
    pub name: String,
    pub user_agent: String,
    pub code: u16,
    /// When the API server answered.
    pub at: Timestamp,
    /// The request body (a patch's operations, an object).
    pub request: Value,
}

impl AuditEvent {
    pub fn ok(&self) -> bool {
        (200..300).contains(&self.code)
    }

    /// Whether the writer named itself `identity` (capo's `User-Agent`: `capo/<v> (<identity>)`).
    pub fn by(&self, identity: &str) -> bool {
        self.user_agent.contains(&format!("({identity})"))
    }

    /// The entries a reservation patch removed: each `remove` is preceded by a `test` of
    /// the entry at that index.
    pub fn removed_entries(&self) -> Vec<String> {
        let ops = self.request.as_array().cloned().unwrap_or_default();
        let mut out = Vec::new();
        for pair in ops.windows(2) {
            if pair[1]["op"] == "remove"
                && pair[0]["op"] == "test"
                && pair[0]["path"] == pair[1]["path"]
                && let Some(e) = pair[0]["value"].as_str()
            {
                out.push(e.to_string());
            }
        }
        out
    }
}

/// The completed requests in the audit log at `path`.
pub fn read(path: &Path) -> Vec<AuditEvent> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["stage"] == "ResponseComplete")
        .map(|e| AuditEvent {
            verb: e["verb"].as_str().unwrap_or_default().to_string(),
            resource: e["objectRef"]["resource"].as_str().unwrap_or_default().to_string(),
            subresource: e["objectRef"]["subresource"].as_str().unwrap_or_default().to_string(),
            name: e["objectRef"]["name"].as_str().unwrap_or_default().to_string(),
            user_agent: e["userAgent"].as_str().unwrap_or_default().to_string(),
            code: e["responseStatus"]["code"].as_u64().unwrap_or(0) as u16,
            at: e["stageTimestamp"].as_str().and_then(|t| t.parse().ok()).unwrap_or(Timestamp::UNIX_EPOCH),
            request: e["requestObject"].clone(),
        })
        .collect()
}
