//! The worker side of standalone mode: the store's calls as requests to `umbp-server`.
//!
//! - A session is opened by a control connection (which also carries buffer registration, each
//!   memfd travelling by `SCM_RIGHTS`); calls run on a pool of data connections joined to the
//!   session, one per concurrently calling thread, so threads are not serialised on one socket.
//! - A broken connection fails its call with [`StoreError::ServerGone`] (a dead server closes the
//!   socket at once; a hung one is cut by the call timeout). The next call reconnects, with a
//!   backoff doubling from 10 ms to 1 s between failed attempts, re-registers every buffer and
//!   starts with an empty key-handle cache (a new server knows no handle).
//! - Ranged gets name their key set with a key handle when the cache holds it; an unknown handle
//!   is answered `key_handle_unknown` and the keys are resent on the same connection.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::config::StandaloneConfig;
use super::io::{recv_frame, send_frame, RecvError};
use super::key_handles::ClientCache;
use super::memfd::KvBuffer;
use super::wire::{self, Op, Reader, Welcome, Writer as _};
use super::AUTH_CONTEXT;
use crate::core::{RangedGet, RangedPut};
use crate::error::{Result, StoreError};
use crate::store::stats::StoreStats;
use te_base::auth::{self as auth, HandshakeError, HandshakeFrames, Step};

/// Longest reply the client reads.
const MAX_REPLY: usize = 1 << 30;
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

struct Conn {
    spin: Duration,
    stream: UnixStream,
    tx: Vec<u8>,
    rx: Vec<u8>,
    generation: u64,
    last_used: Instant,
}

impl Conn {
    fn open(opts: &StandaloneConfig, join: [u8; 16], generation: u64) -> Result<(Conn, Welcome)> {
        let gone = |e: std::io::Error| StoreError::ServerGone {
            detail: format!("connecting to {}: {e}", opts.socket.display()),
        };
        let stream = UnixStream::connect(&opts.socket).map_err(gone)?;
        stream.set_read_timeout(Some(opts.timeout)).map_err(gone)?;
        stream.set_write_timeout(Some(opts.timeout)).map_err(gone)?;
        let mut c = Conn {
            spin: opts.spin,
            stream,
            tx: Vec::new(),
            rx: Vec::new(),
            generation,
            last_used: Instant::now(),
        };
        let refused = |reason: String| StoreError::Refused { reason };
        match &opts.auth {
            // The shared-key handshake (te_base::auth), its last frame (the proof) staged in `tx`
            // for the round trip below, which answers with the welcome.
            Some(key) => {
                let mut frames = HelloFrames { conn: &mut c, join };
                let peer = opts.socket.display().to_string();
                auth::block_on(auth::initiate(&mut frames, key, AUTH_CONTEXT, &peer)).map_err(|e| match e {
                    HandshakeError::Frames(e) => e,
                    HandshakeError::Malformed { .. } => wire::bad_count("challenge").into(),
                    HandshakeError::Unauthenticated(e) => refused(e.to_string()),
                })?;
            }
            None => {
                wire::begin(&mut c.tx, Op::Hello);
                c.tx.extend_from_slice(&join);
                wire::finish(&mut c.tx)?;
            }
        }
        let (op, _) = c.round_trip(None)?;
        if op == Op::Challenge {
            return Err(refused(
                "the server requires the shared key; TE_AUTH_KEY_FILE is not set here".into(),
            ));
        }
        let w = match op {
            Op::Ok => Welcome::decode(&c.rx)?,
            _ => return Err(c.error_reply(op)),
        };
        Ok((c, w))
    }

    /// Sends `tx` (with `fd`), reads the reply into `rx`.
    fn round_trip(&mut self, fd: Option<std::os::fd::BorrowedFd<'_>>) -> Result<(Op, ())> {
        if let Err(e) = send_frame(&self.stream, &self.tx, fd) {
            // A server that refused us wrote why before closing: report that, not the EPIPE.
            if let Ok((h, _)) = recv_frame(&self.stream, &mut self.rx, MAX_REPLY, false) {
                if h.op == Op::Err {
                    return Err(self.error_reply(h.op));
                }
            }
            return Err(StoreError::ServerGone {
                detail: format!("sending: {e}"),
            });
        }
        super::io::spin_readable(&self.stream, self.spin);
        let (h, _) = recv_frame(&self.stream, &mut self.rx, MAX_REPLY, false).map_err(|e| match e {
            RecvError::Io(e) => StoreError::ServerGone {
                detail: format!("reading the reply: {e}"),
            },
            RecvError::Wire(w) => w.into(),
        })?;
        self.last_used = Instant::now();
        Ok((h.op, ()))
    }

