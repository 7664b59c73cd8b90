//! Reads: the tail cache, cold reads of sealed data (kept chunks, reads
//! joined across two chunks, read-ahead), and the hints that let a reader
//! resume inside a batch.

use super::*;

impl<S: Storage> ShardLog<S> {
    /// Read records from `from` (clamped up to the log start) up to the
    /// visible end, within `limits` (at least one record if any is there:
    /// the first may pass the byte cap).
    pub async fn read(&self, from: Offset, limits: ReadLimits) -> Result<ReadResult, LogError> {
        self.read_capped(from, limits, None).await
    }

    /// [`Self::read`] for a caller that set `room` bytes of memory aside
    /// for it (at least the byte cap): the first record may pass the byte
    /// cap only up to `room`, and what the read brings from disk (a chunk,
    /// a batch larger than one, two chunks joined) must fit what is left
    /// of `room`. Without a record yet, a read that does not fit returns
    /// nothing and `first_needs` says how much room it takes, so the
    /// caller can set that much aside and read again; with records, it
    /// ends with them. Records after the first keep to the byte cap.
    pub async fn read_within(
        &self,
        from: Offset,
        limits: ReadLimits,
        room: usize,
    ) -> Result<ReadResult, LogError> {
        self.read_capped(from, limits, Some(room.max(limits.max_bytes)))
            .await
    }

    async fn read_capped(
        &self,
        from: Offset,
        limits: ReadLimits,
        within: Option<usize>,
    ) -> Result<ReadResult, LogError> {
        let (start, end) = {
            let i = self.inner.borrow();
            if let Some(r) = &i.stopped {
                return Err(LogError::Stopped(r.clone()));
            }
            (i.start, i.frontiers.offset(Frontier::Durable))
        };
        let from = from.max(start);
        let mut out = ReadResult {
            records: Vec::new(),
            next: from,
            start,
            end,
            bytes: 0,
            first_needs: None,
        };
        if from >= end || limits.max_records == 0 {
            return Ok(out);
        }
        let mut bytes = 0usize;
        // Tail reads from memory.
        let served = {
            let i = self.inner.borrow();
            match i.cache.front() {
                Some(first) if first.header.base_offset <= from => {
                    let idx = i.cache.partition_point(|b| b.header.end_offset() <= from);
                    for b in i.cache.iter().skip(idx) {
                        if b.header.base_offset >= end {
                            break;
                        }
                        let more = take_batch(
                            &b.bytes,
                            &b.header,
                            &mut out,
                            limits,
                            within,
                            &mut bytes,
                            &self.hints,
                        )
                        .map_err(|e| {
                            let path = i.segments.get(&b.segment).map_or_else(
                                || i.dir.join(segment_name(b.segment)),
                                |s| s.path.clone(),
                            );
                            undecodable(&path, b.pos, &b.header, "in the tail cache", e)
                        })?;
                        if !more {
                            break;
                        }
                    }
                    true
                }
                _ => false,
            }
        };
        if served {
            out.next = out.next.min(end);
            out.bytes = bytes;
            return Ok(out);
        }
        self.read_cold(from, end, limits, within, &mut out, &mut bytes)
            .await
            .inspect_err(|e| self.note_damage(e))?;
        out.next = out.next.min(end);
        out.bytes = bytes;
        Ok(out)
    }

    /// Count a damaged batch a read met (failing at it, or passing it), and
    /// report each damaged place once (a group polling at it meets it on
    /// every poll).
    fn note_damage(&self, e: &LogError) {
        let LogError::Corrupt { path, position, .. } = e else {
            return;
        };
        let mut i = self.inner.borrow_mut();
        i.corrupt_reads += 1;
        let place = (path.clone(), *position);
        if !i.damage_reported.contains(&place) {
            tracing::error!("a read met damage in a segment: {e}");
            if i.damage_reported.len() >= 16 {
                i.damage_reported.remove(0);
            }
            i.damage_reported.push(place);
        }
    }

