//! Reading configuration from `TE_*` environment variables.
//!
//! Every reader is strict: a variable that is set but malformed (empty, non-numeric, negative,
//! trailing garbage, out of range) is an [`Error::Config`] naming the variable and the value. Unset
//! means "use the default"; nothing is ever silently defaulted. Readers take an [`Env`] so tests can
//! pass a map instead of mutating the process environment.

use std::collections::HashMap;
use std::str::FromStr;

use crate::error::{Error, Result};

/// A source of configuration variables.
pub trait Env: Send + Sync {
    /// The raw value of `var`, if set.
    fn get(&self, var: &str) -> Option<String>;

    /// The names of the variables set, for warning about unknown ones (default: none known).
    fn names(&self) -> Vec<String> {
        Vec::new()
    }
}

/// The process environment.
#[derive(Debug, Default, Clone, Copy)]
pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn get(&self, var: &str) -> Option<String> {
        std::env::var_os(var).map(|v| v.to_string_lossy().into_owned())
    }

    fn names(&self) -> Vec<String> {
        std::env::vars_os().filter_map(|(k, _)| k.into_string().ok()).collect()
    }
}

/// A fixed set of variables, for tests and for embedding.
#[derive(Debug, Default, Clone)]
pub struct MapEnv(pub HashMap<String, String>);

impl MapEnv {
    /// Builds a map from `(name, value)` pairs.
    pub fn new<const N: usize>(pairs: [(&str, &str); N]) -> Self {
        MapEnv(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }
}

impl Env for MapEnv {
    fn get(&self, var: &str) -> Option<String> {
        self.0.get(var).cloned()
    }

    fn names(&self) -> Vec<String> {
        self.0.keys().cloned().collect()
    }
}

/// The variables a listener's limits read under `prefix` (see `listener::ListenerLimits`).
pub const LISTENER_VAR_SUFFIXES: [&str; 4] = [
    "_MAX_CONNECTIONS",
    "_MAX_CONNECTIONS_PER_SOURCE",
    "_HANDSHAKE_TIMEOUT_MS",
    "_IDLE_TIMEOUT_MS",
];

/// A variable set in `env` under one of `prefixes` that none of the `known` names is, with the
/// known name closest to it (a likely typo).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownVar {
    /// The variable as set.
    pub name: String,
    /// The closest known variable, if any is close (edit distance at most a third of the name).
    pub closest: Option<String>,
}

impl std::fmt::Display for UnknownVar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.closest {
            Some(c) => write!(f, "{} is not a variable this build reads; did you mean {c}?", self.name),
            None => write!(f, "{} is not a variable this build reads", self.name),
        }
    }
}

/// Every variable of `env` that starts with one of `prefixes` and is not in `known`, sorted, each
/// with its closest known name. Callers log these as warnings: a typo must not pass silently.
pub fn unknown_vars<'a>(
    env: &dyn Env,
    prefixes: &[&str],
    known: impl IntoIterator<Item = &'a str> + Clone,
) -> Vec<UnknownVar> {
    let mut names: Vec<String> = env
        .names()
        .into_iter()
        .filter(|n| prefixes.iter().any(|p| n.starts_with(p)))
        .filter(|n| !known.clone().into_iter().any(|k| k == n))
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let closest = known
                .clone()
                .into_iter()
                .map(|k| (strsim::damerau_levenshtein(&name, k), k))
                .min()
                .filter(|(d, _)| *d <= name.len().div_ceil(3))
                .map(|(_, k)| k.to_string());
            UnknownVar { name, closest }
        })
        .collect()
}

/// Parses `var` with `FromStr`, rejecting empty values and surrounding whitespace.
pub fn parse_var<T>(env: &dyn Env, var: &str) -> Result<Option<T>>
where
    T: FromStr,
    T::Err: std::fmt::Display,
{
    let Some(raw) = env.get(var) else { return Ok(None) };
    parse_value(var, &raw).map(Some)
}

