//! Engine counters, updated once per call.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub(crate) struct Metrics {
    batches: AtomicU64,
    requests: AtomicU64,
    bytes: AtomicU64,
    failed_requests: AtomicU64,
}

/// A snapshot of the engine's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Batches submitted.
    pub batches: u64,
    /// Requests submitted.
    pub requests: u64,
    /// Bytes submitted.
    pub bytes: u64,
    /// Requests that failed at submission (refused by a transport or to a lost peer).
    pub failed_requests: u64,
}

impl Metrics {
    pub fn record_call(&self, requests: u64, bytes: u64, failed: u64) {
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.requests.fetch_add(requests, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        if failed > 0 {
            self.failed_requests.fetch_add(failed, Ordering::Relaxed);
        }
    }

    pub fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            batches: self.batches.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            failed_requests: self.failed_requests.load(Ordering::Relaxed),
        }
    }
}
