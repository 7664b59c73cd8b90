//! How busy the machine's CPUs were while a run measured, and how much of
//! their time the hypervisor gave to other guests (`steal` in
//! `/proc/stat`). On a shared virtual machine a run that lost a tenth of
//! its CPU time to other guests measures the host as much as the broker:
//! the report says so instead of leaving it to be guessed from the
//! figures. It also says how that time divided between the benchmark
//! client and an embedded broker (each process's own CPU time), which on a
//! machine they share tells whose CPU a tail waited for.

use std::time::Instant;

use felix_server::process::cpu_seconds;

/// The machine-wide CPU counters of `/proc/stat`'s first line, in ticks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuTimes {
    /// Ticks spent doing anything (user, nice, system, irq, softirq).
    pub busy: u64,
    /// Ticks idle or waiting for I/O.
    pub idle: u64,
    /// Ticks the hypervisor ran something else while this guest wanted to run.
    pub steal: u64,
}

impl CpuTimes {
    /// Parse the `cpu ` line of `/proc/stat`.
    pub fn parse(stat: &str) -> Option<CpuTimes> {
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        // user nice system idle iowait irq softirq steal [guest guest_nice]
        // (guest time is already counted in user and nice).
        let at = |i: usize| v.get(i).copied().unwrap_or(0);
        if v.len() < 4 {
            return None;
        }
        Some(CpuTimes {
            busy: at(0) + at(1) + at(2) + at(5) + at(6),
            idle: at(3) + at(4),
            steal: at(7),
        })
    }

    fn now() -> Option<CpuTimes> {
        CpuTimes::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }
}

/// What the CPUs did over a window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpuUse {
    /// Share of the CPUs' time spent busy (0 to 1).
    pub busy: f64,
    /// Share of the CPUs' time taken by the hypervisor for other guests.
    pub steal: f64,
    /// CPUs the benchmark process used on average (1.0 = one CPU's whole
    /// time), its client threads and samplers together.
    pub client_cpus: Option<f64>,
    /// CPUs the embedded broker's process used on average, every thread of
    /// it (executors, io_uring workers); `None` for a broker elsewhere
    /// (the run may take that one's from its metrics).
    pub broker_cpus: Option<f64>,
}

impl CpuUse {
    /// From counters at the start and the end of a window.
    pub fn between(a: CpuTimes, b: CpuTimes) -> Option<CpuUse> {
        let busy = b.busy.checked_sub(a.busy)?;
        let idle = b.idle.checked_sub(a.idle)?;
        let steal = b.steal.checked_sub(a.steal)?;
        let total = busy + idle + steal;
        (total > 0).then(|| CpuUse {
            busy: busy as f64 / total as f64,
            steal: steal as f64 / total as f64,
            client_cpus: None,
            broker_cpus: None,
        })
    }

    /// Average CPUs a process used: its CPU seconds between two readings
    /// over the wall time between them.
    fn cpus(a: Option<f64>, b: Option<f64>, secs: f64) -> Option<f64> {
        let used = b? - a?;
        (used >= 0.0 && secs > 0.0).then_some(used / secs)
    }
}

/// A reading of the counters and when it was taken.
#[derive(Debug, Clone, Copy)]
pub struct Counters {
    at: Instant,
    times: CpuTimes,
    /// This process's CPU seconds.
    client: Option<f64>,
    /// The embedded broker's CPU seconds.
    broker: Option<f64>,
}

impl crate::sampler::Reading for Counters {
    fn asked(&self) -> Instant {
        self.at
    }
    fn answered(&self) -> Instant {
        self.at
    }
}

/// Reads the counters every 100 ms on a thread of its own until dropped.
pub struct Sampler(crate::sampler::Sampler<Counters>);

impl Sampler {
    /// `broker`: the embedded broker's process, whose CPU time is read
    /// beside this one's.
    pub fn start(broker: Option<u32>) -> Sampler {
        Sampler(crate::sampler::Sampler::start(
            "felix-bench-cpu",
            move || {
                CpuTimes::now().map(|times| Counters {
                    at: Instant::now(),
                    times,
                    client: cpu_seconds(None),
                    broker: broker.and_then(|p| cpu_seconds(Some(p))),
                })
            },
        ))
    }

    /// Use over the window from `from` to `to`, from the readings that bound
    /// it ([`crate::sampler::Sampler::window`]). `None` without
    /// `/proc/stat` or without a reading before `from`.
    pub fn window(&self, from: Instant, to: Instant) -> Option<CpuUse> {
        let (start, end) = self.0.window(from, to)?;
        let secs = (end.at - start.at).as_secs_f64();
        CpuUse::between(start.times, end.times).map(|u| CpuUse {
            client_cpus: CpuUse::cpus(start.client, end.client, secs),
            broker_cpus: CpuUse::cpus(start.broker, end.broker, secs),
            ..u
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_is_read_and_shares_add_up() {
        let a = CpuTimes::parse("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4\n").unwrap();
        assert_eq!(
            a,
            CpuTimes {
                busy: 150,
                idle: 850,
                steal: 0
            }
        );
        let b = CpuTimes::parse("cpu  200 10 90 900 60 5 5 80 0 0\n").unwrap();
        let u = CpuUse::between(a, b).unwrap();
        // 160 busy (100 + 10 + 40 + 5 + 5), 110 idle, 80 stolen of 350.
        assert!((u.busy - 160.0 / 350.0).abs() < 1e-9, "{u:?}");
        assert!((u.steal - 80.0 / 350.0).abs() < 1e-9, "{u:?}");
        assert_eq!(CpuUse::between(b, a), None, "counters never go back");
        assert_eq!(CpuTimes::parse("cpu  1 2\n"), None);
        assert_eq!(CpuTimes::parse("intr 5\n"), None);
        // An older kernel without the steal column.
        assert_eq!(CpuTimes::parse("cpu  1 2 3 4\n").unwrap().steal, 0);
    }

    #[test]
    fn the_sampler_reads_this_machine() {
        if !std::path::Path::new("/proc/stat").exists() {
            return;
        }
        let s = Sampler::start(Some(std::process::id()));
        // `start` took the first reading, at or before this instant.
        let from = Instant::now();
        // Wait until the counters move (ticks are 10 ms), with a deadline.
        let deadline = from + std::time::Duration::from_secs(10);
        let u = loop {
            if let Some(u) = s.window(from, Instant::now()) {
                break u;
            }
            assert!(Instant::now() < deadline, "the sampler read nothing");
            std::thread::yield_now();
        };
        assert!((0.0..=1.0).contains(&u.busy) && (0.0..=1.0).contains(&u.steal));
        // This process stands in for the broker: both are read.
        assert!(u.client_cpus.is_some_and(|c| c >= 0.0), "{u:?}");
        assert!(u.broker_cpus.is_some_and(|c| c >= 0.0), "{u:?}");
    }

    #[test]
    fn a_process_share_is_its_cpu_time_over_the_wall_time() {
        // 3 CPU seconds over 2 s: one and a half CPUs.
        assert_eq!(CpuUse::cpus(Some(1.0), Some(4.0), 2.0), Some(1.5));
        assert_eq!(CpuUse::cpus(Some(4.0), Some(1.0), 2.0), None);
        assert_eq!(CpuUse::cpus(None, Some(1.0), 2.0), None);
        assert_eq!(CpuUse::cpus(Some(1.0), Some(1.0), 0.0), None);
    }
}
