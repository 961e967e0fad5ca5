//! Planning a batch: coalesce exactly adjacent fragments into single copies and detect batches
//! whose requests touch the same memory.
//!
//! Fragments are ordered by destination address. That groups them by (source region, destination
//! region) as the seed's plan does — a destination region is one address range, and a fragment only
//! joins the previous copy when its source continues the previous source too — and it makes
//! overlapping destinations adjacent, so one pass both coalesces and finds write-write overlap.
//! Reads that overlap writes are found by comparing the address span of all sources with that of
//! all destinations, and only when the spans meet, by a sorted sweep.

/// One request resolved to addresses in this process, before planning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fragment {
    /// First destination byte.
    pub dst: u64,
    /// First source byte.
    pub src: u64,
    /// Bytes (never zero).
    pub len: u64,
    /// The request's index in its batch.
    pub index: u32,
}

/// One copy after coalescing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    /// First destination byte.
    pub dst: u64,
    /// First source byte.
    pub src: u64,
    /// Bytes.
    pub len: u64,
}

/// The result of [`coalesce`] when the batch is safe to run as independent copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coalesced {
    /// Bytes over all copies.
    pub total_bytes: u64,
}

/// Two requests of the batch write the same destination bytes, or one reads bytes another writes.
/// Such a batch must run request by request (see [`crate::peer`]), never as parallel copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overlap;

/// Running address spans of a batch's sources and destinations, kept while resolving so the
/// common case (sources and destinations in disjoint memory) is proven with four comparisons.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spans {
    src_lo: u64,
    src_hi: u64,
    dst_lo: u64,
    dst_hi: u64,
}

impl Default for Spans {
    fn default() -> Self {
        Spans {
            src_lo: u64::MAX,
            src_hi: 0,
            dst_lo: u64::MAX,
            dst_hi: 0,
        }
    }
}

impl Spans {
    /// Widens the spans by `f` (whose ends do not overflow: they were checked against a region).
    #[inline]
    pub fn add(&mut self, f: &Fragment) {
        self.src_lo = self.src_lo.min(f.src);
        self.src_hi = self.src_hi.max(f.src + f.len);
        self.dst_lo = self.dst_lo.min(f.dst);
        self.dst_hi = self.dst_hi.max(f.dst + f.len);
    }

    /// True when some source might overlap some destination.
    #[inline]
    pub fn may_overlap(&self) -> bool {
        self.src_lo < self.dst_hi && self.dst_lo < self.src_hi
    }
}

/// Sorts `frags` by destination, checks that no two destinations overlap, and writes the
/// coalesced copies to `ops` (cleared first). Two fragments merge only when both their sources and
/// their destinations are contiguous, so every byte lands exactly where its request said.
///
/// Does not check sources against destinations; see [`sources_meet_destinations`].
pub fn coalesce(frags: &mut [Fragment], ops: &mut Vec<CopyOp>) -> Result<Coalesced, Overlap> {
    ops.clear();
    if frags.is_empty() {
        return Ok(Coalesced { total_bytes: 0 });
    }
    if !frags.is_sorted_by_key(|f| f.dst) {
        frags.sort_unstable_by_key(|f| f.dst);
    }
    ops.reserve(frags.len());
    let mut total = 0u64;
    let mut cur = CopyOp {
        dst: frags[0].dst,
        src: frags[0].src,
        len: frags[0].len,
    };
    for f in &frags[1..] {
        let cur_end = cur.dst + cur.len;
        if f.dst < cur_end {
            return Err(Overlap);
        }
        if f.dst == cur_end && f.src == cur.src + cur.len {
            cur.len += f.len;
        } else {
            total += cur.len;
            ops.push(cur);
            cur = CopyOp {
                dst: f.dst,
                src: f.src,
                len: f.len,
            };
        }
    }
    total += cur.len;
    ops.push(cur);
    Ok(Coalesced { total_bytes: total })
}

