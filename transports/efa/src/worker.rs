//! The owner thread of one rail: the only thread that posts to the rail's endpoint and reads its
//! completion queue.
//!
//! Posting and completion polling happen on the same thread, so a full transmit queue (`-FI_EAGAIN`)
//! is always resolved by the same loop reading completions: there is no second thread to wait for
//! and no batch that can block its own completions (NIXL deadlocked on exactly that with a
//! 16-descriptor `FI_MORE` chain). Other threads only append whole jobs (one per batch per rail) to
//! the submission queue and wake the owner. When nothing is in flight the owner blocks in
//! `fi_cq_sread`, which also drives progress for peers reading and writing our memory on providers
//! with manual progress (tcp;ofi_rxm, shm).

use std::cell::{Cell, UnsafeCell};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use te_base::{BatchState, Error, TransferOp};

use crate::fabric::{Rail, TRANSPORT};
use crate::ffi;
use crate::idle::IdleMode;
use crate::link::PeerLink;
use crate::mailbox::{Mailbox, NoteJob};
use crate::registry::LocalRegion;

/// Completions read per `fi_cq_read` call.
const CQ_BATCH: usize = 64;
/// Empty polls before the owner stops spinning and waits on the CQ (or yields).
const SPIN_POLLS: u32 = 256;
/// How long an idle owner blocks before rechecking its stop flag.
const IDLE_WAIT_MS: i32 = 100;
/// How long [`RailWorker::stop`] waits for the owner thread before leaving it behind. An owner
/// stuck inside a provider call cannot be interrupted: libfabric 1.17's shm provider spins on a
/// lock in the peer's shared-memory region, and a peer killed while holding it leaves every
/// later post to that peer spinning forever.
const STOP_WAIT: Duration = Duration::from_secs(5);
/// Polling providers: keep yielding (not napping) this long after the last activity.
const POLL_QUIET: Duration = Duration::from_millis(50);
/// Polling providers: a progress call that took this long did work for a peer (copied data into
/// or out of our memory), which counts as activity although no completion of ours shows it.
const SERVED_HINT: Duration = Duration::from_micros(20);
/// Polling providers: the nap between progress calls once quiet.
const POLL_NAP: Duration = Duration::from_micros(50);
/// How long operations already posted to a peer that was aborted (or stalled) may take to come
/// back through the CQ before the rail resets its endpoint to take them from the provider.
const DRAIN: Duration = Duration::from_millis(200);
/// At shutdown, the longest the owner lets posted operations finish: below [`STOP_WAIT`], so
/// [`RailWorker::stop`] still sees the owner end.
const SHUTDOWN_DRAIN: Duration = Duration::from_secs(4);

/// One RMA operation of a job.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fragment {
    /// Index of the request in the caller's batch.
    pub request: u32,
    pub op: TransferOp,
    pub local: u64,
    pub len: u64,
    /// Local descriptor on this rail (null when the provider needs none).
    pub desc: *mut c_void,
    /// Remote address as the target's provider expects it (virtual address or offset).
    pub remote: u64,
    pub rkey: u64,
    /// The peer's address in this rail's AV.
    pub dest: u64,
}

/// A fragment plus the context area libfabric gets for it. `scratch` comes first so the context
/// pointer handed to libfabric is the slot's address; providers that need FI_CONTEXT/FI_CONTEXT2
/// use the 64 bytes as their own.
#[repr(C, align(64))]
pub(crate) struct Slot {
    scratch: UnsafeCell<[usize; 8]>,
    frag: Fragment,
    job: *const RailJob,
    /// Its completion was read (or the endpoint that held it was closed).
    returned: Cell<bool>,
}

/// What all rails' jobs of one batch share.
pub(crate) struct BatchPlan {
    pub batch: Arc<BatchState>,
    pub peer: Arc<PeerLink>,
    /// Fragments still outstanding per request (requests split across rails or at max_msg_size).
    pub fragments_left: Box<[AtomicU32]>,
    /// Local regions the batch uses; deregistration is refused while any job holds them.
    pub regions: Vec<Arc<LocalRegion>>,
    /// The first error of each request that has failed fragments (failure path only; a map, as
    /// a dead peer fails every request of a batch of thousands).
    pub errors: Mutex<HashMap<u32, Error>>,
    /// Set before the first entry of `errors`: the success path takes no lock until then.
    pub has_errors: AtomicBool,
}

