//! The engine's exported metrics: handles per (transport, peer), kept by each connected route,
//! and per transport, updated once per batch (submit: requests and bytes; completion hook: batches, latency, failures by kind) and
//! once per registration call; gauges (open segments, open connections) and consumers' collectors
//! (UMBP's tier counters) refreshed when metrics are collected, so they cost the data path nothing.
//!
//! Peer labels are bounded: the first `max_peers` peer names get their own `peer` label, every
//! later one shares `peer="_other"` (its counts still add up there).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics::{Counter, Gauge, Histogram, Unit};
use parking_lot::Mutex;
use te_base::{BatchState, Error};

use super::Registrar;
use crate::segment::OpenSegment;

/// The `peer` label every peer past the cap shares.
pub const OTHER_PEER: &str = "_other";

/// Failure kinds, the `kind` label of `te_failed_requests_total`.
const KINDS: [&str; 9] = [
    "peer_gone",
    "timeout",
    "cancelled",
    "refused",
    "unauthenticated",
    "transport",
    "io",
    "bounds",
    "other",
];

fn kind_index(e: Option<&Error>) -> usize {
    match e {
        Some(Error::PeerGone { .. } | Error::PeerRestarted { .. }) => 0,
        Some(Error::Timeout { .. }) => 1,
        None | Some(Error::Cancelled) => 2,
        Some(Error::Refused { .. }) => 3,
        Some(Error::Unauthenticated { .. }) => 4,
        Some(Error::Transport { .. }) => 5,
        Some(Error::Io { .. }) => 6,
        Some(Error::OutOfBounds { .. } | Error::LengthOverflow { .. }) => 7,
        Some(_) => 8,
    }
}

/// Handles of one (transport, peer) label set.
pub(crate) struct PeerMetrics {
    requests: Counter,
    bytes: Counter,
    batches: Counter,
    latency: Histogram,
    failures: [Counter; KINDS.len()],
    connections: Gauge,
    /// 1 while the route is paused or probing (failover), refreshed on scrape.
    paused: Gauge,
}

/// Handles of one transport's registrations.
struct TransportMetrics {
    regions: Counter,
    failures: Counter,
    seconds: Histogram,
}

/// A consumer's collector: refreshes its own gauges and counters from its stats.
pub type Collector = Arc<dyn Fn() + Send + Sync>;

/// The engine's exported metrics.
pub(crate) struct Export {
    registrar: Registrar,
    max_peers: usize,
    transport_names: Vec<&'static str>,
    transports: Vec<TransportMetrics>,
    labelled: Mutex<Labelled>,
    open_segments: Gauge,
    cache_hits: Counter,
    /// `te_failover_total{from,to}`, registered on a pair's first failover.
    failovers: Mutex<HashMap<(usize, usize), Counter>>,
    collectors: Mutex<Vec<Collector>>,
}

#[derive(Default)]
struct Labelled {
    names: HashSet<String>,
    sets: HashMap<(usize, String), Arc<PeerMetrics>>,
}

