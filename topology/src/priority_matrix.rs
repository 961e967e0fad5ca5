//! Mooncake's NIC priority matrix: `{"cpu:0": [["preferred"...], ["available"...]], "cuda:0": ...}`.
//!
//! Operators already have these files, so the engine reads them as an override of its computed rail
//! map and prints its own map in the same form. Keys are `cpu:<numa node>`, `cuda:<ordinal>` and
//! `rocm:<ordinal>` (`hip:` accepted). A buffer whose location has an entry is registered on the
//! entry's preferred NICs (its available NICs when the preferred list is empty).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde_json::Value;

use super::discovery::Topology;
use super::policy::PRIORITY_MATRIX_VAR;
use te_base::error::{Error, Result};
use te_base::memory::MemoryLocation;

/// One entry: NICs to use first, and further NICs that may also be used.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MatrixEntry {
    /// Preferred NIC names, in order.
    pub preferred: Vec<String>,
    /// Other usable NIC names, in order.
    pub available: Vec<String>,
}

/// A parsed priority matrix, keyed by normalized location (`cpu:0`, `cuda:3`, `rocm:1`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PriorityMatrix {
    entries: BTreeMap<MatrixKey, MatrixEntry>,
}

/// A matrix key; orders `cpu` before `cuda` before `rocm`, then by number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MatrixKey {
    /// Host memory on a NUMA node.
    Cpu(u32),
    /// CUDA device ordinal.
    Cuda(u32),
    /// HIP device ordinal.
    Rocm(u32),
}

impl MatrixKey {
    /// Parses `cpu:N`, `cuda:N`, `rocm:N` or `hip:N`.
    pub fn parse(text: &str) -> std::result::Result<MatrixKey, String> {
        let bad = || format!("key {text:?} is not cpu:N, cuda:N or rocm:N");
        let (kind, n) = text.split_once(':').ok_or_else(bad)?;
        if n.is_empty() || !n.chars().all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        let n: u32 = n.parse().map_err(|_| bad())?;
        match kind {
            "cpu" => Ok(MatrixKey::Cpu(n)),
            "cuda" => Ok(MatrixKey::Cuda(n)),
            "rocm" | "hip" => Ok(MatrixKey::Rocm(n)),
            _ => Err(bad()),
        }
    }

    /// The key for a buffer location; `None` for host memory of unknown NUMA node.
    pub fn for_location(location: MemoryLocation) -> Option<MatrixKey> {
        match location {
            MemoryLocation::Host { numa: Some(n) } => Some(MatrixKey::Cpu(n)),
            MemoryLocation::Host { numa: None } => None,
            MemoryLocation::Cuda { device } => Some(MatrixKey::Cuda(device)),
            MemoryLocation::Rocm { device } => Some(MatrixKey::Rocm(device)),
        }
    }
}

impl std::fmt::Display for MatrixKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MatrixKey::Cpu(n) => write!(f, "cpu:{n}"),
            MatrixKey::Cuda(n) => write!(f, "cuda:{n}"),
            MatrixKey::Rocm(n) => write!(f, "rocm:{n}"),
        }
    }
}

impl PriorityMatrix {
    /// Parses the JSON text. Every problem is reported with the key and position it concerns.
    pub fn parse(text: &str) -> std::result::Result<PriorityMatrix, String> {
        let value: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
        let Value::Object(map) = value else {
            return Err("top level must be an object mapping locations to [[preferred], [available]]".into());
        };
        let mut entries = BTreeMap::new();
        for (key_text, entry) in map {
            let key = MatrixKey::parse(&key_text)?;
            let Value::Array(lists) = entry else {
                return Err(format!("{key_text}: expected [[preferred NICs], [available NICs]]"));
            };
            if lists.is_empty() || lists.len() > 2 {
                return Err(format!(
                    "{key_text}: expected 1 or 2 lists ([preferred], [available]), found {}",
                    lists.len()
                ));
            }
            let names = |i: usize, what: &str| -> std::result::Result<Vec<String>, String> {
                let Some(list) = lists.get(i) else {
                    return Ok(Vec::new());
                };
                let Value::Array(items) = list else {
                    return Err(format!("{key_text}: the {what} list is not an array"));
                };
                items
                    .iter()
                    .map(|item| match item {
                        Value::String(s) if !s.is_empty() => Ok(s.clone()),
                        _ => Err(format!("{key_text}: {what} NIC {item} is not a non-empty string")),
                    })
                    .collect()
            };
            let entry = MatrixEntry {
                preferred: names(0, "preferred")?,
                available: names(1, "available")?,
            };
            let mut seen = BTreeSet::new();
            for name in entry.preferred.iter().chain(&entry.available) {
                if !seen.insert(name) {
                    return Err(format!("{key_text}: NIC {name:?} is listed twice"));
                }
            }
            if seen.is_empty() {
                return Err(format!("{key_text}: lists no NIC"));
            }
            entries.insert(key, entry);
        }
        Ok(PriorityMatrix { entries })
    }

