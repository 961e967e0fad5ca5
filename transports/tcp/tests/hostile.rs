//! Hostile frames sent from a raw socket: the serving side answers with ERROR frames, never touches
//! memory outside what it registered and exported, and keeps serving.

mod common;
use common::reply;

use std::sync::Arc;

use te_base::config::MapEnv;
use te_base::{MemoryLocation, RegionId, RegionInfo, Transport};
use te_transport_tcp::wire::{Header, Opcode, RefusalCode, HEADER_LEN, MAX_DATA_LEN, VERSION};
use te_transport_tcp::{TcpConfig, TcpTransport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

struct Target {
    t: Arc<TcpTransport>,
    exported: Box<[u8]>,
    private: Box<[u8]>,
}

impl Target {
    async fn start() -> Target {
        let env = MapEnv::new([("TE_TCP_LISTEN", "127.0.0.1:0")]);
        let t = Arc::new(TcpTransport::start(TcpConfig::from_env(&env).unwrap()).await.unwrap());
        let exported = vec![0xEEu8; 4096].into_boxed_slice();
        let private = vec![0x77u8; 4096].into_boxed_slice();
        let info = |id, b: &[u8], exported| RegionInfo {
            id: RegionId(id),
            base: b.as_ptr() as u64,
            len: b.len() as u64,
            location: MemoryLocation::HOST,
            exported,
        };
        t.register(&[info(1, &exported, true), info(2, &private, false)])
            .await
            .unwrap();
        Target { t, exported, private }
    }
    fn token(&self) -> u64 {
        self.t.tcp_endpoint().token
    }
    fn base(&self) -> u64 {
        self.exported.as_ptr() as u64
    }
    async fn raw(&self) -> TcpStream {
        TcpStream::connect(self.t.local_addr()).await.unwrap()
    }
    async fn greeted(&self) -> TcpStream {
        let mut s = self.raw().await;
        let hello = Header {
            token: self.token(),
            ..Header::new(Opcode::Hello)
        };
        s.write_all(&hello.to_bytes()).await.unwrap();
        assert_eq!(reply(&mut s).await.unwrap().0.opcode, Opcode::HelloAck);
        s
    }
    fn untouched(&self) {
        assert!(self.private.iter().all(|&b| b == 0x77), "private memory was touched");
    }
}

async fn expect_refusal(s: &mut TcpStream, code: RefusalCode, id: u64) -> String {
    let (h, msg) = reply(s).await.expect("an ERROR frame");
    assert_eq!(h.opcode, Opcode::Error);
    assert_eq!(RefusalCode::from_u16(h.code), code);
    assert_eq!(h.request_id, id);
    String::from_utf8(msg).unwrap()
}

async fn expect_closed(s: &mut TcpStream) {
    let mut b = [0u8; 1];
    assert_eq!(
        s.read(&mut b).await.unwrap_or(0),
        0,
        "the target should close the connection"
    );
}

fn req(op: Opcode, id: u64, token: u64, addr: u64, len: u64) -> [u8; HEADER_LEN] {
    Header {
        request_id: id,
        token,
        addr,
        len,
        ..Header::new(op)
    }
    .to_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_bounds_requests_get_error_frames_and_the_connection_survives() {
    let t = Target::start().await;
    let tok = t.token();
    let mut s = t.greeted().await;
    let private = t.private.as_ptr() as u64;

    // A write into registered but not exported memory, with its payload.
    s.write_all(&req(Opcode::Write, 1, tok, private, 16)).await.unwrap();
    s.write_all(&[0xAB; 16]).await.unwrap();
    let msg = expect_refusal(&mut s, RefusalCode::OutOfBounds, 1).await;
    assert!(msg.contains("not inside"), "{msg}");

    // A write overlapping the end of the exported buffer.
    s.write_all(&req(Opcode::Write, 2, tok, t.base() + 4090, 16))
        .await
        .unwrap();
    s.write_all(&[0xAB; 16]).await.unwrap();
    expect_refusal(&mut s, RefusalCode::OutOfBounds, 2).await;

    // Reads: before the buffer, overflowing the address space, zero length.
    s.write_all(&req(Opcode::Read, 3, tok, t.base() - 1, 2)).await.unwrap();
    expect_refusal(&mut s, RefusalCode::OutOfBounds, 3).await;
    s.write_all(&req(Opcode::Read, 4, tok, u64::MAX - 3, 100))
        .await
        .unwrap();
    let msg = expect_refusal(&mut s, RefusalCode::OutOfBounds, 4).await;
    assert!(msg.contains("overflows"), "{msg}");
    s.write_all(&req(Opcode::Read, 5, tok, t.base(), 0)).await.unwrap();
    expect_refusal(&mut s, RefusalCode::ZeroLength, 5).await;
    // Private memory is never read out either.
    s.write_all(&req(Opcode::Read, 6, tok, private, 8)).await.unwrap();
    expect_refusal(&mut s, RefusalCode::OutOfBounds, 6).await;

    // A request naming another instance.
    s.write_all(&req(Opcode::Read, 7, tok ^ 1, t.base(), 8)).await.unwrap();
    expect_refusal(&mut s, RefusalCode::WrongInstance, 7).await;

    // The connection still serves a valid write and read.
    s.write_all(&req(Opcode::Write, 8, tok, t.base() + 100, 4))
        .await
        .unwrap();
    s.write_all(&[1, 2, 3, 4]).await.unwrap();
    let (ack, _) = reply(&mut s).await.unwrap();
    assert_eq!((ack.opcode, ack.request_id, ack.len), (Opcode::WriteAck, 8, 4));
    s.write_all(&req(Opcode::Read, 9, tok, t.base() + 99, 6)).await.unwrap();
    let (data, payload) = reply(&mut s).await.unwrap();
    assert_eq!(data.opcode, Opcode::ReadData);
    assert_eq!(payload, [0xEE, 1, 2, 3, 4, 0xEE]);
    t.untouched();
    assert!(t.exported[..100].iter().all(|&b| b == 0xEE));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_violations_close_the_connection_but_not_the_server() {
    let t = Target::start().await;
    let tok = t.token();

    // Garbage instead of a HELLO.
    let mut s = t.raw().await;
    s.write_all(&[0x42; HEADER_LEN]).await.unwrap();
    expect_refusal(&mut s, RefusalCode::Protocol, 0).await;
    expect_closed(&mut s).await;

    // A HELLO for another instance.
    let mut s = t.raw().await;
    s.write_all(
        &Header {
            token: tok ^ 8,
            ..Header::new(Opcode::Hello)
        }
        .to_bytes(),
    )
    .await
    .unwrap();
    expect_refusal(&mut s, RefusalCode::WrongInstance, 0).await;
    expect_closed(&mut s).await;

    // A request before the HELLO.
    let mut s = t.raw().await;
    s.write_all(&req(Opcode::Read, 1, tok, t.base(), 8)).await.unwrap();
    expect_refusal(&mut s, RefusalCode::Protocol, 1).await;
    expect_closed(&mut s).await;

    // After a HELLO: an oversized length, a bad version, an unknown opcode, a reply opcode.
    let mut bad_version = req(Opcode::Read, 1, tok, t.base(), 8);
    bad_version[4] = VERSION + 1;
    let mut bad_opcode = req(Opcode::Read, 1, tok, t.base(), 8);
    bad_opcode[5] = 99;
    for frame in [
        req(Opcode::Write, 1, tok, t.base(), MAX_DATA_LEN + 1),
        bad_version,
        bad_opcode,
        req(Opcode::WriteAck, 1, tok, t.base(), 8),
    ] {
        let mut s = t.greeted().await;
        s.write_all(&frame).await.unwrap();
        let (h, _) = reply(&mut s).await.expect("an ERROR frame");
        assert_eq!(
            (h.opcode, RefusalCode::from_u16(h.code)),
            (Opcode::Error, RefusalCode::Protocol)
        );
        expect_closed(&mut s).await;
    }

    // A truncated header, then the sender vanishes.
    let mut s = t.greeted().await;
    s.write_all(&req(Opcode::Write, 1, tok, t.base(), 8)[..17])
        .await
        .unwrap();
    drop(s);
    // A truncated payload: the header is fine, the payload stops short. Only those bytes may
    // land, and only inside the exported buffer.
    let mut s = t.greeted().await;
    s.write_all(&req(Opcode::Write, 1, tok, t.base(), 64)).await.unwrap();
    s.write_all(&[9; 10]).await.unwrap();
    drop(s);

    // The server still serves new connections.
    let mut s = t.greeted().await;
    s.write_all(&req(Opcode::Read, 1, tok, t.base() + 4000, 96))
        .await
        .unwrap();
    let (h, payload) = reply(&mut s).await.unwrap();
    assert_eq!((h.opcode, payload.len()), (Opcode::ReadData, 96));
    t.untouched();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_write_payload_cannot_block_deregistration() {
    let env = MapEnv::new([("TE_TCP_LISTEN", "127.0.0.1:0"), ("TE_TCP_TIMEOUT_MS", "300")]);
    let t = Arc::new(TcpTransport::start(TcpConfig::from_env(&env).unwrap()).await.unwrap());
    let mem = vec![0u8; 1 << 16].into_boxed_slice();
    let region = RegionInfo {
        id: RegionId(1),
        base: mem.as_ptr() as u64,
        len: mem.len() as u64,
        location: MemoryLocation::HOST,
        exported: true,
    };
    t.register(std::slice::from_ref(&region)).await.unwrap();
    let mut s = TcpStream::connect(t.local_addr()).await.unwrap();
    let tok = t.tcp_endpoint().token;
    s.write_all(
        &Header {
            token: tok,
            ..Header::new(Opcode::Hello)
        }
        .to_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(reply(&mut s).await.unwrap().0.opcode, Opcode::HelloAck);
    // A valid write header announcing 64 KiB, then only 10 bytes, then silence: the target pins
    // the region while it waits for the rest.
    s.write_all(&req(Opcode::Write, 1, tok, region.base, 1 << 16))
        .await
        .unwrap();
    s.write_all(&[1; 10]).await.unwrap();
    while t.remote_requests_in_progress() == 0 {
        tokio::task::yield_now().await;
    }
    // Deregistration still completes: the stalled connection is cut after the timeout.
    t.deregister(std::slice::from_ref(&region)).await.unwrap();
    expect_closed(&mut s).await;
}
