//! Client behaviour against a fake broker: pipelining, timeouts, core
//! routing, feature refusal, disconnects.

mod fake;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fake::{Action, Fake};
use felix_client::{
    AckMode, Client, ClientConfig, ClientError, ErrorCode, GroupMember, GroupPollOptions,
    GroupRecord, Record, StartPosition, StreamInfo, StreamRef, FEATURES_ALL, FEATURE_GROUPS,
    FEATURE_GROUP_ADMIN, FEATURE_GROUP_DEAD_LETTER_PAGES, FEATURE_GROUP_SKIPPED,
    FEATURE_PUBLISH_ACK_MODE,
};
use felix_wire::{Request, Response, WireError};

fn config() -> ClientConfig {
    ClientConfig {
        request_timeout: Duration::from_secs(5),
        connect_timeout: Duration::from_secs(2),
        reconnect_backoff_initial: Duration::from_millis(10),
        reconnect_backoff_max: Duration::from_millis(50),
        ..ClientConfig::default()
    }
}

fn stream_info(stream: &StreamRef, placement: Vec<u32>) -> StreamInfo {
    StreamInfo {
        stream: stream.clone(),
        shards: placement.len() as u32,
        retention_bytes: None,
        retention_ms: None,
        incarnation: None,
        placement,
    }
}

fn group_record(offset: u64, attempts: u32) -> GroupRecord {
    GroupRecord {
        offset,
        attempts,
        timestamp_ms: 1,
        key: None,
        headers: Default::default(),
        payload: Bytes::from_static(b"job"),
        skipped_before: Some(3),
    }
}

fn record(offset: u64) -> Record {
    Record {
        offset,
        timestamp_ms: 7,
        key: None,
        headers: Default::default(),
        payload: Bytes::from(format!("r{offset}")),
    }
}

fn ok() -> Action {
    Action::Reply(Response::Ok)
}

#[tokio::test]
async fn hello_negotiates_and_a_call_round_trips() {
    let fake = Fake::start(1, FEATURES_ALL, |_, req| async move {
        match req {
            Request::ListStreams { tenant } => {
                assert_eq!(tenant.as_deref(), Some("t1"));
                Response::Streams(vec![stream_info(&StreamRef::new("t1", "n", "s"), vec![0])])
                    .into()
            }
            other => panic!("unexpected {other:?}"),
        }
    })
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    assert_eq!(client.cores(), 1);
    assert_eq!(client.features(), FEATURES_ALL);
    assert_eq!(client.broker(), "fake");
    let v = client.list_streams(Some("t1")).await.unwrap();
    assert_eq!(v.len(), 1);
    let hello = &fake.seen()[0].request;
    match hello {
        Request::Hello {
            version,
            features,
            want_core,
            client_name,
            token,
        } => {
            assert_eq!(*version, felix_wire::PROTOCOL_VERSION);
            assert_eq!(*features, FEATURES_ALL);
            assert_eq!(*want_core, None);
            assert!(client_name.starts_with("felix-client-rs/"));
            assert_eq!(*token, None);
        }
        other => panic!("first frame was {other:?}"),
    }
}

#[tokio::test]
async fn a_long_poll_does_not_block_an_ack() {
    let fake = Fake::start(1, FEATURES_ALL, |_, req| async move {
        match req {
            Request::GroupPoll { wait_ms, .. } => {
                tokio::time::sleep(Duration::from_millis(u64::from(wait_ms))).await;
                Response::GroupRecords { records: vec![] }.into()
            }
            Request::GroupAck { .. } => ok(),
            other => panic!("unexpected {other:?}"),
        }
    })
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    let start = Instant::now();
    let poller = {
        let client = client.clone();
        tokio::spawn(async move {
            let r = client
                .group_poll_wait("t", "n", "s", 0, "g", 10, Duration::from_millis(3000))
                .await;
            (r, start.elapsed())
        })
    };
    // Let the poll reach the broker first.
    tokio::time::sleep(Duration::from_millis(100)).await;
    client.group_ack("t", "n", "s", 0, "g", 5).await.unwrap();
    let ack_done = start.elapsed();
    let (poll, poll_done) = poller.await.unwrap();
    assert!(poll.unwrap().is_empty());
    assert!(
        ack_done < Duration::from_millis(2000),
        "ack waited for the poll: {ack_done:?}"
    );
    assert!(poll_done >= Duration::from_millis(3000));
    // Both went over the one connection.
    let hellos = fake.count(|r| matches!(r, Request::Hello { .. }));
    assert_eq!(hellos, 1);
}

