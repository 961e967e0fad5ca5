//! Configuration of the store: a builder whose unset options come from `UMBP_*` variables, then
//! defaults. A variable that is set but malformed is an error naming it; nothing is silently
//! defaulted.
//!
//! Each local-mode setting (tiers, eviction, staging, debugging) is declared once, in
//! [`keys`]: its variable, builder setter and Python keyword, `umbp-server` flag, parser, check,
//! default and doc line. [`StoreKey`] names them; docs/configuration.md's local-mode table is
//! [`StoreKey::doc_table`] (a test holds the page to it). Standalone mode's (the workers' and the
//! server's) are declared the same way, in [`crate::standalone::StandaloneKey`], and distributed
//! mode's (`UMBP_CLUSTER`...) in `cluster::config::ClusterKey`.
//!
//! [`known_vars`] lists every variable this build reads; a `UMBP_*` variable set in the
//! environment that is not among them (a typo) is logged as a warning naming the closest known
//! one when the configuration is resolved.

use std::path::PathBuf;
use std::sync::Arc;

use te_base::config::{Env, ProcessEnv, UnknownVar};

use crate::core::config::CoreConfig;
use crate::error::{Result, StoreError};
use crate::ssd::log::SsdOptions;
use crate::standalone::config::{StandaloneConfig, StandaloneSettings};

pub mod keys;

pub use keys::{SettingValue, StoreKey, Value, ValueKind, ENV_VARS};

/// Every `UMBP_*` variable this build reads: local mode's, standalone mode's (with the server's
/// listener limits) and, with the `cluster` feature, distributed mode's.
pub fn known_vars() -> Vec<String> {
    let vars = ENV_VARS.iter().chain(crate::standalone::ENV_VARS);
    #[cfg(feature = "cluster")]
    let vars = vars.chain(crate::cluster::config::ENV_VARS);
    vars.map(|v| v.to_string()).collect()
}

/// The `UMBP_*` variables of `env` that this build does not read, each with the closest known
/// name (a likely typo).
pub fn unknown_vars(env: &dyn Env) -> Vec<UnknownVar> {
    let known = known_vars();
    te_base::config::unknown_vars(env, &["UMBP_"], known.iter().map(String::as_str))
}

/// Resolved configuration of a store: the core's settings plus the one mode it runs in.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Segment name of the store's own engine (when the store builds one).
    pub segment_name: Option<String>,
    /// The tiers (in standalone mode, the server's are used and these are not).
    pub core: CoreConfig,
    /// The mode, with its settings.
    pub mode: ModeConfig,
}

/// Which mode a store runs in, with that mode's settings.
#[derive(Debug, Clone)]
pub enum ModeConfig {
    /// The tiers live in this process.
    Local,
    /// A worker of the `umbp-server` at the configured socket (`UMBP_STANDALONE_SOCKET`).
    Standalone(StandaloneConfig),
    /// A peer of a cluster (`UMBP_CLUSTER`).
    #[cfg(feature = "cluster")]
    Cluster(crate::cluster::ClusterConfig),
}

impl ModeConfig {
    /// The mode's name: `local`, `standalone` or `distributed`.
    pub fn name(&self) -> &'static str {
        match self {
            ModeConfig::Local => "local",
            ModeConfig::Standalone(_) => "standalone",
            #[cfg(feature = "cluster")]
            ModeConfig::Cluster(_) => "distributed",
        }
    }
}

/// Builds a [`StoreConfig`]: explicit settings, then `UMBP_*` variables, then defaults.
#[derive(Clone)]
pub struct StoreBuilder {
    env: Arc<dyn Env>,
    segment_name: Option<String>,
    /// The local-mode settings given explicitly ([`keys`]).
    settings: keys::Settings,
    /// The standalone-mode settings given explicitly ([`crate::standalone::StandaloneKey`]).
    standalone: StandaloneSettings,
    /// Local mode whatever the environment says (the socket is then not read).
    local: bool,

    #[cfg(feature = "cluster")]
    cluster: Option<crate::cluster::ClusterConfig>,
}

impl Default for StoreBuilder {
    fn default() -> Self {
        Self::new()
    }
}

