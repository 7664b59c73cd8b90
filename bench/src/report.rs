//! Results: the human summary and the JSON document (schema
//! `felix-bench/1`, documented in docs/benchmarking.md).

use std::io::Write;
use std::sync::atomic::Ordering;

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::harness::{fmt_count, fmt_int, Run, StopReason};
use crate::targets::TargetInfo;

pub const SCHEMA: &str = "felix-bench/1";

/// Latency percentiles in microseconds.
#[derive(Debug, Clone, Serialize)]
pub struct LatencyReport {
    /// What was timed.
    pub what: String,
    /// Samples (one per batch, request or record, see `what`).
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

impl LatencyReport {
    pub fn from_hist(h: &Histogram<u64>, what: &str) -> LatencyReport {
        let us = |ns: u64| ns as f64 / 1_000.0;
        let q = |p: f64| {
            if h.is_empty() {
                0.0
            } else {
                us(h.value_at_quantile(p))
            }
        };
        LatencyReport {
            what: what.to_string(),
            count: h.len(),
            mean_us: if h.is_empty() {
                0.0
            } else {
                h.mean() / 1_000.0
            },
            p50_us: q(0.50),
            p90_us: q(0.90),
            p99_us: q(0.99),
            p999_us: q(0.999),
            max_us: if h.is_empty() { 0.0 } else { us(h.max()) },
        }
    }
}

/// A consistency check on the run's counts.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: String,
    /// `None`: not checked.
    pub ok: Option<bool>,
    pub detail: String,
}

impl Check {
    pub fn equal(name: &str, got: u64, want: u64) -> Check {
        Check {
            name: name.into(),
            ok: Some(got == want),
            detail: if got == want {
                fmt_int(got)
            } else {
                format!("{} != {}", fmt_int(got), fmt_int(want))
            },
        }
    }

    pub fn passed(name: &str, detail: String) -> Check {
        Check {
            name: name.into(),
            ok: Some(true),
            detail,
        }
    }

    pub fn failed(name: &str, detail: String) -> Check {
        Check {
            name: name.into(),
            ok: Some(false),
            detail,
        }
    }

    pub fn skipped(name: &str, why: &str) -> Check {
        Check {
            name: name.into(),
            ok: None,
            detail: why.into(),
        }
    }
}

/// Counts over the whole run, warm-up included.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Totals {
    pub published: Option<u64>,
    pub read: Option<u64>,
    pub passes: Option<u64>,
    pub delivered: Option<u64>,
    pub acked: Option<u64>,
    pub nacked: Option<u64>,
    pub redelivered: Option<u64>,
}

/// What a workload hands back.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The measured window, as instants (the broker's metrics are read
    /// over the same one).
    pub measure_from: std::time::Instant,
    pub measure_to: std::time::Instant,
    pub measured_secs: f64,
    pub stop_reason: StopReason,
    pub records: u64,
    pub bytes: u64,
    pub latency: LatencyReport,
    pub publish_latency: Option<LatencyReport>,
    /// The broker's own account (felix_publish_seconds), where its metrics
    /// could be read.
    pub broker_publish_latency: Option<crate::broker_metrics::BrokerLatency>,
    pub offered_rate: Option<f64>,
    pub totals: Totals,
    pub checks: Vec<Check>,
    pub errors: u64,
    pub first_error: Option<String>,
}

