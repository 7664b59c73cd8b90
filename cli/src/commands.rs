//! The client-side commands: everything but `serve`.

use std::io::Write;
use std::time::Duration;

use felix_client::{
    Client, ClientConfig, ClientError, ClusterClient, GroupInfo, GroupMember, GroupPollOptions,
    ShardedGroup, ShardedRecord, StartPosition, StreamOptions, StreamRef, FEATURE_CLUSTER_INFO,
    FEATURE_ERROR_NOT_APPLIED, FEATURE_GROUPS, FEATURE_GROUP_ADMIN, FEATURE_GROUP_CLAIM_CONTROL,
    FEATURE_GROUP_DEAD_LETTER_PAGES, FEATURE_GROUP_SKIPPED, FEATURE_PUBLISH_ACK_MODE,
    FEATURE_REPLICA_INFO, FEATURE_STREAM_INCARNATION,
};
use futures_lite::future::poll_once;

use crate::args::{
    Command, ConsumeArgs, Format, GlobalArgs, GroupCmd, GroupTarget, ReadArgs, ShardCmd, StreamCmd,
};
use crate::output;
use crate::CliError;

mod publish;
use publish::publish;

/// `group describe --all-shards` through `$client` (a `Client` or a
/// `ClusterClient`: the same calls), printed. A group comes into being
/// shard by shard (on its first poll there): a shard without it is looked
/// up (its start and end) so that its records count in the lag, once the
/// group is found on some shard.
macro_rules! describe_every_shard {
    ($client:expr, $g:expr) => {{
        let g: &GroupTarget = $g;
        let (t, n, s) = parts(&g.stream);
        let shards = $client.describe_stream(t, n, s).await?.shards;
        let mut described = Vec::with_capacity(shards as usize);
        for shard in 0..shards {
            described.push($client.group_describe(t, n, s, shard, &g.group).await);
        }
        if described.iter().all(not_polled) {
            return Err(on_no_shard(g));
        }
        let mut infos = Vec::with_capacity(shards as usize);
        for (shard, d) in (0..shards).zip(described) {
            infos.push(if not_polled(&d) {
                output::ShardGroup::NotYet($client.describe_shard(t, n, s, shard).await?)
            } else {
                output::ShardGroup::Polled(d?)
            });
        }
        group_shards(g, infos)
    }};
}

/// Run a client command. `--broker` may list several brokers of a cluster
/// (`A,B,C`): a stream is then created or deleted on each; any other
/// command goes to the first that can be reached, and a `not_leader`
/// answer is followed to the broker it names, or, naming none (an
/// election), asked again for up to [`ELECTION_WAIT`]. A publish follows
/// `not_leader` itself, batch by batch (the [`mod@publish`] module), since the lines it
/// read from stdin cannot be read again.
pub async fn run(global: &GlobalArgs, command: Command) -> Result<(), CliError> {
    // Each broker once: `stream create` counts the brokers holding a stream.
    let mut seen = std::collections::HashSet::new();
    let brokers: Vec<String> = global
        .broker
        .split(',')
        .map(str::trim)
        .filter(|b| !b.is_empty() && seen.insert(*b))
        .map(str::to_string)
        .collect();
    if brokers.is_empty() {
        return Err(CliError::Usage("--broker names no broker".into()));
    }
    let on = |broker: &str| for_broker(global, broker);
    if brokers.len() > 1 && through_cluster(&command) {
        return on_cluster(global, &brokers, command).await;
    }
    if let Command::Stream(create @ StreamCmd::Create { stream, .. }) = &command {
        // On a cluster, on every broker of it, however many were named.
        if let Some(members) = cluster_members(global, &brokers).await? {
            let named: std::collections::BTreeSet<&String> = brokers.iter().collect();
            if members.iter().collect::<std::collections::BTreeSet<_>>() != named {
                eprintln!(
                    "felix: the cluster has {} brokers ({}): creating {stream} on each",
                    members.len(),
                    members.join(", ")
                );
            }
            return create_everywhere(global, &members, create.clone()).await;
        }
        if brokers.len() > 1 {
            return create_everywhere(global, &brokers, create.clone()).await;
        }
    }
    if let (true, Command::Stream(StreamCmd::Delete { stream })) = (brokers.len() > 1, &command) {
        return delete_everywhere(global, &brokers, stream).await;
    }
    let rerunnable = !matches!(&command, Command::Publish(p) if p.messages.is_empty());
    let mut target = 0;
    let mut follows = 0;
    let mut current = brokers[0].clone();
    let mut patience = Patience::default();
    let mut said_waiting = false;
    loop {
        // Only an error before the command did anything (`Client`, not
        // `Partial`) runs it again.
        match run_on(&on(&current), &brokers, command.clone()).await {
            // No leader known (an election, just after a start or a
            // failover): ask again, the next broker listed first, for a
            // while. Nothing was applied.
            Err(CliError::Client(ClientError::NotLeader { leader: None, .. }))
                if rerunnable && patience.lasts() =>
            {
                if !said_waiting {
                    eprintln!(
                        "felix: no leader of that shard is known yet (an election?); waiting"
                    );
                    said_waiting = true;
                }
                patience.pause().await;
                target = (target + 1) % brokers.len();
                current = brokers[target].clone();
            }
            // Brokers naming a leader that has just died, or each other,
            // until an election settles: followed, backing off after the
            // first few.
            Err(CliError::Client(ClientError::NotLeader {
                leader: Some(leader),
                ..
            })) if rerunnable && leader != current && (follows < 3 || patience.lasts()) => {
                eprintln!("felix: {current} does not lead that shard; asking the leader, {leader}");
                follows += 1;
                if follows > 3 {
                    patience.pause().await;
                }
                current = leader;
            }
            // Not reached (nothing was sent): the next broker listed. On a
            // cluster, round the list again for as long as an election may
            // take: the broker reached may have named a leader that has
            // just died.
            Err(CliError::Client(ClientError::Io(e)))
                if target + 1 < brokers.len()
                    || (rerunnable && brokers.len() > 1 && patience.lasts()) =>
            {
                eprintln!("felix: {current}: {e}; trying the next broker");
                if target + 1 >= brokers.len() {
                    patience.pause().await;
                }
                target = (target + 1) % brokers.len();
                current = brokers[target].clone();
            }
            other => return other,
        }
    }
}

