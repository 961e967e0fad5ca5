//! The reply addresses a target answers notifications at: each sender's endpoint name inserted into
//! the rail's AV once and reused, at most `capacity` of them. When full, the least recently used
//! address with no answer in flight leaves the AV, so a stream of senders (or forged reply
//! addresses) cannot grow the AV without bound.

use std::sync::Arc;

use crate::fabric::Rail;

struct Entry {
    addr: Vec<u8>,
    fi_addr: u64,
    in_flight: usize,
    last_used: u64,
}

/// A bounded cache of AV addresses (owner thread only).
pub(crate) struct ReplyBook {
    rail: Arc<Rail>,
    capacity: usize,
    entries: Vec<Entry>,
    clock: u64,
}

impl ReplyBook {
    pub(crate) fn new(rail: Arc<Rail>, capacity: usize) -> ReplyBook {
        ReplyBook {
            rail,
            capacity,
            entries: Vec::with_capacity(capacity),
            clock: 0,
        }
    }

    /// The AV address of `addr` for one answer; pair with [`ReplyBook::release`]. `Err` when the
    /// provider refuses the address or every entry has an answer in flight.
    pub(crate) fn acquire(&mut self, addr: &[u8]) -> Result<u64, ()> {
        self.clock += 1;
        if let Some(e) = self.entries.iter_mut().find(|e| e.addr == addr) {
            e.in_flight += 1;
            e.last_used = self.clock;
            return Ok(e.fi_addr);
        }
        if self.entries.len() >= self.capacity {
            let Some(victim) = self
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| e.in_flight == 0)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
            else {
                tracing::warn!("efa: every notification reply address has an answer in flight");
                return Err(());
            };
            let old = self.entries.swap_remove(victim);
            self.rail.av_release(old.fi_addr);
        }
        // The provider reads as many bytes as its address format needs: a zero-padded copy keeps a
        // short (hostile) address from making it read past the buffer.
        let mut padded = vec![0u8; addr.len().max(self.rail.address.len()).max(256)];
        padded[..addr.len()].copy_from_slice(addr);
        match self.rail.av_acquire(&padded) {
            Ok(fi_addr) => {
                self.entries.push(Entry {
                    addr: addr.to_vec(),
                    fi_addr,
                    in_flight: 1,
                    last_used: self.clock,
                });
                Ok(fi_addr)
            }
            Err(e) => {
                tracing::debug!(error = %e, "efa: a notification's reply address was refused");
                Err(())
            }
        }
    }

    /// The answer to `fi_addr` completed (or was not sent).
    pub(crate) fn release(&mut self, fi_addr: u64) {
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| e.fi_addr == fi_addr && e.in_flight > 0)
        {
            e.in_flight -= 1;
        }
    }

    /// The owner stops: the entries are dropped without removing them from the AV, which closes
    /// with the rail. On shm the endpoint stays open after the owner stops, and libfabric 2.6
    /// crashed in `fi_av_remove` of a reply address whose peer transport in this process had
    /// already closed.
    pub(crate) fn forget(&mut self) {
        self.entries.clear();
    }
}

impl Drop for ReplyBook {
    fn drop(&mut self) {
        for e in self.entries.drain(..) {
            self.rail.av_release(e.fi_addr);
        }
    }
}
