//! One rail's view of its address vector: every peer address is inserted into the provider's AV
//! once, however many connected peers use it, and removed once, when the last of them goes.
//!
//! Why: libfabric 2.6's shm provider breaks when one AV holds an address twice. The second
//! `fi_av_insert` of a name returns the same `fi_addr` (util AV use count 2) without counting a new
//! peer, yet every `fi_av_remove` then unmaps the peer's region and decrements the peer count, so
//! two removals drive it to -1 and the next insert divides by zero (`smr_av_insert`:
//! `SMR_MAX_PEERS / smr_map.num_peers`, SIGFPE; `tests/refusal_probe.c` case `av_dup`). Connecting
//! to one segment from two peers at once (the conformance suite's checks overlap that way) did
//! exactly this. Inserts and removals of one rail also run one at a time under this table's lock.

use std::collections::HashMap;

use te_base::Result;

/// A provider address in use (the key it is stored under), and how many connected peers use it.
struct Entry {
    users: usize,
    /// Every address byte string that resolved to this `fi_addr` (a provider may read fewer bytes
    /// than it is handed, so two strings can name one peer).
    names: Vec<Vec<u8>>,
}

/// Reference-counted AV entries of one rail.
#[derive(Default)]
pub(crate) struct AddressTable {
    by_name: HashMap<Vec<u8>, u64>,
    entries: HashMap<u64, Entry>,
}

impl AddressTable {
    /// The `fi_addr` for `name`, calling `insert` only when no connected peer uses it yet.
    pub(crate) fn acquire(&mut self, name: &[u8], insert: impl FnOnce(&[u8]) -> Result<u64>) -> Result<u64> {
        if let Some(&fi_addr) = self.by_name.get(name) {
            if let Some(e) = self.entries.get_mut(&fi_addr) {
                e.users += 1;
                return Ok(fi_addr);
            }
        }
        let fi_addr = insert(name)?;
        self.by_name.insert(name.to_vec(), fi_addr);
        let entry = self.entries.entry(fi_addr).or_insert(Entry {
            users: 0,
            names: Vec::new(),
        });
        // A different byte string the provider took for an address it already holds: count it as
        // one more user of that entry, which is removed from the provider only once.
        entry.users += 1;
        entry.names.push(name.to_vec());
        Ok(fi_addr)
    }

    /// Drops one user of `fi_addr`. Returns true when it was the last: the caller removes the
    /// address from the provider's AV (exactly once per address the provider handed out).
    pub(crate) fn release(&mut self, fi_addr: u64) -> bool {
        let Some(e) = self.entries.get_mut(&fi_addr) else {
            return false;
        };
        e.users -= 1;
        if e.users > 0 {
            return false;
        }
        if let Some(e) = self.entries.remove(&fi_addr) {
            for n in e.names {
                self.by_name.remove(&n);
            }
        }
        true
    }

    /// Addresses currently in the provider's AV.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_provider_insert_and_one_removal_per_address() {
        let mut t = AddressTable::default();
        let mut inserts = 0;
        let mut ins = |_: &[u8]| {
            inserts += 1;
            Ok(7)
        };
        assert_eq!(t.acquire(b"peer-a", &mut ins).unwrap(), 7);
        assert_eq!(t.acquire(b"peer-a", &mut ins).unwrap(), 7);
        assert_eq!(inserts, 1, "the second peer to the same address reuses the entry");
        assert!(!t.release(7), "one user left");
        assert!(t.release(7), "the last user removes it");
        assert!(
            !t.release(7),
            "a second removal of the same address never reaches the provider"
        );
        assert_eq!(t.len(), 0);
        // Connecting again inserts again.
        t.acquire(b"peer-a", |_| Ok(9)).unwrap();
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn two_names_for_one_provider_address_are_removed_once() {
        let mut t = AddressTable::default();
        t.acquire(b"fi_shm://1\0", |_| Ok(3)).unwrap();
        // The provider reads up to the NUL: different bytes, same peer, same fi_addr.
        t.acquire(b"fi_shm://1\0junk", |_| Ok(3)).unwrap();
        assert!(!t.release(3));
        assert!(t.release(3));
        assert_eq!(t.len(), 0);
        assert!(t.by_name.is_empty());
    }

    #[test]
    fn a_failed_insert_leaves_nothing_behind() {
        let mut t = AddressTable::default();
        let e = t.acquire(b"bad", |_| {
            Err(te_base::Error::transport("efa", "fi_av_insert: invalid"))
        });
        assert!(e.is_err());
        assert_eq!(t.len(), 0);
        assert!(t.by_name.is_empty());
    }
}
