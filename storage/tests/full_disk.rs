//! A full filesystem: a 16 MiB tmpfs (mounted by the test; needs root, skipped otherwise unless
//! `TE_REQUIRE=tmpfs`). Filling it gives `NoSpace`, removes give the space back (compaction),
//! puts succeed again, reopen returns everything acknowledged; with DRAM over the full disk no
//! acknowledged put becomes unreadable.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use umbp::{Store, StoreError};

const OBJ: u64 = 64 << 10;

/// A tmpfs of `mib` MiB mounted on a temporary directory, unmounted on drop.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(mib: u64) -> Option<Tmpfs> {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir.path())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let required = std::env::var("TE_REQUIRE").is_ok_and(|v| v.split(',').any(|x| x.trim() == "tmpfs"));
            assert!(!required, "TE_REQUIRE=tmpfs but mounting a tmpfs failed (needs root)");
            println!("skipped: cannot mount a tmpfs here (needs root; TE_REQUIRE=tmpfs makes this fail)");
            return None;
        }
        Some(Tmpfs { dir })
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("log")
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(self.dir.path()).status();
    }
}

fn ssd_store(dir: &Path, dram: u64, capacity: Option<u64>) -> umbp::StoreBuilder {
    let b = Store::builder()
        .dram_capacity(dram)
        .ssd_dirs(vec![dir.to_path_buf()])
        .ssd_segment_bytes(1 << 20)
        .staging_bytes(1 << 20)
        .staging_slots(2);
    match capacity {
        Some(c) => b.ssd_capacity(c),
        None => b,
    }
}

/// Puts `obj-<first>..` (at most `limit`) until one fails; returns the keys stored and the error
/// that stopped it, if one did.
fn fill(store: &Store, buf: &mut Buf, first: u32, limit: u32) -> (Vec<u32>, Option<StoreError>) {
    let mut stored = Vec::new();
    for i in first..first + limit {
        match put_layers(store, buf, &format!("obj-{i}"), i, 4, OBJ / 4, 0) {
            Ok(()) => stored.push(i),
            Err(e) => return (stored, Some(e)),
        }
    }
    (stored, None)
}

fn check(store: &Store, buf: &mut Buf, keys: &[u32]) {
    for &i in keys {
        get_layers(store, buf, &format!("obj-{i}"), i, 0, 4, OBJ / 4)
            .unwrap_or_else(|e| panic!("acknowledged obj-{i}: {e}"));
    }
}

/// Fill, remove nine of ten, put again, reopen: with the default capacity (90% of free space)
/// and with a capacity larger than the disk (clamped to what the filesystem can give).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_filesystem_recovers_after_removes() {
    let Some(fs) = Tmpfs::mount(16) else { return };
    for capacity in [None, Some(1 << 30)] {
        let dir = fs.path();
        let store = ssd_store(&dir, 0, capacity).open().await.unwrap();
        let cap = store.stats().unwrap().core.ssd_capacity_bytes;
        assert!(cap <= 16 << 20 && cap > 8 << 20, "capacity {cap}");
        let mut buf = Buf::new(&store, OBJ as usize).await;
        let (stored, err) = fill(&store, &mut buf, 0, 1000);
        assert!(matches!(err, Some(StoreError::NoSpace { .. })), "{err:?}");
        assert!(stored.len() > 100, "only {} objects fit", stored.len());
        check(&store, &mut buf, &stored);
        let (keep, gone): (Vec<u32>, Vec<u32>) = stored.iter().partition(|&&i| i % 10 == 0);
        for &i in &gone {
            assert!(store.remove(&format!("obj-{i}")).unwrap());
        }
        // The space comes back: as many puts as were removed, less a segment's worth of slack.
        let want = gone.len() as u32 - 20;
        let (again, err) = fill(&store, &mut buf, 10_000, want);
        assert_eq!(
            again.len() as u32,
            want,
            "after removes only {} puts fit: {err:?}",
            again.len()
        );
        assert!(store.stats().unwrap().core.ssd_segments_compacted > 0);
        check(&store, &mut buf, &keep);
        check(&store, &mut buf, &again);
        store.close().await.unwrap();
        drop(store);
        let store = ssd_store(&dir, 0, capacity).open().await.unwrap();
        let mut buf = Buf::new(&store, OBJ as usize).await;
        check(&store, &mut buf, &keep);
        check(&store, &mut buf, &again);
        for &i in &gone {
            assert!(!store.exists(&format!("obj-{i}")).unwrap(), "removed obj-{i} came back");
        }
        store.close().await.unwrap();
        drop(store);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// Someone else fills the disk after open: the disk's ENOSPC is `NoSpace` for that put only,
/// nothing acknowledged is lost, and puts succeed again once space is freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enospc_is_no_space_and_passes() {
    let Some(fs) = Tmpfs::mount(16) else { return };
    let dir = fs.path();
    let store = ssd_store(&dir, 0, None).open().await.unwrap();
    let mut buf = Buf::new(&store, OBJ as usize).await;
    let (first, err) = fill(&store, &mut buf, 0, 20);
    assert!(err.is_none(), "{err:?}");
    // A ballast file takes every free byte.
    let ballast = fs.dir.path().join("ballast");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&ballast).unwrap();
        let chunk = vec![1u8; 64 << 10];
        for _ in 0..1024 {
            if f.write_all(&chunk).is_err() {
                break;
            }
        }
    }
    let (more, err) = fill(&store, &mut buf, 100, 50);
    assert!(matches!(err, Some(StoreError::NoSpace { .. })), "{err:?}");
    check(&store, &mut buf, &first);
    check(&store, &mut buf, &more);
    std::fs::remove_file(&ballast).unwrap();
    let (again, err) = fill(&store, &mut buf, 200, 20);
    assert_eq!(again.len(), 20, "{err:?}");
    store.close().await.unwrap();
    drop(store);
    let store = ssd_store(&dir, 0, None).open().await.unwrap();
    let mut buf = Buf::new(&store, OBJ as usize).await;
    check(&store, &mut buf, &first);
    check(&store, &mut buf, &more);
    check(&store, &mut buf, &again);
}

/// DRAM over a full disk: demotions fail, the objects stay in DRAM, puts end with `NoSpace`,
/// and every put that returned Ok stays readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_demotions_never_lose_acknowledged_puts() {
    let Some(fs) = Tmpfs::mount(16) else { return };
    let dir = fs.path();
    let store = ssd_store(&dir, 2 << 20, None).open().await.unwrap();
    let mut buf = Buf::new(&store, OBJ as usize).await;
    let (stored, err) = fill(&store, &mut buf, 0, 1000);
    assert!(matches!(err, Some(StoreError::NoSpace { .. })), "{err:?}");
    let s = store.stats().unwrap();
    assert!(
        s.core.demoted > 0 && s.core.demotion_failed > 0 && s.core.dropped == 0,
        "{s:?}"
    );
    check(&store, &mut buf, &stored);
    // Removing makes room for demotions and puts again.
    for &i in stored.iter().filter(|&&i| i % 2 == 1) {
        assert!(store.remove(&format!("obj-{i}")).unwrap());
    }
    let (again, err) = fill(&store, &mut buf, 10_000, 40);
    assert_eq!(again.len(), 40, "{err:?}");
    check(&store, &mut buf, &again);
    let kept: Vec<u32> = stored.iter().copied().filter(|i| i % 2 == 0).collect();
    check(&store, &mut buf, &kept);
}
