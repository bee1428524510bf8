//! The GPU self-test: every launcher on fresh random inputs at awkward sizes, against the CPU
//! kernels of `engine::cpu` and `optim` run in f64 on the same (f32-rounded) inputs.
//!
//! Each case draws its inputs from a generator seeded by the run's seed (time-based unless
//! given; printed in the report) and the case's index, poisons every output with NaN first,
//! runs the GPU launcher, and compares. The error of one output is the norm-wise relative
//! error `max|gpu − ref| / max|ref|` (a NaN or ∞ on the GPU side is an infinite error); a
//! case's error is the largest over its outputs. Thresholds: 1e-5 for fp32, 1e-2 for the bf16
//! GEMM. Optimizer cases compare the parameter *change* (so rounding of the parameter itself
//! does not hide a wrong update) and the new moments.
mod cases;
mod cases_attention;
mod cases_inverse_root;
mod cases_kl_composed;
mod cases_kl_shampoo;
mod cases_loss;
mod cases_optim;
mod cases_refresh;
mod cases_shampoo;
mod cases_shampoo_composed;

use crate::device::{Device, HostElem};
use crate::error::{CudaError, Result, Tier};
use crate::memory::{Arena, Buf, Elem};
use crate::{DeviceInfo, MemoryReport, StreamKind};
use engine::Rng;
use std::fmt::Write as _;
use std::time::Instant;

/// Tolerance of fp32 kernels (norm-wise relative error).
pub const TOL_F32: f64 = 1e-5;
/// Tolerance of the bf16-input GEMM.
pub const TOL_BF16: f64 = 1e-2;

/// Options of a self-test run.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Seed of the input generator; `None` = from the clock.
    pub seed: Option<u64>,
    /// Run only cases whose kernel name contains this.
    pub filter: Option<String>,
    /// Skip the largest sizes.
    pub quick: bool,
    /// Print one line per case to stderr as it finishes (progress, and a trace if a case hangs).
    pub verbose: bool,
}

/// The outcome of one case.
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// Launcher or plan op checked.
    pub kernel: String,
    /// The sizes, as `N=783 C=50`.
    pub size: String,
    /// Largest norm-wise relative error over the outputs.
    pub max_rel_err: f64,
    /// Threshold.
    pub tol: f64,
    /// `max_rel_err ≤ tol` (and no error).
    pub pass: bool,
    /// GPU time of the launch(es), ms, CUDA events (first launch: includes one-off costs).
    pub gpu_ms: f64,
    /// Worst output, or the error that stopped the case.
    pub note: String,
}

/// All results of a run.
#[derive(Clone, Debug)]
pub struct Report {
    /// The device line.
    pub device: DeviceInfo,
    /// The generator seed.
    pub seed: u64,
    /// One row per case (kernel-family load failures first).
    pub results: Vec<CaseResult>,
    /// Memory after the run.
    pub memory: MemoryReport,
    /// Wall time of the whole run, s.
    pub seconds: f64,
}

impl Report {
    /// True when every case passed.
    pub fn passed(&self) -> bool {
        !self.results.is_empty() && self.results.iter().all(|r| r.pass)
    }

    /// The results as a Markdown table, with the device, seed and memory lines above it.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "{}", self.device);
        let _ = writeln!(
            s,
            "seed {} ({:.1} s)  {}",
            self.seed, self.seconds, self.memory
        );
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "| kernel | size | max rel err | tol | pass | gpu ms | worst output |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|");
        for r in &self.results {
            let _ = writeln!(
                s,
                "| {} | {} | {:.2e} | {:.0e} | {} | {:.3} | {} |",
                r.kernel,
                r.size,
                r.max_rel_err,
                r.tol,
                if r.pass { "ok" } else { "FAIL" },
                r.gpu_ms,
                r.note
            );
        }
        let failed = self.results.iter().filter(|r| !r.pass).count();
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "{} passed, {} failed",
            self.results.len() - failed,
            failed
        );
        s
    }
}

