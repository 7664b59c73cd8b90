//! `ShardedGroup`: one consumer of a group on every shard of a stream,
//! against a real broker over TCP.

mod groups_common;

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;
use felix_client::{Client, GroupMember, ShardedGroup, ShardedRecord, StreamOptions};
use felix_wire::RecordIn;
use groups_common::{client, opts, NS, T};

async fn sharded_stream(c: &Client, name: &str, shards: u32) {
    c.create_stream(T, NS, name, shards, StreamOptions::default())
        .await
        .expect("create_stream");
}

/// Publish `n` records to `shard`, payloads `s{shard}-{i}`.
async fn publish_to(c: &Client, stream: &str, shard: u32, n: u32) {
    let records: Vec<RecordIn> = (0..n)
        .map(|i| RecordIn {
            payload: Bytes::from(format!("s{shard}-{i}")),
            ..Default::default()
        })
        .collect();
    let p = c
        .publish_batch(T, NS, stream, shard, records)
        .await
        .expect("publish_batch");
    assert_eq!(p.count, n);
}

async fn group(c: &Client, stream: &str, name: &str) -> ShardedGroup {
    ShardedGroup::new(c.clone(), T, NS, stream, name)
        .await
        .expect("ShardedGroup::new")
}

/// Wait until the broker has `n` group polls parked.
async fn parked(b: &felix_tests::Broker, n: f64) {
    groups_common::eventually("parked polls", Duration::from_secs(10), || async {
        b.metric("felix_group_polls_waiting") == n
    })
    .await;
}

fn keys(records: &[ShardedRecord]) -> Vec<(u32, u64)> {
    records.iter().map(|r| (r.shard, r.record.offset)).collect()
}

#[tokio::test]
async fn a_sharded_group_hands_out_every_record_of_every_shard_once() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    sharded_stream(&c, "wide", 3).await;
    for shard in 0..3 {
        publish_to(&c, "wide", shard, 200).await;
    }
    // Two consumers, each on its own connections, drain the stream at once.
    let consume = |c: Client| async move {
        let mut g = group(&c, "wide", "workers").await;
        let mut got = Vec::new();
        loop {
            let batch = g.poll(32, Duration::from_millis(300)).await.expect("poll");
            if batch.is_empty() {
                break;
            }
            g.ack_many(&batch).await.expect("ack_many");
            got.extend(keys(&batch));
        }
        g.close().await.expect("close");
        got
    };
    let (a, b2) = tokio::join!(
        consume(client(&b.addr).await),
        consume(client(&b.addr).await)
    );
    let mut seen = BTreeSet::new();
    for k in a.iter().chain(&b2) {
        assert!(seen.insert(*k), "{k:?} was handed out twice");
    }
    let want: BTreeSet<(u32, u64)> = (0..3).flat_map(|s| (0..200).map(move |o| (s, o))).collect();
    assert_eq!(seen, want);

    let g = group(&c, "wide", "workers").await;
    assert_eq!(g.shards(), 3);
    assert_eq!(g.lag().await.expect("lag"), 0);
    for info in g.describe().await.expect("describe") {
        assert_eq!((info.position, info.in_flight), (200, 0));
    }
}

#[tokio::test]
async fn a_waiting_sharded_poll_wakes_for_any_shard_and_keeps_what_the_others_claim() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    sharded_stream(&c, "wake", 2).await;
    // Waits long enough to still be out when the test publishes.
    let mut g = group(&c, "wake", "workers")
        .await
        .wait_slice(Duration::from_secs(5));

    // Nothing yet: the poll waits on both shards; a record on shard 1 ends it
    // long before its wait is up.
    let first = {
        let mut poll = std::pin::pin!(g.poll(10, Duration::from_secs(20)));
        tokio::select! {
            r = &mut poll => r,
            () = async {
                parked(&b, 2.0).await;
                publish_to(&c, "wake", 1, 1).await;
                std::future::pending().await
            } => unreachable!(),
        }
        .expect("poll")
    };
    assert_eq!(keys(&first), vec![(1, 0)]);

    // The wait on shard 0 is still out: what arrives there is claimed by it
    // and handed out by the next poll, once.
    parked(&b, 1.0).await;
    publish_to(&c, "wake", 0, 1).await;
    groups_common::eventually("the claim ahead", Duration::from_secs(10), || async {
        b.metric("felix_group_polls_waiting") == 0.0
    })
    .await;
    let second = g.poll(10, Duration::from_secs(10)).await.expect("poll");
    assert_eq!(keys(&second), vec![(0, 0)]);
    assert_eq!(second[0].record.attempts, 1);
    assert_eq!(&second[0].record.payload[..], b"s0-0");
    assert!(g.poll(10, Duration::ZERO).await.expect("poll").is_empty());
    g.ack_many(&[first, second].concat()).await.expect("ack");
    g.close().await.expect("close");
}

