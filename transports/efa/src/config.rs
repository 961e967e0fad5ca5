//! The transport's configuration variables, read strictly (a malformed value is an error naming the
//! variable, never a silent default).

use std::time::Duration;

use te_base::config::{parse_bytes, parse_var, Env};
use te_base::{Error, Result};

pub use crate::idle::IdleMode;

/// Every variable this transport reads.
pub const ENV_VARS: &[&str] = &[
    VAR_PROVIDER,
    VAR_DOMAINS,
    VAR_MAX_RAILS,
    VAR_TIMEOUT_MS,
    VAR_MAX_FRAGMENT,
    VAR_STRIPE,
    VAR_IDLE,
    VAR_SHM,
    VAR_LIBRARY,
];

/// Provider to use (`efa`, `tcp;ofi_rxm`, `tcp`, `shm`, `sockets`). Default: `efa`.
pub const VAR_PROVIDER: &str = "TE_FABRIC_PROVIDER";
/// Comma list of provider domains (NICs) to open rails on. Default: every non-loopback domain, or
/// the loopback ones when there is nothing else.
pub const VAR_DOMAINS: &str = "TE_FABRIC_DOMAINS";
/// At most this many rails.
pub const VAR_MAX_RAILS: &str = "TE_FABRIC_MAX_RAILS";
/// Fail a peer's outstanding requests when none of them completed for this long (milliseconds).
pub const VAR_TIMEOUT_MS: &str = "TE_FABRIC_TIMEOUT_MS";
/// Largest single RMA operation; requests above it are split. Default: the provider's max_msg_size.
pub const VAR_MAX_FRAGMENT: &str = "TE_FABRIC_MAX_FRAGMENT_BYTES";
/// Requests at least this large are striped across all rails (default 1 MiB).
pub const VAR_STRIPE: &str = "TE_FABRIC_STRIPE_BYTES";
/// How a rail's owner thread waits when idle: `block` (in fi_cq_sread) or `poll` (keep progressing).
/// Default: `block` on socket providers, `poll` elsewhere.
pub const VAR_IDLE: &str = "TE_FABRIC_IDLE";
/// Whether intra-node traffic may go through shared memory: `allow` (default) or `deny`. With
/// `deny` every endpoint gets `FI_OPT_SHARED_MEMORY_PERMITTED = false` before it is enabled, so
/// the efa provider keeps peers on the same node on the NIC instead of handing them to its shm
/// peer provider (a loaded libfabric >= 1.18; the environment variable
/// `FI_EFA_ENABLE_SHM_TRANSFER=0` does the same for the whole process on any version). The `shm`
/// provider itself cannot be combined with `deny`.
pub const VAR_SHM: &str = "TE_FABRIC_SHM";

/// The libfabric to load: a path to `libfabric.so.1` (or any name `dlopen` accepts), tried alone.
/// Unset: [`crate::library::DEFAULT_SEARCH`] in order (`/opt/amazon/efa/lib`, `lib64`, then the
/// dynamic loader's search for `libfabric.so.1`). Read from the process environment when libfabric
/// is first needed; one library serves the whole process.
pub const VAR_LIBRARY: &str = "TE_FABRIC_LIBRARY";

/// Parsed configuration.
#[derive(Debug, Clone)]
pub struct FabricConfig {
    /// Provider name as given to fi_getinfo.
    pub provider: String,
    /// True when the provider came from the default rather than the environment.
    pub provider_defaulted: bool,
    /// Explicit domain selection.
    pub domains: Option<Vec<String>>,
    /// Rail cap.
    pub max_rails: usize,
    /// Stall timeout of a peer's outstanding operations.
    pub timeout: Duration,
    /// Cap on one RMA operation's size, if set.
    pub max_fragment: Option<u64>,
    /// Striping threshold.
    pub stripe_bytes: u64,
    /// Idle mode override.
    pub idle: Option<IdleMode>,
    /// Shared memory for intra-node peers permitted ([`VAR_SHM`]).
    pub shm_permitted: bool,
}

