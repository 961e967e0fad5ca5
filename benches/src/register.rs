//! `te-bench register`: replays a node's memory registration as an inference server issues it.
//!
//! N rank processes (`--ranks 8`), each with its own registration pool and provider, are set up,
//! then released together; the time of a cell is the slowest rank's, because nothing serves until
//! every rank has registered. Sweeps caps x orders x rank counts (`--caps`, `--orders`, `--ranks`),
//! optionally within one shared CPU set (`--cores`, as taskset). With `--transport sim` every output
//! is labelled simulated and times are node seconds (wall time divided by `--sim-scale`).

mod affinity;
mod plot;
mod rank;
mod report;
mod saved;
mod shapes;
mod spec;
mod sweep;
mod views;

use std::collections::BTreeMap;
use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};
use te_base::config::{Env, MapEnv, ProcessEnv};
use te_base::registration::{CapDecision, CpuBudget, RegOrder};
use te_base::MemoryLocation;
use te_testkit::{NodeLoad, SimCostModel};
use te_topology::{CpuList, NicPlacement, NicPolicy};

use report::{Cap, Cell, Context};
use spec::{LocationChoice, RankSpec, SimSpec, TransportChoice};

/// Buffer shape presets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ShapePreset {
    /// 182 buffers per rank, 2.5 KB to 391 MB, grouped by pool as the server passes them.
    KimiK3,
    /// `--uniform-count` buffers of `--uniform-size` each.
    Uniform,
}

/// Options of `te-bench register` (boxed: they are many, and the command enum stays small).
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    options: Box<Options>,
}

/// Every option of `te-bench register`.
#[derive(clap::Args)]
pub struct Options {
    /// Rank processes per node, one engine each (comma list to sweep).
    #[arg(long, default_value = "8")]
    ranks: String,
    /// Per-process caps to sweep: numbers, `unset` (unbounded, the variable unset) and `derived`
    /// (what the engine derives for the rank count and cores).
    #[arg(long, default_value = "unset,64,32,16,8,4")]
    caps: String,
    /// Dispatch orders to sweep: given, ascending, descending.
    #[arg(long, default_value = "given,ascending,descending")]
    orders: String,
    /// Buffer shape preset (ignored with --sizes or --sizes-file).
    #[arg(long, value_enum, default_value = "kimi-k3")]
    shape: ShapePreset,
    /// Buffers of the uniform preset.
    #[arg(long, default_value_t = 48)]
    uniform_count: usize,
    /// Size of each buffer of the uniform preset.
    #[arg(long, default_value = "391MB")]
    uniform_size: String,
    /// Explicit buffer sizes in the order passed: `48x391MB,2.79MB,...`.
    #[arg(long)]
    sizes: Option<String>,
    /// A file of sizes (same syntax; commas, spaces or newlines; `#` comments).
    #[arg(long)]
    sizes_file: Option<PathBuf>,
    /// Restrict every rank to this one shared CPU set (`0-63`, `0,1`), as taskset does.
    #[arg(long)]
    cores: Option<String>,
    /// Registration provider.
    #[arg(long, value_enum, default_value = "sim")]
    transport: TransportChoice,
    /// Where the buffers live; cuda with sim uses the device-memory cost model.
    #[arg(long, value_enum, default_value = "host")]
    location: LocationChoice,
    /// Repetitions of every cell; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Wall time per node time for sim (0.03 replays 100 node seconds in 3 s). Much smaller scales
    /// make registrations short against the kernel's scheduling quantum, and oversubscribed
    /// (unbounded) cells stop behaving like threads running side by side on the node.
    #[arg(long, default_value_t = 0.03)]
    sim_scale: f64,
    /// Domains (NICs) each buffer is registered on (default 32, as p5.48xlarge; with --sysfs the
    /// rail map decides).
    #[arg(long)]
    nics: Option<usize>,
    /// Take the NICs per buffer from this sysfs tree or fixture spec (rank r uses GPU r).
    #[arg(long)]
    sysfs: Option<PathBuf>,
    /// NIC selection with --sysfs: local (rail-local, the engine's default) or all. Unset: the
    /// engine's own choice, `TE_NIC_SELECTION` (alias `MC_EFA_NIC_SELECTION`), else local.
    #[arg(long)]
    nic_selection: Option<String>,
    /// sim: device cost per GiB already registered on the domain, ms (k).
    #[arg(long)]
    sim_k_ms_per_gib: Option<f64>,
    /// sim: device cost per GiB of the buffer, ms.
    #[arg(long)]
    sim_device_ms_per_gib: Option<f64>,
    /// sim: host cost per GiB of the buffer, ms.
    #[arg(long)]
    sim_host_ms_per_gib: Option<f64>,
    /// sim: extra CPU per unit of ln(registrations in flight on the node / cores) when oversubscribed.
    #[arg(long)]
    sim_oversubscription_penalty: Option<f64>,
    /// One JSON object per cell on stdout.
    #[arg(long)]
    json: bool,
    /// CSV on stdout.
    #[arg(long)]
    csv: bool,
    /// Draw time against cap per order into this SVG file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Run nothing: print the table (and --plot) from the --json lines of an earlier run.
    #[arg(long)]
    from_json: Option<PathBuf>,
    /// Run the views scenario instead of the sweep: this many tensors laid out back to back in
    /// one `--pool-size` pool, registered through the engine with the registration cache off
    /// (each on its own) and on (the pool, then each as a view of it), `--repeat` times each.
    #[arg(long)]
    views: Option<usize>,
    /// Pool of the views scenario (host memory, prefaulted).
    #[arg(long, default_value = "1GiB")]
    pool_size: String,
    /// Views scenario: read every view back through the engine and check each byte (real
    /// transports; not timed).
    #[arg(long)]
    verify: bool,
    /// Internal: run as one rank process (spec on stdin).
    #[arg(long, hide = true)]
    rank_worker: bool,
}

