//! The transfer engine: registers memory, publishes and opens segments, and routes batches of
//! reads and writes to the transport that can serve them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::{Mutex, RwLock};
use te_base::config::Env;
use te_base::{
    Batch, BatchReport, BatchState, Capabilities, Error, ExportedBuffer, HostBuffer, HostBufferOptions, MemoryKind,
    MemoryLocation, MetadataStore, Peer, Phase, PhaseReport, PhaseStats, PhaseTimer, RegionId, RegionInfo, Result,
    SegmentDescriptor, SegmentId, SubmitContext, TransferRequest, Transport, TransportEndpoint,
};

use te_base::device::PluginAvailability;

use crate::builder::TransferEngineBuilder;
use crate::grouping::{group_requests, Grouped};
use crate::handle::{RegisterOptions, Registration};
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::registry::{Pins, Region, Registry};

/// A transport compiled into this build and whether it runs here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportStatus {
    /// Transport name.
    pub name: String,
    /// `None` when installed and usable; otherwise why not.
    pub unavailable: Option<String>,
}

/// One route to an open segment: a transport and its connection.
struct Route {
    transport: usize,
    caps: Capabilities,
    peer: Arc<dyn Peer>,
}

/// A segment opened by this engine.
pub(crate) struct OpenSegment {
    pub descriptor: Arc<SegmentDescriptor>,
    routes: Vec<Route>,
}

impl OpenSegment {
    /// The first route whose transport moves `local` memory to and from `remote` memory.
    pub fn route_for(&self, local: MemoryKind, remote: MemoryKind) -> Option<usize> {
        self.routes
            .iter()
            .position(|r| r.caps.local.contains(local) && r.caps.remote.contains(remote))
    }
}

/// A handle on an open segment.
#[derive(Debug, Clone)]
pub struct SegmentHandle {
    id: SegmentId,
    descriptor: Arc<SegmentDescriptor>,
}

impl SegmentHandle {
    /// The id to put in [`TransferRequest::segment`].
    pub fn id(&self) -> SegmentId {
        self.id
    }

    /// The segment's name.
    pub fn name(&self) -> &str {
        &self.descriptor.name
    }

    /// The descriptor it was opened with.
    pub fn descriptor(&self) -> &SegmentDescriptor {
        &self.descriptor
    }

    /// The buffers the segment exports.
    pub fn buffers(&self) -> &[ExportedBuffer] {
        &self.descriptor.buffers
    }
}

/// Per-call options of [`TransferEngine::submit_with`].
#[derive(Debug, Clone, Default)]
pub struct SubmitOptions {
    /// Work nobody waits on: the local copy stays inline.
    pub background: bool,
    /// Record this call's phases (the engine's resolve/build/other, the transport's plan/submit)
    /// into the caller's timer instead of the engine's; the caller counts its own calls.
    pub timer: Option<PhaseTimer>,
}

/// One raw region for [`TransferEngine::register_raw_batch`].
#[derive(Debug, Clone, Copy)]
pub struct RawRegion {
    /// First byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Where it lives.
    pub location: MemoryLocation,
}

pub(crate) struct EngineInner {
    pub(crate) name: String,
    pub(crate) instance: u64,
    pub(crate) metadata: Arc<dyn MetadataStore>,
    pub(crate) transports: Vec<Arc<dyn Transport>>,
    pub(crate) statuses: Vec<TransportStatus>,
    pub(crate) plugins: Vec<PluginAvailability>,
    pub(crate) registry: Registry,
    segments: RwLock<Vec<Arc<OpenSegment>>>,
    segment_ids: Mutex<HashMap<String, u32>>,
    control: tokio::sync::Mutex<()>,
    next_region: AtomicU64,
    runtime: tokio::runtime::Handle,
    timer: PhaseTimer,
    phase_stats: Option<Arc<PhaseStats>>,
    metrics: Metrics,
    closed: AtomicBool,
    _env: Arc<dyn Env>,
}

/// The transfer engine. Cheap to clone; all clones share one engine.
///
/// ```no_run
/// # async fn demo() -> te_base::Result<()> {
/// use te_core::{TransferEngine, TransferRequest, HostBufferOptions};
/// let engine = TransferEngine::builder().segment_name("a").build().await?;
/// let src = engine.allocate(1 << 20, HostBufferOptions::default()).await?;
/// let dst = engine.allocate(1 << 20, HostBufferOptions::default()).await?;
/// let me = engine.open_segment("a").await?;
/// engine.transfer(&[TransferRequest::write(src.addr(), me.id(), dst.addr(), 4096)]).await
///     .map_err(|e| te_base::Error::transport("demo", e.to_string()))?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct TransferEngine {
    pub(crate) inner: Arc<EngineInner>,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("name", &self.inner.name)
            .field("transports", &self.inner.statuses)
            .finish()
    }
}

