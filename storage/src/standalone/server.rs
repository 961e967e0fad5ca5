//! The server side of standalone mode: one `umbp-server` per node owns the tiers (a local-mode
//! [`Store`]) and serves worker processes over a Unix socket.
//!
//! - A worker opens a *session* with its first connection (the control connection) and joins
//!   more connections to it with the session's secret token, so its threads are not serialised
//!   on one socket. Each connection is served by its own thread: a call is a few microseconds of
//!   copying, and a blocking read/copy/write loop has no scheduler hop.
//! - Buffers arrive as sealed memfds (`SCM_RIGHTS`); the server maps each and registers the
//!   mapping with its store's engine. A request's worker addresses are translated to the server's
//!   mapping with a bounds check against that session's own buffers only, so a client can reach
//!   no memory but its own.
//! - The session ends when its control connection closes (a worker that exits or is killed):
//!   its key handles are dropped at once, and its buffers are deregistered and unmapped when its
//!   last connection thread lets go (after any copy in flight has finished).
//! - Connections are checked with `SO_PEERCRED` (the server's uid, or a configured gid), capped
//!   per listener and per uid, and bounded in time (handshake, idle, each frame).

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use te_base::auth::{self as auth, AuthKey, HandshakeError, HandshakeFrames, Step, NONCE_LEN};
use te_base::config::Env;
use te_base::listener::{AcceptBackoff, ConnectionGate, ConnectionPermit, ListenerLimits};

use super::config::{StandaloneKey, StandaloneSettings};
use super::io::{peer_credentials, recv_frame, send_frame, RecvError};
use super::key_handles::{Held, ServerTable};
use super::memfd::{map_sealed, Mapping};
use super::stats::StandaloneStats;
use super::wire::{self, Keys, Op, Welcome, Writer as _};
use super::AUTH_CONTEXT;
use crate::config::StoreKey;
use crate::core::{RangedGet, RangedPut};
use crate::error::{Result, StoreError};
use crate::range_map::Range;
use crate::store::backend::{Backend, CallerMemory};
use crate::store::Store;

pub use super::config::{DEFAULT_FRAME_TIMEOUT, DEFAULT_MAX_FRAME};
/// Buffers one session may register.
const MAX_REGIONS: usize = 4096;

/// How the server listens.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// The socket path (`UMBP_STANDALONE_SOCKET`).
    pub socket: PathBuf,
    /// A group whose members may connect besides the server's uid (`UMBP_SERVER_ALLOW_GID`); the
    /// socket is then 0660 and owned by that group, else 0600.
    pub allow_gid: Option<u32>,
    /// Connection caps and deadlines (`UMBP_SERVER_*`; the per-source cap is per uid).
    pub limits: ListenerLimits,
    /// Longest frame (`UMBP_SERVER_MAX_FRAME`).
    pub max_frame: usize,
    /// Key-handle table entries (`UMBP_KEY_HANDLE_CAPACITY`, 0: off).
    pub key_handle_capacity: usize,
    /// Busy-poll for the next request this long before sleeping (`UMBP_STANDALONE_SPIN_US`).
    pub spin: Duration,
    /// The shared key peers must prove (`TE_AUTH_KEY_FILE`), on top of the peer credentials.
    pub auth: Option<AuthKey>,
}

impl ServerOptions {
    /// Options from `UMBP_*` variables; `socket` overrides `UMBP_STANDALONE_SOCKET`.
    pub fn from_env(env: &dyn Env, socket: Option<PathBuf>) -> Result<ServerOptions> {
        let s = StandaloneSettings {
            connect: socket,
            ..Default::default()
        };
        ServerOptions::resolve(&s, env)
    }

    /// The server's settings: each explicit in `s` (an `umbp-server` flag, a Python `Server`
    /// keyword), else its variable in `env`, else its default (the table of
    /// [`super::config::StandaloneKey`]); then the listener limits and the auth key from `env`.
    pub fn resolve(s: &StandaloneSettings, env: &dyn Env) -> Result<ServerOptions> {
        let socket = s.connect(env)?.ok_or_else(|| {
            StoreError::Engine(te_base::Error::config(
                StandaloneKey::Socket.var(),
                "",
                "no socket path (--socket or UMBP_STANDALONE_SOCKET)",
            ))
        })?;
        let frame = Duration::from_millis(s.server_frame_timeout_ms(env)?);
        Ok(ServerOptions {
            socket,
            allow_gid: s.allow_gid(env)?,
            limits: ListenerLimits::from_env(env, "UMBP_SERVER", frame)?,
            max_frame: usize::try_from(s.server_max_frame(env)?).unwrap_or(usize::MAX),
            key_handle_capacity: s.key_handle_capacity(env)?,
            spin: Duration::from_micros(s.standalone_spin_us(env)?),
            auth: AuthKey::from_env(env)?,
        })
    }
}

