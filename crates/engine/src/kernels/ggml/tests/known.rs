//! Hand-built blocks with known values, written from ggml's quantize_row_*_ref packing code, so the
//! layouts are checked by an encoder independent of the decoders. Plus quantize_row properties.

use super::*;

fn f16b(x: f32) -> [u8; 2] {
    f32_to_f16(x).to_le_bytes()
}

#[test]
fn q4_0_known() {
    let mut b = vec![0u8; Q4_0_BYTES];
    b[0..2].copy_from_slice(&f16b(0.5));
    for j in 0..16 {
        b[2 + j] = (j as u8) | ((15 - j as u8) << 4); // elements j: q=j, elements 16+j: q=15-j
    }
    let y = dequant(GgmlType::Q4_0, &b, 32);
    for j in 0..16 {
        assert_eq!(y[j], (j as f32 - 8.0) * 0.5);
        assert_eq!(y[16 + j], (7.0 - j as f32) * 0.5);
    }
}

#[test]
fn q4_1_and_q5_known() {
    let qs: Vec<u8> = (0..16).map(|j| (j as u8) | (((j as u8 + 3) & 15) << 4)).collect();
    let qh: u32 = 0xA5C3_0F81;
    let q4 = |j: usize| if j < 16 { j as u32 } else { (j as u32 - 16 + 3) & 15 };
    let q5 = |j: usize| q4(j) | (((qh >> j) & 1) << 4);
    let mut b = [f16b(0.25).as_slice(), &f16b(-1.0), &qs].concat();
    let y = dequant(GgmlType::Q4_1, &b, 32);
    (0..32).for_each(|j| assert_eq!(y[j], q4(j) as f32 * 0.25 - 1.0, "Q4_1 element {j}"));
    b = [f16b(0.25).as_slice(), &qh.to_le_bytes(), &qs].concat();
    let y = dequant(GgmlType::Q5_0, &b, 32);
    (0..32).for_each(|j| assert_eq!(y[j], (q5(j) as f32 - 16.0) * 0.25, "Q5_0 element {j}"));
    b = [f16b(0.25).as_slice(), &f16b(-1.0), &qh.to_le_bytes(), &qs].concat();
    let y = dequant(GgmlType::Q5_1, &b, 32);
    (0..32).for_each(|j| assert_eq!(y[j], q5(j) as f32 * 0.25 - 1.0, "Q5_1 element {j}"));
}

#[test]
fn q8_known() {
    let qs: Vec<u8> = (0..32).map(|j| (j * 8 - 128) as i8 as u8).collect();
    let y = dequant(GgmlType::Q8_0, &[f16b(0.5).as_slice(), &qs].concat(), 32);
    (0..32).for_each(|j| assert_eq!(y[j], (j as f32 * 8.0 - 128.0) * 0.5));
    let mut k = vec![0u8; Q8_K_BYTES];
    k[0..4].copy_from_slice(&(-0.125f32).to_le_bytes());
    (0..256).for_each(|j| k[Q8_K_QS + j] = j as u8);
    let y = dequant(GgmlType::Q8_K, &k, 256);
    (0..256).for_each(|j| assert_eq!(y[j], (j as u8 as i8) as f32 * -0.125));
}

/// The 12-byte scale/min packing of quantize_row_q4_K_ref.
fn pack_k4(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            s[j] = sc[j];
            s[j + 4] = m[j];
        } else {
            s[j + 4] = (sc[j] & 0xF) | ((m[j] & 0xF) << 4);
            s[j - 4] |= (sc[j] >> 4) << 6;
            s[j] |= (m[j] >> 4) << 6;
        }
    }
    s
}

