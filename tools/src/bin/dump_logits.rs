//! Debug aid for parity work: all logits of a token sequence (one prefill, every position) written as raw
//! little-endian f32 [n_tokens, vocab]. dump_logits MODEL OUT.bin ID...
//! CHUNK=n in the environment feeds n tokens a step (default 256; 1 is a decode step per token);
//! RECKON_NUMERICS=ggml|packed picks the numerics.
use std::io::Write;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let model = reckon_tools::load_model(&args[1]);
    let toks: Vec<u32> = args[3..].iter().map(|s| s.parse().unwrap()).collect();
    let mut out = std::io::BufWriter::new(std::fs::File::create(&args[2]).unwrap());
    let chunk_len = std::env::var("CHUNK").map(|c| c.parse().expect("CHUNK: a number")).unwrap_or(256);
    for x in model.logits_of(&toks, chunk_len) {
        out.write_all(&x.to_le_bytes()).unwrap();
    }
}
