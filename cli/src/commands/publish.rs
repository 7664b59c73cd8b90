//! `felix publish`: records from the arguments or stdin, batched and
//! pipelined to one shard, every batch kept until it is acknowledged so that
//! one a broker refuses as not leading or as stopping (storing none of it),
//! or one that could not be sent to a broker found gone, goes on to the
//! shard's leader, and an exact report of what was stored when the publish
//! fails.

use std::collections::VecDeque;
use std::time::Duration;

use bytes::Bytes;
use felix_client::{Client, ClientError, RecordIn, StreamRef};
use tokio::io::{AsyncBufReadExt, AsyncReadExt};

use super::{connect_client, for_broker, records, Patience};
use crate::args::{GlobalArgs, PublishArgs};
use crate::CliError;

/// A publish sent and not yet known to be acknowledged.
type Answer = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<felix_client::Published, ClientError>> + Send>,
>;

enum Outcome {
    Waiting(Answer),
    /// Answered (seen by `check_failed` before its turn): records stored
    /// and the shard they went to, or the error.
    Answered(Result<(u64, u32), ClientError>),
}

impl Outcome {
    async fn wait(self) -> Result<(u64, u32), ClientError> {
        match self {
            Outcome::Waiting(answer) => answer.await.map(|p| (u64::from(p.count), p.shard)),
            Outcome::Answered(result) => result,
        }
    }
}

/// A publish the broker refused whole: nothing of its batch was stored.
/// The broker says so ([`ClientError::not_applied`]: a disk nearly full, a
/// broker stopping, a shard stopped before the batch was queued), and these
/// codes say it by themselves for a publish. Any other error (a lost
/// connection, a timeout, a shard stopped while writing the batch) leaves
/// the batch's fate unknown.
fn refused_whole(e: &ClientError) -> bool {
    e.not_applied()
        || matches!(
            e.code(),
            Some(
                felix_client::ErrorCode::InvalidRequest
                    | felix_client::ErrorCode::NotFound
                    | felix_client::ErrorCode::TooLarge
                    | felix_client::ErrorCode::Unauthorized
                    | felix_client::ErrorCode::Unsupported
                    | felix_client::ErrorCode::WrongCore
                    // A follower, or a leader not yet serving: nothing
                    // proposed.
                    | felix_client::ErrorCode::NotLeader
            )
        )
}

/// Where a publish looks for the shard's leader.
enum Lead {
    /// Refused as `not_leader`, naming the leader or not.
    Named(Option<String>),
    /// The broker could not be reached (why).
    Unreachable(String),
    /// The broker refused the batches as `unavailable`, saying it stored
    /// none of them (it is stopping, say): why.
    Refused(String),
}

/// A refusal after which the batch goes on to the shard's leader (this
/// broker again once it is back, or another): nothing of it was stored,
/// and the refusal is about this broker, not the batch.
fn sent_on(e: &ClientError) -> bool {
    matches!(e, ClientError::NotLeader { .. })
        || (e.code() == Some(felix_client::ErrorCode::Unavailable) && e.not_applied())
}

/// `e`, an I/O error naming the broker it came from.
fn naming(e: ClientError, broker: &str) -> ClientError {
    match e {
        ClientError::Io(io) if !io.to_string().contains(broker) => ClientError::Io(
            std::io::Error::new(io.kind(), format!("cannot reach {broker}: {io}")),
        ),
        other => other,
    }
}

/// A batch in flight: input records `first ..= first + count - 1` (1-based,
/// in input order).
struct InFlight {
    first: u64,
    /// The batch, kept until it is acknowledged: sent again, in order, to
    /// the shard's leader if this broker refuses it as not leading.
    records: Vec<RecordIn>,
    outcome: Outcome,
}

/// A batch whose answer was an error, kept to be sent again.
struct Failed {
    first: u64,
    records: Vec<RecordIn>,
}

impl Failed {
    fn last(&self) -> u64 {
        last_of(self.first, &self.records)
    }
}

/// The input number of a batch's last record, the first being `first`.
fn last_of(first: u64, records: &[RecordIn]) -> u64 {
    first + records.len() as u64 - 1
}

