//! Quantized matrix multiplication: `out[t, r] = dot(W[r, :], x[t, :])` for a weight matrix that stays in
//! its stored (quantized) form in the memory map.
//!
//! Activations are quantized once per call to the weight type's activation type (as ggml does), then
//! each output element is one `vec_dot`, computed by exactly one thread in a fixed order: results are
//! bit-identical whatever the thread count or the other tokens in the batch.
//!
//! `matmul_many` runs several matrices over the same input (q/k/v, gate/up) as one call: the input is
//! quantized once per activation type and every matrix's rows share one parallel pass, so the threads
//! meet once instead of once per matrix. `matmul_ranges` does the same for matrices that each read their
//! own rows of one input (an MoE layer's experts, each over the tokens that chose it).

use crate::pool;
use crate::kernels::packed::{self, ActSide, PackedInput, PackedMatrix, GROUP};
use crate::kernels::ggml::{activation_row_bytes, fill_pairs, quantize_row_legacy_with_sides, multi_dot_kernel, multi_row_kernel, pair_dot_kernel, prefetch_l2, quantize_row_ggml_x86, vec_dot_kernel, GgmlType, Line, PairActs, MULTI, PAIRS_PER_CALL};

/// A weight matrix of `rows` output features by `cols` input features, stored row-major in `dtype`
/// (`bytes`, ggml layout), and its packed copy if it has one: then the matmul runs the packed kernels
/// and numerics (`quant::packed`), else ggml's.
#[derive(Clone, Copy)]
pub struct QMatrix<'a> {
    pub dtype: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: &'a [u8],
    pub packed: Option<&'a PackedMatrix>,
}

/// Parallel tasks per thread: enough that dynamic claiming balances uneven progress, few enough that the
/// claims (one atomic each) stay negligible.
const TASKS_PER_THREAD: usize = 8;

/// Tasks per thread of a matmul over at most `STREAMING_TOKENS` tokens, which streams its weights from
/// DRAM at size: each task restarts the kernels' software prefetch (`packed::tile::PREFETCH_AHEAD`) cold
/// and prefetches that far into the rows of the next task, which another thread may take. On the
/// Llama-3.2-3B shape (Zen 4, 2 threads, docs/speed.md) 2 tasks a thread decoded 2-4% faster than 8.
const STREAMING_TASKS_PER_THREAD: usize = 2;
const STREAMING_TOKENS: usize = 4;

/// Tokens per activation-preparation task when a batch is large enough to prepare in parallel (even,
/// so a task's token pairs are its own).
const TOKENS_PER_PREP_TASK: usize = 16;

/// How far ahead (bytes of weights) of the rows being computed `run_rows` prefetches into L2: about four
/// calls of the multi-row kernels over a 640-wide Q8_0 matrix (distances of 5-20 KiB all read at the
/// same bandwidth; docs/speed.md).
const PREFETCH_AHEAD_BYTES: usize = 10 << 10;

/// Weight rows whose multi-token results are buffered before they are stored (one cache line of f32).
const SCATTER_ROWS: usize = 16;

thread_local! {
    /// SCATTER_ROWS weight rows' results for all multi-kernel tokens, before they are scattered into the output.
    static ROW_OUT: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// Pair layouts (one per legacy weight type in a call), reused across calls on the calling thread.
    static PAIR_ACTS: std::cell::RefCell<Vec<PairActs>> = const { std::cell::RefCell::new(Vec::new()) };
    /// Side tables of the packed kernels (one per activation type in a call), reused likewise.
    static SIDES: std::cell::RefCell<Vec<ActSide>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A raw pointer that parallel tasks use to write disjoint parts of one buffer.
#[derive(Clone, Copy)]
struct SyncPtr<T>(*mut T);
// SAFETY: every task writes a disjoint part (its own tokens' rows, its own output rows), see the users.
unsafe impl<T> Send for SyncPtr<T> {}
unsafe impl<T> Sync for SyncPtr<T> {}

impl QMatrix<'_> {
    fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.cols).expect("validated at load")
    }

    /// x: `[n_tokens, cols]`, out: `[n_tokens, rows]`; `xq` is scratch for the quantized activations.
    pub fn matmul(&self, x: &[f32], xq: &mut Vec<u8>, out: &mut [f32]) {
        matmul_many(x, xq, &mut [(*self, out)]);
    }
}

/// The kernel family one matrix runs with for a batch.
#[derive(Clone, Copy)]
enum Path {
    /// Packed weights: 16-row groups × token tiles, reading side table number `side`.
    Packed { side: usize },
    /// Legacy types, 2+ tokens: token pairs, reading `PairActs` number `layout`.
    Pairs { layout: usize },
    /// One token: `MULTI` weight rows per call.
    Rows,
    /// K-quants, `MULTI`+ tokens: whole groups of `MULTI` tokens per weight row, the rest one by one.
    Multi,
    /// One `vec_dot` per (row, token).
    Single,
}

/// Where one input's quantized rows are: per activation type, the byte offset of its rows in `xq` and
/// the bytes per row.
struct Prepared {
    plain: Vec<(GgmlType, usize, usize)>,
}

