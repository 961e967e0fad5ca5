//! `te-shm-peer serve BYTES SEED`: the target process of the shm transport's multi-process
//! tests. It starts the transport (settings from the process environment, the key from
//! `TE_AUTH_KEY_FILE`), exports one buffer (a sealed memfd, or anonymous memory with
//! `TE_SHM_MEMFD=0`, as the engine allocates) filled with the position-dependent pattern of SEED,
//! prints its segment descriptor as one JSON line, then answers commands on standard input, one
//! per line, until it closes:
//!
//! - `check OFF LEN SEED [FIRST]`: prints how many bytes of `[OFF, OFF + LEN)` differ from
//!   pattern SEED at positions FIRST.. (default OFF..);
//! - `fill SEED`: refills the buffer with pattern SEED, prints `ok`;
//! - `deregister`: deregisters the buffer (revoking it from every initiator), prints `ok`;
//! - `recv MS`: prints the payload of the next notification (UTF-8), or `none` after MS ms;
//! - `connections`: prints how many initiators are connected.

use std::io::{BufRead, Write};
use std::sync::Arc;
use std::time::Duration;

use te_base::config::ProcessEnv;
use te_base::{HostBacking, HostBuffer, HostBufferOptions, MemoryLocation, RegionId, RegionInfo, Transport};
use te_base::{NotifyInbox, NotifyLimits, SegmentDescriptor, TransportEndpoint};
use te_transport_shm::{ShmConfig, ShmTransport};

fn main() {
    if let Err(e) = run() {
        eprintln!("te-shm-peer: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (bytes, seed) = match args.as_slice() {
        [cmd, bytes, seed] if cmd == "serve" => (
            bytes.parse::<usize>().map_err(|e| format!("BYTES: {e}"))?,
            seed.parse::<u64>().map_err(|e| format!("SEED: {e}"))?,
        ),
        _ => return Err("usage: te-shm-peer serve BYTES SEED".into()),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let config = ShmConfig::from_env(&ProcessEnv).map_err(|e| e.to_string())?;
    // As the engine's `allocate` does: a sealed memfd unless TE_SHM_MEMFD is off.
    let backing = if config.memfd {
        HostBacking::Memfd
    } else {
        HostBacking::Anonymous
    };
    let auth = te_base::auth::AuthKey::from_env(&ProcessEnv).map_err(|e| e.to_string())?;
    let inbox = NotifyInbox::new(NotifyLimits::default());
    let t = Arc::new(ShmTransport::start(config, auth, inbox.clone()).map_err(|e| e.to_string())?);
    let opts = HostBufferOptions {
        backing,
        ..Default::default()
    };
    let buf = HostBuffer::allocate(bytes, opts).map_err(|e| e.to_string())?;
    let view = || {
        // SAFETY: the buffer is live and `bytes` long for the whole run; the tests read or
        // refill it only between batches (they wait for completion before each command).
        unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), buf.len()) }
    };
    te_base::pattern::fill_pattern(view(), seed, 0);
    let info = RegionInfo {
        id: RegionId(1),
        base: buf.addr(),
        len: bytes as u64,
        location: MemoryLocation::HOST,
        exported: true,
    };
    rt.block_on(t.register(std::slice::from_ref(&info)))
        .map_err(|e| e.to_string())?;
    let mut d = SegmentDescriptor::new("shm-peer", te_base::token::random_token());
    d.transports.push(TransportEndpoint {
        transport: "shm".into(),
        info: t.endpoint(),
    });
    d.buffers.push(te_base::ExportedBuffer::of_region(&info));
    let mut out = std::io::stdout().lock();
    let say = |out: &mut std::io::StdoutLock, s: String| {
        let _ = writeln!(out, "{s}");
        let _ = out.flush();
    };
    say(&mut out, d.to_json());
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| words.get(i).and_then(|w| w.parse::<u64>().ok()).unwrap_or(0);
        match words.first().copied() {
            Some("check") => {
                let (off, len, seed) = (num(1) as usize, num(2) as usize, num(3));
                let first = if words.len() > 4 { num(4) } else { off as u64 };
                let end = off.saturating_add(len).min(bytes);
                let bad = view()[off.min(end)..end]
                    .iter()
                    .enumerate()
                    .filter(|(i, b)| **b != te_base::pattern::pattern(seed, first + *i as u64))
                    .count();
                say(&mut out, bad.to_string());
            }
            Some("fill") => {
                te_base::pattern::fill_pattern(view(), num(1), 0);
                say(&mut out, "ok".into());
            }
            Some("deregister") => {
                rt.block_on(t.deregister(std::slice::from_ref(&info)))
                    .map_err(|e| e.to_string())?;
                say(&mut out, "ok".into());
            }
            Some("recv") => {
                let note = inbox.recv_blocking(Duration::from_millis(num(1)));
                say(
                    &mut out,
                    note.map(|n| String::from_utf8_lossy(&n.payload).into_owned())
                        .unwrap_or_else(|| "none".into()),
                );
            }
            Some("connections") => {
                say(&mut out, t.served_connections().to_string());
            }
            _ => say(&mut out, format!("unknown command {line:?}")),
        }
    }
    Ok(())
}
