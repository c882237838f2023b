//! Tiny random models written as GGUF by the tests themselves.
#![allow(dead_code)]

use reckon_engine::gguf::writer::GgufWriter;
use reckon_engine::gguf::Value;
use reckon_engine::kernels::ggml::{quantize_row, GgmlType};

/// splitmix64, so test data is the same on every run.
pub struct TestRng(pub u64);

impl TestRng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

pub struct TinySpec {
    pub arch: &'static str,
    pub vocab: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub layers: usize,
    pub matrix_type: GgmlType,
    pub embed_type: GgmlType,
    pub sliding_window: usize,
}

impl TinySpec {
    pub fn llama(matrix_type: GgmlType) -> Self {
        TinySpec { arch: "llama", vocab: 96, d_model: 64, n_heads: 4, n_kv_heads: 2, head_dim: 16, ffn: 96, layers: 2, matrix_type, embed_type: GgmlType::Q8_0, sliding_window: 0 }
    }
    pub fn gemma3() -> Self {
        TinySpec { arch: "gemma3", vocab: 96, d_model: 64, n_heads: 2, n_kv_heads: 1, head_dim: 32, ffn: 128, layers: 6, matrix_type: GgmlType::Q5_0, embed_type: GgmlType::Q8_0, sliding_window: 8 }
    }
    pub fn qwen2() -> Self {
        TinySpec { arch: "qwen2", ..Self::llama(GgmlType::Q8_0) }
    }
}

