//! Thread-per-core runtime: one glommio executor per configured core, pinned,
//! and the pure placement function that says which core owns a shard.

use crate::types::{CoreId, ShardId, StreamName};
use glommio::{CpuSet, LocalExecutorBuilder, Placement, PoolPlacement};
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    watchdog: Arc<Watchdog>,
}

/// Which CPUs to run on.
#[derive(Clone, Debug)]
pub enum CoreSet {
    /// The first `n` CPUs the process may run on.
    Count(usize),
    /// Exactly these CPU ids.
    List(Vec<usize>),
}

/// Most CPUs a core list may name.
const MAX_CPUS: usize = 4096;

/// Threads per core for blocking file operations (see [`Runtime::start`]).
const BLOCKING_THREADS: usize = 8;

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
                return Err(
                    "cores must be at least 1 (a count); to run on CPU 0 alone, give the CPU \
                     list `0,`"
                        .into(),
                );
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
                    if a > b || b - a >= MAX_CPUS {
                        return Err(format!("bad CPU range {part:?} in {s:?}"));
                    }
                    list.extend(a..=b);
                    if list.len() > MAX_CPUS {
                        return Err(format!("more than {MAX_CPUS} CPUs in {s:?}"));
                    }
                }
                None => list.push(cpu(part)?),
            }
        }
        if list.len() > MAX_CPUS {
            return Err(format!("more than {MAX_CPUS} CPUs in {s:?}"));
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

    /// Refuse a CPU list naming a CPU this process may not run on (one the
    /// machine lacks, or outside its affinity mask): an executor pinned
    /// there would fail to start.
    pub fn check_available(&self) -> Result<(), String> {
        let CoreSet::List(list) = self else {
            return Ok(());
        };
        let Some(ids) = core_affinity::get_core_ids() else {
            return Ok(());
        };
        let available: Vec<usize> = ids.into_iter().map(|c| c.id).collect();
        match list.iter().find(|c| !available.contains(c)) {
            None => Ok(()),
            Some(c) => Err(format!(
                "CPU {c} is not one this process may run on (it may use {})",
                available
                    .iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            )),
        }
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
        let watchdog = Watchdog::start(cpus.len())?;
        let mut handles = Vec::new();
        for (i, cpu) in cpus.iter().copied().enumerate() {
            let main = main.clone();
            let warm = warm_dir.clone();
            let dog = watchdog.clone();
            let ctx = CoreContext {
                core: CoreId(i as u32),
                cores,
                cpu: Some(cpu),
            };
            // The threads that run this core's blocking file operations
            // (directory syncs, small files written atomically, listings:
            // what io_uring does not do), on its CPU. Several, so that a
            // core opening or closing many shards has their syncs in flight
            // together (the file system commits them together) rather than
            // one after another.
            let blocking = CpuSet::online()
                .map_err(|e| io::Error::other(format!("list the online CPUs: {e}")))?
                .filter(|c| c.cpu == cpu);
            let h = LocalExecutorBuilder::new(Placement::Fixed(cpu))
                .blocking_thread_pool_placement(PoolPlacement::Custom(vec![
                    blocking;
                    BLOCKING_THREADS
                ]))
                .name(&thread_name(i))
                // A timer-woken task (a long poll, a claim lapse) waits at
                // most this long behind CPU-bound work (default: 100 ms).
                .preempt_timer(std::time::Duration::from_millis(2))
                .spawn(move || async move {
                    // Deregisters when the executor's work ends, panics included.
                    let _registered = dog.register(i);
                    dog.set_phase(i, Phase::WarmingUp);
                    glommio::spawn_local(heartbeat(dog.clone(), i)).detach();
                    if let Some(dir) = warm {
                        warm_up_with_retries(&dir).await;
                    }
                    dog.set_phase(i, Phase::Running);
                    main(ctx).await
                })
                .map_err(|e| io::Error::other(format!("start executor on CPU {cpu}: {e}")))?;
            handles.push(h);
        }
        Ok(Runtime { handles, watchdog })
    }

    /// A handle that can wake this runtime's executors from any thread.
    pub fn kicker(&self) -> Kicker {
        Kicker(self.watchdog.clone())
    }

    /// Wait for every executor to finish.
    pub fn join(self) -> io::Result<()> {
        let result = self.handles.into_iter().try_for_each(|h| {
            h.join()
                .map(|_| ())
                .map_err(|e| io::Error::other(format!("executor failed: {e}")))
        });
        self.watchdog.stop.store(true, Ordering::Relaxed);
        result?;
        Ok(())
    }
}

