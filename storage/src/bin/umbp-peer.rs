//! `umbp-peer`: one distributed-mode UMBP peer driven over standard input, one command per line,
//! one answer line each (`OK ...`, `MISS ...`, `ERR ...`). The multi-process tests start three of
//! these in network namespaces; the configuration comes from `UMBP_*`/`TE_*` variables.
//!
//! Objects are filled with a self-describing pattern: 8-byte word `i` of an object written with
//! seed `s` is `s << 32 | (i ^ SALT) as u32`, so a reader checks any 8-aligned range without
//! knowing the seed, and a range mixing two versions (or another object's bytes) is detected.
//!
//! Commands:
//! - `put KEY LEN SEED`: store an object.
//! - `get KEY OFF:LEN[,OFF:LEN...]`: ranged get into registered memory, then check every byte:
//!   `OK <bytes> <seed>`, `MISS`, `ERR <error>` or `BAD <first bad offset>`.
//! - `stream KEY N OFF:LEN[,...]`: N such gets: `OK ok=.. miss=.. err=.. bad=.. max_ms=..`.
//! - `fill PREFIX FIRST COUNT LEN`: put keys `PREFIX<i>`, i in FIRST..FIRST+COUNT, seed i + 1;
//!   `sweep PREFIX FIRST COUNT OFF:LEN[,...]`: get each once and check it is key i's bytes:
//!   `OK ok=.. miss=.. err=.. bad=.. wrong=.. last=".."` (the membership-change tests' reader).
//! - `fill-timed PREFIX FIRST COUNT LEN` and `sweep-timed PREFIX FIRST COUNT OFF:LEN[,...]`: as
//!   `fill` and `sweep`, each answer adding `max_ms=..`, the slowest single call (the fault
//!   tests' deadline check).
//! - `mget KEY,KEY,... OFF:LEN[,...]`: one get naming all the keys: `OK ms=.. KEY=SEED|miss|err|bad ...`.
//! - `churn KEY LEN N`: overwrite KEY N times, seeds 1, 2, 3 in rotation (the consistency
//!   test's writer).
//! - `owner KEY`: `OK <owner or none>`; `wait-owner KEY OWNER MS`: poll until it matches.
//! - `member-addr NAME`: `OK <control address of NAME as this peer sees it, or none>`.
//! - `remove KEY`, `stats`, `members`, `quit`.

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use umbp::{Range, RangedGet, Store};

const SALT: u32 = 0x5A5A_A5A5;

fn fill(seed: u64, offset: u64, out: &mut [u8]) {
    for (i, w) in out.chunks_exact_mut(8).enumerate() {
        let idx = offset / 8 + i as u64;
        let word = (seed << 32) | ((idx as u32) ^ SALT) as u64;
        w.copy_from_slice(&word.to_le_bytes());
    }
}

/// The seed of an 8-aligned range read from object offset `offset`, or the first bad offset.
fn check(offset: u64, bytes: &[u8]) -> Result<u64, u64> {
    let mut seed = None;
    for (i, w) in bytes.chunks_exact(8).enumerate() {
        let word = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        let idx = offset / 8 + i as u64;
        let s = word >> 32;
        if (word as u32) != (idx as u32) ^ SALT || seed.is_some_and(|x| x != s) {
            return Err(offset + 8 * i as u64);
        }
        seed = Some(s);
    }
    Ok(seed.unwrap_or(0))
}

fn parse_ranges(spec: &str) -> Option<Vec<(u64, u64)>> {
    spec.split(',')
        .map(|r| {
            let (o, l) = r.split_once(':')?;
            let (o, l) = (o.parse::<u64>().ok()?, l.parse::<u64>().ok()?);
            (o % 8 == 0 && l % 8 == 0 && l > 0).then_some((o, l))
        })
        .collect()
}

/// Caller memory registered once: gets land here.
struct Landing {
    buf: Vec<u8>,
}

enum Got {
    Ok(u64, u64),
    Miss,
    Err(String),
    Bad(u64),
}

impl Landing {
    fn get(&mut self, store: &Store, key: &str, ranges: &[(u64, u64)]) -> Got {
        self.get_many(store, &[key], ranges).remove(0)
    }

