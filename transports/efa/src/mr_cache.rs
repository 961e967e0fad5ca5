//! Keeping libfabric's memory-registration caches away from our regions, so that deregistration
//! revokes remote access before `deregister` returns (docs/efa.md, "Registration caches").
//!
//! What caches, read from libfabric's sources (1.17 to 2.6):
//! - `verbs` (under `ofi_rxm`): every `fi_mr_regattr` goes through the util MR cache when a memory
//!   monitor is active (the default). `fi_close` only returns the entry to the cache's LRU list; the
//!   `ibv_mr`, and its remote key, stay valid until the entry is evicted. Cached entries are also
//!   registered with every remote access right, whatever access was asked for. Measured on
//!   soft-RoCE: a peer's write into deregistered memory completed and its bytes landed.
//! - `efa` before 2.3: explicit registrations went through its cache (`FI_EFA_MR_CACHE_ENABLE`,
//!   on by default) when the application did not keep `FI_MR_LOCAL`; we offer `FI_MR_LOCAL` and
//!   the efa RDM provider keeps it, which leaves its cache closed. From 2.3 on, efa caches only
//!   its own internal registrations.
//! - `tcp`, `shm`, `sockets`, `udp`, `rxd`, `rxm`: no registration cache of their own.
//!
//! Two measures, either of which suffices where it applies:
//! 1. Before libfabric reads its parameters (its first `fi_getinfo` in the process, which always
//!    comes after [`settings`]), `FI_MR_CACHE_MAX_COUNT=0` (util cache off: `ofi_mr_cache_init`
//!    refuses, verbs registers directly) and `FI_EFA_MR_CACHE_ENABLE=0` are put into the
//!    environment, each only where the user has not set it. A value the user set is kept, and
//!    one that turns a cache on is logged as a warning.
//! 2. On verbs rails every registration passes libfabric's `OFI_MR_NOCACHE` flag (see
//!    `csrc/fi_shim.c`), which rxm forwards to verbs: the registration bypasses the cache even when
//!    (1) came too late (another library in the process initialised libfabric first) or the user
//!    turned the cache on.

use std::sync::OnceLock;

/// The variables set to keep registration caches off, with the value that does so.
pub const CACHE_OFF: [(&str, &str); 2] = [("FI_MR_CACHE_MAX_COUNT", "0"), ("FI_EFA_MR_CACHE_ENABLE", "0")];

/// One of [`CACHE_OFF`]'s variables as this process runs with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheSetting {
    /// The variable (`FI_MR_CACHE_MAX_COUNT`...).
    pub var: &'static str,
    /// Its value now.
    pub value: String,
    /// True when this transport set it (the user had not); false when the user's value is kept.
    pub set_here: bool,
    /// True when the value leaves a registration cache on (the user's choice; logged).
    pub cache_on: bool,
}

static SETTINGS: OnceLock<Vec<CacheSetting>> = OnceLock::new();

/// The cache variables, put into the environment (where unset) on the first call, once per
/// process. Called before every `fi_getinfo`, so before libfabric's initialisation reads them.
pub fn settings() -> &'static [CacheSetting] {
    SETTINGS.get_or_init(|| CACHE_OFF.iter().map(|&(var, off)| apply(var, off)).collect())
}

fn apply(var: &'static str, off: &str) -> CacheSetting {
    match std::env::var(var) {
        Ok(value) => {
            let cache_on = !turns_off(var, &value);
            if cache_on {
                tracing::warn!(
                    "efa: {var}={value} from the environment keeps a libfabric registration cache on: \
                     on providers that cache registrations (verbs; efa before 2.3 without FI_MR_LOCAL) \
                     a peer holding an old key may reach memory after deregistration; verbs rails \
                     still bypass the cache per registration"
                );
            }
            CacheSetting {
                var,
                value,
                set_here: false,
                cache_on,
            }
        }
        Err(_) => {
            // Process-wide, and the only write to the environment this crate makes: once (the
            // OnceLock), and before libfabric's first fi_getinfo in this process, so before any
            // thread of ours calls into libfabric. Rust's own env readers take std's env lock; a
            // C library on another thread calling getenv at this instant is the remaining risk,
            // which is why it happens once, early, at install.
            std::env::set_var(var, off);
            tracing::debug!("efa: {var}={off} set (libfabric registration caches off; see docs/efa.md)");
            CacheSetting {
                var,
                value: off.to_string(),
                set_here: true,
                cache_on: false,
            }
        }
    }
}

/// True when `value` keeps `var`'s cache off, read as libfabric reads it: the count as a number
/// (0), the boolean by `fi_parse_bool`'s false spellings (anything else leaves the default, on).
fn turns_off(var: &str, value: &str) -> bool {
    if var == "FI_MR_CACHE_MAX_COUNT" {
        return value.trim_start().parse::<u64>() == Ok(0);
    }
    value == "0" || ["false", "no", "off"].iter().any(|f| value.eq_ignore_ascii_case(f))
}

/// True when registrations on `provider` pass `OFI_MR_NOCACHE` (the verbs core provider, the one
/// that caches explicit registrations and honours the flag).
pub(crate) fn bypass_per_registration(provider: &str) -> bool {
    crate::fabric::core_provider(provider) == "verbs"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_spellings_and_bypass() {
        for v in ["0", "false", "No", "OFF"] {
            assert!(turns_off("FI_EFA_MR_CACHE_ENABLE", v), "{v}");
        }
        for v in ["1", "true", "yes", " off", "disabled"] {
            assert!(!turns_off("FI_EFA_MR_CACHE_ENABLE", v), "{v}");
        }
        assert!(turns_off("FI_MR_CACHE_MAX_COUNT", "0"));
        assert!(turns_off("FI_MR_CACHE_MAX_COUNT", "000"));
        assert!(!turns_off("FI_MR_CACHE_MAX_COUNT", "1024"));
        assert!(!turns_off("FI_MR_CACHE_MAX_COUNT", "none"));
        assert!(bypass_per_registration("verbs;ofi_rxm"));
        assert!(!bypass_per_registration("tcp;ofi_rxm"));
        assert!(!bypass_per_registration("efa"));
        assert!(!bypass_per_registration("shm"));
    }
}
