//! libfabric's registration caches are turned off before libfabric reads its parameters, unless
//! the user chose otherwise (`te_transport_efa::mr_cache`). Each case runs in a child process of
//! this test binary: the variables are process-wide and set once, at the first libfabric query.
//!
//! What the caches would break (a write into deregistered memory landing) needs a provider that
//! caches, verbs or efa; the software providers here have no cache. The conformance suite's
//! deregistered-target check verifies, on the bytes, that revocation holds on every provider the
//! tests run, including `TE_FABRIC_PROVIDER=verbs;ofi_rxm` on soft-RoCE.

mod common;

use std::process::Command;

use common::*;
use te_transport_efa::mr_cache::{settings, CACHE_OFF};

/// What the child must find: `set` (nothing in the environment) or `kept` (the user's values).
const CHILD_VAR: &str = "TE_TEST_EFA_MR_CACHE_CASE";

fn run_child(case: &str, env: &[(&str, &str)]) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "child_checks_the_settings",
        "--include-ignored",
        "--nocapture",
    ])
    .env(CHILD_VAR, case);
    for (var, _) in CACHE_OFF {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied());
    let out = cmd.output().expect("run the child test");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    assert!(out.status.success(), "child ({case}) failed: {}", out.status);
    assert!(text.contains("1 passed"), "the child test did not run");
}

#[test]
fn caches_are_turned_off_where_the_user_did_not_choose() {
    if !provider_present("tcp;ofi_rxm") {
        return;
    }
    run_child("set", &[]);
}

#[test]
fn the_users_choice_is_kept_and_reported() {
    if !provider_present("tcp;ofi_rxm") {
        return;
    }
    run_child(
        "kept",
        &[("FI_MR_CACHE_MAX_COUNT", "64"), ("FI_EFA_MR_CACHE_ENABLE", "off")],
    );
}

#[test]
#[ignore = "run by the tests above in a child process"]
fn child_checks_the_settings() {
    let case = std::env::var(CHILD_VAR).expect("run by a parent test");
    // Before any libfabric call the environment is as the parent left it.
    let before: Vec<Option<String>> = CACHE_OFF.iter().map(|(v, _)| std::env::var(v).ok()).collect();
    // An install queries libfabric, which applies the settings first.
    let t = install("tcp;ofi_rxm", &[]);
    let s = settings();
    assert_eq!(s.len(), CACHE_OFF.len());
    for (setting, ((var, off), before)) in s.iter().zip(CACHE_OFF.iter().zip(before)) {
        assert_eq!(setting.var, *var);
        let now = std::env::var(var).ok();
        match case.as_str() {
            "set" => {
                assert_eq!(before, None, "{var} was set before");
                assert_eq!(now.as_deref(), Some(*off), "{var} in the environment libfabric reads");
                assert!(setting.set_here && !setting.cache_on, "{setting:?}");
            }
            "kept" => {
                assert_eq!(now, before, "{var}: the user's value is kept");
                assert!(!setting.set_here, "{setting:?}");
                // A count of 64 keeps the util cache on (logged); "off" is one of libfabric's false spellings.
                assert_eq!(setting.cache_on, *var == "FI_MR_CACHE_MAX_COUNT", "{setting:?}");
            }
            other => panic!("unknown case {other}"),
        }
    }
    drop(t);
}
