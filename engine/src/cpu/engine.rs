//! [`CpuEngine`]: allocates a verified plan's buffers and runs its programs on the CPU.
use super::exec::{exec_op, OpOutcome};
use super::host::Runtime;
use super::store::{Data, Loc, Store};
use super::Float;
use crate::EngineError;
use optim::{HostEigensolver, Real};
use schedule::{BufferId, HostTask, Init, LiveRange, Op, Placement, Plan, TargetPlan};
use std::collections::HashMap;
use std::sync::Arc;

/// Construction options of a [`CpuEngine`].
#[derive(Clone)]
pub struct EngineOptions {
    /// Seed for parameter initialisation; `None` = `plan.train.seed`.
    pub seed: Option<u64>,
    /// Kernel worker threads; `None` = the plan target's `threads` (`None` there = all cores).
    pub threads: Option<usize>,
    /// An eigensolver to use for [`schedule::HostTask::EigenbasisRefresh`] instead of the
    /// plan's `eigensolver` option (tests inject failing solvers); `None` (the default) = the
    /// plan's ([`EngineOptions::solver`]).
    pub eigensolver: Option<Arc<dyn HostEigensolver>>,
    /// Consecutive failed refreshes of one host task after which the run stops with
    /// [`EngineError::RefreshFailures`] (default 3).
    pub max_consecutive_refresh_failures: u32,
    /// Run every refresh as one synchronous `optim::eigenbasis_refresh` call at the end of its
    /// step, ignoring the plan's `staleness` (the reference path; default false).
    pub synchronous_refresh: bool,
    /// Memory-plan check (tests, CI; default false): the buffers of the plan's shared
    /// `activations` arena are overwritten with NaN (float) or `i32::MIN` (i32) at construction,
    /// after the last op of their live range, and after every op that writes another buffer
    /// the memory plan puts on some of their bytes — garbage where an engine that really shares
    /// the bytes (the CUDA engine) could leave some. If the live ranges or the placement were
    /// wrong, the poison would reach the loss and the parameters; with a right plan, results
    /// are bit-identical to a normal run (`tests/memory_plan.rs`).
    pub poison_transients: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            seed: None,
            threads: None,
            eigensolver: None,
            max_consecutive_refresh_failures: 3,
            synchronous_refresh: false,
            poison_transients: false,
        }
    }
}

impl EngineOptions {
    /// The host eigensolver a run of `plan` uses: the injected one, else the plan's
    /// `eigensolver` option.
    ///
    /// # Errors
    /// [`EngineError::Option`] when the plan names a solver this build lacks (`lapack` without
    /// the `lapack` feature).
    pub fn solver(&self, plan: &Plan) -> Result<Arc<dyn HostEigensolver>, EngineError> {
        match &self.eigensolver {
            Some(s) => Ok(Arc::clone(s)),
            None => optim::solver_by_name(plan.target.eigensolver().name())
                .map(Arc::from)
                .map_err(|e| EngineError::Option(format!("eigensolver: {e}"))),
        }
    }
}

impl std::fmt::Debug for EngineOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineOptions")
            .field("seed", &self.seed)
            .field("threads", &self.threads)
            .field("eigensolver", &self.eigensolver.as_ref().map(|s| s.name()))
            .field(
                "max_consecutive_refresh_failures",
                &self.max_consecutive_refresh_failures,
            )
            .field("synchronous_refresh", &self.synchronous_refresh)
            .field("poison_transients", &self.poison_transients)
            .finish()
    }
}

