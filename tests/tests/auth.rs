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

/// A tokens or permissions file, kept as long as the value.
struct SecurityFile {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
}

fn security_file(text: &str) -> SecurityFile {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("security");
    std::fs::write(&path, text).unwrap();
    SecurityFile { _dir: dir, path }
}

fn with_tokens(o: BrokerOptions, f: &SecurityFile) -> BrokerOptions {
    o.env("FELIX_TOKENS_FILE", f.path.display())
}

async fn connect(addr: &str, token: Option<&str>) -> Result<Client, ClientError> {
    let config = ClientConfig {
        token: token.map(str::to_string),
        ..ClientConfig::default()
    };
    Client::connect(addr, config).await
}

#[tokio::test]
async fn a_broker_with_tokens_lets_in_only_the_tokens_it_lists() {
    let f = security_file(&format!("# who may connect\nalice {ALICE}\nbob {BOB}\n"));
    let b = felix_tests::start_broker!(with_tokens(BrokerOptions::default(), &f));
    let no_token = denied(connect(&b.addr, None).await);
    assert!(no_token.contains("requires a token"), "{no_token}");
    let wrong = denied(connect(&b.addr, Some("alice-secreT")).await);
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
    let e = denied(connect(&b.addr, Some("alice-secret")).await);
    assert!(e.contains("does not authenticate"), "{e}");
    connect(&b.addr, None).await.expect("anonymous");
}

