//! Launchers of the normalisation ops: LayerNorm and RMSNorm, forward and backward (kernel
//! families `layernorm`, `rmsnorm`). Their weight gradients use the two-stage column
//! reductions of `ops::nn` (slab partials, then the slabs added in order).
use super::nn::{
    add_slab_partials, col_slabs, slab_grid, sum_rows_slabs, Dim3, COL_BLOCK, COL_MAX_SLABS,
};
use super::{int, row_threads, rows_of};
use crate::device::Device;
use crate::error::{CudaError, Result};
use crate::kernels::Args;
use crate::memory::{Buf, Elem};

/// Warp-per-row LayerNorm kernels by values per lane `V` (rows of `c ≤ 32·V`):
/// `(V, forward, fused backward)`. Wider rows take the block-per-row kernels.
const LN_WARP_KERNELS: [(usize, &str, &str); 5] = [
    (8, "layernorm_forward_w8", "layernorm_backward_w8"),
    (16, "layernorm_forward_w16", "layernorm_backward_w16"),
    (24, "layernorm_forward_w24", "layernorm_backward_w24"),
    (32, "layernorm_forward_w32", "layernorm_backward_w32"),
    (64, "layernorm_forward_w64", "layernorm_backward_w64"),
];

/// Warps (rows in flight) per block of the fused warp-per-row backward (`LN_BWD_WARPS` in
/// `kernels/layernorm.cu`); each keeps `2·c` f32 column sums in shared memory.
const LN_BWD_WARPS: usize = 8;
/// Most slabs (blocks) of the fused warp-per-row backward: ~4 blocks of 8 warps per H200 SM
/// at N = 16384, and at most `512 · 2c` f32 partials for the finalize to add.
const LN_BWD_MAX_SLABS: usize = 512;
/// Fewest rows per slab of the fused backward (two per warp), so that zeroing and adding a
/// block's column sums stays small beside its rows.
const LN_BWD_MIN_ROWS: usize = 16;

/// `(slabs, rows per slab)` of the fused warp-per-row LayerNorm backward over `n` rows: at most
/// [`LN_BWD_MAX_SLABS`] slabs of at least [`LN_BWD_MIN_ROWS`] rows (one slab when `n` is
/// smaller). Depends on `n` only, so the summation order of dweight/dbias (and the result)
/// is reproducible.
fn ln_bwd_slabs(n: usize) -> (usize, usize) {
    let rows = n.div_ceil(LN_BWD_MAX_SLABS).max(LN_BWD_MIN_ROWS);
    (n.div_ceil(rows).max(1), rows)
}

/// Rows (= warps) per 256-thread block of the warp-per-row LayerNorm kernels.
const LN_WARP_ROWS: usize = 8;

/// Widest row the warp-per-row LayerNorm kernels hold in registers (32 lanes × 64 values).
pub const LAYERNORM_WARP_MAX_C: usize = 32 * 64;

/// The `(forward, backward dx)` warp-per-row kernels for rows of `c`, or `None` past
/// [`LAYERNORM_WARP_MAX_C`].
fn ln_warp_kernels(c: usize) -> Option<(&'static str, &'static str)> {
    LN_WARP_KERNELS
        .iter()
        .find(|(v, _, _)| c <= 32 * v)
        .map(|&(_, f, b)| (f, b))
}

/// Launch shape of a LayerNorm row kernel over `n ≥ 1` rows of `c`: the warp-per-row kernel
/// (8 rows a block) when `c` fits, else the block-per-row `fallback`.
fn ln_row_launch(
    n: usize,
    c: usize,
    warp: Option<&'static str>,
    fallback: &'static str,
) -> (&'static str, Dim3, Dim3) {
    match warp {
        Some(k) => (
            k,
            (n.div_ceil(LN_WARP_ROWS) as u32, 1, 1),
            ((32 * LN_WARP_ROWS) as u32, 1, 1),
        ),
        None => (fallback, (n as u32, 1, 1), (row_threads(c), 1, 1)),
    }
}

