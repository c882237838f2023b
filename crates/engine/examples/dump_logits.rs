//! Debug aid for parity work: all logits of a token sequence (one prefill, every position) written as raw
//! little-endian f32 [n_tokens, vocab]. dump_logits MODEL OUT.bin ID...
//! CHUNK=n in the environment feeds n tokens a step (default 256; 1 is a decode step per token).
use reckon_engine::gguf::GgufFile;
use reckon_engine::model::Model;
use reckon_engine::session::Session;
use std::io::Write;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let model = Model::load(GgufFile::open(&args[1]).unwrap()).unwrap();
    let toks: Vec<u32> = args[3..].iter().map(|s| s.parse().unwrap()).collect();
    let mut s = Session::new(&model, 4096);
    let mut out = std::io::BufWriter::new(std::fs::File::create(&args[2]).unwrap());
    let chunk_len = std::env::var("CHUNK").map(|c| c.parse().expect("CHUNK: a number")).unwrap_or(256);
    for chunk in toks.chunks(chunk_len) {
        for x in s.forward_all(chunk).unwrap() {
            out.write_all(&x.to_le_bytes()).unwrap();
        }
    }
}