/// The setting an `umbp-server` flag sets, in its table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlagSetting {
    /// A store setting (local mode's table).
    Store(StoreKey),
    /// A standalone-mode setting (the server's side of its table).
    Standalone(StandaloneKey),
}

/// A flag of `umbp-server`, from the settings tables.
#[derive(Debug, Clone, Copy)]
pub struct ServerFlag {
    /// The flag (`--dram`).
    pub flag: &'static str,
    /// The name of its value in the usage (`BYTES`); `None` for a switch, which takes none.
    pub value: Option<&'static str>,
    /// The setting it sets.
    pub setting: FlagSetting,
}

impl ServerFlag {
    /// The variable it stands for (a flag wins over it).
    pub fn var(&self) -> &'static str {
        match self.setting {
            FlagSetting::Store(k) => k.var(),
            FlagSetting::Standalone(k) => k.var(),
        }
    }

    /// The setting's doc line.
    pub fn doc(&self) -> &'static str {
        match self.setting {
            FlagSetting::Store(k) => k.doc(),
            FlagSetting::Standalone(k) => k.doc(),
        }
    }

    /// As the usage line shows it: `[--dram BYTES]`, `[--write-through]`.
    pub fn usage(&self) -> String {
        match self.value {
            Some(v) => format!("[{} {v}]", self.flag),
            None => format!("[{}]", self.flag),
        }
    }
}

/// Every flag of `umbp-server`: standalone mode's (the socket first), then the store's.
pub fn server_flags() -> Vec<ServerFlag> {
    let standalone = StandaloneKey::ALL.iter().filter_map(|&k| {
        let (flag, value) = k.flag()?;
        Some(ServerFlag {
            flag,
            value,
            setting: FlagSetting::Standalone(k),
        })
    });
    let store = StoreKey::ALL.iter().filter_map(|&k| {
        let (flag, value) = k.flag()?;
        Some(ServerFlag {
            flag,
            value,
            setting: FlagSetting::Store(k),
        })
    });
    standalone.chain(store).collect()
}

/// Who may connect: the server's own uid, or a member of the configured gid.
pub fn peer_allowed(server_uid: u32, allow_gid: Option<u32>, peer_uid: u32, peer_gid: u32) -> bool {
    peer_uid == server_uid || allow_gid == Some(peer_gid)
}

/// One worker buffer mapped into the server.
struct Region {
    worker_base: u64,
    len: u64,
    map: Mapping,
}

/// One worker process.
struct Session {
    id: u64,
    token: [u8; 16],
    store: Arc<dyn Backend>,
    rt: tokio::runtime::Handle,
    regions: RwLock<Vec<Region>>,
    alive: AtomicBool,
    mapped: Arc<AtomicU64>,
}

