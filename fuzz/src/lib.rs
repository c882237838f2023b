//! reckon's fuzz targets, one function per target; `src/bin/<target>.rs` hands each to libFuzzer, and the
//! tests at the bottom replay `corpus/<target>/` and `regressions/<target>/` through the same functions.
//!
//! A target panics only on a bug: an error result is the right answer to a bad input, never a failure.
//! The few properties checked besides "no panic" hold for every input (see each target).

use reckon_engine::engine::{StopMatcher, StopOutcome};
use reckon_engine::gguf::GgufFile;
use reckon_engine::template::{ChatMessage, ChatTemplate};
use reckon_engine::tokenizer::{IncrementalDecoder, Tokenizer, Utf8Stream};
use serde_json::Value;
use std::sync::OnceLock;

/// The tiny-model writer the engine's and server's tests use (a real byte-level BPE vocabulary and a
/// ChatML template), included from its one copy.
#[allow(dead_code, clippy::all)]
#[path = "../../crates/engine/tests/common/mod.rs"]
pub mod common;

/// `FUZZ_DEBUG=1`: targets say what they did with each input (to check a harness, not while fuzzing).
fn debug() -> bool {
    static D: OnceLock<bool> = OnceLock::new();
    *D.get_or_init(|| std::env::var_os("FUZZ_DEBUG").is_some())
}

fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

// ---------------------------------------------------------------------------------------------------
// gguf: GgufFile::from_vec, every accessor, then the tokenizer, the chat template and Model::load.

