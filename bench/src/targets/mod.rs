//! Brokers a workload can run against, behind one set of operations:
//! create the stream, publish batches (pipelined), replay shards, consume
//! through a group (poll, ack, nack), and count what the broker holds.
//!
//! Enum dispatch rather than trait objects: async methods, three targets,
//! and the hot loop stays free of boxing.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::cli::{Common, PeerMode, StreamName, TargetKind};

pub mod felix;
pub mod nats;
pub mod redis;

/// What the benchmark stream is used as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    /// Published and replayed.
    Log,
    /// Consumed through a consumer group (NATS: a work-queue stream).
    Queue,
}

#[derive(Debug, Clone)]
pub struct Spec {
    pub name: StreamName,
    pub shards: u32,
    pub kind: StreamKind,
    /// Headers every record is published with (Felix only).
    pub headers: Vec<(String, Bytes)>,
}

/// A record handed to a consumer, with what acknowledges it.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub handle: Handle,
    pub payload: Bytes,
    pub attempts: u32,
}

#[derive(Debug, Clone)]
pub enum Handle {
    Felix(felix_client::GroupRecord),
    Redis(Bytes),
    Nats(String),
}

/// What the report says about the broker.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TargetInfo {
    pub target: TargetKind,
    pub version: String,
    /// "embedded" or the address.
    pub broker: String,
    /// Durability in words (ack mode for Felix, configured mode for peers).
    pub mode: String,
    pub broker_cores: Option<String>,
}

#[derive(Debug, Clone)]
pub enum Target {
    Felix(felix::FelixTarget),
    Redis(redis::RedisTarget),
    Nats(nats::NatsTarget),
}

macro_rules! each {
    ($self:expr, $t:ident => $e:expr) => {
        match $self {
            Target::Felix($t) => $e,
            Target::Redis($t) => $e,
            Target::Nats($t) => $e,
        }
    };
}

impl Target {
    pub async fn connect(
        common: &Common,
        addr: &str,
        ack_on_commit: bool,
        spec: Arc<Spec>,
    ) -> Result<Target, String> {
        Ok(match common.target {
            TargetKind::Felix => Target::Felix(
                felix::FelixTarget::connect(
                    addr,
                    common.connections,
                    ack_on_commit,
                    common.token.clone(),
                    spec,
                )
                .await?,
            ),
            TargetKind::Redis => Target::Redis(redis::RedisTarget::connect(addr, spec).await?),
            TargetKind::Nats => Target::Nats(nats::NatsTarget::connect(addr, spec).await?),
        })
    }

    pub fn kind(&self) -> TargetKind {
        match self {
            Target::Felix(_) => TargetKind::Felix,
            Target::Redis(_) => TargetKind::Redis,
            Target::Nats(_) => TargetKind::Nats,
        }
    }

    pub async fn version(&self) -> String {
        match self {
            Target::Felix(t) => t.version(),
            Target::Redis(t) => t.version().await.unwrap_or_else(|e| format!("redis ({e})")),
            Target::Nats(t) => t.version(),
        }
    }

    /// Describe the peer's durability; for Redis, from its own CONFIG, and
    /// warn when it contradicts `--peer-mode`.
    pub async fn peer_mode(&self, declared: Option<PeerMode>) -> String {
        match self {
            Target::Felix(_) => String::new(),
            Target::Redis(t) => match t.durability().await {
                Ok((aof, fsync)) => {
                    let durable = aof == "yes" && fsync == "always";
                    let actual = if durable {
                        PeerMode::Durable
                    } else {
                        PeerMode::Default
                    };
                    if declared.is_some_and(|d| d != actual) {
                        eprintln!(
                            "felix-bench: warning: --peer-mode says {declared:?} but Redis runs appendonly={aof} appendfsync={fsync}"
                        );
                    }
                    format!(
                        "{} (appendonly {aof}, appendfsync {fsync})",
                        if durable { "durable" } else { "default" }
                    )
                }
                Err(e) => format!("unknown ({e})"),
            },
            Target::Nats(_) => match declared {
                Some(PeerMode::Durable) => "durable (sync_interval: always, as declared)".into(),
                Some(PeerMode::Default) => "default (sync_interval 2m, as declared)".into(),
                None => "as configured (not declared; pass --peer-mode)".into(),
            },
        }
    }

    pub async fn create(&self) -> Result<(), String> {
        each!(self, t => t.create().await)
    }

    pub async fn delete(&self) -> Result<(), String> {
        each!(self, t => t.delete().await)
    }

    /// Whether [`Target::stored`] counts exactly the records written: not
    /// on a Felix cluster, where each new leader's generation-start record
    /// takes an offset too.
    pub fn counts_exactly(&self) -> bool {
        match self {
            Target::Felix(t) => !t.is_cluster(),
            _ => true,
        }
    }

    /// Records `shard` holds now.
    pub async fn stored(&self, shard: u32) -> Result<u64, String> {
        each!(self, t => t.stored(shard).await)
    }

    /// Records of `shard` the group has not finished (acknowledged);
    /// `None` if the broker cannot say.
    pub async fn unfinished(&self, shard: u32) -> Result<Option<u64>, String> {
        each!(self, t => t.unfinished(shard).await)
    }

    /// A publisher, split into the half that sends batches and the half
    /// that waits for their acknowledgements (in order), so a paced sender
    /// never waits behind an acknowledgement.
    pub async fn producer(&self, idx: usize) -> Result<(PubTx, PubRx), String> {
        Ok(match self {
            Target::Felix(t) => (PubTx::Felix(t.producer(idx)), PubRx::Felix),
            Target::Redis(t) => {
                let (tx, rx) = t.producer().await?;
                (PubTx::Redis(tx), PubRx::Redis(rx))
            }
            Target::Nats(t) => {
                let (tx, rx) = t.producer().await?;
                (PubTx::Nats(tx), PubRx::Nats(rx))
            }
        })
    }

