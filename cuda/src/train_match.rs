//! Trains one plan on the CPU engine and on the CUDA engine in the same process, with the same
//! seed, data and schedule (`engine::train_with` for both), and compares the training loss of
//! every step and the validation losses: the end-to-end check that the GPU interpreter
//! (dispatch, init, optimizer, refreshes) has the CPU engine's semantics.
//!
//! The GPU side runs with `precision = fp32` (plain fp32 GEMMs, no TF32) whatever the plan
//! says, so the only differences are rounding (summation order, fused kernels).
use crate::engine::{CudaEngine, CudaOptions};
use engine::{
    train_with, CpuEngine, EngineError, EngineOptions, EngineStats, HostTaskReport, StepExecutor,
    TrainOptions,
};
use schedule::{AttentionKernel, Plan, Precision, RefreshMethod, RefreshPlacement, TargetPlan};
use schedule::{BufferClass, BufferId, DType};
use std::collections::HashMap;
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
    /// Where the GPU engine refreshes eigenbases: the plan is rewritten with
    /// [`Plan::force_refresh_placement`] (default: every refresh on the GPU, Shampoo's inverse
    /// roots included; `Auto` keeps the compiled placements).
    pub refresh: RefreshPlacement,
    /// Token cache folder.
    pub cache_dir: Option<PathBuf>,
    /// CPU engine threads (`None` = all cores).
    pub threads: Option<usize>,
    /// Run both engines in lockstep and, after every step, compare every plan buffer outside
    /// the memory plan's shared `activations` arena (`max|gpu − cpu| / max|cpu|`); see
    /// [`MatchReport::state_log`].
    pub compare_state: bool,
    /// With `compare_state`: after each step's comparison, copy the CPU engine's buffers into
    /// the GPU engine, so each step's differences are one step's (not accumulated).
    pub resync: bool,
    /// Buffers whose relative difference exceeds this are listed (default 1e-5).
    pub state_tol: f64,
    /// With `compare_state`: at every step where an eigenbasis refresh was installed, copy the
    /// CPU engine's new basis, `exp_avg` and `exp_avg_sq` of that factor into the GPU engine
    /// (S = 0: the step it was due; S > 0: the plan is run with `refresh_swap = deadline`, so
    /// both engines install each result exactly S steps after its launch, and the copy is made
    /// then). The match then checks everything but the GPU
    /// eigensolver: the bases of nearly degenerate Kronecker factors are ill-conditioned, so
    /// two correct solvers (or fp32 rounding of the factor) legitimately give different ones,
    /// and SOAP's per-coordinate Adam turns that into O(lr) different updates (BENCHMARKS.md).
    /// The GPU refresh itself is checked by the kernel self-test (`eigenbasis_refresh`).
    pub inject_cpu_refreshes: bool,
    /// The GPU engine's GEMM precision. [`Precision::Fp32`] (the default) is the bit-for-bit
    /// comparison with the CPU engine; [`Precision::Bf16`] runs the production path (bf16 model
    /// GEMMs, tensor-core attention, bf16 SOAP GEMMs, TF32 swaps) against the fp32 CPU engine,
    /// which needs a looser `tol` (bf16 operand rounding, ~4e-3 relative per GEMM).
    pub precision: Precision,
}

