//! The README's tour, run for real: `felix serve` on a temporary durable
//! directory, then the CLI commands a newcomer types, checking what they
//! print and their exit codes.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Output, Stdio};

struct Serve {
    child: Child,
    addr: String,
    _dir: tempfile::TempDir,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn felix() -> Command {
    Command::new(env!("CARGO_BIN_EXE_felix"))
}

fn serve() -> Serve {
    let dir = tempfile::tempdir().unwrap();
    let mut child = felix()
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--cores",
            "2",
            "--data-dir",
        ])
        .arg(dir.path())
        .env("FELIX_METRICS_LISTEN", "")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("felix serve");
    // Read the announcement on a helper thread (which then keeps draining
    // stdout), so a broker that never starts fails the test, not hangs it.
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(a) = line.strip_prefix("felix: listening on ") {
                let _ = tx.send(a.to_string());
            }
        }
    });
    let addr = match rx.recv_timeout(std::time::Duration::from_secs(60)) {
        Ok(a) => a,
        Err(e) => {
            let _ = child.kill();
            panic!("felix serve did not announce its address: {e}");
        }
    };
    Serve {
        child,
        addr,
        _dir: dir,
    }
}

fn run(s: &Serve, args: &[&str], stdin: Option<&str>) -> Output {
    let mut cmd = felix();
    cmd.arg("--broker").arg(&s.addr).args(args);
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    if let Some(input) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
    }
    child.wait_with_output().unwrap()
}

fn ok(s: &Serve, args: &[&str], stdin: Option<&str>) -> String {
    let out = run(s, args, stdin);
    assert!(
        out.status.success(),
        "felix {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_readme_tour_works() {
    let s = serve();
    ok(
        &s,
        &["stream", "create", "demo/default/jobs", "--shards", "4"],
        None,
    );
    assert!(ok(&s, &["stream", "list"], None).contains("demo/default/jobs"));
    let input = "job-1\njob-2\njob-3\njob-4\njob-5\n";
    let out = run(
        &s,
        &["publish", "demo/default/jobs", "--shard", "0"],
        Some(input),
    );
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("published 5 records"));
    let json = ok(
        &s,
        &[
            "read",
            "demo/default/jobs",
            "--shard",
            "0",
            "--from",
            "earliest",
            "--format",
            "json",
        ],
        None,
    );
    let rows: Vec<serde_json::Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 5);
    assert_eq!(rows[0]["offset"], 0);
    assert_eq!(rows[4]["payload"], "job-5");
    let text = ok(
        &s,
        &[
            "consume",
            "demo/default/jobs",
            "--shard",
            "0",
            "--group",
            "workers",
            "--count",
            "3",
        ],
        None,
    );
    assert_eq!(
        text.lines().collect::<Vec<_>>(),
        vec!["job-1", "job-2", "job-3"]
    );
    let desc = ok(
        &s,
        &[
            "group",
            "describe",
            "demo/default/jobs",
            "--shard",
            "0",
            "--group",
            "workers",
        ],
        None,
    );
    assert!(
        desc.lines()
            .any(|l| l.starts_with("position") && l.trim_end().ends_with('3')),
        "{desc}"
    );
    ok(
        &s,
        &[
            "group",
            "dead-letters",
            "demo/default/jobs",
            "--shard",
            "0",
            "--group",
            "workers",
        ],
        None,
    );
}

#[test]
fn errors_go_to_stderr_with_a_nonzero_exit() {
    let s = serve();
    let out = run(&s, &["read", "no/such/stream", "--shard", "0"], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("error: not_found:"));
    let out = run(
        &s,
        &["stream", "create", "bad name/x/y", "--shards", "1"],
        None,
    );
    assert_eq!(out.status.code(), Some(1));
    let out = run(&s, &["stream", "create"], None);
    assert_eq!(out.status.code(), Some(2), "usage error");
}

#[test]
fn print_config_shows_where_each_value_came_from() {
    let out = felix()
        .args(["serve", "--print-config", "--listen", "127.0.0.1:9999"])
        .env("FELIX_GROUP_MAX_ATTEMPTS", "9")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("listen = \"127.0.0.1:9999\"  # from flag --listen"),
        "{text}"
    );
    assert!(
        text.contains("max_attempts = 9  # from env FELIX_GROUP_MAX_ATTEMPTS"),
        "{text}"
    );
}

