//! Three `felix serve` processes in a cluster on loopback: every shard is
//! replicated on all three and served by its elected leader. Publishes go
//! through `ClusterClient`; the leader is killed with `kill -9`; the
//! cluster elects another, every acknowledged record is still there at its
//! offset, publishing carries on, and the killed broker comes back and
//! catches up.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use felix_client::{
    Client, ClientConfig, ClientError, ClusterClient, RecordIn, ShardedGroup, StartPosition,
    StreamOptions,
};
use felix_tests::partition::Partition;
use felix_tests::{free_ports, start_broker, Broker, BrokerOptions};

const T: &str = "t1";
const NS: &str = "ha";
const S: &str = "events";
const SHARDS: u32 = 2;

struct Cluster {
    brokers: Vec<Broker>,
    addrs: Vec<String>,
    /// The relays between the brokers, for a cluster that can be cut.
    net: Option<Partition>,
    /// Holds the cluster's secret file.
    _secret: tempfile::TempDir,
}

fn start_cluster() -> Cluster {
    start_cluster_with(&[])
}

fn start_cluster_with(env: &[(&str, &str)]) -> Cluster {
    start_cluster_on(env, false)
}

/// Three brokers; with `cuttable`, each dials the others through relays
/// ([`Partition`]) the test can cut.
fn start_cluster_on(env: &[(&str, &str)], cuttable: bool) -> Cluster {
    let ports = free_ports(6);
    let addrs: Vec<String> = (0..3).map(|i| format!("127.0.0.1:{}", ports[i])).collect();
    let real: Vec<std::net::SocketAddr> = (0..3)
        .map(|i| format!("127.0.0.1:{}", ports[3 + i]).parse().unwrap())
        .collect();
    let net = cuttable.then(|| Partition::new(&real));
    // The brokers prove themselves to each other with a shared secret.
    let secret = tempfile::tempdir().unwrap();
    let secret_file = secret.path().join("cluster.secret");
    std::fs::write(&secret_file, "a secret for the cluster tests\n").unwrap();
    std::fs::set_permissions(
        &secret_file,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    // Broker `x`'s view: its own replication address, and a relay (or the
    // real address) for each other broker.
    let nodes = |x: usize| {
        (0..3)
            .map(|y| {
                let peer = net.as_ref().map_or(real[y], |n| n.address(x, y));
                format!("{}={}/{peer}", y + 1, addrs[y])
            })
            .collect::<Vec<_>>()
            .join(",")
    };
    let brokers = (0..3)
        .map(|i| {
            let mut o = BrokerOptions::default()
                .cores(1)
                .listen(&addrs[i])
                .env("FELIX_NODE_ID", i + 1)
                .env("FELIX_CLUSTER_NODES", nodes(i))
                .env("FELIX_CLUSTER_SECRET_FILE", secret_file.display())
                // Compaction at work throughout: small journal segments,
                // and a log compacted once 8 entries can go.
                .env("FELIX_CLUSTER_COMPACT_ENTRIES", 8)
                .env("FELIX_CLUSTER_JOURNAL_SEGMENT_BYTES", 16 << 10);
            for (k, v) in env {
                o = o.env(k, v);
            }
            start_broker!(o)
        })
        .collect();
    Cluster {
        brokers,
        addrs,
        net,
        _secret: secret,
    }
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

/// Wait (up to 20 s) until `back`, a broker that was down, holds every
/// record of `shard` that `leader` holds (as `leader` has them now).
async fn catches_up(back: &Client, leader: &Client, shard: u32) {
    let want = read_all(leader, shard).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got = read_all(back, shard).await;
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "shard {shard}: the broker that was down holds {} records, the leader {}",
            got.len(),
            want.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
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

        // A follower refuses a publish, naming the leader.
        let leader = cc.leader_of(T, NS, S, 0).expect("a leader is known");
        // Who leads shows in each broker's metrics.
        let labels = [("stream", "t1/ha/events"), ("shard", "0")];
        for (i, b) in cluster.brokers.iter().enumerate() {
            let leads = cluster.addrs[i] == leader;
            assert_eq!(
                b.metric_series("felix_replica_leader", &labels),
                Some(if leads { 1.0 } else { 0.0 }),
                "broker {i}"
            );
            assert!(b.metric_series("felix_replica_term", &labels).unwrap() >= 1.0);
        }
        // Every replica compacts its Raft log (8 entries at a time here):
        // the entries leave memory, and whole journal segments the disk.
        for (i, b) in cluster.brokers.iter().enumerate() {
            let compacted = || {
                b.metric_series("felix_replica_compacted_index", &labels)
                    .unwrap_or(0.0)
            };
            felix_tests::wait_until(Duration::from_secs(10), || compacted() >= 10.0)
                .unwrap_or_else(|_| panic!("broker {i} compacted only to {}", compacted()));
            let held = b
                .metric_series("felix_replica_log_entries", &labels)
                .unwrap();
            assert!(
                held < 20.0,
                "broker {i} holds {held} entries past its point"
            );
        }
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
            catches_up(&back, &nl, shard).await;
        }
        // Having caught up, it compacts past where it was killed.
        publish_some(&cc, 40, 4, &mut acked).await;
        let b = &cluster.brokers[dead];
        felix_tests::wait_until(Duration::from_secs(10), || {
            b.metric_series("felix_replica_compacted_index", &labels)
                .unwrap_or(0.0)
                >= 30.0
        })
        .expect("the restarted broker compacts");
    });
}

/// Every broker describes its own replica of a shard: one leader, in the
/// term the others follow, named by them with its client address; every
/// commit and applied index reaches the leader's last entry; the leader
/// reports each follower holding it. After the leader is killed the two
/// left agree on a new one in a later term, and the dead one's place says
/// it did not answer.
#[test]
fn every_broker_describes_its_replica_and_names_the_leader() {
    use felix_client::ReplicaRole;
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
        let mut acked = BTreeMap::new();
        publish_some(&cc, 0, 6, &mut acked).await;
        // Settled: every broker answers, in one term, naming one leader
        // that says it leads; followers learn the commit with the next
        // heartbeat, and the leader hears what each holds. (A busy machine
        // can hold up heartbeats long enough for another election: then
        // it settles again, in the new term.)
        let deadline = Instant::now() + Duration::from_secs(20);
        let answers = loop {
            let answers = cc.describe_replicas(T, NS, S, 0).await;
            let infos: Vec<_> = answers
                .iter()
                .filter_map(|(_, r)| r.as_ref().ok())
                .collect();
            let settled = infos.len() == 3 && {
                let last = infos.iter().map(|i| i.last_index).max().unwrap();
                let leaders = infos
                    .iter()
                    .filter(|i| i.role == ReplicaRole::Leader)
                    .count();
                leaders == 1
                    && infos.iter().all(|i| {
                        i.term == infos[0].term
                            && i.leader == infos[0].leader
                            && i.commit == last
                            && i.applied == last
                            && i.peers.iter().all(|p| p.matched == last)
                    })
            };
            if settled {
                break answers;
            }
            assert!(
                Instant::now() < deadline,
                "replicas never settled: {answers:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let term = answers[0].1.as_ref().unwrap().term;
        let leader_node = answers[0].1.as_ref().unwrap().leader.unwrap();
        let leader = cluster.addrs[leader_node as usize - 1].clone();
        for (i, (broker, r)) in answers.iter().enumerate() {
            let r = r.as_ref().unwrap();
            assert_eq!(*broker, cluster.addrs[i], "in the order given");
            assert_eq!(r.node, i as u64 + 1, "{broker} is node {}", i + 1);
            assert_eq!((r.stream.stream.as_str(), r.shard), (S, 0));
            assert_eq!(r.term, term, "{broker}: one term");
            assert_eq!(r.leader, Some(leader_node), "{broker} names the leader");
            assert_eq!(r.leader_addr.as_deref(), Some(leader.as_str()));
            assert_eq!(r.stopped, None);
            // Six batches and the leader's generation start, at least.
            assert!(r.last_index >= 7, "{broker}: {r:?}");
            if r.node == leader_node {
                assert_eq!(r.role, ReplicaRole::Leader);
                let mut peers: Vec<u64> = r.peers.iter().map(|p| p.node).collect();
                peers.sort_unstable();
                let others: Vec<u64> = (1..=3).filter(|n| *n != leader_node).collect();
                assert_eq!(peers, others, "the leader reports each follower");
                for p in &r.peers {
                    assert_eq!(p.matched, r.last_index, "node {} holds everything", p.node);
                }
            } else {
                assert_eq!(r.role, ReplicaRole::Follower, "{broker}");
                assert!(r.peers.is_empty(), "only the leader reports peers");
            }
        }

        // kill -9 the leader: the others elect one of themselves, later.
        let dead = leader_node as usize - 1;
        cluster.brokers[dead].kill9();
        publish_some(&cc, 6, 2, &mut acked).await;
        let new_leader = cc.leader_of(T, NS, S, 0).unwrap();
        assert_ne!(new_leader, leader);
        let new_node = cluster.addrs.iter().position(|a| *a == new_leader).unwrap() as u64 + 1;
        let answers = cc.describe_replicas(T, NS, S, 0).await;
        assert!(
            answers[dead].1.is_err(),
            "the killed broker answers nothing"
        );
        for (broker, r) in answers.iter().filter(|(b, _)| *b != leader) {
            let r = r.as_ref().unwrap();
            assert!(r.term > term, "{broker}: a later term");
            assert_eq!(r.leader, Some(new_node), "{broker}");
            assert_eq!(r.leader_addr.as_deref(), Some(new_leader.as_str()));
            let role = if r.node == new_node {
                ReplicaRole::Leader
            } else {
                ReplicaRole::Follower
            };
            assert_eq!(r.role, role, "{broker}");
        }
    });
}

