//! Metrics: plain `Cell` counters on each core, merged at scrape time (the
//! scrape is the one other use of cross-core messages, off the hot path) and
//! served as Prometheus text over HTTP by core 0.

use crate::broker::{Core, CoreMsg};
use felix_engine::group::{GroupCounters, GroupStatus};
use felix_engine::log::{SyncStats, SYNC_BUCKETS_US};
use felix_engine::storage::Storage;
use felix_wire::ErrorCode;
use futures_lite::{AsyncReadExt, AsyncWriteExt};
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::rc::Rc;
use std::time::Duration;

#[derive(Default)]
pub(crate) struct CoreMetrics {
    pub requests: RefCell<BTreeMap<&'static str, u64>>,
    pub errors: RefCell<BTreeMap<&'static str, u64>>,
    pub publish_records: Cell<u64>,
    pub publish_bytes: Cell<u64>,
    pub read_records: Cell<u64>,
    pub read_bytes: Cell<u64>,
    pub group_delivered: Cell<u64>,
    pub group_acked: Cell<u64>,
    pub group_polls_capped: Cell<u64>,
    pub connections_open: Cell<u64>,
    /// Group polls parked until records, room or their wait's end.
    pub group_polls_waiting: Cell<u64>,
    pub connections_accepted: Cell<u64>,
    pub connections_refused: Cell<u64>,
    /// Connections cut off by the write timeout: answers taken too slowly.
    pub connections_cut_off: Cell<u64>,
    /// Connections closed for a frame not finished within the write timeout.
    pub frame_timeouts: Cell<u64>,
    pub handoffs: Cell<u64>,
    /// Publish time in the broker, by what the acknowledgement waited for.
    pub publish_latency: RefCell<PublishLatency>,
}

/// Bucket bounds (µs) of `felix_publish_seconds`: finer than the fsync
/// histogram's around the milliseconds a durable acknowledgement takes.
pub(crate) const PUBLISH_BUCKETS_US: [u64; 14] = [
    100, 250, 500, 750, 1000, 1500, 2000, 3000, 5000, 10_000, 25_000, 100_000, 1_000_000,
    10_000_000,
];

/// A fixed-bucket latency histogram (cumulative counts are worked out when
/// it is rendered).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LatencyBuckets {
    pub count: u64,
    pub sum_us: u64,
    /// Count per bucket of [`PUBLISH_BUCKETS_US`]; the last slot is "over".
    pub buckets: [u64; PUBLISH_BUCKETS_US.len() + 1],
}

impl LatencyBuckets {
    pub fn record(&mut self, us: u64) {
        self.count += 1;
        self.sum_us = self.sum_us.saturating_add(us);
        let i = PUBLISH_BUCKETS_US.partition_point(|b| *b < us);
        self.buckets[i] += 1;
    }

    fn merge(&mut self, o: &LatencyBuckets) {
        self.count += o.count;
        self.sum_us = self.sum_us.saturating_add(o.sum_us);
        for (a, b) in self.buckets.iter_mut().zip(o.buckets.iter()) {
            *a += b;
        }
    }
}

/// What a publish's acknowledgement waited for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AckWait {
    /// The records' fdatasync.
    Durable,
    /// The records queued for the next flush (`FELIX_ACK_ON_COMMIT=0` or
    /// the publish's `ack: queued`).
    Queued,
    /// Commit by a majority of the shard's replicas (a cluster).
    Replicated,
}

impl AckWait {
    const ALL: [AckWait; 3] = [AckWait::Durable, AckWait::Queued, AckWait::Replicated];

    fn label(self) -> &'static str {
        match self {
            AckWait::Durable => "durable",
            AckWait::Queued => "queued",
            AckWait::Replicated => "replicated",
        }
    }
}

impl AckWait {
    /// What a publish with `ack` waits for on a broker that acknowledges on
    /// commit by default (`ack_on_commit`) or not, outside a cluster.
    pub fn of(ack: felix_wire::AckMode, ack_on_commit: bool) -> AckWait {
        use felix_wire::AckMode;
        match ack {
            AckMode::Queued => AckWait::Queued,
            AckMode::Durable => AckWait::Durable,
            AckMode::Default if ack_on_commit => AckWait::Durable,
            AckMode::Default => AckWait::Queued,
        }
    }
}