/// `stream create` on several brokers (every broker of the cluster, each
/// named once): the same incarnation on each
/// (`felix_client::incarnation_to_create`), so the brokers that hold the
/// stream already (a majority: an earlier run cut short, a broker that was
/// down for it) are left as they are and the others join them. A broker
/// that cannot be reached is passed over and named at the end (exit 1):
/// run the command again once it is back. Nothing is created when fewer
/// than a majority answer, or when whether the holders are a majority
/// turns on the brokers that did not.
async fn create_everywhere(
    global: &GlobalArgs,
    brokers: &[String],
    cmd: StreamCmd,
) -> Result<(), CliError> {
    let StreamCmd::Create {
        stream: s,
        shards,
        retention_bytes,
        retention_ms,
    } = cmd
    else {
        unreachable!("called for stream create");
    };
    let name = s.to_string();
    let mut held = Vec::new();
    let mut missing = Vec::new();
    let mut unreachable = Vec::new();
    for b in brokers {
        let described = match connect(&for_broker(global, b), false).await {
            Ok(client) => client
                .describe_stream(&s.tenant, &s.namespace, &s.stream)
                .await
                .map(|info| (client.clone(), Some(info)))
                .or_else(|e| match e.code() {
                    Some(felix_client::ErrorCode::NotFound) => Ok((client, None)),
                    _ => Err(CliError::Client(e)),
                }),
            Err(e) => Err(e),
        };
        match described {
            Ok((_, Some(info))) => held.push((b.clone(), info)),
            Ok((client, None)) => missing.push((b.clone(), client)),
            Err(CliError::Client(e)) if unreached(&e) => {
                eprintln!("felix: {b}: {e}; passing it over");
                unreachable.push(format!("{b} ({e})"));
            }
            Err(e) => return Err(e),
        }
    }
    let total = brokers.len();
    felix_client::enough_answered(
        &name,
        total,
        held.len() + missing.len(),
        held.len(),
        &unreachable,
    )?;
    let incarnation = felix_client::incarnation_to_create(&name, shards, total, &held)?;
    for (b, client) in &missing {
        felix_client::keeps_incarnations(client, b, incarnation)?;
    }
    for (b, _) in &held {
        eprintln!("felix: {b} holds {name} already; left as it is");
    }
    let options = StreamOptions {
        retention_bytes,
        retention_ms,
        ..StreamOptions::default()
    };
    let mut text = String::new();
    for (b, client) in &missing {
        let made =
            felix_client::create_on_broker(client, b, &s, shards, options, incarnation).await;
        match made {
            Ok(Some(info)) => {
                text.push_str(&format!("on {b}:\n"));
                match with_shards(client, &info).await {
                    Ok(t) => text.push_str(&t),
                    Err(e) => {
                        print(&text)?;
                        return Err(e);
                    }
                }
            }
            Ok(None) => eprintln!("felix: {b} holds {name} already; left as it is"),
            Err(e) => {
                // What was made is said before why the rest was not.
                print(&text)?;
                return Err(e.into());
            }
        }
    }
    print(&text)?;
    if unreachable.is_empty() {
        return Ok(());
    }
    Err(CliError::Client(ClientError::Io(std::io::Error::other(
        format!(
            "{name} is not on {}: run the same command again once {} back",
            unreachable.join(", "),
            if unreachable.len() == 1 {
                "it is"
            } else {
                "they are"
            }
        ),
    ))))
}

