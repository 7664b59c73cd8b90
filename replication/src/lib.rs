//! Shard replication for Felix.
//!
//! Each shard is one Raft group over its own log, driven on the core that
//! owns the shard. This crate builds on raft-rs (tikv's `raft`): a Raft
//! state machine with no I/O, no threads and no timers, so every replica of
//! every shard on a core can be driven by that core's one executor. What
//! Felix adds is in [`Replica`] (see its module docs) and [`entry`]: the
//! Raft log's entries are the shard's own batches, stamped with their term
//! and first offset, and a new leader's empty entry is the shard's
//! generation-start record.
//!
//! What is here: the replica ([`Replica`], its log [`ReplicaLog`]) and a
//! deterministic simulation of a three-replica shard under crashes,
//! partitions and lost messages (`tests/cluster_sim.rs`); the peer wire
//! format ([`wire`]) and the handshake that authenticates a peer before
//! its first frame ([`handshake`]); [`host::Host`], which drives a core's
//! replicas over TCP on its glommio executor; and the durable log
//! ([`journal`], [`hard_state`]) a host keeps each replica's entries and
//! votes in. The broker (`felix serve --peers`) runs a host on every core;
//! `README.md` in this folder has the design and what is not done yet.

pub mod entry;
pub mod handshake;
pub mod hard_state;
pub mod host;
pub mod journal;
mod log;
mod replica;
pub mod wire;

pub use entry::{EntryError, EntryInfo, EntryKind};
pub use log::{Compacted, ReplicaLog};
pub use raft::eraftpb::Message;
pub use replica::{
    Applied, Event, Landed, Replica, ReplicaConfig, ReplicaStatus, ReplicationError, Role,
};
