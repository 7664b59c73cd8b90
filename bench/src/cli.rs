//! Command line of `felix-bench`: every flag, its default and its check.
//!
//! Parsing (clap) and validation are kept apart: [`Cli::validate`] turns the
//! parsed flags into a [`Plan`] or a message saying which flag is wrong and
//! why, so the checks are unit-testable without running anything.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Benchmarks Felix (and, for comparison, Redis Streams and NATS JetStream)
/// with reproducible workloads.
///
/// With no --broker, felix-bench starts its own Felix broker on a fresh
/// temporary durable directory (--broker-cores executors), runs the workload
/// against it and removes it afterwards, so `felix-bench publish` works on a
/// fresh machine. Each run warms up (--warmup) before it measures, shows a
/// live progress line on stderr once a second, prints a summary (records/s,
/// MB/s, latency percentiles from an HDR histogram) and, with --json FILE,
/// writes the same in a stable JSON schema ("felix-bench/1").
///
/// See docs/benchmarking.md for what each workload measures and how to read
/// the numbers.
#[derive(Debug, Parser)]
#[command(name = "felix-bench", version, about, long_about, max_term_width = 100)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Publish throughput and acknowledgement latency: producers x shards x
    /// record size x batch size x ack mode, for a fixed count or duration,
    /// optionally at a target rate.
    Publish(PublishArgs),
    /// Replay throughput: fill the stream, then read every shard from the
    /// earliest offset (again from the start each time a pass ends).
    Read(ReadArgs),
    /// Work-queue throughput: fill a backlog, then C consumers of one
    /// consumer group poll and acknowledge it (optionally handing some back
    /// with a nack to be redelivered).
    Queue(QueueArgs),
    /// Publish-to-delivery latency at a fixed offered rate, corrected for
    /// coordinated omission: each record's latency counts from the time it
    /// was meant to be sent, not the time it was.
    E2e(E2eArgs),
    /// Run a Felix broker in this process (used by the embedded mode).
    #[command(name = "__serve", hide = true)]
    Serve(ServeArgs),
}

/// Which broker the workload runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TargetKind {
    /// Felix (embedded unless --broker is given).
    Felix,
    /// NATS JetStream (file storage); one stream per shard, a pull
    /// consumer with explicit acks for queues. Needs a running nats-server
    /// with JetStream enabled (--broker, default 127.0.0.1:4222).
    Nats,
    /// Redis Streams; one stream key per shard, pipelined XADD, XREADGROUP +
    /// XACK for queues. Needs a running redis-server (--broker, default
    /// 127.0.0.1:6379).
    Redis,
}

impl TargetKind {
    pub fn name(self) -> &'static str {
        match self {
            TargetKind::Felix => "felix",
            TargetKind::Nats => "nats",
            TargetKind::Redis => "redis",
        }
    }

    pub fn default_addr(self) -> Option<&'static str> {
        match self {
            TargetKind::Felix => None,
            TargetKind::Nats => Some("127.0.0.1:4222"),
            TargetKind::Redis => Some("127.0.0.1:6379"),
        }
    }
}

/// When a publish is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AckChoice {
    /// As soon as the broker has queued the records, before fdatasync.
    /// Embedded Felix runs with FELIX_ACK_ON_COMMIT=0; an external broker
    /// must be started that way.
    Queued,
    /// The broker's default: for Felix, once an fdatasync covers the records.
    Durable,
    /// The client asks for commit acknowledgements on every publish
    /// (felix-client `ack_on_commit`); same as durable on one node.
    Commit,
}

/// How e2e consumers receive records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Via {
    /// A consumer group: poll (long-poll when idle) + ack.
    Group,
    /// Plain tail reads (long-poll at the end of the log).
    Read,
}

/// How a peer broker is configured, for the report (felix-bench does not
/// configure peers; perf/compare.sh does).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PeerMode {
    /// The peer's most durable setting: Redis `appendonly yes` +
    /// `appendfsync always`; NATS `sync_interval: always`.
    Durable,
    /// The peer's defaults (Redis: no AOF or everysec; NATS: fsync every
    /// 2 minutes).
    Default,
}

