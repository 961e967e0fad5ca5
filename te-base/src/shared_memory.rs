//! Host memory another process can map: a memfd, sized, then sealed against shrinking and
//! growing (`F_SEAL_SHRINK | F_SEAL_GROW`), mapped `MAP_SHARED`.
//!
//! A process that maps a peer's memfd keeps its mapping as long as it likes, so the file must
//! not shrink under it: a truncated file would make its next copy fault (SIGBUS). The seals
//! forbid that for the file's whole life, whoever holds it, even after the process that made it
//! exited; a receiver checks them ([`map_sealed`]) and refuses an fd without both.
//!
//! [`crate::HostBuffer`]s allocated with [`HostBacking::Memfd`] are listed in a process-wide
//! table by address, so a transport that is handed a registered region (an address and a
//! length) can find the memfd behind it once, at registration ([`memfd_of`]), and share it.
//! Memory the engine did not allocate is never in the table.
//!
//! Uses rustix (memfd_create, fcntl seals, mmap, sendmsg/recvmsg with `SCM_RIGHTS`): typed flags
//! and `OwnedFd` (std's `SocketAncillary` is still unstable).

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};

/// The seals a shared buffer must carry before a peer maps it.
pub const REQUIRED_SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW);

/// How a [`crate::HostBuffer`] is backed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostBacking {
    /// The process default ([`set_default_backing`]; anonymous unless changed). The engine's
    /// `allocate` decides this itself (te-core: a memfd when the shm transport runs and
    /// `TE_SHM_MEMFD` is not off).
    #[default]
    Auto,
    /// An anonymous private mapping: no other process can map it.
    Anonymous,
    /// A sealed memfd mapped shared: a peer on this host can map the same pages.
    Memfd,
}

static DEFAULT_BACKING: AtomicU8 = AtomicU8::new(0);

/// Sets what [`HostBacking::Auto`] means for [`crate::HostBuffer::allocate`] in this process
/// (`Auto` restores the built-in default, anonymous). The engine's `allocate` resolves `Auto`
/// itself and is not affected.
pub fn set_default_backing(b: HostBacking) {
    DEFAULT_BACKING.store(
        match b {
            HostBacking::Auto | HostBacking::Anonymous => 0,
            HostBacking::Memfd => 1,
        },
        Ordering::Relaxed,
    );
}

/// What [`HostBacking::Auto`] means in this process right now.
pub fn default_backing() -> HostBacking {
    match DEFAULT_BACKING.load(Ordering::Relaxed) {
        1 => HostBacking::Memfd,
        _ => HostBacking::Anonymous,
    }
}

/// Creates a memfd of `len` bytes sealed with [`REQUIRED_SEALS`] (`hugetlb`: backed by 2 MiB
/// huge pages; `len` must then be a multiple of 2 MiB).
pub fn create_sealed(name: &str, len: u64, hugetlb: bool) -> std::io::Result<OwnedFd> {
    let mut flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
    if hugetlb {
        flags |= MemfdFlags::HUGETLB | MemfdFlags::HUGE_2MB;
    }
    let fd = rustix::fs::memfd_create(name, flags)?;
    rustix::fs::ftruncate(&fd, len)?;
    rustix::fs::fcntl_add_seals(&fd, REQUIRED_SEALS)?;
    Ok(fd)
}

/// A shared mapping of (part of) a file, unmapped on drop.
#[derive(Debug)]
pub struct SharedMapping {
    /// What mmap returned (page-aligned).
    raw: *mut u8,
    raw_len: usize,
    /// Bytes asked for, from `raw + delta`.
    delta: usize,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; who touches its bytes when is the owner's contract
// (a registration), not this handle's.
unsafe impl Send for SharedMapping {}
// SAFETY: as above.
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// Maps `len` bytes of `fd` from byte `offset`, shared, read-write. The mapping starts at the
    /// page below `offset`; [`SharedMapping::addr`] is where byte `offset` landed.
    pub fn map(fd: BorrowedFd<'_>, offset: u64, len: usize) -> std::io::Result<SharedMapping> {
        let page = rustix::param::page_size() as u64;
        let aligned = offset - offset % page;
        let delta = (offset - aligned) as usize;
        let raw_len = len
            .checked_add(delta)
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        // SAFETY: a fresh mapping at an address the kernel chooses (null hint) aliases no Rust
        // object; callers map only sealed files (or their own), so every page stays backed.
        let raw = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                raw_len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                aligned,
            )
        }?;
        Ok(SharedMapping {
            raw: raw.cast(),
            raw_len,
            delta,
            len,
        })
    }

    /// Address of the first byte asked for.
    pub fn addr(&self) -> u64 {
        self.raw as u64 + self.delta as u64
    }

    /// First byte asked for.
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr() as usize as *mut u8
    }

    /// Bytes asked for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty mapping.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: raw/raw_len are exactly what mmap returned; the owner stops using the range
        // before it drops the handle.
        let _ = unsafe { rustix::mm::munmap(self.raw.cast(), self.raw_len) };
    }
}

/// Why a received fd is not mapped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal(pub String);

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Checks that `fd` carries both seals and holds `[offset, offset + len)`, then maps that range
/// shared. An fd without the seals is refused: its owner could truncate it and make our next
/// copy into the mapping fault.
pub fn map_sealed(fd: BorrowedFd<'_>, offset: u64, len: u64) -> Result<SharedMapping, Refusal> {
    let seals =
        rustix::fs::fcntl_get_seals(fd).map_err(|e| Refusal(format!("the fd is not a sealable memfd ({e})")))?;
    if !seals.contains(REQUIRED_SEALS) {
        return Err(Refusal(
            "the memfd is not sealed against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW)".into(),
        ));
    }
    let size = rustix::fs::fstat(fd)
        .map_err(|e| Refusal(format!("fstat: {e}")))?
        .st_size as u64;
    let end = offset.checked_add(len);
    if len == 0 || end.is_none_or(|e| e > size) || len > isize::MAX as u64 / 2 {
        return Err(Refusal(format!(
            "[{offset}, +{len}) does not lie in a memfd of {size} bytes"
        )));
    }
    SharedMapping::map(fd, offset, len as usize).map_err(|e| Refusal(format!("mmap: {e}")))
}

