//! The key directory in etcd (`UMBP_CLUSTER_DIRECTORY=etcd`, the design before issue 26, kept
//! to measure against): `<prefix>/umbp/keys/<key>` names the peer that committed the key, under
//! its lease, written in one transaction per [`MAX_TXN_OPS`] keys before the put returns. Every
//! peer follows the subtree through the membership watch and keeps every key in memory, so a
//! lookup never asks etcd. It has no versions to order two owners' writes by: a key has one
//! owner until that owner removes it or its lease ends.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};
use parking_lot::RwLock;

use super::config::ClusterConfig;
use super::key_directory::{DirectoryCounters, KeyDirectory, Parts, Refused};
use super::membership::Membership;
use super::owner::Owner;
use crate::error::ClusterError;

/// Most operations in one etcd transaction (etcd's default `--max-txn-ops`).
const MAX_TXN_OPS: usize = 128;

pub(crate) struct EtcdKeys {
    etcd: Writer,
    runtime: tokio::runtime::Handle,
    owner: std::sync::Weak<Owner>,
    /// Key to the name of its owner, as the watch last saw it.
    keys: RwLock<HashMap<String, Arc<str>>>,
    membership: RwLock<Arc<Membership>>,
}

/// What writes to etcd need, owned, so that a write runs on the cluster's runtime while the
/// caller's thread (perhaps inside a runtime of its own) waits.
#[derive(Clone)]
struct Writer {
    name: Arc<str>,
    client: Client,
    keys_prefix: Arc<str>,
    lease: Arc<AtomicI64>,
    timeout: Duration,
}

impl EtcdKeys {
    pub(crate) fn new(cfg: &ClusterConfig, p: Parts) -> EtcdKeys {
        EtcdKeys {
            etcd: Writer {
                name: p.name,
                client: p.client,
                keys_prefix: Arc::from(format!("{}/umbp/keys/", cfg.prefix)),
                lease: p.lease,
                timeout: cfg.timeout,
            },
            runtime: p.runtime,
            owner: p.owner,
            keys: RwLock::default(),
            membership: RwLock::new(Arc::new(Membership::new([]))),
        }
    }

    /// Runs `f` on the cluster's runtime and waits for it on this thread (see [`run_on`]).
    fn run<T: Send + 'static>(
        &self,
        what: &'static str,
        end: Instant,
        f: impl std::future::Future<Output = Result<T, ClusterError>> + Send + 'static,
    ) -> Result<T, ClusterError> {
        run_on(&self.runtime, what, end, f)
    }

    /// Drops this peer's copies of the `refused` ones of `keys` (another peer owns them).
    fn drop_local(&self, keys: &[String], refused: &[(usize, String)]) {
        let Some(core) = self.owner.upgrade().and_then(|o| o.core()) else {
            return;
        };
        for &(i, _) in refused {
            let _ = core.remove(&keys[i]);
        }
    }
}

/// Runs `f` on `runtime` and waits for it on this thread, until `end` at most (the future stops
/// there too): etcd's silence is a timeout; a runtime that shut down (the store closing) or a
/// task that ended unfinished is said as such, at once, not as a timeout after the wait.
fn run_on<T: Send + 'static>(
    runtime: &tokio::runtime::Handle,
    what: &'static str,
    end: Instant,
    f: impl std::future::Future<Output = Result<T, ClusterError>> + Send + 'static,
) -> Result<T, ClusterError> {
    let left = end.saturating_duration_since(Instant::now());
    let timeout = ClusterError::EtcdTimeout {
        what,
        ms: left.as_millis() as u64,
    };
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let timed_out = timeout.clone();
    runtime.spawn(async move {
        let _ = tx.send(tokio::time::timeout(left, f).await.unwrap_or(Err(timed_out)));
    });
    match rx.recv_timeout(left) {
        Ok(r) => r,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(timeout),
        // The task was dropped unfinished: the runtime shut down, or the future panicked.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(ClusterError::Task {
            what,
            message: "the cluster's runtime shut down (the store is closing) or the task panicked".into(),
        }),
    }
}

/// The owner's name shared with the membership's, when it is a member: one allocation per peer,
/// not per key.
fn interned(m: &Membership, owner: &str) -> Arc<str> {
    m.name(owner).unwrap_or_else(|| Arc::from(owner))
}

