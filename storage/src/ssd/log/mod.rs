//! The SSD tier: a segmented log of 4 KiB-aligned records in one or more directories (one per
//! drive), an in-memory index rebuilt from the log at open, and ranged reads that fetch only the
//! payload blocks a range touches.
//!
//! Every record carries a sequence number (the object's version, given by the store). The index
//! holds, per key, the record with the highest sequence number; a record that loses (replaced,
//! removed, or written after a newer one) is marked dead on disk, and at open a dead record hides
//! every record of its key with a sequence number not above its own, so nothing removed or
//! replaced comes back.
//!
//! Writes to one directory are serialised (its lock is held while they run). At open every
//! segment is scanned: a record whose payload fails its CRC stays indexed and reads `Corrupt`; a
//! damaged header is skipped by resynchronising on the next block that holds a valid header; only
//! a damaged tail of a directory's last segment with nothing valid after it (a torn write) is
//! truncated. A read error fails the open and truncates nothing.
//!
//! Space comes back through compaction: a sealed segment whose live bytes fall below
//! `compact_below` of its length has its live records rewritten at the log's head by a background
//! thread, a bounded chunk at a time, and is then deleted once the copies are synced. A copy keeps
//! its record's sequence number, so a crash before the source is gone leaves two live copies of
//! one version: the open keeps one and marks the other void (a flag that hides nothing), never
//! dead, since a dead record hides every record of its key up to its sequence number. When a put does not fit under the
//! directory's capacity, segments with dead bytes are compacted at once; if it still does not fit
//! the put fails with `NoSpace`.
//!
//! This module moves bytes between files and caller-provided staging memory; the store moves them
//! between staging and caller buffers through the transfer engine.
//!
//! This file holds the types, the index accessors and removal; `recovery` opens the log,
//! `append` writes records, `space` compacts, and `ranges` plans and runs ranged reads.

mod append;
mod ranges;
mod recovery;
mod space;

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard};

use super::aligned::AlignedBuf;
use super::io::{fd, open_segment, DirectIo, IoBackend, IoEngine, IoOp};
use super::record::{
    align_up, block_crcs, checked_record_len, decode_header, decode_header_unverified, encode_header, has_magic,
    header_len, payload_blocks, peek_header_len, record_len, HeaderFields, BLOCK, FLAG_DEAD, FLAG_VOID,
};
use crate::error::{Result, StoreError, Tier};
use crate::range_map::Extent;

/// Fraction of a directory's free space (plus the log already there) used when no capacity is
/// given.
pub const DEFAULT_CAPACITY_FRACTION: f64 = 0.9;
/// Bytes after which the background compactor releases a directory's lock: a chunk is whole
/// records, ending with the one that reaches this (so at most this plus one record).
pub const COMPACTION_CHUNK_BYTES: u64 = 1 << 20;

/// Settings of the SSD tier.
#[derive(Debug, Clone)]
pub struct SsdOptions {
    /// One directory per drive.
    pub dirs: Vec<PathBuf>,
    /// Total bytes over all directories; `None`: [`DEFAULT_CAPACITY_FRACTION`] of each
    /// directory's filesystem free space at open, plus the log bytes already there.
    pub capacity: Option<u64>,
    /// Size a segment file grows to before the next one starts.
    pub segment_bytes: u64,
    /// O_DIRECT mode.
    pub direct: DirectIo,
    /// I/O engine.
    pub io: IoBackend,
    /// Sealed segments whose live bytes fall below this fraction of their length are compacted.
    pub compact_below: f64,
    /// Called between the steps of compaction and of the open scan's clean-up; crash tests cut
    /// the process there. Empty by default.
    pub step_hook: StepHook,
}

/// The points between two steps of a multi-step write of the log, where a crash may land.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Step {
    /// Compaction wrote the copies of a chunk of live records; the index still names the source.
    CopiesWritten,
    /// Compaction pointed the index at the copies; copies of keys changed meanwhile not yet
    /// marked dead.
    IndexRepointed,
    /// Compaction synced the copies of a whole segment; the source segment still exists.
    CopiesSynced,
    /// Compaction deleted the source segment's file; the directory not yet synced.
    SourceDeleted,
    /// Compaction synced the directory: the segment is gone for good.
    DirectorySynced,
    /// The open scan marked one superseded record dead or one surplus copy void.
    OpenMarked,
}

