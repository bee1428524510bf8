//! Self-test cases of the loss and GEMM launchers: softmax cross-entropy (f32 and bf16 logits
//! and gradients, awkward alignments, masked rows) and the f32 / bf16 GEMMs.
use super::cases::{case, cpu_dims, down_bf16, one};
use super::{cpu, rel_err, wide, Case, Ctx, TOL_BF16, TOL_F32};
use crate::error::Result;
use crate::gemm::{self, Dims};
use crate::memory::Elem;
use crate::ops::loss as gloss;
use engine::cpu as c;

pub(super) fn cross_entropy(v: &mut Vec<Case>) {
    for (n, vocab, big) in [
        (3, 3, false),
        (783, 50, false),
        (50, 50257, false),
        (4096, 783, false),
        (783, 50257, true),
    ] {
        cross_entropy_cases(v, n, vocab, false, (0, 0), big);
    }
    // V = 1; rows starting at every 16-byte phase (odd V); logits and dlogits of different
    // 16-byte alignment (the scalar gradient path) and of the same non-zero one; a padded
    // vocabulary (every row aligned); -inf logits (masked entries add exactly 0); GPT-2's
    // vocabulary at 2048 rows.
    for (n, vocab, masked, offsets, big) in [
        (1, 1, false, (0, 0), false),
        (5, 7, false, (0, 0), false),
        (37, 1001, false, (0, 1), false),
        (37, 1001, false, (2, 2), false),
        (64, 50304, false, (0, 0), false),
        (257, 4099, true, (1, 3), false),
        (2048, 50257, false, (0, 0), true),
    ] {
        cross_entropy_cases(v, n, vocab, masked, offsets, big);
    }
}

/// Logits `N(0, 2²)` `[n, vocab]` and targets in `[0, vocab)`; when `masked`, every logit at
/// `j % 3 == 1` is −∞ and no target points at one.
fn xent_inputs(cx: &mut Ctx<'_>, n: usize, vocab: usize, masked: bool) -> (Vec<f32>, Vec<i32>) {
    let mut logits = cx.normal(n * vocab, 0.0, 2.0);
    let mut targets = cx.ids(n, vocab);
    if masked {
        for (k, l) in logits.iter_mut().enumerate() {
            if (k % vocab) % 3 == 1 {
                *l = f32::NEG_INFINITY;
            }
        }
        for t in targets.iter_mut() {
            if *t % 3 == 1 {
                *t -= 1;
            }
        }
    }
    (logits, targets)
}