/// Brokers of a cluster killed with `kill -9` one after another (the
/// leader of shard 0 every other round) while a producer publishes through
/// `ClusterClient`: at the end every broker holds the same records, every
/// acknowledged record is at the offset its acknowledgement gave, and no
/// record is one the producer never sent. (A publish whose answer was lost
/// is sent again, so a record may be there twice: at least once.)
/// `FELIX_CLUSTER_SOAK_ROUNDS` sets the rounds (default 4).
#[test]
fn acknowledged_records_survive_brokers_killed_one_after_another() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    let rounds: usize = std::env::var("FELIX_CLUSTER_SOAK_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let mut cluster = start_cluster();
    let addrs = cluster.addrs.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let cc = ClusterClient::connect(&addrs, ClientConfig::default())
            .await
            .unwrap();
        cc.create_stream(T, NS, S, SHARDS, StreamOptions::default())
            .await
            .unwrap();
    });
    let acked: Arc<Mutex<BTreeMap<(u32, u64), String>>> = Arc::default();
    let sent: Arc<Mutex<std::collections::BTreeSet<String>>> = Arc::default();
    let leader0: Arc<Mutex<Option<String>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let (acked, sent, leader0, stop, addrs) = (
            acked.clone(),
            sent.clone(),
            leader0.clone(),
            stop.clone(),
            addrs.clone(),
        );
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let config = ClientConfig {
                    request_timeout: Duration::from_secs(3),
                    connect_timeout: Duration::from_secs(1),
                    ..ClientConfig::default()
                };
                let cc = ClusterClient::connect(&addrs, config).await.unwrap();
                let mut n = 0u64;
                let mut failed = 0;
                while !stop.load(Ordering::SeqCst) {
                    let shard = (n % u64::from(SHARDS)) as u32;
                    let batch: Vec<RecordIn> = (0..10).map(|k| record(shard, n * 10 + k)).collect();
                    {
                        let mut s = sent.lock().unwrap();
                        for r in &batch {
                            s.insert(String::from_utf8(r.payload.to_vec()).unwrap());
                        }
                    }
                    match cc.publish_batch(T, NS, S, shard, batch.clone()).await {
                        Ok(p) => {
                            let mut a = acked.lock().unwrap();
                            for (k, r) in batch.iter().enumerate() {
                                a.insert(
                                    (shard, p.base_offset + k as u64),
                                    String::from_utf8(r.payload.to_vec()).unwrap(),
                                );
                            }
                        }
                        Err(_) => failed += 1,
                    }
                    *leader0.lock().unwrap() = cc.leader_of(T, NS, S, 0);
                    n += 1;
                }
                (n, failed)
            })
        })
    };
    // Paced by the producer's progress, not by the clock: each step waits
    // until 50 more records were acknowledged (which, after a kill, means
    // the cluster failed over).
    let progress = |what: &str| {
        let from = acked.lock().unwrap().len();
        felix_tests::wait_until(Duration::from_secs(30), || {
            acked.lock().unwrap().len() >= from + 50
        })
        .unwrap_or_else(|_| panic!("no progress {what} ({from} acknowledged)"));
    };
    let mut rng_state = 0x9E37_79B9_7F4A_7C15u64;
    for round in 0..rounds {
        progress("before a kill");
        let victim = if round % 2 == 0 {
            let l = leader0.lock().unwrap().clone();
            l.and_then(|l| addrs.iter().position(|a| *a == l))
                .unwrap_or(0)
        } else {
            rng_state ^= rng_state << 13;
            rng_state ^= rng_state >> 7;
            rng_state ^= rng_state << 17;
            (rng_state % 3) as usize
        };
        cluster.brokers[victim].kill9();
        progress("with a broker down");
        cluster.brokers[victim].restart();
    }
    progress("after the last restart");
    stop.store(true, Ordering::SeqCst);
    let (batches, failed) = producer.join().unwrap();
    let acked = acked.lock().unwrap().clone();
    let sent = sent.lock().unwrap().clone();
    assert!(
        acked.len() >= 100,
        "{} records acknowledged in {batches} batches ({failed} failed)",
        acked.len()
    );
    rt.block_on(async {
        let clients: Vec<Client> = {
            let mut v = Vec::new();
            for a in &addrs {
                v.push(
                    Client::connect(a.as_str(), ClientConfig::default())
                        .await
                        .unwrap(),
                );
            }
            v
        };
        for shard in 0..SHARDS {
            // Every broker converges on the same records.
            let deadline = Instant::now() + Duration::from_secs(30);
            let all = loop {
                let mut views = Vec::new();
                for c in &clients {
                    views.push(read_all(c, shard).await);
                }
                if views.windows(2).all(|w| w[0] == w[1]) {
                    break views.swap_remove(0);
                }
                assert!(
                    Instant::now() < deadline,
                    "shard {shard}: the brokers hold {:?} records and do not converge",
                    views.iter().map(BTreeMap::len).collect::<Vec<_>>()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            for ((_, off), payload) in acked.iter().filter(|((s, _), _)| *s == shard) {
                assert_eq!(
                    all.get(off),
                    Some(payload),
                    "shard {shard}: acknowledged offset {off} lost or changed"
                );
            }
            for (off, payload) in &all {
                assert!(
                    sent.contains(payload),
                    "shard {shard} offset {off}: {payload:?} was never sent"
                );
            }
        }
    });
}

/// A consumer group on a replicated shard: served by the leader, its
/// position and dead letters replicated; after a `kill -9` of the leader
/// the new one lists the dead letters, still owes the record redriven
/// before the failover, and resumes from the durable position (what was
/// acknowledged above it, and the claims, were the old leader's memory).
#[test]
fn a_group_resumes_from_its_durable_position_on_a_new_leader() {
    let mut cluster = start_cluster();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let cc = ClusterClient::connect(&cluster.addrs, ClientConfig::default())
            .await
            .unwrap();
        cc.create_stream(T, NS, S, 1, StreamOptions::default())
            .await
            .unwrap();
        let mut acked = BTreeMap::new();
        for b in 0..4 {
            let batch: Vec<RecordIn> = (0..5).map(|k| record(0, b * 5 + k)).collect();
            let p = cc.publish_batch(T, NS, S, 0, batch).await.unwrap();
            acked.insert(b, p.base_offset);
        }
        let g = "workers";
        cc.group_create(T, NS, S, 0, g, StartPosition::Earliest)
            .await
            .unwrap();
        // (The leader's generation start takes an offset that a poll
        // settles without delivering: it can come back with one fewer.)
        let got = cc.group_poll(T, NS, S, 0, g, 10).await.unwrap();
        assert!(got.len() >= 6, "{} records", got.len());
        let offsets: Vec<u64> = got.iter().map(|r| r.offset).collect();
        // Dead-letter the third; dead-letter the fifth and redrive it (owed
        // again, below the cursor: a redrive never moves it back); leave
        // the seventh claimed; ack the rest. The cursor stops at the
        // seventh, and the acks above it are the leader's memory.
        for (i, r) in got.iter().enumerate() {
            match i {
                2 | 4 => cc.group_dead_letter(T, NS, S, 0, g, r).await.unwrap(),
                6 => {}
                _ => cc.group_ack(T, NS, S, 0, g, r.offset).await.unwrap(),
            }
        }
        cc.group_redrive(T, NS, S, 0, g, offsets[4]).await.unwrap();
        let before = cc.group_describe(T, NS, S, 0, g).await.unwrap();
        assert_eq!(
            before.position, offsets[6],
            "the cursor stops at the claimed record"
        );
        assert_eq!(
            cc.group_dead_letters(T, NS, S, 0, g).await.unwrap(),
            vec![offsets[2]]
        );

        // A follower serves no group call: it names the leader.
        let leader = cc.leader_of(T, NS, S, 0).unwrap();
        let follower = cluster
            .addrs
            .iter()
            .find(|a| **a != leader)
            .unwrap()
            .clone();
        let f = Client::connect(follower.as_str(), ClientConfig::default())
            .await
            .unwrap();
        for r in [
            f.group_describe(T, NS, S, 0, g).await.map(|_| ()),
            f.group_poll(T, NS, S, 0, g, 1).await.map(|_| ()),
        ] {
            match r {
                Err(ClientError::NotLeader {
                    leader: Some(named),
                    ..
                }) => assert_eq!(named, leader),
                other => panic!("expected not_leader naming {leader}, got {other:?}"),
            }
        }

        // The leader dies.
        let dead = cluster.addrs.iter().position(|a| *a == leader).unwrap();
        cluster.brokers[dead].kill9();
        let after = cc.group_describe(T, NS, S, 0, g).await.unwrap();
        assert_ne!(cc.leader_of(T, NS, S, 0).unwrap(), leader);
        assert_eq!(
            after.position, before.position,
            "the durable position survived"
        );
        assert_eq!(after.in_flight, 0, "claims were the old leader's memory");
        assert_eq!(
            cc.group_dead_letters(T, NS, S, 0, g).await.unwrap(),
            vec![offsets[2]],
            "the dead letter survived, the redriven one is not listed"
        );
        let again = cc.group_poll(T, NS, S, 0, g, 100).await.unwrap();
        let again: Vec<u64> = again.iter().map(|r| r.offset).collect();
        assert_eq!(
            again.first(),
            Some(&offsets[4]),
            "the record redriven before the failover is owed, and goes first: {again:?}"
        );
        assert!(
            again[1..].iter().all(|&o| o >= offsets[6]),
            "nothing else below the durable position: {again:?}"
        );
        for o in &offsets[6..] {
            assert!(
                again.contains(o),
                "claimed or acked above the cursor: delivered again ({o}): {again:?}"
            );
        }
        let total: usize = 20;
        assert_eq!(again.len(), 1 + total - 6, "{again:?}");
        // And the group goes on: ack everything, the cursor reaches the end.
        for o in &again {
            cc.group_ack(T, NS, S, 0, g, *o).await.unwrap();
        }
        // (A poll moves the cursor over the new leader's generation start,
        // which is never delivered.)
        assert!(cc.group_poll(T, NS, S, 0, g, 10).await.unwrap().is_empty());
        let done = cc.group_describe(T, NS, S, 0, g).await.unwrap();
        assert_eq!(done.lag(), 0, "{done:?}");

        // The killed broker comes back (its log's group entries skipped as
        // its replica applies them again), and then the current leader
        // dies: whichever of the two left leads, the group is where it was.
        cluster.brokers[dead].restart();
        let back = Client::connect(cluster.addrs[dead].as_str(), ClientConfig::default())
            .await
            .unwrap();
        let want = read_all(&back, 0).await.len();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let nl = cc.leader_of(T, NS, S, 0).unwrap();
            let c = Client::connect(nl.as_str(), ClientConfig::default())
                .await
                .unwrap();
            if read_all(&back, 0).await == read_all(&c, 0).await {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the restarted broker catches up ({want})"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let second = cc.leader_of(T, NS, S, 0).unwrap();
        let second = cluster.addrs.iter().position(|a| *a == second).unwrap();
        cluster.brokers[second].kill9();
        // Where it was: past every record (the newest leader's generation
        // start past its saved position is no lag).
        let last = cc.group_describe(T, NS, S, 0, g).await.unwrap();
        assert_eq!(last.lag(), 0, "{last:?}");
        assert!(last.position >= done.position, "{last:?}");
        assert_eq!(
            cc.group_dead_letters(T, NS, S, 0, g).await.unwrap(),
            vec![offsets[2]]
        );
        assert!(cc.group_poll(T, NS, S, 0, g, 10).await.unwrap().is_empty());
    });
}