#[tokio::test]
async fn many_requests_in_flight_are_matched_by_id() {
    let fake = Fake::start(1, FEATURES_ALL, |_, req| async move {
        match req {
            Request::Read { from, .. } => {
                let StartPosition::Offset(o) = from else {
                    panic!("expected an offset")
                };
                // Later requests answer sooner.
                tokio::time::sleep(Duration::from_millis(200 - o * 10)).await;
                Response::Records {
                    start_offset: 0,
                    next_offset: o + 1,
                    end_offset: 100,
                    records: vec![record(o)],
                }
                .into()
            }
            other => panic!("unexpected {other:?}"),
        }
    })
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    let mut tasks = Vec::new();
    for o in 0..15u64 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            client
                .read("t", "n", "s", 0, StartPosition::Offset(o), 1, None)
                .await
        }));
    }
    for (o, t) in tasks.into_iter().enumerate() {
        let batch = t.await.unwrap().unwrap();
        assert_eq!(batch.records[0].offset, o as u64);
        assert_eq!(batch.next_offset, o as u64 + 1);
    }
}

#[tokio::test]
async fn an_unanswered_request_times_out_and_the_connection_goes_on() {
    let fake = Fake::start(1, FEATURES_ALL, |_, req| async move {
        match req {
            Request::GroupDescribe { .. } => Action::Ignore,
            Request::Ping => Response::Pong.into(),
            other => panic!("unexpected {other:?}"),
        }
    })
    .await;
    let client = Client::connect(
        fake.addr,
        ClientConfig {
            request_timeout: Duration::from_millis(200),
            ..config()
        },
    )
    .await
    .unwrap();
    let start = Instant::now();
    let err = client
        .group_describe("t", "n", "s", 0, "g")
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::Timeout), "{err:?}");
    assert_eq!(err.kind(), "timeout");
    assert!(start.elapsed() >= Duration::from_millis(200));
    assert!(start.elapsed() < Duration::from_secs(2));
    client.ping().await.unwrap();
}

#[tokio::test]
async fn a_requested_wait_extends_the_timeout() {
    let fake = Fake::start(1, FEATURES_ALL, |_, req| async move {
        match req {
            Request::GroupPoll { wait_ms, .. } => {
                assert_eq!(wait_ms, 3000);
                // Past the request timeout, within it and the wait.
                tokio::time::sleep(Duration::from_millis(2500)).await;
                Response::GroupRecords {
                    records: vec![group_record(1, 1)],
                }
                .into()
            }
            other => panic!("unexpected {other:?}"),
        }
    })
    .await;
    let client = Client::connect(
        fake.addr,
        ClientConfig {
            request_timeout: Duration::from_millis(1000),
            ..config()
        },
    )
    .await
    .unwrap();
    let got = client
        .group_poll_wait("t", "n", "s", 0, "g", 4, Duration::from_millis(3000))
        .await
        .unwrap();
    assert_eq!(got.len(), 1);
}

