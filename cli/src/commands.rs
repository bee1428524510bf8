//! Implementations of the `asteria` subcommands.
use crate::{PassFlags, RunFlags};
use miette::{miette, IntoDiagnostic, Result, WrapErr};
use passes::{PassManager, PassOptions};
use schedule::{Plan, TargetPlan};
use std::path::Path;

/// Parses + checks a spec file with the command line's `--set` overrides (printing the
/// frontend's notes on stderr) and runs the pipeline; returns the plan (memory planned) and the
/// IR liveness analysis.
pub fn compile_spec(
    spec: &Path,
    flags: &PassFlags,
    overrides: &[String],
) -> Result<(Plan, passes::liveness::Liveness)> {
    let checked = frontend::load_spec_with(spec, overrides).map_err(miette::Report::new)?;
    for n in &checked.notes {
        note!("note: {n}");
    }
    compile_config(checked.config, flags)
}

/// Runs the pass pipeline over a checked configuration (as [`compile_spec`] does after
/// loading the spec). Errors: a pass's error.
pub fn compile_config(
    config: ir::config::Config,
    flags: &PassFlags,
) -> Result<(Plan, passes::liveness::Liveness)> {
    let mut module = ir::Module::new(config);
    let options = PassOptions {
        print_before: flags.print_before.clone(),
        print_after: flags.print_after.clone(),
        print_after_all: flags.print_after_all,
        verify_each: flags.verify_each,
        time_passes: flags.time_passes,
        skip: flags.skip_pass.clone(),
        skip_rules: flags.skip_rule.clone(),
        apply_rules: flags.apply_rule.clone(),
    };
    let mut pm = PassManager::new(options).map_err(|e| miette!("{e}"))?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let (cx, timings) = pm
        .run(&mut module, None, &mut out)
        .map_err(|e| miette!("{e}"))?;
    if flags.time_passes {
        let total: f64 = timings.iter().map(|t| t.ms).sum();
        note!("{:>10}  {:<18} summary", "ms", "pass");
        for t in &timings {
            note!("{:>10.3}  {:<18} {}", t.ms, t.pass, t.summary);
        }
        note!("{total:>10.3}  total");
    }
    let plan = cx
        .plan
        .ok_or_else(|| miette!("internal: the pipeline produced no plan"))?;
    let liveness = cx
        .liveness
        .ok_or_else(|| miette!("internal: the pipeline produced no liveness"))?;
    Ok((plan, liveness))
}

/// `asteria compile`.
pub fn compile(
    spec: &Path,
    output: Option<&Path>,
    flags: &PassFlags,
    overrides: &[String],
) -> Result<()> {
    // `-o` naming the spec itself would replace the spec by its plan.
    if let Some(path) = output {
        let same = match (std::fs::canonicalize(spec), std::fs::canonicalize(path)) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
        if same {
            return Err(miette!(
                "-o {} is the spec itself: writing the plan there would replace the spec; \
                 name another file (e.g. {})",
                path.display(),
                path.with_extension("plan.json").display()
            ));
        }
    }
    let (plan, _) = compile_spec(spec, flags, overrides)?;
    match output {
        Some(path) => {
            // As --metrics: missing parent folders are created.
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)
                    .into_diagnostic()
                    .wrap_err_with(|| format!("cannot create {}", parent.display()))?;
            }
            std::fs::write(path, plan.to_json())
                .into_diagnostic()
                .wrap_err_with(|| format!("cannot write the plan to {}", path.display()))?;
            note!(
                "wrote {} ({} buffers, {} ops per step, {} host tasks)",
                path.display(),
                plan.buffers.len(),
                plan.forward.len() + plan.backward.len() + plan.optimizer.len(),
                plan.host_tasks.len()
            );
        }
        None => note!(
            "compiled {} (no -o given: plan not written)",
            spec.display()
        ),
    }
    Ok(())
}

