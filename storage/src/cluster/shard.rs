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

    /// Indexes `keys` as owned by `owner` (a later publication of a key wins, as a later put does).
    pub(crate) fn publish<'k>(&self, owner: &str, keys: impl IntoIterator<Item = &'k str>) {
        let mut e = self.entries.write();
        let owner = e.intern(owner);
        for k in keys {
            match e.keys.get_mut(k) {
                Some(o) => *o = owner.clone(),
                None => {
                    e.keys.insert(k.to_owned(), owner.clone());
                }
            }
        }
    }

    /// Forgets those of `keys` that `owner` still owns here (a newer owner's entry stays).
    pub(crate) fn unpublish<'k>(&self, owner: &str, keys: impl IntoIterator<Item = &'k str>) {
        let mut e = self.entries.write();
        for k in keys {
            if e.keys.get(k).is_some_and(|o| **o == *owner) {
                e.keys.remove(k);
            }
        }
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
        e.keys.retain(|k, owner| {
            live.contains(&**owner) && rendezvous::indexes(rendezvous::stable_hash(k.as_bytes()), members, me)
        });
        let Entries { keys, names } = &mut *e;
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
        s.publish("a", ["k1", "k2"]);
        s.publish("b", ["k2"]);
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
        s.publish("a", by_a.iter().copied());
        s.publish("b", by_b.iter().copied());
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
