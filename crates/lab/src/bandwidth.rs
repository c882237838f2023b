//! Memory read bandwidth, measured in the run that reports a fraction of it (the host's bandwidth moves
//! with its neighbours): each of T threads reads (sums) and copies its own 256 MiB buffer, 7 passes.
//! Decode reads every weight byte and every attended KV byte once per token, so `read GB/s ÷ bytes per
//! token` is the ceiling on decode tokens/s.

use serde::Serialize;
use std::time::Instant;

const BYTES: usize = 256 << 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn pass(threads: usize, bufs: &mut [(Vec<u64>, Vec<u64>)], copy: bool) -> f64 {
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for (src, dst) in bufs.iter_mut().take(threads) {
            s.spawn(move || {
                if copy {
                    dst.copy_from_slice(src);
                    std::hint::black_box(&dst);
                } else {
                    // 8 independent sums so the loop is load-bound, not add-latency-bound.
                    let mut acc = [0u64; 8];
                    for c in src.chunks_exact(8) {
                        for k in 0..8 {
                            acc[k] = acc[k].wrapping_add(c[k]);
                        }
                    }
                    std::hint::black_box(acc);
                }
            });
        }
    });
    let secs = t0.elapsed().as_secs_f64();
    // A copy moves each byte twice (read + write).
    let moved = threads * BYTES * if copy { 2 } else { 1 };
    moved as f64 / secs / 1e9
}


#[derive(Clone, Copy, Debug, Serialize)]
pub struct Bandwidth {
    pub threads: usize,
    pub read_gb_s: f64,
    pub copy_gb_s: f64,
}

/// Medians of 7 read passes and 7 copy passes over `threads` threads (after one of each untimed).
pub fn measure(threads: usize) -> Bandwidth {
    let threads = threads.max(1);
    let words = BYTES / 8;
    let mut bufs: Vec<(Vec<u64>, Vec<u64>)> = (0..threads).map(|i| (vec![i as u64 + 1; words], vec![0; words])).collect();
    pass(threads, &mut bufs, false); // fault the pages in
    pass(threads, &mut bufs, true);
    let read_gb_s = median((0..7).map(|_| pass(threads, &mut bufs, false)).collect());
    let copy_gb_s = median((0..7).map(|_| pass(threads, &mut bufs, true)).collect());
    Bandwidth { threads, read_gb_s, copy_gb_s }
}
