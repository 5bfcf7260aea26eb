//! Label selectors with standard Kubernetes semantics: every `matchLabels` entry and every
//! `matchExpressions` requirement must hold (the original capo ORed expressions).
//!
//! Same YAML shape as `metav1.LabelSelector`, with bounded lists and an operator enum so the
//! API server rejects a bad selector at apply time and CEL cost stays within budget.

use std::collections::BTreeMap;

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    /// Labels that must all be present with exactly these values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 64))]
    pub match_labels: BTreeMap<String, String>,
    /// Requirements that must all hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub match_expressions: Vec<SelectorRequirement>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.operator in ['In', 'NotIn'] ? (has(self.values) && size(self.values) > 0) : (!has(self.values) || size(self.values) == 0)").message("In and NotIn need at least one value; Exists and DoesNotExist take no values"))]
pub struct SelectorRequirement {
    /// The label key.
    #[schemars(length(min = 1, max = 317))]
    pub key: String,
    pub operator: Operator,
    /// Values for `In` and `NotIn`; empty for `Exists` and `DoesNotExist`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(max = 63)))]
    pub values: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum Operator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    #[error("matchExpressions[{index}] (key {key:?}): {operator:?} needs at least one value")]
    MissingValues { index: usize, key: String, operator: Operator },
    #[error("matchExpressions[{index}] (key {key:?}): {operator:?} takes no values")]
    UnexpectedValues { index: usize, key: String, operator: Operator },
}