/// A batch whose answer was an error, as `publish` reports it.
struct Unacked {
    first: u64,
    last: u64,
    why: String,
    /// The broker refused it whole: nothing of it stored.
    refused: bool,
}

/// The bit of `Pipeline::said_waits` past the three kinds of wait: a
/// leader a refusal named could not be reached.
const SAID_NAMED_UNREACHABLE: u8 = 1 << 3;

/// Keeps up to `in_flight` batches sent and unacknowledged, in order. Once
/// one fails, nothing more is sent (a batch sent after it, on a new
/// connection, would be stored after a gap), and on any error every batch
/// still in flight is settled so the count printed is every acknowledged
/// record and the rest are named as of unknown outcome.
///
/// Except for the refusals that are about the broker, not the batch (see
/// [`sent_on`]): a broker that does not lead the shard (a follower of a
/// cluster, or a leader just deposed) refuses each batch whole with
/// `not_leader`, and a stopping one with `unavailable`, storing none of it.
/// When every batch from the first refused one on was refused that way,
/// nothing after the last acknowledged batch is stored, so they are sent
/// again, in order, to the leader the refusal names (or to each broker
/// given in turn, this one again once it is back, for up to
/// [`ELECTION_WAIT`](super::ELECTION_WAIT)), and the publish goes on there.
struct Pipeline<'a> {
    client: Client,
    /// The broker `client` talks to, and every broker `--broker` named.
    current: String,
    global: &'a GlobalArgs,
    brokers: &'a [String],
    ack_on_commit: bool,
    stream: &'a StreamRef,
    shard: u32,
    in_flight: usize,
    pending: VecDeque<InFlight>,
    /// Input records handed to `send` so far.
    sent: u64,
    published: u64,
    /// Batches sent whose answer was an error.
    unknown: Vec<Unacked>,
    /// Shards that acknowledged records (one, unless a broker answered for
    /// another shard than asked).
    shards: std::collections::BTreeSet<u32>,
    /// Leaders followed so far, and the wait for one while none is known.
    follows: u32,
    /// The kinds of wait for a leader said since the last acknowledgement
    /// (a bit each, see `follow`).
    said_waits: u8,
    patience: Patience,
    /// The index in `brokers` of the broker asked last while no leader
    /// is known.
    next_broker: usize,
}

