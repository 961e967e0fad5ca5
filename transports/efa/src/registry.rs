//! Local memory regions and their registrations on each rail.
//!
//! Registration goes through the process-wide [`RegistrationPool`] (bounded workers, size-ordered
//! dispatch, all-or-nothing batches) with this transport as its [`RegistrationProvider`]: one
//! `fi_mr_regattr` per (region, rail). Which rails a region lands on comes from the topology's
//! [`NicPlacement`](te_topology::NicPlacement) (rail-local NICs for a GPU or NUMA node), mapped from topology NICs to our
//! provider domains by name; without RDMA NICs in sysfs (software providers) every rail is used.
//!
//! Serving-side safety: only regions the engine exports get remote access (FI_REMOTE_READ |
//! FI_REMOTE_WRITE) and a key in the descriptor. Local-only regions are registered with local access
//! only, and only when the provider needs local descriptors (FI_MR_LOCAL); otherwise they are not
//! registered with the provider at all, so no key exists that could reach them.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::RwLock;
use te_base::registration::{register_regions, RegistrationPool, RegistrationProvider};
use te_base::{Error, RegionId, RegionInfo, RegistrationFailure, Result};
use te_topology::RailPlacement;

use crate::fabric::{MemoryRegion, Rail, TRANSPORT};
use crate::wire::BufferKeys;

/// A registered local region: one optional registration per rail.
pub(crate) struct LocalRegion {
    pub info: RegionInfo,
    /// Indexed by rail; `None` where the region is not registered on that rail.
    pub mrs: Vec<Option<MemoryRegion>>,
    /// Rails this region can be used on as the local side (registered there, or the rail needs no
    /// local descriptor).
    pub usable: u64,
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

/// This transport as the registration pool's provider.
pub(crate) struct Registrar {
    rails: Vec<Arc<Rail>>,
    placement: Option<RailPlacement>,
}

impl Registrar {
    pub(crate) fn new(rails: Vec<Arc<Rail>>, placement: Option<RailPlacement>) -> Self {
        Registrar { rails, placement }
    }

    /// The rails the topology places `region` on (every rail when it cannot say).
    fn placed(&self, region: &RegionInfo) -> Vec<usize> {
        match &self.placement {
            Some(p) => p.rails_for(region, self.rails.len(), TRANSPORT),
            None => (0..self.rails.len()).collect(),
        }
    }
}

impl RegistrationProvider for Registrar {
    type Handle = MemoryRegion;

    fn name(&self) -> &str {
        TRANSPORT
    }

    fn domain_count(&self) -> usize {
        self.rails.len()
    }

    fn domains_for(&self, region: &RegionInfo) -> Vec<usize> {
        // Local-only regions need a registration only where the provider wants local descriptors.
        self.placed(region)
            .into_iter()
            .filter(|&r| region.exported || self.rails[r].attrs.local_desc())
            .collect()
    }

    fn register(&self, domain: usize, region: &RegionInfo) -> Result<MemoryRegion> {
        self.rails[domain].register(region.base, region.len, region.exported)
    }

    fn deregister(&self, _domain: usize, _region: &RegionInfo, handle: MemoryRegion) -> Result<()> {
        handle.close()
    }
}

/// The regions this transport registered, by id.
pub(crate) struct RegionTable {
    registrar: Arc<Registrar>,
    regions: RwLock<HashMap<RegionId, Arc<LocalRegion>>>,
}

impl RegionTable {
    pub(crate) fn new(registrar: Registrar) -> Self {
        RegionTable {
            registrar: Arc::new(registrar),
            regions: RwLock::new(HashMap::new()),
        }
    }

    /// Registers a batch through the registration pool. On any failure nothing of the batch stays
    /// registered and the error lists every failed item.
    pub(crate) fn register(&self, batch: &[RegionInfo]) -> Result<Vec<serde_json::Value>> {
        let failures: Vec<RegistrationFailure> = batch
            .iter()
            .enumerate()
            .filter_map(|(index, info)| {
                validate(info).err().map(|cause| RegistrationFailure {
                    index,
                    len: info.len,
                    location: info.location.to_string(),
                    cause: Box::new(cause),
                })
            })
            .collect();
        if !failures.is_empty() {
            return Err(Error::RegistrationFailed { failures });
        }
        {
            let table = self.regions.read();
            if let Some(dup) = batch.iter().find(|r| table.contains_key(&r.id)) {
                return Err(Error::AlreadyRegistered {
                    addr: dup.base,
                    len: dup.len,
                    region_base: dup.base,
                    region_len: dup.len,
                });
            }
        }
        let pool = RegistrationPool::global()?;
        let handles = register_regions(pool, &self.registrar, batch.to_vec())?;
        let rails = self.registrar.rails.len();
        let mut keys = Vec::with_capacity(batch.len());
        let mut table = self.regions.write();
        for (info, regs) in batch.iter().zip(handles) {
            let mut mrs: Vec<Option<MemoryRegion>> = (0..rails).map(|_| None).collect();
            for (rail, mr) in regs {
                mrs[rail] = Some(mr);
            }
            let usable = (0..rails)
                .filter(|&r| mrs[r].is_some() || !self.registrar.rails[r].attrs.local_desc())
                .fold(0u64, |m, r| m | (1 << r));
            let region = LocalRegion {
                info: info.clone(),
                mrs,
                usable,
            };
            keys.push(keys_of(&region));
            table.insert(info.id, Arc::new(region));
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
        let removed: Vec<Arc<LocalRegion>> = batch.iter().filter_map(|i| table.remove(&i.id)).collect();
        drop(table);
        // Nothing else holds them (checked above), so this closes every registration.
        drop(removed);
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

fn validate(info: &RegionInfo) -> Result<()> {
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
        // and a provider granting FI_HMEM; the registration then passes the iface and device
        // (`te_fi_mr_reg`'s hmem arguments) instead of 0/0.
        return Err(Error::WrongMemoryKind {
            transport: TRANSPORT.into(),
            what: format!("{} (FI_HMEM support waits for the device plugin)", info.location),
        });
    }
    Ok(())
}

fn keys_of(r: &LocalRegion) -> serde_json::Value {
    if !r.info.exported {
        return serde_json::Value::Null;
    }
    let keys: Vec<Option<u64>> = r.mrs.iter().map(|m| m.as_ref().map(|m| m.key)).collect();
    BufferKeys::encode(&keys)
}
