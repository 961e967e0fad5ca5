//! The initiator in this process, the target in a `te-shm-peer` child: transfers verified byte
//! for byte by the target, revocation, notifications, a target killed in the middle of a batch,
//! a target restarted at the same socket, and a target of another uid.

mod common;

use std::time::Instant;

use common::*;
use te_base::{Error, Notification, RequestStatus, TransferOp};

/// These tests start child processes and copy hundreds of MiB; on a 2-core machine they take
/// turns rather than starve each other.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn writes_and_reads_between_processes_byte_for_byte() {
    let _t = turn();
    let len = 64u64 << 20;
    let mut target = PeerProcess::start(len, 1, &[]);
    let a = initiator(&[]);
    let local = Local::new(&a, 1, len as usize, 2);
    let peer = block_on(a.connect(&target.descriptor)).unwrap();
    let base = target.base();
    // Odd sizes at unaligned offsets, both directions of one batch kept apart by op.
    let cases = [
        (3u64, 1u64),
        (5000, 4097),
        (1 << 20, 65_537),
        ((8 << 20) + 1, (3 << 20) + 5),
    ];
    let reqs = cases
        .iter()
        .enumerate()
        .map(|(i, &(off, n))| request(i as u32, TransferOp::Write, &local, off, base + off, n))
        .collect();
    assert!(all_done(&run(&peer, reqs)));
    for &(off, n) in &cases {
        assert_eq!(target.mismatched(off, n, 2), 0, "{n} B at {off}");
    }
    assert_eq!(target.mismatched(0, 3, 1), 0, "bytes around the writes are untouched");
    assert_eq!(target.mismatched(4, 4996, 1), 0);
    // 10,000 KV-sized fragments (1,728 B), scattered on the remote side so none coalesce.
    let frag = 1728u64;
    let n = 10_000u64;
    let reqs = (0..n)
        .map(|i| {
            let slot = (i * 7919) % n;
            request(i as u32, TransferOp::Write, &local, i * frag, base + slot * frag, frag)
        })
        .collect();
    assert!(all_done(&run(&peer, reqs)));
    for i in 0..n {
        // The target holds, at the fragment's slot, what the initiator held at i * frag.
        let slot = (i * 7919) % n;
        assert_eq!(
            target.mismatched_from(slot * frag, frag, 2, i * frag),
            0,
            "fragment {i}"
        );
    }
    // The whole buffer in 1 MiB writes (one batch, shared by the copy threads), then read back.
    target.ask("fill 1");
    let whole = |op| {
        (0..64u64)
            .map(|i| request(i as u32, op, &local, i << 20, base + (i << 20), 1 << 20))
            .collect()
    };
    assert!(all_done(&run(&peer, whole(TransferOp::Write))));
    assert_eq!(target.mismatched(0, len, 2), 0);
    target.ask("fill 3");
    assert!(all_done(&run(&peer, whole(TransferOp::Read))));
    assert_eq!(local.mismatched(0, len, 3, 0), 0);
}

#[test]
fn a_deregistered_region_is_never_touched_again() {
    let _t = turn();
    let len = 1u64 << 20;
    let mut target = PeerProcess::start(len, 1, &[]);
    let a = initiator(&[]);
    let local = Local::new(&a, 1, len as usize, 2);
    let peer = block_on(a.connect(&target.descriptor)).unwrap();
    let base = target.base();
    assert!(all_done(&run(
        &peer,
        vec![request(0, TransferOp::Write, &local, 0, base, 4096)]
    )));
    assert_eq!(target.ask("deregister"), "ok");
    target.ask("fill 5");
    // The descriptor we hold still lists the buffer; the target's revocation refuses it.
    for op in [TransferOp::Write, TransferOp::Read] {
        let s = run(&peer, vec![request(0, op, &local, 0, base, len)]);
        assert!(
            matches!(&s[0], RequestStatus::Failed(Error::Refused { .. })),
            "{op}: {:?}",
            s[0]
        );
    }
    assert_eq!(target.mismatched(0, len, 5), 0, "no byte of the revoked buffer changed");
    assert!(peer.is_healthy(), "a refusal does not cut the connection");
}

