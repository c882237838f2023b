//! Slow-state detection and fallback. The engine learns, online, how long a step of each shape takes on
//! this host when it is quiet, and notices from its own steps when the host has slowed down (another
//! process took a core, a noisy neighbour, thermal limits). On a 2-core host the parallel step degrades
//! worst: a worker that waits at every one of a step's ~240 parallel regions for a thread that the OS has
//! descheduled makes the whole step as slow as the slowest core (docs/reliability.md). The fallback runs
//! steps on the engine thread alone, partitioned exactly as the parallel step is (`Pool::serial`), so the
//! tokens are the same bits, and it returns when a probe step in the normal configuration is back within
//! the model, or when the last five probes were faster than the fallback on average (then no new slow
//! state for a while: the host is slow in a way the fallback does not help; 1 s, doubling with each such
//! loss in a row up to 30 s).
//!
//! The model: steps are bucketed by shape (log2 of the step's tokens, of its sequences and of the context
//! they attend to); a bucket's reference starts as the median of its first 8
//! normal-mode step times, which are not judged, then is a decaying minimum of them (it falls to every
//! new low at once and rises 0.2% per step, so it follows a lasting change in a few hundred steps but
//! not a burst). A step is slow when it took `margin` times its reference or more; a slow
//! state is declared when three quarters of the normal steps over the last 150 ms (at least 12) were
//! slow, and it ends after two probes in a row within the model (the second on the very next step).
//! Holds no tensors and no clock: callers pass times, so it is tested with made-up ones.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Probes in a row back within the model that end a slow state.
const BACK_PROBES: usize = 2;

/// Normal-mode steps a shape's reference starts from (their median); until then its steps are not judged.
const MIN_SAMPLES: usize = 8;

/// Probes whose mean time must beat the fallback's before it is left as the slower configuration.
const BEAT_PROBES: usize = 5;

/// How long no slow state is declared after a fallback turned out slower than the slowed normal steps:
/// `HOLD_OFF` after the first such loss, doubling with each loss in a row up to `HOLD_OFF_MAX`, and back
/// to `HOLD_OFF` once a slow state ends with the host back to normal. A fixed 10 s kept a real slow state
/// (a CPU hog) from being declared for 6.9 s after one false one (docs/reliability.md, the hog test).
const HOLD_OFF: Duration = Duration::from_secs(1);
const HOLD_OFF_MAX: Duration = Duration::from_secs(30);

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlowStateConfig {
    /// Off: every step runs in the normal configuration.
    pub enabled: bool,
    /// A step is slow at this multiple of its shape's reference.
    pub margin: f64,
    /// Normal-mode steps looked at: those of the last `window_time`, at least `window` of them; a slow
    /// state needs `min_slow` of every `window` slow, over at least `window_time`.
    pub window: usize,
    pub min_slow: usize,
    pub window_time: Duration,
    /// In a slow state, one step in the normal configuration this often.
    pub probe_every: Duration,
}

impl SlowStateConfig {
    /// What `reckon serve` runs with.
    pub const ON: SlowStateConfig = SlowStateConfig { enabled: true, margin: 1.5, window: 12, min_slow: 9, window_time: Duration::from_millis(150), probe_every: Duration::from_millis(250) };
}

/// Off: benchmarks and labs measure the configuration they were given.
impl Default for SlowStateConfig {
    fn default() -> Self {
        SlowStateConfig { enabled: false, ..SlowStateConfig::ON }
    }
}

/// How a step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The configuration the engine was started with (all threads).
    Normal,
    /// The known-safe one: the engine thread alone.
    Fallback,
}

/// A step's shape, what its cost depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepShape {
    pub tokens: usize,
    pub sequences: usize,
    /// Positions attended, over the step's sequences (each chunk's start plus its length).
    pub context: usize,
}

impl StepShape {
    /// The shape of a step's plan.
    pub fn of(plan: &super::StepPlan) -> StepShape {
        StepShape { tokens: plan.chunks.iter().map(|c| c.len).sum(), sequences: plan.chunks.len(), context: plan.chunks.iter().map(|c| c.start + c.len).sum() }
    }

