//! A connected target segment, as one descriptor describes it, and the copy thread that takes
//! batches too large to copy on the submitting thread.

use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use te_base::{BatchState, Error, Peer, RegionId, ResolvedRequest, Result, SegmentDescriptor, SubmitContext};

use crate::connection::Connection;

/// The initiator's registered host regions, by id.
pub(crate) type LocalTable = RwLock<HashMap<RegionId, (u64, u64)>>;

/// A batch handed to the copy thread.
pub(crate) struct Job {
    conn: Arc<Connection>,
    requests: Vec<ResolvedRequest>,
    batch: Arc<BatchState>,
}

/// The transport's persistent copy thread (started once, at install).
pub(crate) struct CopyThread {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
}

impl CopyThread {
    pub fn start() -> Result<CopyThread> {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("te-shm-copy".into())
            .spawn(move || {
                for job in rx {
                    job.conn.run(&job.requests, &job.batch);
                }
            })
            .map_err(|e| Error::io("shm: starting the copy thread", e))?;
        Ok(CopyThread {
            tx: Mutex::new(Some(tx)),
        })
    }

    fn push(&self, job: Job) -> std::result::Result<(), Job> {
        match self.tx.lock().as_ref() {
            Some(tx) => tx.send(job).map_err(|e| e.0),
            None => Err(job),
        }
    }

    /// Lets the thread finish what it holds and exit.
    pub fn stop(&self) {
        self.tx.lock().take();
    }
}

/// A peer segment reached by cross-memory attach.
pub(crate) struct ShmPeer {
    pub descriptor: SegmentDescriptor,
    pub local: Arc<LocalTable>,
    pub conn: Arc<Connection>,
    pub inline_bytes: u64,
    pub copier: Arc<CopyThread>,
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
            let job = Job {
                conn: self.conn.clone(),
                requests,
                batch: batch.clone(),
            };
            if let Err(job) = self.copier.push(job) {
                // The transport is shutting down: copy here rather than drop the batch.
                job.conn.run(&job.requests, &job.batch);
            }
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

    /// Over the control socket, after the batch it follows completed (its bytes were in the
    /// target's memory when the system call returned).
    fn notify(&self, note: te_base::Notification, done: &Arc<BatchState>, index: usize) -> Result<()> {
        let mut body = Vec::new();
        te_base::notify::encode_body(&note.from, &note.payload, &mut body)?;
        self.conn.notify(&body, note.payload.len(), done, index)
    }
}
