//! How a rail's owner thread waits when idle: a setting (`TE_FABRIC_IDLE`) and a per-provider
//! default, shared by the configuration and the worker.

/// How a rail's owner thread waits when there is nothing to post or complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdleMode {
    /// Block in `fi_cq_sread`: the CQ's wait object wakes on completions, and the provider serves
    /// peers without our progress calls (socket providers: the wait object wakes on their
    /// traffic; verbs: the device answers RMA itself).
    Block,
    /// Keep calling `fi_cq_read`: providers whose progress engine is only driven by our calls and
    /// whose wait object does not wake for peers' operations (shm: measured, a peer's first RMA
    /// stalled with -FI_EAGAIN until our blocking read timed out).
    Poll,
}

impl IdleMode {
    /// The mode for a rail of `provider`: blocking only where the rail's CQ has a wait object
    /// (`cq_can_wait`) and the core provider is one measured to keep serving peers while we
    /// sleep: the socket providers, and verbs (soft-RoCE, issue 30: the conformance suite passed
    /// blocking, and an idle target's CPU fell from a whole core to under 1%). Every other
    /// provider polls, efa included: whether efa serves peers while we sleep has not been
    /// measured (no EFA device here), and polling is the mode that cannot stall them.
    pub(crate) fn for_provider(provider: &str, cq_can_wait: bool) -> IdleMode {
        let core = crate::fabric::core_provider(provider);
        if cq_can_wait && matches!(core, "tcp" | "sockets" | "net" | "udp" | "verbs") {
            IdleMode::Block
        } else {
            IdleMode::Poll
        }
    }
}

#[cfg(test)]
mod tests {
    use super::IdleMode;

    #[test]
    fn providers_that_serve_peers_without_progress_calls_block_the_rest_poll() {
        for p in ["tcp;ofi_rxm", "sockets", "verbs;ofi_rxm", "net;ofi_rxm", "udp;ofi_rxd"] {
            assert_eq!(IdleMode::for_provider(p, true), IdleMode::Block, "{p}");
            assert_eq!(
                IdleMode::for_provider(p, false),
                IdleMode::Poll,
                "{p} without a wait object"
            );
        }
        for p in ["shm", "efa", "efa;ofi_rxm", "psm3", ""] {
            assert_eq!(IdleMode::for_provider(p, true), IdleMode::Poll, "{p}");
        }
    }
}
