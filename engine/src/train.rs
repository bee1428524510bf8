//! The training loop: data through `asteria-data`, steps through [`CpuEngine`], validation,
//! JSONL metrics, a progress bar and a summary.
use crate::cpu::{CpuEngine, EngineOptions, EngineStats};
use crate::EngineError;
use crate::HostTaskReport;
use data::{BatchSampler, CorpusSource, Dataset};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use schedule::{Corpus, Op, Plan, Tokenizer};
use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Options of [`train`] (everything not in the plan).
#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    /// Number of steps; `None` = `plan.train.steps`.
    pub steps: Option<u64>,
    /// Folder for the tokenized-corpus cache (llm.c u16 token files); `None` = no cache.
    pub cache_dir: Option<PathBuf>,
    /// Write one JSON object per line here: per step
    /// `{"step","loss","lr","grad_norm","step_ms","tokens_per_s","optimizer_ms",
    /// "refresh_wait_ms","refreshes_launched","refreshes_swapped","max_swap_staleness"}`, per
    /// evaluation `{"step","val_loss"}` (step 0 = before training). `optimizer_ms` is the wall
    /// time of the optimizer program plus the host tasks on the critical path (the visible
    /// optimizer overhead); `refresh_wait_ms` the part of it blocked on background refreshes;
    /// `max_swap_staleness` (steps between launch and swap, max over this step's swaps) is null
    /// when nothing was swapped in; `wall_s` is the seconds since [`TrainOptions::started`]
    /// at the end of the step (of the evaluation in evaluation records); `step_j` the device's
    /// joules in the step and `energy_j` the training steps' joules so far (evaluations
    /// excluded; also in evaluation records), both null where energy is not measured
    /// ([`StepExecutor::energy_j`]: NVML on NVIDIA GPUs).
    pub metrics_path: Option<PathBuf>,
    /// No progress bar and no summary line on stderr (the bar is also hidden when stderr is
    /// not a terminal).
    pub quiet: bool,
    /// Engine options (seed override, threads, eigensolver, refresh failure limit).
    pub engine: EngineOptions,
    /// Write checkpoints under this directory ([`crate::checkpoint`]): every
    /// `checkpoint_every` steps, after the last step, and when interrupted.
    pub checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints; `None` = only at the end (and when interrupted).
    pub checkpoint_every: Option<u64>,
    /// Checkpoints kept (the newest); 0 counts as 1.
    pub checkpoint_keep: usize,
    /// Continue from this checkpoint (a `step-N` directory, or a checkpoint directory: its
    /// newest) instead of the plan's initial state.
    pub resume: Option<PathBuf>,
    /// Set (by a SIGINT / SIGTERM handler) to stop after the current step, checkpointing
    /// first when `checkpoint_dir` is given.
    pub interrupt: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// When the process (or the caller's run) started: the metrics' `wall_s` and the "first
    /// step after" line count from here. `None` = from the start of [`train_with`] (engine
    /// construction, plan compilation and start-up then do not count).
    pub started: Option<Instant>,
}

/// What a training run did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrainSummary {
    /// Steps run.
    pub steps: u64,
    /// Training loss (nats) of every step, in order.
    pub train_losses: Vec<f64>,
    /// `(step, validation loss)` of every evaluation; step 0 is before training.
    pub val_losses: Vec<(u64, f64)>,
    /// Median wall time of one step (forward, backward, optimizer, host tasks), ms.
    pub median_step_ms: f64,
    /// Seconds from [`TrainOptions::started`] to the end of the first step of this run.
    pub first_step_s: f64,
    /// Training tokens per second over all steps.
    pub tokens_per_s: f64,
    /// Failed eigenbasis refreshes (all tasks).
    pub refresh_failures: u64,
    /// Eigenbasis refresh results swapped in (all tasks, inline ones included).
    pub refresh_swaps: u64,
    /// Mean steps between a refresh's launch and its swap, over all swaps.
    pub mean_swap_staleness: f64,
    /// Largest steps between a refresh's launch and its swap.
    pub max_swap_staleness: u64,
    /// Times a step blocked on a background refresh (its staleness bound was reached).
    pub refresh_waits: u64,
    /// Total time blocked on background refreshes, ms.
    pub refresh_wait_ms: f64,
    /// Median optimizer time per step (optimizer program + host tasks on the critical path), ms.
    pub median_optimizer_ms: f64,
    /// Largest optimizer time of one step (the refresh latency spike of native SOAP), ms.
    pub max_optimizer_ms: f64,
    /// Optimizer steps skipped for a non-finite gradient norm.
    pub skipped_steps: u64,
    /// Eigenbasis refreshes skipped because their Kronecker factor was exactly zero (a
    /// parameter whose gradients all vanished); the previous basis was kept. Not failures.
    pub zero_factor_refreshes: u64,
    /// Joules the device used in the training steps (evaluations excluded; NVML on NVIDIA
    /// GPUs), `None` where energy is not measured.
    pub energy_j: Option<f64>,
    /// [`TrainSummary::energy_j`] over the training tokens of the steps run, J/token.
    pub joules_per_token: Option<f64>,
    /// Tokens in the training / validation splits.
    pub train_tokens: usize,
    /// Tokens in the validation split.
    pub val_tokens: usize,
}

