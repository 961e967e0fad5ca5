//! A fixed pool of persistent registration workers pulling items from a shared atomic index.
//!
//! Registering memory is CPU-bound page pinning plus per-domain provider work, so what matters is
//! how many registrations run at once against the cores that serve them. The pool bounds that
//! number (the cap), never starts a thread per buffer, and keeps its threads for the next batch.

use std::cell::Cell;
use std::num::NonZeroUsize;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{Condvar, Mutex};

use super::config::RegistrationConfig;
use super::item::RegistrationItem;
use super::order::RegOrder;
use crate::config::ProcessEnv;
use crate::error::{Error, RegistrationFailure, Result};

/// The most worker threads an unbounded pool keeps. Unbounded means "one worker per item of the
/// batch" (what Mooncake's per-buffer `std::async` did); beyond this many items, the rest queue.
pub const UNBOUNDED_WORKER_CEILING: usize = 1024;

/// Stack size of a worker thread: registration calls go into providers and the kernel, not deep
/// Rust recursion, so a modest stack keeps a large unbounded pool cheap.
const WORKER_STACK_BYTES: usize = 512 << 10;

thread_local! {
    /// Set while a thread runs an item of some pool's batch, so a nested batch runs inline.
    static INSIDE_BATCH: Cell<bool> = const { Cell::new(false) };
}

/// A fixed set of persistent workers that registers and deregisters batches of buffers.
///
/// Semantics of every batch call:
/// - At most `cap` items run at once in this pool, the calling thread included (it works as one
///   of the workers). Batches submitted concurrently from several threads run one after the other,
///   so the bound holds per pool, not per batch. Unbounded (`cap` 0) runs every item of a batch at
///   once, up to [`UNBOUNDED_WORKER_CEILING`].
/// - Items are dispatched in the pool's [`RegOrder`] (ascending by size by default whenever a cap
///   is in force); results come back in the caller's order regardless.
/// - Every item is attempted, even after one has failed.
/// - [`register_batch`](Self::register_batch) either returns every result, or releases every item
///   that succeeded (through the `release` closure, also on the pool) and returns
///   [`Error::RegistrationFailed`] listing every failed item with its index, size, location and
///   cause: a failed batch leaves nothing half-registered.
/// - A panic in a closure is caught and reported as that item's failure.
/// - A batch started from inside another batch's closure runs inline on that thread (still within
///   the cap) rather than deadlocking.
///
/// Worker threads are created when a batch first needs them and then kept, parked, for the next
/// batch; they exit when the pool is dropped.
///
/// ```
/// use te_base::registration::RegistrationPool;
/// use te_base::{MemoryLocation, RegionId, RegionInfo};
///
/// let pool = RegistrationPool::new(4);
/// let regions: Vec<RegionInfo> = (1..=8u64)
///     .map(|i| RegionInfo { id: RegionId(i), base: i << 20, len: i * 4096, location: MemoryLocation::HOST, exported: true })
///     .collect();
/// let keys = pool
///     .register_batch(regions, |r| Ok(r.len / 4096), |_r, _key| Ok(()))
///     .unwrap();
/// assert_eq!(keys, (1..=8).collect::<Vec<u64>>());
/// ```
pub struct RegistrationPool {
    cap: Option<NonZeroUsize>,
    order: RegOrder,
    shared: Arc<Shared>,
    /// Serialises batches so that the cap bounds the whole pool.
    gate: Mutex<()>,
}

impl std::fmt::Debug for RegistrationPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistrationPool")
            .field("cap", &self.cap)
            .field("order", &self.order)
            .field("workers", &self.shared.slots.lock().len())
            .finish()
    }
}

/// The workers, each with its own mailbox so that a batch wakes exactly the helpers it needs, all
/// at once (a shared condition variable would hand its mutex from one waking worker to the next,
/// and on busy cores that chain staggers the start of a large batch).
struct Shared {
    slots: Mutex<Vec<Arc<Slot>>>,
    shutdown: AtomicBool,
}

