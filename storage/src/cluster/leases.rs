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
    /// Holds `slot` until `deadline`; returns the lease id (never 0). Slots of leases past their
    /// deadline are handed to `release` first.
    pub(crate) fn hold(&self, slot: usize, deadline: Instant, release: impl FnOnce(Vec<usize>)) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let mut held = self.held.lock();
        let now = Instant::now();
        let mut expired = Vec::new();
        held.retain(|_, &mut (s, d)| {
            let keep = d > now;
            if !keep {
                expired.push(s);
            }
            keep
        });
        held.insert(id, (slot, deadline));
        drop(held);
        release(expired);
        id
    }

    /// Ends lease `id`: its slot, and whether it was released within its deadline (past it, the
    /// reader's read is not trusted, but the slot is still freed).
    pub(crate) fn release(&self, id: u64) -> Option<(usize, bool)> {
        let (slot, deadline) = self.held.lock().remove(&id)?;
        Some((slot, deadline > Instant::now()))
    }
}
