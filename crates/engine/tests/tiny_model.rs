//! The model runtime on tiny random models written as GGUF by the test: shapes, every weight type end to
//! end, and bit-exact determinism across batch composition, chunking and thread counts, in both
//! numerics (packed where this CPU has its kernels, and ggml).

mod common;

use common::{tiny_model, TestRng, TinySpec};
use reckon_engine::gguf::GgufFile;
use reckon_engine::model::{LogitsWanted, Model, Numerics, Scratch, SeqInput};
use reckon_engine::kernels::ggml::GgmlType;
use reckon_engine::kv::Attention;

fn load(spec: &TinySpec, seed: u64) -> Model {
    Model::load(GgufFile::from_vec(tiny_model(spec, seed)).unwrap()).unwrap()
}

/// The same model once per numerics this CPU runs (packed falls back to ggml without its kernels).
fn load_each(spec: &TinySpec, seed: u64) -> Vec<Model> {
    common::simd_or_skip(reckon_engine::kernels::cpu::SimdLevel::Avx2, "the packed numerics' half of the tiny-model checks");
    let mut models: Vec<Model> = [Numerics::Packed, Numerics::Ggml].into_iter().map(|n| Model::load_with(GgufFile::from_vec(tiny_model(spec, seed)).unwrap(), n).unwrap()).collect();
    models.dedup_by_key(|m| m.numerics());
    models
}

fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut rng = TestRng(seed);
    (0..n).map(|_| (rng.next() % vocab as u64) as u32).collect()
}

/// Block tables for `n` sequences laid out in disjoint, interleaved blocks (seq i gets blocks i, i+n, …).
fn tables(n: usize, blocks_each: usize) -> Vec<Vec<u32>> {
    (0..n).map(|i| (0..blocks_each).map(|b| (b * n + i) as u32).collect()).collect()
}

/// Runs each sequence alone, one prefill: the reference every batched run must equal bit for bit.
fn single_run_logits(model: &Model, prompt: &[u32]) -> Vec<f32> {
    let mut kv = model.new_kv(4, 64);
    let table: Vec<u32> = (0..64).collect();
    let mut s = Scratch::default();
    let input = SeqInput { tokens: prompt, start_pos: 0, block_tables: std::slice::from_ref(&table), logits: LogitsWanted::All, state: None };
    model.forward(&[input], &mut kv, &mut s).to_vec()
}

/// The three architectures, plus llama with K-quant matrices (rows of 256).
fn all_archs() -> Vec<TinySpec> {
    let k = |t| TinySpec { d_model: 256, ffn: 256, n_heads: 4, n_kv_heads: 2, head_dim: 64, ..TinySpec::llama(t) };
    vec![TinySpec::llama(GgmlType::Q4_1), TinySpec::qwen2(), TinySpec::gemma3(), k(GgmlType::Q4_K), k(GgmlType::Q6_K)]
}

#[test]
fn logits_have_the_requested_rows() {
    for spec in all_archs() {
        let model = load(&spec, 1);
        let mut kv = model.new_kv(4, 16);
        let t = tables(2, 8);
        let (a, b) = (tokens(1, 5, spec.vocab), tokens(2, 3, spec.vocab));
        let mut s = Scratch::default();
        let seqs = [
            SeqInput { tokens: &a, start_pos: 0, block_tables: std::slice::from_ref(&t[0]), logits: LogitsWanted::All, state: None },
            SeqInput { tokens: &b, start_pos: 0, block_tables: std::slice::from_ref(&t[1]), logits: LogitsWanted::Last, state: None },
        ];
        let logits = model.forward(&seqs, &mut kv, &mut s);
        assert_eq!(logits.len(), (5 + 1) * spec.vocab, "{}", spec.arch);
        assert!(logits.iter().all(|v| v.is_finite()), "{}", spec.arch);
    }
}

#[test]
fn every_weight_type_runs_end_to_end() {
    use GgmlType::*;
    for t in [F32, F16, Q4_0, Q4_1, Q5_0, Q8_0] {
        let model = load(&TinySpec::llama(t), 3);
        let logits = single_run_logits(&model, &tokens(3, 6, 96));
        assert!(logits.iter().all(|v| v.is_finite()), "{t:?}");
    }
    for t in [Q4_K, Q5_K, Q6_K] {
        // K-quants need rows of 256.
        let spec = TinySpec { d_model: 256, ffn: 256, n_heads: 4, n_kv_heads: 2, head_dim: 64, ..TinySpec::llama(t) };
        let model = load(&spec, 4);
        let logits = single_run_logits(&model, &tokens(4, 6, 96));
        assert!(logits.iter().all(|v| v.is_finite()), "{t:?}");
    }
}

