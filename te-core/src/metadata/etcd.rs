//! Metadata in etcd (cargo feature `etcd`).
//!
//! - Descriptors live under `<prefix>/segments/<name>`; the prefix (`TE_ETCD_PREFIX`, default
//!   `/transfer-engine/default`) separates clusters sharing one etcd.
//! - Every key this store writes is attached to its lease (`TE_ETCD_LEASE_TTL_S`, default 10 s),
//!   kept alive from a background task: when the engine dies, its segments disappear once the
//!   lease runs out. A lease that expired anyway (etcd unreachable for longer than the TTL) is
//!   granted anew and the descriptors are written again.
//! - A watch on the prefix keeps a cache of every descriptor current, so a restarted peer's new
//!   descriptor (new `instance`) is picked up without polling: [`EtcdStore::subscribe`] reports
//!   each change and [`EtcdStore::cached`] answers from memory. [`MetadataStore::fetch`] always
//!   reads etcd (a linearizable get), so it never returns what another engine already replaced
//!   or removed.
//!
//! Every descriptor read from etcd is validated; a malformed one is an error for that segment only.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions,
};
use parking_lot::RwLock;
use te_base::config::{parse_var, Env};
use te_base::{DescriptorEvent, DescriptorWatch, Error, MetadataStore, Result, SegmentDescriptor};
use tokio::sync::broadcast;
use tokio::task::JoinHandle;

/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "/transfer-engine/default";
/// Default lease time-to-live in seconds.
pub const DEFAULT_LEASE_TTL_S: i64 = 10;
/// Default timeout of one etcd call.
pub const DEFAULT_TIMEOUT_MS: u64 = 5000;

/// Settings of the etcd store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// `TE_ETCD_ENDPOINTS`: comma-separated `host:port` or `http://host:port` endpoints.
    pub endpoints: Vec<String>,
    /// `TE_ETCD_PREFIX`: key prefix (cluster id); no trailing slash.
    pub prefix: String,
    /// `TE_ETCD_LEASE_TTL_S`: lease time-to-live in seconds (2..=3600).
    pub lease_ttl_s: i64,
    /// `TE_ETCD_TIMEOUT_MS`: timeout of one etcd call.
    pub timeout: Duration,
}

/// The etcd endpoint list every etcd setting takes (`TE_ETCD_ENDPOINTS`, UMBP's
/// `etcd://...`): comma-separated `host:port` or `scheme://host:port`, none empty, none with
/// whitespace. A malformed list is a config error naming `var`.
pub fn parse_endpoints(var: &str, raw: &str) -> Result<Vec<String>> {
    let endpoints: Vec<String> = raw.split(',').map(str::to_string).collect();
    for e in &endpoints {
        let hostport = e.split_once("://").map_or(e.as_str(), |(_, rest)| rest);
        if e.is_empty() || e.contains(char::is_whitespace) {
            return Err(Error::config(var, raw, "empty or padded endpoint in the list"));
        }
        if !hostport.contains(':') || hostport.starts_with(':') || hostport.ends_with(':') {
            return Err(Error::config(var, raw, format!("endpoint '{e}' is not host:port")));
        }
    }
    Ok(endpoints)
}

/// The key prefix every etcd setting takes: starts with '/', does not end with one, and has no
/// empty segment. A malformed prefix is a config error naming `var`.
pub fn check_prefix(var: &str, prefix: &str) -> Result<()> {
    if !prefix.starts_with('/') || prefix.ends_with('/') || prefix.contains("//") {
        return Err(Error::config(
            var,
            prefix,
            "must start with '/', not end with '/', and have no empty segment",
        ));
    }
    Ok(())
}

impl EtcdConfig {
    /// Settings for `endpoints` with default prefix, TTL and timeout.
    pub fn new(endpoints: Vec<String>) -> Self {
        EtcdConfig {
            endpoints,
            prefix: DEFAULT_PREFIX.into(),
            lease_ttl_s: DEFAULT_LEASE_TTL_S,
            timeout: Duration::from_millis(DEFAULT_TIMEOUT_MS),
        }
    }

