//! `te-node`: one transfer engine in its own process, driven over standard input by the
//! multi-process and multi-host tests. Prints `READY <p2p address>` once serving, then answers each
//! command line with one line (`OK ...` or `ERR ...`).
//!
//! ```text
//! te-node --name NAME --ip IP --metadata p2p|etcd [--etcd URL] [--p2p-port PORT] --slot-bytes N --slots K
//! commands:
//!   push PEER SLOT SEED   write pattern SEED into PEER's buffer slot SLOT, then read it back and compare
//!   pull PEER SLOT SEED   read PEER's slot SLOT and compare with pattern SEED
//!   check SLOT SEED       compare this node's own slot SLOT with pattern SEED
//!   open PEER             open PEER's segment now (flood then needs no metadata lookup)
//!   flood PEER ROUNDS     submit ROUNDS x the whole buffer as writes to PEER, answer at once
//!   wait                  wait for the flood batch; OK or ERR with the first failure
//!   quit
//! ```
//! PEER is a segment name (etcd) or `ip:port` (p2p).

use std::io::{BufRead, Write};
use std::sync::Arc;
use std::time::Duration;

use te_core::config::MapEnv;
use te_core::metadata::etcd::EtcdStore;
use te_core::metadata::p2p::P2pStore;
use te_core::{Batch, HostBufferOptions, MetadataStore, Registration, TransferEngine, TransferRequest};
use te_tests::pattern;

struct Opts {
    name: String,
    ip: String,
    metadata: String,
    etcd: Option<String>,
    p2p_port: u16,
    slot_bytes: u64,
    slots: u64,
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts {
        name: String::new(),
        ip: "127.0.0.1".into(),
        metadata: "p2p".into(),
        etcd: None,
        p2p_port: 7000,
        slot_bytes: 1 << 20,
        slots: 4,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--name" => o.name = val()?,
            "--ip" => o.ip = val()?,
            "--metadata" => o.metadata = val()?,
            "--etcd" => o.etcd = Some(val()?),
            "--p2p-port" => o.p2p_port = val()?.parse().map_err(|e| format!("--p2p-port: {e}"))?,
            "--slot-bytes" => o.slot_bytes = val()?.parse().map_err(|e| format!("--slot-bytes: {e}"))?,
            "--slots" => o.slots = val()?.parse().map_err(|e| format!("--slots: {e}"))?,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if o.name.is_empty() {
        return Err("--name is required".into());
    }
    Ok(o)
}

struct Node {
    engine: TransferEngine,
    buf: Registration,
    scratch: Registration,
    back: Registration,
    slot: u64,
    flood: Option<Batch>,
    /// Segments opened with `open`, used by `flood` without asking the metadata again.
    opened: std::collections::HashMap<String, (te_core::SegmentId, u64)>,
}

fn fill(r: &Registration, off: u64, len: u64, seed: u64) -> Result<(), String> {
    let data: Vec<u8> = (0..len).map(|i| pattern(seed, i)).collect();
    r.write_at(off, &data).map_err(|e| e.to_string())
}

fn mismatches(r: &Registration, off: u64, len: u64, seed: u64) -> Result<u64, String> {
    let mut data = vec![0u8; len as usize];
    r.read_at(off, &mut data).map_err(|e| e.to_string())?;
    Ok(data
        .iter()
        .enumerate()
        .filter(|(i, b)| **b != pattern(seed, *i as u64))
        .count() as u64)
}

impl Node {
    async fn remote_slot(&self, peer: &str, slot: u64) -> Result<(te_core::SegmentId, u64), String> {
        let seg = self.engine.open_segment(peer).await.map_err(|e| e.to_string())?;
        // The slots live in the peer's largest exported buffer (its scratch buffers are smaller).
        let b = seg
            .buffers()
            .iter()
            .max_by_key(|b| b.len)
            .ok_or("peer exports no buffer")?;
        Ok((seg.id(), b.base + slot * self.slot))
    }