/// Parses one raw value of `var`.
pub fn parse_value<T>(var: &str, raw: &str) -> Result<T>
where
    T: FromStr,
    T::Err: std::fmt::Display,
{
    if raw.is_empty() {
        return Err(Error::config(var, raw, "empty value"));
    }
    if raw.trim() != raw {
        return Err(Error::config(var, raw, "surrounding whitespace"));
    }
    raw.parse::<T>().map_err(|e| Error::config(var, raw, e.to_string()))
}

/// Reads a variable that has an alias (`TE_X` and Mooncake's `MC_X`). Both set to different values
/// is an error naming both; both set to the same value is fine.
pub fn parse_var_with_alias<T>(env: &dyn Env, var: &str, alias: &str) -> Result<Option<T>>
where
    T: FromStr + PartialEq,
    T::Err: std::fmt::Display,
{
    let primary: Option<T> = parse_var(env, var)?;
    let secondary: Option<T> = parse_var(env, alias)?;
    match (primary, secondary) {
        (Some(a), Some(b)) if a != b => Err(Error::config(
            var,
            env.get(var).unwrap_or_default(),
            format!("conflicts with {alias}={:?}", env.get(alias).unwrap_or_default()),
        )),
        (Some(a), _) => Ok(Some(a)),
        (None, b) => Ok(b),
    }
}

/// A boolean switch: `1`, `true`, `on`, `yes` or `0`, `false`, `off`, `no`.
pub fn parse_bool(env: &dyn Env, var: &str) -> Result<Option<bool>> {
    let Some(raw) = env.get(var) else { return Ok(None) };
    match raw.as_str() {
        "1" | "true" | "on" | "yes" => Ok(Some(true)),
        "0" | "false" | "off" | "no" => Ok(Some(false)),
        _ => Err(Error::config(var, raw, "expected 1/0, true/false, on/off or yes/no")),
    }
}

/// A byte count: a plain integer, optionally with a K/M/G/KiB/MiB/GiB suffix (powers of two).
pub fn parse_bytes(env: &dyn Env, var: &str) -> Result<Option<u64>> {
    let Some(raw) = env.get(var) else { return Ok(None) };
    parse_byte_size(&raw)
        .map(Some)
        .map_err(|reason| Error::config(var, raw, reason))
}

