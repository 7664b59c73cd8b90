//! The four workloads, written once against [`Target`].

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use hdrhistogram::Histogram;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, Semaphore};

use crate::cli::{Amount, Common, E2eArgs, PublishArgs, QueueArgs, ReadArgs, Via, STAMP_BYTES};
use crate::harness::{self, fmt_int, new_histogram, record, Latencies, Run, StopReason};
use crate::report::{Check, Outcome};
use crate::targets::{Handle, PubRx, PubTx, Target};

/// A consumer polls a shard again at once when it got records, and waits
/// this long for records when there were none.
const IDLE_WAIT: Duration = Duration::from_millis(100);
/// How long consumers keep polling an empty queue that is not drained
/// before calling it stuck.
const STALL: Duration = Duration::from_secs(15);

/// Shards worker `i` of `workers` serves: i, i+W, ... or, with more
/// workers than shards, shard i mod S.
pub fn shards_for(i: usize, workers: usize, shards: u32) -> Vec<u32> {
    let s = shards as usize;
    if workers >= s {
        vec![(i % s) as u32]
    } else {
        (i..s).step_by(workers).map(|x| x as u32).collect()
    }
}

/// `n` records spread over `shards`: shard i gets n/S, the first n%S one more.
pub fn split(n: u64, shards: u32) -> Vec<u64> {
    let s = u64::from(shards);
    (0..s).map(|i| n / s + u64::from(i < n % s)).collect()
}

/// A fixed payload of `size` bytes. Static (one small leak a size), so
/// that the `Bytes` a batch repeats it as are plain copies: clones of a
/// shared `Bytes` each touch its reference count atomically, a hundred a
/// batch, which cost the client CPU it shares with the broker.
fn payload(size: usize) -> Bytes {
    static MADE: std::sync::Mutex<Vec<&'static [u8]>> = std::sync::Mutex::new(Vec::new());
    let mut made = MADE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    // One per size for the whole process, not one a producer.
    let bytes = match made.iter().find(|b| b.len() == size) {
        Some(b) => *b,
        None => {
            let b: Vec<u8> = (0..size).map(|i| b'a' + (i % 26) as u8).collect();
            let b: &'static [u8] = Box::leak(b.into_boxed_slice());
            made.push(b);
            b
        }
    };
    Bytes::from_static(bytes)
}

/// `n` payloads of `size` bytes, each carrying the batch's intended send
/// time and its own sequence number (`seq + 1`, `seq + 2`, ...): slices of
/// one buffer, one allocation for the batch.
fn stamped(n: usize, size: usize, intended_ns: u64, seq: u64) -> Vec<Bytes> {
    let mut b = BytesMut::with_capacity(n * size);
    for i in 0..n as u64 {
        let at = b.len();
        b.put_u64_le(intended_ns);
        b.put_u64_le(seq + 1 + i);
        b.resize(at + size, b'x');
    }
    let b = b.freeze();
    (0..n).map(|i| b.slice(i * size..(i + 1) * size)).collect()
}

fn stamp_of(p: &[u8]) -> Option<u64> {
    (p.len() >= STAMP_BYTES).then(|| u64::from_le_bytes(p[..8].try_into().expect("8 bytes")))
}

/// Publish `n` records per shard as fast as the target takes them (not
/// measured). Returns the records acknowledged.
pub async fn prefill(
    target: &Target,
    per_shard: &[u64],
    record_size: usize,
    quiet: bool,
) -> Result<u64, String> {
    let total: u64 = per_shard.iter().sum();
    let started = Instant::now();
    // Batches of at most about 8 MiB, well inside a broker's frame cap.
    let most = (8 << 20) / record_size.max(1) as u64;
    let batch: u64 = match target {
        Target::Felix(_) => 1000,
        _ => 200,
    }
    .min(most)
    .max(1);
    let payload = payload(record_size);
    let done = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for (shard, &n) in per_shard.iter().enumerate() {
        if n == 0 {
            continue;
        }
        let (mut tx, mut rx) = target.producer(shard).await?;
        let payload = payload.clone();
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            let sem = Arc::new(Semaphore::new(16));
            let (ch_tx, mut ch_rx) = mpsc::unbounded_channel();
            let completer = tokio::spawn(async move {
                let mut acked = 0u64;
                while let Some((ticket, permit)) = ch_rx.recv().await {
                    acked += rx.complete(ticket).await?;
                    drop(permit);
                }
                Ok::<u64, String>(acked)
            });
            let mut sent = 0u64;
            while sent < n {
                let permit = sem.clone().acquire_owned().await.expect("open semaphore");
                let k = batch.min(n - sent);
                let ticket = tx
                    .send(shard as u32, vec![payload.clone(); k as usize])
                    .await?;
                if ch_tx.send((ticket, permit)).is_err() {
                    break;
                }
                sent += k;
                done.fetch_add(k, Ordering::Relaxed);
            }
            drop(ch_tx);
            completer.await.map_err(|e| e.to_string())?
        }));
    }
    let watcher = {
        let done = done.clone();
        tokio::spawn(async move {
            if quiet {
                return;
            }
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                eprintln!(
                    "prefill: {} of {} records sent",
                    fmt_int(done.load(Ordering::Relaxed)),
                    fmt_int(total)
                );
            }
        })
    };
    let mut acked = 0;
    let mut failure = None;
    for t in tasks {
        match t.await.map_err(|e| e.to_string()).and_then(|r| r) {
            Ok(n) => acked += n,
            Err(e) => failure = failure.or(Some(e)),
        }
    }
    watcher.abort();
    if let Some(e) = failure {
        return Err(format!("prefill failed: {e}"));
    }
    if !quiet {
        let secs = started.elapsed().as_secs_f64();
        eprintln!(
            "prefill: {} records in {secs:.1}s ({} rec/s)",
            fmt_int(acked),
            harness::fmt_count(acked as f64 / secs.max(1e-9))
        );
    }
    Ok(acked)
}

