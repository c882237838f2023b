//! Tables, findings and the plot of `reckon lab prefix`, from the raw per-request records.

use super::TurnRecord;
use crate::stats::{summarize, Summary};
use crate::LabError;
use plotters::prelude::*;
use std::fmt::Write;
use std::path::Path;

/// One request position (session, turn) over all passes, both arms.
#[derive(Clone, Debug)]
pub struct TurnRow {
    pub session: usize,
    pub turn: usize,
    pub prompt_tokens: usize,
    pub first_difference: usize,
    pub difference: String,
    pub cached_tokens: usize,
    pub prefilled_with_cache: usize,
    pub prefilled_without: usize,
    pub ttft_with_cache: Summary,
    pub ttft_without: Summary,
}

/// Rows in request order (turn, then session).
pub fn rows(records: &[TurnRecord]) -> Vec<TurnRow> {
    let mut keys: Vec<(usize, usize)> = records.iter().map(|r| (r.turn, r.session)).collect();
    keys.sort_unstable();
    keys.dedup();
    keys.into_iter()
        .filter_map(|(turn, session)| {
            let arm = |cache: bool| records.iter().filter(move |r| r.turn == turn && r.session == session && r.prefix_cache == cache);
            let with = arm(true).next()?;
            let without = arm(false).next()?;
            let ttft = |cache: bool| summarize(&arm(cache).map(|r| r.ttft_ms).collect::<Vec<_>>());
            Some(TurnRow {
                session,
                turn,
                prompt_tokens: with.prompt_tokens,
                first_difference: with.first_difference,
                difference: with.difference.clone(),
                cached_tokens: with.cached_tokens,
                prefilled_with_cache: with.prefilled_tokens,
                prefilled_without: without.prefilled_tokens,
                ttft_with_cache: ttft(true)?,
                ttft_without: ttft(false)?,
            })
        })
        .collect()
}

/// What the run shows, in numbers a reader can check against the table.
#[derive(Clone, Debug)]
pub struct Findings {
    /// Cached / prompt tokens over all requests with the cache on.
    pub hit_rate: f64,
    /// Requests whose prefill was the new suffix (from the first differing token) plus at most one block.
    pub within_one_block: usize,
    pub requests: usize,
    /// Every reply was the same token for token with the cache on and off, in every pass.
    pub replies_identical: bool,
    /// Median TTFT of the last three turns over that of turns 2-4 (the first turn is cold in both arms).
    pub ttft_growth_with_cache: f64,
    pub ttft_growth_without: f64,
    /// Requests (after the first) that reused under half their prompt, with where they differ.
    pub low_hits: Vec<String>,
}

pub fn findings(records: &[TurnRecord], rows: &[TurnRow], block_size: usize) -> Findings {
    let prompt: usize = rows.iter().map(|r| r.prompt_tokens).sum();
    let cached: usize = rows.iter().map(|r| r.cached_tokens).sum();
    let within = rows.iter().filter(|r| r.prefilled_with_cache <= r.prompt_tokens - r.first_difference.min(r.prompt_tokens) + block_size).count();
    let replies_identical = records.iter().filter(|r| r.prefix_cache).all(|a| {
        records.iter().filter(|b| !b.prefix_cache && b.pass == a.pass && b.turn == a.turn && b.session == a.session).all(|b| b.reply_tokens == a.reply_tokens)
    });
    let growth = |ttft: fn(&TurnRow) -> f64| {
        let session0: Vec<f64> = rows.iter().filter(|r| r.session == 0).map(ttft).collect();
        if session0.len() < 5 {
            return f64::NAN;
        }
        let early = summarize(&session0[1..4]).map_or(f64::NAN, |s| s.median);
        let late = summarize(&session0[session0.len() - 3..]).map_or(f64::NAN, |s| s.median);
        late / early
    };
    let low_hits = rows
        .iter()
        .filter(|r| (r.turn, r.session) != (0, 0) && 2 * r.cached_tokens < r.prompt_tokens)
        .map(|r| {
            format!(
                "turn {} session {}: {} of {} prompt tokens cached ({:.1}%); the prompt first differs from every earlier request at token {}: {}",
                r.turn + 1,
                r.session + 1,
                r.cached_tokens,
                r.prompt_tokens,
                100.0 * r.cached_tokens as f64 / r.prompt_tokens as f64,
                r.first_difference,
                r.difference
            )
        })
        .collect();
    Findings {
        hit_rate: cached as f64 / prompt.max(1) as f64,
        within_one_block: within,
        requests: rows.len(),
        replies_identical,
        ttft_growth_with_cache: growth(|r| r.ttft_with_cache.median),
        ttft_growth_without: growth(|r| r.ttft_without.median),
        low_hits,
    }
}

