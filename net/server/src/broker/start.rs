//! Starting the broker: the catalog loaded, the ports taken, one pinned
//! executor a core (`core_main`) and the start-up watched; and the tasks
//! each core runs beside its connections (retention, the disk guard,
//! turning connections away).

use super::signals::install_signal_thread;
use super::*;

/// What the broker calls itself in HELLO: its version, and which process
/// (the node of its cluster) answered.
fn broker_id(node: Option<u64>) -> String {
    let version = env!("CARGO_PKG_VERSION");
    let pid = std::process::id();
    match node {
        Some(n) => format!("felix {version} (node {n}, pid {pid})"),
        None => format!("felix {version} (pid {pid})"),
    }
}

fn shared_announce(
    shared: &Shared,
) -> std::sync::MutexGuard<'_, Option<(String, Option<std::net::SocketAddr>)>> {
    shared.announce.lock().unwrap()
}

/// Start the broker's cores on `cpus` and block until they exit.
pub(crate) fn run(config: Config, cpus: Vec<usize>) -> Result<(), String> {
    // First of all, so that no thread started from here on (glommio's
    // blocking pool included) takes a signal's default action: a stop
    // asked for from now on is the signal thread's (see there).
    let signals = install_signal_thread();
    // Before anything touches the disk or the port: a bad file stops here.
    let security = crate::auth::Security::load(&config)?;
    let durable = config.data_dir.is_some();
    // First, so a broker restarted straight after `kill -9` also waits out
    // the old process's I/O teardown before it touches the data directory.
    wait_for_port_to_free(&config.listen)?;
    let (metas, _dir_lock) = match &config.data_dir {
        Some(d) => {
            std::fs::create_dir_all(d).map_err(|e| {
                // "File exists" alone for a file or a dangling link in the way.
                let link = std::fs::symlink_metadata(d).is_ok_and(|m| m.file_type().is_symlink());
                let why = match std::fs::metadata(d) {
                    Err(t) if link && t.kind() == std::io::ErrorKind::NotFound => {
                        "it is a symbolic link to nothing (its target is missing)".to_string()
                    }
                    Ok(m) if !m.is_dir() && link => {
                        "it is a symbolic link to something that is not a directory".to_string()
                    }
                    Ok(m) if !m.is_dir() => "it exists and is not a directory".to_string(),
                    _ => e.to_string(),
                };
                format!("cannot create data directory {}: {why}", d.display())
            })?;
            // Held until this function returns, after every core has exited.
            let lock = catalog::DirLock::acquire(d)?;
            crate::cluster::check_membership(d, config.cluster.as_ref())?;
            (load_catalog(d)?, Some(lock))
        }
        None => (catalog::Loaded::default(), None),
    };
    for (name, why) in &metas.damaged {
        tracing::error!("{}", damaged_message(name, why));
    }
    let damaged: BTreeMap<StreamName, String> = metas.damaged.iter().cloned().collect();
    let metas = metas.streams;
    let cores = cpus.len() as u32;
    let mut senders = Vec::new();
    let mut receivers = Vec::new();
    for _ in 0..cores {
        let (tx, rx) =
            mailbox::channel().map_err(|e| format!("cannot make a core mailbox: {e}"))?;
        senders.push(tx);
        receivers.push(Some(rx));
    }
    let shared = Arc::new(Shared {
        config: config.clone(),
        cores,
        durable,
        catalog: Mutex::new(metas.iter().map(|m| (m.name.clone(), m.clone())).collect()),
        damaged,
        busy: Mutex::new(Default::default()),
        senders,
        connections: AtomicUsize::new(0),
        shutting_down: AtomicBool::new(false),
        ready: AtomicUsize::new(0),
        stopped: AtomicUsize::new(0),
        start_stage: (0..cores).map(|_| Default::default()).collect(),
        announce: Mutex::new(None),
        broker_id: broker_id(config.cluster.as_ref().map(|c| c.node_id)),
        kicker: std::sync::OnceLock::new(),
        security: Mutex::new(Arc::new(security)),
        security_gen: std::sync::atomic::AtomicU64::new(0),
        security_reloads: Default::default(),
        buffered: (0..cores).map(|_| Default::default()).collect(),
        trim: crate::trim::Handshake::new(cores as usize),
    });
    let receivers = Arc::new(Mutex::new(receivers));
    // Reserve the address up front (port 0 picks a free port), so a bad or
    // busy address fails fast with a clear message, and every core then
    // binds exactly the same port.
    let reservation = reserve_port(&config.listen)?;
    let listen = reservation.1.to_string();
    let metrics_listener = match &config.metrics_listen {
        Some(a) => {
            let l = bind_metrics(a)?;
            l.set_nonblocking(true).map_err(|e| e.to_string())?;
            Some(l)
        }
        None => None,
    };
    // Announced on stdout (scripts and tests read it) by the last core to be
    // ready: every stream open, every listener bound.
    let metrics_addr = match &metrics_listener {
        Some(l) => Some(l.local_addr().map_err(|e| e.to_string())?),
        None => None,
    };
    *shared_announce(&shared) = Some((listen.clone(), metrics_addr));
    let metrics_listener = Arc::new(Mutex::new(metrics_listener));
    // From here a stop signal stops the cores (they may be starting).
    let _ = signals.set(shared.clone());
    // After the signals are blocked: a thread inherits its mask.
    crate::trim::start(shared.clone());
    let warm = config.data_dir.clone();
    let sh = shared.clone();
    let metas = Arc::new(metas);
    let runtime = felix_engine::runtime::Runtime::start(&cpus, warm, move |ctx| {
        let shared = sh.clone();
        let rx = receivers.lock().unwrap()[ctx.core.0 as usize]
            .take()
            .expect("one mailbox per core");
        let metas = metas.clone();
        let listen = listen.clone();
        let metrics = if ctx.core.0 == 0 {
            metrics_listener.lock().unwrap().take()
        } else {
            None
        };
        async move {
            if shared.durable {
                let storage = felix_engine::storage::dma::DmaStorage::with_queue_depth(
                    shared.config.io_queue_depth,
                );
                core_main(ctx, shared, storage, rx, metas, listen, metrics).await;
            } else {
                let storage = felix_engine::storage::sim::SimStorage::new();
                core_main(ctx, shared, storage, rx, metas, listen, metrics).await;
            }
        }
    })
    .map_err(|e| e.to_string())?;
    let _ = shared.kicker.set(runtime.kicker());
    watch_start_up(shared.clone(), runtime.kicker());
    let r = runtime.join().map_err(|e| e.to_string());
    drop(reservation);
    r
}

