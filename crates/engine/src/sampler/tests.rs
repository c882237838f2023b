//! The sampler's unit tests: exact checks of greedy and the cuts, and goodness-of-fit tests of the
//! drawn tokens against the distribution the documented chain gives (llama.cpp's samplers: penalties ->
//! top-k -> top-p -> min-p -> temperature -> draw), computed here independently in f64.

use super::*;

fn logits() -> Vec<f32> {
    (0..100).map(|i| ((i * 37) % 101) as f32 / 10.0).collect()
}

/// `n` logits uniform in [lo, hi), from a fixed seed.
fn spread(seed: u64, n: usize, lo: f64, hi: f64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| (lo + (hi - lo) * rng.next_f64()) as f32).collect()
}

/// Index of the largest value, the lowest on ties, by the plainest loop (NaN-free input).
fn first_max(l: &[f64]) -> u32 {
    let mut best = 0;
    for (i, &v) in l.iter().enumerate() {
        if v > l[best] {
            best = i;
        }
    }
    best as u32
}

/// The penalized logits by the definitions (llama.cpp's `llama_sampler_penalties`): every token seen
/// c > 0 times in the last `penalty_last_n` tokens of the history (all of it for 0) has its logit divided
/// by the repetition penalty if above 0 and multiplied by it otherwise, then lowered by
/// `c * frequency_penalty + presence_penalty`.
fn penalized(logits: &[f32], history: &[u32], p: &SamplingParams) -> Vec<f64> {
    let start = if p.penalty_last_n == 0 { 0 } else { history.len().saturating_sub(p.penalty_last_n) };
    let window = &history[start..];
    let mut l: Vec<f64> = logits.iter().map(|&x| x as f64).collect();
    for (id, li) in l.iter_mut().enumerate() {
        let c = window.iter().filter(|&&t| t as usize == id).count();
        if c > 0 {
            let rep = p.repetition_penalty as f64;
            *li = if *li <= 0.0 { *li * rep } else { *li / rep };
            *li -= c as f64 * p.frequency_penalty as f64 + p.presence_penalty as f64;
        }
    }
    l
}

