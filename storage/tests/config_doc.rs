//! docs/configuration.md's local-mode UMBP table, read as a user reads it: its rows are the
//! store's settings table (`umbp::config::StoreKey`) exactly, each documented default is the
//! value the store uses when the variable is unset, and each documented `umbp-server` flag is
//! one the server takes (a malformed value is refused naming the flag). Likewise its
//! standalone-mode table and standalone mode's settings table (`umbp::standalone::StandaloneKey`),
//! and its distributed-mode table and the cluster's settings table
//! (`umbp::cluster::config::ClusterKey`), which docs/umbp.md points to rather than copies. So the
//! page cannot drift from the code, and a new setting cannot be forgotten there.

use std::process::Command;
use std::sync::Arc;

use te_base::config::MapEnv;
use umbp::config::StoreKey;
use umbp::Store;

const SECTION: &str = "## UMBP, local mode (the core)";

/// The table of the page's local-mode section, lines as written.
fn documented_table() -> String {
    table_of(SECTION)
}

/// The table of the page's section `section`, lines as written.
fn table_of(section: &str) -> String {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/configuration.md"))
        .expect("docs/configuration.md");
    let (_, section) = page.split_once(section).expect("the page's section");
    let section = section.split("\n## ").next().unwrap_or(section);
    section
        .lines()
        .filter(|l| l.starts_with('|'))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// One row: variable, default, builder / Python keyword, `umbp-server` flag (with its value
/// name), meaning; code quotes and escaped pipes undone.
fn rows() -> Vec<[String; 5]> {
    rows_of(&documented_table())
}

/// The rows of `table` (after its header), `N` cells each; code quotes and escaped pipes undone.
fn rows_of<const N: usize>(table: &str) -> Vec<[String; N]> {
    table
        .lines()
        .skip(2)
        .map(|l| {
            let cells: Vec<String> = l
                .trim_matches('|')
                .split(" | ")
                .map(|c| c.trim().trim_matches('`').replace("\\|", "|"))
                .collect();
            cells.try_into().unwrap_or_else(|c| panic!("a row of {N} cells: {c:?}"))
        })
        .collect()
}

#[test]
fn the_pages_local_mode_table_is_the_settings_table() {
    let want = StoreKey::doc_table();
    assert!(
        documented_table() == want,
        "docs/configuration.md's table under {SECTION:?} differs from umbp::config::StoreKey; it should read:\n\n{want}"
    );
    let vars: Vec<String> = rows().into_iter().map(|[v, ..]| v).collect();
    assert_eq!(vars, umbp::config::ENV_VARS);
}

#[test]
fn each_documented_default_is_the_default() {
    // SSD settings are read only with an SSD tier; resolving the configuration opens nothing.
    let base = [("UMBP_SSD_DIRS", "/nonexistent/umbp-config-doc")];
    let config = |extra: Option<(&str, &str)>| {
        let map = base
            .iter()
            .chain(extra.as_ref())
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Store::builder().env(Arc::new(MapEnv(map))).config()
    };
    let unset = format!("{:?}", config(None).unwrap().core);
    let mut checked = 0;
    for [var, default, ..] in rows() {
        // A default that is not a value says what happens instead ("unset", "90% of free").
        if default == "unset" || default.contains(' ') {
            continue;
        }
        let set = config(Some((&var, &default))).unwrap_or_else(|e| panic!("{var}={default}: {e}"));
        assert_eq!(
            format!("{:?}", set.core),
            unset,
            "{var}: the documented default {default} is not the default"
        );
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} defaults checked");
}

#[test]
fn each_documented_flag_is_the_servers() {
    let server = env!("CARGO_BIN_EXE_umbp-server");
    let help = Command::new(server).arg("--help").output().unwrap();
    let usage = String::from_utf8_lossy(&help.stdout).into_owned();
    let mut flags = 0;
    let standalone = rows_of::<5>(&table_of(standalone::SECTION));
    for [var, _, _, flag, _] in rows().into_iter().chain(standalone) {
        if flag.is_empty() {
            continue;
        }
        flags += 1;
        assert!(
            usage.contains(&format!("[{flag}]")),
            "{var}: {flag} not in the usage: {usage}"
        );
        // A flag with a value refuses a malformed one, naming the flag (before anything opens).
        if let Some((name, _)) = flag.split_once(' ') {
            let out = Command::new(server)
                .args(["--socket", "/nonexistent/umbp-config-doc.sock", name, ""])
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success() && err.contains(name), "{name} \"\": {err}");
        }
    }
    assert!(flags >= 8, "only {flags} flags documented");
}