    async fn read_cold(
        &self,
        from: Offset,
        end: Offset,
        limits: ReadLimits,
        within: Option<usize>,
        out: &mut ReadResult,
        bytes: &mut usize,
    ) -> Result<(), LogError> {
        let mut seg_base = {
            let i = self.inner.borrow();
            match i.segments.range(..=from).next_back() {
                Some((b, _)) => *b,
                None => return Ok(()),
            }
        };
        loop {
            // `expected`: the offset the batch at `pos` starts at. Batches
            // follow one another without a gap, which a read checks as
            // well as their checksums: an open takes a sealed segment's
            // summary for what it holds without reading it, so a batch
            // written in the wrong place (its checksum good) is found here.
            let (file, path, mut pos, mut expected, seg_len, seg_end, chunk) = {
                let i = self.inner.borrow();
                let Some(s) = i.segments.get(&seg_base) else {
                    return Ok(()); // removed by retention meanwhile
                };
                let idx = s.index.partition_point(|(o, _)| *o <= out.next);
                let (expected, pos) = if idx == 0 {
                    (s.base, 0)
                } else {
                    s.index[idx - 1]
                };
                (
                    s.file.clone(),
                    s.path.clone(),
                    pos,
                    expected,
                    s.len,
                    s.end,
                    i.config.read_chunk_bytes,
                )
            };
            let mut buf = Bytes::new();
            // A damaged batch passed (below): owed as the read's error until
            // a batch after it verifies and follows on.
            let mut passed: Option<LogError> = None;
            'segment: while pos < seg_len {
                if buf.len() < format::BATCH_HEADER_BYTES {
                    let want = chunk.min((seg_len - pos) as usize);
                    let room = within.map(|r| r.saturating_sub(*bytes));
                    buf = match self
                        .cold_read(
                            &file,
                            seg_base,
                            pos,
                            format::BATCH_HEADER_BYTES,
                            want.max(format::BATCH_HEADER_BYTES),
                            room,
                        )
                        .await?
                    {
                        Brought::Bytes(b) => b,
                        Brought::Needs(n) => {
                            out.needs_room(n);
                            return Ok(());
                        }
                    };
                }
                loop {
                    let parsed = match format::parse_header(&buf) {
                        Ok(h)
                            if buf.len() >= h.len as usize
                                && self.cold_verified(seg_base, pos, &buf[..h.len as usize]) =>
                        {
                            Ok(h)
                        }
                        _ => format::parse_batch(&buf).inspect(|h| {
                            self.mark_cold_verified(seg_base, pos, h.len);
                        }),
                    };
                    match parsed {
                        Ok(h) => {
                            if h.base_offset != expected || !h.plausible() {
                                return Err(LogError::Corrupt {
                                    path: path.display().to_string(),
                                    position: pos,
                                    reason: format!(
                                        "a {:?} batch of {} records at offset {} where a batch \
                                         at offset {expected} was expected",
                                        h.kind, h.record_count, h.base_offset
                                    ),
                                });
                            }
                            expected = h.end_offset();
                            passed = None;
                            let batch = buf.split_to(h.len as usize);
                            let at = pos;
                            pos += h.len as u64;
                            if h.base_offset >= end {
                                return Ok(());
                            }
                            let more =
                                take_batch(&batch, &h, out, limits, within, bytes, &self.hints)
                                    .map_err(|e| undecodable(&path, at, &h, "read from disk", e))?;
                            if !more {
                                return Ok(());
                            }
                        }
                        Err(FrameError::Incomplete(more)) => {
                            let want = (buf.len() + more).max(chunk).min((seg_len - pos) as usize);
                            if want < buf.len() + more {
                                return Err(LogError::Corrupt {
                                    path: path.display().to_string(),
                                    position: pos,
                                    reason: "batch runs past the segment's end".into(),
                                });
                            }
                            let room = within.map(|r| r.saturating_sub(*bytes));
                            buf = match self
                                .cold_read(&file, seg_base, pos, buf.len() + more, want, room)
                                .await?
                            {
                                Brought::Bytes(b) => b,
                                Brought::Needs(n) => {
                                    out.needs_room(n);
                                    return Ok(());
                                }
                            };
                            continue 'segment;
                        }
                        Err(e) => {
                            let damage = LogError::Corrupt {
                                path: path.display().to_string(),
                                position: pos,
                                reason: e.to_string(),
                            };
                            // One damaged batch at a time may be passed;
                            // it is owed as the error until a verified
                            // batch in this segment follows on from it.
                            let passable = passed
                                .is_none()
                                .then(|| passable(&e, &buf, expected, out.next))
                                .flatten();
                            let Some(h) = passable else {
                                return Err(damage);
                            };
                            self.note_damage(&damage);
                            passed = Some(damage);
                            let _ = buf.split_to(h.len as usize);
                            pos += h.len as u64;
                            expected = h.end_offset();
                        }
                    }
                    if buf.is_empty() {
                        continue 'segment;
                    }
                }
            }
            // The segment ended on a passed batch: nothing vouches for
            // where its header says it ends.
            if let Some(damage) = passed {
                return Err(damage);
            }
            // Next segment.
            let next = {
                let i = self.inner.borrow();
                i.segments
                    .range(seg_end..)
                    .next()
                    .map(|(b, _)| *b)
                    .filter(|b| *b > seg_base)
            };
            match next {
                Some(b) if b < end => {
                    seg_base = b;
                    out.next = out.next.max(b);
                }
                _ => return Ok(()),
            }
        }
    }

    /// Whether `batch`, the bytes at `pos` of `segment`, is memory of a cold
    /// chunk (the very bytes, not a later read of the same place) in which
    /// it was verified.
    fn cold_verified(&self, segment: Offset, pos: u64, batch: &[u8]) -> bool {
        let len = batch.len() as u64;
        let i = self.inner.borrow();
        let joined = i.joined.as_ref().is_some_and(|j| {
            j.verified
                && (j.segment, j.pos) == (segment, pos)
                && len <= j.bytes.len() as u64
                && std::ptr::eq(batch.as_ptr(), j.bytes.as_ptr())
        });
        joined
            || i.cold.iter().any(|c| {
                c.holds(segment, pos, len)
                    && c.verified.0 <= pos
                    && pos + len <= c.verified.1
                    && std::ptr::eq(batch.as_ptr(), c.bytes[(pos - c.pos) as usize..].as_ptr())
            })
    }

    /// Note that the batch of `len` bytes at `pos` of `segment` passed its
    /// checksum, in every cold chunk that holds it.
    fn mark_cold_verified(&self, segment: Offset, pos: u64, len: u32) {
        let end = pos + u64::from(len);
        let mut i = self.inner.borrow_mut();
        if let Some(j) = i.joined.as_mut() {
            if (j.segment, j.pos) == (segment, pos) && u64::from(len) <= j.bytes.len() as u64 {
                j.verified = true;
            }
        }
        for c in i.cold.iter_mut() {
            if !c.holds(segment, pos, u64::from(len)) {
                continue;
            }
            let (a, b) = c.verified;
            c.verified = if a == b {
                (pos, end)
            } else if pos == b {
                (a, end)
            } else if end == a {
                (pos, b)
            } else if a <= pos && end <= b {
                (a, b)
            } else {
                // Not adjacent: keep the newer run (readers move forward).
                (pos, end)
            };
        }
    }

    /// Bytes of segment `segment` from `pos`: from a recent chunk that
    /// holds at least `need` bytes from there, at most `max(want, need)`
    /// of them (no more than a disk read returns); otherwise `want` bytes
    /// read from disk and kept as a chunk. A reader moving forward through
    /// the chunks asks for the next one to be read ahead (see
    /// [`ShardLog::run_read_ahead`]); one that needs a chunk being read
    /// ahead waits for it rather than reading it again. With `room`, bytes
    /// that would take more memory than that to bring (a disk read, two
    /// chunks joined) are not brought: the answer says how much.
    async fn cold_read(
        &self,
        file: &S::File,
        segment: Offset,
        pos: u64,
        need: usize,
        want: usize,
        room: Option<usize>,
    ) -> Result<Brought, LogError> {
        loop {
            let arrived = self.ahead.wait();
            match self.kept_or_claim(segment, pos, need, want, room) {
                Cold::Kept(bytes) => return Ok(Brought::Bytes(bytes)),
                Cold::Read => break,
                Cold::Coming => arrived.await,
                Cold::Needs(n) => return Ok(Brought::Needs(n)),
            }
        }
        let in_flight = Reading {
            log: self,
            read: (segment, pos, want as u64),
        };
        let read = file.read_at(pos, want).await;
        drop(in_flight);
        let bytes = read.map_err(|e| io_err("read", e))?;
        let mut i = self.inner.borrow_mut();
        if bytes.len() < need {
            // The file ends inside data the log holds: cut short from
            // outside while the broker runs. Said, not read again for ever.
            return Err(LogError::Corrupt {
                path: i.dir.join(segment_name(segment)).display().to_string(),
                position: pos + bytes.len() as u64,
                reason: format!(
                    "the segment file ends {} bytes into a read of {need} at byte {pos}, \
                     inside data the log holds (was it cut short while the broker ran?)",
                    bytes.len()
                ),
            });
        }
        i.cold_reads += 1;
        // A miss past the start of a kept chunk, up to where it ends, is a
        // reader moving forward out of it.
        let sequential = i
            .cold
            .iter()
            .any(|c| c.segment == segment && c.pos < pos && pos <= c.pos + c.bytes.len() as u64);
        keep_cold(&mut i, segment, pos, bytes.clone(), false);
        if sequential && bytes.len() >= want {
            self.want_ahead(&mut *i, segment, pos + bytes.len() as u64);
        }
        Ok(Brought::Bytes(bytes))
    }

    /// The bytes a cold read wants, from the kept chunks (one, or two a
    /// batch straddles), asking for the next chunk to be read ahead. If
    /// they are not kept and no read in flight brings them, lists this
    /// reader's own read in `reading` for it to issue. With `room`, bytes
    /// that would take more than that to bring are left ([`Cold::Needs`]).
    fn kept_or_claim(
        &self,
        segment: Offset,
        pos: u64,
        need: usize,
        want: usize,
        room: Option<usize>,
    ) -> Cold {
        let mut i = self.inner.borrow_mut();
        if let Some(k) = i
            .cold
            .iter()
            .position(|c| c.holds(segment, pos, need as u64))
        {
            i.cold_hits += 1;
            let tick = i.cold_hits;
            let whole = i.config.read_chunk_bytes;
            let c = &mut i.cold[k];
            c.used = tick;
            c.ahead = false;
            // At most what a disk read would return: a chunk another reader
            // read after the segment grew can run past the end this reader
            // took, into a batch it must not see cut short.
            let at = (pos - c.pos) as usize;
            let out = c.bytes.slice(at..(at + want.max(need)).min(c.bytes.len()));
            // A reader in a whole chunk (not the short one at a segment's
            // written end) will want the next one.
            let (end, full) = (c.pos + c.bytes.len() as u64, c.bytes.len() >= whole);
            if full {
                self.want_ahead(&mut i, segment, end);
            }
            return Cold::Kept(out);
        }
        // Across the end of one kept chunk into the one read after it
        // (chunks read ahead tile the segment, so a batch can straddle two):
        // the `need` bytes, copied into one piece.
        // The same batch joined for the last read (a poll of a few of its
        // records after another): already copied, and maybe verified.
        if let Some(j) = i.joined.as_ref() {
            if (j.segment, j.pos) == (segment, pos) && j.bytes.len() >= need {
                let out = j.bytes.clone();
                i.cold_hits += 1;
                return Cold::Kept(out);
            }
        }
        // (Not with too little room for the copy: then neither is there
        // for the disk read below.)
        let tick = i.cold_hits + 1;
        let joined = if room.is_some_and(|r| need > r) {
            None
        } else {
            straddle(&mut i.cold, segment, pos, need, tick)
        };
        if let Some((joined, (end, len))) = joined {
            i.cold_hits = tick;
            if len >= i.config.read_chunk_bytes {
                self.want_ahead(&mut i, segment, end);
            }
            i.joined = Some(Joined {
                segment,
                pos,
                bytes: joined.clone(),
                verified: false,
            });
            return Cold::Kept(joined);
        }
        // Wait for a read in flight only if it brings all the bytes needed
        // that no kept chunk holds, and they will be kept.
        let from = i
            .cold
            .iter()
            .find(|c| c.holds(segment, pos, 1))
            .map_or(pos, |c| c.pos + c.bytes.len() as u64);
        if i.config.cold_chunks > 0 && reading_brings(&i, segment, from, pos + need as u64) {
            return Cold::Coming;
        }
        if room.is_some_and(|r| want.max(need) > r) {
            return Cold::Needs(want.max(need));
        }
        i.reading.push((segment, pos, want as u64));
        Cold::Read
    }

    /// Ask for the chunk of `segment` at `pos` to be read ahead, unless it
    /// is kept, wanted or being read already, or keeping it would push out
    /// a chunk a reader may still be in: one used within the last
    /// `cold_chunks` reads served from chunks (with more readers moving
    /// through the shard than the chunks can hold, each keeps the chunk it
    /// is in and reads the next itself, as without read-ahead).
    fn want_ahead(&self, i: &mut Inner<S::File>, segment: Offset, pos: u64) {
        if i.config.cold_chunks < 2
            || crowded(i)
            || at_hand(i, segment, pos)
            || i.ahead.contains(&(segment, pos))
        {
            return;
        }
        if i.ahead.len() >= i.config.cold_chunks {
            i.ahead.pop_front();
        }
        i.ahead.push_back((segment, pos));
        self.ahead.wake_all();
    }

    /// Read ahead of sequential readers until the log closes: each chunk a
    /// reader is about to need (see `cold_read`) is read from disk and kept
    /// with the recent chunks, so a consumer working through a backlog
    /// rarely waits on the disk. One read at a time; a failed one is left
    /// to the reader to meet (and report) itself.
    pub async fn run_read_ahead(&self) {
        loop {
            let wanted = self.ahead.wait();
            let job = {
                let mut i = self.inner.borrow_mut();
                if i.closed || i.stopped.is_some() {
                    i.ahead.clear();
                    return;
                }
                let mut job = None;
                while let Some((segment, pos)) = i.ahead.pop_front() {
                    let chunk = i.config.read_chunk_bytes;
                    let Some(s) = i.segments.get(&segment) else {
                        continue; // removed by retention meanwhile
                    };
                    // Crowded since it was wanted: no chunk may go for it now.
                    if pos >= s.len || crowded(&i) || at_hand(&i, segment, pos) {
                        continue;
                    }
                    // Never past the segment's written length: bytes below
                    // it do not change while the log is open.
                    let len = chunk.min((s.len - pos) as usize);
                    job = Some((s.file.clone(), segment, pos, len));
                    break;
                }
                if let Some((_, segment, pos, len)) = &job {
                    i.reading.push((*segment, *pos, *len as u64));
                }
                job
            };
            let Some((file, segment, pos, len)) = job else {
                wanted.await;
                continue;
            };
            let in_flight = Reading {
                log: self,
                read: (segment, pos, len as u64),
            };
            let read = file.read_at(pos, len).await;
            drop(in_flight);
            {
                let mut i = self.inner.borrow_mut();
                match read {
                    Ok(bytes) if !bytes.is_empty() && i.segments.contains_key(&segment) => {
                        i.cold_read_ahead += 1;
                        keep_cold(&mut i, segment, pos, bytes, true);
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(segment = segment.0, pos, "read ahead failed: {e}");
                    }
                }
            }
            self.ahead.wake_all();
        }
    }
}