impl Default for MatchOptions {
    fn default() -> Self {
        MatchOptions {
            steps: 20,
            tol: 1e-4,
            refresh: RefreshPlacement::Gpu,
            cache_dir: None,
            threads: None,
            compare_state: false,
            resync: false,
            inject_cpu_refreshes: false,
            state_tol: 1e-5,
            precision: Precision::Fp32,
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
    /// With `compare_state`: per-step lines naming the buffers over `state_tol` (worst 5).
    pub state_log: Vec<String>,
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
        for line in &self.state_log {
            let _ = writeln!(s, "{line}");
        }
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
    let (device, eigensolver, attention, staleness, weight_casts) = match plan.target {
        TargetPlan::Cuda {
            device,
            eigensolver,
            attention,
            staleness,
            weight_casts,
            ..
        } => (device, eigensolver, attention, staleness, weight_casts),
        TargetPlan::Cpu {
            eigensolver,
            staleness,
            ..
        } => {
            // A CPU spec's `memory` budget sized the CPU engine's working memory (the tiered
            // tiny specs offload moments under a few MiB); on the GPU the CUDA context's own
            // allocations exceed it before any buffer exists. The match compares the plan's
            // placement and copies as compiled, so the GPU engine runs it without that budget.
            plan.memory.budgets.device = None;
            let twice = schedule::WeightCasts::Twice;
            (0, eigensolver, AttentionKernel::Auto, staleness, twice)
        }
    };
    // The plan's staleness bound stays: with `refresh_swap = deadline` both engines install
    // every refresh at the same step, so an S > 0 plan can be matched step by step too (with
    // `finished` the steps at which results arrive depend on timing).
    plan.target = TargetPlan::Cuda {
        device,
        staleness,
        precision: opts.precision,
        eigensolver,
        attention,
        refresh_placement: RefreshPlacement::Auto,
        weight_casts,
    };
    plan.force_refresh_placement(opts.refresh);
    // Injection copies the CPU engine's result at the step it is installed, which must be the
    // same step on both engines: with S > 0 every result is swapped at its bound.
    if opts.inject_cpu_refreshes && staleness > 0 {
        plan.train.refresh_swap = schedule::RefreshSwap::Deadline;
    }
    let train_opts = TrainOptions {
        steps: Some(opts.steps),
        cache_dir: opts.cache_dir.clone(),
        metrics_path: None,
        quiet: true,
        engine: EngineOptions {
            threads: opts.threads,
            ..EngineOptions::default()
        },
        ..Default::default()
    };
    if opts.compare_state {
        return lockstep_match(&plan, opts, &train_opts);
    }
    let t0 = Instant::now();
    let mut gpu = CudaEngine::new(
        plan.clone(),
        CudaOptions {
            engine: train_opts.engine.clone(),
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
        state_log: Vec::new(),
    })
}

/// Both engines driven by one `train_with` (same batches, steps, lr schedule); the CPU engine's
/// losses are the run's, the GPU engine's are recorded, and every plan buffer that persists
/// (not in the shared `activations` arena, whose bytes later buffers reuse) is compared at the
/// end of every step (after the host tasks).
struct Lockstep<'a> {
    cpu: &'a mut CpuEngine<f32>,
    gpu: &'a mut CudaEngine,
    resync: bool,
    inject: bool,
    injected: u64,
    tol: f64,
    /// GPU loss of the last forward not yet followed by a backward.
    pending: Option<f64>,
    /// The GPU's losses of the current step's micro-batches.
    gpu_micro: Vec<f64>,
    gpu_train: Vec<f64>,
    gpu_eval: Vec<f64>,
    log: Vec<String>,
    first: Option<(u64, String, f64)>,
}

/// `max|a − b| / max|b|` (0 for two all-zero buffers, ∞ for a NaN or a length mismatch;
/// never NaN).
fn state_rel(a: &[f64], b: &[f64]) -> (f64, f64) {
    if a.len() != b.len() {
        return (f64::INFINITY, 0.0);
    }
    let (mut d, mut m) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        let diff = (x - y).abs();
        if diff.is_nan() {
            return (f64::INFINITY, m);
        }
        d = d.max(diff);
        m = m.max(y.abs());
    }
    let r = if d == 0.0 {
        0.0
    } else if m == 0.0 {
        f64::INFINITY
    } else {
        d / m
    };
    (r, m)
}

/// Column signs `s_j = sign(Σ_i a_ij b_ij)` of a row-major `[d, d]` basis (QR / eigh columns
/// have arbitrary signs; a flipped column is the same basis vector).
fn column_signs(a: &[f64], b: &[f64]) -> Vec<f64> {
    let d = (a.len() as f64).sqrt().round() as usize;
    if d == 0 || d * d != a.len() || a.len() != b.len() {
        return Vec::new();
    }
    let mut dot = vec![0.0f64; d];
    for (ra, rb) in a.chunks_exact(d).zip(b.chunks_exact(d)) {
        for ((acc, x), y) in dot.iter_mut().zip(ra).zip(rb) {
            *acc += x * y;
        }
    }
    dot.iter()
        .map(|&x| if x < 0.0 { -1.0 } else { 1.0 })
        .collect()
}

