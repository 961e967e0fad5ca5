//! The part of the sharded directory this peer holds: key to owner, for the keys whose
//! rendezvous top set (`rendezvous.rs`) includes this peer, as their owners published them.
//!
//! Pure state, no I/O: the control listener applies PUBLISH, UNPUBLISH and LOOKUP to it, and a
//! membership change prunes what this peer no longer indexes or whose owner left.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use super::rendezvous::{self, Member};

#[derive(Default)]
struct Entries {
    /// Key to owner name.
    keys: HashMap<String, Arc<str>>,
    /// Owner names, one allocation per peer rather than per key.
    names: HashSet<Arc<str>>,
    /// Entries held per owner (capped per source: a member may store only so much here).
    counts: HashMap<Arc<str>, usize>,
}

impl Entries {
    fn intern(&mut self, owner: &str) -> Arc<str> {
        if let Some(n) = self.names.get(owner) {
            return n.clone();
        }
        let n: Arc<str> = Arc::from(owner);
        self.names.insert(n.clone());
        n
    }
}

pub(crate) struct Shard {
    entries: RwLock<Entries>,
    /// When this peer last saw the membership change: until `settle` has passed, owners may
    /// still be re-publishing to it, so an unknown key is not yet known to be unknown.
    changed_at: Mutex<Instant>,
    settle: Duration,
}

impl Shard {
    pub(crate) fn new(settle: Duration) -> Shard {
        Shard {
            entries: RwLock::default(),
            changed_at: Mutex::new(Instant::now()),
            settle,
        }
    }