// ------------------------------------------------------------------ pacing

/// A timer with the kernel's resolution that wakes a task on the client's
/// own runtime: a `timerfd` its reactor watches. tokio's timer has 1 ms
/// granularity, which would add up to a millisecond of the bench's own
/// lateness to every latency counted from the intended send time; a thread
/// sleeping for each batch and handing it over costs two wake-ups a batch
/// (its own and the runtime's), on CPUs the client shares with the broker.
struct Pacer {
    fd: AsyncFd<std::os::fd::OwnedFd>,
}

/// The longest a paced producer waits without looking at the run's state.
const PACER_STEP: Duration = Duration::from_millis(50);

impl Pacer {
    fn new() -> std::io::Result<Pacer> {
        use std::os::fd::FromRawFd;
        // SAFETY: plain syscall; the descriptor it returns is owned below.
        let fd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor no one else owns.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        // SAFETY: the descriptor is open and owned by the `OwnedFd` the
        // AsyncFd keeps until it is dropped; it always returns that one.
        let fd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
            .map_err(std::io::Error::from)?;
        Ok(Pacer { fd })
    }

    /// Return at `at` (at once if it has passed).
    async fn until(&self, at: Instant) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let now = Instant::now();
        if at <= now {
            return Ok(());
        }
        let d = at - now;
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: d.as_secs() as libc::time_t,
                // Never 0 with 0 seconds: that would disarm the timer.
                tv_nsec: d.subsec_nanos().max(1) as libc::c_long,
            },
        };
        let fd = self.fd.get_ref().as_raw_fd();
        // SAFETY: arming our own timer with a valid itimerspec.
        if unsafe { libc::timerfd_settime(fd, 0, &spec, std::ptr::null_mut()) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        loop {
            let mut ready = self.fd.readable().await?;
            let mut expirations = 0u64;
            // SAFETY: reading the 8-byte expiration count into a u64.
            let n = unsafe { libc::read(fd, (&raw mut expirations).cast(), 8) };
            if n == 8 {
                // One-shot: nothing more to read until it is armed again.
                ready.clear_ready();
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::WouldBlock {
                return Err(e);
            }
            ready.clear_ready();
        }
    }
}

/// What a producer sends and how.
#[derive(Debug, Clone)]
struct ProducerPlan {
    shards: Vec<u32>,
    batch: usize,
    inflight: usize,
    record_size: usize,
    /// Paced: time between this producer's batches, and its first one.
    pace: Option<(Instant, Duration)>,
    /// Stamp each payload with its intended send time (e2e).
    stamp: bool,
    /// e2e: the publish-to-delivery latencies, where records never sent
    /// count too (one sample a record, as delivered records are counted).
    delivery: Option<Arc<Latencies>>,
}

