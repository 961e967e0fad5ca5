//! A standalone client's settings (the `UMBP_STANDALONE_*` and key-handle variables of
//! [`crate::standalone`]).

use std::path::PathBuf;
use std::time::Duration;

use te_base::auth::AuthKey;

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
