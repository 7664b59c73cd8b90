//! What every workload shares: the warm-up / measure / stop clock, counters
//! read by the progress line, and latency histograms.
//!
//! A run is: setup (not timed) -> warm-up (the workload runs, nothing is
//! counted) -> measurement (`Amount`: a duration, or a record count) ->
//! drain (work sent during the measurement completes and still counts).
//! Whether something is counted is decided by when it *started* (a batch's
//! scheduled send time), so work begun in the warm-up never inflates the
//! measurement and work begun in it is never lost.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::cli::Amount;

/// The process-wide time origin for stamps carried in payloads.
pub fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Nanoseconds since [`epoch`].
pub fn now_ns() -> u64 {
    ns_of(Instant::now())
}

pub fn ns_of(t: Instant) -> u64 {
    u64::try_from(t.saturating_duration_since(epoch()).as_nanos()).unwrap_or(u64::MAX)
}

/// Latencies from 1 microsecond to 10 minutes at 3 significant digits.
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1_000, 600_000_000_000, 3).expect("valid histogram bounds")
}

/// Record `ns` (clamped into the histogram's range) `count` times.
pub fn record(h: &mut Histogram<u64>, ns: u64, count: u64) {
    let v = ns.clamp(1_000, 600_000_000_000);
    h.record_n(v, count).expect("value clamped into range");
}

/// Why measurement ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    Duration,
    Count,
    /// The workload ran out of work (backlog consumed) first.
    Drained,
    Interrupted,
    Error,
}

impl std::fmt::Display for StopReason {
    /// The name the JSON report uses.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StopReason::Duration => "duration",
            StopReason::Count => "count",
            StopReason::Drained => "drained",
            StopReason::Interrupted => "interrupted",
            StopReason::Error => "error",
        })
    }
}

/// Shared state of one run.
#[derive(Debug)]
pub struct Run {
    started: Instant,
    measure_at: Instant,
    stop_at: Option<Instant>,
    /// Count mode: records the measurement may still start.
    budget: Option<AtomicI64>,
    /// Count mode: records the measurement counts, at most.
    count: Option<u64>,
    stop: AtomicBool,
    stop_reason: Mutex<Option<StopReason>>,
    /// Everything completed, warm-up included (progress line).
    pub done_records: AtomicU64,
    pub done_bytes: AtomicU64,
    /// Completed work that started in the measurement.
    pub measured_records: AtomicU64,
    pub measured_bytes: AtomicU64,
    /// Nanoseconds after `measure_at` of the last measured completion.
    last_measured_ns: AtomicU64,
    pub errors: AtomicU64,
    first_error: Mutex<Option<String>>,
    /// Workload-specific counters shown in the summary.
    pub redeliveries: AtomicU64,
    pub nacks: AtomicU64,
}

impl Run {
    pub fn new(warmup: Duration, amount: Amount) -> Arc<Run> {
        let started = Instant::now();
        let measure_at = started + warmup;
        let (stop_at, budget) = match amount {
            Amount::Duration(d) => (Some(measure_at + d), None),
            Amount::Count(n) => (None, Some(AtomicI64::new(n.min(i64::MAX as u64) as i64))),
        };
        Arc::new(Run {
            started,
            measure_at,
            stop_at,
            budget,
            count: match amount {
                Amount::Count(n) => Some(n),
                Amount::Duration(_) => None,
            },
            stop: AtomicBool::new(false),
            stop_reason: Mutex::new(None),
            done_records: AtomicU64::new(0),
            done_bytes: AtomicU64::new(0),
            measured_records: AtomicU64::new(0),
            measured_bytes: AtomicU64::new(0),
            last_measured_ns: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            first_error: Mutex::new(None),
            redeliveries: AtomicU64::new(0),
            nacks: AtomicU64::new(0),
        })
    }

    pub fn started(&self) -> Instant {
        self.started
    }

    pub fn measure_at(&self) -> Instant {
        self.measure_at
    }

    pub fn stop_at(&self) -> Option<Instant> {
        self.stop_at
    }

    pub fn is_measured(&self, started: Instant) -> bool {
        started >= self.measure_at && !matches!(self.stop_at, Some(s) if started >= s)
    }