/// Plan op `LayerNorm`: `out = (x − μ)/√(σ² + eps) · weight + bias` per row (biased σ²).
/// x/out `[N, c]`, weight/bias `[c]` (bias optional), all f32. Rows of
/// `c ≤` [`LAYERNORM_WARP_MAX_C`] take one warp each (values in registers), wider rows one
/// block each. Errors: [`CudaError::Shape`] on a length mismatch, [`CudaError::Operand`] on
/// a wrong dtype or memory tier, [`CudaError::Invalid`] when `N` or `c` exceeds the kernels'
/// `int` range.
pub fn layernorm_forward(
    dev: &Device,
    x: &Buf,
    weight: &Buf,
    bias: Option<&Buf>,
    out: &Buf,
    c: usize,
    eps: f64,
) -> Result<()> {
    ln_forward(dev, x, weight, bias, out, c, eps, Elem::F32)
}

/// [`layernorm_forward`] with a bf16 output `out` ([`Elem::BF16`] `[N, c]`, round to nearest
/// even: the bits of the f32 output cast afterwards), for an output that only bf16 GEMMs read.
/// Warp-per-row rows only (`c ≤` [`LAYERNORM_WARP_MAX_C`]).
///
/// # Errors
/// As [`layernorm_forward`], and [`CudaError::Invalid`] for `c >` [`LAYERNORM_WARP_MAX_C`].
pub fn layernorm_forward_bf16(
    dev: &Device,
    x: &Buf,
    weight: &Buf,
    bias: Option<&Buf>,
    out: &Buf,
    c: usize,
    eps: f64,
) -> Result<()> {
    ln_forward(dev, x, weight, bias, out, c, eps, Elem::BF16)
}

/// The two LayerNorm forward launchers: `out` of `elem` (f32: warp-per-row or block-per-row
/// kernels; bf16: the warp-per-row `_bf16` kernels only).
#[allow(clippy::too_many_arguments)]
fn ln_forward(
    dev: &Device,
    x: &Buf,
    weight: &Buf,
    bias: Option<&Buf>,
    out: &Buf,
    c: usize,
    eps: f64,
    elem: Elem,
) -> Result<()> {
    let op = if elem == Elem::BF16 {
        "layer_norm_bf16"
    } else {
        "layer_norm"
    };
    let n = rows_of(op, "x", x.len(), c)?;
    x.expect(op, "x", Elem::F32, n * c)?;
    out.expect(op, "out", elem, n * c)?;
    weight.expect(op, "weight", Elem::F32, c)?;
    if let Some(b) = bias {
        b.expect(op, "bias", Elem::F32, c)?;
    }
    let warp = if elem == Elem::BF16 {
        let v = LN_WARP_KERNELS
            .iter()
            .find(|(v, _, _)| c <= 32 * v)
            .map(|t| t.0);
        let Some(v) = v else {
            return Err(CudaError::Invalid {
                op,
                what: format!("rows of {c} exceed the warp kernels' {LAYERNORM_WARP_MAX_C}"),
            });
        };
        Some(match v {
            8 => "layernorm_forward_bf16_w8",
            16 => "layernorm_forward_bf16_w16",
            24 => "layernorm_forward_bf16_w24",
            32 => "layernorm_forward_bf16_w32",
            _ => "layernorm_forward_bf16_w64",
        })
    } else {
        ln_warp_kernels(c).map(|(f, _)| f)
    };
    if n == 0 {
        return Ok(());
    }
    let args = Args::new()
        .buf(x)
        .buf(weight)
        .opt(bias)
        .buf(out)
        .i32(int(op, "N", n)?)
        .i32(int(op, "C", c)?)
        .f32(eps as f32);
    let (kernel, grid, block) = ln_row_launch(n, c, warp, "layernorm_forward");
    dev.launch(kernel, grid, block, args)
}

/// Block of the dweight/dbias slab kernel: 32 columns × 8 row lanes.
const LN_PARAM_BLOCK: Dim3 = (32, 8, 1);

