//! Memory bandwidth probe for the decode roofline: each of T threads repeatedly reads (sums) and copies
//! its own 256 MiB buffer; prints the median GB/s over 7 passes of each. Decode reads every weight byte
//! once per token, so `read GB/s / bytes per token` is the ceiling on tokens/s.
//!   cargo run --release -p reckon-tools --bin bandwidth -- [THREADS]
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

fn main() {
    let threads: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(2);
    let words = BYTES / 8;
    let mut bufs: Vec<(Vec<u64>, Vec<u64>)> = (0..threads).map(|i| (vec![i as u64 + 1; words], vec![0; words])).collect();
    pass(threads, &mut bufs, false); // fault the pages in
    pass(threads, &mut bufs, true);
    let read = median((0..7).map(|_| pass(threads, &mut bufs, false)).collect());
    let copy = median((0..7).map(|_| pass(threads, &mut bufs, true)).collect());
    println!("{{\"threads\": {threads}, \"read_gb_s\": {read:.2}, \"copy_gb_s\": {copy:.2}}}");
}
