//! Per-phase timing of a transfer call, switchable and free when off: a disabled timer never
//! reads the clock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// The phases of one call, in the order they happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Looking up registrations and segments.
    Resolve,
    /// Describing memory kinds of the ranges.
    Classify,
    /// Assembling the transport's work items.
    Build,
    /// Grouping, sorting, coalescing.
    Plan,
    /// Handing work to the transport / doing the copy.
    Submit,
    /// Waiting for completion.
    Wait,
    /// Validation, metrics, anything else.
    Other,
}

impl Phase {
    /// All phases.
    pub const ALL: [Phase; 7] = [
        Phase::Resolve,
        Phase::Classify,
        Phase::Build,
        Phase::Plan,
        Phase::Submit,
        Phase::Wait,
        Phase::Other,
    ];

    /// Lower-case name for reports.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Resolve => "resolve",
            Phase::Classify => "classify",
            Phase::Build => "build",
            Phase::Plan => "plan",
            Phase::Submit => "submit",
            Phase::Wait => "wait",
            Phase::Other => "other",
        }
    }
}

/// Accumulated phase times over many calls.
#[derive(Debug, Default)]
pub struct PhaseStats {
    nanos: [AtomicU64; 7],
    calls: AtomicU64,
    items: AtomicU64,
}

/// A snapshot of [`PhaseStats`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PhaseReport {
    /// Nanoseconds per phase, in [`Phase::ALL`] order.
    pub nanos: [u64; 7],
    /// Calls recorded.
    pub calls: u64,
    /// Items (requests) over all calls.
    pub items: u64,
}

impl PhaseReport {
    /// Mean microseconds per call of `phase`.
    pub fn us_per_call(&self, phase: Phase) -> f64 {
        if self.calls == 0 {
            return 0.0;
        }
        self.nanos[phase as usize] as f64 / self.calls as f64 / 1e3
    }

    /// Total across phases, in nanoseconds.
    pub fn total_nanos(&self) -> u64 {
        self.nanos.iter().sum()
    }
}

impl PhaseStats {
    /// A snapshot.
    pub fn report(&self) -> PhaseReport {
        let mut nanos = [0u64; 7];
        for (n, a) in nanos.iter_mut().zip(&self.nanos) {
            *n = a.load(Ordering::Relaxed);
        }
        PhaseReport {
            nanos,
            calls: self.calls.load(Ordering::Relaxed),
            items: self.items.load(Ordering::Relaxed),
        }
    }

    /// Clears every counter.
    pub fn reset(&self) {
        for a in &self.nanos {
            a.store(0, Ordering::Relaxed);
        }
        self.calls.store(0, Ordering::Relaxed);
        self.items.store(0, Ordering::Relaxed);
    }
}

/// A handle that records phase times into shared stats, or does nothing at all.
#[derive(Debug, Clone, Default)]
pub struct PhaseTimer(Option<Arc<PhaseStats>>);

impl PhaseTimer {
    /// A timer that records nothing and never reads the clock.
    pub const fn off() -> Self {
        PhaseTimer(None)
    }

    /// A timer that records into `stats`.
    pub fn on(stats: Arc<PhaseStats>) -> Self {
        PhaseTimer(Some(stats))
    }

    /// True when recording.
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// The current time when on; `None` (and no clock read) when off.
    #[inline]
    pub fn start(&self) -> Option<Instant> {
        self.0.as_ref().map(|_| Instant::now())
    }

    /// Adds the time since `since` to `phase` and returns now, so phases chain without a second
    /// clock read. Does nothing when off.
    #[inline]
    pub fn lap(&self, phase: Phase, since: Option<Instant>) -> Option<Instant> {
        match (&self.0, since) {
            (Some(stats), Some(t0)) => {
                let now = Instant::now();
                stats.nanos[phase as usize].fetch_add((now - t0).as_nanos() as u64, Ordering::Relaxed);
                Some(now)
            }
            _ => None,
        }
    }

    /// Counts one call of `items` requests. Once per call.
    #[inline]
    pub fn count_call(&self, items: usize) {
        if let Some(stats) = &self.0 {
            stats.calls.fetch_add(1, Ordering::Relaxed);
            stats.items.fetch_add(items as u64, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_timer_records_nothing() {
        let t = PhaseTimer::off();
        assert!(t.start().is_none());
        assert!(t.lap(Phase::Plan, None).is_none());
    }

    #[test]
    fn on_timer_accumulates() {
        let stats = Arc::new(PhaseStats::default());
        let t = PhaseTimer::on(stats.clone());
        let t0 = t.start();
        std::hint::black_box((0..1000).sum::<u64>());
        let t1 = t.lap(Phase::Resolve, t0);
        t.lap(Phase::Submit, t1);
        t.count_call(5);
        let r = stats.report();
        assert_eq!(r.calls, 1);
        assert_eq!(r.items, 5);
        assert!(r.nanos[Phase::Resolve as usize] > 0);
    }
}
