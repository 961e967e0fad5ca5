//! Helpers shared by the efa transport's tests: provider checks that skip (or fail under
//! TE_REQUIRE=libfabric), pattern-filled registered buffers, descriptors and batches.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use te_base::config::MapEnv;
use te_base::{
    Batch, BatchError, BatchReport, BatchState, ExportedBuffer, HostBuffer, HostBufferOptions, InstallContext,
    MemoryLocation, Peer, RegionId, RegionInfo, ResolvedRequest, SegmentDescriptor, SubmitContext, TransferOp,
    Transport, TransportEndpoint,
};

#[path = "../../src/bin/te-efa-peer/pattern.rs"]
pub mod pattern;
pub mod peer_process;

/// The providers the suites run on.
pub const PROVIDERS: [&str; 2] = ["tcp;ofi_rxm", "shm"];

/// The providers the multi-provider tests loop over: the one the environment's
/// `TE_FABRIC_PROVIDER` names (a run on `verbs;ofi_rxm` or `efa`), else [`PROVIDERS`].
pub fn providers() -> Vec<&'static str> {
    match std::env::var("TE_FABRIC_PROVIDER") {
        // Leaked once per call: a test's provider name lives as long as the test binary.
        Ok(p) if !p.is_empty() => vec![Box::leak(p.into_boxed_str())],
        _ => PROVIDERS.to_vec(),
    }
}

pub use te_base::test_support::required;

/// True if `provider` is usable here; otherwise prints why the test is skipped, or panics when
/// TE_REQUIRE contains `libfabric`.
pub fn provider_present(provider: &str) -> bool {
    let found = te_transport_efa::available_providers();
    if found.iter().any(|f| f == provider) {
        return true;
    }
    let msg = format!("libfabric provider '{provider}' is not available here (found: {found:?})");
    if required("libfabric") {
        panic!("TE_REQUIRE contains libfabric but {msg}");
    }
    eprintln!("SKIP: {msg}");
    false
}

/// The environment of an install of `provider`: `TE_FABRIC_PROVIDER=provider`, then every other
/// `TE_FABRIC_*` variable of this process's environment (so `TE_FABRIC_DOMAINS=rxe1` restricts the
/// suite to one domain), then `extra` (a test's own settings win). When the environment's
/// `TE_FABRIC_PROVIDER` names another provider, its variables describe that provider and none is
/// applied.
pub fn install_env(provider: &str, extra: &[(&str, &str)]) -> MapEnv {
    let mut env = MapEnv::new([("TE_FABRIC_PROVIDER", provider)]);
    let applies = std::env::var("TE_FABRIC_PROVIDER").map_or(true, |p| p == provider);
    if applies {
        for (k, v) in std::env::vars() {
            if k.starts_with("TE_FABRIC_") && k != "TE_FABRIC_PROVIDER" {
                env.0.insert(k, v);
            }
        }
    }
    for (k, v) in extra {
        env.0.insert(k.to_string(), v.to_string());
    }
    env
}

/// Installs the transport with `provider` and extra variables (see [`install_env`]).
pub fn install(provider: &str, extra: &[(&str, &str)]) -> Arc<dyn Transport> {
    install_into(provider, extra, te_base::NotifyInbox::new(Default::default()), None)
}

/// As [`install`], delivering received notifications into `inbox`, with the engine key `auth`.
pub fn install_into(
    provider: &str,
    extra: &[(&str, &str)],
    inbox: Arc<te_base::NotifyInbox>,
    auth: Option<te_base::auth::AuthKey>,
) -> Arc<dyn Transport> {
    let ctx = InstallContext {
        auth,
        env: Arc::new(install_env(provider, extra)),
        segment_name: "test".into(),
        devices: Vec::new(),
        notifications: inbox,
    };
    block_on(te_transport_efa::install(&ctx)).unwrap_or_else(|e| panic!("install {provider}: {e}"))
}

/// Runs a future to completion on a small runtime.
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// A registered host buffer.
pub struct Side {
    pub buf: HostBuffer,
    pub region: RegionInfo,
    pub keys: serde_json::Value,
}