/// Start an in-memory broker with `var` naming `f`; it must fail to
/// start. Returns what it said on stderr.
fn start_fails(var: &str, f: &SecurityFile) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_felix-test-broker"))
        .args(["-", "127.0.0.1:0", "1"])
        .env(var, &f.path)
        .env("FELIX_METRICS_LISTEN", "")
        .output()
        .unwrap();
    assert!(!out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_bad_tokens_file_stops_the_broker_at_start_with_its_line() {
    let f = security_file(&format!("alice {ALICE}\nbob not-a-digest\n"));
    let err = start_fails("FELIX_TOKENS_FILE", &f);
    assert!(
        err.contains("line 2") && err.contains("not a SHA-256 digest"),
        "{err}"
    );
}

/// The guide: "The names belong to the principal you authenticate as, so
/// another principal using the same name gets nothing of yours."
#[tokio::test]
async fn a_member_name_belongs_to_its_principal() {
    let f = security_file(&format!("alice {ALICE}\nbob {BOB}\n"));
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

/// HELLO (with `token`, asking for `want_core`) and a CreateStream, sent in
/// one write; the answers read until the broker closes the connection.
async fn hello_then_create(
    addr: &str,
    token: Option<&str>,
    want_core: Option<u32>,
) -> Vec<felix_wire::Response> {
    hello_then_create_bytes(addr, token, want_core, |_| {}).await
}

/// [`hello_then_create`], the encoded requests changed by `mangle` first.
async fn hello_then_create_bytes(
    addr: &str,
    token: Option<&str>,
    want_core: Option<u32>,
    mangle: impl FnOnce(&mut [u8]),
) -> Vec<felix_wire::Response> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut out = bytes::BytesMut::new();
    let hello = felix_wire::Request::Hello {
        version: felix_wire::PROTOCOL_VERSION,
        features: felix_wire::FEATURES_ALL,
        want_core,
        client_name: "raw".into(),
        token: token.map(str::to_string),
    };
    felix_wire::encode_request(1, &hello, &mut out);
    let create = felix_wire::Request::CreateStream {
        stream: felix_wire::StreamRef::new(T, NS, "sneaky"),
        shards: 1,
        retention_bytes: None,
        retention_ms: None,
        incarnation: None,
    };
    felix_wire::encode_request(2, &create, &mut out);
    mangle(&mut out);
    s.write_all(&out).await.unwrap();
    let mut buf = bytes::BytesMut::new();
    let mut answers = Vec::new();
    loop {
        while let Some((_, r)) = felix_wire::decode_response(&mut buf, 64 << 20).unwrap() {
            answers.push(r);
        }
        if answers.len() == 2 {
            return answers;
        }
        let mut chunk = [0u8; 4096];
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return answers,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

fn code_of(r: &felix_wire::Response) -> Option<ErrorCode> {
    match r {
        felix_wire::Response::Error(e) => Some(e.code),
        _ => None,
    }
}

#[tokio::test]
async fn a_request_behind_a_refused_hello_is_not_served_on_any_core() {
    let f = security_file(&format!("alice {ALICE}\n"));
    let b = felix_tests::start_broker!(with_tokens(BrokerOptions::default(), &f));
    // Whichever core accepts the connection, with or without a hand-off to
    // the other: the HELLO is refused and the create behind it never runs.
    for want in [None, Some(0), Some(1)] {
        for token in [None, Some("wrong")] {
            let answers = hello_then_create(&b.addr, token, want).await;
            assert_eq!(answers.len(), 1, "{want:?} {token:?}: {answers:?}");
            assert_eq!(code_of(&answers[0]), Some(ErrorCode::Unauthorized));
        }
        // A token that is not UTF-8 is refused with the connection too.
        let answers = hello_then_create_bytes(&b.addr, Some("alice-secret"), want, |out| {
            let at = out
                .windows(12)
                .position(|w| w == b"alice-secret")
                .expect("the token");
            out[at..at + 3].copy_from_slice(b"\xff\xfe\x00");
        })
        .await;
        assert_eq!(answers.len(), 1, "{want:?} non-UTF-8: {answers:?}");
        assert_eq!(code_of(&answers[0]), Some(ErrorCode::InvalidRequest));
    }
    // A right token works on whichever core the connection asks for, the
    // other one included (the kernel spreads connections over both
    // listeners, so asking for each in turn soon needs a hand-off).
    let mut created = 0;
    for i in 0..40u32 {
        let want = i % 2;
        let answers = hello_then_create(&b.addr, Some("alice-secret"), Some(want)).await;
        assert!(
            matches!(answers[0], felix_wire::Response::HelloOk { core, .. } if core == want),
            "{answers:?}"
        );
        match code_of(&answers[1]) {
            None => created += 1,
            Some(ErrorCode::AlreadyExists) => {}
            other => panic!("{other:?}: {answers:?}"),
        }
        if i >= 1 && b.metric("felix_connection_handoffs_total") >= 1.0 {
            break;
        }
    }
    assert_eq!(created, 1);
    assert!(b.metric("felix_connection_handoffs_total") >= 1.0);
    let alice = connect(&b.addr, Some("alice-secret")).await.unwrap();
    let names: Vec<String> = alice
        .list_streams(None)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.stream.to_string())
        .collect();
    assert_eq!(names, ["t/ns/sneaky"], "created once, by alice");
}

// ----------------------------------------------------------- permissions

/// A broker with alice and bob, and `acl` as its permissions.
fn acl_broker(acl: &str) -> (SecurityFile, SecurityFile, felix_tests::Broker) {
    let tokens = security_file(&format!("alice {ALICE}\nbob {BOB}\n"));
    let acl_file = security_file(acl);
    let b = felix_tests::start_broker!(
        with_tokens(opts(30_000, 5), &tokens).env("FELIX_ACL_FILE", acl_file.path.display())
    );
    (tokens, acl_file, b)
}

/// The call (or the connection) was refused as `unauthorized`: its message.
fn denied<T: std::fmt::Debug>(r: Result<T, ClientError>) -> String {
    match r {
        Err(e) => {
            assert_eq!(e.code(), Some(ErrorCode::Unauthorized), "{e}");
            e.to_string()
        }
        Ok(v) => panic!("allowed: {v:?}"),
    }
}

#[tokio::test]
async fn each_call_needs_its_permission() {
    let (_t, _a, b) = acl_broker(
        "alice *              *\n\
         bob   stream.publish t/ns/jobs\n\
         bob   group.consume  group:t/ns/jobs/workers\n",
    );
    let alice = connect(&b.addr, Some("alice-secret")).await.unwrap();
    let bob = connect(&b.addr, Some("bob-secret")).await.unwrap();
    stream(&alice, JOBS).await;
    alice
        .create_stream(T, NS, "private", 1, StreamOptions::default())
        .await
        .unwrap();

    // Bob publishes to jobs but may not read it, manage it or touch others.
    bob.publish(T, NS, JOBS, 0, "b").await.expect("publish");
    let e = denied(
        bob.read(T, NS, JOBS, 0, StartPosition::Earliest, 10, None)
            .await,
    );
    assert!(
        e.contains("bob may not stream.subscribe on t/ns/jobs"),
        "{e}"
    );
    denied(bob.delete_stream(T, NS, JOBS).await);
    denied(bob.publish(T, NS, "private", 0, "b").await);
    denied(bob.describe_stream(T, NS, "private").await);
    // Lists leave out what he holds nothing on.
    let seen: Vec<String> = bob
        .list_streams(None)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.stream.to_string())
        .collect();
    assert_eq!(seen, ["t/ns/jobs"]);

    // His group: poll and ack, but not redrive or seek; other groups: nothing.
    let workers = Group::new(&bob, JOBS, "workers");
    let got = workers.poll(10).await;
    assert_eq!(offsets(&got), vec![0]);
    workers.ack_all(&got).await;
    let e = denied(bob.group_redrive(T, NS, JOBS, 0, "workers", 0).await);
    assert!(e.contains("group.manage"), "{e}");
    denied(
        bob.group_seek(T, NS, JOBS, 0, "workers", StartPosition::Earliest)
            .await,
    );
    denied(bob.group_poll(T, NS, JOBS, 0, "others", 10).await);
    alice
        .group_poll(T, NS, JOBS, 0, "others", 10)
        .await
        .unwrap();
    assert_eq!(bob.list_groups(T, NS, JOBS, 0).await.unwrap(), ["workers"]);
    assert_eq!(
        alice.list_groups(T, NS, JOBS, 0).await.unwrap(),
        ["others", "workers"]
    );
    assert_eq!(b.metric("felix_errors_total{code=\"unauthorized\"}"), 7.0);
}

#[tokio::test]
async fn subscribe_grants_consume_and_manage_grants_group_manage() {
    let (_t, _a, b) = acl_broker(
        "alice *                *\n\
         bob   stream.subscribe t/*/*\n\
         *     stream.manage    t/ns/shared\n",
    );
    let alice = connect(&b.addr, Some("alice-secret")).await.unwrap();
    let bob = connect(&b.addr, Some("bob-secret")).await.unwrap();
    stream(&alice, JOBS).await;
    publish(&alice, JOBS, 2).await;
    // stream.subscribe: read, and consume any group, but not manage one.
    assert_eq!(
        bob.read(T, NS, JOBS, 0, StartPosition::Earliest, 10, None)
            .await
            .unwrap()
            .records
            .len(),
        2
    );
    let got = Group::new(&bob, JOBS, "any").poll(10).await;
    assert_eq!(offsets(&got), vec![0, 1]);
    denied(bob.group_delete(T, NS, JOBS, 0, "any").await);
    // stream.manage (granted to everyone, on one stream): create it, and
    // manage its groups.
    bob.create_stream(T, NS, "shared", 1, StreamOptions::default())
        .await
        .unwrap();
    bob.group_create(T, NS, "shared", 0, "g", StartPosition::Earliest)
        .await
        .unwrap();
    denied(
        bob.create_stream(T, NS, "other", 1, StreamOptions::default())
            .await,
    );
}

#[test]
fn a_bad_acl_file_stops_the_broker_at_start_with_its_line() {
    let f = security_file("alice stream.publish t/ns/s\nbob stream.write t/ns/s\n");
    let err = start_fails("FELIX_ACL_FILE", &f);
    assert!(
        err.contains("line 2") && err.contains("unknown permission"),
        "{err}"
    );
}

#[tokio::test]
async fn without_tokens_the_permissions_are_the_anonymous_principals() {
    let acl_file = security_file(
        "anonymous stream.manage  t/*/*\n\
         anonymous stream.publish t/ns/jobs\n",
    );
    let b =
        felix_tests::start_broker!(opts(30_000, 5).env("FELIX_ACL_FILE", acl_file.path.display()));
    let c = connect(&b.addr, None).await.unwrap();
    stream(&c, JOBS).await;
    publish(&c, JOBS, 1).await;
    let e = denied(
        c.read(T, NS, JOBS, 0, StartPosition::Earliest, 10, None)
            .await,
    );
    assert!(
        e.contains("anonymous may not stream.subscribe on t/ns/jobs"),
        "{e}"
    );
    denied(
        c.create_stream("u", NS, JOBS, 1, StreamOptions::default())
            .await,
    );
    let listed: Vec<String> = c
        .list_streams(Some(T))
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.stream.to_string())
        .collect();
    assert_eq!(listed, ["t/ns/jobs"]);
    assert!(c.list_streams(Some("u")).await.unwrap().is_empty());
}

