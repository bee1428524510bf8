//! Causal multi-head self-attention (plan ops `Attention`, `AttentionBackward`), two ways.
//!
//! Per (batch, head) with `Q, K, V` `[T, d]`, `s = 1/√d`: `S = s·Q Kᵀ`, `P = softmax(S + mask)`,
//! `O = P V`. Backward (P recomputed): `dV = Pᵀ dO`, `dP = dO Vᵀ`,
//! `dS = P ⊙ (dP − rowsum(P ⊙ dP))`, `dQ = s·dS K`, `dK = s·dSᵀ Q`.
//!
//! - [`attention_forward`] / [`attention_backward`] (spec `attention = gemm`, kernel family
//!   `attention`): cuBLAS strided-batched GEMMs around permutes and a causal row softmax; the
//!   full `T × T` scores are materialised. `attention = auto`'s choice under `precision = fp32`.
//! - [`flash_attention_forward`] / [`flash_attention_backward`] with [`FlashMath::Bf16`]
//!   (family `flash_attention_tc`; `attention = fused`, and `auto` under `precision = bf16`
//!   for head dims ≤ 128): FlashAttention-2 on bf16 tensor cores, fp32 softmax and
//!   accumulation, over bf16 copies of qkv and dout made by the launcher (or the plan's bf16
//!   buffers). Two kernel families compute it ([`FlashKernels`], the device's choice): Hopper's
//!   warpgroup MMA (`wgmma`, family `flash_attention_wgmma`) on compute capability 9.0 for head
//!   dims 33..=128, else `mma.sync m16n8k16` (family `flash_attention_tc`). On the H200 the
//!   wgmma kernels take GPT 0.9B's attention (16 layers, batch 4 × 1024, head dim 128) from
//!   11.3 to 8.8 ms per training step (forward 2.6 → 2.4 ms, backward 8.6 → 6.4 ms).
//!
//! The fused paths read q/k/v strided straight from the fused qkv and keep no `T × T` buffer.
//! Their backward takes only `dout` and `qkv` (as the plan op does) and so recomputes the row
//! log-sum-exp and `delta = rowsum(dO ∘ O)` with one forward-kernel pass into scratch, then runs
//! a dK/dV kernel (per key block) and a dQ kernel (per query block); no state is kept between
//! the forward and backward ops.
use super::{int, row_threads};
use crate::device::{Device, FlashKernels};
use crate::error::{CudaError, Result};
use crate::gemm::{gemm_strided_batched_f32, Dims, Geometry};
use crate::kernels::Args;
use crate::memory::{Buf, Elem};

/// Geometry of an attention call: qkv `[batch·seq_len, 3C]`, `C = n_heads · head_dim`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    /// Sequences in the batch.
    pub batch: usize,
    /// Tokens per sequence `T`.
    pub seq_len: usize,
    /// Number of heads.
    pub n_heads: usize,
    /// Model width `C`.
    pub channels: usize,
}

impl AttnDims {
    fn check(&self, op: &'static str) -> Result<usize> {
        if self.n_heads == 0
            || self.channels % self.n_heads != 0
            || self.batch == 0
            || self.seq_len == 0
        {
            return Err(CudaError::Invalid {
                op,
                what: format!("inconsistent geometry {self:?}"),
            });
        }
        let hd = self.channels / self.n_heads;
        int(
            op,
            "B*NH*T*T",
            self.batch * self.n_heads * self.seq_len * self.seq_len,
        )?;
        int(op, "3*N*C", 3 * self.batch * self.seq_len * self.channels)?;
        Ok(hd)
    }
    pub(crate) fn nc(&self) -> usize {
        self.batch * self.seq_len * self.channels
    }
    fn scores(&self) -> usize {
        self.batch * self.n_heads * self.seq_len * self.seq_len
    }
}

/// Scratch elements (f32) of [`attention_forward`]: `3·N·C + B·NH·T²`.
pub fn attention_forward_scratch_len(d: &AttnDims) -> usize {
    3 * d.nc() + d.scores()
}

/// Scratch elements (f32) of [`attention_backward`]: `7·N·C + 2·B·NH·T²`.
pub fn attention_backward_scratch_len(d: &AttnDims) -> usize {
    7 * d.nc() + 2 * d.scores()
}

struct Heads {
    bh: usize,
    t: usize,
    hd: usize,
}