/// Whether a refresh task (`frequency`, `offset`, `staleness` S) installs a result at the end
/// of 1-based step `t` when every result is swapped exactly at its bound (`refresh_swap =
/// deadline`, which [`train_match`] sets for an injecting match with S > 0): the initial
/// eigendecomposition at step 1 and every refresh of an S = 0 task at once, otherwise the
/// refresh launched at step `t − d` ([`schedule::refresh_due`]) with d = min(S, frequency): a
/// task due again while its refresh is in flight swaps that one in first. A task whose first
/// eigendecomposition failed retries it synchronously at its next due step, which this does
/// not predict: a failure on one engine shows as a refresh-count difference in the log, and on
/// both the retried bases are not injected (the state comparison then shows them apart).
fn installed_at(t: u64, frequency: u64, offset: u64, staleness: u32) -> bool {
    let d = u64::from(staleness).min(frequency);
    t == 1
        || if d == 0 {
            schedule::refresh_due(t, frequency, offset)
        } else {
            t > d + 1 && schedule::refresh_due(t - d, frequency, offset)
        }
}

impl Lockstep<'_> {
    /// Copies the CPU engine's basis and moments of every factor whose refresh was installed
    /// at the end of step `t` ([`installed_at`]) into the GPU engine (see
    /// [`MatchOptions::inject_cpu_refreshes`]); the basis alone for a [`RefreshMethod::Qr`]
    /// refresh (KL-Shampoo), which changes nothing else, and the inverse root alone (the task's
    /// `basis`) for a [`RefreshMethod::InverseRoot`] refresh (Shampoo).
    fn inject_refreshes(&mut self, t: u64) -> Result<(), EngineError> {
        let plan = self.cpu.plan().clone();
        for task in &plan.host_tasks {
            let schedule::HostTask::EigenbasisRefresh {
                basis,
                exp_avg,
                exp_avg_sq,
                frequency,
                offset,
                staleness,
                method,
                ..
            } = *task;
            if !installed_at(t, frequency, offset, staleness) {
                continue;
            }
            let state = match method {
                RefreshMethod::Soap => &[basis, exp_avg, exp_avg_sq][..],
                RefreshMethod::Qr | RefreshMethod::InverseRoot => &[basis][..],
            };
            for &id in state {
                let name = &plan.buffer(id).name;
                let c = self.cpu.buffer(name)?;
                self.gpu.set_buffer(name, &c)?;
            }
            self.injected += 1;
        }
        self.gpu.synchronize()
    }

    fn compare(&mut self, t: u64) -> Result<(), EngineError> {
        let plan = self.cpu.plan().clone();
        // Bases first: their column signs align the eigenbasis moments (SOAP's `exp_avg`;
        // KL-Shampoo's momentum is unrotated and compared as it is).
        // SOAP's first moments live in the eigenbasis whether the step is one `soap_update` or
        // composed (a CUDA target's default): take them from the SOAP refresh tasks.
        let rotated: Vec<BufferId> = plan
            .host_tasks
            .iter()
            .filter_map(|t| match *t {
                schedule::HostTask::EigenbasisRefresh {
                    exp_avg,
                    method: RefreshMethod::Soap,
                    ..
                } => Some(exp_avg),
                _ => None,
            })
            .collect();
        let mut order: Vec<usize> = (0..plan.buffers.len()).collect();
        order.sort_by_key(|&i| plan.buffers[i].class != BufferClass::Eigenbasis);
        let mut signs: HashMap<String, Vec<f64>> = HashMap::new();
        let mut rows: Vec<(f64, String, f64)> = Vec::new();
        let mut classes: Vec<BufferClass> = Vec::new();
        // Buffers of the shared `activations` arena hold defined contents only inside their
        // live range: after the step the GPU's bytes may belong to another buffer.
        let shared = order
            .iter()
            .filter(|&&i| plan.memory.is_shared(BufferId(i as u32)))
            .count();
        for i in order {
            if plan.memory.is_shared(BufferId(i as u32)) {
                continue;
            }
            let b = &plan.buffers[i];
            let name = b.name.clone();
            let mut g = self.gpu.buffer(&name)?;
            let c = self.cpu.buffer(&name)?;
            let mut label = name.clone();
            match b.class {
                BufferClass::Eigenbasis => {
                    let s = column_signs(&g, &c);
                    let d = s.len();
                    if d > 0 && s.iter().any(|&x| x < 0.0) {
                        let raw = state_rel(&g, &c).0;
                        for row in g.chunks_exact_mut(d) {
                            for (x, sj) in row.iter_mut().zip(&s) {
                                *x *= sj;
                            }
                        }
                        let flips = s.iter().filter(|&&x| x < 0.0).count();
                        label = format!("{name} [{flips} col signs aligned; raw {raw:.1e}]");
                    }
                    signs.insert(name.clone(), s);
                }
                BufferClass::ExpAvg if rotated.contains(&BufferId(i as u32)) => {
                    let p = name.strip_suffix(".exp_avg").unwrap_or(&name).to_string();
                    let (m, n) = match b.shape[..] {
                        [m, n] => (m, n),
                        _ => (1, b.numel()),
                    };
                    let sl = signs.get(&format!("{p}.QL")).filter(|s| s.len() == m);
                    let sr = signs.get(&format!("{p}.QR")).filter(|s| s.len() == n);
                    let flips =
                        |s: Option<&Vec<f64>>| s.is_some_and(|v| v.iter().any(|&x| x < 0.0));
                    if flips(sl) || flips(sr) {
                        for (r, row) in g.chunks_exact_mut(n.max(1)).enumerate() {
                            let a = sl.map_or(1.0, |v| v[r]);
                            for (j, x) in row.iter_mut().enumerate() {
                                *x *= a * sr.map_or(1.0, |v| v[j]);
                            }
                        }
                        label = format!("{name} [basis signs aligned]");
                    }
                }
                _ => {}
            }
            let (r, m) = state_rel(&g, &c);
            rows.push((r, label, m));
            classes.push(b.class);
        }
        // Per class: buffers over tol and the worst one (bases would hide everything else in
        // a plain worst-5 list).
        let mut by_class: Vec<(String, usize, f64, String)> = Vec::new();
        for ((r, name, _), class) in rows.iter().zip(&classes) {
            if *r <= self.tol {
                continue;
            }
            let key = format!("{class:?}");
            match by_class.iter_mut().find(|e| e.0 == key) {
                Some(e) => {
                    e.1 += 1;
                    if *r > e.2 {
                        e.2 = *r;
                        e.3 = name.clone();
                    }
                }
                None => by_class.push((key, 1, *r, name.clone())),
            }
        }
        rows.sort_by(|a, b| b.0.total_cmp(&a.0));
        let over: Vec<&(f64, String, f64)> = rows.iter().filter(|r| r.0 > self.tol).collect();
        if over.is_empty() {
            let w = &rows[0];
            self.log.push(format!(
                "state step {t}: all {} buffers within {:.0e} (worst {} {:.2e}; {shared} step-local buffers of the shared arena not compared)",
                rows.len(),
                self.tol,
                w.1,
                w.0
            ));
        } else {
            if self.first.is_none() {
                self.first = Some((t, over[0].1.clone(), over[0].0));
            }
            let worst: Vec<String> = over
                .iter()
                .take(5)
                .map(|(r, n, m)| format!("{n} {r:.2e} (max|cpu| {m:.2e})"))
                .collect();
            let classes: Vec<String> = by_class
                .iter()
                .map(|(c, k, r, n)| format!("{c} {k} (worst {n} {r:.2e})"))
                .collect();
            self.log.push(format!(
                "state step {t}: {} of {} buffers over {:.0e}; by class: {}; worst: {}",
                over.len(),
                rows.len(),
                self.tol,
                classes.join(", "),
                worst.join("; ")
            ));
        }
        if self.resync {
            // The state that carries over to the next step; activations are rewritten anyway.
            // (Not the buffers sharing the activations arena, staging copies included: the
            // CPU engine frees those between steps.)
            for (i, b) in plan.buffers.iter().enumerate() {
                if b.dtype == DType::F32
                    && b.class != BufferClass::Activation
                    && !plan.memory.is_shared(BufferId(i as u32))
                {
                    let c = self.cpu.buffer(&b.name)?;
                    self.gpu.set_buffer(&b.name, &c)?;
                }
            }
            self.gpu.synchronize()?;
        }
        Ok(())
    }
}

