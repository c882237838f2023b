//! `reckon lab kv-quant`: what storing the KV cache quantized does to speed, memory and quality, on this
//! machine, each KV dtype against f16 in the same run.
//!
//! Speed: one engine per dtype, all holding the same seeded random context in their prefix caches; each
//! pass visits every (depth, dtype) once, the dtypes' order reversed on odd passes (A B C, C B A, ...),
//! and times a decode of `n_gen` tokens after the depth and a prefill of `n_prompt` fresh tokens after
//! it (as `reckon bench`'s tg and pp at depth). After the last pass the first arm runs again: a change of
//! over 5% from its first pass flags a host that changed speed during the run (the ratios are still from
//! interleaved passes, but the absolute figures are suspect).
//!
//! Quality: a text, teacher-forced through every dtype in lockstep (chunks of `chunk` tokens, each arm its
//! own KV cache): per position, whether the top-1 token equals f16's and KL(f16 ‖ dtype) of the next-token
//! distributions.

use crate::bench::{random_tokens, NoText};
use crate::stats::{summarize, Summary};
use crate::LabError;
use reckon_engine::engine::{spawn, Completion, EngineConfig, EngineHandle, GenerateParams};
use reckon_engine::kv::{KvDtype, KvDtypes};
use reckon_engine::model::{LogitsWanted, Model, Scratch, SeqInput};
use reckon_engine::sampler::Rng;
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

const BLOCK_SIZE: usize = 16;

/// A top-2 logit gap that two implementations of the same arithmetic precision do not flip: reckon's two
/// numerics and llama.cpp's two modes disagree only below 0.5 (docs/correctness.md).
pub const CLEAR_GAP: f32 = 1.0;

#[derive(Clone, Debug)]
pub struct KvQuantSpec {
    /// The arms; the first is the baseline (f16).
    pub dtypes: Vec<KvDtypes>,
    /// Context depths, each a multiple of the block size (or 0).
    pub depths: Vec<usize>,
    pub passes: usize,
    pub n_gen: usize,
    pub n_prompt: usize,
    /// Tokens per prefill step.
    pub chunk: usize,
}

/// One timed measurement.
#[derive(Clone, Debug, Serialize)]
pub struct SpeedRecord {
    pub pass: usize,
    pub kv_dtype: String,
    pub depth: usize,
    /// "tg" (decode) or "pp" (prefill).
    pub test: &'static str,
    pub tokens: usize,
    pub tokens_per_s: f64,
    /// The drift check's repeat of the first arm.
    pub drift_check: bool,
}

/// One dtype's agreement with the baseline over the teacher-forced text.
#[derive(Clone, Debug, Serialize)]
pub struct QualityRecord {
    pub kv_dtype: String,
    pub positions: usize,
    pub top1_agree: usize,
    pub top1_agreement: f64,
    /// Positions where the baseline's top-2 logit gap is at least `CLEAR_GAP` (not a near-tie), and how
    /// many of them keep the baseline's top-1.
    pub clear_positions: usize,
    pub clear_agree: usize,
    pub mean_kl: f64,
    pub max_kl: f64,
}

/// KV bytes of one token of `model` with `dtypes` cells.
pub fn kv_bytes_per_token(model: &Model, dtypes: KvDtypes) -> usize {
    dtypes.bytes_per_token(model.config.n_layers, model.config.kv_dim())
}

/// Runs the speed passes; `record` sees each measurement as it is made.
pub fn speed(model: &Arc<Model>, spec: &KvQuantSpec, record: impl FnMut(&SpeedRecord)) -> Result<Vec<SpeedRecord>, LabError> {
    speed_with(model, spec, record, None)
}

/// A second implementation's arms, measured inside the same passes: given the pass number, one pass of
/// its own (every depth and arm), as records named `"<implementation> <arm>"`.
pub type ExternalPass<'a> = &'a mut dyn FnMut(usize) -> Result<Vec<SpeedRecord>, LabError>;

/// The prefix of an external implementation's arm names (`"llama.cpp f16"`): its rows are compared with
/// its own f16 arm.
pub const LLAMACPP: &str = "llama.cpp ";

