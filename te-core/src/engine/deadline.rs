//! Batch deadlines: one timer per batch that has one (none when off), which on expiry asks each
//! peer the batch went to to cut its requests short with [`Error::Timeout`].
//!
//! The engine never settles a timed-out request itself: the last request of a batch to settle
//! releases the pins on the batch's memory, so only the transport, once it guarantees that no
//! more bytes of the request will land ([`te_base::Peer::abort`]), may fail it. A transport that
//! cannot cut requests short (the local copy, whose copies always run to the end) lets them
//! finish.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use te_base::config::{parse_var, Env};
use te_base::{BatchState, Error, Peer, Result};

/// The peers a batch's deadline aborts: those it was submitted to, and those failover moved
/// requests to later. Once the deadline fired, no peer can be added (the failover then fails
/// the request with a timeout instead of starting it).
#[derive(Clone, Default)]
pub(crate) struct DeadlinePeers(Arc<Mutex<DeadlineState>>);

#[derive(Default)]
struct DeadlineState {
    expired: bool,
    peers: Vec<Arc<dyn Peer>>,
}

impl DeadlinePeers {
    /// Adds `peer` (once); false if the deadline already passed.
    pub fn add(&self, peer: &Arc<dyn Peer>) -> bool {
        let mut s = self.0.lock();
        if s.expired {
            return false;
        }
        if !s.peers.iter().any(|p| Arc::ptr_eq(p, peer)) {
            s.peers.push(peer.clone());
        }
        true
    }

    pub fn is_empty(&self) -> bool {
        self.0.lock().peers.is_empty()
    }

    /// Marks the deadline passed and hands out the peers to abort.
    fn expire(&self) -> Vec<Arc<dyn Peer>> {
        let mut s = self.0.lock();
        s.expired = true;
        std::mem::take(&mut s.peers)
    }
}

/// Default deadline of every batch, in milliseconds; unset or `0`: no deadline.
pub const TRANSFER_TIMEOUT_VAR: &str = "TE_TRANSFER_TIMEOUT_MS";

/// Longest deadline accepted (a day), so `now + deadline` cannot overflow a clock.
const MAX_DEADLINE_MS: u64 = 86_400_000;

/// Reads [`TRANSFER_TIMEOUT_VAR`]: `None` when unset or `0`.
pub(crate) fn default_deadline(env: &dyn Env) -> Result<Option<Duration>> {
    match parse_var::<u64>(env, TRANSFER_TIMEOUT_VAR)? {
        None | Some(0) => Ok(None),
        Some(ms) if ms > MAX_DEADLINE_MS => Err(Error::config(
            TRANSFER_TIMEOUT_VAR,
            ms.to_string(),
            format!("must be at most {MAX_DEADLINE_MS} (a day); 0 or unset turns deadlines off"),
        )),
        Some(ms) => Ok(Some(Duration::from_millis(ms))),
    }
}

/// Checks a caller's deadline: zero would expire before anything started.
pub(crate) fn check(deadline: Duration) -> Result<()> {
    if deadline.is_zero() || deadline.as_millis() > MAX_DEADLINE_MS as u128 {
        return Err(Error::config(
            "SubmitOptions::deadline",
            format!("{deadline:?}"),
            format!("must be between 1 ms and {MAX_DEADLINE_MS} ms"),
        ));
    }
    Ok(())
}

/// Starts the timer of `batch`: unless every request settled first, after `after` each of
/// `peers` is asked to abort with a timeout error. The batch's completion cancels the timer.
pub(crate) fn arm(runtime: &tokio::runtime::Handle, batch: &Arc<BatchState>, peers: DeadlinePeers, after: Duration) {
    let (settled_tx, settled) = tokio::sync::oneshot::channel::<()>();
    batch.on_complete(Box::new(move |_| {
        let _ = settled_tx.send(());
    }));
    let weak = Arc::downgrade(batch);
    let requests = batch.len();
    runtime.spawn(async move {
        tokio::select! {
            _ = settled => return,
            _ = tokio::time::sleep(after) => {}
        }
        let Some(batch) = weak.upgrade() else { return };
        if batch.is_complete() {
            return;
        }
        for peer in &peers.expire() {
            let err = Error::Timeout {
                what: format!(
                    "batch of {requests} request(s) to segment '{}' (its deadline)",
                    peer.descriptor().name
                ),
                after_ms: after.as_millis() as u64,
            };
            if !peer.abort_batch(&batch, err) {
                tracing::debug!(
                    peer = %peer.descriptor().name,
                    "batch deadline passed; the transport lets its requests finish"
                );
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_base::config::MapEnv;

    #[test]
    fn the_default_is_off_and_bad_values_are_named() {
        assert_eq!(default_deadline(&MapEnv::default()).unwrap(), None);
        let env = |v: &str| MapEnv::new([(TRANSFER_TIMEOUT_VAR, v)]);
        assert_eq!(default_deadline(&env("0")).unwrap(), None);
        assert_eq!(default_deadline(&env("250")).unwrap(), Some(Duration::from_millis(250)));
        for bad in ["-1", "ten", "86400001", ""] {
            let e = default_deadline(&env(bad)).unwrap_err();
            assert!(e.to_string().contains(TRANSFER_TIMEOUT_VAR), "{bad}: {e}");
        }
        assert!(check(Duration::ZERO).is_err());
        assert!(check(Duration::from_millis(1)).is_ok());
    }
}
