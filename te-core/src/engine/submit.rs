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
    /// One submit, step by step: check the call, resolve and group its requests, make the batch
    /// (and its failover hook), hand each group to its route, arm the deadline, count the call.
    pub(super) fn submit(self: &Arc<Self>, requests: &[TransferRequest], opts: &SubmitOptions) -> Result<Batch> {
        let timer = opts.timer.as_ref().unwrap_or(&self.timer);
        let t0 = timer.start();
        let mut record = self.export.as_ref().map(|_| BatchRecord::start());
        let deadline = self.check_submit(opts)?;
        let (Grouped { groups, pins, bytes }, routes) = self.resolve_groups(requests)?;
        let t1 = timer.lap(Phase::Resolve, t0);
        let call = Call {
            state: self.new_batch(requests, pins),
            ctx: SubmitContext {
                timer: timer.clone(),
                background: opts.background,
            },
            deadline,
            deadline_peers: deadline.map(|_| DeadlinePeers::default()),
            single_group: groups.len() == 1,
            requests: requests.len(),
            bytes,
        };
        if self.failover.enabled() && !opts.no_failover {
            self.install_failover(&groups, &routes, &call);
        }
        timer.lap(Phase::Build, t1);
        let mut failed = 0u64;
        for (g, seg) in groups.into_iter().zip(routes) {
            failed += self.dispatch_group(g, &seg, &call, &mut record);
        }
        let Call {
            state,
            deadline,
            deadline_peers,
            ..
        } = call;
        if let (Some(after), Some(peers)) = (deadline, deadline_peers) {
            // Armed when a request went anywhere; a failover that starts one later needs it too.
            if !peers.is_empty() || !state.is_complete() {
                super::deadline::arm(&self.runtime, &state, peers, after);
            }
        }
        if let Some(r) = record {
            r.finish(&state);
        }
        self.count_submit(timer, opts, requests.len(), bytes, failed);
        Ok(Batch::new(state))
    }

    /// Refuses a call to a closed engine or with a bad deadline; returns the batch's deadline
    /// (the call's, else the engine's default).
    fn check_submit(&self, opts: &SubmitOptions) -> Result<Option<Duration>> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed(format!("engine '{}'", self.name)));
        }
        if let Some(d) = opts.deadline {
            super::deadline::check(d)?;
        }
        Ok(opts.deadline.or(self.default_deadline))
    }

    /// Resolves and groups every request under one read of the segment table, pinning the
    /// local regions; returns the groups with each one's segment.
    fn resolve_groups(&self, requests: &[TransferRequest]) -> Result<(Grouped, Vec<Arc<OpenSegment>>)> {
        let segs = self.segments.read();
        let grouped = group_requests(requests, &segs, self.registry.local_resolver())?;
        let routes = grouped
            .groups
            .iter()
            .map(|g| segs[g.segment as usize].clone())
            .collect();
        Ok((grouped, routes))
    }

    /// The batch's state: one length per request, the pins kept until the batch is dropped.
    fn new_batch(self: &Arc<Self>, requests: &[TransferRequest], pins: Pins) -> Arc<BatchState> {
        let lens: Box<[u64]> = requests.iter().map(|r| r.len).collect();
        let state = BatchState::new(lens);
        state.keep_alive(Box::new(PinsReaper {
            pins: Some(pins),
            engine: Arc::downgrade(self),
        }));
        state
    }

    /// Hands one group to its route's peer (or parks it for the reconnect when the connection
    /// is lost) and records it for export. Returns how many of its requests failed at once.
    fn dispatch_group(
        self: &Arc<Self>,
        g: Group,
        seg: &Arc<OpenSegment>,
        call: &Call,
        record: &mut Option<BatchRecord>,
    ) -> u64 {
        let route = &seg.routes[g.route as usize];
        let n = g.requests.len();
        // With several groups, this group's indices: to fail them if its transport refuses,
        // and for metrics to tell its failures from the others'. One group needs neither.
        let indices: Vec<u32> = if call.single_group {
            Vec::new()
        } else {
            g.requests.iter().map(|r| r.index).collect()
        };
        let group_bytes = match (&route.metrics, call.single_group) {
            (None, _) => 0,
            (Some(_), true) => call.bytes,
            (Some(_), false) => g.requests.iter().map(|r| r.len).sum(),
        };
        let failed = if route.peer.is_healthy() {
            submit_group(g.requests, &route.peer, &indices, call)
        } else {
            self.park_group(g.segment, seg, route.transport, g.requests, call)
        };
        if let (Some(r), Some(m)) = (record, &route.metrics) {
            r.group(m, n, group_bytes, indices);
        }
        failed
    }

    /// A group whose route's connection is lost (a peer that went away, or a connection cut for
    /// another batch's deadline) waits for the reconnect and goes on the new connection. Returns
    /// how many requests failed at once (all when no reconnect can start).
    fn park_group(
        self: &Arc<Self>,
        segment: u32,
        seg: &Arc<OpenSegment>,
        transport: usize,
        requests: Vec<te_base::ResolvedRequest>,
        call: &Call,
    ) -> u64 {
        let n = requests.len() as u64;
        let parked = Parked {
            segment,
            was: seg.clone(),
            transport,
            requests,
            state: call.state.clone(),
            deadline_peers: call.deadline_peers.clone(),
            deadline: call.deadline.map(|d| tokio::time::Instant::now() + d),
            ctx: call.ctx.clone(),
        };
        match parked.wait_for_reconnect(self) {
            Ok(()) => 0,
            Err((requests, err)) => {
                call.state.fail_many(requests.iter().map(|r| r.index as usize), &err);
                n
            }
        }
    }

    /// Counts the call (the engine's part after the transports' plan and submit).
    fn count_submit(&self, timer: &PhaseTimer, opts: &SubmitOptions, requests: usize, bytes: u64, failed: u64) {
        let t3 = timer.start();
        self.metrics.record_call(requests as u64, bytes, failed);
        timer.lap(Phase::Other, t3);
        // A caller's own timer counts its own calls; the engine counts only into its own.
        if opts.timer.is_none() {
            timer.count_call(requests);
        }
    }
}

