//! Self-test cases of Shampoo's parameter update (`ops::shampoo::shampoo_update`, plan op
//! `ShampooUpdate`) against `optim::shampoo_update` in float64 on the same (f32-rounded)
//! inputs, on awkward blockings (`schedule::blocking::blocks`):
//!
//! - `[37, 23]` under `B = 16`: six uneven matrix blocks (16/16/5 rows × 16/7 columns);
//! - `[100]` under `B = 16`: a merged vector, seven one-sided blocks (the last of 4);
//! - `[1, 50]` under `B = 16`: a row, merged to the vector `[50]`;
//! - `[3, 4, 5]` under `B = 16`: merged to `[12, 5]`, one matrix block;
//! - `[64, 40]` under `B = 32`, and (full runs only) `[300, 200]` under `B = 128`;
//!
//! each with and without Adam grafting, at `t = 1` (with grafting: the Adam step alone) and
//! `t = 3` from a warm state (random symmetric factors and roots, random moments, positive
//! grafting second moment), with `β₂ = 1` (a running sum) and `β₂ = 0.99` (bias-corrected
//! factors), plus `β₁ = 0` (no first moment: `Ḡ = G`) and no bias correction on `[37, 23]`.
//!
//! Outputs: the parameter change (so the rounding of the parameter itself does not hide a
//! wrong update), the first moment, the grafting second moment and every factor (all sides of
//! all blocks concatenated), norm-wise relative error against [`TOL_F32`].
use super::cases::case;
use super::cases_optim::{delta, delta64};
use super::{cpu, rel_err, wide, Case, Ctx, Outcome, TOL_F32};
use crate::error::Result;
use crate::ops::shampoo as gsh;
use schedule::blocking::{blocks, Block};
use schedule::ShampooHyper;

/// One configuration.
#[derive(Clone, Copy)]
struct Config {
    shape: &'static [usize],
    b: usize,
    grafting: bool,
    t: u64,
    beta1: f64,
    beta2: f64,
    bias_correction: bool,
    big: bool,
}

