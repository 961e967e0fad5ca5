//! The transport conformance suite: one set of checks every transport runs (object_store's
//! `integration.rs` shape). Each check takes a [`ConformancePair`] — an initiator and a target
//! transport instance in this process, so the suite can verify the target's memory byte for byte —
//! and panics with a message naming what broke.
//!
//! ```ignore
//! #[tokio::test]
//! async fn conformance() {
//!     let pair = ConformancePair { initiator: make().await, target: make().await, target_name: "t".into() };
//!     te_base::conformance::run_all(&pair, &ConformanceOptions::default()).await;
//! }
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::batch::{Batch, BatchState, RequestStatus};
use crate::error::Error;
use crate::host_buffer::{HostBuffer, HostBufferOptions};
use crate::memory::{MemoryLocation, RegionId, RegionInfo};
use crate::request::{ResolvedRequest, TransferOp};
use crate::segment::{ExportedBuffer, SegmentDescriptor, TransportEndpoint};
use crate::transport::{Peer, SubmitContext, Transport};

pub mod notify;

/// Two instances of the transport under test.
pub struct ConformancePair {
    /// Submits requests.
    pub initiator: Arc<dyn Transport>,
    /// Serves them (in this process, so its memory can be checked).
    pub target: Arc<dyn Transport>,
    /// Segment name given to the target's descriptor.
    pub target_name: String,
}

/// Differences between transports, passed as flags.
#[derive(Debug, Clone)]
pub struct ConformanceOptions {
    /// Largest single transfer to try (64 MiB by default).
    pub max_bytes: u64,
    /// Requests in the large batch (10,000 by default).
    pub batch_requests: usize,
    /// Batches in flight at once in the concurrency check.
    pub concurrent_batches: usize,
    /// How long any one batch may take before the check fails.
    pub timeout: Duration,
    /// How the transport reports a request the target refuses after the initiator's own checks
    /// passed (a region deregistered under a descriptor the initiator still holds).
    pub target_refusal: TargetRefusal,
}

/// How a transport reports a request its target refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetRefusal {
    /// [`Error::Refused`] or [`Error::OutOfBounds`], named by our own target.
    Typed,
    /// [`Error::Transport`] whose source is the native library's [`crate::NativeError`] (the
    /// provider checked the key; libfabric providers).
    ProviderError,
    /// The provider drops the request unanswered; the transport's stall timeout reports
    /// [`Error::PeerGone`] (libfabric shm 1.x).
    Stall,
}

impl TargetRefusal {
    /// True when `e` is the report this transport gives.
    pub fn matches(self, e: &Error) -> bool {
        match self {
            TargetRefusal::Typed => matches!(e, Error::Refused { .. } | Error::OutOfBounds { .. }),
            TargetRefusal::ProviderError => matches!(
                e,
                Error::Transport { source: Some(s), .. } if s.downcast_ref::<crate::NativeError>().is_some()
            ),
            TargetRefusal::Stall => matches!(e, Error::PeerGone { .. }),
        }
    }
}

impl Default for ConformanceOptions {
    fn default() -> Self {
        ConformanceOptions {
            max_bytes: 64 << 20,
            batch_requests: 10_000,
            concurrent_batches: 4,
            timeout: Duration::from_secs(120),
            target_refusal: TargetRefusal::Typed,
        }
    }
}

/// Runs every check in turn.
pub async fn run_all(pair: &ConformancePair, opts: &ConformanceOptions) {
    checked(pair, "write_read_sizes", write_read_sizes(pair, opts)).await;
    checked(pair, "unaligned_offsets", unaligned_offsets(pair, opts)).await;
    checked(pair, "large_batch", large_batch(pair, opts)).await;
    checked(pair, "concurrent_batches", concurrent_batches(pair, opts)).await;
    checked(
        pair,
        "hostile_requests_fail_alone",
        hostile_requests_fail_alone(pair, opts),
    )
    .await;
    checked(
        pair,
        "deregistered_target_is_refused",
        deregistered_target_is_refused(pair, opts),
    )
    .await;
}

