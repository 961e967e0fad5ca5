//! The data path: a connected same-process segment and [`Peer::submit`] (see the crate docs for
//! the steps and for what happens when requests of one batch touch the same memory).

use std::cell::Cell;
use std::sync::{Arc, Weak};

use te_base::device::CopyFragment;
use te_base::{BatchState, Error, Peer, Phase, ResolvedRequest, Result, SegmentDescriptor, SubmitContext};

use crate::copy::{copy_with_threshold, store_fence};
use crate::device::{copy_one, plan_groups, start_groups, DeviceFragment, Group};
use crate::domain::Domain;
use crate::parts::{run_range, split};
use crate::plan::{coalesce, sources_meet_destinations, Coalesced, CopyOp, Fragment, PlanScratch, Spans};
use crate::pool::HeadsUp;
use crate::resolve::{Resolved, Resolver};
use crate::sequential::{copy_in_request_order, Stop};
use crate::shared::Shared;
use crate::table::RegionTable;

/// Smallest part a fanned-out batch is cut into.
const MIN_PART_BYTES: u64 = 16 << 10;
/// Parts per copy worker: more parts than workers lets the submitting thread take over the parts
/// of a helper that is slow to wake.
const PARTS_PER_WORKER: usize = 2;
/// Scratch kept between batches is trimmed back to this many fragments.
const MAX_KEPT_FRAGMENTS: usize = 1 << 20;

/// Per-thread planning vectors, reused by every batch this thread submits.
#[derive(Default)]
struct Scratch {
    frags: Vec<Fragment>,
    ops: Vec<CopyOp>,
    cuts: Vec<crate::parts::Cursor>,
    plan: PlanScratch,
    /// Requests with a device side, and their plan (empty for host-only batches).
    device: DeviceScratch,
}

/// Planning vectors of the device path.
#[derive(Default)]
struct DeviceScratch {
    frags: Vec<DeviceFragment>,
    /// Every fragment of a batch with device requests, for the batch-wide overlap check.
    all: Vec<Fragment>,
    copies: Vec<CopyFragment>,
    groups: Vec<Group>,
}

impl Scratch {
    fn trim(&mut self) {
        let device = &self.device;
        if self.frags.capacity() > MAX_KEPT_FRAGMENTS
            || self.plan.capacity() > MAX_KEPT_FRAGMENTS
            || device.frags.capacity() > MAX_KEPT_FRAGMENTS
            || device.all.capacity() > MAX_KEPT_FRAGMENTS
        {
            *self = Scratch::default();
        }
    }
}

thread_local! {
    static SCRATCH: Cell<Scratch> = Cell::new(Scratch::default());
}

/// The per-thread vectors and failure lists the planned path works with.
struct PlanState<'a> {
    frags: &'a mut Vec<Fragment>,
    ops: &'a mut Vec<CopyOp>,
    cuts: &'a mut Vec<crate::parts::Cursor>,
    plan: &'a mut PlanScratch,
    device: &'a mut DeviceScratch,
    failures: &'a mut Vec<(usize, Error)>,
    group_failures: &'a mut Vec<(std::ops::Range<usize>, Error)>,
}

/// A segment of this process, reached by copying.
pub(crate) struct LocalPeer {
    pub descriptor: SegmentDescriptor,
    /// The initiating transport: its table, pool and configuration.
    pub shared: Arc<Shared>,
    /// The target's domain. Weak: a peer does not keep another engine's transport alive.
    pub target: Weak<Domain>,
}

impl LocalPeer {
    fn gone(&self) -> Error {
        Error::PeerGone {
            peer: self.descriptor.name.clone(),
            reason: "its local transport was shut down or dropped".into(),
        }
    }

