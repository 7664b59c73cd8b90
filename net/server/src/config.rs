//! Broker configuration: `felix.toml`, overridden by `FELIX_*` environment
//! variables, overridden by command-line flags. Every setting remembers where
//! its value came from, so `felix serve --print-config` can say.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use felix_engine::catalog;
use felix_replication::handshake::PeerKey;

/// Where a setting's value came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Default,
    File(PathBuf),
    Env(&'static str),
    Flag(&'static str),
    /// Raised to follow another setting (`was`: where the lower value came
    /// from).
    Raised {
        was: Box<Source>,
        to: &'static str,
    },
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => write!(f, "default"),
            Source::File(p) => write!(f, "file {}", p.display()),
            Source::Env(v) => write!(f, "env {v}"),
            Source::Flag(v) => write!(f, "flag {v}"),
            Source::Raised { was, to } => write!(f, "{was}, raised to {to}"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Str,
    U64,
    Bool,
}

/// One known setting: `section.name`, its environment variable, its default.
struct Setting {
    section: &'static str,
    name: &'static str,
    env: Option<&'static str>,
    kind: Kind,
    default: &'static str,
    help: &'static str,
}

const SETTINGS: &[Setting] = &[
    Setting { section: "server", name: "listen", env: Some("FELIX_LISTEN"), kind: Kind::Str, default: "127.0.0.1:7400", help: "address every core listens on (SO_REUSEPORT)" },
    Setting { section: "server", name: "cores", env: Some("FELIX_CORES"), kind: Kind::Str, default: "1", help: "executors: a count (first N CPUs) or a CPU list like \"0,1\" or \"0-7\"; the default leaves the rest of the machine to clients and tests" },
    Setting { section: "server", name: "max_connections", env: Some("FELIX_MAX_CONNECTIONS"), kind: Kind::U64, default: "10000", help: "connections accepted at once, whole broker" },
    Setting { section: "server", name: "idle_timeout_ms", env: Some("FELIX_IDLE_TIMEOUT_MS"), kind: Kind::U64, default: "600000", help: "close a connection with no request in flight after this long without a frame" },
    Setting { section: "server", name: "write_timeout_ms", env: Some("FELIX_WRITE_TIMEOUT_MS"), kind: Kind::U64, default: "60000", help: "close a connection whose client takes less than 64 KiB of its waiting answers in this long (what the answers held is freed), or has not finished a frame this long after it began" },
    Setting { section: "server", name: "max_frame_bytes", env: Some("FELIX_MAX_FRAME_BYTES"), kind: Kind::U64, default: "16777216", help: "largest frame accepted (at least 4096); larger ones are refused with too_large. Also bounds a whole dead-letter list answer (larger lists must be paged)" },
    Setting { section: "server", name: "max_requests_per_connection", env: None, kind: Kind::U64, default: "1024", help: "requests one connection may have in flight; the broker stops reading it until some finish" },
    Setting { section: "server", name: "max_request_bytes_per_connection", env: None, kind: Kind::U64, default: "67108864", help: "bytes of requests one connection may have in flight (read, not yet answered: their frames and what decoding them built); the broker stops reading it until some finish" },
    Setting { section: "server", name: "max_pending_response_bytes", env: None, kind: Kind::U64, default: "67108864", help: "unsent response bytes per connection (reads, polls and lists count what they may answer while they run) before the broker stops reading it" },
    Setting { section: "server", name: "max_buffered_bytes_per_core", env: Some("FELIX_MAX_BUFFERED_BYTES_PER_CORE"), kind: Kind::U64, default: "1073741824", help: "request and answer bytes all connections of one core may hold together (requests read and not yet answered, 4 KiB a request in flight, frames arriving at their declared size, room reserved by reads and polls, answers not yet sent); at the budget the core stops reading connections that already hold something, and frames begin only while there is room for them, until some is freed" },
    Setting { section: "server", name: "metrics_listen", env: Some("FELIX_METRICS_LISTEN"), kind: Kind::Str, default: "127.0.0.1:7401", help: "Prometheus text exposition over HTTP; empty disables" },
    Setting { section: "server", name: "metrics_max_groups", env: None, kind: Kind::U64, default: "10000", help: "most (stream, shard, group) triples a scrape reports per-group gauges for (lag, in flight, oldest claim...), in name order; the rest are counted in felix_group_metrics_omitted; 0 reports none" },
    Setting { section: "server", name: "shutdown_grace_ms", env: None, kind: Kind::U64, default: "10000", help: "on SIGTERM/SIGINT, how long in-flight requests may take to finish" },
    Setting { section: "server", name: "log", env: Some("RUST_LOG"), kind: Kind::Str, default: "info", help: "log filter (tracing EnvFilter syntax)" },
    Setting { section: "storage", name: "data_dir", env: Some("FELIX_DURABLE_STORAGE_DIR"), kind: Kind::Str, default: "./felix-data", help: "durable storage directory; empty runs in memory (nothing survives a restart, no consumer groups)" },
    Setting { section: "storage", name: "ack_on_commit", env: Some("FELIX_ACK_ON_COMMIT"), kind: Kind::Bool, default: "true", help: "acknowledge publishes once durable (false: once queued)" },
    Setting { section: "storage", name: "segment_bytes", env: None, kind: Kind::U64, default: "134217728", help: "a segment file rolls at this size (at least 4096)" },
    Setting { section: "storage", name: "retention_bytes", env: None, kind: Kind::U64, default: "0", help: "default per-shard size retention for new streams (0 = keep all)" },
    Setting { section: "storage", name: "retention_ms", env: None, kind: Kind::U64, default: "0", help: "default age retention for new streams (0 = keep all)" },
    Setting { section: "storage", name: "io_queue_depth", env: Some("FELIX_IO_QUEUE_DEPTH"), kind: Kind::U64, default: "8", help: "O_DIRECT I/Os (writes, reads, fdatasyncs) in flight per core, 1 to 1024; also the writes one flush issues at once" },
    Setting { section: "storage", name: "write_chunk_bytes", env: None, kind: Kind::U64, default: "1048576", help: "size of each write of a flush (multiple of 4096; a batch larger than this is written whole)" },
    Setting { section: "storage", name: "preallocate_bytes", env: Some("FELIX_PREALLOCATE_BYTES"), kind: Kind::U64, default: "8388608", help: "reserve each shard's active segment this far ahead of its writes (fallocate), so flushes write inside the file instead of growing it (cheaper fdatasync, no kernel worker hop), and let small flushes (<= 64 KiB) write zeros ahead of their data inside it so later flushes overwrite written blocks; 0 = off. A segment's reservation starts at 256 KiB and doubles up to this step, so it costs a barely written shard little and a busy one up to this much disk until the segment is sealed or the shard closed cleanly" },
    Setting { section: "storage", name: "read_cache_bytes", env: None, kind: Kind::U64, default: "8388608", help: "recent bytes per shard served from memory" },
    Setting { section: "storage", name: "read_cache_bytes_per_core", env: Some("FELIX_READ_CACHE_BYTES_PER_CORE"), kind: Kind::U64, default: "1073741824", help: "memory one core keeps for reads, shared evenly by its shards: each keeps the smaller of read_cache_bytes and its share (a quarter of a share of 1 MiB or more goes to 256 KiB chunks of cold reads, at most eight)" },
    Setting { section: "storage", name: "max_queued_bytes", env: None, kind: Kind::U64, default: "67108864", help: "publishes wait while a shard has this much unflushed" },
    Setting { section: "storage", name: "min_free_bytes", env: Some("FELIX_MIN_FREE_BYTES"), kind: Kind::U64, default: "0", help: "publishes are refused (unavailable) while the data disk has less free than this, and served again once space returns; 0 = the smaller of 256 MiB and 5% of the disk" },
    Setting { section: "storage", name: "verify_on_open", env: Some("FELIX_VERIFY_ON_OPEN"), kind: Kind::Bool, default: "false", help: "at start-up, read every segment of every shard and check every batch's checksum, refusing a shard with damage anywhere (false: a sealed segment's summary stands for it, start-up reads each shard's newest segment, and damage in other sealed segments is found by the read that meets it); start-up then reads all the data the broker retains" },
    Setting { section: "storage", name: "retention_check_ms", env: None, kind: Kind::U64, default: "60000", help: "how often retention runs" },
    Setting { section: "groups", name: "visibility_timeout_ms", env: Some("FELIX_GROUP_VISIBILITY_TIMEOUT_MS"), kind: Kind::U64, default: "30000", help: "how long a claim stands before the record is owed again" },
    Setting { section: "groups", name: "max_attempts", env: Some("FELIX_GROUP_MAX_ATTEMPTS"), kind: Kind::U64, default: "5", help: "deliveries before a record is dead-lettered" },
    Setting { section: "groups", name: "max_wait_ms", env: Some("FELIX_GROUP_MAX_WAIT_MS"), kind: Kind::U64, default: "30000", help: "cap on how long a poll may ask the broker to wait" },
    Setting { section: "groups", name: "max_in_flight", env: Some("FELIX_GROUP_MAX_IN_FLIGHT"), kind: Kind::U64, default: "10000", help: "records one group may have handed out and unsettled on a shard" },
    Setting { section: "groups", name: "max_visibility_ms", env: Some("FELIX_GROUP_MAX_VISIBILITY_MS"), kind: Kind::U64, default: "43200000", help: "cap on a poll's visibility, an extension and a nack delay (never below the visibility timeout)" },
    Setting { section: "groups", name: "max_groups_per_shard", env: None, kind: Kind::U64, default: "10000", help: "consumer groups one shard keeps; a poll or group_create that would add one more is refused with too_large (delete unused groups)" },
    Setting { section: "groups", name: "max_claims_per_core", env: None, kind: Kind::U64, default: "10000000", help: "claims and delayed nacks all groups of one core's shards may hold together (about 40 - 60 bytes of memory each); at it, polls hand out only what their member reclaims and otherwise answer empty, counted in felix_group_polls_capped_total, until acks, nacks or lapses free room" },
    Setting { section: "groups", name: "idle_ms", env: None, kind: Kind::U64, default: "600000", help: "idle groups drop their memory state after this (or twice the visibility timeout)" },
    Setting { section: "security", name: "tokens_file", env: Some("FELIX_TOKENS_FILE"), kind: Kind::Str, default: "", help: "tokens the broker accepts, one `PRINCIPAL SHA256-HEX` line each (the hex of `printf %s TOKEN | sha256sum`; # starts a comment); a connection must then present one in HELLO and acts as its principal. Empty: no authentication, every connection is the anonymous principal and a HELLO carrying a token is refused. Read at start and again on SIGHUP" },
    Setting { section: "security", name: "acl_file", env: Some("FELIX_ACL_FILE"), kind: Kind::Str, default: "", help: "permissions, one `PRINCIPAL PERMISSION RESOURCE` line each (permissions stream.publish, stream.subscribe, stream.manage, group.consume, group.manage or *; resources TENANT/NAMESPACE/STREAM or group:TENANT/NAMESPACE/STREAM/GROUP, any part *, or * alone; principal * is everyone); nothing is allowed that a line does not grant. Empty: every principal may do everything. Read at start and again on SIGHUP" },
    Setting { section: "cluster", name: "node_id", env: Some("FELIX_NODE_ID"), kind: Kind::U64, default: "0", help: "this broker's id among cluster.nodes; 0 = a single broker, shards not replicated" },
    Setting { section: "cluster", name: "nodes", env: Some("FELIX_CLUSTER_NODES"), kind: Kind::Str, default: "", help: "every broker of the cluster, this one included, as ID=CLIENT_ADDR/REPLICATION_ADDR separated by commas (e.g. \"1=10.0.0.1:7400/10.0.0.1:7500,2=...\"); core i of each broker replicates on REPLICATION_ADDR's port + i, so every broker runs the same number of cores. Every shard is replicated on every node (at least three for a failure to be survived); needs storage.data_dir" },
    Setting { section: "cluster", name: "secret_file", env: Some("FELIX_CLUSTER_SECRET_FILE"), kind: Kind::Str, default: "", help: "a file holding the cluster's shared secret (at least 16 bytes; one trailing newline is not part of it), the same on every broker: a broker's replication connection is taken only once it proved it knows the secret (HMAC-SHA256 over a fresh challenge). Empty: brokers are not authenticated, so any process that can reach the replication ports could act as one. Either way replication traffic is not encrypted: keep it on a private network. Read at start" },
    Setting { section: "cluster", name: "tick_ms", env: None, kind: Kind::U64, default: "50", help: "replication tick: a leader heartbeats every 2 ticks, and a follower that hears nothing for 10 to 20 ticks starts an election (shorter fails over sooner, but a broker short of CPU can then miss heartbeats under load and elect needlessly)" },
    Setting { section: "cluster", name: "compact_entries", env: Some("FELIX_CLUSTER_COMPACT_ENTRIES"), kind: Kind::U64, default: "4096", help: "a shard's replica drops the entries of its Raft log that every replica holds and it has applied (and made durable in the shard's log) once there are this many; 0 = never (the log then grows for ever). While a replica is down the others keep what it has not got" },
    Setting { section: "cluster", name: "journal_segment_bytes", env: Some("FELIX_CLUSTER_JOURNAL_SEGMENT_BYTES"), kind: Kind::U64, default: "67108864", help: "size past which a replica's journal starts a new segment file; compaction removes whole segments" },
    Setting { section: "limits", name: "max_records_per_read", env: None, kind: Kind::U64, default: "1000", help: "records one read or poll returns at most (1 to 1000: it can only be lowered)" },
    Setting { section: "limits", name: "max_bytes_per_read", env: None, kind: Kind::U64, default: "4194304", help: "bytes of records after which a read (payloads, keys, header names and values) or poll (the records as answered) stops, each also counting 6 bytes a header for the lengths the broker holds with it; an answer also stops within max_frame_bytes (1 to 4194304: it can only be lowered)" },
    Setting { section: "limits", name: "max_records_per_publish", env: None, kind: Kind::U64, default: "100000", help: "records in one publish request (1 to 100000, the longest list a request carries: it can only be lowered)" },
    Setting { section: "limits", name: "max_timestamp_ahead_ms", env: None, kind: Kind::U64, default: "3600000", help: "a published record's timestamp may be at most this far ahead of the broker's clock (retention by age trusts timestamps); 0 = no limit" },
    Setting { section: "limits", name: "max_shards", env: None, kind: Kind::U64, default: "4096", help: "shards per stream (at most 65536)" },
    Setting { section: "limits", name: "max_total_shards", env: None, kind: Kind::U64, default: "16384", help: "shards of all streams together (each keeps files open and its own caches); a create past it is refused with too_large" },
];

/// A resolved value and where it came from.
#[derive(Clone, Debug)]
struct Resolved {
    value: String,
    source: Source,
}

/// Settings a user passes on the command line.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub data_dir: Option<PathBuf>,
    pub listen: Option<String>,
    pub cores: Option<String>,
    pub node_id: Option<u64>,
    pub peers: Option<String>,
}

/// One broker of a cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterNode {
    pub id: u64,
    /// Where clients reach it (`server.listen` on that broker).
    pub client: String,
    /// Its replication address for core 0 (core i: the port + i).
    pub replication: std::net::SocketAddr,
}

