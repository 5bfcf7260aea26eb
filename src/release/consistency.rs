//! Whether a `ReservedIP` may be write input for the leader. Records are objects anyone
//! with write access to them can make; the leader writes an entry back, releases it or
//! counts it against a cap only for a record that is what capo itself writes: named after
//! its address, its `cidr` that one address, its reservation one of its policy's shards,
//! its Calico group one capo knows. Anything else is reported and left alone — a
//! hand-made record with `cidr: 10.0.0.0/8` never reaches a reservation.

use std::net::IpAddr;

use capo_api::CalicoApiGroup;
use capo_api::reserved_ip::{ReservedIP, record_name, single_ip_cidr};

/// What is wrong with a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Inconsistent {
    #[error("spec.ip is not an address in canonical form")]
    Ip,
    #[error("its name is not the one capo gives the record of spec.ip")]
    Name,
    #[error("spec.cidr is not the one address spec.ip")]
    Cidr,
    #[error("spec.reservation is not one of its policy's reservations (capo-<policy>, capo-<policy>.<n>)")]
    Reservation,
    #[error("spec.calicoApiGroup is not a Calico API group capo writes")]
    Group,
}

impl Inconsistent {
    pub fn reason(self) -> &'static str {
        match self {
            Self::Ip => "ip",
            Self::Name => "name",
            Self::Cidr => "cidr",
            Self::Reservation => "reservation",
            Self::Group => "group",
        }
    }
}

/// `Ok` for a record capo could have written.
pub fn check(rec: &ReservedIP) -> Result<(), Inconsistent> {
    let spec = &rec.spec;
    let ip: IpAddr = spec.ip.parse().map_err(|_| Inconsistent::Ip)?;
    if spec.ip != ip.to_string() {
        return Err(Inconsistent::Ip);
    }
    if rec.metadata.name.as_deref() != Some(record_name(ip).as_str()) {
        return Err(Inconsistent::Name);
    }
    if spec.cidr != single_ip_cidr(ip) {
        return Err(Inconsistent::Cidr);
    }
    if spec.calico_api_group.parse::<CalicoApiGroup>().is_err() {
        return Err(Inconsistent::Group);
    }
    if !is_shard_of(&spec.reservation, &spec.policy) {
        return Err(Inconsistent::Reservation);
    }
    Ok(())
}

fn is_shard_of(reservation: &str, policy: &str) -> bool {
    crate::calico::shards::index_of(reservation, policy).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str, ip: &str, cidr: &str, reservation: &str, group: &str) -> ReservedIP {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "capo.io/v1alpha1", "kind": "ReservedIP", "metadata": { "name": name },
            "spec": { "ip": ip, "cidr": cidr, "reservation": reservation, "calicoApiGroup": group, "policy": "p",
                      "pod": { "namespace": "n", "name": "x", "uid": "u" }, "trigger": "Delete",
                      "reservedAt": "2026-01-01T00:00:00.000000Z", "reserveFor": "1h" },
        }))
        .unwrap()
    }

    #[test]
    fn only_what_capo_writes_is_trusted() {
        let v1 = "crd.projectcalico.org/v1";
        assert_eq!(check(&record("10.0.0.1", "10.0.0.1", "10.0.0.1/32", "capo-p", v1)), Ok(()));
        assert_eq!(check(&record("fd00--1", "fd00::1", "fd00::1/128", "capo-p.12", "projectcalico.org/v3")), Ok(()));
        let cases = [
            (record("10.0.0.1", "10.0.0.1", "10.0.0.0/8", "capo-p", v1), Inconsistent::Cidr),
            (record("10.0.0.1", "10.0.0.1", "10.0.0.1/24", "capo-p", v1), Inconsistent::Cidr),
            (record("10.0.0.2", "10.0.0.1", "10.0.0.1/32", "capo-p", v1), Inconsistent::Name),
            (record("10.0.0.1", "10.0.0.01", "10.0.0.1/32", "capo-p", v1), Inconsistent::Ip),
            (record("fd00--1", "FD00::1", "fd00::1/128", "capo-p", v1), Inconsistent::Ip),
            (record("10.0.0.1", "10.0.0.1", "10.0.0.1/32", "capo-other", v1), Inconsistent::Reservation),
            (record("10.0.0.1", "10.0.0.1", "10.0.0.1/32", "default-ipv4-ippool", v1), Inconsistent::Reservation),
            (record("10.0.0.1", "10.0.0.1", "10.0.0.1/32", "capo-p.0", v1), Inconsistent::Reservation),
            (record("10.0.0.1", "10.0.0.1", "10.0.0.1/32", "capo-p.01", v1), Inconsistent::Reservation),
            (record("10.0.0.1", "10.0.0.1", "10.0.0.1/32", "capo-p.10000", v1), Inconsistent::Reservation),
            (record("10.0.0.1", "10.0.0.1", "10.0.0.1/32", "capo-p", "example.com/v1"), Inconsistent::Group),
        ];
        for (rec, want) in cases {
            assert_eq!(check(&rec), Err(want), "{:?}", rec.spec);
        }
    }
}
