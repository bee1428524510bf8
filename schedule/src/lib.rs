//! The asteria execution plan ("schedule"): a versioned serde JSON document that is the whole
//! contract between the compiler (`frontend` → `ir` → `passes` → `codegen`) and the engine.
//!
//! A [`Plan`] lists named, shaped, typed buffers and the program of one training step over them:
//! the forward program (ends in the scalar loss), the backward program (writes one gradient per
//! parameter), the optimizer program (in-place updates) and the host tasks (eigenbasis
//! refreshes). The engine interprets these instructions generically: it has no notion of a GPT,
//! so a new model family or optimizer is a compiler change, not an engine change.
//!
//! Layout conventions: every tensor is dense row-major; activations are 2-D `[N, C]` with
//! `N = batch * seq_len` tokens (row `n = b * seq_len + t`); a linear layer's weight is
//! `[out_features, in_features]` as in PyTorch's `nn.Linear`.
//!
//! Memory: [`Plan::memory`] places every buffer at a byte offset in one of at most two arenas —
//! a persistent one and an `activations` one whose bytes are reused by buffers with disjoint
//! live ranges (module [`memory`]); [`Plan::verify`] rejects an unsafe placement.
#![deny(missing_docs)]

mod accumulation;
pub mod blocking;
pub mod limits;
pub mod memory;
mod op;
mod operands;
mod options;
mod plan_error;
mod ranges;
pub mod reserve;
mod tiers;
mod verify;

pub use memory::{
    checked_bytes, Access, ArenaKind, ArenaPlan, Budgets, BufferSlot, LiveRange, MemoryPlan,
    PersistReason, Residency, ARENA_ALIGN,
};
pub use op::{
    adamw_kernel_key, operand_dtypes, ElementwiseRule, HostTask, InverseRoot, KlShampooHyper, Op,
    Placement, RefreshMethod, ShampooHyper, SoapHyper, StepScalar, BF16_ATTENTION_MAX_HEAD_DIM,
    BF16_LAYERNORM_MAX_C,
};
pub use options::{
    AttentionKernel, Eigensolver, HostUpdates, Profile, RefreshPlacement, RefreshSwap,
    Rematerialize, WeightCasts,
};
pub use plan_error::PlanError;

/// Whether an `EigenbasisRefresh` with `frequency` and stagger `offset` does work at the end of
/// 1-based step `t`: the initial eigendecomposition at t = 1, then QR refreshes at t > 1 with
/// `(t − 1 − offset) mod frequency = 0` (the first one at t = 1 + offset when offset > 0, as
/// the plan format documents; offset 0 is the reference schedule 1, 1 + f, 1 + 2f, ...).
pub fn refresh_due(t: u64, frequency: u64, offset: u64) -> bool {
    t == 1 || (t > 1 && t > offset && frequency > 0 && (t - 1 - offset).is_multiple_of(frequency))
}

use serde::{Deserialize, Serialize};

/// Magic string in every plan's `format` field.
pub const PLAN_FORMAT: &str = "asteria-plan";
/// Version of the plan format this crate reads and writes. Bumped on any incompatible change
/// (2: the required `memory` section; 3: the typed run options of [`TargetPlan`], and the
/// `fuse` pass's additions: `mat_mul_bias`, bf16 buffers, attention's saved statistics).
pub const PLAN_VERSION: u32 = 3;

/// Index of a buffer in [`Plan::buffers`]. Serialized as a plain integer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BufferId(pub u32);

impl BufferId {
    /// The index into [`Plan::buffers`].
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl std::fmt::Display for BufferId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE-754 binary32 (4 bytes). All parameters, activations and optimizer state.
    F32,
    /// 32-bit signed integer (4 bytes). Token ids.
    I32,
    /// bfloat16 (2 bytes: f32's sign and 8-bit exponent, 7 mantissa bits). Only activations
    /// that the `fuse` pass marks: outputs written in bf16 by their producer and read only as
    /// GEMM operands ([`operand_dtypes`] says which operands may be bf16). Values are f32
    /// values rounded to nearest, ties to even; the CPU engine keeps them in f32 storage,
    /// rounded on every write, so both engines compute with the same values.
    Bf16,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::Bf16 => 2,
        }
    }
    /// The name used in the IR text and the plan JSON (`f32`, `i32`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::I32 => "i32",
            DType::Bf16 => "bf16",
        }
    }
}

