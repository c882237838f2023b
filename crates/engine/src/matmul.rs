//! Quantized matrix multiplication: `out[t, r] = dot(W[r, :], x[t, :])` for a weight matrix that stays in
//! its stored (quantized) form in the memory map.
//!
//! Activations are quantized once per call to the weight type's activation type (as ggml does), then
//! each output element is one `vec_dot`, computed by exactly one thread in a fixed order: results are
//! bit-identical whatever the thread count or the other tokens in the batch.

use crate::quant::{activation_row_bytes, expand_act_row, expanded_act_row_bytes, multi_dot_kernel, multi_row_kernel, quantize_row_ggml_x86, tile_dot_kernel, transpose_act_sums, vec_dot_kernel, wants_expanded_acts, GgmlType, MULTI};
use crate::pool;

/// A weight matrix of `rows` output features by `cols` input features, stored row-major in `dtype`.
#[derive(Clone, Copy, Debug)]
pub struct QMatrix<'a> {
    pub dtype: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: &'a [u8],
}

/// Parallel tasks per thread: enough that dynamic claiming balances uneven progress, few enough that the
/// claims (one atomic each) stay negligible.
const TASKS_PER_THREAD: usize = 8;

/// Most tokens a matmul runs through the tile kernels (decode batches); more take the multi-token
/// kernels, whose per-weight-row staging pays off over many tokens. (`examples/matmul_bench.rs`, Q4_1
/// and Q8_0 576-column rows, 3 interleaved runs: the tile kernels were ahead at 5, 6 and 8 tokens, even
/// at 12, behind at 16.)
const TILE_MAX_TOKENS: usize = 12;

/// Weight rows whose multi-token results are buffered before they are stored (one cache line of f32).
const SCATTER_ROWS: usize = 16;

