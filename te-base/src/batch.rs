//! Completion tracking of a submitted batch: per-request status, a non-blocking poll, an async
//! `wait` (no spinning), and defined cancellation and drop.
//!
//! Dropping a [`Batch`] does not stop transfers already handed to a transport: the shared
//! [`BatchState`] (and the pins on the memory regions it involves, held in its keep-alive list)
//! lives until the last request completes, so memory is never released under an in-flight
//! transfer.

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use event_listener::{Event, Listener};
use parking_lot::Mutex;
use smallvec::SmallVec;

use crate::error::Error;

/// The state of one request of a batch.
#[derive(Debug, Clone)]
pub enum RequestStatus {
    /// Not yet completed.
    Pending,
    /// Completed; every byte is at the destination.
    Done {
        /// Bytes transferred.
        bytes: u64,
    },
    /// Failed with this error.
    Failed(Error),
    /// Cancelled before it started.
    Cancelled,
}

const PENDING: u8 = 0;
const DONE: u8 = 1;
const FAILED: u8 = 2;
const CANCELLED: u8 = 3;

/// Shared completion state of one batch. Transports complete requests by index.
pub struct BatchState {
    status: Box<[AtomicU8]>,
    lens: Box<[u64]>,
    /// Sum of `lens`: the bytes of a batch that completed without failure or cancellation.
    total_bytes: u64,
    remaining: AtomicUsize,
    failed: AtomicUsize,
    cancelled: AtomicUsize,
    failures: Mutex<Vec<(usize, Error)>>,
    cancel_requested: AtomicBool,
    /// Inline for the engine's pins and one more: no allocation per batch for the list itself.
    keep_alive: Mutex<SmallVec<[Box<dyn Any + Send + Sync>; 2]>>,
    /// Two inline: a batch has at most the metrics hook and the notification hook, so adding
    /// them allocates nothing beyond each hook's own box.
    on_complete: Mutex<SmallVec<[CompletionHook; 2]>>,
    /// Consulted before a request is marked failed (the engine's failover); unset on batches
    /// that cannot fail over, so the success path never looks at it.
    failure_hook: std::sync::OnceLock<Box<dyn FailureHook>>,
    done: Event,
}

/// Sees each request of a batch that is about to fail, first: returns true to take the request
/// over (it stays pending; the hook must see that it settles later, by resubmitting it), false
/// to let it fail. Called from whatever thread fails the request; must not block.
pub trait FailureHook: Send + Sync + 'static {
    /// Request `index` is about to fail with `error`.
    fn intercept(&self, index: usize, error: &Error) -> bool;
}

/// Work to run once when the last request of a batch settles (see [`BatchState::on_complete`]).
pub type CompletionHook = Box<dyn FnOnce(&BatchState) + Send>;

impl std::fmt::Debug for BatchState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchState")
            .field("requests", &self.lens.len())
            .field("remaining", &self.remaining.load(Ordering::Relaxed))
            .finish()
    }
}

impl BatchState {
    /// A batch of requests with these lengths, all pending.
    pub fn new(lens: Box<[u64]>) -> Arc<Self> {
        let n = lens.len();
        let status = (0..n).map(|_| AtomicU8::new(PENDING)).collect();
        let total_bytes = lens.iter().fold(0u64, |sum, &l| sum.saturating_add(l));
        Arc::new(BatchState {
            status,
            lens,
            total_bytes,
            remaining: AtomicUsize::new(n),
            failed: AtomicUsize::new(0),
            cancelled: AtomicUsize::new(0),
            failures: Mutex::new(Vec::new()),
            cancel_requested: AtomicBool::new(false),
            keep_alive: Mutex::new(SmallVec::new()),
            on_complete: Mutex::new(SmallVec::new()),
            failure_hook: std::sync::OnceLock::new(),
            done: Event::new(),
        })
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.lens.len()
    }

    /// True for a batch of no requests.
    pub fn is_empty(&self) -> bool {
        self.lens.is_empty()
    }

