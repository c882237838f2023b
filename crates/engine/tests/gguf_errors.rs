//! Broken model files give an error that names the problem, never a panic.

mod common;

use common::{tiny_model, TinySpec};
use reckon_engine::gguf::writer::GgufWriter;
use reckon_engine::gguf::{GgufFile, Value};
use reckon_engine::model::{LogitsWanted, Model, Numerics, Scratch, SeqInput};
use reckon_engine::kernels::ggml::GgmlType;

fn good() -> Vec<u8> {
    tiny_model(&TinySpec::llama(GgmlType::Q8_0), 1)
}

fn open_err(bytes: Vec<u8>) -> String {
    match GgufFile::from_vec(bytes) {
        Ok(f) => match Model::load(f) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        },
        Err(e) => e.to_string(),
    }
}

fn assert_mentions(err: &str, needle: &str) {
    assert!(err.contains(needle), "error {err:?} does not mention {needle:?}");
}

#[test]
fn the_good_file_loads() {
    Model::load(GgufFile::from_vec(good()).unwrap()).unwrap();
}

#[test]
fn wrong_magic() {
    let mut b = good();
    b[..4].copy_from_slice(b"GGML");
    assert_mentions(&open_err(b), "not a GGUF file");
    assert_mentions(&open_err(vec![b'G', b'G']), "shorter than");
}

