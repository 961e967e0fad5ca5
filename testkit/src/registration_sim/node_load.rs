//! The number of registrations in flight on the whole node, shared by every rank process of a
//! replay through a small shared-memory file (or kept in-process when there is only one process).
//!
//! The simulated provider needs it because the measured penalty of oversubscription depends on the
//! registrations in flight across all ranks against the cores, not on one process's share.

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use te_base::{Error, Result};

/// Bytes mapped: one page, of which the first 8 hold the counter.
const MAP_LEN: usize = 4096;

/// A counter of registrations in flight, in this process or shared between processes.
#[derive(Debug)]
pub struct NodeLoad {
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    Local(Arc<AtomicU64>),
    Shared(NonNull<u8>),
}

// SAFETY: the shared mapping is only accessed through an AtomicU64, which is safe to share and send
// between threads; the pointer stays valid until drop.
unsafe impl Send for NodeLoad {}
// SAFETY: as above.
unsafe impl Sync for NodeLoad {}

impl NodeLoad {
    /// A counter private to this process.
    pub fn local() -> Self {
        NodeLoad {
            inner: Inner::Local(Arc::new(AtomicU64::new(0))),
        }
    }

    /// Creates (or resets) the shared counter file at `path`; every process that opens it sees the
    /// same counter.
    pub fn create(path: &Path) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| Error::io(format!("creating node load file {}", path.display()), e))?;
        file.set_len(MAP_LEN as u64)
            .map_err(|e| Error::io(format!("sizing node load file {}", path.display()), e))?;
        Self::map(&file, path)
    }

    /// Opens a counter file made by [`create`](Self::create).
    pub fn open(path: &Path) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Error::io(format!("opening node load file {}", path.display()), e))?;
        let len = file
            .metadata()
            .map_err(|e| Error::io(format!("node load file {}", path.display()), e))?
            .len();
        if len < MAP_LEN as u64 {
            return Err(Error::transport(
                "sim",
                format!("node load file {} is {len} bytes, expected {MAP_LEN}", path.display()),
            ));
        }
        Self::map(&file, path)
    }

    fn map(file: &std::fs::File, path: &Path) -> Result<Self> {
        // SAFETY: mapping MAP_LEN bytes of a file that is at least that long, shared, read-write;
        // the result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                MAP_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::io(
                format!("mapping node load file {}", path.display()),
                std::io::Error::last_os_error(),
            ));
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| Error::transport("sim", "mmap returned null"))?;
        Ok(NodeLoad {
            inner: Inner::Shared(ptr),
        })
    }

    fn counter(&self) -> &AtomicU64 {
        match &self.inner {
            Inner::Local(c) => c,
            // SAFETY: the mapping is page-aligned (so 8-byte aligned), at least 8 bytes long, lives
            // until drop, and is only ever accessed atomically by every process that maps it.
            Inner::Shared(p) => unsafe { AtomicU64::from_ptr(p.as_ptr().cast::<u64>()) },
        }
    }

    /// Registrations in flight now.
    pub fn in_flight(&self) -> u64 {
        self.counter().load(Ordering::Relaxed)
    }

    /// Counts one registration in flight until the guard drops.
    pub fn enter(&self) -> LoadGuard<'_> {
        self.counter().fetch_add(1, Ordering::Relaxed);
        LoadGuard { load: self }
    }
}

impl Drop for NodeLoad {
    fn drop(&mut self) {
        if let Inner::Shared(p) = self.inner {
            // SAFETY: unmapping exactly the region mapped in `map`, once.
            unsafe { libc::munmap(p.as_ptr().cast(), MAP_LEN) };
        }
    }
}

/// One registration in flight; leaves the count when dropped.
#[derive(Debug)]
pub struct LoadGuard<'a> {
    load: &'a NodeLoad,
}

impl Drop for LoadGuard<'_> {
    fn drop(&mut self) {
        self.load.counter().fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_of_one_file_share_the_counter() {
        let path = std::env::temp_dir().join(format!("te-node-load-{}", std::process::id()));
        let a = NodeLoad::create(&path).unwrap();
        let b = NodeLoad::open(&path).unwrap();
        let g = a.enter();
        assert_eq!(b.in_flight(), 1);
        drop(g);
        assert_eq!(b.in_flight(), 0);
        let _ = std::fs::remove_file(&path);
        let local = NodeLoad::local();
        let _g = local.enter();
        assert_eq!(local.in_flight(), 1);
    }
}