/// Random weights of `t`, `rows` x `cols`: floats quantized where ggml can (F32/F16/Q8_0), otherwise
/// random quant bytes with small, finite f16 scales at the start of each block.
fn random_matrix(rng: &mut TestRng, t: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let row_bytes = t.row_bytes(cols).unwrap();
    let mut out = vec![0u8; rows * row_bytes];
    let scale = 1.0 / (cols as f32).sqrt();
    match t {
        GgmlType::F32 | GgmlType::F16 | GgmlType::Q8_0 => {
            for row in out.chunks_exact_mut(row_bytes) {
                let x: Vec<f32> = (0..cols).map(|_| rng.f32() * scale * 2.0).collect();
                quantize_row(t, &x, row);
            }
        }
        _ => {
            out.iter_mut().for_each(|b| *b = rng.next() as u8);
            // The leading f16 fields of every block (d, and m/dmin where present) hold small scales;
            // Q6_K keeps its d at the end of the block.
            let d_offset = if t == GgmlType::Q6_K { t.block_bytes() - 2 } else { 0 };
            let n_scales = if matches!(t, GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K) { 2 } else { 1 };
            for block in out.chunks_exact_mut(t.block_bytes()) {
                for s in 0..n_scales {
                    let v = half::f16::from_f32(scale * 0.1 * (0.5 + rng.f32().abs()));
                    block[d_offset + 2 * s..d_offset + 2 * s + 2].copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
    out
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn norm_weights(rng: &mut TestRng, n: usize) -> Vec<u8> {
    f32_bytes(&(0..n).map(|_| 1.0 + 0.1 * rng.f32()).collect::<Vec<_>>())
}

pub fn tiny_model(spec: &TinySpec, seed: u64) -> Vec<u8> {
    // before any kernel runs: the tests on tiny models rerun under RECKON_SIMD=avx2 (scripts/test)
    simd_cap_from_env();
    let mut rng = TestRng(seed);
    let mut w = GgufWriter::new();
    let a = spec.arch;
    w.meta("general.architecture", Value::String(a.into()));
    w.meta(&format!("{a}.block_count"), Value::U32(spec.layers as u32));
    w.meta(&format!("{a}.context_length"), Value::U32(256));
    w.meta(&format!("{a}.embedding_length"), Value::U32(spec.d_model as u32));
    w.meta(&format!("{a}.feed_forward_length"), Value::U32(spec.ffn as u32));
    w.meta(&format!("{a}.attention.head_count"), Value::U32(spec.n_heads as u32));
    w.meta(&format!("{a}.attention.head_count_kv"), Value::U32(spec.n_kv_heads as u32));
    w.meta(&format!("{a}.attention.key_length"), Value::U32(spec.head_dim as u32));
    w.meta(&format!("{a}.attention.layer_norm_rms_epsilon"), Value::F32(1e-6));
    w.meta(&format!("{a}.rope.freq_base"), Value::F32(10_000.0));
    w.meta(&format!("{a}.vocab_size"), Value::U32(spec.vocab as u32));
    if spec.sliding_window > 0 {
        w.meta(&format!("{a}.attention.sliding_window"), Value::U32(spec.sliding_window as u32));
    }
    let (d, q, kv, ff) = (spec.d_model, spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim, spec.ffn);
    let mt = spec.matrix_type;
    let embed = random_matrix(&mut rng, spec.embed_type, spec.vocab, d);
    w.tensor("token_embd.weight", spec.embed_type, &[d as u64, spec.vocab as u64], embed);
    w.tensor("output_norm.weight", GgmlType::F32, &[d as u64], norm_weights(&mut rng, d));
    for i in 0..spec.layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        let mut mat = |w: &mut GgufWriter, name: &str, rows: usize, cols: usize| {
            let bytes = random_matrix(&mut rng, mt, rows, cols);
            w.tensor(&n(name), mt, &[cols as u64, rows as u64], bytes);
        };
        mat(&mut w, "attn_q.weight", q, d);
        mat(&mut w, "attn_k.weight", kv, d);
        mat(&mut w, "attn_v.weight", kv, d);
        mat(&mut w, "attn_output.weight", d, q);
        mat(&mut w, "ffn_gate.weight", ff, d);
        mat(&mut w, "ffn_up.weight", ff, d);
        mat(&mut w, "ffn_down.weight", d, ff);
        let mut vec = |w: &mut GgufWriter, name: &str, len: usize| {
            let bytes = norm_weights(&mut rng, len);
            w.tensor(&n(name), GgmlType::F32, &[len as u64], bytes);
        };
        vec(&mut w, "attn_norm.weight", d);
        vec(&mut w, "ffn_norm.weight", d);
        if a == "qwen2" {
            vec(&mut w, "attn_q.bias", q);
            vec(&mut w, "attn_k.bias", kv);
            vec(&mut w, "attn_v.bias", kv);
        }
        if a == "gemma3" {
            vec(&mut w, "attn_q_norm.weight", spec.head_dim);
            vec(&mut w, "attn_k_norm.weight", spec.head_dim);
            vec(&mut w, "post_attention_norm.weight", d);
            vec(&mut w, "post_ffw_norm.weight", d);
        }
    }
    w.to_bytes()
}

/// A fetched real model, or `None` with a note when it is missing; with RECKON_REQUIRE_MODELS set (CI)
/// a missing model fails the test instead.
pub fn open_real_model(name: &str) -> Option<reckon_engine::gguf::GgufFile> {
    simd_cap_from_env();
    let path = real_model_path(name);
    if !path.exists() {
        assert!(std::env::var("RECKON_REQUIRE_MODELS").is_err(), "{} is missing and RECKON_REQUIRE_MODELS is set", path.display());
        eprintln!("note: {} not found; skipping (scripts/fetch-models {name})", path.display());
        return None;
    }
    Some(reckon_engine::gguf::GgufFile::open(&path).expect("open model"))
}

/// `RECKON_SIMD=avx2|scalar` caps the kernels for this test process (scripts/test reruns the parity,
/// tiny-model, speculation and server tests under `RECKON_SIMD=avx2`, so an AVX-512 machine checks the
/// AVX2 paths on the real models too). Called by `tiny_model` and `open_real_model`, before any kernel.
pub fn simd_cap_from_env() {
    use reckon_engine::kernels::cpu::{set_simd_cap, SimdLevel};
    if let Some(level) = std::env::var("RECKON_SIMD").ok().and_then(|v| SimdLevel::from_name(&v)) {
        assert!(set_simd_cap(level), "RECKON_SIMD={}: the kernels already chose their level", level.name());
    }
}

/// Where scripts/fetch-models puts a known model (`$RECKON_HOME`, default ~/.cache/reckon/models).
pub fn real_model_path(name: &str) -> std::path::PathBuf {
    let dir = match std::env::var_os("RECKON_HOME").filter(|h| !h.is_empty()) {
        Some(home) => std::path::PathBuf::from(home),
        None => std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/reckon/models"),
    };
    reckon_engine::registry::known_model_path(&dir, name).expect("known model")
}

/// A synthetic model of scripts/make-test-models (`$RECKON_TEST_MODELS`, default
/// ~/.cache/reckon/test-models), or `None` with a note when it is missing; with RECKON_REQUIRE_MODELS
/// set (CI, which runs the script) a missing one fails the test instead.
pub fn open_test_model(name: &str) -> Option<reckon_engine::gguf::GgufFile> {
    simd_cap_from_env();
    let dir = match std::env::var_os("RECKON_TEST_MODELS").filter(|h| !h.is_empty()) {
        Some(dir) => std::path::PathBuf::from(dir),
        None => std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/reckon/test-models"),
    };
    let path = dir.join(format!("{name}.gguf"));
    if !path.exists() {
        assert!(std::env::var("RECKON_REQUIRE_MODELS").is_err(), "{} is missing and RECKON_REQUIRE_MODELS is set", path.display());
        eprintln!("note: {} not found; skipping (scripts/make-test-models)", path.display());
        return None;
    }
    Some(reckon_engine::gguf::GgufFile::open(&path).expect("open model"))
}

/// A model's parity fixture (tests/fixtures/parity/NAME.json, recorded from llama.cpp).
pub fn parity_fixture(name: &str) -> serde_json::Value {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../../tests/fixtures/parity/{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("fixture is JSON")
}

/// The token texts of `tiny_chat_model`'s vocabulary: the 256 byte tokens (GPT-2's byte alphabet, id =
/// byte value), then the merged tokens of `TINY_MERGES`, then the specials of `TINY_SPECIALS`.
pub fn tiny_chat_vocab() -> Vec<String> {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| gpt2_byte_char(b).to_string()).collect();
    tokens.extend(TINY_MERGES.iter().map(|m| m.replace(' ', "")));
    tokens.extend(TINY_SPECIALS.iter().map(|s| s.to_string()));
    tokens
}

/// `tiny_chat_model`'s merges, in rank order (each result is a token).
pub const TINY_MERGES: [&str; 4] = ["Ġ t", "h e", "i n", "Ġt he"];
/// `tiny_chat_model`'s control tokens; the first is BOS and EOS, and all three end a generation.
pub const TINY_SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// `tiny_chat_model`'s chat template (ChatML, as SmolLM2's).
pub const TINY_CHAT_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// GPT-2's byte alphabet: printable bytes stand for themselves, the others for U+0100 upwards in order.
pub fn gpt2_byte_char(b: u8) -> char {
    let printable = |b: u8| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    if printable(b) {
        return b as char;
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).unwrap()
}

/// `tiny_model(spec, seed)` with a real tokenizer: a byte-level BPE ("gpt2") vocabulary of the 256 byte
/// tokens, a few merges and the specials `<|endoftext|>` (BOS and EOS), `<|im_start|>` and `<|im_end|>`,
/// plus a ChatML `tokenizer.chat_template`, so `Tokenizer::from_gguf` and `ChatTemplate::from_gguf` load
/// it as they load a real model. The model's vocabulary is the tokenizer's (`spec.vocab` is ignored);
/// `context_length` replaces `tiny_model`'s 256.
pub fn tiny_chat_model(spec: &TinySpec, seed: u64, context_length: u32) -> Vec<u8> {
    let tokens = tiny_chat_vocab();
    let spec = TinySpec { vocab: tokens.len(), ..*spec };
    let base = reckon_engine::gguf::GgufFile::from_vec(tiny_model(&spec, seed)).expect("tiny_model writes GGUF");
    let mut w = GgufWriter::new();
    let context_key = format!("{}.context_length", spec.arch);
    for (key, value) in &base.header().metadata {
        let value = if *key == context_key { Value::U32(context_length) } else { value.clone() };
        w.meta(key, value);
    }
    let n_normal = 256 + TINY_MERGES.len();
    let eos = n_normal as u32;
    w.meta("tokenizer.ggml.model", Value::String("gpt2".into()));
    w.meta("tokenizer.ggml.pre", Value::String("gpt-2".into()));
    w.meta("tokenizer.ggml.tokens", Value::Array(tokens.iter().map(|t| Value::String(t.clone())).collect()));
    let types = (0..tokens.len()).map(|i| Value::I32(if i < n_normal { 1 } else { 3 }));
    w.meta("tokenizer.ggml.token_type", Value::Array(types.collect()));
    w.meta("tokenizer.ggml.merges", Value::Array(TINY_MERGES.iter().map(|m| Value::String(m.to_string())).collect()));
    w.meta("tokenizer.ggml.bos_token_id", Value::U32(eos));
    w.meta("tokenizer.ggml.eos_token_id", Value::U32(eos));
    w.meta("tokenizer.ggml.add_bos_token", Value::Bool(false));
    w.meta("tokenizer.chat_template", Value::String(TINY_CHAT_TEMPLATE.into()));
    for t in &base.header().tensors {
        let bytes = base.raw()[t.file_offset as usize..(t.file_offset + t.num_bytes) as usize].to_vec();
        w.tensor(&t.name, t.dtype, &t.dims, bytes);
    }
    w.to_bytes()
}

/// Whether this CPU has the kernels of `level`, for a test that otherwise skips (part of) its work with a
/// note. Where RECKON_REQUIRE_SIMD names `level` or a higher one (`avx2`, `avx512`: a CI machine that must
/// test those kernels), a missing level fails the test instead of skipping it.
pub fn simd_or_skip(level: reckon_engine::kernels::cpu::SimdLevel, what: &str) -> bool {
    use reckon_engine::kernels::cpu::SimdLevel;
    simd_cap_from_env();
    if level.is_available() {
        return true;
    }
    if let Some(required) = std::env::var("RECKON_REQUIRE_SIMD").ok().filter(|v| !v.is_empty()) {
        let required = SimdLevel::from_name(&required).unwrap_or_else(|| panic!("RECKON_REQUIRE_SIMD={required:?}: not scalar, avx2, avxvnni or avx512"));
        assert!(
            level > required,
            "{what} needs {} but this CPU has only {}, and RECKON_REQUIRE_SIMD={} requires it",
            level.name(),
            SimdLevel::detected().name(),
            required.name()
        );
    }
    eprintln!("note: no {} on this CPU; {what} skipped", level.name());
    false
}