/// `felix_publish_seconds`, one histogram per [`AckWait`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PublishLatency([LatencyBuckets; 3]);

impl PublishLatency {
    pub fn record(&mut self, wait: AckWait, took: Duration) {
        // Rounded up, so that a bucket's bound is never below what it holds.
        let us = u64::try_from(took.as_nanos().div_ceil(1000)).unwrap_or(u64::MAX);
        self.0[wait as usize].record(us);
    }

    fn merge(&mut self, o: &PublishLatency) {
        for (a, b) in self.0.iter_mut().zip(o.0.iter()) {
            a.merge(b);
        }
    }

    fn render(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "# HELP felix_publish_seconds Time a successful publish spent in the broker, from its \
             request being decoded to its acknowledgement queued for the socket, by what the \
             acknowledgement waited for.\n\
             # TYPE felix_publish_seconds histogram"
        );
        for wait in AckWait::ALL {
            let h = &self.0[wait as usize];
            write_histogram(
                s,
                "felix_publish_seconds",
                &format!("ack=\"{}\"", wait.label()),
                &PUBLISH_BUCKETS_US,
                &h.buckets,
                h.count,
                h.sum_us,
            );
        }
    }
}

/// The sample lines of one histogram series: cumulative `_bucket`s (bounds
/// in µs, rendered in seconds), `+Inf`, `_sum` and `_count`. `labels` is
/// `k="v",...` or empty; `per_bucket` holds one count a bound.
fn write_histogram(
    s: &mut String,
    name: &str,
    labels: &str,
    bounds_us: &[u64],
    per_bucket: &[u64],
    count: u64,
    sum_us: u64,
) {
    let sep = if labels.is_empty() { "" } else { "," };
    let mut cum = 0;
    for (le, n) in bounds_us.iter().zip(per_bucket) {
        cum += n;
        let _ = writeln!(
            s,
            "{name}_bucket{{{labels}{sep}le=\"{}\"}} {cum}",
            *le as f64 / 1e6
        );
    }
    let _ = writeln!(s, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {count}");
    let braced = if labels.is_empty() {
        String::new()
    } else {
        format!("{{{labels}}}")
    };
    let _ = writeln!(s, "{name}_sum{braced} {}", sum_us as f64 / 1e6);
    let _ = writeln!(s, "{name}_count{braced} {count}");
}

impl CoreMetrics {
    pub fn count_request(&self, op: &'static str) {
        *self.requests.borrow_mut().entry(op).or_default() += 1;
    }
    pub fn count_error(&self, code: ErrorCode) {
        *self.errors.borrow_mut().entry(code.as_str()).or_default() += 1;
    }
    pub fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            requests: self
                .requests
                .borrow()
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect(),
            errors: self
                .errors
                .borrow()
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect(),
            counters: vec![
                ("felix_publish_records_total", "Records published, counted as each publish is acknowledged.", self.publish_records.get()),
                ("felix_publish_bytes_total", "Bytes of the records published: keys, header names and values, payloads.", self.publish_bytes.get()),
                ("felix_read_records_total", "Records returned by reads.", self.read_records.get()),
                ("felix_read_bytes_total", "Bytes of the records returned by reads: keys, header names and values, payloads.", self.read_bytes.get()),
                ("felix_group_records_delivered_total", "Records handed out by group polls, redeliveries included.", self.group_delivered.get()),
                ("felix_group_records_acked_total", "Records consumer groups acknowledged.", self.group_acked.get()),
                ("felix_group_polls_capped_total", "Group polls that could hand out nothing, with records waiting, because their group was at groups.max_in_flight (FELIX_GROUP_MAX_IN_FLIGHT) or their core at groups.max_claims_per_core; once a poll, even if it then waits and gets records.", self.group_polls_capped.get()),
                ("felix_connections_accepted_total", "Client connections accepted.", self.connections_accepted.get()),
                ("felix_connections_refused_total", "Client connections turned away (server.max_connections, or no file descriptors left).", self.connections_refused.get()),
                ("felix_connection_handoffs_total", "Connections handed to the core their HELLO asked for.", self.handoffs.get()),
                ("felix_connections_cut_off_total", "Connections closed because their client took less than 64 KiB of its waiting answers within server.write_timeout_ms (their answers dropped).", self.connections_cut_off.get()),
                ("felix_connections_frame_timeouts_total", "Connections closed because a frame their client began was not finished within server.write_timeout_ms.", self.frame_timeouts.get()),
            ],
            connections_open: self.connections_open.get(),
            publish_latency: *self.publish_latency.borrow(),
            group_polls_waiting: self.group_polls_waiting.get(),
            buffered: Vec::new(),
            shards: Vec::new(),
            groups: Vec::new(),
            groups_omitted: 0,
            max_groups: 0,
            retired: ShardSnapshot::default(),
            executor_wakeups: 0,
            security_reloads: (0, 0),
            process: Default::default(),
        }
    }
}

