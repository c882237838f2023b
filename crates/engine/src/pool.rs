//! A small persistent thread pool for the forward pass: `run(n_parts, f)` calls `f(part)` for every part
//! across the pool's threads and the caller's, and returns when all are done.
//!
//! Why not rayon: a decode step is ~240 parallel regions of a few microseconds each (every matmul and every
//! attention layer). Rayon's sleep/wake protocol cost ~15% of SmolLM2 decode (perf: `sched_yield`,
//! `__schedule`, wake-ups). Here idle workers spin on an epoch counter for a while before parking, so a
//! region that follows another starts within a cache-line transfer.
//!
//! Determinism does not depend on scheduling: parts are claimed dynamically, but every part computes its
//! outputs alone and in a fixed order, so which thread runs it cannot change a bit.

use std::cell::{Cell, UnsafeCell};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
const SPIN_FOR: Duration = Duration::from_millis(2);

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// Bumped once per `run`; workers wait for it to change.
    epoch: AtomicUsize,
    job: UnsafeCell<Option<Job>>,
    n_parts: AtomicUsize,
    next_part: AtomicUsize,
    /// Workers that have not finished the current epoch.
    pending: AtomicUsize,
    panicked: AtomicBool,
    stop: AtomicBool,
    /// Set by `rest`: idle workers park now instead of spinning out `spin_for`; cleared by `run`.
    rest: AtomicBool,
    /// How long an idle worker spins before it parks (SPIN_FOR but in tests).
    spin_for: Duration,
    sleepers: Mutex<usize>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the thread inside `run` while no worker reads it (before the epoch bump,
// after every worker has finished the previous epoch), and read by workers only between the bump and their
// `pending` decrement, during which `run` keeps the referenced closure alive and unchanged.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serialises concurrent `run` calls from different threads on the same pool.
    running: Mutex<()>,
    /// What `threads()` says, which kernels partition their work by: the threads there are, or for
    /// `serial`, those of the pool it stands in for.
    partition_threads: usize,
}

thread_local! {
    /// Set on pool worker threads (a nested `run` from a part runs serially) and by `install`.
    static IN_WORKER: Cell<bool> = const { Cell::new(false) };
    static INSTALLED: Cell<*const Pool> = const { Cell::new(std::ptr::null()) };
}

impl Pool {
    /// A pool that runs parts on `threads` threads in all: the caller plus `threads - 1` workers.
    pub fn new(threads: usize) -> Pool {
        Pool::with_spin(threads, SPIN_FOR)
    }