/// A stream a single broker wrote is not taken into a cluster: its shard
/// refuses requests, saying why, rather than let the cluster's entries
/// land on offsets its records already hold.
#[test]
fn a_stream_written_before_joining_a_cluster_is_refused_not_mixed() {
    let mut single = start_broker!(BrokerOptions::default().cores(1));
    let data_dir = single.data_dir().unwrap().to_path_buf();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let c = Client::connect(single.addr.as_str(), ClientConfig::default())
            .await
            .unwrap();
        c.create_stream(T, NS, S, 1, StreamOptions::default())
            .await
            .unwrap();
        c.publish(T, NS, S, 0, "written alone").await.unwrap();
    });
    single.terminate();
    // The same data directory, now as the one node of a cluster.
    let ports = free_ports(2);
    let addr = format!("127.0.0.1:{}", ports[0]);
    let mut cmd = felix_tests::broker_command!(Some(data_dir.as_path()), &addr);
    cmd.env("FELIX_NODE_ID", "1").env(
        "FELIX_CLUSTER_NODES",
        format!("1={addr}/127.0.0.1:{}", ports[1]),
    );
    let (mut child, announced) = felix_tests::spawn_announcing(cmd);
    rt.block_on(async {
        let c = Client::connect(announced.as_str(), ClientConfig::default())
            .await
            .unwrap();
        let err = c.publish(T, NS, S, 0, "in the cluster").await.unwrap_err();
        assert_eq!(err.kind(), "unavailable", "{err}");
        assert!(
            err.message()
                .contains("before this broker joined a cluster"),
            "{err}"
        );
        // The broker serves a stream created in the cluster.
        c.create_stream(T, NS, "fresh", 1, StreamOptions::default())
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match c.publish(T, NS, "fresh", 0, "replicated").await {
                Ok(_) => break,
                Err(e) => assert!(Instant::now() < deadline, "{e}"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    let _ = child.kill();
    let _ = child.wait();
}

/// A consumer group worked while brokers are killed one after another
/// (the leader every other round): a producer publishes, a consumer polls
/// and acknowledges, dead-lettering a fixed tenth of the records. Claims,
/// acks above the cursor and answers are lost at each failover; nothing
/// else may be. At the end, once the group has drained: every
/// acknowledged record was finished (the group's position is past it) or
/// is listed dead, and the dead letters are exactly the records the
/// consumer gave up on: never neither, never a record the consumer
/// finished. `FELIX_CLUSTER_SOAK_ROUNDS` sets the rounds (default 4).
#[test]
fn a_group_loses_nothing_while_brokers_are_killed_one_after_another() {
    use std::collections::BTreeSet;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    let rounds: usize = std::env::var("FELIX_CLUSTER_SOAK_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    // Redeliveries across failovers must not reach the attempt bound: the
    // only dead letters are the consumer's.
    let mut cluster = start_cluster_with(&[
        ("FELIX_GROUP_MAX_ATTEMPTS", "1000"),
        ("FELIX_GROUP_VISIBILITY_TIMEOUT_MS", "2000"),
    ]);
    let addrs = cluster.addrs.clone();
    const G: &str = "soak";
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let cc = ClusterClient::connect(&addrs, ClientConfig::default())
            .await
            .unwrap();
        cc.create_stream(T, NS, S, 1, StreamOptions::default())
            .await
            .unwrap();
        cc.group_create(T, NS, S, 0, G, StartPosition::Earliest)
            .await
            .unwrap();
    });
    // Gives up on the records whose number ends in 7.
    let doomed = |payload: &str| payload.ends_with('7');
    let published: Arc<Mutex<BTreeMap<u64, String>>> = Arc::default();
    let finished = Arc::new(AtomicUsize::new(0));
    let stop_producer = Arc::new(AtomicBool::new(false));
    let stop_consumer = Arc::new(AtomicBool::new(false));
    let leader: Arc<Mutex<Option<String>>> = Arc::default();
    let config = ClientConfig {
        request_timeout: Duration::from_secs(3),
        connect_timeout: Duration::from_secs(1),
        ..ClientConfig::default()
    };
    let producer = {
        let (published, stop, addrs, config) = (
            published.clone(),
            stop_producer.clone(),
            addrs.clone(),
            config.clone(),
        );
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let cc = ClusterClient::connect(&addrs, config).await.unwrap();
                let mut n = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    let batch: Vec<RecordIn> = (0..5).map(|k| record(0, n * 5 + k)).collect();
                    if let Ok(p) = cc.publish_batch(T, NS, S, 0, batch.clone()).await {
                        let mut m = published.lock().unwrap();
                        for (k, r) in batch.iter().enumerate() {
                            m.insert(
                                p.base_offset + k as u64,
                                String::from_utf8(r.payload.to_vec()).unwrap(),
                            );
                        }
                    }
                    n += 1;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            })
        })
    };
    let consumer = {
        let (finished, stop, leader, addrs, config) = (
            finished.clone(),
            stop_consumer.clone(),
            leader.clone(),
            addrs.clone(),
            config.clone(),
        );
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let cc = ClusterClient::connect(&addrs, config).await.unwrap();
                let mut gave_up = BTreeSet::new();
                while !stop.load(Ordering::SeqCst) {
                    let got = match cc
                        .group_poll_wait(T, NS, S, 0, G, 50, Duration::from_millis(100))
                        .await
                    {
                        Ok(g) => g,
                        Err(_) => continue,
                    };
                    *leader.lock().unwrap() = cc.leader_of(T, NS, S, 0);
                    for r in &got {
                        let payload = String::from_utf8(r.payload.to_vec()).unwrap();
                        let done = if doomed(&payload) {
                            let ok = cc.group_dead_letter(T, NS, S, 0, G, r).await.is_ok();
                            if ok {
                                gave_up.insert(r.offset);
                            }
                            ok
                        } else {
                            cc.group_ack(T, NS, S, 0, G, r.offset).await.is_ok()
                        };
                        if done {
                            finished.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
                gave_up
            })
        })
    };
    let progress = |what: &str| {
        let from = finished.load(Ordering::SeqCst);
        felix_tests::wait_until(Duration::from_secs(30), || {
            finished.load(Ordering::SeqCst) >= from + 50
        })
        .unwrap_or_else(|_| panic!("the group made no progress {what} ({from} finished)"));
    };
    let mut rng_state = 0x2545_F491_4F6C_DD1Du64;
    for round in 0..rounds {
        progress("before a kill");
        let victim = if round % 2 == 0 {
            let l = leader.lock().unwrap().clone();
            l.and_then(|l| addrs.iter().position(|a| *a == l))
                .unwrap_or(0)
        } else {
            rng_state ^= rng_state << 13;
            rng_state ^= rng_state >> 7;
            rng_state ^= rng_state << 17;
            (rng_state % 3) as usize
        };
        cluster.brokers[victim].kill9();
        progress("with a broker down");
        cluster.brokers[victim].restart();
    }
    stop_producer.store(true, Ordering::SeqCst);
    producer.join().unwrap();
    let published = published.lock().unwrap().clone();
    assert!(published.len() >= 100, "{} published", published.len());
    // Let the consumer drain the group.
    rt.block_on(async {
        let cc = ClusterClient::connect(&addrs, ClientConfig::default())
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(info) = cc.group_describe(T, NS, S, 0, G).await {
                if info.lag() == 0 && info.in_flight == 0 {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "the group does not drain");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    stop_consumer.store(true, Ordering::SeqCst);
    let gave_up = consumer.join().unwrap();
    rt.block_on(async {
        let cc = ClusterClient::connect(&addrs, ClientConfig::default())
            .await
            .unwrap();
        let info = cc.group_describe(T, NS, S, 0, G).await.unwrap();
        let dead: BTreeSet<u64> = cc
            .group_dead_letters(T, NS, S, 0, G)
            .await
            .unwrap()
            .into_iter()
            .collect();
        for (off, payload) in &published {
            assert!(
                *off < info.position,
                "offset {off} ({payload}) is not behind the drained group's position {}",
                info.position
            );
            if doomed(payload) {
                assert!(
                    dead.contains(off),
                    "offset {off} ({payload}) was given up on and is not listed dead"
                );
            } else {
                assert!(
                    !dead.contains(off),
                    "offset {off} ({payload}) was acknowledged, yet is listed dead"
                );
            }
        }
        // Every dead letter is a record the consumer gave up on (some of
        // them published, or given up on, with the answer lost).
        let leader = cc.leader_of(T, NS, S, 0).unwrap();
        let c = Client::connect(leader.as_str(), ClientConfig::default())
            .await
            .unwrap();
        let all = read_all(&c, 0).await;
        for off in &dead {
            let payload = all.get(off).map(String::as_str).unwrap_or("");
            assert!(
                doomed(payload),
                "dead letter {off} ({payload:?}) is no record the consumer gave up on"
            );
        }
        assert!(
            gave_up.iter().all(|o| dead.contains(o)),
            "every dead letter the consumer saw acknowledged is listed"
        );
    });
}

/// The group calls a consumer takes decisions with, on a cluster, across
/// a failover: an extension and a delayed nack are the leader's memory, so
/// the new leader hands those records out at once; a consumer dead letter
/// survives and can be redriven there; the `*_stream` calls make one call
/// per shard, each on its leader.
#[test]
fn claim_control_and_stream_calls_work_across_a_failover() {
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
        let mut acked = BTreeMap::new();
        publish_some(&cc, 0, 2, &mut acked).await;
        let g = "deciders";
        cc.group_create_stream(T, NS, S, g, StartPosition::Earliest)
            .await
            .unwrap();
        // An offset names a position in one shard: refused for two.
        assert!(matches!(
            cc.group_seek_stream(T, NS, S, g, StartPosition::Offset(3))
                .await,
            Err(ClientError::InvalidArgument(_))
        ));
        // Every record of shard 0 (ten; the leader's generation start is
        // settled, not delivered).
        let got = cc
            .group_poll_wait(T, NS, S, 0, g, 100, Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(got.len(), 10, "{got:?}");
        let stands = cc
            .group_extend(T, NS, S, 0, g, &got[0], Duration::from_secs(60))
            .await
            .unwrap();
        assert!(stands >= Duration::from_secs(59), "{stands:?}");
        cc.group_nack_after(T, NS, S, 0, g, &got[1], Duration::from_secs(60))
            .await
            .unwrap();
        cc.group_dead_letter(T, NS, S, 0, g, &got[2]).await.unwrap();
        for r in &got[3..] {
            cc.group_ack(T, NS, S, 0, g, r.offset).await.unwrap();
        }
        let infos = cc.group_describe_stream(T, NS, S, g).await.unwrap();
        assert_eq!(infos.len(), SHARDS as usize);
        assert_eq!(infos[0].in_flight, 2, "{:?}", infos[0]);
        assert_eq!(infos[0].dead_letters, 1);

        let leader = cc.leader_of(T, NS, S, 0).unwrap();
        let dead = cluster.addrs.iter().position(|a| *a == leader).unwrap();
        cluster.brokers[dead].kill9();

        // The new leader: the extension and the delay are gone with the
        // old one, so both records go out again now; the dead letter is
        // still listed, and a redrive there makes it owed.
        let after = cc.group_describe(T, NS, S, 0, g).await.unwrap();
        assert_eq!(after.in_flight, 0, "{after:?}");
        assert_eq!(
            cc.group_dead_letters(T, NS, S, 0, g).await.unwrap(),
            vec![got[2].offset]
        );
        let again: Vec<u64> = cc
            .group_poll(T, NS, S, 0, g, 100)
            .await
            .unwrap()
            .iter()
            .map(|r| r.offset)
            .collect();
        // (The acks above the cursor, which stood at the first record,
        // were the old leader's memory too.)
        let mut want: Vec<u64> = got.iter().map(|r| r.offset).collect();
        want.remove(2);
        assert_eq!(again, want, "all but the dead letter, again");
        for o in &again {
            cc.group_ack(T, NS, S, 0, g, *o).await.unwrap();
        }
        cc.group_redrive(T, NS, S, 0, g, got[2].offset)
            .await
            .unwrap();
        let owed: Vec<u64> = cc
            .group_poll(T, NS, S, 0, g, 100)
            .await
            .unwrap()
            .iter()
            .map(|r| r.offset)
            .collect();
        assert_eq!(owed, vec![got[2].offset]);
        assert!(cc
            .group_dead_letters(T, NS, S, 0, g)
            .await
            .unwrap()
            .is_empty());
        // Every shard moved, then the group deleted, each on its leader.
        cc.group_seek_stream(T, NS, S, g, StartPosition::Latest)
            .await
            .unwrap();
        for info in cc.group_describe_stream(T, NS, S, g).await.unwrap() {
            assert_eq!(info.lag(), 0, "{info:?}");
        }
        cc.group_delete_stream(T, NS, S, g).await.unwrap();
        let gone = cc.group_describe(T, NS, S, 1, g).await.unwrap_err();
        assert_eq!(
            gone.code(),
            Some(felix_client::ErrorCode::NotFound),
            "{gone}"
        );
        // A group polled on shard 0 only: the stream-wide describe counts
        // shard 1's records (its first poll there starts at its start), and
        // a seek puts it on shard 1 too.
        let late = "late";
        let got = cc.group_poll(T, NS, S, 0, late, 1).await.unwrap();
        assert_eq!(got.len(), 1);
        let infos = cc.group_describe_stream(T, NS, S, late).await.unwrap();
        let shard1 = cc.describe_shard(T, NS, S, 1).await.unwrap();
        assert_eq!(
            infos[1].lag(),
            shard1.end_offset - shard1.start_offset,
            "{infos:?}"
        );
        cc.group_seek_stream(T, NS, S, late, StartPosition::Latest)
            .await
            .unwrap();
        let moved = cc.group_describe(T, NS, S, 1, late).await.unwrap();
        assert_eq!(moved.position, shard1.end_offset, "{moved:?}");
    });
}

/// `ShardedGroup::on_cluster`: one consumer of a group on every shard of a
/// replicated stream, each shard's calls on its leader. Its leader killed
/// part way, the group carries on from the durable position on the new
/// one, and once drained every acknowledged publish was delivered at least
/// once and the group is finished on every shard.
#[test]
fn a_sharded_group_consumes_a_cluster_across_a_failover() {
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
        let mut acked = BTreeMap::new();
        publish_some(&cc, 0, 8, &mut acked).await;
        let mut group = ShardedGroup::on_cluster(cc.clone(), T, NS, S, "sharded")
            .await
            .unwrap()
            .wait_slice(Duration::from_millis(200));
        assert_eq!(group.shards(), SHARDS);

        let mut seen: BTreeMap<(u32, u64), String> = BTreeMap::new();
        let mut consume = async |group: &mut ShardedGroup, upto: usize| {
            let deadline = Instant::now() + Duration::from_secs(60);
            while seen.len() < upto {
                assert!(Instant::now() < deadline, "stuck at {}", seen.len());
                let batch = match group.poll(7, Duration::from_millis(500)).await {
                    Ok(b) => b,
                    // A poll that lost its leader's answer: the claims
                    // lapse or are the old leader's; poll again.
                    Err(ClientError::Disconnected | ClientError::Timeout) => continue,
                    Err(e) => panic!("poll: {e}"),
                };
                for r in &batch {
                    let payload = String::from_utf8(r.record.payload.to_vec()).unwrap();
                    seen.insert((r.shard, r.record.offset), payload);
                }
                match group.ack_many(&batch).await {
                    Ok(()) => {}
                    // Handed out by a leader lost since: owed again.
                    Err(e) if e.code() == Some(felix_client::ErrorCode::StaleClaim) => {}
                    Err(ClientError::Disconnected | ClientError::Timeout) => {}
                    Err(e) => panic!("ack: {e}"),
                }
            }
        };
        consume(&mut group, acked.len() / 2).await;

        let leader = cc.leader_of(T, NS, S, 0).unwrap();
        let dead = cluster.addrs.iter().position(|a| *a == leader).unwrap();
        cluster.brokers[dead].kill9();
        // More work lands on the new leaders meanwhile.
        publish_some(&cc, 8, 4, &mut acked).await;
        consume(&mut group, acked.len()).await;

        for (at, payload) in &acked {
            assert_eq!(seen.get(at), Some(payload), "{at:?} never delivered");
        }
        // Drained: every shard's group finished what was published (a
        // redelivery of a record acked twice is a harmless duplicate).
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let extra = group.poll(100, Duration::from_millis(200)).await.unwrap();
            group.ack_many(&extra).await.unwrap();
            let lag = group.lag().await.unwrap();
            if lag == 0 {
                break;
            }
            assert!(Instant::now() < deadline, "lag stays at {lag}");
        }
        group.close().await.unwrap();
    });
}

