//! The guarantees of the *Queues and Consumer Groups* guide, end to end:
//! one test per name the guide lists, each against a real broker process
//! over TCP, with short timeouts set through the broker's configuration.

mod groups_common;

use felix_client::{Client, ClientError, GroupMember, GroupPollOptions};
use felix_wire::{ErrorCode, StartPosition};
use groups_common::*;
use std::collections::HashSet;
use std::time::{Duration, Instant};

// ---------------------------------------------------------------- the loop

/// While a claim stands no other poll receives the record: concurrent
/// consumers on their own connections get every offset exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offset_in_flight_is_not_handed_out_again() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 40).await;
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let addr = b.addr.clone();
        tasks.push(tokio::spawn(async move {
            let g = Group::new(&client(&addr).await, JOBS, "workers");
            let mut got = Vec::new();
            loop {
                let batch = g.poll(3).await;
                if batch.is_empty() {
                    return got;
                }
                got.extend(batch);
            }
        }));
    }
    let mut seen = HashSet::new();
    for t in tasks {
        for r in t.await.unwrap() {
            assert_eq!(r.attempts, 1, "offset {} redelivered while held", r.offset);
            assert!(
                seen.insert(r.offset),
                "offset {} handed out twice",
                r.offset
            );
        }
    }
    assert_eq!(seen, (0..40).collect::<HashSet<u64>>());
    let g = Group::new(&c, JOBS, "workers");
    assert!(g.poll(100).await.is_empty(), "every record is held");
    assert_eq!(g.describe().await.unwrap().in_flight, 40);
    g.ack_many(&(0..40).collect::<Vec<_>>()).await.unwrap();
    assert_eq!(g.position().await, 40);
}

/// A claim that is not acked lapses after the visibility timeout and the
/// record goes to whoever polls next, as another attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_claim_is_handed_out_again() {
    let b = felix_tests::start_broker!(opts(800, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 1).await;
    let g = Group::new(&c, JOBS, "workers");
    let other = g.via(&client(&b.addr).await);
    let start = Instant::now();
    let first = g.poll(10).await;
    assert_eq!((offsets(&first), attempts(&first)), (vec![0], vec![1]));
    assert!(other.poll(10).await.is_empty(), "the claim still stands");
    // The dead consumer never answers; the record comes back on its own.
    let again = other.poll_wait(10, Duration::from_secs(5)).await;
    assert!(
        start.elapsed() >= Duration::from_millis(750),
        "lapsed early: {:?}",
        start.elapsed()
    );
    assert_eq!((offsets(&again), attempts(&again)), (vec![0], vec![2]));
    assert_eq!(&again[0].payload[..], b"p0");
    other.ack(0).await.unwrap();
    assert_eq!(g.position().await, 1);
    assert!(
        g.poll_wait(10, Duration::from_millis(1000))
            .await
            .is_empty(),
        "acked: gone for good"
    );
}

/// Acks out of order are fine but the saved position only passes a
/// contiguous run of finished offsets, so a restart redelivers the hole and
/// nothing before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cursor_does_not_advance_over_a_gap() {
    let mut b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 8).await;

    // Out of order: the position waits for the lowest, then jumps the run.
    let side = Group::new(&c, JOBS, "side");
    assert_eq!(side.poll(8).await.len(), 8);
    side.ack_many(&[4, 5, 6, 7]).await.unwrap();
    assert_eq!(side.position().await, 0);
    side.ack_many(&[0, 1, 2]).await.unwrap();
    assert_eq!(side.position().await, 3);
    side.ack(3).await.unwrap();
    assert_eq!(side.position().await, 8);

    // The guide's picture: 4 acked while 3 is held.
    let g = Group::new(&c, JOBS, "workers");
    assert_eq!(offsets(&g.poll(8).await), (0..8).collect::<Vec<_>>());
    g.ack_many(&[0, 1, 2, 4, 5, 6, 7]).await.unwrap();
    let info = g.describe().await.unwrap();
    assert_eq!(info.position, 3, "the cursor stops at the held offset");
    assert_eq!(info.in_flight, 1);

    b.kill9();
    b.restart();
    let c = client(&b.addr).await;
    let g = Group::new(&c, JOBS, "workers");
    assert_eq!(g.position().await, 3);
    let again = g.drain().await;
    let got = offsets(&again);
    assert_eq!(got.first(), Some(&3), "offset 3 comes back first: {got:?}");
    assert!(
        got.iter().all(|&o| o >= 3),
        "nothing below the cursor is redelivered: {got:?}"
    );
    g.ack_all(&again).await;
    assert_eq!(g.position().await, 8);
    assert_eq!(Group::new(&c, JOBS, "side").position().await, 8);
}

/// A record handed back or lapsed is owed, and owed records go out before
/// new ones, however many new ones a producer adds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owed_records_go_out_before_new_ones() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 4).await;
    let g = Group::new(&c, JOBS, "workers");
    let batch = g.poll(2).await;
    assert_eq!(offsets(&batch), vec![0, 1]);
    // Offset 2 is claimed for a short time only, and left to lapse.
    let short = GroupPollOptions {
        max_records: 1,
        visibility: Some(Duration::from_millis(200)),
        ..GroupPollOptions::default()
    };
    let lapsing = g.poll_as(&GroupMember::new("slow"), short).await;
    assert_eq!(offsets(&lapsing), vec![2]);
    g.nack(&batch[1]).await.unwrap();
    g.nack(&batch[0]).await.unwrap();
    // A fast producer adds plenty of new work meanwhile.
    publish(&c, JOBS, 200).await;
    eventually("offset 2 to lapse", Duration::from_secs(5), || async {
        g.describe().await.unwrap().owed == 3
    })
    .await;
    let next = g.poll(4).await;
    assert_eq!(
        (offsets(&next), attempts(&next)),
        (vec![0, 1, 2, 3], vec![2, 2, 2, 1])
    );
}

// ----------------------------------------------------- retries, giving up

/// After FELIX_GROUP_MAX_ATTEMPTS deliveries the record is a dead letter
/// and the group moves past it, whether the last attempt was nacked or
/// lapsed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_is_given_up_on_after_the_attempt_bound() {
    let b = felix_tests::start_broker!(opts(300, 3));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 2).await;
    let g = Group::new(&c, JOBS, "workers");

    // Offset 0 fails every time it is tried (claimed long enough that the
    // nack, not a lapse, hands it back).
    let long = GroupPollOptions {
        max_records: 1,
        visibility: Some(Duration::from_secs(10)),
        ..GroupPollOptions::default()
    };
    let me = GroupMember::new("failing");
    for attempt in 1..=3 {
        let r = g.poll_as(&me, long).await;
        assert_eq!((offsets(&r), attempts(&r)), (vec![0], vec![attempt]));
        g.nack(&r[0]).await.unwrap();
    }
    let dead = g.dead_letters_detailed().await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        (dead[0].offset, dead[0].attempts, dead[0].by_consumer),
        (0, 3, false)
    );

    // Offset 1's consumer dies three times.
    let r = g.poll(1).await;
    assert_eq!((offsets(&r), attempts(&r)), (vec![1], vec![1]));
    for attempt in 2..=3 {
        let r = g.poll_wait(1, Duration::from_secs(5)).await;
        assert_eq!((offsets(&r), attempts(&r)), (vec![1], vec![attempt]));
    }
    // Its third claim lapses too: given up, not handed out a fourth time.
    assert!(g.poll_wait(1, Duration::from_millis(800)).await.is_empty());
    let dead = g.dead_letters_detailed().await;
    assert_eq!(
        dead.iter()
            .map(|d| (d.offset, d.attempts))
            .collect::<Vec<_>>(),
        vec![(0, 3), (1, 3)]
    );
    let info = g.describe().await.unwrap();
    assert_eq!(
        (info.position, info.dead_letters, info.in_flight),
        (2, 2, 0)
    );
    // The queue is not stuck: the next record goes out.
    publish(&c, JOBS, 1).await;
    let r = g.poll(10).await;
    assert_eq!((offsets(&r), attempts(&r)), (vec![2], vec![1]));
    // A dead letter is a pointer: the record is still in the log.
    let read = c
        .read(T, NS, JOBS, 0, StartPosition::Offset(0), 1, None)
        .await
        .unwrap();
    assert_eq!(&read.records[0].payload[..], b"p0");
}

/// A redriven dead letter is owed again and handed out, without the cursor
/// moving back over what was finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redriven_record_is_handed_out_again() {
    let b = felix_tests::start_broker!(opts(30_000, 1));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 3).await;
    let g = Group::new(&c, JOBS, "workers");
    let batch = g.poll(3).await;
    g.nack(&batch[1]).await.unwrap(); // attempt bound 1: a dead letter at once
    g.ack_many(&[0, 2]).await.unwrap();
    assert_eq!(g.dead_letters().await, vec![1]);
    assert_eq!(g.position().await, 3);
    assert!(g.poll(10).await.is_empty());
    assert_eq!(
        code(g.redrive(0).await),
        Some(ErrorCode::NotFound),
        "not a dead letter"
    );

    g.redrive(1).await.unwrap();
    assert!(g.dead_letters().await.is_empty(), "owed, no longer listed");
    let info = g.describe().await.unwrap();
    assert_eq!(
        (info.position, info.owed),
        (3, 1),
        "the cursor stays where it was"
    );
    let again = g.via(&client(&b.addr).await).poll(10).await;
    assert_eq!(
        offsets(&again),
        vec![1],
        "only the redriven record, nothing finished"
    );
    assert_eq!(&again[0].payload[..], b"p1");
    g.ack(1).await.unwrap();
    assert_eq!(g.position().await, 3);
    assert!(g.poll(10).await.is_empty());
    assert!(g.dead_letters().await.is_empty());
}

/// A redrive resets the attempt count: the record gets the full bound again
/// and goes back on the list when it fails it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redriven_record_gets_its_attempts_back() {
    let b = felix_tests::start_broker!(opts(30_000, 2));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 1).await;
    let g = Group::new(&c, JOBS, "workers");
    for round in 0..2 {
        for attempt in 1..=2 {
            let r = g.poll(1).await;
            assert_eq!(
                (offsets(&r), attempts(&r)),
                (vec![0], vec![attempt]),
                "round {round}"
            );
            g.nack(&r[0]).await.unwrap();
        }
        let dead = g.dead_letters_detailed().await;
        assert_eq!(dead.len(), 1, "round {round}");
        assert_eq!((dead[0].offset, dead[0].attempts), (0, 2));
        assert!(g.poll(1).await.is_empty(), "given up on");
        g.redrive(0).await.unwrap();
    }
    let r = g.poll(1).await;
    assert_eq!((offsets(&r), attempts(&r)), (vec![0], vec![1]));
    g.ack(0).await.unwrap();
    assert!(g.dead_letters().await.is_empty());
}

/// A redrive is durable before it is answered: kill -9 right after it and
/// the restarted broker still owes the record, until it is acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redriven_record_is_still_owed_after_a_restart() {
    let mut b = felix_tests::start_broker!(opts(30_000, 1));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 3).await;
    let g = Group::new(&c, JOBS, "workers");
    let batch = g.poll(3).await;
    g.nack(&batch[1]).await.unwrap();
    g.ack_many(&[0, 2]).await.unwrap();
    assert_eq!(g.position().await, 3);
    g.redrive(1).await.unwrap();

    b.kill9();
    b.restart();
    let c = client(&b.addr).await;
    let g = Group::new(&c, JOBS, "workers");
    assert!(g.dead_letters().await.is_empty());
    assert_eq!(g.position().await, 3);
    let again = g.poll(10).await;
    assert_eq!((offsets(&again), attempts(&again)), (vec![1], vec![1]));
    g.ack(1).await.unwrap();

    // Finished for good: another crash does not bring it back.
    b.kill9();
    b.restart();
    let g = Group::new(&client(&b.addr).await, JOBS, "workers");
    assert!(g.poll(10).await.is_empty());
    assert!(g.dead_letters().await.is_empty());
}

// ------------------------------------------- long work, backoff, giving up

/// An extended claim stands past the visibility timeout: nobody else gets
/// the record, and the holder's ack is taken. Extensions are capped at
/// FELIX_GROUP_MAX_VISIBILITY_MS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extended_claim_outlasts_the_visibility_timeout() {
    let b = felix_tests::start_broker!(opts(500, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 1).await;
    let g = Group::new(&c, JOBS, "workers");
    let r = g.poll(1).await.remove(0);
    let capped = g.extend(&r, Duration::from_secs(3600)).await.unwrap();
    assert!(
        capped <= Duration::from_secs(60),
        "capped at the max visibility: {capped:?}"
    );
    let stands = g.extend(&r, Duration::from_secs(3)).await.unwrap();
    assert!(
        stands > Duration::from_secs(2) && stands <= Duration::from_secs(3),
        "{stands:?}"
    );
    let start = Instant::now();
    let other = g.via(&client(&b.addr).await);
    // Three visibility timeouts pass; the claim still stands.
    assert!(other
        .poll_wait(1, Duration::from_millis(1500))
        .await
        .is_empty());
    assert!(start.elapsed() >= Duration::from_millis(1400));
    let again = g.extend(&r, Duration::from_secs(2)).await.unwrap();
    assert!(again > Duration::from_secs(1), "still held: {again:?}");
    g.ack(r.offset).await.unwrap();
    assert_eq!(g.position().await, 1);
}

