//! Health of one route (a transport's connection to a segment): errors counted in a window, a
//! pause with a cooldown that doubles while the route keeps failing, and the probe that must
//! pass before a paused route carries traffic again. Pure state over instants the caller passes
//! in, so the policy is tested without clocks or I/O; the engine drives it (`engine::failover`).
//!
//! The numbers follow Mooncake TENT's rail monitor: three errors within ten seconds pause a
//! route; the first cooldown is 30 s and each further pause doubles it, up to 300 s. A route
//! that carried traffic for a whole window since its last resume starts again from the first
//! cooldown.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Errors within [`ERROR_WINDOW`] that pause a route.
pub(crate) const ERRORS_TO_PAUSE: usize = 3;
/// The window in which [`ERRORS_TO_PAUSE`] errors pause a route.
pub(crate) const ERROR_WINDOW: Duration = Duration::from_secs(10);
/// How many times the first cooldown a cooldown may grow to (30 s doubling up to 300 s).
const MAX_COOLDOWN_FACTOR: u32 = 10;

/// What a route is doing, as reported by [`crate::TransferEngine::routes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteState {
    /// Carrying traffic.
    Active,
    /// Paused after repeated errors; probed when the cooldown ends.
    Paused {
        /// The cooldown this pause started with.
        cooldown: Duration,
    },
    /// Its cooldown ended and a probe is running.
    Probing,
}

/// One route's error history and pause state. The data path reads only [`RouteHealth::is_paused`]
/// (one atomic load); everything else runs on failures and probes.
#[derive(Debug)]
pub(crate) struct RouteHealth {
    paused: AtomicBool,
    state: Mutex<HealthState>,
    first_cooldown: Duration,
}

#[derive(Debug)]
struct HealthState {
    state: RouteState,
    /// Instants of the most recent errors, oldest first, at most [`ERRORS_TO_PAUSE`].
    errors: VecDeque<Instant>,
    /// The cooldown the next pause gets.
    next_cooldown: Duration,
    /// When the route last came back from a pause.
    resumed_at: Option<Instant>,
    /// Pauses since start.
    pauses: u64,
}

/// What an error did to the route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorOutcome {
    /// Counted; the route stays active (or was already paused).
    Counted,
    /// This error paused the route for `cooldown`: the caller schedules its probe.
    Paused(Duration),
}

impl RouteHealth {
    /// A healthy route whose first pause lasts `first_cooldown`.
    pub fn new(first_cooldown: Duration) -> Self {
        RouteHealth {
            paused: AtomicBool::new(false),
            state: Mutex::new(HealthState {
                state: RouteState::Active,
                errors: VecDeque::with_capacity(ERRORS_TO_PAUSE),
                next_cooldown: first_cooldown,
                resumed_at: None,
                pauses: 0,
            }),
            first_cooldown,
        }
    }