/// Counters an engine keeps across steps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    /// Optimizer steps whose program was cut short by a non-finite gradient norm.
    pub skipped_steps: u64,
    /// Global gradient norm of the last optimizer step that ran a `ClipGradNorm` (before
    /// clipping).
    pub last_grad_norm: Option<f64>,
    /// Successful eigenbasis refreshes, all tasks.
    pub refreshes: u64,
    /// Refreshes skipped because their factor was exactly zero (the parameter's gradients
    /// vanished); the previous basis was kept. Not failures.
    pub zero_factor_refreshes: u64,
    /// Failed refreshes, per host task (index of `plan.host_tasks`), all time.
    pub refresh_failures: Vec<u64>,
    /// Current run of consecutive failures, per host task.
    pub consecutive_refresh_failures: Vec<u32>,
    /// Wall time spent in host tasks on the critical path (inline refreshes, swaps, waits), ms.
    pub host_task_ms: f64,
    /// Refresh computations started, inline (S = 0, t = 1) or in the background.
    pub refreshes_launched: u64,
    /// Refresh results swapped in (installed), inline ones included.
    pub refresh_swaps: u64,
    /// Sum over swaps of the swap staleness (steps between launch and swap).
    pub swap_staleness_sum: u64,
    /// Largest swap staleness so far, steps.
    pub max_swap_staleness: u64,
    /// Times a step boundary blocked on a background refresh (its staleness bound was reached
    /// before it finished, or the task's next refresh was due).
    pub refresh_waits: u64,
    /// Time blocked on background refreshes, ms.
    pub refresh_wait_ms: f64,
}

impl EngineStats {
    /// Failed refreshes summed over all host tasks.
    pub fn total_refresh_failures(&self) -> u64 {
        self.refresh_failures.iter().sum()
    }

    /// Mean swap staleness over all swaps, steps (0 when none).
    pub fn mean_swap_staleness(&self) -> f64 {
        if self.refresh_swaps == 0 {
            0.0
        } else {
            self.swap_staleness_sum as f64 / self.refresh_swaps as f64
        }
    }
}

/// The CPU interpreter of a [`Plan`], generic over the element type (`f32` to train, `f64`
/// for gradient checks). Every float buffer of the plan is held as a `Vec<T>`, i32 buffers as
/// `Vec<i32>`.
///
/// A step is [`load_batch`](Self::load_batch), [`forward`](Self::forward),
/// [`backward`](Self::backward), [`optimizer_step`](Self::optimizer_step),
/// [`run_host_tasks`](Self::run_host_tasks). Kernels run on the engine's own rayon pool;
/// eigenbasis refreshes with staleness S > 0 run on a second (host) pool in the background and
/// are swapped in at the start of a later `run_host_tasks` ([`crate::refresh_runtime`]).
pub struct CpuEngine<T> {
    pub(crate) plan: Plan,
    pub(crate) store: Store<T>,
    /// The host eigensolver ([`EngineOptions::solver`]).
    pub(crate) solver: Arc<dyn HostEigensolver>,
    pub(crate) stats: EngineStats,
    pub(crate) pool: Arc<rayon::ThreadPool>,
    pub(crate) host_pool: Arc<rayon::ThreadPool>,
    /// The refresh runtime: refreshes in flight, first bases, failure limit.
    pub(crate) refresh: Runtime<T>,
    by_name: HashMap<String, BufferId>,
    /// With [`EngineOptions::poison_transients`]: what to poison after each op.
    poison: Option<Poison>,
    /// The offloaded buffers (host and NVMe tiers) and their copies.
    pub(crate) tiers: super::tiers::Tiers<T>,
    /// The Cranelift-compiled AdamW updates of an f32 engine, one per distinct set of the
    /// plan's constants (bit-identical to `optim::adamw_update`, which an f64 engine runs).
    adamw_kernels: HashMap<[u64; 4], Arc<hostkernels::AdamWKernel>>,
    /// The Cranelift kernels of the plan's element-wise update rules (f32 engines), by rule
    /// text; bit-identical to the rule interpreter, which an f64 engine runs.
    rule_kernels: HashMap<String, Arc<hostkernels::RuleKernel>>,
    /// The staging buffers of offloaded state (`CopyIn` destinations that are not device
    /// copies), allocated by their copy in and freed after their last use, by the step
    /// position of that use ([`staging_lifetimes`]): moving state off the working store then
    /// saves its bytes on this engine too.
    staging_free: Vec<Vec<BufferId>>,
    /// Step positions of the first op of the forward, backward and optimizer programs.
    bases: [usize; 3],
}