impl BatchPlan {
    /// One fragment of `request` is back from the provider (or was never posted). The request
    /// settles with its last fragment, so it never fails while the provider still owns a part
    /// of it: settling releases the pins on its memory.
    fn fragment_done(&self, request: u32) {
        if let Some(left) = self.fragments_left.get(request as usize) {
            if left.fetch_sub(1, Ordering::AcqRel) == 1 {
                if !self.has_errors.load(Ordering::Acquire) {
                    self.batch.complete(request as usize);
                    return;
                }
                let error = self.errors.lock().remove(&request);
                match error {
                    Some(e) => self.batch.fail(request as usize, e),
                    None => self.batch.complete(request as usize),
                }
            }
        }
    }

    /// One fragment of `request` failed with `error` (and is back from the provider).
    fn fragment_failed(&self, request: u32, error: Error) {
        self.has_errors.store(true, Ordering::Release);
        self.errors.lock().entry(request).or_insert(error);
        self.fragment_done(request);
    }
}

/// The fragments of one batch that go over one rail.
pub(crate) struct RailJob {
    plan: Arc<BatchPlan>,
    slots: Box<[Slot]>,
    next: usize,
    outstanding: Cell<usize>,
    progress: Cell<u64>,
    seen_progress: u64,
    last_progress: Option<Instant>,
    /// When the owner found the job ended (its peer aborted or stalled, or its batch cut) with
    /// operations still posted.
    dead_since: Option<Instant>,
    /// The batch was cut short by its deadline ([`te_base::Peer::abort_batch`]): the error its
    /// requests fail with. Other jobs of the peer go on.
    cut: Option<Error>,
    /// Slots whose operations an endpoint reset discarded, to be posted again (the job's batch
    /// is still wanted: only another job ended).
    repost: Vec<usize>,
}

// SAFETY: a job is built on the submitting thread and then owned by exactly one owner thread; its
// raw pointers (descriptors, the slot back-pointers) are plain tokens or point into the job itself.
unsafe impl Send for RailJob {}

impl RailJob {
    /// Builds a job from fragments (one allocation for all slots).
    pub(crate) fn new(plan: Arc<BatchPlan>, fragments: impl ExactSizeIterator<Item = Fragment>) -> Box<RailJob> {
        let slots: Box<[Slot]> = fragments
            .map(|frag| Slot {
                scratch: UnsafeCell::new([0; 8]),
                frag,
                job: std::ptr::null(),
                returned: Cell::new(false),
            })
            .collect();
        let mut job = Box::new(RailJob {
            plan,
            slots,
            next: 0,
            outstanding: Cell::new(0),
            progress: Cell::new(0),
            seen_progress: 0,
            last_progress: None,
            dead_since: None,
            cut: None,
            repost: Vec::new(),
        });
        let me: *const RailJob = &*job;
        for s in job.slots.iter_mut() {
            s.job = me;
        }
        job
    }

    fn finished(&self) -> bool {
        self.next == self.slots.len() && self.repost.is_empty() && self.outstanding.get() == 0
    }

    /// Whether the job's requests are to fail: its batch was cut, or its peer aborted or gone.
    fn ended(&self) -> bool {
        self.cut.is_some() || !self.plan.peer.is_healthy()
    }

    /// What an ended job's requests fail with: the cut's error, or the peer's.
    fn end_error(&self) -> Error {
        match &self.cut {
            Some(e) => e.clone(),
            None => self.plan.peer.gone_error(),
        }
    }

    /// Fails every fragment not posted (never posted, or discarded by a reset) with `error`: the
    /// provider does not hold them.
    fn fail_rest(&mut self, error: &Error) {
        for i in self.repost.drain(..) {
            self.plan.fragment_failed(self.slots[i].frag.request, error.clone());
        }
        for s in &self.slots[self.next..] {
            s.returned.set(true);
            self.plan.fragment_failed(s.frag.request, error.clone());
        }
        self.next = self.slots.len();
    }