fn train_options(run: &RunFlags) -> Result<engine::TrainOptions> {
    let cache_dir = run
        .cache_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("asteria-token-cache"));
    Ok(engine::TrainOptions {
        steps: run.steps,
        cache_dir: Some(cache_dir),
        metrics_path: run.metrics.clone(),
        quiet: run.quiet,
        engine: engine::EngineOptions {
            max_consecutive_refresh_failures: run.max_refresh_failures,
            ..Default::default()
        },
        checkpoint_dir: run.checkpoint_dir.clone(),
        checkpoint_every: run.checkpoint_every,
        checkpoint_keep: run.checkpoint_keep as usize,
        resume: run.resume.clone(),
        interrupt: Some(interrupt_flag()?),
        started: Some(crate::started()),
    })
}

/// A flag that SIGINT and SIGTERM set: the training loop finishes its step, checkpoints (with
/// `--checkpoint-dir`) and stops. A second signal while the flag is set exits at once
/// (status 130), as an impatient Ctrl-C expects.
fn interrupt_flag() -> Result<std::sync::Arc<std::sync::atomic::AtomicBool>> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [SIGINT, SIGTERM] {
        signal_hook::flag::register_conditional_shutdown(sig, 130, std::sync::Arc::clone(&flag))
            .into_diagnostic()?;
        signal_hook::flag::register(sig, std::sync::Arc::clone(&flag)).into_diagnostic()?;
    }
    Ok(flag)
}

/// Applies the CLI's overrides of plan options, prints the options the run uses, and runs
/// the plan on its target's engine.
fn execute(plan: &Plan, run: &RunFlags) -> Result<()> {
    let opts = train_options(run)?;
    let mut plan = plan.clone();
    if let Some(e) = run.eigensolver {
        plan.target.set_eigensolver(e);
    }
    // Fail before anything runs when this build lacks the plan's solver.
    opts.engine
        .solver(&plan)
        .map_err(|e| miette!("plan `{}`: {e}", plan.name))?;
    note!(
        "{}; train: rematerialize {}, max_skipped_steps {}, refresh_swap {}, grad_accum {}",
        plan.target.options_line(),
        plan.train.rematerialize,
        plan.train
            .max_skipped_steps
            .map_or("none".to_string(), |n| n.to_string()),
        plan.train.refresh_swap,
        plan.train.grad_accum
    );
    // The budgets, and what `tier-placement` moved under them.
    let budgets = plan.memory.budgets.describe(match plan.target {
        TargetPlan::Cuda { .. } => "gpu_memory",
        TargetPlan::Cpu { .. } => "memory",
    });
    if !budgets.is_empty() {
        let moved = |kind: schedule::ArenaKind| {
            (0..plan.buffers.len())
                .filter(|&i| plan.memory.tier(schedule::BufferId(i as u32)) == Some(kind))
                .count()
        };
        note!(
            "budgets: {budgets}; tier-placement moved {} tensor(s) to host memory ({}), {} to \
             nvme ({})",
            moved(schedule::ArenaKind::Host),
            schedule::limits::human_size(plan.memory.arena_bytes(schedule::ArenaKind::Host) as u128),
            moved(schedule::ArenaKind::Nvme),
            schedule::limits::human_size(plan.memory.arena_bytes(schedule::ArenaKind::Nvme) as u128),
        );
    }
    let plan = &plan;
    if let TargetPlan::Cuda { .. } = plan.target {
        return execute_cuda(plan, &opts, run.profile, run.trace.is_some());
    } else if run.profile != schedule::Profile::Off {
        return Err(miette!(
            "`--profile {}` times CUDA kernels; plan `{}` targets the CPU engine",
            run.profile,
            plan.name
        ));
    }
    // The engine prints the progress bar and the summary line itself.
    engine::train(plan, &opts).map_err(|e| miette!("{e}"))?;
    Ok(())
}

