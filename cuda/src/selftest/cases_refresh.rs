//! Self-test cases of the GPU eigenbasis refresh ([`crate::refresh`]: cuSOLVER + the `refresh`
//! kernels) against `optim`'s refresh in float64 on the same (f32-rounded) inputs.
//!
//! Inputs are built so the answer is well defined: a random orthonormal `U` (float64 `eigh` of
//! a random symmetric matrix), distinct eigenvalues `λ` spread over `[1, 5]` in a random order,
//! `F = U diag(λ) Uᵀ + ε·S` with a small random symmetric `S` (ε = 1e-3 of the eigenvalue
//! spacing: `diag(Uᵀ F U)` keeps its order, so the permutation is unique, and `F U` is well
//! conditioned, so the QR factor is unique up to column signs).
//! - `eigenbasis_init` (syevd): basis-invariant errors, since eigenvectors are only defined up
//!   to sign: residual `max|F Q − Q diag(QᵀFQ)| / max|F|`, orthonormality `max|QᵀQ − I|`, and
//!   the eigenvalues `diag(QᵀFQ)` (descending) against float64 `eigh` of the same `F`.
//! - `eigenbasis_refresh_*` (power iteration + QR, then the swap): with `U` as the stored basis,
//!   the new basis (columns sign-aligned to the reference), the permutation (exact), and the
//!   moments after [`crate::refresh::apply`]: `exp_avg` re-projected (signs aligned) and
//!   `exp_avg_sq` permuted, against `optim::refresh_compute` + `refresh_apply` in float64.
//! - `eigenbasis_refresh_swap_pinned_moments` / `_chunked`: the swap with its moments in pinned
//!   host memory or on the device, through chunk buffers a third of a moment each (the last
//!   chunk shorter), as the engine swaps a moment larger than its chunk.
//! - `eigenbasis_refresh_swap_pinned_state`: the same with the factor and the stored basis in
//!   pinned host memory too (Kronecker factors and eigenbases in a plan's host tier): the
//!   refresher and the swap read them through their device staging copies.
//! - The QR refresh's method, the tensor-core Rayleigh–Cholesky QR, in
//!   `eigenbasis_refresh_rayleigh_tc` (and `eigenbasis_refresh_tf32_swap`, the same with the
//!   swap's GEMMs in TF32), and its Householder fallback run on its own in
//!   `eigenbasis_refresh_householder`; `eigenbasis_refresh_rotated_*` both with a stored basis
//!   rotated away from the eigenbasis and eigenvalues over two decades. Rayleigh–Cholesky cases
//!   also check that the fallback was not taken.
//! - `eigenbasis_refresh_rayleigh_tc_fallback`: an indefinite factor, where a Cholesky
//!   factorisation fails and the Rayleigh–Cholesky QR must hand over to Householder.
//! - `eigenbasis_refresh_rayleigh_tc_repeated` / `_stiff`: many refreshes in a row, each new
//!   basis stored for the next, must stay orthonormal (the stiff factor's eigenvalues span nine
//!   decades).
//! - `eigenbasis_refresh_rank_deficient_*`: a factor that is zero outside a leading block,
//!   through either method: the range columns against float64, the whole basis orthonormal.
//! - `gemm_3xtf32`: the Rayleigh–Cholesky QR's GEMM against float64 (tolerance 2e-6, which
//!   TF32 alone misses).
//! - `eigenbasis_refresh_qr_*`: KL-Shampoo's refresh (`RefreshMethod::Qr`: `qr(F·Q).Q` with the
//!   columns in their order, no sort, no moment) on a side-stream refresher (the engine's
//!   asynchronous `gpu_side` placement), installed with [`refresh::install_basis`], against
//!   float64 `optim::refresh_compute_method(.., Qr, ..)` + `refresh_apply`: the basis (columns
//!   sign-aligned), its orthonormality, and the permutation slot left unwritten; through either
//!   method, on [`factor`]'s factors (columns of the stored basis unsorted: its eigenvalues are
//!   shuffled) and [`rotated_factor`]'s.
//!
//! Tolerance [`TOL_REFRESH`]: fp32 Householder QR / eigh have a backward error of order
//! `d · 2⁻²⁴`, i.e. up to ~5e-5 at d = 783.
use super::cases::case;
use super::{cpu, Case, Ctx, Outcome, TOL_BF16};
use crate::device::GemmMath;
use crate::error::Result;
use crate::gemm::Dims;
use crate::memory::Elem;
use crate::refresh::{self, GpuRefresher, QrMethod, RefreshSlot, SwapWork};
use crate::StreamKind;
use optim::HostEigensolver;
use schedule::RefreshMethod::{Qr, Soap};

