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
    /// Key to owner name and the version its owner minted for it (see [`newer`]).
    keys: HashMap<String, (Arc<str>, u64)>,
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

/// Whether version `v` of `owner` supersedes version `w` of `other`: versions compare first
/// (hybrid clocks minted by the writers, `Cluster::mint`), ties break by owner name.
pub(crate) fn newer(v: u64, owner: &str, w: u64, other: &str) -> bool {
    (v, owner) > (w, other)
}

/// What one PUBLISH did: per key [`TAKEN`], [`CAPPED`] or the newer version indexed instead;
/// how many the cap refused; and the entries of other owners it superseded (key, owner,
/// version: their copies are to be retired), with the index of each in the PUBLISH.
#[derive(Debug, Default)]
pub(crate) struct Published {
    pub(crate) taken: Vec<u64>,
    pub(crate) capped: usize,
    pub(crate) superseded: Vec<(String, Arc<str>, u64)>,
    pub(crate) superseded_at: Vec<usize>,
}

/// A published key is indexed now.
pub(crate) const TAKEN: u64 = 0;
/// A published key was refused by the entries-per-source cap.
pub(crate) const CAPPED: u64 = u64::MAX;
/// A published key was not taken: the owner of the entry it would supersede could not be made
/// to drop its copy in time (frozen, cut off, gone), so the older entry stands (the last
/// acknowledged write wins only if no superseded copy is left to read).
pub(crate) const BLOCKED: u64 = u64::MAX - 1;

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

    /// Indexes `keys` (each with the version its owner minted) as owned by `owner` where that
    /// is newer than the entry held (the last acknowledged write wins), while `owner` holds fewer
    /// than `cap` entries here.
    pub(crate) fn publish<'k>(
        &self,
        owner: &str,
        keys: impl IntoIterator<Item = (&'k str, u64)>,
        cap: usize,
    ) -> Published {
        let mut e = self.entries.write();
        let owner = e.intern(owner);
        let Entries { keys: map, counts, .. } = &mut *e;
        let mut held = counts.get(&owner).copied().unwrap_or(0);
        let mut out = Published::default();
        for (j, (k, v)) in keys.into_iter().enumerate() {
            let taken = match map.get_mut(k) {
                // Its own entry: the newest of its versions stands.
                Some((o, w)) if *o == owner => {
                    *w = (*w).max(v);
                    TAKEN
                }
                // Never 0 (TAKEN): a version is at least 1 once minted; 0 only for keys found in
                // an SSD log, which any write supersedes.
                Some((o, w)) if !newer(v, &owner, *w, o) => (*w).max(1),
                Some(_) | None if held >= cap => {
                    out.capped += 1;
                    CAPPED
                }
                Some((o, w)) => {
                    if let Some(c) = counts.get_mut(&**o) {
                        *c = c.saturating_sub(1);
                    }
                    out.superseded.push((k.to_owned(), o.clone(), *w));
                    out.superseded_at.push(j);
                    (*o, *w) = (owner.clone(), v);
                    held += 1;
                    TAKEN
                }
                None => {
                    map.insert(k.to_owned(), (owner.clone(), v));
                    held += 1;
                    TAKEN
                }
            };
            out.taken.push(taken);
        }
        counts.insert(owner, held);
        out
    }

    /// Puts back the superseded entries `back` (key, older owner, its version) where `owner`'s
    /// entry of `version` still stands: their older owners could not retire their copies, so
    /// `owner`'s write of those keys is not taken here.
    pub(crate) fn revert(&self, owner: &str, version: impl Fn(&str) -> u64, back: &[(String, Arc<str>, u64)]) {
        let mut e = self.entries.write();
        let Entries { keys: map, counts, .. } = &mut *e;
        for (k, old, w) in back {
            let Some((o, v)) = map.get_mut(k.as_str()) else {
                continue;
            };
            if **o != *owner || *v != version(k) {
                continue;
            }
            if let Some(c) = counts.get_mut(owner) {
                *c = c.saturating_sub(1);
            }
            *counts.entry(old.clone()).or_default() += 1;
            (*o, *v) = (old.clone(), *w);
        }
    }

    /// The owner and version of `key` here (tests).
    #[cfg(test)]
    pub(crate) fn entry(&self, key: &str) -> Option<(String, u64)> {
        self.entries.read().keys.get(key).map(|(o, v)| (o.to_string(), *v))
    }

    /// Forgets those of `keys` that `owner` still owns here (a newer owner's entry stays).
    pub(crate) fn unpublish<'k>(&self, owner: &str, keys: impl IntoIterator<Item = &'k str>) {
        let mut e = self.entries.write();
        let Entries { keys: map, counts, .. } = &mut *e;
        let mut removed = 0;
        for k in keys {
            if map.get(k).is_some_and(|(o, _)| **o == *owner) {
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

    /// The owner of each key and the version it published, as indexed here.
    pub(crate) fn lookup<'k>(&self, keys: impl IntoIterator<Item = &'k str>) -> Vec<Option<(Arc<str>, u64)>> {
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
        keys.retain(|k, (owner, _)| {
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
        s.publish("a", [("k1", 1), ("k2", 1)], usize::MAX);
        s.publish("b", [("k2", 2)], usize::MAX);
        s.unpublish("a", ["k1", "k2"]);
        let got: Vec<Option<String>> = s
            .lookup(["k1", "k2", "k3"])
            .into_iter()
            .map(|o| o.map(|(o, _)| o.to_string()))
            .collect();
        assert_eq!(got, [None, Some("b".into()), None]);
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn the_newest_version_wins_whatever_the_order_it_arrives_in() {
        let s = Shard::new(Duration::ZERO);
        let owner = |k| s.lookup([k]).pop().flatten().map(|(o, _)| o.to_string());
        let p = s.publish("q1", [("k", 20)], usize::MAX);
        assert_eq!((p.taken, p.superseded.len()), (vec![TAKEN], 0));
        // An older version of another owner arrives late: refused with the newer version,
        // nothing retired.
        let p = s.publish("q0", [("k", 10)], usize::MAX);
        assert_eq!((p.taken, p.superseded.len()), (vec![20], 0));
        assert_eq!(owner("k").as_deref(), Some("q1"));
        // A newer one supersedes q1's entry, which is reported for retirement.
        let p = s.publish("q0", [("k", 30)], usize::MAX);
        assert_eq!(p.taken, [TAKEN]);
        assert_eq!(p.superseded.len(), 1);
        assert_eq!((&*p.superseded[0].1, p.superseded[0].2), ("q1", 20));
        assert_eq!(owner("k").as_deref(), Some("q0"));
        // Equal versions break by owner name.
        assert!(newer(5, "b", 5, "a") && !newer(5, "a", 5, "b"));
    }

    #[test]
    fn a_reverted_supersession_puts_the_older_entry_back() {
        let s = Shard::new(Duration::ZERO);
        s.publish("q0", [("k", 10), ("j", 10)], usize::MAX);
        let p = s.publish("q1", [("j", 5), ("k", 20)], usize::MAX);
        assert_eq!(p.superseded_at, [1]);
        s.revert("q1", |_| 20, &p.superseded);
        assert_eq!(s.entry("k"), Some(("q0".into(), 10)));
        assert_eq!((s.held_by("q0"), s.held_by("q1")), (2, 0));
        // Superseded again meanwhile by a newer write: that one stays.
        let p = s.publish("q1", [("k", 30)], usize::MAX);
        s.publish("q1", [("k", 40)], usize::MAX);
        s.revert("q1", |_| 30, &p.superseded);
        assert_eq!(s.entry("k"), Some(("q1".into(), 40)));
    }

    #[test]
    fn entries_per_source_are_capped_and_counted_back_down() {
        let s = Shard::new(Duration::ZERO);
        let keys: Vec<String> = (0..10).map(|i| format!("k{i}")).collect();
        let v1 = |ks: &'static [String]| ks.iter().map(|k| (k.as_str(), 1));
        let keys: &'static [String] = keys.leak();
        assert_eq!(s.publish("a", v1(keys), 4).capped, 6);
        assert_eq!((s.len(), s.held_by("a")), (4, 4));
        // Re-publishing what it holds costs nothing; a takeover counts for the new owner only.
        assert_eq!(s.publish("a", v1(&keys[..4]), 4).capped, 0);
        let p = s.publish("b", [("k0", 2), ("k1", 2)], 4);
        assert_eq!((p.capped, p.superseded.len()), (0, 2));
        assert_eq!((s.held_by("a"), s.held_by("b")), (2, 2));
        assert_eq!(s.publish("a", v1(&keys[4..]), 4).capped, 4);
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
        s.publish("a", by_a.iter().map(|k| (*k, 1)), usize::MAX);
        s.publish("b", by_b.iter().map(|k| (*k, 1)), usize::MAX);
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