/// Runs a CUDA plan on [`cuda::CudaEngine`] through the same training loop as the CPU engine.
fn execute_cuda(
    plan: &Plan,
    opts: &engine::TrainOptions,
    profile: schedule::Profile,
    trace: bool,
) -> Result<()> {
    if !cuda::driver_present() {
        return Err(miette!(
            "plan `{}` targets CUDA, but no CUDA driver (libcuda.so) can be loaded on this machine; \
             run it on a GPU host, or set `target cpu` in the spec",
            plan.name
        ));
    }
    let copts = cuda::CudaOptions {
        engine: opts.engine.clone(),
        device: None,
        profile,
        trace,
    };
    let mut eng = cuda::CudaEngine::new(plan.clone(), copts)
        .map_err(|e| miette!("plan `{}` targets CUDA: {e}", plan.name))?;
    if !opts.quiet {
        note!(
            "{}; {}",
            engine::StepExecutor::describe(&eng),
            eng.arena_line()
        );
    }
    let summary = engine::train_with(&mut eng, opts);
    if trace {
        let (slices, dropped) = eng.take_gpu_trace();
        let i = eng.device().info();
        crate::trace::add_gpu(format!("cuda:{} {}", i.ordinal, i.name), slices, dropped);
    }
    let summary = summary.map_err(|e| miette!("{e}"))?;
    // MFU: the plan's model FLOPs per step over the median step time, against the GPU's
    // dense bf16 peak.
    let flops = plan.model_flops_per_step();
    if summary.median_step_ms > 0.0 && flops > 0.0 {
        let tflops = flops / (summary.median_step_ms * 1e-3) / 1e12;
        let name = &eng.device().info().name;
        match cuda::peak_bf16_tflops(name) {
            Some(peak) => note!(
                "cuda: MFU {:.1}% ({:.0} model TFLOP/s of {peak:.0} peak bf16 on {name}; {:.2} TFLOP per step, median step {:.1} ms)",
                100.0 * tflops / peak,
                tflops,
                flops / 1e12,
                summary.median_step_ms
            ),
            None => note!(
                "cuda: {tflops:.0} model TFLOP/s ({:.2} TFLOP per step, median step {:.1} ms; no bf16 peak known for {name}, so no MFU)",
                flops / 1e12,
                summary.median_step_ms
            ),
        }
    }
    note!(
        "cuda: first step done {:.1} s after process start (compile, set-up, data, first evaluation, step)",
        summary.first_step_s
    );
    let stats = engine::StepExecutor::stats(&eng);
    note!(
        "cuda: {}; {}; host tasks {:.0} ms total, {} refreshes",
        eng.memory_report(),
        eng.arena_line(),
        stats.host_task_ms,
        stats.refreshes
    );
    if stats.refreshes > 0 {
        note!("cuda: {}", eng.refresh_timing());
    }
    let profile = eng.profile_table();
    if !profile.is_empty() {
        note!("per-op GPU time (--profile):\n{profile}");
    }
    Ok(())
}

/// `asteria run`: verify a plan file, then execute it.
pub fn run(path: &Path, run: &RunFlags) -> Result<()> {
    let text = std::fs::read_to_string(path)
        .into_diagnostic()
        .wrap_err_with(|| format!("cannot read plan {}", path.display()))?;
    let plan = Plan::from_json(&text).map_err(|e| {
        if text.trim_start().starts_with('{') {
            miette!("rejected plan {}: {e}", path.display())
        } else {
            miette!(
                help = format!(
                    "a spec is compiled and run with `asteria train {}`",
                    path.display()
                ),
                "rejected plan {}: not JSON; is it a spec? ({e})",
                path.display()
            )
        }
    })?;
    execute(&plan, run)
}

/// `asteria train`: compile a spec, then execute the plan.
pub fn train(spec: &Path, run: &RunFlags, flags: &PassFlags, overrides: &[String]) -> Result<()> {
    let (plan, _) = compile_spec(spec, flags, overrides)?;
    execute(&plan, run)
}

