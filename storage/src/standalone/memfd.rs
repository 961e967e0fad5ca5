//! Shared KV memory: a worker's buffers are sealed memfds mapped `MAP_SHARED`, so the server maps
//! the same pages and copies into them directly. The file is sized, then sealed against shrinking
//! and growing: a worker that truncated a file the server maps would otherwise make the server's
//! next copy fault (SIGBUS). The server refuses an fd without both seals.
//!
//! Uses rustix (memfd_create, fcntl seals, mmap): typed flags and `OwnedFd` instead of raw libc
//! calls, and it is already in the dependency tree.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

use crate::error::{Result, StoreError};

/// The seals a shared buffer must carry.
pub const REQUIRED_SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW);

fn io(context: &str, e: rustix::io::Errno) -> StoreError {
    StoreError::io(context, e.into())
}

/// A shared mapping of a memfd, unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; who may touch its bytes when is the store's
// registration contract, not this handle's.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` shared, read-write.
    pub fn map(fd: BorrowedFd<'_>, len: usize) -> Result<Mapping> {
        // SAFETY: a fresh mapping chosen by the kernel (null hint) aliases no Rust object; the
        // file is sealed against shrinking, so every mapped page stays backed.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )
        }
        .map_err(|e| io("mmap of a shared buffer", e))?;
        Ok(Mapping { ptr: ptr.cast(), len })
    }

    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// First byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty mapping (never made).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly what mmap returned; nothing uses the range after drop
        // (the store deregisters a buffer before its mapping is dropped).
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
    }
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
        let fd = rustix::fs::memfd_create("umbp-kv", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(|e| io("memfd_create", e))?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(|e| io("sizing a memfd", e))?;
        rustix::fs::fcntl_add_seals(&fd, REQUIRED_SEALS).map_err(|e| io("sealing a memfd", e))?;
        let map = Mapping::map(fd.as_fd(), len)?;
        Ok(KvBuffer { fd, map })
    }

    /// An unsealed memfd buffer (tests: the server must refuse it).
    #[doc(hidden)]
    pub fn new_unsealed(len: usize) -> Result<KvBuffer> {
        let fd = rustix::fs::memfd_create("umbp-kv", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(|e| io("memfd_create", e))?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(|e| io("sizing a memfd", e))?;
        let map = Mapping::map(fd.as_fd(), len)?;
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
/// it. The fd is closed once mapped (the mapping keeps the file).
pub fn map_sealed(fd: OwnedFd, len: u64) -> Result<Mapping> {
    let refused = |reason: String| StoreError::Refused { reason };
    let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|_| refused("the fd is not a sealable memfd".into()))?;
    if !seals.contains(REQUIRED_SEALS) {
        return Err(refused(
            "the memfd is not sealed against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW)".into(),
        ));
    }
    let size = rustix::fs::fstat(&fd)
        .map_err(|e| io("fstat of a shared buffer", e))?
        .st_size as u64;
    if len == 0 || len > size || len > isize::MAX as u64 {
        return Err(refused(format!("buffer of {len} bytes over a memfd of {size}")));
    }
    Mapping::map(fd.as_fd(), len as usize)
}