    /// Bytes over all requests of the batch.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Keeps `value` alive until every request has completed (region pins, connections).
    /// Dropped at once if the batch already completed.
    pub fn keep_alive(&self, value: Box<dyn Any + Send + Sync>) {
        let mut guard = self.keep_alive.lock();
        if self.remaining.load(Ordering::Acquire) == 0 {
            drop(guard);
            drop(value);
        } else {
            guard.push(value);
        }
    }

    /// Runs `hook` once, on the thread that settles the batch's last request, after the keep-alive
    /// values were dropped and before waiters wake; at once (on this thread) if the batch already
    /// completed. Per batch, never per request: for metrics, notifications and similar follow-ups.
    /// A hook must not block.
    pub fn on_complete(&self, hook: CompletionHook) {
        let mut guard = self.on_complete.lock();
        if self.remaining.load(Ordering::Acquire) == 0 {
            drop(guard);
            hook(self);
        } else {
            guard.push(hook);
        }
    }

    /// Installs the hook that may take over requests about to fail (once per batch; a second
    /// call is refused, returning the hook). Install before handing the batch to a transport.
    pub fn set_failure_hook(&self, hook: Box<dyn FailureHook>) -> Result<(), Box<dyn FailureHook>> {
        self.failure_hook.set(hook)
    }

    /// True when the failure hook takes request `index` over instead of letting it fail.
    fn intercepted(&self, index: usize, error: &Error) -> bool {
        match self.failure_hook.get() {
            Some(h) => self.is_pending(index) && h.intercept(index, error),
            None => false,
        }
    }

    fn is_pending(&self, index: usize) -> bool {
        self.status
            .get(index)
            .is_some_and(|s| s.load(Ordering::Acquire) == PENDING)
    }

    /// Marks request `index` failed without asking the failure hook: for the hook itself, once
    /// no route is left for it, and for a transport that knows no route can serve it (shm: the
    /// peer process exited).
    pub fn fail_final(&self, index: usize, error: Error) {
        if self.settle(index, FAILED) {
            self.failures.lock().push((index, error));
            self.failed.fetch_add(1, Ordering::Relaxed);
            self.finish(1);
        }
    }

    /// True when every request completed: none failed or was cancelled. Meaningful once
    /// [`BatchState::is_complete`].
    pub fn succeeded(&self) -> bool {
        self.failed.load(Ordering::Acquire) == 0 && self.cancelled.load(Ordering::Acquire) == 0
    }

    /// Visits every request that did not succeed: each failed one with its error, then each
    /// cancelled one with `None`. One lock and one pass over the statuses; for per-batch
    /// follow-ups (metrics) on the rare path of a batch that did not succeed. `f` must not block.
    pub fn for_each_unsuccessful(&self, mut f: impl FnMut(usize, Option<&Error>)) {
        for (i, e) in self.failures.lock().iter() {
            f(*i, Some(e));
        }
        if self.cancelled.load(Ordering::Acquire) > 0 {
            for (i, s) in self.status.iter().enumerate() {
                if s.load(Ordering::Acquire) == CANCELLED {
                    f(i, None);
                }
            }
        }
    }

    /// True once the caller asked to cancel. Transports check it before starting queued work.
    pub fn cancel_requested(&self) -> bool {
        self.cancel_requested.load(Ordering::Relaxed)
    }

    fn settle(&self, index: usize, to: u8) -> bool {
        match self.status.get(index) {
            Some(s) => s
                .compare_exchange(PENDING, to, Ordering::AcqRel, Ordering::Acquire)
                .is_ok(),
            None => false,
        }
    }

    fn finish(&self, n: usize) {
        if n == 0 {
            return;
        }
        if self.remaining.fetch_sub(n, Ordering::AcqRel) == n {
            let kept = std::mem::take(&mut *self.keep_alive.lock());
            drop(kept);
            let hooks = std::mem::take(&mut *self.on_complete.lock());
            for hook in hooks {
                hook(self);
            }
            self.done.notify(usize::MAX);
        }
    }

    /// Marks request `index` done. Completing a request twice or out of range is ignored.
    pub fn complete(&self, index: usize) {
        if self.settle(index, DONE) {
            self.finish(1);
        }
    }

