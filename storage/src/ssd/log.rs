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
//! thread, a bounded chunk at a time, and is then deleted. When a put does not fit under the
//! directory's capacity, segments with dead bytes are compacted at once; if it still does not fit
//! the put fails with `NoSpace`.
//!
//! This module moves bytes between files and caller-provided staging memory; the store moves them
//! between staging and caller buffers through the transfer engine.

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
    header_len, payload_blocks, peek_header_len, record_len, HeaderFields, BLOCK, FLAG_DEAD,
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

/// What the open scan collected over all segments.
#[derive(Default)]
struct Scan {
    /// Per key, the record with the highest sequence number seen and whether it is dead.
    best: HashMap<Arc<str>, (SsdEntry, bool)>,
    /// Keys named by damaged headers (used when the key has no valid record at all).
    damaged: HashMap<Arc<str>, SsdEntry>,
    /// Live records that lost to a newer (or dead) record: marked dead after the scan.
    stale: Vec<SsdEntry>,
    max_seq: u64,
}

impl Scan {
    fn record(&mut self, key: Arc<str>, entry: SsdEntry, dead: bool) {
        self.max_seq = self.max_seq.max(entry.seq);
        match self.best.get_mut(&key) {
            None => {
                self.best.insert(key, (entry, dead));
            }
            Some((cur, cur_dead)) => {
                let wins = entry.seq > cur.seq || (entry.seq == cur.seq && dead && !*cur_dead);
                if wins {
                    let old = std::mem::replace(cur, entry);
                    if !*cur_dead {
                        self.stale.push(old);
                    }
                    *cur_dead = dead;
                } else if !dead {
                    self.stale.push(entry);
                }
            }
        }
    }
}

/// What one position of a segment holds.
enum Found {
    /// A record with a valid header: its length, and whether its payload failed its CRCs with
    /// non-zero bytes (corrupt) or only in all-zero blocks (a torn write).
    Record {
        header: super::record::Header,
        rec_len: u64,
        payload: PayloadCheck,
    },
    /// A header that failed its CRC but whose payload matches the CRCs it claims, or that a
    /// valid record follows: a damaged header, not a torn write.
    DamagedHeader { key: String, seq: u64, rec_len: u64 },
    /// Not a record start, or a torn record.
    Bad,
}

#[derive(PartialEq, Eq)]
enum PayloadCheck {
    Intact,
    Corrupt,
    Torn,
}

impl SsdLog {
    /// Opens the log in `opts.dirs` (created if missing), rebuilding the index from the records
    /// found; torn tails of each directory's last segment are truncated (and synced). A read
    /// error fails the open with a typed error and changes nothing on disk.
    pub fn open(opts: SsdOptions) -> Result<Self> {
        if let Some(d) = opts.dirs.iter().find(|d| d.as_os_str().is_empty()) {
            return Err(StoreError::Engine(te_base::Error::config(
                "UMBP_SSD_DIRS",
                format!("{d:?}"),
                "a directory path is empty",
            )));
        }
        if opts.dirs.is_empty() || opts.dirs.len() > u16::MAX as usize {
            return Err(StoreError::Engine(te_base::Error::config(
                "UMBP_SSD_DIRS",
                format!("{} directories", opts.dirs.len()),
                "need 1..=65535 directories",
            )));
        }
        let io = IoEngine::new(opts.io)?;
        let mut core = LogCore {
            dirs: Vec::with_capacity(opts.dirs.len()),
            index: RwLock::new(HashMap::new()),
            seq: AtomicU64::new(1),
            io,
            counters: SsdCounters::default(),
            opts,
            signal: Mutex::new(Signal {
                work: false,
                shutdown: false,
            }),
            wake: Condvar::new(),
            compacting: Mutex::new(()),
        };
        let mut scan = Scan::default();
        let mut states = Vec::with_capacity(core.opts.dirs.len());
        for (d, path) in core.opts.dirs.clone().iter().enumerate() {
            std::fs::create_dir_all(path).map_err(|e| StoreError::io(format!("create {}", path.display()), e))?;
            states.push(core.scan_dir(d as u16, path, &mut scan)?);
        }
        let n = states.len() as u64;
        for (state, path) in states.iter_mut().zip(&core.opts.dirs) {
            // What the filesystem can give, less the headroom compaction needs to rewrite live
            // records: the default, and the most an explicit capacity gets.
            let avail = fs_available(path)?;
            let fits = (avail.saturating_add(state.bytes) as f64 * DEFAULT_CAPACITY_FRACTION) as u64;
            state.capacity = match core.opts.capacity {
                Some(c) if c / n > fits => {
                    tracing::warn!(
                        "{}: UMBP_SSD_CAPACITY share of {} bytes exceeds what the filesystem can give ({fits}); using {fits}",
                        path.display(),
                        c / n
                    );
                    fits
                }
                Some(c) => (c / n).max(BLOCK),
                None => fits,
            };
        }
        core.dirs = states.into_iter().map(Mutex::new).collect();
        let next = scan
            .max_seq
            .checked_add(1)
            .ok_or_else(|| invalid("open the SSD log".into(), "sequence numbers exhausted"))?;
        core.seq.store(next, Ordering::Relaxed);
        let Scan {
            best, damaged, stale, ..
        } = scan;
        {
            let mut index = core.index.write();
            let named: std::collections::HashSet<Arc<str>> = best.keys().cloned().collect();
            for (k, (e, dead)) in best {
                if !dead {
                    index.insert(k, e);
                }
            }
            // A damaged header names its key only when no valid record (live or dead) does.
            for (k, e) in damaged {
                if !named.contains(&k) {
                    index.insert(k, e);
                }
            }
            for e in index.values() {
                e.file.live.fetch_add(e.record_len(), Ordering::Relaxed);
            }
        }
        // Records that lost to a newer or dead record (a crash between writing a record and
        // marking the one it replaced) are marked dead now, so no later removal can expose them.
        for e in &stale {
            core.mark_dead(e)?;
        }
        let core = Arc::new(core);
        let bg = core.clone();
        let compactor = std::thread::Builder::new()
            .name("umbp-compact".into())
            .spawn(move || bg.compactor_loop())
            .map_err(|e| StoreError::io("start the SSD compactor", e))?;
        Ok(SsdLog {
            core,
            compactor: Some(compactor),
        })
    }
}