#[test]
fn batch_of_n_sequences_equals_n_single_runs() {
    for spec in all_archs() {
        for model in load_each(&spec, 5) {
            let prompts: Vec<Vec<u32>> = (0..4).map(|i| tokens(10 + i, 3 + 5 * i as usize, spec.vocab)).collect();
            let t = tables(prompts.len(), 16);
            let mut kv = model.new_kv(4, 64);
            let mut s = Scratch::default();
            let seqs: Vec<SeqInput> = prompts.iter().zip(&t).map(|(p, bt)| SeqInput { tokens: p, start_pos: 0, block_tables: std::slice::from_ref(bt), logits: LogitsWanted::All, state: None }).collect();
            let batched = model.forward(&seqs, &mut kv, &mut s).to_vec();
            let singles: Vec<f32> = prompts.iter().flat_map(|p| single_run_logits(&model, p)).collect();
            assert_eq!(batched, singles, "{} ({}): batched logits differ from single runs", spec.arch, model.numerics().name());
        }
    }
}

#[test]
fn mixed_prefill_chunks_and_decodes_equal_a_single_prefill() {
    for spec in all_archs() {
        for model in load_each(&spec, 6) {
            // Sequence A: 12-token prompt; B: 20-token prompt (longer than gemma's window of 8).
            let (a, b) = (tokens(20, 12, spec.vocab), tokens(21, 20, spec.vocab));
            let (ref_a, ref_b) = (single_run_logits(&model, &a), single_run_logits(&model, &b));
            let v = spec.vocab;
            let t = tables(2, 8);
            let mut kv = model.new_kv(4, 16);
            let mut s = Scratch::default();
            // Step 1: A's first 11 tokens with B's first 7. Step 2: A's last token (a "decode") with B's next 9.
            // Step 3: B's last 4 alone.
            let step = |kv: &mut _, s: &mut Scratch, seqs: &[SeqInput]| model.forward(seqs, kv, s).to_vec();
            let out1 = step(&mut kv, &mut s, &[
                SeqInput { tokens: &a[..11], start_pos: 0, block_tables: std::slice::from_ref(&t[0]), logits: LogitsWanted::All, state: None },
                SeqInput { tokens: &b[..7], start_pos: 0, block_tables: std::slice::from_ref(&t[1]), logits: LogitsWanted::All, state: None },
            ]);
            let out2 = step(&mut kv, &mut s, &[
                SeqInput { tokens: &b[7..16], start_pos: 7, block_tables: std::slice::from_ref(&t[1]), logits: LogitsWanted::All, state: None },
                SeqInput { tokens: &a[11..], start_pos: 11, block_tables: std::slice::from_ref(&t[0]), logits: LogitsWanted::Last, state: None },
            ]);
            let out3 = step(&mut kv, &mut s, &[SeqInput { tokens: &b[16..], start_pos: 16, block_tables: std::slice::from_ref(&t[1]), logits: LogitsWanted::All, state: None }]);
            let got_a: Vec<f32> = [&out1[..11 * v], &out2[9 * v..]].concat();
            let got_b: Vec<f32> = [&out1[11 * v..], &out2[..9 * v], &out3[..]].concat();
            assert_eq!(got_a, ref_a, "{} ({}): sequence A", spec.arch, model.numerics().name());
            assert_eq!(got_b, ref_b, "{} ({}): sequence B", spec.arch, model.numerics().name());
        }
    }
}

#[test]
fn one_thread_equals_two_threads() {
    for spec in all_archs() {
        for model in load_each(&spec, 7) {
            let prompt = tokens(30, 17, spec.vocab);
            let run = |threads| {
                let pool = reckon_engine::pool::Pool::new(threads);
                pool.install(|| single_run_logits(&model, &prompt))
            };
            assert_eq!(run(1), run(2), "{} ({})", spec.arch, model.numerics().name());
        }
    }
}

