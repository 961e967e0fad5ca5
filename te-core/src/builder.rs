//! Configuring and starting an engine.

use std::sync::Arc;

use te_base::auth::AuthKey;
use te_base::config::{parse_bool, parse_var, Env, ProcessEnv};
use te_base::{Error, InstallContext, MetadataStore, Result, Transport};

use crate::engine::{TransferEngine, TransportStatus};
use crate::metadata::InProcessStore;

/// Builder for [`TransferEngine`]. Unset options come from `TE_*` variables, then defaults.
pub struct TransferEngineBuilder {
    name: Option<String>,
    metadata: Option<Arc<dyn MetadataStore>>,
    env: Arc<dyn Env>,
    phase_timing: Option<bool>,
    only: Option<Vec<String>>,
    custom: Vec<Arc<dyn Transport>>,
    auth: Option<AuthKey>,
    metrics_recorder: Option<Arc<dyn metrics::Recorder + Send + Sync>>,
    warm_up_segments: Option<bool>,
}

impl Default for TransferEngineBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl TransferEngineBuilder {
    /// Defaults: process environment, in-process metadata, every compiled-in transport.
    pub fn new() -> Self {
        TransferEngineBuilder {
            name: None,
            metadata: None,
            env: Arc::new(ProcessEnv),
            phase_timing: None,
            only: None,
            custom: Vec::new(),
            auth: None,
            metrics_recorder: None,
            warm_up_segments: None,
        }
    }

    /// The segment name (default `TE_SEGMENT_NAME`, else `<hostname>-<pid>`).
    pub fn segment_name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Where descriptors are published (default: the process-wide in-process store).
    pub fn metadata(mut self, store: Arc<dyn MetadataStore>) -> Self {
        self.metadata = Some(store);
        self
    }

    /// Where configuration variables are read from (default: the process environment).
    pub fn env(mut self, env: Arc<dyn Env>) -> Self {
        self.env = env;
        self
    }

    /// Records per-phase timings (default `TE_PHASE_TIMING`, else off).
    pub fn phase_timing(mut self, on: bool) -> Self {
        self.phase_timing = Some(on);
        self
    }

