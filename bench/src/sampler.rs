//! Readings taken every 100 ms on a thread of their own while a run
//! measures, and the two that bound its measured window: the machine's CPU
//! counters ([`crate::cpu`]) and the broker's publish histogram
//! ([`crate::broker_metrics`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often a [`Sampler`] takes a reading.
pub const EVERY: Duration = Duration::from_millis(100);

/// A reading and when it was taken: what it counts happened before it was
/// answered, and includes everything before it was asked for.
pub trait Reading: Clone + Send + 'static {
    fn asked(&self) -> Instant;
    fn answered(&self) -> Instant;
}

/// The readings that bound `[from, to]` among readings in the order taken:
/// the last answered at or before `from` (nothing after `from` is in it)
/// and the first asked for at or after `to` (everything before `to` is).
pub fn bounding<R: Reading>(
    readings: &[R],
    from: Instant,
    to: Instant,
) -> (Option<&R>, Option<&R>) {
    (
        readings.iter().rev().find(|r| r.answered() <= from),
        readings.iter().find(|r| r.asked() >= to),
    )
}

type Take<R> = Arc<dyn Fn() -> Option<R> + Send + Sync>;

/// Takes a reading now (before anything runs, so that a window starting at
/// once has one at or before its start), then every [`EVERY`] on a thread
/// named `name`, until dropped.
pub struct Sampler<R: Reading> {
    readings: Arc<Mutex<Vec<R>>>,
    stop: Arc<AtomicBool>,
    take: Take<R>,
}

impl<R: Reading> Sampler<R> {
    pub fn start(name: &str, take: impl Fn() -> Option<R> + Send + Sync + 'static) -> Sampler<R> {
        let take: Take<R> = Arc::new(take);
        let readings = Arc::new(Mutex::new(take().into_iter().collect::<Vec<_>>()));
        let stop = Arc::new(AtomicBool::new(false));
        let (r, st, t) = (readings.clone(), stop.clone(), take.clone());
        let _ = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                while !st.load(Ordering::Relaxed) {
                    // A sampling thread of its own, not an executor.
                    #[allow(clippy::disallowed_methods)]
                    std::thread::sleep(EVERY);
                    if let Some(x) = t() {
                        r.lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .push(x);
                    }
                }
            });
        Sampler {
            readings,
            stop,
            take,
        }
    }

    /// The readings that bound `[from, to]` ([`bounding`]; one taken now if
    /// none came after `to` yet): the window and at most about [`EVERY`]
    /// more at each end. `None` if no reading came before `from`.
    pub fn window(&self, from: Instant, to: Instant) -> Option<(R, R)> {
        let (start, end) = {
            let readings = self
                .readings
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let (start, end) = bounding(&readings, from, to);
            (start?.clone(), end.cloned())
        };
        let end = match end {
            Some(e) => e,
            None => (self.take)()?,
        };
        Some((start, end))
    }
}

impl<R: Reading> Drop for Sampler<R> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Debug, PartialEq)]
    struct R(Instant, Instant);

    impl Reading for R {
        fn asked(&self) -> Instant {
            self.0
        }
        fn answered(&self) -> Instant {
            self.1
        }
    }

    #[test]
    fn the_readings_that_bound_a_window_are_chosen() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let r = |asked: u64, answered: u64| R(at(asked), at(answered));
        let readings = [r(0, 5), r(100, 104), r(200, 230), r(300, 301)];
        let (a, b) = bounding(&readings, at(103), at(210));
        // Answered at 104 is after 103: it may count some of the window.
        assert_eq!(a, Some(&r(0, 5)));
        // Asked at 200, before 210: it may miss some; the next one does not.
        assert_eq!(b, Some(&r(300, 301)));
        // Both ends inclusive.
        assert_eq!(
            bounding(&readings, at(104), at(300)),
            (Some(&r(100, 104)), Some(&r(300, 301)))
        );
        // Nothing before the start: no figure rather than a shorter window;
        // nothing after the end yet: the sampler reads now.
        assert_eq!(bounding(&readings, at(4), at(350)), (None, None));
    }

    #[test]
    fn a_window_ending_after_the_last_reading_reads_now() {
        let s = Sampler::start("felix-bench-test", || {
            let t = Instant::now();
            Some(R(t, t))
        });
        let from = Instant::now();
        let (a, b) = s.window(from, from).unwrap();
        assert!(a.answered() <= from, "the first reading is taken in start");
        assert!(b.asked() >= from, "read at the call");
        if let Some(early) = a.answered().checked_sub(Duration::from_secs(1)) {
            assert!(
                s.window(early, from).is_none(),
                "no reading before the start"
            );
        }
    }
}