#[test]
fn unsupported_version() {
    let mut b = good();
    b[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert_mentions(&open_err(b.clone()), "unsupported GGUF version 1");
    b[4..8].copy_from_slice(&99u32.to_le_bytes());
    assert_mentions(&open_err(b), "version 99");
}

#[test]
fn truncated_anywhere_is_an_error() {
    let b = good();
    // Cut at many points: in the header, in metadata, in tensor infos and in the data.
    for cut in (0..b.len()).step_by(b.len() / 97 + 1) {
        let err = open_err(b[..cut].to_vec());
        assert!(err.contains("GGUF") || err.contains("truncated") || err.contains("past the end"), "cut at {cut}: {err}");
    }
}

#[test]
fn huge_counts_do_not_allocate_or_panic() {
    let mut b = good();
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes()); // tensor count
    assert_mentions(&open_err(b), "more than the file holds");
    let mut w = GgufWriter::new();
    w.meta("k", Value::String("x".into()));
    let mut b = w.to_bytes();
    // The string length field of the first metadata value sits after magic, version, counts, key, type.
    let pos = 4 + 4 + 8 + 8 + 8 + 1 + 4;
    b[pos..pos + 8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    assert_mentions(&open_err(b), "truncated");
}

#[test]
fn unsupported_tensor_type() {
    let mut w = GgufWriter::new();
    w.meta("general.architecture", Value::String("llama".into()));
    w.tensor("t", GgmlType::F32, &[4], vec![0; 16]);
    let mut b = w.to_bytes();
    // Patch the type id (the u32 after the tensor's single dimension) to 20 (IQ4_NL: not supported).
    let needle = [1u32.to_le_bytes().as_slice(), 4u64.to_le_bytes().as_slice(), 0u32.to_le_bytes().as_slice()].concat();
    let at = b.windows(needle.len()).position(|w| w == needle.as_slice()).unwrap() + 12;
    b[at..at + 4].copy_from_slice(&20u32.to_le_bytes());
    assert_mentions(&open_err(b), "unsupported tensor type id 20");
}

#[test]
fn unsupported_architecture_and_missing_tensors() {
    let mut w = GgufWriter::new();
    w.meta("general.architecture", Value::String("mamba".into()));
    assert_mentions(&open_err(w.to_bytes()), "architecture \"mamba\"");
    let mut w = GgufWriter::new();
    w.meta("general.architecture", Value::String("llama".into()));
    assert_mentions(&open_err(w.to_bytes()), "missing key");
}

#[test]
fn tensor_past_the_end_or_misaligned() {
    let mut w = GgufWriter::new();
    w.tensor("t", GgmlType::F32, &[64], vec![0; 256]);
    let b = w.to_bytes();
    assert_mentions(&open_err(b[..b.len() - 100].to_vec()), "past the end");
    let mut b = b;
    // The tensor's offset is the last u64 of its info; make it 7 (not aligned to 32).
    let needle = [64u64.to_le_bytes().as_slice(), 0u32.to_le_bytes().as_slice(), 0u64.to_le_bytes().as_slice()].concat();
    let at = b.windows(needle.len()).position(|w| w == needle.as_slice()).unwrap() + 12;
    b[at..at + 8].copy_from_slice(&7u64.to_le_bytes());
    assert_mentions(&open_err(b), "not aligned");
}

#[test]
fn row_length_must_fit_the_block_size() {
    let mut w = GgufWriter::new();
    w.tensor("t", GgmlType::Q8_0, &[48], vec![0; 68]);
    assert_mentions(&open_err(w.to_bytes()), "not a multiple");
}

/// Where `key`'s value starts in a GGUF image (after its length-prefixed name and its u32 type).
fn value_pos(b: &[u8], key: &str) -> usize {
    let needle = [&(key.len() as u64).to_le_bytes()[..], key.as_bytes()].concat();
    b.windows(needle.len()).position(|w| w == needle.as_slice()).expect("key in the file") + needle.len() + 4
}

/// Where tensor `name`'s info continues after its name: n_dims (u32), dims (u64 each), type (u32),
/// offset (u64).
fn tensor_info_pos(b: &[u8], name: &str) -> usize {
    let needle = [&(name.len() as u64).to_le_bytes()[..], name.as_bytes()].concat();
    b.windows(needle.len()).position(|w| w == needle.as_slice()).expect("tensor in the file") + needle.len()
}

/// One random mutation of a valid image `base` and a description of it. Kinds: bit flips or byte
/// overwrites anywhere (mostly tensor data), the same within the header (metadata and tensor infos), a
/// u32/u64 of the header set to a boundary value, a truncation, a hyper-parameter set to a random value
/// (f32 ones to NaN, ±inf, 0 or random bits), and a tensor's type, shape or offset changed to another
/// plausible one (a valid type id, transposed or resized dims, another aligned offset).
fn mutate(base: &[u8], header: &reckon_engine::gguf::Header, rng: &mut common::TestRng) -> (Vec<u8>, String) {
    let mut b = base.to_vec();
    let header_len = header.data_offset as usize;
    let pick = |rng: &mut common::TestRng, n: usize| (rng.next() % n as u64) as usize;
    match rng.next() % 8 {
        0 => {
            let mut at = Vec::new();
            for _ in 0..1 + pick(rng, 4) {
                let i = pick(rng, b.len());
                b[i] ^= 1 << pick(rng, 8);
                at.push(i);
            }
            (b, format!("bits flipped at {at:?}"))
        }
        1 | 2 => {
            let len = if rng.next() % 2 == 0 { b.len() } else { header_len };
            let mut at = Vec::new();
            for _ in 0..1 + pick(rng, 8) {
                let i = pick(rng, len);
                b[i] = rng.next() as u8;
                at.push(i);
            }
            (b, format!("bytes overwritten at {at:?}"))
        }
        3 => {
            let i = pick(rng, header_len - 8);
            let vals: [u64; 10] = [0, 1, 2, 7, 31, 32, 255, 1 << 31, u32::MAX as u64, u64::MAX];
            let v = vals[pick(rng, vals.len())];
            if rng.next() % 2 == 0 {
                b[i..i + 4].copy_from_slice(&(v as u32).to_le_bytes());
            } else {
                b[i..i + 8].copy_from_slice(&v.to_le_bytes());
            }
            (b, format!("header word at {i} set to {v:#x}"))
        }
        4 => {
            let cut = pick(rng, b.len());
            b.truncate(cut);
            (b, format!("truncated at {cut}"))
        }
        5 => {
            let (key, value) = &header.metadata[pick(rng, header.metadata.len())];
            let at = value_pos(&b, key);
            let desc = match value {
                Value::U32(_) => {
                    let v = [0, 1, 2, 3, 4, 8, 16, 17, 32, 64, 96, 255, 1 << 20, u32::MAX][pick(rng, 14)];
                    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
                    format!("{key} = {v}")
                }
                Value::F32(_) => {
                    let v = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -1.0, 1e30, f32::from_bits(rng.next() as u32)][pick(rng, 7)];
                    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
                    format!("{key} = {v}")
                }
                _ => {
                    let i = at + pick(rng, 4);
                    b[i] = rng.next() as u8;
                    format!("{key}: byte {i} overwritten")
                }
            };
            (b, desc)
        }
        _ => {
            let t = &header.tensors[pick(rng, header.tensors.len())];
            let at = tensor_info_pos(&b, &t.name);
            let n = t.dims.len();
            let (dims_at, type_at, offset_at) = (at + 4, at + 4 + 8 * n, at + 8 + 8 * n);
            let desc = match rng.next() % 4 {
                0 => {
                    let ty = GgmlType::ALL[pick(rng, GgmlType::ALL.len())];
                    b[type_at..type_at + 4].copy_from_slice(&ty.ggml_id().to_le_bytes());
                    format!("{}: type {}", t.name, ty.name())
                }
                1 if n == 2 => {
                    let (d0, d1) = (t.dims[0], t.dims[1]);
                    b[dims_at..dims_at + 8].copy_from_slice(&d1.to_le_bytes());
                    b[dims_at + 8..dims_at + 16].copy_from_slice(&d0.to_le_bytes());
                    format!("{}: dims transposed", t.name)
                }
                1 | 2 => {
                    let k = pick(rng, n);
                    let v = [0u64, 1, 16, 32, 48, 64, 96, 128, 256, 1 << 40][pick(rng, 10)];
                    b[dims_at + 8 * k..dims_at + 8 * k + 8].copy_from_slice(&v.to_le_bytes());
                    format!("{}: dim {k} = {v}", t.name)
                }
                _ => {
                    let data_len = (base.len() - header_len) as u64;
                    let off = (rng.next() % (data_len + 64)) / header.alignment * header.alignment;
                    b[offset_at..offset_at + 8].copy_from_slice(&off.to_le_bytes());
                    format!("{}: offset {off}", t.name)
                }
            };
            (b, desc)
        }
    }
}