/// Two cores; the stream's placement first says shard 1 is on core 0,
/// which is stale: core 0 answers wrong_core naming core 1.
#[tokio::test]
async fn wrong_core_refreshes_placement_and_retries_once() {
    let describes = Arc::new(AtomicU32::new(0));
    let d = describes.clone();
    let fake = Fake::start(2, FEATURES_ALL, move |core, req| {
        let d = d.clone();
        async move {
            match req {
                Request::DescribeStream { stream } => {
                    let n = d.fetch_add(1, Ordering::SeqCst);
                    let placement = if n == 0 { vec![0, 0] } else { vec![0, 1] };
                    Response::Stream(stream_info(&stream, placement)).into()
                }
                Request::Publish { target, .. } => {
                    assert_eq!(target, felix_wire::PublishTarget::Shard(1));
                    if core == 1 {
                        Response::Published {
                            shard: 1,
                            base_offset: 41,
                            count: 1,
                        }
                        .into()
                    } else {
                        Response::Error(WireError::wrong_core(1, "shard 1 is on core 1")).into()
                    }
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    })
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    assert_eq!(client.cores(), 2);
    let offset = client.publish("t", "n", "s", 1, "x").await.unwrap();
    assert_eq!(offset, 41);
    assert_eq!(describes.load(Ordering::SeqCst), 2, "placement refreshed");
    let publishes: Vec<u32> = fake
        .requests()
        .iter()
        .filter(|s| matches!(s.request, Request::Publish { .. }))
        .map(|s| s.core)
        .collect();
    assert_eq!(publishes, vec![0, 1]);
    // A connection asked for core 1.
    assert_eq!(
        fake.count(|r| matches!(
            r,
            Request::Hello {
                want_core: Some(1),
                ..
            }
        )),
        1
    );
    // The refreshed placement is cached: the next publish goes straight to
    // core 1 without describing again.
    client.publish("t", "n", "s", 1, "y").await.unwrap();
    assert_eq!(describes.load(Ordering::SeqCst), 2);
    let last = fake.requests().last().unwrap().clone();
    assert_eq!(last.core, 1);
}

#[tokio::test]
async fn wrong_core_twice_is_an_error_not_a_loop() {
    let fake = Fake::start(2, FEATURES_ALL, |core, req| async move {
        match req {
            Request::DescribeStream { stream } => {
                Response::Stream(stream_info(&stream, vec![0])).into()
            }
            Request::GroupAck { .. } => {
                Response::Error(WireError::wrong_core(1 - core, "elsewhere")).into()
            }
            other => panic!("unexpected {other:?}"),
        }
    })
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    let err = client
        .group_ack("t", "n", "s", 0, "g", 1)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::WrongCore));
    assert_eq!(fake.count(|r| matches!(r, Request::GroupAck { .. })), 2);
}

#[tokio::test]
async fn publish_keyed_goes_to_the_core_of_the_keys_shard() {
    let fake = Fake::start(4, FEATURES_ALL, |core, req| async move {
        match req {
            Request::DescribeStream { stream } => {
                Response::Stream(stream_info(&stream, vec![3, 2, 1, 0])).into()
            }
            Request::Publish {
                target, records, ..
            } => {
                let felix_wire::PublishTarget::Key(key) = target else {
                    panic!("expected a key target")
                };
                assert_eq!(records.iter().next().unwrap().key, Some(&key[..]));
                let shard = felix_wire::shard_for_key(&key, 4);
                assert_eq!(core, 3 - shard, "sent to the wrong core");
                Response::Published {
                    shard,
                    base_offset: 0,
                    count: 1,
                }
                .into()
            }
            other => panic!("unexpected {other:?}"),
        }
    })
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    for k in ["a", "b", "c", "user-42", "zz"] {
        let p = client.publish_keyed("t", "n", "s", k, "v").await.unwrap();
        assert_eq!(p.shard, felix_wire::shard_for_key(k.as_bytes(), 4));
    }
    assert_eq!(
        fake.count(|r| matches!(r, Request::DescribeStream { .. })),
        1
    );
}

#[tokio::test]
async fn claim_control_is_refused_without_the_feature() {
    let features = FEATURE_GROUPS | FEATURE_GROUP_ADMIN;
    let fake = Fake::start(1, features, |_, req| async move {
        match req {
            Request::GroupPoll { visibility_ms, .. } => {
                assert_eq!(visibility_ms, None);
                Response::GroupRecords { records: vec![] }.into()
            }
            Request::GroupNack { delay_ms, .. } => {
                assert_eq!(delay_ms, None);
                ok()
            }
            other => panic!("unexpected {other:?}"),
        }
    })
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    let me = GroupMember::new("w1").reclaim(true);
    let rec = group_record(3, 1);

    let err = client
        .group_poll_as(
            "t",
            "n",
            "s",
            0,
            "g",
            &me,
            GroupPollOptions {
                max_records: 4,
                wait: Duration::ZERO,
                visibility: Some(Duration::from_secs(60)),
            },
        )
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::Unsupported(_)), "{err:?}");
    assert!(err.to_string().contains("FEATURE_GROUP_CLAIM_CONTROL"));

    let err = client
        .group_nack_after("t", "n", "s", 0, "g", &rec, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::Unsupported(_)), "{err:?}");
    let err = client
        .group_extend("t", "n", "s", 0, "g", &rec, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::Unsupported(_)), "{err:?}");
    let err = client
        .group_dead_letter_with_reason("t", "n", "s", 0, "g", &rec, "bad")
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::Unsupported(_)), "{err:?}");
    assert!(fake.requests().is_empty(), "something was sent");

    // Without the refused fields the same calls go through.
    client
        .group_poll_as("t", "n", "s", 0, "g", &me, GroupPollOptions::default())
        .await
        .unwrap();
    client
        .group_nack("t", "n", "s", 0, "g", &rec)
        .await
        .unwrap();
    let sent = fake.requests();
    assert_eq!(sent.len(), 2);
    match &sent[0].request {
        Request::GroupPoll { member, .. } => {
            let m = member.as_ref().unwrap();
            assert_eq!(m.name, "w1");
            assert!(m.reclaim);
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn group_admin_and_groups_are_refused_without_their_features() {
    let fake = Fake::start(1, FEATURE_GROUPS, |_, req| async move {
        panic!("nothing should be sent, got {req:?}")
    })
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    for err in [
        client
            .group_create("t", "n", "s", 0, "g", StartPosition::Latest)
            .await
            .unwrap_err(),
        client
            .group_seek("t", "n", "s", 0, "g", StartPosition::Earliest)
            .await
            .unwrap_err(),
        client
            .group_describe("t", "n", "s", 0, "g")
            .await
            .unwrap_err(),
        client
            .group_delete("t", "n", "s", 0, "g")
            .await
            .unwrap_err(),
    ] {
        assert!(matches!(&err, ClientError::Unsupported(m) if m.contains("FEATURE_GROUP_ADMIN")));
    }

    let fake = Fake::start(1, 0, |_, req| async move {
        panic!("nothing should be sent, got {req:?}")
    })
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    let rec = group_record(1, 1);
    for err in [
        client
            .group_poll("t", "n", "s", 0, "g", 1)
            .await
            .unwrap_err(),
        client
            .group_ack("t", "n", "s", 0, "g", 1)
            .await
            .unwrap_err(),
        client
            .group_nack("t", "n", "s", 0, "g", &rec)
            .await
            .unwrap_err(),
        client
            .group_dead_letters("t", "n", "s", 0, "g")
            .await
            .unwrap_err(),
        client
            .group_redrive("t", "n", "s", 0, "g", 1)
            .await
            .unwrap_err(),
        client
            .group_discard("t", "n", "s", 0, "g", 1)
            .await
            .unwrap_err(),
    ] {
        assert!(
            matches!(&err, ClientError::Unsupported(m) if m.contains("FEATURE_GROUPS")),
            "{err:?}"
        );
    }
    assert!(fake.requests().is_empty());
}

fn dead_letter(offset: u64) -> felix_client::DeadLetterInfo {
    felix_client::DeadLetterInfo {
        offset,
        attempts: 1,
        at_ms: 5,
        reason: None,
        by_consumer: false,
    }
}

/// With FEATURE_GROUP_DEAD_LETTER_PAGES, `group_dead_letters` follows the
/// pages from offset 0 until `next` is `None`; without it, it sends the
/// whole-list request and `group_dead_letters_page` is refused unsent.
#[tokio::test]
async fn dead_letters_are_paged_when_the_broker_pages() {
    let fake = Fake::start(1, FEATURES_ALL, |_, req| async move {
        match req {
            Request::GroupDeadLettersPage { from, .. } => {
                // Pages of two, over offsets 10, 11, 20, 21, 30.
                let all = [10u64, 11, 20, 21, 30];
                let rest: Vec<u64> = all.iter().copied().filter(|o| *o >= from).collect();
                let letters = rest.iter().take(2).map(|o| dead_letter(*o)).collect();
                let next = (rest.len() > 2).then(|| rest[1] + 1);
                Response::DeadLetterPage { letters, next }.into()
            }
            other => panic!("unexpected {other:?}"),
        }
    })
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    assert_eq!(
        client
            .group_dead_letters("t", "n", "s", 0, "g")
            .await
            .unwrap(),
        vec![10, 11, 20, 21, 30]
    );
    // From 0, then just past each page; as many a page as the broker allows.
    let asked: Vec<(u64, u32)> = fake
        .requests()
        .iter()
        .map(|r| match r.request {
            Request::GroupDeadLettersPage { from, max, .. } => (from, max),
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(asked, vec![(0, u32::MAX), (12, u32::MAX), (22, u32::MAX)]);
    let page = client
        .group_dead_letters_page("t", "n", "s", 0, "g", 21, 10)
        .await
        .unwrap();
    let offsets: Vec<u64> = page.letters.iter().map(|d| d.offset).collect();
    assert_eq!((offsets, page.next), (vec![21, 30], None));
    assert!(matches!(
        fake.requests().last().unwrap().request,
        Request::GroupDeadLettersPage {
            from: 21,
            max: 10,
            ..
        }
    ));

    let fake = Fake::start(
        1,
        FEATURES_ALL & !FEATURE_GROUP_DEAD_LETTER_PAGES,
        |_, req| async move {
            match req {
                Request::GroupDeadLetters { .. } => {
                    Response::DeadLetters(vec![dead_letter(3), dead_letter(4)]).into()
                }
                other => panic!("unexpected {other:?}"),
            }
        },
    )
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    assert_eq!(
        client
            .group_dead_letters("t", "n", "s", 0, "g")
            .await
            .unwrap(),
        vec![3, 4]
    );
    let err = client
        .group_dead_letters_page("t", "n", "s", 0, "g", 0, 10)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ClientError::Unsupported(m) if m.contains("FEATURE_GROUP_DEAD_LETTER_PAGES")),
        "{err:?}"
    );
    assert_eq!(fake.requests().len(), 1, "the refused page was not sent");
}

#[tokio::test]
async fn claim_control_fields_are_sent_when_advertised() {
    let fake = Fake::start(1, FEATURES_ALL, |_, req| async move {
        match req {
            Request::GroupPoll { visibility_ms, .. } => {
                assert_eq!(visibility_ms, Some(60_000));
                Response::GroupRecords {
                    records: vec![group_record(3, 2)],
                }
                .into()
            }
            Request::GroupNack {
                offset,
                attempts,
                delay_ms,
                ..
            } => {
                assert_eq!((offset, attempts, delay_ms), (3, 2, Some(30_000)));
                ok()
            }
            Request::GroupExtend {
                offset,
                attempts,
                extend_ms,
                ..
            } => {
                assert_eq!((offset, attempts), (3, 2));
                Response::Extended {
                    stands_ms: extend_ms,
                }
                .into()
            }
            Request::GroupDeadLetter { reason, .. } => {
                assert_eq!(reason.as_deref(), Some("poison"));
                ok()
            }
            other => panic!("unexpected {other:?}"),
        }
    })
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    let batch = client
        .group_poll_as(
            "t",
            "n",
            "s",
            0,
            "g",
            &GroupMember::new("w"),
            GroupPollOptions {
                max_records: 1,
                wait: Duration::ZERO,
                visibility: Some(Duration::from_secs(60)),
            },
        )
        .await
        .unwrap();
    let rec = &batch[0];
    // FEATURE_GROUP_SKIPPED is negotiated, so skipped_before is kept.
    assert_eq!(rec.skipped_before, Some(3));
    client
        .group_nack_after("t", "n", "s", 0, "g", rec, Duration::from_secs(30))
        .await
        .unwrap();
    let stands = client
        .group_extend("t", "n", "s", 0, "g", rec, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(stands, Duration::from_secs(60));
    client
        .group_dead_letter_with_reason("t", "n", "s", 0, "g", rec, "poison")
        .await
        .unwrap();
}

#[tokio::test]
async fn skipped_before_is_dropped_without_the_feature() {
    let features = FEATURES_ALL & !FEATURE_GROUP_SKIPPED;
    let fake = Fake::start(1, features, |_, _| async move {
        Response::GroupRecords {
            records: vec![group_record(9, 1)],
        }
        .into()
    })
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    let batch = client.group_poll("t", "n", "s", 0, "g", 1).await.unwrap();
    assert_eq!(batch[0].skipped_before, None);
}

#[tokio::test]
async fn ack_on_commit_asks_for_durable_acks() {
    let fake = Fake::start(1, FEATURES_ALL, |_, req| async move {
        match req {
            Request::Publish { ack, records, .. } => Response::Published {
                shard: 0,
                base_offset: if ack == AckMode::Durable { 100 } else { 0 },
                count: records.len() as u32,
            }
            .into(),
            other => panic!("unexpected {other:?}"),
        }
    })
    .await;
    let plain = Client::connect(fake.addr, config()).await.unwrap();
    assert_eq!(plain.publish("t", "n", "s", 0, "a").await.unwrap(), 0);
    let durable = Client::connect(
        fake.addr,
        ClientConfig {
            ack_on_commit: true,
            ..config()
        },
    )
    .await
    .unwrap();
    assert_eq!(durable.publish("t", "n", "s", 0, "a").await.unwrap(), 100);
    let acks: Vec<AckMode> = fake
        .requests()
        .iter()
        .filter_map(|s| match &s.request {
            Request::Publish { ack, .. } => Some(*ack),
            _ => None,
        })
        .collect();
    assert_eq!(acks, vec![AckMode::Default, AckMode::Durable]);

    // A broker without the ack-mode feature would ignore the field.
    let old = Fake::start(
        1,
        FEATURES_ALL & !FEATURE_PUBLISH_ACK_MODE,
        |_, req| async move { panic!("nothing should be sent, got {req:?}") },
    )
    .await;
    let durable = Client::connect(
        old.addr,
        ClientConfig {
            ack_on_commit: true,
            ..config()
        },
    )
    .await
    .unwrap();
    let err = durable.publish("t", "n", "s", 0, "a").await.unwrap_err();
    assert!(matches!(err, ClientError::Unsupported(_)), "{err:?}");
}

#[tokio::test]
async fn server_errors_carry_their_code() {
    let fake = Fake::start(1, FEATURES_ALL, |_, _| async move {
        Response::Error(WireError::new(ErrorCode::StaleClaim, "claim lapsed")).into()
    })
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    let err = client
        .group_ack("t", "n", "s", 0, "g", 1)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::StaleClaim));
    assert_eq!(err.kind(), "stale_claim");
    assert_eq!(err.message(), "claim lapsed");
    assert_eq!(err.to_string(), "stale_claim: claim lapsed");
}

#[tokio::test]
async fn group_create_leaves_an_existing_group_alone() {
    let fake = Fake::start(1, FEATURES_ALL, |_, _| async move {
        Response::Error(WireError::new(ErrorCode::AlreadyExists, "exists")).into()
    })
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    client
        .group_create("t", "n", "s", 0, "g", StartPosition::Latest)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_dropped_connection_fails_requests_in_flight_and_reconnects() {
    let fake = Fake::start(1, FEATURES_ALL, |_, req| async move {
        match req {
            Request::Publish { .. } => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                Action::Close
            }
            Request::Ping => Response::Pong.into(),
            other => panic!("unexpected {other:?}"),
        }
    })
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    let err = client.publish("t", "n", "s", 0, "x").await.unwrap_err();
    assert!(matches!(err, ClientError::Disconnected), "{err:?}");
    // The publish was not resent.
    assert_eq!(fake.count(|r| matches!(r, Request::Publish { .. })), 1);
    // The next call opens a new connection.
    client.ping().await.unwrap();
    assert_eq!(fake.count(|r| matches!(r, Request::Hello { .. })), 2);
}

#[tokio::test]
async fn an_unreachable_broker_fails_connect_with_io() {
    // Grab a free port, then close it so nothing listens there.
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let err = Client::connect(addr, config()).await.unwrap_err();
    assert!(matches!(err, ClientError::Io(_)), "{err:?}");
}

#[tokio::test]
async fn reconnects_back_off_exponentially_and_share_a_failed_attempt() {
    let fake = Fake::start(1, FEATURES_ALL, |_, req| async move {
        match req {
            Request::DeleteStream { .. } => Action::Close,
            Request::Ping => Response::Pong.into(),
            other => panic!("unexpected {other:?}"),
        }
    })
    .await;
    let client = Client::connect(
        fake.addr,
        ClientConfig {
            reconnect_backoff_initial: Duration::from_millis(600),
            reconnect_backoff_max: Duration::from_millis(1200),
            ..config()
        },
    )
    .await
    .unwrap();
    fake.stop_listening().await;
    // The broker drops the connection; nothing listens any more.
    let err = client.delete_stream("t", "n", "s").await.unwrap_err();
    assert!(matches!(err, ClientError::Disconnected), "{err:?}");

    // A connection that closed before answering anything counts as a
    // failed attempt: the first reconnect waits the initial 600 ms, and is
    // refused.
    let start = Instant::now();
    let err = client.ping().await.unwrap_err();
    assert!(matches!(err, ClientError::Io(_)), "{err:?}");
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(550) && waited < Duration::from_millis(1150),
        "{waited:?}"
    );

    // Then doubled, 1.2 s, before the next attempt; callers queued behind
    // it share its failure rather than each waiting their own turn (3.6 s).
    let start = Instant::now();
    let (a, b, c) = tokio::join!(client.ping(), client.ping(), client.ping());
    for r in [a, b, c] {
        assert!(matches!(r, Err(ClientError::Io(_))), "{r:?}");
    }
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(1100) && waited < Duration::from_millis(3000),
        "{waited:?}"
    );

    // Capped at 1.2 s (doubled again it would be 2.4 s).
    let start = Instant::now();
    assert!(client.ping().await.is_err());
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(1100) && waited < Duration::from_millis(2000),
        "{waited:?}"
    );
}

