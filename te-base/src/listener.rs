//! What every listener of the engine shares when it faces peers it does not trust: connection
//! caps (total and per source address), deadlines for the handshake, idle time and each frame,
//! TCP keepalive and `TCP_USER_TIMEOUT` on accepted sockets, and a backoff on accept errors so
//! `EMFILE` does not spin a core.
//!
//! The TCP transport, the p2p metadata listener, the rdma handshake listener and the UMBP
//! servers use these pieces with their own variable prefix (`TE_TCP`, `TE_P2P`...).

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::config::{parse_var, Env, LISTENER_VAR_SUFFIXES};
use crate::error::{Error, Result};

/// Default connection cap per listener.
pub const DEFAULT_MAX_CONNECTIONS: usize = 2048;
/// Default connection cap per source address.
pub const DEFAULT_MAX_PER_SOURCE: usize = 256;
/// Default time a new connection has to complete its handshake.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Default time a connection may sit without a frame before it is closed.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(120);

/// Limits of one listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenerLimits {
    /// `<PREFIX>_MAX_CONNECTIONS`: connections served at once; more are closed at accept.
    pub max_connections: usize,
    /// `<PREFIX>_MAX_CONNECTIONS_PER_SOURCE`: connections from one IP address at once.
    pub max_per_source: usize,
    /// `<PREFIX>_HANDSHAKE_TIMEOUT_MS`: accept to authenticated.
    pub handshake_timeout: Duration,
    /// `<PREFIX>_IDLE_TIMEOUT_MS`: longest wait for the first byte of the next frame.
    pub idle_timeout: Duration,
    /// The transport's own timeout (for TCP `TE_TCP_TIMEOUT_MS`): longest time one frame (a
    /// header once its first byte arrived, a payload, a reply write) may make no progress.
    pub frame_timeout: Duration,
}

impl ListenerLimits {
    /// Defaults with the given per-frame timeout.
    pub fn with_frame_timeout(frame_timeout: Duration) -> Self {
        ListenerLimits {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_per_source: DEFAULT_MAX_PER_SOURCE,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            frame_timeout,
        }
    }

    /// Reads `<prefix>_MAX_CONNECTIONS`, `<prefix>_MAX_CONNECTIONS_PER_SOURCE`,
    /// `<prefix>_HANDSHAKE_TIMEOUT_MS` and `<prefix>_IDLE_TIMEOUT_MS` over the defaults.
    pub fn from_env(env: &dyn Env, prefix: &str, frame_timeout: Duration) -> Result<Self> {
        let mut l = ListenerLimits::with_frame_timeout(frame_timeout);
        let positive = |var: String| -> Result<Option<u64>> {
            match parse_var::<u64>(env, &var)? {
                Some(0) => Err(Error::config(&var, "0", "must be at least 1")),
                v => Ok(v),
            }
        };
        let [max, per_source, handshake, idle] = LISTENER_VAR_SUFFIXES;
        if let Some(n) = positive(format!("{prefix}{max}"))? {
            l.max_connections = n as usize;
        }
        if let Some(n) = positive(format!("{prefix}{per_source}"))? {
            l.max_per_source = n as usize;
        }
        if let Some(ms) = positive(format!("{prefix}{handshake}"))? {
            l.handshake_timeout = Duration::from_millis(ms);
        }
        if let Some(ms) = positive(format!("{prefix}{idle}"))? {
            l.idle_timeout = Duration::from_millis(ms);
        }
        Ok(l)
    }
}

/// Counts served connections, in total and per source address.
#[derive(Debug)]
pub struct ConnectionGate {
    max_total: usize,
    max_per_source: usize,
    state: Arc<Mutex<GateState>>,
}

#[derive(Debug, Default)]
struct GateState {
    total: usize,
    per_source: HashMap<IpAddr, usize>,
}

/// One admitted connection; dropping it frees its place.
#[derive(Debug)]
pub struct ConnectionPermit {
    source: IpAddr,
    state: Arc<Mutex<GateState>>,
}

impl Drop for ConnectionPermit {
    fn drop(&mut self) {
        let mut s = self.state.lock();
        s.total -= 1;
        if let Some(n) = s.per_source.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                s.per_source.remove(&self.source);
            }
        }
    }
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The listener serves its maximum.
    Full,
    /// The source address has its maximum.
    SourceFull,
}

impl ConnectionGate {
    /// A gate for `limits`.
    pub fn new(limits: &ListenerLimits) -> Self {
        ConnectionGate {
            max_total: limits.max_connections,
            max_per_source: limits.max_per_source,
            state: Arc::default(),
        }
    }

    /// Admits a connection from `source`, or says why not.
    pub fn admit(&self, source: IpAddr) -> std::result::Result<ConnectionPermit, Refusal> {
        let mut s = self.state.lock();
        if s.total >= self.max_total {
            return Err(Refusal::Full);
        }
        let n = s.per_source.entry(source).or_insert(0);
        if *n >= self.max_per_source {
            return Err(Refusal::SourceFull);
        }
        *n += 1;
        s.total += 1;
        Ok(ConnectionPermit {
            source,
            state: self.state.clone(),
        })
    }

