//! The plan's instruction set: one [`Op`] per kernel, with named buffer operands and the
//! attributes the kernel needs. Shapes are given by the operands' buffers; the verifier
//! (`verify.rs`) checks they agree with what each op expects.
use crate::{BufferId, DType};
use serde::{Deserialize, Serialize};

/// Widest LayerNorm row (C, elements) whose output may be bf16: the CUDA engine's bf16-output
/// LayerNorm keeps a row in one warp's registers (32 lanes × 64 values).
pub const BF16_LAYERNORM_MAX_C: usize = 32 * 64;

/// Largest head dimension (C / n_heads) of an `Attention` whose output may be bf16: the CUDA
/// engine's tensor-core attention kernels, the ones that write bf16, support heads up to 128.
pub const BF16_ATTENTION_MAX_HEAD_DIM: usize = 128;

/// The element types operand `operand` of the plan op named `op` (its snake_case tag, as
/// [`Op::name`]; IR ops of the same name follow the same rule) may have. `ids` / `targets`
/// are i32. bf16 is allowed only where both engines implement it: as the GEMM operands `a` /
/// `b` of `mat_mul` / `mat_mul_bias` (read directly by bf16 tensor-core GEMMs), and as the
/// outputs of the producers that can write bf16 directly — `layer_norm.out` (rows of at most
/// [`BF16_LAYERNORM_MAX_C`]), `gelu.out`, `attention.out` (heads of at most
/// [`BF16_ATTENTION_MAX_HEAD_DIM`]), `rms_norm.out`, `swi_glu.out` and
/// `cross_entropy_backward.dlogits` — and the saved
/// forward output `attention_backward.fwd_out` the tensor-core backward reads; `mat_mul.out`
/// (bf16 GEMMs round their fp32 result in the epilogue; not with `accumulate`) and
/// `mat_mul_bias.out` with its `bias` (both bf16 or both f32: cuBLASLt's epilogue reads the
/// bias in the output's type; the sum is formed in fp32 and rounded once), the `qkv` of `attention` /
/// `attention_backward` and the `dout` of `attention_backward` (heads of at most
/// [`BF16_ATTENTION_MAX_HEAD_DIM`]: the tensor-core kernels read bf16 anyway), the input `x`
/// of `swi_glu` / `gelu` and their backwards, the `dout` of `swi_glu_backward` /
/// `gelu_backward` (a bf16 GEMM's output), the `dx` of `swi_glu_backward` / `gelu_backward` /
/// `rope_backward` (read only by bf16 GEMMs and column sums), the `x` of `sum_rows` (a bias
/// gradient summed in fp32 from such a bf16 gradient), and the `logits` of `cross_entropy` /
/// `cross_entropy_backward` (a bf16 `logits` needs a bf16 `dlogits`); `cast.out` is always
/// bf16 (its `x` f32). Everything else is f32.
pub fn operand_dtypes(op: &str, operand: &str) -> &'static [DType] {
    const F32: &[DType] = &[DType::F32];
    const EITHER: &[DType] = &[DType::F32, DType::Bf16];
    match (op, operand) {
        (_, "ids" | "targets") => &[DType::I32],
        ("mat_mul" | "mat_mul_bias", "a" | "b") => EITHER,
        ("mat_mul" | "mat_mul_bias", "out") => EITHER,
        ("mat_mul_bias", "bias") => EITHER,
        ("attention", "qkv") => EITHER,
        ("attention_backward", "qkv" | "dout") => EITHER,
        ("swi_glu" | "swi_glu_backward" | "gelu" | "gelu_backward", "x") => EITHER,
        ("swi_glu_backward" | "gelu_backward", "dout") => EITHER,
        ("swi_glu_backward" | "gelu_backward" | "rope_backward", "dx") => EITHER,
        ("sum_rows", "x") => EITHER,
        ("cross_entropy" | "cross_entropy_backward", "logits") => EITHER,
        ("layer_norm" | "rms_norm" | "gelu" | "swi_glu" | "rope" | "attention", "out") => EITHER,
        ("attention_backward", "fwd_out") => EITHER,
        ("cross_entropy_backward", "dlogits") => EITHER,
        ("cast", "out") | ("sum_rows_cast", "out_bf16") => &[DType::Bf16],
        _ => F32,
    }
}

/// Hyperparameters of one SOAP parameter update (Vyas et al. 2024, reference `soap.py`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SoapHyper {
    /// Peak learning rate; the engine multiplies by the schedule's multiplier each step.
    pub lr: f64,
    /// β₁ of the first moment.
    pub beta1: f64,
    /// β₂ of the second moment.
    pub beta2: f64,
    /// ε added to √v.
    pub eps: f64,
    /// Decoupled weight decay (multiplied by the scheduled lr).
    pub weight_decay: f64,
    /// Apply Adam bias correction `√(1−β₂ᵏ)/(1−β₁ᵏ)` (k = SOAP's own step count).
    pub correct_bias: bool,
    /// Divide the update by its RMS before applying it.
    pub normalize_grads: bool,
}

/// Hyperparameters of one KL-Shampoo parameter update (Lin et al. 2025, reference
/// `yorkerlin/KL-Methods` `KLOpt` with `using_klsoap = False`; `docs/kl-shampoo.md`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct KlShampooHyper {
    /// Peak learning rate; the engine multiplies by the schedule's multiplier each step.
    pub lr: f64,
    /// β₁ of the (unrotated) momentum.
    pub beta1: f64,
    /// β of the Kronecker factors' and the eigenvalue estimates' EMAs.
    pub shampoo_beta: f64,
    /// ε added to `√(D_L D_Rᵀ)`.
    pub eps: f64,
    /// Decoupled weight decay (multiplied by the scheduled lr), applied after the step.
    pub weight_decay: f64,
    /// Initial eigenvalue estimate.
    pub init_factor: f64,
    /// Clamp: `D ≥ 1/c²`, `c = max(10, min(d, max_clamp_value))`.
    pub max_clamp_value: f64,
    /// Divide the update by its RMS before applying it.
    pub normalize_grads: bool,
}

