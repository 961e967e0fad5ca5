//! Open segments: the routes (transport + connection) to a peer's segment, and the handle callers
//! hold for one.

use std::sync::Arc;

use te_base::{Capabilities, ExportedBuffer, MemoryKind, Peer, SegmentDescriptor, SegmentId};

use crate::route_health::{RouteHealth, RouteState};

/// One route to an open segment: a transport and its connection.
pub(crate) struct Route {
    /// Index of its transport in the engine's list (its preference order).
    pub transport: usize,
    /// The transport's name, for errors, metrics and reports.
    pub transport_name: &'static str,
    /// Its transport serves this process only ([`te_base::Reach::InProcess`]): it fails only
    /// with the process, so no second route of its capabilities stands by behind it.
    pub in_process: bool,
    pub caps: Capabilities,
    pub peer: Arc<dyn Peer>,
    /// Errors and pauses of this connection (a reconnect makes a new route, which starts
    /// active: its handshake passed).
    pub health: Arc<RouteHealth>,
    /// The label set its batches count under, when the engine exports metrics.
    pub metrics: Option<Arc<crate::metrics::PeerMetrics>>,
}

/// A segment opened by this engine.
pub(crate) struct OpenSegment {
    pub descriptor: Arc<SegmentDescriptor>,
    pub routes: Vec<Route>,
    /// Transports that reach the segment but refused to connect, with why (none is a route).
    pub unreached: Vec<UnreachedRoute>,
    /// Closed by [`crate::TransferEngine::close_segment`]: submits to it are refused.
    pub closed: bool,
}

impl Route {
    /// True if its transport moves `local` memory to and from `remote` memory.
    pub fn serves(&self, local: MemoryKind, remote: MemoryKind) -> bool {
        self.caps.local.contains(local) && self.caps.remote.contains(remote)
    }

    /// True if new traffic should avoid it: paused after errors, or its connection lost.
    pub fn avoided(&self) -> bool {
        self.health.is_paused() || !self.peer.is_healthy()
    }
}

impl OpenSegment {
    /// The first route that moves `local` memory to and from `remote` memory and is not paused;
    /// if every such route is paused, the first of them (its failure then fails over).
    pub fn route_for(&self, local: MemoryKind, remote: MemoryKind) -> Option<usize> {
        let mut first = None;
        for (i, r) in self.routes.iter().enumerate() {
            if r.serves(local, remote) {
                if !r.health.is_paused() {
                    return Some(i);
                }
                first.get_or_insert(i);
            }
        }
        first
    }

    /// The routes not in `tried` (bit i: route i) that serve memory of these kinds, in order of
    /// preference, whatever their health: no call into any transport, so safe from a transport's
    /// own thread.
    fn untried(&self, local: MemoryKind, remote: MemoryKind, tried: u64) -> impl Iterator<Item = (usize, &Route)> {
        self.routes
            .iter()
            .enumerate()
            .filter(move |&(i, r)| i < 64 && tried & (1 << i) == 0 && r.serves(local, remote))
    }

    /// True if a route not in `tried` serves memory of these kinds (`tried = 1 << route`: a
    /// group on `route` can fail over).
    pub fn has_untried(&self, local: MemoryKind, remote: MemoryKind, tried: u64) -> bool {
        self.untried(local, remote, tried).next().is_some()
    }

    /// The next route to try for memory of these kinds after the routes in `tried` failed: the
    /// first untried one that is not avoided, else the first untried one at all. Asks routes for
    /// their health: not from a transport's thread.
    pub fn next_route(&self, local: MemoryKind, remote: MemoryKind, tried: u64) -> Option<usize> {
        let mut candidates = self.untried(local, remote, tried);
        let first = candidates.next()?;
        if !first.1.avoided() {
            return Some(first.0);
        }
        Some(candidates.find(|(_, r)| !r.avoided()).unwrap_or(first).0)
    }
}

/// One route of an open segment as [`crate::TransferEngine::routes`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteReport {
    /// The transport.
    pub transport: &'static str,
    /// Paused, probing or active.
    pub state: RouteState,
    /// Whether its connection is up.
    pub connected: bool,
    /// Times it was paused since the segment was opened.
    pub pauses: u64,
}

/// A transport that reaches a segment by its descriptor but refused to connect to it, so its
/// requests go on the next route (e.g. shm without ptrace permission falls back to tcp), as
/// [`crate::TransferEngine::unreached_routes`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnreachedRoute {
    /// The transport.
    pub transport: &'static str,
    /// Its connect error, as text.
    pub reason: String,
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
