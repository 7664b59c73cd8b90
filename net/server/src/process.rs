//! The broker process's own figures for the metrics endpoint, read from
//! `/proc` when scraped (never on the request path): the `process_*`
//! families Prometheus' client libraries export, under the same names, so
//! dashboards and alerts written for any other service work unchanged.
//! CPU time in particular tells the broker's share of a machine it shares
//! with clients from theirs.

use std::fmt::Write as _;

/// One reading. A figure the kernel did not give is left out of the
/// exposition rather than shown as 0.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct ProcessStats {
    /// User and system CPU time of every thread (io_uring workers included).
    pub cpu_seconds: Option<f64>,
    pub resident_bytes: Option<u64>,
    pub virtual_bytes: Option<u64>,
    pub threads: Option<u64>,
    /// Seconds since the Unix epoch at which the process started.
    pub start_time_seconds: Option<f64>,
    pub open_fds: Option<u64>,
    pub max_fds: Option<u64>,
}

/// The fields of `/proc/<pid>/stat` this module reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stat {
    utime_ticks: u64,
    stime_ticks: u64,
    threads: u64,
    start_ticks: u64,
    vsize_bytes: u64,
    rss_pages: u64,
}

/// Parse `/proc/<pid>/stat`. The command name (field 2) sits in
/// parentheses and may itself hold spaces and parentheses, so the fields
/// are counted from the last `)`.
fn parse_stat(s: &str) -> Option<Stat> {
    let rest = &s[s.rfind(')')? + 1..];
    // rest's first field is field 3 (state); field n is rest[n - 3].
    let f: Vec<&str> = rest.split_whitespace().collect();
    let at = |n: usize| f.get(n - 3)?.parse::<u64>().ok();
    Some(Stat {
        utime_ticks: at(14)?,
        stime_ticks: at(15)?,
        threads: at(20)?,
        start_ticks: at(22)?,
        vsize_bytes: at(23)?,
        rss_pages: at(24)?,
    })
}

/// The boot time (`btime`) from `/proc/stat`, in seconds since the epoch.
fn parse_boot_time(s: &str) -> Option<u64> {
    s.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

fn sysconf(name: libc::c_int) -> Option<u64> {
    // SAFETY: sysconf reads a configuration value; no memory is passed.
    let v = unsafe { libc::sysconf(name) };
    u64::try_from(v).ok().filter(|&v| v > 0)
}

/// User plus system CPU seconds a process has used, all its threads
/// together, from `/proc/<pid>/stat` (this process's with `None`): what
/// `process_cpu_seconds_total` reports. felix-bench reads it for itself and
/// for the broker it starts.
pub fn cpu_seconds(pid: Option<u32>) -> Option<f64> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/stat"),
        None => "/proc/self/stat".to_string(),
    };
    let s = parse_stat(&std::fs::read_to_string(path).ok()?)?;
    let hz = sysconf(libc::_SC_CLK_TCK)?;
    Some(s.utime_ticks.saturating_add(s.stime_ticks) as f64 / hz as f64)
}

