//! `TE_TCP_*` configuration, read strictly (a malformed value is an error naming the variable).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use te_base::config::{parse_bytes, parse_var, Env};
use te_base::listener::ListenerLimits;
use te_base::{Error, Result};

use crate::wire::MAX_DATA_LEN;

/// Every variable this transport reads (its listener's limits included).
pub const ENV_VARS: &[&str] = &[
    "TE_TCP_LISTEN",
    "TE_TCP_ADVERTISE",
    "TE_TCP_LANES",
    "TE_TCP_SLICE_BYTES",
    "TE_TCP_THREADS",
    "TE_TCP_TIMEOUT_MS",
    "TE_TCP_MAX_CONNECTIONS",
    "TE_TCP_MAX_CONNECTIONS_PER_SOURCE",
    "TE_TCP_HANDSHAKE_TIMEOUT_MS",
    "TE_TCP_IDLE_TIMEOUT_MS",
];

/// Default listening address: every interface, a port chosen by the kernel.
pub const DEFAULT_LISTEN: &str = "0.0.0.0:0";
/// Default number of connections (lanes) per peer.
pub const DEFAULT_LANES: usize = 1;
/// Default slice size: large transfers are cut into slices of this many bytes.
pub const DEFAULT_SLICE_BYTES: u64 = 1 << 20;
/// Default time without progress after which outstanding requests to a peer fail.
pub const DEFAULT_TIMEOUT_MS: u64 = 10_000;
/// Default number of I/O threads of the transport's own runtime.
pub const DEFAULT_THREADS: usize = 2;

const MIN_SLICE_BYTES: u64 = 4096;
const MAX_LANES: usize = 64;
const MAX_THREADS: usize = 256;

/// Settings of the TCP transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpConfig {
    /// `TE_TCP_LISTEN`: where the serving side listens.
    pub listen: SocketAddr,
    /// `TE_TCP_ADVERTISE`: comma-separated IP addresses put in the descriptor instead of the
    /// interface addresses (for NAT or to pin one network).
    pub advertise: Option<Vec<IpAddr>>,
    /// `TE_TCP_LANES`: connections per peer; slices of a batch are spread over them.
    pub lanes: usize,
    /// `TE_TCP_SLICE_BYTES`: largest payload of one frame (K/M/G suffixes accepted).
    pub slice_bytes: u64,
    /// `TE_TCP_TIMEOUT_MS`: connect timeout, and how long a peer may make no progress while
    /// requests are outstanding before they fail with `PeerGone`.
    pub timeout: Duration,
    /// `TE_TCP_THREADS`: I/O threads of the transport's runtime.
    pub threads: usize,
    /// The serving side's caps and deadlines: `TE_TCP_MAX_CONNECTIONS`,
    /// `TE_TCP_MAX_CONNECTIONS_PER_SOURCE`, `TE_TCP_HANDSHAKE_TIMEOUT_MS`,
    /// `TE_TCP_IDLE_TIMEOUT_MS`; its frame timeout is `timeout`.
    pub limits: ListenerLimits,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            listen: DEFAULT_LISTEN.parse().expect("valid default listen address"),
            advertise: None,
            lanes: DEFAULT_LANES,
            slice_bytes: DEFAULT_SLICE_BYTES,
            timeout: Duration::from_millis(DEFAULT_TIMEOUT_MS),
            threads: DEFAULT_THREADS,
            limits: ListenerLimits::with_frame_timeout(Duration::from_millis(DEFAULT_TIMEOUT_MS)),
        }
    }
}

impl TcpConfig {
    /// Reads every `TE_TCP_*` variable from `env`; unset ones keep their defaults.
    pub fn from_env(env: &dyn Env) -> Result<Self> {
        let mut c = TcpConfig::default();
        if let Some(listen) = parse_var::<SocketAddr>(env, "TE_TCP_LISTEN")? {
            c.listen = listen;
        }
        if let Some(raw) = env.get("TE_TCP_ADVERTISE") {
            let ips = raw
                .split(',')
                .map(|s| s.parse::<IpAddr>())
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| Error::config("TE_TCP_ADVERTISE", &raw, format!("{e} (expected IP[,IP...])")))?;
            c.advertise = Some(ips);
        }
        if let Some(lanes) = parse_var::<usize>(env, "TE_TCP_LANES")? {
            if !(1..=MAX_LANES).contains(&lanes) {
                return Err(Error::config(
                    "TE_TCP_LANES",
                    lanes.to_string(),
                    format!("must be 1..={MAX_LANES}"),
                ));
            }
            c.lanes = lanes;
        }
        if let Some(slice) = parse_bytes(env, "TE_TCP_SLICE_BYTES")? {
            if !(MIN_SLICE_BYTES..=MAX_DATA_LEN).contains(&slice) {
                return Err(Error::config(
                    "TE_TCP_SLICE_BYTES",
                    slice.to_string(),
                    format!("must be {MIN_SLICE_BYTES}..={MAX_DATA_LEN}"),
                ));
            }
            c.slice_bytes = slice;
        }
        if let Some(ms) = parse_var::<u64>(env, "TE_TCP_TIMEOUT_MS")? {
            if ms == 0 {
                return Err(Error::config("TE_TCP_TIMEOUT_MS", "0", "must be at least 1"));
            }
            c.timeout = Duration::from_millis(ms);
        }
        if let Some(threads) = parse_var::<usize>(env, "TE_TCP_THREADS")? {
            if !(1..=MAX_THREADS).contains(&threads) {
                return Err(Error::config(
                    "TE_TCP_THREADS",
                    threads.to_string(),
                    format!("must be 1..={MAX_THREADS}"),
                ));
            }
            c.threads = threads;
        }
        c.limits = ListenerLimits::from_env(env, "TE_TCP", c.timeout)?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_base::config::MapEnv;

    #[test]
    fn defaults_and_overrides() {
        assert_eq!(TcpConfig::from_env(&MapEnv::default()).unwrap(), TcpConfig::default());
        let env = MapEnv::new([
            ("TE_TCP_LISTEN", "127.0.0.1:7000"),
            ("TE_TCP_LANES", "4"),
            ("TE_TCP_SLICE_BYTES", "256K"),
            ("TE_TCP_TIMEOUT_MS", "500"),
            ("TE_TCP_ADVERTISE", "10.0.0.1,::1"),
        ]);
        let c = TcpConfig::from_env(&env).unwrap();
        assert_eq!(c.listen, "127.0.0.1:7000".parse().unwrap());
        assert_eq!(c.lanes, 4);
        assert_eq!(c.slice_bytes, 256 << 10);
        assert_eq!(c.timeout, Duration::from_millis(500));
        assert_eq!(c.advertise.unwrap().len(), 2);
    }

    #[test]
    fn malformed_values_name_the_variable() {
        for (var, bad) in [
            ("TE_TCP_LISTEN", "nowhere"),
            ("TE_TCP_LANES", "0"),
            ("TE_TCP_LANES", "x"),
            ("TE_TCP_SLICE_BYTES", "1"),
            ("TE_TCP_SLICE_BYTES", "2G"),
            ("TE_TCP_TIMEOUT_MS", "0"),
            ("TE_TCP_ADVERTISE", "10.0.0.1,"),
            ("TE_TCP_THREADS", "0"),
            ("TE_TCP_MAX_CONNECTIONS", "0"),
            ("TE_TCP_IDLE_TIMEOUT_MS", "soon"),
        ] {
            let err = TcpConfig::from_env(&MapEnv::new([(var, bad)])).unwrap_err();
            assert!(err.to_string().contains(var), "{var}={bad}: {err}");
        }
    }
}
