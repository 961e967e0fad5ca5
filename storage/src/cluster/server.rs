//! The control listener of a peer: answers RESOLVE (where a key's bytes are in this peer's
//! exported memory), VALIDATE (is the placement a reader used still the committed one),
//! ALLOCATE and COMMIT (a remote put), the sharded directory's PUBLISH, UNPUBLISH and
//! LOOKUP, and RENEW (keeping alive the lease of a member that cannot reach etcd).
//!
//! It faces whoever reaches it: the shared key is proved first when one is configured,
//! connections are capped in total and per source, every frame has a deadline, a body is read
//! only as its bytes arrive, and accept errors back off (te_base::listener). It holds the store
//! weakly, so a store that is dropped stops serving.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use te_base::auth::AuthKey;
use te_base::listener::{accept_admitted, log_refusal, AcceptBackoff, ConnectionGate, ListenerLimits};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use super::conn::{accept_handshake, read_frame, write_frame};
use super::directory::Directory;
use super::guard::DirectoryRefusal;
use super::owner::Owner;
use super::rendezvous;
use super::shard::BLOCKED;
use super::sharded::Sharded;
use super::wire::{self, Op};

const NAME: &str = "umbp cluster control listener";

/// A running control listener; stops when dropped.
pub(crate) struct Server {
    pub(crate) addr: SocketAddr,
    task: JoinHandle<()>,
    joined: Joined,
}

/// The directory, once joined (it needs the listener's address first): COMMIT publishes there,
/// and directory requests reach the key directory through it.
type Joined = Arc<OnceLock<Arc<Directory>>>;

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Server {
    /// Binds `listen` and serves on the current runtime.
    pub(crate) async fn start(
        listen: SocketAddr,
        auth: Option<AuthKey>,
        limits: ListenerLimits,
        owner: Arc<Owner>,
    ) -> std::io::Result<Server> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        if auth.is_none() {
            te_base::auth::warn_unauthenticated(NAME, &addr.to_string(), "where this peer's KV pages are");
        }
        let joined = Joined::default();
        let task = tokio::spawn(accept_loop(listener, auth, limits, owner, joined.clone()));
        Ok(Server { addr, task, joined })
    }

    /// The directory joined: requests that need it are served from now on.
    pub(crate) fn joined(&self, dir: Arc<Directory>) {
        let _ = self.joined.set(dir);
    }
}

async fn accept_loop(
    listener: TcpListener,
    auth: Option<AuthKey>,
    limits: ListenerLimits,
    owner: Arc<Owner>,
    joined: Joined,
) {
    let gate = ConnectionGate::new(&limits);
    let mut backoff = AcceptBackoff::default();
    loop {
        let (stream, from, permit) = accept_admitted(&listener, &gate, &mut backoff, NAME, limits.frame_timeout).await;
        let (auth, owner, joined) = (auth.clone(), owner.clone(), joined.clone());
        tokio::spawn(async move {
            match serve(stream, from, auth, limits, owner, joined).await {
                Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => log_refusal(NAME, &from, &e),
                Err(e) => tracing::debug!("{NAME}: {from}: {e}"),
                Ok(()) => {}
            }
            drop(permit);
        });
    }
}

