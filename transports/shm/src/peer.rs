//! A connected target segment, as one descriptor describes it, and the copy threads that take
//! batches too large to copy on the submitting thread.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::mpsc;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use te_base::{BatchState, Error, Peer, RegionId, ResolvedRequest, Result, SegmentDescriptor, SubmitContext};

use crate::connection::Connection;

/// The initiator's registered host regions, by id.
pub(crate) type LocalTable = RwLock<HashMap<RegionId, (u64, u64)>>;

/// One share of a batch handed to a copy thread.
pub(crate) struct Job {
    conn: Arc<Connection>,
    requests: Arc<[ResolvedRequest]>,
    range: Range<usize>,
    batch: Arc<BatchState>,
}

impl Job {
    fn run(&self) {
        self.conn.run(&self.requests[self.range.clone()], &self.batch);
    }
}

/// The transport's persistent copy threads (started once, at install). The kernel's copy of one
/// thread reaches about half of what a memcpy loop does here (it pins the target's pages one by
/// one), so a large batch is cut into one share per thread.
pub(crate) struct CopyThreads {
    txs: Mutex<Vec<mpsc::Sender<Job>>>,
}

impl CopyThreads {
    pub fn start(threads: usize) -> Result<CopyThreads> {
        let mut txs = Vec::with_capacity(threads);
        for i in 0..threads {
            let (tx, rx) = mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name(format!("te-shm-copy-{i}"))
                .spawn(move || {
                    for job in rx {
                        job.run();
                    }
                })
                .map_err(|e| Error::io("shm: starting a copy thread", e))?;
            txs.push(tx);
        }
        Ok(CopyThreads { txs: Mutex::new(txs) })
    }

    /// Cuts `requests` (of `total` bytes) into one share per thread, by bytes, and hands them
    /// out; shares no thread takes (the transport is stopping) are copied here.
    fn push(&self, conn: &Arc<Connection>, requests: Vec<ResolvedRequest>, total: u64, batch: &Arc<BatchState>) {
        let requests: Arc<[ResolvedRequest]> = requests.into();
        let txs = self.txs.lock().clone();
        let shares = txs.len().min(requests.len()).max(1);
        let mut start = 0usize;
        let mut bytes = 0u64;
        for k in 0..shares {
            let goal = total / shares as u64 * (k as u64 + 1);
            let mut end = start;
            while end < requests.len() && (bytes < goal || k + 1 == shares) {
                bytes += requests[end].len;
                end += 1;
            }
            if end == start {
                continue;
            }
            let job = Job {
                conn: conn.clone(),
                requests: requests.clone(),
                range: start..end,
                batch: batch.clone(),
            };
            start = end;
            match txs.get(k) {
                Some(tx) => {
                    if let Err(e) = tx.send(job) {
                        e.0.run();
                    }
                }
                None => job.run(),
            }
        }
    }

    /// Lets the threads finish what they hold and exit.
    pub fn stop(&self) {
        self.txs.lock().clear();
    }
}

/// A peer segment reached by cross-memory attach.
pub(crate) struct ShmPeer {
    pub descriptor: SegmentDescriptor,
    pub local: Arc<LocalTable>,
    pub conn: Arc<Connection>,
    pub inline_bytes: u64,
    pub copier: Arc<CopyThreads>,
}

impl Peer for ShmPeer {
    fn descriptor(&self) -> &SegmentDescriptor {
        &self.descriptor
    }

    fn submit(&self, mut requests: Vec<ResolvedRequest>, batch: &Arc<BatchState>, ctx: &SubmitContext) -> Result<()> {
        // The engine resolved both sides already; this re-check (one read lock per batch, a
        // lookup per request) keeps a forged request from touching a byte outside registered
        // local memory or the descriptor's buffer. The target's live export list is checked
        // by the copy itself.
        let mut total = 0u64;
        {
            let local = self.local.read();
            let buffers = &self.descriptor.buffers;
            requests.retain(|r| {
                let remote_ok = buffers
                    .get(r.remote_buffer as usize)
                    .is_some_and(|b| b.contains(r.remote_addr, r.len));
                let local_ok = local.get(&r.local_region).is_some_and(|&(base, len)| {
                    r.local_addr >= base && r.len <= len && r.local_addr - base <= len - r.len
                });
                let err = if r.len == 0 {
                    Some(Error::ZeroLength {
                        index: r.index as usize,
                    })
                } else if !remote_ok {
                    Some(Error::OutOfBounds {
                        segment: self.descriptor.name.clone(),
                        addr: r.remote_addr,
                        len: r.len,
                    })
                } else if !local_ok {
                    Some(Error::Unregistered {
                        addr: r.local_addr,
                        len: r.len,
                    })
                } else {
                    None
                };
                match err {
                    Some(e) => {
                        batch.fail(r.index as usize, e);
                        false
                    }
                    None => {
                        total += r.len;
                        true
                    }
                }
            });
        }
        if requests.is_empty() {
            return Ok(());
        }
        if !self.conn.is_healthy() {
            return Err(Error::PeerGone {
                peer: self.descriptor.name.clone(),
                reason: "its shm connection was lost; reconnect to its current instance".into(),
            });
        }
        let t0 = ctx.timer.start();
        if total <= self.inline_bytes || ctx.background {
            self.conn.run(&requests, batch);
        } else {
            self.copier.push(&self.conn, requests, total, batch);
        }
        ctx.timer.lap(te_base::Phase::Submit, t0);
        Ok(())
    }

    fn is_healthy(&self) -> bool {
        self.conn.is_healthy()
    }

    /// Marks the connection cut: queued copies and the rest of a running one fail with `err`
    /// from the thread doing them, after its current system call (which never waits on the
    /// peer), so no request settles while its bytes may still move.
    fn abort(&self, err: Error) -> bool {
        self.conn.kill(err);
        true
    }

    /// Only `batch`: its copies stop before their next system call (one call moves at most 64
    /// MiB), so it fails within that of its deadline while the connection and other batches on
    /// it go on.
    fn abort_batch(&self, batch: &Arc<BatchState>, err: Error) -> bool {
        self.conn.abort_batch(batch, err);
        true
    }

    /// Over the control socket, after the batch it follows completed (its bytes were in the
    /// target's memory when the system call returned).
    fn notify(&self, note: te_base::Notification, done: &Arc<BatchState>, index: usize) -> Result<()> {
        let mut body = Vec::new();
        te_base::notify::encode_body(&note.from, &note.payload, &mut body)?;
        self.conn.notify(&body, note.payload.len(), done, index)
    }
}
