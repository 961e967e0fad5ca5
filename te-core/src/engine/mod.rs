//! The transfer engine: registers memory, publishes and opens segments, and routes batches of
//! reads and writes to the transport that can serve them.

mod deadline;
mod failover;
mod handle;
mod notify;
mod registration;
mod segments;
mod submit;
mod warm_up;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use te_base::config::Env;
use te_base::device::PluginAvailability;
use te_base::{
    Batch, BatchReport, Error, HostBuffer, HostBufferOptions, MemoryLocation, MetadataStore, Phase, PhaseReport,
    PhaseStats, PhaseTimer, Result, SegmentDescriptor, TransferRequest, Transport,
};

use crate::builder::TransferEngineBuilder;
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::registry::Registry;
use crate::segment::{OpenSegment, SegmentHandle};
pub(crate) use deadline::default_deadline as check_transfer_timeout;
pub use deadline::TRANSFER_TIMEOUT_VAR;
pub use failover::{FAILOVER_VAR, ROUTE_PAUSE_VAR};
pub use handle::{RegisterOptions, Registration};
pub use notify::{Notifications, NotifiedBatch};
pub(crate) use registration::registration_cache;
use registration::PendingRegion;
mod live_names;
pub use registration::RawRegion;
pub use registration::REGISTRATION_CACHE_VAR;
pub use submit::SubmitOptions;
pub use warm_up::{RouteWarmUp, WarmUpReport, WARM_UP_VAR};

/// A transport compiled into this build and whether it runs here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransportStatus {
    /// Transport name.
    pub name: String,
    /// `None` when installed and usable; otherwise why not.
    pub unavailable: Option<String>,
    /// Devices (NICs, provider domains) the installed transport did not open, each with why; it
    /// serves on the rest ([`te_base::Transport::skipped_devices`]).
    pub skipped: Vec<te_base::SkippedDevice>,
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
    /// Exported metrics (`None`: off, one check per batch) and the engine's own endpoint.
    pub(crate) export: Option<Arc<crate::metrics::Export>>,
    pub(crate) metrics_endpoint: std::sync::OnceLock<crate::metrics::Endpoint>,
    closed: AtomicBool,
    /// `TE_TRANSFER_TIMEOUT_MS`: the deadline of batches submitted without one.
    default_deadline: Option<std::time::Duration>,
    /// `TE_REGISTRATION_CACHE`: whether ranges inside a registered region may share it.
    registration_cache: bool,
    /// `TE_FAILOVER`, `TE_ROUTE_PAUSE_MS`: resubmission on other routes, pauses of failing ones.
    failover: failover::FailoverPolicy,
    /// Warm every segment up as it is opened (`TE_WARM_UP`, the builder's `warm_up_segments`).
    warm_on_open: bool,
    /// The landing zone of warm-up and probe reads (registered, local only), made on first use.
    scratch: tokio::sync::OnceCell<Registration>,
    /// Watchers and event channels of the open segments.
    live: segments::LiveSegments,
    _env: Arc<dyn Env>,
    /// Notifications peers sent to this segment (the transports deliver into it).
    inbox: Arc<te_base::NotifyInbox>,
}

/// The transfer engine. Cheap to clone; all clones share one engine.
///
/// ```
/// # #[tokio::main] async fn main() -> te_core::Result<()> {
/// use te_core::{HostBufferOptions, TransferEngine, TransferRequest};
/// let engine = TransferEngine::builder().segment_name("doc-engine").build().await?;
/// let src = engine.allocate(1 << 20, HostBufferOptions::default()).await?;
/// let dst = engine.allocate(1 << 20, HostBufferOptions::default()).await?;
/// src.write_at(0, &[7u8; 4096])?;
/// let me = engine.open_segment("doc-engine").await?;
/// // One `?` covers a refused submission and a failed transfer alike.
/// let report = engine.transfer(&[TransferRequest::write(src.addr(), me.id(), dst.addr(), 4096)]).await?;
/// assert_eq!(report.bytes, 4096);
/// let mut back = [0u8; 4096];
/// dst.read_at(0, &mut back)?;
/// assert_eq!(back, [7u8; 4096]);
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