/// `(slabs, rows per slab)` of the dweight/dbias reduction over `n` rows of `c`: [`col_slabs`]
/// at its most (`min(⌈N / 64⌉, 64)` slabs; their partials have their own scratch). Until
/// 2026-12 the partials had to fit a `2N` area (`slabs ≤ N / c`), which left 2 slabs, 128 column
/// blocks, at N = 4096, c = 2048: a quarter of the H200's memory rate. Depends on `n` only.
fn ln_param_slabs(n: usize, _c: usize) -> (usize, usize) {
    col_slabs(n, COL_MAX_SLABS)
}

/// Launches a block-per-row dx kernel of a norm's backward (`layernorm_backward_dx`,
/// `rmsnorm_backward_dx`): `bufs` = dout, x `[N, c]`, weight `[c]`, dx `[N, c]` and the
/// per-row statistics it writes, then N, c, eps; one block of `row_threads(c)` per row; nothing
/// for `n = 0`.
fn dx_block_per_row(
    dev: &Device,
    op: &'static str,
    kernel: &'static str,
    bufs: [&Buf; 5],
    n: usize,
    c: usize,
    eps: f64,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let args = bufs
        .iter()
        .fold(Args::new(), |a, b| a.buf(b))
        .i32(int(op, "N", n)?)
        .i32(int(op, "C", c)?)
        .f32(eps as f32);
    dev.launch(kernel, (n as u32, 1, 1), (row_threads(c), 1, 1), args)
}

/// Scratch elements (f32) of [`layernorm_backward`] over `n_rows` rows of `c`: the slabs'
/// dweight and dbias partials, and for rows wider than [`LAYERNORM_WARP_MAX_C`] (the
/// block-per-row kernels) also each row's mean and rstd.
pub fn layernorm_backward_scratch_len(n_rows: usize, c: usize) -> usize {
    let two_pass = 2 * n_rows + 2 * ln_param_slabs(n_rows, c).0 * c;
    if ln_warp_kernels(c).is_some() {
        // The fused pass, or the two-pass fallback where the device's shared memory per
        // block is too small for the fused kernel's column sums (see `ln_bwd_smem`).
        two_pass.max(2 * ln_bwd_slabs(n_rows).0 * c)
    } else {
        two_pass
    }
}

/// Dynamic shared memory (bytes) of the fused warp-per-row backward over rows of `c`: each of
/// its [`LN_BWD_WARPS`] warps keeps `2·c` f32 column sums (128 KiB at c = 2048; an H100/H200
/// allows 227 KiB a block, an sm_86/89/12x GPU ~99 KiB).
fn ln_bwd_smem(c: usize) -> usize {
    2 * LN_BWD_WARPS * c * std::mem::size_of::<f32>()
}