/// Parses a byte size: the one grammar every size variable and command-line size uses.
///
/// A number (digits, optionally a decimal fraction) and an optional unit: `K`, `M`, `G`, `T`
/// (also `k`, and `KiB`, `MiB`, `GiB`, `TiB`) are powers of 1024, so `4K` is 4096; `KB`, `MB`,
/// `GB`, `TB` (also `kB`) are powers of 1000, as vendors and the seeds quote sizes (`2.79MB` is
/// 2,790,000); `B` or nothing is bytes. The result must be a whole number of bytes that fits 64
/// bits: `1.1K` (1126.4 bytes) is an error, not a rounding.
pub fn parse_byte_size(raw: &str) -> std::result::Result<u64, String> {
    if raw.is_empty() {
        return Err("empty value".into());
    }
    let number_end = raw
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(raw.len());
    let (number, unit) = raw.split_at(number_end);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() || (number.contains('.') && fraction.is_empty()) {
        return Err("expected a non-negative byte count such as 4096, 4K, 2.79MB or 2GiB".into());
    }
    if whole.len() > 20 || fraction.len() > 9 {
        return Err("byte count overflows 64 bits or has more than 9 decimals".into());
    }
    let mult: u128 = match unit {
        "" | "B" => 1,
        "K" | "k" | "KiB" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        "T" | "TiB" => 1 << 40,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        _ => {
            return Err(format!(
                "unknown size unit {unit:?} (K, M, G, T are powers of 1024; KB, MB, GB, TB of 1000)"
            ))
        }
    };
    // Exact decimal arithmetic: (whole.fraction) * mult = digits * mult / 10^decimals.
    let digits: u128 = format!("{whole}{fraction}").parse().map_err(|e| format!("{e}"))?;
    let scale = 10u128.pow(fraction.len() as u32);
    let scaled = digits * mult;
    if !scaled.is_multiple_of(scale) {
        return Err(format!("{raw} is not a whole number of bytes"));
    }
    u64::try_from(scaled / scale).map_err(|_| "byte count overflows 64 bits".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_values_name_the_variable() {
        for bad in ["", "abc", "-1", "12x", " 3"] {
            let env = MapEnv::new([("TE_X", bad)]);
            let err = parse_var::<u64>(&env, "TE_X").unwrap_err();
            assert!(err.to_string().contains("TE_X"), "{err}");
        }
        let env = MapEnv::new([("TE_X", "17")]);
        assert_eq!(parse_var::<u64>(&env, "TE_X").unwrap(), Some(17));
        assert_eq!(parse_var::<u64>(&env, "TE_Y").unwrap(), None);
    }

    #[test]
    fn alias_conflict_is_an_error() {
        let env = MapEnv::new([("TE_A", "4"), ("MC_A", "8")]);
        let err = parse_var_with_alias::<u64>(&env, "TE_A", "MC_A").unwrap_err();
        assert!(err.to_string().contains("MC_A"));
        let env = MapEnv::new([("MC_A", "8")]);
        assert_eq!(parse_var_with_alias::<u64>(&env, "TE_A", "MC_A").unwrap(), Some(8));
        let env = MapEnv::new([("TE_A", "8"), ("MC_A", "8")]);
        assert_eq!(parse_var_with_alias::<u64>(&env, "TE_A", "MC_A").unwrap(), Some(8));
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_byte_size("2K"), Ok(2048));
        assert_eq!(parse_byte_size("128KiB"), Ok(128 << 10));
        assert_eq!(parse_byte_size("1G"), Ok(1 << 30));
        assert_eq!(parse_byte_size("1T"), Ok(1 << 40));
        assert_eq!(parse_byte_size("4K"), parse_byte_size("4096"));
        assert_eq!(parse_byte_size("4KB"), Ok(4_000));
        assert_eq!(parse_byte_size("2.79MB"), Ok(2_790_000));
        assert_eq!(parse_byte_size("1.5K"), Ok(1_536));
        assert_eq!(parse_byte_size("391MB"), Ok(391_000_000));
        for bad in ["1.1K", "1.", ".5K", "1x", "-1", "1 K", "4Q", "0.0000000001G", "16E"] {
            assert!(parse_byte_size(bad).is_err(), "{bad:?}");
        }
        assert!(parse_byte_size("17179869184G").is_err(), "2^64 bytes overflows");
        assert!(parse_byte_size("").is_err());
        assert!(parse_byte_size("K").is_err());
        assert!(parse_byte_size("99999999999999999999G").is_err());
    }

    #[test]
    fn bools() {
        let env = MapEnv::new([("A", "1"), ("B", "off"), ("C", "maybe")]);
        assert_eq!(parse_bool(&env, "A").unwrap(), Some(true));
        assert_eq!(parse_bool(&env, "B").unwrap(), Some(false));
        assert!(parse_bool(&env, "C").is_err());
    }
}

#[cfg(test)]
mod unknown_var_tests {
    use super::*;

    #[test]
    fn unknown_variables_are_named_with_the_closest_known_one() {
        let env = MapEnv::new([
            ("TE_TCP_LANSE", "4"),
            ("TE_TCP_LANES", "4"),
            ("TE_SOMETHING_ELSE_ENTIRELY", "1"),
            ("MC_GID_INDX", "3"),
            ("PATH", "/bin"),
        ]);
        let known = ["TE_TCP_LANES", "TE_TCP_LISTEN", "MC_GID_INDEX"];
        let got = unknown_vars(&env, &["TE_", "MC_"], known);
        assert_eq!(
            got,
            vec![
                UnknownVar {
                    name: "MC_GID_INDX".into(),
                    closest: Some("MC_GID_INDEX".into())
                },
                UnknownVar {
                    name: "TE_SOMETHING_ELSE_ENTIRELY".into(),
                    closest: None
                },
                UnknownVar {
                    name: "TE_TCP_LANSE".into(),
                    closest: Some("TE_TCP_LANES".into())
                },
            ]
        );
        assert!(got[2].to_string().contains("did you mean TE_TCP_LANES?"), "{}", got[2]);
        assert!(unknown_vars(&MapEnv::default(), &["TE_"], known).is_empty());
    }
}
