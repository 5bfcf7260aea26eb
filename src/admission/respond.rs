//! Building AdmissionResponses.

use kube::core::admission::AdmissionResponse;

/// Allow, with warnings for the client (shown by kubectl).
pub fn allow(mut resp: AdmissionResponse, warnings: Vec<String>) -> AdmissionResponse {
    resp.allowed = true;
    if !warnings.is_empty() {
        resp.warnings = Some(warnings);
    }
    resp
}

/// Deny with `code`: 429 makes `kubectl drain` and other eviction clients retry.
pub fn deny(resp: AdmissionResponse, code: u16, reason: &str, message: String) -> AdmissionResponse {
    let mut resp = resp.deny(message);
    resp.result.status = Some(kube::core::response::StatusSummary::Failure);
    resp.result.code = code;
    resp.result.reason = reason.to_string();
    resp
}