/// A consumer that waited on two shards returns one record; its waiting
/// poll on the other shard claims the record published there next.
/// `finish` must hand that one back to the group.
async fn claimed_ahead_goes_back(finish: impl AsyncFnOnce(ShardedGroup)) {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    sharded_stream(&c, "ahead", 2).await;
    let mut a = group(&client(&b.addr).await, "ahead", "workers")
        .await
        .wait_slice(Duration::from_secs(5));
    let got = {
        let mut poll = std::pin::pin!(a.poll(2, Duration::from_secs(20)));
        tokio::select! {
            r = &mut poll => r,
            () = async {
                parked(&b, 2.0).await;
                publish_to(&c, "ahead", 0, 1).await;
                std::future::pending().await
            } => unreachable!(),
        }
        .expect("poll")
    };
    assert_eq!(keys(&got), vec![(0, 0)]);
    parked(&b, 1.0).await;
    publish_to(&c, "ahead", 1, 1).await;
    groups_common::eventually("the claim ahead", Duration::from_secs(10), || async {
        b.metric("felix_group_polls_waiting") == 0.0
    })
    .await;
    finish(a).await;

    let mut b2 = group(&c, "ahead", "workers").await;
    let again = b2.poll(10, Duration::from_secs(5)).await.expect("poll");
    assert_eq!(keys(&again), vec![(1, 0)]);
    assert_eq!(
        again[0].record.attempts, 2,
        "claimed ahead, then handed back"
    );
    b2.ack_many(&again).await.expect("ack");
    let info = b2.describe().await.expect("describe");
    assert_eq!(info[0].in_flight, 1, "the returned record stays claimed");
    assert_eq!(info[1].in_flight, 0);
    b2.close().await.expect("close");
}

#[tokio::test]
async fn closing_a_sharded_group_hands_back_what_it_claimed_ahead() {
    claimed_ahead_goes_back(async |g| g.close().await.expect("close")).await;
}

#[tokio::test]
async fn dropping_a_sharded_group_hands_back_what_it_claimed_ahead() {
    claimed_ahead_goes_back(async |g| drop(g)).await;
}

#[tokio::test]
async fn sharded_acks_nacks_and_dead_letters_go_to_each_records_shard() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    sharded_stream(&c, "route", 3).await;
    for shard in 0..3 {
        publish_to(&c, "route", shard, 1).await;
    }
    let mut g = group(&c, "route", "workers").await;
    let mut got = g.poll(10, Duration::ZERO).await.expect("poll");
    got.sort_by_key(|r| r.shard);
    assert_eq!(keys(&got), vec![(0, 0), (1, 0), (2, 0)]);

    let stands = g
        .extend(&got[0], Duration::from_secs(45))
        .await
        .expect("extend");
    assert!(stands > Duration::from_secs(40));
    g.ack(&got[0]).await.expect("ack");
    g.nack(&got[1]).await.expect("nack");
    g.dead_letter_with_reason(&got[2], "unparseable")
        .await
        .expect("dead_letter");

    let info = g.describe().await.expect("describe");
    assert_eq!((info[0].position, info[0].in_flight), (1, 0));
    assert_eq!((info[1].position, info[1].owed), (0, 1));
    assert_eq!((info[2].position, info[2].dead_letters), (1, 1));
    assert_eq!(
        c.group_dead_letters(T, NS, "route", 2, "workers")
            .await
            .expect("dead letters"),
        vec![0]
    );
    // The nacked record comes again, from its own shard.
    let again = g.poll(10, Duration::ZERO).await.expect("poll");
    assert_eq!(keys(&again), vec![(1, 0)]);
    assert_eq!(again[0].record.attempts, 2);
    g.ack_many(&again).await.expect("ack");
    g.close().await.expect("close");
}