/// Plan op `LayerNormBackward`: dx `[N, c]` and dweight/dbias `[c]` (overwritten; dbias
/// optional), all f32, statistics recomputed from `x`. `scratch` f32 of at least
/// [`layernorm_backward_scratch_len`]. Rows of `c ≤` [`LAYERNORM_WARP_MAX_C`]: one fused pass,
/// a warp per row, each block summing its slab's dweight/dbias partials (where the device
/// allows the block [`ln_bwd_smem`] bytes of shared memory); wider rows (or less shared
/// memory): one block per row for dx, then a column-sum pass over slabs of rows. The partials
/// are then added in a fixed order. No atomics: deterministic.
/// Errors: [`CudaError::Shape`] on a length mismatch, [`CudaError::Operand`] on a wrong
/// dtype or memory tier, [`CudaError::Invalid`] when the scratch is too short or `N`/`c`
/// exceed the kernels' `int` range.
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
    let len = layernorm_backward_scratch_len(n, c);
    let scratch = scratch.slice(0, len)?;
    scratch.expect(OP, "scratch", Elem::F32, len)?;
    let smem = ln_bwd_smem(c);
    let fused = ln_warp_kernels(c).filter(|_| smem <= dev.info().max_shared_per_block_optin);
    if let Some((_, kernel)) = fused {
        let (slabs, rows) = ln_bwd_slabs(n);
        let pw = scratch.slice(0, slabs * c)?;
        let pb = scratch.slice(slabs * c, slabs * c)?;
        let args = Args::new()
            .buf(dout)
            .buf(x)
            .buf(weight)
            .buf(dx)
            .buf(&pw)
            .opt(dbias.map(|_| &pb))
            .i32(int(OP, "N", n)?)
            .i32(int(OP, "C", c)?)
            .f32(eps as f32)
            .i32(int(OP, "rows per slab", rows)?);
        dev.launch_smem(
            kernel,
            (slabs as u32, 1, 1),
            ((32 * LN_BWD_WARPS) as u32, 1, 1),
            int(OP, "shared memory", smem)? as u32,
            args,
        )?;
        let pb = dbias.map(|_| &pb);
        return add_slab_partials(dev, OP, &pw, pb, dweight, dbias, c, slabs);
    }
    let stats = scratch.slice(0, 2 * n)?;
    let bufs = [dout, x, weight, dx, &stats];
    dx_block_per_row(dev, OP, "layernorm_backward_dx", bufs, n, c, eps)?;
    let (slabs, rows) = ln_param_slabs(n, c);
    let grid = slab_grid(c, slabs);
    let slab_args = |pw: &Buf, pb: Option<&Buf>| -> Result<Args> {
        Ok(Args::new()
            .buf(dout)
            .buf(x)
            .buf(&stats)
            .buf(pw)
            .opt(pb)
            .i32(int(OP, "N", n)?)
            .i32(int(OP, "C", c)?)
            .i32(int(OP, "rows per slab", rows)?))
    };
    if slabs == 1 {
        // One slab: its sums are the result.
        let args = slab_args(dweight, dbias)?;
        return dev.launch("layernorm_backward_params", grid, LN_PARAM_BLOCK, args);
    }
    let pw = scratch.slice(2 * n, slabs * c)?;
    let pb = scratch.slice(2 * n + slabs * c, slabs * c)?;
    let args = slab_args(&pw, dbias.map(|_| &pb))?;
    dev.launch("layernorm_backward_params", grid, LN_PARAM_BLOCK, args)?;
    let pb = dbias.map(|_| &pb);
    add_slab_partials(dev, OP, &pw, pb, dweight, dbias, c, slabs)
}

/// Plan op `RmsNorm`: `out = x / √(mean(x²) + eps) · weight`. x f32 `[N, c]`, weight f32
/// `[c]`, out `[N, c]` f32 or bf16 (round to nearest even; the plan makes it bf16 where only
/// bf16 GEMMs read it).
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
    let bf16 = out.elem() == Elem::BF16;
    out.expect(OP, "out", if bf16 { Elem::BF16 } else { Elem::F32 }, n * c)?;
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
        if bf16 {
            "rmsnorm_forward_bf16"
        } else {
            "rmsnorm_forward"
        },
        (n as u32, 1, 1),
        (row_threads(c), 1, 1),
        args,
    )
}

/// Scratch elements (f32) of [`rmsnorm_backward`] over `n_rows` rows of `c`: `N` (row 1/rms)
/// and the dweight partials, `slabs · c` (`sum_rows`' slabs: at most 64).
pub fn rmsnorm_backward_scratch_len(n_rows: usize, c: usize) -> usize {
    n_rows + sum_rows_slabs(n_rows).0 * c
}

/// Plan op `RmsNormBackward`: dx `[N, c]`, dweight `[c]` (overwritten). `scratch` f32 of at
/// least [`rmsnorm_backward_scratch_len`]. dx: one block per row; dweight: a two-stage column
/// reduction (slabs of rows into partials, then the partials added in a fixed order), so the
/// result is deterministic for a given `(N, c)`.
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
    let len = rmsnorm_backward_scratch_len(n, c);
    let scratch = scratch.slice(0, len)?;
    scratch.expect(OP, "scratch", Elem::F32, len)?;
    let rinv = scratch.slice(0, n)?;
    let bufs = [dout, x, weight, dx, &rinv];
    dx_block_per_row(dev, OP, "rmsnorm_backward_dx", bufs, n, c, eps)?;
    let (slabs, rows) = sum_rows_slabs(n);
    let args = |dst: &Buf| -> Result<Args> {
        Ok(Args::new()
            .buf(dout)
            .buf(x)
            .buf(&rinv)
            .buf(dst)
            .i32(int(OP, "N", n)?)
            .i32(int(OP, "C", c)?)
            .i32(int(OP, "rows per slab", rows)?))
    };
    let grid = slab_grid(c, slabs);
    if slabs == 1 {
        return dev.launch("rmsnorm_backward_weight", grid, COL_BLOCK, args(dweight)?);
    }
    let part = scratch.slice(n, slabs * c)?;
    dev.launch("rmsnorm_backward_weight", grid, COL_BLOCK, args(&part)?)?;
    add_slab_partials(dev, OP, &part, None, dweight, None, c, slabs)
}