#[test]
fn a_revocation_during_a_long_batch_is_confirmed_and_stops_it() {
    let _t = turn();
    let len = 64u64 << 20;
    let mut target = PeerProcess::start(len, 1, &[]);
    let a = initiator(&[]);
    let local = Local::new(&a, 1, len as usize, 2);
    let peer = block_on(a.connect(&target.descriptor)).unwrap();
    let base = target.base();
    // 64 GiB over the target's buffer: still running when the revocation comes, on any machine.
    let n: u32 = 1 << 20;
    let reqs = (0..n)
        .map(|i| {
            let off = (u64::from(i) * 65_536) % len;
            request(i, TransferOp::Write, &local, off, base + off, 65_536)
        })
        .collect();
    let batch = submit(&peer, reqs);
    let started = Instant::now();
    loop {
        let p = batch.poll();
        assert_eq!(p.failed, 0, "failures before the revocation");
        if p.done > 0 {
            break;
        }
        assert!(started.elapsed() < HANG_GUARD, "no progress before the revocation");
        std::thread::yield_now();
    }
    // Returns once this initiator confirmed it (between two of its system calls), not by
    // cutting the connection at the deadline.
    assert_eq!(target.ask("deregister"), "ok");
    assert_eq!(
        target.ask("connections"),
        "1",
        "the initiator confirmed in time, it was not cut"
    );
    target.ask("fill 9");
    let _ = batch.wait_blocking(Some(HANG_GUARD)).expect("the batch settles");
    // (`status` looks a failure up linearly: ask for the one request that surely came after.)
    assert!(batch.poll().failed > 0, "the rest of the batch was refused");
    let last = batch.status(n as usize - 1);
    assert!(
        matches!(&last, Some(RequestStatus::Failed(Error::Refused { .. }))),
        "{last:?}"
    );
    assert_eq!(
        target.mismatched(0, len, 9),
        0,
        "no byte written after the revocation returned"
    );
    assert!(peer.is_healthy());
}

#[test]
fn a_deadline_cuts_only_its_own_batch_and_the_connection_stays() {
    let _t = turn();
    let len = 64u64 << 20;
    let spare = 8u64 << 20;
    let mut target = PeerProcess::start(len + spare, 1, &[]);
    let a = initiator(&[]);
    let local = Local::new(&a, 1, len as usize, 2);
    let peer = block_on(a.connect(&target.descriptor)).unwrap();
    let base = target.base();
    // 64 GiB over the first 64 MiB of the target: still running when its deadline comes.
    let n: u32 = 1 << 20;
    let reqs = (0..n)
        .map(|i| {
            let off = (u64::from(i) * 65_536) % len;
            request(i, TransferOp::Write, &local, off, base + off, 65_536)
        })
        .collect();
    let long = submit(&peer, reqs);
    let started = Instant::now();
    while long.poll().done == 0 {
        assert!(started.elapsed() < HANG_GUARD, "no progress before the deadline");
        std::thread::yield_now();
    }
    // Queued on the copy threads behind it, to the 8 MiB the long one never touches.
    let queued = submit(
        &peer,
        (0..8)
            .map(|i| {
                request(
                    i,
                    TransferOp::Write,
                    &local,
                    u64::from(i) << 20,
                    base + len + (u64::from(i) << 20),
                    1 << 20,
                )
            })
            .collect(),
    );
    let timeout = Error::Timeout {
        what: "the long batch (its deadline)".into(),
        after_ms: 1,
    };
    assert!(peer.abort_batch(long.state(), timeout));
    let _ = long.wait_blocking(Some(HANG_GUARD)).expect("the aborted batch settles");
    let report = queued
        .wait_blocking(Some(HANG_GUARD))
        .expect("the queued batch settles");
    assert!(report.is_ok(), "the batch queued behind it is not cut: {report:?}");
    assert_eq!(target.mismatched_from(len, spare, 2, 0), 0, "the queued batch's bytes");
    // Settled means no byte of it moves any more: what is written now stays.
    target.ask("fill 9");
    let p = long.poll();
    assert!(p.failed > 0 && p.done + p.failed == n as usize, "{p:?}");
    let last = long.status(n as usize - 1);
    assert!(
        matches!(&last, Some(RequestStatus::Failed(Error::Timeout { .. }))),
        "{last:?}"
    );
    assert!(peer.is_healthy(), "the connection was not cut");
    let after = run(&peer, vec![request(0, TransferOp::Write, &local, 0, base + len, 4096)]);
    assert!(all_done(&after), "the connection serves the next batch: {after:?}");
    assert_eq!(
        target.mismatched(0, len, 9),
        0,
        "no byte of the aborted batch after it settled"
    );
    assert_eq!(target.ask("connections"), "1", "still the one connection");
}