    /// The error of a non-`Ok` reply.
    fn error_reply(&self, op: Op) -> StoreError {
        match op {
            Op::Err => wire::decode_error(&mut Reader::new(&self.rx)).unwrap_or_else(|e| e.into()),
            other => wire::bad_op(other as u8).into(),
        }
    }
}

/// The hello's frames for the shared-key handshake: a step is staged in `tx` and sent by the
/// next round trip, whose reply must be the server's challenge.
struct HelloFrames<'c> {
    conn: &'c mut Conn,
    join: [u8; 16],
}

impl HandshakeFrames for HelloFrames<'_> {
    type Error = StoreError;

    async fn send(&mut self, step: Step, body: &[u8]) -> Result<()> {
        let tx = &mut self.conn.tx;
        if step == Step::Hello {
            wire::begin(tx, Op::Hello);
            tx.extend_from_slice(&self.join);
        } else {
            wire::begin(tx, Op::Proof);
        }
        tx.extend_from_slice(body);
        Ok(wire::finish(tx)?)
    }

    async fn recv(&mut self, _: Step) -> Result<Vec<u8>> {
        match self.conn.round_trip(None)?.0 {
            Op::Challenge => Ok(self.conn.rx.clone()),
            Op::Ok => Err(StoreError::Refused {
                reason: "the server did not prove the shared key".into(),
            }),
            op => Err(self.conn.error_reply(op)),
        }
    }
}

struct Live {
    token: [u8; 16],
    control: Conn,
    idle: Duration,
}

struct SessionState {
    live: Option<Live>,
    /// [`Client::close`] ran: no call opens a session again.
    closed: bool,
    generation: u64,
    next_try: Instant,
    delay: Duration,
}

/// A memfd buffer this process allocated, whether it is registered with the server, and the
/// caller's registrations inside it (start -> length): the whole buffer, or views of it such as
/// one layer's part. The server maps the whole buffer while any view is registered.
struct Shared {
    len: u64,
    fd: OwnedFd,
    registered: bool,
    views: BTreeMap<u64, u64>,
}

/// The standalone client behind a `Store`.
pub struct Client {
    opts: StandaloneConfig,
    session: Mutex<SessionState>,
    pool: Mutex<Vec<Conn>>,
    buffers: Mutex<BTreeMap<u64, Shared>>,
    cache: Mutex<ClientCache>,
    /// Request bytes sent by ranged gets (for the bench's bytes-per-call).
    get_bytes: std::sync::atomic::AtomicU64,
    gets: std::sync::atomic::AtomicU64,
    /// A registered bounce buffer for `Store::put`/`Store::get`, whose memory is the caller's.
    scratch: Mutex<Option<KvBuffer>>,
}

impl Client {
    /// Connects (opens a session) to the server at `opts.socket`.
    pub fn connect(opts: StandaloneConfig) -> Result<Client> {
        let c = Client {
            cache: Mutex::new(ClientCache::new(
                opts.key_handle_slots,
                opts.key_handle_debug,
                te_base::auth::random_u64(),
            )),
            opts,
            session: Mutex::new(SessionState {
                live: None,
                closed: false,
                generation: 0,
                next_try: Instant::now(),
                delay: Duration::ZERO,
            }),
            pool: Mutex::new(Vec::new()),
            buffers: Mutex::new(BTreeMap::new()),
            get_bytes: Default::default(),
            gets: Default::default(),
            scratch: Mutex::new(None),
        };
        c.ensure_session()?;
        Ok(c)
    }

