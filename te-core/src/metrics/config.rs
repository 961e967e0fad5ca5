//! `TE_METRICS_*`: whether the engine exports metrics, where its Prometheus endpoint listens, the
//! endpoint's limits and the cap on peer labels. Read strictly by `build()`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use te_base::config::{parse_var, Env, LISTENER_VAR_SUFFIXES};
use te_base::listener::ListenerLimits;
use te_base::{Error, Result};

/// Where the endpoint listens: `host:port`, or a bare port (`9100`, `:9100`) for loopback.
pub const LISTEN_VAR: &str = "TE_METRICS_LISTEN";
/// How many peers get their own `peer` label (default 64); later peers share `peer="_other"`.
pub const MAX_PEERS_VAR: &str = "TE_METRICS_MAX_PEERS";
/// Longest time one scrape may take: reading the request, rendering, writing the answer.
pub const TIMEOUT_VAR: &str = "TE_METRICS_TIMEOUT_MS";
/// Prefix of the endpoint's listener limits (`TE_METRICS_MAX_CONNECTIONS`...).
pub const LISTENER_PREFIX: &str = "TE_METRICS";

/// Default [`MAX_PEERS_VAR`].
pub const DEFAULT_MAX_PEERS: usize = 64;
/// Default [`TIMEOUT_VAR`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default connection cap of the endpoint: a scraper or two, not a crowd.
pub const DEFAULT_MAX_CONNECTIONS: usize = 16;
/// Default connection cap per source address.
pub const DEFAULT_MAX_PER_SOURCE: usize = 4;

/// The variables this module reads.
pub fn env_vars() -> Vec<String> {
    let mut v: Vec<String> = [LISTEN_VAR, MAX_PEERS_VAR, TIMEOUT_VAR].map(String::from).to_vec();
    v.extend(LISTENER_VAR_SUFFIXES.iter().map(|s| format!("{LISTENER_PREFIX}{s}")));
    v
}

/// The metrics configuration of an engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsConfig {
    /// [`LISTEN_VAR`]; `None` (the default) starts no endpoint.
    pub listen: Option<SocketAddr>,
    /// [`MAX_PEERS_VAR`].
    pub max_peers: usize,
    /// [`TIMEOUT_VAR`]: a whole scrape, request to last byte of the answer.
    pub timeout: Duration,
    /// Connection caps of the endpoint (`TE_METRICS_MAX_CONNECTIONS`,
    /// `TE_METRICS_MAX_CONNECTIONS_PER_SOURCE`, `TE_METRICS_HANDSHAKE_TIMEOUT_MS`: the time a
    /// client has to send its request head).
    pub limits: ListenerLimits,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            listen: None,
            max_peers: DEFAULT_MAX_PEERS,
            timeout: DEFAULT_TIMEOUT,
            limits: default_limits(DEFAULT_TIMEOUT),
        }
    }
}

fn default_limits(timeout: Duration) -> ListenerLimits {
    ListenerLimits {
        max_connections: DEFAULT_MAX_CONNECTIONS,
        max_per_source: DEFAULT_MAX_PER_SOURCE,
        ..ListenerLimits::with_frame_timeout(timeout)
    }
}

impl MetricsConfig {
    /// Reads every `TE_METRICS_*` variable; a malformed one is `Error::Config` naming it.
    pub fn from_env(env: &dyn Env) -> Result<Self> {
        let listen = match env.get(LISTEN_VAR) {
            None => None,
            Some(raw) => Some(parse_listen(&raw)?),
        };
        let max_peers = match parse_var::<usize>(env, MAX_PEERS_VAR)? {
            None => DEFAULT_MAX_PEERS,
            Some(n) if n > 100_000 => {
                return Err(Error::config(MAX_PEERS_VAR, n.to_string(), "must be at most 100000"))
            }
            Some(n) => n,
        };
        let timeout = match parse_var::<u64>(env, TIMEOUT_VAR)? {
            None => DEFAULT_TIMEOUT,
            Some(0) => return Err(Error::config(TIMEOUT_VAR, "0", "must be at least 1")),
            Some(ms) => Duration::from_millis(ms),
        };
        // The listener's defaults are smaller than a transport's; the variables override them.
        let mut limits = ListenerLimits::from_env(env, LISTENER_PREFIX, timeout)?;
        if !set(env, 0) {
            limits.max_connections = DEFAULT_MAX_CONNECTIONS;
        }
        if !set(env, 1) {
            limits.max_per_source = DEFAULT_MAX_PER_SOURCE;
        }
        Ok(MetricsConfig {
            listen,
            max_peers,
            timeout,
            limits,
        })
    }
}

/// True when the listener variable with suffix number `i` is set.
fn set(env: &dyn Env, i: usize) -> bool {
    env.get(&format!("{LISTENER_PREFIX}{}", LISTENER_VAR_SUFFIXES[i]))
        .is_some()
}

/// `host:port`, or a bare port (`9100` or `:9100`), which binds loopback.
fn parse_listen(raw: &str) -> Result<SocketAddr> {
    let port_only = raw.strip_prefix(':').unwrap_or(raw);
    if let Ok(port) = port_only.parse::<u16>() {
        return Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port));
    }
    raw.parse::<SocketAddr>().map_err(|_| {
        Error::config(
            LISTEN_VAR,
            raw,
            "expected host:port (an IP address) or a port alone for 127.0.0.1",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_base::config::MapEnv;

    #[test]
    fn off_by_default_and_loopback_for_a_bare_port() {
        let c = MetricsConfig::from_env(&MapEnv::new([])).unwrap();
        assert_eq!(c, MetricsConfig::default());
        assert!(c.listen.is_none());
        for raw in ["9100", ":9100"] {
            let c = MetricsConfig::from_env(&MapEnv::new([(LISTEN_VAR, raw)])).unwrap();
            assert_eq!(c.listen, Some("127.0.0.1:9100".parse().unwrap()));
        }
        let c = MetricsConfig::from_env(&MapEnv::new([(LISTEN_VAR, "0.0.0.0:9")])).unwrap();
        assert_eq!(c.listen, Some("0.0.0.0:9".parse().unwrap()));
    }

    #[test]
    fn malformed_values_name_their_variable() {
        for (var, bad) in [
            (LISTEN_VAR, "localhost:x"),
            (LISTEN_VAR, ""),
            (MAX_PEERS_VAR, "-1"),
            (MAX_PEERS_VAR, "1000001"),
            (TIMEOUT_VAR, "0"),
            ("TE_METRICS_MAX_CONNECTIONS", "0"),
        ] {
            let e = MetricsConfig::from_env(&MapEnv::new([(var, bad)])).unwrap_err();
            assert!(e.to_string().contains(var), "{var}={bad}: {e}");
        }
    }

    #[test]
    fn listener_limits_default_small_and_follow_the_variables() {
        let c = MetricsConfig::from_env(&MapEnv::new([])).unwrap();
        assert_eq!(c.limits.max_connections, DEFAULT_MAX_CONNECTIONS);
        assert_eq!(c.limits.max_per_source, DEFAULT_MAX_PER_SOURCE);
        let c = MetricsConfig::from_env(&MapEnv::new([
            ("TE_METRICS_MAX_CONNECTIONS", "3"),
            ("TE_METRICS_MAX_CONNECTIONS_PER_SOURCE", "2048"),
        ]))
        .unwrap();
        assert_eq!((c.limits.max_connections, c.limits.max_per_source), (3, 2048));
    }
}