impl TransferEngine {
    /// Starts configuring an engine.
    pub fn builder() -> TransferEngineBuilder {
        TransferEngineBuilder::new()
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn assemble(
        name: String,
        metadata: Arc<dyn MetadataStore>,
        env: Arc<dyn Env>,
        transports: Vec<Arc<dyn Transport>>,
        statuses: Vec<TransportStatus>,
        plugins: Vec<PluginAvailability>,
        phase_timing: bool,
    ) -> Result<Self> {
        let phase_stats = phase_timing.then(|| Arc::new(PhaseStats::default()));
        let timer = phase_stats.clone().map(PhaseTimer::on).unwrap_or_default();
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| Error::not_available("engine", "must be built inside a tokio runtime"))?;
        let inner = Arc::new(EngineInner {
            name,
            instance: te_base::token::random_token(),
            metadata,
            transports,
            statuses,
            plugins,
            registry: Registry::default(),
            segments: RwLock::new(Vec::new()),
            segment_ids: Mutex::new(HashMap::new()),
            control: tokio::sync::Mutex::new(()),
            next_region: AtomicU64::new(1),
            runtime,
            timer,
            phase_stats,
            metrics: Metrics::default(),
            closed: AtomicBool::new(false),
            _env: env,
        });
        inner.publish().await?;
        Ok(TransferEngine { inner })
    }

    /// The engine's segment name.
    pub fn segment_name(&self) -> &str {
        &self.inner.name
    }

    /// Random per engine start; changes when a peer restarts.
    pub fn instance(&self) -> u64 {
        self.inner.instance
    }

    /// Every transport compiled in, in order of preference, and whether it runs here.
    pub fn transports(&self) -> &[TransportStatus] {
        &self.inner.statuses
    }

    /// This engine's current segment descriptor.
    pub fn descriptor(&self) -> SegmentDescriptor {
        self.inner.descriptor()
    }

