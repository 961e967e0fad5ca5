//! Device memory through the local copy, without a GPU: an in-process fake `DevicePlugin` keeps
//! "device memory" in host allocations, checks that every copy it is given goes the way its
//! direction says, runs the copies only when the pending handle is waited on (so a transport that
//! completed a batch without waiting would leave the bytes unmoved) and records every call.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use te_base::device::{
    CopyDirection, CopyFragment, DevicePlugin, DeviceRuntimeInfo, DmaBufExport, PendingCopy, PointerKind,
};
use te_base::{
    BatchState, Error, ExportedBuffer, MemoryKind, MemoryKinds, MemoryLocation, Peer, RegionId, RegionInfo,
    RequestStatus, ResolvedRequest, SegmentDescriptor, SubmitContext, TransferOp, Transport, TransportEndpoint,
};
use te_transport_local::{LocalConfig, LocalTransport, NtKernel};

static NEXT_REGION: AtomicU64 = AtomicU64::new(1);

/// One `copy_async` call as the fake saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct AsyncCall {
    device: u32,
    direction: CopyDirection,
    fragments: Vec<CopyFragment>,
}

#[derive(Debug, Default)]
struct FakeState {
    /// Device allocations: base -> (device, memory).
    memory: BTreeMap<u64, (u32, Box<[u8]>)>,
    async_calls: Vec<AsyncCall>,
    sync_calls: Vec<(u32, CopyDirection, CopyFragment)>,
}

/// A device runtime whose device memory is host memory.
#[derive(Debug)]
struct FakeDevice {
    kind: MemoryKind,
    state: Mutex<FakeState>,
    waits: AtomicUsize,
    /// `copy_async` on this device fails at once (`u32::MAX`: never).
    fail_start_on: AtomicU64,
    /// Waiting on a copy of this device fails (`u32::MAX`: never).
    fail_wait_on: AtomicU64,
}

impl FakeDevice {
    fn new(kind: MemoryKind) -> Arc<FakeDevice> {
        Arc::new(FakeDevice {
            kind,
            state: Mutex::new(FakeState::default()),
            waits: AtomicUsize::new(0),
            fail_start_on: AtomicU64::new(u64::from(u32::MAX)),
            fail_wait_on: AtomicU64::new(u64::from(u32::MAX)),
        })
    }

    /// The device whose allocation holds `[addr, addr + len)`, if any.
    fn device_of(&self, addr: u64, len: u64) -> Option<u32> {
        let state = self.state.lock();
        let (&base, (device, mem)) = state.memory.range(..=addr).next_back()?;
        (addr + len <= base + mem.len() as u64).then_some(*device)
    }

    /// Checks that a copy goes where `direction` says, with `device` running it.
    fn check(&self, device: u32, direction: CopyDirection, f: &CopyFragment) -> te_base::Result<()> {
        let (src, dst) = (self.device_of(f.src, f.len), self.device_of(f.dst, f.len));
        let ok = match direction {
            CopyDirection::HostToDevice => src.is_none() && dst == Some(device),
            CopyDirection::DeviceToHost => src == Some(device) && dst.is_none(),
            CopyDirection::DeviceToDevice => src == Some(device) && dst.is_some(),
        };
        if ok {
            Ok(())
        } else {
            Err(Error::transport(
                "fake",
                format!("{direction} on device {device} got source {src:?}, destination {dst:?}"),
            ))
        }
    }

    fn async_calls(&self) -> Vec<AsyncCall> {
        self.state.lock().async_calls.clone()
    }

    fn sync_calls(&self) -> usize {
        self.state.lock().sync_calls.len()
    }
}

/// Copies run when waited on (or dropped, as the trait requires).
struct FakePending {
    plugin: Arc<FakeDevice>,
    device: u32,
    fragments: Vec<CopyFragment>,
    done: bool,
}