    async fn run(&mut self, line: &str) -> Result<String, String> {
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| -> Result<u64, String> {
            w.get(i)
                .ok_or_else(|| format!("missing argument {i}"))?
                .parse::<u64>()
                .map_err(|e| format!("argument {i}: {e}"))
        };
        match w.first().copied() {
            Some("push") => {
                let (seg, remote) = self.remote_slot(w.get(1).ok_or("missing peer")?, num(2)?).await?;
                let seed = num(3)?;
                fill(&self.scratch, 0, self.slot, seed)?;
                self.engine
                    .transfer(&[TransferRequest::write(self.scratch.addr(), seg, remote, self.slot)])
                    .await
                    .map_err(|e| e.to_string())?;
                fill(&self.back, 0, self.slot, !seed)?;
                self.engine
                    .transfer(&[TransferRequest::read(self.back.addr(), seg, remote, self.slot)])
                    .await
                    .map_err(|e| e.to_string())?;
                match mismatches(&self.back, 0, self.slot, seed)? {
                    0 => Ok("OK".into()),
                    n => Err(format!("read-back differs in {n} bytes")),
                }
            }
            Some("pull") => {
                let (seg, remote) = self.remote_slot(w.get(1).ok_or("missing peer")?, num(2)?).await?;
                fill(&self.back, 0, self.slot, 0)?;
                self.engine
                    .transfer(&[TransferRequest::read(self.back.addr(), seg, remote, self.slot)])
                    .await
                    .map_err(|e| e.to_string())?;
                match mismatches(&self.back, 0, self.slot, num(3)?)? {
                    0 => Ok("OK".into()),
                    n => Err(format!("pulled slot differs in {n} bytes")),
                }
            }
            Some("check") => match mismatches(&self.buf, num(1)? * self.slot, self.slot, num(2)?)? {
                0 => Ok("OK".into()),
                n => Err(format!("own slot differs in {n} bytes")),
            },
            Some("open") => {
                let peer = w.get(1).ok_or("missing peer")?.to_string();
                let at = self.remote_slot(&peer, 0).await?;
                self.opened.insert(peer, at);
                Ok("OK".into())
            }
            Some("flood") => {
                let peer = w.get(1).ok_or("missing peer")?;
                let (seg, remote) = match self.opened.get(*peer) {
                    Some(&at) => at,
                    None => self.remote_slot(peer, 0).await?,
                };
                let rounds = num(2)?;
                let reqs: Vec<TransferRequest> = (0..rounds)
                    .map(|_| TransferRequest::write(self.scratch.addr(), seg, remote, self.slot))
                    .collect();
                self.flood = Some(self.engine.submit(&reqs).map_err(|e| e.to_string())?);
                Ok("OK submitted".into())
            }
            Some("wait") => {
                let batch = self.flood.take().ok_or("nothing submitted")?;
                match batch.wait().await {
                    Ok(r) => Ok(format!("OK {} requests", r.requests)),
                    Err(e) => Err(e.to_string()),
                }
            }
            other => Err(format!("unknown command {other:?}")),
        }
    }
}

async fn start(o: &Opts) -> Result<(Node, String), String> {
    let mut env = MapEnv::new([("TE_TCP_TIMEOUT_MS", "3000"), ("TE_ETCD_LEASE_TTL_S", "3")]);
    env.0.insert("TE_TCP_LISTEN".into(), format!("{}:0", o.ip));
    let p2p = Arc::new(
        P2pStore::bind(
            format!("{}:{}", o.ip, o.p2p_port).parse().map_err(|e| format!("{e}"))?,
            Duration::from_secs(5),
        )
        .await
        .map_err(|e| e.to_string())?,
    );
    let p2p_addr = p2p.local_addr().to_string();
    let store: Arc<dyn MetadataStore> = match o.metadata.as_str() {
        "p2p" => p2p,
        "etcd" => {
            let ep = o.etcd.clone().ok_or("--metadata etcd needs --etcd URL")?;
            env.0.insert("TE_ETCD_ENDPOINTS".into(), ep);
            env.0.insert("TE_ETCD_PREFIX".into(), "/te-multihost".into());
            Arc::new(EtcdStore::from_env(&env).await.map_err(|e| e.to_string())?)
        }
        m => return Err(format!("unknown metadata {m}")),
    };
    let engine = TransferEngine::builder()
        .segment_name(o.name.clone())
        .metadata(store)
        .env(Arc::new(env))
        .transports(["tcp"])
        .build()
        .await
        .map_err(|e| e.to_string())?;
    let total = o.slot_bytes * o.slots;
    let buf = engine
        .allocate(total as usize, HostBufferOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let scratch = engine
        .allocate(o.slot_bytes as usize, HostBufferOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    let back = engine
        .allocate(o.slot_bytes as usize, HostBufferOptions::default())
        .await
        .map_err(|e| e.to_string())?;
    Ok((
        Node {
            engine,
            buf,
            scratch,
            back,
            slot: o.slot_bytes,
            flood: None,
            opened: Default::default(),
        },
        p2p_addr,
    ))
}

fn main() {
    let opts = match parse() {
        Ok(o) => o,
        Err(e) => {
            println!("ERR {e}");
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let (mut node, addr) = match rt.block_on(start(&opts)) {
        Ok(n) => n,
        Err(e) => {
            println!("ERR {e}");
            std::process::exit(1);
        }
    };
    println!("READY {addr}");
    let _ = std::io::stdout().flush();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        if line.trim() == "quit" {
            break;
        }
        let answer = match rt.block_on(node.run(&line)) {
            Ok(a) => a,
            Err(e) => format!("ERR {e}"),
        };
        println!("{answer}");
        let _ = std::io::stdout().flush();
    }
    let _ = rt.block_on(node.engine.shutdown());
}
