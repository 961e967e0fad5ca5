//! Control connections: frames over TCP with a deadline on every read and write, and the mutual
//! challenge-response (te_base::auth) both sides run before any request when a key is set.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use te_base::auth::AuthKey;
use te_base::auth::{InitiatorHandshake, ResponderHandshake, NONCE_LEN, PROOF_LEN};
use te_base::listener::{deadline, read_growing, tune_socket};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::wire::{decode_head, frame, Op, HEAD};

/// Context bound into every proof, so a proof for another listener kind is worthless here.
pub(crate) const AUTH_CONTEXT: &str = "umbp-cluster-control";

fn invalid(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

/// Reads one frame: the first byte may take `wait` (idle), the rest of the head and the body
/// `frame_timeout` each. The body buffer grows only as bytes arrive.
pub(crate) async fn read_frame(
    s: &mut TcpStream,
    wait: Duration,
    frame_timeout: Duration,
) -> io::Result<(Op, Vec<u8>)> {
    let mut head = [0u8; HEAD];
    deadline(wait, "waiting for a frame", s.read_exact(&mut head[..1])).await?;
    deadline(frame_timeout, "reading a frame head", s.read_exact(&mut head[1..])).await?;
    let h = decode_head(&head).map_err(invalid)?;
    let body = deadline(frame_timeout, "reading a frame body", read_growing(s, h.len)).await?;
    Ok((h.op, body))
}

/// Writes one frame within `timeout`.
pub(crate) async fn write_frame(s: &mut TcpStream, op: Op, body: &[u8], timeout: Duration) -> io::Result<()> {
    deadline(timeout, "writing a frame", s.write_all(&frame(op, body))).await
}

/// An open, authenticated connection to a peer's control listener.
pub(crate) struct Conn {
    stream: TcpStream,
    timeout: Duration,
}

impl Conn {
    /// Connects and runs the handshake, all within `timeout`.
    pub(crate) async fn connect(addr: SocketAddr, auth: Option<&AuthKey>, timeout: Duration) -> io::Result<Conn> {
        let mut stream = deadline(timeout, "connecting", TcpStream::connect(addr)).await?;
        tune_socket(&stream, timeout);
        match auth {
            None => {
                write_frame(&mut stream, Op::Hello, &[], timeout).await?;
                match read_frame(&mut stream, timeout, timeout).await? {
                    (Op::Ready, _) => {}
                    (Op::Refused, why) => return Err(refused(&why)),
                    (op, _) => return Err(invalid(format!("expected READY, got {op:?}"))),
                }
            }
            Some(key) => {
                let (hs, nonce) = InitiatorHandshake::start(key, AUTH_CONTEXT);
                write_frame(&mut stream, Op::Hello, &nonce, timeout).await?;
                let (op, body) = read_frame(&mut stream, timeout, timeout).await?;
                match op {
                    Op::Challenge if body.len() == NONCE_LEN + PROOF_LEN => {}
                    Op::Refused => return Err(refused(&body)),
                    _ => return Err(invalid("the peer did not authenticate")),
                }
                let theirs: [u8; NONCE_LEN] = body[..NONCE_LEN].try_into().expect("length checked");
                let proof = hs
                    .finish(&theirs, &body[NONCE_LEN..], &addr.to_string())
                    .map_err(|e| io::Error::new(io::ErrorKind::PermissionDenied, e.to_string()))?;
                write_frame(&mut stream, Op::Proof, &proof, timeout).await?;
                match read_frame(&mut stream, timeout, timeout).await? {
                    (Op::Ready, _) => {}
                    (Op::Refused, why) => return Err(refused(&why)),
                    (op, _) => return Err(invalid(format!("expected READY, got {op:?}"))),
                }
            }
        }
        Ok(Conn { stream, timeout })
    }

    /// Sends one request and reads its answer, each bounded by the connection's timeout.
    pub(crate) async fn call(&mut self, op: Op, body: &[u8]) -> io::Result<(Op, Vec<u8>)> {
        write_frame(&mut self.stream, op, body, self.timeout).await?;
        read_frame(&mut self.stream, self.timeout, self.timeout).await
    }
}

fn refused(why: &[u8]) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!("refused: {}", String::from_utf8_lossy(&why[..why.len().min(200)])),
    )
}

/// The responder's side of the handshake, run within `limit`. Errors close the connection; the
/// only thing an unauthenticated peer learns is "authentication required" or "refused".
pub(crate) async fn accept_handshake(
    s: &mut TcpStream,
    auth: Option<&AuthKey>,
    peer: &str,
    limit: Duration,
) -> io::Result<()> {
    let (op, body) = read_frame(s, limit, limit).await?;
    if op != Op::Hello {
        return Err(invalid("expected HELLO"));
    }
    match auth {
        None => write_frame(s, Op::Ready, &[], limit).await,
        Some(key) => {
            let Ok(theirs) = <[u8; NONCE_LEN]>::try_from(body.as_slice()) else {
                write_frame(s, Op::Refused, b"authentication required", limit).await?;
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!("{peer}: no credentials"),
                ));
            };
            let (hs, nonce, proof) = ResponderHandshake::answer(key, AUTH_CONTEXT, &theirs);
            let mut answer = nonce.to_vec();
            answer.extend_from_slice(&proof);
            write_frame(s, Op::Challenge, &answer, limit).await?;
            let (op, body) = read_frame(s, limit, limit).await?;
            if op != Op::Proof || hs.check(&body, peer).is_err() {
                let _ = write_frame(s, Op::Refused, b"refused", limit).await;
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!("{peer}: wrong key"),
                ));
            }
            write_frame(s, Op::Ready, &[], limit).await
        }
    }
}