impl EngineInner {
    /// The open segment `id`: [`Error::UnknownSegment`] if no such id was opened,
    /// [`Error::SegmentClosed`] once it was closed.
    pub(crate) fn open_segment_by_id(&self, id: te_base::SegmentId) -> Result<Arc<crate::segment::OpenSegment>> {
        let segs = self.segments.read();
        let seg = segs
            .get(id.0 as usize)
            .ok_or_else(|| Error::UnknownSegment(format!("#{}", id.0)))?;
        if seg.closed {
            return Err(Error::SegmentClosed(seg.descriptor.name.clone()));
        }
        Ok(seg.clone())
    }

    /// True once the engine shuts down.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// [`Error::Closed`] once the engine shut down: every call after `shutdown` says so.
    pub(crate) fn check_open(&self) -> Result<()> {
        if self.is_closed() {
            return Err(Error::Closed(format!("engine '{}'", self.name)));
        }
        Ok(())
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
        inbox: Arc<te_base::NotifyInbox>,
        export: Option<Arc<crate::metrics::Export>>,
        warm_on_open: Option<bool>,
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
            export,
            metrics_endpoint: std::sync::OnceLock::new(),
            closed: AtomicBool::new(false),
            default_deadline: deadline::default_deadline(env.as_ref())?,
            registration_cache: registration_cache(env.as_ref())?,
            failover: failover::FailoverPolicy::from_env(env.as_ref())?,
            warm_on_open: match warm_on_open {
                Some(w) => w,
                None => warm_up::from_env(env.as_ref())?,
            },
            scratch: tokio::sync::OnceCell::new(),
            live: segments::LiveSegments::default(),
            _env: env,
            inbox,
        });
        live_names::claim(&inner)?;
        inner.publish().await?;
        Ok(TransferEngine { inner })
    }

    pub(crate) fn inbox(&self) -> &Arc<te_base::NotifyInbox> {
        &self.inner.inbox
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
        let buf = HostBuffer::allocate(len, self.host_backing(opts)?)?;
        let mut v = self.register_host_buffers(vec![buf], reg).await?;
        Ok(v.remove(0))
    }

    /// Resolves [`te_base::HostBacking::Auto`]: a sealed memfd, which a peer on this host maps
    /// once and copies into directly, when the shm transport runs here and `TE_SHM_MEMFD` is not
    /// off; anonymous memory otherwise, and where a memfd cannot have the huge pages asked for
    /// (explicit ones; transparent ones where the kernel gives shared memory none: a DRAM arena's
    /// first writes were 6-9x slower in 4 KiB shared pages).
    fn host_backing(&self, mut opts: HostBufferOptions) -> Result<HostBufferOptions> {
        if opts.backing == te_base::HostBacking::Auto {
            #[cfg(feature = "shm")]
            let memfd =
                te_base::host_buffer::memfd_gives(opts.huge_pages, te_base::host_buffer::shmem_takes_huge_pages)
                    && self.inner.transports.iter().any(|t| t.name() == "shm")
                    && te_transport_shm::memfd_allocation(&*self.inner._env)?;
            #[cfg(not(feature = "shm"))]
            let memfd = false;
            opts.backing = if memfd {
                te_base::HostBacking::Memfd
            } else {
                te_base::HostBacking::Anonymous
            };
        }
        Ok(opts)
    }

    /// Registers engine-allocated host buffers as one batch.
    pub async fn register_host_buffers(
        &self,
        bufs: Vec<HostBuffer>,
        reg: RegisterOptions,
    ) -> Result<Vec<Registration>> {
        let items = bufs
            .into_iter()
            .map(|b| PendingRegion {
                region: RawRegion {
                    addr: b.addr(),
                    len: b.len() as u64,
                    location: MemoryLocation::Host { numa: b.numa_node() },
                },
                owned: Some(crate::registry::Owner::Host(b)),
            })
            .collect();
        self.inner.register(items, reg).await
    }

    /// Registers memory the engine does not own (framework tensors, foreign allocations).
    ///
    /// A range inside a region already registered with this engine (a tensor that is a view of
    /// a registered pool) is served by the registration cache: the handle shares the covering
    /// registration, costs no transport registration and no descriptor update, and keeps the
    /// covering registration alive until it goes ([`Registration`], [`RegisterOptions::reuse_covering`]).
    /// Its options must match the covering region's ([`Error::RegistrationMismatch`]); a range
    /// that overlaps a registered region without lying inside it is [`Error::AlreadyRegistered`].
    ///
    /// # Safety
    /// `[addr, addr + len)` must be memory of `location` that stays valid (mapped, not freed) until
    /// the returned registration is deregistered or dropped and every transfer on it completed;
    /// transfers will read and write it concurrently with the caller. If ranges inside it are
    /// registered while it lives, they share this registration, which stays (and the whole range
    /// stays reachable, by peers too if exported) until the last of those handles is released as
    /// well: the memory must stay valid until then.
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

    /// Like [`TransferEngine::register_raw`], handing the engine `owner`, whatever keeps the
    /// memory alive (a language runtime's buffer export, a mapping). The engine drops `owner`
    /// only after the region is released: the handle dropped or deregistered, every batch on it
    /// completed and every transport let go of it (so a peer can no longer reach the memory). If
    /// the engine's runtime shuts down during the release, `owner` is leaked rather than dropped
    /// while a transport might still touch the memory. A refused registration drops it at once.
    ///
    /// # Safety
    /// `[addr, addr + len)` must be memory of `location` that stays valid for as long as `owner`
    /// is alive; transfers will read and write it concurrently with the caller.
    pub async unsafe fn register_raw_owned(
        &self,
        addr: u64,
        len: u64,
        location: MemoryLocation,
        reg: RegisterOptions,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<Registration> {
        let item = PendingRegion {
            region: RawRegion { addr, len, location },
            owned: Some(crate::registry::Owner::Foreign(owner)),
        };
        let mut v = self.inner.register(vec![item], reg).await?;
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
        let items = items
            .iter()
            .map(|&region| PendingRegion { region, owned: None })
            .collect();
        self.inner.register(items, reg).await
    }

    /// Opens (or refreshes) the segment called `name`: fetches its descriptor from the metadata
    /// store and connects the best transport that can reach it. Opening the same name again
    /// returns the same id, reconnecting if the peer restarted or its connection failed.
    pub async fn open_segment(&self, name: &str) -> Result<SegmentHandle> {
        self.inner.check_open()?;
        self.inner.open_segment(name).await
    }

    /// Fetches the descriptor of open segment `segment` from the metadata store again and applies
    /// it, as opening it by name again does: memory its peer registered since the open is
    /// reachable afterwards. A submit refused with [`Error::OutOfBounds`] for a range the peer
    /// may have registered since calls this and submits again (the Python binding does so once
    /// per call). Metadata stores that watch (in-process, etcd) apply changes by themselves too,
    /// within their notification delay; peer-to-peer metadata learns of them only this way.
    /// [`Error::UnknownSegment`] if it is not open, [`Error::SegmentClosed`] if it was closed.
    pub async fn refresh_segment(&self, segment: te_base::SegmentId) -> Result<SegmentHandle> {
        self.inner.check_open()?;
        self.inner.open_segment_by_id(segment)?;
        // By the name it was opened by (a p2p address carries where to ask).
        let name = self
            .inner
            .live
            .opened_as(segment.0)
            .ok_or_else(|| Error::UnknownSegment(format!("#{}", segment.0)))?;
        self.inner.open_segment(&name).await
    }

    /// Closes a segment opened by [`TransferEngine::open_segment`]: drops its connections
    /// (requests already in flight on them finish), forgets its descriptor and stops following
    /// it. Later submits to its id fail with [`Error::SegmentClosed`]; opening the name again
    /// gives a new id. [`Error::UnknownSegment`] if `segment` is not open.
    pub async fn close_segment(&self, segment: te_base::SegmentId) -> Result<()> {
        self.inner.close_segment(segment).await
    }

    /// The routes to `segment` (one per transport that reaches it, in order of preference) and
    /// what each is doing: active, paused after repeated errors, or probing to come back
    /// (failover, `docs/failover.md`). [`Error::UnknownSegment`] if it is not open,
    /// [`Error::SegmentClosed`] once closed.
    pub fn routes(&self, segment: &SegmentHandle) -> Result<Vec<crate::RouteReport>> {
        let seg = self.inner.open_segment_by_id(segment.id())?;
        Ok(seg
            .routes
            .iter()
            .map(|r| crate::RouteReport {
                transport: r.transport_name,
                state: r.health.state(),
                connected: r.peer.is_healthy(),
                pauses: r.health.pauses(),
            })
            .collect())
    }

    /// The transports that reach `segment` by its descriptor but refused to connect when it was
    /// (re)connected, each with its error (e.g. shm without ptrace permission, so tcp carries
    /// the traffic). [`Error::UnknownSegment`] if it is not open, [`Error::SegmentClosed`] once
    /// closed.
    pub fn unreached_routes(&self, segment: &SegmentHandle) -> Result<Vec<crate::UnreachedRoute>> {
        Ok(self.inner.open_segment_by_id(segment.id())?.unreached.clone())
    }

    /// Submits a batch. Every request is validated and resolved first: if any is malformed
    /// (zero length, unregistered or partly registered local memory, a remote range outside the
    /// segment's exported buffers, unknown segment, no transport for the memory kinds) nothing
    /// starts and the error names it. Otherwise the returned [`Batch`] reports each request.
    pub fn submit(&self, requests: &[TransferRequest]) -> Result<Batch> {
        self.inner.submit(requests, &SubmitOptions::default())
    }

    /// Like [`TransferEngine::submit`], with per-call options: a caller's own phase timer (so a
    /// consumer such as a store can attribute the engine's resolve/plan/submit to its own call),
    /// and the background flag.
    pub fn submit_with(&self, requests: &[TransferRequest], opts: &SubmitOptions) -> Result<Batch> {
        self.inner.submit(requests, opts)
    }

    /// Submits and waits. A refused batch gives the refusal ([`Error::OutOfBounds`]...); a batch
    /// in which some requests failed gives [`Error::BatchFailed`] with each failure.
    pub async fn transfer(&self, requests: &[TransferRequest]) -> Result<BatchReport> {
        let batch = self.submit(requests)?;
        let t0 = self.inner.timer.start();
        let out = batch.wait().await;
        self.inner.timer.lap(Phase::Wait, t0);
        Ok(out?)
    }

    /// Withdraws the descriptor and stops the transports. Dropping the last clone of the engine
    /// does the same on the engine's runtime, so a forgotten call leaves no stale descriptor.
    pub async fn shutdown(&self) -> Result<()> {
        self.inner.closed.store(true, Ordering::Release);
        self.inner.live.stop_all();
        self.inner
            .metadata
            .withdraw(&self.inner.name, self.inner.instance)
            .await?;
        for t in &self.inner.transports {
            t.shutdown().await;
        }
        self.inner.inbox.close();
        if let Some(endpoint) = self.inner.metrics_endpoint.get() {
            endpoint.stop();
        }
        Ok(())
    }
}

