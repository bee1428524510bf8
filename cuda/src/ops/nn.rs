//! Launchers of the model ops: embedding, positional add, GELU, SwiGLU, RoPE, add, bias add and
//! column sums (kernel families `embedding`, `positional`, `activations`, `rope`,
//! `elementwise`), and the two-stage column reductions they share with the norms
//! (`ops::norm`).
use super::{int, no_alias, row_threads, rows_of};
use crate::device::Device;
use crate::error::{CudaError, Result};
use crate::kernels::Args;
use crate::memory::{Buf, Elem};

/// Block of the column-tile kernels: 32 columns × 16 row lanes.
pub(super) const COL_BLOCK: (u32, u32, u32) = (32, 16, 1);

/// Plan op `Embedding`: `out[n, :] = table[ids[n], :]`. table f32 `[vocab, c]`, ids i32 `[N]`,
/// out f32 `[N, c]`. A bad id NaN-fills its row and is reported by [`Device::take_status`].
pub fn embedding_forward(
    dev: &Device,
    table: &Buf,
    ids: &Buf,
    out: &Buf,
    vocab: usize,
    c: usize,
) -> Result<()> {
    const OP: &str = "embedding";
    let n = ids.len();
    table.expect(OP, "table", Elem::F32, vocab * c)?;
    ids.expect(OP, "ids", Elem::I32, n)?;
    out.expect(OP, "out", Elem::F32, n * c)?;
    if n == 0 {
        return Ok(());
    }
    let args = Args::new()
        .buf(table)
        .buf(ids)
        .buf(out)
        .i32(int(OP, "N", n)?)
        .i32(int(OP, "C", c)?)
        .i32(int(OP, "V", vocab)?);
    dev.launch(
        "embedding_forward",
        (n as u32, 1, 1),
        (row_threads(c).min(256), 1, 1),
        args.buf(dev.status()),
    )
}

/// Elements of scratch [`embedding_backward`] needs: the first and last token position of
/// every table row (`2 · vocab` i32, in an f32 scratch buffer).
pub fn embedding_backward_scratch_len(vocab: usize) -> usize {
    2 * vocab
}

/// Columns each thread of `embedding_backward_rows` sums (`EMB_COLS` in `kernels/embedding.cu`).
const EMB_COLS: usize = 4;

/// Plan op `EmbeddingBackward`: `dtable = 0; dtable[ids[n], :] += dout[n, :]`, each table row
/// the sum of its tokens' rows in increasing token order (bitwise reproducible: no float
/// atomics; `embedding_backward_rows` in `kernels/embedding.cu` writes every row, zeros where
/// no token has its id, with its sums in registers). dout `[N, c]` f32, ids `[N]`
/// i32, dtable `[vocab, c]` f32, `scratch` at least [`embedding_backward_scratch_len`]
/// elements. An id outside `[0, vocab)` is skipped and recorded in the device status word.
///
/// # Errors
/// [`CudaError::Shape`] on wrong lengths, [`CudaError::Invalid`] when a size exceeds `i32`;
/// the driver's status of each launch.
pub fn embedding_backward(
    dev: &Device,
    dout: &Buf,
    ids: &Buf,
    dtable: &Buf,
    vocab: usize,
    c: usize,
    scratch: &Buf,
) -> Result<()> {
    const OP: &str = "embedding_backward";
    let n = ids.len();
    dtable.expect(OP, "dtable", Elem::F32, vocab * c)?;
    ids.expect(OP, "ids", Elem::I32, n)?;
    dout.expect(OP, "dout", Elem::F32, n * c)?;
    let span = scratch.slice(0, embedding_backward_scratch_len(vocab))?;
    if vocab == 0 || c == 0 {
        return Ok(());
    }
    let (n32, v32, c32) = (int(OP, "N", n)?, int(OP, "V", vocab)?, int(OP, "C", c)?);
    let blocks = |total: usize| (total.div_ceil(256).clamp(1, 4096) as u32, 1, 1);
    dev.launch(
        "embedding_backward_span_init",
        blocks(vocab),
        (256, 1, 1),
        Args::new().buf(&span).i32(v32),
    )?;
    dev.launch(
        "embedding_backward_span",
        blocks(n),
        (256, 1, 1),
        Args::new()
            .buf(ids)
            .buf(&span)
            .i32(n32)
            .i32(v32)
            .buf(dev.status()),
    )?;
    // Threads of a block: enough for the row's columns at EMB_COLS each, at most 256; more
    // column tiles past 4 · 256 columns.
    let threads = row_threads(c.div_ceil(EMB_COLS)).min(256);
    let tiles = c.div_ceil(EMB_COLS * threads as usize);
    dev.launch(
        "embedding_backward_rows",
        (v32 as u32, int(OP, "column tiles", tiles)? as u32, 1),
        (threads, 1, 1),
        Args::new()
            .buf(dout)
            .buf(ids)
            .buf(&span)
            .buf(dtable)
            .i32(c32),
    )
}

