//! Warm-up: every route to a segment carries one small READ per lazily connected path before the
//! first real transfer, so connection set-up and handshakes (libfabric's rxm connects each rail
//! on its first message) are paid at a time the caller chooses rather than by the first batch.
//! The same probe tells whether a paused route may carry traffic again (`failover`).
//!
//! The reads land in a scratch page the engine registers (local only) on first use, and read the
//! first bytes of a buffer the segment exports: a READ never changes the peer's memory. A segment
//! that exports nothing a route reaches cannot be probed over it; its connection, made at open,
//! stands as it is and the report says so.

use std::sync::Arc;
use std::time::{Duration, Instant};

use te_base::config::{parse_bool, Env};
use te_base::{
    Batch, BatchState, Error, HostBuffer, HostBufferOptions, MemoryKind, MemoryLocation, ResolvedRequest, Result,
    SubmitContext, TransferOp,
};

use super::registration::{PendingRegion, RawRegion};
use super::{EngineInner, RegisterOptions, Registration, TransferEngine};
use crate::registry::Owner;
use crate::segment::{OpenSegment, SegmentHandle};

/// `1` warms every segment up as it is opened (default off); the builder's
/// [`warm_up_segments`](crate::TransferEngineBuilder::warm_up_segments) overrides it.
pub const WARM_UP_VAR: &str = "TE_WARM_UP";

/// Bytes each probe read moves.
const PROBE_BYTES: u64 = 64;
/// The scratch page: room for one probe read per path, up to 64 paths.
const SCRATCH_BYTES: usize = 4096;

pub(super) fn from_env(env: &dyn Env) -> Result<bool> {
    Ok(parse_bool(env, WARM_UP_VAR)?.unwrap_or(false))
}

/// What [`TransferEngine::warm_up`] did, route by route.
#[derive(Debug, Clone)]
pub struct WarmUpReport {
    /// One entry per route to the segment, in the engine's order of preference.
    pub routes: Vec<RouteWarmUp>,
    /// From the call to the last route's last read.
    pub elapsed: Duration,
}

/// One route's warm-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteWarmUp {
    /// The route's transport.
    pub transport: &'static str,
    /// Probe reads it carried (one per lazily connected path); 0 when it could not be probed.
    pub reads: usize,
    /// Why it was not probed (the segment exports no buffer this route reaches), if it was not.
    pub unprobed: Option<String>,
    /// How long its probe took.
    pub elapsed: Duration,
}

impl TransferEngine {
    /// Warms up every route to `segment`: each transport's connections, queue pairs and rails
    /// connected and handshaken, by one small READ per path the transport connects lazily
    /// ([`te_base::Peer::lazy_paths`]), all of a route's reads in one batch. Bounded by the
    /// engine's transfer deadline (`TE_TRANSFER_TIMEOUT_MS`), else 10 s per route. The first
    /// route that fails ends the call with its error; warming many segments concurrently is the
    /// caller's (one call per segment, joined).
    pub async fn warm_up(&self, segment: &SegmentHandle) -> Result<WarmUpReport> {
        self.inner.check_open()?;
        self.inner.warm_up(segment.id().0).await
    }
}

impl EngineInner {
    pub(super) async fn warm_up(self: &Arc<Self>, id: u32) -> Result<WarmUpReport> {
        let start = Instant::now();
        let seg = match self.segments.read().get(id as usize) {
            Some(s) if s.closed => return Err(Error::SegmentClosed(s.descriptor.name.clone())),
            Some(s) => s.clone(),
            None => return Err(Error::UnknownSegment(format!("id {id}"))),
        };
        let timeout = self.default_deadline.unwrap_or(super::failover::PROBE_TIMEOUT);
        let mut routes = Vec::with_capacity(seg.routes.len());
        for (i, r) in seg.routes.iter().enumerate() {
            let t0 = Instant::now();
            let outcome = self.probe_route(&seg, i, timeout).await;
            let (reads, unprobed) = match outcome {
                Ok(Probe::Read(n)) => (n, None),
                Ok(Probe::Nothing(why)) => (0, Some(why)),
                Err(e) => {
                    return Err(Error::transport(
                        r.transport_name,
                        format!("warming up segment '{}': {e}", seg.descriptor.name),
                    ))
                }
            };
            routes.push(RouteWarmUp {
                transport: r.transport_name,
                reads,
                unprobed,
                elapsed: t0.elapsed(),
            });
        }
        let warmed = routes.iter().filter(|r| r.reads > 0).count();
        self.metrics.record_warmed_routes(warmed as u64);
        Ok(WarmUpReport {
            routes,
            elapsed: start.elapsed(),
        })
    }