/// Tolerance of the refresh cases (norm-wise relative error).
pub const TOL_REFRESH: f64 = 1e-4;

pub(crate) fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for (d, other, big) in [
        (3usize, 5usize, false),
        (50, 7, false),
        (7, 50, false),
        (257, 33, false),
        (783, 50, true),
    ] {
        v.push(case(
            "eigenbasis_init",
            format!("d={d}"),
            TOL_REFRESH,
            big,
            move |cx| init(cx, d),
        ));
        for side in [0u8, 1] {
            let (m, n) = if side == 0 { (d, other) } else { (other, d) };
            // The swap's re-projection in fp32, and in TF32 (the optimizer math of a
            // `precision = bf16` plan; TF32's 10-bit mantissa, so the bf16 tolerance).
            for (kernel, qr, math, tol) in [
                (
                    "eigenbasis_refresh_rayleigh_tc",
                    QrMethod::RayleighCholeskyTc,
                    GemmMath::Fp32,
                    TOL_REFRESH,
                ),
                (
                    "eigenbasis_refresh_householder",
                    QrMethod::Householder,
                    GemmMath::Fp32,
                    TOL_REFRESH,
                ),
                (
                    "eigenbasis_refresh_tf32_swap",
                    QrMethod::RayleighCholeskyTc,
                    GemmMath::Tf32,
                    TOL_BF16,
                ),
            ] {
                v.push(case(
                    kernel,
                    format!("side={side} m={m} n={n}"),
                    tol,
                    big,
                    move |cx| qr_refresh(cx, side, m, n, qr, math, Factor::Plain),
                ));
            }
            // Moments in pinned host memory (a plan's host tier), and device moments, in
            // several chunks: the swap gathers each block of lines onto the device (or reads
            // it in place) and scatters the results back.
            for (kernel, factor) in [
                (
                    "eigenbasis_refresh_swap_pinned_moments",
                    Factor::PinnedMoments,
                ),
                ("eigenbasis_refresh_swap_chunked", Factor::ChunkedMoments),
                // Factor, basis and moments in pinned host memory (the plan's host tier):
                // the refresher and the swap read factor and basis through device copies.
                ("eigenbasis_refresh_swap_pinned_state", Factor::PinnedState),
            ] {
                v.push(case(
                    kernel,
                    format!("side={side} m={m} n={n}"),
                    TOL_REFRESH,
                    big,
                    move |cx| {
                        qr_refresh(
                            cx,
                            side,
                            m,
                            n,
                            QrMethod::RayleighCholeskyTc,
                            GemmMath::Fp32,
                            factor,
                        )
                    },
                ));
            }
            // A stored basis that is a rotation away from the eigenbasis and eigenvalues over
            // two decades: L of the Rayleigh–Cholesky QR is far from the identity.
            for (kernel, qr) in [
                (
                    "eigenbasis_refresh_rotated_rayleigh_tc",
                    QrMethod::RayleighCholeskyTc,
                ),
                (
                    "eigenbasis_refresh_rotated_householder",
                    QrMethod::Householder,
                ),
            ] {
                v.push(case(
                    kernel,
                    format!("side={side} m={m} n={n}"),
                    TOL_REFRESH,
                    big,
                    move |cx| qr_refresh(cx, side, m, n, qr, GemmMath::Fp32, Factor::Rotated),
                ));
            }
        }
    }
    // An indefinite factor (one eigenvalue below zero): B's Cholesky factorisation fails and
    // the Rayleigh–Cholesky QR must hand over to Householder.
    for (d, other) in [(50usize, 7usize), (257, 33)] {
        v.push(case(
            "eigenbasis_refresh_rayleigh_tc_fallback",
            format!("side=0 m={d} n={other}"),
            TOL_REFRESH,
            false,
            move |cx| {
                qr_refresh(
                    cx,
                    0,
                    d,
                    other,
                    QrMethod::RayleighCholeskyTc,
                    GemmMath::Fp32,
                    Factor::Indefinite,
                )
            },
        ));
    }
    // Sixty refreshes in a row, each new basis stored for the next: the basis must stay
    // orthonormal to fp32 rounding (a CholeskyQR pass that never touched Q_p itself drifts by
    // ~5e-7 per refresh). At d = 783 (full self-test only) a max-entry gate on MᵀM − I could be
    // d times looser than the spectral norm the Newton–Schulz step needs.
    for (d, big) in [(64usize, false), (257, false), (783, true)] {
        v.push(case(
            "eigenbasis_refresh_rayleigh_tc_repeated",
            format!("d={d} refreshes=60"),
            1e-5,
            big,
            move |cx| repeated(cx, d, 60, 2.0),
        ));
    }
    // Eigenvalues over nine decades (as ill-conditioned as real training factors get) and a
    // rotated basis: L is ill-conditioned and the Newton–Schulz gate is exercised; ten
    // refreshes in a row must keep the basis orthonormal (fallbacks allowed).
    for (d, big) in [(257usize, false), (783, true)] {
        v.push(case(
            "eigenbasis_refresh_rayleigh_tc_stiff",
            format!("d={d} refreshes=10 decades=9"),
            1e-5,
            big,
            move |cx| repeated(cx, d, 10, 9.0),
        ));
    }
    // 3xTF32 GEMMs (refresh::gemm_3xtf32) against float64 on awkward shapes, every transpose:
    // TF32 alone is ~1e-3 off, so the tolerance fails without the low-order terms.
    for (m, k, p) in [(1usize, 1usize, 1usize), (77, 131, 45), (300, 257, 129)] {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            v.push(case(
                "gemm_3xtf32",
                format!("m={m} k={k} p={p} ta={ta} tb={tb}"),
                2e-6,
                false,
                move |cx| gemm_3xtf32_case(cx, m, k, p, ta, tb),
            ));
        }
    }
    // KL-Shampoo's QR refresh on the side stream, through either method.
    for (d, big) in [(50usize, false), (257, false), (783, true)] {
        for (kernel, qr) in [
            (
                "eigenbasis_refresh_qr_rayleigh_tc",
                QrMethod::RayleighCholeskyTc,
            ),
            ("eigenbasis_refresh_qr_householder", QrMethod::Householder),
        ] {
            for (kind, label) in [(Factor::Plain, "plain"), (Factor::Rotated, "rotated")] {
                v.push(case(
                    kernel,
                    format!("d={d} {label}"),
                    TOL_REFRESH,
                    big,
                    move |cx| qr_method(cx, d, qr, kind),
                ));
            }
        }
    }
    // A rank-deficient factor (zero outside a leading block), through either method.
    for (d, r) in [(50usize, 30usize), (257, 100)] {
        for (kernel, qr) in [
            (
                "eigenbasis_refresh_rank_deficient_rayleigh_tc",
                QrMethod::RayleighCholeskyTc,
            ),
            (
                "eigenbasis_refresh_rank_deficient_householder",
                QrMethod::Householder,
            ),
        ] {
            v.push(case(
                kernel,
                format!("d={d} rank={r}"),
                TOL_REFRESH,
                false,
                move |cx| zero_block(cx, d, r, qr),
            ));
        }
    }
    v
}

