//! Command-line syntax (clap derive). Every flag's help says what it does.

use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgGroup, Args, Parser, Subcommand, ValueEnum};
use felix_client::{StartPosition, StreamRef};

#[derive(Debug, Parser)]
#[command(
    name = "felix",
    version,
    about = "Felix: a durable sharded log broker",
    long_about = "Felix: a durable sharded log broker.\n\n\
        `felix serve` runs a broker. Every other command is a client of a running \
        broker (see --broker): create and inspect streams, publish and read records, \
        and run or administer consumer groups.\n\n\
        Streams are named TENANT/NAMESPACE/STREAM, for example t1/default/jobs.\n\n\
        On a cluster, --broker may name one broker or several, separated by commas: \
        `stream create` runs on every broker of the cluster (the first broker that \
        answers names them), `stream delete` on each broker named, the --all-shards \
        commands send each shard's part to its leader, `consume` and `read --follow` \
        follow the shard's leader from broker to broker for as long as they run, and \
        other commands go to the first broker that answers, following a `not_leader` \
        answer to the shard's leader (a `publish` sends the batches refused that way \
        to the leader, in order, and goes on there).\n\n\
        Errors are printed to stderr as `error: <code>: <message>`; the exit code is \
        2 for a usage error and 1 for any other failure.",
    propagate_version = true
)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Args)]
pub struct GlobalArgs {
    /// Broker to talk to, as HOST:PORT, or for a cluster one or several
    /// separated by commas (`felix --help` says how each command uses
    /// them). Ignored by `serve`, which takes --listen.
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        env = "FELIX_BROKER",
        hide_env_values = true,
        default_value = "127.0.0.1:7400",
        value_name = "ADDR",
        value_parser = parse_brokers
    )]
    pub broker: String,

    /// How long to wait for each answer from the broker, e.g. `30s`,
    /// `500ms`, `2m` (a bare number is seconds). A long poll or a waiting
    /// read gets its wait on top. Connecting is bounded by the smaller of
    /// this and 10s.
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        default_value = "30s",
        value_name = "DURATION",
        value_parser = parse_duration
    )]
    pub timeout: Duration,

    /// Authentication token sent to the broker when connecting: needed by a
    /// broker run with a tokens file (security.tokens_file), refused by one
    /// without.
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        env = "FELIX_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    pub token: Option<String>,

    /// Set by `main`: the stream of a one-shard command given no --shard.
    #[arg(skip)]
    pub shard_left_out: Option<StreamRef>,
}

#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Run a broker in the foreground until SIGINT/SIGTERM (SIGHUP reads the
    /// tokens and permissions files again).
    Serve(ServeArgs),
    /// Create, list, describe and delete streams.
    #[command(subcommand)]
    Stream(StreamCmd),
    /// Inspect one shard of a stream.
    #[command(subcommand)]
    Shard(ShardCmd),
    /// Publish records: the MESSAGE arguments, or one record per stdin line.
    Publish(PublishArgs),
    /// Read records of one shard, or follow it as records arrive.
    Read(ReadArgs),
    /// Administer a consumer group on one shard.
    #[command(subcommand)]
    Group(GroupCmd),
    /// Consume as a member of a consumer group: poll, print, acknowledge.
    Consume(ConsumeArgs),
    /// Check that the broker answers, and show what it supports.
    Ping,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Configuration file (TOML). Defaults to ./felix.toml when it exists.
    /// FELIX_* environment variables override its settings, and the flags
    /// below override both.
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Directory for durable storage (default ./felix-data, or
    /// storage.data_dir / FELIX_DURABLE_STORAGE_DIR). To run in memory
    /// (nothing survives a restart, no consumer groups), set
    /// FELIX_DURABLE_STORAGE_DIR= (empty) or storage.data_dir = "" instead.
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Address to listen on (default 127.0.0.1:7400); port 0 picks a free
    /// port, printed on stdout as `felix: listening on ADDR`.
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
    /// Cores to run on: a count (`4`, the first four CPUs) or a CPU list
    /// (`0-3`, `0,2,4`; one CPU: `3,`). One executor is pinned to each.
    #[arg(long, value_name = "N|LIST")]
    pub cores: Option<String>,
    /// This broker's id in its cluster (cluster.node_id / FELIX_NODE_ID),
    /// one of the ids --peers lists.
    #[arg(long, value_name = "ID", value_parser = parse_whole::<u64>)]
    pub node_id: Option<u64>,
    /// Every broker of the cluster, this one included:
    /// ID=CLIENT_ADDR/REPLICATION_ADDR,... (cluster.nodes /
    /// FELIX_CLUSTER_NODES). Each shard is then replicated on every broker
    /// listed, and served by its elected leader; core i of each broker
    /// replicates on REPLICATION_ADDR's port + i. Needs a data directory.
    #[arg(long, value_name = "LIST")]
    pub peers: Option<String>,
    /// Print the effective configuration (file, environment and flags
    /// merged) and exit without starting.
    #[arg(long)]
    pub print_config: bool,
}

