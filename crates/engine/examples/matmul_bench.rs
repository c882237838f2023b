//! One quantized matmul alone, for kernel work: a random ROWS × COLS weight of TYPE against N activation
//! rows, median over repetitions; prints ns per (weight row, token) and GB/s of weights read. Packed
//! numerics unless RECKON_NUMERICS=ggml (as the engine).
//! matmul_bench TYPE ROWS COLS N [REPS] [THREADS], e.g. `matmul_bench q4_1 1536 576 8`.
use reckon_engine::matmul::QMatrix;
use reckon_engine::model::Numerics;
use reckon_engine::quant::{packed, GgmlType};
use std::time::Instant;

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let dtype = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K]
        .into_iter()
        .find(|t| t.name().eq_ignore_ascii_case(&a[0]))
        .expect("type: q4_0 q4_1 q5_0 q8_0 q4_k q6_k");
    let num = |i: usize, d: usize| a.get(i).map(|s| s.parse().expect("a number")).unwrap_or(d);
    let (rows, cols, n, reps) = (num(1, 1536), num(2, 576), num(3, 8), num(4, 200));
    reckon_engine::pool::init_global(num(5, 2));
    let mut rng = reckon_engine::sampler::Rng::new(7);
    let mut rnd = move || rng.next_f64() as f32 * 2.0 - 1.0;
    let row_bytes = dtype.row_bytes(cols).expect("cols a multiple of the block");
    // Random quants; every block's f16 scales set to 0.01 so no value is odd.
    let mut w: Vec<u8> = (0..rows * row_bytes).map(|_| (rnd() * 127.0) as i8 as u8).collect();
    let scale_offsets: &[usize] = match dtype {
        GgmlType::Q4_1 | GgmlType::Q4_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => &[0],
    };
    for block in w.chunks_exact_mut(dtype.block_bytes()) {
        for &o in scale_offsets {
            block[o..o + 2].copy_from_slice(&0x211Fu16.to_le_bytes());
        }
    }
    let numerics = Numerics::from_env();
    let pm = (numerics == Numerics::Packed).then(|| packed::pack(dtype, rows, cols, &w));
    let m = QMatrix { dtype, rows, cols, bytes: &w, packed: pm.as_ref() };
    let x: Vec<f32> = (0..n * cols).map(|_| rnd()).collect();
    let (mut xq, mut out) = (Vec::new(), vec![0.0; n * rows]);
    let mut times = Vec::new();
    for _ in 0..reps + 3 {
        let t = Instant::now();
        m.matmul(&x, &mut xq, &mut out);
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let s = times[times.len() / 2];
    println!("{} {rows}x{cols} n={n} ({}): {:.1} us, {:.2} ns per row-token, {:.1} GB/s of weights", dtype.name(), numerics.name(), s * 1e6, s * 1e9 / (rows * n) as f64, (rows * row_bytes) as f64 / s / 1e9);
}