/// SIGHUP reads the tokens and permissions files again: a new token lets
/// its principal in, new grants apply to open connections at once, and a
/// file that no longer parses leaves what is in force untouched.
#[tokio::test]
async fn tokens_and_permissions_are_read_again_on_sighup() {
    let tokens = security_file(&format!("alice {ALICE}\n"));
    let acl = security_file("alice * *\n");
    let b =
        felix_tests::start_broker!(with_tokens(BrokerOptions::default(), &tokens)
            .env("FELIX_ACL_FILE", acl.path.display()));
    let alice = connect(&b.addr, Some("alice-secret")).await.unwrap();
    stream(&alice, JOBS).await;
    denied(connect(&b.addr, Some("bob-secret")).await);
    let pid = b.pid() as i32;
    // SAFETY: kill(2) on the broker this test started.
    let hup = || assert_eq!(unsafe { libc::kill(pid, libc::SIGHUP) }, 0);

    // Bob gets a token and may publish; alice loses nothing.
    std::fs::write(&tokens.path, format!("alice {ALICE}\nbob {BOB}\n")).unwrap();
    std::fs::write(&acl.path, "alice * *\nbob stream.publish t/ns/jobs\n").unwrap();
    hup();
    groups_common::eventually(
        "bob's token to be read",
        std::time::Duration::from_secs(10),
        || {
            let addr = b.addr.clone();
            async move { connect(&addr, Some("bob-secret")).await.is_ok() }
        },
    )
    .await;
    let bob = connect(&b.addr, Some("bob-secret")).await.unwrap();
    bob.publish(T, NS, JOBS, 0, "b").await.expect("publish");
    denied(
        bob.read(T, NS, JOBS, 0, StartPosition::Earliest, 10, None)
            .await,
    );

    // A broken file is refused whole: bob keeps what he had.
    let reloads = |result: &str| {
        b.metric(&format!(
            "felix_security_reloads_total{{result=\"{result}\"}}"
        ))
    };
    assert_eq!((reloads("ok"), reloads("failed")), (1.0, 0.0));
    std::fs::write(&acl.path, "bob stream.subscribe\n").unwrap();
    hup();
    groups_common::eventually(
        "the failed reload",
        std::time::Duration::from_secs(10),
        || async { reloads("failed") == 1.0 },
    )
    .await;
    bob.publish(T, NS, JOBS, 0, "b").await.expect("publish");
    denied(
        bob.read(T, NS, JOBS, 0, StartPosition::Earliest, 10, None)
            .await,
    );
    // New grants reach connections already open.
    std::fs::write(
        &acl.path,
        "alice * *\nbob stream.publish t/ns/jobs\nbob stream.subscribe t/ns/jobs\n",
    )
    .unwrap();
    hup();
    groups_common::eventually(
        "the second reload",
        std::time::Duration::from_secs(10),
        || async { reloads("ok") == 2.0 },
    )
    .await;
    let read = bob
        .read(T, NS, JOBS, 0, StartPosition::Earliest, 10, None)
        .await;
    assert_eq!(read.expect("read").records.len(), 2);
    alice
        .publish(T, NS, JOBS, 0, "a")
        .await
        .expect("alice keeps hers");
}