impl FakePending {
    fn finish(&mut self) -> te_base::Result<()> {
        if self.done {
            return Ok(());
        }
        self.done = true;
        self.plugin.waits.fetch_add(1, Ordering::Relaxed);
        if u64::from(self.device) == self.plugin.fail_wait_on.load(Ordering::Relaxed) {
            return Err(Error::transport(
                "fake",
                format!("copy on device {} failed", self.device),
            ));
        }
        for f in &self.fragments {
            // SAFETY: the transport guarantees both ranges stay valid until the copy completes;
            // the fake checked them against its allocations and the test's registered memory.
            unsafe { std::ptr::copy_nonoverlapping(f.src as *const u8, f.dst as *mut u8, f.len as usize) };
        }
        Ok(())
    }
}

impl PendingCopy for FakePending {
    fn is_complete(&self) -> te_base::Result<bool> {
        Ok(self.done)
    }

    fn wait(mut self: Box<Self>) -> te_base::Result<()> {
        self.finish()
    }
}

impl Drop for FakePending {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// The fake as a trait object that can hand out `Arc<FakeDevice>` to its pending copies.
#[derive(Debug)]
struct Fake(Arc<FakeDevice>);

impl DevicePlugin for Fake {
    fn name(&self) -> &'static str {
        "fake"
    }
    fn memory_kind(&self) -> MemoryKind {
        self.0.kind
    }
    fn info(&self) -> DeviceRuntimeInfo {
        DeviceRuntimeInfo {
            name: "fake",
            library: "none".into(),
            driver_version: None,
            runtime_version: None,
            devices: 2,
        }
    }
    fn device_count(&self) -> u32 {
        2
    }
    fn pci_bus_id(&self, device: u32) -> te_base::Result<String> {
        Ok(format!("0000:0{device}:00.0"))
    }
    fn classify(&self, addr: u64) -> te_base::Result<PointerKind> {
        Ok(match self.0.device_of(addr, 1) {
            Some(device) => PointerKind::Device { device },
            None => PointerKind::Host,
        })
    }
    fn allocate(&self, device: u32, len: u64) -> te_base::Result<u64> {
        let mem = vec![0u8; len as usize].into_boxed_slice();
        let addr = mem.as_ptr() as u64;
        self.0.state.lock().memory.insert(addr, (device, mem));
        Ok(addr)
    }
    unsafe fn free(&self, _device: u32, addr: u64) -> te_base::Result<()> {
        self.0.state.lock().memory.remove(&addr);
        Ok(())
    }
    unsafe fn copy(&self, device: u32, direction: CopyDirection, f: CopyFragment) -> te_base::Result<()> {
        self.0.check(device, direction, &f)?;
        self.0.state.lock().sync_calls.push((device, direction, f));
        // SAFETY: as in `FakePending::finish`.
        unsafe { std::ptr::copy_nonoverlapping(f.src as *const u8, f.dst as *mut u8, f.len as usize) };
        Ok(())
    }
    unsafe fn copy_async(
        &self,
        device: u32,
        direction: CopyDirection,
        fragments: &[CopyFragment],
    ) -> te_base::Result<Box<dyn PendingCopy>> {
        self.0.state.lock().async_calls.push(AsyncCall {
            device,
            direction,
            fragments: fragments.to_vec(),
        });
        if u64::from(device) == self.0.fail_start_on.load(Ordering::Relaxed) {
            return Err(Error::transport("fake", format!("cannot start on device {device}")));
        }
        for (i, f) in fragments.iter().enumerate() {
            f.validate(i)?;
            self.0.check(device, direction, f)?;
        }
        Ok(Box::new(FakePending {
            plugin: self.0.clone(),
            device,
            fragments: fragments.to_vec(),
            done: false,
        }))
    }
    fn export_dmabuf(&self, _: u32, _: u64, _: u64) -> te_base::Result<DmaBufExport> {
        Err(Error::not_available("fake", "no dma-buf"))
    }
}

/// Memory registered on one transport: host (a Vec) or fake device memory.
struct Mem {
    info: RegionInfo,
    _host: Option<Box<[u8]>>,
}

