//! Rail-local placement and GPU registration over the recording fake, on te-base's DGX-A100-like
//! RoCE fixture (8 GPUs and 8 NICs mlx5_0..7; NUMA 0 holds mlx5_0..3, NUMA 1 mlx5_4..7; GPU
//! `07:00.0` shares a PCIe switch with mlx5_0, `0f` with mlx5_1 ... `bd` with mlx5_7).

use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;
use te_base::config::MapEnv;
use te_base::device::{
    CopyDirection, CopyFragment, DevicePlugin, DeviceRuntimeInfo, DmaBufExport, PendingCopy, PointerKind,
};
use te_base::{
    Error, HostBuffer, HostBufferOptions, MemoryKind, MemoryLocation, RegionId, RegionInfo, RequestStatus, Result,
    Transport,
};
use te_topology::NicPlacement;

use super::tests::{bytes, config, descriptor, fabric, run, transitions_of, write, Fake, Region};
use super::RdmaTransport;
use crate::protocol::qp_state::QpTransition;
use crate::protocol::remote_keys::BufferKeys;
use crate::verbs::fake::{Call, FakeDevice, RecordingVerbs};
use crate::verbs::Verbs;

const GPU_BUS_IDS: [&str; 8] = [
    "0000:07:00.0",
    "0000:0f:00.0",
    "0000:47:00.0",
    "0000:4e:00.0",
    "0000:87:00.0",
    "0000:90:00.0",
    "0000:b7:00.0",
    "0000:bd:00.0",
];

/// A CUDA runtime stand-in: reports bus ids (its ordinal order), and exports "dma-bufs" (an fd of
/// `/dev/null`, recorded) or refuses to.
#[derive(Debug)]
struct FakeGpu {
    bus_ids: Vec<String>,
    dmabuf: bool,
    exports: Mutex<Vec<(u32, u64, u64)>>,
}

impl FakeGpu {
    /// Ordinals in reverse bus order (as `CUDA_VISIBLE_DEVICES=7,6,...,0` would number them).
    fn reversed(dmabuf: bool) -> Arc<FakeGpu> {
        Arc::new(FakeGpu {
            bus_ids: GPU_BUS_IDS.iter().rev().map(|s| s.to_string()).collect(),
            dmabuf,
            exports: Mutex::new(Vec::new()),
        })
    }
}

impl DevicePlugin for FakeGpu {
    fn name(&self) -> &'static str {
        "fake-cuda"
    }
    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Cuda
    }
    fn info(&self) -> DeviceRuntimeInfo {
        DeviceRuntimeInfo {
            name: "fake-cuda",
            library: "none".into(),
            driver_version: None,
            runtime_version: None,
            devices: self.bus_ids.len() as u32,
        }
    }
    fn device_count(&self) -> u32 {
        self.bus_ids.len() as u32
    }
    fn pci_bus_id(&self, device: u32) -> Result<String> {
        self.bus_ids
            .get(device as usize)
            .cloned()
            .ok_or_else(|| Error::transport("fake-cuda", format!("no device {device}")))
    }
    fn classify(&self, _addr: u64) -> Result<PointerKind> {
        Ok(PointerKind::Host)
    }
    fn allocate(&self, _device: u32, _len: u64) -> Result<u64> {
        Err(Error::not_available("fake-cuda", "allocates nothing"))
    }
    unsafe fn free(&self, _device: u32, _addr: u64) -> Result<()> {
        Ok(())
    }
    unsafe fn copy(&self, _: u32, _: CopyDirection, _: CopyFragment) -> Result<()> {
        Err(Error::not_available("fake-cuda", "copies nothing"))
    }
    unsafe fn copy_async(&self, _: u32, _: CopyDirection, _: &[CopyFragment]) -> Result<Box<dyn PendingCopy>> {
        Err(Error::not_available("fake-cuda", "copies nothing"))
    }
    fn export_dmabuf(&self, device: u32, addr: u64, len: u64) -> Result<DmaBufExport> {
        if !self.dmabuf {
            return Err(Error::not_available("fake-cuda", "driver offers no dma-buf"));
        }
        self.exports.lock().push((device, addr, len));
        let file = std::fs::File::open("/dev/null").map_err(|e| Error::io("fake-cuda: /dev/null", e))?;
        Ok(DmaBufExport {
            fd: OwnedFd::from(file),
            offset: addr & 0xfff,
            len: (len + (addr & 0xfff)).next_multiple_of(4096),
        })
    }
}

