//! Standalone mode when things go wrong: a worker SIGKILLed mid-call (the server unmaps its
//! buffers and drops its handles: fd and mapping counts return to baseline), the server
//! SIGKILLed and restarted (calls fail with `ServerGone` within a bound, the next ones reconnect,
//! re-register and read the SSD keys again), and hostile frames (typed errors, no access to
//! another client's memory or handles, the server keeps serving).

mod standalone_support;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use standalone_support::*;
use umbp::standalone::wire::{self, Op, Put};
use umbp::{KvBuffer, Range, RangedGet, RangedPut, Store, StoreError};

const CHILD_VAR: &str = "UMBP_TEST_KILLED_WORKER_SOCKET";

/// The worker that gets SIGKILLed: registers buffers, puts, then reads in a loop, printing
/// `ready` once it is busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_worker_child() {
    let Ok(socket) = std::env::var(CHILD_VAR) else { return };
    let store = Store::builder().connect(&socket).open().await.unwrap();
    let bufs: Vec<KvBuffer> = (0..3).map(|_| store.alloc_buffer(1 << 20).unwrap()).collect();
    for b in &bufs {
        // SAFETY: the buffers live until the process is killed.
        unsafe { store.register_buffer(b.addr(), b.len() as u64) }
            .await
            .unwrap();
    }
    let keys: Vec<String> = (0..64).map(|i| format!("victim/{i}")).collect();
    put_whole(&store, &keys, bufs[0].addr(), 16384);
    let ranges: Vec<[Range; 1]> = (0..64)
        .map(|i| [Range::new(0, 16384, bufs[0].addr() + i * 16384)])
        .collect();
    let gets: Vec<RangedGet<'_>> = keys
        .iter()
        .zip(&ranges)
        .map(|(k, r)| RangedGet { key: k, ranges: r })
        .collect();
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready").unwrap();
    out.flush().unwrap();
    loop {
        store.batch_get_ranges(&gets).unwrap();
    }
}

