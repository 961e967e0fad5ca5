//! What the initiator sees when a provider refuses an RMA request (a valid key with an address
//! outside its registration, or the key of a deregistered region), per provider and libfabric
//! version, as measured by `tests/refusal_probe.c` and asserted by the transport's tests on every
//! version CI runs (1.17 and 2.6).
//!
//! In every measured case the provider's key and range check holds: no byte outside the exported
//! registration is read or written. What differs is the report, and with it whether the
//! initiator can tell a refused request from a completed one.

use std::fmt;

/// How a refused request ends at the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RefusalReport {
    /// An error completion (tcp;ofi_rxm: `FI_ECANCELED`), on 1.17 and 2.6.
    ErrorCompletion,
    /// No completion at all: the transport fails the request after `TE_FABRIC_TIMEOUT_MS` and
    /// marks the peer gone (shm on libfabric 1.x: the target drops the command without answering).
    NoCompletion,
    /// A success completion although nothing moved (shm on libfabric 2.x: the target returns the
    /// command without an error flag). A refused write is dropped; a refused read leaves stale
    /// bytes of the initiator's own earlier transfers in its destination, never the target's.
    SilentSuccess,
    /// Not measured for this provider and version.
    Unmeasured,
}

impl RefusalReport {
    /// The report of `provider` (as fi_getinfo names it) on libfabric `version` (major, minor).
    pub fn of(provider: &str, version: (u32, u32)) -> RefusalReport {
        let core = crate::fabric::core_provider(provider);
        match (core, version.0) {
            // rxm forwards the tcp provider's error for the refused RMA.
            ("tcp", 1 | 2) if provider.contains("ofi_rxm") => RefusalReport::ErrorCompletion,
            ("shm", 1) => RefusalReport::NoCompletion,
            ("shm", 2) => RefusalReport::SilentSuccess,
            _ => RefusalReport::Unmeasured,
        }
    }

    /// The report of `provider` on the libfabric loaded in this process (`Unmeasured` when none is).
    pub fn of_loaded(provider: &str) -> RefusalReport {
        crate::libfabric_versions()
            .1
            .map_or(RefusalReport::Unmeasured, |v| RefusalReport::of(provider, v))
    }

    /// True when the initiator learns that the request was refused (error, or the stall timeout).
    pub fn initiator_learns(self) -> bool {
        matches!(self, RefusalReport::ErrorCompletion | RefusalReport::NoCompletion)
    }
}

impl fmt::Display for RefusalReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RefusalReport::ErrorCompletion => "refused requests fail with an error completion",
            RefusalReport::NoCompletion => {
                "refused requests never complete; the transport fails them after TE_FABRIC_TIMEOUT_MS"
            }
            RefusalReport::SilentSuccess => {
                "refused requests complete as SUCCESS: nothing is written, and a read's destination \
                 gets stale bytes of this process's own, not the target's; a write to memory the peer \
                 no longer exports looks delivered"
            }
            RefusalReport::Unmeasured => "not measured for this provider and version",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_cases() {
        assert_eq!(
            RefusalReport::of("tcp;ofi_rxm", (1, 17)),
            RefusalReport::ErrorCompletion
        );
        assert_eq!(RefusalReport::of("tcp;ofi_rxm", (2, 6)), RefusalReport::ErrorCompletion);
        assert_eq!(RefusalReport::of("shm", (1, 17)), RefusalReport::NoCompletion);
        assert_eq!(RefusalReport::of("shm", (2, 6)), RefusalReport::SilentSuccess);
        assert_eq!(RefusalReport::of("efa", (2, 6)), RefusalReport::Unmeasured);
        assert!(!RefusalReport::SilentSuccess.initiator_learns());
    }
}