impl TrainSummary {
    /// Loss of the last step (NaN when no step ran).
    pub fn final_train_loss(&self) -> f64 {
        self.train_losses.last().copied().unwrap_or(f64::NAN)
    }
    /// Last validation loss, if any evaluation ran.
    pub fn final_val_loss(&self) -> Option<f64> {
        self.val_losses.last().map(|v| v.1)
    }

    /// Why the run looks diverged, if it does: the last step's training loss is not finite,
    /// or, over at least [`DIVERGENCE_MIN_STEPS`] steps, the mean loss of the last tenth of
    /// them (at least one step) ends above the first step's by more than 5%. A language
    /// model's loss starts near `ln(vocab)` and falls; ending above that start means the
    /// optimizer is making things worse. `None` for a run that looks sane.
    /// `clipped`: the plan clips the gradients' global norm (the hint then suggests a lower
    /// threshold rather than a clip).
    pub fn divergence(&self, clipped: bool) -> Option<String> {
        let losses = &self.train_losses;
        let (&first, &last) = (losses.first()?, losses.last()?);
        let hint = if clipped {
            "a lower `optimizer.lr` (or a smaller `train.grad_clip`) usually helps"
        } else {
            "a lower `optimizer.lr` or a `train.grad_clip` usually helps"
        };
        if !last.is_finite() {
            return Some(format!(
                "the training loss is {last} at the last step: the run diverged; {hint}"
            ));
        }
        if losses.len() < DIVERGENCE_MIN_STEPS || !first.is_finite() {
            return None;
        }
        let k = (losses.len() / 10).max(1);
        let tail = losses[losses.len() - k..].iter().sum::<f64>() / k as f64;
        let over = if k == 1 {
            "at the last step".to_string()
        } else {
            format!("the mean of the last {k} steps")
        };
        (tail > first * 1.05).then(|| {
            format!(
                "the training loss rose from {first:.4} at the first step of this run to \
                 {tail:.4} ({over}): the run is diverging; {hint}"
            )
        })
    }
}

/// Fewest steps a run needs before [`TrainSummary::divergence`] compares its loss with the
/// first step's (a few steps of a short run may rise before they fall).
pub const DIVERGENCE_MIN_STEPS: usize = 10;

impl std::fmt::Display for TrainSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let val = self
            .final_val_loss()
            .map_or("-".to_string(), |v| format!("{v:.4}"));
        write!(
            f,
            "steps {} | train loss {:.4} | val loss {} | median step {:.1} ms (optimizer {:.1} ms, max {:.1} ms) | {:.0} tok/s | refreshes {} swapped, staleness mean {:.2} max {}, {} waits {:.1} ms | refresh failures {} (zero-factor skips {}) | skipped steps {}",
            self.steps,
            self.final_train_loss(),
            val,
            self.median_step_ms,
            self.median_optimizer_ms,
            self.max_optimizer_ms,
            self.tokens_per_s,
            self.refresh_swaps,
            self.mean_swap_staleness,
            self.max_swap_staleness,
            self.refresh_waits,
            self.refresh_wait_ms,
            self.refresh_failures,
            self.zero_factor_refreshes,
            self.skipped_steps
        )?;
        if let (Some(j), Some(jt)) = (self.energy_j, self.joules_per_token) {
            write!(f, " | energy {j:.0} J ({:.2} mJ/token)", jt * 1e3)?;
        }
        Ok(())
    }
}

/// JSONL metrics sink (no-op without a path).
struct Metrics {
    out: Option<(PathBuf, BufWriter<std::fs::File>)>,
}

impl Metrics {
    /// Creates (or, with `append`, a resumed run's, appends to) the metrics file.
    fn open(path: Option<&Path>, append: bool) -> Result<Self, EngineError> {
        let out = match path {
            None => None,
            Some(p) => {
                let io = |source| EngineError::Io {
                    what: "creating the metrics file",
                    path: p.display().to_string(),
                    source,
                };
                if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir).map_err(io)?;
                }
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .write(true)
                    .append(append)
                    .truncate(!append)
                    .open(p)
                    .map_err(io)?;
                Some((p.to_path_buf(), BufWriter::new(file)))
            }
        };
        Ok(Metrics { out })
    }
    fn write(&mut self, value: serde_json::Value) -> Result<(), EngineError> {
        if let Some((path, w)) = &mut self.out {
            writeln!(w, "{value}")
                .and_then(|_| w.flush())
                .map_err(|source| EngineError::Io {
                    what: "writing the metrics file",
                    path: path.display().to_string(),
                    source,
                })?;
        }
        Ok(())
    }
}

/// The peak lr of the first optimizer op that has one (for the metrics' `lr`).
fn peak_lr(plan: &Plan) -> Option<f64> {
    plan.optimizer.iter().find_map(|op| match op {
        Op::AdamW { lr, .. } => Some(*lr),
        Op::SoapUpdate { hyper, .. } => Some(hyper.lr),
        Op::KlShampooUpdate { hyper, .. } => Some(hyper.lr),
        Op::ShampooUpdate { hyper, .. } => Some(hyper.lr),
        Op::ElementwiseUpdate { rule, .. } => Some(rule.lr),
        _ => None,
    })
}

