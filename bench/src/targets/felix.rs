//! The Felix driver: `felix-client`, pipelined.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use felix_client::{Client, ClientConfig, GroupRecord, PendingPublish, RecordIn, StartPosition};

use super::{Delivery, Handle, Spec, StreamKind};

pub const GROUP: &str = "bench";

#[derive(Debug, Clone)]
pub struct FelixTarget {
    clients: Vec<Client>,
    spec: Arc<Spec>,
    /// Whether this run created the stream: only then does `delete` remove
    /// it. A stream that already existed (`--stream` naming a user's own) is
    /// refused by `create` and never touched.
    created: Arc<std::sync::atomic::AtomicBool>,
}

fn e(err: felix_client::ClientError) -> String {
    err.to_string()
}

impl FelixTarget {
    pub async fn connect(
        addr: &str,
        connections: usize,
        ack_on_commit: bool,
        token: Option<String>,
        spec: Arc<Spec>,
    ) -> Result<FelixTarget, String> {
        let config = ClientConfig {
            client_name: concat!("felix-bench/", env!("CARGO_PKG_VERSION")).into(),
            ack_on_commit,
            token,
            request_timeout: Duration::from_secs(60),
            ..ClientConfig::default()
        };
        let mut clients = Vec::with_capacity(connections);
        // The broker prints its address before every core has bound it:
        // retry a refused connection for a few seconds.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        for _ in 0..connections {
            let c = loop {
                match Client::connect(addr, config.clone()).await {
                    Ok(c) => break c,
                    Err(err) if tokio::time::Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        let _ = err;
                    }
                    Err(err) => return Err(format!("cannot connect to Felix at {addr}: {err}")),
                }
            };
            clients.push(c);
        }
        Ok(FelixTarget {
            clients,
            spec,
            created: Default::default(),
        })
    }

    fn client(&self, idx: usize) -> &Client {
        &self.clients[idx % self.clients.len()]
    }

    pub fn version(&self) -> String {
        self.clients[0].broker()
    }

    pub fn cores(&self) -> u32 {
        self.clients[0].cores()
    }

    pub async fn create(&self) -> Result<(), String> {
        let s = &self.spec.name;
        let c = self.client(0);
        c.create_stream(
            &s.tenant,
            &s.namespace,
            &s.stream,
            self.spec.shards,
            Default::default(),
        )
        .await
        .map_err(|err| format!("create_stream {s}: {err}"))?;
        self.created
            .store(true, std::sync::atomic::Ordering::Relaxed);
        // Every client learns the placement once, before the clock starts.
        for c in &self.clients {
            c.describe_stream(&s.tenant, &s.namespace, &s.stream)
                .await
                .map_err(e)?;
        }
        if self.spec.kind == StreamKind::Queue {
            for shard in 0..self.spec.shards {
                c.group_create(
                    &s.tenant,
                    &s.namespace,
                    &s.stream,
                    shard,
                    GROUP,
                    StartPosition::Earliest,
                )
                .await
                .map_err(|err| format!("group_create shard {shard}: {err}"))?;
            }
        }
        Ok(())
    }

    /// Remove the benchmark stream, if this run created it.
    pub async fn delete(&self) -> Result<(), String> {
        if !self.created.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        let s = &self.spec.name;
        self.client(0)
            .delete_stream(&s.tenant, &s.namespace, &s.stream)
            .await
            .map_err(e)
    }

    /// Records the shard holds.
    pub async fn stored(&self, shard: u32) -> Result<u64, String> {
        let s = &self.spec.name;
        let info = self
            .client(0)
            .describe_shard(&s.tenant, &s.namespace, &s.stream, shard)
            .await
            .map_err(e)?;
        Ok(info.end_offset - info.start_offset)
    }

    /// Records of the shard the group has not finished: behind its position
    /// plus anything owed or in flight.
    pub async fn unfinished(&self, shard: u32) -> Result<Option<u64>, String> {
        let s = &self.spec.name;
        let info = self
            .client(0)
            .group_describe(&s.tenant, &s.namespace, &s.stream, shard, GROUP)
            .await
            .map_err(e)?;
        Ok(Some(
            info.lag() + u64::from(info.in_flight) + u64::from(info.owed),
        ))
    }

    pub fn producer(&self, idx: usize) -> PubTx {
        PubTx {
            client: self.client(idx).clone(),
            spec: self.spec.clone(),
        }
    }

    pub fn reader(&self, idx: usize) -> Reader {
        Reader {
            client: self.client(idx).clone(),
            spec: self.spec.clone(),
            next: vec![None; self.spec.shards as usize],
        }
    }

    pub fn consumer(&self, idx: usize, ack_inflight: usize) -> Consumer {
        Consumer {
            client: self.client(idx).clone(),
            spec: self.spec.clone(),
            acks: VecDeque::new(),
            ack_inflight,
        }
    }
}