impl LogCore {
    fn scan_dir(&self, d: u16, path: &Path, scan: &mut Scan) -> Result<DirState> {
        let mut ids: Vec<u32> = std::fs::read_dir(path)
            .map_err(|e| StoreError::io(format!("list {}", path.display()), e))?
            .filter_map(|e| e.ok())
            .filter_map(|e| parse_segment_id(&e.file_name().to_string_lossy()))
            .collect();
        ids.sort_unstable();
        let mut state = DirState {
            path: path.to_owned(),
            segments: VecDeque::new(),
            next_id: match ids.last() {
                None => 0,
                Some(&i) => i
                    .checked_add(1)
                    .ok_or_else(|| invalid(format!("open {}", path.display()), "segment ids exhausted"))?,
            },
            bytes: 0,
            capacity: 0,
            full: false,
        };
        let mut buf = AlignedBuf::new(1 << 20);
        let last = ids.last().copied();
        for id in ids {
            let p = segment_path(path, id);
            let (file, direct) = open_segment(&p, self.opts.direct, false)?;
            let file = Arc::new(SegmentFile {
                file,
                dir: d,
                id,
                direct,
                live: AtomicU64::new(0),
            });
            let seg = self.scan_segment(&file, &p, Some(id) == last, &mut buf, scan)?;
            state.bytes += seg.len;
            state.segments.push_back(seg);
        }
        Ok(state)
    }

    /// Reads `len` bytes at `offset` into `buf` (grown as needed).
    fn read_at(&self, file: &SegmentFile, offset: u64, len: usize, buf: &mut AlignedBuf) -> std::io::Result<()> {
        if buf.len() < len {
            *buf = AlignedBuf::new(len);
        }
        let op = IoOp {
            fd: fd(&file.file),
            offset,
            buf: buf.as_mut_ptr(),
            len,
            write: false,
        };
        self.io.run(&[op]).map_err(|(_, e)| e)
    }

    /// Reads the header starting at `offset` (a block boundary with at least one block left)
    /// into `buf` when its first block names a plausible header that ends inside the file:
    /// its length, or `None`.
    fn read_header(
        &self,
        file: &SegmentFile,
        p: &Path,
        offset: u64,
        file_len: u64,
        buf: &mut AlignedBuf,
    ) -> Result<Option<u64>> {
        let rd = |e| StoreError::io(format!("read {} at offset {offset}", p.display()), e);
        self.read_at(file, offset, BLOCK as usize, buf).map_err(rd)?;
        let Some(hl) = peek_header_len(&buf.as_slice()[..BLOCK as usize]) else {
            return Ok(None);
        };
        if offset.checked_add(hl).is_none_or(|e| e > file_len) {
            return Ok(None);
        }
        if hl > BLOCK {
            self.read_at(file, offset, hl as usize, buf).map_err(rd)?;
        }
        Ok(Some(hl))
    }

    /// Classifies what starts at `offset` (a block boundary with at least one block left).
    fn probe(&self, file: &SegmentFile, p: &Path, offset: u64, file_len: u64, buf: &mut AlignedBuf) -> Result<Found> {
        let Some(hl) = self.read_header(file, p, offset, file_len, buf)? else {
            return Ok(Found::Bad);
        };
        let bytes = &buf.as_slice()[..hl as usize];
        let (header, verified) = match decode_header(bytes) {
            Some(h) => (h, true),
            None => match decode_header_unverified(bytes) {
                Some(h) => (h, false),
                None => return Ok(Found::Bad),
            },
        };
        let Some(rec_len) = checked_record_len(hl, header.payload_len) else {
            return Ok(Found::Bad);
        };
        if offset.checked_add(rec_len).is_none_or(|e| e > file_len) {
            return Ok(Found::Bad);
        }
        if verified && header.flags & FLAG_DEAD != 0 {
            // A dead record's payload is never read again.
            return Ok(Found::Record {
                header,
                rec_len,
                payload: PayloadCheck::Intact,
            });
        }
        let payload = self.check_payload(file, p, offset + hl, &header.block_crcs, buf)?;
        Ok(match (verified, payload) {
            (true, PayloadCheck::Torn) => Found::Bad,
            (true, payload) => Found::Record {
                header,
                rec_len,
                payload,
            },
            // A damaged header over a payload that matches what it claims, or followed by a valid
            // record (so it is no torn tail): its key reads Corrupt.
            (false, check)
                if check == PayloadCheck::Intact
                    || self.valid_record_at(file, p, offset + rec_len, file_len, buf)? =>
            {
                Found::DamagedHeader {
                    key: header.key,
                    seq: header.seq,
                    rec_len,
                }
            }
            (false, _) => Found::Bad,
        })
    }

