//! Two processes move bytes over TCP; the client finds the server by its address alone
//! (peer-to-peer metadata: no metadata service at all).
//!
//! ```text
//! cargo run -p te-core --example tcp_p2p -- serve          # prints: serving at 127.0.0.1:PORT
//! cargo run -p te-core --example tcp_p2p -- client 127.0.0.1:PORT
//! ```
//! Set `TE_AUTH_KEY_FILE` to the same key file in both to make them prove a shared key first.

#[path = "pair/mod.rs"]
mod pair;

use std::sync::Arc;
use std::time::Duration;

use te_core::auth::AuthKey;
use te_core::config::ProcessEnv;
use te_core::metadata::p2p::{P2pConfig, P2pStore};
use te_core::TransferEngine;

/// An engine with only the tcp transport, answering metadata requests on `listen`.
async fn engine(
    name: &str,
    listen: &str,
) -> Result<(TransferEngine, std::net::SocketAddr), Box<dyn std::error::Error>> {
    let auth = AuthKey::from_env(&ProcessEnv)?;
    let mut config = P2pConfig::new(listen.parse()?, Duration::from_secs(5));
    config.auth = auth.clone();
    let store = P2pStore::start(config).await?;
    let addr = store.local_addr();
    let mut builder = TransferEngine::builder()
        .segment_name(name)
        .transports(["tcp"])
        .metadata(Arc::new(store));
    if let Some(key) = auth {
        builder = builder.auth_key(key);
    }
    Ok((builder.build().await?, addr))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["serve"] => {
            let (engine, addr) = engine("pair-server", "127.0.0.1:0").await?;
            pair::serve(&engine, || println!("serving at {addr}")).await?;
            engine.shutdown().await?;
        }
        ["client", addr] => {
            let (engine, _) = engine("pair-client", "127.0.0.1:0").await?;
            // A name of the form host:port asks the engine listening there for its descriptor.
            pair::client(&engine, addr).await?;
            engine.shutdown().await?;
        }
        _ => return Err("usage: tcp_p2p serve | tcp_p2p client HOST:PORT".into()),
    }
    Ok(())
}