    /// The endpoint holding this job's posted operations was closed while the job is still
    /// wanted: what it discarded is posted again on the new endpoint. Writing the same bytes to
    /// the same place again (or reading them again) is harmless: the request has not settled.
    fn repost_unreturned(&mut self) {
        for (i, s) in self.slots[..self.next].iter().enumerate() {
            if !s.returned.replace(true) {
                self.repost.push(i);
            }
        }
        self.outstanding.set(0);
    }

    /// shm after the stall timeout: fails the posted fragments whose completion has not come,
    /// while the job (and the regions it pins in this transport) stays until it does.
    fn fail_posted_keep_job(&mut self, error: &Error) {
        for s in &self.slots[..self.next] {
            if !s.returned.replace(true) {
                self.plan.fragment_failed(s.frag.request, error.clone());
            }
        }
    }

    /// Fails the posted fragments whose completion never came, once the endpoint that held them
    /// is closed (nothing of them moves any more).
    fn fail_unreturned(&mut self, error: &Error) {
        for s in &self.slots[..self.next] {
            if !s.returned.replace(true) {
                self.plan.fragment_failed(s.frag.request, error.clone());
            }
        }
        self.outstanding.set(0);
    }
}

struct Shared {
    rail: Arc<Rail>,
    // Boxed: a job must not move once posted (its slots are libfabric contexts pointing back at it).
    #[allow(clippy::vec_box)]
    queue: Mutex<Vec<Box<RailJob>>>,
    /// Notifications handed to this rail (rail 0 only), in order.
    notes: Mutex<Vec<NoteJob>>,
    has_work: AtomicBool,
    sleeping: AtomicBool,
    stop: AtomicBool,
    timeout: Duration,
    idle: IdleMode,
    /// Closing our endpoint takes posted operations back from the provider (not on shm, where
    /// the peer copies from our memory with process_vm_readv on commands already in its queue).
    reset_reclaims: bool,
}

/// Handle on a rail's owner thread.
pub(crate) struct RailWorker {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Disconnects when the owner thread ends (its sender is dropped, on unwinding too).
    exited: Mutex<Option<mpsc::Receiver<()>>>,
}

impl RailWorker {
    /// Starts the owner thread of `rail`; with `mailbox`, the rail also sends and receives
    /// notifications.
    pub(crate) fn start(
        rail: Arc<Rail>,
        index: usize,
        timeout: Duration,
        idle: Option<IdleMode>,
        mailbox: Option<Mailbox>,
    ) -> te_base::Result<RailWorker> {
        let idle = idle.unwrap_or_else(|| IdleMode::for_provider(&rail.attrs.provider, rail.cq_can_wait));
        let reset_reclaims = crate::fabric::core_provider(&rail.attrs.provider) != "shm";
        let shared = Arc::new(Shared {
            reset_reclaims,
            idle,
            rail,
            queue: Mutex::new(Vec::new()),
            notes: Mutex::new(Vec::new()),
            has_work: AtomicBool::new(false),
            sleeping: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            timeout,
        });
        let s = shared.clone();
        let (exit_tx, exit_rx) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("te-efa-rail{index}"))
            .spawn(move || {
                let _exit = exit_tx;
                Owner::new(s, mailbox).run()
            })
            .map_err(|e| Error::io("spawning the efa rail owner thread", e))?;
        Ok(RailWorker {
            shared,
            thread: Mutex::new(Some(thread)),
            exited: Mutex::new(Some(exit_rx)),
        })
    }

    /// The rail this worker owns.
    pub(crate) fn rail(&self) -> &Arc<Rail> {
        &self.shared.rail
    }

    /// Hands a job to the owner thread. One lock and at most one wake-up per batch.
    pub(crate) fn enqueue(&self, job: Box<RailJob>) {
        if self.shared.stop.load(Ordering::Acquire) {
            let mut job = job;
            job.fail_rest(&Error::Closed("efa transport".into()));
            return;
        }
        self.shared.queue.lock().push(job);
        self.shared.has_work.store(true, Ordering::SeqCst);
        if self.shared.sleeping.load(Ordering::SeqCst) {
            self.wake();
        }
    }

    /// Hands a notification to the owner thread (a rail started with a mailbox).
    pub(crate) fn enqueue_note(&self, job: NoteJob) {
        if self.shared.stop.load(Ordering::Acquire) {
            job.done.fail(job.index, Error::Closed("efa transport".into()));
            return;
        }
        self.shared.notes.lock().push(job);
        self.shared.has_work.store(true, Ordering::SeqCst);
        if self.shared.sleeping.load(Ordering::SeqCst) {
            self.wake();
        }
    }

    /// Makes the owner look at its jobs again (a peer was aborted).
    pub(crate) fn nudge(&self) {
        self.shared.has_work.store(true, Ordering::SeqCst);
        self.wake();
    }

    fn wake(&self) {
        self.shared.rail.cq_signal();
        if let Some(t) = self.thread.lock().as_ref() {
            t.thread().unpark();
        }
    }

    /// Stops the owner thread; requests still queued or in flight fail with `Closed`. Waits at
    /// most [`STOP_WAIT`]: an owner stuck inside the provider is left behind (logged), with the
    /// rail it holds, rather than hanging whoever drops the transport.
    pub(crate) fn stop(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.wake();
        let Some(thread) = self.thread.lock().take() else {
            return;
        };
        let exited = self.exited.lock().take();
        let ended = exited.is_none_or(|rx| rx.recv_timeout(STOP_WAIT) != Err(mpsc::RecvTimeoutError::Timeout));
        if ended {
            let _ = thread.join();
        } else {
            tracing::error!(
                rail = %self.shared.rail.attrs.domain,
                "efa: the rail's owner thread did not stop within {} s (stuck inside the provider, \
                 as on shm after a peer died holding its region lock); leaving it behind",
                STOP_WAIT.as_secs()
            );
        }
    }
}

