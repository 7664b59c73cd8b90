//! Retention (whole sealed segments past the limits, each removal made
//! durable before the next) and destroying a deleted shard's files.

use super::*;

impl<S: Storage> ShardLog<S> {
    /// Delete whole sealed segments past the retention limits. Returns how
    /// many segments were removed.
    pub async fn enforce_retention(&self, now_ms: u64) -> Result<usize, LogError> {
        let mut removed = 0;
        loop {
            // Each removal is made durable before the next: then a crash can
            // bring back only the newest removed segment, never an older one
            // without the ones after it (a gap recovery would refuse). A
            // sync that failed last time is owed before anything else goes.
            if self.inner.borrow().removal_unsynced && !self.inner.borrow().closed {
                let dir = self.inner.borrow().dir.clone();
                self.storage.sync_dir(&dir).await.map_err(|e| {
                    tracing::error!(dir = %dir.display(), "syncing a shard directory after retention: {e}");
                    io_err(&format!("sync {}", dir.display()), e)
                })?;
                self.inner.borrow_mut().removal_unsynced = false;
            }
            let victim = {
                let i = self.inner.borrow();
                // A closed log's files may be gone, or another log's by
                // now (a stream deleted and created again): never touch
                // them. Checked with no await before the removal below.
                if i.closed || i.stopped.is_some() || i.segments.len() < 2 {
                    break;
                }
                let (base, first) = i.segments.iter().next().unwrap();
                let total: u64 = i.segments.values().map(|s| s.len).sum();
                let by_bytes = i.config.retention_bytes.is_some_and(|b| total > b);
                let by_age = i
                    .config
                    .retention_ms
                    .is_some_and(|ms| first.max_timestamp_ms.saturating_add(ms) < now_ms);
                // Never remove a segment that is not fully durable, nor one
                // whose group state no later durable snapshot holds.
                let durable = i.frontiers.lsn(Frontier::Durable);
                let covered = i.snapshot.is_none()
                    || i.covers
                        .iter()
                        .any(|c| c.segment > *base && c.end <= durable);
                if (by_bytes || by_age)
                    && covered
                    && first.end <= i.frontiers.offset(Frontier::Durable)
                {
                    Some(*base)
                } else {
                    None
                }
            };
            let Some(base) = victim else { break };
            // Remove the file first: until that is done the segment stays
            // readable and the log start does not move (a group must not
            // settle offsets as removed that a failed removal keeps).
            let (path, dir) = {
                let i = self.inner.borrow();
                (i.segments[&base].path.clone(), i.dir.clone())
            };
            if let Err(e) = self.storage.remove_file(&path).await {
                tracing::error!(segment = %path.display(), "retention cannot remove segment: {e}");
                return Err(io_err(&format!("remove {}", path.display()), e));
            }
            {
                let mut i = self.inner.borrow_mut();
                i.removal_unsynced = true;
                i.segments.remove(&base);
                i.covers.retain(|c| c.segment > base);
                i.cold.retain(|c| c.segment != base);
                if i.joined.as_ref().is_some_and(|j| j.segment == base) {
                    i.joined = None;
                }
                i.start = *i.segments.keys().next().unwrap();
                let start = i.start;
                while i
                    .cache
                    .front()
                    .is_some_and(|b| b.header.end_offset() <= start)
                {
                    let b = i.cache.pop_front().unwrap();
                    i.cache_bytes -= b.bytes.len();
                }
            }
            tracing::info!(segment = %path.display(), "retention removed segment");
            // Its summary after it (a summary left by a crash between the
            // two names no segment, and the next open removes it).
            let sum = dir.join(summary::summary_name(base));
            if let Err(e) = self.storage.remove_file(&sum).await {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(summary = %sum.display(), "cannot remove a removed segment's summary: {e}");
                }
            }
            // The start moved: waiting readers and polls look again, even
            // if the sync below fails.
            self.progress.wake_all();
            self.storage.sync_dir(&dir).await.map_err(|e| {
                tracing::error!(dir = %dir.display(), "syncing a shard directory after retention: {e}");
                io_err(&format!("sync {}", dir.display()), e)
            })?;
            self.inner.borrow_mut().removal_unsynced = false;
            removed += 1;
        }
        Ok(removed)
    }

    /// Delete every file of this log (after close).
    pub async fn destroy(&self) -> Result<(), LogError> {
        let dir = self.inner.borrow().dir.clone();
        self.inner.borrow_mut().closed = true;
        self.progress.wake_all();
        self.queued.wake_all();
        self.ahead.wake_all();
        self.storage.remove_dir_all(&dir).await.map_err(|e| {
            tracing::error!(dir = %dir.display(), "cannot remove a deleted shard's files: {e}");
            io_err(&format!("remove {}", dir.display()), e)
        })
    }
}
