//! TCP transport: persistent lanes per peer, sliced transfers, bounds-checked serving side.
//!
//! - Every engine listens on `TE_TCP_LISTEN` (default `0.0.0.0:0`: all interfaces, a kernel-chosen
//!   port) and advertises its interface addresses (loopback last) and a random instance token in
//!   its segment descriptor.
//! - Connections to a peer (`TE_TCP_LANES` lanes) are made on `connect`, kept, and shared by every
//!   batch to that peer; a restarted peer (new token) gets new connections.
//! - Transfers are cut into slices of at most `TE_TCP_SLICE_BYTES`, spread round-robin over the
//!   lanes, sent from and received into registered memory directly (vectored socket I/O).
//! - The serving side checks each request against the regions registered AND exported and the
//!   instance token; anything else is answered with an ERROR frame and never served.
//! - A write completes when the target acknowledges it, which it does once the bytes are in its
//!   memory. Outstanding requests to a peer that died or made no progress for `TE_TCP_TIMEOUT_MS`
//!   fail with `Error::PeerGone` naming it.
//!
//! The wire format is in [`wire`]; it is pure and separately tested.

mod config;
mod endpoint;
mod frame_io;
mod lane;
mod notify;
mod peer;
mod plan;
mod regions;
mod serve;
mod transport;
pub mod wire;

pub use config::{TcpConfig, ENV_VARS};
pub use endpoint::TcpEndpoint;
pub use transport::{install, TcpTransport};

/// The tcp transport as te-core lists it.
pub const DESCRIPTOR: te_base::TransportDescriptor = te_base::TransportDescriptor {
    name: "tcp",
    reach: te_base::Reach::Network,
    env_vars: ENV_VARS,
    check_env: |env| TcpConfig::from_env(env).map(drop),
    install: |ctx| Box::pin(install(ctx)),
};