impl Writer {
    async fn timed<T, E: std::fmt::Display>(
        &self,
        what: &'static str,
        f: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, ClusterError> {
        match tokio::time::timeout(self.timeout, f).await {
            Ok(r) => r.map_err(|e| ClusterError::etcd(what, e)),
            Err(_) => Err(ClusterError::EtcdTimeout {
                what,
                ms: self.timeout.as_millis() as u64,
            }),
        }
    }

    fn lease_opts(&self) -> PutOptions {
        PutOptions::new().with_lease(self.lease.load(Ordering::Acquire))
    }

    /// Writes the `todo` ones of `keys` as owned here where no other peer owns them, in
    /// transactions of at most [`MAX_TXN_OPS`], and returns the others (index, owner). A key is
    /// claimed only while absent from etcd (`create_revision == 0`, checked by etcd itself, so
    /// two peers cannot both take it) or already this peer's; the owner's removal or lease
    /// expiry frees it.
    async fn claim(self, keys: Vec<String>, todo: Vec<usize>) -> Result<Vec<(usize, String)>, ClusterError> {
        let mut refused = Vec::new();
        for chunk in todo.chunks(MAX_TXN_OPS) {
            let path = |i: usize| format!("{}{}", self.keys_prefix, keys[i]);
            let absent = |i: usize| Compare::create_revision(path(i), CompareOp::Equal, 0);
            let put = |i: usize| TxnOp::put(path(i), &*self.name, Some(self.lease_opts()));
            let all = Txn::new()
                .when(chunk.iter().map(|&i| absent(i)).collect::<Vec<_>>())
                .and_then(chunk.iter().map(|&i| put(i)).collect::<Vec<_>>());
            let mut c = self.client.clone();
            if self.timed("publishing keys", c.txn(all)).await?.succeeded() {
                continue;
            }
            // Some key of the chunk exists: each on its own, learning its owner when not ours.
            for &i in chunk {
                let one = Txn::new()
                    .when([absent(i)])
                    .and_then([put(i)])
                    .or_else([TxnOp::get(path(i), None)]);
                let r = self.timed("publishing a key", c.txn(one)).await?;
                if r.succeeded() {
                    continue;
                }
                let owner = r
                    .op_responses()
                    .into_iter()
                    .find_map(|o| match o {
                        TxnOpResponse::Get(g) => g
                            .kvs()
                            .first()
                            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()),
                        _ => None,
                    })
                    .unwrap_or_default();
                if owner != *self.name {
                    refused.push((i, owner));
                }
            }
        }
        Ok(refused)
    }

    /// Removes each of `keys` while this peer is still its owner there.
    async fn remove(self, keys: Vec<String>) -> Result<(), ClusterError> {
        for key in keys {
            let k = format!("{}{key}", self.keys_prefix);
            let txn = Txn::new()
                .when([Compare::value(k.clone(), CompareOp::Equal, &*self.name)])
                .and_then([TxnOp::delete(k, None)]);
            let mut c = self.client.clone();
            self.timed("removing a key", c.txn(txn)).await?;
        }
        Ok(())
    }
}

impl KeyDirectory for EtcdKeys {
    fn lives_in_etcd(&self) -> bool {
        true
    }