    /// True while the route must not carry new traffic (paused or probing).
    #[inline]
    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::Acquire)
    }

    /// The route's state now.
    pub fn state(&self) -> RouteState {
        self.state.lock().state
    }

    /// Pauses since start.
    pub fn pauses(&self) -> u64 {
        self.state.lock().pauses
    }

    /// Counts an error at `now`; the [`ERRORS_TO_PAUSE`]-th within [`ERROR_WINDOW`] pauses the route.
    pub fn record_error(&self, now: Instant) -> ErrorOutcome {
        let mut s = self.state.lock();
        if s.state != RouteState::Active {
            return ErrorOutcome::Counted;
        }
        while s
            .errors
            .front()
            .is_some_and(|&t| now.saturating_duration_since(t) > ERROR_WINDOW)
        {
            s.errors.pop_front();
        }
        if s.errors.len() == ERRORS_TO_PAUSE {
            s.errors.pop_front();
        }
        s.errors.push_back(now);
        if s.errors.len() < ERRORS_TO_PAUSE {
            return ErrorOutcome::Counted;
        }
        // A route that ran a whole window since it last came back earned the first cooldown again.
        if s.resumed_at
            .is_some_and(|t| now.saturating_duration_since(t) > ERROR_WINDOW)
        {
            s.next_cooldown = self.first_cooldown;
        }
        let cooldown = s.next_cooldown;
        self.pause(&mut s, cooldown);
        ErrorOutcome::Paused(cooldown)
    }

    /// Pauses the route at once, whatever its error count (its connection is known to be lost).
    pub fn pause_now(&self) -> Option<Duration> {
        let mut s = self.state.lock();
        if s.state != RouteState::Active {
            return None;
        }
        let cooldown = s.next_cooldown;
        self.pause(&mut s, cooldown);
        Some(cooldown)
    }

    fn pause(&self, s: &mut HealthState, cooldown: Duration) {
        s.state = RouteState::Paused { cooldown };
        s.errors.clear();
        s.pauses += 1;
        s.next_cooldown = (cooldown * 2).min(self.first_cooldown * MAX_COOLDOWN_FACTOR);
        self.paused.store(true, Ordering::Release);
    }

    /// The cooldown ended: the probe starts. False if the route is not paused.
    pub fn start_probe(&self) -> bool {
        let mut s = self.state.lock();
        if !matches!(s.state, RouteState::Paused { .. }) {
            return false;
        }
        s.state = RouteState::Probing;
        true
    }

    /// The probe passed at `now`: the route carries traffic again.
    pub fn resume(&self, now: Instant) {
        let mut s = self.state.lock();
        s.state = RouteState::Active;
        s.resumed_at = Some(now);
        s.errors.clear();
        self.paused.store(false, Ordering::Release);
    }

    /// The probe failed: paused again with the next (doubled) cooldown, which is returned.
    pub fn probe_failed(&self) -> Duration {
        let mut s = self.state.lock();
        let cooldown = s.next_cooldown;
        self.pause(&mut s, cooldown);
        cooldown
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIRST: Duration = Duration::from_secs(30);

    #[test]
    fn three_errors_in_the_window_pause_and_two_do_not() {
        let h = RouteHealth::new(FIRST);
        let t0 = Instant::now();
        assert_eq!(h.record_error(t0), ErrorOutcome::Counted);
        assert_eq!(h.record_error(t0 + Duration::from_secs(1)), ErrorOutcome::Counted);
        assert!(!h.is_paused());
        assert_eq!(h.record_error(t0 + Duration::from_secs(2)), ErrorOutcome::Paused(FIRST));
        assert!(h.is_paused());
        assert_eq!(h.state(), RouteState::Paused { cooldown: FIRST });
    }

    #[test]
    fn errors_older_than_the_window_do_not_count() {
        let h = RouteHealth::new(FIRST);
        let t0 = Instant::now();
        for k in 0..10u64 {
            // One error every six seconds: never three within ten.
            assert_eq!(
                h.record_error(t0 + Duration::from_secs(6 * k)),
                ErrorOutcome::Counted,
                "error {k}"
            );
        }
        assert!(!h.is_paused());
    }

    #[test]
    fn cooldowns_double_up_to_ten_times_the_first_and_a_quiet_window_resets_them() {
        let h = RouteHealth::new(FIRST);
        let mut t = Instant::now();
        let burst = |h: &RouteHealth, t: Instant| {
            h.record_error(t);
            h.record_error(t);
            h.record_error(t)
        };
        assert_eq!(burst(&h, t), ErrorOutcome::Paused(FIRST));
        assert!(h.start_probe());
        assert_eq!(h.probe_failed(), FIRST * 2);
        assert!(h.start_probe());
        assert_eq!(h.probe_failed(), FIRST * 4);
        assert!(h.start_probe());
        assert_eq!(h.probe_failed(), FIRST * 8);
        assert!(h.start_probe());
        assert_eq!(h.probe_failed(), FIRST * 10, "capped at 300 s");
        assert!(h.start_probe());
        h.resume(t);
        assert!(!h.is_paused());
        // Failing again right after coming back keeps the long cooldown...
        assert_eq!(burst(&h, t), ErrorOutcome::Paused(FIRST * 10));
        assert!(h.start_probe());
        h.resume(t);
        // ...but after a whole window of traffic it starts from the first one.
        t += ERROR_WINDOW + Duration::from_secs(1);
        assert_eq!(burst(&h, t), ErrorOutcome::Paused(FIRST));
        assert_eq!(h.pauses(), 7);
    }

    #[test]
    fn a_paused_route_ignores_errors_and_pause_now_pauses_an_active_one() {
        let h = RouteHealth::new(FIRST);
        assert_eq!(h.pause_now(), Some(FIRST));
        assert_eq!(h.pause_now(), None, "already paused");
        assert_eq!(h.record_error(Instant::now()), ErrorOutcome::Counted);
        assert!(h.start_probe());
        assert!(!h.start_probe(), "one probe at a time");
        assert_eq!(h.state(), RouteState::Probing);
        assert!(h.is_paused(), "a probing route carries no traffic yet");
    }
}