/// `x` rounded to the nearest bfloat16 (ties to even), returned as the f32 of that value:
/// the bits a CUDA `__float2bfloat16_rn` gives. NaN stays NaN (quiet), ±∞ stays ±∞, and
/// finite values past bf16's largest (≈ 3.39e38) round to ±∞ as in IEEE rounding.
pub fn round_to_bf16(x: f32) -> f32 {
    if x.is_nan() {
        return f32::NAN;
    }
    let bits = x.to_bits();
    let lsb = (bits >> 16) & 1;
    let rounded = bits.wrapping_add(0x7fff + lsb) & 0xffff_0000;
    f32::from_bits(rounded)
}

/// What a buffer holds; drives memory accounting (`asteria explain`) and, later, tier placement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BufferClass {
    /// A trainable parameter (fp32 master weight).
    Parameter,
    /// The gradient of a parameter.
    Gradient,
    /// A forward or backward intermediate.
    Activation,
    /// A per-step input (token ids, targets).
    Input,
    /// Adam first moment (in the eigenbasis for SOAP).
    ExpAvg,
    /// Adam second moment (in the eigenbasis for SOAP).
    ExpAvgSq,
    /// A Kronecker factor `L = Σ G Gᵀ` or `R = Σ Gᵀ G` (SOAP / Shampoo).
    KroneckerFactor,
    /// An eigenbasis `Q` of a Kronecker factor.
    Eigenbasis,
    /// KL-Shampoo's eigenvalue estimates `D` of one side `[d]` (a running estimate in the
    /// current basis, not the factor's eigenvalues).
    EigenvalueEstimate,
    /// An inverse root `(F + ε·I)^(−1/r)` of a Kronecker factor (Shampoo's preconditioner of
    /// one side of one block), recomputed by a refresh.
    InverseRoot,
    /// A small scalar (loss, grad norm).
    Scalar,
}

/// Initial contents of a buffer, applied once when the engine allocates it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Init {
    /// All zeros.
    Zeros,
    /// All ones (norm weights).
    Ones,
    /// Independent N(0, std²) draws from the run's seeded generator.
    Normal {
        /// Standard deviation.
        std: f64,
    },
    /// The initial contents of another buffer `of` (its own init, drawn with its own stream):
    /// a device copy of a parameter whose master lives in the host tier (`host_updates`).
    CopyOf {
        /// The buffer whose initial values this one starts with (its init is not `CopyOf`).
        of: BufferId,
    },
}

/// One named buffer of the plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Buffer {
    /// Unique, human-readable name (`h0.attn.qkv.weight`, `grad.wte`, ...).
    pub name: String,
    /// Row-major shape; the product is the element count. Scalars are `[1]`.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// What the buffer holds.
    pub class: BufferClass,
    /// Initial contents.
    pub init: Init,
}

impl Buffer {
    /// Number of elements (product of `shape`).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Size in bytes.
    pub fn size_bytes(&self) -> usize {
        self.numel() * self.dtype.size_bytes()
    }
}

/// A trainable parameter and the buffer its gradient is written to by the backward program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamRef {
    /// The parameter buffer.
    pub param: BufferId,
    /// Its gradient buffer (same shape).
    pub grad: BufferId,
}

