//! The engine reports the devices an installed transport skipped, each with why (what
//! `te-bench info` prints): here the efa transport on libfabric's tcp;ofi_rxm provider, told to use
//! one domain that exists and one that does not.
#![cfg(feature = "efa")]

use std::sync::Arc;

use te_base::config::MapEnv;
use te_core::TransferEngine;

#[tokio::test]
async fn a_skipped_domain_is_named_in_the_transport_status() {
    const PROVIDER: &str = "tcp;ofi_rxm";
    let domains = te_transport_efa::provider_domains(PROVIDER);
    let Some(good) = domains.first() else {
        te_base::test_support::skip_or_fail("libfabric", &format!("provider {PROVIDER} has no domain here"));
        return;
    };
    let list = format!("{good},no-such-nic");
    let env = MapEnv::new([("TE_FABRIC_PROVIDER", PROVIDER), ("TE_FABRIC_DOMAINS", list.as_str())]);
    let engine = TransferEngine::builder()
        .segment_name("skipped-devices")
        .transports(["efa"])
        .env(Arc::new(env))
        .build()
        .await
        .unwrap();
    let efa = engine
        .transports()
        .iter()
        .find(|t| t.name == "efa")
        .expect("efa status");
    assert_eq!(efa.unavailable, None, "efa serves on '{good}'");
    assert_eq!(efa.skipped.len(), 1, "{:?}", efa.skipped);
    assert_eq!(efa.skipped[0].name, "no-such-nic");
    assert!(
        efa.skipped[0].reason.contains("offers no such domain"),
        "{:?}",
        efa.skipped
    );
    engine.shutdown().await.unwrap();
}