impl Pipeline<'_> {
    async fn send(&mut self, records: Vec<RecordIn>) -> Result<(), CliError> {
        if records.is_empty() {
            return Ok(());
        }
        if self.check_failed() {
            // Settled, and the refused batches sent to the leader, or the
            // publish ends here.
            while !self.pending.is_empty() {
                self.settle_one().await?;
            }
        }
        let (first, count) = (self.sent + 1, records.len() as u64);
        self.begin_or_move(first, records).await?;
        self.sent += count;
        while self.pending.len() >= self.in_flight {
            self.settle_one().await?;
        }
        Ok(())
    }

    /// Send a batch (input records from `first` on) on the current
    /// connection, behind those in flight. An error means it was not sent
    /// (the records come back with it).
    async fn begin(
        &mut self,
        first: u64,
        records: Vec<RecordIn>,
    ) -> Result<(), (ClientError, Vec<RecordIn>)> {
        let s = self.stream;
        let begun = self
            .client
            .begin_publish_batch(
                &s.tenant,
                &s.namespace,
                &s.stream,
                self.shard,
                records.clone(),
            )
            .await;
        match begun {
            Ok(answer) => {
                self.pending.push_back(InFlight {
                    first,
                    records,
                    outcome: Outcome::Waiting(std::future::IntoFuture::into_future(answer)),
                });
                Ok(())
            }
            Err(e) => Err((e, records)),
        }
    }

    /// [`Pipeline::begin`], and when the broker cannot be reached (the
    /// batch was not sent: the connection is gone, or the broker down),
    /// settle what is in flight and, if all of it was acknowledged, look
    /// for the shard's leader among the brokers named and send it there.
    async fn begin_or_move(&mut self, first: u64, records: Vec<RecordIn>) -> Result<(), CliError> {
        let mut records = records;
        loop {
            let e = match self.begin(first, records).await {
                Ok(()) => return Ok(()),
                Err((e, back)) => {
                    records = back;
                    e
                }
            };
            let e = naming(e, &self.current);
            if !matches!(
                e,
                ClientError::Io(_) | ClientError::Disconnected | ClientError::Timeout
            ) {
                return Err(e.into());
            }
            // What went out before it first: acknowledged (or sent on to
            // a leader), or the publish ends with its report.
            let before = self.current.clone();
            while !self.pending.is_empty() {
                self.settle_one().await?;
            }
            if self.current != before {
                // Settling followed a refusal to the leader: try there.
                continue;
            }
            if !self.follow(Lead::Unreachable(e.to_string())).await {
                return Err(e.into());
            }
        }
    }

    /// Look, without waiting, for answers that already came back; whether
    /// one of them is an error (the connection dropped under it, say).
    fn check_failed(&mut self) -> bool {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut failed = false;
        for f in &mut self.pending {
            if let Outcome::Waiting(answer) = &mut f.outcome {
                if let std::task::Poll::Ready(r) = answer.as_mut().poll(&mut cx) {
                    f.outcome = Outcome::Answered(r.map(|p| (u64::from(p.count), p.shard)));
                }
            }
            failed |= matches!(f.outcome, Outcome::Answered(Err(_)));
        }
        failed
    }

    /// Wait for the oldest batch's answer. On an error, every batch still
    /// in flight is settled too, and then either the refused ones go to the
    /// shard's leader or the error ends the publish.
    async fn settle_one(&mut self) -> Result<(), CliError> {
        let Some(f) = self.pending.pop_front() else {
            return Ok(());
        };
        let (first, records) = (f.first, f.records);
        match f.outcome.wait().await {
            Ok(acked) => {
                self.acked(acked);
                if self.follows > 0 {
                    // Through the failover: the next one gets the same
                    // patience.
                    self.follows = 0;
                    self.said_waits = 0;
                    self.patience = Patience::default();
                }
                Ok(())
            }
            Err(e) => self.after_error(Failed { first, records }, e).await,
        }
    }

    fn acked(&mut self, (n, shard): (u64, u32)) {
        self.published += n;
        self.shards.insert(shard);
    }

    async fn after_error(&mut self, failed: Failed, e: ClientError) -> Result<(), CliError> {
        // The failed batch and each after it, with its error. A batch
        // acknowledged after a refused one means the refused ones cannot
        // be sent again without reordering the input.
        let mut failures = vec![(failed, e)];
        let mut acked_after = false;
        while let Some(f) = self.pending.pop_front() {
            let (first, records) = (f.first, f.records);
            match f.outcome.wait().await {
                Ok(acked) => {
                    self.acked(acked);
                    acked_after = true;
                }
                Err(e) => failures.push((Failed { first, records }, e)),
            }
        }
        if failures.iter().all(|(_, e)| sent_on(e)) && !acked_after {
            let lead = match failures.iter().rev().find_map(|(_, e)| match e {
                // The newest word on who leads.
                ClientError::NotLeader { leader, .. } => Some(leader.clone()),
                _ => None,
            }) {
                Some(named) => Lead::Named(named),
                // Refused as unavailable (the broker stopping, its disk
                // nearly full): asked again after a pause, or the others.
                None => Lead::Refused(failures[0].1.to_string()),
            };
            if self.follow(lead).await {
                let mut again = failures.into_iter();
                while let Some((f, refusal)) = again.next() {
                    let (first, last) = (f.first, f.last());
                    if let Err((e, _)) = self.begin(first, f.records).await {
                        // Refused by the last broker, not sent to this
                        // one: not stored.
                        let why = format!("{refusal}; not sent again to {}: {e}", self.current);
                        self.unknown.push(Unacked {
                            first,
                            last,
                            why: why.clone(),
                            refused: true,
                        });
                        for (f, _) in again {
                            self.unknown.push(Unacked {
                                first: f.first,
                                last: f.last(),
                                why: why.clone(),
                                refused: true,
                            });
                        }
                        return Err(e.into());
                    }
                }
                return Ok(());
            }
        }
        let mut first_error = None;
        for (f, e) in failures {
            self.unknown.push(Unacked {
                first: f.first,
                last: f.last(),
                why: e.to_string(),
                refused: refused_whole(&e),
            });
            first_error.get_or_insert(e);
        }
        Err(first_error.expect("at least the failed batch").into())
    }

    /// Connect to the shard's leader: the one a refusal named, or while
    /// none is known (or the broker cannot be reached), each broker given
    /// in turn. Whether one was reached within the patience.
    async fn follow(&mut self, lead: Lead) -> bool {
        let (mut named, why) = match lead {
            Lead::Named(named) => (named, None),
            Lead::Unreachable(why) => (None, Some(Lead::Unreachable(why))),
            Lead::Refused(why) => (None, Some(Lead::Refused(why))),
        };
        // Said once a failover for each kind of wait: not again for each
        // broker asked.
        let kind = match &why {
            None => 0,
            Some(Lead::Unreachable(_)) => 1,
            Some(_) => 2,
        };
        let mut said_waiting = self.said_waits & (1 << kind) != 0;
        // The leader a refusal named, once it could not be reached.
        let mut named_unreachable: Option<String> = None;
        loop {
            if !self.patience.lasts() && self.follows >= 3 {
                return false;
            }
            let mut target_was_named = false;
            let target = match named.take() {
                Some(leader) if leader != self.current => {
                    target_was_named = true;
                    eprintln!(
                        "felix: {} does not lead shard {}; sending to the leader, {leader}",
                        self.current, self.shard
                    );
                    leader
                }
                _ => {
                    let asking = if self.brokers.len() > 1 {
                        "the brokers named in turn"
                    } else {
                        "again"
                    };
                    if let Some(leader) = named_unreachable.take() {
                        if self.said_waits & SAID_NAMED_UNREACHABLE == 0 {
                            self.said_waits |= SAID_NAMED_UNREACHABLE;
                            eprintln!(
                                "felix: {} named {leader} as shard {}'s leader, which cannot be \
                             reached (it may have just failed: an election follows); asking \
                             {asking}",
                                self.current, self.shard
                            );
                        }
                        said_waiting = true;
                    }
                    if !said_waiting {
                        match &why {
                            Some(Lead::Unreachable(why)) => eprintln!(
                                "felix: {why}; every batch sent was acknowledged, so the \
                                 rest goes to shard {}'s leader: asking {asking}",
                                self.shard
                            ),
                            Some(Lead::Refused(why)) => eprintln!(
                                "felix: {} refused the last batches, storing none of them \
                                 ({why}); they are sent again once shard {}'s leader takes \
                                 them: asking {asking}",
                                self.current, self.shard
                            ),
                            _ => eprintln!(
                                "felix: {} does not lead shard {} and names no leader yet \
                                 (an election, or a new leader catching up); asking {asking}",
                                self.current, self.shard
                            ),
                        }
                        said_waiting = true;
                        self.said_waits |= 1 << kind;
                    }
                    self.patience.pause().await;
                    self.next_broker = (self.next_broker + 1) % self.brokers.len();
                    self.brokers[self.next_broker].clone()
                }
            };
            self.follows += 1;
            if self.follows > 3 {
                self.patience.pause().await;
            }
            match connect_client(&for_broker(self.global, &target), self.ack_on_commit).await {
                Ok(client) => {
                    self.client = client;
                    self.current = target;
                    return true;
                }
                Err(e) => {
                    // `current` stays the broker `client` talks to (the one
                    // whose answers the messages speak of).
                    eprintln!("felix: {e}");
                    if target_was_named {
                        named_unreachable = Some(target);
                    }
                }
            }
        }
    }

    /// Whether a batch in flight has no answer yet.
    fn waiting(&self) -> bool {
        self.pending
            .iter()
            .any(|f| matches!(f.outcome, Outcome::Waiting(_)))
    }

    /// Wait for the next batch in flight to be answered, keeping the
    /// answer for its turn. Cancel-safe: a batch stays in flight until
    /// this returns.
    async fn next_answer(&mut self) {
        let waiting = self
            .pending
            .iter_mut()
            .find(|f| matches!(f.outcome, Outcome::Waiting(_)));
        if let Some(f) = waiting {
            if let Outcome::Waiting(answer) = &mut f.outcome {
                let r = answer.as_mut().await;
                f.outcome = Outcome::Answered(r.map(|p| (u64::from(p.count), p.shard)));
            }
        }
    }

    /// Settle the answered batches at the front, or every batch if one
    /// failed: a refusal as `not_leader` sends them on to the leader now,
    /// not when the next line arrives (stdin may be quiet for long).
    async fn take_answers(&mut self) -> Result<(), CliError> {
        if self.check_failed() {
            while !self.pending.is_empty() {
                self.settle_one().await?;
            }
        } else {
            while self
                .pending
                .front()
                .is_some_and(|f| matches!(f.outcome, Outcome::Answered(Ok(_))))
            {
                self.settle_one().await?;
            }
        }
        Ok(())
    }

    async fn finish(&mut self) -> Result<(), CliError> {
        while !self.pending.is_empty() {
            self.settle_one().await?;
        }
        Ok(())
    }

    /// After an error: wait for every answer still due (each comes back,
    /// fails with the connection, or times out), counting what was
    /// acknowledged.
    async fn settle_all(&mut self) {
        while let Some(f) = self.pending.pop_front() {
            let (first, last) = (f.first, last_of(f.first, &f.records));
            match f.outcome.wait().await {
                Ok(acked) => self.acked(acked),
                Err(e) => self.unknown.push(Unacked {
                    first,
                    last,
                    why: e.to_string(),
                    refused: refused_whole(&e),
                }),
            }
        }
    }
}

