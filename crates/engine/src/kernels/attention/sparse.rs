//! Which history blocks each query of a step reads under sparse attention (`kv::sparse`): Quest's
//! upper bound of q·k over a block, from the per-dimension minimum and maximum of its keys
//! (`KvStorage::key_bounds`): `Σ_d max(q_d · min_d, q_d · max_d)`, one per query head (`head_bound`).
//!
//! A block's score is its best head's bound less that head's best bound over the candidates (the
//! log of the largest share of the head's softmax the block could take, before the scale), so a head
//! with small logits still gets the blocks it needs. The sum runs in 16 lanes over the dimensions (lane
//! `d % 16`), added by a fixed tree, the same bits on every ISA, so the picks (and the output) are too.

use super::QueryPos;
use crate::kv::{KvStorage, SparseAttention};
use crate::pool;
use crate::kernels::cpu::SimdLevel;
use std::sync::OnceLock;

/// The tables the queries of a step read through under sparse attention: one per block of queries (of
/// one sequence) at depth, shared by its queries, so the attention kernels tile them together.
#[derive(Debug, Default)]
pub struct SparseViews {
    tables: Vec<Vec<u32>>,
    /// Per query: its table in `tables` and its position in it, or none where it reads its own table.
    at: Vec<Option<(usize, usize)>>,
}

impl SparseViews {
    /// `queries` as the attention kernels read them: through their views, where they have one.
    pub fn apply<'a>(&'a self, queries: &[QueryPos<'a>]) -> Vec<QueryPos<'a>> {
        queries.iter().zip(&self.at).map(|(qp, at)| at.map_or(*qp, |(v, pos)| QueryPos { block_table: &self.tables[v], pos })).collect()
    }

    /// Query `t`'s view and its position in it, if it has one.
    pub fn view(&self, t: usize) -> Option<(&[u32], usize)> {
        self.at[t].map(|(v, pos)| (self.tables[v].as_slice(), pos))
    }
}

/// One block of queries at depth in a step: a sequence's table, the block index `j`, its candidates,
/// the step's queries in it (ascending), and which of them picks (the leader, at `j * bs`; else the
/// first, when no pick is kept for the block).
struct Group<'a> {
    table: &'a [u32],
    j: usize,
    candidates: std::ops::Range<usize>,
    queries: Vec<usize>,
    picker: Option<usize>,
}

/// The views of `queries` (their rotated q: `[n, n_heads * head_dim]`) in `layer`. The queries of a
/// block share its leader's picks: computed here when the leader is in the step (and kept,
/// `KvStorage::set_sparse_pick`), else read back. The candidates of those that pick get their key
/// bounds refreshed first.
pub fn select(sparse: &SparseAttention, n_heads: usize, kv: &mut KvStorage, layer: usize, queries: &[QueryPos], q: &[f32]) -> SparseViews {
    let bs = kv.shape.block_size;
    let mut groups: Vec<Group> = Vec::new();
    for (t, qp) in queries.iter().enumerate() {
        let candidates = sparse.candidates(qp.pos, bs);
        if candidates.is_empty() {
            continue;
        }
        let j = qp.pos / bs;
        let g = match groups.iter().position(|g| g.j == j && std::ptr::eq(g.table, qp.block_table)) {
            Some(g) => g,
            None => {
                groups.push(Group { table: qp.block_table, j, candidates, queries: Vec::new(), picker: None });
                groups.len() - 1
            }
        };
        groups[g].queries.push(t);
    }
    if groups.is_empty() {
        return SparseViews { tables: Vec::new(), at: vec![None; queries.len()] };
    }
    // who picks: the leader if it is here; else nobody, where its picks are kept; else (a block whose
    // leader ran before its picks were kept, which a request's steps do not produce) the first query
    for g in groups.iter_mut() {
        let leader = g.queries.iter().copied().find(|&t| queries[t].pos == g.j * bs);
        g.picker = leader.or_else(|| kv.sparse_pick(layer, g.table[g.j]).is_none().then_some(g.queries[0]));
    }
    let mut blocks: Vec<u32> = groups.iter().filter(|g| g.picker.is_some()).flat_map(|g| g.table[g.candidates.clone()].iter().copied()).collect();
    blocks.sort_unstable();
    blocks.dedup();
    kv.refresh_key_bounds(layer, &blocks);
    let picks = pick_groups(sparse, n_heads, kv, layer, queries, q, &groups);
    let mut views = SparseViews { tables: Vec::with_capacity(groups.len()), at: vec![None; queries.len()] };
    for (g, picked) in groups.iter().zip(picks) {
        let picked: Vec<usize> = match picked {
            Some(p) => {
                if g.picker.is_some_and(|t| queries[t].pos == g.j * bs) {
                    kv.set_sparse_pick(layer, g.table[g.j], &p);
                }
                p
            }
            None => kv.sparse_pick(layer, g.table[g.j]).expect("a kept pick").iter().map(|&i| i as usize).collect(),
        };
        let (table, leader_pos) = sparse.view(g.table, &picked, g.j * bs, bs);
        for &t in &g.queries {
            views.at[t] = Some((views.tables.len(), leader_pos + queries[t].pos - g.j * bs));
        }
        views.tables.push(table);
    }
    views
}