/// A batch whose checksum matched but whose records do not decode.
fn undecodable(path: &Path, pos: u64, h: &BatchHeader, from: &str, e: FrameError) -> LogError {
    LogError::Corrupt {
        path: path.display().to_string(),
        position: pos,
        reason: format!(
            "the batch of offsets {}..{} ({from}) does not decode: {e}",
            h.base_offset,
            h.end_offset()
        ),
    }
}

/// Where the last few reads stopped inside a batch: the batch (by its base
/// offset, which names one batch of a shard for the life of the log), the
/// offset of the first record not read, and where that record starts. Small
/// reads working through a large batch in order (a group polling 16 at a
/// time through batches of 1,000) start where the last one stopped instead
/// of stepping over every record before it again.
#[derive(Default)]
pub(super) struct ReadHints {
    slots: [Option<(Offset, Offset, format::RecordPos)>; 4],
    next: usize,
}

impl ReadHints {
    /// The furthest known start in batch `base` at or below `from`, and the
    /// slot it is in.
    fn find(&self, base: Offset, from: Offset) -> Option<(usize, format::RecordPos)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(k, s)| s.map(|s| (k, s)))
            .filter(|(_, (b, o, _))| *b == base && *o <= from)
            .max_by_key(|(_, (_, o, _))| *o)
            .map(|(k, (_, _, p))| (k, p))
    }

    /// Remember where a read of batch `base` stopped. A read that started at
    /// a hint (`used`, the slot `find` gave it) replaces that hint; another
    /// takes the oldest slot, never a hint another reader is using.
    fn note(&mut self, base: Offset, pos: format::RecordPos, used: Option<usize>) {
        let slot = used.unwrap_or_else(|| {
            let n = self.next;
            self.next = (n + 1) % self.slots.len();
            n
        });
        self.slots[slot] = Some((base, base.plus(pos.index as u64), pos));
    }
}