/// The input is a GGUF image. Whatever parses must be consistent: every tensor's bytes lie inside the
/// file (the reader promises it), and what is built on top of it fails with an error, not a panic.
pub fn gguf(data: &[u8]) {
    reckon_engine::pool::init_global(1);
    let Ok(file) = GgufFile::from_vec(data.to_vec()) else { return };
    let header = file.header();
    let counts = (header.metadata.len(), header.tensors.len());
    for (key, _) in &header.metadata {
        let _ = file.get_str(key);
        let _ = file.get_u64(key);
        let _ = file.get_f32(key);
        let _ = file.get_bool_or(key, false);
        let _ = file.get_str_array(key);
        let _ = file.get_f32_array(key);
        let _ = file.get_i64_array(key);
    }
    for t in &header.tensors {
        let view = file.tensor(&t.name).expect("a listed tensor");
        assert_eq!(view.bytes.len() as u64, file.tensor_info(&t.name).unwrap().num_bytes);
        let _ = (view.row_len(), view.num_rows(), t.num_elements());
    }
    let mut bos = String::new();
    let mut eos = String::new();
    if let Ok(tok) = Tokenizer::from_gguf(&file) {
        let text = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("").to_string();
        (bos, eos) = (text(tok.bos_id()), text(tok.eos_id()));
        for s in ["Hello, world! 123 <|im_start|>user\n héllo 日本 🍕\t\r\n", ""] {
            if let Ok(ids) = tok.encode(s, true, true) {
                let _ = tok.decode(&ids, true);
            }
        }
        let n = tok.vocab_size().min(1024) as u32;
        let ids: Vec<u32> = (0..n + 2).collect();
        let _ = tok.decode(&ids, true);
        let _ = tok.decode(&ids, false);
        let _ = tok.eog_ids();
    }
    if let Ok(t) = ChatTemplate::from_gguf(&file, &bos, &eos) {
        let _ = t.render(&[ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi")], true);
    }
    let loaded = reckon_engine::model::Model::load(file);
    if debug() {
        eprintln!("gguf: (keys, tensors) {counts:?}, (BOS, EOS) text lengths {:?}, model {:?}", (bos.len(), eos.len()), loaded.as_ref().map(|m| m.config.n_layers).map_err(|e| e.to_string()));
    }
}

// ---------------------------------------------------------------------------------------------------
// tokenizer: encode/decode of arbitrary bytes with real vocabularies.

const TINY_PRES: [&str; 6] = ["gpt-2", "llama3", "dbrx", "starcoder", "qwen2", "default"];
const REAL: [&str; 3] = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"];

/// The tiny chat model's byte-level BPE vocabulary (tests/common) under pre-tokenizer `pre`.
fn tiny_bpe(pre: &str) -> Tokenizer {
    use common::{tiny_chat_vocab, TINY_MERGES};
    use reckon_engine::gguf::{writer::GgufWriter, Value as G};
    let tokens = tiny_chat_vocab();
    let n_normal = 256 + TINY_MERGES.len();
    let mut w = GgufWriter::new();
    w.meta("tokenizer.ggml.model", G::String("gpt2".into()));
    w.meta("tokenizer.ggml.pre", G::String(pre.into()));
    w.meta("tokenizer.ggml.tokens", G::Array(tokens.iter().map(|t| G::String(t.clone())).collect()));
    w.meta("tokenizer.ggml.token_type", G::Array((0..tokens.len()).map(|i| G::I32(if i < n_normal { 1 } else { 3 })).collect()));
    w.meta("tokenizer.ggml.merges", G::Array(TINY_MERGES.iter().map(|m| G::String(m.to_string())).collect()));
    w.meta("tokenizer.ggml.bos_token_id", G::U32(n_normal as u32));
    w.meta("tokenizer.ggml.eos_token_id", G::U32(n_normal as u32));
    Tokenizer::from_gguf(&GgufFile::from_vec(w.to_bytes()).unwrap()).expect("tiny BPE tokenizer")
}

/// A small SentencePiece ("llama") vocabulary: unknown, BOS, EOS, the 256 `<0xXX>` byte tokens, pieces with
/// scores (so merges happen), a user-defined and a control token.
fn tiny_spm() -> Tokenizer {
    use reckon_engine::gguf::{writer::GgufWriter, Value as G};
    let mut toks: Vec<(String, i32, f32)> = vec![("<unk>".into(), 2, 0.0), ("<s>".into(), 3, 0.0), ("</s>".into(), 3, 0.0)];
    toks.extend((0..=255u8).map(|b| (format!("<0x{b:02X}>"), 6, 0.0)));
    let pieces = ["▁", "▁t", "▁th", "▁the", "he", "e", "t", "h", "a", "▁a", "in", "▁in", "é", "日本", "▁日", "1", "12", "▁▁", "\n"];
    toks.extend(pieces.iter().enumerate().map(|(i, p)| (p.to_string(), 1, -(i as f32))));
    toks.push(("<tool>".into(), 4, 0.0));
    toks.push(("<end_of_turn>".into(), 3, 0.0));
    let mut w = GgufWriter::new();
    w.meta("tokenizer.ggml.model", G::String("llama".into()));
    w.meta("tokenizer.ggml.tokens", G::Array(toks.iter().map(|t| G::String(t.0.clone())).collect()));
    w.meta("tokenizer.ggml.token_type", G::Array(toks.iter().map(|t| G::I32(t.1)).collect()));
    w.meta("tokenizer.ggml.scores", G::Array(toks.iter().map(|t| G::F32(t.2)).collect()));
    w.meta("tokenizer.ggml.unknown_token_id", G::U32(0));
    w.meta("tokenizer.ggml.bos_token_id", G::U32(1));
    w.meta("tokenizer.ggml.eos_token_id", G::U32(2));
    Tokenizer::from_gguf(&GgufFile::from_vec(w.to_bytes()).unwrap()).expect("tiny SPM tokenizer")
}

/// A fetched model's tokenizer ($RECKON_HOME or ~/.cache/reckon/models, as scripts/fetch-models puts
/// them), or None when it is not there.
fn real_tokenizer(name: &str) -> Option<Tokenizer> {
    let path = common::real_model_path(name);
    if !path.exists() {
        eprintln!("note: {} not found; its tokenizer slot uses a tiny vocabulary", path.display());
        return None;
    }
    Some(Tokenizer::from_gguf(&GgufFile::open(&path).expect("open model")).expect("model tokenizer"))
}

/// Slots 0-5: the tiny BPE vocabulary under each pre-tokenizer; 6: tiny SentencePiece; 7-9: the real
/// models' tokenizers (SmolLM2, Gemma 3, Qwen2.5), each the tiny slot `7..9 % 7` when not fetched.
fn tokenizers() -> &'static [Option<Tokenizer>; 10] {
    static T: OnceLock<[Option<Tokenizer>; 10]> = OnceLock::new();
    T.get_or_init(|| {
        let mut slots: [Option<Tokenizer>; 10] = Default::default();
        for (i, pre) in TINY_PRES.iter().enumerate() {
            slots[i] = Some(tiny_bpe(pre));
        }
        slots[6] = Some(tiny_spm());
        for (i, name) in REAL.iter().enumerate() {
            slots[7 + i] = real_tokenizer(name);
        }
        slots
    })
}

/// `data[0]` picks the tokenizer (slot `data[0] % 10`), `data[1]`'s bits the flags (add_special,
/// parse_special, render_special), the rest is text (lossy UTF-8) to encode and, read as little-endian
/// u16s, token ids to decode (some past the vocabulary). Checked: every id is in the vocabulary; on the
/// tiny byte-level BPE vocabulary decode(encode(text)) without specials is the text (byte-level BPE is
/// lossless); streaming (IncrementalDecoder, Utf8Stream) gives exactly what decoding it all at once gives.
pub fn tokenizer(data: &[u8]) {
    let [sel, flags, rest @ ..] = data else { return };
    let slots = tokenizers();
    let slot = *sel as usize % slots.len();
    let (slot, tok) = match &slots[slot] {
        Some(t) => (slot, t),
        None => (slot % 7, slots[slot % 7].as_ref().unwrap()),
    };
    let (add_special, parse_special, render_special) = (flags & 1 != 0, flags & 2 != 0, flags & 4 != 0);
    let text = lossy(rest);
    // (an error is an answer: a SentencePiece vocabulary without a byte token for some byte)
    let Ok(ids) = tok.encode(&text, add_special, parse_special) else { return };
    let vocab = tok.vocab_size() as u32;
    assert!(ids.iter().all(|&id| id < vocab), "encode gave an id past the vocabulary: {ids:?}");
    let decoded = tok.decode(&ids, render_special);
    if slot < TINY_PRES.len() && !add_special && !parse_special {
        assert_eq!(decoded, text, "byte-level BPE round trip");
    }
    let mut inc = IncrementalDecoder::new(tok, render_special);
    let mut streamed = String::new();
    for &id in &ids {
        streamed.push_str(&inc.push(id));
    }
    streamed.push_str(&inc.finish());
    assert_eq!(streamed, decoded, "incremental decoding differs from decode");
    // Arbitrary ids, including some past the vocabulary.
    let arbitrary: Vec<u32> = rest.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as u32 % (vocab + 8)).collect();
    let _ = tok.decode(&arbitrary, render_special);
    let mut inc = IncrementalDecoder::new(tok, render_special);
    for &id in &arbitrary {
        let _ = inc.push(id);
        let _ = tok.is_control(id);
        let _ = tok.is_eog(id);
        let _ = tok.token_text(id).map(|t| tok.token_id(t));
    }
    let _ = inc.finish();
    // Raw bytes in arbitrary pieces through the UTF-8 stream.
    let mut s = Utf8Stream::default();
    let mut out = String::new();
    for piece in rest.split(|&b| b == b'|') {
        out.push_str(&s.push(piece));
    }
    out.push_str(&s.finish());
    let joined: Vec<u8> = rest.iter().copied().filter(|&b| b != b'|').collect();
    assert_eq!(out, String::from_utf8_lossy(&joined), "streamed UTF-8 differs from the whole bytes' lossy decoding");
}

