//! Self-test cases of the model, attention, loss, GEMM and elementwise launchers.
use super::{cpu, rel_err, wide, Case, Ctx, Outcome, TOL_BF16, TOL_F32};
use crate::device::FlashKernels;
use crate::error::Result;
use crate::gemm::Dims;
use crate::memory::Elem;
use crate::ops::{attention as gattn, nn as g};
use engine::cpu as c;

/// Registers a case.
pub(crate) fn case(
    kernel: &'static str,
    size: String,
    tol: f64,
    big: bool,
    run: impl Fn(&mut Ctx<'_>) -> Result<Outcome> + 'static,
) -> Case {
    Case {
        kernel,
        size,
        tol,
        big,
        run: Box::new(run),
    }
}

pub(super) fn one(name: &'static str, err: f64, gpu_ms: f64) -> Outcome {
    Outcome {
        errs: vec![(name, err)],
        gpu_ms,
    }
}

pub(crate) fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    embedding(&mut v);
    positional(&mut v);
    norms(&mut v);
    layer_norm_extra(&mut v);
    activations(&mut v);
    elementwise(&mut v);
    rope(&mut v);
    attention(&mut v);
    flash_attention(&mut v);
    super::cases_loss::cross_entropy(&mut v);
    super::cases_loss::matmul(&mut v);
    v
}

fn embedding(v: &mut Vec<Case>) {
    for (vocab, ch, n, big) in [(50, 3, 783, false), (50257, 783, 4096, true)] {
        let size = format!("V={vocab} C={ch} N={n}");
        v.push(case("embedding", size.clone(), TOL_F32, big, move |cx| {
            let table = cx.normal(vocab * ch, 0.0, 1.0);
            let ids = cx.ids(n, vocab);
            let (tb, ib, ob) = (cx.up(&table)?, cx.up(&ids)?, cx.out(n * ch)?);
            let ms = cx.timed(|| g::embedding_forward(cx.dev, &tb, &ib, &ob, vocab, ch))?;
            let mut r = vec![0.0; n * ch];
            c::embedding::embedding_forward(&wide(&table), vocab, ch, &ids, &mut r).map_err(cpu)?;
            Ok(one("out", rel_err(&cx.down(&ob)?, &r), ms))
        }));
        v.push(case("embedding_backward", size, TOL_F32, big, move |cx| {
            let dout = cx.normal(n * ch, 0.0, 1.0);
            let ids = cx.ids(n, vocab);
            let (db, ib, tb) = (cx.up(&dout)?, cx.up(&ids)?, cx.out(vocab * ch)?);
            let ms = cx.timed(|| g::embedding_backward(cx.dev, &db, &ib, &tb, vocab, ch))?;
            let mut r = vec![0.0; vocab * ch];
            c::embedding::embedding_backward(&wide(&dout), &ids, &mut r, vocab, ch).map_err(cpu)?;
            Ok(one("dtable", rel_err(&cx.down(&tb)?, &r), ms))
        }));
    }
    v.push(case(
        "embedding_bad_id",
        "V=50 C=3 N=50, id 50 at row 17".into(),
        0.0,
        false,
        |cx| {
            let table = cx.normal(50 * 3, 0.0, 1.0);
            let mut ids = cx.ids(50, 50);
            ids[17] = 50;
            ids[31] = -1;
            let (tb, ib, ob) = (cx.up(&table)?, cx.up(&ids)?, cx.out(50 * 3)?);
            g::embedding_forward(cx.dev, &tb, &ib, &ob, 50, 3)?;
            let reported = matches!(
                cx.dev.take_status(),
                Err(crate::CudaError::IndexOutOfRange { position: 17 })
            );
            let cleared = cx.dev.take_status().is_ok();
            Ok(one(
                "status",
                if reported && cleared { 0.0 } else { 1.0 },
                0.0,
            ))
        },
    ));
}

fn positional(v: &mut Vec<Case>) {
    for (b, t, ch, p, big) in [
        (2, 3, 50, 5, false),
        (3, 783, 50, 1024, false),
        (2, 4096, 783, 4096, true),
    ] {
        let size = format!("B={b} T={t} C={ch} P={p}");
        v.push(case(
            "add_positional",
            size.clone(),
            TOL_F32,
            big,
            move |cx| {
                let x = cx.normal(b * t * ch, 0.0, 1.0);
                let pos = cx.normal(p * ch, 0.0, 1.0);
                let (xb, pb, ob) = (cx.up(&x)?, cx.up(&pos)?, cx.out(b * t * ch)?);
                let ms = cx.timed(|| g::add_positional(cx.dev, &xb, &pb, &ob, ch, t))?;
                let mut r = vec![0.0; x.len()];
                c::positional::add_positional(&wide(&x), &wide(&pos), &mut r, ch, t)
                    .map_err(cpu)?;
                Ok(one("out", rel_err(&cx.down(&ob)?, &r), ms))
            },
        ));
        v.push(case(
            "add_positional_backward",
            size,
            TOL_F32,
            big,
            move |cx| {
                let dout = cx.normal(b * t * ch, 0.0, 1.0);
                let (db, pb) = (cx.up(&dout)?, cx.out(p * ch)?);
                let ms = cx.timed(|| g::add_positional_backward(cx.dev, &db, &pb, ch, t))?;
                let mut r = vec![0.0; p * ch];
                c::positional::add_positional_backward(&wide(&dout), &mut r, ch, t).map_err(cpu)?;
                Ok(one("dpos", rel_err(&cx.down(&pb)?, &r), ms))
            },
        ));
    }
}

/// The contents of a bf16 device buffer, widened to f32.
pub(super) fn down_bf16(cx: &super::Ctx<'_>, b: &crate::Buf) -> Result<Vec<f32>> {
    Ok(cx
        .dev
        .download::<half::bf16>(b)?
        .iter()
        .map(|x| x.to_f32())
        .collect())
}

