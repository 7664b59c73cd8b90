//! Support for end-to-end tests: start, kill -9 and restart real broker
//! processes on loopback, and wait on conditions with deadlines instead of
//! sleeping.

pub mod partition;

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a broker may take to start before the test fails.
pub const START_DEADLINE: Duration = Duration::from_secs(20);

/// A broker process under test.
pub struct Broker {
    bin: String,
    child: Option<Child>,
    pub addr: String,
    pub metrics_addr: String,
    data_dir: Option<PathBuf>,
    _tmp: Option<tempfile::TempDir>,
    env: Vec<(String, String)>,
    cores: u32,
}

/// How to start a broker.
#[derive(Clone, Debug)]
pub struct BrokerOptions {
    pub cores: u32,
    pub durable: bool,
    pub env: Vec<(String, String)>,
    /// Address to listen on (default `127.0.0.1:0`, a free port).
    pub listen: Option<String>,
}

impl Default for BrokerOptions {
    fn default() -> Self {
        BrokerOptions {
            cores: 2,
            durable: true,
            env: Vec::new(),
            listen: None,
        }
    }
}

impl BrokerOptions {
    pub fn env(mut self, k: &str, v: impl ToString) -> Self {
        self.env.push((k.to_string(), v.to_string()));
        self
    }
    pub fn cores(mut self, n: u32) -> Self {
        self.cores = n;
        self
    }
    pub fn in_memory(mut self) -> Self {
        self.durable = false;
        self
    }
    pub fn listen(mut self, addr: impl ToString) -> Self {
        self.listen = Some(addr.to_string());
        self
    }
}

/// Start a broker from an integration test (the binary's path is only known
/// there): `let b = felix_tests::start_broker!(BrokerOptions::default());`
#[macro_export]
macro_rules! start_broker {
    ($opts:expr) => {
        $crate::Broker::start_with(env!("CARGO_BIN_EXE_felix-test-broker"), $opts)
    };
}

/// The broker binary run by hand, as [`broker_command`] builds it:
/// `felix_tests::broker_command!(data_dir, listen)`.
#[macro_export]
macro_rules! broker_command {
    ($data_dir:expr, $listen:expr) => {
        $crate::broker_command(env!("CARGO_BIN_EXE_felix-test-broker"), $data_dir, $listen)
    };
}

/// `felix-test-broker DATA_DIR|- LISTEN 1` with the tests' defaults (no
/// metrics listener, warn logs, no stdin), for tests that run the binary by
/// hand: to watch it refuse to start, or with settings of their own.
pub fn broker_command(bin: &str, data_dir: Option<&Path>, listen: &str) -> Command {
    broker_command_on_cores(bin, data_dir, listen, 1)
}

/// [`broker_command`] on `cores` cores.
pub fn broker_command_on_cores(
    bin: &str,
    data_dir: Option<&Path>,
    listen: &str,
    cores: u32,
) -> Command {
    let dir = data_dir.map_or_else(|| "-".to_string(), |d| d.display().to_string());
    let mut cmd = Command::new(bin);
    cmd.args([dir.as_str(), listen, &cores.to_string()])
        .env("FELIX_METRICS_LISTEN", "")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null());
    cmd
}

/// Give the process `cmd` starts a limit of `files` open files (soft and
/// hard, so the broker cannot raise it), to watch it run short.
pub fn limit_open_files(cmd: &mut Command, files: u64) {
    use std::os::unix::process::CommandExt;
    // SAFETY: only setrlimit(2) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let lim = libc::rlimit {
                rlim_cur: files,
                rlim_max: files,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// A broker process started by hand: killed when dropped, so a test that
/// fails midway leaves no broker running (one would hold the test's output
/// pipes open and keep `cargo test` waiting). Derefs to the [`Child`].
pub struct Spawned(Child);

impl std::ops::Deref for Spawned {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Spawned {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Spawn `cmd` (a [`broker_command`]) with stdout piped; returns it (killed
/// when dropped) and the address it announced. Kills it and panics if it
/// announces nothing within [`START_DEADLINE`].
pub fn spawn_announcing(mut cmd: Command) -> (Spawned, String) {
    use std::io::BufRead;
    let mut child = cmd.stdout(Stdio::piped()).spawn().expect("start broker");
    let out = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(a) = line.strip_prefix("felix: listening on ") {
                let _ = tx.send(a.trim().to_string());
            }
        }
    });
    match rx.recv_timeout(START_DEADLINE) {
        Ok(addr) => (Spawned(child), addr),
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the broker did not announce its address: {e}");
        }
    }
}

