//! Transport-level behaviour of the local copy: two instances in one process moving bytes, forged
//! requests failing alone, concurrency, large batches, overlapping requests, and the control plane.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use te_base::config::MapEnv;
use te_base::{
    Batch, BatchState, Error, ExportedBuffer, HostBuffer, HostBufferOptions, InstallContext, MemoryLocation, Peer,
    Phase, PhaseStats, PhaseTimer, RegionId, RegionInfo, RequestStatus, ResolvedRequest, SegmentDescriptor,
    SubmitContext, TransferOp, Transport, TransportEndpoint,
};
use te_transport_local::{LocalConfig, LocalTransport, NtKernel};

static NEXT_REGION: AtomicU64 = AtomicU64::new(1);

/// A registered host buffer.
struct Buf {
    mem: HostBuffer,
    info: RegionInfo,
}

impl Buf {
    async fn new(t: &LocalTransport, len: usize, exported: bool) -> Buf {
        let mem = HostBuffer::allocate(len, HostBufferOptions::default()).unwrap();
        let info = RegionInfo {
            id: RegionId(NEXT_REGION.fetch_add(1, Ordering::Relaxed)),
            base: mem.addr(),
            len: len as u64,
            location: MemoryLocation::HOST,
            exported,
        };
        let keys = t.register(std::slice::from_ref(&info)).await.unwrap();
        assert_eq!(keys, vec![serde_json::Value::Null]);
        Buf { mem, info }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: read only while no batch touching the buffer is running.
        unsafe { std::slice::from_raw_parts(self.mem.as_ptr(), self.mem.len()) }
    }

    fn fill(&self, seed: u8) {
        // SAFETY: written only while no batch touching the buffer is running.
        let s = unsafe { std::slice::from_raw_parts_mut(self.mem.as_ptr(), self.mem.len()) };
        te_base::pattern::fill_pattern(s, seed as u64, 0);
    }

    fn exported(&self) -> ExportedBuffer {
        ExportedBuffer::of_region(&self.info)
    }
}

fn transport(config: LocalConfig) -> LocalTransport {
    LocalTransport::new(config).unwrap()
}

fn descriptor(name: &str, t: &LocalTransport, exported: &[&Buf]) -> SegmentDescriptor {
    let mut d = SegmentDescriptor::new(name, 1);
    d.transports.push(TransportEndpoint {
        transport: "local".into(),
        info: t.endpoint(),
    });
    d.buffers = exported.iter().map(|b| b.exported()).collect();
    d.buffers.sort_by_key(|b| b.base);
    d.validate().unwrap();
    d
}

/// A request between `local` at `loff` and `remote` (exported buffer `rbuf`) at `roff`.
#[allow(clippy::too_many_arguments)]
fn req(
    index: u32,
    op: TransferOp,
    local: &Buf,
    loff: u64,
    remote: &Buf,
    rbuf: u32,
    roff: u64,
    len: u64,
) -> ResolvedRequest {
    ResolvedRequest {
        index,
        op,
        len,
        local_addr: local.info.base + loff,
        local_region: local.info.id,
        remote_addr: remote.info.base + roff,
        remote_buffer: rbuf,
    }
}

fn submit(peer: &Arc<dyn Peer>, reqs: Vec<ResolvedRequest>, ctx: &SubmitContext) -> Batch {
    let state = BatchState::new(reqs.iter().map(|r| r.len).collect());
    peer.submit(reqs, &state, ctx).unwrap();
    Batch::new(state)
}

fn run(peer: &Arc<dyn Peer>, reqs: Vec<ResolvedRequest>) -> Vec<RequestStatus> {
    let n = reqs.len();
    let batch = submit(peer, reqs, &SubmitContext::default());
    // The local copy completes inside submit.
    assert!(batch.is_complete(), "local copy batch still pending after submit");
    (0..n).map(|i| batch.status(i).unwrap()).collect()
}

fn failed(s: &RequestStatus) -> &Error {
    match s {
        RequestStatus::Failed(e) => e,
        other => panic!("expected a failure, got {other:?}"),
    }
}

