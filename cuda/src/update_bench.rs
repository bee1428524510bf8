//! `asteria bench update-kernels`: the element-wise optimizer update kernels on a CUDA device,
//! all generated from update rules through NVRTC: the engine's AdamW (`ops::optim::AdamWKernel`,
//! from `optim::update::adamw_rule`) and every optimizer of `optim::optimizers`, on the same
//! buffers, alternating, GPU time by CUDA events. (This benchmark decided that the generated
//! AdamW replaces the hand-written kernel: same time on the H200, BENCHMARKS.md.)
use crate::device::{Device, StreamKind};
use crate::error::{CudaError, Result, Tier};
use crate::memory::{Buf, Elem};
use crate::ops::optim as op;

/// One size's medians.
#[derive(Clone, Debug)]
pub struct UpdateBenchRow {
    /// The kernel (`adamw`, `lion`, ...).
    pub kernel: String,
    /// Elements per tensor.
    pub n: usize,
    /// Median GPU milliseconds per update.
    pub median_ms: f64,
    /// Effective bandwidth: bytes read and written per update over the median time, GB/s.
    pub gb_per_s: f64,
}

fn invalid(what: String) -> CudaError {
    CudaError::Invalid {
        op: "bench update-kernels",
        what,
    }
}

/// Times each kernel `reps` times per size (medians; the kernels alternate within each rep so
/// that clocks and neighbours affect them alike).
///
/// # Errors
/// Device, NVRTC or launch errors; a definition whose rule does not build.
pub fn update_kernels(ordinal: usize, sizes: &[usize], reps: usize) -> Result<Vec<UpdateBenchRow>> {
    use optim::update::{simplify, UpdateRule};
    let dev = Device::new(ordinal)?;
    let (lr, beta1, beta2, eps, wd) = (3e-4, 0.9, 0.95, 1e-8, 0.1);
    // Kernels: (name, rule, tensors, bytes per element).
    // (name, rule, this step's scalars)
    let mut rules: Vec<(String, UpdateRule, Vec<f32>)> = Vec::new();
    for d in optim::optimizers::DEFINITIONS {
        let hyper: Vec<(String, f64)> = d
            .defaults()
            .into_iter()
            .filter(|(k, _)| k == "weight_decay")
            .map(|(k, _)| (k, wd))
            .collect();
        let plan_rule = d.plan_rule(&hyper).map_err(|e| invalid(e.to_string()))?;
        let scalars: Vec<f32> = optim::optimizers::step_scalars(&plan_rule, lr, 3);
        let r = optim::optimizers::update_rule(&plan_rule).map_err(|e| invalid(e.to_string()))?;
        rules.push((d.name.to_string(), r, scalars));
    }
    let adamw = op::AdamWKernel::new(&dev, beta1, beta2, eps, wd)?;
    let mut compiled = Vec::new();
    for (name, r, scalars) in rules {
        let (expr, _) = simplify(&r.expr);
        let r = UpdateRule { expr, ..r };
        let k = op::UpdateKernel::new(&dev, &r)?;
        compiled.push((name, k, r, scalars));
    }
    // Enough buffers for the widest rule (AdamW's four at least).
    let width = compiled
        .iter()
        .map(|c| c.2.tensors.len())
        .max()
        .unwrap_or(0)
        .max(4);
    let mut rows = Vec::new();
    for &n in sizes {
        let bytes = width * n.next_multiple_of(64) * 4 + 4096;
        let mut arena = dev.arena("bench-update", Tier::Device, bytes)?;
        let bufs: Vec<Buf> = (0..width)
            .map(|_| arena.buf(Elem::F32, n))
            .collect::<Result<_>>()?;
        let host: Vec<f32> = (0..n)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-4)
            .collect();
        let sq: Vec<f32> = (0..n).map(|i| 1e-4 + (i % 97) as f32 * 1e-5).collect();
        // p, g, m: signed values; every further tensor positive (a second moment's range).
        for (i, b) in bufs.iter().enumerate() {
            dev.upload(b, if i < 3 { &host } else { &sq })?;
        }
        let step = op::AdamWStep {
            t: 3,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay: wd,
        };
        let time = |f: &dyn Fn() -> Result<()>| -> Result<f64> {
            let a = dev.record(StreamKind::Compute, true)?;
            f()?;
            let b = dev.record(StreamKind::Compute, true)?;
            b.synchronize()?;
            Ok(f64::from(a.elapsed_ms(&b)?))
        };
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); 1 + compiled.len()];
        for rep in 0..=reps {
            let hand =
                time(&|| adamw.run(&dev, &step, &bufs[0], &bufs[1], &bufs[2], &bufs[3], None))?;
            let mut gen = Vec::new();
            for (_, k, r, scalars) in &compiled {
                let tensors: Vec<&Buf> = bufs[..r.tensors.len()].iter().collect();
                gen.push(time(&|| k.run(&dev, &tensors, scalars, None))?);
            }
            if rep == 0 {
                continue; // warm-up
            }
            samples[0].push(hand);
            for (i, g) in gen.into_iter().enumerate() {
                samples[i + 1].push(g);
            }
        }
        let names: Vec<String> = std::iter::once("adamw".to_string())
            .chain(compiled.iter().map(|c| c.0.clone()))
            .collect();
        let tensors: Vec<usize> = std::iter::once(4)
            .chain(compiled.iter().map(|c| c.2.tensors.len()))
            .collect();
        let written: Vec<usize> = std::iter::once(3)
            .chain(compiled.iter().map(|c| c.2.outputs.len()))
            .collect();
        for ((name, mut s), (t, w)) in names
            .into_iter()
            .zip(samples)
            .zip(tensors.into_iter().zip(written))
        {
            s.sort_by(f64::total_cmp);
            let median_ms = s[s.len() / 2];
            let moved = (t + w) * 4 * n;
            rows.push(UpdateBenchRow {
                kernel: name,
                n,
                median_ms,
                gb_per_s: moved as f64 / (median_ms * 1e-3) / 1e9,
            });
        }
    }
    Ok(rows)
}