// ---------------------------------------------------------------------------------------------------
// template: an arbitrary template string over arbitrary messages.

const ROLES: [&str; 5] = ["system", "user", "assistant", "tool", "developer"];

/// The input is `TEMPLATE \0 MESSAGES`: the template source (lossy UTF-8), then either JSON (an array of
/// messages, or `{"messages": [...], "tools": [...], "add_generation_prompt": bool}`) or raw pieces split
/// on `\x01`, each a message whose first byte picks the role.
pub fn template(data: &[u8]) {
    let (src, rest) = match data.iter().position(|&b| b == 0) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &[][..]),
    };
    let Ok(t) = ChatTemplate::new(lossy(src), "<s>", "</s>") else { return };
    let (messages, tools, add_generation_prompt) = template_inputs(rest);
    let _ = t.render_with_tools(&messages, &tools, add_generation_prompt);
    let _ = t.render(&messages, !add_generation_prompt);
    let _ = (t.emits_reasoning(), t.supports_tools());
}

fn template_inputs(rest: &[u8]) -> (Vec<ChatMessage>, Vec<Value>, bool) {
    match serde_json::from_slice::<Value>(rest) {
        Ok(Value::Array(items)) => (items.into_iter().filter_map(|m| serde_json::from_value(m).ok()).collect(), Vec::new(), true),
        Ok(Value::Object(o)) => {
            let messages = o.get("messages").and_then(Value::as_array).map(|a| a.iter().filter_map(|m| serde_json::from_value(m.clone()).ok()).collect()).unwrap_or_default();
            let tools = o.get("tools").and_then(Value::as_array).cloned().unwrap_or_default();
            (messages, tools, o.get("add_generation_prompt").and_then(Value::as_bool).unwrap_or(true))
        }
        _ => {
            let messages = rest
                .split(|&b| b == 1)
                .filter(|p| !p.is_empty())
                .take(64)
                .map(|p| ChatMessage::new(ROLES[p[0] as usize % ROLES.len()], &lossy(&p[1..])))
                .collect();
            (messages, Vec::new(), rest.len() % 2 == 0)
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// requests: every API's request body through the real router and handlers, no socket.

struct Server {
    rt: tokio::runtime::Runtime,
    router: axum::Router,
}

/// The router over the tiny chat model (tests/common) with an engine that refuses every submission
/// (`max_waiting: 0`): a request is parsed, rendered, tokenized and validated exactly as served, then
/// answered 503 instead of generating, so every run is fast and the same.
fn server() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| {
        use common::{tiny_chat_model, TinySpec};
        use reckon_engine::engine::{spawn, EngineConfig};
        use reckon_engine::kernels::ggml::GgmlType;
        use std::sync::Arc;
        reckon_engine::pool::init_global(1);
        let file = GgufFile::from_vec(tiny_chat_model(&TinySpec::llama(GgmlType::Q8_0), 7, 4096)).unwrap();
        let tokenizer = Arc::new(Tokenizer::from_gguf(&file).unwrap());
        let text = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).unwrap_or("").to_string();
        let template = Arc::new(ChatTemplate::from_gguf(&file, &text(tokenizer.bos_id()), &text(tokenizer.eos_id())).unwrap());
        let model = Arc::new(reckon_engine::model::Model::load(file).unwrap());
        let config = EngineConfig { num_blocks: 512, max_model_len: 4096, max_running: 1, max_waiting: 0, ..Default::default() };
        let engine = spawn(model, tokenizer.clone(), config);
        let state = reckon_server::AppState {
            engine,
            tokenizer,
            template,
            model_id: "tiny".into(),
            aliases: vec!["haiku".into()],
            api_keys: Vec::new(),
            limits: Default::default(),
            log_prompts: false,
            metrics: Default::default(),
            responses: Default::default(),
            grammar: Default::default(),
            max_body_bytes: reckon_server::DEFAULT_MAX_BODY_BYTES,
            sampling: Default::default(),
            model_card: Default::default(),
            kv_events: None,
        };
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        Server { rt, router: reckon_server::router(state) }
    })
}

