//! A peer that does not play by the rules, on 127.0.0.1: no key or the wrong one, idle
//! connections, a header sent byte by byte and never finished, replies never drained. Each test
//! bounds its loops in count and time.

mod common;
use common::reply;

use std::sync::Arc;
use std::time::{Duration, Instant};

use te_base::auth::{AuthKey, NONCE_LEN};
use te_base::config::MapEnv;
use te_base::{Error, MemoryLocation, RegionId, RegionInfo, SegmentDescriptor, Transport, TransportEndpoint};
use te_transport_tcp::wire::{Header, Opcode, RefusalCode, HELLO_AUTH_LEN};
use te_transport_tcp::{TcpConfig, TcpTransport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn key(byte: u8) -> AuthKey {
    AuthKey::from_bytes(&[byte; 32]).unwrap()
}

async fn transport(vars: &[(&str, &str)], auth: Option<AuthKey>) -> Arc<TcpTransport> {
    let mut env = MapEnv::new([("TE_TCP_LISTEN", "127.0.0.1:0")]);
    for (k, v) in vars {
        env.0.insert(k.to_string(), v.to_string());
    }
    Arc::new(
        TcpTransport::start_with_auth(TcpConfig::from_env(&env).unwrap(), auth)
            .await
            .unwrap(),
    )
}

fn region(mem: &[u8], id: u64) -> RegionInfo {
    RegionInfo {
        id: RegionId(id),
        base: mem.as_ptr() as u64,
        len: mem.len() as u64,
        location: MemoryLocation::HOST,
        exported: true,
    }
}

fn descriptor(t: &TcpTransport, name: &str, mem: &[u8]) -> SegmentDescriptor {
    let mut d = SegmentDescriptor::new(name, 1);
    d.transports.push(TransportEndpoint {
        transport: "tcp".into(),
        info: t.endpoint(),
    });
    d.buffers.push(te_base::ExportedBuffer {
        base: mem.as_ptr() as u64,
        len: mem.len() as u64,
        location: MemoryLocation::HOST,
        keys: Default::default(),
    });
    d
}

/// How long a wait for an event may take before the test fails: a hang guard only, far above
/// every timeout the tests set, so the verdict does not depend on how fast the machine is.
const HANG_GUARD: Duration = Duration::from_secs(30);

/// Waits (bounded) until the target closes `s`.
async fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    let mut b = [0u8; 64];
    let end = Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(end.into(), s.read(&mut b)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
        }
    }
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn hex_forms(token: u64) -> [String; 3] {
    [format!("{token:#x}"), format!("{token:x}"), token.to_string()]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_or_missing_key_is_refused_and_no_error_names_the_token() {
    let target = transport(&[], Some(key(1))).await;
    let mem = vec![0x5Au8; 4096];
    target.register(&[region(&mem, 1)]).await.unwrap();
    let token = target.tcp_endpoint().token;
    let desc = descriptor(&target, "victim", &mem);

    // An engine with another key, and one with none: both refused with Unauthenticated.
    for auth in [Some(key(2)), None] {
        let attacker = transport(&[], auth.clone()).await;
        let err = attacker.connect(&desc).await.err().expect("refused");
        assert!(matches!(err, Error::Unauthenticated { .. }), "{auth:?}: {err}");
        for form in hex_forms(token) {
            assert!(!err.to_string().contains(&form), "the error names the token: {err}");
        }
    }
    // An engine with the key gets in.
    let friend = transport(&[], Some(key(1))).await;
    assert!(friend.connect(&desc).await.is_ok());

    // Raw: a plain HELLO (even with the right token), and an authenticating HELLO followed by a
    // forged proof. Each gets an Unauthenticated refusal naming nothing, then a closed socket.
    let mut s = TcpStream::connect(target.local_addr()).await.unwrap();
    let hello = Header {
        token,
        ..Header::new(Opcode::Hello)
    };
    s.write_all(&hello.to_bytes()).await.unwrap();
    let (h, msg) = reply(&mut s).await.expect("a refusal");
    assert_eq!(
        (h.opcode, RefusalCode::from_u16(h.code)),
        (Opcode::Error, RefusalCode::Unauthenticated)
    );
    let text = String::from_utf8_lossy(&msg).to_string();
    for form in hex_forms(token) {
        assert!(!text.contains(&form), "{text}");
    }
    assert_eq!(h.token, 0, "the refusal carries no token");
    assert!(closed_within(&mut s, HANG_GUARD).await);

    let mut s = TcpStream::connect(target.local_addr()).await.unwrap();
    let hello = Header {
        token: 0,
        len: HELLO_AUTH_LEN,
        ..Header::new(Opcode::Hello)
    };
    s.write_all(&hello.to_bytes()).await.unwrap();
    s.write_all(&[7u8; NONCE_LEN]).await.unwrap();
    let (challenge, _) = reply(&mut s).await.expect("a challenge");
    assert_eq!((challenge.opcode, challenge.token), (Opcode::Challenge, 0));
    let proof = Header {
        len: 32,
        ..Header::new(Opcode::Proof)
    };
    s.write_all(&proof.to_bytes()).await.unwrap();
    s.write_all(&[0u8; 32]).await.unwrap();
    let (h, msg) = reply(&mut s).await.expect("a refusal");
    assert_eq!(RefusalCode::from_u16(h.code), RefusalCode::Unauthenticated);
    let text = String::from_utf8_lossy(&msg).to_string();
    for form in hex_forms(token) {
        assert!(!text.contains(&form), "{text}");
    }
    assert!(closed_within(&mut s, HANG_GUARD).await);
    assert!(mem.iter().all(|&b| b == 0x5A));

    // Without a key, a wrong token is still refused without naming the real one.
    let open = transport(&[], None).await;
    let mut s = TcpStream::connect(open.local_addr()).await.unwrap();
    let hello = Header {
        token: 12345,
        ..Header::new(Opcode::Hello)
    };
    s.write_all(&hello.to_bytes()).await.unwrap();
    let (h, msg) = reply(&mut s).await.expect("a refusal");
    assert_eq!(RefusalCode::from_u16(h.code), RefusalCode::WrongInstance);
    let text = String::from_utf8_lossy(&msg).to_string();
    for form in hex_forms(open.tcp_endpoint().token) {
        assert!(!text.contains(&form), "{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_cut_and_descriptors_return_to_baseline() {
    let target = transport(
        &[
            // Long enough that opening the 200 connections (tens of ms) cannot outlast them on a
            // starved machine: the first ones must still be served when the last one opens.
            ("TE_TCP_IDLE_TIMEOUT_MS", "3000"),
            ("TE_TCP_HANDSHAKE_TIMEOUT_MS", "3000"),
        ],
        None,
    )
    .await;
    let token = target.tcp_endpoint().token;
    let baseline = open_fds();
    let mut sockets = Vec::new();
    for i in 0..200 {
        let mut s = TcpStream::connect(target.local_addr()).await.unwrap();
        if i % 2 == 0 {
            let hello = Header {
                token,
                ..Header::new(Opcode::Hello)
            };
            s.write_all(&hello.to_bytes()).await.unwrap();
            assert_eq!(reply(&mut s).await.unwrap().0.opcode, Opcode::HelloAck);
        }
        sockets.push(s);
    }
    // Each served connection costs exactly one descriptor on the target's side.
    let end = Instant::now() + HANG_GUARD;
    while target.served_connections() < 200 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(target.served_connections(), 200);
    assert!(
        open_fds() <= baseline + 2 * 200 + 2,
        "{} fds for 200 connections",
        open_fds() - baseline
    );
    for s in &mut sockets {
        assert!(closed_within(s, HANG_GUARD).await, "an idle connection was not cut");
    }
    let end = Instant::now() + HANG_GUARD;
    while target.served_connections() > 0 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(target.served_connections(), 0);
    drop(sockets);
    assert!(open_fds() <= baseline + 2, "fds {} vs baseline {baseline}", open_fds());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_caps_hold_and_free_up() {
    let target = transport(
        &[
            ("TE_TCP_MAX_CONNECTIONS", "8"),
            ("TE_TCP_MAX_CONNECTIONS_PER_SOURCE", "4"),
        ],
        None,
    )
    .await;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(TcpStream::connect(target.local_addr()).await.unwrap());
    }
    let end = Instant::now() + HANG_GUARD;
    while target.served_connections() < 4 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A fifth connection from 127.0.0.1 is closed at once.
    let mut extra = TcpStream::connect(target.local_addr()).await.unwrap();
    assert!(closed_within(&mut extra, HANG_GUARD).await);
    assert_eq!(target.served_connections(), 4);
    drop(held);
    let end = Instant::now() + HANG_GUARD;
    while target.served_connections() > 0 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Places free up: an engine connects again.
    let mem = vec![1u8; 4096];
    target.register(&[region(&mem, 1)]).await.unwrap();
    let client = transport(&[], None).await;
    assert!(client.connect(&descriptor(&target, "t", &mem)).await.is_ok());
}

/// How long a slowloris may hold a connection in [`a_header_slowloris_is_cut`]: a third of the
/// idle timeout it runs with, so a cut within it is the frame timeout's (or the handshake's).
const SLOWLORIS_GUARD: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_slowloris_is_cut() {
    let target = transport(
        &[("TE_TCP_TIMEOUT_MS", "300"), ("TE_TCP_IDLE_TIMEOUT_MS", "60000")],
        None,
    )
    .await;
    let token = target.tcp_endpoint().token;
    // Before the HELLO is complete: the handshake deadline and the frame timeout both apply.
    let mut s = TcpStream::connect(target.local_addr()).await.unwrap();
    let hello = Header {
        token,
        ..Header::new(Opcode::Hello)
    }
    .to_bytes();
    s.write_all(&hello[..20]).await.unwrap();
    // Bounds well below the 60 s idle timeout, so only the frame timeout or the handshake
    // deadline (5 s) can have cut it, however slow the machine: not a measure of their delay.
    assert!(closed_within(&mut s, SLOWLORIS_GUARD).await);

    // After the HELLO: 20 bytes of a READ header, then silence. The idle timeout (60 s) does not
    // protect a started frame; the frame timeout (300 ms) cuts it.
    let mut s = TcpStream::connect(target.local_addr()).await.unwrap();
    s.write_all(&hello).await.unwrap();
    assert_eq!(reply(&mut s).await.unwrap().0.opcode, Opcode::HelloAck);
    let read = Header {
        token,
        addr: 0x1000,
        len: 8,
        ..Header::new(Opcode::Read)
    }
    .to_bytes();
    s.write_all(&read[..20]).await.unwrap();
    assert!(
        closed_within(&mut s, SLOWLORIS_GUARD).await,
        "not cut before the idle timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undrained_read_replies_cannot_hold_deregistration() {
    let target = transport(&[("TE_TCP_TIMEOUT_MS", "500")], None).await;
    let token = target.tcp_endpoint().token;
    let mem = vec![3u8; 32 << 20];
    let r = region(&mem, 1);
    target.register(std::slice::from_ref(&r)).await.unwrap();
    // A peer asks for far more than the socket buffers hold and never reads a byte.
    let mut s = TcpStream::connect(target.local_addr()).await.unwrap();
    let hello = Header {
        token,
        ..Header::new(Opcode::Hello)
    };
    s.write_all(&hello.to_bytes()).await.unwrap();
    assert_eq!(reply(&mut s).await.unwrap().0.opcode, Opcode::HelloAck);
    for id in 0..64u64 {
        let read = Header {
            request_id: id,
            token,
            addr: r.base,
            len: r.len,
            ..Header::new(Opcode::Read)
        };
        s.write_all(&read.to_bytes()).await.unwrap();
    }
    let end = Instant::now() + HANG_GUARD;
    while target.remote_requests_in_progress() == 0 && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(target.remote_requests_in_progress() > 0, "the replies pin the region");
    let t0 = Instant::now();
    // A hang guard only: without the frame timeout's cut the wait would never end.
    tokio::time::timeout(Duration::from_secs(60), target.deregister(std::slice::from_ref(&r)))
        .await
        .expect("deregistration finishes once the stalled connection is cut")
        .unwrap();
    // 32 MiB replies do not fit the socket buffers: the first write stalled with its pin held,
    // so only the watchdog's cut could end the wait.
    assert!(
        t0.elapsed() >= Duration::from_millis(250),
        "the pins were released without the cut"
    );
    assert_eq!(target.remote_requests_in_progress(), 0);
    drop(s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_lane_pings_and_outlives_the_idle_timeout() {
    // The lane pings every third of the idle timeout: a ping may come up to 2/3 s late on a
    // starved machine before the target cuts the lane.
    let target = transport(&[("TE_TCP_IDLE_TIMEOUT_MS", "1000")], Some(key(9))).await;
    let mem = vec![0u8; 4096];
    target.register(&[region(&mem, 1)]).await.unwrap();
    let client = transport(&[], Some(key(9))).await;
    let src = vec![0xC3u8; 4096];
    client.register(&[region(&src, 2)]).await.unwrap();
    let peer = client.connect(&descriptor(&target, "t", &mem)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(3000)).await;
    assert!(peer.is_healthy(), "an idle lane was cut although it pinged");
    assert_eq!(target.served_connections(), 1);
}