    /// Reads `TE_ETCD_*`. `TE_ETCD_ENDPOINTS` is required.
    pub fn from_env(env: &dyn Env) -> Result<Self> {
        let raw = env
            .get("TE_ETCD_ENDPOINTS")
            .ok_or_else(|| Error::config("TE_ETCD_ENDPOINTS", "", "not set (expected host:port[,host:port...])"))?;
        let mut c = EtcdConfig::new(parse_endpoints("TE_ETCD_ENDPOINTS", &raw)?);
        if let Some(prefix) = parse_var::<String>(env, "TE_ETCD_PREFIX")? {
            check_prefix("TE_ETCD_PREFIX", &prefix)?;
            c.prefix = prefix;
        }
        if let Some(ttl) = parse_var::<i64>(env, "TE_ETCD_LEASE_TTL_S")? {
            if !(2..=3600).contains(&ttl) {
                return Err(Error::config(
                    "TE_ETCD_LEASE_TTL_S",
                    ttl.to_string(),
                    "must be 2..=3600",
                ));
            }
            c.lease_ttl_s = ttl;
        }
        if let Some(ms) = parse_var::<u64>(env, "TE_ETCD_TIMEOUT_MS")? {
            if ms == 0 {
                return Err(Error::config("TE_ETCD_TIMEOUT_MS", "0", "must be at least 1"));
            }
            c.timeout = Duration::from_millis(ms);
        }
        Ok(c)
    }
}

/// A change seen by the watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SegmentEvent {
    /// A descriptor was published or replaced (the instance it now has).
    Published {
        /// Segment name.
        name: String,
        /// The new descriptor's instance.
        instance: u64,
    },
    /// A descriptor was removed or its owner's lease expired.
    Removed {
        /// Segment name.
        name: String,
    },
}

struct Shared {
    client: Client,
    config: EtcdConfig,
    lease: AtomicI64,
    /// Descriptors this store published, rewritten if the lease had to be renewed.
    own: RwLock<HashMap<String, String>>,
    cache: RwLock<HashMap<String, SegmentDescriptor>>,
    watch_live: AtomicBool,
    events: broadcast::Sender<SegmentEvent>,
}

/// The etcd metadata store of one engine.
pub struct EtcdStore {
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("config", &self.shared.config)
            .field("lease", &self.shared.lease.load(Ordering::Relaxed))
            .finish()
    }
}

fn etcd_err(what: &str, e: etcd_client::Error) -> Error {
    Error::Metadata(format!("etcd: {what}: {e}"))
}

impl Shared {
    fn key(&self, name: &str) -> String {
        format!("{}/segments/{name}", self.config.prefix)
    }

    fn segments_prefix(&self) -> String {
        format!("{}/segments/", self.config.prefix)
    }

    async fn timed<T>(
        &self,
        what: &str,
        f: impl std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.config.timeout, f).await {
            Ok(r) => r.map_err(|e| etcd_err(what, e)),
            Err(_) => Err(Error::Timeout {
                what: format!("etcd: {what}"),
                after_ms: self.config.timeout.as_millis() as u64,
            }),
        }
    }

    async fn put(&self, name: &str, json: &str) -> Result<()> {
        let opts = PutOptions::new().with_lease(self.lease.load(Ordering::Acquire));
        let mut c = self.client.clone();
        self.timed(&format!("put {name}"), c.put(self.key(name), json, Some(opts)))
            .await
            .map(|_| ())
    }

    /// Applies one watched or listed key-value to the cache.
    fn apply(&self, key: &[u8], value: Option<&[u8]>) {
        let prefix = self.segments_prefix();
        let Some(name) = std::str::from_utf8(key).ok().and_then(|k| k.strip_prefix(&prefix)) else {
            return;
        };
        let event = match value.map(SegmentDescriptor::from_json) {
            Some(Ok(d)) if d.name == name => {
                let instance = d.instance;
                self.cache.write().insert(name.to_string(), d);
                SegmentEvent::Published {
                    name: name.to_string(),
                    instance,
                }
            }
            Some(Ok(_)) | Some(Err(_)) => {
                // Malformed or misfiled: forget it; a fetch reports why.
                tracing::warn!("etcd: ignoring an invalid descriptor under {name}");
                self.cache.write().remove(name);
                return;
            }
            None => {
                self.cache.write().remove(name);
                SegmentEvent::Removed { name: name.to_string() }
            }
        };
        let _ = self.events.send(event);
    }
}

