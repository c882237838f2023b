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
}

#[derive(Clone, Debug, Serialize)]
pub struct NeedleRecord {
    pub pass: usize,
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
            let (hay, placed) = haystack(tok, length, spec.needles, spec.seed)?;
            for (i, (name, number, _)) in placed.iter().enumerate() {
                let user = format!("{hay}{}", question(name));
                let prompt = tok.encode(&template.render(&[ChatMessage::new("user", &user)], true)?, true, true)?;
                let order: Vec<usize> = if pass % 2 == 0 { (0..keeps.len()).collect() } else { (0..keeps.len()).rev().collect() };
                for a in order {
                    let st = engines[a].stats();
                    let before = (st.spec_prefill_dropped_tokens.load(Relaxed), st.spec_prefill_scoring_ns.load(Relaxed));
                    let (_, events) = engines[a].submit(GenerateParams::greedy(prompt.clone(), spec.max_tokens)).map_err(|e| LabError::Request(e.to_string()))?;
                    let done = Completion::wait(events).map_err(LabError::Request)?;
                    let r = NeedleRecord {
                        pass,
                        length,
                        keep: keeps[a],
                        needle: i,
                        prompt_tokens: prompt.len(),
                        dropped: st.spec_prefill_dropped_tokens.load(Relaxed) - before.0,
                        expected: number.clone(),
                        correct: done.text.contains(number.as_str()),
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
    Ok(out)
}

/// One (length, keep) over the passes and needles.
#[derive(Clone, Debug, Serialize)]
pub struct NeedleRow {
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
    let mut keys: Vec<(usize, u64)> = Vec::new();
    for r in records {
        if !keys.contains(&(r.length, r.keep.to_bits())) {
            keys.push((r.length, r.keep.to_bits()));
        }
    }
    keys.into_iter()
        .filter_map(|(length, keep)| {
            let mine: Vec<&NeedleRecord> = records.iter().filter(|r| r.length == length && r.keep.to_bits() == keep).collect();
            let full = |r: &NeedleRecord| records.iter().find(|f| f.length == length && f.keep == 1.0 && f.pass == r.pass && f.needle == r.needle);
            let ratios: Vec<f64> = mine.iter().filter_map(|r| full(r).map(|f| f.ttft_ms / r.ttft_ms)).collect();
            Some(NeedleRow {
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
    let mut t = String::from("| length | prompt tokens | keep | needles found | TTFT ms, median (min-max) | of it, scoring ms | full / this TTFT |\n|---|---|---|---|---|---|---|\n");
    for r in rows {
        let _ = writeln!(
            t,
            "| {} | {} | {} | {}/{} | {:.0} ({:.0}-{:.0}) | {:.0} | {:.2}x ({:.2}-{:.2}) |",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_pair_each_request_with_the_full_prefill() {
        let rec = |pass, keep, needle, ttft, correct| NeedleRecord { pass, length: 2048, keep, needle, prompt_tokens: 2100, dropped: 0, expected: "1".into(), reply: "1".into(), correct, ttft_ms: ttft, scoring_ms: 10.0 };
        let records = vec![rec(0, 1.0, 0, 1000.0, true), rec(0, 0.2, 0, 250.0, true), rec(0, 1.0, 1, 900.0, true), rec(0, 0.2, 1, 300.0, false)];
        let rows = rows(&records);
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[1].correct, rows[1].asked, rows[1].speedup.median), (1, 2, 3.5));
        assert!(markdown(&rows).contains("| 2048 | 2100 | 0.2 | 1/2 |"), "{}", markdown(&rows));
    }
}