/// What one case hands back: `(output name, norm-wise relative error)` pairs and GPU ms.
pub(crate) struct Outcome {
    pub(crate) errs: Vec<(&'static str, f64)>,
    pub(crate) gpu_ms: f64,
}

/// The body of a case.
pub(crate) type CaseFn = Box<dyn Fn(&mut Ctx<'_>) -> Result<Outcome>>;

/// One registered case.
pub(crate) struct Case {
    pub(crate) kernel: &'static str,
    pub(crate) size: String,
    pub(crate) tol: f64,
    /// Skipped by `--quick`.
    pub(crate) big: bool,
    pub(crate) run: CaseFn,
}

/// A case's view of the device: a private arena and the input generator.
pub(crate) struct Ctx<'a> {
    pub(crate) dev: &'a Device,
    arena: &'a mut Arena,
    pub(crate) rng: Rng,
}

impl Ctx<'_> {
    /// `n` draws of `N(mean, std²)`, rounded to f32.
    pub(crate) fn normal(&mut self, n: usize, mean: f64, std: f64) -> Vec<f32> {
        (0..n)
            .map(|_| (mean + std * self.rng.normal()) as f32)
            .collect()
    }
    /// `n` draws uniform in `(lo, hi]`.
    pub(crate) fn uniform(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f32> {
        (0..n)
            .map(|_| (lo + (hi - lo) * self.rng.uniform()) as f32)
            .collect()
    }
    /// `n` ids uniform in `[0, bound)`.
    pub(crate) fn ids(&mut self, n: usize, bound: usize) -> Vec<i32> {
        (0..n)
            .map(|_| (self.rng.next_u64() % bound as u64) as i32)
            .collect()
    }
    /// A device buffer holding `v`.
    pub(crate) fn up<T: HostElem>(&mut self, v: &[T]) -> Result<Buf> {
        let b = self.arena.buf(T::ELEM, v.len())?;
        self.dev.upload(&b, v)?;
        Ok(b)
    }
    /// An f32 device buffer of `n` NaNs (an output or scratch).
    pub(crate) fn out(&mut self, n: usize) -> Result<Buf> {
        let b = self.arena.buf(Elem::F32, n)?;
        self.dev.poison(&b)?;
        Ok(b)
    }
    /// A device buffer of `n` elements of `elem`, uninitialised.
    pub(crate) fn raw(&mut self, elem: Elem, n: usize) -> Result<Buf> {
        self.arena.buf(elem, n)
    }
    /// The f32 contents of `b`.
    pub(crate) fn down(&self, b: &Buf) -> Result<Vec<f32>> {
        self.dev.download::<f32>(b)
    }
    /// Runs `f` between two timing events on the compute stream; returns GPU ms.
    pub(crate) fn timed(&self, f: impl FnOnce() -> Result<()>) -> Result<f64> {
        let start = self.dev.record(StreamKind::Compute, true)?;
        f()?;
        let end = self.dev.record(StreamKind::Compute, true)?;
        end.synchronize()?;
        Ok(start.elapsed_ms(&end)? as f64)
    }
}

/// `v` widened to f64.
pub(crate) fn wide(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// Norm-wise relative error `max|g − r| / max|r|` (absolute when `r` is all zero); infinite
/// when any GPU value is NaN/∞ or the lengths differ.
pub fn rel_err(gpu: &[f32], reference: &[f64]) -> f64 {
    if gpu.len() != reference.len() {
        return f64::INFINITY;
    }
    let mut diff = 0.0f64;
    let mut scale = 0.0f64;
    for (&g, &r) in gpu.iter().zip(reference) {
        if !g.is_finite() {
            return f64::INFINITY;
        }
        diff = diff.max((g as f64 - r).abs());
        scale = scale.max(r.abs());
    }
    if scale > 0.0 {
        diff / scale
    } else {
        diff
    }
}

/// Maps a CPU-reference error into the crate error (a failed case, not a crash).
pub(crate) fn cpu<E: std::fmt::Display>(e: E) -> CudaError {
    CudaError::Invalid {
        op: "cpu reference",
        what: e.to_string(),
    }
}

/// Every case, in report order.
fn registry() -> Vec<Case> {
    let mut v = cases::cases();
    v.extend(cases_optim::cases());
    v.extend(cases_kl_shampoo::cases());
    v.extend(cases_kl_composed::cases());
    v.extend(cases_shampoo::cases());
    v.extend(cases_shampoo_composed::cases());
    v.extend(cases_refresh::cases());
    v.extend(cases_inverse_root::cases());
    v
}

/// The kernel names the registry checks (for listing and tests).
pub fn case_kernels() -> Vec<&'static str> {
    let mut k: Vec<&'static str> = Vec::new();
    for c in registry() {
        if !k.contains(&c.kernel) {
            k.push(c.kernel);
        }
    }
    k
}

/// Runs every case with a clock-derived seed.
pub fn run_all(dev: &Device) -> Report {
    run(dev, &Options::default())
}

/// Runs the cases selected by `opts`.
pub fn run(dev: &Device, opts: &Options) -> Report {
    let t0 = Instant::now();
    let seed = opts.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let mut results = Vec::new();
    for load in dev.kernel_loads() {
        if let Some(e) = &load.error {
            results.push(CaseResult {
                kernel: format!("load:{}", load.family),
                size: "-".into(),
                max_rel_err: f64::INFINITY,
                tol: 0.0,
                pass: false,
                gpu_ms: 0.0,
                note: e.lines().next().unwrap_or("").to_string(),
            });
        }
    }
    let arena_bytes = {
        let free = dev.memory_report().device_free;
        (free / 2).clamp(64 << 20, 6 << 30)
    };
    let mut arena = match dev.arena("selftest", Tier::Device, arena_bytes) {
        Ok(a) => a,
        Err(e) => {
            results.push(fail_row("arena", "-", 0.0, &e));
            return finish(dev, seed, results, t0);
        }
    };
    for (i, case) in registry().into_iter().enumerate() {
        if opts
            .filter
            .as_deref()
            .is_some_and(|f| !case.kernel.contains(f))
            || (opts.quick && case.big)
            || (case.kernel.starts_with("flash_attention_wg")
                && dev.info().compute_capability != (9, 0))
        {
            continue;
        }
        let mut ctx = Ctx {
            dev,
            arena: &mut arena,
            rng: Rng::new(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        };
        let outcome = (case.run)(&mut ctx);
        let row = match outcome {
            Ok(o) => {
                let (worst, err) = o.errs.iter().fold(("-", 0.0f64), |(wn, we), &(n, e)| {
                    if e > we || e.is_nan() {
                        (n, e)
                    } else {
                        (wn, we)
                    }
                });
                let err = if o.errs.is_empty() {
                    f64::INFINITY
                } else {
                    err
                };
                CaseResult {
                    kernel: case.kernel.to_string(),
                    size: case.size.clone(),
                    max_rel_err: err,
                    tol: case.tol,
                    pass: err <= case.tol,
                    gpu_ms: o.gpu_ms,
                    note: worst.to_string(),
                }
            }
            Err(e) => fail_row(case.kernel, &case.size, case.tol, &e),
        };
        tracing::info!(
            "{} {}: {:.2e} ({})",
            row.kernel,
            row.size,
            row.max_rel_err,
            if row.pass { "ok" } else { "FAIL" }
        );
        results.push(row);
        // A failed launch can leave the stream in an error state; wait and move on.
        let _ = dev.synchronize();
        let _ = dev.take_status();
        if let Err(e) = arena.reset() {
            results.push(fail_row("arena-reset", "-", 0.0, &e));
            break;
        }
    }
    drop(arena);
    finish(dev, seed, results, t0)
}

fn fail_row(kernel: &str, size: &str, tol: f64, e: &CudaError) -> CaseResult {
    CaseResult {
        kernel: kernel.to_string(),
        size: size.to_string(),
        max_rel_err: f64::INFINITY,
        tol,
        pass: false,
        gpu_ms: 0.0,
        note: e
            .to_string()
            .lines()
            .next()
            .unwrap_or("")
            .chars()
            .take(160)
            .collect(),
    }
}

fn finish(dev: &Device, seed: u64, results: Vec<CaseResult>, t0: Instant) -> Report {
    Report {
        device: dev.info().clone(),
        seed,
        results,
        memory: dev.memory_report(),
        seconds: t0.elapsed().as_secs_f64(),
    }
}
