//! Resolving a batch: every request's local range to its registered region, its remote range to
//! a buffer the target segment exports, and the pair to a route (a connected transport that moves
//! those memory kinds); requests are grouped by (segment, route), one group per transport call.
//!
//! Consecutive requests usually share the local region, the remote buffer and the route, so the
//! loop keeps the bounds of the last ones and compares against them; only a request that leaves
//! them searches (binary search of the registry and of the descriptor's buffers).

use std::sync::Arc;

use te_base::{Error, MemoryKind, MemoryLocation, ResolvedRequest, Result, TransferRequest};

use crate::registry::{LocalResolver, Pins};
use crate::segment::OpenSegment;

/// The requests of one batch that go to one segment over one route.
pub(crate) struct Group {
    pub segment: u32,
    pub route: u32,
    pub requests: Vec<ResolvedRequest>,
    /// The memory kinds (local, remote) of its requests, `None` if they differ (a route that
    /// moves host and device memory alike got both): failover needs one pair to find a route.
    pub kinds: Option<(MemoryKind, MemoryKind)>,
}

/// The remote side the previous request resolved to.
struct RemoteCursor {
    segment: u32,
    local_kind: MemoryKind,
    buffer: u32,
    base: u64,
    span: u64,
    group: usize,
}

impl RemoteCursor {
    /// True when `r`, whose local memory is of `local_kind`, goes where the previous request went.
    #[inline]
    fn holds(&self, r: &TransferRequest, local_kind: MemoryKind) -> bool {
        let off = r.remote_addr.wrapping_sub(self.base);
        r.segment.0 == self.segment && local_kind == self.local_kind && off <= self.span && r.len <= self.span - off
    }
}

/// A resolved batch: its groups, the pins on its local regions, and its bytes.
pub(crate) struct Grouped {
    pub groups: Vec<Group>,
    pub pins: Pins,
    pub bytes: u64,
}

/// Checks, resolves and groups `requests`. Fails on the first request that cannot be served,
/// naming why (its shape first: a zero length, a range past the end of the address space);
/// nothing is submitted then.
pub(crate) fn group_requests(
    requests: &[TransferRequest],
    segments: &[Arc<OpenSegment>],
    mut local: LocalResolver<'_>,
) -> Result<Grouped> {
    let mut groups: Vec<Group> = Vec::new();
    let mut cursor: Option<RemoteCursor> = None;
    // The requests of the group being filled, held here rather than behind `groups[i]` so the
    // loop pushes to a vector it owns; put back when another group is needed and at the end.
    let mut open: Vec<ResolvedRequest> = Vec::new();
    let mut open_group = usize::MAX;
    let mut bytes = 0u64;
    for (i, r) in requests.iter().enumerate() {
        let malformed =
            (r.len == 0) | r.local_addr.checked_add(r.len).is_none() | r.remote_addr.checked_add(r.len).is_none();
        if malformed {
            return Err(shape_error(i, r));
        }
        bytes += r.len;
        let region = local.resolve(r.local_addr, r.len)?;
        let (local_region, local_location) = (region.id, region.location);
        let local_kind = local_location.kind();
        let at = match &cursor {
            Some(c) if c.holds(r, local_kind) => c,
            _ => {
                let c = find_remote(r, local_location, segments, &mut groups, requests.len())?;
                if c.group != open_group {
                    if let Some(g) = groups.get_mut(open_group) {
                        g.requests = std::mem::take(&mut open);
                    }
                    open = std::mem::take(&mut groups[c.group].requests);
                    open_group = c.group;
                }
                cursor.insert(c)
            }
        };
        open.push(ResolvedRequest {
            index: i as u32,
            op: r.op,
            len: r.len,
            local_addr: r.local_addr,
            local_region,
            remote_addr: r.remote_addr,
            remote_buffer: at.buffer,
        });
    }
    if let Some(g) = groups.get_mut(open_group) {
        g.requests = open;
    }
    Ok(Grouped {
        groups,
        pins: local.pins(),
        bytes,
    })
}

/// What is wrong with the shape of request `index`.
#[cold]
fn shape_error(index: usize, r: &TransferRequest) -> Error {
    if r.len == 0 {
        return Error::ZeroLength { index };
    }
    let addr = if r.local_addr.checked_add(r.len).is_none() {
        r.local_addr
    } else {
        r.remote_addr
    };
    Error::LengthOverflow { addr, len: r.len }
}

/// Finds the exported buffer and the route of `r`, and the group it joins (a new one if none).
#[cold]
fn find_remote(
    r: &TransferRequest,
    local: MemoryLocation,
    segments: &[Arc<OpenSegment>],
    groups: &mut Vec<Group>,
    batch_len: usize,
) -> Result<RemoteCursor> {
    let seg = segments
        .get(r.segment.0 as usize)
        .ok_or_else(|| Error::UnknownSegment(format!("id {}", r.segment.0)))?;
    let d = &seg.descriptor;
    if seg.closed {
        return Err(Error::SegmentClosed(d.name.clone()));
    }
    let buffer = d.find_buffer(r.remote_addr, r.len)?;
    let remote = &d.buffers[buffer];
    let remote_kind = remote.location.kind();
    let local_kind = local.kind();
    let route = seg
        .route_for(local_kind, remote_kind)
        .ok_or_else(|| Error::NoTransport {
            segment: d.name.clone(),
            reason: format!("no connected transport moves {local} to/from {remote_kind} memory"),
        })? as u32;
    let kinds = Some((local_kind, remote_kind));
    let group = match groups.iter().position(|g| g.segment == r.segment.0 && g.route == route) {
        Some(g) => {
            if groups[g].kinds != kinds {
                groups[g].kinds = None;
            }
            g
        }
        None => {
            // The first group usually takes the whole batch.
            let cap = if groups.is_empty() { batch_len } else { 0 };
            groups.push(Group {
                segment: r.segment.0,
                route,
                requests: Vec::with_capacity(cap),
                kinds,
            });
            groups.len() - 1
        }
    };
    Ok(RemoteCursor {
        segment: r.segment.0,
        local_kind,
        buffer: buffer as u32,
        base: remote.base,
        span: remote.len,
        group,
    })
}