#[test]
fn sliding_window_layers_forget_old_tokens() {
    // With a window of 8, changing token 0 changes the logits of position 9 only through global layers;
    // make every layer local (6 layers, period 6 → layer 5 is global), so compare against a model whose
    // window covers everything: their outputs must differ past the window and agree inside it.
    let spec = TinySpec::gemma3();
    let windowed = load(&spec, 8);
    let wide = load(&TinySpec { sliding_window: 1024, ..TinySpec::gemma3() }, 8);
    let prompt = tokens(40, 12, spec.vocab);
    let (a, b) = (single_run_logits(&windowed, &prompt), single_run_logits(&wide, &prompt));
    let v = spec.vocab;
    assert_eq!(a[..8 * v], b[..8 * v], "positions inside the window must agree");
    assert_ne!(a[8 * v..], b[8 * v..], "positions past the window must differ");
}

/// The engine validates requests before they reach the model, so the model only asserts its inputs; a
/// bad batch handed to it directly still stops at a check (a panic), never reads or writes out of bounds.
#[test]
fn bad_batches_stop_at_a_check() {
    let model = load(&TinySpec::llama(GgmlType::Q8_0), 9);
    let table = [0u32, 1];
    let too_long = tokens(1, 9, 96);
    let bad_block = [7u32];
    let batches: [(&[u32], &[u32]); 3] = [(&too_long, &table), (&[500], &table), (&[1], &bad_block)];
    for (toks, blocks) in batches {
        let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let (mut kv, mut s) = (model.new_kv(4, 2), Scratch::default());
            model.forward(&[SeqInput { tokens: toks, start_pos: 0, block_tables: &[blocks.to_vec()], logits: LogitsWanted::Last, state: None }], &mut kv, &mut s).to_vec()
        }));
        assert!(step.is_err(), "tokens {toks:?} with blocks {blocks:?} ran");
    }
}

