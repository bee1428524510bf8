//! Self-test cases of Shampoo's GPU inverse root ([`GpuRefresher::compute_inverse_root`], plan
//! method `RefreshMethod::InverseRoot`: cuSOLVER `Ssyevd`, kernel `inverse_root_scale_cols`,
//! one fp32 GEMM) against `optim::refresh_compute_inverse_root` in float64 on the same
//! (f32-rounded) factor, at awkward sides (5, 33, 130; 1024 in full runs), each installed with
//! [`refresh::install_basis`] after [`refresh::verdict`] as the engine swaps it in:
//!
//! - `spd`: `F = U diag(λ) Uᵀ`, `λ` spread over `[0.5, 5]`, ε = 1e-8 (the bench specs'), roots
//!   r = 4 (a matrix block's side) and r = 2 (a vector block's), on the compute stream (the
//!   synchronous path) and on the side stream (the asynchronous one, installed on the compute
//!   stream after an event);
//! - `rank-deficient`: `λ` zero on half the spectrum, ε = 0.1: the null space's eigenvalues
//!   are f32 round-off around ε, so ε is chosen large enough that their relative error stays
//!   below the tolerance (at ε = 1e-8 the root's null-space part is rounding noise on either
//!   side; `docs/shampoo.md` §7.4);
//! - `indefinite`: `λ` over `[−1, 4]`, ε = 1e-3: the spectrum is shifted up so that its
//!   smallest eigenvalue is ε (the reference's perturbation);
//! - `zero`: an all-zero factor, whose root is `ε^(−1/r)·I` (a valid refresh, not skipped);
//! - `nan`: one NaN entry: both sides must refuse (GPU: status word 0, [`refresh::verdict`]'s
//!   `NonFinite`; host: `RefreshError::NonFiniteFactor`) and the previous root must stay.
//!
//! Outputs: the installed root, norm-wise relative error against [`TOL_REFRESH`]; for `nan`,
//! the failure agreement (0 or ∞) and the kept root's change.
use super::cases::case;
use super::cases_refresh::TOL_REFRESH;
use super::{cpu, rel_err, wide, Case, Ctx, Outcome};
use crate::error::Result;
use crate::refresh::{self, GpuRefresher, RefreshSlot};
use crate::StreamKind;
use optim::HostEigensolver;

/// How a case builds its factor.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Spd,
    RankDeficient,
    Indefinite,
    Zero,
    Nan,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Spd => "spd",
            Kind::RankDeficient => "rank-deficient",
            Kind::Indefinite => "indefinite",
            Kind::Zero => "zero",
            Kind::Nan => "nan",
        }
    }
    fn epsilon(self) -> f64 {
        match self {
            Kind::Spd | Kind::Zero | Kind::Nan => 1e-8,
            Kind::RankDeficient => 0.1,
            Kind::Indefinite => 1e-3,
        }
    }
}

pub(crate) fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    let mut add = |d: usize, kind: Kind, exponent: u32, side: bool, big: bool| {
        let stream = if side { "side" } else { "compute" };
        let size = format!("d={d} {} r={exponent} {stream}", kind.name());
        v.push(case("inverse_root", size, TOL_REFRESH, big, move |cx| {
            inverse_root(cx, d, kind, exponent, side)
        }));
    };
    for d in [5usize, 33, 130] {
        add(d, Kind::Spd, 4, false, false);
        add(d, Kind::Spd, 4, true, false);
        add(d, Kind::Spd, 2, false, false);
        add(d, Kind::RankDeficient, 4, true, false);
        add(d, Kind::Indefinite, 4, false, false);
    }
    add(33, Kind::Zero, 4, false, false);
    add(33, Kind::Nan, 4, true, false);
    add(130, Kind::Nan, 2, false, false);
    add(1024, Kind::Spd, 4, true, true);
    v
}

/// `U diag(lam) Uᵀ` rounded to f32 (and symmetric), `U` orthonormal (float64 `eigh` of a
/// random symmetric matrix).
fn with_spectrum(cx: &mut Ctx<'_>, d: usize, lam: &[f64]) -> Result<Vec<f64>> {
    let g = wide(&cx.normal(d * d, 0.0, 1.0));
    let mut sym = vec![0.0f64; d * d];
    for i in 0..d {
        for j in 0..d {
            sym[i * d + j] = g[i * d + j] + g[j * d + i];
        }
    }
    let u = optim::FaerEigensolver
        .eigh_f64(&sym, d)
        .map_err(cpu)?
        .vectors;
    let mut f = vec![0.0f64; d * d];
    for i in 0..d {
        for j in 0..=i {
            let acc: f64 = (0..d).map(|k| u[i * d + k] * lam[k] * u[j * d + k]).sum();
            let v = f64::from(acc as f32);
            f[i * d + j] = v;
            f[j * d + i] = v;
        }
    }
    Ok(f)
}

