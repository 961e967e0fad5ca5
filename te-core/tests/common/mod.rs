//! A transport whose requests complete only when the test says so, to observe in-flight
//! behaviour deterministically. It really copies the bytes, in this process.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::Mutex;
use te_base::{
    BatchState, Capabilities, Error, MemoryKinds, Peer, RegionInfo, ResolvedRequest, Result, SegmentDescriptor,
    SubmitContext, TransferOp, Transport,
};

#[derive(Default)]
struct State {
    queued: Mutex<Vec<(ResolvedRequest, Arc<BatchState>)>>,
    fail: Mutex<BTreeSet<u32>>,
    regions: Mutex<BTreeSet<u64>>,
    /// Regions ever registered (one per region in every `register` call).
    registered_total: std::sync::atomic::AtomicU64,
    auto: AtomicBool,
    refuse: AtomicBool,
    /// Errors `Peer::abort` was called with, and a wake-up for whoever waits on the first.
    aborts: Mutex<Vec<Error>>,
    aborted: tokio::sync::Notify,
    /// Notifications handed to the transport, in order.
    notes: Mutex<Vec<te_base::Notification>>,
}

#[derive(Default)]
pub struct ManualTransport {
    state: Arc<State>,
}

struct ManualPeer {
    state: Arc<State>,
    desc: SegmentDescriptor,
}

impl ManualTransport {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    pub fn fail_index(&self, i: u32) {
        self.state.fail.lock().insert(i);
    }

    pub fn registered(&self) -> BTreeSet<u64> {
        self.state.regions.lock().clone()
    }

    /// Regions registered on this transport since it was made (deregistrations do not count).
    #[allow(dead_code)] // used by tests/registration_cache.rs; each test file compiles this module alone
    pub fn registered_total(&self) -> u64 {
        self.state.registered_total.load(Ordering::Acquire)
    }

    /// Completes every queued request (copying its bytes) or fails the marked ones.
    pub fn complete_all(&self) {
        self.state.complete_all();
    }

    /// Payloads of the notifications handed over so far, in order (each accepted at once).
    #[allow(dead_code)] // used by tests/notify.rs; each test file compiles this module alone
    pub fn notes(&self) -> Vec<Vec<u8>> {
        self.state.notes.lock().iter().map(|n| n.payload.clone()).collect()
    }

    /// From now on, `submit` refuses whole groups (starting nothing), as a transport may.
    pub fn refuse_submissions(&self) {
        self.state.refuse.store(true, Ordering::Release);
    }

    /// Waits until the engine asked a peer to abort, and returns the error it gave.
    pub async fn first_abort(&self) -> Error {
        loop {
            if let Some(e) = self.state.aborts.lock().first().cloned() {
                return e;
            }
            self.state.aborted.notified().await;
        }
    }

    /// Plays a transport that stopped touching the memory after an abort: fails every queued
    /// request with the abort's error.
    pub fn quiesce(&self) {
        let err = self.state.aborts.lock().first().cloned().expect("no abort to quiesce");
        for (r, batch) in std::mem::take(&mut *self.state.queued.lock()) {
            batch.fail(r.index as usize, err.clone());
        }
    }

    /// From now on, requests complete as they are submitted.
    pub fn complete_all_later(&self) {
        self.state.auto.store(true, Ordering::Release);
        self.state.complete_all();
    }
}

impl State {
    fn complete_all(&self) {
        let queued = std::mem::take(&mut *self.queued.lock());
        let fail = self.fail.lock().clone();
        for (r, batch) in queued {
            if fail.contains(&r.index) {
                batch.fail(r.index as usize, Error::transport("manual", "injected failure"));
                continue;
            }
            let (from, to) = match r.op {
                TransferOp::Write => (r.local_addr, r.remote_addr),
                TransferOp::Read => (r.remote_addr, r.local_addr),
            };
            // SAFETY: the engine validated both ranges against live registrations and pins them
            // until this request completes; both are host memory of this process.
            unsafe { std::ptr::copy(from as *const u8, to as *mut u8, r.len as usize) };
            batch.complete(r.index as usize);
        }
    }
}

#[async_trait]
impl Transport for ManualTransport {
    fn name(&self) -> &'static str {
        "manual"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            local: MemoryKinds::HOST,
            remote: MemoryKinds::HOST,
        }
    }
    fn endpoint(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
    fn can_reach(&self, _peer: &SegmentDescriptor) -> bool {
        true
    }
    async fn register(&self, regions: &[RegionInfo]) -> Result<Vec<serde_json::Value>> {
        self.state.regions.lock().extend(regions.iter().map(|r| r.base));
        self.state
            .registered_total
            .fetch_add(regions.len() as u64, Ordering::AcqRel);
        Ok(vec![serde_json::Value::Null; regions.len()])
    }
    async fn deregister(&self, regions: &[RegionInfo]) -> Result<()> {
        let mut set = self.state.regions.lock();
        for r in regions {
            set.remove(&r.base);
        }
        Ok(())
    }
    async fn connect(&self, peer: &SegmentDescriptor) -> Result<Arc<dyn Peer>> {
        Ok(Arc::new(ManualPeer {
            state: self.state.clone(),
            desc: peer.clone(),
        }))
    }
}

impl Peer for ManualPeer {
    fn descriptor(&self) -> &SegmentDescriptor {
        &self.desc
    }

    fn notify(&self, note: te_base::Notification, done: &Arc<BatchState>, index: usize) -> Result<()> {
        self.state.notes.lock().push(note);
        done.complete(index);
        Ok(())
    }
    fn submit(&self, requests: Vec<ResolvedRequest>, batch: &Arc<BatchState>, _ctx: &SubmitContext) -> Result<()> {
        if self.state.refuse.load(Ordering::Acquire) {
            return Err(Error::transport("manual", "refused the whole group"));
        }
        self.state
            .queued
            .lock()
            .extend(requests.into_iter().map(|r| (r, batch.clone())));
        if self.state.auto.load(Ordering::Acquire) {
            self.state.complete_all();
        }
        Ok(())
    }

    /// Records the abort; the requests stay queued until the test calls `quiesce`, as a real
    /// transport's stay in flight until it stopped touching their memory.
    fn abort(&self, err: Error) -> bool {
        self.state.aborts.lock().push(err);
        self.state.aborted.notify_one();
        true
    }
}

/// An engine with only the local transport, configured by `env`.
pub async fn local_engine(name: &str, env: &[(&str, &str)]) -> te_core::TransferEngine {
    let env = te_core::config::MapEnv(env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
    te_core::TransferEngine::builder()
        .segment_name(name)
        .transports(["local"])
        .env(Arc::new(env))
        .build()
        .await
        .expect("engine")
}

/// An engine whose only transport is the test's manual one (no variables from the process).
pub async fn manual_engine(name: &str, manual: &Arc<ManualTransport>) -> te_core::TransferEngine {
    te_core::TransferEngine::builder()
        .segment_name(name)
        .transports(Vec::<String>::new())
        .with_transport(manual.clone())
        .env(Arc::new(te_core::config::MapEnv::default()))
        .build()
        .await
        .expect("engine")
}
