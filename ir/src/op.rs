//! The closed set of IR operations. Operands are SSA values (`Inst::args`); attributes are
//! fields of the variant. Each op documents its arguments and results; the verifier checks them.
//! Math and layouts are those of the plan instruction with the same name
//! (`schedule::Op`), which `lower` emits one-for-one.
use schedule::{
    BufferClass, ElementwiseRule, Init, InverseRoot, KlShampooHyper, Placement, RefreshMethod,
    ShampooHyper, SoapHyper,
};

/// Role of a per-step input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum InputRole {
    /// Token ids `i32[N]`.
    Tokens,
    /// Next-token targets `i32[N]`.
    Targets,
}

/// Program section an instruction belongs to; sections run in this order every step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Section {
    /// Persistent buffers (parameters, optimizer state) and per-step inputs.
    State,
    /// Forward program, ends at the loss.
    Forward,
    /// Backward program, writes parameter gradients.
    Backward,
    /// Optimizer program (in-place updates).
    Optimizer,
    /// Host tasks (eigenbasis refreshes), after the optimizer program.
    Refresh,
}

impl Section {
    /// All sections in execution order.
    pub const ALL: [Section; 5] = [
        Section::State,
        Section::Forward,
        Section::Backward,
        Section::Optimizer,
        Section::Refresh,
    ];
    /// Keyword used in the text format.
    pub fn keyword(self) -> &'static str {
        match self {
            Section::State => "state",
            Section::Forward => "forward",
            Section::Backward => "backward",
            Section::Optimizer => "optimizer",
            Section::Refresh => "refresh",
        }
    }
}

