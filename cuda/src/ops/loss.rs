//! Launchers of the loss and reduction ops: softmax cross-entropy (plan ops `CrossEntropy`,
//! `CrossEntropyBackward`; family `cross_entropy`) and the global gradient norm with clipping
//! (plan op `ClipGradNorm`; families `reduce`, `elementwise`). Reductions accumulate in f64
//! over fixed partitions and add partials in a fixed order: results are deterministic.
use super::{int, row_threads, rows_of};
use crate::device::Device;
use crate::error::{CudaError, Result};
use crate::kernels::Args;
use crate::memory::{Buf, Elem};

/// Blocks (= f64 partials) per buffer of a sum-of-squares reduction.
pub const SUMSQ_BLOCKS: usize = schedule::reserve::SUMSQ_BLOCKS;

/// Scratch elements (f32) of [`cross_entropy_forward`]: `2N` (N f64 row losses).
pub fn cross_entropy_scratch_len(n_rows: usize) -> usize {
    2 * n_rows
}

/// Threads of a cross-entropy row block over `vocab` logits: one float4 a thread per step,
/// a warp multiple between 32 and 1024.
fn xent_threads(vocab: usize) -> u32 {
    row_threads(vocab.div_ceil(4))
}

/// Plan op `CrossEntropy`: `loss[0] = (1/N) Σ_n [logsumexp(logits[n]) − logits[n, targets[n]]]`
/// (nats). logits f32 `[N, vocab]`, targets i32 `[N]`, loss f32 `[1]`. A bad target makes the
/// loss NaN and is reported by [`Device::take_status`]. `scratch` f32 of at least
/// [`cross_entropy_scratch_len`]. One block per row reads the row once (online max and
/// exp-sum, float4 loads); row losses in f64 are averaged in a fixed order (deterministic).
/// `logits` may be bf16 (the output of a bf16 LM head; the statistics are fp32).
/// Errors: [`CudaError::Shape`] on a length mismatch, [`CudaError::Operand`] on a wrong
/// dtype or memory tier, [`CudaError::Invalid`] when `N` or `vocab` exceeds the kernels'
/// `int` range.
pub fn cross_entropy_forward(
    dev: &Device,
    logits: &Buf,
    targets: &Buf,
    loss: &Buf,
    vocab: usize,
    scratch: &Buf,
) -> Result<()> {
    const OP: &str = "cross_entropy";
    let n = targets.len();
    targets.expect(OP, "targets", Elem::I32, n)?;
    // f32 logits, or bf16 (a bf16 LM head's output; the math stays fp32).
    let x16 = logits.elem() == Elem::BF16;
    logits.expect(
        OP,
        "logits",
        if x16 { Elem::BF16 } else { Elem::F32 },
        n * vocab,
    )?;
    loss.expect(OP, "loss", Elem::F32, 1)?;
    let rows = scratch
        .reinterpret(Elem::F64, n)
        .map_err(|_| CudaError::Shape {
            op: OP,
            operand: "scratch",
            expected: cross_entropy_scratch_len(n),
            got: scratch.len(),
        })?;
    if n > 0 {
        let args = Args::new()
            .buf(logits)
            .buf(targets)
            .buf(&rows)
            .i32(int(OP, "N", n)?)
            .i32(int(OP, "V", vocab)?)
            .buf(dev.status());
        dev.launch(
            if x16 {
                "xent_row_loss_bf16x"
            } else {
                "xent_row_loss"
            },
            (n as u32, 1, 1),
            (xent_threads(vocab), 1, 1),
            args,
        )?;
    }
    dev.launch(
        "xent_mean",
        (1, 1, 1),
        (1024, 1, 1),
        Args::new().buf(&rows).buf(loss).i32(n as i32),
    )
}

/// Plan op `CrossEntropyBackward`: `dlogits = (softmax(logits) − onehot(targets)) / N`.
/// logits/dlogits f32 `[N, vocab]`, targets i32 `[N]`. One block per row: one pass for the row
/// max and exp-sum, one that writes the gradient (float4 where logits and dlogits share their
/// 16-byte alignment). A bad target NaN-fills its gradient row and is reported by
/// [`Device::take_status`]. Errors: [`CudaError::Shape`] on a length mismatch,
/// [`CudaError::Operand`] on a wrong dtype or memory tier, [`CudaError::Invalid`] when `N` or
/// `vocab` exceeds the kernels' `int` range.
pub fn cross_entropy_backward(
    dev: &Device,
    logits: &Buf,
    targets: &Buf,
    dlogits: &Buf,
    vocab: usize,
) -> Result<()> {
    xent_backward(dev, logits, targets, dlogits, vocab, Elem::F32)
}

