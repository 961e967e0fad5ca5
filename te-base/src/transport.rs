//! The `Transport` trait every backend implements, and the `Peer` a transport returns for each
//! segment it connects to.
//!
//! Control plane (register, connect) is async; the data path (`Peer::submit`) is non-blocking and
//! receives one whole resolved batch at a time, so a transport can plan and post it without any
//! allocation, lock or clock read per fragment.

use std::sync::Arc;

use async_trait::async_trait;

use crate::batch::BatchState;
use crate::config::Env;
use crate::error::Result;
use crate::memory::{MemoryKinds, RegionInfo};
use crate::request::ResolvedRequest;
use crate::segment::SegmentDescriptor;
use crate::timing::PhaseTimer;

/// What memory a transport can move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Kinds of local (initiator-side) memory it can read from and write into.
    pub local: MemoryKinds,
    /// Kinds of remote (target-side) memory it can reach.
    pub remote: MemoryKinds,
}

/// A transport backend (local copy, TCP, libfabric, verbs).
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// Short name used in descriptors and reports: `local`, `tcp`, `efa`, `rdma`.
    fn name(&self) -> &'static str;

    /// Memory kinds it serves.
    fn capabilities(&self) -> Capabilities;

    /// What peers need to reach this transport; goes into the segment descriptor.
    fn endpoint(&self) -> serde_json::Value;

    /// True if this transport can reach `peer` at all (the peer advertises it, same process for
    /// the local copy, a compatible provider...). Cheap; no I/O.
    fn can_reach(&self, peer: &SegmentDescriptor) -> bool;

    /// Registers a batch of regions. Returns, in the same order, the keys a peer needs to access
    /// each exported region (`Value::Null` where the transport needs none). On failure nothing of
    /// the batch stays registered.
    async fn register(&self, regions: &[RegionInfo]) -> Result<Vec<serde_json::Value>>;

    /// Releases regions registered earlier. The engine calls it when none of the engine's own
    /// batches uses them, never under its control lock, and from its runtime (never from a
    /// `Drop`), so an implementation may await.
    ///
    /// It must stop serving the regions to remote peers at once. It may wait for remote requests
    /// that are already touching them to drain (their memory must stay valid until then), but
    /// only within a deadline the transport enforces itself (TCP: `TE_TCP_TIMEOUT_MS` per stalled
    /// frame, after which the connection is cut and its pins released). It must not wait on a
    /// remote peer's cooperation beyond that, nor on the engine. When it returns, no byte of the
    /// regions is read or written by this transport any more.
    async fn deregister(&self, regions: &[RegionInfo]) -> Result<()>;

    /// Prepares to move data to and from `peer` (connections, address vectors, remote keys).
    async fn connect(&self, peer: &SegmentDescriptor) -> Result<Arc<dyn Peer>>;

    /// Stops background work. Outstanding requests fail with [`crate::Error::Closed`].
    async fn shutdown(&self) {}

    /// Devices (NICs, provider domains) this transport was configured or able to use but did not
    /// open at install, each with why; it serves on the others. Empty by default. The engine
    /// reports them with the transport's status (`te-bench info` prints them).
    fn skipped_devices(&self) -> Vec<crate::error::SkippedDevice> {
        Vec::new()
    }
}

