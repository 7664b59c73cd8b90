//! Group commit: the flusher takes what is queued, writes it in aligned
//! pieces (zeros ahead of small rounds, a reservation ahead of the tail),
//! syncs, and moves the written and durable frontiers.

use super::*;

impl<S: Storage> ShardLog<S> {
    /// Run the group-commit loop until the log stops or closes.
    pub async fn run_flusher(&self) {
        loop {
            {
                let i = self.inner.borrow();
                if i.stopped.is_some() || (i.closed && i.pending.is_empty()) {
                    return;
                }
            }
            if self.has_pending() {
                // A failure stops the shard; the loop exits at the top.
                let _ = self.flush().await;
            } else {
                let wait = self.queued.wait();
                if self.has_pending() || self.inner.borrow().closed {
                    continue;
                }
                wait.await;
            }
        }
    }

    /// Make everything appended before this call durable: when it returns
    /// `Ok`, every batch queued before the call is covered by a completed
    /// fdatasync (and its records are visible to readers).
    ///
    /// With no flush in flight, this runs one group-commit round: write
    /// everything queued, fdatasync, advance the frontiers and wake waiters.
    /// With one in flight (the flusher task's or another caller's), it waits
    /// for that round to finish and then, if what it must cover is still not
    /// durable (queued after that round took the queue), runs the next round
    /// itself. Rounds never overlap, and a caller whose batches the round in
    /// flight already covers adds no write or sync.
    ///
    /// Returns an error if the log stopped before everything was durable (a
    /// failed round, its own or the one it waited for). On a closed log
    /// (`close` flushed everything) it returns `Ok`. Dropping a flush while
    /// its round is in flight stops the shard: what the round took from the
    /// queue may be partly written and is not retried.
    pub async fn flush(&self) -> Result<(), LogError> {
        // The position just past everything queued before this call.
        let target = self.inner.borrow().frontiers.lsn(Frontier::Queued);
        loop {
            // Registered before the check, so a round ending in between
            // still wakes it.
            let progressed = self.progress.wait();
            {
                let mut i = self.inner.borrow_mut();
                // A closed log flushed everything, unless it stopped: a
                // stopped log is an error whether or not it is also closed
                // (never let a later round mark a failed one durable).
                i.refuse().or_else(|e| match e {
                    LogError::Closed => Ok(()),
                    e => Err(e),
                })?;
                if i.frontiers.lsn(Frontier::Durable) >= target {
                    return Ok(());
                }
                if !i.flushing {
                    // A round makes everything it took durable, so what is
                    // not durable with no round in flight is still queued.
                    debug_assert!(!i.pending.is_empty());
                    i.flushing = true;
                    break;
                }
            }
            progressed.await;
        }
        let mut round = RoundGuard {
            log: self,
            done: false,
            durable: std::cell::Cell::new(false),
        };
        let result = self.flush_inner(&round.durable).await;
        round.done = true;
        let mut i = self.inner.borrow_mut();
        i.flushing = false;
        if let Err(e) = &result {
            i.stop_after_round(e.to_string());
        }
        drop(i);
        self.progress.wake_all();
        result.map_err(|e| match e {
            LogError::Stopped(_) => e,
            other => LogError::Stopped(other.to_string()),
        })
    }

