//! The keys a segment publishes for each exported buffer, per rail, and their lookup.
//!
//! `ExportedBuffer.keys["rdma"]` is `{"chunk": <bytes>, "rails": [{"rail": 2, "rate_mbps": ...},
//! ...], "rkeys": [[chunk rkeys of rails[0]], [of rails[1]], ...]}`: the buffer is registered on
//! the rails listed (te-base's [`BufferRails`] form: ascending, no duplicates), split at `chunk`
//! bytes, and the `i`-th listed rail's chunk `c` has rkey `rkeys[i][c]`. Parsed and validated
//! once per connection into a table the data path indexes without allocation.

use serde::{Deserialize, Serialize};
use te_base::{Error, Result, SegmentDescriptor};
use te_topology::{BufferRails, RailRate};

use super::mr_split::{chunk_count, MIN_CHUNK};
use super::slicing::ChunkGrid;

/// The per-buffer key object, as published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferKeys {
    /// Split size of the registration.
    pub chunk: u64,
    /// The rails holding the buffer, ascending, with their link rates.
    pub rails: Vec<RailRate>,
    /// `rkeys[i][chunk]` for rail `rails[i]`.
    pub rkeys: Vec<Vec<u32>>,
}

/// One parsed buffer: its grid, length, rails and keys.
#[derive(Debug, Clone)]
struct RemoteBuffer {
    grid: ChunkGrid,
    len: u64,
    rails: BufferRails,
    rkeys: Vec<Vec<u32>>,
}

/// Remote keys of every exported buffer of one peer.
#[derive(Debug, Clone, Default)]
pub struct RemoteKeyTable {
    /// Indexed like the descriptor's buffers; `None` for buffers without rdma keys.
    buffers: Vec<Option<RemoteBuffer>>,
}

/// Why a remote lookup failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyMiss {
    /// No such buffer, or it has no rdma keys.
    NoBuffer,
    /// The range is not inside the buffer.
    OutOfBounds,
    /// The buffer is not registered on that rail.
    NoRail,
}

impl RemoteKeyTable {
    /// Parses the keys of every buffer of `desc`. Buffers without an `rdma` entry are kept as
    /// unreachable; a malformed entry is an error naming the buffer.
    pub fn from_descriptor(desc: &SegmentDescriptor, transport: &str) -> Result<Self> {
        let mut buffers = Vec::with_capacity(desc.buffers.len());
        for (i, b) in desc.buffers.iter().enumerate() {
            let Some(v) = b.keys.get(transport) else {
                buffers.push(None);
                continue;
            };
            let bad = |why: String| Error::InvalidDescriptor(format!("rdma keys of buffer {i}: {why}"));
            let keys: BufferKeys = serde_json::from_value(v.clone()).map_err(|e| bad(e.to_string()))?;
            if keys.chunk < MIN_CHUNK || keys.chunk & (MIN_CHUNK - 1) != 0 {
                return Err(bad(format!("chunk {} is not a positive multiple of 4 KiB", keys.chunk)));
            }
            if keys.rails.is_empty() || keys.rails.len() > super::handshake::MAX_RAILS {
                return Err(bad(format!("{} rails", keys.rails.len())));
            }
            let rails =
                BufferRails::from_value(&serde_json::json!({ "rails": keys.rails })).map_err(|e| bad(e.to_string()))?;
            if keys.rkeys.len() != keys.rails.len() {
                return Err(bad(format!(
                    "{} rails but {} rkey lists",
                    keys.rails.len(),
                    keys.rkeys.len()
                )));
            }
            let chunks = chunk_count(b.len, keys.chunk);
            if let Some(r) = keys.rkeys.iter().position(|k| k.len() as u64 != chunks) {
                return Err(bad(format!(
                    "rail {} lists {} rkeys for {chunks} chunks",
                    keys.rails[r].rail,
                    keys.rkeys[r].len()
                )));
            }
            let grid = ChunkGrid {
                base: b.base,
                chunk: keys.chunk,
            };
            buffers.push(Some(RemoteBuffer {
                grid,
                len: b.len,
                rails,
                rkeys: keys.rkeys,
            }));
        }
        Ok(RemoteKeyTable { buffers })
    }

    /// The rails the peer registered buffer `buffer` on, ascending (empty for an unknown buffer).
    pub fn rails(&self, buffer: usize) -> &[RailRate] {
        self.buffers
            .get(buffer)
            .and_then(|b| b.as_ref())
            .map_or(&[], |b| b.rails.rates())
    }

    /// The chunk grid of buffer `buffer`, after checking `[addr, addr + len)` lies inside it.
    pub fn grid(&self, buffer: usize, addr: u64, len: u64) -> std::result::Result<ChunkGrid, KeyMiss> {
        let b = self
            .buffers
            .get(buffer)
            .and_then(|b| b.as_ref())
            .ok_or(KeyMiss::NoBuffer)?;
        let grid = b.grid;
        let inside = addr >= grid.base && len <= b.len && addr - grid.base <= b.len - len;
        if !inside {
            return Err(KeyMiss::OutOfBounds);
        }
        Ok(grid)
    }