impl Drop for Session {
    fn drop(&mut self) {
        // Runs on the last connection thread of the session (never on the runtime): every copy
        // of the session has finished, so its buffers can go.
        for r in self.regions.get_mut().drain(..) {
            let _ = self.rt.block_on(self.store.deregister_buffer(r.map.addr()));
            self.mapped.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

struct Shared {
    store: Arc<dyn Backend>,
    rt: tokio::runtime::Handle,
    opts: ServerOptions,
    sessions: Mutex<HashMap<[u8; 16], Weak<Session>>>,
    handles: Mutex<ServerTable>,
    next_session: AtomicU64,
    mapped: Arc<AtomicU64>,
}

/// Serves `store` on `opts.socket` until `shutdown` completes; then unlinks the socket and closes
/// the store (which flushes it).
pub async fn serve(store: Store, opts: ServerOptions, shutdown: impl Future<Output = ()>) -> Result<()> {
    let listener = bind(&opts)?;
    let shared = Arc::new(Shared {
        rt: tokio::runtime::Handle::current(),
        // Seeds which held key set is evicted next; from the OS, so no client can predict it.
        handles: Mutex::new(ServerTable::new(opts.key_handle_capacity, te_base::auth::random_u64())),
        sessions: Mutex::new(HashMap::new()),
        next_session: AtomicU64::new(1),
        mapped: Arc::new(AtomicU64::new(0)),
        store: store.backend().clone(),
        opts: opts.clone(),
    });
    let gate = ConnectionGate::new(&opts.limits);
    let mut backoff = AcceptBackoff::default();
    let uid = rustix::process::getuid().as_raw();
    tracing::info!("umbp-server listening on {}", opts.socket.display());
    if opts.auth.is_none() {
        te_base::auth::warn_unauthenticated(
            "umbp-server",
            &opts.socket.display().to_string(),
            "the store's keys and data to every process of an allowed uid/gid",
        );
    }
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => break,
            a = listener.accept() => a,
        };
        let stream = match accepted {
            Ok((s, _)) => {
                backoff.reset();
                s
            }
            Err(e) => {
                backoff.failed("umbp-server", &e).await;
                continue;
            }
        };
        // Connection threads block (with deadlines): tokio leaves the socket non-blocking.
        let Ok(stream) = stream.into_std() else { continue };
        if stream.set_nonblocking(false).is_err() {
            continue;
        }
        let (peer_uid, peer_gid, pid) = match peer_credentials(&stream) {
            Ok(c) => c,
            Err(_) => continue,
        };
        if !peer_allowed(uid, opts.allow_gid, peer_uid, peer_gid) {
            tracing::warn!("umbp-server: refusing pid {pid} (uid {peer_uid}, gid {peer_gid})");
            refuse(&stream, "peer credentials not allowed");
            continue;
        }
        let permit = match gate.admit(IpAddr::V4(Ipv4Addr::from(peer_uid))) {
            Ok(p) => p,
            Err(why) => {
                refuse(&stream, &format!("connection limit reached ({why:?})"));
                continue;
            }
        };
        let shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("umbp-conn".into())
            .spawn(move || serve_connection(&shared, stream, permit));
        if let Err(e) = spawned {
            tracing::warn!("umbp-server: no thread for a connection: {e}");
        }
    }
    drop(listener);
    let _ = std::fs::remove_file(&opts.socket);
    store.close().await
}

fn bind(opts: &ServerOptions) -> Result<tokio::net::UnixListener> {
    let path = &opts.socket;
    if path.exists() {
        // A socket left by a killed server is removed; a live one is not taken over.
        if UnixStream::connect(path).is_ok() {
            return Err(StoreError::Refused {
                reason: format!("another server listens on {}", path.display()),
            });
        }
        std::fs::remove_file(path).map_err(|e| StoreError::io(format!("removing stale {}", path.display()), e))?;
    }
    let listener =
        tokio::net::UnixListener::bind(path).map_err(|e| StoreError::io(format!("binding {}", path.display()), e))?;
    let mode = if opts.allow_gid.is_some() { 0o660 } else { 0o600 };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| StoreError::io("setting the socket's mode", e))?;
    if let Some(gid) = opts.allow_gid {
        std::os::unix::fs::chown(path, None, Some(gid)).map_err(|e| StoreError::io("setting the socket's group", e))?;
    }
    Ok(listener)
}

fn refuse(stream: &UnixStream, reason: &str) {
    let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
    let mut out = Vec::new();
    wire::begin(&mut out, Op::Err);
    wire::encode_error(&mut out, &StoreError::Refused { reason: reason.into() });
    if wire::finish(&mut out).is_ok() {
        let _ = send_frame(stream, &out, None);
    }
}

