//! Membership in etcd, and the key directory this peer joined with (`key_directory.rs`: sharded
//! over the peers, the default, or in etcd).
//!
//! - `<prefix>/umbp/peers/<name>` holds a peer's control address and the DRAM bytes it last
//!   said it had free, attached to its lease: a dead peer's membership vanishes within the TTL
//!   without anyone cleaning up. A watch keeps an in-memory copy; lookups never ask etcd.
//! - The key directory is told each new membership (the sharded one then re-homes entries off
//!   the watch task). One kept in etcd is followed through the same watch. With a sharded
//!   directory, free capacity is re-announced only when it moved by an eighth of the arena, so
//!   etcd's load follows the membership, not the put rate.
//! - When etcd is out of reach the directory reports itself down (callers go local-only, a
//!   warning is logged once per outage); when it is back, the lease is re-granted if it expired,
//!   every local key is written again and the copy is re-listed.
//! - The member with the lowest name compacts etcd's history once a period, keeping one period
//!   of it (`UMBP_CLUSTER_COMPACT_S`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, PutOptions, WatchOptions};
use parking_lot::RwLock;
use tokio::task::JoinHandle;

use super::config::{ClusterConfig, DirectoryMode};
use super::conn::{ConnPool, Request};
use super::etcd_keys::EtcdKeys;
use super::guard::Guard;
use super::key_directory::{DirectoryCounters, KeyDirectory, Parts, Refused};
use super::membership::Membership;
use super::sharded::Sharded;
use super::wire::{self, Op, Renewal};
use crate::error::ClusterError;

/// What the directory knows, as the watch last saw it.
#[derive(Default)]
struct View {
    /// Peer name to control address, the DRAM bytes it last said it had free, and its lease
    /// (a new lease under the same name is a restarted peer).
    peers: HashMap<Arc<str>, (SocketAddr, u64, i64)>,
}

/// Lists the keys this peer holds (for re-publishing after an outage).
pub(crate) type LocalKeys = Box<dyn Fn() -> Vec<String> + Send + Sync>;
/// This peer's free DRAM bytes (announced with its membership, for remote puts).
pub(crate) type FreeBytes = Box<dyn Fn() -> u64 + Send + Sync>;

pub(crate) struct Directory {
    /// Control connections: those to a peer that left or restarted are dropped when the watch
    /// sees it.
    pool: Arc<ConnPool>,
    /// Peers seen leaving or restarting since the read path last asked ([`Directory::take_restarted`]).
    restarted: parking_lot::Mutex<Vec<Arc<str>>>,
    any_restarted: AtomicBool,
    client: Client,
    cfg: ClusterConfig,
    name: Arc<str>,
    addr: SocketAddr,
    lease: Arc<AtomicI64>,
    /// Whether the lease is known to stand, so this peer may serve its own copies.
    pub(crate) standing: super::standing::Standing,
    view: RwLock<View>,
    /// The watch is established and the view current.
    live: AtomicBool,
    /// A publication failed: every local key is written again when etcd is back.
    dirty: AtomicBool,
    /// Re-joins under a new lease after the old one lapsed (`lease_rejoins`).
    rejoins: AtomicU64,
    warned: AtomicBool,
    local_keys: LocalKeys,
    free_bytes: FreeBytes,
    /// The free bytes last announced (sharded mode re-announces only on a large move), and the
    /// most ever seen free (the move's scale).
    announced_free: AtomicU64,
    free_scale: AtomicU64,
    /// Where keys' owners are recorded.
    keys: Arc<dyn KeyDirectory>,
    /// `<prefix>/umbp/peers/`, and the key directory's subtree in etcd if it keeps one.
    peers_prefix: String,
    keys_prefix: Option<String>,
    tasks: parking_lot::Mutex<Vec<JoinHandle<()>>>,
}

impl Directory {
    /// What the watch follows: membership, and the key directory's subtree if it has one.
    fn root(&self) -> String {
        match self.keys_prefix {
            None => self.peers_prefix.clone(),
            Some(_) => format!("{}/umbp/", self.cfg.prefix),
        }
    }