    /// Installs only the named transports (default: every compiled-in one; `TE_TRANSPORTS`
    /// is a comma-separated list).
    pub fn transports<I, S>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.only = Some(names.into_iter().map(Into::into).collect());
        self
    }

    /// Adds a transport built outside the engine (an out-of-tree backend, or a test double). It
    /// is preferred over the compiled-in ones.
    pub fn with_transport(mut self, transport: Arc<dyn Transport>) -> Self {
        self.custom.push(transport);
        self
    }

    /// The shared key every peer must prove before it may touch this engine's memory (default:
    /// the file `TE_AUTH_KEY_FILE` names; unset: listeners are open, logged once). See
    /// `docs/security.md`.
    pub fn auth_key(mut self, key: AuthKey) -> Self {
        self.auth = Some(key);
        self
    }

    /// Exports the engine's metrics to `recorder` (the embedding process's exporter) instead of
    /// the engine's own endpoint (`TE_METRICS_LISTEN`, which must then be unset). See
    /// [`crate::metrics`].
    pub fn metrics_recorder(mut self, recorder: Arc<dyn metrics::Recorder + Send + Sync>) -> Self {
        self.metrics_recorder = Some(recorder);
        self
    }

    /// Warms every segment up as [`crate::TransferEngine::open_segment`] opens it: each route's
    /// connections, queue pairs and rails connected and their handshakes done before the first
    /// transfer ([`crate::TransferEngine::warm_up`]). Default: `TE_WARM_UP` (off).
    pub fn warm_up_segments(mut self, on: bool) -> Self {
        self.warm_up_segments = Some(on);
        self
    }

    /// Installs the transports and publishes the (empty) descriptor.
    pub async fn build(self) -> Result<TransferEngine> {
        let env = self.env;
        for unknown in crate::env_check::check(&*env)? {
            tracing::warn!("{unknown}");
        }
        let auth = match self.auth {
            Some(k) => Some(k),
            None => AuthKey::from_env(&*env)?,
        };
        let name = match self.name {
            Some(n) => n,
            None => match parse_var::<String>(&*env, "TE_SEGMENT_NAME")? {
                Some(n) => n,
                None => format!("{}-{}", hostname(), std::process::id()),
            },
        };
        let phase_timing = match self.phase_timing {
            Some(p) => p,
            None => parse_bool(&*env, "TE_PHASE_TIMING")?.unwrap_or(false),
        };
        let only = match self.only {
            Some(o) => Some(o),
            None => parse_var::<String>(&*env, "TE_TRANSPORTS")?.map(|s| {
                s.split(',')
                    .map(|t| t.trim().to_string())
                    .filter(|t| !t.is_empty())
                    .collect()
            }),
        };
        if let Some(only) = &only {
            for n in only {
                if !crate::install::COMPILED_TRANSPORTS.contains(&n.as_str()) {
                    return Err(Error::config(
                        "TE_TRANSPORTS",
                        only.join(","),
                        format!(
                            "'{n}' is not compiled in (compiled: {:?})",
                            crate::install::COMPILED_TRANSPORTS
                        ),
                    ));
                }
            }
        }
        let plugins = crate::install::load_plugins();
        let inbox = te_base::NotifyInbox::new(te_base::NotifyLimits::from_env(&*env)?);
        let ctx = InstallContext {
            notifications: inbox.clone(),
            auth: auth.clone(),
            env: env.clone(),
            segment_name: name.clone(),
            devices: plugins.iter().filter_map(|p| p.plugin().cloned()).collect(),
        };
        let mut statuses: Vec<TransportStatus> = self
            .custom
            .iter()
            .map(|t| TransportStatus {
                name: t.name().to_string(),
                unavailable: None,
                skipped: t.skipped_devices(),
            })
            .collect();
        let mut transports: Vec<Arc<dyn Transport>> = self.custom;
        for (tname, result) in crate::install::install_all(&ctx, only.as_deref()).await {
            match result {
                Ok(t) => {
                    statuses.push(TransportStatus {
                        name: tname.to_string(),
                        unavailable: None,
                        skipped: t.skipped_devices(),
                    });
                    transports.push(t);
                }
                Err(Error::NotAvailable { reason, .. }) => {
                    tracing::info!("transport {tname}: not available: {reason}");
                    statuses.push(TransportStatus {
                        name: tname.to_string(),
                        unavailable: Some(reason),
                        skipped: Vec::new(),
                    });
                }
                // Devices found, none opened: unusable here, like "no device", so the engine
                // still serves on its other transports; every device is named with why.
                Err(Error::NoDeviceOpened { transport, skipped }) => {
                    let reason = Error::NoDeviceOpened {
                        transport,
                        skipped: skipped.clone(),
                    }
                    .to_string();
                    tracing::warn!("transport {tname}: not available: {reason}");
                    statuses.push(TransportStatus {
                        name: tname.to_string(),
                        unavailable: Some(reason),
                        skipped,
                    });
                }
                Err(e) => return Err(e),
            }
        }
        let metadata = match self.metadata {
            Some(m) => m,
            None => metadata_from_env(&*env, auth.as_ref()).await?,
        };
        let metrics_config = crate::metrics::MetricsConfig::from_env(&*env)?;
        let names = transports.iter().map(|t| t.name()).collect();
        let (export, serve) = match crate::metrics::setup(&metrics_config, self.metrics_recorder, names)? {
            Some(s) => (Some(s.export), s.serve),
            None => (None, None),
        };
        let engine = TransferEngine::assemble(
            name,
            metadata,
            env,
            transports,
            statuses,
            plugins,
            phase_timing,
            inbox,
            export,
            self.warm_up_segments,
        )
        .await?;
        if let Some(serve) = serve {
            let endpoint = crate::metrics::serve(&engine, &metrics_config, serve, auth).await?;
            let _ = engine.inner.metrics_endpoint.set(endpoint);
        }
        Ok(engine)
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "host".into())
}

/// `TE_METADATA`: `in-process` (default), `p2p` (this engine answers on `TE_P2P_LISTEN`), or
/// `etcd` (`TE_ETCD_ENDPOINTS`, `TE_ETCD_PREFIX`; needs the `etcd` feature).
async fn metadata_from_env(env: &dyn Env, auth: Option<&AuthKey>) -> Result<Arc<dyn MetadataStore>> {
    let choice = parse_var::<String>(env, "TE_METADATA")?;
    match choice.as_deref() {
        None | Some("in-process") => Ok(Arc::new(InProcessStore::global())),
        Some("p2p") => Ok(Arc::new(
            crate::metadata::p2p::P2pStore::from_env(env, auth.cloned()).await?,
        )),
        // etcd authenticates its clients itself (TLS / users); the shared key is for our listeners.
        #[cfg(feature = "etcd")]
        Some("etcd") => Ok(Arc::new(crate::metadata::etcd::EtcdStore::from_env(env).await?)),
        #[cfg(feature = "http-metadata")]
        Some("http") => Ok(Arc::new(crate::metadata::http::HttpMetadataStore::new(
            crate::metadata::http::HttpMetadataConfig::from_env(env)?,
        ))),
        Some(other) => Err(Error::config(
            "TE_METADATA",
            other,
            match other {
                "etcd" => "this build has no etcd support (cargo feature etcd)",
                "http" => "this build has no HTTP metadata support (cargo feature http-metadata)",
                _ => "expected in-process, p2p, etcd or http",
            },
        )),
    }
}