#[test]
fn k4_scale_packing() {
    let mut rng = Rng::new(3);
    for _ in 0..200 {
        let sc: [u8; 8] = std::array::from_fn(|_| rng.byte() & 63);
        let m: [u8; 8] = std::array::from_fn(|_| rng.byte() & 63);
        let p = pack_k4(&sc, &m);
        let both = k4_scales_mins(&p);
        for j in 0..8 {
            assert_eq!(get_scale_min_k4(j, &p), (sc[j], m[j]));
            assert_eq!((both[j], both[8 + j]), (sc[j], m[j]));
        }
    }
}

/// Q4_K and Q5_K blocks from 5-bit levels L (Q4_K uses L < 16), packed as ggml does.
fn k_block(q5: bool, l: &[u8; 256], sc: &[u8; 8], m: &[u8; 8], d: f32, dmin: f32) -> Vec<u8> {
    let mut b = [f16b(d).as_slice(), &f16b(dmin), &pack_k4(sc, m)].concat();
    let mut qh = [0u8; 32];
    let mut qs = [0u8; 128];
    for c in 0..4 {
        for j in 0..32 {
            let (l1, l2) = (l[64 * c + j], l[64 * c + 32 + j]);
            qh[j] |= ((l1 >> 4) << (2 * c)) | ((l2 >> 4) << (2 * c + 1));
            qs[32 * c + j] = (l1 & 15) | ((l2 & 15) << 4);
        }
    }
    if q5 {
        b.extend_from_slice(&qh);
    }
    b.extend_from_slice(&qs);
    b
}

#[test]
fn q4_k_and_q5_k_known() {
    let mut rng = Rng::new(4);
    for q5 in [false, true] {
        let t = if q5 { GgmlType::Q5_K } else { GgmlType::Q4_K };
        let l: [u8; 256] = std::array::from_fn(|_| rng.byte() & if q5 { 31 } else { 15 });
        let sc: [u8; 8] = std::array::from_fn(|_| rng.byte() & 63);
        let m: [u8; 8] = std::array::from_fn(|_| rng.byte() & 63);
        let (d, dmin) = (0.0625f32, 0.125f32); // exact in f16, so values are exact
        let y = dequant(t, &k_block(q5, &l, &sc, &m, d, dmin), 256);
        for i in 0..256 {
            let s = i / 32;
            assert_eq!(
                y[i],
                d * sc[s] as f32 * l[i] as f32 - dmin * m[s] as f32,
                "{t} element {i}"
            );
        }
    }
}

#[test]
fn q6_k_known() {
    let mut rng = Rng::new(6);
    let l: [u8; 256] = std::array::from_fn(|_| rng.byte() & 63);
    let sc: [i8; 16] = std::array::from_fn(|_| rng.byte() as i8);
    let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
    for h in 0..2 {
        let j = 128 * h;
        for i in 0..32 {
            let q = |k: usize| l[j + i + 32 * k];
            ql[64 * h + i] = (q(0) & 0xF) | ((q(2) & 0xF) << 4);
            ql[64 * h + i + 32] = (q(1) & 0xF) | ((q(3) & 0xF) << 4);
            qh[32 * h + i] = (q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) | ((q(3) >> 4) << 6);
        }
    }
    let d = 0.5f32;
    let b = [ql.as_slice(), &qh, &sc.map(|s| s as u8), &f16b(d)].concat();
    let y = dequant(GgmlType::Q6_K, &b, 256);
    for i in 0..256 {
        assert_eq!(y[i], d * sc[i / 16] as f32 * (l[i] as f32 - 32.0), "Q6_K element {i}");
    }
}

