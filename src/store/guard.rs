//! An object of a watch decoded on its own, so that one capo cannot read is reported and
//! skipped instead of failing the whole list or watch.
//!
//! kube's `DeserializeGuard` does the same by first building the whole object as a tree
//! of values and then decoding a clone of that tree: for a Pod (managedFields, spec and
//! all) that is most of what a watch event costs capo, although capo keeps a handful of
//! fields. [`Guarded`] keeps the object's JSON text instead (one copy, no tree) and decodes
//! from it — once when it is well-formed, twice (the second time only its metadata) when
//! it is not. The text is taken as it streams by, which needs the watch event's `type`
//! before its `object`: the order the API server writes them in (its WatchEvent struct's
//! field order); lists need nothing of the kind.

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::core::PartialObjectMeta;
use kube::core::error_boundary::InvalidObject;
use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;

/// `Ok` with the object, or `Err` with what was wrong and the object's metadata.
#[derive(Clone, Debug)]
pub struct Guarded<K>(pub Result<K, InvalidObject>);

impl<'de, K: DeserializeOwned + Resource> Deserialize<'de> for Guarded<K> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = Box::<RawValue>::deserialize(d)?;
        match serde_json::from_str::<K>(raw.get()) {
            Ok(object) => Ok(Guarded(Ok(object))),
            Err(error) => {
                let PartialObjectMeta { metadata, .. } =
                    serde_json::from_str::<PartialObjectMeta<K>>(raw.get()).map_err(D::Error::custom)?;
                Ok(Guarded(Err(InvalidObject { error: error.to_string(), metadata })))
            }
        }
    }
}

impl<K: Resource> Resource for Guarded<K> {
    type DynamicType = K::DynamicType;
    type Scope = K::Scope;

    fn kind(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::kind(dt)
    }
    fn group(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::group(dt)
    }
    fn version(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::version(dt)
    }
    fn plural(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::plural(dt)
    }
    fn meta(&self) -> &ObjectMeta {
        self.0.as_ref().map_or_else(|bad| &bad.metadata, K::meta)
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        self.0.as_mut().map_or_else(|bad| &mut bad.metadata, K::meta_mut)
    }
}

#[cfg(test)]
mod tests {
    use kube::core::ObjectList;
    use kube::core::WatchEvent;

    use super::*;
    use crate::pod::TrimmedPod;

    #[test]
    fn a_watch_event_decodes_from_its_text() {
        let line = r#"{"type":"MODIFIED","object":{"apiVersion":"v1","kind":"Pod","metadata":{"name":"redis-0","namespace":"shop","uid":"u1","resourceVersion":"7","managedFields":[{"manager":"x"}]},"spec":{"containers":[{"name":"c"}]},"status":{"podIPs":[{"ip":"10.0.0.1"}]}}}"#;
        let WatchEvent::Modified(Guarded(Ok(pod))) =
            serde_json::from_str::<WatchEvent<Guarded<TrimmedPod>>>(line).unwrap()
        else {
            panic!("not a decoded Modified event")
        };
        assert_eq!(pod.facts.name, "redis-0");
        assert_eq!(pod.facts.ips, vec!["10.0.0.1".parse::<std::net::IpAddr>().unwrap()]);
        assert_eq!(pod.metadata.resource_version.as_deref(), Some("7"));
    }

    #[test]
    fn one_bad_object_of_a_list_keeps_its_metadata_and_the_rest_decode() {
        let list = r#"{"apiVersion":"capo.io/v1alpha1","kind":"CapoPolicyList","metadata":{"resourceVersion":"9"},"items":[
            {"apiVersion":"capo.io/v1alpha1","kind":"CapoPolicy","metadata":{"name":"bad"},"spec":{"reserveFor":17}},
            {"apiVersion":"capo.io/v1alpha1","kind":"CapoPolicy","metadata":{"name":"good"},"spec":{"podSelector":{}}}]}"#;
        let list: ObjectList<Guarded<capo_api::CapoPolicy>> = serde_json::from_str(list).unwrap();
        let Err(bad) = &list.items[0].0 else { panic!("the bad policy decoded") };
        assert_eq!(bad.metadata.name.as_deref(), Some("bad"));
        assert!(bad.error.contains("reserveFor") || bad.error.contains("invalid type"), "{}", bad.error);
        assert_eq!(list.items[1].meta().name.as_deref(), Some("good"));
        assert!(list.items[1].0.is_ok());
    }

    #[test]
    fn an_object_without_readable_metadata_fails_the_event_with_a_clear_error() {
        let line = r#"{"type":"ADDED","object":{"metadata":"not an object"}}"#;
        let err = serde_json::from_str::<WatchEvent<Guarded<capo_api::CapoPolicy>>>(line).expect_err("an error");
        assert!(err.to_string().contains("metadata") || err.to_string().contains("invalid type"), "{err}");
    }
}