    /// Sends route `route` of `seg` its probe reads and waits for them, at most `timeout`.
    pub(super) async fn probe_route(
        self: &Arc<Self>,
        seg: &OpenSegment,
        route: usize,
        timeout: Duration,
    ) -> Result<Probe> {
        let r = &seg.routes[route];
        let target = seg
            .descriptor
            .buffers
            .iter()
            .enumerate()
            .find(|(_, b)| r.serves(MemoryKind::Host, b.location.kind()));
        let Some((buffer, remote)) = target else {
            return Ok(Probe::Nothing(format!(
                "segment '{}' exports no buffer the {} route reaches",
                seg.descriptor.name, r.transport_name
            )));
        };
        let scratch = self.scratch().await?;
        let paths = r.peer.lazy_paths().clamp(1, SCRATCH_BYTES / PROBE_BYTES as usize);
        let len = PROBE_BYTES.min(remote.len);
        let (local_region, pins) = {
            let mut resolver = self.registry.local_resolver();
            let local = resolver.resolve(scratch.addr(), scratch.len())?;
            (local.id, resolver.pins())
        };
        let requests: Vec<ResolvedRequest> = (0..paths)
            .map(|k| ResolvedRequest {
                index: k as u32,
                op: TransferOp::Read,
                len,
                local_addr: scratch.addr() + k as u64 * PROBE_BYTES,
                local_region,
                remote_addr: remote.base,
                remote_buffer: buffer as u32,
            })
            .collect();
        let state = BatchState::new(vec![len; paths].into());
        state.keep_alive(Box::new(pins));
        if let Err(e) = r.peer.submit(requests, &state, &SubmitContext::default()) {
            // Nothing started: settle the reads so the pins go with the batch.
            state.fail_many(0..paths, &e);
            return Err(e);
        }
        let batch = Batch::new(state);
        match tokio::time::timeout(timeout, batch.wait()).await {
            Ok(Ok(_)) => Ok(Probe::Read(paths)),
            Ok(Err(e)) => Err(e.into_first_error()),
            Err(_) => {
                let err = Error::Timeout {
                    what: format!("probe of the {} route to '{}'", r.transport_name, seg.descriptor.name),
                    after_ms: timeout.as_millis() as u64,
                };
                r.peer.abort(err.clone());
                Err(err)
            }
        }
    }

    /// The scratch page probe reads land in, registered on every transport (local only).
    async fn scratch(self: &Arc<Self>) -> Result<&Registration> {
        self.scratch
            .get_or_try_init(|| async {
                let buf = HostBuffer::allocate(SCRATCH_BYTES, HostBufferOptions::default())?;
                let region = RawRegion {
                    addr: buf.addr(),
                    len: buf.len() as u64,
                    location: MemoryLocation::Host { numa: buf.numa_node() },
                };
                let item = PendingRegion {
                    region,
                    owned: Some(Owner::Host(buf)),
                };
                let mut v = self
                    .register(vec![item], RegisterOptions::local_only().without_cache())
                    .await?;
                Ok(v.remove(0))
            })
            .await
    }

    /// Warms a segment just opened, if the engine was asked to; a failure is logged, the segment
    /// stays open (its first transfer reports what is wrong).
    pub(super) async fn warm_on_open(self: &Arc<Self>, id: u32) {
        if !self.warm_on_open {
            return;
        }
        if let Err(e) = self.warm_up(id).await {
            tracing::warn!("warming up a segment at open failed: {e}");
        }
    }
}

/// What a probe did.
pub(super) enum Probe {
    /// This many reads passed.
    Read(usize),
    /// Nothing to read over this route (why).
    Nothing(String),
}