/// Once a claim lapsed and the record went out again, the old delivery can
/// no longer extend, hand back or dead-letter it: stale_claim. The new
/// holder can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extend_after_the_record_was_handed_out_again_is_refused() {
    let b = felix_tests::start_broker!(opts(300, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 1).await;
    let g = Group::new(&c, JOBS, "workers");
    let old = g.poll(1).await.remove(0);
    let other = g.via(&client(&b.addr).await);
    let wait_long = GroupPollOptions {
        max_records: 1,
        wait: Duration::from_secs(5),
        visibility: Some(Duration::from_secs(20)),
    };
    let new = other
        .poll_as(&GroupMember::new("other"), wait_long)
        .await
        .remove(0);
    assert_eq!((new.offset, new.attempts), (0, 2));
    let stale = Some(ErrorCode::StaleClaim);
    assert_eq!(code(g.extend(&old, Duration::from_secs(5)).await), stale);
    assert_eq!(code(g.nack(&old).await), stale);
    assert_eq!(
        code(g.nack_after(&old, Duration::from_secs(1)).await),
        stale
    );
    assert_eq!(code(g.dead_letter(&old, Some("late")).await), stale);
    assert!(
        g.dead_letters().await.is_empty(),
        "a refused dead letter is not listed"
    );
    // The refusals took nothing from the current holder.
    assert!(other.extend(&new, Duration::from_secs(5)).await.unwrap() > Duration::from_secs(4));
    assert!(g.poll(1).await.is_empty());
    other.ack(0).await.unwrap();
    assert_eq!(g.position().await, 1);
}

/// A nack with a delay holds the record (nobody can extend it) until the
/// delay passes; then it is owed and redelivered as the next attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_nack_is_redelivered_after_the_delay() {
    // A visibility far longer than the delay: redelivery is the delay's.
    let b = felix_tests::start_broker!(opts(20_000, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 1).await;
    let g = Group::new(&c, JOBS, "workers");
    let r = g.poll(1).await.remove(0);
    let start = Instant::now();
    g.nack_after(&r, Duration::from_millis(700)).await.unwrap();
    assert!(g.poll(1).await.is_empty(), "not owed before the delay");
    let info = g.describe().await.unwrap();
    assert_eq!((info.in_flight, info.delayed, info.owed), (1, 1, 0));
    assert_eq!(
        code(g.extend(&r, Duration::from_secs(5)).await),
        Some(ErrorCode::StaleClaim)
    );
    let again = g.poll_wait(1, Duration::from_secs(5)).await;
    let waited = start.elapsed();
    assert_eq!((offsets(&again), attempts(&again)), (vec![0], vec![2]));
    assert!(
        waited >= Duration::from_millis(650),
        "redelivered after {waited:?}"
    );
    assert!(
        waited < Duration::from_secs(5),
        "not after the visibility timeout: {waited:?}"
    );
    g.ack(0).await.unwrap();
}

/// group_dead_letter lists the record (with the consumer's reason), finishes
/// it so the cursor passes it, and it can be redriven or discarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_dead_letter_is_listed_finished_and_redrivable() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 3).await;
    let g = Group::new(&c, JOBS, "workers");
    let batch = g.poll(3).await;
    g.dead_letter(&batch[0], Some("poison")).await.unwrap();
    let dead = g.dead_letters_detailed().await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].offset, 0);
    assert_eq!(dead[0].attempts, 1);
    assert_eq!(dead[0].reason.as_deref(), Some("poison"));
    assert!(dead[0].by_consumer);
    g.ack(1).await.unwrap();
    assert_eq!(g.position().await, 2, "finished: the cursor passed it");
    assert!(
        g.poll(10).await.is_empty(),
        "a dead letter is not redelivered"
    );
    g.ack(2).await.unwrap();

    g.redrive(0).await.unwrap();
    let again = g.poll(10).await;
    assert_eq!((offsets(&again), attempts(&again)), (vec![0], vec![1]));
    g.ack(0).await.unwrap();
    assert!(g.dead_letters().await.is_empty());
    assert_eq!(g.position().await, 3);

    // And discarded: no longer listed, never delivered, still in the log.
    publish(&c, JOBS, 1).await;
    let r = g.poll(10).await.remove(0);
    g.dead_letter(&r, None).await.unwrap();
    assert_eq!(g.dead_letters().await, vec![3]);
    g.discard(3).await.unwrap();
    assert!(g.dead_letters().await.is_empty());
    assert!(g.poll(10).await.is_empty());
    assert_eq!(g.position().await, 4);
    let read = c
        .read(T, NS, JOBS, 0, StartPosition::Offset(3), 1, None)
        .await
        .unwrap();
    assert_eq!(read.records.len(), 1);
}

/// An idle group's memory is dropped (redelivering and restarting attempt
/// counts), but not while a claim still stands: the holder keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tracker_with_a_standing_claim_is_not_evicted() {
    // Idle after max(1 ms, 2 x 300 ms); the idle check runs at least once a
    // second.
    let cfg = config_file("[groups]\nidle_ms = 1\n");
    let b = felix_tests::start_broker!(opts(300, 5).env("FELIX_TEST_CONFIG", cfg.path.display()));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 1).await;
    let held = Group::new(&c, JOBS, "held");
    let delayed = Group::new(&c, JOBS, "delayed");
    let control = Group::new(&c, JOBS, "control");
    // A delayed nack standing through the idle time keeps its group too.
    let d = delayed.poll(1).await.remove(0);
    delayed
        .nack_after(&d, Duration::from_secs(10))
        .await
        .unwrap();
    let long = GroupPollOptions {
        max_records: 1,
        visibility: Some(Duration::from_secs(10)),
        ..GroupPollOptions::default()
    };
    let r = held
        .poll_as(&GroupMember::new("holder"), long)
        .await
        .remove(0);
    let lapses = control.poll(1).await.remove(0);
    assert_eq!(lapses.attempts, 1);
    // Time must pass with no group touched, so no polling here: the control
    // group's claim lapses (300 ms: owed), all three go idle (600 ms), and
    // the next idle check drops the control group's memory (nothing owed or
    // in flight any more). Describing is not activity, so it can watch.
    eventually(
        "the idle control group to be evicted",
        Duration::from_secs(10),
        || async {
            let info = c.group_describe(T, NS, JOBS, 0, "control").await.unwrap();
            info.owed == 0 && info.in_flight == 0
        },
    )
    .await;
    let control_again = control.poll(1).await;
    assert_eq!(
        (offsets(&control_again), attempts(&control_again)),
        (vec![0], vec![1]),
        "the control group was evicted: its attempt count restarted"
    );
    // The held claim survived: nobody else gets the record, the holder
    // still holds it.
    assert!(held.via(&client(&b.addr).await).poll(1).await.is_empty());
    assert!(held.extend(&r, Duration::from_secs(2)).await.is_ok());
    held.ack(0).await.unwrap();
    assert_eq!(held.position().await, 1);
    // The delayed nack survived: still held back (an evicted group would
    // hand the record out again at once, attempt 1).
    assert!(delayed.poll(1).await.is_empty(), "the delay still stands");
    let info = c.group_describe(T, NS, JOBS, 0, "delayed").await.unwrap();
    assert_eq!((info.delayed, info.in_flight), (1, 1), "{info:?}");
}

/// The three claim controls in one consumer's batch: extend a slow record
/// past the visibility, back off one for a retry, give up on a poison one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_extends_delays_and_dead_letters_its_claims() {
    let b = felix_tests::start_broker!(opts(500, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 3).await;
    let g = Group::new(&c, JOBS, "workers");
    let batch = g.poll(3).await;
    let (slow, retry, poison) = (&batch[0], &batch[1], &batch[2]);
    let start = Instant::now();
    g.extend(slow, Duration::from_secs(5)).await.unwrap();
    g.nack_after(retry, Duration::from_millis(700))
        .await
        .unwrap();
    g.dead_letter(poison, Some("unparseable")).await.unwrap();

    // Another worker waits: the delayed one comes back after its delay; the
    // extended one outlasts the visibility; the dead one never comes back.
    let other = g.via(&client(&b.addr).await);
    let got = other.poll_wait(10, Duration::from_secs(4)).await;
    assert_eq!((offsets(&got), attempts(&got)), (vec![1], vec![2]));
    assert!(start.elapsed() >= Duration::from_millis(650));
    other.ack(1).await.unwrap();
    assert!(
        start.elapsed() > Duration::from_millis(500),
        "past the visibility timeout"
    );
    g.ack(slow.offset).await.unwrap();
    let dead = g.dead_letters_detailed().await;
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].offset, dead[0].by_consumer), (2, true));
    assert_eq!(dead[0].reason.as_deref(), Some("unparseable"));
    assert_eq!(g.position().await, 3);
    assert!(other.poll(10).await.is_empty());
}

/// Pipelined acks (`begin_group_ack_many`, each sent before the next poll
/// and awaited only at the end) finish their batches: no offset is handed
/// out twice, and once they are awaited the position has passed them all.
/// A refused pipelined ack is an error when awaited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipelined_ack_finishes_its_batch_while_the_next_poll_runs() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 32).await;
    let mut pending = Vec::new();
    let mut seen = Vec::new();
    loop {
        let batch = c.group_poll(T, NS, JOBS, 0, "workers", 8).await.unwrap();
        if batch.is_empty() {
            break;
        }
        let offs = offsets(&batch);
        seen.extend(offs.iter().copied());
        pending.push(
            c.begin_group_ack_many(T, NS, JOBS, 0, "workers", &offs)
                .await
                .unwrap(),
        );
    }
    assert_eq!(
        seen,
        (0..32).collect::<Vec<u64>>(),
        "each offset once, in order"
    );
    for p in pending {
        p.await.unwrap();
    }
    let g = Group::new(&c, JOBS, "workers");
    assert_eq!(g.position().await, 32);
    let refused = c
        .begin_group_ack_many(T, NS, JOBS, 0, "workers", &[500])
        .await
        .unwrap()
        .await;
    assert_eq!(
        code(refused),
        Some(ErrorCode::InvalidRequest),
        "past the tail"
    );
    c.begin_group_ack_many(T, NS, JOBS, 0, "workers", &[])
        .await
        .unwrap()
        .await
        .expect("nothing to ack answers at once");
}

// ------------------------------------------- creating, moving and deleting

/// A seek backwards replays finished records (as first attempts) but keeps
/// dead letters set aside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seek_backwards_replays_what_the_group_finished() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 5).await;
    let g = Group::new(&c, JOBS, "workers");
    let batch = g.poll(5).await;
    g.dead_letter(&batch[2], None).await.unwrap();
    g.ack_many(&[0, 1, 3, 4]).await.unwrap();
    assert_eq!(g.position().await, 5);
    assert!(g.poll(10).await.is_empty());

    g.seek(StartPosition::Offset(1)).await.unwrap();
    assert_eq!(g.position().await, 1);
    let replay = g.poll(10).await;
    assert_eq!(
        (offsets(&replay), attempts(&replay)),
        (vec![1, 3, 4], vec![1, 1, 1])
    );
    assert_eq!(
        g.dead_letters().await,
        vec![2],
        "dead letters are kept across a seek"
    );
    g.ack_all(&replay).await;
    assert_eq!(g.position().await, 5);

    g.seek(StartPosition::Earliest).await.unwrap();
    assert_eq!(offsets(&g.drain().await), vec![0, 1, 3, 4]);
}

/// A seek voids the claims standing when it lands: an ack for a record the
/// group now owes is refused as stale_claim and the record is delivered
/// again; an ack below the new position is a harmless duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_for_a_claim_from_before_a_seek_is_refused() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 6).await;
    let g = Group::new(&c, JOBS, "workers");
    let before = g.poll(4).await;
    assert_eq!(offsets(&before), vec![0, 1, 2, 3]);
    g.seek(StartPosition::Offset(2)).await.unwrap();
    assert_eq!(g.describe().await.unwrap().in_flight, 0, "claims voided");
    assert_eq!(code(g.ack(3).await), Some(ErrorCode::StaleClaim));
    assert_eq!(code(g.ack_many(&[1, 2]).await), Some(ErrorCode::StaleClaim));
    assert_eq!(code(g.nack(&before[2]).await), Some(ErrorCode::StaleClaim));
    assert_eq!(
        code(g.extend(&before[3], Duration::from_secs(1)).await),
        Some(ErrorCode::StaleClaim)
    );
    g.ack(1)
        .await
        .expect("below the new position: a harmless duplicate");
    assert_eq!(g.position().await, 2);
    let again = g.poll(10).await;
    // 2 and 3 went out before the seek: this is their second delivery.
    assert_eq!(
        (offsets(&again), attempts(&again)),
        (vec![2, 3, 4, 5], vec![2, 2, 1, 1])
    );
    g.ack_all(&again).await;
    assert_eq!(g.position().await, 6);
}

/// The calls a consumer makes for a delivery voided by a seek stay refused
/// once the record has gone out again to someone else: the new delivery
/// counts one more attempt, so a late nack, extension or dead letter from
/// before the seek cannot take the record from its new holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_for_a_delivery_voided_by_a_seek_stay_refused_after_it_goes_out_again() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let (c1, c2) = (client(&b.addr).await, client(&b.addr).await);
    stream(&c1, JOBS).await;
    publish(&c1, JOBS, 3).await;
    let (a, other) = (
        Group::new(&c1, JOBS, "workers"),
        Group::new(&c2, JOBS, "workers"),
    );
    let old = a.poll(3).await;
    assert_eq!(attempts(&old), vec![1, 1, 1]);
    a.seek(StartPosition::Earliest).await.unwrap();
    let new = other.poll(3).await;
    assert_eq!(
        (offsets(&new), attempts(&new)),
        (vec![0, 1, 2], vec![2, 2, 2])
    );
    assert_eq!(code(a.nack(&old[0]).await), Some(ErrorCode::StaleClaim));
    assert_eq!(
        code(a.extend(&old[1], Duration::from_secs(5)).await),
        Some(ErrorCode::StaleClaim)
    );
    assert_eq!(
        code(a.dead_letter(&old[2], Some("late")).await),
        Some(ErrorCode::StaleClaim)
    );
    // Nothing was taken from the new holder.
    let info = a.describe().await.unwrap();
    assert_eq!((info.in_flight, info.owed, info.dead_letters), (3, 0, 0));
    assert!(a.poll(3).await.is_empty());
    other.ack_all(&new).await;
    assert_eq!(other.position().await, 3);
}

