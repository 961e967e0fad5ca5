//! A target process: exports one pattern-filled buffer over the efa transport and answers
//! verification commands on stdin until stdin closes.
//!
//! Protocol (one line each):
//! - out, first: the segment descriptor as JSON;
//! - in `check <offset> <len> <seed>` -> out `mismatched <n>`;
//! - in `fill <seed>` -> out `ok`;
//! - in `foreign <offset> <len> <seed_a> <seed_b>` -> out `foreign <n>`: bytes matching neither
//!   pattern;
//! - in `note <timeout_ms>` -> out `note <from> mismatched_at_delivery <n> <payload>` for the next
//!   received notification, or `none`. A payload `<offset> <len> <seed>` names data its sender
//!   wrote first; `n` counts its bytes that were not in place when the notification was delivered
//!   (checked on the delivering thread, before anyone could read it);
//! - in `exit` (or EOF): the process exits.

use std::collections::VecDeque;
use std::io::{BufRead, Write};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use te_base::config::ProcessEnv;
use te_base::{
    ExportedBuffer, HostBuffer, HostBufferOptions, InstallContext, MemoryLocation, Notification, RegionId, RegionInfo,
    SegmentDescriptor, TransportEndpoint,
};

use crate::pattern;

/// Runs the target until stdin closes.
pub fn serve(bytes: usize, seed: u64) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| e.to_string())?;
    let name = format!("efa-peer-{}", std::process::id());
    let inbox = te_base::NotifyInbox::new(Default::default());
    let ctx = InstallContext {
        auth: None,
        env: Arc::new(ProcessEnv),
        segment_name: name.clone(),
        devices: Vec::new(),
        notifications: inbox.clone(),
    };
    let transport = rt
        .block_on(te_transport_efa::install(&ctx))
        .map_err(|e| e.to_string())?;
    let buf = HostBuffer::allocate(
        bytes,
        HostBufferOptions {
            prefault: true,
            ..Default::default()
        },
    )
    .map_err(|e| e.to_string())?;
    // SAFETY: the buffer is live, `bytes` long, and nothing else touches it yet.
    let slice = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), bytes) };
    pattern::fill(slice, seed, 0);
    let at_delivery: Arc<Mutex<VecDeque<u64>>> = Arc::default();
    {
        let (at_delivery, base) = (at_delivery.clone(), buf.addr() as usize);
        inbox.observe(Some(Box::new(move |n: &Notification| {
            at_delivery.lock().push_back(named_mismatches(n, base, bytes));
        })));
    }
    let region = RegionInfo {
        id: RegionId(1),
        base: buf.addr(),
        len: bytes as u64,
        location: MemoryLocation::HOST,
        exported: true,
    };
    let keys = rt
        .block_on(transport.register(std::slice::from_ref(&region)))
        .map_err(|e| e.to_string())?;
    let mut desc = SegmentDescriptor::new(name, u64::from(std::process::id()));
    desc.transports.push(TransportEndpoint {
        transport: transport.name().into(),
        info: transport.endpoint(),
    });
    desc.buffers.push(ExportedBuffer {
        base: buf.addr(),
        len: bytes as u64,
        location: MemoryLocation::HOST,
        keys: [(transport.name().to_string(), keys[0].clone())].into_iter().collect(),
    });
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", desc.to_json()).map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let reply = match words.as_slice() {
            ["check", off, len, seed] => {
                let (off, len, seed) = (parse(off)?, parse(len)?, parse(seed)?);
                if off.checked_add(len).is_none_or(|end| end > bytes as u64) {
                    format!("error range {off}+{len} outside {bytes}")
                } else {
                    // SAFETY: in bounds (checked above); peers' writes have completed (the client
                    // asks only after its batch finished with delivery-complete semantics).
                    let s = unsafe { std::slice::from_raw_parts(buf.as_ptr().add(off as usize), len as usize) };
                    format!("mismatched {}", pattern::mismatches(s, seed, off))
                }
            }
            ["foreign", off, len, a, b] => {
                let (off, len, a, b) = (parse(off)?, parse(len)?, parse(a)?, parse(b)?);
                if off.checked_add(len).is_none_or(|end| end > bytes as u64) {
                    format!("error range {off}+{len} outside {bytes}")
                } else {
                    // SAFETY: in bounds (checked above); only read.
                    let s = unsafe { std::slice::from_raw_parts(buf.as_ptr().add(off as usize), len as usize) };
                    format!("foreign {}", pattern::foreign(s, a, b, off))
                }
            }
            ["fill", seed] => {
                // SAFETY: the buffer is live; the client does not transfer while it asks to refill.
                let s = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), bytes) };
                pattern::fill(s, parse(seed)?, 0);
                "ok".to_string()
            }
            ["note", ms] => match inbox.recv_blocking(Duration::from_millis(parse(ms)?)) {
                Some(n) => format!(
                    "note {} mismatched_at_delivery {} {}",
                    n.from,
                    at_delivery.lock().pop_front().unwrap_or(u64::MAX),
                    String::from_utf8_lossy(&n.payload)
                ),
                None => "none".to_string(),
            },
            ["exit"] => break,
            _ => format!("error unknown command {line:?}"),
        };
        writeln!(out, "{reply}").map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())?;
    }
    rt.block_on(transport.shutdown());
    Ok(())
}

/// Bytes of the range a `<offset> <len> <seed>` payload names that differ from its pattern
/// (`u64::MAX` when the payload names no range of the buffer).
fn named_mismatches(n: &Notification, base: usize, bytes: usize) -> u64 {
    let text = String::from_utf8_lossy(&n.payload);
    let nums: Vec<u64> = text.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    let [off, len, seed] = nums[..] else {
        return u64::MAX;
    };
    if off.checked_add(len).is_none_or(|end| end > bytes as u64) {
        return u64::MAX;
    }
    // SAFETY: in bounds (checked above); the buffer lives as long as the transport delivering.
    let s = unsafe { std::slice::from_raw_parts((base + off as usize) as *const u8, len as usize) };
    pattern::mismatches(s, seed, off)
}

fn parse(word: &str) -> Result<u64, String> {
    word.parse().map_err(|_| format!("bad number {word:?}"))
}