/// The sending half of a publisher: `begin_publish_batch` returns once the
/// request is on the connection, with a [`PendingPublish`] to await.
#[derive(Debug)]
pub struct PubTx {
    client: Client,
    spec: Arc<Spec>,
}

impl PubTx {
    pub async fn send(
        &mut self,
        shard: u32,
        payloads: Vec<Bytes>,
    ) -> Result<PendingPublish, String> {
        let s = &self.spec.name;
        let records = payloads
            .into_iter()
            .map(|payload| RecordIn {
                payload,
                ..RecordIn::default()
            })
            .collect();
        self.client
            .begin_publish_batch(&s.tenant, &s.namespace, &s.stream, shard, records)
            .await
            .map_err(e)
    }
}

pub async fn complete(p: PendingPublish) -> Result<u64, String> {
    let published = p.await.map_err(e)?;
    Ok(u64::from(published.count))
}

#[derive(Debug)]
pub struct Reader {
    client: Client,
    spec: Arc<Spec>,
    /// Next offset per shard; `None`: from the earliest.
    next: Vec<Option<StartPosition>>,
}

impl Reader {
    pub async fn seek_start(&mut self, shard: u32) -> Result<(), String> {
        self.next[shard as usize] = Some(StartPosition::Earliest);
        Ok(())
    }

    pub async fn seek_end(&mut self, shard: u32) -> Result<(), String> {
        let s = &self.spec.name;
        let info = self
            .client
            .describe_shard(&s.tenant, &s.namespace, &s.stream, shard)
            .await
            .map_err(e)?;
        self.next[shard as usize] = Some(StartPosition::Offset(info.end_offset));
        Ok(())
    }

    pub async fn read(
        &mut self,
        shard: u32,
        max: u32,
        wait: Duration,
    ) -> Result<Vec<Bytes>, String> {
        let s = &self.spec.name;
        let from = self.next[shard as usize].unwrap_or(StartPosition::Earliest);
        let wait = (!wait.is_zero()).then_some(wait);
        let batch = self
            .client
            .read(&s.tenant, &s.namespace, &s.stream, shard, from, max, wait)
            .await
            .map_err(e)?;
        self.next[shard as usize] = Some(StartPosition::Offset(batch.next_offset));
        Ok(batch.records.into_iter().map(|r| r.payload).collect())
    }
}

#[derive(Debug)]
pub struct Consumer {
    client: Client,
    spec: Arc<Spec>,
    acks: VecDeque<felix_client::PendingAck>,
    ack_inflight: usize,
}

impl Consumer {
    pub async fn poll(
        &mut self,
        shard: u32,
        max: u32,
        wait: Duration,
    ) -> Result<Vec<Delivery>, String> {
        let s = &self.spec.name;
        let records = self
            .client
            .group_poll_wait(&s.tenant, &s.namespace, &s.stream, shard, GROUP, max, wait)
            .await
            .map_err(e)?;
        Ok(records
            .into_iter()
            .map(|r| Delivery {
                payload: r.payload.clone(),
                attempts: r.attempts,
                handle: Handle::Felix(r),
            })
            .collect())
    }

    /// Send an ack for `handles` without waiting for its answer (at most
    /// `ack_inflight` outstanding; the oldest is awaited first).
    pub async fn ack(&mut self, shard: u32, handles: Vec<Handle>) -> Result<(), String> {
        let offsets: Vec<u64> = handles
            .into_iter()
            .map(|h| match h {
                Handle::Felix(r) => r.offset,
                _ => unreachable!("felix consumer got a foreign handle"),
            })
            .collect();
        if offsets.is_empty() {
            return Ok(());
        }
        while self.acks.len() >= self.ack_inflight {
            self.wait_oldest().await?;
        }
        // Queued on the connection now, so the next poll leaves with it.
        let s = &self.spec.name;
        let pending = self
            .client
            .begin_group_ack_many(&s.tenant, &s.namespace, &s.stream, shard, GROUP, &offsets)
            .await
            .map_err(e)?;
        self.acks.push_back(pending);
        Ok(())
    }

    async fn wait_oldest(&mut self) -> Result<(), String> {
        if let Some(p) = self.acks.pop_front() {
            p.await.map_err(e)?;
        }
        Ok(())
    }

    pub async fn nack(&mut self, shard: u32, handle: Handle) -> Result<(), String> {
        let Handle::Felix(r) = handle else {
            unreachable!("felix consumer got a foreign handle")
        };
        let r: GroupRecord = r;
        let s = &self.spec.name;
        self.client
            .group_nack(&s.tenant, &s.namespace, &s.stream, shard, GROUP, &r)
            .await
            .map_err(e)
    }

    /// Wait for every outstanding ack.
    pub async fn finish(&mut self) -> Result<(), String> {
        while !self.acks.is_empty() {
            self.wait_oldest().await?;
        }
        Ok(())
    }
}