/// Runs the command (or, with `--rank-worker`, one rank of it).
pub fn run(args: Args) -> Result<(), String> {
    run_options(*args.options)
}

fn run_options(args: Options) -> Result<(), String> {
    if args.rank_worker {
        return rank::run_rank();
    }
    if let Some(n) = args.views {
        return run_views(&args, n);
    }
    if let Some(path) = &args.from_json {
        let s = saved::load(path)?;
        let derived_text = s
            .derived
            .iter()
            .map(|(r, c)| (*r, format!("{} (as saved)", report::cap_label(*c))))
            .collect();
        print!("{}", report::table(&s.ctx, &s.cells, &s.caps, &s.orders, &derived_text));
        if let Some(plot_path) = &args.plot {
            plot::draw(plot_path, &plot_title(&s.ctx), &s.cells, &s.caps, &s.orders)?;
            eprintln!("plot written to {}", plot_path.display());
        }
        return Ok(());
    }
    let sizes = sizes(&args)?;
    let ranks_list = parse_list(&args.ranks, "--ranks", |s| {
        s.parse::<usize>().ok().filter(|&n| (1..=1024).contains(&n))
    })?;
    let orders: Vec<String> = parse_list(&args.orders, "--orders", |s| s.parse::<RegOrder>().ok())?
        .into_iter()
        .map(|o| o.name().to_string())
        .collect();
    if args.repeat == 0 {
        return Err("--repeat must be at least 1".into());
    }
    if !(args.sim_scale.is_finite() && args.sim_scale > 0.0) {
        return Err(format!("--sim-scale {} must be > 0", args.sim_scale));
    }
    let cpus: Option<Vec<u32>> = match &args.cores {
        Some(text) => {
            let list = CpuList::parse(text).map_err(|e| format!("--cores: {e}"))?;
            if list.is_empty() {
                return Err("--cores: empty CPU list".into());
            }
            Some(list.cpus().to_vec())
        }
        None => None,
    };
    let budget = match &cpus {
        Some(list) => CpuBudget::from_parts(list.len(), CpuBudget::detect().quota_cpus),
        None => CpuBudget::detect(),
    };
    let max_ranks = ranks_list.iter().copied().max().unwrap_or(1);
    let (nics_per_rank, nic_source) = nics_per_rank(&args, max_ranks, &ProcessEnv)?;
    let node_load_path = std::env::temp_dir().join(format!("te-bench-register-{}.load", std::process::id()));
    let sim = sim_spec(&args, budget.cores(), &node_load_path);

    // Caps per rank count ("derived" resolves to what the engine would pick for that count).
    let mut derived_text = BTreeMap::new();
    let mut derived_cap: BTreeMap<usize, Cap> = BTreeMap::new();
    for &r in &ranks_list {
        let env = MapEnv::new([("TE_LOCAL_RANKS", r.to_string().as_str())]);
        let d = CapDecision::from_env(&env, &budget).map_err(|e| e.to_string())?;
        derived_text.insert(r, d.to_string());
        derived_cap.insert(r, d.cap.map(|c| c.get()));
    }
    let cap_words: Vec<String> = args.caps.split(',').map(|s| s.trim().to_string()).collect();
    let mut caps_axis: Vec<Cap> = Vec::new();
    for w in &cap_words {
        match w.as_str() {
            "unset" | "unbounded" | "0" => caps_axis.push(None),
            "derived" => {}
            n => caps_axis.push(Some(
                n.parse::<usize>()
                    .ok()
                    .filter(|&c| c > 0)
                    .ok_or_else(|| format!("--caps: bad cap {n:?} (numbers, unset or derived)"))?,
            )),
        }
    }
    let with_derived = cap_words.iter().any(|w| w == "derived");

    let mut cells: Vec<Cell> = Vec::new();
    for &r in &ranks_list {
        let mut caps = caps_axis.clone();
        if with_derived {
            caps.push(derived_cap[&r]);
        }
        for cap in caps {
            for o in &orders {
                if !cells.iter().any(|c| c.ranks == r && c.cap == cap && &c.order == o) {
                    cells.push(Cell {
                        ranks: r,
                        cap,
                        order: o.clone(),
                        runs_s: Vec::new(),
                        work_s: Vec::new(),
                    });
                }
            }
        }
    }
    if with_derived {
        for cap in derived_cap.values() {
            if !caps_axis.contains(cap) {
                caps_axis.push(*cap);
            }
        }
    }

    let exe = std::env::current_exe().map_err(|e| format!("finding te-bench itself: {e}"))?;
    let bar = ProgressBar::new((cells.len() * args.repeat) as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} register [{bar:30}] {pos}/{len} cells {msg} ({elapsed})")
            .map_err(|e| e.to_string())?
            .progress_chars("=> "),
    );
    for _ in 0..args.repeat {
        for cell in cells.iter_mut() {
            bar.set_message(format!(
                "ranks {} cap {} {}",
                cell.ranks,
                report::cap_label(cell.cap),
                cell.order
            ));
            let specs: Vec<RankSpec> = (0..cell.ranks)
                .map(|rank| RankSpec {
                    rank,
                    transport: args.transport,
                    location: args.location,
                    sizes: sizes.clone(),
                    domains: nics_per_rank[rank],
                    cap: cell.cap.unwrap_or(0),
                    order: cell.order.clone(),
                    cpus: cpus.clone(),
                    sim: sim.clone(),
                })
                .collect();
            // A fresh in-flight counter per cell, so a rank that died mid-cell cannot skew the next.
            let load = NodeLoad::create(&node_load_path).map_err(|e| e.to_string())?;
            let results = sweep::run_cell(&exe, &specs);
            drop(load);
            let _ = std::fs::remove_file(&node_load_path);
            let results = results?;
            let slowest = results.iter().map(|r| r.wall_s).fold(0.0, f64::max);
            // Only the simulation runs on a scaled clock; a real transport's time is wall time.
            let scale = if args.transport == TransportChoice::Sim {
                args.sim_scale
            } else {
                1.0
            };
            cell.runs_s.push(slowest / scale);
            cell.work_s.push(results.iter().map(|r| r.work_node_s).sum());
            bar.inc(1);
        }
    }
    bar.finish_and_clear();

    let ctx = Context {
        transport: args.transport.name().into(),
        simulated: args.transport == TransportChoice::Sim,
        location: match args.location {
            LocationChoice::Host => "host".into(),
            LocationChoice::Cuda => "cuda".into(),
        },
        shape: shape_name(&args),
        buffers: sizes.len(),
        bytes_per_rank: sizes.iter().sum(),
        nics_per_rank,
        nic_source,
        cores: budget.cores(),
        cores_source: match &args.cores {
            Some(c) => format!("--cores {c}, shared by all ranks"),
            None => budget.to_string(),
        },
        sim_scale: args.sim_scale,
        repeat: args.repeat,
    };
    let table = report::table(&ctx, &cells, &caps_axis, &orders, &derived_text);
    if args.json {
        for c in &cells {
            println!("{}", report::cell_json(&ctx, c, derived_cap[&c.ranks]));
        }
    }
    if args.csv {
        println!("{}", report::CSV_HEADER);
        for c in &cells {
            println!("{}", report::csv_row(&ctx, c, derived_cap[&c.ranks]));
        }
    }
    if args.json || args.csv {
        eprint!("{table}");
    } else {
        print!("{table}");
    }
    if let Some(path) = &args.plot {
        plot::draw(path, &plot_title(&ctx), &cells, &caps_axis, &orders)?;
        eprintln!("plot written to {}", path.display());
    }
    Ok(())
}

