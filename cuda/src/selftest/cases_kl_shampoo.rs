//! Self-test cases of KL-Shampoo's parameter update (`ops::kl_shampoo::kl_shampoo_update`, plan
//! op `KlShampooUpdate`) against `optim::kl_shampoo_update` in float64 on the same (f32-rounded)
//! inputs, at awkward sizes, with both bases, one of them or none (a missing basis is the
//! identity and that side has no factor, as the plan builds it):
//!
//! - `t = 1`, the initialisation: the factors `(1 − β)/n·G Gᵀ`, `(1 − β)/m·Gᵀ G` over random
//!   previous contents, the estimates set to `init_factor`, parameter and momentum unchanged;
//! - `t = 3`, an update from a warm state (random orthonormal bases from the QR of a Gaussian
//!   matrix, positive random estimates, random symmetric factors, random momentum), with and
//!   without `normalize_grads` (with a basis and without it, the last projection GEMM applies
//!   the step through α/β, so both apply paths are covered);
//! - `clamp`: estimates and a gradient so small that the estimate EMAs fall below the clamp
//!   `1/c²` for some entries (`optim::kl_eig_floor`).
//!
//! Outputs: the parameter change (so the rounding of the parameter itself does not hide a
//! wrong update), the momentum, each factor and both estimates, norm-wise relative error
//! against [`TOL_F32`].
use super::cases::case;
use super::cases_optim::{delta, delta64, orthogonal};
use super::{cpu, rel_err, wide, Case, Ctx, Outcome, TOL_F32};
use crate::error::Result;
use crate::ops::kl_shampoo::{self as gkl, KlSide};
use schedule::KlShampooHyper;

/// One configuration: `[m, n]`, which bases (and so factors) exist, estimates small enough for
/// the clamp, and whether it is a full-run-only size.
#[derive(Clone, Copy)]
struct Config {
    m: usize,
    n: usize,
    left: bool,
    right: bool,
    clamp: bool,
    big: bool,
}

pub(crate) fn cases() -> Vec<Case> {
    let c = |m, n, left, right| Config {
        m,
        n,
        left,
        right,
        clamp: false,
        big: false,
    };
    let configs = [
        c(7, 13, true, true),
        c(33, 5, true, true),
        c(64, 64, true, true),
        // One-sided: the left side unpreconditioned (identity basis, no factor), and the reverse.
        c(33, 5, false, true),
        c(7, 13, true, false),
        // Both sides unpreconditioned: a diagonal (Kronecker) preconditioner.
        c(7, 13, false, false),
        Config {
            clamp: true,
            ..c(13, 7, true, true)
        },
        Config {
            big: true,
            ..c(783, 50, true, true)
        },
    ];
    let mut v = Vec::new();
    for cfg in configs {
        for (t, normalize) in [(1u64, false), (3, false), (3, true)] {
            let size = format!(
                "[{}, {}] Q_L={} Q_R={} t={t} norm={}{}",
                cfg.m,
                cfg.n,
                cfg.left as u8,
                cfg.right as u8,
                normalize as u8,
                if cfg.clamp { " clamp" } else { "" }
            );
            v.push(case(
                "kl_shampoo_update",
                size,
                TOL_F32,
                cfg.big,
                move |cx| update(cx, cfg, t, normalize),
            ));
        }
    }
    v
}

/// A random symmetric `[d, d]` matrix (a previous factor: the EMA only scales it).
fn symmetric(cx: &mut Ctx<'_>, d: usize) -> Vec<f32> {
    let a = cx.normal(d * d, 0.0, 1.0);
    (0..d * d)
        .map(|k| 0.5 * (a[k] + a[(k % d) * d + k / d]))
        .collect()
}