/// What every group of one submit shares.
struct Call {
    state: Arc<BatchState>,
    ctx: SubmitContext,
    deadline: Option<Duration>,
    /// The peers the batch went to, for its deadline to cut (`None`: no deadline).
    deadline_peers: Option<DeadlinePeers>,
    /// The call is one group: its indices are the whole batch's.
    single_group: bool,
    /// The call's request count and bytes.
    requests: usize,
    bytes: u64,
}

/// Submits a group on a healthy route. A transport that returns Err started nothing: the
/// group's requests fail (the whole batch's when it is the only group). Returns how many failed.
fn submit_group(
    requests: Vec<te_base::ResolvedRequest>,
    peer: &Arc<dyn te_base::Peer>,
    indices: &[u32],
    call: &Call,
) -> u64 {
    let n = requests.len() as u64;
    if let Some(d) = &call.deadline_peers {
        d.add(peer);
    }
    match peer.submit(requests, &call.state, &call.ctx) {
        Ok(()) => 0,
        Err(e) => {
            if call.single_group {
                call.state.fail_many(0..call.requests, &e);
            } else {
                call.state.fail_many(indices.iter().map(|&i| i as usize), &e);
            }
            n
        }
    }
}

impl EngineInner {
    /// Gives the batch a failover hook when one of its groups has a second route for its memory
    /// kinds. Only such a batch pays for failover (a copy of those requests and a hook); finding
    /// out is a few comparisons per group.
    fn install_failover(self: &Arc<Self>, groups: &[Group], routes: &[Arc<OpenSegment>], call: &Call) {
        let mut failover: Option<failover::Builder> = None;
        for (g, seg) in groups.iter().zip(routes) {
            let route = g.route as usize;
            if let Some((local, remote)) = g.kinds {
                if route < 64 && seg.has_untried(local, remote, 1 << route) {
                    failover
                        .get_or_insert_with(|| {
                            let attempts = self.failover.attempts;
                            failover::Builder::new(
                                self,
                                &call.state,
                                attempts,
                                call.deadline,
                                call.deadline_peers.clone(),
                                call.ctx.clone(),
                            )
                        })
                        .track(g.segment, seg, route, local, remote, &g.requests);
                }
            }
        }
        if let Some(f) = failover {
            f.install(&call.state);
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