    /// Counters since start.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.inner.metrics.snapshot()
    }

    /// Phase timings since start (`None` unless built with phase timing / `TE_PHASE_TIMING=1`).
    pub fn phase_report(&self) -> Option<PhaseReport> {
        self.inner.phase_stats.as_ref().map(|s| s.report())
    }

    /// Clears phase timings.
    pub fn reset_phase_report(&self) {
        if let Some(s) = &self.inner.phase_stats {
            s.reset();
        }
    }

    /// Allocates page-aligned host memory and registers it (exported).
    pub async fn allocate(&self, len: usize, opts: HostBufferOptions) -> Result<Registration> {
        self.allocate_with(len, opts, RegisterOptions::default()).await
    }

    /// Allocates and registers host memory with explicit registration options.
    pub async fn allocate_with(
        &self,
        len: usize,
        opts: HostBufferOptions,
        reg: RegisterOptions,
    ) -> Result<Registration> {
        let buf = HostBuffer::allocate(len, opts)?;
        let mut v = self.register_host_buffers(vec![buf], reg).await?;
        Ok(v.remove(0))
    }

    /// Registers engine-allocated host buffers as one batch.
    pub async fn register_host_buffers(
        &self,
        bufs: Vec<HostBuffer>,
        reg: RegisterOptions,
    ) -> Result<Vec<Registration>> {
        let items = bufs
            .into_iter()
            .map(|b| {
                let loc = MemoryLocation::Host { numa: b.numa_node() };
                (b.addr(), b.len() as u64, loc, Some(b))
            })
            .collect();
        self.inner.register(items, reg, &self.inner).await
    }

    /// Registers memory the engine does not own (framework tensors, foreign allocations).
    ///
    /// # Safety
    /// `[addr, addr + len)` must be memory of `location` that stays valid (mapped, not freed) until
    /// the returned registration is deregistered or dropped and every transfer on it completed;
    /// transfers will read and write it concurrently with the caller.
    pub async unsafe fn register_raw(
        &self,
        addr: u64,
        len: u64,
        location: MemoryLocation,
        reg: RegisterOptions,
    ) -> Result<Registration> {
        // SAFETY: forwarded contract: the caller guarantees the memory outlives the registration.
        let mut v = unsafe { self.register_raw_batch(&[RawRegion { addr, len, location }], reg) }.await?;
        Ok(v.remove(0))
    }

    /// Registers several foreign regions as one batch (one descriptor update).
    ///
    /// # Safety
    /// Every region must satisfy the contract of [`TransferEngine::register_raw`].
    pub async unsafe fn register_raw_batch(
        &self,
        items: &[RawRegion],
        reg: RegisterOptions,
    ) -> Result<Vec<Registration>> {
        let items = items.iter().map(|r| (r.addr, r.len, r.location, None)).collect();
        self.inner.register(items, reg, &self.inner).await
    }

    /// Opens (or refreshes) the segment called `name`: fetches its descriptor from the metadata
    /// store and connects the best transport that can reach it. Opening the same name again
    /// returns the same id, reconnecting if the peer restarted or its connection failed.
    pub async fn open_segment(&self, name: &str) -> Result<SegmentHandle> {
        self.inner.open_segment(name).await
    }

    /// Submits a batch. Every request is validated and resolved first: if any is malformed
    /// (zero length, unregistered or partly registered local memory, a remote range outside the
    /// segment's exported buffers, unknown segment, no transport for the memory kinds) nothing
    /// starts and the error names it. Otherwise the returned [`Batch`] reports each request.
    pub fn submit(&self, requests: &[TransferRequest]) -> Result<Batch> {
        self.inner.submit(requests, &SubmitOptions::default())
    }

    /// Like [`TransferEngine::submit`], for work nobody waits on: the local copy stays inline
    /// instead of borrowing helper threads.
    pub fn submit_background(&self, requests: &[TransferRequest]) -> Result<Batch> {
        self.inner.submit(
            requests,
            &SubmitOptions {
                background: true,
                timer: None,
            },
        )
    }

    /// Like [`TransferEngine::submit`], with per-call options: a caller's own phase timer (so a
    /// consumer such as a store can attribute the engine's resolve/plan/submit to its own call),
    /// and the background flag.
    pub fn submit_with(&self, requests: &[TransferRequest], opts: &SubmitOptions) -> Result<Batch> {
        self.inner.submit(requests, opts)
    }

    /// Submits and waits.
    pub async fn transfer(&self, requests: &[TransferRequest]) -> std::result::Result<BatchReport, TransferError> {
        let batch = self.submit(requests)?;
        let t0 = self.inner.timer.start();
        let out = batch.wait().await;
        self.inner.timer.lap(Phase::Wait, t0);
        Ok(out?)
    }

    /// Withdraws the descriptor and stops the transports.
    pub async fn shutdown(&self) -> Result<()> {
        self.inner.closed.store(true, Ordering::Release);
        self.inner.metadata.remove(&self.inner.name).await?;
        for t in &self.inner.transports {
            t.shutdown().await;
        }
        Ok(())
    }
}

