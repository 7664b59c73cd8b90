//! `felix-engine`: the storage engine of Felix.
//!
//! * [`storage`] — the one seam all disk I/O passes through: glommio DMA files
//!   (O_DIRECT) in production, a fault-injecting in-memory disk in tests.
//! * [`format`] — the on-disk batch framing (see `docs/internals/storage-format.md`).
//! * [`log`] — a shard's segmented log: group commit, recovery, reads, retention.
//! * [`group`] — the sans-IO consumer-group tracker.
//! * [`runtime`] — thread-per-core executors and shard placement.
//! * [`mailbox`] — cross-core messages (hand-offs, admin), woken through io_uring.

pub mod types;

pub use types::{CoreId, NameError, Offset, ShardId, ShardKey, StreamName};
pub mod catalog;
pub mod format;
pub mod group;
pub mod log;
pub mod mailbox;
mod marks;
pub mod notify;
pub mod runtime;
pub mod storage;