/// One worker's mailbox.
struct Slot {
    job: Mutex<Option<Arc<dyn Job>>>,
    wake: Condvar,
}

/// A batch as the workers see it.
trait Job: Send + Sync {
    /// Runs items until none is left.
    fn work(&self);
}

impl RegistrationPool {
    /// A pool of at most `cap` concurrent registrations (0 = unbounded), dispatching ascending by
    /// size when capped and in the given order when unbounded.
    pub fn new(cap: usize) -> Self {
        let cap = NonZeroUsize::new(cap);
        let order = if cap.is_some() {
            RegOrder::Ascending
        } else {
            RegOrder::Given
        };
        Self::with_policy(cap, order)
    }

    /// A pool with an explicit cap (`None` = unbounded) and dispatch order.
    pub fn with_policy(cap: Option<NonZeroUsize>, order: RegOrder) -> Self {
        RegistrationPool {
            cap,
            order,
            shared: Arc::new(Shared {
                slots: Mutex::new(Vec::new()),
                shutdown: AtomicBool::new(false),
            }),
            gate: Mutex::new(()),
        }
    }

    /// Replaces the dispatch order.
    pub fn with_order(mut self, order: RegOrder) -> Self {
        self.order = order;
        self
    }

    /// A pool configured by `config` (see [`RegistrationConfig::from_env`]).
    pub fn from_config(config: &RegistrationConfig) -> Self {
        Self::with_policy(config.cap.cap, config.order)
    }

