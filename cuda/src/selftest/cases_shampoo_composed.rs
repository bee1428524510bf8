//! Self-test cases of Shampoo's composed step on the CUDA engine (`--skip-rule
//! shampoo-update`: plan ops `ShampooFactorUpdate`, `ShampooPrecondition`, `Graft`, with the
//! generated element-wise rules between them) against the CPU engine's functions
//! (`optim::shampoo_factor_update`, `optim::shampoo_precondition`, `optim::graft`) in float64
//! on the same f32-rounded inputs, on the awkward blockings of `cases_shampoo`: uneven matrix
//! blocks (`[37, 23]` under `B = 16`), a merged vector (`[100]`, `[1, 50]`), a merged 3-d shape
//! (`[3, 4, 5]`), and (full runs only) `[300, 200]` under `B = 128`. The factor update at `t =
//! 1` with `β₂ = 1` (a running sum) and at `t = 3` with `β₂ = 0.99` (bias-corrected storage);
//! grafting at `t = 1` (the graft itself) and `t = 3`. Norm-wise relative error against
//! [`TOL_F32`].
use super::cases::{case, one};
use super::{cpu, rel_err, wide, Case, Ctx, Outcome, TOL_F32};
use crate::error::Result;
use crate::ops::shampoo as gsh;
use crate::Buf;
use schedule::blocking::{blocks, Block};

const SHAPES: [(&[usize], usize, bool); 5] = [
    (&[37, 23], 16, false),
    (&[100], 16, false),
    (&[1, 50], 16, false),
    (&[3, 4, 5], 16, false),
    (&[300, 200], 128, true),
];

pub(crate) fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for (shape, b, big) in SHAPES {
        for (t, beta2) in [(1u64, 1.0), (3, 0.99)] {
            let size = format!("{shape:?} B={b} t={t} b2={beta2}");
            v.push(case(
                "shampoo_factor_update",
                size,
                TOL_F32,
                big,
                move |cx| factor_update(cx, shape, b, t, beta2),
            ));
        }
        let size = format!("{shape:?} B={b}");
        v.push(case(
            "shampoo_precondition",
            size,
            TOL_F32,
            big,
            move |cx| precondition(cx, shape, b),
        ));
        for t in [1u64, 3] {
            let size = format!("{shape:?} B={b} t={t}");
            v.push(case("graft", size, TOL_F32, big, move |cx| {
                graft(cx, shape, b, t)
            }));
        }
    }
    v
}

/// The sides of `shape`'s blocks under `b`, and its element count.
fn sides(shape: &[usize], b: usize) -> (Vec<usize>, usize) {
    let ((vm, vn), blks) = blocks(shape, b);
    (blks.iter().flat_map(Block::sides).collect(), vm * vn)
}

/// Random symmetric `[d, d]` matrices, one per side.
fn symmetric(cx: &mut Ctx<'_>, sides: &[usize], scale: f32) -> Vec<Vec<f32>> {
    sides
        .iter()
        .map(|&d| {
            let a = cx.normal(d * d, 0.0, 1.0);
            (0..d * d)
                .map(|k| scale * 0.5 * (a[k] + a[(k % d) * d + k / d]) / (d as f32).sqrt())
                .collect()
        })
        .collect()
}

fn up_all(cx: &mut Ctx<'_>, mats: &[Vec<f32>]) -> Result<Vec<Buf>> {
    mats.iter().map(|m| cx.up(m)).collect()
}

fn factor_update(
    cx: &mut Ctx<'_>,
    shape: &[usize],
    b: usize,
    t: u64,
    beta2: f64,
) -> Result<Outcome> {
    let (sides, numel) = sides(shape, b);
    let g = cx.normal(numel, 0.0, 1.0);
    let factors = symmetric(cx, &sides, 4.0);
    let (gb, fbs) = (cx.up(&g)?, up_all(cx, &factors)?);
    let fr: Vec<&Buf> = fbs.iter().collect();
    let ms = cx.timed(|| {
        gsh::shampoo_factor_update(cx.dev, t, (beta2, true), (shape, b as u64), &gb, &fr)
    })?;
    let mut rf: Vec<Vec<f64>> = factors.iter().map(|f| wide(f)).collect();
    {
        let mut fs: Vec<&mut [f64]> = rf.iter_mut().map(|f| f.as_mut_slice()).collect();
        optim::shampoo_factor_update(t, (beta2, true), (shape, b), &wide(&g), &mut fs)
            .map_err(cpu)?;
    }
    let mut gpu = Vec::new();
    for f in &fbs {
        gpu.extend(cx.down(f)?);
    }
    Ok(one("factors", rel_err(&gpu, &rf.concat()), ms))
}

fn precondition(cx: &mut Ctx<'_>, shape: &[usize], b: usize) -> Result<Outcome> {
    let (sides, numel) = sides(shape, b);
    let x = cx.normal(numel, 0.0, 1.0);
    let roots = symmetric(cx, &sides, 1.0);
    let (xb, out, rbs) = (cx.up(&x)?, cx.out(numel)?, up_all(cx, &roots)?);
    let scratch = cx.out(gsh::shampoo_precondition_scratch_len(shape, b as u64).max(1))?;
    let rr: Vec<&Buf> = rbs.iter().collect();
    let ms = cx
        .timed(|| gsh::shampoo_precondition(cx.dev, (shape, b as u64), &xb, &out, &rr, &scratch))?;
    let r64: Vec<Vec<f64>> = roots.iter().map(|r| wide(r)).collect();
    let rs: Vec<&[f64]> = r64.iter().map(|r| r.as_slice()).collect();
    let reference = optim::shampoo_precondition((shape, b), &wide(&x), &rs).map_err(cpu)?;
    Ok(one("out", rel_err(&cx.down(&out)?, &reference), ms))
}

fn graft(cx: &mut Ctx<'_>, shape: &[usize], b: usize, t: u64) -> Result<Outcome> {
    let (_, numel) = sides(shape, b);
    let x = cx.normal(numel, 0.0, 3.0);
    let g = cx.normal(numel, 0.0, 0.2);
    let (xb, gb, out) = (cx.up(&x)?, cx.up(&g)?, cx.out(numel)?);
    let scratch = cx.out(gsh::graft_scratch_len(shape, b as u64))?;
    let ms = cx.timed(|| gsh::graft(cx.dev, t, (shape, b as u64), &xb, &gb, &out, &scratch))?;
    let reference = optim::graft(t, (shape, b), &wide(&x), &wide(&g)).map_err(cpu)?;
    Ok(one("out", rel_err(&cx.down(&out)?, &reference), ms))
}
