//! Settings of distributed mode, from `UMBP_CLUSTER*` variables or explicitly.
//!
//! Each is declared once, in the table at the end of this file ([`ClusterKey`], the same table
//! macro as the local-mode settings' [`crate::config::StoreKey`]): its variable, its Python
//! keyword, its parser, its check, its default (as the docs print it and as the value it stands
//! for) and its doc line; the control listener's limits, which `te_base::listener` reads under
//! `UMBP_CLUSTER`, are listed there too. From it come [`ClusterKey`] (with `FromStr`),
//! [`ENV_VARS`], [`ClusterSettings`] (explicit values, the Python keywords' way in) and the
//! resolution of every setting (explicit, then the variable, then the default), and
//! [`ClusterKey::doc_table`], docs/configuration.md's distributed-mode table (a test holds the
//! page to it).
//!
//! Adding a setting: one entry in the table, the field it fills in [`ClusterConfig`], the line in
//! `ClusterConfig::resolve` that fills it, and its row in docs/configuration.md (the test
//! prints the table).
//!
//! The peer's name is the store's segment name. With `TE_AUTH_KEY`/`TE_AUTH_KEY_FILE` set, the
//! control listener and the engine's transports require it of every peer.

use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

use te_base::auth::AuthKey;
use te_base::config::{Env, MapEnv};
use te_base::{Error, Result};

use crate::config::keys::{check, parse, settings_table};

/// Where the key directory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirectoryMode {
    /// Each key's entry at its three rendezvous peers over the live membership; etcd holds only
    /// membership and leases (docs/umbp.md, "Directory").
    Sharded,
    /// Every key in etcd, every peer watching all of them (the design before issue 26).
    Etcd,
}

impl FromStr for DirectoryMode {
    type Err = String;

    /// `sharded` or `etcd`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "sharded" => Ok(DirectoryMode::Sharded),
            "etcd" => Ok(DirectoryMode::Etcd),
            _ => Err("expected sharded or etcd".into()),
        }
    }
}

crate::config::keys::choice_value!(DirectoryMode);

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

/// `etcd://host:port[,host:port...][/prefix]` as endpoints (`http://host:port`) and prefix.
fn endpoints_and_prefix(url: &str) -> Result<(Vec<String>, String)> {
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
    Ok((endpoints, prefix))
}

impl ClusterConfig {
    /// Parses `etcd://host:port[,host:port...][/prefix]` with every other setting at its default.
    pub fn parse(url: &str) -> Result<ClusterConfig> {
        let s = ClusterSettings {
            cluster: Some(url.to_string()),
            ..Default::default()
        };
        Ok(ClusterConfig::explicit(&s)?.expect("the cluster is named"))
    }

    /// Reads `UMBP_CLUSTER*` and the engine's auth key; `None` when `UMBP_CLUSTER` is unset.
    pub fn from_env(env: &dyn Env) -> Result<Option<ClusterConfig>> {
        let Some(mut c) = ClusterConfig::resolve(&ClusterSettings::default(), env)? else {
            return Ok(None);
        };
        c.auth = AuthKey::from_env(env)?;
        Ok(Some(c))
    }

    /// The settings of `s` over the defaults, no variable read (the Python keywords: a
    /// `cluster=` store does not read `UMBP_CLUSTER_*`); `None` when `s` names no cluster.
    pub fn explicit(s: &ClusterSettings) -> Result<Option<ClusterConfig>> {
        ClusterConfig::resolve(s, &MapEnv(Default::default()))
    }

    /// Each setting: explicit in `s`, else its variable in `env`, else its default; `None` when
    /// neither names a cluster (then nothing else is read). Without the auth key.
    fn resolve(s: &ClusterSettings, env: &dyn Env) -> Result<Option<ClusterConfig>> {
        let Some(url) = s.cluster(env)? else {
            return Ok(None);
        };
        let (endpoints, prefix) = endpoints_and_prefix(&url)?;
        Ok(Some(ClusterConfig {
            endpoints,
            prefix,
            listen: s.cluster_listen(env)?,
            lease_ttl_s: s.cluster_lease_ttl_s(env)?,
            timeout: Duration::from_millis(s.cluster_timeout_ms(env)?),
            auth: None,
            directory: s.cluster_directory(env)?,
            compact_every: Some(s.cluster_compact_s(env)?)
                .filter(|&s| s > 0)
                .map(Duration::from_secs),
            max_entries_per_source: usize::try_from(s.cluster_max_entries_per_source(env)?).unwrap_or(usize::MAX),
            lookup_keys_per_s: s.cluster_lookup_keys_per_s(env)?,
            check_source_addr: s.cluster_check_source_addr(env)?,
        }))
    }
}

/// Parsers and checks of the cluster's own settings (the shared ones are in
/// `crate::config::keys`).
mod rules {
    use std::net::SocketAddr;

    use crate::config::keys::check::{unless, Checked};
    use crate::config::keys::parse;