    /// The rkey of the chunk holding `addr` in buffer `buffer` on remote rail `rail`. `addr` must
    /// have passed [`RemoteKeyTable::grid`].
    pub fn rkey(&self, buffer: usize, rail: usize, addr: u64) -> std::result::Result<u32, KeyMiss> {
        let b = self
            .buffers
            .get(buffer)
            .and_then(|b| b.as_ref())
            .ok_or(KeyMiss::NoBuffer)?;
        let chunk = ((addr - b.grid.base) / b.grid.chunk) as usize;
        let position = b
            .rails
            .rates()
            .binary_search_by_key(&rail, |r| r.rail)
            .map_err(|_| KeyMiss::NoRail)?;
        b.rkeys[position].get(chunk).copied().ok_or(KeyMiss::OutOfBounds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_base::{ExportedBuffer, MemoryLocation};

    fn desc(keys: serde_json::Value) -> SegmentDescriptor {
        let mut d = SegmentDescriptor::new("peer", 1);
        d.buffers.push(ExportedBuffer {
            base: 0x10_0000,
            len: 3 * 4096,
            location: MemoryLocation::HOST,
            keys: [("rdma".to_string(), keys)].into_iter().collect(),
        });
        d.buffers.push(ExportedBuffer {
            base: 0x20_0000,
            len: 4096,
            location: MemoryLocation::HOST,
            keys: Default::default(),
        });
        d
    }

    #[test]
    fn looks_up_the_key_of_each_rail_and_chunk() {
        let d = desc(serde_json::json!({
            "chunk": 4096,
            "rails": [{"rail": 1, "rate_mbps": 100}, {"rail": 3, "rate_mbps": 200}],
            "rkeys": [[10, 11, 12], [20, 21, 22]],
        }));
        let t = RemoteKeyTable::from_descriptor(&d, "rdma").unwrap();
        let listed: Vec<usize> = t.rails(0).iter().map(|r| r.rail).collect();
        assert_eq!(listed, [1, 3]);
        assert!(t.rails(1).is_empty() && t.rails(9).is_empty());
        assert_eq!(t.rkey(0, 1, 0x10_0000).unwrap(), 10);
        assert_eq!(t.rkey(0, 3, 0x10_0000 + 4096).unwrap(), 21);
        assert_eq!(t.rkey(0, 3, 0x10_0000 + 3 * 4096 - 1).unwrap(), 22);
        assert_eq!(t.rkey(0, 0, 0x10_0000), Err(KeyMiss::NoRail), "rail not listed");
        assert_eq!(t.rkey(0, 2, 0x10_0000), Err(KeyMiss::NoRail));
        assert!(t.grid(0, 0x10_0000 + 100, 3 * 4096 - 100).is_ok());
        assert_eq!(t.grid(0, 0x10_0000 + 100, 3 * 4096), Err(KeyMiss::OutOfBounds));
        assert_eq!(t.grid(0, 0x0f_ffff, 2), Err(KeyMiss::OutOfBounds));
        assert_eq!(t.grid(1, 0x20_0000, 1), Err(KeyMiss::NoBuffer), "no rdma keys");
        assert_eq!(t.grid(7, 0x20_0000, 1), Err(KeyMiss::NoBuffer));
    }

    #[test]
    fn malformed_keys_are_descriptor_errors() {
        for bad in [
            serde_json::json!({"chunk": 4096, "rails": [{"rail": 0, "rate_mbps": 0}], "rkeys": [[10, 11]]}),
            serde_json::json!({"chunk": 100, "rails": [{"rail": 0, "rate_mbps": 0}], "rkeys": [[10]]}),
            serde_json::json!({"chunk": 4096, "rails": [], "rkeys": []}),
            serde_json::json!({"chunk": 4096, "rkeys": [[1, 2, 3]]}),
            serde_json::json!({"chunk": 4096, "rails": [{"rail": 0, "rate_mbps": 0}], "rkeys": [[1, 2, 3], [4, 5, 6]]}),
            serde_json::json!({"chunk": 4096, "rails": [{"rail": 2, "rate_mbps": 0}, {"rail": 1, "rate_mbps": 0}], "rkeys": [[1, 2, 3], [4, 5, 6]]}),
            serde_json::json!({"chunk": 4096, "rails": [{"rail": 1, "rate_mbps": 0}, {"rail": 1, "rate_mbps": 0}], "rkeys": [[1, 2, 3], [4, 5, 6]]}),
            serde_json::json!({"rails": [{"rail": 0, "rate_mbps": 0}], "rkeys": [[1, 2, 3]]}),
            serde_json::json!("nope"),
        ] {
            let err = RemoteKeyTable::from_descriptor(&desc(bad.clone()), "rdma").unwrap_err();
            assert!(matches!(err, Error::InvalidDescriptor(_)), "{bad}: {err}");
        }
    }
}
