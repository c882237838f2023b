//! `reckon lab spec`: what speculative decoding (`--spec ngram|draft|auto`, `engine::spec`) buys on this
//! machine, per workload, proposer and draft length k, against no speculation in the same run.
//!
//! Workloads, generated from a fixed seed (`workloads`), as chat prompts through the model's template:
//! - `code_edit`: a ~150-line Python file and "rename one function, output the whole file": the answer
//!   is mostly the prompt, where prompt lookup pays most;
//! - `quote`: an article of seeded sentences and "summarise it, quoting three sentences verbatim";
//! - `json`: seeded records in prose and "extract them as a JSON list";
//! - `chat`: a free question, where the output rarely repeats anything.
//!
//! Each pass visits every (workload, k) once, the k order reversed on odd passes; each visit sends
//! `streams` copies of the request at once (greedy, `max_tokens`; one engine per k, its prefix cache on,
//! so a prompt is prefilled once per engine and the passes time decoding) and times the decode: output tokens after each stream's first over the span from the first
//! stream's first token to the last stream's last. k = 0 is no speculation. Every output is compared
//! with k = 0's (greedy speculation must not change a token). Recorded per visit: tokens/s, guesses
//! drafted and kept, the steps that carried guesses, the share of the engine's step time the draft
//! model took, and the engine's own fitted step cost T(k+1)/T(1) (`spec::Controller`, read from
//! `EngineStats` after the visit).

use crate::stats::{summarize, Summary};
use crate::LabError;
use reckon_engine::engine::spec::SpecConfig;
use reckon_engine::engine::{spawn_with_draft, Completion, EngineConfig, EngineHandle, GenerateParams};
use reckon_engine::model::Model;
use reckon_engine::sampler::Rng;
use reckon_engine::template::{ChatMessage, ChatTemplate};
use reckon_engine::tokenizer::Tokenizer;
use serde::Serialize;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone)]
pub struct SpecLabSpec {
    /// Draft lengths; 0 (no speculation) is the baseline and always measured.
    pub ks: Vec<usize>,
    /// Also the controller (`--spec auto`) with at most this many guesses per step.
    pub auto_k: Option<usize>,
    pub workloads: Vec<String>,
    pub streams: Vec<usize>,
    pub passes: usize,
    pub max_tokens: usize,
    pub seed: u64,
    pub min_n: usize,
    pub max_n: usize,
    /// A draft model (same vocabulary): `draft_ks` are its fixed draft lengths, and the controller's arm
    /// may use it.
    pub draft: Option<Arc<Model>>,
    pub draft_ks: Vec<usize>,
}

/// Who guesses in an arm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Proposer {
    None,
    Ngram,
    Draft,
    /// The controller (`--spec auto`): n-gram guesses, the draft model's where none matches.
    Auto,
}

impl Proposer {
    pub fn label(self, k: usize) -> String {
        match self {
            Proposer::None => "0".into(),
            Proposer::Ngram => format!("ngram {k}"),
            Proposer::Draft => format!("draft {k}"),
            Proposer::Auto => format!("auto (≤ {k})"),
        }
    }
}

/// One (pass, workload, streams, k) visit.
#[derive(Clone, Debug, Serialize)]
pub struct SpecRecord {
    pub pass: usize,
    pub workload: String,
    pub streams: usize,
    pub k: usize,
    /// The controller chose how many of the k guesses to carry (`--spec auto`).
    pub auto: bool,
    pub proposer: Proposer,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub decode_tokens_per_s: f64,
    pub drafted: usize,
    pub accepted: usize,
    /// Steps that carried guesses (the mean accepted length is `accepted / steps_with_guesses`).
    pub steps_with_guesses: u64,
    /// Of the engine's step time during the visit, the draft model's share.
    pub draft_share: f64,
    /// The engine's fitted step cost after the visit: T(k+1)/T(1) (`spec::Controller`), and the draft
    /// model's pass of one token over T(1).
    pub step_cost_ratio: f64,
    pub draft_step_ratio: f64,
    /// Every stream's output equals k = 0's in the same pass.
    pub identical: bool,
    /// The first stream's text, on k = 0's records (what the guesses were checked against).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
}