/// Flags every workload takes.
#[derive(Debug, Clone, Args)]
pub struct CommonArgs {
    /// Broker to benchmark.
    #[arg(long, value_enum, default_value_t = TargetKind::Felix)]
    pub target: TargetKind,

    /// Address of a running broker (host:port). Without it, felix-bench
    /// starts an embedded Felix broker for --target felix, and connects to
    /// the peer's default port (redis 6379, nats 4222) otherwise. For a
    /// Felix cluster, every broker's address separated by commas: the
    /// stream is created on each, and every shard's publishes, reads and
    /// polls go to the broker that leads it.
    #[arg(long, value_name = "ADDR")]
    pub broker: Option<String>,

    /// Token to authenticate with, for a Felix broker run with a tokens
    /// file (--target felix with --broker; the embedded broker needs none).
    #[arg(
        long,
        value_name = "TOKEN",
        env = "FELIX_TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,

    /// The Prometheus endpoint (IP:PORT) of the Felix broker given with
    /// --broker, to report the broker's own publish latency
    /// (felix_publish_seconds) over the measured window beside the
    /// client's: publish and e2e runs only (others refuse it). The embedded
    /// broker's is used without asking.
    #[arg(long, value_name = "ADDR")]
    pub broker_metrics: Option<String>,

    /// Executors of the embedded Felix broker: a count (the first N CPUs) or
    /// a CPU list like 0,1. Ignored with --broker.
    #[arg(long, value_name = "N|LIST", default_value = "1")]
    pub broker_cores: String,

    /// Directory in which the embedded broker's temporary data directory is
    /// made (it is removed afterwards). Default: the system temp directory.
    /// Put it on the disk you want to measure.
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,

    /// Log filter for the embedded broker (RUST_LOG syntax).
    #[arg(long, value_name = "FILTER", default_value = "warn")]
    pub broker_log: String,

    /// How the peer (--target nats|redis) was configured, for the report.
    /// For Redis it is checked against CONFIG GET.
    #[arg(long, value_enum, value_name = "MODE")]
    pub peer_mode: Option<PeerMode>,

    /// Shards of the benchmark stream (Redis/NATS: one stream each).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub shards: u32,

    /// Payload bytes of each record (at least 16 for e2e, which stamps the
    /// send time into it).
    #[arg(long, default_value_t = 100, value_name = "BYTES")]
    pub record_size: usize,

    /// Headers on each record (Felix only, at most 1,024): N headers named
    /// `h0`, `h1`, ... with 8-byte values, published with every record and
    /// read back or delivered with it. Not counted in MB/s
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub headers: u16,

    /// Measure for this many seconds (after the warm-up). Default 10 unless
    /// --count is given.
    #[arg(long, value_name = "SECS", conflicts_with = "count")]
    pub duration: Option<f64>,

    /// Measure this many records instead of a duration (after the warm-up).
    #[arg(long, value_name = "N")]
    pub count: Option<u64>,

    /// Run the workload this many seconds before measuring (connections,
    /// caches, allocator and broker buffers settle). 0 measures from the
    /// start.
    #[arg(long, default_value_t = 2.0, value_name = "SECS")]
    pub warmup: f64,

    /// Tokio worker threads of the benchmark client. Default: the CPUs not
    /// given to an embedded broker (at least 1). The client is not pinned.
    #[arg(long, value_name = "N")]
    pub client_threads: Option<usize>,

    /// Separate connections (Felix clients) the workers are spread over.
    /// Felix pipelines every request of a client on one connection per
    /// broker core.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub connections: usize,

    /// Name of the benchmark stream. Default: bench/default/<workload>-<time>.
    #[arg(long, value_name = "TENANT/NS/STREAM")]
    pub stream: Option<String>,

    /// Write the results as JSON to this file ("-" for stdout).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,

    /// Seconds between progress lines on stderr; 0 turns them off.
    #[arg(long, default_value_t = 1.0, value_name = "SECS")]
    pub progress: f64,

