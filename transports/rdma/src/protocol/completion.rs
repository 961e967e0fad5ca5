//! Completion accounting of one batch: requests are cut into pieces spread over QPs and rails; a
//! request completes on `te_base::BatchState` when its last piece retires, and fails at its first
//! failed piece (later pieces of it are then ignored).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use te_base::{BatchState, Error};

/// Pieces outstanding per request of one batch.
#[derive(Debug)]
pub struct BatchTracker {
    state: Arc<BatchState>,
    remaining: Box<[AtomicU32]>,
}

impl BatchTracker {
    /// Tracks `state`; every request starts with zero pieces (see [`BatchTracker::add_pieces`]).
    pub fn new(state: Arc<BatchState>) -> Self {
        let remaining = (0..state.len()).map(|_| AtomicU32::new(0)).collect();
        BatchTracker { state, remaining }
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

    /// One piece of request `index` landed; the request completes with its last piece.
    pub fn piece_done(&self, index: u32) {
        if let Some(r) = self.remaining.get(index as usize) {
            if r.fetch_sub(1, Ordering::AcqRel) == 1 {
                self.state.complete(index as usize);
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
}
