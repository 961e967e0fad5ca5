//! `te-bench watch`: how soon an open segment follows its peer's descriptor.
//!
//! Two engines in this process (tcp transport) share a metadata store: the in-process store, or
//! etcd (an etcd-server started on loopback unless `--etcd` names one). Each round the peer
//! registers a new 64 KiB buffer. Timed from the start of the peer's `allocate`: `publish`, until
//! that call returns (registration and the metadata write), and `follow`, until the follower's
//! `SegmentEvent::Changed` naming the buffer is received (by a task that timestamps each event as
//! it arrives): the store's push plus the engine applying the descriptor. `follow / publish` at or
//! below 1 means the follower is current by the time the publisher's own call returns. One `fetch`
//! of the same descriptor from the same store is reported too: the least a polling follower would
//! pay per poll. Medians per repetition, then the median of those. `--verify` writes a pattern
//! into each new buffer through the follower and checks it in the peer's memory.

use std::sync::Arc;
use std::time::{Duration, Instant};

use te_core::config::MapEnv;
use te_core::metadata::etcd::{EtcdConfig, EtcdStore};
use te_core::metadata::InProcessStore;
use te_core::{HostBufferOptions, MetadataStore, SegmentEvent, TransferEngine, TransferRequest};
use tokio::sync::mpsc;

use crate::util::{median, pattern, print_json, runtime};

const BUFFER: usize = 64 << 10;
/// Bound on one event's arrival (an error, not a measurement).
const PATIENCE: Duration = Duration::from_secs(30);

#[derive(clap::Args)]
pub struct Args {
    /// Metadata store: `in-process` or `etcd`.
    #[arg(long, default_value = "in-process")]
    store: String,
    /// etcd endpoint (`http://host:port`); default: start an etcd-server on loopback.
    #[arg(long)]
    etcd: Option<String>,
    /// Buffers added (and removed) per repetition.
    #[arg(long, default_value_t = 50)]
    rounds: usize,
    /// Repetitions.
    #[arg(long, default_value_t = 5)]
    repeat: usize,
    /// Write into each new buffer through the follower and check every byte at the peer.
    #[arg(long)]
    verify: bool,
    /// One JSON object per line.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<(), String> {
    if args.rounds == 0 || args.repeat == 0 {
        return Err("--rounds and --repeat must be at least 1".into());
    }
    let _etcd;
    let endpoint = match (args.store.as_str(), &args.etcd) {
        ("etcd", Some(e)) => Some(e.clone()),
        ("etcd", None) => {
            _etcd = te_base::test_support::etcd::EtcdServer::start_on_loopback()
                .ok_or("no etcd (Debian etcd-server) to start; pass --etcd http://host:port")?;
            Some(_etcd.endpoint.clone())
        }
        ("in-process", _) => None,
        (s, _) => return Err(format!("unknown --store {s:?} (in-process or etcd)")),
    };
    runtime()?.block_on(measure(&args, endpoint))
}

async fn store(endpoint: &Option<String>, shared: &InProcessStore) -> Result<Arc<dyn MetadataStore>, String> {
    Ok(match endpoint {
        None => Arc::new(shared.clone()),
        Some(e) => {
            let mut c = EtcdConfig::new(vec![e.clone()]);
            c.prefix = format!("/te-bench-watch-{}", std::process::id());
            Arc::new(EtcdStore::connect(c).await.map_err(|e| e.to_string())?)
        }
    })
}

async fn engine(name: &str, store: Arc<dyn MetadataStore>) -> Result<TransferEngine, String> {
    TransferEngine::builder()
        .segment_name(name)
        .metadata(store)
        .env(Arc::new(MapEnv::new([("TE_TCP_LISTEN", "127.0.0.1:0")])))
        .transports(["tcp"])
        .build()
        .await
        .map_err(|e| e.to_string())
}

/// Events of the followed segment with the time each was received.
type Stamped = mpsc::UnboundedReceiver<(Instant, SegmentEvent)>;