/// `asteria sample`: the prompt and its continuation on stdout.
pub fn sample(
    checkpoint: &Path,
    prompt: &str,
    o: &engine::sample::SampleOptions,
    device: &str,
) -> Result<()> {
    let ckpt = engine::checkpoint::load(checkpoint).map_err(|e| miette!("{e}"))?;
    let s = match device {
        "cpu" => engine::sample::generate(&ckpt, prompt, o).map_err(|e| miette!("{e}"))?,
        "cuda" => {
            let plan = engine::sample::stored_plan(&ckpt).map_err(|e| miette!("{e}"))?;
            if !matches!(plan.target, schedule::TargetPlan::Cuda { .. }) {
                return Err(miette!(
                    "{}: its plan `{}` targets the CPU; `--device cuda` samples checkpoints of \
                     CUDA plans (`--device cpu` runs any)",
                    ckpt.dir.display(),
                    plan.name
                ));
            }
            if !cuda::driver_present() {
                return Err(miette!(
                    "`--device cuda`: no CUDA driver (libcuda.so) can be loaded on this machine"
                ));
            }
            let mut eng = cuda::CudaEngine::new(plan.clone(), cuda::CudaOptions::default())
                .map_err(|e| miette!("{e}"))?;
            engine::checkpoint::restore(&mut eng, &ckpt).map_err(|e| miette!("{e}"))?;
            engine::sample::generate_with(&mut eng, prompt, o).map_err(|e| miette!("{e}"))?
        }
        other => {
            return Err(miette!(
                "`--device {other}`: sample runs on `cpu` or `cuda`"
            ))
        }
    };
    note!(
        "{}: step {}, {} prompt tokens, {} generated on {device} (temperature {}, top-k {}, seed {})",
        ckpt.dir.display(),
        ckpt.meta.step,
        s.prompt_ids.len(),
        s.ids.len(),
        o.temperature,
        o.top_k,
        o.seed
    );
    out!("{prompt}{}", s.text);
    Ok(())
}

/// `asteria export CKPT --format hf -o DIR`: the checkpoint's weights as a Hugging Face
/// `transformers` model ([`engine::export::export_hf`]).
///
/// # Errors
/// Another format, a checkpoint that is corrupt or has no architecture recorded, I/O errors.
pub fn export(checkpoint: &Path, format: &str, output: &Path) -> Result<()> {
    if format != "hf" {
        return Err(miette!(
            "`--format {format}`: export writes `hf` (Hugging Face transformers)"
        ));
    }
    let ckpt = engine::checkpoint::load(checkpoint).map_err(|e| miette!("{e}"))?;
    let e = engine::export::export_hf(&ckpt, output).map_err(|e| miette!("{e}"))?;
    note!(
        "{}: step {} exported as {} ({} tensors, {} parameters): {} and {}",
        ckpt.dir.display(),
        ckpt.meta.step,
        e.architecture,
        e.tensors,
        e.parameters,
        e.config.display(),
        e.weights.display()
    );
    Ok(())
}

/// `asteria bench eigh`: median eigensolve times per backend, size and thread count.
pub fn bench_eigh(sizes: &[usize], threads: &[usize], reps: usize) -> Result<()> {
    out!(
        "{:<8} {:>6} {:>8} {:>12}",
        "solver",
        "n",
        "threads",
        "median ms"
    );
    for name in optim::solver_names() {
        let solver = optim::solver_by_name(name).map_err(|e| miette!("{e}"))?;
        for &n in sizes {
            for &t in threads {
                let ms = optim::bench::eigh_median_ms(solver.as_ref(), n, t, reps)
                    .map_err(|e| miette!("{e}"))?;
                out!("{name:<8} {n:>6} {t:>8} {ms:>12.1}");
            }
        }
    }
    Ok(())
}

