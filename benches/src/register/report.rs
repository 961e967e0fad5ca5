//! Results of a sweep: medians per cell, the best cap per order, and the outputs (table, JSON
//! lines, CSV).

use std::collections::BTreeMap;

use serde_json::{json, Value};

/// A cap as swept: `None` = unbounded (the variable unset).
pub type Cap = Option<usize>;

/// One cell of the sweep with every repetition's slowest-rank time.
#[derive(Debug, Clone)]
pub struct Cell {
    pub ranks: usize,
    pub cap: Cap,
    pub order: String,
    /// Slowest rank per repetition, node seconds.
    pub runs_s: Vec<f64>,
    /// Modelled work summed over ranks, node seconds (sim), per repetition.
    pub work_s: Vec<f64>,
}

impl Cell {
    /// Median of the repetitions (upper median for even counts).
    pub fn median_s(&self) -> f64 {
        median(&self.runs_s)
    }
}

/// Upper median; 0 for an empty slice.
pub fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Label of a cap in tables.
pub fn cap_label(cap: Cap) -> String {
    cap.map_or_else(|| "unset".to_string(), |c| c.to_string())
}

/// The lowest-median cap per (ranks, order).
pub fn best_caps(cells: &[Cell]) -> BTreeMap<(usize, String), (Cap, f64)> {
    let mut best: BTreeMap<(usize, String), (Cap, f64)> = BTreeMap::new();
    for c in cells {
        let m = c.median_s();
        let entry = best.entry((c.ranks, c.order.clone())).or_insert((c.cap, m));
        if m < entry.1 {
            *entry = (c.cap, m);
        }
    }
    best
}

/// What every output line carries besides the cell.
#[derive(Debug, Clone)]
pub struct Context {
    pub transport: String,
    pub simulated: bool,
    pub location: String,
    pub shape: String,
    pub buffers: usize,
    pub bytes_per_rank: u64,
    /// Domains each buffer lands on, per rank.
    pub nics_per_rank: Vec<usize>,
    pub nic_source: String,
    pub cores: usize,
    pub cores_source: String,
    pub sim_scale: f64,
    pub repeat: usize,
}

/// One JSON object per cell.
pub fn cell_json(ctx: &Context, cell: &Cell, derived_cap: Cap) -> Value {
    let runs: Vec<f64> = cell.runs_s.iter().map(|v| round3(*v)).collect();
    json!({
        "bench": "register",
        "transport": ctx.transport,
        "simulated": ctx.simulated,
        "location": ctx.location,
        "shape": ctx.shape,
        "buffers": ctx.buffers,
        "bytes_per_rank": ctx.bytes_per_rank,
        "nics": ctx.nics_per_rank.first().copied().unwrap_or(0),
        "nics_per_rank": ctx.nics_per_rank.iter().take(cell.ranks).collect::<Vec<_>>(),
        "nic_source": ctx.nic_source,
        "cores": ctx.cores,
        "ranks": cell.ranks,
        "cap": cell.cap,
        "order": cell.order,
        "slowest_rank_s": round3(cell.median_s()),
        "runs_s": runs,
        "work_s": round3(median(&cell.work_s)),
        "repeat": ctx.repeat,
        "sim_scale": if ctx.simulated { Some(ctx.sim_scale) } else { None },
        "derived_cap": derived_cap,
    })
}

/// CSV header matching [`csv_row`].
pub const CSV_HEADER: &str = "transport,simulated,location,shape,buffers,bytes_per_rank,nics,cores,ranks,cap,order,\
                              slowest_rank_s,min_s,max_s,repeat,sim_scale,derived_cap";

/// One CSV row per cell (empty `cap` = unbounded).
pub fn csv_row(ctx: &Context, cell: &Cell, derived_cap: Cap) -> String {
    let min = cell.runs_s.iter().copied().fold(f64::INFINITY, f64::min);
    let max = cell.runs_s.iter().copied().fold(0.0, f64::max);
    format!(
        "{},{},{},{},{},{},{},{},{},{},{},{:.3},{:.3},{:.3},{},{},{}",
        ctx.transport,
        ctx.simulated,
        ctx.location,
        ctx.shape,
        ctx.buffers,
        ctx.bytes_per_rank,
        ctx.nics_per_rank.first().copied().unwrap_or(0),
        ctx.cores,
        cell.ranks,
        cell.cap.map(|c| c.to_string()).unwrap_or_default(),
        cell.order,
        cell.median_s(),
        min,
        max,
        ctx.repeat,
        if ctx.simulated {
            ctx.sim_scale.to_string()
        } else {
            String::new()
        },
        derived_cap.map(|c| c.to_string()).unwrap_or_default(),
    )
}

/// The human table: per rank count, cap x order in seconds, the best cap per order, the
/// recommended cap and the one the engine would derive.
pub fn table(
    ctx: &Context,
    cells: &[Cell],
    caps: &[Cap],
    orders: &[String],
    derived: &BTreeMap<usize, String>,
) -> String {
    let mut out = String::new();
    let unit = if ctx.simulated {
        format!(
            "SIMULATED ({} provider, times scaled back to node seconds from a {} time scale)",
            ctx.transport, ctx.sim_scale
        )
    } else {
        format!("{} provider, seconds", ctx.transport)
    };
    out.push_str(&format!("te-bench register: {unit}\n"));
    out.push_str(&format!(
        "shape {}: {} buffers per rank, {} per rank, {} memory; {} NIC(s) per buffer ({}); {} cores ({}); median of {}; slowest rank\n",
        ctx.shape,
        ctx.buffers,
        super::shapes::Bytes(ctx.bytes_per_rank),
        ctx.location,
        ctx.nics_per_rank.first().copied().unwrap_or(0),
        ctx.nic_source,
        ctx.cores,
        ctx.cores_source,
        ctx.repeat
    ));
    let best = best_caps(cells);
    let ranks: Vec<usize> = {
        let mut r: Vec<usize> = cells.iter().map(|c| c.ranks).collect();
        r.dedup();
        r
    };
    for r in ranks {
        out.push_str(&format!("\nranks {r}\n  {:>8}", "cap"));
        for o in orders {
            out.push_str(&format!(" {:>12}", o));
        }
        out.push('\n');
        for cap in caps {
            out.push_str(&format!("  {:>8}", cap_label(*cap)));
            for o in orders {
                match cells.iter().find(|c| c.ranks == r && c.cap == *cap && &c.order == o) {
                    Some(c) => out.push_str(&format!(" {:>12.2}", c.median_s())),
                    None => out.push_str(&format!(" {:>12}", "-")),
                }
            }
            out.push('\n');
        }
        let mut parts = Vec::new();
        for o in orders {
            if let Some((cap, s)) = best.get(&(r, o.clone())) {
                parts.push(format!("{o} {} ({s:.2} s)", cap_label(*cap)));
            }
        }
        out.push_str(&format!("  best cap per order: {}\n", parts.join(", ")));
        let preferred = ["ascending", "given", "descending"]
            .iter()
            .find_map(|o| best.get(&(r, o.to_string())).map(|b| (o, b)));
        if let Some((o, (cap, s))) = preferred {
            out.push_str(&format!(
                "  recommended: TE_MAX_CONCURRENT_REG_MR={} ({o} order, {s:.2} s; x {r} ranks = {} in flight)\n",
                cap.unwrap_or(0),
                cap.map_or("unbounded".to_string(), |c| (c * r).to_string())
            ));
        }
        if let Some(d) = derived.get(&r) {
            out.push_str(&format!("  engine would derive: {d}\n"));
        }
    }
    out
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}