/// Hyperparameters of one Shampoo parameter update (Gupta et al. 2018; Distributed Shampoo's
/// semantics, facebookresearch/optimizers; `docs/shampoo.md`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShampooHyper {
    /// Peak learning rate; the engine multiplies by the schedule's multiplier each step.
    pub lr: f64,
    /// β₁ of the first moment (0: none).
    pub beta1: f64,
    /// β₂ of the Kronecker factors (1: a running sum).
    pub beta2: f64,
    /// ε added to a factor before its inverse root (carried by the refresh tasks too).
    pub epsilon: f64,
    /// Decoupled weight decay (multiplied by the scheduled lr).
    pub weight_decay: f64,
    /// Bias-correct the first moment, and the factors when β₂ < 1.
    pub use_bias_correction: bool,
    /// Block size `B` of [`crate::blocking::blocks`]: the parameter's blocks, each with its own
    /// factors and inverse roots.
    pub max_preconditioner_dim: u64,
    /// Adam grafting: each block's step takes the Frobenius norm of the Adam step.
    pub grafting: bool,
    /// β₂ of the grafting second moment.
    pub grafting_beta2: f64,
    /// ε of the grafting denominator.
    pub grafting_epsilon: f64,
}

/// The inverse root a [`RefreshMethod::InverseRoot`] refresh computes: `(F + ε·I)^(−1/exponent)`
/// with the spectrum shifted up to ε where it falls below (Distributed Shampoo's
/// `matrix_inverse_root` by eigendecomposition).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct InverseRoot {
    /// The root `r`: 4 for a side of a matrix block, 2 for a vector block.
    pub exponent: u32,
    /// ε added to the factor's diagonal.
    pub epsilon: f64,
}

/// A per-step scalar an element-wise update reads, from a closed vocabulary: each is computed
/// by the engine on the host in f64 from the step's scheduled learning rate `lr_t` (the peak
/// `lr` times the schedule's multiplier) and the 1-based step `t`, then rounded to the update's
/// precision. In an update expression each is the variable of its [`StepScalar::name`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StepScalar {
    /// `lr`: the scheduled learning rate `lr_t`.
    Lr,
    /// `decay`: `1 − lr_t · weight_decay` (decoupled weight decay as one product).
    Decay {
        /// Decoupled weight decay coefficient.
        weight_decay: f64,
    },
    /// `step_size`: `lr_t / (1 − β₁ᵗ)` (the first moment's bias correction folded into lr).
    StepSize {
        /// β₁ of the first moment.
        beta1: f64,
    },
    /// `bc2_sqrt`: `√(1 − β₂ᵗ)` (the second moment's bias correction).
    Bc2Sqrt {
        /// β₂ of the second moment.
        beta2: f64,
    },
    /// `soap_step`: SOAP's step size `lr_t·√(1 − β₂ᵏ) / (1 − β₁ᵏ)` with k = t − 1 (`soap.py`
    /// counts its bias correction from the first update, one step after the first gradient),
    /// computed in that order; 0 at t = 1, where SOAP does not update.
    SoapStep {
        /// β₁ of the first moment.
        beta1: f64,
        /// β₂ of the second moment.
        beta2: f64,
    },
    /// `neg_lr_wd`: `−lr_t · weight_decay` (decoupled weight decay as an increment,
    /// `p + neg_lr_wd·p`, `soap.py`'s `p.add_(p, alpha=-lr*wd)`).
    NegLrWd {
        /// Decoupled weight decay coefficient.
        weight_decay: f64,
    },
    /// `warm`: 0 at t = 1, 1 from t = 2 (for updates that skip the first step, as SOAP does
    /// while it has no eigenbasis).
    Warm,
    /// `bc1`: `1 − β₁ᵗ`, the first moment's bias correction as a divisor (Shampoo's
    /// `Ḡ = M / (1 − β₁ᵗ)`).
    Bc1 {
        /// β₁ of the first moment.
        beta1: f64,
    },
    /// `bc2`: `1 − β₂ᵗ`, a second moment's bias correction as a divisor (Shampoo's Adam
    /// grafting, `V / (1 − β₂ᵗ)`, with the grafting β₂).
    Bc2 {
        /// β₂ of the second moment.
        beta2: f64,
    },
}

impl StepScalar {
    /// Every variable name of the vocabulary.
    pub const NAMES: [&'static str; 9] = [
        "lr",
        "decay",
        "step_size",
        "bc2_sqrt",
        "soap_step",
        "neg_lr_wd",
        "warm",
        "bc1",
        "bc2",
    ];

