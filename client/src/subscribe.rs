//! [`Subscription`]: follow one shard record by record.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use felix_wire::{Record, StartPosition, StreamRef};
use futures_lite::Stream;

use crate::client::Client;
use crate::error::{ClientError, Result};
use crate::types::ReadBatch;

type ReadFuture = Pin<Box<dyn Future<Output = (Result<ReadBatch>, Instant)> + Send>>;

/// Follows one shard from a starting position, yielding every record in
/// offset order and long-polling the broker at the tail. Made by
/// [`Client::subscribe`].
///
/// Use [`next`](Subscription::next), or use it as a
/// [`Stream`](futures_lite::Stream) of `Result<Record>`. It never ends by
/// itself. A failed read is yielded as an `Err` item; the next call retries
/// from the same position after a short pause, so a loop that keeps
/// calling `next` rides out a broker restart. Stop on errors you consider
/// permanent (such as `not_found`).
///
/// ```no_run
/// # async fn demo(client: felix_client::Client) -> Result<(), felix_client::ClientError> {
/// use felix_client::StartPosition;
///
/// let mut sub = client.subscribe("t1", "default", "events", 0, StartPosition::Earliest);
/// while let Some(record) = sub.next().await {
///     let record = record?;
///     println!("{}: {:?}", record.offset, record.payload);
/// }
/// # Ok(())
/// # }
/// ```
pub struct Subscription {
    client: Client,
    stream: StreamRef,
    shard: u32,
    position: StartPosition,
    max_records: u32,
    wait: Duration,
    buffered: VecDeque<Record>,
    in_flight: Option<ReadFuture>,
    pause: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Offsets retention removed before this subscription reached them.
    skipped: u64,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("stream", &self.stream)
            .field("shard", &self.shard)
            .field("position", &self.position)
            .field("buffered", &self.buffered.len())
            .finish()
    }
}

/// A read's answer must move forward from where it was asked to start:
/// records in ascending order at or above it, and the next position past
/// them. Anything else would repeat or skip records; it is refused as a
/// protocol error (and the same position read again).
fn check_batch(from: Option<u64>, batch: ReadBatch) -> Result<ReadBatch> {
    let mut prev: Option<u64> = None;
    for r in &batch.records {
        if from.is_some_and(|f| r.offset < f) || prev.is_some_and(|p| r.offset <= p) {
            return Err(ClientError::Protocol(format!(
                "read answer out of order: record {} after {prev:?}, asked from {from:?}",
                r.offset
            )));
        }
        prev = Some(r.offset);
    }
    if prev.is_some_and(|p| batch.next_offset <= p) || from.is_some_and(|f| batch.next_offset < f) {
        return Err(ClientError::Protocol(format!(
            "read answer's next offset {} does not move past its records (last {prev:?}, asked from {from:?})",
            batch.next_offset
        )));
    }
    Ok(batch)
}

/// An empty answer faster than this means the broker did not wait; pause
/// before asking again rather than spin.
const TOO_FAST: Duration = Duration::from_millis(20);
const EMPTY_PAUSE: Duration = Duration::from_millis(50);

impl Subscription {
    pub(crate) fn new(
        client: Client,
        stream: StreamRef,
        shard: u32,
        from: StartPosition,
    ) -> Subscription {
        Subscription {
            client,
            stream,
            shard,
            position: from,
            max_records: 500,
            wait: Duration::from_secs(10),
            buffered: VecDeque::new(),
            in_flight: None,
            pause: None,
            skipped: 0,
        }
    }

    /// How many offsets retention removed before this subscription read
    /// them: a reader that falls further behind than the stream's retention
    /// jumps to the oldest record the shard still holds (and logs a
    /// warning), and this says how far.
    pub fn skipped_by_retention(&self) -> u64 {
        self.skipped
    }

    /// Most records fetched per read (default 500).
    pub fn max_records(mut self, max_records: u32) -> Subscription {
        self.max_records = max_records.max(1);
        self
    }

    /// How long each read at the tail asks the broker to wait for new
    /// records (default 10 s).
    pub fn wait(mut self, wait: Duration) -> Subscription {
        self.wait = wait;
        self
    }