impl Drop for RailWorker {
    fn drop(&mut self) {
        self.stop();
    }
}

/// State private to the owner thread.
struct Owner {
    shared: Arc<Shared>,
    // Boxed for the same reason as the queue: posted jobs stay at a fixed address.
    #[allow(clippy::vec_box)]
    active: Vec<Box<RailJob>>,
    ctxs: [*mut c_void; CQ_BATCH],
    lens: [usize; CQ_BATCH],
    mailbox: Option<Mailbox>,
}

impl Owner {
    fn new(shared: Arc<Shared>, mailbox: Option<Mailbox>) -> Self {
        Owner {
            shared,
            active: Vec::new(),
            ctxs: [std::ptr::null_mut(); CQ_BATCH],
            lens: [0; CQ_BATCH],
            mailbox,
        }
    }

    fn run(mut self) {
        let mut idle_polls = 0u32;
        let mut idle_since: Option<Instant> = None;
        loop {
            if self.shared.has_work.swap(false, Ordering::AcqRel) {
                let mut q = self.shared.queue.lock();
                self.active.append(&mut q);
                drop(q);
                if let Some(mb) = self.mailbox.as_mut() {
                    mb.push(self.shared.notes.lock().drain(..));
                }
                // A cut wakes the owner (and so do new jobs, which may belong to a cut batch):
                // looked up once per wake-up, not per post.
                self.apply_cuts();
            }
            if self.shared.stop.load(Ordering::Acquire) {
                self.shut_down();
                return;
            }
            let posted = self.post();
            let timed = (self.shared.idle == IdleMode::Poll && self.active.is_empty()).then(Instant::now);
            let completed = self.poll();
            let served = timed.is_some_and(|t| t.elapsed() >= SERVED_HINT);
            self.active.retain(|j| !j.finished());
            if posted || completed > 0 || served {
                idle_polls = 0;
                idle_since = None;
                continue;
            }
            idle_polls = idle_polls.saturating_add(1);
            if !self.active.is_empty() {
                self.check_stalls();
                self.reap_dead();
            }
            if let Some(mb) = self.mailbox.as_mut().filter(|m| m.busy()) {
                mb.check_timeouts();
            }
            if idle_polls < SPIN_POLLS {
                continue;
            }
            match self.shared.idle {
                IdleMode::Block if self.active.is_empty() => self.wait_idle(),
                IdleMode::Block => {
                    // Sleep in the provider until a completion or traffic arrives (1 ms at most,
                    // so stalls are still noticed).
                    let n = self.shared.rail.cq_sread(&mut self.ctxs, &mut self.lens, 1);
                    self.handle_read(n);
                }
                IdleMode::Poll => {
                    // Incoming RMA produces no completion here, yet the provider needs our progress
                    // calls to serve it: keep polling, yielding the core, and nap only after a
                    // quiet spell.
                    let since = *idle_since.get_or_insert_with(Instant::now);
                    if since.elapsed() < POLL_QUIET {
                        std::thread::yield_now();
                    } else {
                        self.nap();
                    }
                }
            }
        }
    }