impl EtcdStore {
    /// Connects, takes a lease and starts the keep-alive and watch tasks on the current runtime.
    pub async fn connect(config: EtcdConfig) -> Result<EtcdStore> {
        tokio::runtime::Handle::try_current()
            .map_err(|_| Error::Metadata("etcd: the store must be created inside a tokio runtime".into()))?;
        let opts = ConnectOptions::new()
            .with_connect_timeout(config.timeout)
            .with_timeout(config.timeout);
        let endpoints = config.endpoints.clone();
        let client = match tokio::time::timeout(config.timeout, Client::connect(&endpoints, Some(opts))).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(etcd_err(&format!("connecting to {endpoints:?}"), e)),
            Err(_) => {
                return Err(Error::Timeout {
                    what: format!("etcd: connecting to {endpoints:?}"),
                    after_ms: config.timeout.as_millis() as u64,
                })
            }
        };
        let (events, _) = broadcast::channel(1024);
        let shared = Arc::new(Shared {
            client,
            config,
            lease: AtomicI64::new(0),
            own: RwLock::new(HashMap::new()),
            cache: RwLock::new(HashMap::new()),
            watch_live: AtomicBool::new(false),
            events,
        });
        let mut c = shared.client.clone();
        let lease = shared
            .timed("granting a lease", c.lease_grant(shared.config.lease_ttl_s, None))
            .await?;
        shared.lease.store(lease.id(), Ordering::Release);
        // Fill the cache and start watching from the listing's revision, so no change is missed.
        let revision = list_into_cache(&shared).await?;
        let watch = tokio::spawn(watch_loop(shared.clone(), revision));
        let keep = tokio::spawn(keep_alive_loop(shared.clone()));
        Ok(EtcdStore {
            shared,
            tasks: vec![watch, keep],
        })
    }

    /// Connects with settings from `TE_ETCD_*`.
    pub async fn from_env(env: &dyn Env) -> Result<EtcdStore> {
        EtcdStore::connect(EtcdConfig::from_env(env)?).await
    }

    /// Changes to descriptors under the prefix, as the watch sees them.
    pub fn subscribe(&self) -> broadcast::Receiver<SegmentEvent> {
        self.shared.events.subscribe()
    }

    /// The descriptor of `name` as the watch last saw it, without asking etcd; `None` when the
    /// watch is down or the segment is unknown.
    pub fn cached(&self, name: &str) -> Option<SegmentDescriptor> {
        if !self.shared.watch_live.load(Ordering::Acquire) {
            return None;
        }
        self.shared.cache.read().get(name).cloned()
    }

    /// A handle on this store's etcd connection, for a layer above that keeps its own keys and
    /// leases in the same etcd (one connection per process rather than one per user).
    pub fn client(&self) -> Client {
        self.shared.client.clone()
    }

    /// The lease this store's keys are attached to.
    pub fn lease_id(&self) -> i64 {
        self.shared.lease.load(Ordering::Acquire)
    }

    /// Stops the background tasks and revokes the lease: this store's segments disappear now
    /// rather than when the lease runs out.
    pub async fn close(mut self) -> Result<()> {
        for t in self.tasks.drain(..) {
            t.abort();
        }
        let id = self.lease_id();
        let mut c = self.shared.client.clone();
        self.shared
            .timed("revoking the lease", c.lease_revoke(id))
            .await
            .map(|_| ())
    }
}

impl Drop for EtcdStore {
    /// Stops keeping the lease alive; the segments disappear when it runs out (as if the
    /// process died). Use [`EtcdStore::close`] to remove them at once.
    fn drop(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }
}

async fn list_into_cache(shared: &Shared) -> Result<i64> {
    let mut c = shared.client.clone();
    let resp = shared
        .timed(
            "listing segments",
            c.get(shared.segments_prefix(), Some(GetOptions::new().with_prefix())),
        )
        .await?;
    shared.cache.write().clear();
    for kv in resp.kvs() {
        shared.apply(kv.key(), Some(kv.value()));
    }
    Ok(resp.header().map(|h| h.revision()).unwrap_or(0))
}