/// The header of the damaged batch at the start of `buf` if a read from
/// `next` may pass it: only its checksum fails, and its header still places
/// it (it starts at `expected`, is plausible, lies wholly below `next` and
/// whole in `buf`). The next batch must then verify and start where this
/// one says it ends (checked as every batch is), so no offset from `next`
/// on can be skipped.
fn passable(e: &FrameError, buf: &[u8], expected: Offset, next: Offset) -> Option<BatchHeader> {
    if !matches!(e, FrameError::Checksum { .. }) {
        return None;
    }
    format::parse_header(buf).ok().filter(|h| {
        h.base_offset == expected
            && h.plausible()
            && h.end_offset() <= next
            && buf.len() >= h.len as usize
    })
}

/// Take the records of one batch at or above `out.next`. Returns false when
/// a limit was reached and reading should stop.
fn take_batch(
    batch: &Bytes,
    h: &BatchHeader,
    out: &mut ReadResult,
    limits: ReadLimits,
    within: Option<usize>,
    bytes: &mut usize,
    hints: &RefCell<ReadHints>,
) -> Result<bool, FrameError> {
    if h.end_offset() <= out.next {
        return Ok(true);
    }
    match h.kind {
        BatchKind::Group => Ok(true),
        BatchKind::Control => {
            out.next = h.end_offset();
            Ok(true)
        }
        BatchKind::Records => {
            let mut full = false;
            let from = out.next;
            let hint = hints.borrow().find(h.base_offset, from);
            let start = hint.map(|(_, p)| p);
            let stopped = format::for_each_record_from(batch, h, from, start, |r| {
                // The byte cap counts what a record holds in memory
                // (everything it carries, and its headers' lengths) and
                // is never crossed, except by the first record (only up to
                // the room given, `within`), so a read holds at most the cap
                // plus one record however large, or many, keys and headers
                // are.
                let size = r.memory_bytes();
                if out.records.len() >= limits.max_records
                    || (!out.records.is_empty() && *bytes + size > limits.max_bytes)
                {
                    full = true;
                    return false;
                }
                if out.records.is_empty() && within.is_some_and(|room| size > room) {
                    out.first_needs = Some(size);
                    full = true;
                    return false;
                }
                *bytes += size;
                out.next = r.offset.next();
                out.records.push(r);
                true
            })?;
            if let Some(pos) = stopped {
                hints
                    .borrow_mut()
                    .note(h.base_offset, pos, hint.map(|(k, _)| k));
            }
            Ok(!full && out.records.len() < limits.max_records && *bytes < limits.max_bytes)
        }
    }
}

