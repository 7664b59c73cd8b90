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
use felix_replication::handshake::{self, PeerKey};
use felix_replication::host::{Host, HostConfig};
use felix_replication::wire::{encode_frame, PeerMessage};
use felix_replication::{EntryKind, Message, ReplicationError};
use futures_lite::{AsyncReadExt, AsyncWriteExt};
use glommio::net::{TcpListener, TcpStream};
use glommio::{LocalExecutorBuilder, Placement};
use raft::eraftpb::MessageType;

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
    three_hosts_at(configure).0
}

/// [`three_hosts`], with their replication addresses.
fn three_hosts_at(configure: impl Fn(&mut HostConfig)) -> (Vec<Host>, Vec<SocketAddr>) {
    let listeners: Vec<TcpListener> = (0..3)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let hosts = listeners
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
        .collect();
    (hosts, addrs)
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

/// A heartbeat for `GROUP` from `from` to `to` in `term`, framed.
fn heartbeat_frame(from: u64, to: u64, term: u64) -> Vec<u8> {
    let mut hb = Message::default();
    hb.set_msg_type(MessageType::MsgHeartbeat);
    hb.from = from;
    hb.to = to;
    hb.term = term;
    let mut out = Vec::new();
    encode_frame(
        &[PeerMessage {
            group: GROUP,
            held_by_all: 0,
            message: hb,
        }],
        1 << 20,
        &mut out,
    )
    .unwrap();
    out
}

/// Connect to a host's replication port and prove to be `from` with `key`;
/// returns the connection and the nonce it was challenged with.
async fn dial_as(addr: SocketAddr, key: &PeerKey, from: u64, to: u64) -> (TcpStream, [u8; 32]) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut c = [0u8; handshake::CHALLENGE_BYTES];
    s.read_exact(&mut c).await.unwrap();
    let nonce = handshake::read_challenge(&c).unwrap();
    s.write_all(&handshake::prove(key, &nonce, from, to))
        .await
        .unwrap();
    (s, nonce)
}

/// Dial as `from` and check the host's acceptance, proved with `key`.
async fn accepted_as(addr: SocketAddr, key: &PeerKey, from: u64, to: u64) -> TcpStream {
    let (mut s, nonce) = dial_as(addr, key, from, to).await;
    let mut a = [0u8; handshake::ACCEPT_BYTES];
    s.read_exact(&mut a).await.unwrap();
    handshake::check_accept(key, &nonce, from, to, &a).unwrap();
    s
}

/// Whether the host closed `s` within four seconds (more than the
/// handshake's two, less than the ten a silent connection may idle): a
/// read sees the end, or a reset (a socket closed with bytes unread
/// resets the connection).
async fn closed(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(4))).unwrap();
    let mut b = [0u8; 64];
    match s.read(&mut b).await {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

#[test]
fn a_host_without_the_clusters_secret_is_not_heard_and_hears_nothing() {
    LocalExecutorBuilder::new(Placement::Unbound)
        .spawn(|| async move {
            let secret = PeerKey::from_secret(b"the cluster's secret");
            let hosts = three_hosts(|c| {
                c.peer_key = match c.id {
                    3 => PeerKey::from_secret(b"another secret"),
                    _ => secret.clone(),
                }
            });
            let leader = until("a leader", || {
                hosts[..2].iter().position(|h| h.serving(GROUP))
            })
            .await;
            for n in 0..20 {
                hosts[leader].publish(GROUP, &[record(n)]).await.unwrap();
            }
            hosts[leader].read(GROUP).await.unwrap();
            // Committed by the two that share the secret; the third never
            // heard a heartbeat, so it knows no leader, and never won.
            glommio::timer::sleep(Duration::from_millis(300)).await;
            assert_eq!(hosts[2].leader(GROUP), None);
            assert!(!hosts[2].serving(GROUP));
            assert!(hosts[..2].iter().any(|h| h.serving(GROUP)));
            for h in &hosts {
                h.close();
            }
        })
        .unwrap()
        .join()
        .unwrap();
}

#[test]
fn a_connection_speaks_only_for_the_peer_it_proved_to_be() {
    LocalExecutorBuilder::new(Placement::Unbound)
        .spawn(|| async move {
            let key = PeerKey::from_secret(b"the cluster's secret");
            let (hosts, addrs) = three_hosts_at(|c| c.peer_key = key.clone());
            let leader = until("a leader", || hosts.iter().position(|h| h.serving(GROUP))).await;
            let f = (leader + 1) % 3;
            let other = 3 - leader - f;
            let (fid, lid, oid) = (f as u64 + 1, leader as u64 + 1, other as u64 + 1);
            until("the follower to know the leader", || {
                (hosts[f].leader(GROUP) == Some(lid)).then_some(())
            })
            .await;
            let term = hosts[f].term(GROUP).unwrap();

            // No handshake: the host's challenge, then the end.
            let mut s = TcpStream::connect(addrs[f]).await.unwrap();
            s.write_all(&heartbeat_frame(oid, fid, term + 10))
                .await
                .unwrap();
            let mut c = [0u8; handshake::CHALLENGE_BYTES];
            s.read_exact(&mut c).await.unwrap();
            assert!(handshake::read_challenge(&c).is_ok());
            assert!(closed(&mut s).await, "no proof, no hearing");
            // The wrong secret, and a proof meant for another node.
            let (mut s, _) = dial_as(addrs[f], &PeerKey::from_secret(b"guess"), oid, fid).await;
            assert!(closed(&mut s).await, "the wrong secret");
            let (mut s, _) = dial_as(addrs[f], &key, oid, lid).await;
            assert!(closed(&mut s).await, "a proof for another node");
            // A connection that says nothing is closed when the handshake's
            // time is up, well before a silent peer's idle timeout.
            let mut s = TcpStream::connect(addrs[f]).await.unwrap();
            let mut c = [0u8; handshake::CHALLENGE_BYTES];
            s.read_exact(&mut c).await.unwrap();
            assert!(closed(&mut s).await, "a handshake never finished");
            // Proved as one peer, a message claiming to be from another,
            // or meant for another node.
            let mut s = accepted_as(addrs[f], &key, lid, fid).await;
            s.write_all(&heartbeat_frame(oid, fid, term + 10))
                .await
                .unwrap();
            assert!(closed(&mut s).await, "a message from another node");
            let mut s = accepted_as(addrs[f], &key, lid, fid).await;
            s.write_all(&heartbeat_frame(lid, oid, term + 10))
                .await
                .unwrap();
            assert!(closed(&mut s).await, "a message to another node");
            assert_eq!(hosts[f].term(GROUP), Some(term), "and none was taken");

            // The same message from the peer it proved to be is taken (a
            // heartbeat of a later term: the follower moves to it), so the
            // refusal above was the connection's identity, nothing else.
            let mut s = accepted_as(addrs[f], &key, oid, fid).await;
            s.write_all(&heartbeat_frame(oid, fid, term + 10))
                .await
                .unwrap();
            until("the heartbeat to be taken", || {
                (hosts[f].term(GROUP) == Some(term + 10)).then_some(())
            })
            .await;
            for h in &hosts {
                h.close();
            }
        })
        .unwrap()
        .join()
        .unwrap();
}