/// Runs one check and says on stderr that it passed and how long it took, so a log run with
/// `--nocapture` (the rdma VM runner's) lists the checks that ran, not only the one test holding them.
pub async fn checked<F: std::future::Future<Output = ()>>(pair: &ConformancePair, name: &str, check: F) {
    let started = std::time::Instant::now();
    check.await;
    eprintln!(
        "conformance ({}): {name} ok in {:.1} s",
        pair.initiator.name(),
        started.elapsed().as_secs_f64()
    );
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1 << 40);

/// A registered buffer of the suite.
pub struct TestRegion {
    /// The memory.
    pub buf: HostBuffer,
    /// As registered.
    pub info: RegionInfo,
}

impl TestRegion {
    /// The bytes (the suite only reads them after the batches touching them completed).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the buffer is live and `len` bytes long; callers read only after completion.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr(), self.buf.len()) }
    }

    /// Fills the region with `pattern(seed, i)`.
    pub fn fill(&self, seed: u64) {
        // SAFETY: as in `bytes`, and no transfer touches the region while it is being filled.
        let s = unsafe { std::slice::from_raw_parts_mut(self.buf.as_ptr(), self.buf.len()) };
        crate::pattern::fill_pattern(s, seed, 0);
    }
}

pub use crate::pattern::pattern;

/// Allocates and registers `len` bytes on `t`.
pub async fn region(t: &Arc<dyn Transport>, len: usize, exported: bool) -> (TestRegion, serde_json::Value) {
    let buf = HostBuffer::allocate(len, HostBufferOptions::default()).expect("allocate test buffer");
    let info = RegionInfo {
        id: RegionId(NEXT_ID.fetch_add(1, Ordering::Relaxed)),
        base: buf.addr(),
        len: len as u64,
        location: MemoryLocation::HOST,
        exported,
    };
    let keys = t
        .register(std::slice::from_ref(&info))
        .await
        .expect("register test region");
    assert_eq!(keys.len(), 1, "{}: register must return one key per region", t.name());
    (TestRegion { buf, info }, keys.into_iter().next().unwrap_or_default())
}

/// Deregisters the suite's regions before their memory is freed, so a later check that gets the
/// same addresses back registers them cleanly. Best effort: a transport may still hold a refused
/// request of the hostile check in flight (libfabric's shm provider never reports some refusals
/// back), and refusing deregistration then is correct behaviour, not a conformance failure.
pub async fn release(t: &Arc<dyn Transport>, regions: &[&TestRegion]) {
    let infos: Vec<RegionInfo> = regions.iter().map(|r| r.info.clone()).collect();
    if let Err(e) = t.deregister(&infos).await {
        eprintln!("{}: conformance regions not released: {e}", t.name());
    }
}

/// Builds the target's descriptor with the given exported regions.
pub fn descriptor(pair: &ConformancePair, exported: &[(&TestRegion, &serde_json::Value)]) -> SegmentDescriptor {
    let mut d = SegmentDescriptor::new(pair.target_name.clone(), NEXT_ID.fetch_add(1, Ordering::Relaxed));
    d.transports.push(TransportEndpoint {
        transport: pair.target.name().to_string(),
        info: pair.target.endpoint(),
    });
    let mut bufs: Vec<ExportedBuffer> = exported
        .iter()
        .map(|(r, k)| ExportedBuffer {
            base: r.info.base,
            len: r.info.len,
            location: r.info.location,
            keys: if k.is_null() {
                Default::default()
            } else {
                [(pair.target.name().to_string(), (*k).clone())].into_iter().collect()
            },
        })
        .collect();
    bufs.sort_by_key(|b| b.base);
    d.buffers = bufs;
    d.validate().expect("suite built a valid descriptor");
    d
}