/// The host AdamW kernels of `ops`' `adam_w` ops, one per set of constants, by
/// `schedule::adamw_kernel_key` (the CPU engine's and the CUDA engine's host updates).
///
/// # Errors
/// A kernel that does not compile.
pub fn adamw_kernels<'a>(
    ops: impl Iterator<Item = &'a Op>,
) -> Result<HashMap<[u64; 4], Arc<hostkernels::AdamWKernel>>, String> {
    let mut kernels = HashMap::new();
    for op in ops {
        if let Op::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
            ..
        } = *op
        {
            let key = schedule::adamw_kernel_key(beta1, beta2, eps, weight_decay);
            if kernels.contains_key(&key) {
                continue;
            }
            let c = hostkernels::AdamWConstants {
                beta1,
                beta2,
                eps,
                weight_decay,
            };
            let k = hostkernels::AdamWKernel::compile(&c)
                .map_err(|e| format!("compiling the host AdamW kernel: {e}"))?;
            kernels.insert(key, Arc::new(k));
        }
    }
    Ok(kernels)
}

/// Per step position, the staging buffers of `plan` whose last use is there (see
/// `CpuEngine::staging_free`).
fn staging_lifetimes(plan: &Plan) -> Vec<Vec<BufferId>> {
    let mut last: HashMap<BufferId, usize> = HashMap::new();
    let staging: std::collections::HashSet<BufferId> = plan
        .step_ops()
        .filter_map(|(_, op)| match *op {
            Op::CopyIn { src, dst, .. } if plan.buffer(dst).init != Init::CopyOf { of: src } => {
                Some(dst)
            }
            _ => None,
        })
        .collect();
    for (pos, op) in plan.step_ops() {
        for (_, id) in op.operands() {
            if staging.contains(&id) {
                last.insert(id, pos);
            }
        }
    }
    let mut free = vec![Vec::new(); plan.step_len()];
    for (id, pos) in last {
        free[pos].push(id);
    }
    free
}

/// The poisoning schedule of [`EngineOptions::poison_transients`].
struct Poison {
    /// Step positions of the first op of the forward, backward and optimizer programs.
    bases: [usize; 3],
    /// Per step position: the shared-arena buffers to overwrite after that op (those whose
    /// live range ends there, and those sharing bytes with a buffer it writes).
    after: Vec<Vec<BufferId>>,
    /// Every buffer of the shared arena (poisoned at construction).
    all: Vec<BufferId>,
}

impl Poison {
    fn new(plan: &Plan) -> Poison {
        let residency = plan.residency();
        // Shared-arena buffers with their byte range and live range. `verify` guarantees that
        // every buffer of the shared arena is transient.
        let mut shared: Vec<(usize, usize, BufferId, LiveRange)> = plan
            .buffers
            .iter()
            .zip(&residency)
            .enumerate()
            .filter_map(|(i, (b, r))| {
                let id = BufferId(i as u32);
                let live = r.live_range().filter(|_| plan.memory.is_shared(id))?;
                let offset = plan.memory.slot(id)?.offset;
                Some((offset, offset + b.size_bytes(), id, live))
            })
            .collect();
        shared.sort_unstable_by_key(|s| (s.0, s.2));
        let mut overlapping: HashMap<BufferId, Vec<BufferId>> = HashMap::new();
        for (k, &(_, end, a, _)) in shared.iter().enumerate() {
            for &(_, _, b, _) in shared[k + 1..].iter().take_while(|s| s.0 < end) {
                overlapping.entry(a).or_default().push(b);
                overlapping.entry(b).or_default().push(a);
            }
        }
        let mut after = vec![Vec::new(); plan.step_len()];
        for &(_, _, id, live) in &shared {
            after[live.last].push(id);
        }
        for (pos, op) in plan.step_ops() {
            for (_, id, access) in op.accesses() {
                if access.writes() {
                    if let Some(others) = overlapping.get(&id) {
                        after[pos].extend(others);
                    }
                }
            }
        }
        for list in &mut after {
            list.sort_unstable();
            list.dedup();
        }
        let (f, b) = (plan.forward.len(), plan.backward.len());
        Poison {
            bases: [0, f, f + b],
            after,
            all: shared.iter().map(|s| s.2).collect(),
        }
    }

    fn base(&self, section: &str) -> usize {
        match section {
            "forward" => self.bases[0],
            "backward" => self.bases[1],
            _ => self.bases[2],
        }
    }
}

fn build_pool(threads: usize, tag: &'static str) -> Result<rayon::ThreadPool, EngineError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(move |i| format!("asteria-{tag}-{i}"))
        .build()
        .map_err(|e| EngineError::Unsupported(format!("cannot start {threads} {tag} threads: {e}")))
}