impl Heads {
    /// Batched GEMM over heads: `c_i = alpha·op(a_i)·op(b_i)`, operands `[rows, cols]` as stored.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        dev: &Device,
        a: &Buf,
        a_dims: Dims,
        trans_a: bool,
        b: &Buf,
        b_dims: Dims,
        trans_b: bool,
        c: &Buf,
        alpha: f32,
    ) -> Result<()> {
        let g = Geometry::new("attention", a_dims, b_dims, trans_a, trans_b)?;
        let (sa, sb, sc) = (
            a_dims.rows * a_dims.cols,
            b_dims.rows * b_dims.cols,
            g.m * g.p,
        );
        debug_assert!(
            a.len() >= sa * self.bh && b.len() >= sb * self.bh && c.len() >= sc * self.bh
        );
        gemm_strided_batched_f32(
            dev,
            g,
            alpha,
            a.ptr(),
            sa,
            b.ptr(),
            sb,
            0.0,
            c.ptr(),
            sc,
            self.bh,
        )
    }
    fn th(&self) -> Dims {
        Dims::new(self.t, self.hd)
    }
    fn tt(&self) -> Dims {
        Dims::new(self.t, self.t)
    }
}

/// Appends the `(batch, seq_len, n_heads, hd)` kernel parameters.
fn geom(a: Args, d: &AttnDims, hd: usize) -> Args {
    a.i32(d.batch as i32)
        .i32(d.seq_len as i32)
        .i32(d.n_heads as i32)
        .i32(hd as i32)
}

fn softmax(dev: &Device, kernel: &'static str, args: Args, rows: usize, t: usize) -> Result<()> {
    dev.launch(
        kernel,
        (int(kernel, "rows", rows)? as u32, 1, 1),
        (row_threads(t), 1, 1),
        args,
    )
}

/// Plan op `Attention`: qkv `[N, 3C]` → out `[N, C]`, causal, scale `1/√(C/n_heads)`.
/// `scratch` f32 of at least [`attention_forward_scratch_len`].
pub fn attention_forward(
    dev: &Device,
    qkv: &Buf,
    out: &Buf,
    d: &AttnDims,
    scratch: &Buf,
) -> Result<()> {
    const OP: &str = "attention";
    let hd = d.check(OP)?;
    let nc = d.nc();
    qkv.expect(OP, "qkv", Elem::F32, 3 * nc)?;
    out.expect(OP, "out", Elem::F32, nc)?;
    let need = attention_forward_scratch_len(d);
    if scratch.len() < need || scratch.elem() != Elem::F32 {
        return Err(CudaError::Shape {
            op: OP,
            operand: "scratch",
            expected: need,
            got: scratch.len(),
        });
    }
    let (q, k, v) = (
        scratch.slice(0, nc)?,
        scratch.slice(nc, nc)?,
        scratch.slice(2 * nc, nc)?,
    );
    let s = scratch.slice(3 * nc, d.scores())?;
    let h = Heads {
        bh: d.batch * d.n_heads,
        t: d.seq_len,
        hd,
    };
    let scale = (1.0 / (hd as f64).sqrt()) as f32;
    let grid = (dev.grid_for(nc), 1, 1);

    let split = geom(Args::new().buf(qkv).buf(&q).buf(&k).buf(&v), d, hd);
    dev.launch("attn_split_qkv", grid, (256, 1, 1), split)?;
    h.gemm(dev, &q, h.th(), false, &k, h.th(), true, &s, scale)?;
    softmax(
        dev,
        "attn_softmax_causal",
        Args::new().buf(&s).i64((h.bh * h.t) as i64).i32(h.t as i32),
        h.bh * h.t,
        h.t,
    )?;
    // O = P V into q's space (Q is no longer needed), then scatter to [N, C].
    h.gemm(dev, &s, h.tt(), false, &v, h.th(), false, &q, 1.0)?;
    let perm = geom(Args::new().buf(out).buf(&q), d, hd).i32(0);
    dev.launch("attn_permute_heads", grid, (256, 1, 1), perm)
}