#[test]
fn a_killed_worker_leaves_nothing_mapped_in_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--dram", "64M"], &[]);
    let pid = server.pid();
    // Baseline: after one session opened and closed (state a first session creates lazily is
    // then counted), once the server's descriptors have settled.
    {
        let _raw = Raw::connect(&server.socket, [0; 16]).unwrap();
    }
    let fds0 = settled_fd_count(pid);
    let base = fd_targets(pid);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "killed_worker_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_VAR, &server.socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    while !lines.next().expect("child ended early").unwrap().ends_with("ready") {}
    assert_eq!(memfd_maps(pid), 3, "the worker's three buffers are mapped");
    assert!(fd_count(pid) > fds0, "the worker's connections are open");
    child.kill().unwrap();
    child.wait().unwrap();
    eventually(10, "the server to unmap the killed worker's buffers", || {
        memfd_maps(pid) == 0
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while fd_count(pid) != fds0 {
        assert!(
            Instant::now() < deadline,
            "server fds not back to baseline {fds0}: {:?} (before the worker: {base:?})",
            fd_targets(pid)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // And the server still serves, with no session or handle left from the worker.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = rt.block_on(Store::builder().connect(&server.socket).open()).unwrap();
    let st = store.stats().unwrap();
    assert_eq!(sa(&st).server_sessions, 1, "{st:?}");
    assert_eq!(sa(&st).server_mapped_buffers, 0);
    assert_eq!(sa(&st).server_key_handle_held, 0);
    assert!(store.exists("victim/63").unwrap());
}

#[test]
fn a_killed_server_fails_calls_in_bound_and_the_restart_serves_the_ssd_again() {
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().join("ssd");
    std::fs::create_dir(&ssd).unwrap();
    let ssd_arg = ssd.to_str().unwrap().to_owned();
    let args = [
        "--dram",
        "16M",
        "--ssd-dirs",
        &ssd_arg,
        "--ssd-capacity",
        "256M",
        "--write-through",
    ];
    let env = [("UMBP_SSD_SEGMENT_BYTES", "8M")];
    let mut server = Server::start(dir.path(), &args, &env);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = rt.block_on(Store::builder().connect(&server.socket).open()).unwrap();
    let buf = store.alloc_buffer(64 * 4096).unwrap();
    // SAFETY: the buffer outlives the store's use of it.
    rt.block_on(unsafe { store.register_buffer(buf.addr(), buf.len() as u64) })
        .unwrap();
    let keys: Vec<String> = (0..32).map(|i| format!("durable/{i}")).collect();
    {
        // SAFETY: no call uses the buffer now.
        let b = unsafe { buf.bytes_mut() };
        for (i, k) in keys.iter().enumerate() {
            fill(b, i * 4096, k, 0, 4096);
        }
    }
    put_whole(&store, &keys, buf.addr(), 4096);
    server.kill();

    // Calls fail, typed, well within the bound (the socket closes with the process): half the
    // 30 s call timeout, so a failure within it is the closed socket's, not the timeout's,
    // however slow the machine.
    let t = Instant::now();
    let back: Vec<[Range; 1]> = (0..32)
        .map(|i| [Range::new(0, 4096, buf.addr() + (32 + i) * 4096)])
        .collect();
    let gets: Vec<RangedGet<'_>> = keys
        .iter()
        .zip(&back)
        .map(|(k, r)| RangedGet { key: k, ranges: r })
        .collect();
    let e = store.batch_get_ranges(&gets).unwrap_err();
    assert!(matches!(e, StoreError::ServerGone { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
    let e = store.batch_get_ranges(&gets).unwrap_err();
    assert!(matches!(e, StoreError::ServerGone { .. }), "{e}");

    // Restarted on the same SSD: the next calls reconnect (after the backoff), re-register the
    // buffer and read every key from the rebuilt log.
    let _server = Server::start(dir.path(), &args, &env);
    let deadline = Instant::now() + Duration::from_secs(10);
    let got = loop {
        match store.batch_get_ranges(&gets) {
            Err(StoreError::ServerGone { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            other => break other.unwrap(),
        }
    };
    for g in got {
        assert_eq!(g.unwrap(), 4096);
    }
    // SAFETY: the get has returned.
    let b = unsafe { buf.bytes() };
    for (i, k) in keys.iter().enumerate() {
        assert!(check(b, (32 + i) * 4096, k, 0, 4096), "{k}");
    }
    assert_eq!(sa(&store.stats().unwrap()).server_mapped_buffers, 1);
}

#[test]
fn hostile_frames_get_typed_errors_and_touch_no_other_client() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--dram", "64M"], &[("UMBP_SERVER_MAX_FRAME", "1M")]);
    // A victim with a buffer, a stored key, and a minted handle.
    let mut victim = Raw::connect(&server.socket, [0; 16]).unwrap();
    let vbuf = KvBuffer::new(8192).unwrap();
    // The secret is 0xCD; the buffer holds 0xAB while the attacker runs, so a get of the secret
    // into it would show.
    // SAFETY: nothing uses the buffer yet.
    unsafe { vbuf.bytes_mut().fill(0xCD) };
    victim.register(vbuf.addr(), 8192, vbuf.fd()).unwrap();
    let vr = [Range::new(0, 4096, vbuf.addr())];
    let mut tx = Vec::new();
    wire::encode_put_ranges(
        &mut tx,
        &[RangedPut {
            key: "secret",
            object_len: 4096,
            ranges: &vr,
            depth: 0,
        }],
    )
    .unwrap();
    assert_eq!(victim.call(&tx, None).unwrap(), Op::Ok);
    let (_, handle, _) = victim
        .get(
            0,
            777,
            &[RangedGet {
                key: "secret",
                ranges: &vr,
            }],
        )
        .unwrap();
    assert_ne!(handle, 0);
    // SAFETY: no call is running on the victim's buffer.
    unsafe { vbuf.bytes_mut().fill(0xAB) };

    let mut evil = Raw::connect(&server.socket, [0; 16]).unwrap();
    let ebuf = KvBuffer::new(4096).unwrap();
    evil.register(ebuf.addr(), 4096, ebuf.fd()).unwrap();
    // Ranges into the victim's buffer (its worker address), or past the end of its own.
    for r in [
        Range::new(0, 64, vbuf.addr()),
        Range::new(0, 64, ebuf.addr() + 4090),
        Range::new(0, u64::MAX, ebuf.addr()),
    ] {
        let e = evil
            .get(
                0,
                0,
                &[RangedGet {
                    key: "secret",
                    ranges: &[r],
                }],
            )
            .unwrap_err();
        assert!(matches!(e, StoreError::Unregistered { .. }), "{e}");
    }
    // The victim's handle named by another session.
    let er = [Range::new(0, 64, ebuf.addr())];
    let (op, _, _) = evil.get(handle, 777, &[RangedGet { key: "x", ranges: &er }]).unwrap();
    assert_eq!(op, Op::KeyHandleUnknown);
    // Joining the victim's session needs its token.
    let e = Raw::connect(&server.socket, [1; 16]).err().unwrap();
    assert!(matches!(e, StoreError::Refused { .. }), "{e}");
    // Malformed requests: a bad count, an unknown op, a frame over the cap, garbage.
    let mut bad = Vec::new();
    wire::begin(&mut bad, Op::GetRanges);
    bad.u64(0);
    bad.u64(0);
    bad.u32(1000);
    bad.u32(1 << 30);
    wire::finish(&mut bad).unwrap();
    let e = evil.call(&bad, None).unwrap_err();
    assert!(matches!(e, StoreError::Protocol { .. }), "{e}");
    for frame in [
        {
            let mut f = Vec::new();
            wire::begin(&mut f, Op::Stats);
            wire::finish(&mut f).unwrap();
            f[3] = 0x42;
            f
        },
        {
            let mut f = Vec::new();
            wire::begin(&mut f, Op::Stats);
            f[4..8].copy_from_slice(&(2u32 << 20).to_le_bytes());
            f
        },
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
    ] {
        let mut c = Raw::connect(&server.socket, [0; 16]).unwrap();
        let e = c.call(&frame, None).unwrap_err();
        assert!(matches!(e, StoreError::Protocol { .. }), "{e}");
    }
    // An fd sent with a request that takes none.
    let mut stats = Vec::new();
    wire::begin(&mut stats, Op::Stats);
    wire::finish(&mut stats).unwrap();
    let mut c = Raw::connect(&server.socket, [0; 16]).unwrap();
    let e = c.call(&stats, Some(ebuf.fd())).unwrap_err();
    assert!(matches!(e, StoreError::Protocol { .. }), "{e}");

    // The victim's memory and handle are untouched, and the server still serves it.
    // SAFETY: no call is running on the victim's buffer.
    assert!(unsafe { vbuf.bytes() }.iter().all(|&b| b == 0xAB));
    let (op, _, got) = victim
        .get(
            handle,
            777,
            &[RangedGet {
                key: "secret",
                ranges: &vr,
            }],
        )
        .unwrap();
    assert_eq!(op, Op::Ok);
    assert_eq!(*got[0].as_ref().unwrap(), 4096);
}