/// `U` (random orthonormal, row-major, columns), `λ` (distinct, shuffled) and `F` as in the
/// module docs, all f32-rounded and widened back.
fn factor(cx: &mut Ctx<'_>, d: usize) -> Result<(Vec<f64>, Vec<f64>, Vec<f64>)> {
    let g: Vec<f64> = cx
        .normal(d * d, 0.0, 1.0)
        .iter()
        .map(|&x| f64::from(x))
        .collect();
    let mut sym = vec![0.0f64; d * d];
    for i in 0..d {
        for j in 0..d {
            sym[i * d + j] = g[i * d + j] + g[j * d + i];
        }
    }
    let e = optim::FaerEigensolver.eigh_f64(&sym, d).map_err(cpu)?;
    let u: Vec<f64> = e.vectors.iter().map(|&x| f64::from(x as f32)).collect();
    // Distinct eigenvalues over [1, 5], shuffled (Fisher-Yates with the case's generator).
    let spacing = 4.0 / d.max(2) as f64;
    let mut lam: Vec<f64> = (0..d).map(|i| 1.0 + spacing * i as f64).collect();
    for i in (1..d).rev() {
        let j = (cx.rng.next_u64() % (i as u64 + 1)) as usize;
        lam.swap(i, j);
    }
    let eps = 1e-3 * spacing;
    let s = cx.normal(d * d, 0.0, 1.0);
    let mut f = vec![0.0f64; d * d];
    for i in 0..d {
        for j in 0..=i {
            let mut acc = 0.0;
            for k in 0..d {
                acc += u[i * d + k] * lam[k] * u[j * d + k];
            }
            let v = acc + eps * 0.5 * (f64::from(s[i * d + j]) + f64::from(s[j * d + i]));
            let v = f64::from(v as f32);
            f[i * d + j] = v;
            f[j * d + i] = v;
        }
    }
    Ok((u, lam, f))
}