async fn serve(
    mut s: TcpStream,
    from: SocketAddr,
    auth: Option<AuthKey>,
    limits: ListenerLimits,
    owner: Arc<Owner>,
    joined: Joined,
) -> std::io::Result<()> {
    // The member this connection speaks for (proved with the key when one is set).
    let member = accept_handshake(&mut s, auth.as_ref(), &from.to_string(), limits.handshake_timeout).await?;
    loop {
        let (op, body) = match read_frame(&mut s, limits.idle_timeout, limits.frame_timeout).await {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        let Some(core) = owner.core() else { return Ok(()) };
        let (op, answer) = match op {
            Op::Resolve => match wire::decode_resolve(&body) {
                Ok(keys) => {
                    let (lease, places) = owner.resolve(&core, &keys);
                    (Op::Places, wire::encode_places(lease, &places))
                }
                Err(e) => (Op::Refused, format!("malformed RESOLVE: {e}").into_bytes()),
            },
            Op::Validate => match wire::decode_validate(&body) {
                Ok((lease, keys)) => (
                    Op::Verdicts,
                    wire::encode_verdicts(&owner.validate(&core, lease, &keys)),
                ),
                Err(e) => (Op::Refused, format!("malformed VALIDATE: {e}").into_bytes()),
            },
            Op::Allocate => match wire::decode_allocate(&body) {
                Ok(objs) => (Op::Places, wire::encode_places(0, &owner.allocate(&core, &objs))),
                Err(e) => (Op::Refused, format!("malformed ALLOCATE: {e}").into_bytes()),
            },
            Op::Commit => match wire::decode_validate(&body) {
                Ok((_, keys)) => {
                    let (mut verdicts, committed) = owner.commit(&core, &keys);
                    drop(core);
                    // Routable before the writer's put returns; a key the directory did not take
                    // is dropped here and answered "no" (the writer does not acknowledge it).
                    if let Some(dir) = joined.get().cloned() {
                        let end = dir.deadline();
                        let refused = tokio::task::spawn_blocking(move || dir.publish(&committed, true, end))
                            .await
                            .unwrap_or_default();
                        for (j, v) in verdicts.iter_mut().filter(|v| **v).enumerate() {
                            *v = !refused.iter().any(|&(i, _)| i == j);
                        }
                    }
                    (Op::Verdicts, wire::encode_verdicts(&verdicts))
                }
                Err(e) => (Op::Refused, format!("malformed COMMIT: {e}").into_bytes()),
            },
            Op::Publish | Op::Unpublish | Op::Lookup | Op::Retire => {
                drop(core);
                directory_request(&owner, &joined, op, &body, member.as_deref(), from, &limits).await
            }
            Op::Renew => {
                drop(core);
                renew_request(&joined, &body, member.as_deref().unwrap_or_default(), from).await
            }
            other => (Op::Refused, format!("unexpected {other:?}").into_bytes()),
        };
        write_frame(&mut s, op, &answer, limits.frame_timeout).await?;
        if op == Op::Refused {
            return Ok(());
        }
    }
}

/// RENEW from a member that cannot reach etcd itself: its own lease only (any other is
/// answered gone), asked from the IP it announced.
async fn renew_request(joined: &Joined, body: &[u8], member: &str, from: SocketAddr) -> (Op, Vec<u8>) {
    let Some(dir) = joined.get() else {
        return (Op::Refused, b"this peer has not joined yet".to_vec());
    };
    let Ok(sh) = dir.keys().clone().into_any().downcast::<Sharded>() else {
        return (Op::Refused, b"this peer's directory is not sharded".to_vec());
    };
    let lease = match wire::decode_renew(body) {
        Ok(l) => l,
        Err(e) => return (Op::Refused, format!("malformed RENEW: {e}").into_bytes()),
    };
    if let Err(r) = sh
        .guard
        .check_source("RENEW", member, from.ip(), sh.announced_ip(member))
    {
        tracing::debug!("{NAME}: refused: {r}");
        return (Op::Refused, r.to_string().into_bytes());
    }
    (Op::Renewed, wire::encode_renewed(dir.renew_for(member, lease).await))
}

/// PUBLISH, UNPUBLISH and LOOKUP against this peer's shard of the directory, and RETIRE, from a
/// connection that proved it speaks for `member` and comes `from` there (see `guard.rs`: a
/// member speaks only for itself, from the IP it announced, holds at most so many entries here,
/// and looks up at most so many keys per second).
async fn directory_request(
    owner: &Owner,
    joined: &Joined,
    op: Op,
    body: &[u8],
    member: Option<&str>,
    from: SocketAddr,
    limits: &ListenerLimits,
) -> (Op, Vec<u8>) {
    let Some(sh) = joined
        .get()
        .and_then(|d| d.keys().clone().into_any().downcast::<Sharded>().ok())
    else {
        return (Op::Refused, b"this peer's directory is not sharded".to_vec());
    };
    let refuse = |r: DirectoryRefusal| {
        tracing::debug!("{NAME}: refused: {r}");
        (Op::Refused, r.to_string().into_bytes())
    };
    // A member that just joined may reach this peer before the watch shows it here: it is
    // given a short while to appear (woken by the membership change itself).
    let member_now = || async {
        let until = tokio::time::Instant::now() + limits.frame_timeout / 4;
        match member {
            Some(m) => sh.is_member_by(m, until).await,
            None => false,
        }
    };
    match op {
        Op::Publish => match wire::decode_publish(body) {
            Ok((named, deadline, keys)) => {
                let is_member = if member == Some(named.as_str()) {
                    member_now().await
                } else {
                    false
                };
                if let Err(r) = sh.guard.check_owner("PUBLISH", &named, member, is_member) {
                    return refuse(r);
                }
                if let Err(r) = sh
                    .guard
                    .check_source("PUBLISH", &named, from.ip(), sh.announced_ip(&named))
                {
                    return refuse(r);
                }
                // Read after its writer stopped waiting (this peer was frozen or cut off): the
                // put was not acknowledged, and taking it now could retire the copy of the last
                // acknowledged write (its writer dropped its own).
                if deadline != 0 && wire::wall_ms() >= deadline {
                    tracing::debug!("{NAME}: a PUBLISH from {named} arrived after its deadline; refused");
                    return (Op::Refused, b"PUBLISH read after its writer's deadline".to_vec());
                }
                let cap = sh.guard.max_entries_per_source;
                let mut done = sh
                    .shard
                    .publish(&named, keys.iter().map(|(k, v)| (k.as_str(), *v)), cap);
                // The owners of superseded entries drop those copies before the writer's put
                // is acknowledged, within a quarter of the frame timeout and the writer's own
                // deadline; an entry whose owner did not confirm it is put back and that key is
                // answered BLOCKED (not taken here).
                if !done.superseded.is_empty() {
                    let mut left = limits.frame_timeout / 4;
                    if deadline != 0 {
                        let ms = deadline.saturating_sub(wire::wall_ms());
                        left = left.min(std::time::Duration::from_millis(ms));
                    }
                    let end = std::time::Instant::now() + left;
                    let superseded = std::mem::take(&mut done.superseded);
                    let all = superseded.clone();
                    let sh2 = sh.clone();
                    let failed = tokio::task::spawn_blocking(move || sh2.retire(superseded, end))
                        .await
                        .unwrap_or(all);
                    if !failed.is_empty() {
                        let versions: std::collections::HashMap<&str, (usize, u64)> = done
                            .superseded_at
                            .iter()
                            .map(|&j| (keys[j].0.as_str(), (j, keys[j].1)))
                            .collect();
                        sh.shard.revert(&named, |k| versions.get(k).map_or(0, |v| v.1), &failed);
                        for (k, _, _) in &failed {
                            if let Some(&(j, _)) = versions.get(k.as_str()) {
                                done.taken[j] = BLOCKED;
                            }
                        }
                    }
                }
                if done.capped > 0 {
                    sh.guard.counters.refused_capped.fetch_add(1, Ordering::Relaxed);
                    return refuse(DirectoryRefusal::EntriesCapped {
                        source_name: named,
                        cap,
                        refused: done.capped,
                    });
                }
                (Op::Versions, wire::encode_versions(&done.taken))
            }
            Err(e) => (Op::Refused, format!("malformed PUBLISH: {e}").into_bytes()),
        },
        Op::Unpublish => match wire::decode_owned_keys(body) {
            Ok((named, keys)) => {
                let is_member = if member == Some(named.as_str()) {
                    member_now().await
                } else {
                    false
                };
                if let Err(r) = sh.guard.check_owner("UNPUBLISH", &named, member, is_member) {
                    return refuse(r);
                }
                if let Err(r) = sh
                    .guard
                    .check_source("UNPUBLISH", &named, from.ip(), sh.announced_ip(&named))
                {
                    return refuse(r);
                }
                sh.shard.unpublish(&named, keys.iter().map(String::as_str));
                (Op::Verdicts, wire::encode_verdicts(&[]))
            }
            Err(e) => (Op::Refused, format!("malformed UNPUBLISH: {e}").into_bytes()),
        },
        Op::Retire => match wire::decode_validate(body) {
            Ok((deadline, keys)) => {
                // Read after its sender stopped waiting (this peer was frozen or cut off): the
                // sender has put the older entry back, so this copy is still the one routed to.
                if deadline != 0 && wire::wall_ms() >= deadline {
                    tracing::debug!("{NAME}: a RETIRE arrived after its deadline; ignored");
                    return (Op::Refused, b"RETIRE read after its sender's deadline".to_vec());
                }
                // Only a key's directory peer may retire this peer's copy of it.
                let m = sh.membership();
                let from_directory = member.is_some_and(|p| {
                    keys.iter()
                        .all(|(k, _)| rendezvous::indexes(rendezvous::stable_hash(k.as_bytes()), &m.members, p))
                });
                if !from_directory {
                    return refuse(DirectoryRefusal::NotDirectoryPeer {
                        name: member.unwrap_or_default().to_owned(),
                    });
                }
                let name = member.unwrap_or_default();
                if let Err(r) = sh.guard.check_source("RETIRE", name, from.ip(), sh.announced_ip(name)) {
                    return refuse(r);
                }
                if let Some(core) = owner.core() {
                    owner.retire(&core, &keys);
                }
                (Op::Verdicts, wire::encode_verdicts(&[]))
            }
            Err(e) => (Op::Refused, format!("malformed RETIRE: {e}").into_bytes()),
        },
        _ => {
            // The budget is checked on the key count alone, before any key is decoded.
            let n = match wire::lookup_len(body) {
                Ok(n) => n,
                Err(e) => return (Op::Refused, format!("malformed LOOKUP: {e}").into_bytes()),
            };
            // A member's budget is spent only from the IP it announced; otherwise the LOOKUP
            // counts as a non-member's.
            let own = member.filter(|m| {
                !sh.guard.check_source_addr
                    || sh
                        .announced_ip(m)
                        .is_none_or(|a| a.is_unspecified() || a.to_canonical() == from.ip().to_canonical())
            });
            let (source, members) = sh.source(own);
            match sh.guard.lookup_tokens(&source, n, limits.frame_timeout, members) {
                Ok(wait) if !wait.is_zero() => tokio::time::sleep(wait).await,
                Ok(_) => {}
                Err(r) => {
                    // Answered only after the longest wait it could have had: a source over its
                    // budget cannot turn refusals (each a connection, a handshake and a body)
                    // into a loop faster than its connections allow.
                    tokio::time::sleep(limits.frame_timeout).await;
                    return refuse(r);
                }
            }
            match wire::decode_lookup(body) {
                Ok(keys) => {
                    let owners = sh.shard.lookup(keys.iter().map(String::as_str));
                    (Op::Owners, wire::encode_owners(sh.shard.settled(), &owners))
                }
                Err(e) => (Op::Refused, format!("malformed LOOKUP: {e}").into_bytes()),
            }
        }
    }
}