    /// Marks many requests done with one update of the completion counter.
    pub fn complete_many(&self, indices: impl IntoIterator<Item = usize>) {
        let n = indices.into_iter().filter(|&i| self.settle(i, DONE)).count();
        self.finish(n);
    }

    /// Like [`BatchState::complete_many`], for a caller that is the only party settling these
    /// indices right now (a transport completing, on one thread, the requests it was handed):
    /// each status is written with a plain release store instead of a compare-and-swap, which
    /// costs a few nanoseconds per request. Indices already settled are skipped.
    ///
    /// Another thread settling one of these indices at the same time would be counted twice; use
    /// [`BatchState::complete_many`] wherever that can happen (requests split across threads).
    pub fn complete_many_exclusive(&self, indices: impl IntoIterator<Item = usize>) {
        let mut n = 0;
        for i in indices {
            if let Some(s) = self.status.get(i) {
                if s.load(Ordering::Relaxed) == PENDING {
                    s.store(DONE, Ordering::Release);
                    n += 1;
                }
            }
        }
        self.finish(n);
    }

    /// Marks request `index` failed (unless the failure hook takes it over).
    pub fn fail(&self, index: usize, error: Error) {
        if self.intercepted(index, &error) {
            return;
        }
        self.fail_final(index, error);
    }

    /// Marks many requests failed with the same error (one lock, one counter update), except
    /// those the failure hook takes over.
    pub fn fail_many(&self, indices: impl IntoIterator<Item = usize>, error: &Error) {
        let hooked = self.failure_hook.get().is_some();
        let mut failures = self.failures.lock();
        let before = failures.len();
        for i in indices {
            if hooked && self.intercepted(i, error) {
                continue;
            }
            if self.settle(i, FAILED) {
                failures.push((i, error.clone()));
            }
        }
        let n = failures.len() - before;
        drop(failures);
        self.failed.fetch_add(n, Ordering::Relaxed);
        self.finish(n);
    }

    /// Marks request `index` cancelled (it never started).
    pub fn cancel(&self, index: usize) {
        if self.settle(index, CANCELLED) {
            self.cancelled.fetch_add(1, Ordering::Relaxed);
            self.finish(1);
        }
    }

    /// True when no request is pending.
    pub fn is_complete(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }

    /// The status of request `index`, or `None` when out of range.
    pub fn status(&self, index: usize) -> Option<RequestStatus> {
        let s = self.status.get(index)?.load(Ordering::Acquire);
        Some(match s {
            PENDING => RequestStatus::Pending,
            DONE => RequestStatus::Done {
                bytes: self.lens[index],
            },
            CANCELLED => RequestStatus::Cancelled,
            _ => {
                let err = self
                    .failures
                    .lock()
                    .iter()
                    .find(|(i, _)| *i == index)
                    .map(|(_, e)| e.clone());
                RequestStatus::Failed(err.unwrap_or(Error::Cancelled))
            }
        })
    }

    /// Counts of done / failed / cancelled / pending requests and bytes done.
    pub fn progress(&self) -> BatchProgress {
        let mut p = BatchProgress::default();
        for (s, len) in self.status.iter().zip(self.lens.iter()) {
            match s.load(Ordering::Acquire) {
                PENDING => p.pending += 1,
                DONE => {
                    p.done += 1;
                    p.bytes_done += len;
                }
                FAILED => p.failed += 1,
                _ => p.cancelled += 1,
            }
        }
        p
    }

    fn outcome(&self) -> Result<BatchReport, BatchError> {
        // Called once every request settled; without a failure or cancellation all are done.
        if self.succeeded() {
            return Ok(BatchReport {
                requests: self.lens.len(),
                bytes: self.total_bytes,
            });
        }
        let progress = self.progress();
        let mut failures = self.failures.lock().clone();
        failures.sort_by_key(|(i, _)| *i);
        Err(BatchError { progress, failures })
    }
}

/// Counts of a batch's requests by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchProgress {
    /// Completed successfully.
    pub done: usize,
    /// Failed.
    pub failed: usize,
    /// Cancelled before starting.
    pub cancelled: usize,
    /// Still pending.
    pub pending: usize,
    /// Bytes of the completed requests.
    pub bytes_done: u64,
}