/// `F = U diag(λ) Uᵀ` (f32-rounded) with `λ` geometric over `[10^-decades, 1]` (shuffled;
/// `decades = 2` in the comparisons with the float64 reference) and, as
/// the stored basis, `V = qr(U + 0.3·N/√d).Q` (f32-rounded): a basis one refresh period away
/// from the eigenbasis, with `F V` conditioned ~1e2 (so the QR factor is unique up to signs
/// and fp32 Householder stays within the tolerance).
fn rotated_factor(
    cx: &mut Ctx<'_>,
    d: usize,
    decades: f64,
) -> Result<(Vec<f64>, Vec<f64>, Vec<f64>)> {
    let (u, _, _) = factor(cx, d)?;
    let mut lam: Vec<f64> = (0..d)
        .map(|i| 10f64.powf(-decades * i as f64 / d.max(2) as f64))
        .collect();
    for i in (1..d).rev() {
        let j = (cx.rng.next_u64() % (i as u64 + 1)) as usize;
        lam.swap(i, j);
    }
    let mut f = vec![0.0f64; d * d];
    for i in 0..d {
        for j in 0..=i {
            let acc: f64 = (0..d).map(|k| u[i * d + k] * lam[k] * u[j * d + k]).sum();
            let v = f64::from(acc as f32);
            f[i * d + j] = v;
            f[j * d + i] = v;
        }
    }
    let noise = cx.normal(d * d, 0.0, 1.0);
    let scale = 0.3 / (d as f64).sqrt();
    let perturbed: Vec<f64> = u
        .iter()
        .zip(&noise)
        .map(|(&x, &e)| x + scale * f64::from(e))
        .collect();
    let v = optim::thin_qr_q(&perturbed, d, d).map_err(cpu)?;
    let v: Vec<f64> = v.iter().map(|&x| f64::from(x as f32)).collect();
    Ok((v, lam, f))
}

