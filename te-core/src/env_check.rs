//! Checking the whole configuration when an engine is built.
//!
//! Each transport reads its own variables when it installs, and one that is unusable here (no
//! EFA or RDMA device) never gets that far, so a typo in its settings would surface only on the
//! node that has the device. `build()` therefore parses every variable of every compiled-in
//! component first, whichever of them turn out usable, and warns about each `TE_*` / `MC_*`
//! variable that nothing reads, naming the closest one that something does.

use te_base::config::{unknown_vars, Env, UnknownVar, LISTENER_VAR_SUFFIXES};
use te_base::Result;

/// Variables te-core itself reads (engine, p2p and etcd metadata; the p2p listener's limits are
/// added by [`known_vars`]).
const ENGINE_VARS: &[&str] = &[
    "TE_SEGMENT_NAME",
    "TE_PHASE_TIMING",
    "TE_TRANSPORTS",
    "TE_METADATA",
    "TE_P2P_LISTEN",
    "TE_P2P_TIMEOUT_MS",
    "TE_P2P_MAX_ANSWER_BYTES",
    "TE_ETCD_ENDPOINTS",
    "TE_ETCD_PREFIX",
    "TE_ETCD_TIMEOUT_MS",
    "TE_ETCD_LEASE_TTL_S",
    "TE_METADATA_URL",
    "TE_METADATA_TIMEOUT_MS",
    crate::engine::TRANSFER_TIMEOUT_VAR,
    crate::engine::REGISTRATION_CACHE_VAR,
    crate::engine::FAILOVER_VAR,
    crate::engine::ROUTE_PAUSE_VAR,
    crate::engine::WARM_UP_VAR,
];

/// Every `TE_*` / `MC_*` variable this build reads: te-base's, te-topology's, te-core's and those of every
/// compiled-in transport and device plugin.
pub fn known_vars() -> Vec<String> {
    let mut vars: Vec<String> = te_base::ENV_VARS
        .iter()
        .chain(te_topology::ENV_VARS)
        .chain(ENGINE_VARS)
        .map(|v| v.to_string())
        .collect();
    vars.extend(LISTENER_VAR_SUFFIXES.iter().map(|s| format!("TE_P2P{s}")));
    vars.extend(crate::metrics::env_vars());
    for d in crate::install::DESCRIPTORS {
        vars.extend(d.env_vars.iter().map(|v| v.to_string()));
    }
    #[cfg(feature = "cuda")]
    vars.extend(te_plugin_cuda::ENV_VARS.iter().map(|v| v.to_string()));
    vars
}

/// Parses every variable of every compiled-in component (a malformed one is the same
/// `Error::Config` its component would return) and returns the unknown ones, which the builder
/// logs as warnings.
pub(crate) fn check(env: &dyn Env) -> Result<Vec<UnknownVar>> {
    te_base::registration::RegistrationConfig::from_env(env)?;
    te_topology::NicPolicy::from_env(env)?;
    te_base::NotifyLimits::from_env(env)?;
    crate::metadata::p2p::P2pConfig::from_env(env, None)?;
    crate::engine::check_transfer_timeout(env)?;
    crate::engine::registration_cache(env)?;
    crate::metrics::MetricsConfig::from_env(env)?;
    #[cfg(feature = "etcd")]
    if env.get("TE_ETCD_ENDPOINTS").is_some() {
        crate::metadata::etcd::EtcdConfig::from_env(env)?;
    }
    #[cfg(feature = "http-metadata")]
    if env.get("TE_METADATA_URL").is_some() {
        crate::metadata::http::HttpMetadataConfig::from_env(env)?;
    }
    for d in crate::install::DESCRIPTORS {
        (d.check_env)(env)?;
    }
    let known = known_vars();
    Ok(unknown_vars(env, &["TE_", "MC_"], known.iter().map(String::as_str)))
}