/// The client addresses of every broker of the cluster, as the first of
/// `brokers` that answers names them (`describe_cluster`); `None` when it
/// is not in a cluster or too old to say. Brokers not reached are passed
/// over (said on stderr); the error of the last when none is.
async fn cluster_members(
    global: &GlobalArgs,
    brokers: &[String],
) -> Result<Option<Vec<String>>, CliError> {
    let mut last = None;
    for b in brokers {
        match connect(&for_broker(global, b), false).await {
            Ok(client) if client.has_feature(felix_client::FEATURE_CLUSTER_INFO) => {
                let info = client.describe_cluster().await?;
                return Ok(Some(info.members.into_iter().map(|m| m.addr).collect()));
            }
            Ok(_) => return Ok(None),
            Err(CliError::Client(e)) if unreached(&e) => {
                if Some(b) != brokers.last() {
                    eprintln!("felix: {b}: {e}; trying the next broker");
                }
                last = Some(CliError::Client(e));
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.expect("at least one broker"))
}

/// `global` with `--broker` naming `broker` alone.
fn for_broker(global: &GlobalArgs, broker: &str) -> GlobalArgs {
    GlobalArgs {
        broker: broker.to_string(),
        ..global.clone()
    }
}

/// An error that says the broker was not reached (or stopped answering):
/// passed over by the commands run on every broker.
fn unreached(e: &ClientError) -> bool {
    matches!(
        e,
        ClientError::Io(_) | ClientError::Timeout | ClientError::Disconnected
    )
}

/// `stream delete` on several brokers: deleted on each that holds it (one
/// that does not is said and passed over, so a delete cut short can be run
/// again). Every broker is tried; those that could not be reached, or
/// refused, are named at the end (exit 1). `not_found` when no broker held
/// it and every one answered.
async fn delete_everywhere(
    global: &GlobalArgs,
    brokers: &[String],
    s: &StreamRef,
) -> Result<(), CliError> {
    let name = s.to_string();
    let mut unreachable = Vec::new();
    let mut unsure = Vec::new();
    let mut failed = Vec::new();
    let mut deleted = 0;
    let mut text = String::new();
    for b in brokers {
        let done = match connect(&for_broker(global, b), false).await {
            Ok(client) => client
                .delete_stream(&s.tenant, &s.namespace, &s.stream)
                .await
                .map_err(|e| (true, CliError::Client(e))),
            Err(e) => Err((false, e)),
        };
        match done {
            Ok(()) => {
                deleted += 1;
                text.push_str(&format!("deleted {name} on {b}\n"));
            }
            Err((_, CliError::Client(e)))
                if e.code() == Some(felix_client::ErrorCode::NotFound) =>
            {
                eprintln!("felix: {b} does not hold {name}; nothing to delete there")
            }
            // Not reached: it still holds what it held.
            Err((false, CliError::Client(e))) if unreached(&e) => {
                eprintln!("felix: {b}: {e}; passing it over");
                unreachable.push(b.clone());
            }
            // Sent, and the answer lost: deleted or not.
            Err((true, CliError::Client(e))) if unreached(&e) => {
                eprintln!("felix: {b}: {e}");
                unsure.push(b.clone());
            }
            Err((_, CliError::Client(e))) => {
                failed.push(format!("{b}: {}: {}", e.kind(), e.message()))
            }
            Err((_, e)) => return Err(e),
        }
    }
    print(&text)?;
    let again: Vec<String> = unreachable.iter().chain(&unsure).cloned().collect();
    if again.is_empty() && failed.is_empty() {
        if deleted == 0 {
            return Err(CliError::Client(ClientError::Server {
                code: felix_client::ErrorCode::NotFound,
                message: format!("no stream {name} on any of the brokers"),
                not_applied: true,
            }));
        }
        return Ok(());
    }
    let mut why = Vec::new();
    if !again.is_empty() {
        why.push(format!(
            "{name} may still be on {}: once {} back, run `felix --broker {} stream delete \
             {name}` naming only {}: a delete naming every broker would also delete a \
             {name} created again meanwhile",
            again.join(", "),
            if again.len() == 1 {
                "it is"
            } else {
                "they are"
            },
            again.join(","),
            if again.len() == 1 {
                "that broker"
            } else {
                "those brokers"
            },
        ));
    }
    if !failed.is_empty() {
        why.push(format!("refused by {}", failed.join("; ")));
    }
    Err(CliError::Client(ClientError::Io(std::io::Error::other(
        why.join("; "),
    ))))
}

/// How long a command waits for a shard's leader to be elected before it
/// gives up (an election takes well under a second; a cluster without a
/// majority has none).
const ELECTION_WAIT: Duration = Duration::from_secs(10);

/// How long `run` keeps asking through a failover ([`ELECTION_WAIT`] from
/// the first answer that needs it) and how long it pauses between asks.
struct Patience {
    since: Option<std::time::Instant>,
    backoff: Duration,
}

impl Default for Patience {
    fn default() -> Self {
        Patience {
            since: None,
            backoff: Duration::from_millis(50),
        }
    }
}

impl Patience {
    /// Still within the wait (which starts at the first call).
    fn lasts(&mut self) -> bool {
        self.since
            .get_or_insert_with(std::time::Instant::now)
            .elapsed()
            < ELECTION_WAIT
    }

    /// Pause, twice as long each time up to half a second.
    async fn pause(&mut self) {
        tokio::time::sleep(self.backoff).await;
        self.backoff = (self.backoff * 2).min(Duration::from_millis(500));
    }
}

/// A command run through a [`ClusterClient`] when several brokers are
/// named: one that works on every shard of a stream (on a cluster its shards
/// can lead on different brokers), or one that keeps going (consuming, or
/// following a shard), which must follow the shard's leader from broker to
/// broker as it changes rather than stay with the broker it started on.
fn through_cluster(command: &Command) -> bool {
    match command {
        // Every broker's replica of the shard.
        Command::Shard(ShardCmd::Describe { .. }) => true,
        Command::Consume(_) => true,
        Command::Read(args) => args.follow,
        Command::Group(
            GroupCmd::Describe { all_shards, .. }
            | GroupCmd::Create { all_shards, .. }
            | GroupCmd::Seek { all_shards, .. }
            | GroupCmd::Delete { all_shards, .. },
        ) => *all_shards,
        _ => false,
    }
}

/// Run a command [`through_cluster`] picks on a cluster, through a
/// [`ClusterClient`]: each shard's part goes to the broker that leads it
/// now.
async fn on_cluster(
    global: &GlobalArgs,
    brokers: &[String],
    command: Command,
) -> Result<(), CliError> {
    let cluster = ClusterClient::connect(brokers, client_config(global, false)).await?;
    match command {
        Command::Consume(args) if !args.all_shards => {
            let consumer = Consumer::One {
                via: Via::Cluster(&cluster),
                target: &args.target,
                member: args
                    .member
                    .as_ref()
                    .map(|m| GroupMember::new(m.clone()).reclaim(true)),
            };
            consume_with(consumer, &args).await
        }
        Command::Read(args) => follow_on_cluster(&cluster, args).await,
        Command::Consume(args) => {
            let g = &args.target;
            let (t, n, s) = parts(&g.stream);
            let mut group = ShardedGroup::on_cluster(cluster, t, n, s, &g.group).await?;
            if let Some(m) = &args.member {
                group = group.member(GroupMember::new(m.clone()).reclaim(true))?;
            }
            let consumer = Consumer::All {
                group: Box::new(group),
                on_cluster: true,
            };
            consume_with(consumer, &args).await
        }
        Command::Group(GroupCmd::Describe { target: g, .. }) => {
            describe_every_shard!(cluster, &g)
        }
        Command::Group(GroupCmd::Create { target: g, to, .. }) => {
            let (t, n, s) = parts(&g.stream);
            cluster
                .group_create_stream(t, n, s, &g.group, to)
                .await
                .map_err(|e| offset_for_every_shard(e, to, &g))?;
            println(&created(&g, to, true))
        }
        Command::Group(GroupCmd::Seek { target: g, to, .. }) => {
            let (t, n, s) = parts(&g.stream);
            cluster
                .group_seek_stream(t, n, s, &g.group, to)
                .await
                .map_err(|e| offset_for_every_shard(e, to, &g))?;
            println(&moved(&g, to, true))
        }
        Command::Group(GroupCmd::Delete { target: g, .. }) => {
            let (t, n, s) = parts(&g.stream);
            cluster.group_delete_stream(t, n, s, &g.group).await?;
            println(&deleted(&g, true))
        }
        Command::Shard(ShardCmd::Describe { stream, shard }) => {
            describe_on_cluster(global, &cluster, &stream, shard).await
        }
        _ => unreachable!("only commands `through_cluster` picks come here"),
    }
}

/// Run `command` on the broker `global` names, one of `brokers` (every
/// broker `--broker` named: a publish refused as `not_leader` may go on at
/// another).
async fn run_on(global: &GlobalArgs, brokers: &[String], command: Command) -> Result<(), CliError> {
    let ack_on_commit = matches!(&command, Command::Publish(p) if p.ack_on_commit);
    let client = connect(global, ack_on_commit).await?;
    if let Some(stream) = &global.shard_left_out {
        let (t, n, s) = parts(stream);
        if let Ok(info) = client.describe_stream(t, n, s).await {
            if info.shards > 1 {
                eprintln!(
                    "felix: note: {stream} has {} shards; this is shard 0 (give --shard N for \
                     another{})",
                    info.shards,
                    if all_shards_taken(&command) {
                        ", or --all-shards"
                    } else {
                        ""
                    }
                );
            }
        }
    }
    match command {
        Command::Serve(_) => unreachable!("serve runs without a client"),
        Command::Stream(cmd) => stream(&client, cmd).await,
        Command::Shard(ShardCmd::Describe { stream, shard }) => {
            let (t, n, s) = parts(&stream);
            let info = client.describe_shard(t, n, s, shard).await?;
            let mut out = output::shard_details(&info);
            if client.has_feature(FEATURE_REPLICA_INFO) {
                // The shard as this broker has it is worth showing even
                // when its replica is not (a stream from before the
                // cluster, a replica being removed).
                match client.describe_replica(t, n, s, shard).await {
                    Ok(r) => out.push_str(&output::replica_details(&r)),
                    Err(e) => out.push_str(&format!("replica       none here: {e}\n")),
                }
            }
            print(&out)
        }
        Command::Publish(args) => publish(global, brokers, client, args).await,
        Command::Read(args) => read(&client, args).await,
        Command::Group(cmd) => group(&client, cmd).await,
        Command::Consume(args) => consume(&client, args).await,
        Command::Ping => ping(&client).await,
    }
}

/// Whether the command can run on every shard instead (`--all-shards`).
fn all_shards_taken(command: &Command) -> bool {
    matches!(
        command,
        Command::Consume(_)
            | Command::Group(
                GroupCmd::Describe { .. }
                    | GroupCmd::Create { .. }
                    | GroupCmd::Seek { .. }
                    | GroupCmd::Delete { .. }
            )
    )
}

fn client_config(global: &GlobalArgs, ack_on_commit: bool) -> ClientConfig {
    ClientConfig {
        client_name: concat!("felix-cli/", env!("CARGO_PKG_VERSION")).to_string(),
        connect_timeout: global.timeout.min(Duration::from_secs(10)),
        request_timeout: global.timeout,
        ack_on_commit,
        token: global.token.clone(),
        ..ClientConfig::default()
    }
}

async fn connect(global: &GlobalArgs, ack_on_commit: bool) -> Result<Client, CliError> {
    Ok(connect_client(global, ack_on_commit).await?)
}

/// [`connect`], its error the client's own.
async fn connect_client(global: &GlobalArgs, ack_on_commit: bool) -> Result<Client, ClientError> {
    let config = client_config(global, ack_on_commit);
    Client::connect(global.broker.as_str(), config)
        .await
        .map_err(|e| match e {
            ClientError::Io(io) => ClientError::Io(std::io::Error::new(
                io.kind(),
                format!("cannot connect to {}: {io}", global.broker),
            )),
            other => other,
        })
}

/// Write `text` to stdout as is.
fn print(text: &str) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(())
}

fn println(line: &str) -> Result<(), CliError> {
    print(&format!("{line}\n"))
}

async fn stream(client: &Client, cmd: StreamCmd) -> Result<(), CliError> {
    match cmd {
        StreamCmd::Create {
            stream: s,
            shards,
            retention_bytes,
            retention_ms,
        } => {
            if client.has_feature(FEATURE_STREAM_INCARNATION) {
                eprintln!(
                    "felix: this broker is in a cluster: create streams with every broker \
                     named (--broker A,B,C), so that they share one incarnation; this one \
                     is created here alone, without one"
                );
            }
            let info = client
                .create_stream(
                    &s.tenant,
                    &s.namespace,
                    &s.stream,
                    shards,
                    StreamOptions {
                        retention_bytes,
                        retention_ms,
                        ..StreamOptions::default()
                    },
                )
                .await?;
            print(&with_shards(client, &info).await?)
        }
        StreamCmd::List { tenant } => {
            let mut streams = client.list_streams(tenant.as_deref()).await?;
            streams.sort_by(|a, b| a.stream.cmp(&b.stream));
            let mut text = String::new();
            for s in &streams {
                text.push_str(&output::stream_line(s));
                text.push('\n');
            }
            print(&text)
        }
        StreamCmd::Describe { stream: s } => {
            let info = client
                .describe_stream(&s.tenant, &s.namespace, &s.stream)
                .await?;
            print(&with_shards(client, &info).await?)
        }
        StreamCmd::Delete { stream: s } => {
            client
                .delete_stream(&s.tenant, &s.namespace, &s.stream)
                .await?;
            println(&format!("deleted {s}"))
        }
    }
}

/// A stream's description followed by one row per shard (offsets, size,
/// whether it stopped, and on a cluster the leader this broker knows of),
/// one describe call per shard.
async fn with_shards(
    client: &Client,
    info: &felix_client::felix_wire::StreamInfo,
) -> Result<String, CliError> {
    let (t, n, s) = parts(&info.stream);
    let replicated = client.has_feature(FEATURE_REPLICA_INFO);
    let mut shards = Vec::with_capacity(info.shards as usize);
    let mut leaders = Vec::new();
    for shard in 0..info.shards {
        // A shard that cannot serve (it failed to open, its disk is gone)
        // is a row saying why, not the end of the description.
        shards.push(match client.describe_shard(t, n, s, shard).await {
            Ok(i) => output::ShardRow::Described(i),
            Err(e) if e.code() == Some(felix_client::ErrorCode::Unavailable) => {
                output::ShardRow::Refused {
                    shard,
                    core: info.placement.get(shard as usize).copied(),
                    why: e.to_string(),
                }
            }
            Err(e) => return Err(e.into()),
        });
        if replicated {
            leaders.push(match client.describe_replica(t, n, s, shard).await {
                Ok(r) => output::leader(&r),
                Err(e) => format!("unknown ({e})"),
            });
        }
    }
    Ok(format!(
        "{}\n{}",
        output::stream_details(info),
        output::shard_table(&shards, replicated.then_some(leaders.as_slice()))
    ))
}

/// `shard describe` on several brokers: the shard as its leader (or,
/// without one, the first broker that answers) has it, then every
/// broker's replica of it.
async fn describe_on_cluster(
    global: &GlobalArgs,
    cluster: &ClusterClient,
    stream: &StreamRef,
    shard: u32,
) -> Result<(), CliError> {
    let (t, n, s) = parts(stream);
    let answers = cluster.describe_replicas(t, n, s, shard).await;
    // The leader the answers named (the cluster client keeps the newest
    // term's), or any broker that answered.
    let leader = cluster.leader_of(t, n, s, shard).or_else(|| {
        answers
            .iter()
            .find(|(_, r)| r.is_ok())
            .map(|(b, _)| b.clone())
    });
    let Some(broker) = leader else {
        // Nobody answered: the first broker's error says why.
        let (_, first) = answers.into_iter().next().expect("--broker names one");
        return Err(first.expect_err("no broker answered").into());
    };
    let client = Client::connect(&broker, client_config(global, false)).await?;
    let info = client.describe_shard(t, n, s, shard).await?;
    let table: Vec<(String, output::ReplicaAnswer)> = answers
        .into_iter()
        .map(|(b, r)| {
            let r = r.map_err(|e| {
                let what = match e {
                    ClientError::Io(_) | ClientError::Timeout | ClientError::Disconnected => {
                        "unreachable"
                    }
                    _ => "refused",
                };
                (what, e.to_string())
            });
            (b, r)
        })
        .collect();
    print(&format!(
        "{}\n{}",
        output::shard_details(&info),
        output::replica_table(&table)
    ))
}

// ----- publish ------------------------------------------------------------

/// Printed records whose ack failed, in words: what they are, the verb
/// for them and that they come again ("1 printed record", "was", "it may
/// be delivered again"; "2 printed records", "were", "they may ...").
fn unacked(n: usize) -> (String, &'static str, &'static str) {
    if n == 1 {
        (
            "1 printed record".into(),
            "was",
            "it may be delivered again",
        )
    } else {
        (
            format!("{n} printed records"),
            "were",
            "they may be delivered again",
        )
    }
}

/// "1 record", "2 records".
fn records(n: u64) -> String {
    if n == 1 {
        "1 record".to_string()
    } else {
        format!("{n} records")
    }
}

// ----- read ---------------------------------------------------------------

fn is_transient(e: &ClientError) -> bool {
    matches!(
        e,
        ClientError::Io(_) | ClientError::Timeout | ClientError::Disconnected
    ) || refused_while_stopping(e)
}

/// A stopping broker refuses what it reads with `unavailable`, saying it
/// did nothing: it is on its way down, and back after a restart. (A shard
/// stopped by a disk fault is `unavailable` too, but not refused this way:
/// that is reported, not waited out.)
fn refused_while_stopping(e: &ClientError) -> bool {
    e.code() == Some(felix_client::ErrorCode::Unavailable) && e.not_applied()
}

/// What a command that keeps going on a cluster waits out: a broker that
/// cannot be reached, and a shard between leaders (no leader known, or one
/// named that has since lost it, or a write the old leader could not
/// commit), which the cluster client rides out for a while before it gives
/// up and says so.
fn is_transient_on_cluster(e: &ClientError) -> bool {
    is_transient(e)
        || matches!(e, ClientError::NotLeader { .. })
        || e.code() == Some(felix_client::ErrorCode::Unavailable)
}

/// `felix read --follow` on a cluster: long-polling reads through the
/// cluster client, which sends each to a broker holding the shard and moves
/// on when that one cannot be reached. Each read starts where the last one
/// ended, so a retry neither skips nor repeats a record.
async fn follow_on_cluster(cluster: &ClusterClient, args: ReadArgs) -> Result<(), CliError> {
    let s = &args.stream;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, stdout.lock());
    let limit = args.count.unwrap_or(u64::MAX);
    let mut n = 0u64;
    let mut from = args.from;
    // Set once `from` is an offset an answer gave.
    let mut pinned = false;
    let mut failing = false;
    // Since when every read has been refused as past the tail.
    let mut behind_since: Option<std::time::Instant> = None;
    // Read from the leader, whose log is never behind (any replica serves a
    // read, but a follower catching up, or cut off from the others, would
    // be): asking every broker which leads makes the cluster client send
    // the reads there first. Asked again after an error and after a read
    // that found nothing (the leader may have changed meanwhile); a broker
    // that does not answer holds it up for at most LEADER_ASK.
    let find_leader = || async {
        let ask = cluster.describe_replicas(&s.tenant, &s.namespace, &s.stream, args.shard);
        let _ = tokio::time::timeout(LEADER_ASK, ask).await;
    };
    find_leader().await;
    while n < limit {
        let want = (limit - n).min(500) as u32;
        let read = cluster
            .read(
                &s.tenant,
                &s.namespace,
                &s.stream,
                args.shard,
                from,
                want,
                Some(FOLLOW_WAIT),
            )
            .await;
        match read {
            Ok(b) => {
                if failing {
                    eprintln!("felix: reading again");
                    failing = false;
                }
                behind_since = None;
                for r in &b.records {
                    output::write_record(&mut out, args.format, r)?;
                    n += 1;
                }
                out.flush()?;
                // Pinned after the first answer: `latest` means the tail
                // when the command started, not at each retry.
                from = StartPosition::Offset(b.next_offset);
                pinned = true;
                if b.records.is_empty() {
                    find_leader().await;
                }
            }
            // A replica behind the offset the last read reached (one that
            // is catching up) refuses it as past its tail: ask again, of the
            // leader as it is now.
            // (For a while: a log that stays behind the offset read, such
            // as a stream deleted and made again, is an error.)
            Err(e)
                if is_transient_on_cluster(&e)
                    || (pinned
                        && e.code() == Some(felix_client::ErrorCode::InvalidRequest)
                        && behind_since
                            .get_or_insert_with(std::time::Instant::now)
                            .elapsed()
                            < BEHIND_PATIENCE) =>
            {
                if !failing {
                    eprintln!("felix: {e}; retrying");
                    failing = true;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
                find_leader().await;
            }
            Err(e) if n > 0 => return Err(CliError::Partial(e)),
            Err(e) => return Err(e.into()),
        }
    }
    out.flush()?;
    Ok(())
}

/// How long each read of `felix read --follow` on a cluster waits at the
/// tail.
const FOLLOW_WAIT: Duration = Duration::from_secs(10);

/// How long `felix read --follow` on a cluster waits for the brokers to say
/// which leads the shard.
const LEADER_ASK: Duration = Duration::from_secs(2);

/// How long `felix read --follow` on a cluster keeps asking for an offset
/// the shard's logs call past their tail, before it gives up.
const BEHIND_PATIENCE: Duration = Duration::from_secs(60);

async fn read(client: &Client, args: ReadArgs) -> Result<(), CliError> {
    let s = &args.stream;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, stdout.lock());
    let limit = args.count.unwrap_or(u64::MAX);
    let mut n = 0u64;
    if args.follow {
        let mut sub = client.subscribe(&s.tenant, &s.namespace, &s.stream, args.shard, args.from);
        // Said once per outage, not once per retry.
        let mut failing = false;
        while n < limit {
            // Print what is already fetched without flushing; flush before
            // waiting for more.
            let next = match poll_once(sub.next()).await {
                Some(r) => r,
                None => {
                    out.flush()?;
                    sub.next().await
                }
            };
            match next {
                Some(Ok(r)) => {
                    if std::mem::take(&mut failing) {
                        eprintln!("felix: reading again");
                    }
                    output::write_record(&mut out, args.format, &r)?;
                    n += 1;
                }
                Some(Err(e)) if is_transient(&e) => {
                    if !std::mem::replace(&mut failing, true) {
                        eprintln!("felix: {e}; retrying");
                    }
                }
                Some(Err(e)) => return Err(e.into()),
                None => break,
            }
        }
    } else {
        let mut from = args.from;
        // Stop at the tail as it was when the read began.
        let mut stop_at = None;
        'batches: while n < limit {
            let want = (limit - n).min(1000) as u32;
            let b = client
                .read(
                    &s.tenant,
                    &s.namespace,
                    &s.stream,
                    args.shard,
                    from,
                    want,
                    None,
                )
                .await?;
            let end = *stop_at.get_or_insert(b.end_offset);
            for r in &b.records {
                if r.offset >= end || n >= limit {
                    break 'batches;
                }
                output::write_record(&mut out, args.format, r)?;
                n += 1;
            }
            if b.records.is_empty() || b.next_offset >= end {
                break;
            }
            from = StartPosition::Offset(b.next_offset);
        }
    }
    out.flush()?;
    Ok(())
}