impl Prepared {
    fn plain_of(&self, act: GgmlType) -> (usize, usize) {
        let &(_, off, bytes) = self.plain.iter().find(|p| p.0 == act).expect("activation type prepared");
        (off, bytes)
    }
}

/// Writes token rows `first..last` of a matmul's input (`rows`: those rows) just before they are
/// quantized: the row-wise operation that makes the input (RMSNorm, SwiGLU, a residual add) then runs
/// inside the matmul's parallel run, a share of the tokens per thread, instead of on the calling thread
/// alone while the others wait. Each row must be computed as it would be alone (the split varies).
pub type FillRows<'f> = &'f (dyn Fn(usize, usize, &mut [f32]) + Sync);

/// `matmul` for several matrices with the same `cols` over the same input x: `[n_tokens, cols]`; each
/// `out` is `[n_tokens, rows]` of its matrix. Bit-identical to separate `matmul` calls.
pub fn matmul_many(x: &[f32], xq: &mut Vec<u8>, jobs: &mut [(QMatrix, &mut [f32])]) {
    // SAFETY: without a fill nothing writes through the pointer.
    unsafe { matmul_many_impl(x.as_ptr() as *mut f32, x.len(), None, None, xq, jobs) }
}

/// `matmul_many` over an input that `fill` writes first (see `FillRows`); the same results as calling
/// `fill(0, n_tokens, x)` and then `matmul_many(x, ..)`.
pub fn matmul_many_filled(x: &mut [f32], fill: FillRows, xq: &mut Vec<u8>, jobs: &mut [(QMatrix, &mut [f32])]) {
    // SAFETY: `x` is borrowed mutably for the call.
    unsafe { matmul_many_impl(x.as_mut_ptr(), x.len(), Some(fill), None, xq, jobs) }
}

/// Several matrices with the same `cols`, each over its own token rows of x (`[n_tokens, cols]`): job
/// `(m, tokens, out)` computes `out` (`[tokens.len(), m.rows]`) from rows `tokens` of x. With packed
/// weights that is one parallel pass for all of them (an MoE layer's experts: one meeting of the
/// threads per projection, not one per expert, and the input quantized once); otherwise a `matmul`
/// per job. Bit-identical to a `matmul` per job either way.
pub fn matmul_ranges(x: &[f32], xq: &mut Vec<u8>, jobs: &mut [(QMatrix, std::ops::Range<usize>, &mut [f32])]) {
    let Some(cols) = jobs.first().map(|j| j.0.cols) else { return };
    let n_tokens = x.len() / cols;
    for (m, tokens, out) in jobs.iter() {
        assert!(tokens.start <= tokens.end && tokens.end <= n_tokens, "matmul_ranges: tokens {tokens:?} of {n_tokens}");
        assert_eq!(out.len(), tokens.len() * m.rows, "matmul output is not [{}, {}]", tokens.len(), m.rows);
    }
    if jobs.iter().all(|j| j.0.packed.is_some()) {
        let ranges: Vec<std::ops::Range<usize>> = jobs.iter().map(|j| j.1.clone()).collect();
        let mut outs: Vec<(QMatrix, &mut [f32])> = jobs.iter_mut().map(|(m, _, out)| (*m, &mut **out)).collect();
        // SAFETY: without a fill nothing writes through the pointer.
        unsafe { matmul_many_impl(x.as_ptr() as *mut f32, x.len(), None, Some(&ranges), xq, &mut outs) }
    } else {
        // Consecutive jobs over the same rows (an expert's gate and up) share a `matmul_many`.
        let mut rest = jobs;
        while let Some(first) = rest.first() {
            let tokens = first.1.clone();
            let k = rest.iter().take_while(|j| j.1 == tokens).count();
            let (same, later) = rest.split_at_mut(k);
            let mut many: Vec<(QMatrix, &mut [f32])> = same.iter_mut().map(|(m, _, out)| (*m, &mut **out)).collect();
            matmul_many(&x[tokens.start * cols..tokens.end * cols], xq, &mut many);
            rest = later;
        }
    }
}

