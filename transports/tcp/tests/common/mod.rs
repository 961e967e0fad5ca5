//! Raw-socket helpers shared by the hostile-peer tests.

use te_transport_tcp::wire::{Header, HEADER_LEN};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// Reads one frame and its payload; `None` once the target closed the connection.
pub async fn reply(s: &mut TcpStream) -> Option<(Header, Vec<u8>)> {
    let mut raw = [0u8; HEADER_LEN];
    s.read_exact(&mut raw).await.ok()?;
    let h = Header::decode(&raw).expect("the target sends valid headers");
    let mut payload = vec![0u8; h.payload_len() as usize];
    s.read_exact(&mut payload).await.ok()?;
    Some((h, payload))
}