    /// The variable name of this scalar in an update expression.
    pub fn name(&self) -> &'static str {
        match self {
            StepScalar::Lr => "lr",
            StepScalar::Decay { .. } => "decay",
            StepScalar::StepSize { .. } => "step_size",
            StepScalar::Bc2Sqrt { .. } => "bc2_sqrt",
            StepScalar::SoapStep { .. } => "soap_step",
            StepScalar::NegLrWd { .. } => "neg_lr_wd",
            StepScalar::Warm => "warm",
            StepScalar::Bc1 { .. } => "bc1",
            StepScalar::Bc2 { .. } => "bc2",
        }
    }

    /// The spec key names of the hyperparameters the scalar named `name` carries, in order
    /// (`None` for a name outside the vocabulary).
    pub fn keys(name: &str) -> Option<&'static [&'static str]> {
        Some(match name {
            "lr" | "warm" => &[],
            "decay" | "neg_lr_wd" => &["weight_decay"],
            "step_size" | "bc1" => &["beta1"],
            "bc2_sqrt" | "bc2" => &["beta2"],
            "soap_step" => &["beta1", "beta2"],
            _ => return None,
        })
    }

    /// The scalar's value at 1-based step `t` (a `t` of 0 counts as 1) with scheduled
    /// learning rate `lr_t`, in f64 (engines round it to the update's precision).
    pub fn value(&self, lr_t: f64, t: u64) -> f64 {
        let t = t.max(1).min(i32::MAX as u64) as i32;
        match *self {
            StepScalar::Lr => lr_t,
            StepScalar::Decay { weight_decay } => 1.0 - lr_t * weight_decay,
            StepScalar::StepSize { beta1 } => lr_t / (1.0 - beta1.powi(t)),
            StepScalar::Bc2Sqrt { beta2 } => (1.0 - beta2.powi(t)).sqrt(),
            StepScalar::SoapStep { .. } if t <= 1 => 0.0,
            StepScalar::SoapStep { beta1, beta2 } => {
                let k = t - 1;
                lr_t * (1.0 - beta2.powi(k)).sqrt() / (1.0 - beta1.powi(k))
            }
            StepScalar::NegLrWd { weight_decay } => -lr_t * weight_decay,
            StepScalar::Warm => f64::from(u8::from(t > 1)),
            StepScalar::Bc1 { beta1 } => 1.0 - beta1.powi(t),
            StepScalar::Bc2 { beta2 } => 1.0 - beta2.powi(t),
        }
    }

    /// The hyperparameters this scalar carries, by spec key name, in [`StepScalar::keys`]
    /// order.
    pub fn hyperparameters(&self) -> Vec<(&'static str, f64)> {
        match *self {
            StepScalar::Lr | StepScalar::Warm => vec![],
            StepScalar::Decay { weight_decay } | StepScalar::NegLrWd { weight_decay } => {
                vec![("weight_decay", weight_decay)]
            }
            StepScalar::StepSize { beta1 } | StepScalar::Bc1 { beta1 } => vec![("beta1", beta1)],
            StepScalar::Bc2Sqrt { beta2 } | StepScalar::Bc2 { beta2 } => vec![("beta2", beta2)],
            StepScalar::SoapStep { beta1, beta2 } => vec![("beta1", beta1), ("beta2", beta2)],
        }
    }

    /// The scalar named `name` with its hyperparameters from `hyper` (by spec key name:
    /// `weight_decay`, `beta1`, `beta2`); `None` for a name outside the vocabulary or a missing
    /// hyperparameter.
    pub fn from_name(name: &str, hyper: impl Fn(&str) -> Option<f64>) -> Option<StepScalar> {
        Some(match name {
            "lr" => StepScalar::Lr,
            "warm" => StepScalar::Warm,
            "decay" => StepScalar::Decay {
                weight_decay: hyper("weight_decay")?,
            },
            "neg_lr_wd" => StepScalar::NegLrWd {
                weight_decay: hyper("weight_decay")?,
            },
            "step_size" => StepScalar::StepSize {
                beta1: hyper("beta1")?,
            },
            "bc2_sqrt" => StepScalar::Bc2Sqrt {
                beta2: hyper("beta2")?,
            },
            "bc1" => StepScalar::Bc1 {
                beta1: hyper("beta1")?,
            },
            "bc2" => StepScalar::Bc2 {
                beta2: hyper("beta2")?,
            },
            "soap_step" => StepScalar::SoapStep {
                beta1: hyper("beta1")?,
                beta2: hyper("beta2")?,
            },
            _ => return None,
        })
    }
}

impl std::fmt::Display for StepScalar {
    /// `lr`, `decay(0.1)`, `step_size(0.9)`, `bc2_sqrt(0.95)`, `soap_step(0.95,0.95)` (no
    /// space: the IR prints a rule's scalars space-separated): the text format's spelling.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let h = self.hyperparameters();
        if h.is_empty() {
            return f.write_str(self.name());
        }
        let args: Vec<String> = h.iter().map(|(_, x)| format!("{x:?}")).collect();
        write!(f, "{}({})", self.name(), args.join(","))
    }
}

impl std::str::FromStr for StepScalar {
    type Err = String;
    /// The [`Display`](std::fmt::Display) spelling back (no spaces inside the parentheses).
    fn from_str(s: &str) -> Result<StepScalar, String> {
        let (name, args) = match s.split_once('(') {
            None => (s, Vec::new()),
            Some((n, "")) | Some((n, ")")) => {
                return Err(format!("`{s}`: `{n}` takes no empty parentheses"))
            }
            Some((n, rest)) => {
                let a = rest
                    .strip_suffix(')')
                    .ok_or_else(|| format!("`{s}`: missing `)`"))?;
                let xs = a
                    .split(',')
                    .map(|w| {
                        w.trim()
                            .parse::<f64>()
                            .map_err(|_| format!("`{s}`: `{w}` is not a number"))
                    })
                    .collect::<Result<Vec<f64>, String>>()?;
                (n, xs)
            }
        };
        let keys = StepScalar::keys(name).ok_or_else(|| {
            format!(
                "`{name}` is not a step scalar (one of {})",
                StepScalar::NAMES.join(", ")
            )
        })?;
        if keys.len() != args.len() {
            return Err(match keys.len() {
                0 => format!("`{s}`: `{name}` takes no argument"),
                n => format!(
                    "`{s}`: `{name}` takes {n} hyperparameter(s) in parentheses ({})",
                    keys.join(", ")
                ),
            });
        }
        StepScalar::from_name(name, |k| keys.iter().position(|x| *x == k).map(|i| args[i]))
            .ok_or_else(|| format!("`{s}`: internal: missing hyperparameter"))
    }
}

/// What identifies an `AdamW` op's compiled kernel: the bits of the constants baked into it
/// (β₁, β₂, ε, weight decay). Engines compile each distinct key once.
pub fn adamw_kernel_key(beta1: f64, beta2: f64, eps: f64, weight_decay: f64) -> [u64; 4] {
    [
        beta1.to_bits(),
        beta2.to_bits(),
        eps.to_bits(),
        weight_decay.to_bits(),
    ]
}

/// An element-wise optimizer update as a plan carries it: the expression of
/// `optim::update` (text, `(list out0 out1 ...)`) over the tensors `p` (the parameter), `g`
/// (its gradient, or in a composed step a tensor derived from it) and the state tensors named
/// in `state`, and the step scalars in `scalars`. Each item of the `list` is the new value of
/// the tensor named at the same index of `outputs`: `p`, a state tensor or one of `results`
/// (which the expression must not read: `optim::optimizers::update_rule` refuses that, at
/// engine set-up; [`ElementwiseRule::check`] does not parse the expression).
/// Written by `expand-optimizer` from an optimizer's definition (`optim::optimizers`),
/// rewritten by `simplify`; the engines interpret it (CPU) or compile it (CUDA) at set-up and
/// refuse a plan whose expression does not parse or names an unknown tensor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ElementwiseRule {
    /// The optimizer's name (`lion`); letters, digits and `_` (a kernel name suffix).
    pub optimizer: String,
    /// Peak learning rate; the engine multiplies by the schedule's multiplier each step.
    pub lr: f64,
    /// Names of the state tensors in the expression, in operand order (`["m"]`).
    pub state: Vec<String>,
    /// The tensor each item of the expression's `list` overwrites (`p`, a state name or a
    /// result).
    pub outputs: Vec<String>,
    /// The step scalars the expression reads.
    pub scalars: Vec<StepScalar>,
    /// The expression (`(list (+ (* 0.99 m) ...) ...)`).
    pub expr: String,
    /// Tensors the rule writes that are neither `p` nor state: new f32 values of `p`'s shape,
    /// each named once in `outputs` and never read by the expression (a composed optimizer's
    /// intermediate, e.g. SOAP's update direction in the eigenbasis before it is projected
    /// back). Empty for an update that only writes in place.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub results: Vec<String>,
    /// The hyperparameters the rule was written from, by spec key (`beta1`, `eps`; a flag as
    /// 0 or 1), where an instruction-selection rule of `fuse` may replace the update by a
    /// hand-written op computing the same thing (a composed SOAP step by `soap_update`): the
    /// rule regenerates the expression from them and fuses only on an exact match. Empty
    /// otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hyper: Vec<(String, f64)>,
}