/// Connects the initiator to the target's descriptor holding `exported`.
pub async fn connect(pair: &ConformancePair, exported: &[(&TestRegion, &serde_json::Value)]) -> Arc<dyn Peer> {
    pair.initiator
        .connect(&descriptor(pair, exported))
        .await
        .expect("connect")
}

/// Submits and waits; returns the per-request statuses.
pub async fn run_batch(
    peer: &Arc<dyn Peer>,
    reqs: Vec<ResolvedRequest>,
    opts: &ConformanceOptions,
) -> Vec<RequestStatus> {
    let n = reqs.len();
    let state = BatchState::new(reqs.iter().map(|r| r.len).collect());
    let batch = Batch::new(state.clone());
    let indices: Vec<usize> = reqs.iter().map(|r| r.index as usize).collect();
    if let Err(e) = peer.submit(reqs, &state, &SubmitContext::default()) {
        state.fail_many(indices, &e);
    }
    let waited = tokio::time::timeout(opts.timeout, batch.wait()).await;
    assert!(
        waited.is_ok(),
        "batch of {n} requests did not complete within {:?}",
        opts.timeout
    );
    (0..n).map(|i| batch.status(i).expect("status in range")).collect()
}

#[allow(clippy::too_many_arguments)]
fn req(
    index: usize,
    op: TransferOp,
    local: &TestRegion,
    loff: u64,
    remote: &TestRegion,
    rbuf: u32,
    roff: u64,
    len: u64,
) -> ResolvedRequest {
    ResolvedRequest {
        index: index as u32,
        op,
        len,
        local_addr: local.info.base + loff,
        local_region: local.info.id,
        remote_addr: remote.info.base + roff,
        remote_buffer: rbuf,
    }
}

fn assert_all_done(statuses: &[RequestStatus], what: &str) {
    for (i, s) in statuses.iter().enumerate() {
        assert!(
            matches!(s, RequestStatus::Done { .. }),
            "{what}: request {i} did not complete: {s:?}"
        );
    }
}

