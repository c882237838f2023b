//! Attention over quantized KV cells (`kv::quant`, `--kv-dtype q8_0|q4_0`): one arithmetic under both
//! numerics (the ggml numerics' bit-identity to llama.cpp is a property of f16 KV; llama.cpp quantizes V
//! only under flash attention, whose online softmax orders the sums differently).
//!
//! The definition, per query row (token, head) over its cells `lo..=pos`, which `reference` spells out
//! and every SIMD path reproduces bit for bit:
//! - q is quantized per 32 values as q8_0 with an f32 scale `dq = amax / 127`, `qi = round(q / dq)`.
//! - score(c) = Σ_b (dq_b · dk_b(c)) · isum_b(c) over the 32-value blocks b in order (f32, not fused;
//!   the first term as it is), where `isum_b = Σ qi · ki` is exact in i32 whatever the order of its adds;
//!   then times the attention scale.
//! - ggml's softmax over the row's cells (`soft_max`), as the f16 path.
//! - out[d] = Σ_c w_c · x_c[d], x the exact dequantized value (`q · f16(d)` fits in f32), one FMA chain
//!   per d over each run of `RUN` positions, the runs' sums added in order (the packed numerics' value
//!   order, `key_order`).
//!
//! The integer score is what makes quantized keys cheaper than f16 ones, not only smaller: 16 cells of
//! the same 4 dims sit side by side (`kv::quant`'s key layout), so one VNNI instruction does 64
//! multiply-adds for 16 cells and no horizontal sum is needed.

use super::{AttnShape, OutPtr, QueryPos, RUN};
use crate::kernels::ggml::math::soft_max;
use crate::kv::quant::Region;
use crate::kv::QuantLayer;

/// One query row quantized for the integer score dots: `[hd]` i8, and per 32-value block its scale and
/// the sum of its quants (the score kernels that bias the keys to unsigned subtract `bias · Σq`).
pub(super) fn quantize_query(x: &[f32], q: &mut [i8], d: &mut [f32], sum: &mut [i32]) {
    for (b, xb) in x.chunks_exact(32).enumerate() {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let dq = amax / 127.0;
        let id = if dq != 0.0 { 1.0 / dq } else { 0.0 };
        let mut s = 0;
        for (qi, &v) in q[32 * b..32 * b + 32].iter_mut().zip(xb) {
            *qi = (v * id).round() as i8;
            s += *qi as i32;
        }
        (d[b], sum[b]) = (dq, s);
    }
}

/// The score of one row against cell `c` of a key region, before the attention scale.
fn score_ref(r: &Region, region: &[u8], c: usize, q: &[i8], dq: &[f32], kq: &mut [i32], kd: &mut [f32]) -> f32 {
    r.read(region, c, true, kq, kd);
    let mut s = 0.0f32;
    for b in 0..r.hd / 32 {
        let isum: i32 = (32 * b..32 * b + 32).map(|i| kq[i] * q[i] as i32).sum();
        let t = (dq[b] * kd[b]) * isum as f32;
        s = if b == 0 { t } else { s + t };
    }
    s
}

/// Attention of one (token, head) row as the module's definition says, one cell at a time: the
/// reference the SIMD paths are tested against, and the path of CPUs without AVX2.
pub(super) fn reference(shape: &AttnShape, kv: &QuantLayer, bs: usize, query: &QueryPos, head: usize, q: &[f32], out: &mut [f32]) {
    let hd = shape.head_dim;
    let kv_head = head / (shape.n_heads / shape.n_kv_heads);
    let nb = hd / 32;
    let (mut qi, mut dq, mut qs) = (vec![0i8; hd], vec![0f32; nb], vec![0i32; nb]);
    quantize_query(q, &mut qi, &mut dq, &mut qs);
    let (mut xq, mut xd) = (vec![0i32; hd], vec![0f32; nb]);
    let lo = shape.first_pos(query.pos);
    let cell = |pos: usize, r: &Region, data: &'_ [u8]| -> (usize, std::ops::Range<usize>) {
        let at = kv.region_at(r, query.block_table[pos / bs], kv_head);
        debug_assert!(at + r.bytes() <= data.len());
        (pos % bs, at..at + r.bytes())
    };
    let mut w: Vec<f32> = (lo..=query.pos)
        .map(|pos| {
            let (c, range) = cell(pos, &kv.k, kv.keys);
            score_ref(&kv.k, &kv.keys[range], c, &qi, &dq, &mut xq, &mut xd) * shape.scale
        })
        .collect();
    soft_max(&mut w, lo);
    let mut run = vec![0f32; hd];
    for start in (lo / RUN * RUN..=query.pos).step_by(RUN) {
        run.fill(0.0);
        for pos in start.max(lo)..(start + RUN).min(query.pos + 1) {
            let (c, range) = cell(pos, &kv.v, kv.values);
            kv.v.read(&kv.values[range], c, false, &mut xq, &mut xd);
            let p = w[pos - lo];
            for (d, acc) in run.iter_mut().enumerate() {
                *acc = p.mul_add(xq[d] as f32 * xd[d / 32], *acc);
            }
        }
        if start <= lo {
            out.copy_from_slice(&run);
        } else {
            out.iter_mut().zip(&run).for_each(|(o, &r)| *o += r);
        }
    }
}