    fn etcd_subtree(&self) -> Option<&'static str> {
        Some("keys/")
    }

    fn listed(&self, entries: Vec<(String, String)>) {
        let m = self.membership.read().clone();
        let keys = entries
            .into_iter()
            .filter(|(_, owner)| !owner.is_empty())
            .map(|(k, owner)| (k, interned(&m, &owner)))
            .collect();
        *self.keys.write() = keys;
    }

    fn changed(&self, changes: Vec<(String, Option<String>)>) {
        let m = self.membership.read().clone();
        let mut keys = self.keys.write();
        for (key, owner) in changes {
            match owner.filter(|o| !o.is_empty()) {
                Some(owner) => keys.insert(key, interned(&m, &owner)),
                None => keys.remove(&key),
            };
        }
    }

    fn set_membership(&self, m: Membership) -> Option<Arc<Membership>> {
        let mut cur = self.membership.write();
        if cur.same_as(&m) {
            return None;
        }
        *cur = Arc::new(m);
        // Entries live in etcd: nothing moves when the members change.
        None
    }

    fn rebalance(&self, _old: &Membership, _local_keys: &[String]) -> Result<(), ClusterError> {
        Ok(())
    }

    fn publish(&self, keys: &[String], fresh: bool, end: Instant) -> Result<Refused, ClusterError> {
        // Keys already routed here need no write.
        let todo: Vec<usize> = {
            let view = self.keys.read();
            (0..keys.len())
                .filter(|&i| view.get(keys[i].as_str()).is_none_or(|o| **o != *self.etcd.name))
                .collect()
        };
        if todo.is_empty() {
            return Ok(Vec::new());
        }
        // A re-publication of every key held is bounded per transaction, as each is, not by one
        // timeout for all of them.
        let end = match fresh {
            true => end,
            false => end + self.etcd.timeout * (todo.len() / MAX_TXN_OPS) as u32,
        };
        let refused = self.run("publishing keys", end, self.etcd.clone().claim(keys.to_vec(), todo))?;
        if !refused.is_empty() {
            tracing::warn!(
                "umbp cluster: {} local keys are owned by other peers in the etcd directory; this peer's copies are dropped",
                refused.len()
            );
            self.drop_local(keys, &refused);
        }
        Ok(refused
            .into_iter()
            .map(|(i, owner)| {
                let why = format!(
                    "peer {owner} owns it (UMBP_CLUSTER_DIRECTORY=etcd keeps one owner per key: remove it there first)"
                );
                (i, why)
            })
            .collect())
    }

    fn unpublish(&self, keys: &[String], end: Instant) {
        if let Err(e) = self.run("removing a key", end, self.etcd.clone().remove(keys.to_vec())) {
            tracing::warn!("umbp cluster: {e}");
        }
    }

    fn owners(&self, keys: &[&str], _end: Instant) -> Vec<Option<(Arc<str>, SocketAddr)>> {
        let (view, m) = (self.keys.read(), self.membership.read().clone());
        keys.iter()
            .map(|&k| {
                let owner = view.get(k)?;
                if **owner == *self.etcd.name {
                    return None;
                }
                m.addr(owner)
            })
            .collect()
    }

    fn owner_of(&self, key: &str, _end: Instant) -> Option<Arc<str>> {
        self.keys.read().get(key).cloned()
    }

    fn counters(&self) -> DirectoryCounters {
        DirectoryCounters {
            entries: self.keys.read().len() as u64,
            ..DirectoryCounters::default()
        }
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn a_call_on_the_cluster_runtime_answers_or_times_out_as_such() {
        let rt = runtime();
        let end = || Instant::now() + Duration::from_secs(60);
        assert_eq!(run_on(rt.handle(), "a write", end(), async { Ok(7) }), Ok(7));
        let e = ClusterError::etcd("a write", "refused");
        assert_eq!(
            run_on(rt.handle(), "a write", end(), async { Err::<(), _>(e) }),
            Err(ClusterError::etcd("a write", "refused"))
        );
        // etcd silent: the deadline's timeout, naming the work.
        let silent = run_on(
            rt.handle(),
            "a write",
            Instant::now() + Duration::from_millis(50),
            std::future::pending::<Result<(), ClusterError>>(),
        );
        assert!(
            matches!(silent, Err(ClusterError::EtcdTimeout { what: "a write", .. })),
            "{silent:?}"
        );
    }

    #[test]
    fn a_runtime_that_shuts_down_is_not_reported_as_an_etcd_timeout() {
        // Shut down before the call: said at once.
        let rt = runtime();
        let handle = rt.handle().clone();
        drop(rt);
        let far = Instant::now() + Duration::from_secs(60);
        let r = run_on(&handle, "a write", far, async { Ok(1) });
        assert!(matches!(r, Err(ClusterError::Task { what: "a write", .. })), "{r:?}");
        // Shut down while the call waits on etcd (the store closing during a put): said when it
        // happens, not as a timeout when the deadline passes (the bound guards a hang).
        let rt = runtime();
        let handle = rt.handle().clone();
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let closer = std::thread::spawn(move || {
            started_rx.recv().unwrap();
            rt.shutdown_background();
        });
        let r = run_on(&handle, "a write", far, async move {
            started_tx.send(()).unwrap();
            std::future::pending::<Result<(), ClusterError>>().await
        });
        closer.join().unwrap();
        assert!(matches!(r, Err(ClusterError::Task { what: "a write", .. })), "{r:?}");
        assert!(Instant::now() < far);
    }
}
