//! `capo migrate`: the original capo's `capo_config.yaml` as equivalent CapoPolicies.
//!
//! The original ORed the requirements of its `labelSelector` (a Pod matching any one was
//! held) and opted namespaces in with the label `ip-reserve=enabled`. Standard selectors
//! AND their requirements, so each ORed requirement becomes a policy of its own, each with
//! the namespace label as its `namespaceSelector`.

use std::collections::BTreeMap;

use capo_api::selector::{LabelSelector, Operator, SelectorRequirement};
use serde::Deserialize;
use serde_json::json;

/// The original's defaults when a key is missing.
const DEFAULT_TIME: &str = "30m";
const DEFAULT_MAX: u32 = 200;
const DEFAULT_PERIOD: &str = "5m";
/// The namespace label that opted a namespace in.
pub const ORIGINAL_NAMESPACE_LABEL: (&str, &str) = ("ip-reserve", "enabled");

#[derive(Debug, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct OriginalConfig {
    #[serde(default)]
    ip_reserve_time: Option<String>,
    #[serde(default)]
    ip_reserve_max_count: Option<u32>,
    #[serde(default)]
    ip_release_period: Option<String>,
    #[serde(default)]
    label_selector: Option<OriginalSelector>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct OriginalSelector {
    #[serde(default)]
    match_labels: BTreeMap<String, String>,
    #[serde(default)]
    match_expressions: Vec<SelectorRequirement>,
}

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("capo_config.yaml is not YAML capo understands: {0}")]
    Yaml(String),
    #[error("{field} {value:?} is not a Go duration capo can convert (e.g. 40m, 1h30m, 5s, 1.5h)")]
    Duration { field: &'static str, value: String },
    #[error("labelSelector is empty: the original would select no Pod, so there is nothing to migrate")]
    NothingSelected,
}

/// A Go duration (`40m`, `1h30m`, `1.5h`, `300ms`) in capo's syntax.
fn go_duration(field: &'static str, value: &str) -> Result<String, MigrateError> {
    let err = || MigrateError::Duration { field, value: value.to_string() };
    if let Ok(d) = value.parse::<capo_api::Duration>() {
        return Ok(d.to_string());
    }
    let mut rest = value.trim();
    let mut millis = 0f64;
    if rest.is_empty() {
        return Err(err());
    }
    while !rest.is_empty() {
        let num_len = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        let number: f64 = rest[..num_len].parse().map_err(|_| err())?;
        rest = &rest[num_len..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "h" => 3_600_000.0,
            "m" => 60_000.0,
            "s" => 1_000.0,
            "ms" => 1.0,
            "us" | "µs" => 0.001,
            "ns" => 0.000_001,
            _ => return Err(err()),
        };
        millis += number * scale;
        rest = &rest[unit_len..];
    }
    Ok(capo_api::Duration::from_std(std::time::Duration::from_millis(millis.round() as u64)).to_string())
}

/// A name for a policy from one requirement: lowercase, `[a-z0-9-]`, at most 50 chars.
fn policy_name(index: usize, key: &str) -> String {
    let mut slug: String =
        key.to_ascii_lowercase().chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect();
    slug.truncate(40);
    let slug = slug.trim_matches('-');
    format!("migrated-{index}-{slug}")
}

/// The CapoPolicies equivalent to the original's configuration, as JSON objects.
pub fn migrate(config_yaml: &str) -> Result<Vec<serde_json::Value>, MigrateError> {
    let config: OriginalConfig = serde_saphyr::from_str(config_yaml).map_err(|e| MigrateError::Yaml(e.to_string()))?;
    let reserve_for = go_duration("ipReserveTime", config.ip_reserve_time.as_deref().unwrap_or(DEFAULT_TIME))?;
    let release_interval =
        go_duration("ipReleasePeriod", config.ip_release_period.as_deref().unwrap_or(DEFAULT_PERIOD))?;
    let max = config.ip_reserve_max_count.unwrap_or(DEFAULT_MAX).max(1);
    let selector = config.label_selector.unwrap_or_default();
    let mut requirements: Vec<SelectorRequirement> = selector
        .match_labels
        .into_iter()
        .map(|(key, value)| SelectorRequirement { key, operator: Operator::In, values: vec![value] })
        .collect();
    requirements.extend(selector.match_expressions);
    if requirements.is_empty() {
        return Err(MigrateError::NothingSelected);
    }
    let (ns_key, ns_value) = ORIGINAL_NAMESPACE_LABEL;
    Ok(requirements
        .into_iter()
        .enumerate()
        .map(|(i, req)| {
            let pod_selector = LabelSelector { match_labels: BTreeMap::new(), match_expressions: vec![req.clone()] };
            json!({
                "apiVersion": "capo.io/v1alpha1",
                "kind": "CapoPolicy",
                "metadata": {
                    "name": policy_name(i, &req.key),
                    "annotations": { "capo.io/migrated-from": "capo_config.yaml labelSelector (ORed requirement)" },
                },
                "spec": {
                    "namespaceSelector": { "matchLabels": { ns_key: ns_value } },
                    "podSelector": pod_selector,
                    "reserveFor": reserve_for,
                    "maxReserved": max,
                    "releaseInterval": release_interval,
                },
            })
        })
        .collect())
}