    /// Label stored in the JSON output (for scripts comparing runs).
    #[arg(long, value_name = "TEXT")]
    pub label: Option<String>,
}

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct PublishArgs {
    #[command(flatten)]
    #[serde(skip)]
    pub common: CommonArgs,

    /// Concurrent producers; producer i publishes to shards i, i+P, ... (or
    /// shard i mod S when there are more producers than shards).
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub producers: usize,

    /// Records per publish request.
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub batch: usize,

    /// Publish requests each producer keeps in flight (pipelined), which
    /// lets the broker's group commit cover many of them with one fdatasync.
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub inflight: usize,

    /// When a publish is acknowledged (Felix only; peers run as configured).
    #[arg(long, value_enum, default_value_t = AckChoice::Durable)]
    pub ack: AckChoice,

    /// Offered load in records per second over all producers (open loop:
    /// latency counts from each batch's scheduled send time). Default: as
    /// fast as acknowledgements allow.
    #[arg(long, value_name = "RECORDS_PER_SEC")]
    pub rate: Option<f64>,
}

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct ReadArgs {
    #[command(flatten)]
    #[serde(skip)]
    pub common: CommonArgs,

    /// Records to publish before reading (spread over the shards; not
    /// measured).
    #[arg(long, default_value_t = 1_000_000, value_name = "N")]
    pub prefill: u64,

    /// Readers; reader i replays shards i, i+R, ... Default: one per shard.
    #[arg(long, value_name = "N")]
    pub readers: Option<usize>,

    /// Most records one read request asks for.
    #[arg(long, default_value_t = 1000, value_name = "N")]
    pub max_records: u32,
}

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct QueueArgs {
    #[command(flatten)]
    #[serde(skip)]
    pub common: CommonArgs,

    /// Consumers of the group (each on its own task).
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub consumers: usize,

    /// Most records one poll claims.
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub per_poll: u32,

    /// Fraction of first deliveries handed back with a nack (0..1); they are
    /// redelivered and acknowledged then. Not supported for Redis.
    #[arg(long, default_value_t = 0.0, value_name = "FRACTION")]
    pub nack_rate: f64,

    /// Acknowledgement requests each consumer may have in flight while it
    /// polls again.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub ack_inflight: usize,

    /// Consume at most this many records per second over all consumers: a
    /// consumer sends its next poll only once the records it has taken so
    /// far are due at its share of the rate. Measures poll latency at a
    /// partial load (e.g. half the rate an unpaced run reaches). Default:
    /// each consumer polls again as soon as its last poll is answered.
    #[arg(long, value_name = "RECORDS_PER_SEC")]
    pub rate: Option<f64>,

    /// Records to publish before consuming. Default: --count plus a quarter
    /// (for the warm-up), or with --duration a million for each second of
    /// the run, warm-up included, up to 50 million (a consumer that drains
    /// it early ends the run, reporting what it measured).
    #[arg(long, value_name = "N")]
    pub backlog: Option<u64>,
}

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct E2eArgs {
    #[command(flatten)]
    #[serde(skip)]
    pub common: CommonArgs,

    /// Offered load in records per second over all producers.
    #[arg(long, default_value_t = 10_000.0, value_name = "RECORDS_PER_SEC")]
    pub rate: f64,

    /// Concurrent producers.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub producers: usize,

    /// Records per publish request.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub batch: usize,

    /// Publish requests a producer may have in flight.
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub inflight: usize,

    /// Consumers; consumer i follows shards i, i+C, ...
    /// Default: one per shard.
    #[arg(long, value_name = "N")]
    pub consumers: Option<usize>,

    /// Most records one poll or read returns.
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub per_poll: u32,

    /// How consumers receive records.
    #[arg(long, value_enum, default_value_t = Via::Group)]
    pub via: Via,

    /// When a publish is acknowledged (Felix only).
    #[arg(long, value_enum, default_value_t = AckChoice::Durable)]
    pub ack: AckChoice,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    #[arg(long)]
    pub data_dir: PathBuf,
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    #[arg(long, default_value = "1")]
    pub cores: String,
}

/// How long, or how much, to measure.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Amount {
    Duration(Duration),
    Count(u64),
}