/// Plan op `AttentionBackward`: dout `[N, C]`, qkv `[N, 3C]` → dqkv `[N, 3C]` (overwritten),
/// probabilities recomputed. `scratch` f32 of at least [`attention_backward_scratch_len`].
pub fn attention_backward(
    dev: &Device,
    dout: &Buf,
    qkv: &Buf,
    dqkv: &Buf,
    d: &AttnDims,
    scratch: &Buf,
) -> Result<()> {
    const OP: &str = "attention_backward";
    let hd = d.check(OP)?;
    let nc = d.nc();
    qkv.expect(OP, "qkv", Elem::F32, 3 * nc)?;
    dqkv.expect(OP, "dqkv", Elem::F32, 3 * nc)?;
    dout.expect(OP, "dout", Elem::F32, nc)?;
    let need = attention_backward_scratch_len(d);
    if scratch.len() < need || scratch.elem() != Elem::F32 {
        return Err(CudaError::Shape {
            op: OP,
            operand: "scratch",
            expected: need,
            got: scratch.len(),
        });
    }
    let part = |i: usize| scratch.slice(i * nc, nc);
    let (q, k, v, g_o) = (part(0)?, part(1)?, part(2)?, part(3)?);
    let (dq, dk, dv) = (part(4)?, part(5)?, part(6)?);
    let p = scratch.slice(7 * nc, d.scores())?;
    let dp = scratch.slice(7 * nc + d.scores(), d.scores())?;
    let h = Heads {
        bh: d.batch * d.n_heads,
        t: d.seq_len,
        hd,
    };
    let scale = (1.0 / (hd as f64).sqrt()) as f32;
    let grid = (dev.grid_for(nc), 1, 1);
    let rows = h.bh * h.t;

    let split = geom(Args::new().buf(qkv).buf(&q).buf(&k).buf(&v), d, hd);
    dev.launch("attn_split_qkv", grid, (256, 1, 1), split)?;
    let perm = geom(Args::new().buf(dout).buf(&g_o), d, hd).i32(1);
    dev.launch("attn_permute_heads", grid, (256, 1, 1), perm)?;
    h.gemm(dev, &q, h.th(), false, &k, h.th(), true, &p, scale)?;
    softmax(
        dev,
        "attn_softmax_causal",
        Args::new().buf(&p).i64(rows as i64).i32(h.t as i32),
        rows,
        h.t,
    )?;
    h.gemm(dev, &p, h.tt(), true, &g_o, h.th(), false, &dv, 1.0)?;
    h.gemm(dev, &g_o, h.th(), false, &v, h.th(), true, &dp, 1.0)?;
    let sb = Args::new()
        .buf(&p)
        .buf(&dp)
        .i64(rows as i64)
        .i32(h.t as i32);
    softmax(dev, "attn_softmax_causal_backward", sb, rows, h.t)?;
    h.gemm(dev, &dp, h.tt(), false, &k, h.th(), false, &dq, scale)?;
    h.gemm(dev, &dp, h.tt(), true, &q, h.th(), false, &dk, scale)?;
    let merge = geom(Args::new().buf(&dq).buf(&dk).buf(&dv).buf(dqkv), d, hd);
    dev.launch("attn_merge_qkv", grid, (256, 1, 1), merge)
}

/// Largest head dimension the tensor-core fused kernels take (`_d32`, `_d64`, `_d128`
/// variants).
pub const FLASH_TC_MAX_HEAD_DIM: usize = 128;

/// How the fused attention kernels compute: one way today (an fp32 SIMT variant lost its
/// measurement against the GEMM path and was deleted; git history has it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashMath {
    /// bf16 tensor-core MMA (`mma.sync m16n8k16`, or `wgmma` on compute capability 9.0: see
    /// [`FlashKernels`]) with fp32 accumulation and fp32 softmax (head dim ≤ 128): the
    /// `precision = bf16` kernels.
    Bf16,
}

/// Whether [`flash_attention_forward`] / [`flash_attention_backward`] take this geometry with
/// `math` (head dim ≤ [`FLASH_TC_MAX_HEAD_DIM`]).
pub fn flash_supported(d: &AttnDims, math: FlashMath) -> bool {
    let max = match math {
        FlashMath::Bf16 => FLASH_TC_MAX_HEAD_DIM,
    };
    d.n_heads > 0
        && d.channels.is_multiple_of(d.n_heads)
        && d.channels / d.n_heads <= max
        && d.channels > 0
}

/// f32 elements of a scratch region of `n` f32s, rounded up to 256 bytes.
fn region(n: usize) -> usize {
    n.next_multiple_of(64)
}

/// f32 elements holding `n` bf16s, rounded up to 256 bytes.
fn bf16_region(n: usize) -> usize {
    region(n.div_ceil(2))
}