/// A redriven record (below the position, so the seek does not pass it)
/// whose redelivery a seek voided is owed again: an ack or nack from before
/// the seek is `stale_claim`, and its next delivery counts on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redriven_record_voided_by_a_seek_is_owed_again() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 4).await;
    let g = Group::new(&c, JOBS, "workers");
    let first = g.poll(4).await;
    g.dead_letter(&first[0], Some("bad")).await.unwrap();
    g.ack_many(&[1, 2, 3]).await.unwrap();
    assert_eq!(g.position().await, 4);
    g.redrive(0).await.unwrap();
    let again = g.poll(1).await;
    assert_eq!((offsets(&again), attempts(&again)), (vec![0], vec![1]));
    g.seek(StartPosition::Offset(2)).await.unwrap();
    assert_eq!(code(g.ack(0).await), Some(ErrorCode::StaleClaim));
    assert_eq!(code(g.nack(&again[0]).await), Some(ErrorCode::StaleClaim));
    let next = g.poll(10).await;
    assert_eq!(
        (offsets(&next), attempts(&next)),
        (vec![0, 2, 3], vec![2, 1, 1])
    );
    g.ack_all(&next).await;
    assert!(g.dead_letters().await.is_empty());
    assert_eq!(g.position().await, 4);
}

/// A seek voids a claim already at the attempt bound: the record has had
/// its deliveries, so it is set aside as a dead letter then, as a lapse at
/// the bound would, never delivered past the bound; a redrive brings it
/// back with its attempts reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_at_the_attempt_bound_voided_by_a_seek_is_set_aside() {
    let b = felix_tests::start_broker!(opts(30_000, 2));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 2).await;
    let g = Group::new(&c, JOBS, "workers");
    let first = g.poll(1).await;
    g.nack(&first[0]).await.unwrap();
    let second = g.poll(1).await;
    assert_eq!((offsets(&second), attempts(&second)), (vec![0], vec![2]));
    g.seek(StartPosition::Earliest).await.unwrap();
    assert_eq!(g.dead_letters().await, vec![0]);
    let again = g.poll(10).await;
    assert_eq!((offsets(&again), attempts(&again)), (vec![1], vec![1]));
    assert_eq!(code(g.nack(&second[0]).await), Some(ErrorCode::StaleClaim));
    g.ack(1).await.unwrap();
    assert_eq!(g.position().await, 2);
    g.redrive(0).await.unwrap();
    let back = g.poll(10).await;
    assert_eq!((offsets(&back), attempts(&back)), (vec![0], vec![1]));
}

/// An ack in flight when a seek lands either lands first (and the seek
/// then moves the cursor back) or is refused: the cursor ends where the
/// seek put it, durably.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_racing_a_seek_does_not_move_the_new_cursor() {
    let mut b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    let c2 = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 10).await;
    let rounds = 8;
    for i in 0..rounds {
        let g = Group::new(&c, JOBS, &format!("race{i}"));
        let admin = g.via(&c2);
        assert_eq!(g.poll(10).await.len(), 10);
        let all: Vec<u64> = (0..10).collect();
        let (ack, seek) = tokio::join!(g.ack_many(&all), admin.seek(StartPosition::Offset(2)));
        seek.unwrap();
        if let Err(e) = ack {
            assert_eq!(e.code(), Some(ErrorCode::StaleClaim), "{e}");
        }
        assert_eq!(g.position().await, 2, "round {i}");
        let again = g.poll(20).await;
        assert_eq!(offsets(&again), (2..10).collect::<Vec<_>>(), "round {i}");
    }
    b.kill9();
    b.restart();
    let c = client(&b.addr).await;
    for i in 0..rounds {
        let g = Group::new(&c, JOBS, &format!("race{i}"));
        assert_eq!(g.position().await, 2, "round {i} after a restart");
    }
}

/// Create (at Latest, a no-op when the group exists), seek, describe, list
/// and delete, with out-of-range offsets refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_is_created_moved_described_and_deleted() {
    let b = felix_tests::start_broker!(opts(30_000, 1));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 5).await;
    let g = Group::new(&c, JOBS, "workers");
    let missing = g.describe().await.unwrap_err();
    assert_eq!(missing.code(), Some(ErrorCode::NotFound));
    let said = missing.to_string();
    assert!(
        said.contains("group workers does not exist on")
            && said.contains(&format!("{T}/{NS}/{JOBS} shard 0")),
        "names the group, stream and shard: {said}"
    );

    g.create(StartPosition::Latest).await.unwrap();
    let info = g.describe().await.unwrap();
    assert_eq!(info.group, "workers");
    assert_eq!(
        (info.position, info.start_offset, info.end_offset),
        (5, 0, 5)
    );
    assert_eq!(
        (info.lag(), info.in_flight, info.owed, info.dead_letters),
        (0, 0, 0, 0)
    );
    g.create(StartPosition::Earliest)
        .await
        .expect("an existing group is left alone");
    assert_eq!(g.position().await, 5);
    assert!(g.poll(10).await.is_empty(), "only new work");
    publish(&c, JOBS, 2).await;
    let new = g.poll(10).await;
    assert_eq!(offsets(&new), vec![5, 6]);
    let info = g.describe().await.unwrap();
    assert_eq!((info.in_flight, info.lag()), (2, 2));

    g.seek(StartPosition::Offset(1)).await.unwrap();
    let info = g.describe().await.unwrap();
    assert_eq!((info.position, info.in_flight, info.lag()), (1, 0, 6));
    // One attempt each here: the deliveries the seek voided were the
    // records' last, so they are set aside, never delivered past the bound.
    assert_eq!(g.dead_letters().await, vec![5, 6]);
    assert_eq!(
        code(g.seek(StartPosition::Offset(99)).await),
        Some(ErrorCode::InvalidRequest)
    );
    assert_eq!(g.position().await, 1);

    let late = Group::new(&c, JOBS, "late");
    assert_eq!(
        code(late.create(StartPosition::Offset(99)).await),
        Some(ErrorCode::InvalidRequest)
    );
    assert_eq!(code(late.describe().await), Some(ErrorCode::NotFound));
    assert_eq!(
        code(late.seek(StartPosition::Earliest).await),
        Some(ErrorCode::NotFound)
    );
    let mid = Group::new(&c, JOBS, "mid");
    mid.create(StartPosition::Offset(3)).await.unwrap();
    assert_eq!(offsets(&mid.poll(1).await), vec![3]);
    let groups = c.list_groups(T, NS, JOBS, 0).await.unwrap();
    assert_eq!(groups, vec!["mid".to_string(), "workers".to_string()]);

    // A dead letter, then delete: position and dead letters go.
    let r = g.poll(1).await;
    assert_eq!(offsets(&r), vec![1]);
    g.nack(&r[0]).await.unwrap();
    assert_eq!(g.dead_letters().await, vec![1, 5, 6]);
    g.delete().await.unwrap();
    assert_eq!(code(g.describe().await), Some(ErrorCode::NotFound));
    assert_eq!(
        code(c.group_dead_letters(T, NS, JOBS, 0, "workers").await),
        Some(ErrorCode::NotFound)
    );
    assert_eq!(
        c.list_groups(T, NS, JOBS, 0).await.unwrap(),
        vec!["mid".to_string()]
    );
    // A poll brings it back into being, at offset 0, with nothing set aside.
    assert_eq!(offsets(&g.drain().await), (0..7).collect::<Vec<_>>());
    assert_eq!(offsets(&mid.drain().await), vec![4, 5, 6]);
}

// ------------------------------------------------------------------ limits

/// Acks and hand-backs are only for offsets the group handed out; anything
/// else, such as an offset at or past the tail, is invalid_request, and a
/// refused ack changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_for_offsets_never_handed_out_are_refused() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 5).await;
    let g = Group::new(&c, JOBS, "workers");
    assert_eq!(offsets(&g.poll(2).await), vec![0, 1]);
    let invalid = Some(ErrorCode::InvalidRequest);
    assert_eq!(code(g.ack(3).await), invalid, "written, never handed out");
    assert_eq!(code(g.ack(5).await), invalid, "at the tail");
    assert_eq!(code(g.ack(1000).await), invalid, "past the tail");
    assert_eq!(code(g.ack_many(&[0, 1, 5]).await), invalid);
    assert_eq!(g.position().await, 0, "a refused ack finishes nothing");
    assert_eq!(code(g.nack(&fake_record(3, 1)).await), invalid);
    assert_eq!(code(g.nack(&fake_record(7, 1)).await), invalid);
    assert_eq!(
        code(g.extend(&fake_record(3, 1), Duration::from_secs(1)).await),
        invalid
    );
    assert_eq!(code(g.dead_letter(&fake_record(9, 1), None).await), invalid);
    assert!(g.dead_letters().await.is_empty());
    // Offset 3 was not skipped by any of that.
    let rest = g.poll(10).await;
    assert_eq!(
        (offsets(&rest), attempts(&rest)),
        (vec![2, 3, 4], vec![1, 1, 1])
    );
    g.ack_many(&[0, 1, 2, 3, 4]).await.unwrap();
    assert_eq!(g.position().await, 5);
    g.ack(3)
        .await
        .expect("a finished offset again: a harmless duplicate");
}

/// Below a group's position the broker keeps no record of what it handed
/// out: an ack there is a harmless duplicate, a nack or extension is
/// stale_claim, a consumer dead letter invalid_request, and none of them
/// changes the group. So for a group created at the tail, which handed out
/// nothing below it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_below_the_position_change_nothing() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 4).await;
    let g = Group::new(&c, JOBS, "latest");
    g.create(StartPosition::Latest).await.unwrap();
    assert_eq!(g.position().await, 4);
    g.ack(2)
        .await
        .expect("below the position: a harmless duplicate");
    let below = fake_record(2, 1);
    assert_eq!(code(g.nack(&below).await), Some(ErrorCode::StaleClaim));
    assert_eq!(
        code(g.extend(&below, Duration::from_secs(1)).await),
        Some(ErrorCode::StaleClaim)
    );
    assert_eq!(
        code(g.dead_letter(&below, None).await),
        Some(ErrorCode::InvalidRequest)
    );
    assert!(g.dead_letters().await.is_empty());
    let info = g.describe().await.unwrap();
    assert_eq!((info.position, info.in_flight), (4, 0));
    // Only new records go out, the one nacked above among none of them.
    publish(&c, JOBS, 2).await;
    assert_eq!(offsets(&g.drain().await), vec![4, 5]);
}

/// A consumer cannot dead-letter a record already finished: refused, and
/// not listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_dead_letter_of_a_finished_record_is_refused() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 3).await;
    let g = Group::new(&c, JOBS, "workers");
    let batch = g.poll(3).await;
    g.ack(0).await.unwrap(); // finished, below the position
    g.ack(2).await.unwrap(); // finished, above the position (1 is held)
    assert_eq!(g.position().await, 1);
    for r in [&batch[0], &batch[2]] {
        assert_eq!(
            code(g.dead_letter(r, Some("too late")).await),
            Some(ErrorCode::InvalidRequest)
        );
    }
    assert!(g.dead_letters().await.is_empty());
    g.ack(1).await.unwrap();
    assert_eq!(g.position().await, 3);
    assert!(g.dead_letters().await.is_empty());
}

/// At FELIX_GROUP_MAX_IN_FLIGHT a poll answers empty and is counted in
/// felix_group_polls_capped_total; a delayed nack keeps its place under the
/// cap; a poll waiting at the cap is woken when an ack frees room, and a
/// hand-back frees room too. The cap is per group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_at_the_in_flight_cap_answers_empty_until_room_is_freed() {
    const CAPPED: &str = "felix_group_polls_capped_total";
    let b = felix_tests::start_broker!(opts(30_000, 5).env("FELIX_GROUP_MAX_IN_FLIGHT", 3));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 10).await;
    let g = Group::new(&c, JOBS, "workers");
    let held = g.poll(10).await;
    assert_eq!(offsets(&held), vec![0, 1, 2]);
    assert_eq!(b.metric(CAPPED), 0.0);
    assert!(g.poll(10).await.is_empty());
    assert_eq!(b.metric(CAPPED), 1.0);
    let info = g.describe().await.unwrap();
    assert_eq!((info.in_flight, info.lag()), (3, 10));
    // Another group of the same shard has its own cap.
    let other = Group::new(&c, JOBS, "others");
    assert_eq!(offsets(&other.poll(10).await), vec![0, 1, 2]);
    assert_eq!(b.metric(CAPPED), 1.0);

    // A delayed nack still holds its place.
    g.nack_after(&held[1], Duration::from_secs(30))
        .await
        .unwrap();
    assert!(g.poll(10).await.is_empty());
    assert_eq!(b.metric(CAPPED), 2.0);
    let info = g.describe().await.unwrap();
    assert_eq!((info.in_flight, info.delayed), (3, 1));

    let waiter = g.via(&client(&b.addr).await);
    let wait = tokio::spawn(async move { waiter.poll_wait(10, Duration::from_secs(20)).await });
    // The waiting poll has been capped: it is waiting at the cap.
    eventually(
        "the waiting poll to hit the cap",
        Duration::from_secs(10),
        || async { b.metric(CAPPED) >= 3.0 },
    )
    .await;
    assert!(!wait.is_finished());
    g.ack(0).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), wait)
        .await
        .expect("woken by the ack, not by its 20 s wait")
        .unwrap();
    assert_eq!(offsets(&got), vec![3], "room for one");
    assert!(g.poll(10).await.is_empty(), "at the cap again");

    // A plain nack frees room: the owed record goes out again.
    g.nack(&held[2]).await.unwrap();
    let again = g.poll(10).await;
    assert_eq!((offsets(&again), attempts(&again)), (vec![2], vec![2]));
    assert!(g.poll(10).await.is_empty());
}

