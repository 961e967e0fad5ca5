//! Registering and releasing memory: validation, registration on every transport that serves the
//! memory kind (rolled back as a whole on failure), publication, and the deferred release of
//! regions that batches still use.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use te_base::device::PluginAvailability;
use te_base::{Error, MemoryKind, MemoryLocation, RegionId, RegionInfo, Result};

use super::handle::{RegisterOptions, Registration};
use super::EngineInner;
use crate::registry::{Owner, Region, Released};

/// Switches the registration cache for the whole engine (`0`/`off` turns it off; default on):
/// see [`RegisterOptions::reuse_covering`].
pub const REGISTRATION_CACHE_VAR: &str = "TE_REGISTRATION_CACHE";

/// Reads [`REGISTRATION_CACHE_VAR`]; a malformed value is an error naming it.
pub(crate) fn registration_cache(env: &dyn te_base::config::Env) -> Result<bool> {
    Ok(te_base::config::parse_bool(env, REGISTRATION_CACHE_VAR)?.unwrap_or(true))
}

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
    ///
    /// With the registration cache ([`RegisterOptions::reuse_covering`] and
    /// `TE_REGISTRATION_CACHE`, both on by default) an item inside a region already registered,
    /// or inside another item of the batch, becomes a view sharing that registration: no
    /// transport call and no descriptor update for it.
    #[tracing::instrument(name = "register", level = "debug", skip_all, fields(regions = items.len()))]
    pub(super) async fn register(
        self: &Arc<Self>,
        items: Vec<PendingRegion>,
        reg: RegisterOptions,
    ) -> Result<Vec<Registration>> {
        self.check_open()?;
        let _control = self.control.lock().await;
        let share = reg.reuse_covering && self.registration_cache;
        let weak = Arc::downgrade(self);
        let n = items.len();
        let mut out: Vec<Option<Registration>> = (0..n).map(|_| None).collect();
        // The ranges stay readable throughout; each owner is taken by the handle made for it.
        let (ranges, mut owners): (Vec<RawRegion>, Vec<Option<Owner>>) =
            items.into_iter().map(|p| (p.region, p.owned)).unzip();
        // Items inside a registered region: views of it. Dropping `out` on a later error
        // releases them again.
        let mut fresh: Vec<usize> = Vec::with_capacity(n);
        for (i, &region) in ranges.iter().enumerate() {
            check_range(i, &region)?;
            if share {
                let shared = self
                    .registry
                    .share(region.addr, region.len, |info| compatible(info, &region, reg))?;
                if let Some(covering) = shared {
                    out[i] = Some(Registration::view(
                        covering,
                        weak.clone(),
                        region.addr,
                        region.len,
                        owners[i].take(),
                    ));
                    continue;
                }
            } else if let Some(r) = self.registry.overlap(region.addr, region.len) {
                return Err(Error::AlreadyRegistered {
                    addr: region.addr,
                    len: region.len,
                    region_base: r.base,
                    region_len: r.len,
                });
            }
            fresh.push(i);
        }
        let hits = (n - fresh.len()) as u64;
        // The rest, by address (longest first at one address): an item inside the last
        // top-level one is a view of it, one that runs past its end overlaps it.
        fresh.sort_by_key(|&i| (ranges[i].addr, std::cmp::Reverse(ranges[i].len)));
        let mut top: Vec<usize> = Vec::with_capacity(fresh.len());
        let mut inner_views: Vec<(usize, usize)> = Vec::new();
        for &i in &fresh {
            let region = ranges[i];
            if let Some(&t) = top.last() {
                let cover = ranges[t];
                let cover_end = cover.addr + cover.len;
                if region.addr < cover_end {
                    if !share || region.addr + region.len > cover_end {
                        return Err(Error::AlreadyRegistered {
                            addr: region.addr,
                            len: region.len,
                            region_base: cover.addr,
                            region_len: cover.len,
                        });
                    }
                    let info = RegionInfo {
                        id: RegionId(0),
                        base: cover.addr,
                        len: cover.len,
                        location: cover.location,
                        exported: reg.export,
                    };
                    compatible(&info, &region, reg)?;
                    // The covering item by its position in `top` (the last one).
                    inner_views.push((i, top.len() - 1));
                    continue;
                }
            }
            if !region.location.is_host() {
                self.check_device_memory(region.addr, region.len, region.location)?;
            }
            top.push(i);
        }

        let infos: Vec<RegionInfo> = top
            .iter()
            .map(|&i| RegionInfo {
                id: RegionId(self.next_region.fetch_add(1, Ordering::Relaxed)),
                base: ranges[i].addr,
                len: ranges[i].len,
                location: ranges[i].location,
                exported: reg.export,
            })
            .collect();
        let keys = if infos.is_empty() {
            Vec::new()
        } else {
            self.register_on_transports(&infos).await?
        };
        let mut views_of = vec![0u64; top.len()];
        for &(_, k) in &inner_views {
            views_of[k] += 1;
        }
        let mut regions: Vec<Arc<Region>> = Vec::with_capacity(top.len());
        for (((&i, info), keys), views) in top.iter().zip(infos).zip(keys).zip(views_of) {
            let owned = owners[i].take();
            regions.push(Arc::new(Region {
                info,
                keys,
                in_flight: AtomicU64::new(0),
                dying: AtomicBool::new(false),
                handles: AtomicU64::new(1 + views),
                _owned: owned,
            }));
        }
        if !regions.is_empty() {
            self.registry.insert(regions.clone())?;
            if reg.export {
                if let Err(e) = self.publish().await {
                    // The caller gets no handle: the regions must not stay reachable. Withdraw
                    // them from every transport before returning, then try to publish without them.
                    self.roll_back(&regions).await;
                    if let Err(e2) = self.publish().await {
                        tracing::warn!("republishing after a failed registration failed too: {e2}");
                    }
                    return Err(e);
                }
            }
        }
        for (&i, region) in top.iter().zip(&regions) {
            out[i] = Some(Registration::whole(region.clone(), weak.clone()));
        }
        for &(i, k) in &inner_views {
            let covering = regions.get(k).ok_or_else(|| internal("covering region"))?;
            out[i] = Some(Registration::view(
                covering.clone(),
                weak.clone(),
                ranges[i].addr,
                ranges[i].len,
                owners[i].take(),
            ));
        }
        let hits = hits + inner_views.len() as u64;
        if hits > 0 {
            self.metrics.record_cache_hits(hits);
            if let Some(e) = &self.export {
                e.cache_hits(hits);
            }
        }
        out.into_iter()
            .map(|r| r.ok_or_else(|| internal("registration")))
            .collect()
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

    /// Releases one handle now. The last one deregisters the region if idle (else
    /// [`Error::InFlight`]). The control lock covers only the publish; the transports'
    /// deregistration, which may wait for remote requests to drain (bounded by each transport's
    /// timeout), runs outside it, so `allocate` and `register` never wait behind a slow peer.
    pub(crate) async fn deregister_handle(self: &Arc<Self>, region: &Arc<Region>) -> Result<()> {
        // On InFlight the consumed handle's drop defers the release until its transfers complete.
        if let Released::Removed(r) = self.registry.release_handle(region, true)? {
            self.deregister_transports(&r.info).await;
            if r.info.exported {
                let _control = self.control.lock().await;
                self.publish().await?;
            }
        }
        Ok(())
    }

    /// Drop path of a handle: the last one deregisters now if idle, else when the last batch on
    /// the region completes.
    pub(crate) fn release_on_drop(self: &Arc<Self>, region: &Arc<Region>) {
        match self.registry.release_handle(region, false) {
            Ok(Released::Removed(r)) => self.finish_release(vec![r]),
            Ok(Released::Dying) => {
                // The batch may have finished between the check and the mark.
                self.reap_dying();
            }
            Ok(Released::Shared | Released::Gone) => {}
            Err(e) => tracing::warn!("releasing a registration handle failed: {e}"),
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

/// Checks one pending region on its own: non-zero, non-null, no overflow.
fn check_range(i: usize, r: &RawRegion) -> Result<()> {
    if r.len == 0 {
        return Err(Error::ZeroLength { index: i });
    }
    if r.addr == 0 {
        return Err(Error::NullAddress);
    }
    if r.addr.checked_add(r.len).is_none() || usize::try_from(r.addr + r.len).is_err() {
        return Err(Error::LengthOverflow {
            addr: r.addr,
            len: r.len,
        });
    }
    Ok(())
}

/// Whether `requested` (inside `covering`) may share its registration: same export flag and the
/// same memory (kind and device; a host NUMA node only if both name one, and then the same).
fn compatible(covering: &RegionInfo, requested: &RawRegion, reg: RegisterOptions) -> Result<()> {
    let mismatch = |what: &'static str, region: String, requested_value: String| Error::RegistrationMismatch {
        addr: requested.addr,
        len: requested.len,
        region_base: covering.base,
        region_len: covering.len,
        what,
        region,
        requested: requested_value,
    };
    if covering.exported != reg.export {
        let word = |e: bool| if e { "exported" } else { "local only" }.to_string();
        return Err(mismatch("export", word(covering.exported), word(reg.export)));
    }
    let same = match (covering.location, requested.location) {
        (MemoryLocation::Host { numa: Some(a) }, MemoryLocation::Host { numa: Some(b) }) => a == b,
        (MemoryLocation::Host { .. }, MemoryLocation::Host { .. }) => true,
        (a, b) => a == b,
    };
    if !same {
        return Err(mismatch(
            "location",
            covering.location.to_string(),
            requested.location.to_string(),
        ));
    }
    Ok(())
}

/// A broken invariant of [`EngineInner::register`], reported rather than panicking.
fn internal(what: &str) -> Error {
    Error::transport("engine", format!("registration bookkeeping lost its {what} (a bug)"))
}
