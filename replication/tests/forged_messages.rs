//! Messages from a peer are untrusted: whatever one sends, a replica never
//! panics (in release a panic aborts the broker). Random messages of every
//! type a replica takes, with terms, indices, commits and entries near the
//! values that matter (valid batches, at and around the log's end), are
//! stepped into leaders and followers of a live three-replica group, and
//! the group is then checked still to work.
//!
//! `FELIX_FORGE_SEED=<seed>` replays one seed; `FELIX_FORGE_ROUNDS=<n>`
//! runs more.

use std::panic::{catch_unwind, AssertUnwindSafe};

use bytes::Bytes;
use felix_engine::format::{encode_group, encode_records, RecordIn};
use felix_engine::Offset;
use felix_replication::wire::PEER_MESSAGE_TYPES;
use felix_replication::{Event, Message, Replica, ReplicaConfig, ReplicaLog};
use raft::eraftpb::{Entry, MessageType};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Three replicas passing messages directly (no loss), to reach a state
/// with a leader and a log.
struct Group {
    replicas: Vec<Replica>,
}

impl Group {
    fn new() -> Group {
        let replicas = (1..=3)
            .map(|id| {
                let mut c = ReplicaConfig::new(id);
                c.election_ticks = (10 + 3 * id as usize, 11 + 3 * id as usize);
                Replica::open(c, ReplicaLog::new(&[1, 2, 3])).unwrap()
            })
            .collect();
        Group { replicas }
    }

    fn run(&mut self, ticks: usize) {
        for _ in 0..ticks {
            for r in &mut self.replicas {
                r.tick();
            }
            for _ in 0..4 {
                let mut msgs = Vec::new();
                for r in &mut self.replicas {
                    let mut events = Vec::new();
                    r.drain(&mut msgs, &mut events);
                    for e in events {
                        if let Event::Acked { result: Err(e), .. }
                        | Event::Read { result: Err(e), .. } = &e
                        {
                            assert!(
                                !matches!(e, felix_replication::ReplicationError::Stopped(_)),
                                "a replica stopped: {e}"
                            );
                        }
                    }
                }
                for m in msgs {
                    let to = m.to as usize - 1;
                    let _ = self.replicas[to].step(m);
                }
            }
        }
    }

    fn leader(&self) -> Option<usize> {
        self.replicas.iter().position(Replica::serving)
    }

    fn publish(&mut self, payload: &'static [u8]) {
        if let Some(l) = self.leader() {
            let _ = self.replicas[l].propose_records(
                0,
                &[RecordIn {
                    payload: Bytes::from_static(payload),
                    ..RecordIn::default()
                }],
            );
        }
    }
}

fn near(rng: &mut SmallRng, v: u64) -> u64 {
    match rng.gen_range(0..10) {
        0 => 0,
        1 => u64::MAX,
        2 => rng.gen(),
        _ => v
            .saturating_add(rng.gen_range(0..4))
            .saturating_sub(rng.gen_range(0..4)),
    }
}

fn forged_entry(rng: &mut SmallRng, index: u64, term: u64, end: u64) -> Entry {
    let data: Bytes = match rng.gen_range(0..5) {
        0 => Bytes::new(),
        1 => {
            let mut d = Vec::new();
            let r = RecordIn {
                payload: Bytes::from_static(b"forged"),
                ..RecordIn::default()
            };
            encode_records(&mut d, Offset(near(rng, end) % (1 << 40)), term, 0, &[r]);
            d.into()
        }
        2 => {
            let mut d = Vec::new();
            encode_group(&mut d, Offset(near(rng, end) % (1 << 40)), term, 0, b"g");
            d.into()
        }
        _ => (0..rng.gen_range(0..64))
            .map(|_| rng.gen::<u8>())
            .collect::<Vec<u8>>()
            .into(),
    };
    Entry {
        index,
        term,
        data,
        ..Entry::default()
    }
}

