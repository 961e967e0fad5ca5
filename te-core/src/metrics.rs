//! Engine counters, and their export.
//!
//! [`MetricsSnapshot`] is the engine's own always-on counters (one update per call). Export goes
//! through the [`metrics`] facade, so the embedding process can hand the engine its
//! own recorder ([`TransferEngineBuilder::metrics_recorder`](crate::TransferEngineBuilder::metrics_recorder):
//! Prometheus, StatsD, OpenTelemetry, whatever it already runs), or set `TE_METRICS_LISTEN` and
//! the engine serves Prometheus text itself from `metrics-exporter-prometheus`'s recorder (built
//! without its hyper listener and TLS stacks; our own bounded listener serves it, see
//! [`scrape_token`] and `docs/security.md`). `prometheus-client` was the alternative; it was not
//! taken because it has no facade: an embedder would have to adopt its registry type to see our
//! metrics. With neither set (the default) nothing is exported and the data path pays one
//! `Option` check per batch.
//!
//! What is exported (names, labels, when each updates) is listed in `docs/metrics.md`.

mod config;
mod endpoint;
mod export;
mod http;
mod registrar;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub use ::metrics as facade;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use te_base::auth::AuthKey;
use te_base::{Error, Result};

pub(crate) use config::env_vars;
pub use config::{MetricsConfig, DEFAULT_MAX_PEERS, LISTEN_VAR, MAX_PEERS_VAR, TIMEOUT_VAR};
pub use endpoint::scrape_token;
pub(crate) use endpoint::Endpoint;
pub(crate) use export::{BatchRecord, Export, PeerMetrics};
pub use export::{Collector, OTHER_PEER};
pub use http::MAX_REQUEST_HEAD;
pub use registrar::Registrar;

use crate::TransferEngine;

#[derive(Debug, Default)]
pub(crate) struct Metrics {
    batches: AtomicU64,
    requests: AtomicU64,
    bytes: AtomicU64,
    failed_requests: AtomicU64,
    registration_cache_hits: AtomicU64,
    failovers: AtomicU64,
    warmed_routes: AtomicU64,
}

/// A snapshot of the engine's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Batches submitted.
    pub batches: u64,
    /// Requests submitted.
    pub requests: u64,
    /// Bytes submitted.
    pub bytes: u64,
    /// Requests that failed at submission (refused by a transport or to a lost peer).
    pub failed_requests: u64,
    /// Registrations the registration cache served: ranges inside a registered region that got
    /// a handle sharing it instead of a transport registration of their own.
    pub registration_cache_hits: u64,
    /// Requests resubmitted on another route after theirs failed (failover; each resubmission
    /// counts, so one request can count more than once).
    pub failovers: u64,
    /// Routes warm-up probed with at least one read (`TransferEngine::warm_up`, and every open
    /// with `TE_WARM_UP`).
    pub warmed_routes: u64,
}

impl Metrics {
    pub fn record_call(&self, requests: u64, bytes: u64, failed: u64) {
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.requests.fetch_add(requests, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        if failed > 0 {
            self.failed_requests.fetch_add(failed, Ordering::Relaxed);
        }
    }

    pub fn record_failover(&self, requests: u64) {
        self.failovers.fetch_add(requests, Ordering::Relaxed);
    }

    pub fn record_warmed_routes(&self, routes: u64) {
        self.warmed_routes.fetch_add(routes, Ordering::Relaxed);
    }

    pub fn record_cache_hits(&self, hits: u64) {
        self.registration_cache_hits.fetch_add(hits, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            batches: self.batches.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            failed_requests: self.failed_requests.load(Ordering::Relaxed),
            registration_cache_hits: self.registration_cache_hits.load(Ordering::Relaxed),
            failovers: self.failovers.load(Ordering::Relaxed),
            warmed_routes: self.warmed_routes.load(Ordering::Relaxed),
        }
    }
}

/// The export an engine starts with, chosen by the builder.
pub(crate) struct Setup {
    pub export: Arc<Export>,
    /// The engine's own Prometheus recorder and where to serve it (`TE_METRICS_LISTEN`).
    pub serve: Option<(SocketAddr, PrometheusHandle)>,
}

/// Chooses the export: the embedder's `recorder`, else a Prometheus endpoint when
/// `config.listen` is set, else none. Both at once is a configuration error: the embedder's
/// recorder exports, so the variable would silently do nothing.
pub(crate) fn setup(
    config: &MetricsConfig,
    recorder: Option<Arc<dyn ::metrics::Recorder + Send + Sync>>,
    transport_names: Vec<&'static str>,
) -> Result<Option<Setup>> {
    let (registrar, serve) = match (recorder, config.listen) {
        (None, None) => return Ok(None),
        (Some(_), Some(listen)) => {
            return Err(Error::config(
                LISTEN_VAR,
                listen.to_string(),
                "the embedding process supplied its own metrics recorder, which exports them",
            ))
        }
        (Some(r), None) => (Registrar::new(r), None),
        (None, Some(listen)) => {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), export::LATENCY_BUCKETS)
                .map_err(|e| Error::config(LISTEN_VAR, listen.to_string(), e.to_string()))?
                .build_recorder();
            let handle = recorder.handle();
            (Registrar::new(Arc::new(recorder)), Some((listen, handle)))
        }
    };
    let export = Arc::new(Export::new(registrar, config.max_peers, transport_names));
    Ok(Some(Setup { export, serve }))
}

/// Starts the engine's endpoint: each scrape refreshes the engine's gauges and collectors (if the
/// engine is still alive) and renders.
pub(crate) async fn serve(
    engine: &TransferEngine,
    config: &MetricsConfig,
    (listen, handle): (SocketAddr, PrometheusHandle),
    auth: Option<AuthKey>,
) -> Result<Endpoint> {
    let weak = Arc::downgrade(&engine.inner);
    let h = handle.clone();
    let render: endpoint::Render = Arc::new(move || {
        if let Some(inner) = weak.upgrade() {
            (TransferEngine { inner }).collect_metrics();
        }
        h.render()
    });
    Endpoint::start(config, listen, handle, render, auth).await
}

impl TransferEngine {
    /// Where the engine's Prometheus endpoint listens (`TE_METRICS_LISTEN`), if it has one.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.inner.metrics_endpoint.get().map(|e| e.local_addr)
    }

    /// Registers handles on the recorder the engine exports to, for a consumer (a store) that
    /// exports its own metrics next to the engine's; `None` when metrics are off.
    pub fn metrics_registrar(&self) -> Option<Registrar> {
        self.inner.export.as_ref().map(|e| e.registrar().clone())
    }

    /// Adds a collector, run by [`TransferEngine::collect_metrics`] (so on every scrape of the
    /// engine's endpoint): it refreshes a consumer's metrics from its own counters. Ignored when
    /// metrics are off. A collector must not block for long: a scrape waits for it.
    pub fn add_metrics_collector(&self, collector: Collector) {
        if let Some(e) = &self.inner.export {
            e.add_collector(collector);
        }
    }

    /// Refreshes the gauges (open segments, open connections) and runs the collectors. The
    /// engine's endpoint calls it on each scrape; an embedder with its own recorder calls it
    /// before its exporter renders.
    pub fn collect_metrics(&self) {
        if let Some(e) = &self.inner.export {
            e.collect(&self.inner.open_segments());
        }
    }
}