/// Loads the plan's corpus through `asteria-data` and returns the batch sampler: text is
/// tokenized (cached under `opts.cache_dir`); token shards are memory-mapped, their headers
/// checked and every token id checked against the model's vocabulary (the rows of the plan's
/// token embedding) before anything trains.
fn load_data(plan: &Plan, opts: &TrainOptions) -> Result<BatchSampler, EngineError> {
    let (b, t) = (plan.data.batch_size, plan.data.seq_len);
    let source = match &plan.data.corpus {
        Corpus::Builtin => CorpusSource::Builtin,
        Corpus::Files { paths } => CorpusSource::Files(paths.iter().map(PathBuf::from).collect()),
        Corpus::Shards { train, val } => {
            let vocab = plan_vocab(plan)?;
            let paths = |v: &[String]| v.iter().map(PathBuf::from).collect::<Vec<_>>();
            let train_stream = data::load_shards(&paths(train), vocab)?;
            let dataset = if val.is_empty() {
                Dataset::split(train_stream, plan.data.val_fraction, t)?
            } else {
                let val_stream = data::load_shards(&paths(val), vocab)?;
                Dataset::from_splits(train_stream, val_stream, t)?
            };
            dataset.check_batch(b, t)?;
            return Ok(BatchSampler::new(dataset, plan.train.seed));
        }
    };
    let tokenizer = match plan.data.tokenizer {
        Tokenizer::Gpt2 => data::Tokenizer::Gpt2,
        Tokenizer::Bytes => data::Tokenizer::Bytes,
    };
    let tokens = data::load_corpus_tokens(&source, tokenizer, opts.cache_dir.as_deref())?;
    let dataset = Dataset::new(tokens, plan.data.val_fraction, t)?;
    dataset.check_batch(b, t)?;
    Ok(BatchSampler::new(dataset, plan.train.seed))
}

/// The model's vocabulary: rows of the table of the plan's first `embedding` op.
fn plan_vocab(plan: &Plan) -> Result<usize, EngineError> {
    plan.forward
        .iter()
        .find_map(|op| match op {
            Op::Embedding { table, .. } => plan.buffer(*table).shape.first().copied(),
            _ => None,
        })
        .ok_or_else(|| {
            EngineError::Option(format!(
                "plan `{}` reads token shards but has no token embedding to size their ids against",
                plan.name
            ))
        })
}

/// A backend that executes the steps of a verified plan (the CPU engine; the CUDA engine in
/// `asteria-cuda`). [`train_with`] drives any of them with the same data, schedule, metrics
/// and evaluation.
pub trait StepExecutor {
    /// The plan being executed.
    fn plan(&self) -> &Plan;
    /// Copies one batch of token ids and targets (i32 `[batch * seq_len]`) into the plan's
    /// input buffers.
    fn load_batch(&mut self, tokens: &[i32], targets: &[i32]) -> Result<(), EngineError>;
    /// Runs the forward program; returns the mean loss in nats.
    fn forward(&mut self) -> Result<f64, EngineError>;
    /// Runs the backward program for micro-batch `micro` (0-based) of the step: with
    /// `train.grad_accum` ≥ 2 its `GradAccumulate` ops store the micro-batch's gradient on
    /// micro-batch 0 and add it on the others (`micro` is 0 without accumulation).
    fn backward(&mut self, micro: u64) -> Result<(), EngineError>;
    /// Runs the optimizer program for 1-based step `t` with the schedule's lr multiplier;
    /// `false` when the step was skipped (non-finite gradient norm).
    fn optimizer_step(&mut self, t: u64, lr_multiplier: f64) -> Result<bool, EngineError>;
    /// Runs (or launches) the host tasks due at the end of step `t`.
    fn run_host_tasks(&mut self, t: u64) -> Result<HostTaskReport, EngineError>;
    /// Counters kept across steps.
    fn stats(&self) -> &EngineStats;
    /// One line naming the backend for logs (`cpu (2 threads)`, `cuda:0 NVIDIA H200`).
    fn describe(&self) -> String;
    /// Blocks until the step's device work is done (for honest step timings). CPU: no-op.
    fn synchronize(&mut self) -> Result<(), EngineError> {
        Ok(())
    }
    /// Joules the device has used since the engine was set up (NVML on NVIDIA GPUs); `None`
    /// where it cannot be measured (the CPU engine). Read after [`StepExecutor::synchronize`].
    fn energy_j(&self) -> Option<f64> {
        None
    }
    /// What measures [`StepExecutor::energy_j`] (`"NVIDIA H200, NVML energy counter"`).
    fn energy_source(&self) -> Option<String> {
        None
    }
    /// The contents of state buffer `name` as f64 (checkpoints; [`crate::checkpoint`]).
    fn read_state(&self, name: &str) -> Result<Vec<f64>, EngineError> {
        let _ = name;
        Err(self.no_checkpoints())
    }
    /// Elements `start..start + len` of buffer `name` (a sampled row of logits). Default: the
    /// whole buffer read and cut.
    ///
    /// # Errors
    /// [`EngineError::Length`] when the range leaves the buffer; as [`StepExecutor::read_state`].
    fn read_range(&self, name: &str, start: usize, len: usize) -> Result<Vec<f64>, EngineError> {
        let all = self.read_state(name)?;
        match start.checked_add(len) {
            Some(end) if end <= all.len() => Ok(all[start..end].to_vec()),
            _ => Err(EngineError::Length {
                buffer: name.to_string(),
                expected: all.len(),
                got: start.saturating_add(len),
            }),
        }
    }
    /// Overwrites state buffer `name` (resuming from a checkpoint).
    fn write_state(&mut self, name: &str, values: &[f64]) -> Result<(), EngineError> {
        let _ = (name, values);
        Err(self.no_checkpoints())
    }
    /// Counters, writable (a resume restores failure counters and skipped steps).
    fn stats_mut(&mut self) -> Result<&mut EngineStats, EngineError> {
        Err(self.no_checkpoints())
    }
    /// Per refresh task, whether its first eigendecomposition succeeded.
    fn refreshes_initialized(&self) -> Vec<bool> {
        Vec::new()
    }
    /// Waits for work the engine still runs after the last step (the CUDA engine's delayed
    /// host updates) and reports its failure; called once, after the last step. Default:
    /// nothing runs after a step.
    ///
    /// # Errors
    /// The failure of such work.
    fn finish(&mut self) -> Result<(), EngineError> {
        Ok(())
    }
    /// Restores [`StepExecutor::refreshes_initialized`].
    fn set_refreshes_initialized(&mut self, flags: &[bool]) -> Result<(), EngineError> {
        let _ = flags;
        Err(self.no_checkpoints())
    }
    /// Waits for every refresh in flight and swaps it in, as at the end of step `t` (before a
    /// checkpoint, so that it holds no half-finished refresh).
    fn drain_refreshes(&mut self, t: u64) -> Result<(), EngineError> {
        let _ = t;
        Err(self.no_checkpoints())
    }
    /// The refreshes a checkpoint after step `t` records. Default: drains them (installs each
    /// now, within its bound) and records none.
    ///
    /// # Errors
    /// As [`StepExecutor::drain_refreshes`].
    fn checkpoint_refreshes(
        &mut self,
        t: u64,
    ) -> Result<Vec<crate::checkpoint::InFlightRefresh>, EngineError> {
        self.drain_refreshes(t)?;
        Ok(Vec::new())
    }
    /// Restarts a checkpoint's refreshes in flight. Default: accepts none.
    ///
    /// # Errors
    /// [`EngineError::Checkpoint`] when there are some and this engine cannot replay them.
    fn restore_refreshes(
        &mut self,
        refreshes: &[crate::checkpoint::InFlightRefresh],
    ) -> Result<(), EngineError> {
        if refreshes.is_empty() {
            Ok(())
        } else {
            Err(EngineError::Checkpoint(format!(
                "{} cannot resume refreshes in flight ({} recorded)",
                self.describe(),
                refreshes.len()
            )))
        }
    }
    /// The error of a backend that does not checkpoint.
    fn no_checkpoints(&self) -> EngineError {
        EngineError::Checkpoint(format!("{} does not checkpoint", self.describe()))
    }
}

