//! What an error completion means, and when to try re-establishing a failed QP.
//!
//! A QP that completes a request in error goes to the ERROR state and flushes everything after
//! it. Its requests are handed to sibling QPs of the same peer (or kept until it is back), and the
//! QP is reset and re-connected through the handshake, at most once per backoff period that
//! doubles on each failed attempt, so a dead or overloaded peer does not get a reconnect storm.

use std::time::{Duration, Instant};

use te_base::Error;

use super::values::WcStatus;

/// How the transport treats an error completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The request was not at fault (flushed behind another error, retries exhausted on a link
    /// blip, peer busy): post it again, up to the retry limit.
    Transient,
    /// The target refused it (bad rkey, out of its registration, access rights): fail it alone.
    Refused,
    /// Our own side is wrong (bad lkey or length): fail it alone.
    Local,
    /// The device failed: fail it, and the QP's re-establishment decides the rest.
    Fatal,
}

/// Classifies a completion status.
pub fn classify(status: WcStatus) -> ErrorClass {
    match status {
        WcStatus::WR_FLUSH_ERR | WcStatus::RETRY_EXC_ERR | WcStatus::RNR_RETRY_EXC_ERR | WcStatus::RESP_TIMEOUT_ERR => {
            ErrorClass::Transient
        }
        WcStatus::REM_ACCESS_ERR | WcStatus::REM_INV_REQ_ERR | WcStatus::REM_OP_ERR => ErrorClass::Refused,
        WcStatus::LOC_PROT_ERR | WcStatus(1) | WcStatus(2) | WcStatus(8) => ErrorClass::Local,
        _ => ErrorClass::Fatal,
    }
}

/// The error a request fails with after an error completion it will not be retried from.
pub fn request_error(status: WcStatus, vendor_err: u32, peer: &str) -> Error {
    let what = format!("work completion status {} (vendor error {vendor_err:#x})", status.0);
    match classify(status) {
        ErrorClass::Refused => Error::Refused {
            peer: peer.to_string(),
            reason: what,
        },
        ErrorClass::Transient => Error::PeerGone {
            peer: peer.to_string(),
            reason: format!("{what}; retries exhausted"),
        },
        ErrorClass::Local | ErrorClass::Fatal => Error::transport("rdma", what),
    }
}

/// Exponential backoff of a QP's re-establishment attempts (virtual time: callers pass `now`).
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    failures: u32,
    next_attempt: Option<Instant>,
}

impl Backoff {
    /// Waits start at `min` and double up to `max`.
    pub fn new(min: Duration, max: Duration) -> Self {
        Backoff {
            min,
            max: max.max(min),
            failures: 0,
            next_attempt: None,
        }
    }

    /// The QP failed at `now`: the earliest time to try again. Repeated failures before a
    /// success double the wait.
    pub fn on_failure(&mut self, now: Instant) -> Instant {
        let factor = 1u32.checked_shl(self.failures.min(20)).unwrap_or(u32::MAX);
        let wait = self.min.saturating_mul(factor).min(self.max);
        self.failures = self.failures.saturating_add(1);
        let at = now + wait;
        self.next_attempt = Some(at);
        at
    }

    /// True if an attempt may start at `now`. Claims the attempt: a second caller at the same
    /// moment gets false, so one failure leads to one attempt at a time.
    pub fn try_begin(&mut self, now: Instant) -> bool {
        match self.next_attempt {
            Some(at) if now >= at => {
                self.next_attempt = None;
                true
            }
            _ => false,
        }
    }

    /// The QP is back: the next failure starts from `min` again.
    pub fn on_success(&mut self) {
        self.failures = 0;
        self.next_attempt = None;
    }

    /// Failed attempts since the last success.
    pub fn failures(&self) -> u32 {
        self.failures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_statuses() {
        assert_eq!(classify(WcStatus::WR_FLUSH_ERR), ErrorClass::Transient);
        assert_eq!(classify(WcStatus::RETRY_EXC_ERR), ErrorClass::Transient);
        assert_eq!(classify(WcStatus::RNR_RETRY_EXC_ERR), ErrorClass::Transient);
        assert_eq!(classify(WcStatus::REM_ACCESS_ERR), ErrorClass::Refused);
        assert_eq!(classify(WcStatus::LOC_PROT_ERR), ErrorClass::Local);
        assert_eq!(classify(WcStatus::FATAL_ERR), ErrorClass::Fatal);
        assert!(matches!(
            request_error(WcStatus::REM_ACCESS_ERR, 0, "b"),
            Error::Refused { .. }
        ));
        assert!(matches!(
            request_error(WcStatus::RETRY_EXC_ERR, 0, "b"),
            Error::PeerGone { .. }
        ));
    }

    #[test]
    fn backoff_doubles_caps_and_admits_one_attempt_at_a_time() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut b = Backoff::new(ms(10), ms(50));
        assert!(!b.try_begin(t0), "nothing failed yet");
        assert_eq!(b.on_failure(t0), t0 + ms(10));
        assert!(!b.try_begin(t0 + ms(9)));
        assert!(b.try_begin(t0 + ms(10)));
        assert!(!b.try_begin(t0 + ms(10)), "one attempt per failure");
        assert_eq!(b.on_failure(t0 + ms(10)), t0 + ms(30), "doubled");
        assert_eq!(b.on_failure(t0 + ms(30)), t0 + ms(70), "quadrupled");
        assert_eq!(b.on_failure(t0 + ms(70)), t0 + ms(120), "capped at 50");
        assert_eq!(b.failures(), 4);
        b.on_success();
        assert_eq!(b.on_failure(t0 + ms(200)), t0 + ms(210), "back to the minimum");
    }
}
