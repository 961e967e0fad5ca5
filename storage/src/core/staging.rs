//! Registered staging memory of the SSD tier: fixed slots of one engine allocation, so SSD reads
//! and writes move between files and staging by I/O, and between staging and callers through the
//! engine.

use parking_lot::{Condvar, Mutex};
use te_core::Registration;

/// Slots of one registered allocation.
#[derive(Debug)]
pub(crate) struct Staging {
    pub(crate) region: Registration,
    pub(crate) slot_bytes: u64,
    free: Mutex<Vec<usize>>,
    returned: Condvar,
}

/// A slot held until dropped.
pub(crate) struct Slot<'a> {
    staging: &'a Staging,
    index: usize,
}

impl Staging {
    pub(crate) fn new(region: Registration, slot_bytes: u64, slots: usize) -> Self {
        Staging {
            region,
            slot_bytes,
            free: Mutex::new((0..slots).rev().collect()),
            returned: Condvar::new(),
        }
    }

    /// Waits for a free slot.
    pub(crate) fn acquire(&self) -> Slot<'_> {
        let mut free = self.free.lock();
        loop {
            if let Some(index) = free.pop() {
                return Slot { staging: self, index };
            }
            self.returned.wait(&mut free);
        }
    }
}

#[cfg(feature = "cluster")]
impl Staging {
    /// Takes a free slot without waiting (for a remote reader: its lease returns it).
    pub(crate) fn try_acquire_index(&self) -> Option<usize> {
        self.free.lock().pop()
    }

    /// Returns a slot taken with [`Staging::try_acquire_index`].
    pub(crate) fn release_index(&self, index: usize) {
        self.free.lock().push(index);
        self.returned.notify_one();
    }

    /// Address of slot `index`.
    pub(crate) fn slot_addr(&self, index: usize) -> u64 {
        self.region.addr() + index as u64 * self.slot_bytes
    }

    /// First byte of slot `index`.
    pub(crate) fn slot_ptr(&self, index: usize) -> *mut u8 {
        debug_assert!(self.slot_addr(index) + self.slot_bytes <= self.region.addr() + self.region.len());
        // SAFETY: slot indices come from the free list, built as 0..slots, so the offset stays
        // inside the registered allocation.
        unsafe { self.region.as_ptr().add(index * self.slot_bytes as usize) }
    }
}

impl Slot<'_> {
    /// Address of the slot's first byte (4 KiB-aligned).
    pub(crate) fn addr(&self) -> u64 {
        self.staging.region.addr() + self.index as u64 * self.staging.slot_bytes
    }

    /// The slot's first byte.
    pub(crate) fn ptr(&self) -> *mut u8 {
        // SAFETY: the offset stays inside the registered allocation (index < slots).
        unsafe {
            self.staging
                .region
                .as_ptr()
                .add(self.index * self.staging.slot_bytes as usize)
        }
    }

    /// Bytes in the slot.
    pub(crate) fn len(&self) -> u64 {
        self.staging.slot_bytes
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.staging.free.lock().push(self.index);
        self.staging.returned.notify_one();
    }
}