impl EngineInner {
    /// The open segments now (for refreshing metrics gauges).
    pub(crate) fn open_segments(&self) -> Vec<Arc<OpenSegment>> {
        self.segments.read().clone()
    }
}

impl Drop for EngineInner {
    /// The last clone went away without [`TransferEngine::shutdown`]: withdraw the descriptor
    /// (only this instance's) and stop the transports on the runtime, never blocking the
    /// dropping thread. The regions' memory is freed only after the transports stopped (or, if
    /// the runtime is already gone, after they were dropped, as [`Teardown`] orders it).
    fn drop(&mut self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let metadata = self.metadata.clone();
        let name = std::mem::take(&mut self.name);
        let instance = self.instance;
        let teardown = Teardown {
            transports: std::mem::take(&mut self.transports),
            _regions: self.registry.snapshot(),
        };
        self.runtime.spawn(async move {
            if let Err(e) = metadata.withdraw(&name, instance).await {
                tracing::warn!("withdrawing the descriptor of dropped engine '{name}' failed: {e}");
            }
            for t in &teardown.transports {
                t.shutdown().await;
            }
            drop(teardown);
        });
    }
}

/// What a dropped engine releases, in order: fields drop in declaration order, so the
/// transports let go before the memory they were serving is freed.
struct Teardown {
    transports: Vec<Arc<dyn Transport>>,
    _regions: Vec<Arc<crate::registry::Region>>,
}