/// # Safety
/// `x_ptr..x_ptr + x_len` is one live buffer, writable when `fill` is given, not otherwise accessed
/// during the call. With `ranges` (`matmul_ranges`), every matrix is packed and job j's output is
/// `[ranges[j].len(), rows]`, from those token rows.
unsafe fn matmul_many_impl(x_ptr: *mut f32, x_len: usize, fill: Option<FillRows>, ranges: Option<&[std::ops::Range<usize>]>, xq: &mut Vec<u8>, jobs: &mut [(QMatrix, &mut [f32])]) {
    let Some(cols) = jobs.first().map(|j| j.0.cols) else { return };
    let n_tokens = x_len / cols;
    let x_rows = SyncPtr(x_ptr);
    // Token rows first..last of x, for the one part that fills or quantizes them.
    let rows_of = move |first: usize, last: usize| {
        let x_rows = x_rows; // the whole wrapper (Sync), not its raw field
        // SAFETY: inside the buffer; parts take disjoint token ranges (see the callers).
        unsafe { std::slice::from_raw_parts_mut(x_rows.0.add(first * cols), (last - first) * cols) }
    };
    assert_eq!(x_len, n_tokens * cols, "matmul input is not [n, {cols}]");
    // Job j's token rows.
    let tokens_of = |j: usize| ranges.map_or(0..n_tokens, |r| r[j].clone());
    for (j, (m, out)) in jobs.iter().enumerate() {
        assert_eq!(m.cols, cols, "matmul_many: matrices of {} and {cols} columns", m.cols);
        assert_eq!(out.len(), tokens_of(j).len() * m.rows, "matmul output is not [n, {}]", m.rows);
    }
    if n_tokens == 0 {
        return;
    }
    let mut paths: Vec<Path> = jobs.iter().map(|(m, _)| path(m, n_tokens)).collect();
    let (mut layouts, mut sides) = (PAIR_ACTS.take(), SIDES.take());
    let pool = pool::current();
    // Packed weights: the activations are prepared inside the matmul's own parallel run (parts
    // 0..prep_parts, each a range of tokens), not by the caller alone (decode: ~120 matmuls a step while
    // the other threads waited) nor in a run of their own (prefill: one meeting of the threads fewer).
    // ggml's pair layouts need every token before their sums, so they keep `prepare`.
    let packed_only = paths.iter().all(|p| matches!(p, Path::Packed { .. }));
    assert!(packed_only || ranges.is_none(), "matmul_ranges runs packed matrices only");
    let (prepared, side_types) = if packed_only {
        let (prepared, pair_types, side_types) = shape_prep(cols, n_tokens, jobs, &mut paths, xq, &mut layouts, &mut sides);
        debug_assert!(pair_types.is_empty(), "packed paths only");
        (prepared, Some(side_types))
    } else {
        if let Some(fill) = fill {
            fill(0, n_tokens, rows_of(0, n_tokens));
        }
        (prepare(rows_of(0, n_tokens), cols, n_tokens, jobs, &mut paths, xq, &mut layouts, &mut sides), None)
    };
    let no_pairs: [GgmlType; 0] = [];
    let prep = side_types.as_ref().map(|side_types| TokenPrep::new(x_rows, cols, &prepared, &no_pairs, side_types, xq, &mut layouts, &mut sides));
    // Prefill-sized batches in tasks of TOKENS_PER_PREP_TASK tokens, smaller ones a share per thread.
    let prep_chunk = if n_tokens >= 2 * TOKENS_PER_PREP_TASK { TOKENS_PER_PREP_TASK } else { n_tokens.div_ceil(pool.threads()) };
    let prep_parts = if prep.is_some() { n_tokens.div_ceil(prep_chunk) } else { 0 };
    let mats: Vec<QMatrix> = jobs.iter().map(|j| j.0).collect();
    // Taken last: nothing touches `jobs` again while the tasks write through these.
    let outs: Vec<SyncPtr<f32>> = jobs.iter_mut().map(|(_, out)| SyncPtr(out.as_mut_ptr())).collect();
    // Whole groups of GROUP rows per task (a multiple of MULTI), so the packed and multi-row kernels
    // cover every task; one task size for all matrices, so a small one (k, v) is a few tasks rather
    // than as many as a big one.
    let total_rows: usize = mats.iter().map(|m| m.rows).sum();
    let job_tokens = (0..jobs.len()).map(|j| tokens_of(j).len()).max().unwrap_or(0);
    let per_thread = if job_tokens <= STREAMING_TOKENS { STREAMING_TASKS_PER_THREAD } else { TASKS_PER_THREAD };
    let rows_per_task = total_rows.div_ceil(pool.threads() * per_thread).next_multiple_of(GROUP);
    let tasks: Vec<(usize, usize)> = mats.iter().enumerate().filter(|&(j, _)| !tokens_of(j).is_empty()).flat_map(|(j, m)| (0..m.rows).step_by(rows_per_task).map(move |r| (j, r))).collect();
    // The tasks read the activations through a pointer taken without a reference to the buffer, and
    // make their slices only once every preparation part has written its tokens (`prepped`).
    let xq_base = SyncPtr(xq.as_ptr() as *mut u8);
    let (layouts_ref, sides_ref) = (&layouts[..], &sides[..]);
    let prepped = PrepCount::default();
    pool.run(prep_parts + tasks.len(), &|part| {
        if part < prep_parts {
            let _done = prepped.part();
            let prep = prep.as_ref().expect("prep parts only when fused");
            let (first, last) = (part * prep_chunk, ((part + 1) * prep_chunk).min(n_tokens));
            if let Some(fill) = fill {
                fill(first, last, rows_of(first, last));
            }
            // SAFETY: parts cover disjoint token ranges; the buffers were shaped above.
            unsafe { prep.tokens(first, last) };
            return;
        }
        // Parts are claimed in order, so every preparation part is claimed and running (or done).
        prepped.wait_for(prep_parts);
        let xq_base = xq_base; // the whole wrapper (Sync), not its raw field
        let (j, first) = tasks[part - prep_parts];
        let m = &mats[j];
        let last = (first + rows_per_task).min(m.rows);
        let (off, act_bytes) = prepared.plain_of(m.dtype.dot_activation_type());
        // SAFETY: inside `xq` (sized by the preparation), fully written before `wait_for` returned, and
        // not written again during this run.
        let acts = unsafe { std::slice::from_raw_parts(xq_base.0.add(off) as *const u8, n_tokens * act_bytes) };
        // SAFETY: rows first..last of matrix j belong to this task only; the output was sized above.
        let out = RowsOut { ptr: outs[j], rows: m.rows };
        match paths[j] {
            Path::Packed { side } => {
                let input = PackedInput { xq: acts, row_bytes: act_bytes, side: &sides_ref[side] };
                unsafe { run_packed(m, first, last, tokens_of(j), &input, &out) }
            }
            path => unsafe { run_rows(m, path, first, last, n_tokens, acts, act_bytes, layouts_ref, &out) },
        }
    });
    drop(prep);
    PAIR_ACTS.set(layouts);
    SIDES.set(sides);
}

