//! Self-test cases of the optimizer and gradient-norm launchers (against `optim` and
//! `engine::cpu::clip`). Moments start from random, warm states (v > 0) so that `m/(√v+ε)` is
//! smooth in its inputs, as it is after the first steps of training.
use super::cases::case;
use super::{cpu, rel_err, wide, Case, Ctx, Outcome, TOL_BF16, TOL_F32};
use crate::error::Result;
use crate::memory::{Buf, Elem};
use crate::ops::{loss as gloss, optim as gopt};
use schedule::SoapHyper;

pub(crate) fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    clip(&mut v);
    clip_into_adamw(&mut v);
    clip_from_partials(&mut v);
    grad_accumulate(&mut v);
    adamw(&mut v);
    update_rules(&mut v);
    composed_soap(&mut v);
    soap(&mut v);
    v
}

/// A composed SOAP step on the GPU (`expand-optimizer`'s form, which `fuse` leaves composed
/// when its `soap-update` rule does not match): the kernels of its two rules
/// (`optim::optimizers::soap::rules`: the moments rule with its result `u`, and the step rule)
/// against the same rules interpreted on the host, bit for bit, simplified as `simplify`
/// leaves them; and `project` both ways against `optim::project` / `optim::project_back` in
/// float64, each side alone and both, fp32 GEMMs (fp32 tolerance) and bf16 ones (bases cast
/// inside, or handed in as the engine's cached shadows; bf16 tolerance), at awkward sizes.
fn composed_soap(v: &mut Vec<Case>) {
    use optim::optimizers::{soap, step_scalars, update_rule};
    use optim::update::{simplify, Program, UpdateRule};
    let hyper = SoapHyper {
        lr: 3e-3,
        beta1: 0.95,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.01,
        correct_bias: true,
        normalize_grads: false,
    };
    for (n, big) in [(1usize, false), (1037, false), (4096 * 783 + 5, true)] {
        for which in ["moments", "step"] {
            v.push(case(
                "update_rule",
                format!("soap composed {which} n={n}"),
                0.0,
                big,
                move |cx| {
                    let (moments, step) = soap::rules(&hyper).map_err(cpu)?;
                    let rule = if which == "moments" { moments } else { step };
                    let scalars: Vec<f32> = step_scalars(&rule, 3e-3, 3);
                    let r = update_rule(&rule).map_err(cpu)?;
                    let (expr, _) = simplify(&r.expr);
                    let r = UpdateRule { expr, ..r };
                    let kernel = gopt::UpdateKernel::new(cx.dev, &r)?;
                    let prog = Program::new(&r).map_err(cpu)?;
                    // p, g, the state (m, then v > 0: a warm state), the results (written only).
                    let mut host: Vec<Vec<f32>> = Vec::new();
                    for t in &r.tensors {
                        host.push(match t.as_str() {
                            "v" => cx.uniform(n, 1e-4, 1e-2),
                            "m" => cx.normal(n, 0.0, 0.1),
                            "u" => vec![0.0; n],
                            _ => cx.normal(n, 0.0, 1.0),
                        });
                    }
                    let names: Vec<&'static str> = r
                        .tensors
                        .iter()
                        .map(|t| match t.as_str() {
                            "p" => "p",
                            "g" => "g",
                            "m" => "exp_avg",
                            "v" => "exp_avg_sq",
                            "u" => "result u",
                            _ => "tensor",
                        })
                        .collect();
                    bit_check(cx, &kernel, &prog, host, &scalars, &names)
                },
            ));
        }
    }
    // (m, n, left, right, big).
    let shapes = [
        (3, 50, true, true, false),
        (50, 783, true, false, false),
        (50, 783, false, true, false),
        (783, 50, true, true, false),
        (1, 783, false, false, false),
        (783, 3072, true, true, true),
    ];
    let runs = shapes.into_iter().flat_map(|c| {
        [false, true].into_iter().flat_map(move |back| {
            let bf16 = (c.2 || c.3)
                .then_some([
                    (c, back, gopt::SoapProjections::Bf16, false),
                    (c, back, gopt::SoapProjections::Bf16, true),
                ])
                .into_iter()
                .flatten();
            std::iter::once((c, back, gopt::SoapProjections::Fp32Storage, false)).chain(bf16)
        })
    });
    for ((m, n, left, right, big), back, proj, cache) in runs {
        let size = format!(
            "[{m}, {n}] Q_L={} Q_R={} {}",
            left as u8,
            right as u8,
            if back { "back" } else { "forward" }
        );
        let (name, tol) = match (proj, cache) {
            (gopt::SoapProjections::Fp32Storage, _) => ("project", TOL_F32),
            (gopt::SoapProjections::Bf16, false) => ("project_bf16", TOL_BF16),
            (gopt::SoapProjections::Bf16, true) => ("project_bf16_cached", TOL_BF16),
        };
        v.push(case(name, size, tol, big, move |cx| {
            let x = cx.normal(m * n, 0.0, 1.0);
            let ql = if left { Some(orthogonal(cx, m)?) } else { None };
            let qr = if right {
                Some(orthogonal(cx, n)?)
            } else {
                None
            };
            let xb = cx.up(&x)?;
            let out = cx.out(m * n)?;
            let qlb = ql.as_deref().map(|q| cx.up(q)).transpose()?;
            let qrb = qr.as_deref().map(|q| cx.up(q)).transpose()?;
            let scratch = cx.out(gopt::project_scratch_len(m, n, left, right, proj).max(1))?;
            let mut shadow = |q: &Option<Buf>, d: usize| -> Result<Option<Buf>> {
                match q {
                    Some(q) if cache => {
                        let b = cx.raw(Elem::BF16, d * d)?;
                        crate::gemm::cast_f32_to_bf16(cx.dev, q, &b)?;
                        Ok(Some(b))
                    }
                    _ => Ok(None),
                }
            };
            let (qls, qrs) = (shadow(&qlb, m)?, shadow(&qrb, n)?);
            let ms = cx.timed(|| {
                gopt::project(
                    cx.dev,
                    &xb,
                    &out,
                    qlb.as_ref(),
                    qrb.as_ref(),
                    m,
                    n,
                    back,
                    &scratch,
                    proj,
                    [qls.as_ref(), qrs.as_ref()],
                )
            })?;
            let (ql64, qr64) = (ql.as_deref().map(wide), qr.as_deref().map(wide));
            let want = if back {
                optim::project_back(&wide(&x), ql64.as_deref(), qr64.as_deref(), m, n)
            } else {
                optim::project(&wide(&x), ql64.as_deref(), qr64.as_deref(), m, n)
            };
            let errs = vec![("out", rel_err(&cx.down(&out)?, &want))];
            Ok(Outcome { errs, gpu_ms: ms })
        }));
    }
}