    /// True when a record with a valid header starts at `offset`.
    fn valid_record_at(
        &self,
        file: &SegmentFile,
        p: &Path,
        offset: u64,
        file_len: u64,
        buf: &mut AlignedBuf,
    ) -> Result<bool> {
        if offset.checked_add(BLOCK).is_none_or(|e| e > file_len) {
            return Ok(false);
        }
        Ok(self
            .read_header(file, p, offset, file_len, buf)?
            .is_some_and(|hl| decode_header(&buf.as_slice()[..hl as usize]).is_some()))
    }

    fn check_payload(
        &self,
        file: &SegmentFile,
        p: &Path,
        at: u64,
        expected: &[u32],
        buf: &mut AlignedBuf,
    ) -> Result<PayloadCheck> {
        const CHUNK_BLOCKS: usize = 256;
        let mut crcs = Vec::with_capacity(CHUNK_BLOCKS);
        let mut outcome = PayloadCheck::Intact;
        for (c, want) in expected.chunks(CHUNK_BLOCKS).enumerate() {
            let len = want.len() * BLOCK as usize;
            let off = at + (c * CHUNK_BLOCKS) as u64 * BLOCK;
            self.read_at(file, off, len, buf)
                .map_err(|e| StoreError::io(format!("read {} at offset {off}", p.display()), e))?;
            let bytes = &buf.as_slice()[..len];
            block_crcs(bytes, &mut crcs);
            for (b, (got, want)) in crcs.iter().zip(want).enumerate() {
                if got != want {
                    let block = &bytes[b * BLOCK as usize..(b + 1) * BLOCK as usize];
                    if block.iter().any(|&x| x != 0) {
                        return Ok(PayloadCheck::Corrupt);
                    }
                    outcome = PayloadCheck::Torn;
                }
            }
        }
        Ok(outcome)
    }

    /// The next block boundary at or after `from` whose block starts with the record magic.
    fn next_magic(&self, file: &SegmentFile, p: &Path, from: u64, file_len: u64, buf: &mut AlignedBuf) -> Result<u64> {
        const WINDOW: u64 = 1 << 20;
        let mut at = from;
        while at + BLOCK <= file_len {
            let n = WINDOW.min((file_len - at) / BLOCK * BLOCK);
            self.read_at(file, at, n as usize, buf)
                .map_err(|e| StoreError::io(format!("read {} at offset {at}", p.display()), e))?;
            if let Some(b) = buf.as_slice()[..n as usize].chunks(BLOCK as usize).position(has_magic) {
                return Ok(at + b as u64 * BLOCK);
            }
            at += n;
        }
        Ok(file_len)
    }

    fn scan_segment(
        &self,
        file: &Arc<SegmentFile>,
        p: &Path,
        is_last: bool,
        buf: &mut AlignedBuf,
        scan: &mut Scan,
    ) -> Result<Segment> {
        let file_len = file
            .file
            .metadata()
            .map_err(|e| StoreError::io(format!("stat {}", p.display()), e))?
            .len();
        let mut seg = Segment {
            file: file.clone(),
            len: 0,
            keys: Vec::new(),
        };
        let mut offset = 0u64;
        // Start of a damaged region with no valid record after it (yet).
        let mut bad_from: Option<u64> = None;
        let mut damaged: Vec<(Arc<str>, SsdEntry)> = Vec::new();
        let mut corrupt = 0u64;
        while offset.checked_add(BLOCK).is_some_and(|e| e <= file_len) {
            match self.probe(file, p, offset, file_len, buf)? {
                Found::Record {
                    header,
                    rec_len,
                    payload,
                } => {
                    bad_from = None;
                    if payload == PayloadCheck::Corrupt {
                        tracing::warn!("{}: record at offset {offset} failed its payload CRC", p.display());
                        corrupt += 1;
                    }
                    let key: Arc<str> = Arc::from(header.key.as_str());
                    let dead = header.flags & FLAG_DEAD != 0;
                    let entry = SsdEntry {
                        file: file.clone(),
                        offset,
                        header_len: header.header_len,
                        seq: header.seq,
                        payload_len: header.payload_len,
                        depth: header.depth,
                        crcs: header.block_crcs.into(),
                        damaged: false,
                    };
                    seg.keys.push(key.clone());
                    scan.record(key, entry, dead);
                    offset += rec_len;
                }
                Found::DamagedHeader { key, seq, rec_len } => {
                    bad_from = None;
                    tracing::warn!(
                        "{}: record of {key:?} at offset {offset} has a damaged header",
                        p.display()
                    );
                    corrupt += 1;
                    let key: Arc<str> = Arc::from(key.as_str());
                    seg.keys.push(key.clone());
                    damaged.push((
                        key,
                        SsdEntry {
                            file: file.clone(),
                            offset,
                            header_len: BLOCK,
                            seq,
                            payload_len: 0,
                            depth: 0,
                            crcs: Arc::from(Vec::new()),
                            damaged: true,
                        },
                    ));
                    offset += rec_len;
                }
                Found::Bad => {
                    bad_from.get_or_insert(offset);
                    offset = self.next_magic(file, p, offset + BLOCK, file_len, buf)?;
                }
            }
        }
        if offset < file_len {
            bad_from.get_or_insert(offset);
        }
        for (k, e) in damaged {
            scan.damaged.entry(k).or_insert(e);
        }
        let c = &self.counters;
        c.corrupt_records.fetch_add(corrupt, Ordering::Relaxed);
        seg.len = file_len;
        if let Some(t) = bad_from {
            if is_last {
                tracing::warn!(
                    "{}: dropping a torn tail of {} byte(s) at offset {t}",
                    p.display(),
                    file_len - t
                );
                c.torn_dropped.fetch_add(1, Ordering::Relaxed);
                file.file
                    .set_len(t)
                    .and_then(|()| file.file.sync_all())
                    .map_err(|e| StoreError::io(format!("truncate {}", p.display()), e))?;
                seg.len = t;
            } else {
                tracing::warn!(
                    "{}: {} byte(s) from offset {t} hold no valid record; kept until compaction",
                    p.display(),
                    file_len - t
                );
                c.corrupt_records.fetch_add(1, Ordering::Relaxed);
            }
        }
        // The next append starts on a block boundary.
        if !seg.len.is_multiple_of(BLOCK) {
            seg.len = align_up(seg.len);
        }
        Ok(seg)
    }

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

