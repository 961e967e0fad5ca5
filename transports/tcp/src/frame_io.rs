//! Socket I/O of frames: a header reader with a small read-ahead buffer whose payloads go straight
//! into their destination memory, and a vectored writer that sends headers and payloads from where
//! they lie (no staging copy).

use std::io::{self, IoSlice};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::wire::{Header, WireError, HEADER_LEN};

/// Read-ahead size: headers and small payloads come from here; larger payloads are read directly
/// into their destination once this is drained.
const READ_AHEAD: usize = 16 << 10;

/// Most parts handed to one `writev`.
const MAX_IOV: usize = 64;

/// Reads frames from a stream.
pub(crate) struct FrameReader<R> {
    inner: R,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
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
    /// is read from the socket directly into `dst`.
    pub async fn payload_into(&mut self, dst: &mut [u8]) -> io::Result<()> {
        let buffered = (self.end - self.start).min(dst.len());
        dst[..buffered].copy_from_slice(&self.buf[self.start..self.start + buffered]);
        self.start += buffered;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        if buffered < dst.len() {
            self.inner.read_exact(&mut dst[buffered..]).await?;
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

    #[tokio::test]
    async fn truncated_header_is_an_error() {
        let (mut a, b) = tokio::io::duplex(1000);
        a.write_all(&Header::new(Opcode::Read).to_bytes()[..10]).await.unwrap();
        drop(a);
        let mut r = FrameReader::new(b);
        assert_eq!(r.header().await.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }
}
