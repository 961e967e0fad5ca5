//! Two network namespaces joined through a bridge (te-base's test harness), one engine (process)
//! in each, tcp provider: writes and reads over the veth links verified byte for byte. The harness
//! creates and removes the namespaces; it needs root and iproute2 (skips with a message
//! otherwise, fails when TE_REQUIRE contains `netns`).

mod common;

use common::peer_process::{run_initiator, PeerProcess};
use common::*;
use te_base::test_support::netns::network_or_skip;

const PROVIDER: &str = "tcp;ofi_rxm";

#[test]
fn engines_in_two_namespaces_move_data_over_veth() {
    if !provider_present(PROVIDER) {
        return;
    }
    let Some(net) = network_or_skip(2) else {
        return;
    };
    let (ns_a, ns_b) = (net.host_ns(0), net.host_ns(1));
    let len = 64u64 << 20;
    let mut target = PeerProcess::start(PROVIDER, len, 1, &["ip", "netns", "exec", &ns_b]);
    // The target's only rail is its veth end, eth0 (loopback domains are left out when another
    // exists).
    let rails = &target.descriptor.transports[0].info["rails"];
    assert_eq!(rails.as_array().map(Vec::len), Some(1), "{rails}");
    assert_eq!(rails[0]["domain"].as_str(), Some("eth0"), "{rails}");

    // The initiator runs in the other namespace: it writes pattern 5 over the whole buffer in
    // 1 MiB requests, reads it back into zeroed memory and reports mismatches.
    let args = ["client".to_string(), len.to_string(), "5".to_string()];
    let stdout = run_initiator(&target, PROVIDER, &["ip", "netns", "exec", &ns_a], &args);
    assert_eq!(stdout.trim(), "read_mismatched 0", "bytes read back over the veth");
    assert_eq!(target.mismatched(0, len, 5), 0, "bytes written over the veth");
}

/// A notified write across the namespaces: the target receives each notification after its data,
/// in order, from the initiator in the other namespace.
#[test]
fn notified_writes_cross_namespaces() {
    if !provider_present(PROVIDER) {
        return;
    }
    let Some(net) = network_or_skip(2) else {
        return;
    };
    let (ns_a, ns_b) = (net.host_ns(0), net.host_ns(1));
    let len = 16u64 << 20;
    let mut target = PeerProcess::start(PROVIDER, len, 1, &["ip", "netns", "exec", &ns_b]);
    common::peer_process::check_notified_writes(&mut target, PROVIDER, &["ip", "netns", "exec", &ns_a], len, 16);
}
