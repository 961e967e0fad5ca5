//! Page-aligned host memory that the engine allocates for callers: an anonymous mapping, or a
//! sealed memfd mapped shared that a peer on this host can map too ([`HostBacking`]), optionally
//! backed by huge pages and bound to a NUMA node.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Error, Result};
pub use crate::shared_memory::HostBacking;

/// How a [`HostBuffer`] is backed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HugePages {
    /// Ordinary 4 KiB pages.
    #[default]
    None,
    /// Ask the kernel for transparent huge pages (`madvise(MADV_HUGEPAGE)`); best effort.
    Transparent,
    /// Explicit `MAP_HUGETLB` pages; an error if the system has none reserved.
    Explicit,
}

/// Options for [`HostBuffer::allocate`].
#[derive(Debug, Clone, Copy, Default)]
pub struct HostBufferOptions {
    /// Huge page backing.
    pub huge_pages: HugePages,
    /// Bind the pages to this NUMA node (`mbind(MPOL_BIND)`).
    pub numa_node: Option<u32>,
    /// Touch every page at allocation so registration and first transfers do not fault.
    pub prefault: bool,
    /// Anonymous memory or a sealed memfd ([`HostBacking`]; `Auto`: the process default,
    /// [`crate::shared_memory::set_default_backing`]).
    pub backing: HostBacking,
}

/// Zero-initialised, page-aligned host memory owned by the engine. Freed on drop.
#[derive(Debug)]
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    map_len: usize,
    numa_node: Option<u32>,
    /// The sealed memfd behind a [`HostBacking::Memfd`] buffer.
    memfd: Option<Arc<OwnedFd>>,
}

// SAFETY: HostBuffer owns its mapping exclusively; the raw pointer is just an address that any
// thread may use, and all mutation goes through explicit unsafe accessors or transports.
unsafe impl Send for HostBuffer {}
// SAFETY: as above; shared references only expose the address and length.
unsafe impl Sync for HostBuffer {}

const MPOL_BIND: libc::c_int = 2;

/// The backing a buffer gets: an explicit one as asked; `Auto` the process default, except that
/// where transparent huge pages are asked for and the kernel does not give them to shared
/// memory (`shmem_enabled` never or deny), anonymous memory, which gets them. A memfd would fault
/// in 4 KiB pages, which made a DRAM arena's first writes about 6x slower (a UMBP distributed put
/// of fresh keys: 27 ms against 4.5 ms); same-host peers then reach such a buffer by
/// cross-memory attach instead of mapping it.
fn resolve_backing(
    asked: HostBacking,
    huge: HugePages,
    default: impl FnOnce() -> HostBacking,
    shmem_huge: impl FnOnce() -> bool,
) -> HostBacking {
    match asked {
        HostBacking::Auto if !memfd_gives(huge, shmem_huge) => HostBacking::Anonymous,
        HostBacking::Auto => default(),
        b => b,
    }
}

/// Whether a memfd can back memory with the huge pages asked for: explicit ones only through an
/// explicit hugetlb memfd, transparent ones where the kernel gives them to shared memory
/// (`shmem_huge`). Where not, memory left to choose (`HostBacking::Auto`) is anonymous.
pub fn memfd_gives(huge: HugePages, shmem_huge: impl FnOnce() -> bool) -> bool {
    match huge {
        HugePages::None => true,
        HugePages::Transparent => shmem_huge(),
        HugePages::Explicit => false,
    }
}

/// Whether `madvise(MADV_HUGEPAGE)` on shared memory (a memfd mapping) can give huge pages:
/// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` is `always`, `within_size`, `advise` or
/// `force` (read once; unreadable: no).
pub fn shmem_takes_huge_pages() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
            .ok()
            .is_some_and(|s| {
                shmem_setting(&s).is_some_and(|m| matches!(m, "always" | "within_size" | "advise" | "force"))
            })
    })
}

/// The selected mode of a sysfs THP setting (`always within_size advise [never] deny force`).
fn shmem_setting(s: &str) -> Option<&str> {
    let open = s.find('[')?;
    let close = s[open..].find(']')? + open;
    Some(&s[open + 1..close])
}