fn done(statuses: &[RequestStatus]) {
    for (i, s) in statuses.iter().enumerate() {
        assert!(matches!(s, RequestStatus::Done { .. }), "request {i}: {s:?}");
    }
}

/// Two transports; a source and read-back buffer on `a`, an exported buffer on `b`.
struct Setup {
    a: LocalTransport,
    b: LocalTransport,
    src: Buf,
    back: Buf,
    dst: Buf,
    peer: Arc<dyn Peer>,
}

async fn setup(config: LocalConfig, len: usize) -> Setup {
    let a = transport(config);
    let b = transport(config);
    let src = Buf::new(&a, len, false).await;
    let back = Buf::new(&a, len, false).await;
    let dst = Buf::new(&b, len, true).await;
    let peer = a.connect(&descriptor("b", &b, &[&dst])).await.unwrap();
    src.fill(1);
    Setup {
        a,
        b,
        src,
        back,
        dst,
        peer,
    }
}

#[tokio::test]
async fn install_reads_the_environment_strictly() {
    let ctx = |pairs: &[(&str, &str)]| InstallContext {
        auth: None,
        env: Arc::new(MapEnv(
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        )),
        segment_name: "s".into(),
        devices: Vec::new(),
        notifications: te_base::NotifyInbox::new(Default::default()),
    };
    let t = te_transport_local::install(&ctx(&[])).await.unwrap();
    assert_eq!(t.name(), "local");
    let caps = t.capabilities();
    assert!(caps.local.contains(te_base::MemoryKind::Host) && caps.remote.contains(te_base::MemoryKind::Host));
    assert!(!caps.local.contains(te_base::MemoryKind::Cuda) && !caps.remote.contains(te_base::MemoryKind::Rocm));
    for (var, value) in [
        ("TE_COPY_THREADS", "0"),
        ("TE_COPY_THREADS", "x"),
        ("TE_NT_COPY_MIN_BYTES", "lots"),
    ] {
        let err = te_transport_local::install(&ctx(&[(var, value)])).await.err().unwrap();
        assert!(
            matches!(err, Error::Config { .. }) && err.to_string().contains(var),
            "{err}"
        );
    }
    let inline = LocalTransport::new(LocalConfig::from_env(&MapEnv::new([("TE_COPY_THREADS", "1")])).unwrap()).unwrap();
    assert_eq!(inline.helper_threads(), 0);
    assert_eq!(transport(LocalConfig::default()).helper_threads(), 1);
}

#[tokio::test]
async fn writes_and_reads_move_every_byte() {
    for config in [
        LocalConfig::default(),
        LocalConfig {
            copy_threads: 1,
            ..LocalConfig::default()
        },
        LocalConfig {
            fanout_min_bytes: 1,
            fanout_needs_awake_helper: false,
            nt_copy_min_bytes: 0,
            copy_threads: 4,
        },
    ] {
        let s = setup(config, 1 << 21).await;
        // Scattered 1,728 B fragments, a run of adjacent 8,448 B fragments that coalesce, and
        // 37,440 B fragments in reverse order.
        let mut reqs = Vec::new();
        let mut push = |loff: u64, roff: u64, len: u64| {
            let i = reqs.len() as u32;
            reqs.push(req(i, TransferOp::Write, &s.src, loff, &s.dst, 0, roff, len));
        };
        for k in 0..100u64 {
            push(k * 5000 + 3, (99 - k) * 5000 + 11, 1728);
        }
        for k in 0..40u64 {
            push(600_000 + k * 8448, 600_000 + k * 8448, 8448);
        }
        for k in (0..20u64).rev() {
            push(1_000_000 + k * 40_000, 1_000_000 + k * 37_440, 37_440);
        }
        let expected: Vec<(u64, u64, u64)> = reqs.iter().map(|r| (r.local_addr, r.remote_addr, r.len)).collect();
        done(&run(&s.peer, reqs));
        for &(l, r, len) in &expected {
            let (l, r) = ((l - s.src.info.base) as usize, (r - s.dst.info.base) as usize);
            assert_eq!(&s.dst.bytes()[r..r + len as usize], &s.src.bytes()[l..l + len as usize]);
        }
        // Read everything back into a fresh buffer at the source offsets.
        let reads: Vec<ResolvedRequest> = expected
            .iter()
            .enumerate()
            .map(|(i, &(l, r, len))| {
                req(
                    i as u32,
                    TransferOp::Read,
                    &s.back,
                    l - s.src.info.base,
                    &s.dst,
                    0,
                    r - s.dst.info.base,
                    len,
                )
            })
            .collect();
        done(&run(&s.peer, reads));
        for &(l, _, len) in &expected {
            let l = (l - s.src.info.base) as usize;
            assert_eq!(
                &s.back.bytes()[l..l + len as usize],
                &s.src.bytes()[l..l + len as usize]
            );
        }
    }
}

