//! The SSD tier: a segmented log of 4 KiB-aligned records in one or more directories (one per
//! drive), an in-memory index rebuilt from the log at open, and ranged reads that fetch only the
//! payload blocks a range touches.
//!
//! Writes to one directory are serialised (its lock is held while the write runs), so a segment is
//! always a valid prefix of records followed at most by one torn record; the start-up scan keeps
//! the prefix and truncates the rest. Removing or replacing a key rewrites the old record's header
//! with the dead flag, so a later scan never resurrects it. When a directory reaches its share of
//! the capacity its oldest segment is dropped whole (this tier is a cache).
//!
//! This module moves bytes between files and caller-provided staging memory; the store moves them
//! between staging and caller buffers through the transfer engine.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock, RwLockReadGuard};

use super::aligned::AlignedBuf;
use super::io::{fd, open_segment, DirectIo, IoBackend, IoEngine, IoOp};
use super::record::{
    align_up, block_crcs, decode_header, encode_header, header_len, payload_blocks, peek_header_len, record_len,
    HeaderFields, BLOCK, FLAG_DEAD,
};
use crate::error::{Result, StoreError, Tier};
use crate::range_map::Extent;

/// Settings of the SSD tier.
#[derive(Debug, Clone)]
pub struct SsdOptions {
    /// One directory per drive.
    pub dirs: Vec<PathBuf>,
    /// Total bytes over all directories.
    pub capacity: u64,
    /// Size a segment file grows to before the next one starts.
    pub segment_bytes: u64,
    /// O_DIRECT mode.
    pub direct: DirectIo,
    /// I/O engine.
    pub io: IoBackend,
}

/// One open segment file.
#[derive(Debug)]
pub struct SegmentFile {
    file: File,
    dir: u16,
    id: u32,
    direct: bool,
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
}

impl SsdEntry {
    /// File offset of payload block `block`.
    fn block_offset(&self, block: u64) -> u64 {
        self.offset + self.header_len + block * BLOCK
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
}

/// Byte and record counters of the tier, updated once per call.
#[derive(Debug, Default)]
pub struct SsdCounters {
    /// Bytes read from the files.
    pub bytes_read: AtomicU64,
    /// Bytes written to the files.
    pub bytes_written: AtomicU64,
    /// Records dropped at open because they were torn or corrupt.
    pub torn_dropped: AtomicU64,
    /// Segments dropped to stay under the capacity.
    pub segments_evicted: AtomicU64,
}

/// The SSD tier.
pub struct SsdLog {
    dirs: Vec<Mutex<DirState>>,
    index: RwLock<HashMap<Arc<str>, SsdEntry>>,
    seq: AtomicU64,
    io: IoEngine,
    opts: SsdOptions,
    dir_capacity: u64,
    counters: SsdCounters,
}

impl std::fmt::Debug for SsdLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SsdLog")
            .field("dirs", &self.opts.dirs)
            .field("io", &self.io.name())
            .finish()
    }
}

/// One object to append: its key, size and depth hint.
#[derive(Debug, Clone, Copy)]
pub struct AppendItem<'a> {
    /// Key.
    pub key: &'a str,
    /// Payload length.
    pub len: u64,
    /// Depth hint.
    pub depth: u32,
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

impl SsdLog {
    /// Opens the log in `opts.dirs` (created if missing), rebuilding the index from the records
    /// found; torn or corrupt tails are truncated and counted.
    pub fn open(opts: SsdOptions) -> Result<Self> {
        if opts.dirs.is_empty() || opts.dirs.len() > u16::MAX as usize {
            return Err(StoreError::Engine(te_base::Error::config(
                "UMBP_SSD_DIRS",
                format!("{} directories", opts.dirs.len()),
                "need 1..=65535 directories",
            )));
        }
        let io = IoEngine::new(opts.io)?;
        let log = SsdLog {
            dirs: Vec::with_capacity(opts.dirs.len()),
            index: RwLock::new(HashMap::new()),
            seq: AtomicU64::new(1),
            io,
            dir_capacity: (opts.capacity / opts.dirs.len() as u64).max(BLOCK),
            counters: SsdCounters::default(),
            opts,
        };
        let mut log = log;
        let mut max_seq = 0u64;
        for (d, path) in log.opts.dirs.clone().iter().enumerate() {
            std::fs::create_dir_all(path).map_err(|e| StoreError::io(format!("create {}", path.display()), e))?;
            let state = log.scan_dir(d as u16, path, &mut max_seq)?;
            log.dirs.push(Mutex::new(state));
        }
        log.seq.store(max_seq + 1, Ordering::Relaxed);
        Ok(log)
    }

