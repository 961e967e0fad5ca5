//! The transport's own table of registered regions: sorted by base address, searched by binary
//! search, changed a whole batch at a time and all-or-nothing.

use std::collections::HashSet;

use te_base::{Error, MemoryLocation, RegionId, RegionInfo, RegistrationFailure, Result};

/// One registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub base: u64,
    pub end: u64,
    pub id: RegionId,
    pub location: MemoryLocation,
    pub exported: bool,
    /// `location.is_host()`, kept flat for the data path.
    pub host: bool,
}

impl Entry {
    /// True if `[addr, addr + len)` lies inside the region. Overflow-safe.
    #[inline]
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        let size = self.end - self.base;
        addr >= self.base && len <= size && addr - self.base <= size - len
    }
}

/// Regions sorted by base; they never overlap.
#[derive(Debug, Default)]
pub(crate) struct RegionTable {
    entries: Vec<Entry>,
    ids: HashSet<RegionId>,
}

impl RegionTable {
    /// Number of regions.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The region at position `i`.
    #[inline]
    pub fn get(&self, i: usize) -> Option<&Entry> {
        self.entries.get(i)
    }

    /// Position of the region holding byte `addr`, by binary search.
    #[inline]
    pub fn find(&self, addr: u64) -> Option<usize> {
        let i = self.entries.partition_point(|e| e.base <= addr);
        (i > 0 && addr < self.entries[i - 1].end).then(|| i - 1)
    }

    /// Adds a batch of regions, or none of them: a zero-length, null, overflowing, duplicated or
    /// overlapping item fails the batch with every failure listed.
    pub fn insert_batch(&mut self, regions: &[RegionInfo]) -> Result<()> {
        let mut failures = Vec::new();
        let mut fresh: Vec<(usize, Entry)> = Vec::with_capacity(regions.len());
        let mut batch_ids = HashSet::with_capacity(regions.len());
        for (index, r) in regions.iter().enumerate() {
            let fail = |cause: Error| RegistrationFailure {
                index,
                len: r.len,
                location: r.location.to_string(),
                cause: Box::new(cause),
            };
            if r.len == 0 {
                failures.push(fail(Error::ZeroLength { index }));
                continue;
            }
            if r.base == 0 {
                failures.push(fail(Error::NullAddress));
                continue;
            }
            let Some(end) = r.base.checked_add(r.len) else {
                failures.push(fail(Error::LengthOverflow {
                    addr: r.base,
                    len: r.len,
                }));
                continue;
            };
            if let Some(e) = self.overlapping(r.base, end) {
                failures.push(fail(Error::AlreadyRegistered {
                    addr: r.base,
                    len: r.len,
                    region_base: e.base,
                    region_len: e.end - e.base,
                }));
                continue;
            }
            if self.ids.contains(&r.id) || !batch_ids.insert(r.id) {
                // The same id twice: the engine never reuses one, so this is a forged batch.
                failures.push(fail(Error::AlreadyRegistered {
                    addr: r.base,
                    len: r.len,
                    region_base: r.base,
                    region_len: r.len,
                }));
                continue;
            }
            fresh.push((
                index,
                Entry {
                    base: r.base,
                    end,
                    id: r.id,
                    location: r.location,
                    exported: r.exported,
                    host: r.location.is_host(),
                },
            ));
        }
        // Items of the batch against each other.
        fresh.sort_unstable_by_key(|(_, e)| e.base);
        for w in fresh.windows(2) {
            let ((_, a), (index, b)) = (&w[0], &w[1]);
            if b.base < a.end {
                failures.push(RegistrationFailure {
                    index: *index,
                    len: b.end - b.base,
                    location: b.location.to_string(),
                    cause: Box::new(Error::AlreadyRegistered {
                        addr: b.base,
                        len: b.end - b.base,
                        region_base: a.base,
                        region_len: a.end - a.base,
                    }),
                });
            }
        }
        if !failures.is_empty() {
            failures.sort_by_key(|f| f.index);
            return Err(Error::RegistrationFailed { failures });
        }
        self.ids.extend(fresh.iter().map(|(_, e)| e.id));
        self.entries.extend(fresh.into_iter().map(|(_, e)| e));
        self.entries.sort_unstable_by_key(|e| e.base);
        Ok(())
    }

