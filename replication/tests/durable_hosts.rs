//! Hosts with their logs on disk (`Host::open` with a `data_dir`), over
//! loopback TCP: a follower that stops and comes back carries on from its
//! journal and catches up; a whole cluster that stops and comes back
//! applies every entry it had committed, at the same offsets, elects a
//! leader in a later term and goes on.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::rc::Rc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use felix_engine::format::RecordIn;
use felix_replication::host::{Host, HostConfig};
use felix_replication::journal::JournalConfig;
use felix_replication::{Applied, EntryKind};
use glommio::net::TcpListener;
use glommio::{LocalExecutorBuilder, Placement};

const GROUP: u64 = 3;

/// (index, term, kind, base offset, data) of each entry a host applied.
type Log = Rc<RefCell<Vec<(u64, u64, EntryKind, u64, Bytes)>>>;

async fn until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
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

/// Host `i` (id `i + 1`) of three at `addrs`, its state under `root`,
/// applying into a fresh log.
async fn open_host(i: usize, addrs: &[SocketAddr], root: &Path) -> (Host, Log) {
    open_host_with(i, addrs, root, JournalConfig::default()).await
}

/// [`open_host`] with its journals laid out by `journal`.
async fn open_host_with(
    i: usize,
    addrs: &[SocketAddr],
    root: &Path,
    journal: JournalConfig,
) -> (Host, Log) {
    let listener = TcpListener::bind(addrs[i]).expect("the host's port is free again");
    let peers: BTreeMap<u64, SocketAddr> = (0..3)
        .filter(|&j| j != i)
        .map(|j| (j as u64 + 1, addrs[j]))
        .collect();
    let mut config = HostConfig::new(i as u64 + 1, peers);
    config.tick = Duration::from_millis(5);
    config.data_dir = Some(root.join(format!("host-{}", i + 1)));
    config.journal = journal;
    let log = Log::default();
    let applied = log.clone();
    let hook = Box::new(move |group: u64, a: &Applied| {
        assert_eq!(group, GROUP);
        applied
            .borrow_mut()
            .push((a.index, a.term, a.kind, a.base.0, a.data.clone()));
    });
    let host = Host::open(config, listener, &[(GROUP, vec![1, 2, 3])], hook)
        .await
        .expect("the host opens its journal");
    (host, log)
}

async fn leader(hosts: &[Option<Host>]) -> usize {
    until("a leader", || {
        hosts
            .iter()
            .position(|h| h.as_ref().is_some_and(|h| h.serving(GROUP)))
    })
    .await
}

#[test]
fn hosts_come_back_from_their_journals_with_every_committed_entry() {
    let root = tempfile::tempdir().unwrap();
    let root = root.path().to_path_buf();
    LocalExecutorBuilder::new(Placement::Unbound)
        .spawn(move || async move {
            // Ports picked once and bound again on every restart.
            let addrs: Vec<SocketAddr> = (0..3)
                .map(|_| {
                    let l = TcpListener::bind("127.0.0.1:0").unwrap();
                    l.local_addr().unwrap()
                })
                .collect();
            let mut hosts: Vec<Option<Host>> = Vec::new();
            let mut logs: Vec<Log> = Vec::new();
            for i in 0..3 {
                let (h, l) = open_host(i, &addrs, &root).await;
                hosts.push(Some(h));
                logs.push(l);
            }
            let first = leader(&hosts).await;
            for n in 0..30 {
                hosts[first]
                    .as_ref()
                    .unwrap()
                    .publish(GROUP, &[record(n), record(n + 100)])
                    .await
                    .unwrap();
            }

            // A follower stops; the others go on without it; it comes
            // back from its journal and catches up.
            let follower = (first + 1) % 3;
            hosts[follower].take().unwrap().close();
            for n in 0..10 {
                hosts[first]
                    .as_ref()
                    .unwrap()
                    .publish(GROUP, &[record(1_000 + n)])
                    .await
                    .unwrap();
            }
            let (h, l) = open_host(follower, &addrs, &root).await;
            hosts[follower] = Some(h);
            logs[follower] = l;
            let last = logs[first].borrow().last().unwrap().0;
            until("the follower to apply everything again", || {
                (logs[follower].borrow().len() as u64 >= last).then_some(())
            })
            .await;
            assert_eq!(
                logs[follower].borrow()[..last as usize],
                logs[first].borrow()[..last as usize],
                "the follower applied the same entries at the same offsets"
            );

            // Every host stops, and all come back.
            let before = logs[first].borrow().clone();
            let term_before = before.last().unwrap().1;
            for h in hosts.iter_mut() {
                h.take().unwrap().close();
            }
            // Let the old listeners go.
            glommio::timer::sleep(Duration::from_millis(20)).await;
            for i in 0..3 {
                let (h, l) = open_host(i, &addrs, &root).await;
                hosts[i] = Some(h);
                logs[i] = l;
            }
            let second = leader(&hosts).await;
            let landed = hosts[second]
                .as_ref()
                .unwrap()
                .publish(GROUP, &[record(9_999)])
                .await
                .unwrap();
            let end_before = before.iter().map(|e| e.3).max().unwrap();
            assert!(
                landed.base.0 > end_before,
                "{landed:?} lands after everything committed before (offset {end_before} on)"
            );
            let after = logs[second].borrow().clone();
            assert_eq!(
                after[..before.len()],
                before[..],
                "every entry committed before the restart is applied again, unchanged"
            );
            let new = &after[before.len()..];
            assert!(
                new.iter()
                    .any(|e| e.2 == EntryKind::GenerationStart && e.1 > term_before),
                "a new leader in a later term wrote a generation start"
            );
            for h in hosts.iter().flatten() {
                h.close();
            }
        })
        .unwrap()
        .join()
        .unwrap();
}