/// The `layer_norm` and `layer_norm_backward` cases of one size. `N` and `c` pick the paths
/// (see `ops::nn`): rows of `c ≤ 2048` take the warp-per-row kernels (8, 16, 24, 32 or 64
/// values a lane), wider rows the block-per-row ones; dweight/dbias sum `min(N / c, ⌈N / 64⌉,
/// 64)` slabs of rows (at least one) into partials, then the partials. Outputs and scratch
/// NaN-poisoned.
fn layer_norm_cases(v: &mut Vec<Case>, n: usize, ch: usize, bias: bool, big: bool) {
    let size = format!("N={n} C={ch}{}", if bias { "" } else { " no-bias" });
    let eps = 1e-5;
    // The f32 output, and (warp-per-row widths) the bf16 one the engine writes for outputs
    // only GEMMs read.
    for (name, elem, tol) in [
        ("layer_norm", Elem::F32, TOL_F32),
        ("layer_norm_bf16", Elem::BF16, TOL_BF16),
    ] {
        if elem == Elem::BF16 && ch > g::LAYERNORM_WARP_MAX_C {
            continue;
        }
        v.push(case(name, size.clone(), tol, big, move |cx| {
            let x = cx.normal(n * ch, 0.5, 2.0);
            let w = cx.normal(ch, 1.0, 0.1);
            let bv = cx.normal(ch, 0.0, 1.0);
            let (xb, wb, bb) = (cx.up(&x)?, cx.up(&w)?, cx.up(&bv)?);
            let ob = match elem {
                Elem::BF16 => cx.raw(Elem::BF16, n * ch)?,
                _ => cx.out(n * ch)?,
            };
            let bias_b = bias.then_some(&bb);
            let ms = cx.timed(|| match elem {
                Elem::BF16 => g::layernorm_forward_bf16(cx.dev, &xb, &wb, bias_b, &ob, ch, eps),
                _ => g::layernorm_forward(cx.dev, &xb, &wb, bias_b, &ob, ch, eps),
            })?;
            let mut r = vec![0.0; n * ch];
            let bw = wide(&bv);
            c::norms::layernorm_forward(
                &wide(&x),
                &wide(&w),
                bias.then_some(bw.as_slice()),
                &mut r,
                ch,
                eps,
            )
            .map_err(cpu)?;
            let got = match elem {
                Elem::BF16 => down_bf16(cx, &ob)?,
                _ => cx.down(&ob)?,
            };
            Ok(one("out", rel_err(&got, &r), ms))
        }));
    }
    v.push(case(
        "layer_norm_backward",
        size.clone(),
        TOL_F32,
        big,
        move |cx| {
            let x = cx.normal(n * ch, 0.5, 2.0);
            let w = cx.normal(ch, 1.0, 0.1);
            let dout = cx.normal(n * ch, 0.0, 1.0);
            let (xb, wb, gb) = (cx.up(&x)?, cx.up(&w)?, cx.up(&dout)?);
            let (dxb, dwb, dbb) = (cx.out(n * ch)?, cx.out(ch)?, cx.out(ch)?);
            let sb = cx.out(g::layernorm_backward_scratch_len(n, ch))?;
            let dbias = bias.then_some(&dbb);
            let ms = cx.timed(|| {
                g::layernorm_backward(cx.dev, &gb, &xb, &wb, &dxb, &dwb, dbias, ch, eps, &sb)
            })?;
            let (mut dx, mut dw, mut db) = (vec![0.0; n * ch], vec![0.0; ch], vec![0.0; ch]);
            let db_ref = if bias { Some(db.as_mut_slice()) } else { None };
            c::norms::layernorm_backward(
                &wide(&dout),
                &wide(&x),
                &wide(&w),
                &mut dx,
                &mut dw,
                db_ref,
                ch,
                eps,
            )
            .map_err(cpu)?;
            let mut errs = vec![
                ("dx", rel_err(&cx.down(&dxb)?, &dx)),
                ("dweight", rel_err(&cx.down(&dwb)?, &dw)),
            ];
            if bias {
                errs.push(("dbias", rel_err(&cx.down(&dbb)?, &db)));
            }
            Ok(Outcome { errs, gpu_ms: ms })
        },
    ));
}

/// LayerNorm sizes beyond the shared norm sizes, for the warp-per-row kernels of every width
/// (c = 3, 50, 768, 783, 1600, 2048), the block-per-row fallback just past them (c = 2049),
/// N = 1, multi-slab dweight/dbias (N ≥ 1000), and GPT-2 124M's 16384 × 768.
fn layer_norm_extra(v: &mut Vec<Case>) {
    for (n, ch, bias, big) in [
        (1, 3, true, false),
        (1031, 3, false, false),
        (1000, 50, true, false),
        (777, 384, true, false),
        (2053, 768, true, false),
        (5000, 783, false, false),
        (3001, 1600, true, false),
        (4100, 2048, true, false),
        (300, 2049, true, false),
        (4200, 2049, false, false),
        (16384, 768, true, true),
    ] {
        layer_norm_cases(v, n, ch, bias, big);
    }
}

fn norms(v: &mut Vec<Case>) {
    for (n, ch, bias, big) in [
        (3, 50, true, false),
        (783, 783, false, false),
        (50, 4096, true, false),
        (4096, 4096, true, true),
    ] {
        let size = format!("N={n} C={ch}{}", if bias { "" } else { " no-bias" });
        let eps = 1e-5;
        layer_norm_cases(v, n, ch, bias, big);
        v.push(case("rms_norm", size.clone(), TOL_F32, big, move |cx| {
            let x = cx.normal(n * ch, 0.5, 2.0);
            let w = cx.normal(ch, 1.0, 0.1);
            let (xb, wb, ob) = (cx.up(&x)?, cx.up(&w)?, cx.out(n * ch)?);
            let ms = cx.timed(|| g::rmsnorm_forward(cx.dev, &xb, &wb, &ob, ch, eps))?;
            let mut r = vec![0.0; n * ch];
            c::norms::rmsnorm_forward(&wide(&x), &wide(&w), &mut r, ch, eps).map_err(cpu)?;
            Ok(one("out", rel_err(&cx.down(&ob)?, &r), ms))
        }));
        v.push(case(
            "rms_norm_bf16",
            size.clone(),
            TOL_BF16,
            big,
            move |cx| {
                let x = cx.normal(n * ch, 0.5, 2.0);
                let w = cx.normal(ch, 1.0, 0.1);
                let (xb, wb, ob) = (cx.up(&x)?, cx.up(&w)?, cx.raw(Elem::BF16, n * ch)?);
                let ms = cx.timed(|| g::rmsnorm_forward(cx.dev, &xb, &wb, &ob, ch, eps))?;
                let mut r = vec![0.0; n * ch];
                c::norms::rmsnorm_forward(&wide(&x), &wide(&w), &mut r, ch, eps).map_err(cpu)?;
                Ok(one("out", rel_err(&down_bf16(cx, &ob)?, &r), ms))
            },
        ));
        v.push(case("rms_norm_backward", size, TOL_F32, big, move |cx| {
            let x = cx.normal(n * ch, 0.5, 2.0);
            let w = cx.normal(ch, 1.0, 0.1);
            let dout = cx.normal(n * ch, 0.0, 1.0);
            let (xb, wb, gb) = (cx.up(&x)?, cx.up(&w)?, cx.up(&dout)?);
            let (dxb, dwb) = (cx.out(n * ch)?, cx.out(ch)?);
            let sb = cx.out(g::rmsnorm_backward_scratch_len(n, ch))?;
            let ms =
                cx.timed(|| g::rmsnorm_backward(cx.dev, &gb, &xb, &wb, &dxb, &dwb, ch, eps, &sb))?;
            let (mut dx, mut dw) = (vec![0.0; n * ch], vec![0.0; ch]);
            c::norms::rmsnorm_backward(
                &wide(&dout),
                &wide(&x),
                &wide(&w),
                &mut dx,
                &mut dw,
                ch,
                eps,
            )
            .map_err(cpu)?;
            let errs = vec![
                ("dx", rel_err(&cx.down(&dxb)?, &dx)),
                ("dweight", rel_err(&cx.down(&dwb)?, &dw)),
            ];
            Ok(Outcome { errs, gpu_ms: ms })
        }));
    }
}