/// One poll hands out at most 1,000 records, and stops after about 4 MiB of
/// payload, whatever max_records asks; the rest stay for the next poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_hands_out_at_most_a_thousand_records_or_about_4_mib() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 1500).await;
    let g = Group::new(&c, JOBS, "workers");
    let first = g.poll(100_000).await;
    assert_eq!(offsets(&first), (0..1000).collect::<Vec<_>>());
    let second = g.poll(100_000).await;
    assert_eq!(offsets(&second), (1000..1500).collect::<Vec<_>>());
    assert!(matches!(
        c.group_poll(T, NS, JOBS, 0, "workers", 0).await,
        Err(ClientError::InvalidArgument(_))
    ));

    stream(&c, "big").await;
    for _ in 0..6 {
        c.publish(T, NS, "big", 0, vec![7u8; 1_000_000])
            .await
            .unwrap();
    }
    let big = Group::new(&c, "big", "workers");
    let first = big.poll(100).await;
    assert!(
        (4..6).contains(&first.len()),
        "about 4 MiB: {} records of 1 MB",
        first.len()
    );
    let rest = big.drain().await;
    let mut all = offsets(&first);
    all.extend(offsets(&rest));
    assert_eq!(all, (0..6).collect::<Vec<_>>());
}

/// A named member that reconnects and reclaims gets the records it held
/// from older connections first, each as another attempt, over as many
/// polls as it takes, and nobody else gets them meanwhile; an older
/// connection never takes anything back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_member_reclaims_what_it_held_on_a_new_connection() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let admin = client(&b.addr).await;
    stream(&admin, JOBS).await;
    publish(&admin, JOBS, 6).await;
    let opt = |max_records| GroupPollOptions {
        max_records,
        ..GroupPollOptions::default()
    };
    let me = GroupMember::new("worker-1");
    let reclaiming = me.clone().reclaim(true);

    // Connection A holds 0..3, then "restarts".
    let a = Group::new(&client(&b.addr).await, JOBS, "workers");
    let held = a.poll_as(&me, opt(3)).await;
    assert_eq!(
        (offsets(&held), attempts(&held)),
        (vec![0, 1, 2], vec![1, 1, 1])
    );

    // Connection B, same name: its first reclaiming poll reserves 0..3.
    let bb = a.via(&client(&b.addr).await);
    let first = bb.poll_as(&reclaiming, opt(1)).await;
    assert_eq!((offsets(&first), attempts(&first)), (vec![0], vec![2]));
    // Nobody else gets the reserved ones, not even as owed records.
    let stranger = a.via(&client(&b.addr).await);
    let other = stranger.poll(10).await;
    assert_eq!(offsets(&other), vec![3, 4, 5]);
    let rest = bb.poll_as(&reclaiming, opt(10)).await;
    assert_eq!((offsets(&rest), attempts(&rest)), (vec![1, 2], vec![2, 2]));
    assert!(bb.poll_as(&reclaiming, opt(10)).await.is_empty());

    // A is older than the last reclaim: it takes nothing back, only new work.
    publish(&admin, JOBS, 1).await;
    let a_again = a.poll_as(&reclaiming, opt(10)).await;
    assert_eq!((offsets(&a_again), attempts(&a_again)), (vec![6], vec![1]));

    // A newer connection C takes back what B and A hold under the name.
    let cc = a.via(&client(&b.addr).await);
    let back = cc.poll_as(&reclaiming, opt(10)).await;
    assert_eq!(
        (offsets(&back), attempts(&back)),
        (vec![0, 1, 2, 6], vec![3, 3, 3, 2])
    );
    // Only that first poll reclaims; the stranger's records stay its own.
    assert!(cc.poll_as(&reclaiming, opt(10)).await.is_empty());
    stranger.ack_many(&[3, 4, 5]).await.unwrap();
    cc.ack_all(&back).await;
    assert_eq!(cc.position().await, 7);
}

/// A reserved record whose original claim lapses before the reclaiming
/// connection takes it goes to the whole group, like any lapsed claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserved_record_whose_claim_lapses_goes_to_the_whole_group() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let admin = client(&b.addr).await;
    stream(&admin, JOBS).await;
    publish(&admin, JOBS, 2).await;
    let me = GroupMember::new("worker-1");
    let a = Group::new(&client(&b.addr).await, JOBS, "workers");
    let short = GroupPollOptions {
        max_records: 2,
        visibility: Some(Duration::from_millis(1000)),
        ..GroupPollOptions::default()
    };
    assert_eq!(offsets(&a.poll_as(&me, short).await), vec![0, 1]);
    let bb = a.via(&client(&b.addr).await);
    let one = GroupPollOptions {
        max_records: 1,
        ..GroupPollOptions::default()
    };
    let first = bb.poll_as(&me.clone().reclaim(true), one).await;
    assert_eq!((offsets(&first), attempts(&first)), (vec![0], vec![2]));
    // Offset 1 is reserved for B, under A's claim, until that lapses.
    let stranger = a.via(&client(&b.addr).await);
    assert!(stranger.poll(10).await.is_empty());
    eventually(
        "A's claim on 1 to lapse",
        Duration::from_secs(5),
        || async { stranger.describe().await.unwrap().owed == 1 },
    )
    .await;
    let got = stranger.poll(10).await;
    assert_eq!((offsets(&got), attempts(&got)), (vec![1], vec![2]));
    assert!(bb.poll_as(&me.clone().reclaim(true), one).await.is_empty());
    // Names are 1 to 128 bytes; the client refuses others before sending.
    for bad in [String::new(), "x".repeat(129)] {
        let r =
            bb.c.group_poll_as(T, NS, JOBS, 0, "workers", &GroupMember::new(bad), one)
                .await;
        assert!(matches!(r, Err(ClientError::InvalidArgument(_))), "{r:?}");
    }
    let longest = GroupMember::new("x".repeat(128));
    assert!(bb.poll_as(&longest, one).await.is_empty());
    // And the broker refuses them itself, from a client that does not check
    // (on a connection to the core that owns the shard).
    let core = bb.c.describe_stream(T, NS, JOBS).await.unwrap().placement[0];
    let mut raw = tokio::net::TcpStream::connect(b.addr.as_str())
        .await
        .unwrap();
    let hello = felix_wire::Request::Hello {
        version: felix_wire::PROTOCOL_VERSION,
        features: felix_wire::FEATURES_ALL,
        want_core: Some(core),
        client_name: "raw".into(),
        token: None,
    };
    assert!(matches!(
        felix_tests::raw_call(&mut raw, 1, &hello).await,
        felix_wire::Response::HelloOk { .. }
    ));
    let key = felix_wire::GroupKey {
        stream: felix_wire::StreamRef {
            tenant: T.into(),
            namespace: NS.into(),
            stream: JOBS.into(),
        },
        shard: 0,
        group: "workers".into(),
    };
    let poll_as = |name: String| felix_wire::Request::GroupPoll {
        key: key.clone(),
        max_records: 1,
        wait_ms: 0,
        member: Some(felix_wire::GroupMemberRef {
            name,
            reclaim: true,
        }),
        visibility_ms: None,
    };
    for (id, bad) in [(2, String::new()), (3, "x".repeat(129))] {
        match felix_tests::raw_call(&mut raw, id, &poll_as(bad)).await {
            felix_wire::Response::Error(e) => {
                assert_eq!(e.code, ErrorCode::InvalidRequest, "{e:?}")
            }
            other => panic!("a bad member name was served: {other:?}"),
        }
    }
    assert!(matches!(
        felix_tests::raw_call(&mut raw, 4, &poll_as("y".repeat(128))).await,
        felix_wire::Response::GroupRecords { .. }
    ));
    // A claim for no time at all is refused too: it would lapse as it was
    // made and spend an attempt a poll.
    let mut zero = poll_as("z".into());
    if let felix_wire::Request::GroupPoll { visibility_ms, .. } = &mut zero {
        *visibility_ms = Some(0);
    }
    match felix_tests::raw_call(&mut raw, 5, &zero).await {
        felix_wire::Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::InvalidRequest, "{e:?}");
            assert!(e.message.contains("visibility"), "{e:?}");
        }
        other => panic!("a poll with visibility 0 was served: {other:?}"),
    }
    let extend = felix_wire::Request::GroupExtend {
        key: key.clone(),
        offset: 1,
        attempts: 2,
        extend_ms: 0,
    };
    match felix_tests::raw_call(&mut raw, 6, &extend).await {
        felix_wire::Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::InvalidRequest, "{e:?}")
        }
        other => panic!("an extension of 0 was served: {other:?}"),
    }
}

/// On a broker that acks publishes when queued (FELIX_ACK_ON_COMMIT=0), a
/// producer asking for commit acks gets records a poll sees at once; without
/// them a later poll gets the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_acked_publish_is_seen_by_the_next_poll() {
    let b = felix_tests::start_broker!(opts(30_000, 5).env("FELIX_ACK_ON_COMMIT", 0));
    let producer = Client::connect(
        b.addr.as_str(),
        felix_client::ClientConfig {
            ack_on_commit: true,
            ..felix_client::ClientConfig::default()
        },
    )
    .await
    .unwrap();
    stream(&producer, JOBS).await;
    let g = Group::new(&client(&b.addr).await, JOBS, "workers");
    for i in 0..20u64 {
        let at = producer
            .publish(T, NS, JOBS, 0, format!("c{i}"))
            .await
            .unwrap();
        let got = g.poll(10).await;
        assert_eq!(
            offsets(&got),
            vec![at],
            "seen by the poll right after the ack"
        );
        g.ack(at).await.unwrap();
    }
    let queued = client(&b.addr).await;
    let at = queued.publish(T, NS, JOBS, 0, "queued").await.unwrap();
    // Not necessarily the very next poll, but a later one.
    let deadline = Instant::now() + Duration::from_secs(5);
    let got = loop {
        let got = g.poll(10).await;
        if !got.is_empty() || Instant::now() > deadline {
            break offsets(&got);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(got, vec![at]);
}

/// The group features are advertised by a durable broker; an in-memory one
/// advertises none, and the client refuses group calls rather than send
/// them. A client that negotiated FEATURE_GROUP_SKIPPED gets the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_features_follow_durable_storage() {
    use felix_wire::{
        FEATURE_GROUPS, FEATURE_GROUP_ADMIN, FEATURE_GROUP_CLAIM_CONTROL,
        FEATURE_GROUP_DEAD_LETTER_PAGES, FEATURE_GROUP_SKIPPED,
    };
    let all = FEATURE_GROUPS
        | FEATURE_GROUP_SKIPPED
        | FEATURE_GROUP_CLAIM_CONTROL
        | FEATURE_GROUP_ADMIN
        | FEATURE_GROUP_DEAD_LETTER_PAGES;

    let durable = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&durable.addr).await;
    assert!(c.has_feature(all), "features {:#x}", c.features());
    stream(&c, JOBS).await;
    publish(&c, JOBS, 1).await;
    let r = Group::new(&c, JOBS, "workers").poll(1).await;
    assert_eq!(
        r[0].skipped_before,
        Some(0),
        "negotiated: present, nothing skipped"
    );

    let mem = felix_tests::start_broker!(felix_tests::BrokerOptions::default().in_memory());
    let c: Client = client(&mem.addr).await;
    assert_eq!(c.features() & all, 0, "features {:#x}", c.features());
    stream(&c, JOBS).await;
    publish(&c, JOBS, 1).await;
    let unsupported = |r: Result<(), ClientError>| matches!(r, Err(ClientError::Unsupported(_)));
    let g = Group::new(&c, JOBS, "workers");
    let rec = fake_record(0, 1);
    assert!(unsupported(
        c.group_poll(T, NS, JOBS, 0, "workers", 1).await.map(|_| ())
    ));
    assert!(unsupported(
        c.group_poll_wait(T, NS, JOBS, 0, "workers", 1, Duration::from_secs(1))
            .await
            .map(|_| ())
    ));
    assert!(unsupported(
        g.c.group_poll_as(
            T,
            NS,
            JOBS,
            0,
            "workers",
            &GroupMember::new("m"),
            GroupPollOptions::default()
        )
        .await
        .map(|_| ())
    ));
    assert!(unsupported(g.ack(0).await));
    assert!(unsupported(g.nack(&rec).await));
    assert!(unsupported(
        g.nack_after(&rec, Duration::from_secs(1)).await
    ));
    assert!(unsupported(
        g.extend(&rec, Duration::from_secs(1)).await.map(|_| ())
    ));
    assert!(unsupported(g.dead_letter(&rec, None).await));
    assert!(unsupported(
        c.group_dead_letters(T, NS, JOBS, 0, "workers")
            .await
            .map(|_| ())
    ));
    assert!(unsupported(
        c.group_dead_letters_page(T, NS, JOBS, 0, "workers", 0, 10)
            .await
            .map(|_| ())
    ));
    assert!(unsupported(g.redrive(0).await));
    assert!(unsupported(g.discard(0).await));
    assert!(unsupported(g.create(StartPosition::Latest).await));
    assert!(unsupported(g.seek(StartPosition::Latest).await));
    assert!(unsupported(g.describe().await.map(|_| ())));
    assert!(unsupported(g.delete().await));
    assert!(unsupported(c.list_groups(T, NS, JOBS, 0).await.map(|_| ())));
}

/// A broker that rolls 64 KiB segments and checks retention every 100 ms,
/// its config file, and a client that created JOBS on it: one shard kept
/// within 128 KiB.
async fn retention_broker() -> (ConfigFile, felix_tests::Broker, Client) {
    let cfg = config_file("[storage]\nsegment_bytes = 65536\nretention_check_ms = 100\n");
    let b =
        felix_tests::start_broker!(opts(30_000, 5).env("FELIX_TEST_CONFIG", cfg.path.display()));
    let c = client(&b.addr).await;
    let retention = felix_client::StreamOptions {
        retention_bytes: Some(128 << 10),
        ..Default::default()
    };
    c.create_stream(T, NS, JOBS, 1, retention).await.unwrap();
    (cfg, b, c)
}