#[tokio::test]
async fn a_named_sharded_member_takes_back_its_claims_on_every_shard() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    sharded_stream(&c, "named", 2).await;
    for shard in 0..2 {
        publish_to(&c, "named", shard, 3).await;
    }
    let member = GroupMember::new("worker-1").reclaim(true);
    // The first run claims everything and stops answering (its client
    // stays connected, as a hung process's would).
    let first = client(&b.addr).await;
    let mut old = group(&first, "named", "workers")
        .await
        .member(member.clone())
        .expect("member");
    let mut held = old.poll(100, Duration::ZERO).await.expect("poll");
    held.extend(old.poll(100, Duration::ZERO).await.expect("poll"));
    assert_eq!(held.len(), 6);
    assert_eq!(old.held(), 0);
    drop(old);

    // An anonymous consumer gets nothing: the claims stand.
    let mut anon = group(&c, "named", "workers").await;
    assert!(anon
        .poll(100, Duration::ZERO)
        .await
        .expect("poll")
        .is_empty());

    // The restarted member, on a new connection, takes all six back at once.
    let mut new = group(&client(&b.addr).await, "named", "workers")
        .await
        .member(member)
        .expect("member");
    let mut back = Vec::new();
    for _ in 0..4 {
        back.extend(new.poll(100, Duration::ZERO).await.expect("poll"));
    }
    let mut k = keys(&back);
    k.sort();
    assert_eq!(k, vec![(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]);
    assert!(back.iter().all(|r| r.record.attempts == 2));
    new.ack_many(&back).await.expect("ack");
    new.close().await.expect("close");
    anon.close().await.expect("close");
}

#[tokio::test]
async fn a_sharded_group_refuses_bad_arguments() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    sharded_stream(&c, "args", 2).await;
    let missing = ShardedGroup::new(c.clone(), T, NS, "nope", "workers").await;
    assert_eq!(
        missing.err().and_then(|e| e.code()),
        Some(felix_wire::ErrorCode::NotFound)
    );
    let g = group(&c, "args", "workers").await;
    assert!(g.member(GroupMember::new("")).is_err());
    let mut g = group(&c, "args", "workers").await;
    assert!(g.poll(0, Duration::ZERO).await.is_err());
}

#[tokio::test]
async fn a_cancelled_sharded_poll_keeps_what_it_claimed() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    sharded_stream(&c, "cancel", 2).await;
    for shard in 0..2 {
        publish_to(&c, "cancel", shard, 5).await;
    }
    let mut g = group(&c, "cancel", "workers").await;
    // Polled once and dropped, at its first wait for an answer: the poll
    // it sent still claims records.
    {
        let mut poll = std::pin::pin!(g.poll(100, Duration::ZERO));
        let once = std::future::poll_fn(|cx| {
            std::task::Poll::Ready(std::future::Future::poll(poll.as_mut(), cx))
        })
        .await;
        assert!(once.is_pending(), "the poll answered without waiting");
    }

    // Every record still comes out of this group, once and as a first
    // delivery, not after its claim lapses 30 s later.
    let mut records = Vec::new();
    for _ in 0..20 {
        records.extend(g.poll(100, Duration::from_millis(500)).await.expect("poll"));
        if records.len() >= 10 {
            break;
        }
    }
    assert!(records.iter().all(|r| r.record.attempts == 1));
    let mut got = keys(&records);
    got.sort();
    let want: Vec<(u32, u64)> = (0..2).flat_map(|s| (0..5).map(move |o| (s, o))).collect();
    assert_eq!(got, want);
    g.close().await.expect("close");
}

#[tokio::test]
async fn a_sharded_poll_sends_a_new_wait_where_one_ended_empty() {
    // The broker ends every wait after 200 ms; the poll's own lasts longer.
    let b = felix_tests::start_broker!(opts(30_000, 5).env("FELIX_GROUP_MAX_WAIT_MS", 200));
    let c = client(&b.addr).await;
    sharded_stream(&c, "rewait", 2).await;
    let mut g = group(&c, "rewait", "workers").await;
    let got = {
        let mut poll = std::pin::pin!(g.poll(10, Duration::from_secs(20)));
        tokio::select! {
            r = &mut poll => r,
            () = async {
                // Well past the broker's cap: the first waits have ended.
                tokio::time::sleep(Duration::from_millis(700)).await;
                publish_to(&c, "rewait", 1, 1).await;
                std::future::pending().await
            } => unreachable!(),
        }
        .expect("poll")
    };
    assert_eq!(keys(&got), vec![(1, 0)]);
    g.ack_many(&got).await.expect("ack");
    g.close().await.expect("close");
}

#[tokio::test]
async fn a_sharded_poll_for_fewer_records_than_shards_claims_no_more() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    sharded_stream(&c, "few", 4).await;
    let mut a = group(&client(&b.addr).await, "few", "workers").await;
    let (producer, publish) = (c.clone(), tokio::sync::oneshot::channel::<()>());
    let publisher = tokio::spawn(async move {
        let _ = publish.1.await;
        for shard in 0..4 {
            publish_to(&producer, "few", shard, 1).await;
        }
    });
    let got = {
        let mut poll = std::pin::pin!(a.poll(1, Duration::from_secs(20)));
        tokio::select! {
            r = &mut poll => r,
            () = async {
                parked(&b, 1.0).await;
                let _ = publish.0.send(());
                std::future::pending().await
            } => unreachable!(),
        }
        .expect("poll")
    };
    publisher.await.expect("publisher");
    assert_eq!(got.len(), 1);
    assert_eq!(a.held(), 0);
    // The other three were never claimed: first deliveries for another
    // consumer, at once.
    let mut b2 = group(&c, "few", "workers").await;
    let rest = b2.poll(10, Duration::ZERO).await.expect("poll");
    assert_eq!(rest.len(), 3, "{:?} then {:?}", keys(&got), keys(&rest));
    assert!(rest.iter().all(|r| r.record.attempts == 1));
    assert!(rest.iter().all(|r| r.shard != got[0].shard));
    a.ack_many(&got).await.expect("ack");
    b2.ack_many(&rest).await.expect("ack");
    a.close().await.expect("close");
    b2.close().await.expect("close");
}