/// Where the training text comes from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Corpus {
    /// The built-in default corpus (Moby-Dick, CC0), shipped with asteria.
    Builtin,
    /// UTF-8 text files, concatenated in order.
    Files {
        /// Paths, as written in the spec (relative paths are relative to the spec's folder,
        /// already resolved by the compiler).
        paths: Vec<String>,
    },
    /// llm.c / nanoGPT token shards (magic 20240520, version 1: u16 GPT-2 token ids after a
    /// 1024-byte header), memory-mapped and concatenated in order, not tokenized; the plan's
    /// tokenizer is `gpt2`. The engine checks every header and every token id against the
    /// model's vocabulary before training.
    Shards {
        /// Training shards, in order (glob patterns already expanded and sorted).
        train: Vec<String>,
        /// Validation shards, in order; empty = the tail `val_fraction` of the training
        /// stream is held out instead.
        val: Vec<String>,
    },
}

/// Tokenizer that turns the corpus text into token ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tokenizer {
    /// GPT-2 BPE (`r50k_base`, 50257 tokens) through `tiktoken-rs`, `encode_ordinary`.
    Gpt2,
    /// Raw UTF-8 bytes (256 tokens).
    Bytes,
}

/// The data section of a plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataPlan {
    /// Source text.
    pub corpus: Corpus,
    /// Tokenizer.
    pub tokenizer: Tokenizer,
    /// Sequences per step.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Fraction of the token stream (its tail) held out for validation, in (0, 1).
    pub val_fraction: f64,
    /// Per-step input buffer of token ids, i32 `[batch_size * seq_len]`.
    pub tokens: BufferId,
    /// Per-step input buffer of next-token targets, i32 `[batch_size * seq_len]`.
    pub targets: BufferId,
}

/// Training-loop settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainPlan {
    /// Number of optimizer steps.
    pub steps: u64,
    /// Linear warmup steps (lr multiplier rises from 1/warmup to 1).
    pub warmup_steps: u64,
    /// Floor of the cosine decay as a fraction of the peak lr (0.1 = decays to 10%).
    pub min_lr_ratio: f64,
    /// Evaluate validation loss every this many steps (and after the last step); 0 = never.
    pub eval_interval: u64,
    /// Number of validation batches per evaluation.
    pub eval_batches: u64,
    /// Seed for parameter initialisation and batch sampling.
    pub seed: u64,
    /// The activation recomputation the `rematerialize` pass applied (the recomputing ops are
    /// in [`Plan::backward`]; this records the choice for `explain` and the run's first line).
    #[serde(default)]
    pub rematerialize: Rematerialize,
    /// Stop the run with an error after this many consecutive optimizer steps skipped for a
    /// non-finite gradient norm (spec key `max_skipped_steps`, range
    /// [`limits::MAX_SKIPPED_STEPS`]); `None` = never stop. Skips are only detected where the
    /// plan clips gradients (`ClipGradNorm` computes the global norm). A plan written before
    /// the key existed gets the default, [`limits::DEFAULT_MAX_SKIPPED_STEPS`].
    #[serde(default = "default_max_skipped_steps")]
    pub max_skipped_steps: Option<u64>,
    /// When asynchronous refreshes are installed (spec key `refresh_swap`; a plan written
    /// before the key existed gets the default, [`RefreshSwap::Finished`]).
    #[serde(default)]
    pub refresh_swap: RefreshSwap,
    /// Micro-batches per optimizer step (spec key `grad_accum`, range [`limits::GRAD_ACCUM`];
    /// a plan written before the key existed gets 1): the engine runs the forward and backward
    /// programs this many times on consecutive batches before the optimizer program, and the
    /// backward's [`Op::GradAccumulate`] ops average their gradients. Tokens per optimizer step
    /// are `grad_accum · batch_size · seq_len`.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub grad_accum: u64,
}

fn default_max_skipped_steps() -> Option<u64> {
    Some(limits::DEFAULT_MAX_SKIPPED_STEPS)
}

fn one() -> u64 {
    1
}

fn is_one(n: &u64) -> bool {
    *n == 1
}

impl TrainPlan {
    /// Learning-rate multiplier for 1-based `step`: linear warmup then cosine decay to
    /// `min_lr_ratio`, as in nanoGPT / llm.c.
    pub fn lr_multiplier(&self, step: u64) -> f64 {
        if self.warmup_steps > 0 && step <= self.warmup_steps {
            return step as f64 / self.warmup_steps as f64;
        }
        let decay_steps = self.steps.saturating_sub(self.warmup_steps).max(1);
        let progress =
            (step.saturating_sub(self.warmup_steps) as f64 / decay_steps as f64).min(1.0);
        let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine
    }
}