/// True when some fragment's source range overlaps some fragment's destination range.
///
/// `frags` must be sorted by destination with non-overlapping destinations (as [`coalesce`] leaves
/// them); `scratch` is reused for the sorted sources. O(n log n); only called when the spans of
/// sources and destinations meet.
pub fn sources_meet_destinations(frags: &[Fragment], scratch: &mut Vec<(u64, u64)>) -> bool {
    scratch.clear();
    scratch.extend(frags.iter().map(|f| (f.src, f.src + f.len)));
    scratch.sort_unstable();
    let mut d = 0;
    for &(start, end) in scratch.iter() {
        // Destinations are disjoint and sorted, so one that ends before this source starts ends
        // before every later source starts too.
        while d < frags.len() && frags[d].dst + frags[d].len <= start {
            d += 1;
        }
        if d < frags.len() && frags[d].dst < end {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frag(dst: u64, src: u64, len: u64, index: u32) -> Fragment {
        Fragment { dst, src, len, index }
    }

    #[test]
    fn adjacent_fragments_merge_only_when_both_sides_continue() {
        let mut frags = vec![
            frag(1100, 5100, 100, 1),
            frag(1000, 5000, 100, 0),
            frag(1200, 9000, 100, 2), // destination continues, source does not
            frag(1300, 9100, 50, 3),
            frag(2000, 9150, 10, 4), // source continues, destination does not
        ];
        let mut ops = Vec::new();
        let c = coalesce(&mut frags, &mut ops).unwrap();
        assert_eq!(c.total_bytes, 360);
        assert_eq!(
            ops,
            vec![
                CopyOp {
                    dst: 1000,
                    src: 5000,
                    len: 200
                },
                CopyOp {
                    dst: 1200,
                    src: 9000,
                    len: 150
                },
                CopyOp {
                    dst: 2000,
                    src: 9150,
                    len: 10
                },
            ]
        );
    }

    #[test]
    fn overlapping_destinations_are_reported() {
        let mut ops = Vec::new();
        assert_eq!(
            coalesce(&mut [frag(10, 0, 5, 0), frag(14, 100, 5, 1)], &mut ops),
            Err(Overlap)
        );
        assert_eq!(
            coalesce(&mut [frag(10, 0, 5, 0), frag(10, 100, 1, 1)], &mut ops),
            Err(Overlap)
        );
        assert!(coalesce(&mut [frag(10, 0, 5, 0), frag(15, 100, 1, 1)], &mut ops).is_ok());
        assert_eq!(coalesce(&mut [], &mut ops), Ok(Coalesced { total_bytes: 0 }));
        assert!(ops.is_empty());
    }

    #[test]
    fn sources_against_destinations() {
        let mut scratch = Vec::new();
        // Disjoint, interleaved.
        let frags = [frag(100, 50, 50, 0), frag(300, 200, 100, 1)];
        assert!(!sources_meet_destinations(&frags, &mut scratch));
        // A source reaching one byte into a destination.
        let frags = [frag(100, 51, 50, 0), frag(300, 200, 100, 1)];
        assert!(sources_meet_destinations(&frags, &mut scratch));
        // A request copying onto itself.
        assert!(sources_meet_destinations(&[frag(100, 100, 1, 0)], &mut scratch));
    }

    /// A batch of fragments with random sizes placed at random, non-overlapping destination slots
    /// and random sources; a share of them laid out contiguously so coalescing has work to do.
    fn batch() -> impl Strategy<Value = Vec<Fragment>> {
        prop::collection::vec((1u64..300, any::<bool>(), any::<bool>(), 0u64..64), 0..120).prop_map(|items| {
            let mut out = Vec::new();
            let (mut dst, mut src) = (1u64 << 20, 1u64 << 30);
            for (i, (len, dst_gap, src_gap, gap)) in items.into_iter().enumerate() {
                if dst_gap {
                    dst += gap;
                }
                if src_gap {
                    src += gap * 7 + 1;
                }
                out.push(frag(dst, src, len, i as u32));
                dst += len;
                src += len;
            }
            out
        })
    }

    fn shuffled(mut v: Vec<Fragment>, seed: u64) -> Vec<Fragment> {
        let mut x = seed | 1;
        for i in (1..v.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v.swap(i, (x % (i as u64 + 1)) as usize);
        }
        v
    }

    proptest! {
        /// Every destination byte gets exactly the source byte its fragment named, nothing else is
        /// written, and no two copies could have been merged further.
        #[test]
        fn coalescing_is_exact(frags in batch(), seed in any::<u64>()) {
            let mut input = shuffled(frags.clone(), seed);
            let mut ops = Vec::new();
            let c = coalesce(&mut input, &mut ops).unwrap();
            prop_assert_eq!(c.total_bytes, frags.iter().map(|f| f.len).sum::<u64>());
            prop_assert_eq!(ops.iter().map(|o| o.len).sum::<u64>(), c.total_bytes);
            // Byte-level model: destination address -> source address.
            let mut want = std::collections::BTreeMap::new();
            for f in &frags {
                for k in 0..f.len {
                    prop_assert!(want.insert(f.dst + k, f.src + k).is_none());
                }
            }
            let mut got = std::collections::BTreeMap::new();
            for o in &ops {
                for k in 0..o.len {
                    prop_assert!(got.insert(o.dst + k, o.src + k).is_none());
                }
            }
            prop_assert_eq!(want, got);
            for w in ops.windows(2) {
                prop_assert!(w[0].dst + w[0].len <= w[1].dst);
                prop_assert!(!(w[0].dst + w[0].len == w[1].dst && w[0].src + w[0].len == w[1].src));
            }
        }

        /// The sweep agrees with a quadratic check of every source against every destination.
        #[test]
        fn overlap_sweep_matches_brute_force(
            items in prop::collection::vec((0u64..400, 0u64..400, 1u64..40), 1..40),
        ) {
            let mut frags: Vec<Fragment> = items
                .iter()
                .enumerate()
                .map(|(i, &(d, s, l))| frag(d, s, l, i as u32))
                .collect();
            let mut ops = Vec::new();
            let dst_overlap = frags.iter().enumerate().any(|(i, a)| {
                frags[i + 1..].iter().any(|b| a.dst < b.dst + b.len && b.dst < a.dst + a.len)
            });
            let r = coalesce(&mut frags, &mut ops);
            prop_assert_eq!(r.is_err(), dst_overlap);
            if !dst_overlap {
                let brute = frags.iter().any(|a| frags.iter().any(|b| a.src < b.dst + b.len && b.dst < a.src + a.len));
                let mut spans = Spans::default();
                frags.iter().for_each(|f| spans.add(f));
                prop_assert!(spans.may_overlap() || !brute);
                prop_assert_eq!(sources_meet_destinations(&frags, &mut Vec::new()), brute);
            }
        }
    }
}
