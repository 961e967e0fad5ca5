//! Failover: a request that fails for its route's sake (the connection, the NIC, the peer's
//! endpoint) is resubmitted, whole, on the next route that reaches the same segment with the same
//! memory kinds, up to the policy's attempts and never past the batch's deadline; it is reported
//! failed only when no route is left. Failures at submit time (a lost connection, a transport that
//! refuses the batch) and at completion take the same path: the batch's [`FailureHook`] takes the
//! request over before it settles, and a task on the engine's runtime resubmits it.
//!
//! A route that keeps failing is paused ([`crate::route_health`]): new batches avoid it, and when
//! its cooldown ends a probe (a small READ over that route alone, as warm-up sends) must pass
//! before it carries traffic again.
//!
//! Correctness of a re-run: a transport fails a request only once it no longer touches its memory
//! (`Peer` contract), so a WRITE done again writes the same source bytes over whatever part of the
//! range the first attempt reached, and a READ done again lands in full. Batches that cannot fail
//! over (one route for their memory kinds, failover off) carry no hook and pay nothing.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use te_base::config::{parse_var, Env};
use te_base::{BatchState, Error, FailureHook, MemoryKind, ResolvedRequest, Result, SubmitContext};

use super::deadline::DeadlinePeers;
use super::EngineInner;
use crate::route_health::ErrorOutcome;
use crate::segment::OpenSegment;

/// Resubmissions of one request on other routes before it is reported failed; `0` turns
/// failover off (and connects only the preferred route per memory kind). Default 3.
pub const FAILOVER_VAR: &str = "TE_FAILOVER";
/// The first cooldown of a paused route, in milliseconds (it doubles per pause, up to ten times
/// this). Default 30000.
pub const ROUTE_PAUSE_VAR: &str = "TE_ROUTE_PAUSE_MS";

const DEFAULT_ATTEMPTS: u8 = 3;
const MAX_ATTEMPTS: u8 = 16;
const DEFAULT_PAUSE: Duration = Duration::from_secs(30);
/// The probe of a paused route gets this long when no transfer deadline is configured.
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// The engine's failover policy.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FailoverPolicy {
    /// Resubmissions per request; 0: off.
    pub attempts: u8,
    /// First cooldown of a paused route.
    pub first_pause: Duration,
}

impl FailoverPolicy {
    pub fn from_env(env: &dyn Env) -> Result<Self> {
        let attempts = match parse_var::<u8>(env, FAILOVER_VAR)? {
            None => DEFAULT_ATTEMPTS,
            Some(n) if n <= MAX_ATTEMPTS => n,
            Some(n) => {
                return Err(Error::config(
                    FAILOVER_VAR,
                    n.to_string(),
                    format!("at most {MAX_ATTEMPTS} resubmissions per request; 0 turns failover off"),
                ))
            }
        };
        let first_pause = match parse_var::<u64>(env, ROUTE_PAUSE_VAR)? {
            None => DEFAULT_PAUSE,
            Some(ms) if (1..=3_600_000).contains(&ms) => Duration::from_millis(ms),
            Some(ms) => {
                return Err(Error::config(
                    ROUTE_PAUSE_VAR,
                    ms.to_string(),
                    "must be between 1 and 3600000 (an hour)",
                ))
            }
        };
        Ok(FailoverPolicy { attempts, first_pause })
    }

    pub fn enabled(&self) -> bool {
        self.attempts > 0
    }
}

/// True if `e` is the route's failure, which another route may not share: a lost or refused
/// connection, a transport or I/O error, a transport's own stall timeout. Not: what is wrong with
/// the request itself (bounds, registration), a restarted peer (its memory is gone with it), a
/// cancellation, a closing engine.
fn is_route_failure(e: &Error) -> bool {
    matches!(
        e,
        Error::PeerGone { .. }
            | Error::Timeout { .. }
            | Error::Transport { .. }
            | Error::Io { .. }
            | Error::Refused { .. }
            | Error::Unauthenticated { .. }
    )
}

/// A request that may fail over: where it goes and which routes it tried.
#[derive(Clone, Copy)]
struct Tracked {
    request: ResolvedRequest,
    /// Index into [`Shared::segments`].
    segment: u16,
    local: MemoryKind,
    remote: MemoryKind,
    /// The route it is on now.
    route: u8,
    /// Routes it failed on (bit i: route i).
    tried: u64,
    resubmitted: u8,
}