    /// One round; `durable` is set once what it took is durable (dropped
    /// after that, the round has lost nothing: see `RoundGuard`).
    async fn flush_inner(&self, durable: &std::cell::Cell<bool>) -> Result<(), LogError> {
        let chunks: Vec<Chunk> = {
            let mut i = self.inner.borrow_mut();
            // Only a round that syncs what it wrote marks it durable.
            if let Some(r) = &i.stopped {
                return Err(LogError::Stopped(r.clone()));
            }
            i.chunk_hint = i.pending_bytes;
            i.pending_bytes = 0;
            i.flush_stamp = i.flush_stamp.wrapping_add(1);
            i.pending.drain(..).collect()
        };
        let mut dirty: Option<Rc<S::File>> = None;
        // Summaries of the segments this round seals, written once it is
        // durable (see `write_summaries`).
        let mut sealed = Vec::new();
        let count = chunks.len();
        for (n, chunk) in chunks.into_iter().enumerate() {
            let (active_base, dir) = {
                let i = self.inner.borrow();
                (i.active_base(), i.dir.clone())
            };
            if chunk.segment_base != active_base {
                assert!(
                    chunk.segment_base > active_base,
                    "segments only move forward"
                );
                // Seal the active segment: make its data durable, cut its
                // padding, then create the next one and make its name durable.
                if let Some(f) = dirty.take() {
                    f.sync().await.map_err(|e| io_err("fdatasync", e))?;
                }
                let (file, len, summary) = {
                    let i = self.inner.borrow();
                    let s = &i.segments[&active_base];
                    (s.file.clone(), s.len, i.summary_of(active_base).unwrap())
                };
                cut_to(&*file, len, "seal segment").await?;
                let path = dir.join(segment_name(chunk.segment_base));
                let new = self
                    .storage
                    .open(&path, true)
                    .await
                    .map_err(|e| io_err("create segment", e))?;
                self.storage
                    .sync_dir(&dir)
                    .await
                    .map_err(|e| io_err("sync shard directory", e))?;
                // Recovery's proof that this segment existed.
                self.storage
                    .write_file_atomic(
                        &dir.join(TAIL_MARK),
                        &marks::encode_tail(chunk.segment_base),
                    )
                    .await
                    .map_err(|e| io_err(&format!("write {TAIL_MARK}"), e))?;
                sealed.push(summary);
                let mut i = self.inner.borrow_mut();
                i.segments.insert(
                    chunk.segment_base,
                    Segment::empty(chunk.segment_base, path, Rc::new(new), 0),
                );
                i.tail_page.clear();
            }
            // Only the round's last chunk is in the segment that stays
            // active: zeros ahead of an earlier one would be cut at its seal.
            let file = self.write_chunk(chunk, n + 1 == count).await?;
            dirty = Some(file);
        }
        if let Some(f) = dirty {
            let t = std::time::Instant::now();
            f.sync().await.map_err(|e| io_err("fdatasync", e))?;
            let us = t.elapsed().as_micros() as u64;
            self.inner.borrow_mut().sync.record(us);
        }
        {
            let mut i = self.inner.borrow_mut();
            let written = i.frontiers.at(Frontier::Written);
            i.frontiers.mark_durable(written);
            i.flushes += 1;
        }
        durable.set(true);
        if !sealed.is_empty() {
            self.write_summaries(sealed).await;
        }
        self.vouch_for_snapshot().await;
        Ok(())
    }

    /// After an open that had to replay group entries from a segment before
    /// the newest: once the snapshot it queued into the newest segment is
    /// durable, write the summary of the segment before again, vouching
    /// for that snapshot, so the next open replays from there and reads no
    /// sealed segment (a log upgraded from before summaries, or one whose
    /// summary was lost, is then fast from its second start, not only from
    /// its next roll).
    async fn vouch_for_snapshot(&self) {
        let (dir, summary) = {
            let mut i = self.inner.borrow_mut();
            if !i.vouch_pending {
                return;
            }
            let durable = i.frontiers.lsn(Frontier::Durable);
            let newest = i.active_base();
            let Some(c) = i
                .covers
                .iter()
                .rev()
                .find(|c| c.segment == newest && c.end <= durable)
                .copied()
            else {
                return;
            };
            i.vouch_pending = false;
            let Some(&prev) = i.segments.range(..newest).next_back().map(|(b, _)| b) else {
                return;
            };
            let mut summary = i.summary_of(prev).unwrap();
            summary.next_snapshot = Some((c.at, c.until));
            (i.dir.clone(), summary)
        };
        self.write_summary_of_live(&dir, &summary, true).await;
    }

    /// Write `summary` (see `summary::write_summary`), and remove it again
    /// if retention removed its segment meanwhile (and the summary before
    /// this wrote it).
    async fn write_summary_of_live(&self, dir: &Path, summary: &summary::Summary, rewrite: bool) {
        summary::write_summary(&self.storage, dir, summary, rewrite).await;
        let gone = !self.inner.borrow().segments.contains_key(&summary.base);
        if gone {
            let _ = self
                .storage
                .remove_file(&dir.join(summary::summary_name(summary.base)))
                .await;
        }
    }