    fn run(
        &self,
        requests: &[ResolvedRequest],
        target: &Arc<Domain>,
        batch: &BatchState,
        ctx: &SubmitContext,
        scratch: &mut Scratch,
    ) {
        let t0 = ctx.timer.start();
        let config = &self.shared.config;
        let workers = if ctx.background { 1 } else { config.copy_threads };
        // Announce a large batch to the helpers now, so one may be awake by the time the rest of
        // the batch can be shared.
        let mut heads_up = None;
        let mut bytes = 0u64;
        // The whole batch's bytes bound this group's: below the threshold, skip counting them.
        if workers > 1 && batch.total_bytes() >= config.fanout_min_bytes {
            bytes = requests.iter().fold(0u64, |sum, r| sum.saturating_add(r.len));
            if bytes >= config.fanout_min_bytes {
                heads_up = Some(self.shared.pool.heads_up(workers - 1));
            }
        }
        let local = &self.shared.domain;
        // One read lock per table for the whole batch, held until the copies are done so no region
        // is deregistered under them. Same-process domains are locked in id order, so two batches
        // going opposite ways cannot deadlock behind a waiting writer.
        let same = Arc::ptr_eq(local, target);
        let local_first = local.id() <= target.id();
        let (first, second) = if local_first { (local, target) } else { (target, local) };
        let first_guard = first.table.read();
        let second_guard = (!same).then(|| second.table.read());
        let (a, b): (&RegionTable, &RegionTable) = match &second_guard {
            None => (&first_guard, &first_guard),
            Some(g) => (&first_guard, g),
        };
        let (local_table, remote_table) = if local_first { (a, b) } else { (b, a) };

        let Scratch {
            frags,
            ops,
            cuts,
            plan,
            device,
        } = scratch;
        frags.clear();
        device.frags.clear();
        let mut failures: Vec<(usize, Error)> = Vec::new();
        // Device groups whose copy failed: (their requests in `device.frags`, the plugin's error).
        let mut group_failures: Vec<(std::ops::Range<usize>, Error)> = Vec::new();
        let mut resolver = crate::resolve::Resolver::new(
            local_table,
            remote_table,
            &self.descriptor.name,
            &self.descriptor.buffers,
            &self.shared.devices,
        );

        // In ascending request index (as the engine submits), the batch runs here request by
        // request (see `sequential`) until a request has a device side or, for a large batch, a
        // helper wakes up and enough is left to share: the rest is then planned below. Running the
        // front first and the rest after is the order of their indices, so the promised outcome
        // holds across the seam.
        let by_index = requests.windows(2).all(|w| w[0].index < w[1].index);
        let rest = if by_index {
            let pool = &self.shared.pool;
            let announced = heads_up.is_some();
            // Bytes of the requests before `seen`, kept up to date at each check (one pass overall).
            let (mut seen, mut before) = (0usize, 0u64);
            let share_rest = |pos: usize| {
                if !announced || (config.fanout_needs_awake_helper && !pool.helper_watching()) {
                    return false;
                }
                before += requests[seen..pos]
                    .iter()
                    .fold(0u64, |sum, r| sum.saturating_add(r.len));
                seen = pos;
                bytes.saturating_sub(before) >= config.fanout_min_bytes
            };
            let t1 = ctx.timer.lap(Phase::Plan, t0);
            // SAFETY: the tables stay read-locked until after the copies (the guards are dropped
            // below), and this batch's destinations are written by no one else meanwhile.
            let stop = unsafe {
                copy_in_request_order(
                    requests,
                    &mut resolver,
                    self.shared.kernel,
                    config.nt_copy_min_bytes,
                    &mut failures,
                    share_rest,
                )
            };
            ctx.timer.lap(Phase::Submit, t1);
            match stop {
                Stop::Done => &requests[requests.len()..],
                Stop::At(pos) => &requests[pos..],
            }
        } else {
            requests
        };
        if !rest.is_empty() {
            let t0 = ctx.timer.start();
            self.plan_and_copy(
                rest,
                &mut resolver,
                workers,
                heads_up.take(),
                ctx,
                t0,
                PlanState {
                    frags,
                    ops,
                    cuts,
                    plan,
                    device,
                    failures: &mut failures,
                    group_failures: &mut group_failures,
                },
            );
        }
        drop(heads_up);
        drop(second_guard);
        drop(first_guard);

        for (index, error) in failures {
            batch.fail(index, error);
        }
        for (requests, error) in group_failures {
            batch.fail_many(device.frags[requests].iter().map(|f| f.index as usize), &error);
        }
        // Failed requests are already settled and are skipped by this one counter update. This
        // thread is the only one settling these requests (the engine hands each request to one
        // transport call, and the helpers only copy).
        batch.complete_many_exclusive(requests.iter().map(|r| r.index as usize));
    }

