//! The handshake carrier: one TCP exchange per connect (or QP re-establishment) with the address
//! the peer advertises in its descriptor. Framing, validation and the authentication messages live
//! in [`crate::protocol::handshake`]; this file only moves the bytes, within deadlines, and never
//! allocates more than has arrived.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use te_base::auth::{self as auth, AuthKey, HandshakeError, HandshakeFrames, Step, NONCE_LEN};
use te_base::listener::read_growing;
use te_base::{Error, Result};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::protocol::handshake::{
    decode, encode, frame_len, hex32, parse_hex32, AuthMessage, ConnectRequest, ConnectResponse, AUTH_CONTEXT,
    MAX_AUTH_MESSAGE_BYTES,
};

/// How long one handshake exchange may take, all included.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

fn invalid(what: String) -> Error {
    Error::InvalidDescriptor(format!("rdma: {what}"))
}

/// Reads one framed body of at most `max` bytes, growing the buffer as bytes arrive.
pub async fn read_body<R: AsyncRead + Unpin>(stream: &mut R, max: usize) -> Result<Vec<u8>> {
    let mut header = [0u8; 4];
    stream
        .read_exact(&mut header)
        .await
        .map_err(|e| Error::io("rdma handshake: reading frame header", e))?;
    let n = frame_len(header)?;
    if n > max {
        return Err(invalid(format!("handshake frame of {n} bytes (max {max} here)")));
    }
    read_growing(stream, n)
        .await
        .map_err(|e| Error::io("rdma handshake: reading frame body", e))
}

/// Reads one framed message of at most `max` bytes.
pub async fn read_message<T: for<'de> Deserialize<'de>, R: AsyncRead + Unpin>(stream: &mut R, max: usize) -> Result<T> {
    decode(&read_body(stream, max).await?)
}

/// Writes one framed message.
pub async fn write_message<T: Serialize>(stream: &mut TcpStream, message: &T) -> Result<()> {
    stream
        .write_all(&encode(message))
        .await
        .map_err(|e| Error::io("rdma handshake: writing", e))
}

/// The authentication exchange's frames ([`AuthMessage`]s, nonces and proofs in hex), for
/// te-base's one handshake ([`te_base::auth::initiate`] / [`te_base::auth::respond`]).
pub(crate) struct AuthFrames<'s> {
    /// The connection.
    pub stream: &'s mut TcpStream,
    /// Who is at the other end, for errors.
    pub peer: &'s str,
}

impl AuthFrames<'_> {
    fn unauthenticated(&self, reason: &str) -> Error {
        Error::Unauthenticated {
            peer: self.peer.to_string(),
            reason: reason.into(),
        }
    }
}

fn half(body: &[u8], at: usize) -> &[u8; 32] {
    body[at..at + 32]
        .try_into()
        .expect("a handshake body is made of 32-byte halves")
}

impl HandshakeFrames for AuthFrames<'_> {
    type Error = Error;

    async fn send(&mut self, step: Step, body: &[u8]) -> Result<()> {
        let message = match step {
            Step::Hello => AuthMessage::Hello {
                nonce: hex32(half(body, 0)),
            },
            Step::Challenge => AuthMessage::Challenge {
                nonce: hex32(half(body, 0)),
                proof: hex32(half(body, NONCE_LEN)),
            },
            Step::Proof => AuthMessage::Proof {
                proof: hex32(half(body, 0)),
            },
        };
        write_message(self.stream, &message).await
    }

    async fn recv(&mut self, step: Step) -> Result<Vec<u8>> {
        let body = read_body(self.stream, MAX_AUTH_MESSAGE_BYTES).await?;
        match (step, decode::<AuthMessage>(&body)) {
            (Step::Challenge, Ok(AuthMessage::Challenge { nonce, proof })) => Ok([
                parse_hex32(&nonce, "the target's nonce")?,
                parse_hex32(&proof, "the target's proof")?,
            ]
            .concat()),
            // A target without a key answers `Refused`; anything else is as good as that.
            (Step::Challenge, _) => {
                Err(self.unauthenticated("the target does not authenticate (no shared key configured there)"))
            }
            (Step::Proof, Ok(AuthMessage::Proof { proof })) => Ok(parse_hex32(&proof, "proof")?.to_vec()),
            (_, Err(e)) => Err(e),
            (_, Ok(_)) => Err(self.unauthenticated("no proof")),
        }
    }
}

