//! Self-test cases of KL-Shampoo's composed step on the CUDA engine (`--skip-rule
//! kl-shampoo-update`: plan ops `KlScale` and `KlFactorUpdate` around `project` and the
//! generated rule kernels) against `optim::kl_scale` and `optim::kl_factor_update` in float64
//! on the same f32-rounded inputs, at the awkward sizes of `cases_kl_shampoo` with both bases,
//! one or none: the factor update at `t = 1` (initialisation over random previous contents)
//! and `t = 3` (warm state: orthonormal bases, positive estimates, symmetric factors; and
//! estimates around the clamp `1/c²`), the scale at `t = 1` (zero) and `t = 3`. Outputs: each
//! factor and both estimates, or the scaled matrix; norm-wise relative error against
//! [`TOL_F32`].
use super::cases::{case, one};
use super::cases_optim::orthogonal;
use super::{cpu, rel_err, wide, Case, Ctx, Outcome, TOL_F32};
use crate::error::Result;
use crate::ops::kl_shampoo::{self as gkl, FactorHyper, KlSide};

/// `[m, n]`, which bases (and so factors) exist, clamp-sized estimates, full runs only.
type Config = (usize, usize, bool, bool, bool, bool);

const CONFIGS: [Config; 6] = [
    (7, 13, true, true, false, false),
    (33, 5, false, true, false, false),
    (7, 13, true, false, false, false),
    (7, 13, false, false, false, false),
    (13, 7, true, true, true, false),
    (783, 50, true, true, false, true),
];

const HP: FactorHyper = FactorHyper {
    shampoo_beta: 0.95,
    init_factor: 0.1,
    max_clamp_value: 4000.0,
};

pub(crate) fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for cfg in CONFIGS {
        let (m, n, l, r, clamp, big) = cfg;
        for t in [1u64, 3] {
            let size = format!(
                "[{m}, {n}] Q_L={} Q_R={} t={t}{}",
                l as u8,
                r as u8,
                if clamp { " clamp" } else { "" }
            );
            v.push(case(
                "kl_factor_update",
                size.clone(),
                TOL_F32,
                big,
                move |cx| factor_update(cx, cfg, t),
            ));
            if !clamp && l == r {
                v.push(case("kl_scale", size, TOL_F32, big, move |cx| {
                    scale(cx, cfg, t)
                }));
            }
        }
    }
    v
}

/// Positive estimates of both sides: warm, or around the clamp.
fn estimates(cx: &mut Ctx<'_>, (m, n, _, _, clamp, _): Config) -> (Vec<f32>, Vec<f32>) {
    let (lo, hi) = if clamp { (1e-4, 2e-2) } else { (0.05, 2.0) };
    (cx.uniform(m, lo, hi), cx.uniform(n, lo, hi))
}

fn symmetric(cx: &mut Ctx<'_>, d: usize) -> Vec<f32> {
    let a = cx.normal(d * d, 0.0, 1.0);
    (0..d * d)
        .map(|k| 0.5 * (a[k] + a[(k % d) * d + k / d]))
        .collect()
}

fn factor_update(cx: &mut Ctx<'_>, cfg: Config, t: u64) -> Result<Outcome> {
    let (m, n, left, right, clamp, _) = cfg;
    let g = cx.normal(m * n, 0.0, if clamp { 1e-3 } else { 1.0 });
    let (dl, dr) = estimates(cx, cfg);
    let ql = left.then(|| orthogonal(cx, m)).transpose()?;
    let qr = right.then(|| orthogonal(cx, n)).transpose()?;
    let fl = left.then(|| symmetric(cx, m));
    let fr = right.then(|| symmetric(cx, n));
    let (gb, dlb, drb) = (cx.up(&g)?, cx.up(&dl)?, cx.up(&dr)?);
    let qlb = ql.as_deref().map(|q| cx.up(q)).transpose()?;
    let qrb = qr.as_deref().map(|q| cx.up(q)).transpose()?;
    let flb = fl.as_deref().map(|f| cx.up(f)).transpose()?;
    let frb = fr.as_deref().map(|f| cx.up(f)).transpose()?;
    let scratch = cx.out(gkl::kl_factor_update_scratch_len(m, n, left, right))?;
    let side = |factor, basis, eig| KlSide { factor, basis, eig };
    let ms = cx.timed(|| {
        gkl::kl_factor_update(
            cx.dev,
            t,
            &HP,
            &gb,
            side(flb.as_ref(), qlb.as_ref(), &dlb),
            side(frb.as_ref(), qrb.as_ref(), &drb),
            m,
            n,
            &scratch,
        )
    })?;
    let params = optim::KlShampooParams {
        beta1: 0.9,
        shampoo_beta: HP.shampoo_beta,
        eps: 1e-8,
        weight_decay: 0.0,
        precondition_frequency: 0,
        init_factor: HP.init_factor,
        max_clamp_value: HP.max_clamp_value,
        normalize_grads: false,
    };
    let (mut rdl, mut rdr) = (wide(&dl), wide(&dr));
    let (mut rfl, mut rfr) = (fl.as_deref().map(wide), fr.as_deref().map(wide));
    let (ql64, qr64) = (ql.as_deref().map(wide), qr.as_deref().map(wide));
    optim::kl_factor_update(
        t,
        &params,
        &wide(&g),
        (
            optim::KlSide {
                factor: rfl.as_deref_mut(),
                basis: ql64.as_deref(),
                eig: &mut rdl,
            },
            optim::KlSide {
                factor: rfr.as_deref_mut(),
                basis: qr64.as_deref(),
                eig: &mut rdr,
            },
        ),
        m,
        n,
    )
    .map_err(cpu)?;
    let mut errs = vec![
        ("eig_left", rel_err(&cx.down(&dlb)?, &rdl)),
        ("eig_right", rel_err(&cx.down(&drb)?, &rdr)),
    ];
    if let (Some(b), Some(r)) = (&flb, &rfl) {
        errs.push(("factor_left", rel_err(&cx.down(b)?, r)));
    }
    if let (Some(b), Some(r)) = (&frb, &rfr) {
        errs.push(("factor_right", rel_err(&cx.down(b)?, r)));
    }
    Ok(Outcome { errs, gpu_ms: ms })
}

fn scale(cx: &mut Ctx<'_>, cfg: Config, t: u64) -> Result<Outcome> {
    let (m, n, ..) = cfg;
    let x = cx.normal(m * n, 0.0, 1.0);
    let (dl, dr) = estimates(cx, cfg);
    let (xb, out, dlb, drb) = (cx.up(&x)?, cx.out(m * n)?, cx.up(&dl)?, cx.up(&dr)?);
    let scratch = cx.out(gkl::kl_scale_scratch_len(m, n))?;
    let ms =
        cx.timed(|| gkl::kl_scale(cx.dev, t, 1e-8, &xb, &out, (&dlb, &drb), m, n, &scratch))?;
    let reference =
        optim::kl_scale(t, 1e-8, &wide(&x), (&wide(&dl), &wide(&dr)), m, n).map_err(cpu)?;
    Ok(one("out", rel_err(&cx.down(&out)?, &reference), ms))
}
