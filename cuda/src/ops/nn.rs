//! Launchers of the model ops: embedding, positional add, LayerNorm, RMSNorm, GELU, SwiGLU,
//! RoPE, add, bias add and column sums (kernel families `embedding`, `positional`,
//! `layernorm`, `rmsnorm`, `activations`, `rope`, `elementwise`).
use super::{int, no_alias, row_threads, rows_of};
use crate::device::Device;
use crate::error::{CudaError, Result};
use crate::kernels::Args;
use crate::memory::{Buf, Elem};

/// Block of the column-tile kernels: 32 columns × 16 row lanes.
const COL_BLOCK: (u32, u32, u32) = (32, 16, 1);

fn col_grid(c: usize) -> (u32, u32, u32) {
    (c.div_ceil(32).max(1) as u32, 1, 1)
}

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

/// Plan op `EmbeddingBackward`: `dtable = 0; dtable[ids[n], :] += dout[n, :]` (float atomics:
/// the order of additions into one row is unspecified). dout `[N, c]`, dtable `[vocab, c]`.
pub fn embedding_backward(
    dev: &Device,
    dout: &Buf,
    ids: &Buf,
    dtable: &Buf,
    vocab: usize,
    c: usize,
) -> Result<()> {
    const OP: &str = "embedding_backward";
    let n = ids.len();
    dtable.expect(OP, "dtable", Elem::F32, vocab * c)?;
    ids.expect(OP, "ids", Elem::I32, n)?;
    dout.expect(OP, "dout", Elem::F32, n * c)?;
    dev.zero(dtable)?;
    if n == 0 {
        return Ok(());
    }
    let args = Args::new()
        .buf(dout)
        .buf(ids)
        .buf(dtable)
        .i32(int(OP, "N", n)?)
        .i32(int(OP, "C", c)?)
        .i32(int(OP, "V", vocab)?);
    dev.launch(
        "embedding_backward",
        (n as u32, 1, 1),
        (row_threads(c).min(256), 1, 1),
        args.buf(dev.status()),
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

/// Plan op `LayerNorm`: `out = (x − μ)/√(σ² + eps) · weight + bias` per row (biased σ²).
/// x/out `[N, c]`, weight/bias `[c]`.
pub fn layernorm_forward(
    dev: &Device,
    x: &Buf,
    weight: &Buf,
    bias: Option<&Buf>,
    out: &Buf,
    c: usize,
    eps: f64,
) -> Result<()> {
    const OP: &str = "layer_norm";
    let n = rows_of(OP, "x", x.len(), c)?;
    x.expect(OP, "x", Elem::F32, n * c)?;
    out.expect(OP, "out", Elem::F32, n * c)?;
    weight.expect(OP, "weight", Elem::F32, c)?;
    if let Some(b) = bias {
        b.expect(OP, "bias", Elem::F32, c)?;
    }
    if n == 0 {
        return Ok(());
    }
    let args = Args::new()
        .buf(x)
        .buf(weight)
        .opt(bias)
        .buf(out)
        .i32(int(OP, "N", n)?)
        .i32(int(OP, "C", c)?)
        .f32(eps as f32);
    dev.launch(
        "layernorm_forward",
        (n as u32, 1, 1),
        (row_threads(c), 1, 1),
        args,
    )
}

/// Scratch elements (f32) of [`layernorm_backward`]: `2N` (row mean and rstd).
pub fn layernorm_backward_scratch_len(n_rows: usize) -> usize {
    2 * n_rows
}

/// Plan op `LayerNormBackward`: dx `[N, c]` and dweight/dbias `[c]` (overwritten), statistics
/// recomputed from `x`. `scratch` f32 of at least [`layernorm_backward_scratch_len`].
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward(
    dev: &Device,
    dout: &Buf,
    x: &Buf,
    weight: &Buf,
    dx: &Buf,
    dweight: &Buf,
    dbias: Option<&Buf>,
    c: usize,
    eps: f64,
    scratch: &Buf,
) -> Result<()> {
    const OP: &str = "layer_norm_backward";
    let n = rows_of(OP, "x", x.len(), c)?;
    for (name, b) in [("dout", dout), ("x", x), ("dx", dx)] {
        b.expect(OP, name, Elem::F32, n * c)?;
    }
    weight.expect(OP, "weight", Elem::F32, c)?;
    dweight.expect(OP, "dweight", Elem::F32, c)?;
    if let Some(b) = dbias {
        b.expect(OP, "dbias", Elem::F32, c)?;
    }
    let stats = scratch.slice(0, layernorm_backward_scratch_len(n))?;
    stats.expect(OP, "scratch", Elem::F32, 2 * n)?;
    if n > 0 {
        let args = Args::new()
            .buf(dout)
            .buf(x)
            .buf(weight)
            .buf(dx)
            .buf(&stats)
            .i32(int(OP, "N", n)?)
            .i32(int(OP, "C", c)?)
            .f32(eps as f32);
        dev.launch(
            "layernorm_backward_dx",
            (n as u32, 1, 1),
            (row_threads(c), 1, 1),
            args,
        )?;
    }
    let args = Args::new()
        .buf(dout)
        .buf(x)
        .buf(&stats)
        .buf(dweight)
        .opt(dbias)
        .i32(n as i32)
        .i32(int(OP, "C", c)?);
    dev.launch("layernorm_backward_params", col_grid(c), COL_BLOCK, args)
}

/// Plan op `RmsNorm`: `out = x / √(mean(x²) + eps) · weight`. x/out `[N, c]`, weight `[c]`.
pub fn rmsnorm_forward(
    dev: &Device,
    x: &Buf,
    weight: &Buf,
    out: &Buf,
    c: usize,
    eps: f64,
) -> Result<()> {
    const OP: &str = "rms_norm";
    let n = rows_of(OP, "x", x.len(), c)?;
    x.expect(OP, "x", Elem::F32, n * c)?;
    out.expect(OP, "out", Elem::F32, n * c)?;
    weight.expect(OP, "weight", Elem::F32, c)?;
    if n == 0 {
        return Ok(());
    }
    let args = Args::new()
        .buf(x)
        .buf(weight)
        .buf(out)
        .i32(int(OP, "N", n)?)
        .i32(int(OP, "C", c)?)
        .f32(eps as f32);
    dev.launch(
        "rmsnorm_forward",
        (n as u32, 1, 1),
        (row_threads(c), 1, 1),
        args,
    )
}

/// Scratch elements (f32) of [`rmsnorm_backward`]: `N` (row 1/rms).
pub fn rmsnorm_backward_scratch_len(n_rows: usize) -> usize {
    n_rows
}

/// Plan op `RmsNormBackward`: dx `[N, c]`, dweight `[c]` (overwritten). `scratch` f32 of at
/// least [`rmsnorm_backward_scratch_len`].
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward(
    dev: &Device,
    dout: &Buf,
    x: &Buf,
    weight: &Buf,
    dx: &Buf,
    dweight: &Buf,
    c: usize,
    eps: f64,
    scratch: &Buf,
) -> Result<()> {
    const OP: &str = "rms_norm_backward";
    let n = rows_of(OP, "x", x.len(), c)?;
    for (name, b) in [("dout", dout), ("x", x), ("dx", dx)] {
        b.expect(OP, name, Elem::F32, n * c)?;
    }
    weight.expect(OP, "weight", Elem::F32, c)?;
    dweight.expect(OP, "dweight", Elem::F32, c)?;
    let rinv = scratch.slice(0, n)?;
    rinv.expect(OP, "scratch", Elem::F32, n)?;
    if n > 0 {
        let args = Args::new()
            .buf(dout)
            .buf(x)
            .buf(weight)
            .buf(dx)
            .buf(&rinv)
            .i32(int(OP, "N", n)?)
            .i32(int(OP, "C", c)?)
            .f32(eps as f32);
        dev.launch(
            "rmsnorm_backward_dx",
            (n as u32, 1, 1),
            (row_threads(c), 1, 1),
            args,
        )?;
    }
    let args = Args::new()
        .buf(dout)
        .buf(x)
        .buf(&rinv)
        .buf(dweight)
        .i32(n as i32)
        .i32(int(OP, "C", c)?);
    dev.launch("rmsnorm_backward_weight", col_grid(c), COL_BLOCK, args)
}

fn same_len(op: &'static str, bufs: &[(&'static str, &Buf)]) -> Result<usize> {
    let n = bufs[0].1.len();
    for (name, b) in bufs {
        b.expect(op, name, Elem::F32, n)?;
    }
    Ok(n)
}