    /// The current session's token and generation, reconnecting (after the backoff) when the
    /// last one was lost; a new session re-registers every buffer.
    fn ensure_session(&self) -> Result<([u8; 16], u64, Duration)> {
        let mut st = self.session.lock();
        if let Some(l) = &st.live {
            return Ok((l.token, st.generation, l.idle));
        }
        if st.closed {
            return Err(StoreError::Closed);
        }
        let now = Instant::now();
        if now < st.next_try {
            return Err(StoreError::ServerGone {
                detail: format!(
                    "reconnecting to {} (next try in {} ms)",
                    self.opts.socket.display(),
                    (st.next_try - now).as_millis()
                ),
            });
        }
        let generation = st.generation + 1;
        let opened = Conn::open(&self.opts, [0; 16], generation).map(|(mut control, w)| {
            for (&base, b) in self.buffers.lock().iter_mut() {
                b.registered = b.registered && register_on(&mut control, base, b.len, &b.fd).is_ok();
            }
            Live {
                token: w.token,
                control,
                idle: Duration::from_millis(w.idle_ms as u64),
            }
        });
        match opened {
            Ok(live) => {
                let out = (live.token, generation, live.idle);
                st.live = Some(live);
                st.generation = generation;
                st.delay = Duration::ZERO;
                self.cache.lock().reset(generation);
                Ok(out)
            }
            Err(e) => {
                st.delay = (st.delay * 2).clamp(FIRST_BACKOFF, MAX_BACKOFF);
                st.next_try = now + st.delay;
                Err(match e {
                    e @ (StoreError::ServerGone { .. } | StoreError::Refused { .. }) => e,
                    other => StoreError::ServerGone {
                        detail: format!("re-opening the session: {other}"),
                    },
                })
            }
        }
    }

    /// Marks session `generation` lost (its connections are dropped).
    fn lost(&self, generation: u64) {
        let mut st = self.session.lock();
        if st.generation == generation && st.live.is_some() {
            st.live = None;
            st.next_try = Instant::now();
            self.pool.lock().clear();
        }
    }

    fn checkout(&self) -> Result<Conn> {
        let (token, generation, idle) = self.ensure_session()?;
        {
            let mut pool = self.pool.lock();
            while let Some(c) = pool.pop() {
                // The server closes data connections idle past its timeout: use only fresh ones.
                if c.generation == generation && c.last_used.elapsed() < idle / 2 {
                    return Ok(c);
                }
            }
        }
        match Conn::open(&self.opts, token, generation) {
            Ok((c, _)) => Ok(c),
            Err(e) => {
                if matches!(e, StoreError::ServerGone { .. } | StoreError::Refused { .. }) {
                    self.lost(generation);
                }
                Err(e)
            }
        }
    }

    /// Runs one request on a pooled connection: `build` writes the frame into the connection's
    /// buffer, `parse` reads an `Ok` reply. Another reply is the call's error.
    fn call<R>(
        &self,
        build: impl FnOnce(&mut Vec<u8>) -> Result<()>,
        parse: impl FnOnce(Op, &[u8]) -> Result<R>,
    ) -> Result<R> {
        let mut c = self.checkout()?;
        build(&mut c.tx)?;
        let out = self.exchange(&mut c, parse);
        self.checkin(c, &out);
        out
    }

    fn exchange<R>(&self, c: &mut Conn, parse: impl FnOnce(Op, &[u8]) -> Result<R>) -> Result<R> {
        let (op, ()) = c.round_trip(None)?;
        match op {
            Op::Ok | Op::KeyHandleUnknown => parse(op, &c.rx),
            other => Err(c.error_reply(other)),
        }
    }

    fn checkin<R>(&self, c: Conn, out: &Result<R>) {
        match out {
            Err(StoreError::ServerGone { .. }) => self.lost(c.generation),
            Err(StoreError::Protocol { .. }) => {} // the connection's state is unknown: drop it
            _ => self.pool.lock().push(c),
        }
    }

    /// Runs `f` on the registered scratch buffer, grown to at least `len` bytes.
    fn with_scratch<R>(&self, len: usize, f: impl FnOnce(&KvBuffer) -> Result<R>) -> Result<R> {
        let mut s = self.scratch.lock();
        if s.as_ref().is_none_or(|b| b.len() < len) {
            if let Some(old) = s.take() {
                let _ = self.free(old);
            }
            let b = self.alloc(len.max(1 << 20).next_power_of_two())?;
            self.register(b.addr(), b.len() as u64)?;
            *s = Some(b);
        }
        f(s.as_ref().expect("set above"))
    }

