//! An initiator process: connects to a target's descriptor and moves one buffer's worth of data
//! in fixed-size blocks, one batch per pass.

use std::sync::Arc;
use std::time::{Duration, Instant};

use te_base::config::ProcessEnv;
use te_base::{
    Batch, BatchState, HostBuffer, HostBufferOptions, InstallContext, MemoryLocation, Notification, Peer, RegionId,
    RegionInfo, ResolvedRequest, SegmentDescriptor, SubmitContext, TransferOp, Transport,
};

use crate::pattern;

/// A connected initiator with one registered local buffer.
pub struct Client {
    rt: tokio::runtime::Runtime,
    transport: Arc<dyn Transport>,
    local: HostBuffer,
    region: RegionInfo,
    peer: Arc<dyn Peer>,
    remote_base: u64,
    remote_len: u64,
    /// This initiator's segment name (the sender of its notifications).
    name: String,
}

impl Client {
    /// Installs the transport (provider from `TE_FABRIC_PROVIDER`), registers `bytes` of local
    /// memory and connects to the segment described by `descriptor_json` (its first buffer).
    pub fn connect(descriptor_json: &str, bytes: usize) -> Result<Client, String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let desc = SegmentDescriptor::from_json(descriptor_json.trim().as_bytes()).map_err(|e| e.to_string())?;
        let target = desc.buffers.first().ok_or("the target exports no buffer")?;
        let (remote_base, remote_len) = (target.base, target.len);
        let name = format!("efa-client-{}", std::process::id());
        let ctx = InstallContext {
            auth: None,
            env: Arc::new(ProcessEnv),
            segment_name: name.clone(),
            devices: Vec::new(),
            notifications: te_base::NotifyInbox::new(Default::default()),
        };
        let transport = rt
            .block_on(te_transport_efa::install(&ctx))
            .map_err(|e| e.to_string())?;
        let local = HostBuffer::allocate(
            bytes,
            HostBufferOptions {
                prefault: true,
                ..Default::default()
            },
        )
        .map_err(|e| e.to_string())?;
        let region = RegionInfo {
            id: RegionId(1),
            base: local.addr(),
            len: bytes as u64,
            location: MemoryLocation::HOST,
            exported: false,
        };
        rt.block_on(transport.register(std::slice::from_ref(&region)))
            .map_err(|e| e.to_string())?;
        let peer = rt.block_on(transport.connect(&desc)).map_err(|e| e.to_string())?;
        Ok(Client {
            rt,
            transport,
            local,
            region,
            peer,
            remote_base,
            remote_len,
            name,
        })
    }

    /// The local buffer's bytes (read between batches).
    pub fn local_bytes(&self) -> &[u8] {
        // SAFETY: the buffer is live; callers only look at it between batches.
        unsafe { std::slice::from_raw_parts(self.local.as_ptr(), self.local.len()) }
    }

    /// Zeroes the local buffer (between batches).
    pub fn zero_local(&self) {
        // SAFETY: the buffer is live and no transfer or slice of it is active between batches.
        unsafe { std::ptr::write_bytes(self.local.as_ptr(), 0, self.local.len()) };
    }

    /// Moves `total` bytes from offset 0 in `block`-byte requests (one batch), local offset equal to
    /// remote offset. Returns the time from submit to completion.
    pub fn transfer(&self, op: TransferOp, block: u64, total: u64) -> Result<Duration, String> {
        if total > self.region.len || total > self.remote_len || block == 0 {
            return Err(format!(
                "transfer of {total} B in {block} B blocks does not fit the buffers"
            ));
        }
        let n = total.div_ceil(block);
        let mut reqs = Vec::with_capacity(n as usize);
        let mut lens = Vec::with_capacity(n as usize);
        for i in 0..n {
            let off = i * block;
            let len = block.min(total - off);
            lens.push(len);
            reqs.push(ResolvedRequest {
                index: i as u32,
                op,
                len,
                local_addr: self.region.base + off,
                local_region: self.region.id,
                remote_addr: self.remote_base + off,
                remote_buffer: 0,
            });
        }
        let state = BatchState::new(lens.into());
        let start = Instant::now();
        self.peer
            .submit(reqs, &state, &SubmitContext::default())
            .map_err(|e| e.to_string())?;
        let outcome = Batch::new(state)
            .wait_blocking(Some(Duration::from_secs(120)))
            .ok_or("batch did not settle within 120 s")?;
        let elapsed = start.elapsed();
        outcome.map_err(|e| e.to_string())?;
        Ok(elapsed)
    }

    /// Writes `count` consecutive slices of `slice` bytes from offset 0, pipelined, each batch
    /// sending the notification `<offset> <len> <seed>` from its completion hook (as the engine
    /// does). Waits for every batch and every target answer; returns the slices in the order their
    /// notifications were handed over (the order the batches completed).
    pub fn notified_writes(&self, count: u64, slice: u64, seed: u64) -> Result<Vec<u64>, String> {
        if count * slice > self.region.len.min(self.remote_len) || slice == 0 {
            return Err(format!("{count} slices of {slice} B do not fit the buffers"));
        }
        let answers = BatchState::new(vec![0; count as usize].into());
        let order: Arc<parking_lot::Mutex<Vec<u64>>> = Arc::default();
        let mut batches = Vec::with_capacity(count as usize);
        for k in 0..count {
            let off = k * slice;
            let req = ResolvedRequest {
                index: 0,
                op: TransferOp::Write,
                len: slice,
                local_addr: self.region.base + off,
                local_region: self.region.id,
                remote_addr: self.remote_base + off,
                remote_buffer: 0,
            };
            let state = BatchState::new(vec![slice].into());
            let (peer, answers, from, order) = (self.peer.clone(), answers.clone(), self.name.clone(), order.clone());
            state.on_complete(Box::new(move |b| {
                if !b.succeeded() {
                    answers.cancel(k as usize);
                    return;
                }
                // Held across the hand-over, so the recorded order is the order of `notify` calls.
                let mut order = order.lock();
                order.push(k);
                let k = k as usize;
                let note = Notification {
                    from,
                    payload: format!("{off} {slice} {seed}").into_bytes(),
                };
                if let Err(e) = peer.notify(note, &answers, k) {
                    answers.fail(k, e);
                }
            }));
            self.peer
                .submit(vec![req], &state, &SubmitContext::default())
                .map_err(|e| e.to_string())?;
            batches.push(Batch::new(state));
        }
        for b in batches.iter().chain(std::iter::once(&Batch::new(answers))) {
            b.wait_blocking(Some(Duration::from_secs(60)))
                .ok_or("a notified write did not settle within 60 s")?
                .map_err(|e| e.to_string())?;
        }
        let order = order.lock().clone();
        Ok(order)
    }

    /// Fills the local buffer with pattern `seed`.
    pub fn fill(&self, seed: u64) {
        // SAFETY: as in zero_local.
        let s = unsafe { std::slice::from_raw_parts_mut(self.local.as_ptr(), self.local.len()) };
        pattern::fill(s, seed, 0);
    }

    /// Local bytes differing from pattern `seed` in the first `len` bytes.
    pub fn mismatches(&self, seed: u64, len: usize) -> u64 {
        pattern::mismatches(&self.local_bytes()[..len], seed, 0)
    }

    /// Shuts the transport down.
    pub fn close(self) {
        self.rt.block_on(self.transport.shutdown());
    }
}