#[tokio::test]
async fn subscribe_follows_the_tail() {
    let fake = Fake::start(1, FEATURES_ALL, |_, req| async move {
        match req {
            Request::Read {
                from,
                max_records,
                wait_ms,
                ..
            } => {
                let start = match from {
                    StartPosition::Earliest => 0,
                    StartPosition::Offset(o) => o,
                    StartPosition::Latest => panic!("not used"),
                };
                let end = if start >= 5 {
                    // The tail: a record arrives while the read waits.
                    assert!(wait_ms > 0, "a read at the tail should wait");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    start + 1
                } else {
                    (start + u64::from(max_records)).min(5)
                };
                Response::Records {
                    start_offset: 0,
                    next_offset: end,
                    end_offset: 10,
                    records: (start..end).map(record).collect(),
                }
                .into()
            }
            other => panic!("unexpected {other:?}"),
        }
    })
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    let mut sub = client
        .subscribe("t", "n", "s", 0, StartPosition::Earliest)
        .max_records(2);
    for want in 0..8u64 {
        let r = tokio::time::timeout(Duration::from_secs(5), sub.next())
            .await
            .expect("subscription stalled")
            .unwrap()
            .unwrap();
        assert_eq!(r.offset, want);
        assert_eq!(&r.payload[..], format!("r{want}").as_bytes());
    }
    assert_eq!(sub.position(), StartPosition::Offset(8));
}

