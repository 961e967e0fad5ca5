//! Shared KV memory: a worker's buffers are sealed memfds mapped `MAP_SHARED`, so the server maps
//! the same pages and copies into them directly. The file is sized, then sealed against shrinking
//! and growing: a worker that truncated a file the server maps would otherwise make the server's
//! next copy fault (SIGBUS). The server refuses an fd without both seals.
//!
//! The memfd, seal and mapping helpers are the engine's (te-base's `shared_memory`, through
//! `te_core::shared_memory`): the shm transport shares engine-allocated memory the same way.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::MemfdFlags;
use te_core::shared_memory::{create_sealed, SharedMapping};

use crate::error::{Result, StoreError};

/// The seals a shared buffer must carry (the engine's: te-base's `shared_memory`, which the
/// shm transport's memfd path uses too).
pub use te_core::shared_memory::REQUIRED_SEALS;

fn io(context: &str, e: rustix::io::Errno) -> StoreError {
    StoreError::io(context, e.into())
}

/// A shared mapping of a memfd, unmapped on drop (the engine's type).
pub type Mapping = SharedMapping;

fn map(fd: BorrowedFd<'_>, len: usize) -> Result<Mapping> {
    SharedMapping::map(fd, 0, len).map_err(|e| StoreError::io("mmap of a shared buffer", e))
}

/// A buffer of KV memory a worker shares with the server: a sealed memfd and its mapping in this
/// process. Allocated by `Store::alloc_buffer` (in both modes, so code does not change with the
/// mode); its bytes are the caller's through [`KvBuffer::as_ptr`] and [`KvBuffer::addr`].
#[derive(Debug)]
pub struct KvBuffer {
    fd: OwnedFd,
    map: Mapping,
}

impl KvBuffer {
    /// Creates a zeroed, sealed memfd of `len` bytes and maps it.
    pub fn new(len: usize) -> Result<KvBuffer> {
        if len == 0 {
            return Err(StoreError::ZeroLength {
                key_index: 0,
                range_index: 0,
            });
        }
        let fd = create_sealed("umbp-kv", len as u64, false)
            .map_err(|e| StoreError::io("a sealed memfd (memfd_create, ftruncate, F_ADD_SEALS)", e))?;
        let map = map(fd.as_fd(), len)?;
        Ok(KvBuffer { fd, map })
    }

    /// An unsealed memfd buffer (tests: the server must refuse it).
    #[doc(hidden)]
    pub fn new_unsealed(len: usize) -> Result<KvBuffer> {
        let fd = rustix::fs::memfd_create("umbp-kv", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(|e| io("memfd_create", e))?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(|e| io("sizing a memfd", e))?;
        let map = map(fd.as_fd(), len)?;
        Ok(KvBuffer { fd, map })
    }

    /// Address of the first byte in this process.
    pub fn addr(&self) -> u64 {
        self.map.addr()
    }

    /// First byte. Reading or writing it while a store call uses the range is a data race.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Never true (buffers are not empty); for clippy's len-without-is-empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The memfd.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The bytes, for filling and checking while no store call uses the buffer.
    ///
    /// # Safety
    ///
    /// No store call may write into the buffer while the slice lives.
    pub unsafe fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is live for self's life; the caller excludes concurrent writers.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr(), self.map.len()) }
    }

    /// The bytes, mutably, while no store call uses the buffer.
    ///
    /// # Safety
    ///
    /// No store call may read or write the buffer while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self) -> &mut [u8] {
        // SAFETY: as above, and the caller holds the only view.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_ptr(), self.map.len()) }
    }
}

/// Server side: checks a received fd carries both seals and is at least `len` bytes, then maps
/// it (te-base's check, shared with the shm transport). The fd is closed once mapped (the
/// mapping keeps the file).
pub fn map_sealed(fd: OwnedFd, len: u64) -> Result<Mapping> {
    te_core::shared_memory::map_sealed(fd.as_fd(), 0, len).map_err(|r| StoreError::Refused { reason: r.0 })
}
