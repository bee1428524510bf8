//! The allowed range of every numeric setting, defined once: the frontend checks each spec key
//! against its range (the error gives the key's line:column and the range) and
//! [`crate::Plan::verify`] checks the plan fields they become, so a hand-edited plan cannot run
//! what the spec language refuses.
//!
//! The bounds sit far above the largest real models (GPT-3: d_model 12288, 96 layers, 96 heads;
//! LLaMA 3 405B: d_model 16384, 126 layers, FFN 53248, vocab 128256, rope_theta 500000) and low
//! enough that every size the compiler computes from them fits in 64 bits: the largest tensor,
//! logits `[batch_size · seq_len, vocab]` in f32, is at most 2^16 · 2^20 · 2^20 · 4 = 2^58 bytes.
//! Whether the result fits a machine is the memory ceiling's business ([`MAX_PLAN_BYTES`]) at
//! compile time and the engines' (free host or device memory) before they allocate.
//! [`SPEC_KEYS`] lists every key with its range; the README's "Spec keys" table is generated from
//! it (a frontend test checks they agree).

/// An inclusive range of integers, printed `1..=65_536` (spec syntax: `_` groups digits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IntRange {
    /// The smallest allowed value.
    pub min: u64,
    /// The largest allowed value.
    pub max: u64,
}

impl IntRange {
    /// `min..=max`.
    pub const fn new(min: u64, max: u64) -> Self {
        IntRange { min, max }
    }

    /// Whether `x` is in the range.
    pub fn contains(self, x: i128) -> bool {
        i128::from(self.min) <= x && x <= i128::from(self.max)
    }

    /// Whether the unsigned `x` is in the range.
    pub fn contains_u64(self, x: u64) -> bool {
        self.min <= x && x <= self.max
    }
}

impl std::fmt::Display for IntRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}..={}", grouped(self.min), grouped(self.max))
    }
}

/// `n` with `_` between groups of three digits from 10_000 on (`1_048_576`).
#[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` needs Rust 1.87; the workspace supports 1.85
pub fn grouped(n: u64) -> String {
    let s = n.to_string();
    if s.len() <= 4 {
        return s;
    }
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push('_');
        }
        out.push(c);
    }
    out
}

/// A range of finite floats with an open or closed end on each side, printed in interval
/// notation: `(0, 10]`, `[0, 1)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FloatRange {
    /// Lower bound.
    pub min: f64,
    /// Whether `min` itself is allowed.
    pub min_closed: bool,
    /// Upper bound.
    pub max: f64,
    /// Whether `max` itself is allowed.
    pub max_closed: bool,
}

impl FloatRange {
    /// `(min, max]`: above `min`, at most `max`.
    pub const fn above(min: f64, max: f64) -> Self {
        FloatRange {
            min,
            min_closed: false,
            max,
            max_closed: true,
        }
    }
    /// `[min, max]`.
    pub const fn closed(min: f64, max: f64) -> Self {
        FloatRange {
            min,
            min_closed: true,
            max,
            max_closed: true,
        }
    }
    /// `[min, max)`.
    pub const fn below(min: f64, max: f64) -> Self {
        FloatRange {
            min,
            min_closed: true,
            max,
            max_closed: false,
        }
    }
    /// `(min, max)`.
    pub const fn open(min: f64, max: f64) -> Self {
        FloatRange {
            min,
            min_closed: false,
            max,
            max_closed: false,
        }
    }

    /// Whether `x` is finite and in the range.
    pub fn contains(self, x: f64) -> bool {
        let lo = if self.min_closed {
            x >= self.min
        } else {
            x > self.min
        };
        let hi = if self.max_closed {
            x <= self.max
        } else {
            x < self.max
        };
        x.is_finite() && lo && hi
    }
}

impl std::fmt::Display for FloatRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}{}, {}{}",
            if self.min_closed { '[' } else { '(' },
            short(self.min),
            short(self.max),
            if self.max_closed { ']' } else { ')' }
        )
    }
}

/// `x` as written in a spec: `0.5`, `10`, `1e12` (exponent form from a million on).
fn short(x: f64) -> String {
    if x.abs() >= 1e6 {
        format!("{x:e}")
    } else {
        x.to_string()
    }
}

/// The range of one key.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Limit {
    /// An integer key.
    Int(IntRange),
    /// A float key (integers are accepted and converted).
    Float(FloatRange),
    /// A size key, in bytes (written with a unit: `24GiB`).
    Size(IntRange),
}

