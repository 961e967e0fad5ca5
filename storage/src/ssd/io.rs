//! Block I/O of the SSD log: segment files opened with O_DIRECT where the filesystem allows it,
//! and batches of positioned reads and writes through io_uring, or pread/pwrite when io_uring is
//! unavailable or turned off.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::str::FromStr;

use parking_lot::Mutex;

use crate::error::{Result, StoreError};

/// Whether segment files bypass the page cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirectIo {
    /// O_DIRECT when the filesystem accepts it, buffered otherwise.
    #[default]
    Auto,
    /// O_DIRECT or an error.
    On,
    /// Buffered I/O.
    Off,
}

impl FromStr for DirectIo {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(DirectIo::Auto),
            "on" | "1" | "true" => Ok(DirectIo::On),
            "off" | "0" | "false" => Ok(DirectIo::Off),
            _ => Err(format!("unknown direct I/O mode {s:?} (expected auto, on or off)")),
        }
    }
}

/// Which I/O engine submits the log's reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoBackend {
    /// io_uring when the kernel allows it, pread/pwrite otherwise.
    #[default]
    Auto,
    /// io_uring or an error.
    Uring,
    /// pread/pwrite.
    Psync,
}

impl FromStr for IoBackend {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(IoBackend::Auto),
            "uring" | "io_uring" => Ok(IoBackend::Uring),
            "psync" => Ok(IoBackend::Psync),
            _ => Err(format!("unknown I/O backend {s:?} (expected auto, uring or psync)")),
        }
    }
}

/// Opens (creating if needed) a segment file; returns it and whether O_DIRECT is on.
pub fn open_segment(path: &Path, mode: DirectIo, create: bool) -> Result<(File, bool)> {
    let open = |direct: bool| {
        let mut o = OpenOptions::new();
        o.read(true).write(true).create(create);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        o.open(path)
    };
    match mode {
        DirectIo::Off => open(false).map(|f| (f, false)),
        DirectIo::On => open(true).map(|f| (f, true)),
        DirectIo::Auto => match open(true) {
            Ok(f) => Ok((f, true)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => open(false).map(|f| (f, false)),
            Err(e) => Err(e),
        },
    }
    .map_err(|e| StoreError::io(format!("open segment {}", path.display()), e))
}

/// One positioned read or write of a batch. The buffer must stay valid until the batch returns;
/// with O_DIRECT it must be 4 KiB-aligned, and so must `offset` and `len`.
#[derive(Debug, Clone, Copy)]
pub struct IoOp {
    /// File descriptor.
    pub fd: i32,
    /// File offset.
    pub offset: u64,
    /// Memory.
    pub buf: *mut u8,
    /// Bytes.
    pub len: usize,
    /// Write (true) or read.
    pub write: bool,
}

const RING_ENTRIES: u32 = 256;

/// Most times one batch retries `io_uring_enter` after EINTR/EAGAIN/EBUSY before it gives up on
/// submitting more (requests already in flight are still waited for, see [`uring_run`]).
const MAX_ENTER_RETRIES: u32 = 1 << 20;

/// Submits batches of [`IoOp`]s.
pub enum IoEngine {
    /// pread/pwrite, one op after another.
    Psync,
    /// io_uring; rings are pooled so concurrent callers each get one. A ring goes back to the
    /// pool only with nothing in flight.
    Uring(Mutex<Vec<io_uring::IoUring>>),
}

impl std::fmt::Debug for IoEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
thread_local! {
    /// Test-only fault injection: reads that cover this file offset fail with EIO (a real EIO
    /// cannot be produced on a healthy ext4/tmpfs file). Set and cleared by the thread that runs
    /// the I/O.
    pub(crate) static FAIL_READS_AT: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

impl IoEngine {
    /// The engine `backend` asks for.
    pub fn new(backend: IoBackend) -> Result<Self> {
        match backend {
            IoBackend::Psync => Ok(IoEngine::Psync),
            IoBackend::Uring | IoBackend::Auto => match io_uring::IoUring::new(RING_ENTRIES) {
                Ok(ring) => Ok(IoEngine::Uring(Mutex::new(vec![ring]))),
                Err(e) if backend == IoBackend::Auto => {
                    tracing::info!("io_uring unavailable ({e}); using pread/pwrite");
                    Ok(IoEngine::Psync)
                }
                Err(e) => Err(StoreError::Engine(te_base::Error::not_available(
                    "io_uring",
                    e.to_string(),
                ))),
            },
        }
    }

    /// `uring` or `psync`.
    pub fn name(&self) -> &'static str {
        match self {
            IoEngine::Psync => "psync",
            IoEngine::Uring(_) => "uring",
        }
    }

    /// Runs every op to completion. On failure returns the index of the first failed op (ops
    /// after it may or may not have been done). Never returns while an op is still in flight.
    pub fn run(&self, ops: &[IoOp]) -> std::result::Result<(), (usize, std::io::Error)> {
        #[cfg(test)]
        if let Some(at) = FAIL_READS_AT.with(|f| f.get()) {
            if let Some(i) = ops
                .iter()
                .position(|o| !o.write && o.offset <= at && at < o.offset + o.len as u64)
            {
                return Err((i, std::io::Error::from_raw_os_error(libc::EIO)));
            }
        }
        match self {
            IoEngine::Psync => ops
                .iter()
                .enumerate()
                .try_for_each(|(i, op)| psync(op).map_err(|e| (i, e))),
            IoEngine::Uring(pool) => {
                let ring = pool.lock().pop();
                let mut ring = match ring {
                    Some(r) => r,
                    None => io_uring::IoUring::new(RING_ENTRIES).map_err(|e| (0, e))?,
                };
                let result = uring_run(&mut ring, ops);
                // uring_run returns only once nothing it submitted is in flight and the completion
                // queue is empty, so the ring is clean for the next caller.
                pool.lock().push(ring);
                result
            }
        }
    }
}

/// True for errors after which the same call is simply tried again.
fn retryable(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
    )
}