// ----- groups -------------------------------------------------------------

/// The client refuses an offset for every shard of a stream of several
/// (offsets are per shard): say so in the CLI's own words.
fn offset_for_every_shard(e: ClientError, to: StartPosition, g: &GroupTarget) -> CliError {
    match (&e, to) {
        (ClientError::InvalidArgument(_), StartPosition::Offset(o)) => CliError::Usage(format!(
            "{} has several shards and offset {o} names a position in one of them: with \
             --all-shards use --to earliest or --to latest, or give --shard N for the one shard",
            g.stream
        )),
        _ => e.into(),
    }
}

/// "shard N", or "every shard" for an --all-shards call.
fn shards_named(g: &GroupTarget, all_shards: bool) -> String {
    if all_shards {
        "every shard".to_string()
    } else {
        format!("shard {}", g.shard)
    }
}

/// Whether a shard's group describe found no group there (not polled
/// yet); any other failure ends the command.
fn not_polled(described: &Result<GroupInfo, ClientError>) -> bool {
    matches!(described, Err(e) if e.code() == Some(felix_client::ErrorCode::NotFound))
}

/// `group describe --all-shards` found the group on no shard.
fn on_no_shard(g: &GroupTarget) -> CliError {
    CliError::from(ClientError::Server {
        code: felix_client::ErrorCode::NotFound,
        message: format!(
            "group {} does not exist on any shard of {}",
            g.group, g.stream
        ),
        not_applied: true,
    })
}

