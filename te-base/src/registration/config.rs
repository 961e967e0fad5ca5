//! The registration cap and order, read from the environment.
//!
//! The optimum measured on real nodes is `cap x local ranks ~= cores`: registration is CPU-bound
//! page pinning and oversubscribing the cores is punished super-linearly. One engine cannot know
//! how many peer processes share the node unless the launcher says so, so the cap is derived only
//! when a rank count is available and is otherwise left unbounded (the historical behaviour).

use std::fmt;
use std::num::NonZeroUsize;

use super::cpus::CpuBudget;
use super::order::RegOrder;
use crate::config::{parse_var, parse_var_with_alias, Env};
use crate::error::{Error, Result};

/// Per-process cap on concurrent registrations; 0 means unbounded.
pub const CAP_VAR: &str = "TE_MAX_CONCURRENT_REG_MR";
/// Mooncake's name for [`CAP_VAR`], accepted so existing settings carry over.
pub const CAP_ALIAS: &str = "MC_MAX_CONCURRENT_REG_MR";
/// Dispatch order: `ascending`, `descending` or `given`.
pub const ORDER_VAR: &str = "TE_REG_ORDER";
/// Variables that give the number of ranks (engines) on this node, in order of precedence.
pub const LOCAL_RANK_VARS: [&str; 4] = [
    "TE_LOCAL_RANKS",
    "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "SLURM_NTASKS_PER_NODE",
];

/// Why the cap is what it is.
#[derive(Debug, Clone, PartialEq)]
pub enum CapSource {
    /// Set explicitly by this variable (0 = unbounded).
    Configured {
        /// The variable that set it ([`CAP_VAR`] or [`CAP_ALIAS`]).
        var: &'static str,
    },
    /// Derived as max(1, cores / local ranks).
    Derived {
        /// Ranks sharing the node.
        local_ranks: usize,
        /// The variable the rank count came from.
        ranks_var: &'static str,
        /// The cores this process may use.
        cpus: CpuBudget,
    },
    /// No rank count is known, so the cap stays unbounded: deriving it from the cores alone would
    /// oversubscribe by exactly the unknown rank count.
    NoRankCount {
        /// The cores this process may use (for the report).
        cpus: CpuBudget,
    },
}

/// The cap in force and why.
#[derive(Debug, Clone, PartialEq)]
pub struct CapDecision {
    /// At most this many registrations at once per process; `None` = unbounded.
    pub cap: Option<NonZeroUsize>,
    /// Where the value came from.
    pub source: CapSource,
}

impl CapDecision {
    /// Decides the cap from `env` and the cores in `cpus`.
    ///
    /// Errors (each naming the variable): a malformed or negative cap, [`CAP_VAR`] and
    /// [`CAP_ALIAS`] set to different values, a malformed or zero rank count.
    pub fn from_env(env: &dyn Env, cpus: &CpuBudget) -> Result<Self> {
        let ranks = local_ranks(env)?;
        if let Some(value) = parse_var_with_alias::<usize>(env, CAP_VAR, CAP_ALIAS)? {
            let var = if env.get(CAP_VAR).is_some() { CAP_VAR } else { CAP_ALIAS };
            return Ok(CapDecision {
                cap: NonZeroUsize::new(value),
                source: CapSource::Configured { var },
            });
        }
        Ok(match ranks {
            Some((local_ranks, ranks_var)) => CapDecision {
                cap: NonZeroUsize::new((cpus.cores() / local_ranks).max(1)),
                source: CapSource::Derived {
                    local_ranks,
                    ranks_var,
                    cpus: cpus.clone(),
                },
            },
            None => CapDecision {
                cap: None,
                source: CapSource::NoRankCount { cpus: cpus.clone() },
            },
        })
    }

    /// The cap as a number, 0 meaning unbounded.
    pub fn value(&self) -> usize {
        self.cap.map_or(0, NonZeroUsize::get)
    }
}

impl fmt::Display for CapDecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.cap {
            Some(c) => write!(f, "cap {c}")?,
            None => write!(f, "unbounded")?,
        }
        match &self.source {
            CapSource::Configured { var } => write!(f, " (set by {var})"),
            CapSource::Derived {
                local_ranks,
                ranks_var,
                cpus,
            } => write!(f, " (derived: {cpus} / {local_ranks} local ranks from {ranks_var})"),
            CapSource::NoRankCount { cpus } => write!(
                f,
                " (default: no local rank count in {}; set {CAP_VAR} or one of those to bound it; {cpus})",
                LOCAL_RANK_VARS.join(", ")
            ),
        }
    }
}

/// The number of ranks on this node and the variable it came from: the first of
/// [`LOCAL_RANK_VARS`] that is set. Every one that is set must be a positive integer.
pub fn local_ranks(env: &dyn Env) -> Result<Option<(usize, &'static str)>> {
    let mut found = None;
    for var in LOCAL_RANK_VARS {
        if let Some(n) = parse_var::<usize>(env, var)? {
            if n == 0 {
                return Err(Error::config(var, "0", "a rank count must be at least 1"));
            }
            found = found.or(Some((n, var)));
        }
    }
    Ok(found)
}

/// Cap and order of the registration pool.
#[derive(Debug, Clone, PartialEq)]
pub struct RegistrationConfig {
    /// The cap and why.
    pub cap: CapDecision,
    /// Dispatch order: [`ORDER_VAR`] if set, else ascending when capped and given when unbounded.
    pub order: RegOrder,
    /// True if [`ORDER_VAR`] set the order.
    pub order_configured: bool,
}

impl RegistrationConfig {
    /// Reads the configuration, detecting the cores this process may use.
    pub fn from_env(env: &dyn Env) -> Result<Self> {
        Self::from_env_with_cpus(env, &CpuBudget::detect())
    }

    /// Reads the configuration against a known CPU budget.
    pub fn from_env_with_cpus(env: &dyn Env, cpus: &CpuBudget) -> Result<Self> {
        let cap = CapDecision::from_env(env, cpus)?;
        let configured = match env.get(ORDER_VAR) {
            None => None,
            Some(raw) => Some(raw.parse::<RegOrder>().map_err(|e| Error::config(ORDER_VAR, raw, e))?),
        };
        let order = configured.unwrap_or(if cap.cap.is_some() {
            RegOrder::Ascending
        } else {
            RegOrder::Given
        });
        Ok(RegistrationConfig {
            cap,
            order,
            order_configured: configured.is_some(),
        })
    }
}

impl fmt::Display for RegistrationConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let why = if self.order_configured { ORDER_VAR } else { "default" };
        write!(f, "{}, order {} ({why})", self.cap, self.order)
    }
}