/// One op with pread/pwrite, looping over short transfers and EINTR/EAGAIN.
fn psync(op: &IoOp) -> std::io::Result<()> {
    let mut done = 0usize;
    let mut retries = 0u32;
    while done < op.len {
        // SAFETY: the caller guarantees `buf` is valid for `len` bytes for the duration of the
        // call; we pass a sub-range of it.
        let n = unsafe {
            let p = op.buf.add(done);
            let off = (op.offset + done as u64) as libc::off_t;
            if op.write {
                libc::pwrite(op.fd, p.cast(), op.len - done, off)
            } else {
                libc::pread(op.fd, p.cast(), op.len - done, off)
            }
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if retryable(&e) && retries < MAX_ENTER_RETRIES {
                retries += 1;
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("{} bytes short at offset {}", op.len - done, op.offset + done as u64),
            ));
        }
        done += n as usize;
    }
    Ok(())
}

/// Runs `ops` on `ring`. Every request carries its op index as user data; a completion whose
/// index is out of range or already completed is an error, never an index panic. The function
/// returns only when every submitted request has completed: EINTR/EAGAIN/EBUSY from
/// `io_uring_enter` are retried, a request that completes with EINTR/EAGAIN/ECANCELED or short is finished
/// with pread/pwrite, and if the ring itself keeps failing the process aborts rather than return
/// while the kernel may still write into the caller's memory.
fn uring_run(ring: &mut io_uring::IoUring, ops: &[IoOp]) -> std::result::Result<(), (usize, std::io::Error)> {
    use io_uring::{opcode, types};
    let mut next = 0usize;
    let mut in_flight = 0usize;
    let mut first_error: Option<(usize, std::io::Error)> = None;
    let mut done = vec![false; ops.len()];
    fn note(i: usize, e: std::io::Error, first_error: &mut Option<(usize, std::io::Error)>) {
        if first_error.as_ref().is_none_or(|(j, _)| i < *j) {
            *first_error = Some((i, e));
        }
    }
    let mut enter_failures = 0u32;
    while next < ops.len() || in_flight > 0 {
        // Stop submitting after a ring failure; still wait for what is in flight.
        if enter_failures == 0 {
            let mut sq = ring.submission();
            while next < ops.len() && !sq.is_full() {
                let op = &ops[next];
                let fd = types::Fd(op.fd);
                let entry = if op.write {
                    opcode::Write::new(fd, op.buf, op.len as u32).offset(op.offset).build()
                } else {
                    opcode::Read::new(fd, op.buf, op.len as u32).offset(op.offset).build()
                };
                // SAFETY: the entry points into `ops[next].buf`, which the caller keeps valid until
                // this function returns, and we wait for every submitted entry before returning.
                if unsafe { sq.push(&entry.user_data(next as u64)) }.is_err() {
                    break;
                }
                next += 1;
                in_flight += 1;
            }
        }
        if let Err(e) = ring.submit_and_wait(1) {
            if !retryable(&e) {
                enter_failures += 1;
                if in_flight == 0 {
                    // Nothing submitted is outstanding: report and leave the rest undone.
                    note(next, e, &mut first_error);
                    next = ops.len();
                    break;
                }
                if enter_failures > 1000 {
                    eprintln!("umbp: io_uring_enter keeps failing with {in_flight} request(s) in flight: {e}");
                    std::process::abort();
                }
            } else if enter_failures > 0 {
                enter_failures += 1;
            }
        }
        for cqe in ring.completion() {
            let i = cqe.user_data() as usize;
            if i >= ops.len() || done[i] {
                note(
                    ops.len().saturating_sub(1),
                    std::io::Error::other(format!("unexpected io_uring completion {i}")),
                    &mut first_error,
                );
                continue;
            }
            done[i] = true;
            in_flight -= 1;
            let res = cqe.result();
            let op = &ops[i];
            // EINTR/EAGAIN, and ECANCELED (the kernel cancels requests it punted to a worker when
            // the submitting thread takes a signal; we never cancel any): the positioned op is
            // simply done again.
            let outcome = if res == -libc::EINTR || res == -libc::EAGAIN || res == -libc::ECANCELED {
                psync(op)
            } else if res < 0 {
                Err(std::io::Error::from_raw_os_error(-res))
            } else if (res as usize) < op.len {
                // Short transfer: finish the rest synchronously.
                let rest = IoOp {
                    offset: op.offset + res as u64,
                    // SAFETY: res < len, so the pointer stays inside the caller's buffer.
                    buf: unsafe { op.buf.add(res as usize) },
                    len: op.len - res as usize,
                    ..*op
                };
                if res == 0 && !op.write {
                    Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!("{} bytes short at offset {}", op.len, op.offset),
                    ))
                } else {
                    psync(&rest)
                }
            } else {
                Ok(())
            };
            if let Err(e) = outcome {
                note(i, e, &mut first_error);
            }
        }
    }
    if next < ops.len() && first_error.is_none() {
        first_error = Some((next, std::io::Error::other("io_uring submission stopped")));
    }
    first_error.map_or(Ok(()), Err)
}

/// The file descriptor of `f`.
pub fn fd(f: &File) -> i32 {
    f.as_raw_fd()
}
