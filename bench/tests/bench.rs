//! felix-bench as a user runs it: argument errors, tiny runs against the
//! embedded broker whose counts must add up, and the JSON schema. No
//! assertion here depends on how fast anything ran.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_felix-bench"))
        .args(args)
        .output()
        .expect("run felix-bench")
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Run a workload quietly with `--json` and return the document; the run
/// must succeed.
fn run_json(dir: &Path, name: &str, args: &[&str]) -> Value {
    run_json_status(dir, name, args, true)
}

fn run_json_status(dir: &Path, name: &str, args: &[&str], must_succeed: bool) -> Value {
    let json = dir.join(format!("{name}.json"));
    let mut all = args.to_vec();
    let json_arg = json.to_str().unwrap().to_string();
    all.extend_from_slice(&["--progress", "0", "--json", &json_arg]);
    let out = bench(&all);
    if must_succeed {
        assert!(out.status.success(), "{name} failed:\n{}", text(&out));
    }
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    check_schema(&doc);
    doc
}

fn num(v: &Value, path: &str) -> f64 {
    let mut cur = v;
    for p in path.split('.') {
        cur = &cur[p];
    }
    cur.as_f64()
        .unwrap_or_else(|| panic!("{path} is not a number in {v:#}"))
}

/// Every field a script may rely on, with its type.
fn check_schema(doc: &Value) {
    assert_eq!(doc["schema"], "felix-bench/1");
    for key in ["workload", "stop_reason"] {
        assert!(doc[key].is_string(), "{key}: {doc:#}");
    }
    assert!(doc["ok"].is_boolean());
    for key in [
        "started_unix_ms",
        "warmup_secs",
        "measured_secs",
        "records",
        "bytes",
        "records_per_sec",
        "mb_per_sec",
        "errors",
    ] {
        assert!(doc[key].is_number(), "{key} should be a number: {doc:#}");
    }
    for key in ["target", "version", "broker", "mode"] {
        assert!(doc["target"][key].is_string(), "target.{key}: {doc:#}");
    }
    let lat = &doc["latency"];
    assert!(lat["what"].is_string());
    for key in [
        "count", "mean_us", "p50_us", "p90_us", "p99_us", "p999_us", "max_us",
    ] {
        assert!(lat[key].is_number(), "latency.{key}: {doc:#}");
    }
    assert!(num(doc, "latency.p50_us") <= num(doc, "latency.p99_us"));
    assert!(num(doc, "latency.p99_us") <= num(doc, "latency.max_us"));
    assert!(doc["params"].is_object());
    assert!(doc["totals"].is_object());
    assert!(doc["machine"]["cpus"].is_number());
    let checks = doc["checks"].as_array().expect("checks is an array");
    assert!(!checks.is_empty());
    for c in checks {
        assert!(c["name"].is_string() && c["detail"].is_string());
        assert!(c["ok"].is_boolean() || c["ok"].is_null());
    }
}

fn all_checks_pass(doc: &Value) {
    assert_eq!(doc["ok"], true, "{doc:#}");
    assert_eq!(num(doc, "errors"), 0.0);
    for c in doc["checks"].as_array().unwrap() {
        assert_ne!(c["ok"], false, "check failed: {c}");
    }
}

#[test]
fn bad_arguments_exit_2_and_name_the_flag() {
    for (args, flag) in [
        (&["publish", "--shards", "0"][..], "--shards"),
        (
            &["publish", "--count", "5", "--duration", "1"][..],
            "--duration",
        ),
        (&["queue", "--per-poll", "0"][..], "--per-poll"),
        (&["e2e", "--record-size", "4"][..], "--record-size"),
        (&["read", "--prefill", "0"][..], "--prefill"),
    ] {
        let out = bench(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}:\n{}", text(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(flag),
            "{args:?} should name {flag}:\n{}",
            text(&out)
        );
    }
}