/// A connected peer segment, ready for the data path.
pub trait Peer: Send + Sync + 'static {
    /// The descriptor this connection was made from.
    fn descriptor(&self) -> &SegmentDescriptor;

    /// Starts every request of `requests`, all addressed to this peer and already validated
    /// against both registrations. Must not block on the network; completes each request on
    /// `batch` by its `index` (now or later, from any thread). An `Err` means nothing was started
    /// and the engine fails the requests with it.
    fn submit(&self, requests: Vec<ResolvedRequest>, batch: &Arc<BatchState>, ctx: &SubmitContext) -> Result<()>;

    /// How many independent paths (rails, queue pairs, lanes) this peer spreads a batch's requests
    /// over, one after another from the first request on, that are not connected by `connect`
    /// itself. Warm-up sends this many small reads in one batch so each such path makes its
    /// connection and handshake before the first transfer. Default 1: the transport connected
    /// everything in `connect` (tcp lanes, rdma queue pairs), and one read settles the rest.
    fn lazy_paths(&self) -> usize {
        1
    }

    /// True while the connection is usable; false once the peer went away (the engine then
    /// reconnects using a fresh descriptor).
    fn is_healthy(&self) -> bool {
        true
    }

    /// Cuts this connection (a batch's deadline passed, or the peer restarted): every request
    /// outstanding on it fails with `err`, but only once the transport guarantees that no byte of
    /// those requests will be read or written any more, because settling the last request of a
    /// batch releases the pins on its memory. Returns at once; the failing happens when the
    /// transport has quiesced (tcp: both I/O tasks of each lane stopped). Later submits on this
    /// peer fail and [`Peer::is_healthy`] turns false, so the engine reconnects.
    ///
    /// Returns false when the transport cannot cut its requests short; they then settle on their
    /// own. The default, for transports whose requests always finish by themselves within bounded
    /// time (the local copy: synchronous, or on helper threads that run to the end).
    fn abort(&self, err: crate::error::Error) -> bool {
        let _ = err;
        false
    }

    /// Cuts short the requests of one batch (its deadline passed), failing them with `err` under
    /// the same guarantee as [`Peer::abort`], and leaving other batches' requests alone wherever
    /// the transport can: a deadline is the batch's own. Returns false when nothing could be cut
    /// short. The default cuts the whole connection ([`Peer::abort`]); tcp fails the batch's
    /// requests that have not started and cuts only a connection that is carrying one of them.
    fn abort_batch(&self, batch: &Arc<crate::batch::BatchState>, err: crate::error::Error) -> bool {
        let _ = batch;
        self.abort(err)
    }

    /// Sends one notification to this peer's inbox, ordered after every batch this peer already
    /// completed. Must not block: settles request `index` of `done` once the target queued the message
    /// (done), or refused it (failed with [`crate::Error::NotificationQueueFull`],
    /// [`crate::Error::NotificationTooLarge`], or the connection's error). An `Err` means nothing
    /// was sent. The default says the transport cannot; every transport of this workspace implements it.
    fn notify(&self, note: crate::notify::Notification, done: &Arc<BatchState>, index: usize) -> Result<()> {
        let _ = (note, done, index);
        Err(crate::Error::not_available(
            "notifications",
            "this transport cannot carry them",
        ))
    }
}

/// Per-call context of [`Peer::submit`].
#[derive(Debug, Clone, Default)]
pub struct SubmitContext {
    /// Phase timer of the call (off unless `TE_PHASE_TIMING=1`). The transport records its own
    /// [`crate::Phase::Plan`] and [`crate::Phase::Submit`]; the engine records resolve, build and
    /// other around it.
    pub timer: PhaseTimer,
    /// The caller marked the submission as background work: nobody waits on it, so the transport
    /// should not borrow helper threads for it (the local copy stays inline).
    pub background: bool,
}

/// What the engine hands a transport crate's `install` function.
#[derive(Clone)]
pub struct InstallContext {
    /// Where configuration variables come from.
    pub env: Arc<dyn Env>,
    /// The engine's segment name.
    pub segment_name: String,
    /// Device-memory plugins that loaded (CUDA, HIP), for transports that move device memory.
    pub devices: Vec<Arc<dyn crate::device::DevicePlugin>>,
    /// The shared key peers must prove (`TE_AUTH_KEY_FILE` or the builder's `auth_key`); `None`
    /// leaves listeners open to anyone who reaches them (logged once at start).
    pub auth: Option<crate::auth::AuthKey>,
    /// Where the serving side of each transport delivers the notifications peers send to this
    /// engine (bounded; see [`crate::notify`]).
    pub notifications: Arc<crate::notify::NotifyInbox>,
}

impl std::fmt::Debug for InstallContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InstallContext")
            .field("segment_name", &self.segment_name)
            .finish()
    }
}
