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

/// A loopback address nothing listens on (a port bound and let go).
fn free_port_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

fn felix() -> Command {
    Command::new(env!("CARGO_BIN_EXE_felix"))
}

fn serve() -> Serve {
    serve_with(&[])
}

/// `felix serve` with extra settings as `FELIX_*` environment variables.
fn serve_with(env: &[(&str, &str)]) -> Serve {
    serve_in(tempfile::tempdir().unwrap(), env)
}

/// `felix serve` on `dir` (a broker's data directory, new or not).
fn serve_in(dir: tempfile::TempDir, env: &[(&str, &str)]) -> Serve {
    serve_on(dir, "127.0.0.1:0", env)
}

/// `felix serve` on `dir`, listening on `listen`.
/// Stop `s` with SIGTERM (it must exit 0) and start it again on the same
/// data directory and listen address.
fn restart_gracefully(mut s: Serve, listen: &str) -> Serve {
    let pid = s.child.id().to_string();
    let term = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(term.success());
    let status = s.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let dir = std::mem::replace(&mut s._dir, tempfile::tempdir().unwrap());
    serve_on(dir, listen, &[])
}

fn serve_on(dir: tempfile::TempDir, listen: &str, env: &[(&str, &str)]) -> Serve {
    let mut cmd = felix();
    cmd.args(["serve", "--listen", listen, "--cores", "2", "--data-dir"])
        .arg(dir.path())
        .env("FELIX_METRICS_LISTEN", "")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("felix serve");
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
    run_at(&s.addr, args, stdin)
}

/// `felix --broker ADDR ARGS...` (ADDR may list a cluster's brokers).
fn run_at(addr: &str, args: &[&str], stdin: Option<&str>) -> Output {
    let mut cmd = felix();
    cmd.arg("--broker").arg(addr).args(args);
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    if let Some(input) = stdin {
        // A command that stops reading early (and exits) closes the pipe.
        if let Err(e) = child.stdin.take().unwrap().write_all(input.as_bytes()) {
            assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "{e}");
        }
    }
    child.wait_with_output().unwrap()
}

fn ok(s: &Serve, args: &[&str], stdin: Option<&str>) -> String {
    ok_at(&s.addr, args, stdin)
}

fn ok_at(addr: &str, args: &[&str], stdin: Option<&str>) -> String {
    let out = run_at(addr, args, stdin);
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
    let out = run(
        &s,
        &["publish", "demo/default/jobs", "--key", "user-42"],
        Some("keyed\n"),
    );
    assert!(out.status.success(), "{out:?}");
    let json = ok(
        &s,
        &[
            "consume",
            "demo/default/jobs",
            "--all-shards",
            "--group",
            "everyone",
            "--format",
            "json",
        ],
        None,
    );
    let rows = json_rows(&json);
    assert_eq!(rows.len(), 6, "{json}");
    let keyed: Vec<_> = rows.iter().filter(|r| r["key"] == "user-42").collect();
    assert_eq!(keyed.len(), 1);
    assert_eq!(keyed[0]["payload"], "keyed");
    let shard = felix_client::shard_for_key(b"user-42", 4);
    assert_eq!(keyed[0]["shard"], shard);
}