/// Print a group's state on every shard. A group comes into being shard by
/// shard (on its first poll there): a shard without it shows `-` but for
/// its end and its lag (everything it holds), and says so on stderr.
fn group_shards(g: &GroupTarget, shards: Vec<output::ShardGroup>) -> Result<(), CliError> {
    let not_yet: Vec<String> = shards
        .iter()
        .enumerate()
        .filter(|(_, s)| matches!(s, output::ShardGroup::NotYet(_)))
        .map(|(shard, _)| shard.to_string())
        .collect();
    print(&output::group_shards_table(&shards))?;
    if !not_yet.is_empty() {
        eprintln!(
            "felix: group {} has not polled shard(s) {} yet: its first poll there starts at the \
             shard's start, so the lag shown is every record the shard holds",
            g.group,
            not_yet.join(", ")
        );
    }
    Ok(())
}

fn created(g: &GroupTarget, to: StartPosition, all_shards: bool) -> String {
    format!(
        "group {} on {} {}: created at {to}, unless it existed (an existing group is left where it was: `group seek` moves it)",
        g.group,
        g.stream,
        shards_named(g, all_shards)
    )
}

fn moved(g: &GroupTarget, to: StartPosition, all_shards: bool) -> String {
    format!(
        "group {} on {} {}: moved to {to}",
        g.group,
        g.stream,
        shards_named(g, all_shards)
    )
}

