//! Engine behaviour through the public API: moving bytes, and every bad input of DESIGN.md
//! section 7 answered with a typed error that names it.

use std::sync::Arc;

use te_core::config::MapEnv;
use te_core::{
    Error, HostBufferOptions, MemoryLocation, RegisterOptions, RequestStatus, TransferEngine, TransferRequest,
};

mod common;
use common::{local_engine, manual_engine, ManualTransport};

async fn engine(name: &str) -> TransferEngine {
    local_engine(name, &[]).await
}

fn opts() -> HostBufferOptions {
    HostBufferOptions::default()
}

#[tokio::test]
async fn moves_bytes_between_two_engines() {
    let a = engine("mv-a").await;
    let b = engine("mv-b").await;
    let src = a.allocate(1 << 20, opts()).await.unwrap();
    let back = a.allocate(1 << 20, opts()).await.unwrap();
    let dst = b.allocate(1 << 20, opts()).await.unwrap();
    let data: Vec<u8> = (0..1 << 20).map(|i| (i * 7 % 251) as u8).collect();
    src.write_at(0, &data).unwrap();
    let seg = a.open_segment("mv-b").await.unwrap();
    assert_eq!(seg.buffers().len(), 1);
    let reqs: Vec<TransferRequest> = (0..256u64)
        .map(|i| TransferRequest::write(src.addr() + i * 4096, seg.id(), dst.addr() + i * 4096, 4096))
        .collect();
    let report = a.transfer(&reqs).await.unwrap();
    assert_eq!(report.bytes, 1 << 20);
    let reads: Vec<TransferRequest> = (0..16u64)
        .map(|i| TransferRequest::read(back.addr() + i * 65536, seg.id(), dst.addr() + i * 65536, 65536))
        .collect();
    a.transfer(&reads).await.unwrap();
    let mut out = vec![0u8; 1 << 20];
    back.read_at(0, &mut out).unwrap();
    assert_eq!(out, data);
    let m = a.metrics();
    assert_eq!((m.batches, m.requests, m.bytes), (2, 272, 2 << 20));
}

/// One batch alternating between two target segments, two local regions and two exported
/// buffers of one target: every request lands where it says (the engine regroups them per
/// segment and switches regions and buffers request by request).
#[tokio::test]
async fn a_batch_interleaving_segments_regions_and_buffers_lands_every_request() {
    let a = engine("mix-a").await;
    let b = engine("mix-b").await;
    let c = engine("mix-c").await;
    let srcs = [
        a.allocate(1 << 16, opts()).await.unwrap(),
        a.allocate(1 << 16, opts()).await.unwrap(),
    ];
    let b_bufs = [
        b.allocate(1 << 16, opts()).await.unwrap(),
        b.allocate(1 << 16, opts()).await.unwrap(),
    ];
    let c_buf = c.allocate(1 << 16, opts()).await.unwrap();
    for (k, s) in srcs.iter().enumerate() {
        let data: Vec<u8> = (0..1 << 16).map(|i| (i * 3 + k * 101) as u8).collect();
        s.write_at(0, &data).unwrap();
    }
    let (sb, sc) = (
        a.open_segment("mix-b").await.unwrap(),
        a.open_segment("mix-c").await.unwrap(),
    );
    // Request i: from source region i % 2, to b's buffer (i / 2) % 2 or to c, in 256 B blocks.
    let n = 96u64;
    let target = |i: u64| -> (te_core::SegmentId, u64) {
        match i % 3 {
            0 => (sb.id(), b_bufs[0].addr()),
            1 => (sb.id(), b_bufs[1].addr()),
            _ => (sc.id(), c_buf.addr()),
        }
    };
    let reqs: Vec<TransferRequest> = (0..n)
        .map(|i| {
            let (seg, base) = target(i);
            TransferRequest::write(srcs[(i % 2) as usize].addr() + i * 256, seg, base + i * 256, 256)
        })
        .collect();
    let report = a.transfer(&reqs).await.unwrap();
    assert_eq!((report.requests, report.bytes), (n as usize, n * 256));
    for i in 0..n {
        let mut want = vec![0u8; 256];
        srcs[(i % 2) as usize].read_at(i * 256, &mut want).unwrap();
        let mut got = vec![0u8; 256];
        match i % 3 {
            0 => b_bufs[0].read_at(i * 256, &mut got).unwrap(),
            1 => b_bufs[1].read_at(i * 256, &mut got).unwrap(),
            _ => c_buf.read_at(i * 256, &mut got).unwrap(),
        }
        assert_eq!(got, want, "request {i}");
    }
}

