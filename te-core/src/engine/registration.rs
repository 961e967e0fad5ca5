//! Registering and releasing memory: validation, registration on every transport that serves the
//! memory kind (rolled back as a whole on failure), publication, and the deferred release of
//! regions that batches still use.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use te_base::device::PluginAvailability;
use te_base::{Error, MemoryKind, MemoryLocation, RegionId, RegionInfo, Result};

use super::handle::{RegisterOptions, Registration};
use super::EngineInner;
use crate::registry::{Owner, Region};

/// One raw region for [`TransferEngine::register_raw_batch`](crate::TransferEngine::register_raw_batch).
#[derive(Debug, Clone, Copy)]
pub struct RawRegion {
    /// First byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Where it lives.
    pub location: MemoryLocation,
}

/// One region on its way into [`EngineInner::register`]: a caller's raw region, with the host
/// owner of its memory when there is one (the engine's host buffer, a caller's owner).
pub(crate) struct PendingRegion {
    pub region: RawRegion,
    pub owned: Option<Owner>,
}

/// A region's keys: one per transport it is registered on.
type RegionKeys = Vec<(&'static str, serde_json::Value)>;

impl EngineInner {
    /// Registers `items` as one batch under the control lock: all of them or none.
    #[tracing::instrument(name = "register", level = "debug", skip_all, fields(regions = items.len()))]
    pub(super) async fn register(
        self: &Arc<Self>,
        items: Vec<PendingRegion>,
        reg: RegisterOptions,
    ) -> Result<Vec<Registration>> {
        let _control = self.control.lock().await;
        self.validate_new_regions(&items)?;
        let infos: Vec<RegionInfo> = items
            .iter()
            .map(|p| RegionInfo {
                id: RegionId(self.next_region.fetch_add(1, Ordering::Relaxed)),
                base: p.region.addr,
                len: p.region.len,
                location: p.region.location,
                exported: reg.export,
            })
            .collect();

        let keys = self.register_on_transports(&infos).await?;
        let regions: Vec<Arc<Region>> = infos
            .into_iter()
            .zip(keys)
            .zip(items)
            .map(|((info, keys), PendingRegion { owned, .. })| {
                Arc::new(Region {
                    info,
                    keys,
                    in_flight: AtomicU64::new(0),
                    dying: AtomicBool::new(false),
                    _owned: owned,
                })
            })
            .collect();
        self.registry.insert(regions.clone())?;
        if reg.export {
            if let Err(e) = self.publish().await {
                // The caller gets no handle: the regions must not stay reachable. Withdraw them
                // from every transport before returning, then try to publish without them.
                self.roll_back(&regions).await;
                if let Err(e2) = self.publish().await {
                    tracing::warn!("republishing after a failed registration failed too: {e2}");
                }
                return Err(e);
            }
        }
        let weak = Arc::downgrade(self);
        Ok(regions
            .into_iter()
            .map(|region| Registration {
                region,
                engine: weak.clone(),
                released: AtomicBool::new(false),
            })
            .collect())
    }

    /// Registers the regions on every transport that serves their memory kind and returns each
    /// region's keys, one per transport. On any failure, or if a region has no transport at all,
    /// what was registered is withdrawn and nothing stays registered.
    async fn register_on_transports(&self, infos: &[RegionInfo]) -> Result<Vec<RegionKeys>> {
        let mut keys: Vec<RegionKeys> = vec![Vec::new(); infos.len()];
        let mut done: Vec<(usize, Vec<RegionInfo>)> = Vec::new();
        let mut failure = None;
        for (ti, t) in self.transports.iter().enumerate() {
            let caps = t.capabilities();
            let (idx, subset): (Vec<usize>, Vec<RegionInfo>) = infos
                .iter()
                .enumerate()
                .filter(|(_, r)| caps.local.contains(r.location.kind()) || caps.remote.contains(r.location.kind()))
                .map(|(i, r)| (i, r.clone()))
                .unzip();
            if subset.is_empty() {
                continue;
            }
            let started = std::time::Instant::now();
            let registered = t.register(&subset).await;
            if let Some(e) = &self.export {
                e.registered(ti, subset.len(), started.elapsed(), registered.is_ok());
            }
            match registered {
                Ok(k) => {
                    for (i, v) in idx.into_iter().zip(k) {
                        keys[i].push((t.name(), v));
                    }
                    done.push((ti, subset));
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        if failure.is_none() {
            failure = infos
                .iter()
                .enumerate()
                .find(|(i, _)| keys[*i].is_empty())
                .map(|(i, r)| Error::NoTransport {
                    segment: self.name.clone(),
                    reason: format!("no installed transport serves {} memory (item {i})", r.location),
                });
        }
        let Some(e) = failure else {
            return Ok(keys);
        };
        for (tj, regions) in done {
            if let Err(e2) = self.transports[tj].deregister(&regions).await {
                tracing::warn!(
                    "rollback of registration on {} failed: {e2}",
                    self.transports[tj].name()
                );
            }
        }
        Err(e)
    }

    /// Checks every pending region (non-zero, non-null, no overflow, device memory of the declared
    /// kind, no overlap with registered memory or with each other) before anything is registered.
    fn validate_new_regions(&self, items: &[PendingRegion]) -> Result<()> {
        for (i, RawRegion { addr, len, location }) in items.iter().map(|p| p.region).enumerate() {
            if len == 0 {
                return Err(Error::ZeroLength { index: i });
            }
            if addr == 0 {
                return Err(Error::NullAddress);
            }
            if addr.checked_add(len).is_none() || usize::try_from(addr + len).is_err() {
                return Err(Error::LengthOverflow { addr, len });
            }
            if !location.is_host() {
                self.check_device_memory(addr, len, location)?;
            }
            if let Some(r) = self.registry.overlap(addr, len) {
                return Err(Error::AlreadyRegistered {
                    addr,
                    len,
                    region_base: r.base,
                    region_len: r.len,
                });
            }
        }
        let mut order: Vec<RawRegion> = items.iter().map(|p| p.region).collect();
        order.sort_by_key(|r| r.addr);
        for w in order.windows(2) {
            let (a, b) = (w[0], w[1]);
            if a.addr + a.len > b.addr {
                return Err(Error::AlreadyRegistered {
                    addr: b.addr,
                    len: b.len,
                    region_base: a.addr,
                    region_len: a.len,
                });
            }
        }
        Ok(())
    }

    /// Classifies device memory once, at registration, through the plugin of its kind: both
    /// ends of the range must be memory of the declared device. The data path never asks again.
    fn check_device_memory(&self, addr: u64, len: u64, location: MemoryLocation) -> Result<()> {
        let kind = location.kind();
        let plugin = self.plugins.iter().find(|p| match p {
            PluginAvailability::Loaded(pl) => pl.memory_kind() == kind,
            PluginAvailability::Unavailable { name, .. } => plugin_kind(name) == Some(kind),
        });
        let plugin = match plugin {
            None => {
                return Err(Error::not_available(
                    kind.to_string(),
                    format!("no device plugin for {location} memory is compiled in (cargo feature cuda or hip)"),
                ))
            }
            Some(PluginAvailability::Unavailable { error, .. }) => return Err(error.clone()),
            Some(PluginAvailability::Loaded(p)) => p,
        };
        for probe in [addr, addr + len - 1] {
            let found = plugin.classify(probe)?.location(kind)?;
            if found != location {
                return Err(Error::WrongMemoryKind {
                    transport: plugin.name().to_string(),
                    what: format!("[{addr:#x}, +{len}) declared {location} but {probe:#x} is {found}"),
                });
            }
        }
        Ok(())
    }

    async fn deregister_transports(&self, info: &RegionInfo) {
        for t in &self.transports {
            let caps = t.capabilities();
            if caps.local.contains(info.location.kind()) || caps.remote.contains(info.location.kind()) {
                if let Err(e) = t.deregister(std::slice::from_ref(info)).await {
                    tracing::warn!("deregistration on {} failed: {e}", t.name());
                }
            }
        }
    }

    /// Removes regions registered by a call that then failed. Regions a batch already uses
    /// (someone guessed the address) are marked dying and released when it completes.
    async fn roll_back(&self, regions: &[Arc<Region>]) {
        for r in regions {
            match self.registry.remove_idle(r.info.id, r.info.base) {
                Ok(Some(r)) => self.deregister_transports(&r.info).await,
                Ok(None) => {}
                Err(_) => self.registry.mark_dying(r.info.id, r.info.base),
            }
        }
    }

    /// Deregisters an idle region. The control lock covers only the table update and the
    /// publish; the transports' deregistration, which may wait for remote requests to drain
    /// (bounded by each transport's timeout), runs outside it, so `allocate` and `register`
    /// never wait behind a slow peer.
    pub(crate) async fn deregister_idle(self: &Arc<Self>, region: &Arc<Region>) -> Result<()> {
        // On InFlight the consumed handle's drop defers the release until its transfers complete.
        if let Some(r) = self.registry.remove_idle(region.info.id, region.info.base)? {
            self.deregister_transports(&r.info).await;
            if r.info.exported {
                let _control = self.control.lock().await;
                self.publish().await?;
            }
        }
        Ok(())
    }

    /// Drop path: deregister now if idle, else when the last batch on the region completes.
    pub(crate) fn release_on_drop(self: &Arc<Self>, region: Arc<Region>) {
        match self.registry.remove_idle(region.info.id, region.info.base) {
            Ok(Some(r)) => self.finish_release(vec![r]),
            Ok(None) => {}
            Err(_) => {
                self.registry.mark_dying(region.info.id, region.info.base);
                // The batch may have finished between the two calls.
                self.reap_dying();
            }
        }
    }

    pub(crate) fn reap_dying(self: &Arc<Self>) {
        let finished = self.registry.take_finished_dying();
        if !finished.is_empty() {
            self.finish_release(finished);
        }
    }

    /// Hands the release to the engine's runtime: dropping a handle (or finishing the last batch
    /// on a dropped region) never blocks its thread, whatever a remote peer does. Memory owned by
    /// the regions is freed only after every transport let go of it; if the runtime shuts down
    /// first, the memory is leaked rather than freed while a transport might still touch it.
    fn finish_release(self: &Arc<Self>, regions: Vec<Arc<Region>>) {
        let me = self.clone();
        let infos: Vec<RegionInfo> = regions.iter().map(|r| r.info.clone()).collect();
        let exported = infos.iter().any(|r| r.exported);
        let mut keep = LeakUnlessReleased(Some(regions));
        self.runtime.spawn(async move {
            for info in &infos {
                me.deregister_transports(info).await;
            }
            drop(keep.0.take());
            if exported {
                let _control = me.control.lock().await;
                if let Err(e) = me.publish().await {
                    tracing::warn!("republishing descriptor after deregistration failed: {e}");
                }
            }
        });
    }
}

/// Regions on their way out: freed once the transports released them, leaked if the release task
/// is dropped unfinished (its runtime shut down), since a transport might still touch them.
struct LeakUnlessReleased(Option<Vec<Arc<Region>>>);

impl Drop for LeakUnlessReleased {
    fn drop(&mut self) {
        if let Some(regions) = self.0.take() {
            tracing::warn!(
                "{} region(s) leaked: the engine's runtime shut down during their release",
                regions.len()
            );
            std::mem::forget(regions);
        }
    }
}

fn plugin_kind(name: &str) -> Option<MemoryKind> {
    match name {
        "cuda" => Some(MemoryKind::Cuda),
        "hip" => Some(MemoryKind::Rocm),
        _ => None,
    }
}