/// A stream name split into its parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamName {
    pub tenant: String,
    pub namespace: String,
    pub stream: String,
}

impl StreamName {
    /// A name safe to use as a Redis key part and a NATS stream name.
    pub fn flat(&self) -> String {
        format!("{}_{}_{}", self.tenant, self.namespace, self.stream)
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect()
    }
}

impl std::fmt::Display for StreamName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}/{}", self.tenant, self.namespace, self.stream)
    }
}

/// Validated settings shared by every workload.
#[derive(Debug, Clone)]
pub struct Common {
    pub target: TargetKind,
    pub broker: Option<String>,
    /// Sent only to a Felix broker given with --broker.
    pub token: Option<String>,
    /// A Felix broker's metrics endpoint, given with --broker.
    pub broker_metrics: Option<String>,
    pub broker_cores: String,
    pub broker_core_count: usize,
    pub data_dir: Option<PathBuf>,
    pub broker_log: String,
    pub peer_mode: Option<PeerMode>,
    pub shards: u32,
    pub record_size: usize,
    pub headers: u16,
    pub amount: Amount,
    pub warmup: Duration,
    pub client_threads: usize,
    pub connections: usize,
    pub stream: StreamName,
    pub json: Option<PathBuf>,
    pub progress: Option<Duration>,
    pub label: Option<String>,
}

/// A validated workload, ready to run.
#[derive(Debug, Clone)]
pub enum Plan {
    Publish(Common, PublishArgs),
    Read(Common, ReadArgs),
    Queue(Common, QueueArgs, u64),
    E2e(Common, E2eArgs),
}

impl Plan {
    pub fn common(&self) -> &Common {
        match self {
            Plan::Publish(c, _) | Plan::Read(c, _) | Plan::Queue(c, _, _) | Plan::E2e(c, _) => c,
        }
    }

    pub fn workload(&self) -> &'static str {
        match self {
            Plan::Publish(..) => "publish",
            Plan::Read(..) => "read",
            Plan::Queue(..) => "queue",
            Plan::E2e(..) => "e2e",
        }
    }
}

/// Records one publish may carry (the broker's `max_records_per_publish`).
pub const MAX_BATCH: usize = 100_000;
/// Largest record: well under the broker's 16 MiB frame.
pub const MAX_RECORD_BYTES: usize = 4 << 20;
/// Bytes e2e stamps into each payload (send time + sequence).
pub const STAMP_BYTES: usize = 16;

fn err<T>(msg: impl Into<String>) -> Result<T, String> {
    Err(msg.into())
}

fn secs(flag: &str, v: f64) -> Result<Duration, String> {
    if !v.is_finite() || !(0.0..=86_400.0).contains(&v) {
        return err(format!(
            "{flag} must be between 0 and 86400 seconds, not {v}"
        ));
    }
    Ok(Duration::from_secs_f64(v))
}

fn parse_stream(s: &str) -> Result<StreamName, String> {
    let parts: Vec<&str> = s.split('/').collect();
    let ok = |p: &str| {
        !p.is_empty()
            && p.len() <= 64
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
    };
    match parts.as_slice() {
        [t, n, st] if ok(t) && ok(n) && ok(st) => Ok(StreamName {
            tenant: t.to_string(),
            namespace: n.to_string(),
            stream: st.to_string(),
        }),
        _ => err(format!(
            "--stream must be TENANT/NAMESPACE/STREAM of letters, digits, '-', '_' or '.', not {s:?}"
        )),
    }
}

/// How many executors a `--broker-cores` value asks for.
fn core_count(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let bad = || format!("--broker-cores must be a count like 2 or a CPU list like 0,1, not {s:?}");
    if s.contains(',') {
        let ids: Result<Vec<usize>, _> = s.split(',').map(|p| p.trim().parse::<usize>()).collect();
        match ids {
            Ok(v) if !v.is_empty() => Ok(v.len()),
            _ => Err(bad()),
        }
    } else {
        match s.parse::<usize>() {
            Ok(n) if (1..=1024).contains(&n) => Ok(n),
            _ => Err(bad()),
        }
    }
}

fn available_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

