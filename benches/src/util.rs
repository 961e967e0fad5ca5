//! Small helpers shared by the bench commands: medians, JSON lines, runtimes.

use std::time::Duration;

/// Median of a non-empty slice of durations (upper median for even counts).
pub fn median(samples: &mut [Duration]) -> Duration {
    samples.sort_unstable();
    samples[samples.len() / 2]
}

/// p50 and p99 of `samples` (sorted in place; with fewer than 100 samples p99 is the maximum).
pub fn percentiles(samples: &mut [Duration]) -> (Duration, Duration) {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
    (at(0.50), at(0.99))
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

/// An engine in this process for the in-process benchmarks: `transports` only, tcp on loopback,
/// `provider` as `TE_FABRIC_PROVIDER`, the caller's `TE_FABRIC_*` variables and `extra` on top.
/// Its segment name is `name` made unique to this process.
pub async fn in_process_engine(
    name: &str,
    transports: &[&str],
    provider: Option<&str>,
    extra: &[(&str, &str)],
) -> Result<te_core::TransferEngine, String> {
    let mut env = te_core::config::MapEnv::new([("TE_TCP_LISTEN", "127.0.0.1:0")]);
    for (k, v) in std::env::vars().filter(|(k, _)| k.starts_with("TE_FABRIC_")) {
        env.0.insert(k, v);
    }
    if let Some(p) = provider {
        env.0.insert("TE_FABRIC_PROVIDER".into(), p.into());
    }
    for (k, v) in extra {
        env.0.insert(k.to_string(), v.to_string());
    }
    te_core::TransferEngine::builder()
        .segment_name(format!("{name}-{}", std::process::id()))
        .env(std::sync::Arc::new(env))
        .transports(transports.iter().map(|t| t.to_string()))
        .build()
        .await
        .map_err(|e| format!("starting the {name} engine with {transports:?}: {e}"))
}

/// Ends a helper process that takes line commands on its standard input: sends `quit`, gives it
/// 10 s to exit (polled: std has no wait with a timeout), then kills it. For `Drop`s, so it never
/// blocks longer than that on the child.
pub fn quit_child(child: &mut std::process::Child, stdin: &mut std::process::ChildStdin) {
    use std::io::Write;
    let _ = writeln!(stdin, "quit");
    let _ = stdin.flush();
    let end = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < end {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The lines a child writes to `stdout`, read on a thread of their own so that a caller can wait
/// for one with a deadline (`recv_timeout`) instead of blocking on the pipe.
pub fn stdout_lines(stdout: std::process::ChildStdout) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(stdout).lines() {
            let Ok(l) = l else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    lines
}

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