impl ElementwiseRule {
    /// What identifies the rule's compiled kernel: its name, state, outputs, step scalars (by
    /// name: their hyperparameters are arguments, not compiled in) and expression. Engines
    /// compile each distinct key once.
    pub fn kernel_key(&self) -> String {
        let scalars: Vec<&str> = self.scalars.iter().map(|s| s.name()).collect();
        format!(
            "{}|{}|{}|{}|{}|{}",
            self.optimizer,
            self.state.join(","),
            self.results.join(","),
            self.outputs.join(","),
            scalars.join(","),
            self.expr
        )
    }

    /// Tensor names in operand order: `p`, `g`, the state, then the results.
    pub fn tensors(&self) -> Vec<String> {
        let mut v = vec!["p".to_string(), "g".to_string()];
        v.extend(self.state.iter().cloned());
        v.extend(self.results.iter().cloned());
        v
    }

    /// Structural checks (the expression itself is checked by the engine that runs it): a
    /// kernel-name-safe optimizer name, distinct tensor names, at least one output and each
    /// naming `p`, a state tensor or a result once, every result written, distinct step
    /// scalars.
    pub fn check(&self) -> Result<(), String> {
        let ident = |s: &str| {
            !s.is_empty()
                && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !s.starts_with(|c: char| c.is_ascii_digit())
        };
        if !ident(&self.optimizer) {
            return Err(format!(
                "optimizer name `{}` is not an identifier",
                self.optimizer
            ));
        }
        let tensors = self.tensors();
        for (i, t) in tensors.iter().enumerate() {
            if !ident(t) || StepScalar::NAMES.contains(&t.as_str()) {
                return Err(format!("`{t}` cannot name a tensor"));
            }
            if tensors[..i].contains(t) {
                return Err(format!("tensor `{t}` is named twice"));
            }
        }
        if self.outputs.is_empty() {
            return Err("the update writes nothing".into());
        }
        for (i, o) in self.outputs.iter().enumerate() {
            if o == "g" || !tensors.contains(o) {
                return Err(format!(
                    "output `{o}` is not `p`, a state tensor or a result"
                ));
            }
            if self.outputs[..i].contains(o) {
                return Err(format!("output `{o}` is written twice"));
            }
        }
        if let Some(r) = self.results.iter().find(|r| !self.outputs.contains(r)) {
            return Err(format!("result `{r}` is never written"));
        }
        for (i, (k, x)) in self.hyper.iter().enumerate() {
            if !ident(k) || self.hyper[..i].iter().any(|h| &h.0 == k) {
                return Err(format!(
                    "hyperparameter `{k}` is not an identifier or is repeated"
                ));
            }
            if !x.is_finite() {
                return Err(format!("hyperparameter `{k}` = {x} is not finite"));
            }
        }
        for (i, s) in self.scalars.iter().enumerate() {
            if self.scalars[..i].iter().any(|x| x.name() == s.name()) {
                return Err(format!("step scalar `{}` is listed twice", s.name()));
            }
        }
        Ok(())
    }
}