/// `asteria bench update-kernels`: see [`cuda::update_bench`].
pub fn bench_update_kernels(ordinal: usize, sizes: &[usize], reps: usize) -> Result<()> {
    let rows =
        cuda::update_bench::update_kernels(ordinal, sizes, reps).map_err(|e| miette!("{e}"))?;
    out!(
        "{:<20} {:>11} {:>10} {:>8}",
        "kernel",
        "elements",
        "median ms",
        "GB/s"
    );
    for r in &rows {
        out!(
            "{:<20} {:>11} {:>10.4} {:>8.0}",
            r.kernel,
            r.n,
            r.median_ms,
            r.gb_per_s
        );
    }
    for &n in sizes {
        let ms = |k: &str| {
            rows.iter()
                .find(|r| r.n == n && r.kernel == k)
                .map(|r| r.median_ms)
        };
        if let (Some(h), Some(g)) = (ms("adamw hand-written"), ms("adamw generated")) {
            out!(
                "n = {n}: generated / hand-written AdamW time = {:.3}",
                g / h
            );
        }
    }
    // SOAP's step, hand-written `soap_update` against the composition `expand-optimizer` writes
    // (bf16 projections): the matrices of GPT-2 124M (every side rotated) and of LLaMA 1.44B at
    // `max_precond_dim = 2048` (the 5632-wide MLP side unrotated).
    let shapes = [
        (768, 2304, [true, true]),
        (768, 3072, [true, true]),
        (3072, 768, [true, true]),
        (2048, 2048, [true, true]),
        (2048, 5632, [true, false]),
        (5632, 2048, [false, true]),
    ];
    let soap =
        cuda::update_bench::soap_steps(ordinal, &shapes, reps).map_err(|e| miette!("{e}"))?;
    out!();
    out!(nonl "{}", cuda::update_bench::soap_table(&soap));
    Ok(())
}

/// Arguments of `asteria selftest`.
pub struct SelftestArgs {
    pub device: String,
    pub ordinal: usize,
    pub seed: Option<u64>,
    pub filter: Option<String>,
    pub quick: bool,
    pub no_kernels: bool,
    pub train_match: Vec<std::path::PathBuf>,
    pub steps: u64,
    pub tol: f64,
    pub refresh: schedule::RefreshPlacement,
    pub cache_dir: Option<std::path::PathBuf>,
    pub compare_state: bool,
    pub resync: bool,
    pub state_tol: f64,
    pub inject_cpu_refreshes: bool,
    pub match_precision: String,
    pub match_target: String,
    pub skip_pass: Vec<String>,
    pub skip_rule: Vec<String>,
    pub nccl: bool,
}

/// The configuration of a train-match under `--match-target cuda`: the spec compiled for
/// `target cuda` on device `ordinal` at `precision` (`--match-precision`). A CUDA spec keeps
/// every other key of its target (attention, refresh placement, weight casts, budgets, ...);
/// a CPU spec becomes `target cuda` with its staleness, eigensolver and host/NVMe budgets (its
/// `memory` budget sized the CPU engine's working set and is dropped) and every other key at
/// its default. The passes then build the plan that `asteria train` runs on that GPU (bf16
/// casts and bf16-stored activations where the precision is bf16), and the CPU engine runs
/// that same plan, its bf16 buffers rounded to bf16 as the GPU stores them.
fn retarget_cuda(
    mut config: ir::config::Config,
    ordinal: usize,
    precision: schedule::Precision,
) -> ir::config::Config {
    use ir::config::TargetConfig;
    if let TargetConfig::Cpu {
        staleness,
        eigensolver,
        budgets,
        ..
    } = &config.target
    {
        let mut budgets = budgets.clone();
        budgets.device = None;
        config.target = TargetConfig::Cuda {
            device: 0,
            staleness: *staleness,
            precision,
            calibration: None,
            eigensolver: *eigensolver,
            attention: Default::default(),
            refresh_placement: Default::default(),
            weight_casts: Default::default(),
            budgets,
        };
    }
    if let TargetConfig::Cuda {
        device,
        precision: p,
        ..
    } = &mut config.target
    {
        (*device, *p) = (ordinal as u32, precision);
    }
    config
}