fn activations(v: &mut Vec<Case>) {
    for (n, big) in [(3, false), (783 * 50, false), (4096 * 783, true)] {
        let size = format!("n={n}");
        v.push(case("gelu", size.clone(), TOL_F32, big, move |cx| {
            let x = cx.normal(n, 0.0, 3.0);
            let (xb, ob) = (cx.up(&x)?, cx.out(n)?);
            let ms = cx.timed(|| g::gelu_forward(cx.dev, &xb, &ob))?;
            let mut r = vec![0.0; n];
            c::elementwise::gelu(&wide(&x), &mut r).map_err(cpu)?;
            Ok(one("out", rel_err(&cx.down(&ob)?, &r), ms))
        }));
        v.push(case("gelu_bf16", size.clone(), TOL_BF16, big, move |cx| {
            let x = cx.normal(n, 0.0, 3.0);
            let (xb, ob) = (cx.up(&x)?, cx.raw(Elem::BF16, n)?);
            let ms = cx.timed(|| g::gelu_forward_bf16(cx.dev, &xb, &ob))?;
            let mut r = vec![0.0; n];
            c::elementwise::gelu(&wide(&x), &mut r).map_err(cpu)?;
            Ok(one("out", rel_err(&down_bf16(cx, &ob)?, &r), ms))
        }));
        v.push(case("gelu_backward", size, TOL_F32, big, move |cx| {
            let x = cx.normal(n, 0.0, 3.0);
            let dout = cx.normal(n, 0.0, 1.0);
            let (xb, gb, ob) = (cx.up(&x)?, cx.up(&dout)?, cx.out(n)?);
            let ms = cx.timed(|| g::gelu_backward(cx.dev, &gb, &xb, &ob))?;
            let mut r = vec![0.0; n];
            c::elementwise::gelu_backward(&wide(&dout), &wide(&x), &mut r).map_err(cpu)?;
            Ok(one("dx", rel_err(&cx.down(&ob)?, &r), ms))
        }));
    }
    for (rows, f, big) in [(3, 50, false), (50, 783, false), (783, 4096, true)] {
        let size = format!("N={rows} F={f}");
        v.push(case("swi_glu", size.clone(), TOL_F32, big, move |cx| {
            let x = cx.normal(rows * 2 * f, 0.0, 3.0);
            let (xb, ob) = (cx.up(&x)?, cx.out(rows * f)?);
            let ms = cx.timed(|| g::swiglu_forward(cx.dev, &xb, &ob, f))?;
            let mut r = vec![0.0; rows * f];
            c::elementwise::swiglu(&wide(&x), &mut r, f).map_err(cpu)?;
            Ok(one("out", rel_err(&cx.down(&ob)?, &r), ms))
        }));
        v.push(case(
            "swi_glu_bf16",
            size.clone(),
            TOL_BF16,
            big,
            move |cx| {
                let x = cx.normal(rows * 2 * f, 0.0, 3.0);
                let (xb, ob) = (cx.up(&x)?, cx.raw(Elem::BF16, rows * f)?);
                let ms = cx.timed(|| g::swiglu_forward(cx.dev, &xb, &ob, f))?;
                let mut r = vec![0.0; rows * f];
                c::elementwise::swiglu(&wide(&x), &mut r, f).map_err(cpu)?;
                Ok(one("out", rel_err(&down_bf16(cx, &ob)?, &r), ms))
            },
        ));
        // A bf16 x (LLaMA's fc, a bf16 GEMM's output): the reference reads the same rounded x.
        for bf16_out in [false, true] {
            let kernel = if bf16_out {
                "swi_glu_bf16x_bf16"
            } else {
                "swi_glu_bf16x"
            };
            let tol = if bf16_out { TOL_BF16 } else { TOL_F32 };
            v.push(case(kernel, size.clone(), tol, big, move |cx| {
                let x = cx.normal(rows * 2 * f, 0.0, 3.0);
                let x16: Vec<f32> = x.iter().map(|&v| schedule::round_to_bf16(v)).collect();
                let (x32b, xb) = (cx.up(&x)?, cx.raw(Elem::BF16, rows * 2 * f)?);
                crate::gemm::cast_f32_to_bf16(cx.dev, &x32b, &xb)?;
                let ob = if bf16_out {
                    cx.raw(Elem::BF16, rows * f)?
                } else {
                    cx.out(rows * f)?
                };
                let ms = cx.timed(|| g::swiglu_forward(cx.dev, &xb, &ob, f))?;
                let mut r = vec![0.0; rows * f];
                c::elementwise::swiglu(&wide(&x16), &mut r, f).map_err(cpu)?;
                let got = if bf16_out {
                    down_bf16(cx, &ob)?
                } else {
                    cx.down(&ob)?
                };
                Ok(one("out", rel_err(&got, &r), ms))
            }));
        }
        v.push(case(
            "swi_glu_backward_bf16x",
            size.clone(),
            TOL_F32,
            big,
            move |cx| {
                let x = cx.normal(rows * 2 * f, 0.0, 3.0);
                let x16: Vec<f32> = x.iter().map(|&v| schedule::round_to_bf16(v)).collect();
                let dout = cx.normal(rows * f, 0.0, 1.0);
                let (x32b, xb) = (cx.up(&x)?, cx.raw(Elem::BF16, rows * 2 * f)?);
                crate::gemm::cast_f32_to_bf16(cx.dev, &x32b, &xb)?;
                let (gb, ob) = (cx.up(&dout)?, cx.out(rows * 2 * f)?);
                let ms = cx.timed(|| g::swiglu_backward(cx.dev, &gb, &xb, &ob, f))?;
                let mut r = vec![0.0; rows * 2 * f];
                c::elementwise::swiglu_backward(&wide(&dout), &wide(&x16), &mut r, f)
                    .map_err(cpu)?;
                Ok(one("dx", rel_err(&cx.down(&ob)?, &r), ms))
            },
        ));
        v.push(case("swi_glu_backward", size, TOL_F32, big, move |cx| {
            let x = cx.normal(rows * 2 * f, 0.0, 3.0);
            let dout = cx.normal(rows * f, 0.0, 1.0);
            let (xb, gb, ob) = (cx.up(&x)?, cx.up(&dout)?, cx.out(rows * 2 * f)?);
            let ms = cx.timed(|| g::swiglu_backward(cx.dev, &gb, &xb, &ob, f))?;
            let mut r = vec![0.0; rows * 2 * f];
            c::elementwise::swiglu_backward(&wide(&dout), &wide(&x), &mut r, f).map_err(cpu)?;
            Ok(one("dx", rel_err(&cx.down(&ob)?, &r), ms))
        }));
    }
}