/// The cluster this broker is part of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterConfig {
    pub node_id: u64,
    /// Every node, this one included, by id.
    pub nodes: Vec<ClusterNode>,
    pub tick_ms: u64,
    /// Compact a replica's log once this many entries can go (0: never).
    pub compact_entries: u64,
    pub journal_segment_bytes: u64,
    /// `cluster.secret_file`, and the key derived from it (the key of no
    /// secret without one).
    pub secret_file: Option<PathBuf>,
    pub peer_key: PeerKey,
}

impl ClusterConfig {
    pub fn node(&self, id: u64) -> Option<&ClusterNode> {
        self.nodes.iter().find(|n| n.id == id)
    }

    pub fn voters(&self) -> Vec<u64> {
        self.nodes.iter().map(|n| n.id).collect()
    }
}

/// Shortest cluster secret taken.
pub const MIN_SECRET_BYTES: usize = 16;

/// The key of the secret in `path`: its bytes without one trailing
/// newline, at least [`MIN_SECRET_BYTES`] of them.
pub fn read_secret(path: &Path) -> Result<PeerKey, String> {
    let mut bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if bytes.ends_with(b"\n") {
        bytes.pop();
        if bytes.ends_with(b"\r") {
            bytes.pop();
        }
    }
    if bytes.len() < MIN_SECRET_BYTES {
        return Err(format!(
            "{}: the secret is {} bytes, and at least {MIN_SECRET_BYTES} are needed \
             (make one with `head -c 32 /dev/urandom | base64 > FILE`)",
            path.display(),
            bytes.len()
        ));
    }
    Ok(PeerKey::from_secret(&bytes))
}

