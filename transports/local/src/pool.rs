//! A persistent pool of copy helpers.
//!
//! Threads are started once, with the transport; spawning per call maps and unmaps stacks, which
//! serializes on the address space and cost more than not parallelizing at all (the seed measured
//! it). A call posts its job, works on it itself, and claims parts until none is left, so it never
//! waits for a helper to *start*, only for parts a helper already took. The job lives on the
//! caller's stack: it is reachable by helpers only through the queue, and the caller removes it
//! from the queue and waits until every helper that joined has left before returning.

use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};
use te_base::{Error, Result};

/// Stack size of a helper: it only runs copy loops.
const HELPER_STACK_BYTES: usize = 256 << 10;
/// Longest a woken helper watches for an announced job before parking again. Waking a parked
/// thread takes microseconds to tens of microseconds, so a caller announces a job with
/// [`CopyPool::heads_up`] before planning, and the helper is awake when the plan is ready. A helper
/// watches only while some announcement is open, and never after finishing a job: on a small,
/// shared machine it may sit on the very core its caller needs.
const SPIN: Duration = Duration::from_millis(1);

/// One call's work: `parts` pieces, run as `call(data, k)` for each `k`.
struct Job {
    data: *const (),
    call: unsafe fn(*const (), usize),
    parts: usize,
    next: AtomicUsize,
    participants: AtomicUsize,
    waiter: Thread,
}

impl Job {
    fn claim(&self) -> Option<usize> {
        let k = self.next.fetch_add(1, Ordering::Relaxed);
        (k < self.parts).then_some(k)
    }

    fn has_work(&self) -> bool {
        self.next.load(Ordering::Relaxed) < self.parts
    }

    /// Runs part `k`.
    fn run(&self, k: usize) {
        // SAFETY: `data` and `call` were made together from one `&F` in `CopyPool::run`, which
        // keeps that borrow alive until every participant has left the job.
        unsafe { (self.call)(self.data, k) }
    }
}

unsafe fn call_part<F: Fn(usize) + Sync>(data: *const (), k: usize) {
    // SAFETY: `data` came from a `&F` that outlives the job (see `CopyPool::run`).
    let work = unsafe { &*(data as *const F) };
    work(k);
}

/// A pointer to a job in the queue.
#[derive(Clone, Copy, PartialEq, Eq)]
struct JobPtr(*const Job);

// SAFETY: a job is only dereferenced while it is in the queue (under the queue lock) or by a
// participant the owner waits for; its closure is `Sync`, and its counters are atomics.
unsafe impl Send for JobPtr {}

struct Queue {
    jobs: Vec<JobPtr>,
    shutdown: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    work: Condvar,
    /// Jobs posted so far; spinning helpers watch it without taking the lock.
    posted: AtomicU64,
    /// Helpers awake and watching for a job right now.
    watching: AtomicUsize,
    /// Announcements ([`HeadsUp`]) not yet followed by a job or withdrawn.
    expected: AtomicUsize,
    /// CPU of the latest announcer (-1: unknown). A helper woken onto that CPU would only take
    /// it from the announcer, so it does not watch.
    announcer_cpu: AtomicI32,
}

/// Helper threads that share the copies of large batches with the submitting thread.
pub struct CopyPool {
    shared: Arc<Shared>,
    helpers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for CopyPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyPool")
            .field("helpers", &self.helpers.len())
            .finish()
    }
}

