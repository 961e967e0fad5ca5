//! Socket I/O of frames: a header reader with a small read-ahead buffer whose payloads go straight
//! into their destination memory, and a vectored writer that sends headers and payloads from where
//! they lie (no staging copy).

use std::io::{self, IoSlice, IoSliceMut};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::tcp::OwnedReadHalf;

use crate::wire::{Header, WireError, HEADER_LEN};

/// Read-ahead size: headers and small payloads come from here; larger payloads are read directly
/// into their destination once this is drained.
const READ_AHEAD: usize = 16 << 10;

/// Most parts handed to one `writev`.
const MAX_IOV: usize = 64;

/// A stream a [`FrameReader`] reads from: a payload's tail and the read-ahead for the next
/// header are read with one call where the stream can (a socket: one `readv`).
pub(crate) trait FrameSource: AsyncRead + Unpin {
    /// Reads into `first`, then into `second` once `first` is full; waits until at least one
    /// byte is read, `Ok(0)` at end of stream. By default reads into `first` only.
    fn poll_read_pair(&mut self, cx: &mut Context<'_>, first: &mut [u8], second: &mut [u8]) -> Poll<io::Result<usize>> {
        let _ = second;
        let mut rb = ReadBuf::new(first);
        match Pin::new(self).poll_read(cx, &mut rb) {
            Poll::Ready(Ok(())) => Poll::Ready(Ok(rb.filled().len())),
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl FrameSource for OwnedReadHalf {
    fn poll_read_pair(&mut self, cx: &mut Context<'_>, first: &mut [u8], second: &mut [u8]) -> Poll<io::Result<usize>> {
        let stream: &tokio::net::TcpStream = (*self).as_ref();
        loop {
            match stream.poll_read_ready(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
            let mut bufs = [IoSliceMut::new(&mut *first), IoSliceMut::new(&mut *second)];
            match stream.try_read_vectored(&mut bufs) {
                // WouldBlock cleared the readiness: the next poll waits for the socket.
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => return Poll::Ready(r),
            }
        }
    }
}

#[cfg(test)]
impl FrameSource for tokio::io::DuplexStream {}

/// Reads frames from a stream.
pub(crate) struct FrameReader<R> {
    inner: R,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl<R: FrameSource> FrameReader<R> {
    /// Wraps a stream.
    pub fn new(inner: R) -> Self {
        FrameReader {
            inner,
            buf: vec![0u8; READ_AHEAD].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    /// True if a whole header is already buffered (the next `header` call makes no syscall).
    pub fn has_buffered_header(&self) -> bool {
        self.end - self.start >= HEADER_LEN
    }

    /// True if any byte of the next frame is buffered.
    fn has_buffered_bytes(&self) -> bool {
        self.end > self.start
    }

    /// Waits until at least one byte of the next frame is buffered. `Ok(false)` at a clean end of
    /// stream. (The serving side waits here under its idle timeout, and reads the rest of the
    /// header under its frame timeout.)
    pub async fn fill(&mut self) -> io::Result<bool> {
        if self.has_buffered_bytes() {
            return Ok(true);
        }
        self.start = 0;
        self.end = self.inner.read(&mut self.buf[..]).await?;
        Ok(self.end > 0)
    }

    /// True if the next frame can be started without waiting for the peer: a whole header is
    /// buffered, or the stream had bytes ready now (they are appended to the buffer). Never
    /// waits: `Ok(false)` when the next read would (or the stream ended, which the next `fill`
    /// reports). The serving side holds its replies while this is true, so a stream of requests
    /// is answered with one write per burst, not one per request.
    pub async fn fill_ready(&mut self) -> io::Result<bool> {
        if self.has_buffered_header() {
            return Ok(true);
        }
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let (inner, spare) = (&mut self.inner, &mut self.buf[self.end..]);
        // One poll of the read: Pending (the waker it registered is replaced by the next real
        // wait) means nothing is ready.
        let got = std::future::poll_fn(|cx| {
            let mut rb = ReadBuf::new(&mut spare[..]);
            match Pin::new(&mut *inner).poll_read(cx, &mut rb) {
                Poll::Ready(Ok(())) => Poll::Ready(Ok(Some(rb.filled().len()))),
                Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                Poll::Pending => Poll::Ready(Ok(None)),
            }
        })
        .await?;
        match got {
            Some(n) if n > 0 => {
                self.end += n;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// The next header. `Ok(None)` at a clean end of stream between frames; a stream that ends
    /// inside a header is `UnexpectedEof`.
    pub async fn header(&mut self) -> io::Result<Option<Result<Header, WireError>>> {
        while self.end - self.start < HEADER_LEN {
            if self.start > 0 {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            let n = self.inner.read(&mut self.buf[self.end..]).await?;
            if n == 0 {
                if self.end == 0 {
                    return Ok(None);
                }
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "stream ended inside a frame header",
                ));
            }
            self.end += n;
        }
        let mut raw = [0u8; HEADER_LEN];
        raw.copy_from_slice(&self.buf[self.start..self.start + HEADER_LEN]);
        self.start += HEADER_LEN;
        Ok(Some(Header::decode(&raw)))
    }

    /// Reads exactly `dst.len()` payload bytes into `dst`: the buffered part is copied, the rest
    /// is read from the socket directly into `dst`, each read also filling the (then empty)
    /// read-ahead with what follows, so the next header usually comes with the payload's last
    /// bytes: one syscall per frame of a stream, not two.
    pub async fn payload_into(&mut self, dst: &mut [u8]) -> io::Result<()> {
        let buffered = (self.end - self.start).min(dst.len());
        dst[..buffered].copy_from_slice(&self.buf[self.start..self.start + buffered]);
        self.start += buffered;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        let mut filled = buffered;
        while filled < dst.len() {
            // The read-ahead is empty here: `buffered` took all of it.
            let (inner, ahead) = (&mut self.inner, &mut self.buf[..]);
            let rest = &mut dst[filled..];
            let n = std::future::poll_fn(|cx| inner.poll_read_pair(cx, rest, ahead)).await?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "stream ended inside a payload",
                ));
            }
            let want = dst.len() - filled;
            if n > want {
                self.end = n - want;
                filled = dst.len();
            } else {
                filled += n;
            }
        }
        Ok(())
    }

    /// Reads and drops `len` payload bytes (the payload of a refused write).
    pub async fn discard(&mut self, mut len: u64) -> io::Result<()> {
        let mut scratch = [0u8; 4096];
        while len > 0 {
            let n = len.min(scratch.len() as u64) as usize;
            self.payload_into(&mut scratch[..n]).await?;
            len -= n as u64;
        }
        Ok(())
    }
}

/// A byte range to send: an address in this process and a length.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawPart {
    pub addr: usize,
    pub len: usize,
}

impl RawPart {
    /// The part covering `bytes`.
    pub fn of(bytes: &[u8]) -> RawPart {
        RawPart {
            addr: bytes.as_ptr() as usize,
            len: bytes.len(),
        }
    }
}

/// Writes every byte of `parts`, in order, with vectored writes.
///
/// # Safety
///
/// Every part must be readable for its whole length until the returned future completes or is
/// dropped.
pub(crate) async unsafe fn write_all_raw<W: AsyncWrite + Unpin>(w: &mut W, parts: &[RawPart]) -> io::Result<()> {
    let mut idx = 0;
    let mut skip = 0usize;
    while idx < parts.len() {
        let n = {
            let mut iov = [IoSlice::new(&[]); MAX_IOV];
            let mut count = 0;
            for (j, p) in parts[idx..].iter().take(MAX_IOV).enumerate() {
                let off = if j == 0 { skip } else { 0 };
                // SAFETY: the caller guarantees the part is readable for its length; `off` is
                // below `p.len` because a fully written part is skipped below.
                let bytes = unsafe { std::slice::from_raw_parts((p.addr + off) as *const u8, p.len - off) };
                iov[count] = IoSlice::new(bytes);
                count += 1;
            }
            w.write_vectored(&iov[..count]).await?
        };
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "socket accepted no bytes"));
        }
        let mut left = n;
        while left > 0 {
            let rest = parts[idx].len - skip;
            if left >= rest {
                left -= rest;
                idx += 1;
                skip = 0;
            } else {
                skip += left;
                left = 0;
            }
        }
        // Zero-length parts never hold up the loop.
        while idx < parts.len() && parts[idx].len == skip {
            idx += 1;
            skip = 0;
        }
    }
    Ok(())
}

/// Writes `bytes` fully.
pub(crate) async fn write_all<W: AsyncWrite + Unpin>(w: &mut W, bytes: &[u8]) -> io::Result<()> {
    w.write_all(bytes).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Opcode;

    #[tokio::test]
    async fn vectored_writes_and_buffered_reads_agree() {
        let (mut a, b) = tokio::io::duplex(1000);
        let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let h = Header {
            len: payload.len() as u64,
            ..Header::new(Opcode::Write)
        }
        .to_bytes();
        let small = Header::new(Opcode::Read).to_bytes();
        let parts = [
            RawPart::of(&h),
            RawPart::of(&[]),
            RawPart::of(&payload),
            RawPart::of(&small),
        ];
        let writer = async {
            // SAFETY: every part borrows a live local for the whole call.
            unsafe { write_all_raw(&mut a, &parts).await }.unwrap();
            drop(a);
        };
        let reader = async {
            let mut r = FrameReader::new(b);
            let got = r.header().await.unwrap().unwrap().unwrap();
            assert_eq!(got.opcode, Opcode::Write);
            let mut dst = vec![0u8; got.len as usize];
            r.payload_into(&mut dst).await.unwrap();
            assert_eq!(dst, payload);
            assert_eq!(r.header().await.unwrap().unwrap().unwrap().opcode, Opcode::Read);
            assert!(r.header().await.unwrap().is_none());
        };
        tokio::join!(writer, reader);
    }

    /// Over a socket, payload tails and the next header share reads (`readv`); frames still come
    /// out whole and in order, for large and small payloads alike.
    #[tokio::test]
    async fn socket_reads_keep_frames_apart() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sizes = [200_000usize, 0, 3, 70_000, 16 << 10, 1, 500_000];
        let writer = async {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            for (i, &n) in sizes.iter().enumerate() {
                let h = Header {
                    request_id: i as u64,
                    len: n as u64,
                    ..Header::new(Opcode::Write)
                };
                s.write_all(&h.to_bytes()).await.unwrap();
                let payload: Vec<u8> = (0..n).map(|j| (j % 253) as u8 ^ i as u8).collect();
                s.write_all(&payload).await.unwrap();
            }
        };
        let reader = async {
            let (s, _) = listener.accept().await.unwrap();
            let (r, _w) = s.into_split();
            let mut r = FrameReader::new(r);
            for (i, &n) in sizes.iter().enumerate() {
                let h = r.header().await.unwrap().unwrap().unwrap();
                assert_eq!((h.request_id, h.len), (i as u64, n as u64));
                let mut dst = vec![0u8; n];
                r.payload_into(&mut dst).await.unwrap();
                assert!(dst.iter().enumerate().all(|(j, &b)| b == (j % 253) as u8 ^ i as u8));
            }
            assert!(r.header().await.unwrap().is_none());
        };
        tokio::join!(writer, reader);
    }

    #[tokio::test]
    async fn truncated_header_is_an_error() {
        let (mut a, b) = tokio::io::duplex(1000);
        a.write_all(&Header::new(Opcode::Read).to_bytes()[..10]).await.unwrap();
        drop(a);
        let mut r = FrameReader::new(b);
        assert_eq!(r.header().await.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }
}
