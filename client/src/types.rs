//! Argument and result types of client calls that are not wire types.

use std::time::Duration;

use felix_wire::{DeadLetterInfo, Record};

/// Settings for [`Client::create_stream`](crate::Client::create_stream).
/// `None` leaves the broker's default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamOptions {
    /// Keep at most about this many bytes per shard.
    pub retention_bytes: Option<u64>,
    /// Keep records for about this many milliseconds.
    pub retention_ms: Option<u64>,
    /// In a cluster: the stream's incarnation, which must be the same on
    /// every broker (nonzero, at most `i64::MAX`; needs
    /// `FEATURE_STREAM_INCARNATION`).
    /// [`ClusterClient::create_stream`](crate::ClusterClient::create_stream)
    /// chooses it (see [`incarnation_to_create`](crate::incarnation_to_create)):
    /// leave it `None`.
    pub incarnation: Option<u64>,
}

/// Where a batch of records was written: offsets
/// `base_offset .. base_offset + count` of `shard`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    pub base_offset: u64,
    pub count: u32,
    pub shard: u32,
}

impl Published {
    /// The offset of the last record written (`base_offset` for an empty
    /// answer).
    pub fn last_offset(&self) -> u64 {
        self.base_offset
            .saturating_add(u64::from(self.count.saturating_sub(1)))
    }
}

/// The answer to [`Client::read`](crate::Client::read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadBatch {
    pub records: Vec<Record>,
    /// Where the following read should start.
    pub next_offset: u64,
    /// Oldest offset the shard still retains.
    pub start_offset: u64,
    /// Offset the next published record will get (the tail).
    pub end_offset: u64,
}

/// One page of a group's dead letters, the answer to
/// [`Client::group_dead_letters_page`](crate::Client::group_dead_letters_page).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterPage {
    /// In offset order.
    pub letters: Vec<DeadLetterInfo>,
    /// The `from` to ask for the following page; `None` once the list is
    /// exhausted.
    pub next: Option<u64>,
}

/// A named member of a consumer group, for
/// [`Client::group_poll_as`](crate::Client::group_poll_as).
///
/// A member that names itself can take back, at once, the records it held
/// before a restart: set [`reclaim`](GroupMember::reclaim) on the first poll
/// after reconnecting. Names are 1 to 128 bytes and belong to the principal
/// the client authenticates as.
///
/// ```
/// use felix_client::GroupMember;
/// let me = GroupMember::new("worker-1").reclaim(true);
/// assert_eq!(me.name(), "worker-1");
/// assert!(me.reclaims());
/// // Or spelled out:
/// let same = GroupMember { name: "worker-1".into(), reclaim: true };
/// assert_eq!(me, same);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GroupMember {
    /// The member's name, 1 to 128 bytes (checked by the broker).
    pub name: String,
    /// Take back what this member holds from older connections (see
    /// [`reclaim`](GroupMember::reclaim)).
    pub reclaim: bool,
}

impl GroupMember {
    /// Longest member name the broker accepts, in bytes.
    pub const MAX_NAME_BYTES: usize = 128;

    pub fn new(name: impl Into<String>) -> GroupMember {
        GroupMember {
            name: name.into(),
            reclaim: false,
        }
    }

    /// Take back the records this member still holds from older
    /// connections (only the first poll with `reclaim` set on a connection,
    /// for each shard, does so; leaving it set is harmless).
    pub fn reclaim(mut self, reclaim: bool) -> GroupMember {
        self.reclaim = reclaim;
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn reclaims(&self) -> bool {
        self.reclaim
    }
}

/// How [`Client::group_poll_as`](crate::Client::group_poll_as) polls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupPollOptions {
    /// Most records to hand out (the broker also stops at 1,000 records or
    /// about 4 MiB of payload).
    pub max_records: u32,
    /// How long the broker may wait for a record when none is available.
    /// Zero answers at once.
    pub wait: Duration,
    /// How long this poll's claims stand instead of the broker's
    /// visibility timeout. Needs
    /// [`FEATURE_GROUP_CLAIM_CONTROL`](crate::FEATURE_GROUP_CLAIM_CONTROL).
    pub visibility: Option<Duration>,
}

impl Default for GroupPollOptions {
    /// 16 records, no wait, the broker's visibility timeout.
    fn default() -> GroupPollOptions {
        GroupPollOptions {
            max_records: 16,
            wait: Duration::ZERO,
            visibility: None,
        }
    }
}
