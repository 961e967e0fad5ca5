//! The control socket: binding and connecting (abstract or filesystem names), peer credentials,
//! and blocking frame I/O with per-frame deadlines.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::path::Path;

use crate::wire::{Header, HEADER_LEN};

/// The kernel's word on who is at the other end of a Unix socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// Its process id (at connect time).
    pub pid: u32,
    /// Its effective user id.
    pub uid: u32,
}

/// `SO_PEERCRED` of a connected Unix socket.
pub fn peer_cred(stream: &UnixStream) -> io::Result<PeerCred> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are live locals of the sizes the call is told; the fd is open.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(PeerCred {
        pid: cred.pid as u32,
        uid: cred.uid,
    })
}

/// The socket address for a descriptor's `socket` field: `@name` is abstract, anything else a
/// path.
pub fn address(name: &str) -> io::Result<SocketAddr> {
    match name.strip_prefix('@') {
        Some(abs) => SocketAddr::from_abstract_name(abs.as_bytes()),
        None => SocketAddr::from_pathname(Path::new(name)),
    }
}

/// Binds `name`. A path left behind by an engine that exited is replaced; one another process
/// still listens on is an error.
pub fn bind(name: &str) -> io::Result<UnixListener> {
    let addr = address(name)?;
    match UnixListener::bind_addr(&addr) {
        Err(e) if e.kind() == io::ErrorKind::AddrInUse && !name.starts_with('@') => {
            if UnixStream::connect_addr(&addr).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("{name}: another process listens there"),
                ));
            }
            std::fs::remove_file(name)?;
            UnixListener::bind_addr(&addr)
        }
        other => other,
    }
}

/// Reads one frame: header and body.
pub fn read_frame(stream: &mut UnixStream) -> io::Result<(Header, Vec<u8>)> {
    let mut raw = [0u8; HEADER_LEN];
    stream.read_exact(&mut raw)?;
    let h = Header::decode(&raw).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let mut body = vec![0u8; h.len as usize];
    stream.read_exact(&mut body)?;
    Ok((h, body))
}

/// Writes one frame (header with `len` set to the body's length, then the body) in one call.
pub fn write_frame(stream: &mut UnixStream, mut h: Header, body: &[u8]) -> io::Result<()> {
    h.len = body.len() as u32;
    let mut buf = Vec::with_capacity(HEADER_LEN + body.len());
    h.encode_into(&mut buf);
    buf.extend_from_slice(body);
    stream.write_all(&buf)
}

/// Reads one frame and the descriptor sent with it (`SCM_RIGHTS`), if any. The header's first
/// bytes are read with `recvmsg`, so a descriptor attached to the frame is received rather than
/// discarded; a second descriptor on one frame is closed.
pub fn read_frame_fd(stream: &mut UnixStream) -> io::Result<(Header, Vec<u8>, Option<OwnedFd>)> {
    let mut raw = [0u8; HEADER_LEN];
    let fd = te_base::shared_memory::recv_exact_with_fd(stream, &mut raw)?;
    let h = Header::decode(&raw).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let mut body = vec![0u8; h.len as usize];
    stream.read_exact(&mut body)?;
    Ok((h, body, fd))
}

/// Writes one frame with `fd` attached to its first byte (`SCM_RIGHTS`).
pub fn write_frame_fd(stream: &mut UnixStream, mut h: Header, body: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
    h.len = body.len() as u32;
    let mut buf = Vec::with_capacity(HEADER_LEN + body.len());
    h.encode_into(&mut buf);
    buf.extend_from_slice(body);
    te_base::shared_memory::send_with_fd(stream, &buf, fd)
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;
    use crate::wire::{decode_region_fd, Opcode};

    /// A memfd travels with its frame and arrives as a descriptor of the same file; the check the
    /// initiator makes before mapping refuses one without the seals and maps a sealed one.
    #[test]
    fn a_region_fd_arrives_and_only_a_sealed_one_maps() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let flags = rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING;
        let unsealed = rustix::fs::memfd_create("t", flags).unwrap();
        rustix::fs::ftruncate(&unsealed, 8192).unwrap();
        let sealed = te_base::shared_memory::create_sealed("t", 8192, false).unwrap();
        for fd in [&unsealed, &sealed] {
            let h = Header {
                a: 0x10_0000,
                b: 4096,
                ..Header::new(Opcode::RegionFd)
            };
            write_frame_fd(&mut a, h, &4096u64.to_le_bytes(), fd.as_fd()).unwrap();
        }
        // A plain frame between them carries no descriptor.
        write_frame(&mut a, Header::new(Opcode::Ack), &[]).unwrap();
        let mut got = Vec::new();
        for _ in 0..3 {
            got.push(read_frame_fd(&mut b).unwrap());
        }
        assert!(got[2].2.is_none() && got[2].0.op == Opcode::Ack);
        let (h, body, fd) = &got[0];
        let (_, len, offset) = decode_region_fd(h, body).unwrap();
        let e = te_base::shared_memory::map_sealed(fd.as_ref().unwrap().as_fd(), offset, len).unwrap_err();
        assert!(e.0.contains("not sealed"), "{e}");
        let (h, body, fd) = &got[1];
        let (_, len, offset) = decode_region_fd(h, body).unwrap();
        let m = te_base::shared_memory::map_sealed(fd.as_ref().unwrap().as_fd(), offset, len).unwrap();
        assert_eq!(m.len(), 4096);
    }
}
