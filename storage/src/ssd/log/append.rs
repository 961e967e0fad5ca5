//! Appending records: checksums, placement in each directory's active segment, the write,
//! roll-back of a failed write, and publication in the index.

use super::*;

impl LogCore {
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
        // SAFETY: the caller's contract covers the payload extents read here.
        let mut headers = unsafe { encode_headers(items, payloads) };
        let by_dir = self.group_by_dir(items);
        // One lock per directory touched, in directory order.
        let mut guards: Vec<(usize, MutexGuard<'_, DirState>)> = by_dir
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.is_empty())
            .map(|(d, _)| (d, self.dirs[d].lock()))
            .collect();
        let batch = Batch {
            items,
            payloads,
            header_at: &headers.at,
            headers: headers.buf.as_mut_ptr(),
        };
        let mut plan = WritePlan {
            ops: Vec::new(),
            op_item: Vec::new(),
            placement: vec![None; items.len()],
            results: (0..items.len()).map(|_| Ok(())).collect(),
        };
        for (d, state) in guards.iter_mut() {
            self.place_dir(state, *d, &by_dir[*d], &batch, &mut plan);
        }
        if let Err((bad, e)) = self.io.run(&plan.ops) {
            self.roll_back(
                items,
                &mut guards,
                &by_dir,
                &plan.op_item[bad..],
                &mut plan.placement,
                &mut plan.results,
                &e,
            );
        }
        let (mut written, retire) = self.publish(items, &mut plan.placement, &headers.crcs);
        // Still under the directory locks: the compactor never copies a record while its
        // replacement is being marked dead.
        written += self.retire_replaced(&retire);
        drop(guards);
        self.counters.bytes_written.fetch_add(written, Ordering::Relaxed);
        if !retire.is_empty() {
            self.wake_compactor();
        }
        plan.results
    }

    /// The items of each directory, by position.
    fn group_by_dir(&self, items: &[AppendItem<'_>]) -> Vec<Vec<usize>> {
        let mut by_dir: Vec<Vec<usize>> = vec![Vec::new(); self.dirs.len()];
        for (i, it) in items.iter().enumerate() {
            by_dir[self.dir_of(it.key)].push(i);
        }
        by_dir
    }

    /// Places the records of directory `d` (items `idx`) at the end of its active segment and
    /// plans their writes; compacts first when they do not fit, and refuses (`NoSpace`) a record
    /// that still does not. The segment grows now so the next record goes after this one; a
    /// failed write rolls it back.
    fn place_dir(&self, st: &mut DirState, d: usize, idx: &[usize], batch: &Batch<'_, '_>, plan: &mut WritePlan) {
        let items = batch.items;
        let need: u64 = idx.iter().map(|&i| record_len(items[i].key.len(), items[i].len)).sum();
        if st.bytes + need > st.capacity || st.full {
            let all = std::mem::take(&mut st.full);
            if let Err(e) = self.compact_locked(st, need, all) {
                tracing::warn!("compaction to make room failed: {e}");
            }
        }
        for &i in idx {
            let it = &items[i];
            let rl = record_len(it.key.len(), it.len);
            if st.bytes + rl > st.capacity {
                self.counters.no_space.fetch_add(1, Ordering::Relaxed);
                plan.results[i] = Err(StoreError::NoSpace {
                    key: it.key.to_owned(),
                    len: it.len,
                });
                continue;
            }
            if let Err(e) = self.make_active(st, d as u16, rl) {
                plan.results[i] = Err(e);
                continue;
            }
            let seg = st.segments.back_mut().expect("active segment");
            let at = seg.len;
            plan_record_writes(&seg.file.file, at, i, batch, plan);
            seg.len += rl;
            seg.keys.push(Arc::from(it.key));
            st.bytes += rl;
            plan.placement[i] = Some((seg.file.clone(), at));
        }
    }

    /// Indexes every written record whose sequence number is above the indexed one. Returns the
    /// bytes written and the records to retire with the flag each gets: those replaced and new
    /// ones that lost to a newer version are dead; a new record of the version already indexed is
    /// void (a dead mark would hide the indexed record at the next open).
    fn publish(
        &self,
        items: &[AppendItem<'_>],
        placement: &mut [Option<(Arc<SegmentFile>, u64)>],
        crcs: &[Arc<[u32]>],
    ) -> (u64, Vec<(SsdEntry, u32)>) {
        let mut written = 0u64;
        let mut retire = Vec::new();
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
                crcs: crcs[i].clone(),
                damaged: false,
            };
            match index.get(it.key) {
                Some(cur) if !cur.damaged && cur.seq == it.seq => retire.push((entry, FLAG_VOID)),
                Some(cur) if !cur.damaged && cur.seq > it.seq => retire.push((entry, FLAG_DEAD)),
                _ => {
                    entry.file.live.fetch_add(rl, Ordering::Relaxed);
                    if let Some(old) = index.insert(Arc::from(it.key), entry) {
                        old.file.live.fetch_sub(old.record_len(), Ordering::Relaxed);
                        retire.push((old, FLAG_DEAD));
                    }
                }
            }
        }
        (written, retire)
    }

    /// Marks each of `retire` with its flag on disk; returns the header bytes written. The caller
    /// holds the directory locks.
    fn retire_replaced(&self, retire: &[(SsdEntry, u32)]) -> u64 {
        let mut written = 0;
        for (e, flag) in retire {
            match self.mark(e, *flag) {
                Ok(()) => written += e.record_len().min(e.header_len),
                Err(err) => tracing::warn!("could not retire a replaced record: {err}"),
            }
        }
        written
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
    pub(super) fn make_active(&self, st: &mut DirState, d: u16, rl: u64) -> Result<()> {
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
}

/// The encoded headers of one append call, in one aligned buffer that is written from directly.
struct Headers {
    buf: AlignedBuf,
    /// Offset of each item's header in `buf`.
    at: Vec<u64>,
    /// Each item's payload block checksums (kept by its index entry).
    crcs: Vec<Arc<[u32]>>,
}

/// One append call's input, as the per-directory step sees it.
struct Batch<'a, 'k> {
    items: &'a [AppendItem<'k>],
    payloads: &'a [&'a [Extent]],
    /// Offset of each item's header in the headers buffer.
    header_at: &'a [u64],
    /// Start of the headers buffer, which lives until the end of the call.
    headers: *mut u8,
}