/// The execution target and every option that changes what its engine computes or where
/// (module `options`): set by the spec's `target` block, printed at the start of a run
/// ([`TargetPlan::options_line`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TargetPlan {
    /// The CPU engine.
    Cpu {
        /// Worker threads for kernels and host tasks; `None` = all cores.
        threads: Option<usize>,
        /// Preconditioner staleness bound in steps (0 = synchronous refresh).
        staleness: u32,
        /// Host eigensolver of preconditioner refreshes.
        eigensolver: Eigensolver,
    },
    /// The CUDA engine.
    Cuda {
        /// CUDA device ordinal.
        device: u32,
        /// Preconditioner staleness bound in steps.
        staleness: u32,
        /// GEMM precision policy (master weights, optimizer state and accumulation are fp32).
        precision: Precision,
        /// Host eigensolver of host-placed refreshes.
        eigensolver: Eigensolver,
        /// Attention kernels.
        attention: AttentionKernel,
        /// The refresh placement policy `precond-scheduling` applied (each refresh's own
        /// [`Placement`] is what runs; [`Plan::verify`] checks they agree).
        refresh_placement: RefreshPlacement,
        /// How often `fuse` cast each weight to bf16 per step: `once` or `twice` (the spec's
        /// `weight_casts`, `auto` resolved; the casts themselves are ops of the programs).
        /// Informational for the engine, which runs the casts the programs hold.
        #[serde(default = "default_weight_casts")]
        weight_casts: WeightCasts,
    },
}

/// Plans written before `weight_casts` existed cast every weight twice per step.
fn default_weight_casts() -> WeightCasts {
    WeightCasts::Twice
}

impl TargetPlan {
    /// The run's preconditioner staleness bound in steps: `precond-scheduling` gives every
    /// eigenbasis refresh this staleness, and [`Plan::verify`] rejects a refresh whose own
    /// `staleness` exceeds it (the engines schedule by each refresh's own bound).
    pub fn staleness(&self) -> u32 {
        match self {
            TargetPlan::Cpu { staleness, .. } | TargetPlan::Cuda { staleness, .. } => *staleness,
        }
    }

    /// The host eigensolver.
    pub fn eigensolver(&self) -> Eigensolver {
        match self {
            TargetPlan::Cpu { eigensolver, .. } | TargetPlan::Cuda { eigensolver, .. } => {
                *eigensolver
            }
        }
    }

    /// Sets the host eigensolver (the CLI's `--eigensolver` override).
    pub fn set_eigensolver(&mut self, e: Eigensolver) {
        match self {
            TargetPlan::Cpu { eigensolver, .. } | TargetPlan::Cuda { eigensolver, .. } => {
                *eigensolver = e
            }
        }
    }

    /// One line naming the target and every option value, e.g.
    /// `target cuda: device 0, precision bf16, attention auto, weight_casts once, staleness 5, refresh_placement
    /// auto, eigensolver faer`.
    pub fn options_line(&self) -> String {
        match self {
            TargetPlan::Cpu {
                threads,
                staleness,
                eigensolver,
            } => format!(
                "target cpu: threads {}, staleness {staleness}, eigensolver {eigensolver}",
                threads.map_or("all".to_string(), |t| t.to_string())
            ),
            TargetPlan::Cuda {
                device,
                staleness,
                precision,
                eigensolver,
                attention,
                refresh_placement,
                weight_casts,
            } => format!(
                "target cuda: device {device}, precision {}, attention {attention}, \
                 weight_casts {weight_casts}, staleness {staleness}, refresh_placement \
                 {refresh_placement}, eigensolver {eigensolver}",
                match precision {
                    Precision::Bf16 => "bf16",
                    Precision::Fp32 => "fp32",
                }
            ),
        }
    }
}