    /// Connections admitted now.
    pub fn open(&self) -> usize {
        self.state.lock().total
    }
}

/// Sleeps after accept errors, doubling from 1 ms to 1 s, so a listener out of descriptors
/// (`EMFILE`, `ENFILE`) or memory waits for them instead of spinning; reset by a success.
#[derive(Debug, Default)]
pub struct AcceptBackoff {
    delay: Duration,
    logged: u64,
}

impl AcceptBackoff {
    const FIRST: Duration = Duration::from_millis(1);
    const MAX: Duration = Duration::from_secs(1);

    /// A successful accept.
    pub fn reset(&mut self) {
        self.delay = Duration::ZERO;
    }

    /// Handles a failed accept: logs (rate-limited) and sleeps.
    pub async fn failed(&mut self, listener: &str, e: &io::Error) {
        self.step();
        if self.logged.is_power_of_two() {
            tracing::warn!(
                "{listener}: accept failed ({e}); backing off {} ms ({} failures)",
                self.delay.as_millis(),
                self.logged
            );
        }
        tokio::time::sleep(self.delay).await;
    }

    /// Counts one failure and returns the delay to sleep.
    fn step(&mut self) -> Duration {
        self.delay = if self.delay.is_zero() {
            Self::FIRST
        } else {
            (self.delay * 2).min(Self::MAX)
        };
        self.logged += 1;
        self.delay
    }

    /// The delay the last failure slept (for tests).
    pub fn current(&self) -> Duration {
        self.delay
    }
}

/// Keepalive and `TCP_USER_TIMEOUT` on an accepted (or connected) socket, without duplicating its
/// descriptor: the kernel then also notices a peer that vanished without closing.
pub fn tune_socket(stream: &tokio::net::TcpStream, timeout: Duration) {
    let _ = stream.set_nodelay(true);
    let sock = socket2::SockRef::from(stream);
    let idle = (timeout / 2).max(Duration::from_secs(1));
    let ka = socket2::TcpKeepalive::new().with_time(idle).with_interval(idle);
    let _ = sock.set_tcp_keepalive(&ka);
    #[cfg(target_os = "linux")]
    let _ = sock.set_tcp_user_timeout(Some(timeout));
}

/// Waits for the next connection `gate` admits: accept errors back off, a connection over the caps
/// is closed at once (logged by [`log_refusal`], naming `listener`), an admitted socket is tuned
/// ([`tune_socket`] with `socket_timeout`). Dropping the permit frees its place.
pub async fn accept_admitted(
    listener: &tokio::net::TcpListener,
    gate: &ConnectionGate,
    backoff: &mut AcceptBackoff,
    name: &str,
    socket_timeout: Duration,
) -> (tokio::net::TcpStream, std::net::SocketAddr, ConnectionPermit) {
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(accepted) => {
                backoff.reset();
                accepted
            }
            Err(e) => {
                backoff.failed(name, &e).await;
                continue;
            }
        };
        match gate.admit(from.ip()) {
            Ok(permit) => {
                tune_socket(&stream, socket_timeout);
                return (stream, from, permit);
            }
            Err(why) => log_refusal(name, &from, &format_args!("over the connection caps ({why:?})")),
        }
    }
}

/// Shortest time between two logged refusals of one listener.
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// What one listener has logged of its refusals.
#[derive(Debug, Clone, Copy)]
struct RefusalTally {
    last_logged: Instant,
    unlogged: u64,
}

/// Decides whether a refusal at `now` is logged: the first one is, then at most one per
/// [`REFUSAL_LOG_INTERVAL`]. Returns how many refusals went unlogged before it.
fn note_refusal(tally: &mut Option<RefusalTally>, now: Instant) -> Option<u64> {
    match tally {
        Some(t) if now.saturating_duration_since(t.last_logged) < REFUSAL_LOG_INTERVAL => {
            t.unlogged += 1;
            None
        }
        Some(t) => {
            let unlogged = t.unlogged;
            *t = RefusalTally {
                last_logged: now,
                unlogged: 0,
            };
            Some(unlogged)
        }
        None => {
            *tally = Some(RefusalTally {
                last_logged: now,
                unlogged: 0,
            });
            Some(0)
        }
    }
}