/// What a damaged image came to: an error, or a model that ran two steps (a prefill and a decode).
enum Outcome {
    Error,
    Ran,
}

fn load_and_run(bytes: Vec<u8>, numerics: Numerics) -> Outcome {
    let Ok(file) = GgufFile::from_vec(bytes) else { return Outcome::Error };
    let Ok(model) = Model::load_with(file, numerics) else { return Outcome::Error };
    let vocab = model.config.vocab_size;
    let tokens: Vec<u32> = [0, 1, 5, 42, vocab - 1].iter().map(|&t| (t % vocab) as u32).collect();
    let table: Vec<u32> = (0..4).collect();
    let (mut kv, mut s) = (model.new_kv(4, 4), Scratch::default());
    let prefill = SeqInput { tokens: &tokens, start_pos: 0, block_tables: std::slice::from_ref(&table), logits: LogitsWanted::All, state: None };
    assert_eq!(model.forward(&[prefill], &mut kv, &mut s).len(), tokens.len() * vocab);
    let decode = SeqInput { tokens: &tokens[1..2], start_pos: tokens.len(), block_tables: std::slice::from_ref(&table), logits: LogitsWanted::Last, state: None };
    assert_eq!(model.forward(&[decode], &mut kv, &mut s).len(), vocab);
    Outcome::Ran
}