    fn bucket(self) -> (u32, u32, u32) {
        let log2 = |n: usize| usize::BITS - n.leading_zeros();
        (log2(self.tokens), log2(self.sequences), log2(self.context / 256))
    }
}

/// A shape's normal-mode step time: the median of its first `MIN_SAMPLES` steps (so one odd first step,
/// fast or slow, does not set it), then a decaying minimum: down to every new low, up 0.2% a step.
#[derive(Clone, Debug, Default)]
struct Reference {
    first: Vec<f64>,
    secs: Option<f64>,
}

impl Reference {
    /// Takes a normal-mode step's time; its ratio to the reference before it, once there is one.
    fn observe(&mut self, secs: f64) -> Option<f64> {
        let Some(r) = self.secs.as_mut() else {
            self.first.push(secs);
            if self.first.len() == MIN_SAMPLES {
                self.first.sort_by(f64::total_cmp);
                self.secs = Some(self.first[MIN_SAMPLES / 2]);
                self.first = Vec::new();
            }
            return None;
        };
        let ratio = secs / *r;
        *r = secs.min(*r * 1.002);
        Some(ratio)
    }
}

/// A change of state, for the log and the metrics.
#[derive(Clone, Debug, PartialEq)]
pub enum Transition {
    /// Slow steps over the window: the median ratio to the model, and the fallback starts.
    Entered { median_ratio: f64 },
    /// A probe was back within the model (or faster than the fallback): how long the slow state lasted.
    Left { after: Duration, probe_ratio: f64 },
}

pub struct SlowState {
    cfg: SlowStateConfig,
    /// Normal-mode reference per bucket, seconds.
    refs: HashMap<(u32, u32, u32), Reference>,
    /// Fallback steps' recent time per bucket, seconds (an average that follows the last few).
    fallback: HashMap<(u32, u32, u32), f64>,
    /// The last normal-mode steps that had a reference: when they ended, and their ratio to it.
    recent: VecDeque<(Instant, f64)>,
    mode: Mode,
    entered: Option<Instant>,
    last_probe: Option<Instant>,
    /// After a fallback lost to the slowed normal steps, no new slow state before this (the host is
    /// slow in a way the fallback does not help).
    hold_off_until: Option<Instant>,
    /// The next hold-off's length (doubles with each loss in a row).
    hold_off: Duration,
    /// The last probes' times over the fallback's at their shape (a step on a contended host is
    /// bimodal, fast when the other process is off the core: the fallback is left as the slower
    /// configuration only when the probes' mean beats it, over `BEAT_PROBES` probes).
    probe_rel: VecDeque<f64>,
    /// Consecutive probes back within the model (`BACK_PROBES` end the slow state; after a good one
    /// the next step probes again at once).
    good_probes: usize,
    /// Slow states so far.
    pub episodes: u64,
}

impl SlowState {
    pub fn new(cfg: SlowStateConfig) -> SlowState {
        SlowState { cfg, refs: HashMap::new(), fallback: HashMap::new(), recent: VecDeque::new(), mode: Mode::Normal, entered: None, last_probe: None, hold_off_until: None, hold_off: HOLD_OFF, probe_rel: VecDeque::new(), good_probes: 0, episodes: 0 }
    }

    pub fn in_slow_state(&self) -> bool {
        self.mode == Mode::Fallback
    }

    /// How the next step runs: the fallback while in a slow state, but a normal step (a probe) every
    /// `probe_every`.
    pub fn plan(&self, now: Instant) -> Mode {
        match self.mode {
            Mode::Normal => Mode::Normal,
            Mode::Fallback if self.last_probe.is_none_or(|t| now.duration_since(t) >= self.cfg.probe_every) => Mode::Normal,
            Mode::Fallback => Mode::Fallback,
        }
    }