/// Logs a listener's refusal of a peer (it failed to prove the shared key, or it was over the
/// connection caps) at warn, rate-limited per listener: the first refusal, then at most one line
/// per [`REFUSAL_LOG_INTERVAL`] with the count of refusals not logged since. Every listener logs
/// its refusals through this, so a scan or a misconfigured peer shows alike everywhere without
/// flooding the log. `why` is for the operator; the peer was told nothing more than before.
pub fn log_refusal(listener: &str, from: &dyn std::fmt::Display, why: &dyn std::fmt::Display) {
    // One entry per listener kind (a handful of names), so a linear scan is enough.
    static TALLIES: Mutex<Vec<(String, Option<RefusalTally>)>> = parking_lot::const_mutex(Vec::new());
    let logged = {
        let mut tallies = TALLIES.lock();
        let at = match tallies.iter().position(|(name, _)| name == listener) {
            Some(at) => at,
            None => {
                tallies.push((listener.to_string(), None));
                tallies.len() - 1
            }
        };
        note_refusal(&mut tallies[at].1, Instant::now())
    };
    match logged {
        Some(0) => tracing::warn!("{listener}: refused {from}: {why}"),
        Some(n) => tracing::warn!("{listener}: refused {from}: {why} ({n} more refusals since the last one logged)"),
        None => {}
    }
}

/// First allocation of [`read_growing`]'s buffer.
const FIRST_CHUNK: usize = 16 << 10;

/// Reads exactly `len` bytes (a length the peer announced), growing the buffer only as they arrive
/// (doubling from 16 KiB, never past `len`): a peer announcing more than it sends costs what it
/// sent, not what it announced. A close before `len` bytes is `UnexpectedEof`.
pub async fn read_growing<R: tokio::io::AsyncRead + Unpin>(stream: &mut R, len: usize) -> io::Result<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::with_capacity(len.min(FIRST_CHUNK));
    // Each pass reads at least one byte or ends: at most `len` passes.
    while buf.len() < len {
        if buf.len() == buf.capacity() {
            buf.reserve_exact(buf.len().max(FIRST_CHUNK).min(len - buf.len()));
        }
        let room = (buf.capacity() - buf.len()).min(len - buf.len());
        if (&mut *stream).take(room as u64).read_buf(&mut buf).await? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(buf)
}

/// Runs `fut` with a deadline; an expired deadline is `io::ErrorKind::TimedOut` naming `what`.
pub async fn deadline<T>(limit: Duration, what: &str, fut: impl Future<Output = io::Result<T>>) -> io::Result<T> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("{what}: no progress within {} ms", limit.as_millis()),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn refusals_are_logged_first_then_once_per_interval_with_the_count() {
        let t0 = Instant::now();
        let mut tally = None;
        assert_eq!(note_refusal(&mut tally, t0), Some(0));
        for i in 1..=5 {
            assert_eq!(note_refusal(&mut tally, t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(note_refusal(&mut tally, t0 + REFUSAL_LOG_INTERVAL), Some(5));
        assert_eq!(note_refusal(&mut tally, t0 + REFUSAL_LOG_INTERVAL), None);
        assert_eq!(note_refusal(&mut tally, t0 + 2 * REFUSAL_LOG_INTERVAL), Some(1));
    }

    use crate::config::MapEnv;

    #[test]
    fn gate_caps_total_and_per_source() {
        let limits = ListenerLimits {
            max_connections: 3,
            max_per_source: 2,
            ..ListenerLimits::with_frame_timeout(Duration::from_secs(1))
        };
        let gate = ConnectionGate::new(&limits);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let p1 = gate.admit(a).unwrap();
        let _p2 = gate.admit(a).unwrap();
        assert_eq!(gate.admit(a).unwrap_err(), Refusal::SourceFull);
        let _p3 = gate.admit(b).unwrap();
        assert_eq!(gate.admit(b).unwrap_err(), Refusal::Full);
        drop(p1);
        assert_eq!(gate.open(), 2);
        assert!(gate.admit(a).is_ok());
    }

    #[test]
    fn limits_are_read_strictly() {
        let env = MapEnv::new([("TE_X_MAX_CONNECTIONS", "7"), ("TE_X_IDLE_TIMEOUT_MS", "250")]);
        let l = ListenerLimits::from_env(&env, "TE_X", Duration::from_secs(3)).unwrap();
        assert_eq!(l.max_connections, 7);
        assert_eq!(l.idle_timeout, Duration::from_millis(250));
        assert_eq!(l.max_per_source, DEFAULT_MAX_PER_SOURCE);
        for (var, bad) in [("TE_X_MAX_CONNECTIONS", "0"), ("TE_X_HANDSHAKE_TIMEOUT_MS", "-1")] {
            let e = ListenerLimits::from_env(&MapEnv::new([(var, bad)]), "TE_X", Duration::from_secs(1)).unwrap_err();
            assert!(e.to_string().contains(var), "{e}");
        }
    }

    #[tokio::test]
    async fn backoff_doubles_to_a_ceiling_and_resets() {
        let mut b = AcceptBackoff::default();
        let e = io::Error::from_raw_os_error(libc::EMFILE);
        b.failed("test", &e).await;
        b.failed("test", &e).await;
        assert_eq!(b.current(), 2 * AcceptBackoff::FIRST);
        for _ in 0..20 {
            b.step();
        }
        assert_eq!(b.current(), AcceptBackoff::MAX);
        b.reset();
        b.failed("test", &e).await;
        assert_eq!(b.current(), AcceptBackoff::FIRST);
    }
}