/// An IR operation. `args` / `results` below refer to [`crate::Inst::args`] /
/// [`crate::Inst::results`]; shapes use N = tokens per step, C = width, V = vocab.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// A persistent buffer (parameter or optimizer state). args: none; results: 1.
    State {
        /// What it holds.
        class: BufferClass,
        /// Initial contents.
        init: Init,
    },
    /// A per-step input. args: none; results: 1 (`i32[N]`).
    Input {
        /// Which input.
        role: InputRole,
    },
    /// Marks the scalar loss. args: `[loss f32[1]]`; results: none.
    Loss,
    /// Marks `grad` as d loss / d `param`. args: `[param, grad]`; results: none.
    GradOf,
    /// args `[table [V,C], ids i32[N]]` → `[N, C]`.
    Embedding,
    /// args `[dout [N,C], ids, table [V,C]]` (table only for its shape) → dtable `[V, C]`.
    EmbeddingBackward,
    /// args `[x [N,C], pos [P,C]]` → `[N, C]`.
    AddPositional {
        /// Tokens per sequence T.
        seq_len: usize,
    },
    /// args `[dout [N,C], pos [P,C]]` (pos only for its shape) → dpos `[P, C]`.
    AddPositionalBackward {
        /// Tokens per sequence T.
        seq_len: usize,
    },
    /// args `[x, weight]` or `[x, weight, bias]` → `[N, C]`.
    LayerNorm {
        /// Variance epsilon.
        eps: f64,
    },
    /// args `[dout, x, weight]` → `[dx, dweight]`, plus `dbias` when `bias` is set.
    LayerNormBackward {
        /// Variance epsilon.
        eps: f64,
        /// Whether the forward had a bias (adds a third result).
        bias: bool,
    },
    /// args `[x, weight]` → `[N, C]`.
    RmsNorm {
        /// Epsilon.
        eps: f64,
    },
    /// args `[dout, x, weight]` → `[dx, dweight]`.
    RmsNormBackward {
        /// Epsilon.
        eps: f64,
    },
    /// args `[a, b]` → `op(a) op(b)`.
    MatMul {
        /// Transpose a.
        trans_a: bool,
        /// Transpose b.
        trans_b: bool,
    },
    /// args `[a, b, bias [P]]` → `op(a) op(b) + bias` `[M, P]`: a GEMM with a bias epilogue,
    /// made by the `fuse` pass from a `mat_mul` and the `bias_add` of its product.
    MatMulBias {
        /// Transpose a.
        trans_a: bool,
        /// Transpose b.
        trans_b: bool,
    },
    /// args `[x [N,C], bias [C]]` → `[N, C]`.
    BiasAdd,
    /// args `[x [N,C]]` → `[C]`.
    SumRows,
    /// args `[x [N,C]]` (f32) → `[out [C]` f32 = the column sums of `sum_rows`, `out_bf16
    /// [N,C]` bf16 = `cast x`]: one pass over x. Made by `fuse` (`sum-rows-cast`) where an
    /// activation gradient is both summed (a bias gradient) and cast for its GEMMs.
    SumRowsCast,
    /// args `[a, b]` (same type) → same type.
    Add,
    /// args `[x]` (f32) → the same shape in the result's dtype (bf16): `x` rounded to nearest,
    /// ties to even. Inserted by `fuse` (`bf16-cast`) for GEMM operands under bf16.
    Cast,
    /// args `[x]` → same type (tanh approximation).
    Gelu,
    /// args `[dout, x]` → dx.
    GeluBackward,
    /// args `[x [N,2F]]` → `[N, F]`.
    SwiGlu,
    /// args `[dout [N,F], x [N,2F]]` → dx `[N, 2F]`.
    SwiGluBackward,
    /// args `[x [N,W]]` → `[N, W]`.
    Rope {
        /// Tokens per sequence.
        seq_len: usize,
        /// Head dimension (even).
        head_dim: usize,
        /// Leading columns rotated (2C for a fused qkv).
        rotated_cols: usize,
        /// Base θ.
        theta: f64,
    },
    /// args `[dout [N,W]]` → dx `[N, W]`.
    RopeBackward {
        /// Tokens per sequence.
        seq_len: usize,
        /// Head dimension (even).
        head_dim: usize,
        /// Leading columns rotated.
        rotated_cols: usize,
        /// Base θ.
        theta: f64,
    },
    /// args `[qkv [N,3C]]` → `[N, C]` (causal), or `[out, lse [B·NH·T]]` when the `fuse`
    /// pass's `attention-saved` has it keep its softmax statistics for the backward.
    Attention {
        /// Sequences B.
        batch: usize,
        /// Tokens per sequence T.
        seq_len: usize,
        /// Heads.
        n_heads: usize,
    },
    /// args `[dout [N,C], qkv [N,3C]]`, or `[dout, qkv, fwd_out [N,C], lse [B·NH·T]]` with the
    /// forward's saved output and statistics → dqkv `[N, 3C]`.
    AttentionBackward {
        /// Sequences B.
        batch: usize,
        /// Tokens per sequence T.
        seq_len: usize,
        /// Heads.
        n_heads: usize,
    },
    /// args `[logits [N,V], targets i32[N]]` → loss `[1]` (mean, nats).
    CrossEntropy,
    /// args `[logits, targets]` → dlogits `[N, V]`.
    CrossEntropyBackward,
    /// args: every gradient; results: `[norm f32[1]]`, scaling the grads in place when
    /// clipping, or `[norm, scale f32[1]]` (`fuse`'s `clip-into-update`): the grads stay and
    /// the clip factor (1 when not clipping) goes to `scale`, which the updates read.
    ClipGradNorm {
        /// Clip threshold (`None` = only measure).
        max_norm: Option<f64>,
    },
    /// args `[param, grad, exp_avg, exp_avg_sq]` and optionally `grad_scale f32[1]` (a clip's
    /// `scale`: the update reads `grad · grad_scale`); updates in place; no results.
    AdamW {
        /// Peak lr.
        lr: f64,
        /// β₁.
        beta1: f64,
        /// β₂.
        beta2: f64,
        /// ε.
        eps: f64,
        /// Decoupled weight decay.
        weight_decay: f64,
    },
    /// args `[param, grad, exp_avg, exp_avg_sq]` + `basis_left` if `left` + `basis_right` if
    /// `right`; in place; no results.
    SoapUpdate {
        /// Hyperparameters.
        hyper: SoapHyper,
        /// Left (row) side is rotated.
        left: bool,
        /// Right (column) side is rotated.
        right: bool,
    },
    /// KL-Shampoo (see `schedule::Op::KlShampooUpdate`): args `[param, grad, exp_avg,
    /// eig_left, eig_right]` + `factor_left, basis_left` if `left` + `factor_right,
    /// basis_right` if `right`; in place; no results.
    KlShampooUpdate {
        /// Hyperparameters.
        hyper: KlShampooHyper,
        /// The left (row) side has a Kronecker factor and a basis.
        left: bool,
        /// The right (column) side has a Kronecker factor and a basis.
        right: bool,
    },
    /// Shampoo (see `schedule::Op::ShampooUpdate`): args `[param, grad, exp_avg]` +
    /// `graft_sq` if `hyper.grafting` + one `(factor, root)` pair per side of each block of
    /// `schedule::blocking::blocks(param shape, hyper.max_preconditioner_dim)`, in block order
    /// (rows then columns of a matrix block); in place; no results.
    ShampooUpdate {
        /// Hyperparameters (the block size among them).
        hyper: ShampooHyper,
    },
    /// Shampoo's factor accumulation (see `schedule::Op::ShampooFactorUpdate`): args `[grad]`
    /// + the Kronecker factor of every side of every block of
    /// `schedule::blocking::blocks(grad shape, max_preconditioner_dim)`, in block order; in
    /// place; no results.
    ShampooFactorUpdate {
        /// β₂ of the factors (1: a running sum).
        beta2: f64,
        /// Store the factors bias-corrected (when β₂ < 1).
        use_bias_correction: bool,
        /// Block size.
        max_preconditioner_dim: u64,
    },
    /// Shampoo's preconditioning (see `schedule::Op::ShampooPrecondition`): args `[x]` (f32, a
    /// parameter's shape: the first moment or the gradient) + the inverse root of every side
    /// of every block, in block order → f32 of `x`'s shape.
    ShampooPrecondition {
        /// Block size.
        max_preconditioner_dim: u64,
    },
    /// Adam grafting per block (see `schedule::Op::Graft`): args `[x, graft]` (f32, one shape)
    /// → f32 of that shape.
    Graft {
        /// Block size.
        max_preconditioner_dim: u64,
    },
    /// KL-Shampoo's preconditioner in the eigenbasis (see `schedule::Op::KlScale`): args `[x,
    /// eig_left, eig_right]` (`x` f32 `[m, n]`) → f32 `[m, n]`.
    KlScale {
        /// ε added to `√(D_L D_Rᵀ)`.
        eps: f64,
    },
    /// KL-Shampoo's factor and estimate update (see `schedule::Op::KlFactorUpdate`): args
    /// `[grad, eig_left, eig_right]` + `factor_left, basis_left` if `left` + `factor_right,
    /// basis_right` if `right`; in place; no results.
    KlFactorUpdate {
        /// β of the factors' and estimates' EMAs.
        shampoo_beta: f64,
        /// Initial eigenvalue estimate.
        init_factor: f64,
        /// Clamp bound of the estimates.
        max_clamp_value: f64,
        /// The left side has a factor and a basis.
        left: bool,
        /// The right side has a factor and a basis.
        right: bool,
    },
    /// args `[src]` (2-D f32 `[m, n]`), result `[r, c]`: the block of `src` at (`row`, `col`)
    /// (see `schedule::Op::BlockCopy`).
    BlockCopy {
        /// First row of the block.
        row: usize,
        /// First column of the block.
        col: usize,
    },
    /// args `[dst, src]`: writes the block `src` `[r, c]` into `dst` `[m, n]` at (`row`,
    /// `col`); in place; no results.
    BlockWrite {
        /// First row of the block.
        row: usize,
        /// First column of the block.
        col: usize,
    },
    /// args `[grad]` + `factor_left` if `left` + `factor_right` if `right`; in place.
    SoapFactorUpdate {
        /// EMA factor β_s.
        shampoo_beta: f64,
        /// Left factor present.
        left: bool,
        /// Right factor present.
        right: bool,
    },
    /// args `[param, grad, state...]` (the rule's state order, each of the param's shape);
    /// in place (writes what the rule's `outputs` name); one result per name of the rule's
    /// `results` (f32, the param's shape), none for a plain update. `grad` is the param's
    /// gradient, or in a composed optimizer a value derived from it (a `project`'s or another
    /// `elementwise_update`'s result). See `schedule::ElementwiseRule`.
    ElementwiseUpdate {
        /// The update rule.
        rule: ElementwiseRule,
    },
    /// args `[x]` (f32 `[m, n]`: a gradient, a block of one or an update's result) +
    /// `basis_left` `[m, m]` if `left` + `basis_right` `[n, n]` if `right` (eigenbases) →
    /// `[m, n]` f32: `Q_Lᵀ x Q_R`, or `Q_L x Q_Rᵀ` when `back` (see `schedule::Op::Project`).
    Project {
        /// Project back out of the eigenbasis.
        back: bool,
        /// The left (row) side is rotated.
        left: bool,
        /// The right (column) side is rotated.
        right: bool,
    },
    /// args `[factor, basis, exp_avg, exp_avg_sq]` (method `soap`) or `[factor, basis,
    /// exp_avg]` (method `qr`: the momentum only names the parameter's shape; it is not an
    /// operand); host task; in place. The scheduling attributes are set by
    /// `precond-scheduling` (see `schedule::HostTask`).
    EigenbasisRefresh {
        /// 0 = left factor, 1 = right.
        side: u8,
        /// Refresh period in steps.
        frequency: u64,
        /// Step offset within the period (staggering); `< frequency`.
        offset: u64,
        /// Staleness bound in steps (0 = synchronous).
        staleness: u32,
        /// Where the refresh runs.
        placement: Placement,
        /// What a refresh computes after the first eigendecomposition.
        method: RefreshMethod,
        /// The inverse root of method `inverse_root` (args `[factor, root]`); absent otherwise.
        root: Option<InverseRoot>,
    },
}

