//! Small helpers shared by the bench commands: medians, JSON lines, runtimes.

use std::time::Duration;

/// Median of a non-empty slice of durations (upper median for even counts).
pub fn median(samples: &mut [Duration]) -> Duration {
    samples.sort_unstable();
    samples[samples.len() / 2]
}

/// The median over repetitions of `b[i] / a[i]`: pairs measured back to back share the machine's
/// state, so this ratio drifts less than the ratio of two medians.
pub fn paired_ratio(a: &[Duration], b: &[Duration]) -> f64 {
    let mut r: Vec<f64> = a
        .iter()
        .zip(b)
        .map(|(x, y)| y.as_secs_f64() / x.as_secs_f64())
        .collect();
    r.sort_unstable_by(f64::total_cmp);
    r.get(r.len() / 2).copied().unwrap_or(f64::NAN)
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

/// An error naming why `engine`'s transport `name` is not available, if it is not.
pub fn require_transport(engine: &te_core::TransferEngine, name: &str) -> Result<(), String> {
    match engine
        .transports()
        .iter()
        .find(|t| t.name == name)
        .and_then(|t| t.unavailable.clone())
    {
        Some(reason) => Err(format!("transport {name}: not available: {reason}")),
        None => Ok(()),
    }
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

/// What is wrong with a comma-separated list of sizes.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SizeListError {
    #[error("{item:?}: {reason}")]
    Size { item: String, reason: String },
    #[error("a size of 0 bytes")]
    Zero,
    #[error("{0} bytes is listed twice")]
    Repeated(u64),
}

/// A comma-separated list of byte sizes in the project's one size syntax
/// ([`te_core::config::parse_byte_size`]: `4K` = 4,096, `2.79MB` = 2,790,000), in the order
/// given; none zero, none repeated.
pub fn parse_sizes(list: &str) -> Result<Vec<u64>, SizeListError> {
    let mut sizes = Vec::new();
    for item in list.split(',').map(str::trim) {
        let size = te_core::config::parse_byte_size(item).map_err(|reason| SizeListError::Size {
            item: item.to_string(),
            reason,
        })?;
        if size == 0 {
            return Err(SizeListError::Zero);
        }
        if sizes.contains(&size) {
            return Err(SizeListError::Repeated(size));
        }
        sizes.push(size);
    }
    Ok(sizes)
}

pub use te_base::pattern::pattern;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_lists_use_the_project_size_parser() {
        assert_eq!(
            parse_sizes("4K,16K, 64K,256K,1M,4M").unwrap(),
            vec![4096, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
        );
        assert_eq!(parse_sizes("1728,8448,2.79MB").unwrap(), vec![1728, 8448, 2_790_000]);
        assert!(matches!(parse_sizes(""), Err(SizeListError::Size { .. })));
        assert!(matches!(parse_sizes("4K,,1M"), Err(SizeListError::Size { .. })));
        assert!(matches!(parse_sizes("4Q"), Err(SizeListError::Size { item, .. }) if item == "4Q"));
        assert!(matches!(parse_sizes("1.1K"), Err(SizeListError::Size { .. })));
        assert_eq!(parse_sizes("0,4K"), Err(SizeListError::Zero));
        assert_eq!(parse_sizes("4K,4096"), Err(SizeListError::Repeated(4096)));
    }
}