    /// The planned path: resolves `requests`, then sorts and coalesces them (proving them free of
    /// overlaps) and copies them, shared with awake helpers when large; or runs them one by one
    /// in index order when they touch the same memory; device requests go to their plugins.
    #[allow(clippy::too_many_arguments)]
    fn plan_and_copy(
        &self,
        requests: &[ResolvedRequest],
        resolver: &mut Resolver<'_>,
        workers: usize,
        mut heads_up: Option<HeadsUp<'_>>,
        ctx: &SubmitContext,
        t0: Option<std::time::Instant>,
        st: PlanState<'_>,
    ) {
        let PlanState {
            frags,
            ops,
            cuts,
            plan,
            device,
            failures,
            group_failures,
        } = st;
        frags.reserve(requests.len());
        let mut spans = Spans::default();
        for r in requests {
            match resolver.resolve(r) {
                Ok(Resolved::Host(f)) => {
                    spans.add(&f);
                    frags.push(f);
                }
                Ok(Resolved::Device(f)) => {
                    spans.add(&f.as_fragment());
                    device.frags.push(f);
                }
                Err(e) => failures.push((r.index as usize, e)),
            }
        }

        if device.frags.is_empty() {
            let planned = coalesce(frags, plan, ops);
            let in_order = match planned {
                Err(_) => true,
                Ok(_) => spans.may_overlap() && sources_meet_destinations(ops, plan),
            };
            let t1 = ctx.timer.lap(Phase::Plan, t0);
            if in_order {
                drop(heads_up.take());
                frags.sort_unstable_by_key(|f| f.index);
                copy_in_order(frags);
            } else if let Ok(planned) = planned {
                self.copy_host(ops, planned, workers, heads_up.take(), cuts);
            }
            ctx.timer.lap(Phase::Submit, t1);
        } else {
            match plan_with_devices(frags, ops, plan, device, &spans) {
                Some(host) => {
                    let t1 = ctx.timer.lap(Phase::Plan, t0);
                    if host.total_bytes == 0 {
                        // Nothing for the helpers: release them before waiting on the device.
                        drop(heads_up.take());
                    }
                    // Device copies start first: they run on the device while this thread copies
                    // host memory.
                    // SAFETY: every copy lies in live registered regions of the kinds its group
                    // names (held by the read locks until the waits below return), and the whole
                    // batch was checked free of overlapping destinations and of sources meeting
                    // destinations.
                    let pending = unsafe { start_groups(&self.shared.devices, &device.groups, &device.copies) };
                    if host.total_bytes > 0 {
                        self.copy_host(ops, host, workers, heads_up.take(), cuts);
                    }
                    for (group, started) in device.groups.iter().zip(pending) {
                        if let Err(e) = started.and_then(|p| p.wait()) {
                            group_failures.push((group.requests.clone(), e));
                        }
                    }
                    ctx.timer.lap(Phase::Submit, t1);
                }
                None => {
                    let t1 = ctx.timer.lap(Phase::Plan, t0);
                    drop(heads_up.take());
                    self.copy_in_order_with_devices(frags, &mut device.frags, failures);
                    ctx.timer.lap(Phase::Submit, t1);
                }
            }
        }
    }

    /// Copies a planned host batch: inline, or fanned out over the helpers when it is large.
    #[inline]
    fn copy_host(
        &self,
        ops: &[CopyOp],
        planned: Coalesced,
        workers: usize,
        heads_up: Option<HeadsUp<'_>>,
        cuts: &mut Vec<crate::parts::Cursor>,
    ) {
        let config = &self.shared.config;
        let total = planned.total_bytes;
        let parts = if workers <= 1 || total < config.fanout_min_bytes {
            1
        } else {
            ((workers * PARTS_PER_WORKER) as u64).min(total / MIN_PART_BYTES).max(2) as usize
        };
        let (kernel, nt_min) = (self.shared.kernel, config.nt_copy_min_bytes);
        if parts == 1 {
            drop(heads_up);
            for op in ops.iter() {
                // SAFETY: ranges checked against live regions held by the read locks; the
                // planner proved no destination overlaps another copy's source or destination.
                unsafe {
                    copy_with_threshold(
                        kernel,
                        nt_min,
                        op.dst as usize as *mut u8,
                        op.src as usize as *const u8,
                        op.len as usize,
                    )
                };
            }
            store_fence();
        } else {
            split(ops, total, parts, cuts);
            let cuts = &cuts[..];
            let part = |k: usize| {
                // SAFETY: as above; the parts are disjoint byte ranges of the plan, so no two
                // workers write the same bytes.
                unsafe { run_range(ops, cuts[k], cuts[k + 1], kernel, nt_min) }
            };
            match heads_up {
                Some(h) if config.fanout_needs_awake_helper => self.shared.pool.run_if_helped(h, parts, &part),
                h => {
                    drop(h);
                    self.shared.pool.run(parts, &part);
                }
            }
        }
    }