/// softmax(l / t) over `ids`.
fn softmax_f64(l: &[f64], ids: &[usize], t: f64) -> Vec<f64> {
    let max = ids.iter().map(|&i| l[i]).fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = ids.iter().map(|&i| ((l[i] - max) / t).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.into_iter().map(|x| x / sum).collect()
}

/// The probability of each token under the documented chain (temperature > 0), from the definitions:
/// penalties; top-k keeps the k largest logits (lowest id first on ties); top-p keeps the shortest head
/// whose probability (softmax at temperature 1 over what top-k left) reaches p, the token that crosses
/// p included; min-p keeps the tokens whose probability is at least min_p times the largest one's;
/// temperature then divides the logits of the kept tokens, and the draw is from their softmax.
///
/// Panics if a cut lies within 1e-4 of a token's cumulative (top-p) or relative (min-p) probability:
/// such a case would test float rounding, not the sampler, so the cases below are chosen away from it.
fn reference(logits: &[f32], history: &[u32], p: &SamplingParams) -> Vec<f64> {
    assert!(p.temperature > 0.0);
    let l = penalized(logits, history, p);
    let mut order: Vec<usize> = (0..l.len()).collect();
    order.sort_by(|&a, &b| l[b].partial_cmp(&l[a]).expect("no NaN").then(a.cmp(&b)));
    if p.top_k > 0 {
        order.truncate(p.top_k);
    }
    let q = softmax_f64(&l, &order, 1.0);
    let mut keep = order.len();
    if p.top_p < 1.0 {
        let top_p = p.top_p as f64;
        let mut cum = 0.0;
        for (i, &qi) in q.iter().enumerate() {
            cum += qi;
            assert!((cum - top_p).abs() > 1e-4, "top-p {top_p} is on a knife edge at rank {i} (cumulative {cum})");
            if cum >= top_p {
                keep = i + 1;
                break;
            }
        }
    }
    if p.min_p > 0.0 {
        let floor = q[0] * p.min_p as f64;
        assert!(q.iter().all(|&qi| (qi - floor).abs() > 1e-4 * q[0]), "min-p {} is on a knife edge", p.min_p);
        keep = keep.min(q.iter().filter(|&&qi| qi >= floor).count());
    }
    order.truncate(keep);
    let mut out = vec![0.0; l.len()];
    for (&id, pr) in order.iter().zip(softmax_f64(&l, &order, p.temperature as f64)) {
        out[id] = pr;
    }
    out
}

/// ln Γ(a) for a positive multiple of 1/2 (all a chi-square with an integer number of degrees of freedom
/// needs), exactly from Γ(1) = 1, Γ(1/2) = √π and Γ(v + 1) = v Γ(v).
fn ln_gamma_half(a: f64) -> f64 {
    let (mut v, mut g) = if a.fract() == 0.0 { (1.0, 0.0) } else { (0.5, 0.5 * std::f64::consts::PI.ln()) };
    while v < a {
        g += v.ln();
        v += 1.0;
    }
    g
}

/// P(X ≥ x) for X chi-square with `df` degrees of freedom: the regularized upper incomplete gamma
/// Q(df/2, x/2), by its power series below a + 1 and its continued fraction (modified Lentz) above, as in
/// Numerical Recipes' `gammq`.
fn chi_square_upper_tail(x: f64, df: usize) -> f64 {
    let (a, x) = (df as f64 / 2.0, x / 2.0);
    if x <= 0.0 {
        return 1.0;
    }
    let front = (-x + a * x.ln() - ln_gamma_half(a)).exp();
    if x < a + 1.0 {
        let (mut ap, mut term) = (a, 1.0 / a);
        let mut sum = term;
        for _ in 0..100_000 {
            ap += 1.0;
            term *= x / ap;
            sum += term;
            if term.abs() < sum.abs() * 1e-17 {
                break;
            }
        }
        1.0 - sum * front
    } else {
        let tiny = 1e-300;
        let mut b = x + 1.0 - a;
        let (mut c, mut d) = (1.0 / tiny, 1.0 / b);
        let mut h = d;
        for i in 1..100_000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            if d.abs() < tiny {
                d = tiny;
            }
            c = b + an / c;
            if c.abs() < tiny {
                c = tiny;
            }
            d = 1.0 / d;
            let delta = d * c;
            h *= delta;
            if (delta - 1.0).abs() < 1e-16 {
                break;
            }
        }
        front * h
    }
}

/// How unlikely a fit must be to fail a test: with fixed seeds the tests are deterministic, and a correct
/// sampler fails one of them with probability below 1e-6 per case for a seed chosen blindly.
const P_FAIL: f64 = 1e-6;

/// Draws `draws` tokens with `params` and checks them against `want` (one probability per token id):
/// a token of probability 0 is never drawn (exact), and the counts pass Pearson's chi-square test at
/// p > `P_FAIL` (tokens expected fewer than 5 times pooled into one bin).
fn assert_draws_fit(label: &str, params: &SamplingParams, logits: &[f32], history: &[u32], want: &[f64], draws: usize) {
    let mut s = Sampler::new(params.clone());
    let mut counts = vec![0u64; logits.len()];
    for _ in 0..draws {
        counts[s.sample(logits, history) as usize] += 1;
    }
    assert_counts_fit(label, &counts, want, draws);
}

