//! Helpers shared by the consumer-group end-to-end tests (`groups_*.rs`):
//! broker options, a handle on one group of shard 0, and small assertions.

#![allow(dead_code)]

use bytes::Bytes;
use felix_client::{
    Client, ClientConfig, ClientError, DeadLetterInfo, GroupInfo, GroupMember, GroupPollOptions,
    StreamOptions,
};
use felix_tests::BrokerOptions;
use felix_wire::{ErrorCode, GroupRecord, RecordIn, StartPosition};
use std::future::Future;
use std::ops::Range;
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub const T: &str = "t";
pub const NS: &str = "ns";
/// The stream most tests use (one shard).
pub const JOBS: &str = "jobs";

/// A durable two-core broker with the given visibility timeout and attempt
/// bound; claims may be extended or delayed up to a minute.
pub fn opts(visibility_ms: u64, max_attempts: u32) -> BrokerOptions {
    BrokerOptions::default()
        .cores(2)
        .env("FELIX_GROUP_VISIBILITY_TIMEOUT_MS", visibility_ms)
        .env("FELIX_GROUP_MAX_ATTEMPTS", max_attempts)
        .env("FELIX_GROUP_MAX_VISIBILITY_MS", visibility_ms.max(60_000))
}

/// A broker config file (for settings with no environment variable), kept
/// alive as long as the value: pass `path` as `FELIX_TEST_CONFIG`.
pub struct ConfigFile {
    _dir: tempfile::TempDir,
    pub path: PathBuf,
}

pub fn config_file(toml: &str) -> ConfigFile {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("felix.toml");
    std::fs::write(&path, toml).expect("write config");
    ConfigFile { _dir: dir, path }
}

pub async fn client(addr: &str) -> Client {
    Client::connect(addr, ClientConfig::default())
        .await
        .expect("connect")
}

/// Create a one-shard stream.
pub async fn stream(c: &Client, name: &str) {
    c.create_stream(T, NS, name, 1, StreamOptions::default())
        .await
        .expect("create_stream");
}

/// Publish `n` records (payloads `p0`, `p1`, ... counted within this call)
/// to shard 0; returns their offsets.
pub async fn publish(c: &Client, stream: &str, n: u32) -> Range<u64> {
    let records: Vec<RecordIn> = (0..n)
        .map(|i| RecordIn {
            payload: Bytes::from(format!("p{i}")),
            ..Default::default()
        })
        .collect();
    let p = c
        .publish_batch(T, NS, stream, 0, records)
        .await
        .expect("publish_batch");
    assert_eq!(p.count, n);
    p.base_offset..p.base_offset + u64::from(p.count)
}

pub fn offsets(records: &[GroupRecord]) -> Vec<u64> {
    records.iter().map(|r| r.offset).collect()
}

pub fn attempts(records: &[GroupRecord]) -> Vec<u32> {
    records.iter().map(|r| r.attempts).collect()
}

/// The broker's error code of a failed call (`None` if it succeeded or
/// failed on the client side).
pub fn code<T>(r: Result<T, ClientError>) -> Option<ErrorCode> {
    r.err().and_then(|e| e.code())
}

/// A delivery that was never made, to name an offset in nack/extend calls.
pub fn fake_record(offset: u64, attempts: u32) -> GroupRecord {
    GroupRecord {
        offset,
        attempts,
        timestamp_ms: 0,
        key: None,
        headers: Default::default(),
        payload: Bytes::new(),
        skipped_before: None,
    }
}

