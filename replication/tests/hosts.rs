//! Three hosts on one executor, replicating one group over loopback TCP
//! through the peer wire format: a leader is elected, takes writes and
//! reads; it stops; another is elected and carries on from the same log.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use felix_engine::format::RecordIn;
use felix_replication::host::{Host, HostConfig};
use felix_replication::{EntryKind, ReplicationError};
use glommio::net::TcpListener;
use glommio::{LocalExecutorBuilder, Placement};

const GROUP: u64 = 7;

type Log = Rc<RefCell<Vec<(u64, u64, EntryKind, u64, Bytes)>>>;

async fn until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        glommio::timer::sleep(Duration::from_millis(5)).await;
    }
}

fn record(n: u64) -> RecordIn {
    RecordIn {
        payload: Bytes::from(n.to_le_bytes().to_vec()),
        ..RecordIn::default()
    }
}

#[test]
fn three_hosts_replicate_over_tcp_and_a_new_leader_carries_on() {
    LocalExecutorBuilder::new(Placement::Unbound)
        .spawn(|| async move {
            let listeners: Vec<TcpListener> = (0..3)
                .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
                .collect();
            let addrs: Vec<SocketAddr> =
                listeners.iter().map(|l| l.local_addr().unwrap()).collect();
            let logs: Vec<Log> = (0..3).map(|_| Log::default()).collect();
            let mut hosts = Vec::new();
            for (i, listener) in listeners.into_iter().enumerate() {
                let id = i as u64 + 1;
                let peers: BTreeMap<u64, SocketAddr> = (0..3)
                    .filter(|&j| j != i)
                    .map(|j| (j as u64 + 1, addrs[j]))
                    .collect();
                let mut config = HostConfig::new(id, peers);
                config.tick = Duration::from_millis(5);
                let log = logs[i].clone();
                let hook = Box::new(move |group: u64, a: &felix_replication::Applied| {
                    assert_eq!(group, GROUP);
                    log.borrow_mut()
                        .push((a.index, a.term, a.kind, a.base.0, a.data.clone()));
                });
                hosts.push(Host::start(config, listener, &[(GROUP, vec![1, 2, 3])], hook).unwrap());
            }

            let first = until("a leader", || hosts.iter().position(|h| h.serving(GROUP))).await;
            let mut offsets = Vec::new();
            for n in 0..40 {
                let landed = hosts[first]
                    .publish(GROUP, &[record(n), record(n + 1000)])
                    .await
                    .unwrap();
                assert_eq!(landed.end.0 - landed.base.0, 2);
                offsets.push(landed.base.0);
            }
            assert!(offsets.windows(2).all(|w| w[1] == w[0] + 2), "{offsets:?}");
            hosts[first].read(GROUP).await.unwrap();
            // A follower refuses, naming the leader.
            let follower = (first + 1) % 3;
            let leader_id = first as u64 + 1;
            until("the follower to learn the leader", || {
                (hosts[follower].leader(GROUP) == Some(leader_id)).then_some(())
            })
            .await;
            assert_eq!(
                hosts[follower].read(GROUP).await,
                Err(ReplicationError::NotLeader {
                    leader: Some(leader_id)
                })
            );

            // The leader goes away; one of the others takes over.
            hosts[first].close();
            let second = until("a new leader", || {
                (0..3).find(|&i| i != first && hosts[i].serving(GROUP))
            })
            .await;
            let before = offsets.last().unwrap() + 2;
            let landed = hosts[second]
                .publish(GROUP, &[record(7_000)])
                .await
                .unwrap();
            // Its generation start took one offset after everything acked.
            assert!(landed.base.0 > before, "{landed:?} after {before}");
            for n in 0..20 {
                hosts[second]
                    .publish(GROUP, &[record(8_000 + n)])
                    .await
                    .unwrap();
            }
            hosts[second].read(GROUP).await.unwrap();

            // The two survivors applied the same entries.
            let other = (0..3).find(|&i| i != first && i != second).unwrap();
            let last = logs[second].borrow().last().unwrap().0;
            until("the other survivor to catch up", || {
                (logs[other].borrow().last().map(|e| e.0) == Some(last)).then_some(())
            })
            .await;
            assert_eq!(*logs[second].borrow(), *logs[other].borrow());
            let starts = logs[second]
                .borrow()
                .iter()
                .filter(|e| e.2 == EntryKind::GenerationStart)
                .count();
            assert!(starts >= 2, "two leaders, two generation starts");
            for h in &hosts {
                h.close();
            }
        })
        .unwrap()
        .join()
        .unwrap();
}

