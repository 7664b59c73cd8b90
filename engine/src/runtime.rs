//! Thread-per-core runtime: one glommio executor per configured core, pinned,
//! and the pure placement function that says which core owns a shard.

use crate::types::{CoreId, ShardId, StreamName};
use glommio::{LocalExecutorBuilder, Placement};
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};

/// Which core owns `shard` of `stream` when the broker runs `cores` cores.
///
/// Pure and stable: the broker and clients compute the same answer. The
/// stream's hash spreads shard 0 of different streams across cores; shards of
/// one stream then go round-robin, so a stream with at least as many shards as
/// cores uses every core.
pub fn placement(stream: &StreamName, shard: ShardId, cores: u32) -> CoreId {
    assert!(cores > 0, "placement needs at least one core");
    let h = crc32c::crc32c(stream.to_string().as_bytes());
    CoreId(((h as u64 + shard.0 as u64) % cores as u64) as u32)
}

/// What each core's main future is given.
#[derive(Clone, Debug)]
pub struct CoreContext {
    pub core: CoreId,
    pub cores: u32,
    /// The CPU this executor is pinned to, if pinned.
    pub cpu: Option<usize>,
}

/// A running set of executors.
pub struct Runtime {
    handles: Vec<glommio::ExecutorJoinHandle<()>>,
}

/// Which CPUs to run on.
#[derive(Clone, Debug)]
pub enum CoreSet {
    /// The first `n` CPUs the process may run on.
    Count(usize),
    /// Exactly these CPU ids.
    List(Vec<usize>),
}

impl CoreSet {
    /// Parse a count `N` (the first N CPUs), or a CPU list such as `0,2,3`,
    /// `0-3` or `0,2-3` (a list with one CPU: `3,` or `3-3`).
    pub fn parse(s: &str) -> Result<CoreSet, String> {
        let s = s.trim();
        if !s.contains(',') && !s.contains('-') {
            let n: usize = s.parse().map_err(|_| {
                format!("cores must be a count or a CPU list like 0,1 or 0-3: {s:?}")
            })?;
            if n == 0 {
                return Err("cores must be at least 1".into());
            }
            return Ok(CoreSet::Count(n));
        }
        let mut list = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let cpu = |x: &str| {
                x.trim()
                    .parse::<usize>()
                    .map_err(|_| format!("bad CPU id {x:?} in {s:?}"))
            };
            match part.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (cpu(a)?, cpu(b)?);
                    if a > b {
                        return Err(format!("bad CPU range {part:?} in {s:?}"));
                    }
                    list.extend(a..=b);
                }
                None => list.push(cpu(part)?),
            }
        }
        if list.is_empty() {
            return Err("empty core list".into());
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(d) = list.iter().find(|c| !seen.insert(**c)) {
            return Err(format!("CPU {d} appears twice in {s:?}"));
        }
        Ok(CoreSet::List(list))
    }

    /// The CPU ids to pin to.
    pub fn cpus(&self) -> Vec<usize> {
        match self {
            CoreSet::List(l) => l.clone(),
            CoreSet::Count(n) => {
                let available: Vec<usize> = core_affinity::get_core_ids()
                    .map(|ids| ids.into_iter().map(|c| c.id).collect())
                    .unwrap_or_default();
                if available.len() >= *n {
                    available[..*n].to_vec()
                } else {
                    tracing::warn!(
                        "{n} executors on {} CPUs: some share a CPU",
                        available.len()
                    );
                    // More executors than CPUs: wrap around (useful in tests).
                    (0..*n)
                        .map(|i| {
                            available
                                .get(i % available.len().max(1))
                                .copied()
                                .unwrap_or(0)
                        })
                        .collect()
                }
            }
        }
    }
}

