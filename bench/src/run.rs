//! One benchmark run: start what is needed (runtime, embedded broker),
//! connect, run the workload, report, tear down.

use std::sync::Arc;

use serde_json::json;

use crate::cli::{AckChoice, Amount, Common, Plan, TargetKind};
use crate::embedded::{EmbeddedBroker, EmbeddedOptions};
use crate::report::{Machine, Report};
use crate::targets::{Spec, StreamKind, Target, TargetInfo};
use crate::workloads;

fn ack_of(plan: &Plan) -> AckChoice {
    match plan {
        Plan::Publish(_, a) => a.ack,
        Plan::E2e(_, a) => a.ack,
        _ => AckChoice::Durable,
    }
}

fn params(plan: &Plan) -> serde_json::Value {
    let c = plan.common();
    let (duration, count) = match c.amount {
        Amount::Duration(d) => (Some(d.as_secs_f64()), None),
        Amount::Count(n) => (None, Some(n)),
    };
    let mut v = json!({
        "target": c.target,
        "broker": c.broker,
        "broker_cores": c.broker_cores,
        "shards": c.shards,
        "record_size": c.record_size,
        "headers": c.headers,
        "duration_secs": duration,
        "count": count,
        "warmup_secs": c.warmup.as_secs_f64(),
        "client_threads": c.client_threads,
        "connections": c.connections,
        "stream": c.stream.to_string(),
        "peer_mode": c.peer_mode,
    });
    let specific = match plan {
        Plan::Publish(_, a) => serde_json::to_value(a),
        Plan::Read(_, a) => serde_json::to_value(a),
        Plan::Queue(_, a, backlog) => serde_json::to_value(a).map(|mut x| {
            x["backlog"] = json!(backlog);
            x
        }),
        Plan::E2e(_, a) => serde_json::to_value(a),
    }
    .unwrap_or_default();
    if let (Some(m), Some(s)) = (v.as_object_mut(), specific.as_object()) {
        for (k, x) in s {
            m.insert(k.clone(), x.clone());
        }
    }
    v
}

fn mode_of(c: &Common, ack: AckChoice) -> String {
    match (c.target, ack, c.broker.is_some()) {
        (TargetKind::Felix, AckChoice::Queued, false) => {
            "queued acks (FELIX_ACK_ON_COMMIT=0)".into()
        }
        (TargetKind::Felix, AckChoice::Queued, true) => {
            "queued acks (as the external broker is configured)".into()
        }
        // A cluster acknowledges a publish once a majority holds it.
        (TargetKind::Felix, AckChoice::Durable, true)
            if c.broker.as_deref().is_some_and(|b| b.contains(',')) =>
        {
            "replicated acks (a majority of the cluster)".into()
        }
        (TargetKind::Felix, AckChoice::Durable, _) => "durable acks (fdatasync)".into(),
        (TargetKind::Felix, AckChoice::Commit, _) => "commit acks (ack_on_commit)".into(),
        _ => String::new(),
    }
}

