//! Buffer shapes a rank registers: presets and explicit size lists.

use std::fmt;

/// One pool's worth of buffers as the server passes them.
#[derive(Debug, Clone)]
pub struct PoolShape {
    /// What the pool holds.
    pub name: &'static str,
    /// Buffers in the pool.
    pub count: usize,
    /// Bytes per buffer.
    pub size: u64,
}

/// The kimi-k3 preset: 182 buffers per rank from 2.5 KB to 391 MB, grouped by pool in the order an
/// SGLang-style server registers them. The seed reports the count, the extremes and a 2.79 MB
/// buffer; the split between pools is our approximation of an MLA model's per-layer caches.
pub const KIMI_K3: [PoolShape; 4] = [
    PoolShape {
        name: "per-layer scales",
        count: 52,
        size: 2_560,
    },
    PoolShape {
        name: "indexer keys",
        count: 61,
        size: 2_790_000,
    },
    PoolShape {
        name: "latent KV",
        count: 61,
        size: 391_000_000,
    },
    PoolShape {
        name: "sliding-window state",
        count: 8,
        size: 24_000_000,
    },
];

/// The sizes of a shape, in the order the server passes them.
pub fn expand(pools: &[PoolShape]) -> Vec<u64> {
    pools
        .iter()
        .flat_map(|p| std::iter::repeat_n(p.size, p.count))
        .collect()
}

/// Parses a size list: entries separated by commas, whitespace or newlines, each `SIZE` or
/// `COUNTxSIZE`; `#` starts a comment. SIZE is a byte size as every size in the engine is read
/// (`te_core::config::parse_byte_size`: K/M/G/T and KiB.. are powers of 1024, KB/MB/GB/TB of 1000;
/// decimals allowed where the result is whole, `2.79MB`).
pub fn parse_sizes(text: &str) -> Result<Vec<u64>, String> {
    let mut sizes = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("");
        for entry in line
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|e| !e.is_empty())
        {
            let (count, size) = match entry.split_once(['x', '*']) {
                Some((n, s)) => (
                    n.parse::<usize>()
                        .map_err(|_| format!("bad count in size entry {entry:?}"))?,
                    s,
                ),
                None => (1, entry),
            };
            let bytes = parse_size(size)?;
            if bytes == 0 {
                return Err(format!("size entry {entry:?} is zero bytes"));
            }
            if count == 0 || count > 1_000_000 {
                return Err(format!("count in size entry {entry:?} must be 1..=1000000"));
            }
            sizes.extend(std::iter::repeat_n(bytes, count));
        }
    }
    if sizes.is_empty() {
        return Err("the size list is empty".into());
    }
    Ok(sizes)
}

/// Parses one size: te-core's one byte-size grammar (`4K` is 4096, `2.79MB` is 2,790,000).
pub fn parse_size(text: &str) -> Result<u64, String> {
    te_core::config::parse_byte_size(text).map_err(|e| format!("bad size {text:?}: {e}"))
}

/// Human-readable bytes (decimal units, as the seed quotes them).
pub struct Bytes(pub u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0 as f64;
        if b >= 1e9 {
            write!(f, "{:.2} GB", b / 1e9)
        } else if b >= 1e6 {
            write!(f, "{:.2} MB", b / 1e6)
        } else if b >= 1e3 {
            write!(f, "{:.1} KB", b / 1e3)
        } else {
            write!(f, "{} B", self.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kimi_k3_has_the_seed_shape() {
        let sizes = expand(&KIMI_K3);
        assert_eq!(sizes.len(), 182);
        assert_eq!(*sizes.iter().min().unwrap(), 2_560);
        assert_eq!(*sizes.iter().max().unwrap(), 391_000_000);
    }

    #[test]
    fn size_lists_parse_and_reject_garbage() {
        assert_eq!(
            parse_sizes("2x4K, 2.79MB\n# comment\n1GiB, 4KB").unwrap(),
            vec![4096, 4096, 2_790_000, 1 << 30, 4000]
        );
        for bad in ["", "0", "3xx", "12Q", "-5", "0x4K", "abc"] {
            assert!(parse_sizes(bad).is_err(), "{bad:?}");
        }
    }
}