/// Scratch elements (f32) of [`flash_attention_forward`]: the row log-sum-exp `B·NH·T`, and with
/// [`FlashMath::Bf16`] the bf16 copy of qkv (`3·N·C` bf16), each region 256-byte aligned.
pub fn flash_forward_scratch_len(d: &AttnDims, math: FlashMath) -> usize {
    let lse = region(d.batch * d.n_heads * d.seq_len);
    match math {
        FlashMath::Bf16 => lse + bf16_region(3 * d.nc()),
    }
}

/// Scratch elements (f32) of [`flash_attention_backward`]: log-sum-exp and delta (`B·NH·T`
/// each), and with [`FlashMath::Bf16`] the bf16 copies of qkv (`3·N·C`) and dout (`N·C`), each
/// region 256-byte aligned.
pub fn flash_backward_scratch_len(d: &AttnDims, math: FlashMath) -> usize {
    let rows = region(d.batch * d.n_heads * d.seq_len);
    match math {
        FlashMath::Bf16 => 2 * rows + bf16_region(3 * d.nc()) + bf16_region(d.nc()),
    }
}

/// The bf16 copy of `x` (`n` elements) in the scratch region at f32 offset `at`: cast on the
/// compute stream; a bf16 `x` (a plan buffer the `fuse` pass made bf16) is used as it is.
fn bf16_copy(dev: &Device, scratch: &Buf, at: usize, x: &Buf, n: usize) -> Result<Buf> {
    if x.elem() == Elem::BF16 {
        x.expect("attention", "bf16 operand", Elem::BF16, n)?;
        return Ok(x.clone());
    }
    let b = scratch
        .slice(at, bf16_region(n))?
        .reinterpret(Elem::BF16, n)?;
    crate::gemm::cast_f32_to_bf16(dev, x, &b)?;
    Ok(b)
}

/// `x` must hold `n` elements, f32 or — read by the tensor-core kernels — bf16.
fn f32_or_bf16(
    op: &'static str,
    name: &'static str,
    x: &Buf,
    n: usize,
    math: Option<FlashMath>,
) -> Result<()> {
    let elem = match (x.elem(), math) {
        (Elem::BF16, Some(FlashMath::Bf16)) => Elem::BF16,
        _ => Elem::F32,
    };
    x.expect(op, name, elem, n)
}

/// The fused kernels of one head-dim variant: threads per block, kernel names, and the dynamic
/// shared memory (bytes) each takes at launch (0: the variant's tiles are static arrays).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FlashVariant {
    threads: usize,
    /// Forward with an f32 output (also backward pass 1).
    fwd: &'static str,
    /// Forward with a bf16 output.
    fwd_bf16out: &'static str,
    dkdv: &'static str,
    dq: &'static str,
    /// Of both forwards.
    fwd_smem: u32,
    dkdv_smem: u32,
    dq_smem: u32,
}

/// Bytes of `rows` tile rows of the d128 kernels (row stride 128 + 8 bf16).
const fn tc_d128_rows(rows: usize) -> u32 {
    (rows * (128 + 8) * 2) as u32
}

