//! Page allocator of the DRAM arena: free runs of pages, best fit, neighbours merged on free.
//!
//! An object gets one run of pages when one is free (so its ranges coalesce in a copy plan);
//! under fragmentation it gets a few runs, largest first, up to a caller-given limit.

use std::collections::{BTreeMap, BTreeSet};

/// A run of pages: `pages` pages starting at page `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct PageRun {
    /// First page.
    pub start: u32,
    /// Number of pages (never zero).
    pub pages: u32,
}

/// Free-run bookkeeping of an arena of `total` pages.
#[derive(Debug)]
pub struct PageAllocator {
    total: u32,
    free: u32,
    by_start: BTreeMap<u32, u32>,
    by_size: BTreeSet<(u32, u32)>,
}

impl PageAllocator {
    /// An allocator with every one of `total` pages free.
    pub fn new(total: u32) -> Self {
        let mut a = PageAllocator {
            total,
            free: 0,
            by_start: BTreeMap::new(),
            by_size: BTreeSet::new(),
        };
        if total > 0 {
            a.insert_free(0, total);
        }
        a
    }

    /// Pages in the arena.
    pub fn total_pages(&self) -> u32 {
        self.total
    }

    /// Pages free.
    pub fn free_pages(&self) -> u32 {
        self.free
    }

    /// The largest free run, in pages.
    pub fn largest_free_run(&self) -> u32 {
        self.by_size.iter().next_back().map_or(0, |&(n, _)| n)
    }

    fn insert_free(&mut self, start: u32, pages: u32) {
        self.by_start.insert(start, pages);
        self.by_size.insert((pages, start));
        self.free += pages;
    }

    fn remove_free(&mut self, start: u32, pages: u32) {
        self.by_start.remove(&start);
        self.by_size.remove(&(pages, start));
        self.free -= pages;
    }

    /// Allocates `pages` pages as at most `max_runs` runs: one run (the smallest free run that
    /// fits) when possible, else the largest free runs. `None` (and nothing taken) when that is
    /// not possible.
    pub fn allocate(&mut self, pages: u32, max_runs: usize, out: &mut Vec<PageRun>) -> bool {
        out.clear();
        if pages == 0 || pages > self.free || max_runs == 0 {
            return false;
        }
        if let Some(&(size, start)) = self.by_size.range((pages, 0)..).next() {
            self.remove_free(start, size);
            if size > pages {
                self.insert_free(start + pages, size - pages);
            }
            out.push(PageRun { start, pages });
            return true;
        }
        // Fragmented: check that the largest `max_runs` runs suffice before taking any.
        let mut enough = 0u64;
        for &(size, _) in self.by_size.iter().rev().take(max_runs) {
            enough += size as u64;
        }
        if enough < pages as u64 {
            return false;
        }
        let mut left = pages;
        while left > 0 {
            let &(size, start) = self.by_size.iter().next_back().expect("checked above");
            self.remove_free(start, size);
            let take = size.min(left);
            if size > take {
                self.insert_free(start + take, size - take);
            }
            out.push(PageRun { start, pages: take });
            left -= take;
        }
        out.sort_unstable_by_key(|r| r.start);
        true
    }

    /// Returns a run allocated earlier, merging it with free neighbours.
    pub fn free(&mut self, run: PageRun) {
        debug_assert!(run.pages > 0 && run.start as u64 + run.pages as u64 <= self.total as u64);
        let mut start = run.start;
        let mut pages = run.pages;
        if let Some((&ps, &pn)) = self.by_start.range(..start).next_back() {
            if ps + pn == start {
                self.remove_free(ps, pn);
                start = ps;
                pages += pn;
            }
        }
        let end = start + pages;
        if let Some(&nn) = self.by_start.get(&end) {
            self.remove_free(end, nn);
            pages += nn;
        }
        self.insert_free(start, pages);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn best_fit_then_fragmented_then_merge() {
        let mut a = PageAllocator::new(10);
        let mut out = Vec::new();
        assert!(a.allocate(3, 1, &mut out));
        let first = out[0];
        assert!(a.allocate(3, 1, &mut out));
        let second = out[0];
        assert!(a.allocate(4, 1, &mut out));
        let third = out[0];
        assert_eq!(a.free_pages(), 0);
        a.free(first);
        a.free(third);
        // 3 + 4 free but not contiguous: one run cannot hold 5, two can.
        assert!(!a.allocate(5, 1, &mut out));
        assert_eq!(a.free_pages(), 7);
        assert!(a.allocate(5, 2, &mut out));
        assert_eq!(out.iter().map(|r| r.pages).sum::<u32>(), 5);
        for r in out.clone() {
            a.free(r);
        }
        a.free(second);
        assert_eq!(a.largest_free_run(), 10);
    }

    proptest! {
        /// Live runs never overlap, stay in the arena, and the free count always equals the arena
        /// minus the live pages; freeing everything leaves one run of the whole arena.
        #[test]
        fn runs_are_disjoint_and_accounted(ops in proptest::collection::vec((any::<bool>(), 1u32..20, 1usize..4, any::<u16>()), 1..200)) {
            let total = 128u32;
            let mut a = PageAllocator::new(total);
            let mut live: Vec<Vec<PageRun>> = Vec::new();
            let mut out = Vec::new();
            for (alloc, pages, max_runs, pick) in ops {
                if alloc || live.is_empty() {
                    let before = a.free_pages();
                    if a.allocate(pages, max_runs, &mut out) {
                        prop_assert!(out.len() <= max_runs);
                        prop_assert_eq!(out.iter().map(|r| r.pages).sum::<u32>(), pages);
                        prop_assert_eq!(a.free_pages(), before - pages);
                        live.push(out.clone());
                    } else {
                        prop_assert_eq!(a.free_pages(), before);
                    }
                } else {
                    let obj = live.swap_remove(pick as usize % live.len());
                    for r in obj { a.free(r); }
                }
                let mut used = vec![false; total as usize];
                let mut used_count = 0;
                for r in live.iter().flatten() {
                    prop_assert!(r.pages > 0 && r.start + r.pages <= total);
                    for p in r.start..r.start + r.pages {
                        prop_assert!(!used[p as usize], "page {} allocated twice", p);
                        used[p as usize] = true;
                        used_count += 1;
                    }
                }
                prop_assert_eq!(a.free_pages(), total - used_count);
            }
            for r in live.into_iter().flatten() { a.free(r); }
            prop_assert_eq!(a.largest_free_run(), total);
        }
    }
}