/// One connection: the hello, then request after request until the peer leaves, breaks the
/// protocol or times out.
fn serve_connection(shared: &Shared, stream: UnixStream, _permit: ConnectionPermit) {
    let limits = shared.opts.limits;
    let _ = stream.set_write_timeout(Some(limits.frame_timeout));
    let _ = stream.set_read_timeout(Some(limits.handshake_timeout));
    let mut rx = Vec::new();
    let mut tx = Vec::new();
    let (session, control) = match hello(shared, &stream, &mut rx, &mut tx) {
        Ok(s) => s,
        Err(e) => {
            reply_error(&stream, &mut tx, &e);
            return;
        }
    };
    // Reads of a frame that has started are bounded by the frame timeout; the wait for the next
    // frame by the idle timeout (none for the control connection, which lives with its worker).
    let _ = stream.set_read_timeout(Some(limits.frame_timeout));
    let idle = (!control).then(|| rustix::event::Timespec {
        tv_sec: limits.idle_timeout.as_secs() as i64,
        tv_nsec: limits.idle_timeout.subsec_nanos() as i64,
    });
    loop {
        let mut fds = [rustix::event::PollFd::new(&stream, rustix::event::PollFlags::IN)];
        if !super::io::spin_readable(&stream, shared.opts.spin) {
            match rustix::event::poll(&mut fds, idle.as_ref()) {
                Ok(1) => {}
                Err(rustix::io::Errno::INTR) => continue,
                _ => break,
            }
        }
        let (h, fd) = match recv_frame(&stream, &mut rx, shared.opts.max_frame, true) {
            Ok(f) => f,
            Err(RecvError::Wire(e)) => {
                reply_error(&stream, &mut tx, &e.into());
                break;
            }
            Err(RecvError::Io(_)) => break,
        };
        if !session.alive.load(Ordering::Acquire) {
            reply_error(
                &stream,
                &mut tx,
                &StoreError::Refused {
                    reason: "the session ended".into(),
                },
            );
            break;
        }
        let outcome = dispatch(shared, &session, h.op, &rx, fd, &mut tx);
        let sent = match outcome {
            Ok(()) => send_frame(&stream, &tx, None),
            Err(e) => {
                let fatal = matches!(e, StoreError::Protocol { .. });
                reply_error(&stream, &mut tx, &e);
                if fatal {
                    break;
                }
                Ok(())
            }
        };
        if sent.is_err() {
            break;
        }
    }
    if control {
        session.alive.store(false, Ordering::Release);
        shared.sessions.lock().remove(&session.token);
        shared.handles.lock().drop_session(session.id);
    }
}

fn reply_error(stream: &UnixStream, tx: &mut Vec<u8>, e: &StoreError) {
    wire::begin(tx, Op::Err);
    wire::encode_error(tx, e);
    if wire::finish(tx).is_ok() {
        let _ = send_frame(stream, tx, None);
    }
}

/// The hello's frames for the shared-key handshake (te_base::auth): the challenge out, the
/// worker's proof in.
struct HelloFrames<'a> {
    stream: &'a UnixStream,
    rx: &'a mut Vec<u8>,
    tx: &'a mut Vec<u8>,
}

impl HandshakeFrames for HelloFrames<'_> {
    type Error = StoreError;

    async fn send(&mut self, _: Step, body: &[u8]) -> Result<()> {
        wire::begin(self.tx, Op::Challenge);
        self.tx.extend_from_slice(body);
        wire::finish(self.tx)?;
        send_frame(self.stream, self.tx, None).map_err(|e| StoreError::io("challenge", e))
    }

    async fn recv(&mut self, _: Step) -> Result<Vec<u8>> {
        let (h, _) = recv_frame(self.stream, self.rx, 64, false).map_err(|e| StoreError::Protocol {
            detail: format!("proof: {e}"),
        })?;
        if h.op != Op::Proof {
            return Err(wire::bad_op(h.op as u8).into());
        }
        Ok(self.rx.clone())
    }
}

