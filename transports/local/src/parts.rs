//! Splitting a plan's copies into parts of about equal bytes for the copy workers, and running one
//! part.
//!
//! A part is the byte range between two cursors over the list of copies, so one large copy can be
//! shared by several workers. Cuts inside a copy fall on a destination cache-line boundary, so no
//! two workers' streaming stores fill the same line.

use crate::copy::{copy_with_threshold, NtKernel, CACHE_LINE};
use crate::plan::CopyOp;

/// A position in a list of copies: byte `off` of copy `op`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Cursor {
    /// Index of the copy.
    pub op: usize,
    /// Byte offset inside it.
    pub off: u64,
}

/// Writes `parts + 1` cursors to `cuts` (cleared first) so that part `k` is `cuts[k]..cuts[k + 1]`
/// and the parts hold about `total / parts` bytes each. `total` must be the sum of the lengths.
pub fn split(ops: &[CopyOp], total: u64, parts: usize, cuts: &mut Vec<Cursor>) {
    cuts.clear();
    let parts = parts.max(1);
    cuts.push(Cursor::default());
    let mut op = 0usize;
    let mut before = 0u64; // bytes of the copies before `op`
    for k in 1..parts {
        let target = (total as u128 * k as u128 / parts as u128) as u64;
        while op < ops.len() && before + ops[op].len <= target {
            before += ops[op].len;
            op += 1;
        }
        let mut cut = if op == ops.len() {
            Cursor { op, off: 0 }
        } else {
            let off = target - before;
            let dst = ops[op].dst;
            let aligned = (dst + off) & !(CACHE_LINE as u64 - 1);
            Cursor {
                op,
                off: aligned.saturating_sub(dst),
            }
        };
        let prev = *cuts.last().expect("cuts starts non-empty");
        if cut < prev {
            cut = prev;
        }
        cuts.push(cut);
    }
    cuts.push(Cursor { op: ops.len(), off: 0 });
}

/// Copies the bytes of `ops` from `from` up to `to` (exclusive) with `kernel` for pieces of at least
/// `nt_min` bytes, then fences the streaming stores.
///
/// # Safety
/// Every copy of `ops` must name a valid, readable source and writable destination that overlap
/// neither each other nor any destination another thread writes at the same time.
pub unsafe fn run_range(ops: &[CopyOp], from: Cursor, to: Cursor, kernel: NtKernel, nt_min: u64) {
    let mut i = from.op;
    let mut off = from.off;
    while i < ops.len() && (i < to.op || (i == to.op && off < to.off)) {
        let op = ops[i];
        let end = if i == to.op { to.off.min(op.len) } else { op.len };
        if end > off {
            let len = (end - off) as usize;
            // SAFETY: `[off, end)` lies inside this copy, whose ranges the caller vouches for.
            unsafe {
                copy_with_threshold(
                    kernel,
                    nt_min,
                    (op.dst + off) as usize as *mut u8,
                    (op.src + off) as usize as *const u8,
                    len,
                )
            };
        }
        i += 1;
        off = 0;
    }
    crate::copy::store_fence();
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The parts tile the plan: in order, no gaps, no overlap, every byte once.
    fn tiles(ops: &[CopyOp], cuts: &[Cursor]) -> Vec<(usize, u64, u64)> {
        let mut pieces = Vec::new();
        for w in cuts.windows(2) {
            let (from, to) = (w[0], w[1]);
            let mut i = from.op;
            let mut off = from.off;
            while i < ops.len() && (i < to.op || (i == to.op && off < to.off)) {
                let end = if i == to.op { to.off.min(ops[i].len) } else { ops[i].len };
                if end > off {
                    pieces.push((i, off, end));
                }
                i += 1;
                off = 0;
            }
        }
        pieces
    }

    proptest! {
        #[test]
        fn parts_cover_every_byte_once(
            lens in prop::collection::vec(1u64..100_000, 0..40),
            dst_mis in 0u64..64,
            parts in 1usize..16,
        ) {
            let mut dst = 1u64 << 32 | dst_mis;
            let ops: Vec<CopyOp> = lens
                .iter()
                .map(|&len| {
                    let op = CopyOp { dst, src: dst + (1 << 40), len };
                    dst += len + 4096;
                    op
                })
                .collect();
            let total: u64 = lens.iter().sum();
            let mut cuts = Vec::new();
            split(&ops, total, parts, &mut cuts);
            prop_assert_eq!(cuts.len(), parts + 1);
            prop_assert!(cuts.windows(2).all(|w| w[0] <= w[1]));
            let pieces = tiles(&ops, &cuts);
            let mut covered = vec![0u64; ops.len()];
            let mut last = (0usize, 0u64);
            for &(i, from, to) in &pieces {
                prop_assert!((i, from) >= last, "pieces out of order");
                last = (i, to);
                covered[i] += to - from;
                // Cuts inside a copy sit on a destination cache line.
                if from > 0 {
                    prop_assert_eq!((ops[i].dst + from) % 64, 0);
                }
            }
            prop_assert_eq!(covered, lens);
        }
    }

    #[test]
    fn parts_are_balanced_for_one_large_copy() {
        let ops = [CopyOp {
            dst: 4096,
            src: 1 << 30,
            len: 1 << 20,
        }];
        let mut cuts = Vec::new();
        split(&ops, 1 << 20, 4, &mut cuts);
        let offs: Vec<u64> = cuts.iter().map(|c| c.off).collect();
        assert_eq!(offs, vec![0, 1 << 18, 2 << 18, 3 << 18, 0]);
        assert_eq!(cuts[4].op, 1);
    }

    #[test]
    fn run_range_copies_exactly_its_part() {
        let src: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut dst = vec![0u8; 10_000];
        let base_s = src.as_ptr() as u64;
        let base_d = dst.as_mut_ptr() as u64;
        let ops = [
            CopyOp {
                dst: base_d,
                src: base_s,
                len: 3000,
            },
            CopyOp {
                dst: base_d + 5000,
                src: base_s + 5000,
                len: 5000,
            },
        ];
        let mut cuts = Vec::new();
        split(&ops, 8000, 3, &mut cuts);
        for k in [2, 0, 1] {
            // SAFETY: the copies stay inside `src` and `dst`, which are distinct vectors.
            unsafe { run_range(&ops, cuts[k], cuts[k + 1], NtKernel::detect(), 2048) };
        }
        assert_eq!(&dst[..3000], &src[..3000]);
        assert!(dst[3000..5000].iter().all(|&b| b == 0));
        assert_eq!(&dst[5000..], &src[5000..]);
    }
}
