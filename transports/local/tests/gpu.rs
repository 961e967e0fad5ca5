//! Device copies on a real NVIDIA GPU, through the transport with the CUDA plugin and through the
//! whole engine (registration classifies the memory, the local transport moves it). Without a GPU
//! each test prints why and passes, unless `TE_REQUIRE` names `cuda` (scripts/gpu-check.sh sets
//! it), in which case a missing GPU fails.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use te_base::device::{CopyDirection, CopyFragment, DeviceBuffer, DevicePlugin};
use te_base::pattern::pattern_bytes;
use te_base::{
    BatchState, Error, ExportedBuffer, MemoryKind, MemoryLocation, RegionId, RegionInfo, RequestStatus,
    ResolvedRequest, SegmentDescriptor, SubmitContext, TransferOp, Transport, TransportEndpoint,
};
use te_core::config::MapEnv;
use te_core::{HostBufferOptions, RegisterOptions, TransferEngine, TransferRequest};
use te_transport_local::{LocalConfig, LocalTransport, NtKernel};

static NEXT_REGION: AtomicU64 = AtomicU64::new(1);

/// The KV-cache fragment sizes the local copy is measured with.
const FRAGMENT_SIZES: [u64; 3] = [1_728, 8_448, 37_440];

fn required() -> bool {
    te_base::test_support::required("cuda")
}

fn gpu() -> Option<Arc<dyn DevicePlugin>> {
    match te_plugin_cuda::load() {
        Ok(p) => Some(p),
        Err(e) if required() => panic!("TE_REQUIRE names cuda, but {e}"),
        Err(e) => {
            println!("skipping GPU test: {e}");
            None
        }
    }
}

/// Copies `data` into device memory at `addr`.
fn upload(cuda: &Arc<dyn DevicePlugin>, device: u32, addr: u64, data: &[u8]) {
    let f = CopyFragment {
        dst: addr,
        src: data.as_ptr() as u64,
        len: data.len() as u64,
    };
    // SAFETY: the caller passes live device memory of at least `data.len()` bytes; the copy
    // returns when the bytes have landed.
    unsafe { cuda.copy(device, CopyDirection::HostToDevice, f) }.unwrap();
}

/// Reads `len` bytes of device memory at `addr`.
fn download(cuda: &Arc<dyn DevicePlugin>, device: u32, addr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let f = CopyFragment {
        dst: out.as_mut_ptr() as u64,
        src: addr,
        len: len as u64,
    };
    // SAFETY: as in `upload`, the other way.
    unsafe { cuda.copy(device, CopyDirection::DeviceToHost, f) }.unwrap();
    out
}

fn region(base: u64, len: u64, location: MemoryLocation) -> RegionInfo {
    RegionInfo {
        id: RegionId(NEXT_REGION.fetch_add(1, Ordering::Relaxed)),
        base,
        len,
        location,
        exported: true,
    }
}

fn exported(r: &RegionInfo) -> ExportedBuffer {
    ExportedBuffer {
        base: r.base,
        len: r.len,
        location: r.location,
        keys: Default::default(),
    }
}

