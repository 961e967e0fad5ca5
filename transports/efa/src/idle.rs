//! How a rail's owner thread waits when idle: a setting (`TE_FABRIC_IDLE`) and a per-provider
//! default, shared by the configuration and the worker.

/// How a rail's owner thread waits when there is nothing to post or complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdleMode {
    /// Block in `fi_cq_sread`: the CQ's wait object wakes on incoming traffic (socket providers).
    Block,
    /// Keep calling `fi_cq_read`: providers whose progress engine is only driven by our calls and
    /// whose wait object does not wake for peers' operations (shm: measured, a peer's first RMA
    /// stalled with -FI_EAGAIN until our blocking read timed out).
    Poll,
}

impl IdleMode {
    /// The mode for a rail of `provider`: blocking only where the provider rides on sockets and
    /// the rail's CQ has a wait object (`cq_can_wait`).
    pub(crate) fn for_provider(provider: &str, cq_can_wait: bool) -> IdleMode {
        let core = crate::fabric::core_provider(provider);
        if cq_can_wait && matches!(core, "tcp" | "sockets" | "net" | "udp") {
            IdleMode::Block
        } else {
            IdleMode::Poll
        }
    }
}
