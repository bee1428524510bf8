//! The `asteria` command: compile spec files into execution plans, inspect what each pass did,
//! and run plans on the CPU or CUDA engine.
/// `eprintln!` that ignores a closed stderr (a pipe whose reader exited) instead of panicking.
macro_rules! note {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

/// `println!` (and `print!` with `out!(nonl ...)`) that ignores a closed stdout
/// (`asteria ... | head -1`) instead of panicking.
macro_rules! out {
    (nonl $($t:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stdout(), $($t)*);
    }};
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

mod calibrate;
mod commands;
mod explain;
mod trace;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

/// asteria: second-order optimizers (SOAP, Shampoo) for LLM training, as a compiler + engine.
#[derive(Parser)]
#[command(name = "asteria", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Pass-manager flags shared by `compile`, `explain` and `train`.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct PassFlags {
    /// Print the IR after this pass (repeatable): expand-model, autodiff, expand-optimizer,
    /// simplify (element-wise update rules), fuse, rematerialize, liveness, precond-scheduling,
    /// lower (the plan JSON), accumulate-gradients (the backward with its accumulations),
    /// tier-placement, prefetch-insertion, copy-hoisting (where each copy in of offloaded state
    /// runs), memory-planning (the memory plan's arenas, peak live bytes and largest buffers),
    /// copy-out-overlap (how far copies out run on into the next step's forward).
    #[arg(long = "print-after", value_name = "PASS")]
    pub print_after: Vec<String>,
    /// Print the IR after every pass.
    #[arg(long = "print-after-all")]
    pub print_after_all: bool,
    /// Print the IR before this pass (repeatable); before a pass after `lower`, the plan's
    /// programs as they stand.
    #[arg(long = "print-before", value_name = "PASS")]
    pub print_before: Vec<String>,
    /// Verify the IR after every pass.
    #[arg(long = "verify-each")]
    pub verify_each: bool,
    /// Report the wall time of each pass (on stderr).
    #[arg(long = "time-passes")]
    pub time_passes: bool,
    /// Do not run this optional pass (repeatable): fuse (to compare with the unfused plan),
    /// copy-hoisting (to compare copies in issued in the optimizer program only),
    /// copy-out-overlap (to compare copies out that end with their step).
    #[arg(long = "skip-pass", value_name = "PASS")]
    pub skip_pass: Vec<String>,
    /// Do not apply this `fuse` rule (repeatable): soap-update, shampoo-update or
    /// kl-shampoo-update, whose optimizer steps then stay composed (to compare a hand-written
    /// op with its composition).
    #[arg(long = "skip-rule", value_name = "RULE")]
    pub skip_rule: Vec<String>,
    /// Apply this `fuse` rule where the target leaves it out by default (repeatable):
    /// soap-update on a CUDA target selects the hand-written `soap_update` (the composed step
    /// is the default there: measured faster).
    #[arg(long = "apply-rule", value_name = "RULE")]
    pub apply_rule: Vec<String>,
}

/// Spec overrides, shared by `compile`, `explain` and `train`.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct SpecFlags {
    /// Override a key of the spec (repeatable; a later one wins): `--set train.seed=7
    /// --set optimizer.lr=3e-4 --set data.corpus=books`. Checked like a key written in the
    /// spec (same types, ranges and messages, located on the argument) and recorded in the
    /// plan like one; a value is spec syntax, unquoted text is a string.
    #[arg(long = "set", value_name = "BLOCK.KEY=VALUE")]
    pub set: Vec<String>,
}