/// How often an executor's heartbeat task runs.
pub const HEARTBEAT: Duration = Duration::from_millis(10);

/// How long an executor may miss its heartbeat before the watchdog wakes it.
const STUCK_AFTER: Duration = Duration::from_millis(100);

/// Count heartbeats for the watchdog.
async fn heartbeat(dog: Arc<Watchdog>, core: usize) {
    loop {
        dog.beats[core].fetch_add(1, Ordering::Relaxed);
        glommio::timer::sleep(HEARTBEAT).await;
    }
}

/// Wakes an executor that stays parked in `io_uring_enter` after what it
/// waits for has completed.
///
/// Seen on this kernel (6.18) under load, about one broker start in thirty
/// with two brokers starting at once: both executors asleep in
/// `io_uring_enter`, one with its first O_DIRECT read done, neither woken
/// even by its own timers (the heartbeat above stopped counting), the broker
/// never announced. Attaching a debugger released it at once: the
/// interrupted wait returns, glommio treats `EINTR` as a wake-up, looks at
/// its rings and finds the completion. The watchdog does the same with a
/// signal, only to an executor whose heartbeat has stopped for
/// [`STUCK_AFTER`], so a healthy core is never interrupted. The handler does
/// nothing and is installed with `SA_RESTART` (other system calls the
/// signal lands in are restarted; glommio's wait sees `EINTR`).
struct Watchdog {
    beats: Vec<AtomicU64>,
    phases: Vec<std::sync::atomic::AtomicU8>,
    /// Each executor's thread while it runs (locked while signalling it, so
    /// a thread is never signalled after it deregistered).
    threads: Vec<Mutex<Option<libc::pthread_t>>>,
    kicks: AtomicU64,
    stop: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn kick_signal() -> libc::c_int {
    libc::SIGRTMIN() + 5
}

extern "C" fn ignore_signal(_: libc::c_int) {}

impl Watchdog {
    fn start(cores: usize) -> io::Result<Arc<Watchdog>> {
        // SAFETY: installs a handler that does nothing for a signal no one
        // else in the process uses.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = ignore_signal as extern "C" fn(libc::c_int) as usize;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(kick_signal(), &sa, std::ptr::null_mut()) != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        let dog = Arc::new(Watchdog {
            beats: (0..cores).map(|_| AtomicU64::new(0)).collect(),
            phases: (0..cores).map(|_| Default::default()).collect(),
            threads: (0..cores).map(|_| Mutex::new(None)).collect(),
            kicks: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let d = dog.clone();
        std::thread::Builder::new()
            .name("felix-watchdog".into())
            .spawn(move || d.run())?;
        Ok(dog)
    }

    /// Called on the executor's own thread.
    fn register(self: &Arc<Self>, core: usize) -> Registered {
        // SAFETY: pthread_self has no preconditions.
        let me = unsafe { libc::pthread_self() };
        *lock(&self.threads[core]) = Some(me);
        Registered(self.clone(), core)
    }
}

/// Where an executor is in its life, for start-up diagnostics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The thread has not started running its executor yet.
    NotStarted = 0,
    /// Running the DMA warm-up.
    WarmingUp = 1,
    /// Running the core's own work.
    Running = 2,
}

impl Watchdog {
    fn set_phase(&self, core: usize, phase: Phase) {
        self.phases[core].store(phase as u8, Ordering::Relaxed);
    }
}

/// Wakes executors from outside (see [`Watchdog`]).
#[derive(Clone)]
pub struct Kicker(Arc<Watchdog>);