    /// The directory a key's records go to.
    fn dir_of(&self, key: &str) -> usize {
        crc32c::crc32c(key.as_bytes()) as usize % self.dirs.len()
    }

    /// Appends one record per item, its payload taken from memory `payloads[i]` (extents in
    /// object order). Checksums every block, writes each directory's records while holding that
    /// directory's lock (one lock each, in order), then publishes each record whose sequence
    /// number is above the indexed one and marks the records it replaces (or a record that lost
    /// to a newer one) dead. Per-item results: `Ok` when the record is written (published, or
    /// already superseded by a newer version), `NoSpace` when it does not fit.
    ///
    /// # Safety
    ///
    /// Every payload extent must be 4 KiB-aligned and readable, rounded up to whole 4 KiB blocks
    /// (the bytes past the object are written as padding), and unchanged until this returns.
    pub unsafe fn append(&self, items: &[AppendItem<'_>], payloads: &[&[Extent]]) -> Vec<Result<()>> {
        let mut results: Vec<Result<()>> = (0..items.len()).map(|_| Ok(())).collect();
        // Headers of the whole call in one aligned buffer.
        let mut header_at = Vec::with_capacity(items.len());
        let mut total = 0u64;
        for it in items {
            header_at.push(total);
            total += header_len(it.key.len(), it.len);
        }
        let mut headers = AlignedBuf::new(total as usize);
        let mut all_crcs: Vec<Arc<[u32]>> = Vec::with_capacity(items.len());
        let mut crcs = Vec::new();
        for (i, it) in items.iter().enumerate() {
            crcs.clear();
            let mut left = align_up(it.len);
            for e in payloads[i] {
                let n = align_up(e.len).min(left);
                // SAFETY: per the contract the extent is readable rounded up to whole blocks.
                let bytes = unsafe { std::slice::from_raw_parts(e.addr as *const u8, n as usize) };
                crcs.extend(bytes.chunks(BLOCK as usize).map(crc32c::crc32c));
                left -= n;
            }
            debug_assert_eq!(left, 0);
            let f = HeaderFields {
                flags: 0,
                seq: it.seq,
                payload_len: it.len,
                depth: it.depth,
                key: it.key,
                block_crcs: &crcs,
            };
            let h = header_at[i] as usize;
            encode_header(
                &f,
                &mut headers.as_mut_slice()[h..h + header_len(it.key.len(), it.len) as usize],
            );
            all_crcs.push(crcs.as_slice().into());
        }
        let mut by_dir: Vec<Vec<usize>> = vec![Vec::new(); self.dirs.len()];
        for (i, it) in items.iter().enumerate() {
            by_dir[self.dir_of(it.key)].push(i);
        }
        let mut guards: Vec<(usize, MutexGuard<'_, DirState>)> = by_dir
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.is_empty())
            .map(|(d, _)| (d, self.dirs[d].lock()))
            .collect();
        let mut ops: Vec<IoOp> = Vec::new();
        let mut op_item: Vec<usize> = Vec::new();
        let mut placement: Vec<Option<(Arc<SegmentFile>, u64)>> = vec![None; items.len()];
        let hbase = headers.as_mut_ptr();
        for (d, state) in guards.iter_mut() {
            let st: &mut DirState = state;
            let need: u64 = by_dir[*d]
                .iter()
                .map(|&i| record_len(items[i].key.len(), items[i].len))
                .sum();
            if st.bytes + need > st.capacity || st.full {
                let all = std::mem::take(&mut st.full);
                if let Err(e) = self.compact_locked(st, need, all) {
                    tracing::warn!("compaction to make room failed: {e}");
                }
            }
            for &i in &by_dir[*d] {
                let it = &items[i];
                let rl = record_len(it.key.len(), it.len);
                if st.bytes + rl > st.capacity {
                    self.counters.no_space.fetch_add(1, Ordering::Relaxed);
                    results[i] = Err(StoreError::NoSpace {
                        key: it.key.to_owned(),
                        len: it.len,
                    });
                    continue;
                }
                if let Err(e) = self.make_active(st, *d as u16, rl) {
                    results[i] = Err(e);
                    continue;
                }
                let seg = st.segments.back_mut().expect("active segment");
                let at = seg.len;
                let hl = header_len(it.key.len(), it.len);
                ops.push(IoOp {
                    fd: fd(&seg.file.file),
                    offset: at,
                    // SAFETY: inside the headers buffer, which lives until the end of this call.
                    buf: unsafe { hbase.add(header_at[i] as usize) },
                    len: hl as usize,
                    write: true,
                });
                op_item.push(i);
                let mut off = at + hl;
                let mut left = align_up(it.len);
                for e in payloads[i] {
                    let n = align_up(e.len).min(left);
                    ops.push(IoOp {
                        fd: fd(&seg.file.file),
                        offset: off,
                        buf: e.addr as *mut u8,
                        len: n as usize,
                        write: true,
                    });
                    op_item.push(i);
                    off += n;
                    left -= n;
                }
                // The segment grows now so the next record goes after this one; a failed write
                // rolls it back below.
                seg.len += rl;
                seg.keys.push(Arc::from(it.key));
                st.bytes += rl;
                placement[i] = Some((seg.file.clone(), at));
            }
        }
        if let Err((bad, e)) = self.io.run(&ops) {
            self.roll_back(
                items,
                &mut guards,
                &by_dir,
                &op_item[bad..],
                &mut placement,
                &mut results,
                &e,
            );
        }
        let mut written = 0u64;
        let mut retire: Vec<SsdEntry> = Vec::new();
        {
            let mut index = self.index.write();
            for (i, it) in items.iter().enumerate() {
                let Some((file, offset)) = placement[i].take() else {
                    continue;
                };
                let rl = record_len(it.key.len(), it.len);
                written += rl;
                let entry = SsdEntry {
                    file,
                    offset,
                    header_len: header_len(it.key.len(), it.len),
                    seq: it.seq,
                    payload_len: it.len,
                    depth: it.depth,
                    crcs: all_crcs[i].clone(),
                    damaged: false,
                };
                match index.get(it.key) {
                    Some(cur) if !cur.damaged && cur.seq >= it.seq => retire.push(entry),
                    _ => {
                        entry.file.live.fetch_add(rl, Ordering::Relaxed);
                        if let Some(old) = index.insert(Arc::from(it.key), entry) {
                            old.file.live.fetch_sub(old.record_len(), Ordering::Relaxed);
                            retire.push(old);
                        }
                    }
                }
            }
        }
        // Still under the directory locks: the compactor never copies a record while its
        // replacement is being marked dead.
        for e in &retire {
            match self.mark_dead(e) {
                Ok(()) => written += e.record_len().min(e.header_len),
                Err(err) => tracing::warn!("could not mark a replaced record dead: {err}"),
            }
        }
        drop(guards);
        self.counters.bytes_written.fetch_add(written, Ordering::Relaxed);
        if !retire.is_empty() {
            self.wake_compactor();
        }
        results
    }

    /// After a failed write: everything from the first failed op on is treated as not written;
    /// each directory with a failed record is cut back (and its file truncated) to before it, so
    /// no segment holds a hole.
    #[allow(clippy::too_many_arguments)]
    fn roll_back(
        &self,
        items: &[AppendItem<'_>],
        guards: &mut [(usize, MutexGuard<'_, DirState>)],
        by_dir: &[Vec<usize>],
        failed_ops: &[usize],
        placement: &mut [Option<(Arc<SegmentFile>, u64)>],
        results: &mut [Result<()>],
        e: &std::io::Error,
    ) {
        let full = is_no_space(e);
        let fail = |i: usize| {
            if full {
                StoreError::NoSpace {
                    key: items[i].key.to_owned(),
                    len: items[i].len,
                }
            } else {
                StoreError::io("write to the SSD log", clone_io(e))
            }
        };
        for &i in failed_ops {
            if results[i].is_ok() {
                results[i] = Err(fail(i));
            }
        }
        for (d, state) in guards.iter_mut() {
            let Some((first_bad, cut)) = by_dir[*d]
                .iter()
                .copied()
                .filter(|&i| results[i].is_err())
                .filter_map(|i| placement[i].as_ref().map(|p| (i, p.1)))
                .min_by_key(|&(_, at)| at)
            else {
                continue;
            };
            let file = placement[first_bad].as_ref().expect("placed").0.clone();
            for &i in &by_dir[*d] {
                let later = placement[i]
                    .as_ref()
                    .is_some_and(|(f, at)| f.id >= file.id && (!Arc::ptr_eq(f, &file) || *at >= cut));
                if later {
                    if results[i].is_ok() {
                        results[i] = Err(fail(i));
                    }
                    placement[i] = None;
                }
            }
            let st: &mut DirState = state;
            st.full |= full;
            // Later segments created by this batch hold nothing valid now: empty them too.
            for seg in st.segments.iter_mut().filter(|s| s.file.id >= file.id) {
                let new_len = if Arc::ptr_eq(&seg.file, &file) { cut } else { 0 };
                if seg.len > new_len {
                    st.bytes -= seg.len - new_len;
                    seg.len = new_len;
                    if let Err(err) = seg.file.file.set_len(new_len) {
                        tracing::warn!("could not cut back segment {} after a failed write: {err}", seg.file.id);
                    }
                }
            }
        }
        if full {
            self.counters
                .no_space
                .fetch_add(failed_ops.len() as u64, Ordering::Relaxed);
            self.wake_compactor();
        }
    }

    /// Makes sure the directory's last segment can take `rl` more bytes, starting a new one when
    /// it is full.
    fn make_active(&self, st: &mut DirState, d: u16, rl: u64) -> Result<()> {
        let full = st
            .segments
            .back()
            .is_none_or(|s| s.len > 0 && s.len + rl > self.opts.segment_bytes);
        if full {
            self.rotate(st, d)?;
        }
        Ok(())
    }

    fn rotate(&self, st: &mut DirState, d: u16) -> Result<()> {
        let id = st.next_id;
        let next = id
            .checked_add(1)
            .ok_or_else(|| invalid(format!("new segment in {}", st.path.display()), "segment ids exhausted"))?;
        let (file, direct) = open_segment(&segment_path(&st.path, id), self.opts.direct, true)?;
        sync_dir(&st.path)?;
        st.next_id = next;
        st.segments.push_back(Segment {
            file: Arc::new(SegmentFile {
                file,
                dir: d,
                id,
                direct,
                live: AtomicU64::new(0),
            }),
            len: 0,
            keys: Vec::new(),
        });
        Ok(())
    }

    /// Rewrites the header of `e` with the dead flag (a damaged header is zeroed instead). The
    /// caller holds the lock of the record's directory, or is the open scan.
    fn mark_dead(&self, e: &SsdEntry) -> Result<()> {
        let ctx = || format!("mark a record of segment {} dead", e.file.id);
        let mut buf = AlignedBuf::new(e.header_len as usize);
        if !e.damaged {
            self.read_at(&e.file, e.offset, e.header_len as usize, &mut buf)
                .map_err(|err| StoreError::io(ctx(), err))?;
            let Some(h) = decode_header(&buf.as_slice()[..e.header_len as usize]) else {
                return Err(invalid(ctx(), "the header no longer decodes"));
            };
            let f = HeaderFields {
                flags: h.flags | FLAG_DEAD,
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

    /// Appends to `spans` the block spans of `entry` that cover the object ranges
    /// `(offset, len)` of `ranges` (sorted by offset or not; adjacent spans merge), placing them
    /// in staging from `*staging_cursor` on. Returns the staging offset of each range's first
    /// byte through `range_staging`.
    pub fn plan_ranges(
        entry_pos: usize,
        ranges: impl Iterator<Item = (u64, u64)>,
        spans: &mut Vec<ReadSpan>,
        staging_cursor: &mut u64,
        range_staging: &mut Vec<u64>,
    ) {
        let first_span = spans.len();
        for (offset, len) in ranges {
            let fb = offset / BLOCK;
            let lb = (offset + len - 1) / BLOCK;
            // Reuse a span of this entry that already holds the blocks, or extends to them.
            let mut placed = None;
            if let Some(s) = spans[first_span..].last_mut() {
                let s_end = s.first_block + s.blocks;
                if fb >= s.first_block && fb <= s_end {
                    if lb >= s_end {
                        let grow = lb + 1 - s_end;
                        s.blocks += grow;
                        *staging_cursor += grow * BLOCK;
                    }
                    placed = Some(s.staging_offset + (offset - s.first_block * BLOCK));
                }
            }
            let at = placed.unwrap_or_else(|| {
                let blocks = lb + 1 - fb;
                spans.push(ReadSpan {
                    entry: entry_pos,
                    first_block: fb,
                    blocks,
                    staging_offset: *staging_cursor,
                });
                *staging_cursor += blocks * BLOCK;
                *staging_cursor - blocks * BLOCK + (offset - fb * BLOCK)
            });
            range_staging.push(at);
        }
    }

    /// Reads `spans` of `entries` into staging and verifies every block read. Per span: `Ok` or
    /// the error of its key (nothing of a failed span may be returned to a caller). Counts the
    /// bytes read once.
    ///
    /// # Safety
    ///
    /// `staging` must be valid for writes over every span's `[staging_offset, +blocks * 4096)`,
    /// 4 KiB-aligned, and not used by anyone else until this returns.
    pub unsafe fn read_spans(
        &self,
        keys: &[&str],
        entries: &[&SsdEntry],
        spans: &[ReadSpan],
        staging: *mut u8,
        results: &mut Vec<Result<()>>,
    ) {
        results.clear();
        let in_record = |s: &ReadSpan| {
            let e = entries[s.entry];
            !e.damaged
                && s.first_block
                    .checked_add(s.blocks)
                    .is_some_and(|end| end <= e.crcs.len() as u64)
        };
        let ops: Vec<IoOp> = spans
            .iter()
            .filter(|s| in_record(s))
            .map(|s| {
                let e = entries[s.entry];
                IoOp {
                    fd: fd(&e.file.file),
                    offset: e.block_offset(s.first_block),
                    // SAFETY: inside staging per the contract.
                    buf: unsafe { staging.add(s.staging_offset as usize) },
                    len: (s.blocks * BLOCK) as usize,
                    write: false,
                }
            })
            .collect();
        let outcome = self.io.run(&ops);
        let mut read = 0u64;
        let mut op = 0usize;
        for s in spans {
            let e = entries[s.entry];
            if !in_record(s) {
                results.push(Err(StoreError::Corrupt {
                    key: keys[s.entry].to_owned(),
                    tier: Tier::Ssd,
                    detail: "the record's header failed its CRC32C".into(),
                }));
                continue;
            }
            let k = op;
            op += 1;
            if let Err((bad, err)) = &outcome {
                // Ops from the first failure on may not have completed.
                if k >= *bad {
                    results.push(Err(StoreError::io(
                        format!("read {:?} from the SSD log", keys[s.entry]),
                        clone_io(err),
                    )));
                    continue;
                }
            }
            read += s.blocks * BLOCK;
            // SAFETY: the span was just read into staging, which the caller keeps valid.
            let bytes = unsafe {
                std::slice::from_raw_parts(staging.add(s.staging_offset as usize), (s.blocks * BLOCK) as usize)
            };
            let want = &e.crcs[s.first_block as usize..(s.first_block + s.blocks) as usize];
            let bad_block = bytes
                .chunks(BLOCK as usize)
                .zip(want)
                .position(|(b, &c)| crc32c::crc32c(b) != c);
            results.push(match bad_block {
                None => Ok(()),
                Some(b) => Err(StoreError::Corrupt {
                    key: keys[s.entry].to_owned(),
                    tier: Tier::Ssd,
                    detail: format!("payload block {} failed its CRC32C", s.first_block + b as u64),
                }),
            });
        }
        self.counters.bytes_read.fetch_add(read, Ordering::Relaxed);
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

    fn wake_compactor(&self) {
        let mut s = self.signal.lock();
        if !s.work {
            s.work = true;
            drop(s);
            self.wake.notify_one();
        }
    }

    fn compactor_loop(&self) {
        loop {
            {
                let mut s = self.signal.lock();
                while !s.work && !s.shutdown {
                    self.wake.wait(&mut s);
                }
                if s.shutdown {
                    return;
                }
                s.work = false;
            }
            // Bounded: one pass over the candidates present now.
            let candidates: usize = self.dirs.iter().map(|d| d.lock().segments.len()).sum();
            for _ in 0..candidates {
                if self.signal.lock().shutdown {
                    return;
                }
                match self.compact_one(false) {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) => {
                        tracing::warn!("background compaction failed: {e}");
                        break;
                    }
                }
            }
        }
    }

    /// Compacts every sealed segment whose live fraction is below the threshold (`force`: every
    /// sealed segment with any dead byte), in the background compactor's bounded chunks. Returns
    /// the number of segments compacted.
    pub fn compact(&self, force: bool) -> Result<u64> {
        let mut n = 0;
        let limit: usize = self.dirs.iter().map(|d| d.lock().segments.len()).sum();
        for _ in 0..limit {
            if !self.compact_one(force)? {
                break;
            }
            n += 1;
        }
        Ok(n)
    }

    /// The sealed segment of `st` with the lowest live fraction that qualifies, and the keys of
    /// its records.
    fn candidate(&self, st: &DirState, force: bool) -> Option<(Arc<SegmentFile>, Vec<Arc<str>>)> {
        let sealed = st.segments.len().saturating_sub(1);
        st.segments
            .iter()
            .take(sealed)
            .filter(|s| s.len > 0)
            .filter_map(|s| {
                let live = s.file.live.load(Ordering::Relaxed);
                let f = live as f64 / s.len as f64;
                let qualifies = if force {
                    live < s.len
                } else {
                    f < self.opts.compact_below
                };
                qualifies.then_some((s, f))
            })
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(s, _)| (s.file.clone(), s.keys.clone()))
    }

    /// Compacts one candidate segment of some directory, a chunk of about
    /// [`COMPACTION_CHUNK_BYTES`] per hold of the directory lock. False when there is none.
    fn compact_one(&self, force: bool) -> Result<bool> {
        let _one = self.compacting.lock();
        for dir in &self.dirs {
            let Some((src, keys)) = self.candidate(&dir.lock(), force) else {
                continue;
            };
            let mut at = 0usize;
            while at < keys.len() {
                let mut st = dir.lock();
                if !st.segments.iter().any(|s| Arc::ptr_eq(&s.file, &src)) {
                    return Ok(true); // compacted meanwhile by a put that needed room
                }
                let mut bytes = 0u64;
                let start = at;
                {
                    let index = self.index.read();
                    while at < keys.len() && (at == start || bytes < COMPACTION_CHUNK_BYTES) {
                        bytes += index
                            .get(&keys[at])
                            .filter(|e| Arc::ptr_eq(&e.file, &src))
                            .map_or(0, |e| e.record_len());
                        at += 1;
                    }
                }
                self.move_records(&mut st, &src, &keys[start..at])?;
            }
            let mut st = dir.lock();
            if st.segments.iter().any(|s| Arc::ptr_eq(&s.file, &src)) {
                // Anything published into it between chunks (nothing is: it is sealed) moves now.
                self.move_records(&mut st, &src, &keys)?;
                self.delete_segment(&mut st, &src)?;
            }
            return Ok(true);
        }
        Ok(false)
    }

    /// Compaction while a put holds the directory lock: compacts segments with dead bytes, most
    /// dead first, until `need` more bytes fit under the capacity (`all`: every such segment, after
    /// the disk filled up) or none is left.
    fn compact_locked(&self, st: &mut DirState, need: u64, all: bool) -> Result<()> {
        let limit = st.segments.len();
        for _ in 0..limit {
            if !all && st.bytes + need <= st.capacity {
                break;
            }
            let Some((src, keys)) = self.candidate(st, true) else {
                break;
            };
            self.move_records(st, &src, &keys)?;
            self.delete_segment(st, &src)?;
        }
        Ok(())
    }

    /// Rewrites the live records of `src` among `keys` at the directory's head and repoints the
    /// index at them; a copy whose key changed meanwhile is marked dead. Damaged records are not
    /// copied (their keys then read NotFound).
    fn move_records(&self, st: &mut DirState, src: &Arc<SegmentFile>, keys: &[Arc<str>]) -> Result<()> {
        let mut live: Vec<(Arc<str>, SsdEntry)> = Vec::new();
        {
            let mut index = self.index.write();
            for k in keys {
                let Some(e) = index.get(k).filter(|e| Arc::ptr_eq(&e.file, src)) else {
                    continue;
                };
                if e.damaged {
                    index.remove(k);
                    continue;
                }
                if !live.iter().any(|(_, x)| x.same_record(e)) {
                    live.push((k.clone(), e.clone()));
                }
            }
        }
        if live.is_empty() {
            return Ok(());
        }
        let total: u64 = live.iter().map(|(_, e)| e.record_len()).sum();
        let mut buf = AlignedBuf::new(total as usize);
        let base = buf.as_mut_ptr();
        let mut reads = Vec::with_capacity(live.len());
        let mut at = 0u64;
        for (_, e) in &live {
            reads.push(IoOp {
                fd: fd(&e.file.file),
                offset: e.offset,
                // SAFETY: inside `buf`, which holds `total` bytes and outlives the I/O.
                buf: unsafe { base.add(at as usize) },
                len: e.record_len() as usize,
                write: false,
            });
            at += e.record_len();
        }
        self.io
            .run(&reads)
            .map_err(|(_, e)| StoreError::io("compaction: read live records", e))?;
        self.counters.bytes_read.fetch_add(total, Ordering::Relaxed);
        let d = src.dir;
        let mut writes = Vec::with_capacity(live.len());
        let mut placed: Vec<(Arc<SegmentFile>, u64)> = Vec::with_capacity(live.len());
        let mut at = 0u64;
        let mut failure = None;
        for (k, e) in &live {
            let rl = e.record_len();
            if let Err(err) = self.make_active(st, d, rl) {
                failure = Some(err);
                break;
            }
            let seg = st.segments.back_mut().expect("active segment");
            writes.push(IoOp {
                fd: fd(&seg.file.file),
                offset: seg.len,
                // SAFETY: as above.
                buf: unsafe { base.add(at as usize) },
                len: rl as usize,
                write: true,
            });
            placed.push((seg.file.clone(), seg.len));
            seg.len += rl;
            seg.keys.push(k.clone());
            st.bytes += rl;
            at += rl;
        }
        if failure.is_none() {
            if let Err((_, e)) = self.io.run(&writes) {
                failure = Some(StoreError::io("compaction: rewrite live records", e));
            }
        }
        if let Some(err) = failure {
            // Cut every segment this call wrote to back to where its copies started.
            for (f, off) in placed.iter().rev() {
                if let Some(seg) = st.segments.iter_mut().find(|s| Arc::ptr_eq(&s.file, f)) {
                    if seg.len > *off {
                        st.bytes -= seg.len - *off;
                        seg.len = *off;
                        if let Err(e) = seg.file.file.set_len(*off) {
                            tracing::warn!("could not cut back segment {} after a failed compaction: {e}", f.id);
                        }
                    }
                }
            }
            return Err(err);
        }
        let mut retire = Vec::new();
        {
            let mut index = self.index.write();
            for ((k, old), (file, offset)) in live.iter().zip(placed) {
                let copy = SsdEntry {
                    file,
                    offset,
                    ..old.clone()
                };
                match index.get_mut(k) {
                    Some(cur) if cur.same_record(old) => {
                        copy.file.live.fetch_add(copy.record_len(), Ordering::Relaxed);
                        old.file.live.fetch_sub(old.record_len(), Ordering::Relaxed);
                        *cur = copy;
                    }
                    _ => retire.push(copy),
                }
            }
        }
        for e in &retire {
            self.mark_dead(e)?;
        }
        let c = &self.counters;
        c.compaction_written.fetch_add(total, Ordering::Relaxed);
        c.bytes_written.fetch_add(total, Ordering::Relaxed);
        Ok(())
    }

    /// Drops a compacted segment from the directory and deletes its file (synced).
    fn delete_segment(&self, st: &mut DirState, src: &Arc<SegmentFile>) -> Result<()> {
        let Some(pos) = st.segments.iter().position(|s| Arc::ptr_eq(&s.file, src)) else {
            return Ok(());
        };
        let seg = st.segments.remove(pos).expect("position found");
        st.bytes -= seg.len;
        let path = segment_path(&st.path, seg.file.id);
        std::fs::remove_file(&path).map_err(|e| StoreError::io(format!("delete {}", path.display()), e))?;
        sync_dir(&st.path)?;
        let c = &self.counters;
        c.segments_compacted.fetch_add(1, Ordering::Relaxed);
        c.compaction_freed.fetch_add(seg.len, Ordering::Relaxed);
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
#[path = "log_tests.rs"]
mod tests;