fn deleted(g: &GroupTarget, all_shards: bool) -> String {
    format!(
        "group {} on {} {}: deleted",
        g.group,
        g.stream,
        shards_named(g, all_shards)
    )
}

async fn group(client: &Client, cmd: GroupCmd) -> Result<(), CliError> {
    match cmd {
        GroupCmd::Describe {
            target: g,
            all_shards,
        } => {
            if all_shards {
                return describe_every_shard!(client, &g);
            }
            let (t, n, s) = parts(&g.stream);
            let info = client.group_describe(t, n, s, g.shard, &g.group).await?;
            print(&output::group_details(&info))
        }
        GroupCmd::Create {
            target: g,
            to,
            all_shards,
        } => {
            let (t, n, s) = parts(&g.stream);
            if all_shards {
                client
                    .group_create_stream(t, n, s, &g.group, to)
                    .await
                    .map_err(|e| offset_for_every_shard(e, to, &g))?;
            } else {
                client.group_create(t, n, s, g.shard, &g.group, to).await?;
            }
            println(&created(&g, to, all_shards))
        }
        GroupCmd::Seek {
            target: g,
            to,
            all_shards,
        } => {
            let (t, n, s) = parts(&g.stream);
            if all_shards {
                client
                    .group_seek_stream(t, n, s, &g.group, to)
                    .await
                    .map_err(|e| offset_for_every_shard(e, to, &g))?;
            } else {
                client.group_seek(t, n, s, g.shard, &g.group, to).await?;
            }
            println(&moved(&g, to, all_shards))
        }
        GroupCmd::Delete {
            target: g,
            all_shards,
        } => {
            let (t, n, s) = parts(&g.stream);
            if all_shards {
                client.group_delete_stream(t, n, s, &g.group).await?;
            } else {
                client.group_delete(t, n, s, g.shard, &g.group).await?;
            }
            println(&deleted(&g, all_shards))
        }
        GroupCmd::List { stream, shard } => {
            let (t, n, s) = parts(&stream);
            let mut names = client.list_groups(t, n, s, shard).await?;
            names.sort();
            let mut text = String::new();
            for name in names {
                text.push_str(&name);
                text.push('\n');
            }
            print(&text)
        }
        GroupCmd::DeadLetters {
            target: g,
            format,
            from,
            limit,
        } => dead_letters(client, &g, format, from, limit).await,
        GroupCmd::Redrive {
            target: g,
            offset,
            all,
        } => settle_dead_letters(client, &g, offset, all, true).await,
        GroupCmd::Discard {
            target: g,
            offset,
            all,
        } => settle_dead_letters(client, &g, offset, all, false).await,
    }
}

/// Print a group's dead letters from offset `from`, at most `limit` of them,
/// a page at a time as they come (the whole list in one answer from a
/// broker without pages).
async fn dead_letters(
    client: &Client,
    g: &GroupTarget,
    format: Format,
    from: u64,
    limit: Option<u64>,
) -> Result<(), CliError> {
    let (t, n, s) = parts(&g.stream);
    let mut left = limit.unwrap_or(u64::MAX);
    let lines = |letters: &[felix_client::DeadLetterInfo]| {
        let mut text = String::new();
        for d in letters {
            text.push_str(&output::dead_letter_line(d, format));
            text.push('\n');
        }
        text
    };
    if !client.has_feature(FEATURE_GROUP_DEAD_LETTER_PAGES) {
        let mut v = client
            .group_dead_letters_detailed(t, n, s, g.shard, &g.group)
            .await?;
        v.retain(|d| d.offset >= from);
        v.truncate(usize::try_from(left).unwrap_or(usize::MAX));
        if v.is_empty() {
            say_none_listed(from, limit);
        }
        return print(&lines(&v));
    }
    let mut page_from = from;
    let mut listed = 0u64;
    while left > 0 {
        let max = u32::try_from(left).unwrap_or(u32::MAX);
        let mut page = client
            .group_dead_letters_page(t, n, s, g.shard, &g.group, page_from, max)
            .await?;
        page.letters
            .truncate(usize::try_from(left).unwrap_or(usize::MAX));
        left -= page.letters.len() as u64;
        listed += page.letters.len() as u64;
        print(&lines(&page.letters))?;
        match page.next {
            Some(next) if next > page_from => page_from = next,
            Some(next) => {
                return Err(CliError::Client(ClientError::Protocol(format!(
                    "broker answered a dead-letter page from {page_from} with next {next}"
                ))))
            }
            None => break,
        }
    }
    if listed == 0 {
        say_none_listed(from, limit);
    }
    Ok(())
}