    /// Where the next read will start. Records already fetched but not yet
    /// yielded are below it.
    pub fn position(&self) -> StartPosition {
        self.position
    }

    /// The next record, waiting for one to be published if need be.
    /// Never `None`; `Option` only to match `StreamExt::next`.
    pub async fn next(&mut self) -> Option<Result<Record>> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx)).await
    }

    fn start_read(&mut self) -> ReadFuture {
        let client = self.client.clone();
        let stream = self.stream.clone();
        let (shard, from, max, wait) = (self.shard, self.position, self.max_records, self.wait);
        Box::pin(async move {
            let started = Instant::now();
            let r = client.read_ref(&stream, shard, from, max, wait).await;
            (r, started)
        })
    }
}

impl Stream for Subscription {
    type Item = Result<Record>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(r) = this.buffered.pop_front() {
                return Poll::Ready(Some(Ok(r)));
            }
            if let Some(pause) = &mut this.pause {
                if pause.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                this.pause = None;
            }
            if this.in_flight.is_none() {
                this.in_flight = Some(this.start_read());
            }
            let fut = this.in_flight.as_mut().expect("set above");
            let (result, started) = match fut.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(r) => r,
            };
            this.in_flight = None;
            let from = match this.position {
                StartPosition::Offset(o) => Some(o),
                _ => None,
            };
            match result.and_then(|b| check_batch(from, b)) {
                Ok(batch) => {
                    if let Some(f) = from.filter(|f| batch.start_offset > *f) {
                        let gap = batch.start_offset - f;
                        this.skipped += gap;
                        tracing::warn!(
                            stream = %this.stream, shard = this.shard, from = f,
                            start = batch.start_offset,
                            "subscription fell behind retention: {gap} offsets were removed before it read them"
                        );
                    }
                    this.position = StartPosition::Offset(batch.next_offset);
                    if batch.records.is_empty() && started.elapsed() < TOO_FAST {
                        this.pause = Some(Box::pin(tokio::time::sleep(EMPTY_PAUSE)));
                    }
                    this.buffered.extend(batch.records);
                }
                Err(e) => {
                    let backoff = this
                        .client
                        .config()
                        .reconnect_backoff_initial
                        .max(Duration::from_millis(100));
                    this.pause = Some(Box::pin(tokio::time::sleep(backoff)));
                    return Poll::Ready(Some(Err(e)));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(offsets: &[u64], next: u64, start: u64) -> ReadBatch {
        ReadBatch {
            records: offsets
                .iter()
                .map(|&offset| Record {
                    offset,
                    timestamp_ms: 0,
                    key: None,
                    headers: Default::default(),
                    payload: Default::default(),
                })
                .collect(),
            next_offset: next,
            start_offset: start,
            end_offset: next,
        }
    }

    #[test]
    fn a_read_answer_must_move_forward_from_where_it_was_asked() {
        // Fine: ascending from the position, next past the last; gaps
        // (control records, retention) are allowed.
        assert!(check_batch(Some(5), batch(&[5, 6, 9], 10, 0)).is_ok());
        assert!(check_batch(Some(5), batch(&[], 5, 0)).is_ok());
        assert!(check_batch(Some(5), batch(&[12], 13, 12)).is_ok());
        assert!(check_batch(None, batch(&[0, 1], 2, 0)).is_ok());
        // Refused: below the position, out of order, repeated, or a next
        // offset that would read the same records again.
        for (from, b) in [
            (Some(5), batch(&[4, 5], 6, 0)),
            (Some(5), batch(&[6, 5], 7, 0)),
            (Some(5), batch(&[5, 5], 6, 0)),
            (Some(5), batch(&[5, 6], 6, 0)),
            (Some(5), batch(&[], 4, 0)),
            (None, batch(&[3, 2], 4, 0)),
        ] {
            assert!(
                matches!(check_batch(from, b.clone()), Err(ClientError::Protocol(_))),
                "{from:?} {b:?}"
            );
        }
    }
}