impl Mem {
    fn bytes(&self) -> &[u8] {
        // SAFETY: read only between batches; the memory lives as long as `self` (host) or the
        // fake plugin's allocation (device; the tests never free it early).
        unsafe { std::slice::from_raw_parts(self.info.base as *const u8, self.info.len as usize) }
    }

    fn fill(&self, seed: u8) {
        // SAFETY: written only between batches, as above.
        let s = unsafe { std::slice::from_raw_parts_mut(self.info.base as *mut u8, self.info.len as usize) };
        te_base::pattern::fill_pattern(s, seed as u64, 0);
    }

    fn exported(&self) -> ExportedBuffer {
        ExportedBuffer::of_region(&self.info)
    }
}

async fn host(t: &LocalTransport, len: usize, seed: u8) -> Mem {
    let mem = vec![0u8; len].into_boxed_slice();
    let m = Mem {
        info: region(mem.as_ptr() as u64, len, MemoryLocation::HOST),
        _host: Some(mem),
    };
    m.fill(seed);
    t.register(std::slice::from_ref(&m.info)).await.unwrap();
    m
}

async fn device(t: &LocalTransport, plugin: &Fake, location: MemoryLocation, len: usize, seed: u8) -> Mem {
    let ordinal = match location {
        MemoryLocation::Cuda { device } | MemoryLocation::Rocm { device } => device,
        MemoryLocation::Host { .. } => unreachable!("device memory expected"),
    };
    let addr = plugin.allocate(ordinal, len as u64).unwrap();
    let m = Mem {
        info: region(addr, len, location),
        _host: None,
    };
    m.fill(seed);
    t.register(std::slice::from_ref(&m.info)).await.unwrap();
    m
}

fn region(base: u64, len: usize, location: MemoryLocation) -> RegionInfo {
    RegionInfo {
        id: RegionId(NEXT_REGION.fetch_add(1, Ordering::Relaxed)),
        base,
        len: len as u64,
        location,
        exported: true,
    }
}

fn descriptor(name: &str, t: &LocalTransport, exported: &[&Mem]) -> SegmentDescriptor {
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

fn transport(plugins: &[Arc<dyn DevicePlugin>]) -> LocalTransport {
    let config = LocalConfig {
        copy_threads: 2,
        ..LocalConfig::default()
    };
    LocalTransport::with_devices(config, NtKernel::detect(), plugins).unwrap()
}

/// A request of `len` bytes between `local` at `loff` and `remote` at `roff`.
#[allow(clippy::too_many_arguments)]
fn req(
    d: &SegmentDescriptor,
    index: u32,
    op: TransferOp,
    local: &Mem,
    loff: u64,
    remote: &Mem,
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
        remote_buffer: d.find_buffer(remote.info.base, 1).unwrap() as u32,
    }
}

fn run(peer: &Arc<dyn Peer>, reqs: Vec<ResolvedRequest>) -> Vec<RequestStatus> {
    let n = reqs.len();
    let state = BatchState::new(reqs.iter().map(|r| r.len).collect());
    peer.submit(reqs, &state, &SubmitContext::default()).unwrap();
    assert!(state.is_complete(), "batch still pending after submit");
    (0..n).map(|i| state.status(i).unwrap()).collect()
}

fn is_done(s: &RequestStatus) -> bool {
    matches!(s, RequestStatus::Done { .. })
}

/// The initiator `a` with host memory and device memory of device 0; the target `b` with device
/// memory on devices 0 and 1 and host memory; everything 64 KiB.
struct World {
    fake: Arc<FakeDevice>,
    plugin: Fake,
    peer: Arc<dyn Peer>,
    desc: SegmentDescriptor,
    a_host: Mem,
    a_dev0: Mem,
    b_dev0: Mem,
    b_dev1: Mem,
    b_host: Mem,
    _t: (LocalTransport, LocalTransport),
}

const LEN: usize = 1 << 16;