/// Plan op `Gelu` (tanh approximation, GPT-2). Same shapes.
pub fn gelu_forward(dev: &Device, x: &Buf, out: &Buf) -> Result<()> {
    let n = same_len("gelu", &[("x", x), ("out", out)])?;
    dev.launch(
        "gelu_forward",
        (dev.grid_for(n), 1, 1),
        (256, 1, 1),
        Args::new().buf(x).buf(out).i64(n as i64),
    )
}

/// Plan op `GeluBackward`: `dx = dout · gelu′(x)`.
pub fn gelu_backward(dev: &Device, dout: &Buf, x: &Buf, dx: &Buf) -> Result<()> {
    let n = same_len("gelu_backward", &[("dout", dout), ("x", x), ("dx", dx)])?;
    let args = Args::new().buf(dout).buf(x).buf(dx).i64(n as i64);
    dev.launch("gelu_backward", (dev.grid_for(n), 1, 1), (256, 1, 1), args)
}

/// Plan op `SwiGlu`: x `[N, 2f]` = `[gate | up]`, `out[n, k] = silu(gate) · up`, out `[N, f]`.
pub fn swiglu_forward(dev: &Device, x: &Buf, out: &Buf, f: usize) -> Result<()> {
    const OP: &str = "swi_glu";
    let n = rows_of(OP, "out", out.len(), f)?;
    x.expect(OP, "x", Elem::F32, 2 * n * f)?;
    out.expect(OP, "out", Elem::F32, n * f)?;
    no_alias(OP, x, out)?;
    let total = n * f;
    let args = Args::new()
        .buf(x)
        .buf(out)
        .i64(total as i64)
        .i32(int(OP, "F", f)?);
    dev.launch(
        "swiglu_forward",
        (dev.grid_for(total), 1, 1),
        (256, 1, 1),
        args,
    )
}