fn update(cx: &mut Ctx<'_>, cfg: Config, t: u64, normalize: bool) -> Result<Outcome> {
    let Config {
        m,
        n,
        left,
        right,
        clamp,
        ..
    } = cfg;
    let hp = KlShampooHyper {
        lr: 0.0,
        beta1: 0.9,
        shampoo_beta: 0.95,
        eps: 1e-8,
        weight_decay: 0.01,
        init_factor: 0.1,
        max_clamp_value: 4000.0,
        normalize_grads: normalize,
    };
    // Large enough that the parameter change stands out of the parameter's own f32 rounding.
    let lr = 0.5;
    let mn = m * n;
    let p = cx.normal(mn, 0.0, 1.0);
    let g = cx.normal(mn, 0.0, if clamp { 1e-3 } else { 1.0 });
    let ea = cx.normal(mn, 0.0, 0.3);
    // Estimates: warm and positive, or around the clamp 1/c² (1/169 and 1/100 at [13, 7]).
    let (lo, hi) = if clamp { (1e-4, 2e-2) } else { (0.05, 2.0) };
    let (dl, dr) = (cx.uniform(m, lo, hi), cx.uniform(n, lo, hi));
    let ql = left.then(|| orthogonal(cx, m)).transpose()?;
    let qr = right.then(|| orthogonal(cx, n)).transpose()?;
    let fl = left.then(|| symmetric(cx, m));
    let fr = right.then(|| symmetric(cx, n));

    let (pb, gb, eb) = (cx.up(&p)?, cx.up(&g)?, cx.up(&ea)?);
    let (dlb, drb) = (cx.up(&dl)?, cx.up(&dr)?);
    let qlb = ql.as_deref().map(|q| cx.up(q)).transpose()?;
    let qrb = qr.as_deref().map(|q| cx.up(q)).transpose()?;
    let flb = fl.as_deref().map(|f| cx.up(f)).transpose()?;
    let frb = fr.as_deref().map(|f| cx.up(f)).transpose()?;
    let scratch = cx.out(gkl::kl_shampoo_update_scratch_len(m, n, left, right))?;
    let ms = cx.timed(|| {
        gkl::kl_shampoo_update(
            cx.dev,
            t,
            lr,
            &hp,
            &pb,
            &gb,
            &eb,
            KlSide {
                factor: flb.as_ref(),
                basis: qlb.as_ref(),
                eig: &dlb,
            },
            KlSide {
                factor: frb.as_ref(),
                basis: qrb.as_ref(),
                eig: &drb,
            },
            m,
            n,
            &scratch,
        )
    })?;

    let params = optim::KlShampooParams {
        beta1: hp.beta1,
        shampoo_beta: hp.shampoo_beta,
        eps: hp.eps,
        weight_decay: hp.weight_decay,
        precondition_frequency: 0,
        init_factor: hp.init_factor,
        max_clamp_value: hp.max_clamp_value,
        normalize_grads: hp.normalize_grads,
    };
    let (mut rp, mut re, mut rdl, mut rdr) = (wide(&p), wide(&ea), wide(&dl), wide(&dr));
    let (mut rfl, mut rfr) = (fl.as_deref().map(wide), fr.as_deref().map(wide));
    let (ql64, qr64) = (ql.as_deref().map(wide), qr.as_deref().map(wide));
    optim::kl_shampoo_update(
        t,
        &params,
        lr,
        &mut rp,
        &wide(&g),
        &mut re,
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
        m,
        n,
    )
    .map_err(cpu)?;

    let mut errs = vec![
        (
            "param delta",
            rel_err(&delta(&cx.down(&pb)?, &p), &delta64(&rp, &p)),
        ),
        ("exp_avg", rel_err(&cx.down(&eb)?, &re)),
        ("eig_left", rel_err(&cx.down(&dlb)?, &rdl)),
        ("eig_right", rel_err(&cx.down(&drb)?, &rdr)),
    ];
    for (name, gpu, reference) in [("factor_left", &flb, &rfl), ("factor_right", &frb, &rfr)] {
        if let (Some(b), Some(r)) = (gpu, reference) {
            errs.push((name, rel_err(&cx.down(b)?, r)));
        }
    }
    Ok(Outcome { errs, gpu_ms: ms })
}
