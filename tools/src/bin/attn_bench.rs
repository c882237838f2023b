//! Attention alone, for kernel work: one layer's prefill attention of N query tokens at a depth, on
//! random K/V, timed over repetitions (median). attn_bench HEADS KV_HEADS HEAD_DIM DEPTH N [REPS] [THREADS] [WINDOW]
//! With `KV_DTYPE=q8_0` (or q4_0) over quantized cells; with `PER_HEAD=1` in the environment it times the per-head reference path instead; with `DECODE=1`,
//! N sequences decoding one token each at DEPTH.
//! e.g. SmolLM2: `attn_bench 9 3 64 4096 256`. Prints ns per (query, head, key).
use reckon_engine::kernels::attention::{attend, attend_per_head_path, AttnShape, QueryPos};
use reckon_engine::kv::{KeyLayout, KvShape, KvStorage};
use std::time::Instant;

fn main() {
    let a: Vec<usize> = std::env::args().skip(1).map(|s| s.parse().expect("numbers")).collect();
    let (n_heads, n_kv_heads, head_dim, depth, n) = (a[0], a[1], a[2], a[3], a[4]);
    let reps = a.get(5).copied().unwrap_or(20);
    reckon_tools::init_process();
    reckon_engine::pool::init_global(a.get(6).copied().unwrap_or(1));
    let window = a.get(7).copied().filter(|&w| w > 0);
    let values_in_key_order = std::env::var("RECKON_NUMERICS").as_deref() != Ok("ggml");
    let shape = AttnShape { n_heads, n_kv_heads, head_dim, scale: 0.125, window, values_in_key_order };
    // the packed numerics' keys are stored by dimension
    let key_layout = if values_in_key_order { KeyLayout::ByDim } else { KeyLayout::Rows };
    let per_head = std::env::var_os("PER_HEAD").is_some();
    let bs = 16;
    // KV_DTYPE=q8_0 (or q4_0, or `K,V`): quantized cells.
    let dtypes = reckon_engine::kv::KvDtypes::parse(&std::env::var("KV_DTYPE").unwrap_or_else(|_| "f16".into())).expect("KV_DTYPE");
    let total = depth + n;
    let kv_dim = n_kv_heads * head_dim;
    let mut kv = KvStorage::new(KvShape { num_layers: 1, kv_dim, head_dim, block_size: bs, num_blocks: total.div_ceil(bs), dtypes, key_layout });
    let table: Vec<u32> = (0..total.div_ceil(bs) as u32).collect();
    let mut rng = reckon_engine::sampler::Rng::new(1);
    let mut rnd = move || rng.next_f64() as f32 * 2.0 - 1.0;
    for pos in 0..total {
        let k: Vec<f32> = (0..kv_dim).map(|_| rnd()).collect();
        let v: Vec<f32> = (0..kv_dim).map(|_| rnd()).collect();
        kv.write(0, kv.slot(&table, pos), &k, &v);
    }
    // DECODE=1: N sequences decoding one token each at DEPTH (sharing one cache, as a decode batch's shape).
    let decode = std::env::var_os("DECODE").is_some();
    let queries: Vec<QueryPos> = if decode {
        (0..n).map(|_| QueryPos { block_table: &table, pos: depth }).collect()
    } else {
        (depth..total).map(|pos| QueryPos { block_table: &table, pos }).collect()
    };
    let q: Vec<f32> = (0..n * n_heads * head_dim).map(|_| rnd()).collect();
    let mut out = vec![0.0; q.len()];
    let mut times = Vec::new();
    for _ in 0..reps + 1 {
        let t = Instant::now();
        if per_head {
            attend_per_head_path(&shape, &kv, 0, &queries, &q, &mut out);
        } else {
            attend(&shape, &kv, 0, &queries, &q, &mut out);
        }
        times.push(t.elapsed().as_secs_f64());
    }
    times.remove(0);
    times.sort_by(|a, b| a.total_cmp(b));
    let cells = if decode { (depth + 1) as f64 } else { depth as f64 + n as f64 / 2.0 } * n as f64 * n_heads as f64;
    let med = reckon_lab::stats::median(&times);
    println!("median {:.2} ms  ({:.3} ns per query·head·key, min {:.2} ms, max {:.2} ms)", med * 1e3, med * 1e9 / cells, times[0] * 1e3, times[times.len() - 1] * 1e3);
}