/// One instruction of a plan program. `N` = tokens in the batch (`batch * seq_len`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
#[allow(missing_docs)] // operand fields are documented on each variant
pub enum Op {
    /// `out[n, :] = table[ids[n], :]`. table f32 `[V, C]`, ids i32 `[N]`, out f32 `[N, C]`.
    /// An id outside `[0, V)` is a runtime error.
    Embedding {
        table: BufferId,
        ids: BufferId,
        out: BufferId,
    },
    /// `dtable = 0; dtable[ids[n], :] += dout[n, :]`. dout `[N, C]`, dtable `[V, C]`.
    EmbeddingBackward {
        dout: BufferId,
        ids: BufferId,
        dtable: BufferId,
    },
    /// `out[b*T + t, :] = x[b*T + t, :] + pos[t, :]`. x/out `[N, C]`, pos `[P, C]`, `T = seq_len ≤ P`.
    AddPositional {
        x: BufferId,
        pos: BufferId,
        out: BufferId,
        seq_len: usize,
    },
    /// `dpos[t, :] = Σ_b dout[b*T + t, :]` for `t < T`, zero for `t ≥ T`. dpos `[P, C]`.
    AddPositionalBackward {
        dout: BufferId,
        dpos: BufferId,
        seq_len: usize,
    },
    /// LayerNorm over the last dim: `out = (x − μ)/√(σ² + eps) · weight + bias`.
    /// x/out `[N, C]`, weight/bias `[C]`.
    LayerNorm {
        x: BufferId,
        weight: BufferId,
        bias: Option<BufferId>,
        out: BufferId,
        eps: f64,
    },
    /// Gradients of [`Op::LayerNorm`] (statistics recomputed from `x`): dx `[N, C]`,
    /// dweight/dbias `[C]` (overwritten).
    LayerNormBackward {
        dout: BufferId,
        x: BufferId,
        weight: BufferId,
        dx: BufferId,
        dweight: BufferId,
        dbias: Option<BufferId>,
        eps: f64,
    },
    /// RMSNorm over the last dim: `out = x / √(mean(x²) + eps) · weight`. x/out `[N, C]`, weight `[C]`.
    RmsNorm {
        x: BufferId,
        weight: BufferId,
        out: BufferId,
        eps: f64,
    },
    /// Gradients of [`Op::RmsNorm`]: dx `[N, C]`, dweight `[C]` (overwritten).
    RmsNormBackward {
        dout: BufferId,
        x: BufferId,
        weight: BufferId,
        dx: BufferId,
        dweight: BufferId,
        eps: f64,
    },
    /// `out = op(a) · op(b)` (+ `out` if `accumulate`), op = transpose when the flag is set.
    /// a `[M, K]` (or `[K, M]`), b `[K, P]` (or `[P, K]`), out `[M, P]`.
    /// A linear layer `y = x Wᵀ` is `a = x, b = W, trans_b = true`.
    ///
    /// `micro_accumulate = Some(s)` (the `accumulate-gradients` pass, on a parameter gradient's
    /// only backward write; `accumulate` false): gradient accumulation in the GEMM —
    /// `out = s · op(a)op(b)` on the step's first micro-batch and `out = out + s ·
    /// op(a)op(b)` after (cuBLAS α = s, β = 0 or 1; the CPU engine rounds the product, then
    /// the scaled sum, as [`Op::GradAccumulate`] does). f32 `out`.
    MatMul {
        a: BufferId,
        b: BufferId,
        out: BufferId,
        trans_a: bool,
        trans_b: bool,
        accumulate: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        micro_accumulate: Option<f64>,
    },
    /// A GEMM with a bias epilogue (the `fuse` pass's fusion of a `MatMul` and the `BiasAdd`
    /// of its product): `out[m, :] = (op(a) · op(b))[m, :] + bias`, the product rounded to f32
    /// before the bias is added, exactly as the unfused pair computes it. a `[M, K]` (or
    /// `[K, M]`), b `[K, P]` (or `[P, K]`), bias f32 `[P]`, out f32 `[M, P]` (overwritten).
    MatMulBias {
        a: BufferId,
        b: BufferId,
        bias: BufferId,
        out: BufferId,
        trans_a: bool,
        trans_b: bool,
    },
    /// `out[n, :] = x[n, :] + bias`. x/out `[N, C]`, bias `[C]`.
    BiasAdd {
        x: BufferId,
        bias: BufferId,
        out: BufferId,
    },
    /// `out[c] = Σ_n x[n, c]` (bias gradient). x `[N, C]`, out `[C]`.
    SumRows { x: BufferId, out: BufferId },
    /// `SumRows` and `Cast` of the same x in one pass: `out[c] = Σ_n x[n, c]` (f32 `[C]`,
    /// the same values as `SumRows`) and `out_bf16 = bf16(x)` (`[N, C]`, as `Cast`). x f32
    /// `[N, C]`. The `fuse` pass's `sum-rows-cast` makes it.
    SumRowsCast {
        x: BufferId,
        out: BufferId,
        out_bf16: BufferId,
    },
    /// Elementwise `out = a + b`, same shapes.
    Add {
        a: BufferId,
        b: BufferId,
        out: BufferId,
    },
    /// `out = bf16(x)`: x f32, out bf16, same shape; round to nearest, ties to even
    /// ([`crate::round_to_bf16`]). The `fuse` pass's `bf16-cast` inserts it for the f32 operands
    /// of bf16 GEMMs (weights, f32 activations and gradients).
    Cast { x: BufferId, out: BufferId },
    /// GELU, tanh approximation (GPT-2). Same shapes.
    Gelu { x: BufferId, out: BufferId },
    /// `dx = dout · gelu'(x)`.
    GeluBackward {
        dout: BufferId,
        x: BufferId,
        dx: BufferId,
    },
    /// SwiGLU: x `[N, 2F]` = `[gate | up]`, `out[n, f] = silu(gate[n, f]) · up[n, f]`, out `[N, F]`.
    SwiGlu { x: BufferId, out: BufferId },
    /// Gradient of [`Op::SwiGlu`]: dout `[N, F]`, x/dx `[N, 2F]`.
    SwiGluBackward {
        dout: BufferId,
        x: BufferId,
        dx: BufferId,
    },
    /// Rotary position embedding (Su et al. 2021, LLaMA's rotate-half layout) applied to the
    /// first `rotated_cols` columns of x `[N, W]` (q and k of a fused qkv: `2C`), in chunks of
    /// `head_dim`; other columns are copied. Position of row n is `n mod seq_len`;
    /// frequency `theta^(−2i/head_dim)`.
    Rope {
        x: BufferId,
        out: BufferId,
        seq_len: usize,
        head_dim: usize,
        rotated_cols: usize,
        theta: f64,
    },
    /// Gradient of [`Op::Rope`] (the inverse rotation).
    RopeBackward {
        dout: BufferId,
        dx: BufferId,
        seq_len: usize,
        head_dim: usize,
        rotated_cols: usize,
        theta: f64,
    },
    /// Causal multi-head self-attention on a fused qkv `[N, 3C]` (`[q | k | v]`, heads
    /// contiguous in each), softmax scale `1/√(C/n_heads)`; out `[N, C]`. With `lse` (the
    /// `fuse` pass's `attention-saved`), also the softmax statistics its backward reuses:
    /// `lse[(b·NH + h)·T + t] = log₂ Σ_{s ≤ t} 2^(q_t·k_s · scale · log₂e)`, the base-2
    /// log-sum-exp of row t's scaled scores, f32 `[B·NH·T]`.
    Attention {
        qkv: BufferId,
        out: BufferId,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lse: Option<BufferId>,
        batch: usize,
        seq_len: usize,
        n_heads: usize,
    },
    /// Gradient of [`Op::Attention`]: dout `[N, C]`, dqkv `[N, 3C]`. With `fwd_out` and `lse`
    /// (both or neither: the forward's `out` and `lse`), an engine may take the softmax
    /// statistics and `rowsum(dout ⊙ out)` from them instead of recomputing them from qkv (the
    /// CUDA tensor-core backward does; the CPU engine recomputes: the same math).
    AttentionBackward {
        dout: BufferId,
        qkv: BufferId,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fwd_out: Option<BufferId>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lse: Option<BufferId>,
        dqkv: BufferId,
        batch: usize,
        seq_len: usize,
        n_heads: usize,
    },
    /// Mean softmax cross-entropy in nats: logits f32 `[N, V]`, targets i32 `[N]`, loss `[1]`.
    CrossEntropy {
        logits: BufferId,
        targets: BufferId,
        loss: BufferId,
    },
    /// `dlogits = (softmax(logits) − onehot(targets)) / N` (d mean loss / d logits).
    CrossEntropyBackward {
        logits: BufferId,
        targets: BufferId,
        dlogits: BufferId,
    },
    /// Global L2 norm of `grads` written to `norm` `[1]`; if `max_norm` is set and the norm
    /// exceeds it, every gradient is scaled by `max_norm / norm` (PyTorch `clip_grad_norm_`).
    /// With `scale` (f32 `[1]`; the `fuse` pass's `clip-into-update`) the gradients stay as they
    /// are and the factor (`max_norm / norm`, else 1) is written there instead, for the updates
    /// that read it as their `grad_scale`. A non-finite norm makes the engine skip the rest of
    /// the optimizer program this step.
    ///
    /// With `partials` (f32 `[2 · SUMSQ_BLOCKS · k]`, written by one [`Op::GradSumSquares`] per
    /// gradient during the backward: the `prefetch-insertion` pass's form when gradients
    /// leave the device) `grads` is empty, the norm is the square root of the sum of the
    /// `k` gradients' partial sums (f64, in slot order: the same value as from the gradients),
    /// and `scale` is required: the gradients are scaled where they come back
    /// ([`Op::ScaleByScalar`]) or read it as their `grad_scale`.
    ClipGradNorm {
        grads: Vec<BufferId>,
        norm: BufferId,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        scale: Option<BufferId>,
        max_norm: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        partials: Option<BufferId>,
    },
    /// The sum of squares of the f32 gradient `grad`, accumulated in f64, written to slot
    /// `slot` of `partials` (f32 `[2 · SUMSQ_BLOCKS · k]`: slot `i` is the `SUMSQ_BLOCKS` f64
    /// words from f64 index `i · SUMSQ_BLOCKS`; how an engine splits its sum over them is its
    /// own, the slot's total is the gradient's sum of squares). Issued right after the
    /// gradient's last write in the backward, so that the gradient can leave the device
    /// before the [`Op::ClipGradNorm`] that reads `partials`.
    GradSumSquares {
        grad: BufferId,
        partials: BufferId,
        slot: usize,
    },
    /// Gradient accumulation over the micro-batches of one optimizer step
    /// (`train.grad_accum`, the `accumulate-gradients` pass): `total ← scale · micro` on the
    /// step's first micro-batch and `total ← total + scale · micro` on the others (f32, equal
    /// shapes; `scale` = 1 / micro-batches, so `total` is the mean of the micro-batches'
    /// gradients). Issued in the backward right after `micro`'s last write; the engine knows
    /// which micro-batch it runs (`StepExecutor::backward`'s index). `total` is the
    /// parameter's gradient that the optimizer program reads.
    GradAccumulate {
        micro: BufferId,
        total: BufferId,
        scale: f64,
    },
    /// `x ← x · scale[0]` in place (f32 `x`, f32 `[1]` `scale`): a gradient clipped where it
    /// comes back to the device, by the factor a partials-form [`Op::ClipGradNorm`] wrote
    /// (the bits an in-place clip would have stored).
    ScaleByScalar { x: BufferId, scale: BufferId },
    /// AdamW (Loshchilov & Hutter; PyTorch `torch.optim.AdamW`) on one parameter, in place,
    /// with bias correction at the engine's 1-based step t and lr = `lr ·` schedule multiplier.
    /// With `grad_scale` (f32 `[1]`, a `ClipGradNorm`'s `scale`) the update reads
    /// `grad · grad_scale` (the product rounded to the gradient's type, as an in-place clip
    /// would store it) instead of `grad`.
    ///
    /// `on_host` (`host_updates`, written by `tier-placement`): every operand is in the host
    /// tier and the update runs on the host cores, where that state lives (the CUDA engine's
    /// host-update worker, ordered against the copy streams by events); the CPU engine runs it
    /// as any other. Same math either way.
    AdamW {
        param: BufferId,
        grad: BufferId,
        exp_avg: BufferId,
        exp_avg_sq: BufferId,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        grad_scale: Option<BufferId>,
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        on_host: bool,
    },
    /// SOAP parameter update (reference `soap.py` step body) on a 2-D parameter `[m, n]`
    /// (1-D parameters: `[n]` with no bases). At step t = 1 it does nothing (the first step only
    /// initializes). Otherwise with SOAP's own count k = t − 1: G' = Q_Lᵀ G Q_R (a missing basis
    /// = identity), moments updated in the eigenbasis, update `Q_L (m'/(√v'+ε)) Q_Rᵀ`, bias
    /// correction, optional RMS normalisation, then decoupled weight decay.
    SoapUpdate {
        param: BufferId,
        grad: BufferId,
        exp_avg: BufferId,
        exp_avg_sq: BufferId,
        basis_left: Option<BufferId>,
        basis_right: Option<BufferId>,
        hyper: SoapHyper,
    },
    /// KL-Shampoo parameter update ([`KlShampooHyper`]; `optim::kl_shampoo_update`) on a 2-D
    /// parameter `[m, n]`: `exp_avg` `[m, n]` is the unrotated momentum, `eig_left` `[m]` and
    /// `eig_right` `[n]` the eigenvalue estimates, and each side of length ≤
    /// `max_precond_dim` has a Kronecker factor and its basis (`[m, m]` / `[n, n]`; a side
    /// without them uses the identity basis). At step t = 1 it initialises the factors from the
    /// gradient and the estimates to `init_factor` (the parameter is unchanged); otherwise the
    /// update, the factors and the estimates (from the step's starting bases and estimates),
    /// then decoupled weight decay. The bases are set by `EigenbasisRefresh` host tasks with
    /// method `qr`.
    KlShampooUpdate {
        param: BufferId,
        grad: BufferId,
        exp_avg: BufferId,
        factor_left: Option<BufferId>,
        factor_right: Option<BufferId>,
        basis_left: Option<BufferId>,
        basis_right: Option<BufferId>,
        eig_left: BufferId,
        eig_right: BufferId,
        hyper: KlShampooHyper,
    },
    /// Shampoo parameter update ([`ShampooHyper`]; `optim::shampoo_update`) on a parameter
    /// viewed as [`crate::blocking::blocks`] of its shape under `max_preconditioner_dim`:
    /// `exp_avg` (first moment) and `graft_sq` (the Adam grafting second moment, present iff
    /// `grafting`) have the parameter's shape; `factors[k]` and `roots[k]` are the Kronecker
    /// factor and inverse root `[d, d]` of the k-th side of the blocks in block order (two
    /// sides, rows then columns, for a matrix block; one for a vector block). Each step,
    /// per block: the factors accumulate the block's gradient (stored bias-corrected), the
    /// moments update, the block's step is `root_L Ḡ root_R` (grafted to the Adam step's
    /// norm; the Adam step itself at t = 1, before any root exists), then decoupled weight
    /// decay. The roots are set by `EigenbasisRefresh` host tasks with method
    /// `inverse_root`.
    ShampooUpdate {
        param: BufferId,
        grad: BufferId,
        exp_avg: BufferId,
        graft_sq: Option<BufferId>,
        factors: Vec<BufferId>,
        roots: Vec<BufferId>,
        hyper: ShampooHyper,
    },
    /// Shampoo's Kronecker-factor accumulation, the first op of its composed step
    /// (`optim::optimizers::shampoo`; `optim::shampoo_factor_update`): per block of
    /// [`crate::blocking::blocks`]`(grad's shape, max_preconditioner_dim)` with `G` the block
    /// of `grad`, `F_k ← a·F_k + c·C_k` (`C_1 = G Gᵀ`, `C_2 = Gᵀ G` for a matrix block, `g gᵀ`
    /// for a vector block), with `(a, c)` = `(1, 1)` when β₂ = 1 (a running sum), the
    /// bias-corrected storage of [`Op::ShampooUpdate`] when β₂ < 1 and `use_bias_correction`,
    /// else `(β₂, 1 − β₂)`. `factors` `[d, d]` f32 in block order, in place.
    ShampooFactorUpdate {
        grad: BufferId,
        factors: Vec<BufferId>,
        beta2: f64,
        use_bias_correction: bool,
        max_preconditioner_dim: u64,
    },
    /// Shampoo's preconditioning (`optim::shampoo_precondition`): per block of `x` (f32, a
    /// parameter's shape, blocked as [`Op::ShampooFactorUpdate`]), `out_b = R_1ᵀ x_b R_2` for a
    /// matrix block and `x_b R_1` for a vector block (a row), with the blocks' inverse roots
    /// `roots` `[d, d]` in block order (symmetric, so `R_1ᵀ x_b` is Distributed Shampoo's
    /// `R_1 x_b`); `out` f32 of `x`'s shape.
    ShampooPrecondition {
        x: BufferId,
        out: BufferId,
        roots: Vec<BufferId>,
        max_preconditioner_dim: u64,
    },
    /// Adam grafting per block (`optim::graft`; Distributed Shampoo's `AdamPreconditionerConfig`
    /// grafting): `out_b = x_b · ‖graft_b‖ / (‖x_b‖ + 1e-16)` (Frobenius norms in f64), and
    /// `out = graft` at step t = 1, before any inverse root exists. f32, all of one shape,
    /// blocked as [`Op::ShampooFactorUpdate`].
    Graft {
        x: BufferId,
        graft: BufferId,
        out: BufferId,
        max_preconditioner_dim: u64,
    },
    /// KL-Shampoo's preconditioner in the eigenbasis (`optim::kl_scale`): `out = x ⊘
    /// (√(D_L D_Rᵀ) + ε)` for `x` `[m, n]` f32 with the eigenvalue estimates `eig_left` `[m]` and
    /// `eig_right` `[n]`; zero at step t = 1 (the initialising step, whose update is skipped).
    KlScale {
        x: BufferId,
        out: BufferId,
        eig_left: BufferId,
        eig_right: BufferId,
        eps: f64,
    },
    /// KL-Shampoo's factor and eigenvalue-estimate update, after the step of its composition
    /// (`optim::kl_factor_update`): at t = 1 it initialises the factors from `grad` `[m, n]` and
    /// the estimates to `init_factor`; later `S_L ← β S_L + (1 − β)/n · G Q_R D_R⁻¹ Q_Rᵀ Gᵀ`
    /// (and twin) and the clamped estimates, from the bases and estimates the step started
    /// with. Operands as [`Op::KlShampooUpdate`]'s; in place.
    KlFactorUpdate {
        grad: BufferId,
        factor_left: Option<BufferId>,
        factor_right: Option<BufferId>,
        basis_left: Option<BufferId>,
        basis_right: Option<BufferId>,
        eig_left: BufferId,
        eig_right: BufferId,
        shampoo_beta: f64,
        init_factor: f64,
        max_clamp_value: f64,
    },
    /// Kronecker-factor accumulation, every step after the update:
    /// `L ← lerp(L, G Gᵀ, 1−β_s)` `[m, m]`, `R ← lerp(R, Gᵀ G, 1−β_s)` `[n, n]`.
    SoapFactorUpdate {
        grad: BufferId,
        factor_left: Option<BufferId>,
        factor_right: Option<BufferId>,
        shampoo_beta: f64,
    },
    /// An element-wise optimizer update ([`ElementwiseRule`]) on one parameter, in place:
    /// `param`, `grad` and every `state` tensor f32 of one shape (`state` in the rule's order);
    /// writes the tensors the rule's `outputs` name.
    ElementwiseUpdate {
        param: BufferId,
        grad: BufferId,
        state: Vec<BufferId>,
        /// One new f32 buffer of `param`'s shape per name in the rule's `results`, in order.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        results: Vec<BufferId>,
        rule: ElementwiseRule,
    },
    /// Rotates an f32 matrix `x` `[m, n]` into the eigenbases of a parameter's Kronecker
    /// factors, `out = Q_Lᵀ x Q_R` (`soap.py`'s `project`), or back, `out = Q_L x Q_Rᵀ`
    /// (`project_back`) when `back`; a missing basis is the identity. Bases `[m, m]` / `[n, n]`
    /// f32 row-major with the basis vectors as columns; `out` `[m, n]` f32. On the CPU engine
    /// `optim::project` (f32 GEMMs, the left side first).
    Project {
        x: BufferId,
        out: BufferId,
        basis_left: Option<BufferId>,
        basis_right: Option<BufferId>,
        back: bool,
    },
    /// Copies the block `src[row .. row + r, col .. col + c]` of a 2-D f32 `src` `[m, n]` into
    /// `dst` `[r, c]` (a blocked optimizer's view of one block of a parameter or gradient).
    BlockCopy {
        src: BufferId,
        dst: BufferId,
        row: usize,
        col: usize,
    },
    /// Writes the f32 block `src` `[r, c]` into `dst[row .. row + r, col .. col + c]` of a 2-D
    /// `dst` `[m, n]`, in place (the rest of `dst` unchanged): the inverse of
    /// [`Op::BlockCopy`], after a blocked optimizer updated the block.
    BlockWrite {
        src: BufferId,
        dst: BufferId,
        row: usize,
        col: usize,
    },
    /// Brings an offloaded buffer `src` (placed in the `host` or `nvme` arena by the
    /// `tier-placement` pass) into its staging buffer `dst` on the engine's device (same dtype
    /// and shape), a byte copy. The `prefetch-insertion` pass issues it ahead of `dst`'s first
    /// use; an engine may run it asynchronously (a copy stream, an I/O thread) but completes it
    /// before any later op touches `dst`.
    ///
    /// With `last_step` it runs at optimizer steps t ≤ `last_step` only and does nothing
    /// after (an optimizer-program op: `host_updates = delayed`'s synchronous copy during the
    /// learning-rate warm-up).
    CopyIn {
        src: BufferId,
        dst: BufferId,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        last_step: Option<u64>,
    },
    /// Writes the staging buffer `src` back to its offloaded home `dst` after its last writer
    /// (the inverse of [`Op::CopyIn`]); `src`'s bytes are free once it completes.
    CopyOut { src: BufferId, dst: BufferId },
}

