//! The `te-shm-peer` child process and the initiator-side helpers of the multi-process tests.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use te_base::config::MapEnv;
use te_base::{
    Batch, BatchState, HostBuffer, HostBufferOptions, MemoryLocation, Peer, RegionId, RegionInfo, RequestStatus,
    ResolvedRequest, SegmentDescriptor, SubmitContext, TransferOp, Transport,
};
use te_transport_shm::{ShmConfig, ShmTransport};

/// Hang guard of every wait: generous, never what a test measures.
pub const HANG_GUARD: Duration = Duration::from_secs(120);

/// A `te-shm-peer serve` child exporting one pattern-filled buffer.
pub struct PeerProcess {
    pub child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub descriptor: SegmentDescriptor,
}

impl PeerProcess {
    /// Starts the peer with `bytes` of pattern `seed` and extra environment `env`.
    pub fn start(bytes: u64, seed: u64, env: &[(&str, &str)]) -> PeerProcess {
        PeerProcess::start_with(bytes, seed, env, |_| {})
    }

    /// As [`PeerProcess::start`], with a hook to adjust the command (e.g. run it as another uid).
    pub fn start_with(bytes: u64, seed: u64, env: &[(&str, &str)], adjust: impl FnOnce(&mut Command)) -> PeerProcess {
        PeerProcess::start_program(env!("CARGO_BIN_EXE_te-shm-peer").as_ref(), bytes, seed, env, adjust)
    }

    /// As [`PeerProcess::start_with`], running the peer binary at `program` (a copy another uid
    /// can reach when the build directory is private).
    pub fn start_program(
        program: &std::path::Path,
        bytes: u64,
        seed: u64,
        env: &[(&str, &str)],
        adjust: impl FnOnce(&mut Command),
    ) -> PeerProcess {
        let mut cmd = Command::new(program);
        // Cross-memory attach unless a test asks for the memfd path (TE_SHM_MEMFD=1).
        cmd.args(["serve", &bytes.to_string(), &seed.to_string()])
            .env("TE_SHM_MEMFD", "0")
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        adjust(&mut cmd);
        let mut child = cmd.spawn().expect("start te-shm-peer");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert!(
            !line.trim().is_empty(),
            "te-shm-peer exited before publishing its descriptor"
        );
        let descriptor = SegmentDescriptor::from_json(line.trim().as_bytes()).expect("peer descriptor");
        PeerProcess {
            child,
            stdin,
            stdout,
            descriptor,
        }
    }

    /// Sends one command and returns its answer line.
    pub fn ask(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim().to_string()
    }

    /// Bytes of `[off, off + len)` that differ from pattern `seed` (positions from the buffer start).
    pub fn mismatched(&mut self, off: u64, len: u64, seed: u64) -> u64 {
        self.ask(&format!("check {off} {len} {seed}")).parse().expect("a count")
    }

    /// Bytes of `[off, off + len)` that differ from pattern `seed` at positions `first..`.
    pub fn mismatched_from(&mut self, off: u64, len: u64, seed: u64, first: u64) -> u64 {
        self.ask(&format!("check {off} {len} {seed} {first}"))
            .parse()
            .expect("a count")
    }

    /// Start of the exported buffer in the peer's address space.
    pub fn base(&self) -> u64 {
        self.descriptor.buffers[0].base
    }

    /// Kills the process and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// An initiator transport with settings `env`.
pub fn initiator(env: &[(&str, &str)]) -> Arc<dyn Transport> {
    shm_initiator(env)
}

/// An initiator transport with settings `env`, as its concrete type (route counters).
pub fn shm_initiator(env: &[(&str, &str)]) -> Arc<ShmTransport> {
    let mut map = MapEnv::default();
    for (k, v) in env {
        map.0.insert(k.to_string(), v.to_string());
    }
    let config = ShmConfig::from_env(&map).unwrap();
    let inbox = te_base::NotifyInbox::new(te_base::NotifyLimits::default());
    Arc::new(ShmTransport::start(config, None, inbox).unwrap())
}

/// A registered local buffer filled with pattern `seed`.
pub struct Local {
    pub buf: HostBuffer,
    pub info: RegionInfo,
}

impl Local {
    pub fn new(t: &Arc<dyn Transport>, id: u64, len: usize, seed: u64) -> Local {
        let buf = HostBuffer::allocate(len, HostBufferOptions::default()).unwrap();
        // SAFETY: the buffer is live, `len` long, and no transfer runs yet.
        te_base::pattern::fill_pattern(unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), len) }, seed, 0);
        let info = RegionInfo {
            id: RegionId(id),
            base: buf.addr(),
            len: len as u64,
            location: MemoryLocation::HOST,
            exported: false,
        };
        block_on(t.register(std::slice::from_ref(&info))).unwrap();
        Local { buf, info }
    }

    /// Bytes of `[off, off + len)` that differ from pattern `seed` at positions `first..`.
    pub fn mismatched(&self, off: u64, len: u64, seed: u64, first: u64) -> usize {
        // SAFETY: read after the batches writing it completed.
        let s = unsafe { std::slice::from_raw_parts(self.buf.as_ptr().add(off as usize), len as usize) };
        s.iter()
            .enumerate()
            .filter(|(i, b)| **b != te_base::pattern::pattern(seed, first + *i as u64))
            .count()
    }
}

/// A request of `op` between `local[loff..]` and the peer's `remote` address.
pub fn request(index: u32, op: TransferOp, local: &Local, loff: u64, remote: u64, len: u64) -> ResolvedRequest {
    ResolvedRequest {
        index,
        op,
        len,
        local_addr: local.info.base + loff,
        local_region: local.info.id,
        remote_addr: remote,
        remote_buffer: 0,
    }
}

/// Submits `reqs` and returns the batch (not waited for).
pub fn submit(peer: &Arc<dyn Peer>, reqs: Vec<ResolvedRequest>) -> Batch {
    let state = BatchState::new(reqs.iter().map(|r| r.len).collect());
    let batch = Batch::new(state.clone());
    let indices: Vec<usize> = reqs.iter().map(|r| r.index as usize).collect();
    if let Err(e) = peer.submit(reqs, &state, &SubmitContext::default()) {
        state.fail_many(indices, &e);
    }
    batch
}

/// Submits and waits (hang guard only); each request's status.
pub fn run(peer: &Arc<dyn Peer>, reqs: Vec<ResolvedRequest>) -> Vec<RequestStatus> {
    let n = reqs.len();
    let batch = submit(peer, reqs);
    // Failed requests are reported per request below, not as the batch error.
    let _ = batch.wait_blocking(Some(HANG_GUARD)).expect("batch settles");
    (0..n).map(|i| batch.status(i).unwrap()).collect()
}

pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

pub fn all_done(statuses: &[RequestStatus]) -> bool {
    statuses.iter().all(|s| matches!(s, RequestStatus::Done { .. }))
}
