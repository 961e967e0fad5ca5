//! Standalone mode against a real `umbp-server` process: the behaviour suite in both modes, key
//! handles end to end (the seed's cycle and both disable paths), several worker processes at once,
//! and what the server refuses (unsealed memfds, foreign memory, other uids).

mod standalone_support;

use std::os::fd::AsFd;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use standalone_support::*;
use umbp::standalone::wire::Op;
use umbp::{KvBuffer, Range, RangedGet, Store, StoreError};

const WORKER_VAR: &str = "UMBP_TEST_WORKER_SOCKET";

fn dram_only() -> umbp::StoreBuilder {
    Store::builder().local().dram_capacity(64 << 20).ssd_dirs(vec![])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behaviour_suite_local() {
    let store = dram_only().open().await.unwrap();
    assert!(!store.is_standalone());
    behaviour_suite(&store).await;
    store.close().await.unwrap();
}

/// The same suite on a peer of a one-peer cluster (a real etcd on loopback), with the sharded
/// directory: every key is local, so the distributed layer must leave each call's outcome
/// unchanged, and the stats gain a cluster section with nothing read remotely.
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behaviour_suite_distributed() {
    behaviour_suite_cluster(umbp::DirectoryMode::Sharded).await;
}

/// The same with the etcd directory (the design kept to measure against).
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behaviour_suite_distributed_etcd_directory() {
    behaviour_suite_cluster(umbp::DirectoryMode::Etcd).await;
}

#[cfg(feature = "cluster")]
async fn behaviour_suite_cluster(directory: umbp::DirectoryMode) {
    let Some(etcd) = te_tests::etcd::EtcdServer::start_on_loopback() else {
        return;
    };
    let mut cc = umbp::ClusterConfig::parse(&etcd.endpoint.replace("http://", "etcd://")).unwrap();
    cc.prefix = format!("/suite-{}-{directory:?}", std::process::id());
    cc.listen = "127.0.0.1:0".parse().unwrap();
    cc.directory = directory;
    let store = dram_only().cluster(cc).open().await.unwrap();
    assert!(matches!(store.config().mode, umbp::ModeConfig::Cluster(_)));
    behaviour_suite(&store).await;
    let st = store.stats().unwrap();
    let cluster = st.cluster.as_ref().expect("a peer's stats have a cluster section");
    assert_eq!(cluster.remote_hits, 0, "{st:?}");
    assert!(st.standalone.is_none());
    // Every key the suite left stored is published (evicted ones are unpublished, so only
    // those still here count). The put returns once etcd holds the key; this peer's own view
    // learns it from its etcd watch, which may deliver a moment later: wait for it, bounded.
    let stored: Vec<&str> = [
        "suite/page-0",
        "suite/page-1",
        "suite/page-2",
        "suite/whole",
        "suite/whole2",
    ]
    .into_iter()
    .filter(|k| store.exists(k).unwrap())
    .collect();
    assert!(!stored.is_empty(), "the suite left keys stored");
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    for k in stored {
        while store.cluster_owner(k).is_none() {
            assert!(
                std::time::Instant::now() < until,
                "{k} is stored but not in this peer's view after 10 s"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
    store.close().await.unwrap();
    drop(etcd);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behaviour_suite_standalone() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--dram", "64M"], &[]);
    let store = Store::builder().connect(&server.socket).open().await.unwrap();
    assert!(store.is_standalone());
    behaviour_suite(&store).await;
    let st = store.stats().unwrap();
    assert!(
        sa(&st).key_handle_hits >= 1,
        "the repeated get named its keys by handle: {st:?}"
    );
    assert_eq!(sa(&st).server_sessions, 1);
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_store_does_not_reconnect() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--dram", "64M"], &[]);
    let store = Store::builder().connect(&server.socket).open().await.unwrap();
    store.put("kept", &[7u8; 4096], 0).await.unwrap();
    assert!(store.exists("kept").unwrap());
    store.close().await.unwrap();
    // Queries fail as closed; none opens a new session.
    assert!(
        matches!(store.exists("kept"), Err(StoreError::Closed)),
        "a closed store reconnected to answer exists()"
    );
    assert!(matches!(
        store.batch_exists_consecutive(&["kept"]),
        Err(StoreError::Closed)
    ));
    assert!(matches!(store.remove("kept"), Err(StoreError::Closed)));
    let other = Store::builder().connect(&server.socket).open().await.unwrap();
    assert!(other.exists("kept").unwrap(), "the object outlives the closed client");
    // The closed client's session ends when the server sees its connections close.
    let deadline = Instant::now() + Duration::from_secs(10);
    while sa(&other.stats().unwrap()).server_sessions != 1 {
        assert!(Instant::now() < deadline, "{:?}", other.stats().unwrap());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    other.close().await.unwrap();
}

/// Writes `n` objects of 4 ranges each into the server, then walks a cycle of `c` key sets
/// (one object each) `rounds` times; returns the client's stats.
async fn cycle(store: &Store, c: usize, rounds: usize) -> umbp::StoreStats {
    let buf = store.alloc_buffer(c * 4096).unwrap();
    // SAFETY: freed below, after the last call.
    unsafe { store.register_buffer(buf.addr(), buf.len() as u64) }
        .await
        .unwrap();
    let keys: Vec<String> = (0..c).map(|i| format!("cycle/{c}/{i}")).collect();
    put_whole(store, &keys, buf.addr(), 4096);
    let part = [Range::new(1024, 512, buf.addr())];
    for _ in 0..rounds {
        for k in &keys {
            let got = store.batch_get_ranges(&[RangedGet { key: k, ranges: &part }]).unwrap();
            assert_eq!(*got[0].as_ref().unwrap(), 512);
        }
    }
    store.free_buffer(buf).await.unwrap();
    store.stats().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_handles_survive_a_cycle_longer_than_the_client_cache() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--dram", "64M"], &[]);
    let mut rates = Vec::new();
    for c in [8usize, 9, 16, 32, 40] {
        let store = Store::builder()
            .connect(&server.socket)
            .key_handle_slots(8)
            .open()
            .await
            .unwrap();
        let rounds = 60;
        let st = cycle(&store, c, rounds).await;
        let reuses = (c * (rounds - 1)) as f64;
        let rate = sa(&st).key_handle_hits as f64 / reuses;
        rates.push((c, rate, sa(&st).key_handle_remints));
        if c == 8 {
            assert_eq!(rate, 1.0, "C=8 fits: {st:?}");
            assert_eq!((sa(&st).key_handle_mints, sa(&st).key_handle_remints), (8, 0));
        }
        // The handle is a hint: every call returned the right length whatever it hit.
        assert_eq!(sa(&st).key_handle_hits + sa(&st).key_handle_misses, (c * rounds) as u64);
        store.close().await.unwrap();
    }
    println!("hit rate over reuses at 8 slots (C, rate, remints): {rates:?}");
    // Random replacement on a cycle: ~77% at C = 9 and ~19% at C = 16 (LRU: 0 on both).
    assert!(rates[1].1 >= 0.70, "C=9: {rates:?}");
    assert!(rates[2].1 >= 0.15, "C=16: {rates:?}");
    assert!(rates[3].1 > 0.0 && rates[4].1 > 0.0, "{rates:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_handles_survive_a_cycle_longer_than_the_server_table() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--dram", "64M", "--key-handle-capacity", "8"], &[]);
    let store = Store::builder().connect(&server.socket).open().await.unwrap();
    let rounds = 60;
    let st = cycle(&store, 9, rounds).await;
    let rate = sa(&st).key_handle_hits as f64 / (9 * (rounds - 1)) as f64;
    assert!(rate >= 0.70, "C=9 at server capacity 8: {rate} {st:?}");
    assert_eq!(sa(&st).server_key_handle_held, 8);
    assert!(sa(&st).server_key_handle_bytes > 0);
    assert!(
        sa(&st).server_key_handle_misses > 0,
        "the server forgot handles the client held"
    );
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_zero_turns_the_server_table_off_and_terminates() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--dram", "64M"], &[("UMBP_KEY_HANDLE_CAPACITY", "0")]);
    let store = Store::builder().connect(&server.socket).open().await.unwrap();
    // With the spinning eviction loop of the seed, the second mint never returns: bound it.
    let (tx, rx) = std::sync::mpsc::channel();
    let s2 = store.clone();
    tokio::spawn(async move {
        let st = cycle(&s2, 4, 5).await;
        let _ = tx.send(st);
    });
    let st = tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(60)))
        .await
        .unwrap()
        .expect("calls at capacity 0 did not return");
    assert_eq!(sa(&st).server_key_handle_mints, 0);
    assert_eq!(sa(&st).server_key_handle_held, 0);
    assert_eq!(sa(&st).key_handle_hits, 0);
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_zero_also_stops_the_server_remembering() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--dram", "64M"], &[]);
    let store = Store::builder()
        .connect(&server.socket)
        .key_handle_slots(0)
        .open()
        .await
        .unwrap();
    let st = cycle(&store, 9, 10).await;
    assert_eq!((sa(&st).key_handle_hits, sa(&st).key_handle_mints), (0, 0));
    assert_eq!(sa(&st).server_key_handle_held, 0, "{st:?}");
    // Handles are minted from 1 and never reused: if the whole run minted nothing, the first
    // handle a raw client can get is still 1 (the seed's assertion).
    let mut raw = Raw::connect(&server.socket, [0; 16]).unwrap();
    let buf = KvBuffer::new(4096).unwrap();
    raw.register(buf.addr(), 4096, buf.fd()).unwrap();
    let r = [Range::new(0, 64, buf.addr())];
    let (op, minted, got) = raw
        .get(
            0,
            12345,
            &[RangedGet {
                key: "cycle/9/0",
                ranges: &r,
            }],
        )
        .unwrap();
    assert_eq!(op, Op::Ok);
    assert_eq!(*got[0].as_ref().unwrap(), 64);
    assert_eq!(minted, 1, "the slots-0 client made the server mint handles");
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_refuses_unsealed_memfds_and_foreign_memory() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--dram", "64M"], &[]);
    let mut raw = Raw::connect(&server.socket, [0; 16]).unwrap();
    let unsealed = KvBuffer::new_unsealed(8192).unwrap();
    let e = raw.register(unsealed.addr(), 8192, unsealed.fd()).unwrap_err();
    assert!(
        matches!(&e, StoreError::Refused { reason } if reason.contains("sealed")),
        "{e}"
    );
    // A pipe is no memfd.
    let (r, _w) = std::io::pipe().unwrap();
    let e = raw.register(0x10000, 4096, r.as_fd()).unwrap_err();
    assert!(matches!(e, StoreError::Refused { .. }), "{e}");
    // A sealed buffer registered with a length beyond its file.
    let sealed = KvBuffer::new(4096).unwrap();
    let e = raw.register(sealed.addr(), 1 << 20, sealed.fd()).unwrap_err();
    assert!(matches!(e, StoreError::Refused { .. }), "{e}");

    // Through the API: memory that is not a buffer from alloc_buffer is NotShareable.
    let store = Store::builder().connect(&server.socket).open().await.unwrap();
    let mut v = vec![0u8; 4096];
    // SAFETY: refused before anything maps it.
    let e = unsafe { store.register_buffer(v.as_mut_ptr() as u64, 4096) }
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::NotShareable { .. }), "{e}");
    store.close().await.unwrap();
}

