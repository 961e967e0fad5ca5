//! The transfer engine.
//!
//! Register memory, publish it as a segment, open other engines' segments and move bytes
//! between them in batches. Transports are chosen with cargo features (`local`, `shm`, `tcp`, `efa`,
//! `rdma`); the engine installs every compiled-in transport that works on this host and reports
//! the others with the reason.
//!
//! ```no_run
//! use te_core::{HostBufferOptions, TransferEngine, TransferRequest};
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let engine = TransferEngine::builder().segment_name("node-a").build().await?;
//! let local = engine.allocate(1 << 20, HostBufferOptions::default()).await?;
//! let peer = engine.open_segment("node-a").await?; // any published segment name
//! let remote = peer.buffers()[0].base;
//! engine.transfer(&[TransferRequest::write(local.addr(), peer.id(), remote, 4096)]).await?;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

mod builder;
mod engine;
mod env_check;
mod grouping;
mod install;
pub mod metadata;
pub mod metrics;
mod registry;
mod route_health;
mod segment;

pub use builder::TransferEngineBuilder;
pub use engine::{Notifications, NotifiedBatch};
pub use engine::{
    RawRegion, RegisterOptions, Registration, RouteWarmUp, SubmitOptions, TransferEngine, TransportStatus,
    WarmUpReport, FAILOVER_VAR, ROUTE_PAUSE_VAR, TRANSFER_TIMEOUT_VAR, WARM_UP_VAR,
};
pub use env_check::known_vars;
pub use install::{device_plugins, PluginStatus, COMPILED_TRANSPORTS};
pub use metrics::MetricsSnapshot;
pub use route_health::RouteState;
pub use segment::{RouteReport, SegmentEvent, SegmentHandle, UnreachedRoute};

/// Peer authentication: the shared key every peer must prove (see `docs/security.md`).
pub mod auth {
    pub use te_base::auth::{AuthKey, KEY_FILE_VAR};
}

/// Notifications: what a target receives, and the bounds of its inbox.
pub mod notify {
    pub use te_base::notify::{NotifyLimits, MAX_PAYLOAD_LIMIT};
    pub use te_base::Notification;
}

/// Where the engine reads its `TE_*` variables from: the process environment, or a map.
pub mod config {
    pub use te_base::config::{parse_byte_size, Env, MapEnv, ProcessEnv, UnknownVar};
}

/// Host memory another process on this host can map: sealed memfds (`allocate` makes them when
/// the shm transport runs), checked and mapped with [`shared_memory::map_sealed`].
pub mod shared_memory {
    pub use te_base::shared_memory::{
        create_sealed, map_sealed, memfd_of, MemfdRange, Refusal, SharedMapping, REQUIRED_SEALS,
    };
}

/// Device memory (CUDA, ROCm) through the device plugins: allocating it and copying to and from it.
pub mod device {
    pub use te_base::device::{
        CopyDirection, CopyFragment, DeviceBuffer, DevicePlugin, DeviceRuntimeInfo, PendingCopy, PointerKind,
    };
}

pub use te_base::{
    Batch, BatchError, BatchProgress, BatchReport, Error, ErrorSource, ExportedBuffer, HostBacking, HostBuffer,
    HostBufferOptions, HugePages, MemoryKind, MemoryLocation, MetadataStore, NativeError, Phase, PhaseReport,
    PhaseStats, PhaseTimer, RequestStatus, Result, SegmentDescriptor, SegmentId, TransferOp, TransferRequest,
};