    /// `Store::put`: the bytes go through the scratch buffer (copied here, then by the server).
    pub fn put_bytes(&self, key: &str, data: &[u8], depth: u32) -> Result<()> {
        self.with_scratch(data.len(), |b| {
            // SAFETY: the scratch buffer is used by one call at a time (its lock is held).
            unsafe { b.bytes_mut()[..data.len()].copy_from_slice(data) };
            let ranges = [crate::range_map::Range::new(0, data.len() as u64, b.addr())];
            self.put_ranges(&[RangedPut {
                key,
                object_len: data.len() as u64,
                ranges: &ranges,
                depth,
            }])?
            .remove(0)
        })
    }

    /// `Store::get`: the object lands in the scratch buffer and is copied out.
    pub fn get_bytes(&self, key: &str) -> Result<Vec<u8>> {
        let Some(mut len) = self.object_lens(&[key])?[0] else {
            return Err(StoreError::NotFound { key: key.to_owned() });
        };
        for _ in 0..8 {
            let got = self.with_scratch(len as usize, |b| {
                match self.get_whole(&[(key, b.addr(), b.len() as u64)])?.remove(0) {
                    // SAFETY: the get has finished and the scratch lock is held.
                    Ok(n) => Ok(Ok(unsafe { b.bytes()[..n as usize].to_vec() })),
                    Err(StoreError::BufferTooSmall { need, .. }) => Ok(Err(need)),
                    Err(e) => Err(e),
                }
            })?;
            match got {
                Ok(v) => return Ok(v),
                Err(need) => len = need,
            }
        }
        Err(StoreError::WriteConflict { key: key.to_owned() })
    }

    /// Allocates a sealed memfd buffer this client can register.
    pub fn alloc(&self, len: usize) -> Result<KvBuffer> {
        let buf = KvBuffer::new(len)?;
        let fd = buf
            .fd()
            .try_clone_to_owned()
            .map_err(|e| StoreError::io("dup of a memfd", e))?;
        self.buffers.lock().insert(
            buf.addr(),
            Shared {
                len: len as u64,
                fd,
                registered: false,
                views: BTreeMap::new(),
            },
        );
        Ok(buf)
    }

    /// Forgets a buffer (deregistering it and every view of it first).
    pub fn free(&self, buf: KvBuffer) -> Result<()> {
        let res = self.unmap_on_server(buf.addr(), true).map(|_| ());
        self.buffers.lock().remove(&buf.addr());
        res
    }

    /// Registers `[addr, addr + len)`, which must lie inside one buffer from [`Client::alloc`]
    /// (the whole buffer, or a view of it such as one layer's part): the buffer's memfd travels
    /// to the server, which maps it, once for all its views.
    pub fn register(&self, addr: u64, len: u64) -> Result<()> {
        let not_shareable = |reason: &str| StoreError::NotShareable {
            addr,
            len,
            reason: reason.into(),
        };
        self.ensure_session()?;
        // Lock order everywhere: session, then buffers.
        let mut st = self.session.lock();
        let mut buffers = self.buffers.lock();
        let Some((&base, b)) = buffers.range_mut(..=addr).next_back() else {
            return Err(not_shareable(
                "not a buffer from Store::alloc_buffer (device memory and framework tensors would need IPC handles)",
            ));
        };
        if len == 0 || addr - base >= b.len || len > b.len - (addr - base) {
            return Err(not_shareable(
                "not inside one buffer from Store::alloc_buffer (register the buffer or a view inside it)",
            ));
        }
        if b.registered {
            b.views.insert(addr, len);
            return Ok(());
        }
        let generation = st.generation;
        let Some(live) = st.live.as_mut() else {
            return Err(StoreError::ServerGone {
                detail: "the session was lost".into(),
            });
        };
        let r = register_on(&mut live.control, base, b.len, &b.fd);
        if r.is_ok() {
            b.registered = true;
            b.views.insert(addr, len);
        }
        drop(buffers);
        drop(st);
        if matches!(r, Err(StoreError::ServerGone { .. })) {
            self.lost(generation);
        }
        r
    }

    /// Deregisters the registration (buffer or view) that starts at `addr`; false if none did.
    /// The server unmaps the buffer once its last registered view is gone.
    pub fn deregister(&self, addr: u64) -> Result<bool> {
        self.unmap_on_server(addr, false)
    }

