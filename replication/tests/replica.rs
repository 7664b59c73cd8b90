//! One replica's rules, one at a time (the cluster simulation covers them
//! together under faults).

use bytes::Bytes;
use felix_engine::format::RecordIn;
use felix_engine::Offset;
use felix_replication::{
    EntryKind, Event, Message, Replica, ReplicaConfig, ReplicaLog, ReplicationError,
};
use raft::eraftpb::{Entry, MessageType};

fn record(payload: &'static [u8]) -> RecordIn {
    RecordIn {
        payload: Bytes::from_static(payload),
        ..RecordIn::default()
    }
}

/// Tick a lone replica until it serves, collecting events.
fn lone_leader() -> (Replica, Vec<Event>) {
    let mut r = Replica::open(ReplicaConfig::new(1), ReplicaLog::new(&[1])).unwrap();
    let mut events = Vec::new();
    let mut out = Vec::new();
    for _ in 0..100 {
        r.tick();
        r.drain(&mut out, &mut events);
        if r.serving() {
            return (r, events);
        }
    }
    panic!("a lone replica never elected itself");
}

#[test]
fn a_new_leaders_generation_start_takes_an_offset_and_records_follow_it() {
    let (mut r, events) = lone_leader();
    let starts: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            Event::Applied(a) => Some(a),
            _ => None,
        })
        .collect();
    assert_eq!(starts.len(), 1);
    assert_eq!(starts[0].kind, EntryKind::GenerationStart);
    assert_eq!((starts[0].base, starts[0].end), (Offset(0), Offset(1)));

    let landed = r.propose_records(7, &[record(b"a"), record(b"b")]).unwrap();
    assert_eq!((landed.base, landed.end), (Offset(1), Offset(3)));
    let (mut out, mut events) = (Vec::new(), Vec::new());
    r.drain(&mut out, &mut events);
    assert!(
        events.iter().any(|e| matches!(e,
            Event::Acked { token: 7, result: Ok(l) } if l.base == Offset(1) && l.end == Offset(3))),
        "{events:?}"
    );
    assert_eq!(r.applied_end(), Offset(3));

    r.read(8).unwrap();
    r.drain(&mut out, &mut events);
    assert!(events.iter().any(|e| matches!(
        e,
        Event::Read {
            token: 8,
            result: Ok(_)
        }
    )));
}

#[test]
fn a_restarted_replica_applies_its_committed_log_again() {
    let (mut r, _) = lone_leader();
    r.propose_records(1, &[record(b"kept")]).unwrap();
    let (mut out, mut events) = (Vec::new(), Vec::new());
    r.drain(&mut out, &mut events);
    let log = r.into_log();
    let mut r = Replica::open(ReplicaConfig::new(1), log).unwrap();
    let mut events = Vec::new();
    for _ in 0..100 {
        r.tick();
        r.drain(&mut out, &mut events);
        if r.serving() {
            break;
        }
    }
    let kinds: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            Event::Applied(a) => Some((a.kind, a.base.0)),
            _ => None,
        })
        .collect();
    // The old generation start, the record, then this term's start.
    assert_eq!(
        kinds,
        vec![
            (EntryKind::GenerationStart, 0),
            (EntryKind::Records { count: 1 }, 1),
            (EntryKind::GenerationStart, 2)
        ]
    );
}

#[test]
fn a_follower_refuses_writes_and_reads_and_names_no_leader_it_does_not_know() {
    let mut r = Replica::open(ReplicaConfig::new(2), ReplicaLog::new(&[1, 2, 3])).unwrap();
    assert_eq!(
        r.propose_records(1, &[record(b"x")]),
        Err(ReplicationError::NotLeader { leader: None })
    );
    assert_eq!(r.read(2), Err(ReplicationError::NotLeader { leader: None }));
}