    async fn timed<T, E: std::fmt::Display>(
        &self,
        what: &'static str,
        f: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, ClusterError> {
        match tokio::time::timeout(self.cfg.timeout, f).await {
            Ok(r) => r.map_err(|e| ClusterError::etcd(what, e)),
            Err(_) => Err(ClusterError::EtcdTimeout {
                what,
                ms: self.cfg.timeout.as_millis() as u64,
            }),
        }
    }

    /// Joins (membership under a fresh lease) on `client` (the engine's etcd connection), lists
    /// the directory and starts the watch and keep-alive tasks on the current runtime (the
    /// cluster's). `pool` carries the sharded directory's messages.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn join(
        cfg: ClusterConfig,
        client: Client,
        pool: Arc<ConnPool>,
        name: String,
        addr: SocketAddr,
        local_keys: LocalKeys,
        free_bytes: FreeBytes,
        owner: std::sync::Weak<super::owner::Owner>,
    ) -> Result<Arc<Directory>, ClusterError> {
        let name: Arc<str> = Arc::from(name.as_str());
        let lease = Arc::new(AtomicI64::new(0));
        let keys = build(
            &cfg,
            Parts {
                name: name.clone(),
                pool: pool.clone(),
                owner,
                client: client.clone(),
                lease: lease.clone(),
                runtime: tokio::runtime::Handle::current(),
            },
        );
        let cfg_prefix = cfg.prefix.clone();
        let d = Arc::new(Directory {
            pool,
            restarted: Default::default(),
            any_restarted: AtomicBool::new(false),
            client,
            cfg,
            name,
            addr,
            lease,
            standing: super::standing::Standing::new(),
            view: RwLock::default(),
            live: AtomicBool::new(false),
            dirty: AtomicBool::new(false),
            rejoins: AtomicU64::new(0),
            warned: AtomicBool::new(false),
            local_keys,
            free_bytes,
            announced_free: AtomicU64::new(0),
            free_scale: AtomicU64::new(0),
            peers_prefix: format!("{cfg_prefix}/umbp/peers/"),
            keys_prefix: keys.etcd_subtree().map(|s| format!("{cfg_prefix}/umbp/{s}")),
            keys,
            tasks: parking_lot::Mutex::new(Vec::new()),
        });
        d.grant().await?;
        d.announce().await?;
        let revision = d.list().await?;
        let watch = tokio::spawn(watch_loop(d.clone(), revision));
        let keep = tokio::spawn(keep_alive_loop(d.clone()));
        d.tasks.lock().extend([watch, keep]);
        Ok(d)
    }

    /// The end of a directory call started now (the cluster timeout).
    pub(crate) fn deadline(&self) -> std::time::Instant {
        std::time::Instant::now() + self.cfg.timeout
    }

    /// The key directory this peer joined with.
    pub(crate) fn keys(&self) -> &Arc<dyn KeyDirectory> {
        &self.keys
    }

    async fn grant(&self) -> Result<(), ClusterError> {
        let mut c = self.client.clone();
        let sent = std::time::Instant::now();
        let l = self
            .timed("granting a lease", c.lease_grant(self.cfg.lease_ttl_s, None))
            .await?;
        self.lease.store(l.id(), Ordering::Release);
        self.standing
            .confirmed(sent, Duration::from_secs(l.ttl().max(0) as u64));
        Ok(())
    }

    fn lease_opts(&self) -> PutOptions {
        PutOptions::new().with_lease(self.lease.load(Ordering::Acquire))
    }

    async fn announce(&self) -> Result<(), ClusterError> {
        let mut c = self.client.clone();
        let key = format!("{}{}", self.peers_prefix, self.name);
        let free = (self.free_bytes)();
        self.timed(
            "announcing this peer",
            c.put(key, format!("{} {free}", self.addr), Some(self.lease_opts())),
        )
        .await?;
        self.announced_free.store(free, Ordering::Relaxed);
        self.free_scale.fetch_max(free, Ordering::Relaxed);
        Ok(())
    }

    /// Re-announces the free capacity: every keep-alive period with the directory in etcd (as
    /// before); with the sharded one when it moved by more than an eighth of the most this peer ever had free
    /// (about its arena), so that a full cluster's steady eviction churn, a few pages either
    /// way, writes nothing to etcd.
    async fn refresh_free(&self) -> Result<(), ClusterError> {
        if !self.keys.lives_in_etcd() {
            let (was, now) = (self.announced_free.load(Ordering::Relaxed), (self.free_bytes)());
            let scale = self.free_scale.fetch_max(now, Ordering::Relaxed).max(now);
            if was.abs_diff(now) <= scale / 8 {
                return Ok(());
            }
        }
        self.announce().await
    }

