//! Standalone mode's settings, the workers' and the server's, each declared once in the table at
//! the end of this file ([`StandaloneKey`], the table macro of [`crate::config::StoreKey`]): its
//! variable, its Python keyword, its `umbp-server` flag if it has one, its parser, its default
//! (as the docs print it and as the value it stands for) and its doc line; the server's listener
//! limits, which `te_base::listener` reads under `UMBP_SERVER`, are listed there too.
//!
//! From it come [`StandaloneKey`] (with `FromStr`), [`ENV_VARS`], [`StandaloneSettings`] (the
//! explicit values: builder, Python keywords, `umbp-server` flags), the resolution of every
//! setting (explicit, then the variable, then the default) by a worker
//! (`StandaloneConfig::resolve`) and by the server (`server::ServerOptions::resolve`), the
//! server's flags, and [`StandaloneKey::doc_table`], docs/configuration.md's standalone-mode
//! table (a test holds the page to it). [`StandaloneKey::side`] says which of the two reads a
//! setting (a test holds it to the two resolutions).
//!
//! Adding a setting: one entry in the table, its arm in [`StandaloneKey::side`], the field it
//! fills in [`StandaloneConfig`] or `ServerOptions` and the line of the resolution that fills it,
//! and its row in docs/configuration.md (the test prints the table).
//!
//! With `TE_AUTH_KEY_FILE` set (te-base's variable), both sides prove the shared
//! key in the hello (`te_base::auth`).

use std::path::PathBuf;
use std::time::Duration;

use te_base::auth::AuthKey;
use te_base::config::Env;

use super::key_handles::{DEFAULT_CAPACITY, DEFAULT_SLOTS};
use crate::config::keys::{bad, check, parse, settings_table};
use crate::error::{Result, StoreError};

/// Default longest frame a worker may send (the server's default for its settings table).
pub const DEFAULT_MAX_FRAME: usize = 64 << 20;
/// Default per-frame timeout.
pub const DEFAULT_FRAME_TIMEOUT: Duration = Duration::from_secs(10);

/// Resolved settings of a standalone client.
#[derive(Debug, Clone)]
pub struct StandaloneConfig {
    /// The server's socket.
    pub socket: PathBuf,
    /// Longest wait for a reply.
    pub timeout: Duration,
    /// Busy-poll for a reply this long before sleeping.
    pub spin: Duration,
    /// Key-handle cache slots (0: off).
    pub key_handle_slots: usize,
    /// Keep the reuse-distance histogram.
    pub key_handle_debug: bool,
    /// The shared key (`TE_AUTH_KEY_FILE`) proved to the server.
    pub auth: Option<AuthKey>,
}

impl StandaloneConfig {
    /// A worker's settings: each explicit in `s`, else its variable in `env`, else its default.
    /// `None` when no socket is named, or with `local` (the socket is then not read): local
    /// mode. Every other worker setting is read, and a malformed one refused, either way.
    pub(crate) fn resolve(s: &StandaloneSettings, env: &dyn Env, local: bool) -> Result<Option<StandaloneConfig>> {
        let socket = if local { None } else { s.connect(env)? };
        let timeout = Duration::from_millis(s.standalone_timeout_ms(env)?);
        let spin = Duration::from_micros(s.standalone_spin_us(env)?);
        let key_handle_slots = s.key_handle_slots(env)?;
        let key_handle_debug = s.key_handle_debug(env)?;
        let auth = AuthKey::from_env(env)?;
        Ok(socket.map(|socket| StandaloneConfig {
            socket,
            timeout,
            spin,
            key_handle_slots,
            key_handle_debug,
            auth,
        }))
    }
}

/// Which side of standalone mode reads a setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// A worker's store (`Store::builder().connect(..)`; Python `te.umbp.Store`).
    Workers,
    /// The server (`umbp-server`; Python `te.umbp.Server`).
    Server,
    /// Both.
    Both,
}

