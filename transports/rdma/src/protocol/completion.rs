//! Completion accounting of one batch: requests are cut into pieces spread over QPs and rails; a
//! request completes on `te_base::BatchState` when its last piece retires, and fails at its first
//! failed piece (later pieces of it are then ignored). A batch cut short by its deadline instead
//! fails a request only once its last piece is accounted for (landed, flushed or never posted),
//! because settling it releases the pins on its memory.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

use te_base::{BatchState, Error};

/// Set in a request's count once one of its pieces was dropped by a cut.
const CUT: u32 = 1 << 31;

/// Pieces outstanding per request of one batch.
#[derive(Debug)]
pub struct BatchTracker {
    state: Arc<BatchState>,
    remaining: Box<[AtomicU32]>,
    /// The error of a cut ([`BatchTracker::piece_cut`]).
    cut: OnceLock<Error>,
}

impl BatchTracker {
    /// Tracks `state`; every request starts with zero pieces (see [`BatchTracker::add_pieces`]).
    pub fn new(state: Arc<BatchState>) -> Self {
        let remaining = (0..state.len()).map(|_| AtomicU32::new(0)).collect();
        BatchTracker {
            state,
            remaining,
            cut: OnceLock::new(),
        }
    }

    /// The batch.
    pub fn state(&self) -> &Arc<BatchState> {
        &self.state
    }

    /// Request `index` was cut into `n` more pieces. Call before any of them is posted.
    pub fn add_pieces(&self, index: u32, n: u32) {
        if let Some(r) = self.remaining.get(index as usize) {
            r.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// One piece of request `index` landed; the request completes with its last piece (or
    /// fails then, if a cut dropped another of its pieces).
    pub fn piece_done(&self, index: u32) {
        if let Some(r) = self.remaining.get(index as usize) {
            let before = r.fetch_sub(1, Ordering::AcqRel);
            if before & !CUT == 1 {
                match (before & CUT != 0, self.cut.get()) {
                    (true, Some(err)) => self.state.fail(index as usize, err.clone()),
                    _ => self.state.complete(index as usize),
                }
            }
        }
    }

    /// One piece of request `index` will not land: its batch was cut short with `err` and the
    /// piece was never posted, or came back flushed. The request fails with `err` once its last
    /// piece is accounted for, not before: until then the device may still touch its memory.
    pub fn piece_cut(&self, index: u32, err: &Error) {
        let _ = self.cut.set(err.clone());
        if let Some(r) = self.remaining.get(index as usize) {
            r.fetch_or(CUT, Ordering::AcqRel);
            if r.fetch_sub(1, Ordering::AcqRel) & !CUT == 1 {
                self.state
                    .fail(index as usize, self.cut.get().cloned().unwrap_or_else(|| err.clone()));
            }
        }
    }

    /// Request `index` failed (a piece failed for good). Its other pieces no longer matter.
    pub fn fail(&self, index: u32, error: Error) {
        self.state.fail(index as usize, error);
    }

    /// True once the caller cancelled the batch: pieces not yet posted are dropped.
    pub fn cancelled(&self) -> bool {
        self.state.cancel_requested()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_base::{Batch, RequestStatus};

    #[test]
    fn a_request_completes_with_its_last_piece_and_fails_at_its_first_failure() {
        let state = BatchState::new(vec![100, 200, 300].into());
        let t = BatchTracker::new(state.clone());
        t.add_pieces(0, 3);
        t.add_pieces(1, 1);
        t.add_pieces(2, 2);
        t.piece_done(0);
        t.piece_done(0);
        assert!(matches!(state.status(0), Some(RequestStatus::Pending)));
        t.piece_done(0);
        assert!(matches!(state.status(0), Some(RequestStatus::Done { bytes: 100 })));
        t.fail(2, Error::Cancelled);
        t.piece_done(2);
        t.piece_done(2);
        assert!(
            matches!(state.status(2), Some(RequestStatus::Failed(_))),
            "failure sticks"
        );
        t.piece_done(1);
        let e = Batch::new(state).wait_blocking(None).unwrap().unwrap_err();
        assert_eq!((e.progress.done, e.progress.failed), (2, 1));
        t.piece_done(99); // out of range: ignored
    }

    #[test]
    fn a_cut_request_fails_only_with_its_last_piece_and_untouched_ones_complete() {
        let state = BatchState::new(vec![100, 200, 300].into());
        let t = BatchTracker::new(state.clone());
        t.add_pieces(0, 3);
        t.add_pieces(1, 2);
        t.add_pieces(2, 1);
        let cut = Error::Timeout {
            what: "test".into(),
            after_ms: 1,
        };
        t.piece_cut(0, &cut);
        t.piece_done(0);
        assert!(
            matches!(state.status(0), Some(RequestStatus::Pending)),
            "a piece is still out"
        );
        t.piece_done(0);
        assert!(matches!(
            state.status(0),
            Some(RequestStatus::Failed(Error::Timeout { .. }))
        ));
        t.piece_done(1);
        t.piece_cut(1, &cut);
        assert!(matches!(
            state.status(1),
            Some(RequestStatus::Failed(Error::Timeout { .. }))
        ));
        t.piece_done(2);
        assert!(
            matches!(state.status(2), Some(RequestStatus::Done { bytes: 300 })),
            "every piece landed before the cut"
        );
    }
}