/// Records waiting to be sent as one batch.
struct Batch {
    records: Vec<RecordIn>,
    bytes: usize,
    key: Option<Bytes>,
    max_records: usize,
    max_bytes: usize,
}

impl Batch {
    fn push(&mut self, payload: Vec<u8>) {
        self.bytes += payload.len();
        self.records.push(RecordIn {
            key: self.key.clone(),
            payload: payload.into(),
            ..RecordIn::default()
        });
    }

    fn full(&self) -> bool {
        self.records.len() >= self.max_records || self.bytes >= self.max_bytes
    }

    fn take(&mut self) -> Vec<RecordIn> {
        self.bytes = 0;
        std::mem::take(&mut self.records)
    }
}

/// A partly filled batch read from stdin goes out after this long, so
/// lines typed or trickled in are not held back until the batch fills.
const LINGER: Duration = Duration::from_millis(50);

pub(super) async fn publish(
    global: &GlobalArgs,
    brokers: &[String],
    client: Client,
    args: PublishArgs,
) -> Result<(), CliError> {
    let s = &args.stream;
    let (shard, key) = match &args.key {
        Some(k) => {
            let info = client
                .describe_stream(&s.tenant, &s.namespace, &s.stream)
                .await?;
            let shard = felix_client::shard_for_key(k.as_bytes(), info.shards);
            (shard, Some(Bytes::from(k.clone())))
        }
        None => (args.shard.unwrap_or(0), None),
    };
    let mut pipe = Pipeline {
        client,
        current: global.broker.clone(),
        global,
        brokers,
        ack_on_commit: args.ack_on_commit,
        stream: s,
        shard,
        in_flight: args.in_flight.max(1),
        pending: VecDeque::new(),
        sent: 0,
        published: 0,
        unknown: Vec::new(),
        shards: Default::default(),
        follows: 0,
        said_waits: 0,
        patience: Patience::default(),
        next_broker: 0,
    };
    let mut batch = Batch {
        records: Vec::new(),
        bytes: 0,
        key,
        max_records: args.batch_records.max(1),
        max_bytes: args.batch_bytes.max(1),
    };
    let stdin = args.messages.is_empty();
    let result = if stdin {
        publish_stdin(&mut pipe, &mut batch).await
    } else {
        publish_messages(&mut pipe, &mut batch, args.messages).await
    };
    match result {
        Ok(()) => {
            // Which shard, since a --key picks it.
            let to = match pipe.shards.iter().collect::<Vec<_>>()[..] {
                [one] => format!(" to shard {one}"),
                _ => String::new(),
            };
            eprintln!("published {}{to}", records(pipe.published));
            Ok(())
        }
        Err(e) => {
            pipe.settle_all().await;
            let e = match e {
                CliError::Client(c) => CliError::Partial(c),
                other => other,
            };
            eprintln!("published {} before the error", records(pipe.published));
            // In input order (a batch not sent again after a refusal is
            // named before those sent again ahead of it were settled).
            pipe.unknown.sort_by_key(|u| u.first);
            for Unacked {
                first,
                last,
                why,
                refused,
            } in &pipe.unknown
            {
                let which = if first == last {
                    format!("input record {first}")
                } else {
                    format!("input records {first}-{last}")
                };
                if *refused {
                    eprintln!(
                        "{which} (counting from 1, in input order) refused by the broker \
                         ({why}): not stored"
                    );
                } else {
                    eprintln!(
                        "{which} (counting from 1, in input order) went out and got no \
                         acknowledgement ({why}): may or may not be stored"
                    );
                }
            }
            if pipe.sent == 0 {
                eprintln!("no input record was sent");
            } else {
                eprintln!("no input record after record {} was sent", pipe.sent);
            }
            Err(e)
        }
    }
}