    /// The process-wide pool, configured once from the process environment (see
    /// [`RegistrationConfig::from_env`]). A malformed setting is returned as an error on every call.
    /// The decision (cap and why) is logged once at `info` level.
    pub fn global() -> Result<&'static RegistrationPool> {
        static GLOBAL: OnceLock<Result<(RegistrationConfig, RegistrationPool)>> = OnceLock::new();
        GLOBAL
            .get_or_init(|| {
                let config = RegistrationConfig::from_env(&ProcessEnv)?;
                tracing::info!(target: "te::registration", "registration pool: {config}");
                let pool = RegistrationPool::from_config(&config);
                Ok((config, pool))
            })
            .as_ref()
            .map(|(_, pool)| pool)
            .map_err(Clone::clone)
    }

    /// The cap (`None` = unbounded).
    pub fn cap(&self) -> Option<NonZeroUsize> {
        self.cap
    }

    /// The dispatch order.
    pub fn order(&self) -> RegOrder {
        self.order
    }

    /// Number of worker threads started so far (the calling thread not counted).
    pub fn worker_count(&self) -> usize {
        self.shared.slots.lock().len()
    }

    /// Starts workers ahead of time so that a batch of `items` items does not pay for thread
    /// creation (benchmarks call it before their start barrier).
    pub fn warm_up(&self, items: usize) {
        self.ensure_workers(self.helpers_for(items));
    }

    /// Runs `op` on every item and returns each outcome in the caller's order. Nothing is rolled
    /// back; this is the primitive the batch calls build on.
    pub fn try_each<I, T, F>(&self, items: Vec<I>, op: F) -> Vec<Result<T>>
    where
        I: RegistrationItem + Send + Sync + 'static,
        T: Send + 'static,
        F: Fn(&I) -> Result<T> + Send + Sync + 'static,
    {
        let sizes: Vec<u64> = items.iter().map(|i| i.size()).collect();
        let items = Arc::new(items);
        let run_items = Arc::clone(&items);
        self.run_indexed(&sizes, move |i| op(&run_items[i]))
    }

    /// Registers every item with `register`; on any failure releases the successful ones with
    /// `release` and returns [`Error::RegistrationFailed`] listing every failed item. See the type's
    /// documentation for the full semantics.
    pub fn register_batch<I, T, F, R>(&self, items: Vec<I>, register: F, release: R) -> Result<Vec<T>>
    where
        I: RegistrationItem + Send + Sync + 'static,
        T: Send + 'static,
        F: Fn(&I) -> Result<T> + Send + Sync + 'static,
        R: Fn(&I, T) -> Result<()> + Send + Sync + 'static,
    {
        let sizes: Vec<u64> = items.iter().map(|i| i.size()).collect();
        let items = Arc::new(items);
        let run_items = Arc::clone(&items);
        let outcomes = self.run_indexed(&sizes, move |i| register(&run_items[i]));
        if outcomes.iter().all(|o| o.is_ok()) {
            return outcomes.into_iter().collect();
        }

        let mut failures = Vec::new();
        let mut succeeded = Vec::new();
        for (index, outcome) in outcomes.into_iter().enumerate() {
            match outcome {
                Ok(value) => succeeded.push((index, Mutex::new(Some(value)))),
                Err(cause) => failures.push(failure(&items[index], index, cause)),
            }
        }
        let release_sizes: Vec<u64> = succeeded.iter().map(|(i, _)| sizes[*i]).collect();
        let succeeded = Arc::new(succeeded);
        let release_items = Arc::clone(&items);
        let release_list = Arc::clone(&succeeded);
        let released = self.run_indexed(&release_sizes, move |k| {
            let (index, slot) = &release_list[k];
            match slot.lock().take() {
                Some(value) => release(&release_items[*index], value),
                None => Ok(()),
            }
        });
        for (k, outcome) in released.into_iter().enumerate() {
            if let Err(e) = outcome {
                let index = succeeded[k].0;
                tracing::error!(target: "te::registration", "releasing item {index} after a failed batch failed: {e}");
                let cause = Error::transport(
                    "registration",
                    format!("registered, but releasing it after the batch failed also failed: {e}"),
                );
                failures.push(failure(&items[index], index, cause));
            }
        }
        failures.sort_by_key(|f| f.index);
        Err(Error::RegistrationFailed { failures })
    }

    /// Deregisters every item with `deregister`, attempting all of them; returns
    /// [`Error::RegistrationFailed`] listing every item that failed.
    pub fn deregister_batch<I, F>(&self, items: Vec<I>, deregister: F) -> Result<()>
    where
        I: RegistrationItem + Send + Sync + 'static,
        F: Fn(&I) -> Result<()> + Send + Sync + 'static,
    {
        let sizes: Vec<u64> = items.iter().map(|i| i.size()).collect();
        let items = Arc::new(items);
        let run_items = Arc::clone(&items);
        let outcomes = self.run_indexed(&sizes, move |i| deregister(&run_items[i]));
        let failures: Vec<RegistrationFailure> = outcomes
            .into_iter()
            .enumerate()
            .filter_map(|(index, o)| o.err().map(|cause| failure(&items[index], index, cause)))
            .collect();
        if failures.is_empty() {
            Ok(())
        } else {
            Err(Error::RegistrationFailed { failures })
        }
    }

    /// Helper threads a batch of `n` items uses besides the caller.
    fn helpers_for(&self, n: usize) -> usize {
        let width = match self.cap {
            Some(cap) => cap.get().min(n),
            None => n.min(UNBOUNDED_WORKER_CEILING + 1),
        };
        width.saturating_sub(1)
    }

    /// Starts workers until there are at least `wanted`. A failed spawn leaves the pool smaller
    /// (the batch still completes: the caller works too).
    fn ensure_workers(&self, wanted: usize) {
        let mut slots = self.shared.slots.lock();
        while slots.len() < wanted {
            let slot = Arc::new(Slot {
                job: Mutex::new(None),
                wake: Condvar::new(),
            });
            let (shared, mine) = (Arc::clone(&self.shared), Arc::clone(&slot));
            let spawned = std::thread::Builder::new()
                .name("te-reg-worker".into())
                .stack_size(WORKER_STACK_BYTES)
                .spawn(move || worker_loop(&shared, &mine));
            match spawned {
                Ok(_) => slots.push(slot),
                Err(e) => {
                    tracing::warn!(target: "te::registration", "could not start a registration worker ({e}); continuing with {}", slots.len());
                    break;
                }
            }
        }
    }

    /// Runs `op(i)` for every `i` in `0..sizes.len()` in dispatch order, at most `cap` at once.
    fn run_indexed<T, F>(&self, sizes: &[u64], op: F) -> Vec<Result<T>>
    where
        T: Send + 'static,
        F: Fn(usize) -> Result<T> + Send + Sync + 'static,
    {
        let n = sizes.len();
        if n == 0 {
            return Vec::new();
        }
        let dispatch = self.order.dispatch(sizes);
        if INSIDE_BATCH.with(Cell::get) {
            // Nested inside one of this or another pool's items: run inline, still one at a time.
            let mut results: Vec<Option<Result<T>>> = (0..n).map(|_| None).collect();
            for i in dispatch {
                results[i] = Some(run_guarded(&op, i));
            }
            return results
                .into_iter()
                .map(|r| r.unwrap_or_else(|| Err(lost_item())))
                .collect();
        }

        let _serial = self.gate.lock();
        let helpers = self.helpers_for(n);
        let job = Arc::new(BatchJob {
            dispatch,
            next: AtomicUsize::new(0),
            op,
            results: Mutex::new((0..n).map(|_| None).collect()),
            done: Mutex::new(0),
            all_done: Condvar::new(),
        });
        if helpers > 0 {
            self.ensure_workers(helpers);
            let slots = self.shared.slots.lock();
            // A worker still leaving the previous batch finds this job when it comes back; the
            // previous one is complete, so replacing it is harmless.
            for slot in slots.iter().take(helpers) {
                *slot.job.lock() = Some(job.clone() as Arc<dyn Job>);
                slot.wake.notify_one();
            }
        }
        job.work();
        {
            let mut done = job.done.lock();
            while *done < n {
                job.all_done.wait(&mut done);
            }
        }
        let results = std::mem::take(&mut *job.results.lock());
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(lost_item())))
            .collect()
    }
}

