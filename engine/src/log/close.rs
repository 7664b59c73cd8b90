//! Closing a log: the last flush, giving back the active segment's
//! reservation, and the clean mark that holds the next open to where the
//! log ended.

use super::*;

impl<S: Storage> ShardLog<S> {
    /// Flush everything queued (waiting out a flush already in flight), then
    /// refuse further appends and wake everyone.
    pub async fn close(&self) -> Result<(), LogError> {
        let mut result = Ok(());
        loop {
            let progressed = self.progress.wait();
            let (flushing, pending, stopped) = {
                let i = self.inner.borrow();
                (i.flushing, !i.pending.is_empty(), i.stopped.clone())
            };
            if let Some(why) = stopped {
                result = Err(LogError::Stopped(why));
                break;
            }
            if flushing {
                progressed.await;
            } else if pending {
                if let Err(e) = self.flush().await {
                    result = Err(e);
                    break;
                }
            } else {
                break;
            }
        }
        self.inner.borrow_mut().closed = true;
        self.progress.wake_all();
        self.queued.wake_all();
        self.ahead.wake_all();
        if result.is_ok() {
            result = self.release_reservation().await;
        }
        if result.is_ok() {
            result = self.mark_clean().await;
        }
        result
    }

    /// Record where the closed log ends, for the next open to hold it to.
    async fn mark_clean(&self) -> Result<(), LogError> {
        let (dir, clean) = {
            let i = self.inner.borrow();
            if i.stopped.is_some() {
                return Ok(());
            }
            let Some(s) = i.segments.values().next_back() else {
                return Ok(());
            };
            let clean = Clean {
                end: s.end,
                tail_base: s.base,
                tail_len: s.len,
            };
            (i.dir.clone(), clean)
        };
        self.storage
            .write_file_atomic(&dir.join(CLEAN_MARK), &marks::encode_clean(clean))
            .await
            .map_err(|e| io_err(&format!("write {CLEAN_MARK}"), e))
    }

    /// Cut the active segment back to the end of its data's last page: a
    /// clean stop leaves no reserved blocks (nor zeros written ahead) for
    /// the next open to read through, and gives the space back, but keeps
    /// the blocks of the page the next flush rewrites (a filesystem with
    /// blocks under a page would otherwise need a new one for it, which a
    /// full disk refuses). Nothing is lost if this is cut short: recovery
    /// reads zeros past the data as the end.
    async fn release_reservation(&self) -> Result<(), LogError> {
        let (file, len, reserved) = {
            let i = self.inner.borrow();
            if i.stopped.is_some() {
                return Ok(());
            }
            let Some(s) = i.segments.values().next_back() else {
                return Ok(());
            };
            (s.file.clone(), s.len, s.reserved.max(s.zeroed))
        };
        // The page holding the data's end is written whole (padded with
        // zeros), so its blocks hold data or zeros.
        let keep = align_up(len);
        if reserved <= keep {
            return Ok(());
        }
        cut_to(&*file, keep, "release reservation").await?;
        let mut i = self.inner.borrow_mut();
        if let Some(s) = i.segments.values_mut().next_back() {
            s.reserved = keep;
            s.zeroed = keep;
        }
        Ok(())
    }
}
