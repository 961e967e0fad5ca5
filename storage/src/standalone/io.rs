//! Frames over a Unix stream socket: writing a frame (with a memfd attached by `SCM_RIGHTS`),
//! reading one under a size cap (the buffer grows only as bytes arrive, so an announced length
//! costs what was sent), and the peer's credentials (`SO_PEERCRED`).
//!
//! Descriptors travel by `te_base::shared_memory::{send_with_fd, recv_exact_with_fd}` (shared
//! with the shm transport); the credentials come from rustix's `socket_peercred`.

use std::io::{self, Read, Write};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use super::wire::{decode_header, Header, WireError, HEADER};

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum RecvError {
    /// The socket failed, timed out or closed.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The header was not a valid frame header.
    #[error("{0}")]
    Wire(#[from] WireError),
}

/// Writes `frame`; with `fd`, the descriptor travels with its first byte.
pub fn send_frame(stream: &UnixStream, frame: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    match fd {
        Some(fd) => te_base::shared_memory::send_with_fd(stream, frame, fd),
        None => (&*stream).write_all(frame),
    }
}

/// Reads one frame into `buf` (its payload), refusing payloads over `max`. With `accept_fd`, a
/// descriptor sent with the header is returned (any other is closed).
pub fn recv_frame(
    stream: &UnixStream,
    buf: &mut Vec<u8>,
    max: usize,
    accept_fd: bool,
) -> Result<(Header, Option<OwnedFd>), RecvError> {
    let mut head = [0u8; HEADER];
    let fd = if accept_fd {
        te_base::shared_memory::recv_exact_with_fd(stream, &mut head)?
    } else {
        (&*stream).read_exact(&mut head)?;
        None
    };
    let h = decode_header(&head, max)?;
    read_growing(stream, buf, h.len)?;
    Ok((h, fd))
}

/// Reads exactly `len` bytes into `buf`, growing it only as bytes arrive.
fn read_growing(stream: &UnixStream, buf: &mut Vec<u8>, len: usize) -> io::Result<()> {
    const FIRST: usize = 64 << 10;
    buf.clear();
    if buf.capacity() >= len {
        buf.resize(len, 0);
        return (&*stream).read_exact(buf);
    }
    while buf.len() < len {
        let want = (len - buf.len()).min(buf.len().max(FIRST));
        let at = buf.len();
        buf.resize(at + want, 0);
        (&*stream).read_exact(&mut buf[at..])?;
    }
    Ok(())
}

/// Polls `stream` for readability without sleeping for up to `spin` (a reply or request usually
/// follows within microseconds; sleeping costs a wakeup). True once readable.
pub fn spin_readable(stream: &UnixStream, spin: std::time::Duration) -> bool {
    if spin.is_zero() {
        return false;
    }
    let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
    let start = std::time::Instant::now();
    loop {
        let mut fds = [rustix::event::PollFd::new(stream, rustix::event::PollFlags::IN)];
        if rustix::event::poll(&mut fds, Some(&zero)).unwrap_or(0) > 0 {
            return true;
        }
        if start.elapsed() >= spin {
            return false;
        }
        std::hint::spin_loop();
    }
}

/// The uid, gid and pid of the process at the other end.
pub fn peer_credentials(stream: &UnixStream) -> io::Result<(u32, u32, i32)> {
    let c = rustix::net::sockopt::socket_peercred(stream)?;
    Ok((c.uid.as_raw(), c.gid.as_raw(), c.pid.as_raw_nonzero().get()))
}