impl Outcome {
    pub fn new(run: &Run, h: Histogram<u64>, what: &str) -> Outcome {
        Outcome {
            measure_from: run.measure_at(),
            measure_to: run.measure_at() + run.measured_elapsed(),
            measured_secs: run.measured_elapsed().as_secs_f64(),
            stop_reason: run.stop_reason(),
            records: run.measured_records.load(Ordering::Relaxed),
            bytes: run.measured_bytes.load(Ordering::Relaxed),
            latency: LatencyReport::from_hist(&h, what),
            publish_latency: None,
            broker_publish_latency: None,
            offered_rate: None,
            totals: Totals::default(),
            checks: Vec::new(),
            errors: run.errors.load(Ordering::Relaxed),
            first_error: run.first_error(),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub client_threads: usize,
    pub kernel: String,
    /// Share of the machine's CPU time busy while the run measured
    /// (client, broker and everything else), from `/proc/stat`.
    pub cpu_busy: Option<f64>,
    /// Share of the machine's CPU time the hypervisor gave to other guests
    /// while the run measured (`steal`): a busy host, whose figures are
    /// not comparable with a quiet one's.
    pub cpu_steal: Option<f64>,
    /// CPUs the benchmark process used on average while the run measured.
    pub client_cpus: Option<f64>,
    /// CPUs the broker process used on average: the embedded broker's from
    /// its `/proc` entry, one started apart from its
    /// `process_cpu_seconds_total` where the run scrapes its metrics.
    pub broker_cpus: Option<f64>,
}

impl Machine {
    /// The summary's `cpus` line: how busy the machine was, what the
    /// hypervisor took, and how the CPUs divided between broker and client.
    pub fn cpus_line(&self) -> Option<String> {
        let (busy, steal) = (self.cpu_busy?, self.cpu_steal?);
        let warning = if steal >= STEAL_WARNING {
            " (other guests took CPU time: figures from this run are not comparable)"
        } else {
            ""
        };
        let split = match (self.broker_cpus, self.client_cpus) {
            (Some(b), Some(c)) => format!(
                "; of its {} CPUs the broker used {b:.2}, the client {c:.2}",
                self.cpus
            ),
            (None, Some(c)) => format!("; of its {} CPUs the client used {c:.2}", self.cpus),
            _ => String::new(),
        };
        Some(format!(
            "  cpus      {:.0}% busy, {:.0}% stolen by the hypervisor{warning}{split}",
            busy * 100.0,
            steal * 100.0
        ))
    }

    pub fn here(client_threads: usize, cpu: Option<crate::cpu::CpuUse>) -> Machine {
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        Machine {
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            client_threads,
            kernel,
            cpu_busy: cpu.map(|c| c.busy),
            cpu_steal: cpu.map(|c| c.steal),
            client_cpus: cpu.and_then(|c| c.client_cpus),
            broker_cpus: cpu.and_then(|c| c.broker_cpus),
        }
    }
}

/// The JSON document.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub schema: &'static str,
    pub workload: String,
    pub label: Option<String>,
    pub ok: bool,
    pub target: TargetInfo,
    /// Every setting of the run, as given or defaulted.
    pub params: serde_json::Value,
    pub started_unix_ms: u64,
    pub warmup_secs: f64,
    pub measured_secs: f64,
    pub stop_reason: StopReason,
    /// Records completed in the measured window.
    pub records: u64,
    /// Payload bytes completed in the measured window.
    pub bytes: u64,
    pub records_per_sec: f64,
    /// Payload megabytes (10^6 bytes) per second.
    pub mb_per_sec: f64,
    pub offered_rate: Option<f64>,
    pub latency: LatencyReport,
    pub publish_latency: Option<LatencyReport>,
    /// Felix: the broker's publish latency over the measured window, from
    /// its `felix_publish_seconds` (bucket bounds: at most).
    pub broker_publish_latency: Option<crate::broker_metrics::BrokerLatency>,
    pub totals: Totals,
    pub checks: Vec<Check>,
    pub errors: u64,
    pub first_error: Option<String>,
    pub machine: Machine,
}

impl Report {
    #[allow(clippy::too_many_arguments)]
    pub fn build(
        workload: &str,
        label: Option<String>,
        target: TargetInfo,
        params: serde_json::Value,
        started_unix_ms: u64,
        warmup_secs: f64,
        o: Outcome,
        machine: Machine,
    ) -> Report {
        let secs = o.measured_secs.max(1e-9);
        let mut o = o;
        if o.records == 0 {
            o.checks.push(Check::failed(
                "something was measured",
                format!(
                    "no record completed in the measured window (stopped: {}); for a queue, raise --backlog",
                    o.stop_reason
                ),
            ));
        }
        let ok = o.errors == 0 && o.checks.iter().all(|c| c.ok != Some(false));
        Report {
            schema: SCHEMA,
            workload: workload.to_string(),
            label,
            ok,
            target,
            params,
            started_unix_ms,
            warmup_secs,
            measured_secs: o.measured_secs,
            stop_reason: o.stop_reason,
            records: o.records,
            bytes: o.bytes,
            records_per_sec: if o.records == 0 {
                0.0
            } else {
                o.records as f64 / secs
            },
            mb_per_sec: if o.bytes == 0 {
                0.0
            } else {
                o.bytes as f64 / secs / 1e6
            },
            offered_rate: o.offered_rate,
            latency: o.latency,
            publish_latency: o.publish_latency,
            broker_publish_latency: o.broker_publish_latency,
            totals: o.totals,
            checks: o.checks,
            errors: o.errors,
            first_error: o.first_error,
            machine,
        }
    }