/// `asteria selftest --device cuda`: the kernel self-test and the CPU-vs-GPU training checks.
pub fn selftest(a: &SelftestArgs) -> Result<()> {
    if a.device != "cuda" {
        return Err(miette!("`--device {}`: only the cuda backend has a self-test (the CPU engine is the reference)", a.device));
    }
    if !cuda::driver_present() {
        return Err(miette!("no CUDA driver (libcuda.so) can be loaded on this machine: the CUDA self-test needs a GPU host"));
    }
    if a.nccl {
        // Before any other work: this may re-execute the program with a libnccl.so alias.
        let user = std::env::var("USER").unwrap_or_else(|_| "user".into());
        let alias = std::env::temp_dir().join(format!("asteria-nccl-alias-{user}"));
        cuda::nccl::ensure_loadable(&alias).map_err(|e| miette!("NCCL: {e}"))?;
    }
    let mut failed = Vec::new();
    if !a.no_kernels {
        let dev = cuda::Device::new(a.ordinal).map_err(|e| miette!("{e}"))?;
        out!("{}", dev.info());
        let opts = cuda::selftest::Options {
            seed: a.seed,
            filter: a.filter.clone(),
            quick: a.quick,
            verbose: false,
        };
        let report = cuda::selftest::run(&dev, &opts);
        out!(nonl "{}", report.table());
        if !report.passed() {
            failed.push("kernel self-test".to_string());
        }
    }
    let refresh = a.refresh;
    let precision = match a.match_precision.as_str() {
        "fp32" => schedule::Precision::Fp32,
        "bf16" => schedule::Precision::Bf16,
        other => return Err(miette!("--match-precision: `{other}` is not fp32 or bf16")),
    };
    if !matches!(a.match_target.as_str(), "spec" | "cuda") {
        return Err(miette!(
            "--match-target: `{}` is not spec or cuda",
            a.match_target
        ));
    }
    for spec in &a.train_match {
        let flags = PassFlags {
            skip_pass: a.skip_pass.clone(),
            skip_rule: a.skip_rule.clone(),
            ..PassFlags::default()
        };
        let (plan, _) = match a.match_target.as_str() {
            "spec" => compile_spec(spec, &flags, &[])?,
            _ => {
                let spec_config = frontend::load_spec(spec).map_err(miette::Report::new)?;
                let config = retarget_cuda(spec_config, a.ordinal, precision);
                compile_config(config, &flags)?
            }
        };
        let opts = cuda::train_match::MatchOptions {
            steps: a.steps,
            tol: a.tol,
            refresh,
            cache_dir: Some(
                a.cache_dir
                    .clone()
                    .unwrap_or_else(|| std::env::temp_dir().join("asteria-token-cache")),
            ),
            threads: None,
            compare_state: a.compare_state || a.inject_cpu_refreshes,
            resync: a.resync,
            state_tol: a.state_tol,
            inject_cpu_refreshes: a.inject_cpu_refreshes,
            precision,
        };
        match cuda::train_match::train_match(&plan, &opts) {
            Ok(r) => {
                out!();
                out!(nonl "{}", r.table());
                if !r.passed() {
                    failed.push(format!("train-match {}", spec.display()));
                }
            }
            Err(e) => {
                out!("train-match {}: ERROR {e}", spec.display());
                failed.push(format!("train-match {}", spec.display()));
            }
        }
    }
    if a.nccl {
        match cuda::nccl::all_reduce_check(1_000_003, a.seed.unwrap_or(7)) {
            Ok(c) => {
                out!(
                    "\n{}: NCCL {} all-reduce (sum) over {} GPU(s), {} f32 each: max rel err {:.2e} (tol {:.0e}), {:.2} ms",
                    if c.passed() { "PASS" } else { "FAIL" },
                    c.version,
                    c.ranks,
                    c.elems,
                    c.max_rel_err,
                    1e-6 * c.ranks as f64,
                    c.ms
                );
                if !c.passed() {
                    failed.push("nccl all-reduce".to_string());
                }
            }
            Err(e) => {
                out!("\nnccl all-reduce: ERROR {e}");
                failed.push("nccl all-reduce".to_string());
            }
        }
    }
    if failed.is_empty() {
        out!("\nselftest: all passed");
        Ok(())
    } else {
        Err(miette!("selftest failed: {}", failed.join(", ")))
    }
}

