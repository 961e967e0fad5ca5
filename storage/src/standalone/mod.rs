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
//! Its settings, the workers' and the server's, are declared once each in [`config`]
//! ([`StandaloneKey`]); docs/configuration.md's "UMBP, standalone mode" table is
//! [`StandaloneKey::doc_table`].

pub mod client;
pub mod config;
pub mod io;
pub mod key_handles;
pub mod memfd;
pub mod server;
pub mod stats;
pub mod wire;

pub use config::{StandaloneKey, ENV_VARS};
pub use memfd::KvBuffer;

/// The context both sides of the standalone hello bind their proofs to.
pub const AUTH_CONTEXT: &str = "umbp-standalone";