impl Op {
    /// The op's name in the text format (snake_case, as the plan's `op` tag).
    pub fn name(&self) -> &'static str {
        match self {
            Op::State { .. } => "state",
            Op::Input { .. } => "input",
            Op::Loss => "loss",
            Op::GradOf => "grad_of",
            Op::Embedding => "embedding",
            Op::EmbeddingBackward => "embedding_backward",
            Op::AddPositional { .. } => "add_positional",
            Op::AddPositionalBackward { .. } => "add_positional_backward",
            Op::LayerNorm { .. } => "layer_norm",
            Op::LayerNormBackward { .. } => "layer_norm_backward",
            Op::RmsNorm { .. } => "rms_norm",
            Op::RmsNormBackward { .. } => "rms_norm_backward",
            Op::MatMul { .. } => "mat_mul",
            Op::MatMulBias { .. } => "mat_mul_bias",
            Op::BiasAdd => "bias_add",
            Op::SumRows => "sum_rows",
            Op::SumRowsCast => "sum_rows_cast",
            Op::Add => "add",
            Op::Cast => "cast",
            Op::Gelu => "gelu",
            Op::GeluBackward => "gelu_backward",
            Op::SwiGlu => "swi_glu",
            Op::SwiGluBackward => "swi_glu_backward",
            Op::Rope { .. } => "rope",
            Op::RopeBackward { .. } => "rope_backward",
            Op::Attention { .. } => "attention",
            Op::AttentionBackward { .. } => "attention_backward",
            Op::CrossEntropy => "cross_entropy",
            Op::CrossEntropyBackward => "cross_entropy_backward",
            Op::ClipGradNorm { .. } => "clip_grad_norm",
            Op::AdamW { .. } => "adam_w",
            Op::SoapUpdate { .. } => "soap_update",
            Op::SoapFactorUpdate { .. } => "soap_factor_update",
            Op::KlShampooUpdate { .. } => "kl_shampoo_update",
            Op::ShampooUpdate { .. } => "shampoo_update",
            Op::ShampooFactorUpdate { .. } => "shampoo_factor_update",
            Op::ShampooPrecondition { .. } => "shampoo_precondition",
            Op::Graft { .. } => "graft",
            Op::KlScale { .. } => "kl_scale",
            Op::KlFactorUpdate { .. } => "kl_factor_update",
            Op::BlockCopy { .. } => "block_copy",
            Op::BlockWrite { .. } => "block_write",
            Op::ElementwiseUpdate { .. } => "elementwise_update",
            Op::Project { .. } => "project",
            Op::EigenbasisRefresh { .. } => "eigenbasis_refresh",
        }
    }

    /// Whether the op mutates its arguments in place (optimizer ops, clipping, host tasks).
    pub fn is_in_place(&self) -> bool {
        matches!(
            self,
            Op::ClipGradNorm { .. }
                | Op::AdamW { .. }
                | Op::SoapUpdate { .. }
                | Op::SoapFactorUpdate { .. }
                | Op::KlShampooUpdate { .. }
                | Op::ShampooUpdate { .. }
                | Op::ShampooFactorUpdate { .. }
                | Op::KlFactorUpdate { .. }
                | Op::BlockWrite { .. }
                | Op::ElementwiseUpdate { .. }
                | Op::EigenbasisRefresh { .. }
        )
    }
}