/// One parameter shape's SOAP step, hand-written against composed.
#[derive(Clone, Debug)]
pub struct SoapStepRow {
    /// Parameter rows.
    pub m: usize,
    /// Parameter columns.
    pub n: usize,
    /// Eigenbases present (`[Q_L, Q_R]`; a side wider than `max_precond_dim` has none).
    pub bases: [bool; 2],
    /// Median GPU ms of the hand-written `soap_update` (what `fuse`'s `soap-update` selects).
    pub hand_ms: f64,
    /// Median GPU ms of the composed step as `expand-optimizer` writes it: `project` → the
    /// moments rule's generated kernel (result `u`) → `project` back → the step rule's kernel.
    pub composed_ms: f64,
}

/// SOAP's per-parameter step on a CUDA device at each `(m, n, bases)`, the two ways the CUDA
/// engine can run it, alternating, `reps` times (medians, CUDA events; one warm-up): the
/// hand-written `ops::optim::soap_update` and the composition of `ops::optim::project` and the
/// kernels generated from `optim::optimizers::soap::rules` (simplified), both with bf16
/// projections and the bases' bf16 shadows cached (the engine's `precision = bf16` path),
/// step 3, lr 3e-3, betas (0.95, 0.95), weight decay 0.01. This is the measurement that
/// decides whether the composed step may replace the hand-written op (issue 19).
///
/// # Errors
/// Device, cuBLAS, NVRTC or launch errors.
pub fn soap_steps(
    ordinal: usize,
    shapes: &[(usize, usize, [bool; 2])],
    reps: usize,
) -> Result<Vec<SoapStepRow>> {
    use optim::optimizers::{soap, step_scalars, update_rule};
    use optim::update::{simplify, UpdateRule};
    let dev = Device::new(ordinal)?;
    let hp = schedule::SoapHyper {
        lr: 3e-3,
        beta1: 0.95,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.01,
        correct_bias: true,
        normalize_grads: false,
    };
    let (t, lr) = (3u64, 3e-3);
    let (moments, step) = soap::rules(&hp).map_err(|e| invalid(e.to_string()))?;
    let compile = |rule: &schedule::ElementwiseRule| -> Result<(op::UpdateKernel, Vec<f32>)> {
        let r = update_rule(rule).map_err(|e| invalid(e.to_string()))?;
        let (expr, _) = simplify(&r.expr);
        let k = op::UpdateKernel::new(&dev, &UpdateRule { expr, ..r })?;
        Ok((k, step_scalars(rule, lr, t)))
    };
    let (km, sm) = compile(&moments)?;
    let (ks, ss) = compile(&step)?;
    let proj = op::SoapProjections::Bf16;
    let mut rows = Vec::new();
    for &(m, n, [left, right]) in shapes {
        let mn = m * n;
        let scratch_len = op::soap_update_scratch_len(m, n, left, right, proj)
            .max(op::project_scratch_len(m, n, left, right, proj))
            .max(1);
        let slots = |len: usize| len.next_multiple_of(64);
        let bytes = (7 * slots(mn) + slots(m * m) + slots(n * n) + slots(scratch_len)) * 4
            + (slots(m * m) + slots(n * n)) * 2
            + 8192;
        let mut arena = dev.arena("bench-soap-step", Tier::Device, bytes)?;
        let mut f32s = |len: usize| arena.buf(Elem::F32, len);
        // p, g, m, v, u (the moments rule's result), g' (projected gradient), N (projected back).
        let [p, g, ea, eas, u, gp, nb] = [(); 7].map(|_| f32s(mn));
        let (p, g, ea, eas, u, gp, nb) = (p?, g?, ea?, eas?, u?, gp?, nb?);
        let ql = left.then(|| f32s(m * m)).transpose()?;
        let qr = right.then(|| f32s(n * n)).transpose()?;
        let scratch = f32s(scratch_len)?;
        let qls = left.then(|| arena.buf(Elem::BF16, m * m)).transpose()?;
        let qrs = right.then(|| arena.buf(Elem::BF16, n * n)).transpose()?;
        let signed: Vec<f32> = (0..mn)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-4)
            .collect();
        let sq: Vec<f32> = (0..mn).map(|i| 1e-4 + (i % 97) as f32 * 1e-5).collect();
        for (b, h) in [(&p, &signed), (&g, &signed), (&ea, &signed), (&eas, &sq)] {
            dev.upload(b, h)?;
        }
        // Bases: scaled identities are enough for timing (the GEMMs do not look at values).
        for (q, s, d) in [(&ql, &qls, m), (&qr, &qrs, n)] {
            if let (Some(q), Some(s)) = (q, s) {
                let mut h = vec![0.0f32; d * d];
                for i in 0..d {
                    h[i * d + i] = 1.0;
                }
                dev.upload(q, &h)?;
                crate::gemm::cast_f32_to_bf16(&dev, q, s)?;
            }
        }
        let cached = [qls.as_ref(), qrs.as_ref()];
        let time = |f: &dyn Fn() -> Result<()>| -> Result<f64> {
            let a = dev.record(StreamKind::Compute, true)?;
            f()?;
            let b = dev.record(StreamKind::Compute, true)?;
            b.synchronize()?;
            Ok(f64::from(a.elapsed_ms(&b)?))
        };
        let hand = || {
            op::soap_update(
                &dev,
                t,
                lr,
                &hp,
                &p,
                &g,
                &ea,
                &eas,
                ql.as_ref(),
                qr.as_ref(),
                m,
                n,
                &scratch,
                proj,
                cached,
            )
        };
        let composed = || -> Result<()> {
            let (qa, qb) = (ql.as_ref(), qr.as_ref());
            op::project(&dev, &g, &gp, qa, qb, m, n, false, &scratch, proj, cached)?;
            km.run(&dev, &[&p, &gp, &ea, &eas, &u], &sm, None)?;
            op::project(&dev, &u, &nb, qa, qb, m, n, true, &scratch, proj, cached)?;
            ks.run(&dev, &[&p, &nb], &ss, None)
        };
        let (mut hs, mut cs) = (Vec::new(), Vec::new());
        for rep in 0..=reps {
            let (h, c) = (time(&hand)?, time(&composed)?);
            if rep > 0 {
                hs.push(h);
                cs.push(c);
            }
        }
        let median = |mut s: Vec<f64>| {
            s.sort_by(f64::total_cmp);
            s.get(s.len() / 2).copied().unwrap_or(f64::NAN)
        };
        rows.push(SoapStepRow {
            m,
            n,
            bases: [left, right],
            hand_ms: median(hs),
            composed_ms: median(cs),
        });
    }
    Ok(rows)
}