impl HostBuffer {
    /// Allocates `len` bytes (rounded up to the page size internally).
    pub fn allocate(len: usize, opts: HostBufferOptions) -> Result<Self> {
        if len == 0 {
            return Err(Error::ZeroLength { index: 0 });
        }
        let page = if opts.huge_pages == HugePages::Explicit {
            2 << 20
        } else {
            page_size()
        };
        let map_len = len.checked_next_multiple_of(page).ok_or(Error::LengthOverflow {
            addr: 0,
            len: len as u64,
        })?;
        let backing = resolve_backing(
            opts.backing,
            opts.huge_pages,
            crate::shared_memory::default_backing,
            shmem_takes_huge_pages,
        );
        let memfd = if backing == HostBacking::Memfd {
            let fd =
                crate::shared_memory::create_sealed("te-host", map_len as u64, opts.huge_pages == HugePages::Explicit)
                    .map_err(|e| {
                        if opts.huge_pages == HugePages::Explicit {
                            Error::not_available(
                                "huge pages",
                                format!("memfd_create(MFD_HUGETLB, {map_len} B) failed: {e}"),
                            )
                        } else {
                            Error::io(format!("a sealed memfd of {map_len} bytes"), e)
                        }
                    })?;
            Some(Arc::new(fd))
        } else {
            None
        };
        let (mut flags, fd) = match &memfd {
            Some(fd) => (libc::MAP_SHARED, fd.as_fd().as_raw_fd()),
            None => (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1),
        };
        if opts.huge_pages == HugePages::Explicit && memfd.is_none() {
            flags |= libc::MAP_HUGETLB;
        }
        // SAFETY: a new mapping (anonymous, or of our own sealed memfd sized `map_len`) with no
        // address hint; the kernel picks the address and we check for MAP_FAILED before using it.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            let err = std::io::Error::last_os_error();
            if opts.huge_pages == HugePages::Explicit {
                return Err(Error::not_available(
                    "huge pages",
                    format!("mmap(MAP_HUGETLB, {map_len} B) failed: {err}"),
                ));
            }
            return Err(Error::io(format!("mmap of {map_len} bytes"), err));
        }
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or(Error::NullAddress)?;
        if let Some(fd) = &memfd {
            crate::shared_memory::note(ptr.as_ptr() as u64, map_len as u64, fd.clone());
        }
        let buf = HostBuffer {
            ptr,
            len,
            map_len,
            numa_node: opts.numa_node,
            memfd,
        };
        if opts.huge_pages == HugePages::Transparent {
            // SAFETY: the range is exactly our own live mapping.
            unsafe { libc::madvise(raw, map_len, libc::MADV_HUGEPAGE) };
        }
        if let Some(node) = opts.numa_node {
            buf.bind_to_node(node)?;
        }
        if opts.prefault {
            let step = page_size();
            let mut off = 0;
            while off < map_len {
                // SAFETY: off < map_len, inside our mapping; a volatile write forces the fault.
                unsafe { buf.ptr.as_ptr().add(off).write_volatile(0) };
                off += step;
            }
        }
        Ok(buf)
    }

    fn bind_to_node(&self, node: u32) -> Result<()> {
        if node >= 1024 {
            return Err(Error::config(
                "numa_node",
                node.to_string(),
                "NUMA node out of range (max 1023)",
            ));
        }
        let mut mask = [0u64; 16];
        mask[(node / 64) as usize] |= 1u64 << (node % 64);
        // SAFETY: mbind on our own mapping with a correctly sized node mask (16 x 64 bits).
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mbind,
                self.ptr.as_ptr() as usize,
                self.map_len,
                MPOL_BIND,
                mask.as_ptr(),
                (mask.len() * 64) as libc::c_ulong,
                0 as libc::c_uint,
            )
        };
        if rc != 0 {
            return Err(Error::io(
                format!("mbind to NUMA node {node}"),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The address of the first byte.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Length in bytes as requested.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (zero-length buffers are refused); present for API symmetry.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The NUMA node the buffer was bound to, if any.
    pub fn numa_node(&self) -> Option<u32> {
        self.numa_node
    }

    /// The sealed memfd behind the buffer ([`HostBacking::Memfd`]); `None` for anonymous memory.
    pub fn memfd(&self) -> Option<BorrowedFd<'_>> {
        self.memfd.as_ref().map(|f| f.as_fd())
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if self.memfd.is_some() {
            crate::shared_memory::forget(self.ptr.as_ptr() as u64);
        }
        // SAFETY: unmapping exactly the mapping created in `allocate`, once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.map_len) };
    }
}

/// The system page size.
pub fn page_size() -> usize {
    rustix::param::page_size()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_zeroed_aligned_memory() {
        let b = HostBuffer::allocate(
            10_000,
            HostBufferOptions {
                prefault: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(b.addr() % page_size() as u64, 0);
        assert_eq!(b.len(), 10_000);
        // SAFETY: the buffer is live and 10_000 bytes long; nothing else uses it.
        let s = unsafe { std::slice::from_raw_parts(b.as_ptr(), b.len()) };
        assert!(s.iter().all(|&x| x == 0));
    }

    #[test]
    fn transparent_huge_pages_win_over_a_memfd_default_the_kernel_cannot_back() {
        let memfd = || HostBacking::Memfd;
        let t = HugePages::Transparent;
        assert_eq!(
            resolve_backing(HostBacking::Auto, t, memfd, || false),
            HostBacking::Anonymous
        );
        assert_eq!(
            resolve_backing(HostBacking::Auto, t, memfd, || true),
            HostBacking::Memfd
        );
        assert_eq!(
            resolve_backing(HostBacking::Auto, HugePages::None, memfd, || false),
            HostBacking::Memfd
        );
        // Asked for explicitly: as asked.
        assert_eq!(
            resolve_backing(HostBacking::Memfd, t, memfd, || false),
            HostBacking::Memfd
        );
        assert_eq!(
            shmem_setting("always within_size advise [never] deny force\n"),
            Some("never")
        );
        assert_eq!(shmem_setting("[advise] never"), Some("advise"));
        assert_eq!(shmem_setting("garbage"), None);
    }

    #[test]
    fn zero_length_is_refused() {
        assert!(matches!(
            HostBuffer::allocate(0, Default::default()),
            Err(Error::ZeroLength { .. })
        ));
    }

    #[test]
    fn numa_node_zero_binds_or_reports() {
        // Node 0 exists on every Linux host with NUMA support; where mbind is unsupported the
        // error must say so rather than panic.
        match HostBuffer::allocate(
            1 << 20,
            HostBufferOptions {
                numa_node: Some(0),
                ..Default::default()
            },
        ) {
            Ok(b) => assert_eq!(b.numa_node(), Some(0)),
            Err(e) => assert!(e.to_string().contains("mbind"), "{e}"),
        }
    }
}
