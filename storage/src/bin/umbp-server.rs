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
//! Its flags are those of the settings tables: the store's (`umbp::config::StoreKey`) and
//! standalone mode's (`umbp::standalone::StandaloneKey`: `--socket`, `--allow-gid`,
//! `--key-handle-capacity`), the `umbp-server` columns of docs/configuration.md; their values
//! parse as the variables do. `umbp::standalone::server::server_flags` lists them (Python's
//! `te.server` builds its parser from that list).

use std::process::ExitCode;

use te_base::config::ProcessEnv;
use umbp::config::Value;
use umbp::standalone::config::StandaloneSettings;
use umbp::standalone::server::{serve, server_flags, FlagSetting, ServerOptions};
use umbp::Store;

/// The usage line: the flags come from the settings tables.
fn usage() -> String {
    let flags: Vec<String> = server_flags().iter().map(|f| f.usage()).collect();
    format!("usage: umbp-server {}", flags.join(" "))
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
    let mut builder = Store::builder().local();
    let mut server = StandaloneSettings::default();
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value\n{}", usage()));
        match a.as_str() {
            "-h" | "--help" => {
                println!("{}", usage());
                return Ok(());
            }
            // A setting's flag: a switch takes no value, the others parse theirs as the
            // setting's variable is parsed.
            flag => {
                let Some(f) = server_flags().into_iter().find(|f| f.flag == flag) else {
                    return Err(format!("unknown argument {flag:?}\n{}", usage()));
                };
                let raw = match f.value {
                    Some(_) => Some(value()?),
                    None => None,
                };
                let why = |e: String| match &raw {
                    Some(v) => format!("{flag} {v:?}: {e}"),
                    None => format!("{flag}: {e}"),
                };
                match (f.setting, &raw) {
                    (FlagSetting::Store(k), Some(v)) => builder = builder.set_text(k, v).map_err(why)?,
                    (FlagSetting::Store(k), None) => builder = builder.set(k, Value::Switch(true)).map_err(why)?,
                    (FlagSetting::Standalone(k), Some(v)) => server.set_text(k, v).map_err(why)?,
                    (FlagSetting::Standalone(k), None) => server.set(k, Value::Switch(true)).map_err(why)?,
                }
            }
        }
    }
    let opts = ServerOptions::resolve(&server, &ProcessEnv).map_err(|e| e.to_string())?;
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
