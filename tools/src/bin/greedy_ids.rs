//! Greedy continuation from token ids (debug aid): greedy_ids MODEL N ID...
use reckon_engine::model::{LogitsWanted, Scratch, SeqInput};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let model = reckon_tools::load_model(&args[1]);
    let n: usize = args[2].parse().unwrap();
    let mut toks: Vec<u32> = args[3..].iter().map(|s| s.parse().unwrap()).collect();
    let mut kv = model.new_kv(16, 64);
    let table: Vec<u32> = (0..64).collect();
    let mut scratch = Scratch::default();
    let mut start = 0;
    let t0 = std::time::Instant::now();
    for _ in 0..n {
        let inp = SeqInput { tokens: &toks[start..], start_pos: start, block_tables: std::slice::from_ref(&table), logits: LogitsWanted::Last, state: None };
        let logits = model.forward(&[inp], &mut kv, &mut scratch);
        let next = logits.iter().enumerate().fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 as u32;
        start = toks.len();
        toks.push(next);
    }
    eprintln!("{:?}", t0.elapsed());
    println!("{:?}", toks);
}
