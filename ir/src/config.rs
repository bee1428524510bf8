//! The validated run configuration a spec file describes (model, optimizer, data, training,
//! target). The frontend produces it; the IR module carries it so that every pass dump is a
//! complete, re-parsable program.
use serde::{Deserialize, Serialize};

/// Complete configuration of one training run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// Run name (the spec file's stem).
    pub name: String,
    /// Model architecture.
    pub model: ModelConfig,
    /// Optimizer and its hyperparameters.
    pub optimizer: OptimizerConfig,
    /// Training data.
    pub data: DataConfig,
    /// Training loop.
    pub train: TrainConfig,
    /// Execution target.
    pub target: TargetConfig,
}

/// Transformer family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// GPT-2: LayerNorm (with bias), GELU (tanh), learned positions, tied embeddings, biases.
    Gpt2,
    /// LLaMA / OLMo: RMSNorm, SwiGLU, RoPE, no biases, untied embeddings.
    Llama,
}

/// Model architecture. Parameter shapes follow PyTorch (`nn.Linear` weight `[out, in]`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Family.
    pub family: Family,
    /// Vocabulary size (rows of the token embedding), e.g. 50257 for GPT-2 BPE.
    pub vocab_size: usize,
    /// Maximum context length in tokens (rows of the position embedding for GPT-2).
    pub context: usize,
    /// Residual width C.
    pub d_model: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Attention heads; must divide `d_model`.
    pub n_heads: usize,
    /// MLP hidden size F (GPT-2 convention 4C; LLaMA SwiGLU uses F per branch).
    pub mlp_hidden: usize,
    /// Epsilon of LayerNorm / RMSNorm.
    pub norm_eps: f64,
    /// Std of the N(0, σ²) weight init (GPT-2: 0.02; residual projections scaled by 1/√(2L)).
    pub init_std: f64,
    /// RoPE base θ (LLaMA family only).
    pub rope_theta: f64,
}

/// Optimizer choice.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum OptimizerConfig {
    /// AdamW.
    Adamw(AdamWConfig),
    /// SOAP.
    Soap(SoapConfig),
    /// KL-Shampoo.
    KlShampoo(KlShampooConfig),
    /// Shampoo (Distributed Shampoo's semantics).
    Shampoo(ShampooConfig),
    /// An optimizer defined by its element-wise update rule (`optim::optimizers`: Lion, ...).
    Elementwise(ElementwiseConfig),
}

/// An optimizer of `optim::optimizers` and its hyperparameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ElementwiseConfig {
    /// The definition's name (`lion`).
    pub name: String,
    /// Every hyperparameter by name (pairs expanded: `beta1`, `beta2`), defaults filled in.
    pub hyper: Vec<(String, f64)>,
}

/// AdamW hyperparameters (PyTorch `torch.optim.AdamW` semantics).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    /// Peak learning rate.
    pub lr: f64,
    /// β₁.
    pub beta1: f64,
    /// β₂.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay, applied to 2-D parameters only (nanoGPT convention).
    pub weight_decay: f64,
}

/// SOAP hyperparameters; names and defaults of the reference `soap.py` (Vyas et al. 2024).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SoapConfig {
    /// Peak learning rate (default 3e-3).
    pub lr: f64,
    /// β₁ (default 0.95).
    pub beta1: f64,
    /// β₂ (default 0.95).
    pub beta2: f64,
    /// EMA factor of the Kronecker factors (default: β₂).
    pub shampoo_beta: f64,
    /// ε (default 1e-8).
    pub eps: f64,
    /// Decoupled weight decay (default 0.01).
    pub weight_decay: f64,
    /// Eigenbasis refresh period in steps (default 10).
    pub precondition_frequency: u64,
    /// Dimensions larger than this stay unrotated (default 10000).
    pub max_precond_dim: usize,
    /// Adam bias correction (default true).
    pub correct_bias: bool,
    /// Normalize the update by its RMS (default false).
    pub normalize_grads: bool,
    /// Blocked SOAP (the spec's `max_preconditioner_dim`): a side of a 2-D parameter longer
    /// than this and at most `max_precond_dim` is cut into pieces of this many rows or columns,
    /// each block preconditioned as its own parameter; a side over `max_precond_dim` stays
    /// whole and unrotated (default none: `soap.py`'s behaviour, no side cut).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<usize>,
}

