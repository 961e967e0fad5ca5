//! The initiator in this process, the target in a `te-efa-peer` child: writes and reads verified
//! byte for byte by the target, and a target killed in the middle of a batch.

mod common;

use std::time::{Duration, Instant};

use common::peer_process::PeerProcess;
use common::*;
use te_base::{RequestStatus, TransferOp};

/// These tests assert bounded-time behaviour (a dead peer settles within the stall timeout, a
/// survivor keeps progressing) with child processes; run concurrently on a 2-core machine they
/// starve each other past those bounds, so they take turns.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn each_provider(f: impl Fn(&str)) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    for p in providers() {
        if provider_present(p) {
            eprintln!("-- provider {p}");
            f(p);
        }
    }
}

#[test]
fn writes_and_reads_between_processes() {
    each_provider(|p| {
        let len = 64u64 << 20;
        let mut target = PeerProcess::start(p, len, 1, &[]);
        let a = install(p, &[]);
        let local = Side::new(&a, 1, len as usize, false, 2);
        let peer = block_on(a.connect(&target.descriptor)).unwrap();
        let base = target.base();
        // Odd sizes at unaligned offsets in one batch.
        let cases = [
            (3u64, 1u64),
            (5000, 4097),
            (1 << 20, 65_537),
            ((8 << 20) + 1, (3 << 20) + 5),
        ];
        let reqs = cases
            .iter()
            .enumerate()
            .map(|(i, &(off, n))| request(i as u32, TransferOp::Write, &local, off, 0, base + off, n))
            .collect();
        run(&peer, reqs).unwrap();
        let mut covered = 0;
        for &(off, n) in &cases {
            assert_eq!(target.mismatched(off, n, 2), 0, "{p}: {n} B at {off}");
            covered += n;
        }
        // Everything else still holds the target's own pattern.
        assert_eq!(target.mismatched(0, 3, 1), 0);
        assert_eq!(target.mismatched(4, 4996, 1), 0);
        assert!(covered < len);
        // The whole buffer in 1 MiB requests, then read back into zeroed local memory.
        let whole = |op| {
            (0..64u64)
                .map(|i| request(i as u32, op, &local, i << 20, 0, base + (i << 20), 1 << 20))
                .collect()
        };
        let reqs = whole(TransferOp::Write);
        run(&peer, reqs).unwrap();
        assert_eq!(target.mismatched(0, len, 2), 0, "{p}: 64 MiB in 1 MiB writes");
        local.zero();
        let reqs = whole(TransferOp::Read);
        run(&peer, reqs).unwrap();
        assert_eq!(
            pattern::mismatches(local.bytes(), 2, 0),
            0,
            "{p}: 64 MiB in 1 MiB reads"
        );
    });
}

/// Notified writes from another process: each notification reaches the target after its data,
/// in order, tagged with the initiator's segment name.
#[test]
fn notified_writes_between_processes() {
    each_provider(|p| {
        let len = 16u64 << 20;
        let mut target = PeerProcess::start(p, len, 1, &[]);
        common::peer_process::check_notified_writes(&mut target, p, &[], len, 16);
    });
}

