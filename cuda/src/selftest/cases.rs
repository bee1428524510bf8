//! Self-test cases of the model, attention, loss, GEMM and elementwise launchers.
use super::{cpu, rel_err, wide, Case, Ctx, Outcome, TOL_BF16, TOL_F32};
use crate::error::Result;
use crate::gemm::Dims;
use crate::memory::{Buf, Elem};
use crate::ops::nn as g;
use crate::ops::norm as gn;
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
    super::cases_attention::attention(&mut v);
    super::cases_attention::flash_attention(&mut v);
    super::cases_loss::cross_entropy(&mut v);
    super::cases_loss::matmul(&mut v);
    v
}

fn embedding(v: &mut Vec<Case>) {
    for (vocab, ch, n, big) in [
        (50, 3, 783, false),
        (7, 1025, 5003, false),
        (50257, 783, 4096, true),
    ] {
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
            let span = cx.out(g::embedding_backward_scratch_len(vocab))?;
            let ms = cx.timed(|| g::embedding_backward(cx.dev, &db, &ib, &tb, vocab, ch, &span))?;
            let mut r = vec![0.0; vocab * ch];
            c::embedding::embedding_backward(&wide(&dout), &ids, &mut r, vocab, ch).map_err(cpu)?;
            // Bitwise reproducible: a second run gives the same bits.
            let first = cx.down(&tb)?;
            g::embedding_backward(cx.dev, &db, &ib, &tb, vocab, ch, &span)?;
            let same = first
                .iter()
                .zip(&cx.down(&tb)?)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            let err = if same { rel_err(&first, &r) } else { 1.0 };
            Ok(one("dtable", err, ms))
        }));
    }
    v.push(case(
        "embedding_bad_id",
        "V=50 C=3 N=50, id 50 at row 17, -1 at 31; forward and backward".into(),
        0.0,
        false,
        |cx| {
            let table = cx.normal(50 * 3, 0.0, 1.0);
            let mut ids = cx.ids(50, 50);
            ids[17] = 50;
            ids[31] = -1;
            let (tb, ib, ob) = (cx.up(&table)?, cx.up(&ids)?, cx.out(50 * 3)?);
            let report = |cx: &Ctx| {
                let reported = matches!(
                    cx.dev.take_status(),
                    Err(crate::CudaError::IndexOutOfRange { position: 17 })
                );
                reported && cx.dev.take_status().is_ok()
            };
            g::embedding_forward(cx.dev, &tb, &ib, &ob, 50, 3)?;
            let forward = report(cx);
            // The backward skips both rows and reports the first, too.
            let (dt, span) = (
                cx.out(50 * 3)?,
                cx.out(g::embedding_backward_scratch_len(50))?,
            );
            g::embedding_backward(cx.dev, &ob, &ib, &dt, 50, 3, &span)?;
            let backward = report(cx);
            Ok(one(
                "status",
                if forward && backward { 0.0 } else { 1.0 },
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
/// (see `ops::norm`): rows of `c ≤ 2048` take the fused warp-per-row backward (8, 16, 24, 32 or
/// 64 values a lane; dweight/dbias partials of `min(⌈N / 16⌉, 512)` slabs in the same pass), wider
/// rows the block-per-row dx and a column-sum pass over `min(⌈N / 64⌉, 64)` slabs; the
/// partials are then added in slab order. Outputs and scratch NaN-poisoned; the backward runs
/// twice and must give the same bits.
fn layer_norm_cases(v: &mut Vec<Case>, n: usize, ch: usize, bias: bool, big: bool) {
    let size = format!("N={n} C={ch}{}", if bias { "" } else { " no-bias" });
    let eps = 1e-5;
    // The f32 output, and (warp-per-row widths) the bf16 one the engine writes for outputs
    // only GEMMs read.
    for (name, elem, tol) in [
        ("layer_norm", Elem::F32, TOL_F32),
        ("layer_norm_bf16", Elem::BF16, TOL_BF16),
    ] {
        if elem == Elem::BF16 && ch > gn::LAYERNORM_WARP_MAX_C {
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
                Elem::BF16 => gn::layernorm_forward_bf16(cx.dev, &xb, &wb, bias_b, &ob, ch, eps),
                _ => gn::layernorm_forward(cx.dev, &xb, &wb, bias_b, &ob, ch, eps),
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
            let sb = cx.out(gn::layernorm_backward_scratch_len(n, ch))?;
            let dbias = bias.then_some(&dbb);
            let ms = cx.timed(|| {
                gn::layernorm_backward(cx.dev, &gb, &xb, &wb, &dxb, &dwb, dbias, ch, eps, &sb)
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
            let first = [cx.down(&dxb)?, cx.down(&dwb)?, cx.down(&dbb)?];
            // Bitwise reproducible: a second run gives the same bits (an error of 1 otherwise).
            gn::layernorm_backward(cx.dev, &gb, &xb, &wb, &dxb, &dwb, dbias, ch, eps, &sb)?;
            let second = [cx.down(&dxb)?, cx.down(&dwb)?, cx.down(&dbb)?];
            let same = first
                .iter()
                .zip(&second)
                .all(|(a, b)| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()));
            let check = |got: &[f32], want: &[f64]| if same { rel_err(got, want) } else { 1.0 };
            let mut errs = vec![
                ("dx", check(&first[0], &dx)),
                ("dweight", check(&first[1], &dw)),
            ];
            if bias {
                errs.push(("dbias", check(&first[2], &db)));
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
            let ms = cx.timed(|| gn::rmsnorm_forward(cx.dev, &xb, &wb, &ob, ch, eps))?;
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
                let ms = cx.timed(|| gn::rmsnorm_forward(cx.dev, &xb, &wb, &ob, ch, eps))?;
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
            let sb = cx.out(gn::rmsnorm_backward_scratch_len(n, ch))?;
            let ms =
                cx.timed(|| gn::rmsnorm_backward(cx.dev, &gb, &xb, &wb, &dxb, &dwb, ch, eps, &sb))?;
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

/// A device operand of `n` values drawn N(mean, std²), f32 or bf16, and the values the kernel
/// reads (rounded to bf16 for a bf16 operand): the reference computes from those.
fn operand(cx: &mut Ctx<'_>, n: usize, mean: f64, std: f64, bf16: bool) -> Result<(Buf, Vec<f32>)> {
    let x = cx.normal(n, mean, std);
    let x32 = cx.up(&x)?;
    if !bf16 {
        return Ok((x32, x));
    }
    let xb = cx.raw(Elem::BF16, n)?;
    crate::gemm::cast_f32_to_bf16(cx.dev, &x32, &xb)?;
    Ok((xb, x.iter().map(|&v| schedule::round_to_bf16(v)).collect()))
}

/// An output of `n` values, f32 (NaN-filled) or bf16.
fn result(cx: &mut Ctx<'_>, n: usize, bf16: bool) -> Result<Buf> {
    if bf16 {
        cx.raw(Elem::BF16, n)
    } else {
        cx.out(n)
    }
}

/// The values of an output made by [`result`].
fn read(cx: &Ctx<'_>, b: &Buf, bf16: bool) -> Result<Vec<f32>> {
    if bf16 {
        down_bf16(cx, b)
    } else {
        cx.down(b)
    }
}

/// GELU and SwiGLU, forward and backward, in every dtype combination of their operands (the
/// plan's `bf16-output` makes GEMM outputs and GEMM-only inputs bf16; the size column names the
/// operands and their dtypes in order, `f` f32 and `b` bf16, as the kernel names do): against the CPU
/// engine's kernels in float64 on the values the GPU kernel read; a bf16 output at bf16
/// tolerance.
fn activations(v: &mut Vec<Case>) {
    const TWO: [&str; 4] = ["ff", "fb", "bf", "bb"];
    const THREE: [&str; 8] = ["fff", "ffb", "fbf", "fbb", "bff", "bfb", "bbf", "bbb"];
    let tol = |bf16_out: bool| if bf16_out { TOL_BF16 } else { TOL_F32 };
    for (n, big) in [(3, false), (783 * 50, false), (4096 * 783, true)] {
        let size = format!("n={n}");
        for (i, dt) in TWO.into_iter().enumerate() {
            let (xh, oh) = (i & 2 != 0, i & 1 != 0);
            let size = format!("{size} x,out {dt}");
            v.push(case("gelu", size, tol(oh), big, move |cx| {
                let (xb, x) = operand(cx, n, 0.0, 3.0, xh)?;
                let ob = result(cx, n, oh)?;
                let ms = cx.timed(|| g::gelu_forward(cx.dev, &xb, &ob))?;
                let mut r = vec![0.0; n];
                c::elementwise::gelu(&wide(&x), &mut r).map_err(cpu)?;
                Ok(one("out", rel_err(&read(cx, &ob, oh)?, &r), ms))
            }));
        }
        for (i, dt) in THREE.into_iter().enumerate() {
            let (dh, xh, oh) = (i & 4 != 0, i & 2 != 0, i & 1 != 0);
            let size = format!("{size} dout,x,dx {dt}");
            v.push(case("gelu_backward", size, tol(oh), big, move |cx| {
                let (xb, x) = operand(cx, n, 0.0, 3.0, xh)?;
                let (gb, dout) = operand(cx, n, 0.0, 1.0, dh)?;
                let ob = result(cx, n, oh)?;
                let ms = cx.timed(|| g::gelu_backward(cx.dev, &gb, &xb, &ob))?;
                let mut r = vec![0.0; n];
                c::elementwise::gelu_backward(&wide(&dout), &wide(&x), &mut r).map_err(cpu)?;
                Ok(one("dx", rel_err(&read(cx, &ob, oh)?, &r), ms))
            }));
        }
    }
    for (rows, f, big) in [(3, 50, false), (50, 783, false), (783, 4096, true)] {
        let size = format!("N={rows} F={f}");
        for (i, dt) in TWO.into_iter().enumerate() {
            let (xh, oh) = (i & 2 != 0, i & 1 != 0);
            let size = format!("{size} x,out {dt}");
            v.push(case("swi_glu", size, tol(oh), big, move |cx| {
                let (xb, x) = operand(cx, rows * 2 * f, 0.0, 3.0, xh)?;
                let ob = result(cx, rows * f, oh)?;
                let ms = cx.timed(|| g::swiglu_forward(cx.dev, &xb, &ob, f))?;
                let mut r = vec![0.0; rows * f];
                c::elementwise::swiglu(&wide(&x), &mut r, f).map_err(cpu)?;
                Ok(one("out", rel_err(&read(cx, &ob, oh)?, &r), ms))
            }));
        }
        for (i, dt) in THREE.into_iter().enumerate() {
            let (dh, xh, oh) = (i & 4 != 0, i & 2 != 0, i & 1 != 0);
            let size = format!("{size} dout,x,dx {dt}");
            v.push(case("swi_glu_backward", size, tol(oh), big, move |cx| {
                let (xb, x) = operand(cx, rows * 2 * f, 0.0, 3.0, xh)?;
                let (gb, dout) = operand(cx, rows * f, 0.0, 1.0, dh)?;
                let ob = result(cx, rows * 2 * f, oh)?;
                let ms = cx.timed(|| g::swiglu_backward(cx.dev, &gb, &xb, &ob, f))?;
                let mut r = vec![0.0; rows * 2 * f];
                c::elementwise::swiglu_backward(&wide(&dout), &wide(&x), &mut r, f).map_err(cpu)?;
                Ok(one("dx", rel_err(&read(cx, &ob, oh)?, &r), ms))
            }));
        }
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
    // bf16 x (GPT's c_fc bias gradient): fp32 sums of the bf16 values, four columns a thread
    // where C is a multiple of 4.
    let size = format!("N={n} C={ch} x bf16");
    v.push(case("sum_rows", size, TOL_F32, big, move |cx| {
        let (xb, x) = operand(cx, n * ch, 0.3, 1.0, true)?;
        let ob = cx.out(ch)?;
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
        // The bf16 output (a rotated qkv that only the tensor-core attention reads): against
        // the CPU engine, and bit for bit the f32 kernel's result rounded to nearest even (the
        // copy the attention would otherwise make).
        v.push(case("rope_bf16", size.clone(), TOL_BF16, big, move |cx| {
            let x = cx.normal(rows * width, 0.0, 1.0);
            let xb = cx.up(&x)?;
            let (o32, o16) = (cx.out(rows * width)?, cx.raw(Elem::BF16, rows * width)?);
            let sb = cx.out(g::rope_scratch_len(seq_len, head_dim))?;
            g::rope_forward(cx.dev, &xb, &o32, &gd, &sb)?;
            let ms = cx.timed(|| g::rope_forward(cx.dev, &xb, &o16, &gd, &sb))?;
            let mut r = vec![0.0; rows * width];
            c::rope::rope_forward(&wide(&x), &mut r, &cd).map_err(cpu)?;
            let got = down_bf16(cx, &o16)?;
            let same = cx
                .down(&o32)?
                .iter()
                .zip(&got)
                .all(|(&f, &b)| half::bf16::from_f32(f).to_f32().to_bits() == b.to_bits());
            Ok(Outcome {
                errs: vec![
                    ("out", rel_err(&got, &r)),
                    (
                        "bits of the rounded f32 kernel",
                        if same { 0.0 } else { f64::INFINITY },
                    ),
                ],
                gpu_ms: ms,
            })
        }));
        // The backward's bf16 dx (LLaMA's qkv gradient, read only by bf16 GEMMs).
        v.push(case(
            "rope_backward",
            format!("{size} dx bf16"),
            TOL_BF16,
            big,
            move |cx| {
                let x = cx.normal(rows * width, 0.0, 1.0);
                let xb = cx.up(&x)?;
                let o16 = cx.raw(Elem::BF16, rows * width)?;
                let sb = cx.out(g::rope_scratch_len(seq_len, head_dim))?;
                let ms = cx.timed(|| g::rope_backward(cx.dev, &xb, &o16, &gd, &sb))?;
                let mut r = vec![0.0; rows * width];
                c::rope::rope_backward(&wide(&x), &mut r, &cd).map_err(cpu)?;
                Ok(one("dx", rel_err(&down_bf16(cx, &o16)?, &r), ms))
            },
        ));
    }
}

/// The CPU engine's matmul geometry of a GPU one (same rows and columns).
pub(super) fn cpu_dims(d: Dims) -> c::matmul::Dims {
    c::matmul::Dims {
        rows: d.rows,
        cols: d.cols,
    }
}
