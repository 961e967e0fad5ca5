//! Staging slots an owner holds for remote readers, each under a lease with a deadline: released
//! by the reader's VALIDATE, or by the next lease operation after the deadline passed (a reader
//! that died pins nothing for longer than the cluster timeout).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::Mutex;

#[derive(Default)]
pub(crate) struct Leases {
    next: AtomicU64,
    held: Mutex<HashMap<u64, (usize, Instant)>>,
}

impl Leases {
    /// Holds `slot` until `deadline`; returns the lease id (never 0).
    pub(crate) fn hold(&self, slot: usize, deadline: Instant) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        self.held.lock().insert(id, (slot, deadline));
        id
    }

    /// Ends the leases past their deadline (their reader died or gave up) and returns their
    /// slots, for the caller to give back.
    pub(crate) fn expire(&self) -> Vec<usize> {
        let now = Instant::now();
        let mut expired = Vec::new();
        self.held.lock().retain(|_, &mut (s, d)| {
            let keep = d > now;
            if !keep {
                expired.push(s);
            }
            keep
        });
        expired
    }

    /// Ends lease `id`: its slot, and whether it was released within its deadline (past it, the
    /// reader's read is not trusted, but the slot is still freed).
    pub(crate) fn release(&self, id: u64) -> Option<(usize, bool)> {
        let (slot, deadline) = self.held.lock().remove(&id)?;
        Some((slot, deadline > Instant::now()))
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::Leases;

    #[test]
    fn expire_returns_only_the_slots_past_their_deadline() {
        let leases = Leases::default();
        let now = Instant::now();
        let dead = leases.hold(3, now - Duration::from_millis(1));
        let live = leases.hold(5, now + Duration::from_secs(60));
        assert_eq!(leases.expire(), vec![3]);
        assert!(leases.expire().is_empty());
        assert_eq!(leases.release(dead), None);
        assert_eq!(leases.release(live), Some((5, true)));
    }
}