    fn scan_dir(&self, d: u16, path: &Path, max_seq: &mut u64) -> Result<DirState> {
        let mut ids: Vec<u32> = std::fs::read_dir(path)
            .map_err(|e| StoreError::io(format!("list {}", path.display()), e))?
            .filter_map(|e| e.ok())
            .filter_map(|e| parse_segment_id(&e.file_name().to_string_lossy()))
            .collect();
        ids.sort_unstable();
        let mut state = DirState {
            path: path.to_owned(),
            segments: VecDeque::new(),
            next_id: ids.last().map_or(0, |&i| i + 1),
            bytes: 0,
        };
        let mut buf = AlignedBuf::new(1 << 20);
        for id in ids {
            let p = segment_path(path, id);
            let (file, direct) = open_segment(&p, self.opts.direct, false)?;
            let file = Arc::new(SegmentFile {
                file,
                dir: d,
                id,
                direct,
            });
            let seg = self.scan_segment(&file, &p, &mut buf, max_seq)?;
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

    fn scan_segment(
        &self,
        file: &Arc<SegmentFile>,
        p: &Path,
        buf: &mut AlignedBuf,
        max_seq: &mut u64,
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
        let mut crcs = Vec::new();
        let mut index = self.index.write();
        while offset + BLOCK <= file_len {
            if self.read_at(file, offset, BLOCK as usize, buf).is_err() {
                break;
            }
            let Some(hl) = peek_header_len(&buf.as_slice()[..BLOCK as usize]) else {
                break;
            };
            if offset + hl > file_len || (hl > BLOCK && self.read_at(file, offset, hl as usize, buf).is_err()) {
                break;
            }
            let Some(h) = decode_header(&buf.as_slice()[..hl as usize]) else {
                break;
            };
            let rec_len = hl + payload_blocks(h.payload_len) * BLOCK;
            if offset + rec_len > file_len || !self.payload_intact(file, offset + hl, &h.block_crcs, buf, &mut crcs) {
                break;
            }
            *max_seq = (*max_seq).max(h.seq);
            if h.flags & FLAG_DEAD == 0 {
                let key: Arc<str> = Arc::from(h.key.as_str());
                let newer = index.get(&key).is_none_or(|e| e.seq < h.seq);
                if newer {
                    index.insert(
                        key.clone(),
                        SsdEntry {
                            file: file.clone(),
                            offset,
                            header_len: hl,
                            seq: h.seq,
                            payload_len: h.payload_len,
                            depth: h.depth,
                            crcs: h.block_crcs.into(),
                        },
                    );
                }
                seg.keys.push(key);
            }
            offset += rec_len;
        }
        drop(index);
        if offset < file_len {
            tracing::warn!(
                "{}: dropping {} torn or corrupt byte(s) at offset {offset}",
                p.display(),
                file_len - offset
            );
            self.counters.torn_dropped.fetch_add(1, Ordering::Relaxed);
            file.file
                .set_len(offset)
                .map_err(|e| StoreError::io(format!("truncate {}", p.display()), e))?;
        }
        seg.len = offset;
        Ok(seg)
    }

    fn payload_intact(
        &self,
        file: &SegmentFile,
        at: u64,
        expected: &[u32],
        buf: &mut AlignedBuf,
        crcs: &mut Vec<u32>,
    ) -> bool {
        const CHUNK_BLOCKS: usize = 256;
        for (c, want) in expected.chunks(CHUNK_BLOCKS).enumerate() {
            let len = want.len() * BLOCK as usize;
            if self
                .read_at(file, at + (c * CHUNK_BLOCKS) as u64 * BLOCK, len, buf)
                .is_err()
            {
                return false;
            }
            block_crcs(&buf.as_slice()[..len], crcs);
            if crcs.as_slice() != want {
                return false;
            }
        }
        true
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

    /// The index, read-locked: resolve a whole batch under one shared lock.
    pub fn index(&self) -> RwLockReadGuard<'_, HashMap<Arc<str>, SsdEntry>> {
        self.index.read()
    }

    /// True if `key` is stored.
    pub fn contains(&self, key: &str) -> bool {
        self.index.read().contains_key(key)
    }

    /// The directory a key's records go to.
    fn dir_of(&self, key: &str) -> usize {
        crc32c::crc32c(key.as_bytes()) as usize % self.dirs.len()
    }

    /// Appends one record per item, its payload taken from memory `payloads[i]` (extents in
    /// object order). Checksums every block, writes each directory's records while holding that
    /// directory's lock (one lock each, in order), then publishes them in the index and marks the
    /// records they replace dead. Per-item results.
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
        let mut seqs = Vec::with_capacity(items.len());
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
            let seq = self.seq.fetch_add(1, Ordering::Relaxed);
            seqs.push(seq);
            let f = HeaderFields {
                flags: 0,
                seq,
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
        let mut guards: Vec<(usize, parking_lot::MutexGuard<'_, DirState>)> = by_dir
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.is_empty())
            .map(|(d, _)| (d, self.dirs[d].lock()))
            .collect();
        let mut ops: Vec<IoOp> = Vec::new();
        let mut op_item: Vec<usize> = Vec::new();
        let mut placement: Vec<Option<(Arc<SegmentFile>, u64)>> = vec![None; items.len()];
        let mut evicted: Vec<Segment> = Vec::new();
        let hbase = headers.as_mut_ptr();
        for (d, state) in guards.iter_mut() {
            for &i in &by_dir[*d] {
                let it = &items[i];
                let rl = record_len(it.key.len(), it.len);
                let placed = self.active_segment(state, *d as u16).and_then(|_| {
                    let len = state.segments.back().map_or(0, |s| s.len);
                    if len > 0 && len + rl > self.opts.segment_bytes {
                        self.rotate(state, *d as u16)?;
                    }
                    Ok(())
                });
                if let Err(e) = placed {
                    results[i] = Err(e);
                    continue;
                }
                self.make_room(state, rl, &mut evicted);
                let st: &mut DirState = state;
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
                st.bytes += rl;
                seg.keys.push(Arc::from(it.key));
                placement[i] = Some((seg.file.clone(), at));
            }
        }
        let outcome = self.io.run(&ops);
        if let Err((bad, e)) = &outcome {
            // Everything from the first failed write on is treated as not written: each directory
            // that has a failed record is cut back to before it, so no segment holds a hole.
            let err = StoreError::io("write to the SSD log", clone_io(e));
            for &i in op_item.iter().skip(*bad) {
                if results[i].is_ok() {
                    results[i] = Err(err.clone());
                }
            }
            for (d, state) in guards.iter_mut() {
                let Some(first_bad) = by_dir[*d]
                    .iter()
                    .copied()
                    .filter(|&i| results[i].is_err())
                    .filter_map(|i| placement[i].as_ref().map(|p| (i, p.1)))
                    .min_by_key(|&(_, at)| at)
                else {
                    continue;
                };
                let file = placement[first_bad.0].as_ref().expect("placed").0.clone();
                for &i in &by_dir[*d] {
                    let later = placement[i]
                        .as_ref()
                        .is_some_and(|(f, at)| Arc::ptr_eq(f, &file) && *at >= first_bad.1);
                    if later {
                        if results[i].is_ok() {
                            results[i] = Err(err.clone());
                        }
                        placement[i] = None;
                    }
                }
                let st: &mut DirState = state;
                if let Some(seg) = st.segments.iter_mut().find(|s| Arc::ptr_eq(&s.file, &file)) {
                    st.bytes -= seg.len - first_bad.1;
                    seg.len = first_bad.1;
                }
            }
        }
        let mut written = 0u64;
        let mut replaced: Vec<SsdEntry> = Vec::new();
        {
            let mut index = self.index.write();
            for seg in &evicted {
                for k in &seg.keys {
                    if index.get(k).is_some_and(|e| Arc::ptr_eq(&e.file, &seg.file)) {
                        index.remove(k);
                    }
                }
            }
            for (i, it) in items.iter().enumerate() {
                let Some((file, offset)) = placement[i].take() else {
                    continue;
                };
                if results[i].is_err() || evicted.iter().any(|s| Arc::ptr_eq(&s.file, &file)) {
                    if results[i].is_ok() {
                        results[i] = Err(StoreError::NoSpace {
                            key: it.key.to_owned(),
                            len: it.len,
                        });
                    }
                    continue;
                }
                written += record_len(it.key.len(), it.len);
                let entry = SsdEntry {
                    file,
                    offset,
                    header_len: header_len(it.key.len(), it.len),
                    seq: seqs[i],
                    payload_len: it.len,
                    depth: it.depth,
                    crcs: all_crcs[i].clone(),
                };
                if let Some(old) = index.insert(Arc::from(it.key), entry) {
                    replaced.push(old);
                }
            }
        }
        drop(guards);
        for seg in evicted {
            let path = segment_path(&self.opts.dirs[seg.file.dir as usize], seg.file.id);
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!("could not delete evicted segment {}: {e}", path.display());
            }
        }
        written += self.mark_dead(&replaced);
        self.counters.bytes_written.fetch_add(written, Ordering::Relaxed);
        results
    }

    /// The index of the active (last) segment of a directory, creating the first one.
    fn active_segment(&self, state: &mut DirState, d: u16) -> Result<usize> {
        if state.segments.is_empty() {
            self.rotate(state, d)?;
        }
        Ok(state.segments.len() - 1)
    }

    fn rotate(&self, state: &mut DirState, d: u16) -> Result<()> {
        let id = state.next_id;
        let (file, direct) = open_segment(&segment_path(&state.path, id), self.opts.direct, true)?;
        state.next_id += 1;
        state.segments.push_back(Segment {
            file: Arc::new(SegmentFile {
                file,
                dir: d,
                id,
                direct,
            }),
            len: 0,
            keys: Vec::new(),
        });
        Ok(())
    }

    /// Drops the oldest segments (never the active one) until `need` more bytes fit.
    fn make_room(&self, state: &mut DirState, need: u64, evicted: &mut Vec<Segment>) {
        while state.bytes + need > self.dir_capacity && state.segments.len() > 1 {
            let seg = state.segments.pop_front().expect("more than one segment");
            state.bytes -= seg.len;
            self.counters.segments_evicted.fetch_add(1, Ordering::Relaxed);
            evicted.push(seg);
        }
    }

    /// Rewrites the headers of `entries` with the dead flag. Returns bytes written.
    fn mark_dead(&self, entries: &[SsdEntry]) -> u64 {
        let mut written = 0;
        for e in entries {
            let mut buf = AlignedBuf::new(e.header_len as usize);
            if self
                .read_at(&e.file, e.offset, e.header_len as usize, &mut buf)
                .is_err()
            {
                continue;
            }
            let Some(h) = decode_header(&buf.as_slice()[..e.header_len as usize]) else {
                continue;
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
            let op = IoOp {
                fd: fd(&e.file.file),
                offset: e.offset,
                buf: buf.as_mut_ptr(),
                len: e.header_len as usize,
                write: true,
            };
            match self.io.run(&[op]) {
                Ok(()) => written += e.header_len,
                Err((_, err)) => tracing::warn!("could not mark a replaced record dead: {err}"),
            }
        }
        written
    }

    /// Removes `key`; its record is marked dead on disk before this returns. False if absent.
    pub fn remove(&self, key: &str) -> Result<bool> {
        let Some(old) = self.index.write().remove(key) else {
            return Ok(false);
        };
        let written = self.mark_dead(std::slice::from_ref(&old));
        self.counters.bytes_written.fetch_add(written, Ordering::Relaxed);
        if written == 0 {
            return Err(StoreError::io(
                format!("mark the record of {key:?} dead"),
                std::io::Error::other("header rewrite failed"),
            ));
        }
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
        let ops: Vec<IoOp> = spans
            .iter()
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
        for (k, s) in spans.iter().enumerate() {
            let e = entries[s.entry];
            if let Err((bad, err)) = &outcome {
                if k == *bad {
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

    /// Flushes every segment file to stable storage.
    pub fn sync(&self) -> Result<()> {
        for d in &self.dirs {
            let state = d.lock();
            for s in &state.segments {
                s.file
                    .file
                    .sync_data()
                    .map_err(|e| StoreError::io(format!("fsync segment {}", s.file.id), e))?;
            }
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
#[path = "log_tests.rs"]
mod tests;
