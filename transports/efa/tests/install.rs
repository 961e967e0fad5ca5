//! Installing the transport: provider choice, strict configuration, granted mr_mode in the
//! endpoint, and typed errors for memory and descriptors it cannot serve.

mod common;

use std::sync::Arc;

use common::*;
use te_base::config::MapEnv;
use te_base::{Error, InstallContext, MemoryLocation, RegionId, RegionInfo};

fn install_with(pairs: &[(&str, &str)]) -> te_base::Result<Arc<dyn te_base::Transport>> {
    install_err(pairs)
}

fn err_of(pairs: &[(&str, &str)]) -> Error {
    match install_err(pairs) {
        Ok(t) => panic!("installed: {}", t.endpoint()),
        Err(e) => e,
    }
}

fn install_err(pairs: &[(&str, &str)]) -> te_base::Result<Arc<dyn te_base::Transport>> {
    let mut env = MapEnv::default();
    for (k, v) in pairs {
        env.0.insert(k.to_string(), v.to_string());
    }
    let ctx = InstallContext {
        auth: None,
        env: Arc::new(env),
        segment_name: "t".into(),
        devices: Vec::new(),
        notifications: te_base::NotifyInbox::new(Default::default()),
    };
    block_on(te_transport_efa::install(&ctx))
}

#[test]
fn default_provider_is_efa_or_a_clear_not_available() {
    let found = te_transport_efa::available_providers();
    match install_with(&[]) {
        Ok(t) => assert!(
            found.iter().any(|p| p == "efa"),
            "installed without efa present: {}",
            t.endpoint()
        ),
        Err(Error::NotAvailable { what, reason }) => {
            assert!(!found.iter().any(|p| p == "efa"));
            assert!(what.contains("efa") && reason.contains("'efa'"), "{reason}");
            for p in &found {
                assert!(
                    reason.contains(p.as_str()),
                    "the error must list provider {p}: {reason}"
                );
            }
        }
        Err(e) => panic!("unexpected error {e}"),
    }
    let err = err_of(&[("TE_FABRIC_PROVIDER", "no-such-provider")]);
    assert!(
        matches!(&err, Error::NotAvailable { reason, .. } if reason.contains("no-such-provider")),
        "{err}"
    );
}

#[test]
fn malformed_configuration_is_an_error_naming_the_variable() {
    if !provider_present("tcp;ofi_rxm") {
        return;
    }
    for (var, value) in [
        ("TE_FABRIC_DOMAINS", "no-such-nic"),
        ("TE_FABRIC_TIMEOUT_MS", "soon"),
        ("TE_FABRIC_MAX_FRAGMENT_BYTES", "0"),
        ("TE_FABRIC_IDLE", "nap"),
    ] {
        let err = err_of(&[("TE_FABRIC_PROVIDER", "tcp;ofi_rxm"), (var, value)]);
        assert!(
            matches!(&err, Error::Config { var: v, .. } if v == var),
            "{var}={value}: {err}"
        );
    }
}

#[test]
fn endpoint_follows_the_granted_mr_mode() {
    for p in providers() {
        if !provider_present(p) {
            continue;
        }
        let config = te_transport_efa::config::FabricConfig::from_env(&install_env(p, &[])).unwrap();
        let t = te_transport_efa::FabricTransport::open(config).unwrap();
        let granted = t.rail_mr_mode(0).unwrap();
        let virt = granted & te_transport_efa::ffi::mr::VIRT_ADDR != 0;
        use te_base::Transport;
        assert_eq!(t.endpoint()["virt_addr"].as_bool(), Some(virt), "{p}: {}", t.endpoint());
        assert_eq!(t.endpoint()["provider"].as_str(), Some(t.provider()));
        eprintln!("{p}: mr_mode bits {granted:#x}, rails {}", t.rails());
    }
}

#[test]
fn device_memory_and_foreign_descriptors_are_typed_errors() {
    let p = "tcp;ofi_rxm";
    if !provider_present(p) {
        return;
    }
    let t = install(p, &[]);
    let gpu = RegionInfo {
        id: RegionId(1),
        base: 0x1000,
        len: 4096,
        location: MemoryLocation::Cuda { device: 0 },
        exported: true,
    };
    match block_on(t.register(&[gpu])) {
        Err(Error::RegistrationFailed { failures }) => {
            assert!(
                matches!(*failures[0].cause, Error::WrongMemoryKind { .. }),
                "{:?}",
                failures[0].cause
            )
        }
        other => panic!("unexpected {other:?}"),
    }
    let zero = RegionInfo {
        id: RegionId(2),
        base: 0x1000,
        len: 0,
        location: MemoryLocation::HOST,
        exported: false,
    };
    assert!(block_on(t.register(&[zero])).is_err());
    // A descriptor of another provider, and one with a malformed endpoint.
    let mut other = descriptor("x", &t, &[]);
    other.transports[0].info["provider"] = "shm".into();
    assert!(matches!(block_on(t.connect(&other)), Err(Error::NoTransport { .. })));
    assert!(!t.can_reach(&other));
    let mut bad = descriptor("x", &t, &[]);
    bad.transports[0].info["rails"] = serde_json::json!([{"domain": "x", "addr": "zz"}]);
    assert!(matches!(block_on(t.connect(&bad)), Err(Error::InvalidDescriptor(_))));
    let none = te_base::SegmentDescriptor::new("y", 1);
    assert!(matches!(block_on(t.connect(&none)), Err(Error::NoTransport { .. })));
}

#[test]
fn denying_shared_memory_works_where_the_provider_has_no_shm_path() {
    // shm itself cannot be denied shm.
    let err = err_of(&[("TE_FABRIC_PROVIDER", "shm"), ("TE_FABRIC_SHM", "deny")]);
    assert!(
        matches!(&err, Error::Config { .. }) && err.to_string().contains("TE_FABRIC_SHM"),
        "{err}"
    );
    let p = "tcp;ofi_rxm";
    if !provider_present(p) {
        return;
    }
    // tcp;ofi_rxm has no shared-memory path: on 2.x fi_setopt answers -FI_ENOPROTOOPT, on 1.17
    // the headers lack the option; either way the transport installs and moves bytes.
    let a = install(p, &[("TE_FABRIC_SHM", "deny")]);
    let b = install(p, &[("TE_FABRIC_SHM", "deny")]);
    let src = Side::new(&a, 1, 1 << 16, false, 1);
    let dst = Side::new(&b, 1, 1 << 16, true, 2);
    let peer = block_on(a.connect(&descriptor("b", &b, &[&dst]))).unwrap();
    run(
        &peer,
        vec![request(0, te_base::TransferOp::Write, &src, 0, 0, dst.addr(), 1 << 16)],
    )
    .unwrap();
    assert_eq!(pattern::mismatches(dst.bytes(), 1, 0), 0);
}