/// The worker process of `several_worker_processes_share_one_server`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_child() {
    let Ok(socket) = std::env::var(WORKER_VAR) else { return };
    let id: usize = std::env::var("UMBP_TEST_WORKER_ID").unwrap().parse().unwrap();
    let store = Store::builder().connect(&socket).open().await.unwrap();
    let obj = 3 * 1728usize;
    let pages = 16;
    let buf = store.alloc_buffer(2 * pages * obj).unwrap();
    // SAFETY: freed at the end.
    unsafe { store.register_buffer(buf.addr(), buf.len() as u64) }
        .await
        .unwrap();
    let keys: Vec<String> = (0..pages).map(|p| format!("w{id}/p{p}")).collect();
    {
        // SAFETY: no call uses the buffer now.
        let b = unsafe { buf.bytes_mut() };
        for (p, k) in keys.iter().enumerate() {
            fill(b, p * obj, k, 0, obj);
        }
    }
    put_whole(&store, &keys, buf.addr(), obj as u64);
    let back = pages * obj;
    for round in 0..20 {
        // SAFETY: no call uses the buffer now.
        unsafe { buf.bytes_mut()[back..].fill(0) };
        let rs: Vec<[Range; 1]> = (0..pages)
            .map(|p| [Range::new(1728, 1728, buf.addr() + (back + p * 1728) as u64)])
            .collect();
        let gets: Vec<RangedGet<'_>> = keys
            .iter()
            .zip(&rs)
            .map(|(k, r)| RangedGet { key: k, ranges: r })
            .collect();
        for g in store.batch_get_ranges(&gets).unwrap() {
            assert_eq!(g.unwrap(), 1728);
        }
        // SAFETY: the get has returned.
        let b = unsafe { buf.bytes() };
        for (p, k) in keys.iter().enumerate() {
            assert!(
                check(b, back + p * 1728, k, 1728, 1728),
                "worker {id} round {round} page {p}"
            );
        }
    }
    store.free_buffer(buf).await.unwrap();
    println!("worker {id} ok");
    store.close().await.unwrap();
}

