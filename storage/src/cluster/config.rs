//! Settings of distributed mode, from `UMBP_CLUSTER*` variables or the builder.
//!
//! | variable | default | meaning |
//! | --- | --- | --- |
//! | `UMBP_CLUSTER` | unset (local mode) | `etcd://host:port[,host:port...][/prefix]`: etcd endpoints and the key prefix separating clusters (default prefix `/umbp`) |
//! | `UMBP_CLUSTER_LISTEN` | `127.0.0.1:0` | address of this peer's control listener (an IP other peers reach) |
//! | `UMBP_CLUSTER_LEASE_TTL_S` | 10 | membership lease: a dead peer's keys stop being routed to it within this |
//! | `UMBP_CLUSTER_TIMEOUT_MS` | 3000 | bound of one etcd call, one control request and one remote read |
//! | `UMBP_CLUSTER_DIRECTORY` | `sharded` | where the key directory lives: `sharded` (each key's entry at its two rendezvous peers, etcd holds membership only) or `etcd` (every key in etcd, every peer watching all of them: the design before issue 26, kept to measure against) |
//! | `UMBP_CLUSTER_MAX_ENTRIES_PER_SOURCE` | 4194304 | sharded directory: most entries one member may hold at this peer; a PUBLISH past it is refused (counted) |
//! | `UMBP_CLUSTER_LOOKUP_KEYS_PER_S` | 1000000 | sharded directory: keys per second one member's LOOKUPs may ask of this peer (a token bucket, a burst of one second's worth; non-members share one); past it a LOOKUP waits, or is refused when the wait would exceed the frame timeout (the refusal sent after that timeout) |
//! | `UMBP_CLUSTER_CHECK_SOURCE_ADDR` | `1` | sharded directory: a PUBLISH, UNPUBLISH or RETIRE in a member's name must come from the IP that member announced (its control address; unchecked when that is unspecified); `0` turns it off (NAT between peers). Peers connect from their announced IP |
//! | `UMBP_CLUSTER_MAX_CONNECTIONS`, `UMBP_CLUSTER_MAX_CONNECTIONS_PER_SOURCE`, `UMBP_CLUSTER_HANDSHAKE_TIMEOUT_MS`, `UMBP_CLUSTER_IDLE_TIMEOUT_MS` | te-base's listener defaults | the control listener's limits (te_base::listener::ListenerLimits) |
//! | `UMBP_CLUSTER_COMPACT_S` | 60 | the cluster compacts etcd's revision history this often, keeping one period of it (done by the member with the lowest name); `0` = never (an operator's `--auto-compaction-*` does it) |
//!
//! The peer's name is the store's segment name. With `TE_AUTH_KEY`/`TE_AUTH_KEY_FILE` set, the
//! control listener and the engine's transports require it of every peer.

use std::net::SocketAddr;
use std::time::Duration;

use te_base::auth::AuthKey;
use te_base::config::{parse_var, Env};
use te_base::{Error, Result};

/// The distributed-mode variables.
pub const ENV_VARS: &[&str] = &[
    "UMBP_CLUSTER",
    "UMBP_CLUSTER_LISTEN",
    "UMBP_CLUSTER_LEASE_TTL_S",
    "UMBP_CLUSTER_TIMEOUT_MS",
    "UMBP_CLUSTER_DIRECTORY",
    "UMBP_CLUSTER_COMPACT_S",
    "UMBP_CLUSTER_MAX_ENTRIES_PER_SOURCE",
    "UMBP_CLUSTER_LOOKUP_KEYS_PER_S",
    "UMBP_CLUSTER_CHECK_SOURCE_ADDR",
    // The control listener's limits (ListenerLimits::from_env under "UMBP_CLUSTER").
    "UMBP_CLUSTER_MAX_CONNECTIONS",
    "UMBP_CLUSTER_MAX_CONNECTIONS_PER_SOURCE",
    "UMBP_CLUSTER_HANDSHAKE_TIMEOUT_MS",
    "UMBP_CLUSTER_IDLE_TIMEOUT_MS",
];

/// Where the key directory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirectoryMode {
    /// Each key's entry at its two rendezvous peers over the live membership; etcd holds only
    /// membership and leases (docs/umbp.md, "Directory").
    Sharded,
    /// Every key in etcd, every peer watching all of them (the design before issue 26).
    Etcd,
}

/// Distributed-mode settings.
#[derive(Clone)]
pub struct ClusterConfig {
    /// etcd endpoints (`http://host:port`).
    pub endpoints: Vec<String>,
    /// Key prefix (starts with `/`, no trailing `/`).
    pub prefix: String,
    /// Control listener address.
    pub listen: SocketAddr,
    /// Membership lease time-to-live in seconds (2..=3600).
    pub lease_ttl_s: i64,
    /// Bound of one etcd call, control request or remote read.
    pub timeout: Duration,
    /// Shared key peers must prove (the engine's `TE_AUTH_KEY`).
    pub auth: Option<AuthKey>,
    /// Where the key directory lives.
    pub directory: DirectoryMode,
    /// etcd history compaction period (`None`: the cluster does not compact).
    pub compact_every: Option<Duration>,
    /// Most directory entries one member may hold at this peer (sharded directory).
    pub max_entries_per_source: usize,
    /// Keys per second one member's LOOKUPs may ask of this peer (sharded directory).
    pub lookup_keys_per_s: u64,
    /// A request in a member's name must come from the IP the member announced (sharded
    /// directory).
    pub check_source_addr: bool,
}

