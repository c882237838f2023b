//! `reckon lab spec-prefill`: what a sparse prefill (`--spec-prefill-keep`, `engine::sparse`) saves in
//! time to first token and what it loses in recall, against a full prefill in the same passes.
//!
//! Needle recall: `lab eviction`'s seeded haystack of about `length` tokens with `needles` facts at
//! evenly spaced depths; each is asked for in its own request (greedy), at every keep ratio (1.0 is the
//! full prefill). One engine per (length, keep), the prefix cache off (each request prefills its whole
//! prompt), arms interleaved and reversed on odd passes. Recorded per request: the answer, whether it
//! holds the needle's number, the time to first token and the scoring pass's part of it.
//!
//! Not yet: the generated QA set, the append-heavy session with and without idle recovery.

use crate::eviction::haystack;
use crate::stats::{summarize, Summary};
use crate::LabError;
use reckon_engine::engine::sparse::SparsePrefillConfig;
use reckon_engine::engine::{spawn_with_models, Completion, EngineConfig, EngineHandle, GenerateParams};
use reckon_engine::model::Model;
use reckon_engine::template::{ChatMessage, ChatTemplate};
use reckon_engine::tokenizer::Tokenizer;
use serde::Serialize;
use std::fmt::Write as _;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

#[derive(Clone)]
pub struct SpecPrefillLabSpec {
    pub lengths: Vec<usize>,
    /// Keep ratios; 1.0 (the full prefill) is always measured first.
    pub keeps: Vec<f64>,
    pub needles: usize,
    pub passes: usize,
    pub seed: u64,
    pub max_tokens: usize,
    /// The sparse prefill's settings but `keep` (its `min_tokens` is set to 1: every prompt is thinned).
    pub scoring: SparsePrefillConfig,
    /// The scoring model (the model itself without one).
    pub scorer: Option<Arc<Model>>,
    /// The QA set too (`qa_cases`).
    pub qa: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct NeedleRecord {
    pub pass: usize,
    /// `needle` (a secret number) or `qa` (a generated fact of another kind).
    pub set: &'static str,
    pub length: usize,
    pub keep: f64,
    pub needle: usize,
    pub prompt_tokens: usize,
    /// Prompt tokens the sparse prefill did not compute.
    pub dropped: u64,
    pub expected: String,
    pub reply: String,
    pub correct: bool,
    pub ttft_ms: f64,
    pub scoring_ms: f64,
}

fn question(name: &str) -> String {
    format!("\n\nWhat is the secret number for {name}? Reply with the number only.")
}

/// The QA set's kinds of fact: the sentence, the question, the answers to draw from.
const QA: [(&str, &str, &[&str]); 5] = [
    (" {name}'s favourite colour is {x}.", "What is {name}'s favourite colour? Reply with one word.", &["turquoise", "crimson", "violet", "amber", "olive", "indigo"]),
    (" {name} was born in the city of {x}.", "In which city was {name} born? Reply with the city only.", &["Lisbon", "Krakow", "Nairobi", "Osaka", "Quito", "Tallinn"]),
    (" {name} keeps a pet {x} at home.", "What animal does {name} keep as a pet? Reply with one word.", &["tortoise", "parrot", "ferret", "hamster", "iguana", "rabbit"]),
    (" {name} works as a {x} in the old town.", "What is {name}'s job? Reply with one word.", &["locksmith", "dentist", "carpenter", "pharmacist", "florist", "plumber"]),
    (" {name} plays the {x} in a band.", "Which instrument does {name} play? Reply with one word.", &["cello", "trombone", "harp", "banjo", "clarinet", "accordion"]),
];
const QA_NAMES: &[&str] = &["Marisol", "Teodor", "Yusuf", "Ingrid", "Rafael", "Suki", "Olek", "Nadia"];

/// One question of a recall set: the user message (haystack and question), the expected answer, the
/// byte offset of its fact in the haystack and the fact's text.
pub struct Case {
    pub user: String,
    pub expected: String,
    pub hay: String,
    pub offset: usize,
    pub fact: String,
}

/// The needle set: `needles` secret numbers in `lab eviction`'s haystack.
pub fn needle_cases(tok: &Tokenizer, length: usize, needles: usize, seed: u64) -> Result<Vec<Case>, LabError> {
    let (hay, placed) = haystack(tok, length, needles, seed)?;
    Ok(placed
        .iter()
        .map(|(name, number, b)| Case { user: format!("{hay}{}", question(name)), expected: number.clone(), hay: hay.clone(), offset: *b, fact: format!(" The secret number for {name} is {number}.") })
        .collect())
}

/// The QA set: `n` facts of five kinds (colour, city, pet, job, instrument) about other names, seeded,
/// in the same filler; each asked in its own request, answered right when the reply holds the word.
pub fn qa_cases(tok: &Tokenizer, length: usize, n: usize, seed: u64) -> Result<Vec<Case>, LabError> {
    use reckon_engine::sampler::Rng;
    let mut rng = Rng::new(seed ^ 0x9a5e);
    let picked: Vec<(usize, &str, &str)> = (0..n).map(|i| {
        let kind = i % QA.len();
        let x = QA[kind].2[(rng.next_u64() % QA[kind].2.len() as u64) as usize];
        (kind, QA_NAMES[i % QA_NAMES.len()], x)
    }).collect();
    let facts: Vec<String> = picked.iter().map(|(k, name, x)| QA[*k].0.replace("{name}", name).replace("{x}", x)).collect();
    let (hay, at) = crate::eviction::haystack_with(tok, length, &facts, &mut rng)?;
    Ok(picked
        .iter()
        .zip(at)
        .zip(&facts)
        .map(|((&(k, name, x), b), fact)| Case { user: format!("{hay}\n\n{}", QA[k].1.replace("{name}", name)), expected: x.to_string(), hay: hay.clone(), offset: b, fact: fact.clone() })
        .collect())
}

/// Runs the passes; `record` sees each request as it ends.
pub fn run(model: &Arc<Model>, tok: &Arc<Tokenizer>, template: &ChatTemplate, spec: &SpecPrefillLabSpec, mut record: impl FnMut(&NeedleRecord)) -> Result<Vec<NeedleRecord>, LabError> {
    let mut keeps = vec![1.0];
    keeps.extend(spec.keeps.iter().copied().filter(|&k| k < 1.0));
    let longest = spec.lengths.iter().copied().max().unwrap_or(0) + 256 + spec.max_tokens;
    let engine = |keep: f64| -> Result<EngineHandle, LabError> {
        let config = EngineConfig {
            block_size: 16,
            num_blocks: longest.div_ceil(16) + 8,
            max_batch_tokens: 512,
            max_running: 1,
            max_waiting: 4,
            max_model_len: longest,
            prefix_caching: false,
            spec_prefill: (keep < 1.0).then_some(SparsePrefillConfig { keep, min_tokens: 1, recover: false, ..spec.scoring }),
            ..EngineConfig::default()
        };
        spawn_with_models(model.clone(), None, spec.scorer.clone().filter(|_| keep < 1.0), tok.clone(), config, None).map_err(|e| LabError::Request(e.to_string()))
    };
    let engines: Vec<EngineHandle> = keeps.iter().map(|&k| engine(k)).collect::<Result<_, _>>()?;
    let mut out = Vec::new();
    for pass in 0..spec.passes {
        for &length in &spec.lengths {
            let mut sets = vec![("needle", needle_cases(tok, length, spec.needles, spec.seed)?)];
            if spec.qa {
                sets.push(("qa", qa_cases(tok, length, spec.needles, spec.seed)?));
            }
            for (set, cases) in &sets {
            for (i, case) in cases.iter().enumerate() {
                let prompt = tok.encode(&template.render(&[ChatMessage::new("user", &case.user)], true)?, true, true)?;
                let order: Vec<usize> = if pass % 2 == 0 { (0..keeps.len()).collect() } else { (0..keeps.len()).rev().collect() };
                for a in order {
                    let st = engines[a].stats();
                    let before = (st.spec_prefill_dropped_tokens.load(Relaxed), st.spec_prefill_scoring_ns.load(Relaxed));
                    let (_, events) = engines[a].submit(GenerateParams::greedy(prompt.clone(), spec.max_tokens)).map_err(|e| LabError::Request(e.to_string()))?;
                    let done = Completion::wait(events).map_err(LabError::Request)?;
                    let r = NeedleRecord {
                        pass,
                        set,
                        length,
                        keep: keeps[a],
                        needle: i,
                        prompt_tokens: prompt.len(),
                        dropped: st.spec_prefill_dropped_tokens.load(Relaxed) - before.0,
                        expected: case.expected.clone(),
                        correct: done.text.to_lowercase().contains(&case.expected.to_lowercase()),
                        reply: done.text.trim().to_string(),
                        ttft_ms: done.timings.time_to_first_token.as_secs_f64() * 1e3,
                        scoring_ms: (st.spec_prefill_scoring_ns.load(Relaxed) - before.1) as f64 / 1e6,
                    };
                    record(&r);
                    out.push(r);
                }
            }
            }
        }
    }
    Ok(out)
}

/// One (length, keep) over the passes and needles.
#[derive(Clone, Debug, Serialize)]
pub struct NeedleRow {
    pub set: &'static str,
    pub length: usize,
    pub keep: f64,
    pub prompt_tokens: usize,
    /// Needles answered, of those asked, over every pass.
    pub correct: usize,
    pub asked: usize,
    pub ttft_ms: Summary,
    pub scoring_ms: Summary,
    /// Per (pass, needle), the full prefill's TTFT over this arm's.
    pub speedup: Summary,
}

pub fn rows(records: &[NeedleRecord]) -> Vec<NeedleRow> {
    let mut keys: Vec<(&'static str, usize, u64)> = Vec::new();
    for r in records {
        if !keys.contains(&(r.set, r.length, r.keep.to_bits())) {
            keys.push((r.set, r.length, r.keep.to_bits()));
        }
    }
    keys.into_iter()
        .filter_map(|(set, length, keep)| {
            let mine: Vec<&NeedleRecord> = records.iter().filter(|r| r.set == set && r.length == length && r.keep.to_bits() == keep).collect();
            let full = |r: &NeedleRecord| records.iter().find(|f| f.set == set && f.length == length && f.keep == 1.0 && f.pass == r.pass && f.needle == r.needle);
            let ratios: Vec<f64> = mine.iter().filter_map(|r| full(r).map(|f| f.ttft_ms / r.ttft_ms)).collect();
            Some(NeedleRow {
                set,
                length,
                keep: f64::from_bits(keep),
                prompt_tokens: mine.iter().map(|r| r.prompt_tokens).max().unwrap_or(0),
                correct: mine.iter().filter(|r| r.correct).count(),
                asked: mine.len(),
                ttft_ms: summarize(&mine.iter().map(|r| r.ttft_ms).collect::<Vec<_>>())?,
                scoring_ms: summarize(&mine.iter().map(|r| r.scoring_ms).collect::<Vec<_>>())?,
                speedup: summarize(&ratios)?,
            })
        })
        .collect()
}

pub fn markdown(rows: &[NeedleRow]) -> String {
    let mut t = String::from("| set | length | prompt tokens | keep | found | TTFT ms, median (min-max) | of it, scoring ms | full / this TTFT |\n|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        let _ = writeln!(
            t,
            "| {} | {} | {} | {} | {}/{} | {:.0} ({:.0}-{:.0}) | {:.0} | {:.2}x ({:.2}-{:.2}) |",
            r.set,
            r.length, r.prompt_tokens, r.keep, r.correct, r.asked, r.ttft_ms.median, r.ttft_ms.min, r.ttft_ms.max, r.scoring_ms.median, r.speedup.median, r.speedup.min, r.speedup.max
        );
    }
    t
}

/// TTFT speedup and needles found against the keep ratio, a line per length.
pub fn plot(rows: &[NeedleRow], title: &str, path: &std::path::Path) -> Result<(), LabError> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| LabError::Plot(e.to_string());
    let root = SVGBackend::new(path, (800, 450)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (left, right) = root.split_horizontally(400);
    let ymax = rows.iter().map(|r| r.speedup.max).fold(1.5, f64::max) * 1.1;
    let colors = [RED, BLUE, GREEN, MAGENTA, CYAN, BLACK];
    let mut lengths: Vec<usize> = rows.iter().map(|r| r.length).collect();
    lengths.dedup();
    for (area, what) in [(&left, "TTFT, full over sparse"), (&right, "needles found (share)")] {
        let top = if what.starts_with("TTFT") { ymax } else { 1.05 };
        let mut chart = ChartBuilder::on(area).caption(format!("{title}: {what}"), ("sans-serif", 13)).margin(10).x_label_area_size(30).y_label_area_size(40).build_cartesian_2d(0.0..1.0, 0.0..top).map_err(|e| err(&e))?;
        chart.configure_mesh().x_desc("keep").draw().map_err(|e| err(&e))?;
        for (i, &length) in lengths.iter().enumerate() {
            let color = colors[i % colors.len()];
            let pts: Vec<(f64, f64)> = rows.iter().filter(|r| r.length == length).map(|r| (r.keep, if what.starts_with("TTFT") { r.speedup.median } else { r.correct as f64 / r.asked.max(1) as f64 })).collect();
            chart.draw_series(LineSeries::new(pts, color.stroke_width(2))).map_err(|e| err(&e))?.label(format!("{length} tokens")).legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color));
        }
        chart.configure_series_labels().position(SeriesLabelPosition::UpperRight).border_style(BLACK).background_style(WHITE).draw().map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// How well a cheaper scoring pass ranks the prompt (issue 21: "measure its cost and its ranking quality
/// against the full-draft ranking"): per scoring variant (the scorer's first `layers` layers, a pooling
/// of its attention), whether each needle's sentence is wholly kept at several keep ratios, the worst
/// rank of the needle's chunks, and how much of the deepest variant's selection it shares.
#[derive(Clone, Debug, Serialize)]
pub struct RankRecord {
    pub length: usize,
    pub needle: usize,
    pub prompt_tokens: usize,
    pub layers: usize,
    pub pooling: &'static str,
    /// Rank of the needle's worst chunk among the prompt's chunks (0: the best-scored).
    pub worst_rank: usize,
    pub chunks: usize,
    /// (keep, the needle's every token kept).
    pub kept: Vec<(f64, bool)>,
    /// At keep 0.2: the share of the deepest same-pooling selection this one keeps too.
    pub overlap_deepest: f64,
    /// The scoring pass of the deepest variant (every layer asked for), and this variant's share of
    /// it in layers.
    pub pass_ms: f64,
    pub est_ms: f64,
}

/// Poolings of the look-ahead queries' attention compared by `rank`: `mean` (over queries, as the
/// engine scores), `max` (over queries), and each with `+spread` (a chunk also takes its neighbours'
/// scores: the text around an attended span, such as a number after the name asked for).
pub const POOLINGS: [&str; 4] = ["mean", "max", "mean+spread", "max+spread"];

fn pooled(by_layer: &[reckon_engine::engine::sparse::LayerAttention], layers: usize, pooling: &str, chunk: usize) -> Vec<f32> {
    use reckon_engine::engine::sparse::{chunk_scores, pool, spread, Pooling};
    let imp = pool(&by_layer[..layers], if pooling.starts_with("max") { Pooling::Max } else { Pooling::Mean });
    let s = chunk_scores(&imp, 0, chunk);
    if pooling.ends_with("+spread") {
        spread(&s)
    } else {
        s
    }
}

/// The token positions of `case`'s fact sentence in `prompt` (`rendered`, tokenized).
fn fact_tokens(tok: &Tokenizer, prompt: &[u32], rendered: &str, case: &Case) -> std::ops::Range<usize> {
    let base = rendered.find(&case.hay[..case.hay.len().min(200)]).unwrap_or(0);
    let mut ends = Vec::with_capacity(prompt.len());
    let mut at = 0;
    for &t in prompt {
        at += tok.token_bytes(t, true).len();
        ends.push(at);
    }
    // the rendered text may start with a BOS the tokenizer added: align on the total
    let from = base + case.offset + at.saturating_sub(rendered.len());
    let to = from + case.fact.len();
    let first = ends.iter().position(|&e| e > from).unwrap_or(0);
    let last = ends.iter().position(|&e| e >= to).unwrap_or(prompt.len() - 1);
    first..last + 1
}

/// One scoring pass per needle prompt of every length (the deepest of `layers`), every variant read off
/// it (a layer's attention does not depend on later layers).
pub fn rank(scorer: &Model, tok: &Arc<Tokenizer>, template: &ChatTemplate, spec: &SpecPrefillLabSpec, layers: &[usize], mut record: impl FnMut(&RankRecord)) -> Result<Vec<RankRecord>, LabError> {
    use reckon_engine::engine::sparse::{attention_by_layer, select};
    let deepest = layers.iter().copied().max().unwrap_or(1).min(scorer.config.n_layers);
    let chunk = spec.scoring.chunk;
    let mut out = Vec::new();
    for &length in &spec.lengths {
        let mut cases = needle_cases(tok, length, spec.needles, spec.seed)?;
        if spec.qa {
            cases.extend(qa_cases(tok, length, spec.needles, spec.seed)?);
        }
        for (i, case) in cases.iter().enumerate() {
            let rendered = template.render(&[ChatMessage::new("user", &case.user)], true)?;
            let prompt = tok.encode(&rendered, true, true)?;
            let span = fact_tokens(tok, &prompt, &rendered, case);
            let t0 = std::time::Instant::now();
            let by_layer = attention_by_layer(scorer, &prompt, deepest, spec.scoring.lookahead);
            let pass_ms = t0.elapsed().as_secs_f64() * 1e3;
            for pooling in POOLINGS {
                let deep_sel = select(prompt.len(), 0, chunk, &pooled(&by_layer, deepest, pooling, chunk), 0.2);
                for &l in layers.iter().filter(|&&l| l <= deepest) {
                    let scores = pooled(&by_layer, l, pooling, chunk);
                    let mut order: Vec<usize> = (0..scores.len()).collect();
                    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
                    let worst_rank = (span.start / chunk..=(span.end - 1) / chunk).map(|j| order.iter().position(|&o| o == j).unwrap_or(0)).max().unwrap_or(0);
                    let kept = [0.1, 0.2, 0.3]
                        .iter()
                        .map(|&k| {
                            let sel = select(prompt.len(), 0, chunk, &scores, k);
                            (k, span.clone().all(|p| sel.binary_search(&p).is_ok()))
                        })
                        .collect();
                    let sel = select(prompt.len(), 0, chunk, &scores, 0.2);
                    let shared = sel.iter().filter(|p| deep_sel.binary_search(p).is_ok()).count();
                    let r = RankRecord {
                        length,
                        needle: i,
                        prompt_tokens: prompt.len(),
                        layers: l,
                        pooling,
                        worst_rank,
                        chunks: scores.len(),
                        kept,
                        overlap_deepest: shared as f64 / deep_sel.len().max(1) as f64,
                        pass_ms,
                        est_ms: pass_ms * l as f64 / deepest as f64,
                    };
                    record(&r);
                    out.push(r);
                }
            }
        }
    }
    Ok(out)
}

/// Per (length, layers, pooling): needles kept at each ratio, the median worst rank, the overlap with
/// the deepest ranking and the estimated scoring time.
pub fn rank_markdown(records: &[RankRecord]) -> String {
    let mut t = String::from("| length | layers | pooling | needles kept @0.1 / 0.2 / 0.3 | needle chunk rank, median (max) | overlap with deepest @0.2 | scoring ms (share of the deepest pass) |\n|---|---|---|---|---|---|---|\n");
    let mut keys: Vec<(usize, usize, &str)> = Vec::new();
    for r in records {
        if !keys.contains(&(r.length, r.layers, r.pooling)) {
            keys.push((r.length, r.layers, r.pooling));
        }
    }
    keys.sort();
    for (length, layers, pooling) in keys {
        let mine: Vec<&RankRecord> = records.iter().filter(|r| (r.length, r.layers, r.pooling) == (length, layers, pooling)).collect();
        let kept = |k: usize| mine.iter().filter(|r| r.kept[k].1).count();
        let ranks = summarize(&mine.iter().map(|r| r.worst_rank as f64).collect::<Vec<_>>());
        let overlap = summarize(&mine.iter().map(|r| r.overlap_deepest).collect::<Vec<_>>());
        let est = summarize(&mine.iter().map(|r| r.est_ms).collect::<Vec<_>>());
        let (Some(ranks), Some(overlap), Some(est)) = (ranks, overlap, est) else { continue };
        let _ = writeln!(
            t,
            "| {length} | {layers} | {pooling} | {} / {} / {} of {} | {:.0} ({:.0}) of {} | {:.0}% | {:.0} |",
            kept(0),
            kept(1),
            kept(2),
            mine.len(),
            ranks.median,
            ranks.max,
            mine[0].chunks,
            overlap.median * 100.0,
            est.median
        );
    }
    t
}

/// The append-heavy agent session (issue 21's second table): what a sparse prefill leaves for the next
/// turn. A system prompt with tool schemas, a first user turn of `first_tokens` (a file the agent was
/// given), then turns of `turn_tokens` appended to the whole history (`lab prefix`'s generator), greedy
/// replies of `max_tokens`. Three arms, the prefix cache on in each: `full` (no sparse prefill), `sparse`
/// (a sparse prefill wherever the new suffix beyond the cache hit reaches `min_tokens`), `recover`
/// (the same with idle recovery). Between turns the client thinks for `think_ms`: the engine is idle
/// then, and `recover` recovers. During each think, `probes` short requests arrive at seeded random
/// moments: their time to first token in `recover` against the other arms' (an idle engine) is what
/// recovery adds to a request that arrives mid-slice.
#[derive(Clone)]
pub struct SessionSpec {
    pub turns: usize,
    pub system_tokens: usize,
    pub first_tokens: usize,
    pub turn_tokens: (usize, usize),
    pub think_ms: u64,
    pub probes: usize,
    pub max_tokens: usize,
    pub passes: usize,
    /// The sparse arms' settings (`recover` is set per arm).
    pub sparse: SparsePrefillConfig,
    pub scorer: Option<Arc<Model>>,
}

pub const SESSION_ARMS: [&str; 3] = ["full", "sparse", "recover"];

#[derive(Clone, Debug, Serialize)]
pub struct SessionRecord {
    pub pass: usize,
    pub arm: &'static str,
    pub turn: usize,
    pub prompt_tokens: usize,
    /// Prompt tokens the prefix cache gave.
    pub cached_tokens: usize,
    /// Prompt tokens the sparse prefill did not compute.
    pub dropped_tokens: u64,
    /// Prompt tokens computed: the prompt less the cache hit and the dropped.
    pub computed_tokens: usize,
    /// Tokens still sparse (recovery's debt) when the turn arrived.
    pub debt_at_arrival: u64,
    pub ttft_ms: f64,
    pub e2e_ms: f64,
    pub reply: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct ProbeRecord {
    pub pass: usize,
    pub arm: &'static str,
    pub turn: usize,
    /// Since the turn's reply ended.
    pub at_ms: f64,
    pub ttft_ms: f64,
    /// A recovery step was running or queued (the debt was not paid) when it arrived.
    pub recovering: bool,
}

/// Recovery's slices over a pass of the `recover` arm: steps that carried a slice, their time.
#[derive(Clone, Debug, Serialize)]
pub struct SliceRecord {
    pub pass: usize,
    pub steps: u64,
    pub tokens: u64,
    pub ms: f64,
    /// The longest step that carried a slice.
    pub max_step_ms: f64,
}

pub struct SessionRun {
    pub turns: Vec<SessionRecord>,
    pub probes: Vec<ProbeRecord>,
    pub slices: Vec<SliceRecord>,
}

/// Runs the session's passes (arms interleaved, order reversed on odd passes).
pub fn session(model: &Arc<Model>, tok: &Arc<Tokenizer>, template: &ChatTemplate, spec: &SessionSpec, mut record: impl FnMut(&SessionRecord)) -> Result<SessionRun, LabError> {
    use crate::prefix::conversation::{system_prompt, user_turn};
    use reckon_engine::sampler::Rng;
    let longest = spec.system_tokens + spec.first_tokens + spec.turns * (spec.turn_tokens.1 + spec.max_tokens + 64) + 512;
    let system = system_prompt(tok, spec.system_tokens, None)?;
    let mut run = SessionRun { turns: Vec::new(), probes: Vec::new(), slices: Vec::new() };
    for pass in 0..spec.passes {
        let order: Vec<&'static str> = if pass % 2 == 0 { SESSION_ARMS.to_vec() } else { SESSION_ARMS.iter().rev().copied().collect() };
        for arm in order {
            let config = EngineConfig {
                block_size: 16,
                num_blocks: 2 * longest.div_ceil(16) + 64,
                max_batch_tokens: 512,
                max_running: 4,
                max_waiting: 16,
                max_model_len: longest,
                prefix_caching: true,
                spec_prefill: (arm != "full").then_some(SparsePrefillConfig { recover: arm == "recover", ..spec.sparse }),
                ..EngineConfig::default()
            };
            let scorer = spec.scorer.clone().filter(|_| arm != "full");
            let engine = spawn_with_models(model.clone(), None, scorer, tok.clone(), config, None).map_err(|e| LabError::Request(e.to_string()))?;
            let st = engine.stats();
            let mut history: Vec<ChatMessage> = vec![ChatMessage::new("system", &system)];
            let mut rng = Rng::new(spec.seed_for(pass));
            let slices0 = (st.spec_prefill_recovery_steps.load(Relaxed), st.spec_prefill_recovered_tokens.load(Relaxed), st.spec_prefill_recovery_ns.load(Relaxed));
            for turn in 0..spec.turns {
                let (lo, hi) = if turn == 0 { (spec.first_tokens, spec.first_tokens) } else { spec.turn_tokens };
                history.push(ChatMessage::new("user", &user_turn(tok, 0, turn, lo, hi)?));
                let prompt = tok.encode(&template.render(&history, true)?, true, true)?;
                let debt_at_arrival = st.spec_prefill_recovery_debt.load(Relaxed);
                let dropped0 = st.spec_prefill_dropped_tokens.load(Relaxed);
                let (_, events) = engine.submit(GenerateParams::greedy(prompt.clone(), spec.max_tokens)).map_err(|e| LabError::Request(e.to_string()))?;
                let done = Completion::wait(events).map_err(LabError::Request)?;
                let dropped = st.spec_prefill_dropped_tokens.load(Relaxed) - dropped0;
                let r = SessionRecord {
                    pass,
                    arm,
                    turn,
                    prompt_tokens: prompt.len(),
                    cached_tokens: done.usage.cached_tokens,
                    dropped_tokens: dropped,
                    computed_tokens: prompt.len().saturating_sub(done.usage.cached_tokens + dropped as usize),
                    debt_at_arrival,
                    ttft_ms: done.timings.time_to_first_token.as_secs_f64() * 1e3,
                    e2e_ms: done.timings.end_to_end.as_secs_f64() * 1e3,
                    reply: done.text.clone(),
                };
                record(&r);
                run.turns.push(r);
                history.push(ChatMessage::new("assistant", &done.text));
                if turn + 1 == spec.turns {
                    break;
                }
                // the client thinks; short probes arrive at seeded moments
                let thinking = std::time::Instant::now();
                let mut at: Vec<u64> = (0..spec.probes).map(|_| rng.next_u64() % spec.think_ms.max(1)).collect();
                at.sort();
                for (i, at) in at.into_iter().enumerate() {
                    let wait = std::time::Duration::from_millis(at).saturating_sub(thinking.elapsed());
                    std::thread::sleep(wait);
                    let recovering = st.spec_prefill_recovery_debt.load(Relaxed) > 0;
                    let at_ms = thinking.elapsed().as_secs_f64() * 1e3;
                    let text = format!("Probe {pass}.{turn}.{i}: reply with one word.");
                    let probe = tok.encode(&template.render(&[ChatMessage::new("user", &text)], true)?, true, true)?;
                    let (_, events) = engine.submit(GenerateParams::greedy(probe, 1)).map_err(|e| LabError::Request(e.to_string()))?;
                    let done = Completion::wait(events).map_err(LabError::Request)?;
                    run.probes.push(ProbeRecord { pass, arm, turn, at_ms, ttft_ms: done.timings.time_to_first_token.as_secs_f64() * 1e3, recovering });
                }
                std::thread::sleep(std::time::Duration::from_millis(spec.think_ms).saturating_sub(thinking.elapsed()));
            }
            if arm == "recover" {
                let (s, t, ns) = (st.spec_prefill_recovery_steps.load(Relaxed), st.spec_prefill_recovered_tokens.load(Relaxed), st.spec_prefill_recovery_ns.load(Relaxed));
                let max_step_ms = st.spec_prefill_recovery_max_step_ns.load(Relaxed) as f64 / 1e6;
                run.slices.push(SliceRecord { pass, steps: s - slices0.0, tokens: t - slices0.1, ms: (ns - slices0.2) as f64 / 1e6, max_step_ms });
            }
        }
    }
    Ok(run)
}

impl SessionSpec {
    fn seed_for(&self, pass: usize) -> u64 {
        0x5e55_1000 + pass as u64
    }
}

/// Per arm and turn: medians over passes; then each arm's session (the sum of its turns' end-to-end
/// times); then recovery's added latency on the probes.
pub fn session_markdown(run: &SessionRun) -> String {
    let mut t = String::from("| turn | prompt tokens | arm | cached | dropped | computed | debt at arrival | TTFT ms, median (min-max) | end to end ms |\n|---|---|---|---|---|---|---|---|---|\n");
    let turns = run.turns.iter().map(|r| r.turn).max().map_or(0, |m| m + 1);
    let med = |xs: Vec<f64>| summarize(&xs);
    for turn in 0..turns {
        for arm in SESSION_ARMS {
            let mine: Vec<&SessionRecord> = run.turns.iter().filter(|r| r.turn == turn && r.arm == arm).collect();
            let (Some(ttft), Some(e2e)) = (med(mine.iter().map(|r| r.ttft_ms).collect()), med(mine.iter().map(|r| r.e2e_ms).collect())) else { continue };
            let m = |f: &dyn Fn(&SessionRecord) -> f64| med(mine.iter().map(|r| f(r)).collect()).map_or(0.0, |s| s.median);
            let _ = writeln!(
                t,
                "| {turn} | {:.0} | {arm} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} ({:.0}-{:.0}) | {:.0} |",
                m(&|r| r.prompt_tokens as f64),
                m(&|r| r.cached_tokens as f64),
                m(&|r| r.dropped_tokens as f64),
                m(&|r| r.computed_tokens as f64),
                m(&|r| r.debt_at_arrival as f64),
                ttft.median,
                ttft.min,
                ttft.max,
                e2e.median
            );
        }
    }
    t.push_str("\n| arm | session time s (sum of turns' end to end), median (min-max) | of it, TTFT s |\n|---|---|---|\n");
    let passes = run.turns.iter().map(|r| r.pass).max().map_or(0, |m| m + 1);
    for arm in SESSION_ARMS {
        let per_pass = |f: &dyn Fn(&SessionRecord) -> f64| -> Vec<f64> { (0..passes).map(|p| run.turns.iter().filter(|r| r.arm == arm && r.pass == p).map(|r| f(r)).sum::<f64>() / 1e3).collect() };
        if let (Some(total), Some(ttft)) = (med(per_pass(&|r| r.e2e_ms)), med(per_pass(&|r| r.ttft_ms))) {
            let _ = writeln!(t, "| {arm} | {:.1} ({:.1}-{:.1}) | {:.1} |", total.median, total.min, total.max, ttft.median);
        }
    }
    let idle: Vec<f64> = run.probes.iter().filter(|p| p.arm != "recover").map(|p| p.ttft_ms).collect();
    let busy: Vec<f64> = run.probes.iter().filter(|p| p.arm == "recover" && p.recovering).map(|p| p.ttft_ms).collect();
    if let (Some(i), Some(b)) = (med(idle.clone()), med(busy.clone())) {
        let p99 = |xs: &[f64]| {
            let mut s = xs.to_vec();
            s.sort_by(f64::total_cmp);
            crate::stats::percentile(&s, 0.99)
        };
        let slice_ms: Vec<f64> = run.slices.iter().filter(|s| s.steps > 0).map(|s| s.ms / s.steps as f64).collect();
        let slice = med(slice_ms).map_or(0.0, |s| s.median);
        let longest = run.slices.iter().map(|s| s.max_step_ms).fold(0.0, f64::max);
        let _ = writeln!(
            t,
            "\nProbes (a one-token reply to a short prompt, arriving during the client's think time): idle engine (full and sparse arms) TTFT median {:.0} ms, p99 {:.0} ms (n {}); arriving while recovery runs, median {:.0} ms, p99 {:.0} ms (n {}). Added by recovery: median {:.0} ms, p99 {:.0} ms; a recovery slice's step: mean {:.0} ms, longest {:.0} ms.",
            i.median,
            p99(&idle),
            idle.len(),
            b.median,
            p99(&busy),
            busy.len(),
            b.median - i.median,
            p99(&busy) - i.median,
            slice,
            longest
        );
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_pair_each_request_with_the_full_prefill() {
        let rec = |pass, keep, needle, ttft, correct| NeedleRecord { pass, set: "needle", length: 2048, keep, needle, prompt_tokens: 2100, dropped: 0, expected: "1".into(), reply: "1".into(), correct, ttft_ms: ttft, scoring_ms: 10.0 };
        let records = vec![rec(0, 1.0, 0, 1000.0, true), rec(0, 0.2, 0, 250.0, true), rec(0, 1.0, 1, 900.0, true), rec(0, 0.2, 1, 300.0, false)];
        let rows = rows(&records);
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[1].correct, rows[1].asked, rows[1].speedup.median), (1, 2, 3.5));
        assert!(markdown(&rows).contains("| needle | 2048 | 2100 | 0.2 | 1/2 |"), "{}", markdown(&rows));
    }
}