#[tokio::test]
async fn malformed_requests_are_refused_with_what_was_wrong() {
    let a = engine("bad-a").await;
    let b = engine("bad-b").await;
    let src = a.allocate(8192, opts()).await.unwrap();
    let dst = b.allocate(8192, opts()).await.unwrap();
    let seg = a.open_segment("bad-b").await.unwrap();
    let id = seg.id();
    let ok = TransferRequest::write(src.addr(), id, dst.addr(), 16);
    let check = |reqs: &[TransferRequest]| a.submit(reqs).map(|_| ()).unwrap_err();

    assert!(matches!(
        check(&[ok, TransferRequest { len: 0, ..ok }]),
        Error::ZeroLength { index: 1 }
    ));
    assert!(matches!(
        check(&[TransferRequest { local_addr: 0x10, ..ok }]),
        Error::Unregistered { .. }
    ));
    assert!(matches!(
        check(&[TransferRequest { len: 8193, ..ok }]),
        Error::PartlyRegistered { .. }
    ));
    assert!(matches!(
        check(&[TransferRequest {
            remote_addr: dst.addr() + 8190,
            ..ok
        }]),
        Error::OutOfBounds { .. }
    ));
    assert!(matches!(
        check(&[TransferRequest {
            remote_addr: dst.addr() + 8192,
            ..ok
        }]),
        Error::OutOfBounds { .. }
    ));
    assert!(matches!(
        check(&[TransferRequest {
            remote_addr: u64::MAX - 4,
            ..ok
        }]),
        Error::LengthOverflow { .. }
    ));
    assert!(matches!(
        check(&[TransferRequest {
            local_addr: u64::MAX - 4,
            ..ok
        }]),
        Error::LengthOverflow { .. }
    ));
    assert!(matches!(
        check(&[TransferRequest {
            segment: te_core::SegmentId(99),
            ..ok
        }]),
        Error::UnknownSegment(_)
    ));
    // Nothing of a refused batch started.
    let mut probe = [0u8; 16];
    dst.read_at(0, &mut probe).unwrap();
    assert_eq!(probe, [0u8; 16]);
    assert!(matches!(
        a.open_segment("no-such-segment").await,
        Err(Error::UnknownSegment(_))
    ));
}

#[tokio::test]
async fn unexported_memory_is_not_in_the_descriptor_and_cannot_be_targeted() {
    let a = engine("unexp-a").await;
    let b = engine("unexp-b").await;
    let src = a.allocate(4096, opts()).await.unwrap();
    let hidden = b
        .allocate_with(4096, opts(), RegisterOptions::local_only())
        .await
        .unwrap();
    let seg = a.open_segment("unexp-b").await.unwrap();
    assert!(seg.buffers().is_empty());
    let err = a
        .submit(&[TransferRequest::write(src.addr(), seg.id(), hidden.addr(), 16)])
        .unwrap_err();
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
}

#[tokio::test]
async fn overlapping_and_empty_registrations_are_refused() {
    let a = engine("ovl").await;
    let r = a.allocate(8192, opts()).await.unwrap();
    // SAFETY: the range lies inside `r`, which outlives the attempt; it is refused anyway.
    let err = unsafe { a.register_raw(r.addr() + 4096, 8192, MemoryLocation::HOST, RegisterOptions::default()) }
        .await
        .unwrap_err();
    assert!(matches!(err, Error::AlreadyRegistered { .. }), "{err}");
    // SAFETY: zero-length registration is refused before the memory is looked at.
    let err = unsafe { a.register_raw(r.addr(), 0, MemoryLocation::HOST, RegisterOptions::default()) }
        .await
        .unwrap_err();
    assert!(matches!(err, Error::ZeroLength { .. }));
    // SAFETY: the null address is refused before use.
    let err = unsafe { a.register_raw(0, 16, MemoryLocation::HOST, RegisterOptions::default()) }
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NullAddress));
}