fn hello(shared: &Shared, stream: &UnixStream, rx: &mut Vec<u8>, tx: &mut Vec<u8>) -> Result<(Arc<Session>, bool)> {
    let (h, _) = recv_frame(stream, rx, 64, false).map_err(|e| StoreError::Protocol {
        detail: format!("hello: {e}"),
    })?;
    if h.op != Op::Hello || (rx.len() != 16 && rx.len() != 16 + NONCE_LEN) {
        return Err(wire::bad_op(h.op as u8).into());
    }
    let join: [u8; 16] = rx[..16].try_into().expect("16 bytes");
    if let Some(key) = &shared.opts.auth {
        // The shared-key challenge-response runs before anything else (the session token
        // included) is looked at.
        let refused = || StoreError::Refused {
            reason: "this server requires the shared key (TE_AUTH_KEY_FILE)".into(),
        };
        let initiator: [u8; NONCE_LEN] = rx.get(16..16 + NONCE_LEN).ok_or_else(refused)?.try_into().expect("32");
        let mut frames = HelloFrames { stream, rx, tx };
        match auth::block_on(auth::respond(&mut frames, key, AUTH_CONTEXT, &initiator, "umbp worker")) {
            Ok(()) => {}
            Err(HandshakeError::Frames(e)) => return Err(e),
            Err(HandshakeError::Malformed { .. }) => return Err(wire::bad_op(Op::Proof as u8).into()),
            Err(HandshakeError::Unauthenticated(_)) => {
                te_base::listener::log_refusal(
                    "umbp standalone server",
                    &"a worker",
                    &"it did not prove the shared key",
                );
                return Err(refused());
            }
        }
    }
    let (session, control) = if join == [0; 16] {
        // The token lets a second connection join this session: a secret, from the OS.
        let token: [u8; 16] = te_base::auth::random_bytes();
        let s = Arc::new(Session {
            id: shared.next_session.fetch_add(1, Ordering::Relaxed),
            token,
            store: shared.store.clone(),
            rt: shared.rt.clone(),
            regions: RwLock::new(Vec::new()),
            alive: AtomicBool::new(true),
            mapped: shared.mapped.clone(),
        });
        shared.sessions.lock().insert(token, Arc::downgrade(&s));
        (s, true)
    } else {
        let s = shared.sessions.lock().get(&join).and_then(Weak::upgrade);
        let s = s.ok_or_else(|| StoreError::Refused {
            reason: "unknown session".into(),
        })?;
        (s, false)
    };
    Welcome {
        token: session.token,
        idle_ms: shared.opts.limits.idle_timeout.as_millis().min(u32::MAX as u128) as u32,
        max_frame: shared.opts.max_frame.min(u32::MAX as usize) as u32,
    }
    .encode(tx)?;
    send_frame(stream, tx, None).map_err(|e| StoreError::io("hello reply", e))?;
    Ok((session, control))
}

/// Translates a worker range to the server's mapping of that worker's own buffer.
#[inline]
fn translate(regions: &[Region], key_index: usize, range_index: usize, r: Range) -> Result<Range> {
    let i = regions.partition_point(|g| g.worker_base <= r.addr);
    if i > 0 {
        let g = &regions[i - 1];
        if r.len <= g.len && r.addr - g.worker_base <= g.len - r.len {
            return Ok(Range::new(r.offset, r.len, g.map.addr() + (r.addr - g.worker_base)));
        }
    }
    Err(StoreError::Unregistered {
        key_index,
        range_index,
        addr: r.addr,
        len: r.len,
    })
}

/// Translates every range of a call, key by key (`count(k)` ranges each).
fn translate_all(
    regions: &[Region],
    ranges: wire::Ranges<'_>,
    nkeys: usize,
    count: impl Fn(usize) -> usize,
) -> Result<Vec<Range>> {
    let mut out = Vec::with_capacity(ranges.len());
    let mut it = ranges.iter();
    for k in 0..nkeys {
        for i in 0..count(k) {
            let r = it.next().ok_or(wire::bad_count("ranges"))?;
            out.push(translate(regions, k, i, r)?);
        }
    }
    Ok(out)
}