/// `speed` with `external`'s pass after reckon's on even passes and before it on odd ones.
pub fn speed_with(model: &Arc<Model>, spec: &KvQuantSpec, record: impl FnMut(&SpeedRecord), mut external: Option<ExternalPass>) -> Result<Vec<SpeedRecord>, LabError> {
    let mut runner = SpeedRunner::new(model, spec)?;
    // (both reckon's measurements and the external pass report through it)
    let record = std::cell::RefCell::new(record);
    let mut out = Vec::new();
    let mut other = |pass: usize, out: &mut Vec<SpeedRecord>| -> Result<(), LabError> {
        if let Some(f) = external.as_mut() {
            for r in f(pass)? {
                (record.borrow_mut())(&r);
                out.push(r);
            }
        }
        Ok(())
    };
    let mut theirs = Vec::new();
    for pass in 0..spec.passes {
        if pass % 2 == 1 {
            other(pass, &mut theirs)?;
        }
        out.extend(runner.pass(pass, |r| (record.borrow_mut())(r))?);
        if pass % 2 == 0 {
            other(pass, &mut theirs)?;
        }
    }
    out.extend(runner.drift_check(spec.passes, |r| (record.borrow_mut())(r))?);
    out.extend(theirs);
    Ok(out)
}

/// The speed passes' engines (one per arm, each holding the seeded context in its prefix cache), for
/// `speed_with` and for a second process measuring the same arms at another SIMD level
/// (`reckon lab kv-quant --serve-passes`).
pub struct SpeedRunner {
    spec: KvQuantSpec,
    engines: Vec<EngineHandle>,
    context: Vec<u32>,
    vocab: usize,
    rng: Rng,
}

impl SpeedRunner {
    /// Starts the engines and fills their caches (with one untimed warm-up of each test).
    pub fn new(model: &Arc<Model>, spec: &KvQuantSpec) -> Result<SpeedRunner, LabError> {
        let vocab = model.config.vocab_size;
        let max_depth = spec.depths.iter().copied().max().unwrap_or(0);
        let mut rng = Rng::new(1234);
        let context = random_tokens(&mut rng, max_depth.max(BLOCK_SIZE), vocab);
        let per_run = spec.n_prompt.max(spec.n_gen + 2) + BLOCK_SIZE;
        let config = |kv_dtypes| EngineConfig {
            block_size: BLOCK_SIZE,
            num_blocks: (max_depth + 8 * per_run).div_ceil(BLOCK_SIZE) + 4,
            max_batch_tokens: spec.chunk.max(1),
            max_running: 1,
            max_waiting: 1,
            max_model_len: max_depth + per_run + 1,
            prefix_caching: true,
            kv_dtypes,
            ..EngineConfig::default()
        };
        let engines: Vec<EngineHandle> = spec.dtypes.iter().map(|&d| spawn(model.clone(), Arc::new(NoText), config(d))).collect();
        let mut runner = SpeedRunner { spec: spec.clone(), engines, context, vocab, rng };
        for i in 0..runner.engines.len() {
            generate(&runner.engines[i], runner.context.clone(), 2)?;
            let prompt = [runner.context.as_slice(), &random_tokens(&mut runner.rng, spec.n_prompt.max(1), vocab)].concat();
            generate(&runner.engines[i], prompt, 1)?;
        }
        Ok(runner)
    }

    /// One pass: every depth, every arm (reversed on odd passes).
    pub fn pass(&mut self, pass: usize, mut record: impl FnMut(&SpeedRecord)) -> Result<Vec<SpeedRecord>, LabError> {
        let mut out = Vec::new();
        for depth in self.spec.depths.clone() {
            let arms: Vec<usize> = if pass % 2 == 0 { (0..self.engines.len()).collect() } else { (0..self.engines.len()).rev().collect() };
            for arm in arms {
                out.extend(self.measure(pass, arm, depth, false, &mut record)?);
            }
        }
        Ok(out)
    }

    /// The first arm at the first depth once more, as the drift check.
    pub fn drift_check(&mut self, pass: usize, mut record: impl FnMut(&SpeedRecord)) -> Result<Vec<SpeedRecord>, LabError> {
        match self.spec.depths.first() {
            Some(&depth) => self.measure(pass, 0, depth, true, &mut record),
            None => Ok(Vec::new()),
        }
    }