/// The writes of one append call, planned under the directory locks.
struct WritePlan {
    ops: Vec<IoOp>,
    /// The item each op writes.
    op_item: Vec<usize>,
    /// Where each item's record goes (segment file, offset); `None` when it was refused.
    placement: Vec<Option<(Arc<SegmentFile>, u64)>>,
    /// Per-item outcome so far.
    results: Vec<Result<()>>,
}

/// Checksums every payload block of every item and encodes the headers of the whole call into
/// one aligned buffer.
///
/// # Safety
///
/// As [`LogCore::append`]: every payload extent is readable, rounded up to whole 4 KiB blocks.
unsafe fn encode_headers(items: &[AppendItem<'_>], payloads: &[&[Extent]]) -> Headers {
    let mut at = Vec::with_capacity(items.len());
    let mut total = 0u64;
    for it in items {
        at.push(total);
        total += header_len(it.key.len(), it.len);
    }
    let mut buf = AlignedBuf::new(total as usize);
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
        let h = at[i] as usize;
        encode_header(
            &f,
            &mut buf.as_mut_slice()[h..h + header_len(it.key.len(), it.len) as usize],
        );
        all_crcs.push(crcs.as_slice().into());
    }
    Headers {
        buf,
        at,
        crcs: all_crcs,
    }
}

/// Plans the writes of item `i`'s record at `at` in `file`: its header from the headers buffer,
/// then its payload extents in object order.
fn plan_record_writes(file: &File, at: u64, i: usize, batch: &Batch<'_, '_>, plan: &mut WritePlan) {
    let it = &batch.items[i];
    let hl = header_len(it.key.len(), it.len);
    plan.ops.push(IoOp {
        fd: fd(file),
        offset: at,
        // SAFETY: inside the headers buffer, which lives until the end of the append call.
        buf: unsafe { batch.headers.add(batch.header_at[i] as usize) },
        len: hl as usize,
        write: true,
    });
    plan.op_item.push(i);
    let mut off = at + hl;
    let mut left = align_up(it.len);
    for e in batch.payloads[i] {
        let n = align_up(e.len).min(left);
        plan.ops.push(IoOp {
            fd: fd(file),
            offset: off,
            buf: e.addr as *mut u8,
            len: n as usize,
            write: true,
        });
        plan.op_item.push(i);
        off += n;
        left -= n;
    }
}
