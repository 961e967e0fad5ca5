//! libfabric is opened at run time: which library this process loaded (checked against
//! `TE_FABRIC_LIBRARY` and `TE_EXPECT_LIBFABRIC`, which scripts/test.sh sets for each version it
//! tests), and what installing the transport says on a host without it (a child process whose
//! `TE_FABRIC_LIBRARY` names a file that does not exist).

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use te_base::Error;

/// Set in the child process of [`without_libfabric_install_is_not_available`].
const CHILD: &str = "TE_TEST_EFA_NO_LIBRARY_CHILD";
const MISSING: &str = "/nonexistent/te-test/libfabric.so.1";

#[test]
fn the_loaded_library_is_the_one_named_and_expected() {
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let lib = match te_transport_efa::libfabric() {
        Ok(lib) => lib,
        Err(e) if required("libfabric") => panic!("TE_REQUIRE contains libfabric but {e}"),
        Err(e) => {
            eprintln!("SKIP: {e}");
            return;
        }
    };
    eprintln!("loaded {lib:?}");
    let (major, minor) = lib.version;
    if let Ok(want) = std::env::var("TE_EXPECT_LIBFABRIC") {
        assert_eq!(format!("{major}.{minor}"), want, "TE_EXPECT_LIBFABRIC ({lib:?})");
    }
    match std::env::var("TE_FABRIC_LIBRARY") {
        Ok(named) => {
            assert!(lib.from_env, "{lib:?}");
            assert_eq!(lib.requested, named);
            let real = |p: &str| Path::new(p).canonicalize().unwrap_or_else(|e| panic!("{p}: {e}"));
            assert_eq!(
                real(&lib.path),
                real(&named),
                "loaded another file than TE_FABRIC_LIBRARY names"
            );
        }
        Err(_) => {
            assert!(!lib.from_env);
            assert!(te_transport_efa::library::DEFAULT_SEARCH.contains(&lib.requested.as_str()));
        }
    }
    // The API version asked for is the older of the headers' and the library's; the fi_info
    // functions come from the newest symbol version both know (docs/efa.md, "Which libfabric").
    let (headers, _) = te_transport_efa::libfabric_versions();
    assert_eq!(headers, te_transport_efa::library::HEADER_VERSION);
    assert_eq!(lib.api_version, lib.version.min(headers));
    let want_abi = match lib.version {
        (1, _) => "FABRIC_1.3",
        (2, 0..=5) => lib.abi.as_str(), // 1.8 or 1.9, whichever that release exports
        _ => "FABRIC_1.9",
    };
    assert_eq!(lib.abi, want_abi, "{lib:?}");
}

#[test]
fn without_libfabric_install_is_not_available() {
    if std::env::var_os(CHILD).is_some() {
        return child();
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "without_libfabric_install_is_not_available",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("TE_FABRIC_LIBRARY", MISSING)
        .env("TE_FABRIC_PROVIDER", "tcp;ofi_rxm")
        .output()
        .expect("run this test binary as the child");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    assert!(out.status.success(), "child failed: {:?}", out.status);
    assert!(text.contains("child: checked"), "the child ran no check");
}

/// In the child: nothing can load, so nothing is found, and installing says why.
fn child() {
    assert!(te_transport_efa::available_providers().is_empty());
    assert_eq!(te_transport_efa::libfabric_versions().1, None);
    let ctx = te_base::InstallContext {
        auth: None,
        env: std::sync::Arc::new(install_env("tcp;ofi_rxm", &[])),
        segment_name: "test".into(),
        devices: Vec::new(),
        notifications: te_base::NotifyInbox::new(Default::default()),
    };
    let err = match block_on(te_transport_efa::install(&ctx)) {
        Ok(t) => panic!("installed without libfabric: {}", t.endpoint()),
        Err(e) => e,
    };
    let Error::NotAvailable { what, reason } = &err else {
        panic!("expected NotAvailable, got {err}");
    };
    assert_eq!(what, "efa transport");
    assert!(
        reason.starts_with(&format!(
            "libfabric.so.1 not found (tried: {MISSING} (from TE_FABRIC_LIBRARY): no such file)"
        )),
        "{reason}"
    );
    assert!(
        err.to_string().contains("not available: libfabric.so.1 not found"),
        "{err}"
    );
    println!("child: checked ({err})");
}