/// Sends `payload` as a notification from "initiator"; the returned batch settles with its answer.
fn send_note(peer: &std::sync::Arc<dyn te_base::Peer>, payload: &[u8]) -> te_base::Batch {
    let state = te_base::BatchState::new(vec![0].into_boxed_slice());
    let done = te_base::Batch::new(state.clone());
    let note = Notification {
        from: "initiator".into(),
        payload: payload.to_vec(),
    };
    peer.notify(note, &state, 0).unwrap();
    done
}

#[test]
fn notifications_reach_the_other_process_after_their_data() {
    let _t = turn();
    let mut target = PeerProcess::start(1 << 20, 1, &[]);
    let a = initiator(&[]);
    let local = Local::new(&a, 1, 1 << 20, 2);
    let peer = block_on(a.connect(&target.descriptor)).unwrap();
    assert!(all_done(&run(
        &peer,
        vec![request(0, TransferOp::Write, &local, 0, target.base(), 1 << 20)]
    )));
    let done = send_note(&peer, b"layer 7 ready");
    done.wait_blocking(Some(HANG_GUARD))
        .expect("notification answered")
        .unwrap();
    assert_eq!(target.ask("recv 60000"), "layer 7 ready");
    assert_eq!(
        target.mismatched(0, 1 << 20, 2),
        0,
        "the data was there before the note"
    );
}

#[test]
fn a_notification_waiting_for_its_answer_fails_when_the_connection_is_dropped() {
    let _t = turn();
    let target = PeerProcess::start(1 << 20, 1, &[]);
    let a = initiator(&[]);
    let peer = block_on(a.connect(&target.descriptor)).unwrap();
    // A stopped target reads nothing, so the note is sent and never answered.
    let pid = target.child.id() as i32;
    // SAFETY: `pid` is our child, not yet reaped (PeerProcess reaps it on drop).
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let done = send_note(&peer, b"never answered");
    assert_eq!(done.poll().done + done.poll().failed, 0, "answered by a stopped target");
    drop(peer);
    let report = done
        .wait_blocking(Some(HANG_GUARD))
        .expect("the note settles once its connection is gone");
    assert!(
        matches!(done.status(0), Some(RequestStatus::Failed(Error::Closed(_)))),
        "{report:?} {:?}",
        done.status(0)
    );
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
}

#[test]
fn a_target_killed_mid_batch_fails_the_batch_and_nothing_hangs() {
    let _t = turn();
    let len = 64u64 << 20;
    let mut target = PeerProcess::start(len, 1, &[]);
    let a = initiator(&[]);
    let local = Local::new(&a, 1, len as usize, 2);
    let peer = block_on(a.connect(&target.descriptor)).unwrap();
    let base = target.base();
    // 64 GiB in 64 KiB writes over the target's buffer: far more than can finish before the
    // kill below, whatever the machine's speed; the copy thread carries it.
    let n: u32 = 1 << 20;
    let reqs = (0..n)
        .map(|i| {
            let off = (u64::from(i) * 65_536) % len;
            request(i, TransferOp::Write, &local, off, base + off, 65_536)
        })
        .collect();
    let batch = submit(&peer, reqs);
    // Wait for the event "copies are landing", then kill the target.
    let started = Instant::now();
    while batch.poll().done == 0 {
        assert_eq!(batch.poll().failed, 0, "failures before the kill");
        assert!(started.elapsed() < HANG_GUARD, "no progress before the kill");
        std::thread::yield_now();
    }
    target.kill();
    let report = batch
        .wait_blocking(Some(HANG_GUARD))
        .expect("the batch settles after the kill");
    let err = report.expect_err("a batch whose target died cannot succeed");
    let failed: Vec<Error> = (0..n as usize)
        .filter_map(|i| match batch.status(i) {
            Some(RequestStatus::Failed(e)) => Some(e),
            _ => None,
        })
        .take(3)
        .collect();
    assert!(!failed.is_empty(), "{err}");
    assert!(
        failed.iter().all(|e| matches!(e, Error::PeerGone { .. })),
        "failures name the lost peer: {failed:?}"
    );
    assert!(!peer.is_healthy());
    let after = run(&peer, vec![request(0, TransferOp::Write, &local, 0, base, 16)]);
    assert!(
        matches!(&after[0], RequestStatus::Failed(Error::PeerGone { .. })),
        "{after:?}"
    );
}