/// Why [`TransferEngine::transfer`] failed: the batch was refused, or some requests failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// The batch was malformed; nothing started.
    #[error(transparent)]
    Refused(#[from] Error),
    /// Some requests failed; the others completed.
    #[error(transparent)]
    Failed(#[from] te_base::BatchError),
}

impl EngineInner {
    fn descriptor(&self) -> SegmentDescriptor {
        let mut d = SegmentDescriptor::new(self.name.clone(), self.instance);
        d.transports = self
            .transports
            .iter()
            .map(|t| TransportEndpoint {
                transport: t.name().to_string(),
                info: t.endpoint(),
            })
            .collect();
        d.buffers = self
            .registry
            .snapshot()
            .iter()
            .filter(|r| r.info.exported && !r.dying.load(Ordering::Acquire))
            .map(|r| ExportedBuffer {
                base: r.info.base,
                len: r.info.len,
                location: r.info.location,
                keys: r
                    .keys
                    .iter()
                    .filter(|(_, v)| !v.is_null())
                    .map(|(n, v)| (n.to_string(), v.clone()))
                    .collect(),
            })
            .collect();
        d
    }

    async fn publish(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Ok(());
        }
        let desc = self.descriptor();
        self.metadata.publish(&desc).await?;
        self.refresh_own_segment(desc).await
    }

    /// If this engine opened its own segment, keep that open segment current: reconnect its
    /// routes with the new descriptor, so memory registered after the open is reachable without
    /// reopening (a store that registers as it grows relies on this).
    async fn refresh_own_segment(&self, desc: SegmentDescriptor) -> Result<()> {
        let Some(id) = self.segment_ids.lock().get(&self.name).copied() else {
            return Ok(());
        };
        let current = self.segments.read()[id as usize].clone();
        let desc = Arc::new(desc);
        let mut routes = Vec::with_capacity(current.routes.len());
        for r in &current.routes {
            let peer = self.transports[r.transport].connect(&desc).await?;
            routes.push(Route {
                transport: r.transport,
                caps: r.caps,
                peer,
            });
        }
        self.segments.write()[id as usize] = Arc::new(OpenSegment {
            descriptor: desc,
            routes,
        });
        Ok(())
    }

    async fn register(
        &self,
        items: Vec<(u64, u64, MemoryLocation, Option<HostBuffer>)>,
        reg: RegisterOptions,
        me: &Arc<EngineInner>,
    ) -> Result<Vec<Registration>> {
        let _control = self.control.lock().await;
        // Validate everything first: nothing is registered if any item is malformed.
        let mut order: Vec<usize> = (0..items.len()).collect();
        order.sort_by_key(|&i| items[i].0);
        for (i, (addr, len, _, _)) in items.iter().enumerate() {
            if *len == 0 {
                return Err(Error::ZeroLength { index: i });
            }
            if *addr == 0 {
                return Err(Error::NullAddress);
            }
            if addr.checked_add(*len).is_none() || usize::try_from(*addr + *len).is_err() {
                return Err(Error::LengthOverflow { addr: *addr, len: *len });
            }
            if !items[i].2.is_host() {
                self.check_device_memory(*addr, *len, items[i].2)?;
            }
            if let Some(r) = self.registry.overlap(*addr, *len) {
                return Err(Error::AlreadyRegistered {
                    addr: *addr,
                    len: *len,
                    region_base: r.base,
                    region_len: r.len,
                });
            }
        }
        for w in order.windows(2) {
            let (a, b) = (&items[w[0]], &items[w[1]]);
            if a.0 + a.1 > b.0 {
                return Err(Error::AlreadyRegistered {
                    addr: b.0,
                    len: b.1,
                    region_base: a.0,
                    region_len: a.1,
                });
            }
        }
        let infos: Vec<RegionInfo> = items
            .iter()
            .map(|(addr, len, location, _)| RegionInfo {
                id: RegionId(self.next_region.fetch_add(1, Ordering::Relaxed)),
                base: *addr,
                len: *len,
                location: *location,
                exported: reg.export,
            })
            .collect();

        // Register on every transport that can serve each memory kind.
        let mut keys: Vec<Vec<(&'static str, serde_json::Value)>> = vec![Vec::new(); infos.len()];
        let mut done: Vec<(usize, Vec<RegionInfo>)> = Vec::new();
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
            match t.register(&subset).await {
                Ok(k) => {
                    for (i, v) in idx.into_iter().zip(k) {
                        keys[i].push((t.name(), v));
                    }
                    done.push((ti, subset));
                }
                Err(e) => {
                    for (tj, regions) in done {
                        if let Err(e2) = self.transports[tj].deregister(&regions).await {
                            tracing::warn!(
                                "rollback of registration on {} failed: {e2}",
                                self.transports[tj].name()
                            );
                        }
                    }
                    return Err(e);
                }
            }
        }
        for (i, r) in infos.iter().enumerate() {
            if keys[i].is_empty() {
                for (tj, regions) in done {
                    let _ = self.transports[tj].deregister(&regions).await;
                }
                return Err(Error::NoTransport {
                    segment: self.name.clone(),
                    reason: format!("no installed transport serves {} memory (item {i})", r.location),
                });
            }
        }
        let regions: Vec<Arc<Region>> = infos
            .into_iter()
            .zip(keys)
            .zip(items)
            .map(|((info, keys), (_, _, _, owned))| {
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
        let weak = Arc::downgrade(me);
        Ok(regions
            .into_iter()
            .map(|region| Registration {
                region,
                engine: weak.clone(),
                released: AtomicBool::new(false),
            })
            .collect())
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

    async fn open_segment(&self, name: &str) -> Result<SegmentHandle> {
        let desc = Arc::new(self.metadata.fetch(name).await?);
        desc.validate()?;
        let existing = self.segment_ids.lock().get(name).copied();
        if let Some(id) = existing {
            let current = self.segments.read()[id as usize].clone();
            if *current.descriptor == *desc && current.routes.iter().all(|r| r.peer.is_healthy()) {
                return Ok(SegmentHandle {
                    id: SegmentId(id),
                    descriptor: current.descriptor.clone(),
                });
            }
        }
        let mut routes: Vec<Route> = Vec::new();
        let mut failures: Vec<String> = Vec::new();
        for (ti, t) in self.transports.iter().enumerate() {
            if !t.can_reach(&desc) {
                continue;
            }
            let caps = t.capabilities();
            let covered = routes.iter().any(|r| r.caps == caps);
            if covered {
                continue;
            }
            match t.connect(&desc).await {
                Ok(peer) => routes.push(Route {
                    transport: ti,
                    caps,
                    peer,
                }),
                Err(e) => failures.push(format!("{}: {e}", t.name())),
            }
        }
        if routes.is_empty() {
            let offered: Vec<&str> = desc.transports.iter().map(|t| t.transport.as_str()).collect();
            let installed: Vec<&str> = self.transports.iter().map(|t| t.name()).collect();
            let mut reason = format!("segment offers {offered:?}, this engine has {installed:?}");
            if !failures.is_empty() {
                reason.push_str(&format!("; connect failed: {}", failures.join("; ")));
            }
            return Err(Error::NoTransport {
                segment: name.to_string(),
                reason,
            });
        }
        let seg = Arc::new(OpenSegment {
            descriptor: desc.clone(),
            routes,
        });
        let mut ids = self.segment_ids.lock();
        let mut segs = self.segments.write();
        let id = match ids.get(name) {
            Some(&id) => {
                segs[id as usize] = seg;
                id
            }
            None => {
                let id = segs.len() as u32;
                segs.push(seg);
                ids.insert(name.to_string(), id);
                id
            }
        };
        Ok(SegmentHandle {
            id: SegmentId(id),
            descriptor: desc,
        })
    }

    fn submit(self: &Arc<Self>, requests: &[TransferRequest], opts: &SubmitOptions) -> Result<Batch> {
        let timer = opts.timer.as_ref().unwrap_or(&self.timer);
        let background = opts.background;
        let t0 = timer.start();
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed(format!("engine '{}'", self.name)));
        }
        let segs = self.segments.read();
        let Grouped { groups, pins, bytes } = group_requests(requests, &segs, self.registry.local_resolver())?;
        let t1 = timer.lap(Phase::Resolve, t0);
        let lens: Box<[u64]> = requests.iter().map(|r| r.len).collect();
        let state = BatchState::new(lens);
        state.keep_alive(Box::new(PinsReaper {
            pins: Some(pins),
            engine: Arc::downgrade(self),
        }));
        let ctx = SubmitContext {
            timer: timer.clone(),
            background,
        };
        let routes: Vec<Arc<OpenSegment>> = groups.iter().map(|g| segs[g.segment as usize].clone()).collect();
        drop(segs);
        timer.lap(Phase::Build, t1);
        let single_group = groups.len() == 1;
        let mut failed = 0u64;
        for (g, seg) in groups.into_iter().zip(routes) {
            let peer = &seg.routes[g.route as usize].peer;
            if !peer.is_healthy() {
                let err = Error::PeerGone {
                    peer: seg.descriptor.name.clone(),
                    reason: "connection lost; reopen the segment".into(),
                };
                failed += g.requests.len() as u64;
                state.fail_many(g.requests.iter().map(|r| r.index as usize), &err);
                continue;
            }
            let n = g.requests.len();
            // A transport that returns Err started nothing. With one group that is the whole
            // batch; otherwise keep this group's indices to fail them.
            let indices: Vec<u32> = if single_group {
                Vec::new()
            } else {
                g.requests.iter().map(|r| r.index).collect()
            };
            if let Err(e) = peer.submit(g.requests, &state, &ctx) {
                failed += n as u64;
                if single_group {
                    state.fail_many(0..requests.len(), &e);
                } else {
                    state.fail_many(indices.into_iter().map(|i| i as usize), &e);
                }
            }
        }
        // The transports recorded their own plan and submit inside the loop above; the engine's
        // part after it is the counter update.
        let t3 = timer.start();
        self.metrics.record_call(requests.len() as u64, bytes, failed);
        timer.lap(Phase::Other, t3);
        // A caller's own timer counts its own calls; the engine counts only into its own.
        if opts.timer.is_none() {
            timer.count_call(requests.len());
        }
        Ok(Batch::new(state))
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

/// Keeps a batch's regions pinned; on release, reaps regions whose owners dropped them meanwhile.
struct PinsReaper {
    pins: Option<Pins>,
    engine: Weak<EngineInner>,
}

impl Drop for PinsReaper {
    fn drop(&mut self) {
        let any_dying = self.pins.as_ref().is_some_and(|p| p.any_dying());
        drop(self.pins.take());
        if any_dying {
            if let Some(e) = self.engine.upgrade() {
                e.reap_dying();
            }
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
