//! `te-node`: one transfer engine in its own process, driven over standard input by the
//! multi-process and multi-host tests. Prints `READY <p2p address>` once serving, then answers each
//! command line with one line (`OK ...` or `ERR ...`).
//!
//! ```text
//! te-node --name NAME --ip IP --metadata p2p|etcd [--etcd URL] [--p2p-port PORT] --slot-bytes N --slots K
//! commands:
//!   push PEER SLOT SEED   write pattern SEED into PEER's buffer slot SLOT, then read it back and compare
//!   pull PEER SLOT SEED   read PEER's slot SLOT and compare with pattern SEED
//!   sweep PEER SEED       every size 1 B..slot at unaligned offsets, then 10,000 fragments
//!   check SLOT SEED       compare this node's own slot SLOT with pattern SEED
//!   open PEER             open PEER's segment now (flood then needs no metadata lookup)
//!   flood PEER ROUNDS     submit ROUNDS x the whole buffer as writes to PEER, answer at once
//!   wait                  wait for the flood batch; OK or ERR with the first failure
//!   npush PEER SLOT SEED N        N notified writes into N parts of PEER's slot SLOT, pipelined
//!   nrecv SLOT SEED N FROM ORD    take N notifications from FROM, checking each part as it is read
//!                                 (ORD 1: they must arrive in part order)
//!   nbare PEER N                  N bare notifications; OK accepted=K [refused=VARIANT: ...]
//!   ntake N FROM                  exactly N notifications from FROM are waiting, carrying 0..N
//!   quit
//! ```
//! PEER is a segment name (etcd) or `ip:port` (p2p).

use std::io::{BufRead, Write};
use std::sync::Arc;
use std::time::Duration;

use te_core::config::MapEnv;
use te_core::metadata::etcd::EtcdStore;
use te_core::metadata::p2p::{P2pConfig, P2pStore};
use te_core::{Batch, HostBufferOptions, MetadataStore, Registration, TransferEngine, TransferRequest};
use te_tests::notify_check::Parts;
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
    /// Writes then reads back every size from 1 byte to the whole slot at unaligned offsets of
    /// the peer's slot 0, one batch per size, then a batch of 10,000 small fragments; compares
    /// every byte.
    async fn sweep(&mut self, peer: &str, seed: u64) -> Result<String, String> {
        let (seg, remote) = self.remote_slot(peer, 0).await?;
        let slot = self.slot;
        let mut sizes: Vec<u64> = vec![1, 2, 7, 63, 4095, 4096, 4097, 65_537, (1 << 20) + 3];
        sizes.retain(|&n| n + 13 <= slot);
        sizes.push(slot);
        for (k, &n) in sizes.iter().enumerate() {
            let off = if n == slot { 0 } else { 1 + (k as u64 * 5) % 12 };
            let s = seed ^ n;
            fill(&self.scratch, 0, slot, s)?;
            let w = TransferRequest::write(self.scratch.addr(), seg, remote + off, n);
            self.engine
                .transfer(&[w])
                .await
                .map_err(|e| format!("write {n} B: {e}"))?;
            fill(&self.back, 0, slot, !s)?;
            let r = TransferRequest::read(self.back.addr(), seg, remote + off, n);
            self.engine
                .transfer(&[r])
                .await
                .map_err(|e| format!("read {n} B: {e}"))?;
            match mismatches(&self.back, 0, n, s)? {
                0 => {}
                bad => return Err(format!("{n} B at offset {off}: {bad} bytes differ")),
            }
        }
        // 10,000 fragments of 64 bytes, written scattered, read back gathered.
        let frag = 64u64;
        let count = (slot / frag).min(10_000);
        fill(&self.scratch, 0, slot, seed)?;
        let writes: Vec<TransferRequest> = (0..count)
            .map(|i| {
                TransferRequest::write(
                    self.scratch.addr() + i * frag,
                    seg,
                    remote + (count - 1 - i) * frag,
                    frag,
                )
            })
            .collect();
        self.engine
            .transfer(&writes)
            .await
            .map_err(|e| format!("fragment writes: {e}"))?;
        let reads: Vec<TransferRequest> = (0..count)
            .map(|i| TransferRequest::read(self.back.addr() + (count - 1 - i) * frag, seg, remote + i * frag, frag))
            .collect();
        self.engine
            .transfer(&reads)
            .await
            .map_err(|e| format!("fragment reads: {e}"))?;
        match mismatches(&self.back, 0, count * frag, seed)? {
            0 => Ok(format!("OK {} sizes, {count} fragments", sizes.len())),
            bad => Err(format!("fragments: {bad} bytes differ")),
        }
    }

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
            Some("sweep") => self.sweep(w.get(1).ok_or("missing peer")?, num(2)?).await,
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
            Some("npush") => {
                let (seg, remote) = self.remote_slot(w.get(1).ok_or("missing peer")?, num(2)?).await?;
                let (engine, scratch) = (&self.engine, &self.scratch);
                let parts = Parts {
                    slot: self.slot,
                    seed: num(3)?,
                    count: num(4)?,
                };
                te_tests::notify_check::push(engine, scratch, seg, remote, parts).await
            }
            Some("nrecv") => {
                let from = w.get(4).ok_or("missing sender")?;
                let off = num(1)? * self.slot;
                let (engine, buf) = (&self.engine, &self.buf);
                let parts = Parts {
                    slot: self.slot,
                    seed: num(2)?,
                    count: num(3)?,
                };
                te_tests::notify_check::recv(engine, buf, off, parts, from, num(5)? == 1).await
            }
            Some("ntake") => {
                te_tests::notify_check::take(&self.engine, num(1)?, w.get(2).ok_or("missing sender")?).await
            }
            Some("nbare") => te_tests::notify_check::bare(&self.engine, w.get(1).ok_or("missing peer")?, num(2)?).await,
            other => Err(format!("unknown command {other:?}")),
        }
    }
}

async fn start(o: &Opts) -> Result<(Node, String), String> {
    // The process's TE_* variables (TE_TCP_LANES...), over short timeouts suited to tests.
    let mut env = MapEnv::new([("TE_TCP_TIMEOUT_MS", "3000"), ("TE_ETCD_LEASE_TTL_S", "3")]);
    env.0.extend(std::env::vars().filter(|(k, _)| k.starts_with("TE_")));
    env.0.insert("TE_TCP_LISTEN".into(), format!("{}:0", o.ip));
    // The metadata listener proves the same key as the transports (TE_AUTH_KEY_FILE).
    let p2p_config = P2pConfig {
        auth: te_core::auth::AuthKey::from_env(&env).map_err(|e| e.to_string())?,
        ..P2pConfig::new(
            format!("{}:{}", o.ip, o.p2p_port).parse().map_err(|e| format!("{e}"))?,
            Duration::from_secs(5),
        )
    };
    let p2p = Arc::new(P2pStore::start(p2p_config).await.map_err(|e| e.to_string())?);
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
