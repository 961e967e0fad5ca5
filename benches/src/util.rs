//! Small helpers shared by the bench commands: medians, JSON lines, runtimes.

use std::time::Duration;

/// Median of a non-empty slice of durations (upper median for even counts).
pub fn median(samples: &mut [Duration]) -> Duration {
    samples.sort_unstable();
    samples[samples.len() / 2]
}

/// Prints one JSON object per line.
pub fn print_json(v: &serde_json::Value) {
    println!("{}", serde_json::to_string(v).unwrap_or_default());
}

/// A multi-threaded tokio runtime for the engine's control plane.
pub fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))
}

/// Parses a comma-separated list of numbers.
pub fn parse_list<T: std::str::FromStr>(s: &str) -> Result<Vec<T>, String> {
    s.split(',')
        .map(|x| {
            x.trim()
                .parse::<T>()
                .map_err(|_| format!("bad list element {x:?} in {s:?}"))
        })
        .collect()
}

pub use te_base::pattern::pattern;
