//! A connected peer: its lanes, and the per-batch planning that spreads slices over them.

use std::sync::Arc;

use te_base::{BatchState, Error, Peer, ResolvedRequest, Result, SegmentDescriptor, SubmitContext};

use crate::lane::{Lane, LaneJob};
use crate::notify::NoteJob;
use crate::plan::{lane_share, LaneCursor, Plan};
use crate::regions::RegionTable;

/// The lanes to one instance of a peer, shared by every [`TcpPeer`] opened on it.
pub(crate) struct Connection {
    pub lanes: Vec<Arc<Lane>>,
}

impl Connection {
    /// Fails everything outstanding and stops the lanes.
    pub fn kill(&self, err: Error) {
        for lane in &self.lanes {
            lane.kill(err.clone());
        }
    }

    /// True while every lane is alive.
    pub fn is_healthy(&self) -> bool {
        self.lanes.iter().all(|l| l.is_alive())
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // Lanes finish what they carry, then close their connections.
        for lane in &self.lanes {
            lane.close_when_idle();
        }
    }
}

/// A peer segment reached over TCP, as one descriptor describes it.
pub(crate) struct TcpPeer {
    /// The descriptor this peer was opened with: requests are checked against its buffers.
    pub descriptor: SegmentDescriptor,
    /// The initiator's registered regions, to check each request's local side.
    pub local: Arc<RegionTable>,
    pub connection: Arc<Connection>,
    pub slice: u64,
}

impl Peer for TcpPeer {
    fn descriptor(&self) -> &SegmentDescriptor {
        &self.descriptor
    }

    fn submit(&self, mut requests: Vec<ResolvedRequest>, batch: &Arc<BatchState>, _ctx: &SubmitContext) -> Result<()> {
        // The engine resolved both sides already; this re-check (one lock-free table view per
        // batch, a binary search per request) keeps a forged request from sending or receiving a
        // single byte outside registered local memory or the peer's exported buffer.
        let local = self.local.view();
        let buffers = &self.descriptor.buffers;
        requests.retain(|r| {
            let remote_ok = buffers
                .get(r.remote_buffer as usize)
                .is_some_and(|b| b.contains(r.remote_addr, r.len));
            let local_ok = local.holds(r.local_region, r.local_addr, r.len);
            if !remote_ok {
                batch.fail(
                    r.index as usize,
                    Error::OutOfBounds {
                        segment: self.descriptor.name.clone(),
                        addr: r.remote_addr,
                        len: r.len,
                    },
                );
            } else if r.len == 0 {
                batch.fail(
                    r.index as usize,
                    Error::ZeroLength {
                        index: r.index as usize,
                    },
                );
            } else if !local_ok {
                batch.fail(
                    r.index as usize,
                    Error::Unregistered {
                        addr: r.local_addr,
                        len: r.len,
                    },
                );
            }
            remote_ok && local_ok && r.len > 0
        });
        if requests.is_empty() {
            return Ok(());
        }
        if !self.is_healthy() {
            return Err(Error::PeerGone {
                peer: self.descriptor.name.clone(),
                reason: "its connection was lost; reconnect to its current instance".into(),
            });
        }
        let lanes = self.connection.lanes.len() as u64;
        let (plan, total) = Plan::new(requests, batch.clone(), self.slice, lanes);
        for (i, lane) in self.connection.lanes.iter().enumerate() {
            let slices = lane_share(total, i as u64, lanes);
            if slices > 0 {
                lane.push(LaneJob {
                    plan: plan.clone(),
                    cursor: LaneCursor::new(i as u64),
                    slices,
                });
            }
        }
        Ok(())
    }

    fn is_healthy(&self) -> bool {
        self.connection.is_healthy()
    }

    /// Shuts the lanes' sockets down; the last I/O task of each lane to stop fails what that lane
    /// carried with `err`, so no request settles while a task may still touch its memory. Every
    /// batch on this connection fails, not only the one whose deadline passed: a stalled peer
    /// stalls them all.
    fn abort(&self, err: Error) -> bool {
        self.connection.kill(err);
        true
    }

    /// Only the batch's own requests: those not started fail at once, and only a lane carrying
    /// one of them on the wire is cut (`Lane::abort_batch`).
    fn abort_batch(&self, batch: &Arc<BatchState>, err: Error) -> bool {
        let mut any = false;
        for lane in &self.connection.lanes {
            any |= lane.abort_batch(batch, &err);
        }
        any
    }

    /// Rides the first lane, behind whatever it carries already; the engine calls it only once
    /// the batch it follows was acknowledged.
    fn notify(&self, note: te_base::Notification, done: &Arc<BatchState>, index: usize) -> Result<()> {
        let mut body = Vec::new();
        te_base::notify::encode_body(&note.from, &note.payload, &mut body)?;
        let lane = self.connection.lanes.first().ok_or_else(|| Error::PeerGone {
            peer: self.descriptor.name.clone(),
            reason: "no connection".into(),
        })?;
        lane.push_note(Arc::new(NoteJob {
            body,
            payload_len: note.payload.len(),
            done: done.clone(),
            index,
        }));
        Ok(())
    }
}
