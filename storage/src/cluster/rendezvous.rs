//! Which peers index a key: rendezvous (highest-random-weight) hashing over the live membership.
//!
//! A key's directory peers are the [`REPLICAS`] members with the highest weight
//! `mix(hash(key) ^ hash(member))`. Every peer computes the same answer from the same
//! membership without asking anyone, and a join or a leave moves only the keys whose top set
//! the changed member enters or leaves (about `REPLICAS / N` of them).
//!
//! The hash is ours, not `std`'s or a crate's default hasher: every peer of a cluster, whatever
//! build it runs, must weigh a key the same, so it is fixed here (CRC-32C of the bytes, seeded
//! twice for 64 bits, then the SplitMix64 finaliser to spread it).

use std::sync::Arc;

/// How many peers index each key. A put is acknowledged once a majority of them took it
/// ([`write_quorum`]) and a lookup believes the newest entry among as many as make every lookup
/// meet every acknowledged put ([`read_quorum`]): with three, one silent or frozen directory
/// peer costs neither puts nor lookups, and two puts that each missed a different one are still
/// ordered (docs/umbp.md, "the last acknowledged write wins").
pub(crate) const REPLICAS: usize = 3;

/// How many of a key's `n` directory peers must take a put before it is acknowledged.
pub(crate) fn write_quorum(n: usize) -> usize {
    n / 2 + 1
}

/// How many of a key's `n` directory peers a lookup must hear from: with the write quorum,
/// more than `n`, so the two sets share at least one peer.
pub(crate) fn read_quorum(n: usize) -> usize {
    (n + 1).saturating_sub(write_quorum(n)).max(1)
}

/// 64-bit hash of `bytes`, stable across builds and machines.
pub(crate) fn stable_hash(bytes: &[u8]) -> u64 {
    let lo = crc32c::crc32c(bytes) as u64;
    let hi = crc32c::crc32c_append(0x9e37_79b9, bytes) as u64;
    mix(lo | (hi << 32))
}

/// SplitMix64's finaliser: every input bit affects every output bit.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A live member with its name's hash, computed once per membership change.
#[derive(Clone, Debug)]
pub(crate) struct Member {
    pub(crate) name: Arc<str>,
    hash: u64,
}

impl Member {
    pub(crate) fn new(name: Arc<str>) -> Member {
        let hash = stable_hash(name.as_bytes());
        Member { name, hash }
    }
}

/// The directory peers of the key hashed to `key_hash`, highest weight first (fewer than
/// [`REPLICAS`] when the membership is smaller). One pass over the members, no allocation.
pub(crate) fn top(key_hash: u64, members: &[Member]) -> [Option<&Member>; REPLICAS] {
    let mut best: [Option<(u64, &Member)>; REPLICAS] = [None; REPLICAS];
    for m in members {
        // Ties (vanishingly rare) break by name, so every peer still agrees.
        let w = mix(key_hash ^ m.hash);
        let beats = |b: &Option<(u64, &Member)>| match b {
            None => true,
            Some((bw, bm)) => (w, &*m.name) > (*bw, &*bm.name),
        };
        if let Some(at) = best.iter().position(beats) {
            best.copy_within(at..REPLICAS - 1, at + 1);
            best[at] = Some((w, m));
        }
    }
    best.map(|b| b.map(|(_, m)| m))
}

