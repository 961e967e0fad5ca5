//! The NIC policy in force: which NICs a buffer is registered on, read from the environment.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::Serialize;

use te_base::config::{parse_bytes, parse_var, parse_var_with_alias, Env};
use te_base::error::Result;

/// Selects `local` or `all` NICs per buffer.
pub const NIC_SELECTION_VAR: &str = "TE_NIC_SELECTION";
/// Mooncake's name for [`NIC_SELECTION_VAR`], accepted as an alias.
pub const NIC_SELECTION_ALIAS: &str = "MC_EFA_NIC_SELECTION";
/// Path of a priority-matrix JSON file that overrides the computed rail map.
pub const PRIORITY_MATRIX_VAR: &str = "TE_NIC_PRIORITY_MATRIX";
/// Transfers above this many bytes are striped across rails.
pub const STRIPE_MIN_BYTES_VAR: &str = "TE_STRIPE_MIN_BYTES";
/// Default of [`STRIPE_MIN_BYTES_VAR`]: 128 KiB.
pub const DEFAULT_STRIPE_MIN_BYTES: u64 = 128 << 10;

/// Which NICs a buffer is registered on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NicSelection {
    /// Only the rails local to the buffer (its GPU's PCI switch, its NUMA node). Registration cost
    /// is paid per NIC, so this is the default: 4 NICs instead of 32 per GPU buffer on p5.48xlarge.
    #[default]
    Local,
    /// Every NIC, as Mooncake does: most bandwidth per buffer, most registration time.
    All,
}

impl FromStr for NicSelection {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "local" => Ok(NicSelection::Local),
            "all" => Ok(NicSelection::All),
            _ => Err("expected local or all".into()),
        }
    }
}

impl fmt::Display for NicSelection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NicSelection::Local => "local",
            NicSelection::All => "all",
        })
    }
}

/// The NIC policy: selection, optional override file, striping threshold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NicPolicy {
    /// Local rails or all NICs.
    pub selection: NicSelection,
    /// A priority-matrix file overriding the computed map (from [`PRIORITY_MATRIX_VAR`]).
    pub matrix_path: Option<PathBuf>,
    /// Transfers of more than this many bytes are striped across the common rails.
    pub stripe_min_bytes: u64,
}

impl Default for NicPolicy {
    fn default() -> Self {
        NicPolicy {
            selection: NicSelection::Local,
            matrix_path: None,
            stripe_min_bytes: DEFAULT_STRIPE_MIN_BYTES,
        }
    }
}

impl NicPolicy {
    /// Reads `TE_NIC_SELECTION` (alias `MC_EFA_NIC_SELECTION`; both set and different is an
    /// error), `TE_NIC_PRIORITY_MATRIX` and `TE_STRIPE_MIN_BYTES`. Malformed values are
    /// [`Error::Config`](te_base::Error::Config) naming the variable.
    pub fn from_env(env: &dyn Env) -> Result<NicPolicy> {
        let selection = parse_var_with_alias::<NicSelection>(env, NIC_SELECTION_VAR, NIC_SELECTION_ALIAS)?;
        let matrix_path = parse_var::<PathBuf>(env, PRIORITY_MATRIX_VAR)?;
        let stripe_min_bytes = parse_bytes(env, STRIPE_MIN_BYTES_VAR)?;
        Ok(NicPolicy {
            selection: selection.unwrap_or_default(),
            matrix_path,
            stripe_min_bytes: stripe_min_bytes.unwrap_or(DEFAULT_STRIPE_MIN_BYTES),
        })
    }
}