fn first_mismatch(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// Writes then reads back single transfers from 1 B to `max_bytes`, verifying every byte.
pub async fn write_read_sizes(pair: &ConformancePair, opts: &ConformanceOptions) {
    let max = opts.max_bytes as usize;
    let (src, _) = region(&pair.initiator, max + 64, false).await;
    let (back, _) = region(&pair.initiator, max + 64, false).await;
    let (dst, dkey) = region(&pair.target, max + 64, true).await;
    let peer = connect(pair, &[(&dst, &dkey)]).await;
    src.fill(1);
    let mut len = 1usize;
    let mut sizes = vec![];
    while len <= max {
        sizes.push(len);
        if len > 1 {
            sizes.push(len - 1);
            sizes.push(len + 1);
        }
        len *= 4;
    }
    sizes.push(max);
    sizes.retain(|&s| s <= max);
    sizes.sort_unstable();
    sizes.dedup();
    for &n in &sizes {
        let off = (n % 61) as u64;
        let w = run_batch(
            &peer,
            vec![req(0, TransferOp::Write, &src, 3, &dst, 0, off, n as u64)],
            opts,
        )
        .await;
        assert_all_done(&w, &format!("{}: write of {n} B", pair.initiator.name()));
        let got = &dst.bytes()[off as usize..off as usize + n];
        if let Some(p) = first_mismatch(got, &src.bytes()[3..3 + n]) {
            panic!(
                "{}: write of {n} B: byte {p} differs at the target",
                pair.initiator.name()
            );
        }
        let r = run_batch(
            &peer,
            vec![req(0, TransferOp::Read, &back, 5, &dst, 0, off, n as u64)],
            opts,
        )
        .await;
        assert_all_done(&r, &format!("{}: read of {n} B", pair.initiator.name()));
        if let Some(p) = first_mismatch(&back.bytes()[5..5 + n], got) {
            panic!("{}: read of {n} B: byte {p} differs", pair.initiator.name());
        }
    }
    release(&pair.initiator, &[&src, &back]).await;
    release(&pair.target, &[&dst]).await;
}

/// Transfers at odd offsets on both sides, next to bytes that must stay untouched.
pub async fn unaligned_offsets(pair: &ConformancePair, opts: &ConformanceOptions) {
    let (src, _) = region(&pair.initiator, 1 << 16, false).await;
    let (dst, dkey) = region(&pair.target, 1 << 16, true).await;
    let peer = connect(pair, &[(&dst, &dkey)]).await;
    src.fill(2);
    dst.fill(3);
    let before = dst.bytes().to_vec();
    let cases = [
        (1u64, 7u64, 1u64),
        (3, 4093, 5),
        (4095, 1, 4097),
        (17, 33, 1000),
        (0, 65535, 1),
    ];
    for (i, &(loff, roff, len)) in cases.iter().enumerate() {
        let w = run_batch(
            &peer,
            vec![req(0, TransferOp::Write, &src, loff, &dst, 0, roff, len)],
            opts,
        )
        .await;
        assert_all_done(&w, &format!("unaligned case {i}"));
    }
    let mut expect = before;
    for &(loff, roff, len) in &cases {
        expect[roff as usize..(roff + len) as usize]
            .copy_from_slice(&src.bytes()[loff as usize..(loff + len) as usize]);
    }
    if let Some(p) = first_mismatch(dst.bytes(), &expect) {
        panic!(
            "{}: unaligned writes: target byte {p} is wrong (neighbours must stay untouched)",
            pair.initiator.name()
        );
    }
    release(&pair.initiator, &[&src]).await;
    release(&pair.target, &[&dst]).await;
}

/// One batch of `batch_requests` scattered fragments of mixed sizes, written and read back.
pub async fn large_batch(pair: &ConformancePair, opts: &ConformanceOptions) {
    let n = opts.batch_requests;
    let sizes = [1728u64, 1, 64, 4096, 8448, 100];
    let total: u64 = (0..n).map(|i| sizes[i % sizes.len()]).sum();
    let (src, _) = region(&pair.initiator, total as usize, false).await;
    let (back, _) = region(&pair.initiator, total as usize, false).await;
    let (dst, dkey) = region(&pair.target, total as usize, true).await;
    let peer = connect(pair, &[(&dst, &dkey)]).await;
    src.fill(4);
    let mut offs = Vec::with_capacity(n);
    let mut o = 0;
    for i in 0..n {
        offs.push((o, sizes[i % sizes.len()]));
        o += sizes[i % sizes.len()];
    }
    let mut writes = Vec::with_capacity(n);
    let mut reads = Vec::with_capacity(n);
    for &(off, len) in &offs {
        writes.push(req(writes.len(), TransferOp::Write, &src, off, &dst, 0, off, len));
        reads.push(req(reads.len(), TransferOp::Read, &back, off, &dst, 0, off, len));
    }
    // Submit in a permuted order to defeat trivially sequential handling.
    let perm = |v: &mut Vec<ResolvedRequest>| {
        let len = v.len();
        for i in 0..len {
            v.swap(i, (i * 7919 + 13) % len);
        }
        for (k, r) in v.iter_mut().enumerate() {
            r.index = k as u32;
        }
    };
    perm(&mut writes);
    perm(&mut reads);
    assert_all_done(&run_batch(&peer, writes, opts).await, "large batch writes");
    if let Some(p) = first_mismatch(dst.bytes(), src.bytes()) {
        panic!("{}: large batch: target byte {p} wrong", pair.initiator.name());
    }
    assert_all_done(&run_batch(&peer, reads, opts).await, "large batch reads");
    if let Some(p) = first_mismatch(back.bytes(), src.bytes()) {
        panic!("{}: large batch read-back: byte {p} wrong", pair.initiator.name());
    }
    release(&pair.initiator, &[&src, &back]).await;
    release(&pair.target, &[&dst]).await;
}

/// Several batches in flight at once on disjoint ranges.
pub async fn concurrent_batches(pair: &ConformancePair, opts: &ConformanceOptions) {
    let k = opts.concurrent_batches.max(2);
    let chunk = 1u64 << 20;
    let (src, _) = region(&pair.initiator, (chunk * k as u64) as usize, false).await;
    let (dst, dkey) = region(&pair.target, (chunk * k as u64) as usize, true).await;
    let peer = connect(pair, &[(&dst, &dkey)]).await;
    src.fill(5);
    let mut batches = Vec::new();
    for b in 0..k as u64 {
        let reqs: Vec<ResolvedRequest> = (0..64u64)
            .map(|i| {
                let off = b * chunk + i * (chunk / 64);
                req(i as usize, TransferOp::Write, &src, off, &dst, 0, off, chunk / 64)
            })
            .collect();
        let state = BatchState::new(reqs.iter().map(|r| r.len).collect());
        peer.submit(reqs, &state, &SubmitContext::default()).expect("submit");
        batches.push(Batch::new(state));
    }
    for (i, b) in batches.iter().enumerate() {
        let r = tokio::time::timeout(opts.timeout, b.wait())
            .await
            .expect("concurrent batch timed out");
        assert!(r.is_ok(), "concurrent batch {i} failed: {r:?}");
    }
    if let Some(p) = first_mismatch(dst.bytes(), src.bytes()) {
        panic!("{}: concurrent batches: target byte {p} wrong", pair.initiator.name());
    }
    release(&pair.initiator, &[&src]).await;
    release(&pair.target, &[&dst]).await;
}

/// Forged requests (outside the exported buffer, into unexported memory, a bad buffer index,
/// an unknown local region) fail on their own; the good request of the same batch completes and
/// memory outside what was exported is never touched.
pub async fn hostile_requests_fail_alone(pair: &ConformancePair, opts: &ConformanceOptions) {
    let (src, _) = region(&pair.initiator, 1 << 16, false).await;
    let (dst, dkey) = region(&pair.target, 1 << 16, true).await;
    let (secret, _) = region(&pair.target, 1 << 16, false).await;
    secret.fill(9);
    let secret_before = secret.bytes().to_vec();
    let peer = connect(pair, &[(&dst, &dkey)]).await;
    src.fill(6);
    let good = req(0, TransferOp::Write, &src, 0, &dst, 0, 0, 4096);
    let past_end = req(1, TransferOp::Write, &src, 0, &dst, 0, (1 << 16) - 100, 4096);
    let mut into_secret = req(2, TransferOp::Write, &src, 0, &dst, 0, 0, 4096);
    into_secret.remote_addr = secret.info.base;
    let mut bad_index = req(3, TransferOp::Write, &src, 0, &dst, 0, 0, 16);
    bad_index.remote_buffer = 77;
    let mut bad_local = req(4, TransferOp::Write, &src, 0, &dst, 0, 8192, 16);
    bad_local.local_region = RegionId(u64::MAX);
    let mut read_secret = req(5, TransferOp::Read, &src, 0, &dst, 0, 0, 64);
    read_secret.remote_addr = secret.info.base;
    let statuses = run_batch(
        &peer,
        vec![good, past_end, into_secret, bad_index, bad_local, read_secret],
        opts,
    )
    .await;
    assert!(
        matches!(statuses[0], RequestStatus::Done { .. }),
        "the good request must complete: {:?}",
        statuses[0]
    );
    // A remote range outside what the target exported is refused as out of bounds, by the
    // initiator's own check or by the target; an unknown local region as unregistered memory.
    let remote_refusal = |e: &Error| matches!(e, Error::OutOfBounds { .. } | Error::Refused { .. });
    let local_refusal = |e: &Error| matches!(e, Error::Unregistered { .. } | Error::PartlyRegistered { .. });
    for (i, what, expected) in [
        (1, "past the end", &remote_refusal as &dyn Fn(&Error) -> bool),
        (2, "into unexported memory", &remote_refusal),
        (3, "bad buffer index", &remote_refusal),
        (4, "unknown local region", &local_refusal),
        (5, "reading unexported memory", &remote_refusal),
    ] {
        assert!(
            matches!(&statuses[i], RequestStatus::Failed(e) if expected(e)),
            "{}: request {what} must fail with the right error, got {:?}",
            pair.initiator.name(),
            statuses[i]
        );
    }
    assert_eq!(
        secret.bytes(),
        &secret_before[..],
        "unexported target memory was modified"
    );
    assert_eq!(&dst.bytes()[..4096], &src.bytes()[..4096], "good request's bytes");
    // Nothing of the past-the-end write may land in the exported buffer either.
    assert!(
        dst.bytes()[(1 << 16) - 100..].iter().all(|&b| b == 0),
        "partial write of a refused request"
    );
    release(&pair.initiator, &[&src]).await;
    release(&pair.target, &[&dst, &secret]).await;
}

/// After the target deregisters a region, a write to it is refused and not one byte of it changes
/// (checked on the bytes, then on the status): deregistration revokes remote access before it
/// returns, whatever registration cache the transport's library keeps.
pub async fn deregistered_target_is_refused(pair: &ConformancePair, opts: &ConformanceOptions) {
    let (src, _) = region(&pair.initiator, 1 << 16, false).await;
    let (dst, dkey) = region(&pair.target, 1 << 16, true).await;
    // Different patterns on both sides, so a write that lands shows in every byte it touched.
    src.fill(DEREGISTERED_SRC_SEED);
    dst.fill(DEREGISTERED_DST_SEED);
    let peer = connect(pair, &[(&dst, &dkey)]).await;
    pair.target
        .deregister(std::slice::from_ref(&dst.info))
        .await
        .expect("deregister");
    let statuses = run_batch(&peer, vec![req(0, TransferOp::Write, &src, 0, &dst, 0, 0, 4096)], opts).await;
    // The bytes first: a refused status over memory that was written anyway (a registration cache
    // keeping the key alive) must fail on what landed, not only on what was reported.
    let landed = deregistered_bytes_changed(&dst);
    let refused = matches!(&statuses[0], RequestStatus::Failed(e) if opts.target_refusal.matches(e));
    assert!(
        landed == 0,
        "{}: deregistered memory was written: {landed} of 4096 bytes changed (status {:?})",
        pair.initiator.name(),
        statuses[0]
    );
    // The initiator's descriptor still lists the region, so only the target can refuse it, and
    // the report must be the one the transport documents (`opts.target_refusal`).
    assert!(
        refused,
        "{}: write to a deregistered region must be refused as {:?}, got {:?}",
        pair.initiator.name(),
        opts.target_refusal,
        statuses[0]
    );
    release(&pair.initiator, &[&src]).await;
}

/// Pattern seeds of [`deregistered_target_is_refused`]'s source and (deregistered) target.
pub const DEREGISTERED_SRC_SEED: u64 = 0xdead;
/// See [`DEREGISTERED_SRC_SEED`].
pub const DEREGISTERED_DST_SEED: u64 = 0xbeef;

/// How many bytes of a region filled with [`DEREGISTERED_DST_SEED`] no longer hold it (after a
/// write into it was attempted while it was deregistered).
pub fn deregistered_bytes_changed(dst: &TestRegion) -> usize {
    dst.bytes()
        .iter()
        .enumerate()
        .filter(|&(i, &b)| b != pattern(DEREGISTERED_DST_SEED, i as u64))
        .count()
}