    /// Reads the whole directory into the view; returns the revision it was read at.
    async fn list(self: &Arc<Self>) -> Result<i64, ClusterError> {
        let mut c = self.client.clone();
        let resp = self
            .timed(
                "listing the directory",
                c.get(self.root(), Some(GetOptions::new().with_prefix())),
            )
            .await?;
        let mut view = View::default();
        let mut entries = Vec::new();
        for kv in resp.kvs() {
            self.apply_to(&mut view, &mut entries, kv.key(), Some((kv.value(), kv.lease())));
        }
        let unlisted = {
            let mut cur = self.view.write();
            let unlisted: Vec<(Arc<str>, i64)> = cur
                .peers
                .iter()
                .filter(|(n, _)| !view.peers.contains_key(*n))
                .map(|(n, &(_, _, lease))| (n.clone(), lease))
                .collect();
            for (n, _) in &unlisted {
                view.peers.insert(n.clone(), cur.peers[n]);
            }
            *cur = view;
            unlisted
        };
        self.membership_seen();
        self.drop_unless_rejoined(unlisted);
        self.keys
            .listed(entries.into_iter().filter_map(|(k, v)| Some((k, v?))).collect());
        Ok(resp.header().map(|h| h.revision()).unwrap_or(0))
    }

    /// Members a re-list did not show, kept until a lease TTL has passed (`unlisted`: name and
    /// the lease it had). No watch saw them go, so the listing alone cannot tell a member that
    /// left from one etcd forgot: after etcd restarted empty every member is missing until it
    /// re-joins under a new lease, and a view without them sends keys to other directory peers,
    /// whose entries need not meet the writes already acknowledged. One still under its old
    /// lease after the TTL (not re-joined; a watch would have shown a re-join) is dropped then.
    fn drop_unless_rejoined(self: &Arc<Self>, unlisted: Vec<(Arc<str>, i64)>) {
        if unlisted.is_empty() {
            return;
        }
        let d = Arc::downgrade(self);
        let ttl = Duration::from_secs(self.cfg.lease_ttl_s.max(1) as u64);
        // Among the tasks `leave` stops: a closed peer drops nobody from a view it no longer uses.
        let mut tasks = self.tasks.lock();
        tasks.retain(|t| !t.is_finished());
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(ttl).await;
            let Some(d) = d.upgrade() else { return };
            let mut gone = false;
            {
                let mut view = d.view.write();
                for (name, lease) in &unlisted {
                    if view.peers.get(name).is_some_and(|&(_, _, l)| l == *lease) {
                        let key = format!("{}{name}", d.peers_prefix);
                        gone |= d.apply_to(&mut view, &mut Vec::new(), key.as_bytes(), None);
                    }
                }
            }
            if gone {
                tracing::info!("umbp cluster: members missing from etcd for a lease TTL dropped");
                d.membership_seen();
            }
        }));
    }

    /// After the view's peers changed: tells the key directory the new membership and, if its
    /// members differ, has it re-home entries off the watch task (the sharded one's prune and
    /// publications walk every key).
    fn membership_seen(self: &Arc<Self>) {
        let m = Membership::new(self.view.read().peers.iter().map(|(n, &(a, _, l))| (n.clone(), a, l)));
        let Some(old) = self.keys.set_membership(m) else { return };
        let d = self.clone();
        tokio::task::spawn_blocking(move || {
            let keys = (d.local_keys)();
            if let Err(e) = d.keys.rebalance(&old, &keys) {
                d.dirty.store(true, Ordering::Release);
                tracing::warn!("umbp cluster: re-homing directory entries: {e}; retried within a lease period");
            }
        });
    }

    /// Applies one membership entry to `view`, or adds one of the key directory's to `keys` (key
    /// below its subtree, new value or `None`: deleted); returns whether the members changed.
    fn apply_to(
        &self,
        view: &mut View,
        keys: &mut Vec<(String, Option<String>)>,
        key: &[u8],
        value: Option<(&[u8], i64)>,
    ) -> bool {
        let Ok(key) = std::str::from_utf8(key) else {
            return false;
        };
        if let Some(peer) = key.strip_prefix(&self.peers_prefix) {
            // "addr free_bytes"
            let entry = value.and_then(|(v, lease)| {
                let mut w = std::str::from_utf8(v).ok()?.split_whitespace();
                let addr = w.next()?.parse().ok()?;
                Some((addr, w.next().and_then(|f| f.parse().ok()).unwrap_or(0), lease))
            });
            let old = match entry {
                Some(e) => view.peers.insert(Arc::from(peer), e),
                None => view.peers.remove(peer),
            };
            // A new lease under the name is a restarted peer, none a departed one: connections
            // pooled to the old instance are dead (a request on one would fail or wait).
            if old.is_some_and(|o| entry.is_none_or(|e| e.2 != o.2)) {
                self.pool.forget(peer);
                // The read path forgets its segment and remembered placements at its next call.
                self.restarted.lock().push(Arc::from(peer));
                self.any_restarted.store(true, Ordering::Release);
            }
            return true;
        }
        if let Some(k) = self.keys_prefix.as_deref().and_then(|p| key.strip_prefix(p)) {
            let owner = value.and_then(|(v, _)| std::str::from_utf8(v).ok());
            keys.push((k.to_owned(), owner.map(str::to_owned)));
        }
        false
    }

    /// The peers seen leaving or coming back under a new lease since the last call (one atomic
    /// load when there are none).
    pub(crate) fn take_restarted(&self) -> Vec<Arc<str>> {
        if !self.any_restarted.swap(false, Ordering::AcqRel) {
            return Vec::new();
        }
        std::mem::take(&mut *self.restarted.lock())
    }

    /// True while the watch is established; logs once per outage when it is not.
    pub(crate) fn is_live(&self) -> bool {
        let live = self.live.load(Ordering::Acquire);
        if !live && !self.warned.swap(true, Ordering::AcqRel) {
            tracing::warn!("umbp cluster: etcd is out of reach; serving local keys only until it is back");
        }
        live
    }

    /// The owner and its control address of each key (`None`: not in the directory, owned by
    /// this peer, or its owner is not a live member); blocking, by `end`.
    pub(crate) fn owners(&self, keys: &[&str], end: std::time::Instant) -> Vec<Option<(Arc<str>, SocketAddr)>> {
        self.keys.owners(keys, end)
    }

    /// The owner of `key` as the directory says (for visibility checks); blocking, within the
    /// cluster timeout.
    pub(crate) fn owner_of(&self, key: &str) -> Option<Arc<str>> {
        self.keys.owner_of(key, self.deadline())
    }

    /// Times the lease lapsed and this peer re-joined under a new one.
    pub(crate) fn rejoins(&self) -> u64 {
        self.rejoins.load(Ordering::Relaxed)
    }

    /// The key directory's counters.
    pub(crate) fn counters(&self) -> DirectoryCounters {
        self.keys.counters()
    }

    /// The control address of each live member named by `names` (one read lock for the batch).
    pub(crate) fn addrs_of<'n>(&self, names: impl Iterator<Item = &'n str>) -> Vec<Option<SocketAddr>> {
        let view = self.view.read();
        names.map(|n| view.peers.get(n).map(|&(a, _, _)| a)).collect()
    }

    /// Live members and their control addresses.
    pub(crate) fn members(&self) -> Vec<(Arc<str>, SocketAddr)> {
        self.view
            .read()
            .peers
            .iter()
            .map(|(n, &(a, _, _))| (n.clone(), a))
            .collect()
    }

    /// The other live member with the most free DRAM, if it announced at least `need` bytes.
    pub(crate) fn roomiest_peer(&self, need: u64) -> Option<(Arc<str>, SocketAddr)> {
        let view = self.view.read();
        view.peers
            .iter()
            .filter(|(n, &(_, free, _))| ***n != *self.name && free >= need)
            .max_by_key(|(_, &(_, free, _))| free)
            .map(|(n, &(a, _, _))| (n.clone(), a))
    }

    /// Writes `keys` as owned by this peer, by `end` (blocking). On failure the directory is
    /// marked for a full re-publication, which the keep-alive loop does within a lease period
    /// (at once when etcd answers again after an outage). `fresh`: the keys were just written
    /// here, else a re-publication of keys held. Returns the keys a fresh write may not
    /// acknowledge (their copies here are dropped).
    pub(crate) fn publish(&self, keys: &[String], fresh: bool, end: std::time::Instant) -> Refused {
        match self.keys.publish(keys, fresh, end) {
            Ok(refused) => refused,
            Err(e) => {
                self.dirty.store(true, Ordering::Release);
                tracing::warn!(
                    "umbp cluster: publishing {} keys failed ({e}); every local key is written again within a lease period",
                    keys.len()
                );
                Vec::new()
            }
        }
    }

    /// Writes every local key again (after an outage or a lost lease), off the runtime's
    /// workers; an error leaves the directory marked for another try.
    async fn republish(&self) -> Result<(), ClusterError> {
        let (dir, keys) = (self.keys.clone(), (self.local_keys)());
        let end = self.deadline();
        tokio::task::spawn_blocking(move || dir.publish(&keys, false, end))
            .await
            .map_err(|e| ClusterError::Task {
                what: "publishing",
                message: e.to_string(),
            })?
            .map(drop)
    }

    /// Asks for every local key to be written again once etcd answers.
    pub(crate) fn mark_dirty(&self) {
        self.dirty.store(true, Ordering::Release);
    }

    /// Keeps `lease` alive once on a member's behalf (RENEW), within half the timeout. Only the
    /// lease this peer's view holds for `member` is renewed (a member speaks only for itself);
    /// any other is answered gone, as it is for this view.
    pub(crate) async fn renew_for(&self, member: &str, lease: i64) -> Renewal {
        let known = self.view.read().peers.get(member).map(|&(_, _, l)| l);
        if known != Some(lease) {
            return Renewal::Gone;
        }
        let mut c = self.client.clone();
        let once = async {
            let (mut keeper, mut stream) = c.lease_keep_alive(lease).await?;
            keeper.keep_alive().await?;
            stream.message().await
        };
        let half = self.cfg.timeout / 2;
        match tokio::time::timeout(half, once).await {
            Ok(Ok(Some(r))) if r.ttl() > 0 => Renewal::Renewed { ttl_s: r.ttl() as u64 },
            Ok(Ok(Some(_))) => Renewal::Gone,
            _ => match te_core::metadata::etcd::lease_exists(&mut self.client.clone(), lease, half).await {
                Some(false) => Renewal::Gone,
                // Alive, but not renewed by this peer: say nothing stronger.
                Some(true) | None => Renewal::EtcdUnreachable,
            },
        }
    }

    /// This peer's keep-alive got no answer from etcd: asks up to three other members of the
    /// last view to renew the lease for it (not with a directory in etcd: `None`). Renewed: the lease stands as if etcd had answered (`Some(false)`). Gone: the
    /// lease expired (`Some(true)`). Otherwise `None`, with the standing noting whether the
    /// members asked cannot reach etcd either (an outage everyone sees: local copies are served
    /// as before) or none answered (this peer is cut off: its standing runs out a TTL after its
    /// last confirmation).
    async fn renew_through_peers(&self, lease: i64) -> Option<bool> {
        if self.keys.lives_in_etcd() {
            return None;
        }
        let mut others: Vec<(Arc<str>, SocketAddr)> =
            self.members().into_iter().filter(|(n, _)| **n != *self.name).collect();
        // Members that answered lately first, then by name, so the same ones relay each time.
        let suspects = self.pool.suspects(Duration::from_secs(self.cfg.lease_ttl_s as u64));
        others.sort_by_key(|(n, _)| (suspects.contains(n), n.clone()));
        let reqs: Vec<Request> = others
            .into_iter()
            .take(3)
            .map(|(peer, addr)| Request {
                peer,
                addr,
                op: Op::Renew,
                body: wire::encode_renew(lease),
            })
            .collect();
        if reqs.is_empty() {
            // The only member: nobody to ask, nobody who could have written meanwhile.
            self.standing.etcd_out_for_all(true);
            return None;
        }
        let sent = std::time::Instant::now();
        let end = sent + self.cfg.timeout;
        let pool = self.pool.clone();
        let answers = tokio::task::spawn_blocking(move || pool.exchange(&reqs, end))
            .await
            .unwrap_or_default();
        let (mut ttl, mut gone, mut down) = (None, false, false);
        for a in answers {
            let Ok((Op::Renewed, body)) = a else { continue };
            match wire::decode_renewed(&body) {
                Ok(Renewal::Renewed { ttl_s }) => ttl = ttl.max(Some(ttl_s)),
                Ok(Renewal::Gone) => gone = true,
                Ok(Renewal::EtcdUnreachable) => down = true,
                Err(_) => {}
            }
        }
        if let Some(ttl_s) = ttl {
            self.standing.confirmed(sent, Duration::from_secs(ttl_s));
            return Some(false);
        }
        if gone {
            return Some(true);
        }
        self.standing.etcd_out_for_all(down);
        None
    }

    /// Leaves: stops the tasks and revokes the lease, so this peer's membership and keys vanish
    /// now rather than at the TTL.
    pub(crate) async fn leave(&self) {
        for t in self.tasks.lock().drain(..) {
            t.abort();
        }
        let mut c = self.client.clone();
        let id = self.lease.load(Ordering::Acquire);
        if let Err(e) = self.timed("revoking the lease", c.lease_revoke(id)).await {
            tracing::warn!("umbp cluster: leaving: {e}");
        }
    }

    /// After an outage: a new lease if the old one expired, membership and every local key
    /// written again.
    async fn recover(&self, lease_expired: bool) -> Result<(), ClusterError> {
        if lease_expired {
            self.grant().await?;
        }
        self.announce().await?;
        if lease_expired || self.dirty.swap(false, Ordering::AcqRel) {
            if let Err(e) = self.republish().await {
                self.dirty.store(true, Ordering::Release);
                return Err(e);
            }
        }
        // The lapse is counted once, when its re-join completes (here or in a later round).
        if self.standing.rejoining() {
            self.rejoins.fetch_add(1, Ordering::Relaxed);
        }
        self.standing.rejoined();
        Ok(())
    }
}

