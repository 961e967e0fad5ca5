//! Registration configuration: the cap variable and its alias, the order, the derived cap from
//! rank-count variables, cgroup quotas and a real restricted affinity mask.

use std::path::PathBuf;
use std::process::Command;

use te_base::config::{MapEnv, ProcessEnv};
use te_base::registration::{cpus, CapSource, CpuBudget, RegOrder, RegistrationConfig, CAP_ALIAS, CAP_VAR};

fn cfg(pairs: &[(&str, &str)], cores: usize) -> te_base::Result<RegistrationConfig> {
    let env = MapEnv(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
    RegistrationConfig::from_env_with_cpus(&env, &CpuBudget::from_parts(cores, None))
}

#[test]
fn unset_is_unbounded_and_says_why() {
    let c = cfg(&[], 192).unwrap();
    assert_eq!(c.cap.cap, None);
    assert!(matches!(c.cap.source, CapSource::NoRankCount { .. }));
    assert_eq!(c.order, RegOrder::Given);
    let text = c.to_string();
    assert!(
        text.contains("unbounded") && text.contains("LOCAL_WORLD_SIZE"),
        "{text}"
    );
}

#[test]
fn zero_is_unbounded_even_with_a_rank_count() {
    let c = cfg(&[(CAP_VAR, "0"), ("LOCAL_WORLD_SIZE", "8")], 192).unwrap();
    assert_eq!(c.cap.cap, None);
    assert_eq!(c.cap.source, CapSource::Configured { var: CAP_VAR });
}

#[test]
fn valid_values_and_the_alias() {
    let c = cfg(&[(CAP_VAR, "16")], 192).unwrap();
    assert_eq!(c.cap.value(), 16);
    assert_eq!(c.order, RegOrder::Ascending);
    let c = cfg(&[(CAP_ALIAS, "24")], 192).unwrap();
    assert_eq!(c.cap.value(), 24);
    assert_eq!(c.cap.source, CapSource::Configured { var: CAP_ALIAS });
    let c = cfg(&[(CAP_VAR, "8"), (CAP_ALIAS, "8")], 192).unwrap();
    assert_eq!(c.cap.value(), 8);
}

#[test]
fn a_conflict_between_the_variable_and_its_alias_is_an_error() {
    let err = cfg(&[(CAP_VAR, "8"), (CAP_ALIAS, "16")], 192).unwrap_err().to_string();
    assert!(err.contains(CAP_VAR) && err.contains(CAP_ALIAS), "{err}");
}

#[test]
fn malformed_values_are_errors_naming_the_variable() {
    for var in [
        CAP_VAR,
        CAP_ALIAS,
        "TE_LOCAL_RANKS",
        "LOCAL_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "SLURM_NTASKS_PER_NODE",
    ] {
        for bad in ["abc", "-1", "12x", "", " 4", "4.5"] {
            let err = cfg(&[(var, bad)], 8).unwrap_err().to_string();
            assert!(err.contains(var), "{var}={bad:?}: {err}");
        }
    }
    let err = cfg(&[("LOCAL_WORLD_SIZE", "0")], 8).unwrap_err().to_string();
    assert!(err.contains("LOCAL_WORLD_SIZE"), "{err}");
    let err = cfg(&[("TE_REG_ORDER", "random")], 8).unwrap_err().to_string();
    assert!(err.contains("TE_REG_ORDER"), "{err}");
}

#[test]
fn the_order_variable_overrides_the_default() {
    let c = cfg(&[(CAP_VAR, "4"), ("TE_REG_ORDER", "descending")], 8).unwrap();
    assert_eq!(c.order, RegOrder::Descending);
    assert!(c.order_configured);
    let c = cfg(&[("TE_REG_ORDER", "ascending")], 8).unwrap();
    assert_eq!((c.cap.cap, c.order), (None, RegOrder::Ascending));
}

#[test]
fn the_cap_is_derived_from_the_rank_count_and_cores() {
    for (var, ranks, cores, expected) in [
        ("TE_LOCAL_RANKS", "8", 192, 24),
        ("LOCAL_WORLD_SIZE", "4", 192, 48),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "8", 64, 8),
        ("SLURM_NTASKS_PER_NODE", "2", 2, 1),
        ("LOCAL_WORLD_SIZE", "8", 2, 1),
    ] {
        let c = cfg(&[(var, ranks)], cores).unwrap();
        assert_eq!(c.cap.value(), expected, "{var}={ranks} on {cores} cores");
        assert_eq!(c.order, RegOrder::Ascending);
        match c.cap.source {
            CapSource::Derived { ranks_var, .. } => assert_eq!(ranks_var, var),
            other => panic!("unexpected source {other:?}"),
        }
    }
    // TE_LOCAL_RANKS takes precedence over what the launcher says.
    let c = cfg(&[("TE_LOCAL_RANKS", "2"), ("LOCAL_WORLD_SIZE", "8")], 16).unwrap();
    assert_eq!(c.cap.value(), 8);
    // A cgroup quota lowers the cores.
    let env = MapEnv::new([("LOCAL_WORLD_SIZE", "8")]);
    let c = RegistrationConfig::from_env_with_cpus(&env, &CpuBudget::from_parts(192, Some(64.0))).unwrap();
    assert_eq!(c.cap.value(), 8);
}

