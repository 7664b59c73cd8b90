//! Deterministic simulation of the tracker against a reference model.
//!
//! Each case runs a random schedule (seeded `SmallRng`) of appends (with
//! control records), polls from named and anonymous consumers (reclaim,
//! custom visibility, plans read before other requests run, records the
//! broker did not load), acks, nacks, delayed nacks, extends, dead letters,
//! time passing, ticks, seeks, creates, deletes, redrives, discards,
//! retention, evictions, crashes (the log cut anywhere after the last entry
//! that was waited on, replayed from the last snapshot) and snapshots. After
//! every step it checks:
//!
//! * the tracker's internal invariants;
//! * its slots equal the model's, state for state (one claim per record);
//! * a delivery never takes a record someone else's claim still holds, and
//!   counts one more attempt, never past the bound;
//! * reserved records go first, owed before new;
//! * the position passes only finished offsets, never an unfinished one;
//! * in flight never exceeds the cap;
//! * replaying the written entries reproduces the durable state exactly;
//! * after a crash, every redrive and consumer dead letter answered survives.
//!
//! At the end it drains the group and checks every offset below the tail was
//! acked, is a dead letter or was discarded, or was skipped legitimately.
//!
//! `FELIX_SIM_SEED=n` (with `FELIX_SIM_STEPS=n`, both printed on failure)
//! replays one case; `FELIX_SIM_CASES=n` sets the count (default 3,000 short
//! schedules and 30 long ones, a few seconds).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;

/// (principal, name) of the named members consumers use.
const MEMBERS: [(&str, &str); 3] = [
    ("anonymous", "alpha"),
    ("anonymous", "beta"),
    ("mallory", "alpha"),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MState {
    Claimed {
        deadline: u64,
        member: Option<usize>,
        conn: u64,
        reserved_for: Option<u64>,
    },
    Delayed {
        until: u64,
    },
    Owed,
}

#[derive(Clone, Copy, Debug)]
struct MRec {
    attempts: u32,
    st: MState,
    skipped_before: u64,
}

struct Consumer {
    member: Option<usize>,
    conn: u64,
    /// Deliveries this process believes it holds: (offset, attempts).
    held: Vec<(u64, u32)>,
}

/// What the schedules exercised, summed over cases, so a change that stops
/// the simulation reaching a path is noticed.
#[derive(Default, Debug, Clone, Copy)]
struct Stats {
    new_deliveries: u64,
    owed_deliveries: u64,
    reserved_deliveries: u64,
    capped_polls: u64,
    skipped_before: u64,
    dead_at_bound: u64,
    consumer_dead_letters: u64,
    redrives: u64,
    stale_refusals: u64,
    seeks: u64,
    evictions: u64,
    crashes: u64,
    snapshot_replays: u64,
    /// Restarts (crashes, evictions) where the record at the position had
    /// been told of skips below it, which the position entry kept.
    kept_skips: u64,
}

impl Stats {
    fn fields(&self) -> [u64; 14] {
        [
            self.new_deliveries,
            self.owed_deliveries,
            self.reserved_deliveries,
            self.capped_polls,
            self.skipped_before,
            self.dead_at_bound,
            self.consumer_dead_letters,
            self.redrives,
            self.stale_refusals,
            self.seeks,
            self.evictions,
            self.crashes,
            self.snapshot_replays,
            self.kept_skips,
        ]
    }

    fn add(&mut self, o: &Stats) {
        self.new_deliveries += o.new_deliveries;
        self.owed_deliveries += o.owed_deliveries;
        self.reserved_deliveries += o.reserved_deliveries;
        self.capped_polls += o.capped_polls;
        self.skipped_before += o.skipped_before;
        self.dead_at_bound += o.dead_at_bound;
        self.consumer_dead_letters += o.consumer_dead_letters;
        self.redrives += o.redrives;
        self.stale_refusals += o.stale_refusals;
        self.seeks += o.seeks;
        self.evictions += o.evictions;
        self.crashes += o.crashes;
        self.snapshot_replays += o.snapshot_replays;
        self.kept_skips += o.kept_skips;
    }
}

struct Plan {
    caller: Caller,
    loaded: BTreeSet<u64>,
}

struct Sim {
    seed: u64,
    rng: SmallRng,
    cfg: GroupConfig,
    t: GroupTracker,
    replica: GroupTracker,
    now: u64,
    start: u64,
    end: u64,
    control: BTreeSet<u64>,
    entries: Vec<GroupEntry>,
    durable_len: usize,
    snapshots: Vec<usize>,
    consumers: Vec<Consumer>,
    next_conn: u64,
    plans: HashMap<usize, Plan>,
    // The model of the current epoch (since the last seek, restart, delete).
    mrec: BTreeMap<u64, MRec>,
    handed_epoch: BTreeSet<u64>,
    /// Attempts of records a seek voided, for their next delivery.
    carried: BTreeMap<u64, u32>,
    /// What those without a record in `mrec` were told lay skipped below
    /// them: said again at their next delivery.
    carried_skipped: BTreeMap<u64, u64>,
    finished_epoch: BTreeSet<u64>,
    settled_epoch: BTreeSet<u64>,
    last_reclaim: HashMap<usize, u64>,
    // Facts across epochs.
    acked_ever: BTreeSet<u64>,
    discarded_ever: BTreeSet<u64>,
    exempt: Vec<(u64, u64)>,
    must_owe: BTreeSet<u64>,
    must_list: BTreeSet<u64>,
    last_position: u64,
    position_may_jump: bool,
    trace: VecDeque<String>,
    step: usize,
    steps: usize,
    stats: Stats,
}

impl Drop for Sim {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "\n*** group simulation failed: FELIX_SIM_SEED={} FELIX_SIM_STEPS={} (at step {}, now {}, log [{}, {}))",
                self.seed, self.steps, self.step, self.now, self.start, self.end
            );
            eprintln!("config: {:?}", self.cfg);
            eprintln!("last steps:");
            for line in &self.trace {
                eprintln!("  {line}");
            }
        }
    }
}