    pub fn stopping(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    pub fn request_stop(&self, reason: StopReason) {
        let mut r = self.stop_reason.lock().unwrap_or_else(|p| p.into_inner());
        if r.is_none() {
            *r = Some(reason);
        }
        self.stop.store(true, Ordering::Relaxed);
    }

    pub fn stop_reason(&self) -> StopReason {
        let r = self.stop_reason.lock().unwrap_or_else(|p| p.into_inner());
        r.unwrap_or(match self.stop_at {
            Some(_) => StopReason::Duration,
            None => StopReason::Count,
        })
    }

    /// May work of `n` records start at `at`? Stops the run when the
    /// duration has passed or the count budget is spent. In count mode,
    /// returns how many of the `n` may start (a final batch may be cut).
    pub fn admit(&self, at: Instant, n: u64) -> Option<u64> {
        if self.stopping() {
            return None;
        }
        if let Some(s) = self.stop_at {
            if at >= s {
                self.request_stop(StopReason::Duration);
                return None;
            }
        }
        if at < self.measure_at {
            return Some(n);
        }
        match &self.budget {
            None => Some(n),
            Some(b) => {
                let before = b.fetch_sub(n as i64, Ordering::Relaxed);
                if before <= 0 {
                    self.request_stop(StopReason::Count);
                    None
                } else {
                    let got = (before as u64).min(n);
                    if got == before as u64 {
                        self.request_stop(StopReason::Count);
                    }
                    Some(got)
                }
            }
        }
    }

    /// Completed work of `records`/`bytes` that started at `started`.
    /// Returns whether it counted. In count mode the measurement counts
    /// exactly the count: the completion that reaches it stops the run, and
    /// anything beyond it (a consumer's last poll) is left out.
    pub fn complete(&self, started: Instant, records: u64, bytes: u64) -> bool {
        self.done_records.fetch_add(records, Ordering::Relaxed);
        self.done_bytes.fetch_add(bytes, Ordering::Relaxed);
        if records == 0 || !self.is_measured(started) {
            return false;
        }
        let take = match self.count {
            None => {
                self.measured_records.fetch_add(records, Ordering::Relaxed);
                records
            }
            Some(c) => {
                let prev = self.measured_records.fetch_update(
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                    |cur| (cur < c).then(|| (cur + records).min(c)),
                );
                match prev {
                    Err(_) => return false,
                    Ok(prev) => {
                        let take = (prev + records).min(c) - prev;
                        if prev + take >= c {
                            self.request_stop(StopReason::Count);
                        }
                        take
                    }
                }
            }
        };
        self.measured_bytes
            .fetch_add(bytes * take / records, Ordering::Relaxed);
        let ns = u64::try_from(
            Instant::now()
                .saturating_duration_since(self.measure_at)
                .as_nanos(),
        )
        .unwrap_or(u64::MAX);
        self.last_measured_ns.fetch_max(ns, Ordering::Relaxed);
        true
    }

    pub fn error(&self, e: impl std::fmt::Display) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        let mut f = self.first_error.lock().unwrap_or_else(|p| p.into_inner());
        if f.is_none() {
            *f = Some(e.to_string());
        }
    }

    pub fn first_error(&self) -> Option<String> {
        self.first_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The measured window: from `measure_at` to the last measured
    /// completion (or to the end of the duration, if later).
    pub fn measured_elapsed(&self) -> Duration {
        let last = Duration::from_nanos(self.last_measured_ns.load(Ordering::Relaxed));
        match (self.stop_at, self.stop_reason()) {
            (Some(s), StopReason::Duration) => {
                last.max(s.saturating_duration_since(self.measure_at))
            }
            _ => last,
        }
    }
}

/// Latency histograms shared by workers, merged when a worker finishes
/// (each worker records into its own and hands it over once).
#[derive(Debug)]
pub struct Latencies {
    merged: Mutex<Histogram<u64>>,
}

impl Default for Latencies {
    fn default() -> Self {
        Latencies {
            merged: Mutex::new(new_histogram()),
        }
    }
}

impl Latencies {
    pub fn add(&self, h: &Histogram<u64>) {
        let mut m = self.merged.lock().unwrap_or_else(|p| p.into_inner());
        m.add(h).expect("same bounds");
    }

    pub fn take(&self) -> Histogram<u64> {
        let m = self.merged.lock().unwrap_or_else(|p| p.into_inner());
        m.clone()
    }
}

fn phase(run: &Run, now: Instant) -> &'static str {
    if run.stopping() {
        "drain"
    } else if now < run.measure_at {
        "warmup"
    } else {
        "measure"
    }
}