impl Side {
    /// Allocates `len` bytes filled with pattern `seed` and registers them on `t`.
    pub fn new(t: &Arc<dyn Transport>, id: u64, len: usize, exported: bool, seed: u64) -> Side {
        let buf = HostBuffer::allocate(len, HostBufferOptions::default()).unwrap();
        Side::from_buffer(t, buf, id, exported, seed)
    }

    /// Fills and registers an existing buffer.
    pub fn from_buffer(t: &Arc<dyn Transport>, buf: HostBuffer, id: u64, exported: bool, seed: u64) -> Side {
        let len = buf.len();
        Side::fill_buffer(&buf, seed);
        let region = RegionInfo {
            id: RegionId(id),
            base: buf.addr(),
            len: len as u64,
            location: MemoryLocation::HOST,
            exported,
        };
        let keys = block_on(t.register(std::slice::from_ref(&region))).unwrap().remove(0);
        Side { buf, region, keys }
    }

    /// Refills the buffer with pattern `seed` (between transfers).
    pub fn fill_pattern(&self, seed: u64) {
        Side::fill_buffer(&self.buf, seed);
    }

    fn fill_buffer(buf: &HostBuffer, seed: u64) {
        // SAFETY: test buffers are only touched by the test thread and by transfers the test waits
        // for before looking again; no shared slice of it is alive here.
        let s = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), buf.len()) };
        pattern::fill(s, seed, 0);
    }

    /// The bytes (read only after the transfers touching them completed).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: as in fill_buffer.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr(), self.buf.len()) }
    }

    /// Zeroes the buffer (between transfers).
    pub fn zero(&self) {
        // SAFETY: as in fill_buffer.
        unsafe { std::ptr::write_bytes(self.buf.as_ptr(), 0, self.buf.len()) };
    }

    pub fn addr(&self) -> u64 {
        self.buf.addr()
    }
}

/// A descriptor exporting `sides` of transport `t`.
pub fn descriptor(name: &str, t: &Arc<dyn Transport>, sides: &[&Side]) -> SegmentDescriptor {
    let mut d = SegmentDescriptor::new(name, 1);
    d.transports.push(TransportEndpoint {
        transport: t.name().into(),
        info: t.endpoint(),
    });
    let mut sorted: Vec<&&Side> = sides.iter().collect();
    sorted.sort_by_key(|s| s.addr());
    for s in sorted {
        d.buffers.push(ExportedBuffer {
            base: s.addr(),
            len: s.region.len,
            location: MemoryLocation::HOST,
            keys: [(t.name().to_string(), s.keys.clone())].into_iter().collect(),
        });
    }
    d
}

/// One request from `local` (at `local_off`) to the peer's buffer `buffer` at `remote_addr`.
pub fn request(
    index: u32,
    op: TransferOp,
    local: &Side,
    local_off: u64,
    buffer: u32,
    remote_addr: u64,
    len: u64,
) -> ResolvedRequest {
    ResolvedRequest {
        index,
        op,
        len,
        local_addr: local.addr() + local_off,
        local_region: local.region.id,
        remote_addr,
        remote_buffer: buffer,
    }
}

/// Submits `reqs` as one batch and returns its handle.
pub fn submit(peer: &Arc<dyn Peer>, reqs: Vec<ResolvedRequest>) -> Batch {
    let mut lens = vec![0u64; reqs.len()];
    for r in &reqs {
        lens[r.index as usize] = r.len;
    }
    let state = BatchState::new(lens.into());
    peer.submit(reqs, &state, &SubmitContext::default()).expect("submit");
    Batch::new(state)
}

/// Submits and waits (at most 60 s, so a hang fails instead of blocking CI).
pub fn run(peer: &Arc<dyn Peer>, reqs: Vec<ResolvedRequest>) -> Result<BatchReport, BatchError> {
    submit(peer, reqs)
        .wait_blocking(Some(Duration::from_secs(60)))
        .expect("batch did not settle within 60 s")
}