/// Random damage anywhere in the file (not only the header) gives an error or a model that runs: never
/// a panic, an out-of-bounds access or a hang, whatever the (possibly NaN) logits. A truncated file is
/// always an error (the tiny model's last tensor ends the file). Seeded, so deterministic; a failure
/// names the seed and the mutation, and RECKON_GGUF_FUZZ_CASES=N runs more cases.
#[test]
fn random_damage_anywhere_errs_or_loads_a_model_that_runs() {
    use std::sync::{mpsc, Arc, Mutex};
    // Half the cases load packed numerics: AVX-512 kernels, AVX2 ones, or (neither) ggml's again.
    use reckon_engine::kernels::cpu::SimdLevel;
    if !common::simd_or_skip(SimdLevel::Avx512, "damaged weights through the AVX-512 kernels") {
        common::simd_or_skip(SimdLevel::Avx2, "damaged weights through the packed kernels");
    }
    let cases: usize = std::env::var("RECKON_GGUF_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1500);
    let current = Arc::new(Mutex::new(String::from("starting")));
    let (done, finished) = mpsc::channel();
    let worker = {
        let current = current.clone();
        std::thread::spawn(move || {
            let mut summary = Vec::new();
            // Most cases run the forward steps on the calling thread alone: on a busy machine a step
            // split over a pool waits for its workers to be scheduled, dozens of times per case. Every
            // 8th case uses the default pool, so the split paths see damaged models too.
            let serial = reckon_engine::pool::Pool::new(1);
            for (spec_name, spec, seed) in [("llama Q4_1", TinySpec::llama(GgmlType::Q4_1), 71), ("gemma3", TinySpec::gemma3(), 72)] {
                let base = tiny_model(&spec, seed);
                let header = GgufFile::from_vec(base.clone()).unwrap().header().clone();
                let last_end = header.tensors.iter().map(|t| t.file_offset + t.num_bytes).max().unwrap();
                assert_eq!(last_end, base.len() as u64, "the last tensor ends the file");
                let (mut ran, mut errors, mut slowest) = (0, 0, (0.0f64, String::new()));
                for case in 0..cases as u64 {
                    let mut rng = common::TestRng(seed * 1_000_003 + case);
                    let (bytes, what) = mutate(&base, &header, &mut rng);
                    let truncated = bytes.len() < base.len();
                    let numerics = if case % 2 == 0 { Numerics::Packed } else { Numerics::Ggml };
                    let pooled = case % 8 == 7;
                    let threads = if pooled { "default pool" } else { "1 thread" };
                    let label = format!("{spec_name}, case {case} (seed {}): {what}, {numerics:?}, {threads}", seed * 1_000_003 + case);
                    *current.lock().unwrap() = label.clone();
                    let start = std::time::Instant::now();
                    let run = || if pooled { load_and_run(bytes, numerics) } else { serial.install(|| load_and_run(bytes, numerics)) };
                    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run))
                        .unwrap_or_else(|_| panic!("{label}: panicked (see the message above)"));
                    let secs = start.elapsed().as_secs_f64();
                    if secs > slowest.0 {
                        slowest = (secs, label.clone());
                    }
                    match outcome {
                        Outcome::Error => errors += 1,
                        Outcome::Ran => {
                            assert!(!truncated, "{label}: a truncated file loaded");
                            ran += 1;
                        }
                    }
                }
                summary.push(format!("{spec_name}: {ran} loaded and ran, {errors} errors; slowest {:.1} ms ({})", slowest.0 * 1e3, slowest.1));
                assert!(ran > cases / 5 && errors > cases / 5, "{spec_name}: the mutations should both break and spare the file ({ran} ran, {errors} errors)");
            }
            let _ = done.send(());
            summary
        })
    };
    // A hang shows as no end within the limit (the whole run takes a few seconds).
    let limit = std::time::Duration::from_secs(60 + cases as u64 / 10);
    match finished.recv_timeout(limit) {
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("no end after {limit:?}: hung on {}", current.lock().unwrap()),
        _ => match worker.join() {
            Ok(summary) => summary.iter().for_each(|l| eprintln!("{l}")),
            Err(e) => std::panic::resume_unwind(e),
        },
    }
}