fn dispatch(shared: &Shared, s: &Session, op: Op, payload: &[u8], fd: Option<OwnedFd>, tx: &mut Vec<u8>) -> Result<()> {
    let store = &shared.store;
    if fd.is_some() && op != Op::Register {
        return Err(StoreError::Protocol {
            detail: "a descriptor sent with a request that takes none".into(),
        });
    }
    wire::begin(tx, Op::Ok);
    match op {
        Op::GetRanges => return get_ranges(shared, s, payload, tx),
        Op::PutRanges => {
            let p = wire::decode_put_ranges(payload)?;
            let regions = s.regions.read();
            let ranges = translate_all(&regions, p.ranges, p.keys.len(), |k| p.meta(k).2)?;
            let mut items = Vec::with_capacity(p.keys.len());
            let mut at = 0;
            for (k, key) in p.keys.iter().enumerate() {
                let (object_len, depth, n) = p.meta(k);
                items.push(RangedPut {
                    key,
                    object_len,
                    ranges: &ranges[at..at + n],
                    depth,
                });
                at += n;
            }
            let results: Vec<Result<u64>> = store
                .batch_put_ranges(&items)?
                .into_iter()
                .map(|r| r.map(|()| 0))
                .collect();
            wire::encode_results(tx, &results);
        }
        Op::GetWhole => {
            let (keys, recs) = wire::decode_get_whole(payload)?;
            let regions = s.regions.read();
            let mut items = Vec::with_capacity(recs.len());
            for (k, (key, &(addr, cap))) in keys.iter().zip(&recs).enumerate() {
                let r = translate(&regions, k, 0, Range::new(0, cap, addr))?;
                items.push((key, r.addr, cap));
            }
            let results = store.batch_get(&items)?;
            tx.u64(0);
            wire::encode_results(tx, &results);
        }
        Op::Exists => {
            let keys = one_key(payload)?;
            tx.u8(store.exists(keys)? as u8);
        }
        Op::Remove => {
            let key = one_key(payload)?;
            tx.u8(store.remove(key)? as u8);
        }
        Op::ExistsConsecutive => {
            let keys = wire::decode_keys(payload)?;
            let v: Vec<&str> = keys.iter().collect();
            tx.u64(store.batch_exists_consecutive(&v)? as u64);
        }
        Op::ObjectLens => {
            let keys = wire::decode_keys(payload)?;
            let v: Vec<&str> = keys.iter().collect();
            let lens = store.object_lens(&v)?;
            let results: Vec<Result<u64>> = lens
                .into_iter()
                .zip(keys.iter())
                .map(|(l, k)| l.ok_or_else(|| StoreError::NotFound { key: k.to_owned() }))
                .collect();
            wire::encode_results(tx, &results);
        }
        Op::Register => {
            let mut r = wire::Reader::new(payload);
            let (base, len) = (r.u64("buffer base")?, r.u64("buffer length")?);
            r.end()?;
            let fd = fd.ok_or_else(|| StoreError::Protocol {
                detail: "register without a memfd".into(),
            })?;
            register(shared, s, base, len, fd)?;
        }
        Op::Deregister => {
            let mut r = wire::Reader::new(payload);
            let base = r.u64("buffer base")?;
            r.end()?;
            let removed = {
                let mut regions = s.regions.write();
                match regions.binary_search_by_key(&base, |g| g.worker_base) {
                    Ok(i) => Some(regions.remove(i)),
                    Err(_) => None,
                }
            };
            if let Some(g) = &removed {
                shared.rt.block_on(store.deregister_buffer(g.map.addr()))?;
                shared.mapped.fetch_sub(1, Ordering::Relaxed);
            }
            tx.u8(removed.is_some() as u8);
        }
        Op::Stats => {
            let mut st = store.stats()?;
            let h = shared.handles.lock().counts();
            st.standalone = Some(StandaloneStats {
                server_key_handle_hits: h.hits,
                server_key_handle_misses: h.misses,
                server_key_handle_mints: h.mints,
                server_key_handle_held: h.held,
                server_key_handle_bytes: h.bytes,
                server_sessions: shared.sessions.lock().len() as u64,
                server_mapped_buffers: shared.mapped.load(Ordering::Relaxed),
                ..Default::default()
            });
            wire::encode_stats(tx, &st);
        }
        Op::PhaseReport => wire::encode_phases(tx, store.phase_report()?.as_ref()),
        Op::ResetPhases => store.reset_phase_report()?,
        Op::Flush => store.flush()?,
        Op::Compact => {
            let mut r = wire::Reader::new(payload);
            let force = r.u8("force")? != 0;
            r.end()?;
            tx.u64(store.compact(force)?);
        }
        other => return Err(wire::bad_op(other as u8).into()),
    }
    wire::finish(tx)?;
    Ok(())
}

fn one_key(payload: &[u8]) -> Result<&str> {
    let keys = wire::decode_keys(payload)?;
    let mut it = keys.iter();
    match (it.next(), it.next()) {
        (Some(k), None) => Ok(k),
        _ => Err(wire::bad_count("exactly one key").into()),
    }
}