    /// Reads and parses a file; problems are [`Error::Config`] on `TE_NIC_PRIORITY_MATRIX` naming
    /// the file and what is wrong with it.
    pub fn load(path: &Path) -> Result<PriorityMatrix> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::config(PRIORITY_MATRIX_VAR, &shown, format!("cannot read the file: {e}")))?;
        PriorityMatrix::parse(&text).map_err(|reason| Error::config(PRIORITY_MATRIX_VAR, shown, reason))
    }

    /// Checks that every NIC the matrix names exists in `topology`.
    pub fn check_nics(&self, topology: &Topology) -> std::result::Result<(), String> {
        for (key, entry) in &self.entries {
            for name in entry.preferred.iter().chain(&entry.available) {
                if topology.nic_index(name).is_none() {
                    let known: Vec<&str> = topology.nics.iter().take(8).map(|n| n.name.as_str()).collect();
                    let more = topology.nics.len().saturating_sub(known.len());
                    return Err(format!(
                        "{key}: NIC {name:?} does not exist on this host (NICs: {}{})",
                        if known.is_empty() {
                            "none".to_string()
                        } else {
                            known.join(", ")
                        },
                        if more > 0 {
                            format!(" and {more} more")
                        } else {
                            String::new()
                        }
                    ));
                }
            }
        }
        Ok(())
    }

    /// The entry for `key`.
    pub fn get(&self, key: MatrixKey) -> Option<&MatrixEntry> {
        self.entries.get(&key)
    }

    /// Adds or replaces an entry.
    pub fn insert(&mut self, key: MatrixKey, entry: MatrixEntry) {
        self.entries.insert(key, entry);
    }

    /// Entries in key order.
    pub fn entries(&self) -> impl Iterator<Item = (MatrixKey, &MatrixEntry)> {
        self.entries.iter().map(|(k, v)| (*k, v))
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when there is no entry.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The JSON form Mooncake reads, one key per line, keys in `cpu`, `cuda`, `rocm` order.
    pub fn to_json(&self) -> String {
        let mut out = String::from("{");
        for (i, (key, entry)) in self.entries.iter().enumerate() {
            let lists = serde_json::json!([entry.preferred, entry.available]);
            out.push_str(if i == 0 { "\n  " } else { ",\n  " });
            out.push_str(&format!("\"{key}\": {lists}"));
        }
        out.push_str(if self.entries.is_empty() { "}" } else { "\n}" });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_mooncake_form() {
        let text = r#"{"cpu:0": [["mlx5_0"], ["mlx5_1"]], "cuda:10": [["a", "b"], []], "cuda:2": [["c"]]}"#;
        let m = PriorityMatrix::parse(text).unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(m.get(MatrixKey::Cuda(2)).unwrap().preferred, ["c"]);
        let printed = m.to_json();
        assert_eq!(PriorityMatrix::parse(&printed).unwrap(), m);
        assert!(printed.find("cuda:2").unwrap() < printed.find("cuda:10").unwrap());
    }

    #[test]
    fn malformed_matrices_say_what_is_wrong() {
        for (text, needle) in [
            ("[", "not valid JSON"),
            ("[]", "top level"),
            (r#"{"gpu:0": [["a"]]}"#, "gpu:0"),
            (r#"{"cuda:x": [["a"]]}"#, "cuda:x"),
            (r#"{"cuda:0": "a"}"#, "cuda:0"),
            (r#"{"cuda:0": []}"#, "found 0"),
            (r#"{"cuda:0": [["a"], ["b"], ["c"]]}"#, "found 3"),
            (r#"{"cuda:0": [["a", 3]]}"#, "preferred NIC 3"),
            (r#"{"cuda:0": [["a"], "b"]}"#, "available list"),
            (r#"{"cuda:0": [["a"], ["a"]]}"#, "twice"),
            (r#"{"cpu:1": [[], []]}"#, "lists no NIC"),
            (r#"{"cpu:1": [[""]]}"#, "non-empty string"),
        ] {
            let err = PriorityMatrix::parse(text).unwrap_err();
            assert!(err.contains(needle), "{text}: {err}");
        }
    }
}