/// `attend` over quantized cells: by tiles on CPUs with AVX2 (`x86`), else one row at a time.
pub(super) fn attend(shape: &AttnShape, kv: &QuantLayer, bs: usize, queries: &[QueryPos], q: &[f32], out: OutPtr) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::ggml::math::avx2_available() || crate::kernels::ggml::math::avx512_available() {
        return super::quant_x86::attend(shape, kv, bs, queries, q, out);
    }
    let (n_heads, hd) = (shape.n_heads, shape.head_dim);
    crate::pool::current().run(queries.len() * n_heads, &|i| {
        let out = out; // the whole wrapper (Sync), not its raw field
        // SAFETY: part i writes output row i alone; `attend` checked the output's length.
        let row = unsafe { std::slice::from_raw_parts_mut(out.0.add(i * hd), hd) };
        reference(shape, kv, bs, &queries[i / n_heads], i % n_heads, &q[i * hd..(i + 1) * hd], row);
    });
}

#[cfg(test)]
mod tests {
    use super::super::fixture::{batch, noise, three_sequences};
    use super::*;
    use crate::kv::{KvDtype, KvDtypes};

    /// The integer sums at their largest: q4_0 keys whose codes are 15 but one per block (a block of
    /// -8 and 31 sevens) against queries of ±127 everywhere, where the AVX2 path's i16 sums of a block
    /// come within 2,300 of overflowing; and q8_0 keys of -127 and ±111. Every path gives the
    /// reference's bits.
    #[test]
    fn quantized_scores_at_the_largest_codes_equal_the_reference() {
        use crate::kv::{KvShape, KvStorage};
        let (n_heads, n_kv_heads, hd, bs) = (2, 1, 64, 16);
        let shape = AttnShape { n_heads, n_kv_heads, head_dim: hd, scale: 0.001, window: None, values_in_key_order: true };
        for k in [KvDtype::Q4_0, KvDtype::Q8_0] {
            let mut kv = KvStorage::new(KvShape { num_layers: 1, kv_dim: hd, head_dim: hd, block_size: bs, num_blocks: 4, dtypes: KvDtypes { k, v: KvDtype::Q8_0 }, key_layout: Default::default() });
            let table: Vec<u32> = vec![2, 0, 3];
            let n = 40;
            for pos in 0..n {
                let key: Vec<f32> = (0..hd).map(|i| if i % 32 == 0 { -8.0 } else if k == KvDtype::Q4_0 || pos % 2 == 0 { 7.0 } else { -7.0 }).collect();
                let v: Vec<f32> = (0..hd).map(|i| noise(i + 100 * pos, 1.5)).collect();
                let slot = kv.slot(&table, pos);
                kv.write(0, slot, &key, &v);
            }
            let layer = kv.layer_quant(0).expect("quantized");
            let queries: Vec<QueryPos> = (0..n).map(|pos| QueryPos { block_table: &table, pos }).collect();
            for sign in [1.0f32, -1.0] {
                let q = vec![sign; n * n_heads * hd];
                let mut want = vec![0.0; q.len()];
                for (t, qp) in queries.iter().enumerate() {
                    for h in 0..n_heads {
                        let at = (t * n_heads + h) * hd;
                        reference(&shape, &layer, bs, qp, h, &q[at..at + hd], &mut want[at..at + hd]);
                    }
                }
                let mut got = vec![0.0; q.len()];
                attend(&shape, &layer, bs, &queries, &q, OutPtr(got.as_mut_ptr()));
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{k:?} keys, queries {sign}");
            }
        }
    }

