//! Async (tokio) client for the Felix broker.
//!
//! A [`Client`] talks to one broker over the Felix wire protocol. It keeps a
//! connection per broker core, sends each request about a shard to the core
//! that owns it, pipelines any number of requests on each connection and
//! matches the answers by request id, so a long poll never holds up an ack.
//!
//! Everything a program needs is re-exported here; the wire types are also
//! reachable as [`felix_wire`] (a public crate, so `use felix_wire::StartPosition;`
//! works too when it is a dependency).
//!
//! # Publishing and reading
//!
//! ```no_run
//! use std::time::Duration;
//! use felix_client::{Client, ClientConfig, StartPosition, StreamOptions};
//!
//! # async fn demo() -> Result<(), felix_client::ClientError> {
//! let client = Client::connect("127.0.0.1:7400", ClientConfig::default()).await?;
//! client
//!     .create_stream("t1", "default", "events", 4, StreamOptions::default())
//!     .await?;
//!
//! let offset = client.publish("t1", "default", "events", 0, "hello").await?;
//! let batch = client
//!     .read("t1", "default", "events", 0, StartPosition::Offset(offset), 100, None)
//!     .await?;
//! assert_eq!(&batch.records[0].payload[..], b"hello");
//!
//! // Records with one key land on one shard, in order.
//! let at = client.publish_keyed("t1", "default", "events", "user-42", "clicked").await?;
//! println!("shard {} offset {}", at.shard, at.base_offset);
//! # Ok(())
//! # }
//! ```
//!
//! # A queue: consumer groups
//!
//! Members of a group divide a shard's records between them; a record is
//! held by one consumer until it is acknowledged, handed back, or its claim
//! lapses. See the *Queues and Consumer Groups* guide.
//!
//! ```no_run
//! use std::time::Duration;
//! use felix_client::{Client, ClientConfig, StartPosition};
//!
//! # async fn handle(_: &[u8]) -> Result<(), ()> { Ok(()) }
//! # async fn demo() -> Result<(), felix_client::ClientError> {
//! let client = Client::connect("127.0.0.1:7400", ClientConfig::default()).await?;
//! client
//!     .group_create("t1", "default", "jobs", 0, "workers", StartPosition::Latest)
//!     .await?;
//! loop {
//!     // Wait up to five seconds for work rather than spinning.
//!     let batch = client
//!         .group_poll_wait("t1", "default", "jobs", 0, "workers", 16, Duration::from_secs(5))
//!         .await?;
//!     for record in batch {
//!         match handle(&record.payload).await {
//!             Ok(()) => {
//!                 client.group_ack("t1", "default", "jobs", 0, "workers", record.offset).await?;
//!             }
//!             Err(_) => {
//!                 // Hand it back now rather than waiting out the timeout.
//!                 client.group_nack("t1", "default", "jobs", 0, "workers", &record).await?;
//!             }
//!         }
//!     }
//! }
//! # }
//! ```
//!
//! The rest of the guide's calls, as it writes them:
//!
//! ```no_run
//! use std::time::Duration;
//! use felix_client::{Client, ClientConfig, GroupMember, GroupPollOptions};
//! use felix_wire::StartPosition;
//!
//! # async fn demo(client: Client) -> Result<(), felix_client::ClientError> {
//! // A named member takes back what it held before a restart.
//! let me = GroupMember::new("worker-1").reclaim(true);
//! let options = GroupPollOptions {
//!     max_records: 16,
//!     wait: Duration::from_secs(5),
//!     visibility: Some(Duration::from_secs(120)),
//! };
//! let batch = client
//!     .group_poll_as("t1", "default", "jobs", 0, "workers", &me, options)
//!     .await?;
//! for record in &batch {
//!     if record.attempts > 1 { /* a redelivery */ }
//!     let stands = client
//!         .group_extend("t1", "default", "jobs", 0, "workers", record, Duration::from_secs(60))
//!         .await?;
//!     let _ = stands;
//!     client
//!         .group_nack_after("t1", "default", "jobs", 0, "workers", record, Duration::from_secs(30))
//!         .await?;
//!     client
//!         .group_dead_letter_with_reason("t1", "default", "jobs", 0, "workers", record, "unparseable")
//!         .await?;
//! }
//! let dead = client.group_dead_letters("t1", "default", "jobs", 0, "workers").await?;
//! for offset in dead {
//!     client.group_redrive("t1", "default", "jobs", 0, "workers", offset).await?;
//!     // client.group_discard("t1", "default", "jobs", 0, "workers", offset).await?;
//! }
//! client
//!     .group_seek("t1", "default", "jobs", 0, "workers", StartPosition::Offset(0))
//!     .await?;
//! let info = client.group_describe("t1", "default", "jobs", 0, "workers").await?;
//! println!("{} records behind, {} in flight", info.lag(), info.in_flight);
//! client.group_delete("t1", "default", "jobs", 0, "workers").await?;
//! # Ok(())
//! # }
//! ```
//!
//! A group is per shard. [`ShardedGroup`] consumes the group on every shard
//! of a stream as one queue; each [`ShardedRecord`] names its shard, and
//! acks go back to it.
//!
//! # Features
//!
//! HELLO negotiates feature bits, and the client never sends a field the
//! broker did not advertise: group calls need [`FEATURE_GROUPS`];
//! `group_create`/`seek`/`describe`/`delete` need [`FEATURE_GROUP_ADMIN`]; a
//! poll visibility, a nack delay, `group_extend` and `group_dead_letter` need
//! [`FEATURE_GROUP_CLAIM_CONTROL`]; `group_dead_letters_page` needs
//! [`FEATURE_GROUP_DEAD_LETTER_PAGES`] (`group_dead_letters` pages with it
//! and asks for the whole list without it); `ack_on_commit` needs
//! [`FEATURE_PUBLISH_ACK_MODE`]. Without the bit the call fails with
//! [`ClientError::Unsupported`] before anything is sent.
//! [`GroupRecord::skipped_before`] is only ever set with
//! [`FEATURE_GROUP_SKIPPED`].
//!
//! # Errors and retries
//!
//! Every call returns [`ClientError`]. The broker's refusals are
//! [`ClientError::Server`] with an [`ErrorCode`] ([`ClientError::code`]).
//! A `wrong_core` answer is handled inside the client (placement refresh and
//! one retry). Nothing else is retried: a request in flight when its
//! connection drops fails with [`ClientError::Disconnected`], since a
//! publish may have been written. The next call reconnects, backing off
//! exponentially between failed attempts.