#[derive(Debug, Clone, Subcommand)]
pub enum StreamCmd {
    /// Create a stream (on a cluster: on every broker of it, with one
    /// incarnation).
    Create {
        /// TENANT/NAMESPACE/STREAM
        #[arg(value_parser = parse_stream)]
        stream: StreamRef,
        /// Number of shards (fixed for the stream's life).
        #[arg(long, value_name = "N", value_parser = parse_count::<u32>)]
        shards: u32,
        /// Keep at most about this many bytes per shard; 0 keeps all
        /// (default: the broker's `storage.retention_bytes`, fixed at
        /// creation; `stream describe` shows `none` for keep-all).
        #[arg(long, value_name = "B", value_parser = parse_whole::<u64>)]
        retention_bytes: Option<u64>,
        /// Keep records for about this many milliseconds; 0 keeps all
        /// (default: the broker's `storage.retention_ms`, fixed at
        /// creation).
        #[arg(long, value_name = "MS", value_parser = parse_ms)]
        retention_ms: Option<u64>,
    },
    /// List streams, one per line.
    List {
        /// Only this tenant's streams.
        #[arg(long, value_name = "T")]
        tenant: Option<String>,
    },
    /// Show a stream's shards, retention and placement.
    Describe {
        /// TENANT/NAMESPACE/STREAM
        #[arg(value_parser = parse_stream)]
        stream: StreamRef,
    },
    /// Delete a stream and all its records.
    Delete {
        /// TENANT/NAMESPACE/STREAM
        #[arg(value_parser = parse_stream)]
        stream: StreamRef,
    },
}

#[derive(Debug, Clone, Subcommand)]
pub enum ShardCmd {
    /// Show a shard's offsets, size and owning core; on a cluster, the
    /// broker's replica of it too (role, term, leader, replication
    /// indices), and with several --broker, every broker's, a row each.
    Describe {
        /// TENANT/NAMESPACE/STREAM
        #[arg(value_parser = parse_stream)]
        stream: StreamRef,
        /// Shard number.
        #[arg(long, value_name = "N", default_value_t = 0, value_parser = parse_whole::<u32>)]
        shard: u32,
    },
}

#[derive(Debug, Clone, Args)]
pub struct PublishArgs {
    /// TENANT/NAMESPACE/STREAM
    #[arg(value_parser = parse_stream)]
    pub stream: StreamRef,
    /// Shard to publish to (default 0 unless --key is given).
    #[arg(long, value_name = "N", conflicts_with = "key", value_parser = parse_whole::<u32>)]
    pub shard: Option<u32>,
    /// Routing key: stored with every record, and picks the shard
    /// (crc32c(key) mod shards), so records with one key stay in order.
    #[arg(long, value_name = "K")]
    pub key: Option<String>,
    /// Wait for each batch to be durable before it is acknowledged
    /// (commit acks), whatever the broker's default.
    #[arg(long)]
    pub ack_on_commit: bool,
    /// Most records per batch read from stdin.
    #[arg(long, value_name = "N", default_value_t = 1000, value_parser = parse_count::<usize>)]
    pub batch_records: usize,
    /// Most payload bytes per batch read from stdin.
    #[arg(long, value_name = "BYTES", default_value_t = 1024 * 1024, value_parser = parse_count::<usize>)]
    pub batch_bytes: usize,
    /// Batches sent but not yet acknowledged at once. Order is kept.
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = parse_count::<usize>)]
    pub in_flight: usize,
    /// Records to publish, one per argument. Without any, each line of
    /// stdin is a record (without its line ending); `felix` exits once every
    /// line is acknowledged and prints `published N records to shard S` to
    /// stderr (no shard when they went to several). On
    /// an error it sends nothing more, waits for the answers still due, and
    /// prints how many records were acknowledged, which input records
    /// (counting from 1) went out without an acknowledgement (those may or
    /// may not be stored), and from which input record on nothing was
    /// sent.
    #[arg(value_name = "MESSAGE")]
    pub messages: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// The payload alone, one record per line (invalid UTF-8 replaced).
    Text,
    /// One JSON object per line: offset, timestamp, key, payload. Key and
    /// payload are UTF-8 strings when valid, else base64, as the
    /// `key_encoding`/`payload_encoding` fields say ("utf8" or "base64").
    Json,
}