/// A shard's replica, in a cluster.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ReplicaSnapshot {
    pub term: u64,
    pub leads: bool,
    /// Raft entries held in memory, past the compaction point.
    pub log_entries: u64,
    /// The last entry compacted away (0: none yet).
    pub compacted: u64,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct ShardSnapshot {
    pub stream: String,
    pub shard: u32,
    pub start: u64,
    pub end: u64,
    pub bytes: u64,
    pub stopped: bool,
    /// The shard could not be opened: its offsets and size are unknown (not
    /// 0), so those series are left out for it.
    pub unopened: bool,
    /// In a cluster: the shard's replica.
    pub replica: Option<ReplicaSnapshot>,
    pub flushes: u64,
    pub bytes_written: u64,
    pub cold_reads: u64,
    pub cold_hits: u64,
    pub cold_read_ahead: u64,
    pub corrupt_reads: u64,
    pub sync: SyncStats,
}

impl ShardSnapshot {
    /// A log's I/O counters, with no shape (stream, offsets, size).
    pub fn io_of(st: &felix_engine::log::LogStats) -> ShardSnapshot {
        ShardSnapshot {
            flushes: st.flushes,
            bytes_written: st.bytes_written,
            cold_reads: st.cold_reads,
            cold_hits: st.cold_hits,
            cold_read_ahead: st.cold_read_ahead,
            corrupt_reads: st.corrupt_reads,
            sync: st.sync,
            ..ShardSnapshot::default()
        }
    }

    /// Add another snapshot's I/O counters to these.
    pub fn add_io(&mut self, o: &ShardSnapshot) {
        self.flushes += o.flushes;
        self.bytes_written += o.bytes_written;
        self.cold_reads += o.cold_reads;
        self.cold_hits += o.cold_hits;
        self.cold_read_ahead += o.cold_read_ahead;
        self.corrupt_reads += o.corrupt_reads;
        self.sync.merge(&o.sync);
    }
}

/// Where one consumer group stands on one shard (what `group_describe`
/// answers) and what it has done, for the per-group series: lag and the age
/// of the oldest unfinished work per shard, so that one stuck shard is not
/// hidden in a total.
#[derive(Clone, Debug)]
pub(crate) struct GroupSnapshot {
    pub stream: String,
    pub shard: u32,
    pub group: String,
    pub status: GroupStatus,
    /// Since the broker started (or the group was first used).
    pub counters: GroupCounters,
}

