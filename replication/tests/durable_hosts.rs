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
    let listener = TcpListener::bind(addrs[i]).expect("the host's port is free again");
    let peers: BTreeMap<u64, SocketAddr> = (0..3)
        .filter(|&j| j != i)
        .map(|j| (j as u64 + 1, addrs[j]))
        .collect();
    let mut config = HostConfig::new(i as u64 + 1, peers);
    config.tick = Duration::from_millis(5);
    config.data_dir = Some(root.join(format!("host-{}", i + 1)));
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