/// A description printed as `name  value` lines, by name.
fn fields(text: &str) -> std::collections::HashMap<String, String> {
    text.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(char::is_whitespace)?;
            Some((k.to_string(), v.trim().to_string()))
        })
        .collect()
}

/// `felix read ... --format json` as JSON values, one per line.
fn json_rows(out: &str) -> Vec<serde_json::Value> {
    out.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[test]
fn publish_takes_several_messages_as_arguments() {
    let s = serve();
    ok(
        &s,
        &["stream", "create", "t/ns/args", "--shards", "2"],
        None,
    );
    let out = run(
        &s,
        &[
            "publish",
            "t/ns/args",
            "--shard",
            "1",
            "first",
            "second",
            "third one",
        ],
        None,
    );
    assert!(out.status.success(), "{out:?}");
    assert!(out.stdout.is_empty(), "publish prints to stderr only");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("published 3 records"),
        "{out:?}"
    );
    // One record per argument, in order, on the shard asked for.
    let text = ok(&s, &["read", "t/ns/args", "--shard", "1"], None);
    assert_eq!(
        text.lines().collect::<Vec<_>>(),
        vec!["first", "second", "third one"]
    );
    assert_eq!(ok(&s, &["read", "t/ns/args", "--shard", "0"], None), "");
}