impl<T: crate::cpu::Float + optim::Real> StepExecutor for CpuEngine<T> {
    fn plan(&self) -> &Plan {
        CpuEngine::plan(self)
    }
    fn load_batch(&mut self, tokens: &[i32], targets: &[i32]) -> Result<(), EngineError> {
        CpuEngine::load_batch(self, tokens, targets)
    }
    fn forward(&mut self) -> Result<f64, EngineError> {
        CpuEngine::forward(self)
    }
    fn backward(&mut self, micro: u64) -> Result<(), EngineError> {
        CpuEngine::backward_micro(self, micro)
    }
    fn optimizer_step(&mut self, t: u64, lr_multiplier: f64) -> Result<bool, EngineError> {
        CpuEngine::optimizer_step(self, t, lr_multiplier)
    }
    fn run_host_tasks(&mut self, t: u64) -> Result<HostTaskReport, EngineError> {
        CpuEngine::run_host_tasks(self, t)
    }
    fn stats(&self) -> &EngineStats {
        CpuEngine::stats(self)
    }
    fn describe(&self) -> String {
        format!("cpu ({} threads)", self.threads())
    }
    fn read_state(&self, name: &str) -> Result<Vec<f64>, EngineError> {
        CpuEngine::buffer(self, name)
    }
    fn write_state(&mut self, name: &str, values: &[f64]) -> Result<(), EngineError> {
        CpuEngine::set_buffer(self, name, values)
    }
    fn stats_mut(&mut self) -> Result<&mut EngineStats, EngineError> {
        Ok(CpuEngine::stats_mut(self))
    }
    fn refreshes_initialized(&self) -> Vec<bool> {
        CpuEngine::refreshes_initialized(self)
    }
    fn set_refreshes_initialized(&mut self, flags: &[bool]) -> Result<(), EngineError> {
        CpuEngine::set_refreshes_initialized(self, flags)
    }
    fn drain_refreshes(&mut self, t: u64) -> Result<(), EngineError> {
        CpuEngine::finish_refreshes(self, t).map(|_| ())
    }
    fn checkpoint_refreshes(
        &mut self,
        _t: u64,
    ) -> Result<Vec<crate::checkpoint::InFlightRefresh>, EngineError> {
        Ok(self.in_flight_refreshes())
    }
    fn restore_refreshes(
        &mut self,
        refreshes: &[crate::checkpoint::InFlightRefresh],
    ) -> Result<(), EngineError> {
        self.relaunch_refreshes(refreshes)
    }
}

/// Mean validation loss over `plan.train.eval_batches` deterministic validation batches.
fn evaluate<E: StepExecutor>(
    engine: &mut E,
    sampler: &BatchSampler,
    x: &mut [i32],
    y: &mut [i32],
) -> Result<f64, EngineError> {
    let (b, t, k) = (
        engine.plan().data.batch_size,
        engine.plan().data.seq_len,
        engine.plan().train.eval_batches,
    );
    let mut sum = 0.0;
    for i in 0..k {
        sampler.val_batch(i as usize, b, t, x, y)?;
        engine.load_batch(x, y)?;
        sum += engine.forward()?;
    }
    Ok(sum / k.max(1) as f64)
}