impl Broker {
    pub fn start_with(bin: &str, opts: BrokerOptions) -> Broker {
        let tmp = tempfile::tempdir().expect("tempdir");
        let data_dir = opts.durable.then(|| tmp.path().join("data"));
        let mut b = Broker {
            bin: bin.to_string(),
            child: None,
            addr: opts.listen.unwrap_or_else(|| "127.0.0.1:0".into()),
            metrics_addr: "127.0.0.1:0".into(),
            data_dir,
            _tmp: Some(tmp),
            env: opts.env,
            cores: opts.cores,
        };
        b.spawn();
        b
    }

    /// The running broker's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn data_dir(&self) -> Option<&Path> {
        self.data_dir.as_deref()
    }

    /// Start the broker. A start that does not announce within
    /// [`START_DEADLINE`] is killed and tried again (twice), and the retry
    /// is logged so the suite says when it happened. It is a guard, not a
    /// fix: the broker's watchdog wakes an executor glommio parked before
    /// its first task ran (see `felix_engine::runtime`), which used to hang
    /// about one start in 2,000 under load.
    fn spawn(&mut self) {
        let mut last = String::new();
        for attempt in 1..=3 {
            match self.try_spawn() {
                Ok(()) => return,
                Err(e) => {
                    eprintln!("felix-tests: broker start attempt {attempt} failed: {e}");
                    last = e;
                }
            }
        }
        panic!("{last}");
    }

    fn try_spawn(&mut self) -> Result<(), String> {
        let bin = &self.bin;
        let dir = self
            .data_dir
            .as_ref()
            .map(|d| d.display().to_string())
            .unwrap_or_else(|| "-".into());
        let mut cmd = Command::new(bin);
        cmd.arg(dir)
            .arg(&self.addr)
            .arg(self.cores.to_string())
            .env("FELIX_METRICS_LISTEN", "127.0.0.1:0")
            .env(
                "RUST_LOG",
                std::env::var("FELIX_TEST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start broker");
        // The broker prints the addresses it bound (port 0 picks free ports).
        // Read them on a helper thread so a broker that never announces
        // fails the test after a deadline instead of hanging the suite.
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufRead::lines(std::io::BufReader::new(out)) {
                let Ok(line) = line else { break };
                if line.starts_with("felix: ") && tx.send(line).is_err() {
                    // Nobody listens any more; keep draining so the broker
                    // never blocks on a full pipe.
                }
            }
        });
        let deadline = Instant::now() + START_DEADLINE;
        let mut found = 0;
        while found < 2 {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match rx.recv_timeout(left) {
                Ok(line) => line,
                Err(e) => {
                    let _ = child.kill();
                    let status = child.wait().ok();
                    return Err(format!(
                        "broker did not announce its addresses within {START_DEADLINE:?} \
                         ({e}; exit status {status:?})"
                    ));
                }
            };
            if let Some(a) = line.strip_prefix("felix: listening on ") {
                self.addr = a.trim().to_string();
                found += 1;
            } else if let Some(a) = line.strip_prefix("felix: metrics on http://") {
                self.metrics_addr = a.trim().trim_end_matches("/metrics").to_string();
                found += 1;
            }
        }
        self.child = Some(child);
        wait_until(Duration::from_secs(20), || {
            TcpStream::connect(&self.addr).is_ok()
        })
        .map_err(|_| format!("broker did not start listening on {}", self.addr))
    }

    /// `kill -9`: no shutdown, no flush.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait for the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        self.signal_and_wait(libc::SIGTERM)
    }

    /// SIGINT (Ctrl-C) and wait for the exit status.
    pub fn interrupt(&mut self) -> std::process::ExitStatus {
        self.signal_and_wait(libc::SIGINT)
    }

    /// A broker that has not exited within a minute of the signal is
    /// killed and the test fails, rather than hanging the run.
    fn signal_and_wait(&mut self, sig: libc::c_int) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("running");
        // SAFETY: sending a signal to our own child process.
        unsafe { libc::kill(c.id() as i32, sig) };
        let mut status = None;
        let _ = wait_until(Duration::from_secs(60), || {
            status = c.try_wait().expect("wait");
            status.is_some()
        });
        status.unwrap_or_else(|| {
            let _ = c.kill();
            let _ = c.wait();
            panic!("the broker did not exit within 60 s of signal {sig}");
        })
    }

    /// Start again on the same data directory and address.
    pub fn restart(&mut self) {
        self.kill9();
        // The old process's listening sockets can outlive it briefly (the
        // kernel tears its io_uring down asynchronously) and still complete
        // handshakes, then reset them; with SO_REUSEPORT they would even
        // share connections with the new broker. Wait until nothing listens.
        wait_until(Duration::from_secs(20), || {
            TcpStream::connect(&self.addr).is_err()
        })
        .unwrap_or_else(|_| panic!("the old broker still listens on {}", self.addr));
        self.spawn();
    }

    /// Start again on the same data directory and address, with another
    /// number of cores.
    pub fn restart_with_cores(&mut self, cores: u32) {
        self.cores = cores;
        self.restart();
    }

    /// Start again on the same data directory and address with `k` set to
    /// `v` in its environment (a setting changed between runs).
    pub fn restart_with_env(&mut self, k: &str, v: impl ToString) {
        self.env.retain(|(name, _)| name != k);
        self.env.push((k.to_string(), v.to_string()));
        self.restart();
    }

    /// The Prometheus text of the broker's metrics endpoint.
    pub fn metrics(&self) -> String {
        use std::io::{Read, Write};
        let mut s = TcpStream::connect(&self.metrics_addr).expect("metrics connect");
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    /// The value of one series of a metric: the sample whose labels include
    /// every `name="value"` pair given. `None` if no series matches.
    pub fn metric_series(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let text = self.metrics();
        let line = text.lines().find(|l| {
            l.strip_prefix(name).is_some_and(|rest| {
                rest.starts_with('{')
                    && labels
                        .iter()
                        .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
            })
        })?;
        line.rsplit(' ').next()?.parse().ok()
    }

    /// Sum of a metric's samples (all label sets).
    pub fn metric(&self, name: &str) -> f64 {
        self.metrics()
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A condition did not hold before its deadline.
#[derive(Debug)]
pub struct TimedOut;

/// `n` loopback ports for brokers whose addresses must be known before
/// they start (a cluster's client and replication ports), free when
/// chosen. They come from below the kernel's ephemeral range, so no
/// outgoing connection of this or any other process takes one between
/// now and the broker's bind (ports from `bind(0)` are ephemeral, and a
/// test's own client connections could take one first), and from a
/// per-process cursor, so tests running side by side do not choose the
/// same ones. They are often consecutive: a broker of several cores also
/// takes the ports above its replication port (one per core), so ask for
/// that many more and space them out.
pub fn free_ports(n: usize) -> Vec<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 10_000;
    // Below the ephemeral range (32768 on Linux unless changed).
    let high = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768)
        .clamp(LOW + 1_000, 65_535);
    static CURSOR: AtomicU32 = AtomicU32::new(0);
    let span = high - LOW;
    let start = (u64::from(std::process::id()) * 7_919 % u64::from(span)) as u32;
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let at = LOW + (start + CURSOR.fetch_add(1, Ordering::Relaxed)) % span;
        if std::net::TcpListener::bind(("127.0.0.1", at as u16)).is_ok() {
            out.push(at as u16);
        }
    }
    out
}

/// Poll `cond` until it holds or `deadline` passes.
pub fn wait_until(deadline: Duration, mut cond: impl FnMut() -> bool) -> Result<(), TimedOut> {
    let end = Instant::now() + deadline;
    while Instant::now() < end {
        if cond() {
            return Ok(());
        }
        std::thread::yield_now();
        std::thread::park_timeout(Duration::from_millis(20));
    }
    Err(TimedOut)
}

/// Send one request on a raw wire connection and read one response (tests
/// of what the client library would never send).
pub async fn raw_call(
    s: &mut tokio::net::TcpStream,
    id: u64,
    req: &felix_wire::Request,
) -> felix_wire::Response {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut out = bytes::BytesMut::new();
    felix_wire::encode_request(id, req, &mut out);
    s.write_all(&out).await.unwrap();
    let mut buf = bytes::BytesMut::new();
    loop {
        if let Some((rid, resp)) = felix_wire::decode_response(&mut buf, 64 << 20).unwrap() {
            assert_eq!(rid, id);
            return resp;
        }
        let mut chunk = [0u8; 65536];
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0, "broker closed the connection");
        buf.extend_from_slice(&chunk[..n]);
    }
}
