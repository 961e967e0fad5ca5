//! `te-bench topology`: the devices discovered on this host (or a fixture), the rail map and the
//! NIC policy in force, as a table, as JSON lines (`--json`) or as a Mooncake priority matrix
//! (`--matrix`).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;

use te_base::config::{Env, ProcessEnv};
use te_base::MemoryLocation;
use te_topology::{NicPlacement, OrdinalOrigin, RailSelection, Topology, NIC_SELECTION_ALIAS, NIC_SELECTION_VAR};

/// Options of `te-bench topology`.
#[derive(clap::Args)]
pub struct Args {
    /// Read this sysfs tree instead of /sys: a directory, or a fixture spec such as
    /// topology/tests/fixtures/topology/p5.48xlarge.json.
    #[arg(long, value_name = "DIR|SPEC.json")]
    sysfs: Option<PathBuf>,
    /// Override TE_NIC_SELECTION (and its alias MC_EFA_NIC_SELECTION) for this run.
    #[arg(long, value_name = "local|all")]
    nic_selection: Option<String>,
    /// One JSON object per line instead of tables.
    #[arg(long)]
    json: bool,
    /// Print the placement in force as a Mooncake priority-matrix JSON file and nothing else.
    #[arg(long)]
    matrix: bool,
}

/// The process environment with the command-line overrides on top.
struct OverlayEnv {
    overrides: HashMap<&'static str, Option<String>>,
}

impl Env for OverlayEnv {
    fn get(&self, var: &str) -> Option<String> {
        match self.overrides.get(var) {
            Some(v) => v.clone(),
            None => ProcessEnv.get(var),
        }
    }
}

/// Runs `te-bench topology`: discovers, applies the policy from the environment and the flags,
/// and prints the result.
pub fn run(args: Args) -> Result<(), String> {
    let topology = match &args.sysfs {
        Some(path) => te_testkit::fixture::discover(path),
        None => Topology::discover(),
    }
    .map_err(|e| e.to_string())?;
    let mut overrides = HashMap::new();
    if let Some(sel) = &args.nic_selection {
        overrides.insert(NIC_SELECTION_VAR, Some(sel.clone()));
        overrides.insert(NIC_SELECTION_ALIAS, None);
    }
    let placement = NicPlacement::from_env(topology, &OverlayEnv { overrides }).map_err(|e| e.to_string())?;

    let mut out = String::new();
    if args.matrix {
        let matrix = placement.priority_matrix().map_err(|e| e.to_string())?;
        out = matrix.to_json();
        out.push('\n');
    } else {
        let rails = rail_rows(&placement)?;
        if args.json {
            json_lines(&mut out, &placement, &rails);
        } else {
            tables(&mut out, &placement, &rails).map_err(|e| e.to_string())?;
        }
    }
    match std::io::stdout().lock().write_all(out.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(format!("writing to stdout: {e}")),
        _ => Ok(()),
    }
}

/// Every location the host can hold memory in, with the rails the policy selects for it.
fn rail_rows(placement: &NicPlacement) -> Result<Vec<(MemoryLocation, RailSelection)>, String> {
    let t = placement.topology();
    let mut locations: Vec<MemoryLocation> = t
        .numa_nodes
        .iter()
        .map(|n| MemoryLocation::Host { numa: Some(n.id) })
        .collect();
    locations.extend((0..placement.cuda_ordinals().len() as u32).map(|device| MemoryLocation::Cuda { device }));
    locations.extend((0..placement.rocm_ordinals().len() as u32).map(|device| MemoryLocation::Rocm { device }));
    locations
        .into_iter()
        .map(|loc| {
            placement
                .rails_for(loc, None)
                .map(|sel| (loc, sel))
                .map_err(|e| e.to_string())
        })
        .collect()
}

fn nic_names(placement: &NicPlacement, rails: &[usize]) -> Vec<String> {
    rails
        .iter()
        .filter_map(|&r| placement.nic(r).map(|n| n.name.clone()))
        .collect()
}

fn json_lines(out: &mut String, placement: &NicPlacement, rails: &[(MemoryLocation, RailSelection)]) {
    let mut line = |v: serde_json::Value| {
        out.push_str(&v.to_string());
        out.push('\n');
    };
    let t = placement.topology();
    line(serde_json::json!({ "type": "topology", "topology": t }));
    line(serde_json::json!({
        "type": "policy",
        "policy": placement.policy(),
        "override": placement.matrix().is_some(),
        "cuda_ordinals": placement.cuda_ordinals(),
        "rocm_ordinals": placement.rocm_ordinals(),
    }));
    for (loc, sel) in rails {
        let bus_id = match loc {
            MemoryLocation::Cuda { device } => placement.cuda_ordinals().bus_id(*device),
            MemoryLocation::Rocm { device } => placement.rocm_ordinals().bus_id(*device),
            MemoryLocation::Host { .. } => None,
        };
        line(serde_json::json!({
            "type": "rails",
            "location": loc.to_string(),
            "bus_id": bus_id,
            "rails": sel.rails,
            "nics": nic_names(placement, &sel.rails),
            "count": sel.rails.len(),
            "source": sel.source,
        }));
    }
}

fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref().map_or_else(|| "-".to_string(), |v| v.to_string())
}

