//! `te-bench`: the benchmark CLI operators run. Every command has `--json` (one object per line)
//! and, where bytes move, `--verify`.

use clap::{Parser, Subcommand};

mod failover;
mod info;
mod local_copy;
mod notify;
mod register;
mod size_plot;
mod topology;
mod transfer;
mod umbp;
mod umbp_cluster_scale;
mod umbp_distributed;
mod umbp_standalone;
mod util;
mod warm_up;
mod watch;

#[derive(Parser)]
#[command(name = "te-bench", version, about = "Transfer engine benchmarks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Time from a route's death mid-batch to the batch's completion on the fallback route.
    Failover(failover::Args),
    /// Transports and device plugins compiled in, and whether each is usable here.
    Info(info::Args),
    /// Scattered-fragment copies through the engine against memcpy baselines.
    LocalCopy(local_copy::Args),
    /// Notification latency: a write + notification to the target's receipt, against the plain
    /// write's completion.
    Notify(notify::Args),
    /// Replays a node's memory registration (multi-process, barrier-synchronised).
    Register(register::Args),
    /// Discovered devices, rail map and NIC policy.
    Topology(topology::Args),
    /// Network transfer bandwidth and latency between two processes or hosts.
    Transfer(transfer::Args),
    /// UMBP store: layer-wise ranged restore (TTFL) and offload.
    Umbp(umbp::Args),
    /// First-transfer latency with and without warm-up, and the time to warm N peers.
    WarmUp(warm_up::Args),
    /// How soon an open segment follows its peer's descriptor (metadata watch + apply).
    Watch(watch::Args),
    /// The owner peer of `umbp --distributed` (started by it).
    #[command(hide = true)]
    UmbpOwner(umbp::Args),
    /// A light peer of `umbp --cluster-scale` (started by it).
    #[command(hide = true)]
    UmbpScalePeer(umbp_cluster_scale::PeerArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Failover(a) => failover::run(a),
        Command::Info(a) => info::run(a),
        Command::LocalCopy(a) => local_copy::run(a),
        Command::Notify(a) => notify::run(a),
        Command::Register(a) => register::run(a),
        Command::Topology(a) => topology::run(a),
        Command::Transfer(a) => transfer::run(a),
        Command::Umbp(a) => umbp::run(a),
        Command::UmbpOwner(a) => umbp_distributed::owner(a),
        Command::UmbpScalePeer(a) => umbp_cluster_scale::peer(a),
        Command::WarmUp(a) => warm_up::run(a),
        Command::Watch(a) => watch::run(a),
    };
    if let Err(e) = result {
        eprintln!("te-bench: {e}");
        std::process::exit(1);
    }
}