#[cfg(test)]
mod tests {
    use super::super::nn::COL_SLAB_MIN_ROWS;
    use super::*;

    #[test]
    fn layernorm_warp_kernel_widths() {
        // (width, forward kernel, backward kernel) at the edges of each width class.
        for (c, fwd, bwd) in [
            (1, "layernorm_forward_w8", "layernorm_backward_w8"),
            (256, "layernorm_forward_w8", "layernorm_backward_w8"),
            (257, "layernorm_forward_w16", "layernorm_backward_w16"),
            (768, "layernorm_forward_w24", "layernorm_backward_w24"),
            (783, "layernorm_forward_w32", "layernorm_backward_w32"),
            (
                LAYERNORM_WARP_MAX_C,
                "layernorm_forward_w64",
                "layernorm_backward_w64",
            ),
        ] {
            let k = ln_warp_kernels(c).expect("a warp kernel");
            assert_eq!((k.0, k.1), (fwd, bwd), "c = {c}");
        }
        assert_eq!(ln_warp_kernels(LAYERNORM_WARP_MAX_C + 1), None);
        let (k, grid, block) = ln_row_launch(1001, 768, Some("w"), "fallback");
        assert_eq!((k, grid, block), ("w", (126, 1, 1), (256, 1, 1)));
        let (k, grid, block) = ln_row_launch(3, 4096, None, "fallback");
        assert_eq!((k, grid, block), ("fallback", (3, 1, 1), (1024, 1, 1)));
    }

    #[test]
    fn layernorm_param_slabs_fit_the_scratch_and_cover_the_rows() {
        assert_eq!(ln_param_slabs(16384, 768), (64, 256));
        assert_eq!(ln_param_slabs(4096, 2048), (64, 64));
        assert_eq!(ln_param_slabs(0, 50), (1, 1));
        assert_eq!(ln_param_slabs(3, 50), (1, 3));
        for n in [1, 3, 63, 64, 65, 1000, 1031, 4096, 16384, 100_000] {
            for c in [1, 3, 50, 768, 783, 2048, 2049, 4096] {
                let (slabs, rows) = ln_param_slabs(n, c);
                assert!((1..=COL_MAX_SLABS).contains(&slabs), "n={n} c={c}");
                assert!(slabs * rows >= n && (slabs - 1) * rows < n, "n={n} c={c}");
                if slabs > 1 {
                    // Partials live in the scratch after the 2N statistics.
                    assert!(2 * n + 2 * slabs * c <= layernorm_backward_scratch_len(n, c));
                    assert!(slabs <= n.div_ceil(COL_SLAB_MIN_ROWS), "n={n} c={c}");
                }
                // The fused warp-per-row backward: its slabs cover the rows, at most
                // LN_BWD_MAX_SLABS, and their partials fit the scratch.
                let (slabs, rows) = ln_bwd_slabs(n);
                assert!((1..=LN_BWD_MAX_SLABS).contains(&slabs), "n={n}");
                assert!(slabs * rows >= n && (slabs - 1) * rows < n, "n={n}");
                if c <= LAYERNORM_WARP_MAX_C {
                    assert!(2 * slabs * c <= layernorm_backward_scratch_len(n, c));
                }
            }
        }
        assert_eq!(ln_bwd_slabs(16384), (512, 32));
        assert_eq!(ln_bwd_slabs(4096), (256, 16));
        assert_eq!(ln_bwd_slabs(5003), (313, 16));
        assert_eq!(ln_bwd_slabs(10), (1, 16));
        assert_eq!(ln_bwd_slabs(0), (1, 16));
    }
}
