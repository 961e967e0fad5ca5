//! Whether this peer may still serve its own copies: its lease must be known to stand.
//!
//! A peer frozen (or cut off from etcd) for longer than its lease TTL has lost its membership:
//! the others dropped its directory entries, so a later put of one of its keys superseded
//! nothing and no RETIRE reached it. When it resumes, its copies may be older than a write
//! acknowledged elsewhere, and serving them would break "the last acknowledged write wins"
//! until its recovery (a new lease, every local key published again) has had them retired.
//! So local reads need the lease to be known to stand: within a TTL of the sending of a
//! keep-alive etcd answered (etcd extends the lease when it receives it, which is after the
//! send), and not while a lapsed lease is being replaced.
//!
//! When this peer cannot reach etcd, other members renew its lease for it (RENEW, sharded
//! directory): a member cut off from etcd but not from its peers stays a member, and a
//! renewal they relay counts as etcd's own. When every member asked says etcd is out of its
//! reach too, the outage is everyone's: no member can see another leave, and local copies are
//! served as before (docs/umbp.md, "etcd outages"). When none answers, this peer is cut off
//! from both: its standing runs out a TTL after its last confirmation, while the others may
//! already be writing its keys elsewhere.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub(crate) struct Standing {
    base: Instant,
    /// Milliseconds after `base` until which the lease surely stands.
    until_ms: AtomicU64,
    /// The lease lapsed; a new one is being granted and the local keys published again.
    rejoining: AtomicBool,
    /// The last keep-alive got no answer from etcd at all, and the members asked cannot reach
    /// it either (or, with the etcd directory, there is nobody to ask).
    etcd_unreachable: AtomicBool,
}

impl Standing {
    pub(crate) fn new() -> Standing {
        Standing {
            base: Instant::now(),
            until_ms: AtomicU64::new(0),
            rejoining: AtomicBool::new(false),
            etcd_unreachable: AtomicBool::new(false),
        }
    }

    fn ms(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.base).as_millis() as u64
    }

    /// etcd granted or extended the lease for `ttl` in answer to a request sent at `sent`.
    pub(crate) fn confirmed(&self, sent: Instant, ttl: Duration) {
        self.until_ms
            .fetch_max(self.ms(sent) + ttl.as_millis() as u64, Ordering::AcqRel);
        self.etcd_unreachable.store(false, Ordering::Release);
    }

    /// A keep-alive got no answer from etcd and no member renewed the lease: `for_all` when
    /// the members asked cannot reach etcd either (an outage everyone sees), not when none
    /// answered (this peer is cut off).
    pub(crate) fn etcd_out_for_all(&self, for_all: bool) {
        self.etcd_unreachable.store(for_all, Ordering::Release);
    }

    /// The lease lapsed: local reads stop until [`Standing::rejoined`].
    pub(crate) fn lapsed(&self) {
        self.rejoining.store(true, Ordering::Release);
    }

    /// Whether a lapsed lease is being replaced.
    pub(crate) fn rejoining(&self) -> bool {
        self.rejoining.load(Ordering::Acquire)
    }

    /// A new lease is held and every local key was published again.
    pub(crate) fn rejoined(&self) {
        self.rejoining.store(false, Ordering::Release);
    }

    /// Whether this peer may serve its own copies now (one clock read and three loads).
    pub(crate) fn may_serve_local(&self) -> bool {
        !self.rejoining.load(Ordering::Acquire)
            && (self.etcd_unreachable.load(Ordering::Acquire)
                || self.ms(Instant::now()) < self.until_ms.load(Ordering::Acquire))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_reads_need_a_lease_known_to_stand() {
        let s = Standing::new();
        assert!(!s.may_serve_local(), "no lease yet");
        s.confirmed(Instant::now(), Duration::from_secs(60));
        assert!(s.may_serve_local());
        // A confirmation sent long ago (a process frozen since) has run out.
        let s = Standing::new();
        std::thread::sleep(Duration::from_millis(20));
        s.confirmed(s.base, Duration::from_millis(10));
        assert!(!s.may_serve_local(), "a TTL after the keep-alive was sent");
        // etcd out of reach for everyone: local copies are served as before.
        s.etcd_out_for_all(true);
        assert!(s.may_serve_local());
        // Cut off from etcd and every member: not past the last confirmation.
        s.etcd_out_for_all(false);
        assert!(!s.may_serve_local());
        s.etcd_out_for_all(true);
        // A lapsed lease: not until the rejoin completed, whatever else holds.
        s.confirmed(Instant::now(), Duration::from_secs(60));
        s.lapsed();
        assert!(!s.may_serve_local());
        s.rejoined();
        assert!(s.may_serve_local());
    }
}