    fn measure(&mut self, pass: usize, arm: usize, depth: usize, drift_check: bool, record: &mut impl FnMut(&SpeedRecord)) -> Result<Vec<SpeedRecord>, LabError> {
        let (engine, name, spec) = (&self.engines[arm], self.spec.dtypes[arm].name(), &self.spec);
        let mut out = Vec::new();
        let start = if depth == 0 { vec![1] } else { self.context[..depth].to_vec() };
        if spec.n_gen > 0 {
            let (_, arrivals) = generate(engine, start.clone(), spec.n_gen + 1)?;
            let secs = arrivals[spec.n_gen].duration_since(arrivals[0]).as_secs_f64();
            let r = SpeedRecord { pass, kv_dtype: name.clone(), depth, test: "tg", tokens: spec.n_gen, tokens_per_s: spec.n_gen as f64 / secs, drift_check };
            record(&r);
            out.push(r);
        }
        if spec.n_prompt > 0 {
            let prompt = [&self.context[..depth], &random_tokens(&mut self.rng, spec.n_prompt, self.vocab)].concat();
            let (done, _) = generate(engine, prompt, 1)?;
            let secs = done.timings.time_to_first_token.as_secs_f64();
            let r = SpeedRecord { pass, kv_dtype: name, depth, test: "pp", tokens: spec.n_prompt, tokens_per_s: spec.n_prompt as f64 / secs, drift_check };
            record(&r);
            out.push(r);
        }
        Ok(out)
    }
}

/// A greedy generation of `n` tokens and each token's arrival.
fn generate(engine: &EngineHandle, prompt: Vec<u32>, n: usize) -> Result<(Completion, Vec<Instant>), LabError> {
    let params = GenerateParams { ignore_eos: true, ..GenerateParams::greedy(prompt, n) };
    let (_, events) = engine.submit(params).map_err(|e| LabError::Request(e.to_string()))?;
    let mut arrivals = Vec::with_capacity(n);
    let done = Completion::wait_with(events, |_, _| arrivals.push(Instant::now())).map_err(LabError::Request)?;
    Ok((done, arrivals))
}

/// Teacher-forces `tokens` through every arm in lockstep and compares each with the first.
pub fn quality(model: &Model, tokens: &[u32], chunk: usize, dtypes: &[KvDtypes]) -> Vec<QualityRecord> {
    let vocab = model.config.vocab_size;
    let blocks = tokens.len().div_ceil(BLOCK_SIZE).max(1);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut arms: Vec<(reckon_engine::kv::KvStorage, Scratch)> = dtypes.iter().map(|&d| (model.new_kv_with(d, BLOCK_SIZE, blocks), Scratch::default())).collect();
    // per arm: top-1 agreements, KL sum, KL max, agreements at clear positions
    let mut stats = vec![(0usize, 0.0f64, 0.0f64, 0usize); dtypes.len()];
    let mut clear = 0;
    let mut base: Vec<f32> = Vec::new();
    let mut base_lp = vec![0f64; vocab];
    for (i, part) in tokens.chunks(chunk.max(1)).enumerate() {
        // one sequence: a hybrid model's state slot 0 of each arm's storage
        let state = model.config.short_conv.as_ref().map(|_| 0);
        let input = SeqInput { tokens: part, start_pos: i * chunk.max(1), block_tables: std::slice::from_ref(&table), logits: LogitsWanted::All, state };
        for (a, (kv, scratch)) in arms.iter_mut().enumerate() {
            let logits = model.forward(std::slice::from_ref(&input), kv, scratch);
            if a == 0 {
                base.clear();
                base.extend_from_slice(logits);
                continue;
            }
            for (row, b) in logits.chunks_exact(vocab).zip(base.chunks_exact(vocab)) {
                log_softmax(b, &mut base_lp);
                let top_b = argmax(b);
                let second = b.iter().enumerate().filter(|&(i, _)| i != top_b).map(|(_, &x)| x).fold(f32::NEG_INFINITY, f32::max);
                let is_clear = b[top_b] - second >= CLEAR_GAP;
                clear += usize::from(is_clear && a == 1);
                let kl = kl_from(&base_lp, row);
                let s = &mut stats[a];
                let agree = argmax(row) == top_b;
                s.0 += usize::from(agree);
                s.1 += kl;
                s.2 = s.2.max(kl);
                s.3 += usize::from(agree && is_clear);
            }
        }
    }
    dtypes
        .iter()
        .zip(&stats)
        .enumerate()
        .map(|(a, (d, &(agree, kl_sum, kl_max, clear_agree)))| {
            let (agree, clear_agree) = if a == 0 { (tokens.len(), clear) } else { (agree, clear_agree) };
            QualityRecord {
                kv_dtype: d.name(),
                positions: tokens.len(),
                top1_agree: agree,
                top1_agreement: agree as f64 / tokens.len() as f64,
                clear_positions: clear,
                clear_agree,
                mean_kl: kl_sum / tokens.len() as f64,
                max_kl: kl_max,
            }
        })
        .collect()
}

fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |best, (i, &x)| if x > best.1 { (i, x) } else { best }).0
}

/// ln Σ exp(logits), in f64 (a row's log-normalizer).
pub(crate) fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln()
}

fn log_softmax(row: &[f32], out: &mut [f64]) {
    let lse = log_sum_exp(row);
    for (o, &x) in out.iter_mut().zip(row) {
        *o = x as f64 - lse;
    }
}

/// KL(p ‖ q) with p given as log-probabilities and q as logits.
fn kl_from(log_p: &[f64], q_logits: &[f32]) -> f64 {
    let lse = log_sum_exp(q_logits);
    log_p.iter().zip(q_logits).map(|(&lp, &x)| lp.exp() * (lp - (x as f64 - lse))).sum::<f64>().max(0.0)
}

/// One (dtype, depth, test) over the passes.
#[derive(Clone, Debug, Serialize)]
pub struct SpeedRow {
    pub kv_dtype: String,
    pub depth: usize,
    pub test: &'static str,
    pub tokens_per_s: Summary,
    /// Median over the passes of this arm's speed over the baseline's in the same pass.
    pub ratio: Summary,
}

/// Rows of every arm in `arms` (reckon's first, then other implementations' or SIMD levels', if any),
/// each against its own implementation's first arm in the same pass (reckon's f16, `"llama.cpp f16"`,
/// `"avx2 f16"`).
pub fn speed_rows(records: &[SpeedRecord], arms: &[String], depths: &[usize]) -> Vec<SpeedRow> {
    let mut rows = Vec::new();
    fn timed<'a>(records: &'a [SpeedRecord], d: &'a str, depth: usize, test: &'a str) -> impl Iterator<Item = &'a SpeedRecord> {
        records.iter().filter(move |r| !r.drift_check && r.kv_dtype == d && r.depth == depth && r.test == test)
    }
    let base_of = |name: &str| -> String { arms.iter().find(|a| implementation(a) == implementation(name)).cloned().unwrap_or_default() };
    for test in ["tg", "pp"] {
        for &depth in depths {
            for name in arms {
                let base = base_of(name);
                let speeds: Vec<f64> = timed(records, name, depth, test).map(|r| r.tokens_per_s).collect();
                let ratios: Vec<f64> = timed(records, name, depth, test).filter_map(|r| timed(records, &base, depth, test).find(|b| b.pass == r.pass).map(|b| r.tokens_per_s / b.tokens_per_s)).collect();
                if let (Some(tokens_per_s), Some(ratio)) = (summarize(&speeds), summarize(&ratios)) {
                    rows.push(SpeedRow { kv_dtype: name.clone(), depth, test, tokens_per_s, ratio });
                }
            }
        }
    }
    rows
}

/// The implementation an arm's name belongs to: the word before its first space (`"llama.cpp q8_0 fa"`:
/// `"llama.cpp"`, `"avx2 q8_0"`: reckon at another SIMD level), or `""` for reckon's own arms.
pub fn implementation(name: &str) -> &str {
    name.split_once(' ').map_or("", |(i, _)| i)
}