/// Say on stderr (stdout stays one line per dead letter for scripts) that
/// a dead-letter listing found none: none at all, or none in the window
/// asked for. A limit of 0 asked for none, and gets no remark.
fn say_none_listed(from: u64, limit: Option<u64>) {
    match (from, limit) {
        (_, Some(0)) => {}
        (0, _) => eprintln!("no dead letters"),
        (from, _) => eprintln!("no dead letters at offset {from} or above"),
    }
}

fn parts(s: &StreamRef) -> (&str, &str, &str) {
    (&s.tenant, &s.namespace, &s.stream)
}

/// Redrive (or discard) one dead letter, or all of them.
async fn settle_dead_letters(
    client: &Client,
    g: &GroupTarget,
    offset: Option<u64>,
    all: bool,
    redrive: bool,
) -> Result<(), CliError> {
    let (t, n, s) = parts(&g.stream);
    let offsets = match (offset, all) {
        (Some(o), false) => vec![o],
        (None, true) => {
            client
                .group_dead_letters(t, n, s, g.shard, &g.group)
                .await?
        }
        _ => return Err(CliError::Usage("give either --offset or --all".to_string())),
    };
    for &o in &offsets {
        if redrive {
            client.group_redrive(t, n, s, g.shard, &g.group, o).await?;
        } else {
            client.group_discard(t, n, s, g.shard, &g.group, o).await?;
        }
    }
    let verb = if redrive { "redrove" } else { "discarded" };
    println(&format!(
        "{verb} {} dead letter{}",
        offsets.len(),
        if offsets.len() == 1 { "" } else { "s" }
    ))
}

async fn consume(client: &Client, args: ConsumeArgs) -> Result<(), CliError> {
    let g = &args.target;
    let member = args
        .member
        .as_ref()
        .map(|m| GroupMember::new(m.clone()).reclaim(true));
    let consumer = if args.all_shards {
        let (t, n, s) = parts(&g.stream);
        let mut group = ShardedGroup::new(client.clone(), t, n, s, &g.group).await?;
        if let Some(m) = member {
            group = group.member(m)?;
        }
        Consumer::All {
            group: Box::new(group),
            on_cluster: false,
        }
    } else {
        Consumer::One {
            via: Via::Broker(client),
            target: g,
            member,
        }
    };
    consume_with(consumer, &args).await
}

/// Poll, print and acknowledge until done; then hand back what was
/// claimed ahead, and say how many records were consumed.
async fn consume_with(mut consumer: Consumer<'_>, args: &ConsumeArgs) -> Result<(), CliError> {
    let mut done = 0u64;
    let result = consume_records(&mut consumer, args, &mut done, stop_on_signal()).await;
    // Records claimed ahead go back to the group; if that fails they lapse
    // back after their visibility timeout, so it only earns a warning.
    if let Err(e) = consumer.finish().await {
        eprintln!("felix: handing back records claimed ahead: {e}; they return to the group when their claims lapse");
    }
    match result {
        Ok(()) => {
            eprintln!("consumed {}", records(done));
            Ok(())
        }
        Err(e) if done > 0 => {
            eprintln!("consumed {} before the error", records(done));
            Err(match e {
                CliError::Client(c) => CliError::Partial(c),
                other => other,
            })
        }
        Err(e) => Err(e),
    }
}

/// What `felix consume` polls: one shard's group, or the group on every
/// shard of the stream.
enum Consumer<'a> {
    One {
        via: Via<'a>,
        target: &'a GroupTarget,
        member: Option<GroupMember>,
    },
    /// `on_cluster`: its shards' calls go to their leaders through a
    /// cluster client, which a follower waits through failovers with.
    All {
        group: Box<ShardedGroup>,
        on_cluster: bool,
    },
}

/// Where one shard's group calls go: the one broker named, or, on a
/// cluster, the shard's leader wherever it is now.
#[derive(Clone, Copy)]
enum Via<'a> {
    Broker(&'a Client),
    Cluster(&'a ClusterClient),
}

impl Consumer<'_> {
    async fn poll(&mut self, want: u32, wait: Duration) -> Result<Vec<ShardedRecord>, ClientError> {
        match self {
            Consumer::One {
                via,
                target: g,
                member,
            } => {
                let (t, n, s) = parts(&g.stream);
                let (shard, group) = (g.shard, g.group.as_str());
                let records = match (member, *via) {
                    (Some(m), via) => {
                        let options = GroupPollOptions {
                            max_records: want,
                            wait,
                            visibility: None,
                        };
                        match via {
                            Via::Broker(c) => {
                                c.group_poll_as(t, n, s, shard, group, m, options).await?
                            }
                            Via::Cluster(c) => {
                                c.group_poll_as(t, n, s, shard, group, m, options).await?
                            }
                        }
                    }
                    (None, Via::Broker(c)) => {
                        c.group_poll_wait(t, n, s, shard, group, want, wait).await?
                    }
                    (None, Via::Cluster(c)) => {
                        c.group_poll_wait(t, n, s, shard, group, want, wait).await?
                    }
                };
                Ok(records
                    .into_iter()
                    .map(|record| ShardedRecord { shard, record })
                    .collect())
            }
            Consumer::All { group, .. } => group.poll(want, wait).await,
        }
    }

    async fn ack_many(&self, records: &[ShardedRecord]) -> Result<(), ClientError> {
        match self {
            Consumer::One { via, target: g, .. } => {
                let (t, n, s) = parts(&g.stream);
                let offsets: Vec<u64> = records.iter().map(|r| r.record.offset).collect();
                match via {
                    Via::Broker(c) => c.group_ack_many(t, n, s, g.shard, &g.group, &offsets).await,
                    Via::Cluster(c) => c.group_ack_many(t, n, s, g.shard, &g.group, &offsets).await,
                }
            }
            Consumer::All { group, .. } => group.ack_many(records).await,
        }
    }

    async fn nack(&self, r: &ShardedRecord) -> Result<(), ClientError> {
        match self {
            Consumer::One { via, target: g, .. } => {
                let (t, n, s) = parts(&g.stream);
                match via {
                    Via::Broker(c) => c.group_nack(t, n, s, g.shard, &g.group, &r.record).await,
                    Via::Cluster(c) => c.group_nack(t, n, s, g.shard, &g.group, &r.record).await,
                }
            }
            Consumer::All { group, .. } => group.nack(r).await,
        }
    }

    /// Whether `e` is worth waiting out when following: on a cluster, a
    /// shard between leaders too.
    fn transient(&self, e: &ClientError) -> bool {
        match self {
            Consumer::One {
                via: Via::Broker(_),
                ..
            } => is_transient(e),
            Consumer::One {
                via: Via::Cluster(_),
                ..
            } => is_transient_on_cluster(e),
            Consumer::All {
                on_cluster: false, ..
            } => is_transient(e),
            Consumer::All {
                on_cluster: true, ..
            } => is_transient_on_cluster(e),
        }
    }

    /// The shard to print beside each record (json), when there are several.
    fn shown_shard(&self, r: &ShardedRecord) -> Option<u32> {
        matches!(self, Consumer::All { .. }).then_some(r.shard)
    }

    /// Hand back whatever was claimed ahead and not printed.
    async fn finish(self) -> Result<(), ClientError> {
        match self {
            Consumer::One { .. } => Ok(()),
            Consumer::All { group, .. } => group.close().await,
        }
    }
}