macro_rules! setter {
    ($(#[$doc:meta])* $name:ident, $field:ident, $ty:ty) => {
        $(#[$doc])*
        pub fn $name(mut self, v: $ty) -> Self {
            self.$field = Some(v);
            self
        }
    };
}

impl StoreBuilder {
    /// Every option unset; variables are read from the process environment.
    pub fn new() -> Self {
        StoreBuilder {
            env: Arc::new(ProcessEnv),
            segment_name: None,
            settings: keys::Settings::default(),
            standalone: StandaloneSettings::default(),
            local: false,

            #[cfg(feature = "cluster")]
            cluster: None,
        }
    }

    /// Distributed mode: join the cluster described by `cfg` (else `UMBP_CLUSTER`, unset: local).
    #[cfg(feature = "cluster")]
    pub fn cluster(mut self, cfg: crate::cluster::ClusterConfig) -> Self {
        self.cluster = Some(cfg);
        self
    }

    /// Reads variables from `env` instead of the process environment.
    pub fn env(mut self, env: Arc<dyn Env>) -> Self {
        self.env = env;
        self
    }

    setter!(
        /// Segment name of the store's own engine.
        segment_name, segment_name, String);
    /// Standalone mode: `open()` connects to the `umbp-server` listening on `socket` instead of
    /// opening tiers in this process (as `UMBP_STANDALONE_SOCKET` does).
    pub fn connect(mut self, socket: impl Into<PathBuf>) -> Self {
        self.standalone.connect = Some(socket.into());
        self.local = false;
        self
    }

    /// Local mode even when `UMBP_STANDALONE_SOCKET` is set (the server's own store).
    pub fn local(mut self) -> Self {
        self.local = true;
        self
    }

    /// Standalone mode: key-handle cache slots (0: off; as `UMBP_KEY_HANDLE_SLOTS`).
    pub fn key_handle_slots(mut self, v: usize) -> Self {
        self.standalone.key_handle_slots = Some(v);
        self
    }

    /// Sets a worker's standalone-mode setting from a binding's value (as its own setter
    /// would); `Err` says why `v` is not a value of it, or that the server reads `key`, not a
    /// store (see [`crate::standalone::server::ServerOptions::resolve`]).
    pub fn set_standalone(
        mut self,
        key: crate::standalone::StandaloneKey,
        v: Value,
    ) -> std::result::Result<Self, String> {
        if !key.read_by_workers() {
            return Err(format!("{key} is read by umbp-server, not by a store"));
        }
        self.standalone.set(key, v)?;
        if key == crate::standalone::StandaloneKey::Socket {
            self.local = false;
        }
        Ok(self)
    }

    /// Resolves and validates the configuration; logs a warning for each unknown `UMBP_*`
    /// variable (see [`unknown_vars`]).
    pub fn config(&self) -> Result<StoreConfig> {
        let env = &*self.env;
        for unknown in unknown_vars(env) {
            tracing::warn!("{unknown}");
        }
        let bad =
            |var: &str, value: String, reason: &str| StoreError::Engine(te_base::Error::config(var, value, reason));

        // Each setting resolves itself (explicit, variable, default) and checks its own value;
        // what follows are the rules between settings. SSD settings are read only with an SSD
        // tier.
        let s = &self.settings;
        let dram_capacity = s.dram_capacity(env)?;
        let dram_page_bytes = s.dram_page_bytes(env)?;
        if dram_capacity / dram_page_bytes > u32::MAX as u64 {
            return Err(bad(
                "UMBP_DRAM_CAPACITY",
                dram_capacity.to_string(),
                "more than 2^32 pages; raise UMBP_DRAM_PAGE_BYTES",
            ));
        }
        let high = s.high_watermark(env)?;
        let low = s.low_watermark(env)?;
        if low > high {
            return Err(bad(
                "UMBP_DRAM_LOW_WATERMARK",
                low.to_string(),
                "must not exceed UMBP_DRAM_HIGH_WATERMARK",
            ));
        }
        let eviction = s.eviction(env)?;
        let dirs = s.ssd_dirs(env)?.unwrap_or_default();
        let ssd = if dirs.is_empty() {
            None
        } else {
            let capacity = s.ssd_capacity(env)?;
            let segment_bytes = s.ssd_segment_bytes(env)?;
            if let Some(c) = capacity.filter(|&c| c < segment_bytes) {
                return Err(bad(
                    "UMBP_SSD_CAPACITY",
                    c.to_string(),
                    "must hold at least one segment",
                ));
            }
            Some(SsdOptions {
                dirs,
                capacity,
                segment_bytes,
                compact_below: s.compact_below(env)?,
                direct: s.ssd_direct(env)?,
                io: s.ssd_io(env)?,
                step_hook: Default::default(),
            })
        };
        let ssd_staging_bytes = s.staging_bytes(env)?;
        let ssd_staging_slots = s.staging_slots(env)?;
        let write_through = s.write_through(env)?;
        if dram_capacity == 0 && ssd.is_none() {
            return Err(bad(
                "UMBP_DRAM_CAPACITY",
                "0".into(),
                "no tier left: set UMBP_SSD_DIRS or a DRAM capacity",
            ));
        }
        let core = CoreConfig {
            dram_capacity,
            dram_page_bytes,
            dram_high_watermark: high,
            dram_low_watermark: low,
            eviction,
            ssd,
            ssd_staging_bytes,
            ssd_staging_slots,
            write_through,
            promote_on_read: s.promote_on_read(env)?,
            ranged_call_debug: s.ranged_call_debug(env)?,
        };
        // Every mode's variables are checked whichever mode is chosen: a malformed one is an
        // error even where it would not be used.
        let standalone = StandaloneConfig::resolve(&self.standalone, env, self.local)?;
        #[cfg(feature = "cluster")]
        let cluster = match &self.cluster {
            Some(c) => Some(c.clone()),
            None => crate::cluster::ClusterConfig::from_env(env)?,
        };
        let mode = match standalone {
            Some(standalone) => {
                // A standalone client has no tiers of its own, so it cannot also be a cluster
                // peer: the `umbp-server` it talks to is the one that joins the cluster.
                #[cfg(feature = "cluster")]
                if cluster.is_some() {
                    return Err(StoreError::Engine(te_base::Error::config(
                        "UMBP_CLUSTER",
                        format!("(with UMBP_STANDALONE_SOCKET={})", standalone.socket.display()),
                        "a standalone client cannot join a cluster; configure the cluster on its umbp-server",
                    )));
                }
                ModeConfig::Standalone(standalone)
            }
            #[cfg(feature = "cluster")]
            None if cluster.is_some() => ModeConfig::Cluster(cluster.expect("checked")),
            None => ModeConfig::Local,
        };
        Ok(StoreConfig {
            segment_name: self.segment_name.clone(),
            core,
            mode,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eviction::EvictionPolicy;
    use te_base::config::MapEnv;

    fn with(pairs: &[(&str, &str)]) -> StoreBuilder {
        let map = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        StoreBuilder::new().env(Arc::new(MapEnv(map)))
    }

    #[test]
    fn unknown_variables_name_the_closest_known_one() {
        let map = [
            ("UMBP_DRAM_CAPACTIY", "1G"),
            ("UMBP_SSD_DIR", "/tmp/x"),
            ("UMBP_SERVER_IDLE_TIMEOUT_MS", "5"),
            ("UMBP_STANDALONE_SOCKET", "/tmp/s"),
            ("UMBP_NOTHING_LIKE_THIS_AT_ALL", "1"),
            ("TE_SEGMENT_NAME", "x"),
        ];
        let env = MapEnv(map.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        let got: Vec<(String, Option<String>)> = unknown_vars(&env).into_iter().map(|u| (u.name, u.closest)).collect();
        assert_eq!(
            got,
            [
                ("UMBP_DRAM_CAPACTIY".to_string(), Some("UMBP_DRAM_CAPACITY".to_string())),
                ("UMBP_NOTHING_LIKE_THIS_AT_ALL".to_string(), None),
                ("UMBP_SSD_DIR".to_string(), Some("UMBP_SSD_DIRS".to_string())),
            ]
        );
        // Resolving the configuration only warns: the known variables still apply.
        assert!(with(&map).config().is_ok());
    }

    /// Every `UMBP_*` name quoted in the crate's code is in [`known_vars`], so the list cannot
    /// drift from what the store reads.
    #[test]
    fn every_variable_in_the_sources_is_known() {
        let known = known_vars();
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut missing = Vec::new();
        let mut seen = 0;
        let mut stack = vec![root];
        while let Some(d) = stack.pop() {
            for entry in std::fs::read_dir(&d).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    // known_vars() lists what this build reads: the cluster sources count only
                    // with the feature.
                    if cfg!(feature = "cluster") || !path.ends_with("cluster") {
                        stack.push(path);
                    }
                    continue;
                }
                let name = path.file_name().unwrap().to_string_lossy();
                // Unit-test files use made-up names.
                if !name.ends_with(".rs") || name == "tests.rs" || name.ends_with("_tests.rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                // Only the code before a file's unit tests.
                let code = text.split("#[cfg(test)]").next().unwrap_or("");
                for piece in code.split('"').skip(1).step_by(2) {
                    let is_var = piece.starts_with("UMBP_")
                        && piece.len() > 5
                        && piece
                            .bytes()
                            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
                    // A prefix the listener limits are appended to.
                    let prefix_only = piece == "UMBP_SERVER";
                    // Without the feature, code naming the cluster's variables is compiled out.
                    let compiled_out = !cfg!(feature = "cluster") && piece.starts_with("UMBP_CLUSTER");
                    if is_var && !prefix_only && !compiled_out {
                        seen += 1;
                        if !known.iter().any(|k| k == piece) {
                            missing.push(format!("{piece} ({})", path.display()));
                        }
                    }
                }
            }
        }
        assert!(
            seen > 20,
            "found only {seen} variable names: is the scan looking at the sources?"
        );
        assert!(missing.is_empty(), "read but not in known_vars(): {missing:?}");
    }

    #[test]
    fn defaults_and_overrides() {
        let c = with(&[]).config().unwrap();
        assert_eq!(c.core.dram_capacity, 1 << 30);
        assert!(c.core.ssd.is_none());
        assert!(matches!(c.mode, ModeConfig::Local));
        let c = with(&[
            ("UMBP_DRAM_CAPACITY", "64M"),
            ("UMBP_SSD_DIRS", "/tmp/a,/tmp/b"),
            ("UMBP_EVICTION", "lru"),
        ])
        .config()
        .unwrap();
        assert_eq!(c.core.dram_capacity, 64 << 20);
        assert_eq!(c.core.ssd.unwrap().dirs.len(), 2);
        assert_eq!(c.core.eviction, EvictionPolicy::Lru);
        // Explicit settings win over the environment.
        let c = with(&[("UMBP_DRAM_CAPACITY", "64M")])
            .dram_capacity(8 << 20)
            .config()
            .unwrap();
        assert_eq!(c.core.dram_capacity, 8 << 20);
    }

    #[test]
    fn malformed_values_are_rejected_by_name() {
        for (var, value) in [
            ("UMBP_DRAM_CAPACITY", "lots"),
            ("UMBP_DRAM_PAGE_BYTES", "1000"),
            ("UMBP_DRAM_HIGH_WATERMARK", "1.5"),
            ("UMBP_DRAM_LOW_WATERMARK", "0"),
            ("UMBP_DRAM_LOW_WATERMARK", "0.99"),
            ("UMBP_EVICTION", "random"),
            ("UMBP_SSD_DIRS", ""),
            ("UMBP_SSD_DIRS", "/tmp/a,,/tmp/b"),
            ("UMBP_SSD_STAGING_SLOTS", "0"),
            ("UMBP_SSD_STAGING_BYTES", "12345"),
            ("UMBP_SSD_WRITE_THROUGH", "maybe"),
            ("UMBP_RANGED_CALL_DEBUG", "2"),
            ("UMBP_PROMOTE_ON_READ", " 1"),
        ] {
            let err = with(&[(var, value)]).config().unwrap_err();
            assert!(err.to_string().contains(var), "{var}={value:?}: {err}");
        }
        for (var, value) in [
            ("UMBP_SSD_SEGMENT_BYTES", "100"),
            ("UMBP_SSD_DIRECT", "sometimes"),
            ("UMBP_SSD_IO", "aio"),
            ("UMBP_SSD_CAPACITY", "1K"),
            ("UMBP_SSD_COMPACT_BELOW", "1.5"),
        ] {
            let err = with(&[("UMBP_SSD_DIRS", "/tmp/x"), (var, value)]).config().unwrap_err();
            assert!(err.to_string().contains(var), "{var}={value:?}: {err}");
        }
        let err = with(&[("UMBP_DRAM_CAPACITY", "0")]).config().unwrap_err();
        assert!(err.to_string().contains("UMBP_DRAM_CAPACITY"));
    }
}
