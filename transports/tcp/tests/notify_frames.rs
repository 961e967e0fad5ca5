//! NOTIFY frames from a raw socket: a malformed body is refused and the connection keeps serving,
//! a full inbox and an oversized payload are answered with their codes (and the target's maximum),
//! an oversized frame ends the connection, and nothing is queued beyond the inbox's bounds.

mod common;
use common::reply;

use std::sync::Arc;

use te_base::config::MapEnv;
use te_base::{NotifyInbox, NotifyLimits};
use te_transport_tcp::wire::{Header, Opcode, RefusalCode};
use te_transport_tcp::{TcpConfig, TcpTransport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn target(inbox: Arc<NotifyInbox>) -> TcpTransport {
    let env = MapEnv::new([("TE_TCP_LISTEN", "127.0.0.1:0")]);
    TcpTransport::start_with(TcpConfig::from_env(&env).unwrap(), None, inbox)
        .await
        .unwrap()
}

async fn greeted(t: &TcpTransport) -> TcpStream {
    let mut s = TcpStream::connect(t.local_addr()).await.unwrap();
    let hello = Header {
        token: t.tcp_endpoint().token,
        ..Header::new(Opcode::Hello)
    };
    s.write_all(&hello.to_bytes()).await.unwrap();
    assert_eq!(reply(&mut s).await.unwrap().0.opcode, Opcode::HelloAck);
    s
}

async fn notify_frame(s: &mut TcpStream, id: u64, body: &[u8]) -> Header {
    let h = Header {
        request_id: id,
        len: body.len() as u64,
        ..Header::new(Opcode::Notify)
    };
    let mut frame = h.to_bytes().to_vec();
    frame.extend_from_slice(body);
    s.write_all(&frame).await.unwrap();
    let (r, _) = reply(s).await.expect("an answer");
    assert_eq!(r.request_id, id);
    r
}

fn body(from: &str, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    te_base::notify::encode_body(from, payload, &mut out).unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_notify_frames_are_bounded_and_answered() {
    let inbox = NotifyInbox::new(NotifyLimits {
        queue_depth: 2,
        max_bytes: 8,
    });
    let t = target(inbox.clone()).await;
    let mut s = greeted(&t).await;

    // Sender name longer than the body: refused, the connection keeps serving.
    let r = notify_frame(&mut s, 1, &[200, b'a']).await;
    assert_eq!(
        (r.opcode, RefusalCode::from_u16(r.code)),
        (Opcode::Error, RefusalCode::Protocol)
    );
    // Too large a payload: TooLarge, with the target's maximum in `addr`.
    let r = notify_frame(&mut s, 2, &body("x", &[0; 9])).await;
    assert_eq!(RefusalCode::from_u16(r.code), RefusalCode::TooLarge);
    assert_eq!(r.addr, 8);
    // Two fit, the third is refused as QueueFull.
    assert_eq!(
        notify_frame(&mut s, 3, &body("x", b"1")).await.opcode,
        Opcode::NotifyAck
    );
    assert_eq!(
        notify_frame(&mut s, 4, &body("y", b"2")).await.opcode,
        Opcode::NotifyAck
    );
    let r = notify_frame(&mut s, 5, &body("z", b"3")).await;
    assert_eq!(RefusalCode::from_u16(r.code), RefusalCode::QueueFull);
    assert_eq!(inbox.len(), 2);
    assert_eq!(inbox.try_recv().unwrap().from, "x");
    assert_eq!(inbox.try_recv().unwrap().from, "y");
    assert!(inbox.try_recv().is_none());

    // A frame above the wire bound ends the connection before any payload is read.
    let h = Header {
        request_id: 6,
        len: te_base::notify::MAX_BODY_LEN as u64 + 1,
        ..Header::new(Opcode::Notify)
    };
    s.write_all(&h.to_bytes()).await.unwrap();
    let (r, _) = reply(&mut s).await.expect("an ERROR frame");
    assert_eq!(RefusalCode::from_u16(r.code), RefusalCode::Protocol);
    let mut b = [0u8; 1];
    assert_eq!(s.read(&mut b).await.unwrap_or(0), 0, "the connection should be closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_before_the_handshake_is_refused() {
    let inbox = NotifyInbox::new(NotifyLimits::default());
    let t = target(inbox.clone()).await;
    let mut s = TcpStream::connect(t.local_addr()).await.unwrap();
    let b = body("x", b"1");
    let h = Header {
        len: b.len() as u64,
        ..Header::new(Opcode::Notify)
    };
    s.write_all(&h.to_bytes()).await.unwrap();
    s.write_all(&b).await.unwrap();
    let (r, _) = reply(&mut s).await.expect("an ERROR frame");
    assert_eq!(RefusalCode::from_u16(r.code), RefusalCode::Protocol);
    assert!(inbox.is_empty());
}