/// Builds the key directory `cfg.directory` names.
fn build(cfg: &ClusterConfig, p: Parts) -> Arc<dyn KeyDirectory> {
    match cfg.directory {
        DirectoryMode::Sharded => {
            // An "unknown" is trusted once owners had time to re-publish after a change (each
            // message is bounded by the timeout); a failed peer is passed over for a lease TTL,
            // by when it has left the membership or come back under a new lease.
            let settle = 2 * cfg.timeout;
            let suspect_for = std::time::Duration::from_secs(cfg.lease_ttl_s as u64);
            let guard = Guard::new(cfg.max_entries_per_source, cfg.lookup_keys_per_s, cfg.check_source_addr);
            Arc::new(Sharded::new(
                p.name,
                p.pool,
                settle,
                suspect_for,
                cfg.timeout,
                guard,
                p.owner,
            ))
        }
        DirectoryMode::Etcd => Arc::new(EtcdKeys::new(cfg, p)),
    }
}

impl Drop for Directory {
    fn drop(&mut self) {
        for t in self.tasks.get_mut().drain(..) {
            t.abort();
        }
    }
}

async fn watch_loop(d: Arc<Directory>, mut revision: i64) {
    loop {
        let opts = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
        let mut c = d.client.clone();
        match d.timed("watching the directory", c.watch(d.root(), Some(opts))).await {
            Ok(mut stream) => {
                d.live.store(true, Ordering::Release);
                d.warned.store(false, Ordering::Release);
                while let Ok(Some(resp)) = stream.message().await {
                    if resp.canceled() {
                        break;
                    }
                    let (mut members_changed, mut keys) = (false, Vec::new());
                    {
                        let mut view = d.view.write();
                        for ev in resp.events() {
                            let Some(kv) = ev.kv() else { continue };
                            revision = revision.max(kv.mod_revision());
                            let value = match ev.event_type() {
                                EventType::Put => Some((kv.value(), kv.lease())),
                                EventType::Delete => None,
                            };
                            members_changed |= d.apply_to(&mut view, &mut keys, kv.key(), value);
                        }
                    }
                    if members_changed {
                        d.membership_seen();
                    }
                    if !keys.is_empty() {
                        d.keys.changed(keys);
                    }
                }
            }
            Err(e) => tracing::debug!("umbp cluster: {e}"),
        }
        d.live.store(false, Ordering::Release);
        // Re-list before watching again: a restarted (or compacted) etcd may be at a lower
        // revision than the one this watch reached, and a watch from there would skip its writes.
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if let Ok(r) = d.list().await {
                revision = r;
                break;
            }
        }
    }
}