impl Kicker {
    /// Interrupt core `core`'s wait, if it is running: it looks at its
    /// rings again. Harmless to a core that was not stuck.
    pub fn kick(&self, core: usize) -> bool {
        let Some(slot) = self.0.threads.get(core) else {
            return false;
        };
        let thread = lock(slot);
        let Some(t) = *thread else {
            drop(thread);
            let unstarted = self.0.phases.get(core).map(|p| p.load(Ordering::Relaxed))
                == Some(Phase::NotStarted as u8);
            if unstarted && kick_unstarted(core) > 0 {
                self.0.kicks.fetch_add(1, Ordering::Relaxed);
                return true;
            }
            return false;
        };
        // SAFETY: as in `Watchdog::run`: the thread cannot finish while we
        // hold its slot.
        unsafe { libc::pthread_kill(t, kick_signal()) };
        self.0.kicks.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Where core `core` is, and how many heartbeats it has counted.
    pub fn phase(&self, core: usize) -> (Phase, u64) {
        let phase = match self.0.phases.get(core).map(|p| p.load(Ordering::Relaxed)) {
            Some(1) => Phase::WarmingUp,
            Some(2) => Phase::Running,
            _ => Phase::NotStarted,
        };
        let beats = self
            .0
            .beats
            .get(core)
            .map_or(0, |b| b.load(Ordering::Relaxed));
        (phase, beats)
    }

    /// Times an executor was woken this way, by the watchdog or by hand.
    pub fn kicks(&self) -> u64 {
        self.0.kicks.load(Ordering::Relaxed)
    }
}

/// An executor thread the watchdog may signal, until this is dropped (on
/// that thread, before it finishes).
struct Registered(Arc<Watchdog>, usize);

impl Drop for Registered {
    fn drop(&mut self) {
        *lock(&self.0.threads[self.1]) = None;
    }
}

impl Watchdog {
    fn run(&self) {
        let mut last: Vec<(u64, Instant)> = self
            .beats
            .iter()
            .map(|b| (b.load(Ordering::Relaxed), Instant::now()))
            .collect();
        while !self.stop.load(Ordering::Relaxed) {
            std::thread::park_timeout(HEARTBEAT * 2);
            let now = Instant::now();
            for (core, (seen, since)) in last.iter_mut().enumerate() {
                let beats = self.beats[core].load(Ordering::Relaxed);
                if beats != *seen {
                    (*seen, *since) = (beats, now);
                    continue;
                }
                if now.duration_since(*since) < STUCK_AFTER {
                    continue;
                }
                let thread = lock(&self.threads[core]);
                match *thread {
                    // SAFETY: the thread registered itself and cannot finish
                    // while we hold its slot (it deregisters under this lock).
                    Some(t) => unsafe {
                        libc::pthread_kill(t, kick_signal());
                    },
                    None if self.phases[core].load(Ordering::Relaxed)
                        == Phase::NotStarted as u8 =>
                    {
                        drop(thread);
                        // Parked before its first task ran (see
                        // `kick_unstarted`); it has not registered, so find
                        // it by name.
                        if kick_unstarted(core) == 0 {
                            *since = now;
                            continue;
                        }
                    }
                    None => continue,
                }
                self.kicks.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(core, "watchdog woke a stuck executor");
                *since = now;
            }
        }
    }
}

/// The name prefix of core `core`'s executor thread (glommio appends `-N`).
fn thread_name(core: usize) -> String {
    format!("felix-core-{core}")
}

/// Signal the threads of core `core` that has not started; returns how many.
///
/// glommio 0.9 can park an executor that still has a runnable task:
/// `run_task_queues` answers "nothing ran" both when every queue is empty
/// and when the preemption check fired before it ran anything, and the
/// executor parks on either. With a 2 ms preemption timer, an executor
/// thread that loses its CPU for 2 ms between arming the timer and running
/// its first task (two brokers starting at once on two CPUs) sleeps in
/// `io_uring_enter` with that task queued and nothing in flight to wake it;
/// about one start in 2,000 hung this way. Later in life the same slip is
/// caught by the heartbeat, but before the first task runs the thread has
/// not registered, so it is found by its name (`/proc/self/task/*/comm`,
/// which the kernel keeps to 15 bytes; `felix-core-NNN-` still fits) and
/// signalled with `tgkill`. The executor's wait returns `EINTR`, it looks
/// at its queues again and runs the task. glommio's own thread pool
/// threads carry the same name; a signal to them is a no-op (`SA_RESTART`).
fn kick_unstarted(core: usize) -> usize {
    let prefix = format!("{}-", thread_name(core));
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    let mut kicked = 0;
    for task in tasks.flatten() {
        let Some(tid) = task
            .file_name()
            .to_str()
            .and_then(|t| t.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        let Ok(comm) = std::fs::read_to_string(task.path().join("comm")) else {
            continue;
        };
        if comm.trim_end().starts_with(&prefix) {
            // SAFETY: tgkill to a thread of this process (the tgid check
            // makes a stale tid harmless); the handler does nothing.
            let rc = unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, kick_signal()) };
            if rc == 0 {
                kicked += 1;
            }
        }
    }
    kicked
}