impl Step {
    /// Every step, in the order a compaction passes them (the open scan's last).
    pub const ALL: [Step; 6] = [
        Step::CopiesWritten,
        Step::IndexRepointed,
        Step::CopiesSynced,
        Step::SourceDeleted,
        Step::DirectorySynced,
        Step::OpenMarked,
    ];
}

/// A function called at each [`Step`]; cloning shares it.
#[derive(Clone, Default)]
pub struct StepHook(Option<Arc<dyn Fn(Step) + Send + Sync>>);

impl StepHook {
    /// A hook that calls `f` at every step.
    pub fn new(f: impl Fn(Step) + Send + Sync + 'static) -> Self {
        StepHook(Some(Arc::new(f)))
    }

    fn at(&self, step: Step) {
        if let Some(f) = &self.0 {
            f(step);
        }
    }
}

impl std::fmt::Debug for StepHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "StepHook(set)"
        } else {
            "StepHook(none)"
        })
    }
}

/// One open segment file.
#[derive(Debug)]
pub struct SegmentFile {
    file: File,
    dir: u16,
    id: u32,
    direct: bool,
    /// Bytes of the records of this file that the index points to.
    live: AtomicU64,
}

/// Where a live record is.
#[derive(Debug, Clone)]
pub struct SsdEntry {
    file: Arc<SegmentFile>,
    offset: u64,
    header_len: u64,
    seq: u64,
    /// Payload length (the object's size).
    pub payload_len: u64,
    /// Depth hint given at put.
    pub depth: u32,
    crcs: Arc<[u32]>,
    /// The record's header failed its checksum at open: the key reads `Corrupt`.
    damaged: bool,
}

impl SsdEntry {
    /// File offset of payload block `block`.
    fn block_offset(&self, block: u64) -> u64 {
        self.offset + self.header_len + block * BLOCK
    }

    /// The record's sequence number (the object's version).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// True when the record's header was damaged: reads of the key report `Corrupt`.
    pub fn is_damaged(&self) -> bool {
        self.damaged
    }

    fn record_len(&self) -> u64 {
        if self.damaged {
            BLOCK
        } else {
            self.header_len + payload_blocks(self.payload_len) * BLOCK
        }
    }

    fn same_record(&self, other: &SsdEntry) -> bool {
        Arc::ptr_eq(&self.file, &other.file) && self.offset == other.offset
    }
}

struct Segment {
    file: Arc<SegmentFile>,
    len: u64,
    keys: Vec<Arc<str>>,
}

struct DirState {
    path: PathBuf,
    segments: VecDeque<Segment>,
    next_id: u32,
    bytes: u64,
    capacity: u64,
    /// A write here failed for lack of disk space: the next append compacts every segment with
    /// dead bytes first.
    full: bool,
}

/// Byte and record counters of the tier, updated once per call.
#[derive(Debug, Default)]
pub struct SsdCounters {
    /// Bytes read from the files.
    pub bytes_read: AtomicU64,
    /// Bytes written to the files.
    pub bytes_written: AtomicU64,
    /// Torn tails truncated at open.
    pub torn_dropped: AtomicU64,
    /// Damaged records found at open (payload or header checksum failed); their keys read
    /// `Corrupt`, or are gone when the header could not name them.
    pub corrupt_records: AtomicU64,
    /// Segments compacted and deleted.
    pub segments_compacted: AtomicU64,
    /// Bytes rewritten by compaction.
    pub compaction_written: AtomicU64,
    /// Segment bytes deleted by compaction.
    pub compaction_freed: AtomicU64,
    /// Records refused for lack of space.
    pub no_space: AtomicU64,
}

struct Signal {
    work: bool,
    shutdown: bool,
}

/// The shared state of the log (what the background compactor also uses).
pub struct LogCore {
    dirs: Vec<Mutex<DirState>>,
    index: RwLock<HashMap<Arc<str>, SsdEntry>>,
    seq: AtomicU64,
    io: IoEngine,
    opts: SsdOptions,
    counters: SsdCounters,
    signal: Mutex<Signal>,
    wake: Condvar,
    compacting: Mutex<()>,
}