#[test]
fn errors_go_to_stderr_with_a_nonzero_exit() {
    let s = serve();
    let out = run(&s, &["read", "no/such/stream", "--shard", "0"], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("error: not_found:"));
    // A name the broker would refuse is a usage error, caught before
    // anything is sent; a count of shards past its limit is the broker's.
    let out = run(
        &s,
        &["stream", "create", "bad name/x/y", "--shards", "1"],
        None,
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("tenant name \"bad name\" has ' '"));
    let out = run(
        &s,
        &["stream", "create", "a/x/y", "--shards", "99999"],
        None,
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("limits.max_shards"));
    let out = run(&s, &["stream", "create"], None);
    assert_eq!(out.status.code(), Some(2), "usage error");
    let out = run(&s, &["read", "a/x/y", "--shard", "1h"], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a whole number"));
}

/// A one-shard command run without --shard on a stream of several says
/// which shard it took, on stderr; its output is unchanged.
#[test]
fn a_left_out_shard_is_pointed_out_on_a_stream_of_several() {
    let s = serve();
    let ok = |args: &[&str]| {
        let out = run(&s, args, None);
        assert!(out.status.success(), "{args:?}: {out:?}");
        out
    };
    ok(&["stream", "create", "t/ns/four", "--shards", "4"]);
    ok(&["stream", "create", "t/ns/one", "--shards", "1"]);
    ok(&["publish", "t/ns/four", "--shard", "0", "a"]);
    ok(&["publish", "t/ns/one", "a"]);
    let note = "has 4 shards; this is shard 0";
    let out = ok(&["read", "t/ns/four", "--count", "1"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "a\n");
    assert!(String::from_utf8_lossy(&out.stderr).contains(note));
    let out = ok(&["read", "t/ns/four", "--shard", "0", "--count", "1"]);
    assert!(!String::from_utf8_lossy(&out.stderr).contains(note));
    let out = ok(&["read", "t/ns/one", "--count", "1"]);
    assert!(out.stderr.is_empty(), "{out:?}");
    let out = ok(&["consume", "t/ns/four", "--group", "g", "--count", "1"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("or --all-shards"));
    let out = ok(&[
        "group",
        "describe",
        "t/ns/four",
        "--group",
        "g",
        "--all-shards",
    ]);
    assert!(!String::from_utf8_lossy(&out.stderr).contains(note));
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

/// `felix ping` names the broker (its version and process), its cores and
/// every feature it offers.
#[test]
fn ping_names_the_broker_its_cores_and_features() {
    let s = serve();
    let out = fields(&ok(&s, &["ping"], None));
    let pid = s.child.id();
    assert_eq!(
        out["broker"],
        format!("felix {} (pid {pid})", env!("CARGO_PKG_VERSION"))
    );
    assert_eq!(out["cores"], "2");
    let features: Vec<&str> = out["features"].split(' ').collect();
    for f in [
        "groups",
        "group_admin",
        "publish_ack_mode",
        "error_not_applied",
    ] {
        assert!(features.contains(&f), "{features:?}");
    }
    // Cluster-only features are not offered by a single broker.
    assert!(!features.contains(&"cluster_info"), "{features:?}");
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
        let shard = felix_client::shard_for_key(key.as_bytes(), 4);
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(
            said.contains(&format!("published 2 records to shard {shard}")),
            "{said}"
        );
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
    assert_eq!(f["retention_bytes"], "none");
    assert_eq!(f["retention_ms"], "none");
    let cores: Vec<u32> = f["placement"]
        .split_whitespace()
        .map(|c| c.parse().unwrap())
        .collect();
    assert_eq!(cores.len(), 3, "{desc}");
    assert!(cores.iter().all(|c| *c < 2), "serve runs 2 cores: {desc}");
    // One row per shard, under a header, with its offsets and size.
    ok(
        &s,
        &["publish", "t/ns/desc", "--shard", "1"],
        Some("a\nb\n"),
    );
    let desc = ok(&s, &["stream", "describe", "t/ns/desc"], None);
    let rows: Vec<Vec<&str>> = desc
        .lines()
        .skip_while(|l| !l.starts_with("shard "))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows[0],
        [
            "shard",
            "core",
            "start_offset",
            "end_offset",
            "bytes",
            "stopped"
        ],
        "{desc}"
    );
    assert_eq!(rows.len(), 4, "{desc}");
    for (i, r) in rows[1..].iter().enumerate() {
        assert_eq!(r[0], i.to_string(), "{desc}");
        assert_eq!(r[1], cores[i].to_string(), "placement agrees: {desc}");
        assert_eq!(r[2], "0", "{desc}");
        assert_eq!(r[3], if i == 1 { "2" } else { "0" }, "{desc}");
        assert_eq!(r[5], "no", "{desc}");
    }
    assert!(rows[2][4].parse::<u64>().unwrap() > 0, "{desc}");
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
    assert_eq!(f["retention_ms"], "none");
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

// ----- consumer groups ------------------------------------------------------

/// `felix group describe` as `name -> value`.
fn describe(s: &Serve, stream: &str, group: &str) -> std::collections::HashMap<String, String> {
    fields(&ok(
        s,
        &["group", "describe", stream, "--group", group],
        None,
    ))
}

/// A failed command: exit 1, nothing on stdout, and `error: <code>: ...` on
/// stderr. Returns stderr.
fn fails_with(s: &Serve, args: &[&str], code: &str) -> String {
    let out = run(s, args, None);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "felix {args:?}: {out:?}");
    assert!(
        err.starts_with(&format!("error: {code}: ")),
        "felix {args:?}: wanted {code}, got {err:?}"
    );
    assert!(out.stdout.is_empty(), "felix {args:?}: {out:?}");
    err
}

/// `felix consume STREAM --group G ARGS...`: the payloads it printed, and
/// what it said on stderr.
fn consume(s: &Serve, stream: &str, group: &str, args: &[&str]) -> (Vec<String>, String) {
    let mut all = vec!["consume", stream, "--group", group, "--wait-ms", "200"];
    all.extend_from_slice(args);
    let out = run(s, &all, None);
    assert!(out.status.success(), "felix {all:?}: {out:?}");
    let lines = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    (lines, String::from_utf8_lossy(&out.stderr).to_string())
}

/// Only the payloads `consume` printed.
fn consumed(s: &Serve, stream: &str, group: &str, args: &[&str]) -> Vec<String> {
    consume(s, stream, group, args).0
}

/// A consumer that claims records and dies without acknowledging them (the
/// CLI's `consume` hands back what it cannot print, so this uses the client
/// library directly): they stay claimed until the claim lapses or a
/// reclaiming member takes them back. `args` takes `--count N` and
/// `--member NAME` as `felix consume` does.
fn consume_without_acking(s: &Serve, stream: &str, group: &str, args: &[&str]) {
    let mut count = 1000u32;
    let mut member = None;
    for pair in args.chunks(2) {
        match pair {
            ["--count", n] => count = n.parse().unwrap(),
            ["--member", m] => member = Some(m.to_string()),
            other => panic!("consume_without_acking: unsupported {other:?}"),
        }
    }
    let parts: Vec<&str> = stream.split('/').collect();
    let (t, n, st) = (parts[0], parts[1], parts[2]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let c =
            felix_client::Client::connect(s.addr.as_str(), felix_client::ClientConfig::default())
                .await
                .unwrap();
        let got = match member {
            Some(m) => {
                let opts = felix_client::GroupPollOptions {
                    max_records: count,
                    ..Default::default()
                };
                c.group_poll_as(t, n, st, 0, group, &felix_client::GroupMember::new(m), opts)
                    .await
                    .unwrap()
            }
            None => c.group_poll(t, n, st, 0, group, count).await.unwrap(),
        };
        assert!(!got.is_empty(), "nothing to claim");
        // Dropped without an ack: the claims stand.
    });
}

/// `felix group dead-letters --format json`, one value per dead letter.
fn dead_letters(s: &Serve, stream: &str, group: &str) -> Vec<serde_json::Value> {
    json_rows(&ok(
        s,
        &[
            "group",
            "dead-letters",
            stream,
            "--group",
            group,
            "--format",
            "json",
        ],
        None,
    ))
}

fn dead_letter_offsets(s: &Serve, stream: &str, group: &str) -> Vec<u64> {
    dead_letters(s, stream, group)
        .iter()
        .map(|d| d["offset"].as_u64().unwrap())
        .collect()
}

/// Poll `f` until it holds; a bounded wait for a claim to lapse.
fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !f() {
        assert!(
            std::time::Instant::now() < deadline,
            "still waiting for {what} after 60s"
        );
        std::thread::park_timeout(std::time::Duration::from_millis(50));
    }
}

/// A broker that dead-letters a record whose first claim lapses, with
/// claims that lapse after three seconds.
fn serve_one_attempt() -> Serve {
    serve_with(&[
        ("FELIX_GROUP_MAX_ATTEMPTS", "1"),
        ("FELIX_GROUP_VISIBILITY_TIMEOUT_MS", "3000"),
    ])
}

/// Publish `a`, `b`, `c` to a new one-shard stream and let the group's
/// claims on `a` and `b` lapse into dead letters.
fn two_dead_letters(s: &Serve, stream: &str, group: &str) {
    ok(s, &["stream", "create", stream, "--shards", "1"], None);
    ok(s, &["publish", stream, "a", "b", "c"], None);
    consume_without_acking(s, stream, group, &["--count", "2"]);
    wait_until("offsets 0 and 1 to be dead letters", || {
        dead_letter_offsets(s, stream, group) == [0, 1]
    });
}

#[test]
fn group_create_starts_where_asked_and_leaves_an_existing_group_alone() {
    let s = serve();
    let st = "t/ns/gcreate";
    ok(&s, &["stream", "create", st, "--shards", "1"], None);
    ok(&s, &["publish", st, "r0", "r1", "r2", "r3", "r4"], None);

    let out = ok(
        &s,
        &[
            "group", "create", st, "--group", "early", "--to", "earliest",
        ],
        None,
    );
    assert_eq!(
        out,
        "group early on t/ns/gcreate shard 0: created at earliest, unless it existed (an existing group is left where it was: `group seek` moves it)\n"
    );
    ok(
        &s,
        &["group", "create", st, "--group", "late", "--to", "latest"],
        None,
    );
    ok(
        &s,
        &["group", "create", st, "--group", "mid", "--to", "3"],
        None,
    );
    // --to defaults to earliest.
    ok(&s, &["group", "create", st, "--group", "dflt"], None);
    for (group, position, lag) in [
        ("early", "0", "5"),
        ("late", "5", "0"),
        ("mid", "3", "2"),
        ("dflt", "0", "5"),
    ] {
        let f = describe(&s, st, group);
        assert_eq!(f["group"], group);
        assert_eq!(f["position"], position, "{group}: {f:?}");
        assert_eq!(f["lag"], lag, "{group}: {f:?}");
        assert_eq!(f["end_offset"], "5", "{group}: {f:?}");
        assert_eq!(f["in_flight"], "0", "{group}: {f:?}");
    }
    assert_eq!(
        ok(&s, &["group", "list", st], None),
        "dflt\nearly\nlate\nmid\n"
    );

    // Creating a group that exists succeeds and changes nothing.
    assert_eq!(consumed(&s, st, "mid", &["--count", "1"]), ["r3"]);
    assert_eq!(describe(&s, st, "mid")["position"], "4");
    ok(
        &s,
        &["group", "create", st, "--group", "mid", "--to", "earliest"],
        None,
    );
    ok(
        &s,
        &["group", "create", st, "--group", "late", "--to", "0"],
        None,
    );
    assert_eq!(describe(&s, st, "mid")["position"], "4");
    assert_eq!(describe(&s, st, "late")["position"], "5");

    // Each group delivers from where it stands.
    ok(&s, &["publish", st, "r5"], None);
    assert_eq!(consumed(&s, st, "late", &[]), ["r5"]);
    assert_eq!(consumed(&s, st, "mid", &[]), ["r4", "r5"]);
    assert_eq!(consumed(&s, st, "early", &["--count", "2"]), ["r0", "r1"]);

    // A start past the tail is refused, and no group is made.
    fails_with(
        &s,
        &["group", "create", st, "--group", "far", "--to", "99"],
        "invalid_request",
    );
    fails_with(
        &s,
        &["group", "describe", st, "--group", "far"],
        "not_found",
    );
    assert_eq!(
        ok(&s, &["group", "list", st], None),
        "dflt\nearly\nlate\nmid\n"
    );
    fails_with(
        &s,
        &["group", "create", "t/ns/none", "--group", "g"],
        "not_found",
    );
}

#[test]
fn group_seek_replays_backwards_and_skips_forwards() {
    let s = serve();
    let st = "t/ns/gseek";
    ok(&s, &["stream", "create", st, "--shards", "1"], None);
    ok(&s, &["publish", st, "r0", "r1", "r2", "r3", "r4"], None);
    assert_eq!(consumed(&s, st, "g", &[]).len(), 5);
    assert_eq!(describe(&s, st, "g")["position"], "5");

    // Backwards: what was already acknowledged is delivered again.
    let out = ok(
        &s,
        &["group", "seek", st, "--group", "g", "--to", "2"],
        None,
    );
    assert_eq!(out, "group g on t/ns/gseek shard 0: moved to 2\n");
    let f = describe(&s, st, "g");
    assert_eq!((f["position"].as_str(), f["lag"].as_str()), ("2", "3"));
    assert_eq!(consumed(&s, st, "g", &[]), ["r2", "r3", "r4"]);
    assert_eq!(describe(&s, st, "g")["position"], "5");
    ok(
        &s,
        &["group", "seek", st, "--group", "g", "--to", "earliest"],
        None,
    );
    assert_eq!(describe(&s, st, "g")["position"], "0");
    assert_eq!(consumed(&s, st, "g", &["--count", "1"]), ["r0"]);

    // Forwards: what lies between is never delivered.
    ok(
        &s,
        &["group", "seek", st, "--group", "g", "--to", "4"],
        None,
    );
    assert_eq!(describe(&s, st, "g")["position"], "4");
    assert_eq!(consumed(&s, st, "g", &[]), ["r4"]);
    ok(
        &s,
        &["group", "seek", st, "--group", "g", "--to", "1"],
        None,
    );
    ok(
        &s,
        &["group", "seek", st, "--group", "g", "--to", "latest"],
        None,
    );
    let f = describe(&s, st, "g");
    assert_eq!((f["position"].as_str(), f["lag"].as_str()), ("5", "0"));
    assert!(consumed(&s, st, "g", &[]).is_empty());
    ok(&s, &["publish", st, "r5"], None);
    assert_eq!(consumed(&s, st, "g", &[]), ["r5"]);

    // A seek voids standing claims: records held by a consumer that never
    // acked go out again at once, not after the 30 s visibility timeout.
    ok(&s, &["publish", st, "r6", "r7"], None);
    consume_without_acking(&s, st, "g", &[]);
    assert_eq!(describe(&s, st, "g")["in_flight"], "2");
    assert!(consumed(&s, st, "g", &[]).is_empty(), "still claimed");
    ok(
        &s,
        &["group", "seek", st, "--group", "g", "--to", "6"],
        None,
    );
    let f = describe(&s, st, "g");
    assert_eq!(
        (f["position"].as_str(), f["in_flight"].as_str()),
        ("6", "0")
    );
    assert_eq!(consumed(&s, st, "g", &[]), ["r6", "r7"]);

    // Past the tail is refused and the group stays where it was; an
    // unknown group cannot be moved.
    fails_with(
        &s,
        &["group", "seek", st, "--group", "g", "--to", "99"],
        "invalid_request",
    );
    assert_eq!(describe(&s, st, "g")["position"], "8");
    fails_with(
        &s,
        &["group", "seek", st, "--group", "nobody", "--to", "0"],
        "not_found",
    );
    fails_with(
        &s,
        &["group", "describe", st, "--group", "nobody"],
        "not_found",
    );
}

#[test]
fn group_delete_removes_the_group() {
    let s = serve();
    let st = "t/ns/gdelete";
    ok(&s, &["stream", "create", st, "--shards", "1"], None);
    ok(&s, &["publish", st, "r0", "r1", "r2", "r3"], None);
    assert_eq!(consumed(&s, st, "g", &["--count", "2"]), ["r0", "r1"]);
    assert_eq!(consumed(&s, st, "kept", &["--count", "1"]), ["r0"]);
    assert_eq!(ok(&s, &["group", "list", st], None), "g\nkept\n");

    let out = ok(&s, &["group", "delete", st, "--group", "g"], None);
    assert_eq!(out, "group g on t/ns/gdelete shard 0: deleted\n");
    let err = fails_with(&s, &["group", "describe", st, "--group", "g"], "not_found");
    assert!(err.contains("group g "), "{err}");
    fails_with(
        &s,
        &["group", "dead-letters", st, "--group", "g"],
        "not_found",
    );
    fails_with(&s, &["group", "delete", st, "--group", "g"], "not_found");
    assert_eq!(ok(&s, &["group", "list", st], None), "kept\n");
    assert_eq!(describe(&s, st, "kept")["position"], "1");
    // The stream and its records are untouched.
    assert_eq!(ok(&s, &["read", st], None), "r0\nr1\nr2\nr3\n");

    // A later consume makes the group anew, from the start of the log.
    assert_eq!(consumed(&s, st, "g", &[]), ["r0", "r1", "r2", "r3"]);
    assert_eq!(describe(&s, st, "g")["position"], "4");
}

#[test]
fn group_redrive_makes_a_dead_letter_owed_again() {
    let s = serve_one_attempt();
    let st = "t/ns/redrive";
    two_dead_letters(&s, st, "g");

    let text = ok(&s, &["group", "dead-letters", st, "--group", "g"], None);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    for (i, line) in lines.iter().enumerate() {
        let cols: Vec<&str> = line.split('\t').collect();
        assert_eq!(cols[0], i.to_string(), "{line}");
        assert_eq!(cols[1], "attempts=1", "{line}");
        assert!(
            cols[2].starts_with("at=20") && cols[2].ends_with('Z'),
            "{line}"
        );
        assert_eq!(cols[3], "by=broker", "{line}");
        assert_eq!(cols[4], "reason=claim lapsed after attempt 1", "{line}");
    }
    // Dead letters are finished as far as the cursor goes.
    let f = describe(&s, st, "g");
    assert_eq!(f["dead_letters"], "2", "{f:?}");
    assert_eq!(f["position"], "2", "{f:?}");
    assert_eq!(f["owed"], "0", "{f:?}");
    assert_eq!(f["in_flight"], "0", "{f:?}");

    // By offset: owed again, delivered before the new record, attempts reset.
    let out = ok(
        &s,
        &["group", "redrive", st, "--group", "g", "--offset", "0"],
        None,
    );
    assert_eq!(out, "redrove 1 dead letter\n");
    assert_eq!(dead_letter_offsets(&s, st, "g"), [1]);
    let f = describe(&s, st, "g");
    assert_eq!((f["owed"].as_str(), f["dead_letters"].as_str()), ("1", "1"));
    let (out, err) = consume(&s, st, "g", &["--format", "json"]);
    let rows: Vec<serde_json::Value> = out
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let got: Vec<(u64, &str, u64)> = rows
        .iter()
        .map(|r| {
            (
                r["offset"].as_u64().unwrap(),
                r["payload"].as_str().unwrap(),
                r["attempts"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(got, [(0, "a", 1), (2, "c", 1)]);
    assert!(err.contains("consumed 2 records"), "{err}");
    assert_eq!(dead_letter_offsets(&s, st, "g"), [1]);
    let f = describe(&s, st, "g");
    assert_eq!(f["position"], "3", "{f:?}");
    assert_eq!(
        (
            f["owed"].as_str(),
            f["in_flight"].as_str(),
            f["dead_letters"].as_str()
        ),
        ("0", "0", "1")
    );

    // --all: every dead letter.
    let out = ok(&s, &["group", "redrive", st, "--group", "g", "--all"], None);
    assert_eq!(out, "redrove 1 dead letter\n");
    assert!(dead_letter_offsets(&s, st, "g").is_empty());
    assert_eq!(consumed(&s, st, "g", &[]), ["b"]);
    let f = describe(&s, st, "g");
    assert_eq!(
        (
            f["owed"].as_str(),
            f["dead_letters"].as_str(),
            f["position"].as_str()
        ),
        ("0", "0", "3")
    );
    assert!(consumed(&s, st, "g", &[]).is_empty());

    // Nothing left to redrive.
    let out = ok(&s, &["group", "redrive", st, "--group", "g", "--all"], None);
    assert_eq!(out, "redrove 0 dead letters\n");
    fails_with(
        &s,
        &["group", "redrive", st, "--group", "g", "--offset", "1"],
        "not_found",
    );
}

/// `group dead-letters` prints every dead letter of a list longer than one
/// page (the broker's pages hold at most 1,000), and `--from` / `--limit`
/// pick a window of it across page boundaries.
#[test]
fn group_dead_letters_prints_a_long_list_and_a_window_of_it() {
    let s = serve_one_attempt();
    let st = "t/ns/manydead";
    ok(&s, &["stream", "create", st, "--shards", "1"], None);
    let input: String = (0..2500).map(|i| format!("r{i}\n")).collect();
    ok(&s, &["publish", st], Some(&input));
    for _ in 0..3 {
        consume_without_acking(&s, st, "g", &["--count", "1000"]);
    }
    wait_until("2,500 dead letters", || {
        describe(&s, st, "g")["dead_letters"] == "2500"
    });
    assert_eq!(
        dead_letter_offsets(&s, st, "g"),
        (0..2500).collect::<Vec<u64>>()
    );
    let text = ok(&s, &["group", "dead-letters", st, "--group", "g"], None);
    assert_eq!(text.lines().count(), 2500);

    let window = |args: &[&str]| -> Vec<u64> {
        let mut all = vec!["group", "dead-letters", st, "--group", "g"];
        all.extend_from_slice(args);
        ok(&s, &all, None)
            .lines()
            .map(|l| l.split('\t').next().unwrap().parse().unwrap())
            .collect()
    };
    assert_eq!(
        window(&["--from", "900", "--limit", "1300"]),
        (900..2200).collect::<Vec<u64>>()
    );
    assert_eq!(window(&["--limit", "3"]), vec![0, 1, 2]);
    assert_eq!(
        window(&["--from", "2498"]),
        vec![2498, 2499],
        "to the end of the list"
    );
    assert!(window(&["--from", "2500"]).is_empty());
    assert!(window(&["--limit", "0"]).is_empty());
    // What stderr says of an empty window: not that the group has none.
    let said = |args: &[&str]| {
        let mut all = vec!["group", "dead-letters", st, "--group", "g"];
        all.extend_from_slice(args);
        String::from_utf8_lossy(&run(&s, &all, None).stderr).into_owned()
    };
    assert!(
        said(&["--from", "2500"]).contains("no dead letters at offset 2500 or above"),
        "{}",
        said(&["--from", "2500"])
    );
    assert!(!said(&["--limit", "0"]).contains("no dead letters"));
}

#[test]
fn group_discard_drops_a_dead_letter_without_redelivering_it() {
    let s = serve_one_attempt();
    let st = "t/ns/discard";
    two_dead_letters(&s, st, "g");

    let out = ok(
        &s,
        &["group", "discard", st, "--group", "g", "--offset", "1"],
        None,
    );
    assert_eq!(out, "discarded 1 dead letter\n");
    assert_eq!(dead_letter_offsets(&s, st, "g"), [0]);
    assert_eq!(describe(&s, st, "g")["dead_letters"], "1");
    // Only the record never delivered comes out; `b` does not.
    assert_eq!(consumed(&s, st, "g", &[]), ["c"]);
    let f = describe(&s, st, "g");
    assert_eq!(
        (
            f["position"].as_str(),
            f["owed"].as_str(),
            f["lag"].as_str()
        ),
        ("3", "0", "0")
    );

    let out = ok(&s, &["group", "discard", st, "--group", "g", "--all"], None);
    assert_eq!(out, "discarded 1 dead letter\n");
    assert!(dead_letter_offsets(&s, st, "g").is_empty());
    assert_eq!(
        ok(&s, &["group", "dead-letters", st, "--group", "g"], None),
        ""
    );
    let f = describe(&s, st, "g");
    assert_eq!((f["dead_letters"].as_str(), f["owed"].as_str()), ("0", "0"));
    assert!(consumed(&s, st, "g", &[]).is_empty());
    // The records stay in the log.
    assert_eq!(ok(&s, &["read", st], None), "a\nb\nc\n");
    fails_with(
        &s,
        &["group", "discard", st, "--group", "g", "--offset", "0"],
        "not_found",
    );
}

#[test]
fn consume_prints_acks_and_moves_the_position() {
    let s = serve();
    let st = "t/ns/consume";
    ok(&s, &["stream", "create", st, "--shards", "1"], None);
    ok(&s, &["publish", st, "r0", "r1", "r2", "r3", "r4"], None);

    let (out, err) = consume(&s, st, "g", &["--count", "2"]);
    assert_eq!(out, ["r0", "r1"]);
    assert!(err.contains("consumed 2 records"), "{err}");
    let f = describe(&s, st, "g");
    assert_eq!(
        (
            f["position"].as_str(),
            f["lag"].as_str(),
            f["in_flight"].as_str()
        ),
        ("2", "3", "0")
    );

    // One record per poll, as JSON: the rest, each a first delivery.
    let (out, err) = consume(&s, st, "g", &["--batch", "1", "--format", "json"]);
    let rows: Vec<serde_json::Value> = out
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3, "{out:?}");
    for (row, i) in rows.iter().zip(2u64..) {
        assert_eq!(row["offset"], i);
        assert_eq!(row["payload"], format!("r{i}"));
        assert_eq!(row["attempts"], 1);
    }
    assert!(err.contains("consumed 3 records"), "{err}");
    let f = describe(&s, st, "g");
    assert_eq!(
        (
            f["position"].as_str(),
            f["lag"].as_str(),
            f["in_flight"].as_str(),
            f["owed"].as_str()
        ),
        ("5", "0", "0", "0")
    );

    // Nothing left: prints nothing and succeeds.
    let (out, err) = consume(&s, st, "g", &[]);
    assert!(out.is_empty(), "{out:?}");
    assert!(err.contains("consumed 0 records"), "{err}");
    // Another group has its own position.
    assert_eq!(consumed(&s, st, "other", &["--count", "1"]), ["r0"]);
    assert_eq!(describe(&s, st, "g")["position"], "5");
}

#[test]
fn consume_as_a_member_takes_back_what_an_earlier_run_held() {
    let s = serve();
    let st = "t/ns/member";
    ok(&s, &["stream", "create", st, "--shards", "1"], None);
    ok(&s, &["publish", st, "m0", "m1", "m2", "m3", "m4"], None);

    // A run as w1 claims m0 and m1 and dies without acknowledging them.
    consume_without_acking(&s, st, "g", &["--member", "w1", "--count", "2"]);
    let f = describe(&s, st, "g");
    assert_eq!(
        (f["in_flight"].as_str(), f["position"].as_str()),
        ("2", "0")
    );

    // Others do not get them while the claims stand (30 s by default).
    let (out, _) = consume(
        &s,
        st,
        "g",
        &["--member", "w2", "--count", "1", "--format", "json"],
    );
    let row: serde_json::Value = serde_json::from_str(&out[0]).unwrap();
    assert_eq!(
        (row["offset"].as_u64(), row["attempts"].as_u64()),
        (Some(2), Some(1))
    );

    // The next run as w1 takes them back at once, first, each as a second
    // attempt, then carries on with what is new.
    let (out, err) = consume(&s, st, "g", &["--member", "w1", "--format", "json"]);
    let got: Vec<(u64, u64)> = out
        .iter()
        .map(|l| {
            let r: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                r["offset"].as_u64().unwrap(),
                r["attempts"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(got, [(0, 2), (1, 2), (3, 1), (4, 1)]);
    assert!(err.contains("consumed 4 records"), "{err}");
    let f = describe(&s, st, "g");
    assert_eq!(
        (
            f["position"].as_str(),
            f["in_flight"].as_str(),
            f["owed"].as_str()
        ),
        ("5", "0", "0")
    );

    // A third run as w1 has nothing left to take back or take.
    let (out, err) = consume(&s, st, "g", &["--member", "w1"]);
    assert!(out.is_empty(), "{out:?}");
    assert!(err.contains("consumed 0 records"), "{err}");
}

#[test]
fn group_commands_report_bad_input() {
    let s = serve();
    let st = "t/ns/badgroup";
    ok(&s, &["stream", "create", st, "--shards", "1"], None);
    ok(&s, &["publish", st, "x"], None);

    // Unknown groups, streams and shards: exit 1, the code on stderr.
    for args in [
        &["group", "describe", st, "--group", "nope"][..],
        &["group", "dead-letters", st, "--group", "nope"][..],
        &["group", "seek", st, "--group", "nope", "--to", "0"][..],
        &["group", "delete", st, "--group", "nope"][..],
        &["group", "redrive", st, "--group", "nope", "--offset", "0"][..],
        &["group", "discard", st, "--group", "nope", "--all"][..],
        &["group", "describe", "no/such/stream", "--group", "g"][..],
        &["group", "create", "no/such/stream", "--group", "g"][..],
        &["group", "list", "no/such/stream"][..],
        &["consume", "no/such/stream", "--group", "g"][..],
        &["consume", st, "--shard", "3", "--group", "g"][..],
    ] {
        fails_with(&s, args, "not_found");
    }
    // None of that made a group.
    assert_eq!(ok(&s, &["group", "list", st], None), "");
    fails_with(
        &s,
        &["group", "create", st, "--group", "bad name"],
        "invalid_request",
    );
    // Member names are 1 to 128 bytes (the client checks, before sending:
    // a usage error).
    let long = "m".repeat(129);
    let out = run(
        &s,
        &["consume", st, "--group", "g", "--member", long.as_str()],
        None,
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).starts_with("error: invalid_argument:"),
        "{out:?}"
    );
    // An offset for every shard of a stream of several.
    ok(&s, &["stream", "create", "t/ns/two", "--shards", "2"], None);
    let out = run(
        &s,
        &[
            "group",
            "seek",
            "t/ns/two",
            "--group",
            "g",
            "--all-shards",
            "--to",
            "5",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("error: usage:") && err.contains("--to earliest"),
        "{err}"
    );

    // Usage errors: exit 2 before talking to the broker.
    for args in [
        &["group", "describe", st][..],
        &["group", "seek", st, "--group", "g"][..],
        &["group", "seek", st, "--group", "g", "--to", "soon"][..],
        &["group", "create", st, "--group", "g", "--to", "-1"][..],
        &["group", "redrive", st, "--group", "g"][..],
        &[
            "group", "redrive", st, "--group", "g", "--offset", "0", "--all",
        ][..],
        &["group", "discard", st, "--group", "g"][..],
        &["group", "discard", st, "--group", "g", "--offset", "x"][..],
        &["group", "frobnicate", st, "--group", "g"][..],
        &["consume", st][..],
        &["consume", st, "--group", "g", "--count", "many"][..],
        &["consume", "not-a-stream", "--group", "g"][..],
        &["consume", st, "--group", "g", "--format", "xml"][..],
        &["consume", st, "--group", "g", "--batch", "0"][..],
        &["stream", "create", "t/ns/none", "--shards", "0"][..],
        &["publish", st, "--in-flight", "0"][..],
        &["--broker", "localhost", "group", "list", st][..],
    ] {
        let out = run(&s, args, None);
        assert_eq!(out.status.code(), Some(2), "felix {args:?}: {out:?}");
        assert!(out.stdout.is_empty(), "felix {args:?}: {out:?}");
        assert!(!out.stderr.is_empty(), "felix {args:?}: {out:?}");
    }
    assert_eq!(ok(&s, &["group", "list", st], None), "");
}

/// `felix consume` whose output goes nowhere (`| head` that already exited)
/// hands the records it claimed back at once instead of leaving them claimed
/// until the visibility timeout, and says so.
#[test]
fn consume_hands_back_what_it_could_not_print() {
    let s = serve();
    let st = "t/ns/closed";
    ok(&s, &["stream", "create", st, "--shards", "1"], None);
    ok(&s, &["publish", st, "a", "b", "c"], None);
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = felix()
        .arg("--broker")
        .arg(&s.addr)
        .args(["consume", st, "--group", "g", "--count", "3"])
        .stdin(Stdio::null())
        .stdout(writer)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
        .wait_with_output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("handed back 3"), "{err}");
    let f = describe(&s, st, "g");
    assert_eq!(
        (
            f["position"].as_str(),
            f["in_flight"].as_str(),
            f["owed"].as_str()
        ),
        ("0", "0", "3"),
        "{f:?}"
    );
    // And the next consumer gets them now, each on its second attempt.
    let (got, _) = consume(&s, st, "g", &["--count", "3"]);
    assert_eq!(got, ["a", "b", "c"]);
}

/// A publish that fails part-way (here a line too large for the broker's
/// frame cap, refused before it is sent) still counts every record the
/// broker acknowledged before the error, and those records are stored.
#[test]
fn a_failed_publish_counts_every_record_acknowledged_before_the_error() {
    let s = serve_with(&[("FELIX_MAX_FRAME_BYTES", "1048576")]);
    ok(&s, &["stream", "create", "t/n/big", "--shards", "1"], None);
    let mut input: String = (1..=3000).map(|i| format!("{i}\n")).collect();
    input.push_str(&"a".repeat(2 << 20));
    input.push('\n');
    let out = run(
        &s,
        &["publish", "t/n/big", "--batch-records", "500"],
        Some(&input),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("input line 3001 is longer than the broker's frame limit of 1048576 bytes"),
        "{err}"
    );
    assert!(
        err.contains("published 3000 records before the error"),
        "{err}"
    );
    assert!(
        err.contains("no input record after record 3000 was sent"),
        "{err}"
    );
    let stored = ok(
        &s,
        &["read", "t/n/big", "--shard", "0", "--from", "earliest"],
        None,
    );
    let want: String = (1..=3000).map(|i| format!("{i}\n")).collect();
    assert_eq!(stored, want);
}

/// A line with no end in sight (bytes and no newline) is refused once it
/// outgrows the broker's frame limit, without reading it whole: the
/// command stops reading and exits, and its writer finds the pipe closed
/// long before it has written everything.
#[test]
fn an_endless_line_on_stdin_is_refused_without_being_read_whole() {
    let s = serve_with(&[("FELIX_MAX_FRAME_BYTES", "1048576")]);
    ok(
        &s,
        &["stream", "create", "t/n/endless", "--shards", "1"],
        None,
    );
    let mut child = felix()
        .args(["--broker", &s.addr, "publish", "t/n/endless"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || {
        let chunk = vec![b'x'; 1 << 20];
        let mut written = 0u64;
        // Up to 256 MiB: all of it would be read by a command that buffers
        // the whole line before looking at its size.
        while written < 256 << 20 {
            if stdin.write_all(&chunk).is_err() {
                break;
            }
            written += chunk.len() as u64;
        }
        written
    });
    let out = child.wait_with_output().unwrap();
    let written = writer.join().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("input line 1 is longer than the broker's frame limit"),
        "{err}"
    );
    assert!(err.contains("no input record was sent"), "{err}");
    assert!(
        written < 64 << 20,
        "the command read {written} bytes of one line"
    );
    let stored = ok(
        &s,
        &["read", "t/n/endless", "--shard", "0", "--from", "earliest"],
        None,
    );
    assert_eq!(stored, "", "nothing was published");
}

/// A `FELIX_*` variable that is not valid UTF-8 is a clear configuration
/// error; any other such variable is ignored (it cannot be a setting).
#[test]
fn environment_variables_that_are_not_utf8_do_not_crash_the_broker() {
    use std::os::unix::ffi::OsStrExt;
    let bad = std::ffi::OsStr::from_bytes(b"\xff\xfe");
    let out = felix()
        .args(["serve", "--print-config"])
        .env("FELIX_LISTEN", bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("FELIX_LISTEN is not valid UTF-8"),
        "{out:?}"
    );
    let out = felix()
        .args(["serve", "--print-config"])
        .env("SOMETHING_ELSE", bad)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

#[test]
fn consume_all_shards_takes_every_shards_records_once() {
    let s = serve();
    let st = "t/ns/gall";
    ok(&s, &["stream", "create", st, "--shards", "3"], None);
    for shard in 0..3 {
        let (a, b) = (format!("s{shard}a"), format!("s{shard}b"));
        ok(
            &s,
            &["publish", st, "--shard", &shard.to_string(), &a, &b],
            None,
        );
    }
    // Without --all-shards a group is one shard's (0 unless --shard).
    assert_eq!(consumed(&s, st, "one", &[]), ["s0a", "s0b"]);

    let (lines, err) = consume(
        &s,
        st,
        "all",
        &["--all-shards", "--format", "json", "--batch", "2"],
    );
    assert!(err.contains("consumed 6 records"), "{err}");
    let mut got: Vec<(u64, u64, String)> = lines
        .iter()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["shard"].as_u64().unwrap(),
                v["offset"].as_u64().unwrap(),
                v["payload"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    got.sort();
    let want: Vec<(u64, u64, String)> = (0..3u64)
        .flat_map(|sh| [(sh, 0, format!("s{sh}a")), (sh, 1, format!("s{sh}b"))])
        .collect();
    assert_eq!(got, want);
    // Every shard's group is finished, nothing left claimed.
    assert!(consumed(&s, st, "all", &["--all-shards"]).is_empty());
    for shard in ["0", "1", "2"] {
        let d = fields(&ok(
            &s,
            &["group", "describe", st, "--group", "all", "--shard", shard],
            None,
        ));
        assert_eq!(
            (d["position"].as_str(), d["in_flight"].as_str()),
            ("2", "0"),
            "{d:?}"
        );
    }
    let out = run(
        &s,
        &[
            "consume",
            st,
            "--group",
            "g",
            "--all-shards",
            "--shard",
            "1",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

#[test]
fn consume_follow_stops_cleanly_on_ctrl_c_and_leaves_nothing_claimed() {
    let s = serve();
    let st = "t/ns/gint";
    ok(&s, &["stream", "create", st, "--shards", "2"], None);
    ok(&s, &["publish", st, "--shard", "0", "a"], None);
    ok(&s, &["publish", st, "--shard", "1", "b"], None);
    let mut consumer = felix()
        .arg("--broker")
        .arg(&s.addr)
        .args(["consume", st, "--group", "g", "--all-shards", "--follow"])
        .args(["--wait-ms", "30000"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = follow_lines(&mut consumer);
    let mut got = vec![next_line(&lines), next_line(&lines)];
    got.sort();
    assert_eq!(got, ["a", "b"]);
    // Now parked in a 30 s wait on both shards: Ctrl-C ends it without
    // waiting that out.
    let asked = std::time::Instant::now();
    let kill = Command::new("kill")
        .args(["-INT", &consumer.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let out = consumer.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("consumed 2 records"), "{err}");
    assert!(
        asked.elapsed() < std::time::Duration::from_secs(20),
        "{err}"
    );
    // Nothing is left claimed: a record published now is a first delivery.
    ok(&s, &["publish", st, "--shard", "1", "c"], None);
    let (lines, _) = consume(&s, st, "g", &["--all-shards", "--format", "json"]);
    let rows: Vec<serde_json::Value> = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 1, "{lines:?}");
    assert_eq!(
        (rows[0]["payload"].as_str(), rows[0]["attempts"].as_u64()),
        (Some("c"), Some(1))
    );
}

/// `felix group describe --all-shards`: the table, and its rows split
/// into cells.
fn shard_rows(s: &Serve, stream: &str, group: &str) -> (String, Vec<Vec<String>>) {
    let table = ok(
        s,
        &[
            "group",
            "describe",
            stream,
            "--group",
            group,
            "--all-shards",
        ],
        None,
    );
    let rows = table
        .lines()
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect();
    (table, rows)
}

#[test]
fn group_commands_take_all_shards() {
    let s = serve();
    let st = "t/ns/gwide";
    ok(&s, &["stream", "create", st, "--shards", "2"], None);
    ok(&s, &["publish", st, "--shard", "0", "a", "b"], None);
    ok(&s, &["publish", st, "--shard", "1", "c"], None);
    let out = ok(
        &s,
        &[
            "group",
            "create",
            st,
            "--group",
            "g",
            "--all-shards",
            "--to",
            "latest",
        ],
        None,
    );
    assert!(out.contains("every shard: created at latest"), "{out}");
    ok(&s, &["publish", st, "--shard", "1", "d"], None);
    let (table, rows) = shard_rows(&s, st, "g");
    assert_eq!(
        rows[0][..4],
        ["shard", "position", "end_offset", "lag"],
        "{table}"
    );
    assert_eq!(rows[1][..4], ["0", "2", "2", "0"], "{table}");
    assert_eq!(rows[2][..4], ["1", "1", "2", "1"], "{table}");
    assert_eq!(rows[3][..4], ["all", "-", "-", "1"], "{table}");
    // Only d was published after the group's start.
    assert_eq!(consumed(&s, st, "g", &["--all-shards"]), ["d"]);
    ok(
        &s,
        &[
            "group",
            "seek",
            st,
            "--group",
            "g",
            "--all-shards",
            "--to",
            "earliest",
        ],
        None,
    );
    let mut again = consumed(&s, st, "g", &["--all-shards"]);
    again.sort();
    assert_eq!(again, ["a", "b", "c", "d"]);
    // An offset names a place in one shard's log: refused for several.
    let out = run(
        &s,
        &[
            "group",
            "seek",
            st,
            "--group",
            "g",
            "--all-shards",
            "--to",
            "1",
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(2), "a usage error: {out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("names a position in one of them"));
    let out = ok(
        &s,
        &["group", "delete", st, "--group", "g", "--all-shards"],
        None,
    );
    assert!(out.contains("every shard: deleted"), "{out}");
    for shard in ["0", "1"] {
        fails_with(
            &s,
            &["group", "describe", st, "--group", "g", "--shard", shard],
            "not_found",
        );
    }
    let err = fails_with(
        &s,
        &["group", "describe", st, "--group", "g", "--all-shards"],
        "not_found",
    );
    assert!(err.contains("does not exist on any shard"), "{err}");
    // A group polled on one shard only: the other shows `-`, but for its
    // end and, as lag, every record it holds (the group's first poll there
    // starts at its start), which the total counts.
    assert_eq!(
        consumed(&s, st, "h", &["--shard", "1", "--count", "1"]),
        ["c"]
    );
    let (table, rows) = shard_rows(&s, st, "h");
    assert_eq!(rows[1], ["0", "-", "2", "2", "-", "-", "-", "-"], "{table}");
    assert_eq!(rows[2][..4], ["1", "1", "2", "1"], "{table}");
    assert_eq!(rows[3][..4], ["all", "-", "-", "3"], "{table}");
    // A seek of every shard puts the group there on the shard it has not
    // polled too (created), so that shard does not start at offset 0.
    ok(
        &s,
        &[
            "group",
            "seek",
            st,
            "--group",
            "h",
            "--all-shards",
            "--to",
            "latest",
        ],
        None,
    );
    let (table, rows) = shard_rows(&s, st, "h");
    assert_eq!(rows[1][..4], ["0", "2", "2", "0"], "{table}");
    assert_eq!(rows[2][..4], ["1", "2", "2", "0"], "{table}");
    // A delete of every shard counts a shard without the group as done.
    ok(
        &s,
        &["group", "delete", st, "--group", "h", "--shard", "0"],
        None,
    );
    let out = ok(
        &s,
        &["group", "delete", st, "--group", "h", "--all-shards"],
        None,
    );
    assert!(out.contains("every shard: deleted"), "{out}");
    let err = fails_with(
        &s,
        &[
            "group",
            "seek",
            st,
            "--group",
            "h",
            "--all-shards",
            "--to",
            "earliest",
        ],
        "not_found",
    );
    assert!(err.contains("does not exist on any shard"), "{err}");
    fails_with(
        &s,
        &["group", "describe", st, "--group", "h", "--shard", "0"],
        "not_found",
    );
    // The consumes below use h again: polled on shard 1 only.
    assert_eq!(
        consumed(&s, st, "h", &["--shard", "1", "--count", "1"]),
        ["c"]
    );
    // An empty dead-letter list says so, on stderr.
    let out = run(
        &s,
        &["group", "dead-letters", st, "--group", "h", "--shard", "1"],
        None,
    );
    assert!(out.status.success() && out.stdout.is_empty(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("no dead letters"));
}

/// `felix --broker ALL publish ARGS`, sent again while it fails with
/// `unavailable` (an election under way as the publish arrived: nothing
/// stored, the CLI says, since it reports anything else that was).
fn publish_to_cluster(all: &str, args: &[&str]) {
    let mut cmd = vec!["publish"];
    cmd.extend_from_slice(args);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let out = run_at(all, &cmd, None);
        if out.status.success() {
            return;
        }
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("error: unavailable") && std::time::Instant::now() < deadline,
            "felix {cmd:?} failed: {err}"
        );
        std::thread::park_timeout(std::time::Duration::from_millis(100));
    }
}

/// The README's cluster, run for real: three `felix serve --node-id N
/// --peers ...` on loopback, a stream created on every broker with one
/// `--broker A,B,C`, records published and consumed through whichever
/// broker leads (the CLI follows `not_leader`), and every broker holding
/// them.
#[test]
fn the_readme_cluster_works() {
    // Below the ephemeral range (32768 and up): no connection of the CLI
    // runs below takes one of them before the brokers bind it.
    let base = 10_000 + (std::process::id() % 2_000) * 10;
    let ports: Vec<u16> = (base..base + 200)
        .map(|p| p as u16)
        .filter(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
        .take(6)
        .collect();
    let addrs: Vec<String> = (0..3).map(|i| format!("127.0.0.1:{}", ports[i])).collect();
    let peers = (0..3)
        .map(|i| format!("{}={}/127.0.0.1:{}", i + 1, addrs[i], ports[3 + i]))
        .collect::<Vec<_>>()
        .join(",");
    let secret_dir = tempfile::tempdir().unwrap();
    let secret = secret_dir.path().join("felix-cluster.secret");
    std::fs::write(&secret, "c2VjcmV0IGZvciB0aGUgUkVBRE1FIGNsdXN0ZXIK\n").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    // Broker `i` (0-based) on `dir`, once it announces its address.
    let start_node = |i: usize, dir: tempfile::TempDir| {
        let mut cmd = felix();
        cmd.env("FELIX_CLUSTER_SECRET_FILE", &secret)
            .args([
                "serve",
                "--node-id",
                &(i + 1).to_string(),
                "--peers",
                &peers,
            ])
            .args(["--listen", &addrs[i], "--data-dir"])
            .arg(dir.path())
            .env("FELIX_METRICS_LISTEN", "")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped());
        let mut child = cmd.spawn().expect("felix serve");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if line.starts_with("felix: listening on ") {
                    let _ = tx.send(());
                }
            }
        });
        rx.recv_timeout(std::time::Duration::from_secs(60))
            .expect("felix serve announces its address");
        Serve {
            child,
            addr: addrs[i].clone(),
            _dir: dir,
        }
    };
    let nodes: Vec<Serve> = (0..3)
        .map(|i| start_node(i, tempfile::tempdir().unwrap()))
        .collect();
    // One --broker naming the whole cluster.
    let all = addrs.join(",");
    ok_at(
        &all,
        &["stream", "create", "demo/ha/jobs", "--shards", "1"],
        None,
    );
    // One incarnation everywhere; a second create leaves it as it is.
    let incarnation = |described: &str| {
        described
            .lines()
            .find(|l| l.starts_with("incarnation "))
            .unwrap_or_else(|| panic!("{described}"))
            .to_string()
    };
    let first = incarnation(&ok(
        &nodes[0],
        &["stream", "describe", "demo/ha/jobs"],
        None,
    ));
    for n in &nodes {
        let described = ok(n, &["stream", "describe", "demo/ha/jobs"], None);
        assert!(described.contains("demo/ha/jobs"), "{described}");
        assert_eq!(incarnation(&described), first, "{}", n.addr);
    }
    // What a command run on several brokers said: (exit ok, stdout, stderr).
    let said = |addr: &str, args: &[&str]| {
        let out = run_at(addr, args, None);
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (ok_again, _, stderr) = said(&all, &["stream", "create", "demo/ha/jobs", "--shards", "1"]);
    assert!(ok_again, "{stderr}");
    assert_eq!(
        stderr.matches("holds demo/ha/jobs already").count(),
        3,
        "{stderr}"
    );
    let (ok_wrong, _, stderr) = said(&all, &["stream", "create", "demo/ha/jobs", "--shards", "2"]);
    assert!(!ok_wrong);
    assert!(stderr.contains("error: already_exists:"), "{stderr}");
    assert!(stderr.contains("with 1 shards, not 2"), "{stderr}");
    // Naming one broker is enough: it names the others, and the stream
    // is made on each with one incarnation.
    let (ok_one, _, stderr) = said(
        &addrs[1],
        &["stream", "create", "demo/ha/one", "--shards", "1"],
    );
    assert!(ok_one, "{stderr}");
    assert!(
        stderr.contains(&format!(
            "the cluster has 3 brokers ({}): creating demo/ha/one on each",
            addrs.join(", ")
        )),
        "{stderr}"
    );
    let one = incarnation(&ok(&nodes[0], &["stream", "describe", "demo/ha/one"], None));
    for n in &nodes {
        let described = ok(n, &["stream", "describe", "demo/ha/one"], None);
        assert_eq!(incarnation(&described), one, "{}", n.addr);
    }
    ok_at(
        &all,
        &["stream", "create", "demo/ha/late", "--shards", "1"],
        None,
    );
    // A delete goes to the brokers named (the way to delete a stale copy
    // on one broker), one that cannot be reached among them.
    let gone = free_port_addr();
    let with_gone = format!("{all},{gone}");
    // Deleted where it can be; run again, the brokers without it say so.
    let (ok_del, stdout, stderr) = said(&with_gone, &["stream", "delete", "demo/ha/late"]);
    assert!(!ok_del, "{stderr}");
    assert!(
        stderr.contains(&format!(
            "demo/ha/late may still be on {gone}: once it is back, run \
             `felix --broker {gone} stream delete demo/ha/late`"
        )),
        "{stderr}"
    );
    assert_eq!(stdout.matches("deleted demo/ha/late on").count(), 3);
    let (ok_del, _, stderr) = said(&all, &["stream", "delete", "demo/ha/late"]);
    assert!(!ok_del, "held by none: {stderr}");
    assert!(
        stderr.contains("error: not_found: no stream demo/ha/late on any"),
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("does not hold demo/ha/late").count(),
        3,
        "{stderr}"
    );
    // Published through whichever broker leads: the stream was created a
    // moment ago, so its election may still be on, which the CLI waits out
    // (a leader deposed as it took the publish answers `unavailable`: not
    // stored, sent again here).
    publish_to_cluster(
        &all,
        &["demo/ha/jobs", "--shard", "0", "one", "two", "three"],
    );
    // Every broker's replica of the shard: one leads, the others follow it.
    // (A follower the leader has not reached yet knows of none for a moment.)
    let roles = |described: &str| -> Vec<String> {
        described
            .lines()
            .filter(|l| {
                let first = l.split_whitespace().next().unwrap_or("");
                addrs.iter().any(|a| a == first)
            })
            .map(|l| l.split_whitespace().nth(2).unwrap().to_string())
            .collect()
    };
    // Which broker (its index) leads shard 0 of `stream`, once one does.
    let leader_of = |stream: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let described = ok_at(&all, &["shard", "describe", stream], None);
            if let Some(l) = roles(&described).iter().position(|r| r == "leader") {
                return l;
            }
            assert!(std::time::Instant::now() < deadline, "{described}");
            std::thread::park_timeout(std::time::Duration::from_millis(50));
        }
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let leader = loop {
        let described = ok_at(&all, &["shard", "describe", "demo/ha/jobs"], None);
        let roles = roles(&described);
        let mut sorted = roles.clone();
        sorted.sort_unstable();
        if sorted == ["follower", "follower", "leader"] {
            break roles.iter().position(|r| r == "leader").unwrap();
        }
        assert!(std::time::Instant::now() < deadline, "{described}");
        std::thread::park_timeout(std::time::Duration::from_millis(50));
    };
    // One broker's own view names the leader and its address.
    let follower = &nodes[(leader + 1) % 3];
    let own = ok(follower, &["shard", "describe", "demo/ha/jobs"], None);
    assert!(
        own.contains(&format!(
            "leader        node {} at {}",
            leader + 1,
            addrs[leader]
        )),
        "{own}"
    );
    assert!(own.contains("follower in term"), "{own}");
    let stream = ok(follower, &["stream", "describe", "demo/ha/jobs"], None);
    assert!(
        stream.contains(&format!("node {} at {}", leader + 1, addrs[leader])),
        "{stream}"
    );
    // Every broker holds them (a follower can be a moment behind).
    for n in &nodes {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let text = ok(
                n,
                &[
                    "read",
                    "demo/ha/jobs",
                    "--shard",
                    "0",
                    "--count",
                    "3",
                    "--from",
                    "earliest",
                ],
                None,
            );
            if text == "one\ntwo\nthree\n" {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{} has {text:?}",
                n.addr
            );
            std::thread::park_timeout(std::time::Duration::from_millis(50));
        }
    }
    // A publish reading stdin, given brokers that do not lead the shard:
    // the batches they refuse as `not_leader` (several in flight at once)
    // go to the leader, in input order, and every line is stored once.
    ok_at(
        &all,
        &["stream", "create", "demo/ha/lines", "--shards", "1"],
        None,
    );
    let lines_leader = leader_of("demo/ha/lines");
    let not_leading = format!(
        "{},{}",
        addrs[(lines_leader + 1) % 3],
        addrs[(lines_leader + 2) % 3]
    );
    let input: String = (0..2_000).map(|i| format!("line {i}\n")).collect();
    let out = run_at(
        &not_leading,
        &[
            "publish",
            "demo/ha/lines",
            "--batch-records",
            "50",
            "--in-flight",
            "8",
        ],
        Some(&input),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("published 2000 records to shard 0"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "does not lead shard 0; sending to the leader, {}",
            addrs[lines_leader]
        )),
        "{stderr}"
    );
    let stored = ok(
        &nodes[lines_leader],
        &[
            "read",
            "demo/ha/lines",
            "--shard",
            "0",
            "--from",
            "earliest",
        ],
        None,
    );
    assert!(stored == input, "stored {} lines", stored.lines().count());

    // A group, through the leader.
    let consumed = ok_at(
        &all,
        &[
            "consume",
            "demo/ha/jobs",
            "--shard",
            "0",
            "--group",
            "workers",
            "--count",
            "3",
        ],
        None,
    );
    assert_eq!(consumed, "one\ntwo\nthree\n");

    // A stream of two shards, which may lead on different brokers: the
    // every-shard commands go to each shard's leader.
    ok_at(
        &all,
        &["stream", "create", "demo/ha/wide", "--shards", "2"],
        None,
    );
    for (shard, words) in [("0", ["a", "b"]), ("1", ["c", "d"])] {
        publish_to_cluster(
            &all,
            &["demo/ha/wide", "--shard", shard, words[0], words[1]],
        );
    }
    ok_at(
        &all,
        &[
            "group",
            "create",
            "demo/ha/wide",
            "--all-shards",
            "--group",
            "wide",
        ],
        None,
    );
    let consumed = ok_at(
        &all,
        &[
            "consume",
            "demo/ha/wide",
            "--all-shards",
            "--group",
            "wide",
            "--count",
            "4",
        ],
        None,
    );
    let mut lines: Vec<&str> = consumed.lines().collect();
    lines.sort_unstable();
    assert_eq!(lines, ["a", "b", "c", "d"], "{consumed}");
    let described = ok_at(
        &all,
        &[
            "group",
            "describe",
            "demo/ha/wide",
            "--all-shards",
            "--group",
            "wide",
        ],
        None,
    );
    // A row per shard and one for them all, each shard finished.
    assert_eq!(described.lines().count(), 4, "{described}");
    assert!(
        described.lines().any(|l| l.starts_with("all")),
        "{described}"
    );

    // Commands that keep going follow the shard's leader through a
    // failover: a one-shard `consume --follow` and a `read --follow`, both
    // given the whole cluster, go on printing once the leader is killed
    // and another elected, each record once.
    let mut nodes = nodes;
    let follow = |args: &[&str]| {
        let mut child = felix()
            .arg("--broker")
            .arg(&all)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        (child, rx)
    };
    let expect_lines = |rx: &std::sync::mpsc::Receiver<String>, want: &[&str], what: &str| {
        for w in want {
            let got = rx
                .recv_timeout(std::time::Duration::from_secs(30))
                .unwrap_or_else(|e| panic!("{what}: no {w:?}: {e}"));
            assert_eq!(got, *w, "{what}");
        }
    };
    let (mut consumer, consumed) = follow(&[
        "consume",
        "demo/ha/jobs",
        "--shard",
        "0",
        "--group",
        "followers",
        "--follow",
    ]);
    let (mut reader, read) = follow(&[
        "read",
        "demo/ha/jobs",
        "--shard",
        "0",
        "--from",
        "earliest",
        "--follow",
    ]);
    expect_lines(&consumed, &["one", "two", "three"], "consume --follow");
    expect_lines(&read, &["one", "two", "three"], "read --follow");
    let leader = leader_of("demo/ha/jobs");
    let _ = nodes[leader].child.kill();
    let _ = nodes[leader].child.wait();
    publish_to_cluster(&all, &["demo/ha/jobs", "--shard", "0", "four"]);
    expect_lines(
        &consumed,
        &["four"],
        "consume --follow after the leader died",
    );
    expect_lines(&read, &["four"], "read --follow after the leader died");
    // Back, as a follower now: the same data directory.
    let dir = std::mem::replace(&mut nodes[leader]._dir, tempfile::tempdir().unwrap());
    nodes[leader] = start_node(leader, dir);
    publish_to_cluster(&all, &["demo/ha/jobs", "--shard", "0", "five"]);
    expect_lines(&consumed, &["five"], "consume --follow");
    expect_lines(&read, &["five"], "read --follow");
    for child in [&mut consumer, &mut reader] {
        assert!(child.try_wait().unwrap().is_none(), "still following");
        let _ = child.kill();
        let _ = child.wait();
    }

    // A stdin publish whose leader dies between batches (every batch sent
    // acknowledged): the rest goes to the new leader, found among the
    // brokers named, and every line is stored once, in order.
    ok_at(
        &all,
        &["stream", "create", "demo/ha/ride", "--shards", "1"],
        None,
    );
    let ride_leader = leader_of("demo/ha/ride");
    let mut publisher = felix()
        .arg("--broker")
        .arg(&all)
        .args(["publish", "demo/ha/ride"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines_in = publisher.stdin.take().unwrap();
    let first: String = (0..100).map(|i| format!("ride {i}\n")).collect();
    lines_in.write_all(first.as_bytes()).unwrap();
    lines_in.flush().unwrap();
    let read_ride = |at: &str, n: usize| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let count = n.to_string();
            let args = [
                "read",
                "demo/ha/ride",
                "--shard",
                "0",
                "--from",
                "earliest",
                "--count",
                &count,
            ];
            let out = run_at(at, &args, None);
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            if text.lines().count() == n {
                return text;
            }
            assert!(std::time::Instant::now() < deadline, "{at}: {text:?}");
            std::thread::park_timeout(std::time::Duration::from_millis(50));
        }
    };
    // All acknowledged (so none in flight) before the leader goes.
    assert_eq!(read_ride(&addrs[ride_leader], 100), first);
    let _ = nodes[ride_leader].child.kill();
    let _ = nodes[ride_leader].child.wait();
    // Long enough for the publisher to see its connection gone.
    std::thread::park_timeout(std::time::Duration::from_millis(500));
    let rest: String = (100..200).map(|i| format!("ride {i}\n")).collect();
    lines_in.write_all(rest.as_bytes()).unwrap();
    drop(lines_in);
    let out = publisher.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("published 200 records"), "{stderr}");
    assert!(
        stderr.contains("every batch sent was acknowledged"),
        "{stderr}"
    );
    let survivor = &addrs[(ride_leader + 1) % 3];
    assert_eq!(read_ride(survivor, 200), format!("{first}{rest}"));
    let dir = std::mem::replace(&mut nodes[ride_leader]._dir, tempfile::tempdir().unwrap());
    nodes[ride_leader] = start_node(ride_leader, dir);

    // A broker of the cluster down: the stream is made on the others, and
    // the one it is not on is named, to run the command again for.
    let _ = nodes[2].child.kill();
    let _ = nodes[2].child.wait();
    let down = ["stream", "create", "demo/ha/down", "--shards", "1"];
    let (ok_down, _, stderr) = said(&all, &down);
    assert!(!ok_down, "{stderr}");
    assert!(
        stderr.contains(&format!("demo/ha/down is not on {}", addrs[2])),
        "{stderr}"
    );
    assert!(stderr.contains("run the same command again"), "{stderr}");
    for n in &nodes[..2] {
        ok(n, &["stream", "describe", "demo/ha/down"], None);
    }
    // Two of three down: no majority answers, and nothing is made.
    let _ = nodes[1].child.kill();
    let _ = nodes[1].child.wait();
    let (ok_few, _, stderr) = said(
        &addrs[0],
        &["stream", "create", "demo/ha/few", "--shards", "1"],
    );
    assert!(!ok_few, "{stderr}");
    assert!(
        stderr.contains("only 1 of the 3 brokers answered"),
        "{stderr}"
    );
    let (made, _, _) = said(&addrs[0], &["stream", "describe", "demo/ha/few"]);
    assert!(!made, "nothing created");
    drop(nodes);
}

/// A shard that cannot be opened (here its directory is gone) does not
/// take `stream describe` down with it: the other shards are described,
/// and its row says why it refuses.
#[test]
fn stream_describe_shows_a_shard_that_cannot_open() {
    let mut s = serve();
    ok(
        &s,
        &["stream", "create", "t/ns/broken", "--shards", "2"],
        None,
    );
    ok(
        &s,
        &["publish", "t/ns/broken", "--shard", "0", "kept"],
        None,
    );
    ok(
        &s,
        &["publish", "t/ns/broken", "--shard", "1", "lost"],
        None,
    );
    let dir = std::mem::replace(&mut s._dir, tempfile::tempdir().unwrap());
    drop(s);
    std::fs::remove_dir_all(dir.path().join("t/ns/broken/1")).unwrap();
    let s = serve_in(dir, &[]);
    let out = ok(&s, &["stream", "describe", "t/ns/broken"], None);
    let row = |n: &str| {
        out.lines()
            .find(|l| l.split_whitespace().next() == Some(n))
            .unwrap_or_else(|| panic!("no row for shard {n}: {out}"))
            .to_string()
    };
    let fine: Vec<String> = row("0").split_whitespace().map(String::from).collect();
    assert_eq!(fine[2..], ["0", "1", fine[4].as_str(), "no"], "{out}");
    assert!(row("1").contains("unavailable"), "{out}");
    assert!(row("1").contains("missing"), "{out}");
    // The shard that opened still serves.
    assert_eq!(
        ok(
            &s,
            &["read", "t/ns/broken", "--shard", "0", "--count", "1"],
            None
        ),
        "kept\n"
    );
}

/// `felix read --follow` against one broker rides a graceful restart: the
/// stopping broker refuses its next read (`unavailable`, nothing done), and
/// the follower waits for the broker to come back and reads on from where
/// it was, every record once, in order.
#[test]
fn a_read_follow_rides_a_graceful_restart() {
    let listen = free_port_addr();
    let mut s = serve_on(tempfile::tempdir().unwrap(), &listen, &[]);
    let st = "t/ns/followed";
    ok(&s, &["stream", "create", st, "--shards", "1"], None);
    let first: Vec<String> = (0..10).map(|i| format!("r{i}")).collect();
    let mut args = vec!["publish", st, "--shard", "0"];
    args.extend(first.iter().map(String::as_str));
    ok(&s, &args, None);
    let mut follower = felix()
        .arg("--broker")
        .arg(&s.addr)
        .args([
            "read", st, "--shard", "0", "--from", "earliest", "--follow", "--count", "20",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Waiting at the tail when the stop comes.
    std::thread::park_timeout(std::time::Duration::from_millis(1500));
    s = restart_gracefully(s, &listen);
    let second: Vec<String> = (10..20).map(|i| format!("r{i}")).collect();
    let mut args = vec!["publish", st, "--shard", "0"];
    args.extend(second.iter().map(String::as_str));
    ok(&s, &args, None);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while follower.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = follower.kill();
            break;
        }
        std::thread::park_timeout(std::time::Duration::from_millis(50));
    }
    let out = follower.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    let want: String = first
        .iter()
        .chain(&second)
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(String::from_utf8_lossy(&out.stdout), want, "{stderr}");
}

/// A stdin `felix publish` through a broker's graceful restart (SIGTERM,
/// then started again on its directory and address): the stopping broker
/// refuses the batches it reads after the signal, saying it stored none,
/// and answers every one sent before the publish heard that; the publish
/// sends those on once the broker is back, so every line is stored once,
/// in order.
#[test]
fn a_stdin_publish_rides_a_graceful_restart() {
    let listen = free_port_addr();
    let mut s = serve_on(tempfile::tempdir().unwrap(), &listen, &[]);
    let st = "t/ns/rolling";
    ok(&s, &["stream", "create", st, "--shards", "1"], None);
    let mut publisher = felix()
        .arg("--broker")
        .arg(&s.addr)
        .args(["publish", st, "--shard", "0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines_in = publisher.stdin.take().unwrap();
    const LINES: usize = 20_000;
    // Lines keep coming, 100 every 5 ms (a second in all), through the
    // restart.
    let feeder = std::thread::spawn(move || {
        for chunk in 0..LINES / 100 {
            let text: String = (chunk * 100..(chunk + 1) * 100)
                .map(|i| format!("line {i}\n"))
                .collect();
            // A publisher that died is reported below, with its stderr.
            if lines_in.write_all(text.as_bytes()).is_err() {
                return;
            }
            std::thread::park_timeout(std::time::Duration::from_millis(5));
        }
    });
    // The publish is under way (connected, storing) before the stop.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let read = run(
            &s,
            &[
                "read", st, "--shard", "0", "--from", "earliest", "--count", "1",
            ],
            None,
        );
        if !read.stdout.is_empty() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "nothing stored");
        std::thread::park_timeout(std::time::Duration::from_millis(20));
    }
    s = restart_gracefully(s, &listen);
    feeder.join().unwrap();
    let out = publisher.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("published {LINES} records")),
        "{stderr}"
    );
    // Refused in flight (or, rarely, gone between two batches).
    assert!(
        stderr.contains("storing none of them")
            || stderr.contains("every batch sent was acknowledged"),
        "{stderr}"
    );
    let count = LINES.to_string();
    let stored = ok(
        &s,
        &[
            "read", st, "--shard", "0", "--from", "earliest", "--count", &count,
        ],
        None,
    );
    let want: String = (0..LINES).map(|i| format!("line {i}\n")).collect();
    assert!(
        stored == want,
        "stored {} lines, not the {LINES} in order",
        stored.lines().count()
    );
}
