//! Standalone mode: one `umbp-server` per node owns the DRAM arena and the SSD tier; worker
//! processes are its clients through the same [`crate::Store`] API, chosen by configuration
//! (`Store::builder().connect(path)` or `UMBP_STANDALONE_SOCKET`).
//!
//! No KV byte crosses the socket: workers allocate their KV buffers as sealed memfds
//! ([`KvBuffer`], `Store::alloc_buffer`), register them (the fd travels by `SCM_RIGHTS`), and
//! every get and put is a local-copy batch inside the server between its tiers and the worker's
//! mapping. The wire ([`wire`]) is a compact binary protocol; ranged gets name repeated key sets
//! with key handles ([`key_handles`]).
//!
//! | variable | default | meaning |
//! | --- | --- | --- |
//! | `UMBP_STANDALONE_SOCKET` | unset | connect to this server (workers) / listen here (server) |
//! | `UMBP_STANDALONE_TIMEOUT_MS` | 30000 | longest wait for a reply before `ServerGone` |
//! | `UMBP_STANDALONE_SPIN_US` | 0 | busy-poll this long for a reply (client) or request (server) before sleeping |
//! | `UMBP_KEY_HANDLE_SLOTS` | 128 | client key-set cache (0: off, and nothing is hashed) |
//! | `UMBP_KEY_HANDLE_CAPACITY` | 512 | server key-set table (0: off) |
//! | `UMBP_KEY_HANDLE_DEBUG` | 0 | keep and print the reuse-distance histogram |
//! | `UMBP_SERVER_ALLOW_GID` | unset | a group allowed to connect besides the server's uid |
//! | `TE_AUTH_KEY_FILE` | unset | shared key proved by both sides in the hello (`te_base::auth`) |
//! | `UMBP_SERVER_MAX_FRAME` | 64M | longest request frame |
//! | `UMBP_SERVER_FRAME_TIMEOUT_MS` | 10000 | longest stall within one frame or reply |
//! | `UMBP_SERVER_MAX_CONNECTIONS`, `..._PER_SOURCE`, `..._HANDSHAKE_TIMEOUT_MS`, `..._IDLE_TIMEOUT_MS` | see `te_base::listener` | connection caps (per source = per uid) and deadlines |

pub mod client;
pub mod config;
pub mod io;
pub mod key_handles;
pub mod memfd;
pub mod server;
pub mod stats;
pub mod wire;

pub use memfd::KvBuffer;

/// The context both sides of the standalone hello bind their proofs to.
pub const AUTH_CONTEXT: &str = "umbp-standalone";

/// The standalone-mode variables (client and server); the server's listener limits are
/// `UMBP_SERVER` plus [`te_base::config::LISTENER_VAR_SUFFIXES`].
pub const ENV_VARS: &[&str] = &[
    "UMBP_STANDALONE_SOCKET",
    "UMBP_STANDALONE_TIMEOUT_MS",
    "UMBP_STANDALONE_SPIN_US",
    "UMBP_KEY_HANDLE_SLOTS",
    "UMBP_KEY_HANDLE_CAPACITY",
    "UMBP_KEY_HANDLE_DEBUG",
    "UMBP_SERVER_ALLOW_GID",
    "UMBP_SERVER_MAX_FRAME",
    "UMBP_SERVER_FRAME_TIMEOUT_MS",
];
