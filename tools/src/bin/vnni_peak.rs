//! The compute ceiling of the packed kernels: how many 512-bit `vpdpbusd` (16 lanes × 4 int8 products,
//! the instruction every packed AVX-512 kernel spends its time in) T threads retire per second, with 16
//! independent accumulator chains each (more than latency × throughput on any core we know), and the
//! implied int8 multiply-adds per second. A batched decode step or a prefill of N tokens does about
//! N × (weights) multiply-adds: when that divided by this rate approaches the step's time, the step is
//! bound by arithmetic, not by the weight stream (docs/speed.md, "Serving at size").
//!   cargo run --release -p reckon-tools --bin vnni_peak -- [THREADS] [SECONDS_PER_PASS] [PASSES]
//! Prints one JSON line per pass and one with the median.
use std::time::Instant;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn chains(iters: u64) -> i32 {
    use std::arch::x86_64::*;
    // Distinct starting values: identical chains could be merged into one by the compiler.
    let mut acc: [__m512i; 16] = std::array::from_fn(|i| _mm512_set1_epi32(i as i32));
    let (mut w, mut x) = (_mm512_set1_epi8(3), _mm512_set1_epi8(5));
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = _mm512_dpbusd_epi32(*a, w, x);
        }
        // Keep the operands opaque so the loop is not folded.
        std::arch::asm!("/* {0} {1} */", inout(zmm_reg) w, inout(zmm_reg) x, options(nomem, nostack, pure));
    }
    acc.iter().map(|a| _mm512_reduce_add_epi32(*a)).fold(0i32, |s, v| s.wrapping_add(v))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let threads: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(2);
    let seconds: f64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1.0);
    let passes: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(5);
    #[cfg(target_arch = "x86_64")]
    if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni")) {
        eprintln!("vnni_peak: this CPU has no AVX-512 VNNI");
        std::process::exit(1);
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        eprintln!("vnni_peak: x86-64 only");
        std::process::exit(1);
    }
    // Calibrate one thread's iterations to about `seconds`.
    let probe = 1_000_000u64;
    let t = Instant::now();
    #[cfg(target_arch = "x86_64")]
    std::hint::black_box(unsafe { chains(probe) });
    let iters = ((probe as f64) * seconds / t.elapsed().as_secs_f64()).max(1.0) as u64;
    let mut rates = Vec::new();
    for pass in 0..passes {
        let t = Instant::now();
        std::thread::scope(|s| {
            for _ in 0..threads {
                #[cfg(target_arch = "x86_64")]
                s.spawn(move || std::hint::black_box(unsafe { chains(iters) }));
            }
        });
        let per_s = (threads as u64 * iters * 16) as f64 / t.elapsed().as_secs_f64();
        println!("{{\"pass\": {pass}, \"threads\": {threads}, \"vpdpbusd_g_s\": {:.3}, \"int8_gmac_s\": {:.1}}}", per_s / 1e9, per_s * 64.0 / 1e9);
        rates.push(per_s);
    }
    let Some(s) = reckon_lab::stats::summarize(&rates) else { return };
    println!("{{\"median\": true, \"threads\": {threads}, \"vpdpbusd_g_s\": {:.3}, \"int8_gmac_s\": {:.1}, \"min_g_s\": {:.3}, \"max_g_s\": {:.3}}}", s.median / 1e9, s.median * 64.0 / 1e9, s.min / 1e9, s.max / 1e9);
}
