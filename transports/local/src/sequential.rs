//! Copying a host batch in request order, resolving and copying in one pass, without sorting.
//!
//! A batch (or the front of one) that stays on the submitting thread runs request after request in
//! ascending index. That is already the outcome the crate promises when requests touch the same
//! memory ([crate docs](crate#requests-that-touch-the-same-memory)), so no overlap check is needed:
//! a later request that writes bytes an earlier one wrote leaves its own, one that reads them
//! reads what the earlier one wrote. Only a request (or a merged run) whose own source and
//! destination overlap needs care: it is copied with `memmove` semantics and no streaming stores.
//!
//! Consecutive requests contiguous in both source and destination merge into one copy, unless the
//! merged copy would overlap itself. Requests adjacent only out of order are not merged: on the CPU
//! sorting a batch to find them (about 7 ns per fragment) costs more than the memcpy calls it would
//! save. While one copy runs, the start of the next is prefetched, so the cache misses of a jump
//! to a scattered fragment overlap the copy before it.
//!
//! Batches shared with helper threads are sorted, proven free of overlaps and coalesced instead
//! ([`crate::plan`]).

use te_base::{Error, ResolvedRequest};

use crate::copy::{copy_op, prefetch, store_fence, NtKernel};
use crate::plan::CopyOp;
use crate::resolve::{Resolved, Resolver};

/// Requests between two looks at whether a helper woke up.
const HELPER_CHECK_EVERY: usize = 256;

/// Why [`copy_in_request_order`] stopped before the end of the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// Every request was handled.
    Done,
    /// Request `at` (and every one after it) is left for the planned path: it has a device side,
    /// or `hand_over` asked for the rest.
    At(usize),
}

/// Resolves and copies `requests` (in ascending request index) one after another, merging
/// consecutive contiguous ones; requests that cannot be served are appended to `failures` and
/// skipped. Every [`HELPER_CHECK_EVERY`] requests it asks `hand_over(position)` whether the rest
/// should be planned for sharing instead, and stops there if so. Fences streaming stores before
/// returning.
///
/// # Safety
/// The resolver's tables must stay read-locked (so every region it grants stays registered and
/// mapped) until this returns, and nothing else may write the destinations meanwhile.
pub(crate) unsafe fn copy_in_request_order(
    requests: &[ResolvedRequest],
    resolver: &mut Resolver<'_>,
    kernel: NtKernel,
    nt_min: u64,
    failures: &mut Vec<(usize, Error)>,
    mut hand_over: impl FnMut(usize) -> bool,
) -> Stop {
    let mut stop = Stop::Done;
    let mut cur: Option<CopyOp> = None;
    for (pos, r) in requests.iter().enumerate() {
        if pos % HELPER_CHECK_EVERY == 0 && pos > 0 && hand_over(pos) {
            stop = Stop::At(pos);
            break;
        }
        let f = match resolver.resolve(r) {
            Ok(Resolved::Host(f)) => f,
            Ok(Resolved::Device(_)) => {
                stop = Stop::At(pos);
                break;
            }
            Err(e) => {
                failures.push((r.index as usize, e));
                continue;
            }
        };
        let next = CopyOp {
            dst: f.dst,
            src: f.src,
            len: f.len,
        };
        if let Some(c) = cur.as_mut() {
            let merged = CopyOp {
                len: c.len + next.len,
                ..*c
            };
            if next.dst == c.dst + c.len && next.src == c.src + c.len && !merged.overlaps_itself() {
                c.len = merged.len;
                continue;
            }
            prefetch(next.dst, next.src, next.len, next.len >= nt_min);
            // SAFETY: `c` lies in regions the resolver granted, kept registered by the caller's
            // locks; runs are copied in request order on this thread only.
            unsafe { copy_op(*c, kernel, nt_min) };
        }
        cur = Some(next);
    }
    if let Some(c) = cur {
        // SAFETY: as above.
        unsafe { copy_op(c, kernel, nt_min) };
    }
    store_fence();
    stop
}