/// Every offset of `0..end` is either a delivered record or one of the
/// offsets a delivered record's `skipped_before` says directly below it
/// were settled without delivery, and no offset is both; the settled ones
/// are exactly those an ordinary read does not return.
fn assert_skips_cover_the_holes(
    delivered: &BTreeMap<u64, u64>,
    readable: &BTreeMap<u64, String>,
    end: u64,
) {
    let mut settled = std::collections::BTreeSet::new();
    for (&o, &skipped) in delivered {
        assert!(skipped <= o, "offset {o} skipped {skipped}");
        settled.extend(o - skipped..o);
    }
    for o in 0..end {
        let d = delivered.contains_key(&o);
        let s = settled.contains(&o);
        assert!(
            d != s,
            "offset {o}: delivered {d}, counted in a skipped_before {s} (delivered {delivered:?})"
        );
        assert_eq!(
            readable.contains_key(&o),
            d,
            "offset {o}: a settled offset is one a read does not return"
        );
    }
}

/// The guide's holes that will not fill, over TCP across a failover: each
/// leader's generation-start record takes an offset that a group settles
/// without delivering, and the record delivered next counts it in
/// `skipped_before`, so a consumer applying records in offset order never
/// waits for it.
#[test]
fn a_new_leaders_generation_start_is_counted_in_skipped_before() {
    let mut cluster = start_cluster();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let cc = ClusterClient::connect(&cluster.addrs, ClientConfig::default())
            .await
            .unwrap();
        cc.create_stream(T, NS, S, 1, StreamOptions::default())
            .await
            .unwrap();
        let g = "in-order";
        // offset → skipped_before of its latest delivery.
        let mut delivered = BTreeMap::new();
        let mut take = |got: Vec<felix_client::GroupRecord>| {
            for r in got {
                let s = r
                    .skipped_before
                    .expect("the client negotiates skipped_before");
                delivered.insert(r.offset, s);
            }
        };
        for round in 0..3u64 {
            for b in 0..3 {
                let batch: Vec<RecordIn> =
                    (0..5).map(|k| record(0, round * 100 + b * 5 + k)).collect();
                cc.publish_batch(T, NS, S, 0, batch).await.unwrap();
            }
            let got = cc
                .group_poll_wait(T, NS, S, 0, g, 1000, Duration::from_secs(1))
                .await
                .unwrap();
            assert!(!got.is_empty(), "round {round}");
            for r in &got {
                cc.group_ack(T, NS, S, 0, g, r.offset).await.unwrap();
            }
            take(got);
            if round < 2 {
                // The leader dies; the next one writes its generation start.
                let leader = cc.leader_of(T, NS, S, 0).unwrap();
                let i = cluster.addrs.iter().position(|a| *a == leader).unwrap();
                cluster.brokers[i].kill9();
                cluster.brokers[i].restart();
            }
        }
        // Whatever is left (a failover may hand back an ack the old leader
        // had not yet shipped: a record delivered twice is fine here).
        loop {
            let got = cc.group_poll(T, NS, S, 0, g, 1000).await.unwrap();
            if got.is_empty() {
                break;
            }
            for r in &got {
                cc.group_ack(T, NS, S, 0, g, r.offset).await.unwrap();
            }
            take(got);
        }
        let leader = cc.leader_of(T, NS, S, 0).unwrap();
        let c = Client::connect(leader.as_str(), ClientConfig::default())
            .await
            .unwrap();
        let end = c.describe_shard(T, NS, S, 0).await.unwrap().end_offset;
        let readable = read_all(&c, 0).await;
        assert_eq!(readable.len(), 45, "every record published");
        // At least three leaders' generation starts: three offsets settled.
        assert!(end >= 48, "end {end}");
        assert_skips_cover_the_holes(&delivered, &readable, end);
        let info = cc.group_describe(T, NS, S, 0, g).await.unwrap();
        assert_eq!(info.lag(), 0, "{info:?}");

        // One more leader, with nothing published since: its generation
        // start is past the group's saved position, yet a group that
        // finished every record still reports no lag, before any poll.
        let leader = cc.leader_of(T, NS, S, 0).unwrap();
        let i = cluster.addrs.iter().position(|a| *a == leader).unwrap();
        cluster.brokers[i].kill9();
        cluster.brokers[i].restart();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let info = loop {
            if let Ok(info) = cc.group_describe(T, NS, S, 0, g).await {
                if info.end_offset > end {
                    break info;
                }
            }
            assert!(std::time::Instant::now() < deadline, "no new leader");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(info.lag(), 0, "only a generation start behind: {info:?}");
        assert_eq!(info.position, info.end_offset, "{info:?}");
        // A record published after it is lag again, counted from the saved
        // position: the generation starts below it (one, or more if the
        // election took more than one round) with it.
        cc.publish(T, NS, S, 0, "late").await.unwrap();
        let info = cc.group_describe(T, NS, S, 0, g).await.unwrap();
        assert!(info.lag() >= 2, "{info:?}");
        assert_eq!(info.position + info.lag(), info.end_offset, "{info:?}");
    });
}