pub(crate) fn cases() -> Vec<Case> {
    let shapes: [(&'static [usize], usize, bool); 6] = [
        (&[37, 23], 16, false),
        (&[100], 16, false),
        (&[1, 50], 16, false),
        (&[3, 4, 5], 16, false),
        (&[64, 40], 32, false),
        (&[300, 200], 128, true),
    ];
    let mut configs = Vec::new();
    for (shape, b, big) in shapes {
        for grafting in [false, true] {
            for (t, beta2) in [(1u64, 1.0), (3, 1.0), (1, 0.99), (3, 0.99)] {
                configs.push(Config {
                    shape,
                    b,
                    grafting,
                    t,
                    beta1: 0.9,
                    beta2,
                    bias_correction: true,
                    big,
                });
            }
        }
    }
    for grafting in [false, true] {
        let base = Config {
            shape: &[37, 23],
            b: 16,
            grafting,
            t: 3,
            beta1: 0.9,
            beta2: 0.99,
            bias_correction: true,
            big: false,
        };
        configs.push(Config { beta1: 0.0, ..base });
        configs.push(Config {
            bias_correction: false,
            ..base
        });
    }
    configs
        .into_iter()
        .map(|cfg| {
            let size = format!(
                "{:?} B={} graft={} t={} b1={} b2={}{}",
                cfg.shape,
                cfg.b,
                cfg.grafting as u8,
                cfg.t,
                cfg.beta1,
                cfg.beta2,
                if cfg.bias_correction { "" } else { " no-bc" }
            );
            case("shampoo_update", size, TOL_F32, cfg.big, move |cx| {
                update(cx, cfg)
            })
        })
        .collect()
}

/// A random symmetric `[d, d]` matrix.
fn symmetric(cx: &mut Ctx<'_>, d: usize, scale: f32) -> Vec<f32> {
    let a = cx.normal(d * d, 0.0, 1.0);
    (0..d * d)
        .map(|k| scale * 0.5 * (a[k] + a[(k % d) * d + k / d]))
        .collect()
}

fn update(cx: &mut Ctx<'_>, cfg: Config) -> Result<Outcome> {
    let hp = ShampooHyper {
        lr: 0.0,
        beta1: cfg.beta1,
        beta2: cfg.beta2,
        epsilon: 1e-8,
        weight_decay: 0.01,
        use_bias_correction: cfg.bias_correction,
        max_preconditioner_dim: cfg.b as u64,
        grafting: cfg.grafting,
        grafting_beta2: 0.999,
        grafting_epsilon: 1e-8,
    };
    // Large enough that the parameter change stands out of the parameter's own f32 rounding.
    let lr = 0.5;
    let ((vm, vn), blks) = blocks(cfg.shape, cfg.b);
    let numel = vm * vn;
    let sides: Vec<usize> = blks.iter().flat_map(Block::sides).collect();
    let p = cx.normal(numel, 0.0, 1.0);
    let g = cx.normal(numel, 0.0, 1.0);
    let ea = cx.normal(numel, 0.0, 0.3);
    let v = cx.uniform(numel, 0.05, 2.0);
    let mut factors = Vec::with_capacity(sides.len());
    let mut roots = Vec::with_capacity(sides.len());
    for &d in &sides {
        factors.push(symmetric(cx, d, 1.0));
        // Roots of a moderate size, so that no block's step dwarfs the others.
        roots.push(symmetric(cx, d, 1.0 / (d as f32).sqrt()));
    }

    let (pb, gb, eb) = (cx.up(&p)?, cx.up(&g)?, cx.up(&ea)?);
    let vb = if cfg.grafting { Some(cx.up(&v)?) } else { None };
    let fbs = factors
        .iter()
        .map(|f| cx.up(f))
        .collect::<Result<Vec<_>>>()?;
    let rbs = roots.iter().map(|r| cx.up(r)).collect::<Result<Vec<_>>>()?;
    let scratch = cx.out(gsh::shampoo_update_scratch_len(
        cfg.shape,
        cfg.b,
        cfg.beta1 != 0.0,
        cfg.grafting,
    ))?;
    let (fr, rr): (Vec<&crate::Buf>, Vec<&crate::Buf>) =
        (fbs.iter().collect(), rbs.iter().collect());
    let ms = cx.timed(|| {
        gsh::shampoo_update(
            cx.dev,
            cfg.t,
            lr,
            &hp,
            &pb,
            &gb,
            &eb,
            vb.as_ref(),
            cfg.shape,
            &fr,
            &rr,
            &scratch,
        )
    })?;

    let params = optim::ShampooParams {
        beta1: hp.beta1,
        beta2: hp.beta2,
        epsilon: hp.epsilon,
        weight_decay: hp.weight_decay,
        max_preconditioner_dim: cfg.b,
        precondition_frequency: 1,
        start_preconditioning_step: None,
        use_bias_correction: hp.use_bias_correction,
        grafting: hp.grafting.then_some(optim::AdamGrafting {
            beta2: hp.grafting_beta2,
            epsilon: hp.grafting_epsilon,
        }),
    };
    let (mut rp, mut re, mut rv) = (wide(&p), wide(&ea), wide(&v));
    let mut rf: Vec<Vec<f64>> = factors.iter().map(|f| wide(f)).collect();
    let r64: Vec<Vec<f64>> = roots.iter().map(|r| wide(r)).collect();
    {
        let mut fs: Vec<&mut [f64]> = rf.iter_mut().map(|f| f.as_mut_slice()).collect();
        let rs: Vec<&[f64]> = r64.iter().map(|r| r.as_slice()).collect();
        optim::shampoo_update(
            cfg.t,
            &params,
            lr,
            &mut rp,
            &wide(&g),
            &mut re,
            cfg.grafting.then_some(rv.as_mut_slice()),
            cfg.shape,
            &mut fs,
            &rs,
        )
        .map_err(cpu)?;
    }

    let mut errs = vec![
        (
            "param delta",
            rel_err(&delta(&cx.down(&pb)?, &p), &delta64(&rp, &p)),
        ),
        ("exp_avg", rel_err(&cx.down(&eb)?, &re)),
    ];
    if let Some(vb) = &vb {
        errs.push(("graft_sq", rel_err(&cx.down(vb)?, &rv)));
    }
    let mut gpu_f = Vec::new();
    for b in &fbs {
        gpu_f.extend(cx.down(b)?);
    }
    let ref_f: Vec<f64> = rf.concat();
    errs.push(("factors", rel_err(&gpu_f, &ref_f)));
    Ok(Outcome { errs, gpu_ms: ms })
}
