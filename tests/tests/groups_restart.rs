//! Consumer groups across `kill -9`: what the guide says survives a restart
//! (the position, dead letters, redrives) does, and what is only the
//! leader's memory (claims, delays, extensions, acks above the position) is
//! handed out again from the position.

mod groups_common;

use felix_wire::{ErrorCode, StartPosition};
use groups_common::*;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// kill -9 with claims standing, dead letters listed and a redrive pending.
/// After the restart nothing below the position is redelivered (except the
/// redriven record, still owed), records claimed and not acked come back,
/// dead letters are still listed and still not delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_dead_letters_and_redrives_survive_kill_9() {
    let mut b = felix_tests::start_broker!(opts(30_000, 2));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 10).await;
    let g = Group::new(&c, JOBS, "workers");
    let batch = g.poll(10).await;
    assert_eq!(offsets(&batch), (0..10).collect::<Vec<_>>());
    g.ack_many(&[0, 1, 2]).await.unwrap();
    g.dead_letter(&batch[3], Some("bad input")).await.unwrap(); // finished: position 4
    g.ack(5).await.unwrap(); // above the gap at 4
    g.dead_letter(&batch[6], None).await.unwrap();
    // Offset 7 runs out of attempts (bound 2) and the broker gives up.
    g.nack(&batch[7]).await.unwrap();
    let r = g.poll(1).await;
    assert_eq!((offsets(&r), attempts(&r)), (vec![7], vec![2]));
    g.nack(&r[0]).await.unwrap();
    // A redrive of 3, below the position, is pending when the broker dies.
    g.redrive(3).await.unwrap();
    let info = g.describe().await.unwrap();
    assert_eq!((info.position, info.in_flight, info.owed), (4, 3, 1));
    assert_eq!(g.dead_letters().await, vec![6, 7]);

    b.kill9();
    b.restart();
    let c = client(&b.addr).await;
    let g = Group::new(&c, JOBS, "workers");
    let info = g.describe().await.unwrap();
    assert_eq!(info.position, 4, "the durable position");
    let dead = g.dead_letters_detailed().await;
    let dead: Vec<_> = dead
        .iter()
        .map(|d| (d.offset, d.by_consumer, d.attempts))
        .collect();
    assert_eq!(dead, vec![(6, true, 1), (7, false, 2)], "still listed");

    let again = g.drain().await;
    let got = offsets(&again);
    // 3: the redrive, still owed, first. 4, 8, 9: claimed, never acked.
    // 5: its ack was above the position, which only memory held.
    assert_eq!(got, vec![3, 4, 5, 8, 9], "{got:?}");
    assert!(attempts(&again).iter().all(|&a| a == 1));
    g.ack_all(&again).await;
    assert_eq!(g.position().await, 10);

    // Everything finished stays finished; the dead letters can still be
    // redriven and discarded after yet another crash.
    b.kill9();
    b.restart();
    let c = client(&b.addr).await;
    let g = Group::new(&c, JOBS, "workers");
    assert!(g.poll(100).await.is_empty());
    assert_eq!(g.position().await, 10);
    assert_eq!(g.dead_letters().await, vec![6, 7]);
    g.redrive(6).await.unwrap();
    g.discard(7).await.unwrap();
    let r = g.poll(100).await;
    assert_eq!((offsets(&r), attempts(&r)), (vec![6], vec![1]));
    g.ack(6).await.unwrap();
    b.kill9();
    b.restart();
    let g = Group::new(&client(&b.addr).await, JOBS, "workers");
    assert!(g.dead_letters().await.is_empty());
    assert_eq!(g.position().await, 10);
    assert!(g.poll(100).await.is_empty());
}