/// The SSD tier: the log and its background compactor.
pub struct SsdLog {
    core: Arc<LogCore>,
    compactor: Option<std::thread::JoinHandle<()>>,
}

impl std::ops::Deref for SsdLog {
    type Target = LogCore;
    fn deref(&self) -> &LogCore {
        &self.core
    }
}

impl Drop for SsdLog {
    fn drop(&mut self) {
        self.core.signal.lock().shutdown = true;
        self.core.wake.notify_all();
        if let Some(t) = self.compactor.take() {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for SsdLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SsdLog")
            .field("dirs", &self.opts.dirs)
            .field("io", &self.io.name())
            .finish()
    }
}

/// One object to append: its key, size, depth hint and version.
#[derive(Debug, Clone, Copy)]
pub struct AppendItem<'a> {
    /// Key.
    pub key: &'a str,
    /// Payload length.
    pub len: u64,
    /// Depth hint.
    pub depth: u32,
    /// Sequence number (the object's version): the index keeps the highest per key.
    pub seq: u64,
}

/// A span of payload blocks of one record to read into staging.
#[derive(Debug, Clone, Copy)]
pub struct ReadSpan {
    /// Position of the record in the caller's entry list.
    pub entry: usize,
    /// First payload block.
    pub first_block: u64,
    /// Number of blocks.
    pub blocks: u64,
    /// Where the blocks land in staging.
    pub staging_offset: u64,
}

fn segment_path(dir: &Path, id: u32) -> PathBuf {
    dir.join(format!("seg-{id:08}.log"))
}

fn parse_segment_id(name: &str) -> Option<u32> {
    name.strip_prefix("seg-")?.strip_suffix(".log")?.parse().ok()
}

fn invalid(context: String, detail: &str) -> StoreError {
    StoreError::io(
        context,
        std::io::Error::new(std::io::ErrorKind::InvalidData, detail.to_owned()),
    )
}

/// fsync of a directory, so file creations and deletions in it survive power loss.
fn sync_dir(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::io(format!("fsync directory {}", path.display()), e))
}

/// Bytes available to unprivileged users on the filesystem of `path`.
fn fs_available(path: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| invalid(format!("statvfs {}", path.display()), "path contains a NUL byte"))?;
    // SAFETY: statvfs only writes into the zeroed struct we pass, and `c` is a valid C string.
    let (rc, st) = unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        (libc::statvfs(c.as_ptr(), &mut st), st)
    };
    if rc != 0 {
        return Err(StoreError::io(
            format!("statvfs {}", path.display()),
            std::io::Error::last_os_error(),
        ));
    }
    // The field types differ between platforms (u32 on some 32-bit targets).
    #[allow(clippy::unnecessary_cast)]
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// True for write errors that mean the disk (or a quota) is full.
fn is_no_space(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOSPC) | Some(libc::EFBIG) | Some(libc::EDQUOT)
    )
}