fn narrow(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

fn wide(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

/// `a · b` for row-major `[d, d]` f64 matrices.
fn mm(a: &[f64], ta: bool, b: &[f64], d: usize) -> Vec<f64> {
    let mut out = vec![0.0; d * d];
    // The shapes are square and consistent by construction.
    let _ = optim::matmul(&mut out, a, ta, b, false, d, d, d);
    out
}

fn max_abs(v: &[f64]) -> f64 {
    v.iter().fold(0.0f64, |m, x| m.max(x.abs()))
}

/// A compute-stream refresher for side length `d` using `qr` (the engine's refresher, or
/// Householder alone), and an output slot (with the arena it lives in, which must outlive it).
fn refresher(
    cx: &Ctx<'_>,
    d: usize,
    qr: QrMethod,
) -> Result<(GpuRefresher, crate::memory::Arena, RefreshSlot)> {
    refresher_on(cx, d, qr, StreamKind::Compute)
}

/// [`refresher`] bound to stream `stream`.
fn refresher_on(
    cx: &Ctx<'_>,
    d: usize,
    qr: QrMethod,
    stream: StreamKind,
) -> Result<(GpuRefresher, crate::memory::Arena, RefreshSlot)> {
    let dev = cx.dev;
    let (mut r, _) = GpuRefresher::new(dev, stream, d)?;
    r.set_qr_method(qr);
    let mut arena = dev.arena(
        "selftest-refresh",
        crate::Tier::Device,
        RefreshSlot::bytes(d),
    )?;
    let slot = RefreshSlot::carve(&mut arena, d)?;
    Ok((r, arena, slot))
}

fn init(cx: &mut Ctx<'_>, d: usize) -> Result<Outcome> {
    let (_, _, f) = factor(cx, d)?;
    let dev = cx.dev;
    let (r, _arena, slot) = refresher(cx, d, QrMethod::RayleighCholeskyTc)?;
    dev.poison(&slot.q)?;
    let fb = cx.up(&narrow(&f))?;
    let basis = cx.out(d * d)?;
    let ms = cx.timed(|| r.compute(dev, true, Soap, d, &fb, &basis, &slot))?;
    let status = dev.download::<i32>(&slot.status)?;
    if let Err(e) = refresh::verdict(true, d, &status) {
        return Err(crate::CudaError::Invalid {
            op: "eigenbasis_init",
            what: e.to_string(),
        });
    }
    let q = wide(&dev.download::<f32>(&slot.q)?);
    // Residual, orthonormality, eigenvalues (descending).
    let fq = mm(&f, false, &q, d);
    let qfq = mm(&q, true, &fq, d);
    let diag: Vec<f64> = (0..d).map(|j| qfq[j * d + j]).collect();
    let mut resid = 0.0f64;
    for i in 0..d {
        for j in 0..d {
            resid = resid.max((fq[i * d + j] - q[i * d + j] * diag[j]).abs());
        }
    }
    let qtq = mm(&q, true, &q, d);
    let mut orth = 0.0f64;
    for i in 0..d {
        for j in 0..d {
            let want = if i == j { 1.0 } else { 0.0 };
            orth = orth.max((qtq[i * d + j] - want).abs());
        }
    }
    // The eigenvalues of F itself (float64 eigh), descending.
    let mut want = optim::FaerEigensolver.eigh_f64(&f, d).map_err(cpu)?.values;
    want.sort_by(|a, b| b.total_cmp(a));
    let values = super::rel_err(&narrow(&diag), &want);
    Ok(Outcome {
        errs: vec![
            ("residual", resid / max_abs(&f)),
            ("orthonormality", orth),
            ("eigenvalues", values),
        ],
        gpu_ms: ms,
    })
}

fn qr_refresh(
    cx: &mut Ctx<'_>,
    side: u8,
    m: usize,
    n: usize,
    qr: QrMethod,
    math: GemmMath,
    kind: Factor,
) -> Result<Outcome> {
    let d = if side == 0 { m } else { n };
    let (u, _, f) = match kind {
        Factor::Plain | Factor::PinnedMoments | Factor::ChunkedMoments | Factor::PinnedState => {
            factor(cx, d)?
        }
        Factor::Rotated => rotated_factor(cx, d, 2.0)?,
        Factor::Indefinite => {
            // λ₀ − 6 ∈ [−5, −1]: distinct from the others, and F U stays well conditioned.
            let (u, lam, mut f) = factor(cx, d)?;
            for i in 0..d {
                for j in 0..d {
                    f[i * d + j] = f64::from((f[i * d + j] - 6.0 * u[i * d] * u[j * d]) as f32);
                }
            }
            (u, lam, f)
        }
    };
    let ea = cx.normal(m * n, 0.0, 1.0);
    let eas = cx.uniform(m * n, 0.1, 2.0);
    let dev = cx.dev;
    let (mut r, _arena, slot) = refresher(cx, d, qr)?;
    let all_pinned = kind == Factor::PinnedState;
    r.stage_offloaded(dev, all_pinned, all_pinned)?;
    let pinned = kind == Factor::PinnedMoments || all_pinned;
    // The engine's chunk for this task; a pinned- or chunked-moments case takes about a third
    // of the moment per chunk (whole lines, the last chunk shorter) so that several chunks go through.
    let chunk = if pinned || kind == Factor::ChunkedMoments {
        d + m * n / 3
    } else {
        schedule::reserve::swap_chunk_len(d, m * n)
    };
    let work = SwapWork::new(dev, d, chunk, all_pinned)?;
    let mut _pinned_arena = None;
    let (fb, qb, eab, easb) = if pinned {
        let bytes = 2 * (m * n * 4 + d * d * 4 + 2 * crate::memory::BUF_ALIGN);
        let mut a = dev.arena("selftest-pinned", crate::Tier::PinnedHost, bytes)?;
        let (x, y) = (a.buf(Elem::F32, m * n)?, a.buf(Elem::F32, m * n)?);
        dev.upload(&x, &ea)?;
        dev.upload(&y, &eas)?;
        let (fb, qb) = if all_pinned {
            let (fp, qp) = (a.buf(Elem::F32, d * d)?, a.buf(Elem::F32, d * d)?);
            dev.upload(&fp, &narrow(&f))?;
            dev.upload(&qp, &narrow(&u))?;
            (fp, qp)
        } else {
            (cx.up(&narrow(&f))?, cx.up(&narrow(&u))?)
        };
        _pinned_arena = Some(a);
        (fb, qb, x, y)
    } else {
        (
            cx.up(&narrow(&f))?,
            cx.up(&narrow(&u))?,
            cx.up(&ea)?,
            cx.up(&eas)?,
        )
    };
    dev.poison(&slot.q)?;
    let ms = cx.timed(|| {
        r.compute(dev, false, Soap, d, &fb, &qb, &slot)?;
        let status = dev.download::<i32>(&slot.status)?;
        refresh::verdict(false, d, &status).map_err(|e| crate::CudaError::Invalid {
            op: "eigenbasis_refresh",
            what: e.to_string(),
        })?;
        refresh::apply(
            dev, &work, false, side, &slot.q, &slot.idx, &qb, &eab, &easb, m, n, math,
        )
    })?;
    let q_gpu = wide(&dev.download::<f32>(&qb)?);
    let idx_gpu = dev.download::<i32>(&slot.idx.slice(0, d)?)?;
    let mut ea_gpu = wide(&dev.download::<f32>(&eab)?);
    let eas_gpu = dev.download::<f32>(&easb)?;
    // Reference: float64 on the same f32 inputs.
    let solver = optim::FaerEigensolver;
    let res = optim::refresh_compute(&solver, 11, 10, side, &f, &u, m, n)
        .map_err(cpu)?
        .ok_or_else(|| cpu("reference refresh skipped"))?;
    let (mut q_ref, mut ea_ref, mut eas_ref) = (u.clone(), wide(&ea), wide(&eas));
    optim::refresh_apply(&res, &mut q_ref, &mut ea_ref, &mut eas_ref, m, n).map_err(cpu)?;
    // Align GPU column signs to the reference (QR columns are defined up to sign); flip the
    // matching exp_avg rows (side 0) or columns (side 1).
    let mut q_al = q_gpu.clone();
    for j in 0..d {
        let dot: f64 = (0..d).map(|i| q_gpu[i * d + j] * q_ref[i * d + j]).sum();
        if dot < 0.0 {
            for i in 0..d {
                q_al[i * d + j] = -q_al[i * d + j];
            }
            if side == 0 {
                for c in 0..n {
                    ea_gpu[j * n + c] = -ea_gpu[j * n + c];
                }
            } else {
                for row in 0..m {
                    ea_gpu[row * n + j] = -ea_gpu[row * n + j];
                }
            }
        }
    }
    let perm_ok = idx_gpu
        .iter()
        .zip(res.permutation())
        .all(|(&g, &c)| g >= 0 && g as usize == c);
    let mut errs = vec![
        ("basis", super::rel_err(&narrow(&q_al), &q_ref)),
        ("permutation", if perm_ok { 0.0 } else { f64::INFINITY }),
        ("exp_avg", super::rel_err(&narrow(&ea_gpu), &ea_ref)),
        ("exp_avg_sq", super::rel_err(&eas_gpu, &eas_ref)),
    ];
    if qr == QrMethod::RayleighCholeskyTc {
        // Plain and rotated factors are positive definite: no fallback; the indefinite one
        // must fall back.
        let want = if kind == Factor::Indefinite {
            (0, 1)
        } else {
            (1, 0)
        };
        let ok = r.cholesky_counts() == want;
        errs.push(("fallback as expected", if ok { 0.0 } else { f64::INFINITY }));
    }
    Ok(Outcome { errs, gpu_ms: ms })
}

/// `reps` refreshes (the engine's Rayleigh–Cholesky QR) of one [`rotated_factor`], each storing
/// its basis for the next; the final basis's `max|QᵀQ − I|` (float64) and whether any refresh
/// fell back.
/// With `decades` other than 2 (a stiff factor) only the orthonormality is checked: the
/// Householder fallback may take some refreshes.
fn repeated(cx: &mut Ctx<'_>, d: usize, reps: usize, decades: f64) -> Result<Outcome> {
    let (v, _, f) = rotated_factor(cx, d, decades)?;
    let dev = cx.dev;
    let (r, _arena, slot) = refresher(cx, d, QrMethod::RayleighCholeskyTc)?;
    let (fb, qb) = (cx.up(&narrow(&f))?, cx.up(&narrow(&v))?);
    let ms = cx.timed(|| {
        for _ in 0..reps {
            r.compute(dev, false, Soap, d, &fb, &qb, &slot)?;
            let status = dev.download::<i32>(&slot.status)?;
            refresh::verdict(false, d, &status).map_err(|e| crate::CudaError::Invalid {
                op: "eigenbasis_refresh_rayleigh_tc_repeated",
                what: e.to_string(),
            })?;
            dev.copy(&qb, &slot.q.slice(0, d * d)?, StreamKind::Compute)?;
        }
        Ok(())
    })?;
    let q = wide(&dev.download::<f32>(&qb)?);
    let qtq = mm(&q, true, &q, d);
    let mut orth = 0.0f64;
    for i in 0..d {
        for j in 0..d {
            orth = orth.max((qtq[i * d + j] - if i == j { 1.0 } else { 0.0 }).abs());
        }
    }
    let no_fallback = r.cholesky_counts() == (reps as u64, 0) || decades != 2.0;
    Ok(Outcome {
        errs: vec![
            ("orthonormality", orth),
            ("no fallback", if no_fallback { 0.0 } else { f64::INFINITY }),
        ],
        gpu_ms: ms,
    })
}

/// `C = α·op(A)·op(B) + β·C₀` by [`refresh::gemm_3xtf32`] against float64 on the same f32
/// inputs (`op(A)` `[m, k]`, `op(B)` `[k, p]`, α = 0.75, β = −0.5), through the norm-wise
/// relative error of C.
fn gemm_3xtf32_case(
    cx: &mut Ctx<'_>,
    m: usize,
    k: usize,
    p: usize,
    ta: bool,
    tb: bool,
) -> Result<Outcome> {
    let (a, b, c0) = (
        cx.normal(m * k, 0.0, 1.0),
        cx.normal(k * p, 0.0, 1.0),
        cx.normal(m * p, 0.0, 1.0),
    );
    let (alpha, beta) = (0.75f32, -0.5f32);
    let dev = cx.dev;
    let (ad, bd) = (
        if ta { Dims::new(k, m) } else { Dims::new(m, k) },
        if tb { Dims::new(p, k) } else { Dims::new(k, p) },
    );
    let (ab, bb, cb) = (cx.up(&a)?, cx.up(&b)?, cx.up(&c0)?);
    let big = m.max(k).max(p);
    let mut split = Vec::new();
    for _ in 0..4 {
        split.push(cx.up(&vec![0f32; big * big])?);
    }
    let split: [crate::memory::Buf; 4] = [
        split[0].clone(),
        split[1].clone(),
        split[2].clone(),
        split[3].clone(),
    ];
    let ms = cx.timed(|| {
        refresh::gemm_3xtf32(
            dev,
            StreamKind::Compute,
            &ab,
            ad,
            &bb,
            bd,
            &cb,
            ta,
            tb,
            alpha,
            beta,
            &split,
        )
    })?;
    let got = dev.download::<f32>(&cb)?;
    let at = |i: usize, l: usize| f64::from(if ta { a[l * m + i] } else { a[i * k + l] });
    let bt = |l: usize, j: usize| f64::from(if tb { b[j * k + l] } else { b[l * p + j] });
    let mut want = vec![0f64; m * p];
    for i in 0..m {
        for j in 0..p {
            let dot: f64 = (0..k).map(|l| at(i, l) * bt(l, j)).sum();
            want[i * p + j] = f64::from(alpha) * dot + f64::from(beta) * f64::from(c0[i * p + j]);
        }
    }
    Ok(Outcome {
        errs: vec![("C", super::rel_err(&got, &want))],
        gpu_ms: ms,
    })
}

/// KL-Shampoo's QR refresh (`RefreshMethod::Qr`) of a side-`d` factor built as `kind` says,
/// on a side-stream refresher using `qr`, installed on the compute stream after it (as the
/// engine swaps a `gpu_side` result in); see the module docs for what is compared.
fn qr_method(cx: &mut Ctx<'_>, d: usize, qr: QrMethod, kind: Factor) -> Result<Outcome> {
    let (u, _, f) = match kind {
        Factor::Rotated => rotated_factor(cx, d, 2.0)?,
        _ => factor(cx, d)?,
    };
    let dev = cx.dev;
    let (r, _arena, slot) = refresher_on(cx, d, qr, StreamKind::Side)?;
    let (fb, qb) = (cx.up(&narrow(&f))?, cx.up(&narrow(&u))?);
    dev.poison(&slot.q)?;
    // -1 everywhere: a Qr refresh writes no permutation.
    dev.fill_bits32(&slot.idx, u32::MAX)?;
    let ms = cx.timed(|| {
        r.compute(dev, false, Qr, d, &fb, &qb, &slot)?;
        let status = dev.download_on::<i32>(&slot.status, StreamKind::Side)?;
        refresh::verdict(false, d, &status).map_err(|e| crate::CudaError::Invalid {
            op: "eigenbasis_refresh_qr",
            what: e.to_string(),
        })?;
        let done = dev.record(StreamKind::Side, false)?;
        dev.wait(StreamKind::Compute, &done)?;
        refresh::install_basis(dev, &slot.q, &qb, d)
    })?;
    let q = wide(&dev.download::<f32>(&qb)?);
    let idx = dev.download::<i32>(&slot.idx)?;
    let solver = optim::FaerEigensolver;
    let res = optim::refresh_compute_method(&solver, 11, 10, Qr, 0, &f, &u, d, 1)
        .map_err(cpu)?
        .ok_or_else(|| cpu("reference refresh skipped"))?;
    let mut q_ref = u.clone();
    optim::refresh_apply(&res, &mut q_ref, &mut [], &mut [], d, 1).map_err(cpu)?;
    // Column signs aligned to the reference (QR columns are defined up to sign).
    let mut q_al = q.clone();
    for j in 0..d {
        let dot: f64 = (0..d).map(|i| q[i * d + j] * q_ref[i * d + j]).sum();
        if dot < 0.0 {
            for i in 0..d {
                q_al[i * d + j] = -q_al[i * d + j];
            }
        }
    }
    let qtq = mm(&q, true, &q, d);
    let mut orth = 0.0f64;
    for i in 0..d {
        for j in 0..d {
            orth = orth.max((qtq[i * d + j] - if i == j { 1.0 } else { 0.0 }).abs());
        }
    }
    let untouched = idx.iter().all(|&i| i == -1);
    let mut errs = vec![
        ("basis", super::rel_err(&narrow(&q_al), &q_ref)),
        ("orthonormality", orth),
        (
            "no permutation",
            if untouched { 0.0 } else { f64::INFINITY },
        ),
    ];
    // On [`factor`]'s factors `L` of the Rayleigh–Cholesky QR stays near the identity even
    // with the columns unsorted: no fallback. A rotated basis with unsorted columns may make
    // `L` ill-conditioned, and the fallback may be taken there.
    if qr == QrMethod::RayleighCholeskyTc && kind == Factor::Plain {
        let ok = r.cholesky_counts() == (1, 0);
        errs.push(("no fallback", if ok { 0.0 } else { f64::INFINITY }));
    }
    Ok(Outcome { errs, gpu_ms: ms })
}

/// The factor a [`qr_refresh`] case builds (see [`factor`], [`rotated_factor`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Factor {
    Plain,
    Rotated,
    /// [`factor`] with one eigenvalue moved below zero.
    Indefinite,
    /// [`factor`], with the moments in pinned host memory, swapped in several chunks.
    PinnedMoments,
    /// [`factor`], with the moments in device memory, swapped in several chunks.
    ChunkedMoments,
    /// [`factor`], with factor, stored basis and moments in pinned host memory (a plan whose
    /// Kronecker factors and eigenbases `tier-placement` moved to the host tier): the
    /// refresher and the swap copy factor and basis to the device first.
    PinnedState,
}

/// A factor that is zero outside its leading `r × r` block and the identity as stored basis,
/// refreshed with `qr`: `A = F[:, idx]` has exactly zero columns. The Rayleigh–Cholesky QR's
/// shift keeps its Cholesky factorisations defined, and either outcome (its own result or the
/// Householder fallback) is correct. Only the first `r` columns (the range, ordered first by
/// the descending estimates) are unique up to sign; they are compared with float64
/// `refresh_compute`, and the whole basis must be orthonormal.
fn zero_block(cx: &mut Ctx<'_>, d: usize, r: usize, qr: QrMethod) -> Result<Outcome> {
    let (_, _, fr) = factor(cx, r)?;
    let mut f = vec![0.0f64; d * d];
    for i in 0..r {
        f[i * d..i * d + r].copy_from_slice(&fr[i * r..(i + 1) * r]);
    }
    let mut eye = vec![0.0f64; d * d];
    for i in 0..d {
        eye[i * d + i] = 1.0;
    }
    let dev = cx.dev;
    let (r_gpu, _arena, slot) = refresher(cx, d, qr)?;
    let (fb, qb) = (cx.up(&narrow(&f))?, cx.up(&narrow(&eye))?);
    dev.poison(&slot.q)?;
    let ms = cx.timed(|| r_gpu.compute(dev, false, Soap, d, &fb, &qb, &slot))?;
    let status = dev.download::<i32>(&slot.status)?;
    refresh::verdict(false, d, &status).map_err(|e| crate::CudaError::Invalid {
        op: "eigenbasis_refresh_rank_deficient",
        what: e.to_string(),
    })?;
    let q = wide(&dev.download::<f32>(&slot.q.slice(0, d * d)?)?);
    let res = optim::refresh_compute(&optim::FaerEigensolver, 11, 10, 0, &f, &eye, d, 1)
        .map_err(cpu)?
        .ok_or_else(|| cpu("reference refresh skipped"))?;
    let q_ref = res.basis();
    // Orthonormality of the whole GPU basis.
    let qtq = mm(&q, true, &q, d);
    let mut orth = 0.0f64;
    for i in 0..d {
        for j in 0..d {
            orth = orth.max((qtq[i * d + j] - if i == j { 1.0 } else { 0.0 }).abs());
        }
    }
    // The range columns, sign-aligned.
    let (mut got, mut want) = (Vec::with_capacity(d * r), Vec::with_capacity(d * r));
    for j in 0..r {
        let dot: f64 = (0..d).map(|i| q[i * d + j] * q_ref[i * d + j]).sum();
        let s = if dot < 0.0 { -1.0 } else { 1.0 };
        for i in 0..d {
            got.push((s * q[i * d + j]) as f32);
            want.push(q_ref[i * d + j]);
        }
    }
    Ok(Outcome {
        errs: vec![
            ("range columns", super::rel_err(&got, &want)),
            ("orthonormality", orth),
        ],
        gpu_ms: ms,
    })
}