impl Drop for RegistrationPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        for slot in self.shared.slots.lock().iter() {
            let _held = slot.job.lock();
            slot.wake.notify_one();
        }
    }
}

fn worker_loop(shared: &Shared, slot: &Slot) {
    loop {
        let job = {
            let mut mailbox = slot.job.lock();
            loop {
                if shared.shutdown.load(Ordering::Acquire) {
                    return;
                }
                if let Some(job) = mailbox.take() {
                    break job;
                }
                slot.wake.wait(&mut mailbox);
            }
        };
        job.work();
    }
}

struct BatchJob<T, F> {
    dispatch: Vec<usize>,
    next: AtomicUsize,
    op: F,
    results: Mutex<Vec<Option<Result<T>>>>,
    done: Mutex<usize>,
    all_done: Condvar,
}

impl<T, F> Job for BatchJob<T, F>
where
    T: Send + 'static,
    F: Fn(usize) -> Result<T> + Send + Sync + 'static,
{
    fn work(&self) {
        let n = self.dispatch.len();
        INSIDE_BATCH.with(|f| f.set(true));
        loop {
            let k = self.next.fetch_add(1, Ordering::Relaxed);
            if k >= n {
                break;
            }
            let index = self.dispatch[k];
            let outcome = run_guarded(&self.op, index);
            self.results.lock()[index] = Some(outcome);
            let mut done = self.done.lock();
            *done += 1;
            if *done == n {
                self.all_done.notify_all();
            }
        }
        INSIDE_BATCH.with(|f| f.set(false));
    }
}

/// Runs one item, turning a panic into that item's error.
fn run_guarded<T>(op: &(impl Fn(usize) -> Result<T> + ?Sized), index: usize) -> Result<T> {
    catch_unwind(AssertUnwindSafe(|| op(index))).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "non-text panic payload".into());
        Err(Error::transport("registration", format!("panicked: {what}")))
    })
}

fn lost_item() -> Error {
    Error::transport("registration", "item produced no result")
}

fn failure(item: &impl RegistrationItem, index: usize, cause: Error) -> RegistrationFailure {
    RegistrationFailure {
        index,
        len: item.size(),
        location: item.location().to_string(),
        cause: Box::new(cause),
    }
}