impl LogCore {
    /// The I/O engine in use (`uring` or `psync`).
    pub fn io_engine(&self) -> &'static str {
        self.io.name()
    }

    /// True when every segment file was opened with O_DIRECT.
    pub fn direct_io(&self) -> bool {
        self.dirs
            .iter()
            .all(|d| d.lock().segments.iter().all(|s| s.file.direct))
    }

    /// Byte and record counters.
    pub fn counters(&self) -> &SsdCounters {
        &self.counters
    }

    /// Number of live keys.
    pub fn len(&self) -> usize {
        self.index.read().len()
    }

    /// True when no key is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of segment files over all directories.
    pub fn file_bytes(&self) -> u64 {
        self.dirs.iter().map(|d| d.lock().bytes).sum()
    }

    /// Bytes the directories may hold together.
    pub fn capacity(&self) -> u64 {
        self.dirs.iter().map(|d| d.lock().capacity).sum()
    }

    /// The index, read-locked: resolve a whole batch under one shared lock.
    pub fn index(&self) -> RwLockReadGuard<'_, HashMap<Arc<str>, SsdEntry>> {
        self.index.read()
    }

    /// True if `key` is stored.
    pub fn contains(&self, key: &str) -> bool {
        self.index.read().contains_key(key)
    }

    /// A new sequence number (object version), above every one in the log.
    pub fn next_seq(&self) -> u64 {
        self.next_seqs(1).start
    }

    /// `n` new sequence numbers at once (one atomic add for a whole batch).
    pub fn next_seqs(&self, n: u64) -> std::ops::Range<u64> {
        let first = self.seq.fetch_add(n, Ordering::Relaxed);
        first..first + n
    }

    /// Rewrites the header of `e` with the dead flag (a damaged header is zeroed instead). The
    /// caller holds the lock of the record's directory, or is the open scan.
    fn mark_dead(&self, e: &SsdEntry) -> Result<()> {
        self.mark(e, FLAG_DEAD)
    }

    /// Rewrites the header of `e` with `flag` ([`FLAG_DEAD`], or [`FLAG_VOID`] for a surplus copy
    /// of a version another record holds); a damaged header is zeroed instead. The caller holds
    /// the lock of the record's directory, or is the open scan.
    fn mark(&self, e: &SsdEntry, flag: u32) -> Result<()> {
        let what = if flag == FLAG_VOID { "void" } else { "dead" };
        let ctx = || format!("mark a record of segment {} {what}", e.file.id);
        let mut buf = AlignedBuf::new(e.header_len as usize);
        if !e.damaged {
            self.read_at(&e.file, e.offset, e.header_len as usize, &mut buf)
                .map_err(|err| StoreError::io(ctx(), err))?;
            let Some(h) = decode_header(&buf.as_slice()[..e.header_len as usize]) else {
                return Err(invalid(ctx(), "the header no longer decodes"));
            };
            let f = HeaderFields {
                flags: h.flags | flag,
                seq: h.seq,
                payload_len: h.payload_len,
                depth: h.depth,
                key: &h.key,
                block_crcs: &h.block_crcs,
            };
            encode_header(&f, &mut buf.as_mut_slice()[..e.header_len as usize]);
        }
        let op = IoOp {
            fd: fd(&e.file.file),
            offset: e.offset,
            buf: buf.as_mut_ptr(),
            len: if e.damaged {
                BLOCK as usize
            } else {
                e.header_len as usize
            },
            write: true,
        };
        self.io.run(&[op]).map_err(|(_, err)| StoreError::io(ctx(), err))
    }

    /// Takes `key` out of the index (no I/O); the record must then be passed to
    /// [`LogCore::retire`]. Lets the store remove a key from both tiers atomically.
    pub fn unpublish(&self, key: &str) -> Option<SsdEntry> {
        let old = self.index.write().remove(key)?;
        old.file.live.fetch_sub(old.record_len(), Ordering::Relaxed);
        Some(old)
    }

    /// Marks an unpublished record dead on disk.
    pub fn retire(&self, old: &SsdEntry) -> Result<()> {
        let guard = self.dirs[old.file.dir as usize].lock();
        let r = self.mark_dead(old);
        drop(guard);
        if r.is_ok() {
            self.counters.bytes_written.fetch_add(old.header_len, Ordering::Relaxed);
        }
        self.wake_compactor();
        r
    }

    /// Removes `key`; its record is marked dead on disk before this returns. False if absent.
    pub fn remove(&self, key: &str) -> Result<bool> {
        let Some(old) = self.unpublish(key) else {
            return Ok(false);
        };
        self.retire(&old)?;
        Ok(true)
    }

    /// Makes every acknowledged write durable: fsyncs every segment file and every directory.
    pub fn sync(&self) -> Result<()> {
        for d in &self.dirs {
            let state = d.lock();
            for s in &state.segments {
                s.file
                    .file
                    .sync_data()
                    .map_err(|e| StoreError::io(format!("fsync segment {}", s.file.id), e))?;
            }
            sync_dir(&state.path)?;
        }
        Ok(())
    }
}

fn clone_io(e: &std::io::Error) -> std::io::Error {
    match e.raw_os_error() {
        Some(code) => std::io::Error::from_raw_os_error(code),
        None => std::io::Error::new(e.kind(), e.to_string()),
    }
}

#[cfg(test)]
mod tests;
