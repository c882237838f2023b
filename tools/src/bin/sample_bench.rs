//! The sampler alone: microseconds per token for a vocabulary of V random logits, as the server samples
//! them (OpenAI defaults: no top-k or min-p). sample_bench [V] [TEMPERATURE] [TOP_P] [REPS]
use reckon_engine::sampler::{Rng, Sampler, SamplingParams};
use std::time::Instant;

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, d: f64| a.get(i).map(|s| s.parse().expect("a number")).unwrap_or(d);
    let (v, temperature, top_p, reps) = (num(0, 49152.0) as usize, num(1, 1.0) as f32, num(2, 1.0) as f32, num(3, 200.0) as usize);
    let mut rng = Rng::new(1);
    // Logits spread like a model's: a few large, a long tail.
    let logits: Vec<f32> = (0..v).map(|_| (rng.next_f64().powi(8) * 30.0 - 5.0) as f32).collect();
    let mut s = Sampler::new(SamplingParams { temperature, top_k: 0, top_p, min_p: 0.0, repetition_penalty: 1.0, presence_penalty: 0.0, frequency_penalty: 0.0, penalty_last_n: 0, seed: 7 });
    let times: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(s.sample(&logits, &[]));
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    println!("V={v} temperature {temperature} top_p {top_p}: {:.0} us per token (median of {reps})", reckon_lab::stats::median(&times));
}
