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