/// [`soap_steps`]' rows as a text table (one line per shape, the composed / hand-written
/// time ratio last).
pub fn soap_table(rows: &[SoapStepRow]) -> String {
    use std::fmt::Write as _;
    let mut s = format!(
        "{:<24} {:>9} {:>16} {:>12} {:>18}\n",
        "SOAP step [m, n]", "bases", "hand-written ms", "composed ms", "composed / hand"
    );
    for r in rows {
        let bases = format!(
            "{}{}",
            if r.bases[0] { "L" } else { "-" },
            if r.bases[1] { "R" } else { "-" }
        );
        let _ = writeln!(
            s,
            "{:<24} {:>9} {:>16.4} {:>12.4} {:>18.3}",
            format!("[{}, {}]", r.m, r.n),
            bases,
            r.hand_ms,
            r.composed_ms,
            r.composed_ms / r.hand_ms
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::{soap_table, SoapStepRow};

    #[test]
    fn soap_table_has_a_line_per_shape_with_the_ratio() {
        let rows = [
            SoapStepRow {
                m: 768,
                n: 2304,
                bases: [true, true],
                hand_ms: 0.2,
                composed_ms: 0.1,
            },
            SoapStepRow {
                m: 5632,
                n: 2048,
                bases: [false, true],
                hand_ms: 0.4,
                composed_ms: 0.3,
            },
        ];
        let t = soap_table(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(
            lines[1].starts_with("[768, 2304]")
                && lines[1].contains(" LR ")
                && lines[1].ends_with("0.500")
        );
        assert!(lines[2].contains(" -R ") && lines[2].ends_with("0.750"));
    }
}
