//! How a batch is cut into slices and spread over the lanes of a peer. Pure arithmetic, no I/O.
//!
//! The slices of a batch are numbered in request order (request 0's slices first). Slice `k` goes
//! to lane `k % lanes`. Both the sending and the receiving task of a lane walk the same sequence
//! with a [`LaneCursor`], so replies (which TCP keeps in order) are matched to slices without any
//! per-slice table.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use te_base::{BatchState, ResolvedRequest};

/// One batch, shared by the lanes that carry it.
pub(crate) struct Plan {
    /// The batch's requests (all to one peer).
    pub requests: Vec<ResolvedRequest>,
    /// Slices still outstanding per request; the request completes when it reaches zero.
    pub remaining: Box<[AtomicU64]>,
    /// Where completions go.
    pub batch: Arc<BatchState>,
    /// Slice size in bytes.
    pub slice: u64,
    /// Number of lanes the slices are spread over.
    pub lanes: u64,
}

impl Plan {
    /// Builds the plan and returns it with the total number of slices.
    pub fn new(requests: Vec<ResolvedRequest>, batch: Arc<BatchState>, slice: u64, lanes: u64) -> (Arc<Plan>, u64) {
        let mut total = 0u64;
        let remaining = requests
            .iter()
            .map(|r| {
                let n = slices_of(r.len, slice);
                total += n;
                AtomicU64::new(n)
            })
            .collect();
        let plan = Plan {
            requests,
            remaining,
            batch,
            slice,
            lanes,
        };
        (Arc::new(plan), total)
    }

    /// Marks one slice of request at `pos` done; completes the request after its last slice.
    pub fn slice_done(&self, pos: usize) {
        if self.remaining[pos].fetch_sub(1, Ordering::AcqRel) == 1 {
            self.batch.complete(self.requests[pos].index as usize);
        }
    }
}

/// Number of slices of a request of `len` bytes.
pub(crate) fn slices_of(len: u64, slice: u64) -> u64 {
    len.div_ceil(slice)
}

/// Number of the `total` slices that lane `lane` of `lanes` carries.
pub(crate) fn lane_share(total: u64, lane: u64, lanes: u64) -> u64 {
    if lane >= total {
        0
    } else {
        (total - lane).div_ceil(lanes)
    }
}

/// One slice: part of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slice {
    /// Position of the request in the plan.
    pub pos: usize,
    /// Offset of the slice inside the request.
    pub offset: u64,
    /// Length of the slice.
    pub len: u64,
}

/// Walks the slices of one lane in order.
#[derive(Debug, Clone)]
pub(crate) struct LaneCursor {
    pos: usize,
    offset: u64,
    /// Global number of the slice at (pos, offset).
    k: u64,
    lane: u64,
}

impl LaneCursor {
    /// A cursor at the first slice of lane `lane`.
    pub fn new(lane: u64) -> Self {
        LaneCursor {
            pos: 0,
            offset: 0,
            k: 0,
            lane,
        }
    }

    /// The next slice of this lane, or `None` after its last.
    pub fn next(&mut self, requests: &[ResolvedRequest], slice: u64, lanes: u64) -> Option<Slice> {
        loop {
            let req = requests.get(self.pos)?;
            let here = Slice {
                pos: self.pos,
                offset: self.offset,
                len: (req.len - self.offset).min(slice),
            };
            let mine = self.k % lanes == self.lane;
            self.k += 1;
            self.offset += here.len;
            if self.offset >= req.len {
                self.pos += 1;
                self.offset = 0;
            }
            if mine {
                return Some(here);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use te_base::{RegionId, TransferOp};

    fn req(index: u32, len: u64) -> ResolvedRequest {
        ResolvedRequest {
            index,
            op: TransferOp::Write,
            len,
            local_addr: 0x1000,
            local_region: RegionId(1),
            remote_addr: 0x2000,
            remote_buffer: 0,
        }
    }

    proptest! {
        /// Every byte of every request is covered by exactly one slice, no slice exceeds the
        /// slice size, and each lane gets exactly its share.
        #[test]
        fn lanes_cover_every_byte_once(
            lens in proptest::collection::vec(1u64..50_000, 1..40),
            slice in 1u64..9000,
            lanes in 1u64..6,
        ) {
            let requests: Vec<_> = lens.iter().enumerate().map(|(i, &l)| req(i as u32, l)).collect();
            let total: u64 = lens.iter().map(|&l| slices_of(l, slice)).sum();
            let mut covered: Vec<u64> = vec![0; lens.len()];
            let mut seen = 0u64;
            for lane in 0..lanes {
                let mut c = LaneCursor::new(lane);
                let mut n = 0;
                let mut last: Option<Slice> = None;
                while let Some(s) = c.next(&requests, slice, lanes) {
                    prop_assert!(s.len >= 1 && s.len <= slice);
                    if let Some(l) = last {
                        prop_assert!((s.pos, s.offset) > (l.pos, l.offset));
                    }
                    covered[s.pos] += s.len;
                    last = Some(s);
                    n += 1;
                }
                prop_assert_eq!(n, lane_share(total, lane, lanes));
                seen += n;
            }
            prop_assert_eq!(seen, total);
            prop_assert_eq!(covered, lens);
        }
    }

    #[test]
    fn shares_add_up() {
        for total in 0..20 {
            for lanes in 1..5 {
                let s: u64 = (0..lanes).map(|l| lane_share(total, l, lanes)).sum();
                assert_eq!(s, total);
            }
        }
    }

    #[test]
    fn completes_after_last_slice() {
        let batch = BatchState::new(vec![10].into());
        let (plan, total) = Plan::new(vec![req(0, 10)], batch.clone(), 4, 2);
        assert_eq!(total, 3);
        plan.slice_done(0);
        plan.slice_done(0);
        assert!(!batch.is_complete());
        plan.slice_done(0);
        assert!(batch.is_complete());
    }
}