/// The picks of the groups that pick (`Group::picker`), in parallel; none for the others.
fn pick_groups(sparse: &SparseAttention, n_heads: usize, kv: &KvStorage, layer: usize, queries: &[QueryPos], q: &[f32], groups: &[Group]) -> Vec<Option<Vec<usize>>> {
    let bs = kv.shape.block_size;
    let (hd, kv_dim) = (kv.shape.head_dim, kv.shape.kv_dim);
    let q_dim = n_heads * hd;
    let group = n_heads / (kv_dim / hd);
    let out: Vec<OnceLock<Vec<usize>>> = (0..groups.len()).map(|_| OnceLock::new()).collect();
    let work: Vec<usize> = (0..groups.len()).filter(|&g| groups[g].picker.is_some()).collect();
    let parts = work.len().min(4 * pool::current().threads());
    let level = crate::kernels::cpu::simd_level();
    pool::current().run(parts, &|p| {
        let (mut bound, mut scores, mut qq) = (Vec::new(), Vec::new(), vec![0f32; 2 * q_dim]);
        for &gi in &work[p * work.len() / parts..(p + 1) * work.len() / parts] {
            let (g, c) = (&groups[gi], groups[gi].candidates.clone());
            let t = g.picker.expect("a picking group");
            // each head's q split by sign, `[n_heads][2][hd]`: positive parts meet the maximums, negative
            // parts the minimums
            for (h, qh) in q[t * q_dim..(t + 1) * q_dim].chunks_exact(hd).enumerate() {
                let (pos, neg) = qq[2 * h * hd..2 * (h + 1) * hd].split_at_mut(hd);
                qh.iter().zip(pos.iter_mut().zip(neg.iter_mut())).for_each(|(&x, (p, n))| (*p, *n) = (x.max(0.0), x.min(0.0)));
            }
            // bound[h][i]: head h's bound over candidate i
            bound.clear();
            bound.resize(n_heads * c.len(), 0.0);
            let job = Bounds { kv, layer, blocks: &queries[t].block_table[c.clone()], qq: &qq, n_heads, group, hd };
            match level {
                // SAFETY: the CPU has the level's features (`simd_level`); hd is a multiple of 16.
                #[cfg(target_arch = "x86_64")]
                SimdLevel::Avx512 if hd % 16 == 0 => unsafe { bounds_avx512(&job, &mut bound) },
                #[cfg(target_arch = "x86_64")]
                SimdLevel::Avx2 | SimdLevel::AvxVnni if hd % 16 == 0 => unsafe { bounds_avx2(&job, &mut bound) },
                _ => job.run(&mut bound),
            }
            scores.clear();
            scores.resize(c.len(), f32::NEG_INFINITY);
            for row in bound.chunks_exact(c.len()) {
                let best = row.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
                scores.iter_mut().zip(row).for_each(|(s, &x)| *s = s.max(x - best));
            }
            let _ = out[gi].set(sparse.pick(c, &scores, bs));
        }
    });
    out.into_iter().map(|v| v.into_inner()).collect()
}