#[test]
fn a_malformed_append_from_a_peer_is_dropped_whole() {
    let mut r = Replica::open(ReplicaConfig::new(2), ReplicaLog::new(&[1, 2, 3])).unwrap();
    let mut m = Message::default();
    m.set_msg_type(MessageType::MsgAppend);
    m.from = 1;
    m.to = 2;
    m.term = 1;
    m.entries = vec![Entry {
        index: 1,
        term: 1,
        data: Bytes::from_static(b"not a batch at all"),
        ..Entry::default()
    }]
    .into();
    assert!(matches!(
        r.step(m.clone()),
        Err(ReplicationError::Refused(_))
    ));
    // From someone who is not a replica of the shard.
    m.from = 9;
    m.entries.clear();
    assert!(matches!(r.step(m), Err(ReplicationError::Refused(_))));
    let (mut out, mut events) = (Vec::new(), Vec::new());
    r.drain(&mut out, &mut events);
    assert_eq!(r.log().last(), 0);
}

#[test]
fn an_empty_publish_is_refused_and_the_leader_keeps_serving() {
    let (mut r, _) = lone_leader();
    assert!(matches!(
        r.propose_records(1, &[] as &[RecordIn]),
        Err(ReplicationError::Refused(_))
    ));
    let (mut out, mut events) = (Vec::new(), Vec::new());
    r.drain(&mut out, &mut events);
    assert!(r.serving());
    r.propose_records(2, &[record(b"after")]).unwrap();
    r.drain(&mut out, &mut events);
    assert!(events.iter().any(|e| matches!(
        e,
        Event::Acked {
            token: 2,
            result: Ok(_)
        }
    )));
}

fn records_entry(index: u64, term: u64, base: u64) -> Entry {
    let mut data = Vec::new();
    felix_engine::format::encode_records(&mut data, Offset(base), term, 0, &[record(b"r")]);
    Entry {
        index,
        term,
        data: data.into(),
        ..Entry::default()
    }
}

fn generation_entry(index: u64, term: u64) -> Entry {
    Entry {
        index,
        term,
        ..Entry::default()
    }
}

fn append_from_1(index: u64, log_term: u64, entries: Vec<Entry>) -> Message {
    let mut m = Message::default();
    m.set_msg_type(MessageType::MsgAppend);
    m.from = 1;
    m.to = 2;
    m.term = 1;
    m.index = index;
    m.log_term = log_term;
    m.entries = entries.into();
    m
}

#[test]
fn an_append_at_the_wrong_offset_is_refused_before_raft_takes_it() {
    let mut r = Replica::open(ReplicaConfig::new(2), ReplicaLog::new(&[1, 2, 3])).unwrap();
    // Offset 5 where the log would end at 1.
    let bad = append_from_1(0, 0, vec![generation_entry(1, 1), records_entry(2, 1, 5)]);
    assert!(matches!(r.step(bad), Err(ReplicationError::Refused(_))));
    let good = append_from_1(0, 0, vec![generation_entry(1, 1), records_entry(2, 1, 1)]);
    r.step(good).unwrap();
    let (mut out, mut events) = (Vec::new(), Vec::new());
    r.drain(&mut out, &mut events);
    assert_eq!((r.log().last(), r.log().end()), (2, 2));
    // Following on from what it holds (unpersisted or not), the next
    // entry must start at 2.
    let next_bad = append_from_1(2, 1, vec![records_entry(3, 1, 3)]);
    assert!(matches!(
        r.step(next_bad),
        Err(ReplicationError::Refused(_))
    ));
    r.step(append_from_1(2, 1, vec![records_entry(3, 1, 2)]))
        .unwrap();
    r.drain(&mut out, &mut events);
    assert_eq!((r.log().last(), r.log().end()), (3, 3));
}

