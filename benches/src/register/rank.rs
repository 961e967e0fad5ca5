//! The rank side: one process, its own pool and provider, started by the parent with
//! `te-bench register --rank-worker`. Protocol on stdin/stdout: the parent sends the spec (one JSON
//! line); the rank sets up everything, answers `ready`, waits for `go`, registers the whole batch,
//! and answers with its result (one JSON line).

use std::io::{BufRead, Write};
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Instant;

use te_base::registration::{deregister_regions, register_regions, RegistrationPool};
use te_base::{MemoryLocation, RegionId, RegionInfo};
use te_testkit::SimProvider;

use super::affinity;
use super::spec::{LocationChoice, RankResult, RankSpec, TransportChoice};

/// Runs one rank; its errors go back to the parent on stderr and as the exit status.
pub fn run_rank() -> Result<(), String> {
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    let mut line = String::new();
    input
        .read_line(&mut line)
        .map_err(|e| format!("rank: reading the spec: {e}"))?;
    let spec: RankSpec = serde_json::from_str(&line).map_err(|e| format!("rank: bad spec: {e}"))?;
    if let Some(cpus) = &spec.cpus {
        affinity::restrict_to(cpus)?;
    }
    let order = spec.order()?;
    let pool = RegistrationPool::with_policy(NonZeroUsize::new(spec.cap), order);
    pool.warm_up(spec.sizes.len());
    let regions = regions(&spec);

    let result = match spec.transport {
        TransportChoice::Sim => {
            let provider = Arc::new(SimProvider::new(spec.sim.config(spec.domains)?).map_err(|e| e.to_string())?);
            let wall_s = timed_after_barrier(&mut input, || {
                let handles = register_regions(&pool, &provider, regions.clone()).map_err(|e| e.to_string())?;
                Ok(regions.iter().cloned().zip(handles).collect::<Vec<_>>())
            })
            .and_then(|(wall_s, registered)| {
                deregister_regions(&pool, &provider, registered).map_err(|e| e.to_string())?;
                Ok(wall_s)
            })?;
            RankResult {
                rank: spec.rank,
                wall_s,
                work_node_s: provider.work_node_s(),
            }
        }
        TransportChoice::Efa | TransportChoice::Rdma | TransportChoice::Local | TransportChoice::Tcp => {
            engine_rank(&spec, &mut input)?
        }
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string(&result).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())
}

/// Says `ready`, waits for `go`, and times `work`.
fn timed_after_barrier<T>(
    input: &mut impl BufRead,
    work: impl FnOnce() -> Result<T, String>,
) -> Result<(f64, T), String> {
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "ready")
            .and_then(|_| out.flush())
            .map_err(|e| e.to_string())?;
    }
    let mut line = String::new();
    input
        .read_line(&mut line)
        .map_err(|e| format!("rank: waiting for go: {e}"))?;
    if line.trim() != "go" {
        return Err(format!("rank: expected go, got {line:?}"));
    }
    let start = Instant::now();
    let value = work()?;
    Ok((start.elapsed().as_secs_f64(), value))
}

/// Synthetic, non-overlapping regions for the simulated provider (it never touches the memory).
fn regions(spec: &RankSpec) -> Vec<RegionInfo> {
    let location = match spec.location {
        LocationChoice::Host => MemoryLocation::HOST,
        LocationChoice::Cuda => MemoryLocation::Cuda {
            device: spec.rank as u32,
        },
    };
    let mut base = 1u64 << 40;
    spec.sizes
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let region = RegionInfo {
                id: RegionId(i as u64 + 1),
                base,
                len,
                location,
                exported: true,
            };
            base += len.div_ceil(4096) * 4096 + 4096;
            region
        })
        .collect()
}

/// A real transport: this rank builds an engine with only that transport and registers real,
/// prefaulted host buffers through it (its registration pool, placement and provider), with the
/// cell's cap and order given to the engine through its own variables.
fn engine_rank(spec: &RankSpec, input: &mut impl BufRead) -> Result<RankResult, String> {
    let name = spec.transport.name();
    if spec.location != LocationChoice::Host {
        return Err(format!(
            "transport {name}: not available: device-memory registration through {name} needs the GPU plugin path, \
             which this benchmark does not drive yet; use --location host"
        ));
    }
    // The process-wide pool reads these once, at its first use, which is below.
    std::env::set_var("TE_MAX_CONCURRENT_REG_MR", spec.cap.to_string());
    std::env::set_var("TE_REG_ORDER", &spec.order);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let engine = rt
        .block_on(
            te_core::TransferEngine::builder()
                .segment_name(format!("te-bench-register-{}-{}", spec.rank, std::process::id()))
                .transports([name])
                .build(),
        )
        .map_err(|e| e.to_string())?;
    crate::util::require_transport(&engine, name)?;
    let opts = te_core::HostBufferOptions {
        prefault: true,
        ..Default::default()
    };
    let buffers = spec
        .sizes
        .iter()
        .map(|&len| te_core::HostBuffer::allocate(len as usize, opts).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    let (wall_s, registered) = timed_after_barrier(input, || {
        rt.block_on(engine.register_host_buffers(buffers, te_core::RegisterOptions::default()))
            .map_err(|e| e.to_string())
    })?;
    drop(registered);
    Ok(RankResult {
        rank: spec.rank,
        wall_s,
        work_node_s: wall_s,
    })
}