/// The key and value dtypes an arm's name stands for: `q8_0`, `q8_0,q4_0`, or an external arm such as
/// `"llama.cpp q8_0,f16"` / `"llama.cpp q4_0 fa"` (flash attention on).
pub fn arm_dtypes(name: &str) -> Option<(KvDtype, KvDtype)> {
    let spec = name.split_once(' ').map_or(name, |(_, arm)| arm).trim_end_matches(" fa");
    match spec.split_once(',') {
        Some((k, v)) => Some((KvDtype::from_name(k)?, KvDtype::from_name(v)?)),
        None => KvDtype::from_name(spec).map(|d| (d, d)),
    }
}

/// Per test and depth, reckon's fastest arm (at this process's SIMD level) over llama.cpp's fastest
/// (medians).
pub fn best_over_external(rows: &[SpeedRow]) -> Vec<(&'static str, usize, String, String, f64)> {
    let mut out = Vec::new();
    let mut keys: Vec<(&'static str, usize)> = rows.iter().map(|r| (r.test, r.depth)).collect();
    keys.dedup();
    for (test, depth) in keys {
        let best = |implementation_: &str| rows.iter().filter(|r| r.test == test && r.depth == depth && implementation(&r.kv_dtype) == implementation_).max_by(|a, b| a.tokens_per_s.median.total_cmp(&b.tokens_per_s.median));
        if let (Some(ours), Some(theirs)) = (best(""), best(LLAMACPP.trim_end())) {
            out.push((test, depth, ours.kv_dtype.clone(), theirs.kv_dtype.clone(), ours.tokens_per_s.median / theirs.tokens_per_s.median));
        }
    }
    out
}

/// The drift check: the first arm's first-depth decode (or prefill) speed at the end over its first pass.
pub fn drift(records: &[SpeedRecord]) -> Option<f64> {
    let last = records.iter().rfind(|r| r.drift_check)?;
    let first = records.iter().find(|r| !r.drift_check && r.pass == 0 && r.kv_dtype == last.kv_dtype && r.depth == last.depth && r.test == last.test)?;
    Some(last.tokens_per_s / first.tokens_per_s - 1.0)
}

/// The leg's markdown: speed table (with $ per million tokens at `price_per_hour`, and with a measured
/// `bandwidth` each decode's bound and the fraction reached), KV memory, quality.
pub fn markdown(model: &Model, rows: &[SpeedRow], quality: &[QualityRecord], drift: Option<f64>, price_per_hour: Option<f64>, bandwidth: Option<&crate::bandwidth::Bandwidth>) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let price = |tps: f64| price_per_hour.map(|p| format!(" | ${:.3}", p / (tps * 3600.0) * 1e6)).unwrap_or_default();
    let mut head = String::from("| test | depth | KV | tok/s median (min-max) | ms per token | vs its implementation's first arm, median (min-max) | KV MiB at depth");
    let mut rule = String::from("|---|---|---|---|---|---|---");
    if price_per_hour.is_some() {
        head += " | $ / M tokens";
        rule += "|---";
    }
    if let Some(bw) = bandwidth {
        head += &format!(" | MB read per token | bound at {:.1} GB/s | of bound", bw.read_gb_s);
        rule += "|---|---|---";
    }
    let _ = writeln!(out, "{head} |\n{rule}|");
    for r in rows {
        let (k, v) = arm_dtypes(&r.kv_dtype).unwrap_or_default();
        let d = KvDtypes { k, v };
        let mib = (kv_bytes_per_token(model, d) * r.depth) as f64 / (1 << 20) as f64;
        let t = &r.tokens_per_s;
        let q = &r.ratio;
        let bound = match bandwidth {
            Some(bw) if r.test == "tg" => {
                let bytes = model.decode_bytes_per_token(r.depth, d) as f64;
                let b = bw.read_gb_s * 1e9 / bytes;
                format!(" | {:.1} | {b:.1} | {:.0}%", bytes / 1e6, 100.0 * t.median / b)
            }
            Some(_) => " | | |".to_string(),
            None => String::new(),
        };
        let _ = writeln!(out, "| {} | {} | {} | {:.1} ({:.1}-{:.1}) | {:.2} | {:.2}x ({:.2}-{:.2}) | {:.1}{}{bound} |", r.test, r.depth, r.kv_dtype, t.median, t.min, t.max, 1000.0 / t.median, q.median, q.min, q.max, mib, price(t.median));
    }
    if let Some(d) = drift {
        let flag = if d.abs() > 0.05 { " — over 5%: the host changed speed during the run; treat absolute figures with care" } else { "" };
        let _ = writeln!(out, "\nDrift check (first arm repeated at the end): {:+.1}%{flag}", 100.0 * d);
    }
    if !quality.is_empty() {
        let _ = writeln!(out, "\n| KV | bytes/token | teacher-forced top-1 = first arm's | same, where its top-2 gap ≥ {CLEAR_GAP} | mean KL | max KL |");
        let _ = writeln!(out, "|---|---|---|---|---|---|");
        for q in quality {
            let d = KvDtypes::parse(&q.kv_dtype).unwrap_or_default();
            let pct = |a: usize, n: usize| 100.0 * a as f64 / n.max(1) as f64;
            let _ = writeln!(
                out,
                "| {} | {} | {}/{} ({:.2}%) | {}/{} ({:.2}%) | {:.5} | {:.4} |",
                q.kv_dtype,
                kv_bytes_per_token(model, d),
                q.top1_agree,
                q.positions,
                100.0 * q.top1_agreement,
                q.clear_agree,
                q.clear_positions,
                pct(q.clear_agree, q.clear_positions),
                q.mean_kl,
                q.max_kl
            );
        }
    }
    out
}