/// Publish 48 records of 16 KiB (twelve segments' worth) to JOBS and wait
/// until retention is done: the shard back within its 128 KiB (the start
/// moves a segment at a time until then) and its start past `past`.
/// Returns the new start.
async fn publish_past_retention(c: &Client, past: u64) -> u64 {
    for _ in 0..48 {
        c.publish(T, NS, JOBS, 0, vec![1u8; 16 << 10])
            .await
            .unwrap();
    }
    eventually(
        "retention to remove old segments",
        Duration::from_secs(10),
        || async {
            let info = c.describe_shard(T, NS, JOBS, 0).await.unwrap();
            info.start_offset > past && info.bytes <= 128 << 10
        },
    )
    .await;
    c.describe_shard(T, NS, JOBS, 0).await.unwrap().start_offset
}

/// Offsets retention removed before the group got to them are settled and
/// counted in the next record's skipped_before; the group's state survives
/// retention (it is snapshotted into each new segment) and a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_retention_removed_are_skipped_and_counted() {
    let (_cfg, mut b, c) = retention_broker().await;
    publish(&c, JOBS, 2).await;
    let g = Group::new(&c, JOBS, "workers");
    let batch = g.poll(2).await;
    g.dead_letter(&batch[0], Some("kept")).await.unwrap();
    g.ack(1).await.unwrap();
    assert_eq!(g.position().await, 2);
    let start = publish_past_retention(&c, 2).await;
    // Earliest is the oldest record the shard still holds.
    let late = Group::new(&c, JOBS, "late");
    assert_eq!(
        code(late.create(StartPosition::Offset(0)).await),
        Some(ErrorCode::InvalidRequest),
        "below the log start"
    );
    late.create(StartPosition::Earliest).await.unwrap();
    assert_eq!(late.position().await, start);
    // Lag counts what the group can still be handed: not what retention
    // removed above its position (settled, never delivered).
    let info = g.describe().await.unwrap();
    assert_eq!((info.position, info.end_offset), (2, 50));
    assert_eq!(info.lag(), 50 - start);
    assert_eq!(
        b.metric_series("felix_group_lag", &[("group", "workers")]),
        Some((50 - start) as f64),
        "the broker's own figure"
    );
    let got = g.drain().await;
    assert_eq!(got[0].offset, start);
    assert_eq!(
        got[0].skipped_before,
        Some(start - 2),
        "2..{start} were removed unread"
    );
    assert!(got[1..].iter().all(|r| r.skipped_before == Some(0)));
    assert_eq!(offsets(&got), (start..50).collect::<Vec<_>>());
    g.ack_all(&got).await;
    assert_eq!(g.position().await, 50);

    b.kill9();
    b.restart();
    let g = Group::new(&client(&b.addr).await, JOBS, "workers");
    assert_eq!(
        g.position().await,
        50,
        "the group outlived the segments it was written in"
    );
    assert_eq!(g.dead_letters().await, vec![0]);
    assert!(g.poll(10).await.is_empty());
    // Retention removed the dead letter's record too: a redrive has nothing
    // to hand out and is refused, the letter kept until it is discarded.
    assert_eq!(code(g.redrive(0).await), Some(ErrorCode::NotFound));
    assert_eq!(g.dead_letters().await, vec![0]);
    g.discard(0).await.unwrap();
    assert!(g.dead_letters().await.is_empty());
}

/// A record handed out with `skipped_before` keeps the count across a
/// restart: the poll moved the group's position up to it, and a broker
/// killed before the record is finished hands it out again from that
/// position, still saying what lies settled below it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_handed_out_with_skips_keeps_them_across_a_restart() {
    let (_cfg, mut b, c) = retention_broker().await;
    let g = Group::new(&c, JOBS, "workers");
    g.create(StartPosition::Earliest).await.unwrap();
    let start = publish_past_retention(&c, 0).await;
    let got = g.poll(1).await;
    assert_eq!(got[0].offset, start);
    assert_eq!(
        got[0].skipped_before,
        Some(start),
        "0..{start} were removed unread"
    );
    assert_eq!(g.position().await, start);
    // A durable publish flushes the log, the group's position entry with it.
    c.publish(T, NS, JOBS, 0, "flush").await.unwrap();

    b.kill9();
    b.restart();
    let g = Group::new(&client(&b.addr).await, JOBS, "workers");
    assert_eq!(g.position().await, start);
    let again = g.poll(1).await;
    assert_eq!(again[0].offset, start, "handed out again from the position");
    assert_eq!(
        again[0].skipped_before,
        Some(start),
        "and still told that 0..{start} lie settled below it"
    );
}

/// A member reclaims claims retention removed meanwhile, right below the
/// records the group has not handed out yet: the removed ones are settled,
/// and every retained record after them is delivered (none is settled as
/// if it had been removed too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reclaimed_claims_retention_removed_do_not_take_the_next_records_with_them() {
    let (_cfg, b, c) = retention_broker().await;
    // Three 16 KiB records fill the first 64 KiB segment.
    let big = |n: usize| {
        (0..n)
            .map(|_| felix_wire::RecordIn {
                payload: vec![7u8; 16 << 10].into(),
                ..Default::default()
            })
            .collect::<Vec<_>>()
    };
    for _ in 0..3 {
        c.publish_batch(T, NS, JOBS, 0, big(1)).await.unwrap();
    }
    let me = GroupMember::new("m").reclaim(true);
    let g = Group::new(&c, JOBS, "workers");
    let opt = |n| GroupPollOptions {
        max_records: n,
        ..GroupPollOptions::default()
    };
    assert_eq!(offsets(&g.poll_as(&me, opt(3)).await), vec![0, 1, 2]);
    // More records: the first segment (0..=2) goes to retention.
    for _ in 0..6 {
        c.publish_batch(T, NS, JOBS, 0, big(1)).await.unwrap();
    }
    eventually(
        "retention to remove the first segment",
        Duration::from_secs(10),
        || async { c.describe_shard(T, NS, JOBS, 0).await.unwrap().start_offset == 3 },
    )
    .await;
    // The member comes back on a new connection and reclaims 0..=2.
    let c2 = client(&b.addr).await;
    let g2 = g.via(&c2);
    let got = g2.poll_as(&me, opt(10)).await;
    assert_eq!(offsets(&got), (3..9).collect::<Vec<_>>());
    g2.ack_all(&got).await;
    assert_eq!(g2.position().await, 9);
}

/// A client that did not offer FEATURE_GROUP_SKIPPED in its HELLO (one that
/// predates it) gets delivered records without the field, on the same broker
/// that gives it to clients that did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_did_not_negotiate_skipped_before_gets_records_without_it() {
    use felix_wire::{GroupKey, Request, Response, StreamRef, FEATURES_ALL, FEATURE_GROUP_SKIPPED};
    let b = felix_tests::start_broker!(opts(30_000, 5).cores(1));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 2).await;

    let poll = |group: &str| Request::GroupPoll {
        key: GroupKey {
            stream: StreamRef {
                tenant: T.into(),
                namespace: NS.into(),
                stream: JOBS.into(),
            },
            shard: 0,
            group: group.into(),
        },
        max_records: 10,
        wait_ms: 0,
        member: None,
        visibility_ms: None,
    };
    for (offered, want) in [
        (FEATURES_ALL & !FEATURE_GROUP_SKIPPED, None),
        (FEATURES_ALL, Some(0)),
    ] {
        let mut s = tokio::net::TcpStream::connect(&b.addr).await.unwrap();
        let hello = Request::Hello {
            version: felix_wire::PROTOCOL_VERSION,
            features: offered,
            want_core: None,
            client_name: "old-client".into(),
            token: None,
        };
        match felix_tests::raw_call(&mut s, 1, &hello).await {
            Response::HelloOk { features, .. } => {
                assert_eq!(features & FEATURE_GROUP_SKIPPED != 0, want.is_some())
            }
            other => panic!("unexpected {other:?}"),
        }
        let group = format!("g-{offered:x}");
        match felix_tests::raw_call(&mut s, 2, &poll(&group)).await {
            Response::GroupRecords { records } => {
                assert_eq!(records.len(), 2);
                for r in records {
                    assert_eq!(r.skipped_before, want, "offered {offered:#x}");
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// The whole-stream group calls make one call per shard; an offset is
/// refused for a stream with more than one shard. A nack may carry a reason,
/// which the dead letter lists when that nack used up the last attempt; the
/// broker's own give-ups say why too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_wide_group_calls_and_dead_letter_reasons() {
    let b = felix_tests::start_broker!(opts(300, 2));
    let c = client(&b.addr).await;
    c.create_stream(T, NS, "wide", 3, felix_client::StreamOptions::default())
        .await
        .unwrap();
    for shard in 0..3 {
        c.publish(T, NS, "wide", shard, "old").await.unwrap();
    }
    c.group_create_stream(T, NS, "wide", "g", StartPosition::Latest)
        .await
        .unwrap();
    let infos = c.group_describe_stream(T, NS, "wide", "g").await.unwrap();
    assert_eq!(infos.len(), 3);
    assert!(infos.iter().all(|i| i.position == 1), "{infos:?}");
    assert!(matches!(
        c.group_seek_stream(T, NS, "wide", "g", StartPosition::Offset(0))
            .await,
        Err(ClientError::InvalidArgument(_))
    ));
    c.group_seek_stream(T, NS, "wide", "g", StartPosition::Earliest)
        .await
        .unwrap();
    let infos = c.group_describe_stream(T, NS, "wide", "g").await.unwrap();
    assert!(infos.iter().all(|i| i.position == 0), "{infos:?}");
    c.group_delete_stream(T, NS, "wide", "g").await.unwrap();
    for shard in 0..3 {
        assert!(c.group_describe(T, NS, "wide", shard, "g").await.is_err());
    }

    // Reasons: a nack at the bound (2 attempts) keeps the consumer's reason;
    // a lapse at the bound gets the broker's.
    stream(&c, JOBS).await;
    publish(&c, JOBS, 2).await;
    let g = Group::new(&c, JOBS, "workers");
    // Claimed long enough that the nacks come first, however slow the host.
    let long = GroupPollOptions {
        max_records: 1,
        visibility: Some(Duration::from_secs(30)),
        ..GroupPollOptions::default()
    };
    for _ in 0..2 {
        let got = g.poll_as(&GroupMember::new("nacker"), long).await;
        assert_eq!(offsets(&got), vec![0]);
        c.group_nack_with_reason(
            T,
            NS,
            JOBS,
            0,
            "workers",
            &got[0],
            Duration::ZERO,
            "payload does not parse",
        )
        .await
        .unwrap();
    }
    for _ in 0..2 {
        let got = g.poll(1).await;
        assert_eq!(offsets(&got), vec![1]);
        eventually("the claim to lapse", Duration::from_secs(10), || async {
            g.describe().await.unwrap().in_flight == 0
        })
        .await;
    }
    // The lapse is noticed on the next request.
    let _ = g.poll(1).await;
    let dl = c
        .group_dead_letters_detailed(T, NS, JOBS, 0, "workers")
        .await
        .unwrap();
    let reason = |o: u64| {
        dl.iter()
            .find(|d| d.offset == o)
            .and_then(|d| d.reason.clone())
    };
    assert_eq!(reason(0).as_deref(), Some("payload does not parse"));
    assert_eq!(reason(1).as_deref(), Some("claim lapsed after attempt 2"));
}

/// A waiting poll waits at most FELIX_GROUP_MAX_WAIT_MS, whatever it asks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_poll_is_capped_at_the_broker_wait_limit() {
    let b = felix_tests::start_broker!(opts(30_000, 5).env("FELIX_GROUP_MAX_WAIT_MS", 300));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    let asked = Duration::from_secs(60);
    let t = Instant::now();
    let got = c
        .group_poll_wait(T, NS, JOBS, 0, "workers", 10, asked)
        .await
        .unwrap();
    assert!(got.is_empty());
    // It waited (the cap is a wait, not a refusal) and was answered empty
    // long before the minute it asked for, and before the default cap of
    // 30 s: the configured 300 ms is the one applied (a generous upper
    // bound for a loaded machine).
    let took = t.elapsed();
    assert!(took >= Duration::from_millis(250), "{took:?}");
    assert!(took < Duration::from_secs(10), "{took:?}");
}

// ------------------------------------------------- edges the review found

/// A claim that lapses at the attempt bound is a dead letter to every call
/// at once: the list, redrive and discard do not wait for the broker's
/// timer to notice the lapse (describe already counted it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_lapses_at_the_attempt_bound_is_listed_at_once() {
    let b = felix_tests::start_broker!(opts(30_000, 1));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 2).await;
    let g = Group::new(&c, JOBS, "workers");
    // Short claims, far below the broker's 30 s timeout and its timer's
    // one-second look.
    let short = GroupPollOptions {
        max_records: 2,
        visibility: Some(Duration::from_millis(200)),
        ..GroupPollOptions::default()
    };
    let r = g.poll_as(&GroupMember::new("w"), short).await;
    assert_eq!(offsets(&r), vec![0, 1]);
    eventually(
        "describe to count both lapses",
        Duration::from_secs(10),
        || async { g.describe().await.unwrap().dead_letters == 2 },
    )
    .await;
    assert_eq!(
        g.dead_letters().await,
        vec![0, 1],
        "listed as soon as counted"
    );
    g.discard(1).await.unwrap();
    g.redrive(0).await.unwrap();
    let again = g.poll(10).await;
    assert_eq!((offsets(&again), attempts(&again)), (vec![0], vec![1]));
    g.ack(0).await.unwrap();
    assert_eq!(g.position().await, 2, "the discarded 1 stays finished");
}