async fn world() -> World {
    let fake = FakeDevice::new(MemoryKind::Cuda);
    let plugin = Fake(fake.clone());
    let plugins: Vec<Arc<dyn DevicePlugin>> = vec![Arc::new(Fake(fake.clone()))];
    let (a, b) = (transport(&plugins), transport(&plugins));
    let a_host = host(&a, LEN, 1).await;
    let a_dev0 = device(&a, &plugin, MemoryLocation::Cuda { device: 0 }, LEN, 2).await;
    let b_dev0 = device(&b, &plugin, MemoryLocation::Cuda { device: 0 }, LEN, 3).await;
    let b_dev1 = device(&b, &plugin, MemoryLocation::Cuda { device: 1 }, LEN, 4).await;
    let b_host = host(&b, LEN, 5).await;
    let desc = descriptor("b", &b, &[&b_dev0, &b_dev1, &b_host]);
    let peer = a.connect(&desc).await.unwrap();
    World {
        fake,
        plugin,
        peer,
        desc,
        a_host,
        a_dev0,
        b_dev0,
        b_dev1,
        b_host,
        _t: (a, b),
    }
}

#[tokio::test]
async fn capabilities_follow_the_loaded_plugins() {
    let none = transport(&[]);
    assert_eq!(none.capabilities().local, MemoryKinds::HOST);
    assert_eq!(none.capabilities().remote, MemoryKinds::HOST);
    let cuda: Arc<dyn DevicePlugin> = Arc::new(Fake(FakeDevice::new(MemoryKind::Cuda)));
    let rocm: Arc<dyn DevicePlugin> = Arc::new(Fake(FakeDevice::new(MemoryKind::Rocm)));
    let both = transport(&[cuda.clone(), rocm]);
    let kinds = MemoryKinds::of(&[MemoryKind::Host, MemoryKind::Cuda, MemoryKind::Rocm]);
    assert_eq!((both.capabilities().local, both.capabilities().remote), (kinds, kinds));
    let one = transport(&[cuda]);
    assert!(one.capabilities().remote.contains(MemoryKind::Cuda));
    assert!(!one.capabilities().local.contains(MemoryKind::Rocm));

    // The engine's install path hands the plugins over the same way.
    let ctx = te_base::InstallContext {
        auth: None,
        env: Arc::new(te_base::config::MapEnv::new([("TE_COPY_THREADS", "1")])),
        segment_name: "a".into(),
        devices: vec![Arc::new(Fake(FakeDevice::new(MemoryKind::Cuda)))],
        notifications: te_base::NotifyInbox::new(Default::default()),
    };
    let installed = te_transport_local::install(&ctx).await.unwrap();
    assert!(installed.capabilities().local.contains(MemoryKind::Cuda));
}