#[test]
fn q8_0_and_q8_1_round_trip() {
    let mut rng = Rng::new(8);
    let x: Vec<f32> = (0..1024).map(|_| rng.activation()).collect();
    for t in [GgmlType::Q8_0, GgmlType::Q8_1] {
        let (q, y) = (quant(t, &x), dequant(t, &quant(t, &x), x.len()));
        for (i, b) in q.chunks_exact(t.block_bytes()).enumerate() {
            let xs = &x[32 * i..32 * i + 32];
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let (d, d16) = (amax / 127.0, rd_f16(b, 0));
            let qoff = t.block_bytes() - 32;
            let sum: i32 = b[qoff..].iter().map(|&q| q as i8 as i32).sum();
            for j in 0..32 {
                let k = (b[qoff + j] as i8).unsigned_abs() as f32;
                // rounding error of q plus the error from storing d as f16
                let bound = 0.5 * d * 1.0001 + k * (d16 - d).abs();
                assert!((y[32 * i + j] - xs[j]).abs() <= bound, "{t} element {j}");
            }
            if t == GgmlType::Q8_1 {
                assert_eq!(rd_u16(b, 2), f32_to_f16(sum as f32 * d));
            }
        }
    }
}

#[test]
fn q8_k_bsums_and_round_trip() {
    let mut rng = Rng::new(9);
    let mut x: Vec<f32> = (0..1024).map(|_| rng.activation()).collect();
    x[256..512].fill(0.0);
    let q = quant(GgmlType::Q8_K, &x);
    let y = dequant(GgmlType::Q8_K, &q, x.len());
    for (i, b) in q.chunks_exact(Q8_K_BYTES).enumerate() {
        for g in 0..16 {
            let s: i32 = (0..16).map(|k| b[Q8_K_QS + 16 * g + k] as i8 as i32).sum();
            assert_eq!(rd_i16(b, Q8_K_BSUMS + 2 * g) as i32, s);
        }
        let d = rd_f32(b, 0).abs();
        for j in 0..256 {
            assert!((y[256 * i + j] - x[256 * i + j]).abs() <= 0.5 * d * 1.0001);
        }
    }
    assert_eq!(rd_f32(&q, Q8_K_BYTES), 0.0);
}

#[test]
fn rounding_flavors() {
    // d = 1: 0.5, 1.5, 2.5 are exact ties. Reference roundf: away from zero; x86 path: to even.
    let mut x = vec![0.25f32; 32];
    x[..7].copy_from_slice(&[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5]);
    let q = |f: fn(GgmlType, &[f32], &mut [u8])| {
        let mut b = vec![0u8; Q8_0_BYTES];
        f(GgmlType::Q8_0, &x, &mut b);
        b[2..9].iter().map(|&v| v as i8).collect::<Vec<_>>()
    };
    assert_eq!(q(quantize_row), [127, 1, 2, 3, -1, -2, -3]);
    assert_eq!(q(quantize_row_ggml_x86), [127, 0, 2, 2, 0, -2, -2]);
    // Q8_K uses nearest_int (ties to even) and the signed max: max = -127 gives iscale = 1, d = 1.
    let mut k = vec![0.25f32; 256];
    k[..5].copy_from_slice(&[-127.0, 0.5, 1.5, 2.5, -2.5]);
    let b = quant(GgmlType::Q8_K, &k);
    assert_eq!(rd_f32(&b, 0), 1.0);
    assert_eq!(
        b[Q8_K_QS..Q8_K_QS + 5].iter().map(|&v| v as i8).collect::<Vec<_>>(),
        [-127, 0, 2, 2, -2]
    );
    // a positive max gives a negative d
    k[0] = 127.0;
    let b = quant(GgmlType::Q8_K, &k);
    assert_eq!(rd_f32(&b, 0), -1.0);
    assert_eq!(b[Q8_K_QS] as i8, -127);
}

#[test]
fn float_types_round_trip() {
    let x = [1.0f32, -2.5, 65504.0, 1e-7, 70000.0, 0.1];
    let y = dequant(GgmlType::F32, &quant(GgmlType::F32, &x), x.len());
    assert_eq!(y, x);
    let y = dequant(GgmlType::F16, &quant(GgmlType::F16, &x), x.len());
    let want: Vec<f32> = x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
    assert_eq!(y, want);
    assert_eq!(y[4], f32::INFINITY);
}
