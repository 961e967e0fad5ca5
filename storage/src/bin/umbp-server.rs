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
//!
//! The store's flags are those of its settings table (`umbp::config::StoreKey`, the
//! `umbp-server` column of docs/configuration.md); their values parse as the variables do.

use std::path::PathBuf;
use std::process::ExitCode;

use te_base::config::ProcessEnv;
use umbp::config::{StoreKey, Value};
use umbp::standalone::server::{serve, ServerOptions};
use umbp::Store;

/// The usage line: the store's flags come from its settings table (`umbp::config::StoreKey`).
fn usage() -> String {
    format!(
        "usage: umbp-server --socket PATH {} [--allow-gid GID] [--key-handle-capacity N]",
        StoreKey::usage_flags()
    )
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("umbp-server: {e}");
            ExitCode::FAILURE
        }
    }
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
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value\n{}", usage()));
        match a.as_str() {
            "--socket" => socket = Some(PathBuf::from(value()?)),
            "--allow-gid" => allow_gid = Some(value()?.parse::<u32>().map_err(|e| format!("--allow-gid: {e}"))?),
            "--key-handle-capacity" => {
                capacity = Some(
                    value()?
                        .parse::<usize>()
                        .map_err(|e| format!("--key-handle-capacity: {e}"))?,
                )
            }
            "-h" | "--help" => {
                println!("{}", usage());
                return Ok(());
            }
            // A store setting's flag: a switch takes no value, the others parse theirs as the
            // setting's variable is parsed.
            flag => {
                let Some((key, takes_value)) = StoreKey::from_flag(flag).and_then(|k| Some((k, k.flag()?.1.is_some())))
                else {
                    return Err(format!("unknown argument {flag:?}\n{}", usage()));
                };
                builder = if takes_value {
                    let v = value()?;
                    builder.set_text(key, &v).map_err(|e| format!("{flag} {v:?}: {e}"))?
                } else {
                    builder
                        .set(key, Value::Switch(true))
                        .map_err(|e| format!("{flag}: {e}"))?
                };
            }
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