/// The memfd behind a range of engine-allocated memory.
#[derive(Debug, Clone)]
pub struct MemfdRange {
    /// The sealed memfd.
    pub fd: Arc<OwnedFd>,
    /// Where the range starts in it.
    pub offset: u64,
}

impl MemfdRange {
    /// The descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Memfd-backed host buffers of this process: base -> (length, fd).
static BACKED: RwLock<BTreeMap<u64, (u64, Arc<OwnedFd>)>> = RwLock::new(BTreeMap::new());

/// The memfd behind `[addr, addr + len)`, when the range lies inside one memfd-backed
/// [`crate::HostBuffer`] of this process. One lookup; meant for registration, not per transfer.
pub fn memfd_of(addr: u64, len: u64) -> Option<MemfdRange> {
    let table = BACKED.read();
    let (&base, (size, fd)) = table.range(..=addr).next_back()?;
    let off = addr - base;
    (len <= *size && off <= size - len).then(|| MemfdRange {
        fd: fd.clone(),
        offset: off,
    })
}

pub(crate) fn note(base: u64, len: u64, fd: Arc<OwnedFd>) {
    BACKED.write().insert(base, (len, fd));
}

pub(crate) fn forget(base: u64) {
    BACKED.write().remove(&base);
}

/// Writes `bytes` to a Unix stream with `fd` attached to the first byte (`SCM_RIGHTS`), then
/// whatever the first call did not take. How a memfd travels to the process that maps it.
pub fn send_with_fd(stream: &UnixStream, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [fd];
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other("no room for SCM_RIGHTS"));
    }
    let sent = loop {
        match rustix::net::sendmsg(stream, &[io::IoSlice::new(bytes)], &mut control, SendFlags::NOSIGNAL) {
            Ok(n) => break n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    (&*stream).write_all(&bytes[sent..])
}

/// Fills `buf` from a Unix stream, receiving the descriptor sent with its first bytes, if any
/// (the first one is kept, extras close as they drop). The stream closing before the first byte
/// is `UnexpectedEof`.
pub fn recv_exact_with_fd(stream: &UnixStream, buf: &mut [u8]) -> io::Result<Option<OwnedFd>> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = loop {
        match rustix::net::recvmsg(
            stream,
            &mut [io::IoSliceMut::new(buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(r) => break r.bytes,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let mut fd = None;
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = msg {
            for f in fds {
                if fd.is_none() {
                    fd = Some(f);
                }
            }
        }
    }
    if got == 0 && !buf.is_empty() {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    (&*stream).read_exact(&mut buf[got..])?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{HostBuffer, HostBufferOptions};

    #[test]
    fn a_memfd_buffer_is_found_and_maps_onto_the_same_pages() {
        let buf = HostBuffer::allocate(
            3 * 4096 + 100,
            HostBufferOptions {
                backing: HostBacking::Memfd,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(buf.memfd().is_some());
        let r = memfd_of(buf.addr() + 4096 + 7, 1000).expect("listed");
        assert_eq!(r.offset, 4096 + 7);
        assert!(memfd_of(buf.addr() + 4096, 1 << 20).is_none(), "past its end");
        let m = map_sealed(r.fd(), r.offset, 1000).unwrap();
        // SAFETY: both ranges are live mappings of this test; nothing else touches them.
        unsafe {
            *buf.as_ptr().add(4096 + 7) = 0x5a;
            assert_eq!(*(m.addr() as *const u8), 0x5a);
            *(m.addr() as *mut u8).add(1) = 0x6b;
            assert_eq!(*buf.as_ptr().add(4096 + 8), 0x6b);
        }
        let base = buf.addr();
        drop(buf);
        assert!(memfd_of(base, 1).is_none(), "forgotten on drop");
        // The mapping outlives the buffer (the file lives while mapped).
        // SAFETY: the mapping is still live.
        assert_eq!(unsafe { *(m.addr() as *const u8) }, 0x5a);
    }

    #[test]
    fn an_unsealed_or_short_fd_is_refused() {
        let fd = rustix::fs::memfd_create("t", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&fd, 8192).unwrap();
        let e = map_sealed(fd.as_fd(), 0, 4096).unwrap_err();
        assert!(e.0.contains("not sealed"), "{e}");
        rustix::fs::fcntl_add_seals(&fd, REQUIRED_SEALS).unwrap();
        map_sealed(fd.as_fd(), 0, 8192).unwrap();
        assert!(map_sealed(fd.as_fd(), 4096, 8192).is_err());
        assert!(map_sealed(fd.as_fd(), u64::MAX, 2).is_err());
        assert!(map_sealed(fd.as_fd(), 0, 0).is_err());
        let anon = rustix::fs::open("/dev/null", rustix::fs::OFlags::RDWR, rustix::fs::Mode::empty()).unwrap();
        assert!(map_sealed(anon.as_fd(), 0, 1).is_err());
    }

    #[test]
    fn anonymous_buffers_are_not_listed() {
        let buf = HostBuffer::allocate(4096, HostBufferOptions::default()).unwrap();
        assert!(buf.memfd().is_none());
        assert!(memfd_of(buf.addr(), 1).is_none());
    }
}
