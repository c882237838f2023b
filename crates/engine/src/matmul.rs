//! Quantized matrix multiplication: `out[t, r] = dot(W[r, :], x[t, :])` for a weight matrix that stays in
//! its stored (quantized) form in the memory map.
//!
//! Activations are quantized once per call to the weight type's activation type (as ggml does), then
//! each output element is one `vec_dot`, computed by exactly one thread in a fixed order: results are
//! bit-identical whatever the thread count or the other tokens in the batch.

use crate::quant::{activation_row_bytes, quantize_row_ggml_x86, vec_dot_kernel, GgmlType};
use rayon::prelude::*;

/// A weight matrix of `rows` output features by `cols` input features, stored row-major in `dtype`.
#[derive(Clone, Copy, Debug)]
pub struct QMatrix<'a> {
    pub dtype: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: &'a [u8],
}

/// Rows computed per parallel task: big enough to amortise scheduling, small enough to balance 2+ cores.
const ROWS_PER_TASK: usize = 64;

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
        xq.resize(n_tokens * act_bytes, 0);
        for (row, q) in x.chunks_exact(self.cols).zip(xq.chunks_exact_mut(act_bytes)) {
            quantize_row_ggml_x86(act_type, row, q);
        }
        let xq: &[u8] = xq;
        let w_row_bytes = self.row_bytes();
        let out_ptr = OutPtr(out.as_mut_ptr());
        let dot = vec_dot_kernel(self.dtype);
        let num_tasks = self.rows.div_ceil(ROWS_PER_TASK);
        (0..num_tasks).into_par_iter().for_each(|task| {
            let out_ptr = out_ptr;
            let first = task * ROWS_PER_TASK;
            let last = (first + ROWS_PER_TASK).min(self.rows);
            for r in first..last {
                let w = &self.bytes[r * w_row_bytes..(r + 1) * w_row_bytes];
                for (t, a) in xq.chunks_exact(act_bytes).enumerate() {
                    let v = dot(self.cols, w, a);
                    // SAFETY: (t, r) is in bounds (asserted above) and row r belongs to this task only.
                    unsafe { *out_ptr.0.add(t * self.rows + r) = v };
                }
            }
        });
    }
}