/// Options of commands that execute a plan.
#[derive(clap::Args, Clone, Debug)]
pub struct RunFlags {
    /// Stop after this many training steps (1..=1_000_000_000). The learning-rate schedule
    /// stays the spec's (warmup and cosine decay over `train.steps`), so a run cut short has
    /// the same steps as the full run up to there, and steps past `train.steps` hold the
    /// schedule's floor; `--set train.steps=N` (on `train`, or on `compile` before `run`)
    /// rescales the schedule instead.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1_000_000_000))]
    pub steps: Option<u64>,
    /// Write per-step and per-evaluation metrics as JSON lines to this file.
    #[arg(long, value_name = "FILE.jsonl")]
    pub metrics: Option<PathBuf>,
    /// No progress bar.
    #[arg(long, short)]
    pub quiet: bool,
    /// Write the run's timeline as a Chrome / Perfetto trace (JSON; open it in
    /// ui.perfetto.dev): steps and their phases, the CPU engine's ops, preconditioner
    /// refreshes on their threads, their launches, waits and swaps.
    #[arg(long, value_name = "FILE.json")]
    pub trace: Option<PathBuf>,
    /// Host eigensolver for preconditioner refreshes (faer or lapack), overriding the spec's
    /// `eigensolver` (the plan records the value that runs).
    #[arg(long, value_name = "SOLVER", value_parser = option_value::<schedule::Eigensolver>)]
    pub eigensolver: Option<schedule::Eigensolver>,
    /// CUDA engine: per-op GPU times, printed at the end (`ops`: a host sync around every op;
    /// `events`: CUDA events, steps keep their overlap), from the second training step on (the
    /// first is warm-up: module loads, GEMM planning). Changes timing only.
    #[arg(long, value_name = "MODE", default_value = "off", value_parser = option_value::<schedule::Profile>)]
    pub profile: schedule::Profile,
    /// Folder for the token cache (default: the system temp dir).
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Stop the run after this many consecutive failed eigenbasis refreshes of one factor
    /// (each failure keeps the previous basis).
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_refresh_failures: u32,
    /// Write checkpoints (weights, the whole optimizer state, data position, step) under DIR:
    /// after the last step, every `--checkpoint-every` steps, and on SIGINT / SIGTERM (the step
    /// in progress finishes first).
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints (needs --checkpoint-dir).
    #[arg(long, value_name = "N", requires = "checkpoint_dir", value_parser = clap::value_parser!(u64).range(1..=1_000_000_000))]
    pub checkpoint_every: Option<u64>,
    /// Checkpoints kept in --checkpoint-dir (the newest).
    #[arg(long, value_name = "K", default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub checkpoint_keep: u64,
    /// Continue from a checkpoint: a `step-N` directory, or a --checkpoint-dir (its newest).
    /// The spec must describe the same model and optimizer; staleness, budgets, lr and steps
    /// may differ.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
}

/// Parses a typed plan option (`schedule::Eigensolver`, `Profile`, ...) for clap; the error
/// lists the allowed values.
fn option_value<T: std::str::FromStr<Err = String>>(s: &str) -> Result<T, String> {
    s.parse()
}