/// One batch with every direction: one `copy_async` per (direction, device), adjacent fragments
/// coalesced, every byte where its request said, every request done.
#[tokio::test]
async fn one_batched_copy_per_direction_and_device() {
    let w = world().await;
    let d = &w.desc;
    let frag = 1728u64;
    let mut reqs = Vec::new();
    let mut push = |op, local: &Mem, loff, remote: &Mem, roff, len| {
        let i = reqs.len() as u32;
        reqs.push(req(d, i, op, local, loff, remote, roff, len));
    };
    // host -> device 0: eight adjacent fragments submitted in reverse (one copy after coalescing),
    // plus one apart.
    for k in (0..8u64).rev() {
        push(TransferOp::Write, &w.a_host, k * frag, &w.b_dev0, k * frag, frag);
    }
    push(TransferOp::Write, &w.a_host, 20_000, &w.b_dev0, 30_000, 100);
    // host -> device 1.
    push(TransferOp::Write, &w.a_host, 40_000, &w.b_dev1, 1000, 8448);
    // device 0 -> host (a read of remote device memory into local host memory).
    push(TransferOp::Read, &w.a_host, 50_000, &w.b_dev0, 40_000, 5000);
    // device 0 (local) -> device 1 (remote), two adjacent.
    push(TransferOp::Write, &w.a_dev0, 0, &w.b_dev1, 20_000, 3000);
    push(TransferOp::Write, &w.a_dev0, 3000, &w.b_dev1, 23_000, 3000);
    // device 1 (remote) -> device 0 (local): runs on device 1's stream.
    push(TransferOp::Read, &w.a_dev0, 10_000, &w.b_dev1, 50_000, 777);
    // host -> host stays on the CPU path.
    push(TransferOp::Write, &w.a_host, 60_000, &w.b_host, 100, 4000);

    let (src_host, src_dev0, b_dev1_before) = (
        w.a_host.bytes().to_vec(),
        w.a_dev0.bytes().to_vec(),
        w.b_dev1.bytes().to_vec(),
    );
    let b_dev0_before = w.b_dev0.bytes().to_vec();
    let st = run(&w.peer, reqs);
    assert!(st.iter().all(is_done), "{st:?}");

    let mut calls = w.fake.async_calls();
    calls.sort_by_key(|c| (c.device, format!("{}", c.direction)));
    let summary: Vec<(u32, CopyDirection, usize)> = calls
        .iter()
        .map(|c| (c.device, c.direction, c.fragments.len()))
        .collect();
    assert_eq!(
        summary,
        vec![
            (0, CopyDirection::DeviceToDevice, 1),
            (0, CopyDirection::DeviceToHost, 1),
            (0, CopyDirection::HostToDevice, 2),
            (1, CopyDirection::DeviceToDevice, 1),
            (1, CopyDirection::HostToDevice, 1),
        ]
    );
    let h2d0 = calls
        .iter()
        .find(|c| c.device == 0 && c.direction == CopyDirection::HostToDevice)
        .unwrap();
    assert_eq!(h2d0.fragments[0].len, 8 * frag, "adjacent fragments coalesced");
    assert_eq!(
        w.fake.waits.load(Ordering::Relaxed),
        5,
        "every started copy was waited on"
    );
    assert_eq!(w.fake.sync_calls(), 0);

    let (b0, b1, a0, ah, bh) = (
        w.b_dev0.bytes(),
        w.b_dev1.bytes(),
        w.a_dev0.bytes(),
        w.a_host.bytes(),
        w.b_host.bytes(),
    );
    let n = 8 * frag as usize;
    assert_eq!(&b0[..n], &src_host[..n]);
    assert_eq!(&b0[30_000..30_100], &src_host[20_000..20_100]);
    assert_eq!(
        &b0[n..30_000],
        &b_dev0_before[n..30_000],
        "bytes between requests untouched"
    );
    assert_eq!(&b1[1000..9448], &src_host[40_000..48_448]);
    assert_eq!(&ah[50_000..55_000], &b_dev0_before[40_000..45_000]);
    assert_eq!(&b1[20_000..26_000], &src_dev0[..6000]);
    assert_eq!(&a0[10_000..10_777], &b_dev1_before[50_000..50_777]);
    assert_eq!(&bh[100..4100], &src_host[60_000..64_000]);
}

/// A plugin error fails the requests of its group, and only those.
#[tokio::test]
async fn plugin_errors_fail_only_their_group() {
    for fail_at_start in [true, false] {
        let w = world().await;
        let d = &w.desc;
        let flag = if fail_at_start {
            &w.fake.fail_start_on
        } else {
            &w.fake.fail_wait_on
        };
        flag.store(1, Ordering::Relaxed);
        let b1_before = w.b_dev1.bytes().to_vec();
        let reqs = vec![
            req(d, 0, TransferOp::Write, &w.a_host, 0, &w.b_dev0, 0, 4096),
            req(d, 1, TransferOp::Write, &w.a_host, 0, &w.b_dev1, 0, 4096),
            req(d, 2, TransferOp::Write, &w.a_host, 8192, &w.b_dev1, 8192, 100),
            req(d, 3, TransferOp::Read, &w.a_host, 16_384, &w.b_dev1, 16_384, 100), // device 1 -> host
            req(d, 4, TransferOp::Write, &w.a_host, 0, &w.b_host, 0, 4096),
        ];
        let st = run(&w.peer, reqs);
        for (i, s) in st.iter().enumerate() {
            let in_failed_group = i == 1 || i == 2 || i == 3;
            match s {
                RequestStatus::Failed(Error::Transport { transport, message, .. }) if in_failed_group => {
                    assert_eq!(transport, "fake");
                    assert!(message.contains("device 1"), "{message}");
                }
                s if !in_failed_group => assert!(is_done(s), "request {i}: {s:?}"),
                s => panic!("request {i} should have failed: {s:?}"),
            }
        }
        assert_eq!(&w.b_dev0.bytes()[..4096], &w.a_host.bytes()[..4096]);
        assert_eq!(&w.b_host.bytes()[..4096], &w.a_host.bytes()[..4096]);
        assert_eq!(w.b_dev1.bytes(), &b1_before[..], "a failed group moved bytes");
        // Device 1 had two groups (host->device, device->host): both failed, neither was retried.
        let on_dev1 = w.fake.async_calls().iter().filter(|c| c.device == 1).count();
        assert_eq!(on_dev1, 2);
    }
}

