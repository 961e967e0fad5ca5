//! Registering metric handles with a recorder of the `metrics` facade: the engine's own
//! Prometheus recorder (`TE_METRICS_LISTEN`) or one the embedding process supplied. Handles are
//! registered once, on the control plane; the data path only bumps them.

use std::sync::Arc;

use metrics::{Counter, Gauge, Histogram, Key, Label, Level, Metadata, Recorder, SharedString, Unit};

/// Registers handles on one recorder. Cheap to clone.
///
/// ```
/// # use std::sync::Arc;
/// let recorder = Arc::new(metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder());
/// let handle = recorder.handle();
/// let r = te_core::metrics::Registrar::new(recorder);
/// r.counter("store_hits_total", &[("tier", "dram".into())]).increment(2);
/// assert!(handle.render().contains("store_hits_total{tier=\"dram\"} 2"));
/// ```
#[derive(Clone)]
pub struct Registrar {
    recorder: Arc<dyn Recorder + Send + Sync>,
}

impl std::fmt::Debug for Registrar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Registrar")
    }
}

const METADATA: Metadata<'static> = Metadata::new("te_core", Level::INFO, Some(module_path!()));

fn key(name: &'static str, labels: &[(&'static str, String)]) -> Key {
    let labels: Vec<Label> = labels.iter().map(|(k, v)| Label::new(*k, v.clone())).collect();
    Key::from_parts(name, labels)
}

impl Registrar {
    /// Registers on `recorder`.
    pub fn new(recorder: Arc<dyn Recorder + Send + Sync>) -> Self {
        Registrar { recorder }
    }

    /// A counter named `name` with these labels.
    pub fn counter(&self, name: &'static str, labels: &[(&'static str, String)]) -> Counter {
        self.recorder.register_counter(&key(name, labels), &METADATA)
    }

    /// A gauge named `name` with these labels.
    pub fn gauge(&self, name: &'static str, labels: &[(&'static str, String)]) -> Gauge {
        self.recorder.register_gauge(&key(name, labels), &METADATA)
    }

    /// A histogram named `name` with these labels.
    pub fn histogram(&self, name: &'static str, labels: &[(&'static str, String)]) -> Histogram {
        self.recorder.register_histogram(&key(name, labels), &METADATA)
    }

    /// Describes a counter (its `# HELP` line).
    pub fn describe_counter(&self, name: &'static str, unit: Option<Unit>, help: &'static str) {
        self.recorder
            .describe_counter(name.into(), unit, SharedString::const_str(help));
    }

    /// Describes a gauge.
    pub fn describe_gauge(&self, name: &'static str, unit: Option<Unit>, help: &'static str) {
        self.recorder
            .describe_gauge(name.into(), unit, SharedString::const_str(help));
    }

    /// Describes a histogram.
    pub fn describe_histogram(&self, name: &'static str, unit: Option<Unit>, help: &'static str) {
        self.recorder
            .describe_histogram(name.into(), unit, SharedString::const_str(help));
    }
}