/// The kernels generated from element-wise update rules (AdamW as a rule, and every optimizer
/// of `optim::optimizers`, simplified with `optim::update`'s egg rules) against the same rules
/// interpreted on the host in f32: bit for bit (an error of 1 where any bit of any output
/// differs), on warm random states of awkward lengths (second moments positive).
fn update_rules(v: &mut Vec<Case>) {
    use optim::optimizers::{self, step_scalars, update_rule, DEFINITIONS};
    use optim::update::{adamw_rule, simplify, Program, UpdateRule};
    use schedule::BufferClass;
    // The rule of `which`, whether each state tensor is a second moment, and step 3's scalars.
    fn build(which: &str) -> std::result::Result<(UpdateRule, Vec<bool>, Vec<f32>), String> {
        if which == "adamw" {
            let t = 3;
            let scalars = vec![
                (1.0 - 3e-4 * 0.1) as f32,
                (3e-4 / (1.0 - 0.9f64.powi(t))) as f32,
                (1.0 - 0.95f64.powi(t)).sqrt() as f32,
            ];
            return Ok((adamw_rule(0.9, 0.95, 1e-8, 0.1), vec![false, true], scalars));
        }
        let d = optimizers::find(which).ok_or("no such definition")?;
        // Weight decay where the optimizer has it (so `decay` is a step scalar, not 1).
        let hyper: Vec<(String, f64)> = d
            .defaults()
            .into_iter()
            .filter(|(k, _)| k == "weight_decay")
            .map(|(k, _)| (k, 0.1))
            .collect();
        let rule = d.plan_rule(&hyper).map_err(|e| e.to_string())?;
        let second = d
            .state
            .iter()
            .map(|s| s.class == BufferClass::ExpAvgSq)
            .collect();
        let scalars = step_scalars(&rule, 3e-4, 3);
        Ok((
            update_rule(&rule).map_err(|e| e.to_string())?,
            second,
            scalars,
        ))
    }
    let names: Vec<&'static str> = std::iter::once("adamw")
        .chain(DEFINITIONS.iter().map(|d| d.name))
        .collect();
    for (n, big) in [(1usize, false), (1037, false), (4096 * 783 + 5, true)] {
        for &which in &names {
            v.push(case(
                "update_rule",
                format!("{which} n={n}"),
                0.0,
                big,
                move |cx| {
                    let (rule, second, scalars) = build(which).map_err(cpu)?;
                    let (expr, _) = simplify(&rule.expr);
                    let rule = UpdateRule { expr, ..rule };
                    let kernel = gopt::UpdateKernel::new(cx.dev, &rule)?;
                    let prog = Program::new(&rule).map_err(cpu)?;
                    // p, g, then the state (second moments > 0: a warm state).
                    let mut host: Vec<Vec<f32>> =
                        vec![cx.normal(n, 0.0, 1.0), cx.normal(n, 0.0, 1.0)];
                    for &sq in &second {
                        host.push(if sq {
                            cx.uniform(n, 1e-4, 1e-2)
                        } else {
                            cx.normal(n, 0.0, 0.1)
                        });
                    }
                    let names: Vec<&'static str> = rule
                        .tensors
                        .iter()
                        .enumerate()
                        .map(|(i, t)| match t.as_str() {
                            "p" => "p",
                            "g" => "g",
                            _ if second.get(i - 2) == Some(&true) => "second moment",
                            _ => "state",
                        })
                        .collect();
                    bit_check(cx, &kernel, &prog, host, &scalars, &names)
                },
            ));
        }
    }
}