/// The per-request table (TTFT medians over passes, with min-max) and the findings, in Markdown.
pub fn markdown(rows: &[TurnRow], f: &Findings, block_size: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "| turn | session | prompt tokens | first new token | cached | prefilled (cache on) | TTFT ms (cache on) | prefilled (cache off) | TTFT ms (cache off) | off / on |");
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let (a, b) = (&r.ttft_with_cache, &r.ttft_without);
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {:.0} ({:.0}-{:.0}) | {} | {:.0} ({:.0}-{:.0}) | {:.2}x |",
            r.turn + 1,
            r.session + 1,
            r.prompt_tokens,
            r.first_difference,
            r.cached_tokens,
            r.prefilled_with_cache,
            a.median,
            a.min,
            a.max,
            r.prefilled_without,
            b.median,
            b.min,
            b.max,
            b.median / a.median
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "- prefix cache hit rate: {:.1}% of prompt tokens", 100.0 * f.hit_rate);
    let _ = writeln!(out, "- prefilled = new suffix + at most one block ({block_size} tokens): {} of {} requests", f.within_one_block, f.requests);
    if f.ttft_growth_with_cache.is_finite() && f.ttft_growth_without.is_finite() {
        let _ = writeln!(out, "- TTFT growth, last 3 turns over turns 2-4: {:.2}x with the cache, {:.2}x without", f.ttft_growth_with_cache, f.ttft_growth_without);
    }
    let _ = writeln!(out, "- replies identical with the cache on and off (greedy): {}", if f.replies_identical { "yes, every request of every pass" } else { "NO" });
    if !f.low_hits.is_empty() {
        let _ = writeln!(out, "- low cache hits ({} requests reused under half their prompt):", f.low_hits.len());
        for l in f.low_hits.iter().take(5) {
            let _ = writeln!(out, "  - {l}");
        }
    }
    out
}

/// TTFT and prefilled tokens per request, cache on and off, as an SVG.
pub fn plot(rows: &[TurnRow], title: &str, path: &Path) -> Result<(), LabError> {
    let err = |e: &dyn std::fmt::Display| LabError::Plot(e.to_string());
    let root = SVGBackend::new(path, (1100, 450)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root.titled(title, ("sans-serif", 18)).map_err(|e| err(&e))?;
    let (left, right) = root.split_horizontally(550);
    let n = rows.len() as f64 + 1.0;
    let series = |f: fn(&TurnRow) -> f64| rows.iter().enumerate().map(move |(i, r)| (i as f64 + 1.0, f(r))).collect::<Vec<_>>();
    let panels: [(&DrawingArea<_, _>, &str, fn(&TurnRow) -> f64, fn(&TurnRow) -> f64); 2] = [
        (&left, "time to first token, ms (median)", |r| r.ttft_with_cache.median, |r| r.ttft_without.median),
        (&right, "prompt tokens prefilled", |r| r.prefilled_with_cache as f64, |r| r.prefilled_without as f64),
    ];
    for (area, caption, on, off) in panels {
        let top = series(off).iter().chain(series(on).iter()).map(|p| p.1).fold(1.0, f64::max) * 1.1;
        let mut chart = ChartBuilder::on(area)
            .caption(caption, ("sans-serif", 15))
            .margin(12)
            .x_label_area_size(35)
            .y_label_area_size(55)
            .build_cartesian_2d(0.0..n, 0.0..top)
            .map_err(|e| err(&e))?;
        chart.configure_mesh().x_desc("request (turn order)").draw().map_err(|e| err(&e))?;
        chart.draw_series(LineSeries::new(series(off), RED.stroke_width(2))).map_err(|e| err(&e))?.label("prefix cache off").legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], RED));
        chart.draw_series(LineSeries::new(series(on), BLUE.stroke_width(2))).map_err(|e| err(&e))?.label("prefix cache on").legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], BLUE));
        chart.configure_series_labels().position(SeriesLabelPosition::UpperLeft).border_style(BLACK).background_style(WHITE).draw().map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))
}