/// How long one DMA warm-up may take before it is abandoned and retried.
const WARM_UP_DEADLINE: Duration = Duration::from_secs(2);
const WARM_UP_TRIES: u32 = 10;

/// [`warm_up_dma`], retried: about one executor start in a few hundred
/// (two brokers starting at once on two CPUs) the first O_DIRECT read of the
/// warm-up never completes, although the executor keeps running (its
/// heartbeat counts on). glommio only settles how it reads a disk once that
/// first read completes, so a core that gave up would meet the same stall at
/// its first segment open; abandoning the read and trying again with a new
/// file gets through.
async fn warm_up_with_retries(dir: &Path) {
    for attempt in 1..=WARM_UP_TRIES {
        match glommio::timer::timeout(WARM_UP_DEADLINE, async {
            warm_up_dma(dir).await.map_err(glommio::GlommioError::from)
        })
        .await
        {
            Ok(()) => {
                if attempt > 1 {
                    tracing::warn!(attempt, "DMA warm-up went through on a retry");
                }
                return;
            }
            Err(glommio::GlommioError::TimedOut(_)) => {
                tracing::warn!(
                    attempt,
                    "DMA warm-up in {} stalled for {WARM_UP_DEADLINE:?}; retrying",
                    dir.display()
                );
            }
            Err(e) => {
                tracing::warn!("DMA warm-up in {} failed: {e}", dir.display());
                return;
            }
        }
    }
    tracing::error!("DMA warm-up in {} never completed", dir.display());
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

    /// A core whose thread has not registered is found by its name and
    /// interrupted; threads of other cores are left alone.
    #[test]
    fn an_unstarted_core_is_woken_by_its_thread_name() {
        let dog = Watchdog::start(1).unwrap();
        let spawn_pauser = |name: &str| {
            let (tx, rx) = std::sync::mpsc::channel();
            let h = std::thread::Builder::new()
                .name(name.into())
                .spawn(move || {
                    tx.send(()).unwrap();
                    // SAFETY: pause only returns once a handled signal lands
                    // (it is never restarted, SA_RESTART or not).
                    unsafe { libc::pause() };
                })
                .unwrap();
            rx.recv().unwrap();
            h
        };
        let target = spawn_pauser(&format!("{}-1", thread_name(97)));
        let other = spawn_pauser(&format!("{}-2", thread_name(977)));
        // The thread may not have reached pause() yet: kick until it ends.
        let mut kicks = 0;
        while !target.is_finished() {
            kicks += kick_unstarted(97);
            std::thread::park_timeout(Duration::from_millis(5));
        }
        target.join().unwrap();
        assert!(kicks >= 1);
        assert!(!other.is_finished(), "another core's thread was signalled");
        assert_eq!(kick_unstarted(977), 1);
        while !other.is_finished() {
            kick_unstarted(977);
            std::thread::park_timeout(Duration::from_millis(5));
        }
        other.join().unwrap();
        dog.stop.store(true, Ordering::Relaxed);
    }

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
        // A huge range is refused before anything is built for it.
        assert!(CoreSet::parse("0-18446744073709551615").is_err());
        assert!(CoreSet::parse("0-4095").is_ok());
        assert!(CoreSet::parse("0-4095,5000").is_err());
        assert!(matches!(CoreSet::parse("3,"), Ok(CoreSet::List(v)) if v == vec![3]));
        assert!(CoreSet::parse("0").is_err());
        // CPUs the process may not run on are refused before any executor
        // is pinned there; counts are placed on the CPUs there are.
        let past = CoreSet::parse("0,4095").unwrap();
        if core_affinity::get_core_ids().is_some_and(|ids| ids.iter().all(|c| c.id != 4095)) {
            let e = past.check_available().unwrap_err();
            assert!(
                e.contains("CPU 4095 is not one this process may run on"),
                "{e}"
            );
        }
        if let Some(first) = core_affinity::get_core_ids().and_then(|ids| ids.first().copied()) {
            let one = CoreSet::parse(&format!("{},", first.id)).unwrap();
            assert!(one.check_available().is_ok());
        }
        assert!(CoreSet::parse("64").unwrap().check_available().is_ok());
        assert!(CoreSet::parse("x").is_err());
        assert!(CoreSet::parse("3-1").is_err());
        assert!(CoreSet::parse("1,1").is_err());
    }
}
