//! Two processes move bytes over TCP; they find each other by segment name in etcd.
//!
//! ```text
//! etcd &                                                   # listens on 127.0.0.1:2379
//! cargo run -p te-core --features etcd --example tcp_etcd -- serve  http://127.0.0.1:2379
//! cargo run -p te-core --features etcd --example tcp_etcd -- client http://127.0.0.1:2379
//! ```
//! The server's descriptor is attached to an etcd lease: if the server dies, its segment
//! disappears from etcd when the lease runs out.

#[path = "pair/mod.rs"]
mod pair;

use std::sync::Arc;

use te_core::metadata::etcd::{EtcdConfig, EtcdStore};
use te_core::TransferEngine;

/// An engine with only the tcp transport, publishing its descriptor in etcd at `endpoint`.
async fn engine(name: &str, endpoint: &str) -> Result<TransferEngine, Box<dyn std::error::Error>> {
    let mut config = EtcdConfig::new(vec![endpoint.to_string()]);
    config.prefix = "/te-examples/tcp_etcd".into();
    let store = EtcdStore::connect(config).await?;
    Ok(TransferEngine::builder()
        .segment_name(name)
        .transports(["tcp"])
        .metadata(Arc::new(store))
        .build()
        .await?)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["serve", endpoint] => {
            let engine = engine("pair-server", endpoint).await?;
            pair::serve(&engine, || println!("serving segment pair-server")).await?;
            engine.shutdown().await?;
        }
        ["client", endpoint] => {
            let engine = engine("pair-client", endpoint).await?;
            pair::client(&engine, "pair-server").await?;
            engine.shutdown().await?;
        }
        _ => return Err("usage: tcp_etcd serve|client ETCD_ENDPOINT".into()),
    }
    Ok(())
}