fn payload(o: u64) -> u32 {
    (o.wrapping_mul(2_654_435_761) % 700) as u32 + 1
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let mut rng = SmallRng::seed_from_u64(seed);
        let visibility_ms = rng.gen_range(200..3_000);
        let cfg = GroupConfig {
            visibility_ms,
            max_attempts: rng.gen_range(1..=5),
            max_in_flight: rng.gen_range(3..=60),
            max_visibility_ms: visibility_ms * rng.gen_range(1..=8),
            poll_max_records: rng.gen_range(3..=50),
            poll_max_bytes: if rng.gen_bool(0.3) {
                rng.gen_range(100..3_000)
            } else {
                4 << 20
            },
            idle_ms: rng.gen_range(1_000..20_000),
            // Counted without a limit (the model predicts the group's own
            // cap only): `check` holds the count to the trackers' claims.
            shared_claims: SharedClaims::default(),
        }
        .clamped();
        let consumers = vec![
            Consumer {
                member: None,
                conn: 1,
                held: vec![],
            },
            Consumer {
                member: None,
                conn: 2,
                held: vec![],
            },
            Consumer {
                member: Some(0),
                conn: 3,
                held: vec![],
            },
            Consumer {
                member: Some(0),
                conn: 4,
                held: vec![],
            },
            Consumer {
                member: Some(1),
                conn: 5,
                held: vec![],
            },
            Consumer {
                member: Some(2),
                conn: 6,
                held: vec![],
            },
        ];
        Sim {
            seed,
            rng,
            t: GroupTracker::new("workers", cfg.clone()),
            replica: GroupTracker::new("workers", cfg.clone()),
            cfg,
            now: 1_000,
            start: 0,
            end: 0,
            control: BTreeSet::new(),
            entries: Vec::new(),
            durable_len: 0,
            snapshots: Vec::new(),
            consumers,
            next_conn: 7,
            plans: HashMap::new(),
            mrec: BTreeMap::new(),
            handed_epoch: BTreeSet::new(),
            finished_epoch: BTreeSet::new(),
            settled_epoch: BTreeSet::new(),
            last_reclaim: HashMap::new(),
            acked_ever: BTreeSet::new(),
            discarded_ever: BTreeSet::new(),
            exempt: Vec::new(),
            must_owe: BTreeSet::new(),
            must_list: BTreeSet::new(),
            carried: BTreeMap::new(),
            carried_skipped: BTreeMap::new(),
            last_position: 0,
            position_may_jump: false,
            trace: VecDeque::new(),
            step: 0,
            steps: 0,
            stats: Stats::default(),
        }
    }

    fn note(&mut self, line: String) {
        if self.trace.len() == 40 {
            self.trace.pop_front();
        }
        self.trace
            .push_back(format!("#{} t={} {}", self.step, self.now, line));
    }

    fn log(&self) -> LogView {
        LogView::new(self.start, self.end)
    }

    fn caller(&self, ci: usize, reclaim: bool) -> Caller {
        let c = &self.consumers[ci];
        match c.member {
            None => Caller::anonymous(c.conn),
            Some(m) => Caller {
                principal: MEMBERS[m].0.into(),
                connection: c.conn,
                member: Some(MEMBERS[m].1.to_string()),
                reclaim,
            },
        }
    }

    /// Dead letters that are finished: listed ones and those discarded
    /// at or above the position.
    fn finished_dead(&self) -> BTreeSet<u64> {
        self.t
            .durable()
            .map(|g| g.dead_letters().keys().map(|o| o.0).collect())
            .unwrap_or_default()
    }

    fn dead(&self) -> BTreeSet<u64> {
        self.t
            .durable()
            .map(|g| g.listed_dead_letters().map(|(o, _)| o.0).collect())
            .unwrap_or_default()
    }

    fn redriven(&self) -> BTreeSet<u64> {
        self.t
            .durable()
            .map(|g| g.redriven().iter().map(|o| o.0).collect())
            .unwrap_or_default()
    }

    fn clamp_vis(&self, ms: u64) -> u64 {
        ms.clamp(1, self.cfg.max_visibility_ms)
    }

    /// Append the tracker's writes to the log, through the codec, and to the
    /// replica.
    fn write(&mut self, writes: Vec<GroupEntry>, durable: bool) {
        let any = !writes.is_empty();
        for e in writes {
            let decoded = GroupEntry::decode(&e.to_bytes()).expect("own entry decodes");
            assert_eq!(decoded, e, "codec round trip");
            assert!(self.replica.apply_entry(&decoded));
            self.entries.push(decoded);
        }
        if durable && any {
            self.durable_len = self.entries.len();
        }
    }

    /// After a crash or an eviction (not a seek), a record at the durable
    /// position that went out before keeps the skips it was told: the
    /// position entry recorded them.
    fn check_kept_skips(&mut self) {
        if let Some(g) = self.t.durable() {
            if let Some(m) = self.mrec.get(&g.position().0) {
                self.stats.kept_skips += (m.skipped_before > 0) as u64;
                assert_eq!(
                    g.position_skipped(),
                    m.skipped_before,
                    "the position {} kept {} skipped below it, the record was told {}",
                    g.position().0,
                    g.position_skipped(),
                    m.skipped_before
                );
            }
        }
    }

    /// A new epoch: the memory is gone, the durable state stays.
    fn new_epoch(&mut self) {
        self.mrec.clear();
        self.carried.clear();
        self.carried_skipped.clear();
        self.handed_epoch.clear();
        self.finished_epoch.clear();
        self.settled_epoch.clear();
        // What the last position entry recorded as skipped below the
        // position is known again: the record there is told it.
        if let Some(g) = self.t.durable() {
            let p = g.position().0;
            self.settled_epoch
                .extend(p.saturating_sub(g.position_skipped())..p);
        }
        self.plans.clear();
        // Discarded dead letters above the position stay finished.
        let discarded: Vec<u64> = self
            .t
            .durable()
            .map(|g| {
                g.dead_letters()
                    .iter()
                    .filter(|(_, d)| d.discarded)
                    .map(|(o, _)| o.0)
                    .collect()
            })
            .unwrap_or_default();
        self.finished_epoch.extend(discarded);
        for r in self.redriven() {
            self.mrec.insert(
                r,
                MRec {
                    attempts: 0,
                    st: MState::Owed,
                    skipped_before: 0,
                },
            );
        }
        self.position_may_jump = true;
    }

    fn finish(&mut self, o: u64) {
        self.mrec.remove(&o);
        self.carried.remove(&o);
        self.carried_skipped.remove(&o);
        self.finished_epoch.insert(o);
        self.must_owe.remove(&o);
    }

    /// What the tracker does at the start of a poll, plan or tick.
    fn model_expire(&mut self) -> Vec<u64> {
        let mut dead = vec![];
        let now = self.now;
        let max = self.cfg.max_attempts;
        for (&o, m) in self.mrec.iter_mut() {
            match m.st {
                MState::Claimed { deadline, .. } if deadline <= now => {
                    if m.attempts >= max {
                        dead.push(o);
                    } else {
                        m.st = MState::Owed;
                    }
                }
                MState::Delayed { until } if until <= now => m.st = MState::Owed,
                _ => {}
            }
        }
        for &o in &dead {
            self.finish(o);
        }
        dead
    }

    fn model_reclaim(&mut self, caller: &Caller, member: Option<usize>) {
        let Some(m) = member else { return };
        if !caller.reclaim {
            return;
        }
        let conn = caller.connection;
        if self.last_reclaim.get(&m).is_some_and(|&l| conn <= l) {
            return;
        }
        self.last_reclaim.insert(m, conn);
        for rec in self.mrec.values_mut() {
            if let MState::Claimed {
                member: Some(cm),
                conn: c,
                reserved_for,
                ..
            } = &mut rec.st
            {
                if *cm == m && reserved_for.unwrap_or(*c) < conn {
                    *reserved_for = Some(conn);
                }
            }
        }
    }

    fn prepare(&mut self, caller: &Caller, member: Option<usize>) -> Vec<u64> {
        if !self.t.exists() {
            // The poll creates the group at 0.
            self.new_epoch();
        }
        let dead = self.model_expire();
        self.model_reclaim(caller, member);
        let start = self.start;
        let removed: Vec<u64> = self
            .mrec
            .iter()
            .filter(|(&o, m)| o < start && m.st == MState::Owed)
            .map(|(&o, _)| o)
            .collect();
        for o in removed {
            self.finish(o);
        }
        dead
    }

    fn check_dead(&mut self, expected: &[u64]) {
        self.stats.dead_at_bound += expected.len() as u64;
        let dead = self.dead();
        for o in expected {
            assert!(
                dead.contains(o),
                "{o} at the attempt bound was not dead-lettered"
            );
        }
    }

    // ------------------------------------------------------------------- ops

    fn op_append(&mut self) {
        let n = self.rng.gen_range(1..=12);
        for _ in 0..n {
            if self.rng.gen_bool(0.08) {
                self.control.insert(self.end);
            }
            self.end += 1;
        }
        self.note(format!("append {n} -> end {}", self.end));
    }

    fn op_plan(&mut self, ci: usize) {
        let reclaim = self.rng.gen_bool(0.5);
        let caller = self.caller(ci, reclaim);
        let max = self.rng.gen_range(0..30);
        let member = self.consumers[ci].member;
        let dead = self.prepare(&caller, member);
        let frontier_before = self.t.frontier().0;
        let plan = self.t.plan_poll(self.now, &caller, max, self.log());
        self.note(format!(
            "plan c{ci} conn {} reclaim {reclaim} max {max} -> {:?}",
            caller.connection, plan.offsets
        ));
        self.write(plan.writes, false);
        self.check_dead(&dead);
        self.note_frontier(frontier_before, &BTreeSet::new());
        let loaded = plan.offsets.iter().map(|o| o.0).collect();
        self.plans.insert(ci, Plan { caller, loaded });
    }

    fn op_poll(&mut self, ci: usize) {
        let (caller, loaded) = match self.plans.remove(&ci) {
            // A poll whose plan was read before other requests ran.
            Some(p) if p.caller.connection == self.consumers[ci].conn => (p.caller, Some(p.loaded)),
            _ => {
                let reclaim = self.rng.gen_bool(0.5);
                (self.caller(ci, reclaim), None)
            }
        };
        let member = self.consumers[ci].member;
        let max = self.rng.gen_range(0..30);
        let vis = if self.rng.gen_bool(0.3) {
            Some(self.rng.gen_range(0..3 * self.cfg.visibility_ms))
        } else {
            None
        };
        let fail_after = if self.rng.gen_bool(0.1) {
            self.rng.gen_range(0..20)
        } else {
            usize::MAX
        };
        let work = self.t.has_work_for(self.now, &caller, self.log());
        let dead = self.prepare(&caller, member);
        let frontier_before = self.t.frontier().0;
        let (start, end, now, log) = (self.start, self.end, self.now, self.log());
        let control = &self.control;
        let mut calls = 0;
        let mut not_loaded = false;
        let mut lookup = |o: Offset| {
            let o = o.0;
            assert!(o < end, "looked up {o} past the tail {end}");
            calls += 1;
            if o < start || control.contains(&o) {
                Lookup::Skipped
            } else if calls > fail_after || loaded.as_ref().is_some_and(|l| !l.contains(&o)) {
                not_loaded = true;
                Lookup::NotLoaded
            } else {
                Lookup::Record {
                    payload_bytes: payload(o),
                }
            }
        };
        let out = self.t.poll(now, &caller, max, vis, log, &mut lookup);
        assert_eq!(
            out.unread, not_loaded,
            "unread says whether a lookup missed"
        );
        self.note(format!(
            "poll c{ci} conn {} reclaim {} max {max} vis {vis:?} fail_after {fail_after} planned {} -> {:?} capped {}",
            caller.connection,
            caller.reclaim,
            loaded.is_some(),
            out.deliveries
                .iter()
                .map(|d| (d.offset.0, d.attempts, d.skipped_before))
                .collect::<Vec<_>>(),
            out.capped
        ));
        self.write(out.writes, false);
        self.check_dead(&dead);
        assert!(
            work || out.deliveries.is_empty(),
            "has_work_for said no, the poll delivered"
        );

        // Caps.
        let cap = if max == 0 {
            self.cfg.poll_max_records
        } else {
            max.min(self.cfg.poll_max_records)
        };
        assert!(out.deliveries.len() <= cap as usize, "record cap");
        let bytes_but_last: u64 = out
            .deliveries
            .iter()
            .rev()
            .skip(1)
            .map(|d| payload(d.offset.0) as u64)
            .sum();
        assert!(
            bytes_but_last < self.cfg.poll_max_bytes,
            "a poll went on after crossing the byte cap"
        );
        if out.capped {
            self.stats.capped_polls += 1;
            assert!(out.deliveries.is_empty());
            assert!(self.model_in_flight() >= self.cfg.max_in_flight);
        }

        let delivered_now: BTreeSet<u64> = out.deliveries.iter().map(|d| d.offset.0).collect();
        self.note_frontier(frontier_before, &delivered_now);

        // Each delivery against the model.
        let deadline = now + self.clamp_vis(vis.unwrap_or(self.cfg.visibility_ms));
        let mut phase = 0;
        let mut delivered = BTreeSet::new();
        for d in &out.deliveries {
            let o = d.offset.0;
            assert!(
                o >= start && o < end && !self.control.contains(&o),
                "delivered {o}, which is not a record"
            );
            assert!(delivered.insert(o), "{o} delivered twice in one poll");
            // Never past the bound, a seek's voided deliveries included.
            let carried = self.carried.remove(&o);
            assert!(
                d.attempts >= 1 && d.attempts <= self.cfg.max_attempts,
                "{o} delivered at attempt {}",
                d.attempts
            );
            let skipped_before = match self.mrec.get(&o).copied() {
                Some(m) => {
                    match m.st {
                        MState::Claimed {
                            deadline,
                            member: cm,
                            reserved_for,
                            ..
                        } => {
                            assert!(deadline > now);
                            assert!(
                                reserved_for == Some(caller.connection) && cm == member,
                                "{o} handed out while another claim stands: {m:?}"
                            );
                            assert_eq!(phase, 0, "a reserved record after owed or new ones");
                            self.stats.reserved_deliveries += 1;
                        }
                        MState::Owed => {
                            assert!(phase <= 1, "an owed record after a new one");
                            phase = 1;
                            self.stats.owed_deliveries += 1;
                        }
                        MState::Delayed { .. } => panic!("{o} handed out during its delay"),
                    }
                    assert_eq!(d.attempts, m.attempts + 1, "{o} attempts");
                    assert_eq!(d.skipped_before, m.skipped_before, "{o} skipped_before");
                    m.skipped_before
                }
                None => {
                    assert!(
                        !self.handed_epoch.contains(&o),
                        "{o} handed out again as if new"
                    );
                    assert_eq!(
                        d.attempts,
                        1 + carried.unwrap_or(0),
                        "a new record's attempts"
                    );
                    phase = 2;
                    self.stats.new_deliveries += 1;
                    let mut run = 0;
                    while o > run && self.settled_epoch.contains(&(o - run - 1)) {
                        run += 1;
                    }
                    // A redelivery after a seek says again what the voided
                    // delivery said.
                    let run = run.max(self.carried_skipped.remove(&o).unwrap_or(0));
                    assert_eq!(d.skipped_before, run, "{o} skipped_before");
                    self.stats.skipped_before += (run > 0) as u64;
                    run
                }
            };
            self.mrec.insert(
                o,
                MRec {
                    attempts: d.attempts,
                    st: MState::Claimed {
                        deadline,
                        member,
                        conn: caller.connection,
                        reserved_for: None,
                    },
                    skipped_before,
                },
            );
            self.handed_epoch.insert(o);
            self.consumers[ci].held.push((o, d.attempts));
        }

        // Records reserved for this connection that it did not get: given up
        // on at the bound, or removed by retention, if the poll reached them.
        let slots = self.t.slot_view();
        let dead_now = self.dead();
        let reserved_left: Vec<(u64, MRec)> = self
            .mrec
            .iter()
            .filter(|(_, m)| {
                matches!(m.st, MState::Claimed { reserved_for: Some(r), .. } if r == caller.connection)
            })
            .map(|(&o, &m)| (o, m))
            .collect();
        for (o, m) in reserved_left {
            if !slots.contains_key(&o) {
                if m.attempts >= self.cfg.max_attempts {
                    assert!(dead_now.contains(&o), "reserved {o} at the bound vanished");
                } else {
                    assert!(o < start, "reserved {o} vanished");
                }
                self.finish(o);
            } else if phase >= 1 {
                panic!("{o} reserved for this connection was passed over");
            }
        }
        if phase == 2 {
            assert!(
                !self.mrec.values().any(|m| m.st == MState::Owed),
                "a new record went out while records were owed: {:?}",
                self.mrec
            );
        }
    }

    /// What the frontier passed without delivering: settled offsets.
    fn note_frontier(&mut self, frontier_before: u64, delivered_now: &BTreeSet<u64>) {
        let dead_now = self.finished_dead();
        let start = self.start;
        for q in frontier_before..self.t.frontier().0 {
            if !delivered_now.contains(&q) {
                let discarded =
                    self.discarded_ever.contains(&q) && self.finished_epoch.contains(&q);
                assert!(
                    q < start || self.control.contains(&q) || dead_now.contains(&q) || discarded,
                    "the frontier passed {q} without delivering it"
                );
                // Retention counts whatever it removed; a dead letter the
                // frontier passes breaks the run.
                if q < start || !(dead_now.contains(&q) || discarded) {
                    self.settled_epoch.insert(q);
                }
            }
        }
    }

    fn model_in_flight(&self) -> u32 {
        self.mrec.values().filter(|m| m.st != MState::Owed).count() as u32
    }

    /// Pick something a consumer holds (or held), sometimes anything at all.
    fn pick(&mut self) -> (usize, u64, u32) {
        let ci = self.rng.gen_range(0..self.consumers.len());
        if !self.consumers[ci].held.is_empty() && self.rng.gen_bool(0.9) {
            let i = self.rng.gen_range(0..self.consumers[ci].held.len());
            let (o, a) = self.consumers[ci].held[i];
            (ci, o, a)
        } else {
            let o = self.rng.gen_range(0..self.end + 3);
            (ci, o, self.rng.gen_range(0..=self.cfg.max_attempts + 1))
        }
    }

    fn forget(&mut self, ci: usize, o: u64) {
        self.consumers[ci].held.retain(|&(h, _)| h != o);
    }

    fn op_ack(&mut self) {
        let (ci, o, _) = self.pick();
        // Below the log start the tracker may or may not have dropped a
        // carried entry yet; either answer is fine there.
        let voided = self.carried.contains_key(&o) && o >= self.start;
        let in_play = self.mrec.contains_key(&o) && !self.carried.contains_key(&o);
        let r = self.t.ack(self.now, &[Offset(o)], self.log());
        self.note(format!("ack {o} by c{ci} -> {r:?}"));
        if self.t.exists() && o < self.end && voided {
            assert!(
                matches!(r, Err(GroupError::StaleClaim(_))),
                "an ack of {o}, voided by a seek, was not refused: {r:?}"
            );
        }
        if self.t.exists() {
            if in_play {
                assert!(r.is_ok(), "an ack of {o}, in play, was refused: {r:?}");
            }
            if o >= self.end {
                assert!(matches!(r, Err(GroupError::InvalidRequest(_))));
            }
        }
        if let Ok(w) = r {
            if in_play {
                self.finish(o);
                self.acked_ever.insert(o);
            } else {
                assert!(w.is_empty(), "a duplicate ack of {o} wrote {w:?}");
            }
            self.write(w, true);
        }
        self.forget(ci, o);
    }

    fn owed(&self, o: u64) -> bool {
        matches!(self.mrec.get(&o), Some(m) if matches!(m.st, MState::Owed))
    }

    /// Whether the model says delivery `a` of `o` is still the latest one
    /// and not handed back: its claim stands, or lapsed with the record owed
    /// but not handed out again (the guide's condition for extend and nack).
    /// A standing reservation is not: it goes to the member's newer
    /// connection next, which the old delivery must not undo.
    fn held(&self, o: u64, a: u32) -> bool {
        let now = self.now;
        a >= 1
            && !self.carried.contains_key(&o)
            && matches!(self.mrec.get(&o), Some(m) if m.attempts == a
            && match m.st {
                MState::Claimed { reserved_for: Some(_), deadline, .. } => deadline <= now,
                MState::Claimed { .. } | MState::Owed => true,
                MState::Delayed { .. } => false,
            })
    }

    fn op_nack(&mut self) {
        let (ci, o, a) = self.pick();
        let delay = match self.rng.gen_range(0..4) {
            0 => None,
            1 => Some(0),
            2 => Some(self.rng.gen_range(1..4 * self.cfg.visibility_ms)),
            _ => Some(self.rng.gen_range(0..u64::MAX / 2)),
        };
        let at_cap = self.model_in_flight() >= self.cfg.max_in_flight;
        let ok = self.t.exists()
            && self.held(o, a)
            && !(self.owed(o) && delay.is_some_and(|d| d > 0) && at_cap);
        let r = self
            .t
            .nack(self.now, Offset(o), a, delay, Some("sim"), self.log());
        self.note(format!("nack {o}#{a} delay {delay:?} by c{ci} -> {r:?}"));
        assert_eq!(
            r.is_ok(),
            ok,
            "nack {o}#{a}: model says {ok}, tracker {r:?}"
        );
        self.stats.stale_refusals += matches!(r, Err(GroupError::StaleClaim(_))) as u64;
        if let Err(e) = &r {
            assert!(
                o >= self.end || !self.t.exists() || !matches!(e, GroupError::NotFound(_)),
                "{e:?}"
            );
        }
        if let Ok(w) = r {
            if a >= self.cfg.max_attempts {
                self.finish(o);
                assert!(self.dead().contains(&o));
                self.must_list.insert(o);
            } else {
                let m = self.mrec.get_mut(&o).unwrap();
                m.st = match delay.filter(|&d| d > 0) {
                    Some(d) => MState::Delayed {
                        until: self.now + d.min(self.cfg.max_visibility_ms),
                    },
                    None => MState::Owed,
                };
            }
            self.write(w, true);
            self.forget(ci, o);
        }
    }

    fn op_extend(&mut self) {
        let (ci, o, a) = self.pick();
        let ms = self.rng.gen_range(0..4 * self.cfg.visibility_ms);
        let at_cap = self.model_in_flight() >= self.cfg.max_in_flight;
        // A claim lapsed at the bound is the broker's to give up on.
        let lapsed_at_bound = matches!(self.mrec.get(&o), Some(m)
            if m.attempts >= self.cfg.max_attempts
                && matches!(m.st, MState::Claimed { deadline, .. } if deadline <= self.now));
        let ok =
            self.t.exists() && self.held(o, a) && !(self.owed(o) && at_cap) && !lapsed_at_bound;
        let r = self.t.extend(self.now, Offset(o), a, ms, self.log());
        self.note(format!("extend {o}#{a} by {ms} -> {r:?}"));
        assert_eq!(
            r.is_ok(),
            ok,
            "extend {o}#{a}: model says {ok}, tracker {r:?}"
        );
        if let Ok(stands) = r {
            assert_eq!(stands, self.clamp_vis(ms));
            let now = self.now;
            let conn = self.consumers[ci].conn;
            let m = self.mrec.get_mut(&o).unwrap();
            m.st = match m.st {
                // A standing claim keeps its holder and reservation.
                MState::Claimed {
                    deadline,
                    member,
                    conn,
                    reserved_for,
                } if deadline > now => MState::Claimed {
                    deadline: now + stands,
                    member,
                    conn,
                    reserved_for,
                },
                // A lapsed claim not yet given back keeps its member.
                MState::Claimed {
                    member: Some(member),
                    conn: holder,
                    reserved_for: None,
                    ..
                } => MState::Claimed {
                    deadline: now + stands,
                    member: Some(member),
                    conn: holder,
                    reserved_for: None,
                },
                // A lapsed reservation, or an owed record, is taken back
                // as a plain claim.
                _ => MState::Claimed {
                    deadline: now + stands,
                    member: None,
                    conn,
                    reserved_for: None,
                },
            };
        } else if matches!(r, Err(GroupError::StaleClaim(_))) {
            self.forget(ci, o);
        }
    }

    fn op_dead_letter(&mut self) {
        let (ci, o, a) = self.pick();
        let ok = self.t.exists()
            && a >= 1
            && !self.carried.contains_key(&o)
            && self.mrec.get(&o).is_some_and(|m| m.attempts == a);
        let r = self
            .t
            .dead_letter(self.now, Offset(o), a, Some("sim gives up"), self.log());
        self.note(format!("dead_letter {o}#{a} -> {r:?}"));
        assert_eq!(
            r.is_ok(),
            ok,
            "dead_letter {o}#{a}: model says {ok}, tracker {r:?}"
        );
        if let Ok(w) = r {
            self.stats.consumer_dead_letters += 1;
            self.finish(o);
            self.must_list.insert(o);
            self.write(w, true);
            assert!(self.dead().contains(&o));
        }
        self.forget(ci, o);
    }

    fn op_advance(&mut self, max: u64) {
        let ms = self.rng.gen_range(0..max);
        self.now += ms;
        self.note(format!("advance {ms}"));
    }

    fn op_tick(&mut self) {
        let dead = if self.t.exists() {
            self.model_expire()
        } else {
            vec![]
        };
        let w = self.t.tick(self.now);
        self.note(format!("tick -> {} writes", w.len()));
        self.write(w, false);
        self.check_dead(&dead);
        if let Some(d) = self.t.next_deadline() {
            assert!(d > self.now, "a deadline at or before now survived a tick");
        }
    }

    fn op_reconnect(&mut self) {
        let ci = self.rng.gen_range(0..self.consumers.len());
        self.consumers[ci].conn = self.next_conn;
        self.next_conn += 1;
        if self.rng.gen_bool(0.7) {
            self.consumers[ci].held.clear();
        }
        self.note(format!("c{ci} reconnects as {}", self.consumers[ci].conn));
    }

    fn pick_start(&mut self) -> StartAt {
        match self.rng.gen_range(0..5) {
            0 => StartAt::Earliest,
            1 => StartAt::Latest,
            2 => StartAt::Offset(Offset(self.end + self.rng.gen_range(1..3))),
            _ => StartAt::Offset(Offset(self.rng.gen_range(self.start..=self.end))),
        }
    }

    fn resolve(&self, at: StartAt) -> Option<u64> {
        match at {
            StartAt::Earliest => Some(self.start),
            StartAt::Latest => Some(self.end),
            StartAt::Offset(o) if o.0 >= self.start && o.0 <= self.end => Some(o.0),
            StartAt::Offset(_) => None,
        }
    }

    fn op_seek(&mut self) {
        let to = self.pick_start();
        let before = self.t.position().0;
        let exists = self.t.exists();
        let r = self.t.seek(self.now, to, self.log());
        self.note(format!("seek {to:?} -> {r:?}"));
        match (exists, self.resolve(to)) {
            (false, _) => assert!(matches!(r, Err(GroupError::NotFound(_)))),
            (true, None) => assert!(matches!(r, Err(GroupError::InvalidRequest(_)))),
            (true, Some(p)) => {
                let w = r.expect("a valid seek");
                self.stats.seeks += 1;
                self.write(w, true);
                assert_eq!(self.t.position().0, p);
                if p > before {
                    self.exempt.push((before, p));
                }
                let voided: Vec<(u64, u32)> = self
                    .mrec
                    .iter()
                    .filter(|(_, m)| m.attempts > 0)
                    .map(|(o, m)| (*o, m.attempts))
                    .chain(self.carried.iter().map(|(o, a)| (*o, *a)))
                    .collect();
                let skips: BTreeMap<u64, u64> = self
                    .mrec
                    .iter()
                    .map(|(o, m)| (*o, m.skipped_before))
                    .chain(self.carried_skipped.iter().map(|(o, k)| (*o, *k)))
                    .filter(|(_, k)| *k > 0)
                    .collect();
                self.new_epoch();
                // Voided deliveries keep their attempts: the next delivery
                // counts on from them; one at the bound is set aside now.
                let mut dead = vec![];
                for (o, a) in voided {
                    // Redriven and not finished (the model's own record of
                    // it: a redrive stays owed wherever the seek lands).
                    let redriven = self.mrec.contains_key(&o) || self.must_owe.contains(&o);
                    if !redriven && o < p {
                        continue;
                    }
                    if a >= self.cfg.max_attempts {
                        dead.push(o);
                        self.finish(o);
                        continue;
                    }
                    let skipped = skips.get(&o).copied().unwrap_or(0);
                    match self.mrec.get_mut(&o) {
                        Some(m) => {
                            m.attempts = a;
                            m.skipped_before = skipped;
                        }
                        None if skipped > 0 => {
                            self.carried_skipped.insert(o, skipped);
                        }
                        None => {}
                    }
                    self.carried.insert(o, a);
                }
                self.check_dead(&dead);
                // A redrive stays owed across a seek, whichever way it
                // moves (the guide: until acknowledged or given up again),
                // the ones it passes included.
                let redriven = self.redriven();
                for &o in &self.must_owe {
                    assert!(
                        o < self.start || o >= p || redriven.contains(&o),
                        "the seek to {p} dropped the redrive of {o}"
                    );
                }
            }
        }
    }

    fn op_create(&mut self) {
        let at = self.pick_start();
        let exists = self.t.exists();
        let r = self.t.create(self.now, at, self.log());
        self.note(format!("create {at:?} -> {r:?}"));
        match (exists, self.resolve(at)) {
            (true, _) => assert_eq!(r, Ok(vec![])),
            (false, None) => assert!(matches!(r, Err(GroupError::InvalidRequest(_)))),
            (false, Some(p)) => {
                self.write(r.expect("a valid create"), true);
                self.exempt.push((0, p));
                self.new_epoch();
            }
        }
    }

    fn op_delete(&mut self) {
        let exists = self.t.exists();
        let r = self.t.delete(self.now);
        self.note(format!("delete -> {r:?}"));
        assert_eq!(r.is_ok(), exists);
        if let Ok(w) = r {
            self.write(w, true);
            self.must_owe.clear();
            self.must_list.clear();
            self.new_epoch();
        }
    }

    fn op_redrive(&mut self) {
        let dead: Vec<u64> = self.dead().into_iter().collect();
        let o = if !dead.is_empty() && self.rng.gen_bool(0.9) {
            dead[self.rng.gen_range(0..dead.len())]
        } else {
            self.rng.gen_range(0..self.end + 2)
        };
        let ok = dead.contains(&o) && o >= self.start;
        let position = self.t.position().0;
        let frontier = self.t.frontier().0;
        let r = self.t.redrive(self.now, Offset(o), self.log());
        self.note(format!("redrive {o} -> {r:?}"));
        assert_eq!(r.is_ok(), ok);
        if let Ok(w) = r {
            self.stats.redrives += 1;
            self.write(w, true);
            assert!(!self.mrec.contains_key(&o));
            if o < position || o < frontier {
                self.mrec.insert(
                    o,
                    MRec {
                        attempts: 0,
                        st: MState::Owed,
                        skipped_before: 0,
                    },
                );
                self.finished_epoch.remove(&o);
            }
            self.must_list.remove(&o);
            self.must_owe.insert(o);
        }
    }

    fn op_discard(&mut self) {
        let dead: Vec<u64> = self.dead().into_iter().collect();
        let o = if !dead.is_empty() && self.rng.gen_bool(0.9) {
            dead[self.rng.gen_range(0..dead.len())]
        } else {
            self.rng.gen_range(0..self.end + 2)
        };
        let frontier = self.t.frontier().0;
        let r = self.t.discard(self.now, Offset(o));
        self.note(format!("discard {o} -> {r:?}"));
        assert_eq!(r.is_ok(), dead.contains(&o));
        if let Ok(w) = r {
            self.write(w, true);
            self.discarded_ever.insert(o);
            // Discarded is still finished (whether or not the frontier
            // passed it yet): it is never delivered again.
            let _ = frontier;
            self.finished_epoch.insert(o);
            self.must_list.remove(&o);
        }
    }

    fn op_retention(&mut self) {
        if self.end > self.start {
            self.start += self.rng.gen_range(0..=(self.end - self.start) / 2 + 1);
            self.start = self.start.min(self.end);
        }
        self.note(format!("retention -> start {}", self.start));
    }

    fn op_evict(&mut self) {
        let force = self.rng.gen_bool(0.3);
        let can = self.t.can_evict(self.now);
        if can {
            let now = self.now;
            assert!(
                !self.mrec.values().any(|m| match m.st {
                    MState::Claimed { deadline, .. } => deadline > now,
                    MState::Delayed { until } => until > now,
                    MState::Owed => false,
                }),
                "evictable with a claim or delay standing"
            );
        }
        if can || force {
            self.note(format!("evict (forced {force})"));
            self.t.reset_to_durable();
            self.check_kept_skips();
            self.stats.evictions += 1;
            // Who reclaimed last outlives the eviction (connections stay).
            self.new_epoch();
        }
    }

    fn op_crash(&mut self) {
        let cut = self.rng.gen_range(self.durable_len..=self.entries.len());
        self.entries.truncate(cut);
        self.snapshots.retain(|&s| s < cut);
        self.durable_len = cut;
        let from = self.snapshots.last().copied().unwrap_or(0);
        let mut t = GroupTracker::new("workers", self.cfg.clone());
        let mut replica = GroupTracker::new("workers", self.cfg.clone());
        for e in &self.entries[from..] {
            t.apply_entry(e);
            replica.apply_entry(e);
        }
        t.reset_to_durable();
        self.t = t;
        self.replica = replica;
        self.check_kept_skips();
        self.stats.crashes += 1;
        self.stats.snapshot_replays += (from > 0) as u64;
        self.note(format!(
            "crash: log cut to {cut} entries, replayed from {from}"
        ));
        // Whatever was answered after waiting for durability survives.
        let position = self.t.position().0;
        let redriven = self.redriven();
        let dead = self.dead();
        for &o in &self.must_owe {
            assert!(
                o < self.start || (redriven.contains(&o) || o >= position) && !dead.contains(&o),
                "a redrive of {o} answered before the crash was lost"
            );
        }
        for &o in &self.must_list {
            assert!(
                dead.contains(&o),
                "dead letter {o} answered before the crash was lost"
            );
        }
        self.last_reclaim.clear();
        self.new_epoch();
    }

    fn op_snapshot(&mut self) {
        let s = self.t.snapshot_entries();
        if !s.is_empty() {
            self.snapshots.push(self.entries.len());
            self.note(format!("snapshot at entry {}", self.entries.len()));
            self.write(s, false);
        }
    }

    fn op_describe(&mut self) {
        let Ok(st) = self.t.describe(self.now, self.log()) else {
            assert!(!self.t.exists());
            return;
        };
        let now = self.now;
        let max = self.cfg.max_attempts;
        let (mut in_flight, mut delayed, mut owed, mut dead) = (0, 0, 0, 0);
        for m in self.mrec.values() {
            match m.st {
                MState::Claimed { deadline, .. } if deadline > now => in_flight += 1,
                MState::Claimed { .. } if m.attempts >= max => dead += 1,
                MState::Delayed { until } if until > now => {
                    in_flight += 1;
                    delayed += 1
                }
                _ => owed += 1,
            }
        }
        assert_eq!(
            (st.in_flight, st.delayed, st.owed, st.dead_letters),
            (in_flight, delayed, owed, self.dead().len() as u64 + dead),
            "describe"
        );
        assert_eq!(st.position, self.t.position());
    }

    fn op_junk(&mut self) {
        // Requests naming anything at all: checked by the model's predictions.
        match self.rng.gen_range(0..4) {
            0 => self.op_ack(),
            1 => self.op_nack(),
            2 => self.op_extend(),
            _ => self.op_dead_letter(),
        }
    }

    // ---------------------------------------------------------------- checks

    fn check(&mut self) {
        self.t.check_invariants();
        assert_eq!(
            self.cfg.shared_claims.held(),
            u64::from(self.t.in_flight()) + u64::from(self.replica.in_flight()),
            "the shared claim count is the trackers' claims"
        );
        assert_eq!(
            self.replica.durable(),
            self.t.durable(),
            "replaying the written entries differs from the durable state"
        );
        // The tracker's slots are the model's, state for state.
        let view = self.t.slot_view();
        let model: BTreeMap<u64, (char, u32, u64)> = self
            .mrec
            .iter()
            .map(|(&o, m)| {
                let v = match m.st {
                    MState::Claimed {
                        deadline,
                        reserved_for,
                        ..
                    } => (
                        if reserved_for.is_some() { 'R' } else { 'C' },
                        m.attempts,
                        deadline,
                    ),
                    MState::Delayed { until } => ('D', m.attempts, until),
                    MState::Owed => ('O', m.attempts, 0),
                };
                (o, v)
            })
            .collect();
        assert_eq!(view, model, "tracker slots differ from the model");
        assert!(self.t.in_flight() <= self.cfg.max_in_flight);
        // The position passes only finished offsets.
        let position = self.t.position().0;
        // Finished dead letters, discarded ones above the position included.
        let dead = self.finished_dead();
        if !self.position_may_jump {
            assert!(
                position >= self.last_position,
                "the position moved back from {} to {position}",
                self.last_position
            );
            for q in self.last_position..position {
                assert!(
                    self.finished_epoch.contains(&q)
                        || self.settled_epoch.contains(&q)
                        || dead.contains(&q)
                        || self.control.contains(&q)
                        || q < self.start,
                    "the position passed {q}, which is not finished"
                );
            }
        }
        let redriven = self.redriven();
        for &o in self.mrec.keys() {
            assert!(
                o >= position || redriven.contains(&o),
                "the position passed {o}, still in play"
            );
        }
        self.last_position = position;
        self.position_may_jump = false;
    }

    fn run(&mut self, steps: usize) -> Stats {
        self.steps = steps;
        for _ in 0..steps {
            self.step += 1;
            let ci = self.rng.gen_range(0..self.consumers.len());
            match self.rng.gen_range(0..1000) {
                0..=89 => self.op_append(),
                90..=279 => self.op_poll(ci),
                280..=319 => self.op_plan(ci),
                320..=459 => self.op_ack(),
                460..=519 => self.op_nack(),
                520..=559 => self.op_extend(),
                560..=579 => self.op_dead_letter(),
                580..=689 => {
                    let max = self.cfg.visibility_ms;
                    self.op_advance(max)
                }
                690..=699 => {
                    let max = 3 * self.cfg.max_visibility_ms;
                    self.op_advance(max)
                }
                700..=739 => self.op_tick(),
                740..=764 => self.op_reconnect(),
                765..=774 => self.op_seek(),
                775..=784 => self.op_create(),
                785..=787 => self.op_delete(),
                788..=819 => self.op_redrive(),
                820..=834 => self.op_discard(),
                835..=849 => self.op_retention(),
                850..=864 => self.op_evict(),
                865..=879 => self.op_crash(),
                880..=899 => self.op_snapshot(),
                900..=929 => self.op_describe(),
                _ => self.op_junk(),
            }
            self.check();
        }
        self.drain();
        self.stats
    }

    /// Let every claim lapse, then poll and ack until the group is at the
    /// tail; every offset below it must then be accounted for.
    fn drain(&mut self) {
        self.note("drain".to_string());
        self.now += self.cfg.max_visibility_ms + 1;
        self.op_tick();
        self.check();
        let caller = Caller::anonymous(u64::MAX);
        for _ in 0..100_000 {
            let dead = self.prepare(&caller, None);
            let (start, control) = (self.start, self.control.clone());
            let mut lookup = |o: Offset| {
                if o.0 < start || control.contains(&o.0) {
                    Lookup::Skipped
                } else {
                    Lookup::Record {
                        payload_bytes: payload(o.0),
                    }
                }
            };
            let log = self.log();
            let frontier_before = self.t.frontier().0;
            let out = self.t.poll(self.now, &caller, 0, None, log, &mut lookup);
            self.write(out.writes, false);
            self.check_dead(&dead);
            let offsets: Vec<Offset> = out.deliveries.iter().map(|d| d.offset).collect();
            let delivered_now = offsets.iter().map(|o| o.0).collect();
            self.note_frontier(frontier_before, &delivered_now);
            for &o in &offsets {
                self.finish(o.0);
                self.acked_ever.insert(o.0);
            }
            let w = self
                .t
                .ack(self.now, &offsets, self.log())
                .expect("drain ack");
            self.write(w, true);
            self.check();
            if offsets.is_empty() {
                break;
            }
        }
        assert_eq!(
            self.t.position().0,
            self.end,
            "the drained group is not at the tail"
        );
        assert_eq!(self.t.in_flight(), 0);
        let dead = self.dead();
        for o in 0..self.end {
            let ok = self.control.contains(&o)
                || o < self.start
                || self.exempt.iter().any(|&(a, b)| o >= a && o < b)
                || self.acked_ever.contains(&o)
                || dead.contains(&o)
                || self.discarded_ever.contains(&o);
            assert!(
                ok,
                "offset {o} was lost: never acked, dead-lettered or discarded"
            );
        }
    }
}