fn elementwise(v: &mut Vec<Case>) {
    for (n, ch, big) in [(3, 50, false), (783, 3, false), (4096, 783, true)] {
        let size = format!("N={n} C={ch}");
        v.push(case("add", size.clone(), TOL_F32, big, move |cx| {
            let (a, b) = (cx.normal(n * ch, 0.0, 1.0), cx.normal(n * ch, 0.0, 1.0));
            let (ab, bb, ob) = (cx.up(&a)?, cx.up(&b)?, cx.out(n * ch)?);
            let ms = cx.timed(|| g::add(cx.dev, &ab, &bb, &ob))?;
            let mut r = vec![0.0; n * ch];
            c::elementwise::add(&wide(&a), &wide(&b), &mut r).map_err(cpu)?;
            Ok(one("out", rel_err(&cx.down(&ob)?, &r), ms))
        }));
        v.push(case("bias_add", size.clone(), TOL_F32, big, move |cx| {
            let (x, b) = (cx.normal(n * ch, 0.0, 1.0), cx.normal(ch, 0.0, 1.0));
            let (xb, bb, ob) = (cx.up(&x)?, cx.up(&b)?, cx.out(n * ch)?);
            let ms = cx.timed(|| g::bias_add(cx.dev, &xb, &bb, &ob, ch))?;
            let mut r = vec![0.0; n * ch];
            c::elementwise::bias_add(&wide(&x), &wide(&b), &mut r, ch).map_err(cpu)?;
            Ok(one("out", rel_err(&cx.down(&ob)?, &r), ms))
        }));
        sum_rows_case(v, n, ch, big);
        // Plan op `Cast`: bit-identical to the CPU engine's rounding (nearest, ties to even).
        v.push(case("cast_bf16", size.clone(), 0.0, big, move |cx| {
            let x = cx.normal(n * ch, 0.0, 3.0);
            let (xb, ob) = (cx.up(&x)?, cx.raw(Elem::BF16, n * ch)?);
            let ms = cx.timed(|| crate::gemm::cast_f32_to_bf16(cx.dev, &xb, &ob))?;
            let r: Vec<f64> = x
                .iter()
                .map(|&v| f64::from(schedule::round_to_bf16(v)))
                .collect();
            let mut errs = vec![("out", rel_err(&down_bf16(cx, &ob)?, &r))];
            // Unaligned operands (one element in): the element-at-a-time path.
            if n * ch > 1 {
                let m = n * ch - 1;
                let (xs, os) = (xb.slice(1, m)?, cx.raw(Elem::BF16, m + 1)?.slice(1, m)?);
                crate::gemm::cast_f32_to_bf16(cx.dev, &xs, &os)?;
                errs.push(("unaligned", rel_err(&down_bf16(cx, &os)?, &r[1..])));
            }
            Ok(Outcome { errs, gpu_ms: ms })
        }));
    }
    // One slab (N <= 64) and many (`min(⌈N / 64⌉, 64)`: 16 for N = 1000, 64 for N = 16384,
    // last slab short when 64 does not divide N), odd and GPT-2 widths.
    for n in [1, 3, 1000, 16384] {
        for ch in [1, 3, 50, 768, 783, 3072] {
            if (n, ch) != (3, 50) {
                sum_rows_case(v, n, ch, n >= 16384 && ch >= 768);
            }
        }
    }
}

/// The `sum_rows` case of one size: per-slab column partials in the scratch, then the
/// partials added in slab order (one slab writes `out` directly). Output and scratch
/// NaN-poisoned.
fn sum_rows_case(v: &mut Vec<Case>, n: usize, ch: usize, big: bool) {
    let size = format!("N={n} C={ch}");
    v.push(case("sum_rows", size, TOL_F32, big, move |cx| {
        let x = cx.normal(n * ch, 0.3, 1.0);
        let (xb, ob) = (cx.up(&x)?, cx.out(ch)?);
        let sb = cx.out(g::sum_rows_scratch_len(n, ch))?;
        let ms = cx.timed(|| g::sum_rows(cx.dev, &xb, &ob, ch, &sb))?;
        let mut r = vec![0.0; ch];
        c::elementwise::sum_rows(&wide(&x), &mut r, ch).map_err(cpu)?;
        Ok(one("out", rel_err(&cx.down(&ob)?, &r), ms))
    }));
    // Plan op `SumRowsCast`: the column sums bit-identical to `sum_rows`'s on the GPU (and near
    // the CPU's), the copy bit-identical to the CPU engine's bf16 rounding; both paths (four
    // columns a thread where C is a multiple of 4, one otherwise).
    let size = format!("N={n} C={ch}");
    v.push(case("sum_rows_cast", size, TOL_F32, big, move |cx| {
        let x = cx.normal(n * ch, 0.3, 1.0);
        let (xb, ob, ob2) = (cx.up(&x)?, cx.out(ch)?, cx.out(ch)?);
        let cb = cx.raw(Elem::BF16, n * ch)?;
        let sb = cx.out(g::sum_rows_scratch_len(n, ch))?;
        let ms = cx.timed(|| g::sum_rows_cast(cx.dev, &xb, &ob, &cb, ch, &sb))?;
        g::sum_rows(cx.dev, &xb, &ob2, ch, &sb)?;
        let mut r = vec![0.0; ch];
        c::elementwise::sum_rows(&wide(&x), &mut r, ch).map_err(cpu)?;
        let (fused, plain) = (cx.down(&ob)?, cx.down(&ob2)?);
        let same = fused
            .iter()
            .zip(&plain)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        let rounded: Vec<f64> = x
            .iter()
            .map(|&v| f64::from(schedule::round_to_bf16(v)))
            .collect();
        let copy = down_bf16(cx, &cb)?;
        let exact = copy.iter().zip(&rounded).all(|(a, b)| f64::from(*a) == *b);
        Ok(Outcome {
            errs: vec![
                ("out", rel_err(&fused, &r)),
                ("out bits == sum_rows", if same { 0.0 } else { 1.0 }),
                ("out_bf16 bits == cpu", if exact { 0.0 } else { 1.0 }),
            ],
            gpu_ms: ms,
        })
    }));
}

