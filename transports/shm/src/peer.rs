//! A connected target segment, as one descriptor describes it, and the copy threads that take
//! batches too large to copy on the submitting thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use te_base::{BatchState, Error, Peer, RegionId, ResolvedRequest, Result, SegmentDescriptor, SubmitContext};

use crate::connection::Connection;

/// The initiator's registered host regions, by id.
pub(crate) type LocalTable = RwLock<HashMap<RegionId, (u64, u64)>>;

/// A large batch cut into chunks that the copy threads and the submitting thread claim one at a
/// time.
pub(crate) struct Job {
    conn: Arc<Connection>,
    requests: Arc<[ResolvedRequest]>,
    /// Chunk `k` is `requests[cuts[k]..cuts[k + 1]]`.
    cuts: Vec<usize>,
    next: AtomicUsize,
    batch: Arc<BatchState>,
}

impl Job {
    /// Copies chunks until none is left.
    fn drain(&self) {
        loop {
            let k = self.next.fetch_add(1, Ordering::Relaxed);
            if k + 1 >= self.cuts.len() {
                return;
            }
            self.conn
                .run(&self.requests[self.cuts[k]..self.cuts[k + 1]], &self.batch);
        }
    }
}

/// Bytes per chunk at least (and a batch is cut into at most [`MAX_CHUNKS`]): small enough that
/// whoever is on a core takes the next one, large enough that claiming costs nothing.
const CHUNK_BYTES: u64 = 1 << 20;
const MAX_CHUNKS: u64 = 4096;
/// Batches up to this size are copied by the submitting thread too (it claims chunks beside the
/// copy threads, so the batch never waits for a copy thread that cannot get a core); larger
/// ones are left to the copy threads, so `submit` returns at once.
pub(crate) const SUBMITTER_JOINS_MAX_BYTES: u64 = 256 << 20;

/// The transport's persistent copy threads (started once, at install), sharing large batches
/// with the submitting thread chunk by chunk.
pub(crate) struct CopyThreads {
    txs: Mutex<Vec<mpsc::Sender<Arc<Job>>>>,
}

impl CopyThreads {
    pub fn start(threads: usize) -> Result<CopyThreads> {
        let mut txs = Vec::with_capacity(threads);
        for i in 0..threads {
            let (tx, rx) = mpsc::channel::<Arc<Job>>();
            std::thread::Builder::new()
                .name(format!("te-shm-copy-{i}"))
                .spawn(move || {
                    for job in rx {
                        job.drain();
                    }
                })
                .map_err(|e| Error::io("shm: starting a copy thread", e))?;
            txs.push(tx);
        }
        Ok(CopyThreads { txs: Mutex::new(txs) })
    }

    /// Cuts `requests` (of `total` bytes) into chunks by bytes and offers them to every copy
    /// thread; up to [`SUBMITTER_JOINS_MAX_BYTES`] this thread claims chunks too until none is
    /// left (copy threads may still be finishing theirs when it returns). Chunks no thread takes
    /// (the transport is stopping) are copied here.
    fn push(&self, conn: &Arc<Connection>, requests: Vec<ResolvedRequest>, total: u64, batch: &Arc<BatchState>) {
        let chunk = CHUNK_BYTES.max(total / MAX_CHUNKS);
        let mut cuts = Vec::with_capacity((total / chunk) as usize + 2);
        cuts.push(0);
        let mut bytes = 0u64;
        for (i, r) in requests.iter().enumerate() {
            bytes += r.len;
            if bytes >= chunk {
                cuts.push(i + 1);
                bytes = 0;
            }
        }
        if *cuts.last().expect("starts non-empty") != requests.len() {
            cuts.push(requests.len());
        }
        let chunks = cuts.len() - 1;
        let job = Arc::new(Job {
            conn: conn.clone(),
            requests: requests.into(),
            cuts,
            next: AtomicUsize::new(0),
            batch: batch.clone(),
        });
        let txs = self.txs.lock().clone();
        let mut offered = 0;
        for tx in txs.iter().take(chunks) {
            if tx.send(job.clone()).is_ok() {
                offered += 1;
            }
        }
        if offered == 0 || total <= SUBMITTER_JOINS_MAX_BYTES {
            job.drain();
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
