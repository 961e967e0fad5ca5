//! Transfer requests as callers write them and as transports receive them.

use crate::memory::RegionId;

/// Direction of a transfer, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransferOp {
    /// Remote memory to local memory.
    Read,
    /// Local memory to remote memory.
    Write,
}

impl std::str::FromStr for TransferOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "read" => Ok(TransferOp::Read),
            "write" => Ok(TransferOp::Write),
            _ => Err(format!("unknown op {s:?} (expected read or write)")),
        }
    }
}

impl std::fmt::Display for TransferOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransferOp::Read => "read",
            TransferOp::Write => "write",
        })
    }
}

/// Identifies an open segment within one engine (returned by `open_segment`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SegmentId(pub u32);

/// One read or write, as a caller submits it.
///
/// `local_addr` must lie in memory registered with the engine; `remote_addr` is an address inside
/// a buffer the target segment exported (its descriptor lists them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferRequest {
    /// Read or write.
    pub op: TransferOp,
    /// Local address (in registered memory).
    pub local_addr: u64,
    /// Number of bytes.
    pub len: u64,
    /// The target segment.
    pub segment: SegmentId,
    /// Address in the target's exported memory.
    pub remote_addr: u64,
}

impl TransferRequest {
    /// A read of `len` bytes from `segment` at `remote_addr` into `local_addr`.
    pub fn read(local_addr: u64, segment: SegmentId, remote_addr: u64, len: u64) -> Self {
        TransferRequest {
            op: TransferOp::Read,
            local_addr,
            len,
            segment,
            remote_addr,
        }
    }

    /// A write of `len` bytes from `local_addr` to `segment` at `remote_addr`.
    pub fn write(local_addr: u64, segment: SegmentId, remote_addr: u64, len: u64) -> Self {
        TransferRequest {
            op: TransferOp::Write,
            local_addr,
            len,
            segment,
            remote_addr,
        }
    }
}

/// A request after the engine validated and resolved both sides. What transports receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolvedRequest {
    /// Position in the caller's batch; used to report completion.
    pub index: u32,
    /// Read or write.
    pub op: TransferOp,
    /// Number of bytes (never zero).
    pub len: u64,
    /// Local address, inside `local_region`.
    pub local_addr: u64,
    /// The registered local region holding `[local_addr, +len)`.
    pub local_region: RegionId,
    /// Remote address, inside the peer descriptor's buffer `remote_buffer`.
    pub remote_addr: u64,
    /// Index of the exported buffer in the peer's descriptor.
    pub remote_buffer: u32,
}