impl StepExecutor for Lockstep<'_> {
    fn plan(&self) -> &Plan {
        self.cpu.plan()
    }
    fn load_batch(&mut self, tokens: &[i32], targets: &[i32]) -> Result<(), EngineError> {
        self.cpu.load_batch(tokens, targets)?;
        self.gpu.load_batch(tokens, targets)
    }
    fn forward(&mut self) -> Result<f64, EngineError> {
        let c = self.cpu.forward()?;
        let g = StepExecutor::forward(self.gpu)?;
        if let Some(prev) = self.pending.replace(g) {
            self.gpu_eval.push(prev);
        }
        Ok(c)
    }
    fn backward(&mut self, micro: u64) -> Result<(), EngineError> {
        self.cpu.backward_micro(micro)?;
        StepExecutor::backward(self.gpu, micro)?;
        if let Some(g) = self.pending.take() {
            self.gpu_micro.push(g);
        }
        Ok(())
    }
    fn optimizer_step(&mut self, t: u64, lr_multiplier: f64) -> Result<bool, EngineError> {
        // The step's loss: the mean of its micro-batches' (as the training loop takes it).
        if !self.gpu_micro.is_empty() {
            let n = self.gpu_micro.len() as f64;
            self.gpu_train.push(self.gpu_micro.iter().sum::<f64>() / n);
            self.gpu_micro.clear();
        }
        let c = self.cpu.optimizer_step(t, lr_multiplier)?;
        let g = StepExecutor::optimizer_step(self.gpu, t, lr_multiplier)?;
        if c != g {
            self.log.push(format!(
                "step {t}: optimizer step taken on cpu {c}, gpu {g}"
            ));
        }
        Ok(c)
    }
    fn run_host_tasks(&mut self, t: u64) -> Result<HostTaskReport, EngineError> {
        let r = self.cpu.run_host_tasks(t)?;
        let g = StepExecutor::run_host_tasks(self.gpu, t)?;
        if r.refreshed != g.refreshed || r.failed != g.failed {
            self.log.push(format!(
                "step {t}: refreshes cpu {}/{} failed, gpu {}/{} failed",
                r.refreshed, r.failed, g.refreshed, g.failed
            ));
        }
        self.gpu.synchronize()?;
        if self.inject {
            self.inject_refreshes(t)?;
        }
        self.compare(t)?;
        Ok(r)
    }
    fn stats(&self) -> &EngineStats {
        self.cpu.stats()
    }
    fn describe(&self) -> String {
        self.gpu.describe()
    }
    fn synchronize(&mut self) -> Result<(), EngineError> {
        self.gpu.synchronize()
    }
}