const STAGES: [&str; 4] = [
    "starting",
    "opening its shards",
    "binding its listener",
    "ready",
];

fn set_stage(shared: &Shared, core: u32, stage: u8) {
    shared.start_stage[core as usize].store(stage, Ordering::Relaxed);
}

/// How long a stop signal waits for cores still starting before the
/// process exits without them (see [`watch_start_up`]).
const STOP_DURING_START_GRACE: Duration = Duration::from_secs(5);

/// Say so when start-up takes long, and which core is where; wake the
/// executors that are not ready (see `felix_engine::runtime::Kicker`: an
/// executor has been seen parked after its I/O completed). A stop asked
/// for while cores are still starting exits the process once
/// [`STOP_DURING_START_GRACE`] has passed without them.
fn watch_start_up(shared: Arc<Shared>, kicker: felix_engine::runtime::Kicker) {
    let spawned = std::thread::Builder::new()
        .name("felix-start-watch".into())
        .spawn(move || {
            let began = std::time::Instant::now();
            let mut next = Duration::from_secs(5);
            let mut stop_asked: Option<std::time::Instant> = None;
            loop {
                std::thread::park_timeout(Duration::from_millis(200));
                let ready = shared.ready.load(Ordering::SeqCst);
                if ready >= shared.cores as usize {
                    return;
                }
                if shared.shutting_down.load(Ordering::SeqCst) {
                    // A core takes its stop only once started: one that
                    // cannot start (a disk that does not answer) would
                    // leave the process up for good. A core's start-up is
                    // recovery, safe to cut at any point, so past a grace
                    // it is.
                    let asked = *stop_asked.get_or_insert_with(std::time::Instant::now);
                    // The cores that did start (and may have served) finish
                    // their stop first: only those that never started are
                    // cut off.
                    let started_ones_done = shared.stopped.load(Ordering::SeqCst) >= ready;
                    if asked.elapsed() >= STOP_DURING_START_GRACE
                        && started_ones_done
                        && shared.ready.load(Ordering::SeqCst) == ready
                    {
                        eprintln!(
                            "felix: stopped during start-up: {} of {} cores had not started \
                             {}s after the stop was asked for; exiting without a clean \
                             shutdown (the next start recovers as after a crash)",
                            shared.cores as usize - ready,
                            shared.cores,
                            STOP_DURING_START_GRACE.as_secs()
                        );
                        std::process::exit(1);
                    }
                    // Still woken below: a core parked by glommio can yet
                    // start, and stop cleanly.
                }
                if began.elapsed() < next {
                    continue;
                }
                next += Duration::from_secs(5);
                let mut where_ = Vec::new();
                for (core, st) in shared.start_stage.iter().enumerate() {
                    let st = st.load(Ordering::Relaxed) as usize;
                    if st + 1 < STAGES.len() {
                        let (phase, beats) = kicker.phase(core);
                        where_.push(format!(
                            "core {core} {} (executor {phase:?}, {beats} heartbeats)",
                            STAGES[st.min(STAGES.len() - 1)]
                        ));
                        kicker.kick(core);
                    }
                }
                eprintln!(
                    "felix: start-up has taken {}s ({}); waking those cores",
                    began.elapsed().as_secs(),
                    where_.join(", ")
                );
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot watch start-up: {e}");
    }
}

/// Read the stream catalog before the cores start (each core needs it to know
/// which shards to open), through the same storage seam as every other disk
/// access, on a short-lived executor of its own.
fn load_catalog(data_dir: &Path) -> Result<catalog::Loaded, String> {
    let dir = data_dir.to_path_buf();
    glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .name("felix-catalog")
        // A long preemption interval: glommio 0.9 can park an executor for
        // good if its preemption timer fires before the first task runs
        // (see `felix_engine::runtime`); this one runs a single short task.
        .preempt_timer(Duration::from_secs(1))
        .spawn(move || async move {
            let storage = felix_engine::storage::dma::DmaStorage::new();
            catalog::load(&storage, &dir).await
        })
        .map_err(|e| format!("cannot start an executor to read the catalog: {e}"))?
        .join()
        .map_err(|e| format!("reading the catalog failed: {e}"))?
}

/// How long start-up waits for a port held by a process that just died.
const PORT_GRACE: Duration = Duration::from_secs(10);

/// Refuse to share the listen port with a live listener.
///
/// The cores bind with `SO_REUSEPORT`, which would let a second broker (of
/// the same user) bind the same port and silently take half of its
/// connections. Worse, after `kill -9` the kernel tears a process's io_uring
/// down asynchronously, and for a moment its listening sockets still complete
/// handshakes (and then reset them). So before binding, connect to the port:
/// while something answers, wait (up to [`PORT_GRACE`]) for it to go away,
/// then refuse.
fn wait_for_port_to_free(addr: &str) -> Result<(), String> {
    use std::net::ToSocketAddrs;
    let Some(sa) = addr.to_socket_addrs().ok().and_then(|mut a| a.next()) else {
        return Ok(()); // reserve_port reports a bad address
    };
    // Only an address of this machine can be listened on; probing one that
    // is not would connect to whatever answers for it elsewhere.
    if !sa.ip().is_unspecified() {
        if let Err(e) = std::net::UdpSocket::bind(std::net::SocketAddr::new(sa.ip(), 0)) {
            return Err(format!(
                "cannot listen on {addr}: {} is not an address of this machine ({e})",
                sa.ip()
            ));
        }
    }
    if sa.port() == 0 {
        return Ok(());
    }
    let probe = if sa.ip().is_unspecified() {
        std::net::SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), sa.port())
    } else {
        sa
    };
    let taken = wait_while_taken(
        &format!("something still accepts connections on {addr}"),
        || std::net::TcpStream::connect_timeout(&probe, Duration::from_millis(200)).is_ok(),
    );
    if taken {
        return Err(format!(
            "cannot listen on {addr}: another process is accepting connections there \
             (another broker?); stop it or choose another --listen address"
        ));
    }
    Ok(())
}