impl LabelSelector {
    /// Checks what the schema checks, for objects that slipped past it (an old CRD, a
    /// hand-edited etcd): the controller marks such a policy `Ready=False`.
    pub fn validate(&self) -> Result<(), SelectorError> {
        for (index, req) in self.match_expressions.iter().enumerate() {
            let needs_values = matches!(req.operator, Operator::In | Operator::NotIn);
            match (needs_values, req.values.is_empty()) {
                (true, true) => {
                    return Err(SelectorError::MissingValues { index, key: req.key.clone(), operator: req.operator });
                }
                (false, false) => {
                    return Err(SelectorError::UnexpectedValues {
                        index,
                        key: req.key.clone(),
                        operator: req.operator,
                    });
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Whether `labels` satisfy this selector. An empty selector matches everything.
    pub fn matches<L: LabelSet + ?Sized>(&self, labels: &L) -> bool {
        self.match_labels.iter().all(|(k, v)| labels.label(k) == Some(v.as_str()))
            && self.match_expressions.iter().all(|req| req.matches(labels))
    }
}

impl SelectorRequirement {
    pub fn matches<L: LabelSet + ?Sized>(&self, labels: &L) -> bool {
        let value = labels.label(&self.key);
        match self.operator {
            Operator::In => value.is_some_and(|v| self.values.iter().any(|w| w == v)),
            Operator::NotIn => value.is_none_or(|v| !self.values.iter().any(|w| w == v)),
            Operator::Exists => value.is_some(),
            Operator::DoesNotExist => value.is_none(),
        }
    }
}

/// Something a selector can look labels up in.
pub trait LabelSet {
    fn label(&self, key: &str) -> Option<&str>;
}

impl LabelSet for BTreeMap<String, String> {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
}

/// An object's labels as a cache keeps them: the pairs sorted by key in one allocation.
/// A `BTreeMap` node has room for eleven pairs whatever it holds (about 540 bytes for
/// `String` pairs); a Pod's few labels take a quarter of that here, and capo keeps one
/// label set per cached Pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Labels(Box<[(Box<str>, Box<str>)]>);

impl Labels {
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.binary_search_by(|(k, _)| (**k).cmp(key)).ok().map(|i| &*self.0[i].1)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (&**k, &**v))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl LabelSet for Labels {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key)
    }
}

impl From<BTreeMap<String, String>> for Labels {
    fn from(map: BTreeMap<String, String>) -> Self {
        // A map iterates in key order: the pairs come sorted.
        Self(map.into_iter().map(|(k, v)| (k.into_boxed_str(), v.into_boxed_str())).collect())
    }
}

impl FromIterator<(String, String)> for Labels {
    fn from_iter<I: IntoIterator<Item = (String, String)>>(pairs: I) -> Self {
        pairs.into_iter().collect::<BTreeMap<_, _>>().into()
    }
}

impl<'de> Deserialize<'de> for Labels {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        BTreeMap::<String, String>::deserialize(d).map(Self::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn req(key: &str, operator: Operator, values: &[&str]) -> SelectorRequirement {
        SelectorRequirement { key: key.into(), operator, values: values.iter().map(|v| v.to_string()).collect() }
    }

    #[test]
    fn compact_labels_answer_as_the_map_they_came_from() {
        let map = labels(&[("tier", "cache"), ("app", "redis"), ("statefulset.kubernetes.io/pod-name", "redis-7")]);
        let compact = Labels::from(map.clone());
        for key in ["app", "tier", "statefulset.kubernetes.io/pod-name", "missing", "", "zzz"] {
            assert_eq!(compact.get(key), map.label(key), "{key}");
        }
        assert_eq!(compact.len(), 3);
        assert_eq!(
            compact.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            ["app", "statefulset.kubernetes.io/pod-name", "tier"]
        );
        let read: Labels = serde_json::from_value(serde_json::json!({"tier": "cache", "app": "redis"})).unwrap();
        assert_eq!(read.get("app"), Some("redis"));
        let sel = LabelSelector {
            match_labels: labels(&[("app", "redis")]),
            match_expressions: vec![
                req("tier", Operator::In, &["cache", "db"]),
                req("gone", Operator::DoesNotExist, &[]),
            ],
        };
        assert!(sel.matches(&compact) && sel.matches(&map));
        assert!(Labels::default().is_empty() && !sel.matches(&Labels::default()));
    }

    #[test]
    fn empty_selector_matches_everything() {
        assert!(LabelSelector::default().matches(&labels(&[])));
        assert!(LabelSelector::default().matches(&labels(&[("a", "b")])));
    }

    #[test]
    fn expressions_are_anded_not_ored() {
        // The original capo ORed these two; a Kafka broker without a StatefulSet label
        // must not match a selector that asks for both.
        let sel = LabelSelector {
            match_labels: BTreeMap::new(),
            match_expressions: vec![
                req("statefulset.kubernetes.io/pod-name", Operator::Exists, &[]),
                req("brokerId", Operator::Exists, &[]),
            ],
        };
        assert!(!sel.matches(&labels(&[("brokerId", "1")])));
        assert!(sel.matches(&labels(&[("brokerId", "1"), ("statefulset.kubernetes.io/pod-name", "k-0")])));
    }

    #[test]
    fn every_operator_has_standard_semantics() {
        let l = labels(&[("app", "redis"), ("tier", "db")]);
        assert!(req("app", Operator::In, &["redis", "zk"]).matches(&l));
        assert!(!req("app", Operator::In, &["zk"]).matches(&l));
        assert!(!req("missing", Operator::In, &["x"]).matches(&l));
        assert!(req("app", Operator::NotIn, &["zk"]).matches(&l));
        assert!(req("missing", Operator::NotIn, &["zk"]).matches(&l));
        assert!(!req("app", Operator::NotIn, &["redis"]).matches(&l));
        assert!(req("tier", Operator::Exists, &[]).matches(&l));
        assert!(!req("missing", Operator::Exists, &[]).matches(&l));
        assert!(req("missing", Operator::DoesNotExist, &[]).matches(&l));
        assert!(!req("app", Operator::DoesNotExist, &[]).matches(&l));
    }

    #[test]
    fn match_labels_and_expressions_must_all_hold() {
        let sel = LabelSelector {
            match_labels: labels(&[("app", "redis")]),
            match_expressions: vec![req("tier", Operator::In, &["db"])],
        };
        assert!(sel.matches(&labels(&[("app", "redis"), ("tier", "db")])));
        assert!(!sel.matches(&labels(&[("app", "redis"), ("tier", "web")])));
        assert!(!sel.matches(&labels(&[("tier", "db")])));
    }

    #[test]
    fn validate_reports_the_offending_expression() {
        let sel = LabelSelector { match_labels: BTreeMap::new(), match_expressions: vec![req("a", Operator::In, &[])] };
        let err = sel.validate().unwrap_err().to_string();
        assert!(err.contains("matchExpressions[0]") && err.contains("\"a\""), "{err}");
        let sel = LabelSelector {
            match_labels: BTreeMap::new(),
            match_expressions: vec![req("a", Operator::Exists, &["x"])],
        };
        assert!(matches!(sel.validate(), Err(SelectorError::UnexpectedValues { .. })));
    }
}
