//! The embedded Felix broker: this executable, run again as a child with the
//! hidden `__serve` command on a temporary durable directory.
//!
//! A child process rather than executors inside the bench process: the
//! broker pins its executors, and a separate process keeps the client's
//! threads, allocator and page faults out of the broker's address space,
//! the way a real deployment runs. The child announces its address on
//! stdout (`felix: listening on ADDR`, port 0 picks a free port), dies with
//! its parent (PR_SET_PDEATHSIG), and is stopped with SIGTERM.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::cli::ServeArgs;

const LISTENING: &str = "felix: listening on ";
const METRICS: &str = "felix: metrics on http://";
/// How long to wait for the metrics address after the broker's address.
const METRICS_GRACE: Duration = Duration::from_secs(2);

/// A line the broker printed that the bench looks for.
enum Announced {
    Listening(String),
    /// host:port of its Prometheus endpoint.
    Metrics(String),
}
const START_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_TIMEOUT: Duration = Duration::from_secs(20);

/// A running embedded broker; stopped (and its directory removed) on drop.
#[derive(Debug)]
pub struct EmbeddedBroker {
    child: Option<Child>,
    addr: String,
    /// host:port of its Prometheus endpoint.
    metrics: Option<String>,
    dir: Option<tempfile::TempDir>,
}

/// Settings of the child broker.
#[derive(Debug, Clone)]
pub struct EmbeddedOptions<'a> {
    pub cores: &'a str,
    pub parent_dir: Option<&'a Path>,
    pub log: &'a str,
    /// FELIX_ACK_ON_COMMIT for the child.
    pub ack_on_commit: bool,
}

impl EmbeddedBroker {
    /// Start this executable again as the broker.
    pub fn start(opts: &EmbeddedOptions<'_>) -> Result<EmbeddedBroker, String> {
        let exe =
            std::env::current_exe().map_err(|e| format!("cannot find own executable: {e}"))?;
        Self::start_exe(&exe, opts)
    }

    /// Start `exe` (a felix-bench binary: it must have `__serve`) as the
    /// broker. Tests use it, where the running executable is the test.
    pub fn start_exe(exe: &Path, opts: &EmbeddedOptions<'_>) -> Result<EmbeddedBroker, String> {
        let dir = match opts.parent_dir {
            Some(p) => {
                std::fs::create_dir_all(p)
                    .map_err(|e| format!("cannot create {}: {e}", p.display()))?;
                tempfile::Builder::new()
                    .prefix("felix-bench-")
                    .tempdir_in(p)
            }
            None => tempfile::Builder::new().prefix("felix-bench-").tempdir(),
        }
        .map_err(|e| format!("cannot make a temporary data directory: {e}"))?;
        let data = dir.path().join("data");
        let mut cmd = Command::new(exe);
        cmd.arg("__serve")
            .arg("--data-dir")
            .arg(&data)
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--cores")
            .arg(opts.cores)
            // No felix.toml from wherever the bench was started.
            .current_dir(dir.path())
            // Metrics on a free port: the bench reads the broker's own
            // publish latency from them.
            .env("FELIX_METRICS_LISTEN", "127.0.0.1:0")
            .env(
                "FELIX_ACK_ON_COMMIT",
                if opts.ack_on_commit { "1" } else { "0" },
            )
            .env("RUST_LOG", opts.log)
            .env_remove("FELIX_LISTEN")
            .env_remove("FELIX_CORES")
            .env_remove("FELIX_DURABLE_STORAGE_DIR")
            // The bench's own clients bring no token.
            .env_remove("FELIX_TOKENS_FILE")
            .env_remove("FELIX_ACL_FILE")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start the embedded broker: {e}"))?;
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("felix-broker-stdout".into())
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if let Some(a) = line.strip_prefix(LISTENING) {
                        let _ = tx.send(Announced::Listening(a.trim().to_string()));
                    } else if let Some(m) = line
                        .strip_prefix(METRICS)
                        .and_then(|m| m.trim().strip_suffix("/metrics"))
                    {
                        let _ = tx.send(Announced::Metrics(m.to_string()));
                    } else {
                        // Anything else the broker prints goes to our stderr.
                        eprintln!("broker: {line}");
                    }
                }
            })
            .map_err(|e| format!("cannot start a thread: {e}"))?;
        let mut broker = EmbeddedBroker {
            child: Some(child),
            addr: String::new(),
            metrics: None,
            dir: Some(dir),
        };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(Announced::Listening(addr)) => {
                    broker.addr = addr;
                    // The metrics address is printed right after; a broker
                    // that does not print it is served without it.
                    if let Ok(Announced::Metrics(m)) = rx.recv_timeout(METRICS_GRACE) {
                        broker.metrics = Some(m);
                    }
                    return Ok(broker);
                }
                Ok(Announced::Metrics(_)) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {}
            }
            if let Some(child) = broker.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    broker.child = None;
                    return Err(format!(
                        "the embedded broker exited before listening ({status})"
                    ));
                }
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the embedded broker did not announce its address within {}s",
                    START_TIMEOUT.as_secs()
                ));
            }
        }
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The broker's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// host:port of the broker's Prometheus endpoint.
    pub fn metrics_addr(&self) -> Option<&str> {
        self.metrics.as_deref()
    }

    pub fn data_dir(&self) -> Option<&Path> {
        self.dir.as_ref().map(|d| d.path())
    }

    /// SIGTERM, wait for a clean exit (SIGKILL after a grace period), then
    /// remove the data directory.
    pub fn stop(&mut self) -> Result<(), String> {
        let mut result = Ok(());
        if let Some(mut child) = self.child.take() {
            let pid = child.id() as libc::pid_t;
            // SAFETY: signalling our own child process by its pid.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
            let deadline = Instant::now() + STOP_TIMEOUT;
            loop {
                match child.try_wait() {
                    Ok(Some(status)) => {
                        if !status.success() {
                            result = Err(format!("the embedded broker stopped with {status}"));
                        }
                        break;
                    }
                    Ok(None) if Instant::now() < deadline => {
                        // The main thread, after the client runtime is gone:
                        // no executor runs here.
                        #[allow(clippy::disallowed_methods)]
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    _ => {
                        let _ = child.kill();
                        let _ = child.wait();
                        result = Err("the embedded broker did not stop on SIGTERM; killed".into());
                        break;
                    }
                }
            }
        }
        if let Some(dir) = self.dir.take() {
            let _ = dir.close();
        }
        result
    }
}

impl Drop for EmbeddedBroker {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// The hidden `__serve` command: run a broker in this process until SIGTERM.
pub fn serve(args: &ServeArgs) -> i32 {
    // SAFETY: prctl with PR_SET_PDEATHSIG takes a signal number; it only
    // affects this process.
    unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGTERM as libc::c_ulong,
            0,
            0,
            0,
        );
    }
    // The parent may have gone before the prctl took effect.
    // SAFETY: getppid has no preconditions.
    if unsafe { libc::getppid() } == 1 {
        return 1;
    }
    let opts = felix_server::ServeOptions {
        config_path: None,
        data_dir: Some(args.data_dir.clone()),
        listen: Some(args.listen.clone()),
        cores: Some(args.cores.clone()),
        node_id: None,
        peers: None,
        print_config: false,
    };
    match felix_server::serve(opts) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("felix-bench __serve: {e}");
            1
        }
    }
}