mod standalone {
    use super::*;
    use umbp::standalone::server::ServerOptions;
    use umbp::standalone::{StandaloneKey, ENV_VARS};

    pub(super) const SECTION: &str = "## UMBP, standalone mode";

    #[test]
    fn the_pages_standalone_mode_table_is_the_standalone_table() {
        let want = StandaloneKey::doc_table();
        assert!(
            table_of(SECTION) == want,
            "docs/configuration.md's table under {SECTION:?} differs from umbp::standalone::StandaloneKey; it should read:\n\n{want}"
        );
        let vars: Vec<String> = rows_of::<5>(&want).into_iter().map(|[v, ..]| v).collect();
        assert_eq!(vars, ENV_VARS);
    }

    #[test]
    fn each_documented_standalone_default_is_the_default() {
        // What a worker and the server resolve (their Debug), with `extra` set.
        let resolved = |extra: Option<(&str, &str)>| {
            let map: std::collections::HashMap<String, String> = [("UMBP_STANDALONE_SOCKET", "/nonexistent/umbp.sock")]
                .iter()
                .chain(extra.as_ref())
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let env = Arc::new(MapEnv(map));
            let worker = Store::builder()
                .env(env.clone())
                .config()
                .map(|c| format!("{:?}", c.mode));
            let server = ServerOptions::from_env(&*env, None).map(|o| format!("{o:?}"));
            (
                worker.unwrap_or_else(|e| panic!("{extra:?}: {e}")),
                server.unwrap_or_else(|e| panic!("{extra:?}: {e}")),
            )
        };
        let unset = resolved(None);
        let mut checked = 0;
        for [var, default, ..] in rows_of::<5>(&table_of(SECTION)) {
            // Not a value ("unset", "unset (local mode)").
            if default.starts_with("unset") {
                continue;
            }
            let set = resolved(Some((&var, &default)));
            assert_eq!(set, unset, "{var}: the documented default {default} is not the default");
            checked += 1;
        }
        assert!(checked >= 10, "only {checked} defaults checked");
    }
}

#[cfg(feature = "cluster")]
mod distributed {
    use super::*;
    use umbp::cluster::config::{ClusterKey, ENV_VARS};
    use umbp::ClusterConfig;

    const SECTION: &str = "## UMBP, distributed mode";

    #[test]
    fn the_pages_distributed_mode_table_is_the_cluster_table() {
        let want = ClusterKey::doc_table();
        assert!(
            table_of(SECTION) == want,
            "docs/configuration.md's table under {SECTION:?} differs from umbp::cluster::config::ClusterKey; it should read:\n\n{want}"
        );
        let vars: Vec<String> = rows_of::<4>(&want).into_iter().map(|[v, ..]| v).collect();
        assert_eq!(vars, ENV_VARS);
    }

    #[test]
    fn each_documented_cluster_default_is_the_default() {
        let config = |extra: Option<(&str, &str)>| {
            let map = [("UMBP_CLUSTER", "etcd://127.0.0.1:2379")]
                .iter()
                .chain(extra.as_ref())
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            ClusterConfig::from_env(&MapEnv(map)).map(|c| format!("{:?}", c.expect("a cluster")))
        };
        let unset = config(None).unwrap();
        let mut checked = 0;
        for [var, default, keyword, _] in rows_of::<4>(&table_of(SECTION)) {
            // Read by the control listener (te_base::listener; a unit test holds those), or not a
            // value ("unset (local mode)").
            if keyword.is_empty() || default.contains(' ') {
                continue;
            }
            let set = config(Some((&var, &default))).unwrap_or_else(|e| panic!("{var}={default}: {e}"));
            assert_eq!(set, unset, "{var}: the documented default {default} is not the default");
            checked += 1;
        }
        assert!(checked >= 8, "only {checked} defaults checked");
    }

    #[test]
    fn umbp_md_points_to_the_table_rather_than_copying_it() {
        let page =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/umbp.md")).expect("docs/umbp.md");
        let copied: Vec<&str> = page.lines().filter(|l| l.starts_with("| `UMBP_CLUSTER")).collect();
        assert!(
            copied.is_empty(),
            "docs/umbp.md copies rows of the distributed-mode table: {copied:?}"
        );
        assert!(
            page.contains("\"UMBP, distributed mode\""),
            "docs/umbp.md should point to the table"
        );
    }
}
