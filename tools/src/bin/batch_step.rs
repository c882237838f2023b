//! One model step over B sequences each decoding one token at a context of DEPTH, for B = 1, 2, 4, 8, 16:
//! the engine's continuous-batching decode step without the scheduler. Prints the median step time, the
//! step time per token, and tokens/s. batch_step MODEL_PATH [DEPTH] [REPS] [THREADS]
//! Environment: BATCHES=1,8 times only those batch sizes; SAME_POS=1 decodes every step at position DEPTH
//! (a long run stays at one depth, for a profiler); HUGE_AB=1 also steps a second copy of the model
//! whose packed weights and KV pool are on small pages, in alternation with the default huge-page one,
//! and prints both (HUGE_AB=kv: only the KV pool on small pages, the weights shared);
//! RECKON_NUMERICS=ggml|packed picks the numerics.
use reckon_engine::model::{LogitsWanted, Model, Scratch, SeqInput};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = &args[0];
    let num = |i: usize, d: usize| args.get(i).map(|s| s.parse().expect("a number")).unwrap_or(d);
    let (depth, reps, threads) = (num(1, 128), num(2, 20), num(3, 2));
    reckon_engine::pool::init_global(threads);
    let model = reckon_tools::load_model(path);
    let bs = 16;
    let max_b = 16; // sequences prefilled (the largest batch)
    let blocks_per_seq = (depth + reps + 2).div_ceil(bs);
    let mut kv = model.new_kv(bs, max_b * blocks_per_seq);
    // HUGE_AB=1: a second KV pool on small pages, stepped in alternation with the first (huge pages).
    let huge_ab = std::env::var("HUGE_AB").ok();
    let (model_small, mut kv_small) = match huge_ab.as_deref() {
        None => (None, None),
        Some(what) => {
            reckon_engine::huge_buf::set_huge_pages(false);
            let small: Option<Model> = (what != "kv").then(|| reckon_tools::load_model(path));
            let kv = small.as_ref().unwrap_or(&model).new_kv(bs, max_b * blocks_per_seq);
            (small, Some(kv))
        }
    };
    let model_small = model_small.as_ref().unwrap_or(&model);
    let huge_ab = huge_ab.is_some();
    let mut scratch = Scratch::default();
    let tables: Vec<Vec<u32>> = (0..max_b).map(|s| ((s * blocks_per_seq) as u32..((s + 1) * blocks_per_seq) as u32).collect()).collect();
    // Prefill every sequence to DEPTH with distinct tokens.
    let prompts: Vec<Vec<u32>> = (0..max_b).map(|s| (0..depth).map(|i| ((s * 7919 + i * 104729) % 5000 + 100) as u32).collect()).collect();
    for s in 0..max_b {
        let input = SeqInput { tokens: &prompts[s], start_pos: 0, block_tables: std::slice::from_ref(&tables[s]), logits: LogitsWanted::Last, state: None };
        model.forward(&[input], &mut kv, &mut scratch);
        if let Some(kv_small) = kv_small.as_mut() {
            model_small.forward(&[input], kv_small, &mut scratch);
        }
    }
    println!("| batch | step ms (median) | ms per token | tokens/s |");
    println!("|---|---|---|---|");
    // BATCHES=4,8 in the environment times only those batch sizes (for a profiler).
    let batches: Vec<usize> = std::env::var("BATCHES").map(|v| v.split(',').map(|b| b.parse().expect("batch sizes")).collect()).unwrap_or(vec![1, 2, 4, 8, 16]);
    // SAME_POS=1: every step decodes at position DEPTH (rewriting that cell), so a long run for a profiler
    // stays at one depth.
    let same_pos = std::env::var("SAME_POS").is_ok();
    for b in batches {
        let tok = [42u32];
        let (mut times, mut times_small) = (Vec::new(), Vec::new());
        for r in 0..reps {
            let inputs: Vec<SeqInput> = (0..b).map(|s| SeqInput { tokens: &tok, start_pos: if same_pos { depth } else { depth + r }, block_tables: std::slice::from_ref(&tables[s]), logits: LogitsWanted::Last, state: None }).collect();
            let t = Instant::now();
            model.forward(&inputs, &mut kv, &mut scratch);
            times.push(t.elapsed().as_secs_f64() * 1e3);
            if let Some(kv_small) = kv_small.as_mut() {
                let t = Instant::now();
                model_small.forward(&inputs, kv_small, &mut scratch);
                times_small.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        let ms = reckon_lab::stats::median(&times);
        println!("| {b} | {ms:.2} | {:.2} | {:.0} |", ms / b as f64, 1e3 * b as f64 / ms);
        if huge_ab {
            let ms = reckon_lab::stats::median(&times_small);
            println!("| {b} small pages | {ms:.2} | {:.2} | {:.0} |", ms / b as f64, 1e3 * b as f64 / ms);
        }
    }
}