/// Await `cond` until it holds, checking every 20 ms, or fail after `limit`.
pub async fn eventually<F, Fut>(what: &str, limit: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let end = Instant::now() + limit;
    loop {
        if cond().await {
            return;
        }
        assert!(Instant::now() < end, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One consumer group on shard 0 of a stream, through one client.
#[derive(Clone)]
pub struct Group {
    pub c: Client,
    pub stream: String,
    pub group: String,
}

impl Group {
    pub fn new(c: &Client, stream: &str, group: &str) -> Group {
        Group {
            c: c.clone(),
            stream: stream.to_string(),
            group: group.to_string(),
        }
    }

    /// The same group through another client (connection).
    pub fn via(&self, c: &Client) -> Group {
        Group::new(c, &self.stream, &self.group)
    }

    pub async fn poll(&self, max: u32) -> Vec<GroupRecord> {
        self.c
            .group_poll(T, NS, &self.stream, 0, &self.group, max)
            .await
            .expect("group_poll")
    }

    pub async fn poll_wait(&self, max: u32, wait: Duration) -> Vec<GroupRecord> {
        self.c
            .group_poll_wait(T, NS, &self.stream, 0, &self.group, max, wait)
            .await
            .expect("group_poll_wait")
    }

    pub async fn poll_as(
        &self,
        member: &GroupMember,
        options: GroupPollOptions,
    ) -> Vec<GroupRecord> {
        self.c
            .group_poll_as(T, NS, &self.stream, 0, &self.group, member, options)
            .await
            .expect("group_poll_as")
    }

    pub async fn ack(&self, offset: u64) -> Result<(), ClientError> {
        self.c
            .group_ack(T, NS, &self.stream, 0, &self.group, offset)
            .await
    }

    pub async fn ack_many(&self, offsets: &[u64]) -> Result<(), ClientError> {
        self.c
            .group_ack_many(T, NS, &self.stream, 0, &self.group, offsets)
            .await
    }

    pub async fn ack_all(&self, records: &[GroupRecord]) {
        self.ack_many(&offsets(records)).await.expect("ack");
    }

    pub async fn nack(&self, r: &GroupRecord) -> Result<(), ClientError> {
        self.c
            .group_nack(T, NS, &self.stream, 0, &self.group, r)
            .await
    }

    pub async fn nack_after(&self, r: &GroupRecord, delay: Duration) -> Result<(), ClientError> {
        self.c
            .group_nack_after(T, NS, &self.stream, 0, &self.group, r, delay)
            .await
    }

    pub async fn extend(&self, r: &GroupRecord, by: Duration) -> Result<Duration, ClientError> {
        self.c
            .group_extend(T, NS, &self.stream, 0, &self.group, r, by)
            .await
    }

    pub async fn dead_letter(
        &self,
        r: &GroupRecord,
        reason: Option<&str>,
    ) -> Result<(), ClientError> {
        match reason {
            Some(why) => {
                self.c
                    .group_dead_letter_with_reason(T, NS, &self.stream, 0, &self.group, r, why)
                    .await
            }
            None => {
                self.c
                    .group_dead_letter(T, NS, &self.stream, 0, &self.group, r)
                    .await
            }
        }
    }

    pub async fn dead_letters(&self) -> Vec<u64> {
        self.c
            .group_dead_letters(T, NS, &self.stream, 0, &self.group)
            .await
            .expect("group_dead_letters")
    }

    pub async fn dead_letters_detailed(&self) -> Vec<DeadLetterInfo> {
        self.c
            .group_dead_letters_detailed(T, NS, &self.stream, 0, &self.group)
            .await
            .expect("group_dead_letters_detailed")
    }

    pub async fn redrive(&self, offset: u64) -> Result<(), ClientError> {
        self.c
            .group_redrive(T, NS, &self.stream, 0, &self.group, offset)
            .await
    }

    pub async fn discard(&self, offset: u64) -> Result<(), ClientError> {
        self.c
            .group_discard(T, NS, &self.stream, 0, &self.group, offset)
            .await
    }

    pub async fn create(&self, at: StartPosition) -> Result<(), ClientError> {
        self.c
            .group_create(T, NS, &self.stream, 0, &self.group, at)
            .await
    }

    pub async fn seek(&self, to: StartPosition) -> Result<(), ClientError> {
        self.c
            .group_seek(T, NS, &self.stream, 0, &self.group, to)
            .await
    }

    pub async fn describe(&self) -> Result<GroupInfo, ClientError> {
        self.c
            .group_describe(T, NS, &self.stream, 0, &self.group)
            .await
    }

    /// The group's saved position (its cursor).
    pub async fn position(&self) -> u64 {
        self.describe().await.expect("group_describe").position
    }

    pub async fn delete(&self) -> Result<(), ClientError> {
        self.c
            .group_delete(T, NS, &self.stream, 0, &self.group)
            .await
    }

    /// Poll until an empty answer; everything handed out, in order.
    pub async fn drain(&self) -> Vec<GroupRecord> {
        let mut out = Vec::new();
        loop {
            let batch = self.poll(1000).await;
            if batch.is_empty() {
                return out;
            }
            out.extend(batch);
        }
    }
}