/// Where the cluster's etcd compaction stands: the revision seen one period ago is compacted
/// away at the next period, so a watcher that fell behind by less than a period still resumes.
#[derive(Default)]
struct Compaction {
    due: Option<tokio::time::Instant>,
    keep_from: Option<i64>,
}

impl Directory {
    /// Compacts etcd's history when due, if this peer is the member with the lowest name (one
    /// compactor per cluster, with no election: the membership says who).
    async fn compact_if_due(&self, c: &mut Compaction) {
        let Some(every) = self.cfg.compact_every else { return };
        let now = tokio::time::Instant::now();
        if c.due.is_some_and(|d| now < d) {
            return;
        }
        c.due = Some(now + every);
        let lowest = self.view.read().peers.keys().min().is_some_and(|n| **n == *self.name);
        if !lowest {
            c.keep_from = None;
            return;
        }
        let mut client = self.client.clone();
        let head = match self
            .timed(
                "reading the revision",
                client.get(
                    self.peers_prefix.clone(),
                    Some(GetOptions::new().with_count_only().with_prefix()),
                ),
            )
            .await
        {
            Ok(r) => r.header().map(|h| h.revision()),
            Err(e) => {
                tracing::debug!("umbp cluster: {e}");
                return;
            }
        };
        if let Some(rev) = c.keep_from.take() {
            match self.timed("compacting", client.compact(rev, None)).await {
                Ok(_) => tracing::debug!("umbp cluster: compacted etcd history before revision {rev}"),
                // Already compacted further (an operator's auto-compaction): nothing to do.
                Err(e) => tracing::debug!("umbp cluster: {e}"),
            }
        }
        c.keep_from = head;
    }
}

