//! Signals: `SIGTERM`/`SIGINT` begin a graceful stop (a second one, a
//! second or more later, exits at once), `SIGHUP` reloads the tokens and
//! permissions.

use super::*;

/// A stop signal this soon after the first is taken as the same request,
/// not as the second that exits at once.
const SIGNAL_REPEAT: std::time::Duration = std::time::Duration::from_secs(1);

/// What a SIGTERM or SIGINT does.
#[derive(Debug, PartialEq, Eq)]
enum StopSignal {
    /// The first: stop gracefully.
    Begin,
    /// Within [`SIGNAL_REPEAT`] of the first: the same request (tools such
    /// as `timeout` signal the process and then its whole group).
    Repeat,
    /// A second request: exit at once.
    Exit,
}

fn on_stop_signal(first: Option<std::time::Instant>, now: std::time::Instant) -> StopSignal {
    match first {
        None => StopSignal::Begin,
        Some(t) if now.saturating_duration_since(t) < SIGNAL_REPEAT => StopSignal::Repeat,
        Some(_) => StopSignal::Exit,
    }
}

/// The broker the signal thread acts on, once it exists (see
/// [`install_signal_thread`]).
pub(super) type SignalTarget = Arc<std::sync::OnceLock<Arc<Shared>>>;

/// SIGTERM/SIGINT: tell every core to stop; SIGHUP: read the tokens and
/// permissions files again. The signals are blocked in every thread (the
/// mask is inherited by the executors and every other thread started after
/// this) and taken here with `sigwait`, so no handler runs on an executor.
///
/// Installed first thing, before the broker exists: a stop asked for
/// before `target` is set (while the broker waits for its port, loads its
/// catalog) ends the process at once with exit code 0, since nothing has
/// been opened; a SIGHUP then is dropped (the files are read afterwards).
///
/// The files are read on a thread of their own: a read that hangs (a dead
/// network mount) must not keep SIGTERM from being taken. HUPs that arrive
/// while a reload is pending fold into it (it reads the files as they are
/// when it starts).
pub(super) fn install_signal_thread() -> SignalTarget {
    let set = block_signals(&[libc::SIGTERM, libc::SIGINT, libc::SIGHUP]);
    let target: SignalTarget = Default::default();
    let (reload, reloads) = std::sync::mpsc::sync_channel::<()>(1);
    let reloading = target.clone();
    std::thread::Builder::new()
        .name("felix-reload".into())
        .spawn(move || {
            while reloads.recv().is_ok() {
                if let Some(shared) = reloading.get() {
                    reload_security(shared);
                }
            }
        })
        .expect("reload thread");
    let waiting = target.clone();
    // SAFETY: sigwait on the initialised set, on this thread only.
    unsafe {
        std::thread::Builder::new()
            .name("felix-signals".into())
            .spawn(move || {
                let mut first_stop: Option<std::time::Instant> = None;
                loop {
                    let mut sig: libc::c_int = 0;
                    if libc::sigwait(&set, &mut sig) != 0 {
                        continue;
                    }
                    let Some(shared) = waiting.get() else {
                        if sig != libc::SIGHUP {
                            eprintln!("felix: stopped before start-up (nothing was opened)");
                            std::process::exit(0);
                        }
                        continue;
                    };
                    if sig == libc::SIGHUP {
                        // Full: a reload is pending and will see the files
                        // as they are now.
                        let _ = reload.try_send(());
                        continue;
                    }
                    let now = std::time::Instant::now();
                    match on_stop_signal(first_stop, now) {
                        StopSignal::Begin => {
                            first_stop = Some(now);
                            tracing::info!(
                                signal = sig,
                                "shutting down: finishing in-flight requests"
                            );
                            shared.shutting_down.store(true, Ordering::SeqCst);
                            for tx in &shared.senders {
                                let _ = tx.send(CoreMsg::Shutdown);
                            }
                        }
                        StopSignal::Repeat => tracing::info!(
                            signal = sig,
                            "stop signal repeated within {SIGNAL_REPEAT:?}: the same request \
                             (signal again later to exit at once)"
                        ),
                        StopSignal::Exit => {
                            eprintln!("felix: second signal, exiting now");
                            std::process::exit(130);
                        }
                    }
                }
            })
            .expect("signal thread");
    }
    target
}

/// Block `signals` in the calling thread (and so in every thread it starts
/// from now on); returns them as a set for `sigwait`.
pub(super) fn block_signals(signals: &[libc::c_int]) -> libc::sigset_t {
    // SAFETY: plain libc signal-mask calls on a zeroed, initialised sigset.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in signals {
            libc::sigaddset(&mut set, *s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// SIGHUP: read the tokens and permissions files again. A file that no
/// longer reads, or no longer parses, leaves what is in force untouched.
/// New connections authenticate against the new tokens (open ones keep
/// their principal); every request from now on is checked against the new
/// permissions.
fn reload_security(shared: &Shared) {
    let c = &shared.config;
    if c.tokens_file.is_none() && c.acl_file.is_none() {
        tracing::info!("SIGHUP: no security.tokens_file or security.acl_file to read again");
        return;
    }
    match crate::auth::Security::load(c) {
        Ok(fresh) => {
            *shared
                .security
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(fresh);
            shared.security_reloads[0].fetch_add(1, Ordering::Relaxed);
            shared.security_gen.fetch_add(1, Ordering::Release);
            tracing::info!("SIGHUP: tokens and permissions read again");
        }
        Err(e) => {
            shared.security_reloads[1].fetch_add(1, Ordering::Relaxed);
            tracing::error!("SIGHUP: {e}; the tokens and permissions in force are kept");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_signal_repeated_within_a_second_is_the_same_request() {
        let t = std::time::Instant::now();
        let at = |ms: u64| t + Duration::from_millis(ms);
        assert_eq!(on_stop_signal(None, t), StopSignal::Begin);
        assert_eq!(on_stop_signal(Some(t), at(0)), StopSignal::Repeat);
        assert_eq!(on_stop_signal(Some(t), at(999)), StopSignal::Repeat);
        assert_eq!(on_stop_signal(Some(t), at(1000)), StopSignal::Exit);
        assert_eq!(on_stop_signal(Some(t), at(60_000)), StopSignal::Exit);
    }
}