#[tokio::test]
async fn subscription_is_a_stream() {
    use futures_lite::StreamExt;
    let fake = Fake::start(1, FEATURES_ALL, |_, req| async move {
        match req {
            Request::Read { from, .. } => {
                let StartPosition::Offset(o) = from else {
                    panic!("expected an offset")
                };
                Response::Records {
                    start_offset: 0,
                    next_offset: o + 1,
                    end_offset: o + 1,
                    records: vec![record(o)],
                }
                .into()
            }
            other => panic!("unexpected {other:?}"),
        }
    })
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    let sub = client.subscribe("t", "n", "s", 0, StartPosition::Offset(3));
    let offsets: Vec<u64> = sub.take(3).map(|r| r.unwrap().offset).collect().await;
    assert_eq!(offsets, vec![3, 4, 5]);
}

#[tokio::test]
async fn oversized_requests_are_refused_before_sending() {
    let fake = Fake::start(1, FEATURES_ALL, |_, req| async move {
        panic!("nothing should be sent, got {req:?}")
    })
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    let big = vec![0u8; felix_wire::DEFAULT_MAX_FRAME_BYTES as usize + 1];
    let err = client.publish("t", "n", "s", 0, big).await.unwrap_err();
    assert!(matches!(err, ClientError::InvalidArgument(_)), "{err:?}");
    // A batch past the 4 GiB a frame can describe (its records share one
    // buffer) is an error, not a panic and a 4 GiB allocation.
    let chunk = bytes::Bytes::from(vec![7u8; 1 << 20]);
    let records = (0..4100)
        .map(|_| felix_client::RecordIn {
            payload: chunk.clone(),
            ..Default::default()
        })
        .collect();
    let err = client
        .publish_batch("t", "n", "s", 0, records)
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::InvalidArgument(_)), "{err:?}");
    // More records than a request may carry: refused here, not by the
    // broker's decoder.
    let records = (0..felix_wire::MAX_ITEMS_PER_VEC + 1)
        .map(|_| felix_client::RecordIn::default())
        .collect();
    let err = client
        .publish_batch("t", "n", "s", 0, records)
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::InvalidArgument(_)), "{err:?}");
    let err = client
        .group_poll_as(
            "t",
            "n",
            "s",
            0,
            "g",
            &GroupMember::new(""),
            GroupPollOptions::default(),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::InvalidArgument(_)), "{err:?}");
}