/// KL-Shampoo hyperparameters (Lin et al. 2025); names and defaults of the reference `KLOpt`
/// (`yorkerlin/KL-Methods`, `docs/kl-shampoo.md` §5), plus `max_precond_dim`, which the
/// reference does not have (it gives every dimension a dense factor).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KlShampooConfig {
    /// Peak learning rate (default 1e-4).
    pub lr: f64,
    /// β₁ of the momentum (default 0.9).
    pub beta1: f64,
    /// β₂ (default 0.98): the default of `shampoo_beta`, and the second-moment β of the AdamW
    /// that updates 1-D parameters.
    pub beta2: f64,
    /// EMA factor of the Kronecker factors and the eigenvalue estimates (default: β₂).
    pub shampoo_beta: f64,
    /// ε of the denominator (default 1e-8).
    pub eps: f64,
    /// Decoupled weight decay, 2-D parameters (default 0.01).
    pub weight_decay: f64,
    /// Basis refresh period in steps (default 10).
    pub precondition_frequency: u64,
    /// Initial eigenvalue estimate (default 0.1).
    pub init_factor: f64,
    /// Clamp of the estimates, `D ≥ 1/c²`, `c = max(10, min(d, max_clamp_value))` (default
    /// 4000).
    pub max_clamp_value: f64,
    /// Sides longer than this have no factor: identity basis, eigenvalue estimate only
    /// (default 10000, as SOAP's).
    pub max_precond_dim: usize,
    /// Normalize the update by its RMS (default false).
    pub normalize_grads: bool,
}

/// Shampoo hyperparameters; names and defaults of Distributed Shampoo
/// (facebookresearch/optimizers `DistributedShampoo.__init__`, `docs/shampoo.md` §1), with
/// Adam grafting's (`AdamPreconditionerConfig`) when `grafting` is on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShampooConfig {
    /// Peak learning rate (default 1e-2).
    pub lr: f64,
    /// β₁ of the first moment (default 0.9).
    pub beta1: f64,
    /// β₂ of the Kronecker factors (default 1.0: a running sum).
    pub beta2: f64,
    /// ε added to a factor before its inverse root (default 1e-12).
    pub epsilon: f64,
    /// Decoupled weight decay, every parameter (default 0).
    pub weight_decay: f64,
    /// Block size (default 1024): each block of at most this many rows and columns has its
    /// own factors.
    pub max_preconditioner_dim: usize,
    /// Steps between inverse-root refreshes (default 1).
    pub precondition_frequency: u64,
    /// Bias-correct the first moment and, when β₂ < 1, the factors (default true).
    pub use_bias_correction: bool,
    /// Adam grafting (default false: none, as the reference).
    pub grafting: bool,
    /// β₂ of the grafting second moment (default 0.999).
    pub grafting_beta2: f64,
    /// ε of the grafting denominator (default 1e-10).
    pub grafting_epsilon: f64,
}

/// Where the training text comes from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CorpusConfig {
    /// The built-in Moby-Dick.
    Builtin,
    /// UTF-8 text files (paths resolved relative to the spec file's folder).
    Files {
        /// Paths.
        paths: Vec<String>,
    },
    /// llm.c / nanoGPT token shards (`.bin`: a 256 × i32 header, then u16 GPT-2 token ids),
    /// read in place; `data { train = "DIR/*train*.bin"  val = "DIR/*val*.bin" }`, patterns
    /// expanded (sorted) by the frontend.
    Shards {
        /// Training shards, in order.
        train: Vec<String>,
        /// Validation shards, in order; empty = the tail `val_fraction` of the training shards.
        val: Vec<String>,
    },
}

/// Tokenizer choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerKind {
    /// GPT-2 BPE (`r50k_base`).
    Gpt2,
    /// Raw bytes (vocab 256).
    Bytes,
}

/// Training data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataConfig {
    /// Corpus.
    pub corpus: CorpusConfig,
    /// Tokenizer.
    pub tokenizer: TokenizerKind,
    /// Sequences per step B.
    pub batch_size: usize,
    /// Tokens per sequence T (≤ model context).
    pub seq_len: usize,
    /// Held-out fraction of the token stream, in (0, 1).
    pub val_fraction: f64,
}

/// Training loop.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// Optimizer steps.
    pub steps: u64,
    /// Linear warmup steps.
    pub warmup_steps: u64,
    /// Cosine floor as a fraction of peak lr.
    pub min_lr_ratio: f64,
    /// Gradient clipping by global norm (`None` = off).
    pub grad_clip: Option<f64>,
    /// Validation every this many steps (0 = only at the end).
    pub eval_interval: u64,
    /// Batches per validation.
    pub eval_batches: u64,
    /// RNG seed.
    pub seed: u64,
    /// Activation recomputation (`rematerialize = off | selective | layers`, default off):
    /// the `rematerialize` pass's policy.
    #[serde(default)]
    pub rematerialize: crate::Rematerialize,
    /// `max_skipped_steps = N | none` (default 10, `limits::DEFAULT_MAX_SKIPPED_STEPS`): stop
    /// after N consecutive steps skipped for a non-finite gradient; `None` = never stop.
    #[serde(default = "default_max_skipped_steps")]
    pub max_skipped_steps: Option<u64>,
    /// When asynchronous refreshes are installed (`refresh_swap = finished | deadline`,
    /// default finished).
    #[serde(default)]
    pub refresh_swap: crate::RefreshSwap,
    /// `grad_accum = N` (default 1, range `limits::GRAD_ACCUM`): micro-batches of
    /// `batch_size × seq_len` tokens per optimizer step, their gradients averaged (the
    /// `accumulate-gradients` pass).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub grad_accum: u64,
}

