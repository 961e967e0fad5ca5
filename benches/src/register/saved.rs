//! `--from-json FILE`: rebuilds the table and the plot from the `--json` lines of an earlier run
//! (on this machine or on a real node), without running anything.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use super::report::{Cap, Cell, Context};

/// What a saved run holds.
pub struct Saved {
    pub ctx: Context,
    pub cells: Vec<Cell>,
    pub caps: Vec<Cap>,
    pub orders: Vec<String>,
    pub derived: BTreeMap<usize, Cap>,
}

/// Reads `path`: one JSON object per line as `te-bench register --json` prints them.
pub fn load(path: &Path) -> Result<Saved, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("--from-json {}: {e}", path.display()))?;
    let mut saved: Option<Saved> = None;
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let bad = |what: &str| format!("--from-json {} line {}: {what}", path.display(), n + 1);
        let v: Value = serde_json::from_str(line).map_err(|e| bad(&e.to_string()))?;
        if v["bench"] != "register" {
            return Err(bad("not a te-bench register result"));
        }
        let num = |k: &str| v[k].as_u64().ok_or_else(|| bad(&format!("missing {k}")));
        let text = |k: &str| {
            v[k].as_str()
                .map(str::to_string)
                .ok_or_else(|| bad(&format!("missing {k}")))
        };
        let ranks = num("ranks")? as usize;
        let cap: Cap = v["cap"].as_u64().map(|c| c as usize);
        let order = text("order")?;
        let runs_s: Vec<f64> = v["runs_s"]
            .as_array()
            .ok_or_else(|| bad("missing runs_s"))?
            .iter()
            .filter_map(Value::as_f64)
            .collect();
        let s = saved.get_or_insert_with(|| Saved {
            ctx: Context {
                transport: v["transport"].as_str().unwrap_or("?").to_string(),
                simulated: v["simulated"].as_bool().unwrap_or(false),
                location: v["location"].as_str().unwrap_or("?").to_string(),
                shape: v["shape"].as_str().unwrap_or("?").to_string(),
                buffers: v["buffers"].as_u64().unwrap_or(0) as usize,
                bytes_per_rank: v["bytes_per_rank"].as_u64().unwrap_or(0),
                nics_per_rank: vec![v["nics"].as_u64().unwrap_or(0) as usize],
                nic_source: v["nic_source"].as_str().unwrap_or("?").to_string(),
                cores: v["cores"].as_u64().unwrap_or(0) as usize,
                cores_source: "as saved".to_string(),
                sim_scale: v["sim_scale"].as_f64().unwrap_or(1.0),
                repeat: v["repeat"].as_u64().unwrap_or(0) as usize,
            },
            cells: Vec::new(),
            caps: Vec::new(),
            orders: Vec::new(),
            derived: BTreeMap::new(),
        });
        if !s.caps.contains(&cap) {
            s.caps.push(cap);
        }
        if !s.orders.contains(&order) {
            s.orders.push(order.clone());
        }
        s.derived.insert(ranks, v["derived_cap"].as_u64().map(|c| c as usize));
        s.cells.push(Cell {
            ranks,
            cap,
            order,
            work_s: vec![v["work_s"].as_f64().unwrap_or(0.0)],
            runs_s,
        });
    }
    saved.ok_or_else(|| format!("--from-json {}: no results", path.display()))
}