fn path(m: &QMatrix, n_tokens: usize) -> Path {
    if m.packed.is_some() {
        Path::Packed { side: usize::MAX }
    } else if n_tokens == 1 && multi_row_kernel(m.dtype).is_some() {
        Path::Rows
    } else if n_tokens >= 2 && pair_dot_kernel(m.dtype, m.cols).is_some() {
        Path::Pairs { layout: usize::MAX }
    } else if n_tokens >= MULTI && multi_dot_kernel(m.dtype, m.cols).is_some() {
        Path::Multi
    } else {
        Path::Single
    }
}

/// Quantizes x once per activation type the matrices need (into `xq`), builds one pair layout per
/// legacy weight type among the pair paths and one side table per activation type among the packed
/// paths (numbering them in `paths`); in parallel over tokens for prefill-sized batches. For calls that
/// are not all packed (ggml numerics); packed-only calls prepare inside their matmul run.
#[allow(clippy::too_many_arguments)]
fn prepare(x: &[f32], cols: usize, n_tokens: usize, jobs: &[(QMatrix, &mut [f32])], paths: &mut [Path], xq: &mut Vec<u8>, layouts: &mut Vec<PairActs>, sides: &mut Vec<ActSide>) -> Prepared {
    let (prepared, pair_types, side_types) = shape_prep(cols, n_tokens, jobs, paths, xq, layouts, sides);
    {
        let prep = TokenPrep::new(SyncPtr(x.as_ptr() as *mut f32), cols, &prepared, &pair_types, &side_types, xq, layouts, sides);
        if n_tokens >= 2 * TOKENS_PER_PREP_TASK {
            pool::current().run(n_tokens.div_ceil(TOKENS_PER_PREP_TASK), &|task| {
                let first = task * TOKENS_PER_PREP_TASK;
                // SAFETY: tasks cover disjoint token ranges.
                unsafe { prep.tokens(first, (first + TOKENS_PER_PREP_TASK).min(n_tokens)) };
            });
        } else {
            // SAFETY: the only preparation of these tokens.
            unsafe { prep.tokens(0, n_tokens) };
        }
    }
    for (l, &t) in layouts.iter_mut().zip(&pair_types) {
        let (off, bytes) = prepared.plain_of(t.dot_activation_type());
        l.fill_sums(t, cols, &xq[off..off + n_tokens * bytes], bytes, n_tokens);
    }
    prepared
}

/// Sizes `xq`, the pair layouts and the side tables for the matrices' activation types and numbers
/// them in `paths`; returns where each type's rows go, the legacy weight types that need pair layouts
/// and the activation types of the side tables (the first entries of `sides`; later ones are stale
/// buffers kept for reuse). Nothing is quantized yet.
#[allow(clippy::too_many_arguments)]
fn shape_prep(cols: usize, n_tokens: usize, jobs: &[(QMatrix, &mut [f32])], paths: &mut [Path], xq: &mut Vec<u8>, layouts: &mut Vec<PairActs>, sides: &mut Vec<ActSide>) -> (Prepared, Vec<GgmlType>, Vec<GgmlType>) {
    let mut plain: Vec<(GgmlType, usize, usize)> = Vec::new();
    let mut pair_types: Vec<GgmlType> = Vec::new();
    let mut side_types: Vec<GgmlType> = Vec::new();
    let mut size = 0;
    for ((m, _), p) in jobs.iter().zip(paths.iter_mut()) {
        let act = m.dtype.dot_activation_type();
        if !plain.iter().any(|q| q.0 == act) {
            let bytes = activation_row_bytes(act, cols);
            plain.push((act, size, bytes));
            size += n_tokens * bytes;
        }
        let number = |types: &mut Vec<GgmlType>, t: GgmlType| {
            types.iter().position(|&u| u == t).unwrap_or_else(|| {
                types.push(t);
                types.len() - 1
            })
        };
        match p {
            Path::Pairs { layout } => *layout = number(&mut pair_types, m.dtype),
            Path::Packed { side } => *side = number(&mut side_types, act),
            _ => {}
        }
    }
    xq.resize(size, 0);
    layouts.resize_with(pair_types.len().max(layouts.len()), PairActs::default);
    for (l, &t) in layouts.iter_mut().zip(&pair_types) {
        l.shape(t, cols, n_tokens);
    }
    sides.resize_with(side_types.len().max(sides.len()), ActSide::default);
    for (s, &act) in sides.iter_mut().zip(&side_types) {
        s.shape(act, cols, n_tokens);
    }
    (Prepared { plain }, pair_types, side_types)
}