#[test]
fn several_worker_processes_share_one_server() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--dram", "64M"], &[]);
    let children: Vec<_> = (0..3)
        .map(|id| {
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "worker_child", "--nocapture", "--test-threads=1"])
                .env(WORKER_VAR, &server.socket)
                .env("UMBP_TEST_WORKER_ID", id.to_string())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (id, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "worker {id}: {text}");
        assert!(text.contains(&format!("worker {id} ok")), "worker {id}: {text}");
    }
    // Every worker's keys are on the server, and nothing of theirs is mapped any more.
    let mut raw = Raw::connect(&server.socket, [0; 16]).unwrap();
    let mut tx = Vec::new();
    umbp::standalone::wire::encode_keys(
        &mut tx,
        Op::ExistsConsecutive,
        ["w0/p15", "w1/p15", "w2/p15"].into_iter(),
    )
    .unwrap();
    assert_eq!(raw.call(&tx, None).unwrap(), Op::Ok);
    assert_eq!(raw.rx, 3u64.to_le_bytes());
    eventually(10, "worker mappings to go", || memfd_maps(server.pid()) == 0);
}

/// The child of `a_wrong_uid_is_refused`: connects and prints what happened.
#[test]
fn uid_child() {
    let Ok(socket) = std::env::var("UMBP_TEST_UID_SOCKET") else {
        return;
    };
    match Raw::connect(std::path::Path::new(&socket), [0; 16]) {
        Ok(_) => println!("connected"),
        Err(e) => println!("refused: {e}"),
    }
}

