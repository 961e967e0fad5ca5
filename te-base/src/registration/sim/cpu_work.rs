//! Real CPU work for the simulated provider: a busy loop that runs until this thread has consumed
//! a given amount of CPU time, part of it inside a spin lock shared by the process's registrations.
//!
//! Measuring the thread's own CPU time (not wall time) is what makes the model honest under
//! contention: a descheduled thread makes no progress, so oversubscribed cores stretch every
//! registration as they do on a real node.
//!
//! The lock stands for the process-wide state that page pinning and MR bookkeeping serialise on
//! (the address space's page-table locks, a provider's domain/MR-cache lock). Waiters spin, then
//! yield; when the holder is descheduled mid-section because more threads want the cores than there
//! are cores, every waiter burns CPU for nothing. That lock-holder preemption is what punishes
//! oversubscription more than linearly, as measured on the real nodes.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};

/// Granularity of the work: the lock is taken once per slice of this much CPU time.
const SLICE_NS: u64 = 50_000;
/// Spins on a held lock before yielding the CPU.
const SPINS_BEFORE_YIELD: u32 = 200;

/// A test-and-set spin lock that yields after a while.
#[derive(Debug, Default)]
pub struct SpinLock {
    held: AtomicBool,
}

impl SpinLock {
    fn lock(&self) -> SpinGuard<'_> {
        let mut spins = 0u32;
        loop {
            if !self.held.load(Ordering::Relaxed)
                && self
                    .held
                    .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return SpinGuard { lock: self };
            }
            spins += 1;
            if spins < SPINS_BEFORE_YIELD {
                std::hint::spin_loop();
            } else {
                spins = 0;
                std::thread::yield_now();
            }
        }
    }
}

struct SpinGuard<'a> {
    lock: &'a SpinLock,
}

impl Drop for SpinGuard<'_> {
    fn drop(&mut self) {
        self.lock.held.store(false, Ordering::Release);
    }
}

/// Consumes `ns` nanoseconds of this thread's CPU time, the fraction `locked` of each slice while
/// holding `lock`.
pub fn burn(ns: u64, locked: f64, lock: &SpinLock) {
    let locked = locked.clamp(0.0, 1.0);
    let mut left = ns;
    while left > 0 {
        let slice = left.min(SLICE_NS);
        let inside = (slice as f64 * locked) as u64;
        spin_for(slice - inside);
        if inside > 0 {
            let _guard = lock.lock();
            spin_for(inside);
        }
        left -= slice;
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
fn thread_cpu_ns() -> u64 {
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
    fn burn_consumes_at_least_the_requested_cpu_time() {
        let lock = SpinLock::default();
        let before = thread_cpu_ns();
        burn(2_000_000, 0.25, &lock);
        assert!(thread_cpu_ns() - before >= 2_000_000);
        assert!(!lock.held.load(Ordering::Relaxed));
    }
}
