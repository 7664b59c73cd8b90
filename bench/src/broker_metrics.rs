//! The broker's own account of a publish's time: `felix_publish_seconds`
//! from its Prometheus endpoint, over the measured window.
//!
//! Set beside the client's acknowledgement latency it tells the broker's
//! share (taking the request, the commit) from the client's and the
//! network's: on a machine where the client shares the broker's CPUs, a
//! tail the broker does not see is the client's or the scheduler's.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde::Serialize;

const METRIC: &str = "felix_publish_seconds_bucket{";
const TIMEOUT: Duration = Duration::from_secs(2);

/// Cumulative bucket counts of one series: (upper bound in µs, None for
/// +Inf; count at or below it), in the order the broker gives them.
type Buckets = Vec<(Option<f64>, u64)>;

/// `felix_publish_seconds` by its `ack` label.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PublishHistogram(BTreeMap<String, Buckets>);

impl PublishHistogram {
    /// The histogram's buckets from a Prometheus text exposition.
    pub fn parse(text: &str) -> PublishHistogram {
        let mut out: BTreeMap<String, Buckets> = BTreeMap::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(METRIC) else {
                continue;
            };
            let Some((labels, value)) = rest.rsplit_once("} ") else {
                continue;
            };
            let (Some(ack), Some(le), Ok(count)) = (
                label(labels, "ack"),
                label(labels, "le"),
                value.trim().parse::<f64>(),
            ) else {
                continue;
            };
            let bound = match le {
                "+Inf" => None,
                s => match s.parse::<f64>() {
                    Ok(secs) => Some(secs * 1e6),
                    Err(_) => continue,
                },
            };
            out.entry(ack.to_string())
                .or_default()
                .push((bound, count as u64));
        }
        PublishHistogram(out)
    }

    /// What was counted since `earlier`, for the series counted most in
    /// that time (the run's own kind of acknowledgement).
    pub fn since(&self, earlier: &PublishHistogram) -> Option<BrokerLatency> {
        let mut best: Option<BrokerLatency> = None;
        for (ack, now) in &self.0 {
            let before = earlier.0.get(ack).map_or(&[][..], |b| b.as_slice());
            // The same buckets counting up, or no figure: a broker that
            // restarted (counts went down) or changed its buckets between
            // the scrapes would give a wrong one.
            if !before.is_empty()
                && (before.len() != now.len()
                    || before
                        .iter()
                        .zip(now)
                        .any(|((l0, n0), (l1, n1))| l0 != l1 || n0 > n1))
            {
                return None;
            }
            let delta: Buckets = now
                .iter()
                .enumerate()
                .map(|(i, (le, n))| (*le, n - before.get(i).map_or(0, |(_, c)| *c)))
                .collect();
            let count = delta.last().map_or(0, |(_, n)| *n);
            if count == 0 || best.as_ref().is_some_and(|b| b.count >= count) {
                continue;
            }
            let at = |q: f64| quantile_bound(&delta, count, q);
            best = Some(BrokerLatency {
                ack: ack.clone(),
                count,
                p50_at_most_us: at(0.50),
                p90_at_most_us: at(0.90),
                p99_at_most_us: at(0.99),
                p999_at_most_us: at(0.999),
            });
        }
        best
    }
}

/// The value of `name="..."` in a label set.
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    labels.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == name).then(|| v.trim().trim_matches('"'))
    })
}

/// The upper bound of the bucket holding quantile `q`: the quantile is at
/// most this (None: past the last finite bucket).
fn quantile_bound(delta: &Buckets, count: u64, q: f64) -> Option<f64> {
    let rank = (q * count as f64).ceil().max(1.0) as u64;
    delta
        .iter()
        .find(|(_, n)| *n >= rank)
        .and_then(|(le, _)| *le)
}

/// The broker's publish latency over the measured window, as bucket
/// bounds: each quantile is at most the figure given.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BrokerLatency {
    /// What the acknowledgements waited for: durable, queued, replicated.
    pub ack: String,
    /// Publishes the broker answered in the window.
    pub count: u64,
    pub p50_at_most_us: Option<f64>,
    pub p90_at_most_us: Option<f64>,
    pub p99_at_most_us: Option<f64>,
    pub p999_at_most_us: Option<f64>,
}

/// The broker process's CPU time (`process_cpu_seconds_total`) in a
/// Prometheus text exposition.
pub fn cpu_seconds(text: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix("process_cpu_seconds_total "))
        .and_then(|v| v.trim().parse().ok())
}

/// One scrape of `http://addr/metrics`: the publish histogram and the
/// process's CPU time.
pub fn scrape(addr: &str) -> std::io::Result<(PublishHistogram, Option<f64>)> {
    let sock = addr
        .parse::<std::net::SocketAddr>()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let mut s = TcpStream::connect_timeout(&sock, TIMEOUT)?;
    s.set_read_timeout(Some(TIMEOUT))?;
    s.set_write_timeout(Some(TIMEOUT))?;
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok((PublishHistogram::parse(&text), cpu_seconds(&text)))
}

/// One scrape: when it was asked for and answered, and what it held. The
/// broker's numbers are from some time in between.
#[derive(Debug, Clone)]
pub struct Scrape {
    pub sent: Instant,
    pub received: Instant,
    pub histogram: PublishHistogram,
    pub cpu_seconds: Option<f64>,
}

impl Scrape {
    /// When the broker took its numbers, as near as can be told: halfway
    /// between asking and getting the answer.
    fn midpoint(&self) -> Instant {
        self.sent + (self.received - self.sent) / 2
    }
}

