//! Local memory regions and their registrations on each rail.
//!
//! Serving-side safety: only regions the engine exports get remote access (FI_REMOTE_READ |
//! FI_REMOTE_WRITE) and a key in the descriptor. Local-only regions are registered with local access
//! only, and only when the provider needs local descriptors (FI_MR_LOCAL); otherwise they are not
//! registered with the provider at all, so no key exists that could reach them.
//!
//! Integration points (other helpers' modules, not committed when this was written):
//! - `te_base::registration` (the bounded, ordered registration pool): [`RegionTable::register`]
//!   registers serially on the calling thread; switch the per-(region, rail) loop to the pool.
//! - `te_base::topology` (rail-local placement): [`rails_for`] registers on every rail; it should
//!   return the rails local to the memory's device/NUMA node.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::RwLock;
use te_base::{Error, MemoryLocation, RegionId, RegionInfo, RegistrationFailure, Result};

use crate::fabric::{MemoryRegion, Rail, TRANSPORT};
use crate::wire::BufferKeys;

/// A registered local region: one optional registration per rail.
pub(crate) struct LocalRegion {
    pub info: RegionInfo,
    /// Indexed by rail; `None` where the region is not registered on that rail.
    pub mrs: Vec<Option<MemoryRegion>>,
}

impl LocalRegion {
    /// The local descriptor on `rail` (null when unregistered there or not needed).
    pub(crate) fn desc(&self, rail: usize) -> *mut std::ffi::c_void {
        match self.mrs.get(rail) {
            Some(Some(m)) => m.desc,
            _ => std::ptr::null_mut(),
        }
    }
}

/// The rails a region is registered on. Every rail until the topology module's rail-local
/// placement is available (see the module docs).
pub(crate) fn rails_for(_location: &MemoryLocation, rails: usize) -> std::ops::Range<usize> {
    0..rails
}

/// The regions this transport registered, by id.
#[derive(Default)]
pub(crate) struct RegionTable {
    regions: RwLock<HashMap<RegionId, Arc<LocalRegion>>>,
}

impl RegionTable {
    /// Registers a batch. On any failure nothing of the batch stays registered and the error
    /// lists every failed item.
    pub(crate) fn register(&self, rails: &[Arc<Rail>], batch: &[RegionInfo]) -> Result<Vec<serde_json::Value>> {
        let mut done: Vec<Arc<LocalRegion>> = Vec::with_capacity(batch.len());
        let mut failures = Vec::new();
        for (index, info) in batch.iter().enumerate() {
            match register_one(rails, info) {
                Ok(r) => done.push(Arc::new(r)),
                Err(cause) => failures.push(RegistrationFailure {
                    index,
                    len: info.len,
                    location: info.location.to_string(),
                    cause: Box::new(cause),
                }),
            }
        }
        if !failures.is_empty() {
            return Err(Error::RegistrationFailed { failures });
        }
        let mut table = self.regions.write();
        if let Some(dup) = done.iter().find(|r| table.contains_key(&r.info.id)) {
            return Err(Error::AlreadyRegistered {
                addr: dup.info.base,
                len: dup.info.len,
                region_base: dup.info.base,
                region_len: dup.info.len,
            });
        }
        let keys = done.iter().map(|r| keys_of(r)).collect();
        for r in done {
            table.insert(r.info.id, r);
        }
        Ok(keys)
    }

    /// Releases regions. Refused (and nothing of the batch released) while any of them is used by a
    /// transfer still owned by a rail.
    pub(crate) fn deregister(&self, batch: &[RegionInfo]) -> Result<()> {
        let mut table = self.regions.write();
        for info in batch {
            if let Some(r) = table.get(&info.id) {
                let users = Arc::strong_count(r) - 1;
                if users > 0 {
                    return Err(Error::InFlight {
                        base: info.base,
                        len: info.len,
                        in_flight: users as u64,
                    });
                }
            }
        }
        for info in batch {
            table.remove(&info.id);
        }
        Ok(())
    }

    /// Runs `f` with the table read-locked (one lock per batch on the data path).
    pub(crate) fn with<R>(&self, f: impl FnOnce(&HashMap<RegionId, Arc<LocalRegion>>) -> R) -> R {
        f(&self.regions.read())
    }

    /// Drops every registration (at shutdown).
    pub(crate) fn clear(&self) {
        self.regions.write().clear();
    }
}

fn register_one(rails: &[Arc<Rail>], info: &RegionInfo) -> Result<LocalRegion> {
    if info.len == 0 {
        return Err(Error::ZeroLength { index: 0 });
    }
    if info.base == 0 {
        return Err(Error::NullAddress);
    }
    if info.base.checked_add(info.len).is_none() {
        return Err(Error::LengthOverflow {
            addr: info.base,
            len: info.len,
        });
    }
    if !info.location.is_host() {
        // FI_HMEM hook: device memory needs the device plugin (pointer classification, PCI bus id)
        // and a provider granting FI_HMEM; register with the iface/device then.
        return Err(Error::WrongMemoryKind {
            transport: TRANSPORT.into(),
            what: format!("{} (FI_HMEM support waits for the device plugin)", info.location),
        });
    }
    let mut mrs: Vec<Option<MemoryRegion>> = (0..rails.len()).map(|_| None).collect();
    for r in rails_for(&info.location, rails.len()) {
        let rail = &rails[r];
        let needed = info.exported || rail.attrs.local_desc();
        if needed {
            mrs[r] = Some(rail.register(info.base, info.len, info.exported)?);
        }
    }
    Ok(LocalRegion { info: info.clone(), mrs })
}

fn keys_of(r: &LocalRegion) -> serde_json::Value {
    if !r.info.exported {
        return serde_json::Value::Null;
    }
    // An exported region is registered on every rail it is placed on; rails without it get key 0,
    // which no provider hands out for our registrations, so a peer using it is refused.
    let keys: Vec<u64> = r.mrs.iter().map(|m| m.as_ref().map_or(0, |m| m.key)).collect();
    BufferKeys::encode(&keys)
}