impl CopyPool {
    /// Starts `helpers` threads (0 for a pool that runs everything on the caller).
    pub fn new(helpers: usize) -> Result<Self> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                jobs: Vec::new(),
                shutdown: false,
            }),
            work: Condvar::new(),
            posted: AtomicU64::new(0),
            watching: AtomicUsize::new(0),
            expected: AtomicUsize::new(0),
            announcer_cpu: AtomicI32::new(-1),
        });
        let mut pool = CopyPool {
            shared,
            helpers: Vec::with_capacity(helpers),
        };
        for i in 0..helpers {
            let shared = pool.shared.clone();
            let handle = thread::Builder::new()
                .name(format!("te-local-copy-{i}"))
                .stack_size(HELPER_STACK_BYTES)
                .spawn(move || helper_loop(&shared))
                .map_err(|e| Error::io("starting a local-copy helper thread", e))?;
            pool.helpers.push(handle);
        }
        Ok(pool)
    }

    /// Number of helper threads (the caller of [`CopyPool::run`] works too).
    pub fn helpers(&self) -> usize {
        self.helpers.len()
    }

    /// Announces a job to up to `n` helpers, so they are awake when it is posted. The
    /// announcement lasts until the returned guard is passed to [`CopyPool::run_if_helped`] or
    /// dropped; helpers stop watching then.
    pub fn heads_up(&self, n: usize) -> HeadsUp<'_> {
        self.shared.announcer_cpu.store(current_cpu(), Ordering::Relaxed);
        self.shared.expected.fetch_add(1, Ordering::AcqRel);
        for _ in 0..n.min(self.helpers.len()) {
            self.shared.work.notify_one();
        }
        HeadsUp { shared: &self.shared }
    }

    /// True when a helper is awake and watching for an announced job right now.
    pub fn helper_watching(&self) -> bool {
        self.shared.watching.load(Ordering::Acquire) > 0
    }

    /// Like [`CopyPool::run`], but shares the work only if a helper is awake right now (after a
    /// [`CopyPool::heads_up`]); otherwise runs every part on this thread.
    ///
    /// On a machine with more runnable threads than cores a woken helper may not get a core for
    /// milliseconds (or may be waiting for the caller's own core), and a caller that handed it a
    /// part has to wait that long. A helper that is already watching is on a core of its own, so
    /// the work is shared only then.
    pub fn run_if_helped<F: Fn(usize) + Sync>(&self, heads_up: HeadsUp<'_>, parts: usize, work: &F) {
        let helped = self.shared.watching.load(Ordering::Acquire) > 0;
        if helped {
            self.run_posted(parts, work, Some(heads_up));
        } else {
            drop(heads_up);
            (0..parts).for_each(work);
        }
    }

    /// Runs `work(k)` for every `k` in `0..parts`, on this thread and on helpers that are free,
    /// and returns when all parts are done. Parts run in any order, concurrently.
    pub fn run<F: Fn(usize) + Sync>(&self, parts: usize, work: &F) {
        self.run_posted(parts, work, None);
    }

    fn run_posted<F: Fn(usize) + Sync>(&self, parts: usize, work: &F, heads_up: Option<HeadsUp<'_>>) {
        if parts <= 1 || self.helpers.is_empty() {
            drop(heads_up);
            (0..parts).for_each(work);
            return;
        }
        let job = Job {
            data: work as *const F as *const (),
            call: call_part::<F>,
            parts,
            next: AtomicUsize::new(0),
            participants: AtomicUsize::new(0),
            waiter: thread::current(),
        };
        self.shared.queue.lock().jobs.push(JobPtr(&job));
        self.shared.posted.fetch_add(1, Ordering::Release);
        drop(heads_up);
        // The retire guard runs on every exit, unwinding included, so helpers never see a dead job.
        let _retire = Retire {
            shared: &self.shared,
            job: &job,
        };
        for _ in 0..(parts - 1).min(self.helpers.len()) {
            self.shared.work.notify_one();
        }
        while let Some(k) = job.claim() {
            job.run(k);
        }
    }
}

/// An open announcement of a job (see [`CopyPool::heads_up`]); closing it tells watching helpers
/// to stop waiting for that job.
#[must_use = "the announcement ends when the guard is dropped"]
pub struct HeadsUp<'a> {
    shared: &'a Shared,
}

impl Drop for HeadsUp<'_> {
    fn drop(&mut self) {
        self.shared.expected.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Takes a job out of the queue and waits until every helper that joined it has left.
struct Retire<'a> {
    shared: &'a Shared,
    job: &'a Job,
}

impl Drop for Retire<'_> {
    fn drop(&mut self) {
        let me = JobPtr(self.job);
        {
            let mut queue = self.shared.queue.lock();
            if let Some(pos) = queue.jobs.iter().position(|j| *j == me) {
                queue.jobs.swap_remove(pos);
            }
        }
        // No helper can join any more; wait for those that did. Parking may wake spuriously or
        // on a stale token, hence the loop.
        while self.job.participants.load(Ordering::Acquire) != 0 {
            thread::park();
        }
    }
}

/// Leaves a job: the last participant out wakes its owner. Runs on unwinding too.
struct Leave<'a>(&'a Job);

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        // Clone the owner's handle first: once the count reaches zero the job may be gone.
        let waiter = self.0.waiter.clone();
        if self.0.participants.fetch_sub(1, Ordering::AcqRel) == 1 {
            waiter.unpark();
        }
    }
}