impl std::fmt::Debug for ClusterConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterConfig")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .field("listen", &self.listen)
            .field("lease_ttl_s", &self.lease_ttl_s)
            .field("timeout", &self.timeout)
            .field("auth", &self.auth.is_some())
            .field("directory", &self.directory)
            .field("compact_every", &self.compact_every)
            .field("max_entries_per_source", &self.max_entries_per_source)
            .field("lookup_keys_per_s", &self.lookup_keys_per_s)
            .field("check_source_addr", &self.check_source_addr)
            .finish()
    }
}

impl ClusterConfig {
    /// Parses `etcd://host:port[,host:port...][/prefix]` with default listener, lease and timeout.
    pub fn parse(url: &str) -> Result<ClusterConfig> {
        // The endpoint and prefix rules are te-core's etcd metadata rules, not a copy.
        let rest = url
            .strip_prefix("etcd://")
            .ok_or_else(|| Error::config("UMBP_CLUSTER", url, "expected etcd://host:port[,host:port...][/prefix]"))?;
        let (hosts, prefix) = match rest.find('/') {
            Some(i) => (&rest[..i], rest[i..].trim_end_matches('/').to_string()),
            None => (rest, "/umbp".to_string()),
        };
        te_core::metadata::etcd::check_prefix("UMBP_CLUSTER", &prefix)?;
        let endpoints: Vec<String> = te_core::metadata::etcd::parse_endpoints("UMBP_CLUSTER", hosts)?
            .into_iter()
            .map(|h| format!("http://{h}"))
            .collect();
        Ok(ClusterConfig {
            endpoints,
            prefix,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            lease_ttl_s: 10,
            timeout: Duration::from_millis(3000),
            auth: None,
            directory: DirectoryMode::Sharded,
            compact_every: Some(Duration::from_secs(60)),
            max_entries_per_source: 4 << 20,
            lookup_keys_per_s: 1_000_000,
            check_source_addr: true,
        })
    }