/// The `cross_entropy` and `cross_entropy_backward` cases of one size. `offsets` = (logits,
/// dlogits) element offsets inside their device buffers, to move rows off 16-byte alignment.
/// Outputs and scratch NaN-poisoned.
fn cross_entropy_cases(
    v: &mut Vec<Case>,
    n: usize,
    vocab: usize,
    masked: bool,
    offsets: (usize, usize),
    big: bool,
) {
    let (lo, dlo) = offsets;
    let mut size = format!("N={n} V={vocab}");
    if masked {
        size.push_str(" masked");
    }
    if lo > 0 || dlo > 0 {
        size.push_str(&format!(" offsets {lo}/{dlo}"));
    }
    v.push(case(
        "cross_entropy",
        size.clone(),
        TOL_F32,
        big,
        move |cx| {
            let (logits, targets) = xent_inputs(cx, n, vocab, masked);
            let padded: Vec<f32> = vec![0.0; lo].into_iter().chain(logits.clone()).collect();
            let (lb, tb, ob) = (cx.up(&padded)?, cx.up(&targets)?, cx.out(1)?);
            let lb = lb.slice(lo, n * vocab)?;
            let sb = cx.out(gloss::cross_entropy_scratch_len(n))?;
            let ms =
                cx.timed(|| gloss::cross_entropy_forward(cx.dev, &lb, &tb, &ob, vocab, &sb))?;
            let r = c::cross_entropy::cross_entropy_forward(&wide(&logits), &targets, vocab)
                .map_err(cpu)?;
            Ok(one("loss", rel_err(&cx.down(&ob)?, &[r]), ms))
        },
    ));
    v.push(case(
        "cross_entropy_backward",
        size.clone(),
        TOL_F32,
        big,
        move |cx| {
            let (logits, targets) = xent_inputs(cx, n, vocab, masked);
            let padded: Vec<f32> = vec![0.0; lo].into_iter().chain(logits.clone()).collect();
            let (lb, tb) = (cx.up(&padded)?, cx.up(&targets)?);
            let lb = lb.slice(lo, n * vocab)?;
            let ob = cx.out(n * vocab + dlo)?.slice(dlo, n * vocab)?;
            let ms = cx.timed(|| gloss::cross_entropy_backward(cx.dev, &lb, &tb, &ob, vocab))?;
            let mut r = vec![0.0; n * vocab];
            c::cross_entropy::cross_entropy_backward(&wide(&logits), &targets, &mut r, vocab)
                .map_err(cpu)?;
            Ok(one("dlogits", rel_err(&cx.down(&ob)?, &r), ms))
        },
    ));
    if lo > 0 {
        return; // the bf16 variant reads the same logits; its cases use aligned rows
    }
    v.push(case(
        "cross_entropy_backward_bf16",
        size.clone(),
        TOL_BF16,
        big,
        move |cx| {
            let (logits, targets) = xent_inputs(cx, n, vocab, masked);
            let (lb, tb) = (cx.up(&logits)?, cx.up(&targets)?);
            let ob = cx.raw(Elem::BF16, n * vocab)?;
            let ms =
                cx.timed(|| gloss::cross_entropy_backward_bf16(cx.dev, &lb, &tb, &ob, vocab))?;
            let mut r = vec![0.0; n * vocab];
            c::cross_entropy::cross_entropy_backward(&wide(&logits), &targets, &mut r, vocab)
                .map_err(cpu)?;
            Ok(one("dlogits", rel_err(&down_bf16(cx, &ob)?, &r), ms))
        },
    ));
    // bf16 logits (a bf16 LM head's output): the reference reads the same rounded logits.
    let up16 = |cx: &mut Ctx<'_>, x: &[f32]| -> Result<crate::Buf> {
        let (b32, b16) = (cx.up(x)?, cx.raw(Elem::BF16, x.len())?);
        crate::gemm::cast_f32_to_bf16(cx.dev, &b32, &b16)?;
        Ok(b16)
    };
    let size16 = size.clone();
    v.push(case(
        "cross_entropy_bf16x",
        size16,
        TOL_F32,
        big,
        move |cx| {
            let (logits, targets) = xent_inputs(cx, n, vocab, masked);
            let l16: Vec<f32> = logits.iter().map(|&x| schedule::round_to_bf16(x)).collect();
            let (lb, tb, ob) = (up16(cx, &logits)?, cx.up(&targets)?, cx.out(1)?);
            let sb = cx.out(gloss::cross_entropy_scratch_len(n))?;
            let ms =
                cx.timed(|| gloss::cross_entropy_forward(cx.dev, &lb, &tb, &ob, vocab, &sb))?;
            let r = c::cross_entropy::cross_entropy_forward(&wide(&l16), &targets, vocab)
                .map_err(cpu)?;
            Ok(one("loss", rel_err(&cx.down(&ob)?, &[r]), ms))
        },
    ));
    v.push(case(
        "cross_entropy_backward_bf16x",
        size,
        TOL_BF16,
        big,
        move |cx| {
            let (logits, targets) = xent_inputs(cx, n, vocab, masked);
            let l16: Vec<f32> = logits.iter().map(|&x| schedule::round_to_bf16(x)).collect();
            let (lb, tb) = (up16(cx, &logits)?, cx.up(&targets)?);
            let ob = cx.raw(Elem::BF16, n * vocab)?;
            let ms =
                cx.timed(|| gloss::cross_entropy_backward_bf16(cx.dev, &lb, &tb, &ob, vocab))?;
            let mut r = vec![0.0; n * vocab];
            c::cross_entropy::cross_entropy_backward(&wide(&l16), &targets, &mut r, vocab)
                .map_err(cpu)?;
            Ok(one("dlogits", rel_err(&down_bf16(cx, &ob)?, &r), ms))
        },
    ));
}