/// On `tcp;ofi_rxm` only. libfabric 1.17's shm provider serialises access to a peer through a
/// spinlock in that peer's shared-memory region, which the peer itself takes on every progress
/// call: SIGKILL it while it holds the lock and every later post to it spins forever inside
/// `fi_writemsg`, where no caller can interrupt it (seen once in CI: the rail's owner thread
/// stuck in `__pthread_spin_lock`). No transport above the provider can bound that; docs/efa.md
/// says so.
#[test]
fn killed_peer_fails_outstanding_requests_and_others_keep_working() {
    each_provider(|p| {
        if p == "shm" {
            eprintln!("-- shm: skipped, a killed shm peer can leave its region lock held (see above)");
            return;
        }
        let len = 64u64 << 20;
        let mut victim = PeerProcess::start(p, len, 1, &[]);
        let mut survivor = PeerProcess::start(p, 1 << 20, 1, &[]);
        let a = install(p, &[]);
        let local = Side::new(&a, 1, len as usize, false, 7);
        let to_victim = block_on(a.connect(&victim.descriptor)).unwrap();
        let to_survivor = block_on(a.connect(&survivor.descriptor)).unwrap();
        let victim_name = victim.descriptor.name.clone();
        // 16,384 small writes keep the batch in flight long enough to kill the target under it.
        let n = len / 4096;
        let reqs = (0..n)
            .map(|i| {
                request(
                    i as u32,
                    TransferOp::Write,
                    &local,
                    i * 4096,
                    0,
                    victim.base() + i * 4096,
                    4096,
                )
            })
            .collect();
        let batch = submit(&to_victim, reqs);
        assert!(
            !batch.is_complete(),
            "the batch finished before the kill; the test proves nothing"
        );
        victim.kill();
        let killed = Instant::now();
        // Bounded: every request settles (stall timeout 3 s by default) rather than hanging. The
        // bound is a hang guard, 10x the stall timeout: a starved machine may settle late.
        let outcome = batch
            .wait_blocking(Some(Duration::from_secs(30)))
            .unwrap_or_else(|| panic!("{p}: requests still pending 30 s after the peer was killed"));
        eprintln!("{p}: settled {:?} after the kill", killed.elapsed());
        let err = outcome.expect_err("requests to a killed peer must fail");
        assert!(
            err.progress.failed > 0 && err.progress.pending == 0,
            "{p}: {:?}",
            err.progress
        );
        for (i, e) in &err.failures {
            assert!(
                e.to_string().contains(&victim_name),
                "{p}: request {i}: error must name the peer: {e}"
            );
        }
        for i in 0..n as usize {
            assert!(!matches!(batch.status(i), Some(RequestStatus::Pending)));
        }
        assert!(!to_victim.is_healthy());
        // New work for the dead peer is refused at once; the other peer is still served.
        let again = te_base::BatchState::new(vec![4096].into());
        let refused = to_victim.submit(
            vec![request(0, TransferOp::Write, &local, 0, 0, victim.base(), 4096)],
            &again,
            &Default::default(),
        );
        assert!(refused.unwrap_err().to_string().contains(&victim_name));
        run(
            &to_survivor,
            vec![request(0, TransferOp::Write, &local, 0, 0, survivor.base(), 1 << 20)],
        )
        .unwrap();
        assert_eq!(survivor.mismatched(0, 1 << 20, 7), 0, "{p}: survivor data");
    });
}

/// A target stopped (SIGSTOP) after a warm-up write, with a batch of 8 x 1 MiB writes to it in
/// flight: a stopped target cannot acknowledge delivery.
struct Stopped {
    target: PeerProcess,
    a: std::sync::Arc<dyn te_base::Transport>,
    local: Side,
    peer: std::sync::Arc<dyn te_base::Peer>,
    batch: te_base::Batch,
    pid: libc::pid_t,
    len: u64,
}

fn stopped_under_batch(p: &str, stall_timeout_ms: &str) -> Stopped {
    let len = 8u64 << 20;
    let target = PeerProcess::start(p, len, 1, &[]);
    let a = install(p, &[("TE_FABRIC_TIMEOUT_MS", stall_timeout_ms)]);
    let local = Side::new(&a, 1, len as usize, false, 3);
    let peer = block_on(a.connect(&target.descriptor)).unwrap();
    // Connect and warm up while the target runs.
    run(
        &peer,
        vec![request(0, TransferOp::Write, &local, 0, 0, target.base(), 4096)],
    )
    .unwrap();
    let pid = target.child.id() as libc::pid_t;
    let mut target = target;
    target.freeze();
    let reqs = (0..8u64)
        .map(|i| {
            request(
                i as u32,
                TransferOp::Write,
                &local,
                i << 20,
                0,
                target.base() + (i << 20),
                1 << 20,
            )
        })
        .collect();
    let batch = submit(&peer, reqs);
    Stopped {
        target,
        a,
        local,
        peer,
        batch,
        pid,
        len,
    }
}