/// The per-token half of `prepare`: quantizes tokens' rows, fills their side entries and pair lines,
/// through raw pointers so that parts working on different tokens can run at once.
struct TokenPrep<'a> {
    /// The input rows, read per token range (a fill may have written them just before).
    x: SyncPtr<f32>,
    cols: usize,
    plain: &'a [(GgmlType, usize, usize)],
    pair_types: &'a [GgmlType],
    xq: SyncPtr<u8>,
    lines: Vec<SyncPtr<Line>>,
    /// Per side table: its activation type, blocks per token and pointers.
    sides: Vec<(GgmlType, usize, SidePtrs)>,
}

impl<'a> TokenPrep<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(x: SyncPtr<f32>, cols: usize, prepared: &'a Prepared, pair_types: &'a [GgmlType], side_types: &[GgmlType], xq: &mut [u8], layouts: &mut [PairActs], sides: &mut [ActSide]) -> Self {
        TokenPrep {
            x,
            cols,
            plain: &prepared.plain,
            pair_types,
            xq: SyncPtr(xq.as_mut_ptr()),
            lines: layouts.iter_mut().take(pair_types.len()).map(|l| SyncPtr(l.lines.as_mut_ptr())).collect(),
            sides: sides.iter_mut().zip(side_types).map(|(s, &act)| (act, s.blocks, SidePtrs(s.ptrs()))).collect(),
        }
    }

    /// Tokens `first..last` (`first` even when pair layouts are filled).
    ///
    /// # Safety
    /// No other call covers any of these tokens at the same time, and the buffers `new` saw are still
    /// the shaped ones.
    unsafe fn tokens(&self, first: usize, last: usize) {
        let cols = self.cols;
        for &(act, off, bytes) in self.plain {
            for t in first..last {
                // SAFETY: token t's row of this activation type is written by this call only, inside
                // `xq` (sized for n_tokens rows of every type by `shape_prep`).
                let q = unsafe { std::slice::from_raw_parts_mut(self.xq.0.add(off + t * bytes), bytes) };
                // SAFETY: token t's input row, complete (filled, if at all, by this same part) and not
                // written while this call reads it.
                let x = unsafe { std::slice::from_raw_parts(self.x.0.add(t * cols) as *const f32, cols) };
                let Some(&(_, blocks, ptrs)) = self.sides.iter().find(|s| s.0 == act) else {
                    quantize_row_ggml_x86(act, x, q);
                    continue;
                };
                let fused = matches!(act, GgmlType::Q8_0 | GgmlType::Q8_1) && {
                    // SAFETY: the table was shaped for n_tokens tokens of `act`, legacy entries for these
                    // types, `blocks` per token; token t's entries are this call's.
                    let legacy_sides = unsafe { std::slice::from_raw_parts_mut(ptrs.0 .0.add(t * blocks), blocks) };
                    quantize_row_legacy_with_sides(act, x, q, legacy_sides)
                };
                if !fused {
                    quantize_row_ggml_x86(act, x, q);
                    // SAFETY: as above.
                    unsafe { ActSide::fill_token(act, blocks, ptrs.0, t, q) };
                }
            }
        }
        for (k, &t) in self.pair_types.iter().enumerate() {
            let &(_, off, bytes) = self.plain.iter().find(|p| p.0 == t.dot_activation_type()).expect("quantized above");
            let per_pair = crate::kernels::ggml::lines_per_pair(t, cols);
            let (p0, p1) = (first / 2, last.div_ceil(2));
            // SAFETY: rows first..last were written just above by this call (no one else writes them),
            // and the lines of pairs p0..p1 (made of those rows, first being even) are this call's own;
            // both are inside their buffers, sized by `shape_prep`.
            let (acts, lines) = unsafe {
                (
                    std::slice::from_raw_parts(self.xq.0.add(off + first * bytes) as *const u8, (last - first) * bytes),
                    std::slice::from_raw_parts_mut(self.lines[k].0.add(p0 * per_pair), (p1 - p0) * per_pair),
                )
            };
            fill_pairs(t, cols, acts, bytes, last - first, lines);
        }
    }
}

/// How many preparation parts of a fused matmul run have finished; a part that panics marks the run
/// failed instead, so the parts waiting on it panic too rather than spin forever.
#[derive(Default)]
struct PrepCount {
    done: std::sync::atomic::AtomicUsize,
    failed: std::sync::atomic::AtomicBool,
}

/// Counts its part as done when dropped (as failed if dropped by a panic).
struct PrepPart<'a>(&'a PrepCount);