impl ReadResult {
    /// A read within a room met bytes it has no room left to bring: it
    /// ends with the records it has, or, with none, says what it takes.
    fn needs_room(&mut self, n: usize) {
        if self.records.is_empty() {
            self.first_needs = Some(n);
        }
    }
}

/// Where a cold read's bytes are to come from.
enum Cold {
    /// Kept in memory: here they are.
    Kept(Bytes),
    /// A read in flight brings them: wait for it, then look again.
    Coming,
    /// Nowhere yet: read them (the read is listed as in flight).
    Read,
    /// Bringing them takes this many bytes, more than the read has room
    /// for.
    Needs(usize),
}

/// What a cold read brought: the bytes, or how much room bringing them
/// takes (more than the read had).
enum Brought {
    Bytes(Bytes),
    Needs(usize),
}

/// A cold read in flight, listed in `Inner::reading` from before it is
/// issued until it completes or its future is dropped, whichever comes
/// first: readers waiting for its bytes look again either way.
struct Reading<'a, S: Storage> {
    log: &'a ShardLog<S>,
    read: (Offset, u64, u64),
}

impl<S: Storage> Drop for Reading<'_, S> {
    fn drop(&mut self) {
        if let Ok(mut i) = self.log.inner.try_borrow_mut() {
            if let Some(k) = i.reading.iter().position(|r| *r == self.read) {
                i.reading.swap_remove(k);
            }
        }
        self.log.ahead.wake_all();
    }
}