#[derive(Debug, Clone, Args)]
pub struct ReadArgs {
    /// TENANT/NAMESPACE/STREAM
    #[arg(value_parser = parse_stream)]
    pub stream: StreamRef,
    /// Shard to read.
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = parse_whole::<u32>)]
    pub shard: u32,
    /// Where to start: `earliest` (oldest retained record), `latest` (the
    /// tail: only new records) or an offset.
    #[arg(long, value_name = "earliest|latest|OFFSET", default_value = "earliest", value_parser = parse_start, allow_hyphen_values = true)]
    pub from: StartPosition,
    /// Stop after this many records.
    #[arg(long, value_name = "N", value_parser = parse_whole::<u64>)]
    pub count: Option<u64>,
    /// Keep reading as new records arrive, instead of stopping at the tail.
    /// With several --broker, a broker that cannot be reached is passed
    /// over for another holding the shard, and the read goes on where it
    /// stopped.
    #[arg(long)]
    pub follow: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

/// Which group: the stream, shard and group name.
#[derive(Debug, Clone, Args)]
pub struct GroupTarget {
    /// TENANT/NAMESPACE/STREAM
    #[arg(value_parser = parse_stream)]
    pub stream: StreamRef,
    /// Shard the group consumes (groups are per shard).
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = parse_whole::<u32>)]
    pub shard: u32,
    /// Group name.
    #[arg(long, value_name = "G")]
    pub group: String,
}

#[derive(Debug, Clone, Subcommand)]
pub enum GroupCmd {
    /// Show where a group stands: position, lag, in flight, owed, dead
    /// letters.
    Describe {
        #[command(flatten)]
        target: GroupTarget,
        /// The group on every shard of the stream: one line per shard and
        /// a total.
        #[arg(long, conflicts_with = "shard")]
        all_shards: bool,
    },
    /// Create a group at a position; an existing group is left alone.
    Create {
        #[command(flatten)]
        target: GroupTarget,
        /// Starting position: `earliest`, `latest` or an offset.
        #[arg(long, value_name = "earliest|latest|OFFSET", default_value = "earliest", value_parser = parse_start, allow_hyphen_values = true)]
        to: StartPosition,
        /// On every shard of the stream (`latest` is each shard's own tail;
        /// an offset is refused for a stream of several shards).
        #[arg(long, conflicts_with = "shard")]
        all_shards: bool,
    },
    /// Move an existing group, backwards to replay or forwards to skip. Voids
    /// every standing claim.
    Seek {
        #[command(flatten)]
        target: GroupTarget,
        /// New position: `earliest`, `latest` or an offset.
        #[arg(long, value_name = "earliest|latest|OFFSET", value_parser = parse_start, allow_hyphen_values = true)]
        to: StartPosition,
        /// On every shard of the stream (`latest` is each shard's own tail;
        /// an offset is refused for a stream of several shards).
        #[arg(long, conflicts_with = "shard")]
        all_shards: bool,
    },
    /// Delete a group's position and dead letters.
    Delete {
        #[command(flatten)]
        target: GroupTarget,
        /// On every shard of the stream.
        #[arg(long, conflicts_with = "shard")]
        all_shards: bool,
    },
    /// List the groups on a shard.
    List {
        /// TENANT/NAMESPACE/STREAM
        #[arg(value_parser = parse_stream)]
        stream: StreamRef,
        /// Shard number.
        #[arg(long, value_name = "N", default_value_t = 0, value_parser = parse_whole::<u32>)]
        shard: u32,
    },
    /// List a group's dead letters in offset order: offset, attempts, when,
    /// by whom, why. Prints all of them (fetched a page at a time) unless
    /// --from or --limit narrows the list.
    DeadLetters {
        #[command(flatten)]
        target: GroupTarget,
        /// Output format: text (a line per dead letter: offset, attempts,
        /// when, by whom, why) or json (an object per line).
        #[arg(long, value_enum, default_value_t = Format::Text, hide_possible_values = true)]
        format: Format,
        /// List only the dead letters at this offset and above.
        #[arg(long, value_name = "OFFSET", default_value_t = 0, value_parser = parse_whole::<u64>)]
        from: u64,
        /// List at most N dead letters (default: all of them).
        #[arg(long, value_name = "N", value_parser = parse_whole::<u64>)]
        limit: Option<u64>,
    },
    /// Put a dead letter back to be delivered again, its attempts reset.
    #[command(group(ArgGroup::new("which").required(true).args(["offset", "all"])))]
    Redrive {
        #[command(flatten)]
        target: GroupTarget,
        /// Offset of the dead letter (or --all).
        #[arg(long, value_name = "O", value_parser = parse_whole::<u64>)]
        offset: Option<u64>,
        /// Every dead letter of the group.
        #[arg(long, conflicts_with = "offset")]
        all: bool,
    },
    /// Stop tracking a dead letter (the record stays in the log).
    #[command(group(ArgGroup::new("which").required(true).args(["offset", "all"])))]
    Discard {
        #[command(flatten)]
        target: GroupTarget,
        /// Offset of the dead letter (or --all).
        #[arg(long, value_name = "O", value_parser = parse_whole::<u64>)]
        offset: Option<u64>,
        /// Every dead letter of the group.
        #[arg(long, conflicts_with = "offset")]
        all: bool,
    },
}