impl PrepCount {
    fn part(&self) -> PrepPart<'_> {
        PrepPart(self)
    }

    /// Returns once `n` parts are done (their writes visible here).
    fn wait_for(&self, n: usize) {
        use std::sync::atomic::Ordering;
        while self.done.load(Ordering::Acquire) < n {
            assert!(!self.failed.load(Ordering::Relaxed), "a matmul's activation preparation failed");
            std::hint::spin_loop();
        }
    }
}

impl Drop for PrepPart<'_> {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering;
        if std::thread::panicking() {
            self.0.failed.store(true, Ordering::Relaxed);
        } else {
            self.0.done.fetch_add(1, Ordering::Release);
        }
    }
}

/// The raw table pointers of an `ActSide`, shared by the preparation tasks (each writes its own tokens).
#[derive(Clone, Copy)]
struct SidePtrs((*mut packed::acts::LSide, *mut packed::acts::KSide));
// SAFETY: as SyncPtr: every task writes the entries of its own tokens only.
unsafe impl Send for SidePtrs {}
unsafe impl Sync for SidePtrs {}

/// Tokens whose activations a packed matmul keeps hot while it runs all of a task's groups over them:
/// about 256 KiB of quantized rows (L2), at least one tile.
const PACKED_CHUNK_BYTES: usize = 256 << 10;

/// Rows `first..last` (whole groups but for the matrix's last) of a packed matrix for every token:
/// token chunks outer (their activations stay in L2), groups inner, each group over the chunk's tokens
/// (`packed::tiles`; the kernels prefetch the weights ahead themselves).
///
/// # Safety
/// Rows `first..last` of `out` belong to this call alone; `first` is a multiple of GROUP.
unsafe fn run_packed(m: &QMatrix, first: usize, last: usize, tokens: std::ops::Range<usize>, x: &PackedInput, out: &RowsOut) {
    let p = m.packed.expect("chosen by path()");
    let tile = packed::tile_tokens(m.dtype);
    let chunk = (PACKED_CHUNK_BYTES / x.row_bytes).max(1).next_multiple_of(tile);
    // `out` holds rows `tokens`: the kernels index it by token, from where token 0's row would be.
    let out0 = out.ptr.0.wrapping_sub(tokens.start * out.rows);
    for c0 in tokens.clone().step_by(chunk) {
        let c1 = (c0 + chunk).min(tokens.end);
        for g in first / GROUP..last.div_ceil(GROUP) {
            packed::tiles(p, g, x, c0, c1, out0, out.rows);
        }
    }
}

/// One matrix's output, written row by row by the tasks that own the rows.
struct RowsOut {
    ptr: SyncPtr<f32>,
    rows: usize,
}

impl RowsOut {
    /// # Safety
    /// Row r must belong to the caller's task and (t, r) be inside the `[n_tokens, rows]` output.
    #[inline(always)]
    unsafe fn store(&self, t: usize, r: usize, v: f32) {
        *self.ptr.0.add(t * self.rows + r) = v;
    }
}