    fn with_spin(threads: usize, spin_for: Duration) -> Pool {
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            n_parts: AtomicUsize::new(0),
            next_part: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            rest: AtomicBool::new(false),
            spin_for,
            sleepers: Mutex::new(0),
            wake: Condvar::new(),
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("reckon-worker-{i}"))
                    .spawn(move || worker(&shared))
                    .expect("cannot spawn a pool worker thread")
            })
            .collect();
        Pool { shared, workers, running: Mutex::new(()), partition_threads: threads.max(1) }
    }

    /// A pool without workers that partitions work as a pool of `threads` threads does: every part runs
    /// on the caller, the parts are the same, so the results are bit for bit those of that pool (the
    /// engine's fallback when the host is slow, `engine::slow`).
    pub fn serial(threads: usize) -> Pool {
        let mut pool = Pool::new(1);
        pool.partition_threads = threads.max(1);
        pool
    }

    /// The threads kernels partition their work for (see `serial`).
    pub fn threads(&self) -> usize {
        self.partition_threads
    }

    /// Runs `f` with this pool as the one `current()` returns on this thread.
    pub fn install<R>(&self, f: impl FnOnce() -> R) -> R {
        let prev = INSTALLED.with(|c| c.replace(self as *const Pool));
        struct Restore(*const Pool);
        impl Drop for Restore {
            fn drop(&mut self) {
                INSTALLED.with(|c| c.set(self.0));
            }
        }
        let _restore = Restore(prev);
        f()
    }

    /// Tells idle workers to park now rather than spin: the caller knows that no run comes for a while
    /// and that other threads of the process need the cores meanwhile (the engine between two steps,
    /// while the HTTP threads stream its tokens). The next `run` wakes them.
    pub fn rest(&self) {
        self.shared.rest.store(true, Ordering::Relaxed);
    }

    /// Calls `f(part)` for `part in 0..n_parts`, spread over the pool; returns when all have returned.
    /// A panic in a part is re-raised here after the others finish.
    pub fn run(&self, n_parts: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_parts == 0 {
            return;
        }
        if self.workers.is_empty() || n_parts == 1 || IN_WORKER.with(|w| w.get()) {
            (0..n_parts).for_each(f);
            return;
        }
        let _running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // SAFETY: every worker finished the previous epoch (pending was 0 when the last run returned), so
        // none reads `job` now; the closure outlives this call, which waits for all workers below.
        unsafe {
            let job: Job = std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static (dyn Fn(usize) + Sync)>(f);
            *s.job.get() = Some(job);
        }
        s.n_parts.store(n_parts, Ordering::Relaxed);
        s.next_part.store(0, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        s.pending.store(self.workers.len(), Ordering::Relaxed);
        s.rest.store(false, Ordering::Relaxed);
        s.epoch.fetch_add(1, Ordering::Release);
        if *s.sleepers.lock().unwrap_or_else(|e| e.into_inner()) > 0 {
            s.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| claim_parts(s, f)));
        while s.pending.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
        // SAFETY: all workers are done with this epoch.
        unsafe { *s.job.get() = None };
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        assert!(!s.panicked.load(Ordering::Relaxed), "a thread-pool part panicked");
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        {
            let _g = self.shared.sleepers.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn claim_parts(s: &Shared, f: &(dyn Fn(usize) + Sync)) {
    let n = s.n_parts.load(Ordering::Relaxed);
    loop {
        let part = s.next_part.fetch_add(1, Ordering::Relaxed);
        if part >= n {
            return;
        }
        f(part);
    }
}

fn worker(s: &Shared) {
    IN_WORKER.with(|w| w.set(true));
    let mut seen = 0usize;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            spins = spins.wrapping_add(1);
            let rest = s.rest.load(Ordering::Relaxed);
            if !rest && (spins % 1024 != 0 || start.elapsed() < s.spin_for) {
                std::hint::spin_loop();
                continue;
            }
            let mut sleepers = s.sleepers.lock().unwrap_or_else(|e| e.into_inner());
            *sleepers += 1;
            while s.epoch.load(Ordering::Acquire) == seen && !s.stop.load(Ordering::Acquire) {
                sleepers = s.wake.wait(sleepers).unwrap_or_else(|e| e.into_inner());
            }
            *sleepers -= 1;
        }
        // SAFETY: `run` set `job` before bumping the epoch (Release/Acquire above) and keeps it until
        // `pending` reaches 0, which this worker only signals below.
        let job = unsafe { (*s.job.get()).expect("a job is set for every epoch") };
        let f = unsafe { &*job };
        if catch_unwind(AssertUnwindSafe(|| claim_parts(s, f))).is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

static GLOBAL: OnceLock<Pool> = OnceLock::new();

/// Sets the thread count of the global pool; only the first call (or first use) counts. Returns whether
/// this call set it.
pub fn init_global(threads: usize) -> bool {
    let mut set = false;
    GLOBAL.get_or_init(|| {
        set = true;
        Pool::new(threads)
    });
    set
}

/// The pool installed on this thread (`Pool::install`), else the global one (created on first use with
/// one thread per available core unless `init_global` said otherwise).
pub fn current() -> &'static Pool {
    let installed = INSTALLED.with(|c| c.get());
    if !installed.is_null() {
        // SAFETY: `install` keeps the pool borrowed (alive) while the pointer is set.
        return unsafe { &*installed };
    }
    GLOBAL.get_or_init(|| Pool::new(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_part_runs_once() {
        let pool = Pool::new(3);
        for n in [0usize, 1, 2, 7, 100, 1000] {
            let hits: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
            pool.run(n, &|p| {
                hits[p].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n={n}");
        }
    }

    #[test]
    fn many_short_runs_and_idle_gaps() {
        let pool = Pool::new(2);
        let total = AtomicU64::new(0);
        for i in 0..2000 {
            pool.run(4, &|p| {
                total.fetch_add(p as u64 + 1, Ordering::Relaxed);
            });
            if i % 500 == 0 {
                std::thread::sleep(Duration::from_millis(5)); // let the worker park
            }
        }
        assert_eq!(total.load(Ordering::Relaxed), 2000 * 10);
    }

    #[test]
    fn runs_after_rest_wake_the_parked_workers() {
        // Workers that would spin for a minute: only `rest` can make them park within the test.
        let pool = Pool::with_spin(3, Duration::from_secs(60));
        let total = AtomicU64::new(0);
        let sleepers = || *pool.shared.sleepers.lock().unwrap();
        for i in 0..200u64 {
            pool.run(6, &|_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
            if i % 50 == 0 {
                std::thread::sleep(Duration::from_millis(20));
                assert_eq!(sleepers(), 0, "without rest the workers keep spinning");
                pool.rest();
                // a generous deadline: a busy machine may hold a worker off its core
                let deadline = Instant::now() + Duration::from_secs(10);
                while sleepers() < 2 {
                    assert!(Instant::now() < deadline, "resting workers park");
                    std::thread::sleep(Duration::from_micros(100));
                }
            }
        }
        assert_eq!(total.load(Ordering::Relaxed), 200 * 6);
    }

    #[test]
    fn a_panicking_part_is_reported_and_the_pool_survives() {
        let pool = Pool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| pool.run(8, &|p| assert!(p != 5, "part 5"))));
        assert!(r.is_err());
        let count = AtomicU64::new(0);
        pool.run(8, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 8);
    }

    #[test]
    fn install_overrides_the_global_pool() {
        let pool = Pool::new(1);
        pool.install(|| assert_eq!(current().threads(), 1));
        let serial = Pool::serial(4);
        serial.install(|| assert_eq!(current().threads(), 4));
        let hits: Vec<AtomicU64> = (0..9).map(|_| AtomicU64::new(0)).collect();
        serial.run(9, &|p| {
            hits[p].fetch_add(1, Ordering::Relaxed);
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    }
}