    /// Drops the registration at `addr` (with `all`, every view of its buffer) and, when none is
    /// left, the server's mapping of the buffer.
    fn unmap_on_server(&self, addr: u64, all: bool) -> Result<bool> {
        let mut st = self.session.lock();
        let mut buffers = self.buffers.lock();
        let Some((&base, b)) = buffers.range_mut(..=addr).next_back() else {
            return Ok(false);
        };
        let had = if all {
            let had = !b.views.is_empty();
            b.views.clear();
            had
        } else {
            b.views.remove(&addr).is_some()
        };
        if !had || !b.views.is_empty() || !b.registered {
            return Ok(had);
        }
        b.registered = false;
        drop(buffers);
        let Some(live) = st.live.as_mut() else {
            // No session: the server already dropped the mapping.
            return Ok(true);
        };
        let c = &mut live.control;
        wire::begin(&mut c.tx, Op::Deregister);
        c.tx.u64(base);
        wire::finish(&mut c.tx)?;
        let (op, ()) = c.round_trip(None)?;
        if op != Op::Ok {
            return Err(c.error_reply(op));
        }
        Ok(true)
    }

    /// True if `key` exists.
    pub fn exists(&self, key: &str) -> Result<bool> {
        self.call(
            |tx| Ok(wire::encode_keys(tx, Op::Exists, std::iter::once(key))?),
            |_, rx| read_bool(rx),
        )
    }

    /// Removes `key`.
    pub fn remove(&self, key: &str) -> Result<bool> {
        self.call(
            |tx| Ok(wire::encode_keys(tx, Op::Remove, std::iter::once(key))?),
            |_, rx| read_bool(rx),
        )
    }

    /// Consecutive stored keys from the first.
    pub fn exists_consecutive(&self, keys: &[&str]) -> Result<usize> {
        self.call(
            |tx| Ok(wire::encode_keys(tx, Op::ExistsConsecutive, keys.iter().copied())?),
            |_, rx| {
                let mut r = Reader::new(rx);
                let n = r.u64("consecutive keys")?;
                r.end()?;
                Ok(n as usize)
            },
        )
    }

    /// Object lengths.
    pub fn object_lens(&self, keys: &[&str]) -> Result<Vec<Option<u64>>> {
        self.call(
            |tx| Ok(wire::encode_keys(tx, Op::ObjectLens, keys.iter().copied())?),
            |_, rx| {
                let mut r = Reader::new(rx);
                let v = wire::decode_results(&mut r, keys.len())?;
                r.end()?;
                Ok(v.into_iter().map(|x| x.ok()).collect())
            },
        )
    }