fn forged(rng: &mut SmallRng, to: u64, term: u64, last: u64, end: u64) -> Message {
    let mut m = Message::default();
    m.set_msg_type(PEER_MESSAGE_TYPES[rng.gen_range(0..PEER_MESSAGE_TYPES.len())]);
    m.to = if rng.gen_ratio(19, 20) {
        to
    } else {
        rng.gen_range(0..5)
    };
    m.from = if rng.gen_ratio(19, 20) {
        (to % 3) + 1
    } else {
        rng.gen_range(0..5)
    };
    m.term = near(rng, term);
    m.log_term = near(rng, term);
    m.index = near(rng, last);
    m.commit = near(rng, last);
    m.commit_term = near(rng, term);
    m.reject = rng.gen();
    m.reject_hint = near(rng, last);
    m.request_snapshot = if rng.gen_ratio(1, 10) { rng.gen() } else { 0 };
    m.priority = match rng.gen_range(0..10) {
        0 => -1,
        1 => rng.gen(),
        _ => 0,
    };
    if rng.gen_ratio(1, 3) {
        m.context = Bytes::from(
            (0..rng.gen_range(0..10))
                .map(|_| rng.gen::<u8>())
                .collect::<Vec<u8>>(),
        );
    }
    if m.get_msg_type() == MessageType::MsgAppend || rng.gen_ratio(1, 10) {
        let n = rng.gen_range(0..4);
        let contiguous = rng.gen_ratio(3, 4);
        let mut entries = Vec::new();
        for k in 0..n {
            let index = if contiguous {
                m.index.saturating_add(1 + k)
            } else {
                near(rng, last)
            };
            let t = if rng.gen_ratio(3, 4) {
                m.term
            } else {
                near(rng, term)
            };
            entries.push(forged_entry(rng, index, t, end));
        }
        m.entries = entries.into();
    }
    m
}

/// Steps taken and refused, and whether the group had a leader when the
/// forging began: the forged stream must reach live states, not just
/// bounce off the first check.
#[derive(Default)]
struct Tally {
    taken: u64,
    refused: u64,
    led: u64,
}

fn one_round(seed: u64, tally: &mut Tally) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut g = Group::new();
    // A quarter of the rounds forge into a group that has not yet elected
    // anyone (terms 0, nothing committed: how every replica starts).
    if rng.gen_ratio(3, 4) {
        g.run(60);
    }
    tally.led += g.leader().is_some() as u64;
    for _ in 0..rng.gen_range(0..5) {
        g.publish(b"real");
        g.run(2);
    }
    for _ in 0..200 {
        let target = rng.gen_range(0..3);
        let r = &g.replicas[target];
        let (to, term, last, end) = (r.id(), r.term(), r.log().last(), r.log().end());
        let m = forged(&mut rng, to, term, last, end);
        match g.replicas[target].step(m) {
            Ok(()) => tally.taken += 1,
            Err(_) => tally.refused += 1,
        }
        let (mut out, mut events) = (Vec::new(), Vec::new());
        g.replicas[target].drain(&mut out, &mut events);
        // What it sends in answer goes to its real peers.
        for m in out {
            if (1..=3).contains(&m.to) {
                let _ = g.replicas[m.to as usize - 1].step(m);
            }
        }
        if rng.gen_ratio(1, 20) {
            g.run(1);
        }
    }
}

#[test]
fn no_message_a_peer_sends_panics_a_replica() {
    let seeds: Vec<u64> = match std::env::var("FELIX_FORGE_SEED") {
        Ok(s) => vec![s.parse().expect("FELIX_FORGE_SEED is a number")],
        Err(_) => {
            let n = std::env::var("FELIX_FORGE_ROUNDS")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(300u64);
            (0..n).collect()
        }
    };
    let mut tally = Tally::default();
    let rounds = seeds.len() as u64;
    for seed in seeds {
        if catch_unwind(AssertUnwindSafe(|| one_round(seed, &mut tally))).is_err() {
            panic!("a forged message panicked a replica (replay: FELIX_FORGE_SEED={seed})");
        }
    }
    eprintln!(
        "forged messages: {} taken, {} refused; a leader in {} of {rounds} rounds",
        tally.taken, tally.refused, tally.led
    );
    assert!(
        tally.led * 2 > rounds && tally.led < rounds,
        "most rounds start from a group with a leader, some from a fresh one"
    );
    assert!(
        tally.taken * 10 > tally.taken + tally.refused,
        "a fair share of forgeries get past the checks"
    );
}