fn run_views(args: &Options, views: usize) -> Result<(), String> {
    if args.repeat == 0 {
        return Err("--repeat must be at least 1".into());
    }
    if !(args.sim_scale.is_finite() && args.sim_scale > 0.0) {
        return Err(format!("--sim-scale {} must be > 0", args.sim_scale));
    }
    let pool_bytes = shapes::parse_size(&args.pool_size).map_err(|e| format!("--pool-size: {e}"))?;
    // One domain unless asked: the sim's costs are per domain, and a real transport has its own.
    let domains = args.nics.unwrap_or(1);
    if domains == 0 {
        return Err("--nics must be at least 1".into());
    }
    let node_load_path = std::env::temp_dir().join(format!("te-bench-register-{}.load", std::process::id()));
    let load = NodeLoad::create(&node_load_path).map_err(|e| e.to_string())?;
    let cores = CpuBudget::detect().cores();
    let result = views::run(views::ViewsSpec {
        views,
        pool_bytes,
        transport: args.transport,
        location: args.location,
        domains,
        repeat: args.repeat,
        sim: sim_spec(args, cores, &node_load_path),
        verify: args.verify,
        json: args.json,
    });
    drop(load);
    let _ = std::fs::remove_file(&node_load_path);
    result
}

fn plot_title(ctx: &Context) -> String {
    let short_shape = ctx.shape.split(" [").next().unwrap_or_default();
    format!(
        "{}te-bench register: {short_shape}, {} buffers/rank, {} memory, {} NICs/buffer, {} cores{}",
        if ctx.simulated { "SIMULATED " } else { "" },
        ctx.buffers,
        ctx.location,
        ctx.nics_per_rank.first().copied().unwrap_or(0),
        ctx.cores,
        if ctx.simulated { " (node seconds)" } else { "" }
    )
}