/// Latency histogram buckets, seconds: 10 us to 10 s.
pub(crate) const LATENCY_BUCKETS: &[f64] = &[
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

impl Export {
    pub fn new(registrar: Registrar, max_peers: usize, transport_names: Vec<&'static str>) -> Self {
        describe(&registrar);
        let transports = transport_names
            .iter()
            .map(|t| {
                let l = [("transport", t.to_string())];
                TransportMetrics {
                    regions: registrar.counter("te_registered_regions_total", &l),
                    failures: registrar.counter("te_registration_failures_total", &l),
                    seconds: registrar.histogram("te_registration_seconds", &l),
                }
            })
            .collect();
        Export {
            open_segments: registrar.gauge("te_open_segments", &[]),
            cache_hits: registrar.counter("te_registration_cache_hits_total", &[]),
            registrar,
            max_peers,
            transport_names,
            transports,
            labelled: Mutex::default(),
            failovers: Mutex::default(),
            collectors: Mutex::default(),
        }
    }

    pub fn registrar(&self) -> &Registrar {
        &self.registrar
    }

    /// One registration call on transport `t`: `regions` regions, `took`, `ok`.
    pub fn registered(&self, t: usize, regions: usize, took: Duration, ok: bool) {
        let m = &self.transports[t];
        if ok {
            m.regions.increment(regions as u64);
        } else {
            m.failures.increment(1);
        }
        m.seconds.record(took.as_secs_f64());
    }

    /// `hits` ranges served by the registration cache (no transport registration of their own).
    pub fn cache_hits(&self, hits: u64) {
        self.cache_hits.increment(hits);
    }

    /// `requests` resubmitted from transport `from` to transport `to` (failover; a failure path,
    /// so the counter is looked up under a lock).
    pub fn failover(&self, from: usize, to: usize, requests: u64) {
        let mut f = self.failovers.lock();
        f.entry((from, to))
            .or_insert_with(|| {
                let labels = [
                    ("from", self.transport_names[from].to_string()),
                    ("to", self.transport_names[to].to_string()),
                ];
                self.registrar.counter("te_failover_total", &labels)
            })
            .increment(requests);
    }

    /// The label set of (transport `t`, peer `name`), registered on first use; past the cap,
    /// the shared `_other` set. Called when a route is connected; the route keeps it, so a batch
    /// finds its label set without a lookup.
    pub fn label_set(&self, t: usize, name: &str) -> Arc<PeerMetrics> {
        let mut l = self.labelled.lock();
        let peer = if l.names.contains(name) {
            name.to_string()
        } else if l.names.len() < self.max_peers {
            l.names.insert(name.to_string());
            name.to_string()
        } else {
            OTHER_PEER.to_string()
        };
        let r = &self.registrar;
        let transport = self.transport_names[t];
        l.sets
            .entry((t, peer.clone()))
            .or_insert_with(|| {
                let labels = [("transport", transport.to_string()), ("peer", peer)];
                let with_kind = |k: &str| {
                    let mut v = labels.to_vec();
                    v.push(("kind", k.to_string()));
                    r.counter("te_failed_requests_total", &v)
                };
                Arc::new(PeerMetrics {
                    requests: r.counter("te_requests_total", &labels),
                    bytes: r.counter("te_bytes_total", &labels),
                    batches: r.counter("te_batches_total", &labels),
                    latency: r.histogram("te_batch_latency_seconds", &labels),
                    failures: KINDS.map(with_kind),
                    paused: r.gauge("te_route_paused", &labels),
                    connections: r.gauge("te_open_connections", &labels),
                })
            })
            .clone()
    }

    /// Refreshes the gauges from the open segments, then runs the consumers' collectors.
    pub fn collect(&self, segments: &[Arc<OpenSegment>]) {
        self.open_segments.set(segments.len() as f64);
        let mut connections: HashMap<*const PeerMetrics, (Arc<PeerMetrics>, usize, usize)> = HashMap::new();
        for r in segments.iter().flat_map(|s| &s.routes) {
            let Some(m) = &r.metrics else { continue };
            let e = connections.entry(Arc::as_ptr(m)).or_insert((m.clone(), 0, 0));
            e.1 += usize::from(r.peer.is_healthy());
            e.2 += usize::from(r.health.is_paused());
        }
        for (m, n, paused) in connections.into_values() {
            m.connections.set(n as f64);
            m.paused.set(paused as f64);
        }
        let collectors = self.collectors.lock().clone();
        for c in collectors {
            c();
        }
    }

    pub fn add_collector(&self, c: Collector) {
        self.collectors.lock().push(c);
    }
}

/// One batch being recorded: its start and the label sets of its groups (with their request
/// indices when there are several). The first group is held inline: most batches have one, and
/// then recording allocates nothing but the completion hook.
pub(crate) struct BatchRecord {
    start: Instant,
    first: Option<Group>,
    rest: Vec<Group>,
}

/// A group's label set and, when the batch has several groups, its request indices (ascending).
type Group = (Arc<PeerMetrics>, Vec<u32>);

impl BatchRecord {
    /// Records the batch's completion from its completion hook: the one clock read at the end,
    /// the latency and batch count under each group's label set, failures by kind.
    pub fn finish(self, state: &BatchState) {
        state.on_complete(Box::new(move |s| self.complete(s)));
    }

    /// Starts recording one batch (the one clock read at submit).
    pub fn start() -> Self {
        BatchRecord {
            start: Instant::now(),
            first: None,
            rest: Vec::new(),
        }
    }

    /// Counts a group of the batch under its route's label set: its `requests` and `bytes`, and
    /// `indices` (its request indices, ascending; empty when it is the batch's only group, since
    /// every failure of the batch is then its).
    pub fn group(&mut self, metrics: &Arc<PeerMetrics>, requests: usize, bytes: u64, indices: Vec<u32>) {
        metrics.requests.increment(requests as u64);
        metrics.bytes.increment(bytes);
        match self.first {
            None => self.first = Some((metrics.clone(), indices)),
            Some(_) => self.rest.push((metrics.clone(), indices)),
        }
    }

    fn complete(self, state: &BatchState) {
        let secs = self.start.elapsed().as_secs_f64();
        for (m, _) in self.first.iter().chain(&self.rest) {
            m.batches.increment(1);
            m.latency.record(secs);
        }
        if state.succeeded() {
            return;
        }
        let groups: Vec<&Group> = self.first.iter().chain(&self.rest).collect();
        let mut counts = vec![[0u64; KINDS.len()]; groups.len()];
        state.for_each_unsuccessful(|i, e| {
            let g = match groups.len() {
                1 => 0,
                _ => match groups.iter().position(|(_, ix)| ix.binary_search(&(i as u32)).is_ok()) {
                    Some(g) => g,
                    None => return,
                },
            };
            counts[g][kind_index(e)] += 1;
        });
        for ((m, _), c) in groups.into_iter().zip(counts) {
            for (counter, n) in m.failures.iter().zip(c) {
                if n > 0 {
                    counter.increment(n);
                }
            }
        }
    }
}

fn describe(r: &Registrar) {
    r.describe_counter("te_requests_total", None, "Requests submitted, per transport and peer.");
    r.describe_counter(
        "te_bytes_total",
        Some(Unit::Bytes),
        "Bytes submitted, per transport and peer.",
    );
    r.describe_counter(
        "te_batches_total",
        None,
        "Batches completed (a batch to several peers counts under each).",
    );
    r.describe_histogram(
        "te_batch_latency_seconds",
        Some(Unit::Seconds),
        "Batch latency, submit to the last request settled.",
    );
    r.describe_counter(
        "te_failed_requests_total",
        None,
        "Requests that failed or were cancelled, by kind.",
    );
    r.describe_gauge(
        "te_open_connections",
        None,
        "Healthy connections to open segments (refreshed on scrape).",
    );
    r.describe_gauge("te_open_segments", None, "Segments this engine opened.");
    r.describe_gauge(
        "te_route_paused",
        None,
        "Routes paused after repeated errors or probing to come back (failover; refreshed on scrape).",
    );
    r.describe_counter(
        "te_failover_total",
        None,
        "Requests resubmitted on another transport after theirs failed, by from and to transport.",
    );
    r.describe_counter(
        "te_registered_regions_total",
        None,
        "Memory regions registered, per transport.",
    );
    r.describe_counter(
        "te_registration_failures_total",
        None,
        "Registration calls that failed, per transport.",
    );
    r.describe_counter(
        "te_registration_cache_hits_total",
        None,
        "Registrations that shared a registered region containing them (the registration cache).",
    );
    r.describe_histogram(
        "te_registration_seconds",
        Some(Unit::Seconds),
        "Time of one registration call on one transport.",
    );
}
