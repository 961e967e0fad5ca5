//! Open segments: the routes (transport + connection) to a peer's segment, and the handle callers
//! hold for one.

use std::sync::Arc;

use te_base::{Capabilities, ExportedBuffer, MemoryKind, Peer, SegmentDescriptor, SegmentId};

/// One route to an open segment: a transport and its connection.
pub(crate) struct Route {
    pub transport: usize,
    pub caps: Capabilities,
    pub peer: Arc<dyn Peer>,
}

/// A segment opened by this engine.
pub(crate) struct OpenSegment {
    pub descriptor: Arc<SegmentDescriptor>,
    pub routes: Vec<Route>,
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
    pub(crate) id: SegmentId,
    pub(crate) descriptor: Arc<SegmentDescriptor>,
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

    /// The descriptor it was opened with.
    pub fn descriptor(&self) -> &SegmentDescriptor {
        &self.descriptor
    }

    /// The buffers the segment exports.
    pub fn buffers(&self) -> &[ExportedBuffer] {
        &self.descriptor.buffers
    }
}