    /// Write the summaries of the segments a round sealed. Each is durable
    /// at its final length and no longer the newest (so no open takes a
    /// summary for a segment that may still grow), and the snapshot the
    /// next segment opens with is durable too, so the summary can vouch for
    /// it: an open then replays group entries from there, and need not read
    /// the sealed segment at all. The round's waiters are woken first: only
    /// the next open's speed depends on these. A failure is reported, and
    /// whatever it left under the name removed: that open reads the segment.
    async fn write_summaries(&self, sealed: Vec<summary::Summary>) {
        self.progress.wake_all();
        let dir = self.inner.borrow().dir.clone();
        for mut summary in sealed {
            {
                let i = self.inner.borrow();
                if !i.segments.contains_key(&summary.base) {
                    continue;
                }
                let durable = i.frontiers.lsn(Frontier::Durable);
                summary.next_snapshot = i
                    .covers
                    .iter()
                    .find(|c| c.segment == summary.end && c.at == 0 && c.end <= durable)
                    .map(|c| (c.at, c.until));
            }
            if summary.next_snapshot.is_some() && summary.end == self.inner.borrow().active_base() {
                // Vouches for the newest segment's opening snapshot.
                self.inner.borrow_mut().vouch_pending = false;
            }
            self.write_summary_of_live(&dir, &summary, false).await;
        }
    }

