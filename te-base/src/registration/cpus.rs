//! How many cores this process may actually run on: its CPU affinity mask and its cgroup CPU quota
//! (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`), not the machine's core count.

use std::fmt;
use std::path::{Path, PathBuf};

/// The cores available to this process, and where the number came from.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuBudget {
    /// CPUs in the affinity mask of the calling thread (`sched_getaffinity`).
    pub affinity_cpus: usize,
    /// CPUs' worth of time the cgroup quota allows (quota / period), if a quota is set.
    pub quota_cpus: Option<f64>,
}

impl CpuBudget {
    /// Reads the affinity mask of the calling thread and the process's cgroup quota.
    pub fn detect() -> Self {
        let affinity_cpus =
            affinity_cpu_count().unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
        let quota_cpus = cgroup_quota_cpus(Path::new("/"));
        CpuBudget {
            affinity_cpus,
            quota_cpus,
        }
    }

    /// A budget from known parts (tests, `te-bench --cores`).
    pub fn from_parts(affinity_cpus: usize, quota_cpus: Option<f64>) -> Self {
        CpuBudget {
            affinity_cpus,
            quota_cpus,
        }
    }

    /// Whole cores usable: the affinity count, lowered to the quota (rounded down, at least 1).
    pub fn cores(&self) -> usize {
        let affinity = self.affinity_cpus.max(1);
        match self.quota_cpus {
            Some(q) if q.is_finite() && q > 0.0 => affinity.min((q.floor() as usize).max(1)),
            _ => affinity,
        }
    }
}

impl fmt::Display for CpuBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} cores (affinity mask {} CPUs", self.cores(), self.affinity_cpus)?;
        match self.quota_cpus {
            Some(q) => write!(f, ", cgroup quota {q:.2} CPUs)"),
            None => write!(f, ", no cgroup quota)"),
        }
    }
}

/// Number of CPUs in the calling thread's affinity mask.
pub fn affinity_cpu_count() -> Option<usize> {
    // SAFETY: cpu_set_t is plain data; zeroed is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, writable cpu_set_t of the size passed; pid 0 means this thread.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return None;
    }
    // SAFETY: `set` was filled by sched_getaffinity above.
    let count = unsafe { libc::CPU_COUNT(&set) };
    usize::try_from(count).ok().filter(|&c| c > 0)
}

/// CPUs' worth of quota of this process's cgroup (the smallest along its path to the root), under
/// the filesystem root `root` (`/` on a live system; a fixture directory in tests).
pub fn cgroup_quota_cpus(root: &Path) -> Option<f64> {
    let cgroup = std::fs::read_to_string(root.join("proc/self/cgroup")).ok()?;
    let mountinfo = std::fs::read_to_string(root.join("proc/self/mountinfo")).ok()?;
    quota_from(&cgroup, &mountinfo, root)
}

/// The quota given the texts of `/proc/self/cgroup` and `/proc/self/mountinfo`, reading the
/// cgroup files under `root`.
pub fn quota_from(cgroup: &str, mountinfo: &str, root: &Path) -> Option<f64> {
    let mut best: Option<f64> = None;
    let mut keep = |q: Option<f64>| {
        if let Some(q) = q {
            best = Some(best.map_or(q, |b: f64| b.min(q)));
        }
    };
    for line in cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if controllers.is_empty() {
            if let Some((mount, mount_root)) = find_mount(mountinfo, "cgroup2", None) {
                for dir in cgroup_dirs(root, &mount, &mount_root, path) {
                    keep(
                        std::fs::read_to_string(dir.join("cpu.max"))
                            .ok()
                            .and_then(|t| parse_cpu_max(&t)),
                    );
                }
            }
        } else if controllers.split(',').any(|c| c == "cpu") {
            if let Some((mount, mount_root)) = find_mount(mountinfo, "cgroup", Some("cpu")) {
                for dir in cgroup_dirs(root, &mount, &mount_root, path) {
                    let quota = std::fs::read_to_string(dir.join("cpu.cfs_quota_us")).ok();
                    let period = std::fs::read_to_string(dir.join("cpu.cfs_period_us")).ok();
                    if let (Some(q), Some(p)) = (quota, period) {
                        keep(parse_cfs(&q, &p));
                    }
                }
            }
        }
    }
    best
}

/// Parses cgroup v2 `cpu.max` (`"max 100000"` or `"200000 100000"`) into CPUs.
pub fn parse_cpu_max(text: &str) -> Option<f64> {
    let mut it = text.split_whitespace();
    let quota = it.next()?;
    let period: f64 = it.next().map_or(Some(100_000.0), |p| p.parse().ok())?;
    if quota == "max" || period <= 0.0 {
        return None;
    }
    let quota: f64 = quota.parse().ok()?;
    (quota > 0.0).then_some(quota / period)
}

/// Parses cgroup v1 `cpu.cfs_quota_us` and `cpu.cfs_period_us` into CPUs (`-1` = no quota).
pub fn parse_cfs(quota: &str, period: &str) -> Option<f64> {
    let quota: i64 = quota.trim().parse().ok()?;
    let period: i64 = period.trim().parse().ok()?;
    (quota > 0 && period > 0).then(|| quota as f64 / period as f64)
}

/// The mount point and mount root of the cgroup filesystem of type `fstype` (with the super option
/// `option` for v1 hierarchies).
fn find_mount(mountinfo: &str, fstype: &str, option: Option<&str>) -> Option<(String, String)> {
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let left: Vec<&str> = left.split(' ').collect();
        let right: Vec<&str> = right.split(' ').collect();
        if left.len() < 5 || right.len() < 3 || right[0] != fstype {
            return None;
        }
        if let Some(opt) = option {
            if !right[2].split(',').any(|o| o == opt) {
                return None;
            }
        }
        Some((left[4].to_string(), left[3].to_string()))
    })
}

/// The cgroup's directory and its ancestors up to the mount point, under `root`.
fn cgroup_dirs(root: &Path, mount: &str, mount_root: &str, path: &str) -> Vec<PathBuf> {
    let relative = path.strip_prefix(mount_root).unwrap_or(path).trim_start_matches('/');
    let base = root.join(mount.trim_start_matches('/'));
    let mut dirs = vec![base.clone()];
    let mut current = base;
    for part in relative.split('/').filter(|p| !p.is_empty()) {
        current = current.join(part);
        dirs.push(current.clone());
    }
    dirs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_quota_files() {
        assert_eq!(parse_cpu_max("max 100000\n"), None);
        assert_eq!(parse_cpu_max("250000 100000\n"), Some(2.5));
        assert_eq!(parse_cpu_max("garbage"), None);
        assert_eq!(parse_cfs("-1\n", "100000\n"), None);
        assert_eq!(parse_cfs("150000\n", "100000\n"), Some(1.5));
    }

    #[test]
    fn budget_takes_the_smaller_of_mask_and_quota() {
        assert_eq!(CpuBudget::from_parts(8, None).cores(), 8);
        assert_eq!(CpuBudget::from_parts(8, Some(2.5)).cores(), 2);
        assert_eq!(CpuBudget::from_parts(8, Some(0.5)).cores(), 1);
        assert_eq!(CpuBudget::from_parts(2, Some(16.0)).cores(), 2);
    }

    #[test]
    fn live_detection_is_sane() {
        let b = CpuBudget::detect();
        assert!(b.cores() >= 1 && b.affinity_cpus >= 1);
    }
}