#[test]
fn a_damaged_hard_state_stops_the_host_from_opening() {
    let root = tempfile::tempdir().unwrap();
    let root = root.path().to_path_buf();
    LocalExecutorBuilder::new(Placement::Unbound)
        .spawn(move || async move {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let mut config = HostConfig::new(1, BTreeMap::new());
            config.tick = Duration::from_millis(5);
            config.data_dir = Some(root.clone());
            let host = Host::open(
                config.clone(),
                listener,
                &[(GROUP, vec![1])],
                Box::new(|_, _| {}),
            )
            .await
            .unwrap();
            until("a lone leader", || host.serving(GROUP).then_some(())).await;
            host.publish(GROUP, &[record(1)]).await.unwrap();
            host.close();
            let state = HostConfig::group_dir(&root, GROUP)
                .join(felix_replication::hard_state::HARD_STATE_FILE);
            std::fs::write(&state, b"not a hard state").unwrap();
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let err = Host::open(
                config.clone(),
                listener,
                &[(GROUP, vec![1])],
                Box::new(|_, _| {}),
            )
            .await
            .err()
            .expect("a damaged hard state is refused");
            assert!(err.to_string().contains("damaged"), "{err}");
            // And a data_dir is never silently kept in memory.
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            assert!(
                Host::start(config, listener, &[(GROUP, vec![1])], Box::new(|_, _| {})).is_err()
            );
        })
        .unwrap()
        .join()
        .unwrap();
}

#[test]
fn groups_added_after_the_start_replicate_and_a_removed_group_leaves_no_files() {
    let root = tempfile::tempdir().unwrap();
    let root = root.path().to_path_buf();
    LocalExecutorBuilder::new(Placement::Unbound)
        .spawn(move || async move {
            let listeners: Vec<TcpListener> = (0..3)
                .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
                .collect();
            let addrs: Vec<SocketAddr> =
                listeners.iter().map(|l| l.local_addr().unwrap()).collect();
            let mut hosts = Vec::new();
            for (i, listener) in listeners.into_iter().enumerate() {
                let peers = (0..3)
                    .filter(|&j| j != i)
                    .map(|j| (j as u64 + 1, addrs[j]))
                    .collect();
                let mut config = HostConfig::new(i as u64 + 1, peers);
                config.tick = Duration::from_millis(5);
                config.data_dir = Some(root.join(format!("host-{}", i + 1)));
                hosts.push(
                    Host::open(config, listener, &[], Box::new(|_, _| {}))
                        .await
                        .unwrap(),
                );
            }
            for h in &hosts {
                h.add_group(GROUP, &[1, 2, 3]).await.unwrap();
                assert!(h.add_group(GROUP, &[1, 2, 3]).await.is_err(), "twice");
            }
            let leader = until("a leader", || hosts.iter().position(|h| h.serving(GROUP))).await;
            hosts[leader].publish(GROUP, &[record(1)]).await.unwrap();
            let dirs: Vec<_> = (0..3)
                .map(|i| HostConfig::group_dir(&root.join(format!("host-{}", i + 1)), GROUP))
                .collect();
            assert!(dirs.iter().all(|d| d.exists()));
            for h in &hosts {
                h.remove_group(GROUP).await.unwrap();
            }
            assert!(
                dirs.iter().all(|d| !d.exists()),
                "the group's files are gone"
            );
            assert!(!hosts[leader].serving(GROUP));
            assert!(matches!(
                hosts[leader].publish(GROUP, &[record(2)]).await,
                Err(felix_replication::ReplicationError::Refused(_))
            ));
            for h in &hosts {
                h.close();
            }
        })
        .unwrap()
        .join()
        .unwrap();
}

/// `.rlog` segment files in host `i`'s journal of `GROUP`.
fn segments(root: &Path, i: usize) -> usize {
    let dir = HostConfig::group_dir(&root.join(format!("host-{}", i + 1)), GROUP);
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".rlog"))
        })
        .count()
}