/// What a fully successful batch did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchReport {
    /// Requests completed.
    pub requests: usize,
    /// Bytes moved.
    pub bytes: u64,
}

/// A batch in which at least one request failed or was cancelled. The others' results stand.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{} of {} request(s) failed, {} cancelled; first: {}", progress.failed, progress.done + progress.failed + progress.cancelled + progress.pending, progress.cancelled, first_failure(failures))]
pub struct BatchError {
    /// Counts by state.
    pub progress: BatchProgress,
    /// Every failed request's index and error, in index order.
    pub failures: Vec<(usize, Error)>,
}

impl BatchError {
    /// The first failed request's error (in index order), or [`Error::Cancelled`] when the batch
    /// failed only by cancellation: what a caller waiting on one outcome reports.
    pub fn into_first_error(self) -> Error {
        self.failures
            .into_iter()
            .next()
            .map(|(_, e)| e)
            .unwrap_or(Error::Cancelled)
    }
}

fn first_failure(f: &[(usize, Error)]) -> String {
    f.first()
        .map(|(i, e)| format!("#{i}: {e}"))
        .unwrap_or_else(|| "none".into())
}

/// The caller's handle on a submitted batch.
#[derive(Debug, Clone)]
pub struct Batch {
    state: Arc<BatchState>,
}

impl Batch {
    /// Wraps shared state.
    pub fn new(state: Arc<BatchState>) -> Self {
        Batch { state }
    }

    /// The shared state (to add a completion hook with [`BatchState::on_complete`]).
    pub fn state(&self) -> &Arc<BatchState> {
        &self.state
    }

    /// Non-blocking: counts by state.
    pub fn poll(&self) -> BatchProgress {
        self.state.progress()
    }

    /// True when every request has completed, failed or been cancelled.
    pub fn is_complete(&self) -> bool {
        self.state.is_complete()
    }

    /// Status of request `index`.
    pub fn status(&self, index: usize) -> Option<RequestStatus> {
        self.state.status(index)
    }

    /// Asks transports not to start requests that are still queued; they complete as
    /// `Cancelled`. Requests already on the wire finish normally. Memory stays pinned until then.
    pub fn cancel(&self) {
        self.state.cancel_requested.store(true, Ordering::Relaxed);
    }

    /// Waits (asynchronously, without spinning) until every request has settled.
    pub async fn wait(&self) -> Result<BatchReport, BatchError> {
        loop {
            if self.state.is_complete() {
                return self.state.outcome();
            }
            let listener = self.state.done.listen();
            if self.state.is_complete() {
                return self.state.outcome();
            }
            listener.await;
        }
    }

