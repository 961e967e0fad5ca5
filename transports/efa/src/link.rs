//! The part of a connected peer that the rail owner threads see, in its own module so that the
//! peer (which builds jobs for the workers) and the workers (which report a peer gone) do not
//! import each other.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use te_base::{BatchAborts, Error};

use crate::fabric::{Rail, TRANSPORT};

/// The part of a peer the rail owners see: where it is in each AV and whether it is alive.
pub(crate) struct PeerLink {
    pub(crate) name: String,
    pub(crate) healthy: AtomicBool,
    pub(crate) gone_reason: Mutex<Option<String>>,
    /// The error [`PeerLink::abort`] gave: what its requests fail with.
    pub(crate) aborted: Mutex<Option<Error>>,
    /// Batches cut short by their deadline ([`te_base::Peer::abort_batch`]): the rail owners drop
    /// their fragments not yet posted and take back posted ones, leaving other batches alone.
    pub(crate) cuts: BatchAborts,
    /// Per local rail: the peer's address in that rail's AV.
    pub(crate) dests: Vec<u64>,
    pub(crate) rails: Vec<Arc<Rail>>,
}

impl PeerLink {
    /// The peer's segment name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    /// Marks the peer gone (first reason wins) and returns the error naming it.
    pub(crate) fn mark_gone(&self, reason: String) -> Error {
        let mut r = self.gone_reason.lock();
        if r.is_none() {
            tracing::warn!(peer = %self.name, %reason, "efa: peer went away");
            *r = Some(reason);
        }
        self.healthy.store(false, Ordering::Release);
        Error::PeerGone {
            peer: self.name.clone(),
            reason: r.clone().unwrap_or_default(),
        }
    }

    /// Cuts the peer off (a deadline passed): its requests fail with `err` (first one wins) as
    /// soon as the provider holds no part of them.
    pub(crate) fn abort(&self, err: Error) {
        let mut a = self.aborted.lock();
        if a.is_none() {
            tracing::debug!(peer = %self.name, error = %err, "efa: aborting the peer's requests");
            *a = Some(err);
        }
        self.healthy.store(false, Ordering::Release);
    }

    /// The error for requests to a peer already marked gone (or aborted).
    pub(crate) fn gone_error(&self) -> Error {
        if let Some(e) = self.aborted.lock().clone() {
            return e;
        }
        Error::PeerGone {
            peer: self.name.clone(),
            reason: self
                .gone_reason
                .lock()
                .clone()
                .unwrap_or_else(|| "marked unhealthy".into()),
        }
    }

    /// Wraps a local posting error so it names the peer.
    pub(crate) fn error_from(&self, call: &str, e: &Error) -> Error {
        Error::transport(TRANSPORT, format!("{call} to peer '{}': {e}", self.name))
    }
}

impl Drop for PeerLink {
    fn drop(&mut self) {
        // No job references the link any more, so nothing is posted to these addresses.
        for (rail, &dest) in self.rails.iter().zip(&self.dests) {
            rail.av_release(dest);
        }
    }
}