/// The variant of the fused kernels for head dim `hd` (≤ [`FLASH_TC_MAX_HEAD_DIM`]) from the
/// family `kernels` (head dims ≤ 32 always take the `mma.sync` d32 kernels). The d128 `mma.sync`
/// kernels' shared memory, as `flash_attention_tc.cu`'s header lays it out: forward and dQ two
/// stages of (64 + 64) rows (69632 bytes), dK/dV 128 K + 128 V rows and the two stages
/// (139264 bytes). The wgmma kernels' (`flash_attention_wgmma.cu`): forward the block's 128 Q
/// rows and two stages of (64 + 64) rows, dQ and dK/dV 2 × 128 rows and the two stages, at
/// 2 bytes × the variant's width per row.
fn flash_variant(hd: usize, math: FlashMath, kernels: FlashKernels) -> FlashVariant {
    let stat = |fwd, fwd_bf16out, dkdv, dq| FlashVariant {
        threads: FLASH_TC_THREADS,
        fwd,
        fwd_bf16out,
        dkdv,
        dq,
        fwd_smem: 0,
        dkdv_smem: 0,
        dq_smem: 0,
    };
    let wg = |width: usize, fwd, fwd_bf16out, dkdv, dq| {
        let rows = |n: usize| (n * width * 2) as u32;
        FlashVariant {
            threads: FLASH_TC_THREADS,
            fwd,
            fwd_bf16out,
            dkdv,
            dq,
            fwd_smem: rows(FLASH_TC_ROWS + 4 * FLASH_TC_TILE),
            dkdv_smem: rows(2 * FLASH_TC_ROWS + 4 * FLASH_TC_TILE),
            dq_smem: rows(2 * FLASH_TC_ROWS + 4 * FLASH_TC_TILE),
        }
    };
    match (math, kernels) {
        (FlashMath::Bf16, _) if hd <= 32 => stat(
            "flash_attn_tc_fwd_d32",
            "flash_attn_tc_fwd_bf16out_d32",
            "flash_attn_tc_bwd_dkdv_d32",
            "flash_attn_tc_bwd_dq_d32",
        ),
        (FlashMath::Bf16, FlashKernels::Wgmma) if hd <= 64 => wg(
            64,
            "flash_attn_wg_fwd_d64",
            "flash_attn_wg_fwd_bf16out_d64",
            "flash_attn_wg_bwd_dkdv_d64",
            "flash_attn_wg_bwd_dq_d64",
        ),
        (FlashMath::Bf16, FlashKernels::Wgmma) => wg(
            128,
            "flash_attn_wg_fwd_d128",
            "flash_attn_wg_fwd_bf16out_d128",
            "flash_attn_wg_bwd_dkdv_d128",
            "flash_attn_wg_bwd_dq_d128",
        ),
        (FlashMath::Bf16, FlashKernels::Mma) if hd <= 64 => stat(
            "flash_attn_tc_fwd_d64",
            "flash_attn_tc_fwd_bf16out_d64",
            "flash_attn_tc_bwd_dkdv_d64",
            "flash_attn_tc_bwd_dq_d64",
        ),
        (FlashMath::Bf16, FlashKernels::Mma) => FlashVariant {
            threads: FLASH_TC_THREADS,
            fwd: "flash_attn_tc_fwd_d128",
            fwd_bf16out: "flash_attn_tc_fwd_bf16out_d128",
            dkdv: "flash_attn_tc_bwd_dkdv_d128",
            dq: "flash_attn_tc_bwd_dq_d128",
            fwd_smem: tc_d128_rows(2 * 2 * FLASH_TC_TILE),
            dkdv_smem: tc_d128_rows(2 * FLASH_TC_ROWS + 2 * 2 * FLASH_TC_TILE),
            dq_smem: tc_d128_rows(2 * FLASH_TC_ROWS),
        },
    }
}

/// Rows per block and threads per block of the tensor-core kernels (8 warps of 16 rows), and
/// rows per streamed shared-memory tile (`TC_ROWS`, `TC_TILE` in the kernel file).
const FLASH_TC_ROWS: usize = 128;
const FLASH_TC_THREADS: usize = 256;
const FLASH_TC_TILE: usize = 64;

/// A launch grid or block.
type Dim3 = (u32, u32, u32);

fn flash_check(op: &'static str, d: &AttnDims, math: FlashMath) -> Result<(usize, Dim3, Dim3)> {
    if !flash_supported(d, math) || d.batch == 0 || d.seq_len == 0 {
        let max = match math {
            FlashMath::Bf16 => FLASH_TC_MAX_HEAD_DIM,
        };
        return Err(CudaError::Invalid {
            op,
            what: format!(
                "fused attention ({math:?}) needs head dim <= {max} and a consistent geometry, got {d:?}"
            ),
        });
    }
    let hd = d.channels / d.n_heads;
    int(op, "3*N*C", 3 * d.nc())?;
    int(op, "B*NH*T", d.batch * d.n_heads * d.seq_len)?;
    let bh = d.batch * d.n_heads;
    if bh > 65_535 {
        return Err(CudaError::Invalid {
            op,
            what: format!("batch*n_heads = {bh} exceeds the grid's y limit 65535"),
        });
    }
    let threads = FLASH_TC_THREADS;
    let rows = match math {
        FlashMath::Bf16 => FLASH_TC_ROWS,
    };
    let grid = (d.seq_len.div_ceil(rows) as u32, bh as u32, 1);
    let block = (threads as u32, 1, 1);
    Ok((hd, grid, block))
}

fn flash_scratch(op: &'static str, scratch: &Buf, need: usize) -> Result<()> {
    if scratch.len() < need || scratch.elem() != Elem::F32 {
        return Err(CudaError::Shape {
            op,
            operand: "scratch",
            expected: need,
            got: scratch.len(),
        });
    }
    Ok(())
}