impl StandaloneKey {
    /// Which side reads it (its doc line starts with "Workers:" or "Server:" where one does).
    pub fn side(self) -> Side {
        match self {
            StandaloneKey::Socket | StandaloneKey::SpinUs => Side::Both,
            StandaloneKey::TimeoutMs | StandaloneKey::KeyHandleSlots | StandaloneKey::KeyHandleDebug => Side::Workers,
            StandaloneKey::KeyHandleCapacity
            | StandaloneKey::AllowGid
            | StandaloneKey::MaxFrame
            | StandaloneKey::FrameTimeoutMs => Side::Server,
        }
    }

    /// Whether a worker reads it (a Python `Store` keyword).
    pub fn read_by_workers(self) -> bool {
        self.side() != Side::Server
    }

    /// Whether the server reads it (a Python `Server` keyword).
    pub fn read_by_server(self) -> bool {
        self.side() != Side::Workers
    }
}

settings_table! {
    /// A standalone-mode setting, a worker's or the server's (see the module docs: each is
    /// declared once).
    key: StandaloneKey,
    /// The standalone-mode variables (workers and server, with the server's listener limits).
    vars: ENV_VARS,
    /// Standalone-mode settings given explicitly (builder, Python keywords, `umbp-server` flags).
    settings: pub StandaloneSettings,
    error: bad => StoreError,
    what: "a standalone-mode UMBP setting",
    keyword_column: "Python",
    setters: ,
    entries: {
        /// The server's socket: workers connect to the `umbp-server` listening here (standalone mode), the server listens here.
        Socket {
            var: "UMBP_STANDALONE_SOCKET",
            set: connect: PathBuf,
            parse: parse::text,
            check: check::none,
            default: "unset (local mode)",
            flag: "--socket" "PATH",
        }
        /// Workers: longest wait for a reply before `ServerGone`.
        TimeoutMs {
            var: "UMBP_STANDALONE_TIMEOUT_MS",
            set: standalone_timeout_ms: u64,
            parse: parse::text,
            check: check::none,
            default: "30000" = 30_000,
        }
        /// Busy-poll this long for a reply (workers) or a request (server) before sleeping.
        SpinUs {
            var: "UMBP_STANDALONE_SPIN_US",
            set: standalone_spin_us: u64,
            parse: parse::text,
            check: check::none,
            default: "0" = 0,
        }
        /// Workers: key-set cache slots (0: off, and nothing is hashed).
        KeyHandleSlots {
            var: "UMBP_KEY_HANDLE_SLOTS",
            set: key_handle_slots: usize,
            parse: parse::text,
            check: check::none,
            default: "128" = DEFAULT_SLOTS,
        }
        /// Server: key-set table entries (0: off).
        KeyHandleCapacity {
            var: "UMBP_KEY_HANDLE_CAPACITY",
            set: key_handle_capacity: usize,
            parse: parse::text,
            check: check::none,
            default: "512" = DEFAULT_CAPACITY,
            flag: "--key-handle-capacity" "N",
        }
        /// Workers: keep and print the key handles' reuse-distance histogram.
        KeyHandleDebug {
            var: "UMBP_KEY_HANDLE_DEBUG",
            set: key_handle_debug: bool,
            parse: parse::switch,
            check: check::none,
            default: "0" = false,
        }
        /// Server: a group allowed to connect besides the server's uid (the socket is then 0660 and owned by it, else 0600).
        AllowGid {
            var: "UMBP_SERVER_ALLOW_GID",
            set: allow_gid: u32,
            parse: parse::text,
            check: check::none,
            default: "unset",
            flag: "--allow-gid" "GID",
        }
        /// Server: longest request frame.
        MaxFrame {
            var: "UMBP_SERVER_MAX_FRAME",
            set: server_max_frame: u64,
            parse: parse::bytes,
            check: check::none,
            default: "64M" = DEFAULT_MAX_FRAME as u64,
        }
        /// Server: longest stall within one frame or reply.
        FrameTimeoutMs {
            var: "UMBP_SERVER_FRAME_TIMEOUT_MS",
            set: server_frame_timeout_ms: u64,
            parse: parse::text,
            check: check::none,
            default: "10000" = DEFAULT_FRAME_TIMEOUT.as_millis() as u64,
        }
    },
    // The server's listener limits: te_base::listener::ListenerLimits::from_env under
    // "UMBP_SERVER" (a unit test holds names and defaults to te-base's).
    also: {
        /// Server: connections served at once.
        "UMBP_SERVER_MAX_CONNECTIONS" = "2048",
        /// Server: connections from one uid at once.
        "UMBP_SERVER_MAX_CONNECTIONS_PER_SOURCE" = "256",
        /// Server: accept to authenticated.
        "UMBP_SERVER_HANDSHAKE_TIMEOUT_MS" = "5000",
        /// Server: longest wait for the first byte of a connection's next frame.
        "UMBP_SERVER_IDLE_TIMEOUT_MS" = "120000",
    },
}