    /// Nothing of ours in flight on a provider whose CQ wakes on traffic: block in the provider
    /// (which keeps serving peers) until work arrives.
    fn wait_idle(&mut self) {
        self.shared.sleeping.store(true, Ordering::SeqCst);
        if !self.shared.has_work.load(Ordering::SeqCst) && !self.shared.stop.load(Ordering::SeqCst) {
            let n = self.shared.rail.cq_sread(&mut self.ctxs, &mut self.lens, IDLE_WAIT_MS);
            self.handle_read(n);
        }
        self.shared.sleeping.store(false, Ordering::SeqCst);
    }

    /// A short park between progress calls on polling providers; new work unparks at once.
    fn nap(&mut self) {
        self.shared.sleeping.store(true, Ordering::SeqCst);
        if !self.shared.has_work.load(Ordering::SeqCst) && !self.shared.stop.load(Ordering::SeqCst) {
            std::thread::park_timeout(POLL_NAP);
        }
        self.shared.sleeping.store(false, Ordering::SeqCst);
    }

    /// Posts every fragment it can. Stops at the first `-FI_EAGAIN` (the queue is full: the caller
    /// polls completions next). Returns true if anything was posted or settled.
    fn post(&mut self) -> bool {
        let rail = &self.shared.rail;
        let mut any = self.mailbox.as_mut().is_some_and(Mailbox::pump);
        for job in self.active.iter_mut() {
            if job.next == job.slots.len() && job.repost.is_empty() {
                continue;
            }
            if job.next == 0 && job.plan.batch.cancel_requested() {
                let batch = &job.plan.batch;
                for s in job.slots.iter() {
                    batch.cancel(s.frag.request as usize);
                }
                job.next = job.slots.len();
                any = true;
                continue;
            }
            if job.last_progress.is_none() {
                // The stall clock starts when the job first gets a chance to post.
                job.last_progress = Some(Instant::now());
            }
            if job.ended() {
                // Cut, aborted or gone: what the provider does not hold fails now; what it holds
                // fails when its completion comes back, or when `reap_ended` takes it back by a
                // reset.
                let err = job.end_error();
                job.fail_rest(&err);
                any = true;
                continue;
            }
            // Operations a reset discarded first, then the rest in order.
            while let Some(&i) = job.repost.last() {
                match post_slot(rail, job, i) {
                    Posted::Full => break,
                    Posted::Yes | Posted::Failed => {
                        job.repost.pop();
                        any = true;
                    }
                }
            }
            if !job.repost.is_empty() {
                continue;
            }
            while job.next < job.slots.len() {
                match post_slot(rail, job, job.next) {
                    // Full queue, or (shm) a peer not yet ready: our completions are polled next;
                    // other jobs may still post (their peer may be ready).
                    Posted::Full => break,
                    Posted::Yes | Posted::Failed => {
                        job.next += 1;
                        any = true;
                    }
                }
            }
        }
        any
    }

    /// Jobs whose batch was cut by its deadline: fragments not posted fail at once with the cut's
    /// error; posted ones when they come back, or when `reap_ended` takes them back.
    fn apply_cuts(&mut self) {
        for job in self.active.iter_mut() {
            if job.cut.is_some() {
                continue;
            }
            if let Some(err) = job.plan.peer.cuts.error_of(&job.plan.batch) {
                job.fail_rest(&err);
                job.cut = Some(err);
            }
        }
    }

    /// Reads one batch of completions. Returns how many operations settled.
    fn poll(&mut self) -> usize {
        let n = self.shared.rail.cq_read(&mut self.ctxs, &mut self.lens);
        self.handle_read(n)
    }

