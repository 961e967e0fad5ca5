//! Opening the log: scanning every segment, rebuilding the index, truncating torn tails.

use super::*;

/// What the open scan collected over all segments.
#[derive(Default)]
struct Scan {
    /// Per key, the record with the highest sequence number seen and whether it is dead.
    best: HashMap<Arc<str>, (SsdEntry, bool)>,
    /// Keys named by damaged headers (used when the key has no valid record at all).
    damaged: HashMap<Arc<str>, SsdEntry>,
    /// Live records to mark after the scan, with their flag: dead for those that lost to a newer
    /// (or dead) record; void for a second live copy of a version (a compaction cut short), so
    /// it hides nothing.
    marks: Vec<(SsdEntry, u32)>,
    max_seq: u64,
}

impl Scan {
    /// Takes one valid record (void ones are never passed). Per key, the highest sequence number
    /// wins; at equal numbers a dead record wins over a live one (a version removed after
    /// compaction copied it), and of two live copies the first scanned stays and the other is
    /// surplus.
    fn record(&mut self, key: Arc<str>, entry: SsdEntry, dead: bool) {
        self.max_seq = self.max_seq.max(entry.seq);
        match self.best.get_mut(&key) {
            None => {
                self.best.insert(key, (entry, dead));
            }
            Some((cur, cur_dead)) => {
                let same = entry.seq == cur.seq;
                let wins = entry.seq > cur.seq || (same && dead && !*cur_dead);
                if wins {
                    let old = std::mem::replace(cur, entry);
                    if !*cur_dead {
                        self.marks.push((old, FLAG_DEAD));
                    }
                    *cur_dead = dead;
                } else if !dead {
                    let flag = if same && !*cur_dead { FLAG_VOID } else { FLAG_DEAD };
                    self.marks.push((entry, flag));
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
        header: crate::ssd::record::Header,
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
            best, damaged, marks, ..
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
        // Surplus copies of a live version are marked void: dead, they would hide that version
        // once compaction moves or deletes the copy the index keeps.
        for (e, flag) in &marks {
            core.mark(e, *flag)?;
            core.opts.step_hook.at(Step::OpenMarked);
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
    pub(super) fn read_at(
        &self,
        file: &SegmentFile,
        offset: u64,
        len: usize,
        buf: &mut AlignedBuf,
    ) -> std::io::Result<()> {
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
        if verified && header.flags & (FLAG_DEAD | FLAG_VOID) != 0 {
            // A dead or void record's payload is never read again.
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
                    let at = offset;
                    offset += rec_len;
                    if header.flags & FLAG_VOID != 0 {
                        // A surplus copy: space for compaction to take back, nothing to index.
                        continue;
                    }
                    let key: Arc<str> = Arc::from(header.key.as_str());
                    let dead = header.flags & FLAG_DEAD != 0;
                    let entry = SsdEntry {
                        file: file.clone(),
                        offset: at,
                        header_len: header.header_len,
                        seq: header.seq,
                        payload_len: header.payload_len,
                        depth: header.depth,
                        crcs: header.block_crcs.into(),
                        damaged: false,
                    };
                    seg.keys.push(key.clone());
                    scan.record(key, entry, dead);
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
}