async fn watch_loop(shared: Arc<Shared>, mut revision: i64) {
    loop {
        let opts = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
        let mut c = shared.client.clone();
        match c.watch(shared.segments_prefix(), Some(opts)).await {
            Ok(mut stream) => {
                shared.watch_live.store(true, Ordering::Release);
                while let Ok(Some(resp)) = stream.message().await {
                    if resp.canceled() {
                        break;
                    }
                    for ev in resp.events() {
                        let Some(kv) = ev.kv() else { continue };
                        revision = revision.max(kv.mod_revision());
                        match ev.event_type() {
                            EventType::Put => shared.apply(kv.key(), Some(kv.value())),
                            EventType::Delete => shared.apply(kv.key(), None),
                        }
                    }
                }
            }
            Err(e) => tracing::warn!("etcd: watch failed: {e}"),
        }
        // The watch broke (etcd restarted, compaction...): serve fetches from etcd until it is
        // re-established, and re-list so the cache holds no stale entry.
        shared.watch_live.store(false, Ordering::Release);
        tokio::time::sleep(Duration::from_millis(200)).await;
        if let Ok(r) = list_into_cache(&shared).await {
            revision = r;
        }
    }
}

/// Whether etcd still holds lease `id` (`None`: etcd did not answer within `timeout`). A lease
/// etcd no longer knows (it expired, or etcd lost its data) reads as gone, whether etcd answers
/// with a TTL of -1 or with a "requested lease not found" error. For every holder of an etcd
/// lease whose keep-alive broke: a broken keep-alive does not say which happened.
pub async fn lease_exists(client: &mut Client, id: i64, timeout: Duration) -> Option<bool> {
    match tokio::time::timeout(timeout, client.lease_time_to_live(id, None)).await {
        Ok(Ok(r)) => Some(r.ttl() > 0),
        Ok(Err(e)) if e.to_string().contains("lease not found") => Some(false),
        _ => None,
    }
}

async fn keep_alive_loop(shared: Arc<Shared>) {
    let period = Duration::from_millis((shared.config.lease_ttl_s as u64 * 1000) / 3);
    loop {
        let id = shared.lease.load(Ordering::Acquire);
        let mut c = shared.client.clone();
        let alive = match c.lease_keep_alive(id).await {
            Ok((mut keeper, mut stream)) => loop {
                if keeper.keep_alive().await.is_err() {
                    break true;
                }
                match stream.message().await {
                    Ok(Some(r)) if r.ttl() > 0 => tokio::time::sleep(period).await,
                    Ok(Some(_)) => break false,
                    _ => break true,
                }
            },
            Err(_) => true,
        };
        // A broken keep-alive does not say whether the lease is gone: an etcd that restarted
        // without its data answers with an error, not a TTL of 0. Ask; when etcd cannot be
        // reached, assume the lease lives and try again next period.
        let alive = alive && lease_exists(&mut c, id, shared.config.timeout).await != Some(false);
        if !alive {
            // The lease expired (etcd was out of reach too long): take a new one and write our
            // descriptors again.
            if let Ok(l) = shared
                .timed("granting a lease", c.lease_grant(shared.config.lease_ttl_s, None))
                .await
            {
                shared.lease.store(l.id(), Ordering::Release);
                let own: Vec<(String, String)> =
                    shared.own.read().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
                for (name, json) in own {
                    let _ = shared.put(&name, &json).await;
                }
            }
        }
        tokio::time::sleep(period.min(Duration::from_secs(1))).await;
    }
}

/// A watch on one segment, fed by the store's prefix watch (one etcd watch per store, however
/// many segments are followed).
struct EtcdWatch {
    shared: Arc<Shared>,
    name: String,
    events: broadcast::Receiver<SegmentEvent>,
}

impl EtcdWatch {
    /// The event for the descriptor the cache now holds (the watch already validated it).
    fn current(&self) -> DescriptorEvent {
        match self.shared.cache.read().get(&self.name) {
            Some(d) => DescriptorEvent::Changed(d.clone()),
            None => DescriptorEvent::Removed,
        }
    }
}