/// A consumer can only acknowledge or hand back what the group handed out:
/// for a group that does not exist yet that is nothing, so acks, nacks,
/// extensions and dead letters are invalid_request (not not_found), and the
/// refused calls do not create the group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_about_a_delivery_of_a_group_that_never_polled_are_invalid() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 2).await;
    let g = Group::new(&c, JOBS, "nobody");
    let r = fake_record(0, 1);
    assert_eq!(code(g.ack(0).await), Some(ErrorCode::InvalidRequest));
    assert_eq!(code(g.ack(2).await), Some(ErrorCode::InvalidRequest));
    assert_eq!(code(g.nack(&r).await), Some(ErrorCode::InvalidRequest));
    assert_eq!(
        code(g.extend(&r, Duration::from_secs(1)).await),
        Some(ErrorCode::InvalidRequest)
    );
    assert_eq!(
        code(c.group_dead_letter(T, NS, JOBS, 0, "nobody", &r).await),
        Some(ErrorCode::InvalidRequest)
    );
    assert_eq!(code(g.describe().await), Some(ErrorCode::NotFound));
    assert!(c.list_groups(T, NS, JOBS, 0).await.unwrap().is_empty());
    // Its first poll brings it into being at offset 0.
    assert_eq!(offsets(&g.poll(10).await), vec![0, 1]);
}

// ------------------------------------- the broker's side, over the wire

/// A raw wire connection (for requests the client library would refuse to
/// send), with the features its HELLO was granted.
struct Raw {
    s: tokio::net::TcpStream,
    next_id: u64,
    features: u64,
}

impl Raw {
    /// Connect and say HELLO offering `features`.
    async fn hello(addr: &str, features: u64) -> Raw {
        let s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut raw = Raw {
            s,
            next_id: 1,
            features: 0,
        };
        let hello = felix_wire::Request::Hello {
            version: felix_wire::PROTOCOL_VERSION,
            features,
            want_core: None,
            client_name: "raw".into(),
            token: None,
        };
        match raw.call(hello).await {
            felix_wire::Response::HelloOk { features, .. } => raw.features = features,
            other => panic!("unexpected {other:?}"),
        }
        raw
    }

    async fn call(&mut self, req: felix_wire::Request) -> felix_wire::Response {
        let id = self.next_id;
        self.next_id += 1;
        felix_tests::raw_call(&mut self.s, id, &req).await
    }

    /// The error code of the answer to `req` (`None` if it succeeded).
    async fn code(&mut self, req: felix_wire::Request) -> Option<ErrorCode> {
        match self.call(req).await {
            felix_wire::Response::Error(e) => Some(e.code),
            _ => None,
        }
    }
}

/// The wire key of `group` on shard 0 of the jobs stream.
fn wire_key(group: &str) -> felix_wire::GroupKey {
    felix_wire::GroupKey {
        stream: felix_wire::StreamRef {
            tenant: T.into(),
            namespace: NS.into(),
            stream: JOBS.into(),
        },
        shard: 0,
        group: group.into(),
    }
}

/// The broker itself refuses what a connection did not negotiate, whatever
/// a client sends: without FEATURE_GROUP_CLAIM_CONTROL a poll's visibility,
/// a nack's delay, an extend and a consumer dead letter are `unsupported`;
/// without FEATURE_GROUP_ADMIN so are group_create, group_seek,
/// group_describe and group_delete. A refused request changes nothing, and
/// the rest of the group calls work on the same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_refuses_claim_control_and_admin_a_connection_did_not_negotiate() {
    use felix_wire::{
        Request, Response, FEATURES_ALL, FEATURE_GROUPS, FEATURE_GROUP_ADMIN,
        FEATURE_GROUP_CLAIM_CONTROL,
    };
    // One core: a raw connection is served by the shard's owner.
    let b = felix_tests::start_broker!(opts(30_000, 5).cores(1));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 3).await;
    // The same group through a client that negotiated everything.
    let g = Group::new(&c, JOBS, "workers");
    let unsupported = Some(ErrorCode::Unsupported);
    let poll = |visibility_ms: Option<u64>| Request::GroupPoll {
        key: wire_key("workers"),
        max_records: 10,
        wait_ms: 0,
        member: None,
        visibility_ms,
    };
    let nack = |offset: u64, delay_ms: Option<u64>| Request::GroupNack {
        key: wire_key("workers"),
        offset,
        attempts: 1,
        delay_ms,
        reason: None,
    };

    // ---- without claim control
    let mut raw = Raw::hello(&b.addr, FEATURES_ALL & !FEATURE_GROUP_CLAIM_CONTROL).await;
    assert_eq!(
        raw.features & (FEATURE_GROUPS | FEATURE_GROUP_CLAIM_CONTROL),
        FEATURE_GROUPS,
        "granted {:#x}",
        raw.features
    );
    assert_eq!(raw.code(poll(Some(60_000))).await, unsupported);
    assert_eq!(
        code(g.describe().await),
        Some(ErrorCode::NotFound),
        "the refused poll claimed nothing, did not even create the group"
    );
    // A poll without a visibility is served (the broker's timeout).
    match raw.call(poll(None)).await {
        Response::GroupRecords { records } => {
            assert_eq!(offsets(&records), vec![0, 1, 2]);
            assert_eq!(attempts(&records), vec![1, 1, 1]);
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(raw.code(nack(0, Some(10_000))).await, unsupported);
    let extend = Request::GroupExtend {
        key: wire_key("workers"),
        offset: 1,
        attempts: 1,
        extend_ms: 10_000,
    };
    assert_eq!(raw.code(extend).await, unsupported);
    let dead_letter = Request::GroupDeadLetter {
        key: wire_key("workers"),
        offset: 2,
        attempts: 1,
        reason: Some("poison".into()),
    };
    assert_eq!(raw.code(dead_letter).await, unsupported);
    // None of them took effect: all three are still simply held.
    let info = g.describe().await.unwrap();
    assert_eq!(
        (
            info.in_flight,
            info.delayed,
            info.owed,
            info.dead_letters,
            info.position
        ),
        (3, 0, 0, 0, 0)
    );
    assert!(g.dead_letters().await.is_empty());
    // A plain nack and acks are served on the same connection.
    assert_eq!(raw.code(nack(0, None)).await, None);
    assert_eq!(g.describe().await.unwrap().owed, 1);
    let ack = Request::GroupAck {
        key: wire_key("workers"),
        offsets: vec![1, 2],
    };
    assert_eq!(raw.code(ack).await, None);
    match raw.call(poll(None)).await {
        Response::GroupRecords { records } => {
            assert_eq!((offsets(&records), attempts(&records)), (vec![0], vec![2]));
        }
        other => panic!("unexpected {other:?}"),
    }
    let ack = Request::GroupAck {
        key: wire_key("workers"),
        offsets: vec![0],
    };
    assert_eq!(raw.code(ack).await, None);
    assert_eq!(g.position().await, 3);

    // ---- without group administration
    let mut raw = Raw::hello(&b.addr, FEATURES_ALL & !FEATURE_GROUP_ADMIN).await;
    assert_eq!(
        raw.features & (FEATURE_GROUPS | FEATURE_GROUP_ADMIN),
        FEATURE_GROUPS,
        "granted {:#x}",
        raw.features
    );
    let create = Request::GroupCreate {
        key: wire_key("fresh"),
        start: StartPosition::Latest,
    };
    assert_eq!(raw.code(create).await, unsupported);
    assert_eq!(
        code(Group::new(&c, JOBS, "fresh").describe().await),
        Some(ErrorCode::NotFound),
        "the refused create made nothing"
    );
    let seek = Request::GroupSeek {
        key: wire_key("workers"),
        start: StartPosition::Offset(0),
    };
    assert_eq!(raw.code(seek).await, unsupported);
    assert_eq!(g.position().await, 3, "the refused seek moved nothing");
    let describe = Request::GroupDescribe {
        key: wire_key("workers"),
    };
    assert_eq!(raw.code(describe).await, unsupported);
    let delete = Request::GroupDelete {
        key: wire_key("workers"),
    };
    assert_eq!(raw.code(delete).await, unsupported);
    assert_eq!(g.position().await, 3, "the refused delete removed nothing");
    // Listing the groups is not administration: FEATURE_GROUPS is enough.
    let list = Request::ListGroups {
        stream: wire_key("workers").stream,
        shard: 0,
    };
    match raw.call(list).await {
        Response::Groups(names) => assert_eq!(names, vec!["workers".to_string()]),
        other => panic!("unexpected {other:?}"),
    }
    // Claim control was negotiated on this connection: a poll's visibility
    // is served (nothing left to hand out).
    match raw.call(poll(Some(60_000))).await {
        Response::GroupRecords { records } => assert!(records.is_empty()),
        other => panic!("unexpected {other:?}"),
    }
}

const CAPPED: &str = "felix_group_polls_capped_total";

/// A broker whose groups may have one record in flight; a group holding
/// offset 0 of two records (claimed for the 30 s visibility); and a poll of
/// the group on another connection, waiting up to 20 s at the cap.
async fn a_poll_waiting_at_the_cap() -> (
    felix_tests::Broker,
    Group,
    felix_wire::GroupRecord,
    tokio::task::JoinHandle<Vec<felix_wire::GroupRecord>>,
) {
    let b = felix_tests::start_broker!(opts(30_000, 5).env("FELIX_GROUP_MAX_IN_FLIGHT", 1));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 2).await;
    let g = Group::new(&c, JOBS, "workers");
    let held = g.poll(10).await;
    assert_eq!((offsets(&held), attempts(&held)), (vec![0], vec![1]));
    assert_eq!(b.metric(CAPPED), 0.0);
    let waiter = g.via(&client(&b.addr).await);
    let wait = tokio::spawn(async move { waiter.poll_wait(10, Duration::from_secs(20)).await });
    // Offset 1 is there to be handed out, but the cap leaves no room: the
    // poll is counted as capped and waits.
    eventually(
        "the waiting poll to hit the cap",
        Duration::from_secs(10),
        || async { b.metric(CAPPED) >= 1.0 },
    )
    .await;
    assert!(!wait.is_finished(), "nothing has freed room yet");
    (b, g, held.into_iter().next().unwrap(), wait)
}

/// A poll waiting at the in-flight cap is woken when a claim lapses: it
/// gets the lapsed record (the owed one, before the new offset 1), long
/// before its own 20 s wait would end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_waiting_at_the_in_flight_cap_is_woken_by_a_lapse() {
    let (b, g, held, wait) = a_poll_waiting_at_the_cap().await;
    // Cut the claim short now that the poll waits (so the lapse cannot come
    // before it), and let it lapse.
    assert_eq!(
        g.extend(&held, Duration::from_millis(500)).await.unwrap(),
        Duration::from_millis(500)
    );
    let got = wait.await.unwrap();
    assert_eq!(
        (offsets(&got), attempts(&got)),
        (vec![0], vec![2]),
        "woken by the lapse, not answered empty at the end of its wait"
    );
    // The extend woke the waiting poll, which looked again, still at the
    // cap: one poll past the cap is counted once, however often it looks.
    assert_eq!(b.metric(CAPPED), 1.0);
    assert_eq!(
        code(g.extend(&held, Duration::from_secs(5)).await),
        Some(ErrorCode::StaleClaim),
        "the first claim lapsed and the record went out again"
    );
    g.ack(0).await.unwrap();
}

/// A poll waiting at the in-flight cap is woken by a nack: the handed-back
/// record goes to it as the next attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_waiting_at_the_in_flight_cap_is_woken_by_a_nack() {
    let (_b, g, held, wait) = a_poll_waiting_at_the_cap().await;
    g.nack(&held).await.unwrap();
    let got = wait.await.unwrap();
    assert_eq!(
        (offsets(&got), attempts(&got)),
        (vec![0], vec![2]),
        "woken by the nack, not answered empty at the end of its wait"
    );
    g.ack(0).await.unwrap();
}

/// A reclaim that gives up on the records it reserved (they were at the
/// attempt bound) frees their in-flight places; a poll waiting at the cap is
/// woken to use what the reclaiming poll did not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_waiting_at_the_in_flight_cap_is_woken_when_a_reclaim_gives_up() {
    let b = felix_tests::start_broker!(opts(30_000, 1).env("FELIX_GROUP_MAX_IN_FLIGHT", 2));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 2).await;
    let me = GroupMember::new("worker-1").reclaim(true);
    let first = Group::new(&client(&b.addr).await, JOBS, "workers");
    let held = first.poll_as(&me, GroupPollOptions::default()).await;
    assert_eq!(offsets(&held), vec![0, 1], "the group is at its cap");
    publish(&c, JOBS, 2).await;
    let waiter = first.via(&client(&b.addr).await);
    let wait = tokio::spawn(async move { waiter.poll_wait(10, Duration::from_secs(30)).await });
    eventually(
        "the waiting poll to hit the cap",
        Duration::from_secs(10),
        || async { b.metric(CAPPED) >= 1.0 },
    )
    .await;

    // The member comes back on a new connection: what it held is at the
    // attempt bound (1), so the reclaim dead-letters both, and the poll
    // takes one new record with the room.
    let again = first.via(&client(&b.addr).await);
    let options = GroupPollOptions {
        max_records: 1,
        ..GroupPollOptions::default()
    };
    let reclaimed = again.poll_as(&me, options).await;
    assert_eq!(
        (offsets(&reclaimed), attempts(&reclaimed)),
        (vec![2], vec![1])
    );
    // Woken, well before its 30 s wait would end.
    eventually(
        "the waiting poll to be woken",
        Duration::from_secs(10),
        || async { wait.is_finished() },
    )
    .await;
    let got = wait.await.unwrap();
    assert_eq!(
        (offsets(&got), attempts(&got)),
        (vec![3], vec![1]),
        "woken by the room the reclaim freed, not answered empty at the end of its wait"
    );
    assert_eq!(
        c.group_dead_letters(T, NS, JOBS, 0, "workers")
            .await
            .unwrap(),
        vec![0, 1]
    );
}

