//! The handshake carrier: one TCP exchange per connect (or QP re-establishment) with the address
//! the peer advertises in its descriptor. Framing and validation live in
//! [`crate::protocol::handshake`]; this file only moves the bytes.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use te_base::{Error, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::protocol::handshake::{decode, encode, frame_len, ConnectRequest, ConnectResponse};

/// How long one handshake exchange may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Reads one framed message.
pub async fn read_message<T: for<'de> Deserialize<'de>>(stream: &mut TcpStream) -> Result<T> {
    let mut header = [0u8; 4];
    stream
        .read_exact(&mut header)
        .await
        .map_err(|e| Error::io("rdma handshake: reading frame header", e))?;
    let n = frame_len(header)?;
    let mut body = vec![0u8; n];
    stream
        .read_exact(&mut body)
        .await
        .map_err(|e| Error::io("rdma handshake: reading frame body", e))?;
    decode(&body)
}

/// Writes one framed message.
pub async fn write_message<T: Serialize>(stream: &mut TcpStream, message: &T) -> Result<()> {
    stream
        .write_all(&encode(message))
        .await
        .map_err(|e| Error::io("rdma handshake: writing", e))
}

/// Sends `request` to the target's listener at `addr` and returns its answer.
pub async fn exchange(addr: SocketAddr, peer: &str, request: &ConnectRequest) -> Result<ConnectResponse> {
    let gone = |e: String| Error::PeerGone {
        peer: peer.to_string(),
        reason: format!("rdma handshake with {addr}: {e}"),
    };
    let work = async {
        let mut stream = TcpStream::connect(addr).await.map_err(|e| gone(e.to_string()))?;
        write_message(&mut stream, request).await?;
        read_message::<ConnectResponse>(&mut stream).await
    };
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, work).await {
        Ok(r) => r,
        Err(_) => Err(Error::Timeout {
            what: format!("rdma handshake with '{peer}' at {addr}"),
            after_ms: HANDSHAKE_TIMEOUT.as_millis() as u64,
        }),
    }
}