/// Without a plugin for a kind, its requests fail with a typed error naming the missing plugin,
/// and host requests of the same batch are served.
#[tokio::test]
async fn without_a_plugin_device_requests_name_what_is_missing() {
    let fake = FakeDevice::new(MemoryKind::Cuda);
    let plugin = Fake(fake.clone());
    let (a, b) = (transport(&[]), transport(&[]));
    let a_host = host(&a, LEN, 1).await;
    let b_dev = device(&b, &plugin, MemoryLocation::Cuda { device: 0 }, LEN, 2).await;
    let b_host = host(&b, LEN, 3).await;
    let d = descriptor("b", &b, &[&b_dev, &b_host]);
    let peer = a.connect(&d).await.unwrap();
    let st = run(
        &peer,
        vec![
            req(&d, 0, TransferOp::Write, &a_host, 0, &b_dev, 0, 64),
            req(&d, 1, TransferOp::Write, &a_host, 0, &b_host, 0, 64),
        ],
    );
    match &st[0] {
        RequestStatus::Failed(e @ Error::WrongMemoryKind { .. }) => assert_eq!(
            e.to_string(),
            "transport 'local' cannot serve remote cuda:0 (no cuda device plugin is loaded) memory"
        ),
        other => panic!("{other:?}"),
    }
    assert!(is_done(&st[1]));
    assert!(fake.async_calls().is_empty());

    // A CUDA plugin does not serve ROCm memory, and device->device between runtimes is refused.
    let w = world().await;
    let rocm = device(&w._t.0, &w.plugin, MemoryLocation::Rocm { device: 0 }, 4096, 9).await;
    let st = run(
        &w.peer,
        vec![
            req(&w.desc, 0, TransferOp::Write, &rocm, 0, &w.b_host, 0, 64),
            req(&w.desc, 1, TransferOp::Write, &rocm, 0, &w.b_dev0, 0, 64),
        ],
    );
    for s in &st {
        assert!(
            matches!(s, RequestStatus::Failed(Error::WrongMemoryKind { .. })),
            "{s:?}"
        );
    }
    assert!(w.fake.async_calls().is_empty());
}

/// Requests that write the same device bytes run one at a time in index order with the plugin's
/// synchronous copy; a device request overlapping itself is refused.
#[tokio::test]
async fn overlapping_device_requests_run_in_index_order() {
    let w = world().await;
    let d = &w.desc;
    let st = run(
        &w.peer,
        vec![
            req(d, 0, TransferOp::Write, &w.a_host, 0, &w.b_dev0, 100, 1000),
            req(d, 1, TransferOp::Write, &w.a_host, 5000, &w.b_dev0, 600, 1000),
            req(d, 2, TransferOp::Write, &w.a_host, 9000, &w.b_host, 0, 10),
        ],
    );
    assert!(st.iter().all(is_done), "{st:?}");
    assert!(w.fake.async_calls().is_empty());
    assert_eq!(w.fake.sync_calls(), 2);
    let (b0, ah) = (w.b_dev0.bytes(), w.a_host.bytes());
    assert_eq!(&b0[100..600], &ah[..500]);
    assert_eq!(&b0[600..1600], &ah[5000..6000], "the later request wins");
    assert_eq!(&w.b_host.bytes()[..10], &ah[9000..9010]);

    // Device memory copied onto an overlapping range of itself (same segment, local read).
    let me = descriptor("a", &w._t.0, &[&w.a_dev0]);
    let self_peer = w._t.0.connect(&me).await.unwrap();
    let st = run(
        &self_peer,
        vec![req(&me, 0, TransferOp::Write, &w.a_dev0, 0, &w.a_dev0, 10, 100)],
    );
    assert!(
        matches!(&st[0], RequestStatus::Failed(Error::Transport { .. })),
        "{st:?}"
    );
}