/// `assert_draws_fit`'s test of `counts` (per token id, over `draws` draws) against `want`.
fn assert_counts_fit(label: &str, counts: &[u64], want: &[f64], draws: usize) {
    for (id, (&c, &w)) in counts.iter().zip(want).enumerate() {
        assert!(w > 0.0 || c == 0, "{label}: token {id} is cut (probability 0) but was drawn {c} times");
    }
    let n = draws as f64;
    // (observed, expected) per bin.
    let mut bins: Vec<(f64, f64)> = Vec::new();
    let mut pooled = (0.0, 0.0);
    for (&c, &w) in counts.iter().zip(want) {
        if w == 0.0 {
            continue;
        }
        if n * w >= 5.0 {
            bins.push((c as f64, n * w));
        } else {
            pooled.0 += c as f64;
            pooled.1 += n * w;
        }
    }
    if pooled.1 > 0.0 {
        if pooled.1 >= 5.0 || bins.is_empty() {
            bins.push(pooled);
        } else {
            let smallest = bins.iter_mut().min_by(|a, b| a.1.total_cmp(&b.1)).expect("a bin");
            smallest.0 += pooled.0;
            smallest.1 += pooled.1;
        }
    }
    let kept = want.iter().filter(|&&w| w > 0.0).count();
    if bins.len() < 2 {
        return; // one token kept: the exact check above is the whole test
    }
    let stat: f64 = bins.iter().map(|&(o, e)| (o - e) * (o - e) / e).sum();
    let df = bins.len() - 1;
    let p = chi_square_upper_tail(stat, df);
    eprintln!("{label}: {kept} tokens kept, chi-square {stat:.1} on {df} degrees of freedom, p = {p:.3}");
    assert!(
        p > P_FAIL,
        "{label}: draws do not fit the reference (chi-square {stat:.1}, {df} d.o.f., p = {p:.2e})\n  counts {counts:?}\n  want   {:?}",
        want.iter().map(|w| (w * n).round() as u64).collect::<Vec<_>>()
    );
}

const DRAWS: usize = 100_000;

fn no_cuts(temperature: f32, seed: u64) -> SamplingParams {
    SamplingParams { temperature, top_k: 0, top_p: 1.0, min_p: 0.0, seed, ..SamplingParams::default() }
}

#[test]
fn chi_square_tail_matches_closed_forms_and_tables() {
    // Even degrees of freedom: Q(k, y) = e^-y Σ_{j<k} y^j / j!.
    for df in (2..=80).step_by(2) {
        for x in [0.1, 1.0, 5.0, df as f64, 2.0 * df as f64, 100.0, 250.0] {
            let y = x / 2.0;
            let (mut term, mut sum) = (1.0f64, 0.0f64);
            for j in 0..df / 2 {
                if j > 0 {
                    term *= y / j as f64;
                }
                sum += term;
            }
            let want = (-y).exp() * sum;
            let got = chi_square_upper_tail(x, df);
            assert!((got - want).abs() <= 1e-10 * want.max(1e-300) + 1e-300, "df {df} x {x}: {got} vs {want}");
        }
    }
    // Odd degrees of freedom, against published critical values.
    for (x, df, p) in [(23.928, 1, 1e-6), (3.841, 1, 0.05), (7.815, 3, 0.05), (20.515, 5, 0.001), (44.314, 25, 0.01)] {
        let got = chi_square_upper_tail(x, df);
        assert!((got / p - 1.0).abs() < 2e-3, "df {df} x {x}: {got} vs {p}");
    }
}

/// Whether this CPU has `level`, for a test that otherwise skips (part of) its work with a note. Where
/// RECKON_REQUIRE_SIMD names `level` or a higher one (`avx2`, `avx512`: a CI machine that must test those
/// kernels), a missing level fails the test instead of skipping it.
fn simd_or_skip(level: crate::kernels::cpu::SimdLevel, what: &str) -> bool {
    use crate::kernels::cpu::SimdLevel;
    if level.is_available() {
        return true;
    }
    if let Some(required) = std::env::var("RECKON_REQUIRE_SIMD").ok().filter(|v| !v.is_empty()) {
        let required = SimdLevel::from_name(&required).unwrap_or_else(|| panic!("RECKON_REQUIRE_SIMD={required:?}: not scalar, avx2, avxvnni or avx512"));
        assert!(
            level > required,
            "{what} needs {} but this CPU has only {}, and RECKON_REQUIRE_SIMD={} requires it",
            level.name(),
            SimdLevel::detected().name(),
            required.name()
        );
    }
    eprintln!("note: no {} on this CPU; {what} skipped", level.name());
    false
}

