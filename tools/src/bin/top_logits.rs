//! Debug aid for parity work: top-5 logits at every position of a token sequence, computed batched
//! (one prefill with all logits) and sequentially (one token per step). top_logits MODEL ID...

fn top5(l: &[f32]) -> Vec<(usize, f32)> {
    let mut v: Vec<(usize, f32)> = l.iter().copied().enumerate().collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v.truncate(5);
    v
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let model = reckon_tools::load_model(&args[1]);
    eprintln!("numerics: {}", model.numerics().name());
    let toks: Vec<u32> = args[2..].iter().map(|s| s.parse().unwrap()).collect();
    let vocab = model.config.vocab_size;
    let batched = model.logits_of(&toks, toks.len());
    let single = model.logits_of(&toks, 1);
    for i in 0..toks.len() {
        let seq = &single[i * vocab..(i + 1) * vocab];
        println!("pos {i}: batched {:?}", top5(&batched[i * vocab..(i + 1) * vocab]));
        println!("pos {i}: single  {:?}", top5(seq));
    }
}