    /// Runs a batch with device requests whose requests touch the same memory: one request at a
    /// time in ascending index, host ones with `memmove` semantics, device ones with the plugin's
    /// synchronous copy. A failed device request fails alone.
    fn copy_in_order_with_devices(
        &self,
        host: &mut [Fragment],
        device: &mut [DeviceFragment],
        failures: &mut Vec<(usize, Error)>,
    ) {
        host.sort_unstable_by_key(|f| f.index);
        device.sort_unstable_by_key(|f| f.index);
        let (mut h, mut d) = (host.iter().peekable(), device.iter().peekable());
        loop {
            let host_next = match (h.peek(), d.peek()) {
                (Some(a), Some(b)) => a.index < b.index,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (None, None) => break,
            };
            if host_next {
                if let Some(f) = h.next() {
                    copy_in_order(std::slice::from_ref(f));
                }
            } else if let Some(f) = d.next() {
                // SAFETY: both ranges lie in live registered regions of the kinds the fragment's
                // group names, held by the read locks; one request at a time, so nothing of ours
                // runs concurrently.
                if let Err(e) = unsafe { copy_one(&self.shared.devices, f) } {
                    failures.push((f.index as usize, e));
                }
            }
        }
    }
}

/// Copies fragments one at a time in the given order with `memmove` semantics (host memory).
fn copy_in_order(frags: &[Fragment]) {
    for f in frags.iter() {
        // SAFETY: both ranges were checked to lie in live registered host regions that stay
        // registered while the caller holds the read locks; `copy` (memmove) allows overlap, and
        // running one request at a time on this thread leaves no concurrent access of ours.
        unsafe {
            std::ptr::copy(f.src as usize as *const u8, f.dst as usize as *mut u8, f.len as usize);
        }
    }
}

/// Plans a batch that has device requests. Host and device addresses share one address space, so
/// the whole batch is checked at once for overlapping destinations and for sources meeting
/// destinations; `None` means it must run request by request. Otherwise `device` holds the device
/// groups and their copies, and `ops` the host plan.
fn plan_with_devices(
    frags: &[Fragment],
    ops: &mut Vec<CopyOp>,
    plan: &mut PlanScratch,
    device: &mut DeviceScratch,
    spans: &Spans,
) -> Option<Coalesced> {
    device.all.clear();
    device.all.extend_from_slice(frags);
    device.all.extend(device.frags.iter().map(DeviceFragment::as_fragment));
    let overlap = match coalesce(&device.all, plan, ops) {
        Err(_) => true,
        Ok(_) => spans.may_overlap() && sources_meet_destinations(ops, plan),
    };
    if overlap {
        return None;
    }
    let first = device.frags.first()?.group;
    if frags.is_empty() && device.frags.iter().all(|f| f.group == first) {
        // One group and no host requests (the common case: a layer to or from one GPU): the
        // batch-wide plan is already that group's coalesced copies.
        device.copies.clear();
        device.copies.extend(ops.iter().map(|o| CopyFragment {
            dst: o.dst,
            src: o.src,
            len: o.len,
        }));
        device.groups.clear();
        device.groups.push(Group {
            key: first,
            copies: 0..device.copies.len(),
            requests: 0..device.frags.len(),
        });
        ops.clear();
        return Some(Coalesced { total_bytes: 0 });
    }
    plan_groups(&mut device.frags, &mut device.copies, &mut device.groups);
    coalesce(frags, plan, ops).ok()
}

impl Peer for LocalPeer {
    fn descriptor(&self) -> &SegmentDescriptor {
        &self.descriptor
    }

    fn submit(&self, requests: Vec<ResolvedRequest>, batch: &Arc<BatchState>, ctx: &SubmitContext) -> Result<()> {
        if !self.shared.domain.is_open() {
            return Err(Error::Closed(format!("{} transport", crate::NAME)));
        }
        let target = self
            .target
            .upgrade()
            .filter(|d| d.is_open())
            .ok_or_else(|| self.gone())?;
        if batch.cancel_requested() {
            for r in &requests {
                batch.cancel(r.index as usize);
            }
            return Ok(());
        }
        let mut scratch = SCRATCH.take();
        self.run(&requests, &target, batch, ctx, &mut scratch);
        scratch.trim();
        SCRATCH.set(scratch);
        Ok(())
    }

    fn is_healthy(&self) -> bool {
        self.shared.domain.is_open() && self.target.upgrade().is_some_and(|d| d.is_open())
    }

    fn notify(&self, note: te_base::Notification, done: &Arc<BatchState>, index: usize) -> Result<()> {
        let target = self
            .target
            .upgrade()
            .filter(|d| d.is_open())
            .ok_or_else(|| self.gone())?;
        crate::notify::deliver(&target, &self.descriptor.name, note, done, index);
        Ok(())
    }
}