#[async_trait]
impl DescriptorWatch for EtcdWatch {
    async fn next(&mut self) -> Option<DescriptorEvent> {
        loop {
            match self.events.recv().await {
                Ok(SegmentEvent::Published { name, .. } | SegmentEvent::Removed { name }) if name == self.name => {
                    return Some(self.current())
                }
                Ok(_) => {}
                // Missed events: the cache holds the latest state, which is all a follower needs.
                Err(broadcast::error::RecvError::Lagged(_)) => return Some(self.current()),
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

#[async_trait]
impl MetadataStore for EtcdStore {
    fn name(&self) -> &'static str {
        "etcd"
    }

    async fn publish(&self, descriptor: &SegmentDescriptor) -> Result<()> {
        descriptor.validate()?;
        let json = descriptor.to_json();
        self.shared.put(&descriptor.name, &json).await?;
        self.shared.own.write().insert(descriptor.name.clone(), json);
        Ok(())
    }

    async fn fetch(&self, name: &str) -> Result<SegmentDescriptor> {
        let mut c = self.shared.client.clone();
        let resp = self
            .shared
            .timed(&format!("get {name}"), c.get(self.shared.key(name), None))
            .await?;
        let kv = resp
            .kvs()
            .first()
            .ok_or_else(|| Error::UnknownSegment(name.to_string()))?;
        let d = SegmentDescriptor::from_json(kv.value())?;
        if d.name != name {
            return Err(Error::InvalidDescriptor(format!(
                "etcd key of '{name}' holds segment '{}'",
                d.name
            )));
        }
        Ok(d)
    }

    /// Served by the store's one prefix watch: each put or delete of `name` (or its lease
    /// running out) is an event.
    async fn watch(&self, name: &str) -> Result<Option<Box<dyn DescriptorWatch>>> {
        Ok(Some(Box::new(EtcdWatch {
            shared: self.shared.clone(),
            name: name.to_string(),
            events: self.shared.events.subscribe(),
        })))
    }

    async fn remove(&self, name: &str) -> Result<()> {
        self.shared.own.write().remove(name);
        let mut c = self.shared.client.clone();
        self.shared
            .timed(&format!("delete {name}"), c.delete(self.shared.key(name), None))
            .await
            .map(|_| ())
    }

    /// Deletes the key only if it still holds what this store published: one etcd transaction,
    /// so a successor's descriptor written in between is never removed.
    async fn withdraw(&self, name: &str, instance: u64) -> Result<()> {
        let Some(json) = self.shared.own.read().get(name).cloned() else {
            return Ok(());
        };
        if SegmentDescriptor::from_json(json.as_bytes()).ok().map(|d| d.instance) != Some(instance) {
            return Ok(());
        }
        self.shared.own.write().remove(name);
        let key = self.shared.key(name);
        let txn = Txn::new()
            .when([Compare::value(key.clone(), CompareOp::Equal, json)])
            .and_then([TxnOp::delete(key, None)]);
        let mut c = self.shared.client.clone();
        self.shared
            .timed(&format!("withdraw {name}"), c.txn(txn))
            .await
            .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_base::config::MapEnv;

    /// The rules UMBP's `etcd://` URL shares with `TE_ETCD_*` (one source for both).
    #[test]
    fn endpoint_and_prefix_rules() {
        assert_eq!(
            parse_endpoints("V", "h:1,http://10.0.0.1:2379").unwrap(),
            ["h:1", "http://10.0.0.1:2379"]
        );
        for bad in ["", "h:1,", "h", " h:1", "h :1", "http://h", ":1", "h:"] {
            let e = parse_endpoints("V", bad).unwrap_err().to_string();
            assert!(e.contains('V'), "{bad}: {e}");
        }
        assert!(check_prefix("V", "/a/b").is_ok());
        for bad in ["", "/", "a", "/a/", "//a", "/a//b"] {
            assert!(check_prefix("V", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn config_is_strict() {
        let c = EtcdConfig::from_env(&MapEnv::new([("TE_ETCD_ENDPOINTS", "127.0.0.1:2379,10.0.0.1:2379")])).unwrap();
        assert_eq!(c.endpoints.len(), 2);
        assert_eq!(c.prefix, DEFAULT_PREFIX);
        assert!(EtcdConfig::from_env(&MapEnv::default())
            .unwrap_err()
            .to_string()
            .contains("TE_ETCD_ENDPOINTS"));
        for (var, bad) in [
            ("TE_ETCD_PREFIX", "no-slash"),
            ("TE_ETCD_PREFIX", "/trailing/"),
            ("TE_ETCD_LEASE_TTL_S", "1"),
            ("TE_ETCD_TIMEOUT_MS", "0"),
        ] {
            let env = MapEnv::new([("TE_ETCD_ENDPOINTS", "127.0.0.1:2379"), (var, bad)]);
            assert!(
                EtcdConfig::from_env(&env).unwrap_err().to_string().contains(var),
                "{var}={bad}"
            );
        }
        let env = MapEnv::new([("TE_ETCD_ENDPOINTS", "a:1,,b:2")]);
        assert!(EtcdConfig::from_env(&env).is_err());
    }
}