/// One series of a metrics file: `(step, loss)` and `(step, val_loss)`.
type Series = (String, Vec<(f64, f64)>, Vec<(f64, f64)>);

fn read_series(arg: &str, metric: &str, x_key: &str) -> Result<Series> {
    let (name, path) = match arg.split_once('=') {
        Some((n, p)) => (n.to_string(), std::path::PathBuf::from(p)),
        None => {
            let p = std::path::PathBuf::from(arg);
            (
                p.file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                p,
            )
        }
    };
    let text = std::fs::read_to_string(&path)
        .into_diagnostic()
        .wrap_err_with(|| format!("cannot read {}", path.display()))?;
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: serde_json::Value = serde_json::from_str(line)
            .into_diagnostic()
            .wrap_err_with(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
        let step = v.get(x_key).and_then(serde_json::Value::as_f64);
        match (
            step,
            v.get(metric).and_then(serde_json::Value::as_f64),
            v.get("val_loss")
                .and_then(serde_json::Value::as_f64)
                .filter(|_| metric == "loss"),
        ) {
            (Some(s), Some(l), _) if l.is_finite() => train.push((s, l)),
            (Some(s), _, Some(l)) if l.is_finite() => val.push((s, l)),
            _ => {}
        }
    }
    Ok((name, train, val))
}