/// Where a preconditioner refresh runs (decided by the `precond-scheduling` pass).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// The host worker pool, through the `HostEigensolver` (on a discrete GPU: the factor is
    /// staged D2H into pinned memory and the basis copied back on the copy streams).
    Host,
    /// The GPU side stream (cuBLAS / cuSOLVER, concurrent with the compute stream; falls back
    /// to the host on the CPU engine).
    GpuSide,
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Placement::Host => "host",
            Placement::GpuSide => "gpu_side",
        })
    }
}

impl std::str::FromStr for Placement {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "host" => Ok(Placement::Host),
            "gpu_side" => Ok(Placement::GpuSide),
            _ => Err(format!(
                "unknown placement `{s}` (expected `host` or `gpu_side`)"
            )),
        }
    }
}

/// What an [`HostTask::EigenbasisRefresh`] computes after the first eigendecomposition.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefreshMethod {
    /// SOAP (`soap.py` `get_orthogonal_matrix_QR`): columns sorted by the estimated
    /// eigenvalues `diag(Qᵀ F Q)`, `exp_avg_sq` permuted to match, one power iteration + QR,
    /// `exp_avg` re-projected into the new basis.
    #[default]
    Soap,
    /// KL-Shampoo (`KLOpt`, `docs/kl-shampoo.md` §3): `Q ← qr(F · Q).Q` with the columns in
    /// their order; no moment is read or written (the task's `exp_avg` and `exp_avg_sq` name
    /// the parameter's unrotated momentum and are not operands).
    Qr,
    /// Shampoo: the factor's inverse root ([`InverseRoot`], the task's `root`) replaces the
    /// `basis` operand, at every refresh including the first; no moment is read or written
    /// (the task's `exp_avg` and `exp_avg_sq` name the root, only for its shape).
    InverseRoot,
}