#[test]
fn deregistration_is_refused_while_a_stopped_peer_holds_the_batch() {
    each_provider(|p| {
        let Stopped {
            mut target,
            a,
            local,
            peer: _peer,
            batch,
            pid,
            len,
        } = stopped_under_batch(p, "60000");
        let refused = block_on(a.deregister(std::slice::from_ref(&local.region)));
        assert!(
            matches!(refused, Err(te_base::Error::InFlight { .. })),
            "{p}: {refused:?}"
        );
        assert!(!batch.is_complete());
        // SAFETY: as above.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
        batch.wait_blocking(Some(Duration::from_secs(60))).unwrap().unwrap();
        assert_eq!(target.mismatched(0, len, 3), 0, "{p}");
        block_on(a.deregister(std::slice::from_ref(&local.region))).unwrap();
    });
}

/// A deadline on a silent peer (SIGSTOP: it neither answers nor closes): `abort` fails the
/// outstanding batch with the deadline's error, and only once the provider holds no part of it:
/// after the failure the local memory is overwritten, the peer resumed and served, and none of
/// the new bytes reach it. On tcp;ofi_rxm that happens within a bound while the peer is still
/// stopped (the rail reopens its endpoint at the same address, so a new connection works at
/// once); on shm the peer itself copies from our memory on commands already in its queue, so the
/// batch fails only once the resumed peer gave them back.
#[test]
fn abort_fails_a_batch_to_a_silent_peer_only_once_no_byte_can_move() {
    each_provider(|p| {
        // No stall timeout in the way: only the abort may end the batch.
        let Stopped {
            mut target,
            a,
            local,
            peer,
            batch,
            pid,
            len,
        } = stopped_under_batch(p, "600000");
        // The stopped peer cannot complete it; meanwhile the rail posts what the provider takes.
        assert!(
            batch.wait_blocking(Some(Duration::from_millis(300))).is_none(),
            "{p}: a stopped peer completed the batch"
        );
        let aborted = Instant::now();
        assert!(peer.abort(te_base::Error::Timeout {
            what: "test deadline".into(),
            after_ms: 1
        }));
        let resume = || {
            // SAFETY: as above.
            assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
        };
        if p == "shm" {
            assert!(
                batch.wait_blocking(Some(Duration::from_millis(500))).is_none(),
                "shm: the batch failed while the stopped peer still held commands to copy our memory"
            );
            resume();
        }
        // A hang guard (10x the stall timeout), as after the kill above.
        let outcome = batch
            .wait_blocking(Some(Duration::from_secs(30)))
            .unwrap_or_else(|| panic!("{p}: batch still in progress 30 s after the abort"));
        eprintln!("{p}: settled {:?} after the abort", aborted.elapsed());
        let err = outcome.expect_err("an aborted batch fails");
        assert_eq!(err.progress.pending, 0, "{p}");
        for (i, e) in &err.failures {
            assert!(
                e.is_timeout(),
                "{p}: request {i} failed with {e}, not the deadline's error"
            );
        }
        assert!(!peer.is_healthy(), "{p}: an aborted peer stays unusable");
        // The memory is ours again: overwrite it, let the peer run, and make sure it is served
        // (a new connection's write lands) before looking for stray bytes.
        local.fill_pattern(42);
        if p != "shm" {
            resume();
        }
        let again = block_on(a.connect(&target.descriptor)).unwrap();
        let tail = len - 4096;
        run(
            &again,
            vec![request(
                0,
                TransferOp::Write,
                &local,
                tail,
                0,
                target.base() + tail,
                4096,
            )],
        )
        .unwrap_or_else(|e| panic!("{p}: write on a new connection after the abort: {e}"));
        assert_eq!(target.mismatched(tail, 4096, 42), 0, "{p}: new connection's data");
        // Every byte holds the peer's own pattern or the aborted batch's, none the new one.
        let stray = target.foreign(0, len - 4096, 1, 3);
        assert_eq!(stray, 0, "{p}: {stray} bytes written after the abort reached the peer");
    });
}