fn helper_loop(shared: &Shared) {
    let mut queue: MutexGuard<'_, Queue> = shared.queue.lock();
    let mut watch = false;
    loop {
        if queue.shutdown {
            return;
        }
        // SAFETY: a job in the queue is alive; its owner removes it under this lock before
        // letting it go.
        let found = queue.jobs.iter().copied().find(|j| unsafe { (*j.0).has_work() });
        let Some(ptr) = found else {
            let cpu = current_cpu();
            if watch && (cpu < 0 || cpu != shared.announcer_cpu.load(Ordering::Relaxed)) {
                watch = false;
                let seen = shared.posted.load(Ordering::Acquire);
                shared.watching.fetch_add(1, Ordering::AcqRel);
                MutexGuard::unlocked(&mut queue, || watch_for_job(shared, seen));
                shared.watching.fetch_sub(1, Ordering::AcqRel);
            } else {
                shared.work.wait(&mut queue);
                watch = true;
            }
            continue;
        };
        watch = false;
        // SAFETY: as above; joining under the lock means the owner, which retires the job under
        // the same lock, will wait for us.
        let job = unsafe { &*ptr.0 };
        job.participants.fetch_add(1, Ordering::Relaxed);
        MutexGuard::unlocked(&mut queue, || {
            let _leave = Leave(job);
            while let Some(k) = job.claim() {
                job.run(k);
            }
        });
    }
}

/// The CPU this thread runs on, or -1 where that cannot be asked. One vDSO call on Linux.
fn current_cpu() -> i32 {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: sched_getcpu takes no arguments and only reads the calling thread's CPU.
        unsafe { libc::sched_getcpu() }
    }
    #[cfg(not(target_os = "linux"))]
    {
        -1
    }
}

/// Watches until a job is posted after `seen`, no job is announced any more, or [`SPIN`] passed.
///
/// Yields between checks: a woken helper is often placed on its waker's core, and spinning there
/// would keep the caller that is planning the job off its own core until the watch times out.
fn watch_for_job(shared: &Shared, seen: u64) {
    let start = Instant::now();
    loop {
        for _ in 0..16 {
            if shared.posted.load(Ordering::Acquire) != seen || shared.expected.load(Ordering::Acquire) == 0 {
                return;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= SPIN {
            return;
        }
        thread::yield_now();
    }
}

impl Drop for CopyPool {
    fn drop(&mut self) {
        self.shared.queue.lock().shutdown = true;
        self.shared.work.notify_all();
        for handle in self.helpers.drain(..) {
            let _ = handle.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_part_runs_once() {
        let pool = CopyPool::new(3).unwrap();
        for parts in [0, 1, 2, 7, 64] {
            let hits: Vec<AtomicU64> = (0..parts).map(|_| AtomicU64::new(0)).collect();
            pool.run(parts, &|k| {
                hits[k].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "{parts} parts");
        }
    }

    #[test]
    fn concurrent_callers_share_the_helpers() {
        let pool = Arc::new(CopyPool::new(1).unwrap());
        let total = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (pool, total) = (pool.clone(), total.clone());
                thread::spawn(move || {
                    for _ in 0..200 {
                        pool.run(5, &|k| {
                            total.fetch_add(k as u64 + 1, Ordering::Relaxed);
                        });
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(total.load(Ordering::Relaxed), 4 * 200 * 15);
    }

    #[test]
    fn work_is_shared_only_with_an_awake_helper() {
        let pool = CopyPool::new(1).unwrap();
        let me = thread::current().id();
        // Nobody watching: everything runs here, nothing is posted, the announcement is closed.
        pool.run_if_helped(pool.heads_up(1), 8, &|_| assert_eq!(thread::current().id(), me));
        assert_eq!(pool.shared.posted.load(Ordering::Acquire), 0);
        assert_eq!(pool.shared.expected.load(Ordering::Acquire), 0);
        // A helper counted as watching: the job is posted and every part still runs once.
        pool.shared.watching.fetch_add(1, Ordering::AcqRel);
        let hits: Vec<AtomicU64> = (0..8).map(|_| AtomicU64::new(0)).collect();
        pool.run_if_helped(pool.heads_up(1), 8, &|k| {
            hits[k].fetch_add(1, Ordering::Relaxed);
        });
        pool.shared.watching.fetch_sub(1, Ordering::AcqRel);
        assert_eq!(pool.shared.posted.load(Ordering::Acquire), 1);
        assert_eq!(pool.shared.expected.load(Ordering::Acquire), 0);
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn a_pool_without_helpers_runs_inline() {
        let pool = CopyPool::new(0).unwrap();
        let me = thread::current().id();
        pool.run(3, &|_| assert_eq!(thread::current().id(), me));
        assert_eq!(pool.helpers(), 0);
    }
}