/// Plan op `CrossEntropyBackward` with a bf16 gradient: `dlogits = bf16((softmax(logits) −
/// onehot(targets)) / N)`, logits f32 `[N, V]`, targets i32 `[N]`, dlogits [`Elem::BF16`]
/// `[N, V]`. For a gradient read only by bf16 GEMMs (the engine writes it straight into the
/// buffer's bf16 shadow): half the bytes written, and no f32 → bf16 cast afterwards. A
/// target outside `[0, V)` gives a NaN row and is reported by the status check.
///
/// # Errors
/// Shape or dtype mismatches, sizes beyond `int`, launch failures.
pub fn cross_entropy_backward_bf16(
    dev: &Device,
    logits: &Buf,
    targets: &Buf,
    dlogits: &Buf,
    vocab: usize,
) -> Result<()> {
    xent_backward(dev, logits, targets, dlogits, vocab, Elem::BF16)
}

/// The `CrossEntropyBackward` launchers: `dlogits` of `out` (f32: `xent_backward`, bf16:
/// `xent_backward_bf16`; same arguments); bf16 logits (`xent_backward_bf16x_bf16`) only with a
/// bf16 `dlogits`.
fn xent_backward(
    dev: &Device,
    logits: &Buf,
    targets: &Buf,
    dlogits: &Buf,
    vocab: usize,
    out: Elem,
) -> Result<()> {
    let x16 = logits.elem() == Elem::BF16;
    let (op, kernel) = match (x16, out) {
        (true, Elem::BF16) => ("cross_entropy_backward_bf16", "xent_backward_bf16x_bf16"),
        (true, _) => {
            return Err(CudaError::Invalid {
                op: "cross_entropy_backward",
                what: "bf16 logits need a bf16 dlogits".into(),
            })
        }
        (false, Elem::BF16) => ("cross_entropy_backward_bf16", "xent_backward_bf16"),
        (false, _) => ("cross_entropy_backward", "xent_backward"),
    };
    let n = rows_of(op, "logits", logits.len(), vocab)?;
    targets.expect(op, "targets", Elem::I32, n)?;
    logits.expect(
        op,
        "logits",
        if x16 { Elem::BF16 } else { Elem::F32 },
        n * vocab,
    )?;
    dlogits.expect(op, "dlogits", out, n * vocab)?;
    if n == 0 {
        return Ok(());
    }
    let args = Args::new()
        .buf(logits)
        .buf(targets)
        .buf(dlogits)
        .i32(int(op, "N", n)?)
        .i32(int(op, "V", vocab)?)
        .f32((1.0 / n as f64) as f32)
        .buf(dev.status());
    dev.launch(kernel, (n as u32, 1, 1), (xent_threads(vocab), 1, 1), args)
}

/// Scratch elements (f32) of [`clip_grad_norm`] over `n_grads` buffers:
/// `2·256·n_grads` (f64 partials) `+ 2` (the scale factor).
pub fn clip_grad_norm_scratch_len(n_grads: usize) -> usize {
    2 * SUMSQ_BLOCKS * n_grads + 2
}

/// Writes `Σ x²` partials of `x` (f32) into `partials[slot·256 .. slot·256 + 256]` (f64).
pub(crate) fn sumsq_partials(dev: &Device, x: &Buf, partials: &Buf, slot: usize) -> Result<()> {
    x.expect("sumsq", "x", Elem::F32, x.len())?;
    if partials.elem() != Elem::F64 || partials.len() < (slot + 1) * SUMSQ_BLOCKS {
        return Err(CudaError::Shape {
            op: "sumsq",
            operand: "partials",
            expected: (slot + 1) * SUMSQ_BLOCKS,
            got: partials.len(),
        });
    }
    let args = Args::new()
        .buf(x)
        .i64(x.len() as i64)
        .buf(partials)
        .i32(slot as i32);
    // 1024 threads per block on large tensors (256 blocks of 256 kept too few loads in flight to
    // stream a [2048, 8192] gradient at the memory's rate); a function of the length only.
    let threads = if x.len() >= 1 << 22 { 1024 } else { 256 };
    dev.launch(
        "sumsq_partials",
        (SUMSQ_BLOCKS as u32, 1, 1),
        (threads, 1, 1),
        args,
    )
}

/// Plan op `GradSumSquares`: the f64 partial sums of `Σ grad_i²` into slot `slot` of the plan
/// buffer `partials` (f32 `[2·SUMSQ_BLOCKS·k]`, read as f64 `[SUMSQ_BLOCKS·k]`): the partials
/// [`clip_grad_norm`] computes for its `slot`-th gradient, so that [`clip_grad_norm_partials`]
/// finds the same norm.
pub fn grad_sum_squares(dev: &Device, grad: &Buf, partials: &Buf, slot: usize) -> Result<()> {
    let p64 = partials_f64(partials)?;
    sumsq_partials(dev, grad, &p64, slot)
}

fn partials_f64(partials: &Buf) -> Result<Buf> {
    if partials.elem() != Elem::F32 || partials.len() % (2 * SUMSQ_BLOCKS) != 0 {
        return Err(CudaError::Shape {
            op: "grad_sum_squares",
            operand: "partials",
            expected: 2 * SUMSQ_BLOCKS,
            got: partials.len(),
        });
    }
    partials.reinterpret(Elem::F64, partials.len() / 2)
}

