//! `reckon lab eviction`: what a StreamingLLM window (`--kv-window`, `kv::window`) saves and what it
//! loses, on this machine's model.
//!
//! Recall: a haystack of seeded filler sentences holds `needles` facts ("The secret number for Alice is
//! 40213.") at evenly spaced depths; each is asked for in its own request (the haystack, then the
//! question), greedy, and counts when the reply contains the number. Every (length, arm) sees the same
//! haystack and questions; an arm is full KV, one window (with its sinks), or sparse attention over the
//! history (`kv::sparse`, which keeps every block but reads a picked part of them).
//!
//! Fluency: a text teacher-forced through each arm, and through each window without sinks (the case
//! StreamingLLM's sinks exist for): mean negative log-likelihood and perplexity over the positions past
//! the largest window, where every window has dropped something.
//!
//! Memory: the KV bytes a sequence of each length holds under each arm (`KvWindow::held_blocks`).

use crate::LabError;
use reckon_engine::engine::{spawn, Completion, EngineConfig, GenerateParams};
use reckon_engine::kv::{Attention, KvDtypes, KvWindow, SparseAttention};
use reckon_engine::model::Model;
use reckon_engine::sampler::Rng;
use reckon_engine::template::{ChatMessage, ChatTemplate};
use reckon_engine::tokenizer::Tokenizer;
use serde::Serialize;
use std::fmt::Write as _;
use std::sync::Arc;

const BLOCK_SIZE: usize = 16;

#[derive(Clone, Debug)]
pub struct EvictionSpec {
    /// Haystack lengths (tokens, approximately: whole sentences).
    pub lengths: Vec<usize>,
    /// Window sizes (`N`); full KV is always the first arm.
    pub windows: Vec<usize>,
    pub sinks: usize,
    pub needles: usize,
    pub seed: u64,
    /// Reply tokens at most.
    pub max_tokens: usize,
    pub kv_dtypes: KvDtypes,
    /// An arm of sparse attention (`--sparse-attention`), after the windows.
    pub sparse: Option<SparseAttention>,
}

/// What one arm keeps and reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arm {
    Full,
    Window(usize),
    /// Sparse attention with this history budget (`EvictionSpec::sparse`).
    Sparse(usize),
}

impl EvictionSpec {
    /// Full KV, each window, then sparse attention.
    pub fn arms(&self) -> Vec<Arm> {
        std::iter::once(Arm::Full).chain(self.windows.iter().map(|&w| Arm::Window(w))).chain(self.sparse.map(|s| Arm::Sparse(s.budget))).collect()
    }
}

/// One needle asked for at one length under one arm.
#[derive(Clone, Debug, Serialize)]
pub struct RecallRecord {
    pub kv_dtype: String,
    pub length: usize,
    /// `None`: full KV (or sparse attention).
    pub window: Option<usize>,
    /// Sparse attention's history budget (`None`: full KV or a window).
    pub sparse: Option<usize>,
    pub sinks: usize,
    pub needle: usize,
    pub prompt_tokens: usize,
    /// The needle's first token, and how far before the end of the prompt it is.
    pub needle_pos: usize,
    pub distance_from_end: usize,
    pub expected: String,
    pub reply: String,
    pub correct: bool,
    pub prefill_ms: f64,
}

/// One arm's fluency over the teacher-forced text.
#[derive(Clone, Debug, Serialize)]
pub struct FluencyRecord {
    pub window: Option<usize>,
    /// Sparse attention's history budget.
    pub sparse: Option<usize>,
    pub sinks: usize,
    /// Positions scored: `from..tokens`.
    pub from: usize,
    pub tokens: usize,
    pub mean_nll: f64,
    pub perplexity: f64,
}