#[test]
fn help_lists_every_workload_and_flag() {
    let out = bench(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for w in ["publish", "read", "queue", "e2e"] {
        assert!(help.contains(w), "{help}");
    }
    assert!(!help.contains("__serve"), "the serve command is hidden");
    let out = bench(&["publish", "--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--target",
        "--broker",
        "--broker-cores",
        "--producers",
        "--batch",
        "--inflight",
        "--ack",
        "--rate",
        "--duration",
        "--count",
        "--warmup",
        "--json",
        "--record-size",
        "--shards",
    ] {
        assert!(help.contains(flag), "publish --help lacks {flag}");
    }
}

#[test]
fn embedded_runs_count_every_record() {
    let dir = tempfile::tempdir().unwrap();

    // Publish exactly 2,000 records; the broker holds exactly those.
    let doc = run_json(
        dir.path(),
        "publish",
        &[
            "publish", "--count", "2000", "--warmup", "0", "--batch", "100", "--shards", "2",
        ],
    );
    all_checks_pass(&doc);
    assert_eq!(doc["workload"], "publish");
    assert_eq!(doc["target"]["broker"], "embedded");
    assert_eq!(num(&doc, "records"), 2000.0);
    assert_eq!(num(&doc, "totals.published"), 2000.0);
    assert_eq!(num(&doc, "bytes"), 2000.0 * 100.0);
    assert_eq!(
        num(&doc, "latency.count"),
        20.0,
        "one sample per batch of 100"
    );
    assert_eq!(doc["stop_reason"], "count");
    // The broker's own account of the same publishes, from its metrics.
    assert_eq!(doc["broker_publish_latency"]["ack"], "durable", "{doc:#}");
    assert_eq!(num(&doc, "broker_publish_latency.count"), 20.0);

    // Paced at 1,000 records/s for 1 s by two producers (batches of 10,
    // one every 20 ms each): the batches are due over the whole second, so
    // the run cannot end sooner, nor send more than they hold (a pacer that
    // did not wait would publish as fast as the unpaced run above, for the
    // whole second).
    let began = std::time::Instant::now();
    let doc = run_json_status(
        dir.path(),
        "publish-paced",
        &[
            "publish",
            "--rate",
            "1000",
            "--batch",
            "10",
            "--producers",
            "2",
            "--duration",
            "1",
            "--warmup",
            "0",
        ],
        false,
    );
    let took = began.elapsed();
    assert_eq!(num(&doc, "params.rate"), 1000.0);
    assert!(
        took >= std::time::Duration::from_millis(900),
        "a paced run of 1 s ended after {took:?}: {doc:#}"
    );
    let records = num(&doc, "records");
    assert!(records > 0.0 && records <= 1200.0, "{doc:#}");

    // Publish 2,000 and read them all back.
    let doc = run_json(
        dir.path(),
        "read",
        &[
            "read",
            "--prefill",
            "2000",
            "--count",
            "2000",
            "--warmup",
            "0",
            "--shards",
            "2",
        ],
    );
    all_checks_pass(&doc);
    assert_eq!(num(&doc, "totals.published"), 2000.0);
    assert_eq!(num(&doc, "records"), 2000.0);
    assert!(
        num(&doc, "totals.passes") >= 2.0,
        "one pass per shard at least"
    );

    // A queue of 1,000 records, every one acknowledged once.
    let doc = run_json(
        dir.path(),
        "queue",
        &[
            "queue",
            "--count",
            "1000",
            "--warmup",
            "0",
            "--consumers",
            "2",
            "--per-poll",
            "50",
        ],
    );
    all_checks_pass(&doc);
    assert_eq!(num(&doc, "totals.published"), 1000.0);
    assert_eq!(num(&doc, "totals.acked"), 1000.0);
    assert_eq!(num(&doc, "records"), 1000.0);

    // Paced at 2,000 records/s: every record still acknowledged once, and the
    // run cannot end before the rate lets the consumers take the last poll
    // (each of the two takes 300 at 1,000/s, the last 50 due at 0.25 s).
    let doc = run_json(
        dir.path(),
        "queue-paced",
        &[
            "queue",
            "--count",
            "600",
            "--warmup",
            "0",
            "--consumers",
            "2",
            "--shards",
            "2",
            "--per-poll",
            "50",
            "--rate",
            "2000",
        ],
    );
    all_checks_pass(&doc);
    assert_eq!(num(&doc, "totals.acked"), 600.0);
    assert_eq!(num(&doc, "offered_rate"), 2000.0);
    assert!(
        num(&doc, "measured_secs") >= 0.25,
        "paced consumers finished early: {doc:#}"
    );

    // With nacks: every record still ends acknowledged, nacked ones redelivered.
    let doc = run_json(
        dir.path(),
        "queue-nack",
        &[
            "queue",
            "--count",
            "1000",
            "--warmup",
            "0",
            "--nack-rate",
            "0.1",
            "--per-poll",
            "50",
        ],
    );
    all_checks_pass(&doc);
    assert_eq!(num(&doc, "totals.acked"), 1000.0);
    let nacked = num(&doc, "totals.nacked");
    assert!(nacked > 0.0);
    assert_eq!(num(&doc, "totals.redelivered"), nacked);
    assert_eq!(num(&doc, "totals.delivered"), 1000.0 + nacked);

    // End to end at a low rate: everything published arrives. (Not required
    // to succeed: on a loaded machine the "offered rate sustained" check may
    // fail, and that is about timing.)
    let doc = run_json_status(
        dir.path(),
        "e2e",
        &[
            "e2e",
            "--rate",
            "400",
            "--duration",
            "0.5",
            "--warmup",
            "0.2",
        ],
        false,
    );
    assert_eq!(num(&doc, "errors"), 0.0, "{doc:#}");
    assert_eq!(num(&doc, "totals.published"), num(&doc, "totals.delivered"));
    assert!(doc["publish_latency"].is_object());
    assert_eq!(num(&doc, "offered_rate"), 400.0);
}

#[test]
fn json_to_stdout_keeps_the_summary_on_stderr() {
    let out = bench(&[
        "publish",
        "--count",
        "300",
        "--warmup",
        "0",
        "--progress",
        "0",
        "--json",
        "-",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let doc: Value = serde_json::from_slice(&out.stdout).expect("stdout is only JSON");
    check_schema(&doc);
    assert_eq!(num(&doc, "records"), 300.0);
    assert!(String::from_utf8_lossy(&out.stderr).contains("felix-bench publish"));
}

/// `--stream` naming a stream that already exists on the broker is refused,
/// and the stream and its records are left exactly as they were (the bench
/// removes only streams it created); a run on its own stream cleans it up.
#[test]
fn an_existing_stream_is_refused_and_left_alone_and_the_bench_removes_only_its_own() {
    let broker = felix_bench::embedded::EmbeddedBroker::start_exe(
        Path::new(env!("CARGO_BIN_EXE_felix-bench")),
        &felix_bench::embedded::EmbeddedOptions {
            cores: "1",
            parent_dir: None,
            log: "warn",
            ack_on_commit: true,
        },
    )
    .expect("start a broker");
    let addr = broker.addr().to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = rt
        .block_on(felix_client::Client::connect(
            addr.as_str(),
            felix_client::ClientConfig::default(),
        ))
        .expect("connect");
    rt.block_on(client.create_stream("keep", "me", "here", 1, Default::default()))
        .expect("create");
    for i in 0..3u8 {
        rt.block_on(client.publish("keep", "me", "here", 0, vec![i; 10]))
            .expect("publish");
    }

    let o = bench(&[
        "publish",
        "--broker",
        &addr,
        "--stream",
        "keep/me/here",
        "--count",
        "100",
        "--warmup",
        "0",
        "--progress",
        "0",
    ]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("already_exists"), "{}", text(&o));
    let info = rt
        .block_on(client.describe_stream("keep", "me", "here"))
        .expect("the user's stream is still there");
    assert_eq!(info.shards, 1);
    let shard = rt
        .block_on(client.describe_shard("keep", "me", "here", 0))
        .expect("describe shard");
    assert_eq!(shard.end_offset, 3, "its records are still there");

    let o = bench(&[
        "publish",
        "--broker",
        &addr,
        "--count",
        "100",
        "--warmup",
        "0",
        "--progress",
        "0",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let names: Vec<String> = rt
        .block_on(client.list_streams(None))
        .unwrap()
        .iter()
        .map(|s| {
            format!(
                "{}/{}/{}",
                s.stream.tenant, s.stream.namespace, s.stream.stream
            )
        })
        .collect();
    assert_eq!(names, ["keep/me/here"], "the bench's own stream is removed");
}