/// A KV window (`kv::window`) reads the sink blocks and the recent blocks and nothing between: filling
/// the skipped blocks with garbage before every step changes no bit, one prefill equals token-by-token
/// decoding, the logits equal full attention's until the first position that skips a block and differ
/// after it, and garbage in the sink block does change them.
#[test]
fn a_kv_window_reads_its_sinks_and_recent_blocks_and_nothing_between() {
    use reckon_engine::kv::{KvDtypes, KvWindow};
    // f16 in blocks of 4 (the sinks are block 0); q8_0 keys and values in blocks of 16
    let cases = [(KvDtypes::F16, KvWindow { window: 8, sinks: 2 }, 4, 40), (KvDtypes::parse("q8_0").unwrap(), KvWindow { window: 40, sinks: 4 }, 16, 160)];
    for spec in all_archs() {
        for model in load_each(&spec, 5) {
          for &(dtypes, w, bs, n) in &cases {
            if dtypes.check_shape(model.config.head_dim, bs).is_err() {
                continue;
            }
            let (layers, kv_dim, vocab) = (model.config.n_layers, model.config.kv_dim(), spec.vocab);
            let toks = tokens(3, n, vocab);
            let table: Vec<u32> = (0..(n / bs) as u32).rev().collect();
            let mut s = Scratch::default();
            let mut kv = model.new_kv_with(dtypes, bs, n / bs);
            let input = SeqInput { tokens: &toks, start_pos: 0, block_tables: std::slice::from_ref(&table), logits: LogitsWanted::All, state: None };
            let whole = model.forward_at(&[input], &[], Attention::Window(w), &mut kv, &mut s).to_vec();
            // garbage keys that score high against some query: ±large (a tiny random model's attention is
            // so peaked that small garbage gets no weight at all)
            let garbage = |sign: f32| -> Vec<f32> { (0..kv_dim).map(|i| sign * (((i * 7919) % 13) as f32 - 6.0) * 300.0).collect() };
            let spoil_with = |kv: &mut reckon_engine::kv::KvStorage, block: usize, sign: f32| {
                let g = garbage(sign);
                for l in 0..layers {
                    for slot in 0..bs {
                        kv.write(l, table[block] as usize * bs + slot, &g, &g);
                    }
                }
            };
            let spoil = |kv: &mut reckon_engine::kv::KvStorage, block: usize| spoil_with(kv, block, 1.0);
            let mut kv_steps = model.new_kv_with(dtypes, bs, n / bs);
            let mut steps = Vec::new();
            for pos in 0..n {
                w.dead_blocks(pos, bs).for_each(|b| spoil(&mut kv_steps, b));
                let input = SeqInput { tokens: &toks[pos..pos + 1], start_pos: pos, block_tables: std::slice::from_ref(&table), logits: LogitsWanted::All, state: None };
                steps.extend_from_slice(model.forward_at(&[input], &[], Attention::Window(w), &mut kv_steps, &mut s));
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(bits(&whole) == bits(&steps), "{:?} {}: skipped blocks were read, or chunking changed the result", spec.arch, model.numerics().name());
            let mut kv = model.new_kv_with(dtypes, bs, n / bs);
            let full = model.forward(&[SeqInput { tokens: &toks, start_pos: 0, block_tables: std::slice::from_ref(&table), logits: LogitsWanted::All, state: None }], &mut kv, &mut s).to_vec();
            let first_gap = (0..n).find(|&p| !w.gap(p, bs).is_empty()).unwrap();
            assert_eq!(first_gap, w.window + w.sink_end(bs) + bs - 1);
            assert!(bits(&whole[..first_gap * vocab]) == bits(&full[..first_gap * vocab]));
            assert!(whole[first_gap * vocab..] != full[first_gap * vocab..], "the window changed nothing");
            // the sinks are read: decode the last token again (the same bits), then with block 0 spoiled
            let last = SeqInput { tokens: &toks[n - 1..], start_pos: n - 1, block_tables: std::slice::from_ref(&table), logits: LogitsWanted::All, state: None };
            assert!(bits(model.forward_at(&[last], &[], Attention::Window(w), &mut kv_steps, &mut s)) == bits(&whole[(n - 1) * vocab..]));
            let changed = [1.0, -1.0].iter().any(|&sign| {
                spoil_with(&mut kv_steps, 0, sign);
                model.forward_at(&[last], &[], Attention::Window(w), &mut kv_steps, &mut s)[..] != whole[(n - 1) * vocab..]
            });
            assert!(changed, "{} {} {dtypes:?}: the sinks were not read", spec.arch, model.numerics().name());
          }
        }
    }
}

/// Sparse attention over the history (`kv::sparse`): what a query reads depends on its own q and the
/// keys before it only, so a prompt prefilled whole, token by token, or beside another sequence gives
/// the same bits; with a budget that covers the history it is full attention; with a small one it is not.
#[test]
fn sparse_attention_is_the_same_however_the_prompt_is_chunked_or_batched() {
    use reckon_engine::kv::SparseAttention;
    let sparse = SparseAttention { budget: 8, local: 8, sinks: 2 };
    let (bs, n) = (4, 64);
    for spec in all_archs() {
        for model in load_each(&spec, 9) {
            let vocab = spec.vocab;
            let (a, b) = (tokens(5, n, vocab), tokens(6, n, vocab));
            let (ta, tb): (Vec<u32>, Vec<u32>) = ((0..16).rev().collect(), (16..32).collect());
            let mut s = Scratch::default();
            let run = |toks: &[u32], table: &Vec<u32>, chunk: usize, sparse: Option<SparseAttention>, s: &mut Scratch| -> Vec<f32> {
                let mut kv = model.new_kv(bs, 32);
                let mut out = Vec::new();
                for (i, part) in toks.chunks(chunk).enumerate() {
                    let input = SeqInput { tokens: part, start_pos: i * chunk, block_tables: std::slice::from_ref(table), logits: LogitsWanted::All, state: None };
                    out.extend_from_slice(model.forward_at(&[input], &[], sparse.map_or(Attention::Full, Attention::Sparse), &mut kv, s));
                }
                out
            };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let whole = run(&a, &ta, n, Some(sparse), &mut s);
            for chunk in [1, 5, 16] {
                assert!(bits(&whole) == bits(&run(&a, &ta, chunk, Some(sparse), &mut s)), "{:?} {}: chunks of {chunk} changed the result", spec.arch, model.numerics().name());
            }
            // beside another sequence, in one step
            let mut kv = model.new_kv(bs, 32);
            let inputs = [
                SeqInput { tokens: &b, start_pos: 0, block_tables: std::slice::from_ref(&tb), logits: LogitsWanted::All, state: None },
                SeqInput { tokens: &a, start_pos: 0, block_tables: std::slice::from_ref(&ta), logits: LogitsWanted::All, state: None },
            ];
            let both = model.forward_at(&inputs, &[], Attention::Sparse(sparse), &mut kv, &mut s).to_vec();
            assert!(bits(&both[n * vocab..]) == bits(&whole), "{:?} {}: a batch changed the result", spec.arch, model.numerics().name());
            assert!(bits(&both[..n * vocab]) == bits(&run(&b, &tb, n, Some(sparse), &mut s)));
            // a budget that covers the history is full attention; a small one is not
            let dense = run(&a, &ta, n, None, &mut s);
            assert!(bits(&run(&a, &ta, 7, Some(SparseAttention { budget: n, ..sparse }), &mut s)) == bits(&dense));
            let first = (0..n).find(|&p| !sparse.candidates(p, bs).is_empty()).unwrap();
            assert!(bits(&whole[..first * vocab]) == bits(&dense[..first * vocab]));
            if model.config.n_layers > (0..model.config.n_layers).filter(|&l| model.config.layer_window(l).is_some()).count() {
                assert!(whole[first * vocab..] != dense[first * vocab..], "{:?}: sparse attention changed nothing", spec.arch);
            }
        }
    }
}

/// Sparse prefill (`Model::forward_at`, issue 21): kept tokens in consecutive cells, each rotated for its
/// place in the full prompt. Layer 0's keys and values depend on a token and its position only, so a kept
/// token's cells hold the very bits the full prefill wrote at its position (its RoPE position is its index
/// in the prompt); with every token kept the logits are the full prefill's; the thinned tokens at their
/// cells' positions instead give other keys and other logits.
#[test]
fn a_sparse_prefill_keeps_each_token_at_its_position() {
    for spec in [TinySpec::llama(GgmlType::Q4_1), TinySpec::qwen2()] {
        for model in load_each(&spec, 21) {
            let prompt = tokens(5, 40, spec.vocab);
            let table: Vec<u32> = (0..16).collect();
            let tables = std::slice::from_ref(&table);
            let mut s = Scratch::default();
            let run = |tokens: &[u32], positions: Option<&[usize]>, kv: &mut reckon_engine::kv::KvStorage, s: &mut Scratch| {
                let seq = SeqInput { tokens, start_pos: 0, block_tables: tables, logits: LogitsWanted::Last, state: None };
                model.forward_at(&[seq], &[positions], Attention::Full, kv, s).to_vec()
            };
            let mut full = model.new_kv(4, 16);
            let full_logits = run(&prompt, None, &mut full, &mut s);
            let all: Vec<usize> = (0..40).collect();
            assert_eq!(run(&prompt, Some(&all), &mut model.new_kv(4, 16), &mut s), full_logits, "every token kept");
            let kept: Vec<usize> = (0..8).chain(17..25).chain(36..40).collect();
            let thin: Vec<u32> = kept.iter().map(|&p| prompt[p]).collect();
            let mut sparse = model.new_kv(4, 16);
            let sparse_logits = run(&thin, Some(&kept), &mut sparse, &mut s);
            let d = model.config.kv_dim();
            let ((_, fv), (_, sv)) = (full.layer(0), sparse.layer(0));
            for (cell, &p) in kept.iter().enumerate() {
                let (a, b) = (full.slot(&table, p), sparse.slot(&table, cell));
                assert_eq!(full.key_row(0, a), sparse.key_row(0, b), "{}: layer 0 key of position {p} (cell {cell})", spec.arch);
                assert_eq!(fv[a * d..(a + 1) * d], sv[b * d..(b + 1) * d], "{}: layer 0 value of position {p}", spec.arch);
            }
            let mut shifted = model.new_kv(4, 16);
            assert_ne!(run(&thin, None, &mut shifted, &mut s), sparse_logits, "positions matter");
            let b = sparse.slot(&table, 8);
            assert_ne!(shifted.key_row(0, b), sparse.key_row(0, b), "cell 8 rotated for position 17, not 8");
        }
    }
}

/// Sparse prefill's scoring (`engine::sparse`): the attention probabilities it computes from a layer's
/// roped queries and the stored keys are the model's own: weighting the stored values by them gives the
/// attention output the model computed (`kqv_out`), for every head of the look-ahead queries, GQA and
/// all. And the importance it returns is a position's largest head probability averaged over queries
/// and layers: finite, within [0, 1].
#[test]
fn sparse_prefill_scoring_uses_the_models_own_attention() {
    use reckon_engine::engine::sparse::{head_probs, importance, Pooling};
    use reckon_engine::model::Tracer;
    use std::sync::Mutex;
    struct Keep(Mutex<Vec<(String, usize, Vec<f32>)>>);
    impl Tracer for Keep {
        fn record(&self, name: &str, layer: usize, rows: &[f32], _: usize) {
            if name == "Qcur" || name == "kqv_out" {
                self.0.lock().unwrap().push((name.to_string(), layer, rows.to_vec()));
            }
        }
    }
    for spec in [TinySpec::llama(GgmlType::Q4_1), TinySpec::qwen2()] {
        for model in load_each(&spec, 23) {
            let c = &model.config;
            let prompt = tokens(9, 37, spec.vocab);
            let (n, w) = (prompt.len(), 3);
            let mut kv = model.new_kv(16, 3);
            let table: Vec<u32> = (0..3).collect();
            let tables = std::slice::from_ref(&table);
            let mut s = Scratch::default();
            let quiet = Keep(Mutex::new(Vec::new()));
            model.forward_layers(&[SeqInput { tokens: &prompt[..n - w], start_pos: 0, block_tables: tables, logits: LogitsWanted::None, state: None }], c.n_layers, &mut kv, &mut s, &quiet);
            let keep = Keep(Mutex::new(Vec::new()));
            model.forward_layers(&[SeqInput { tokens: &prompt[n - w..], start_pos: n - w, block_tables: tables, logits: LogitsWanted::None, state: None }], c.n_layers, &mut kv, &mut s, &keep);
            let got = keep.0.into_inner().unwrap();
            let (q_dim, kv_dim, hd, group) = (c.q_dim(), c.kv_dim(), c.head_dim, c.n_heads / c.n_kv_heads);
            for layer in 0..c.n_layers {
                let rows = |name: &str| got.iter().find(|g| g.0 == name && g.1 == layer).map(|g| g.2.clone()).unwrap();
                let (q, out) = (rows("Qcur"), rows("kqv_out"));
                let values = kv.layer(layer).1;
                // the keys as rows, whatever the storage's layout (`head_probs` reads rows)
                let keys: Vec<half::f16> = (0..3 * 16).flat_map(|sl| kv.key_row(layer, sl)).collect();
                for j in 0..w {
                    let slots: Vec<usize> = (0..=n - w + j).map(|p| kv.slot(&table, p)).collect();
                    for h in 0..c.n_heads {
                        let p = head_probs(&q[j * q_dim + h * hd..][..hd], &keys, &slots, h / group, kv_dim, c.attn_scale);
                        for d in 0..hd {
                            let want: f32 = slots.iter().zip(&p).map(|(&sl, &pr)| pr * values[sl * kv_dim + (h / group) * hd + d].to_f32()).sum();
                            let have = out[j * q_dim + h * hd + d];
                            assert!((want - have).abs() <= 2e-3 * (1.0 + have.abs()), "{} layer {layer} query {j} head {h}: {want} vs {have}", spec.arch);
                        }
                    }
                }
            }
            let imp = importance(&model, &prompt, c.n_layers, w, Pooling::Mean);
            let imp_max = importance(&model, &prompt, c.n_layers, w, Pooling::Max);
            assert_eq!(imp.len(), n);
            // the importance from these probabilities: the largest over heads, averaged over queries and layers
            let mut want = vec![0f32; n];
            let mut want_max = vec![0f32; n];
            for layer in 0..c.n_layers {
                let mut layer_max = vec![0f32; n];
                let q = got.iter().find(|g| g.0 == "Qcur" && g.1 == layer).map(|g| g.2.clone()).unwrap();
                for j in 0..w {
                    let slots: Vec<usize> = (0..=n - w + j).map(|p| kv.slot(&table, p)).collect();
                    let mut best = vec![0f32; slots.len()];
                    let keys: Vec<half::f16> = (0..3 * 16).flat_map(|sl| kv.key_row(layer, sl)).collect();
                    for h in 0..c.n_heads {
                        let p = head_probs(&q[j * q_dim + h * hd..][..hd], &keys, &slots, h / group, kv_dim, c.attn_scale);
                        best.iter_mut().zip(p).for_each(|(b, p)| *b = b.max(p));
                    }
                    want.iter_mut().zip(&best).for_each(|(x, b)| *x += b / (w * c.n_layers) as f32);
                    layer_max.iter_mut().zip(&best).for_each(|(x, &b)| *x = x.max(b));
                }
                want_max.iter_mut().zip(layer_max).for_each(|(x, b)| *x += b / c.n_layers as f32);
            }
            assert!(imp_max.iter().zip(&want_max).all(|(a, b)| (a - b).abs() < 1e-5), "{imp_max:?} vs {want_max:?}");
            assert!(imp.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-5), "{imp:?} vs {want:?}");
            assert!(imp.iter().all(|x| x.is_finite() && (0.0..=1.0).contains(x)), "{imp:?}");
            assert_eq!(imp, importance(&model, &prompt, c.n_layers, w, Pooling::Mean), "deterministic");
        }
    }
}