#[derive(Subcommand)]
enum Command {
    /// Compile a spec file into an execution plan (JSON).
    Compile {
        /// The spec file (`*.asteria`).
        spec: PathBuf,
        /// Where to write the plan.
        #[arg(short, long, value_name = "PLAN.json")]
        output: Option<PathBuf>,
        #[command(flatten)]
        passes: PassFlags,
        #[command(flatten)]
        spec_flags: SpecFlags,
    },
    /// Show memory per class, the memory plan's arenas, memory per tier, and ops per step, of a
    /// compiled spec.
    Explain {
        /// The spec file.
        spec: PathBuf,
        #[command(flatten)]
        spec_flags: SpecFlags,
    },
    /// Verify and execute a compiled plan.
    Run {
        /// The plan (from `asteria compile`).
        plan: PathBuf,
        #[command(flatten)]
        run: RunFlags,
    },
    /// Compile a spec and run it.
    Train {
        /// The spec file.
        spec: PathBuf,
        #[command(flatten)]
        run: RunFlags,
        #[command(flatten)]
        passes: PassFlags,
        #[command(flatten)]
        spec_flags: SpecFlags,
    },
    /// Generate text with a checkpoint's weights (the plan it stores; `--device cpu | cuda`): the prompt,
    /// then `--tokens` new tokens drawn from the model's softmax (`--temperature 0`: greedy).
    Sample {
        /// A checkpoint: a `step-N` directory, or a `--checkpoint-dir` (its newest).
        checkpoint: PathBuf,
        /// Text the generation continues.
        #[arg(long)]
        prompt: String,
        /// New tokens to generate (1..=100000).
        #[arg(long, default_value_t = 64)]
        tokens: usize,
        /// Softmax temperature (0..=100; 0 takes the most likely token).
        #[arg(long, default_value_t = 1.0)]
        temperature: f64,
        /// Draw only among the k most likely tokens (0 = all).
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        /// Seed of the draws (the same seed, prompt and checkpoint give the same text).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Engine: `cpu` (runs the checkpoint's plan whatever its target) or `cuda` (a
        /// checkpoint of a CUDA plan, on the GPU).
        #[arg(long, default_value = "cpu")]
        device: String,
    },
    /// Write a checkpoint's weights for other tools: `--format hf` writes a Hugging Face
    /// `transformers` model (config.json + model.safetensors; GPT2LMHeadModel or
    /// LlamaForCausalLM).
    Export {
        /// A checkpoint: a `step-N` directory, or a `--checkpoint-dir` (its newest).
        checkpoint: PathBuf,
        /// Output format (hf).
        #[arg(long, default_value = "hf")]
        format: String,
        /// Output directory (created if missing; its config.json and model.safetensors are
        /// replaced).
        #[arg(short, long, value_name = "DIR")]
        output: PathBuf,
    },
    /// Measure this host (eigensolve and QR times per size, GEMM rate) and write a target
    /// description for the `precond-scheduling` cost model (`target { calibration = "FILE" }`).
    Calibrate {
        /// Where to write the JSON description (stdout when absent).
        #[arg(short, long, value_name = "FILE.json")]
        output: Option<PathBuf>,
        /// Matrix sizes to measure (each 1..=16384).
        #[arg(long, value_delimiter = ',', default_value = "64,128,256,512,1024", value_parser = matrix_size)]
        sizes: Vec<usize>,
        /// Worker threads (default: all cores; 1..=4096).
        #[arg(long, value_parser = count)]
        threads: Option<usize>,
        /// Repetitions per measurement (median reported; 1..=4096).
        #[arg(long, default_value_t = 3, value_parser = count)]
        reps: usize,
        /// Also measure a GPU (`cuda`): refresh times through the engine's cuSOLVER refresher,
        /// pinned host→device bandwidth and the bf16 GEMM rate; the description then places
        /// refreshes between the host pool and the GPU side stream.
        #[arg(long)]
        device: Option<String>,
        /// CUDA device ordinal (with `--device cuda`).
        #[arg(long, default_value_t = 0)]
        ordinal: usize,
        /// With `--device cuda`: print the GPU refresher's phase times as GPU times, from extra
        /// refreshes that synchronise after every phase (the measured refresh times are not
        /// affected).
        #[arg(long)]
        sync_phases: bool,
        /// Also measure the NVMe tier's drive: write and read 256 MiB through the engine's
        /// checksummed NVMe store (O_DIRECT where the filesystem allows) in this directory.
        #[arg(long, value_name = "DIR")]
        nvme: Option<PathBuf>,
    },
    /// Check a backend: `--device cuda` runs every CUDA kernel against the CPU kernels and,
    /// with `--train-match SPEC`, trains SPEC on the CPU and the GPU engine in one process and
    /// compares the losses step by step (GPU in fp32). Exit status 1 on any failure.
    Selftest {
        /// The backend to check (only `cuda` has a self-test).
        #[arg(long, default_value = "cuda")]
        device: String,
        /// CUDA device ordinal.
        #[arg(long, default_value_t = 0)]
        ordinal: usize,
        /// Seed of the kernel self-test's inputs (default: from the clock).
        #[arg(long)]
        seed: Option<u64>,
        /// Only kernel cases whose name contains this.
        #[arg(long)]
        filter: Option<String>,
        /// Skip the largest kernel sizes.
        #[arg(long)]
        quick: bool,
        /// Skip the kernel self-test (only the train-match checks).
        #[arg(long)]
        no_kernels: bool,
        /// Spec to train on both engines and compare (repeatable).
        #[arg(long = "train-match", value_name = "SPEC")]
        train_match: Vec<PathBuf>,
        /// Steps of each train-match.
        #[arg(long, default_value_t = 20)]
        steps: u64,
        /// Largest allowed relative loss difference of any step.
        #[arg(long, default_value_t = 1e-4)]
        tol: f64,
        /// Where the GPU engine refreshes eigenbases in the train-match: gpu, host or auto (as
        /// compiled); the plan is rewritten accordingly.
        #[arg(long, default_value = "gpu", value_parser = option_value::<schedule::RefreshPlacement>)]
        refresh: schedule::RefreshPlacement,
        /// Folder for the token cache.
        #[arg(long, value_name = "DIR")]
        cache_dir: Option<PathBuf>,
        /// Train-match: run both engines in lockstep and compare every plan buffer after each
        /// step (prints the buffers over `--state-tol`, worst 5).
        #[arg(long)]
        compare_state: bool,
        /// With `--compare-state`: copy the CPU state into the GPU engine after each step, so
        /// each step's differences are one step's.
        #[arg(long)]
        resync: bool,
        /// With `--compare-state`: list buffers whose max|gpu - cpu| / max|cpu| exceeds this.
        #[arg(long, default_value_t = 1e-5)]
        state_tol: f64,
        /// Train-match: after every step that installs eigenbasis refreshes, copy the CPU
        /// engine's new bases and re-projected moments into the GPU engine (checks everything
        /// but the GPU eigensolver, whose bases of nearly degenerate factors legitimately
        /// differ; the kernel self-test checks the GPU refresh itself). With staleness > 0 the
        /// plan runs with `refresh_swap = deadline` so that both engines install each result at
        /// the same step. Implies `--compare-state`.
        #[arg(long)]
        inject_cpu_refreshes: bool,
        /// GEMM precision of the GPU engine in the train-match: fp32 (bit-for-bit check) or
        /// bf16 (the production path against the fp32 CPU engine; pass a looser --tol, e.g. 0.02).
        #[arg(long, default_value = "fp32")]
        match_precision: String,
        /// Train-match: the plan both engines run. `spec`: the spec as written (a CPU spec's
        /// plan; with --match-precision bf16 only its GEMMs run in bf16 on the GPU). `cuda`:
        /// the spec recompiled for `target cuda` at --match-precision, the plan `asteria train`
        /// runs on the GPU (bf16 weight copies, bf16-stored activations and gradients); the CPU
        /// engine runs the same plan, rounding those buffers to bf16 as the GPU stores them.
        #[arg(long, default_value = "spec", value_parser = ["spec", "cuda"])]
        match_target: String,
        /// Train-match: compile the specs without this optional pass (repeatable): `fuse`
        /// leaves every optimizer step composed (a SOAP step's `project` and rules with
        /// results run on both engines) and the model ops unfused.
        #[arg(long = "skip-pass", value_name = "PASS")]
        skip_pass: Vec<String>,
        /// Train-match: compile the specs without this `fuse` rule (repeatable):
        /// `soap-update` leaves SOAP's steps composed (as a CUDA target runs them) while the
        /// model ops stay fused.
        #[arg(long = "skip-rule", value_name = "RULE")]
        skip_rule: Vec<String>,
        /// Also check NCCL: a sum all-reduce over every visible GPU against the f64 sum (finds
        /// `libnccl.so.2` when cudarc cannot, re-executing with a `libnccl.so` alias).
        #[arg(long)]
        nccl: bool,
    },
    /// Plot loss curves of metrics files (`--metrics` JSONL of `asteria train`) as an SVG.
    Plot {
        /// Metrics files; each is one series, named by its file stem (or `NAME=FILE`).
        #[arg(required = true)]
        metrics: Vec<String>,
        /// The SVG to write.
        #[arg(short, long, value_name = "FILE.svg")]
        output: PathBuf,
        /// Title of the plot.
        #[arg(long, default_value = "training loss")]
        title: String,
        /// The per-step key to plot (`loss`, `step_ms`, `optimizer_ms`, `refresh_wait_ms`, ...).
        #[arg(long, default_value = "loss")]
        metric: String,
        /// The key on the x axis: `step`, `wall_s` (seconds since the run started) or
        /// `energy_j` (the training steps' GPU joules so far; GPU runs).
        #[arg(long, default_value = "step")]
        x: String,
    },
    /// Micro-benchmarks of the runtime's building blocks.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Element-wise optimizer update kernels on a CUDA device (all generated from update
    /// rules): the AdamW op's and every rule-defined optimizer's; median GPU ms and effective
    /// GB/s per update. Then SOAP's step at the matrix shapes of GPT-2 124M and LLaMA 1.44B,
    /// the hand-written `soap_update` against the composed step (`project`, the generated
    /// rule kernels, `project` back).
    UpdateKernels {
        /// CUDA device ordinal.
        #[arg(long, default_value_t = 0)]
        ordinal: usize,
        /// Elements per tensor.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "1000000,16000000,124000000"
        )]
        sizes: Vec<usize>,
        /// Timed repetitions per kernel and size (the median is reported).
        #[arg(long, default_value_t = 20)]
        reps: usize,
    },
    /// Host eigensolvers (faer, lapack) on random symmetric matrices: median ms per eigh.
    Eigh {
        /// Matrix sizes (each 1..=16384).
        #[arg(long, value_delimiter = ',', default_value = "512,1024,2048", value_parser = matrix_size)]
        sizes: Vec<usize>,
        /// Thread counts (each 1..=4096).
        #[arg(long, value_delimiter = ',', default_value = "2", value_parser = count)]
        threads: Vec<usize>,
        /// Repetitions per measurement (the median is reported; 1..=4096).
        #[arg(long, default_value_t = 3, value_parser = count)]
        reps: usize,
    },
}