/// GEMM precision policy of the CUDA engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// bf16 GEMM inputs with fp32 accumulation (the default; cuBLAS `GemmEx`).
    #[default]
    Bf16,
    /// Full fp32 GEMMs (no TF32): for checking against the CPU engine.
    Fp32,
}

/// Transformer family of [`ModelPlan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelFamily {
    /// GPT-2: LayerNorm (with bias), GELU (tanh), learned positions, tied embeddings, biases.
    Gpt2,
    /// LLaMA / OLMo: RMSNorm, SwiGLU, RoPE (rotate-half), no biases, untied embeddings.
    Llama,
}

/// The architecture a plan was compiled from: what a checkpoint's weights mean outside asteria
/// (`asteria export`). The engines do not read it; the programs are the plan's ops.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelPlan {
    /// Family.
    pub family: ModelFamily,
    /// Vocabulary size (rows of the token embedding).
    pub vocab_size: usize,
    /// Maximum context length in tokens.
    pub context: usize,
    /// Residual width.
    pub d_model: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Attention heads.
    pub n_heads: usize,
    /// MLP hidden size (per SwiGLU branch for LLaMA).
    pub mlp_hidden: usize,
    /// Epsilon of LayerNorm / RMSNorm.
    pub norm_eps: f64,
    /// RoPE base θ (LLaMA only).
    pub rope_theta: f64,
}

/// A complete, self-contained execution plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Always [`PLAN_FORMAT`].
    pub format: String,
    /// Always [`PLAN_VERSION`] for plans this crate writes.
    pub version: u32,
    /// Name of the run (the spec file's stem).
    pub name: String,
    /// Every buffer the step touches.
    pub buffers: Vec<Buffer>,
    /// Trainable parameters with their gradient buffers.
    pub params: Vec<ParamRef>,
    /// Scalar `[1]` buffer the forward program writes the mean cross-entropy loss (nats) to.
    pub loss: BufferId,
    /// Forward program: from the input buffers to `loss`.
    pub forward: Vec<Op>,
    /// Backward program: writes every `params[i].grad` (d loss / d param).
    pub backward: Vec<Op>,
    /// Optimizer program, run after backward; updates parameters and state in place.
    pub optimizer: Vec<Op>,
    /// Host tasks (eigenbasis refreshes) run after the optimizer program on their schedule.
    pub host_tasks: Vec<HostTask>,
    /// Data pipeline.
    pub data: DataPlan,
    /// Training loop.
    pub train: TrainPlan,
    /// Execution target.
    pub target: TargetPlan,
    /// Where every buffer lives: arenas and per-buffer byte offsets (see [`memory`]).
    pub memory: MemoryPlan,
    /// The architecture the plan was compiled from (absent in plans written before it was
    /// recorded, and in hand-built plans).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelPlan>,
}

impl Plan {
    /// How buffer `i` is initialised: its [`Init`] and the index of the random stream a
    /// [`Init::Normal`] draws from (the buffer's own index), with an [`Init::CopyOf`] resolved
    /// to the buffer it copies (so both start with the same bits). Engines initialise every
    /// buffer through this. `None` for an index out of range or a `CopyOf` naming a buffer out
    /// of range or another `CopyOf` ([`Plan::verify`] refuses both).
    pub fn initial(&self, i: usize) -> Option<(Init, u64)> {
        match self.buffers.get(i)?.init {
            Init::CopyOf { of } => match self.buffers.get(of.index())?.init {
                Init::CopyOf { .. } => None,
                init => Some((init, of.0 as u64)),
            },
            init => Some((init, i as u64)),
        }
    }