/// Runs an update rule's generated `kernel` on `host` (one tensor per rule tensor, uploaded)
/// and its interpreted `prog` on the host copies with the same `scalars`; each tensor's error
/// is 0 when every bit agrees, else 1, named by `names`.
fn bit_check(
    cx: &mut Ctx<'_>,
    kernel: &gopt::UpdateKernel,
    prog: &optim::update::Program,
    mut host: Vec<Vec<f32>>,
    scalars: &[f32],
    names: &[&'static str],
) -> Result<Outcome> {
    let bufs = host
        .iter()
        .map(|h| cx.up(h))
        .collect::<Result<Vec<Buf>>>()?;
    let refs: Vec<&Buf> = bufs.iter().collect();
    let ms = cx.timed(|| kernel.run(cx.dev, &refs, scalars, None))?;
    let mut slices: Vec<&mut [f32]> = host.iter_mut().map(|h| h.as_mut_slice()).collect();
    prog.run(&mut slices, scalars).map_err(cpu)?;
    let mut errs = Vec::new();
    for ((b, h), &name) in bufs.iter().zip(&host).zip(names) {
        let got = cx.down(b)?;
        let same =
            got.len() == h.len() && got.iter().zip(h).all(|(a, b)| a.to_bits() == b.to_bits());
        errs.push((name, if same { 0.0 } else { 1.0 }));
    }
    Ok(Outcome { errs, gpu_ms: ms })
}

/// Parameter change `new − old` of the GPU (f64) and the reference.
pub(super) fn delta(new: &[f32], old: &[f32]) -> Vec<f32> {
    new.iter()
        .zip(old)
        .map(|(&a, &b)| ((a as f64) - (b as f64)) as f32)
        .collect()
}

/// The reference's parameter change `new − old` (f64).
pub(super) fn delta64(new: &[f64], old: &[f32]) -> Vec<f64> {
    new.iter().zip(old).map(|(&a, &b)| a - b as f64).collect()
}

fn clip(v: &mut Vec<Case>) {
    for (max_norm, label) in [(Some(0.5), "clip to 0.5·norm"), (None, "no clipping")] {
        let sizes = [3usize, 783 * 50, 4096 * 783];
        let size = format!("{sizes:?} {label}");
        v.push(case("clip_grad_norm", size, TOL_F32, false, move |cx| {
            let grads: Vec<Vec<f32>> = sizes.iter().map(|&n| cx.normal(n, 0.0, 1.0)).collect();
            let bufs = grads
                .iter()
                .map(|g| cx.up(g))
                .collect::<Result<Vec<Buf>>>()?;
            let norm = cx.out(1)?;
            let scratch = cx.out(gloss::clip_grad_norm_scratch_len(grads.len()))?;
            // Reference norm first, to pick a max_norm that clips.
            let wides: Vec<Vec<f64>> = grads.iter().map(|g| wide(g)).collect();
            let ref_norm = engine::cpu::clip::global_norm(
                &wides.iter().map(Vec::as_slice).collect::<Vec<_>>(),
            );
            let max = max_norm.map(|f| f * ref_norm);
            let refs: Vec<&Buf> = bufs.iter().collect();
            let ms =
                cx.timed(|| gloss::clip_grad_norm(cx.dev, &refs, &norm, None, max, &scratch))?;
            let mut clipped = wides.clone();
            if let Some(m) = max {
                let mut views: Vec<&mut [f64]> =
                    clipped.iter_mut().map(Vec::as_mut_slice).collect();
                engine::cpu::clip::clip_to(&mut views, ref_norm, m);
            }
            let mut errs = vec![("norm", rel_err(&cx.down(&norm)?, &[ref_norm]))];
            for (i, b) in bufs.iter().enumerate() {
                errs.push((
                    ["grad0", "grad1", "grad2"][i],
                    rel_err(&cx.down(b)?, &clipped[i]),
                ));
            }
            Ok(Outcome { errs, gpu_ms: ms })
        }));
    }
}

/// `fuse`'s `clip-into-update`: the clip writes its factor (`scale`) and AdamW reads
/// `grad · scale`, against the clip scaling the gradients in place and AdamW reading them —
/// bit-identical parameters and moments (clipping and not; lengths with a scalar tail).
fn clip_into_adamw(v: &mut Vec<Case>) {
    for (clip_to, label) in [(Some(0.5), "clip to 0.5·norm"), (None, "no clipping")] {
        let sizes = [3usize, 783 * 50 + 1, 4096 * 783];
        let size = format!("{sizes:?} {label}");
        v.push(case("clip_into_adam_w", size, 0.0, false, move |cx| {
            let s = gopt::AdamWStep {
                t: 3,
                lr: 0.05,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
            };
            let grads: Vec<Vec<f32>> = sizes.iter().map(|&n| cx.normal(n, 0.0, 1.0)).collect();
            let params: Vec<Vec<f32>> = sizes.iter().map(|&n| cx.normal(n, 0.0, 1.0)).collect();
            let wides: Vec<Vec<f64>> = grads.iter().map(|g| wide(g)).collect();
            let ref_norm = engine::cpu::clip::global_norm(
                &wides.iter().map(Vec::as_slice).collect::<Vec<_>>(),
            );
            let max = clip_to.map(|f| f * ref_norm);
            let scratch = cx.out(gloss::clip_grad_norm_scratch_len(sizes.len()))?;
            // [unfused, fused]: each its own gradients, parameters and moments.
            let mut finals = Vec::new();
            let mut ms = 0.0;
            for fused in [false, true] {
                let gb = grads
                    .iter()
                    .map(|g| cx.up(g))
                    .collect::<Result<Vec<Buf>>>()?;
                let pb = params
                    .iter()
                    .map(|p| cx.up(p))
                    .collect::<Result<Vec<Buf>>>()?;
                let mut mb = Vec::new();
                let mut vb = Vec::new();
                for &n in &sizes {
                    mb.push(cx.up(&vec![0.0f32; n])?);
                    vb.push(cx.up(&vec![0.0f32; n])?);
                }
                let (norm, scale) = (cx.out(1)?, cx.out(1)?);
                let refs: Vec<&Buf> = gb.iter().collect();
                let sc = fused.then_some(&scale);
                let t = cx.timed(|| {
                    gloss::clip_grad_norm(cx.dev, &refs, &norm, sc, max, &scratch)?;
                    for i in 0..sizes.len() {
                        gopt::adamw(cx.dev, &s, &pb[i], &gb[i], &mb[i], &vb[i], sc)?;
                    }
                    Ok(())
                })?;
                if fused {
                    ms = t;
                }
                let mut out = Vec::new();
                for b in pb.iter().chain(&mb).chain(&vb) {
                    out.push(cx.down(b)?);
                }
                finals.push(out);
            }
            let same = finals[0]
                .iter()
                .zip(&finals[1])
                .all(|(a, b)| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
            Ok(super::cases::one(
                "param, moments bits",
                if same { 0.0 } else { 1.0 },
                ms,
            ))
        }));
    }
}

/// Gradients streamed to host memory (`prefetch-insertion`): each gradient's sum of squares
/// into its slot of the plan's partials buffer (`grad_sum_squares`), the clip from those
/// partials (`clip_grad_norm_partials`) and the scaling where each gradient comes back
/// (`scale_by_scalar`), against the clip reading the gradients and scaling them in place —
/// the same norm and the same gradient bits (clipping and not; awkward lengths).
fn clip_from_partials(v: &mut Vec<Case>) {
    for (clip_to, label) in [(Some(0.5), "clip to 0.5·norm"), (None, "no clipping")] {
        let sizes = [3usize, 783 * 50 + 1, 4096 * 783];
        let size = format!("{sizes:?} {label}");
        v.push(case(
            "clip_grad_norm_partials",
            size,
            0.0,
            false,
            move |cx| {
                let grads: Vec<Vec<f32>> = sizes.iter().map(|&n| cx.normal(n, 0.0, 1.0)).collect();
                let wides: Vec<Vec<f64>> = grads.iter().map(|g| wide(g)).collect();
                let ref_norm = engine::cpu::clip::global_norm(
                    &wides.iter().map(Vec::as_slice).collect::<Vec<_>>(),
                );
                let max = clip_to.map(|f| f * ref_norm);
                // In place, from the gradients.
                let direct = grads
                    .iter()
                    .map(|g| cx.up(g))
                    .collect::<Result<Vec<Buf>>>()?;
                let (norm0, norm1, scale) = (cx.out(1)?, cx.out(1)?, cx.out(1)?);
                let scratch = cx.out(gloss::clip_grad_norm_scratch_len(sizes.len()))?;
                let refs: Vec<&Buf> = direct.iter().collect();
                gloss::clip_grad_norm(cx.dev, &refs, &norm0, None, max, &scratch)?;
                // From partials, the slots written in reverse order (as a backward finishes them).
                let streamed = grads
                    .iter()
                    .map(|g| cx.up(g))
                    .collect::<Result<Vec<Buf>>>()?;
                let partials = cx.out(2 * schedule::reserve::SUMSQ_BLOCKS * sizes.len())?;
                let ms = cx.timed(|| {
                    for (i, g) in streamed.iter().enumerate().rev() {
                        gloss::grad_sum_squares(cx.dev, g, &partials, i)?;
                    }
                    gloss::clip_grad_norm_partials(cx.dev, &partials, &norm1, &scale, max)?;
                    if max.is_some() {
                        for g in &streamed {
                            gloss::scale_by_scalar(cx.dev, g, &scale)?;
                        }
                    }
                    Ok(())
                })?;
                let bits =
                    |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                let mut same = bits(&cx.down(&norm0)?, &cx.down(&norm1)?);
                for (a, b) in direct.iter().zip(&streamed) {
                    same &= bits(&cx.down(a)?, &cx.down(b)?);
                }
                Ok(super::cases::one(
                    "norm, gradient bits",
                    if same { 0.0 } else { 1.0 },
                    ms,
                ))
            },
        ));
    }
}

/// Gradient accumulation over micro-batches (`grad_accumulate`, the plan's `GradAccumulate`):
/// three micro-batch gradients folded in with scale 1/3 (store on the first, add after)
/// against the CPU engine's loop (`engine::cpu::exec`: product and sum each rounded once), bit
/// for bit, at awkward lengths (the float4 body and the scalar tail).
fn grad_accumulate(v: &mut Vec<Case>) {
    for n in [1usize, 4099, 783 * 4096 + 3] {
        v.push(case(
            "grad_accumulate",
            format!("n={n} micro-batches=3"),
            0.0,
            false,
            move |cx| {
                let k = 3;
                let scale = 1.0 / k as f64;
                let micros: Vec<Vec<f32>> = (0..k).map(|_| cx.normal(n, 0.0, 1.0)).collect();
                let bufs = micros
                    .iter()
                    .map(|m| cx.up(m))
                    .collect::<Result<Vec<Buf>>>()?;
                // NaN in the total before the first micro-batch: it must be overwritten, not
                // read (a leak fails the bit comparison).
                let total = cx.up(&vec![f32::NAN; n])?;
                let ms = cx.timed(|| {
                    for (i, b) in bufs.iter().enumerate() {
                        gloss::grad_accumulate(cx.dev, b, &total, scale, i == 0)?;
                    }
                    Ok(())
                })?;
                let s = scale as f32;
                let mut want = vec![0f32; n];
                for (i, m) in micros.iter().enumerate() {
                    for (w, &x) in want.iter_mut().zip(m) {
                        let p = x * s;
                        *w = if i == 0 { p } else { *w + p };
                    }
                }
                let got = cx.down(&total)?;
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                Ok(super::cases::one(
                    "total bits",
                    if same { 0.0 } else { 1.0 },
                    ms,
                ))
            },
        ));
    }
}

fn adamw(v: &mut Vec<Case>) {
    for (n, wd, big) in [
        (3usize, 0.1, false),
        (783 * 50, 0.0, false),
        (783 * 4096, 0.1, true),
    ] {
        let size = format!("n={n} t=7 wd={wd}");
        v.push(case("adam_w", size, TOL_F32, big, move |cx| {
            let s = gopt::AdamWStep {
                t: 7,
                lr: 0.05,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: wd,
            };
            let p = cx.normal(n, 0.0, 1.0);
            let g = cx.normal(n, 0.0, 0.1);
            let m = cx.normal(n, 0.0, 0.05);
            let vv = cx.uniform(n, 0.005, 0.015);
            let (pb, gb, mb, vb) = (cx.up(&p)?, cx.up(&g)?, cx.up(&m)?, cx.up(&vv)?);
            let ms = cx.timed(|| gopt::adamw(cx.dev, &s, &pb, &gb, &mb, &vb, None))?;
            let (mut rp, mut rm, mut rv) = (wide(&p), wide(&m), wide(&vv));
            let hp = optim::AdamWParams {
                lr: s.lr,
                beta1: s.beta1,
                beta2: s.beta2,
                eps: s.eps,
                weight_decay: s.weight_decay,
            };
            optim::adamw_update(s.t, &hp, &mut rp, &wide(&g), &mut rm, &mut rv).map_err(cpu)?;
            let errs = vec![
                (
                    "param delta",
                    rel_err(&delta(&cx.down(&pb)?, &p), &delta64(&rp, &p)),
                ),
                ("exp_avg", rel_err(&cx.down(&mb)?, &rm)),
                ("exp_avg_sq", rel_err(&cx.down(&vb)?, &rv)),
            ];
            Ok(Outcome { errs, gpu_ms: ms })
        }));
    }
}

/// A random `[d, d]` orthogonal matrix (QR of a Gaussian matrix), rounded to f32.
pub(super) fn orthogonal(cx: &mut Ctx<'_>, d: usize) -> Result<Vec<f32>> {
    let a: Vec<f64> = (0..d * d).map(|_| cx.rng.normal()).collect();
    let q = optim::thin_qr_q(&a, d, d).map_err(cpu)?;
    Ok(q.iter().map(|&x| x as f32).collect())
}

fn soap(v: &mut Vec<Case>) {
    // (m, n, left basis, right basis, normalize_grads, correct_bias, weight decay, big). With a
    // basis and without normalize_grads the last projection GEMM applies the update (α/β), so
    // both weight-decay branches (β = 1 and β = 1 − lr·wd) are covered there.
    let configs = [
        (3, 50, true, true, false, true, 0.01, false),
        (3, 50, true, true, false, true, 0.0, false),
        (783, 50, true, true, true, true, 0.01, false),
        (50, 783, true, false, false, true, 0.01, false),
        (50, 783, true, false, false, true, 0.0, false),
        (50, 783, false, true, false, false, 0.01, false),
        (50, 783, true, false, true, true, 0.01, false),
        (50, 783, false, true, true, true, 0.01, false),
        (1, 783, false, false, false, true, 0.01, false),
        (783, 783, true, true, false, true, 0.01, true),
    ];
    // Each with the fp32 projections (`soap_update`, fp32 tolerance) and, where there is a
    // basis, the bf16 ones (operands rounded to bf16, bf16 tolerance): bases cast inside
    // (`soap_update_bf16`) and bf16 bases handed in as the engine's cached shadows
    // (`soap_update_bf16_cached`).
    let runs = configs.into_iter().flat_map(|c| {
        let bf16 = (c.2 || c.3)
            .then_some([
                (c, gopt::SoapProjections::Bf16, false),
                (c, gopt::SoapProjections::Bf16, true),
            ])
            .into_iter()
            .flatten();
        std::iter::once((c, gopt::SoapProjections::Fp32Storage, false)).chain(bf16)
    });
    for ((m, n, left, right, normalize, correct, wd, big), proj, cache) in runs {
        let size = format!(
            "[{m}, {n}] Q_L={} Q_R={} norm={} bias_corr={} wd={wd} t=5",
            left as u8, right as u8, normalize as u8, correct as u8
        );
        let (name, tol) = match (proj, cache) {
            (gopt::SoapProjections::Fp32Storage, _) => ("soap_update", TOL_F32),
            (gopt::SoapProjections::Bf16, false) => ("soap_update_bf16", TOL_BF16),
            (gopt::SoapProjections::Bf16, true) => ("soap_update_bf16_cached", TOL_BF16),
        };
        v.push(case(name, size, tol, big, move |cx| {
            let hp = SoapHyper {
                lr: 0.0,
                beta1: 0.95,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: wd,
                correct_bias: correct,
                normalize_grads: normalize,
            };
            let (t, lr) = (5u64, 0.5);
            let p = cx.normal(m * n, 0.0, 1.0);
            let g = cx.normal(m * n, 0.0, 1.0);
            let ea = cx.normal(m * n, 0.0, 0.3);
            let eas = cx.uniform(m * n, 0.5, 1.5);
            let ql = if left { Some(orthogonal(cx, m)?) } else { None };
            let qr = if right {
                Some(orthogonal(cx, n)?)
            } else {
                None
            };
            let (pb, gb, eb, sb) = (cx.up(&p)?, cx.up(&g)?, cx.up(&ea)?, cx.up(&eas)?);
            let qlb = ql.as_deref().map(|q| cx.up(q)).transpose()?;
            let qrb = qr.as_deref().map(|q| cx.up(q)).transpose()?;
            let scratch = cx.out(gopt::soap_update_scratch_len(m, n, left, right, proj))?;
            // The engine's bf16 shadows of the bases, cast before the timed call.
            let mut shadow = |q: &Option<Buf>, d: usize| -> Result<Option<Buf>> {
                match q {
                    Some(q) if cache => {
                        let b = cx.raw(Elem::BF16, d * d)?;
                        crate::gemm::cast_f32_to_bf16(cx.dev, q, &b)?;
                        Ok(Some(b))
                    }
                    _ => Ok(None),
                }
            };
            let (qls, qrs) = (shadow(&qlb, m)?, shadow(&qrb, n)?);
            let ms = cx.timed(|| {
                gopt::soap_update(
                    cx.dev,
                    t,
                    lr,
                    &hp,
                    &pb,
                    &gb,
                    &eb,
                    &sb,
                    qlb.as_ref(),
                    qrb.as_ref(),
                    m,
                    n,
                    &scratch,
                    proj,
                    [qls.as_ref(), qrs.as_ref()],
                )
            })?;
            let (mut rp, mut re, mut rs) = (wide(&p), wide(&ea), wide(&eas));
            let params = optim::SoapParams {
                beta1: hp.beta1,
                beta2: hp.beta2,
                eps: hp.eps,
                weight_decay: hp.weight_decay,
                correct_bias: hp.correct_bias,
                normalize_grads: hp.normalize_grads,
            };
            let (ql64, qr64) = (ql.as_deref().map(wide), qr.as_deref().map(wide));
            optim::soap_update(
                t,
                lr,
                &params,
                &mut rp,
                &wide(&g),
                &mut re,
                &mut rs,
                ql64.as_deref(),
                qr64.as_deref(),
                m,
                n,
            )
            .map_err(cpu)?;
            let errs = vec![
                (
                    "param delta",
                    rel_err(&delta(&cx.down(&pb)?, &p), &delta64(&rp, &p)),
                ),
                ("exp_avg", rel_err(&cx.down(&eb)?, &re)),
                ("exp_avg_sq", rel_err(&cx.down(&sb)?, &rs)),
            ];
            Ok(Outcome { errs, gpu_ms: ms })
        }));
    }
    // The factor accumulation with fp32 operands, and with the gradient cast to bf16
    // (`soap_factor_update_bf16`, bf16 tolerance).
    let shapes = [(50usize, 783usize), (783, 3)];
    let runs = shapes.into_iter().flat_map(|s| {
        [
            (s, gopt::SoapProjections::Fp32Storage),
            (s, gopt::SoapProjections::Bf16),
        ]
    });
    for ((m, n), proj) in runs {
        let (name, tol) = match proj {
            gopt::SoapProjections::Fp32Storage => ("soap_factor_update", TOL_F32),
            gopt::SoapProjections::Bf16 => ("soap_factor_update_bf16", TOL_BF16),
        };
        v.push(case(
            name,
            format!("G [{m}, {n}] beta=0.95"),
            tol,
            false,
            move |cx| {
                let g = cx.normal(m * n, 0.0, 1.0);
                let sym = |cx: &mut Ctx<'_>, d: usize| -> Vec<f32> {
                    let a = cx.normal(d * d, 0.0, 1.0);
                    (0..d * d)
                        .map(|i| 0.5 * (a[i] + a[(i % d) * d + i / d]))
                        .collect()
                };
                let (l0, r0) = (sym(cx, m), sym(cx, n));
                let (gb, lb, rb) = (cx.up(&g)?, cx.up(&l0)?, cx.up(&r0)?);
                let scratch =
                    cx.out(gopt::soap_factor_update_scratch_len(m, n, true, true, proj).max(1))?;
                let ms = cx.timed(|| {
                    gopt::soap_factor_update(
                        cx.dev,
                        &gb,
                        Some(&lb),
                        Some(&rb),
                        m,
                        n,
                        0.95,
                        &scratch,
                        proj,
                    )
                })?;
                let (mut rl, mut rr) = (wide(&l0), wide(&r0));
                optim::soap_factor_update(&wide(&g), Some(&mut rl), Some(&mut rr), m, n, 0.95)
                    .map_err(cpu)?;
                let errs = vec![
                    ("L", rel_err(&cx.down(&lb)?, &rl)),
                    ("R", rel_err(&cx.down(&rb)?, &rr)),
                ];
                Ok(Outcome { errs, gpu_ms: ms })
            },
        ));
    }
}