/// Scattered fragments of the bench's sizes, host->device->host through two batches: every byte
/// comes back, and each batch is one `copy_async`.
#[tokio::test]
async fn scattered_fragments_round_trip_byte_exact() {
    for frag in [1728u64, 8448, 37_440] {
        let w = world().await;
        let d = &w.desc;
        let n = (LEN as u64 / (frag + 64)) as usize;
        // Destination slots permuted so nothing coalesces.
        let slot = |i: usize| ((i * 5 + 3) % n) as u64 * (frag + 64);
        let writes = (0..n)
            .map(|i| {
                req(
                    d,
                    i as u32,
                    TransferOp::Write,
                    &w.a_host,
                    i as u64 * (frag + 64),
                    &w.b_dev1,
                    slot(i),
                    frag,
                )
            })
            .collect();
        assert!(run(&w.peer, writes).iter().all(is_done));
        let back = host(&w._t.0, LEN, 0).await;
        let reads = (0..n)
            .map(|i| {
                req(
                    d,
                    i as u32,
                    TransferOp::Read,
                    &back,
                    i as u64 * (frag + 64),
                    &w.b_dev1,
                    slot(i),
                    frag,
                )
            })
            .collect();
        assert!(run(&w.peer, reads).iter().all(is_done));
        for i in 0..n {
            let r = (i as u64 * (frag + 64)) as usize..(i as u64 * (frag + 64) + frag) as usize;
            assert_eq!(&back.bytes()[r.clone()], &w.a_host.bytes()[r], "{frag} B fragment {i}");
        }
        let calls = w.fake.async_calls();
        assert_eq!(calls.len(), 2, "{frag} B: one call per batch");
        assert!(calls.iter().all(|c| c.device == 1 && c.fragments.len() == n));
        assert_eq!(calls[0].direction, CopyDirection::HostToDevice);
        assert_eq!(calls[1].direction, CopyDirection::DeviceToHost);
    }
}

/// A batch to one device with no host requests takes the single-group plan: adjacent fragments
/// still coalesce, in any submission order, and every byte lands.
#[tokio::test]
async fn a_single_group_batch_is_coalesced() {
    let w = world().await;
    let d = &w.desc;
    // Four runs of four adjacent 1,000 B fragments, submitted shuffled; runs 1,000 B apart.
    let mut reqs = Vec::new();
    for k in [3u64, 0, 2, 1] {
        for j in [1u64, 3, 0, 2] {
            let off = k * 5000 + j * 1000;
            let i = reqs.len() as u32;
            reqs.push(req(d, i, TransferOp::Write, &w.a_host, off, &w.b_dev1, off + 7, 1000));
        }
    }
    assert!(run(&w.peer, reqs).iter().all(is_done));
    let calls = w.fake.async_calls();
    assert_eq!(calls.len(), 1);
    let lens: Vec<u64> = calls[0].fragments.iter().map(|f| f.len).collect();
    assert_eq!(lens, vec![4000; 4]);
    assert_eq!((calls[0].device, calls[0].direction), (1, CopyDirection::HostToDevice));
    for k in 0..4usize {
        let r = k * 5000..k * 5000 + 4000;
        assert_eq!(&w.b_dev1.bytes()[r.start + 7..r.end + 7], &w.a_host.bytes()[r]);
    }
}