/// Run one producer until the run stops; returns records acknowledged.
async fn producer(
    run: Arc<Run>,
    mut tx: PubTx,
    mut rx: PubRx,
    plan: ProducerPlan,
    lat: Arc<Latencies>,
) -> u64 {
    let sem = Arc::new(Semaphore::new(plan.inflight));
    let (ch_tx, mut ch_rx) = mpsc::unbounded_channel();
    let size = plan.record_size as u64;
    let crun = run.clone();
    let clat = lat.clone();
    let completer = tokio::spawn(async move {
        let mut hist = new_histogram();
        let mut acked = 0u64;
        while let Some((ticket, intended, permit)) = ch_rx.recv().await {
            match rx.complete(ticket).await {
                Ok(n) => {
                    acked += n;
                    let now = Instant::now();
                    if crun.complete(intended, n, n * size) {
                        record(&mut hist, (now - intended).as_nanos() as u64, 1);
                    }
                }
                Err(e) => {
                    crun.error(format!("publish: {e}"));
                    crun.request_stop(StopReason::Error);
                }
            }
            drop(permit);
        }
        clat.add(&hist);
        acked
    });
    let fixed = payload(plan.record_size);
    let pacer = match plan.pace.map(|_| Pacer::new()).transpose() {
        Ok(p) => p,
        Err(e) => {
            run.error(format!("cannot make the pacing timer: {e}"));
            run.request_stop(StopReason::Error);
            None
        }
    };
    let mut k = 0u64;
    let mut seq = 0u64;
    loop {
        let Ok(permit) = sem.clone().acquire_owned().await else {
            break;
        };
        let intended = match (&pacer, plan.pace) {
            (Some(p), Some((base, iv))) => {
                let at = base + iv.mul_f64(k as f64);
                // In steps of at most 50 ms, so that a slow rate still sees
                // the run's end (or an error) promptly.
                loop {
                    // A batch due at or after the end is never sent: the
                    // run is over for this producer (admit says so below).
                    if run.stopping() || run.stop_at().is_some_and(|s| at >= s) {
                        break;
                    }
                    let now = Instant::now();
                    if at <= now {
                        break;
                    }
                    if let Err(e) = p.until(at.min(now + PACER_STEP)).await {
                        run.error(format!("pacing timer: {e}"));
                        run.request_stop(StopReason::Error);
                    }
                }
                if run.stopping() && run.stop_at().is_none_or(|s| at < s) {
                    break;
                }
                at
            }
            (None, Some(_)) => break,
            _ => Instant::now(),
        };
        let Some(n) = run.admit(intended, plan.batch as u64) else {
            break;
        };
        let shard = plan.shards[(k % plan.shards.len() as u64) as usize];
        let payloads: Vec<Bytes> = if plan.stamp {
            let v = stamped(n as usize, plan.record_size, harness::ns_of(intended), seq);
            seq += n;
            v
        } else {
            vec![fixed.clone(); n as usize]
        };
        match tx.send(shard, payloads).await {
            Ok(ticket) => {
                if ch_tx.send((ticket, intended, permit)).is_err() {
                    break;
                }
            }
            Err(e) => {
                run.error(format!("publish: {e}"));
                run.request_stop(StopReason::Error);
                break;
            }
        }
        k += 1;
    }
    drop(ch_tx);
    if run.stop_reason() == StopReason::Duration {
        if let (Some((base, iv)), Some(end)) = (plan.pace, run.stop_at()) {
            lat.add(&missed_batches(&run, base, iv, k, end, 1));
            if let Some(d) = &plan.delivery {
                d.add(&missed_batches(&run, base, iv, k, end, plan.batch as u64));
            }
        }
    }
    completer.await.unwrap_or(0)
}

/// Batches from `first` on that fell due before `end` and were never sent
/// (the producer was held up: every batch in flight, or a send blocked).
/// Each has waited at least until `end`, and counts so (`samples` times: 1
/// for a batch's acknowledgement, its records for their delivery): leaving
/// them out would drop exactly the waits a corrected latency exists to show.
fn missed_batches(
    run: &Run,
    base: Instant,
    interval: Duration,
    first: u64,
    end: Instant,
    samples: u64,
) -> Histogram<u64> {
    let mut missed = new_histogram();
    for k in first.. {
        let intended = base + interval.mul_f64(k as f64);
        if intended >= end {
            break;
        }
        if run.is_measured(intended) {
            record(&mut missed, (end - intended).as_nanos() as u64, samples);
        }
    }
    missed
}

/// Run the measured phase: the clock starts now.
fn start_progress(common: &Common, run: &Arc<Run>) -> Arc<AtomicBool> {
    let done = Arc::new(AtomicBool::new(false));
    if let Some(every) = common.progress {
        tokio::spawn(harness::progress(
            run.clone(),
            every,
            common.record_size,
            done.clone(),
        ));
    }
    done
}

/// Stop the run at its end time even if every worker is blocked.
fn start_deadline(run: &Arc<Run>) {
    if let Some(at) = run.stop_at() {
        let run = run.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(at.into()).await;
            run.request_stop(StopReason::Duration);
        });
    }
}