    /// A step of `shape` ran in `ran` and took `secs`.
    pub fn observe(&mut self, shape: StepShape, ran: Mode, secs: f64, now: Instant) -> Option<Transition> {
        if !self.cfg.enabled || !(secs > 0.0) || shape.tokens == 0 {
            return None;
        }
        let b = shape.bucket();
        if ran == Mode::Fallback {
            let avg = self.fallback.entry(b).or_insert(secs);
            *avg += 0.25 * (secs - *avg);
            return None;
        }
        let ratio = self.refs.entry(b).or_default().observe(secs);
        match self.mode {
            Mode::Normal => {
                let ratio = ratio?;
                self.recent.push_back((now, ratio));
                // drop the oldest step while the rest still reach back window_time (dropping every step
                // older than that left a span always short of it for steps under window_time / window:
                // 8 ms steps 1.6x slow for 300 steps were never a slow state)
                while self.recent.len() > self.cfg.window && self.recent.get(1).is_some_and(|&(t, _)| now.duration_since(t) >= self.cfg.window_time) {
                    self.recent.pop_front();
                }
                let n = self.recent.len();
                let slow = self.recent.iter().filter(|&&(_, x)| x >= self.cfg.margin).count();
                let span = self.recent.front().map_or(Duration::ZERO, |&(t, _)| now.duration_since(t));
                let held_off = self.hold_off_until.is_some_and(|t| now < t);
                // min_slow of every window steps, over at least window_time
                if n >= self.cfg.window && slow * self.cfg.window >= self.cfg.min_slow * n && span >= self.cfg.window_time && !held_off {
                    let mut sorted: Vec<f64> = self.recent.iter().map(|&(_, x)| x).collect();
                    sorted.sort_by(f64::total_cmp);
                    let median_ratio = sorted[sorted.len() / 2];
                    self.mode = Mode::Fallback;
                    self.entered = Some(now);
                    self.last_probe = Some(now);
                    self.episodes += 1;
                    self.recent.clear();
                    self.probe_rel.clear();
                    self.good_probes = 0;
                    return Some(Transition::Entered { median_ratio });
                }
                None
            }
            Mode::Fallback => {
                // a probe: back within the model, or faster than the fallback at this shape
                self.last_probe = Some(now);
                let probe_ratio = ratio.unwrap_or(1.0);
                if let Some(&f) = self.fallback.get(&b) {
                    self.probe_rel.push_back(secs / f);
                    if self.probe_rel.len() > BEAT_PROBES {
                        self.probe_rel.pop_front();
                    }
                }
                let beats = self.probe_rel.len() == BEAT_PROBES && self.probe_rel.iter().sum::<f64>() < 0.9 * BEAT_PROBES as f64;
                self.good_probes = if probe_ratio < self.cfg.margin { self.good_probes + 1 } else { 0 };
                if self.good_probes > 0 && self.good_probes < BACK_PROBES {
                    // looks back to normal: check again on the next step
                    self.last_probe = None;
                }
                if self.good_probes >= BACK_PROBES || beats {
                    self.probe_rel.clear();
                    self.good_probes = 0;
                    let after = self.entered.map_or(Duration::ZERO, |t| now.duration_since(t));
                    self.mode = Mode::Normal;
                    self.entered = None;
                    self.recent.clear();
                    if probe_ratio >= self.cfg.margin {
                        self.hold_off_until = Some(now + self.hold_off);
                        self.hold_off = (self.hold_off * 2).min(HOLD_OFF_MAX);
                    } else {
                        self.hold_off = HOLD_OFF;
                    }
                    return Some(Transition::Left { after, probe_ratio });
                }
                None
            }
        }
    }
}

/// The engine's side of it: the model of the host, the fallback's pool (the engine thread alone,
/// partitioned as the normal pool), and the log line and counters each change of state gives.
pub struct SlowStage {
    state: SlowState,
    serial_pool: Option<crate::pool::Pool>,
}

impl SlowStage {
    pub fn new(cfg: SlowStateConfig) -> SlowStage {
        SlowStage { state: SlowState::new(cfg), serial_pool: None }
    }

    /// How the step starting `now` runs, and for a fallback step the pool to run it in.
    pub fn begin(&mut self, now: Instant) -> (Mode, Option<crate::pool::Pool>) {
        let mode = self.state.plan(now);
        let pool = (mode == Mode::Fallback).then(|| self.serial_pool.take().unwrap_or_else(|| crate::pool::Pool::serial(crate::pool::current().threads())));
        (mode, pool)
    }