/// Maps a handshake's failure to the engine's error.
pub(crate) fn handshake_error(e: HandshakeError<Error>) -> Error {
    match e {
        HandshakeError::Frames(e) | HandshakeError::Unauthenticated(e) => e,
        malformed => invalid(malformed.to_string()),
    }
}

/// The initiator's side of the authentication exchange.
async fn authenticate(stream: &mut TcpStream, key: &AuthKey, peer: &str) -> Result<()> {
    auth::initiate(&mut AuthFrames { stream, peer }, key, AUTH_CONTEXT, peer)
        .await
        .map_err(handshake_error)
}

/// Sends `request` to the target's listener at `addr` (authenticating first when `auth` is set)
/// and returns its answer.
pub async fn exchange(
    addr: SocketAddr,
    peer: &str,
    request: &ConnectRequest,
    auth: Option<&AuthKey>,
) -> Result<ConnectResponse> {
    let gone = |e: String| Error::PeerGone {
        peer: peer.to_string(),
        reason: format!("rdma handshake with {addr}: {e}"),
    };
    let work = async {
        let mut stream = TcpStream::connect(addr).await.map_err(|e| gone(e.to_string()))?;
        // Small frames back and forth: never wait for a delayed ACK (Nagle) during the handshake.
        let _ = stream.set_nodelay(true);
        if let Some(key) = auth {
            authenticate(&mut stream, key, peer).await?;
        }
        write_message(&mut stream, request).await?;
        let response =
            read_message::<ConnectResponse, _>(&mut stream, crate::protocol::handshake::MAX_MESSAGE_BYTES).await?;
        if response == ConnectResponse::Unauthenticated {
            return Err(Error::Unauthenticated {
                peer: peer.to_string(),
                reason: "the target requires the shared key (TE_AUTH_KEY_FILE)".into(),
            });
        }
        Ok(response)
    };
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, work).await {
        Ok(r) => r,
        Err(_) => Err(Error::Timeout {
            what: format!("rdma handshake with '{peer}' at {addr}"),
            after_ms: HANDSHAKE_TIMEOUT.as_millis() as u64,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bodies_grow_with_the_bytes_not_the_announcement() {
        // Announces the maximum, sends 10 bytes and closes: an error, having held about 10 bytes.
        let (mut tx, mut rx) = tokio::io::duplex(1 << 12);
        let mut frame = (crate::protocol::handshake::MAX_MESSAGE_BYTES as u32)
            .to_be_bytes()
            .to_vec();
        frame.extend_from_slice(b"{\"version\"");
        tx.write_all(&frame).await.unwrap();
        drop(tx);
        assert!(read_body(&mut rx, usize::MAX).await.is_err());
        // Over the caller's cap: refused before reading the body.
        let (mut tx, mut rx) = tokio::io::duplex(1 << 12);
        tx.write_all(&2000u32.to_be_bytes()).await.unwrap();
        let err = read_body(&mut rx, MAX_AUTH_MESSAGE_BYTES).await.unwrap_err();
        assert!(err.to_string().contains("2000"), "{err}");
        // A whole body arrives whole, in a buffer no larger than it.
        let (mut tx, mut rx) = tokio::io::duplex(1 << 12);
        let body = vec![b'7'; 100_000];
        let writer = tokio::spawn(async move {
            tx.write_all(&(body.len() as u32).to_be_bytes()).await.unwrap();
            tx.write_all(&body).await.unwrap();
        });
        let got = read_body(&mut rx, usize::MAX).await.unwrap();
        writer.await.unwrap();
        assert_eq!(got.len(), 100_000);
        assert!(got.capacity() <= 100_000);
    }
}