#[test]
fn publish_with_a_key_goes_to_the_keys_shard_and_stores_the_key() {
    let s = serve();
    let shards = 4u32;
    ok(
        &s,
        &["stream", "create", "t/ns/keyed", "--shards", "4"],
        None,
    );
    for key in ["alpha", "beta", "gamma"] {
        let m1 = format!("{key}-1");
        let m2 = format!("{key}-2");
        let out = run(&s, &["publish", "t/ns/keyed", "--key", key, &m1, &m2], None);
        assert!(out.status.success(), "{out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("published 2 records"));
    }
    let mut seen = 0;
    for shard in 0..shards {
        let json = ok(
            &s,
            &[
                "read",
                "t/ns/keyed",
                "--shard",
                &shard.to_string(),
                "--format",
                "json",
            ],
            None,
        );
        let mut per_key: std::collections::HashMap<String, Vec<String>> = Default::default();
        for row in json_rows(&json) {
            let key = row["key"].as_str().expect("a key").to_string();
            assert_eq!(row["key_encoding"], "utf8");
            assert_eq!(
                shard,
                felix_client::shard_for_key(key.as_bytes(), shards),
                "{key} on shard {shard}"
            );
            per_key
                .entry(key)
                .or_default()
                .push(row["payload"].as_str().unwrap().to_string());
            seen += 1;
        }
        for (key, payloads) in per_key {
            assert_eq!(payloads, vec![format!("{key}-1"), format!("{key}-2")]);
        }
    }
    assert_eq!(seen, 6);
    // A key and a shard together are a usage error.
    let out = run(
        &s,
        &["publish", "t/ns/keyed", "--key", "k", "--shard", "0", "x"],
        None,
    );
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn read_count_stops_after_that_many_records() {
    let s = serve();
    ok(
        &s,
        &["stream", "create", "t/ns/count", "--shards", "1"],
        None,
    );
    ok(
        &s,
        &["publish", "t/ns/count", "r0", "r1", "r2", "r3", "r4"],
        None,
    );
    let lines =
        |args: &[&str]| -> Vec<String> { ok(&s, args, None).lines().map(str::to_string).collect() };
    assert_eq!(
        lines(&["read", "t/ns/count", "--count", "2"]),
        vec!["r0", "r1"]
    );
    assert_eq!(
        lines(&["read", "t/ns/count", "--from", "3", "--count", "1"]),
        vec!["r3"]
    );
    // More than there are: stops at the tail.
    assert_eq!(lines(&["read", "t/ns/count", "--count", "50"]).len(), 5);
    assert!(lines(&["read", "t/ns/count", "--count", "0"]).is_empty());
}

#[test]
fn read_from_latest_skips_what_is_there_and_follows_what_arrives() {
    let s = serve();
    ok(
        &s,
        &["stream", "create", "t/ns/latest", "--shards", "1"],
        None,
    );
    ok(&s, &["publish", "t/ns/latest", "old-1", "old-2"], None);
    // Without --follow a read from the tail has nothing to print.
    let out = run(&s, &["read", "t/ns/latest", "--from", "latest"], None);
    assert!(out.status.success(), "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
    // The tail as an offset is the same place.
    assert_eq!(ok(&s, &["read", "t/ns/latest", "--from", "2"], None), "");
    // Past the tail is refused.
    let out = run(&s, &["read", "t/ns/latest", "--from", "3"], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("error: invalid_request:"));
    // With --follow: the old records never show, new ones do. The follower
    // takes the tail when it starts, which this test cannot observe, so
    // publish numbered records until one shows up; that one and every one
    // after it must come out, in order.
    let mut follower = felix()
        .arg("--broker")
        .arg(&s.addr)
        .args(["read", "t/ns/latest", "--from", "latest", "--follow"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let lines = follow_lines(&mut follower);
    let mut sent = 0;
    let first = loop {
        ok(
            &s,
            &["publish", "t/ns/latest", &format!("new-{sent}")],
            None,
        );
        sent += 1;
        match lines.recv_timeout(std::time::Duration::from_millis(200)) {
            Ok(line) => break line,
            Err(_) => assert!(sent < 150, "`read --from latest --follow` printed nothing"),
        }
    };
    let first: usize = first
        .strip_prefix("new-")
        .unwrap_or_else(|| panic!("printed {first:?}, not a new record"))
        .parse()
        .unwrap();
    ok(&s, &["publish", "t/ns/latest", "last"], None);
    for i in first + 1..sent {
        assert_eq!(next_line(&lines), format!("new-{i}"));
    }
    assert_eq!(next_line(&lines), "last");
    let _ = follower.kill();
    let _ = follower.wait();
}

/// The lines a running `felix read --follow` prints, as they come.
fn follow_lines(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

fn next_line(rx: &std::sync::mpsc::Receiver<String>) -> String {
    rx.recv_timeout(std::time::Duration::from_secs(30))
        .expect("no line from `read --follow` within 30s")
}

#[test]
fn read_follow_prints_records_as_they_arrive() {
    let s = serve();
    ok(
        &s,
        &["stream", "create", "t/ns/tail", "--shards", "1"],
        None,
    );
    ok(&s, &["publish", "t/ns/tail", "already-there"], None);
    let mut follower = felix()
        .arg("--broker")
        .arg(&s.addr)
        .args(["read", "t/ns/tail", "--follow"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let lines = follow_lines(&mut follower);
    assert_eq!(next_line(&lines), "already-there");
    // It is now at the tail; each publish shows up as it lands.
    for m in ["live-1", "live-2"] {
        ok(&s, &["publish", "t/ns/tail", m], None);
        assert_eq!(next_line(&lines), m);
    }
    assert!(
        follower.try_wait().unwrap().is_none(),
        "--follow keeps running at the tail"
    );
    let _ = follower.kill();
    let _ = follower.wait();
}

#[test]
fn read_format_text_prints_payloads_and_json_prints_every_field() {
    let s = serve();
    ok(&s, &["stream", "create", "t/ns/fmt", "--shards", "1"], None);
    ok(&s, &["publish", "t/ns/fmt", "plain"], None);
    ok(&s, &["publish", "t/ns/fmt", "--key", "k1", "keyed"], None);
    // A line that is not UTF-8, from stdin.
    let mut p = felix()
        .arg("--broker")
        .arg(&s.addr)
        .args(["publish", "t/ns/fmt"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    p.stdin.take().unwrap().write_all(b"\xff\xfebin\n").unwrap();
    let out = p.wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");

    let text = ok(&s, &["read", "t/ns/fmt", "--format", "text"], None);
    assert_eq!(text, "plain\nkeyed\n\u{fffd}\u{fffd}bin\n");
    assert_eq!(
        ok(&s, &["read", "t/ns/fmt"], None),
        text,
        "text is the default"
    );

    let rows = json_rows(&ok(&s, &["read", "t/ns/fmt", "--format", "json"], None));
    assert_eq!(rows.len(), 3);
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(row["offset"], i as u64);
        assert!(row["timestamp"].as_u64().unwrap() > 0, "{row}");
    }
    assert_eq!(rows[0]["key"], serde_json::Value::Null);
    assert_eq!(rows[0]["payload"], "plain");
    assert_eq!(rows[0]["payload_encoding"], "utf8");
    assert_eq!(rows[1]["key"], "k1");
    assert_eq!(rows[1]["key_encoding"], "utf8");
    assert_eq!(rows[1]["payload"], "keyed");
    assert_eq!(rows[2]["payload"], "//5iaW4=");
    assert_eq!(rows[2]["payload_encoding"], "base64");
}

#[test]
fn stream_describe_shows_shards_retention_and_placement() {
    let s = serve();
    let created = ok(
        &s,
        &["stream", "create", "t/ns/desc", "--shards", "3"],
        None,
    );
    let desc = ok(&s, &["stream", "describe", "t/ns/desc"], None);
    assert_eq!(created, desc, "create prints the description");
    let f = fields(&desc);
    assert_eq!(f["stream"], "t/ns/desc");
    assert_eq!(f["shards"], "3");
    assert_eq!(f["retention_bytes"], "default");
    assert_eq!(f["retention_ms"], "default");
    let cores: Vec<u32> = f["placement"]
        .split_whitespace()
        .map(|c| c.parse().unwrap())
        .collect();
    assert_eq!(cores.len(), 3, "{desc}");
    assert!(cores.iter().all(|c| *c < 2), "serve runs 2 cores: {desc}");
    let out = run(&s, &["stream", "describe", "t/ns/nothing"], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("error: not_found:"));
}

#[test]
fn stream_delete_removes_the_stream_and_its_records() {
    let s = serve();
    ok(
        &s,
        &["stream", "create", "t/ns/gone", "--shards", "2"],
        None,
    );
    ok(
        &s,
        &["stream", "create", "t/ns/kept", "--shards", "1"],
        None,
    );
    ok(&s, &["publish", "t/ns/gone", "x", "y"], None);
    let out = ok(&s, &["stream", "delete", "t/ns/gone"], None);
    assert_eq!(out.trim_end(), "deleted t/ns/gone");
    for args in [
        &["stream", "describe", "t/ns/gone"][..],
        &["read", "t/ns/gone", "--shard", "0"][..],
        &["stream", "delete", "t/ns/gone"][..],
    ] {
        let out = run(&s, args, None);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).starts_with("error: not_found:"),
            "{args:?}: {out:?}"
        );
        assert!(out.stdout.is_empty(), "{args:?}: {out:?}");
    }
    let list = ok(&s, &["stream", "list"], None);
    assert!(!list.contains("t/ns/gone"), "{list}");
    assert!(list.contains("t/ns/kept"), "{list}");
    // The name is free again, and the new stream starts empty.
    ok(
        &s,
        &["stream", "create", "t/ns/gone", "--shards", "1"],
        None,
    );
    assert_eq!(ok(&s, &["read", "t/ns/gone"], None), "");
}

#[test]
fn stream_create_takes_retention_and_describe_shows_it() {
    let s = serve();
    ok(
        &s,
        &[
            "stream",
            "create",
            "t/ns/ret",
            "--shards",
            "1",
            "--retention-bytes",
            "1048576",
            "--retention-ms",
            "86400000",
        ],
        None,
    );
    ok(
        &s,
        &[
            "stream",
            "create",
            "t/ns/bytes-only",
            "--shards",
            "1",
            "--retention-bytes",
            "4096",
        ],
        None,
    );
    let f = fields(&ok(&s, &["stream", "describe", "t/ns/ret"], None));
    assert_eq!(f["retention_bytes"], "1048576");
    assert_eq!(f["retention_ms"], "86400000");
    let f = fields(&ok(&s, &["stream", "describe", "t/ns/bytes-only"], None));
    assert_eq!(f["retention_bytes"], "4096");
    assert_eq!(f["retention_ms"], "default");
    let list = ok(&s, &["stream", "list"], None);
    assert!(
        list.lines()
            .any(|l| l == "t/ns/ret\tshards=1\tretention_bytes=1048576\tretention_ms=86400000"),
        "{list}"
    );
    let out = run(
        &s,
        &[
            "stream",
            "create",
            "t/ns/bad",
            "--shards",
            "1",
            "--retention-ms",
            "soon",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(2), "usage error");
}