    /// The dispatched path (AVX-512 VNNI, AVX2, or the reference itself) gives the reference's bits for
    /// every row: prefill tiles, a decode batch, lone tokens over long contexts (the phase split), a
    /// sliding window, GQA groups, head sizes 32/64/96/128/256, and each pair of quantized formats.
    #[test]
    fn quantized_attention_equals_its_reference() {
        let cases = [(9, 3, 64, None), (4, 1, 256, Some(40)), (14, 2, 64, None), (4, 2, 128, Some(1500)), (9, 3, 64, Some(600)), (8, 8, 64, None), (2, 1, 32, Some(8)), (4, 2, 96, None)];
        let dtypes = [(KvDtype::Q8_0, KvDtype::Q8_0), (KvDtype::Q4_0, KvDtype::Q4_0), (KvDtype::Q8_0, KvDtype::Q4_0), (KvDtype::Q4_0, KvDtype::Q8_0)];
        for (ci, &(n_heads, n_kv_heads, head_dim, window)) in cases.iter().enumerate() {
            let (k, v) = dtypes[ci % dtypes.len()];
            let shape = AttnShape { n_heads, n_kv_heads, head_dim, scale: 0.125, window, values_in_key_order: true };
            let kv_dim = n_kv_heads * head_dim;
            let bs = if ci % 2 == 0 { 16 } else { 32 };
            let (kv, tables) = three_sequences(kv_dim, head_dim, bs, KvDtypes { k, v }, Default::default());
            let layer = kv.layer_quant(0).expect("quantized");
            let queries = batch(&tables);
            let q_dim = n_heads * head_dim;
            let q: Vec<f32> = (0..queries.len() * q_dim).map(|i| 2.0 * noise(i, 3.3)).collect();
            let mut want = vec![0.0; q.len()];
            for (t, qp) in queries.iter().enumerate() {
                for h in 0..n_heads {
                    let at = t * q_dim + h * head_dim;
                    reference(&shape, &layer, bs, qp, h, &q[at..at + head_dim], &mut want[at..at + head_dim]);
                }
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let what = format!("heads {n_heads}/{n_kv_heads} hd {head_dim} window {window:?} bs {bs} {k:?}/{v:?}");
            let mut got = vec![0.0; q.len()];
            attend(&shape, &layer, bs, &queries, &q, OutPtr(got.as_mut_ptr()));
            assert_eq!(bits(&got), bits(&want), "{what}: batch");
            for (t, qp) in queries.iter().enumerate() {
                let mut one = vec![0.0; q_dim];
                attend(&shape, &layer, bs, std::slice::from_ref(qp), &q[t * q_dim..(t + 1) * q_dim], OutPtr(one.as_mut_ptr()));
                assert_eq!(bits(&one), bits(&want[t * q_dim..(t + 1) * q_dim]), "{what}: token {t} alone");
            }
            let picks = [44, 74, 94];
            let dq: Vec<QueryPos> = picks.iter().map(|&t| queries[t]).collect();
            let dqv: Vec<f32> = picks.iter().flat_map(|&t| q[t * q_dim..(t + 1) * q_dim].to_vec()).collect();
            let mut dec = vec![0.0; dqv.len()];
            attend(&shape, &layer, bs, &dq, &dqv, OutPtr(dec.as_mut_ptr()));
            for (i, &t) in picks.iter().enumerate() {
                assert_eq!(bits(&dec[i * q_dim..(i + 1) * q_dim]), bits(&want[t * q_dim..(t + 1) * q_dim]), "{what}: decode batch token {t}");
            }
            // and the reference is attention: f32 attention of the dequantized query over the dequantized
            // cells, up to rounding
            let qp = &queries[94];
            let (mut xq, mut xd) = (vec![0i32; head_dim], vec![0f32; head_dim / 32]);
            let lo = shape.first_pos(qp.pos);
            for h in [0, n_heads - 1] {
                let kvh = h / (n_heads / n_kv_heads);
                let (mut qi, mut dq, mut qs) = (vec![0i8; head_dim], vec![0f32; head_dim / 32], vec![0i32; head_dim / 32]);
                quantize_query(&q[94 * q_dim + h * head_dim..][..head_dim], &mut qi, &mut dq, &mut qs);
                let qh: Vec<f64> = (0..head_dim).map(|d| qi[d] as f64 * dq[d / 32] as f64).collect();
                let read = |r: &Region, data: &[u8], pos: usize, xq: &mut Vec<i32>, xd: &mut Vec<f32>| -> Vec<f64> {
                    let at = layer.region_at(r, qp.block_table[pos / bs], kvh);
                    r.read(&data[at..at + r.bytes()], pos % bs, std::ptr::eq(data, layer.keys), xq, xd);
                    (0..head_dim).map(|d| xq[d] as f64 * xd[d / 32] as f64).collect()
                };
                let s: Vec<f64> = (lo..=qp.pos).map(|p| read(&layer.k, layer.keys, p, &mut xq, &mut xd).iter().zip(&qh).map(|(a, b)| a * b).sum::<f64>() * 0.125).collect();
                let m = s.iter().copied().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                let mut o = vec![0f64; head_dim];
                for (i, p) in (lo..=qp.pos).enumerate() {
                    let x = read(&layer.v, layer.values, p, &mut xq, &mut xd);
                    o.iter_mut().zip(&x).for_each(|(o, x)| *o += e[i] / z * x);
                }
                let got = &want[94 * q_dim + h * head_dim..][..head_dim];
                let err = o.iter().zip(got).map(|(a, &b)| (a - b as f64).abs()).fold(0.0, f64::max);
                assert!(err < 1e-4, "{what}: head {h} differs from f64 attention by {err}");
            }
        }
    }
}