/// One metric family drawn from many values of `T`: its name, kind
/// (`gauge` or `counter`), help text, and how to read one value.
type Series<T, V> = (&'static str, &'static str, &'static str, fn(&T) -> V);

/// A core's buffered-bytes budget (`server.max_buffered_bytes_per_core`).
#[derive(Clone, Debug, Default)]
pub(crate) struct BufferedSnapshot {
    pub core: u32,
    pub bytes: u64,
    pub peak: u64,
    pub waits: u64,
    /// Bytes the core's shards keep for reads.
    pub read_cache: u64,
    /// Claims and delayed nacks the core's groups hold.
    pub claims: u64,
    /// Bytes let through past the budget: of frames arriving, of requests
    /// in flight.
    pub overdraft_frames: u64,
    pub overdraft_requests: u64,
    pub overdraft_answers: u64,
}

/// One core's numbers, `Send` so they can cross to the scraping core.
#[derive(Clone, Debug, Default)]
pub(crate) struct MetricsSnapshot {
    pub requests: BTreeMap<String, u64>,
    pub errors: BTreeMap<String, u64>,
    /// Name, help text and value of each plain counter.
    pub counters: Vec<(&'static str, &'static str, u64)>,
    pub connections_open: u64,
    pub publish_latency: PublishLatency,
    pub group_polls_waiting: u64,
    /// One entry per core (labelled, not summed).
    pub buffered: Vec<BufferedSnapshot>,
    pub shards: Vec<ShardSnapshot>,
    pub groups: Vec<GroupSnapshot>,
    /// Groups left out of `groups` (over `server.metrics_max_groups`).
    pub groups_omitted: u64,
    /// `server.metrics_max_groups`.
    pub max_groups: usize,
    /// I/O totals of deleted shards (counters only; no shape).
    pub retired: ShardSnapshot,
    /// Process-wide (not merged): executors the watchdog had to wake.
    pub executor_wakeups: u64,
    /// Process-wide: SIGHUP reloads of the security files that took, and
    /// that failed (the files in force kept).
    pub security_reloads: (u64, u64),
    /// Process-wide: the `process_*` families (CPU time, memory, files).
    pub process: crate::process::ProcessStats,
}

impl MetricsSnapshot {
    fn merge(&mut self, o: MetricsSnapshot) {
        for (k, v) in o.requests {
            *self.requests.entry(k).or_default() += v;
        }
        for (k, v) in o.errors {
            *self.errors.entry(k).or_default() += v;
        }
        if self.counters.is_empty() {
            self.counters = o.counters;
        } else {
            for (a, b) in self.counters.iter_mut().zip(o.counters) {
                a.2 += b.2;
            }
        }
        self.connections_open += o.connections_open;
        self.publish_latency.merge(&o.publish_latency);
        self.group_polls_waiting += o.group_polls_waiting;
        self.buffered.extend(o.buffered);
        self.shards.extend(o.shards);
        self.groups.extend(o.groups);
        self.groups_omitted += o.groups_omitted;
        self.max_groups = self.max_groups.max(o.max_groups);
        self.retired.add_io(&o.retired);
    }

    /// Prometheus text exposition format 0.0.4.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "# HELP felix_requests_total Requests handled, by operation.\n# TYPE felix_requests_total counter");
        for (op, n) in &self.requests {
            let _ = writeln!(s, "felix_requests_total{{op=\"{op}\"}} {n}");
        }
        let _ = writeln!(s, "# HELP felix_errors_total Error responses, by code.\n# TYPE felix_errors_total counter");
        for (code, n) in &self.errors {
            let _ = writeln!(s, "felix_errors_total{{code=\"{code}\"}} {n}");
        }
        for (name, help, v) in &self.counters {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        }
        let _ = writeln!(
            s,
            "# HELP felix_connections_open Client connections open.\n# TYPE felix_connections_open gauge\nfelix_connections_open {}",
            self.connections_open
        );
        self.publish_latency.render(&mut s);
        let _ = writeln!(
            s,
            "# HELP felix_group_polls_waiting Group polls parked until records arrive, room frees or their wait ends.\n# TYPE felix_group_polls_waiting gauge\nfelix_group_polls_waiting {}",
            self.group_polls_waiting
        );
        let mut cores = self.buffered.clone();
        cores.sort_by_key(|b| b.core);
        let per_core: [Series<BufferedSnapshot, u64>; 8] = [
            ("felix_core_buffered_bytes", "gauge", "Request and answer bytes a core's connections hold (server.max_buffered_bytes_per_core).", |b| b.bytes),
            ("felix_core_buffered_bytes_peak", "gauge", "The most felix_core_buffered_bytes has been since start.", |b| b.peak),
            ("felix_read_cache_bytes", "gauge", "Bytes a core's shards keep in memory for reads (storage.read_cache_bytes_per_core).", |b| b.read_cache),
            ("felix_core_overdraft_frame_bytes", "gauge", "Of felix_core_buffered_bytes, bytes of frames arriving let in while the core was at its budget (by connections holding nothing; at most about a quarter of the budget and one frame).", |b| b.overdraft_frames),
            ("felix_core_overdraft_request_bytes", "gauge", "Of felix_core_buffered_bytes, bytes of requests in flight let through while the core was at its budget (by connections holding nothing).", |b| b.overdraft_requests),
            ("felix_core_overdraft_answer_bytes", "gauge", "Of felix_core_buffered_bytes, bytes of answers let through while the core was at its budget (by connections holding nothing): the room reads, polls and lists took, then their answers until sent (at most about a quarter of the budget and one answer, then 512 KiB a connection).", |b| b.overdraft_answers),
            ("felix_core_buffered_waits_total", "counter", "Times a connection or a read waited for the core's buffered-bytes budget.", |b| b.waits),
            ("felix_core_group_claims", "gauge", "Claims and delayed nacks all groups of a core's shards hold (groups.max_claims_per_core).", |b| b.claims),
        ];
        for (name, kind, help, value) in per_core {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for b in &cores {
                let _ = writeln!(s, "{name}{{core=\"{}\"}} {}", b.core, value(b));
            }
        }
        let _ = writeln!(
            s,
            "# HELP felix_executor_wakeups_total Times the watchdog woke an executor that had stopped running its tasks.\n\
             # TYPE felix_executor_wakeups_total counter\n\
             felix_executor_wakeups_total {}",
            self.executor_wakeups
        );
        let _ = writeln!(
            s,
            "# HELP felix_security_reloads_total SIGHUP reloads of security.tokens_file and security.acl_file, by result (failed: the files in force were kept).\n\
             # TYPE felix_security_reloads_total counter\n\
             felix_security_reloads_total{{result=\"ok\"}} {}\n\
             felix_security_reloads_total{{result=\"failed\"}} {}",
            self.security_reloads.0, self.security_reloads.1
        );
        self.process.render(&mut s);
        // Counters start from the deleted shards' totals, so that deleting a
        // stream never makes them go backwards.
        let mut io = self.retired.clone();
        let _ = writeln!(s, "# HELP felix_shard_end_offset One past the last durable offset of a shard.\n# TYPE felix_shard_end_offset gauge");
        for sh in self.shards.iter().filter(|sh| !sh.unopened) {
            let _ = writeln!(
                s,
                "felix_shard_end_offset{{stream=\"{}\",shard=\"{}\"}} {}",
                sh.stream, sh.shard, sh.end
            );
        }
        let _ = writeln!(s, "# HELP felix_shard_start_offset The oldest offset a shard still holds (retention removes below it).\n# TYPE felix_shard_start_offset gauge");
        for sh in self.shards.iter().filter(|sh| !sh.unopened) {
            let _ = writeln!(
                s,
                "felix_shard_start_offset{{stream=\"{}\",shard=\"{}\"}} {}",
                sh.stream, sh.shard, sh.start
            );
        }
        let _ = writeln!(s, "# HELP felix_shard_bytes Bytes of a shard's log segments.\n# TYPE felix_shard_bytes gauge");
        for sh in self.shards.iter().filter(|sh| !sh.unopened) {
            let _ = writeln!(
                s,
                "felix_shard_bytes{{stream=\"{}\",shard=\"{}\"}} {}",
                sh.stream, sh.shard, sh.bytes
            );
        }
        let _ = writeln!(s, "# HELP felix_shard_stopped 1 where a shard stopped after an I/O failure (it refuses requests until a restart).\n# TYPE felix_shard_stopped gauge");
        for sh in &self.shards {
            let _ = writeln!(
                s,
                "felix_shard_stopped{{stream=\"{}\",shard=\"{}\"}} {}",
                sh.stream, sh.shard, sh.stopped as u8
            );
            io.add_io(sh);
        }
        if self.shards.iter().any(|sh| sh.replica.is_some()) {
            type Field = fn(&ReplicaSnapshot) -> u64;
            let series: [(&str, &str, Field); 4] = [
                (
                    "felix_replica_leader",
                    "1 where this broker leads the shard (in a cluster).",
                    |r| r.leads as u64,
                ),
                (
                    "felix_replica_term",
                    "The Raft term of this broker's replica of the shard.",
                    |r| r.term,
                ),
                (
                    "felix_replica_log_entries",
                    "Raft entries the shard's replica holds, past its compaction point.",
                    |r| r.log_entries,
                ),
                (
                    "felix_replica_compacted_index",
                    "The last Raft entry the shard's replica compacted away.",
                    |r| r.compacted,
                ),
            ];
            for (name, help, field) in series {
                let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} gauge");
                for sh in &self.shards {
                    if let Some(r) = &sh.replica {
                        let _ = writeln!(
                            s,
                            "{name}{{stream=\"{}\",shard=\"{}\"}} {}",
                            sh.stream,
                            sh.shard,
                            field(r)
                        );
                    }
                }
            }
        }
        self.render_groups(&mut s);
        let ShardSnapshot {
            flushes,
            bytes_written: written,
            cold_reads,
            cold_hits,
            cold_read_ahead,
            corrupt_reads,
            sync,
            ..
        } = io;
        let _ = writeln!(
            s,
            "# HELP felix_flushes_total Group-commit rounds (each a write and an fdatasync).\n# TYPE felix_flushes_total counter\nfelix_flushes_total {flushes}"
        );
        let _ = writeln!(s, "# HELP felix_disk_bytes_written_total Bytes written to log segments (zeros written ahead included).\n# TYPE felix_disk_bytes_written_total counter\nfelix_disk_bytes_written_total {written}");
        let _ = writeln!(
            s,
            "# HELP felix_cold_reads_total Reads below the in-memory tail, by where they were served from.\n\
             # TYPE felix_cold_reads_total counter\n\
             felix_cold_reads_total{{from=\"disk\"}} {cold_reads}\n\
             felix_cold_reads_total{{from=\"chunk\"}} {cold_hits}\n\
             # HELP felix_cold_read_ahead_total Chunks read from disk ahead of a reader moving forward through them.\n\
             # TYPE felix_cold_read_ahead_total counter\n\
             felix_cold_read_ahead_total {cold_read_ahead}\n\
             # HELP felix_read_damage_total Damaged batches reads met in segments (a checksum or place that is wrong), each failed at or passed on the way to later records; the broker's log names the file and byte.\n\
             # TYPE felix_read_damage_total counter\n\
             felix_read_damage_total {corrupt_reads}"
        );
        let _ = writeln!(
            s,
            "# HELP felix_fsync_seconds fdatasync latency.\n# TYPE felix_fsync_seconds histogram"
        );
        write_histogram(
            &mut s,
            "felix_fsync_seconds",
            "",
            &SYNC_BUCKETS_US,
            &sync.buckets,
            sync.count,
            sync.sum_us,
        );
        s
    }
}

