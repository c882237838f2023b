//! Broken model files give an error that names the problem, never a panic.

mod common;

use common::{tiny_model, TinySpec};
use reckon_engine::gguf::writer::GgufWriter;
use reckon_engine::gguf::{GgufFile, Value};
use reckon_engine::model::Model;
use reckon_engine::quant::GgmlType;

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

#[test]
fn random_byte_corruption_never_panics() {
    let base = good();
    let mut rng = common::TestRng(99);
    for _ in 0..300 {
        let mut b = base.clone();
        for _ in 0..4 {
            // Corrupt the header area, where structure lives.
            let header_len = 4096.min(b.len());
            let i = (rng.next() % header_len as u64) as usize;
            b[i] = rng.next() as u8;
        }
        let _ = GgufFile::from_vec(b).map(Model::load);
    }
}