/// Waits for the follower's view to hold (`present`) or lack a buffer at `base`; returns when the
/// event arrived.
async fn follow(events: &mut Stamped, base: u64, present: bool) -> Result<Instant, String> {
    let wait = async {
        loop {
            match events.recv().await {
                Some((at, SegmentEvent::Changed(d))) if d.buffers.iter().any(|b| b.base == base) == present => {
                    return Ok(at)
                }
                Some(_) => {}
                None => return Err("segment events ended".to_string()),
            }
        }
    };
    tokio::time::timeout(PATIENCE, wait)
        .await
        .map_err(|_| format!("no event within {PATIENCE:?}"))?
}

async fn measure(args: &Args, endpoint: Option<String>) -> Result<(), String> {
    let shared = InProcessStore::new();
    let pid = std::process::id();
    let (a_name, b_name) = (format!("watch-a-{pid}"), format!("watch-b-{pid}"));
    let a_store = store(&endpoint, &shared).await?;
    let a = engine(&a_name, a_store.clone()).await?;
    let b = engine(&b_name, store(&endpoint, &shared).await?).await?;
    let seg = a.open_segment(&b_name).await.map_err(|e| e.to_string())?;
    let mut events = {
        let mut rx = seg.events();
        let (tx, stamped) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok(e) = rx.recv().await {
                if tx.send((Instant::now(), e)).is_err() {
                    return;
                }
            }
        });
        stamped
    };
    let src = a
        .allocate(BUFFER, HostBufferOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let data: Vec<u8> = (0..BUFFER as u64).map(|i| pattern(7, i)).collect();
    src.write_at(0, &data).map_err(|e| e.to_string())?;

    let (mut publishes, mut follows, mut fetches) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 0..args.repeat {
        let mut p = Vec::with_capacity(args.rounds);
        let mut f = Vec::with_capacity(args.rounds);
        let mut g = Vec::with_capacity(args.rounds);
        for _ in 0..args.rounds {
            let t0 = Instant::now();
            let added = b
                .allocate(BUFFER, HostBufferOptions::default())
                .await
                .map_err(|e| e.to_string())?;
            p.push(t0.elapsed());
            let seen = follow(&mut events, added.addr(), true).await?;
            f.push(seen.duration_since(t0));
            let t1 = Instant::now();
            a_store.fetch(&b_name).await.map_err(|e| e.to_string())?;
            g.push(t1.elapsed());
            if args.verify {
                let w = [TransferRequest::write(
                    src.addr(),
                    seg.id(),
                    added.addr(),
                    BUFFER as u64,
                )];
                a.transfer(&w)
                    .await
                    .map_err(|e| format!("write into the new buffer: {e}"))?;
                let mut back = vec![0u8; BUFFER];
                added.read_at(0, &mut back).map_err(|e| e.to_string())?;
                if back != data {
                    return Err("verify: the new buffer holds other bytes".into());
                }
            }
            let base = added.addr();
            added.deregister().await.map_err(|e| e.to_string())?;
            follow(&mut events, base, false).await?;
        }
        let row = [median(&mut p), median(&mut f), median(&mut g)];
        report(args, &format!("rep {rep}"), row);
        publishes.push(row[0]);
        follows.push(row[1]);
        fetches.push(row[2]);
    }
    let row = [median(&mut publishes), median(&mut follows), median(&mut fetches)];
    report(args, "median", row);
    a.shutdown().await.map_err(|e| e.to_string())?;
    b.shutdown().await.map_err(|e| e.to_string())
}

/// Prints medians of (publish, follow, fetch).
fn report(args: &Args, what: &str, [publish, follow, fetch]: [Duration; 3]) {
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let ratio = follow.as_secs_f64() / publish.as_secs_f64().max(1e-9);
    if args.json {
        print_json(&serde_json::json!({
            "bench": "watch",
            "store": args.store,
            "row": what,
            "rounds": args.rounds,
            "publish_us": us(publish),
            "follow_us": us(follow),
            "fetch_us": us(fetch),
            "follow_over_publish": ratio,
        }));
    } else {
        println!(
            "{:<10} {:<8} publish {:>9.1} us   follow {:>9.1} us   follow/publish {:>5.2}   one fetch {:>9.1} us",
            args.store,
            what,
            us(publish),
            us(follow),
            ratio,
            us(fetch)
        );
    }
}
