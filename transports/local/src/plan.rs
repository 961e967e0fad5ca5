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

impl CopyOp {
    /// True when the copy's source and destination overlap.
    #[inline]
    pub fn overlaps_itself(&self) -> bool {
        self.src < self.dst + self.len && self.dst < self.src + self.len
    }
}

/// The result of [`coalesce`] when the batch is safe to run as independent copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coalesced {
    /// Bytes over all copies.
    pub total_bytes: u64,
}

/// Two requests of the batch write the same destination bytes, or one reads bytes another writes.
/// Such a batch must run request by request (see the [crate docs](crate#requests-that-touch-the-same-memory)),
/// never as parallel copies.
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

/// Reusable vectors of the planner, kept per thread so planning allocates nothing per batch once
/// warm.
#[derive(Debug, Default)]
pub struct PlanScratch {
    keys: Vec<u64>,
    tmp: Vec<u64>,
    counts: Vec<u32>,
    pairs: Vec<(u64, u64)>,
}

impl PlanScratch {
    /// Fragments' worth of capacity held (for trimming oversized scratch).
    pub fn capacity(&self) -> usize {
        self.keys.capacity()
    }
}

/// Batches at least this large are ordered by radix sort, smaller ones by comparison sort.
const RADIX_MIN: usize = 256;
/// Bits per radix digit: 2,048 counters fit in L1 next to the keys.
const RADIX_DIGIT_BITS: u32 = 11;

/// Orders `frags` by destination, checks that no two destinations overlap, and writes the
/// coalesced copies to `ops` (cleared first), in destination order. Two fragments merge only when
/// both their sources and their destinations are contiguous, so every byte lands exactly where its
/// request said. `frags` itself is left in submission order.
///
/// Already sorted input costs one pass. Otherwise the order is found by sorting compact keys
/// (destination offset above the fragment's position) with a radix sort, a few nanoseconds per
/// fragment where a comparison sort of the fragments costs tens.
///
/// Does not check sources against destinations; see [`sources_meet_destinations`].
pub fn coalesce(frags: &[Fragment], scratch: &mut PlanScratch, ops: &mut Vec<CopyOp>) -> Result<Coalesced, Overlap> {
    ops.clear();
    if frags.is_empty() {
        return Ok(Coalesced { total_bytes: 0 });
    }
    ops.reserve(frags.len());
    let mut sorted = true;
    let (mut lo, mut hi) = (frags[0].dst, frags[0].dst);
    for w in frags.windows(2) {
        sorted &= w[0].dst <= w[1].dst;
        lo = lo.min(w[1].dst);
        hi = hi.max(w[1].dst);
    }
    if sorted {
        return walk(frags.iter(), ops);
    }
    let n = frags.len();
    let index_bits = usize::BITS - (n - 1).leading_zeros();
    let offset_bits = u64::BITS - (hi - lo).leading_zeros();
    let keys = &mut scratch.keys;
    keys.clear();
    if index_bits + offset_bits <= u64::BITS {
        keys.extend(
            frags
                .iter()
                .enumerate()
                .map(|(i, f)| ((f.dst - lo) << index_bits) | i as u64),
        );
        if n >= RADIX_MIN {
            radix_sort(keys, &mut scratch.tmp, &mut scratch.counts, index_bits, offset_bits);
        } else {
            keys.sort_unstable();
        }
        let mask = (1u64 << index_bits) - 1;
        walk(keys.iter().map(|&k| &frags[(k & mask) as usize]), ops)
    } else {
        // Destinations spread over more of the address space than a key can hold next to the
        // position: sort positions by destination instead.
        keys.extend(0..n as u64);
        keys.sort_unstable_by_key(|&i| frags[i as usize].dst);
        walk(keys.iter().map(|&i| &frags[i as usize]), ops)
    }
}

