//! How a policy's holds are spread over its capo-owned reservations ("shards"), so that
//! writing one hold costs the same however many the policy holds, and one policy can hold
//! 100,000 IPs although one object fits about 31,000 IPv4 entries.
//!
//! - A policy has `count(maxReserved)` shards, enough that at its cap each holds about
//!   [`AT_CAP`] entries, a quarter of its bound (docs/release.md gives the measurements
//!   behind both numbers).
//! - An entry's home shard is a hash of the entry over that count: every replica picks the
//!   same shard without asking anyone.
//! - A shard that holds [`SHARD_SIZE`] entries or more (by the watched copy), or whose name
//!   is taken by an object that is not this policy's, is skipped for the next one; past
//!   the last, overflow shards follow. So no shard grows past its bound, whatever the
//!   count of holds, and a full shard never refuses a deletion.
//! - During a burst a new entry joins a shard of the policy that has an append in flight
//!   and entries waiting for the next, while that shard holds fewer than [`JOIN_BELOW`]:
//!   the waiting entries go out in one patch, so a storm costs far fewer appends than
//!   holds. Every replica finds an entry wherever it went (the watched copy lists it), so
//!   nothing depends on an entry being in its home shard.
//! - Shard 0 is `capo-<policy>`, the one object earlier versions wrote: their holds stay
//!   where they are and are released from there.

/// The most entries capo puts in one reservation object.
pub const SHARD_SIZE: usize = 2_000;
/// About how many entries each home shard holds when the policy is at its cap: an append
/// to a shard of 500 costs the API server half what one to 2,000 costs, while Calico's
/// AutoAssign lists 100,000 entries in 200 objects within 4 % of 50 objects.
pub const AT_CAP: u32 = 500;
/// A burst's entries join a shard with an append in flight only while it holds fewer than
/// this: joining never makes a shard bigger than a home shard is at the policy's cap, so
/// an append costs what the sizing above promises (docs/release.md).
pub const JOIN_BELOW: usize = AT_CAP as usize;
/// The highest shard index capo uses (overflow included): far more than 100,000 holds need.
pub const MAX_SHARDS: u32 = 9_999;

/// How many home shards a policy with this cap has.
pub fn count(max_reserved: u32) -> u32 {
    (u64::from(max_reserved).div_ceil(u64::from(AT_CAP))).clamp(1, u64::from(MAX_SHARDS)) as u32
}

/// The index of `name` among `policy`'s shards (`capo-<policy>` is 0, `capo-<policy>.<n>`
/// is n), if it is one of them.
pub fn index_of(name: &str, policy: &str) -> Option<u32> {
    if name == capo_api::keys::shard_name(policy, 0) {
        return Some(0);
    }
    let index = name.strip_prefix(&format!("capo-{policy}.")).and_then(|n| n.parse::<u32>().ok())?;
    ((1..=MAX_SHARDS).contains(&index) && capo_api::keys::shard_name(policy, index) == name).then_some(index)
}

/// FNV-1a: stable across processes and versions (unlike the standard library's hasher).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}

/// The home shard of `entry` among `count`.
pub fn home(entry: &str, count: u32) -> u32 {
    (fnv1a(entry.as_bytes()) % u64::from(count.max(1))) as u32
}

/// The shards to try for `entry`, in order: home, the rest of the home shards, then
/// overflow shards.
pub fn probe_order(entry: &str, count: u32) -> impl Iterator<Item = u32> {
    let count = count.clamp(1, MAX_SHARDS);
    let h = home(entry, count);
    (h..count).chain(0..h).chain(count..=MAX_SHARDS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts() {
        assert_eq!(count(1), 1);
        assert_eq!(count(300), 1, "the default cap: one object, as before shards");
        assert_eq!(count(500), 1);
        assert_eq!(count(501), 2);
        assert_eq!(count(12_000), 24);
        assert_eq!(count(100_000), 200);
    }

    #[test]
    fn homes_spread_evenly_and_are_stable() {
        let n = 10;
        let mut per = vec![0usize; n as usize];
        for i in 0..20_000u32 {
            let entry = format!("10.{}.{}.{}/32", i >> 16, (i >> 8) & 0xff, i & 0xff);
            per[home(&entry, n) as usize] += 1;
        }
        assert!(per.iter().all(|&c| (1_800..=2_200).contains(&c)), "{per:?}");
        assert_eq!(home("10.0.0.1/32", 7), home("10.0.0.1/32", 7));
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c, "FNV-1a 64 of \"a\"");
    }

    #[test]
    fn only_the_policys_own_shard_names_have_an_index() {
        assert_eq!(index_of("capo-redis", "redis"), Some(0));
        assert_eq!(index_of("capo-redis.7", "redis"), Some(7));
        assert_eq!(index_of("capo-redis.07", "redis"), None, "not a name capo writes");
        assert_eq!(index_of("capo-redis.0", "redis"), None);
        assert_eq!(index_of("capo-redis.10000", "redis"), None, "past the last shard");
        assert_eq!(index_of("capo-other.1", "redis"), None);
        assert_eq!(index_of("redis", "redis"), None);
    }

    #[test]
    fn probing_visits_every_home_shard_once_then_overflows() {
        let order: Vec<u32> = probe_order("10.0.0.1/32", 4).take(6).collect();
        let mut homes = order[..4].to_vec();
        homes.sort();
        assert_eq!(homes, vec![0, 1, 2, 3]);
        assert_eq!(&order[4..], &[4, 5]);
        assert_eq!(order[0], home("10.0.0.1/32", 4));
    }
}