fn register(shared: &Shared, s: &Session, base: u64, len: u64, fd: OwnedFd) -> Result<()> {
    if base.checked_add(len).is_none() {
        return Err(wire::bad_value("buffer range").into());
    }
    let map = map_sealed(fd, len)?;
    let mut regions = s.regions.write();
    if regions.len() >= MAX_REGIONS {
        return Err(StoreError::Refused {
            reason: format!("more than {MAX_REGIONS} buffers in one session"),
        });
    }
    let at = regions.partition_point(|g| g.worker_base < base);
    let overlaps = regions.get(at).is_some_and(|g| g.worker_base < base + len)
        || (at > 0 && regions[at - 1].worker_base + regions[at - 1].len > base);
    if overlaps {
        return Err(StoreError::Refused {
            reason: "the buffer overlaps one already registered".into(),
        });
    }
    // SAFETY: the mapping stays valid until the region is deregistered (Deregister, or the
    // session's drop, both deregister before the mapping is dropped); the sealed file cannot
    // shrink under it. The worker may race on its own bytes, never on anyone else's.
    let memory = unsafe { CallerMemory::new(map.addr(), len, None) };
    shared.rt.block_on(s.store.register_buffer(memory))?;
    regions.insert(
        at,
        Region {
            worker_base: base,
            len,
            map,
        },
    );
    shared.mapped.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// The keys of a ranged get: sent in the frame, or held by the key-handle table.
enum CallKeys<'a> {
    Sent(Keys<'a>),
    Held(Arc<Held>),
}

/// Pairs each key with its ranges (`counts` of them, in key order).
fn ranged_gets<'a>(
    keys: impl Iterator<Item = &'a str>,
    ranges: &'a [Range],
    counts: &wire::Counts<'_>,
) -> Vec<RangedGet<'a>> {
    let mut items = Vec::with_capacity(keys.size_hint().0);
    let mut at = 0;
    for (k, key) in keys.enumerate() {
        let n = counts.get(k);
        items.push(RangedGet {
            key,
            ranges: &ranges[at..at + n],
        });
        at += n;
    }
    items
}

// Never inlined: `scripts/umbp-callgrind.sh` counts the instructions of this function per call.
#[inline(never)]
fn get_ranges(shared: &Shared, s: &Session, payload: &[u8], tx: &mut Vec<u8>) -> Result<()> {
    let g = wire::decode_get_ranges(payload)?;
    let mut minted = 0;
    // The entry just minted for the keys sent: this call fills its resolution.
    let mut fresh = None;
    let keys = if g.handle != 0 {
        let held = shared.handles.lock().resolve(s.id, g.handle, g.fingerprint, g.nkeys);
        match held {
            Some(k) => CallKeys::Held(k),
            None => {
                wire::begin(tx, Op::KeyHandleUnknown);
                wire::finish(tx)?;
                return Ok(());
            }
        }
    } else {
        let keys = g.keys.expect("decoded with the handle 0");
        if g.fingerprint != 0 {
            (minted, fresh) = shared.handles.lock().mint_held(s.id, g.fingerprint, keys.iter());
        }
        CallKeys::Sent(keys)
    };
    let regions = s.regions.read();
    let ranges = translate_all(&regions, g.ranges, g.nkeys, |k| g.counts.get(k))?;
    let items = match &keys {
        CallKeys::Sent(k) => ranged_gets(k.iter(), &ranges, &g.counts),
        CallKeys::Held(h) => ranged_gets(h.keys.iter(), &ranges, &g.counts),
    };
    // A held key set reuses what the store resolved for it last time (unless another call of
    // the same handle is using it right now).
    let resolved = match (&keys, &fresh) {
        (CallKeys::Held(h), _) | (CallKeys::Sent(_), Some(h)) => h.resolved.try_lock(),
        (CallKeys::Sent(_), None) => None,
    };
    let results = match resolved {
        Some(mut r) => shared.store.batch_get_ranges(&items, Some(&mut r))?,
        None => shared.store.batch_get_ranges(&items, None)?,
    };
    drop(regions);
    tx.u64(minted);
    wire::encode_results(tx, &results);
    wire::finish(tx)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_servers_uid_or_the_allowed_gid_may_connect() {
        assert!(peer_allowed(1000, None, 1000, 5));
        assert!(!peer_allowed(1000, None, 1001, 5));
        assert!(peer_allowed(1000, Some(5), 1001, 5));
        assert!(!peer_allowed(1000, Some(5), 1001, 6));
        assert!(!peer_allowed(0, None, 65534, 65534));
    }
}