async fn keep_alive_loop(d: Arc<Directory>) {
    let period = Duration::from_millis((d.cfg.lease_ttl_s as u64 * 1000) / 3);
    let mut compaction = Compaction::default();
    loop {
        let id = d.lease.load(Ordering::Acquire);
        let mut c = d.client.clone();
        // Err: etcd out of reach (or the lease unknown to it); Ok(true): the lease expired.
        let outcome: Result<bool, ClusterError> = async {
            let (mut keeper, mut stream) = d.timed("keeping the lease", c.lease_keep_alive(id)).await?;
            let mut recovered = !d.dirty.load(Ordering::Acquire);
            loop {
                let sent = std::time::Instant::now();
                d.timed("keeping the lease", keeper.keep_alive()).await?;
                match d.timed("keeping the lease", stream.message()).await? {
                    Some(r) if r.ttl() > 0 => {
                        d.standing.confirmed(sent, Duration::from_secs(r.ttl() as u64));
                        // Also a publication that failed or timed out while etcd kept answering
                        // (the dirty flag): written again in this round, not at the next outage.
                        if !recovered || d.dirty.load(Ordering::Acquire) {
                            d.recover(false).await?;
                            recovered = true;
                        } else {
                            // Keeps the announced free capacity current for remote puts.
                            d.refresh_free().await?;
                        }
                        d.compact_if_due(&mut compaction).await;
                        tokio::time::sleep(period).await;
                    }
                    Some(_) => return Ok(true),
                    None => return Err(ClusterError::etcd("keeping the lease", "the keep-alive stream closed")),
                }
            }
        }
        .await;
        let expired = match outcome {
            Ok(expired) => expired,
            // etcd reports a lost lease as an error of the keep-alive stream: ask it directly.
            Err(_) => {
                d.dirty.store(true, Ordering::Release);
                match d.renew_through_peers(id).await {
                    Some(expired) => expired,
                    None => {
                        let mut c = d.client.clone();
                        match te_core::metadata::etcd::lease_exists(&mut c, id, d.cfg.timeout).await {
                            Some(exists) => !exists,
                            None => {
                                // A directory in etcd asks no peers: an outage as before.
                                if d.keys.lives_in_etcd() {
                                    d.standing.etcd_out_for_all(true);
                                }
                                false
                            }
                        }
                    }
                }
            }
        };
        if expired {
            d.standing.lapsed();
            // Whatever was written under the old lease is gone: a new lease, membership and
            // every local key again.
            if let Err(e) = d.recover(true).await {
                tracing::debug!("umbp cluster: {e}");
            }
        }
        tokio::time::sleep(period.min(Duration::from_secs(1))).await;
    }
}