/// Bind the metrics listener, waiting out a dying process's socket.
fn bind_metrics(addr: &str) -> Result<std::net::TcpListener, String> {
    let mut bound = None;
    wait_while_taken(&format!("metrics address {addr} is in use"), || {
        let r = std::net::TcpListener::bind(addr);
        let in_use = matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::AddrInUse);
        bound = Some(r);
        in_use
    });
    match bound {
        Some(Ok(l)) => Ok(l),
        Some(Err(e)) => Err(format!("cannot serve metrics on {addr}: {e}")),
        None => unreachable!("wait_while_taken asks at least once"),
    }
}

/// Ask `taken` every 100 ms until it answers false or [`PORT_GRACE`] has
/// passed, saying once on stderr that we wait (`what` says why). Returns
/// whether it was still taken.
fn wait_while_taken(what: &str, mut taken: impl FnMut() -> bool) -> bool {
    let began = std::time::Instant::now();
    let mut said = false;
    while taken() {
        if began.elapsed() >= PORT_GRACE {
            return true;
        }
        if !said {
            eprintln!(
                "felix: {what}; waiting up to {}s for it to close",
                PORT_GRACE.as_secs()
            );
            said = true;
        }
        std::thread::park_timeout(Duration::from_millis(100));
    }
    false
}