const NAMES: &[&str] = &["Alice", "Bruno", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jules", "Kemal", "Lena"];
const SUBJECTS: &[&str] = &[
    "The old bridge", "A small bakery", "The river", "Our neighbour", "The morning train", "A quiet library", "The harbour", "The village school",
    "A red bicycle", "The town council", "The museum", "A stray cat", "The football club", "The market square", "The lighthouse", "A travelling circus",
];
const VERBS: &[&str] = &[
    "was repainted", "opened early", "flooded again", "hosted a small fair", "ran late", "closed for repairs", "welcomed many visitors",
    "was mentioned in the paper", "changed its opening hours", "raised money for charity", "was covered in snow", "got a new sign",
];
const WHEN: &[&str] = &["last spring", "on Tuesday", "in the autumn", "after the storm", "every weekend", "during the holidays", "before dawn", "in March", "that evening", "for a week"];

/// A needle: the name asked for, its number, and the byte offset of its sentence in the haystack.
pub type Needle = (String, String, usize);

/// A seeded haystack of about `length` tokens with `needles` facts at evenly spaced depths.
pub fn haystack(tok: &Tokenizer, length: usize, needles: usize, seed: u64) -> reckon_engine::Result<(String, Vec<Needle>)> {
    let mut rng = Rng::new(seed);
    let facts: Vec<(String, String)> = (0..needles).map(|i| (NAMES[i % NAMES.len()].to_string(), format!("{}", 10_000 + rng.next_u64() % 90_000))).collect();
    let texts: Vec<String> = facts.iter().map(|(name, number)| format!(" The secret number for {name} is {number}.")).collect();
    let (text, at) = haystack_with(tok, length, &texts, &mut rng)?;
    Ok((text, facts.into_iter().zip(at).map(|((n, x), b)| (n, x, b)).collect()))
}

/// Seeded filler sentences of about `length` tokens with the `facts` (each a sentence starting with a
/// space) at evenly spaced depths; the text and each fact's byte offset in it (at its leading space,
/// less one for the first byte trimmed).
pub fn haystack_with(tok: &Tokenizer, length: usize, facts: &[String], rng: &mut Rng) -> reckon_engine::Result<(String, Vec<usize>)> {
    let pick = |rng: &mut Rng, xs: &[&'static str]| xs[(rng.next_u64() % xs.len() as u64) as usize];
    let fact_tokens: usize = facts.iter().map(|f| tok.encode(f, false, false).map(|t| t.len()).unwrap_or(0)).sum();
    let mut sentences: Vec<String> = Vec::new();
    let mut filler = String::new();
    while tok.encode(&filler, false, false)?.len() + fact_tokens < length {
        for _ in 0..16 {
            let s = format!(" {} {} {}.", pick(rng, SUBJECTS), pick(rng, VERBS), pick(rng, WHEN));
            filler.push_str(&s);
            sentences.push(s);
        }
    }
    let n = facts.len().max(1);
    let mut text = String::new();
    let mut placed = Vec::new();
    let at: Vec<usize> = (0..facts.len()).map(|i| ((2 * i + 1) * sentences.len()) / (2 * n)).collect();
    for (j, s) in sentences.iter().enumerate() {
        for (i, _) in at.iter().enumerate().filter(|(_, &a)| a == j) {
            placed.push(text.len());
            text.push_str(&facts[i]);
        }
        text.push_str(s);
    }
    Ok((text.trim_start().to_string(), placed.into_iter().map(|b| b.saturating_sub(1)).collect()))
}

fn question(name: &str) -> String {
    format!("\n\nWhat is the secret number for {name}? Reply with the number only.")
}

/// Runs every arm over every length; `on_record` sees each answer.
pub fn recall(model: &Arc<Model>, tok: &Arc<Tokenizer>, template: &ChatTemplate, spec: &EvictionSpec, mut on_record: impl FnMut(&RecallRecord)) -> Result<Vec<RecallRecord>, LabError> {
    let longest = spec.lengths.iter().copied().max().unwrap_or(0) + 256 + spec.max_tokens;
    let arms = spec.arms();
    let mut out = Vec::new();
    for &length in &spec.lengths {
        let (hay, placed) = haystack(tok, length, spec.needles, spec.seed)?;
        for &arm in &arms {
            let config = EngineConfig {
                block_size: BLOCK_SIZE,
                num_blocks: longest.div_ceil(BLOCK_SIZE) + 4,
                max_batch_tokens: 512,
                max_running: 1,
                max_waiting: 4,
                max_model_len: longest,
                prefix_caching: true,
                kv_dtypes: spec.kv_dtypes,
                kv_window: arm.window().map(|window| KvWindow { window, sinks: spec.sinks }),
                sparse_attention: spec.sparse.filter(|_| matches!(arm, Arm::Sparse(_))),
                ..EngineConfig::default()
            };
            let engine = spawn(model.clone(), tok.clone(), config);
            let head = template_head(tok, template)?;
            for (i, (name, number, byte)) in placed.iter().enumerate() {
                let user = format!("{hay}{}", question(name));
                let prompt = tok.encode(&template.render(&[ChatMessage::new("user", &user)], true)?, true, true)?;
                // the needle's position: the template's head, then the haystack before it
                let needle_pos = head + tok.encode(&hay[..*byte], false, false)?.len();
                let (_, events) = engine.submit(GenerateParams::greedy(prompt.clone(), spec.max_tokens)).map_err(|e| LabError::Request(e.to_string()))?;
                let done = Completion::wait(events).map_err(LabError::Request)?;
                let r = RecallRecord {
                    kv_dtype: spec.kv_dtypes.name(),
                    length,
                    window: arm.window(),
                    sparse: arm.sparse(),
                    sinks: match arm {
                        Arm::Full => 0,
                        Arm::Window(_) => spec.sinks,
                        Arm::Sparse(_) => spec.sparse.map_or(0, |s| s.sinks),
                    },
                    needle: i,
                    prompt_tokens: prompt.len(),
                    needle_pos,
                    distance_from_end: prompt.len().saturating_sub(needle_pos),
                    expected: number.clone(),
                    correct: done.text.contains(number.as_str()),
                    reply: done.text.trim().to_string(),
                    prefill_ms: done.timings.time_to_first_token.as_secs_f64() * 1e3,
                };
                on_record(&r);
                out.push(r);
            }
        }
    }
    Ok(out)
}

/// Tokens of the rendered prompt before the user's text starts.
fn template_head(tok: &Tokenizer, template: &ChatTemplate) -> reckon_engine::Result<usize> {
    let marked = template.render(&[ChatMessage::new("user", "\u{1}")], true)?;
    let head = marked.split('\u{1}').next().unwrap_or("");
    Ok(tok.encode(head, true, true)?.len())
}

/// Teacher-forces `tokens` through full KV and each window, with its sinks and without; scores the
/// positions past the largest window (and its sink blocks).
pub fn fluency(model: &Model, tokens: &[u32], windows: &[usize], sinks: usize, sparse: Option<SparseAttention>) -> Vec<FluencyRecord> {
    let from = windows.iter().map(|&w| KvWindow { window: w, sinks }.sink_end(BLOCK_SIZE) + w + BLOCK_SIZE).max().unwrap_or(0).min(tokens.len().saturating_sub(1));
    let mut arms: Vec<Attention> = vec![Attention::Full];
    for &w in windows {
        arms.push(Attention::Window(KvWindow { window: w, sinks }));
        if sinks > 0 {
            arms.push(Attention::Window(KvWindow { window: w, sinks: 0 }));
        }
    }
    arms.extend(sparse.map(Attention::Sparse));
    arms.into_iter()
        .map(|attention| {
            let (mut sum, mut n, mut pos) = (0f64, 0usize, 0usize);
            model.for_each_logits_with(tokens, 512, attention, |row| {
                if pos >= from && pos + 1 < tokens.len() {
                    sum += crate::kv::log_sum_exp(row) - row[tokens[pos + 1] as usize] as f64;
                    n += 1;
                }
                pos += 1;
            });
            let mean = sum / n.max(1) as f64;
            let (window, sparse) = (attention.window(), attention.sparse());
            let sinks = window.map(|w| w.sinks).or(sparse.map(|s| s.sinks)).unwrap_or(0);
            FluencyRecord { window: window.map(|w| w.window), sparse: sparse.map(|s| s.budget), sinks, from, tokens: tokens.len(), mean_nll: mean, perplexity: mean.exp() }
        })
        .collect()
}

impl Arm {
    fn window(self) -> Option<usize> {
        match self {
            Arm::Window(w) => Some(w),
            _ => None,
        }
    }

    fn sparse(self) -> Option<usize> {
        match self {
            Arm::Sparse(b) => Some(b),
            _ => None,
        }
    }

    fn of(window: Option<usize>, sparse: Option<usize>) -> Arm {
        match (window, sparse) {
            (Some(w), _) => Arm::Window(w),
            (None, Some(b)) => Arm::Sparse(b),
            (None, None) => Arm::Full,
        }
    }
}

fn arm_name(arm: Arm, sinks: usize, sparse: Option<SparseAttention>) -> String {
    match arm {
        Arm::Full => "full KV".into(),
        Arm::Window(w) => format!("window {w} + {sinks} sinks"),
        Arm::Sparse(b) => format!("sparse {b} + {} local + {} sinks", sparse.map_or(0, |s| s.local), sparse.map_or(0, |s| s.sinks)),
    }
}

/// The recall table (k of n per length and arm), the KV memory a sequence holds, where each window's
/// recall collapses, and the fluency table.
pub fn markdown(model: &Model, spec: &EvictionSpec, records: &[RecallRecord], fluency: &[FluencyRecord]) -> String {
    let mut out = String::new();
    let arms = spec.arms();
    let bpt = spec.kv_dtypes.bytes_per_token(model.config.n_layers, model.config.kv_dim());
    let recalled = |arm: Arm, length: usize| records.iter().filter(|r| Arm::of(r.window, r.sparse) == arm && r.length == length && r.correct).count();
    let prompt_len = |length: usize| records.iter().find(|r| r.length == length).map_or(length, |r| r.prompt_tokens);
    let _ = writeln!(out, "Needle recall: {} needles per haystack, greedy, exact number in the reply; KV memory one sequence holds at the end of its prompt ({}).\n", spec.needles, spec.kv_dtypes.name());
    let _ = write!(out, "| arm |");
    for &l in &spec.lengths {
        let _ = write!(out, " {} tokens |", prompt_len(l));
    }
    let _ = write!(out, "\n|---|");
    for _ in &spec.lengths {
        let _ = write!(out, "---|");
    }
    out.push('\n');
    for &arm in &arms {
        let _ = write!(out, "| {} |", arm_name(arm, spec.sinks, spec.sparse));
        for &l in &spec.lengths {
            let len = prompt_len(l);
            // (sparse attention keeps every block, and its key bounds besides: not counted here)
            let held = match arm {
                Arm::Full | Arm::Sparse(_) => len.div_ceil(BLOCK_SIZE),
                Arm::Window(w) => KvWindow { window: w, sinks: spec.sinks }.held_blocks(len, BLOCK_SIZE),
            } * BLOCK_SIZE;
            let _ = write!(out, " {}/{} ({:.1} MiB) |", recalled(arm, l), spec.needles, (held * bpt) as f64 / (1 << 20) as f64);
        }
        out.push('\n');
    }
    out.push('\n');
    for &w in &spec.windows {
        let full_ok = |l: usize| recalled(Arm::Full, l);
        match spec.lengths.iter().find(|&&l| recalled(Arm::Window(w), l) < full_ok(l)) {
            Some(&l) => {
                let _ = writeln!(
                    out,
                    "- window {w}: recall falls below full KV's at {} prompt tokens ({:.1}x the window): {}/{} against {}/{}; the needles recalled are those within the last {w} positions.",
                    prompt_len(l),
                    prompt_len(l) as f64 / w as f64,
                    recalled(Arm::Window(w), l),
                    spec.needles,
                    full_ok(l),
                    spec.needles
                );
            }
            None => {
                let _ = writeln!(out, "- window {w}: recall equals full KV's at every length measured.");
            }
        }
    }
    if let Some(sp) = spec.sparse {
        let arm = Arm::Sparse(sp.budget);
        let (got, full) = spec.lengths.iter().map(|&l| (recalled(arm, l), recalled(Arm::Full, l))).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        // sinks, picks and the local blocks, whole, and the query's own block up to itself
        let most = (sp.sinks.div_ceil(BLOCK_SIZE) + sp.budget.div_ceil(BLOCK_SIZE) + sp.local.div_ceil(BLOCK_SIZE) + 1) * BLOCK_SIZE;
        let _ = writeln!(out, "- {}: {got} needles recalled over all lengths, full KV {full}; a query reads at most {most} positions.", arm_name(arm, 0, spec.sparse));
    }
    let within = records.iter().filter(|r| r.window.is_some_and(|w| r.distance_from_end + 8 <= w)).collect::<Vec<_>>();
    let outside = records.iter().filter(|r| r.window.is_some_and(|w| r.distance_from_end > w + BLOCK_SIZE)).collect::<Vec<_>>();
    let _ = writeln!(
        out,
        "- under a window, needles inside it: {}/{} recalled; needles behind it: {}/{}.",
        within.iter().filter(|r| r.correct).count(),
        within.len(),
        outside.iter().filter(|r| r.correct).count(),
        outside.len()
    );
    if !fluency.is_empty() {
        let f = &fluency[0];
        let _ = writeln!(out, "\nFluency past the window: teacher-forced text of {} tokens, positions {}..{} scored (every window has dropped tokens there), over f16 KV whatever the recall's KV dtype (`reckon lab kv-quant` scores the quantized formats).\n", f.tokens, f.from, f.tokens);
        let _ = writeln!(out, "| arm | mean NLL | perplexity |\n|---|---|---|");
        for f in fluency {
            let _ = writeln!(out, "| {} | {:.4} | {:.3} |", arm_name(Arm::of(f.window, f.sparse), f.sinks, spec.sparse), f.mean_nll, f.perplexity);
        }
    }
    out
}

/// Recall (k of n) against prompt length, one line per arm, as an SVG.
pub fn plot(spec: &EvictionSpec, records: &[RecallRecord], title: &str, path: &std::path::Path) -> Result<(), LabError> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| LabError::Plot(e.to_string());
    let root = SVGBackend::new(path, (800, 450)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let xmax = records.iter().map(|r| r.prompt_tokens).max().unwrap_or(1) as f64 * 1.05;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(35)
        .y_label_area_size(45)
        .build_cartesian_2d(0.0..xmax, 0.0..spec.needles as f64 + 0.5)
        .map_err(|e| err(&e))?;
    chart.configure_mesh().x_desc("prompt tokens").y_desc("needles recalled").draw().map_err(|e| err(&e))?;
    let colors = [BLACK, RED, BLUE, GREEN, MAGENTA, CYAN];
    for (i, arm) in spec.arms().into_iter().enumerate() {
        let color = colors[i % colors.len()];
        let pts: Vec<(f64, f64)> = spec
            .lengths
            .iter()
            .filter_map(|&l| {
                let sel: Vec<&RecallRecord> = records.iter().filter(|r| Arm::of(r.window, r.sparse) == arm && r.length == l).collect();
                (!sel.is_empty()).then(|| (sel[0].prompt_tokens as f64, sel.iter().filter(|r| r.correct).count() as f64))
            })
            .collect();
        chart.draw_series(LineSeries::new(pts.clone(), color.stroke_width(2))).map_err(|e| err(&e))?.label(arm_name(arm, spec.sinks, spec.sparse)).legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color));
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled()))).map_err(|e| err(&e))?;
        if let Arm::Window(w) = arm {
            chart.draw_series(DashedLineSeries::new([(w as f64, 0.0), (w as f64, spec.needles as f64 + 0.5)], 4, 4, color.stroke_width(1))).map_err(|e| err(&e))?;
        }
    }
    chart.configure_series_labels().position(SeriesLabelPosition::LowerLeft).border_style(BLACK).background_style(WHITE).draw().map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}
