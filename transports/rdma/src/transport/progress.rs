//! The progress thread: polls every rail's completion queue, dispatches completions to their
//! QP slot (or to the notification ring of a QP this side accepted), refills send queues, posts
//! notifications `notify` left to it, starts QP re-establishments when their backoff allows, and
//! enforces the flush grace of aborted connections.
//! One persistent thread per transport; it holds only a weak reference, so dropping the transport
//! ends it.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use te_base::{Error, Result};

use super::peer::{try_begin_reconnect, PeerInner, Reconnect};
use super::Shared;
use crate::verbs::{Completion, Verbs};

/// Completions taken per poll call.
const POLL_BATCH: usize = 64;

/// Starts the thread; returns its handle for waking it.
pub(crate) fn spawn<V: Verbs>(shared: Weak<Shared<V>>) -> Result<std::thread::Thread> {
    let handle = std::thread::Builder::new()
        .name("te-rdma-progress".into())
        .spawn(move || run(shared))
        .map_err(|e| Error::io("rdma: starting the progress thread", e))?;
    Ok(handle.thread().clone())
}

fn run<V: Verbs>(weak: Weak<Shared<V>>) {
    let mut wcs = vec![Completion::default(); POLL_BATCH];
    let mut targets: Vec<Option<(Arc<PeerInner<V>>, usize)>> = Vec::with_capacity(POLL_BATCH);
    loop {
        let Some(shared) = weak.upgrade() else { return };
        if shared.stop.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let now = Instant::now();
        let mut got = 0;
        for rail in &shared.rails().rails {
            let n = match shared.verbs.poll_cq(rail.cq(), &mut wcs) {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(rail = %rail.name, "rdma: polling the CQ: {e}");
                    0
                }
            };
            if n == 0 {
                continue;
            }
            got += n;
            targets.clear();
            {
                let map = shared.qps.read();
                targets.extend(
                    wcs[..n]
                        .iter()
                        .map(|c| map.get(&c.qp_num).and_then(|(w, i)| w.upgrade().map(|p| (p, *i)))),
                );
            }
            for (t, c) in targets.drain(..).zip(&wcs[..n]) {
                match t {
                    Some((peer, index)) => peer.on_completion(index, c, now),
                    None => super::target::on_ring_completion(&shared, c),
                }
            }
        }
        let waiting_notes = std::mem::take(&mut *shared.note_waiting.lock());
        for w in waiting_notes {
            if let Some(peer) = w.upgrade() {
                let mut inner = peer.slots[0].inner.lock();
                peer.pump_notes(&mut inner);
            }
        }
        let aborting = std::mem::take(&mut *shared.aborting.lock());
        for w in aborting {
            if let Some(peer) = w.upgrade() {
                if !peer.give_up_draining(now) {
                    shared.aborting.lock().push(w);
                }
            }
        }
        let broken = std::mem::take(&mut *shared.broken.lock());
        for (w, index) in broken {
            let Some(peer) = w.upgrade() else { continue };
            match try_begin_reconnect(&peer, index, now) {
                Reconnect::Start => {
                    shared.runtime.spawn(peer.reestablish(index));
                }
                Reconnect::Wait => shared.broken.lock().push((w, index)),
                Reconnect::Nothing => {}
            }
        }
        let outstanding = shared.outstanding();
        let waiting = !shared.broken.lock().is_empty() || !shared.aborting.lock().is_empty();
        drop(shared);
        if got == 0 {
            if outstanding > 0 {
                std::thread::yield_now();
            } else if waiting {
                std::thread::park_timeout(Duration::from_millis(1));
            } else {
                std::thread::park_timeout(Duration::from_millis(100));
            }
        }
    }
}