async fn sum_stored(target: &Target, shards: u32) -> Result<u64, String> {
    let mut n = 0;
    for s in 0..shards {
        n += target.stored(s).await?;
    }
    Ok(n)
}

// ------------------------------------------------------------------ publish

pub async fn publish(target: &Target, c: &Common, a: &PublishArgs) -> Result<Outcome, String> {
    target.create().await?;
    let run = Run::new(c.warmup, c.amount);
    let lat = Arc::new(Latencies::default());
    let per_producer_rate = a.rate.map(|r| r / a.producers as f64);
    let mut tasks = Vec::new();
    for i in 0..a.producers {
        let (tx, rx) = target.producer(i).await?;
        let pace = per_producer_rate.map(|r| {
            let iv = Duration::from_secs_f64(a.batch as f64 / r);
            // Stagger producers across one interval.
            (
                run.started() + iv.mul_f64(i as f64 / a.producers as f64),
                iv,
            )
        });
        let plan = ProducerPlan {
            shards: shards_for(i, a.producers, c.shards),
            batch: a.batch,
            inflight: a.inflight,
            record_size: c.record_size,
            pace,
            stamp: false,
            delivery: None,
        };
        tasks.push(tokio::spawn(producer(
            run.clone(),
            tx,
            rx,
            plan,
            lat.clone(),
        )));
    }
    let progress = start_progress(c, &run);
    start_deadline(&run);
    let mut acked = 0;
    for t in tasks {
        acked += t.await.map_err(|e| e.to_string())?;
    }
    progress.store(true, Ordering::Relaxed);
    let mut out = Outcome::new(&run, lat.take(), "publish acknowledgement, per batch");
    out.totals.published = Some(acked);
    // With queued acks (and peers that acknowledge before they write) the
    // last records become visible a moment after their acknowledgement.
    let mut stored = 0;
    for attempt in 0..30 {
        match sum_stored(target, c.shards).await {
            Ok(n) => stored = n,
            Err(e) => {
                out.checks
                    .push(Check::failed("records stored = records acknowledged", e));
                return Ok(out);
            }
        }
        if stored == acked || (stored > acked && !target.counts_exactly()) || attempt == 29 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if target.counts_exactly() {
        out.checks.push(Check::equal(
            "records stored = records acknowledged",
            stored,
            acked,
        ));
    } else {
        // Each new leader's generation start takes an offset as well.
        let name = "offsets stored >= records acknowledged";
        out.checks.push(if stored >= acked {
            Check::passed(
                name,
                format!(
                    "{stored} >= {acked} ({} offsets taken by generation starts)",
                    stored - acked
                ),
            )
        } else {
            Check::failed(name, format!("{stored} < {acked}"))
        });
    }
    Ok(out)
}

// ------------------------------------------------------------------ read

pub async fn read(target: &Target, c: &Common, a: &ReadArgs) -> Result<Outcome, String> {
    target.create().await?;
    let per_shard = split(a.prefill, c.shards);
    let published = prefill(target, &per_shard, c.record_size, c.progress.is_none()).await?;
    let per_shard = Arc::new(per_shard);
    let readers = a.readers.unwrap_or(c.shards as usize);
    let run = Run::new(c.warmup, c.amount);
    let lat = Arc::new(Latencies::default());
    let short = Arc::new(AtomicU64::new(0));
    let passes = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for i in 0..readers {
        let mut reader = target.reader(i).await?;
        let shards = shards_for(i, readers, c.shards);
        let (run, lat, per_shard, short, passes) = (
            run.clone(),
            lat.clone(),
            per_shard.clone(),
            short.clone(),
            passes.clone(),
        );
        let max = a.max_records;
        tasks.push(tokio::spawn(async move {
            let mut hist = new_histogram();
            let mut read_total = 0u64;
            'run: loop {
                for &shard in &shards {
                    let want = per_shard[shard as usize];
                    if let Err(e) = reader.seek_start(shard).await {
                        run.error(format!("read: {e}"));
                        run.request_stop(StopReason::Error);
                        break 'run;
                    }
                    let mut got = 0u64;
                    let mut empty_since: Option<Instant> = None;
                    while got < want {
                        if run.stopping() {
                            break 'run;
                        }
                        let ask = max.min((want - got).min(u64::from(u32::MAX)) as u32);
                        let t0 = Instant::now();
                        match reader.read(shard, ask, Duration::ZERO).await {
                            Ok(records) => {
                                let n = records.len() as u64;
                                if n == 0 {
                                    let since = *empty_since.get_or_insert(t0);
                                    if since.elapsed() > Duration::from_secs(5) {
                                        short.fetch_add(1, Ordering::Relaxed);
                                        run.error(format!("read: shard {shard} ended after {got} of {want} records"));
                                        run.request_stop(StopReason::Error);
                                        break 'run;
                                    }
                                    continue;
                                }
                                empty_since = None;
                                got += n;
                                read_total += n;
                                let bytes: u64 = records.iter().map(|p| p.len() as u64).sum();
                                if run.complete(t0, n, bytes) {
                                    record(&mut hist, t0.elapsed().as_nanos() as u64, 1);
                                }
                            }
                            Err(e) => {
                                run.error(format!("read: {e}"));
                                run.request_stop(StopReason::Error);
                                break 'run;
                            }
                        }
                    }
                    if got > want {
                        short.fetch_add(1, Ordering::Relaxed);
                        run.error(format!("read: shard {shard} gave {got} records, {want} were published"));
                    }
                    passes.fetch_add(1, Ordering::Relaxed);
                }
            }
            lat.add(&hist);
            read_total
        }));
    }
    let progress = start_progress(c, &run);
    start_deadline(&run);
    let mut read_total = 0;
    for t in tasks {
        read_total += t.await.map_err(|e| e.to_string())?;
    }
    progress.store(true, Ordering::Relaxed);
    let mut out = Outcome::new(&run, lat.take(), "read request round trip");
    out.totals.published = Some(published);
    out.totals.read = Some(read_total);
    out.totals.passes = Some(passes.load(Ordering::Relaxed));
    out.checks.push(Check::equal(
        "prefill acknowledged = requested",
        published,
        a.prefill,
    ));
    out.checks.push(Check::equal(
        "every completed pass read exactly the shard's records",
        short.load(Ordering::Relaxed),
        0,
    ));
    Ok(out)
}

