//! Registration handles: what callers hold for memory registered with the engine.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use te_base::{MemoryLocation, RegionId, Result};

use super::EngineInner;
use crate::registry::Region;

/// Options for registering memory.
#[derive(Debug, Clone, Copy)]
pub struct RegisterOptions {
    /// Export the region to peers (it appears in the segment descriptor and remote engines may
    /// read and write it). Default: true. Memory that is not exported can only be the local side
    /// of a transfer.
    pub export: bool,
}

impl Default for RegisterOptions {
    fn default() -> Self {
        RegisterOptions { export: true }
    }
}

impl RegisterOptions {
    /// Registered for local use only; peers cannot reach it.
    pub fn local_only() -> Self {
        RegisterOptions { export: false }
    }
}

/// A region registered with a [`crate::TransferEngine`].
///
/// Dropping it deregisters the region without blocking the dropping thread: the release runs on
/// the engine's runtime. If transfers on it are still in flight, the region stops accepting new
/// transfers at once and is deregistered (and engine-allocated memory freed) when the last one
/// completes. [`Registration::deregister`] reports that case as an error.
#[derive(Debug)]
pub struct Registration {
    pub(crate) region: Arc<Region>,
    pub(crate) engine: Weak<EngineInner>,
    pub(crate) released: AtomicBool,
}

impl Registration {
    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        self.region.info.base
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.region.info.len
    }

    /// Never true: zero-length registrations are refused.
    pub fn is_empty(&self) -> bool {
        self.region.info.len == 0
    }

    /// The first byte as a pointer. Reads and writes through it race with transfers on the same
    /// bytes; synchronise with batch completion.
    pub fn as_ptr(&self) -> *mut u8 {
        self.region.info.base as *mut u8
    }

    /// Where the memory lives.
    pub fn location(&self) -> MemoryLocation {
        self.region.info.location
    }

    /// The engine's id of the region.
    pub fn id(&self) -> RegionId {
        self.region.info.id
    }

    /// True if peers can reach it.
    pub fn is_exported(&self) -> bool {
        self.region.info.exported
    }

    /// Copies `data` into the region at `offset` (host memory only).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check_host_range(offset, data.len() as u64)?;
        // SAFETY: the range was checked to lie inside this live host region; the region stays
        // mapped while `self` exists. Concurrent transfers on the same bytes are the caller's
        // responsibility, as for any DMA-visible memory.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.as_ptr().add(offset as usize), data.len()) };
        Ok(())
    }

    /// Copies bytes of the region at `offset` into `out` (host memory only).
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check_host_range(offset, out.len() as u64)?;
        // SAFETY: as in `write_at`; the source range lies inside the live region.
        unsafe { std::ptr::copy_nonoverlapping(self.as_ptr().add(offset as usize), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn check_host_range(&self, offset: u64, len: u64) -> Result<()> {
        if !self.region.info.location.is_host() {
            return Err(te_base::Error::WrongMemoryKind {
                transport: "registration".into(),
                what: self.region.info.location.to_string(),
            });
        }
        let addr = self.addr().checked_add(offset).ok_or(te_base::Error::LengthOverflow {
            addr: self.addr(),
            len: offset,
        })?;
        if !self.region.info.contains(addr, len) {
            return Err(te_base::Error::PartlyRegistered {
                addr,
                len,
                region_base: self.addr(),
                region_len: self.len(),
            });
        }
        Ok(())
    }

    /// Deregisters now and consumes the handle. While transfers use the region this is refused
    /// with [`te_base::Error::InFlight`]; the region then stops accepting new transfers at once
    /// and is released when the last one completes, as on drop. Waits on remote peers only
    /// within the transports' own deadlines, and never under the engine's control lock.
    pub async fn deregister(self) -> Result<()> {
        let Some(engine) = self.engine.upgrade() else {
            self.released.store(true, Ordering::Release);
            return Ok(());
        };
        if self.released.load(Ordering::Acquire) {
            return Ok(());
        }
        engine.deregister_idle(&self.region).await?;
        self.released.store(true, Ordering::Release);
        Ok(())
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if self.released.load(Ordering::Acquire) {
            return;
        }
        if let Some(engine) = self.engine.upgrade() {
            engine.release_on_drop(self.region.clone());
        }
    }
}