fn progress_bar(steps: u64, quiet: bool) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(steps), ProgressDrawTarget::stderr());
    if quiet || !std::io::stderr().is_terminal() {
        pb.set_draw_target(ProgressDrawTarget::hidden());
    }
    if let Ok(style) = ProgressStyle::with_template("step {pos}/{len} [{bar:30}] {msg} ETA {eta}") {
        pb.set_style(style.progress_chars("=> "));
    }
    pb
}

/// Trains `plan` on the CPU in f32: loads and tokenizes the corpus (`plan.data`, cached under
/// `opts.cache_dir`), samples seeded batches (`plan.train.seed`), and runs `steps` steps of
/// load → forward → backward → optimizer (lr × `plan.train.lr_multiplier(t)`) → host tasks.
/// Validation loss (mean over `eval_batches` fixed validation batches) is measured once before
/// training (≈ ln(vocab) for a fresh model), every `eval_interval` steps and after the last
/// step (`eval_interval = 0`: never).
///
/// # Errors
/// Any [`EngineError`]: invalid plan, `steps` outside `schedule::limits::STEPS` (0 steps is an
/// error, not an empty summary), data loading (a corpus split smaller than one batch),
/// buffers larger than the free memory, a kernel error (bad token id), creating or writing the
/// metrics file ([`EngineError::Io`], naming the file; the lines written before it stay), too
/// many consecutive eigenbasis refresh failures, or [`EngineError::Diverged`]: the optimizer
/// skipped `plan.train.max_skipped_steps` consecutive steps for a non-finite gradient norm
/// (the metrics file then ends with the last skipped step). An offload tier's error
/// ([`EngineError::Tier`]: a corrupt or truncated NVMe block) names the step that did not
/// finish and the newest checkpoint of the run, with the `--resume` that continues from it.
pub fn train(plan: &Plan, opts: &TrainOptions) -> Result<TrainSummary, EngineError> {
    plan.verify()?;
    let mut engine = CpuEngine::<f32>::new(plan.clone(), opts.engine.clone())?;
    train_with(&mut engine, opts)
}

/// `e`, the error that stopped step `step`; an offload tier's ([`EngineError::Tier`]: a
/// corrupt or truncated NVMe block, a failed write) says what of the run is kept: the newest
/// checkpoint `last` (its step and directory) and how to continue from it, or that there is
/// none. Other errors are returned as they are.
fn stopped_at(e: EngineError, step: u64, last: Option<&(u64, PathBuf)>) -> EngineError {
    match e {
        EngineError::Tier(m) => {
            let kept = match last {
                Some((k, dir)) => format!(
                    "the newest checkpoint, after step {k}, is {} (continue with --resume {})",
                    dir.display(),
                    dir.parent().unwrap_or(dir).display()
                ),
                None => "no checkpoint was written before it (`--checkpoint-dir DIR \
                         --checkpoint-every N` keeps one every N steps)"
                    .to_string(),
            };
            EngineError::Tier(format!(
                "{m}; step {step} did not finish and the run stopped; {kept}"
            ))
        }
        other => other,
    }
}