#[tokio::test]
async fn phase_timer_records_plan_and_submit_only_when_on() {
    let s = setup(LocalConfig::default(), 1 << 16).await;
    let stats = Arc::new(PhaseStats::default());
    let ctx = SubmitContext {
        timer: PhaseTimer::on(stats.clone()),
        background: false,
    };
    let batch = submit(
        &s.peer,
        vec![req(0, TransferOp::Write, &s.src, 0, &s.dst, 0, 0, 4096)],
        &ctx,
    );
    assert!(batch.wait_blocking(None).unwrap().is_ok());
    let report = stats.report();
    assert!(report.nanos[Phase::Submit as usize] > 0, "{report:?}");
    assert_eq!(report.nanos[Phase::Resolve as usize], 0);
    // Out of index order the batch is planned (resolved and sorted before any copy): planning
    // time is recorded.
    stats.reset();
    let reqs = (0..64u32)
        .rev()
        .map(|i| {
            req(
                i,
                TransferOp::Write,
                &s.src,
                u64::from(i) * 64,
                &s.dst,
                0,
                u64::from(i) * 64,
                64,
            )
        })
        .collect();
    assert!(submit(&s.peer, reqs, &ctx).wait_blocking(None).unwrap().is_ok());
    let report = stats.report();
    assert!(report.nanos[Phase::Plan as usize] > 0, "{report:?}");
    assert!(report.nanos[Phase::Submit as usize] > 0, "{report:?}");
    // Background work with the timer off: still copied, nothing recorded anywhere.
    let ctx = SubmitContext {
        timer: PhaseTimer::off(),
        background: true,
    };
    let batch = submit(
        &s.peer,
        vec![req(0, TransferOp::Write, &s.src, 100, &s.dst, 0, 8192, 40_000)],
        &ctx,
    );
    assert!(batch.wait_blocking(None).unwrap().is_ok());
    assert_eq!(&s.dst.bytes()[8192..48_192], &s.src.bytes()[100..40_100]);
}

