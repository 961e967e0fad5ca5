//! [`LocalTransport`]: the control plane of the local copy (register, connect, shut down).

use std::sync::Arc;

use async_trait::async_trait;
use te_base::device::DevicePlugin;
use te_base::{
    Capabilities, Error, MemoryKinds, NotifyInbox, NotifyLimits, Peer, RegionInfo, Result, SegmentDescriptor, Transport,
};

use crate::config::LocalConfig;
use crate::copy::NtKernel;
use crate::device::DeviceRoutes;
use crate::domain::{Domain, LocalEndpoint};
use crate::peer::LocalPeer;
use crate::pool::CopyPool;
use crate::shared::Shared;
use crate::NAME;

/// Moves bytes between memory of segments in this process by copying.
///
/// Each instance (one per engine) is a *domain*: it keeps its own table of registered regions and
/// publishes a process token and domain id as its endpoint, so it reaches exactly the segments of
/// this process. Host memory is copied by the CPU; requests with a device side go through the
/// device plugin of that memory kind given at construction (one batched copy per direction and
/// device per batch). Without a plugin for a kind, requests touching it fail with
/// [`Error::WrongMemoryKind`] naming the missing plugin.
///
/// ```
/// # tokio_test_block_on(async {
/// use std::sync::Arc;
/// use te_base::config::MapEnv;
/// use te_base::{InstallContext, Transport};
///
/// let ctx = InstallContext {
///     auth: None,
///     env: Arc::new(MapEnv::new([("TE_COPY_THREADS", "1")])),
///     segment_name: "a".into(),
///     devices: Vec::new(),
///     notifications: te_base::NotifyInbox::new(Default::default()),
/// };
/// let transport = te_transport_local::install(&ctx).await.unwrap();
/// assert_eq!(transport.name(), "local");
/// # });
/// # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
/// # }
/// ```
#[derive(Debug)]
pub struct LocalTransport {
    shared: Arc<Shared>,
}

impl LocalTransport {
    /// A transport with `config`, using the widest streaming kernel this CPU supports. Starts
    /// `config.copy_threads - 1` helper threads.
    pub fn new(config: LocalConfig) -> Result<Self> {
        Self::with_kernel(config, NtKernel::detect())
    }

    /// A transport that copies with `kernel` (for tests and benchmarks comparing kernels).
    pub fn with_kernel(config: LocalConfig, kernel: NtKernel) -> Result<Self> {
        Self::with_devices(config, kernel, &[])
    }

    /// A transport that also serves the device memory of `devices` (the first plugin of each
    /// memory kind), as [`install`](crate::install) builds it from the engine's loaded plugins.
    pub fn with_devices(config: LocalConfig, kernel: NtKernel, devices: &[Arc<dyn DevicePlugin>]) -> Result<Self> {
        Self::with_inbox(config, kernel, devices, NotifyInbox::new(NotifyLimits::default()))
    }

    /// Like [`LocalTransport::with_devices`], delivering notifications sent to this segment into
    /// `inbox`.
    pub fn with_inbox(
        config: LocalConfig,
        kernel: NtKernel,
        devices: &[Arc<dyn DevicePlugin>],
        inbox: Arc<NotifyInbox>,
    ) -> Result<Self> {
        config.validate()?;
        let pool = CopyPool::new(config.copy_threads - 1)?;
        Ok(LocalTransport {
            shared: Arc::new(Shared {
                domain: Domain::create(inbox),
                pool,
                config,
                kernel,
                devices: DeviceRoutes::new(devices),
            }),
        })
    }

    /// Where notifications sent to this transport's segment are delivered.
    pub fn notifications(&self) -> &Arc<NotifyInbox> {
        &self.shared.domain.inbox
    }

    /// The configuration in use.
    pub fn config(&self) -> &LocalConfig {
        &self.shared.config
    }

    /// Helper threads started for the copies (`copy_threads - 1`).
    pub fn helper_threads(&self) -> usize {
        self.shared.pool.helpers()
    }

    /// The streaming-store kernel in use.
    pub fn kernel(&self) -> NtKernel {
        self.shared.kernel
    }

    /// This instance's endpoint (process token and domain id).
    pub fn local_endpoint(&self) -> LocalEndpoint {
        LocalEndpoint::here(self.shared.domain.id())
    }

    fn check_open(&self) -> Result<()> {
        if self.shared.domain.is_open() {
            Ok(())
        } else {
            Err(Error::Closed(format!("{NAME} transport")))
        }
    }

    /// The live domain `peer` names, or why it cannot be reached.
    fn target_of(&self, peer: &SegmentDescriptor) -> Result<Arc<Domain>> {
        let segment = &peer.name;
        let info = peer.endpoint(NAME).ok_or_else(|| Error::NoTransport {
            segment: segment.clone(),
            reason: format!("it does not advertise the {NAME} transport"),
        })?;
        let endpoint = LocalEndpoint::parse(segment, info)?;
        if !endpoint.is_this_process() {
            return Err(Error::NoTransport {
                segment: segment.clone(),
                reason: format!(
                    "the {NAME} transport reaches segments of this process only; it lives in process {}",
                    endpoint.process
                ),
            });
        }
        Domain::lookup(endpoint.domain).ok_or_else(|| Error::PeerGone {
            peer: segment.clone(),
            reason: format!(
                "its {NAME} transport (domain {}) was shut down or dropped",
                endpoint.domain
            ),
        })
    }
}

#[async_trait]
impl Transport for LocalTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    /// Host memory, plus each device kind a plugin was given for.
    fn capabilities(&self) -> Capabilities {
        let kinds: MemoryKinds = self.shared.devices.kinds();
        Capabilities {
            local: kinds,
            remote: kinds,
        }
    }

    fn endpoint(&self) -> serde_json::Value {
        self.local_endpoint().to_json()
    }

    fn can_reach(&self, peer: &SegmentDescriptor) -> bool {
        self.shared.domain.is_open() && self.target_of(peer).is_ok()
    }

    /// Adds the regions to this domain's table (all or none), with the location the engine
    /// classified. Device memory is recorded even without its plugin, so a request touching it
    /// fails with a clear [`Error::WrongMemoryKind`] rather than looking unregistered. The local
    /// copy needs no keys: every key is `null`.
    async fn register(&self, regions: &[RegionInfo]) -> Result<Vec<serde_json::Value>> {
        self.check_open()?;
        self.shared.domain.table.write().insert_batch(regions)?;
        Ok(vec![serde_json::Value::Null; regions.len()])
    }

    /// Removes the regions (all or none). Waits for batches copying from or into this domain.
    async fn deregister(&self, regions: &[RegionInfo]) -> Result<()> {
        self.shared.domain.table.write().remove_batch(regions)
    }

    async fn connect(&self, peer: &SegmentDescriptor) -> Result<Arc<dyn Peer>> {
        self.check_open()?;
        let target = self.target_of(peer)?;
        Ok(Arc::new(LocalPeer {
            descriptor: peer.clone(),
            shared: self.shared.clone(),
            target: Arc::downgrade(&target),
        }))
    }

    async fn shutdown(&self) {
        self.shared.domain.close();
    }
}

impl Drop for LocalTransport {
    fn drop(&mut self) {
        // The transport owns its domain: peers elsewhere must stop reaching it.
        self.shared.domain.close();
    }
}