/// Logs compacted on every host: entries every replica holds leave memory
/// and whole journal segments leave the disk; a replica that is down
/// holds the others' compaction back to what it has, catches up when it
/// returns, and hosts restarted from compacted journals go on at the same
/// offsets.
#[test]
fn compacted_logs_keep_what_a_replica_still_needs_and_restart_from_their_point() {
    let root = tempfile::tempdir().unwrap();
    let root = root.path().to_path_buf();
    LocalExecutorBuilder::new(Placement::Unbound)
        .spawn(move || async move {
            let addrs: Vec<SocketAddr> = (0..3)
                .map(|_| {
                    let l = TcpListener::bind("127.0.0.1:0").unwrap();
                    l.local_addr().unwrap()
                })
                .collect();
            // Small segments, so compaction has whole ones to drop.
            let open = |i: usize| {
                let journal = JournalConfig {
                    segment_bytes: 8 << 10,
                };
                open_host_with(i, &addrs, &root, journal)
            };
            let mut hosts: Vec<Option<Host>> = Vec::new();
            let mut logs: Vec<Log> = Vec::new();
            for i in 0..3 {
                let (h, l) = open(i).await;
                hosts.push(Some(h));
                logs.push(l);
            }
            let big = |n: u64| RecordIn {
                payload: Bytes::from(vec![n as u8; 1500]),
                ..RecordIn::default()
            };
            let first = leader(&hosts).await;
            for n in 0..40 {
                hosts[first]
                    .as_ref()
                    .unwrap()
                    .publish(GROUP, &[big(n)])
                    .await
                    .unwrap();
            }
            let last = hosts[first].as_ref().unwrap().applied(GROUP).unwrap();
            for h in hosts.iter().flatten() {
                until(
                    "every replica to apply everything and hear it is held",
                    || {
                        (h.applied(GROUP) == Some(last) && h.compactable(GROUP) == Some(last))
                            .then_some(())
                    },
                )
                .await;
            }
            let before = segments(&root, 0);
            for (i, h) in hosts.iter().enumerate() {
                let h = h.as_ref().unwrap();
                let point = h.compact(GROUP, last).expect("something to compact");
                assert_eq!(point.index, last);
                assert_eq!(h.log_len(GROUP), Some(0), "host {i} holds nothing past it");
            }
            until("the journals to drop whole segments", || {
                (0..3).all(|i| segments(&root, i) < before).then_some(())
            })
            .await;

            // A follower goes down: the others keep what it has not got.
            let follower = (first + 1) % 3;
            hosts[follower].take().unwrap().close();
            for n in 0..30 {
                hosts[first]
                    .as_ref()
                    .unwrap()
                    .publish(GROUP, &[big(100 + n)])
                    .await
                    .unwrap();
            }
            let lead = hosts[first].as_ref().unwrap();
            assert_eq!(
                lead.compact(GROUP, u64::MAX),
                None,
                "the follower holds it back"
            );
            assert!(lead.log_len(GROUP).unwrap() >= 30);

            // Back, from its compacted journal: applies what it missed.
            let (h, l) = open(follower).await;
            hosts[follower] = Some(h);
            logs[follower] = l;
            let last = hosts[first].as_ref().unwrap().applied(GROUP).unwrap();
            until("the follower to catch up", || {
                (hosts[follower].as_ref().unwrap().applied(GROUP) == Some(last)).then_some(())
            })
            .await;
            let caught = logs[follower].borrow().clone();
            assert!(
                caught.first().is_some_and(|e| e.0 > 1),
                "it applies from its compaction point on, not from the first entry"
            );
            let same: Vec<_> = logs[first]
                .borrow()
                .iter()
                .filter(|e| e.0 >= caught[0].0)
                .cloned()
                .collect();
            assert_eq!(caught, same, "the same entries at the same offsets");
            until("the leader to compact once it is held again", || {
                hosts[first]
                    .as_ref()
                    .unwrap()
                    .compact(GROUP, last)
                    .map(|_| ())
            })
            .await;

            // Everyone restarts from compacted journals and goes on.
            let end_before = logs[first].borrow().iter().map(|e| e.3).max().unwrap();
            for h in hosts.iter_mut() {
                h.take().unwrap().close();
            }
            glommio::timer::sleep(Duration::from_millis(20)).await;
            for i in 0..3 {
                let (h, l) = open(i).await;
                hosts[i] = Some(h);
                logs[i] = l;
            }
            let second = leader(&hosts).await;
            let landed = hosts[second]
                .as_ref()
                .unwrap()
                .publish(GROUP, &[big(9_999)])
                .await
                .unwrap();
            assert!(
                landed.base.0 > end_before,
                "{landed:?} lands after everything committed before (offset {end_before} on)"
            );
            for h in hosts.iter().flatten() {
                h.close();
            }
        })
        .unwrap()
        .join()
        .unwrap();
}