/// Rows `first..last` of `m` for every token, by `path`; `acts` are the plain quantized rows.
///
/// # Safety
/// Rows `first..last` of `out` belong to this call alone.
#[allow(clippy::too_many_arguments)]
unsafe fn run_rows(m: &QMatrix, path: Path, first: usize, last: usize, n_tokens: usize, acts: &[u8], act_bytes: usize, layouts: &[PairActs], out: &RowsOut) {
    let w_row_bytes = m.row_bytes();
    let rows_of = |r: usize, k: usize| &m.bytes[r * w_row_bytes..(r + k) * w_row_bytes];
    // The bytes of rows r..r + k, PREFETCH_AHEAD_BYTES further on (clamped to the matrix).
    let prefetch_ahead = |r: usize, k: usize| {
        let start = (r * w_row_bytes + PREFETCH_AHEAD_BYTES).min(m.bytes.len());
        prefetch_l2(&m.bytes[start..(start + k * w_row_bytes).min(m.bytes.len())]);
    };
    let mut first = first;
    match path {
        Path::Pairs { layout } => {
            let kernel = pair_dot_kernel(m.dtype, m.cols).expect("chosen by path()");
            let paired = &layouts[layout];
            // MULTI rows × up to 2·PAIRS_PER_CALL tokens per call; the rows stay in L1 across the groups.
            let mut res = [0.0f32; MULTI * 2 * PAIRS_PER_CALL];
            while first + MULTI <= last {
                prefetch_ahead(first, MULTI);
                for p0 in (0..paired.n_pairs).step_by(PAIRS_PER_CALL) {
                    let n_pairs = (paired.n_pairs - p0).min(PAIRS_PER_CALL);
                    kernel(m.cols, rows_of(first, MULTI), w_row_bytes, paired, p0, n_pairs, &mut res);
                    for r in 0..MULTI {
                        for k in 0..(2 * n_pairs).min(n_tokens - 2 * p0) {
                            out.store(2 * p0 + k, first + r, res[r * 2 * PAIRS_PER_CALL + k]);
                        }
                    }
                }
                first += MULTI;
            }
        }
        Path::Rows => {
            let kernel = multi_row_kernel(m.dtype).expect("chosen by path()");
            while first + MULTI <= last {
                prefetch_ahead(first, MULTI);
                for (k, &v) in kernel(m.cols, rows_of(first, MULTI), w_row_bytes, acts).iter().enumerate() {
                    out.store(0, first + k, v);
                }
                first += MULTI;
            }
        }
        Path::Multi => {
            let kernel = multi_dot_kernel(m.dtype, m.cols).expect("chosen by path()");
            let n_multi = n_tokens / MULTI * MULTI;
            // Rows computed SCATTER_ROWS at a time into a buffer, then stored token by token, so the
            // output is written in whole cache lines rather than one float per line.
            ROW_OUT.with_borrow_mut(|buf| {
                for r0 in (first..last).step_by(SCATTER_ROWS) {
                    let r1 = (r0 + SCATTER_ROWS).min(last);
                    buf.resize((r1 - r0) * n_multi, 0.0);
                    kernel(m.cols, rows_of(r0, r1 - r0), w_row_bytes, r1 - r0, acts, act_bytes, buf);
                    for t in 0..n_multi {
                        for r in r0..r1 {
                            out.store(t, r, buf[(r - r0) * n_multi + t]);
                        }
                    }
                }
            });
            for r in first..last {
                for t in n_multi..n_tokens {
                    out.store(t, r, vec_dot_kernel(m.dtype)(m.cols, rows_of(r, 1), &acts[t * act_bytes..(t + 1) * act_bytes]));
                }
            }
            return;
        }
        Path::Single => {}
        Path::Packed { .. } => unreachable!("run_packed"),
    }
    let dot = vec_dot_kernel(m.dtype);
    for r in first..last {
        for t in 0..n_tokens {
            out.store(t, r, dot(m.cols, rows_of(r, 1), &acts[t * act_bytes..(t + 1) * act_bytes]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::ggml::random_weight_rows;

    /// Every (token, row) of a matmul is the one-row `vec_dot` of that token's quantized row, whatever the
    /// batch size (pairs, odd batches, the multi-token and one-token paths, leftover rows), and
    /// `matmul_many` over matrices of several types gives each matrix's `matmul`.
    #[test]
    fn matmul_is_the_one_row_dot_for_every_batch_and_group() {
        let (cols, rows) = (512, 37); // 37 rows: a leftover below MULTI
        let types = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K];
        let weights: Vec<Vec<u8>> = types.iter().enumerate().map(|(i, &t)| random_weight_rows(t, rows, cols, 10 + i as u64)).collect();
        let mats: Vec<QMatrix> = types.iter().zip(&weights).map(|(&t, w)| QMatrix { dtype: t, rows, cols, bytes: w, packed: None }).collect();
        let mut rng = crate::sampler::Rng::new(3);
        for n in [1usize, 2, 3, 4, 7, 9, 16, 33, 40] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.next_f64() as f32 * 4.0 - 2.0).collect();
            let mut xq = Vec::new();
            let mut singles = Vec::new();
            for m in &mats {
                let mut out = vec![0.0f32; n * rows];
                m.matmul(&x, &mut xq, &mut out);
                let act = m.dtype.dot_activation_type();
                let ab = activation_row_bytes(act, cols);
                let mut q = vec![0u8; ab];
                for t in 0..n {
                    quantize_row_ggml_x86(act, &x[t * cols..(t + 1) * cols], &mut q);
                    for r in 0..rows {
                        let want = vec_dot_kernel(m.dtype)(cols, &m.bytes[r * m.row_bytes()..(r + 1) * m.row_bytes()], &q);
                        assert_eq!(out[t * rows + r].to_bits(), want.to_bits(), "{} n={n} token {t} row {r}", m.dtype);
                    }
                }
                singles.push(out);
            }
            let mut outs: Vec<Vec<f32>> = mats.iter().map(|_| vec![0.0f32; n * rows]).collect();
            let mut jobs: Vec<(QMatrix, &mut [f32])> = mats.iter().copied().zip(outs.iter_mut().map(|o| &mut o[..])).collect();
            matmul_many(&x, &mut xq, &mut jobs);
            for ((m, got), want) in mats.iter().zip(&outs).zip(&singles) {
                assert!(got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), "{} n={n}: matmul_many differs", m.dtype);
            }
        }
    }

    /// With packed weights, every (token, row) of a matmul is the packed definition's dot, whatever the
    /// batch: one token, tile remainders, and more tokens than one chunk of `run_packed` (400).
    #[test]
    fn packed_matmul_is_the_definition_for_every_batch() {
        if !crate::kernels::cpu::tests::test_needs(crate::kernels::cpu::SimdLevel::Avx2, "packed matmul vs the definition") {
            return;
        }
        let (cols, rows) = (768, 37);
        let types = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K];
        let weights: Vec<Vec<u8>> = types.iter().enumerate().map(|(i, &t)| random_weight_rows(t, rows, cols, 20 + i as u64)).collect();
        let packs: Vec<_> = types.iter().zip(&weights).map(|(&t, w)| packed::pack(t, rows, cols, w)).collect();
        let mats: Vec<QMatrix> = types.iter().zip(&weights).zip(&packs).map(|((&t, w), p)| QMatrix { dtype: t, rows, cols, bytes: w, packed: Some(p) }).collect();
        let mut rng = crate::sampler::Rng::new(4);
        // 1-3 threads: decode-sized batches prepare their activations inside the parallel run (also with
        // fewer tokens than threads); 400 tokens go through several token chunks.
        for threads in [1usize, 2, 3] {
            pool::Pool::new(threads).install(|| {
                for n in [1usize, 2, 3, 9, 31, 400] {
                    let x: Vec<f32> = (0..n * cols).map(|_| rng.next_f64() as f32 * 4.0 - 2.0).collect();
                    for m in &mats {
                        let (mut xq, mut out) = (Vec::new(), vec![0.0f32; n * rows]);
                        m.matmul(&x, &mut xq, &mut out);
                        assert_is_the_definition(m, &x, &out, &format!("{} n={n} threads={threads}", m.dtype));
                    }
                    // several activation types (side tables) in one call: Q8_1, Q8_0 and Q8_K
                    let (mut xq, mut outs) = (Vec::new(), vec![vec![0.0f32; n * rows]; 3]);
                    let [a, b, c] = &mut outs[..] else { unreachable!() };
                    matmul_many(&x, &mut xq, &mut [(mats[1], &mut a[..]), (mats[3], &mut b[..]), (mats[4], &mut c[..])]);
                    for (m, out) in [&mats[1], &mats[3], &mats[4]].into_iter().zip(&outs) {
                        assert_is_the_definition(m, &x, out, &format!("matmul_many {} n={n} threads={threads}", m.dtype));
                    }
                }
            });
        }
    }

    /// `matmul_ranges` (an MoE layer's experts in one pass) gives each job the bits of a `matmul` over
    /// its own rows, packed or not: ranges of one token, of several, overlapping, empty, and one longer
    /// than a tile, on 1-3 threads.
    #[test]
    fn matmul_ranges_is_a_matmul_per_job() {
        let (cols, rows, n) = (512, 45, 13);
        let types = [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q4_0];
        let weights: Vec<Vec<u8>> = types.iter().enumerate().map(|(i, &t)| random_weight_rows(t, rows, cols, 40 + i as u64)).collect();
        let packs: Vec<_> = types.iter().zip(&weights).map(|(&t, w)| packed::pack(t, rows, cols, w)).collect();
        let packed_ok = crate::kernels::cpu::SimdLevel::detected() >= crate::kernels::cpu::SimdLevel::Avx2;
        let mut rng = crate::sampler::Rng::new(8);
        let x: Vec<f32> = (0..n * cols).map(|_| rng.next_f64() as f32 * 4.0 - 2.0).collect();
        let ranges = [0..1, 1..1, 1..7, 3..5, 7..13, 12..13];
        for with_packed in [false, true].into_iter().filter(|&p| p <= packed_ok) {
            let mats: Vec<QMatrix> = types.iter().zip(&weights).zip(&packs).map(|((&t, w), p)| QMatrix { dtype: t, rows, cols, bytes: w, packed: with_packed.then_some(p) }).collect();
            // Job j: matrix j % 3 over ranges[j], so one matrix appears with several ranges.
            let want: Vec<Vec<f32>> = ranges.iter().enumerate().map(|(j, r)| {
                let mut out = vec![0.0f32; r.len() * rows];
                mats[j % 3].matmul(&x[r.start * cols..r.end * cols], &mut Vec::new(), &mut out);
                out
            }).collect();
            for threads in [1usize, 2, 3] {
                pool::Pool::new(threads).install(|| {
                    let mut outs: Vec<Vec<f32>> = ranges.iter().map(|r| vec![f32::NAN; r.len() * rows]).collect();
                    let mut jobs: Vec<(QMatrix, std::ops::Range<usize>, &mut [f32])> = outs.iter_mut().enumerate().map(|(j, o)| (mats[j % 3], ranges[j].clone(), &mut o[..])).collect();
                    matmul_ranges(&x, &mut Vec::new(), &mut jobs);
                    for (j, (got, want)) in outs.iter().zip(&want).enumerate() {
                        assert!(got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), "packed {with_packed} threads {threads}: job {j} ({} over {:?}) differs", mats[j % 3].dtype, ranges[j]);
                    }
                });
            }
        }
    }

    fn assert_is_the_definition(m: &QMatrix, x: &[f32], out: &[f32], what: &str) {
        let (rows, cols, rb) = (m.rows, m.cols, m.row_bytes());
        let act = m.dtype.dot_activation_type();
        let mut q = vec![0u8; activation_row_bytes(act, cols)];
        for tok in 0..x.len() / cols {
            quantize_row_ggml_x86(act, &x[tok * cols..(tok + 1) * cols], &mut q);
            for r in 0..rows {
                let want = packed::reference::dot(m.dtype, cols, &m.bytes[r * rb..(r + 1) * rb], &q);
                assert_eq!(out[tok * rows + r].to_bits(), want.to_bits(), "{what}: token {tok} row {r}");
            }
        }
    }
}
