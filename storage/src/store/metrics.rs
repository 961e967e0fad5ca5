//! Exporting the store's counters through its engine's metrics (`TE_METRICS_LISTEN`, or the
//! recorder the embedding process gave the engine; see `te_core::metrics`).
//!
//! Nothing is counted here: the store keeps its [`StoreStats`] counters as it always does (once
//! per call, never per key), and a collector copies them into the exported counters and gauges
//! when metrics are collected (each scrape of the engine's endpoint). With metrics off the store
//! registers nothing and pays nothing.

use std::sync::Arc;

use te_core::metrics::facade::{Counter, Gauge};
use te_core::metrics::Registrar;

use te_core::TransferEngine;

use super::stats::StoreStats;
use crate::error::Result;
use crate::standalone::stats::StandaloneStats;

/// The exported handles, registered once when the store opens.
struct Handles {
    local_hits: Counter,
    remote_hits: Counter,
    misses: Counter,
    delivered: [Counter; 3],
    ssd_read: Counter,
    evictions: Counter,
    demotions: Counter,
    demotion_failures: Counter,
    promotions: Counter,
    puts_ok: Counter,
    puts_failed: Counter,
    key_handles: [Counter; 4],
    server_key_handles: [Counter; 3],
    server_key_handles_held: Gauge,
    objects: [Gauge; 2],
    used: [Gauge; 2],
    capacity: [Gauge; 2],
}

fn l(k: &'static str, v: &str) -> [(&'static str, String); 1] {
    [(k, v.to_string())]
}

impl Handles {
    fn new(r: &Registrar) -> Self {
        let tier = |name, t| r.counter(name, &l("tier", t));
        let event = |name, e| r.counter(name, &l("event", e));
        let gauge = |name, t| r.gauge(name, &l("tier", t));
        r.describe_counter(
            "umbp_hits_total",
            None,
            "Keys served, by tier (local: DRAM or SSD; remote: a peer).",
        );
        r.describe_counter("umbp_misses_total", None, "Keys of gets served by no tier and no peer.");
        r.describe_counter(
            "umbp_delivered_bytes_total",
            None,
            "Bytes delivered to callers, by tier.",
        );
        r.describe_counter(
            "umbp_ssd_read_bytes_total",
            None,
            "Bytes read from SSD files (whole blocks); over delivered SSD bytes: read amplification.",
        );
        r.describe_counter(
            "umbp_evictions_total",
            None,
            "Objects evicted from DRAM (demoted to SSD or dropped).",
        );
        r.describe_counter("umbp_key_handle_total", None, "Standalone client key-handle events.");
        Handles {
            local_hits: tier("umbp_hits_total", "local"),
            remote_hits: tier("umbp_hits_total", "remote"),
            misses: r.counter("umbp_misses_total", &[]),
            delivered: ["dram", "ssd", "remote"].map(|t| tier("umbp_delivered_bytes_total", t)),
            ssd_read: r.counter("umbp_ssd_read_bytes_total", &[]),
            evictions: r.counter("umbp_evictions_total", &[]),
            demotions: r.counter("umbp_demotions_total", &[]),
            demotion_failures: r.counter("umbp_demotion_failures_total", &[]),
            promotions: r.counter("umbp_promotions_total", &[]),
            puts_ok: r.counter("umbp_puts_total", &l("outcome", "ok")),
            puts_failed: r.counter("umbp_puts_total", &l("outcome", "failed")),
            key_handles: ["hit", "miss", "mint", "remint"].map(|e| event("umbp_key_handle_total", e)),
            server_key_handles: ["hit", "miss", "mint"].map(|e| event("umbp_server_key_handle_total", e)),
            server_key_handles_held: r.gauge("umbp_server_key_handles_held", &[]),
            objects: ["dram", "ssd"].map(|t| gauge("umbp_objects", t)),
            used: ["dram", "ssd"].map(|t| gauge("umbp_used_bytes", t)),
            capacity: ["dram", "ssd"].map(|t| gauge("umbp_capacity_bytes", t)),
        }
    }

    fn update(&self, stats: &StoreStats) {
        let s = &stats.core;
        #[cfg(feature = "cluster")]
        let (remote_hits, remote_bytes) = stats
            .cluster
            .as_ref()
            .map_or((0, 0), |c| (c.remote_hits, c.remote_bytes));
        #[cfg(not(feature = "cluster"))]
        let (remote_hits, remote_bytes) = (0, 0);
        self.local_hits.absolute(s.local_hits);
        self.remote_hits.absolute(remote_hits);
        self.misses.absolute(s.misses);
        for (c, v) in self
            .delivered
            .iter()
            .zip([s.dram_read_bytes, s.ssd_delivered_bytes, remote_bytes])
        {
            c.absolute(v);
        }
        self.ssd_read.absolute(s.ssd_read_bytes);
        self.evictions.absolute(s.demoted + s.dropped);
        self.demotions.absolute(s.demoted);
        self.demotion_failures.absolute(s.demotion_failed);
        self.promotions.absolute(s.promoted);
        self.puts_ok.absolute(s.puts_ok);
        self.puts_failed.absolute(s.puts_failed);
        if let Some(sa) = &stats.standalone {
            self.update_standalone(sa);
        }
        let pairs = [
            (&self.objects, [s.dram_objects, s.ssd_objects]),
            (&self.used, [s.dram_used_bytes, s.ssd_file_bytes]),
            (&self.capacity, [s.dram_capacity_bytes, s.ssd_capacity_bytes]),
        ];
        for (gauges, values) in pairs {
            for (g, v) in gauges.iter().zip(values) {
                g.set(v as f64);
            }
        }
    }

    fn update_standalone(&self, s: &StandaloneStats) {
        let client = [
            s.key_handle_hits,
            s.key_handle_misses,
            s.key_handle_mints,
            s.key_handle_remints,
        ];
        for (c, v) in self.key_handles.iter().zip(client) {
            c.absolute(v);
        }
        let server = [
            s.server_key_handle_hits,
            s.server_key_handle_misses,
            s.server_key_handle_mints,
        ];
        for (c, v) in self.server_key_handles.iter().zip(server) {
            c.absolute(v);
        }
        self.server_key_handles_held.set(s.server_key_handle_held as f64);
    }
}

/// Registers the store's metrics with `engine`'s recorder and a collector that refreshes them
/// from `stats` (which holds the store weakly and answers `None` once it is gone: the engine it
/// is registered on belongs to the store); nothing when the engine exports no metrics.
pub(crate) fn export(engine: &TransferEngine, stats: impl Fn() -> Option<Result<StoreStats>> + Send + Sync + 'static) {
    let Some(registrar) = engine.metrics_registrar() else {
        return;
    };
    let handles = Handles::new(&registrar);
    engine.add_metrics_collector(Arc::new(move || match stats() {
        Some(Ok(s)) => handles.update(&s),
        // A standalone server that cannot be reached leaves the gauges at their last values.
        Some(Err(e)) => tracing::debug!("store metrics not updated: {e}"),
        None => {}
    }));
}