/// One query's bounds over its candidate blocks, computed once per SIMD level (`run`,
/// `bounds_avx512`, `bounds_avx2`): the same fused multiply-adds in the same order, so each level gives
/// the same bits.
struct Bounds<'a> {
    kv: &'a KvStorage,
    layer: usize,
    /// The candidates' block ids.
    blocks: &'a [u32],
    /// `[n_heads][2][hd]`: each head's q, positive parts then negative parts.
    qq: &'a [f32],
    n_heads: usize,
    group: usize,
    hd: usize,
}

impl Bounds<'_> {
    /// `(pos, neg)` of head `h`, and the offset of its KV head's dimensions in a block's bounds.
    #[inline(always)]
    fn head(&self, h: usize) -> (&[f32], &[f32], usize) {
        let (pos, neg) = self.qq[2 * h * self.hd..2 * (h + 1) * self.hd].split_at(self.hd);
        (pos, neg, (h / self.group) * self.hd)
    }

    /// Block `i`'s bounds: minimums and maximums, `[kv_dim]` each.
    #[inline(always)]
    fn block(&self, i: usize) -> (&[f32], &[f32]) {
        self.kv.key_bounds(self.layer, self.blocks[i]).split_at(self.kv.shape.kv_dim)
    }

    /// `bound[h * blocks + i]`: head `h`'s bound over block `i` (`head_bound`).
    fn run(&self, bound: &mut [f32]) {
        let n = self.blocks.len();
        for i in 0..n {
            let (lo, hi) = self.block(i);
            for h in 0..self.n_heads {
                let (pos, neg, g) = self.head(h);
                bound[h * n + i] = head_bound(pos, neg, &lo[g..g + self.hd], &hi[g..g + self.hd]);
            }
        }
    }
}

impl Bounds<'_> {
    /// `run` by the vector forms: blocks by fours, whose four bounds `four` computes for one head (its
    /// `pos`, `neg` and KV head offset) with one shared reduction. A last group of fewer than four
    /// repeats its last block.
    #[inline(always)]
    fn by_fours(&self, bound: &mut [f32], four: impl Fn(&[f32], &[f32], usize, &[(&[f32], &[f32]); 4]) -> [f32; 4]) {
        let n = self.blocks.len();
        for i in (0..n).step_by(4) {
            let k = (n - i).min(4);
            let blocks: [(&[f32], &[f32]); 4] = std::array::from_fn(|j| self.block(i + j.min(k - 1)));
            for h in 0..self.n_heads {
                let (pos, neg, g) = self.head(h);
                let out = four(pos, neg, g, &blocks);
                bound[h * n + i..h * n + i + k].copy_from_slice(&out[..k]);
            }
        }
    }
}

/// `Bounds::run` with AVX-512 (head sizes a multiple of 16): the 16 lanes in one register.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn bounds_avx512(job: &Bounds, bound: &mut [f32]) {
    use std::arch::x86_64::*;
    job.by_fours(bound, |pos, neg, g, blocks| {
        // SAFETY: every slice holds at least hd values from `g`, hd a multiple of 16 (checked by the
        // caller); AVX-512F is enabled.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); 4];
            for d in (0..pos.len()).step_by(16) {
                let (p, q) = (_mm512_loadu_ps(pos.as_ptr().add(d)), _mm512_loadu_ps(neg.as_ptr().add(d)));
                for (acc, (lo, hi)) in acc.iter_mut().zip(blocks) {
                    let up = _mm512_fmadd_ps(p, _mm512_loadu_ps(hi.as_ptr().add(g + d)), *acc);
                    *acc = _mm512_fmadd_ps(q, _mm512_loadu_ps(lo.as_ptr().add(g + d)), up);
                }
            }
            // lanes l + 8 (two blocks a register), then l + 4 (four blocks a register), l + 2, l + 1
            let halves = |a: __m512, b: __m512| _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
            let (ab, cd) = (halves(acc[0], acc[1]), halves(acc[2], acc[3]));
            let x4 = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
            let x2 = _mm512_add_ps(x4, _mm512_permute_ps(x4, 0xEE));
            let x1 = _mm512_add_ps(x2, _mm512_permute_ps(x2, 0x55));
            let mut out = [0f32; 16];
            _mm512_storeu_ps(out.as_mut_ptr(), x1);
            [out[0], out[4], out[8], out[12]]
        }
    })
}

