//! A per-key history of puts, removes and gets (each with a start and an end tick of one global
//! counter) and its linearizability check: the model the concurrency tests hold the store to.

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

#[derive(Debug, Clone, Copy)]
pub enum Op {
    Put {
        version: u32,
    },
    Remove,
    /// `None`: NotFound.
    Get {
        saw: Option<u32>,
    },
}

#[derive(Debug, Clone, Copy)]
pub struct Event {
    pub op: Op,
    pub start: u64,
    pub end: u64,
}

pub struct Log {
    pub per_key: Vec<Mutex<Vec<Event>>>,
    pub tick: AtomicU64,
}

impl Log {
    pub fn tick(&self) -> u64 {
        self.tick.fetch_add(1, Ordering::SeqCst)
    }

    /// Runs `call` between two ticks: the tick before, its result, and the tick after.
    pub fn timed<T>(&self, call: impl FnOnce() -> T) -> (u64, T, u64) {
        let start = self.tick();
        let r = call();
        (start, r, self.tick())
    }

    pub fn push(&self, k: usize, op: Op, start: u64, end: u64) {
        self.per_key[k].lock().unwrap().push(Event { op, start, end });
    }
}

impl Log {
    /// An empty history of `keys` keys.
    pub fn new(keys: usize) -> Log {
        Log {
            per_key: (0..keys).map(|_| Mutex::new(Vec::new())).collect(),
            tick: AtomicU64::new(1),
        }
    }

    /// Every key's illegal results, and the number of gets checked.
    pub fn check(&self) -> (Vec<String>, usize) {
        let mut gets = 0usize;
        let mut stale = Vec::new();
        for (k, events) in self.per_key.iter().enumerate() {
            let events = events.lock().unwrap().clone();
            gets += events.iter().filter(|e| matches!(e.op, Op::Get { .. })).count();
            stale.extend(check_key(k, &events));
        }
        (stale, gets)
    }
}

/// Byte `o` of version `v` of key `k`, in layers of `layer` bytes: each layer starts with its tag
/// (version, layer, key; see [`tag_at`]), the rest is a position- and version-dependent pattern.
pub fn content(layer: u64, k: usize, v: u32, o: u64) -> u8 {
    let in_layer = o % layer;
    if in_layer < 12 {
        let tag = [v, (o / layer) as u32, k as u32];
        return tag[(in_layer / 4) as usize].to_le_bytes()[(in_layer % 4) as usize];
    }
    let seed = (k as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (v as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    (seed.wrapping_add(o.wrapping_mul(0x9E37_79B9_7F4A_7C15)) >> 29) as u8 ^ o as u8
}

/// The tag (version, layer, key) at the start of `b`, a layer's first 12 bytes.
pub fn tag_at(b: &[u8]) -> (u32, u32, u32) {
    let w = |i: usize| u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
    (w(0), w(1), w(2))
}

/// Fails the test with the first few of `problems` (results the run itself found wrong) or of
/// `stale` (results the history model does not allow).
pub fn assert_clean(problems: &[String], stale: &[String]) {
    for (what, list) in [("wrong", problems), ("stale", stale)] {
        assert!(
            list.is_empty(),
            "{} {what} results, first: {:?}",
            list.len(),
            &list[..list.len().min(5)]
        );
    }
}

/// Checks every get of one key against its writes; returns a line per illegal result.
pub fn check_key(k: usize, events: &[Event]) -> Vec<String> {
    let mut writes: Vec<Event> = events
        .iter()
        .copied()
        .filter(|e| !matches!(e.op, Op::Get { .. }))
        .collect();
    // The initial state: absent, as if removed before everything.
    writes.push(Event {
        op: Op::Remove,
        start: 0,
        end: 0,
    });
    let put_of: HashMap<u32, Event> = writes
        .iter()
        .filter_map(|w| match w.op {
            Op::Put { version } => Some((version, *w)),
            _ => None,
        })
        .collect();
    // For "no write both started after W ended and ended before G started": the latest start of
    // the writes that ended before a tick.
    let mut by_end: Vec<(u64, u64)> = writes.iter().map(|w| (w.end, w.start)).collect();
    by_end.sort_unstable();
    let mut max_start = Vec::with_capacity(by_end.len());
    let mut m = 0;
    for &(_, s) in &by_end {
        m = m.max(s);
        max_start.push(m);
    }
    let latest_overwrite = |before: u64| {
        let i = by_end.partition_point(|&(e, _)| e < before);
        if i == 0 {
            0
        } else {
            max_start[i - 1]
        }
    };
    let removes: Vec<Event> = writes.iter().copied().filter(|w| matches!(w.op, Op::Remove)).collect();
    let mut gets: Vec<(Event, Option<Event>)> = Vec::new();
    let mut out = Vec::new();
    for g in events.iter().filter(|e| matches!(e.op, Op::Get { .. })) {
        let Op::Get { saw } = g.op else { unreachable!() };
        let m = latest_overwrite(g.start);
        match saw {
            Some(v) => match put_of.get(&v) {
                None => out.push(format!("key {k}: get {g:?} saw v{v}, which was never put successfully")),
                Some(w) if w.start > g.end => out.push(format!("key {k}: get {g:?} saw v{v} before its put {w:?}")),
                Some(w) if m > w.end => out.push(format!(
                    "key {k}: get {g:?} saw v{v} (put {w:?}), overwritten by a write that started at {m}"
                )),
                Some(w) => gets.push((*g, Some(*w))),
            },
            None => {
                if removes.iter().any(|r| r.start < g.end && r.end >= m) {
                    gets.push((*g, None));
                } else {
                    out.push(format!(
                        "key {k}: get {g:?} saw NotFound, but a put completed after every remove"
                    ));
                }
            }
        }
    }
    // No get returns something older than what an earlier (finished) get returned.
    let mut seen: Vec<(u64, u64)> = gets.iter().filter_map(|(g, w)| w.map(|w| (g.end, w.start))).collect();
    seen.sort_unstable();
    let mut prefix = Vec::with_capacity(seen.len());
    let mut m = 0;
    for &(_, s) in &seen {
        m = m.max(s);
        prefix.push(m);
    }
    for (g, w) in &gets {
        let i = seen.partition_point(|&(e, _)| e < g.start);
        if i == 0 {
            continue;
        }
        let newest_seen_start = prefix[i - 1];
        match w {
            Some(w) if w.end < newest_seen_start => out.push(format!(
                "key {k}: get {g:?} returned the put {w:?}, older than one an earlier get returned (started {newest_seen_start})"
            )),
            None if !removes.iter().any(|r| r.start < g.end && r.end > newest_seen_start) => out.push(format!(
                "key {k}: get {g:?} returned NotFound, but an earlier get saw a put that started at {newest_seen_start} after every remove"
            )),
            _ => {}
        }
    }
    out
}
