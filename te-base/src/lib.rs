//! The lowest layer of the transfer engine.
//!
//! Everything a transport needs and nothing above it: the [`Transport`] trait, memory, segment and
//! request types, the [`Error`] type, strict configuration readers, the registration pool, the
//! device-plugin trait and the transport conformance suite. Topology discovery and NIC selection
//! live in `te-topology` (only the NIC-bound transports and the engine's settings check use them).
//! Users depend on `te-core`, which re-exports what they need.

pub mod auth;
pub mod batch;
pub mod batch_aborts;
pub mod config;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod device;
pub mod error;
pub mod host_buffer;
#[cfg(feature = "listener")]
pub mod listener;
pub mod memory;
pub mod metadata;
pub mod notify;
pub mod pattern;
pub mod registration;
pub mod request;
pub mod segment;
pub mod shared_memory;
#[cfg(feature = "test-support")]
pub mod test_support;
pub mod timing;
pub mod token;
pub mod transport;
pub mod transport_descriptor;
pub mod wire;

pub use batch::{Batch, BatchError, BatchProgress, BatchReport, BatchState, FailureHook, RequestStatus};
pub use batch_aborts::BatchAborts;
pub use error::{Error, ErrorSource, NativeError, RegistrationFailure, Result, SkippedDevice};
pub use host_buffer::{HostBacking, HostBuffer, HostBufferOptions, HugePages};
pub use memory::{MemoryKind, MemoryKinds, MemoryLocation, RegionId, RegionInfo};
pub use metadata::{DescriptorEvent, DescriptorWatch, MetadataStore};
pub use notify::{Notification, NotifyInbox, NotifyLimits};
pub use request::{ResolvedRequest, SegmentId, TransferOp, TransferRequest};
pub use segment::{ExportedBuffer, SegmentDescriptor, TransportEndpoint, DESCRIPTOR_VERSION};
pub use timing::{Phase, PhaseReport, PhaseStats, PhaseTimer};
pub use transport::{Capabilities, InstallContext, Peer, SubmitContext, Transport};
pub use transport_descriptor::{Installer, Reach, TransportDescriptor};

/// The variables this crate reads (registration pool, authentication, notifications) and those its
/// test support reads. Here, above the modules that read them, so the readers in [`config`] import
/// none of their users.
pub const ENV_VARS: &[&str] = &[
    auth::KEY_FILE_VAR,
    registration::CAP_VAR,
    registration::CAP_ALIAS,
    registration::ORDER_VAR,
    registration::LOCAL_RANK_VARS[0],
    "TE_REQUIRE",
    "TE_ETCD_BIN",
    notify::QUEUE_DEPTH_VAR,
    notify::MAX_BYTES_VAR,
];
