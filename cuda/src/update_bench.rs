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
    let mut rules: Vec<(String, UpdateRule)> = Vec::new();
    for d in optim::optimizers::DEFINITIONS {
        let r = d
            .plan_rule(&[("weight_decay".into(), wd)])
            .map_err(|e| invalid(e.to_string()))?;
        let r = optim::optimizers::update_rule(&r).map_err(|e| invalid(e.to_string()))?;
        rules.push((d.name.to_string(), r));
    }
    let adamw = op::AdamWKernel::new(&dev, beta1, beta2, eps, wd)?;
    let mut compiled = Vec::new();
    for (name, r) in rules {
        let (expr, _) = simplify(&r.expr);
        let r = UpdateRule { expr, ..r };
        let k = op::UpdateKernel::new(&dev, &r)?;
        compiled.push((name, k, r));
    }
    let mut rows = Vec::new();
    for &n in sizes {
        let bytes = 4 * n.next_multiple_of(64) * 4 + 4096;
        let mut arena = dev.arena("bench-update", Tier::Device, bytes)?;
        let bufs: Vec<Buf> = (0..4)
            .map(|_| arena.buf(Elem::F32, n))
            .collect::<Result<_>>()?;
        let host: Vec<f32> = (0..n)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-4)
            .collect();
        let sq: Vec<f32> = (0..n).map(|i| 1e-4 + (i % 97) as f32 * 1e-5).collect();
        dev.upload(&bufs[0], &host)?;
        dev.upload(&bufs[1], &host)?;
        dev.upload(&bufs[2], &host)?;
        dev.upload(&bufs[3], &sq)?;
        let step = op::AdamWStep {
            t: 3,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay: wd,
        };
        let scalars_adamw = [
            (1.0 - lr * wd) as f32,
            (lr / (1.0 - beta1.powi(3))) as f32,
            (1.0 - beta2.powi(3)).sqrt() as f32,
        ];
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
            for (name, k, r) in &compiled {
                let tensors: Vec<&Buf> = bufs[..r.tensors.len()].iter().collect();
                let _ = name;
                let scalars: Vec<f32> = r
                    .scalars
                    .iter()
                    .map(|s| match s.as_str() {
                        "lr" => lr as f32,
                        "decay" => (1.0 - lr * wd) as f32,
                        "step_size" => scalars_adamw[1],
                        _ => scalars_adamw[2],
                    })
                    .collect();
                gen.push(time(&|| k.run(&dev, &tensors, &scalars, None))?);
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