/// A delayed nack keeps its place under the cap; a poll waiting at the cap
/// is woken when the delay ends, and gets the record then, not before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_waiting_at_the_in_flight_cap_is_woken_when_a_delayed_nack_ends() {
    let (_b, g, held, wait) = a_poll_waiting_at_the_cap().await;
    let start = Instant::now();
    g.nack_after(&held, Duration::from_millis(1500))
        .await
        .unwrap();
    let got = wait.await.unwrap();
    assert_eq!(
        (offsets(&got), attempts(&got)),
        (vec![0], vec![2]),
        "woken when the delay ended, not answered empty at the end of its wait"
    );
    assert!(
        start.elapsed() >= Duration::from_millis(1450),
        "not owed before the delay: {:?}",
        start.elapsed()
    );
    g.ack(0).await.unwrap();
}

/// FELIX_GROUP_MAX_VISIBILITY_MS caps, over TCP, a poll's visibility (the
/// claim lapses at the cap, not at the minute asked, nor at the shorter
/// visibility timeout), a nack's delay (redelivered at the cap) and an
/// extension (which answers exactly the cap as how long the claim stands).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn visibility_delays_and_extensions_are_capped_at_the_max_visibility() {
    let b = felix_tests::start_broker!(felix_tests::BrokerOptions::default()
        .cores(2)
        .env("FELIX_GROUP_VISIBILITY_TIMEOUT_MS", 1000)
        .env("FELIX_GROUP_MAX_ATTEMPTS", 5)
        .env("FELIX_GROUP_MAX_VISIBILITY_MS", 2000));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 3).await;
    let g = Group::new(&c, JOBS, "workers");
    let cap = Duration::from_millis(2000);
    let a_minute = Duration::from_secs(60);

    // A poll asking a minute's visibility gets the cap's.
    let start = Instant::now();
    let long = GroupPollOptions {
        max_records: 1,
        visibility: Some(a_minute),
        ..GroupPollOptions::default()
    };
    let r = g.poll_as(&GroupMember::new("slow"), long).await;
    assert_eq!((offsets(&r), attempts(&r)), (vec![0], vec![1]));
    assert_eq!(g.describe().await.unwrap().in_flight, 1);
    eventually(
        "the minute-long claim to lapse at the cap",
        Duration::from_secs(20),
        || async {
            let info = g.describe().await.unwrap();
            info.owed == 1 && info.in_flight == 0
        },
    )
    .await;
    assert!(
        start.elapsed() >= cap - Duration::from_millis(50),
        "stood for the cap, not the 1 s visibility timeout: {:?}",
        start.elapsed()
    );
    let other = g.via(&client(&b.addr).await);
    let again = other.poll(1).await;
    assert_eq!((offsets(&again), attempts(&again)), (vec![0], vec![2]));
    other.ack(0).await.unwrap();

    // A nack delayed a minute is owed again after the cap.
    let r = g.poll(1).await;
    assert_eq!((offsets(&r), attempts(&r)), (vec![1], vec![1]));
    let start = Instant::now();
    g.nack_after(&r[0], a_minute).await.unwrap();
    assert_eq!(g.describe().await.unwrap().delayed, 1);
    eventually(
        "the minute-long delay to end at the cap",
        Duration::from_secs(20),
        || async {
            let info = g.describe().await.unwrap();
            info.owed == 1 && info.delayed == 0
        },
    )
    .await;
    assert!(
        start.elapsed() >= cap - Duration::from_millis(50),
        "held back for the cap: {:?}",
        start.elapsed()
    );
    let again = other.poll(1).await;
    assert_eq!((offsets(&again), attempts(&again)), (vec![1], vec![2]));
    other.ack(1).await.unwrap();

    // An extension past the cap stands for exactly the cap; one below it
    // stands for what was asked.
    let r = g.poll(1).await.remove(0);
    assert_eq!(r.offset, 2);
    assert_eq!(g.extend(&r, a_minute).await.unwrap(), cap);
    assert_eq!(g.extend(&r, Duration::from_secs(3600)).await.unwrap(), cap);
    assert_eq!(
        g.extend(&r, Duration::from_millis(1500)).await.unwrap(),
        Duration::from_millis(1500)
    );
    g.ack(2).await.unwrap();
    assert_eq!(g.position().await, 3);
}

/// A record its member nacked with a delay is nobody's while it waits: the
/// member restarting (a new connection reclaiming under its name) takes back
/// what it still held but not the delayed record, which goes to anyone who
/// polls once the delay has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_restarts_does_not_reclaim_a_record_it_nacked_with_a_delay() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let admin = client(&b.addr).await;
    stream(&admin, JOBS).await;
    publish(&admin, JOBS, 2).await;
    let opt = |max_records| GroupPollOptions {
        max_records,
        ..GroupPollOptions::default()
    };
    let me = GroupMember::new("worker-1");
    let reclaiming = me.clone().reclaim(true);
    let delay = Duration::from_secs(5);

    let a = Group::new(&client(&b.addr).await, JOBS, "workers");
    let held = a.poll_as(&me, opt(2)).await;
    assert_eq!((offsets(&held), attempts(&held)), (vec![0, 1], vec![1, 1]));
    let start = Instant::now();
    a.nack_after(&held[0], delay).await.unwrap();

    // The member restarts: a new connection, same name, reclaiming.
    let bb = a.via(&client(&b.addr).await);
    let back = bb.poll_as(&reclaiming, opt(10)).await;
    assert_eq!(
        (offsets(&back), attempts(&back)),
        (vec![1], vec![2]),
        "what it held, not what it nacked with a delay"
    );
    assert!(bb.poll_as(&reclaiming, opt(10)).await.is_empty());
    let info = bb.describe().await.unwrap();
    assert_eq!(
        (info.in_flight, info.delayed, info.owed),
        (2, 1, 0),
        "still delayed"
    );

    // After the delay it goes to anyone: here a stranger's waiting poll
    // (the reclaiming connection does not poll again).
    let stranger = a.via(&client(&b.addr).await);
    let got = stranger.poll_wait(10, Duration::from_secs(20)).await;
    assert_eq!((offsets(&got), attempts(&got)), (vec![0], vec![2]));
    assert!(
        start.elapsed() >= delay - Duration::from_millis(50),
        "not before the delay: {:?}",
        start.elapsed()
    );
    stranger.ack(0).await.unwrap();
    bb.ack(1).await.unwrap();
    assert_eq!(bb.position().await, 2);
}

// ------------------------------- beyond the guide: paging dead letters

/// Dead-letter `n` records of the jobs stream through `g` (a broker with
/// one attempt): claim them with short claims, a thousand a poll, and wait
/// for the claims to lapse into dead letters.
async fn dead_letter_by_lapse(g: &Group, n: u64) {
    let short = GroupPollOptions {
        max_records: 1000,
        visibility: Some(Duration::from_millis(300)),
        ..GroupPollOptions::default()
    };
    let mut claimed = 0;
    while claimed < n {
        let r = g.poll_as(&GroupMember::new("w"), short).await;
        assert!(!r.is_empty(), "{claimed} of {n} claimed, then nothing");
        claimed += r.len() as u64;
    }
    assert_eq!(claimed, n);
    eventually(
        "every claim to lapse into a dead letter",
        Duration::from_secs(20),
        || async { u64::from(g.describe().await.unwrap().dead_letters) == n },
    )
    .await;
}

/// A dead-letter list longer than a page comes back a page at a time: pages
/// of at most what was asked (and at most the broker's 1,000), ascending and
/// contiguous, each starting where the last said, the last one saying the
/// list is exhausted. `group_dead_letters` pages through all of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_dead_letter_list_is_paged_in_order() {
    let b = felix_tests::start_broker!(opts(30_000, 1));
    let c = client(&b.addr).await;
    assert!(c.has_feature(felix_wire::FEATURE_GROUP_DEAD_LETTER_PAGES));
    stream(&c, JOBS).await;
    publish(&c, JOBS, 2500).await;
    let g = Group::new(&c, JOBS, "workers");
    dead_letter_by_lapse(&g, 2500).await;
    let page = |from: u64, max: u32| {
        let c = c.clone();
        async move {
            c.group_dead_letters_page(T, NS, JOBS, 0, "workers", from, max)
                .await
                .expect("group_dead_letters_page")
        }
    };

    let mut from = 0;
    let mut seen: Vec<u64> = Vec::new();
    let mut sizes = Vec::new();
    loop {
        let p = page(from, 1000).await;
        let offs: Vec<u64> = p.letters.iter().map(|d| d.offset).collect();
        assert!(!offs.is_empty(), "an empty page from {from}");
        assert!(offs[0] >= from, "page from {from} starts at {}", offs[0]);
        assert!(
            offs.windows(2).all(|w| w[1] == w[0] + 1),
            "page from {from} is not ascending and contiguous"
        );
        if let Some(last) = seen.last() {
            assert_eq!(offs[0], last + 1, "pages overlap or leave a gap");
        }
        assert!(p
            .letters
            .iter()
            .all(|d| d.attempts == 1 && !d.by_consumer && d.reason.is_some()));
        sizes.push(offs.len());
        seen.extend(&offs);
        match p.next {
            Some(next) => {
                assert_eq!(next, offs[offs.len() - 1] + 1, "next is just past the page");
                from = next;
            }
            None => break,
        }
        assert!(sizes.len() < 10, "the pages do not end");
    }
    assert_eq!(sizes, vec![1000, 1000, 500]);
    assert_eq!(seen, (0..2500).collect::<Vec<u64>>());

    // The broker caps a page at its 1,000.
    let p = page(0, 5000).await;
    assert_eq!((p.letters.len(), p.next), (1000, Some(1000)));
    // From the middle, a small page; past the end, an empty last page.
    let p = page(1234, 10).await;
    let offs: Vec<u64> = p.letters.iter().map(|d| d.offset).collect();
    assert_eq!((offs, p.next), ((1234..1244).collect(), Some(1244)));
    let p = page(2499, 10).await;
    assert_eq!((p.letters.len(), p.next), (1, None));
    let p = page(2500, 10).await;
    assert_eq!((p.letters.len(), p.next), (0, None));
    let p = page(u64::MAX, 10).await;
    assert_eq!((p.letters.len(), p.next), (0, None));

    // The guide's call lists all of them (three pages under the hood).
    assert_eq!(g.dead_letters().await, (0..2500).collect::<Vec<u64>>());
    let detailed = g.dead_letters_detailed().await;
    assert_eq!(detailed.len(), 2500);
    // A redriven letter leaves the list; paging skips over the hole.
    g.redrive(1000).await.unwrap();
    let p = page(999, 2).await;
    let offs: Vec<u64> = p.letters.iter().map(|d| d.offset).collect();
    assert_eq!((offs, p.next), (vec![999, 1001], Some(1002)));
    assert_eq!(g.dead_letters().await.len(), 2499);
    // A group that does not exist has no list to page.
    assert_eq!(
        code(
            c.group_dead_letters_page(T, NS, JOBS, 0, "nobody", 0, 10)
                .await
        ),
        Some(ErrorCode::NotFound)
    );
}

/// With a small frame cap, a list of dead letters with long reasons does
/// not fit in one answer: the whole-list request is refused with
/// `too_large` (naming the paged call) instead of sending a frame over the
/// cap, while paging lists every letter, reasons intact, each page within
/// the cap. A short list still comes back whole, and a connection that did
/// not negotiate pages is refused them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_list_over_the_frame_cap_must_be_paged() {
    use felix_wire::{Request, Response, FEATURES_ALL, FEATURE_GROUP_DEAD_LETTER_PAGES};
    const CAP: usize = 64 * 1024;
    // One core: a raw connection is served by the shard's owner.
    let b = felix_tests::start_broker!(opts(30_000, 5).cores(1).env("FELIX_MAX_FRAME_BYTES", CAP));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 200).await;
    let g = Group::new(&c, JOBS, "workers");
    let claimed = g.poll(1000).await;
    assert_eq!(claimed.len(), 200);
    // 1,000-byte reasons make each listed letter exactly 1,024 bytes on the
    // wire, so a page is 63 letters when the frame's own bytes are counted
    // and 64 (one frame too large) if they were not.
    let reason = |o: u64| format!("{o:04}:{}", "x".repeat(995));
    for r in &claimed {
        g.dead_letter(r, Some(&reason(r.offset))).await.unwrap();
    }
    // A second group with a short list.
    let few = Group::new(&c, JOBS, "few");
    for r in few.poll(2).await {
        few.dead_letter(&r, Some("short")).await.unwrap();
    }

    let mut raw = Raw::hello(&b.addr, FEATURES_ALL).await;
    assert_ne!(raw.features & FEATURE_GROUP_DEAD_LETTER_PAGES, 0);
    let why = whole_list_refused(&mut raw, "workers").await;
    assert!(why.contains("group_dead_letters_page"), "{why}");
    assert!(why.contains("FEATURE_GROUP_DEAD_LETTER_PAGES"), "{why}");
    match raw
        .call(Request::GroupDeadLetters {
            key: wire_key("few"),
        })
        .await
    {
        Response::DeadLetters(list) => {
            assert_eq!(list.iter().map(|d| d.offset).collect::<Vec<_>>(), [0, 1])
        }
        other => panic!("unexpected {other:?}"),
    }

    // Paged, over the wire: every page fits the cap.
    let mut from = 0;
    let mut seen = Vec::new();
    let mut pages = 0;
    loop {
        let req = Request::GroupDeadLettersPage {
            key: wire_key("workers"),
            from,
            max: 1000,
        };
        let resp = raw.call(req).await;
        let mut frame = bytes::BytesMut::new();
        felix_wire::encode_response(0, &resp, &mut frame);
        assert!(frame.len() - 4 <= CAP, "a page of {} bytes", frame.len());
        let Response::DeadLetterPage { letters, next } = resp else {
            panic!("unexpected {resp:?}");
        };
        assert!(!letters.is_empty());
        if next.is_some() {
            assert_eq!(letters.len(), 63, "a full page under a 64 KiB frame");
        }
        pages += 1;
        seen.extend(letters.iter().map(|d| d.offset));
        match next {
            Some(n) => from = n,
            None => break,
        }
    }
    assert_eq!(pages, 4, "200 letters, 63 a page");
    assert_eq!(seen, (0..200).collect::<Vec<u64>>());

    // The client pages on its own; reasons come back whole.
    assert_eq!(g.dead_letters().await, (0..200).collect::<Vec<u64>>());
    let detailed = g.dead_letters_detailed().await;
    assert_eq!(detailed.len(), 200);
    for d in &detailed {
        assert_eq!(d.reason.as_deref(), Some(reason(d.offset).as_str()));
        assert!(d.by_consumer);
    }

    // A connection without the bit is refused pages, not served them.
    let mut old = Raw::hello(&b.addr, FEATURES_ALL & !FEATURE_GROUP_DEAD_LETTER_PAGES).await;
    assert_eq!(old.features & FEATURE_GROUP_DEAD_LETTER_PAGES, 0);
    let req = Request::GroupDeadLettersPage {
        key: wire_key("workers"),
        from: 0,
        max: 10,
    };
    assert_eq!(old.code(req).await, Some(ErrorCode::Unsupported));
    let why = whole_list_refused(&mut old, "workers").await;
    assert!(why.contains("predates paging"), "{why}");
}