#![forbid(unsafe_code)]
#![warn(missing_debug_implementations)]

mod client;
mod cluster;
mod config;
mod conn;
mod error;
mod sharded;
mod stream_groups;
mod subscribe;
mod types;

pub use client::{Client, Pending, PendingAck, PendingPublish};
pub use cluster::{
    create_on_broker, enough_answered, incarnation_to_create, keeps_incarnations, show_incarnation,
    ClusterClient,
};
pub use config::ClientConfig;
pub use error::{ClientError, Result};
pub use sharded::{ShardedGroup, ShardedRecord};
pub use subscribe::Subscription;
pub use types::{
    DeadLetterPage, GroupMember, GroupPollOptions, Published, ReadBatch, StreamOptions,
};

pub use bytes::Bytes;
pub use felix_wire;
pub use felix_wire::{
    shard_for_key, AckMode, ClusterInfo, ClusterMember, DeadLetterInfo, ErrorCode, GroupInfo,
    GroupRecord, Headers, PeerProgress, Record, RecordHeadersIter, RecordIn, ReplicaInfo,
    ReplicaRole, ShardInfo, StartPosition, StreamInfo, StreamRef, FEATURES_ALL,
    FEATURE_CLUSTER_INFO, FEATURE_ERROR_NOT_APPLIED, FEATURE_GROUPS, FEATURE_GROUP_ADMIN,
    FEATURE_GROUP_CLAIM_CONTROL, FEATURE_GROUP_DEAD_LETTER_PAGES, FEATURE_GROUP_SKIPPED,
    FEATURE_PUBLISH_ACK_MODE, FEATURE_REPLICA_INFO, FEATURE_STREAM_INCARNATION,
};