/// The factor of `kind` (f32 values, widened).
fn factor(cx: &mut Ctx<'_>, d: usize, kind: Kind) -> Result<Vec<f64>> {
    let spread = |lo: f64, hi: f64| -> Vec<f64> {
        (0..d)
            .map(|i| lo + (hi - lo) * i as f64 / (d.max(2) - 1) as f64)
            .collect()
    };
    match kind {
        Kind::Spd => with_spectrum(cx, d, &spread(0.5, 5.0)),
        Kind::RankDeficient => {
            let mut lam = spread(0.5, 5.0);
            lam.iter_mut().take(d - d / 2).for_each(|x| *x = 0.0);
            with_spectrum(cx, d, &lam)
        }
        Kind::Indefinite => with_spectrum(cx, d, &spread(-1.0, 4.0)),
        Kind::Zero => Ok(vec![0.0; d * d]),
        Kind::Nan => {
            let mut f = with_spectrum(cx, d, &spread(0.5, 5.0))?;
            f[(d / 2) * d + d / 3] = f64::NAN;
            Ok(f)
        }
    }
}

fn inverse_root(
    cx: &mut Ctx<'_>,
    d: usize,
    kind: Kind,
    exponent: u32,
    side: bool,
) -> Result<Outcome> {
    let root = schedule::InverseRoot {
        exponent,
        epsilon: kind.epsilon(),
    };
    let f = factor(cx, d, kind)?;
    let f32s: Vec<f32> = f.iter().map(|&x| x as f32).collect();
    // The previous root (what a refused refresh must leave in place).
    let prev = cx.normal(d * d, 0.0, 1.0);
    let dev = cx.dev;
    let stream = if side {
        StreamKind::Side
    } else {
        StreamKind::Compute
    };
    let (r, _) = GpuRefresher::new(dev, stream, d)?;
    let mut arena = dev.arena(
        "selftest-inverse-root",
        crate::Tier::Device,
        RefreshSlot::bytes(d),
    )?;
    let slot = RefreshSlot::carve(&mut arena, d)?;
    dev.poison(&slot.q)?;
    let fb = cx.up(&f32s)?;
    let rb = cx.up(&prev)?;
    let mut gpu_verdict = Ok(());
    let ms = cx.timed(|| {
        r.compute_inverse_root(dev, d, root, &fb, &slot)?;
        let status = dev.download_on::<i32>(&slot.status, stream)?;
        // As the engine reads an inverse root's status words: an eigendecomposition's.
        gpu_verdict = refresh::verdict(true, d, &status);
        if gpu_verdict.is_ok() {
            if side {
                let done = dev.record(StreamKind::Side, false)?;
                dev.wait(StreamKind::Compute, &done)?;
            }
            refresh::install_basis(dev, &slot.q, &rb, d)?;
        }
        Ok(())
    })?;
    let got = cx.down(&rb)?;
    let solver = optim::FaerEigensolver;
    // The engines' entry point at a refresh step (t = 11, frequency 10).
    let reference = optim::refresh_compute_inverse_root::<f64>(&solver, 11, 10, 0, &f, d, root);
    let errs = match (kind, reference, gpu_verdict) {
        (Kind::Nan, Err(optim::RefreshError::NonFiniteFactor { .. }), Err(fail)) => {
            let refused = matches!(fail, refresh::RefreshFailure::NonFinite { .. });
            vec![
                ("both refuse", if refused { 0.0 } else { f64::INFINITY }),
                ("root kept", rel_err(&got, &wide(&prev))),
            ]
        }
        (_, Ok(Some(res)), Ok(())) => {
            let mut want = vec![0.0f64; d * d];
            optim::refresh_apply(&res, &mut want, &mut [], &mut [], d, 1).map_err(cpu)?;
            vec![("root", rel_err(&got, &want))]
        }
        (_, reference, gpu) => {
            return Err(cpu(format!(
                "host and GPU disagree on the refresh: host {:?}, GPU {gpu:?}",
                reference.map(|r| r.map(|r| r.kind()))
            )))
        }
    };
    Ok(Outcome { errs, gpu_ms: ms })
}