/// An ack is durable before it is answered: a consumer acking while the
/// broker is killed loses no acknowledged record (none comes back after the
/// restart) and the group resumes from its position with nothing missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acknowledged_record_is_not_redelivered_after_kill_9() {
    let mut b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    // Far more than the consumer gets through before the kill, however
    // late the test's thread runs after the first 500 acks (and what is
    // left, drained unacknowledged below, within the group's 10,000 in
    // flight).
    let total = 8_000u64;
    for _ in 0..8 {
        publish(&c, JOBS, 1000).await;
    }
    let acked: Arc<Mutex<BTreeSet<u64>>> = Arc::default();
    let consumer = {
        let g = Group::new(&client(&b.addr).await, JOBS, "workers");
        let acked = acked.clone();
        tokio::spawn(async move {
            loop {
                let Ok(batch) = g.c.group_poll(T, NS, JOBS, 0, "workers", 20).await else {
                    return;
                };
                let o = offsets(&batch);
                if g.ack_many(&o).await.is_err() {
                    return;
                }
                acked.lock().unwrap().extend(o);
            }
        })
    };
    eventually("some acks", Duration::from_secs(20), || async {
        acked.lock().unwrap().len() >= 500
    })
    .await;
    b.kill9();
    let _ = consumer.await;
    let acked = acked.lock().unwrap().clone();
    assert!((acked.len() as u64) < total, "the consumer was still going");

    b.restart();
    let g = Group::new(&client(&b.addr).await, JOBS, "workers");
    let position = g.position().await;
    let acked_prefix = (0..).find(|o| !acked.contains(o)).unwrap();
    assert!(
        position >= acked_prefix,
        "position {position} below acknowledged {acked_prefix}"
    );
    let again = g.drain().await;
    let got = offsets(&again);
    assert_eq!(
        got,
        (position..total).collect::<Vec<_>>(),
        "the rest, once, in order"
    );
    let redelivered_acked: Vec<u64> = got.iter().copied().filter(|o| acked.contains(o)).collect();
    assert!(
        redelivered_acked.is_empty(),
        "acknowledged, then redelivered: {redelivered_acked:?}"
    );
}

/// Delays and extensions are the leader's memory: after a restart those
/// records are handed out from the position at once, sooner than asked. A
/// claim from before the restart can no longer be extended or nacked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delays_and_extensions_do_not_outlive_a_restart() {
    let mut b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 3).await;
    let g = Group::new(&c, JOBS, "workers");
    let batch = g.poll(3).await;
    g.nack_after(&batch[0], Duration::from_secs(50))
        .await
        .unwrap();
    g.extend(&batch[1], Duration::from_secs(50)).await.unwrap();
    g.ack(2).await.unwrap();
    assert!(g.poll(10).await.is_empty());

    b.kill9();
    b.restart();
    let g = Group::new(&client(&b.addr).await, JOBS, "workers");
    assert_eq!(
        code(g.extend(&batch[1], Duration::from_secs(5)).await),
        Some(ErrorCode::StaleClaim),
        "the claim did not survive"
    );
    let again = g.poll(10).await;
    // 2's ack was above the position (0 was still unfinished): memory only.
    assert_eq!(
        (offsets(&again), attempts(&again)),
        (vec![0, 1, 2], vec![1, 1, 1])
    );
    g.ack_all(&again).await;
    assert_eq!(g.position().await, 3);
}

/// Two polls of one group reading cold records at once (after a restart
/// nothing is in the read cache): the one whose planned records the other
/// took while both were reading plans and reads again, rather than
/// answering empty while records wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_polls_over_cold_records_never_answer_empty_while_records_wait() {
    const N: u64 = 2_000;
    let mut b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    for _ in 0..4 {
        publish(&c, JOBS, (N / 4) as u32).await;
    }
    b.kill9();
    b.restart();
    let (c1, c2) = (client(&b.addr).await, client(&b.addr).await);
    let (g1, g2) = (
        Group::new(&c1, JOBS, "workers"),
        Group::new(&c2, JOBS, "workers"),
    );
    let mut seen = BTreeSet::new();
    let mut round = 0;
    while (seen.len() as u64) < N {
        let (a, b2) = tokio::join!(g1.poll(10), g2.poll(10));
        let left = N - seen.len() as u64;
        for (name, got) in [("first", &a), ("second", &b2)] {
            assert!(
                !got.is_empty() || left <= 10,
                "round {round}: the {name} poll answered empty with {left} records waiting"
            );
            for r in got.iter() {
                assert!(
                    seen.insert(r.offset),
                    "offset {} handed out twice",
                    r.offset
                );
            }
        }
        g1.ack_all(&a).await;
        g2.ack_all(&b2).await;
        round += 1;
    }
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        (0..N).collect::<Vec<_>>()
    );
    assert_eq!(g1.position().await, N);
}