    fn handle_read(&mut self, n: isize) -> usize {
        if n > 0 {
            for (&ctx, &len) in self.ctxs[..n as usize].iter().zip(&self.lens) {
                if let Some((mb, i)) = self.mailbox.as_mut().and_then(|m| m.owns(ctx).map(|i| (m, i))) {
                    mb.completed(i, len, None);
                    continue;
                }
                // SAFETY: every other context we post is a Slot inside a live job (jobs are
                // retired only after all their completions are read).
                unsafe { settle(ctx, None) };
            }
            return n as usize;
        }
        if n == -ffi::FI_EAVAIL {
            let Some((ctx, err, text)) = self.shared.rail.cq_readerr() else {
                return 0;
            };
            if ctx.is_null() {
                tracing::warn!(%text, "efa: error completion without a context");
                return 1;
            }
            if let Some((mb, i)) = self.mailbox.as_mut().and_then(|m| m.owns(ctx).map(|i| (m, i))) {
                mb.completed(i, 0, Some((err, text)));
                return 1;
            }
            // SAFETY: as above.
            unsafe { settle(ctx, Some((err, text))) };
            return 1;
        }
        if n < 0 {
            tracing::warn!(error = %ffi::strerror(n as i64), "efa: fi_cq_read failed");
        }
        0
    }

    /// Reads the CQ until it is empty (bounded).
    fn drain_cq(&mut self) {
        for _ in 0..1024 {
            if self.poll() == 0 {
                return;
            }
        }
    }

    /// Marks the peer of a job that has not completed anything for the timeout gone. Its requests
    /// then fail as [`Owner::post`] and [`Owner::reap_dead`] say: never while the provider still
    /// owns a part of them.
    fn check_stalls(&mut self) {
        let now = Instant::now();
        let timeout = self.shared.timeout;
        for job in self.active.iter_mut() {
            if !job.plan.peer.is_healthy() || job.finished() {
                continue;
            }
            let p = job.progress.get();
            if p != job.seen_progress {
                job.seen_progress = p;
                job.last_progress = Some(now);
                continue;
            }
            let Some(last) = job.last_progress else {
                continue;
            };
            if now.duration_since(last) >= timeout {
                job.plan.peer.mark_gone(format!(
                    "no progress for {} ms ({} operation(s) outstanding, {} not accepted by the provider)",
                    timeout.as_millis(),
                    job.outstanding.get(),
                    job.slots.len() - job.next
                ));
                self.shared.has_work.store(true, Ordering::SeqCst);
            }
        }
    }

    /// shm: nothing takes an operation queued to a peer back (the peer copies from our memory
    /// itself), so an ended job's posted fragments (its peer dead or aborted, or its batch cut)
    /// fail only when their completions come, or once the job made no progress for the stall
    /// timeout: then the peer is taken to have dropped them (shm 1.x drops refused accesses
    /// unanswered). If it was only stopped, it may still copy from that memory when it resumes;
    /// docs/efa.md says so. The jobs stay (their regions stay registered here) until the
    /// completions come or the endpoint closes. Other jobs are not touched.
    fn reap_stalled_shm(&mut self) -> bool {
        let now = Instant::now();
        let timeout = self.shared.timeout;
        let mut any = false;
        for j in self.active.iter_mut() {
            if j.next == 0 || !j.ended() {
                continue;
            }
            let since = *j.dead_since.get_or_insert(now);
            if j.progress.get() != j.seen_progress {
                j.seen_progress = j.progress.get();
                j.last_progress = Some(now);
            }
            let quiet = j.last_progress.unwrap_or(since);
            if j.slots[..j.next].iter().any(|s| !s.returned.get()) && now.duration_since(quiet) >= timeout {
                let err = j.end_error();
                j.fail_posted_keep_job(&err);
                any = true;
            }
        }
        any
    }

