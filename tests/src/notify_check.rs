//! Notification commands of `te-node` (`npush`, `nrecv`, `nbare`), kept apart from its
//! transfer commands: a sender pipelines notified writes into parts of a peer's slot, the peer
//! checks each part the moment its notification is read.

use std::time::Duration;

use te_core::{NotifiedBatch, Registration, SegmentId, SubmitOptions, TransferEngine, TransferRequest};

use crate::pattern;

/// A slot cut into `count` equal parts, part `k` holding pattern `seed + k`.
#[derive(Debug, Clone, Copy)]
pub struct Parts {
    /// Bytes of the whole slot.
    pub slot: u64,
    /// Pattern seed of part 0.
    pub seed: u64,
    /// Number of parts (and of notified batches).
    pub count: u64,
}

/// Seed of part `k` of a notified run with seed `seed`.
fn part_seed(seed: u64, k: u64) -> u64 {
    seed.wrapping_add(k)
}

/// Writes `count` batches into `count` equal parts of the peer's slot at `remote` (batch `k`:
/// part `k`, pattern `seed + k`, notification payload `k` as 4 little-endian bytes), all in
/// flight at once; waits for every batch and every notification's acceptance.
pub async fn push(
    engine: &TransferEngine,
    scratch: &Registration,
    seg: SegmentId,
    remote: u64,
    parts: Parts,
) -> Result<String, String> {
    let Parts { slot, seed, count } = parts;
    let part = slot / count.max(1);
    if part == 0 {
        return Err("more parts than bytes".into());
    }
    for k in 0..count {
        let data: Vec<u8> = (0..part).map(|i| pattern(part_seed(seed, k), i)).collect();
        scratch.write_at(k * part, &data).map_err(|e| e.to_string())?;
    }
    let mut batches: Vec<NotifiedBatch> = Vec::with_capacity(count as usize);
    for k in 0..count {
        let w = TransferRequest::write(scratch.addr() + k * part, seg, remote + k * part, part);
        let payload = (k as u32).to_le_bytes();
        batches.push(
            engine
                .submit_notified(&[w], payload, &SubmitOptions::default())
                .map_err(|e| format!("batch {k}: {e}"))?,
        );
    }
    for (k, b) in batches.iter().enumerate() {
        b.wait().await.map_err(|e| format!("batch {k}: {e}"))?;
    }
    Ok(format!("OK {count} notified batches"))
}

/// Receives `count` notifications from `from`; checks, as each is read, that the part it names
/// holds its data in `buf` at `slot_off`. With `ordered`, they must arrive as parts 0, 1, 2...
pub async fn recv(
    engine: &TransferEngine,
    buf: &Registration,
    slot_off: u64,
    parts: Parts,
    from: &str,
    ordered: bool,
) -> Result<String, String> {
    let Parts { slot, seed, count } = parts;
    let inbox = engine.notifications();
    let part = slot / count.max(1);
    let mut seen = vec![false; count as usize];
    let mut data = vec![0u8; part as usize];
    for i in 0..count {
        let n = tokio::time::timeout(Duration::from_secs(60), inbox.recv())
            .await
            .map_err(|_| format!("only {i} of {count} notifications arrived"))?
            .ok_or("the engine closed")?;
        if n.from != from {
            return Err(format!("notification from {:?}, expected {from:?}", n.from));
        }
        let k: [u8; 4] = n.payload.as_slice().try_into().map_err(|_| "payload is not 4 bytes")?;
        let k = u32::from_le_bytes(k) as u64;
        if k >= count || seen[k as usize] {
            return Err(format!("notification {k} unexpected or repeated"));
        }
        if ordered && k != i {
            return Err(format!("notification {k} arrived as number {i}"));
        }
        seen[k as usize] = true;
        buf.read_at(slot_off + k * part, &mut data).map_err(|e| e.to_string())?;
        if let Some(p) = data
            .iter()
            .enumerate()
            .position(|(j, b)| *b != pattern(part_seed(seed, k), j as u64))
        {
            return Err(format!(
                "notification {k} read while byte {p} of its data was not in place"
            ));
        }
    }
    Ok(format!("OK {count} notifications"))
}

/// Sends `count` bare notifications one after another; reports how many were accepted and the
/// first refusal's error variant.
pub async fn bare(engine: &TransferEngine, peer: &str, count: u64) -> Result<String, String> {
    let seg = engine.open_segment(peer).await.map_err(|e| e.to_string())?;
    for i in 0..count {
        if let Err(e) = engine.notify(&seg, (i as u32).to_le_bytes()).await {
            let kind = match e {
                te_core::Error::NotificationQueueFull { .. } => "NotificationQueueFull",
                te_core::Error::NotificationTooLarge { .. } => "NotificationTooLarge",
                _ => "other",
            };
            return Ok(format!("OK accepted={i} refused={kind}: {e}"));
        }
    }
    Ok(format!("OK accepted={count}"))
}

/// Takes `count` notifications from `from` carrying 0, 1, 2... (as [`bare`] sends them).
pub async fn take(engine: &TransferEngine, count: u64, from: &str) -> Result<String, String> {
    let inbox = engine.notifications();
    for i in 0..count {
        let n = inbox
            .try_recv()
            .ok_or_else(|| format!("only {i} of {count} notifications waiting"))?;
        if n.from != from || n.payload != (i as u32).to_le_bytes() {
            return Err(format!("notification {i}: from {:?}, payload {:?}", n.from, n.payload));
        }
    }
    match inbox.try_recv() {
        None => Ok(format!("OK {count} notifications")),
        Some(n) => Err(format!("one more than {count} was queued: {n:?}")),
    }
}
