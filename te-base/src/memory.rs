//! Where memory lives and how registered regions are described to transports.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Where a buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MemoryLocation {
    /// Host DRAM, optionally bound to a NUMA node.
    Host {
        /// NUMA node, when known or requested.
        numa: Option<u32>,
    },
    /// CUDA device memory of device ordinal `device`.
    Cuda {
        /// Device ordinal as the CUDA runtime numbers it (after `CUDA_VISIBLE_DEVICES`).
        device: u32,
    },
    /// ROCm (HIP) device memory of device ordinal `device`.
    Rocm {
        /// Device ordinal as the HIP runtime numbers it (after `HIP_VISIBLE_DEVICES`).
        device: u32,
    },
}

impl MemoryLocation {
    /// Host memory with no NUMA preference.
    pub const HOST: MemoryLocation = MemoryLocation::Host { numa: None };

    /// The kind of memory, without the device ordinal.
    pub fn kind(&self) -> MemoryKind {
        match self {
            MemoryLocation::Host { .. } => MemoryKind::Host,
            MemoryLocation::Cuda { .. } => MemoryKind::Cuda,
            MemoryLocation::Rocm { .. } => MemoryKind::Rocm,
        }
    }

    /// True for host memory.
    pub fn is_host(&self) -> bool {
        matches!(self, MemoryLocation::Host { .. })
    }
}

impl fmt::Display for MemoryLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryLocation::Host { numa: None } => write!(f, "host"),
            MemoryLocation::Host { numa: Some(n) } => write!(f, "host:numa{n}"),
            MemoryLocation::Cuda { device } => write!(f, "cuda:{device}"),
            MemoryLocation::Rocm { device } => write!(f, "rocm:{device}"),
        }
    }
}

impl FromStr for MemoryLocation {
    type Err = String;

    /// Parses `host`, `cpu`, `host:numa1`, `cpu:1`, `cuda:0`, `rocm:3` (also `hip:3`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (kind, rest) = match s.split_once(':') {
            Some((k, r)) => (k, Some(r)),
            None => (s, None),
        };
        let ordinal = |r: &str| -> Result<u32, String> {
            r.parse::<u32>()
                .map_err(|_| format!("bad device ordinal {r:?} in {s:?}"))
        };
        match (kind, rest) {
            ("host" | "cpu", None) => Ok(MemoryLocation::HOST),
            ("host" | "cpu", Some(r)) => {
                let n = r.strip_prefix("numa").unwrap_or(r);
                Ok(MemoryLocation::Host {
                    numa: Some(ordinal(n)?),
                })
            }
            ("cuda", Some(r)) => Ok(MemoryLocation::Cuda { device: ordinal(r)? }),
            ("rocm" | "hip", Some(r)) => Ok(MemoryLocation::Rocm { device: ordinal(r)? }),
            _ => Err(format!(
                "unknown memory location {s:?} (expected host, host:numaN, cuda:N or rocm:N)"
            )),
        }
    }
}

/// The kind of memory, for capability checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryKind {
    /// Host DRAM.
    Host,
    /// CUDA device memory.
    Cuda,
    /// ROCm device memory.
    Rocm,
}

impl MemoryKind {
    const fn bit(self) -> u8 {
        match self {
            MemoryKind::Host => 1,
            MemoryKind::Cuda => 2,
            MemoryKind::Rocm => 4,
        }
    }
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MemoryKind::Host => "host",
            MemoryKind::Cuda => "cuda",
            MemoryKind::Rocm => "rocm",
        })
    }
}

/// A set of memory kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryKinds(u8);

impl MemoryKinds {
    /// No kind.
    pub const NONE: MemoryKinds = MemoryKinds(0);
    /// Host memory only.
    pub const HOST: MemoryKinds = MemoryKinds(1);

    /// Builds a set from a list.
    pub const fn of(kinds: &[MemoryKind]) -> Self {
        let mut bits = 0;
        let mut i = 0;
        while i < kinds.len() {
            bits |= kinds[i].bit();
            i += 1;
        }
        MemoryKinds(bits)
    }

    /// Adds a kind.
    pub const fn with(self, kind: MemoryKind) -> Self {
        MemoryKinds(self.0 | kind.bit())
    }

    /// True if `kind` is in the set.
    pub const fn contains(self, kind: MemoryKind) -> bool {
        self.0 & kind.bit() != 0
    }
}

/// Identifies a registered region within one engine. Never reused during the engine's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RegionId(pub u64);

/// A registered region as a transport sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfo {
    /// The engine's id of the region.
    pub id: RegionId,
    /// First byte's address in this process.
    pub base: u64,
    /// Length in bytes (never zero).
    pub len: u64,
    /// Where the memory lives (classified once, at registration).
    pub location: MemoryLocation,
    /// True if peers may read and write it (it appears in the segment descriptor).
    pub exported: bool,
}

impl RegionInfo {
    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.base + self.len
    }

    /// True if `[addr, addr + len)` lies inside the region. Overflow-safe.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.base && len <= self.len && addr - self.base <= self.len - len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn location_round_trips_through_text() {
        for loc in [
            MemoryLocation::HOST,
            MemoryLocation::Host { numa: Some(1) },
            MemoryLocation::Cuda { device: 3 },
            MemoryLocation::Rocm { device: 0 },
        ] {
            assert_eq!(loc.to_string().parse::<MemoryLocation>().unwrap(), loc);
        }
        assert!("gpu:0".parse::<MemoryLocation>().is_err());
        assert!("cuda:x".parse::<MemoryLocation>().is_err());
        assert_eq!(
            "cpu:1".parse::<MemoryLocation>().unwrap(),
            MemoryLocation::Host { numa: Some(1) }
        );
    }

    #[test]
    fn region_contains_is_overflow_safe() {
        let r = RegionInfo {
            id: RegionId(1),
            base: 100,
            len: 50,
            location: MemoryLocation::HOST,
            exported: true,
        };
        assert!(r.contains(100, 50));
        assert!(r.contains(149, 1));
        assert!(!r.contains(149, 2));
        assert!(!r.contains(99, 1));
        assert!(!r.contains(120, u64::MAX));
        assert!(!r.contains(u64::MAX, 1));
    }

    #[test]
    fn kinds_set() {
        let k = MemoryKinds::HOST.with(MemoryKind::Cuda);
        assert!(k.contains(MemoryKind::Host) && k.contains(MemoryKind::Cuda) && !k.contains(MemoryKind::Rocm));
    }
}