    /// One ranged get of `ranges` of every key in `keys` (one call, per-key results), each
    /// key's bytes checked.
    fn get_many(&mut self, store: &Store, keys: &[&str], ranges: &[(u64, u64)]) -> Vec<Got> {
        let per_key: u64 = ranges.iter().map(|r| r.1).sum();
        let total = per_key * keys.len() as u64;
        if total > self.buf.len() as u64 {
            let why = format!("ranges exceed the {}-byte landing buffer", self.buf.len());
            return keys.iter().map(|_| Got::Err(why.clone())).collect();
        }
        let base = self.buf.as_mut_ptr() as u64;
        let mut at = 0u64;
        let rs: Vec<Vec<Range>> = keys
            .iter()
            .map(|_| {
                ranges
                    .iter()
                    .map(|&(o, l)| {
                        let r = Range::new(o, l, base + at);
                        at += l;
                        r
                    })
                    .collect()
            })
            .collect();
        self.buf[..total as usize].fill(0);
        let gets: Vec<RangedGet> = keys
            .iter()
            .zip(&rs)
            .map(|(&key, r)| RangedGet { key, ranges: r })
            .collect();
        let results = match store.batch_get_ranges(&gets) {
            Ok(v) => v,
            Err(e) => return keys.iter().map(|_| Got::Err(e.to_string())).collect(),
        };
        let mut at = 0usize;
        results
            .into_iter()
            .map(|got| {
                let start = at;
                at += per_key as usize;
                match got {
                    Ok(n) => {
                        let mut at = start;
                        let mut seed = None;
                        for &(o, l) in ranges {
                            match check(o, &self.buf[at..at + l as usize]) {
                                Ok(s) if seed.is_none_or(|x| x == s) => seed = Some(s),
                                Ok(_) => return Got::Bad(o),
                                Err(bad) => return Got::Bad(bad),
                            }
                            at += l as usize;
                        }
                        Got::Ok(n, seed.unwrap_or(0))
                    }
                    Err(umbp::StoreError::NotFound { .. }) => Got::Miss,
                    Err(e) => Got::Err(e.to_string()),
                }
            })
            .collect()
    }
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let name = arg(&args, "--name").unwrap_or_else(|| format!("peer-{}", std::process::id()));
    let landing_bytes: usize = arg(&args, "--landing").and_then(|v| v.parse().ok()).unwrap_or(8 << 20);
    let store = match Store::builder().segment_name(name.clone()).open().await {
        Ok(s) => s,
        Err(e) => {
            println!("ERR opening the store: {e}");
            return;
        }
    };
    let mut landing = Landing {
        buf: vec![0u8; landing_bytes],
    };
    // SAFETY: `landing.buf` is never reallocated and outlives the store's use of it (the store
    // is closed before it is dropped).
    if let Err(e) = unsafe { store.register_buffer(landing.buf.as_mut_ptr() as u64, landing.buf.len() as u64) }.await {
        println!("ERR registering: {e}");
        return;
    }
    let addr = store
        .cluster_members()
        .into_iter()
        .find(|(n, _)| *n == name)
        .map(|(_, a)| a.to_string())
        .unwrap_or_default();
    println!("READY {addr}");
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    while let Some(Ok(line)) = lines.next() {
        let w: Vec<&str> = line.split_whitespace().collect();
        let answer = match w.as_slice() {
            ["put", key, len, seed] => match (len.parse::<usize>(), seed.parse::<u64>()) {
                (Ok(len), Ok(seed)) => {
                    let mut data = vec![0u8; len];
                    fill(seed, 0, &mut data);
                    match store.put(key, &data, 0).await {
                        Ok(()) => "OK".to_string(),
                        Err(e) => format!("ERR {e}"),
                    }
                }
                _ => "ERR usage: put KEY LEN SEED".into(),
            },
            ["get", key, spec] => match parse_ranges(spec) {
                Some(r) => match landing.get(&store, key, &r) {
                    Got::Ok(n, seed) => format!("OK {n} {seed}"),
                    Got::Miss => "MISS".into(),
                    Got::Err(e) => format!("ERR {e}"),
                    Got::Bad(at) => format!("BAD {at}"),
                },
                None => "ERR ranges: OFF:LEN,... (multiples of 8)".into(),
            },
            ["stream", key, n, spec] => match (n.parse::<u64>(), parse_ranges(spec)) {
                (Ok(n), Some(r)) => {
                    let (mut ok, mut miss, mut err, mut bad, mut max) = (0, 0, 0, 0, Duration::ZERO);
                    let mut last_err = String::new();
                    for _ in 0..n {
                        let t = Instant::now();
                        match landing.get(&store, key, &r) {
                            Got::Ok(..) => ok += 1,
                            Got::Miss => miss += 1,
                            Got::Err(e) => {
                                err += 1;
                                last_err = e;
                            }
                            Got::Bad(_) => bad += 1,
                        }
                        max = max.max(t.elapsed());
                    }
                    format!(
                        "OK ok={ok} miss={miss} err={err} bad={bad} max_ms={} last_err={last_err:?}",
                        max.as_millis()
                    )
                }
                _ => "ERR usage: stream KEY N OFF:LEN,...".into(),
            },
            ["fill" | "fill-timed", prefix, first, count, len] => {
                match (first.parse::<u64>(), count.parse::<u64>(), len.parse::<usize>()) {
                    // Keys PREFIX<i> for i in FIRST..FIRST+COUNT, key i holding seed i + 1.
                    (Ok(first), Ok(count), Ok(len)) => {
                        let mut data = vec![0u8; len];
                        let (mut failed, mut max) = (0, Duration::ZERO);
                        for i in first..first + count {
                            fill(i + 1, 0, &mut data);
                            let t = Instant::now();
                            if store.put(&format!("{prefix}{i}"), &data, 0).await.is_err() {
                                failed += 1;
                            }
                            max = max.max(t.elapsed());
                        }
                        if w[0] == "fill" {
                            format!("OK failed={failed}")
                        } else {
                            format!("OK failed={failed} max_ms={}", max.as_millis())
                        }
                    }
                    _ => "ERR usage: fill PREFIX FIRST COUNT LEN".into(),
                }
            }
            ["sweep" | "sweep-timed", prefix, first, count, spec] => {
                match (first.parse::<u64>(), count.parse::<u64>(), parse_ranges(spec)) {
                    // Reads each key of a `fill` once: ok (right bytes of the right version), miss,
                    // err, bad (a torn or foreign byte) or wrong (another key's bytes).
                    (Ok(first), Ok(count), Some(r)) => {
                        let (mut ok, mut miss, mut err, mut bad, mut wrong) = (0, 0, 0, 0, 0);
                        let mut last = String::new();
                        let mut max = Duration::ZERO;
                        for i in first..first + count {
                            let key = format!("{prefix}{i}");
                            let t = Instant::now();
                            let got = landing.get(&store, &key, &r);
                            max = max.max(t.elapsed());
                            match got {
                                Got::Ok(_, seed) if seed == i + 1 => ok += 1,
                                Got::Ok(..) => wrong += 1,
                                Got::Miss => {
                                    miss += 1;
                                    last = format!("{key}: miss");
                                }
                                Got::Err(e) => {
                                    err += 1;
                                    last = format!("{key}: {e}");
                                }
                                Got::Bad(_) => bad += 1,
                            }
                        }
                        let timed = if w[0] == "sweep" {
                            String::new()
                        } else {
                            format!(" max_ms={}", max.as_millis())
                        };
                        format!("OK ok={ok} miss={miss} err={err} bad={bad} wrong={wrong}{timed} last={last:?}")
                    }
                    _ => "ERR usage: sweep PREFIX FIRST COUNT OFF:LEN,...".into(),
                }
            }
            ["mget", keys, spec] => match parse_ranges(spec) {
                // One call naming several keys (of several owners, say): per key `KEY=SEED`,
                // `KEY=miss`, `KEY=bad` or `KEY=err`, and how long the call took.
                Some(r) => {
                    let keys: Vec<&str> = keys.split(',').collect();
                    let t = Instant::now();
                    let got = landing.get_many(&store, &keys, &r);
                    let ms = t.elapsed().as_millis();
                    let mut answer = format!("OK ms={ms}");
                    for (k, g) in keys.iter().zip(got) {
                        match g {
                            Got::Ok(_, seed) => answer += &format!(" {k}={seed}"),
                            Got::Miss => answer += &format!(" {k}=miss"),
                            Got::Err(_) => answer += &format!(" {k}=err"),
                            Got::Bad(_) => answer += &format!(" {k}=bad"),
                        }
                    }
                    answer
                }
                None => "ERR ranges: OFF:LEN,... (multiples of 8)".into(),
            },
            ["churn", key, len, n] => match (len.parse::<usize>(), n.parse::<u64>()) {
                (Ok(len), Ok(n)) => {
                    // Three versions in rotation, filled once: puts follow each other as fast as
                    // the store takes them, and pages reused two puts later hold other bytes.
                    let versions: Vec<Vec<u8>> = (1..=3)
                        .map(|seed| {
                            let mut d = vec![0u8; len];
                            fill(seed, 0, &mut d);
                            d
                        })
                        .collect();
                    let mut failed = 0;
                    for i in 0..n {
                        if store.put(key, &versions[(i % 3) as usize], 0).await.is_err() {
                            failed += 1;
                        }
                    }
                    format!("OK failed={failed}")
                }
                _ => "ERR usage: churn KEY LEN N".into(),
            },
            ["owner", key] => format!("OK {}", store.cluster_owner(key).unwrap_or_else(|| "none".into())),
            ["wait-owner", key, owner, ms] => {
                let limit = Duration::from_millis(ms.parse().unwrap_or(5000));
                let t = Instant::now();
                loop {
                    let now = store.cluster_owner(key).unwrap_or_else(|| "none".into());
                    if now == *owner {
                        break format!("OK {}", t.elapsed().as_millis());
                    }
                    if t.elapsed() > limit {
                        break format!("ERR owner is {now} after {} ms", limit.as_millis());
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            ["remove", key] => match store.remove(key) {
                Ok(found) => format!("OK {found}"),
                Err(e) => format!("ERR {e}"),
            },
            ["stats"] => match store.stats() {
                Ok(s) => format!("OK {s:?}"),
                Err(e) => format!("ERR {e}"),
            },
            ["members"] => {
                let mut m: Vec<String> = store.cluster_members().into_iter().map(|(n, _)| n).collect();
                m.sort();
                format!("OK {}", m.join(","))
            }
            ["member-addr", name] => format!(
                "OK {}",
                store
                    .cluster_members()
                    .into_iter()
                    .find(|(n, _)| n == name)
                    .map_or_else(|| "none".to_string(), |(_, a)| a.to_string())
            ),
            ["quit"] => break,
            _ => format!("ERR unknown command {line:?}"),
        };
        println!("{answer}");
        let _ = std::io::stdout().flush();
    }
    let _ = store.close().await;
}