#[test]
fn forged_messages_that_would_panic_raft_are_refused() {
    let mut r = Replica::open(ReplicaConfig::new(2), ReplicaLog::new(&[1, 2, 3])).unwrap();
    let refused = |r: &mut Replica, m: Message, what: &str| {
        assert!(
            matches!(r.step(m), Err(ReplicationError::Refused(_))),
            "{what} was taken"
        );
    };
    // A gap between entries, an entry at index 0, entries far ahead.
    refused(
        &mut r,
        append_from_1(0, 0, vec![generation_entry(1, 1), generation_entry(3, 1)]),
        "a gap",
    );
    refused(
        &mut r,
        append_from_1(0, 0, vec![generation_entry(0, 1)]),
        "index 0",
    );
    refused(
        &mut r,
        append_from_1(0, 0, vec![generation_entry(9, 1)]),
        "a far entry",
    );
    // Terms out of order, or past the message's own term.
    refused(
        &mut r,
        append_from_1(0, 0, vec![generation_entry(1, 1), generation_entry(2, 0)]),
        "falling terms",
    );
    refused(
        &mut r,
        append_from_1(0, 0, vec![generation_entry(1, 7)]),
        "a future term",
    );
    // Following an index past the log at term 0 (raft-rs takes that term
    // as a match), with and without entries.
    let mut far = append_from_1(5, 0, vec![records_entry(6, 1, 0)]);
    refused(&mut r, far.clone(), "an append after a far index at term 0");
    far.entries.clear();
    far.commit = 5;
    refused(&mut r, far, "an empty append committing past the log");
    // A heartbeat committing past the log is taken, with its commit cut to
    // the log (it still names the leader).
    let mut hb = Message::default();
    hb.set_msg_type(MessageType::MsgHeartbeat);
    hb.from = 1;
    hb.to = 2;
    hb.term = 1;
    hb.commit = 100;
    r.step(hb.clone()).unwrap();
    assert_eq!(r.leader(), Some(1));
    // An append response past the log.
    let mut resp = Message::default();
    resp.set_msg_type(MessageType::MsgAppendResponse);
    resp.from = 1;
    resp.to = 2;
    resp.term = 1;
    resp.index = u64::MAX;
    refused(&mut r, resp, "an append response past the log");
    // Entries on a heartbeat; from itself; types never taken from peers.
    hb.commit = 0;
    hb.entries = vec![generation_entry(1, 1)].into();
    refused(&mut r, hb.clone(), "entries on a heartbeat");
    hb.entries.clear();
    hb.from = 2;
    refused(&mut r, hb.clone(), "a message from itself");
    for t in [
        MessageType::MsgTimeoutNow,
        MessageType::MsgReadIndex,
        MessageType::MsgReadIndexResp,
        MessageType::MsgTransferLeader,
        MessageType::MsgSnapshot,
        MessageType::MsgPropose,
        MessageType::MsgHup,
    ] {
        let mut m = Message::default();
        m.set_msg_type(t);
        m.from = 1;
        m.to = 2;
        m.term = 1;
        refused(&mut r, m, &format!("{t:?}"));
    }
    // No term (raft-rs takes that as its owner's own), a term no group
    // reaches, a campaign claiming a leadership transfer.
    let mut pv = Message::default();
    pv.set_msg_type(MessageType::MsgRequestPreVote);
    pv.from = 3;
    pv.to = 2;
    refused(&mut r, pv.clone(), "a pre-vote without a term");
    pv.term = u64::MAX;
    refused(&mut r, pv.clone(), "a pre-vote at term u64::MAX");
    pv.term = 2;
    pv.context = Bytes::from_static(b"CampaignTransfer");
    refused(&mut r, pv.clone(), "a campaign claiming a transfer");
    pv.context = Bytes::new();
    pv.priority = -1;
    refused(&mut r, pv.clone(), "a pre-vote with an election priority");
    pv.priority = 0;
    pv.term = (1 << 40) + 5;
    refused(&mut r, pv, "a term implausibly far ahead");
    // An entry of term 0 after index 0 (raft-rs would take it as a match
    // and commit past the log).
    let mut zero = append_from_1(0, 0, vec![generation_entry(1, 0)]);
    zero.commit = 1;
    refused(&mut r, zero, "an entry of term 0");
    // Still a working follower.
    r.step(append_from_1(0, 0, vec![generation_entry(1, 1)]))
        .unwrap();
    let (mut out, mut events) = (Vec::new(), Vec::new());
    r.drain(&mut out, &mut events);
    assert_eq!(r.log().last(), 1);
}
