//! Which objects leave a tier under pressure.
//!
//! `Lru` evicts least recently used first. `PrefixAware` looks at a window of the least recently
//! used candidates and evicts the deepest of them first (the depth hint given at put: a page's
//! position in its prefix), so pages that many prefixes share (shallow ones) survive longer than
//! the tails that only one request reaches.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::str::FromStr;

/// Eviction policy of a tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictionPolicy {
    /// Least recently used first.
    Lru,
    /// The deepest of the `window` least recently used candidates first.
    PrefixAware {
        /// How many of the least recently used objects compete on depth.
        window: usize,
    },
}

impl Default for EvictionPolicy {
    fn default() -> Self {
        EvictionPolicy::PrefixAware { window: 16 }
    }
}

impl FromStr for EvictionPolicy {
    type Err = String;

    /// `lru`, `prefix` (window 16) or `prefix:N`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once(':') {
            None if s == "lru" => Ok(EvictionPolicy::Lru),
            None if s == "prefix" => Ok(EvictionPolicy::default()),
            Some(("prefix", n)) => match n.parse::<usize>() {
                Ok(w) if w >= 1 => Ok(EvictionPolicy::PrefixAware { window: w }),
                _ => Err(format!("bad window {n:?} in {s:?} (expected an integer >= 1)")),
            },
            _ => Err(format!(
                "unknown eviction policy {s:?} (expected lru, prefix or prefix:N)"
            )),
        }
    }
}

/// One object that may be evicted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// The caller's handle of the object.
    pub id: usize,
    /// Logical time of the last access (larger is more recent).
    pub last_access: u64,
    /// Depth hint given at put (larger is deeper in its prefix).
    pub depth: u32,
    /// Bytes freed by evicting it.
    pub bytes: u64,
}

/// Appends to `victims` the ids of candidates to evict, in eviction order, until at least
/// `bytes_to_free` bytes are chosen or the candidates run out. Reorders `candidates`.
pub fn choose_victims(
    candidates: &mut [Candidate],
    policy: EvictionPolicy,
    bytes_to_free: u64,
    victims: &mut Vec<usize>,
) -> u64 {
    candidates.sort_unstable_by_key(|c| (c.last_access, c.id));
    let mut freed = 0u64;
    match policy {
        EvictionPolicy::Lru => {
            for c in candidates.iter() {
                if freed >= bytes_to_free {
                    break;
                }
                victims.push(c.id);
                freed += c.bytes;
            }
        }
        EvictionPolicy::PrefixAware { window } => {
            // Deepest first; among equals the least recently used.
            let mut heap = BinaryHeap::with_capacity(window.max(1));
            let mut next = 0;
            while freed < bytes_to_free {
                while heap.len() < window.max(1) && next < candidates.len() {
                    let c = &candidates[next];
                    heap.push((c.depth, Reverse(c.last_access), Reverse(next)));
                    next += 1;
                }
                let Some((_, _, Reverse(i))) = heap.pop() else { break };
                victims.push(candidates[i].id);
                freed += candidates[i].bytes;
            }
        }
    }
    freed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cands(spec: &[(u64, u32)]) -> Vec<Candidate> {
        spec.iter()
            .enumerate()
            .map(|(id, &(last_access, depth))| Candidate {
                id,
                last_access,
                depth,
                bytes: 10,
            })
            .collect()
    }

    #[test]
    fn lru_evicts_oldest_first() {
        let mut c = cands(&[(5, 0), (1, 9), (3, 0), (2, 0)]);
        let mut v = Vec::new();
        assert_eq!(choose_victims(&mut c, EvictionPolicy::Lru, 30, &mut v), 30);
        assert_eq!(v, vec![1, 3, 2]);
    }

    #[test]
    fn prefix_aware_evicts_deepest_of_the_oldest_window() {
        // The window holds the 4 least recently used: ids 0..4, where depth decides. Id 5 is the
        // deepest of all but the most recent: it only competes once evictions slide the window.
        let mut c = cands(&[(1, 0), (2, 3), (3, 1), (4, 2), (10, 0), (11, 99)]);
        let mut v = Vec::new();
        choose_victims(&mut c, EvictionPolicy::PrefixAware { window: 4 }, 20, &mut v);
        assert_eq!(v, vec![1, 3]);
        // Two evictions slid ids 4 and 5 into the window; 5 is deepest, then 2; shallow 0 and 4
        // (the shared prefix) go last, oldest first.
        let mut c = cands(&[(1, 0), (2, 3), (3, 1), (4, 2), (10, 0), (11, 99)]);
        v.clear();
        choose_victims(&mut c, EvictionPolicy::PrefixAware { window: 4 }, 60, &mut v);
        assert_eq!(v, vec![1, 3, 5, 2, 0, 4]);
    }

    #[test]
    fn window_one_is_lru() {
        let mut a = cands(&[(5, 1), (1, 9), (3, 0), (2, 4)]);
        let mut b = a.clone();
        let (mut va, mut vb) = (Vec::new(), Vec::new());
        choose_victims(&mut a, EvictionPolicy::PrefixAware { window: 1 }, 40, &mut va);
        choose_victims(&mut b, EvictionPolicy::Lru, 40, &mut vb);
        assert_eq!(va, vb);
    }

    #[test]
    fn parses_policies_and_rejects_others() {
        assert_eq!("lru".parse::<EvictionPolicy>(), Ok(EvictionPolicy::Lru));
        assert_eq!(
            "prefix:8".parse::<EvictionPolicy>(),
            Ok(EvictionPolicy::PrefixAware { window: 8 })
        );
        for bad in ["", "LRU", "prefix:0", "prefix:x", "fifo"] {
            assert!(bad.parse::<EvictionPolicy>().is_err(), "{bad}");
        }
    }
}