fn eight_nics() -> Arc<RecordingVerbs> {
    fabric(
        (0..8u8)
            .map(|i| FakeDevice::roce(&format!("mlx5_{i}"), [10, 0, i, 1]))
            .collect(),
    )
}

fn fixture_placement() -> NicPlacement {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../topology/tests/fixtures/topology/roce-8gpu.json");
    let topology = te_testkit::fixture::discover(&path).expect("te-base's RoCE fixture");
    NicPlacement::from_env(topology, &MapEnv::new([])).expect("default policy")
}

/// A sysfs root that has (or lacks) the `nvidia_peermem` module.
fn sysfs(peermem: bool) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    if peermem {
        std::fs::create_dir_all(dir.path().join("module/nvidia_peermem")).unwrap();
    }
    dir
}

async fn start(
    verbs: &Arc<RecordingVerbs>,
    name: &str,
    placement: Option<NicPlacement>,
    plugins: Vec<Arc<dyn DevicePlugin>>,
    sysfs: &Path,
) -> Arc<Fake> {
    start_on(verbs, &names(0..=7), name, placement, plugins, sysfs).await
}

async fn start_on(
    verbs: &Arc<RecordingVerbs>,
    devices: &[String],
    name: &str,
    placement: Option<NicPlacement>,
    plugins: Vec<Arc<dyn DevicePlugin>>,
    sysfs: &Path,
) -> Arc<Fake> {
    let t = RdmaTransport::start(verbs.clone(), devices, placement, plugins, config(), name, sysfs, None)
        .await
        .expect("start over the fake");
    Arc::new(t)
}

static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1 << 40);

fn region_info(buf: &HostBuffer, location: MemoryLocation, exported: bool) -> RegionInfo {
    RegionInfo {
        id: RegionId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)),
        base: buf.addr(),
        len: buf.len() as u64,
        location,
        exported,
    }
}

/// A region at `location` (host memory standing in for GPU memory: the fake only copies bytes).
async fn region_at(t: &Fake, len: usize, location: MemoryLocation, exported: bool, seed: u8) -> Region {
    let buf = HostBuffer::allocate(len, HostBufferOptions::default()).unwrap();
    // SAFETY: freshly allocated, `len` bytes, nothing else touches it yet.
    let bytes = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), len) };
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(13).wrapping_add(seed);
    }
    let info = region_info(&buf, location, exported);
    let key = t.register(std::slice::from_ref(&info)).await.unwrap().remove(0);
    Region { buf, info, key }
}

fn listed_rails(key: &serde_json::Value) -> Vec<usize> {
    let keys: BufferKeys = serde_json::from_value(key.clone()).unwrap();
    keys.rails.iter().map(|r| r.rail).collect()
}