/// The routes a body can go to; an input's first line names one (`POST /v1/chat/completions`), else
/// its first byte picks one. `GET`/`DELETE /v1/responses/<id>` take the id from the line.
const ROUTES: [(&str, &str); 5] =
    [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"), ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens")];

/// The input is `METHOD PATH\nBODY`. The answer must not be a 500 (with an engine that refuses every
/// request, nothing can fail inside it) and its body, when JSON, must be JSON.
pub fn requests(data: &[u8]) {
    use tower::ServiceExt;
    let Some(&first) = data.first() else { return };
    let (line, body) = match data.iter().position(|&b| b == b'\n') {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (&[][..], data),
    };
    let line = lossy(line);
    let (method, path) = match line.split_once(' ') {
        Some((m @ ("GET" | "DELETE"), p)) if p.starts_with("/v1/responses/") => (m.to_string(), p.to_string()),
        Some(("POST", p)) if ROUTES.iter().any(|r| r.1 == p) => ("POST".to_string(), p.to_string()),
        _ => {
            let (m, p) = ROUTES[first as usize % ROUTES.len()];
            (m.to_string(), p.to_string())
        }
    };
    let Ok(req) = axum::http::Request::builder()
        .method(method.as_str())
        .uri(path.as_str())
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body.to_vec()))
    else {
        return;
    };
    let s = server();
    s.rt.block_on(async {
        let resp = s.router.clone().oneshot(req).await.expect("the router is infallible");
        let status = resp.status();
        let json = resp.headers().get("content-type").is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
        let bytes = if json { axum::body::to_bytes(resp.into_body(), usize::MAX).await.expect("a JSON body") } else { Default::default() };
        if debug() {
            eprintln!("{method} {path} -> {status} {}", String::from_utf8_lossy(&bytes));
        }
        assert_ne!(status.as_u16(), 500, "{method} {path}: 500 {}", String::from_utf8_lossy(&bytes));
        if json {
            serde_json::from_slice::<Value>(&bytes).unwrap_or_else(|e| panic!("{method} {path}: {status} body is not JSON ({e}): {:?}", String::from_utf8_lossy(&bytes)));
        }
    });
}