#[tokio::test]
async fn forged_requests_fail_alone_with_typed_errors() {
    let s = setup(LocalConfig::default(), 1 << 16).await;
    let secret = Buf::new(&s.b, 4096, false).await;
    secret.fill(9);
    let secret_before = secret.bytes().to_vec();
    let elsewhere = Buf::new(&s.b, 4096, true).await; // exported, but not in this descriptor
    let device = RegionInfo {
        id: RegionId(NEXT_REGION.fetch_add(1, Ordering::Relaxed)),
        base: 0x7000_0000_0000,
        len: 1 << 20,
        location: MemoryLocation::Cuda { device: 0 },
        exported: true,
    };
    s.b.register(std::slice::from_ref(&device)).await.unwrap();
    let mut d = descriptor("b", &s.b, &[&s.dst]);
    d.buffers.push(ExportedBuffer {
        base: device.base,
        len: device.len,
        location: device.location,
        keys: Default::default(),
    });
    d.buffers.sort_by_key(|b| b.base);
    let dst_index = d.find_buffer(s.dst.info.base, 1).unwrap() as u32;
    let device_index = d.find_buffer(device.base, 1).unwrap() as u32;
    let peer = s.a.connect(&d).await.unwrap();

    let w =
        |i: u32, loff: u64, roff: u64, len: u64| req(i, TransferOp::Write, &s.src, loff, &s.dst, dst_index, roff, len);
    let mut reqs = vec![
        w(0, 0, 0, 4096),                 // good
        w(1, 0, (1 << 16) - 100, 4096),   // past the exported buffer's end
        w(2, 0, 4096, 0),                 // zero length
        w(3, 100, 8192, 1000),            // good
        w(4, (1 << 16) - 10, 12288, 100), // local range runs past its region
    ];
    let mut r = w(5, 0, 0, 64);
    r.remote_addr = secret.info.base; // registered but not exported
    reqs.push(r);
    let mut r = w(6, 0, 0, 64);
    r.local_region = RegionId(u64::MAX); // unknown local region
    reqs.push(r);
    let mut r = w(7, 0, 0, 64);
    r.remote_buffer = 9; // no such exported buffer
    reqs.push(r);
    let mut r = w(8, 0, 0, 64);
    r.remote_addr = elsewhere.info.base; // exported by the target, but not in the named buffer
    reqs.push(r);
    let mut r = w(9, 0, 0, 64);
    r.remote_addr = u64::MAX - 10; // overflows
    reqs.push(r);
    let mut r = req(10, TransferOp::Read, &s.src, 0, &s.dst, device_index, 0, 64);
    r.remote_addr = device.base; // device memory
    reqs.push(r);
    let mut r = w(11, 0, 0, 64);
    r.local_addr = 0x10; // not registered at all
    reqs.push(r);

    let st = run(&peer, reqs);
    done(&[st[0].clone(), st[3].clone()]);
    assert!(matches!(failed(&st[1]), Error::OutOfBounds { segment, .. } if segment == "b"));
    assert!(matches!(failed(&st[2]), Error::ZeroLength { index: 2 }));
    assert!(matches!(failed(&st[4]), Error::PartlyRegistered { .. }));
    assert!(matches!(failed(&st[5]), Error::OutOfBounds { .. }));
    assert!(matches!(failed(&st[6]), Error::Unregistered { .. }));
    assert!(matches!(failed(&st[7]), Error::OutOfBounds { .. }));
    assert!(matches!(failed(&st[8]), Error::OutOfBounds { .. }));
    assert!(matches!(failed(&st[9]), Error::LengthOverflow { .. }));
    assert!(matches!(failed(&st[10]), Error::WrongMemoryKind { what, .. } if what.contains("cuda:0")));
    assert!(matches!(failed(&st[11]), Error::Unregistered { .. }));
    assert_eq!(secret.bytes(), &secret_before[..], "unexported memory was written");
    assert!(elsewhere.bytes().iter().all(|&b| b == 0));
    assert_eq!(&s.dst.bytes()[..4096], &s.src.bytes()[..4096]);
    assert_eq!(&s.dst.bytes()[8192..9192], &s.src.bytes()[100..1100]);
    assert!(
        s.dst.bytes()[(1 << 16) - 100..].iter().all(|&b| b == 0),
        "refused write landed"
    );
    assert!(
        s.dst.bytes()[12288..12388].iter().all(|&b| b == 0),
        "refused write landed"
    );
}

#[tokio::test]
async fn a_deregistered_target_region_is_refused_even_with_a_stale_descriptor() {
    let s = setup(LocalConfig::default(), 1 << 16).await;
    done(&run(
        &s.peer,
        vec![req(0, TransferOp::Write, &s.src, 0, &s.dst, 0, 0, 64)],
    ));
    s.b.deregister(std::slice::from_ref(&s.dst.info)).await.unwrap();
    let st = run(&s.peer, vec![req(0, TransferOp::Write, &s.src, 64, &s.dst, 0, 64, 64)]);
    assert!(matches!(failed(&st[0]), Error::OutOfBounds { .. }));
    assert!(s.dst.bytes()[64..128].iter().all(|&b| b == 0));
    // Deregistering twice, or something never registered, is an error and changes nothing.
    assert!(s.b.deregister(std::slice::from_ref(&s.dst.info)).await.is_err());
}