/// `bytes` in the largest binary unit that divides it (`24GiB`, `1536MiB`, `1000B`), as a
/// spec would write it.
pub fn human_size(bytes: u128) -> String {
    for (unit, shift) in [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        let m = 1u128 << shift;
        if bytes >= m && bytes.is_multiple_of(m) {
            return format!("{}{unit}", bytes / m);
        }
    }
    format!("{bytes}B")
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Limit::Int(r) => r.fmt(f),
            Limit::Float(r) => r.fmt(f),
            Limit::Size(r) => write!(
                f,
                "{}..={}",
                human_size(u128::from(r.min)),
                human_size(u128::from(r.max))
            ),
        }
    }
}

// --- model ---------------------------------------------------------------------------------
/// `vocab`: rows of the token embedding (2^20; the largest real vocabularies are ~2^18).
pub const VOCAB: IntRange = IntRange::new(1, 1 << 20);
/// `context`: maximum sequence length in tokens (2^20).
pub const CONTEXT: IntRange = IntRange::new(1, 1 << 20);
/// `d_model`: residual width (2^16).
pub const D_MODEL: IntRange = IntRange::new(1, 1 << 16);
/// `layers`: transformer blocks.
pub const LAYERS: IntRange = IntRange::new(1, 1024);
/// `heads`: attention heads (must also divide `d_model`).
pub const HEADS: IntRange = IntRange::new(1, 1024);
/// `mlp_hidden`: MLP width (2^18 = 4 × the largest `d_model`).
pub const MLP_HIDDEN: IntRange = IntRange::new(1, 1 << 18);
/// `norm_eps`: LayerNorm / RMSNorm epsilon.
pub const NORM_EPS: FloatRange = FloatRange::above(0.0, 1.0);
/// `init_std`: standard deviation of the weight init.
pub const INIT_STD: FloatRange = FloatRange::above(0.0, 1.0);
/// `rope_theta`: RoPE base.
pub const ROPE_THETA: FloatRange = FloatRange::above(0.0, 1e12);

// --- optimizer -----------------------------------------------------------------------------
/// `lr`: peak learning rate.
pub const LR: FloatRange = FloatRange::above(0.0, 10.0);
/// Each of `betas` and `shampoo_beta`: EMA factors.
pub const BETA: FloatRange = FloatRange::below(0.0, 1.0);
/// `eps`: Adam's ε.
pub const EPS: FloatRange = FloatRange::above(0.0, 1.0);
/// `weight_decay`: decoupled weight decay (multiplied by the scheduled lr).
pub const WEIGHT_DECAY: FloatRange = FloatRange::closed(0.0, 10.0);
/// `precondition_frequency`: eigenbasis refresh period in steps.
pub const PRECONDITION_FREQUENCY: IntRange = IntRange::new(1, 100_000);
/// `max_precond_dim`: dimensions above this stay unrotated (up to the largest `vocab`).
pub const MAX_PRECOND_DIM: IntRange = IntRange::new(1, 1 << 20);
/// Shampoo's β₂ of the Kronecker factors (1: a running sum, the reference's default).
pub const SHAMPOO_BETA2: FloatRange = FloatRange::above(0.0, 1.0);
/// Shampoo's `max_preconditioner_dim`: the block size (below 8 the blocks of one embedding
/// number in the hundreds of thousands).
pub const MAX_PRECONDITIONER_DIM: IntRange = IntRange::new(8, 1 << 20);
/// The Shampoo blocks (or blocked-SOAP blocks) of a whole model: each has up to two factors,
/// two inverse roots or bases and two refresh tasks.
pub const SHAMPOO_BLOCKS: u64 = 65_536;
/// KL-Shampoo's `init_factor`: the initial eigenvalue estimate.
pub const INIT_FACTOR: FloatRange = FloatRange::above(0.0, 1e6);
/// KL-Shampoo's `max_clamp_value`: the estimates are clamped at `1/c²`,
/// `c = max(10, min(d, max_clamp_value))`.
pub const MAX_CLAMP_VALUE: FloatRange = FloatRange::closed(1.0, 1e9);

// --- data ----------------------------------------------------------------------------------
/// `batch_size`: sequences per step (2^16).
pub const BATCH_SIZE: IntRange = IntRange::new(1, 1 << 16);
/// `seq_len`: tokens per sequence (also at most `context`).
pub const SEQ_LEN: IntRange = IntRange::new(1, 1 << 20);
/// `val_fraction`: held-out share of the token stream.
pub const VAL_FRACTION: FloatRange = FloatRange::open(0.0, 1.0);