/// The leader's generation start holds an offset but no record; a poll
/// whose range crosses it still hands out as many records as it asked for
/// (the read behind it counts records, so it finds one more past the
/// range), rather than one short.
#[test]
fn a_poll_across_a_generation_start_still_fills_up() {
    let cluster = start_cluster();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let cc = ClusterClient::connect(&cluster.addrs, ClientConfig::default())
            .await
            .unwrap();
        cc.create_stream(T, NS, S, 1, StreamOptions::default())
            .await
            .unwrap();
        let batch: Vec<RecordIn> = (0..10).map(|k| record(0, k)).collect();
        cc.publish_batch(T, NS, S, 0, batch).await.unwrap();
        for (max, from) in [(2, 0u64), (5, 2)] {
            let got = cc.group_poll(T, NS, S, 0, "g", max).await.unwrap();
            let payloads: Vec<String> = got
                .iter()
                .map(|r| String::from_utf8(r.payload.to_vec()).unwrap())
                .collect();
            let want: Vec<String> = (from..from + u64::from(max))
                .map(|k| format!("s0-r{k}"))
                .collect();
            assert_eq!(payloads, want, "a poll of {max}");
        }
    });
}

/// A cluster client that knows every broker but `leader` (which is cut
/// off or stopped: short timeouts, so a call that reaches it gives up
/// soon and tries the others).
async fn without(cluster: &Cluster, leader: &str) -> ClusterClient {
    let others: Vec<&String> = cluster.addrs.iter().filter(|a| *a != leader).collect();
    let config = ClientConfig {
        connect_timeout: Duration::from_millis(500),
        request_timeout: Duration::from_secs(2),
        ..ClientConfig::default()
    };
    ClusterClient::connect(&others, config).await.unwrap()
}