/// Describing a group right after a restart tells the truth about time: a
/// redrive still owed has been owed since the broker came back (its redrive
/// time is not durable), not since 1970, and a group with no request since
/// the restart has no last-active time. The same holds for the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_described_after_a_restart_reports_sane_ages() {
    let mut b = felix_tests::start_broker!(opts(30_000, 1));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 2).await;
    let g = Group::new(&c, JOBS, "workers");
    let batch = g.poll(2).await;
    g.nack(&batch[0]).await.unwrap(); // one attempt: a dead letter
    g.ack(1).await.unwrap();
    g.redrive(0).await.unwrap();

    b.kill9();
    b.restart();
    let g = Group::new(&client(&b.addr).await, JOBS, "workers");
    let info = g.describe().await.unwrap();
    assert_eq!((info.owed, info.in_flight), (1, 0), "{info:?}");
    let age = info.oldest_owed_age_ms.expect("an owed record has an age");
    assert!(age < 60_000, "owed for {age} ms, since before the restart");
    assert_eq!(info.last_active_ms, None, "no request since the restart");
    let labels = [("group", "workers")];
    let metric = b
        .metric_series("felix_group_oldest_owed_age_seconds", &labels)
        .expect("the group's gauge");
    assert!(metric < 60.0, "{metric}");
    // Its first request since: active again.
    assert_eq!(offsets(&g.poll(1).await), vec![0]);
    assert!(g.describe().await.unwrap().last_active_ms.is_some());
}

/// Group state over many segments. With 4 KiB segments the log rolls every
/// few calls, and each start-up rebuilds the groups from the newest
/// segment's opening snapshot and what follows it, as the sealed segments'
/// summaries direct, without reading the sealed segments. Across `kill -9`s
/// and clean stops what the guide says survives (positions, dead letters, a
/// pending redrive, a deleted group staying deleted) comes back, and the
/// same as from a start-up that reads every segment (`verify_on_open`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_state_over_many_segments_survives_restarts_as_a_full_replay_rebuilds_it() {
    let cfg = config_file("[storage]\nsegment_bytes = 4096\n");
    let mut b =
        felix_tests::start_broker!(opts(30_000, 2).env("FELIX_TEST_CONFIG", cfg.path.display()));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    fill(&c, 30).await;
    let a = Group::new(&c, JOBS, "a");
    let r = a.poll(50).await;
    assert_eq!(r.len(), 50);
    a.ack_many(&(0..40).collect::<Vec<_>>()).await.unwrap();
    fill(&c, 12).await;
    a.dead_letter(&r[40], Some("bad")).await.unwrap();
    a.dead_letter(&r[41], None).await.unwrap();
    a.ack_many(&(42..50).collect::<Vec<_>>()).await.unwrap();
    fill(&c, 12).await;
    a.redrive(40).await.unwrap();
    let bg = Group::new(&c, JOBS, "b");
    bg.create(StartPosition::Offset(100)).await.unwrap();
    let r = bg.poll(20).await;
    bg.ack_all(&r).await;
    let cg = Group::new(&c, JOBS, "c");
    let r = cg.poll(10).await;
    cg.ack_all(&r).await;
    fill(&c, 12).await;
    cg.delete().await.unwrap();
    fill(&c, 12).await;
    let shard = b.data_dir().unwrap().join(format!("{T}/{NS}/{JOBS}/0"));
    let count = |ext: &str| {
        std::fs::read_dir(&shard)
            .unwrap()
            .filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                name.to_string_lossy().ends_with(ext)
            })
            .count()
    };
    assert!(count(".log") >= 6, "{} segments", count(".log"));

    let mut b_position = 120;
    for round in 0..5 {
        match round {
            0 => b.restart_with_env("FELIX_VERIFY_ON_OPEN", 1),
            1 => b.restart_with_env("FELIX_VERIFY_ON_OPEN", 0),
            2 => assert!(b.terminate().success()),
            _ => b.kill9(),
        }
        if round >= 2 {
            b.restart();
        }
        assert!(count(".sum") + 1 >= count(".log"), "round {round}");
        let c = client(&b.addr).await;
        let a = Group::new(&c, JOBS, "a");
        let info = a.describe().await.unwrap();
        assert_eq!((info.position, info.dead_letters), (50, 1), "round {round}");
        assert_eq!(a.dead_letters().await, vec![41], "round {round}");
        let bg = Group::new(&c, JOBS, "b");
        assert_eq!(bg.position().await, b_position, "round {round}");
        let cg = Group::new(&c, JOBS, "c");
        assert_eq!(
            code(cg.describe().await),
            Some(ErrorCode::NotFound),
            "round {round}: the deleted group"
        );
        // More rolls before the next restart, and group b moves on.
        fill(&c, 15).await;
        let r = bg.poll(5).await;
        bg.ack_all(&r).await;
        b_position += 5;
    }
    // The redrive is still owed, first.
    let c = client(&b.addr).await;
    let a = Group::new(&c, JOBS, "a");
    let r = a.poll(1).await;
    assert_eq!(offsets(&r), vec![40]);
}

/// `batches` publishes of 10 records each (a batch a publish, so each
/// takes its own room in the log).
async fn fill(c: &felix_client::Client, batches: u32) {
    for _ in 0..batches {
        publish(c, JOBS, 10).await;
    }
}
