//! `umbp-server`: the node's UMBP store in standalone mode. Runs in the foreground, owns the DRAM
//! arena and the SSD tier, and serves worker processes on a Unix socket. Configured by flags and
//! the same `UMBP_*` variables as local mode (a flag wins). SIGTERM or SIGINT: stop accepting,
//! flush, unlink the socket, exit 0. After SIGKILL a restart on the same SSD directories rebuilds
//! the SSD tier from its log.
//!
//! ```text
//! umbp-server --socket /run/umbp.sock [--dram 64G] [--ssd-dirs /nvme0,/nvme1] [--ssd-capacity 2048G]
//!             [--eviction prefix] [--write-through] [--allow-gid 1001] [--key-handle-capacity 512]
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use te_base::config::{parse_byte_size, ProcessEnv};
use umbp::standalone::server::{serve, ServerOptions};
use umbp::{EvictionPolicy, Store};

const USAGE: &str = "usage: umbp-server --socket PATH [--dram BYTES] [--ssd-dirs DIR,...] [--ssd-capacity BYTES] \
[--eviction lru|prefix|prefix:N] [--write-through] [--allow-gid GID] [--key-handle-capacity N]";

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("umbp-server: {e}");
            ExitCode::FAILURE
        }
    }
}

fn bytes(flag: &str, v: &str) -> Result<u64, String> {
    parse_byte_size(v).map_err(|e| format!("{flag} {v:?}: {e}"))
}

/// Gives SIGTERM and SIGINT back their default action before tokio takes them. A library linked
/// into this binary may have installed its own handler at load time: with the efa transport
/// compiled in, Debian's libfabric pulls in libinfinipath (psm provider), whose handler resets
/// the signals and calls `exit(1)`. tokio's handler chains to whatever was installed before it,
/// so that handler would end the server before it flushes and unlinks its socket.
fn own_termination_signals() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: no other thread exists yet (the runtime is built after this), and SIG_DFL is a
        // valid disposition for both signals.
        unsafe { libc::signal(sig, libc::SIG_DFL) };
    }
}

fn run() -> Result<(), String> {
    own_termination_signals();
    let mut args = std::env::args().skip(1);
    let mut socket = None;
    let mut builder = Store::builder().local();
    let mut allow_gid = None;
    let mut capacity = None;
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value\n{USAGE}"));
        match a.as_str() {
            "--socket" => socket = Some(PathBuf::from(value()?)),
            "--dram" => builder = builder.dram_capacity(bytes("--dram", &value()?)?),
            "--ssd-dirs" => builder = builder.ssd_dirs(value()?.split(',').map(PathBuf::from).collect()),
            "--ssd-capacity" => builder = builder.ssd_capacity(bytes("--ssd-capacity", &value()?)?),
            "--eviction" => {
                let v = value()?;
                builder = builder.eviction(
                    v.parse::<EvictionPolicy>()
                        .map_err(|e| format!("--eviction {v}: {e}"))?,
                )
            }
            "--write-through" => builder = builder.write_through(true),
            "--allow-gid" => allow_gid = Some(value()?.parse::<u32>().map_err(|e| format!("--allow-gid: {e}"))?),
            "--key-handle-capacity" => {
                capacity = Some(
                    value()?
                        .parse::<usize>()
                        .map_err(|e| format!("--key-handle-capacity: {e}"))?,
                )
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    let mut opts = ServerOptions::from_env(&ProcessEnv, socket).map_err(|e| e.to_string())?;
    if allow_gid.is_some() {
        opts.allow_gid = allow_gid;
    }
    if let Some(c) = capacity {
        opts.key_handle_capacity = c;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    rt.block_on(async move {
        // The handlers go in before the store opens its engine: a provider library loaded then
        // (libfabric's shm, in cluster mode) chains to them instead of replacing them.
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(|e| format!("SIGTERM handler: {e}"))?;
        let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
            .map_err(|e| format!("SIGINT handler: {e}"))?;
        let store = builder.open().await.map_err(|e| format!("opening the store: {e}"))?;
        let stats = store
            .stats()
            .map_err(|e| format!("reading the store's counters: {e}"))?;
        eprintln!(
            "umbp-server: listening on {} (DRAM {} B, SSD {} objects recovered)",
            opts.socket.display(),
            stats.core.dram_capacity_bytes,
            stats.core.ssd_objects
        );
        let shutdown = async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = interrupt.recv() => {}
            }
        };
        serve(store, opts, shutdown).await.map_err(|e| e.to_string())?;
        eprintln!("umbp-server: stopped");
        Ok::<(), String>(())
    })
}
