//! `--scheme one-to-many`: this process is the one initiator. One engine opens every target; each
//! repetition runs one batch per target, all concurrently (one task each), every task timing its
//! own batch; the latency round trips run concurrently the same way.

use std::sync::Arc;

use te_core::{TransferEngine, TransferRequest};
use tokio::task::JoinSet;

use super::summary::{mono_ns, PeerResult, PeerRun};
use super::{write_seed, Plan};
use crate::transfer::{attach, block_requests, engine, p2p_store, round_trips, verify_fresh, Args, Session};

struct Peer {
    plan: Plan,
    args: Args,
    session: Session,
    requests: Arc<Vec<TransferRequest>>,
}

/// Runs `f` for every peer concurrently, one task each; the outputs in peer order.
async fn concurrently<T, F, Fut>(peers: &[Peer], f: F) -> Result<Vec<T>, String>
where
    T: Send + 'static,
    F: Fn(TransferEngine, Args, Arc<Vec<TransferRequest>>) -> Fut,
    Fut: std::future::Future<Output = Result<T, String>> + Send + 'static,
{
    let mut set = JoinSet::new();
    for (i, p) in peers.iter().enumerate() {
        let fut = f(p.session.engine.clone(), p.args.clone(), p.requests.clone());
        set.spawn(async move { fut.await.map(|v| (i, v)) });
    }
    let mut out: Vec<Option<T>> = (0..peers.len()).map(|_| None).collect();
    while let Some(joined) = set.join_next().await {
        let (i, v) = joined.map_err(|e| format!("a peer's task failed: {e}"))??;
        out[i] = Some(v);
    }
    out.into_iter()
        .map(|v| v.ok_or_else(|| "a peer's task gave no result".to_string()))
        .collect()
}

pub(super) async fn run(args: &Args, plans: &[Plan]) -> Result<Vec<PeerResult>, String> {
    let store = p2p_store("127.0.0.1:0".parse().expect("valid address")).await?;
    let engine = engine(args, store, "initiator").await?;
    let mut peers = Vec::with_capacity(plans.len());
    for plan in plans {
        let a = plan.args(args);
        let session = attach(&a, engine.clone(), &plan.addr, None).await?;
        let requests = Arc::new(block_requests(&a, &session.local, session.seg, session.remote_base));
        // Warm-up: connections, page faults.
        engine.transfer(&requests).await.map_err(|e| e.to_string())?;
        peers.push(Peer {
            plan: plan.clone(),
            args: a,
            session,
            requests,
        });
    }
    let mut runs: Vec<Vec<PeerRun>> = vec![Vec::with_capacity(args.repeat); peers.len()];
    for _ in 0..args.repeat {
        let timed = concurrently(&peers, |engine, a, requests| async move {
            let start_ns = mono_ns();
            for _ in 0..a.batches {
                engine.transfer(&requests).await.map_err(|e| e.to_string())?;
            }
            Ok(PeerRun {
                start_ns,
                end_ns: mono_ns(),
            })
        })
        .await?;
        for (r, t) in runs.iter_mut().zip(timed) {
            r.push(t);
        }
    }
    let latency = concurrently(&peers, |engine, a, requests| async move {
        round_trips(&a, &engine, &requests).await
    })
    .await?;
    let mut results = Vec::with_capacity(peers.len());
    for ((p, runs), (p50_us, p99_us)) in peers.iter().zip(runs).zip(latency) {
        let mismatched_bytes = if args.verify {
            Some(verify_fresh(&p.args, &p.session, &p.requests, write_seed(p.plan.peer)).await?)
        } else {
            None
        };
        results.push(PeerResult {
            peer: p.plan.peer,
            pid: std::process::id(),
            target: p.plan.addr.clone(),
            remote_offset: p.plan.remote_offset,
            bytes_per_run: args.total_bytes * u64::from(args.batches),
            runs,
            p50_us,
            p99_us,
            mismatched_bytes,
            open_us: p.session.open_us,
        });
    }
    drop(peers);
    engine.shutdown().await.map_err(|e| e.to_string())?;
    Ok(results)
}