/// A batch's failover state, shared by its hook and the task that resubmits.
pub(crate) struct Shared {
    engine: Weak<EngineInner>,
    batch: Weak<BatchState>,
    attempts: u8,
    deadline: Option<Instant>,
    deadline_peers: Option<DeadlinePeers>,
    ctx: SubmitContext,
    /// The segments its failing-over groups go to, with their ids.
    segments: Vec<(u32, Arc<OpenSegment>)>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// By request index; `None` for requests that cannot fail over.
    tracked: Vec<Option<Tracked>>,
    /// Taken over, waiting for the resubmitting task: (request index, the route it failed on,
    /// its error, reported if no route is left by then).
    queue: Vec<(usize, u8, Error)>,
    /// The resubmitting task runs.
    draining: bool,
    /// Routes whose failure this batch already counted (segment slot, route): one per batch.
    counted: Vec<(u16, u8)>,
}

/// Collects, while a batch is grouped and submitted, what its hook needs. Made for the first
/// group that can fail over, so a batch with none allocates nothing.
pub(crate) struct Builder {
    shared: Shared,
}

impl Builder {
    pub fn new(
        engine: &Arc<EngineInner>,
        batch: &Arc<BatchState>,
        attempts: u8,
        deadline: Option<Duration>,
        deadline_peers: Option<DeadlinePeers>,
        ctx: SubmitContext,
    ) -> Self {
        let mut tracked = Vec::with_capacity(batch.len());
        tracked.resize_with(batch.len(), || None);
        Builder {
            shared: Shared {
                engine: Arc::downgrade(engine),
                batch: Arc::downgrade(batch),
                attempts,
                deadline: deadline.map(|d| Instant::now() + d),
                deadline_peers,
                ctx,
                segments: Vec::new(),
                state: Mutex::new(State {
                    tracked,
                    ..State::default()
                }),
            },
        }
    }

    /// Tracks the requests of a group going to segment `id` over `route` (below 64: routes are
    /// bits of a mask); the caller checked that another route of the segment serves the same
    /// memory kinds ([`OpenSegment::has_untried`]).
    pub fn track(
        &mut self,
        id: u32,
        seg: &Arc<OpenSegment>,
        route: usize,
        local: MemoryKind,
        remote: MemoryKind,
        requests: &[ResolvedRequest],
    ) {
        let slot = match self.shared.segments.iter().position(|(s, _)| *s == id) {
            Some(p) => p,
            None => {
                self.shared.segments.push((id, seg.clone()));
                self.shared.segments.len() - 1
            }
        };
        let state = self.shared.state.get_mut();
        for r in requests {
            if let Some(t) = state.tracked.get_mut(r.index as usize) {
                *t = Some(Tracked {
                    request: *r,
                    segment: slot as u16,
                    local,
                    remote,
                    route: route as u8,
                    tried: 0,
                    resubmitted: 0,
                });
            }
        }
    }

    /// Installs the hook on the batch.
    pub fn install(self, batch: &Arc<BatchState>) {
        let _ = batch.set_failure_hook(Box::new(Hook(Arc::new(self.shared))));
    }
}

struct Hook(Arc<Shared>);

impl FailureHook for Hook {
    /// Runs on the failing transport's thread, possibly under its locks: it decides from the
    /// batch's own state only and calls into no transport (not even `is_healthy`); choosing the
    /// next route, counting the failure and resubmitting happen on the engine's runtime.
    fn intercept(&self, index: usize, error: &Error) -> bool {
        let shared = &self.0;
        if !is_route_failure(error) || shared.deadline.is_some_and(|d| Instant::now() >= d) {
            return false;
        }
        let Some(engine) = shared.engine.upgrade() else {
            return false;
        };
        if engine.is_closed() {
            return false;
        }
        let mut state = shared.state.lock();
        let Some(Some(t)) = state.tracked.get_mut(index) else {
            return false;
        };
        if t.resubmitted >= shared.attempts {
            return false;
        }
        let from = t.route;
        t.tried |= 1 << from;
        let seg = &shared.segments[t.segment as usize].1;
        if !seg.has_untried(t.local, t.remote, t.tried) {
            return false;
        }
        t.resubmitted += 1;
        state.queue.push((index, from, error.clone()));
        let start = !std::mem::replace(&mut state.draining, true);
        drop(state);
        if start {
            let shared = shared.clone();
            engine.runtime.spawn(async move { resubmit(shared) });
        }
        true
    }
}