#[tokio::test]
async fn device_memory_without_a_plugin_is_a_typed_error() {
    let a = engine("dev").await;
    // SAFETY: the address is never dereferenced: there is no CUDA driver on the test hosts.
    let err = unsafe {
        a.register_raw(
            0x7000_0000,
            4096,
            MemoryLocation::Cuda { device: 0 },
            RegisterOptions::default(),
        )
    }
    .await
    .unwrap_err();
    // Without a plugin compiled in, or without a driver here, the error says cuda is not available.
    assert!(matches!(err, Error::NotAvailable { .. }), "{err}");
    assert!(err.to_string().contains("cuda"), "{err}");
}

#[tokio::test]
async fn malformed_configuration_names_the_variable() {
    for (var, value) in [
        ("TE_PHASE_TIMING", "maybe"),
        ("TE_TRANSPORTS", "warp-drive"),
        ("TE_COPY_THREADS", "0"),
        ("TE_COPY_THREADS", "2x"),
        ("TE_METADATA", "zookeeper"),
    ] {
        let env = MapEnv::new([(var, value)]);
        let err = TransferEngine::builder()
            .segment_name("cfg")
            .env(Arc::new(env))
            .build()
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Config { .. }), "{var}={value}: {err}");
        assert!(err.to_string().contains(var), "{err}");
    }
}

#[tokio::test]
async fn phase_timing_is_off_by_default_and_counts_calls_when_on() {
    let off = engine("pt-off").await;
    assert!(off.phase_report().is_none());
    let on = TransferEngine::builder()
        .segment_name("pt-on")
        .phase_timing(true)
        .build()
        .await
        .unwrap();
    let s = on.allocate(8192, opts()).await.unwrap();
    let d = on.allocate(8192, opts()).await.unwrap();
    let me = on.open_segment("pt-on").await.unwrap();
    on.transfer(&[TransferRequest::write(s.addr(), me.id(), d.addr(), 4096)])
        .await
        .unwrap();
    let r = on.phase_report().unwrap();
    assert_eq!((r.calls, r.items), (1, 1));
}