#[cfg(test)]
mod tests {
    use te_base::config::MapEnv;

    use super::*;
    use crate::config::{StoreKey, Value};
    use crate::standalone::server::ServerOptions;

    fn env(pairs: &[(&str, &str)]) -> MapEnv {
        MapEnv(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    /// Whether resolving a worker's settings / the server's reads `var` (a malformed value of it
    /// is refused naming it).
    fn read_by(var: &str) -> (bool, bool) {
        // Empty is malformed for every setting of the table.
        let e = env(&[("UMBP_STANDALONE_SOCKET", "/tmp/s"), (var, "")]);
        let refused = |r: Result<()>| r.is_err_and(|e| e.to_string().contains(var));
        let workers = refused(StandaloneConfig::resolve(&StandaloneSettings::default(), &e, false).map(|_| ()));
        let server = refused(ServerOptions::resolve(&StandaloneSettings::default(), &e).map(|_| ()));
        (workers, server)
    }

    #[test]
    fn each_side_reads_the_settings_its_side_says() {
        for &k in StandaloneKey::ALL {
            assert_eq!(read_by(k.var()), (k.read_by_workers(), k.read_by_server()), "{k}");
            let prefix = match k.side() {
                Side::Workers => Some("Workers:"),
                Side::Server => Some("Server:"),
                Side::Both => None,
            };
            match prefix {
                Some(p) => assert!(k.doc().starts_with(p), "{k}: {:?}", k.doc()),
                None => assert!(!k.doc().starts_with("Workers:") && !k.doc().starts_with("Server:")),
            }
        }
        for (var, ..) in StandaloneKey::READ_ELSEWHERE {
            assert_eq!(read_by(var), (false, true), "{var}");
        }
    }

    #[test]
    fn the_listener_rows_are_te_bases_limits() {
        crate::config::keys::assert_listener_rows("UMBP_SERVER", StandaloneKey::READ_ELSEWHERE);
    }

    #[test]
    fn the_server_flags_are_not_the_stores() {
        for &k in StandaloneKey::ALL {
            if let Some((flag, _)) = k.flag() {
                assert_eq!(StoreKey::from_flag(flag), None, "{flag}");
                assert!(
                    k.read_by_server(),
                    "{k}: a flag of umbp-server the server does not read"
                );
            }
        }
    }

    #[test]
    fn defaults_explicit_settings_and_variables() {
        let c = StandaloneConfig::resolve(
            &StandaloneSettings::default(),
            &env(&[("UMBP_STANDALONE_SOCKET", "/s")]),
            false,
        )
        .unwrap()
        .unwrap();
        assert_eq!(c.socket, PathBuf::from("/s"));
        assert_eq!((c.timeout, c.spin), (Duration::from_secs(30), Duration::ZERO));
        assert_eq!((c.key_handle_slots, c.key_handle_debug), (128, false));
        assert!(
            StandaloneConfig::resolve(&StandaloneSettings::default(), &env(&[]), false)
                .unwrap()
                .is_none()
        );
        // `local`: the socket is not read, even when malformed.
        let e = env(&[("UMBP_STANDALONE_SOCKET", "")]);
        assert!(StandaloneConfig::resolve(&StandaloneSettings::default(), &e, true)
            .unwrap()
            .is_none());

        // An explicit setting wins over its variable, which is then not read.
        let mut s = StandaloneSettings::default();
        s.set(StandaloneKey::Socket, Value::Path("/explicit".into())).unwrap();
        s.set(StandaloneKey::KeyHandleSlots, Value::Count(0)).unwrap();
        s.set_text(StandaloneKey::AllowGid, "7").unwrap();
        s.set_text(StandaloneKey::KeyHandleCapacity, "3").unwrap();
        let e = env(&[
            ("UMBP_STANDALONE_SOCKET", ""),
            ("UMBP_KEY_HANDLE_SLOTS", "x"),
            ("UMBP_SERVER_ALLOW_GID", "x"),
            ("UMBP_KEY_HANDLE_CAPACITY", "x"),
            ("UMBP_STANDALONE_TIMEOUT_MS", "5"),
            ("UMBP_SERVER_MAX_FRAME", "1M"),
        ]);
        let c = StandaloneConfig::resolve(&s, &e, false).unwrap().unwrap();
        assert_eq!(
            (c.socket.to_str(), c.key_handle_slots, c.timeout),
            (Some("/explicit"), 0, Duration::from_millis(5))
        );
        let o = ServerOptions::resolve(&s, &e).unwrap();
        assert_eq!((o.allow_gid, o.key_handle_capacity, o.max_frame), (Some(7), 3, 1 << 20));
        assert!(s.set(StandaloneKey::AllowGid, Value::Count(1 << 40)).is_err());
        assert!(s.set(StandaloneKey::Socket, Value::Choice("/s".into())).is_err());
    }

    #[test]
    fn malformed_values_are_refused_as_before() {
        // The texts of te_base::config::parse_var / parse_bool / parse_bytes, which read these
        // before the table.
        for (var, value, reason) in [
            ("UMBP_STANDALONE_SOCKET", "", "empty value"),
            ("UMBP_STANDALONE_SOCKET", " /s", "surrounding whitespace"),
            ("UMBP_STANDALONE_TIMEOUT_MS", "soon", "invalid digit found in string"),
            ("UMBP_STANDALONE_SPIN_US", "-1", "invalid digit found in string"),
            ("UMBP_KEY_HANDLE_SLOTS", "many", "invalid digit found in string"),
            (
                "UMBP_KEY_HANDLE_DEBUG",
                "2",
                "expected 1/0, true/false, on/off or yes/no",
            ),
        ] {
            let e =
                StandaloneConfig::resolve(&StandaloneSettings::default(), &env(&[(var, value)]), false).unwrap_err();
            assert_eq!(e.to_string(), bad(var, value, reason).to_string());
        }
        for (var, value, reason) in [
            ("UMBP_SERVER_ALLOW_GID", "wheel", "invalid digit found in string"),
            ("UMBP_SERVER_FRAME_TIMEOUT_MS", "", "empty value"),
            ("UMBP_KEY_HANDLE_CAPACITY", "-1", "invalid digit found in string"),
        ] {
            let e = ServerOptions::resolve(
                &StandaloneSettings::default(),
                &env(&[("UMBP_STANDALONE_SOCKET", "/s"), (var, value)]),
            )
            .unwrap_err();
            assert_eq!(e.to_string(), bad(var, value, reason).to_string());
        }
        let e = ServerOptions::resolve(
            &StandaloneSettings::default(),
            &env(&[("UMBP_STANDALONE_SOCKET", "/s"), ("UMBP_SERVER_MAX_FRAME", "big")]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("UMBP_SERVER_MAX_FRAME=\"big\""), "{e}");
        let e = ServerOptions::resolve(&StandaloneSettings::default(), &env(&[])).unwrap_err();
        assert!(
            e.to_string()
                .contains("no socket path (--socket or UMBP_STANDALONE_SOCKET)"),
            "{e}"
        );
        // The listener limits, through te_base::listener.
        let e = ServerOptions::resolve(
            &StandaloneSettings::default(),
            &env(&[("UMBP_STANDALONE_SOCKET", "/s"), ("UMBP_SERVER_MAX_CONNECTIONS", "0")]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("UMBP_SERVER_MAX_CONNECTIONS"), "{e}");
    }
}