/// Run a validated plan to its report. Starts and stops the embedded broker.
pub fn run(plan: &Plan) -> Result<Report, String> {
    let c = plan.common().clone();
    let ack = ack_of(plan);
    let started_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    crate::harness::epoch();
    raise_open_file_limit();

    let mut embedded = None;
    let addr = match (&c.broker, c.target) {
        (Some(a), _) => a.clone(),
        (None, TargetKind::Felix) => {
            let b = EmbeddedBroker::start(&EmbeddedOptions {
                cores: &c.broker_cores,
                parent_dir: c.data_dir.as_deref(),
                log: &c.broker_log,
                ack_on_commit: ack != AckChoice::Queued,
            })?;
            if c.progress.is_some() {
                eprintln!(
                    "felix-bench: embedded broker on {} ({} core(s), data in {})",
                    b.addr(),
                    c.broker_cores,
                    b.data_dir()
                        .map(|p| p.display().to_string())
                        .unwrap_or_default()
                );
            }
            let a = b.addr().to_string();
            embedded = Some(b);
            a
        }
        (None, t) => t
            .default_addr()
            .expect("peers have a default port")
            .to_string(),
    };

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(c.client_threads)
        .thread_name("felix-bench")
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the client runtime: {e}"))?;

    let kind = match plan {
        Plan::Queue(..) => StreamKind::Queue,
        Plan::E2e(_, a) if a.via == crate::cli::Via::Group => StreamKind::Queue,
        _ => StreamKind::Log,
    };
    let spec = Arc::new(Spec {
        name: c.stream.clone(),
        shards: c.shards,
        kind,
        headers: (0..c.headers)
            .map(|i| (format!("h{i}"), bytes::Bytes::from_static(b"headerv!")))
            .collect(),
    });
    let result = runtime.block_on(async {
        let target = Target::connect(&c, &addr, ack == AckChoice::Commit, spec).await?;
        let info = TargetInfo {
            target: c.target,
            version: target.version().await,
            broker: if embedded.is_some() {
                "embedded".into()
            } else {
                addr.clone()
            },
            mode: match c.target {
                TargetKind::Felix => mode_of(&c, ack),
                _ => target.peer_mode(c.peer_mode).await,
            },
            broker_cores: match (&target, embedded.is_some()) {
                (Target::Felix(_), true) => Some(c.broker_cores.clone()),
                (Target::Felix(f), false) => Some(f.cores().to_string()),
                _ => None,
            },
        };
        let run = async {
            match plan {
                Plan::Publish(c, a) => workloads::publish(&target, c, a).await,
                Plan::Read(c, a) => workloads::read(&target, c, a).await,
                Plan::Queue(c, a, backlog) => workloads::queue(&target, c, a, *backlog).await,
                Plan::E2e(c, a) => workloads::e2e(&target, c, a).await,
            }
        };
        // Ctrl-C or SIGTERM stops the run and goes on to the clean-up below
        // (the benchmark stream, the embedded broker and its directory),
        // which the default signal action would skip.
        let sampler = crate::cpu::Sampler::start(embedded.as_ref().and_then(|b| b.pid()));
        // The broker's own publish latency, where publishing is what is
        // measured (read and queue runs publish only to fill the stream).
        let scraper = match (&target, embedded.as_ref(), plan) {
            (_, _, Plan::Read(..) | Plan::Queue(..)) => None,
            (Target::Felix(_), Some(b), _) => b.metrics_addr().map(str::to_string),
            (Target::Felix(_), None, _) => c.broker_metrics.clone(),
            _ => None,
        }
        .map(|a| crate::broker_metrics::Sampler::start(&a));
        let outcome = tokio::select! {
            o = run => o,
            why = interrupted() => Err(format!("{why}: the run was stopped and cleaned up")),
        };
        // The CPUs over the measured window (the samples around it, as for
        // the broker's latency below: the checks after a run are not in it).
        let cpu = outcome
            .as_ref()
            .ok()
            .and_then(|o| sampler.window(o.measure_from, o.measure_to));
        let mut outcome = outcome;
        // A broker started apart: its share of the CPUs from its metrics.
        let cpu = match (cpu, outcome.as_ref().ok(), scraper.as_ref()) {
            (Some(u), Some(o), Some(s)) if u.broker_cpus.is_none() => Some(crate::cpu::CpuUse {
                broker_cpus: s.cpus(o.measure_from, o.measure_to),
                ..u
            }),
            (u, _, _) => u,
        };
        if let (Ok(o), Some(s)) = (outcome.as_mut(), scraper.as_ref()) {
            o.broker_publish_latency = s.window(o.measure_from, o.measure_to);
            if o.broker_publish_latency.is_none() && embedded.is_none() {
                eprintln!(
                    "felix-bench: no felix_publish_seconds from --broker-metrics {} for the measured window (is it the broker's metrics_listen, and is the broker this version?)",
                    c.broker_metrics.as_deref().unwrap_or_default()
                );
            }
        }
        // Leave an external broker as we found it.
        if embedded.is_none() {
            if let Err(e) = target.delete().await {
                eprintln!("felix-bench: could not delete the benchmark stream: {e}");
            }
        }
        outcome.map(|o| (info, o, cpu))
    });
    runtime.shutdown_timeout(std::time::Duration::from_secs(2));
    let stopped = match embedded.as_mut() {
        Some(b) => b.stop(),
        None => Ok(()),
    };
    let (info, outcome, cpu) = result?;
    if let Err(e) = stopped {
        eprintln!("felix-bench: {e}");
    }
    Ok(Report::build(
        plan.workload(),
        c.label.clone(),
        info,
        params(plan),
        started_unix_ms,
        c.warmup.as_secs_f64(),
        outcome,
        Machine::here(c.client_threads, cpu),
    ))
}

/// A paced producer holds a timer descriptor and every Redis/NATS worker a
/// socket: raise the soft limit on open files to the hard limit, so that
/// thousands of producers do not fail at the usual 1,024.
fn raise_open_file_limit() {
    // SAFETY: getrlimit/setrlimit on a struct we own.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            let _ = libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// Resolves on SIGINT or SIGTERM, naming it.
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => "interrupted (SIGINT)",
        _ = term.recv() => "terminated (SIGTERM)",
    }
}