fn one() -> u64 {
    1
}

fn is_one(n: &u64) -> bool {
    *n == 1
}

fn default_max_skipped_steps() -> Option<u64> {
    Some(crate::limits::DEFAULT_MAX_SKIPPED_STEPS)
}

/// Execution target.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TargetConfig {
    /// CPU engine.
    Cpu {
        /// Threads (`None` = all cores).
        threads: Option<usize>,
        /// Preconditioner staleness bound in steps (0 = synchronous).
        staleness: u32,
        /// Target description for the cost model: a built-in name (`cpu`, `h200`, `gh200`,
        /// `gb10`) or the path of a JSON file written by `asteria calibrate` (resolved against
        /// the spec's folder). `None` = the built-in `cpu`.
        #[serde(default)]
        calibration: Option<String>,
        /// Host eigensolver of refreshes (`eigensolver`, default faer).
        #[serde(default)]
        eigensolver: crate::Eigensolver,
        /// Memory budgets (`memory`, `host_memory`, `nvme`, `nvme_memory`; default none).
        #[serde(default, skip_serializing_if = "crate::Budgets::is_empty")]
        budgets: crate::Budgets,
    },
    /// CUDA engine.
    Cuda {
        /// Device ordinal.
        device: u32,
        /// Preconditioner staleness bound in steps.
        staleness: u32,
        /// GEMM precision: `bf16` (bf16 inputs, fp32 accumulation; default) or `fp32`.
        #[serde(default)]
        precision: crate::Precision,
        /// As for `Cpu`; `None` = the built-in `h200`.
        #[serde(default)]
        calibration: Option<String>,
        /// Host eigensolver of host-placed refreshes (`eigensolver`, default faer).
        #[serde(default)]
        eigensolver: crate::Eigensolver,
        /// Attention kernels (`attention = auto | fused | gemm`, default auto).
        #[serde(default)]
        attention: crate::AttentionKernel,
        /// Where refreshes run (`refresh_placement = auto | gpu | host`, default auto: the
        /// cost model decides per factor).
        #[serde(default)]
        refresh_placement: crate::RefreshPlacement,
        /// How often weights are cast to bf16 per step (`weight_casts = auto | once | twice`,
        /// default auto; [`crate::WeightCasts`]).
        #[serde(default)]
        weight_casts: crate::WeightCasts,
        /// Memory budgets (`gpu_memory`, `host_memory`, `nvme`, `nvme_memory`; default none).
        #[serde(default, skip_serializing_if = "crate::Budgets::is_empty")]
        budgets: crate::Budgets,
    },
}

impl Config {
    /// Whether the `fuse` pass casts each weight once per step (`weight_casts = once`, or
    /// `auto` on a CUDA target without a `gpu_memory` budget and with `rematerialize = off`);
    /// false on the CPU target (no bf16 GEMMs) and for `twice`.
    pub fn weight_casts_once(&self) -> bool {
        match &self.target {
            TargetConfig::Cuda {
                weight_casts,
                budgets,
                ..
            } => match weight_casts {
                crate::WeightCasts::Once => true,
                crate::WeightCasts::Twice => false,
                crate::WeightCasts::Auto => {
                    budgets.device.is_none()
                        && self.train.rematerialize == crate::Rematerialize::Off
                }
            },
            TargetConfig::Cpu { .. } => false,
        }
    }
}

impl TargetConfig {
    /// The preconditioner staleness bound in steps.
    pub fn staleness(&self) -> u32 {
        match self {
            TargetConfig::Cpu { staleness, .. } | TargetConfig::Cuda { staleness, .. } => {
                *staleness
            }
        }
    }
    /// The host eigensolver.
    pub fn eigensolver(&self) -> crate::Eigensolver {
        match self {
            TargetConfig::Cpu { eigensolver, .. } | TargetConfig::Cuda { eigensolver, .. } => {
                *eigensolver
            }
        }
    }
    /// The refresh placement policy (`Host` on the CPU target, which has no GPU).
    pub fn refresh_placement(&self) -> crate::RefreshPlacement {
        match self {
            TargetConfig::Cpu { .. } => crate::RefreshPlacement::Host,
            TargetConfig::Cuda {
                refresh_placement, ..
            } => *refresh_placement,
        }
    }
    /// The memory budgets (none set: every buffer on the device).
    pub fn budgets(&self) -> &crate::Budgets {
        match self {
            TargetConfig::Cpu { budgets, .. } | TargetConfig::Cuda { budgets, .. } => budgets,
        }
    }
    /// The cost-model description named by the spec, if any.
    pub fn calibration(&self) -> Option<&str> {
        match self {
            TargetConfig::Cpu { calibration, .. } | TargetConfig::Cuda { calibration, .. } => {
                calibration.as_deref()
            }
        }
    }
}