/// Plan op `AddPositional`: `out[b·T + t, :] = x[b·T + t, :] + pos[t, :]`. x/out `[N, c]`,
/// pos `[P, c]` with `T = seq_len ≤ P` and `N` a multiple of `T`.
pub fn add_positional(
    dev: &Device,
    x: &Buf,
    pos: &Buf,
    out: &Buf,
    c: usize,
    seq_len: usize,
) -> Result<()> {
    const OP: &str = "add_positional";
    let total = x.len();
    x.expect(OP, "x", Elem::F32, total)?;
    out.expect(OP, "out", Elem::F32, total)?;
    pos.expect(OP, "pos", Elem::F32, pos.len())?;
    if seq_len == 0
        || c == 0
        || total % (seq_len * c) != 0
        || pos.len() < seq_len * c
        || pos.len() % c != 0
    {
        return Err(CudaError::Shape {
            op: OP,
            operand: "pos",
            expected: seq_len * c,
            got: pos.len(),
        });
    }
    let args = Args::new()
        .buf(x)
        .buf(pos)
        .buf(out)
        .i64(total as i64)
        .i32(int(OP, "C", c)?)
        .i32(int(OP, "T", seq_len)?);
    dev.launch(
        "add_positional",
        (dev.grid_for(total), 1, 1),
        (256, 1, 1),
        args,
    )
}

/// Plan op `AddPositionalBackward`: `dpos[t, :] = Σ_b dout[b·T + t, :]` for `t < T`, zero for
/// `t ≥ T`. dout `[N, c]`, dpos `[P, c]`.
pub fn add_positional_backward(
    dev: &Device,
    dout: &Buf,
    dpos: &Buf,
    c: usize,
    seq_len: usize,
) -> Result<()> {
    const OP: &str = "add_positional_backward";
    dout.expect(OP, "dout", Elem::F32, dout.len())?;
    dpos.expect(OP, "dpos", Elem::F32, dpos.len())?;
    if seq_len == 0
        || c == 0
        || dout.len() % (seq_len * c) != 0
        || dpos.len() < seq_len * c
        || dpos.len() % c != 0
    {
        return Err(CudaError::Shape {
            op: OP,
            operand: "dpos",
            expected: seq_len * c,
            got: dpos.len(),
        });
    }
    no_alias(OP, dout, dpos)?;
    let batch = dout.len() / (seq_len * c);
    let total = dpos.len();
    let args = Args::new()
        .buf(dout)
        .buf(dpos)
        .i64(total as i64)
        .i32(int(OP, "C", c)?)
        .i32(int(OP, "T", seq_len)?)
        .i32(int(OP, "B", batch)?);
    dev.launch(
        "add_positional_backward",
        (dev.grid_for(total), 1, 1),
        (256, 1, 1),
        args,
    )
}

/// A CUDA grid or block shape.
pub(super) type Dim3 = (u32, u32, u32);

/// Most row slabs (f32 partials per column) of the two-stage column reductions
/// (LayerNorm dweight/dbias and RMSNorm dweight in `ops::norm`, [`sum_rows`]).
pub(super) const COL_MAX_SLABS: usize = 64;
/// Rows per slab the column reductions aim at least for (`⌈N / 64⌉` slabs at most).
pub(super) const COL_SLAB_MIN_ROWS: usize = 64;

