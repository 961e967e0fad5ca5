//! What both two-process examples share: the server exports a buffer and waits for the client's
//! "done" marker; the client reads the server's half, writes its own half, then the marker.
//! Only the metadata store (how the client finds the server) differs between the examples.

use std::time::{Duration, Instant};

use te_base::pattern::pattern;
use te_core::{HostBufferOptions, Registration, TransferEngine, TransferRequest};

/// Size of the server's exported buffer: the server fills the first half, the client the second.
pub const BUFFER: u64 = 4 << 20;
/// The client's last write: this marker in the buffer's last 8 bytes says "done".
const MARKER: u64 = 0x5445_2d44_4f4e_4521;
/// Each request moves one 64 KiB block, so a read or write is a batch of 32 requests.
const BLOCK: u64 = 64 << 10;

/// Server: export a buffer holding the server's pattern, then wait (at most `deadline`) for the
/// client's marker and check every byte the client wrote.
pub async fn serve(engine: &TransferEngine, announce: impl FnOnce()) -> Result<(), Box<dyn std::error::Error>> {
    let buffer = engine.allocate(BUFFER as usize, HostBufferOptions::default()).await?;
    let half: Vec<u8> = (0..BUFFER / 2).map(|o| pattern(b's' as u64, o)).collect();
    buffer.write_at(0, &half)?;
    announce();
    wait_for_marker(&buffer, Duration::from_secs(60))?;
    let mut written = vec![0u8; (BUFFER / 2 - 8) as usize];
    buffer.read_at(BUFFER / 2, &mut written)?;
    let bad = written
        .iter()
        .enumerate()
        .filter(|&(i, &b)| b != pattern(b'c' as u64, BUFFER / 2 + i as u64))
        .count();
    if bad > 0 {
        return Err(format!("{bad} bytes the client wrote are wrong").into());
    }
    println!("server: the client wrote {} bytes, all correct", written.len());
    Ok(())
}

/// Polls the buffer's last 8 bytes. A real server would be told by a notification; this keeps
/// the example to the engine's basic calls.
fn wait_for_marker(buffer: &Registration, deadline: Duration) -> Result<(), Box<dyn std::error::Error>> {
    let start = Instant::now();
    let mut tail = [0u8; 8];
    loop {
        buffer.read_at(BUFFER - 8, &mut tail)?;
        if u64::from_le_bytes(tail) == MARKER {
            return Ok(());
        }
        if start.elapsed() > deadline {
            return Err("no client finished within 60 s".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Client: open the server's segment by `name`, read its half, write ours, then the marker.
pub async fn client(engine: &TransferEngine, name: &str) -> Result<(), Box<dyn std::error::Error>> {
    let peer = engine.open_segment(name).await?;
    let remote = peer.buffers().first().ok_or("the server exports no buffer")?.base;
    let local = engine.allocate(BUFFER as usize, HostBufferOptions::default()).await?;

    // One batch of reads: the server's half lands in our first half.
    let reads: Vec<TransferRequest> = (0..BUFFER / 2 / BLOCK)
        .map(|i| TransferRequest::read(local.addr() + i * BLOCK, peer.id(), remote + i * BLOCK, BLOCK))
        .collect();
    engine.transfer(&reads).await?;
    let mut got = vec![0u8; (BUFFER / 2) as usize];
    local.read_at(0, &mut got)?;
    if got
        .iter()
        .enumerate()
        .any(|(o, &b)| b != pattern(b's' as u64, o as u64))
    {
        return Err("the server's bytes arrived wrong".into());
    }

    // One batch of writes from our second half into the server's, then the marker on its own,
    // after the data is in place (transfer returns only once the bytes have landed).
    let ours: Vec<u8> = (BUFFER / 2..BUFFER - 8).map(|o| pattern(b'c' as u64, o)).collect();
    local.write_at(BUFFER / 2, &ours)?;
    let writes: Vec<TransferRequest> = (0..BUFFER / 2 / BLOCK)
        .map(|i| {
            let at = BUFFER / 2 + i * BLOCK;
            let len = BLOCK.min(BUFFER - 8 - at);
            TransferRequest::write(local.addr() + at, peer.id(), remote + at, len)
        })
        .collect();
    engine.transfer(&writes).await?;
    local.write_at(BUFFER - 8, &MARKER.to_le_bytes())?;
    engine
        .transfer(&[TransferRequest::write(
            local.addr() + BUFFER - 8,
            peer.id(),
            remote + BUFFER - 8,
            8,
        )])
        .await?;
    println!(
        "client: read {} bytes and wrote {} bytes over {}",
        got.len(),
        ours.len() + 8,
        name
    );
    Ok(())
}