    /// Blocks the thread until every request has settled, or `timeout` passes (`None` then).
    pub fn wait_blocking(&self, timeout: Option<Duration>) -> Option<Result<BatchReport, BatchError>> {
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        loop {
            if self.state.is_complete() {
                return Some(self.state.outcome());
            }
            let listener = self.state.done.listen();
            if self.state.is_complete() {
                return Some(self.state.outcome());
            }
            match deadline {
                Some(d) => {
                    listener.wait_deadline(d)?;
                }
                None => listener.wait(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completes_and_reports() {
        let s = BatchState::new(vec![10, 20, 30].into());
        let b = Batch::new(s.clone());
        assert_eq!(b.poll().pending, 3);
        s.complete_many([0, 2]);
        assert!(!b.is_complete());
        s.complete(1);
        s.complete(1); // twice: ignored
        s.complete(99); // out of range: ignored
        let r = b.wait_blocking(None).unwrap().unwrap();
        assert_eq!(r, BatchReport { requests: 3, bytes: 60 });
    }

    #[test]
    fn failures_are_reported_per_request() {
        let s = BatchState::new(vec![1, 2, 3].into());
        s.complete(0);
        s.fail(2, Error::Cancelled);
        s.cancel(1);
        let e = Batch::new(s).wait_blocking(None).unwrap().unwrap_err();
        assert_eq!(e.progress.done, 1);
        assert_eq!(e.progress.failed, 1);
        assert_eq!(e.progress.cancelled, 1);
        assert_eq!(e.failures.len(), 1);
        assert_eq!(e.failures[0].0, 2);
    }

    #[test]
    fn keep_alive_is_released_on_completion() {
        let s = BatchState::new(vec![1].into());
        let token = Arc::new(());
        s.keep_alive(Box::new(token.clone()));
        assert_eq!(Arc::strong_count(&token), 2);
        s.complete(0);
        assert_eq!(Arc::strong_count(&token), 1);
    }

    #[test]
    fn completion_hooks_run_once_with_the_outcome() {
        let s = BatchState::new(vec![1, 2].into());
        let runs = Arc::new(AtomicUsize::new(0));
        let seen_ok = Arc::new(AtomicBool::new(true));
        let (r, ok) = (runs.clone(), seen_ok.clone());
        s.on_complete(Box::new(move |b| {
            r.fetch_add(1, Ordering::SeqCst);
            ok.store(b.succeeded(), Ordering::SeqCst);
        }));
        s.complete(0);
        assert_eq!(runs.load(Ordering::SeqCst), 0, "ran before the last request settled");
        s.fail(1, Error::Cancelled);
        s.fail(1, Error::Cancelled);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert!(!seen_ok.load(Ordering::SeqCst), "a failed batch reported success");
        // Registered after completion: runs at once.
        let r = runs.clone();
        s.on_complete(Box::new(move |_| {
            r.fetch_add(1, Ordering::SeqCst);
        }));
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn unsuccessful_requests_are_visited_once_each() {
        let s = BatchState::new(vec![1, 2, 3, 4].into());
        s.complete(0);
        s.fail(3, Error::Cancelled);
        s.cancel(1);
        let mut seen = Vec::new();
        s.for_each_unsuccessful(|i, e| seen.push((i, e.is_some())));
        assert_eq!(seen, [(3, true), (1, false)]);
    }

    #[test]
    fn wait_times_out_then_completes_from_another_thread() {
        let s = BatchState::new(vec![1].into());
        let b = Batch::new(s.clone());
        assert!(b.wait_blocking(Some(Duration::from_millis(5))).is_none());
        let t = std::thread::spawn(move || s.complete(0));
        assert!(b.wait_blocking(None).unwrap().is_ok());
        t.join().unwrap();
    }

    /// Takes over even indices once, then lets them fail.
    struct TakeEvenOnce(Mutex<Vec<usize>>);

    impl FailureHook for TakeEvenOnce {
        fn intercept(&self, index: usize, _: &Error) -> bool {
            let mut taken = self.0.lock();
            if index % 2 == 1 || taken.contains(&index) {
                return false;
            }
            taken.push(index);
            true
        }
    }

    #[test]
    fn a_failure_hook_keeps_the_requests_it_takes_pending() {
        let s = BatchState::new(vec![1, 2, 3, 4].into());
        assert!(s
            .set_failure_hook(Box::new(TakeEvenOnce(Mutex::new(Vec::new()))))
            .is_ok());
        assert!(s
            .set_failure_hook(Box::new(TakeEvenOnce(Mutex::new(Vec::new()))))
            .is_err());
        s.fail_many(0..4, &Error::Cancelled);
        let p = s.progress();
        assert_eq!((p.failed, p.pending), (2, 2), "0 and 2 were taken over");
        // Taken over requests settle later, by completion or by failing again.
        s.complete(0);
        s.fail(2, Error::Cancelled);
        assert!(s.is_complete());
        let e = Batch::new(s).wait_blocking(None).unwrap().unwrap_err();
        assert_eq!(e.progress.done, 1);
        let failed: Vec<usize> = e.failures.iter().map(|(i, _)| *i).collect();
        assert_eq!(failed, [1, 2, 3]);
    }

    #[test]
    fn empty_batch_is_complete() {
        let b = Batch::new(BatchState::new(Vec::new().into()));
        assert!(b.is_complete());
        assert_eq!(b.wait_blocking(None).unwrap().unwrap().requests, 0);
    }
}