fn parse_list<T>(text: &str, flag: &str, parse: impl Fn(&str) -> Option<T>) -> Result<Vec<T>, String> {
    let items: Vec<&str> = text.split(',').map(str::trim).collect();
    if items.iter().any(|s| s.is_empty()) {
        return Err(format!("{flag}: empty element in {text:?}"));
    }
    items
        .into_iter()
        .map(|s| parse(s).ok_or_else(|| format!("{flag}: bad value {s:?}")))
        .collect()
}

fn sizes(args: &Options) -> Result<Vec<u64>, String> {
    if let Some(list) = &args.sizes {
        return shapes::parse_sizes(list).map_err(|e| format!("--sizes: {e}"));
    }
    if let Some(path) = &args.sizes_file {
        let text = std::fs::read_to_string(path).map_err(|e| format!("--sizes-file {}: {e}", path.display()))?;
        return shapes::parse_sizes(&text).map_err(|e| format!("--sizes-file {}: {e}", path.display()));
    }
    match args.shape {
        ShapePreset::KimiK3 => Ok(shapes::expand(&shapes::KIMI_K3)),
        ShapePreset::Uniform => {
            let size = shapes::parse_size(&args.uniform_size).map_err(|e| format!("--uniform-size: {e}"))?;
            if size == 0 || args.uniform_count == 0 {
                return Err("--uniform-count and --uniform-size must be positive".into());
            }
            Ok(vec![size; args.uniform_count])
        }
    }
}

fn shape_name(args: &Options) -> String {
    if args.sizes.is_some() {
        "sizes".into()
    } else if args.sizes_file.is_some() {
        "sizes-file".into()
    } else {
        match args.shape {
            ShapePreset::KimiK3 => {
                let pools: Vec<String> = shapes::KIMI_K3
                    .iter()
                    .map(|p| format!("{} x {} {}", p.count, shapes::Bytes(p.size), p.name))
                    .collect();
                format!("kimi-k3 [{}]", pools.join(", "))
            }
            ShapePreset::Uniform => "uniform".into(),
        }
    }
}