/// Send `sig` to a broker this test started.
fn signal(b: &Broker, sig: libc::c_int) {
    // SAFETY: kill(2) on a child process of this test.
    assert_eq!(unsafe { libc::kill(b.pid() as libc::pid_t, sig) }, 0);
}

/// The guide's promise on reading group state: a leader cut off while the
/// rest of the cluster elects another and moves the group on does not
/// answer `group_describe` or the dead-letter list from its old state; it
/// must hear from a majority first, so it refuses, and once the network
/// heals it learns it was deposed and names the new leader.
///
/// The old leader is cut off and at once stopped (SIGSTOP), so it still
/// believes it leads when it is asked (a leader cut off and running steps
/// down by itself within an election timeout); it is let go, still cut
/// off, with the requests waiting in its socket. A broker that answered
/// from its own memory would answer them with the old position.
#[test]
fn a_deposed_leader_refuses_to_describe_a_group() {
    let cluster = start_cluster_on(&[], true);
    let net = cluster.net.as_ref().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let cc = ClusterClient::connect(&cluster.addrs, ClientConfig::default())
            .await
            .unwrap();
        cc.create_stream(T, NS, S, 1, StreamOptions::default())
            .await
            .unwrap();
        let g = "readers";
        let batch: Vec<RecordIn> = (0..5).map(|k| record(0, k)).collect();
        cc.publish_batch(T, NS, S, 0, batch).await.unwrap();
        let got = cc
            .group_poll_wait(T, NS, S, 0, g, 100, Duration::from_secs(1))
            .await
            .unwrap();
        cc.group_dead_letter(T, NS, S, 0, g, &got[0]).await.unwrap();
        cc.group_ack(T, NS, S, 0, g, got[1].offset).await.unwrap();
        let old = cc.group_describe(T, NS, S, 0, g).await.unwrap();
        assert_eq!(
            cc.group_dead_letters(T, NS, S, 0, g).await.unwrap(),
            vec![got[0].offset]
        );

        let leader = cc.leader_of(T, NS, S, 0).unwrap();
        let li = cluster.addrs.iter().position(|a| *a == leader).unwrap();
        let to_old = Client::connect(leader.as_str(), ClientConfig::default())
            .await
            .unwrap();
        net.isolate(li);
        signal(&cluster.brokers[li], libc::SIGSTOP);

        // The other two elect a leader; there the group finishes every
        // record and its dead letter is redriven and finished too.
        let rest = without(&cluster, &leader).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        let moved = loop {
            assert!(Instant::now() < deadline, "the others elect a leader");
            let _ = rest.group_redrive(T, NS, S, 0, g, got[0].offset).await;
            if let Ok(got) = rest.group_poll(T, NS, S, 0, g, 100).await {
                for r in &got {
                    let _ = rest.group_ack(T, NS, S, 0, g, r.offset).await;
                }
            }
            if let Ok(info) = rest.group_describe(T, NS, S, 0, g).await {
                if info.position > old.position && info.in_flight == 0 && info.dead_letters == 0 {
                    break info;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_ne!(rest.leader_of(T, NS, S, 0).unwrap(), leader);

        // Asked while stopped, then let go, still cut off.
        let describe = {
            let c = to_old.clone();
            tokio::spawn(async move { c.group_describe(T, NS, S, 0, g).await })
        };
        let dead_letters = {
            let c = to_old.clone();
            tokio::spawn(async move { c.group_dead_letters(T, NS, S, 0, g).await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        signal(&cluster.brokers[li], libc::SIGCONT);
        // Refused: not_leader once it stepped down for want of a majority,
        // or unavailable when no majority confirmed it in time.
        let refused = |e: &ClientError| {
            matches!(e, ClientError::NotLeader { .. })
                || e.code() == Some(felix_client::ErrorCode::Unavailable)
        };
        let d = describe.await.unwrap();
        assert!(
            matches!(&d, Err(e) if refused(e)),
            "the deposed leader answered {d:?} (the group stands at {})",
            moved.position
        );
        let l = dead_letters.await.unwrap();
        assert!(
            matches!(&l, Err(e) if refused(e)),
            "the deposed leader answered {l:?} (the new leader lists none)"
        );

        // Healed, it hears of the new leader and names it.
        net.heal(li);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match to_old.group_describe(T, NS, S, 0, g).await {
                Err(ClientError::NotLeader {
                    leader: Some(named),
                    ..
                }) => {
                    assert_ne!(named, leader);
                    break;
                }
                Err(e) if refused(&e) => {
                    assert!(Instant::now() < deadline, "it never names a leader: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                other => panic!("expected not_leader, got {other:?}"),
            }
        }
    });
}

/// A leader cut off from the others acknowledges nothing sent to it (it
/// cannot reach a majority), the other two elect a leader and take
/// publishes, and once the network heals the old leader drops what it
/// took alone and holds exactly the cluster's log: every acknowledged
/// record at its offset, nothing that was not acknowledged.
#[test]
fn a_cut_off_leader_acknowledges_nothing_and_rejoins_without_it() {
    let cluster = start_cluster_on(&[], true);
    let net = cluster.net.as_ref().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
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
        let mut acked = BTreeMap::new();
        publish_some(&cc, 0, 4, &mut acked).await;
        // Cut off the broker that leads shard 0.
        let leader = cc.leader_of(T, NS, S, 0).unwrap();
        let li = cluster.addrs.iter().position(|a| *a == leader).unwrap();
        let to_old = Client::connect(leader.as_str(), ClientConfig::default())
            .await
            .unwrap();
        net.isolate(li);
        let alone = {
            let c = to_old.clone();
            tokio::spawn(async move {
                let batch: Vec<RecordIn> = (0..5)
                    .map(|k| RecordIn {
                        payload: format!("alone-{k}").into_bytes().into(),
                        ..RecordIn::default()
                    })
                    .collect();
                c.publish_batch(T, NS, S, 0, batch).await
            })
        };

        // The other two carry on (through a client that knows only them).
        let rest = without(&cluster, &leader).await;
        publish_some(&rest, 4, 4, &mut acked).await;

        // Nothing it took alone is acknowledged, before the network heals
        // or after, once it hears the news and its entry is overwritten.
        let alone = if alone.is_finished() {
            net.heal(li);
            alone.await.unwrap()
        } else {
            net.heal(li);
            tokio::time::timeout(Duration::from_secs(40), alone)
                .await
                .expect("the publish to the cut-off leader is answered")
                .unwrap()
        };
        match alone {
            Err(e) => eprintln!("the cut-off leader's publish: {e}"),
            Ok(p) => panic!("acknowledged without a majority: {p:?}"),
        }
        publish_some(&cc, 8, 2, &mut acked).await;

        // Every broker converges on the same log, which is exactly what
        // was acknowledged.
        let deadline = Instant::now() + Duration::from_secs(30);
        for shard in 0..SHARDS {
            let want: BTreeMap<u64, String> = acked
                .iter()
                .filter(|((s, _), _)| *s == shard)
                .map(|((_, o), p)| (*o, p.clone()))
                .collect();
            for addr in &cluster.addrs {
                let c = Client::connect(addr.as_str(), ClientConfig::default())
                    .await
                    .unwrap();
                loop {
                    let have = read_all(&c, shard).await;
                    if have == want {
                        break;
                    }
                    assert!(
                        Instant::now() < deadline,
                        "broker {addr}, shard {shard}: {} records, want {}; not acknowledged: {:?}",
                        have.len(),
                        want.len(),
                        have.iter()
                            .filter(|(o, _)| !want.contains_key(o))
                            .collect::<Vec<_>>()
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    });
}

/// A group's acknowledgement sent to a leader cut off from the others is
/// not acknowledged (group writes commit on a majority), and the new
/// leader owes that record again: an ack the cluster did not take never
/// finishes a record.
#[test]
fn an_ack_to_a_cut_off_leader_is_refused_and_the_record_is_owed() {
    const CLAIMS: &str = "felix_core_group_claims";
    let cluster = start_cluster_on(&[], true);
    let net = cluster.net.as_ref().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let cc = ClusterClient::connect(&cluster.addrs, ClientConfig::default())
            .await
            .unwrap();
        cc.create_stream(T, NS, S, 1, StreamOptions::default())
            .await
            .unwrap();
        let g = "workers";
        let batch: Vec<RecordIn> = (0..5).map(|k| record(0, k)).collect();
        cc.publish_batch(T, NS, S, 0, batch).await.unwrap();
        let got = cc
            .group_poll_wait(T, NS, S, 0, g, 100, Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(got.len(), 5);
        let offsets: Vec<u64> = got.iter().map(|r| r.offset).collect();
        // The first is finished while the cluster is whole.
        cc.group_ack(T, NS, S, 0, g, offsets[0]).await.unwrap();

        let leader = cc.leader_of(T, NS, S, 0).unwrap();
        let li = cluster.addrs.iter().position(|a| *a == leader).unwrap();
        assert_eq!(
            cluster.brokers[li].metric(CLAIMS),
            4.0,
            "the leader's claims"
        );
        let to_old = Client::connect(leader.as_str(), ClientConfig::default())
            .await
            .unwrap();
        net.isolate(li);
        let acks = {
            let c = to_old.clone();
            let o = offsets.clone();
            tokio::spawn(async move {
                let mut out = Vec::new();
                for off in &o[1..3] {
                    out.push(c.group_ack(T, NS, S, 0, g, *off).await);
                }
                out
            })
        };

        let rest = without(&cluster, &leader).await;
        // The new leader owes every record but the first: the acks the
        // cut-off leader took never committed.
        // (Until then a poll may reach the old leader, which still has
        // every record claimed: a describe needs a majority's word.)
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            assert!(Instant::now() < deadline, "the others elect a leader");
            if rest.group_describe(T, NS, S, 0, g).await.is_ok()
                && rest.leader_of(T, NS, S, 0).is_some_and(|l| l != leader)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let again = rest.group_poll(T, NS, S, 0, g, 100).await.unwrap();
        let again: Vec<u64> = again.iter().map(|r| r.offset).collect();
        assert_eq!(again, offsets[1..].to_vec());

        net.heal(li);
        let acks = tokio::time::timeout(Duration::from_secs(40), acks)
            .await
            .expect("the acks to the cut-off leader are answered")
            .unwrap();
        for a in &acks {
            assert!(
                a.is_err(),
                "an ack without a majority was acknowledged: {acks:?}"
            );
        }
        // The deposed leader's claims are nobody's now: they leave its
        // core's claim count (the new leader holds its own).
        let deadline = Instant::now() + Duration::from_secs(10);
        while cluster.brokers[li].metric(CLAIMS) != 0.0 {
            assert!(
                Instant::now() < deadline,
                "the old leader still counts its claims"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for o in &again {
            rest.group_ack(T, NS, S, 0, g, *o).await.unwrap();
        }
        // (A poll settles the new leader's generation start.)
        assert!(rest
            .group_poll(T, NS, S, 0, g, 10)
            .await
            .unwrap()
            .is_empty());
        let info = rest.group_describe(T, NS, S, 0, g).await.unwrap();
        assert_eq!(info.lag(), 0, "{info:?}");
    });
}

/// A broker's data directory records which node of which cluster it holds
/// (`felix.cluster`, at its first start in one). Started again with
/// another set of nodes (here: only itself, which would make it its own
/// majority and let it acknowledge what the cluster never committed), or
/// as another node, or outside a cluster, it refuses to start and says
/// why; with the same nodes at new addresses it starts.
#[test]
fn a_broker_started_with_other_nodes_than_its_data_directory_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let ports = free_ports(8);
    let addr = format!("127.0.0.1:{}", ports[0]);
    let nodes = |p: &[u16], ids: &[u64]| {
        ids.iter()
            .map(|id| {
                let i = *id as usize - 1;
                format!("{id}=127.0.0.1:{}/127.0.0.1:{}", p[2 * i], p[2 * i + 1])
            })
            .collect::<Vec<_>>()
            .join(",")
    };
    let start = |id: Option<u64>, peers: Option<String>| {
        let mut cmd = felix_tests::broker_command!(Some(data.as_path()), &addr);
        if let (Some(id), Some(peers)) = (id, peers) {
            cmd.env("FELIX_NODE_ID", id.to_string())
                .env("FELIX_CLUSTER_NODES", peers);
        }
        cmd
    };
    // Node 1 of nodes 1, 2, 3 (the others need not run for it to start).
    let (mut child, _) =
        felix_tests::spawn_announcing(start(Some(1), Some(nodes(&ports, &[1, 2, 3]))));
    let _ = child.kill();
    let _ = child.wait();
    let recorded = std::fs::read_to_string(data.join("felix.cluster")).unwrap();
    assert!(recorded.contains("node_id = 1"), "{recorded}");
    assert!(recorded.contains("nodes = [1, 2, 3]"), "{recorded}");

    let refused = |cmd: std::process::Command, why: &str| {
        let mut cmd = cmd;
        let out = cmd
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = out.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "it started: {err}");
        assert!(err.contains(why), "{err}");
    };
    // Only itself: it would be its own majority.
    refused(
        start(Some(1), Some(nodes(&ports, &[1]))),
        "membership changes are not supported",
    );
    // Another node's identity on this node's state.
    refused(
        start(Some(2), Some(nodes(&ports, &[1, 2, 3]))),
        "holds node 1 of a cluster of nodes 1, 2, 3",
    );
    // Outside a cluster.
    refused(start(None, None), "does not leave a cluster");
    // The same nodes at other addresses: taken.
    let moved: Vec<u16> = free_ports(6);
    let mut moved_nodes = nodes(&moved, &[1, 2, 3]);
    // Node 1 keeps the client address the test listens on.
    moved_nodes = moved_nodes.replacen(
        &format!("1=127.0.0.1:{}", moved[0]),
        &format!("1={addr}"),
        1,
    );
    let (mut child, _) = felix_tests::spawn_announcing(start(Some(1), Some(moved_nodes)));
    let _ = child.kill();
    let _ = child.wait();
}

/// A broker down while a stream was deleted and created again comes back
/// holding the old stream, whose log is longer and no older than the new
/// one's. Its shards are not the new stream's replicas (each creation has
/// its own incarnation): it neither wins an election nor votes in the new
/// stream's, which keeps every record it acknowledged. Creating the stream
/// across all three brokers is then refused, naming the disagreement; once
/// the old copy is deleted on that broker, the same create gives it the
/// new stream's incarnation and it catches up. A broker that then misses
/// only a deletion comes back as the one holder of the old stream: a create
/// refuses to spread its copy to the others.
#[test]
fn a_broker_down_while_its_stream_was_created_again_keeps_out_of_it() {
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
        let mut old = BTreeMap::new();
        publish_some(&cc, 0, 20, &mut old).await;
        // Later terms for the old stream: every broker killed and started
        // again, each time electing anew.
        for round in 0..3 {
            for b in cluster.brokers.iter_mut() {
                b.kill9();
            }
            for b in cluster.brokers.iter_mut() {
                b.restart();
            }
            publish_some(&cc, 20 + round, 1, &mut old).await;
        }

        // Node 3 misses the deletion and the new stream.
        cluster.brokers[2].kill9();
        let two = without(&cluster, &cluster.addrs[2]).await;
        // The client knows node 3 too (the others name it): the delete
        // and the create are made on the other two, and each says it could
        // not reach node 3, to be run again once it is back.
        let not_on_three = |what: &str, e: ClientError| {
            assert!(e.to_string().contains(&cluster.addrs[2]), "{what}: {e}");
        };
        let deleted = two.delete_stream(T, NS, S).await.unwrap_err();
        assert!(
            deleted.to_string().contains(&format!(
                "deleted on {}, {}",
                cluster.addrs[0], cluster.addrs[1]
            )),
            "{deleted}"
        );
        assert!(!deleted.not_applied(), "{deleted}");
        not_on_three("delete", deleted);
        let created = two
            .create_stream(T, NS, S, SHARDS, StreamOptions::default())
            .await
            .unwrap_err();
        assert_eq!(
            created.code(),
            Some(felix_client::ErrorCode::Unavailable),
            "{created}"
        );
        assert!(
            created
                .to_string()
                .contains("was created on the other brokers"),
            "{created}"
        );
        not_on_three("create", created);
        let mut new = BTreeMap::new();
        publish_some(&two, 1000, 2, &mut new).await;

        // Back with its old copy, it campaigns with that log: several
        // election timeouts (the cluster's are well under a second) to
        // win the new stream's shards, if it could.
        cluster.brokers[2].restart();
        tokio::time::sleep(Duration::from_secs(3)).await;
        publish_some(&two, 1002, 2, &mut new).await;
        let leaders = |c: &ClusterClient| {
            (0..SHARDS)
                .map(|s| c.leader_of(T, NS, S, s).unwrap())
                .collect::<Vec<_>>()
        };
        for (shard, leader) in leaders(&two).into_iter().enumerate() {
            assert_ne!(leader, cluster.addrs[2], "shard {shard}");
            let c = Client::connect(&leader, ClientConfig::default())
                .await
                .unwrap();
            let want: BTreeMap<u64, String> = new
                .iter()
                .filter(|((s, _), _)| *s == shard as u32)
                .map(|((_, o), p)| (*o, p.clone()))
                .collect();
            let got = read_all(&c, shard as u32).await;
            let got: BTreeMap<u64, String> = got
                .into_iter()
                .filter(|(o, _)| want.contains_key(o))
                .collect();
            assert_eq!(got, want, "shard {shard}: the new stream's records");
        }

        // Not the same stream everywhere: said, and nothing is created.
        let err = cc
            .create_stream(T, NS, S, SHARDS, StreamOptions::default())
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(felix_client::ErrorCode::AlreadyExists));
        assert!(
            err.to_string().contains("not the same stream everywhere"),
            "{err}"
        );
        // The old copy deleted there, the same create joins it in.
        let third = Client::connect(&cluster.addrs[2], ClientConfig::default())
            .await
            .unwrap();
        third.delete_stream(T, NS, S).await.unwrap();
        cc.create_stream(T, NS, S, SHARDS, StreamOptions::default())
            .await
            .unwrap();
        let a = two.describe_stream(T, NS, S).await.unwrap();
        let b = third.describe_stream(T, NS, S).await.unwrap();
        assert!(a.incarnation.is_some());
        assert_eq!(a.incarnation, b.incarnation, "one incarnation");
        publish_some(&cc, 1004, 2, &mut new).await;
        for shard in 0..SHARDS {
            let leader = cc.leader_of(T, NS, S, shard).unwrap();
            let l = Client::connect(&leader, ClientConfig::default())
                .await
                .unwrap();
            catches_up(&third, &l, shard).await;
        }

        // Node 3 misses only a deletion: back, its copy is the stream's
        // only one, and a create does not spread it to the others (it
        // would bring the deleted stream back).
        cluster.brokers[2].kill9();
        not_on_three("delete", two.delete_stream(T, NS, S).await.unwrap_err());
        cluster.brokers[2].restart();
        let err = cc
            .create_stream(T, NS, S, SHARDS, StreamOptions::default())
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(felix_client::ErrorCode::AlreadyExists));
        assert!(
            err.to_string().contains("held by only 1 of the 3 brokers"),
            "{err}"
        );
        let others = two.describe_stream(T, NS, S).await;
        assert!(
            matches!(&others, Err(e) if e.code() == Some(felix_client::ErrorCode::NotFound)),
            "not created on the others: {others:?}"
        );
        let third = Client::connect(&cluster.addrs[2], ClientConfig::default())
            .await
            .unwrap();
        third.delete_stream(T, NS, S).await.unwrap();
        cc.create_stream(T, NS, S, SHARDS, StreamOptions::default())
            .await
            .unwrap();
        let fresh = third.describe_stream(T, NS, S).await.unwrap();
        assert_ne!(fresh.incarnation, a.incarnation, "a new incarnation");
    });
}

/// A broker names every broker of its cluster (`describe_cluster`), so a
/// cluster client given one address finds the others: it creates a stream
/// on all three with one incarnation, and keeps publishing when the broker
/// it was given is killed. A broker outside a cluster does not advertise
/// the call, and the client refuses it without asking.
#[test]
fn a_cluster_client_given_one_broker_finds_the_others() {
    let mut cluster = start_cluster();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let seed = cluster.addrs[1].clone();
        let plain = Client::connect(&seed, ClientConfig::default())
            .await
            .unwrap();
        let info = plain.describe_cluster().await.unwrap();
        assert_eq!(info.node, 2, "the answering broker's own id");
        let named: Vec<(u64, String)> =
            info.members.into_iter().map(|m| (m.node, m.addr)).collect();
        let want: Vec<(u64, String)> = (0..3)
            .map(|i| (i as u64 + 1, cluster.addrs[i].clone()))
            .collect();
        assert_eq!(named, want);

        let cc = ClusterClient::connect(&[&seed], ClientConfig::default())
            .await
            .unwrap();
        assert_eq!(cc.members(), &cluster.addrs[..]);
        assert_eq!(cc.brokers()[0], seed, "the broker given comes first");
        assert_eq!(cc.brokers().len(), 3, "{:?}", cc.brokers());
        cc.create_stream(T, NS, S, SHARDS, StreamOptions::default())
            .await
            .unwrap();
        let mut incarnations = Vec::new();
        for a in &cluster.addrs {
            let c = Client::connect(a, ClientConfig::default()).await.unwrap();
            incarnations.push(c.describe_stream(T, NS, S).await.unwrap().incarnation);
        }
        assert!(incarnations[0].is_some(), "{incarnations:?}");
        assert!(
            incarnations.iter().all(|i| *i == incarnations[0]),
            "one incarnation on every broker: {incarnations:?}"
        );

        let mut acked = BTreeMap::new();
        publish_some(&cc, 0, 4, &mut acked).await;
        // The broker it was given dies: the others carry on, and every
        // acknowledged record is on each shard's leader.
        cluster.brokers[1].kill9();
        publish_some(&cc, 4, 4, &mut acked).await;
        for shard in 0..SHARDS {
            let leader = cc.leader_of(T, NS, S, shard).expect("a leader is known");
            assert_ne!(leader, seed, "shard {shard}");
            let l = Client::connect(&leader, ClientConfig::default())
                .await
                .unwrap();
            let got = read_all(&l, shard).await;
            for ((_, offset), payload) in acked.iter().filter(|((s, _), _)| *s == shard) {
                assert_eq!(
                    got.get(offset),
                    Some(payload),
                    "shard {shard} offset {offset}"
                );
            }
        }
        cluster.brokers[1].restart();

        let single = start_broker!(BrokerOptions::default().cores(1));
        let alone = Client::connect(&single.addr, ClientConfig::default())
            .await
            .unwrap();
        match alone.describe_cluster().await {
            Err(ClientError::Unsupported(why)) => {
                assert!(why.contains("FEATURE_CLUSTER_INFO"), "{why}")
            }
            other => panic!("a broker outside a cluster: {other:?}"),
        }
    });
}