/// Fragment `i` of `n` at `frag` bytes: source slot `i`, destination slot permuted so nothing
/// coalesces.
fn slot(i: usize, n: usize, frag: u64) -> (u64, u64) {
    let stride = frag + 64;
    let mut mult = (n / 2 + 1) | 1;
    while gcd(mult, n) != 1 {
        mult += 2;
    }
    (i as u64 * stride, ((i * mult) % n) as u64 * stride)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The transport with the real plugin: every direction in one batch, byte exact; a request on a
/// device ordinal the driver does not have fails alone; requests writing the same device bytes run
/// in index order.
#[tokio::test]
async fn transport_moves_every_direction_with_the_cuda_plugin() {
    let Some(cuda) = gpu() else { return };
    assert_eq!(cuda.memory_kind(), MemoryKind::Cuda);
    let t =
        LocalTransport::with_devices(LocalConfig::default(), NtKernel::detect(), std::slice::from_ref(&cuda)).unwrap();
    const LEN: usize = 4 << 20;
    let host_src = pattern_bytes(1, 0, LEN);
    let mut host_dst = vec![0u8; LEN];
    let dev_a = DeviceBuffer::allocate(&cuda, 0, LEN as u64).unwrap();
    let dev_b = DeviceBuffer::allocate(&cuda, 0, LEN as u64).unwrap();
    let dev_lie = DeviceBuffer::allocate(&cuda, 0, 4096).unwrap();
    upload(&cuda, 0, dev_a.addr(), &pattern_bytes(2, 0, LEN));
    upload(&cuda, 0, dev_b.addr(), &vec![0u8; LEN]);
    let regions = [
        region(host_src.as_ptr() as u64, LEN as u64, MemoryLocation::HOST),
        region(host_dst.as_mut_ptr() as u64, LEN as u64, MemoryLocation::HOST),
        region(dev_a.addr(), LEN as u64, MemoryLocation::Cuda { device: 0 }),
        region(dev_b.addr(), LEN as u64, MemoryLocation::Cuda { device: 0 }),
        // Real device memory declared on an ordinal the driver does not have: the transport
        // trusts the registration, the plugin refuses the copy.
        region(dev_lie.addr(), 4096, MemoryLocation::Cuda { device: 99 }),
    ];
    t.register(&regions).await.unwrap();
    let mut d = SegmentDescriptor::new("self", 1);
    d.transports.push(TransportEndpoint {
        transport: "local".into(),
        info: t.endpoint(),
    });
    d.buffers = regions.iter().map(exported).collect();
    d.buffers.sort_by_key(|b| b.base);
    let peer = t.connect(&d).await.unwrap();
    let buf = |r: &RegionInfo| d.find_buffer(r.base, 1).unwrap() as u32;
    let [hs, hd, da, db, lie] = &regions;
    let write = |index: u32, local: &RegionInfo, loff: u64, remote: &RegionInfo, roff: u64, len: u64| ResolvedRequest {
        index,
        op: TransferOp::Write,
        len,
        local_addr: local.base + loff,
        local_region: local.id,
        remote_addr: remote.base + roff,
        remote_buffer: buf(remote),
    };

    // host -> device b, device a -> device b, device a -> host, host -> host, and the lie.
    let mut reqs = Vec::new();
    let mut expect: Vec<(&RegionInfo, u64, u64, &RegionInfo, u64)> = Vec::new();
    let mut off = 0u64;
    for (k, &frag) in FRAGMENT_SIZES.iter().enumerate() {
        let n = 16;
        for i in 0..n {
            let (s, dst) = slot(i, n, frag);
            let (s, dst) = (s + off, dst + off);
            let (src_r, dst_r) = match (k + i) % 3 {
                0 => (hs, db),
                1 => (da, db),
                _ => (da, hd),
            };
            reqs.push(write(reqs.len() as u32, src_r, s, dst_r, dst, frag));
            expect.push((src_r, s, frag, dst_r, dst));
        }
        off += 16 * (frag + 64);
    }
    let host_index = reqs.len();
    reqs.push(write(host_index as u32, hs, 0, hd, (LEN - 4096) as u64, 4096));
    let lie_index = reqs.len();
    reqs.push(write(lie_index as u32, hs, 0, lie, 0, 64));
    let n = reqs.len();
    let state = BatchState::new(reqs.iter().map(|r| r.len).collect());
    peer.submit(reqs, &state, &SubmitContext::default()).unwrap();
    assert!(state.is_complete());
    for i in 0..n {
        let s = state.status(i).unwrap();
        if i == lie_index {
            assert!(matches!(&s, RequestStatus::Failed(Error::NotAvailable { .. })), "{s:?}");
        } else {
            assert!(matches!(s, RequestStatus::Done { .. }), "request {i}: {s:?}");
        }
    }
    let read = |r: &RegionInfo| -> Vec<u8> {
        if r.location.is_host() {
            // SAFETY: host regions are the two vectors above, alive and not being copied.
            unsafe { std::slice::from_raw_parts(r.base as *const u8, r.len as usize) }.to_vec()
        } else {
            download(&cuda, 0, r.base, r.len as usize)
        }
    };
    let (a_now, b_now, hd_now, hs_now) = (read(da), read(db), read(hd), read(hs));
    let bytes = |r: &RegionInfo| -> &Vec<u8> {
        if r.id == hs.id {
            &hs_now
        } else if r.id == da.id {
            &a_now
        } else if r.id == db.id {
            &b_now
        } else {
            &hd_now
        }
    };
    for (src_r, s, len, dst_r, dst) in expect {
        let (s, len, dst) = (s as usize, len as usize, dst as usize);
        assert_eq!(
            &bytes(dst_r)[dst..dst + len],
            &bytes(src_r)[s..s + len],
            "{len} B fragment"
        );
    }
    assert_eq!(&hd_now[LEN - 4096..], &host_src[..4096]);

    // Two writes to overlapping device bytes: run one by one, the later index wins.
    let reqs = vec![write(0, hs, 0, db, 100, 1000), write(1, hs, 5000, db, 600, 1000)];
    let state = BatchState::new(reqs.iter().map(|r| r.len).collect());
    peer.submit(reqs, &state, &SubmitContext::default()).unwrap();
    assert!((0..2).all(|i| matches!(state.status(i), Some(RequestStatus::Done { .. }))));
    let b_now = download(&cuda, 0, dev_b.addr(), 1600);
    assert_eq!(&b_now[100..600], &host_src[..500]);
    assert_eq!(&b_now[600..1600], &host_src[5000..6000]);
    t.deregister(&regions).await.unwrap();
    drop(host_dst);
}

/// The engine end to end: device memory registered (classified once by the plugin), scattered
/// KV-cache fragments host->device, device->device and device->host, every byte back.
#[test]
fn engine_round_trips_kv_fragments_through_device_memory() {
    let Some(cuda) = gpu() else { return };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let engine = rt
        .block_on(
            TransferEngine::builder()
                .segment_name(format!("gpu-local-{}", std::process::id()))
                .env(Arc::new(MapEnv::new([("TE_COPY_THREADS", "2")])))
                .transports(["local"])
                .build(),
        )
        .unwrap();
    for frag in FRAGMENT_SIZES {
        let n = 257usize;
        let span = n as u64 * (frag + 64);
        let src = rt
            .block_on(engine.allocate_with(
                span as usize,
                HostBufferOptions::default(),
                RegisterOptions::local_only(),
            ))
            .unwrap();
        let back = rt
            .block_on(engine.allocate_with(
                span as usize,
                HostBufferOptions::default(),
                RegisterOptions::local_only(),
            ))
            .unwrap();
        let data = pattern_bytes(frag, 0, span as usize);
        src.write_at(0, &data).unwrap();
        let dev_a = DeviceBuffer::allocate(&cuda, 0, span).unwrap();
        let dev_b = DeviceBuffer::allocate(&cuda, 0, span).unwrap();
        let cuda0 = MemoryLocation::Cuda { device: 0 };
        let (reg_a, reg_b) = rt.block_on(async {
            // SAFETY: both buffers are live device memory of device 0 and outlive their
            // registrations (deregistered at the end of this iteration, after every batch).
            let a = unsafe { engine.register_raw(dev_a.addr(), span, cuda0, RegisterOptions::default()) }.await;
            // SAFETY: as for `a`.
            let b = unsafe { engine.register_raw(dev_b.addr(), span, cuda0, RegisterOptions::default()) }.await;
            (a.unwrap(), b.unwrap())
        });
        // Declared on the wrong device: refused at registration.
        // SAFETY: refused before anything is registered.
        let wrong = rt.block_on(unsafe {
            engine.register_raw(
                dev_a.addr() + span / 2,
                64,
                MemoryLocation::Cuda { device: 1 },
                RegisterOptions::default(),
            )
        });
        assert!(
            matches!(
                wrong,
                Err(Error::WrongMemoryKind { .. }) | Err(Error::AlreadyRegistered { .. })
            ),
            "{wrong:?}"
        );
        let me = rt.block_on(engine.open_segment(engine.segment_name())).unwrap();
        let slots: Vec<(u64, u64)> = (0..n).map(|i| slot(i, n, frag)).collect();
        // host -> a (permuted), a -> b (same slots), b -> host (permuted back).
        let h2d: Vec<TransferRequest> = slots
            .iter()
            .map(|&(s, d)| TransferRequest::write(src.addr() + s, me.id(), dev_a.addr() + d, frag))
            .collect();
        let d2d: Vec<TransferRequest> = slots
            .iter()
            .map(|&(_, d)| TransferRequest::write(dev_a.addr() + d, me.id(), dev_b.addr() + d, frag))
            .collect();
        let d2h: Vec<TransferRequest> = slots
            .iter()
            .map(|&(s, d)| TransferRequest::read(back.addr() + s, me.id(), dev_b.addr() + d, frag))
            .collect();
        for reqs in [&h2d, &d2d, &d2h] {
            let batch = engine.submit(reqs).unwrap();
            match batch.wait_blocking(None) {
                Some(Ok(_)) => {}
                other => panic!("{frag} B: {other:?}"),
            }
        }
        let mut out = vec![0u8; span as usize];
        back.read_at(0, &mut out).unwrap();
        for &(s, _) in &slots {
            let r = s as usize..(s + frag) as usize;
            assert_eq!(&out[r.clone()], &data[r], "{frag} B fragment at {s}");
        }
        // Deregistered before the device memory is freed (end of the iteration).
        rt.block_on(async {
            reg_a.deregister().await.unwrap();
            reg_b.deregister().await.unwrap();
        });
    }
}