#[derive(Debug, Clone, Args)]
pub struct ConsumeArgs {
    #[command(flatten)]
    pub target: GroupTarget,
    /// Consume the group on every shard of the stream instead of one
    /// (json output then names each record's shard). Waiting polls go to
    /// every shard at once; records one of them claims after the first has
    /// answered are printed next, or handed back when the command ends.
    #[arg(long, conflicts_with = "shard")]
    pub all_shards: bool,
    /// Poll as this named member, taking back at once whatever an earlier
    /// run under the same name still held (reclaim). Without it, polls are
    /// anonymous.
    #[arg(long, value_name = "NAME")]
    pub member: Option<String>,
    /// Stop after this many records.
    #[arg(long, value_name = "N", value_parser = parse_whole::<u64>)]
    pub count: Option<u64>,
    /// How long each poll waits for a record when none is available. A
    /// poll that comes back empty ends the command unless --follow.
    #[arg(long, value_name = "MS", default_value_t = 1000, value_parser = parse_ms)]
    pub wait_ms: u64,
    /// Keep polling after an empty poll (until --count, or forever). A
    /// dropped connection does not end it: polls and acks are tried again
    /// once reconnected (records whose ack the restarted broker no longer
    /// knows are delivered again). With several --broker, neither does a
    /// failover: polls and acks go to the shard's new leader once one is
    /// elected (records the old leader handed out come again).
    #[arg(long)]
    pub follow: bool,
    /// Records claimed per poll.
    #[arg(long, value_name = "N", default_value_t = 100, value_parser = parse_count::<u32>)]
    pub batch: u32,
    /// Output format. json adds `attempts` (1 for a first delivery).
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

pub fn parse_stream(s: &str) -> Result<StreamRef, String> {
    let r = s.parse::<StreamRef>().map_err(|e| e.to_string())?;
    // The broker's own rule for names, so that a typo is a usage error
    // before anything is sent.
    felix_engine::StreamName::new(&r.tenant, &r.namespace, &r.stream).map_err(|e| e.to_string())?;
    Ok(r)
}

/// A count that must be at least 1 (shards, batch sizes, batches in
/// flight): 0 would make nothing, or wait for ever.
pub fn parse_count<T>(s: &str) -> Result<T, String>
where
    T: std::str::FromStr + PartialEq + Default,
    T::Err: std::fmt::Display,
{
    let n: T = parse_whole(s)?;
    if n == T::default() {
        return Err("must be at least 1".into());
    }
    Ok(n)
}

/// A whole number (a count, a shard, an offset, a size in bytes).
pub fn parse_whole<T>(s: &str) -> Result<T, String>
where
    T: std::str::FromStr,
{
    let digits = !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    s.parse().map_err(|_| {
        if digits {
            format!("{s} is too large")
        } else {
            format!("{s:?} is not a whole number (digits only, no units or sign)")
        }
    })
}

/// A number of milliseconds (the flags named `-ms`).
pub fn parse_ms(s: &str) -> Result<u64, String> {
    parse_whole(s).map_err(|e| format!("{e}: give milliseconds, e.g. 3600000 for an hour"))
}

/// `--broker`: one `HOST:PORT`, or several separated by commas.
pub fn parse_brokers(s: &str) -> Result<String, String> {
    for one in s.split(',') {
        let one = one.trim();
        let port = one.rsplit_once(':').and_then(|(host, port)| {
            (!host.is_empty()).then_some(())?;
            port.parse::<u16>().ok()
        });
        if port.is_none() {
            return Err(format!(
                "{one:?} is not HOST:PORT (the broker's listen address, e.g. 127.0.0.1:7400; \
                 several are separated by commas)"
            ));
        }
    }
    Ok(s.to_string())
}

pub fn parse_start(s: &str) -> Result<StartPosition, String> {
    match s {
        "earliest" => Ok(StartPosition::Earliest),
        "latest" => Ok(StartPosition::Latest),
        n => n.parse::<u64>().map(StartPosition::Offset).map_err(|_| {
            format!("{n:?} is not `earliest`, `latest` or an offset (a whole number, from 0)")
        }),
    }
}

/// `500ms`, `30s`, `2m`, `1h`, or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 500ms, 30s, 2m or 1h"))?;
    let d = match unit.trim() {
        "ms" => Duration::from_millis(n),
        "" | "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.saturating_mul(60)),
        "h" => Duration::from_secs(n.saturating_mul(3600)),
        _ => return Err(format!("{s:?}: unknown unit (use ms, s, m or h)")),
    };
    if d.is_zero() {
        return Err("a timeout must be more than zero".into());
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn durations_and_positions_parse() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("0s").is_err());
        assert_eq!(parse_start("earliest"), Ok(StartPosition::Earliest));
        assert_eq!(parse_start("latest"), Ok(StartPosition::Latest));
        assert_eq!(parse_start("42"), Ok(StartPosition::Offset(42)));
        assert!(parse_start("-1").is_err());
        assert!(parse_stream("a/b").is_err());
        assert!(parse_stream("a/b/JOBS space").is_err());
        assert!(parse_stream("a/../c").is_err());
        assert!(parse_stream(&format!("a/b/{}", "x".repeat(129))).is_err());
        assert_eq!(parse_whole::<u32>("7"), Ok(7));
        assert!(parse_whole::<u32>("1h").is_err());
        assert!(parse_ms("1h").unwrap_err().contains("milliseconds"));
        assert_eq!(parse_stream("a/b/c"), Ok(StreamRef::new("a", "b", "c")));
    }

    #[test]
    fn publish_takes_a_shard_or_a_key_not_both() {
        let r = Cli::try_parse_from(["felix", "publish", "a/b/c", "--shard", "1", "--key", "k"]);
        assert!(r.is_err());
        let cli =
            Cli::try_parse_from(["felix", "publish", "a/b/c", "--key", "k", "m1", "m2"]).unwrap();
        match cli.command {
            Command::Publish(p) => {
                assert_eq!(p.key.as_deref(), Some("k"));
                assert_eq!(p.messages, vec!["m1", "m2"]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn global_flags_go_anywhere() {
        let cli = Cli::try_parse_from([
            "felix",
            "stream",
            "list",
            "--broker",
            "h:1",
            "--timeout",
            "2s",
        ])
        .unwrap();
        assert_eq!(cli.global.broker, "h:1");
        assert_eq!(cli.global.timeout, Duration::from_secs(2));
    }

    #[test]
    fn group_redrive_needs_an_offset_or_all() {
        assert!(
            Cli::try_parse_from(["felix", "group", "redrive", "a/b/c", "--group", "g"]).is_err()
        );
        assert!(Cli::try_parse_from([
            "felix", "group", "redrive", "a/b/c", "--group", "g", "--all"
        ])
        .is_ok());
        assert!(Cli::try_parse_from([
            "felix", "group", "redrive", "a/b/c", "--group", "g", "--offset", "3"
        ])
        .is_ok());
    }
}
