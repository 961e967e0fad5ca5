//! Submitting a batch: resolve and group every request under one read of the segment table, pin
//! the local regions for the batch's lifetime, hand each group to its route's peer.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use te_base::{Batch, BatchState, Error, Phase, PhaseTimer, Result, SubmitContext, TransferRequest};

use super::deadline::DeadlinePeers;
use super::failover;
use super::EngineInner;
use crate::grouping::{group_requests, Group, Grouped};
use crate::metrics::BatchRecord;
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
    /// Report a request that failed on its route as failed instead of resubmitting it on the next
    /// route to the segment (failover, `TE_FAILOVER`; see `docs/failover.md`).
    pub no_failover: bool,
}

impl EngineInner {
    pub(super) fn submit(self: &Arc<Self>, requests: &[TransferRequest], opts: &SubmitOptions) -> Result<Batch> {
        let timer = opts.timer.as_ref().unwrap_or(&self.timer);
        let background = opts.background;
        let t0 = timer.start();
        let mut record = self.export.as_ref().map(|_| BatchRecord::start());
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
        let deadline_peers = deadline.map(|_| DeadlinePeers::default());
        if self.failover.enabled() && !opts.no_failover {
            self.install_failover(&groups, &routes, &state, deadline, &deadline_peers, &ctx);
        }
        timer.lap(Phase::Build, t1);
        let single_group = groups.len() == 1;
        let mut failed = 0u64;
        for (g, seg) in groups.into_iter().zip(routes) {
            let route = &seg.routes[g.route as usize];
            let peer = &route.peer;
            let n = g.requests.len();
            // With several groups, this group's indices: to fail them if its transport refuses,
            // and for metrics to tell its failures from the others'. One group needs neither.
            let indices: Vec<u32> = if single_group {
                Vec::new()
            } else {
                g.requests.iter().map(|r| r.index).collect()
            };
            let group_bytes = match (&route.metrics, single_group) {
                (None, _) => 0,
                (Some(_), true) => bytes,
                (Some(_), false) => g.requests.iter().map(|r| r.len).sum(),
            };
            if !peer.is_healthy() {
                // Lost (a peer that went away, or a connection cut for another batch's deadline):
                // the group waits for the reconnect and goes on the new connection.
                let parked = Parked {
                    segment: g.segment,
                    was: seg.clone(),
                    transport: route.transport,
                    requests: g.requests,
                    state: state.clone(),
                    deadline_peers: deadline_peers.clone(),
                    deadline: deadline.map(|d| tokio::time::Instant::now() + d),
                    ctx: ctx.clone(),
                };
                if let Err((requests, err)) = parked.wait_for_reconnect(self) {
                    failed += n as u64;
                    state.fail_many(requests.iter().map(|r| r.index as usize), &err);
                }
            } else {
                if let Some(d) = &deadline_peers {
                    d.add(peer);
                }
                // A transport that returns Err started nothing.
                if let Err(e) = peer.submit(g.requests, &state, &ctx) {
                    failed += n as u64;
                    if single_group {
                        state.fail_many(0..requests.len(), &e);
                    } else {
                        state.fail_many(indices.iter().map(|&i| i as usize), &e);
                    }
                }
            }
            if let (Some(r), Some(m)) = (&mut record, &route.metrics) {
                r.group(m, n, group_bytes, indices);
            }
        }
        if let (Some(after), Some(peers)) = (deadline, deadline_peers) {
            // Armed when a request went anywhere; a failover that starts one later needs it too.
            if !peers.is_empty() || !state.is_complete() {
                super::deadline::arm(&self.runtime, &state, peers, after);
            }
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

impl EngineInner {
    /// Gives the batch a failover hook when one of its groups has a second route for its memory
    /// kinds. Only such a batch pays for failover (a copy of those requests and a hook); finding
    /// out is a few comparisons per group.
    fn install_failover(
        self: &Arc<Self>,
        groups: &[Group],
        routes: &[Arc<OpenSegment>],
        state: &Arc<BatchState>,
        deadline: Option<Duration>,
        deadline_peers: &Option<DeadlinePeers>,
        ctx: &SubmitContext,
    ) {
        let mut failover: Option<failover::Builder> = None;
        for (g, seg) in groups.iter().zip(routes) {
            let route = g.route as usize;
            if let Some((local, remote)) = g.kinds {
                if route < 64 && seg.has_untried(local, remote, 1 << route) {
                    failover
                        .get_or_insert_with(|| {
                            let attempts = self.failover.attempts;
                            failover::Builder::new(self, state, attempts, deadline, deadline_peers.clone(), ctx.clone())
                        })
                        .track(g.segment, seg, route, local, remote, &g.requests);
                }
            }
        }
        if let Some(f) = failover {
            f.install(state);
        }
    }
}

/// A group whose route's connection was found lost at submit: it goes on the same transport's
/// new connection once the reconnect it starts (or joins) ended, bounded by the batch's deadline
/// like a failover. Not: after the peer restarted (its memory went with the old process), when
/// the segment was closed meanwhile, or when the reconnect failed, which fail the group naming it.
struct Parked {
    segment: u32,
    was: Arc<OpenSegment>,
    transport: usize,
    requests: Vec<te_base::ResolvedRequest>,
    state: Arc<BatchState>,
    deadline_peers: Option<DeadlinePeers>,
    /// The batch's deadline: the wait ends there (the deadline's timer has no peer to cut).
    deadline: Option<tokio::time::Instant>,
    ctx: SubmitContext,
}

impl Parked {
    /// Starts the wait; gives the group back with the error when no reconnect can start.
    fn wait_for_reconnect(
        self,
        engine: &Arc<EngineInner>,
    ) -> std::result::Result<(), (Vec<te_base::ResolvedRequest>, Error)> {
        let Some(mut reconnected) = engine.reconnect_later(self.segment) else {
            let err = Error::SegmentClosed(self.was.descriptor.name.clone());
            return Err((self.requests, err));
        };
        let weak = Arc::downgrade(engine);
        let deadline = self.deadline;
        engine.runtime.spawn(async move {
            let ended = async {
                match reconnected.wait_for(|o| o.is_some()).await {
                    Ok(o) => o.clone().unwrap_or(Ok(())),
                    Err(_) => Err("the segment was closed".to_string()),
                }
            };
            let outcome = match deadline {
                Some(at) => tokio::select! {
                    o = ended => o,
                    _ = tokio::time::sleep_until(at) => return self.fail(&self.past_deadline()),
                },
                None => ended.await,
            };
            self.resume(weak.upgrade(), outcome);
        });
        Ok(())
    }

    fn resume(self, engine: Option<Arc<EngineInner>>, outcome: std::result::Result<(), String>) {
        let name = self.was.descriptor.name.clone();
        let Some(engine) = engine.filter(|e| !e.is_closed()) else {
            return self.fail(&Error::Closed(format!("engine (segment '{name}')")));
        };
        if let Err(why) = outcome {
            return self.fail(&Error::PeerGone {
                peer: name,
                reason: format!("connection lost, and reconnecting failed: {why}"),
            });
        }
        let now = engine.segments.read().get(self.segment as usize).cloned();
        let Some(now) = now.filter(|s| !s.closed) else {
            return self.fail(&Error::SegmentClosed(name));
        };
        if now.descriptor.instance != self.was.descriptor.instance {
            return self.fail(&Error::PeerRestarted {
                peer: name,
                reason: "it restarted while its connection was lost".into(),
            });
        }
        let Some(route) = now
            .routes
            .iter()
            .find(|r| r.transport == self.transport && r.peer.is_healthy())
        else {
            return self.fail(&Error::PeerGone {
                peer: name,
                reason: "connection lost; the reconnect found no healthy route of its transport".into(),
            });
        };
        if let Some(peers) = &self.deadline_peers {
            if !peers.add(&route.peer) {
                return self.fail(&self.past_deadline());
            }
        }
        let indices: Vec<u32> = self.requests.iter().map(|r| r.index).collect();
        if let Err(e) = route.peer.submit(self.requests, &self.state, &self.ctx) {
            // Nothing started: each request fails (through the failover hook, if it has one).
            self.state.fail_many(indices.iter().map(|&i| i as usize), &e);
        }
    }

    /// Fails every request of the group with `err`.
    fn fail(&self, err: &Error) {
        self.state
            .fail_many(self.requests.iter().map(|r| r.index as usize), err)
    }

    /// What the group fails with when the batch's deadline passed while it waited.
    fn past_deadline(&self) -> Error {
        Error::Timeout {
            what: format!(
                "batch to segment '{}' waiting for its reconnect (its deadline)",
                self.was.descriptor.name
            ),
            after_ms: 0,
        }
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
