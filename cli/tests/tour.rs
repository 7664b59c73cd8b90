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