    /// The human summary.
    pub fn print(&self, out: &mut dyn Write) -> std::io::Result<()> {
        let t = &self.target;
        let cores = t
            .broker_cores
            .as_deref()
            .map(|c| format!(", {c} core(s)"))
            .unwrap_or_default();
        writeln!(
            out,
            "felix-bench {} -> {} ({}{}, {})",
            self.workload, t.version, t.broker, cores, t.mode
        )?;
        writeln!(
            out,
            "  measured {:.2}s after {:.1}s warm-up (stopped: {})",
            self.measured_secs, self.warmup_secs, self.stop_reason
        )?;
        if let Some(r) = self.offered_rate {
            writeln!(out, "  offered   {} rec/s", fmt_count(r))?;
        }
        writeln!(
            out,
            "  records   {:>14}   {:>12} rec/s   {:>9.1} MB/s",
            fmt_int(self.records),
            fmt_count(self.records_per_sec),
            self.mb_per_sec
        )?;
        for l in std::iter::once(&self.latency).chain(self.publish_latency.as_ref()) {
            writeln!(out, "  latency   {} (n={})", l.what, fmt_int(l.count))?;
            writeln!(
                out,
                "            p50 {}  p90 {}  p99 {}  p99.9 {}  max {}",
                fmt_us(l.p50_us),
                fmt_us(l.p90_us),
                fmt_us(l.p99_us),
                fmt_us(l.p999_us),
                fmt_us(l.max_us)
            )?;
        }
        if let Some(b) = &self.broker_publish_latency {
            let at_most = |us: Option<f64>| match us {
                Some(us) => format!("<={}", fmt_us(us)),
                None => "over 10s".to_string(),
            };
            writeln!(
                out,
                "  broker    publish in the broker, {} acks (felix_publish_seconds, n={})",
                b.ack,
                fmt_int(b.count)
            )?;
            writeln!(
                out,
                "            p50 {}  p90 {}  p99 {}  p99.9 {}",
                at_most(b.p50_at_most_us),
                at_most(b.p90_at_most_us),
                at_most(b.p99_at_most_us),
                at_most(b.p999_at_most_us)
            )?;
        }
        if let Some(line) = self.machine.cpus_line() {
            writeln!(out, "{line}")?;
        }
        let tot = &self.totals;
        let mut parts = Vec::new();
        for (name, v) in [
            ("published", tot.published),
            ("read", tot.read),
            ("passes", tot.passes),
            ("delivered", tot.delivered),
            ("acked", tot.acked),
            ("nacked", tot.nacked),
            ("redelivered", tot.redelivered),
        ] {
            if let Some(v) = v {
                parts.push(format!("{name} {}", fmt_int(v)));
            }
        }
        writeln!(out, "  totals    {} (warm-up included)", parts.join(", "))?;
        for c in &self.checks {
            let mark = match c.ok {
                Some(true) => "ok  ",
                Some(false) => "FAIL",
                None => "skip",
            };
            writeln!(out, "  check {mark} {}: {}", c.name, c.detail)?;
        }
        if self.errors > 0 {
            writeln!(
                out,
                "  errors    {} (first: {})",
                self.errors,
                self.first_error.as_deref().unwrap_or("?")
            )?;
        }
        Ok(())
    }
}

/// Share of stolen CPU time from which the summary says a run's figures
/// are not comparable with a quiet machine's.
pub const STEAL_WARNING: f64 = 0.03;

/// Microseconds in a readable unit.
pub fn fmt_us(us: f64) -> String {
    if us >= 1_000_000.0 {
        format!("{:.2}s", us / 1_000_000.0)
    } else if us >= 1_000.0 {
        format!("{:.2}ms", us / 1_000.0)
    } else {
        format!("{us:.0}us")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(steal: f64, broker: Option<f64>, client: Option<f64>) -> Machine {
        Machine {
            cpus: 2,
            client_threads: 1,
            kernel: String::new(),
            cpu_busy: Some(0.95),
            cpu_steal: Some(steal),
            client_cpus: client,
            broker_cpus: broker,
        }
    }

    #[test]
    fn the_cpus_line_divides_the_machine_between_broker_and_client() {
        assert_eq!(
            machine(0.0, Some(1.27), Some(0.456)).cpus_line().unwrap(),
            "  cpus      95% busy, 0% stolen by the hypervisor; \
             of its 2 CPUs the broker used 1.27, the client 0.46"
        );
        assert_eq!(
            machine(0.0, None, Some(0.5)).cpus_line().unwrap(),
            "  cpus      95% busy, 0% stolen by the hypervisor; of its 2 CPUs the client used 0.50"
        );
        // The warning stays with the figure it is about.
        let busy_host = machine(0.2, Some(1.0), Some(0.5)).cpus_line().unwrap();
        assert!(
            busy_host.contains("hypervisor (other guests took CPU time"),
            "{busy_host}"
        );
        let mut none = machine(0.0, None, None);
        none.cpu_busy = None;
        assert_eq!(none.cpus_line(), None);
    }
}