async fn publish_messages(
    pipe: &mut Pipeline<'_>,
    batch: &mut Batch,
    messages: Vec<String>,
) -> Result<(), CliError> {
    for m in messages {
        batch.push(m.into_bytes());
        if batch.full() {
            pipe.send(batch.take()).await?;
        }
    }
    pipe.send(batch.take()).await?;
    pipe.finish().await
}

async fn publish_stdin(pipe: &mut Pipeline<'_>, batch: &mut Batch) -> Result<(), CliError> {
    let mut stdin = tokio::io::BufReader::with_capacity(256 * 1024, tokio::io::stdin());
    // Persists across cancelled reads: read_until appends what it got.
    let mut line = Vec::new();
    let mut flush_at = None;
    // A line is read up to one byte past the broker's frame limit: one
    // longer can never be published, and reading it whole (a stream of
    // bytes with no newline) would only exhaust memory.
    let limit = u64::from(pipe.client.max_frame_bytes());
    loop {
        let room = (limit + 1).saturating_sub(line.len() as u64);
        let mut bounded = (&mut stdin).take(room);
        let linger = flush_at.unwrap_or_else(|| tokio::time::Instant::now() + LINGER);
        let waiting = pipe.waiting();
        let read = tokio::select! {
            r = bounded.read_until(b'\n', &mut line) => Some(r?),
            _ = tokio::time::sleep_until(linger), if flush_at.is_some() => None,
            // While stdin is quiet, answers are still acted on (settled
            // here, out of the select: settling is not cancel-safe).
            () = pipe.next_answer(), if waiting => {
                pipe.take_answers().await?;
                continue;
            }
        };
        if line.len() as u64 > limit && line.last() != Some(&b'\n') {
            // Send the lines before it, then stop: `publish` reports what
            // was stored.
            let number = pipe.sent + batch.records.len() as u64 + 1;
            pipe.send(batch.take()).await?;
            return Err(CliError::Client(ClientError::InvalidArgument(format!(
                "input line {number} is longer than the broker's frame limit of {limit} \
                 bytes (server.max_frame_bytes), so no publish can carry it; it was not \
                 read to its end"
            ))));
        }
        match read {
            // The linger passed with the batch part full: send it.
            None => {
                flush_at = None;
                pipe.send(batch.take()).await?;
                continue;
            }
            Some(0) if line.is_empty() => break,
            Some(_) => {}
        }
        if line.last() == Some(&b'\n') {
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
        }
        batch.push(std::mem::take(&mut line));
        if batch.full() {
            flush_at = None;
            pipe.send(batch.take()).await?;
        } else if flush_at.is_none() {
            flush_at = Some(tokio::time::Instant::now() + LINGER);
        }
    }
    pipe.send(batch.take()).await?;
    pipe.finish().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_fill_by_records_or_bytes() {
        let mut b = Batch {
            records: Vec::new(),
            bytes: 0,
            key: Some(Bytes::from_static(b"k")),
            max_records: 3,
            max_bytes: 10,
        };
        b.push(b"ab".to_vec());
        b.push(b"cd".to_vec());
        assert!(!b.full());
        b.push(b"e".to_vec());
        assert!(b.full());
        let taken = b.take();
        assert_eq!(taken.len(), 3);
        assert_eq!(taken[0].key.as_deref(), Some(&b"k"[..]));
        assert!(!b.full());
        b.push(vec![0; 10]);
        assert!(b.full());
    }
}
