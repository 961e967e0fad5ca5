//! How GPU memory is registered: through a dma-buf the device plugin exports
//! (`ibv_reg_dmabuf_mr`), else as a plain `ibv_reg_mr` of the device pointer when the kernel's
//! peer-memory module (`nvidia_peermem`) is loaded, else not at all.

use std::sync::Arc;

use te_base::device::{DevicePlugin, DmaBufExport};
use te_base::{Error, MemoryKind, MemoryKinds, MemoryLocation, RegionInfo, Result};

use crate::NAME;

/// The device plugins the engine loaded and what the host offers for GPU registration.
#[derive(Debug, Clone, Default)]
pub struct DeviceMemory {
    plugins: Vec<Arc<dyn DevicePlugin>>,
    /// `nvidia_peermem` is loaded: NICs can register CUDA pointers directly.
    peermem: bool,
    /// libibverbs has `ibv_reg_dmabuf_mr`.
    dmabuf_verb: bool,
}

impl DeviceMemory {
    /// GPU registration with `plugins`, the peer-memory module state and the verb's presence.
    pub fn new(plugins: Vec<Arc<dyn DevicePlugin>>, peermem: bool, dmabuf_verb: bool) -> Self {
        DeviceMemory {
            plugins,
            peermem,
            dmabuf_verb,
        }
    }

    fn plugin(&self, kind: MemoryKind) -> Option<&Arc<dyn DevicePlugin>> {
        self.plugins.iter().find(|p| p.memory_kind() == kind)
    }

    fn peer_memory(&self, kind: MemoryKind) -> bool {
        kind == MemoryKind::Cuda && self.peermem
    }

    /// The memory kinds this host can register: host always, a GPU kind when its plugin is
    /// loaded and the verb exists (dma-buf) or, for CUDA, when `nvidia_peermem` is loaded.
    pub fn kinds(&self) -> MemoryKinds {
        let mut kinds = MemoryKinds::HOST;
        for kind in [MemoryKind::Cuda, MemoryKind::Rocm] {
            if (self.dmabuf_verb && self.plugin(kind).is_some()) || self.peer_memory(kind) {
                kinds = kinds.with(kind);
            }
        }
        kinds
    }

    /// Decides how `region` is registered, once per region before it goes to the pool: `Some`
    /// dma-buf to register from, `None` for a plain `ibv_reg_mr` (host memory, or GPU memory
    /// through peer memory). [`Error::NotAvailable`] naming what is missing when GPU memory has
    /// neither route.
    pub fn prepare(&self, region: &RegionInfo) -> Result<Option<DmaBufExport>> {
        let (kind, device) = match region.location {
            MemoryLocation::Host { .. } => return Ok(None),
            MemoryLocation::Cuda { device } => (MemoryKind::Cuda, device),
            MemoryLocation::Rocm { device } => (MemoryKind::Rocm, device),
        };
        let dmabuf_failure = match self.plugin(kind) {
            None => format!("no {kind} device plugin is loaded (dma-buf)"),
            Some(_) if !self.dmabuf_verb => "libibverbs lacks ibv_reg_dmabuf_mr (needs rdma-core >= 34)".to_string(),
            Some(plugin) => match plugin.export_dmabuf(device, region.base, region.len) {
                Ok(export) => return Ok(Some(export)),
                Err(e) => format!("{} could not export a dma-buf: {e}", plugin.name()),
            },
        };
        if self.peer_memory(kind) {
            tracing::debug!(
                "rdma: {dmabuf_failure}; registering {} through nvidia_peermem",
                region.location
            );
            return Ok(None);
        }
        let peer = match kind {
            MemoryKind::Cuda => "the nvidia_peermem kernel module is not loaded",
            _ => "no peer-memory route for this memory kind",
        };
        Err(Error::not_available(
            NAME,
            format!(
                "cannot register {} memory: {dmabuf_failure}, and {peer}",
                region.location
            ),
        ))
    }
}