/// `Bounds::run` with AVX2 and FMA (head sizes a multiple of 16): lanes 0-7 and 8-15 in two registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn bounds_avx2(job: &Bounds, bound: &mut [f32]) {
    use std::arch::x86_64::*;
    job.by_fours(bound, |pos, neg, g, blocks| {
        // SAFETY: as in `bounds_avx512`; AVX2 and FMA are enabled.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 2]; 4];
            for at in (0..pos.len()).step_by(8) {
                let half = (at / 8) % 2;
                let (p, q) = (_mm256_loadu_ps(pos.as_ptr().add(at)), _mm256_loadu_ps(neg.as_ptr().add(at)));
                for (acc, (lo, hi)) in acc.iter_mut().zip(blocks) {
                    let up = _mm256_fmadd_ps(p, _mm256_loadu_ps(hi.as_ptr().add(g + at)), acc[half]);
                    acc[half] = _mm256_fmadd_ps(q, _mm256_loadu_ps(lo.as_ptr().add(g + at)), up);
                }
            }
            // lanes l + 8, then l + 4 (two blocks a register), l + 2, l + 1
            let x8 = acc.map(|a| _mm256_add_ps(a[0], a[1]));
            let pair = |a: __m256, b: __m256| {
                let x4 = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
                let x2 = _mm256_add_ps(x4, _mm256_permute_ps(x4, 0xEE));
                _mm256_add_ps(x2, _mm256_permute_ps(x2, 0x55))
            };
            let mut out = [0f32; 16];
            _mm256_storeu_ps(out.as_mut_ptr(), pair(x8[0], x8[1]));
            _mm256_storeu_ps(out.as_mut_ptr().add(8), pair(x8[2], x8[3]));
            [out[0], out[4], out[8], out[12]]
        }
    })
}