    /// Ranged get, naming the key set by handle when the cache holds it.
    pub fn get_ranges(&self, items: &[RangedGet<'_>]) -> Result<Vec<Result<u64>>> {
        let keys = || items.iter().map(|i| i.key);
        let mut c = self.checkout()?;
        let look = {
            let mut cache = self.cache.lock();
            let mut look = cache.lookup(keys());
            if cache.session() != c.generation {
                // The cache was reset for another session since this connection was opened.
                look.handle = 0;
            }
            look
        };
        let mut send_keys = look.handle == 0;
        let out = loop {
            if let Err(e) = wire::encode_get_ranges(&mut c.tx, look.handle, look.fingerprint, items, send_keys) {
                break Err(e.into());
            }
            self.get_bytes
                .fetch_add(c.tx.len() as u64, std::sync::atomic::Ordering::Relaxed);
            self.gets.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let reply = self.exchange(&mut c, |op, rx| {
                if op == Op::KeyHandleUnknown {
                    return Ok(None);
                }
                let mut r = Reader::new(rx);
                let minted = r.u64("minted handle")?;
                let v = wire::decode_results(&mut r, items.len())?;
                r.end()?;
                Ok(Some((minted, v)))
            });
            match reply {
                Ok(None) if !send_keys => {
                    // The server forgot the handle: drop it, resend the keys (it mints anew).
                    self.cache.lock().forget(look.fingerprint);
                    send_keys = true;
                }
                Ok(None) => break Err(wire::bad_op(Op::KeyHandleUnknown as u8).into()),
                Ok(Some((minted, v))) => {
                    let mut cache = self.cache.lock();
                    if send_keys {
                        cache.miss();
                        // A handle minted by a session that has since been replaced is dropped.
                        if cache.session() == c.generation {
                            cache.insert(look.fingerprint, minted, keys());
                        }
                    } else {
                        cache.hit();
                    }
                    break Ok(v);
                }
                Err(e) => break Err(e),
            }
        };
        self.checkin(c, &out);
        out
    }

    /// Ranged put.
    pub fn put_ranges(&self, items: &[RangedPut<'_>]) -> Result<Vec<Result<()>>> {
        self.call(
            |tx| Ok(wire::encode_put_ranges(tx, items)?),
            |_, rx| {
                let mut r = Reader::new(rx);
                let v = wire::decode_results(&mut r, items.len())?;
                r.end()?;
                Ok(v.into_iter().map(|x| x.map(|_| ())).collect())
            },
        )
    }

    /// Whole-object get.
    pub fn get_whole(&self, items: &[(&str, u64, u64)]) -> Result<Vec<Result<u64>>> {
        self.call(
            |tx| Ok(wire::encode_get_whole(tx, items)?),
            |_, rx| {
                let mut r = Reader::new(rx);
                r.u64("whole get reply")?;
                let v = wire::decode_results(&mut r, items.len())?;
                r.end()?;
                Ok(v)
            },
        )
    }

    /// A request with an empty (or one-byte) payload and an `Ok` reply parsed by `parse`.
    fn simple<R>(&self, op: Op, arg: Option<u8>, parse: impl FnOnce(&[u8]) -> Result<R>) -> Result<R> {
        self.call(
            |tx| {
                wire::begin(tx, op);
                if let Some(a) = arg {
                    tx.u8(a);
                }
                Ok(wire::finish(tx)?)
            },
            |_, rx| parse(rx),
        )
    }

    /// The server's counters plus this client's key-handle counters.
    pub fn stats(&self) -> Result<StoreStats> {
        let mut s = self.simple(Op::Stats, None, |rx| Ok(wire::decode_stats(rx)?))?;
        let n = self.cache.lock().counts();
        let sa = s.standalone.get_or_insert_with(Default::default);
        sa.key_handle_hits = n.hits;
        sa.key_handle_misses = n.misses;
        sa.key_handle_mints = n.mints;
        sa.key_handle_remints = n.remints;
        Ok(s)
    }

    /// The server's phase report.
    pub fn phase_report(&self) -> Result<Option<te_base::PhaseReport>> {
        self.simple(Op::PhaseReport, None, |rx| Ok(wire::decode_phases(rx)?))
    }

    /// Clears the server's phase report.
    pub fn reset_phase_report(&self) -> Result<()> {
        self.simple(Op::ResetPhases, None, |_| Ok(()))
    }

    /// Flushes the server's store.
    pub fn flush(&self) -> Result<()> {
        self.simple(Op::Flush, None, |_| Ok(()))
    }

    /// Compacts the server's SSD log.
    pub fn compact(&self, force: bool) -> Result<u64> {
        self.simple(Op::Compact, Some(force as u8), |rx| {
            let mut r = Reader::new(rx);
            let n = r.u64("compacted")?;
            r.end()?;
            Ok(n)
        })
    }

    /// The reuse-distance line (with `UMBP_KEY_HANDLE_DEBUG=1`).
    pub fn key_handle_report(&self) -> Option<String> {
        self.cache.lock().reuse().map(|r| r.line())
    }

    /// Mean request bytes of the ranged gets so far, and how many there were.
    pub fn get_request_bytes(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.get_bytes.load(Relaxed), self.gets.load(Relaxed))
    }

    /// Ends the session: connections close, so the server unmaps this client's buffers.
    pub fn close(&self) {
        self.pool.lock().clear();
        let mut st = self.session.lock();
        st.live = None;
        st.closed = true;
        if self.opts.key_handle_debug {
            if let Some(line) = self.key_handle_report() {
                eprintln!("umbp key handles: {:?}; {line}", self.cache.lock().counts());
            }
        }
    }
}

fn register_on(c: &mut Conn, base: u64, len: u64, fd: &OwnedFd) -> Result<()> {
    wire::begin(&mut c.tx, Op::Register);
    c.tx.u64(base);
    c.tx.u64(len);
    wire::finish(&mut c.tx)?;
    let (op, ()) = c.round_trip(Some(fd.as_fd()))?;
    if op != Op::Ok {
        return Err(c.error_reply(op));
    }
    Ok(())
}

fn read_bool(rx: &[u8]) -> Result<bool> {
    let mut r = Reader::new(rx);
    let b = r.u8("flag")?;
    r.end()?;
    Ok(b != 0)
}
