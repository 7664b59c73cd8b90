//! Opening a log: the marks, the sealed segments' summaries (or a scan of
//! those without one), the scan of the newest segment, and how its tail is
//! told apart from damage (a torn last write is cut; anything older that
//! does not verify refuses the open).

use super::*;
use futures_util::StreamExt;

impl<S: Storage> ShardLog<S> {
    /// Open (or create) the log in `dir`, recovering its tail. Group
    /// entries are passed to `replay` in log order, from the newest complete
    /// group snapshot a sealed segment's summary vouches for (else from the
    /// log's start): see [`ShardLog::set_snapshot_provider`].
    pub async fn open(
        storage: S,
        dir: &Path,
        config: LogConfig,
        replay: &mut dyn FnMut(Replayed<'_>),
    ) -> Result<Self, LogError> {
        assert!(config.write_chunk_bytes.is_multiple_of(ALIGN) && config.write_chunk_bytes > 0);
        assert!(config.io_depth > 0, "io_depth must be at least 1");
        storage
            .create_dir_all(dir)
            .await
            .map_err(|e| io_err("create shard directory", e))?;
        let names = storage
            .list_dir(dir)
            .await
            .map_err(|e| io_err("list shard directory", e))?;
        // Only the names the log gives its files (twenty digits): `5.log` or
        // `+5.log` is not segment 5 (whose file would then be missing), but
        // a file the log does not know.
        let ours = |n: &str, ext: &str| {
            let base = n.strip_suffix(ext)?.strip_suffix('.')?;
            let ours = base.len() == 20 && base.bytes().all(|b| b.is_ascii_digit());
            ours.then(|| base.parse::<u64>().ok().map(Offset))?
        };
        let mut bases: Vec<Offset> = names.iter().filter_map(|n| ours(n, "log")).collect();
        bases.sort();
        let (tail_mark, clean) = read_marks(&storage, dir).await?;
        if let Some(newest) = tail_mark {
            if bases.last().is_none_or(|b| *b < newest) {
                let left = match bases.last() {
                    None => "no segment file is left".to_string(),
                    Some(b) => format!("the newest segment file left starts at offset {b}"),
                };
                return Err(LogError::Corrupt {
                    path: dir.join(segment_name(newest)).display().to_string(),
                    position: 0,
                    reason: format!(
                        "missing: the log had rolled to a segment starting at offset {newest} \
                         ({TAIL_MARK}), but {left}; segment files were lost, and opening the \
                         shard would give their offsets out again, so it is not opened (to \
                         open it anyway, accepting the loss, remove {TAIL_MARK}, and \
                         {CLEAN_MARK} if there is one)"
                    ),
                });
            }
        }

        // Every segment file opened and sized, and each sealed one's summary
        // read (`summary`): where one is trusted the segment is not read.
        // Several at a time: a shard may have thousands of segments.
        let count = bases.len();
        if let Some(&base) = bases.last().filter(|b| **b >= Offset::LIMIT) {
            return Err(LogError::Corrupt {
                path: dir.join(segment_name(base)).display().to_string(),
                position: 0,
                reason: format!("segment named for offset {base}, past any a log reaches"),
            });
        }
        let mut found: Vec<Found<S::File>> =
            futures_util::stream::iter(bases.iter().copied().enumerate())
                .map(|(i, base)| {
                    let storage = &storage;
                    async move {
                        let path = dir.join(segment_name(base));
                        let file = storage
                            .open(&path, false)
                            .await
                            .map_err(|e| io_err("open segment", e))?;
                        let size = file.size().await.map_err(|e| io_err("size", e))?;
                        let summary = if i + 1 < count {
                            read_summary(storage, dir, base, size).await
                        } else {
                            None
                        };
                        Ok::<_, LogError>(Found {
                            base,
                            path,
                            file: Rc::new(file),
                            size,
                            summary,
                        })
                    }
                })
                .buffered(OPEN_AT_ONCE)
                .collect::<Vec<_>>()
                .await
                .into_iter()
                .collect::<Result<_, _>>()?;
        // Group entries are replayed from the newest complete snapshot a
        // summary vouches for (the state before it is in it), else from
        // the start: (segment, position).
        let mut replay_start: Option<(Offset, u64)> = None;
        // A snapshot in the newest segment, as the summary before it vouches
        // for it: (segment, where the snapshot starts and ends). A segment
        // ending short of that has lost durable data.
        let mut vouched: Option<(Offset, u64, u64)> = None;
        for (k, f) in found.iter().enumerate() {
            let Some(s) = &f.summary else { continue };
            if let Some(at) = s.snapshot_at {
                replay_start = Some((f.base, at));
            }
            if let (Some((at, until)), Some(next)) = (s.next_snapshot, found.get(k + 1)) {
                if next.base == s.end {
                    replay_start = Some((next.base, at));
                    vouched = Some((next.base, at, until));
                }
            }
        }
        // Whether the open replays from a segment before the newest: then
        // the snapshot it queues is vouched for once durable.
        let replays_old = found.len() > 1
            && replay_start.is_none_or(|(b, _)| Some(b) != found.last().map(|f| f.base));
        // A scrub reads every segment and replays everything (the check
        // of what the summaries vouch for still holds it).
        if config.verify_on_open {
            replay_start = None;
            for f in &mut found {
                f.summary = None;
            }
        }

        let mut segments = BTreeMap::new();
        // Summaries of sealed segments scanned for want of one, written
        // once the open has passed its checks: the next open need not read
        // them (a log from before summaries gets them at its first open).
        let mut heal = Vec::new();
        let mut expected: Option<Offset> = None;
        let mut lsn = Lsn::ZERO;
        let mut tail_page = Vec::new();
        // Stamp of the last flush found on disk: new flushes continue after it.
        let mut last_flush: Option<u16> = None;
        let mut data_end = Offset::ZERO;
        for (i, f) in found.into_iter().enumerate() {
            let Found {
                base,
                path,
                file,
                size,
                summary,
            } = f;
            let is_tail = i + 1 == count;
            if let Some(exp) = expected {
                if exp != base {
                    return Err(LogError::Corrupt {
                        path: path.display().to_string(),
                        position: 0,
                        reason: format!(
                            "segment starts at offset {base} but the previous one ends at {exp}"
                        ),
                    });
                }
            }
            // Where in this segment group entries are replayed from (none:
            // not at all).
            let holds_groups = summary.as_ref().is_none_or(|s| s.groups);
            let replay_from = match replay_start {
                Some((b, _)) if base < b => None,
                _ if !holds_groups => None,
                Some((b, at)) if base == b => Some(at),
                _ => Some(0),
            };
            if let (Some(s), None) = (&summary, replay_from) {
                let seg = Segment::summarised(path, file, s.clone());
                if let Some(d) = seg.data_end {
                    data_end = d;
                }
                last_flush = seg.last_flush.or(last_flush);
                lsn = lsn.plus(seg.len);
                expected = Some(seg.end);
                segments.insert(base, seg);
                continue;
            }
            let mut seg = Segment::empty(base, path.clone(), file, size);
            seg.snapshot_at = summary.as_ref().and_then(|s| s.snapshot_at);
            let mut notes = Vec::new();
            let scanned =
                scan_segment(&seg, size, &config, replay_from, replay, &mut notes).await?;
            let valid_len = scanned.valid_len;
            for (h, pos) in &notes {
                seg.note_batch(h, *pos, config.index_interval_bytes);
            }
            // Before anything is judged or cut: a segment ending inside the
            // snapshot its predecessor's summary vouches for.
            if let Some((b, at, until)) = vouched {
                if b == base && valid_len < until {
                    return Err(LogError::Corrupt {
                        path: path.display().to_string(),
                        position: valid_len,
                        reason: format!(
                            "the segment ends at byte {valid_len}{}, inside the group snapshot \
                             at bytes {at}..{until}, which the summary of the segment before it \
                             says was durable: durable data is missing, and group \
                             state could be rebuilt from part of a snapshot, so the shard is not \
                             opened (to open it anyway, rebuilding group state from older \
                             segments and accepting the loss, remove {})",
                            scanned
                                .problem
                                .as_ref()
                                .map(|(_, why)| format!(" ({why})"))
                                .unwrap_or_default(),
                            summary::summary_name(
                                segments.keys().next_back().copied().unwrap_or(base)
                            )
                        ),
                    });
                }
            }

            if let Some(d) = seg.data_end {
                data_end = d;
            }
            last_flush = seg.last_flush.or(last_flush);
            if is_tail && scanned.problem.is_none() {
                held_to_clean(clean, &path, base, &seg, valid_len, None)?;
            }
            if let Some((pos, reason)) = scanned.problem {
                if !is_tail {
                    return Err(LogError::Corrupt {
                        path: path.display().to_string(),
                        position: pos,
                        reason,
                    });
                }
                // The last segment: a torn last write is cut off, damage to
                // data written before it refuses the open (see
                // `look_past_damage`).
                let chunk = config.read_chunk_bytes.max(1 << 20);
                let past = look_past_damage(&*seg.file, size, pos, scanned.expected, chunk).await?;
                if !matches!(
                    past,
                    Some(PastDamage {
                        later_flush: Some(_),
                        ..
                    })
                ) {
                    held_to_clean(clean, &path, base, &seg, valid_len, Some((pos, &reason)))?;
                }
                match past {
                    Some(PastDamage {
                        first: (q, h),
                        later_flush: Some((q2, h2)),
                    }) => {
                        return Err(LogError::Corrupt {
                            path: path.display().to_string(),
                            position: pos,
                            reason: format!(
                                "{reason}; the batch here should start at offset {}, but valid \
                                 batches written by more than one flush follow it (the next at \
                                 byte {q}, offset {}; one from a later flush at byte {q2}, \
                                 offset {}): this is damage to data written before the last \
                                 flush, not a torn write, and cutting the log here would drop \
                                 acknowledged records, so the shard is not opened",
                                scanned.expected, h.base_offset, h2.base_offset
                            ),
                        });
                    }
                    Some(PastDamage { first: (q, h), .. }) => {
                        tracing::warn!(
                            segment = %path.display(),
                            position = pos,
                            dropped = size - pos,
                            "truncating a torn last write: {reason}; the valid batches after it \
                             (from byte {q}, offset {}) were all written by the same, last flush, \
                             which never completed",
                            h.base_offset
                        );
                    }
                    // An unsealed tail normally ends in zeros (the partial
                    // last page, or preallocated space).
                    None if reason.starts_with("zero") => {}
                    None => {
                        tracing::warn!(
                            segment = %path.display(),
                            position = pos,
                            dropped = size - pos,
                            "truncating a torn or corrupt tail: {reason}"
                        );
                    }
                }
            }
            seg.len = valid_len;
            seg.zeroed = valid_len;
            if !is_tail && summary.is_none() && !config.verify_on_open {
                heal.push(seg.summary());
            }
            if is_tail {
                let page_start = align_down(valid_len);
                let page_end = align_up(valid_len).min(size);
                let page = if page_end > page_start {
                    seg.file
                        .read_at(page_start, (page_end - page_start) as usize)
                        .await
                        .map_err(|e| io_err("read tail page", e))?
                } else {
                    Bytes::new()
                };
                let in_page = (valid_len - page_start) as usize;
                if page.len() < in_page {
                    return Err(io_err(
                        "read tail page",
                        std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
                    ));
                }
                // The data's last page is kept whole when what follows the
                // data in it is zeros (its padding): the next flush rewrites
                // that page, and on a full disk it then needs no new block
                // (a filesystem with blocks under a page allocates them).
                let keep = if page[in_page..].iter().all(|&b| b == 0) {
                    page_end.max(valid_len)
                } else {
                    valid_len
                };
                if size != keep {
                    cut_to(&*seg.file, keep, "trim tail").await?;
                }
                seg.reserved = keep;
                tail_page = page[..in_page].to_vec();
            }
            lsn = lsn.plus(seg.len);
            expected = Some(seg.end);
            segments.insert(base, seg);
        }
        if segments.is_empty() {
            let path = dir.join(segment_name(Offset::ZERO));
            let file = storage
                .open(&path, true)
                .await
                .map_err(|e| io_err("create segment", e))?;
            storage
                .sync_dir(dir)
                .await
                .map_err(|e| io_err("sync shard directory", e))?;
            segments.insert(
                Offset::ZERO,
                Segment::empty(Offset::ZERO, path, Rc::new(file), 0),
            );
        }
        // Summaries that stand for no sealed segment: one whose segment
        // retention removed (stopped between the two removals), one for the
        // newest segment (which may grow), and what an interrupted summary
        // write left.
        let newest = *segments.keys().next_back().unwrap();
        let stale: Vec<&String> = names
            .iter()
            .filter(|n| match ours(n, summary::SUMMARY_EXT) {
                Some(base) => base == newest || !segments.contains_key(&base),
                None => ours(n, "tmp").is_some(),
            })
            .collect();
        for name in &stale {
            let path = dir.join(name);
            storage
                .remove_file(&path)
                .await
                .map_err(|e| io_err(&format!("remove {}", path.display()), e))?;
        }
        if !stale.is_empty() {
            storage
                .sync_dir(dir)
                .await
                .map_err(|e| io_err("sync shard directory", e))?;
        }
        futures_util::stream::iter(&heal)
            .for_each_concurrent(OPEN_AT_ONCE, |s| {
                summary::write_summary(&storage, dir, s, false)
            })
            .await;
        // Before the log takes a write: a clean mark left behind would make
        // the next open after a crash refuse a torn write as damage, and
        // a log from before tail marks (or a new one) gets its first.
        if clean.is_some() {
            storage
                .remove_file(&dir.join(CLEAN_MARK))
                .await
                .map_err(|e| io_err(&format!("remove {CLEAN_MARK}"), e))?;
            storage
                .sync_dir(dir)
                .await
                .map_err(|e| io_err("sync shard directory", e))?;
        }
        if tail_mark.is_none() {
            let newest = *segments.keys().next_back().unwrap();
            storage
                .write_file_atomic(&dir.join(TAIL_MARK), &marks::encode_tail(newest))
                .await
                .map_err(|e| io_err(&format!("write {TAIL_MARK}"), e))?;
        }
        let start = *segments.keys().next().unwrap();
        let (end, projected_len, end_base) = {
            let tail = segments.values().next_back().unwrap();
            (tail.end, tail.len, tail.base)
        };
        let inner = Inner {
            flush_stamp: last_flush.map_or(1, |f| f.wrapping_add(1)),
            data_end,
            config,
            dir: dir.to_path_buf(),
            segments,
            start,
            frontiers: Frontiers::new(Point { offset: end, lsn }),
            projected_len,
            snapshot_len: 0,
            target_base: end_base,
            pending: VecDeque::new(),
            pending_bytes: 0,
            chunk_hint: 0,
            tail_page,
            cache: VecDeque::new(),
            cache_bytes: 0,
            cold: VecDeque::new(),
            joined: None,
            cold_hits: 0,
            cold_reads: 0,
            corrupt_reads: 0,
            damage_reported: Vec::new(),
            cold_read_ahead: 0,
            ahead: VecDeque::new(),
            reading: Vec::new(),
            stopped: None,
            closed: false,
            flushing: false,
            removal_unsynced: false,
            flushes: 0,
            bytes_written: 0,
            sync: SyncStats::default(),
            snapshot: None,
            covers: Vec::new(),
            vouch_pending: replays_old,
        };
        Ok(ShardLog {
            storage,
            inner: Rc::new(RefCell::new(inner)),
            progress: Rc::new(WaitList::new()),
            queued: Rc::new(WaitList::new()),
            written: Rc::new(WaitList::new()),
            ahead: Rc::new(WaitList::new()),
            hints: Rc::new(RefCell::new(ReadHints::default())),
        })
    }
}

/// A log closed cleanly (`clean`) must end exactly where it did then, in
/// its newest segment (`base`, scanned to `valid_len`, `problem` where the
/// scan stopped short): nothing can have been torn since. Checked before
/// recovery cuts anything.
fn held_to_clean<F>(
    clean: Option<Clean>,
    path: &Path,
    base: Offset,
    seg: &Segment<F>,
    valid_len: u64,
    problem: Option<(u64, &str)>,
) -> Result<(), LogError> {
    let Some(c) = clean else { return Ok(()) };
    if c.tail_base == base && c.tail_len == valid_len && c.end == seg.end {
        // Zeros past the end at most (a reservation cut short).
        return Ok(());
    }
    if (base, valid_len) > (c.tail_base, c.tail_len) && seg.end >= c.end {
        // Whole past where it was closed, and written on since by a broker
        // that did not take the mark away (an older one): nothing of what
        // the mark vouches for is missing, and what came after it is
        // recovered as after a crash.
        tracing::warn!(
            segment = %path.display(),
            "the log goes on past where it was closed cleanly (offset {}, {CLEAN_MARK}); \
             recovering what follows as after a crash",
            c.end
        );
        return Ok(());
    }
    let found = match problem {
        Some((pos, reason)) => format!("it is damaged at byte {pos}: {reason}"),
        None => format!(
            "it now ends at offset {} (byte {valid_len} of this segment)",
            seg.end
        ),
    };
    Err(LogError::Corrupt {
        path: path.display().to_string(),
        position: problem.map_or(valid_len, |p| p.0),
        reason: format!(
            "the shard was closed cleanly with its log ending at offset {} (byte {} of the \
             segment starting at offset {}, {CLEAN_MARK}), but {found}; no write can have been \
             torn since, so acknowledged records are damaged or missing, and the shard is not \
             opened (to open it anyway, accepting the loss, remove {CLEAN_MARK})",
            c.end, c.tail_len, c.tail_base
        ),
    })
}

/// A segment file found at open: its file, size, and the summary it can be
/// taken for (sealed segments only).
struct Found<F> {
    base: Offset,
    path: PathBuf,
    file: Rc<F>,
    size: u64,
    summary: Option<summary::Summary>,
}

/// Segments opened (and summaries read) at once when a log opens.
const OPEN_AT_ONCE: usize = 32;

/// The summary of the sealed segment `base`, `size` bytes long, if it has
/// one that can be trusted (see [`summary`]). Anything else is reported and
/// the segment scanned: a summary only spares a read.
async fn read_summary<S: Storage>(
    storage: &S,
    dir: &Path,
    base: Offset,
    size: u64,
) -> Option<summary::Summary> {
    let path = dir.join(summary::summary_name(base));
    let bytes = match storage.read_file(&path).await {
        Ok(Some(b)) => b,
        Ok(None) => return None,
        Err(e) => {
            tracing::warn!(summary = %path.display(), "cannot read a segment's summary (scanning the segment): {e}");
            return None;
        }
    };
    if summary::Summary::is_old(&bytes) {
        // Written by an earlier build: the open scans the segment and
        // writes it again.
        return None;
    }
    let why = match summary::Summary::decode(&bytes) {
        None => format!("not a valid summary ({} bytes)", bytes.len()),
        Some(s) if s.base != base => format!("it names the segment at offset {}", s.base),
        Some(s) if s.len != size => format!(
            "it describes {} bytes, and the segment file holds {size}",
            s.len
        ),
        Some(s) => return Some(s),
    };
    tracing::warn!(summary = %path.display(), "not using a segment's summary (scanning the segment): {why}");
    None
}

/// The shard's marks (see [`marks`]); one that cannot be read or decoded
/// refuses the open.
async fn read_marks<S: Storage>(
    storage: &S,
    dir: &Path,
) -> Result<(Option<Offset>, Option<Clean>), LogError> {
    async fn read<S: Storage, T>(
        storage: &S,
        dir: &Path,
        name: &str,
        decode: fn(&[u8]) -> Option<T>,
    ) -> Result<Option<T>, LogError> {
        let path = dir.join(name);
        let Some(bytes) = storage
            .read_file(&path)
            .await
            .map_err(|e| io_err(&format!("read {}", path.display()), e))?
        else {
            return Ok(None);
        };
        match decode(&bytes) {
            Some(v) => Ok(Some(v)),
            None => Err(LogError::Corrupt {
                path: path.display().to_string(),
                position: 0,
                reason: format!(
                    "not a valid {name} ({} bytes); it is written whole or not at all, so this \
                     is damage (see docs/operations.md before removing it)",
                    bytes.len()
                ),
            }),
        }
    }
    Ok((
        read(storage, dir, TAIL_MARK, marks::decode_tail).await?,
        read(storage, dir, CLEAN_MARK, marks::decode_clean).await?,
    ))
}

/// What [`scan_segment`] found.
struct Scanned {
    /// Length of the valid prefix.
    valid_len: u64,
    /// The offset the next batch after the valid prefix should start at.
    expected: Offset,
    /// If the scan stopped before the end of the file: where and why.
    problem: Option<(u64, String)>,
}

/// Scan a segment from its start, verifying every batch.
async fn scan_segment<F: StorageFile>(
    seg: &Segment<F>,
    size: u64,
    config: &LogConfig,
    replay_from: Option<u64>,
    replay: &mut dyn FnMut(Replayed<'_>),
    notes: &mut Vec<(BatchHeader, u64)>,
) -> Result<Scanned, LogError> {
    let mut pos = 0u64;
    let mut expected = seg.base;
    let mut buf = Bytes::new();
    let chunk = config.read_chunk_bytes.max(1 << 20);
    // The scan ends short of the file's end, at `pos`, for `why`.
    let stop = |pos: u64, expected: Offset, why: String| Scanned {
        valid_len: pos,
        expected,
        problem: Some((pos, why)),
    };
    while pos < size {
        match format::parse_batch(&buf) {
            Ok(h) => {
                if h.base_offset != expected {
                    let why = format!(
                        "batch at offset {} where {expected} was expected",
                        h.base_offset
                    );
                    return Ok(stop(pos, expected, why));
                }
                if !h.plausible() {
                    // Checksummed, yet not a batch the log writes (a control
                    // batch of two records would shift every offset after).
                    let why = format!(
                        "a {:?} batch of {} records in {} bytes",
                        h.kind, h.record_count, h.len
                    );
                    return Ok(stop(pos, expected, why));
                }
                let batch = buf.split_to(h.len as usize);
                match h.kind {
                    BatchKind::Group => {
                        if replay_from.is_some_and(|from| pos >= from) {
                            replay(Replayed::Group(&batch[format::BATCH_HEADER_BYTES..]));
                        }
                    }
                    BatchKind::Control => {}
                    BatchKind::Records => {
                        // Check the records decode, so a bad batch is found
                        // here and not by a reader later.
                        format::for_each_record(&batch, &h, Offset::ZERO, |_| true).map_err(
                            |e| LogError::Corrupt {
                                path: seg.path.display().to_string(),
                                position: pos,
                                reason: e.to_string(),
                            },
                        )?;
                    }
                }
                notes.push((h, pos));
                expected = h.end_offset();
                pos += h.len as u64;
            }
            Err(FrameError::Incomplete(more)) => {
                let have = buf.len() as u64;
                if pos + have >= size {
                    // Fewer zeros than a batch's length field are padding
                    // too: the end of the page a clean stop keeps.
                    let why = if buf.iter().all(|&b| b == 0) {
                        "zero bytes where a batch was expected"
                    } else {
                        "batch cut short by the end of the file"
                    };
                    return Ok(stop(pos, expected, why.into()));
                }
                let want = ((have as usize + more).max(chunk) as u64).min(size - pos) as usize;
                buf = seg
                    .file
                    .read_at(pos, want)
                    .await
                    .map_err(|e| io_err("read segment", e))?;
                if buf.len() as u64 <= have {
                    return Ok(stop(pos, expected, "short read".into()));
                }
            }
            Err(FrameError::Zero) => {
                // Zeros to the end of the file are padding of an unsealed
                // tail; anything else after them is damage.
                return Ok(stop(
                    pos,
                    expected,
                    "zero bytes where a batch was expected".into(),
                ));
            }
            Err(e) => return Ok(stop(pos, expected, e.to_string())),
        }
    }
    Ok(Scanned {
        valid_len: pos,
        expected,
        problem: None,
    })
}

/// Valid batches found past a bad spot in the last segment.
struct PastDamage {
    /// The first: its byte position and header.
    first: (u64, BatchHeader),
    /// One written by a different flush than `first`, if there is one.
    later_flush: Option<(u64, BatchHeader)>,
}

/// Look past a bad spot at byte `bad` of the last segment (the batch there
/// should have started at offset `expected`) for valid batches that continue
/// the log.
///
/// A torn last write and damage to older data both leave a bad batch, and
/// both can have valid batches after it: a multi-page O_DIRECT write is not
/// atomic, so pages of the last, unsynced flush can reach the disk after a
/// page before them did not. What tells them apart is which flushes wrote
/// what follows. Only the last flush can be unsynced (the flusher writes a
/// flush only after the one before it was synced), and every batch carries
/// its flush's stamp. Valid batches after the bad spot from two different
/// flushes mean the bad batch was written, and synced, before the last
/// flush: damage to acknowledged data. Valid batches from one flush only are
/// the last flush's surviving pages around a torn one.
///
/// Batches are packed back to back (flushes pad only the end of the file,
/// and the next flush overwrites that padding), so a batch can start at any
/// byte: this tries every position, skipping runs of zeros, and computes a
/// checksum only for a header that fits what continuing the log allows: a
/// known version and kind, a record count its length can hold, an end inside
/// the file, and a base offset at least `expected` and at most one offset per
/// [`format::RECORD_FIXED_BYTES`] bytes since the last valid batch. A
/// candidate's bytes are checksummed in chunks of at most `chunk`: nothing
/// is allocated from a length read from the file.
async fn look_past_damage<F: StorageFile>(
    file: &F,
    size: u64,
    bad: u64,
    expected: Offset,
    chunk: usize,
) -> Result<Option<PastDamage>, LogError> {
    const HEADER: u64 = format::BATCH_HEADER_BYTES as u64;
    let chunk = (chunk as u64).max(2 * HEADER);
    let mut first: Option<(u64, BatchHeader)> = None;
    // Start of the stretch since the last valid batch, and the offset the
    // next batch starts at or after.
    let mut gap = bad;
    let mut exp = expected;
    let mut q = bad + 1;
    let mut buf = Bytes::new();
    let mut buf_pos = q;
    while q + HEADER <= size {
        if q < buf_pos || q + HEADER > buf_pos + buf.len() as u64 {
            buf_pos = q;
            buf = file
                .read_at(q, chunk.min(size - q) as usize)
                .await
                .map_err(|e| io_err("read segment", e))?;
            if (buf.len() as u64) < HEADER {
                break;
            }
        }
        let b = &buf[(q - buf_pos) as usize..];
        let h = match format::parse_header(b) {
            Ok(h) => h,
            Err(FrameError::Zero) => {
                // A batch's length field has a nonzero byte: skip to three
                // bytes before the next one (the first four are zero).
                q = match first_nonzero(b) {
                    Some(n) => q + n as u64 - 3,
                    None => buf_pos + buf.len() as u64 - 3,
                };
                continue;
            }
            Err(_) => {
                q += 1;
                continue;
            }
        };
        let most = exp
            .0
            .saturating_add((q - gap) / format::RECORD_FIXED_BYTES as u64);
        let fits = h.plausible()
            && q + h.len as u64 <= size
            && h.base_offset >= exp
            && h.base_offset.0 <= most;
        if !fits || !checksum_matches(file, &buf, buf_pos, q, &h, chunk).await? {
            q += 1;
            continue;
        }
        match first {
            None => first = Some((q, h)),
            Some((_, f)) if f.flush != h.flush => {
                return Ok(Some(PastDamage {
                    first: first.unwrap(),
                    later_flush: Some((q, h)),
                }))
            }
            Some(_) => {}
        }
        q += h.len as u64;
        gap = q;
        exp = h.end_offset();
    }
    Ok(first.map(|first| PastDamage {
        first,
        later_flush: None,
    }))
}

/// Does the checksum of the batch at `q` (header `h`, its first bytes in
/// `buf`, which starts at `buf_pos`) match? Reads what `buf` lacks in pieces
/// of at most `chunk` bytes.
async fn checksum_matches<F: StorageFile>(
    file: &F,
    buf: &Bytes,
    buf_pos: u64,
    q: u64,
    h: &BatchHeader,
    chunk: u64,
) -> Result<bool, LogError> {
    let at = (q - buf_pos) as usize;
    let end = q + h.len as u64;
    let have = buf_pos + buf.len() as u64;
    if end <= have {
        return Ok(crc32c::crc32c(&buf[at + 8..at + h.len as usize]) == h.crc);
    }
    let mut crc = crc32c::crc32c(&buf[at + 8..]);
    let mut pos = have;
    while pos < end {
        let piece = file
            .read_at(pos, chunk.min(end - pos) as usize)
            .await
            .map_err(|e| io_err("read segment", e))?;
        if piece.is_empty() {
            return Ok(false);
        }
        crc = crc32c::crc32c_append(crc, &piece);
        pos += piece.len() as u64;
    }
    Ok(crc == h.crc)
}

/// Index of the first nonzero byte of `b`. Recovery runs this over the
/// zeros of a reserved tail (megabytes per shard at every open), so it tests
/// 64 bytes at a time (a loop the compiler vectorises) before looking for
/// the byte.
pub(super) fn first_nonzero(b: &[u8]) -> Option<usize> {
    const BLOCK: usize = 64;
    let mut blocks = b.chunks_exact(BLOCK);
    let mut at = 0;
    for block in blocks.by_ref() {
        if !block.iter().all(|x| *x == 0) {
            return block.iter().position(|x| *x != 0).map(|n| at + n);
        }
        at += BLOCK;
    }
    blocks
        .remainder()
        .iter()
        .position(|x| *x != 0)
        .map(|n| at + n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_nonzero_finds_the_first_set_byte_anywhere() {
        for len in [0usize, 1, 7, 63, 64, 65, 200, 4096] {
            assert_eq!(first_nonzero(&vec![0u8; len]), None, "len {len}");
            for at in 0..len {
                let mut b = vec![0u8; len];
                b[at] = 1;
                if at + 1 < len {
                    b[len - 1] = 9;
                }
                assert_eq!(first_nonzero(&b), Some(at), "len {len} at {at}");
            }
        }
    }
}