/// `argmax` (its AVX2 path where the CPU has AVX2) and the portable lanes both equal the plain loop.
#[test]
fn argmax_is_the_plain_loop_with_ties_nans_zeros_and_infinities() {
    // Without AVX2, `argmax` is the portable path, compared twice.
    simd_or_skip(crate::kernels::cpu::SimdLevel::Avx2, "argmax's AVX2 path");
    let plain = |l: &[f32]| {
        let mut best = 0;
        for (i, &v) in l.iter().enumerate() {
            if v > l[best] {
                best = i;
            }
        }
        best as u32
    };
    let mut rng = Rng::new(11);
    let specials = [f32::NAN, -0.0, 0.0, f32::INFINITY, f32::NEG_INFINITY, 1.0, -1.0];
    for len in (0..70).chain([49152, 49157]) {
        for case in 0..40 {
            let l: Vec<f32> = (0..len)
                .map(|_| {
                    let r = rng.next_f64();
                    if case % 4 == 0 && r < 0.3 {
                        specials[(r * 100.0) as usize % specials.len()]
                    } else {
                        // few distinct values, so ties are common
                        ((rng.next_f64() * 8.0) as i32 - 4) as f32
                    }
                })
                .collect();
            assert_eq!(argmax(&l), plain(&l), "len {len} case {case}: {l:?}");
            let portable = if l.first().is_some_and(|v| !v.is_nan()) { largest_lanes(&l, true).1 } else { 0 };
            assert_eq!(portable, plain(&l), "len {len} case {case} (portable)");
        }
    }
}

#[test]
fn max_logit_is_the_fold_of_f32_max() {
    let mut rng = Rng::new(12);
    for len in 0..60 {
        let l: Vec<f32> = (0..len).map(|i| if i % 7 == 3 { f32::NAN } else { (rng.next_f64() * 10.0 - 5.0) as f32 }).collect();
        assert_eq!(max_logit(&l).to_bits(), l.iter().copied().fold(f32::NEG_INFINITY, f32::max).to_bits(), "{l:?}");
    }
    assert_eq!(max_logit(&[f32::NAN; 20]), f32::NEG_INFINITY);
}

/// Temperature 0 is the first largest (penalized) logit, checked against an independent loop on random
/// logits full of ties, with and without penalties (penalties chosen so the arithmetic is exact in f32
/// and f64, so ties stay ties), whatever the seed and the cuts.
#[test]
fn greedy_is_the_first_largest_penalized_logit() {
    let mut rng = Rng::new(21);
    let mut distinct = std::collections::HashSet::new();
    for case in 0..400 {
        let n = 1 + (rng.next_u64() % 80) as usize;
        let l: Vec<f32> = (0..n).map(|_| ((rng.next_f64() * 9.0) as i32 - 4) as f32).collect();
        let history: Vec<u32> = (0..(rng.next_u64() % 12)).map(|_| (rng.next_u64() % n as u64) as u32).collect();
        let penalties = case % 2 == 1;
        let p = SamplingParams {
            temperature: 0.0,
            top_k: (rng.next_u64() % 4) as usize,
            seed: rng.next_u64(),
            repetition_penalty: if penalties { 2.0 } else { 1.0 },
            presence_penalty: if penalties { 0.5 } else { 0.0 },
            frequency_penalty: if penalties { 0.25 } else { 0.0 },
            penalty_last_n: 6,
            ..SamplingParams::default()
        };
        let want = first_max(&penalized(&l, &history, &p));
        let mut s = Sampler::new(p);
        for _ in 0..3 {
            assert_eq!(s.sample(&l, &history), want, "case {case}: logits {l:?} history {history:?}");
        }
        distinct.insert(want);
    }
    assert!(distinct.len() > 20, "the cases cover many positions");
    assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
}