/// Parse `cluster.nodes`: `ID=CLIENT_ADDR/REPLICATION_ADDR,...`.
pub fn parse_nodes(s: &str) -> Result<Vec<ClusterNode>, String> {
    let mut nodes: Vec<ClusterNode> = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let bad = |why: &str| format!("{item:?}: {why} (expected ID=CLIENT_ADDR/REPLICATION_ADDR)");
        let (id, addrs) = item.split_once('=').ok_or_else(|| bad("no `=`"))?;
        let id: u64 = id
            .trim()
            .parse()
            .map_err(|_| bad("the id is not a whole number"))?;
        if id == 0 || id >= 1 << 62 {
            return Err(bad("ids run from 1 to 2^62 - 1"));
        }
        let (client, repl) = addrs.split_once('/').ok_or_else(|| bad("no `/`"))?;
        let client = client.trim();
        if client.is_empty() {
            return Err(bad("no client address"));
        }
        let replication: std::net::SocketAddr = repl
            .trim()
            .parse()
            .map_err(|_| bad("the replication address is not IP:PORT"))?;
        if nodes.iter().any(|n| n.id == id) {
            return Err(bad("the id is listed twice"));
        }
        nodes.push(ClusterNode {
            id,
            client: client.to_string(),
            replication,
        });
    }
    nodes.sort_by_key(|n| n.id);
    Ok(nodes)
}

/// The effective configuration.
#[derive(Clone, Debug)]
pub struct Config {
    values: BTreeMap<(&'static str, &'static str), Resolved>,
    /// Settings adjusted to be consistent, to log at start-up.
    pub warnings: Vec<String>,
    pub listen: String,
    pub cores: String,
    pub max_connections: u64,
    pub idle_timeout_ms: u64,
    pub write_timeout_ms: u64,
    pub max_frame_bytes: u32,
    pub max_requests_per_connection: usize,
    pub max_request_bytes_per_connection: usize,
    pub max_pending_response_bytes: usize,
    pub max_buffered_bytes_per_core: usize,
    pub metrics_listen: Option<String>,
    pub metrics_max_groups: usize,
    pub shutdown_grace_ms: u64,
    pub log: String,
    pub data_dir: Option<PathBuf>,
    pub ack_on_commit: bool,
    pub segment_bytes: u64,
    pub retention_bytes: Option<u64>,
    pub retention_ms: Option<u64>,
    pub io_queue_depth: usize,
    pub write_chunk_bytes: usize,
    /// 0 = off.
    pub preallocate_bytes: u64,
    pub read_cache_bytes: usize,
    pub read_cache_bytes_per_core: usize,
    pub max_queued_bytes: usize,
    /// Free bytes the data disk keeps for the broker; 0 = automatic.
    pub min_free_bytes: u64,
    /// Scan every segment at start-up (see `LogConfig::verify_on_open`).
    pub verify_on_open: bool,
    pub retention_check_ms: u64,
    pub visibility_timeout_ms: u64,
    pub max_attempts: u32,
    pub max_wait_ms: u64,
    pub max_in_flight: u32,
    pub max_visibility_ms: u64,
    pub group_idle_ms: u64,
    pub max_groups_per_shard: usize,
    pub max_claims_per_core: u64,
    pub max_records_per_read: u32,
    pub max_bytes_per_read: u32,
    pub max_records_per_publish: u32,
    /// How far ahead of the broker's clock a record's timestamp may be
    /// (`None`: no limit).
    pub max_timestamp_ahead_ms: Option<u64>,
    pub max_shards: u32,
    pub max_total_shards: u64,
    /// `security.tokens_file`; `None`: no authentication.
    pub tokens_file: Option<PathBuf>,
    /// `security.acl_file`; `None`: every principal may do everything.
    pub acl_file: Option<PathBuf>,
    /// `cluster.*`; `None`: a single broker.
    pub cluster: Option<ClusterConfig>,
}

/// A configuration that cannot be used, and why.
#[derive(Debug, thiserror::Error)]
#[error("configuration: {0}")]
pub struct ConfigError(pub String);

/// Most O_DIRECT I/Os a core keeps in flight: past a few hundred a disk
/// gains nothing, and each holds its buffer.
const MAX_IO_QUEUE_DEPTH: u64 = 1024;

/// Refuse a setting above a hard limit rather than quietly use less than
/// `--print-config` shows.
fn at_most(n: u32, max: u32, name: &str) -> Result<u32, ConfigError> {
    if n > max {
        return Err(ConfigError(format!(
            "`{name}` is {n}; it can be at most {max}"
        )));
    }
    Ok(n)
}

fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// `FELIX_*` variables read by the `felix` CLI and the test tools rather
/// than by a broker: set in a broker's environment (brokers started by the
/// tests inherit theirs) they are not mistakes.
const OTHER_FELIX_VARS: &[&str] = &[
    "FELIX_BROKER",
    "FELIX_TOKEN",
    "FELIX_LOG",
    "FELIX_REQUIRE_CLIENTS",
    "FELIX_TEST_CONFIG",
    "FELIX_TEST_LOG",
    "FELIX_ADDR",
    "FELIX_TEST_BROKER",
    "FELIX_AUTH_ADDR",
    "FELIX_AUTH_TOKEN",
    "FELIX_AUTH_PRINCIPAL",
    "FELIX_SIM_SEED",
    "FELIX_SIM_CASES",
    "FELIX_SIM_STEPS",
    "FELIX_SIM_SCHEDULES",
    "FELIX_WIRE_SEED",
    "FELIX_JOURNAL_SEED",
    "FELIX_JOURNAL_ROUNDS",
    "FELIX_FORGE_SEED",
    "FELIX_FORGE_ROUNDS",
    "FELIX_FUZZ_SEED",
    "FELIX_CLUSTER_SOAK_ROUNDS",
    "FELIX_REPLICATE_DIR",
    "FELIX_WRITE_EXAMPLE",
];

/// Is `k` a variable some setting reads?
fn is_setting_var(k: &str) -> bool {
    SETTINGS.iter().any(|s| s.env == Some(k))
}

/// A warning for each `FELIX_*` variable in `env` that no setting reads (a
/// misspelt one would otherwise be ignored without a word), naming the
/// setting it looks meant for and that setting's variable, if it has one.
fn unknown_env(env: &BTreeMap<String, String>) -> Vec<String> {
    env.keys()
        .filter(|k| k.starts_with("FELIX_") && !OTHER_FELIX_VARS.contains(&k.as_str()))
        .filter(|k| !is_setting_var(k))
        .map(|k| {
            let name = k["FELIX_".len()..].to_ascii_lowercase();
            // `FELIX_DATA_DIR`, or with its section: `FELIX_STORAGE_DATA_DIR`.
            let meant = SETTINGS.iter().find(|s| {
                name == s.name
                    || name
                        .strip_prefix(s.section)
                        .and_then(|n| n.strip_prefix('_'))
                        == Some(s.name)
            });
            match meant {
                Some(s) => match s.env {
                    Some(var) => format!(
                        "{k} is ignored: no setting reads it; {}.{} is set with {var}",
                        s.section, s.name
                    ),
                    None => format!(
                        "{k} is ignored: {}.{} has no environment variable; set it in the \
                         configuration file",
                        s.section, s.name
                    ),
                },
                None => match nearest_var(k) {
                    Some(var) => {
                        format!("{k} is ignored: no setting reads it; did you mean {var}?")
                    }
                    None => format!(
                        "{k} is ignored: no setting reads it (`felix serve --print-config` \
                         lists the settings; felix.example.toml names their variables)"
                    ),
                },
            }
        })
        .collect()
}