#[tokio::test]
async fn a_sharded_poll_does_not_spin_when_the_broker_ends_its_waits_at_once() {
    // The broker ends every wait after 1 ms.
    let b = felix_tests::start_broker!(opts(30_000, 5).env("FELIX_GROUP_MAX_WAIT_MS", 1));
    let c = client(&b.addr).await;
    sharded_stream(&c, "spin", 2).await;
    let mut g = group(&c, "spin", "workers")
        .await
        .wait_slice(Duration::from_millis(500));
    // Only polls are sent meanwhile.
    let polls = || b.metric("felix_requests_total");
    let before = polls();
    assert!(g
        .poll(10, Duration::from_secs(2))
        .await
        .expect("poll")
        .is_empty());
    // A sweep of both shards, then a wait on each every 500 ms: about ten
    // polls, not one per round trip.
    let sent = polls() - before;
    assert!((2.0..=20.0).contains(&sent), "{sent} polls in 2 s");
    g.close().await.expect("close");
}

/// A group comes into being shard by shard, on its first poll there. The
/// stream-wide calls act on every shard regardless: the lag counts the
/// records of a shard not polled yet (its first poll starts at the start),
/// a seek puts the group there too (created), a delete counts a shard
/// without it as done, and a group on no shard is `not_found`.
#[tokio::test]
async fn stream_wide_group_calls_reach_shards_the_group_has_not_polled() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    sharded_stream(&c, "partial", 3).await;
    for shard in 0..3 {
        publish_to(&c, "partial", shard, 10).await;
    }
    // Polled (and finished) on shard 1 only.
    let got = c.group_poll(T, NS, "partial", 1, "g", 100).await.unwrap();
    let offsets: Vec<u64> = got.iter().map(|r| r.offset).collect();
    c.group_ack_many(T, NS, "partial", 1, "g", &offsets)
        .await
        .unwrap();
    let mut g = group(&c, "partial", "g").await;
    assert_eq!(g.lag().await.unwrap(), 20, "shards 0 and 2 owe all 20");
    let infos = c
        .group_describe_stream(T, NS, "partial", "g")
        .await
        .unwrap();
    let at: Vec<(u64, u64)> = infos.iter().map(|i| (i.position, i.lag())).collect();
    assert_eq!(at, [(0, 10), (10, 0), (0, 10)]);

    // A seek to the tail moves shard 1 and creates the group on 0 and 2.
    c.group_seek_stream(T, NS, "partial", "g", felix_wire::StartPosition::Latest)
        .await
        .unwrap();
    for shard in 0..3 {
        let i = c
            .group_describe(T, NS, "partial", shard, "g")
            .await
            .unwrap();
        assert_eq!((i.position, i.lag()), (10, 0), "shard {shard}");
    }
    assert!(g.poll(100, Duration::ZERO).await.unwrap().is_empty());

    // Deleted on shard 0 alone, then on every shard: the rest go too.
    c.group_delete(T, NS, "partial", 0, "g").await.unwrap();
    c.group_delete_stream(T, NS, "partial", "g").await.unwrap();
    for shard in 0..3 {
        let e = c
            .group_describe(T, NS, "partial", shard, "g")
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(felix_wire::ErrorCode::NotFound), "{e}");
    }
    // On no shard: each stream-wide call says so, and the seek made nothing.
    let start = felix_wire::StartPosition::Earliest;
    for e in [
        c.group_delete_stream(T, NS, "partial", "g")
            .await
            .unwrap_err(),
        c.group_seek_stream(T, NS, "partial", "g", start)
            .await
            .unwrap_err(),
        c.group_describe_stream(T, NS, "partial", "g")
            .await
            .unwrap_err(),
    ] {
        assert_eq!(e.code(), Some(felix_wire::ErrorCode::NotFound), "{e}");
        assert!(e.to_string().contains("does not exist on any shard"), "{e}");
    }
    assert!(c.list_groups(T, NS, "partial", 0).await.unwrap().is_empty());
}