/// Domains per buffer for each rank, and where that number came from.
/// NICs each rank's buffers are registered on, and where that number came from. With `--sysfs`
/// the policy is the engine's: `env`'s `TE_NIC_SELECTION` (and the other NIC variables) unless
/// `--nic-selection` overrides it.
fn nics_per_rank(args: &Options, ranks: usize, env: &dyn Env) -> Result<(Vec<usize>, String), String> {
    let Some(sysfs) = &args.sysfs else {
        let n = args.nics.unwrap_or(32);
        if n == 0 {
            return Err("--nics must be at least 1".into());
        }
        return Ok((vec![n; ranks], format!("--nics {n}")));
    };
    if args.nics.is_some() {
        return Err("--nics and --sysfs are exclusive: the rail map decides with --sysfs".into());
    }
    let mut policy = NicPolicy::from_env(env).map_err(|e| e.to_string())?;
    let selection_source = match &args.nic_selection {
        Some(flag) => {
            policy.selection = flag.parse().map_err(|e| format!("--nic-selection: {e}"))?;
            format!("--nic-selection {flag}")
        }
        None => format!(
            "selection {} (TE_NIC_SELECTION or default)",
            format!("{:?}", policy.selection).to_lowercase()
        ),
    };
    let topology = te_testkit::fixture::discover(sysfs).map_err(|e| format!("--sysfs: {e}"))?;
    let gpus = topology.gpus.len();
    let placement = NicPlacement::new(topology, policy).map_err(|e| format!("--sysfs: {e}"))?;
    let mut counts = Vec::with_capacity(ranks);
    let mut sources = Vec::new();
    for rank in 0..ranks {
        let location = match args.location {
            LocationChoice::Host => MemoryLocation::HOST,
            LocationChoice::Cuda => {
                if gpus == 0 {
                    return Err(format!("--sysfs {}: no GPU for --location cuda", sysfs.display()));
                }
                MemoryLocation::Cuda {
                    device: (rank % gpus) as u32,
                }
            }
        };
        let chosen = placement
            .rails_for(location, None)
            .map_err(|e| format!("--sysfs: {e}"))?;
        if chosen.rails.is_empty() {
            return Err(format!("--sysfs {}: the topology has no NIC", sysfs.display()));
        }
        counts.push(chosen.rails.len());
        if rank == 0 {
            sources.push(format!("{:?}", chosen.source));
        }
    }
    let name = sysfs
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    Ok((counts, format!("{name}, {selection_source}, {}", sources.join(""))))
}

fn sim_spec(args: &Options, cores: usize, node_load_path: &std::path::Path) -> SimSpec {
    let m = SimCostModel::P5_48XLARGE;
    SimSpec {
        scale: args.sim_scale,
        host_base_ms: m.host_base_ms,
        host_ms_per_gib: args.sim_host_ms_per_gib.unwrap_or(m.host_ms_per_gib),
        device_base_ms: m.device_base_ms,
        device_ms_per_gib: args.sim_device_ms_per_gib.unwrap_or(m.device_ms_per_gib),
        device_ms_per_prior_gib: args.sim_k_ms_per_gib.unwrap_or(m.device_ms_per_prior_gib),
        oversubscription_penalty: args.sim_oversubscription_penalty.unwrap_or(m.oversubscription_penalty),
        cores,
        node_load_path: node_load_path.display().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        options: Options,
    }

    fn nics<const N: usize>(extra: &[&str], env: [(&str, &str); N]) -> Result<(Vec<usize>, String), String> {
        let fixture = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../topology/tests/fixtures/topology/p5.48xlarge.json"
        );
        let mut argv = vec!["register", "--location", "cuda", "--sysfs", fixture];
        argv.extend_from_slice(extra);
        let cli = Cli::try_parse_from(argv).map_err(|e| e.to_string())?;
        nics_per_rank(&cli.options, 1, &MapEnv::new(env))
    }

    #[test]
    fn nic_selection_follows_the_environment_unless_the_flag_overrides_it() {
        // p5.48xlarge: 4 rail-local NICs per GPU, 32 in all.
        assert_eq!(nics(&[], []).unwrap().0, vec![4]);
        assert_eq!(nics(&[], [("TE_NIC_SELECTION", "all")]).unwrap().0, vec![32]);
        assert_eq!(nics(&[], [("MC_EFA_NIC_SELECTION", "all")]).unwrap().0, vec![32]);
        let (n, source) = nics(&["--nic-selection", "local"], [("TE_NIC_SELECTION", "all")]).unwrap();
        assert_eq!(n, vec![4]);
        assert!(source.contains("--nic-selection local"), "{source}");
        let err = nics(&[], [("TE_NIC_SELECTION", "bogus")]).unwrap_err();
        assert!(err.contains("TE_NIC_SELECTION"), "{err}");
    }
}