/// A group of taken-over requests: one transport call per (segment slot, next route, failed
/// route).
struct Regrouped {
    slot: u16,
    to: u8,
    from: u8,
    requests: Vec<ResolvedRequest>,
}

/// Resubmits every request the hook took over, grouped by (segment, route), until none is left.
/// On the engine's runtime: free to ask routes for their health and to count their failures,
/// which it does with the batch's lock released (a transport's thread may hold its own lock
/// while the hook waits for the batch's).
fn resubmit(shared: Arc<Shared>) {
    loop {
        let (Some(batch), Some(engine)) = (shared.batch.upgrade(), shared.engine.upgrade()) else {
            // Nobody waits on the batch any more, or the engine is gone with its transports.
            return shared.fail_queued_closed();
        };
        let Some((work, newly_failed)) = shared.take_work() else {
            return;
        };
        for &(slot, from) in &newly_failed {
            let (id, seg) = &shared.segments[slot as usize];
            engine.route_failed(*id, seg, from as usize);
        }
        // Choose each request's next route (health-aware, so after counting the failures).
        let groups = shared.regroup(&batch, work);
        for group in groups {
            shared.send_group(&engine, &batch, group);
        }
    }
}

impl Shared {
    /// Ends the resubmitting task when the batch or the engine is gone: what it had queued fails
    /// with `Closed` (if anyone still holds the batch).
    fn fail_queued_closed(&self) {
        let queue = {
            let mut state = self.state.lock();
            state.draining = false;
            std::mem::take(&mut state.queue)
        };
        if let Some(batch) = self.batch.upgrade() {
            for (index, ..) in queue {
                batch.fail_final(index, Error::Closed("engine".into()));
            }
        }
    }

    /// Takes the queued work out of the batch's state, with the routes whose failure this batch
    /// has not counted yet (marked counted now). `None` when the queue is empty: the task ends.
    #[allow(clippy::type_complexity)]
    fn take_work(&self) -> Option<(Vec<(Tracked, u8, Error)>, Vec<(u16, u8)>)> {
        let mut state = self.state.lock();
        if state.queue.is_empty() {
            state.draining = false;
            return None;
        }
        let queue = std::mem::take(&mut state.queue);
        let mut work: Vec<(Tracked, u8, Error)> = Vec::with_capacity(queue.len());
        let mut newly_failed: Vec<(u16, u8)> = Vec::new();
        for (index, from, err) in queue {
            let Some(Some(t)) = state.tracked.get(index) else {
                continue;
            };
            let failed = (t.segment, from);
            if !state.counted.contains(&failed) && !newly_failed.contains(&failed) {
                newly_failed.push(failed);
            }
            work.push((*t, from, err));
        }
        state.counted.extend_from_slice(&newly_failed);
        Some((work, newly_failed))
    }

    /// Gives each request of `work` its next route and groups them by (segment, route, failed
    /// route); a request with no route left fails with its error. Records each request's new
    /// route for the hook, should it fail there too.
    fn regroup(&self, batch: &BatchState, work: Vec<(Tracked, u8, Error)>) -> Vec<Regrouped> {
        let mut groups: Vec<Regrouped> = Vec::new();
        let mut moved: Vec<(usize, u8)> = Vec::with_capacity(work.len());
        for (t, from, err) in work {
            let seg = &self.segments[t.segment as usize].1;
            let Some(to) = seg.next_route(t.local, t.remote, t.tried) else {
                // The routes left went away meanwhile: the request fails with its error.
                batch.fail_final(t.request.index as usize, err);
                continue;
            };
            let to = to as u8;
            moved.push((t.request.index as usize, to));
            match groups
                .iter_mut()
                .find(|g| g.slot == t.segment && g.to == to && g.from == from)
            {
                Some(g) => g.requests.push(t.request),
                None => groups.push(Regrouped {
                    slot: t.segment,
                    to,
                    from,
                    requests: vec![t.request],
                }),
            }
        }
        let mut state = self.state.lock();
        for (index, to) in moved {
            if let Some(Some(t)) = state.tracked.get_mut(index) {
                t.route = to;
            }
        }
        groups
    }