fn rope(v: &mut Vec<Case>) {
    // (rows, width, seq_len, head_dim, rotated_cols, theta)
    let configs = [
        (3, 12, 3, 4, 8, 10000.0, false),
        (100, 150, 50, 10, 100, 10000.0, false),
        (2 * 783, 768, 783, 64, 512, 10000.0, false),
        (4096, 3 * 1024, 4096, 128, 2048, 500000.0, true),
    ];
    for (rows, width, seq_len, head_dim, rotated_cols, theta, big) in configs {
        let size = format!(
            "N={rows} W={width} T={seq_len} hd={head_dim} rot={rotated_cols} theta={theta}"
        );
        let gd = g::RopeDims {
            width,
            seq_len,
            head_dim,
            rotated_cols,
            theta,
        };
        let cd = c::rope::RopeDims {
            width,
            seq_len,
            head_dim,
            rotated_cols,
            theta,
        };
        for backward in [false, true] {
            let name = if backward { "rope_backward" } else { "rope" };
            v.push(case(name, size.clone(), TOL_F32, big, move |cx| {
                let x = cx.normal(rows * width, 0.0, 1.0);
                let (xb, ob) = (cx.up(&x)?, cx.out(rows * width)?);
                let sb = cx.out(g::rope_scratch_len(seq_len, head_dim))?;
                let mut r = vec![0.0; rows * width];
                let ms = if backward {
                    let ms = cx.timed(|| g::rope_backward(cx.dev, &xb, &ob, &gd, &sb))?;
                    c::rope::rope_backward(&wide(&x), &mut r, &cd).map_err(cpu)?;
                    ms
                } else {
                    let ms = cx.timed(|| g::rope_forward(cx.dev, &xb, &ob, &gd, &sb))?;
                    c::rope::rope_forward(&wide(&x), &mut r, &cd).map_err(cpu)?;
                    ms
                };
                Ok(one("out", rel_err(&cx.down(&ob)?, &r), ms))
            }));
        }
    }
}

fn attention(v: &mut Vec<Case>) {
    // (batch, seq_len, n_heads, channels)
    for (b, t, nh, ch, big) in [
        (1, 3, 1, 50, false),
        (2, 50, 2, 48, false),
        (2, 783, 4, 256, false),
        (2, 1024, 12, 768, true),
    ] {
        let size = format!("B={b} T={t} NH={nh} C={ch}");
        let gd = gattn::AttnDims {
            batch: b,
            seq_len: t,
            n_heads: nh,
            channels: ch,
        };
        let cd = c::attention::AttnDims {
            batch: b,
            seq_len: t,
            n_heads: nh,
            channels: ch,
        };
        let nc = b * t * ch;
        v.push(case("attention", size.clone(), TOL_F32, big, move |cx| {
            let qkv = cx.normal(3 * nc, 0.0, 1.0);
            let (qb, ob) = (cx.up(&qkv)?, cx.out(nc)?);
            let sb = cx.out(gattn::attention_forward_scratch_len(&gd))?;
            let ms = cx.timed(|| gattn::attention_forward(cx.dev, &qb, &ob, &gd, &sb))?;
            let mut r = vec![0.0; nc];
            c::attention::attention_forward(&wide(&qkv), &mut r, &cd).map_err(cpu)?;
            Ok(one("out", rel_err(&cx.down(&ob)?, &r), ms))
        }));
        v.push(case("attention_backward", size, TOL_F32, big, move |cx| {
            let qkv = cx.normal(3 * nc, 0.0, 1.0);
            let dout = cx.normal(nc, 0.0, 1.0);
            let (qb, gb, db) = (cx.up(&qkv)?, cx.up(&dout)?, cx.out(3 * nc)?);
            let sb = cx.out(gattn::attention_backward_scratch_len(&gd))?;
            let ms = cx.timed(|| gattn::attention_backward(cx.dev, &gb, &qb, &db, &gd, &sb))?;
            let mut r = vec![0.0; 3 * nc];
            c::attention::attention_backward(&wide(&dout), &wide(&qkv), &mut r, &cd)
                .map_err(cpu)?;
            let got = cx.down(&db)?;
            let errs = (0..3)
                .map(|part| {
                    let pick = |s: &[f32]| -> Vec<f32> {
                        s.chunks(3 * ch)
                            .flat_map(|row| row[part * ch..(part + 1) * ch].to_vec())
                            .collect()
                    };
                    let pick64 = |s: &[f64]| -> Vec<f64> {
                        s.chunks(3 * ch)
                            .flat_map(|row| row[part * ch..(part + 1) * ch].to_vec())
                            .collect()
                    };
                    (["dq", "dk", "dv"][part], rel_err(&pick(&got), &pick64(&r)))
                })
                .collect();
            Ok(Outcome { errs, gpu_ms: ms })
        }));
    }
}