impl std::fmt::Display for RefreshMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RefreshMethod::Soap => "soap",
            RefreshMethod::Qr => "qr",
            RefreshMethod::InverseRoot => "inverse_root",
        })
    }
}

impl std::str::FromStr for RefreshMethod {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "soap" => Ok(RefreshMethod::Soap),
            "qr" => Ok(RefreshMethod::Qr),
            "inverse_root" => Ok(RefreshMethod::InverseRoot),
            _ => Err(format!(
                "unknown refresh method `{s}` (expected `soap`, `qr` or `inverse_root`)"
            )),
        }
    }
}

/// A task the engine runs outside the step's kernel programs (on the host worker pool), at the
/// end of the steps its schedule selects.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "task", rename_all = "snake_case")]
#[allow(missing_docs)] // operand fields are documented on the variant
pub enum HostTask {
    /// Refresh the eigenbasis of one Kronecker factor (reference `soap.py`
    /// `get_orthogonal_matrix` / `get_orthogonal_matrix_QR`), for one `side` of a parameter
    /// (0 = left factor `[m, m]`, 1 = right factor `[n, n]`):
    /// - at the end of step t = 1: `basis ← eigh(factor)` with columns in descending
    ///   eigenvalue order;
    /// - at the end of step t > 1 with (t − 1) mod `frequency` = 0: estimated eigenvalues
    ///   `diag(Qᵀ F Q)` sort the columns of Q (descending) and permute `exp_avg_sq` along `side`
    ///   the same way, then one power iteration + QR: `Q_new = qr(F Q_sorted).Q`; `exp_avg`
    ///   (stored in the eigenbasis) is re-projected: `E ← Q_newᵀ Q_old E` (side 0) or
    ///   `E ← E Q_oldᵀ Q_new` (side 1).
    ///
    /// With `method` [`RefreshMethod::Qr`] (KL-Shampoo) a QR refresh is `Q_new = qr(F Q).Q`
    /// with no sort and no moment touched. With [`RefreshMethod::InverseRoot`] (Shampoo) every
    /// refresh, the first included, writes `basis ← (F + ε·I)^(−1/r)` (`root`).
    ///
    /// A non-finite factor or a failed eigensolve keeps the previous basis (counted, logged).
    ///
    /// Scheduling (from `precond-scheduling`): QR refreshes happen at the end of the steps t > 1
    /// with (t − 1 − `offset`) mod `frequency` = 0 (`offset` staggers factors across the steps of
    /// a period; 0 = the reference schedule). With `staleness` S > 0 the refresh works on a
    /// snapshot of the factor while training continues with the previous basis; its result is
    /// swapped in at a later step boundary, at the latest before step t + S + 1 (the engine
    /// waits only then). S = 0 is the synchronous, native behaviour. S is at most the target's
    /// bound ([`crate::TargetPlan::staleness`]; [`crate::Plan::verify`] checks it).
    EigenbasisRefresh {
        factor: BufferId,
        basis: BufferId,
        side: u8,
        exp_avg: BufferId,
        exp_avg_sq: BufferId,
        frequency: u64,
        #[serde(default)]
        offset: u64,
        #[serde(default)]
        staleness: u32,
        #[serde(default = "default_placement")]
        placement: Placement,
        #[serde(default)]
        method: RefreshMethod,
        /// The inverse root of a [`RefreshMethod::InverseRoot`] refresh (absent otherwise).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        root: Option<InverseRoot>,
    },
}

fn default_placement() -> Placement {
    Placement::Host
}