    /// `ip:port`.
    pub fn listen(raw: &str) -> Result<SocketAddr, String> {
        let raw: String = parse::text(raw)?;
        raw.parse().map_err(|_| "expected ip:port".to_string())
    }

    pub fn lease_ttl(v: &i64) -> Checked {
        unless(!(2..=3600).contains(v), "must be 2..=3600")
    }

    pub fn at_least_one(v: &u64) -> Checked {
        unless(*v == 0, "must be at least 1")
    }

    pub fn compact(v: &u64) -> Checked {
        unless(*v > 86_400, "must be 0..=86400")
    }
}

settings_table! {
    /// A distributed-mode setting (see the module docs: each is declared once).
    key: ClusterKey,
    /// The distributed-mode variables (with the control listener's limits).
    vars: ENV_VARS,
    /// Distributed-mode settings given explicitly (the Python keywords), by setting.
    settings: pub ClusterSettings,
    error: Error::config => Error,
    what: "a distributed-mode UMBP setting",
    keyword_column: "Python",
    setters: ,
    entries: {
        /// `etcd://host:port[,host:port...][/prefix]`: etcd endpoints and the key prefix separating clusters (prefix default `/umbp`).
        Cluster {
            var: "UMBP_CLUSTER",
            set: cluster: String,
            parse: parse::text,
            check: check::none,
            default: "unset (local mode)",
        }
        /// Control listener address (an address other peers reach).
        Listen {
            var: "UMBP_CLUSTER_LISTEN",
            set: cluster_listen: SocketAddr,
            parse: rules::listen,
            check: check::none,
            default: "127.0.0.1:0" = SocketAddr::from(([127, 0, 0, 1], 0)),
        }
        /// Membership lease in seconds (2..=3600): a dead peer's keys stop being routed to it within this.
        LeaseTtlS {
            var: "UMBP_CLUSTER_LEASE_TTL_S",
            set: cluster_lease_ttl_s: i64,
            parse: parse::text,
            check: rules::lease_ttl,
            default: "10" = 10,
        }
        /// Deadline of one cluster call (get, put, lookup, publish, remove) end to end, whatever one member does: a retry on a fresh connection spends what is left of it; also one etcd call.
        TimeoutMs {
            var: "UMBP_CLUSTER_TIMEOUT_MS",
            set: cluster_timeout_ms: u64,
            parse: parse::text,
            check: rules::at_least_one,
            default: "3000" = 3000,
        }
        /// Key directory: `sharded` (each key's entry at its three rendezvous peers; etcd holds membership only) or `etcd` (every key in etcd, the design before issue 26, kept to measure against).
        Directory {
            var: "UMBP_CLUSTER_DIRECTORY",
            set: cluster_directory: DirectoryMode,
            parse: parse::text,
            check: check::none,
            default: "sharded" = DirectoryMode::Sharded,
        }
        /// etcd history compaction period in seconds (0..=86400), keeping one period of it, done by the member with the lowest name; `0` = never (an operator's `--auto-compaction-*` does it).
        CompactS {
            var: "UMBP_CLUSTER_COMPACT_S",
            set: cluster_compact_s: u64,
            parse: parse::text,
            check: rules::compact,
            default: "60" = 60,
        }
        /// Sharded directory: most entries one member may hold at this peer; a PUBLISH past it is refused (`directory_refused_capped`).
        MaxEntriesPerSource {
            var: "UMBP_CLUSTER_MAX_ENTRIES_PER_SOURCE",
            set: cluster_max_entries_per_source: u64,
            parse: parse::text,
            check: rules::at_least_one,
            default: "4194304" = 4 << 20,
        }
        /// Sharded directory: keys per second one member's LOOKUPs may ask of this peer (token bucket, burst of one second; non-members share one); past it a LOOKUP waits, or is refused when the wait exceeds the frame timeout, the refusal sent after that timeout (`directory_lookups_throttled`).
        LookupKeysPerS {
            var: "UMBP_CLUSTER_LOOKUP_KEYS_PER_S",
            set: cluster_lookup_keys_per_s: u64,
            parse: parse::text,
            check: rules::at_least_one,
            default: "1000000" = 1_000_000,
        }
        /// Sharded directory: a PUBLISH, UNPUBLISH, RETIRE or RENEW (a lease renewal relayed for a member cut off from etcd) in a member's name must come from the IP that member announced (its control address; not checked when that is unspecified), and LOOKUPs from elsewhere count as a non-member's; peers connect from their announced IP. `0`: off (NAT between peers).
        CheckSourceAddr {
            var: "UMBP_CLUSTER_CHECK_SOURCE_ADDR",
            set: cluster_check_source_addr: bool,
            parse: parse::switch,
            check: check::none,
            default: "1" = true,
        }
    },
    // The control listener's limits: te_base::listener::ListenerLimits::from_env under
    // "UMBP_CLUSTER" (a unit test holds names and defaults to te-base's).
    also: {
        /// Control listener: connections served at once.
        "UMBP_CLUSTER_MAX_CONNECTIONS" = "2048",
        /// Control listener: connections from one IP address at once.
        "UMBP_CLUSTER_MAX_CONNECTIONS_PER_SOURCE" = "256",
        /// Control listener: accept to authenticated.
        "UMBP_CLUSTER_HANDSHAKE_TIMEOUT_MS" = "5000",
        /// Control listener: longest wait for a connection's next frame.
        "UMBP_CLUSTER_IDLE_TIMEOUT_MS" = "120000",
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Value;
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

    #[test]
    fn umbp_server_has_no_cluster_flags() {
        for &k in ClusterKey::ALL {
            assert!(k.flag().is_none(), "{k}: umbp-server has no cluster flags");
        }
    }

    #[test]
    fn the_listener_rows_are_te_bases_limits() {
        crate::config::keys::assert_listener_rows("UMBP_CLUSTER", ClusterKey::READ_ELSEWHERE);
    }

    #[test]
    fn explicit_settings_win_over_defaults_and_read_no_variable() {
        let mut s = ClusterSettings::default();
        assert!(ClusterConfig::explicit(&s).unwrap().is_none());
        s.set(ClusterKey::Cluster, Value::Choice("etcd://h:1/x".into()))
            .unwrap();
        s.set(ClusterKey::Listen, Value::Choice("10.0.0.1:5".into())).unwrap();
        s.set(ClusterKey::LeaseTtlS, Value::Count(3)).unwrap();
        s.set(ClusterKey::Directory, Value::Choice("etcd".into())).unwrap();
        s.set(ClusterKey::CompactS, Value::Bytes(0)).unwrap();
        s.set(ClusterKey::CheckSourceAddr, Value::Switch(false)).unwrap();
        let c = ClusterConfig::explicit(&s).unwrap().unwrap();
        assert_eq!((c.prefix.as_str(), c.listen.port(), c.lease_ttl_s), ("/x", 5, 3));
        assert_eq!(
            (c.directory, c.compact_every, c.check_source_addr),
            (DirectoryMode::Etcd, None, false)
        );
        // The rest at their defaults, as parse() gives them.
        let d = ClusterConfig::parse("etcd://h:1/x").unwrap();
        assert_eq!(
            (c.timeout, c.max_entries_per_source),
            (d.timeout, d.max_entries_per_source)
        );
        // A bad value is refused naming the variable; a value of the wrong kind or a choice that
        // does not parse, naming why.
        s.set(ClusterKey::LeaseTtlS, Value::Count(1)).unwrap();
        let e = ClusterConfig::explicit(&s).unwrap_err();
        assert_eq!(
            e.to_string(),
            Error::config("UMBP_CLUSTER_LEASE_TTL_S", "1", "must be 2..=3600").to_string()
        );
        assert!(s.set(ClusterKey::Directory, Value::Choice("gossip".into())).is_err());
        assert!(s.set(ClusterKey::TimeoutMs, Value::Switch(true)).is_err());
    }

    #[test]
    fn malformed_variables_are_quoted_as_before() {
        let env = |var: &str, value: &str| {
            MapEnv(
                [("UMBP_CLUSTER", "etcd://h:1"), (var, value)]
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            )
        };
        for (var, value, quoted, reason) in [
            ("UMBP_CLUSTER_LISTEN", "nowhere", "nowhere", "expected ip:port"),
            ("UMBP_CLUSTER_LISTEN", "", "", "empty value"),
            ("UMBP_CLUSTER_LEASE_TTL_S", "01", "1", "must be 2..=3600"),
            ("UMBP_CLUSTER_TIMEOUT_MS", "0", "0", "must be at least 1"),
            ("UMBP_CLUSTER_DIRECTORY", "gossip", "gossip", "expected sharded or etcd"),
            ("UMBP_CLUSTER_DIRECTORY", " etcd", " etcd", "surrounding whitespace"),
            ("UMBP_CLUSTER_COMPACT_S", "86401", "86401", "must be 0..=86400"),
            ("UMBP_CLUSTER_MAX_ENTRIES_PER_SOURCE", "0", "0", "must be at least 1"),
            ("UMBP_CLUSTER_LOOKUP_KEYS_PER_S", "0", "0", "must be at least 1"),
            (
                "UMBP_CLUSTER_CHECK_SOURCE_ADDR",
                "maybe",
                "maybe",
                "expected 1/0, true/false, on/off or yes/no",
            ),
        ] {
            let e = ClusterConfig::from_env(&env(var, value)).unwrap_err();
            assert_eq!(e.to_string(), Error::config(var, quoted, reason).to_string());
        }
        let e = ClusterConfig::from_env(&env("UMBP_CLUSTER", "http://h:1")).unwrap_err();
        assert_eq!(
            e.to_string(),
            Error::config(
                "UMBP_CLUSTER",
                "http://h:1",
                "expected etcd://host:port[,host:port...][/prefix]"
            )
            .to_string()
        );
    }
}