thread_local! {
    /// SCATTER_ROWS weight rows' results for all multi-kernel tokens, before they are scattered into the output.
    static ROW_OUT: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A raw pointer that parallel tasks use to write disjoint rows of one byte buffer.
#[derive(Clone, Copy)]
struct BytePtr(*mut u8);
// SAFETY: every task writes a disjoint set of rows, see `matmul`.
unsafe impl Send for BytePtr {}
unsafe impl Sync for BytePtr {}

/// A raw pointer that parallel tasks use to write disjoint elements of one output buffer.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every task writes a disjoint set of output elements (its own rows), see `matmul`.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl QMatrix<'_> {
    fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.cols).expect("validated at load")
    }

    /// x: `[n_tokens, cols]`, out: `[n_tokens, rows]`; `xq` is scratch for the quantized activations.
    pub fn matmul(&self, x: &[f32], xq: &mut Vec<u8>, out: &mut [f32]) {
        let n_tokens = x.len() / self.cols;
        assert_eq!(x.len(), n_tokens * self.cols, "matmul input is not [n, {}]", self.cols);
        assert_eq!(out.len(), n_tokens * self.rows, "matmul output is not [n, {}]", self.rows);
        let act_type = self.dtype.dot_activation_type();
        let act_bytes = activation_row_bytes(act_type, self.cols);
        let tile = if (2..=TILE_MAX_TOKENS).contains(&n_tokens) { tile_dot_kernel(self.dtype, self.cols) } else { None };
        let multi = if n_tokens >= MULTI && tile.is_none() { multi_dot_kernel(self.dtype, self.cols) } else { None };
        let n_multi = if multi.is_some() { n_tokens / MULTI * MULTI } else { 0 };
        // Tile and multi-token kernels for Q8_0/Q8_1 activations read them in their expanded layout, stored
        // after the plain rows; the K-quant ones read the plain rows.
        let expanded = wants_expanded_acts(self.dtype);
        let n_wide = if tile.is_some() { n_tokens } else if expanded { n_multi } else { 0 };
        let wide_bytes = expanded_act_row_bytes(self.cols);
        xq.resize(n_tokens * act_bytes + n_wide * wide_bytes, 0);
        let (plain, wide) = xq.split_at_mut(n_tokens * act_bytes);
        // Quantize (and expand) the activation rows, in parallel for prefill-sized batches.
        let (plain_ptr, wide_ptr) = (BytePtr(plain.as_mut_ptr()), BytePtr(wide.as_mut_ptr()));
        let quantize_rows = |first: usize, last: usize| {
            let (plain_ptr, wide_ptr) = (plain_ptr, wide_ptr);
            for t in first..last {
                // SAFETY: token t's rows are disjoint from every other token's, and inside the buffers
                // (plain: n_tokens rows of act_bytes, wide: n_wide rows of wide_bytes).
                let q = unsafe { std::slice::from_raw_parts_mut(plain_ptr.0.add(t * act_bytes), act_bytes) };
                quantize_row_ggml_x86(act_type, &x[t * self.cols..(t + 1) * self.cols], q);
                if t < n_wide {
                    let e = unsafe { std::slice::from_raw_parts_mut(wide_ptr.0.add(t * wide_bytes), wide_bytes) };
                    expand_act_row(act_type, self.cols, q, e);
                }
            }
        };
        const TOKENS_PER_QUANT_TASK: usize = 16;
        if n_tokens >= 2 * TOKENS_PER_QUANT_TASK {
            pool::current().run(n_tokens.div_ceil(TOKENS_PER_QUANT_TASK), &|task| {
                let first = task * TOKENS_PER_QUANT_TASK;
                quantize_rows(first, (first + TOKENS_PER_QUANT_TASK).min(n_tokens));
            });
        } else {
            quantize_rows(0, n_tokens);
        }
        let (xq, wide): (&[u8], &[u8]) = (plain, wide);
        let mut s_by_block = Vec::new();
        if (multi.is_some() || tile.is_some()) && act_type == GgmlType::Q8_1 {
            transpose_act_sums(self.cols, wide, wide_bytes, n_wide, &mut s_by_block);
        }
        let s_by_block = &s_by_block[..];
        let w_row_bytes = self.row_bytes();
        let out_ptr = OutPtr(out.as_mut_ptr());
        let dot = vec_dot_kernel(self.dtype);
        // A lone token (decode): several weight rows per call instead, sharing the activation loads.
        let rows_kernel = if n_tokens == 1 { multi_row_kernel(self.dtype) } else { None };
        let pool = pool::current();
        // Whole multiples of MULTI rows per task, so the multi-row kernels cover every task.
        let rows_per_task = self.rows.div_ceil(pool.threads() * TASKS_PER_THREAD).next_multiple_of(MULTI);
        let num_tasks = self.rows.div_ceil(rows_per_task);
        pool.run(num_tasks, &|task| {
            let out_ptr = out_ptr;
            let first = task * rows_per_task;
            let last = (first + rows_per_task).min(self.rows);
            let store = |t: usize, r: usize, v: f32| {
                // SAFETY: (t, r) is in bounds (asserted above) and row r belongs to this task only.
                unsafe { *out_ptr.0.add(t * self.rows + r) = v };
            };
            let mut first = first;
            if let Some(tile) = tile {
                // MULTI rows × up to MULTI tokens per call; the rows stay in L1 across the token groups.
                let mut tile_out = [0.0f32; MULTI * MULTI];
                while first + MULTI <= last {
                    let w = &self.bytes[first * w_row_bytes..(first + MULTI) * w_row_bytes];
                    for t0 in (0..n_tokens).step_by(MULTI) {
                        let n_tok = (n_tokens - t0).min(MULTI);
                        let s = s_by_block.get(t0..).unwrap_or(&[]);
                        tile(self.cols, w, w_row_bytes, &wide[t0 * wide_bytes..], wide_bytes, s, n_tokens, n_tok, &mut tile_out);
                        for r in 0..MULTI {
                            for k in 0..n_tok {
                                store(t0 + k, first + r, tile_out[r * MULTI + k]);
                            }
                        }
                    }
                    first += MULTI;
                }
            }
            if let Some(rows_kernel) = rows_kernel {
                while first + MULTI <= last {
                    let v = rows_kernel(self.cols, &self.bytes[first * w_row_bytes..(first + MULTI) * w_row_bytes], w_row_bytes, xq);
                    for (k, &v) in v.iter().enumerate() {
                        store(0, first + k, v);
                    }
                    first += MULTI;
                }
            }
            if let Some(multi) = multi {
                // Rows computed SCATTER_ROWS at a time into a buffer, then stored token by token, so the
                // output is written in whole cache lines rather than one float per line.
                ROW_OUT.with_borrow_mut(|buf| {
                    for r0 in (first..last).step_by(SCATTER_ROWS) {
                        let r1 = (r0 + SCATTER_ROWS).min(last);
                        buf.resize((r1 - r0) * n_multi, 0.0);
                        for (r, row_out) in (r0..r1).zip(buf.chunks_exact_mut(n_multi)) {
                            let w = &self.bytes[r * w_row_bytes..(r + 1) * w_row_bytes];
                            if expanded {
                                multi(self.cols, w, wide, wide_bytes, s_by_block, row_out);
                            } else {
                                multi(self.cols, w, xq, act_bytes, s_by_block, row_out);
                            }
                        }
                        for t in 0..n_multi {
                            for r in r0..r1 {
                                store(t, r, buf[(r - r0) * n_multi + t]);
                            }
                        }
                    }
                });
            }
            for r in first..last {
                let w = &self.bytes[r * w_row_bytes..(r + 1) * w_row_bytes];
                for t in n_multi..n_tokens {
                    store(t, r, dot(self.cols, w, &xq[t * act_bytes..(t + 1) * act_bytes]));
                }
            }
        });
    }
}