/// The setting variable `k` looks like a slip of: within two edits of it,
/// or it with a word left off the end (`FELIX_ACL` for `FELIX_ACL_FILE`);
/// none when two are as near.
fn nearest_var(k: &str) -> Option<&'static str> {
    SETTINGS
        .iter()
        .filter_map(|s| s.env)
        .map(|var| {
            let cut = var
                .strip_prefix(k)
                .is_some_and(|rest| rest.starts_with('_'));
            (if cut { 0 } else { edit_distance(k, var) }, var)
        })
        .filter(|(d, _)| *d <= 2)
        .fold(
            None,
            |best: Option<(usize, Option<&str>)>, (d, var)| match best {
                Some((b, _)) if b < d => best,
                // Two as near: no one guess.
                Some((b, _)) if b == d => Some((b, None)),
                _ => Some((d, Some(var))),
            },
        )
        .and_then(|(_, var)| var)
}

/// Levenshtein distance between two ASCII-ish strings (by chars).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diag + usize::from(ca != *cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// Refuse an address a listener could not bind: it must be `IP:PORT` or
/// `HOST:PORT` that resolves.
fn check_address(r: &Resolved, what: &str, ipv4_only: bool) -> Result<(), ConfigError> {
    use std::net::ToSocketAddrs;
    match r.value.trim().to_socket_addrs().map(|mut a| a.next()) {
        Ok(Some(a)) if ipv4_only && !a.is_ipv4() => Err(ConfigError(format!(
            "{what} = {:?} (from {}) is the IPv6 address {a}; only IPv4 is supported for now",
            r.value, r.source
        ))),
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err(ConfigError(format!(
            "{what} = {:?} (from {}) resolves to no address",
            r.value, r.source
        ))),
        Err(e) => Err(ConfigError(format!(
            "{what} = {:?} (from {}) is not an address (IP:PORT, e.g. 127.0.0.1:7400): {e}",
            r.value, r.source
        ))),
    }
}

impl Config {
    /// Where setting `section.name` came from (`default`, `file PATH`,
    /// `env VAR`, `flag --F`).
    pub fn source_of(&self, section: &str, name: &str) -> String {
        self.values
            .iter()
            .find(|((s, n), _)| *s == section && *n == name)
            .map_or_else(|| "default".to_string(), |(_, r)| r.source.to_string())
    }

    /// Defaults, then the file (if any), then the environment, then flags.
    pub fn load(file: Option<&Path>, overrides: &Overrides) -> Result<Config, ConfigError> {
        // Only variables that are Unicode: one that is not cannot be a
        // setting (a `FELIX_*` one that is not is refused), and `vars()`
        // would panic on it.
        let mut env = BTreeMap::new();
        for (k, v) in std::env::vars_os() {
            let Some(k) = k.to_str() else { continue };
            match v.into_string() {
                Ok(v) => {
                    env.insert(k.to_string(), v);
                }
                Err(_) if is_setting_var(k) => {
                    return Err(ConfigError(format!(
                        "environment variable {k} is not valid UTF-8"
                    )));
                }
                Err(_) => {}
            }
        }
        Self::load_with_env(file, overrides, &env)
    }