/// Whether `name` is one of the directory peers of `key_hash`.
pub(crate) fn indexes(key_hash: u64, members: &[Member], name: &str) -> bool {
    top(key_hash, members).iter().flatten().any(|m| &*m.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn members(n: usize) -> Vec<Member> {
        (0..n).map(|i| Member::new(Arc::from(format!("peer-{i}")))).collect()
    }

    fn names(t: [Option<&Member>; REPLICAS]) -> Vec<String> {
        t.iter().flatten().map(|m| m.name.to_string()).collect()
    }

    #[test]
    fn the_hash_is_fixed_across_builds() {
        // Peers of one cluster may run different builds: these values must never change.
        // Checked against an independent implementation (CRC-32C bit by bit, SplitMix64).
        assert_eq!(stable_hash(b""), 0x1dce_f434_3272_1bcb);
        assert_eq!(stable_hash(b"page/0"), 0xc630_da92_95cd_7418);
        assert_ne!(stable_hash(b"page/0"), stable_hash(b"page/1"));
        let crc = crc32c::crc32c(b"123456789");
        assert_eq!(crc, 0xe306_9283, "CRC-32C check value");
    }

    #[test]
    fn small_memberships_give_every_member() {
        assert_eq!(names(top(7, &[])), Vec::<String>::new());
        assert_eq!(names(top(7, &members(1))), ["peer-0"]);
        let mut two = names(top(7, &members(2)));
        two.sort();
        assert_eq!(two, ["peer-0", "peer-1"]);
    }

    #[test]
    fn every_write_quorum_meets_every_read_quorum() {
        for n in 1..=REPLICAS {
            assert!(write_quorum(n) + read_quorum(n) > n, "{n} directory peers");
            assert!(write_quorum(n) <= n && read_quorum(n) >= 1);
        }
        assert_eq!((write_quorum(3), read_quorum(3)), (2, 2));
        assert_eq!((write_quorum(2), read_quorum(2)), (2, 1));
        assert_eq!((write_quorum(1), read_quorum(1)), (1, 1));
    }

    #[test]
    fn the_top_set_is_the_highest_weights_in_order() {
        let m = members(9);
        for k in 0..500u64 {
            let mut all: Vec<(u64, String)> = m.iter().map(|p| (mix(k ^ p.hash), p.name.to_string())).collect();
            all.sort_by(|a, b| b.cmp(a));
            let want: Vec<String> = all.into_iter().take(REPLICAS).map(|(_, n)| n).collect();
            assert_eq!(names(top(k, &m)), want);
        }
    }

    #[test]
    fn keys_spread_evenly() {
        let m = members(16);
        let mut count = vec![0usize; 16];
        for i in 0..32_000u32 {
            for p in top(stable_hash(format!("k{i}").as_bytes()), &m).iter().flatten() {
                count[m.iter().position(|x| x.name == p.name).unwrap()] += 1;
            }
        }
        // 2,000 x REPLICAS each on average; a binomial's spread is about 70.
        let mean = 2_000 * REPLICAS;
        assert!(count.iter().all(|&c| c.abs_diff(mean) < 400), "{count:?}");
    }

    proptest! {
        #[test]
        fn a_join_moves_only_keys_the_joiner_takes(n in 1usize..40, keys in prop::collection::vec(any::<u64>(), 1..200)) {
            let before = members(n);
            let after = members(n + 1);
            let joiner = &after[n].name;
            for k in keys {
                let old = names(top(k, &before));
                let new = names(top(k, &after));
                // Every member of the new set other than the joiner was in the old one.
                for p in &new {
                    prop_assert!(p == &**joiner || old.contains(p), "{} came from nowhere", p);
                }
                // All but one of the old directory peers still index the key: a write quorum
                // taken before the join meets every read quorum after it.
                let kept = new.iter().filter(|p| old.contains(p)).count();
                prop_assert!(kept + 1 >= old.len().min(REPLICAS), "{} of {:?} kept", kept, old);
            }
        }

        #[test]
        fn a_leave_keeps_one_old_directory_peer(n in 3usize..40, gone in 0usize..40, keys in prop::collection::vec(any::<u64>(), 1..200)) {
            let before = members(n);
            let gone = gone % n;
            let after: Vec<Member> = before.iter().enumerate().filter(|&(i, _)| i != gone).map(|(_, m)| m.clone()).collect();
            for k in keys {
                let old = names(top(k, &before));
                let new = names(top(k, &after));
                prop_assert_eq!(new.len(), REPLICAS.min(n - 1));
                let kept = new.iter().filter(|p| old.contains(p)).count();
                prop_assert!(kept + 1 >= old.len(), "{} of {:?} kept", kept, old);
                if !old.contains(&before[gone].name.to_string()) {
                    prop_assert_eq!(&old, &new, "a key the leaver did not index moved");
                }
            }
        }
    }
}