/// Three hosts with `configure` applied to each config.
fn three_hosts(configure: impl Fn(&mut HostConfig)) -> Vec<Host> {
    let listeners: Vec<TcpListener> = (0..3)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    listeners
        .into_iter()
        .enumerate()
        .map(|(i, listener)| {
            let peers = (0..3)
                .filter(|&j| j != i)
                .map(|j| (j as u64 + 1, addrs[j]))
                .collect();
            let mut config = HostConfig::new(i as u64 + 1, peers);
            config.tick = Duration::from_millis(5);
            configure(&mut config);
            Host::start(
                config,
                listener,
                &[(GROUP, vec![1, 2, 3])],
                Box::new(|_, _| {}),
            )
            .unwrap()
        })
        .collect()
}

#[test]
fn appends_larger_than_one_frame_together_are_split_across_frames() {
    LocalExecutorBuilder::new(Placement::Unbound)
        .spawn(|| async move {
            // A frame holds one 1 MiB append and little more, so eight
            // 400 KiB batches in flight need several frames a pass.
            let hosts = three_hosts(|c| {
                c.max_frame = (1 << 20) + (64 << 10);
                c.replica.max_append_bytes = 1 << 20;
            });
            let leader = until("a leader", || hosts.iter().position(|h| h.serving(GROUP))).await;
            let big = Rc::new(RecordIn {
                payload: Bytes::from(vec![1u8; 400 << 10]),
                ..RecordIn::default()
            });
            let mut tasks = Vec::new();
            for _ in 0..8 {
                let (h, big) = (hosts[leader].clone(), big.clone());
                tasks.push(glommio::spawn_local(async move {
                    glommio::timer::timeout(Duration::from_secs(20), async {
                        Ok(h.publish(GROUP, &[(*big).clone()]).await)
                    })
                    .await
                    .expect("committed in time")
                    .unwrap()
                }));
            }
            for t in tasks {
                t.await;
            }
            // Split, not dropped and sent again.
            assert_eq!(hosts[leader].frames_dropped(), 0);
            // Too big for any frame: refused up front, not stuck.
            let huge = RecordIn {
                payload: Bytes::from(vec![2u8; 2 << 20]),
                ..RecordIn::default()
            };
            assert!(matches!(
                hosts[leader].publish(GROUP, &[huge]).await,
                Err(ReplicationError::Refused(_))
            ));
            for h in &hosts {
                h.close();
            }
        })
        .unwrap()
        .join()
        .unwrap();
}

#[test]
fn a_host_dropped_without_close_stops_its_tasks_and_a_bad_config_is_refused() {
    LocalExecutorBuilder::new(Placement::Unbound)
        .spawn(|| async move {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let host = Host::start(
                HostConfig::new(1, BTreeMap::new()),
                listener,
                &[(GROUP, vec![1])],
                Box::new(|_, _| {}),
            )
            .unwrap();
            until("a lone leader", || host.serving(GROUP).then_some(())).await;
            drop(host);
            // Its listener went with its tasks.
            glommio::timer::sleep(Duration::from_millis(20)).await;
            assert!(glommio::net::TcpStream::connect(addr).await.is_err());

            let bad = |configure: &dyn Fn(&mut HostConfig), voters: Vec<u64>| {
                let mut c = HostConfig::new(1, BTreeMap::new());
                configure(&mut c);
                let l = TcpListener::bind("127.0.0.1:0").unwrap();
                Host::start(c, l, &[(GROUP, voters)], Box::new(|_, _| {})).is_err()
            };
            assert!(bad(&|_| {}, vec![1, 2]), "a voter without an address");
            assert!(
                bad(&|c| c.max_frame = 1 << 20, vec![1]),
                "no room for a full append"
            );
        })
        .unwrap()
        .join()
        .unwrap();
}