    pub fn load_with_env(
        file: Option<&Path>,
        overrides: &Overrides,
        env: &BTreeMap<String, String>,
    ) -> Result<Config, ConfigError> {
        let mut values = BTreeMap::new();
        for s in SETTINGS {
            values.insert(
                (s.section, s.name),
                Resolved {
                    value: s.default.to_string(),
                    source: Source::Default,
                },
            );
        }
        if let Some(path) = file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| ConfigError(format!("cannot read {}: {e}", path.display())))?;
            let table: toml::Table = text
                .parse()
                .map_err(|e| ConfigError(format!("{}: {e}", path.display())))?;
            for (section, v) in table {
                let toml::Value::Table(inner) = v else {
                    return Err(ConfigError(format!(
                        "{}: `{section}` must be a [section]",
                        path.display()
                    )));
                };
                for (name, v) in inner {
                    let Some(s) = SETTINGS
                        .iter()
                        .find(|s| s.section == section && s.name == name)
                    else {
                        return Err(ConfigError(format!(
                            "{}: unknown setting `{section}.{name}`",
                            path.display()
                        )));
                    };
                    let value = match (&v, s.kind) {
                        (toml::Value::String(x), _) => x.clone(),
                        (toml::Value::Integer(i), Kind::U64 | Kind::Str) if *i >= 0 => {
                            i.to_string()
                        }
                        (toml::Value::Boolean(b), Kind::Bool) => b.to_string(),
                        // As the variables take them: 1 and 0.
                        (toml::Value::Integer(i @ (0 | 1)), Kind::Bool) => i.to_string(),
                        _ => {
                            let want = match s.kind {
                                Kind::Bool => "; a switch is true or false (or 1/0)",
                                Kind::U64 => "; a whole number",
                                Kind::Str => "; a string",
                            };
                            return Err(ConfigError(format!(
                                "{}: `{section}.{name}` has the wrong type ({v}{want})",
                                path.display()
                            )));
                        }
                    };
                    values.insert(
                        (s.section, s.name),
                        Resolved {
                            value,
                            source: Source::File(path.to_path_buf()),
                        },
                    );
                }
            }
        }
        for s in SETTINGS {
            if let Some(var) = s.env {
                if let Some(v) = env.get(var) {
                    values.insert(
                        (s.section, s.name),
                        Resolved {
                            value: v.clone(),
                            source: Source::Env(var),
                        },
                    );
                }
            }
        }
        if let Some(d) = &overrides.data_dir {
            values.insert(
                ("storage", "data_dir"),
                Resolved {
                    value: d.display().to_string(),
                    source: Source::Flag("--data-dir"),
                },
            );
        }
        if let Some(l) = &overrides.listen {
            values.insert(
                ("server", "listen"),
                Resolved {
                    value: l.clone(),
                    source: Source::Flag("--listen"),
                },
            );
        }
        if let Some(c) = &overrides.cores {
            values.insert(
                ("server", "cores"),
                Resolved {
                    value: c.clone(),
                    source: Source::Flag("--cores"),
                },
            );
        }
        if let Some(id) = overrides.node_id {
            values.insert(
                ("cluster", "node_id"),
                Resolved {
                    value: id.to_string(),
                    source: Source::Flag("--node-id"),
                },
            );
        }
        if let Some(p) = &overrides.peers {
            values.insert(
                ("cluster", "nodes"),
                Resolved {
                    value: p.clone(),
                    source: Source::Flag("--peers"),
                },
            );
        }
        let mut cfg = Self::build(values)?;
        cfg.warnings.extend(unknown_env(env));
        Ok(cfg)
    }

    fn build(
        values: BTreeMap<(&'static str, &'static str), Resolved>,
    ) -> Result<Config, ConfigError> {
        let get = |sec: &'static str, name: &'static str| -> &Resolved { &values[&(sec, name)] };
        let num = |sec: &'static str, name: &'static str| -> Result<u64, ConfigError> {
            let r = get(sec, name);
            r.value.trim().parse::<u64>().map_err(|_| {
                ConfigError(format!(
                    "{sec}.{name} = {:?} (from {}) is not a whole number",
                    r.value, r.source
                ))
            })
        };
        let boolean = |sec: &'static str, name: &'static str| -> Result<bool, ConfigError> {
            let r = get(sec, name);
            parse_bool(&r.value).ok_or_else(|| {
                ConfigError(format!(
                    "{sec}.{name} = {:?} (from {}) is not true or false (or 1/0, yes/no, on/off)",
                    r.value, r.source
                ))
            })
        };
        // `what` names a setting as `section.name`: where its value came
        // from, for an error about it.
        let from = |what: &str| -> String {
            values
                .iter()
                .find(|((sec, name), _)| {
                    what.strip_prefix(sec).and_then(|r| r.strip_prefix('.')) == Some(name)
                })
                .map(|(_, r)| format!(" (from {})", r.source))
                .unwrap_or_default()
        };
        let nonzero = |v: u64, what: &str| -> Result<u64, ConfigError> {
            if v == 0 {
                Err(ConfigError(format!(
                    "{what}{} must be at least 1",
                    from(what)
                )))
            } else {
                Ok(v)
            }
        };
        let opt = |v: u64| if v == 0 { None } else { Some(v) };
        let u32_of = |v: u64, what: &str| -> Result<u32, ConfigError> {
            u32::try_from(v)
                .map_err(|_| ConfigError(format!("{what} = {v}{} is too large", from(what))))
        };
        let data_dir = get("storage", "data_dir").value.trim().to_string();
        let tokens_file = get("security", "tokens_file").value.trim().to_string();
        let acl_file = get("security", "acl_file").value.trim().to_string();
        let metrics = get("server", "metrics_listen").value.trim().to_string();
        check_address(get("server", "listen"), "server.listen", true)?;
        if !metrics.is_empty() {
            check_address(
                get("server", "metrics_listen"),
                "server.metrics_listen",
                false,
            )?;
            let listen = get("server", "listen").value.trim();
            if let (Ok(a), Ok(b)) = (
                listen.parse::<std::net::SocketAddr>(),
                metrics.parse::<std::net::SocketAddr>(),
            ) {
                let overlap =
                    a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified();
                if a.port() == b.port() && a.port() != 0 && overlap {
                    return Err(ConfigError(format!(
                        "server.metrics_listen = {metrics:?} (from {}) is the port server.listen = \
                         {listen:?} (from {}) takes: give the metrics another port, or leave \
                         server.metrics_listen empty for none",
                        get("server", "metrics_listen").source,
                        get("server", "listen").source
                    )));
                }
            }
        }
        {
            let r = get("server", "log");
            if let Err(e) = tracing_subscriber::EnvFilter::try_new(&r.value) {
                return Err(ConfigError(format!(
                    "server.log = {:?} (from {}) is not a log filter: {e} \
                     (examples: `info`, `warn,felix_server=debug`)",
                    r.value, r.source
                )));
            }
        }
        let visibility_timeout_ms = nonzero(
            num("groups", "visibility_timeout_ms")?,
            "groups.visibility_timeout_ms",
        )?;
        let mut max_visibility_ms = num("groups", "max_visibility_ms")?;
        let mut raised_cap = None;
        // Checked before it can raise the cap, so the error names it.
        if visibility_timeout_ms > felix_engine::group::MAX_VISIBILITY_LIMIT_MS {
            return Err(ConfigError(format!(
                "`groups.visibility_timeout_ms` is {visibility_timeout_ms}; it can be at most {}",
                felix_engine::group::MAX_VISIBILITY_LIMIT_MS
            )));
        }
        let mut warnings = Vec::new();
        if max_visibility_ms < visibility_timeout_ms {
            // The cap is never below the timeout: a longer timeout raises
            // the cap with it (saying so when the cap was set explicitly).
            let was = get("groups", "max_visibility_ms").source.clone();
            if was != Source::Default {
                warnings.push(format!(
                    "groups.max_visibility_ms ({max_visibility_ms}, {was}) is below \
                     groups.visibility_timeout_ms ({visibility_timeout_ms}); the cap is \
                     never below the timeout, so it is raised to {visibility_timeout_ms}"
                ));
            }
            max_visibility_ms = visibility_timeout_ms;
            raised_cap = Some(was);
        }
        let group_limit = |v: u64, max: u64, what: &str| -> Result<u64, ConfigError> {
            if v > max {
                return Err(ConfigError(format!(
                    "`{what}` is {v}; it can be at most {max}"
                )));
            }
            Ok(v)
        };
        group_limit(
            max_visibility_ms,
            felix_engine::group::MAX_VISIBILITY_LIMIT_MS,
            "groups.max_visibility_ms",
        )?;
        let write_chunk_bytes = num("storage", "write_chunk_bytes")?;
        if write_chunk_bytes == 0 || write_chunk_bytes % 4096 != 0 {
            return Err(ConfigError(format!(
                "storage.write_chunk_bytes{} must be a positive multiple of 4096",
                from("storage.write_chunk_bytes")
            )));
        }
        // Below this a frame cannot carry one dead letter with its reason,
        // nor a useful batch: refuse the setting rather than a broker that
        // answers too_large to ordinary requests.
        const MIN_FRAME: u64 = 4096;
        if num("server", "max_frame_bytes")? < MIN_FRAME {
            return Err(ConfigError(format!(
                "server.max_frame_bytes{} must be at least {MIN_FRAME}",
                from("server.max_frame_bytes")
            )));
        }
        // A segment is a file (and an open descriptor) of its own: one of a
        // few bytes would hold a batch or two, and a shard would run out of
        // descriptors long before it held much.
        const MIN_SEGMENT: u64 = 4096;
        if num("storage", "segment_bytes")? < MIN_SEGMENT {
            return Err(ConfigError(format!(
                "storage.segment_bytes{} must be at least {MIN_SEGMENT} (each segment is a file \
                 the broker keeps open; the default is 128 MiB)",
                from("storage.segment_bytes")
            )));
        }
        // A budget under one frame would let a connection holding anything
        // run no request that carries a frame's worth.
        if num("server", "max_buffered_bytes_per_core")? < num("server", "max_frame_bytes")? {
            return Err(ConfigError(
                "server.max_buffered_bytes_per_core must be at least server.max_frame_bytes".into(),
            ));
        }
        let node_id = num("cluster", "node_id")?;
        let nodes = parse_nodes(&get("cluster", "nodes").value)
            .map_err(|e| ConfigError(format!("cluster.nodes: {e}")))?;
        let cluster = match (node_id, nodes.is_empty()) {
            (0, true) => None,
            (0, false) => {
                return Err(ConfigError(
                    "cluster.nodes is set but cluster.node_id is not: which node is this?".into(),
                ))
            }
            (id, true) => {
                return Err(ConfigError(format!(
                    "cluster.node_id is {id} but cluster.nodes is empty"
                )))
            }
            (id, false) => {
                if !nodes.iter().any(|n| n.id == id) {
                    return Err(ConfigError(format!(
                        "cluster.node_id {id} is not one of cluster.nodes"
                    )));
                }
                if data_dir.is_empty() {
                    return Err(ConfigError(
                        "a cluster needs storage.data_dir: a replica must remember its votes and entries"
                            .into(),
                    ));
                }
                let secret_file = get("cluster", "secret_file").value.trim().to_string();
                let secret_file = (!secret_file.is_empty()).then(|| PathBuf::from(secret_file));
                let peer_key = match &secret_file {
                    Some(f) => {
                        use std::os::unix::fs::PermissionsExt;
                        let key = read_secret(f)
                            .map_err(|e| ConfigError(format!("cluster.secret_file: {e}")))?;
                        let mode = std::fs::metadata(f).map_or(0, |m| m.permissions().mode());
                        if mode & 0o077 != 0 {
                            warnings.push(format!(
                                "cluster.secret_file {} may be read by other users (mode {:o}): \
                                 `chmod 600` it",
                                f.display(),
                                mode & 0o777
                            ));
                        }
                        key
                    }
                    None => {
                        warnings.push(
                            "cluster.secret_file is not set: brokers are not authenticated, \
                             so any process that can reach the replication ports could act as \
                             one; set the same secret on every broker"
                                .into(),
                        );
                        PeerKey::open()
                    }
                };
                Some(ClusterConfig {
                    secret_file,
                    peer_key,
                    node_id: id,
                    nodes,
                    tick_ms: nonzero(num("cluster", "tick_ms")?, "cluster.tick_ms")?,
                    compact_entries: num("cluster", "compact_entries")?,
                    journal_segment_bytes: nonzero(
                        num("cluster", "journal_segment_bytes")?,
                        "cluster.journal_segment_bytes",
                    )?,
                })
            }
        };
        let cfg = Config {
            cluster,
            listen: get("server", "listen").value.trim().to_string(),
            cores: get("server", "cores").value.clone(),
            max_connections: nonzero(num("server", "max_connections")?, "server.max_connections")?,
            idle_timeout_ms: nonzero(num("server", "idle_timeout_ms")?, "server.idle_timeout_ms")?,
            write_timeout_ms: nonzero(
                num("server", "write_timeout_ms")?,
                "server.write_timeout_ms",
            )?,
            max_frame_bytes: u32_of(
                nonzero(num("server", "max_frame_bytes")?, "server.max_frame_bytes")?,
                "server.max_frame_bytes",
            )?,
            max_requests_per_connection: nonzero(
                num("server", "max_requests_per_connection")?,
                "server.max_requests_per_connection",
            )? as usize,
            max_request_bytes_per_connection: nonzero(
                num("server", "max_request_bytes_per_connection")?,
                "server.max_request_bytes_per_connection",
            )? as usize,
            max_pending_response_bytes: nonzero(
                num("server", "max_pending_response_bytes")?,
                "server.max_pending_response_bytes",
            )? as usize,
            max_buffered_bytes_per_core: nonzero(
                num("server", "max_buffered_bytes_per_core")?,
                "server.max_buffered_bytes_per_core",
            )? as usize,
            metrics_listen: if metrics.is_empty() {
                None
            } else {
                Some(metrics)
            },
            metrics_max_groups: num("server", "metrics_max_groups")? as usize,
            shutdown_grace_ms: num("server", "shutdown_grace_ms")?,
            log: get("server", "log").value.clone(),
            data_dir: if data_dir.is_empty() {
                None
            } else {
                Some(PathBuf::from(data_dir))
            },
            ack_on_commit: boolean("storage", "ack_on_commit")?,
            segment_bytes: nonzero(num("storage", "segment_bytes")?, "storage.segment_bytes")?,
            retention_bytes: opt(num("storage", "retention_bytes")?),
            retention_ms: opt(num("storage", "retention_ms")?),
            io_queue_depth: group_limit(
                nonzero(num("storage", "io_queue_depth")?, "storage.io_queue_depth")?,
                MAX_IO_QUEUE_DEPTH,
                "storage.io_queue_depth",
            )? as usize,
            write_chunk_bytes: write_chunk_bytes as usize,
            preallocate_bytes: num("storage", "preallocate_bytes")?,
            read_cache_bytes: num("storage", "read_cache_bytes")? as usize,
            read_cache_bytes_per_core: num("storage", "read_cache_bytes_per_core")? as usize,
            max_queued_bytes: nonzero(
                num("storage", "max_queued_bytes")?,
                "storage.max_queued_bytes",
            )? as usize,
            min_free_bytes: num("storage", "min_free_bytes")?,
            verify_on_open: boolean("storage", "verify_on_open")?,
            retention_check_ms: nonzero(
                num("storage", "retention_check_ms")?,
                "storage.retention_check_ms",
            )?,
            visibility_timeout_ms,
            max_attempts: group_limit(
                nonzero(num("groups", "max_attempts")?, "groups.max_attempts")?,
                felix_engine::group::MAX_ATTEMPTS_LIMIT as u64,
                "groups.max_attempts",
            )? as u32,
            max_wait_ms: num("groups", "max_wait_ms")?,
            max_in_flight: group_limit(
                nonzero(num("groups", "max_in_flight")?, "groups.max_in_flight")?,
                felix_engine::group::MAX_IN_FLIGHT_LIMIT as u64,
                "groups.max_in_flight",
            )? as u32,
            max_visibility_ms,
            group_idle_ms: nonzero(num("groups", "idle_ms")?, "groups.idle_ms")?,
            max_records_per_read: u32_of(
                nonzero(
                    num("limits", "max_records_per_read")?,
                    "limits.max_records_per_read",
                )?,
                "limits.max_records_per_read",
            )
            .and_then(|n| at_most(n, 1000, "limits.max_records_per_read"))?,
            max_bytes_per_read: u32_of(
                nonzero(
                    num("limits", "max_bytes_per_read")?,
                    "limits.max_bytes_per_read",
                )?,
                "limits.max_bytes_per_read",
            )
            .and_then(|n| at_most(n, 4 << 20, "limits.max_bytes_per_read"))?,
            max_records_per_publish: u32_of(
                nonzero(
                    num("limits", "max_records_per_publish")?,
                    "limits.max_records_per_publish",
                )?,
                "limits.max_records_per_publish",
            )
            .and_then(|n| {
                // No message carries a longer list (the decoder answers
                // too_large past it).
                at_most(
                    n,
                    felix_wire::MAX_ITEMS_PER_VEC as u32,
                    "limits.max_records_per_publish",
                )
            })?,
            max_timestamp_ahead_ms: opt(num("limits", "max_timestamp_ahead_ms")?),
            max_shards: u32_of(
                nonzero(num("limits", "max_shards")?, "limits.max_shards")?,
                "limits.max_shards",
            )
            .and_then(|n| at_most(n, catalog::MAX_SHARDS, "limits.max_shards"))?,
            max_total_shards: nonzero(
                num("limits", "max_total_shards")?,
                "limits.max_total_shards",
            )?,
            max_groups_per_shard: nonzero(
                num("groups", "max_groups_per_shard")?,
                "groups.max_groups_per_shard",
            )? as usize,
            max_claims_per_core: nonzero(
                num("groups", "max_claims_per_core")?,
                "groups.max_claims_per_core",
            )?,
            tokens_file: (!tokens_file.is_empty()).then(|| PathBuf::from(tokens_file)),
            acl_file: (!acl_file.is_empty()).then(|| PathBuf::from(acl_file)),
            values,
            warnings: Vec::new(),
        };
        let mut cfg = cfg;
        if let Some(was) = raised_cap {
            if let Some(r) = cfg.values.get_mut(&("groups", "max_visibility_ms")) {
                r.value = max_visibility_ms.to_string();
                r.source = Source::Raised {
                    was: Box::new(was),
                    to: "groups.visibility_timeout_ms",
                };
            }
        }
        cfg.warnings = warnings;
        Ok(cfg)
    }

    /// The effective configuration as TOML, each value annotated with where
    /// it came from.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut section = "";
        for s in SETTINGS {
            if s.section != section {
                if !section.is_empty() {
                    out.push('\n');
                }
                section = s.section;
                out.push_str(&format!("[{section}]\n"));
            }
            let r = &self.values[&(s.section, s.name)];
            let shown = match s.kind {
                Kind::Str => format!("{:?}", r.value),
                // As the file takes it, whatever spelling the environment used.
                Kind::Bool => parse_bool(&r.value)
                    .map(|b| b.to_string())
                    .unwrap_or_else(|| r.value.clone()),
                _ => r.value.clone(),
            };
            // The variable that would override it, unless it just did.
            let env = match (s.env, &r.source) {
                (Some(_), Source::Env(_)) | (None, _) => String::new(),
                (Some(e), _) => format!(", {e}"),
            };
            out.push_str(&format!(
                "{} = {}  # from {}{} — {}\n",
                s.name, shown, r.source, env, s.help
            ));
        }
        out
    }
}