pub(super) fn matmul(v: &mut Vec<Case>) {
    // (M, K, P, trans_a, trans_b, accumulate)
    let f32_cases = [
        (3, 50, 783, false, false, false, false),
        (783, 4096, 50, false, true, true, false),
        (50, 783, 3, true, false, false, false),
        (783, 783, 4096, true, true, true, false),
        (4096, 783, 4096, false, true, false, true),
    ];
    for (m, k, p, ta, tb, acc, big) in f32_cases {
        let size = format!(
            "M={m} K={k} P={p} ta={} tb={} acc={}",
            ta as u8, tb as u8, acc as u8
        );
        v.push(case("mat_mul", size, TOL_F32, big, move |cx| {
            let (a, b) = (cx.normal(m * k, 0.0, 1.0), cx.normal(k * p, 0.0, 1.0));
            let out0 = cx.normal(m * p, 0.0, 1.0);
            let ad = if ta { Dims::new(k, m) } else { Dims::new(m, k) };
            let bd = if tb { Dims::new(p, k) } else { Dims::new(k, p) };
            let (abuf, bbuf) = (cx.up(&a)?, cx.up(&b)?);
            let ob = if acc { cx.up(&out0)? } else { cx.out(m * p)? };
            let ms = cx.timed(|| gemm::matmul(cx.dev, &abuf, ad, &bbuf, bd, &ob, ta, tb, acc))?;
            let mut r = if acc { wide(&out0) } else { vec![0.0; m * p] };
            let (cad, cbd) = (cpu_dims(ad), cpu_dims(bd));
            c::matmul::matmul(&wide(&a), cad, &wide(&b), cbd, &mut r, ta, tb, acc).map_err(cpu)?;
            Ok(one("out", rel_err(&cx.down(&ob)?, &r), ms))
        }));
    }
    for (m, k, p, ta, tb, acc, big) in [
        (783, 4096, 50, false, true, false, false),
        (1024, 783, 4096, true, false, true, true),
    ] {
        let size = format!(
            "M={m} K={k} P={p} ta={} tb={} acc={}",
            ta as u8, tb as u8, acc as u8
        );
        v.push(case("mat_mul_bf16", size, TOL_BF16, big, move |cx| {
            let (a, b) = (cx.normal(m * k, 0.0, 1.0), cx.normal(k * p, 0.0, 1.0));
            let out0 = cx.normal(m * p, 0.0, 1.0);
            let ad = if ta { Dims::new(k, m) } else { Dims::new(m, k) };
            let bd = if tb { Dims::new(p, k) } else { Dims::new(k, p) };
            let (a32, b32) = (cx.up(&a)?, cx.up(&b)?);
            let (a16, b16) = (cx.raw(Elem::BF16, a.len())?, cx.raw(Elem::BF16, b.len())?);
            let ob = if acc { cx.up(&out0)? } else { cx.out(m * p)? };
            let ms = cx.timed(|| {
                gemm::cast_f32_to_bf16(cx.dev, &a32, &a16)?;
                gemm::cast_f32_to_bf16(cx.dev, &b32, &b16)?;
                gemm::matmul_bf16(cx.dev, &a16, ad, &b16, bd, &ob, ta, tb, acc)
            })?;
            let mut r = if acc { wide(&out0) } else { vec![0.0; m * p] };
            let (cad, cbd) = (cpu_dims(ad), cpu_dims(bd));
            c::matmul::matmul(&wide(&a), cad, &wide(&b), cbd, &mut r, ta, tb, acc).map_err(cpu)?;
            Ok(one("out", rel_err(&cx.down(&ob)?, &r), ms))
        }));
    }
    // Gradient accumulation in the weight-gradient GEMM (`MatMul::micro_accumulate`): three
    // micro-batches into one total, α = 1/3, β = 0 on the first (the total starts as NaN: β
    // = 0 must not read it, and any leak makes the error infinite) and 1 after, as the engine
    // launches them; bf16 and fp32 operands, both transposes the weight gradients use,
    // against the float64 sum of the three products over 3.
    for (m, k, p, ta, tb, bf16, big) in [
        (783, 1024, 50, true, false, true, false),
        (50, 783, 257, true, false, false, false),
        (257, 50, 783, false, true, true, false),
        (2048, 4096, 2048, true, false, true, true),
    ] {
        let size = format!(
            "in the GEMM: M={m} K={k} P={p} ta={} tb={} {} x 3 micro-batches",
            ta as u8,
            tb as u8,
            if bf16 { "bf16" } else { "fp32" }
        );
        let tol = if bf16 { TOL_BF16 } else { TOL_F32 };
        v.push(case("grad_accumulate", size, tol, big, move |cx| {
            let ad = if ta { Dims::new(k, m) } else { Dims::new(m, k) };
            let bd = if tb { Dims::new(p, k) } else { Dims::new(k, p) };
            let (cad, cbd) = (cpu_dims(ad), cpu_dims(bd));
            let ob = cx.up(&vec![f32::NAN; m * p])?;
            let mut want = vec![0.0; m * p];
            let mut ms = 0.0;
            for micro in 0..3 {
                let (a, b) = (cx.normal(m * k, 0.0, 1.0), cx.normal(k * p, 0.0, 1.0));
                let (a32, b32) = (cx.up(&a)?, cx.up(&b)?);
                let beta = if micro == 0 { 0.0 } else { 1.0 };
                let alpha = (1.0f64 / 3.0) as f32;
                ms += if bf16 {
                    let (a16, b16) = (cx.raw(Elem::BF16, a.len())?, cx.raw(Elem::BF16, b.len())?);
                    gemm::cast_f32_to_bf16(cx.dev, &a32, &a16)?;
                    gemm::cast_f32_to_bf16(cx.dev, &b32, &b16)?;
                    cx.timed(|| {
                        gemm::gemm_bf16(cx.dev, &a16, ad, &b16, bd, &ob, ta, tb, alpha, beta)
                    })?
                } else {
                    cx.timed(|| {
                        gemm::gemm_f32(cx.dev, &a32, ad, &b32, bd, &ob, ta, tb, alpha, beta)
                    })?
                };
                let mut prod = vec![0.0; m * p];
                c::matmul::matmul(&wide(&a), cad, &wide(&b), cbd, &mut prod, ta, tb, false)
                    .map_err(cpu)?;
                for (w, x) in want.iter_mut().zip(&prod) {
                    *w += x / 3.0;
                }
            }
            Ok(one("total", rel_err(&cx.down(&ob)?, &want), ms))
        }));
    }
    // bf16 output (SOAP's chained eigenbasis projections): the GEMM rounds its fp32 result to
    // bf16 in the epilogue; odd shapes, every transpose combination.
    for (m, k, p, ta, tb, big) in [
        (3, 50, 783, false, false, false),
        (783, 257, 50, true, true, false),
        (50, 783, 3, true, false, false),
        (3072, 3072, 768, true, false, true),
        (768, 3072, 3072, false, true, true),
    ] {
        let size = format!("M={m} K={k} P={p} ta={} tb={}", ta as u8, tb as u8);
        v.push(case("mat_mul_bf16_out", size, TOL_BF16, big, move |cx| {
            let (a, b) = (cx.normal(m * k, 0.0, 1.0), cx.normal(k * p, 0.0, 1.0));
            let ad = if ta { Dims::new(k, m) } else { Dims::new(m, k) };
            let bd = if tb { Dims::new(p, k) } else { Dims::new(k, p) };
            let (a32, b32) = (cx.up(&a)?, cx.up(&b)?);
            let (a16, b16) = (cx.raw(Elem::BF16, a.len())?, cx.raw(Elem::BF16, b.len())?);
            let ob = cx.raw(Elem::BF16, m * p)?;
            let ms = cx.timed(|| {
                gemm::cast_f32_to_bf16(cx.dev, &a32, &a16)?;
                gemm::cast_f32_to_bf16(cx.dev, &b32, &b16)?;
                gemm::matmul_bf16(cx.dev, &a16, ad, &b16, bd, &ob, ta, tb, false)
            })?;
            let mut r = vec![0.0; m * p];
            let (cad, cbd) = (cpu_dims(ad), cpu_dims(bd));
            c::matmul::matmul(&wide(&a), cad, &wide(&b), cbd, &mut r, ta, tb, false)
                .map_err(cpu)?;
            Ok(one("out", rel_err(&down_bf16(cx, &ob)?, &r), ms))
        }));
    }
    // GEMM + bias in cuBLASLt's epilogue (the engine's fused `MatMul` + `BiasAdd`): odd and
    // aligned shapes, every transpose combination.
    for (m, k, p, ta, tb, big) in [
        (3, 50, 783, false, false, false),
        (783, 4096, 50, false, true, false),
        (50, 783, 3, true, false, false),
        (1024, 768, 2304, false, true, true),
        (4096, 3072, 768, true, true, true),
        (37, 200, 64, false, true, false),
    ] {
        let size = format!("M={m} K={k} P={p} ta={} tb={}", ta as u8, tb as u8);
        // f32 output and bias, and — where the `fuse` pass makes them so, rows of a multiple of
        // 8 — bf16 output and bias: one rounding of the fp32 sum, against the float64 product
        // plus the bias the GEMM reads (bf16-rounded for a bf16 output).
        for bf16_out in [false, true] {
            if bf16_out && p % 8 != 0 {
                continue;
            }
            let name = if bf16_out {
                "mat_mul_bf16_bias_bf16_out"
            } else {
                "mat_mul_bf16_bias"
            };
            v.push(case(name, size.clone(), TOL_BF16, big, move |cx| {
                let (a, b) = (cx.normal(m * k, 0.0, 1.0), cx.normal(k * p, 0.0, 1.0));
                let bias = cx.normal(p, 0.0, 1.0);
                let ad = if ta { Dims::new(k, m) } else { Dims::new(m, k) };
                let bd = if tb { Dims::new(p, k) } else { Dims::new(k, p) };
                let (a32, b32, bias32) = (cx.up(&a)?, cx.up(&b)?, cx.up(&bias)?);
                let (a16, b16) = (cx.raw(Elem::BF16, a.len())?, cx.raw(Elem::BF16, b.len())?);
                let (biasb, ob) = if bf16_out {
                    let (b16, o) = (cx.raw(Elem::BF16, p)?, cx.raw(Elem::BF16, m * p)?);
                    gemm::cast_f32_to_bf16(cx.dev, &bias32, &b16)?;
                    (b16, o)
                } else {
                    (bias32, cx.out(m * p)?)
                };
                let ms = cx.timed(|| {
                    gemm::cast_f32_to_bf16(cx.dev, &a32, &a16)?;
                    gemm::cast_f32_to_bf16(cx.dev, &b32, &b16)?;
                    gemm::gemm_bf16_bias(cx.dev, &a16, ad, &b16, bd, &biasb, &ob, ta, tb)
                })?;
                let mut r = vec![0.0; m * p];
                let (cad, cbd) = (cpu_dims(ad), cpu_dims(bd));
                c::matmul::matmul(&wide(&a), cad, &wide(&b), cbd, &mut r, ta, tb, false)
                    .map_err(cpu)?;
                for (i, x) in r.iter_mut().enumerate() {
                    let bi = bias[i % p];
                    *x += f64::from(if bf16_out {
                        schedule::round_to_bf16(bi)
                    } else {
                        bi
                    });
                }
                let got = if bf16_out {
                    down_bf16(cx, &ob)?
                } else {
                    cx.down(&ob)?
                };
                Ok(one("out", rel_err(&got, &r), ms))
            }));
        }
    }
}