    /// Reads `UMBP_CLUSTER*` and the engine's auth key; `None` when `UMBP_CLUSTER` is unset.
    pub fn from_env(env: &dyn Env) -> Result<Option<ClusterConfig>> {
        let Some(url) = parse_var::<String>(env, "UMBP_CLUSTER")? else {
            return Ok(None);
        };
        let mut c = ClusterConfig::parse(&url)?;
        if let Some(listen) = parse_var::<String>(env, "UMBP_CLUSTER_LISTEN")? {
            c.listen = listen
                .parse()
                .map_err(|_| Error::config("UMBP_CLUSTER_LISTEN", &listen, "expected ip:port"))?;
        }
        if let Some(ttl) = parse_var::<i64>(env, "UMBP_CLUSTER_LEASE_TTL_S")? {
            if !(2..=3600).contains(&ttl) {
                return Err(Error::config(
                    "UMBP_CLUSTER_LEASE_TTL_S",
                    ttl.to_string(),
                    "must be 2..=3600",
                ));
            }
            c.lease_ttl_s = ttl;
        }
        if let Some(ms) = parse_var::<u64>(env, "UMBP_CLUSTER_TIMEOUT_MS")? {
            if ms == 0 {
                return Err(Error::config("UMBP_CLUSTER_TIMEOUT_MS", "0", "must be at least 1"));
            }
            c.timeout = Duration::from_millis(ms);
        }
        if let Some(d) = parse_var::<String>(env, "UMBP_CLUSTER_DIRECTORY")? {
            c.directory = match d.as_str() {
                "sharded" => DirectoryMode::Sharded,
                "etcd" => DirectoryMode::Etcd,
                _ => return Err(Error::config("UMBP_CLUSTER_DIRECTORY", &d, "expected sharded or etcd")),
            };
        }
        if let Some(s) = parse_var::<u64>(env, "UMBP_CLUSTER_COMPACT_S")? {
            if s > 86_400 {
                return Err(Error::config(
                    "UMBP_CLUSTER_COMPACT_S",
                    s.to_string(),
                    "must be 0..=86400",
                ));
            }
            c.compact_every = (s > 0).then(|| Duration::from_secs(s));
        }
        if let Some(n) = parse_var::<u64>(env, "UMBP_CLUSTER_MAX_ENTRIES_PER_SOURCE")? {
            if n == 0 {
                return Err(Error::config(
                    "UMBP_CLUSTER_MAX_ENTRIES_PER_SOURCE",
                    "0",
                    "must be at least 1",
                ));
            }
            c.max_entries_per_source = usize::try_from(n).unwrap_or(usize::MAX);
        }
        if let Some(n) = parse_var::<u64>(env, "UMBP_CLUSTER_LOOKUP_KEYS_PER_S")? {
            if n == 0 {
                return Err(Error::config(
                    "UMBP_CLUSTER_LOOKUP_KEYS_PER_S",
                    "0",
                    "must be at least 1",
                ));
            }
            c.lookup_keys_per_s = n;
        }
        if let Some(b) = te_base::config::parse_bool(env, "UMBP_CLUSTER_CHECK_SOURCE_ADDR")? {
            c.check_source_addr = b;
        }
        c.auth = AuthKey::from_env(env)?;
        Ok(Some(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_base::config::MapEnv;

    #[test]
    fn the_control_listeners_limits_are_known_and_read() {
        // Issue 38: these were read but warned as unknown ("did you mean UMBP_SERVER_...").
        let env = MapEnv(
            [
                ("UMBP_CLUSTER_MAX_CONNECTIONS", "100"),
                ("UMBP_CLUSTER_MAX_CONNECTIONS_PER_SOURCE", "4"),
                ("UMBP_CLUSTER_HANDSHAKE_TIMEOUT_MS", "700"),
                ("UMBP_CLUSTER_IDLE_TIMEOUT_MS", "9000"),
            ]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        );
        assert_eq!(crate::config::unknown_vars(&env), []);
        let l = te_base::listener::ListenerLimits::from_env(&env, "UMBP_CLUSTER", Duration::from_secs(1)).unwrap();
        assert_eq!((l.max_connections, l.max_per_source), (100, 4));
        assert_eq!(
            (l.handshake_timeout, l.idle_timeout),
            (Duration::from_millis(700), Duration::from_millis(9000))
        );
    }

    #[test]
    fn parses_endpoints_prefix_and_refuses_malformed_values() {
        let c = ClusterConfig::parse("etcd://10.0.0.1:2379,10.0.0.2:2379/kv/a").unwrap();
        assert_eq!(c.endpoints, ["http://10.0.0.1:2379", "http://10.0.0.2:2379"]);
        assert_eq!(c.prefix, "/kv/a");
        assert_eq!(ClusterConfig::parse("etcd://h:1").unwrap().prefix, "/umbp");
        for bad in ["http://h:1", "etcd://", "etcd://h", "etcd://h:1,", "etcd://h:1//x"] {
            assert!(ClusterConfig::parse(bad).is_err(), "{bad}");
        }
        let env = |pairs: &[(&str, &str)]| MapEnv(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        assert!(ClusterConfig::from_env(&env(&[])).unwrap().is_none());
        let c = ClusterConfig::from_env(&env(&[
            ("UMBP_CLUSTER", "etcd://h:1"),
            ("UMBP_CLUSTER_LISTEN", "10.1.0.2:7100"),
            ("UMBP_CLUSTER_LEASE_TTL_S", "3"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((c.listen.port(), c.lease_ttl_s, c.check_source_addr), (7100, 3, true));
        assert_eq!(
            (c.directory, c.compact_every),
            (DirectoryMode::Sharded, Some(Duration::from_secs(60)))
        );
        let c = ClusterConfig::from_env(&env(&[
            ("UMBP_CLUSTER", "etcd://h:1"),
            ("UMBP_CLUSTER_DIRECTORY", "etcd"),
            ("UMBP_CLUSTER_COMPACT_S", "0"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((c.directory, c.compact_every), (DirectoryMode::Etcd, None));
        let c = ClusterConfig::from_env(&env(&[
            ("UMBP_CLUSTER", "etcd://h:1"),
            ("UMBP_CLUSTER_MAX_ENTRIES_PER_SOURCE", "1000"),
            ("UMBP_CLUSTER_LOOKUP_KEYS_PER_S", "5000"),
            ("UMBP_CLUSTER_CHECK_SOURCE_ADDR", "0"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (c.max_entries_per_source, c.lookup_keys_per_s, c.check_source_addr),
            (1000, 5000, false)
        );
        for (var, value) in [
            ("UMBP_CLUSTER_LISTEN", "nowhere"),
            ("UMBP_CLUSTER_LEASE_TTL_S", "1"),
            ("UMBP_CLUSTER_TIMEOUT_MS", "0"),
            ("UMBP_CLUSTER_DIRECTORY", "gossip"),
            ("UMBP_CLUSTER_COMPACT_S", "86401"),
            ("UMBP_CLUSTER_MAX_ENTRIES_PER_SOURCE", "0"),
            ("UMBP_CLUSTER_LOOKUP_KEYS_PER_S", "none"),
            ("UMBP_CLUSTER_CHECK_SOURCE_ADDR", "maybe"),
        ] {
            let e = ClusterConfig::from_env(&env(&[("UMBP_CLUSTER", "etcd://h:1"), (var, value)])).unwrap_err();
            assert!(e.to_string().contains(var), "{e}");
        }
    }
}