/// [`train_match`] with `compare_state`: both engines in lockstep (see [`Lockstep`]).
fn lockstep_match(
    plan: &Plan,
    opts: &MatchOptions,
    train_opts: &TrainOptions,
) -> Result<MatchReport, String> {
    let t0 = Instant::now();
    let mut gpu = CudaEngine::new(
        plan.clone(),
        CudaOptions {
            engine: train_opts.engine.clone(),
            ..CudaOptions::default()
        },
    )
    .map_err(|e| format!("CUDA engine: {e}"))?;
    let mut cpu = CpuEngine::<f32>::new(plan.clone(), train_opts.engine.clone())
        .map_err(|e| format!("CPU engine: {e}"))?;
    let mut ls = Lockstep {
        cpu: &mut cpu,
        gpu: &mut gpu,
        resync: opts.resync,
        inject: opts.inject_cpu_refreshes,
        injected: 0,
        tol: opts.state_tol,
        pending: None,
        gpu_micro: Vec::new(),
        gpu_train: Vec::new(),
        gpu_eval: Vec::new(),
        log: vec![format!(
            "state comparison: max|gpu - cpu| / max|cpu| per plan buffer after each step{}",
            if opts.resync {
                ", GPU re-synced to the CPU state after each step (one-step differences)"
            } else if opts.inject_cpu_refreshes && plan.target.staleness() > 0 {
                " (accumulated; the CPU engine's refresh results copied into the GPU engine as each is installed, every result at its staleness bound: refresh_swap = deadline)"
            } else if opts.inject_cpu_refreshes {
                " (accumulated; the CPU engine's refresh results copied into the GPU engine at each refresh)"
            } else {
                " (accumulated)"
            }
        )],
        first: None,
    };
    let c = train_with(&mut ls, train_opts).map_err(|e| format!("lockstep run: {e}"))?;
    if let Some(g) = ls.pending.take() {
        ls.gpu_eval.push(g);
    }
    let secs = t0.elapsed().as_secs_f64();
    let mut log = std::mem::take(&mut ls.log);
    if ls.inject {
        log.push(format!(
            "{} refresh results injected from the CPU engine",
            ls.injected
        ));
    }
    log.push(match &ls.first {
        Some((t, n, r)) => format!("first buffer over tol: step {t}, {n} ({r:.2e})"),
        None => "no buffer over tol".to_string(),
    });
    let k = plan.train.eval_batches.max(1) as usize;
    let gpu_val: Vec<f64> = ls
        .gpu_eval
        .chunks(k)
        .map(|ch| ch.iter().sum::<f64>() / ch.len() as f64)
        .collect();
    let gpu_train = std::mem::take(&mut ls.gpu_train);
    let mut max_rel = if c.train_losses.len() == gpu_train.len() {
        0.0f64
    } else {
        f64::INFINITY
    };
    for (a, b) in c.train_losses.iter().zip(&gpu_train) {
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
        .zip(&gpu_val)
        .map(|(a, b)| (a.0, a.1, *b))
        .collect();
    Ok(MatchReport {
        name: plan.name.clone(),
        gpu: gpu.describe(),
        cpu_losses: c.train_losses,
        gpu_losses: gpu_train,
        val,
        max_rel,
        tol: opts.tol,
        seconds: (secs, secs),
        gpu_refreshes: gpu.stats().refreshes,
        state_log: log,
    })
}

#[cfg(test)]
mod tests {
    use super::installed_at;

    /// The steps at which a task installs results, for frequency 3 (offset 0 and 1) and
    /// staleness 0, 1 and 2: the engines' schedule ([`schedule::refresh_due`]) shifted by S,
    /// the initial eigendecomposition always at step 1.
    #[test]
    fn injection_follows_the_install_steps() {
        let steps =
            |f, o, s| -> Vec<u64> { (1..=14).filter(|&t| installed_at(t, f, o, s)).collect() };
        assert_eq!(steps(3, 0, 0), vec![1, 4, 7, 10, 13]);
        assert_eq!(steps(3, 0, 1), vec![1, 5, 8, 11, 14]);
        assert_eq!(steps(3, 0, 2), vec![1, 6, 9, 12]);
        assert_eq!(steps(3, 1, 0), vec![1, 2, 5, 8, 11, 14]);
        assert_eq!(steps(3, 1, 2), vec![1, 4, 7, 10, 13]);
        // A due step at t = 1 is the synchronous initial one, not shifted again.
        assert_eq!(
            steps(1, 0, 1),
            (1..=14).filter(|&t| t != 2).collect::<Vec<_>>()
        );
    }
}