fn devices_registered(calls: &[Call]) -> Vec<String> {
    let mut out: Vec<String> = calls
        .iter()
        .filter_map(|c| match c {
            Call::RegMr { device, .. } | Call::RegDmabufMr { device, .. } => Some(device.clone()),
            _ => None,
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

fn names(range: std::ops::RangeInclusive<u8>) -> Vec<String> {
    range.map(|i| format!("mlx5_{i}")).collect()
}

const CUDA0: MemoryLocation = MemoryLocation::Cuda { device: 0 };

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_buffers_go_on_numa_local_rails_and_gpu_buffers_on_switch_local_rails() {
    let verbs = eight_nics();
    let gpu = FakeGpu::reversed(true);
    let root = sysfs(false);
    let a = start(&verbs, "a", Some(fixture_placement()), vec![gpu.clone()], root.path()).await;

    verbs.clear_calls();
    let host = region_at(&a, 64 << 10, MemoryLocation::Host { numa: Some(1) }, true, 1).await;
    assert_eq!(devices_registered(&verbs.calls()), names(4..=7), "NUMA 1's NICs only");
    assert_eq!(listed_rails(&host.key), [4, 5, 6, 7], "the keys list the rails");
    let keys: BufferKeys = serde_json::from_value(host.key.clone()).unwrap();
    assert!(keys.rails.iter().all(|r| r.rate_mbps == 200_000), "rates from sysfs");
    assert_eq!(keys.rkeys.len(), 4);

    // CUDA ordinal 0 is GPU bd:00.0 as the plugin numbers devices (not bus order's 07:00.0).
    verbs.clear_calls();
    let on_gpu = region_at(&a, 64 << 10, CUDA0, true, 2).await;
    let calls = verbs.calls();
    assert_eq!(
        devices_registered(&calls),
        ["mlx5_7"],
        "the GPU's switch-local NIC only"
    );
    assert_eq!(listed_rails(&on_gpu.key), [7]);
    assert!(
        calls.iter().any(|c| matches!(c,
            Call::RegDmabufMr { offset, len, iova, .. }
                if *iova == on_gpu.info.base && *len == on_gpu.info.len && *offset == on_gpu.info.base & 0xfff)),
        "registered from the exported dma-buf: {calls:?}"
    );
    assert!(
        !calls.iter().any(|c| matches!(c, Call::RegMr { .. })),
        "no plain registration"
    );
    assert_eq!(
        gpu.exports.lock().as_slice(),
        [(0, on_gpu.info.base, on_gpu.info.len)],
        "one export per region"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_placement_every_rail_holds_every_region() {
    let verbs = eight_nics();
    let root = sysfs(false);
    let a = start(&verbs, "a", None, Vec::new(), root.path()).await;
    verbs.clear_calls();
    let host = region_at(&a, 8192, MemoryLocation::Host { numa: Some(1) }, true, 1).await;
    assert_eq!(devices_registered(&verbs.calls()), names(0..=7));
    assert_eq!(listed_rails(&host.key), (0..8).collect::<Vec<_>>());
}

/// Device of every initiator QP used by `calls`' posts, and the devices of the keys they used.
fn posted_devices(verbs: &RecordingVerbs, calls: &[Call]) -> (Vec<String>, Vec<(String, String, u32)>) {
    let mut qps = Vec::new();
    let mut wrs = Vec::new();
    for c in calls {
        if let Call::PostSend { qpn, wrs: posted } = c {
            qps.push(verbs.device_of(*qpn).unwrap());
            for wr in posted {
                wrs.push((
                    verbs.device_of(wr.lkey).unwrap(),
                    verbs.device_of(wr.rkey).unwrap(),
                    wr.len,
                ));
            }
        }
    }
    qps.sort();
    qps.dedup();
    (qps, wrs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_use_only_the_rails_both_buffers_are_on() {
    let verbs = eight_nics();
    let root = sysfs(false);
    let a = start(&verbs, "a", Some(fixture_placement()), Vec::new(), root.path()).await;
    // b uses fewer NICs (as with TE_RDMA_DEVICES), so its rail positions are not its rail
    // numbers: rail 1 (mlx5_1) is its first, rail 5 its fourth. Pairs still join equal rail
    // numbers: a's position 1 with b's position 0.
    let b_devices: Vec<String> = ["mlx5_5", "mlx5_3", "mlx5_1", "mlx5_2"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let b = start_on(
        &verbs,
        &b_devices,
        "b",
        Some(fixture_placement()),
        vec![FakeGpu::reversed(true)],
        root.path(),
    )
    .await;
    let len = 1 << 20;
    let src = region_at(&a, len, MemoryLocation::Host { numa: Some(0) }, false, 1).await;
    // b's CUDA ordinal 6 is GPU 0f:00.0, next to mlx5_1: the only rail both buffers are on.
    let gpu_dst = region_at(&b, len, MemoryLocation::Cuda { device: 6 }, true, 2).await;
    let host_dst = region_at(&b, 4 * len, MemoryLocation::Host { numa: Some(0) }, true, 3).await;
    let far_dst = region_at(&b, len, MemoryLocation::Host { numa: Some(1) }, true, 4).await;
    assert_eq!(listed_rails(&gpu_dst.key), [1]);
    let desc = descriptor(&b, "b", &[&gpu_dst, &host_dst, &far_dst]);
    let index_of = |r: &Region| desc.buffers.iter().position(|x| x.base == r.info.base).unwrap() as u32;
    let peer = a.connect(&desc).await.unwrap();

    // One common rail: every WR goes over a QP of mlx5_1 with lkey and rkey of mlx5_1, and that
    // QP is connected to a target QP on the peer's mlx5_1.
    let calls_before = verbs.calls().len();
    let st = run(
        &peer,
        vec![write(0, &src, 0, &gpu_dst, index_of(&gpu_dst), 0, len as u64)],
    )
    .await;
    assert!(matches!(st[0], RequestStatus::Done { .. }), "{st:?}");
    assert_eq!(bytes(&gpu_dst), bytes(&src));
    let calls = verbs.calls();
    let (qps, wrs) = posted_devices(&verbs, &calls[calls_before..]);
    assert_eq!(qps, ["mlx5_1"]);
    assert!(wrs.iter().all(|(l, r, _)| l == "mlx5_1" && r == "mlx5_1"), "{wrs:?}");
    for c in &calls[calls_before..] {
        if let Call::PostSend { qpn, .. } = c {
            let rtr = transitions_of(&calls, *qpn)
                .into_iter()
                .find_map(|t| match t {
                    QpTransition::ToRtr { dest_qpn, .. } => Some(dest_qpn),
                    _ => None,
                })
                .expect("connected");
            assert_eq!(verbs.device_of(rtr).as_deref(), Some("mlx5_1"), "the right rail pair");
        }
    }

    // Three common rails (NUMA 0: a holds rails 0..=3, b only 1..=3), a 4 MiB write striped by
    // link rate (all equal): about a third on each, nothing elsewhere.
    let src4 = region_at(&a, 4 * len, MemoryLocation::Host { numa: Some(0) }, false, 5).await;
    let calls_before = verbs.calls().len();
    let st = run(
        &peer,
        vec![write(0, &src4, 0, &host_dst, index_of(&host_dst), 0, 4 * len as u64)],
    )
    .await;
    assert!(matches!(st[0], RequestStatus::Done { .. }), "{st:?}");
    assert_eq!(bytes(&host_dst), bytes(&src4));
    let (qps, wrs) = posted_devices(&verbs, &verbs.calls()[calls_before..]);
    assert_eq!(qps, names(1..=3));
    assert!(
        wrs.iter().all(|(l, r, _)| l == r),
        "lkey and rkey of the same rail: {wrs:?}"
    );
    let total: u64 = wrs.iter().map(|w| u64::from(w.2)).sum();
    assert_eq!(total, 4 * len as u64);
    for dev in names(1..=3) {
        let sent: u64 = wrs.iter().filter(|(l, _, _)| *l == dev).map(|w| u64::from(w.2)).sum();
        let third = 4 * len as u64 / 3;
        assert!(sent.abs_diff(third) <= 4096, "{dev} carries about a third: {sent}");
    }

    // No common rail: a typed error naming both sides' rails, nothing posted.
    let calls_before = verbs.calls().len();
    let st = run(&peer, vec![write(0, &src, 0, &far_dst, index_of(&far_dst), 0, 4096)]).await;
    let RequestStatus::Failed(Error::Refused { reason, .. }) = &st[0] else {
        panic!("expected a refusal, got {st:?}");
    };
    assert!(
        reason.contains("no common rail")
            && reason.contains("[0 (mlx5_0), 1 (mlx5_1), 2 (mlx5_2), 3 (mlx5_3)]")
            && reason.contains(&format!("remote buffer {} on rails [5 (mlx5_5)]", index_of(&far_dst))),
        "{reason}"
    );
    assert!(!verbs.calls()[calls_before..]
        .iter()
        .any(|c| matches!(c, Call::PostSend { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_memory_falls_back_to_peer_memory_and_is_otherwise_not_available() {
    // The library predates ibv_reg_dmabuf_mr, nvidia_peermem is loaded: plain registration.
    let verbs = Arc::new(RecordingVerbs::new(vec![FakeDevice::roce("mlx5_0", [10, 0, 0, 1])]).without_dmabuf());
    let devices = ["mlx5_0".to_string()];
    let with_peermem = sysfs(true);
    let gpu = FakeGpu::reversed(true);
    let t = RdmaTransport::start(
        verbs.clone(),
        &devices,
        None,
        vec![gpu.clone()],
        config(),
        "a",
        with_peermem.path(),
        None,
    )
    .await
    .unwrap();
    assert!(t.capabilities().local.contains(MemoryKind::Cuda));
    let buf = HostBuffer::allocate(8192, HostBufferOptions::default()).unwrap();
    verbs.clear_calls();
    t.register(&[region_info(&buf, CUDA0, true)]).await.unwrap();
    let calls = verbs.calls();
    assert!(calls
        .iter()
        .any(|c| matches!(c, Call::RegMr { addr, .. } if *addr == buf.addr())));
    assert!(!calls.iter().any(|c| matches!(c, Call::RegDmabufMr { .. })));
    assert!(gpu.exports.lock().is_empty(), "no export without the verb");
    drop(t);

    // Neither route: the plugin cannot export, the verb is missing, no peer memory.
    let no_peermem = sysfs(false);
    type Case = (Arc<RecordingVerbs>, Vec<Arc<dyn DevicePlugin>>, &'static str);
    let cases: [Case; 3] = [
        (
            Arc::new(RecordingVerbs::new(vec![FakeDevice::roce("mlx5_0", [10, 0, 0, 1])])),
            Vec::new(),
            "no cuda device plugin is loaded",
        ),
        (
            Arc::new(RecordingVerbs::new(vec![FakeDevice::roce("mlx5_0", [10, 0, 0, 1])])),
            vec![FakeGpu::reversed(false)],
            "driver offers no dma-buf",
        ),
        (
            Arc::new(RecordingVerbs::new(vec![FakeDevice::roce("mlx5_0", [10, 0, 0, 1])]).without_dmabuf()),
            vec![FakeGpu::reversed(true)],
            "ibv_reg_dmabuf_mr",
        ),
    ];
    for (verbs, plugins, missing) in cases {
        let plugin_count = plugins.len();
        let t = RdmaTransport::start(
            verbs.clone(),
            &devices,
            None,
            plugins,
            config(),
            "b",
            no_peermem.path(),
            None,
        )
        .await
        .unwrap();
        let err = t.register(&[region_info(&buf, CUDA0, true)]).await.unwrap_err();
        let Error::NotAvailable { what, reason } = &err else {
            panic!("expected NotAvailable, got {err}");
        };
        assert_eq!(what, "rdma");
        assert!(
            reason.contains(missing) && reason.contains("nvidia_peermem"),
            "{missing}: {reason}"
        );
        assert_eq!(verbs.live_mrs(), 0, "nothing registered");
        assert_eq!(
            t.capabilities().local.contains(MemoryKind::Cuda),
            plugin_count > 0 && verbs.supports_dmabuf(),
            "{missing}"
        );
        // Host memory still registers.
        t.register(&[region_info(&buf, MemoryLocation::HOST, true)])
            .await
            .unwrap();
    }
}