/// `client <bytes> <seed>`: reads a descriptor line on stdin, writes pattern `seed` over the
/// target's first `bytes` in 1 MiB requests, zeroes the local buffer, reads it back and reports
/// `read_mismatched <n>` on stdout.
pub fn run(bytes: usize, seed: u64) -> Result<(), String> {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).map_err(|e| e.to_string())?;
    let client = Client::connect(&line, bytes)?;
    client.fill(seed);
    client.transfer(TransferOp::Write, 1 << 20, bytes as u64)?;
    client.zero_local();
    client.transfer(TransferOp::Read, 1 << 20, bytes as u64)?;
    println!("read_mismatched {}", client.mismatches(seed, bytes));
    client.close();
    Ok(())
}

/// `client-notify <bytes> <seed> <count>`: reads a descriptor line on stdin, writes pattern `seed`
/// over the target's first `bytes` in `count` notified batches (see [`Client::notified_writes`])
/// and reports `notified <count> from <name> order <k,...>` (the slices in the order their
/// notifications were handed over) once every notification was accepted.
pub fn run_notified(bytes: usize, seed: u64, count: u64) -> Result<(), String> {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).map_err(|e| e.to_string())?;
    let client = Client::connect(&line, bytes)?;
    client.fill(seed);
    let order = client.notified_writes(count, bytes as u64 / count.max(1), seed)?;
    let order: Vec<String> = order.iter().map(u64::to_string).collect();
    println!("notified {count} from {} order {}", client.name, order.join(","));
    client.close();
    Ok(())
}