impl MetricsSnapshot {
    /// The per-group gauges, one series per (stream, shard, group), in
    /// name order. Names need no escaping: stream and group names are
    /// `[A-Za-z0-9._-]` (checked before anything is written to a log).
    fn render_groups(&self, s: &mut String) {
        let mut groups: Vec<&GroupSnapshot> = self.groups.iter().collect();
        groups.sort_by(|a, b| (&a.stream, a.shard, &a.group).cmp(&(&b.stream, b.shard, &b.group)));
        // Each core kept at most the cap; together they may hold more.
        let omitted = self.groups_omitted + groups.len().saturating_sub(self.max_groups) as u64;
        groups.truncate(self.max_groups);
        let _ = writeln!(
            s,
            "# HELP felix_group_metrics_omitted Groups left out of the per-group gauges (server.metrics_max_groups).\n\
             # TYPE felix_group_metrics_omitted gauge\n\
             felix_group_metrics_omitted {omitted}"
        );
        let series: [Series<GroupSnapshot, String>; 12] = [
            ("felix_group_position", "gauge", "A group's saved position on a shard: every offset below it is finished.", |g| g.status.position.0.to_string()),
            ("felix_group_lag", "gauge", "Records a group has yet to finish: from its position (or the shard's start, if retention removed records above it) to the shard's durable end.", |g| g.status.lag().to_string()),
            ("felix_group_in_flight", "gauge", "Records a group has handed out and not settled (standing claims and delayed nacks).", |g| g.status.in_flight.to_string()),
            ("felix_group_delayed", "gauge", "Of a group's in-flight records, those handed back with a delay.", |g| g.status.delayed.to_string()),
            ("felix_group_owed", "gauge", "Records a group handed out before that wait for the next poll (lapsed claims, nacks, redrives).", |g| g.status.owed.to_string()),
            ("felix_group_dead_letters", "gauge", "Records a group has set aside as dead letters.", |g| g.status.dead_letters.to_string()),
            ("felix_group_oldest_in_flight_age_seconds", "gauge", "How long a group's oldest standing claim or delay has stood (0 with none).", |g| secs(g.status.oldest_in_flight_age_ms)),
            ("felix_group_oldest_owed_age_seconds", "gauge", "How long a group's oldest owed record has waited for a poll (0 with none).", |g| secs(g.status.oldest_owed_age_ms)),
            ("felix_group_delivered_records_total", "counter", "Records a group handed out, redeliveries included, since the broker started.", |g| g.counters.delivered.to_string()),
            ("felix_group_redelivered_records_total", "counter", "Records a group handed out again (attempt 2 or later) since the broker started.", |g| g.counters.redelivered.to_string()),
            ("felix_group_acked_records_total", "counter", "Records a group finished by an ack since the broker started.", |g| g.counters.acked.to_string()),
            ("felix_group_dead_lettered_records_total", "counter", "Records a group set aside as dead letters since the broker started.", |g| g.counters.dead_lettered.to_string()),
        ];
        for (name, kind, help, value) in series {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for g in &groups {
                let _ = writeln!(
                    s,
                    "{name}{{stream=\"{}\",shard=\"{}\",group=\"{}\"}} {}",
                    g.stream,
                    g.shard,
                    g.group,
                    value(g)
                );
            }
        }
    }
}