/// Plan op `SwiGluBackward`: dout `[N, f]`, x/dx `[N, 2f]`.
pub fn swiglu_backward(dev: &Device, dout: &Buf, x: &Buf, dx: &Buf, f: usize) -> Result<()> {
    const OP: &str = "swi_glu_backward";
    let n = rows_of(OP, "dout", dout.len(), f)?;
    dout.expect(OP, "dout", Elem::F32, n * f)?;
    x.expect(OP, "x", Elem::F32, 2 * n * f)?;
    dx.expect(OP, "dx", Elem::F32, 2 * n * f)?;
    no_alias(OP, x, dx)?;
    let total = n * f;
    let args = Args::new()
        .buf(dout)
        .buf(x)
        .buf(dx)
        .i64(total as i64)
        .i32(int(OP, "F", f)?);
    dev.launch(
        "swiglu_backward",
        (dev.grid_for(total), 1, 1),
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

/// Plan op `SumRows`: `out[j] = Σ_n x[n, j]` (bias gradient). x `[N, c]`, out `[c]`.
pub fn sum_rows(dev: &Device, x: &Buf, out: &Buf, c: usize) -> Result<()> {
    const OP: &str = "sum_rows";
    let n = rows_of(OP, "x", x.len(), c)?;
    x.expect(OP, "x", Elem::F32, n * c)?;
    out.expect(OP, "out", Elem::F32, c)?;
    let args = Args::new()
        .buf(x)
        .buf(out)
        .i32(int(OP, "N", n)?)
        .i32(int(OP, "C", c)?);
    dev.launch("sum_rows", col_grid(c), COL_BLOCK, args)
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

fn rope(dev: &Device, op: &'static str, x: &Buf, out: &Buf, d: &RopeDims, sign: f32) -> Result<()> {
    let total = same_len(op, &[("x", x), ("out", out)])?;
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
    let args = Args::new()
        .buf(x)
        .buf(out)
        .i64(total as i64)
        .i32(int(op, "width", d.width)?)
        .i32(int(op, "seq_len", d.seq_len)?)
        .i32(int(op, "head_dim", d.head_dim)?)
        .i32(int(op, "rotated_cols", d.rotated_cols)?)
        .f64(d.theta)
        .f32(sign);
    dev.launch(
        "rope_rotate",
        (dev.grid_for(total), 1, 1),
        (256, 1, 1),
        args,
    )
}

/// Plan op `Rope` (rotate-half layout, angle `p·theta^(−2i/head_dim)`).
pub fn rope_forward(dev: &Device, x: &Buf, out: &Buf, d: &RopeDims) -> Result<()> {
    rope(dev, "rope", x, out, d, 1.0)
}

/// Plan op `RopeBackward`: the inverse rotation.
pub fn rope_backward(dev: &Device, dout: &Buf, dx: &Buf, d: &RopeDims) -> Result<()> {
    rope(dev, "rope_backward", dout, dx, d, -1.0)
}
