//! Rail maps of real instance types, read through sysfs trees generated from the fixture specs in
//! `tests/fixtures/topology/`.

use std::path::PathBuf;

use te_base::config::MapEnv;
use te_base::MemoryLocation;
use te_testkit::FixtureSpec;
use te_topology::{GpuVendor, NicKind, NicPlacement, NicPolicy, NicSelection, RailMap, RailSource, Topology};

fn spec(name: &str) -> FixtureSpec {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/topology/{name}.json"));
    FixtureSpec::load(&path).unwrap()
}

fn discover(spec: &FixtureSpec) -> Topology {
    let dir = spec.materialize_temp().unwrap();
    Topology::discover_at(dir.path()).unwrap()
}

/// The rail map as `gpu bus id -> NIC names`.
fn gpu_rail_names(topology: &Topology, map: &RailMap) -> Vec<(String, Vec<String>)> {
    map.gpus
        .iter()
        .map(|g| {
            let names = g.rails.iter().map(|&i| topology.nics[i].name.clone()).collect();
            (g.gpu.to_string(), names)
        })
        .collect()
}

fn names(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

#[test]
fn p5_48xlarge_has_four_local_rails_per_gpu() {
    let t = discover(&spec("p5.48xlarge"));
    assert_eq!(t.gpus.len(), 8, "NVSwitches must not count as GPUs");
    assert!(t
        .gpus
        .iter()
        .all(|g| g.vendor == GpuVendor::Nvidia && g.device_id == 0x2330));
    assert_eq!(t.nics.len(), 32);
    assert!(t
        .nics
        .iter()
        .all(|n| n.kind == NicKind::Efa && n.driver.as_deref() == Some("efa")));
    assert!(t
        .nics
        .iter()
        .all(|n| n.rate_mbps() == 100_000 && n.ports[0].link_layer == "Unspecified"));
    assert_eq!(t.numa_nodes.len(), 2);
    assert_eq!(t.numa_nodes[1].cpus.to_string(), "48-95,144-191");
    assert_eq!(t.numa_nodes[0].cpus.len(), 96);
    let gpu0 = &t.gpus[0];
    assert_eq!(
        gpu0.pci.to_string(),
        "pci0000:4c/0000:4c:01.0/0000:4d:00.0/0000:4e:00.0/0000:4f:00.0"
    );

    let map = RailMap::build(&t);
    let expected = [
        ("0000:4f:00.0", [79, 80, 81, 82]),
        ("0000:60:00.0", [96, 97, 98, 99]),
        ("0000:70:00.0", [113, 114, 115, 116]),
        ("0000:80:00.0", [130, 131, 132, 133]),
        ("0000:90:00.0", [147, 148, 149, 150]),
        ("0000:a0:00.0", [164, 165, 166, 167]),
        ("0000:b0:00.0", [181, 182, 183, 184]),
        ("0000:c0:00.0", [198, 199, 200, 201]),
    ];
    let want: Vec<(String, Vec<String>)> = expected
        .iter()
        .map(|(bus, nics)| (bus.to_string(), nics.iter().map(|n| format!("rdmap{n}s0")).collect()))
        .collect();
    assert_eq!(gpu_rail_names(&t, &map), want);
    for g in &map.gpus {
        assert!(
            matches!(&g.source, RailSource::PciLocal { ancestor, sharing: 1 } if ancestor.ends_with(":00.0")),
            "{:?}",
            g.source
        );
    }
    // Host memory: the 16 NICs of each socket.
    assert_eq!(map.nodes[0].rails, (0..16).collect::<Vec<_>>());
    assert_eq!(map.nodes[1].rails, (16..32).collect::<Vec<_>>());
}

#[test]
fn p5en_48xlarge_has_two_local_rails_per_gpu() {
    let t = discover(&spec("p5en.48xlarge"));
    assert_eq!((t.gpus.len(), t.nics.len()), (8, 16));
    assert!(t.nics.iter().all(|n| n.rate_mbps() == 200_000));
    let map = RailMap::build(&t);
    let gpu_buses = [0x4f, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0];
    let want: Vec<(String, Vec<String>)> = gpu_buses
        .iter()
        .map(|b| {
            (
                format!("0000:{b:02x}:00.0"),
                vec![format!("rdmap{}s0", b + 1), format!("rdmap{}s0", b + 2)],
            )
        })
        .collect();
    assert_eq!(gpu_rail_names(&t, &map), want);
    assert_eq!(map.nodes[0].rails.len(), 8);
}

#[test]
fn p4d_24xlarge_shares_one_nic_per_gpu_pair() {
    let t = discover(&spec("p4d.24xlarge"));
    assert_eq!((t.gpus.len(), t.nics.len()), (8, 4));
    // No switch is visible: the GPUs and the NIC sit directly on one root bus.
    assert!(t.gpus[0].pci.bridges.is_empty());
    let map = RailMap::build(&t);
    let want = vec![
        ("0000:10:1c.0".to_string(), names(&["rdmap16s27"])),
        ("0000:10:1d.0".to_string(), names(&["rdmap16s27"])),
        ("0000:20:1c.0".to_string(), names(&["rdmap32s27"])),
        ("0000:20:1d.0".to_string(), names(&["rdmap32s27"])),
        ("0000:90:1c.0".to_string(), names(&["rdmap144s27"])),
        ("0000:90:1d.0".to_string(), names(&["rdmap144s27"])),
        ("0000:a0:1c.0".to_string(), names(&["rdmap160s27"])),
        ("0000:a0:1d.0".to_string(), names(&["rdmap160s27"])),
    ];
    assert_eq!(gpu_rail_names(&t, &map), want);
    assert_eq!(
        map.gpus[0].source,
        RailSource::PciLocal {
            ancestor: "pci0000:10".into(),
            sharing: 2
        }
    );
    assert_eq!(map.nodes[1].rails.len(), 2);
}

#[test]
fn roce_host_pairs_each_gpu_with_its_mlx5() {
    let t = discover(&spec("roce-8gpu"));
    assert_eq!((t.gpus.len(), t.nics.len()), (8, 8));
    assert!(t
        .nics
        .iter()
        .all(|n| n.kind == NicKind::Verbs && n.ports[0].link_layer == "Ethernet"));
    assert_eq!(t.nics[3].netdevs, ["enp84s0"]);
    let backed = t.net_interfaces.iter().find(|i| i.name == "enp84s0").unwrap();
    assert_eq!(backed.rdma_device.as_deref(), Some("mlx5_3"));
    // The storage NIC has a netdev but no RDMA device: not a rail.
    assert!(t
        .net_interfaces
        .iter()
        .any(|i| i.name == "enp225s0" && i.rdma_device.is_none()));
    assert!(t.net_interfaces.iter().any(|i| i.name == "docker0" && i.pci.is_none()));
    let map = RailMap::build(&t);
    let got = gpu_rail_names(&t, &map);
    let want: Vec<(String, Vec<String>)> = ["07", "0f", "47", "4e", "87", "90", "b7", "bd"]
        .iter()
        .enumerate()
        .map(|(i, b)| (format!("0000:{b}:00.0"), vec![format!("mlx5_{i}")]))
        .collect();
    assert_eq!(got, want);
}

#[test]
fn plain_host_has_no_rails_and_that_is_not_an_error() {
    let t = discover(&spec("plain-host"));
    assert!(t.nics.is_empty() && t.gpus.is_empty());
    let eth0 = t.net_interfaces.iter().find(|i| i.name == "eth0").unwrap();
    assert_eq!(eth0.pci.as_ref().unwrap().device.to_string(), "0000:00:03.0");
    assert_eq!(eth0.numa, None);
    let placement = NicPlacement::new(t, NicPolicy::default()).unwrap();
    let chosen = placement.rails_for(MemoryLocation::HOST, None).unwrap();
    assert!(chosen.rails.is_empty());
    assert_eq!(chosen.source, RailSource::NoNics);
    assert!(placement.priority_matrix().unwrap().is_empty());
}

#[test]
fn gpu_without_local_nic_falls_back_to_its_numa_node_then_to_all() {
    // p5 with the four NICs of GPU 7's switch removed: GPU 7 uses the 12 other NICs of node 1.
    let mut s = spec("p5.48xlarge");
    s.devices
        .retain(|d| !d.path.starts_with("pci0000:bd/") || d.kind != "efa");
    let t = discover(&s);
    assert_eq!(t.nics.len(), 28);
    let map = RailMap::build(&t);
    let gpu7 = &map.gpus[7];
    assert_eq!(gpu7.source, RailSource::SameNuma { node: 1 });
    assert_eq!(gpu7.rails, (16..28).collect::<Vec<_>>());
    assert_eq!(map.gpus[6].rails.len(), 4);

    // The same GPU with an unknown NUMA node: every NIC.
    for d in s.devices.iter_mut().filter(|d| d.path.starts_with("pci0000:bd/")) {
        d.numa = -1;
    }
    let t = discover(&s);
    let map = RailMap::build(&t);
    assert!(matches!(map.gpus[7].source, RailSource::All { .. }));
    assert_eq!(map.gpus[7].rails.len(), 28);
}

#[test]
fn host_memory_on_a_node_without_nics_uses_all_nics() {
    // p4d with the two NICs of NUMA node 1 removed.
    let mut s = spec("p4d.24xlarge");
    s.devices.retain(|d| !(d.kind == "efa" && d.numa == 1));
    let t = discover(&s);
    let map = RailMap::build(&t);
    assert_eq!(map.node(0).unwrap().rails, [0, 1]);
    assert_eq!(map.node(0).unwrap().source, RailSource::SameNuma { node: 0 });
    assert_eq!(map.node(1).unwrap().rails, [0, 1]);
    assert!(matches!(map.node(1).unwrap().source, RailSource::All { .. }));
    // GPUs 4-7 lost their switch's NIC and have none on their node either.
    assert!(map.gpus[4..]
        .iter()
        .all(|g| matches!(g.source, RailSource::All { .. }) && g.rails == [0, 1]));
}

#[test]
fn gpus_without_any_nic_get_no_rails() {
    let mut s = spec("p5.48xlarge");
    s.devices.retain(|d| d.kind != "efa");
    let t = discover(&s);
    assert_eq!((t.gpus.len(), t.nics.len()), (8, 0));
    let map = RailMap::build(&t);
    assert!(map
        .gpus
        .iter()
        .all(|g| g.rails.is_empty() && g.source == RailSource::NoNics));
    let placement = NicPlacement::new(t, NicPolicy::default()).unwrap();
    let chosen = placement.rails_for(MemoryLocation::Cuda { device: 3 }, None).unwrap();
    assert!(chosen.rails.is_empty());
}

#[test]
fn nics_are_split_evenly_among_gpus_sharing_a_switch() {
    // p5 with GPU 1 moved under GPU 0's switch: the two GPUs split the four NICs two and two.
    let mut s = spec("p5.48xlarge");
    s.devices.retain(|d| !d.path.starts_with("pci0000:5d/"));
    let gpu = s.devices.iter().find(|d| d.kind == "h100").unwrap().clone();
    let mut moved = gpu.clone();
    moved.path = gpu
        .path
        .replace("0000:4e:00.0/0000:4f:00.0", "0000:4e:06.0/0000:55:00.0");
    s.devices.push(moved);
    let t = discover(&s);
    let map = RailMap::build(&t);
    let got = gpu_rail_names(&t, &map);
    assert_eq!(got[0], ("0000:4f:00.0".into(), names(&["rdmap79s0", "rdmap80s0"])));
    assert_eq!(got[1], ("0000:55:00.0".into(), names(&["rdmap81s0", "rdmap82s0"])));
}

#[test]
fn policy_all_registers_everywhere_and_local_on_the_rails() {
    let t = discover(&spec("p5.48xlarge"));
    let local = NicPlacement::from_env(t.clone(), &MapEnv::new([("TE_NIC_SELECTION", "local")])).unwrap();
    let all = NicPlacement::from_env(t, &MapEnv::new([("MC_EFA_NIC_SELECTION", "all")])).unwrap();
    assert_eq!(all.policy().selection, NicSelection::All);
    let gpu = MemoryLocation::Cuda { device: 2 };
    assert_eq!(local.rails_for(gpu, None).unwrap().rails, [8, 9, 10, 11]);
    assert_eq!(all.rails_for(gpu, None).unwrap().rails.len(), 32);
    let host1 = MemoryLocation::Host { numa: Some(1) };
    assert_eq!(
        local.rails_for(host1, None).unwrap().rails,
        (16..32).collect::<Vec<_>>()
    );
    // Unknown NUMA node and no address: every NIC.
    assert_eq!(local.rails_for(MemoryLocation::HOST, None).unwrap().rails.len(), 32);
}

#[test]
fn visible_devices_pick_the_gpu_of_an_ordinal() {
    let t = discover(&spec("p5.48xlarge"));
    let env = MapEnv::new([("CUDA_VISIBLE_DEVICES", "5,6")]);
    let mut placement = NicPlacement::from_env(t, &env).unwrap();
    let rails = |p: &NicPlacement, d: u32| p.rails_for(MemoryLocation::Cuda { device: d }, None).unwrap();
    assert_eq!(rails(&placement, 0).rails, [20, 21, 22, 23]);
    assert_eq!(rails(&placement, 1).rails, [24, 25, 26, 27]);
    assert!(matches!(rails(&placement, 2).source, RailSource::All { .. }));
    // A device plugin's mapping wins.
    placement
        .set_gpu_ordinals(te_base::MemoryKind::Cuda, vec!["0000:c0:00.0".parse().unwrap()])
        .unwrap();
    assert_eq!(rails(&placement, 0).rails, [28, 29, 30, 31]);
}

/// A device plugin that only knows bus ids, as the CUDA plugin reports them.
#[derive(Debug)]
struct BusIdsOnly(Vec<&'static str>);

impl te_base::device::DevicePlugin for BusIdsOnly {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn memory_kind(&self) -> te_base::MemoryKind {
        te_base::MemoryKind::Cuda
    }
    fn info(&self) -> te_base::device::DeviceRuntimeInfo {
        te_base::device::DeviceRuntimeInfo {
            name: "cuda",
            library: "none".into(),
            driver_version: None,
            runtime_version: None,
            devices: self.0.len() as u32,
        }
    }
    fn device_count(&self) -> u32 {
        self.0.len() as u32
    }
    fn pci_bus_id(&self, device: u32) -> te_base::Result<String> {
        Ok(self.0[device as usize].to_string())
    }
    fn classify(&self, _addr: u64) -> te_base::Result<te_base::device::PointerKind> {
        Err(te_base::Error::not_available("classify", "test plugin"))
    }
    fn allocate(&self, _device: u32, _len: u64) -> te_base::Result<u64> {
        Err(te_base::Error::not_available("allocate", "test plugin"))
    }
    unsafe fn free(&self, _device: u32, _addr: u64) -> te_base::Result<()> {
        Err(te_base::Error::not_available("free", "test plugin"))
    }
    unsafe fn copy(
        &self,
        _device: u32,
        _direction: te_base::device::CopyDirection,
        _fragment: te_base::device::CopyFragment,
    ) -> te_base::Result<()> {
        Err(te_base::Error::not_available("copy", "test plugin"))
    }
    unsafe fn copy_async(
        &self,
        _device: u32,
        _direction: te_base::device::CopyDirection,
        _fragments: &[te_base::device::CopyFragment],
    ) -> te_base::Result<Box<dyn te_base::device::PendingCopy>> {
        Err(te_base::Error::not_available("copy_async", "test plugin"))
    }
    fn export_dmabuf(&self, _device: u32, _addr: u64, _len: u64) -> te_base::Result<te_base::device::DmaBufExport> {
        Err(te_base::Error::not_available("export_dmabuf", "test plugin"))
    }
}

#[test]
fn device_plugin_supplies_the_ordinal_map() {
    let t = discover(&spec("p5.48xlarge"));
    let mut placement = NicPlacement::new(t, NicPolicy::default()).unwrap();
    // CUDA_VISIBLE_DEVICES=7,3 as the runtime would report it.
    placement
        .use_device_plugin(&BusIdsOnly(vec!["0000:c0:00.0", "0000:80:00.0"]))
        .unwrap();
    let rails = |d: u32| {
        placement
            .rails_for(MemoryLocation::Cuda { device: d }, None)
            .unwrap()
            .rails
    };
    assert_eq!(rails(0), [28, 29, 30, 31]);
    assert_eq!(rails(1), [12, 13, 14, 15]);
    assert!(placement.cuda_ordinals().len() == 2);
    let err = placement.use_device_plugin(&BusIdsOnly(vec!["GPU-1"])).unwrap_err();
    assert!(
        err.to_string().contains("cuda") && err.to_string().contains("GPU-1"),
        "{err}"
    );
}

#[test]
fn malformed_sysfs_files_are_errors_naming_the_file() {
    let dir = spec("p4d.24xlarge").materialize_temp().unwrap();
    let file = dir.path().join("devices/pci0000:10/0000:10:1c.0/numa_node");
    std::fs::write(&file, "zero\n").unwrap();
    let err = Topology::discover_at(dir.path()).unwrap_err();
    assert!(err.to_string().contains("0000:10:1c.0/numa_node"), "{err}");
    let err = Topology::discover_from("/nonexistent/sysfs").unwrap_err();
    assert!(err.to_string().contains("/nonexistent/sysfs"), "{err}");
    let bad_spec = std::env::temp_dir().join(format!("te-bad-spec-{}.json", std::process::id()));
    std::fs::write(
        &bad_spec,
        r#"{"name": "x", "numa_nodes": [], "devices": [{"kind": "gpu", "path": "pci0000:00/0000:00:01.0"}]}"#,
    )
    .unwrap();
    let err = te_testkit::fixture::discover(&bad_spec).unwrap_err();
    let _ = std::fs::remove_file(&bad_spec);
    assert!(err.to_string().contains("unknown kind"), "{err}");
}

#[test]
fn generated_tree_has_the_sysfs_layout() {
    let dir = spec("p5.48xlarge").materialize_temp().unwrap();
    let root = dir.path();
    let link = |p: &str| std::fs::read_link(root.join(p)).unwrap().display().to_string();
    let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap();
    assert_eq!(
        link("class/infiniband/rdmap79s0"),
        "../../devices/pci0000:4c/0000:4c:01.0/0000:4d:00.0/0000:4e:01.0/0000:50:00.0/infiniband/rdmap79s0"
    );
    assert_eq!(
        link("bus/pci/devices/0000:4f:00.0"),
        "../../../devices/pci0000:4c/0000:4c:01.0/0000:4d:00.0/0000:4e:00.0/0000:4f:00.0"
    );
    let nic = "devices/pci0000:4c/0000:4c:01.0/0000:4d:00.0/0000:4e:01.0/0000:50:00.0";
    assert!(link(&format!("{nic}/driver")).ends_with("bus/pci/drivers/efa"));
    assert_eq!(read(&format!("{nic}/vendor")), "0x1d0f\n");
    assert_eq!(read(&format!("{nic}/class")), "0x020000\n");
    assert_eq!(read(&format!("{nic}/numa_node")), "0\n");
    assert_eq!(read(&format!("{nic}/local_cpulist")), "0-47,96-143\n");
    assert_eq!(
        read(&format!("{nic}/infiniband/rdmap79s0/ports/1/state")),
        "4: ACTIVE\n"
    );
    assert_eq!(read("devices/pci0000:4c/0000:4c:01.0/class"), "0x060400\n");
    assert_eq!(read("devices/system/node/node1/cpulist"), "48-95,144-191\n");
    let resolved = std::fs::canonicalize(root.join("class/infiniband/rdmap79s0/device")).unwrap();
    assert!(
        resolved.ends_with("0000:4e:01.0/0000:50:00.0"),
        "{}",
        resolved.display()
    );
}