/// Plan op `Attention` through the fused kernel: qkv `[N, 3C]` → out `[N, C]` (f32), causal,
/// scale `1/√(C/n_heads)`, computed as `math` says. `scratch` f32 of at least
/// [`flash_forward_scratch_len`] (receives the base-2 row log-sum-exp `[B, NH, T]`).
///
/// # Errors
/// A geometry [`flash_supported`] rejects, operands of the wrong size, launch failures.
pub fn flash_attention_forward(
    dev: &Device,
    qkv: &Buf,
    out: &Buf,
    d: &AttnDims,
    scratch: &Buf,
    math: FlashMath,
) -> Result<()> {
    flash_forward(dev, qkv, out, d, scratch, math, None)
}

/// What a tensor-core forward keeps for its backward ([`flash_attention_forward_saving`],
/// [`flash_attention_backward_saved`]): the base-2 row log-sum-exp `lse` (f32 `[B, NH, T]`)
/// and the bf16 copy of qkv (`[N, 3C]`).
pub struct FlashSaved<'a> {
    /// f32 `[B·NH·T]`.
    pub lse: &'a Buf,
    /// [`Elem::BF16`] `[N·3C]`.
    pub qkv16: &'a Buf,
}

/// [`flash_attention_forward`] with [`FlashMath::Bf16`] that also keeps the row log-sum-exp and
/// its bf16 copy of qkv in `saved`, so that [`flash_attention_backward_saved`] skips the
/// forward rerun and the second cast of qkv. `out` is f32, or [`Elem::BF16`] for an output
/// that only bf16 GEMMs read (rounded to nearest even in the kernel's epilogue).
///
/// # Errors
/// As [`flash_attention_forward`]; `saved` buffers of the wrong size or type.
pub fn flash_attention_forward_saving(
    dev: &Device,
    qkv: &Buf,
    out: &Buf,
    d: &AttnDims,
    scratch: &Buf,
    saved: &FlashSaved<'_>,
) -> Result<()> {
    flash_forward(dev, qkv, out, d, scratch, FlashMath::Bf16, Some(saved))
}

fn flash_forward(
    dev: &Device,
    qkv: &Buf,
    out: &Buf,
    d: &AttnDims,
    scratch: &Buf,
    math: FlashMath,
    saved: Option<&FlashSaved<'_>>,
) -> Result<()> {
    const OP: &str = "flash_attention";
    let (hd, grid, block) = flash_check(OP, d, math)?;
    let nc = d.nc();
    f32_or_bf16(OP, "qkv", qkv, 3 * nc, Some(math))?;
    // A bf16 `out` (a plan buffer the `fuse` pass made bf16) from the tensor-core kernels only.
    let bf16_out = out.elem() == Elem::BF16;
    if bf16_out && math != FlashMath::Bf16 {
        return Err(CudaError::Invalid {
            op: OP,
            what: "a bf16 `out` needs the tensor-core (bf16) kernels".into(),
        });
    }
    out.expect(OP, "out", if bf16_out { Elem::BF16 } else { Elem::F32 }, nc)?;
    flash_scratch(OP, scratch, flash_forward_scratch_len(d, math))?;
    let rows = d.batch * d.n_heads * d.seq_len;
    let scale = (1.0 / (hd as f64).sqrt()) as f32;
    let var = flash_variant(hd, math, dev.flash_kernels());
    let fwd = if bf16_out { var.fwd_bf16out } else { var.fwd };
    let (lse, input) = match (saved, math) {
        (Some(sv), FlashMath::Bf16) => {
            sv.lse.expect(OP, "saved lse", Elem::F32, rows)?;
            sv.qkv16.expect(OP, "saved qkv", Elem::BF16, 3 * nc)?;
            // A bf16 qkv is what the backward reads (the caller passes it as `saved.qkv16`).
            if qkv.elem() != Elem::BF16 {
                crate::gemm::cast_f32_to_bf16(dev, qkv, sv.qkv16)?;
            } else if qkv.ptr() != sv.qkv16.ptr() {
                return Err(CudaError::Invalid {
                    op: OP,
                    what: "a bf16 qkv must be its own saved copy".into(),
                });
            }
            (sv.lse.clone(), sv.qkv16.clone())
        }
        (None, FlashMath::Bf16) => (
            scratch.slice(0, rows)?,
            bf16_copy(dev, scratch, region(rows), qkv, 3 * nc)?,
        ),
    };
    let args = Args::new()
        .buf(&input)
        .buf(out)
        .buf(&lse)
        .opt(None)
        .opt(None)
        .i32(d.seq_len as i32)
        .i32(d.n_heads as i32)
        .i32(hd as i32)
        .f32(scale);
    dev.launch_smem(fwd, grid, block, var.fwd_smem, args)
}