/// A bound (not listening) SO_REUSEPORT socket holding the broker's port
/// while the cores bind theirs; returns it and the resolved address.
fn reserve_port(addr: &str) -> Result<(std::os::fd::OwnedFd, std::net::SocketAddr), String> {
    use std::net::ToSocketAddrs;
    use std::os::fd::FromRawFd;
    let sa = addr
        .to_socket_addrs()
        .map_err(|e| format!("bad listen address {addr:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("listen address {addr:?} resolves to nothing"))?;
    let std::net::SocketAddr::V4(v4) = sa else {
        return Err(format!(
            "listen address {sa}: only IPv4 is supported for now"
        ));
    };
    // SAFETY: plain socket calls on a descriptor we own; the sockaddr is a
    // fully initialised sockaddr_in.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(format!("socket: {}", std::io::Error::last_os_error()));
        }
        let owned = std::os::fd::OwnedFd::from_raw_fd(fd);
        let one: libc::c_int = 1;
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_REUSEPORT,
            &one as *const _ as *const libc::c_void,
            4,
        );
        let mut sin: libc::sockaddr_in = std::mem::zeroed();
        sin.sin_family = libc::AF_INET as libc::sa_family_t;
        sin.sin_port = v4.port().to_be();
        sin.sin_addr.s_addr = u32::from_ne_bytes(v4.ip().octets());
        if libc::bind(
            fd,
            &sin as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in>() as u32,
        ) != 0
        {
            return Err(format!(
                "cannot listen on {addr}: {}",
                std::io::Error::last_os_error()
            ));
        }
        let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        libc::getsockname(fd, &mut sin as *mut _ as *mut libc::sockaddr, &mut len);
        let port = u16::from_be(sin.sin_port);
        Ok((
            owned,
            std::net::SocketAddr::new(std::net::IpAddr::V4(*v4.ip()), port),
        ))
    }
}