/// A commented example `felix.toml` with every setting at its default.
pub fn example_toml() -> String {
    let mut out = String::from(
        "# felix.toml: every setting with its default value.\n#\n# Precedence: built-in default < this file < environment variable < flag.\n# `felix serve --print-config` shows the effective value of each setting\n# and where it came from.\n",
    );
    let mut section = "";
    for s in SETTINGS {
        if s.section != section {
            section = s.section;
            out.push_str(&format!("\n[{section}]\n"));
        }
        out.push_str(&format!("# {}", s.help));
        if let Some(e) = s.env {
            out.push_str(&format!(" (env {e})"));
        }
        out.push('\n');
        let shown = match s.kind {
            Kind::Str => format!("{:?}", s.default),
            _ => s.default.to_string(),
        };
        out.push_str(&format!("{} = {}\n", s.name, shown));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_env(vars: &[(&str, &str)], overrides: &Overrides) -> Result<Config, ConfigError> {
        let env: BTreeMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::load_with_env(None, overrides, &env)
    }

    #[test]
    fn a_cluster_secret_is_read_from_its_file() {
        let nodes = "1=127.0.0.1:7400/127.0.0.1:7500,2=127.0.0.1:7410/127.0.0.1:7510";
        let dir = tempfile::tempdir().unwrap();
        let load = |secret: Option<&[u8]>| {
            let f = dir.path().join("secret");
            let _ = std::fs::remove_file(&f);
            if let Some(b) = secret {
                use std::os::unix::fs::PermissionsExt;
                std::fs::write(&f, b).unwrap();
                std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
            }
            let f = f.display().to_string();
            with_env(
                &[
                    ("FELIX_NODE_ID", "1"),
                    ("FELIX_CLUSTER_NODES", nodes),
                    ("FELIX_CLUSTER_SECRET_FILE", &f),
                ],
                &Overrides::default(),
            )
        };
        let c = load(Some(b"0123456789abcdef\n")).unwrap();
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        let cluster = c.cluster.unwrap();
        // One trailing newline is not part of the secret.
        assert_eq!(cluster.peer_key, PeerKey::from_secret(b"0123456789abcdef"));
        assert!(cluster.secret_file.is_some());
        assert_eq!(
            load(Some(b"0123456789abcdef\r\n"))
                .unwrap()
                .cluster
                .unwrap()
                .peer_key,
            PeerKey::from_secret(b"0123456789abcdef")
        );
        // A secret others may read is taken, with a warning.
        {
            use std::os::unix::fs::PermissionsExt;
            let f = dir.path().join("open-secret");
            std::fs::write(&f, "0123456789abcdef").unwrap();
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
            let f = f.display().to_string();
            let c = with_env(
                &[
                    ("FELIX_NODE_ID", "1"),
                    ("FELIX_CLUSTER_NODES", nodes),
                    ("FELIX_CLUSTER_SECRET_FILE", &f),
                ],
                &Overrides::default(),
            )
            .unwrap();
            assert!(
                c.warnings.iter().any(|w| w.contains("mode 644")),
                "{:?}",
                c.warnings
            );
        }
        for (secret, why) in [
            (Some(&b"short\n"[..]), "at least 16"),
            (Some(&b"\n"[..]), "the secret is 0 bytes"),
            (None, "No such file"),
        ] {
            let e = load(secret).unwrap_err().to_string();
            assert!(e.contains("cluster.secret_file") && e.contains(why), "{e}");
        }
        // Without one: the key of no secret, and a warning.
        let c = with_env(
            &[("FELIX_NODE_ID", "1"), ("FELIX_CLUSTER_NODES", nodes)],
            &Overrides::default(),
        )
        .unwrap();
        assert!(c.cluster.unwrap().peer_key.is_open());
        assert!(
            c.warnings.iter().any(|w| w.contains("not authenticated")),
            "{:?}",
            c.warnings
        );
    }

    #[test]
    fn a_cluster_is_every_node_with_this_one_among_them() {
        let nodes = "2=127.0.0.1:7410/127.0.0.1:7510, 1=127.0.0.1:7400/127.0.0.1:7500,3=h3:7400/10.0.0.3:7500";
        let c = with_env(
            &[("FELIX_NODE_ID", "1"), ("FELIX_CLUSTER_NODES", nodes)],
            &Overrides::default(),
        )
        .unwrap();
        let cluster = c.cluster.expect("a cluster");
        assert_eq!(cluster.node_id, 1);
        assert_eq!(cluster.voters(), vec![1, 2, 3]);
        assert_eq!(cluster.node(3).unwrap().client, "h3:7400");
        assert_eq!(
            cluster.node(2).unwrap().replication,
            "127.0.0.1:7510".parse().unwrap()
        );
        // The flags win over the environment.
        let c = with_env(
            &[("FELIX_NODE_ID", "1"), ("FELIX_CLUSTER_NODES", nodes)],
            &Overrides {
                node_id: Some(2),
                ..Overrides::default()
            },
        )
        .unwrap();
        assert_eq!(c.cluster.unwrap().node_id, 2);
        // No cluster by default.
        assert!(with_env(&[], &Overrides::default())
            .unwrap()
            .cluster
            .is_none());
        for (vars, why) in [
            (
                vec![("FELIX_NODE_ID", "4"), ("FELIX_CLUSTER_NODES", nodes)],
                "not one of",
            ),
            (vec![("FELIX_CLUSTER_NODES", nodes)], "node_id is not"),
            (vec![("FELIX_NODE_ID", "1")], "nodes is empty"),
            (
                vec![
                    ("FELIX_NODE_ID", "1"),
                    ("FELIX_CLUSTER_NODES", "1=a:1/127.0.0.1:2,1=b:1/127.0.0.1:3"),
                ],
                "listed twice",
            ),
            (
                vec![
                    ("FELIX_NODE_ID", "1"),
                    ("FELIX_CLUSTER_NODES", "1=a:1/nowhere"),
                ],
                "IP:PORT",
            ),
            (
                vec![
                    ("FELIX_NODE_ID", "1"),
                    ("FELIX_CLUSTER_NODES", "0=a:1/127.0.0.1:2"),
                ],
                "ids run",
            ),
            (
                vec![
                    ("FELIX_NODE_ID", "1"),
                    ("FELIX_CLUSTER_NODES", nodes),
                    ("FELIX_DURABLE_STORAGE_DIR", ""),
                ],
                "needs storage.data_dir",
            ),
        ] {
            let err = with_env(&vars, &Overrides::default())
                .unwrap_err()
                .to_string();
            assert!(err.contains(why), "{vars:?}: {err}");
        }
    }

    /// The shipped example lists every setting at its default and parses.
    #[test]
    fn the_example_config_is_current_and_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../felix.example.toml");
        if std::env::var("FELIX_WRITE_EXAMPLE").is_ok() {
            std::fs::write(&path, example_toml()).unwrap();
        }
        let shipped =
            std::fs::read_to_string(&path).expect("felix.example.toml at the repository root");
        assert_eq!(
            shipped,
            example_toml(),
            "regenerate with FELIX_WRITE_EXAMPLE=1 cargo test -p felix-server"
        );
        let cfg =
            Config::load_with_env(Some(&path), &Overrides::default(), &BTreeMap::new()).unwrap();
        assert!(cfg.render().contains("from file"));
    }

    #[test]
    fn defaults_env_and_flags_layer_in_order() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let file = dir.join("felix.toml");
        std::fs::write(&file, "[groups]\nmax_attempts = 3\nvisibility_timeout_ms = 1000\n[server]\nlisten = \"127.0.0.1:9000\"\n").unwrap();
        let mut env = BTreeMap::new();
        env.insert("FELIX_GROUP_MAX_ATTEMPTS".to_string(), "7".to_string());
        env.insert("FELIX_ACK_ON_COMMIT".to_string(), "0".to_string());
        let cfg = Config::load_with_env(
            Some(&file),
            &Overrides {
                listen: Some("127.0.0.1:9100".into()),
                ..Default::default()
            },
            &env,
        )
        .unwrap();
        assert_eq!(cfg.max_attempts, 7);
        assert_eq!(cfg.visibility_timeout_ms, 1000);
        assert!(!cfg.ack_on_commit);
        assert_eq!(cfg.listen, "127.0.0.1:9100");
        let shown = cfg.render();
        assert!(
            shown.contains("max_attempts = 7  # from env FELIX_GROUP_MAX_ATTEMPTS"),
            "{shown}"
        );
        assert!(shown.contains("from flag --listen"), "{shown}");
        assert!(
            shown.contains("visibility_timeout_ms = 1000  # from file"),
            "{shown}"
        );
    }

    #[test]
    fn bad_settings_are_refused_with_their_name() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let file = dir.join("bad.toml");
        std::fs::write(&file, "[groups]\nmax_atempts = 3\n").unwrap();
        let e = Config::load_with_env(Some(&file), &Overrides::default(), &BTreeMap::new())
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("unknown setting `groups.max_atempts`"),
            "{e}"
        );
        let mut env = BTreeMap::new();
        env.insert("FELIX_ACK_ON_COMMIT".to_string(), "maybe".to_string());
        let e = Config::load_with_env(None, &Overrides::default(), &env).unwrap_err();
        assert!(e.to_string().contains("yes/no"), "{e}");
        // A switch takes 1 and 0 in the file too, as the variables do.
        std::fs::write(&file, "[storage]\nack_on_commit = 0\n").unwrap();
        let cfg =
            Config::load_with_env(Some(&file), &Overrides::default(), &BTreeMap::new()).unwrap();
        assert!(!cfg.ack_on_commit);
        std::fs::write(&file, "[storage]\nack_on_commit = 2\n").unwrap();
        let e = Config::load_with_env(Some(&file), &Overrides::default(), &BTreeMap::new())
            .unwrap_err();
        assert!(e.to_string().contains("wrong type"), "{e}");

        // Over a hard cap: refused, not quietly lowered behind --print-config.
        std::fs::write(&file, "[limits]\nmax_records_per_read = 5000\n").unwrap();
        let e = Config::load_with_env(Some(&file), &Overrides::default(), &BTreeMap::new())
            .unwrap_err();
        assert!(e.to_string().contains("at most 1000"), "{e}");
        std::fs::write(&file, "[limits]\nmax_shards = 65537\n").unwrap();
        let e = Config::load_with_env(Some(&file), &Overrides::default(), &BTreeMap::new())
            .unwrap_err();
        assert!(e.to_string().contains("at most 65536"), "{e}");

        std::fs::write(&file, "[storage]\nsegment_bytes = 1\n").unwrap();
        let e = Config::load_with_env(Some(&file), &Overrides::default(), &BTreeMap::new())
            .unwrap_err();
        assert!(
            e.to_string().contains(&format!(
                "storage.segment_bytes (from file {}) must be at least 4096",
                file.display()
            )),
            "{e}"
        );

        // A frame cap too small to carry ordinary answers.
        std::fs::write(&file, "[server]\nmax_frame_bytes = 1000\n").unwrap();
        let e = Config::load_with_env(Some(&file), &Overrides::default(), &BTreeMap::new())
            .unwrap_err();
        assert!(
            e.to_string().contains(&format!(
                "server.max_frame_bytes (from file {}) must be at least 4096",
                file.display()
            )),
            "{e}"
        );
    }

    #[test]
    fn addresses_and_the_log_filter_are_checked_before_start() {
        let env_of = |k: &str, v: &str| BTreeMap::from([(k.to_string(), v.to_string())]);
        let load = |env: BTreeMap<String, String>| {
            Config::load_with_env(None, &Overrides::default(), &env).map_err(|e| e.to_string())
        };
        let e = load(env_of("FELIX_LISTEN", "notanaddr")).unwrap_err();
        assert!(
            e.contains("server.listen = \"notanaddr\" (from env FELIX_LISTEN) is not an address"),
            "{e}"
        );
        // A bare number in the file is a string setting's text, and no address.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("felix.toml");
        std::fs::write(&file, "[server]\nlisten = 5\n").unwrap();
        let e = Config::load_with_env(Some(&file), &Overrides::default(), &BTreeMap::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("server.listen = \"5\""), "{e}");
        let e = load(env_of("FELIX_METRICS_LISTEN", "127.0.0.1")).unwrap_err();
        assert!(e.contains("server.metrics_listen"), "{e}");
        // Empty turns metrics off: not an address, and not an error.
        assert!(load(env_of("FELIX_METRICS_LISTEN", "")).is_ok());
        let e = load(env_of("RUST_LOG", "garbage===")).unwrap_err();
        assert!(
            e.contains("server.log = \"garbage===\" (from env RUST_LOG) is not a log filter"),
            "{e}"
        );
        assert!(load(env_of("RUST_LOG", "warn,felix_server=debug")).is_ok());
        let e = load(env_of("FELIX_LISTEN", "[::1]:7400")).unwrap_err();
        assert!(e.contains("only IPv4 is supported"), "{e}");
        // Metrics on the clients' port: refused here, not by a bind that
        // waits and then fails.
        let both = |listen: &str, metrics: &str| {
            load(BTreeMap::from([
                ("FELIX_LISTEN".to_string(), listen.to_string()),
                ("FELIX_METRICS_LISTEN".to_string(), metrics.to_string()),
            ]))
        };
        let e = both("127.0.0.1:7990", "127.0.0.1:7990").unwrap_err();
        assert!(e.contains("is the port server.listen"), "{e}");
        assert!(both("0.0.0.0:7990", "127.0.0.1:7990").is_err());
        assert!(both("127.0.0.1:7990", "127.0.0.1:7991").is_ok());
        assert!(
            both("127.0.0.1:0", "127.0.0.1:0").is_ok(),
            "ports chosen at bind"
        );
    }

    #[test]
    fn unknown_felix_variables_are_named_in_a_warning() {
        let env = BTreeMap::from(
            [
                ("FELIX_LISTENN", "127.0.0.1:1"),
                ("FELIX_SEGMENT_BYTES", "1"),
                ("FELIX_DATA_DIR", "/d"),
                ("FELIX_GROUPS_MAX_ATTEMPTS", "3"),
                ("FELIX_SIM_SEED", "7"),
                ("FELIX_BROKER", "127.0.0.1:7400"),
                ("FELIX_LISTEN", "127.0.0.1:7400"),
                ("FELIX_TOKEN_FILE", "/etc/felix/tokens"),
                ("FELIX_NOTHING_LIKE_IT", "1"),
                ("FELIX_GROUP", "1"),
                ("FELIX_ACL", "/etc/felix/acl"),
                ("PATH", "/bin"),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string())),
        );
        let c = Config::load_with_env(None, &Overrides::default(), &env).unwrap();
        // In the variables' order (a map's).
        let want = [
            "FELIX_ACL is ignored: no setting reads it; did you mean FELIX_ACL_FILE?",
            "FELIX_DATA_DIR is ignored: no setting reads it; storage.data_dir is set with \
             FELIX_DURABLE_STORAGE_DIR",
            "FELIX_GROUP is ignored: no setting reads it (",
            "FELIX_GROUPS_MAX_ATTEMPTS is ignored: no setting reads it; groups.max_attempts is \
             set with FELIX_GROUP_MAX_ATTEMPTS",
            "FELIX_LISTENN is ignored: no setting reads it; did you mean FELIX_LISTEN?",
            "FELIX_NOTHING_LIKE_IT is ignored: no setting reads it (",
            "FELIX_SEGMENT_BYTES is ignored: storage.segment_bytes has no environment variable",
            "FELIX_TOKEN_FILE is ignored: no setting reads it; did you mean FELIX_TOKENS_FILE?",
        ];
        assert_eq!(c.warnings.len(), want.len(), "{:?}", c.warnings);
        for (w, want) in c.warnings.iter().zip(want) {
            assert!(w.starts_with(want), "{w:?} should start {want:?}");
        }
    }

    #[test]
    fn a_longer_visibility_timeout_raises_the_cap() {
        let mut env = BTreeMap::new();
        env.insert(
            "FELIX_GROUP_VISIBILITY_TIMEOUT_MS".to_string(),
            (24 * 3_600_000u64).to_string(),
        );
        let c = Config::load_with_env(None, &Overrides::default(), &env).unwrap();
        assert_eq!(c.max_visibility_ms, 24 * 3_600_000);
        assert!(c
            .render()
            .contains("raised to groups.visibility_timeout_ms"));
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        // A cap set below the timeout: the cap is never below the timeout,
        // so it is raised too, with a warning naming where it was set.
        env.insert(
            "FELIX_GROUP_MAX_VISIBILITY_MS".to_string(),
            "60000".to_string(),
        );
        let c = Config::load_with_env(None, &Overrides::default(), &env).unwrap();
        assert_eq!(c.max_visibility_ms, 24 * 3_600_000);
        assert!(c
            .render()
            .contains("env FELIX_GROUP_MAX_VISIBILITY_MS, raised to groups.visibility_timeout_ms"));
        assert_eq!(c.warnings.len(), 1);
        assert!(c.warnings[0].contains("is below groups.visibility_timeout_ms"));
        // A timeout past what a claim can hold is named, not the cap it
        // would have raised.
        let mut env = BTreeMap::new();
        env.insert(
            "FELIX_GROUP_VISIBILITY_TIMEOUT_MS".to_string(),
            "4294967296".to_string(),
        );
        let e = Config::load_with_env(None, &Overrides::default(), &env).unwrap_err();
        assert!(
            e.to_string().contains("groups.visibility_timeout_ms"),
            "{e}"
        );
        assert!(!e.to_string().contains("max_visibility_ms"), "{e}");
        // Past what a claim can hold: refused, not lowered.
        let mut env = BTreeMap::new();
        env.insert("FELIX_GROUP_MAX_ATTEMPTS".to_string(), "70000".to_string());
        let e = Config::load_with_env(None, &Overrides::default(), &env).unwrap_err();
        assert!(e.to_string().contains("at most 65535"), "{e}");
    }

    #[test]
    fn print_config_shows_booleans_as_the_file_takes_them() {
        let mut env = BTreeMap::new();
        env.insert("FELIX_ACK_ON_COMMIT".to_string(), "0".to_string());
        let c = Config::load_with_env(None, &Overrides::default(), &env).unwrap();
        let shown = c.render();
        assert!(
            shown.contains("ack_on_commit = false  # from env"),
            "{shown}"
        );
        // And what it prints loads back.
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let file = dir.join("printed.toml");
        std::fs::write(&file, &shown).unwrap();
        let again =
            Config::load_with_env(Some(&file), &Overrides::default(), &BTreeMap::new()).unwrap();
        assert!(!again.ack_on_commit);
    }
}