    /// Counts a group's failover and submits it on its next route, unless the batch's deadline
    /// passed (its requests fail with `Timeout`). A route that refuses it starts nothing: each
    /// request goes through the hook again, to the next route or to its final failure.
    fn send_group(&self, engine: &Arc<EngineInner>, batch: &Arc<BatchState>, group: Regrouped) {
        let Regrouped {
            slot,
            to: route,
            from,
            requests,
        } = group;
        let seg = &self.segments[slot as usize].1;
        let to = &seg.routes[route as usize];
        engine.count_failover(seg, from as usize, route as usize, requests.len() as u64);
        if let Some(peers) = &self.deadline_peers {
            if !peers.add(&to.peer) {
                let err = Error::Timeout {
                    what: format!(
                        "failover of a batch to segment '{}' (its deadline)",
                        seg.descriptor.name
                    ),
                    after_ms: 0,
                };
                return fail_all(batch, &requests, &err);
            }
        }
        tracing::debug!(
            segment = %seg.descriptor.name,
            from = seg.routes[from as usize].transport_name,
            to = to.transport_name,
            requests = requests.len(),
            "failing over"
        );
        let indices: Vec<u32> = requests.iter().map(|r| r.index).collect();
        if let Err(e) = to.peer.submit(requests, batch, &self.ctx) {
            for i in indices {
                batch.fail(i as usize, e.clone());
            }
        }
    }
}

fn fail_all(batch: &BatchState, requests: &[ResolvedRequest], err: &Error) {
    for r in requests {
        batch.fail_final(r.index as usize, err.clone());
    }
}

impl EngineInner {
    /// Route `route` of segment `id` failed a batch: count it, pause it after repeated errors
    /// (scheduling its probe), and reconnect the segment if the connection itself is lost.
    pub(super) fn route_failed(self: &Arc<Self>, id: u32, seg: &OpenSegment, route: usize) {
        let r = &seg.routes[route];
        let lost = !r.peer.is_healthy();
        let outcome = if lost {
            r.health
                .pause_now()
                .map(ErrorOutcome::Paused)
                .unwrap_or(ErrorOutcome::Counted)
        } else {
            r.health.record_error(Instant::now())
        };
        if lost {
            self.reconnect_later(id);
        }
        if let ErrorOutcome::Paused(cooldown) = outcome {
            tracing::warn!(
                segment = %seg.descriptor.name,
                transport = r.transport_name,
                "route paused for {cooldown:?} after repeated errors"
            );
            self.schedule_probe(id, r.transport, cooldown);
        }
    }

    /// After `cooldown`, probes the route of transport `transport` to segment `id` (the one in
    /// use then: a reconnect may have replaced it): resumed if the probe passes, paused again
    /// with a doubled cooldown if not.
    fn schedule_probe(self: &Arc<Self>, id: u32, transport: usize, cooldown: Duration) {
        let engine = Arc::downgrade(self);
        self.runtime.spawn(async move {
            let mut wait = cooldown;
            loop {
                tokio::time::sleep(wait).await;
                let Some(e) = engine.upgrade() else { return };
                let seg = match e.segments.read().get(id as usize) {
                    Some(s) if !s.closed => s.clone(),
                    _ => return,
                };
                let Some(route) = seg.routes.iter().position(|r| r.transport == transport) else {
                    return;
                };
                let health = seg.routes[route].health.clone();
                if !health.start_probe() {
                    return;
                }
                let timeout = e.default_deadline.unwrap_or(PROBE_TIMEOUT);
                let healthy = seg.routes[route].peer.is_healthy();
                let probe = match e.probe_route(&seg, route, timeout).await {
                    // Nothing to read over it: its connection's health is all there is to probe.
                    Ok(super::warm_up::Probe::Nothing(why)) if !healthy => Err(Error::PeerGone {
                        peer: seg.descriptor.name.clone(),
                        reason: format!("connection lost ({why})"),
                    }),
                    other => other,
                };
                match probe {
                    Ok(_) => {
                        tracing::info!(segment = %seg.descriptor.name, "route of transport #{transport} passed its probe; resumed");
                        health.resume(Instant::now());
                        return;
                    }
                    Err(err) => {
                        wait = health.probe_failed();
                        tracing::warn!(segment = %seg.descriptor.name, "route probe failed ({err}); paused for {wait:?}");
                        if !seg.routes[route].peer.is_healthy() {
                            e.reconnect_later(id);
                        }
                    }
                }
            }
        });
    }

    fn count_failover(&self, seg: &OpenSegment, from: usize, to: usize, requests: u64) {
        self.metrics.record_failover(requests);
        if let Some(export) = &self.export {
            export.failover(seg.routes[from].transport, seg.routes[to].transport, requests);
        }
    }
}
