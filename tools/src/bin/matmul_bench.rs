//! One quantized matmul alone, for kernel work: a random ROWS × COLS weight of TYPE against N activation
//! rows, median over repetitions; prints ns per (weight row, token) and GB/s of weights read. Packed
//! numerics unless RECKON_NUMERICS=ggml (as the engine), the packed weights in an arena on 2 MiB pages
//! as the engine's are. To stream from DRAM as decode does, make the matrix several times the L3 (e.g.
//! `q4_k 131072 4096 1 20`: 302 MB).
//! matmul_bench TYPE ROWS COLS N [REPS] [THREADS], e.g. `matmul_bench q4_1 1536 576 8`.
//! PREP=1 times only the activation preparation of the packed kernels on one thread (N rows of COLS), the
//! fused quantization with side entries against quantizing then reading the sides back, alternating.
use reckon_engine::kernels::matmul::QMatrix;
use reckon_engine::model::Numerics;
use reckon_engine::kernels::ggml::GgmlType;
use reckon_engine::kernels::packed;
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
    if std::env::var_os("PREP").is_some() {
        return prep_bench(dtype, cols, n, reps);
    }
    reckon_tools::init_process();
    let numerics = reckon_tools::numerics();
    let pm = (numerics == Numerics::Packed).then(|| {
        let shape = packed::PackedShape::new(dtype, rows, cols);
        let mut arena = reckon_engine::huge_buf::HugeBuf::zeroed(shape.lines());
        packed::pack_into(dtype, rows, cols, &w, &|_| {}, &mut arena);
        packed::PackedMatrix::in_arena(shape, std::sync::Arc::new(arena), 0)
    });
    let m = QMatrix { dtype, rows, cols, bytes: &w, packed: pm.as_ref() };
    let x: Vec<f32> = (0..n * cols).map(|_| rnd()).collect();
    let (mut xq, mut out) = (Vec::new(), vec![0.0; n * rows]);
    let mut times = Vec::new();
    for _ in 0..reps + 3 {
        let t = Instant::now();
        m.matmul(&x, &mut xq, &mut out);
        times.push(t.elapsed().as_secs_f64());
    }
    let s = reckon_lab::stats::median(&times);
    println!("{} {rows}x{cols} n={n} ({}): {:.1} us, {:.2} ns per row-token, {:.1} GB/s of weights", dtype.name(), numerics.name(), s * 1e6, s * 1e9 / (rows * n) as f64, (rows * row_bytes) as f64 / s / 1e9);
}

/// PREP=1: ns per activation block, fused (`quantize_row_legacy_with_sides`) against separate
/// (`quantize_row_ggml_x86` + `ActSide::fill_token`), medians over alternating repetitions.
fn prep_bench(dtype: GgmlType, cols: usize, n: usize, reps: usize) {
    use reckon_engine::kernels::packed::ActSide;
    use reckon_engine::kernels::ggml::{quantize_row_ggml_x86, quantize_row_legacy_with_sides};
    let act = dtype.dot_activation_type();
    let ab = act.row_bytes(cols).expect("cols a multiple of the block");
    let mut rng = reckon_engine::sampler::Rng::new(9);
    let x: Vec<f32> = (0..n * cols).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect();
    let mut xq = vec![0u8; n * ab];
    let mut side = ActSide::default();
    side.shape(act, cols, n);
    let blocks = side.blocks;
    let (mut fused, mut separate) = (Vec::new(), Vec::new());
    for _ in 0..reps + 3 {
        let t = Instant::now();
        for (tok, (row, q)) in x.chunks_exact(cols).zip(xq.chunks_exact_mut(ab)).enumerate() {
            assert!(quantize_row_legacy_with_sides(act, row, q, &mut side.legacy[tok * blocks..(tok + 1) * blocks]), "{act}: no fused path");
        }
        fused.push(t.elapsed().as_secs_f64());
        let ptrs = side.ptrs();
        let t = Instant::now();
        for (tok, (row, q)) in x.chunks_exact(cols).zip(xq.chunks_exact_mut(ab)).enumerate() {
            quantize_row_ggml_x86(act, row, q);
            // SAFETY: shaped for n tokens of `act`; one writer.
            unsafe { ActSide::fill_token(act, blocks, ptrs, tok, q) };
        }
        separate.push(t.elapsed().as_secs_f64());
    }
    let per_block = |v: &[f64]| reckon_lab::stats::median(v) * 1e9 / (n * blocks) as f64;
    println!("{act} {n}x{cols}: fused {:.1} ns per block, separate {:.1} ns per block", per_block(&fused), per_block(&separate));
}