    /// The step of `shape` ran in `mode` (its pool handed back) and took `secs`: fed to the model; a
    /// change of state is logged and counted in `stats`.
    pub fn end(&mut self, shape: StepShape, mode: Mode, pool: Option<crate::pool::Pool>, secs: f64, stats: &super::EngineStats) {
        use std::sync::atomic::Ordering::Relaxed;
        if pool.is_some() {
            self.serial_pool = pool;
        }
        match self.state.observe(shape, mode, secs, Instant::now()) {
            Some(Transition::Entered { median_ratio }) => {
                tracing::warn!("slow state: steps take {median_ratio:.1}x what this host's model of them says; running steps on the engine thread alone until a probe step is back within the model");
                stats.slow_state.store(true, Relaxed);
                stats.slow_state_episodes.fetch_add(1, Relaxed);
                stats.slow_state_since_ms.store(super::stats::unix_ms(), Relaxed);
            }
            Some(Transition::Left { after, probe_ratio }) => {
                tracing::warn!("slow state over after {:.0} ms (a probe step at {probe_ratio:.2}x the model): back to the normal configuration", after.as_secs_f64() * 1e3);
                stats.slow_state.store(false, Relaxed);
                stats.slow_state_ns.fetch_add(after.as_nanos() as u64, Relaxed);
            }
            None => {}
        }
        if mode == Mode::Fallback {
            stats.slow_state_fallback_steps.fetch_add(1, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DECODE: StepShape = StepShape { tokens: 8, sequences: 8, context: 1200 };

    /// Feeds steps of `secs` each (a step's time apart), returning the transitions with the step index.
    fn feed(s: &mut SlowState, t: &mut Instant, n: usize, mut secs: impl FnMut(Mode) -> f64) -> Vec<(usize, Transition)> {
        let mut out = Vec::new();
        for i in 0..n {
            let mode = s.plan(*t);
            let d = secs(mode);
            *t += Duration::from_secs_f64(d);
            if let Some(tr) = s.observe(DECODE, mode, d, *t) {
                out.push((i, tr));
            }
        }
        out
    }

    #[test]
    fn a_hog_is_detected_the_fallback_runs_and_the_engine_returns() {
        let mut s = SlowState::new(SlowStateConfig::ON);
        let mut t = Instant::now();
        // quiet: 8 ms steps with a little jitter, no transition
        assert!(feed(&mut s, &mut t, 200, |_| 0.008 + 0.0005 * rand_like()).is_empty());
        // a hog: parallel steps take 3x, the fallback 1.5x the quiet parallel step
        let hog = |m: Mode| if m == Mode::Normal { 0.024 } else { 0.012 };
        let tr = feed(&mut s, &mut t, 100, hog);
        assert!(matches!(tr[0], (8, Transition::Entered { median_ratio }) if median_ratio > 2.9), "the ninth slow step of the window: {tr:?}");
        assert_eq!(tr.len(), 1, "no flapping while the hog runs: {tr:?}");
        assert!(s.in_slow_state());
        // the hog ends: the next probe (within 250 ms) sees a quiet step and the engine returns
        let tr = feed(&mut s, &mut t, 100, |_| 0.008);
        assert!(matches!(tr[..], [(i, Transition::Left { probe_ratio, .. })] if i <= 250 / 8 + 1 && probe_ratio < 1.1), "{tr:?}");
        assert_eq!((s.episodes, s.in_slow_state()), (1, false));
    }

    #[test]
    fn bursts_and_other_shapes_are_not_a_slow_state() {
        let mut s = SlowState::new(SlowStateConfig::ON);
        let mut t = Instant::now();
        feed(&mut s, &mut t, 50, |_| 0.008);
        // a burst of 8 slow steps of 12 is below the 9 the window asks
        for i in 0..60 {
            let d = if i % 12 < 8 { 0.02 } else { 0.008 };
            t += Duration::from_secs_f64(d);
            assert_eq!(s.observe(DECODE, Mode::Normal, d, t), None, "step {i}");
        }
        // a larger step (a prefill) is its own bucket: no reference yet, not slow
        for _ in 0..20 {
            t += Duration::from_millis(80);
            assert_eq!(s.observe(StepShape { tokens: 512, sequences: 1, context: 512 }, Mode::Normal, 0.08, t), None);
        }
        assert!(!s.in_slow_state());
    }

    #[test]
    fn a_fallback_slower_than_the_slowed_normal_step_is_left_and_held_off_longer_each_time() {
        let mut s = SlowState::new(SlowStateConfig::ON);
        let mut t = Instant::now();
        feed(&mut s, &mut t, 50, |_| 0.008);
        // both cores busy: normal steps 2x, the fallback worse still (3x), for 20 s
        let (start, mut events) = (t, Vec::new());
        while t.duration_since(start) < Duration::from_secs(20) {
            let mode = s.plan(t);
            let d = if mode == Mode::Normal { 0.016 } else { 0.024 };
            t += Duration::from_secs_f64(d);
            if let Some(tr) = s.observe(DECODE, mode, d, t) {
                events.push((t.duration_since(start).as_secs_f64(), tr));
            }
        }
        // entered, left (five probes beat the fallback), held off 1 s, entered and left again, held off
        // 2 s; meanwhile the normal steps raise the model to the slowed host's speed, so no third one
        assert_eq!(events.len(), 4, "{events:?}");
        for (i, (_, tr)) in events.iter().enumerate() {
            assert_eq!(matches!(tr, Transition::Entered { .. }), i % 2 == 0, "{events:?}");
        }
        let gap = events[2].0 - events[1].0;
        assert!((1.0..1.5).contains(&gap), "held off {gap:.2} s after the first loss: {events:?}");
        assert_eq!(s.hold_off, Duration::from_secs(4), "two losses in a row: the next hold-off is 4 s");
        // a slow state that ends with the host back to normal resets the hold-off to 1 s
        feed(&mut s, &mut t, 2000, |_| 0.008);
        assert!(!s.in_slow_state());
        let hog = |m: Mode| if m == Mode::Normal { 0.024 } else { 0.012 };
        let tr = feed(&mut s, &mut t, 100, hog);
        assert!(matches!(tr[..], [(_, Transition::Entered { .. })]), "{tr:?}");
        feed(&mut s, &mut t, 100, |_| 0.008);
        assert!(!s.in_slow_state());
        assert_eq!(s.hold_off, HOLD_OFF);
    }

    #[test]
    fn a_slowdown_of_short_steps_is_found() {
        // 4 ms decode steps (SmolLM2 at depth 0), then a hog makes them 8 ms and the fallback 6 ms
        let mut s = SlowState::new(SlowStateConfig::ON);
        let mut t = Instant::now();
        assert!(feed(&mut s, &mut t, 400, |_| 0.004).is_empty());
        let tr = feed(&mut s, &mut t, 100, |m: Mode| if m == Mode::Normal { 0.008 } else { 0.006 });
        assert!(matches!(tr[..], [(i, Transition::Entered { median_ratio })] if i <= 20 && median_ratio > 1.9), "{tr:?}");
    }

    #[test]
    fn no_slow_state_before_a_shape_has_its_first_samples() {
        // a shape's first step happened to be fast (its caches warm from the step before), the next ones
        // run at the normal speed: a reference from that first step made them all look 1.6x slow
        let mut s = SlowState::new(SlowStateConfig::ON);
        let mut t = Instant::now();
        let steps = feed(&mut s, &mut t, 300, {
            let mut first = true;
            move |_| if std::mem::take(&mut first) { 0.005 } else { 0.008 + 0.0002 * rand_like() }
        });
        assert!(steps.is_empty(), "{steps:?}");
        // a real hog is still found
        let hog = |m: Mode| if m == Mode::Normal { 0.024 } else { 0.012 };
        let tr = feed(&mut s, &mut t, 100, hog);
        assert!(matches!(tr[..], [(_, Transition::Entered { .. })]), "{tr:?}");
    }

    #[test]
    fn disabled_never_changes_mode() {
        let mut s = SlowState::new(SlowStateConfig::default());
        let mut t = Instant::now();
        feed(&mut s, &mut t, 50, |_| 0.008);
        assert!(feed(&mut s, &mut t, 100, |_| 0.05).is_empty());
    }

    /// A fixed pseudo-random sequence in [0, 1) (no clock, no global state across tests that matters).
    fn rand_like() -> f64 {
        use std::sync::atomic::{AtomicU64, Ordering};
        static X: AtomicU64 = AtomicU64::new(12345);
        let x = X.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        ((x >> 11) % 1000) as f64 / 1000.0
    }
}