/// A batch `straddle` joined, with whether its checksum was verified.
pub(super) struct Joined {
    pub(super) segment: Offset,
    pub(super) pos: u64,
    pub(super) bytes: Bytes,
    pub(super) verified: bool,
}

/// The `need` bytes of `segment` from `pos`, copied from two kept chunks
/// when one ends inside them and another holds the rest (both marked used
/// at `tick`); with the end and length of the second.
fn straddle(
    cold: &mut VecDeque<ColdChunk>,
    segment: Offset,
    pos: u64,
    need: usize,
    tick: u64,
) -> Option<(Bytes, (u64, usize))> {
    let a = cold.iter().position(|c| c.holds(segment, pos, 1))?;
    let split = cold[a].pos + cold[a].bytes.len() as u64;
    let rest = (pos + need as u64).checked_sub(split)?;
    let b = cold.iter().position(|c| c.holds(segment, split, rest))?;
    let mut joined = Vec::with_capacity(need);
    joined.extend_from_slice(&cold[a].bytes[(pos - cold[a].pos) as usize..]);
    let from = (split - cold[b].pos) as usize;
    joined.extend_from_slice(&cold[b].bytes[from..from + rest as usize]);
    for k in [a, b] {
        cold[k].used = tick;
        cold[k].ahead = false;
    }
    let second = &cold[b];
    Some((
        Bytes::from(joined),
        (second.pos + second.bytes.len() as u64, second.bytes.len()),
    ))
}