#[test]
fn same_seed_same_tokens_and_different_seed_differs() {
    let draw = |seed| {
        let mut s = Sampler::new(SamplingParams { temperature: 1.5, top_k: 0, top_p: 1.0, min_p: 0.0, seed, ..Default::default() });
        (0..50).map(|_| s.sample(&logits(), &[])).collect::<Vec<_>>()
    };
    assert_eq!(draw(7), draw(7));
    assert_ne!(draw(7), draw(8));
}

#[test]
fn top_k_one_is_greedy() {
    let mut s = Sampler::new(SamplingParams { temperature: 5.0, top_k: 1, seed: 3, ..Default::default() });
    for _ in 0..20 {
        assert_eq!(s.sample(&logits(), &[]), argmax(&logits()));
    }
}

/// Probabilities 0.4, 0.3, 0.2, 0.1: top-p 0.5 keeps the first two (0.4 alone is short of 0.5; the
/// token that crosses it is kept), min-p 0.6 keeps those above 0.24 (the first two; an absolute floor of
/// 0.6 would keep only the first). The cut tail holds 30% of the mass, so a missing cut shows.
#[test]
fn top_p_and_min_p_restrict_the_candidates() {
    let l: Vec<f32> = [0.4f64, 0.3, 0.2, 0.1].iter().map(|p| p.ln() as f32).collect();
    for (top_p, min_p) in [(0.5, 0.0), (1.0, 0.6), (0.5, 0.6)] {
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, top_k: 0, top_p, min_p, seed: 1, ..Default::default() });
        let mut counts = [0; 4];
        (0..2000).for_each(|_| counts[s.sample(&l, &[]) as usize] += 1);
        assert_eq!(counts[2] + counts[3], 0, "top_p {top_p} min_p {min_p}: {counts:?}");
        // 4:3 between the two kept tokens: each well above a quarter of the draws.
        assert!(counts[0] > 500 && counts[1] > 500, "top_p {top_p} min_p {min_p}: {counts:?}");
    }
}

#[test]
fn penalties_push_repeated_tokens_down() {
    let l = vec![5.0, 4.9, 1.0];
    let mut s = Sampler::new(SamplingParams { temperature: 0.0, repetition_penalty: 1.5, ..Default::default() });
    assert_eq!(s.sample(&l, &[0]), 1);
    let mut s = Sampler::new(SamplingParams { temperature: 0.0, frequency_penalty: 0.05, ..Default::default() });
    assert_eq!(s.sample(&l, &[0, 0, 0]), 1);
    let mut s = Sampler::new(SamplingParams { temperature: 0.0, presence_penalty: 0.2, ..Default::default() });
    assert_eq!(s.sample(&l, &[0]), 1);
}

/// The cuts from a sorted head equal the cuts over the whole vocabulary sorted (a vocabulary wider
/// than the first head, so the head has to grow for a top-p near 1).
#[test]
fn candidates_equal_a_full_sort() {
    let mut rng = Rng::new(5);
    let logits: Vec<f32> = (0..5000).map(|_| (rng.next_f64() * 8.0) as f32).collect();
    for (top_k, top_p, min_p) in [(0, 0.9, 0.0), (0, 0.999, 0.0), (0, 1.0, 0.05), (0, 1.0, 0.0001), (40, 0.95, 0.05), (300, 1.0, 0.0), (0, 0.5, 0.5)] {
        let p = SamplingParams { temperature: 1.0, top_k, top_p, min_p, ..Default::default() };
        let mut want: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
        want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if top_k > 0 {
            want.truncate(top_k);
        }
        let probs = softmax(&want, 1.0);
        let mut keep = want.len();
        if top_p < 1.0 {
            let mut cum = 0.0;
            keep = probs.iter().position(|&q| { cum += q; cum >= top_p as f64 }).map_or(keep, |i| i + 1);
        }
        if min_p > 0.0 {
            keep = keep.min(probs.iter().take_while(|&&q| q >= probs[0] * min_p as f64).count().max(1));
        }
        want.truncate(keep);
        assert_eq!(candidates(&logits, &p), Some(want), "top_k {top_k} top_p {top_p} min_p {min_p}");
    }
}