/// The training loop of [`train`] over any [`StepExecutor`] (the plan is the executor's).
///
/// # Errors
/// As [`train`].
pub fn train_with<E: StepExecutor>(
    engine: &mut E,
    opts: &TrainOptions,
) -> Result<TrainSummary, EngineError> {
    let started = opts.started.unwrap_or_else(Instant::now);
    let plan = &engine.plan().clone();
    let steps = opts.steps.unwrap_or(plan.train.steps);
    if !schedule::limits::STEPS.contains_u64(steps) {
        return Err(EngineError::Option(format!(
            "steps = {steps} is outside the allowed range {}",
            schedule::limits::STEPS
        )));
    }
    let sampler_start = Instant::now();
    let mut sampler = load_data(plan, opts)?;
    tracing::info!(
        train_tokens = sampler.dataset().train().len(),
        val_tokens = sampler.dataset().val().len(),
        elapsed_ms = sampler_start.elapsed().as_millis() as u64,
        "data ready"
    );
    tracing::info!(backend = %engine.describe(), steps, "training");
    // A resumed run appends to its metrics file (the earlier run's records stay; a resume
    // refused below writes nothing to it).
    let resumed_ckpt = match &opts.resume {
        Some(dir) => Some(crate::checkpoint::load(dir)?),
        None => None,
    };
    // The metrics' `wall_s`: seconds of the run, continuing a resumed checkpoint's.
    let wall_base = resumed_ckpt
        .as_ref()
        .and_then(|c| c.meta.wall_s)
        .unwrap_or(0.0);
    // A bad --checkpoint-dir stops the run now, not after the steps before its first save.
    if let Some(root) = &opts.checkpoint_dir {
        crate::checkpoint::prepare_root(root)?;
    }
    let mut metrics = Metrics::open(opts.metrics_path.as_deref(), resumed_ckpt.is_some())?;
    let (b, t) = (plan.data.batch_size, plan.data.seq_len);
    let micro_batches = plan.train.grad_accum.max(1);
    let tokens_per_step = (b * t) as f64 * micro_batches as f64;
    let (mut x, mut y) = (vec![0i32; b * t], vec![0i32; b * t]);
    let evals = plan.train.eval_interval > 0 && plan.train.eval_batches > 0;
    let peak = peak_lr(plan);
    let mut summary = TrainSummary {
        train_tokens: sampler.dataset().train().len(),
        val_tokens: sampler.dataset().val().len(),
        ..TrainSummary::default()
    };
    // Training-step joules so far (evaluations excluded), when the engine measures energy.
    let mut train_j: Option<f64> = None;
    let mut eval = |engine: &mut E,
                    sampler: &BatchSampler,
                    step: u64,
                    summary: &mut TrainSummary,
                    metrics: &mut Metrics,
                    train_j: Option<f64>| {
        let v = tracing::info_span!("evaluate")
            .in_scope(|| evaluate(engine, sampler, &mut x, &mut y))?;
        tracing::info!(step, val_loss = v, "validation");
        summary.val_losses.push((step, v));
        metrics.write(serde_json::json!({
            "step": step,
            "val_loss": v,
            "wall_s": wall_base + started.elapsed().as_secs_f64(),
            "energy_j": train_j,
        }))
    };
    // Resume: the checkpoint's state, and the sampler replayed to its data position.
    let mut first = 1u64;
    let (mut bx, mut by) = (vec![0i32; b * t], vec![0i32; b * t]);
    if let Some(ckpt) = &resumed_ckpt {
        if ckpt.meta.step >= steps {
            return Err(EngineError::Checkpoint(format!(
                "{} is at step {}, and this run ends at step {steps}: raise --steps",
                ckpt.dir.display(),
                ckpt.meta.step
            )));
        }
        if ckpt.meta.seed != plan.train.seed {
            return Err(EngineError::Checkpoint(format!(
                "{} was written with seed {}, the plan's is {}: the data order would differ",
                ckpt.dir.display(),
                ckpt.meta.seed,
                plan.train.seed
            )));
        }
        if let Some((cb, ct)) = ckpt.meta.batch_shape.filter(|&s| s != (b, t)) {
            return Err(EngineError::Checkpoint(format!(
                "{} was written by a run drawing batches of {cb} x {ct} tokens, this plan draws \
                 {b} x {t}: its data position would not be the same; resume with the \
                 checkpoint's batch_size and seq_len",
                ckpt.dir.display()
            )));
        }
        crate::checkpoint::restore(engine, ckpt)?;
        for _ in 0..ckpt.meta.batches {
            sampler.next_train_batch(b, t, &mut bx, &mut by)?;
        }
        first = ckpt.meta.step + 1;
        tracing::info!(dir = %ckpt.dir.display(), step = ckpt.meta.step, "resumed");
    }
    if evals && first == 1 {
        eval(engine, &sampler, 0, &mut summary, &mut metrics, None)?;
    }
    let pb = progress_bar(steps, opts.quiet);
    // What a run says on stderr besides the bar: a line at start, one per evaluation, and
    // (when stderr is not a terminal: a log file, CI, a job scheduler) a status line at least
    // once a minute. In a terminal the lines print above the bar.
    let tty = std::io::stderr().is_terminal();
    let say = |pb: &ProgressBar, line: String| {
        if opts.quiet {
        } else if tty {
            pb.println(line);
        } else {
            // A closed stderr (its reader exited) is not an error of the run.
            let _ = writeln!(std::io::stderr(), "{line}");
        }
    };
    say(
        &pb,
        format!(
            "training steps {first}..={steps} on {}: {}{b} x {t} = {} tokens/step; corpus {} train / {} val tokens",
            engine.describe(),
            if micro_batches > 1 {
                format!("{micro_batches} micro-batches of ")
            } else {
                String::new()
            },
            micro_batches as usize * b * t,
            summary.train_tokens,
            summary.val_tokens
        ),
    );
    if let Some(ckpt) = &resumed_ckpt {
        say(
            &pb,
            format!(
                "resumed from {} (after step {}, {} batches drawn)",
                ckpt.dir.display(),
                ckpt.meta.step,
                ckpt.meta.batches
            ),
        );
        if let Some(root) = opts.resume.as_deref().filter(|r| *r != ckpt.dir.as_path()) {
            for skipped in crate::checkpoint::incomplete_newer(root, ckpt.meta.step) {
                tracing::warn!(
                    "{} is newer but not a complete checkpoint (no meta.json): skipped",
                    skipped.display()
                );
            }
        }
    }
    if let Some(src) = engine.energy_source() {
        say(
            &pb,
            format!("energy: {src} (joules per step in the metrics)"),
        );
    }
    if let Some(&(_, v)) = summary.val_losses.last() {
        say(&pb, format!("step 0/{steps} | val loss {v:.4}"));
    }
    let mut last_line = Instant::now();
    // Grows with the run (a billion-step run must not reserve 8 GB up front).
    let reserve = usize::try_from(steps).map_or(1 << 16, |s| s.min(1 << 16));
    let mut step_ms = Vec::with_capacity(reserve);
    let mut optimizer_ms = Vec::with_capacity(reserve);
    let (base_step, base_batches) = resumed_ckpt
        .as_ref()
        .map_or((0, 0), |c| (c.meta.step, c.meta.batches));
    let checkpoint = |engine: &mut E, step: u64| -> Result<Option<PathBuf>, EngineError> {
        match &opts.checkpoint_dir {
            Some(root) => crate::checkpoint::save(
                engine,
                root,
                step,
                // The data position: a resumed run continues from its checkpoint's (written
                // with the same or another `grad_accum`).
                base_batches + (step - base_step) * micro_batches,
                plan.train.seed,
                opts.checkpoint_keep,
                wall_base + started.elapsed().as_secs_f64(),
            )
            .map(Some),
            None => Ok(None),
        }
    };
    // The newest checkpoint of this run (or the one it resumed from): a step that fails on an
    // offload tier names it, so that nothing trained before it is lost.
    let mut last_saved: Option<(u64, PathBuf)> =
        resumed_ckpt.as_ref().map(|c| (c.meta.step, c.dir.clone()));
    // The current run of consecutive skipped steps, and the last finite training loss.
    let mut skipped_run = 0u64;
    let mut last_finite_loss: Option<(u64, f64)> = None;
    pb.set_position(first - 1);
    for step in first..=steps {
        // Spans of the run's trace (`asteria train --trace`): a step and its phases.
        let _step_span = tracing::info_span!("step", step).entered();
        let start = Instant::now();
        let joules_before = engine.energy_j();
        // The step's micro-batches: consecutive batches, their gradients accumulated by the
        // backward program, the loss their mean.
        let mut loss_sum = 0.0;
        for micro in 0..micro_batches {
            sampler.next_train_batch(b, t, &mut bx, &mut by)?;
            let stopped = |e| stopped_at(e, step, last_saved.as_ref());
            engine.load_batch(&bx, &by).map_err(stopped)?;
            loss_sum += tracing::info_span!("forward", micro)
                .in_scope(|| engine.forward())
                .map_err(stopped)?;
            tracing::info_span!("backward", micro)
                .in_scope(|| engine.backward(micro))
                .map_err(stopped)?;
        }
        let stopped = |e| stopped_at(e, step, last_saved.as_ref());
        let loss = loss_sum / micro_batches as f64;
        let mult = plan.train.lr_multiplier(step);
        let opt_start = Instant::now();
        let stepped = tracing::info_span!("optimizer")
            .in_scope(|| engine.optimizer_step(step, mult))
            .map_err(stopped)?;
        let host = tracing::info_span!("host tasks")
            .in_scope(|| engine.run_host_tasks(step))
            .map_err(stopped)?;
        let opt_ms = opt_start.elapsed().as_secs_f64() * 1e3;
        tracing::info_span!("synchronize")
            .in_scope(|| engine.synchronize())
            .map_err(stopped)?;
        let ms = start.elapsed().as_secs_f64() * 1e3;
        let step_j = match (joules_before, engine.energy_j()) {
            (Some(a), Some(b)) => Some((b - a).max(0.0)),
            _ => None,
        };
        if let Some(j) = step_j {
            train_j = Some(train_j.unwrap_or(0.0) + j);
        }
        step_ms.push(ms);
        optimizer_ms.push(opt_ms);
        summary.train_losses.push(loss);
        let tps = tokens_per_step / (ms / 1e3);
        let grad_norm = engine.stats().last_grad_norm.filter(|_| {
            plan.optimizer
                .iter()
                .any(|o| matches!(o, Op::ClipGradNorm { .. }))
        });
        let written = metrics.write(serde_json::json!({
            "step": step,
            "loss": loss,
            "lr": peak.map_or(mult, |p| p * mult),
            "grad_norm": grad_norm.filter(|g| g.is_finite()),
            "step_ms": ms,
            "tokens_per_s": tps,
            "optimizer_ms": opt_ms,
            "refresh_wait_ms": host.wait_ms,
            "refreshes_launched": host.launched,
            "refreshes_swapped": host.swapped,
            "max_swap_staleness": host.max_swap_staleness,
            "wall_s": wall_base + started.elapsed().as_secs_f64(),
            "step_j": step_j,
            "energy_j": train_j,
        }));
        if step == first {
            // Time to first step: process start (or the caller's) to the end of this step:
            // compilation, engine set-up (allocation, initialisation, kernel compilation),
            // data loading, the first evaluation and the step itself.
            let wall = started.elapsed().as_secs_f64();
            tracing::info!(wall_s = wall, "first step done");
            summary.first_step_s = wall;
            say(
                &pb,
                format!("first step done {wall:.1} s after start ({ms:.0} ms)"),
            );
        }
        if let Err(e) = written {
            // Lose nothing: the state after this step is saved before the run stops.
            pb.finish_and_clear();
            if let Some(dir) = checkpoint(engine, step)? {
                tracing::error!(checkpoint = %dir.display(), "metrics write failed; checkpoint saved");
            }
            return Err(e);
        }
        tracing::debug!(step, loss, step_ms = ms, "step");
        if loss.is_finite() {
            last_finite_loss = Some((step, loss));
        }
        skipped_run = if stepped { 0 } else { skipped_run + 1 };
        if let Some(limit) = plan.train.max_skipped_steps {
            if skipped_run >= limit {
                pb.finish_and_clear();
                return Err(EngineError::Diverged {
                    step,
                    skipped: skipped_run,
                    limit,
                    last_finite_loss,
                });
            }
        }
        pb.set_position(step);
        pb.set_message(format!("loss {loss:.4} | {tps:.0} tok/s"));
        if evals && (step % plan.train.eval_interval == 0 || step == steps) {
            eval(engine, &sampler, step, &mut summary, &mut metrics, train_j)
                .map_err(|e| stopped_at(e, step, last_saved.as_ref()))?;
            let v = summary.val_losses.last().map_or(f64::NAN, |x| x.1);
            say(
                &pb,
                format!(
                    "step {step}/{steps} | train loss {loss:.4} | val loss {v:.4} | {tps:.0} tok/s"
                ),
            );
            last_line = Instant::now();
        } else if !tty && last_line.elapsed().as_secs() >= 60 {
            say(
                &pb,
                format!("step {step}/{steps} | train loss {loss:.4} | {tps:.0} tok/s"),
            );
            last_line = Instant::now();
        }
        let interrupted = opts
            .interrupt
            .as_ref()
            .is_some_and(|f| f.load(std::sync::atomic::Ordering::SeqCst));
        let due = opts
            .checkpoint_every
            .is_some_and(|n| n > 0 && step % n == 0);
        if interrupted {
            pb.finish_and_clear();
            let saved = checkpoint(engine, step)?;
            return Err(EngineError::Interrupted(match saved {
                Some(dir) => format!(
                    "stopped after step {step}; checkpoint {} (resume with --resume {})",
                    dir.display(),
                    dir.parent().unwrap_or(&dir).display()
                ),
                None => format!("stopped after step {step}; no --checkpoint-dir, nothing saved"),
            }));
        }
        if due && step != steps {
            if let Some(dir) = checkpoint(engine, step)? {
                say(&pb, format!("checkpoint {}", dir.display()));
                last_saved = Some((step, dir));
            }
        }
    }
    engine
        .finish()
        .map_err(|e| stopped_at(e, steps, last_saved.as_ref()))?;
    if let Some(dir) = checkpoint(engine, steps)? {
        say(&pb, format!("checkpoint {}", dir.display()));
    }
    pb.finish_and_clear();
    summary.steps = steps;
    let total_s: f64 = step_ms.iter().sum::<f64>() / 1e3;
    // The steps this process ran (a resumed run starts after its checkpoint's step).
    summary.tokens_per_s = if total_s > 0.0 {
        tokens_per_step * step_ms.len() as f64 / total_s
    } else {
        0.0
    };
    step_ms.sort_by(|a, b| a.total_cmp(b));
    summary.median_step_ms = step_ms.get(step_ms.len() / 2).copied().unwrap_or(0.0);
    optimizer_ms.sort_by(|a, b| a.total_cmp(b));
    summary.max_optimizer_ms = optimizer_ms.last().copied().unwrap_or(0.0);
    summary.median_optimizer_ms = optimizer_ms
        .get(optimizer_ms.len() / 2)
        .copied()
        .unwrap_or(0.0);
    let stats = engine.stats();
    summary.refresh_failures = stats.total_refresh_failures();
    summary.refresh_swaps = stats.refresh_swaps;
    summary.mean_swap_staleness = stats.mean_swap_staleness();
    summary.max_swap_staleness = stats.max_swap_staleness;
    summary.refresh_waits = stats.refresh_waits;
    summary.refresh_wait_ms = stats.refresh_wait_ms;
    summary.skipped_steps = engine.stats().skipped_steps;
    summary.zero_factor_refreshes = engine.stats().zero_factor_refreshes;
    summary.energy_j = train_j;
    let run_tokens = tokens_per_step * (steps + 1 - first) as f64;
    summary.joules_per_token = train_j.filter(|_| run_tokens > 0.0).map(|j| j / run_tokens);
    tracing::info!(%summary, "training done");
    if !opts.quiet {
        // A closed stderr (its reader exited) is not an error of the run.
        let _ = writeln!(std::io::stderr(), "{summary}");
    }
    let clipped = plan
        .optimizer
        .iter()
        .any(|o| matches!(o, Op::ClipGradNorm { .. }));
    if let Some(why) = summary.divergence(clipped) {
        // A plain line like the summary's (also under `--quiet`: it is a warning).
        tracing::debug!("{why}");
        let _ = writeln!(std::io::stderr(), "warning: {why}");
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::TrainSummary;

    fn run(losses: &[f64]) -> Option<String> {
        TrainSummary {
            train_losses: losses.to_vec(),
            ..Default::default()
        }
        .divergence(true)
    }

    #[test]
    fn a_loss_that_ends_above_its_start_or_not_finite_is_reported() {
        let falling: Vec<f64> = (0..20).map(|i| 10.8 - 0.2 * f64::from(i)).collect();
        assert_eq!(run(&falling), None);
        // lr 10 on tiny: 10.8 at step 1, then over a thousand.
        let mut rising = falling.clone();
        rising.extend([40.0, 300.0, 1313.0]);
        let why = run(&rising).expect("diverging");
        assert!(
            why.contains("rose from 10.8000")
                && why.contains("to 806.5000 (the mean of the last 2 steps)"),
            "{why}"
        );
        assert!(why.contains("a smaller `train.grad_clip`"), "{why}");
        let unclipped = TrainSummary {
            train_losses: rising.clone(),
            ..Default::default()
        }
        .divergence(false)
        .expect("diverging");
        assert!(unclipped.contains("or a `train.grad_clip`"), "{unclipped}");
        let mut nan = falling.clone();
        nan.push(f64::NAN);
        assert!(run(&nan).expect("NaN").contains("NaN at the last step"));
        // Too short to judge a rise, but a NaN is a NaN.
        assert_eq!(run(&[5.0, 6.0, 7.0]), None);
        assert!(run(&[5.0, f64::INFINITY]).is_some());
        assert_eq!(run(&[]), None);
    }
}