/// The fused (flash-style) attention kernels against the CPU reference at awkward sizes: every
/// head-dim variant (d32, d64, d128, each also padded: head dims 16, 24, 48, 50, 100), T not
/// a multiple of the 128-row block or the 64-row tile, T = 1, several batches. Outputs and
/// scratch NaN-poisoned. The bf16 tensor-core kernels (bf16 tolerance: operands rounded to
/// bf16, fp32 accumulation) take every geometry with head dims ≤ 128: forward, backward
/// (statistics from a forward rerun) and the saved-statistics backward; both families, the
/// `mma.sync` kernels (`flash_attention_tc*`) and, on compute capability 9.0, the `wgmma` ones
/// (`flash_attention_wg*`, head dims above 32).
fn flash_attention(v: &mut Vec<Case>) {
    // (batch, seq_len, n_heads, channels)
    for (b, t, nh, ch, big) in [
        (1, 1, 1, 16, false),
        (2, 7, 2, 64, false),
        (3, 50, 1, 16, false),
        (1, 3, 1, 50, false),
        (2, 129, 2, 64, false),
        (1, 129, 12, 768, false),
        (2, 50, 3, 300, false),
        (1, 200, 2, 256, false),
        (2, 200, 2, 100, false),
        (1, 150, 3, 144, false),
        (1, 70, 2, 48, false),
        (1, 1, 2, 128, false),
        (3, 1024, 2, 64, false),
        (1, 1024, 12, 768, true),
        (2, 1024, 12, 768, true),
        // Head dim 128 (the d128 kernels: dynamic shared memory, K/V rows re-read from it in
        // dK/dV) and 100 (padded to 128).
        (1, 1, 1, 128, false),
        (2, 200, 2, 256, false),
        (1, 129, 2, 200, false),
        (2, 1000, 2, 256, false),
        (2, 1024, 2, 256, false),
        (1, 1024, 16, 2048, true),
    ] {
        let size = format!("B={b} T={t} NH={nh} C={ch}");
        let gd = gattn::AttnDims {
            batch: b,
            seq_len: t,
            n_heads: nh,
            channels: ch,
        };
        let cd = c::attention::AttnDims {
            batch: b,
            seq_len: t,
            n_heads: nh,
            channels: ch,
        };
        let nc = b * t * ch;
        let math = gattn::FlashMath::Bf16;
        let tol = TOL_BF16;
        for (kernels, [fwd_name, bwd_name, saved_name, bf16_name]) in [
            (
                FlashKernels::Mma,
                [
                    "flash_attention_tc",
                    "flash_attention_tc_backward",
                    "flash_attention_tc_backward_saved",
                    "flash_attention_tc_bf16_inputs",
                ],
            ),
            (
                FlashKernels::Wgmma,
                [
                    "flash_attention_wg",
                    "flash_attention_wg_backward",
                    "flash_attention_wg_backward_saved",
                    "flash_attention_wg_bf16_inputs",
                ],
            ),
        ] {
            // Heads of at most 32 run the mma.sync kernels in either family.
            if !gattn::flash_supported(&gd, math)
                || (kernels == FlashKernels::Wgmma && ch / nh <= 32)
            {
                continue;
            }

            v.push(case(
                fwd_name,
                size.clone(),
                tol,
                big,
                with_kernels(kernels, move |cx| {
                    let qkv = cx.normal(3 * nc, 0.0, 1.0);
                    let (qb, ob) = (cx.up(&qkv)?, cx.out(nc)?);
                    let sb = cx.out(gattn::flash_forward_scratch_len(&gd, math))?;
                    let ms = cx.timed(|| {
                        gattn::flash_attention_forward(cx.dev, &qb, &ob, &gd, &sb, math)
                    })?;
                    let mut r = vec![0.0; nc];
                    c::attention::attention_forward(&operands(&qkv, math), &mut r, &cd)
                        .map_err(cpu)?;
                    Ok(one("out", rel_err(&cx.down(&ob)?, &r), ms))
                }),
            ));
            v.push(case(
                bwd_name,
                size.clone(),
                tol,
                big,
                with_kernels(kernels, move |cx| {
                    let qkv = cx.normal(3 * nc, 0.0, 1.0);
                    let dout = cx.normal(nc, 0.0, 1.0);
                    let (qb, gb, db) = (cx.up(&qkv)?, cx.up(&dout)?, cx.out(3 * nc)?);
                    let sb = cx.out(gattn::flash_backward_scratch_len(&gd, math))?;
                    let ms = cx.timed(|| {
                        gattn::flash_attention_backward(cx.dev, &gb, &qb, &db, &gd, &sb, math)
                    })?;
                    let mut r = vec![0.0; 3 * nc];
                    c::attention::attention_backward(
                        &operands(&dout, math),
                        &operands(&qkv, math),
                        &mut r,
                        &cd,
                    )
                    .map_err(cpu)?;
                    let errs = dqkv_errs(&cx.down(&db)?, &r, ch);
                    Ok(Outcome { errs, gpu_ms: ms })
                }),
            ));
            // The engine's path: the forward keeps lse and bf16 qkv, the backward takes them
            // and the bf16 copy of the output (delta from O instead of a forward rerun).
            v.push(case(
                saved_name,
                size.clone(),
                tol,
                big,
                with_kernels(kernels, move |cx| {
                    let qkv = cx.normal(3 * nc, 0.0, 1.0);
                    let dout = cx.normal(nc, 0.0, 1.0);
                    let (qb, gb, db) = (cx.up(&qkv)?, cx.up(&dout)?, cx.out(3 * nc)?);
                    let rows = b * nh * t;
                    let (lse, qkv16) = (cx.out(rows)?, cx.raw(Elem::BF16, 3 * nc)?);
                    // The forward writes its output in bf16 (the engine's bf16-only path).
                    let o16 = cx.raw(Elem::BF16, nc)?;
                    let fs = cx.out(gattn::flash_forward_scratch_len(&gd, math))?;
                    let bs = cx.out(gattn::flash_backward_scratch_len(&gd, math))?;
                    let saved = gattn::FlashSaved {
                        lse: &lse,
                        qkv16: &qkv16,
                    };
                    gattn::flash_attention_forward_saving(cx.dev, &qb, &o16, &gd, &fs, &saved)?;
                    let mut ro = vec![0.0; nc];
                    c::attention::attention_forward(&operands(&qkv, math), &mut ro, &cd)
                        .map_err(cpu)?;
                    let o16_host = down_bf16(cx, &o16)?;
                    let out_err = rel_err(&o16_host, &ro);
                    let ms = cx.timed(|| {
                        gattn::flash_attention_backward_saved(
                            cx.dev, &gb, &db, &gd, &bs, &saved, &o16,
                        )
                    })?;
                    let mut r = vec![0.0; 3 * nc];
                    let (dout_r, qkv_r) = (operands(&dout, math), operands(&qkv, math));
                    c::attention::attention_backward(&dout_r, &qkv_r, &mut r, &cd).map_err(cpu)?;
                    // By contract this path's delta is rowsum(dO ⊙ O) of the bf16 O it is
                    // given (FlashAttention-2's choice); the reference takes the same O.
                    delta_from_o16(&mut r, &qkv_r, &dout_r, &wide(&o16_host), &ro, &cd);
                    let mut errs = dqkv_errs(&cx.down(&db)?, &r, ch);
                    errs.push(("out", out_err));
                    Ok(Outcome { errs, gpu_ms: ms })
                }),
            ));
            // qkv and dout as bf16 plan buffers (the `fuse` pass's for GPT's qkv): the kernels
            // read them as they are, and every output is bit-identical to the f32-input path
            // above, which casts them per call (an error of 1 where any bit differs).
            v.push(case(
                bf16_name,
                size.clone(),
                tol,
                big,
                with_kernels(kernels, move |cx| {
                    let qkv = cx.normal(3 * nc, 0.0, 1.0);
                    let dout = cx.normal(nc, 0.0, 1.0);
                    let (qb, gb) = (cx.up(&qkv)?, cx.up(&dout)?);
                    let (q16, g16) = (cx.raw(Elem::BF16, 3 * nc)?, cx.raw(Elem::BF16, nc)?);
                    crate::gemm::cast_f32_to_bf16(cx.dev, &qb, &q16)?;
                    crate::gemm::cast_f32_to_bf16(cx.dev, &gb, &g16)?;
                    let rows = b * nh * t;
                    let fs = cx.out(gattn::flash_forward_scratch_len(&gd, math))?;
                    let bs = cx.out(gattn::flash_backward_scratch_len(&gd, math))?;
                    // The f32-input reference: the engine's saving path with its own copy.
                    let (lse, copy16) = (cx.out(rows)?, cx.raw(Elem::BF16, 3 * nc)?);
                    let (o_ref, d_ref) = (cx.raw(Elem::BF16, nc)?, cx.out(3 * nc)?);
                    let saved = gattn::FlashSaved {
                        lse: &lse,
                        qkv16: &copy16,
                    };
                    gattn::flash_attention_forward_saving(cx.dev, &qb, &o_ref, &gd, &fs, &saved)?;
                    gattn::flash_attention_backward_saved(
                        cx.dev, &gb, &d_ref, &gd, &bs, &saved, &o_ref,
                    )?;
                    let d_rerun = cx.out(3 * nc)?;
                    gattn::flash_attention_backward(cx.dev, &gb, &qb, &d_rerun, &gd, &bs, math)?;
                    // The bf16 inputs: qkv is its own saved copy, dout is read as it is.
                    let (lse2, o16, d16) =
                        (cx.out(rows)?, cx.raw(Elem::BF16, nc)?, cx.out(3 * nc)?);
                    let saved2 = gattn::FlashSaved {
                        lse: &lse2,
                        qkv16: &q16,
                    };
                    let ms = cx.timed(|| {
                        gattn::flash_attention_forward_saving(
                            cx.dev, &q16, &o16, &gd, &fs, &saved2,
                        )?;
                        gattn::flash_attention_backward_saved(
                            cx.dev, &g16, &d16, &gd, &bs, &saved2, &o16,
                        )
                    })?;
                    let d16_rerun = cx.out(3 * nc)?;
                    gattn::flash_attention_backward(
                        cx.dev, &g16, &q16, &d16_rerun, &gd, &bs, math,
                    )?;
                    let same = |a: Vec<f32>, b: Vec<f32>| -> f64 {
                        let eq = a.len() == b.len()
                            && a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
                        if eq {
                            0.0
                        } else {
                            1.0
                        }
                    };
                    let errs = vec![
                        ("out", same(down_bf16(cx, &o16)?, down_bf16(cx, &o_ref)?)),
                        ("lse", same(cx.down(&lse2)?, cx.down(&lse)?)),
                        ("dqkv saved", same(cx.down(&d16)?, cx.down(&d_ref)?)),
                        ("dqkv rerun", same(cx.down(&d16_rerun)?, cx.down(&d_rerun)?)),
                    ];
                    Ok(Outcome { errs, gpu_ms: ms })
                }),
            ));
        }
    }
}