    pub async fn reader(&self, idx: usize) -> Result<Reader, String> {
        Ok(match self {
            Target::Felix(t) => Reader::Felix(t.reader(idx)),
            Target::Redis(t) => Reader::Redis(t.reader().await?),
            Target::Nats(t) => Reader::Nats(t.reader().await?),
        })
    }

    pub async fn consumer(&self, idx: usize, ack_inflight: usize) -> Result<Consumer, String> {
        Ok(match self {
            Target::Felix(t) => Consumer::Felix(t.consumer(idx, ack_inflight)),
            Target::Redis(t) => Consumer::Redis(t.consumer(idx).await?),
            Target::Nats(t) => Consumer::Nats(t.consumer().await?),
        })
    }
}

/// Sends publish batches.
#[derive(Debug)]
pub enum PubTx {
    Felix(felix::PubTx),
    Redis(redis::PubTx),
    Nats(nats::PubTx),
}

/// A batch on its way, to be completed by the matching [`PubRx`].
#[derive(Debug)]
pub enum Ticket {
    Felix(felix_client::PendingPublish),
    /// Replies (Redis) or PubAcks (NATS) to collect.
    Count(usize),
}

impl PubTx {
    /// Send a batch; returns once it is on its way.
    pub async fn send(&mut self, shard: u32, payloads: Vec<Bytes>) -> Result<Ticket, String> {
        match self {
            PubTx::Felix(p) => p.send(shard, payloads).await.map(Ticket::Felix),
            PubTx::Redis(p) => p.send(shard, payloads).await.map(Ticket::Count),
            PubTx::Nats(p) => p.send(shard, payloads).await.map(Ticket::Count),
        }
    }
}

/// Completes batches in the order they were sent.
#[derive(Debug)]
pub enum PubRx {
    Felix,
    Redis(redis::PubRx),
    Nats(nats::PubRx),
}

impl PubRx {
    /// Wait for a batch's acknowledgement; returns its record count.
    pub async fn complete(&mut self, ticket: Ticket) -> Result<u64, String> {
        match (self, ticket) {
            (PubRx::Felix, Ticket::Felix(p)) => felix::complete(p).await,
            (PubRx::Redis(r), Ticket::Count(n)) => r.complete(n).await,
            (PubRx::Nats(r), Ticket::Count(n)) => r.complete(n).await,
            _ => unreachable!("ticket from another target"),
        }
    }
}

#[derive(Debug)]
pub enum Reader {
    Felix(felix::Reader),
    Redis(redis::Reader),
    Nats(nats::Reader),
}

impl Reader {
    /// The next read of `shard` starts at its earliest record.
    pub async fn seek_start(&mut self, shard: u32) -> Result<(), String> {
        match self {
            Reader::Felix(r) => r.seek_start(shard).await,
            Reader::Redis(r) => r.seek_start(shard).await,
            Reader::Nats(r) => r.seek_start(shard).await,
        }
    }

    /// The next read of `shard` returns only records published from now.
    pub async fn seek_end(&mut self, shard: u32) -> Result<(), String> {
        match self {
            Reader::Felix(r) => r.seek_end(shard).await,
            Reader::Redis(r) => r.seek_end(shard).await,
            Reader::Nats(r) => r.seek_end(shard).await,
        }
    }

    /// Up to `max` payloads of `shard`, continuing where the last read
    /// stopped; at the end, waits up to `wait` where the target can.
    pub async fn read(
        &mut self,
        shard: u32,
        max: u32,
        wait: Duration,
    ) -> Result<Vec<Bytes>, String> {
        match self {
            Reader::Felix(r) => r.read(shard, max, wait).await,
            Reader::Redis(r) => r.read(shard, max, wait).await,
            Reader::Nats(r) => r.read(shard, max, wait).await,
        }
    }
}

#[derive(Debug)]
pub enum Consumer {
    Felix(felix::Consumer),
    Redis(redis::Consumer),
    Nats(nats::Consumer),
}

impl Consumer {
    pub async fn poll(
        &mut self,
        shard: u32,
        max: u32,
        wait: Duration,
    ) -> Result<Vec<Delivery>, String> {
        match self {
            Consumer::Felix(c) => c.poll(shard, max, wait).await,
            Consumer::Redis(c) => c.poll(shard, max, wait).await,
            Consumer::Nats(c) => c.poll(shard, max, wait).await,
        }
    }

    /// Acknowledge; may return before the broker confirms (see `finish`).
    pub async fn ack(&mut self, shard: u32, handles: Vec<Handle>) -> Result<(), String> {
        match self {
            Consumer::Felix(c) => c.ack(shard, handles).await,
            Consumer::Redis(c) => c.ack(shard, handles).await,
            Consumer::Nats(c) => c.ack(shard, handles).await,
        }
    }

    pub async fn nack(&mut self, shard: u32, handle: Handle) -> Result<(), String> {
        match self {
            Consumer::Felix(c) => c.nack(shard, handle).await,
            Consumer::Redis(c) => c.nack(shard, handle).await,
            Consumer::Nats(c) => c.nack(shard, handle).await,
        }
    }

    /// Wait until every acknowledgement sent has been confirmed/processed.
    pub async fn finish(&mut self) -> Result<(), String> {
        match self {
            Consumer::Felix(c) => c.finish().await,
            Consumer::Redis(c) => c.finish().await,
            Consumer::Nats(c) => c.finish().await,
        }
    }
}
