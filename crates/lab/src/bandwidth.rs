//! Memory read bandwidth, measured in the run that reports a fraction of it (the host's bandwidth moves
//! with its neighbours): each of T threads reads (sums) and copies its own 256 MiB buffer, 7 passes.
//! Decode reads every weight byte and every attended KV byte once per token, so `read GB/s ÷ bytes per
//! token` is the ceiling on decode tokens/s.
//!
//! That ceiling assumes the token's bytes come from DRAM. On a host whose last-level cache holds them
//! (a SmolLM2 token at depth 4,096 reads about 191 MB; some server parts have 260-480 MiB of L3) decode
//! can pass it, so `footprint` also measures the bandwidth of reading a working set of exactly a token's
//! bytes over and over, as decode does: DRAM's where the bytes do not fit, the cache's where they do.

use crate::stats::median;
use serde::Serialize;
use std::time::Instant;

const BYTES: usize = 256 << 20;

/// Sums `words` with 8 independent accumulators, so the loop is bound by loads, not by add latency.
fn read_sum(words: &[u64]) {
    let mut acc = [0u64; 8];
    for c in words.chunks_exact(8) {
        for k in 0..8 {
            acc[k] = acc[k].wrapping_add(c[k]);
        }
    }
    std::hint::black_box(acc);
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
                    read_sum(src);
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
    let read_gb_s = median(&(0..7).map(|_| pass(threads, &mut bufs, false)).collect::<Vec<_>>());
    let copy_gb_s = median(&(0..7).map(|_| pass(threads, &mut bufs, true)).collect::<Vec<_>>());
    Bandwidth { threads, read_gb_s, copy_gb_s }
}

/// Read GB/s over a working set of `bytes` in all, split evenly over `threads` threads, each reading its
/// part again and again (at least 256 MiB a pass): the bandwidth a decode whose token reads `bytes` can
/// reach on this host. The median of 7 timed passes, after one untimed.
pub fn footprint(threads: usize, bytes: usize) -> f64 {
    let threads = threads.max(1);
    let words = (bytes / 8 / threads).max(8);
    let laps = BYTES.div_ceil(8 * words);
    let parts: Vec<Vec<u64>> = (0..threads).map(|i| vec![i as u64 + 1; words]).collect();
    let timed = || {
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for part in &parts {
                s.spawn(move || {
                    for _ in 0..laps {
                        read_sum(part);
                    }
                });
            }
        });
        (threads * laps * 8 * words) as f64 / t0.elapsed().as_secs_f64() / 1e9
    };
    timed();
    median(&(0..7).map(|_| timed()).collect::<Vec<_>>())
}

#[cfg(test)]
mod tests {
    #[test]
    fn footprint_reads_something() {
        // not a timing test: a small working set gives a positive, finite figure
        let gb_s = super::footprint(2, 1 << 20);
        assert!(gb_s.is_finite() && gb_s > 0.0, "{gb_s}");
    }
}