#[tokio::test]
async fn token_and_name_go_in_hello_and_unauthorized_fails_connect() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = bytes::BytesMut::new();
        let (id, req) = loop {
            s.read_buf(&mut buf).await.unwrap();
            if let Some(f) = felix_wire::decode_request(&mut buf, 1 << 20).unwrap() {
                break f;
            }
        };
        let Request::Hello {
            token, client_name, ..
        } = req
        else {
            panic!("expected HELLO")
        };
        assert_eq!(token.as_deref(), Some("secret"));
        assert_eq!(client_name, "tester");
        let mut out = bytes::BytesMut::new();
        felix_wire::encode_response(
            id,
            &Response::Error(WireError::new(ErrorCode::Unauthorized, "bad token")),
            &mut out,
        );
        s.write_all(&out).await.unwrap();
    });
    let err = Client::connect(
        addr,
        ClientConfig {
            token: Some("secret".into()),
            client_name: "tester".into(),
            ..config()
        },
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::Unauthorized));
}

#[tokio::test]
async fn pipelined_publishes_go_out_in_order() {
    let fake = Fake::start(1, FEATURES_ALL, |_, req| async move {
        match req {
            Request::Publish { records, .. } => {
                let n: u64 = std::str::from_utf8(records.iter().next().unwrap().payload)
                    .unwrap()
                    .parse()
                    .unwrap();
                // Answer out of order.
                tokio::time::sleep(Duration::from_millis((n * 7919) % 40)).await;
                Response::Published {
                    shard: 0,
                    base_offset: n * 10,
                    count: records.len() as u32,
                }
                .into()
            }
            other => panic!("unexpected {other:?}"),
        }
    })
    .await;
    let client = Client::connect(fake.addr, config()).await.unwrap();
    let mut pending = std::collections::VecDeque::new();
    let mut answers = Vec::new();
    for n in 0..40u64 {
        let records = vec![felix_client::RecordIn {
            payload: Bytes::from(n.to_string()),
            ..Default::default()
        }];
        pending.push_back(
            client
                .begin_publish_batch("t", "n", "s", 0, records)
                .await
                .unwrap(),
        );
        if pending.len() >= 4 {
            answers.push(pending.pop_front().unwrap().await.unwrap().base_offset);
        }
    }
    for p in pending {
        answers.push(p.await.unwrap().base_offset);
    }
    assert_eq!(answers, (0..40).map(|n| n * 10).collect::<Vec<_>>());
    let sent: Vec<String> = fake
        .requests()
        .iter()
        .map(|s| match &s.request {
            Request::Publish { records, .. } => {
                String::from_utf8(records.iter().next().unwrap().payload.to_vec()).unwrap()
            }
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(sent, (0..40).map(|n| n.to_string()).collect::<Vec<_>>());
}

/// A broker that completes HELLO and then drops every connection before
/// answering is not reconnected to in a tight loop: such a connection
/// counts as a failed attempt, so the backoff keeps growing.
#[tokio::test]
async fn connections_dropped_before_any_answer_back_off() {
    let fake = Fake::start(1, FEATURES_ALL, |_, _| async { Action::Close }).await;
    let cfg = ClientConfig {
        reconnect_backoff_initial: Duration::from_millis(50),
        reconnect_backoff_max: Duration::from_millis(400),
        ..config()
    };
    let client = Client::connect(fake.addr, cfg).await.unwrap();
    let until = std::time::Instant::now() + Duration::from_secs(1);
    let mut calls = 0;
    while std::time::Instant::now() < until {
        assert!(client.ping().await.is_err());
        calls += 1;
    }
    let hellos = fake.count(|r| matches!(r, Request::Hello { .. }));
    // 50 + 100 + 200 + 400 + 400 ms of backoff fit in a second: about six.
    assert!(
        hellos <= 8,
        "{hellos} connections in a second ({calls} calls)"
    );
}

/// Pointed at something that answers HTTP (the broker's metrics port, the
/// likeliest mix-up), `connect` says so instead of quoting a frame length.
#[tokio::test]
async fn connecting_to_an_http_port_says_so() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = [0u8; 256];
        let _ = s.read(&mut buf).await;
        let _ = s
            .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            .await;
        // Held open: the client decides from what it got.
        tokio::time::sleep(Duration::from_secs(5)).await;
    });
    let err = Client::connect(addr, ClientConfig::default())
        .await
        .expect_err("an HTTP server is no broker");
    let msg = err.to_string();
    assert!(msg.contains("not a Felix broker"), "{msg}");
    assert!(msg.contains("metrics port"), "{msg}");
}