/// Merges fragments given in destination order into `ops`; fails on overlapping destinations.
#[inline]
fn walk<'a>(mut frags: impl Iterator<Item = &'a Fragment>, ops: &mut Vec<CopyOp>) -> Result<Coalesced, Overlap> {
    let Some(first) = frags.next() else {
        return Ok(Coalesced { total_bytes: 0 });
    };
    let mut total = 0u64;
    let mut cur = CopyOp {
        dst: first.dst,
        src: first.src,
        len: first.len,
    };
    for f in frags {
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

/// Sorts `keys` by their bits `[low, low + bits)` (least significant digit first, stable), using
/// `tmp` and `counts` as scratch. Digits on which every key agrees are skipped.
fn radix_sort(keys: &mut Vec<u64>, tmp: &mut Vec<u64>, counts: &mut Vec<u32>, low: u32, bits: u32) {
    if bits == 0 {
        return;
    }
    let passes = bits.div_ceil(RADIX_DIGIT_BITS) as usize;
    let digit = bits.div_ceil(passes as u32);
    let buckets = 1usize << digit;
    // The last digit may be narrower: bits above `low + bits` must not take part.
    let masks: [u64; 6] = std::array::from_fn(|p| {
        let width = bits.saturating_sub(p as u32 * digit).min(digit);
        (1u64 << width) - 1
    });
    counts.clear();
    counts.resize(buckets * passes, 0);
    // One read of the keys fills the histograms of every pass; the pass count is a constant inside
    // the loop so it unrolls.
    match passes {
        1 => histograms::<1>(keys, counts, low, digit, &masks),
        2 => histograms::<2>(keys, counts, low, digit, &masks),
        3 => histograms::<3>(keys, counts, low, digit, &masks),
        4 => histograms::<4>(keys, counts, low, digit, &masks),
        5 => histograms::<5>(keys, counts, low, digit, &masks),
        _ => histograms::<6>(keys, counts, low, digit, &masks),
    }
    let n = keys.len() as u32;
    tmp.clear();
    tmp.resize(keys.len(), 0);
    for (p, &mask) in masks.iter().enumerate().take(passes) {
        let hist = &mut counts[p * buckets..(p + 1) * buckets];
        if hist.contains(&n) {
            continue;
        }
        let mut sum = 0u32;
        for c in hist.iter_mut() {
            let here = *c;
            *c = sum;
            sum += here;
        }
        let shift = low + p as u32 * digit;
        for &k in keys.iter() {
            let d = ((k >> shift) & mask) as usize;
            tmp[hist[d] as usize] = k;
            hist[d] += 1;
        }
        std::mem::swap(keys, tmp);
    }
}

/// Counts, for each of `P` digits of `digit` bits starting at bit `low`, how many keys have each
/// digit value; `counts` holds `P` tables of `1 << digit` counters.
fn histograms<const P: usize>(keys: &[u64], counts: &mut [u32], low: u32, digit: u32, masks: &[u64; 6]) {
    let buckets = 1usize << digit;
    let (tables, _) = counts.split_at_mut(P * buckets);
    for &k in keys {
        for p in 0..P {
            let d = ((k >> (low + p as u32 * digit)) & masks[p]) as usize;
            tables[p * buckets + d] += 1;
        }
    }
}

/// True when some copy's source range overlaps some copy's destination range.
///
/// `ops` must be sorted by destination with non-overlapping destinations (as [`coalesce`] writes
/// them; coalescing joins only contiguous ranges, so checking copies is checking fragments).
/// O(n log n); only needed when the address spans of sources and destinations meet.
pub fn sources_meet_destinations(ops: &[CopyOp], scratch: &mut PlanScratch) -> bool {
    let sources = &mut scratch.pairs;
    sources.clear();
    sources.extend(ops.iter().map(|o| (o.src, o.src + o.len)));
    sources.sort_unstable();
    let mut d = 0;
    for &(start, end) in sources.iter() {
        // Destinations are disjoint and sorted, so one that ends before this source starts ends
        // before every later source starts too.
        while d < ops.len() && ops[d].dst + ops[d].len <= start {
            d += 1;
        }
        if d < ops.len() && ops[d].dst < end {
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
        let frags = vec![
            frag(1100, 5100, 100, 1),
            frag(1000, 5000, 100, 0),
            frag(1200, 9000, 100, 2), // destination continues, source does not
            frag(1300, 9100, 50, 3),
            frag(2000, 9150, 10, 4), // source continues, destination does not
        ];
        let mut ops = Vec::new();
        let c = coalesce(&frags, &mut PlanScratch::default(), &mut ops).unwrap();
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
        let (mut ops, mut s) = (Vec::new(), PlanScratch::default());
        assert_eq!(
            coalesce(&[frag(10, 0, 5, 0), frag(14, 100, 5, 1)], &mut s, &mut ops),
            Err(Overlap)
        );
        assert_eq!(
            coalesce(&[frag(14, 100, 5, 1), frag(10, 0, 5, 0)], &mut s, &mut ops),
            Err(Overlap)
        );
        assert_eq!(
            coalesce(&[frag(10, 0, 5, 0), frag(10, 100, 1, 1)], &mut s, &mut ops),
            Err(Overlap)
        );
        assert!(coalesce(&[frag(15, 100, 1, 1), frag(10, 0, 5, 0)], &mut s, &mut ops).is_ok());
        assert_eq!(coalesce(&[], &mut s, &mut ops), Ok(Coalesced { total_bytes: 0 }));
        assert!(ops.is_empty());
        // Destinations too far apart for a compact key still sort (by comparison).
        let far = [frag(u64::MAX - 10, 0, 5, 0), frag(0, 100, 5, 1), frag(5, 105, 5, 2)];
        coalesce(&far, &mut s, &mut ops).unwrap();
        let want = vec![
            CopyOp {
                dst: 0,
                src: 100,
                len: 10,
            },
            CopyOp {
                dst: u64::MAX - 10,
                src: 0,
                len: 5,
            },
        ];
        assert_eq!(ops, want);
    }

    #[test]
    fn sources_against_destinations() {
        let mut s = PlanScratch::default();
        let op = |dst, src, len| CopyOp { dst, src, len };
        // Disjoint, interleaved.
        assert!(!sources_meet_destinations(
            &[op(100, 50, 50), op(300, 200, 100)],
            &mut s
        ));
        // A source reaching one byte into a destination.
        assert!(sources_meet_destinations(&[op(100, 51, 50), op(300, 200, 100)], &mut s));
        // A request copying onto itself.
        assert!(sources_meet_destinations(&[op(100, 100, 1)], &mut s));
    }

    /// A batch of fragments with random sizes placed at random, non-overlapping destination slots
    /// and random sources; a share of them laid out contiguously so coalescing has work to do.
    fn batch() -> impl Strategy<Value = Vec<Fragment>> {
        prop::collection::vec((1u64..300, any::<bool>(), any::<bool>(), 0u64..64), 0..600).prop_map(|items| {
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
            let input = shuffled(frags.clone(), seed);
            let mut ops = Vec::new();
            let c = coalesce(&input, &mut PlanScratch::default(), &mut ops).unwrap();
            prop_assert_eq!(&input, &shuffled(frags.clone(), seed), "input order is kept");
            prop_assert_eq!(c.total_bytes, frags.iter().map(|f| f.len).sum::<u64>());
            prop_assert_eq!(ops.iter().map(|o| o.len).sum::<u64>(), c.total_bytes);
            // Every fragment lies inside one copy at the matching source offset; with the copies
            // disjoint and the totals equal, that is every byte in its place and nothing more.
            for f in &frags {
                let i = ops.partition_point(|o| o.dst <= f.dst) - 1;
                let o = ops[i];
                prop_assert!(f.dst + f.len <= o.dst + o.len, "fragment {} spills out of its copy", f.index);
                prop_assert_eq!(o.src + (f.dst - o.dst), f.src, "fragment {} reads the wrong source", f.index);
            }
            for w in ops.windows(2) {
                prop_assert!(w[0].dst + w[0].len <= w[1].dst);
                prop_assert!(!(w[0].dst + w[0].len == w[1].dst && w[0].src + w[0].len == w[1].src));
            }
        }

        /// The radix sort orders by the selected bits exactly as a stable comparison sort does.
        #[test]
        fn radix_sort_matches_a_stable_sort(
            raw in prop::collection::vec(any::<u64>(), 0..3000),
            low in 0u32..20,
            bits in 0u32..40,
        ) {
            let bits = bits.min(64 - low);
            let sel = |k: u64| if bits == 0 { 0 } else { (k >> low) & (u64::MAX >> (64 - bits)) };
            let mut want = raw.clone();
            want.sort_by_key(|&k| sel(k));
            let mut keys = raw;
            radix_sort(&mut keys, &mut Vec::new(), &mut Vec::new(), low, bits);
            prop_assert_eq!(keys, want);
        }

        /// The sweep agrees with a quadratic check of every source against every destination.
        #[test]
        fn overlap_sweep_matches_brute_force(
            items in prop::collection::vec((0u64..400, 0u64..400, 1u64..40), 1..40),
        ) {
            let frags: Vec<Fragment> = items
                .iter()
                .enumerate()
                .map(|(i, &(d, s, l))| frag(d, s, l, i as u32))
                .collect();
            let mut ops = Vec::new();
            let dst_overlap = frags.iter().enumerate().any(|(i, a)| {
                frags[i + 1..].iter().any(|b| a.dst < b.dst + b.len && b.dst < a.dst + a.len)
            });
            let mut scratch = PlanScratch::default();
            let r = coalesce(&frags, &mut scratch, &mut ops);
            prop_assert_eq!(r.is_err(), dst_overlap);
            if !dst_overlap {
                let brute = frags.iter().any(|a| frags.iter().any(|b| a.src < b.dst + b.len && b.dst < a.src + a.len));
                let mut spans = Spans::default();
                frags.iter().for_each(|f| spans.add(f));
                prop_assert!(spans.may_overlap() || !brute);
                prop_assert_eq!(sources_meet_destinations(&ops, &mut scratch), brute);
            }
        }
    }
}
