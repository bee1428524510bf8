//! Trains one plan on the CPU engine and on the CUDA engine in the same process, with the same
//! seed, data and schedule (`engine::train_with` for both), and compares the training loss of
//! every step and the validation losses: the end-to-end check that the GPU interpreter
//! (dispatch, init, optimizer, refreshes) has the CPU engine's semantics.
//!
//! The GPU side runs with `precision = fp32` (plain fp32 GEMMs, no TF32) whatever the plan
//! says, so the only differences are rounding (summation order, fused kernels).
use crate::engine::{CudaEngine, CudaOptions, RefreshMode};
use engine::{train_with, CpuEngine, EngineOptions, StepExecutor, TrainOptions};
use schedule::{Plan, Precision, TargetPlan};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

/// Options of [`train_match`].
#[derive(Clone, Debug)]
pub struct MatchOptions {
    /// Steps to train (default 20).
    pub steps: u64,
    /// Largest allowed `|gpu − cpu| / |cpu|` of any step's loss (default 1e-4).
    pub tol: f64,
    /// Where the GPU engine refreshes eigenbases.
    pub refresh: RefreshMode,
    /// Token cache folder.
    pub cache_dir: Option<PathBuf>,
    /// CPU engine threads (`None` = all cores).
    pub threads: Option<usize>,
}

impl Default for MatchOptions {
    fn default() -> Self {
        MatchOptions {
            steps: 20,
            tol: 1e-4,
            refresh: RefreshMode::Gpu,
            cache_dir: None,
            threads: None,
        }
    }
}

/// The outcome of [`train_match`].
#[derive(Clone, Debug)]
pub struct MatchReport {
    /// The plan's name.
    pub name: String,
    /// The GPU engine's description.
    pub gpu: String,
    /// Per-step training losses, CPU.
    pub cpu_losses: Vec<f64>,
    /// Per-step training losses, GPU.
    pub gpu_losses: Vec<f64>,
    /// Validation losses `(step, cpu, gpu)`.
    pub val: Vec<(u64, f64, f64)>,
    /// Largest relative difference of a training loss.
    pub max_rel: f64,
    /// Tolerance.
    pub tol: f64,
    /// Wall seconds of the CPU and GPU runs.
    pub seconds: (f64, f64),
    /// Refreshes done on the GPU engine.
    pub gpu_refreshes: u64,
}

impl MatchReport {
    /// Every loss finite and within the tolerance.
    pub fn passed(&self) -> bool {
        !self.cpu_losses.is_empty()
            && self.cpu_losses.len() == self.gpu_losses.len()
            && self.max_rel.is_finite()
            && self.max_rel <= self.tol
    }

    /// A table of per-step losses and the verdict.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "train-match `{}` on {}", self.name, self.gpu);
        let _ = writeln!(s, "| step | cpu loss | gpu loss | rel diff |");
        let _ = writeln!(s, "|---|---|---|---|");
        for (i, (c, g)) in self.cpu_losses.iter().zip(&self.gpu_losses).enumerate() {
            let _ = writeln!(s, "| {} | {c:.7} | {g:.7} | {:.2e} |", i + 1, rel(*c, *g));
        }
        for (step, c, g) in &self.val {
            let _ = writeln!(s, "| val@{step} | {c:.7} | {g:.7} | {:.2e} |", rel(*c, *g));
        }
        let _ = writeln!(
            s,
            "{}: max rel diff {:.3e} (tol {:.0e}) over {} steps; cpu {:.1} s, gpu {:.1} s, {} refreshes (GPU engine)",
            if self.passed() { "PASS" } else { "FAIL" },
            self.max_rel,
            self.tol,
            self.cpu_losses.len(),
            self.seconds.0,
            self.seconds.1,
            self.gpu_refreshes
        );
        s
    }
}

fn rel(c: f64, g: f64) -> f64 {
    if c == g {
        0.0
    } else {
        (g - c).abs() / c.abs().max(1e-30)
    }
}

/// Trains `plan` for `opts.steps` steps on both engines and compares (see the module docs).
///
/// # Errors
/// Either engine's error, as text (no device, bad plan, data).
pub fn train_match(plan: &Plan, opts: &MatchOptions) -> Result<MatchReport, String> {
    let mut plan = plan.clone();
    let device = match plan.target {
        TargetPlan::Cuda { device, .. } => device,
        TargetPlan::Cpu { .. } => 0,
    };
    plan.target = TargetPlan::Cuda {
        device,
        staleness: 0,
        precision: Precision::Fp32,
    };
    let train_opts = TrainOptions {
        steps: Some(opts.steps),
        cache_dir: opts.cache_dir.clone(),
        metrics_path: None,
        quiet: true,
        engine: EngineOptions {
            threads: opts.threads,
            ..EngineOptions::default()
        },
    };
    let t0 = Instant::now();
    let mut gpu = CudaEngine::new(
        plan.clone(),
        CudaOptions {
            engine: train_opts.engine.clone(),
            refresh: opts.refresh,
            ..CudaOptions::default()
        },
    )
    .map_err(|e| format!("CUDA engine: {e}"))?;
    let g = train_with(&mut gpu, &train_opts).map_err(|e| format!("GPU run: {e}"))?;
    let gpu_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut cpu = CpuEngine::<f32>::new(plan.clone(), train_opts.engine.clone())
        .map_err(|e| format!("CPU engine: {e}"))?;
    let c = train_with(&mut cpu, &train_opts).map_err(|e| format!("CPU run: {e}"))?;
    let cpu_s = t1.elapsed().as_secs_f64();
    let mut max_rel = if c.train_losses.len() == g.train_losses.len() {
        0.0f64
    } else {
        f64::INFINITY
    };
    for (a, b) in c.train_losses.iter().zip(&g.train_losses) {
        let r = rel(*a, *b);
        max_rel = if r.is_nan() {
            f64::INFINITY
        } else {
            max_rel.max(r)
        };
    }
    let val = c
        .val_losses
        .iter()
        .zip(&g.val_losses)
        .map(|(a, b)| (a.0, a.1, b.1))
        .collect();
    Ok(MatchReport {
        name: plan.name.clone(),
        gpu: gpu.describe(),
        cpu_losses: c.train_losses,
        gpu_losses: g.train_losses,
        val,
        max_rel,
        tol: opts.tol,
        seconds: (cpu_s, gpu_s),
        gpu_refreshes: gpu.stats().refreshes,
    })
}