#[tokio::test]
async fn registration_is_all_or_nothing() {
    let t = transport(LocalConfig::default());
    let a = Buf::new(&t, 8192, true).await;
    let fresh = HostBuffer::allocate(4096, HostBufferOptions::default()).unwrap();
    let good = RegionInfo {
        id: RegionId(NEXT_REGION.fetch_add(1, Ordering::Relaxed)),
        base: fresh.addr(),
        len: 4096,
        location: MemoryLocation::HOST,
        exported: true,
    };
    let overlapping = RegionInfo {
        id: RegionId(NEXT_REGION.fetch_add(1, Ordering::Relaxed)),
        base: a.info.base + 100,
        len: 10,
        ..good.clone()
    };
    let err = t.register(&[good.clone(), overlapping]).await.unwrap_err();
    let Error::RegistrationFailed { failures } = err else {
        panic!("{err}")
    };
    assert_eq!(failures.len(), 1);
    assert_eq!(failures[0].index, 1);
    // The good item of the failed batch was not kept: registering it alone now works.
    t.register(std::slice::from_ref(&good)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_from_many_threads() {
    let always_share = LocalConfig {
        fanout_needs_awake_helper: false,
        ..LocalConfig::default()
    };
    let s = setup(always_share, 8 << 20).await;
    let threads = 4u64;
    let per = (8u64 << 20) / threads;
    std::thread::scope(|scope| {
        for t in 0..threads {
            let (peer, src, dst) = (&s.peer, &s.src, &s.dst);
            scope.spawn(move || {
                for round in 0..20u64 {
                    // 64 fragments of a quarter of the buffer each round, big enough to fan out.
                    let frag = per / 64;
                    let reqs: Vec<ResolvedRequest> = (0..64u64)
                        .map(|i| {
                            let off = t * per + ((i * 17 + round) % 64) * frag;
                            req(i as u32, TransferOp::Write, src, off, dst, 0, off, frag)
                        })
                        .collect();
                    let batch = submit(peer, reqs, &SubmitContext::default());
                    assert!(batch.wait_blocking(None).unwrap().is_ok());
                }
            });
        }
    });
    assert!(s.dst.bytes() == s.src.bytes(), "concurrent batches left wrong bytes");
}

#[tokio::test]
async fn ten_thousand_requests_in_one_batch() {
    let n = 10_000u64;
    let frag = 1728u64;
    let always_share = LocalConfig {
        fanout_needs_awake_helper: false,
        ..LocalConfig::default()
    };
    let s = setup(always_share, (n * frag) as usize).await;
    // 7919 is prime and does not divide n, so `i * 7919 % n` visits every slot once.
    let perm = |i: u64| (i * 7919) % n;
    // Batch 1: submitted in scrambled order, but source and destination slots match, so the plan
    // coalesces everything into one copy. Batch 2: destinations scrambled against sources, so
    // nothing coalesces. Both are large enough to fan out.
    for scrambled_dst in [false, true] {
        s.dst.fill(0);
        let reqs: Vec<ResolvedRequest> = (0..n)
            .map(|i| {
                let slot = perm(i);
                let dst_slot = if scrambled_dst { perm(slot) } else { slot };
                req(
                    i as u32,
                    TransferOp::Write,
                    &s.src,
                    slot * frag,
                    &s.dst,
                    0,
                    dst_slot * frag,
                    frag,
                )
            })
            .collect();
        let expect: Vec<(usize, usize)> = reqs
            .iter()
            .map(|r| {
                (
                    (r.local_addr - s.src.info.base) as usize,
                    (r.remote_addr - s.dst.info.base) as usize,
                )
            })
            .collect();
        done(&run(&s.peer, reqs));
        for (l, r) in expect {
            assert_eq!(
                &s.dst.bytes()[r..r + frag as usize],
                &s.src.bytes()[l..l + frag as usize],
                "scrambled destinations: {scrambled_dst}"
            );
        }
    }
}

/// Requests that read what others write, within one segment's own memory: the batch runs request
/// by request in index order with memmove semantics, exactly like this reference model.
#[tokio::test]
async fn overlapping_requests_run_in_index_order() {
    for config in [
        LocalConfig::default(),
        LocalConfig {
            copy_threads: 4,
            nt_copy_min_bytes: 0,
            fanout_min_bytes: 1,
            fanout_needs_awake_helper: false,
        },
    ] {
        let t = transport(config);
        let mem = Buf::new(&t, 1 << 16, true).await;
        let scratch = Buf::new(&t, 1 << 16, false).await;
        let peer = t.connect(&descriptor("self", &t, &[&mem])).await.unwrap();
        mem.fill(3);
        scratch.fill(4);
        let mut model: Vec<u8> = mem.bytes().to_vec();
        let scratch_model: Vec<u8> = scratch.bytes().to_vec();
        // (op, local offset in `mem` or `scratch`, remote offset in `mem`, len, local is mem)
        let cases: [(TransferOp, u64, u64, u64, bool); 6] = [
            (TransferOp::Write, 0, 100, 5000, true), // copy onto an overlapping range of itself
            (TransferOp::Write, 20_000, 30_000, 3000, false), // from scratch
            (TransferOp::Read, 4000, 29_000, 2500, true), // reads what request 1 wrote
            (TransferOp::Write, 31_000, 30_500, 4000, true), // writes over request 1's output
            (TransferOp::Write, 0, 40_000, 64, false),
            (TransferOp::Read, 40_010, 40_000, 64, true), // reads request 4's output, overlapping itself
        ];
        let mut reqs = Vec::new();
        for (i, &(op, loff, roff, len, local_is_mem)) in cases.iter().enumerate() {
            let local = if local_is_mem { &mem } else { &scratch };
            reqs.push(req(i as u32, op, local, loff, &mem, 0, roff, len));
            let (l, r, n) = (loff as usize, roff as usize, len as usize);
            match (op, local_is_mem) {
                (TransferOp::Write, true) => model.copy_within(l..l + n, r),
                (TransferOp::Write, false) => model[r..r + n].copy_from_slice(&scratch_model[l..l + n]),
                (TransferOp::Read, true) => model.copy_within(r..r + n, l),
                (TransferOp::Read, false) => unreachable!("no such case"),
            }
        }
        // In index order the batch takes the request-order path; reversed, the planned path (the
        // order is by request index, not by position in the vector). Same outcome both ways.
        for reversed in [false, true] {
            mem.fill(3);
            let mut batch = reqs.clone();
            if reversed {
                batch.reverse();
            }
            done(&run(&peer, batch));
            assert!(
                mem.bytes() == &model[..],
                "overlapping batch (reversed: {reversed}) differs from the in-order model"
            );
            assert!(scratch.bytes() == &scratch_model[..]);
        }
    }
}

/// A batch in index order is copied request by request until a helper may take the rest (here
/// at once: sharing does not wait for an awake helper), then the rest is planned. Across that
/// seam the outcome is still that of the requests run in index order: a chain in which each
/// request reads what the one before it wrote, and a scattered batch the helpers share.
#[tokio::test]
async fn batches_handed_to_the_planner_midway_keep_index_order() {
    let t = transport(LocalConfig {
        copy_threads: 2,
        nt_copy_min_bytes: 0,
        fanout_min_bytes: 1,
        fanout_needs_awake_helper: false,
    });
    let mem = Buf::new(&t, 1 << 16, true).await;
    let scratch = Buf::new(&t, 1 << 16, false).await;
    let peer = t.connect(&descriptor("self", &t, &[&mem])).await.unwrap();
    let n = 600u64;

    // Request i copies block i onto block i + 1: block 0 spreads over every block.
    mem.fill(7);
    let mut model = mem.bytes().to_vec();
    let chain: Vec<ResolvedRequest> = (0..n)
        .map(|i| req(i as u32, TransferOp::Write, &mem, i * 64, &mem, 0, (i + 1) * 64, 64))
        .collect();
    for i in 0..n as usize {
        model.copy_within(i * 64..i * 64 + 64, (i + 1) * 64);
    }
    done(&run(&peer, chain));
    assert!(mem.bytes() == &model[..], "the chain differs from the in-order model");

    // Scattered, non-overlapping: block i of scratch to a permuted block of mem.
    scratch.fill(9);
    let perm = |i: u64| (i * 7 + 3) % n;
    let scattered: Vec<ResolvedRequest> = (0..n)
        .map(|i| req(i as u32, TransferOp::Write, &scratch, i * 64, &mem, 0, perm(i) * 64, 64))
        .collect();
    done(&run(&peer, scattered));
    for i in 0..n {
        let (s, d) = ((i * 64) as usize, (perm(i) * 64) as usize);
        assert_eq!(&mem.bytes()[d..d + 64], &scratch.bytes()[s..s + 64], "block {i}");
    }
}

#[tokio::test]
async fn writes_to_the_same_destination_are_ordered_by_index() {
    let s = setup(LocalConfig::default(), 1 << 16).await;
    let reqs = vec![
        req(1, TransferOp::Write, &s.src, 5000, &s.dst, 0, 0, 4096),
        req(0, TransferOp::Write, &s.src, 0, &s.dst, 0, 0, 4096),
        req(2, TransferOp::Write, &s.src, 9000, &s.dst, 0, 2048, 100),
    ];
    done(&run(&s.peer, reqs));
    let mut want = s.src.bytes()[5000..9096].to_vec();
    want[2048..2148].copy_from_slice(&s.src.bytes()[9000..9100]);
    assert_eq!(&s.dst.bytes()[..4096], &want[..]);
}

/// The same, submitted in index order as the engine does: the batch takes the unsorted
/// request-order path (and merges the contiguous pair 0-1), with the same outcome.
#[tokio::test]
async fn in_order_batches_with_repeated_destinations_end_as_run_one_by_one() {
    let s = setup(LocalConfig::default(), 1 << 16).await;
    let reqs = vec![
        req(0, TransferOp::Write, &s.src, 0, &s.dst, 0, 0, 2048),
        req(1, TransferOp::Write, &s.src, 2048, &s.dst, 0, 2048, 2048),
        req(2, TransferOp::Write, &s.src, 9000, &s.dst, 0, 1000, 3000),
        req(3, TransferOp::Write, &s.src, 20000, &s.dst, 0, 1500, 10),
    ];
    done(&run(&s.peer, reqs));
    let mut want = s.src.bytes()[0..4096].to_vec();
    want[1000..4000].copy_from_slice(&s.src.bytes()[9000..12000]);
    want[1500..1510].copy_from_slice(&s.src.bytes()[20000..20010]);
    assert_eq!(&s.dst.bytes()[..4096], &want[..]);
}

#[tokio::test]
async fn cancelled_batches_move_nothing() {
    let s = setup(LocalConfig::default(), 1 << 16).await;
    let reqs = vec![req(0, TransferOp::Write, &s.src, 0, &s.dst, 0, 0, 4096)];
    let state = BatchState::new(vec![4096].into());
    let batch = Batch::new(state.clone());
    batch.cancel();
    s.peer.submit(reqs, &state, &SubmitContext::default()).unwrap();
    assert!(matches!(batch.status(0), Some(RequestStatus::Cancelled)));
    assert!(s.dst.bytes().iter().all(|&b| b == 0));
}

#[tokio::test]
async fn reach_and_connect_only_in_this_process() {
    let a = transport(LocalConfig::default());
    let b = transport(LocalConfig::default());
    let buf = Buf::new(&b, 4096, true).await;
    let d = descriptor("b", &b, &[&buf]);
    assert!(a.can_reach(&d));

    let mut foreign = d.clone();
    foreign.transports[0].info = serde_json::json!({"process": "1-00000000deadbeef", "domain": 1});
    assert!(!a.can_reach(&foreign));
    let err = a.connect(&foreign).await.err().unwrap();
    assert!(
        matches!(&err, Error::NoTransport { segment, .. } if segment == "b"),
        "{err}"
    );

    let mut tcp_only = d.clone();
    tcp_only.transports[0].transport = "tcp".into();
    assert!(!a.can_reach(&tcp_only));
    assert!(matches!(
        a.connect(&tcp_only).await.err().unwrap(),
        Error::NoTransport { .. }
    ));

    let mut garbage = d.clone();
    garbage.transports[0].info = serde_json::json!("nonsense");
    assert!(!a.can_reach(&garbage));
    assert!(matches!(
        a.connect(&garbage).await.err().unwrap(),
        Error::InvalidDescriptor(_)
    ));

    let peer = a.connect(&d).await.unwrap();
    assert!(peer.is_healthy());
    assert_eq!(peer.descriptor().name, "b");

    // The target goes away: no new connections, and the old peer reports it gone.
    b.shutdown().await;
    assert!(!a.can_reach(&d));
    assert!(matches!(a.connect(&d).await.err().unwrap(), Error::PeerGone { .. }));
    assert!(!peer.is_healthy());
    let state = BatchState::new(vec![8].into());
    let reqs = vec![ResolvedRequest {
        index: 0,
        op: TransferOp::Read,
        len: 8,
        local_addr: buf.info.base,
        local_region: buf.info.id,
        remote_addr: buf.info.base,
        remote_buffer: 0,
    }];
    let err = peer.submit(reqs, &state, &SubmitContext::default()).unwrap_err();
    assert!(matches!(err, Error::PeerGone { .. }), "{err}");

    // A dropped target is gone too.
    let c = transport(LocalConfig::default());
    let dc = descriptor("c", &c, &[]);
    assert!(a.can_reach(&dc));
    drop(c);
    assert!(!a.can_reach(&dc));

    // The initiator shut down: its peers refuse work.
    let e = transport(LocalConfig::default());
    let peer_e = e.connect(&descriptor("a", &a, &[])).await.unwrap();
    e.shutdown().await;
    let state = BatchState::new(vec![].into());
    assert!(matches!(
        peer_e.submit(vec![], &state, &SubmitContext::default()),
        Err(Error::Closed(_))
    ));
    assert!(matches!(
        e.register(std::slice::from_ref(&buf.info)).await,
        Err(Error::Closed(_))
    ));
}

#[tokio::test]
async fn every_kernel_end_to_end() {
    for kernel in NtKernel::supported() {
        let config = LocalConfig {
            nt_copy_min_bytes: 256,
            fanout_min_bytes: 1,
            fanout_needs_awake_helper: false,
            copy_threads: 2,
        };
        let a = LocalTransport::with_kernel(config, kernel).unwrap();
        assert_eq!(a.kernel(), kernel);
        let src = Buf::new(&a, 1 << 20, false).await;
        let dst = Buf::new(&a, 1 << 20, true).await;
        src.fill(kernel.name().len() as u8);
        let peer = a.connect(&descriptor("self", &a, &[&dst])).await.unwrap();
        let reqs: Vec<ResolvedRequest> = (0..100u64)
            .map(|i| {
                req(
                    i as u32,
                    TransferOp::Write,
                    &src,
                    i * 10_000 + i,
                    &dst,
                    0,
                    i * 10_001,
                    9_999 - i,
                )
            })
            .collect();
        let expect: Vec<(usize, usize, usize)> = reqs
            .iter()
            .map(|r| {
                (
                    (r.local_addr - src.info.base) as usize,
                    (r.remote_addr - dst.info.base) as usize,
                    r.len as usize,
                )
            })
            .collect();
        done(&run(&peer, reqs));
        for (l, r, n) in expect {
            assert_eq!(&dst.bytes()[r..r + n], &src.bytes()[l..l + n], "{}", kernel.name());
        }
    }
}
