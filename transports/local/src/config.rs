//! Configuration of the local-copy transport, read strictly from `TE_*` variables.

use te_base::config::{parse_bytes, parse_var, Env};
use te_base::{Error, Result};

/// Every variable this transport reads.
pub const ENV_VARS: &[&str] = &[COPY_THREADS_VAR, NT_COPY_MIN_BYTES_VAR, COPY_FANOUT_MIN_BYTES_VAR];

/// Variable naming the number of copy workers, the submitting thread included.
pub const COPY_THREADS_VAR: &str = "TE_COPY_THREADS";
/// Variable naming the smallest copy that uses non-temporal stores.
pub const NT_COPY_MIN_BYTES_VAR: &str = "TE_NT_COPY_MIN_BYTES";
/// Variable naming the smallest batch that is split across copy helpers.
pub const COPY_FANOUT_MIN_BYTES_VAR: &str = "TE_COPY_FANOUT_MIN_BYTES";

/// Default number of copy workers. Two was best on every shape the seed measured: past two, the
/// local copies outrun everything else the node does and stop paying.
pub const DEFAULT_COPY_THREADS: usize = 2;
/// Default non-temporal threshold. A ranged copy overwrites its destination completely, so reading
/// it for ownership first is wasted; 2 KiB is where streaming stores start to pay.
pub const DEFAULT_NT_COPY_MIN_BYTES: u64 = 2 << 10;
/// Default smallest rest of a batch handed to an awake helper. A batch starts on the submitting
/// thread at once, so waking a helper costs nothing on the critical path; sharing costs sorting
/// the rest (about 7 ns per fragment) and, for data already in this core's cache, did not pay on
/// the 2 vCPUs measured: a cache-resident 3.5 MiB batch of 1,728 B fragments ran at 0.73x the
/// memcpy loop when shared and 0.83x alone, while batches of 16.5 MiB and more ran at 1.56-1.95x
/// shared.
pub const DEFAULT_FANOUT_MIN_BYTES: u64 = 4 << 20;
/// Upper bound of `TE_COPY_THREADS`; more workers than this is a typo, not a plan.
pub const MAX_COPY_THREADS: usize = 64;

/// How the local-copy transport copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalConfig {
    /// Copy workers including the submitting thread (`TE_COPY_THREADS`, default 2). 1 copies
    /// inline on the submitting thread and starts no helper.
    pub copy_threads: usize,
    /// Copies of at least this many bytes use non-temporal stores (`TE_NT_COPY_MIN_BYTES`,
    /// default 2 KiB). Set it above every fragment size to turn streaming stores off.
    pub nt_copy_min_bytes: u64,
    /// A batch is shared with helpers only while at least this many of its bytes are left
    /// (`TE_COPY_FANOUT_MIN_BYTES`, default 4 MiB); smaller batches stay on the submitting thread.
    pub fanout_min_bytes: u64,
    /// Share a batch only with a helper that is already awake (true by default). On a machine with
    /// more runnable threads than cores, a parked helper can wait milliseconds for a core while
    /// the caller waits for it; with this set, such a batch is copied inline instead. False always
    /// shares (for dedicated machines, and to exercise the parallel path in tests).
    pub fanout_needs_awake_helper: bool,
}

impl Default for LocalConfig {
    fn default() -> Self {
        LocalConfig {
            copy_threads: DEFAULT_COPY_THREADS,
            nt_copy_min_bytes: DEFAULT_NT_COPY_MIN_BYTES,
            fanout_min_bytes: DEFAULT_FANOUT_MIN_BYTES,
            fanout_needs_awake_helper: true,
        }
    }
}

impl LocalConfig {
    /// Reads `TE_COPY_THREADS`, `TE_NT_COPY_MIN_BYTES` and `TE_COPY_FANOUT_MIN_BYTES` from `env`; unset means the default,
    /// anything malformed is an [`Error::Config`] naming the variable and the value.
    ///
    /// ```
    /// use te_base::config::MapEnv;
    /// use te_transport_local::LocalConfig;
    ///
    /// let cfg = LocalConfig::from_env(&MapEnv::new([("TE_COPY_THREADS", "1"), ("TE_NT_COPY_MIN_BYTES", "4K")])).unwrap();
    /// assert_eq!((cfg.copy_threads, cfg.nt_copy_min_bytes), (1, 4096));
    /// assert!(LocalConfig::from_env(&MapEnv::new([("TE_COPY_THREADS", "0")])).is_err());
    /// ```
    pub fn from_env(env: &dyn Env) -> Result<Self> {
        let mut cfg = LocalConfig::default();
        if let Some(threads) = parse_var::<usize>(env, COPY_THREADS_VAR)? {
            cfg.copy_threads = threads;
        }
        if let Some(bytes) = parse_bytes(env, NT_COPY_MIN_BYTES_VAR)? {
            cfg.nt_copy_min_bytes = bytes;
        }
        if let Some(bytes) = parse_bytes(env, COPY_FANOUT_MIN_BYTES_VAR)? {
            cfg.fanout_min_bytes = bytes;
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the values a caller set directly.
    pub fn validate(&self) -> Result<()> {
        if self.copy_threads == 0 {
            return Err(Error::config(
                COPY_THREADS_VAR,
                "0",
                "must be at least 1 (1 copies inline on the submitting thread)",
            ));
        }
        if self.copy_threads > MAX_COPY_THREADS {
            return Err(Error::config(
                COPY_THREADS_VAR,
                self.copy_threads.to_string(),
                format!("at most {MAX_COPY_THREADS} copy workers"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_base::config::MapEnv;

    #[test]
    fn defaults_when_unset() {
        let cfg = LocalConfig::from_env(&MapEnv::default()).unwrap();
        assert_eq!(cfg, LocalConfig::default());
        assert_eq!(cfg.copy_threads, 2);
        assert_eq!(cfg.nt_copy_min_bytes, 2048);
    }

    #[test]
    fn reads_both_variables() {
        let env = MapEnv::new([
            ("TE_COPY_THREADS", "4"),
            ("TE_NT_COPY_MIN_BYTES", "64KiB"),
            ("TE_COPY_FANOUT_MIN_BYTES", "1M"),
        ]);
        let cfg = LocalConfig::from_env(&env).unwrap();
        assert_eq!(cfg.copy_threads, 4);
        assert_eq!(cfg.nt_copy_min_bytes, 64 << 10);
        assert_eq!(cfg.fanout_min_bytes, 1 << 20);
    }

    #[test]
    fn malformed_values_name_the_variable() {
        for (var, bad) in [
            ("TE_COPY_THREADS", "0"),
            ("TE_COPY_THREADS", "-1"),
            ("TE_COPY_THREADS", "two"),
            ("TE_COPY_THREADS", ""),
            ("TE_COPY_THREADS", " 2"),
            ("TE_COPY_THREADS", "65"),
            ("TE_NT_COPY_MIN_BYTES", "2X"),
            ("TE_NT_COPY_MIN_BYTES", "-5"),
            ("TE_NT_COPY_MIN_BYTES", ""),
            ("TE_COPY_FANOUT_MIN_BYTES", "1 M"),
        ] {
            let err = LocalConfig::from_env(&MapEnv::new([(var, bad)])).unwrap_err();
            assert!(matches!(err, Error::Config { .. }), "{var}={bad:?}: {err}");
            assert!(err.to_string().contains(var), "{var}={bad:?}: {err}");
        }
    }
}