#[test]
fn a_wrong_uid_is_refused() {
    use std::os::unix::process::CommandExt;
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } != 0 {
        println!("skipped: switching uid needs root (the check is unit-tested in server.rs)");
        return;
    }
    // Everything uid 65534 needs lies under /tmp (1777), not under the checkout: a checkout in
    // a 0700 directory (/root, mktemp -d) is not traversable by that uid.
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let server = Server::start(dir.path(), &["--dram", "16M"], &[]);
    let mode = std::fs::metadata(&server.socket).unwrap().permissions();
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777, 0o600);
    // Open the directory and the socket file to everyone, so only SO_PEERCRED stands in the way.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&server.socket, std::fs::Permissions::from_mode(0o777)).unwrap();
    // A copy of this test binary that the other uid can execute.
    let exe_dir = tempfile::tempdir_in("/tmp").unwrap();
    std::fs::set_permissions(exe_dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = exe_dir.path().join("uid-child");
    std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = match Command::new(&exe)
        .args(["--exact", "uid_child", "--nocapture", "--test-threads=1"])
        .env("UMBP_TEST_UID_SOCKET", &server.socket)
        .current_dir(exe_dir.path())
        .uid(65534)
        .gid(65534)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            println!(
                "skipped: cannot run a copy of the test binary as uid 65534 from {}: {e}",
                exe.display()
            );
            return;
        }
    };
    let text = String::from_utf8_lossy(&out.stdout);
    if text.contains("Permission denied") && !text.contains("refused by") {
        println!("skipped: the test binary is not reachable as uid 65534: {text}");
        return;
    }
    assert!(text.contains("refused by the umbp-server: peer credentials"), "{text}");
    // The server's own uid still connects.
    Raw::connect(&server.socket, [0; 16]).unwrap();
}