/// `f` with the device's fused attention kernels set to `kernels`, the previous choice restored
/// after it.
fn with_kernels(
    kernels: FlashKernels,
    f: impl Fn(&mut Ctx<'_>) -> Result<Outcome> + 'static,
) -> impl Fn(&mut Ctx<'_>) -> Result<Outcome> + 'static {
    move |cx| {
        let prev = cx.dev.set_flash_kernels(kernels)?;
        let r = f(cx);
        cx.dev.set_flash_kernels(prev)?;
        r
    }
}

/// The CPU engine's matmul geometry of a GPU one (same rows and columns).
pub(super) fn cpu_dims(d: Dims) -> c::matmul::Dims {
    c::matmul::Dims {
        rows: d.rows,
        cols: d.cols,
    }
}

/// Moves the float64 attention-backward reference `dqkv` (`[N, 3C]`, on the operands `qkv`,
/// `dout`) to a backward whose `delta_i = rowsum(dO ⊙ O)_i` is taken from `o_used` instead of
/// the exact output `o_exact` (both `[N, C]`): with `e_i = Σ_c dO_ic (o_used − o_exact)_ic` per
/// head, `dS_ij` changes by `−P_ij e_i`, so `dQ_i` by `−s·e_i Σ_j P_ij K_j` and `dK_j` by
/// `−s Σ_i P_ij e_i Q_i` (`dV` does not depend on delta). The saved-attention backward computes
/// delta from the bf16 O of the forward; at tiny T, where few keys make `dP − delta` a
/// cancellation, that rounding alone moves dK by more than the bf16 tolerance (1.9e-2 at
/// T = 3, seen on the H200), so the reference must make the same choice.
fn delta_from_o16(
    dqkv: &mut [f64],
    qkv: &[f64],
    dout: &[f64],
    o_used: &[f64],
    o_exact: &[f64],
    d: &c::attention::AttnDims,
) {
    let (t, ch, nh) = (d.seq_len, d.channels, d.n_heads);
    let hd = ch / nh;
    let w = 3 * ch;
    let scale = 1.0 / (hd as f64).sqrt();
    let mut p = vec![0.0f64; t];
    for b in 0..d.batch {
        for h in 0..nh {
            let row = |i: usize| b * t + i;
            let q = |i: usize, x: usize| qkv[row(i) * w + h * hd + x];
            let k = |j: usize, x: usize| qkv[row(j) * w + ch + h * hd + x];
            for i in 0..t {
                let e: f64 = (0..hd)
                    .map(|x| {
                        let at = row(i) * ch + h * hd + x;
                        dout[at] * (o_used[at] - o_exact[at])
                    })
                    .sum();
                // Causal softmax row i of s·Q Kᵀ.
                let mut mx = f64::NEG_INFINITY;
                for (j, pj) in p.iter_mut().enumerate().take(i + 1) {
                    *pj = scale * (0..hd).map(|x| q(i, x) * k(j, x)).sum::<f64>();
                    mx = mx.max(*pj);
                }
                let mut sum = 0.0;
                for pj in p.iter_mut().take(i + 1) {
                    *pj = (*pj - mx).exp();
                    sum += *pj;
                }
                for j in 0..=i {
                    let c = scale * e * p[j] / sum;
                    for x in 0..hd {
                        dqkv[row(i) * w + h * hd + x] -= c * k(j, x);
                        dqkv[row(j) * w + ch + h * hd + x] -= c * q(i, x);
                    }
                }
            }
        }
    }
}

/// Relative errors of the q, k and v parts of a `dqkv` `[N, 3C]` (each row `[dq | dk | dv]`,
/// `ch` = C columns each) against the float64 reference.
fn dqkv_errs(got: &[f32], r: &[f64], ch: usize) -> Vec<(&'static str, f64)> {
    (0..3)
        .map(|part| {
            let cols = part * ch..(part + 1) * ch;
            let g: Vec<f32> = got
                .chunks(3 * ch)
                .flat_map(|row| row[cols.clone()].to_vec())
                .collect();
            let w: Vec<f64> = r
                .chunks(3 * ch)
                .flat_map(|row| row[cols.clone()].to_vec())
                .collect();
            (["dq", "dk", "dv"][part], rel_err(&g, &w))
        })
        .collect()
}

/// The float64 reference's operands for fused attention computed as `math` says: the inputs
/// rounded to bf16 (nearest even) for the tensor-core kernels.
/// Those kernels compute attention of bf16-rounded Q, K, V and dO by contract (the precision
/// policy of `precision = bf16`); with the same rounded operands on both sides the bf16
/// tolerance measures the kernel's own arithmetic (P and dS rounded to bf16 for the MMAs, fp32
/// sums and softmax) rather than the conditioning of the gradients at tiny T.
fn operands(x: &[f32], math: gattn::FlashMath) -> Vec<f64> {
    match math {
        gattn::FlashMath::Bf16 => x
            .iter()
            .map(|&v| f64::from(half::bf16::from_f32(v).to_f32()))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::{c, delta_from_o16};

    /// Backward of causal attention in float64 from first principles, with delta taken from
    /// `o_delta` (`[N, C]`): `dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ o_delta))`.
    fn brute_backward(
        qkv: &[f64],
        dout: &[f64],
        o_delta: &[f64],
        d: &c::attention::AttnDims,
    ) -> Vec<f64> {
        let (t, ch, nh) = (d.seq_len, d.channels, d.n_heads);
        let (hd, w) = (ch / nh, 3 * ch);
        let s = 1.0 / (hd as f64).sqrt();
        let mut g = vec![0.0; qkv.len()];
        for b in 0..d.batch {
            for h in 0..nh {
                let at = |i: usize, part: usize, x: usize| (b * t + i) * w + part * ch + h * hd + x;
                let ot = |i: usize, x: usize| (b * t + i) * ch + h * hd + x;
                for i in 0..t {
                    let sc: Vec<f64> = (0..=i)
                        .map(|j| {
                            s * (0..hd)
                                .map(|x| qkv[at(i, 0, x)] * qkv[at(j, 1, x)])
                                .sum::<f64>()
                        })
                        .collect();
                    let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = sc.iter().map(|v| (v - mx).exp()).sum();
                    let delta: f64 = (0..hd).map(|x| dout[ot(i, x)] * o_delta[ot(i, x)]).sum();
                    for j in 0..=i {
                        let p = (sc[j] - mx).exp() / z;
                        let dp: f64 = (0..hd).map(|x| dout[ot(i, x)] * qkv[at(j, 2, x)]).sum();
                        let ds = p * (dp - delta);
                        for x in 0..hd {
                            g[at(i, 0, x)] += s * ds * qkv[at(j, 1, x)];
                            g[at(j, 1, x)] += s * ds * qkv[at(i, 0, x)];
                            g[at(j, 2, x)] += p * dout[ot(i, x)];
                        }
                    }
                }
            }
        }
        g
    }

    #[test]
    fn delta_correction_matches_a_backward_with_that_delta() {
        let d = c::attention::AttnDims {
            batch: 2,
            seq_len: 5,
            n_heads: 2,
            channels: 6,
        };
        let n = d.batch * d.seq_len;
        // Deterministic pseudo-random inputs.
        let mut state = 12345u64;
        let mut rnd = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        };
        let qkv: Vec<f64> = (0..n * 3 * d.channels).map(|_| rnd()).collect();
        let dout: Vec<f64> = (0..n * d.channels).map(|_| rnd()).collect();
        let mut o = vec![0.0; n * d.channels];
        c::attention::attention_forward(&qkv, &mut o, &d).expect("cpu attention forward");
        let o_used: Vec<f64> = o.iter().map(|v| v + 0.01 * rnd()).collect();
        let mut r = vec![0.0; qkv.len()];
        c::attention::attention_backward(&dout, &qkv, &mut r, &d).expect("cpu attention backward");
        // Exact O: the first-principles backward is the reference itself.
        let exact = brute_backward(&qkv, &dout, &o, &d);
        assert!(r.iter().zip(&exact).all(|(a, b)| (a - b).abs() < 1e-12));
        delta_from_o16(&mut r, &qkv, &dout, &o_used, &o, &d);
        let want = brute_backward(&qkv, &dout, &o_used, &d);
        let worst = r
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(worst < 1e-12, "worst {worst}");
        // And the perturbation did move the gradient (the check can fail).
        assert!(r.iter().zip(&exact).any(|(a, b)| (a - b).abs() > 1e-4));
    }
}