/// A tiny temperature is greedy, not NaN probabilities (the no-cut path divides in f32).
#[test]
fn tiny_temperature_draws_the_argmax() {
    let mut s = Sampler::new(SamplingParams { temperature: 1e-38, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 2, ..Default::default() });
    assert!((0..20).all(|_| s.sample(&logits(), &[]) == argmax(&logits())));
}

// ---- Goodness of fit: 1e5 seeded draws per case against the reference distribution. ----

/// No cut (the vectorized whole-vocabulary path): softmax(l / T), sharpened and flattened.
#[test]
fn temperature_alone_fits_the_tempered_softmax() {
    let l = spread(31, 48, -2.0, 2.0);
    for (t, seed) in [(0.6, 1), (1.0, 2), (1.8, 3)] {
        let p = no_cuts(t, seed);
        assert_draws_fit(&format!("temperature {t}"), &p, &l, &[], &reference(&l, &[], &p), DRAWS);
    }
}

/// Top-k keeps the k largest logits; a tie straddling the k-th place keeps the lower id.
#[test]
fn top_k_fits_and_keeps_the_lower_id_on_a_tie() {
    let mut l = spread(32, 48, -1.0, 1.0);
    let mut order: Vec<usize> = (0..l.len()).collect();
    order.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
    // The 10th and 11th largest become equal: only the lower id of the two is kept by top-k 10.
    l[order[10]] = l[order[9]];
    let p = SamplingParams { temperature: 1.5, top_k: 10, top_p: 1.0, min_p: 0.0, seed: 4, ..SamplingParams::default() };
    let want = reference(&l, &[], &p);
    assert_eq!(want.iter().filter(|&&w| w > 0.0).count(), 10);
    assert!(want[order[9].min(order[10])] > 0.0 && want[order[9].max(order[10])] == 0.0);
    assert_draws_fit("top-k 10", &p, &l, &[], &want, DRAWS);
    let p = SamplingParams { top_k: 3, temperature: 0.7, seed: 5, ..p };
    assert_draws_fit("top-k 3", &p, &l, &[], &reference(&l, &[], &p), DRAWS);
}

/// Top-p keeps the token that crosses p, decides the cut at temperature 1 (a temperature of 2 here
/// would keep more), and renormalizes what it keeps before the temperature applies.
#[test]
fn top_p_fits_keeping_the_crossing_token() {
    let l = spread(33, 32, -2.0, 2.0);
    for (top_p, t, seed) in [(0.7f32, 2.0f32, 6), (0.35, 0.5, 7), (0.9, 1.0, 8)] {
        let p = SamplingParams { temperature: t, top_k: 0, top_p, min_p: 0.0, seed, ..SamplingParams::default() };
        let want = reference(&l, &[], &p);
        // The kept set is a strict head of the vocabulary whose last token (the one crossing p) matters.
        let kept = want.iter().filter(|&&w| w > 0.0).count();
        assert!(kept > 1 && kept < l.len(), "top-p {top_p}: {kept} kept");
        assert!(want.iter().all(|&w| w == 0.0 || w * DRAWS as f64 > 500.0), "every kept token is drawn often");
        assert_draws_fit(&format!("top-p {top_p} T {t}"), &p, &l, &[], &want, DRAWS);
    }
}

/// Min-p keeps the tokens whose probability (temperature 1) is at least min_p times the top one's.
#[test]
fn min_p_fits_relative_to_the_top_probability() {
    let l = spread(34, 32, -2.0, 2.0);
    for (min_p, t, seed) in [(0.2f32, 0.5f32, 9), (0.05, 1.5, 10), (0.5, 1.0, 11)] {
        let p = SamplingParams { temperature: t, top_k: 0, top_p: 1.0, min_p, seed, ..SamplingParams::default() };
        let want = reference(&l, &[], &p);
        let kept = want.iter().filter(|&&w| w > 0.0).count();
        assert!(kept > 1 && kept < l.len(), "min-p {min_p}: {kept} kept");
        assert_draws_fit(&format!("min-p {min_p} T {t}"), &p, &l, &[], &want, DRAWS);
    }
}