/// Plan op `ClipGradNorm` with `partials`: `norm[0]` and `scale[0]` as [`clip_grad_norm`]
/// writes them with `scale_out`, from the gradients' partial sums that
/// [`grad_sum_squares`] wrote (the same kernel, so the same bits).
pub fn clip_grad_norm_partials(
    dev: &Device,
    partials: &Buf,
    norm: &Buf,
    scale: &Buf,
    max_norm: Option<f64>,
) -> Result<()> {
    const OP: &str = "clip_grad_norm";
    norm.expect(OP, "norm", Elem::F32, 1)?;
    scale.expect(OP, "scale", Elem::F32, 1)?;
    let p64 = partials_f64(partials)?;
    let count = int(OP, "partials", p64.len())?;
    let args = Args::new()
        .buf(&p64)
        .i32(count)
        .buf(norm)
        .buf(scale)
        .f64(max_norm.unwrap_or(-1.0));
    dev.launch("grad_norm_finalize", (1, 1, 1), (1024, 1, 1), args)
}

/// Plan op `GradAccumulate`: `total ← scale · micro` when `first`, else `total ← total + scale
/// · micro` (f32, equal lengths; the product and the sum each rounded once, as the CPU
/// engine's loop: `__fmul_rn`, `__fadd_rn`). `scale` is 1 / micro-batches.
pub fn grad_accumulate(
    dev: &Device,
    micro: &Buf,
    total: &Buf,
    scale: f64,
    first: bool,
) -> Result<()> {
    let n = total.len();
    total.expect("grad_accumulate", "total", Elem::F32, n)?;
    micro.expect("grad_accumulate", "micro", Elem::F32, n)?;
    let args = Args::new()
        .buf(micro)
        .buf(total)
        .f32(scale as f32)
        .i32(i32::from(first))
        .i64(n as i64);
    dev.launch(
        "grad_accumulate",
        (dev.grid_for(n), 1, 1),
        (256, 1, 1),
        args,
    )
}

/// Plan op `ScaleByScalar`: `x ← x · scale[0]` (f32 `x`, f32 `[1]` `scale` on the device), the
/// in-place clip's kernel.
pub fn scale_by_scalar(dev: &Device, x: &Buf, scale: &Buf) -> Result<()> {
    x.expect("scale_by_scalar", "x", Elem::F32, x.len())?;
    scale.expect("scale_by_scalar", "scale", Elem::F32, 1)?;
    let n = x.len();
    let args = Args::new().buf(x).buf(scale).i64(n as i64);
    dev.launch(
        "scale_by_device_scalar",
        (dev.grid_for(n), 1, 1),
        (256, 1, 1),
        args,
    )
}

/// Plan op `ClipGradNorm`: `norm[0] = √(Σ_g Σ_i g_i²)` (f64 accumulation); when `max_norm` is
/// set and the norm is finite and above it, every gradient is scaled by `max_norm / norm` on
/// the GPU (no host round trip) — or, with `scale_out` (f32 `[1]`), that factor (1 when not
/// clipping) is written there and the gradients stay as they are (the updates read it). The
/// caller reads `norm` back to skip the optimizer program on a non-finite norm. `scratch` f32
/// of at least [`clip_grad_norm_scratch_len`].
pub fn clip_grad_norm(
    dev: &Device,
    grads: &[&Buf],
    norm: &Buf,
    scale_out: Option<&Buf>,
    max_norm: Option<f64>,
    scratch: &Buf,
) -> Result<()> {
    const OP: &str = "clip_grad_norm";
    norm.expect(OP, "norm", Elem::F32, 1)?;
    let k = grads.len();
    let need = clip_grad_norm_scratch_len(k);
    if scratch.len() < need || scratch.elem() != Elem::F32 {
        return Err(CudaError::Shape {
            op: OP,
            operand: "scratch",
            expected: need,
            got: scratch.len(),
        });
    }
    let partials = scratch.reinterpret(Elem::F64, SUMSQ_BLOCKS * k.max(1))?;
    if let Some(s) = scale_out {
        s.expect(OP, "scale", Elem::F32, 1)?;
    }
    let scale = match scale_out {
        Some(s) => s.clone(),
        None => scratch.slice(need - 2, 1)?,
    };
    for (i, g) in grads.iter().enumerate() {
        sumsq_partials(dev, g, &partials, i)?;
    }
    let count = int(OP, "partials", SUMSQ_BLOCKS * k)?;
    let args = Args::new()
        .buf(&partials)
        .i32(count)
        .buf(norm)
        .buf(&scale)
        .f64(max_norm.unwrap_or(-1.0));
    dev.launch("grad_norm_finalize", (1, 1, 1), (1024, 1, 1), args)?;
    if max_norm.is_some() && scale_out.is_none() {
        for g in grads {
            let n = g.len();
            let args = Args::new().buf(g).buf(&scale).i64(n as i64);
            dev.launch(
                "scale_by_device_scalar",
                (dev.grid_for(n), 1, 1),
                (256, 1, 1),
                args,
            )?;
        }
    }
    Ok(())
}