// --- train ---------------------------------------------------------------------------------
/// `steps` (and the CLI's `--steps`): optimizer steps.
pub const STEPS: IntRange = IntRange::new(1, 1_000_000_000);
/// `warmup`: linear warmup steps (also at most `steps`).
pub const WARMUP: IntRange = IntRange::new(0, 1_000_000_000);
/// `min_lr_ratio`: cosine floor as a fraction of the peak lr.
pub const MIN_LR_RATIO: FloatRange = FloatRange::closed(0.0, 1.0);
/// `grad_clip`: global-norm clipping threshold (`none` disables clipping).
pub const GRAD_CLIP: FloatRange = FloatRange::above(0.0, 1e6);
/// `eval_interval`: steps between validations (and after the last step); 0 = never.
pub const EVAL_INTERVAL: IntRange = IntRange::new(0, 1_000_000_000);
/// `eval_batches`: batches per validation.
pub const EVAL_BATCHES: IntRange = IntRange::new(1, 100_000);
/// `grad_accum`: micro-batches per optimizer step (gradient accumulation).
pub const GRAD_ACCUM: IntRange = IntRange::new(1, 65_536);
/// `seed`: any 64-bit value.
pub const SEED: IntRange = IntRange::new(0, u64::MAX);
/// `max_skipped_steps`: consecutive optimizer steps skipped for a non-finite gradient norm
/// after which a run stops with an error (`none`: never stop). At least 1 (0 would stop at the
/// first skip, which is what 1 does).
pub const MAX_SKIPPED_STEPS: IntRange = IntRange::new(1, 1_000_000_000);
/// The default of `max_skipped_steps`: one non-finite step (an overflow on one unlucky batch)
/// is skipped and training goes on, but a skipped step leaves the parameters unchanged, so ten
/// different batches in a row with a non-finite gradient mean the model itself has diverged;
/// stopping then wastes at most ten steps instead of the rest of the run.
pub const DEFAULT_MAX_SKIPPED_STEPS: u64 = 10;

// --- target --------------------------------------------------------------------------------
/// `threads` (CPU target): worker threads. A fixed cap, since a plan may be compiled on one
/// machine and run on another; the CPU engine also refuses more than
/// [`MAX_THREADS_PER_CORE`] threads per core of the machine it runs on.
pub const THREADS: IntRange = IntRange::new(1, 1024);
/// The most CPU engine threads per available core: oversubscribing further only slows each
/// step down (on 2 cores one step takes 0.25 s at 2 threads and 28 s at 128).
pub const MAX_THREADS_PER_CORE: usize = 4;
/// `staleness`: steps a refresh result may be late (the largest refresh period).
pub const STALENESS: IntRange = IntRange::new(0, 100_000);
/// `device` (CUDA target): device ordinal.
pub const DEVICE: IntRange = IntRange::new(0, 255);
/// `gpu_memory` / `memory` / `host_memory`: a memory budget in bytes (1 MiB to 16 TiB).
pub const MEMORY_BUDGET: IntRange = IntRange::new(1 << 20, 1 << 44);
/// `nvme_memory`: the NVMe tier's budget in bytes (1 MiB to 1 PiB).
pub const NVME_BUDGET: IntRange = IntRange::new(1 << 20, 1 << 50);

// --- sizes ---------------------------------------------------------------------------------
/// The most elements one buffer may have (2^40: 4 TiB of f32).
pub const MAX_BUFFER_ELEMENTS: u64 = 1 << 40;
/// The most bytes a plan's buffers may take together, one place each (16 TiB): more than any
/// host or device holds. The compiler refuses a larger plan, naming its largest buffers.
pub const MAX_PLAN_BYTES: u64 = 16 << 40;