fn secs(ms: u64) -> String {
    format!("{:.3}", ms as f64 / 1e3)
}

/// Gather every core's snapshot and merge them.
pub(crate) async fn scrape<S: Storage>(core: &Rc<Core<S>>) -> MetricsSnapshot {
    let mut total = MetricsSnapshot::default();
    let mut waits = Vec::new();
    for tx in &core.shared.senders {
        let Ok((reply, rx)) = felix_engine::mailbox::channel() else {
            continue;
        };
        if tx.send(CoreMsg::Scrape { reply }).is_ok() {
            waits.push(rx);
        }
    }
    for rx in waits {
        if let Some(s) = rx.attach().recv().await {
            total.merge(s);
        }
    }
    total.executor_wakeups = core.shared.kicker.get().map_or(0, |k| k.kicks());
    total.security_reloads = (
        core.shared.security_reloads[0].load(std::sync::atomic::Ordering::Relaxed),
        core.shared.security_reloads[1].load(std::sync::atomic::Ordering::Relaxed),
    );
    // A few small /proc reads on the scraping core (the descriptors are
    // counted from the directory's size, not by listing them).
    total.process = crate::process::ProcessStats::read();
    total
}

/// Metrics connections served at once; more are closed as they arrive.
/// Scrapers ask one at a time; the bound keeps connections that send
/// nothing, or never read the answer, from taking the process's file
/// descriptors (which the shards' segment files and clients need).
const MAX_METRICS_CONNECTIONS: usize = 8;