    /// Model FLOPs of one training step (all its micro-batches), the numerator of MFU (PaLM's
    /// definition, Chowdhery et al. 2022, appendix B): `2·m·k·n` for every GEMM of the forward program and twice that
    /// for its two backward GEMMs (input and weight gradients: the usual `6·N` per token), plus
    /// causal self-attention counted unmasked — `4·B·T²·C` for the scores and the weighted sum
    /// of the forward, twice that for the backward (`12·L·C·T` per token). Counted from the
    /// forward program so that recomputation (`rematerialize`'s copies in the backward) is not
    /// model FLOPs; neither are casts, norms, element-wise ops and the optimizer. Saturates
    /// instead of overflowing.
    pub fn model_flops_per_step(&self) -> f64 {
        let dims = |id: BufferId| -> (f64, f64) {
            match self.buffer(id).shape[..] {
                [r, c] => (r as f64, c as f64),
                _ => (0.0, 0.0),
            }
        };
        let mut flops = 0.0;
        for op in &self.forward {
            match op {
                Op::MatMul {
                    a,
                    b,
                    trans_a,
                    trans_b,
                    ..
                }
                | Op::MatMulBias {
                    a,
                    b,
                    trans_a,
                    trans_b,
                    ..
                } => {
                    let (ar, ac) = dims(*a);
                    let (br, bc) = dims(*b);
                    let (m, k) = if *trans_a { (ac, ar) } else { (ar, ac) };
                    let n = if *trans_b { br } else { bc };
                    flops += 3.0 * 2.0 * m * k * n;
                }
                Op::Attention {
                    qkv,
                    batch,
                    seq_len,
                    ..
                } => {
                    let c = dims(*qkv).1 / 3.0;
                    let t = *seq_len as f64;
                    flops += 3.0 * 4.0 * *batch as f64 * t * t * c;
                }
                _ => {}
            }
        }
        // The forward and backward run once per micro-batch.
        flops * self.train.grad_accum.max(1) as f64
    }

    /// Serializes to pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("invariant: a Plan always serializes")
    }

    /// Parses and verifies a plan. A truncated, malformed or inconsistent document (bad
    /// version, buffer index out of range, shape mismatch, ...) is rejected with a
    /// [`PlanError`] before anything runs.
    pub fn from_json(text: &str) -> Result<Plan, PlanError> {
        // The format and version first, so that a plan of another version (e.g. one without
        // the `memory` section of version 2) is named as such rather than as malformed.
        #[derive(Deserialize)]
        struct Header {
            format: String,
            version: u32,
        }
        if let Ok(h) = serde_json::from_str::<Header>(text) {
            if h.format != PLAN_FORMAT || h.version != PLAN_VERSION {
                return Err(PlanError::Version {
                    format: h.format,
                    version: h.version,
                });
            }
        }
        let plan: Plan = serde_json::from_str(text).map_err(|e| PlanError::Json {
            line: e.line(),
            column: e.column(),
            message: e.to_string(),
        })?;
        plan.verify()?;
        Ok(plan)
    }

    /// Rewrites the plan to run every preconditioner refresh at one place: sets the CUDA
    /// target's `refresh_placement` and every refresh's [`Placement`] (`Auto` leaves the
    /// plan as compiled). Used by harnesses that compare engines with refreshes on the GPU.
    /// A CPU target is left unchanged (its engine runs every refresh on the host).
    pub fn force_refresh_placement(&mut self, p: RefreshPlacement) {
        let to = match p {
            RefreshPlacement::Auto => return,
            RefreshPlacement::Gpu => Placement::GpuSide,
            RefreshPlacement::Host => Placement::Host,
        };
        if let TargetPlan::Cuda {
            refresh_placement, ..
        } = &mut self.target
        {
            *refresh_placement = p;
            for t in &mut self.host_tasks {
                let HostTask::EigenbasisRefresh { placement, .. } = t;
                *placement = to;
            }
        }
    }

    /// The buffer with id `id`. Panics if out of range; call [`Plan::verify`] first.
    pub fn buffer(&self, id: BufferId) -> &Buffer {
        &self.buffers[id.index()]
    }

    /// Bytes of all buffers of `class`.
    pub fn bytes_of(&self, class: BufferClass) -> usize {
        self.buffers
            .iter()
            .filter(|b| b.class == class)
            .map(Buffer::size_bytes)
            .sum()
    }
}