/// Plan op `AttentionBackward` on the tensor cores from what the forward kept: `saved` (row
/// log-sum-exp and the bf16 qkv of [`flash_attention_forward_saving`]) and `o16`, the bf16
/// copy of the forward's output `[N, C]` (the engine's shadow of it). delta = rowsum(dO ∘ O) comes
/// from `o16` (kernel `flash_attn_tc_delta`) instead of a rerun of the forward, the standard
/// FlashAttention-2 backward (Dao 2023, Algorithm 2), then the same dK/dV and dQ passes.
/// `scratch` as for [`flash_attention_backward`].
///
/// # Errors
/// As [`flash_attention_backward`]; saved buffers of the wrong size or type.
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward_saved(
    dev: &Device,
    dout: &Buf,
    dqkv: &Buf,
    d: &AttnDims,
    scratch: &Buf,
    saved: &FlashSaved<'_>,
    o16: &Buf,
) -> Result<()> {
    const OP: &str = "flash_attention_backward";
    let math = FlashMath::Bf16;
    let (hd, grid, block) = flash_check(OP, d, math)?;
    let nc = d.nc();
    dqkv.expect(OP, "dqkv", Elem::F32, 3 * nc)?;
    f32_or_bf16(OP, "dout", dout, nc, Some(math))?;
    o16.expect(OP, "o (bf16)", Elem::BF16, nc)?;
    let rows = d.batch * d.n_heads * d.seq_len;
    saved.lse.expect(OP, "saved lse", Elem::F32, rows)?;
    saved.qkv16.expect(OP, "saved qkv", Elem::BF16, 3 * nc)?;
    flash_scratch(OP, scratch, flash_backward_scratch_len(d, math))?;
    let delta = scratch.slice(region(rows), rows)?;
    let scale = (1.0 / (hd as f64).sqrt()) as f32;
    let var = flash_variant(hd, math, dev.flash_kernels());
    let at = 2 * region(rows) + bf16_region(3 * nc);
    let dout = bf16_copy(dev, scratch, at, dout, nc)?;
    let args = Args::new()
        .buf(&dout)
        .buf(o16)
        .buf(&delta)
        .i32(int32(OP, rows)?)
        .i32(d.seq_len as i32)
        .i32(d.n_heads as i32)
        .i32(hd as i32);
    dev.launch(
        "flash_attn_tc_delta",
        (rows.div_ceil(8) as u32, 1, 1),
        (256, 1, 1),
        args,
    )?;
    let tail = |a: Args| {
        a.i32(d.seq_len as i32)
            .i32(d.n_heads as i32)
            .i32(hd as i32)
            .f32(scale)
    };
    let bwd = || {
        Args::new()
            .buf(&dout)
            .buf(saved.qkv16)
            .buf(saved.lse)
            .buf(&delta)
            .buf(dqkv)
    };
    dev.launch_smem(var.dkdv, grid, block, var.dkdv_smem, tail(bwd()))?;
    dev.launch_smem(var.dq, grid, block, var.dq_smem, tail(bwd()))
}

fn int32(op: &'static str, n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| CudaError::Invalid {
        op,
        what: format!("{n} rows exceed int"),
    })
}