// ---------------------------------------------------------------------------------------------------
// stop: the streaming stop-string matcher against the naive answer.

/// The input is NUL-separated pieces: the first byte's low 3 bits (0-4) say how many of the first pieces
/// are stop strings, the other pieces are the deltas (each lossy UTF-8). The matcher must emit exactly
/// the text up to the first stop string (nothing after it), stop on the delta that completes it, and
/// hold back less than the longest stop string (the same properties as the engine's proptest).
pub fn stop(data: &[u8]) {
    let Some((&head, rest)) = data.split_first() else { return };
    let n_stops = (head & 7) as usize % 5;
    let pieces: Vec<String> = rest.split(|&b| b == 0).map(lossy).collect();
    let n_stops = n_stops.min(pieces.len());
    let (stops, deltas) = pieces.split_at(n_stops);
    let first_stop = |text: &str| stops.iter().filter(|s| !s.is_empty()).filter_map(|s| text.find(s.as_str())).min();
    // the naive answer: the text up to the first delta after which it holds a stop string, cut there
    let (want, stops_at_all) = {
        let mut text = String::new();
        let mut hit = false;
        for d in deltas {
            text.push_str(d);
            if let Some(at) = first_stop(&text) {
                text.truncate(at);
                hit = true;
                break;
            }
        }
        (text, hit)
    };
    let longest = stops.iter().map(String::len).max().unwrap_or(0);
    let mut m = StopMatcher::new(stops.to_vec());
    let (mut pushed, mut out, mut stopped) = (String::new(), String::new(), false);
    for d in deltas {
        pushed.push_str(d);
        match m.push(d) {
            StopOutcome::Continue(s) => {
                out.push_str(&s);
                assert!(first_stop(&pushed).is_none(), "went on past a stop string: {pushed:?}");
                assert!(pushed.len() - out.len() < longest.max(1), "holds back {:?} of {pushed:?}", &pushed[out.len()..]);
            }
            StopOutcome::Stopped(s) => {
                out.push_str(&s);
                assert!(first_stop(&pushed).is_some(), "stopped on {pushed:?} without a stop string");
                let matched = m.matched().expect("a stopped matcher names its stop string");
                assert!(stops.iter().any(|s| s == matched), "matched {matched:?}, not a stop string");
                stopped = true;
            }
        }
        assert!(want.starts_with(out.as_str()), "emitted {out:?}, past {want:?}");
        if stopped {
            break;
        }
    }
    if !stopped {
        out.push_str(&m.finish());
    }
    assert_eq!(stopped, stops_at_all, "stopped");
    assert_eq!(out, want, "emitted text");
}

// ---------------------------------------------------------------------------------------------------