/// Print a progress line every `every` until `done` is set. On a terminal
/// the line is rewritten in place; otherwise one line per tick.
pub async fn progress(run: Arc<Run>, every: Duration, record_size: usize, done: Arc<AtomicBool>) {
    // SAFETY: isatty only inspects the descriptor.
    let tty = unsafe { libc::isatty(2) } == 1;
    let mut last_records = 0u64;
    let mut last_bytes = 0u64;
    let mut last_t = Instant::now();
    let _ = record_size;
    loop {
        tokio::time::sleep(every).await;
        if done.load(Ordering::Relaxed) {
            break;
        }
        let now = Instant::now();
        let r = run.done_records.load(Ordering::Relaxed);
        let b = run.done_bytes.load(Ordering::Relaxed);
        let dt = now.duration_since(last_t).as_secs_f64().max(1e-9);
        let rate = (r - last_records) as f64 / dt;
        let mbs = (b - last_bytes) as f64 / dt / 1e6;
        let errors = run.errors.load(Ordering::Relaxed);
        let line = format!(
            "[{:>6.1}s] {:<7} {:>12} rec/s {:>9.1} MB/s  total {:>12}{}",
            now.duration_since(run.started).as_secs_f64(),
            phase(&run, now),
            fmt_count(rate),
            mbs,
            fmt_int(r),
            if errors > 0 {
                format!("  errors {errors}")
            } else {
                String::new()
            }
        );
        let mut err = std::io::stderr().lock();
        if tty {
            let _ = write!(err, "\r\x1b[2K{line}");
        } else {
            let _ = writeln!(err, "{line}");
        }
        let _ = err.flush();
        last_records = r;
        last_bytes = b;
        last_t = now;
    }
    if tty {
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[2K");
        let _ = err.flush();
    }
}

/// 1234567 -> "1,234,567".
pub fn fmt_int(n: u64) -> String {
    let s = n.to_string();
    let (head, rest) = s.split_at(s.len() % 3);
    let mut parts: Vec<&str> = Vec::new();
    if !head.is_empty() {
        parts.push(head);
    }
    parts.extend(
        rest.as_bytes()
            .chunks(3)
            .map(|c| std::str::from_utf8(c).expect("ASCII digits")),
    );
    parts.join(",")
}

pub fn fmt_count(x: f64) -> String {
    fmt_int(x.max(0.0).round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_group_by_thousands() {
        assert_eq!(fmt_int(0), "0");
        assert_eq!(fmt_int(999), "999");
        assert_eq!(fmt_int(1000), "1,000");
        assert_eq!(fmt_int(1234567), "1,234,567");
    }

    #[test]
    fn count_budget_admits_exactly_the_count() {
        let run = Run::new(Duration::ZERO, Amount::Count(250));
        let t = Instant::now();
        assert_eq!(run.admit(t, 100), Some(100));
        assert_eq!(run.admit(t, 100), Some(100));
        assert_eq!(run.admit(t, 100), Some(50));
        assert!(run.stopping());
        assert_eq!(run.admit(t, 100), None);
        assert_eq!(run.stop_reason(), StopReason::Count);
    }

    #[test]
    fn warmup_work_is_not_counted() {
        let run = Run::new(Duration::from_secs(3600), Amount::Count(10));
        let t = Instant::now();
        assert_eq!(run.admit(t, 100), Some(100), "warm-up takes no budget");
        assert!(!run.complete(t, 100, 1000));
        assert_eq!(run.measured_records.load(Ordering::Relaxed), 0);
        assert_eq!(run.done_records.load(Ordering::Relaxed), 100);
    }

    #[test]
    fn count_mode_counts_exactly_the_count() {
        let run = Run::new(Duration::ZERO, Amount::Count(250));
        let t = Instant::now();
        assert!(run.complete(t, 100, 1000));
        assert!(run.complete(t, 100, 1000));
        assert!(!run.stopping());
        assert!(run.complete(t, 100, 1000));
        assert!(run.stopping());
        assert!(!run.complete(t, 100, 1000));
        assert_eq!(run.measured_records.load(Ordering::Relaxed), 250);
        assert_eq!(run.measured_bytes.load(Ordering::Relaxed), 2500);
        assert_eq!(run.done_records.load(Ordering::Relaxed), 400);
    }

    #[test]
    fn histogram_clamps_out_of_range_values() {
        let mut h = new_histogram();
        record(&mut h, 0, 1);
        record(&mut h, u64::MAX, 1);
        assert_eq!(h.len(), 2);
    }
}
