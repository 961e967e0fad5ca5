//! Open segments: the routes (transport + connection) to a peer's segment, and the handle callers
//! hold for one.

use std::sync::Arc;

use te_base::{Capabilities, ExportedBuffer, MemoryKind, Peer, SegmentDescriptor, SegmentId};

/// One route to an open segment: a transport and its connection.
pub(crate) struct Route {
    pub caps: Capabilities,
    pub peer: Arc<dyn Peer>,
    /// The label set its batches count under, when the engine exports metrics.
    pub metrics: Option<Arc<crate::metrics::PeerMetrics>>,
}

/// A segment opened by this engine.
pub(crate) struct OpenSegment {
    pub descriptor: Arc<SegmentDescriptor>,
    pub routes: Vec<Route>,
    /// Closed by [`crate::TransferEngine::close_segment`]: submits to it are refused.
    pub closed: bool,
}

impl OpenSegment {
    /// The first route whose transport moves `local` memory to and from `remote` memory.
    pub fn route_for(&self, local: MemoryKind, remote: MemoryKind) -> Option<usize> {
        self.routes
            .iter()
            .position(|r| r.caps.local.contains(local) && r.caps.remote.contains(remote))
    }
}

/// What happened to an open segment (see [`SegmentHandle::events`]).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum SegmentEvent {
    /// The peer published a new descriptor (buffers added or removed); submits use it now.
    Changed(Arc<SegmentDescriptor>),
    /// The peer restarted (a new instance): requests in flight to the old one failed with
    /// [`te_base::Error::PeerRestarted`]; submits go to the new one, reconnected.
    Restarted(Arc<SegmentDescriptor>),
    /// The peer withdrew its descriptor (it shut down, or its metadata lease ran out).
    Gone,
    /// This engine closed the segment.
    Closed,
}

/// A handle on an open segment.
#[derive(Debug, Clone)]
pub struct SegmentHandle {
    pub(crate) id: SegmentId,
    pub(crate) descriptor: Arc<SegmentDescriptor>,
    pub(crate) events: tokio::sync::broadcast::Sender<SegmentEvent>,
}

impl SegmentHandle {
    /// The id to put in [`TransferRequest::segment`](te_base::TransferRequest::segment).
    pub fn id(&self) -> SegmentId {
        self.id
    }

    /// The segment's name.
    pub fn name(&self) -> &str {
        &self.descriptor.name
    }

    /// Changes to the segment from now on: descriptor changes, a restart, its removal, its
    /// closing. A receiver that falls more than 64 events behind gets `Lagged` and then the
    /// latest events.
    pub fn events(&self) -> tokio::sync::broadcast::Receiver<SegmentEvent> {
        self.events.subscribe()
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