/// The policies as a multi-document YAML stream.
pub fn render(policies: &[serde_json::Value]) -> String {
    let mut out = String::from("# Generated by `capo migrate` from the original capo's capo_config.yaml.\n");
    for p in policies {
        out.push_str("---\n");
        out.push_str(&capo_api::crds::to_yaml(p).expect("a policy serializes"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The original chart's default configuration.
    const ORIGINAL_DEFAULT: &str = r#"
apiVersion: config.capo.io/v1
kind: CapoConfig
health:
  healthProbeBindAddress: :8081
metrics:
  bindAddress: 127.0.0.1:8080
webhook:
  port: 9443
leaderElection:
  leaderElect: true
  resourceName: ip-reserve
  resourceNamespace: ip-reserve
ipReserveMaxCount: 300
ipReserveTime: 40m
ipReleasePeriod: 5s
labelSelector:
  matchExpressions:
  - key: statefulset.kubernetes.io/pod-name
    operator: Exists
  - key: brokerId
    operator: Exists
"#;

    #[test]
    fn the_originals_default_config_becomes_two_policies() {
        let policies = migrate(ORIGINAL_DEFAULT).unwrap();
        assert_eq!(policies.len(), 2, "one per ORed requirement");
        for (p, key) in policies.iter().zip(["statefulset.kubernetes.io/pod-name", "brokerId"]) {
            let spec = &p["spec"];
            assert_eq!(spec["reserveFor"], "40m");
            assert_eq!(spec["maxReserved"], 300);
            assert_eq!(spec["releaseInterval"], "5s");
            assert_eq!(spec["namespaceSelector"]["matchLabels"]["ip-reserve"], "enabled");
            assert_eq!(spec["podSelector"]["matchExpressions"][0]["key"], key);
            assert_eq!(spec["podSelector"]["matchExpressions"][0]["operator"], "Exists");
            // Each is a valid CapoPolicy that capo compiles.
            let policy: capo_api::CapoPolicy = serde_json::from_value(p.clone()).unwrap();
            crate::policy::CompiledPolicy::compile(&policy).unwrap();
        }
        assert_eq!(policies[0]["metadata"]["name"], "migrated-0-statefulset-kubernetes-io-pod-name");
        assert_eq!(policies[1]["metadata"]["name"], "migrated-1-brokerid");
        let yaml = render(&policies);
        assert_eq!(yaml.matches("kind: CapoPolicy").count(), 2);
    }

    #[test]
    fn missing_keys_take_the_originals_defaults_and_match_labels_migrate_too() {
        let policies = migrate("labelSelector:\n  matchLabels:\n    app: kafka\n").unwrap();
        assert_eq!(policies.len(), 1);
        let spec = &policies[0]["spec"];
        assert_eq!(
            (spec["reserveFor"].as_str(), spec["maxReserved"].as_u64(), spec["releaseInterval"].as_str()),
            (Some("30m"), Some(200), Some("5m"))
        );
        assert_eq!(spec["podSelector"]["matchExpressions"][0]["operator"], "In");
        assert_eq!(spec["podSelector"]["matchExpressions"][0]["values"][0], "kafka");
    }

    #[test]
    fn go_durations_convert_and_bad_input_says_what_is_wrong() {
        assert_eq!(go_duration("x", "1.5h").unwrap(), "1h30m");
        assert_eq!(go_duration("x", "1h0m30s").unwrap(), "1h30s");
        assert_eq!(go_duration("x", "300ms").unwrap(), "300ms");
        assert!(matches!(
            go_duration("ipReserveTime", "forever"),
            Err(MigrateError::Duration { field: "ipReserveTime", .. })
        ));
        assert!(matches!(migrate("ipReserveTime: 40m\n"), Err(MigrateError::NothingSelected)));
        assert!(matches!(migrate("labelSelector: [1, 2"), Err(MigrateError::Yaml(_))));
    }
}