    /// Ended jobs (a dead or aborted peer, a cut batch) whose posted operations did not come back
    /// within [`DRAIN`]: the only way libfabric gives them back is closing the endpoint that holds
    /// them (fi_endpoint(3): discarded, their buffers no longer touched), so the rail reopens its
    /// endpoint at the same address. The ended jobs' requests fail; the operations of every other
    /// job on the rail (other batches, other peers) are posted again on the new endpoint, so a cut
    /// costs them a repost, not a failure. Notifications being sent fail (a repeated NOTIFY could
    /// be queued twice); receives are posted again. Returns true if it reset.
    fn reap_dead(&mut self) -> bool {
        if !self.shared.reset_reclaims {
            return self.reap_stalled_shm();
        }
        let now = Instant::now();
        let mut overdue = false;
        for j in self.active.iter_mut() {
            if j.outstanding.get() == 0 || !j.ended() {
                continue;
            }
            let since = *j.dead_since.get_or_insert(now);
            overdue |= now.duration_since(since) >= DRAIN;
        }
        if !overdue {
            return false;
        }
        // Completions already queued are real results: take them first. Then close, and take
        // whatever the close itself wrote; nothing of the old endpoint can complete after that.
        self.drain_cq();
        let reset = self.shared.rail.reset_endpoint();
        self.drain_cq();
        let rail = &self.shared.rail;
        let stalled: Vec<String> = self
            .active
            .iter()
            .filter(|j| j.dead_since.is_some() && j.outstanding.get() > 0)
            .map(|j| j.plan.peer.name().to_string())
            .collect();
        let lost = Error::transport(
            TRANSPORT,
            format!(
                "the operation was discarded when rail '{}' reset its endpoint to take back operations posted for {} (a peer that stopped responding, or a batch cut by its deadline)",
                rail.attrs.domain,
                stalled.join(", ")
            ),
        );
        match &reset {
            Ok(()) => {
                tracing::warn!(rail = %rail.attrs.domain, peers = ?stalled, "efa: reset the rail's endpoint to take back operations of ended batches; other operations are posted again")
            }
            Err(e) => {
                tracing::error!(rail = %rail.attrs.domain, error = %e, "efa: the rail's endpoint could not be reopened; the rail fails every request")
            }
        }
        for job in self.active.iter_mut() {
            if job.ended() {
                let err = job.end_error();
                job.fail_unreturned(&err);
            } else if reset.is_ok() {
                job.repost_unreturned();
            } else {
                job.fail_unreturned(&lost);
            }
        }
        if let Some(mb) = self.mailbox.as_mut() {
            mb.endpoint_reset(&lost);
        }
        true
    }

    fn shut_down(&mut self) {
        let err = Error::Closed("efa transport".into());
        if let Some(mb) = self.mailbox.as_mut() {
            mb.push(self.shared.notes.lock().drain(..));
            mb.shut_down(&err);
        }
        let mut q = self.shared.queue.lock();
        self.active.append(&mut q);
        drop(q);
        for job in self.active.iter_mut() {
            job.fail_rest(&err);
        }
        // Let posted operations finish while they make progress: until none is outstanding, or
        // none completed for the stall timeout, and never past SHUTDOWN_DRAIN.
        let start = Instant::now();
        let mut last_completion = start;
        let outstanding = |a: &[Box<RailJob>]| a.iter().any(|j| j.outstanding.get() > 0);
        while outstanding(&self.active) {
            let now = Instant::now();
            if now.duration_since(start) >= SHUTDOWN_DRAIN || now.duration_since(last_completion) >= self.shared.timeout
            {
                break;
            }
            if self.poll() > 0 {
                last_completion = now;
            } else {
                std::thread::yield_now();
            }
        }
        if self.shared.reset_reclaims {
            // Closing the endpoint discards what it still holds; its memory is no longer touched,
            // so those requests can fail.
            self.shared.rail.close_endpoint();
            for job in self.active.iter_mut() {
                job.fail_unreturned(&err);
            }
            self.active.clear();
            return;
        }
        // shm: closing takes nothing back (the peer copies from our memory itself), and closing
        // while a peer transport in this process still progressed crashed that peer inside
        // libfabric 1.17 (apparently it used our unmapped region). The endpoint stays open until
        // the rail drops; jobs the provider still holds (a peer that stopped copying) are leaked
        // so their contexts stay valid. Their requests fail now.
        for mut job in self.active.drain(..) {
            let held = job.outstanding.get() > 0;
            job.fail_posted_keep_job(&err);
            if held {
                std::mem::forget(job);
            }
        }
    }
}

/// What posting one slot did.
enum Posted {
    /// The provider took it.
    Yes,
    /// The queue is full (`-FI_EAGAIN`): try again after polling.
    Full,
    /// The provider refused it: its request failed.
    Failed,
}

