//! Authentication against a real broker over TCP: `security.tokens_file`
//! maps tokens to principals, HELLO must carry one, and a group member's
//! name belongs to the principal that polls under it.

mod groups_common;

use felix_client::{
    Client, ClientConfig, ClientError, GroupMember, GroupPollOptions, StartPosition, StreamOptions,
};
use felix_tests::BrokerOptions;
use felix_wire::ErrorCode;
use groups_common::{offsets, opts, publish, stream, Group, JOBS, NS, T};

/// `printf %s alice-secret | sha256sum`, and bob's.
const ALICE: &str = "0c848abb03307b06cf70cd4e29c157dc81af5e94ab3eb1d0c59a120269572376";
const BOB: &str = "9f03ef1533a68d2f506f81ef463c1183a82a6bd40e45613f36e6fe1889cf1b99";

/// A tokens file kept as long as the value.
struct TokensFile {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
}

fn tokens_file(text: &str) -> TokensFile {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokens");
    std::fs::write(&path, text).unwrap();
    TokensFile { _dir: dir, path }
}

fn with_tokens(o: BrokerOptions, f: &TokensFile) -> BrokerOptions {
    o.env("FELIX_TOKENS_FILE", f.path.display())
}

async fn connect(addr: &str, token: Option<&str>) -> Result<Client, ClientError> {
    let config = ClientConfig {
        token: token.map(str::to_string),
        ..ClientConfig::default()
    };
    Client::connect(addr, config).await
}

fn refused(r: Result<Client, ClientError>) -> String {
    match r {
        Err(e) => {
            assert_eq!(e.code(), Some(ErrorCode::Unauthorized), "{e}");
            e.to_string()
        }
        Ok(c) => panic!("connected: {c:?}"),
    }
}

#[tokio::test]
async fn a_broker_with_tokens_lets_in_only_the_tokens_it_lists() {
    let f = tokens_file(&format!("# who may connect\nalice {ALICE}\nbob {BOB}\n"));
    let b = felix_tests::start_broker!(with_tokens(BrokerOptions::default(), &f));
    let no_token = refused(connect(&b.addr, None).await);
    assert!(no_token.contains("requires a token"), "{no_token}");
    let wrong = refused(connect(&b.addr, Some("alice-secreT")).await);
    assert!(wrong.contains("unknown token"), "{wrong}");
    assert_eq!(b.metric("felix_errors_total{code=\"unauthorized\"}"), 2.0);

    // The right token works, on every core: the two shards sit on the
    // broker's two cores, and a connection handed to the other core
    // authenticates there.
    let alice = connect(&b.addr, Some("alice-secret")).await.expect("alice");
    assert_eq!(alice.cores(), 2);
    alice
        .create_stream(T, NS, "wide", 2, StreamOptions::default())
        .await
        .expect("create");
    for shard in 0..2 {
        alice
            .publish(T, NS, "wide", shard, "hi")
            .await
            .expect("publish");
    }
    let bob = connect(&b.addr, Some("bob-secret")).await.expect("bob");
    for shard in 0..2 {
        let read = bob
            .read(T, NS, "wide", shard, StartPosition::Earliest, 10, None)
            .await
            .expect("read");
        assert_eq!(read.records.len(), 1);
    }
}

#[tokio::test]
async fn a_broker_without_tokens_refuses_a_token_rather_than_ignore_it() {
    let b = felix_tests::start_broker!(BrokerOptions::default());
    let e = refused(connect(&b.addr, Some("alice-secret")).await);
    assert!(e.contains("does not authenticate"), "{e}");
    connect(&b.addr, None).await.expect("anonymous");
}

#[test]
fn a_bad_tokens_file_stops_the_broker_at_start_with_its_line() {
    let f = tokens_file(&format!("alice {ALICE}\nbob not-a-digest\n"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_felix-test-broker"))
        .args(["-", "127.0.0.1:0", "1"])
        .env("FELIX_TOKENS_FILE", &f.path)
        .env("FELIX_METRICS_LISTEN", "")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("line 2") && err.contains("not a SHA-256 digest"),
        "{err}"
    );
}

/// The guide: "The names belong to the principal you authenticate as, so
/// another principal using the same name gets nothing of yours."
#[tokio::test]
async fn a_member_name_belongs_to_its_principal() {
    let f = tokens_file(&format!("alice {ALICE}\nbob {BOB}\n"));
    let b = felix_tests::start_broker!(with_tokens(opts(30_000, 5), &f));
    let alice = connect(&b.addr, Some("alice-secret")).await.expect("alice");
    stream(&alice, JOBS).await;
    publish(&alice, JOBS, 3).await;
    let worker = GroupMember::new("worker-1").reclaim(true);
    let held = Group::new(&alice, JOBS, "workers")
        .poll_as(&worker, GroupPollOptions::default())
        .await;
    assert_eq!(offsets(&held), vec![0, 1, 2]);

    // Bob, on a new connection under the same member name with reclaim set,
    // takes nothing of Alice's: the records stay claimed.
    let bob = connect(&b.addr, Some("bob-secret")).await.expect("bob");
    let bobs = Group::new(&bob, JOBS, "workers");
    assert!(bobs
        .poll_as(&worker, GroupPollOptions::default())
        .await
        .is_empty());

    // Alice restarted (a new connection, same token) takes them all back.
    let alice2 = connect(&b.addr, Some("alice-secret")).await.expect("alice");
    let back = Group::new(&alice2, JOBS, "workers")
        .poll_as(&worker, GroupPollOptions::default())
        .await;
    assert_eq!(offsets(&back), vec![0, 1, 2]);
    assert!(back.iter().all(|r| r.attempts == 2));
    // Acks are not tied to a principal (claims do not say who holds them).
    bobs.ack_many(&[0, 1, 2]).await.expect("ack");
    let info = alice2
        .group_describe(T, NS, JOBS, 0, "workers")
        .await
        .unwrap();
    assert_eq!((info.position, info.in_flight), (3, 0));
}