// ------------------------------------------------------------------ queue

/// Deterministic "random" choice of which first deliveries to nack, so runs
/// repeat: a 64-bit mix of the payload's position.
fn nack_this(seq: u64, rate: f64) -> bool {
    if rate <= 0.0 {
        return false;
    }
    let mut x = seq.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    (x as f64 / u64::MAX as f64) < rate
}

pub async fn queue(
    target: &Target,
    c: &Common,
    a: &QueueArgs,
    backlog: u64,
) -> Result<Outcome, String> {
    target.create().await?;
    let per_shard = split(backlog, c.shards);
    let published = prefill(target, &per_shard, c.record_size, c.progress.is_none()).await?;
    let run = Run::new(c.warmup, c.amount);
    let lat = Arc::new(Latencies::default());
    let acked_total = Arc::new(AtomicU64::new(0));
    let delivered = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for i in 0..a.consumers {
        let mut consumer = target.consumer(i, a.ack_inflight).await?;
        let shards = shards_for(i, a.consumers, c.shards);
        let (run, lat, acked_total, delivered) = (
            run.clone(),
            lat.clone(),
            acked_total.clone(),
            delivered.clone(),
        );
        let (per_poll, nack_rate) = (a.per_poll, a.nack_rate);
        // Paced: this consumer's share of --rate, from its first poll.
        let share = a.rate.map(|r| r / a.consumers as f64);
        tasks.push(tokio::spawn(async move {
            let mut hist = new_histogram();
            let mut idle_since: Option<Instant> = None;
            let mut k = 0usize;
            let mut seq = (i as u64) << 40;
            let paced_from = Instant::now();
            let mut taken = 0u64;
            while !run.stopping() {
                if let Some(share) = share {
                    // The next poll is due once what was taken so far is.
                    let due = paced_from + Duration::from_secs_f64(taken as f64 / share);
                    if due > Instant::now() {
                        tokio::time::sleep_until(due.into()).await;
                        continue;
                    }
                }
                let shard = shards[k % shards.len()];
                k += 1;
                let t0 = Instant::now();
                let batch = match consumer.poll(shard, per_poll, IDLE_WAIT).await {
                    Ok(b) => b,
                    Err(e) => {
                        run.error(format!("poll: {e}"));
                        run.request_stop(StopReason::Error);
                        break;
                    }
                };
                if batch.is_empty() {
                    if acked_total.load(Ordering::Relaxed) >= published {
                        run.request_stop(StopReason::Drained);
                        break;
                    }
                    let since = *idle_since.get_or_insert(t0);
                    if since.elapsed() > STALL {
                        run.error(format!(
                            "queue stalled: nothing to poll for {}s with {} of {} records acknowledged",
                            STALL.as_secs(),
                            acked_total.load(Ordering::Relaxed),
                            published
                        ));
                        run.request_stop(StopReason::Error);
                        break;
                    }
                    continue;
                }
                idle_since = None;
                taken += batch.len() as u64;
                let measured = run.is_measured(t0);
                if measured {
                    record(&mut hist, t0.elapsed().as_nanos() as u64, 1);
                }
                delivered.fetch_add(batch.len() as u64, Ordering::Relaxed);
                let mut acks: Vec<Handle> = Vec::with_capacity(batch.len());
                let mut bytes = 0u64;
                for d in batch {
                    if d.attempts > 1 {
                        run.redeliveries.fetch_add(1, Ordering::Relaxed);
                    }
                    seq += 1;
                    if d.attempts == 1 && nack_this(seq, nack_rate) {
                        run.nacks.fetch_add(1, Ordering::Relaxed);
                        if let Err(e) = consumer.nack(shard, d.handle).await {
                            run.error(format!("nack: {e}"));
                        }
                        continue;
                    }
                    bytes += d.payload.len() as u64;
                    acks.push(d.handle);
                }
                let n = acks.len() as u64;
                if let Err(e) = consumer.ack(shard, acks).await {
                    run.error(format!("ack: {e}"));
                    run.request_stop(StopReason::Error);
                    break;
                }
                let total = acked_total.fetch_add(n, Ordering::Relaxed) + n;
                run.complete(t0, n, bytes);
                if total >= published {
                    run.request_stop(StopReason::Drained);
                }
            }
            if let Err(e) = consumer.finish().await {
                run.error(format!("ack: {e}"));
            }
            lat.add(&hist);
        }));
    }
    let progress = start_progress(c, &run);
    start_deadline(&run);
    for t in tasks {
        t.await.map_err(|e| e.to_string())?;
    }
    progress.store(true, Ordering::Relaxed);
    let acked = acked_total.load(Ordering::Relaxed);
    let mut out = Outcome::new(&run, lat.take(), "poll round trip");
    out.offered_rate = a.rate;
    out.totals.published = Some(published);
    out.totals.acked = Some(acked);
    out.totals.delivered = Some(delivered.load(Ordering::Relaxed));
    out.totals.nacked = Some(run.nacks.load(Ordering::Relaxed));
    out.totals.redelivered = Some(run.redeliveries.load(Ordering::Relaxed));
    out.checks.push(Check::equal(
        "backlog acknowledged = requested",
        published,
        backlog,
    ));
    let exact =
        a.nack_rate == 0.0 || acked >= published || target.kind() != crate::cli::TargetKind::Felix;
    if exact {
        // Acknowledgements may be applied a moment after they are sent
        // (NATS acks are not confirmed; with sync_interval always each one is
        // synced): look again for up to ten seconds.
        let want = published.saturating_sub(acked);
        let mut left = 0;
        for attempt in 0..100 {
            left = 0;
            for s in 0..c.shards {
                match target.unfinished(s).await {
                    Ok(Some(n)) => left += n,
                    Ok(None) => {
                        out.checks.push(Check::skipped(
                            "records left unfinished = backlog - acknowledged",
                            "not checked: the broker does not report a group's lag (Redis before 7.0)",
                        ));
                        return Ok(out);
                    }
                    Err(e) => {
                        out.checks.push(Check::failed(
                            "records left unfinished = backlog - acknowledged",
                            e,
                        ));
                        return Ok(out);
                    }
                }
            }
            if left == want || attempt == 99 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        out.checks.push(Check::equal(
            "records left unfinished = backlog - acknowledged",
            left,
            want,
        ));
    } else {
        out.checks.push(Check::skipped(
            "records left unfinished = backlog - acknowledged",
            "not checked: nacked records not yet redelivered leave holes below the position",
        ));
    }
    Ok(out)
}

// ------------------------------------------------------------------ e2e

pub async fn e2e(target: &Target, c: &Common, a: &E2eArgs) -> Result<Outcome, String> {
    target.create().await?;
    let consumers = a.consumers.unwrap_or(c.shards as usize);
    let run = Run::new(c.warmup, c.amount);
    let lat = Arc::new(Latencies::default());
    let publish_lat = Arc::new(Latencies::default());
    let received = Arc::new(AtomicU64::new(0));
    let published = Arc::new(AtomicU64::new(0));
    let producers_done = Arc::new(AtomicBool::new(false));
    let mut ctasks = Vec::new();
    // Consumers first, positioned at the tail, so nothing is missed.
    enum Side {
        Group(crate::targets::Consumer),
        Read(crate::targets::Reader),
    }
    for i in 0..consumers {
        let shards = shards_for(i, consumers, c.shards);
        let mut side = match a.via {
            Via::Group => Side::Group(target.consumer(i, 64).await?),
            Via::Read => {
                let mut r = target.reader(i).await?;
                for &s in &shards {
                    r.seek_end(s).await?;
                }
                Side::Read(r)
            }
        };
        let (run, lat, received, published, producers_done) = (
            run.clone(),
            lat.clone(),
            received.clone(),
            published.clone(),
            producers_done.clone(),
        );
        let per_poll = a.per_poll;
        ctasks.push(tokio::spawn(async move {
            let mut hist: Histogram<u64> = new_histogram();
            let measure_from = harness::ns_of(run.measure_at());
            let measure_to = run.stop_at().map_or(u64::MAX, harness::ns_of);
            let mut k = 0usize;
            let mut drain_deadline: Option<Instant> = None;
            loop {
                if producers_done.load(Ordering::Relaxed) {
                    if received.load(Ordering::Relaxed) >= published.load(Ordering::Relaxed) {
                        break;
                    }
                    let d = *drain_deadline.get_or_insert(Instant::now() + Duration::from_secs(10));
                    if Instant::now() > d {
                        run.error(format!(
                            "e2e: {} of {} published records arrived within 10s of the end",
                            received.load(Ordering::Relaxed),
                            published.load(Ordering::Relaxed)
                        ));
                        break;
                    }
                }
                let shard = shards[k % shards.len()];
                k += 1;
                let payloads: Vec<(Bytes, Option<Handle>)> = match &mut side {
                    Side::Group(cons) => match cons.poll(shard, per_poll, IDLE_WAIT).await {
                        Ok(b) => b
                            .into_iter()
                            .map(|d| {
                                // A redelivery is acknowledged but not timed again.
                                let p = if d.attempts == 1 {
                                    d.payload
                                } else {
                                    Bytes::new()
                                };
                                (p, Some(d.handle))
                            })
                            .collect(),
                        Err(e) => {
                            run.error(format!("poll: {e}"));
                            break;
                        }
                    },
                    Side::Read(r) => match r.read(shard, per_poll, IDLE_WAIT).await {
                        Ok(b) => b.into_iter().map(|p| (p, None)).collect(),
                        Err(e) => {
                            run.error(format!("read: {e}"));
                            break;
                        }
                    },
                };
                if payloads.is_empty() {
                    continue;
                }
                let now = harness::now_ns();
                let mut handles = Vec::with_capacity(payloads.len());
                let first = payloads.iter().filter(|(p, _)| !p.is_empty()).count() as u64;
                for (p, h) in payloads {
                    if let Some(sent) = stamp_of(&p) {
                        if sent >= measure_from && sent < measure_to {
                            record(&mut hist, now.saturating_sub(sent), 1);
                        }
                    }
                    handles.extend(h);
                }
                received.fetch_add(first, Ordering::Relaxed);
                if let Side::Group(cons) = &mut side {
                    if let Err(e) = cons.ack(shard, handles).await {
                        run.error(format!("ack: {e}"));
                        break;
                    }
                }
            }
            if let Side::Group(cons) = &mut side {
                let _ = cons.finish().await;
            }
            lat.add(&hist);
        }));
    }
    let rate = a.rate / a.producers as f64;
    let mut ptasks = Vec::new();
    // Producers start after a short settling delay (consumers polling).
    let base = Instant::now() + Duration::from_millis(50);
    for i in 0..a.producers {
        let (tx, rx) = target.producer(i).await?;
        let iv = Duration::from_secs_f64(a.batch as f64 / rate);
        let plan = ProducerPlan {
            shards: shards_for(i, a.producers, c.shards),
            batch: a.batch,
            inflight: a.inflight,
            record_size: c.record_size,
            pace: Some((base + iv.mul_f64(i as f64 / a.producers as f64), iv)),
            stamp: true,
            delivery: Some(lat.clone()),
        };
        ptasks.push(tokio::spawn(producer(
            run.clone(),
            tx,
            rx,
            plan,
            publish_lat.clone(),
        )));
    }
    let progress = start_progress(c, &run);
    start_deadline(&run);
    let mut acked = 0;
    for t in ptasks {
        acked += t.await.map_err(|e| e.to_string())?;
    }
    published.store(acked, Ordering::Relaxed);
    producers_done.store(true, Ordering::Relaxed);
    for t in ctasks {
        t.await.map_err(|e| e.to_string())?;
    }
    progress.store(true, Ordering::Relaxed);
    let mut out = Outcome::new(
        &run,
        lat.take(),
        "publish to delivery, from intended send time",
    );
    out.publish_latency = Some(crate::report::LatencyReport::from_hist(
        &publish_lat.take(),
        "publish acknowledgement, from intended send time",
    ));
    out.offered_rate = Some(a.rate);
    let got = received.load(Ordering::Relaxed);
    out.totals.published = Some(acked);
    out.totals.delivered = Some(got);
    out.checks.push(Check::equal(
        "records delivered = records published",
        got,
        acked,
    ));
    if let Amount::Duration(d) = c.amount {
        let expected = a.rate * d.as_secs_f64();
        let measured = run.measured_records.load(Ordering::Relaxed) as f64;
        if measured < 0.9 * expected {
            out.checks.push(Check::failed(
                "offered rate sustained",
                format!(
                    "published {} records in the window, {:.0} were due: the target (or the client) could not keep up",
                    fmt_int(measured as u64),
                    expected
                ),
            ));
        } else {
            out.checks.push(Check::passed(
                "offered rate sustained",
                format!(
                    "{:.0}% of the due records were published",
                    100.0 * measured / expected
                ),
            ));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_pacer_never_wakes_before_its_time() {
        let p = Pacer::new().unwrap();
        for us in [1u64, 50, 200, 900, 1_500, 20_000] {
            let at = Instant::now() + Duration::from_micros(us);
            p.until(at).await.unwrap();
            assert!(Instant::now() >= at, "woke before a wait of {us} us");
        }
        // A time already past returns without arming the timer, and the
        // timer still works after it.
        p.until(Instant::now() - Duration::from_millis(5))
            .await
            .unwrap();
        let at = Instant::now() + Duration::from_millis(2);
        p.until(at).await.unwrap();
        assert!(Instant::now() >= at);
    }

    #[test]
    fn workers_cover_every_shard() {
        assert_eq!(shards_for(0, 2, 4), vec![0, 2]);
        assert_eq!(shards_for(1, 2, 4), vec![1, 3]);
        assert_eq!(shards_for(3, 4, 2), vec![1]);
        for workers in 1..6 {
            for shards in 1..6u32 {
                let mut seen: Vec<u32> = (0..workers)
                    .flat_map(|i| shards_for(i, workers, shards))
                    .collect();
                seen.sort();
                seen.dedup();
                assert_eq!(seen, (0..shards).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn split_adds_up() {
        assert_eq!(split(10, 3), vec![4, 3, 3]);
        assert_eq!(split(10, 3).iter().sum::<u64>(), 10);
        assert_eq!(split(2, 4), vec![1, 1, 0, 0]);
    }

    #[test]
    fn stamps_round_trip() {
        let batch = stamped(3, 100, 123_456_789, 7);
        assert_eq!(batch.len(), 3);
        for (i, p) in batch.iter().enumerate() {
            assert_eq!(p.len(), 100);
            assert_eq!(stamp_of(p), Some(123_456_789));
            assert_eq!(&p[8..16], &(8 + i as u64).to_le_bytes(), "its own sequence");
            assert!(p[16..].iter().all(|&b| b == b'x'));
        }
        assert_eq!(stamp_of(b"short"), None);
    }

    /// A producer held up at the end: the batches due before the end and
    /// never sent count, each at least as late as the end, and only those
    /// intended inside the measured window.
    #[test]
    fn batches_never_sent_count_as_late_as_the_end() {
        let run = Run::new(Duration::ZERO, Amount::Duration(Duration::from_secs(1)));
        let base = run.measure_at();
        let end = run.stop_at().unwrap();
        let iv = Duration::from_millis(100);
        // Batches 0..=9 are due before the end; 7, 8 and 9 were not sent.
        let h = missed_batches(&run, base, iv, 7, end, 1);
        assert_eq!(h.len(), 3);
        assert_eq!(h.min() / 1_000_000, 99, "{}", h.min());
        assert_eq!(h.max() / 1_000_000, 300, "{}", h.max());
        // Counted once a record for their delivery: 3 batches of 50.
        assert_eq!(missed_batches(&run, base, iv, 7, end, 50).len(), 150);
        // Nothing due after the end, and nothing before the window.
        assert_eq!(missed_batches(&run, base, iv, 10, end, 1).len(), 0);
        let early = base - Duration::from_millis(250);
        assert_eq!(missed_batches(&run, early, iv, 0, end, 1).len(), 10);
    }

    #[test]
    fn nack_choice_follows_the_rate() {
        let n = (0..100_000).filter(|&i| nack_this(i, 0.1)).count();
        assert!((9_000..11_000).contains(&n), "{n}");
        assert!(!(0..1000).any(|i| nack_this(i, 0.0)));
    }
}