fn scrape_at(addr: &str) -> Option<Scrape> {
    let sent = Instant::now();
    let (histogram, cpu_seconds) = scrape(addr).ok()?;
    Some(Scrape {
        sent,
        received: Instant::now(),
        histogram,
        cpu_seconds,
    })
}

impl crate::sampler::Reading for Scrape {
    fn asked(&self) -> Instant {
        self.sent
    }
    fn answered(&self) -> Instant {
        self.received
    }
}

/// Scrapes the broker every 100 ms on a thread of its own until dropped
/// (one scrape asks each broker core for its numbers and renders them: a
/// few hundred microseconds of core 0's time a second).
pub struct Sampler(crate::sampler::Sampler<Scrape>);

impl Sampler {
    pub fn start(addr: &str) -> Sampler {
        let addr = addr.to_string();
        Sampler(crate::sampler::Sampler::start(
            "felix-bench-scrape",
            move || scrape_at(&addr),
        ))
    }

    /// The broker's publish latency between `from` and `to`, from the
    /// scrapes that bound it ([`crate::sampler::Sampler::window`]): the
    /// window and about 100 ms more at each end. `None` if no scrape came
    /// before `from` or the two do not compare.
    pub fn window(&self, from: Instant, to: Instant) -> Option<BrokerLatency> {
        let (start, end) = self.0.window(from, to)?;
        end.histogram.since(&start.histogram)
    }

    /// CPUs the broker process used on average between the scrapes that
    /// bound `from` to `to` (`None` from a broker without
    /// `process_cpu_seconds_total`, or one that restarted between them).
    pub fn cpus(&self, from: Instant, to: Instant) -> Option<f64> {
        let (start, end) = self.0.window(from, to)?;
        let used = end.cpu_seconds? - start.cpu_seconds?;
        let secs = (end.midpoint() - start.midpoint()).as_secs_f64();
        (used >= 0.0 && secs > 0.0).then_some(used / secs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(durable: &[u64], queued: &[u64]) -> String {
        let les = ["0.0005", "0.001", "0.002", "+Inf"];
        let mut s = String::from("# TYPE felix_publish_seconds histogram\n");
        for (ack, counts) in [("durable", durable), ("queued", queued)] {
            for (le, n) in les.iter().zip(counts) {
                s.push_str(&format!(
                    "felix_publish_seconds_bucket{{ack=\"{ack}\",le=\"{le}\"}} {n}\n"
                ));
            }
            s.push_str(&format!(
                "felix_publish_seconds_count{{ack=\"{ack}\"}} {}\n",
                counts[3]
            ));
        }
        s.push_str("felix_fsync_seconds_bucket{le=\"0.001\"} 7\n");
        s
    }

    #[test]
    fn the_window_is_the_difference_of_two_scrapes() {
        let a = PublishHistogram::parse(&text(&[10, 20, 30, 30], &[0, 0, 0, 0]));
        // 100 more publishes: 50 under 0.5 ms, 40 more under 1 ms, 9 more
        // under 2 ms and one over.
        let b = PublishHistogram::parse(&text(&[60, 110, 129, 130], &[0, 0, 0, 0]));
        let l = b.since(&a).unwrap();
        assert_eq!(l.ack, "durable");
        assert_eq!(l.count, 100);
        assert_eq!(l.p50_at_most_us, Some(500.0));
        assert_eq!(l.p90_at_most_us, Some(1000.0));
        assert_eq!(l.p99_at_most_us, Some(2000.0));
        assert_eq!(l.p999_at_most_us, None, "past the last finite bucket");
        // From nothing: everything counted.
        assert_eq!(b.since(&PublishHistogram::default()).unwrap().count, 130);
    }

    #[test]
    fn a_restart_or_other_buckets_between_scrapes_give_no_figure() {
        let a = PublishHistogram::parse(&text(&[10, 20, 30, 30], &[0, 0, 0, 0]));
        let restarted = PublishHistogram::parse(&text(&[1, 2, 3, 3], &[0, 0, 0, 0]));
        assert_eq!(restarted.since(&a), None);
        let fewer = PublishHistogram::parse(
            "felix_publish_seconds_bucket{ack=\"durable\",le=\"+Inf\"} 40\n",
        );
        assert_eq!(fewer.since(&a), None);
    }

    #[test]
    fn the_process_cpu_time_is_read_from_its_own_line() {
        let t = "# TYPE process_cpu_seconds_total counter\n\
                 process_cpu_seconds_total_other 9\n\
                 process_cpu_seconds_total 12.34\n";
        assert_eq!(cpu_seconds(t), Some(12.34));
        assert_eq!(cpu_seconds("felix_requests_total 3\n"), None);
        assert_eq!(cpu_seconds("process_cpu_seconds_total x\n"), None);
    }

    #[test]
    fn the_series_counted_most_in_the_window_is_reported() {
        let a = PublishHistogram::parse(&text(&[5, 5, 5, 5], &[0, 0, 0, 0]));
        let b = PublishHistogram::parse(&text(&[5, 5, 5, 5], &[3, 3, 4, 4]));
        let l = b.since(&a).unwrap();
        assert_eq!((l.ack.as_str(), l.count), ("queued", 4));
        assert_eq!(a.since(&a), None, "nothing in the window");
        assert_eq!(
            PublishHistogram::parse("garbage\n{}} x"),
            Default::default()
        );
    }
}