/// The chunk to let go of first: the least recently used of those a reader
/// has used, else the oldest read ahead.
fn victim(cold: &VecDeque<ColdChunk>) -> Option<usize> {
    (0..cold.len()).min_by_key(|&k| (cold[k].ahead, cold[k].used))
}

/// Whether every chunk is taken: the one that would go for a chunk read
/// ahead was used within the last `cold_chunks` reads served from chunks
/// (a reader may still be in it), or is itself read ahead and unused.
fn crowded<F>(i: &Inner<F>) -> bool {
    if i.cold.len() < i.config.cold_chunks {
        return false;
    }
    victim(&i.cold).is_none_or(|k| {
        let c = &i.cold[k];
        c.ahead || c.used + i.config.cold_chunks as u64 > i.cold_hits
    })
}

/// Whether a cold read in flight brings bytes `[from, to)` of `segment`.
fn reading_brings<F>(i: &Inner<F>, segment: Offset, from: u64, to: u64) -> bool {
    i.reading
        .iter()
        .any(|&(s, p, len)| s == segment && p <= from && to <= p + len)
}

/// Whether the byte of `segment` at `pos` is kept in a chunk or on its way.
fn at_hand<F>(i: &Inner<F>, segment: Offset, pos: u64) -> bool {
    i.cold.iter().any(|c| c.holds(segment, pos, 1)) || reading_brings(i, segment, pos, pos + 1)
}

/// Keep `bytes`, read from `segment` at `pos`, as the newest cold chunk
/// (letting go of `victim`s past `cold_chunks`, and of any older chunk read
/// from the same place).
fn keep_cold<F>(i: &mut Inner<F>, segment: Offset, pos: u64, bytes: Bytes, ahead: bool) {
    if i.config.cold_chunks == 0 || bytes.is_empty() {
        return;
    }
    i.cold
        .retain(|c| !(c.segment == segment && c.pos >= pos && c.pos < pos + bytes.len() as u64));
    while i.cold.len() >= i.config.cold_chunks {
        let Some(k) = victim(&i.cold) else { break };
        i.cold.remove(k);
    }
    let used = i.cold_hits;
    i.cold.push_back(ColdChunk {
        segment,
        pos,
        bytes,
        verified: (pos, pos),
        used,
        ahead,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_readers_in_one_batch_keep_their_own_hints() {
        let pos = |index: u32| format::RecordPos {
            index,
            at: index as usize * 10,
        };
        let base = Offset(1000);
        let mut h = ReadHints::default();
        // Two readers start in the batch, far apart, neither from a hint.
        h.note(base, pos(100), None);
        h.note(base, pos(500), None);
        // Each moves on from its own hint; neither takes the other's.
        for step in 1..20u32 {
            let (k, a) = h
                .find(base, base.plus(100 + 16 * (step - 1) as u64))
                .unwrap();
            assert_eq!(a.index, 100 + 16 * (step - 1));
            h.note(base, pos(a.index + 16), Some(k));
            let (k, b) = h
                .find(base, base.plus(500 + 16 * (step - 1) as u64))
                .unwrap();
            assert_eq!(b.index, 500 + 16 * (step - 1));
            h.note(base, pos(b.index + 16), Some(k));
        }
        // Another batch, and offsets below every hint, find nothing.
        assert_eq!(h.find(Offset(7), Offset(2000)), None);
        assert_eq!(h.find(base, base.plus(50)), None);
    }
}