impl FabricConfig {
    /// Reads every variable from `env`.
    pub fn from_env(env: &dyn Env) -> Result<Self> {
        let provider: Option<String> = parse_var(env, VAR_PROVIDER)?;
        let domains = match env.get(VAR_DOMAINS) {
            None => None,
            Some(raw) => {
                let list: Vec<String> = raw.split(',').map(|s| s.to_string()).collect();
                if list.iter().any(|d| d.is_empty() || d.trim() != d) {
                    return Err(Error::config(
                        VAR_DOMAINS,
                        raw,
                        "expected a comma list of domain names without spaces",
                    ));
                }
                Some(list)
            }
        };
        let max_rails: usize = parse_var(env, VAR_MAX_RAILS)?.unwrap_or(crate::wire::MAX_RAILS);
        if max_rails == 0 || max_rails > crate::wire::MAX_RAILS {
            return Err(Error::config(
                VAR_MAX_RAILS,
                max_rails.to_string(),
                format!("must be 1..={}", crate::wire::MAX_RAILS),
            ));
        }
        let timeout_ms: u64 = parse_var(env, VAR_TIMEOUT_MS)?.unwrap_or(3000);
        if timeout_ms == 0 {
            return Err(Error::config(VAR_TIMEOUT_MS, "0", "must be at least 1"));
        }
        let max_fragment = parse_bytes(env, VAR_MAX_FRAGMENT)?;
        if max_fragment == Some(0) {
            return Err(Error::config(VAR_MAX_FRAGMENT, "0", "must be at least 1 byte"));
        }
        let stripe_bytes = parse_bytes(env, VAR_STRIPE)?.unwrap_or(1 << 20);
        if stripe_bytes == 0 {
            return Err(Error::config(VAR_STRIPE, "0", "must be at least 1 byte"));
        }
        let idle = match env.get(VAR_IDLE).as_deref() {
            None => None,
            Some("block") => Some(IdleMode::Block),
            Some("poll") => Some(IdleMode::Poll),
            Some(other) => return Err(Error::config(VAR_IDLE, other, "expected block or poll")),
        };
        let shm_permitted = match env.get(VAR_SHM).as_deref() {
            None | Some("allow") => true,
            Some("deny") => false,
            Some(other) => return Err(Error::config(VAR_SHM, other, "expected allow or deny")),
        };
        if !shm_permitted && provider.as_deref() == Some("shm") {
            return Err(Error::config(
                VAR_SHM,
                "deny",
                format!("contradicts {VAR_PROVIDER}=shm (choose another provider to keep traffic off shm)"),
            ));
        }
        Ok(FabricConfig {
            idle,
            shm_permitted,
            provider_defaulted: provider.is_none(),
            provider: provider.unwrap_or_else(|| "efa".to_string()),
            domains,
            max_rails,
            timeout: Duration::from_millis(timeout_ms),
            max_fragment,
            stripe_bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use te_base::config::MapEnv;

    use super::*;

    #[test]
    fn defaults_and_strictness() {
        let c = FabricConfig::from_env(&MapEnv::new([])).unwrap();
        assert_eq!(c.provider, "efa");
        assert!(c.provider_defaulted);
        assert_eq!(c.stripe_bytes, 1 << 20);
        let c = FabricConfig::from_env(&MapEnv::new([
            (VAR_PROVIDER, "tcp;ofi_rxm"),
            (VAR_DOMAINS, "lo,eth0"),
            (VAR_MAX_FRAGMENT, "64K"),
        ]))
        .unwrap();
        assert_eq!(c.provider, "tcp;ofi_rxm");
        assert_eq!(c.domains.as_deref(), Some(&["lo".to_string(), "eth0".to_string()][..]));
        assert_eq!(c.max_fragment, Some(65536));
        for (var, bad) in [
            (VAR_PROVIDER, ""),
            (VAR_DOMAINS, "lo,,eth0"),
            (VAR_DOMAINS, "lo, eth0"),
            (VAR_MAX_RAILS, "0"),
            (VAR_MAX_RAILS, "65"),
            (VAR_MAX_RAILS, "two"),
            (VAR_TIMEOUT_MS, "-5"),
            (VAR_MAX_FRAGMENT, "0"),
            (VAR_STRIPE, "1X"),
            (VAR_IDLE, "sleep"),
            (VAR_SHM, "off"),
        ] {
            let err = FabricConfig::from_env(&MapEnv::new([(var, bad)])).unwrap_err();
            assert!(err.to_string().contains(var), "{var}={bad:?}: {err}");
        }
        assert!(c.shm_permitted);
        let deny = FabricConfig::from_env(&MapEnv::new([(VAR_SHM, "deny")])).unwrap();
        assert!(!deny.shm_permitted);
        let err = FabricConfig::from_env(&MapEnv::new([(VAR_SHM, "deny"), (VAR_PROVIDER, "shm")])).unwrap_err();
        assert!(err.to_string().contains(VAR_SHM), "{err}");
    }
}