fn mix(i: u64) -> u64 {
    // splitmix64, so consecutive case numbers give unrelated schedules.
    let mut z = i.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

#[test]
fn group_simulation_of_random_schedules_keeps_every_invariant() {
    if let Some(seed) = env_u64("FELIX_SIM_SEED") {
        let steps = env_u64("FELIX_SIM_STEPS").unwrap_or(400);
        Sim::new(seed).run(steps as usize);
        return;
    }
    let cases = env_u64("FELIX_SIM_CASES").unwrap_or(3_000);
    let mut stats = Stats::default();
    for i in 0..cases {
        stats.add(&Sim::new(mix(i)).run(400));
    }
    println!("{cases} schedules exercised {stats:?}");
    if cases >= 500 {
        assert!(
            stats.fields().iter().all(|&n| n > 0),
            "a path was never exercised: {stats:?}"
        );
    }
}

#[test]
fn group_simulation_with_long_schedules() {
    if env_u64("FELIX_SIM_SEED").is_some() {
        return;
    }
    let cases = env_u64("FELIX_SIM_CASES").map_or(30, |c| c / 100 + 1);
    let mut stats = Stats::default();
    for i in 0..cases {
        stats.add(&Sim::new(mix(1 << 40 | i)).run(5_000));
    }
    println!("{cases} long schedules exercised {stats:?}");
}