/// Ask for a group's whole dead-letter list, expect `too_large`, and return
/// the broker's message.
async fn whole_list_refused(raw: &mut Raw, group: &str) -> String {
    match raw
        .call(felix_wire::Request::GroupDeadLetters {
            key: wire_key(group),
        })
        .await
    {
        felix_wire::Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::TooLarge, "{e:?}");
            e.message
        }
        other => panic!("a whole list over the cap answered {}", other.name()),
    }
}

/// A core's groups hold at most `groups.max_claims_per_core` claims together:
/// at it, a poll on any of its shards answers empty (counted as capped)
/// whatever room its own group has, and settling a claim on one shard wakes a
/// poll waiting on another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_core_holds_at_most_its_claim_limit_across_groups_and_shards() {
    const CAPPED: &str = "felix_group_polls_capped_total";
    const CLAIMS: &str = "felix_core_group_claims";
    const MAIL: &str = "mail";
    let cfg = config_file("[groups]\nmax_claims_per_core = 5\n");
    let b = felix_tests::start_broker!(opts(30_000, 5)
        .cores(1)
        .env("FELIX_TEST_CONFIG", cfg.path.display()));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    stream(&c, MAIL).await;
    publish(&c, JOBS, 10).await;
    publish(&c, MAIL, 10).await;
    let jobs = Group::new(&c, JOBS, "workers");
    let mail = Group::new(&c, MAIL, "senders");

    let held = jobs.poll(3).await;
    assert_eq!(offsets(&held), vec![0, 1, 2]);
    assert_eq!(offsets(&mail.poll(10).await), vec![0, 1], "two places left");
    assert_eq!(b.metric(CLAIMS), 5.0);
    assert_eq!(b.metric(CAPPED), 0.0);
    assert!(mail.poll(10).await.is_empty());
    assert_eq!(b.metric(CAPPED), 1.0);
    // Another group, with all its own room: the core's limit holds it too.
    assert!(Group::new(&c, JOBS, "others").poll(10).await.is_empty());
    assert_eq!(b.metric(CAPPED), 2.0);

    // A poll waiting on one shard is woken by an ack on the other.
    let waiter = mail.via(&client(&b.addr).await);
    let wait = tokio::spawn(async move { waiter.poll_wait(10, Duration::from_secs(20)).await });
    eventually(
        "the waiting poll to hit the limit",
        Duration::from_secs(10),
        || async { b.metric(CAPPED) >= 3.0 },
    )
    .await;
    assert!(!wait.is_finished());
    jobs.ack(0).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), wait)
        .await
        .expect("woken by the ack on the other shard, not by its 20 s wait")
        .unwrap();
    assert_eq!(offsets(&got), vec![2], "room for one");
    assert_eq!(b.metric(CLAIMS), 5.0);

    // Deleting a group gives back what it held.
    jobs.delete().await.unwrap();
    assert_eq!(b.metric(CLAIMS), 3.0);
    assert_eq!(offsets(&mail.poll(10).await), vec![3, 4]);
}

/// A shard keeps at most `groups.max_groups_per_shard` groups: a poll or
/// create that would add one more is `too_large`, existing groups go on, and
/// deleting one makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_keeps_at_most_its_group_limit() {
    let cfg = config_file("[groups]\nmax_groups_per_shard = 2\n");
    let b =
        felix_tests::start_broker!(opts(30_000, 5).env("FELIX_TEST_CONFIG", cfg.path.display()));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 3).await;
    let (g1, g2, g3) = (
        Group::new(&c, JOBS, "one"),
        Group::new(&c, JOBS, "two"),
        Group::new(&c, JOBS, "three"),
    );
    assert_eq!(offsets(&g1.poll(1).await), vec![0]);
    g2.create(StartPosition::Earliest).await.unwrap();
    let refused = c.group_poll(T, NS, JOBS, 0, "three", 1).await;
    assert_eq!(code(refused), Some(ErrorCode::TooLarge));
    assert_eq!(
        code(g3.create(StartPosition::Earliest).await),
        Some(ErrorCode::TooLarge)
    );
    assert_eq!(offsets(&g1.poll(1).await), vec![1], "existing groups go on");
    assert_eq!(offsets(&g2.poll(1).await), vec![0]);
    g1.delete().await.unwrap();
    assert_eq!(offsets(&g3.poll(1).await), vec![0], "room after a delete");
}

/// A poll's answer stays within the frame cap: owed records scattered among
/// finished ones are loaded only while they fit the poll's byte budget
/// (only the poll's first record may pass it), so a large record behind
/// them waits for the next poll instead of pushing the answer over the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scattered_owed_records_never_push_a_poll_over_the_frame_cap() {
    let cfg = config_file("[limits]\nmax_bytes_per_read = 524288\n");
    let b = felix_tests::start_broker!(opts(30_000, 5)
        .env("FELIX_TEST_CONFIG", cfg.path.display())
        .env("FELIX_MAX_FRAME_BYTES", 1 << 20));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    // 0, 2, 4, 6, 8: 100 KiB; 1, 3, 5, 7, 9: tiny; 10: nearly a frame.
    let sizes: Vec<usize> = (0..10)
        .map(|o| if o % 2 == 0 { 100 << 10 } else { 8 })
        .chain([(1 << 20) - 4096])
        .collect();
    for n in &sizes {
        c.publish(T, NS, JOBS, 0, vec![1u8; *n]).await.unwrap();
    }
    let g = Group::new(&c, JOBS, "workers");
    let mut first = Vec::new();
    while first.len() < sizes.len() {
        let got = g.poll(100).await;
        assert!(!got.is_empty());
        first.extend(got);
    }
    for r in &first {
        if r.offset % 2 == 1 {
            g.ack(r.offset).await.unwrap();
        } else {
            g.nack(r).await.unwrap();
        }
    }
    // Owed now: 0, 2, 4, 6, 8 (500 KiB) and 10, each its own run.
    let again = g.poll(100).await;
    assert_eq!(offsets(&again), vec![0, 2, 4, 6, 8], "the large one waits");
    let last = g.poll(100).await;
    assert_eq!(offsets(&last), vec![10]);
    g.ack_all(&again).await;
    g.ack_all(&last).await;
    assert_eq!(g.position().await, 11);
}

// --------------------------------- beyond the guide: per-group metrics

/// A scrape reports, per shard, each group's position, lag, in-flight
/// (delayed included), owed and dead-letter counts (what `group_describe`
/// answers) and how long its oldest claim has stood; a deleted group
/// leaves the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_report_each_groups_lag_and_unfinished_work() {
    let b = felix_tests::start_broker!(opts(30_000, 5));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 10).await;
    let g = Group::new(&c, JOBS, "workers");
    let r = g.poll(5).await;
    assert_eq!(offsets(&r), vec![0, 1, 2, 3, 4]);
    g.ack(0).await.unwrap();
    g.nack(&r[1]).await.unwrap(); // owed
    g.dead_letter(&r[2], Some("bad input")).await.unwrap();
    g.nack_after(&r[3], Duration::from_secs(60)).await.unwrap(); // delayed
                                                                 // Offset 4 stays claimed, and ages: the oldest claim's age must show.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let labels = [
        ("stream", "t/ns/jobs"),
        ("shard", "0"),
        ("group", "workers"),
    ];
    let m = |name: &str| {
        b.metric_series(name, &labels)
            .unwrap_or_else(|| panic!("no {name} series for the group:\n{}", b.metrics()))
    };
    assert_eq!(m("felix_group_position"), 1.0, "offset 1 is unfinished");
    assert_eq!(m("felix_group_lag"), 9.0);
    assert_eq!(m("felix_group_in_flight"), 2.0, "a claim and a delay");
    assert_eq!(m("felix_group_delayed"), 1.0);
    assert_eq!(m("felix_group_owed"), 1.0);
    assert_eq!(m("felix_group_dead_letters"), 1.0);
    assert!(m("felix_group_oldest_in_flight_age_seconds") >= 0.1);
    let info = g.describe().await.unwrap();
    assert_eq!(
        (
            info.position,
            info.lag(),
            u64::from(info.in_flight),
            u64::from(info.owed)
        ),
        (1, 9, 2, 1),
        "the metrics agree with group_describe"
    );
    // Offsets 3 (delayed) and 4 (claimed) were handed out at least 100 ms
    // ago; offset 1, owed since its nack, just as long. The dead letter
    // says when and why it was set aside, and who did it.
    let age = |a: Option<u64>| a.unwrap_or_else(|| panic!("no age: {info:?}"));
    assert!(age(info.oldest_in_flight_age_ms) >= 100, "{info:?}");
    assert!(age(info.oldest_in_flight_age_ms) < 60_000, "{info:?}");
    assert!(age(info.oldest_owed_age_ms) >= 100, "{info:?}");
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let dl = c
        .group_dead_letters_detailed(T, NS, JOBS, 0, "workers")
        .await
        .unwrap();
    assert_eq!(dl.len(), 1, "{dl:?}");
    assert_eq!((dl[0].offset, dl[0].attempts), (2, 1));
    assert_eq!(dl[0].reason.as_deref(), Some("bad input"));
    assert!(dl[0].by_consumer);
    assert!(
        dl[0].at_ms <= now_ms && now_ms - dl[0].at_ms < 60_000,
        "set aside {} ms ago",
        now_ms.saturating_sub(dl[0].at_ms)
    );
    // And what it has done: five handed out, one acked, one given up on;
    // then the nacked record goes out again.
    assert_eq!(m("felix_group_delivered_records_total"), 5.0);
    assert_eq!(m("felix_group_redelivered_records_total"), 0.0);
    assert_eq!(m("felix_group_acked_records_total"), 1.0);
    assert_eq!(m("felix_group_dead_lettered_records_total"), 1.0);
    let owed = g.poll(1).await;
    assert_eq!((offsets(&owed), attempts(&owed)), (vec![1], vec![2]));
    assert_eq!(m("felix_group_delivered_records_total"), 6.0);
    assert_eq!(m("felix_group_redelivered_records_total"), 1.0);
    g.delete().await.unwrap();
    assert_eq!(b.metric_series("felix_group_lag", &labels), None);
}

/// Past `server.metrics_max_groups` a scrape reports the first groups by
/// stream, shard and name, and counts the rest as omitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_report_at_most_the_configured_groups() {
    let cfg = config_file("[server]\nmetrics_max_groups = 2\n");
    let b =
        felix_tests::start_broker!(opts(30_000, 5).env("FELIX_TEST_CONFIG", cfg.path.display()));
    let c = client(&b.addr).await;
    stream(&c, JOBS).await;
    publish(&c, JOBS, 3).await;
    for name in ["c", "a", "b"] {
        Group::new(&c, JOBS, name).poll(1).await;
    }
    let lag = |group: &str| b.metric_series("felix_group_lag", &[("group", group)]);
    assert_eq!((lag("a"), lag("b"), lag("c")), (Some(3.0), Some(3.0), None));
    assert_eq!(b.metric("felix_group_metrics_omitted"), 1.0);

    // Across cores: a two-shard stream (a shard on each core), two groups
    // on each shard; the cap keeps the first by stream, shard and group.
    let cfg = config_file("[server]\nmetrics_max_groups = 3\n");
    let b =
        felix_tests::start_broker!(opts(30_000, 5).env("FELIX_TEST_CONFIG", cfg.path.display()));
    let c = client(&b.addr).await;
    c.create_stream(T, NS, "two", 2, felix_client::StreamOptions::default())
        .await
        .unwrap();
    for shard in [1, 0] {
        for group in ["y", "x"] {
            c.group_poll(T, NS, "two", shard, group, 1).await.unwrap();
        }
    }
    let seen = |shard: &str, group: &str| {
        b.metric_series("felix_group_lag", &[("shard", shard), ("group", group)])
            .is_some()
    };
    assert_eq!(
        [
            seen("0", "x"),
            seen("0", "y"),
            seen("1", "x"),
            seen("1", "y")
        ],
        [true, true, true, false]
    );
    assert_eq!(b.metric("felix_group_metrics_omitted"), 1.0);
}
