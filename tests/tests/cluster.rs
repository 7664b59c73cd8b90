//! Three `felix serve` processes in a cluster on loopback: every shard is
//! replicated on all three and served by its elected leader. Publishes go
//! through `ClusterClient`; the leader is killed with `kill -9`; the
//! cluster elects another, every acknowledged record is still there at its
//! offset, publishing carries on, and the killed broker comes back and
//! catches up.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use felix_client::{
    Client, ClientConfig, ClientError, ClusterClient, ErrorCode, RecordIn, StartPosition,
    StreamOptions,
};
use felix_tests::{start_broker, Broker, BrokerOptions};

const T: &str = "t1";
const NS: &str = "ha";
const S: &str = "events";
const SHARDS: u32 = 2;

fn free_ports(n: usize) -> Vec<u16> {
    // Held together so no two are the same, then let go for the brokers.
    let held: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    held.iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

struct Cluster {
    brokers: Vec<Broker>,
    addrs: Vec<String>,
}

fn start_cluster() -> Cluster {
    let ports = free_ports(6);
    let addrs: Vec<String> = (0..3).map(|i| format!("127.0.0.1:{}", ports[i])).collect();
    let nodes = (0..3)
        .map(|i| format!("{}={}/127.0.0.1:{}", i + 1, addrs[i], ports[3 + i]))
        .collect::<Vec<_>>()
        .join(",");
    let brokers = (0..3)
        .map(|i| {
            start_broker!(BrokerOptions::default()
                .cores(1)
                .listen(&addrs[i])
                .env("FELIX_NODE_ID", i + 1)
                .env("FELIX_CLUSTER_NODES", &nodes))
        })
        .collect();
    Cluster { brokers, addrs }
}

fn record(shard: u32, n: u64) -> RecordIn {
    RecordIn {
        payload: format!("s{shard}-r{n}").into_bytes().into(),
        ..RecordIn::default()
    }
}

/// Every record of `shard` as `c` has it: offset → payload.
async fn read_all(c: &Client, shard: u32) -> BTreeMap<u64, String> {
    let mut out = BTreeMap::new();
    let mut from = StartPosition::Earliest;
    loop {
        let batch = c.read(T, NS, S, shard, from, 1000, None).await.unwrap();
        for r in &batch.records {
            out.insert(r.offset, String::from_utf8(r.payload.to_vec()).unwrap());
        }
        if batch.records.is_empty() || batch.next_offset >= batch.end_offset {
            return out;
        }
        from = StartPosition::Offset(batch.next_offset);
    }
}

/// Publish `n` batches of 5 to each shard through the cluster client;
/// returns what was acknowledged: (shard, offset) → payload.
async fn publish_some(
    cc: &ClusterClient,
    first: u64,
    n: u64,
    acked: &mut BTreeMap<(u32, u64), String>,
) {
    for b in first..first + n {
        for shard in 0..SHARDS {
            let batch: Vec<RecordIn> = (0..5).map(|k| record(shard, b * 5 + k)).collect();
            let p = cc
                .publish_batch(T, NS, S, shard, batch.clone())
                .await
                .unwrap_or_else(|e| panic!("batch {b} to shard {shard}: {e}"));
            assert_eq!(p.count, 5);
            for (k, r) in batch.iter().enumerate() {
                acked.insert(
                    (shard, p.base_offset + k as u64),
                    String::from_utf8(r.payload.to_vec()).unwrap(),
                );
            }
        }
    }
}

#[test]
fn a_cluster_keeps_every_acknowledged_record_through_the_loss_of_its_leader() {
    let mut cluster = start_cluster();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let cc = ClusterClient::connect(&cluster.addrs, ClientConfig::default())
            .await
            .unwrap();
        cc.create_stream(T, NS, S, SHARDS, StreamOptions::default())
            .await
            .unwrap();
        // Created again (a create that was interrupted): left as it is.
        cc.create_stream(T, NS, S, SHARDS, StreamOptions::default())
            .await
            .unwrap();
        let mut acked = BTreeMap::new();
        publish_some(&cc, 0, 20, &mut acked).await;

        // A broker in a cluster does not offer consumer groups yet, and says so.
        let direct = Client::connect(cluster.addrs[0].as_str(), ClientConfig::default())
            .await
            .unwrap();
        assert!(!direct.has_feature(felix_client::FEATURE_GROUPS));

        // A follower refuses a publish, naming the leader.
        let leader = cc.leader_of(T, NS, S, 0).expect("a leader is known");
        let follower = cluster
            .addrs
            .iter()
            .find(|a| **a != leader)
            .unwrap()
            .clone();
        let f = Client::connect(follower.as_str(), ClientConfig::default())
            .await
            .unwrap();
        match f.publish(T, NS, S, 0, "to a follower").await {
            Err(ClientError::NotLeader {
                leader: Some(named),
                ..
            }) => assert_eq!(named, leader),
            other => panic!("expected not_leader naming {leader}, got {other:?}"),
        }
        // Reads are served by any replica, of what is committed.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let got = read_all(&f, 0).await;
            if got.len() == acked.keys().filter(|(s, _)| *s == 0).count() {
                break;
            }
            assert!(Instant::now() < deadline, "the follower catches up");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        // kill -9 the leader of shard 0.
        let dead = cluster.addrs.iter().position(|a| *a == leader).unwrap();
        cluster.brokers[dead].kill9();
        publish_some(&cc, 20, 20, &mut acked).await;
        let new_leader = cc.leader_of(T, NS, S, 0).unwrap();
        assert_ne!(new_leader, leader, "another broker leads now");

        // Every acknowledged record, at its offset, on the new leader.
        let nl = Client::connect(new_leader.as_str(), ClientConfig::default())
            .await
            .unwrap();
        for shard in 0..SHARDS {
            let got = read_all(&nl, shard).await;
            for ((s, off), payload) in acked.iter().filter(|((s, _), _)| *s == shard) {
                assert_eq!(
                    got.get(off),
                    Some(payload),
                    "shard {s} offset {off} was acknowledged"
                );
            }
            // Nothing but acknowledged records (no publish was retried here
            // after a lost answer).
            assert_eq!(
                got.len(),
                acked.keys().filter(|(s, _)| *s == shard).count(),
                "shard {shard}: no record twice, none unacknowledged"
            );
        }

        // The killed broker comes back and catches up from the others.
        cluster.brokers[dead].restart();
        let back = Client::connect(cluster.addrs[dead].as_str(), ClientConfig::default())
            .await
            .unwrap();
        for shard in 0..SHARDS {
            let want = read_all(&nl, shard).await;
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let got = read_all(&back, shard).await;
                if got == want {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "shard {shard}: the restarted broker holds {} records, the leader {}",
                    got.len(),
                    want.len()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        // Groups are refused with a clear error rather than half served:
        // the client does not send what the broker does not advertise, and
        // the broker answers one sent anyway with `unsupported`.
        let err = direct
            .group_describe(T, NS, S, 0, "workers")
            .await
            .unwrap_err();
        assert!(matches!(err, ClientError::Unsupported(_)), "{err}");
        let mut raw = tokio::net::TcpStream::connect(cluster.addrs[dead].as_str())
            .await
            .unwrap();
        let hello = felix_wire::Request::Hello {
            version: felix_wire::PROTOCOL_VERSION,
            features: felix_wire::FEATURES_ALL,
            want_core: None,
            client_name: "cluster-test".into(),
            token: None,
        };
        assert!(matches!(
            felix_tests::raw_call(&mut raw, 1, &hello).await,
            felix_wire::Response::HelloOk { .. }
        ));
        let describe = felix_wire::Request::GroupDescribe {
            key: felix_wire::GroupKey {
                stream: felix_wire::StreamRef::new(T, NS, S),
                shard: 0,
                group: "workers".into(),
            },
        };
        match felix_tests::raw_call(&mut raw, 2, &describe).await {
            felix_wire::Response::Error(e) => assert_eq!(e.code, ErrorCode::Unsupported, "{e}"),
            other => panic!("expected unsupported, got {other:?}"),
        }
    });
}