    /// Indexes `keys` as owned by `owner` (a later publication of a key wins, as a later put
    /// does), while `owner` holds fewer than `cap` entries here; returns how many keys the cap
    /// refused.
    pub(crate) fn publish<'k>(&self, owner: &str, keys: impl IntoIterator<Item = &'k str>, cap: usize) -> usize {
        let mut e = self.entries.write();
        let owner = e.intern(owner);
        let Entries { keys: map, counts, .. } = &mut *e;
        let mut held = counts.get(&owner).copied().unwrap_or(0);
        let mut refused = 0;
        for k in keys {
            match map.get_mut(k) {
                Some(o) if *o == owner => {}
                Some(o) if held < cap => {
                    if let Some(c) = counts.get_mut(&**o) {
                        *c = c.saturating_sub(1);
                    }
                    *o = owner.clone();
                    held += 1;
                }
                None if held < cap => {
                    map.insert(k.to_owned(), owner.clone());
                    held += 1;
                }
                _ => refused += 1,
            }
        }
        counts.insert(owner, held);
        refused
    }

    /// Forgets those of `keys` that `owner` still owns here (a newer owner's entry stays).
    pub(crate) fn unpublish<'k>(&self, owner: &str, keys: impl IntoIterator<Item = &'k str>) {
        let mut e = self.entries.write();
        let Entries { keys: map, counts, .. } = &mut *e;
        let mut removed = 0;
        for k in keys {
            if map.get(k).is_some_and(|o| **o == *owner) {
                map.remove(k);
                removed += 1;
            }
        }
        if let Some(c) = counts.get_mut(owner) {
            *c = c.saturating_sub(removed);
        }
    }

    /// Entries `owner` holds here.
    #[cfg(test)]
    pub(crate) fn held_by(&self, owner: &str) -> usize {
        self.entries.read().counts.get(owner).copied().unwrap_or(0)
    }

    /// The owner of each key, as published here.
    pub(crate) fn lookup<'k>(&self, keys: impl IntoIterator<Item = &'k str>) -> Vec<Option<Arc<str>>> {
        let e = self.entries.read();
        keys.into_iter().map(|k| e.keys.get(k).cloned()).collect()
    }

    /// Whether an unknown key here means the directory does not know it.
    pub(crate) fn settled(&self) -> bool {
        self.changed_at.lock().elapsed() >= self.settle
    }

    /// Entries held.
    pub(crate) fn len(&self) -> usize {
        self.entries.read().keys.len()
    }

    /// After a membership change: drops the entries whose owner is no longer a member (its keys
    /// stop being routed) and those this peer (`me`) no longer indexes (their new directory
    /// peers get them from the owners), and starts a new settling period.
    pub(crate) fn membership_changed(&self, members: &[Member], me: &str) {
        *self.changed_at.lock() = Instant::now();
        let live: HashSet<&str> = members.iter().map(|m| &*m.name).collect();
        let mut e = self.entries.write();
        let Entries { keys, names, counts } = &mut *e;
        counts.clear();
        keys.retain(|k, owner| {
            let keep =
                live.contains(&**owner) && rendezvous::indexes(rendezvous::stable_hash(k.as_bytes()), members, me);
            if keep {
                *counts.entry(owner.clone()).or_default() += 1;
            }
            keep
        });
        names.retain(|n| live.contains(&**n));
        if keys.capacity() > 4 * keys.len().max(1024) {
            keys.shrink_to_fit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(names: &[&str]) -> Vec<Member> {
        names.iter().map(|n| Member::new(Arc::from(*n))).collect()
    }

    #[test]
    fn a_later_owner_wins_and_an_old_owner_cannot_remove_its_entry() {
        let s = Shard::new(Duration::ZERO);
        s.publish("a", ["k1", "k2"], usize::MAX);
        s.publish("b", ["k2"], usize::MAX);
        s.unpublish("a", ["k1", "k2"]);
        let got: Vec<Option<String>> = s
            .lookup(["k1", "k2", "k3"])
            .into_iter()
            .map(|o| o.map(|o| o.to_string()))
            .collect();
        assert_eq!(got, [None, Some("b".into()), None]);
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn entries_per_source_are_capped_and_counted_back_down() {
        let s = Shard::new(Duration::ZERO);
        let keys: Vec<String> = (0..10).map(|i| format!("k{i}")).collect();
        assert_eq!(s.publish("a", keys.iter().map(String::as_str), 4), 6);
        assert_eq!((s.len(), s.held_by("a")), (4, 4));
        // Re-publishing what it holds costs nothing; a takeover counts for the new owner only.
        assert_eq!(s.publish("a", keys[..4].iter().map(String::as_str), 4), 0);
        assert_eq!(s.publish("b", ["k0", "k1"], 4), 0);
        assert_eq!((s.held_by("a"), s.held_by("b")), (2, 2));
        assert_eq!(s.publish("a", keys[4..].iter().map(String::as_str), 4), 4);
        s.unpublish("a", keys.iter().map(String::as_str));
        assert_eq!((s.held_by("a"), s.len()), (0, 2));
    }

    #[test]
    fn a_membership_change_drops_left_owners_and_keys_indexed_elsewhere() {
        let s = Shard::new(Duration::from_secs(3600));
        let all = members(&["me", "a", "b", "c"]);
        let keys: Vec<String> = (0..400).map(|i| format!("k{i}")).collect();
        let mine: Vec<&str> = keys
            .iter()
            .map(String::as_str)
            .filter(|k| rendezvous::indexes(rendezvous::stable_hash(k.as_bytes()), &all, "me"))
            .collect();
        let (by_a, by_b) = mine.split_at(mine.len() / 2);
        s.publish("a", by_a.iter().copied(), usize::MAX);
        s.publish("b", by_b.iter().copied(), usize::MAX);
        assert!(!s.settled());
        // "a" leaves: its keys go; "b"'s stay where "me" still indexes them.
        let after = members(&["me", "b", "c"]);
        s.membership_changed(&after, "me");
        for (k, o) in by_a.iter().zip(s.lookup(by_a.iter().copied())) {
            assert!(o.is_none(), "{k} of a departed owner is still routed");
        }
        let kept = s.lookup(by_b.iter().copied());
        for (k, o) in by_b.iter().zip(kept) {
            let still_mine = rendezvous::indexes(rendezvous::stable_hash(k.as_bytes()), &after, "me");
            assert_eq!(o.is_some(), still_mine, "{k}");
        }
    }
}