impl ProcessStats {
    /// Read this process's figures. Costs a few small `/proc` reads and a
    /// listing of `/proc/self/fd`: for scrapes, not for hot paths.
    pub(crate) fn read() -> ProcessStats {
        let stat = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| parse_stat(&s));
        let boot = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| parse_boot_time(&s));
        let max_fds = match crate::fds::limit() {
            u64::MAX => None,
            n => Some(n),
        };
        ProcessStats::from_parts(
            stat,
            boot,
            sysconf(libc::_SC_CLK_TCK),
            sysconf(libc::_SC_PAGESIZE),
            crate::fds::open_count(),
            max_fds,
        )
    }

    fn from_parts(
        stat: Option<Stat>,
        boot_time: Option<u64>,
        ticks_per_second: Option<u64>,
        page_bytes: Option<u64>,
        open_fds: Option<u64>,
        max_fds: Option<u64>,
    ) -> ProcessStats {
        let secs = |ticks: u64| ticks_per_second.map(|hz| ticks as f64 / hz as f64);
        ProcessStats {
            cpu_seconds: stat.and_then(|s| secs(s.utime_ticks.saturating_add(s.stime_ticks))),
            resident_bytes: stat
                .zip(page_bytes)
                .map(|(s, page)| s.rss_pages.saturating_mul(page)),
            virtual_bytes: stat.map(|s| s.vsize_bytes),
            threads: stat.map(|s| s.threads),
            start_time_seconds: stat
                .and_then(|s| secs(s.start_ticks))
                .zip(boot_time)
                .map(|(since_boot, boot)| boot as f64 + since_boot),
            open_fds,
            max_fds,
        }
    }

    /// Append the families in Prometheus text format.
    pub(crate) fn render(&self, s: &mut String) {
        let families: [(&str, &str, &str, Option<String>); 7] = [
            ("process_cpu_seconds_total", "counter", "User and system CPU time the broker process has used, all its threads together (seconds).", self.cpu_seconds.map(|v| format!("{v:.2}"))),
            ("process_resident_memory_bytes", "gauge", "Resident memory of the broker process (bytes).", self.resident_bytes.map(|v| v.to_string())),
            ("process_virtual_memory_bytes", "gauge", "Virtual memory size of the broker process (bytes).", self.virtual_bytes.map(|v| v.to_string())),
            ("process_threads", "gauge", "Threads of the broker process (executors, their io_uring workers and blocking-operation threads).", self.threads.map(|v| v.to_string())),
            ("process_start_time_seconds", "gauge", "When the broker process started, in seconds since the Unix epoch.", self.start_time_seconds.map(|v| format!("{v:.2}"))),
            ("process_open_fds", "gauge", "Open file descriptors (segment files, sockets and the rest).", self.open_fds.map(|v| v.to_string())),
            ("process_max_fds", "gauge", "The soft limit on open file descriptors.", self.max_fds.map(|v| v.to_string())),
        ];
        for (name, kind, help, value) in families {
            if let Some(v) = value {
                let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A real line's shape, with a command name holding spaces and a ')'.
    const STAT: &str = "4242 (felix (core) 1) S 1 4242 4242 0 -1 4194368 1234 0 0 0 \
                        250 75 0 0 20 0 9 0 3000 123456789 2048 18446744073709551615 \
                        1 1 0 0 0 0 0 4096 17634 0 0 0 17 1 0 0 0 0 0";

    #[test]
    fn stat_fields_are_counted_from_the_last_parenthesis() {
        assert_eq!(
            parse_stat(STAT),
            Some(Stat {
                utime_ticks: 250,
                stime_ticks: 75,
                threads: 9,
                start_ticks: 3000,
                vsize_bytes: 123_456_789,
                rss_pages: 2048,
            })
        );
        assert_eq!(parse_stat("4242 (felix) S 1 2"), None);
        assert_eq!(parse_stat("no parenthesis"), None);
        assert_eq!(parse_stat(""), None);
    }

    #[test]
    fn figures_are_converted_and_missing_ones_left_out() {
        let p = ProcessStats::from_parts(
            parse_stat(STAT),
            parse_boot_time("cpu  1 2 3\nbtime 1700000000\nprocesses 9\n"),
            Some(100),
            Some(4096),
            Some(17),
            Some(1024),
        );
        assert_eq!(p.cpu_seconds, Some(3.25));
        assert_eq!(p.resident_bytes, Some(2048 * 4096));
        assert_eq!(p.start_time_seconds, Some(1_700_000_030.0));
        let mut s = String::new();
        p.render(&mut s);
        assert!(s.contains("\nprocess_cpu_seconds_total 3.25\n"), "{s}");
        assert!(
            s.contains("\nprocess_resident_memory_bytes 8388608\n"),
            "{s}"
        );
        assert!(
            s.contains("\nprocess_start_time_seconds 1700000030.00\n"),
            "{s}"
        );
        assert!(s.contains("\nprocess_open_fds 17\n"), "{s}");

        let none = ProcessStats::from_parts(None, None, Some(100), Some(4096), None, None);
        let mut s = String::new();
        none.render(&mut s);
        assert_eq!(s, "");
    }

    #[test]
    fn this_process_can_be_read() {
        let own = cpu_seconds(None).expect("this process's CPU time");
        let again = cpu_seconds(Some(std::process::id())).expect("by its pid");
        assert!(own >= 0.0 && again >= own, "{own} then {again}");
        let p = ProcessStats::read();
        assert!(p.cpu_seconds.is_some_and(|c| c >= 0.0), "{p:?}");
        assert!(p.resident_bytes.is_some_and(|r| r > 0), "{p:?}");
        assert!(p.threads.is_some_and(|t| t >= 1), "{p:?}");
        assert!(p.open_fds.is_some_and(|n| n >= 3), "{p:?}");
    }
}
