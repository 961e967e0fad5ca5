//! Space management: the background compactor and the compaction a put runs when it does not
//! fit.

use super::*;

impl LogCore {
    pub(super) fn wake_compactor(&self) {
        let mut s = self.signal.lock();
        if !s.work {
            s.work = true;
            drop(s);
            self.wake.notify_one();
        }
    }

    pub(super) fn compactor_loop(&self) {
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
            let mut copies = Vec::new();
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
                self.move_records(&mut st, &src, &keys[start..at], &mut copies)?;
            }
            let mut st = dir.lock();
            if st.segments.iter().any(|s| Arc::ptr_eq(&s.file, &src)) {
                // Anything published into it between chunks (nothing is: it is sealed) moves now.
                self.move_records(&mut st, &src, &keys, &mut copies)?;
                self.delete_segment(&mut st, &src, &copies)?;
            }
            return Ok(true);
        }
        Ok(false)
    }

    /// Compaction while a put holds the directory lock: compacts segments with dead bytes, most
    /// dead first, until `need` more bytes fit under the capacity (`all`: every such segment, after
    /// the disk filled up) or none is left.
    pub(super) fn compact_locked(&self, st: &mut DirState, need: u64, all: bool) -> Result<()> {
        let limit = st.segments.len();
        for _ in 0..limit {
            if !all && st.bytes + need <= st.capacity {
                break;
            }
            let Some((src, keys)) = self.candidate(st, true) else {
                break;
            };
            let mut copies = Vec::new();
            self.move_records(st, &src, &keys, &mut copies)?;
            self.delete_segment(st, &src, &copies)?;
        }
        Ok(())
    }

    /// Rewrites the live records of `src` among `keys` at the directory's head and repoints the
    /// index at them; a copy whose key changed meanwhile is marked dead. Damaged records are not
    /// copied (their keys then read NotFound). Adds each file written to `copies` (synced before
    /// the source is deleted).
    fn move_records(
        &self,
        st: &mut DirState,
        src: &Arc<SegmentFile>,
        keys: &[Arc<str>],
        copies: &mut Vec<Arc<SegmentFile>>,
    ) -> Result<()> {
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
        for (f, _) in &placed {
            if !copies.iter().any(|c| Arc::ptr_eq(c, f)) {
                copies.push(f.clone());
            }
        }
        self.opts.step_hook.at(Step::CopiesWritten);
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
        self.opts.step_hook.at(Step::IndexRepointed);
        for e in &retire {
            self.mark_dead(e)?;
        }
        let c = &self.counters;
        c.compaction_written.fetch_add(total, Ordering::Relaxed);
        c.bytes_written.fetch_add(total, Ordering::Relaxed);
        Ok(())
    }

    /// Drops a compacted segment from the directory and deletes its file, after syncing the
    /// files its records were copied to: a power cut never takes the source away before the
    /// copies are on disk.
    fn delete_segment(&self, st: &mut DirState, src: &Arc<SegmentFile>, copies: &[Arc<SegmentFile>]) -> Result<()> {
        let Some(pos) = st.segments.iter().position(|s| Arc::ptr_eq(&s.file, src)) else {
            return Ok(());
        };
        for f in copies {
            f.file
                .sync_data()
                .map_err(|e| StoreError::io(format!("compaction: fsync segment {}", f.id), e))?;
        }
        self.opts.step_hook.at(Step::CopiesSynced);
        let seg = st.segments.remove(pos).expect("position found");
        st.bytes -= seg.len;
        let path = segment_path(&st.path, seg.file.id);
        std::fs::remove_file(&path).map_err(|e| StoreError::io(format!("delete {}", path.display()), e))?;
        self.opts.step_hook.at(Step::SourceDeleted);
        sync_dir(&st.path)?;
        self.opts.step_hook.at(Step::DirectorySynced);
        let c = &self.counters;
        c.segments_compacted.fetch_add(1, Ordering::Relaxed);
        c.compaction_freed.fetch_add(seg.len, Ordering::Relaxed);
        Ok(())
    }
}