#[test]
fn a_peer_restarted_at_the_same_socket_is_reached_again() {
    let _t = turn();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("target.sock");
    let sock = sock.to_str().unwrap();
    let env = [("TE_SHM_SOCKET", sock)];
    let len = 1u64 << 20;
    let mut first = PeerProcess::start(len, 1, &env);
    let a = initiator(&[]);
    let local = Local::new(&a, 1, len as usize, 2);
    let old = block_on(a.connect(&first.descriptor)).unwrap();
    assert!(all_done(&run(
        &old,
        vec![request(0, TransferOp::Write, &local, 0, first.base(), len)]
    )));
    assert_eq!(first.mismatched(0, len, 2), 0);
    let old_descriptor = first.descriptor.clone();
    first.kill();
    let mut second = PeerProcess::start(len, 4, &env);
    // The old connection learns of the exit from its control socket (an event, not a timer).
    let started = Instant::now();
    while old.is_healthy() {
        assert!(
            started.elapsed() < HANG_GUARD,
            "the old connection never noticed the exit"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // The old descriptor reaches the socket, but not the instance it names.
    let e = block_on(a.connect(&old_descriptor))
        .err()
        .expect("the old instance is gone");
    assert!(matches!(e, Error::PeerGone { .. }), "{e}");
    // The new descriptor at the same address is reached again.
    let new = block_on(a.connect(&second.descriptor)).unwrap();
    assert!(all_done(&run(
        &new,
        vec![request(0, TransferOp::Write, &local, 0, second.base(), len)]
    )));
    assert_eq!(second.mismatched(0, len, 2), 0);
}

#[test]
fn a_target_of_another_uid_is_not_reached() {
    let _t = turn();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: starting a peer as another uid needs root");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    // The build directory may be private (a clone under a 0700 temporary directory): the other
    // uid runs a copy of the peer binary from a directory it can reach.
    let reachable = tempfile::Builder::new()
        .prefix("te-shm-uid")
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::set_permissions(reachable.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let program = reachable.path().join("te-shm-peer");
    std::fs::copy(env!("CARGO_BIN_EXE_te-shm-peer"), &program).unwrap();
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut target = PeerProcess::start_program(&program, 1 << 20, 1, &[], |cmd| {
        cmd.uid(65534).gid(65534).current_dir(reachable.path());
    });
    assert_eq!(target.ask("connections"), "0");
    let a = initiator(&[]);
    let e = block_on(a.connect(&target.descriptor)).err().expect("refused");
    assert!(
        matches!(&e, Error::NotAvailable { reason, .. } if reason.contains("uid")),
        "another uid is not reachable, and the reason says why: {e}"
    );
    // Allowed explicitly on our side, the target still refuses us (it allows only its own uid).
    let a = initiator(&[("TE_SHM_ALLOW_UIDS", "65534")]);
    let e = block_on(a.connect(&target.descriptor))
        .err()
        .expect("refused by the target");
    assert!(
        matches!(&e, Error::NotAvailable { reason, .. } if reason.contains("uid")),
        "{e}"
    );
}

#[test]
fn a_refused_permission_probe_is_not_available_with_the_reason() {
    let _t = turn();
    let target = PeerProcess::start(1 << 20, 1, &[]);
    let a = initiator(&[("TE_SHM_FAULT_PROBE_ERRNO", "1")]);
    let e = block_on(a.connect(&target.descriptor)).err().expect("probe refused");
    assert!(
        matches!(&e, Error::NotAvailable { reason, .. } if reason.contains("process_vm_readv")),
        "{e}"
    );
}