/// Decode tok/s against depth, one line per dtype, as an SVG.
pub fn plot(rows: &[SpeedRow], title: &str, path: &std::path::Path) -> Result<(), LabError> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| LabError::Plot(e.to_string());
    let root = SVGBackend::new(path, (1100, 450)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root.titled(title, ("sans-serif", 18)).map_err(|e| err(&e))?;
    let (left, right) = root.split_horizontally(550);
    let colors = [RED, BLUE, GREEN, MAGENTA, CYAN, BLACK];
    for (area, test, caption) in [(&left, "tg", "decode tok/s (median) vs depth"), (&right, "pp", "prefill tok/s at depth (median)")] {
        let sel: Vec<&SpeedRow> = rows.iter().filter(|r| r.test == test).collect();
        if sel.is_empty() {
            continue;
        }
        let xmax = sel.iter().map(|r| r.depth).max().unwrap_or(1).max(1) as f64 * 1.05;
        let ymax = sel.iter().map(|r| r.tokens_per_s.max).fold(1.0, f64::max) * 1.1;
        let mut chart = ChartBuilder::on(area).caption(caption, ("sans-serif", 15)).margin(12).x_label_area_size(35).y_label_area_size(55).build_cartesian_2d(0.0..xmax, 0.0..ymax).map_err(|e| err(&e))?;
        chart.configure_mesh().x_desc("context depth (tokens)").draw().map_err(|e| err(&e))?;
        // each dtype once, in the arms' order (rows come depth by depth)
        let mut names: Vec<&str> = Vec::new();
        for r in &sel {
            if !names.contains(&r.kv_dtype.as_str()) {
                names.push(&r.kv_dtype);
            }
        }
        for (i, name) in names.iter().enumerate() {
            let color = colors[i % colors.len()];
            let pts: Vec<(f64, f64)> = sel.iter().filter(|r| r.kv_dtype == *name).map(|r| (r.depth as f64, r.tokens_per_s.median)).collect();
            chart.draw_series(LineSeries::new(pts, color.stroke_width(2))).map_err(|e| err(&e))?.label(*name).legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color));
        }
        chart.configure_series_labels().position(SeriesLabelPosition::LowerLeft).border_style(BLACK).background_style(WHITE).draw().map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_is_zero_for_equal_and_positive_otherwise() {
        let a = [1.0f32, 2.0, 3.0];
        let mut lp = [0f64; 3];
        log_softmax(&a, &mut lp);
        assert!(kl_from(&lp, &a) < 1e-12);
        assert!(kl_from(&lp, &[3.0, 2.0, 1.0]) > 0.5);
        assert_eq!(argmax(&a), 2);
    }

    #[test]
    fn llama_cpp_rows_are_compared_with_llama_cpp_f16() {
        let rec = |pass, d: &str, tps| SpeedRecord { pass, kv_dtype: d.into(), depth: 4096, test: "tg", tokens: 64, tokens_per_s: tps, drift_check: false };
        let records = vec![rec(0, "f16", 100.0), rec(0, "q8_0", 140.0), rec(0, "llama.cpp f16", 50.0), rec(0, "llama.cpp q8_0 fa", 40.0), rec(0, "llama.cpp q8_0,f16", 60.0)];
        let arms: Vec<String> = ["f16", "q8_0", "llama.cpp f16", "llama.cpp q8_0 fa", "llama.cpp q8_0,f16"].map(String::from).to_vec();
        let rows = speed_rows(&records, &arms, &[4096]);
        let ratio = |name: &str| rows.iter().find(|r| r.kv_dtype == name).unwrap().ratio.median;
        assert_eq!((ratio("q8_0"), ratio("llama.cpp q8_0 fa"), ratio("llama.cpp q8_0,f16")), (1.4, 0.8, 1.2));
        let best = best_over_external(&rows);
        assert_eq!(best, vec![("tg", 4096, "q8_0".to_string(), "llama.cpp q8_0,f16".to_string(), 140.0 / 60.0)]);
        assert_eq!(arm_dtypes("llama.cpp q8_0,f16"), Some((KvDtype::Q8_0, KvDtype::F16)));
        assert_eq!(arm_dtypes("llama.cpp q4_0 fa"), Some((KvDtype::Q4_0, KvDtype::Q4_0)));
        assert_eq!(arm_dtypes("q8_0,q4_0"), Some((KvDtype::Q8_0, KvDtype::Q4_0)));
    }

    #[test]
    fn a_second_simd_level_is_compared_with_its_own_f16() {
        let rec = |pass, d: &str, tps| SpeedRecord { pass, kv_dtype: d.into(), depth: 4096, test: "tg", tokens: 64, tokens_per_s: tps, drift_check: false };
        let records = vec![rec(0, "f16", 100.0), rec(0, "q8_0", 130.0), rec(0, "avx2 f16", 80.0), rec(0, "avx2 q8_0", 120.0), rec(0, "llama.cpp f16", 50.0)];
        let arms: Vec<String> = ["f16", "q8_0", "avx2 f16", "avx2 q8_0", "llama.cpp f16"].map(String::from).to_vec();
        let rows = speed_rows(&records, &arms, &[4096]);
        let ratio = |name: &str| rows.iter().find(|r| r.kv_dtype == name).unwrap().ratio.median;
        assert_eq!((ratio("q8_0"), ratio("avx2 q8_0")), (1.3, 1.5));
        assert_eq!(best_over_external(&rows), vec![("tg", 4096, "q8_0".to_string(), "llama.cpp f16".to_string(), 130.0 / 50.0)]);
        assert_eq!(arm_dtypes("avx2 q8_0"), Some((KvDtype::Q8_0, KvDtype::Q8_0)));
    }

    #[test]
    fn rows_pair_each_pass_with_the_baseline() {
        let rec = |pass, d: &str, tps| SpeedRecord { pass, kv_dtype: d.into(), depth: 1024, test: "tg", tokens: 64, tokens_per_s: tps, drift_check: false };
        let records = vec![rec(0, "f16", 100.0), rec(0, "q8_0", 150.0), rec(1, "q8_0", 120.0), rec(1, "f16", 100.0), SpeedRecord { drift_check: true, pass: 2, ..rec(2, "f16", 90.0) }];
        let arms = ["f16".to_string(), "q8_0".to_string()];
        let rows = speed_rows(&records, &arms, &[1024]);
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[1].ratio.median, rows[1].ratio.min, rows[1].ratio.max), (1.35, 1.2, 1.5));
        assert_eq!(rows[0].tokens_per_s.n, 2, "the drift check is not a pass");
        assert!((drift(&records).unwrap() + 0.1).abs() < 1e-12);
    }
}
