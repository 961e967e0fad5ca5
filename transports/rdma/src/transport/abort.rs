//! Cutting a connection short ([`te_base::Peer::abort`]: a batch's deadline passed, or the peer
//! restarted) without releasing memory the device may still touch.
//!
//! Every QP of the connection is moved to ERROR. Work requests never posted are collected;
//! posted ones are retired by their completions, which on an ERROR QP come back for every
//! request (`WR_FLUSH_ERR` for those that did not run). A request
//! fails with the abort's error only once every QP of the connection has no work request left in
//! flight, because its pieces may sit on several QPs and failing it settles it, and settling the
//! last request of a batch releases the pins on its memory. After that, no byte of an aborted
//! request can land.
//!
//! Bounded: if a QP's flush completions do not all come back within `TE_RDMA_ABORT_FLUSH_MS`
//! (a wedged device or driver), the progress thread destroys that QP instead. Once
//! `ibv_destroy_qp` returns, the device holds no context for the QP and executes none of its work
//! requests, so releasing the memory is safe then too. If even that fails, the requests stay
//! unsettled and their memory pinned: leaked rather than exposed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use te_base::Error;

use super::peer::Piece;

/// One abort of a connection: the error, the pieces to fail, and the QPs still draining.
pub(crate) struct Drain {
    pub(crate) err: Error,
    /// Pieces to fail once nothing is in flight; `None` once that happened (later ones fail at
    /// once).
    doomed: Mutex<Option<Vec<Piece>>>,
    /// QPs with work requests in flight, plus one held by the abort itself while it walks them.
    draining: AtomicUsize,
    /// When the progress thread stops waiting for flush completions and destroys the QPs.
    pub(crate) give_up_at: Instant,
}

impl Drain {
    /// An abort with `err` that waits for flushes until `give_up_at`; the caller holds one
    /// draining count until it has walked every QP.
    pub(crate) fn new(err: Error, give_up_at: Instant) -> Arc<Self> {
        Arc::new(Drain {
            err,
            doomed: Mutex::new(Some(Vec::new())),
            draining: AtomicUsize::new(1),
            give_up_at,
        })
    }

    /// A QP has work requests in flight: the failing waits for it.
    pub(crate) fn hold(&self) {
        self.draining.fetch_add(1, Ordering::AcqRel);
    }

    /// A piece that will not complete: failed with the abort's error once nothing is in flight.
    pub(crate) fn doom(&self, p: Piece) {
        let mut doomed = self.doomed.lock();
        match doomed.as_mut() {
            Some(list) => list.push(p),
            None => {
                drop(doomed);
                p.fail(self.err.clone());
            }
        }
    }

    /// A QP has nothing in flight any more (its last completion came back, or it was destroyed).
    /// The last one fails every collected piece.
    pub(crate) fn release(&self) {
        if self.draining.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let list = self.doomed.lock().take().unwrap_or_default();
        for p in list {
            p.fail(self.err.clone());
        }
    }

    /// True once every collected piece failed.
    pub(crate) fn finished(&self) -> bool {
        self.doomed.lock().is_none()
    }
}