fn tables(out: &mut String, placement: &NicPlacement, rails: &[(MemoryLocation, RailSelection)]) -> std::fmt::Result {
    let t = placement.topology();
    writeln!(
        out,
        "topology of {}: {} NUMA node(s), {} GPU(s), {} RDMA NIC(s), {} network interface(s)",
        t.source,
        t.numa_nodes.len(),
        t.gpus.len(),
        t.nics.len(),
        t.net_interfaces.len()
    )?;

    writeln!(out, "\nNUMA nodes")?;
    writeln!(out, "  {:<5} cpus", "node")?;
    for n in &t.numa_nodes {
        writeln!(out, "  {:<5} {} ({} CPUs)", n.id, n.cpus, n.cpus.len())?;
    }

    writeln!(out, "\nRDMA NICs (rail = position in bus-id order)")?;
    if t.nics.is_empty() {
        writeln!(
            out,
            "  none (no /sys/class/infiniband devices): RDMA and EFA transports are not available"
        )?;
    } else {
        writeln!(
            out,
            "  {:<5} {:<12} {:<6} {:<10} {:<13} {:<5} {:<9} {:<7} {:<12} pci path",
            "rail", "name", "kind", "driver", "bus id", "numa", "rate", "state", "link layer"
        )?;
        for (i, n) in t.nics.iter().enumerate() {
            let port = n.ports.first();
            writeln!(
                out,
                "  {:<5} {:<12} {:<6} {:<10} {:<13} {:<5} {:<9} {:<7} {:<12} {}",
                i,
                n.name,
                format!("{:?}", n.kind).to_lowercase(),
                opt(&n.driver),
                opt(&n.bus_id()),
                opt(&n.numa),
                format!("{}G", n.rate_mbps() / 1000),
                port.map_or("-", |p| p.state.as_str()),
                port.map_or("-", |p| p.link_layer.as_str()),
                opt(&n.pci)
            )?;
        }
    }

    writeln!(out, "\nGPUs (bus-id order)")?;
    if t.gpus.is_empty() {
        writeln!(out, "  none")?;
    } else {
        writeln!(
            out,
            "  {:<13} {:<7} {:<7} {:<5} pci path",
            "bus id", "vendor", "device", "numa"
        )?;
        for g in &t.gpus {
            writeln!(
                out,
                "  {:<13} {:<7} {:<7} {:<5} {}",
                g.bus_id().to_string(),
                format!("{:?}", g.vendor).to_lowercase(),
                format!("{:#06x}", g.device_id),
                opt(&g.numa),
                g.pci
            )?;
        }
    }

    writeln!(out, "\nNetwork interfaces")?;
    writeln!(
        out,
        "  {:<12} {:<13} {:<5} {:<8} {:<9} rdma",
        "name", "bus id", "numa", "state", "speed"
    )?;
    for i in &t.net_interfaces {
        writeln!(
            out,
            "  {:<12} {:<13} {:<5} {:<8} {:<9} {}",
            i.name,
            i.pci.as_ref().map_or("virtual".to_string(), |p| p.device.to_string()),
            opt(&i.numa),
            opt(&i.operstate),
            i.speed_mbps.map_or("-".to_string(), |s| format!("{s}M")),
            opt(&i.rdma_device)
        )?;
    }

    let policy = placement.policy();
    writeln!(out, "\nPolicy")?;
    writeln!(
        out,
        "  selection      {} (TE_NIC_SELECTION, alias MC_EFA_NIC_SELECTION)",
        policy.selection
    )?;
    writeln!(
        out,
        "  override file  {}",
        policy
            .matrix_path
            .as_ref()
            .map_or("none (TE_NIC_PRIORITY_MATRIX)".to_string(), |p| p.display().to_string())
    )?;
    writeln!(
        out,
        "  stripe above   {} B (TE_STRIPE_MIN_BYTES)",
        policy.stripe_min_bytes
    )?;
    writeln!(out, "  cuda ordinals  {}", origin(placement.cuda_ordinals().origin()))?;
    if !placement.rocm_ordinals().is_empty() {
        writeln!(out, "  rocm ordinals  {}", origin(placement.rocm_ordinals().origin()))?;
    }

    writeln!(out, "\nRails per buffer location (policy in force)")?;
    writeln!(
        out,
        "  {:<11} {:<14} {:<6} {:<40} source",
        "location", "bus id", "count", "nics"
    )?;
    for (loc, sel) in rails {
        let bus_id = match loc {
            MemoryLocation::Cuda { device } => placement.cuda_ordinals().bus_id(*device),
            MemoryLocation::Rocm { device } => placement.rocm_ordinals().bus_id(*device),
            MemoryLocation::Host { .. } => None,
        };
        let names = nic_names(placement, &sel.rails);
        let shown = if names.len() > 4 {
            format!("{},... ({} more)", names[..4].join(","), names.len() - 4)
        } else {
            names.join(",")
        };
        writeln!(
            out,
            "  {:<11} {:<14} {:<6} {:<40} {}",
            loc.to_string(),
            opt(&bus_id),
            sel.rails.len(),
            if shown.is_empty() { "-".to_string() } else { shown },
            sel.source
        )?;
    }
    Ok(())
}

fn origin(o: &OrdinalOrigin) -> String {
    match o {
        OrdinalOrigin::BusOrder => "bus-id order (CUDA_VISIBLE_DEVICES unset; a device plugin may refine it)".into(),
        OrdinalOrigin::VisibleDevices { var, value } => format!("bus-id order filtered by {var}={value}"),
        OrdinalOrigin::Runtime => "reported by the device runtime".into(),
        OrdinalOrigin::Unresolved { reason } => format!("unresolved: {reason}"),
    }
}