/// Where [`CpuEngine::buffer`] / [`CpuEngine::set_buffer`] reach an offloaded buffer, for
/// error messages.
const ACCESS: Loc = Loc {
    section: "buffer access",
    index: 0,
    op: "read/write",
};

impl<T: Float + Real> CpuEngine<T> {
    /// Verifies `plan`, allocates every buffer and initialises it from its [`Init`] (normal
    /// draws from one generator seeded by `opts.seed` or `plan.train.seed`, in buffer order:
    /// the same seed gives the same weights).
    ///
    /// # Errors
    /// [`EngineError::Plan`] when verification fails; [`EngineError::Option`] for a zero
    /// thread count or failure limit, or more than `schedule::limits::MAX_THREADS_PER_CORE`
    /// threads per core of this machine; [`EngineError::OutOfMemory`] when the buffers need more
    /// than the host's available memory (checked before anything is allocated).
    pub fn new(plan: Plan, opts: EngineOptions) -> Result<Self, EngineError> {
        plan.verify()?;
        if opts.max_consecutive_refresh_failures == 0 {
            return Err(EngineError::Option(
                "max_consecutive_refresh_failures must be at least 1".into(),
            ));
        }
        let target_threads = match plan.target {
            TargetPlan::Cpu { threads, .. } => threads,
            TargetPlan::Cuda { .. } => None,
        };
        let threads = opts.threads.or(target_threads).unwrap_or(0);
        if opts.threads == Some(0) {
            return Err(EngineError::Option("threads must be at least 1".into()));
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let most = schedule::limits::MAX_THREADS_PER_CORE * cores;
        if threads > most {
            return Err(EngineError::Option(format!(
                "plan `{}` asks for {threads} threads; this machine has {cores} cores and more \
                 than {most} threads ({} per core) only slow each step down; set `threads` \
                 in the spec's `target cpu` block to at most {most}, or leave it out (all cores)",
                plan.name,
                schedule::limits::MAX_THREADS_PER_CORE
            )));
        }
        if let Some(available) = crate::fits::host_available_bytes() {
            let needed = crate::fits::host_bytes(&plan, std::mem::size_of::<T>());
            crate::fits::check_fits(&plan, "host memory", needed, available)?;
        }
        let solver = opts.solver(&plan)?;
        let pool = Arc::new(build_pool(threads, "kernel")?);
        let host_pool = Arc::new(build_pool(threads, "host")?);
        let mut store = Store::zeros(&plan);
        // Normal draws: `crate::normal_fill` per buffer (stream = buffer index), in parallel on
        // the kernel pool; the CUDA engine uploads the same values.
        let seed = opts.seed.unwrap_or(plan.train.seed);
        pool.install(|| {
            for (i, data) in store.data.iter_mut().enumerate() {
                // `Plan::initial` resolves a `CopyOf` (verified) to its source's init and stream.
                let (init, stream) = plan.initial(i).unwrap_or((Init::Zeros, i as u64));
                match (init, data) {
                    (Init::Zeros | Init::CopyOf { .. }, _) => {}
                    (Init::Ones, Data::F(v)) => v.iter_mut().for_each(|x| *x = T::one()),
                    (Init::Ones, Data::I(v)) => v.iter_mut().for_each(|x| *x = 1),
                    (Init::Normal { std }, Data::F(v)) => {
                        crate::normal_fill(seed, stream, v, |z| <T as Float>::from_f64(std * z))
                    }
                    (Init::Normal { std }, Data::I(v)) => {
                        crate::normal_fill(seed, stream, v, |z| (std * z).round() as i32)
                    }
                }
            }
        });
        let tasks = plan.host_tasks.len();
        let gpu_side = plan
            .host_tasks
            .iter()
            .filter(|t| {
                matches!(
                    t,
                    HostTask::EigenbasisRefresh {
                        placement: Placement::GpuSide,
                        ..
                    }
                )
            })
            .count();
        if gpu_side > 0 {
            tracing::info!(
                tasks = gpu_side,
                "the CPU engine has no GPU side stream: refreshes placed on `gpu_side` run on the host pool"
            );
        }
        let by_name = plan
            .buffers
            .iter()
            .enumerate()
            .map(|(i, b)| (b.name.clone(), BufferId(i as u32)))
            .collect();
        let poison = opts.poison_transients.then(|| Poison::new(&plan));
        if let Some(p) = &poison {
            for &id in &p.all {
                store.poison(id);
            }
        }
        let tiers = super::tiers::Tiers::new(&plan, |i, v: &mut [T]| {
            match plan.initial(i).unwrap_or((Init::Zeros, i as u64)) {
                (Init::Zeros | Init::CopyOf { .. }, _) => {}
                (Init::Ones, _) => v.iter_mut().for_each(|x| *x = T::one()),
                (Init::Normal { std }, stream) => {
                    crate::normal_fill(seed, stream, v, |z| <T as Float>::from_f64(std * z))
                }
            }
        })?;
        // Element-wise update rules are checked here, before anything runs, and compiled for
        // the host when the engine is f32.
        let mut rule_kernels = HashMap::new();
        for (index, op) in plan.optimizer.iter().enumerate() {
            if let Op::ElementwiseUpdate { rule, .. } = op {
                let refused = |e: &dyn std::fmt::Display| {
                    EngineError::Plan(schedule::PlanError::Invalid(format!(
                        "optimizer[{index}] (elementwise_update): the `{}` update rule: {e}",
                        rule.optimizer
                    )))
                };
                super::exec::rule_program(rule).map_err(|e| refused(&e))?;
                let key = rule.kernel_key();
                if T::BYTES == 4 && !rule_kernels.contains_key(&key) {
                    let r = optim::optimizers::update_rule(rule).map_err(|e| refused(&e))?;
                    let k = hostkernels::RuleKernel::compile(&r).map_err(|e| refused(&e))?;
                    rule_kernels.insert(key, Arc::new(k));
                }
            }
        }
        let adamw_kernels = if T::BYTES == 4 {
            adamw_kernels(plan.optimizer.iter()).map_err(EngineError::Unsupported)?
        } else {
            HashMap::new()
        };
        let refresh = Runtime::new(&plan, &opts);
        let staging_free = staging_lifetimes(&plan);
        for &id in staging_free.iter().flatten() {
            if let Some(Data::F(v)) = store.data.get_mut(id.index()) {
                *v = Vec::new();
            }
        }
        let bases = [
            0,
            plan.forward.len(),
            plan.forward.len() + plan.backward.len(),
        ];
        Ok(CpuEngine {
            plan,
            store,
            solver,
            stats: EngineStats {
                refresh_failures: vec![0; tasks],
                consecutive_refresh_failures: vec![0; tasks],
                ..EngineStats::default()
            },
            pool,
            host_pool,
            refresh,
            by_name,
            poison,
            tiers,
            adamw_kernels,
            rule_kernels,
            staging_free,
            bases,
        })
    }

    /// The plan this engine runs.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Counters (skipped steps, refresh failures, last gradient norm).
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Number of kernel worker threads.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// The id of the buffer called `name`.
    pub fn buffer_id(&self, name: &str) -> Result<BufferId, EngineError> {
        self.by_name
            .get(name)
            .copied()
            .ok_or_else(|| EngineError::UnknownBuffer(name.to_string()))
    }

    /// Copies the contents of buffer `name` out as f64 (i32 buffers are converted too; a buffer
    /// in the host or NVMe tier is read from there).
    ///
    /// # Errors
    /// [`EngineError::UnknownBuffer`]; [`EngineError::Tier`] when an NVMe read fails.
    pub fn buffer(&self, name: &str) -> Result<Vec<f64>, EngineError> {
        let id = self.buffer_id(name)?;
        if self.tiers.is_offloaded(id) {
            let len = self.plan.buffer(id).numel();
            let mut v = vec![T::zero(); len];
            self.tiers.read(id, &mut v, ACCESS)?;
            return Ok(v.iter().map(|&x| Float::to_f64(x)).collect());
        }
        if self.staging_free.iter().flatten().any(|&s| s == id)
            && matches!(&self.store.data[id.index()], Data::F(v) if v.is_empty())
        {
            return Err(EngineError::Tier(format!(
                "`{name}` is a staging copy of offloaded state: it holds bytes only between its \
                 copy in and its last use within a step; read its home instead"
            )));
        }
        Ok(match &self.store.data[id.index()] {
            Data::F(v) => v.iter().map(|&x| Float::to_f64(x)).collect(),
            Data::I(v) => v.iter().map(|&x| x as f64).collect(),
        })
    }

    /// Overwrites buffer `name` with `values` (rounded to `T`, to i32 for i32 buffers, and to
    /// bf16 for bf16 buffers; a buffer in the host or NVMe tier is written there).
    ///
    /// # Errors
    /// [`EngineError::UnknownBuffer`], or [`EngineError::Length`] when `values` does not have
    /// the buffer's element count.
    pub fn set_buffer(&mut self, name: &str, values: &[f64]) -> Result<(), EngineError> {
        let id = self.buffer_id(name)?;
        if self.tiers.is_offloaded(id) {
            let len = self.plan.buffer(id).numel();
            if values.len() != len {
                return Err(EngineError::Length {
                    buffer: name.to_string(),
                    expected: len,
                    got: values.len(),
                });
            }
            let v: Vec<T> = values.iter().map(|&y| <T as Float>::from_f64(y)).collect();
            return self.tiers.write(id, &v, ACCESS);
        }
        let len = match &self.store.data[id.index()] {
            Data::F(v) => v.len(),
            Data::I(v) => v.len(),
        };
        if values.len() != len {
            return Err(EngineError::Length {
                buffer: name.to_string(),
                expected: len,
                got: values.len(),
            });
        }
        let bf16 = self.store.bf16[id.index()];
        match &mut self.store.data[id.index()] {
            Data::F(v) => {
                v.iter_mut()
                    .zip(values)
                    .for_each(|(x, &y)| *x = <T as Float>::from_f64(y));
                if bf16 {
                    super::store::round_slice_to_bf16(v);
                }
            }
            Data::I(v) => v
                .iter_mut()
                .zip(values)
                .for_each(|(x, &y)| *x = y.round() as i32),
        }
        Ok(())
    }

    /// Every parameter as `(name, values as f64)`, in `plan.params` order.
    pub fn params(&self) -> Vec<(String, Vec<f64>)> {
        self.plan
            .params
            .iter()
            .filter_map(|p| {
                let name = self.store.names.get(p.param.index())?.clone();
                let values = self.buffer(&name).ok()?;
                Some((name, values))
            })
            .collect()
    }

    /// Copies one batch into the plan's input buffers: `tokens` and `targets` are i32
    /// `[batch_size · seq_len]` (row `n = b·seq_len + t`). Ids are range-checked by the kernels
    /// that read them.
    ///
    /// # Errors
    /// [`EngineError::Length`] when a slice has the wrong length.
    pub fn load_batch(&mut self, tokens: &[i32], targets: &[i32]) -> Result<(), EngineError> {
        for (id, values) in [
            (self.plan.data.tokens, tokens),
            (self.plan.data.targets, targets),
        ] {
            let name = self.store.names[id.index()].clone();
            match &mut self.store.data[id.index()] {
                Data::I(v) if v.len() == values.len() => v.copy_from_slice(values),
                Data::I(v) => {
                    return Err(EngineError::Length {
                        buffer: name,
                        expected: v.len(),
                        got: values.len(),
                    })
                }
                Data::F(_) => {
                    return Err(EngineError::DType {
                        buffer: name,
                        expected: "i32",
                        actual: "f32",
                    })
                }
            }
        }
        Ok(())
    }

    /// Runs `program` (a clone of one of the plan's programs) on the kernel pool.
    fn run(
        &mut self,
        section: &'static str,
        program: &[Op],
        t: u64,
        lr_multiplier: f64,
    ) -> Result<bool, EngineError> {
        let pool = Arc::clone(&self.pool);
        let store = &mut self.store;
        let stats = &mut self.stats;
        let poison = self.poison.as_ref();
        let tiers = &mut self.tiers;
        let kernels = &self.adamw_kernels;
        let rule_kernels = &self.rule_kernels;
        let staging_free = &self.staging_free;
        let base = match section {
            "forward" => self.bases[0],
            "backward" => self.bases[1],
            _ => self.bases[2],
        };
        pool.install(|| {
            for (index, op) in program.iter().enumerate() {
                let loc = Loc { section, index, op: op.name() };
                let _op_span = tracing::debug_span!("op", name = op.name(), section, index).entered();
                // A host-placed update (`host_updates`) works on its host-tier state where it
                // lives: paged into working storage around the op, as a refresh swap does.
                let paged = if op.on_host() {
                    let ids: Vec<BufferId> = op.operands().iter().map(|&(_, id)| id).collect();
                    tiers.page_in(store, &ids, loc)?
                } else {
                    Vec::new()
                };
                let outcome = match op {
                    Op::CopyIn { src, dst, last_step } => {
                        // (`last_step`: a copy of the warm-up steps only.)
                        if last_step.is_none_or(|l| t <= l) {
                            // A staging buffer gets its bytes here (freed after its last use).
                            let len: usize = store.shapes[dst.index()].iter().product();
                            if let Some(Data::F(v)) = store.data.get_mut(dst.index()) {
                                if v.len() != len {
                                    *v = vec![T::zero(); len];
                                }
                            }
                            tiers.copy_in(store, *src, *dst, loc)?;
                        }
                        OpOutcome::Done
                    }
                    Op::CopyOut { src, dst } => {
                        tiers.copy_out(store, *src, *dst, loc)?;
                        OpOutcome::Done
                    }
                    Op::AdamW {
                        param,
                        grad,
                        exp_avg,
                        exp_avg_sq,
                        grad_scale: None,
                        lr,
                        beta1,
                        beta2,
                        eps,
                        weight_decay,
                        ..
                    } if kernels.contains_key(&schedule::adamw_kernel_key(*beta1, *beta2, *eps, *weight_decay)) => {
                        let k = &kernels[&schedule::adamw_kernel_key(*beta1, *beta2, *eps, *weight_decay)];
                        let outs = [
                            ("param", *param),
                            ("exp_avg", *exp_avg),
                            ("exp_avg_sq", *exp_avg_sq),
                        ];
                        let lr = lr * lr_multiplier;
                        store.with_outs(loc, &outs, &[*grad], |s, o| {
                            let bad = || EngineError::Optim {
                                location: loc.to_string(),
                                message: "internal: the host AdamW kernel needs f32".into(),
                            };
                            let [p, m, v] = o else {
                                return Err(bad());
                            };
                            let g = T::as_f32(s.f(*grad)?).ok_or_else(bad)?;
                            let (p, m, v) = (
                                T::as_f32_mut(p).ok_or_else(bad)?,
                                T::as_f32_mut(m).ok_or_else(bad)?,
                                T::as_f32_mut(v).ok_or_else(bad)?,
                            );
                            k.update(t, lr, p, g, m, v).map_err(|e| EngineError::Optim {
                                location: loc.to_string(),
                                message: e.to_string(),
                            })
                        })?;
                        OpOutcome::Done
                    }
                    Op::ElementwiseUpdate {
                        param,
                        grad,
                        state,
                        results,
                        rule,
                    } if rule_kernels.contains_key(&rule.kernel_key()) => {
                        let k = &rule_kernels[&rule.kernel_key()];
                        let scalars: Vec<f32> =
                            optim::optimizers::step_scalars(rule, rule.lr * lr_multiplier, t);
                        let outs: Vec<(&'static str, BufferId)> = std::iter::once(("param", *param))
                            .chain(state.iter().map(|s| ("state", *s)))
                            .chain(results.iter().map(|r| ("result", *r)))
                            .collect();
                        store.with_outs(loc, &outs, &[*grad], |s, o| {
                            let bad = |m: String| EngineError::Optim {
                                location: loc.to_string(),
                                message: m,
                            };
                            let need_f32 = || bad("internal: the host rule kernel needs f32".into());
                            let g = T::as_f32(s.f(*grad)?).ok_or_else(need_f32)?;
                            let (p, rest) =
                                o.split_first_mut().ok_or_else(|| bad("no param".into()))?;
                            let mut tensors = vec![
                                hostkernels::Operand::Write(T::as_f32_mut(p).ok_or_else(need_f32)?),
                                hostkernels::Operand::Read(g),
                            ];
                            for v in rest.iter_mut() {
                                tensors.push(hostkernels::Operand::Write(
                                    T::as_f32_mut(v).ok_or_else(need_f32)?,
                                ));
                            }
                            k.run(&mut tensors, &scalars).map_err(|e| bad(e.to_string()))
                        })?;
                        OpOutcome::Done
                    }
                    _ => exec_op(store, op, loc, t, lr_multiplier)?,
                };
                if !paged.is_empty() {
                    tiers.page_out(store, &paged, loc)?;
                }
                for &id in staging_free.get(base + index).map_or(&[][..], Vec::as_slice) {
                    if let Some(Data::F(v)) = store.data.get_mut(id.index()) {
                        *v = Vec::new();
                    }
                }
                if let Some(p) = poison {
                    let pos = p.base(section) + index;
                    for &id in p.after.get(pos).map_or(&[][..], Vec::as_slice) {
                        store.poison(id);
                    }
                }
                match outcome {
                    OpOutcome::Done => {}
                    OpOutcome::GradNorm(norm) => {
                        stats.last_grad_norm = Some(norm);
                        if !norm.is_finite() {
                            stats.skipped_steps += 1;
                            tracing::warn!(step = t, grad_norm = norm, "non-finite gradient norm: skipping the optimizer update of this step");
                            // Staging copies already in (some during the backward) die with the
                            // step: nothing was updated, their homes hold the state.
                            for &id in staging_free.iter().flatten() {
                                if let Some(Data::F(v)) = store.data.get_mut(id.index()) {
                                    *v = Vec::new();
                                }
                            }
                            return Ok(false);
                        }
                    }
                }
            }
            Ok(true)
        })
    }

    /// Bytes the working store holds now (every buffer's current allocation, in this engine's
    /// float size; offloaded state and freed staging buffers hold none), between steps.
    pub fn working_bytes(&self) -> usize {
        self.store
            .data
            .iter()
            .map(|d| match d {
                Data::F(v) => v.len() * T::BYTES,
                Data::I(v) => v.len() * 4,
            })
            .sum()
    }

    /// Bytes moved through the NVMe tier so far and whether it uses O_DIRECT (`None` when the
    /// plan offloads nothing to NVMe).
    pub fn nvme_stats(&self) -> Option<crate::nvme::NvmeStats> {
        self.tiers.nvme_stats()
    }

    /// Runs the forward program and returns the loss (mean cross-entropy, nats) read from
    /// `plan.loss`.
    ///
    /// # Errors
    /// Any kernel error, e.g. [`EngineError::IndexOutOfRange`] for a bad token id.
    pub fn forward(&mut self) -> Result<f64, EngineError> {
        let program = std::mem::take(&mut self.plan.forward);
        let r = self.run("forward", &program, 0, 1.0);
        self.plan.forward = program;
        r?;
        Ok(self
            .store
            .f(self.plan.loss)?
            .first()
            .map_or(f64::NAN, |&x| Float::to_f64(x)))
    }

    /// Runs the backward program (writes every parameter's gradient). Call after
    /// [`forward`](Self::forward) on the same batch.
    pub fn backward(&mut self) -> Result<(), EngineError> {
        self.backward_micro(0)
    }

    /// Runs the backward program for micro-batch `micro` (0-based) of a step: with
    /// `train.grad_accum` ≥ 2 its `GradAccumulate` ops store the gradient on micro-batch 0 and
    /// add it on the others. [`backward`](Self::backward) is micro-batch 0.
    pub fn backward_micro(&mut self, micro: u64) -> Result<(), EngineError> {
        let program = std::mem::take(&mut self.plan.backward);
        let r = self.run("backward", &program, micro, 1.0);
        self.plan.backward = program;
        r.map(|_| ())
    }

    /// Runs the optimizer program for 1-based step `t`, with every op's lr scaled by
    /// `lr_multiplier`. Returns `false` when a `ClipGradNorm` found a non-finite norm and the
    /// rest of the program was skipped (counted in [`EngineStats::skipped_steps`], warned).
    pub fn optimizer_step(&mut self, t: u64, lr_multiplier: f64) -> Result<bool, EngineError> {
        let program = std::mem::take(&mut self.plan.optimizer);
        let r = self.run("optimizer", &program, t.max(1), lr_multiplier);
        self.plan.optimizer = program;
        r
    }
}
