//! Submitting a batch: resolve and group every request under one read of the segment table, pin
//! the local regions for the batch's lifetime, hand each group to its route's peer.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use te_base::{Batch, BatchState, Error, Peer, Phase, PhaseTimer, Result, SubmitContext, TransferRequest};

use super::EngineInner;
use crate::grouping::{group_requests, Grouped};
use crate::registry::Pins;
use crate::segment::OpenSegment;

/// Per-call options of [`TransferEngine::submit_with`](crate::TransferEngine::submit_with).
#[derive(Debug, Clone, Default)]
pub struct SubmitOptions {
    /// Work nobody waits on: the local copy stays inline.
    pub background: bool,
    /// Record this call's phases (the engine's resolve/build/other, the transport's plan/submit)
    /// into the caller's timer instead of the engine's; the caller counts its own calls.
    pub timer: Option<PhaseTimer>,
    /// Fail the batch's unfinished requests with [`Error::Timeout`] this long after submission,
    /// each once its transport stopped touching the memory (docs/architecture.md, Deadlines);
    /// `None`: the engine's default, `TE_TRANSFER_TIMEOUT_MS` (off unless set).
    pub deadline: Option<Duration>,
}

impl EngineInner {
    pub(super) fn submit(self: &Arc<Self>, requests: &[TransferRequest], opts: &SubmitOptions) -> Result<Batch> {
        let timer = opts.timer.as_ref().unwrap_or(&self.timer);
        let background = opts.background;
        let t0 = timer.start();
        let mut record = self.export.as_ref().map(|e| e.begin());
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed(format!("engine '{}'", self.name)));
        }
        let deadline = opts.deadline.or(self.default_deadline);
        if let Some(d) = opts.deadline {
            super::deadline::check(d)?;
        }
        let segs = self.segments.read();
        let Grouped { groups, pins, bytes } = group_requests(requests, &segs, self.registry.local_resolver())?;
        let t1 = timer.lap(Phase::Resolve, t0);
        let lens: Box<[u64]> = requests.iter().map(|r| r.len).collect();
        let state = BatchState::new(lens);
        state.keep_alive(Box::new(PinsReaper {
            pins: Some(pins),
            engine: Arc::downgrade(self),
        }));
        let ctx = SubmitContext {
            timer: timer.clone(),
            background,
        };
        let routes: Vec<Arc<OpenSegment>> = groups.iter().map(|g| segs[g.segment as usize].clone()).collect();
        drop(segs);
        timer.lap(Phase::Build, t1);
        let single_group = groups.len() == 1;
        let mut failed = 0u64;
        let mut deadline_peers: Vec<Arc<dyn Peer>> = Vec::new();
        for (g, seg) in groups.into_iter().zip(routes) {
            if let (Some(e), Some(r)) = (&self.export, &mut record) {
                e.group(
                    r,
                    &seg,
                    (g.segment, g.route),
                    &g.requests,
                    single_group.then_some(bytes),
                );
            }
            let peer = &seg.routes[g.route as usize].peer;
            if !peer.is_healthy() {
                self.reconnect_later(g.segment);
                let err = Error::PeerGone {
                    peer: seg.descriptor.name.clone(),
                    reason: "connection lost; reconnecting in the background".into(),
                };
                failed += g.requests.len() as u64;
                state.fail_many(g.requests.iter().map(|r| r.index as usize), &err);
                continue;
            }
            let n = g.requests.len();
            // A transport that returns Err started nothing. With one group that is the whole
            // batch; otherwise keep this group's indices to fail them.
            let indices: Vec<u32> = if single_group {
                Vec::new()
            } else {
                g.requests.iter().map(|r| r.index).collect()
            };
            if deadline.is_some() {
                deadline_peers.push(peer.clone());
            }
            if let Err(e) = peer.submit(g.requests, &state, &ctx) {
                failed += n as u64;
                if single_group {
                    state.fail_many(0..requests.len(), &e);
                } else {
                    state.fail_many(indices.into_iter().map(|i| i as usize), &e);
                }
            }
        }
        if let Some(after) = deadline.filter(|_| !deadline_peers.is_empty()) {
            super::deadline::arm(&self.runtime, &state, deadline_peers, after);
        }
        if let Some(r) = record {
            r.finish(&state);
        }
        // The transports recorded their own plan and submit inside the loop above; the engine's
        // part after it is the counter update.
        let t3 = timer.start();
        self.metrics.record_call(requests.len() as u64, bytes, failed);
        timer.lap(Phase::Other, t3);
        // A caller's own timer counts its own calls; the engine counts only into its own.
        if opts.timer.is_none() {
            timer.count_call(requests.len());
        }
        Ok(Batch::new(state))
    }
}

/// Keeps a batch's regions pinned; on release, reaps regions whose owners dropped them meanwhile.
struct PinsReaper {
    pins: Option<Pins>,
    engine: Weak<EngineInner>,
}

impl Drop for PinsReaper {
    fn drop(&mut self) {
        let any_dying = self.pins.as_ref().is_some_and(|p| p.any_dying());
        drop(self.pins.take());
        if any_dying {
            if let Some(e) = self.engine.upgrade() {
                e.reap_dying();
            }
        }
    }
}