    /// Removes a batch of regions, or none: each must be registered with the same id and base.
    pub fn remove_batch(&mut self, regions: &[RegionInfo]) -> Result<()> {
        for r in regions {
            let known = self
                .find(r.base)
                .map(|i| &self.entries[i])
                .is_some_and(|e| e.base == r.base && e.id == r.id);
            if !known {
                return Err(Error::Unregistered {
                    addr: r.base,
                    len: r.len,
                });
            }
        }
        let mut gone: Vec<u64> = regions.iter().map(|r| r.base).collect();
        gone.sort_unstable();
        for r in regions {
            self.ids.remove(&r.id);
        }
        self.entries.retain(|e| gone.binary_search(&e.base).is_err());
        Ok(())
    }

    /// Some region overlapping `[base, end)`.
    fn overlapping(&self, base: u64, end: u64) -> Option<&Entry> {
        // The only candidates are the last region starting before `end` (regions are disjoint).
        let i = self.entries.partition_point(|e| e.base < end);
        (i > 0 && self.entries[i - 1].end > base).then(|| &self.entries[i - 1])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(id: u64, base: u64, len: u64) -> RegionInfo {
        RegionInfo {
            id: RegionId(id),
            base,
            len,
            location: MemoryLocation::HOST,
            exported: true,
        }
    }

    #[test]
    fn finds_by_binary_search() {
        let mut t = RegionTable::default();
        t.insert_batch(&[region(2, 0x3000, 0x1000), region(1, 0x1000, 0x1000)])
            .unwrap();
        assert_eq!(t.find(0x1000), Some(0));
        assert_eq!(t.find(0x1fff), Some(0));
        assert_eq!(t.find(0x2000), None);
        assert_eq!(t.find(0x3800), Some(1));
        assert_eq!(t.find(0xfff), None);
        assert!(t.get(0).unwrap().contains(0x1800, 0x800));
        assert!(!t.get(0).unwrap().contains(0x1800, 0x801));
        assert!(!t.get(0).unwrap().contains(0x1800, u64::MAX));
    }

    #[test]
    fn a_bad_item_fails_the_whole_batch() {
        let mut t = RegionTable::default();
        t.insert_batch(&[region(1, 0x1000, 0x1000)]).unwrap();
        let err = t
            .insert_batch(&[
                region(2, 0x8000, 0x100),
                region(3, 0x1800, 0x1000), // overlaps region 1
                region(4, 0x9000, 0),      // zero length
                region(5, 0x8080, 0x10),   // overlaps item 0
                region(6, u64::MAX, 2),    // overflows
                region(1, 0x20000, 1),     // duplicate id
            ])
            .unwrap_err();
        let Error::RegistrationFailed { failures } = err else {
            panic!("{err}")
        };
        let idx: Vec<usize> = failures.iter().map(|f| f.index).collect();
        assert_eq!(idx, vec![1, 2, 3, 4, 5]);
        assert_eq!(t.len(), 1, "nothing of the failed batch stays");
    }

    #[test]
    fn removal_is_all_or_nothing() {
        let mut t = RegionTable::default();
        t.insert_batch(&[region(1, 0x1000, 0x100), region(2, 0x2000, 0x100)])
            .unwrap();
        assert!(t
            .remove_batch(&[region(1, 0x1000, 0x100), region(9, 0x2000, 0x100)])
            .is_err());
        assert_eq!(t.len(), 2);
        t.remove_batch(&[region(2, 0x2000, 0x100)]).unwrap();
        assert_eq!(t.find(0x2000), None);
        assert_eq!(t.find(0x1000), Some(0));
    }
}