/// `(slabs, rows per slab)` of a two-stage column reduction over `n` rows: at most `most`
/// slabs, at most [`COL_MAX_SLABS`] and at most `⌈n / COL_SLAB_MIN_ROWS⌉`; at least one.
/// Every slab but the last holds `rows` rows. A function of its arguments only, so the
/// summation order (and the result) is reproducible.
pub(super) fn col_slabs(n: usize, most: usize) -> (usize, usize) {
    let want = most
        .min(n.div_ceil(COL_SLAB_MIN_ROWS))
        .clamp(1, COL_MAX_SLABS);
    let rows = n.div_ceil(want).max(1);
    (n.div_ceil(rows).max(1), rows)
}

/// Grid of a slab kernel (stage 1 of the column reductions): 32-column tiles × slabs.
pub(super) fn slab_grid(c: usize, slabs: usize) -> Dim3 {
    (c.div_ceil(32) as u32, slabs as u32, 1)
}

/// Stage 2 of the column reductions: `out_a[j] = Σ_s part_a[s·c + j]` and, when given,
/// `out_b[j] = Σ_s part_b[s·c + j]` (kernel `layernorm_backward_params_finalize`: 8 groups of
/// consecutive slabs, each summed in order, then the groups added in order). Deterministic.
#[allow(clippy::too_many_arguments)]
pub(super) fn add_slab_partials(
    dev: &Device,
    op: &'static str,
    part_a: &Buf,
    part_b: Option<&Buf>,
    out_a: &Buf,
    out_b: Option<&Buf>,
    c: usize,
    slabs: usize,
) -> Result<()> {
    let args = Args::new()
        .buf(part_a)
        .opt(part_b)
        .buf(out_a)
        .opt(out_b)
        .i32(int(op, "C", c)?)
        .i32(int(op, "slabs", slabs)?);
    dev.launch(
        "layernorm_backward_params_finalize",
        (c.div_ceil(32) as u32, 1, 1),
        (32, 8, 1),
        args,
    )
}

fn same_len(op: &'static str, bufs: &[(&'static str, &Buf)]) -> Result<usize> {
    let n = bufs[0].1.len();
    for (name, b) in bufs {
        b.expect(op, name, Elem::F32, n)?;
    }
    Ok(n)
}

/// f32 or bf16: the dtype of an activation kernel's operand (the kernels read bf16 inputs and
/// round bf16 outputs to nearest even; their math is fp32).
fn f32_or_bf16(op: &'static str, what: &'static str, b: &Buf, len: usize) -> Result<bool> {
    let bf16 = b.elem() == Elem::BF16;
    b.expect(op, what, if bf16 { Elem::BF16 } else { Elem::F32 }, len)?;
    Ok(bf16)
}