/// When `main` began: time to first step counts from here.
fn started() -> std::time::Instant {
    *STARTED.get_or_init(std::time::Instant::now)
}
static STARTED: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

fn main() -> ExitCode {
    started();
    let cli = Cli::parse();
    let trace_file = match &cli.command {
        Command::Run { run, .. } | Command::Train { run, .. } => run.trace.clone(),
        _ => None,
    };
    // Finished at the end of `main`: writes the end of the trace file, then the GPU's slices.
    let trace_guard = match trace::init(trace_file.as_deref()) {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Command::Compile {
            spec,
            output,
            passes,
            spec_flags,
        } => commands::compile(&spec, output.as_deref(), &passes, &spec_flags.set),
        Command::Explain { spec, spec_flags } => explain::explain(&spec, &spec_flags.set),
        Command::Run { plan, run } => commands::run(&plan, &run),
        Command::Train {
            spec,
            run,
            passes,
            spec_flags,
        } => commands::train(&spec, &run, &passes, &spec_flags.set),
        Command::Sample {
            checkpoint,
            prompt,
            tokens,
            temperature,
            top_k,
            seed,
            device,
        } => commands::sample(
            &checkpoint,
            &prompt,
            &engine::sample::SampleOptions {
                tokens,
                temperature,
                top_k,
                seed,
            },
            &device,
        ),
        Command::Export {
            checkpoint,
            format,
            output,
        } => commands::export(&checkpoint, &format, &output),
        Command::Calibrate {
            output,
            sizes,
            threads,
            reps,
            device,
            ordinal,
            sync_phases,
            nvme,
        } => calibrate::calibrate(
            output.as_deref(),
            &sizes,
            threads,
            reps,
            device.as_deref(),
            ordinal,
            sync_phases,
            nvme.as_deref(),
        ),
        Command::Bench {
            what:
                BenchCommand::Eigh {
                    sizes,
                    threads,
                    reps,
                },
        } => commands::bench_eigh(&sizes, &threads, reps),
        Command::Bench {
            what:
                BenchCommand::UpdateKernels {
                    ordinal,
                    sizes,
                    reps,
                },
        } => commands::bench_update_kernels(ordinal, &sizes, reps),
        Command::Selftest {
            device,
            ordinal,
            seed,
            filter,
            quick,
            no_kernels,
            train_match,
            steps,
            tol,
            refresh,
            cache_dir,
            compare_state,
            resync,
            state_tol,
            inject_cpu_refreshes,
            match_precision,
            match_target,
            skip_pass,
            skip_rule,
            nccl,
        } => commands::selftest(&commands::SelftestArgs {
            device,
            ordinal,
            seed,
            filter,
            quick,
            no_kernels,
            train_match,
            steps,
            tol,
            refresh,
            cache_dir,
            compare_state,
            resync,
            state_tol,
            inject_cpu_refreshes,
            match_precision,
            match_target,
            skip_pass,
            skip_rule,
            nccl,
        }),
        Command::Plot {
            metrics,
            output,
            title,
            metric,
            x,
        } => commands::plot(&metrics, &output, &title, &metric, &x),
    };
    let result = match (trace_guard, &trace_file) {
        (Some(guard), Some(path)) => {
            let merged = trace::finish(guard, path).map_err(|e| miette::miette!("{e}"));
            result.and(merged)
        }
        _ => result,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(report) => {
            // Rendered once and written in one call (miette writes character by character),
            // ignoring a closed stderr.
            let text = format!("{report:?}");
            note!("{text}");
            ExitCode::FAILURE
        }
    }
}

/// A measured matrix side `n` (of `n × n` factors): 1..=16384.
fn matrix_size(s: &str) -> Result<usize, String> {
    in_range(s, 1, 16384)
}

/// A thread or repetition count: 1..=4096.
fn count(s: &str) -> Result<usize, String> {
    in_range(s, 1, 4096)
}

fn in_range(s: &str, lo: usize, hi: usize) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (lo..=hi).contains(&n) => Ok(n),
        _ => Err(format!("expected a whole number in {lo}..={hi}, got `{s}`")),
    }
}