/// How long a metrics connection may take to send its request, or to take
/// each piece of the answer.
const METRICS_IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest a scraper may take to read the whole answer.
const METRICS_ANSWER_DEADLINE: Duration = Duration::from_secs(30);

/// A minimal HTTP/1.0 server for `GET /metrics`.
pub(crate) async fn serve_http<S: Storage>(core: Rc<Core<S>>, listener: std::net::TcpListener) {
    // SAFETY: ownership of the bound, listening descriptor moves to glommio.
    let listener = unsafe {
        <glommio::net::TcpListener as std::os::fd::FromRawFd>::from_raw_fd(
            std::os::fd::IntoRawFd::into_raw_fd(listener),
        )
    };
    let open = Rc::new(Cell::new(0usize));
    loop {
        let mut stream = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                if core.stopping.get() {
                    return;
                }
                // Out of descriptors and the like: back off rather than
                // spin the core that also serves shards.
                tracing::warn!("metrics endpoint: accept failed: {e}");
                glommio::timer::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if open.get() >= MAX_METRICS_CONNECTIONS {
            tracing::debug!(
                "metrics endpoint: {} connections open; closing a new one",
                open.get()
            );
            drop(stream);
            continue;
        }
        open.set(open.get() + 1);
        let core = core.clone();
        let open = open.clone();
        glommio::spawn_local(async move {
            // A scraper that connects and sends nothing, or never reads the
            // answer, is dropped after a while instead of holding a task
            // and a descriptor forever.
            stream.set_read_timeout(Some(METRICS_IO_TIMEOUT)).ok();
            stream.set_write_timeout(Some(METRICS_IO_TIMEOUT)).ok();
            let mut buf = [0u8; 2048];
            let n = stream.read(&mut buf).await.unwrap_or(0);
            let req = String::from_utf8_lossy(&buf[..n]);
            let (status, body) = if req.starts_with("GET /metrics") || req.starts_with("GET / ") {
                ("200 OK", scrape(&core).await.render())
            } else {
                ("404 Not Found", "try /metrics\n".to_string())
            };
            let head = format!(
                "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            // One deadline for the whole answer: a reader taking a few
            // bytes now and then would pass every per-write timeout and
            // hold a slot for hours.
            let _ = glommio::timer::timeout(METRICS_ANSWER_DEADLINE, async {
                let _ = stream.write_all(head.as_bytes()).await;
                let _ = stream.write_all(body.as_bytes()).await;
                let _ = stream.close().await;
                Ok(())
            })
            .await;
            open.set(open.get() - 1);
        })
        .detach();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_publish_lands_in_the_first_bucket_at_least_its_time() {
        let mut h = PublishLatency::default();
        for us in [0, 100, 101, 2000, 2001, 10_000_000, 10_000_001] {
            h.record(AckWait::Durable, Duration::from_micros(us));
        }
        // A part of a microsecond over a bound is over it.
        h.record(AckWait::Durable, Duration::from_nanos(100_001));
        h.record(AckWait::Queued, Duration::from_micros(5));
        let mut text = String::new();
        h.render(&mut text);
        let bucket = |ack: &str, le: &str| -> u64 {
            let line = format!("felix_publish_seconds_bucket{{ack=\"{ack}\",le=\"{le}\"}} ");
            let l = text.lines().find(|l| l.starts_with(&line)).unwrap();
            l[line.len()..].parse().unwrap()
        };
        // le is inclusive: 100 µs is in the first bucket, 101 µs is not.
        assert_eq!(bucket("durable", "0.0001"), 2);
        assert_eq!(bucket("durable", "0.00025"), 4);
        assert_eq!(bucket("durable", "0.002"), 5);
        assert_eq!(bucket("durable", "0.003"), 6);
        assert_eq!(bucket("durable", "10"), 7);
        assert_eq!(bucket("durable", "+Inf"), 8, "past 10 s: only +Inf");
        assert_eq!(bucket("queued", "0.0001"), 1);
        assert_eq!(bucket("replicated", "+Inf"), 0);
        assert!(text.contains("felix_publish_seconds_count{ack=\"durable\"} 8\n"));
        assert_eq!(
            text.matches("# TYPE felix_publish_seconds histogram")
                .count(),
            1
        );
    }

    #[test]
    fn every_family_has_help_and_type() {
        let mut snap = CoreMetrics::default().snapshot();
        snap.shards.push(ShardSnapshot {
            stream: "t/n/s".into(),
            replica: Some(ReplicaSnapshot::default()),
            ..ShardSnapshot::default()
        });
        snap.process = crate::process::ProcessStats::read();
        let text = snap.render();
        assert!(text.contains("felix_replica_term"), "{text}");
        assert!(
            text.contains("# TYPE process_cpu_seconds_total counter"),
            "{text}"
        );
        let mut helped = std::collections::BTreeSet::new();
        let mut typed = 0;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').unwrap();
                assert!(!help.trim().is_empty(), "{name}: empty help");
                assert!(helped.insert(name.to_string()), "{name}: two HELP lines");
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let name = rest.split(' ').next().unwrap();
                assert!(helped.contains(name), "{name}: TYPE without HELP before it");
                typed += 1;
            }
        }
        assert!(typed >= 20, "{text}");
    }

    #[test]
    fn a_histogram_without_labels_renders_bare_sum_and_count() {
        let mut s = String::new();
        write_histogram(&mut s, "x_seconds", "", &[50, 1000], &[2, 3, 1], 6, 2_500);
        assert_eq!(
            s,
            "x_seconds_bucket{le=\"0.00005\"} 2\n\
             x_seconds_bucket{le=\"0.001\"} 5\n\
             x_seconds_bucket{le=\"+Inf\"} 6\n\
             x_seconds_sum 0.0025\n\
             x_seconds_count 6\n"
        );
    }
}