/// A deadline is its batch's own (issue 37). Two batches of 8 x 1 MiB writes to a stopped target
/// (SIGSTOP: nothing completes), the second cut by `abort_batch` (what the engine does when its
/// deadline passes); the stall timeout is out of the way.
/// - The cut batch fails with the deadline's error and only that. On tcp;ofi_rxm it does so while
///   the target is still stopped: its posted operations are taken back by resetting the rail's
///   endpoint. On shm the target copies from our memory itself, so it settles once the target
///   resumed (its posted writes may then land: they count).
/// - The other batch does not fail: the operations the reset discarded are posted again, and it
///   completes byte for byte once the target resumes; the link stays healthy (before, the cut
///   was `abort`, which failed both batches and the link).
/// - No byte written into the cut batch's memory after it failed reaches the target.
#[test]
fn a_batch_cut_by_its_deadline_fails_no_other_batch() {
    each_provider(|p| {
        const MIB: u64 = 1 << 20;
        let half = 8 * MIB;
        let mut target = PeerProcess::start(p, 2 * half, 1, &[]);
        let a = install(p, &[("TE_FABRIC_TIMEOUT_MS", "600000")]);
        let kept = Side::new(&a, 1, half as usize, false, 3);
        // Twice as long, so each byte sits at the offset it has in the target (the patterns are
        // position-dependent); only its second half is sent.
        let cut = Side::new(&a, 2, 2 * half as usize, false, 5);
        let peer = block_on(a.connect(&target.descriptor)).unwrap();
        run(
            &peer,
            vec![request(0, TransferOp::Write, &kept, 0, 0, target.base(), 4096)],
        )
        .unwrap();
        let pid = target.child.id() as libc::pid_t;
        target.freeze();
        let writes = |side: &Side, at: u64| -> Vec<_> {
            (0..8u64)
                .map(|i| {
                    request(
                        i as u32,
                        TransferOp::Write,
                        side,
                        at + i * MIB,
                        0,
                        target.base() + at + i * MIB,
                        MIB,
                    )
                })
                .collect()
        };
        // The batch to be cut goes first, so the provider holds its operations when it is cut.
        let timed = submit(&peer, writes(&cut, half));
        let other = submit(&peer, writes(&kept, 0));
        let deadline = || te_base::Error::Timeout {
            what: "test deadline".into(),
            after_ms: 1,
        };
        // Meanwhile the rail posts what the provider takes (so on tcp;ofi_rxm the cut takes the
        // reset path; either way the assertions below must hold).
        assert!(
            timed.wait_blocking(Some(Duration::from_millis(300))).is_none(),
            "{p}: a stopped target completed the batch"
        );
        assert!(peer.abort_batch(timed.state(), deadline()));
        let resume = || {
            // SAFETY: signalling our own child, not yet reaped.
            assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
        };
        if p == "shm" {
            resume();
        }
        let outcome = timed
            .wait_blocking(Some(Duration::from_secs(30)))
            .unwrap_or_else(|| panic!("{p}: the cut batch still in progress 30 s after the cut"));
        if let Err(err) = &outcome {
            assert_eq!(err.progress.pending, 0, "{p}");
            for (i, e) in &err.failures {
                assert!(e.is_timeout(), "{p}: cut request {i} failed with {e}");
            }
        }
        if p != "shm" {
            assert!(
                outcome.is_err(),
                "{p}: the stopped target cannot have completed the cut batch"
            );
            assert!(
                !other.is_complete(),
                "{p}: the stopped target completed the other batch"
            );
        }
        // The cut batch's memory is ours again.
        cut.fill_pattern(42);
        if p != "shm" {
            resume();
        }
        let report = other
            .wait_blocking(Some(Duration::from_secs(60)))
            .unwrap_or_else(|| panic!("{p}: the other batch still in progress 60 s after the target resumed"));
        assert!(report.is_ok(), "{p}: another batch's deadline failed it: {report:?}");
        assert!(peer.is_healthy(), "{p}: a batch's deadline cut the link");
        assert_eq!(target.mismatched(0, half, 3), 0, "{p}: the other batch's bytes");
        // Served after the cut: a new batch on the same link lands.
        run(
            &peer,
            vec![request(0, TransferOp::Write, &kept, 0, 0, target.base(), 4096)],
        )
        .unwrap_or_else(|e| panic!("{p}: a write after the cut: {e}"));
        let stray = target.foreign(half, half, 1, 5);
        assert_eq!(stray, 0, "{p}: {stray} bytes written after the cut reached the target");
    });
}
