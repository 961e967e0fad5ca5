//! Discovery on the machine the tests run on, and the kernel's NUMA lookup on real buffers.

use te_base::config::ProcessEnv;
use te_base::{Error, MemoryLocation};
use te_topology::{node_via_get_mempolicy, node_via_move_pages, numa_node_of, NicPlacement, Topology};

/// True when `TE_REQUIRE` names `what`: a missing capability must then fail the test.
fn required(what: &str) -> bool {
    std::env::var("TE_REQUIRE")
        .map(|v| v.split(',').any(|s| s.trim() == what))
        .unwrap_or(false)
}

#[test]
fn discovers_this_host_without_error() {
    let topology = Topology::discover().unwrap();
    // Kernels built with NUMA support list node0 even on single-socket hosts.
    let has_node_dir = std::path::Path::new("/sys/devices/system/node/node0").exists();
    assert_eq!(!topology.numa_nodes.is_empty(), has_node_dir, "{topology:?}");
    assert!(topology.numa_nodes.iter().all(|n| !n.cpus.is_empty()));
    assert!(topology
        .net_interfaces
        .iter()
        .any(|i| i.name == "lo" && i.pci.is_none()));
    for nic in &topology.nics {
        assert!(!nic.name.is_empty() && !nic.ports.is_empty(), "{nic:?}");
    }
    // Placement works whether or not the host has RDMA NICs.
    let placement = NicPlacement::from_env(topology.clone(), &ProcessEnv).unwrap();
    let chosen = placement.rails_for(MemoryLocation::HOST, None).unwrap();
    assert_eq!(chosen.rails.len(), topology.nics.len());
    if topology.nics.is_empty() {
        println!("no RDMA NIC on this host: placement is empty, as expected");
    }
}

#[test]
fn numa_node_of_a_real_buffer_is_a_node_of_this_host() {
    let nodes: Vec<u32> = Topology::discover().unwrap().numa_nodes.iter().map(|n| n.id).collect();
    let buffer = vec![1u8; 1 << 20];
    let addr = buffer.as_ptr() as u64;
    match node_via_get_mempolicy(addr) {
        Ok(node) => assert!(nodes.contains(&node), "node {node} not in {nodes:?}"),
        Err(Error::NotAvailable { reason, .. }) if !required("numa") => {
            println!("skipped: get_mempolicy not available here ({reason})");
            return;
        }
        Err(e) => panic!("get_mempolicy on a touched buffer: {e}"),
    }
    let moved = node_via_move_pages(addr).unwrap();
    assert_eq!(moved, Some(node_via_get_mempolicy(addr).unwrap()));
    assert_eq!(numa_node_of(addr).unwrap(), moved);
    std::hint::black_box(&buffer);
}

#[test]
fn numa_lookup_of_an_unmapped_address_is_an_error() {
    // The zero page is never mapped in a user process.
    match node_via_get_mempolicy(16) {
        Err(Error::Io { context, .. }) => assert!(context.contains("get_mempolicy"), "{context}"),
        Err(Error::NotAvailable { reason, .. }) if !required("numa") => {
            println!("skipped: get_mempolicy not available here ({reason})")
        }
        other => panic!("expected EFAULT, got {other:?}"),
    }
}

#[test]
fn host_placement_follows_the_buffer_node() {
    let buffer = vec![7u8; 1 << 16];
    let addr = buffer.as_ptr() as u64;
    let node = match numa_node_of(addr) {
        Ok(Some(node)) => node,
        Ok(None) if !required("numa") => return println!("skipped: the kernel does not report NUMA nodes here"),
        other => panic!("numa_node_of: {other:?}"),
    };
    // The p5.48xlarge fixture has nodes 0 and 1 with 16 NICs each: the buffer gets its node's NICs.
    let spec = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/topology/p5.48xlarge.json");
    let placement = NicPlacement::new(te_testkit::fixture::discover(&spec).unwrap(), Default::default()).unwrap();
    let chosen = placement.rails_for(MemoryLocation::HOST, Some(addr)).unwrap();
    let expected = placement
        .rail_map()
        .node(node)
        .expect("node of this host is 0 or 1")
        .rails
        .clone();
    assert_eq!(chosen.rails, expected);
    assert_eq!(chosen.rails.len(), 16);
    std::hint::black_box(&buffer);
}