#[test]
fn sigterm_flushes_and_unlinks_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().join("ssd");
    std::fs::create_dir(&ssd).unwrap();
    let ssd_arg = ssd.to_str().unwrap().to_owned();
    let args = ["--dram", "16M", "--ssd-dirs", &ssd_arg, "--ssd-capacity", "256M"];
    let mut server = Server::start(dir.path(), &args, &[("UMBP_SSD_SEGMENT_BYTES", "8M")]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = rt.block_on(Store::builder().connect(&server.socket).open()).unwrap();
    rt.block_on(store.put("kept", &[5u8; 9000], 0)).unwrap();
    let status = server.terminate();
    assert!(status.success(), "{status:?}");
    assert!(!server.socket.exists(), "the socket file was left behind");
    // The DRAM-only object was flushed to SSD on the way out: a new server serves it.
    let _server = Server::start(dir.path(), &args, &[("UMBP_SSD_SEGMENT_BYTES", "8M")]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let got = loop {
        match rt.block_on(store.get("kept")) {
            Err(StoreError::ServerGone { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            other => break other,
        }
    };
    assert_eq!(got.unwrap(), vec![5u8; 9000]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_key_is_proved_before_anything_else() {
    use std::sync::Arc;
    use te_base::config::MapEnv;
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    let other = dir.path().join("other");
    std::fs::write(&key, "a-shared-key-of-32-bytes-or-so!!\n").unwrap();
    std::fs::write(&other, "another-key-of-32-bytes-or-so!!!\n").unwrap();
    let key_s = key.to_str().unwrap().to_owned();
    let server = Server::start(dir.path(), &["--dram", "16M"], &[("TE_AUTH_KEY_FILE", &key_s)]);
    let with = |file: Option<&std::path::Path>| {
        let env = match file {
            Some(f) => MapEnv::new([("TE_AUTH_KEY_FILE", f.to_str().unwrap())]),
            None => MapEnv::new([]),
        };
        Store::builder().env(Arc::new(env)).connect(&server.socket)
    };
    let store = with(Some(&key)).open().await.unwrap();
    store.put("k", &[1u8; 100], 0).await.unwrap();
    assert_eq!(store.get("k").await.unwrap(), vec![1u8; 100]);
    for (file, what) in [(None, "no key"), (Some(other.as_path()), "another key")] {
        let e = with(file).open().await.unwrap_err();
        // No key: the server says it wants one. Another key: the server's proof fails here (the
        // handshake is mutual), before this side proves anything.
        let want = if file.is_none() {
            "shared key"
        } else {
            "not authenticated"
        };
        assert!(
            matches!(&e, StoreError::Refused { reason } if reason.contains(want)),
            "{what}: {e}"
        );
    }
    // A raw hello without a nonce is refused before its session token is looked at.
    let e = Raw::connect(&server.socket, [0; 16]).err().unwrap();
    assert!(
        matches!(&e, StoreError::Refused { reason } if reason.contains("shared key")),
        "{e}"
    );
    // A peer that answers the challenge with a wrong proof is refused by the server.
    {
        use umbp::standalone::io::{recv_frame, send_frame};
        use umbp::standalone::wire::{self, Reader};
        let s = std::os::unix::net::UnixStream::connect(&server.socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut tx = Vec::new();
        wire::begin(&mut tx, Op::Hello);
        tx.extend_from_slice(&[0u8; 16 + 32]);
        wire::finish(&mut tx).unwrap();
        send_frame(&s, &tx, None).unwrap();
        let mut rx = Vec::new();
        assert_eq!(recv_frame(&s, &mut rx, 1 << 20, false).unwrap().0.op, Op::Challenge);
        wire::begin(&mut tx, Op::Proof);
        tx.extend_from_slice(&[7u8; 32]);
        wire::finish(&mut tx).unwrap();
        send_frame(&s, &tx, None).unwrap();
        assert_eq!(recv_frame(&s, &mut rx, 1 << 20, false).unwrap().0.op, Op::Err);
        let e = wire::decode_error(&mut Reader::new(&rx)).unwrap();
        assert!(matches!(e, StoreError::Refused { .. }), "{e}");
    }
    // A client holding a key refuses a server that proves none.
    let dir2 = tempfile::tempdir().unwrap();
    let open_server = Server::start(dir2.path(), &["--dram", "16M"], &[]);
    let env = MapEnv::new([("TE_AUTH_KEY_FILE", key_s.as_str())]);
    let e = Store::builder()
        .env(Arc::new(env))
        .connect(&open_server.socket)
        .open()
        .await
        .unwrap_err();
    assert!(e.to_string().contains("did not prove"), "{e}");
    store.close().await.unwrap();
}

/// `Store::get` waiting on a server that does not answer leaves the runtime's other tasks
/// running: on a runtime with one worker, a task queued behind the waiting get still runs before
/// the get gives up.
#[test]
fn an_async_get_waiting_on_a_stopped_server_does_not_stall_other_tasks() {
    use std::collections::HashMap;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &["--dram", "16M"], &[]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    // The get waits this long for the stopped server. The other task only needs a replacement
    // worker thread to start meanwhile; 2 s was too short for that once, under a parallel test
    // run on two loaded cores (the get's timeout answered first).
    let env = te_base::config::MapEnv(HashMap::from([(
        "UMBP_STANDALONE_TIMEOUT_MS".to_owned(),
        "10000".to_owned(),
    )]));
    let open = Store::builder()
        .env(std::sync::Arc::new(env))
        .connect(&server.socket)
        .open();
    let store = rt.block_on(open).unwrap();
    rt.block_on(store.put("k", &[1u8; 4096], 0)).unwrap();
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(server.pid() as i32, libc::SIGSTOP) }, 0);
    // The stop is delivered asynchronously: a server thread running when it was sent may still
    // answer the get. Wait until every thread of the server is stopped (hang guard: 30 s).
    let tasks = format!("/proc/{}/task", server.pid());
    let stopped = || {
        std::fs::read_dir(&tasks).ok().is_some_and(|dir| {
            dir.flatten().all(|t| {
                // The state follows the parenthesized command name in /proc/PID/task/TID/stat.
                std::fs::read_to_string(t.path().join("stat"))
                    .ok()
                    .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.starts_with('T')))
                    .unwrap_or(false)
            })
        })
    };
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while !stopped() {
        assert!(std::time::Instant::now() < until, "the server did not stop");
        std::thread::yield_now();
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let (s, t) = (store.clone(), tx.clone());
    rt.spawn(async move { t.send(("get", s.get("k").await.is_ok())).unwrap() });
    rt.spawn(async move { tx.send(("other task", true)).unwrap() });
    let first = rx.recv_timeout(Duration::from_secs(30));
    let second = rx.recv_timeout(Duration::from_secs(30));
    // SAFETY: as above.
    unsafe { libc::kill(server.pid() as i32, libc::SIGCONT) };
    assert_eq!(
        first.unwrap().0,
        "other task",
        "the other task waited for the blocked get"
    );
    assert_eq!(second.unwrap(), ("get", false), "a get from a stopped server succeeded");
    rt.block_on(store.close()).unwrap();
}