/// A fresh directory under the system temp dir, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("te-reg-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
    fn write(&self, rel: &str, text: &str) {
        let path = self.0.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn cgroup_v2_quota_is_the_smallest_along_the_path() {
    let root = Scratch::new("v2");
    root.write("proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
    root.write(
        "proc/self/mountinfo",
        "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
    );
    root.write("sys/fs/cgroup/cpu.max", "max 100000\n");
    root.write("sys/fs/cgroup/kubepods/cpu.max", "800000 100000\n");
    root.write("sys/fs/cgroup/kubepods/pod1/cpu.max", "400000 100000\n");
    root.write("sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "max 100000\n");
    assert_eq!(cpus::cgroup_quota_cpus(&root.0), Some(4.0));
}

#[test]
fn cgroup_v1_quota_and_no_quota() {
    let root = Scratch::new("v1");
    root.write("proc/self/cgroup", "4:memory:/job\n1:cpu,cpuacct:/job\n0::/\n");
    root.write(
        "proc/self/mountinfo",
        "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n",
    );
    root.write("sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
    root.write("sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n");
    root.write("sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_quota_us", "250000\n");
    root.write("sys/fs/cgroup/cpu,cpuacct/job/cpu.cfs_period_us", "100000\n");
    assert_eq!(cpus::cgroup_quota_cpus(&root.0), Some(2.5));
    assert_eq!(CpuBudget::from_parts(8, Some(2.5)).cores(), 2);
    let none = Scratch::new("none");
    none.write("proc/self/cgroup", "0::/\n");
    none.write("proc/self/mountinfo", "");
    assert_eq!(cpus::cgroup_quota_cpus(&none.0), None);
}

const CHILD_VAR: &str = "TE_REG_TEST_AFFINITY_CHILD";

/// Runs in a child process started under `taskset`: prints what the engine derives there.
#[test]
fn affinity_child_probe() {
    if std::env::var_os(CHILD_VAR).is_none() {
        return;
    }
    let budget = CpuBudget::detect();
    let config = RegistrationConfig::from_env(&ProcessEnv).unwrap();
    println!("PROBE affinity={} cap={}", budget.affinity_cpus, config.cap.value());
}

fn required(what: &str) -> bool {
    std::env::var("TE_REQUIRE")
        .map(|v| v.split(',').any(|x| x.trim() == what))
        .unwrap_or(false)
}

fn probe(cpu_list: &str, ranks: &str) -> Option<(usize, usize)> {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new("taskset")
        .args(["-c", cpu_list])
        .arg(exe)
        .args(["--exact", "affinity_child_probe", "--nocapture", "--test-threads=1"])
        .env(CHILD_VAR, "1")
        .env("TE_LOCAL_RANKS", ranks)
        .env_remove(CAP_VAR)
        .env_remove(CAP_ALIAS)
        .output()
        .ok()?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    // The harness may print "test name ... " on the same line first.
    let line = text.lines().find_map(|l| l.find("PROBE ").map(|at| &l[at..]))?;
    let field = |name: &str| -> usize {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .and_then(|v| v.parse().ok())
            .unwrap()
    };
    Some((field("affinity="), field("cap=")))
}

#[test]
fn the_derived_cap_follows_a_restricted_affinity_mask() {
    if Command::new("taskset").arg("-V").output().is_err() {
        assert!(!required("taskset"), "TE_REQUIRE names taskset but it is not installed");
        println!("skipped: taskset (util-linux) is not installed");
        return;
    }
    let quota = CpuBudget::detect().quota_cpus;
    let (affinity, cap) = probe("0", "1").expect("probe output");
    assert_eq!(affinity, 1);
    assert_eq!(cap, 1);
    let available = cpus::affinity_cpu_count().unwrap_or(1);
    if available >= 2 && quota.is_none_or(|q| q >= 2.0) {
        assert_eq!(probe("0,1", "1").expect("probe output"), (2, 2));
        assert_eq!(probe("0,1", "2").expect("probe output"), (2, 1));
    }
}

#[test]
fn the_global_pool_is_configured_once_from_the_process_environment() {
    let first = te_base::registration::RegistrationPool::global().unwrap();
    let again = te_base::registration::RegistrationPool::global().unwrap();
    assert!(std::ptr::eq(first, again));
    let expected = RegistrationConfig::from_env(&ProcessEnv).unwrap();
    assert_eq!(first.cap(), expected.cap.cap);
    assert_eq!(first.order(), expected.order);
    assert_eq!(
        first
            .register_batch(Vec::<te_base::RegionInfo>::new(), |_| Ok(()), |_, _| Ok(()))
            .unwrap(),
        Vec::<()>::new()
    );
}
