//! `felix-server`: the Felix broker.
//!
//! One glommio executor per configured core ([`felix_engine::runtime`]), each
//! listening on the same port (SO_REUSEPORT) and owning a disjoint set of
//! shards. A connection's HELLO names the core it wants; the accepting core
//! hands the socket to that core once, and from then on its requests are
//! served there without locks. See `docs/internals/` for the formats.

// Handlers return `Result<_, Response>` to answer a refusal directly; the
// error path builds one response per request, so its size does not matter.
#![allow(clippy::result_large_err)]

mod acl;
mod auth;
mod broker;
mod cluster;

pub mod config;
mod conn;
mod disk;
mod fds;
mod groups;
mod memory;
mod metrics;
pub mod process;
mod shard;
mod trim;

pub use config::{ClusterConfig, ClusterNode, Config, ConfigError, Overrides, Source};
use felix_engine::runtime::CoreSet;
use std::path::PathBuf;

/// What `felix serve` was asked on its command line.
#[derive(Clone, Debug, Default)]
pub struct ServeOptions {
    pub config_path: Option<PathBuf>,
    pub data_dir: Option<PathBuf>,
    pub listen: Option<String>,
    pub cores: Option<String>,
    /// `--node-id`: this broker's id in its cluster.
    pub node_id: Option<u64>,
    /// `--peers`: every broker of the cluster (see `cluster.nodes`).
    pub peers: Option<String>,
    pub print_config: bool,
}

/// Why the broker could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{0}")]
    Start(String),
}

/// Free memory glibc keeps at the top of a heap (`M_TRIM_THRESHOLD`), set
/// by [`tune_allocator`]; the allocator trimmer lowers it for a moment
/// (`trim.rs`).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const KEEP_FREE_TOP: libc::c_int = 256 << 20;

/// Make glibc's malloc keep memory it gets back for the next request rather
/// than returning it to the kernel at once, so that a busy process is not
/// page-faulting fresh zeroed pages for every large buffer.
///
/// glibc serves requests above its mmap threshold (128 KiB, raised on the
/// fly up to the largest block freed) with a fresh mapping each, and gives
/// back the top of a heap once more than 128 KiB of it is free. A broker
/// and its clients allocate and free megabyte buffers all the time (frames,
/// the pieces a flush writes), so each came back as new pages the kernel
/// had to fault in and zero: with 64 KiB publishes, setting the two
/// thresholds (32 MiB, glibc's most, and 256 MiB) cut the bench client's CPU
/// per GB by a third and the broker's by about a tenth (`perf/README.md`).
/// The cost is up to 256 MiB of freed memory kept per heap.
///
/// Called by [`serve`] and by `felix-bench`; a no-op off glibc, and when
/// `GLIBC_TUNABLES` sets malloc tunables (the operator's choice stands).
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("malloc.")) {
            return;
        }
        // SAFETY: mallopt only changes malloc's parameters; both values are
        // in range for these options.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, KEEP_FREE_TOP);
        }
    }
}

/// Run a broker until SIGTERM/SIGINT; returns after a clean shutdown.
pub fn serve(opts: ServeOptions) -> Result<(), ServeError> {
    tune_allocator();
    let config_path = opts.config_path.clone().or_else(|| {
        let default = PathBuf::from("felix.toml");
        default.exists().then_some(default)
    });
    let config = Config::load(
        config_path.as_deref(),
        &Overrides {
            data_dir: opts.data_dir.clone(),
            listen: opts.listen.clone(),
            cores: opts.cores.clone(),
            node_id: opts.node_id,
            peers: opts.peers.clone(),
        },
    )?;
    // Checked before --print-config returns, so that it refuses what
    // serving would.
    let cores = CoreSet::parse(&config.cores)
        .and_then(|c| c.check_available().map(|()| c))
        .map_err(|e| {
            ServeError::Config(ConfigError(format!(
                "server.cores = {:?} (from {}): {e}",
                config.cores,
                config.source_of("server", "cores")
            )))
        })?;
    if opts.print_config {
        print!("{}", config.render());
        for w in &config.warnings {
            println!("# warning: {w}");
        }
        return Ok(());
    }
    init_logging(&config.log);
    for w in &config.warnings {
        tracing::warn!("{w}");
    }
    fds::raise_limit();
    warn_if_real_time();
    let cpus = cores.cpus();
    match &config.data_dir {
        Some(d) => tracing::info!(data_dir = %d.display(), "durable storage"),
        None => {
            let banner = "RUNNING IN MEMORY: storage.data_dir is empty, so nothing survives a restart and consumer groups are disabled. Set FELIX_DURABLE_STORAGE_DIR or --data-dir for a durable broker.";
            tracing::warn!("{banner}");
            eprintln!("felix: WARNING: {banner}");
        }
    }
    broker::run(config, cpus).map_err(ServeError::Start)
}

/// A broker run under a real-time policy (`chrt -f`, `chrt -r`) has its
/// core threads, which never leave their CPUs idle for long under load,
/// starve the kernel's own workers on those CPUs, which complete its disk
/// I/O: seen here as a start-up that never finishes. Said, not refused.
fn warn_if_real_time() {
    // SAFETY: a plain query of this process's scheduling policy.
    let policy = unsafe { libc::sched_getscheduler(0) };
    if policy == libc::SCHED_FIFO || policy == libc::SCHED_RR {
        let msg = "the broker runs under a real-time scheduling policy (SCHED_FIFO or \
                   SCHED_RR): its core threads can starve the kernel workers that complete \
                   its disk I/O on their CPUs, and start-up may never finish; run it under \
                   the normal policy (pin it with --cores instead)";
        tracing::warn!("{msg}");
        eprintln!("felix: WARNING: {msg}");
    }
}

fn init_logging(filter: &str) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(filter)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colour for a terminal, plain text for a file or a pipe.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}