/// Every numeric spec key: `(block, key, range)`, in the order of the README's table.
pub const SPEC_KEYS: &[(&str, &str, Limit)] = &[
    ("model", "vocab", Limit::Int(VOCAB)),
    ("model", "context", Limit::Int(CONTEXT)),
    ("model", "d_model", Limit::Int(D_MODEL)),
    ("model", "layers", Limit::Int(LAYERS)),
    ("model", "heads", Limit::Int(HEADS)),
    ("model", "mlp_hidden", Limit::Int(MLP_HIDDEN)),
    ("model", "norm_eps", Limit::Float(NORM_EPS)),
    ("model", "init_std", Limit::Float(INIT_STD)),
    ("model", "rope_theta", Limit::Float(ROPE_THETA)),
    ("optimizer", "lr", Limit::Float(LR)),
    ("optimizer", "betas", Limit::Float(BETA)),
    ("optimizer", "shampoo_beta", Limit::Float(BETA)),
    ("optimizer", "eps", Limit::Float(EPS)),
    ("optimizer", "weight_decay", Limit::Float(WEIGHT_DECAY)),
    (
        "optimizer",
        "precondition_frequency",
        Limit::Int(PRECONDITION_FREQUENCY),
    ),
    ("optimizer", "max_precond_dim", Limit::Int(MAX_PRECOND_DIM)),
    ("optimizer", "init_factor", Limit::Float(INIT_FACTOR)),
    (
        "optimizer",
        "max_clamp_value",
        Limit::Float(MAX_CLAMP_VALUE),
    ),
    ("optimizer", "epsilon", Limit::Float(EPS)),
    (
        "optimizer",
        "max_preconditioner_dim",
        Limit::Int(MAX_PRECONDITIONER_DIM),
    ),
    ("optimizer", "grafting_beta2", Limit::Float(BETA)),
    ("optimizer", "grafting_epsilon", Limit::Float(EPS)),
    ("data", "batch_size", Limit::Int(BATCH_SIZE)),
    ("data", "seq_len", Limit::Int(SEQ_LEN)),
    ("data", "val_fraction", Limit::Float(VAL_FRACTION)),
    ("train", "steps", Limit::Int(STEPS)),
    ("train", "warmup", Limit::Int(WARMUP)),
    ("train", "min_lr_ratio", Limit::Float(MIN_LR_RATIO)),
    ("train", "grad_clip", Limit::Float(GRAD_CLIP)),
    ("train", "eval_interval", Limit::Int(EVAL_INTERVAL)),
    ("train", "eval_batches", Limit::Int(EVAL_BATCHES)),
    ("train", "seed", Limit::Int(SEED)),
    ("train", "max_skipped_steps", Limit::Int(MAX_SKIPPED_STEPS)),
    ("train", "grad_accum", Limit::Int(GRAD_ACCUM)),
    ("target", "threads", Limit::Int(THREADS)),
    ("target", "staleness", Limit::Int(STALENESS)),
    ("target", "device", Limit::Int(DEVICE)),
    ("target", "gpu_memory", Limit::Size(MEMORY_BUDGET)),
    ("target", "memory", Limit::Size(MEMORY_BUDGET)),
    ("target", "host_memory", Limit::Size(MEMORY_BUDGET)),
    ("target", "nvme_memory", Limit::Size(NVME_BUDGET)),
];

/// The README's "Spec keys" table: one row per entry of [`SPEC_KEYS`].
pub fn markdown_table() -> String {
    let mut s = String::from("| block | key | allowed range |\n|---|---|---|\n");
    for (block, key, limit) in SPEC_KEYS {
        s.push_str(&format!("| `{block}` | `{key}` | `{limit}` |\n"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_print_in_spec_syntax() {
        assert_eq!(D_MODEL.to_string(), "1..=65_536");
        assert_eq!(LAYERS.to_string(), "1..=1024");
        assert_eq!(SEED.to_string(), "0..=18_446_744_073_709_551_615");
        assert_eq!(LR.to_string(), "(0, 10]");
        assert_eq!(BETA.to_string(), "[0, 1)");
        assert_eq!(ROPE_THETA.to_string(), "(0, 1e12]");
    }

    #[test]
    fn float_ranges_refuse_their_open_ends_and_non_finite_values() {
        assert!(!LR.contains(0.0) && LR.contains(10.0) && !LR.contains(10.000001));
        assert!(BETA.contains(0.0) && !BETA.contains(1.0));
        assert!(!EPS.contains(f64::NAN) && !WEIGHT_DECAY.contains(f64::INFINITY));
    }

    #[test]
    fn the_largest_tensor_of_the_largest_spec_fits_64_bits() {
        let tokens = BATCH_SIZE.max * SEQ_LEN.max;
        let logits = tokens.checked_mul(VOCAB.max).and_then(|n| n.checked_mul(4));
        assert!(logits.is_some());
        let mlp = tokens
            .checked_mul(2 * MLP_HIDDEN.max)
            .and_then(|n| n.checked_mul(4));
        assert!(mlp.is_some());
        let factor = MAX_PRECOND_DIM.max.checked_mul(MAX_PRECOND_DIM.max);
        assert!(factor.is_some_and(|n| n <= MAX_BUFFER_ELEMENTS));
    }
}
