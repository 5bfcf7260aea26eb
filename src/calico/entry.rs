//! Entries of a Calico `IPReservation`: capo writes canonical single-address CIDRs
//! (`10.0.0.5/32`, `fd00::5/128`); in its own objects it removes only what is not a CIDR
//! at all, since one such entry makes every Calico IPAM allocation in the cluster fail.

use std::net::IpAddr;

/// The entry capo writes for `ip`.
pub fn canonical(ip: IpAddr) -> String {
    capo_api::reserved_ip::single_ip_cidr(ip)
}

/// The address of an entry in capo's canonical form (`/32` or `/128`, lowercase,
/// shortest), if it is one: only such entries can be capo's holds.
pub fn single_ip(entry: &str) -> Option<IpAddr> {
    let net: ipnet::IpNet = entry.parse().ok()?;
    (net.prefix_len() == net.max_prefix_len() && canonical(net.addr()) == entry).then_some(net.addr())
}

/// Whether Calico can use `entry` as a reserved range: an address, a `/`, and a prefix
/// length that fits the family (host bits may be set, as Calico's own parser allows).
pub fn is_cidr(entry: &str) -> bool {
    let Some((addr, len)) = entry.split_once('/') else { return false };
    let Ok(addr) = addr.parse::<IpAddr>() else { return false };
    let max = if addr.is_ipv4() { 32 } else { 128 };
    !len.is_empty()
        && len.bytes().all(|b| b.is_ascii_digit())
        && len.len() <= 3
        && len.parse::<u8>().is_ok_and(|l| l <= max)
}

/// A JSON pointer segment (RFC 6901).
pub fn pointer_escape(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_entries() {
        assert!(single_ip("10.0.0.1/32").is_some());
        assert!(single_ip("fd00::1/128").is_some());
        for bad in ["10.0.0.1", "10.0.0.0/24", "FD00::1/128", "fd00:0::1/128", "x", "10.0.0.01/32"] {
            assert!(single_ip(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn cidrs_calico_can_use() {
        for good in ["10.0.0.1/32", "10.0.0.0/24", "10.0.0.7/31", "FD00::1/128", "fd00::/64", "0.0.0.0/0"] {
            assert!(is_cidr(good), "{good}");
        }
        for bad in
            ["not-an-ip", "10.0.0.1", "10.0.0.0/33", "fd00::/129", "10.0.0.0/", "10.0.0.0/-1", "/24", "10.0.0.0/2x"]
        {
            assert!(!is_cidr(bad), "{bad}");
        }
    }

    #[test]
    fn pointer_segments() {
        assert_eq!(pointer_escape("app.kubernetes.io/managed-by"), "app.kubernetes.io~1managed-by");
        assert_eq!(pointer_escape("a~b"), "a~0b");
    }
}