/// Ctrl-C or SIGTERM asks `felix consume` to stop once the batch in hand is
/// printed and acknowledged (and what it claimed ahead is handed back); a
/// second one exits at once.
fn stop_on_signal() -> tokio::sync::watch::Receiver<bool> {
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut term) = signal(SignalKind::terminate()) else {
            return;
        };
        let mut asked = false;
        loop {
            tokio::select! {
                r = tokio::signal::ctrl_c() => if r.is_err() { return },
                _ = term.recv() => {}
            }
            if asked {
                std::process::exit(130);
            }
            asked = true;
            eprintln!("felix: stopping after this batch (again to exit at once)");
            let _ = tx.send(true);
        }
    });
    rx
}

async fn consume_records(
    consumer: &mut Consumer<'_>,
    args: &ConsumeArgs,
    done: &mut u64,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(), CliError> {
    let wait = Duration::from_millis(args.wait_ms);
    let limit = args.count.unwrap_or(u64::MAX);
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, stdout.lock());
    // Polls failing for a while (a broker restarting, an election).
    let mut failing = false;
    while *done < limit && !*stop.borrow() {
        let want = (limit - *done).min(u64::from(args.batch.max(1))) as u32;
        let asked = std::time::Instant::now();
        // A stop while polling drops the poll: what the every-shard
        // consumer's polls claim it keeps and hands back; a one-shard poll
        // the broker has not answered yet claims nothing once this process
        // exits and its connection closes.
        let polled = tokio::select! {
            r = consumer.poll(want, wait) => r,
            Ok(_) = stop.wait_for(|s| *s) => break,
        };
        let records = match polled {
            Ok(r) => {
                if failing {
                    eprintln!("felix: polling again");
                    failing = false;
                }
                r
            }
            Err(e) if args.follow && consumer.transient(&e) => {
                // Said once, not at every retry (an election can take
                // several seconds).
                if !failing {
                    eprintln!("felix: {e}; retrying");
                    failing = true;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        if records.is_empty() {
            if args.follow {
                // An empty answer before the wait was up (`--wait-ms 0`, or
                // the group at its in-flight cap): pause rather than ask
                // again at once.
                if asked.elapsed() < wait.max(EMPTY_POLL_PAUSE) {
                    tokio::time::sleep(EMPTY_POLL_PAUSE).await;
                }
                continue;
            }
            break;
        }
        // Records that could not be printed (stdout closed) are handed back
        // at once rather than left claimed until the visibility timeout.
        let printed = records
            .iter()
            .try_for_each(|r| {
                output::write_group_record(
                    &mut out,
                    args.format,
                    consumer.shown_shard(r),
                    &r.record,
                )
            })
            .and_then(|()| out.flush());
        if let Err(e) = printed {
            for r in &records {
                let _ = consumer.nack(r).await;
            }
            eprintln!(
                "felix: handed back {} records that could not be printed",
                records.len()
            );
            return Err(e.into());
        }
        let mut retried = false;
        loop {
            match consumer.ack_many(&records).await {
                Ok(()) => break,
                // The connection dropped under the ack: the claims may well
                // stand, so ack again once reconnected.
                Err(e) if args.follow && consumer.transient(&e) && !*stop.borrow() => {
                    eprintln!("felix: ack: {e}; retrying");
                    retried = true;
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                // Refused after a reconnect (the broker restarted, and its
                // claims with it, or they lapsed meanwhile): the records
                // come again.
                // Following, the same for a claim refused as stale without a
                // reconnect seen here: on a cluster the client may have
                // followed the shard to a new leader, which holds none of the
                // old one's claims; on one broker the claims may have lapsed
                // while the records were printed. (Anything else, such as a
                // group deleted meanwhile, ends the command.)
                Err(e)
                    if (retried
                        && matches!(
                            e.code(),
                            Some(
                                felix_client::ErrorCode::InvalidRequest
                                    | felix_client::ErrorCode::StaleClaim
                            )
                        ))
                        || (args.follow
                            && e.code() == Some(felix_client::ErrorCode::StaleClaim)) =>
                {
                    let (printed, _, again) = unacked(records.len());
                    let when = if retried {
                        "after a retry (if the first ack took effect after all, they were \
                         acknowledged)"
                    } else {
                        "as stale (a new leader, or claims that lapsed)"
                    };
                    eprintln!("felix: the ack of {printed} was refused {when} ({e}); {again}");
                    break;
                }
                Err(e) => {
                    let (printed, verb, again) = unacked(records.len());
                    eprintln!("felix: {printed} {verb} not acknowledged; {again}");
                    return Err(e.into());
                }
            }
        }
        *done += records.len() as u64;
    }
    out.flush()?;
    Ok(())
}

/// `felix consume --follow`'s pause after an empty poll that came back
/// before its wait was up.
const EMPTY_POLL_PAUSE: Duration = Duration::from_millis(100);

async fn ping(client: &Client) -> Result<(), CliError> {
    let rtt = client.ping().await?;
    let names = [
        (FEATURE_GROUPS, "groups"),
        (FEATURE_GROUP_SKIPPED, "group_skipped"),
        (FEATURE_GROUP_CLAIM_CONTROL, "group_claim_control"),
        (FEATURE_GROUP_ADMIN, "group_admin"),
        (FEATURE_PUBLISH_ACK_MODE, "publish_ack_mode"),
        (FEATURE_GROUP_DEAD_LETTER_PAGES, "group_dead_letter_pages"),
        (FEATURE_REPLICA_INFO, "replica_info"),
        (FEATURE_STREAM_INCARNATION, "stream_incarnation"),
        (FEATURE_CLUSTER_INFO, "cluster_info"),
        (FEATURE_ERROR_NOT_APPLIED, "error_not_applied"),
    ];
    let features: Vec<&str> = names
        .iter()
        .filter(|(bit, _)| client.has_feature(*bit))
        .map(|(_, n)| *n)
        .collect();
    println(&format!(
        "broker    {}\ncores     {}\nfeatures  {}\nrtt       {:.3} ms",
        client.broker(),
        client.cores(),
        if features.is_empty() {
            "none".to_string()
        } else {
            features.join(" ")
        },
        rtt.as_secs_f64() * 1000.0
    ))
}