/// `Σ_d max(q_d · lo_d, q_d · hi_d)` over the head's dimensions, as `pos_d · hi_d + neg_d · lo_d` with
/// `pos = max(q, 0)` and `neg = min(q, 0)`: lane `d % 16` runs `acc = fma(neg_d, lo_d, fma(pos_d,
/// hi_d, acc))` over its dimensions in order, then the lanes are added by halves (8, 4, 2, 1).
fn head_bound(pos: &[f32], neg: &[f32], lo: &[f32], hi: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for (d, (((&p, &n), &lo), &hi)) in pos.iter().zip(neg).zip(lo).zip(hi).enumerate() {
        acc[d % 16] = n.mul_add(lo, p.mul_add(hi, acc[d % 16]));
    }
    for w in [8, 4, 2, 1] {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KeyLayout, KvDtypes, KvShape};

    fn storage(key_layout: KeyLayout, blocks: usize) -> KvStorage {
        let mut kv = KvStorage::new(KvShape { num_layers: 2, kv_dim: 64, head_dim: 32, block_size: 16, num_blocks: blocks, dtypes: KvDtypes::F16, key_layout });
        kv.keep_sparse_state(1);
        kv
    }

    /// The bound is never below a real score, in either key layout; a write makes the block's bounds stale.
    #[test]
    fn bounds_hold_every_key_of_the_block_and_follow_writes() {
        for key_layout in [KeyLayout::Rows, KeyLayout::ByDim] {
            let mut kv = storage(key_layout, 4);
            let key = |slot: usize, i: usize| ((slot * 64 + i) as f32 * 0.37).sin() * (1.0 + (i % 5) as f32);
            for slot in 0..64 {
                let k: Vec<f32> = (0..64).map(|i| key(slot, i)).collect();
                kv.write(1, slot, &k, &k);
            }
            kv.refresh_key_bounds(1, &[2, 0]);
            let q: Vec<f32> = (0..32).map(|d| (d as f32 * 1.3).cos()).collect();
            for slot in (0..16).chain(32..48) {
                let b = (slot / 16) as u32;
                let (lo, hi) = kv.key_bounds(1, b).split_at(64);
                for i in 0..64 {
                    let x = half::f16::from_f32(key(slot, i)).to_f32();
                    assert!(lo[i] <= x && x <= hi[i], "{key_layout:?}: slot {slot} dim {i}");
                }
                for h in 0..2 {
                    let k = kv.key_row(1, slot);
                    let score: f32 = (0..32).map(|d| q[d] * k[h * 32 + d].to_f32()).sum();
                    let (pos, neg): (Vec<f32>, Vec<f32>) = q.iter().map(|&x| (x.max(0.0), x.min(0.0))).unzip();
                    assert!(head_bound(&pos, &neg, &lo[h * 32..h * 32 + 32], &hi[h * 32..h * 32 + 32]) >= score - 1e-4);
                }
            }
            // a new key far outside block 2's range: stale until refreshed, then held
            kv.write(1, 33, &[100.0; 64], &[0.0; 64]);
            kv.refresh_key_bounds(1, &[2]);
            assert_eq!(kv.key_bounds(1, 2)[64..].iter().copied().fold(f32::NEG_INFINITY, f32::max), 100.0);
        }
    }

    /// Quantized keys' bounds are the range of the keys as the attention kernels read them (`q · d`),
    /// reached by some cell in each dimension; a write makes them stale, as for f16 keys.
    #[test]
    fn quantized_keys_bound_what_attention_reads() {
        for dtypes in ["q8_0", "q4_0", "q8_0,q4_0"] {
            let dtypes = KvDtypes::parse(dtypes).unwrap();
            let mut kv = KvStorage::new(KvShape { num_layers: 2, kv_dim: 64, head_dim: 32, block_size: 16, num_blocks: 4, dtypes, key_layout: KeyLayout::Rows });
            kv.keep_sparse_state(1);
            for slot in 0..64 {
                let k: Vec<f32> = (0..64).map(|i| ((slot * 64 + i) as f32 * 0.37).sin() * (1.0 + (i % 5) as f32)).collect();
                kv.write(1, slot, &k, &k);
            }
            kv.refresh_key_bounds(1, &[3, 1]);
            for b in [1u32, 3] {
                let layer = kv.layer_quant(1).unwrap();
                let (mut q, mut d) = (vec![0; 32], vec![0.0; 1]);
                let (mut lo, mut hi) = (vec![f32::INFINITY; 64], vec![f32::NEG_INFINITY; 64]);
                for h in 0..2 {
                    let at = layer.region_at(&layer.k, b, h);
                    for c in 0..16 {
                        layer.k.read(&layer.keys[at..at + layer.k.bytes()], c, true, &mut q, &mut d);
                        for i in 0..32 {
                            lo[h * 32 + i] = lo[h * 32 + i].min(q[i] as f32 * d[0]);
                            hi[h * 32 + i] = hi[h * 32 + i].max(q[i] as f32 * d[0]);
                        }
                    }
                }
                let (got_lo, got_hi) = kv.key_bounds(1, b).split_at(64);
                assert_eq!((got_lo, got_hi), (&lo[..], &hi[..]), "{}: block {b}", dtypes.name());
            }
            kv.write(1, 17, &[100.0; 64], &[0.0; 64]);
            kv.refresh_key_bounds(1, &[1]);
            assert!(kv.key_bounds(1, 1)[64..].iter().all(|&x| (x - 100.0).abs() < 1.0), "{}: the new key's range", dtypes.name());
        }
    }

    /// The vector forms of the bound give the scalar definition's bits.
    #[test]
    fn vector_bounds_equal_the_scalar_ones_bit_for_bit() {
        let mut kv = storage(KeyLayout::ByDim, 6);
        for slot in 0..96 {
            let k: Vec<f32> = (0..64).map(|i| ((slot * 131 + i * 17) as f32 * 0.61).sin() * 3.0).collect();
            kv.write(0, slot, &k, &k);
        }
        let blocks = [5u32, 0, 3, 1, 2, 4];
        kv.refresh_key_bounds(0, &blocks);
        let qq: Vec<f32> = (0..4 * 2 * 32).map(|i| ((i * 7) as f32 * 0.37).cos() * 2.0).map(|x| if (x * 10.0) as i32 % 3 == 0 { 0.0 } else { x }).collect();
        let job = Bounds { kv: &kv, layer: 0, blocks: &blocks, qq: &qq, n_heads: 4, group: 2, hd: 32 };
        let mut want = vec![0.0; 24];
        job.run(&mut want);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        #[cfg(target_arch = "x86_64")]
        {
            if crate::kernels::cpu::SimdLevel::Avx2.is_available() {
                let mut got = vec![0.0; 24];
                // SAFETY: AVX2 is available; hd 32.
                unsafe { bounds_avx2(&job, &mut got) };
                assert_eq!(bits(&got), bits(&want), "avx2");
            }
            if crate::kernels::cpu::SimdLevel::Avx512.is_available() {
                let mut got = vec![0.0; 24];
                // SAFETY: AVX-512 is available; hd 32.
                unsafe { bounds_avx512(&job, &mut got) };
                assert_eq!(bits(&got), bits(&want), "avx512");
            }
        }
    }

    /// A block's leader whose q matches one history block's keys picks it; the view runs sinks, picks,
    /// local; the block's later queries read the leader's picks, in its step or a later one.
    #[test]
    fn a_leader_picks_the_block_that_matches_it_for_its_whole_block() {
        let sparse = SparseAttention { budget: 16, local: 16, sinks: 16 };
        let mut kv = storage(KeyLayout::ByDim, 8);
        // 6 blocks of small keys, but block 3 (table entry 3 → id 5) holds a large one along dim 7 of
        // each KV head, where each head's q points
        let table: Vec<u32> = vec![2, 3, 4, 5, 6, 7];
        for pos in 0..96 {
            let mut k = vec![0.01 * ((pos % 7) as f32 - 3.0); 64];
            if pos == 50 {
                (k[7], k[39]) = (8.0, 8.0);
            }
            // and block 1 (id 3) one along dim 8
            if pos == 20 {
                (k[8], k[40]) = (8.0, 8.0);
            }
            kv.write(0, kv.slot(&table, pos), &k, &k);
        }
        let mut qv = vec![0.0f32; 2 * 32];
        (qv[7], qv[39]) = (1.0, 1.0);
        // block 5's leader (80) and a later query: candidates 1..4 (local: block 4); budget one block
        assert_eq!(sparse.candidates(80, 16), 1..4);
        let queries = [QueryPos { block_table: &table, pos: 80 }, QueryPos { block_table: &table, pos: 81 }];
        let q2: Vec<f32> = qv.iter().chain(&vec![0.0; 64]).copied().collect();
        let views = select(&sparse, 2, &mut kv, 0, &queries, &q2);
        assert_eq!(views.view(0), Some((&[2, 5, 6, 7][..], 2 * 16 + 80 - 64)));
        assert_eq!(views.view(1), Some((&[2, 5, 6, 7][..], 2 * 16 + 81 - 64)));
        // one table for both, so the kernels tile them together
        let read = views.apply(&queries);
        assert!(std::ptr::eq(read[0].block_table, read[1].block_table));
        // a later step's query of the block reads the leader's picks, whatever its own q (here along
        // dim 8: on its own it would pick block 1)
        let later = [QueryPos { block_table: &table, pos: 89 }];
        let mut other = vec![0.0f32; 64];
        (other[8], other[40]) = (1.0, 1.0);
        assert_eq!(select(&sparse, 2, &mut kv, 0, &later, &other).view(0), Some((&[2, 5, 6, 7][..], 2 * 16 + 89 - 64)));
        // the kept picks go with the block's keys (a restore from the disk tier replaces them); then the
        // block's first query in the step picks
        let bytes = kv.read_block(7);
        kv.write_block(7, &bytes);
        assert_eq!(kv.sparse_pick(0, 7), None);
        assert_eq!(select(&sparse, 2, &mut kv, 0, &later, &other).view(0), Some((&[2, 3, 6, 7][..], 2 * 16 + 89 - 64)));
        // a short query reads its table
        let short = [QueryPos { block_table: &table, pos: 40 }];
        assert_eq!(select(&sparse, 2, &mut kv, 0, &short, &qv).view(0), None);
    }
}