/// Plan op `AttentionBackward` through the fused kernels: dout `[N, C]`, qkv `[N, 3C]` → dqkv
/// `[N, 3C]` (f32, every element overwritten), computed as `math` says. `scratch` f32 of at
/// least [`flash_backward_scratch_len`].
///
/// # Errors
/// A geometry [`flash_supported`] rejects, operands of the wrong size, launch failures.
pub fn flash_attention_backward(
    dev: &Device,
    dout: &Buf,
    qkv: &Buf,
    dqkv: &Buf,
    d: &AttnDims,
    scratch: &Buf,
    math: FlashMath,
) -> Result<()> {
    const OP: &str = "flash_attention_backward";
    let (hd, grid, block) = flash_check(OP, d, math)?;
    let nc = d.nc();
    f32_or_bf16(OP, "qkv", qkv, 3 * nc, Some(math))?;
    dqkv.expect(OP, "dqkv", Elem::F32, 3 * nc)?;
    f32_or_bf16(OP, "dout", dout, nc, Some(math))?;
    flash_scratch(OP, scratch, flash_backward_scratch_len(d, math))?;
    let rows = d.batch * d.n_heads * d.seq_len;
    let (lse, delta) = (scratch.slice(0, rows)?, scratch.slice(region(rows), rows)?);
    let scale = (1.0 / (hd as f64).sqrt()) as f32;
    let var = flash_variant(hd, math, dev.flash_kernels());
    let (qkv, dout) = match math {
        FlashMath::Bf16 => {
            let at = 2 * region(rows);
            (
                bf16_copy(dev, scratch, at, qkv, 3 * nc)?,
                bf16_copy(dev, scratch, at + bf16_region(3 * nc), dout, nc)?,
            )
        }
    };
    let (qkv, dout) = (&qkv, &dout);
    let tail = |a: Args| {
        a.i32(d.seq_len as i32)
            .i32(d.n_heads as i32)
            .i32(hd as i32)
            .f32(scale)
    };
    let pass1 = Args::new()
        .buf(qkv)
        .opt(None)
        .buf(&lse)
        .buf(dout)
        .buf(&delta);
    dev.launch_smem(var.fwd, grid, block, var.fwd_smem, tail(pass1))?;
    let bwd = || {
        Args::new()
            .buf(dout)
            .buf(qkv)
            .buf(&lse)
            .buf(&delta)
            .buf(dqkv)
    };
    dev.launch_smem(var.dkdv, grid, block, var.dkdv_smem, tail(bwd()))?;
    dev.launch_smem(var.dq, grid, block, var.dq_smem, tail(bwd()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_head_dim_up_to_the_limit_has_a_registered_variant() {
        for (kernels, prefix, family) in [
            (FlashKernels::Mma, "flash_attn_tc_", "flash_attention_tc"),
            (
                FlashKernels::Wgmma,
                "flash_attn_wg_",
                "flash_attention_wgmma",
            ),
        ] {
            for hd in 1..=FLASH_TC_MAX_HEAD_DIM {
                let v = flash_variant(hd, FlashMath::Bf16, kernels);
                let width = [32, 64, 128]
                    .into_iter()
                    .find(|&w| hd <= w)
                    .expect("a variant width");
                // Heads of at most 32 take the mma.sync d32 kernels in either family.
                let (prefix, family) = if width == 32 {
                    ("flash_attn_tc_", "flash_attention_tc")
                } else {
                    (prefix, family)
                };
                for k in [v.fwd, v.fwd_bf16out, v.dkdv, v.dq] {
                    assert!(k.ends_with(&format!("_d{width}")), "hd {hd}: {k}");
                    assert!(k.starts_with(prefix), "hd {hd}: {k}");
                    assert_eq!(
                        crate::kernels::family_of(k).map(|f| f.name),
                        Some(family),
                        "{k}"
                    );
                }
                let smem = [v.fwd_smem, v.dkdv_smem, v.dq_smem];
                if width < 128 && kernels == FlashKernels::Mma {
                    assert_eq!(smem, [0; 3], "d{width} tiles are static arrays");
                }
            }
        }
    }

    #[test]
    fn the_dynamic_shared_memory_sizes_are_the_kernel_files_layout() {
        let tc = flash_variant(128, FlashMath::Bf16, FlashKernels::Mma);
        assert_eq!(
            [tc.fwd_smem, tc.dkdv_smem, tc.dq_smem],
            [69_632, 139_264, 69_632]
        );
        let src = crate::kernels::family_of("flash_attn_tc_fwd_d128")
            .expect("registered")
            .source;
        for bytes in [tc.fwd_smem, tc.dkdv_smem, tc.dq_smem] {
            assert!(
                src.contains(&format!("{bytes} B")),
                "header gives {bytes} B"
            );
        }
        // The wgmma kernels static_assert the same numbers (wg_fwd_smem, wg_bwd_smem).
        let wg = crate::kernels::family_of("flash_attn_wg_fwd_d128")
            .expect("registered")
            .source;
        for width in [64, 128] {
            let v = flash_variant(width, FlashMath::Bf16, FlashKernels::Wgmma);
            assert_eq!(v.dkdv_smem, v.dq_smem);
            for (what, bytes) in [("fwd", v.fwd_smem), ("bwd", v.dkdv_smem)] {
                assert!(
                    wg.contains(&format!("wg_{what}_smem<{width}>() == {bytes}")),
                    "flash_attention_wgmma.cu asserts {what} d{width} = {bytes} bytes"
                );
            }
        }
    }
}