/// `asteria plot`: training (lines) and validation (markers) loss of metrics files as an SVG;
/// with `metric` other than `loss`, that per-step key instead (e.g. `step_ms`, ms per step);
/// against `x_key` (`step`, `wall_s`, `energy_j`).
///
/// # Errors
/// Another x key, unreadable or non-JSON files, no finite values, SVG write failures.
pub fn plot(
    metrics: &[String],
    output: &Path,
    title: &str,
    metric: &str,
    x_key: &str,
) -> Result<()> {
    use plotters::prelude::*;
    let x_desc = match x_key {
        "step" => "step",
        "wall_s" => "wall time (s)",
        "energy_j" => "GPU energy (J)",
        other => {
            return Err(miette!(
                "`--x {other}`: the x axis is `step`, `wall_s` or `energy_j`"
            ))
        }
    };
    let series = metrics
        .iter()
        .map(|m| read_series(m, metric, x_key))
        .collect::<Result<Vec<_>>>()?;
    if series.iter().all(|(_, t, v)| t.is_empty() && v.is_empty()) {
        return Err(miette!(
            "no record of the metrics files has both `{x_key}` and `{metric}`{}",
            if x_key == "energy_j" {
                " (energy is measured on NVIDIA GPUs through NVML)"
            } else {
                ""
            }
        ));
    }
    let all = || series.iter().flat_map(|(_, t, v)| t.iter().chain(v));
    let x_max = all().map(|p| p.0).fold(1.0f64, f64::max);
    let y_min = all().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let y_max = all().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    if !y_min.is_finite() || !y_max.is_finite() {
        return Err(miette!("no finite `{metric}` values in the metrics files"));
    }
    let pad = 0.05 * (y_max - y_min).max(1e-3);
    let draw = || -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(output, (900, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d(0f64..x_max, (y_min - pad)..(y_max + pad))?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(if metric == "loss" {
                "loss (nats)".to_string()
            } else {
                metric.to_string()
            })
            .draw()?;
        for (i, (name, train, val)) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(
                    train.iter().copied(),
                    color.stroke_width(2),
                ))?
                .label(if metric == "loss" {
                    format!("{name} train")
                } else {
                    name.clone()
                })
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
            if !val.is_empty() {
                chart
                    .draw_series(
                        val.iter()
                            .map(|&(x, y)| Circle::new((x, y), 4, color.filled())),
                    )?
                    .label(format!("{name} val"))
                    .legend(move |(x, y)| Circle::new((x + 9, y), 4, color.filled()));
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| miette!("plotting to {}: {e}", output.display()))?;
    note!("wrote {}", output.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use schedule::{DType, Precision, TargetPlan};

    /// The GPU-free half of `selftest --match-target cuda`: the tiny CPU spec recompiled for
    /// `target cuda` at bf16 is the plan the GPU trains (bf16 weight copies and bf16-stored
    /// activations, which the CPU spec's plan has none of; staleness kept), and the CPU engine
    /// trains that same plan, its losses within bf16 rounding of the fp32 plan's.
    #[test]
    fn match_target_cuda_compiles_the_gpu_plan_and_the_cpu_engine_trains_it() {
        let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/tiny.asteria");
        let flags = PassFlags::default();
        let config = frontend::load_spec(&spec).expect("tiny spec");
        let (gpu_plan, _) =
            compile_config(retarget_cuda(config, 0, Precision::Bf16), &flags).expect("compile");
        assert!(matches!(
            gpu_plan.target,
            TargetPlan::Cuda {
                precision: Precision::Bf16,
                staleness: 0,
                ..
            }
        ));
        let bf16 = |p: &Plan| p.buffers.iter().filter(|b| b.dtype == DType::Bf16).count();
        let (cpu_plan, _) = compile_spec(&spec, &flags, &[]).expect("compile");
        assert_eq!(
            bf16(&cpu_plan),
            0,
            "the CPU spec's plan stores nothing in bf16"
        );
        assert!(bf16(&gpu_plan) > 10, "bf16 buffers: {}", bf16(&gpu_plan));
        let opts = engine::TrainOptions {
            steps: Some(3),
            quiet: true,
            ..Default::default()
        };
        let mut losses = Vec::new();
        for plan in [&cpu_plan, &gpu_plan] {
            let mut cpu = engine::CpuEngine::<f32>::new(plan.clone(), opts.engine.clone())
                .expect("CPU engine");
            let s = engine::train_with(&mut cpu, &opts).expect("train");
            losses.push(s.train_losses);
        }
        assert_eq!(losses[0].len(), 3);
        for (a, b) in losses[0].iter().zip(&losses[1]) {
            assert!(
                b.is_finite() && (a - b).abs() <= 1e-2 * a.abs(),
                "{a} vs {b}"
            );
        }
        assert_ne!(
            losses[0], losses[1],
            "the bf16 plan rounds what the fp32 one does not"
        );
    }

    /// A CUDA spec keeps every key of its target under `--match-target cuda` but the device
    /// ordinal and the precision.
    #[test]
    fn match_target_cuda_keeps_a_cuda_specs_target_keys() {
        use ir::config::TargetConfig;
        let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/gpt2-124m.asteria");
        let mut config = frontend::load_spec(&spec).expect("gpt2-124m spec");
        let TargetConfig::Cuda {
            attention,
            weight_casts,
            staleness,
            ..
        } = &mut config.target
        else {
            panic!("examples/gpt2-124m.asteria targets cuda");
        };
        *attention = ir::AttentionKernel::Gemm;
        *weight_casts = ir::WeightCasts::Twice;
        *staleness = 3;
        let mut want = config.target.clone();
        if let TargetConfig::Cuda {
            device, precision, ..
        } = &mut want
        {
            (*device, *precision) = (1, Precision::Fp32);
        }
        assert_eq!(retarget_cuda(config, 1, Precision::Fp32).target, want);
    }
}