/// Posts slot `i` of `job` on `rail`.
fn post_slot(rail: &Rail, job: &RailJob, i: usize) -> Posted {
    let slot = &job.slots[i];
    let f = slot.frag;
    let ctx = slot as *const Slot as *mut c_void;
    // SAFETY: the local range lies in a region registered on this rail that the plan keeps
    // registered (regions list) until this job is retired, which happens only after its completion
    // is read (or its endpoint closed); the slot (context scratch) lives in the boxed job, which
    // does not move or drop before then; dest came from this rail's AV.
    let rc = unsafe {
        match f.op {
            TransferOp::Write => rail.post_write(f.local, f.len, f.desc, f.dest, f.remote, f.rkey, ctx),
            TransferOp::Read => rail.post_read(f.local, f.len, f.desc, f.dest, f.remote, f.rkey, ctx),
        }
    };
    if rc == 0 {
        slot.returned.set(false);
        job.outstanding.set(job.outstanding.get() + 1);
        job.progress.set(job.progress.get() + 1);
        Posted::Yes
    } else if rc == -ffi::FI_EAGAIN {
        Posted::Full
    } else {
        let call = match f.op {
            TransferOp::Write => "fi_writemsg",
            TransferOp::Read => "fi_readmsg",
        };
        slot.returned.set(true);
        job.plan
            .fragment_failed(f.request, job.plan.peer.error_from(call, &rail.error(call, rc as i64)));
        Posted::Failed
    }
}

/// Settles the operation whose context is `ctx`: success, or the error text the provider gave.
///
/// # Safety
/// `ctx` must be a `Slot` pointer posted by this rail's owner whose job is still alive.
unsafe fn settle(ctx: *mut c_void, error: Option<(i32, String)>) {
    // SAFETY: guaranteed by the caller.
    let slot = unsafe { &*(ctx as *const Slot) };
    // SAFETY: the back-pointer was set when the job was boxed; the job outlives its slots' completions.
    let job = unsafe { &*slot.job };
    job.outstanding.set(job.outstanding.get().saturating_sub(1));
    if slot.returned.replace(true) {
        return; // already failed after a stall (shm); the job lives until this completion
    }
    job.progress.set(job.progress.get() + 1);
    match error {
        // A peer cut off by an abort: its requests fail with the abort's error even when the
        // provider still finished a part of them.
        None if !job.plan.peer.is_healthy() => job.plan.fragment_failed(slot.frag.request, job.plan.peer.gone_error()),
        // A batch cut by its deadline: a fragment that arrived still counts (the request fails
        // only if another of its fragments did).
        None => job.plan.fragment_done(slot.frag.request),
        Some(_) if job.cut.is_some() => job.plan.fragment_failed(slot.frag.request, job.end_error()),
        Some((err, text)) => {
            let peer = &job.plan.peer;
            let e = if !peer.is_healthy() {
                // Aborted or gone: the operation was flushed for that reason.
                peer.gone_error()
            } else if is_peer_failure(err) {
                peer.mark_gone(text)
            } else {
                // The provider's code stays the error's source (its text names the provider
                // errno too), so a caller can tell a refused key from a fault.
                Error::transport_caused(
                    TRANSPORT,
                    format!("{} to peer '{}' failed", op_name(slot.frag.op), peer.name()),
                    te_base::NativeError {
                        library: "libfabric",
                        code: -(err.unsigned_abs() as i64),
                        text,
                    },
                )
            };
            job.plan.fragment_failed(slot.frag.request, e);
        }
    }
}

fn op_name(op: TransferOp) -> &'static str {
    match op {
        TransferOp::Write => "RMA write",
        TransferOp::Read => "RMA read",
    }
}

/// Error codes that mean the peer (or the path to it) went away.
fn is_peer_failure(err: i32) -> bool {
    matches!(
        err,
        libc::ECONNRESET
            | libc::ECONNREFUSED
            | libc::ECONNABORTED
            | libc::EHOSTUNREACH
            | libc::ENETUNREACH
            | libc::ENOTCONN
            | libc::ETIMEDOUT
            | libc::EPIPE
            | libc::ESRCH
            | libc::ESHUTDOWN
    )
}
