//! Registration handles: what callers hold for memory registered with the engine.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use te_base::{MemoryLocation, RegionId, Result};

use super::EngineInner;
use crate::registry::{Owner, Region};

/// Options for registering memory.
#[derive(Debug, Clone, Copy)]
pub struct RegisterOptions {
    /// Export the region to peers (it appears in the segment descriptor and remote engines may
    /// read and write it). Default: true. Memory that is not exported can only be the local side
    /// of a transfer.
    pub export: bool,
    /// The registration cache: a range that lies inside a region already registered with this
    /// engine (a tensor that is a view of a registered pool) gets a handle of its own that shares
    /// the covering registration, with no transport registration and no descriptor update; the
    /// covering registration is released when its last handle goes. Its options must match the
    /// covering region's ([`te_base::Error::RegistrationMismatch`] names what differs). Default:
    /// true; `false` (or `TE_REGISTRATION_CACHE=0` for the whole engine) refuses such a range with
    /// [`te_base::Error::AlreadyRegistered`], as before the cache. See `docs/registration.md`.
    pub reuse_covering: bool,
}

impl Default for RegisterOptions {
    fn default() -> Self {
        RegisterOptions {
            export: true,
            reuse_covering: true,
        }
    }
}

impl RegisterOptions {
    /// Registered for local use only; peers cannot reach it.
    pub fn local_only() -> Self {
        RegisterOptions {
            export: false,
            ..Self::default()
        }
    }

    /// These options without the registration cache: a range inside a registered region is
    /// refused with [`te_base::Error::AlreadyRegistered`].
    pub fn without_cache(self) -> Self {
        RegisterOptions {
            reuse_covering: false,
            ..self
        }
    }
}

/// A region registered with a [`crate::TransferEngine`], or a view of one: a handle of a range
/// inside an already registered region, which shares that region's registration (the
/// registration cache, [`RegisterOptions::reuse_covering`]).
///
/// Every handle of a registration counts: the covering registration (its transport keys, its
/// descriptor entry, the memory it owns) lives until the last of them (its own and every view's)
/// is dropped or deregistered. Releasing the handle the region was registered with while views
/// live releases only that handle; the views keep the whole covering region registered and
/// reachable, peers included if it is exported.
///
/// Dropping the last handle deregisters the region without blocking the dropping thread: the
/// release runs on the engine's runtime. If transfers on it are still in flight, the region stops
/// accepting new transfers at once and is deregistered (and engine-allocated memory freed) when
/// the last one completes. [`Registration::deregister`] reports that case as an error.
#[derive(Debug)]
pub struct Registration {
    pub(crate) region: Arc<Region>,
    pub(crate) engine: Weak<EngineInner>,
    pub(crate) released: AtomicBool,
    /// This handle's own range: the region's, or a view's inside it.
    pub(crate) base: u64,
    pub(crate) len: u64,
    /// True if the cache handed this handle out (it shares a registration made earlier).
    pub(crate) view: bool,
    /// What a caller of `register_raw_owned` handed over for a view, dropped with the handle: the
    /// covering registration's own owner or memory contract keeps the view's bytes valid.
    pub(crate) _owner: Option<Owner>,
}

impl Registration {
    /// A handle of the whole of `region`, which was just registered.
    pub(crate) fn whole(region: Arc<Region>, engine: Weak<EngineInner>) -> Self {
        Registration {
            base: region.info.base,
            len: region.info.len,
            region,
            engine,
            released: AtomicBool::new(false),
            view: false,
            _owner: None,
        }
    }

    /// A handle of `[base, base + len)` inside `region`, whose handle count already includes it.
    pub(crate) fn view(
        region: Arc<Region>,
        engine: Weak<EngineInner>,
        base: u64,
        len: u64,
        owner: Option<Owner>,
    ) -> Self {
        Registration {
            region,
            engine,
            released: AtomicBool::new(false),
            base,
            len,
            view: true,
            _owner: owner,
        }
    }

    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        self.base
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Never true: zero-length registrations are refused.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True if this handle shares a registration made earlier (or by another range of the same
    /// batch) instead of having registered on the transports itself.
    pub fn is_view(&self) -> bool {
        self.view
    }

    /// The registered region this handle shares: `(first byte, length)`. The handle's own range
    /// unless it is a view.
    pub fn covering(&self) -> (u64, u64) {
        (self.region.info.base, self.region.info.len)
    }

    /// The first byte as a pointer. Reads and writes through it race with transfers on the same
    /// bytes; synchronise with batch completion.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base as *mut u8
    }

    /// Where the memory lives.
    pub fn location(&self) -> MemoryLocation {
        self.region.info.location
    }

    /// The engine's id of the region (a view has its covering region's).
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
        let inside = addr >= self.base && len <= self.len && addr - self.base <= self.len - len;
        if !inside {
            return Err(te_base::Error::PartlyRegistered {
                addr,
                len,
                region_base: self.addr(),
                region_len: self.len(),
            });
        }
        Ok(())
    }

    /// Deregisters now and consumes the handle. If other handles share the registration (views,
    /// or the handle the views share), only this handle is released and the registration stays.
    /// For the last handle: while transfers use the region this is refused with
    /// [`te_base::Error::InFlight`]; the region then stops accepting new transfers at once and is
    /// released when the last one completes, as on drop. Waits on remote peers only within the
    /// transports' own deadlines, and never under the engine's control lock.
    pub async fn deregister(self) -> Result<()> {
        let Some(engine) = self.engine.upgrade() else {
            self.released.store(true, Ordering::Release);
            return Ok(());
        };
        if self.released.load(Ordering::Acquire) {
            return Ok(());
        }
        engine.deregister_handle(&self.region).await?;
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
            engine.release_on_drop(&self.region);
        }
    }
}