    /// Write one chunk at the end of the active segment (rewriting its
    /// partial last page), in pieces with at most `io_depth` in flight.
    async fn write_chunk(
        &self,
        chunk: Chunk,
        last_in_round: bool,
    ) -> Result<Rc<S::File>, LogError> {
        let (file, seg_len, reserved, zeroed, depth, step, segment_bytes) = {
            let i = self.inner.borrow();
            let s = &i.segments[&chunk.segment_base];
            debug_assert_eq!(Some(&s.base), i.segments.keys().next_back());
            (
                s.file.clone(),
                s.len,
                s.reserved,
                s.zeroed,
                i.config.io_depth,
                i.config.preallocate.then_some(i.config.preallocate_step),
                i.config.segment_bytes,
            )
        };
        let Chunk {
            segment_base,
            start,
            mut pieces,
            len: chunk_len,
            batches,
            end: chunk_end,
        } = chunk;
        assert_eq!(start, seg_len, "a chunk starts where its segment ends");
        let new_len = seg_len + chunk_len as u64;
        let write_end = align_up(new_len);
        {
            // The segment's partial last page, written again in front of
            // the new bytes: into the first piece's room for it, and into
            // the pieces after it that start on the same page (they carried
            // that room over before it was filled).
            let i = self.inner.borrow();
            let page = align_down(seg_len);
            // Checked always: a wrong tail would write over durable bytes.
            assert_eq!(
                i.tail_page.len() as u64,
                seg_len - page,
                "tail page out of step"
            );
            for p in pieces.iter_mut().take_while(|p| p.at == page) {
                p.buf.filled_mut()[..i.tail_page.len()].copy_from_slice(&i.tail_page);
            }
        }
        // The last partial page of the segment after this chunk, and zeros
        // to the page boundary (recovery reads them as the end of the log).
        let new_tail = match pieces.last_mut() {
            Some(last) => {
                let from = (align_down(new_len) - last.at) as usize;
                let to = (new_len - last.at) as usize;
                debug_assert_eq!(to, last.buf.len());
                let t = last.buf.filled()[from..to].to_vec();
                last.buf.pad_to_page();
                t
            }
            None => self.inner.borrow().tail_page.clone(),
        };
        // Zeros ahead of the data, from a small round only. Blocks reserved
        // by fallocate are unwritten extents: the first write into one
        // converts it, and the fdatasync after that write must commit the
        // conversion to the filesystem journal (fio on ext4: 75-79 us a sync
        // after 64 KiB written into new or reserved blocks, 44 us after an
        // overwrite). So when less than ZERO_AHEAD_LOW of written zeros is
        // left past this round's end, the round also writes a piece of
        // zeros there, inside the reservation: the rounds after it overwrite
        // written blocks and sync only their data, and one round in every
        // ZERO_AHEAD_PIECE of data pays for the conversion. A large round
        // does not (it is bandwidth-bound, and zeros would double its disk
        // writes), nor one whose reservation failed (zeros would grow the
        // file).
        let zeros = match step {
            Some(_) if last_in_round && chunk_len <= ZERO_AHEAD_ROUND && reserved != u64::MAX => {
                let at = zeroed.max(write_end);
                debug_assert_eq!(at % ALIGN as u64, 0);
                let until = align_down(
                    at.saturating_add(ZERO_AHEAD_PIECE as u64)
                        .min(align_up(segment_bytes)),
                );
                (at - write_end < ZERO_AHEAD_LOW && until > at).then(|| (at, (until - at) as usize))
            }
            _ => None,
        };
        let need = zeros.map_or(write_end, |(at, len)| at + len as u64);
        let mut reserved = reserved;
        if let Some(step) = step.filter(|_| need > reserved) {
            // Reserve past these writes (`reservation_for`). Best effort: a
            // filesystem without fallocate grows the file as it is written,
            // and it is not asked again for this segment.
            //
            // Nor while the disk is short of room (looked at again at the
            // next flush that needs it): a reservation takes its step at once,
            // between two looks of the broker's free-space guard, from the
            // room the publishes it let through will write into.
            let to = reservation_for(need, step);
            let had = file.size().await.map_err(|e| io_err("size", e))?;
            let (dir, floor) = {
                let i = self.inner.borrow();
                (i.dir.clone(), i.config.min_free_bytes)
            };
            let grow = to.saturating_sub(had);
            let roomy = match self.storage.space(&dir) {
                Ok((free, total)) => {
                    free.saturating_sub(storage::free_space_floor(floor, total))
                        >= grow.saturating_mul(2)
                }
                Err(_) => true,
            };
            if roomy {
                reserved = match file.allocate(to).await {
                    Ok(()) => to,
                    Err(e) => {
                        tracing::debug!("reserving segment blocks failed: {e}");
                        // A reservation cut short (ENOSPC) can keep what it
                        // took: give it back.
                        if let Err(e) = file.truncate(had).await {
                            tracing::debug!("giving back a failed reservation: {e}");
                        }
                        // Not again in this segment: after an ENOSPC the
                        // free space read is not to be trusted, and each
                        // try would fill the disk for a moment.
                        u64::MAX
                    }
                };
            } else {
                tracing::debug!(
                    segment = chunk.segment_base.0,
                    "not reserving blocks ahead: the disk is short of room"
                );
            }
            let mut i = self.inner.borrow_mut();
            if let Some(s) = i.segments.get_mut(&chunk.segment_base) {
                s.reserved = reserved;
            }
        }
        // Zeros only inside the reservation (none where it failed, or was
        // not made for want of room): past it they would grow the file.
        let zeros = zeros.filter(|(at, len)| reserved != u64::MAX && at + *len as u64 <= reserved);
        // Each piece but the last ends inside a page the next one writes
        // again whole; the last one is padded to its page.
        let count = pieces.len();
        let piece_at: Vec<u64> = pieces.iter().map(|p| p.at).collect();
        let mut writes: Vec<(Option<usize>, PageBuf, usize, u64)> = Vec::with_capacity(count + 1);
        // Each piece's memory, by index: a piece not written (all its
        // bytes are in the next one's first page) stays; a written one comes
        // back into its slot below.
        let mut kept: Vec<Option<PageBuf>> = Vec::with_capacity(count);
        for (k, p) in pieces.into_iter().enumerate() {
            let n = if k + 1 == count {
                p.buf.len()
            } else {
                align_down(p.buf.len() as u64) as usize
            };
            if n == 0 {
                kept.push(Some(p.buf));
            } else {
                writes.push((Some(k), p.buf, n, p.at));
                kept.push(None);
            }
        }
        // The zeros go last, so they are the last write of the last group.
        if let Some((pos, len)) = zeros {
            writes.push((None, take_zeros(len), len, pos));
        }
        let mut written_bytes = 0u64;
        let mut zeros_written = zeros.is_some();
        let mut iter = writes.into_iter();
        loop {
            let group: Vec<_> = iter.by_ref().take(depth).collect();
            if group.is_empty() {
                break;
            }
            let futs = group.into_iter().map(|(k, buf, n, pos)| {
                written_bytes += n as u64;
                let file = &file;
                async move { (k, file.write_at(buf, n, pos).await) }
            });
            for (k, r) in futures_util::future::join_all(futs).await {
                match (k, r) {
                    (Some(k), Ok(buf)) => kept[k] = Some(buf),
                    (None, Ok(buf)) => give_back_zeros(buf),
                    // Zeros are an optimisation inside reserved blocks that
                    // read as zeros anyway: a failure costs nothing but the
                    // speed-up, never the shard.
                    (None, Err(e)) => {
                        tracing::debug!("writing zeros ahead failed: {e}");
                        zeros_written = false;
                    }
                    (Some(_), Err(e)) => return Err(io_err("write", e)),
                }
            }
        }
        // The bytes are on the device (not yet synced): advance `written`,
        // index the batches, keep them for tail reads.
        let mut i = self.inner.borrow_mut();
        {
            let seg = i.segments.get_mut(&segment_base).unwrap();
            seg.zeroed = seg.zeroed.max(write_end);
            if let (Some((pos, len)), true) = (zeros, zeros_written) {
                seg.zeroed = seg.zeroed.max(pos + len as u64);
            }
        }
        let interval = i.config.index_interval_bytes;
        let cache_max = i.config.read_cache_bytes;
        i.tail_page = new_tail;
        i.bytes_written += written_bytes;
        {
            let seg = i.segments.values_mut().next_back().unwrap();
            for (h, pos, _) in &batches {
                seg.note_batch(h, *pos, interval);
            }
            seg.len = new_len;
        }
        // The pieces become the cache's memory without a copy.
        let kept: Vec<PageBuf> = kept
            .into_iter()
            .map(|p| p.expect("every piece is back"))
            .collect();
        let capacity: Vec<usize> = kept.iter().map(PageBuf::capacity).collect();
        let shared: Vec<Bytes> = kept.into_iter().map(PageBuf::into_bytes).collect();
        // Pieces of the batches this round adds to the cache, in order.
        let mut round_pieces = Vec::with_capacity(batches.len());
        for (h, pos, k) in &batches {
            // Control batches are cached too: a reader must be able to step
            // over their offsets without going to disk.
            if h.kind != BatchKind::Group {
                let at = (*pos - piece_at[*k]) as usize;
                let bytes = shared[*k].slice(at..at + h.len as usize);
                i.cache_bytes += bytes.len();
                i.cache.push_back(CachedBatch {
                    header: *h,
                    bytes,
                    segment: segment_base,
                    pos: *pos,
                });
                round_pieces.push(*k);
            }
        }
        while i.cache_bytes > cache_max && i.cache.len() > 1 {
            let b = i.cache.pop_front().unwrap();
            i.cache_bytes -= b.bytes.len();
        }
        // A cached batch keeps its whole piece alive. Where the cache keeps
        // less than half of a piece's memory (a shard with a small share of
        // its core's budget, a piece sized for more than the round brought,
        // a small round in a page), copy what it keeps out so the piece is
        // freed; where it keeps more, the copy would cost more than the
        // memory it frees.
        let survivors = round_pieces.len().min(i.cache.len());
        let round_pieces = &round_pieces[round_pieces.len() - survivors..];
        let first = i.cache.len() - survivors;
        let mut kept_of = vec![0usize; shared.len()];
        for (b, &k) in i.cache.range(first..).zip(round_pieces) {
            kept_of[k] += b.bytes.len();
        }
        // A piece copied out goes into one new buffer its batches share.
        let mut copied: Vec<Option<Vec<u8>>> = kept_of
            .iter()
            .zip(&capacity)
            .map(|(&kept, &cap)| (kept > 0 && kept * 2 <= cap).then(|| Vec::with_capacity(kept)))
            .collect();
        for (b, &k) in i.cache.range(first..).zip(round_pieces) {
            if let Some(v) = &mut copied[k] {
                v.extend_from_slice(&b.bytes);
            }
        }
        let copied: Vec<Option<Bytes>> = copied.into_iter().map(|v| v.map(Bytes::from)).collect();
        let mut at = vec![0usize; shared.len()];
        for (b, &k) in i.cache.range_mut(first..).zip(round_pieces) {
            if let Some(all) = &copied[k] {
                let n = b.bytes.len();
                b.bytes = all.slice(at[k]..at[k] + n);
                at[k] += n;
            }
        }
        i.frontiers.mark_written(chunk_end);
        drop(i);
        self.written.wake_all();
        Ok(file)
    }
}

