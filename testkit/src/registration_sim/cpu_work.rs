//! Real CPU work for the simulated provider: a busy loop that runs until this thread has consumed
//! a given amount of CPU time.
//!
//! Measuring the thread's own CPU time (not wall time) is what makes the model honest under
//! contention: a descheduled thread makes no progress, so oversubscribed cores stretch every
//! registration as they do on a real node.
//!
//! After every slice the thread yields the CPU. The time scale compresses the work (a 40 ms node
//! registration may take 0.4 ms here) but not the kernel's scheduling quantum (milliseconds), so
//! without yielding, the first threads of an oversubscribed batch would run many registrations
//! before the last ones start, which on the node (where they run side by side on many cores) they
//! do not. Yielding every slice keeps oversubscribed threads finely interleaved.

use std::hint::black_box;

/// Granularity of the work: the oversubscription penalty is re-evaluated, and the CPU yielded,
/// once per slice of this much CPU time.
pub const SLICE_NS: u64 = 50_000;

/// Consumes `ns` nanoseconds of this thread's CPU time in slices, each stretched by
/// `stretch()` (>= 1) evaluated at the start of the slice.
pub fn burn(ns: u64, stretch: impl Fn() -> f64) {
    let mut left = ns;
    while left > 0 {
        let slice = left.min(SLICE_NS);
        let factor = stretch().max(1.0);
        spin_for((slice as f64 * factor) as u64);
        left -= slice;
        std::thread::yield_now();
    }
}

/// Busy-loops until this thread has used `ns` more nanoseconds of CPU time.
fn spin_for(ns: u64) {
    if ns == 0 {
        return;
    }
    let start = thread_cpu_ns();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    while thread_cpu_ns().saturating_sub(start) < ns {
        for _ in 0..1024 {
            x = black_box(x.rotate_left(5) ^ x.wrapping_mul(0x2545_f491_4f6c_dd1d));
        }
    }
    black_box(x);
}

/// CPU time consumed by the calling thread, in nanoseconds.
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID is always supported on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        // Never expected on Linux; wall time keeps the loop finite.
        static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        return EPOCH.get_or_init(std::time::Instant::now).elapsed().as_nanos() as u64;
    }
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burn_consumes_the_requested_cpu_time_times_the_stretch() {
        let before = thread_cpu_ns();
        burn(2_000_000, || 1.0);
        let plain = thread_cpu_ns() - before;
        assert!(plain >= 2_000_000);
        let before = thread_cpu_ns();
        burn(2_000_000, || 2.0);
        assert!(thread_cpu_ns() - before >= 4_000_000);
    }
}
