//! Two engine processes on loopback (no root needed) over the TCP transport and peer-to-peer
//! metadata: every transfer size at unaligned offsets and a 10,000-fragment batch, both
//! directions, byte for byte, with one lane and with several lanes and small slices; then the
//! target is killed mid-batch and restarted.

use std::process::Command;

use te_base::test_support::free_port;
use te_tests::node::Node;

const SLOT: u64 = 4 << 20;

fn node(name: &str, port: u16, extra_env: &[(&str, &str)]) -> Node {
    let mut c = Command::new(env!("CARGO_BIN_EXE_te-node"));
    c.args(["--name", name, "--ip", "127.0.0.1", "--metadata", "p2p"])
        .args([
            "--p2p-port",
            &port.to_string(),
            "--slot-bytes",
            &SLOT.to_string(),
            "--slots",
            "2",
        ]);
    for (k, v) in extra_env {
        c.env(k, v);
    }
    Node::start(c).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn both_ways(env: &[(&str, &str)]) {
    let (pa, pb) = (free_port().unwrap(), free_port().unwrap());
    let mut a = node("proc-a", pa, env);
    let mut b = node("proc-b", pb, env);
    a.ok(&format!("sweep 127.0.0.1:{pb} 11"));
    b.ok(&format!("sweep 127.0.0.1:{pa} 12"));
    // Slot 1 written by the other process, checked by the owner in its own memory.
    a.ok(&format!("push 127.0.0.1:{pb} 1 21"));
    b.ok("check 1 21");
    b.ok(&format!("push 127.0.0.1:{pa} 1 22"));
    a.ok("check 1 22");
}

#[test]
fn every_size_both_directions_one_lane() {
    both_ways(&[]);
}

#[test]
fn every_size_both_directions_three_lanes_small_slices() {
    both_ways(&[("TE_TCP_LANES", "3"), ("TE_TCP_SLICE_BYTES", "64K")]);
}

#[test]
fn killed_target_fails_the_batch_and_its_restart_is_reachable() {
    let (pa, pb) = (free_port().unwrap(), free_port().unwrap());
    let mut a = node("proc-a", pa, &[]);
    let b = node("proc-b", pb, &[]);
    let peer = format!("127.0.0.1:{pb}");
    a.ok(&format!("open {peer}"));
    b.signal("STOP");
    a.ok(&format!("flood {peer} 64"));
    b.signal("KILL");
    b.kill();
    let answer = a.cmd("wait").unwrap();
    assert!(
        answer.starts_with("ERR") && answer.contains("proc-b") && answer.contains("went away"),
        "{answer}"
    );
    let mut b = node("proc-b", pb, &[]);
    a.ok(&format!("push {peer} 0 5"));
    b.ok("check 0 5");
    b.ok(&format!("push 127.0.0.1:{pa} 0 6"));
    a.ok("check 0 6");
}

/// Writes a key file readable only by its owner.
fn key_file(name: &str, key: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::temp_dir().join(format!("te-mp-{}-{name}.key", std::process::id()));
    std::fs::write(&path, key).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

#[test]
fn processes_sharing_a_key_move_bytes_and_a_wrong_key_is_refused() {
    let good = key_file("good", "a shared secret of 32 bytes ....\n");
    let bad = key_file("bad", "another secret, also 32 bytes...\n");
    let good_env = [("TE_AUTH_KEY_FILE", good.to_str().unwrap())];
    both_ways(&good_env);

    let (pa, pb) = (free_port().unwrap(), free_port().unwrap());
    let mut a = node("proc-a", pa, &good_env);
    let mut c = node(
        "proc-c",
        free_port().unwrap(),
        &[("TE_AUTH_KEY_FILE", bad.to_str().unwrap())],
    );
    let mut open = node("proc-open", free_port().unwrap(), &[]);
    let _b = node("proc-b", pb, &good_env);
    for (who, n) in [("wrong key", &mut c), ("no key", &mut open)] {
        let answer = n.cmd(&format!("open 127.0.0.1:{pb}")).unwrap();
        assert!(
            answer.starts_with("ERR") && answer.contains("not authenticated"),
            "{who}: {answer}"
        );
    }
    a.ok(&format!("open 127.0.0.1:{pb}"));
    let _ = std::fs::remove_file(good);
    let _ = std::fs::remove_file(bad);
}

/// Notified writes between two processes: the receiver waits in `recv` while the sender pipelines
/// 64 notified batches into its slot; each notification must find its part of the slot written,
/// in order (one lane: batches complete in submission order).
#[test]
fn notified_writes_arrive_after_their_data_in_order() {
    let (pa, pb) = (free_port().unwrap(), free_port().unwrap());
    let mut a = node("proc-a", pa, &[]);
    let mut b = node("proc-b", pb, &[]);
    let recv = "nrecv 1 41 64 proc-a 1";
    b.send(recv).unwrap();
    a.ok(&format!("npush 127.0.0.1:{pb} 1 41 64"));
    b.expect_ok(recv);
}

/// With several lanes the completion order is not the submission order; every notification must
/// still find its data in place.
#[test]
fn notified_writes_over_three_lanes_find_their_data() {
    let env = [("TE_TCP_LANES", "3"), ("TE_TCP_SLICE_BYTES", "64K")];
    let (pa, pb) = (free_port().unwrap(), free_port().unwrap());
    let mut a = node("proc-a", pa, &env);
    let mut b = node("proc-b", pb, &env);
    let recv = "nrecv 1 42 16 proc-a 0";
    b.send(recv).unwrap();
    a.ok(&format!("npush 127.0.0.1:{pb} 1 42 16"));
    b.expect_ok(recv);
}

/// A full inbox in another process is a typed error at the sender, and draining it recovers.
#[test]
fn full_inbox_of_another_process_refuses_with_a_typed_error() {
    let (pa, pb) = (free_port().unwrap(), free_port().unwrap());
    let mut a = node("proc-a", pa, &[]);
    let mut b = node("proc-b", pb, &[("TE_NOTIFY_QUEUE_DEPTH", "4")]);
    let answer = a.ok(&format!("nbare 127.0.0.1:{pb} 5"));
    assert!(
        answer.starts_with("OK accepted=4 refused=NotificationQueueFull"),
        "{answer}"
    );
    // Four were queued; reading them makes room again.
    b.ok("ntake 4 proc-a");
    let answer = a.ok(&format!("nbare 127.0.0.1:{pb} 1"));
    assert_eq!(answer, "OK accepted=1");
}
