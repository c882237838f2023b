//! Debug aid for parity work: top-5 logits at every position of a token sequence, computed batched
//! (one prefill with all logits) and sequentially (one token per step). top_logits MODEL ID...
use reckon_engine::gguf::GgufFile;
use reckon_engine::model::Model;
use reckon_engine::session::Session;

fn top5(l: &[f32]) -> Vec<(usize, f32)> {
    let mut v: Vec<(usize, f32)> = l.iter().copied().enumerate().collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v.truncate(5);
    v
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let model = Model::load(GgufFile::open(&args[1]).unwrap()).unwrap();
    eprintln!("numerics: {}", model.numerics().name());
    let toks: Vec<u32> = args[2..].iter().map(|s| s.parse().unwrap()).collect();
    let vocab = model.config.vocab_size;
    let mut s = Session::new(&model, 4096);
    let batched = s.forward_all(&toks).unwrap().to_vec();
    let mut s = Session::new(&model, 4096);
    for (i, &t) in toks.iter().enumerate() {
        let seq = s.forward_all(&[t]).unwrap().to_vec();
        println!("pos {i}: batched {:?}", top5(&batched[i * vocab..(i + 1) * vocab]));
        println!("pos {i}: single  {:?}", top5(&seq));
    }
}