#[allow(clippy::too_many_arguments)] // the parts of one core, assembled once at start
async fn core_main<S: Storage>(
    ctx: CoreContext,
    shared: Arc<Shared>,
    storage: S,
    rx: mailbox::Receiver<CoreMsg>,
    metas: Arc<Vec<StreamMeta>>,
    listen: String,
    metrics: Option<std::net::TcpListener>,
) {
    set_stage(&shared, ctx.core.0, 1);
    let disk = crate::disk::DiskGuard::new(
        shared.config.data_dir.as_deref(),
        shared.config.min_free_bytes,
        shared.cores,
    );
    let core = Core::new(ctx, shared.clone(), storage, disk);
    report_disk(&core, core.disk.refresh());
    if let Err(e) = crate::cluster::start(&core).await {
        eprintln!("felix: core {}: {e}", core.core_id());
        std::process::exit(1);
    }
    // Every stream at once: its shards share the core's opening slots.
    let opening: Vec<_> = metas
        .iter()
        .map(|meta| {
            let core = core.clone();
            let meta = meta.clone();
            glommio::spawn_local(async move {
                let name = meta.name.clone();
                if let Err(e) = core.open_stream_only(meta).await {
                    // The failed shards refuse requests with the reason;
                    // everything else is served.
                    eprintln!("felix: WARNING: shards of {name} could not be opened: {e}");
                }
            })
        })
        .collect();
    for o in opening {
        o.await;
    }
    core.share_caches();
    set_stage(&shared, core.core_id(), 2);
    let listener = match glommio::net::TcpListener::bind(&listen) {
        Ok(l) => l,
        Err(e) => {
            eprintln!(
                "felix: core {}: cannot listen on {listen}: {e}",
                core.core_id()
            );
            std::process::exit(1);
        }
    };
    if core.core_id() == 0 {
        if let Some(l) = metrics {
            glommio::spawn_local(crate::metrics::serve_http(core.clone(), l)).detach();
        }
    }
    set_stage(&shared, core.core_id(), 3);
    if shared.ready.fetch_add(1, Ordering::SeqCst) + 1 == shared.cores as usize {
        if let Some((addr, metrics)) = shared_announce(&shared).take() {
            println!("felix: listening on {addr}");
            if let Some(m) = metrics {
                println!("felix: metrics on http://{m}/metrics");
            }
        }
        tracing::info!(
            listen = %listen,
            cores = shared.cores,
            durable = shared.durable,
            "felix broker ready"
        );
    }
    let mailbox = glommio::spawn_local(core.clone().run_mailbox(rx));
    let retention = glommio::spawn_local(run_retention(core.clone())).detach();
    let disk_watch = glommio::spawn_local(watch_disk(core.clone())).detach();
    let buffered_watch = glommio::spawn_local(share_buffered(core.clone())).detach();
    // Accept until told to stop.
    loop {
        let accept = listener.accept();
        let stop = async {
            core.until_stopping().await;
            Err(glommio::GlommioError::<()>::IoError(std::io::Error::other(
                "stopping",
            )))
        };
        match futures_lite::future::or(accept, stop).await {
            Ok(stream) => {
                let refusal = if crate::fds::near_limit(stream.as_raw_fd()) {
                    Some(Refusal::OpenFiles)
                } else {
                    let n = shared.connections.fetch_add(1, Ordering::Relaxed);
                    if n >= shared.config.max_connections as usize {
                        shared.connections.fetch_sub(1, Ordering::Relaxed);
                        Some(Refusal::Connections(n))
                    } else {
                        None
                    }
                };
                if let Some(why) = refusal {
                    core.metrics
                        .connections_refused
                        .set(core.metrics.connections_refused.get() + 1);
                    crate::conn::warn_rate_limited(&REFUSED_CONNECTION_LOG, || why.log_line());
                    refuse(&core, stream, why);
                    continue;
                }
                glommio::spawn_local(conn::serve(core.clone(), stream, Vec::new(), false)).detach();
            }
            Err(e) => {
                if core.stopping.get() {
                    break;
                }
                crate::conn::warn_rate_limited(&ACCEPT_FAILED_LOG, || {
                    format!("accept failed: {e}")
                });
                glommio::timer::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    drop(listener);
    mailbox.await;
    drop(retention);
    drop(disk_watch);
    drop(buffered_watch);
    core.drain_and_close().await;
    shared.stopped.fetch_add(1, Ordering::SeqCst);
    tracing::info!(core = core.core_id(), "core stopped");
}

thread_local! {
    /// When a core last logged a refused connection, or a failed accept.
    static REFUSED_CONNECTION_LOG: crate::conn::LogLimit = const { std::cell::Cell::new(None) };
    static ACCEPT_FAILED_LOG: crate::conn::LogLimit = const { std::cell::Cell::new(None) };
}

/// Why a new connection is turned away.
#[derive(Clone, Copy, Debug)]
enum Refusal {
    /// `server.max_connections` are open (this many).
    Connections(usize),
    /// Open files are within the reserve kept for storage (see `fds`).
    OpenFiles,
}

impl Refusal {
    fn log_line(self) -> String {
        match self {
            Refusal::Connections(n) => format!("connection refused: {n} open"),
            Refusal::OpenFiles => format!(
                "connection refused: open files are within {} of the limit of {}, kept for \
                 segment files; raise the open-file limit (ulimit -n, LimitNOFILE=)",
                crate::fds::reserve(crate::fds::limit()),
                crate::fds::limit()
            ),
        }
    }

    /// What the client is told.
    fn answer(self, limit: u64) -> String {
        match self {
            Refusal::Connections(_) => format!(
                "the broker is at its connection limit (server.max_connections = {limit}); \
                 try again later"
            ),
            Refusal::OpenFiles => "the broker is short of open files (the rest are kept for \
                 its storage); try again later"
                .to_string(),
        }
    }
}

/// Connections over `server.max_connections` being answered at once on a
/// core; past this many the rest are closed without an answer (a flood of
/// connections must not buy itself tasks and buffers).
const MAX_REFUSING: usize = 32;

/// How long a refused connection has to send its HELLO.
const REFUSE_WAIT: Duration = Duration::from_secs(1);

/// Close a connection over `server.max_connections`, answering its HELLO
/// with a typed `busy` error first, so the client reports (and backs off
/// on) a full broker rather than a connection reset. Reads at most one
/// small frame and waits at most [`REFUSE_WAIT`] for it.
fn refuse<S: Storage>(core: &Rc<Core<S>>, stream: glommio::net::TcpStream, why: Refusal) {
    if core.refusing.get() >= MAX_REFUSING {
        return;
    }
    core.refusing.set(core.refusing.get() + 1);
    let core = core.clone();
    glommio::spawn_local(async move {
        use futures_lite::{AsyncReadExt, AsyncWriteExt};
        let limit = core.shared.config.max_connections;
        let mut stream = stream;
        let answer = glommio::timer::timeout(REFUSE_WAIT, async {
            // A HELLO is small; anything that does not fit is not one.
            const MAX_HELLO: u32 = 4096;
            let mut buf = bytes::BytesMut::new();
            let mut chunk = [0u8; 1024];
            let id = loop {
                let n = stream.read(&mut chunk).await?;
                if n == 0 {
                    return Ok(());
                }
                buf.extend_from_slice(&chunk[..n]);
                match felix_wire::decode_request(&mut buf, MAX_HELLO) {
                    Ok(Some((id, _))) => break id,
                    Ok(None) => continue,
                    Err(e) => break e.request_id().unwrap_or(0),
                }
            };
            let mut out = bytes::BytesMut::new();
            felix_wire::encode_response(
                id,
                &wire_err(ErrorCode::Busy, why.answer(limit)),
                &mut out,
            );
            stream.write_all(&out).await?;
            stream.flush().await?;
            Ok(())
        })
        .await;
        if let Err(e) = answer {
            tracing::debug!("refused connection not answered: {e}");
        }
        let _ = stream.shutdown(std::net::Shutdown::Both).await;
        core.refusing.set(core.refusing.get() - 1);
    })
    .detach();
}

/// Tell the allocator trimmer the most this core's connections held in
/// the last second, once a second (what they hold at that instant could
/// miss a burst that came and went between two looks, and with it the
/// trim after it), and answer the trim it asks for after a burst.
async fn share_buffered<S: Storage>(core: Rc<Core<S>>) {
    let index = core.ctx.core.0 as usize;
    let me = &core.shared.buffered[index];
    while !core.stopping.get() {
        me.store(core.budget.take_recent_peak() as u64, Ordering::Relaxed);
        core.shared.trim.answer(index);
        glommio::timer::sleep(Duration::from_secs(1)).await;
    }
}

/// Look at the data disk's free space every [`crate::disk::REFRESH`].
async fn watch_disk<S: Storage>(core: Rc<Core<S>>) {
    if core.shared.config.data_dir.is_none() {
        return;
    }
    while !core.stopping.get() {
        glommio::timer::sleep(crate::disk::REFRESH).await;
        report_disk(&core, core.disk.refresh());
    }
}

/// Log the disk guard's transitions (core 0 only: they all see one disk).
fn report_disk<S: Storage>(core: &Core<S>, change: Option<bool>) {
    if core.ctx.core.0 != 0 {
        return;
    }
    match change {
        Some(true) => tracing::warn!("{}", core.disk.check(0).err().unwrap_or_default()),
        Some(false) => tracing::info!("the data disk has room again; publishes are served"),
        None => {}
    }
}

async fn run_retention<S: Storage>(core: Rc<Core<S>>) {
    let every = Duration::from_millis(core.shared.config.retention_check_ms);
    loop {
        glommio::timer::sleep(every).await;
        if core.stopping.get() {
            return;
        }
        let shards: Vec<Rc<Shard<S>>> = core
            .streams
            .borrow()
            .values()
            .flat_map(|ls| ls.shards.iter().filter_map(|s| s.open().cloned()))
            .collect();
        for s in shards {
            // Deleted since the list was taken (a stream of that name may
            // exist again, with files at the same paths).
            if s.deleted.get() {
                continue;
            }
            if let Err(e) = s.log.enforce_retention(now_ms()).await {
                tracing::error!("retention on {}: {e}", s.name());
            }
        }
    }
}