/// Zeros a small flush round writes ahead of its data when preallocation is
/// on (see `write_chunk`). Against the piece a round adds, the rounds that
/// follow it find written blocks for this many bytes of data.
const ZERO_AHEAD_PIECE: usize = 256 << 10;
/// A round writes a piece of zeros when fewer than this many bytes of
/// written zeros are left past its end.
const ZERO_AHEAD_LOW: u64 = 64 << 10;
/// Largest chunk of data (a round's last chunk: the part in the segment that
/// stays active) that writes zeros ahead. A disk near
/// its bandwidth makes rounds larger than this (more data gathers while each
/// one is written), so zeros never take bandwidth the data needs.
const ZERO_AHEAD_ROUND: usize = 64 << 10;

thread_local! {
    /// A piece of zeros this thread's logs write ahead of small rounds,
    /// kept between writes so that it is not filled again each time (a
    /// DMA write only reads it). One a thread (a core), not one a shard:
    /// a core may own thousands of shards.
    static ZEROS: std::cell::RefCell<Option<PageBuf>> = const { std::cell::RefCell::new(None) };
}

/// At least `len` zero bytes to write from (`len` a multiple of [`ALIGN`]).
fn take_zeros(len: usize) -> PageBuf {
    match ZEROS.with(|z| z.borrow_mut().take()) {
        Some(b) if b.writable() >= len => b,
        _ => PageBuf::zeroed(len.max(ZERO_AHEAD_PIECE)),
    }
}

