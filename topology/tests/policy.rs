//! NIC policy: the selection variable and its Mooncake alias, and priority-matrix override files.

use std::io::Write;
use std::path::{Path, PathBuf};

use te_base::config::MapEnv;
use te_base::{Error, MemoryLocation};
use te_topology::{NicPlacement, NicPolicy, NicSelection, PriorityMatrix, RailSource, Topology};

fn topology(name: &str) -> Topology {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/topology/{name}.json"));
    te_testkit::fixture::discover(&path).unwrap()
}

/// A file in the temp dir that is removed when dropped.
struct TempFile(PathBuf);

impl TempFile {
    fn new(tag: &str, text: &str) -> TempFile {
        let path = std::env::temp_dir().join(format!("te-matrix-{}-{tag}.json", std::process::id()));
        std::fs::File::create(&path)
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        TempFile(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn selection_reads_the_variable_and_its_alias() {
    let read = |pairs: &[(&str, &str)]| {
        let env = MapEnv(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        NicPolicy::from_env(&env)
    };
    assert_eq!(read(&[]).unwrap().selection, NicSelection::Local);
    assert_eq!(
        read(&[("TE_NIC_SELECTION", "all")]).unwrap().selection,
        NicSelection::All
    );
    assert_eq!(
        read(&[("MC_EFA_NIC_SELECTION", "all")]).unwrap().selection,
        NicSelection::All
    );
    assert_eq!(
        read(&[("TE_NIC_SELECTION", "all"), ("MC_EFA_NIC_SELECTION", "all")])
            .unwrap()
            .selection,
        NicSelection::All
    );
    let conflict = read(&[("TE_NIC_SELECTION", "local"), ("MC_EFA_NIC_SELECTION", "all")]).unwrap_err();
    assert!(
        matches!(&conflict, Error::Config { var, .. } if var == "TE_NIC_SELECTION"),
        "{conflict}"
    );
    assert!(conflict.to_string().contains("MC_EFA_NIC_SELECTION"), "{conflict}");
    for bad in ["", "LOCAL", "some", " all"] {
        let err = read(&[("TE_NIC_SELECTION", bad)]).unwrap_err();
        assert!(
            matches!(&err, Error::Config { var, .. } if var == "TE_NIC_SELECTION"),
            "{err}"
        );
    }
    let err = read(&[("MC_EFA_NIC_SELECTION", "none")]).unwrap_err();
    assert!(err.to_string().contains("MC_EFA_NIC_SELECTION"), "{err}");
}

#[test]
fn stripe_threshold_is_read_strictly() {
    let policy = NicPolicy::from_env(&MapEnv::new([("TE_STRIPE_MIN_BYTES", "1M")])).unwrap();
    assert_eq!(policy.stripe_min_bytes, 1 << 20);
    assert_eq!(
        NicPolicy::from_env(&MapEnv::default()).unwrap().stripe_min_bytes,
        128 << 10
    );
    let err = NicPolicy::from_env(&MapEnv::new([("TE_STRIPE_MIN_BYTES", "12Q")])).unwrap_err();
    assert!(err.to_string().contains("TE_STRIPE_MIN_BYTES"), "{err}");
}

#[test]
fn override_file_replaces_the_computed_rails() {
    let file = TempFile::new(
        "ok",
        r#"{
            "cpu:0": [["mlx5_1"], ["mlx5_0", "mlx5_2"]],
            "cuda:0": [["mlx5_7", "mlx5_6"], []],
            "cuda:1": [[], ["mlx5_5"]]
        }"#,
    );
    let env = MapEnv::new([("TE_NIC_PRIORITY_MATRIX", file.path().to_str().unwrap())]);
    let placement = NicPlacement::from_env(topology("roce-8gpu"), &env).unwrap();
    let on = |loc: MemoryLocation| placement.rails_for(loc, None).unwrap();
    let gpu0 = on(MemoryLocation::Cuda { device: 0 });
    assert_eq!(gpu0.rails, [6, 7]);
    assert_eq!(gpu0.source, RailSource::Override { key: "cuda:0".into() });
    // An empty preferred list falls back to the available list.
    assert_eq!(on(MemoryLocation::Cuda { device: 1 }).rails, [5]);
    assert_eq!(on(MemoryLocation::Host { numa: Some(0) }).rails, [1]);
    // Locations the file does not name keep the computed map.
    assert_eq!(on(MemoryLocation::Cuda { device: 2 }).rails, [2]);
    assert_eq!(on(MemoryLocation::Host { numa: Some(1) }).rails, [4, 5, 6, 7]);
    // The policy "all" still wins over the file.
    let env = MapEnv::new([
        ("TE_NIC_PRIORITY_MATRIX", file.path().to_str().unwrap()),
        ("TE_NIC_SELECTION", "all"),
    ]);
    let all = NicPlacement::from_env(topology("roce-8gpu"), &env).unwrap();
    assert_eq!(
        all.rails_for(MemoryLocation::Cuda { device: 0 }, None)
            .unwrap()
            .rails
            .len(),
        8
    );
}

#[test]
fn printed_matrix_round_trips_as_an_override() {
    let p5 = topology("p5.48xlarge");
    let computed = NicPlacement::new(p5.clone(), NicPolicy::default()).unwrap();
    let printed = computed.priority_matrix().unwrap();
    assert_eq!(printed.len(), 2 + 8);
    let text = printed.to_json();
    assert!(text.starts_with("{\n  \"cpu:0\": [["), "{text}");
    let gpu0 = printed.get(te_topology::MatrixKey::Cuda(0)).unwrap();
    assert_eq!(gpu0.preferred, ["rdmap79s0", "rdmap80s0", "rdmap81s0", "rdmap82s0"]);
    assert_eq!(gpu0.available.len(), 28);

    let file = TempFile::new("roundtrip", &text);
    let env = MapEnv::new([("TE_NIC_PRIORITY_MATRIX", file.path().to_str().unwrap())]);
    let overridden = NicPlacement::from_env(p5, &env).unwrap();
    for device in 0..8 {
        let loc = MemoryLocation::Cuda { device };
        assert_eq!(
            overridden.rails_for(loc, None).unwrap().rails,
            computed.rails_for(loc, None).unwrap().rails
        );
    }
    assert_eq!(overridden.priority_matrix().unwrap(), printed);
}

#[test]
fn malformed_override_files_are_config_errors_naming_the_problem() {
    let cases = [
        ("syntax", "{\"cuda:0\": [[\"mlx5_0\"]", "not valid JSON"),
        ("toplevel", "[[\"mlx5_0\"]]", "top level must be an object"),
        ("key", r#"{"gpu0": [["mlx5_0"]]}"#, "key \"gpu0\""),
        ("shape", r#"{"cuda:0": ["mlx5_0"]}"#, "preferred list is not an array"),
        (
            "unknown",
            r#"{"cuda:0": [["mlx5_9"], []]}"#,
            "NIC \"mlx5_9\" does not exist",
        ),
        ("dup", r#"{"cpu:0": [["mlx5_0"], ["mlx5_0"]]}"#, "listed twice"),
        ("empty", r#"{"cpu:0": [[], []]}"#, "lists no NIC"),
    ];
    for (tag, text, needle) in cases {
        let file = TempFile::new(tag, text);
        let shown = file.path().display().to_string();
        let env = MapEnv::new([("TE_NIC_PRIORITY_MATRIX", shown.as_str())]);
        let err = NicPlacement::from_env(topology("roce-8gpu"), &env).unwrap_err();
        match &err {
            Error::Config { var, value, reason } => {
                assert_eq!(var, "TE_NIC_PRIORITY_MATRIX");
                assert_eq!(value, &shown);
                assert!(reason.contains(needle), "{tag}: {reason}");
            }
            other => panic!("{tag}: expected a config error, got {other}"),
        }
    }
    let env = MapEnv::new([("TE_NIC_PRIORITY_MATRIX", "/nonexistent/matrix.json")]);
    let err = NicPlacement::from_env(topology("roce-8gpu"), &env).unwrap_err();
    assert!(err.to_string().contains("cannot read the file"), "{err}");
    // Parsing alone needs no topology.
    assert!(PriorityMatrix::parse(r#"{"rocm:1": [["x"]], "hip:2": [["y"]]}"#).is_ok());
}