/// One kernel name per dtype combination, in operand order (false = f32, true = bf16): the
/// suffix letters of `activations.cu` (`f`, `b`).
fn by_dtypes<const N: usize>(names: &[&'static str], bf16: [bool; N]) -> &'static str {
    let i = bf16.iter().fold(0usize, |acc, &b| acc * 2 + usize::from(b));
    names[i]
}

/// Plan op `Gelu` (tanh approximation, GPT-2): x and out of the same length, each f32 or bf16
/// (a bf16 x is a bf16 GEMM's output, a bf16 out is read only by bf16 GEMMs; the plan's
/// `bf16-output` decides), math in fp32.
///
/// # Errors
/// Lengths that differ, an operand neither f32 nor bf16, launch failures.
pub fn gelu_forward(dev: &Device, x: &Buf, out: &Buf) -> Result<()> {
    const OP: &str = "gelu";
    let n = x.len();
    let kernel = by_dtypes(
        &[
            "gelu_forward_ff",
            "gelu_forward_fb",
            "gelu_forward_bf",
            "gelu_forward_bb",
        ],
        [f32_or_bf16(OP, "x", x, n)?, f32_or_bf16(OP, "out", out, n)?],
    );
    dev.launch(
        kernel,
        (dev.grid_for(n.div_ceil(4)), 1, 1),
        (256, 1, 1),
        Args::new().buf(x).buf(out).i64(n as i64),
    )
}

/// Plan op `GeluBackward`: `dx = dout · gelu′(x)`; dout, x and dx f32 or bf16 (as
/// [`gelu_forward`]; a bf16 dx is read only by bf16 GEMMs and the bias gradient's column
/// sums), all of one length.
///
/// # Errors
/// As [`gelu_forward`].
pub fn gelu_backward(dev: &Device, dout: &Buf, x: &Buf, dx: &Buf) -> Result<()> {
    const OP: &str = "gelu_backward";
    let n = dx.len();
    let kernel = by_dtypes(
        &[
            "gelu_backward_fff",
            "gelu_backward_ffb",
            "gelu_backward_fbf",
            "gelu_backward_fbb",
            "gelu_backward_bff",
            "gelu_backward_bfb",
            "gelu_backward_bbf",
            "gelu_backward_bbb",
        ],
        [
            f32_or_bf16(OP, "dout", dout, n)?,
            f32_or_bf16(OP, "x", x, n)?,
            f32_or_bf16(OP, "dx", dx, n)?,
        ],
    );
    let args = Args::new().buf(dout).buf(x).buf(dx).i64(n as i64);
    dev.launch(
        kernel,
        (dev.grid_for(n.div_ceil(4)), 1, 1),
        (256, 1, 1),
        args,
    )
}

/// Plan op `SwiGlu`: x `[N, 2f]` = `[gate | up]`, `out[n, k] = silu(gate) · up`, out `[N, f]`;
/// x and out each f32 or bf16 (as [`gelu_forward`]); the math is fp32.
///
/// # Errors
/// Lengths that do not match `f`, an operand neither f32 nor bf16, aliasing, launch failures.
pub fn swiglu_forward(dev: &Device, x: &Buf, out: &Buf, f: usize) -> Result<()> {
    const OP: &str = "swi_glu";
    let n = rows_of(OP, "out", out.len(), f)?;
    let dtypes = [
        f32_or_bf16(OP, "x", x, 2 * n * f)?,
        f32_or_bf16(OP, "out", out, n * f)?,
    ];
    no_alias(OP, x, out)?;
    let total = n * f;
    let args = Args::new()
        .buf(x)
        .buf(out)
        .i64(total as i64)
        .i32(int(OP, "F", f)?);
    let kernel = by_dtypes(
        &[
            "swiglu_forward_ff",
            "swiglu_forward_fb",
            "swiglu_forward_bf",
            "swiglu_forward_bb",
        ],
        dtypes,
    );
    dev.launch(
        kernel,
        (dev.grid_for(total.div_ceil(4)), 1, 1),
        (256, 1, 1),
        args,
    )
}

/// Plan op `SwiGluBackward`: dout `[N, f]`, x `[N, 2f]` (as the forward read it), dx `[N, 2f]`,
/// each f32 or bf16 (a bf16 dout is a bf16 GEMM's output, a bf16 dx is read only by bf16 GEMMs);
/// the math is fp32.
///
/// # Errors
/// As [`swiglu_forward`].
pub fn swiglu_backward(dev: &Device, dout: &Buf, x: &Buf, dx: &Buf, f: usize) -> Result<()> {
    const OP: &str = "swi_glu_backward";
    let n = rows_of(OP, "dout", dout.len(), f)?;
    let dtypes = [
        f32_or_bf16(OP, "dout", dout, n * f)?,
        f32_or_bf16(OP, "x", x, 2 * n * f)?,
        f32_or_bf16(OP, "dx", dx, 2 * n * f)?,
    ];
    no_alias(OP, x, dx)?;
    let total = n * f;
    let args = Args::new()
        .buf(dout)
        .buf(x)
        .buf(dx)
        .i64(total as i64)
        .i32(int(OP, "F", f)?);
    let kernel = by_dtypes(
        &[
            "swiglu_backward_fff",
            "swiglu_backward_ffb",
            "swiglu_backward_fbf",
            "swiglu_backward_fbb",
            "swiglu_backward_bff",
            "swiglu_backward_bfb",
            "swiglu_backward_bbf",
            "swiglu_backward_bbb",
        ],
        dtypes,
    );
    dev.launch(
        kernel,
        (dev.grid_for(total.div_ceil(4)), 1, 1),
        (256, 1, 1),
        args,
    )
}

/// Plan op `Add`: `out = a + b`, same lengths.
pub fn add(dev: &Device, a: &Buf, b: &Buf, out: &Buf) -> Result<()> {
    let n = same_len("add", &[("a", a), ("b", b), ("out", out)])?;
    dev.launch(
        "add_f32",
        (dev.grid_for(n), 1, 1),
        (256, 1, 1),
        Args::new().buf(a).buf(b).buf(out).i64(n as i64),
    )
}

/// Plan op `BiasAdd`: `out[n, :] = x[n, :] + bias`. x/out `[N, c]`, bias `[c]`.
pub fn bias_add(dev: &Device, x: &Buf, bias: &Buf, out: &Buf, c: usize) -> Result<()> {
    const OP: &str = "bias_add";
    let n = rows_of(OP, "x", x.len(), c)?;
    let total = same_len(OP, &[("x", x), ("out", out)])?;
    bias.expect(OP, "bias", Elem::F32, c)?;
    let _ = n;
    let args = Args::new()
        .buf(x)
        .buf(bias)
        .buf(out)
        .i64(total as i64)
        .i32(int(OP, "C", c)?);
    dev.launch("bias_add", (dev.grid_for(total), 1, 1), (256, 1, 1), args)
}

/// `(slabs, rows per slab)` of [`sum_rows`] over `n` rows: `min(⌈n / 64⌉, 64)` slabs (the
/// partials live in their own scratch, so unlike LayerNorm's there is no `N / c` bound).
pub(super) fn sum_rows_slabs(n: usize) -> (usize, usize) {
    col_slabs(n, COL_MAX_SLABS)
}

/// Scratch elements (f32) of [`sum_rows`] over `n` rows of `c`: the per-slab column partials,
/// `slabs · c` (unused when one slab is the result).
pub fn sum_rows_scratch_len(n: usize, c: usize) -> usize {
    sum_rows_slabs(n).0 * c
}

/// Plan op `SumRows`: `out[j] = Σ_n x[n, j]` (bias gradient). x `[N, c]`, out `[c]`, f32;
/// `scratch` f32 of at least [`sum_rows_scratch_len`]. Column sums over slabs of rows into
/// partials (kernel `sum_rows`, grid `⌈c / 32⌉ × slabs`), then the partials added in slab
/// order; one slab writes `out` directly. No atomics: deterministic for a given `(N, c)`.
/// Errors: [`CudaError::Shape`] on a length mismatch, [`CudaError::Operand`] on a wrong dtype
/// or memory tier, [`CudaError::Invalid`] when the scratch is too short or `N`/`c` exceed the
/// kernels' `int` range.
pub fn sum_rows(dev: &Device, x: &Buf, out: &Buf, c: usize, scratch: &Buf) -> Result<()> {
    const OP: &str = "sum_rows";
    let n = rows_of(OP, "x", x.len(), c)?;
    let bf16 = f32_or_bf16(OP, "x", x, n * c)?;
    out.expect(OP, "out", Elem::F32, c)?;
    let len = sum_rows_scratch_len(n, c);
    let scratch = scratch.slice(0, len)?;
    scratch.expect(OP, "scratch", Elem::F32, len)?;
    let (slabs, rows) = sum_rows_slabs(n);
    // bf16 x: four columns a thread where c and x's alignment allow it.
    let (kernel, per_thread) = match (bf16, c % 4 == 0 && x.ptr() % 8 == 0) {
        (false, _) => ("sum_rows", 1),
        (true, true) => ("sum_rows_bf16x4", 4),
        (true, false) => ("sum_rows_bf16x", 1),
    };
    let grid = slab_grid(c.div_ceil(per_thread), slabs);
    let args = |dst: &Buf| -> Result<Args> {
        Ok(Args::new()
            .buf(x)
            .buf(dst)
            .i32(int(OP, "N", n)?)
            .i32(int(OP, "C", c)?)
            .i32(int(OP, "rows per slab", rows)?))
    };
    if slabs == 1 {
        // One slab: its sums are the result.
        return dev.launch(kernel, grid, COL_BLOCK, args(out)?);
    }
    dev.launch(kernel, grid, COL_BLOCK, args(&scratch)?)?;
    add_slab_partials(dev, OP, &scratch, None, out, None, c, slabs)
}

/// Plan op `SumRowsCast`: [`sum_rows`]'s column sums (bit-identical: the same slabs, row lanes
/// and order) into `out` f32 `[c]` and `out_bf16 = bf16(x)` `[N, c]` (round to nearest even,
/// as [`crate::gemm::cast_f32_to_bf16`]) in one pass over x f32 `[N, c]`; `scratch` as
/// [`sum_rows`]'s. Four columns per thread (kernel `sum_rows_cast4`) where `c` is a multiple of
/// 4 and x / out_bf16 are 16- / 8-byte aligned, else one (`sum_rows_cast`).
/// Errors: those of [`sum_rows`].
pub fn sum_rows_cast(
    dev: &Device,
    x: &Buf,
    out: &Buf,
    out_bf16: &Buf,
    c: usize,
    scratch: &Buf,
) -> Result<()> {
    const OP: &str = "sum_rows_cast";
    let n = rows_of(OP, "x", x.len(), c)?;
    x.expect(OP, "x", Elem::F32, n * c)?;
    out.expect(OP, "out", Elem::F32, c)?;
    out_bf16.expect(OP, "out_bf16", Elem::BF16, n * c)?;
    let len = sum_rows_scratch_len(n, c);
    let scratch = scratch.slice(0, len)?;
    scratch.expect(OP, "scratch", Elem::F32, len)?;
    let (slabs, rows) = sum_rows_slabs(n);
    let vec = c % 4 == 0 && x.ptr() % 16 == 0 && out_bf16.ptr() % 8 == 0;
    let (kernel, per_thread) = if vec {
        ("sum_rows_cast4", 4)
    } else {
        ("sum_rows_cast", 1)
    };
    let grid = slab_grid(c.div_ceil(per_thread), slabs);
    let args = |dst: &Buf| -> Result<Args> {
        Ok(Args::new()
            .buf(x)
            .buf(dst)
            .buf(out_bf16)
            .i32(int(OP, "N", n)?)
            .i32(int(OP, "C", c)?)
            .i32(int(OP, "rows per slab", rows)?))
    };
    if slabs == 1 {
        return dev.launch(kernel, grid, COL_BLOCK, args(out)?);
    }
    dev.launch(kernel, grid, COL_BLOCK, args(&scratch)?)?;
    add_slab_partials(dev, OP, &scratch, None, out, None, c, slabs)
}

/// Geometry of a RoPE call (plan op `Rope`): x `[N, width]`, the first `rotated_cols` columns
/// rotated in chunks of `head_dim`, row n at position `n mod seq_len`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeDims {
    /// Columns of x.
    pub width: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Width of one head chunk (even).
    pub head_dim: usize,
    /// Leading rotated columns (multiple of `head_dim`, ≤ `width`).
    pub rotated_cols: usize,
    /// Frequency base.
    pub theta: f64,
}

/// Scratch elements (f32) of [`rope_forward`] / [`rope_backward`]: the `[seq_len, head_dim/2]`
/// cosine and sine table, interleaved.
pub fn rope_scratch_len(seq_len: usize, head_dim: usize) -> usize {
    2 * seq_len * (head_dim / 2)
}

#[allow(clippy::too_many_arguments)]
fn rope(
    dev: &Device,
    op: &'static str,
    x: &Buf,
    out: &Buf,
    d: &RopeDims,
    sign: f32,
    scratch: &Buf,
) -> Result<()> {
    // The forward's out and the backward's dx may be bf16 (`rope_rotate_bf16`: where only the
    // tensor-core attention or bf16 GEMMs read them); x is f32.
    let bf16_out = out.elem() == Elem::BF16;
    let total = x.len();
    x.expect(op, "x", Elem::F32, total)?;
    out.expect(
        op,
        "out",
        if bf16_out { Elem::BF16 } else { Elem::F32 },
        total,
    )?;
    let bad = d.width == 0
        || total % d.width != 0
        || d.seq_len == 0
        || d.head_dim == 0
        || d.head_dim % 2 != 0
        || d.rotated_cols % d.head_dim != 0
        || d.rotated_cols > d.width;
    if bad {
        return Err(CudaError::Invalid {
            op,
            what: format!("inconsistent geometry {d:?} for {total} elements"),
        });
    }
    no_alias(op, x, out)?;
    let len = rope_scratch_len(d.seq_len, d.head_dim);
    let table = scratch.slice(0, len)?;
    table.expect(op, "scratch", Elem::F32, len)?;
    let rows = total / d.width;
    if rows == 0 {
        return Ok(());
    }
    let args = Args::new()
        .buf(&table)
        .i32(int(op, "seq_len", d.seq_len)?)
        .i32(int(op, "head_dim", d.head_dim)?)
        .f64(d.theta);
    dev.launch(
        "rope_table",
        (dev.grid_for(len / 2), 1, 1),
        (256, 1, 1),
        args,
    )?;
    let work = rows * (d.width - d.rotated_cols / 2);
    let args = Args::new()
        .buf(x)
        .buf(out)
        .buf(&table)
        .i64(rows as i64)
        .i32(int(op, "width", d.width)?)
        .i32(int(op, "seq_len", d.seq_len)?)
        .i32(int(op, "head_dim", d.head_dim)?)
        .i32(int(op, "rotated_cols", d.rotated_cols)?)
        .f32(sign);
    let kernel = if bf16_out {
        "rope_rotate_bf16"
    } else {
        "rope_rotate"
    };
    dev.launch(kernel, (dev.grid_for(work), 1, 1), (256, 1, 1), args)
}

/// Plan op `Rope` (rotate-half layout, angle `p·theta^(−2i/head_dim)`). x f32 `[N, width]`, out
/// f32 or bf16 (round to nearest even: the plan makes it bf16 where only the tensor-core
/// attention reads it); `scratch` f32 of at least [`rope_scratch_len`] (the angle table, computed in
/// f64 and rounded to f32 as the CPU engine's).
pub fn rope_forward(dev: &Device, x: &Buf, out: &Buf, d: &RopeDims, scratch: &Buf) -> Result<()> {
    rope(dev, "rope", x, out, d, 1.0, scratch)
}

/// Plan op `RopeBackward`: the inverse rotation. Shapes and scratch as [`rope_forward`].
pub fn rope_backward(
    dev: &Device,
    dout: &Buf,
    dx: &Buf,
    d: &RopeDims,
    scratch: &Buf,
) -> Result<()> {
    rope(dev, "rope_backward", dout, dx, d, -1.0, scratch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_rows_slabs_cover_the_rows_and_fit_the_scratch() {
        assert_eq!(sum_rows_slabs(16384), (64, 256));
        assert_eq!(sum_rows_slabs(1000), (16, 63));
        assert_eq!(sum_rows_slabs(64), (1, 64));
        assert_eq!(sum_rows_slabs(0), (1, 1));
        assert_eq!(sum_rows_scratch_len(16384, 3072), 64 * 3072);
        for n in [0, 1, 3, 63, 64, 65, 1000, 1031, 4096, 16384, 100_000] {
            let (slabs, rows) = sum_rows_slabs(n);
            assert!((1..=COL_MAX_SLABS).contains(&slabs), "n={n}");
            assert!(slabs * rows >= n && (slabs - 1) * rows < n.max(1), "n={n}");
            assert!(slabs <= n.div_ceil(COL_SLAB_MIN_ROWS).max(1), "n={n}");
            for c in [1, 3, 50, 768, 783, 3072] {
                assert_eq!(sum_rows_scratch_len(n, c), slabs * c);
            }
        }
    }
}