impl CommonArgs {
    fn validate(&self, workload: &str) -> Result<Common, String> {
        if self.shards == 0 || self.shards > 4096 {
            return err(format!("--shards must be 1 to 4096, not {}", self.shards));
        }
        if self.record_size == 0 || self.record_size > MAX_RECORD_BYTES {
            return err(format!(
                "--record-size must be 1 to {MAX_RECORD_BYTES} bytes, not {}",
                self.record_size
            ));
        }
        let amount = match (self.duration, self.count) {
            (Some(_), Some(_)) => return err("give --duration or --count, not both"),
            (_, Some(0)) => return err("--count must be at least 1"),
            (_, Some(n)) => Amount::Count(n),
            (Some(d), None) => {
                let d = secs("--duration", d)?;
                if d < Duration::from_millis(100) {
                    return err("--duration must be at least 0.1 seconds");
                }
                Amount::Duration(d)
            }
            (None, None) => Amount::Duration(Duration::from_secs(10)),
        };
        let warmup = secs("--warmup", self.warmup)?;
        let progress = match secs("--progress", self.progress)? {
            d if d.is_zero() => None,
            d if d < Duration::from_millis(100) => {
                return err("--progress must be 0 (off) or at least 0.1 seconds")
            }
            d => Some(d),
        };
        let broker_core_count = core_count(&self.broker_cores)?;
        if self.target != TargetKind::Felix && self.broker.is_none() && self.data_dir.is_some() {
            return err("--data-dir is for the embedded Felix broker only");
        }
        if self.headers > 1024 {
            return err(format!("--headers must be 0 to 1024, not {}", self.headers));
        }
        if self.headers > 0 && self.target != TargetKind::Felix {
            return err("--headers is for --target felix only");
        }
        if self.target == TargetKind::Felix && self.peer_mode.is_some() {
            return err("--peer-mode describes a Redis or NATS peer, not Felix");
        }
        if let Some(b) = &self.broker {
            let list: Vec<&str> = b.split(',').map(str::trim).collect();
            if list.iter().any(|a| !a.contains(':')) {
                return err(format!("--broker must be HOST:PORT (or, for a Felix cluster, HOST:PORT,HOST:PORT,...), not {b:?}"));
            }
            if list.len() > 1 && self.target != TargetKind::Felix {
                return err("a list of brokers (a cluster) is for --target felix only");
            }
        }
        if let Some(m) = &self.broker_metrics {
            if !matches!(workload, "publish" | "e2e") {
                return err(
                    "--broker-metrics is for publish and e2e runs (the broker's publish latency)",
                );
            }
            if self.broker.is_none() || self.target != TargetKind::Felix {
                return err("--broker-metrics is for a Felix broker given with --broker (the embedded broker's are read without it)");
            }
            if m.parse::<std::net::SocketAddr>().is_err() {
                return err(format!(
                    "--broker-metrics must be IP:PORT of the broker's metrics_listen, not {m:?}"
                ));
            }
        }
        let client_threads = match self.client_threads {
            Some(0) => return err("--client-threads must be at least 1"),
            Some(n) if n > 256 => return err("--client-threads must be at most 256"),
            Some(n) => n,
            None => {
                let embedded = self.target == TargetKind::Felix && self.broker.is_none();
                let taken = if embedded { broker_core_count } else { 0 };
                available_cpus().saturating_sub(taken).max(1)
            }
        };
        if self.connections == 0 || self.connections > 1024 {
            return err(format!(
                "--connections must be 1 to 1024, not {}",
                self.connections
            ));
        }
        let stream = match &self.stream {
            Some(s) => parse_stream(s)?,
            None => {
                let t = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis());
                StreamName {
                    tenant: "bench".into(),
                    namespace: "default".into(),
                    stream: format!("{workload}-{t}"),
                }
            }
        };
        Ok(Common {
            target: self.target,
            broker: self.broker.clone(),
            token: self.broker.as_ref().and(self.token.clone()),
            broker_metrics: self.broker_metrics.clone(),
            broker_cores: self.broker_cores.trim().to_string(),
            broker_core_count,
            data_dir: self.data_dir.clone(),
            broker_log: self.broker_log.clone(),
            peer_mode: self.peer_mode,
            shards: self.shards,
            record_size: self.record_size,
            headers: self.headers,
            amount,
            warmup,
            client_threads,
            connections: self.connections,
            stream,
            json: self.json.clone(),
            progress,
            label: self.label.clone(),
        })
    }
}

