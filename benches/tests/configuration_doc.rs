//! docs/configuration.md lists every variable of every component: each one this build reads
//! (`te_core::known_vars`, `umbp::config::known_vars`) has a row, and in a build with every
//! component compiled in, every row names a variable something reads. So the page cannot drift
//! from the code.

use std::collections::BTreeSet;

/// The variables named in the first column of the page's tables.
fn documented() -> BTreeSet<String> {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/configuration.md"))
        .expect("docs/configuration.md");
    page.lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once('`').map(|(v, _)| v.to_string()))
        .filter(|v| {
            v.chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        })
        .collect()
}

fn known() -> BTreeSet<String> {
    te_core::known_vars()
        .into_iter()
        .chain(umbp::config::known_vars())
        .collect()
}

#[test]
fn every_variable_read_has_a_row_and_every_row_is_read() {
    let (doc, known) = (documented(), known());
    let missing: Vec<&String> = known.difference(&doc).collect();
    assert!(missing.is_empty(), "read but not in docs/configuration.md: {missing:?}");
    // Only a build with every component knows every variable the page lists.
    let full = [
        "TE_FABRIC_PROVIDER",
        "TE_RDMA_DEVICES",
        "UMBP_CLUSTER",
        "TE_CUDA_BATCH_MEMCPY",
    ]
    .iter()
    .all(|v| known.contains(*v));
    let stale: Vec<&String> = doc.difference(&known).collect();
    if full {
        assert!(
            stale.is_empty(),
            "in docs/configuration.md but read by nothing: {stale:?}"
        );
    } else {
        println!(
            "skipped the stale-row check: not every component is compiled in ({} rows not known here)",
            stale.len()
        );
    }
}