impl Runtime {
    /// Start one pinned executor per CPU, each running `main(ctx)`.
    /// `warm_dir` is a directory on the data disk (see [`warm_up_dma`]).
    pub fn start<F, Fut>(cpus: &[usize], warm_dir: Option<PathBuf>, main: F) -> io::Result<Runtime>
    where
        F: Fn(CoreContext) -> Fut + Send + Sync + Clone + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        let cores = cpus.len() as u32;
        let mut handles = Vec::new();
        for (i, cpu) in cpus.iter().copied().enumerate() {
            let main = main.clone();
            let warm = warm_dir.clone();
            let ctx = CoreContext {
                core: CoreId(i as u32),
                cores,
                cpu: Some(cpu),
            };
            let h = LocalExecutorBuilder::new(Placement::Fixed(cpu))
                .name(&format!("felix-core-{i}"))
                // A timer-woken task (a long poll, a claim lapse) waits at
                // most this long behind CPU-bound work (default: 100 ms).
                .preempt_timer(std::time::Duration::from_millis(2))
                .spawn(move || async move {
                    glommio::spawn_local(heartbeat()).detach();
                    if let Some(dir) = warm {
                        if let Err(e) = warm_up_dma(&dir).await {
                            tracing::warn!("DMA warm-up in {} failed: {e}", dir.display());
                        }
                    }
                    main(ctx).await
                })
                .map_err(|e| io::Error::other(format!("start executor on CPU {cpu}: {e}")))?;
            handles.push(h);
        }
        Ok(Runtime { handles })
    }

    /// Wait for every executor to finish.
    pub fn join(self) -> io::Result<()> {
        for h in self.handles {
            h.join()
                .map_err(|e| io::Error::other(format!("executor failed: {e}")))?;
        }
        Ok(())
    }
}

/// How often an idle executor wakes on its own.
pub const HEARTBEAT: std::time::Duration = std::time::Duration::from_millis(10);

/// Wake the executor every [`HEARTBEAT`], whatever else it waits for.
///
/// On this kernel (6.18) an executor parked in `io_uring_enter` sometimes
/// stays parked after the I/O it waits for has completed: seen with both
/// executors of a broker asleep, one with its first O_DIRECT read issued, the
/// completion already there (interrupting the thread with a debugger let it
/// go on at once). One start in about fifty hung for good that way, under
/// load. A periodic timer bounds such a stall to one heartbeat: each wake-up
/// reaps every ring. Costs 100 wake-ups a second on an idle core.
async fn heartbeat() {
    loop {
        glommio::timer::sleep(HEARTBEAT).await;
    }
}

/// glommio decides whether a disk supports its polling ring by test-reading
/// the first DMA file opened on each executor; an empty first file makes it
/// guess wrong, after which DMA reads fail with EOPNOTSUPP and synced writes
/// are slow. Opening a non-empty file first makes the guess right.
pub async fn warm_up_dma(dir: &Path) -> io::Result<()> {
    let path = dir.join(format!(
        ".felix-warmup-{}",
        std::process::id() as u64 * 1000 + thread_tag()
    ));
    std::fs::create_dir_all(dir)?;
    std::fs::write(&path, vec![0u8; 4096])?;
    let f = glommio::io::DmaFile::open(&path)
        .await
        .map_err(|e| io::Error::other(e.to_string()))?;
    let _ = f.read_at_aligned(0, 4096).await;
    let _ = f.close().await;
    std::fs::remove_file(&path)
}

fn thread_tag() -> u64 {
    // Distinct per executor thread; only used to name a temporary file.
    let id = format!("{:?}", std::thread::current().id());
    id.bytes()
        .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64))
        % 1000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_is_pure_and_spreads_shards() {
        let s = StreamName::parse("t/n/s").unwrap();
        let a: Vec<_> = (0..8).map(|i| placement(&s, ShardId(i), 2)).collect();
        let b: Vec<_> = (0..8).map(|i| placement(&s, ShardId(i), 2)).collect();
        assert_eq!(a, b);
        assert_eq!(a.iter().filter(|c| c.0 == 0).count(), 4);
        assert!(placement(&s, ShardId(3), 1) == CoreId(0));
    }

    #[test]
    fn core_sets_parse() {
        assert!(matches!(CoreSet::parse("2"), Ok(CoreSet::Count(2))));
        assert!(matches!(CoreSet::parse("0,1"), Ok(CoreSet::List(v)) if v == vec![0, 1]));
        assert!(matches!(CoreSet::parse("0-2"), Ok(CoreSet::List(v)) if v == vec![0, 1, 2]));
        assert!(matches!(CoreSet::parse("0,2-3"), Ok(CoreSet::List(v)) if v == vec![0, 2, 3]));
        assert!(matches!(CoreSet::parse("3,"), Ok(CoreSet::List(v)) if v == vec![3]));
        assert!(CoreSet::parse("0").is_err());
        assert!(CoreSet::parse("x").is_err());
        assert!(CoreSet::parse("3-1").is_err());
        assert!(CoreSet::parse("1,1").is_err());
    }
}