/// A history whose last 16 tokens repeat some tokens of positive and some of negative logit, and whose
/// older part holds tokens that appear nowhere in the window (they must not be penalized).
fn penalty_case() -> (Vec<f32>, Vec<u32>) {
    let l = spread(35, 32, -2.5, 2.5);
    let mut by_logit: Vec<usize> = (0..l.len()).collect();
    by_logit.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
    let t = |rank: usize| by_logit[rank] as u32;
    // Older than the window: the two top tokens and a mid one.
    let old = [t(0), t(1), t(0), t(12), t(1), t(0), t(12), t(0)];
    // Window (16 tokens): the 3rd best 4 times, the 4th best twice, a negative-logit token 3 times, ...
    let window = [t(2), t(5), t(2), t(3), t(30), t(2), t(30), t(7), t(3), t(2), t(30), t(8), t(9), t(5), t(20), t(7)];
    assert!(l[t(30) as usize] < 0.0 && l[t(2) as usize] > 0.0);
    (l, [&old[..], &window[..]].concat())
}

#[test]
fn penalties_fit_over_the_last_n_tokens() {
    let (l, history) = penalty_case();
    let base = SamplingParams { penalty_last_n: 16, ..no_cuts(1.0, 12) };
    let cases = [
        ("repetition 1.8", SamplingParams { repetition_penalty: 1.8, ..base.clone() }),
        ("presence 1.0", SamplingParams { presence_penalty: 1.0, ..base.clone() }),
        ("frequency 0.7", SamplingParams { frequency_penalty: 0.7, ..base.clone() }),
        ("all, window 16", SamplingParams { repetition_penalty: 1.3, presence_penalty: 0.4, frequency_penalty: 0.5, seed: 13, ..base.clone() }),
        ("all, whole history", SamplingParams { repetition_penalty: 1.3, presence_penalty: 0.4, frequency_penalty: 0.5, penalty_last_n: 0, seed: 14, ..base.clone() }),
        ("repetition 0.6 (rewards)", SamplingParams { repetition_penalty: 0.6, temperature: 0.8, seed: 15, ..base.clone() }),
    ];
    for (label, p) in cases {
        let want = reference(&l, &history, &p);
        // The penalties move the distribution well beyond what 1e5 draws can miss.
        let plain = reference(&l, &[], &p);
        let moved: f64 = want.iter().zip(&plain).map(|(a, b)| (a - b).abs()).sum();
        assert!(moved > 0.05, "{label}: penalties move {moved}");
        assert_draws_fit(label, &p, &l, &history, &want, DRAWS);
    }
}

/// Everything at once: penalties, then the three cuts, then temperature.
#[test]
fn full_chain_fits() {
    let (l, history) = penalty_case();
    let p = SamplingParams {
        temperature: 0.8,
        top_k: 12,
        top_p: 0.8,
        min_p: 0.1,
        repetition_penalty: 1.3,
        presence_penalty: 0.3,
        frequency_penalty: 0.2,
        penalty_last_n: 16,
        seed: 16,
    };
    let want = reference(&l, &history, &p);
    assert!(want.iter().filter(|&&w| w > 0.0).count() > 2);
    assert_draws_fit("full chain", &p, &l, &history, &want, DRAWS);
}