/// The inputs of `corpus/<target>/` and `regressions/<target>/` (a crash found by `fuzz/run`, copied
/// there once fixed), for replay.
pub fn saved_inputs(target: &str) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    for dir in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else { continue };
        let mut paths: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_file() && !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.'))).collect();
        paths.sort();
        out.extend(paths.into_iter().map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        }));
    }
    out
}

#[cfg(test)]
mod tests {
    fn replay(target: &str, f: fn(&[u8])) {
        let inputs = super::saved_inputs(target);
        for (path, bytes) in &inputs {
            eprintln!("replay {}", path.display());
            f(bytes);
        }
        eprintln!("{target}: {} inputs replayed", inputs.len());
    }

    #[test]
    fn gguf() {
        replay("gguf", super::gguf);
    }
    #[test]
    fn tokenizer() {
        replay("tokenizer", super::tokenizer);
    }
    #[test]
    fn template() {
        replay("template", super::template);
    }
    #[test]
    fn requests() {
        replay("requests", super::requests);
    }
    #[test]
    fn stop() {
        replay("stop", super::stop);
    }

    /// Writes the GGUF seeds of `corpus/gguf/` with the tests' tiny-model writer (file names without
    /// `.gguf`: the repository ignores that extension).
    #[test]
    #[ignore = "writes corpus/gguf: cargo test --manifest-path fuzz/Cargo.toml --lib -- --ignored write_gguf_seeds"]
    fn write_gguf_seeds() {
        use crate::common::{tiny_chat_model, tiny_model, TinySpec};
        use reckon_engine::gguf::{writer::GgufWriter, Value as G};
        use reckon_engine::kernels::ggml::GgmlType::{Q4_0, Q5_0, Q8_0, F16};
        let small = |arch: &'static str| TinySpec { arch, vocab: 32, d_model: 32, n_heads: 2, n_kv_heads: 1, head_dim: 16, ffn: 32, layers: 1, matrix_type: Q8_0, embed_type: Q8_0, sliding_window: 0 };
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/gguf");
        std::fs::create_dir_all(&dir).unwrap();
        let mut tok_only = GgufWriter::new();
        tok_only.meta("general.architecture", G::String("llama".into()));
        tok_only.meta("general.alignment", G::U32(64));
        tok_only.meta("tokenizer.ggml.model", G::String("gpt2".into()));
        tok_only.meta("tokenizer.ggml.pre", G::String("qwen2".into()));
        tok_only.meta("tokenizer.ggml.tokens", G::Array(["a", "b", "ab", "<|im_end|>"].iter().map(|t| G::String(t.to_string())).collect()));
        tok_only.meta("tokenizer.ggml.token_type", G::Array([1, 1, 1, 3].iter().map(|&t| G::I32(t)).collect()));
        tok_only.meta("tokenizer.ggml.merges", G::Array(vec![G::String("a b".into())]));
        tok_only.meta("tokenizer.ggml.eos_token_id", G::U32(3));
        tok_only.meta("nested", G::Array(vec![G::Array(vec![G::F64(1.5), G::I64(-1)]), G::Array(vec![G::Bool(true)])]));
        let mut empty = b"GGUF".to_vec();
        empty.extend(2u32.to_le_bytes());
        empty.extend([0u8; 16]);
        let seeds: [(&str, Vec<u8>); 6] = [
            ("tiny-chat-llama-q8_0", tiny_chat_model(&small("llama"), 1, 128)),
            ("tiny-qwen2-q4_0", tiny_model(&TinySpec { matrix_type: Q4_0, ..small("qwen2") }, 2)),
            ("tiny-gemma3-q5_0", tiny_model(&TinySpec { matrix_type: Q5_0, embed_type: F16, layers: 6, sliding_window: 8, ..small("gemma3") }, 3)),
            ("tokenizer-only", tok_only.to_bytes()),
            ("empty-v2", empty),
            ("not-gguf", b"GGUX\x03\0\0\0".to_vec()),
        ];
        for (name, bytes) in seeds {
            std::fs::write(dir.join(name), &bytes).unwrap();
            eprintln!("{name}: {} bytes", bytes.len());
        }
    }
}
