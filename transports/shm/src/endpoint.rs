//! What a target advertises in its segment descriptor, and the host identity that decides
//! whether two engines can reach each other by cross-memory attach.

use std::os::unix::fs::MetadataExt;

use serde::{Deserialize, Serialize};
use te_base::{Error, Result, SegmentDescriptor};

/// The host and pid namespace a process runs in: the kernel's boot id, and the inode of its pid
/// namespace. Two processes with equal identities share one kernel and one pid numbering, which
/// cross-memory attach needs (it names the target by pid).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostIdentity {
    /// `/proc/sys/kernel/random/boot_id`.
    pub boot_id: String,
    /// Inode of `/proc/self/ns/pid`.
    pub pid_ns: u64,
}

impl HostIdentity {
    /// This process's identity.
    pub fn current() -> Result<HostIdentity> {
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map_err(|e| Error::not_available("shm", format!("cannot read the boot id: {e}")))?
            .trim()
            .to_string();
        let pid_ns = std::fs::metadata("/proc/self/ns/pid")
            .map_err(|e| Error::not_available("shm", format!("cannot read the pid namespace: {e}")))?
            .ino();
        Ok(HostIdentity { boot_id, pid_ns })
    }
}

/// The `shm` entry of a segment descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmEndpoint {
    /// Where the target runs.
    pub host: HostIdentity,
    /// The target's pid (checked against the socket's peer credentials on connect).
    pub pid: u32,
    /// The target's uid.
    pub uid: u32,
    /// Random per transport start: a restarted target at the same socket is told apart.
    pub token: u64,
    /// The control socket: a filesystem path, or `@name` for an abstract socket.
    pub socket: String,
    /// Device memory (CUDA/HIP IPC handles) is where a later version would advertise what it
    /// serves; this one serves host memory only and says so.
    #[serde(default)]
    pub device_ipc: Option<serde_json::Value>,
}

impl ShmEndpoint {
    /// The endpoint `peer` advertises for `shm`, validated.
    pub fn of(peer: &SegmentDescriptor) -> Result<ShmEndpoint> {
        let info = peer.endpoint("shm").ok_or_else(|| Error::NoTransport {
            segment: peer.name.clone(),
            reason: "it does not advertise the shm transport".into(),
        })?;
        let ep: ShmEndpoint = serde_json::from_value(info.clone())
            .map_err(|e| Error::InvalidDescriptor(format!("shm endpoint of {}: {e}", peer.name)))?;
        if ep.socket.is_empty() || ep.socket.len() > 107 || ep.pid == 0 {
            return Err(Error::InvalidDescriptor(format!(
                "shm endpoint of {}: bad socket name or pid",
                peer.name
            )));
        }
        Ok(ep)
    }
}
