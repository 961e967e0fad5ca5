//! What the pool needs to know about an item it registers: its size (for ordering) and where the
//! memory lives (for failure reports).

use crate::memory::{MemoryLocation, RegionInfo};

/// An item of a registration or deregistration batch.
pub trait RegistrationItem {
    /// Size of the buffer in bytes; used to order the batch and to report failures.
    fn size(&self) -> u64;
    /// Where the buffer lives; used to report failures.
    fn location(&self) -> MemoryLocation;
}

impl RegistrationItem for RegionInfo {
    fn size(&self) -> u64 {
        self.len
    }

    fn location(&self) -> MemoryLocation {
        self.location
    }
}

/// An item paired with what its registration produced (a handle, a key), as deregistration takes it.
impl<I: RegistrationItem, H> RegistrationItem for (I, H) {
    fn size(&self) -> u64 {
        self.0.size()
    }

    fn location(&self) -> MemoryLocation {
        self.0.location()
    }
}
