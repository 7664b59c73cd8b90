//! The Python and Node clients' own test suites, run against real brokers:
//! one plain, one that requires a token. Each suite reads the addresses from
//! `FELIX_ADDR` and `FELIX_AUTH_ADDR` (with `FELIX_AUTH_TOKEN` and
//! `FELIX_AUTH_PRINCIPAL`). Their cluster tests start, `kill -9` and restart
//! brokers of their own: `FELIX_TEST_BROKER` names the binary
//! (`felix-test-broker DATA_DIR LISTEN CORES`, configured by `FELIX_*`
//! variables).
//!
//! A machine without `python3` or `node` skips that suite with a note on
//! stderr, unless `FELIX_REQUIRE_CLIENTS=1` (CI sets it) makes a missing
//! interpreter a failure.

use felix_tests::{Broker, BrokerOptions};
use std::path::{Path, PathBuf};
use std::process::Command;

/// `printf %s alice-secret | sha256sum`.
const ALICE_DIGEST: &str = "0c848abb03307b06cf70cd4e29c157dc81af5e94ab3eb1d0c59a120269572376";
const ALICE_TOKEN: &str = "alice-secret";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the workspace")
        .to_path_buf()
}

/// Whether `program --version` runs; if not, skip (or fail under CI).
fn interpreter(program: &str) -> bool {
    let found = Command::new(program)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var("FELIX_REQUIRE_CLIENTS").as_deref() != Ok("1"),
            "{program} is required (FELIX_REQUIRE_CLIENTS=1) but does not run"
        );
        eprintln!("skipped: {program} not found, so its client's tests did not run");
    }
    found
}

/// The brokers a suite runs against, kept alive for its duration.
struct Brokers {
    plain: Broker,
    auth: Broker,
    _tokens: tempfile::TempDir,
}

fn brokers() -> Brokers {
    let options = || BrokerOptions::default().env("FELIX_GROUP_MAX_ATTEMPTS", 3);
    let tokens = tempfile::tempdir().expect("tempdir");
    let tokens_file = tokens.path().join("tokens");
    std::fs::write(&tokens_file, format!("alice {ALICE_DIGEST}\n")).expect("tokens file");
    Brokers {
        plain: felix_tests::start_broker!(options()),
        auth: felix_tests::start_broker!(options().env("FELIX_TOKENS_FILE", tokens_file.display())),
        _tokens: tokens,
    }
}

/// One suite at a time: each runs its own tests in parallel against brokers
/// of its own, and timing-sensitive cases (short visibility timeouts) should
/// not share the machine with the other suite too.
static ONE_SUITE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Run a suite with the brokers' addresses; fail with its output if it fails.
fn run_suite(mut cmd: Command, name: &str) {
    let _turn = ONE_SUITE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let b = brokers();
    let out = cmd
        .current_dir(repo_root())
        .env("FELIX_ADDR", &b.plain.addr)
        .env("FELIX_AUTH_ADDR", &b.auth.addr)
        .env("FELIX_AUTH_TOKEN", ALICE_TOKEN)
        .env("FELIX_AUTH_PRINCIPAL", "alice")
        .env("FELIX_TEST_BROKER", env!("CARGO_BIN_EXE_felix-test-broker"))
        .output()
        .unwrap_or_else(|e| panic!("run the {name} suite: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the {name} suite failed:\n{text}");
    eprintln!("{text}");
}

#[test]
fn the_python_client_suite_passes_against_a_real_broker() {
    if !interpreter("python3") {
        return;
    }
    let mut cmd = Command::new("python3");
    cmd.args([
        "-m",
        "unittest",
        "discover",
        "-s",
        "client/python/tests",
        "-t",
        "client/python",
    ])
    .env("PYTHONDONTWRITEBYTECODE", "1");
    run_suite(cmd, "Python client");
}

#[test]
fn the_node_client_suite_passes_against_a_real_broker() {
    if !interpreter("node") {
        return;
    }
    // The test files by name: how `node --test` treats a directory differs
    // between Node versions.
    let dir = repo_root().join("client/node/test");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("directory entry").path())
        .filter(|p| p.to_string_lossy().ends_with(".test.js"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no *.test.js in {}", dir.display());
    let mut cmd = Command::new("node");
    cmd.arg("--test").args(&files);
    run_suite(cmd, "Node client");
}