fn check_range(flag: &str, v: usize, lo: usize, hi: usize) -> Result<(), String> {
    if v < lo || v > hi {
        return err(format!("{flag} must be {lo} to {hi}, not {v}"));
    }
    Ok(())
}

fn check_rate(flag: &str, r: f64) -> Result<(), String> {
    if !r.is_finite() || !(1e-3..=1e9).contains(&r) {
        return err(format!(
            "{flag} must be at least 0.001 and at most 1e9 records/s, not {r}"
        ));
    }
    Ok(())
}

impl Cli {
    /// Check every flag; `Ok(None)` for the hidden serve command.
    pub fn validate(&self) -> Result<Option<Plan>, String> {
        match &self.command {
            Command::Serve(_) => Ok(None),
            Command::Publish(a) => {
                let c = a.common.validate("publish")?;
                check_range("--producers", a.producers, 1, 10_000)?;
                check_range("--batch", a.batch, 1, MAX_BATCH)?;
                check_range("--inflight", a.inflight, 1, 10_000)?;
                if let Some(r) = a.rate {
                    check_rate("--rate", r)?;
                }
                if c.target != TargetKind::Felix && a.ack != AckChoice::Durable {
                    return err("--ack applies to Felix; configure a peer's durability with its own settings (--peer-mode labels it)");
                }
                if c.record_size * a.batch > 8 << 20 {
                    return err("--record-size x --batch must stay under 8 MiB (the request frame limit is 16 MiB)");
                }
                Ok(Some(Plan::Publish(c, a.clone())))
            }
            Command::Read(a) => {
                let c = a.common.validate("read")?;
                if a.prefill == 0 {
                    return err("--prefill must be at least 1");
                }
                if a.prefill < u64::from(c.shards) {
                    return err("--prefill must be at least one record per shard");
                }
                if let Some(r) = a.readers {
                    check_range("--readers", r, 1, 10_000)?;
                }
                if a.max_records == 0 || a.max_records > 100_000 {
                    return err("--max-records must be 1 to 100000");
                }
                Ok(Some(Plan::Read(c, a.clone())))
            }
            Command::Queue(a) => {
                let c = a.common.validate("queue")?;
                check_range("--consumers", a.consumers, 1, 10_000)?;
                check_range("--ack-inflight", a.ack_inflight, 1, 10_000)?;
                if let Some(r) = a.rate {
                    check_rate("--rate", r)?;
                }
                if a.per_poll == 0 || a.per_poll > 1000 {
                    return err(
                        "--per-poll must be 1 to 1000 (a poll returns at most 1,000 records)",
                    );
                }
                if !(0.0..1.0).contains(&a.nack_rate) {
                    return err(format!(
                        "--nack-rate must be at least 0 and below 1, not {}",
                        a.nack_rate
                    ));
                }
                if a.nack_rate > 0.0 && c.target == TargetKind::Redis {
                    return err("--nack-rate: Redis Streams has no nack (a record is redelivered only by XCLAIM after it idles)");
                }
                let backlog = match (a.backlog, c.amount) {
                    (Some(0), _) => return err("--backlog must be at least 1"),
                    (Some(b), Amount::Count(n)) if b < n => {
                        return err(format!(
                            "--backlog ({b}) must hold at least --count ({n}) records"
                        ))
                    }
                    (Some(b), _) => b,
                    (None, Amount::Count(n)) if c.warmup.is_zero() => n,
                    (None, Amount::Count(n)) => n.saturating_add(n / 4),
                    // A million records a second of the run, warm-up
                    // included: a fast machine drains it early, which ends
                    // the run (`drained`) with the window measured so far.
                    // (At most 50 million: about 6 GB of 100-byte records.)
                    (None, Amount::Duration(d)) => {
                        ((c.warmup + d).as_secs_f64() * 1_000_000.0).ceil().min(5e7) as u64
                    }
                };
                Ok(Some(Plan::Queue(c, a.clone(), backlog)))
            }
            Command::E2e(a) => {
                let c = a.common.validate("e2e")?;
                check_rate("--rate", a.rate)?;
                check_range("--producers", a.producers, 1, 10_000)?;
                check_range("--batch", a.batch, 1, MAX_BATCH)?;
                check_range("--inflight", a.inflight, 1, 100_000)?;
                if let Some(n) = a.consumers {
                    check_range("--consumers", n, 1, 10_000)?;
                }
                if a.per_poll == 0 || a.per_poll > 1000 {
                    return err("--per-poll must be 1 to 1000");
                }
                if c.record_size < STAMP_BYTES {
                    return err(format!(
                        "--record-size must be at least {STAMP_BYTES} for e2e (the send time is stamped into the payload)"
                    ));
                }
                if c.target != TargetKind::Felix && a.ack != AckChoice::Durable {
                    return err("--ack applies to Felix only");
                }
                if c.target != TargetKind::Felix && a.via == Via::Read {
                    return err(
                        "--via read is implemented for Felix only; peers use their queue consumer",
                    );
                }
                if a.via == Via::Read && a.consumers.is_some_and(|n| n > c.shards as usize) {
                    return err(
                        "--via read needs --consumers at most --shards (readers split the shards; two on one shard would each see every record)",
                    );
                }
                Ok(Some(Plan::E2e(c, a.clone())))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(args: &[&str]) -> Result<Plan, String> {
        let mut v = vec!["felix-bench"];
        v.extend_from_slice(args);
        let cli = Cli::try_parse_from(v).map_err(|e| e.to_string())?;
        cli.validate().map(|p| p.expect("a workload"))
    }

    #[test]
    fn defaults_are_valid_for_every_workload() {
        for w in ["publish", "read", "queue", "e2e"] {
            let p = plan(&[w]).unwrap_or_else(|e| panic!("{w}: {e}"));
            assert_eq!(p.workload(), w);
            assert_eq!(p.common().amount, Amount::Duration(Duration::from_secs(10)));
            assert_eq!(p.common().target, TargetKind::Felix);
        }
    }

    #[test]
    fn count_and_duration_exclude_each_other() {
        assert!(plan(&["publish", "--count", "10", "--duration", "1"]).is_err());
        let p = plan(&["publish", "--count", "10"]).unwrap();
        assert_eq!(p.common().amount, Amount::Count(10));
        assert!(plan(&["publish", "--count", "0"]).is_err());
        assert!(plan(&["publish", "--duration", "0.01"]).is_err());
        assert!(plan(&["publish", "--duration", "-1"]).is_err());
    }

    #[test]
    fn bad_values_are_refused_with_the_flag_named() {
        let cases: &[(&[&str], &str)] = &[
            (&["publish", "--shards", "0"], "--shards"),
            (&["publish", "--batch", "0"], "--batch"),
            (&["publish", "--producers", "0"], "--producers"),
            (&["publish", "--inflight", "0"], "--inflight"),
            (&["publish", "--rate", "0"], "--rate"),
            (&["publish", "--record-size", "0"], "--record-size"),
            (&["publish", "--headers", "1025"], "--headers"),
            (
                &["read", "--target", "redis", "--headers", "1"],
                "--headers",
            ),
            (&["publish", "--broker-cores", "zero"], "--broker-cores"),
            (&["publish", "--broker-cores", "0"], "--broker-cores"),
            (&["publish", "--broker", "nohostport"], "--broker"),
            (&["publish", "--broker", "a:1,nohostport"], "--broker"),
            (
                &["publish", "--target", "redis", "--broker", "a:1,b:2"],
                "brokers",
            ),
            (&["publish", "--stream", "a/b"], "--stream"),
            (&["publish", "--warmup=-2"], "--warmup"),
            (&["publish", "--client-threads", "0"], "--client-threads"),
            (
                &["publish", "--target", "redis", "--ack", "queued"],
                "--ack",
            ),
            (&["publish", "--peer-mode", "durable"], "--peer-mode"),
            (
                &["publish", "--broker-metrics", "127.0.0.1:9100"],
                "--broker-metrics",
            ),
            (
                &["publish", "--broker", "a:1", "--broker-metrics", "nope"],
                "--broker-metrics",
            ),
            (
                &[
                    "queue",
                    "--broker",
                    "a:1",
                    "--broker-metrics",
                    "127.0.0.1:1",
                ],
                "--broker-metrics",
            ),
            (&["read", "--prefill", "0"], "--prefill"),
            (&["read", "--max-records", "0"], "--max-records"),
            (&["queue", "--per-poll", "0"], "--per-poll"),
            (&["queue", "--per-poll", "1001"], "--per-poll"),
            (&["queue", "--nack-rate", "1.0"], "--nack-rate"),
            (&["queue", "--rate", "0"], "--rate"),
            (
                &["queue", "--target", "redis", "--nack-rate", "0.1"],
                "--nack-rate",
            ),
            (&["queue", "--count", "100", "--backlog", "10"], "--backlog"),
            (&["e2e", "--record-size", "8"], "--record-size"),
            (&["e2e", "--rate=-5"], "--rate"),
            (&["e2e", "--target", "nats", "--via", "read"], "--via"),
            (&["e2e", "--rate", "1e-18"], "--rate"),
            (
                &["e2e", "--via", "read", "--shards", "1", "--consumers", "2"],
                "--consumers",
            ),
        ];
        for (args, flag) in cases {
            let e = plan(args).expect_err(&format!("{args:?} should be refused"));
            assert!(
                e.contains(flag),
                "{args:?}: message {e:?} should name {flag}"
            );
        }
    }

    #[test]
    fn unknown_flags_and_targets_are_refused_by_the_parser() {
        assert!(plan(&["publish", "--no-such-flag"]).is_err());
        assert!(plan(&["publish", "--target", "kafka"]).is_err());
        assert!(plan(&["publish", "--ack", "sometimes"]).is_err());
        assert!(plan(&["frobnicate"]).is_err());
    }

    #[test]
    fn queue_backlog_covers_count_and_warmup() {
        let Plan::Queue(_, _, b) = plan(&["queue", "--count", "1000"]).unwrap() else {
            panic!()
        };
        assert_eq!(b, 1250);
        let Plan::Queue(_, _, b) = plan(&["queue", "--count", "1000", "--warmup", "0"]).unwrap()
        else {
            panic!()
        };
        assert_eq!(b, 1000);
        let Plan::Queue(_, _, b) = plan(&["queue"]).unwrap() else {
            panic!()
        };
        assert_eq!(b, 12_000_000, "10 s and 2 s of warm-up");
        let Plan::Queue(_, _, b) = plan(&["queue", "--duration", "3", "--warmup", "1"]).unwrap()
        else {
            panic!()
        };
        assert_eq!(b, 4_000_000);
    }

    #[test]
    fn broker_cores_accepts_counts_and_lists() {
        assert_eq!(
            plan(&["publish", "--broker-cores", "2"])
                .unwrap()
                .common()
                .broker_core_count,
            2
        );
        assert_eq!(
            plan(&["publish", "--broker-cores", "0,1"])
                .unwrap()
                .common()
                .broker_core_count,
            2
        );
    }

    #[test]
    fn stream_names_split_and_flatten() {
        let p = plan(&["publish", "--stream", "t1/ns/s-1"]).unwrap();
        assert_eq!(p.common().stream.to_string(), "t1/ns/s-1");
        assert_eq!(p.common().stream.flat(), "t1_ns_s_1");
    }

    #[test]
    fn help_explains_every_flag() {
        use clap::CommandFactory;
        let mut cmd = Cli::command();
        cmd.build();
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            for arg in sub.get_arguments() {
                let id = arg.get_id().as_str();
                if id == "help" || id == "version" {
                    continue;
                }
                assert!(
                    arg.get_help().is_some() || arg.get_long_help().is_some(),
                    "{} --{id} has no help text",
                    sub.get_name()
                );
            }
        }
    }
}