#[tokio::test]
async fn deregistration_is_refused_while_in_flight_and_drop_defers_it() {
    let manual = ManualTransport::new();
    let a = manual_engine("inflight", &manual).await;
    let src = a.allocate(4096, opts()).await.unwrap();
    let dst = a.allocate(4096, opts()).await.unwrap();
    src.write_at(0, &[7u8; 64]).unwrap();
    let me = a.open_segment("inflight").await.unwrap();
    let batch = a
        .submit(&[TransferRequest::write(src.addr(), me.id(), dst.addr(), 64)])
        .unwrap();
    assert!(!batch.is_complete());
    // Deregistering (or dropping) the source while in flight: refused as in flight; new
    // transfers using it are refused at once and it leaves the descriptor, but it stays
    // registered (and its memory valid) until the batch completes.
    let src_addr = src.addr();
    assert!(matches!(src.deregister().await, Err(Error::InFlight { .. })));
    let err = a
        .submit(&[TransferRequest::write(src_addr, me.id(), dst.addr(), 64)])
        .unwrap_err();
    assert!(matches!(err, Error::Unregistered { .. }), "{err}");
    assert!(!a.descriptor().buffers.iter().any(|b| b.base == src_addr));
    assert!(
        manual.registered().contains(&src_addr),
        "deregistered from the transport while in flight"
    );
    manual.complete_all();
    batch.wait().await.unwrap();
    assert!(matches!(batch.status(0), Some(RequestStatus::Done { bytes: 64 })));
    let mut out = [0u8; 64];
    dst.read_at(0, &mut out).unwrap();
    assert_eq!(out, [7u8; 64], "the in-flight copy read valid memory");
    // The release runs on the engine's runtime (a drop never blocks): wait for it, bounded.
    let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while manual.registered().contains(&src_addr) && std::time::Instant::now() < end {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    assert!(
        !manual.registered().contains(&src_addr),
        "dropped region still registered after completion"
    );
    let dst_addr = dst.addr();
    dst.deregister().await.unwrap();
    assert!(!manual.registered().contains(&dst_addr));
}

#[tokio::test]
async fn failed_requests_do_not_disturb_the_others() {
    let manual = ManualTransport::new();
    let a = manual_engine("partial", &manual).await;
    let src = a.allocate(8192, opts()).await.unwrap();
    let dst = a.allocate(8192, opts()).await.unwrap();
    src.write_at(0, &[5u8; 8192]).unwrap();
    let me = a.open_segment("partial").await.unwrap();
    let reqs: Vec<TransferRequest> = (0..4u64)
        .map(|i| TransferRequest::write(src.addr() + i * 1024, me.id(), dst.addr() + i * 1024, 1024))
        .collect();
    let batch = a.submit(&reqs).unwrap();
    manual.fail_index(2);
    manual.complete_all();
    let err = batch.wait().await.unwrap_err();
    assert_eq!(err.progress.done, 3);
    assert_eq!(err.failures.len(), 1);
    assert_eq!(err.failures[0].0, 2);
    let mut out = vec![0u8; 4096];
    dst.read_at(0, &mut out).unwrap();
    assert!(
        out[..2048].iter().all(|&b| b == 5)
            && out[2048..3072].iter().all(|&b| b == 0)
            && out[3072..].iter().all(|&b| b == 5)
    );
    let e = a.transfer(&reqs[..1]);
    manual.complete_all_later();
    // Accepted at submission; the transfer then completes (the manual transport finishes it).
    assert!(matches!(e.await, Ok(_) | Err(Error::BatchFailed(_))));
}

#[tokio::test]
async fn own_segment_stays_current_as_memory_is_registered() {
    let a = engine("own-live").await;
    let me = a.open_segment("own-live").await.unwrap();
    let src = a.allocate(4096, opts()).await.unwrap();
    let dst = a.allocate(4096, opts()).await.unwrap();
    src.write_at(0, b"late registration").unwrap();
    // No reopen: the engine refreshed its own open segment when dst was registered.
    a.transfer(&[TransferRequest::write(src.addr(), me.id(), dst.addr(), 17)])
        .await
        .unwrap();
    let mut out = [0u8; 17];
    dst.read_at(0, &mut out).unwrap();
    assert_eq!(&out, b"late registration");
    // And a deregistered buffer stops being a valid target at once.
    let dst_addr = dst.addr();
    dst.deregister().await.unwrap();
    let err = a
        .submit(&[TransferRequest::write(src.addr(), me.id(), dst_addr, 17)])
        .unwrap_err();
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
}

#[tokio::test]
async fn a_callers_phase_timer_receives_the_call() {
    let a = engine("timer-caller").await;
    let src = a.allocate(8192, opts()).await.unwrap();
    let dst = a.allocate(8192, opts()).await.unwrap();
    let me = a.open_segment("timer-caller").await.unwrap();
    let stats = Arc::new(te_core::PhaseStats::default());
    let o = te_core::SubmitOptions {
        background: false,
        timer: Some(te_core::PhaseTimer::on(stats.clone())),
        ..Default::default()
    };
    a.submit_with(&[TransferRequest::write(src.addr(), me.id(), dst.addr(), 64)], &o)
        .unwrap()
        .wait()
        .await
        .unwrap();
    let r = stats.report();
    assert!(r.total_nanos() > 0, "the engine's phases land in the caller's timer");
    assert_eq!(r.calls, 0, "the caller counts its own calls");
    assert!(a.phase_report().is_none(), "the engine's own timer stays off");
}

#[tokio::test]
async fn a_transport_refusing_a_group_fails_exactly_its_requests() {
    let manual = ManualTransport::new();
    let a = manual_engine("refusing", &manual).await;
    let src = a.allocate(8192, opts()).await.unwrap();
    let dst = a.allocate(8192, opts()).await.unwrap();
    let me = a.open_segment("refusing").await.unwrap();
    manual.refuse_submissions();
    let reqs: Vec<TransferRequest> = (0..3u64)
        .map(|i| TransferRequest::write(src.addr() + i * 64, me.id(), dst.addr() + i * 64, 64))
        .collect();
    let err = a.submit(&reqs).unwrap().wait().await.unwrap_err();
    assert_eq!(err.progress.failed, 3);
    assert!(err
        .failures
        .iter()
        .all(|(_, e)| e.to_string().contains("refused the whole group")));
    assert_eq!(a.metrics().failed_requests, 3);
    // The pins were released with the failed batch: deregistration is allowed again.
    src.deregister().await.unwrap();
}

/// Fetches `name` until it is gone, within a deadline (the withdrawal runs on the runtime).
async fn gone_within(store: &te_core::metadata::InProcessStore, name: &str, secs: u64) -> bool {
    use te_core::MetadataStore;
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
    while tokio::time::Instant::now() < deadline {
        if matches!(store.fetch(name).await, Err(Error::UnknownSegment(_))) {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_last_clone_withdraws_the_descriptor() {
    use te_core::MetadataStore;
    let store = te_core::metadata::InProcessStore::new();
    let build = || {
        TransferEngine::builder()
            .segment_name("dropped")
            .transports(["local"])
            .metadata(Arc::new(store.clone()))
            .build()
    };
    let a = build().await.unwrap();
    let clone = a.clone();
    drop(a);
    // A clone keeps the engine, and its descriptor, alive.
    assert_eq!(store.fetch("dropped").await.unwrap().instance, clone.instance());
    drop(clone);
    assert!(
        gone_within(&store, "dropped", 10).await,
        "descriptor left behind by a dropped engine"
    );

    // Withdrawal names the instance: a predecessor's late drop never removes a successor that
    // reused the name.
    let old = build().await.unwrap();
    let old_instance = old.instance();
    old.shutdown().await.unwrap();
    let successor = build().await.unwrap();
    store.withdraw("dropped", old_instance).await.unwrap();
    assert_eq!(store.fetch("dropped").await.unwrap().instance, successor.instance());
    store.withdraw("dropped", successor.instance()).await.unwrap();
    assert!(gone_within(&store, "dropped", 1).await);
}

#[tokio::test]
async fn build_validates_every_known_variable_whichever_transports_run_here() {
    // Each is read by a component that may be unusable on this host (efa, rdma) or not selected;
    // build() refuses them all the same, naming the variable.
    let mut bad = vec![
        ("TE_MAX_CONCURRENT_REG_MR", "-1"),
        ("TE_NIC_SELECTION", "bogus"),
        ("TE_COPY_THREADS", "many"),
        ("TE_P2P_TIMEOUT_MS", "soon"),
    ];
    if cfg!(feature = "tcp") {
        bad.push(("TE_TCP_LANES", "0x"));
    }
    if cfg!(feature = "rdma") {
        bad.push(("TE_RDMA_MTU", "9000x"));
    }
    if cfg!(feature = "efa") {
        bad.push(("TE_FABRIC_MAX_RAILS", "-3"));
    }
    for (var, value) in bad {
        let err = TransferEngine::builder()
            .segment_name(format!("env-{var}"))
            .transports(["local"])
            .env(Arc::new(te_core::config::MapEnv::new([(var, value)])))
            .build()
            .await
            .expect_err(var);
        assert!(
            matches!(&err, Error::Config { var: v, .. } if v == var),
            "{var}={value}: {err}"
        );
    }
}

/// Every `"TE_..."` / `"MC_..."` string literal in the sources of te-core and the crates it can
/// compile in names a variable that `known_vars` lists, so the unknown-variable warning cannot
/// fire on a variable something reads.
#[test]
fn every_variable_in_the_sources_is_known() {
    let known = te_core::known_vars();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    // known_vars() lists what the compiled-in components read, so only their sources count
    // (`cargo test -p te-core` builds the default features alone).
    let dirs = [
        ("te-base/src", true),
        ("te-core/src", true),
        ("transports/local/src", cfg!(feature = "local")),
        ("transports/tcp/src", cfg!(feature = "tcp")),
        ("transports/shm/src", cfg!(feature = "shm")),
        ("transports/rdma/src", cfg!(feature = "rdma")),
        ("transports/efa/src", cfg!(feature = "efa")),
        ("plugins/cuda/src", cfg!(feature = "cuda")),
    ];
    let dirs = dirs.iter().filter(|(_, compiled)| *compiled).map(|(d, _)| *d);
    // Names that only tests and test support read.
    let test_only = ["TE_REQUIRE", "TE_ETCD_BIN"];
    let mut missing = Vec::new();
    for dir in dirs {
        let mut stack = vec![root.join(dir)];
        while let Some(d) = stack.pop() {
            for entry in std::fs::read_dir(&d).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    // Unit-test fixtures use made-up names (TE_X, MC_A).
                    if !path.ends_with("tests") {
                        stack.push(path);
                    }
                    continue;
                }
                if path.extension().is_none_or(|e| e != "rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                // Only the code before a file's unit tests.
                let code = text.split("#[cfg(test)]").next().unwrap_or("");
                for piece in code.split('"').skip(1).step_by(2) {
                    let is_var = (piece.starts_with("TE_") || piece.starts_with("MC_"))
                        && piece.len() > 3
                        && piece
                            .bytes()
                            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
                    let prefix_only =
                        piece.ends_with('_') || ["TE_TCP", "TE_RDMA", "TE_P2P", "TE_METRICS"].contains(&piece);
                    if is_var && !prefix_only && !known.iter().any(|k| k == piece) && !test_only.contains(&piece) {
                        missing.push(format!("{piece} ({})", path.display()));
                    }
                }
            }
        }
    }
    assert!(missing.is_empty(), "read but not in known_vars(): {missing:?}");
}

/// The deadline asks the transport to abort and leaves settling to it: until the transport
/// quiesced the batch stays in flight (its memory pinned), then every request fails with the
/// timeout.
#[tokio::test]
async fn a_deadline_aborts_through_the_transport_which_settles_the_requests() {
    let manual = ManualTransport::new();
    let a = manual_engine("deadline-manual", &manual).await;
    let src = a.allocate(8192, opts()).await.unwrap();
    let dst = a.allocate(8192, opts()).await.unwrap();
    let me = a.open_segment("deadline-manual").await.unwrap();
    let reqs = [
        TransferRequest::write(src.addr(), me.id(), dst.addr(), 4096),
        TransferRequest::write(src.addr() + 4096, me.id(), dst.addr() + 4096, 4096),
    ];
    let o = te_core::SubmitOptions {
        deadline: Some(std::time::Duration::from_millis(20)),
        ..Default::default()
    };
    let batch = a.submit_with(&reqs, &o).unwrap();
    let err = tokio::time::timeout(std::time::Duration::from_secs(20), manual.first_abort())
        .await
        .expect("the deadline never asked the transport to abort");
    assert!(err.is_timeout(), "{err}");
    assert!(err.to_string().contains("deadline-manual"), "{err}");
    assert!(
        !batch.is_complete(),
        "the engine settled requests the transport still holds"
    );
    manual.quiesce();
    let e = batch.wait().await.unwrap_err();
    assert_eq!(e.failures.len(), 2);
    assert!(e.failures.iter().all(|(_, e)| e.is_timeout()));
}

/// `register_raw_owned`: the owner outlives the handle while a batch holds the region, and goes
/// once the engine released it; a refused registration drops it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_registration_keeps_its_owner_until_the_region_is_released() {
    let e = engine("owned-raw").await;
    let mut mem = vec![0u8; 1 << 16];
    let owner = Arc::new(());
    let addr = mem.as_mut_ptr() as u64;
    // SAFETY: `mem` outlives the registration (it is dropped at the end of the test, after the
    // owner was released).
    let reg = unsafe {
        e.register_raw_owned(
            addr,
            1 << 16,
            MemoryLocation::HOST,
            RegisterOptions::default(),
            Box::new(owner.clone()),
        )
    }
    .await
    .unwrap();
    assert_eq!(Arc::strong_count(&owner), 2);
    let src = e.allocate(1 << 16, opts()).await.unwrap();
    let seg = e.open_segment("owned-raw").await.unwrap();
    drop(reg);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while Arc::strong_count(&owner) > 1 {
        assert!(std::time::Instant::now() < deadline, "the owner was never released");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // Released: the memory is no longer a target.
    let gone = e.submit(&[TransferRequest::write(src.addr(), seg.id(), addr, 64)]);
    assert!(gone.is_err() || gone.unwrap().wait().await.is_err());
    // Refused (zero length): the owner is dropped at once.
    let refused = Arc::new(());
    // SAFETY: nothing is registered (zero length is refused).
    let r = unsafe {
        e.register_raw_owned(
            addr,
            0,
            MemoryLocation::HOST,
            RegisterOptions::default(),
            Box::new(refused.clone()),
        )
    }
    .await;
    assert!(matches!(r, Err(Error::ZeroLength { .. })));
    assert_eq!(Arc::strong_count(&refused), 1);
    drop(mem);
}