/// Speculative verification of a point-mass guess (`Sampler::accept_or_resample`, `engine::spec`): the
/// token that results (the guess when kept, else the redrawn one) has exactly the distribution `sample`
/// draws from, whichever token was guessed: likely, unlikely, or cut by top-k/top-p.
#[test]
fn a_kept_or_redrawn_guess_has_the_samplers_distribution() {
    let logits = spread(11, 12, -2.0, 2.0);
    let history = [3u32, 3, 7];
    let cases = [
        ("no cuts, T 0.8", no_cuts(0.8, 5)),
        ("top-k 6, top-p 0.9", SamplingParams { temperature: 1.0, top_k: 6, top_p: 0.9, min_p: 0.0, seed: 6, ..SamplingParams::default() }),
        ("penalties, T 1.2", SamplingParams { temperature: 1.2, top_k: 0, top_p: 1.0, min_p: 0.0, repetition_penalty: 1.3, presence_penalty: 0.5, seed: 7, ..SamplingParams::default() }),
    ];
    for (label, params) in cases {
        let want = reference(&logits, &history, &params);
        let likely = first_max(&want);
        let cut = want.iter().position(|&w| w == 0.0).map(|i| i as u32);
        let unlikely = (0..want.len()).filter(|&i| want[i] > 0.0).min_by(|&a, &b| want[a].total_cmp(&want[b])).unwrap() as u32;
        for guess in [Some(likely), Some(unlikely), cut].into_iter().flatten() {
            let mut s = Sampler::new(params.clone());
            let mut counts = vec![0u64; logits.len()];
            for _ in 0..DRAWS {
                let t = s.accept_or_resample(&logits, &history, guess).unwrap_or(guess);
                counts[t as usize] += 1;
            }
            assert_counts_fit(&format!("{label}, guess {guess}"), &counts, &want, DRAWS);
        }
    }
    // greedy: kept iff the argmax
    let mut g = Sampler::new(SamplingParams::greedy());
    let best = first_max(&logits.iter().map(|&l| l as f64).collect::<Vec<_>>());
    assert_eq!(g.accept_or_resample(&logits, &[], best), None);
    assert_eq!(g.accept_or_resample(&logits, &[], (best + 1) % 12), Some(best));
}

#[test]
fn a_model_files_recommended_sampling_overlays_llama_cpps_defaults() {
    use crate::gguf::{writer::GgufWriter, GgufFile, Value};
    let file = |meta: &[(&str, Value)]| {
        let mut w = GgufWriter::new();
        meta.iter().for_each(|(k, v)| {
            w.meta(k, v.clone());
        });
        GgufFile::from_vec(w.to_bytes()).unwrap()
    };
    // none declared: llama.cpp's defaults
    let none = SamplingParams::from_gguf(&file(&[]));
    assert_eq!((none.params, none.declared.len(), none.skipped.len()), (SamplingParams::default(), 0, 0));
    // Qwen's generation_config as a converter writes it (f32 and u32/i32 values)
    let qwen = SamplingParams::from_gguf(&file(&[
        ("general.sampling.temp", Value::F32(0.7)),
        ("general.sampling.top_k", Value::U32(20)),
        ("general.sampling.top_p", Value::F32(0.8)),
        ("general.sampling.penalty_repeat", Value::F32(1.05)),
        ("general.sampling.penalty_last_n", Value::I32(-1)),
        ("general.sampling.mirostat", Value::I32(0)),
    ]));
    let want = SamplingParams { temperature: 0.7, top_k: 20, top_p: 0.8, repetition_penalty: 1.05, penalty_last_n: 0, ..SamplingParams::default() };
    assert_eq!(qwen.params, want);
    assert_eq!(qwen.declared.len(), 5);
    assert!(qwen.skipped.is_empty(), "mirostat 0 is off: {:?}", qwen.skipped);
    // unusable values and samplers reckon lacks are skipped, and named
    let odd = SamplingParams::from_gguf(&file(&[
        ("general.sampling.top_p", Value::F32(1.5)),
        ("general.sampling.temp", Value::String("hot".into())),
        ("general.sampling.min_p", Value::F32(0.1)),
        ("general.sampling.mirostat", Value::I32(2)),
    ]));
    assert_eq!(odd.params, SamplingParams { min_p: 0.1, ..SamplingParams::default() });
    assert_eq!(odd.skipped.len(), 3, "{:?}", odd.skipped);
    assert!(odd.skipped.iter().any(|s| s.contains("mirostat") && s.contains("no such sampler")), "{:?}", odd.skipped);
}