/// Keep a written piece of zeros for the next [`take_zeros`].
fn give_back_zeros(buf: PageBuf) {
    ZEROS.with(|z| {
        let mut z = z.borrow_mut();
        if z.as_ref().is_none_or(|k| k.writable() < buf.writable()) {
            *z = Some(buf);
        }
    });
}

/// Smallest reservation step. A segment's reservation grows to the next
/// power of two past its writes (at least this) until that reaches
/// `preallocate_step`, then a step at a time: a shard that is barely written
/// reserves little disk (thousands of shards would otherwise each hold a
/// full step), and one written fast reaches full steps after a few extends.
pub(super) const MIN_RESERVE_STEP: u64 = 256 << 10;

/// How far a segment whose writes end at `need` is reserved, with steps of
/// at most `step` (see [`MIN_RESERVE_STEP`]).
pub(super) fn reservation_for(need: u64, step: u64) -> u64 {
    let step = step.max(ALIGN as u64);
    let grow = need.max(MIN_RESERVE_STEP).checked_next_power_of_two();
    match grow {
        Some(to) if to < step => to,
        _ => need.div_ceil(step).saturating_mul(step),
    }
}

/// Stops the log if a flush round is dropped before it finished (its
/// future cancelled): the chunks it took from the queue may be partly
/// written and are gone from the queue, so nothing can make them durable.
/// Without this, `flushing` would stay set and every later flush, and every
/// waiter on the durable frontier, would wait forever.
struct RoundGuard<'a, S: Storage> {
    log: &'a ShardLog<S>,
    done: bool,
    /// What the round took is durable: only its summaries were left to
    /// write, and dropping it then loses nothing.
    durable: std::cell::Cell<bool>,
}

impl<S: Storage> Drop for RoundGuard<'_, S> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if let Ok(mut i) = self.log.inner.try_borrow_mut() {
            i.flushing = false;
            if !self.durable.get() {
                i.stop_after_round("a flush was dropped before it completed".into());
            }
        }
        self.log.progress.wake_all();
        self.log.queued.wake_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_double_up_to_the_step_then_go_a_step_at_a_time() {
        let mib = 1u64 << 20;
        let step = 8 * mib;
        // A barely written segment holds 256 KiB, not a whole step.
        assert_eq!(reservation_for(4096, step), 256 << 10);
        assert_eq!(reservation_for(260 << 10, step), 512 << 10);
        assert_eq!(reservation_for(3 * mib, step), 4 * mib);
        assert_eq!(reservation_for(5 * mib, step), step);
        assert_eq!(reservation_for(8 * mib, step), step);
        assert_eq!(reservation_for(8 * mib + 1, step), 2 * step);
        assert_eq!(reservation_for(100 * mib, step), 104 * mib);
        // Always past the writes.
        for need in [1, 4096, 300 << 10, 7 * mib, 9 * mib, 33 * mib] {
            for step in [4096, 12288, 32 << 10, mib, 3 * mib, 8 * mib] {
                let to = reservation_for(need, step);
                assert!(to >= need, "need {need} step {step}: {to}");
                assert!(
                    to - need < step.max(MIN_RESERVE_STEP).max(need),
                    "need {need} step {step}: {to}"
                );
            }
        }
        // Steps at or under the smallest are used as they are.
        assert_eq!(reservation_for(40 << 10, 32 << 10), 64 << 10);
        assert_eq!(reservation_for(u64::MAX - 5, mib), u64::MAX);
    }
}