/// The workload's user message, from `seed`.
pub fn workload(name: &str, seed: u64) -> Option<String> {
    let mut rng = Rng::new(seed ^ name.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64)));
    fn pick_from(rng: &mut Rng, xs: &[&'static str]) -> &'static str {
        xs[(rng.next_u64() % xs.len() as u64) as usize]
    }
    const NOUNS: [&str; 16] = ["order", "invoice", "sensor", "reading", "user", "session", "packet", "route", "tile", "shard", "ticket", "batch", "frame", "record", "token", "window"];
    const VERBS: [&str; 12] = ["load", "parse", "merge", "filter", "score", "encode", "split", "sum", "check", "clean", "group", "rank"];
    const PLACES: [&str; 10] = ["Lisbon", "Osaka", "Quito", "Tromsø", "Accra", "Perth", "Lyon", "Hanoi", "Tucson", "Riga"];
    const NAMES: [&str; 12] = ["Ada", "Bruno", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kemal", "Lena"];
    Some(match name {
        "code_edit" => {
            let mut file = String::from("import math\n\n");
            let mut first = None;
            while file.lines().count() < 150 {
                let (v, n) = (pick_from(&mut rng, &VERBS), pick_from(&mut rng, &NOUNS));
                let (lim, c) = (10 + rng.next_u64() % 90, rng.next_u64() % 7);
                let f = format!("{v}_{n}s");
                first.get_or_insert(f.clone());
                let _ = write!(
                    file,
                    "def {f}(items, limit={lim}):\n    \"\"\"{v} every {n} up to the limit.\"\"\"\n    out = []\n    for i, item in enumerate(items):\n        if i >= limit:\n            break\n        value = item.get(\"{n}\", 0)\n        out.append(math.sqrt(abs(value)) + {c})\n    return out\n\n\n",
                );
            }
            let old = first.expect("a function");
            format!("Rename the function `{old}` to `{old}_v2` in this file. Output the whole file, changed, and nothing else.\n\n```python\n{file}```")
        }
        "quote" => {
            let mut text = String::new();
            for i in 0..30 {
                let (who, a, b, v) = (pick_from(&mut rng, &NAMES), pick_from(&mut rng, &NOUNS), pick_from(&mut rng, &NOUNS), pick_from(&mut rng, &VERBS));
                let _ = write!(text, "In {}, {who} recorded that the {a} {b} had to {v} twice before noon. ", 1990 + i);
            }
            format!("Summarise this report in three sentences, then quote its three most important sentences verbatim, each on its own line.\n\n{text}")
        }
        "json" => {
            let mut text = String::new();
            for _ in 0..20 {
                let (name, age) = (pick_from(&mut rng, &NAMES), 20 + rng.next_u64() % 50);
                let _ = write!(text, "{name} is {age} years old and lives in {}. ", pick_from(&mut rng, &PLACES));
            }
            format!("Extract every person below as a JSON list of objects with the keys \"name\", \"age\" and \"city\". Output only the JSON.\n\n{text}")
        }
        "chat" => {
            let (a, v, b) = (pick_from(&mut rng, &NOUNS), pick_from(&mut rng, &VERBS), pick_from(&mut rng, &NOUNS));
            format!("Write a short story about a {a} who learns to {v} {b}s.")
        }
        _ => return None,
    })
}

pub const WORKLOADS: [&str; 4] = ["code_edit", "quote", "json", "chat"];

/// Runs the passes; `record` sees each visit as it is made.
pub fn run(model: &Arc<Model>, tokenizer: &Arc<Tokenizer>, template: &ChatTemplate, spec: &SpecLabSpec, mut record: impl FnMut(&SpecRecord)) -> Result<Vec<SpecRecord>, LabError> {
    // arms: (k, proposer)
    let mut ks: Vec<(usize, Proposer)> = vec![(0, Proposer::None)];
    ks.extend(spec.ks.iter().copied().filter(|&k| k > 0).map(|k| (k, Proposer::Ngram)));
    if spec.draft.is_some() {
        ks.extend(spec.draft_ks.iter().copied().filter(|&k| k > 0).map(|k| (k, Proposer::Draft)));
    }
    ks.extend(spec.auto_k.map(|k| (k, Proposer::Auto)));
    let prompts: Vec<(String, Vec<u32>)> = spec
        .workloads
        .iter()
        .map(|w| {
            let user = workload(w, spec.seed).ok_or_else(|| LabError::Request(format!("unknown workload {w}")))?;
            let text = template.render(&[ChatMessage::new("user", &user)], true).map_err(|e| LabError::Request(e.to_string()))?;
            Ok((w.clone(), tokenizer.encode(&text, true, true).map_err(|e| LabError::Request(e.to_string()))?))
        })
        .collect::<Result<_, LabError>>()?;
    let longest = prompts.iter().map(|p| p.1.len()).max().unwrap_or(0) + spec.max_tokens + 16;
    let max_streams = spec.streams.iter().copied().max().unwrap_or(1);
    let engines: Vec<EngineHandle> = ks
        .iter()
        .map(|&(k, proposer)| {
            let auto = proposer == Proposer::Auto;
            let with_draft = matches!(proposer, Proposer::Draft | Proposer::Auto) && spec.draft.is_some();
            let config = EngineConfig {
                block_size: 16,
                num_blocks: max_streams * longest.div_ceil(16) + 8,
                max_batch_tokens: 512,
                max_running: max_streams,
                max_waiting: max_streams,
                max_model_len: longest,
                prefix_caching: true,
                spec: (k > 0).then_some(SpecConfig { k, min_n: spec.min_n, max_n: spec.max_n, auto, draft: with_draft }),
                ..EngineConfig::default()
            };
            spawn_with_draft(model.clone(), spec.draft.clone().filter(|_| with_draft), tokenizer.clone(), config, None).map_err(|e| LabError::Request(e.to_string()))
        })
        .collect::<Result<_, _>>()?;
    let mut out = Vec::new();
    for pass in 0..spec.passes {
        for (w, prompt) in &prompts {
            for &streams in &spec.streams {
                let order: Vec<usize> = if pass % 2 == 0 { (0..ks.len()).collect() } else { (0..ks.len()).rev().collect() };
                let mut visits: Vec<(usize, Vec<Vec<u32>>, SpecRecord)> = Vec::new();
                for i in order {
                    let (ids, r) = visit(&engines[i], prompt, streams, spec.max_tokens, ks[i].0)?;
                    visits.push((i, ids, SpecRecord { pass, workload: w.clone(), streams, k: ks[i].0, auto: ks[i].1 == Proposer::Auto, proposer: ks[i].1, identical: true, ..r }));
                }
                let base = visits.iter().find(|v| v.0 == 0).map(|v| v.1.clone()).unwrap_or_default();
                visits.sort_by_key(|v| v.0);
                for (_, ids, mut r) in visits {
                    r.identical = ids == base;
                    if r.proposer == Proposer::None {
                        r.output = ids.first().map(|t| tokenizer.decode(t, false));
                    }
                    record(&r);
                    out.push(r);
                }
            }
        }
    }
    Ok(out)
}

/// `streams` copies of `prompt` at once; every stream's tokens, and the visit's figures.
fn visit(engine: &EngineHandle, prompt: &[u32], streams: usize, max_tokens: usize, k: usize) -> Result<(Vec<Vec<u32>>, SpecRecord), LabError> {
    use std::sync::atomic::Ordering::Relaxed;
    let st = engine.stats();
    let before = (st.spec_drafts.load(Relaxed), st.step_ns.load(Relaxed), st.draft_ns.load(Relaxed));
    let rxs: Vec<_> = (0..streams)
        .map(|_| engine.submit(GenerateParams { ignore_eos: true, ..GenerateParams::greedy(prompt.to_vec(), max_tokens) }).map(|r| r.1).map_err(|e| LabError::Request(e.to_string())))
        .collect::<Result<_, _>>()?;
    let results: Vec<(Completion, Vec<Instant>)> = std::thread::scope(|s| {
        let handles: Vec<_> = rxs
            .into_iter()
            .map(|rx| {
                s.spawn(move || {
                    let mut arrivals = Vec::new();
                    let c = Completion::wait_with(rx, |_, _| arrivals.push(Instant::now()));
                    c.map(|c| (c, arrivals))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a client thread").map_err(LabError::Request)).collect::<Result<Vec<_>, _>>()
    })?;
    let first = results.iter().filter_map(|r| r.1.first()).min().copied();
    let last = results.iter().filter_map(|r| r.1.last()).max().copied();
    let decoded: usize = results.iter().map(|r| r.1.len().saturating_sub(1)).sum();
    let secs = match (first, last) {
        (Some(a), Some(b)) if b > a => b.duration_since(a).as_secs_f64(),
        _ => f64::NAN,
    };
    let usage = |f: fn(&reckon_engine::engine::Usage) -> usize| results.iter().map(|r| f(&r.0.usage)).sum::<usize>();
    let (a, b, d1) = (st.step_cost_a_ns.load(Relaxed) as f64, st.step_cost_b_ns.load(Relaxed) as f64, st.draft_step_ns.load(Relaxed) as f64);
    let step_ns = st.step_ns.load(Relaxed).saturating_sub(before.1);
    let r = SpecRecord {
        pass: 0,
        workload: String::new(),
        streams,
        k: 0,
        auto: false,
        proposer: Proposer::None,
        steps_with_guesses: st.spec_drafts.load(Relaxed).saturating_sub(before.0),
        draft_share: if step_ns == 0 { 0.0 } else { st.draft_ns.load(Relaxed).saturating_sub(before.2) as f64 / step_ns as f64 },
        step_cost_ratio: if a + b > 0.0 { (a + b * (k + 1) as f64) / (a + b) } else { f64::NAN },
        draft_step_ratio: if a + b > 0.0 { d1 / (a + b) } else { f64::NAN },
        prompt_tokens: prompt.len(),
        output_tokens: usage(|u| u.completion_tokens),
        decode_tokens_per_s: decoded as f64 / secs,
        drafted: usage(|u| u.accepted_prediction_tokens + u.rejected_prediction_tokens),
        accepted: usage(|u| u.accepted_prediction_tokens),
        identical: true,
        output: None,
    };
    Ok((results.into_iter().map(|r| r.0.ids).collect(), r))
}

/// One (workload, streams, k) over the passes.
#[derive(Clone, Debug, Serialize)]
pub struct SpecRow {
    pub workload: String,
    pub streams: usize,
    pub k: usize,
    pub auto: bool,
    pub proposer: Proposer,
    /// Guesses kept per step that carried guesses.
    pub mean_accepted: f64,
    /// Medians over the passes: T(k+1)/T(1) and the draft model's share of the step time.
    pub step_cost_ratio: f64,
    pub draft_share: f64,
    pub tokens_per_s: Summary,
    /// Per pass, this k's decode rate over k = 0's in the same pass.
    pub speedup: Summary,
    pub acceptance: f64,
    pub identical: bool,
}

pub fn rows(records: &[SpecRecord]) -> Vec<SpecRow> {
    let mut keys: Vec<(String, usize, usize, Proposer)> = records.iter().map(|r| (r.workload.clone(), r.streams, r.k, r.proposer)).collect();
    keys.dedup();
    let mut seen = Vec::new();
    let mut out = Vec::new();
    for key in keys {
        if seen.contains(&key) {
            continue;
        }
        seen.push(key.clone());
        let (w, streams, k, proposer) = key;
        let auto = proposer == Proposer::Auto;
        let mine: Vec<&SpecRecord> = records.iter().filter(|r| r.workload == w && r.streams == streams && r.k == k && r.proposer == proposer).collect();
        let base = |pass: usize| records.iter().find(|r| r.workload == w && r.streams == streams && r.k == 0 && r.pass == pass);
        let speeds: Vec<f64> = mine.iter().map(|r| r.decode_tokens_per_s).collect();
        let ratios: Vec<f64> = mine.iter().filter_map(|r| base(r.pass).map(|b| r.decode_tokens_per_s / b.decode_tokens_per_s)).collect();
        let (drafted, accepted) = mine.iter().fold((0, 0), |(d, a), r| (d + r.drafted, a + r.accepted));
        let steps: u64 = mine.iter().map(|r| r.steps_with_guesses).sum();
        let median = |f: fn(&SpecRecord) -> f64| summarize(&mine.iter().map(|r| f(r)).filter(|x| x.is_finite()).collect::<Vec<_>>()).map_or(f64::NAN, |s| s.median);
        if let (Some(tokens_per_s), Some(speedup)) = (summarize(&speeds), summarize(&ratios)) {
            let acceptance = if drafted == 0 { 0.0 } else { accepted as f64 / drafted as f64 };
            let mean_accepted = if steps == 0 { 0.0 } else { accepted as f64 / steps as f64 };
            let (step_cost_ratio, draft_share) = (median(|r| r.step_cost_ratio), median(|r| r.draft_share));
            out.push(SpecRow { workload: w, streams, k, auto, proposer, mean_accepted, step_cost_ratio, draft_share, tokens_per_s, speedup, acceptance, identical: mine.iter().all(|r| r.identical) });
        }
    }
    out
}

pub fn markdown(rows: &[SpecRow]) -> String {
    let mut t = String::from("| workload | streams | k | decode tok/s, median (min-max) | over k = 0, median (min-max) | guesses kept | kept per step | T(k+1)/T(1) | drafting share | output = k 0's |\n|---|---|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        let (s, x) = (&r.tokens_per_s, &r.speedup);
        let dash = |show: bool, v: String| if show { v } else { "—".to_string() };
        let kept = dash(r.k > 0, format!("{:.0}%", 100.0 * r.acceptance));
        let per_step = dash(r.k > 0, format!("{:.2}", r.mean_accepted));
        let cost = dash(r.k > 0 && !r.auto && r.step_cost_ratio.is_finite(), format!("{:.2}", r.step_cost_ratio));
        let share = dash(matches!(r.proposer, Proposer::Draft | Proposer::Auto) && r.draft_share > 0.0, format!("{:.0}%", 100.0 * r.draft_share));
        let _ = writeln!(t, "| {} | {} | {} | {:.1} ({:.1}-{:.1}) | {:.2}x ({:.2}-{:.2}) | {kept} | {per_step} | {cost} | {share} | {} |", r.workload, r.streams, r.proposer.label(r.k), s.median, s.min, s.max, x.median, x.min, x.max, if r.identical { "yes" } else { "**no**" });
    }
    // the best k per (workload, streams)
    let _ = writeln!(t, "\nBest fixed arm (median speedup), the break-even (the largest fixed k of each proposer still at or above 1.00x), and the controller's:\n\n| workload | streams | best fixed | over k = 0 | break-even k | auto over k = 0 |\n|---|---|---|---|---|---|");
    let mut groups: Vec<(String, usize)> = rows.iter().map(|r| (r.workload.clone(), r.streams)).collect();
    groups.dedup();
    for (w, s) in groups {
        if let Some(best) = rows.iter().filter(|r| r.workload == w && r.streams == s && !r.auto).max_by(|a, b| a.speedup.median.total_cmp(&b.speedup.median)) {
            let auto = rows.iter().find(|r| r.workload == w && r.streams == s && r.auto).map_or("—".to_string(), |a| format!("{:.2}x ({:.2}-{:.2})", a.speedup.median, a.speedup.min, a.speedup.max));
            let even = |p: Proposer| rows.iter().filter(|r| r.workload == w && r.streams == s && r.proposer == p && r.speedup.median >= 1.0).map(|r| r.k).max();
            let mut breakeven: Vec<String> = Vec::new();
            for p in [Proposer::Ngram, Proposer::Draft] {
                if rows.iter().any(|r| r.workload == w && r.streams == s && r.proposer == p) {
                    breakeven.push(format!("{}: {}", if p == Proposer::Ngram { "ngram" } else { "draft" }, even(p).map_or("none".to_string(), |k| k.to_string())));
                }
            }
            let _ = writeln!(t, "| {w} | {s} | {} | {:.2}x | {} | {auto} |", best.proposer.label(best.k), best.speedup.median, breakeven.join(", "));
        }
    }
    t
}

/// Speedup over k = 0 against k, a line per (workload, streams).
pub fn plot(rows: &[SpecRow], title: &str, path: &std::path::Path) -> Result<(), LabError> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| LabError::Plot(e.to_string());
    let root = SVGBackend::new(path, (800, 450)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let kmax = rows.iter().map(|r| r.k).max().unwrap_or(1).max(1) as f64;
    let ymax = rows.iter().map(|r| r.speedup.max).fold(1.5, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(&root).caption(title, ("sans-serif", 16)).margin(12).x_label_area_size(35).y_label_area_size(50).build_cartesian_2d(0.0..kmax, 0.0..ymax).map_err(|e| err(&e))?;
    chart.configure_mesh().x_desc("k (most guesses per step)").y_desc("decode speed over no speculation").draw().map_err(|e| err(&e))?;
    let colors = [RED, BLUE, GREEN, MAGENTA, CYAN, BLACK];
    let mut groups: Vec<(String, usize)> = Vec::new();
    for r in rows {
        if !groups.contains(&(r.workload.clone(), r.streams)) {
            groups.push((r.workload.clone(), r.streams));
        }
    }
    for (i, (w, s)) in groups.iter().enumerate() {
        let color = colors[i % colors.len()];
        let line = |p: Proposer| -> Vec<(f64, f64)> { rows.iter().filter(|r| &r.workload == w && r.streams == *s && (r.proposer == p || r.proposer == Proposer::None)).map(|r| (r.k as f64, r.speedup.median)).collect() };
        chart.draw_series(LineSeries::new(line(Proposer::Ngram), color.stroke_width(2))).map_err(|e| err(&e))?.label(format!("{w}, {s} stream(s), ngram")).legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color));
        if rows.iter().any(|r| r.proposer == Proposer::Draft) {
            chart.draw_series(LineSeries::new(line(Proposer::Draft), color.stroke_width(1))).map_err(|e| err(&e))?.label(format!("{w}, {s} stream(s), draft model (thin)")).legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color));
        }
    }
    chart.draw_series(LineSeries::new([(0.0, 1.0), (kmax, 1.0)], BLACK.stroke_width(1))).map_err(|e| err(&e))?;
    chart.configure_series_labels().position(SeriesLabelPosition::UpperRight).border_style(BLACK).background_style(WHITE).draw().map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workloads_are_fixed_by_the_seed() {
        for w in WORKLOADS {
            assert_eq!(workload(w, 1), workload(w, 1));
            assert_ne!(workload(w, 1), workload(w, 2), "{w}");
        }
        let code = workload("code_edit", 1).unwrap();
        assert!(code.lines().count() >= 150, "{}", code.lines().count());
        assert!(workload("nope", 1).is_none());
    }

    #[test]
    fn rows_pair_each_pass_with_k_0() {
        let proposer = |k| if k == 0 { Proposer::None } else { Proposer::Ngram };
        let rec = |pass, k, tps| SpecRecord { pass, workload: "code_edit".into(), streams: 1, k, auto: false, proposer: proposer(k), prompt_tokens: 10, output_tokens: 64, decode_tokens_per_s: tps, drafted: 10 * k, accepted: 5 * k, steps_with_guesses: 10, draft_share: 0.0, step_cost_ratio: 1.2, draft_step_ratio: f64::NAN, identical: true, output: None };
        let records = vec![rec(0, 0, 100.0), rec(0, 4, 250.0), rec(1, 4, 180.0), rec(1, 0, 90.0)];
        let rows = rows(&records);
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[1].k, rows[1].speedup.median, rows[1].acceptance), (4, 2.25, 0.5));
        assert_eq!(rows[1].mean_accepted, 2.0);
        assert!(markdown(&rows).contains("| code_edit | 1 | ngram 4 | 2.25x | ngram: 4 | — |"), "{}", markdown(&rows));
    }
}
