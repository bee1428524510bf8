//! The kernel families: hand-written CUDA C in `cuda/kernels/*.cu` (one family per file),
//! embedded in the binary, compiled by NVRTC at start-up and looked up by name; plus the small
//! argument packer the launchers use.
use crate::error::{CudaError, Result};
use crate::memory::Buf;
use crate::nvrtc::{self, Origin};
use cudarc::driver::{CudaContext, CudaFunction};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// Device helpers (warp/block reductions) prepended to every family before compiling.
pub const COMMON: &str = include_str!("../kernels/common.cuh");

/// One kernel family: a `.cu` file and the `extern "C"` kernels it defines.
#[derive(Clone, Copy, Debug)]
pub struct Family {
    /// File stem in `cuda/kernels/`.
    pub name: &'static str,
    /// The file's text.
    pub source: &'static str,
    /// Its `extern "C" __global__` kernel names, in file order.
    pub kernels: &'static [&'static str],
}

macro_rules! family {
    ($name:literal, [$($k:literal),* $(,)?]) => {
        Family { name: $name, source: include_str!(concat!("../kernels/", $name, ".cu")), kernels: &[$($k),*] }
    };
    // A family whose source starts with a shared header of `cuda/kernels/` (the fused attention
    // families' flash_common.cuh).
    ($name:literal, prelude $pre:literal, [$($k:literal),* $(,)?]) => {
        Family {
            name: $name,
            source: concat!(
                include_str!(concat!("../kernels/", $pre)),
                include_str!(concat!("../kernels/", $name, ".cu"))
            ),
            kernels: &[$($k),*],
        }
    };
}

/// Every family, in load order.
pub const FAMILIES: &[Family] = &[
    family!(
        "embedding",
        [
            "embedding_forward",
            "embedding_backward_span_init",
            "embedding_backward_span",
            "embedding_backward_rows"
        ]
    ),
    family!("positional", ["add_positional", "add_positional_backward"]),
    family!(
        "layernorm",
        [
            "layernorm_forward",
            "layernorm_backward_dx",
            "layernorm_forward_w8",
            "layernorm_forward_w16",
            "layernorm_forward_w24",
            "layernorm_forward_w32",
            "layernorm_forward_w64",
            "layernorm_backward_w8",
            "layernorm_backward_w16",
            "layernorm_backward_w24",
            "layernorm_backward_w32",
            "layernorm_backward_w64",
            "layernorm_backward_params",
            "layernorm_backward_params_finalize",
            "layernorm_forward_bf16_w8",
            "layernorm_forward_bf16_w16",
            "layernorm_forward_bf16_w24",
            "layernorm_forward_bf16_w32",
            "layernorm_forward_bf16_w64"
        ]
    ),
    family!(
        "rmsnorm",
        [
            "rmsnorm_forward",
            "rmsnorm_forward_bf16",
            "rmsnorm_backward_dx",
            "rmsnorm_backward_weight"
        ]
    ),
    family!(
        "activations",
        [
            "gelu_forward_ff",
            "gelu_forward_fb",
            "gelu_forward_bf",
            "gelu_forward_bb",
            "gelu_backward_fff",
            "gelu_backward_ffb",
            "gelu_backward_fbf",
            "gelu_backward_fbb",
            "gelu_backward_bff",
            "gelu_backward_bfb",
            "gelu_backward_bbf",
            "gelu_backward_bbb",
            "swiglu_forward_ff",
            "swiglu_forward_fb",
            "swiglu_forward_bf",
            "swiglu_forward_bb",
            "swiglu_backward_fff",
            "swiglu_backward_ffb",
            "swiglu_backward_fbf",
            "swiglu_backward_fbb",
            "swiglu_backward_bff",
            "swiglu_backward_bfb",
            "swiglu_backward_bbf",
            "swiglu_backward_bbb"
        ]
    ),
    family!(
        "elementwise",
        [
            "add_f32",
            "bias_add",
            "sum_rows",
            "sum_rows_bf16x",
            "sum_rows_bf16x4",
            "sum_rows_cast",
            "sum_rows_cast4",
            "scale_by_device_scalar",
            "grad_accumulate",
            "cast_f32_bf16"
        ]
    ),
    family!("rope", ["rope_table", "rope_rotate", "rope_rotate_bf16"]),
    family!(
        "attention",
        [
            "attn_split_qkv",
            "attn_merge_qkv",
            "attn_permute_heads",
            "attn_softmax_causal",
            "attn_softmax_causal_backward",
        ]
    ),
    family!(
        "flash_attention_tc",
        prelude "flash_common.cuh",
        [
            "flash_attn_tc_fwd_d32",
            "flash_attn_tc_bwd_dkdv_d32",
            "flash_attn_tc_bwd_dq_d32",
            "flash_attn_tc_fwd_d64",
            "flash_attn_tc_bwd_dkdv_d64",
            "flash_attn_tc_bwd_dq_d64",
            "flash_attn_tc_fwd_bf16out_d32",
            "flash_attn_tc_fwd_bf16out_d64",
            "flash_attn_tc_fwd_d128",
            "flash_attn_tc_bwd_dkdv_d128",
            "flash_attn_tc_bwd_dq_d128",
            "flash_attn_tc_fwd_bf16out_d128",
            "flash_attn_tc_delta",
        ]
    ),
    family!(
        "flash_attention_wgmma",
        prelude "flash_common.cuh",
        [
            "flash_attn_wg_fwd_d64",
            "flash_attn_wg_fwd_bf16out_d64",
            "flash_attn_wg_bwd_dkdv_d64",
            "flash_attn_wg_bwd_dq_d64",
            "flash_attn_wg_fwd_d128",
            "flash_attn_wg_fwd_bf16out_d128",
            "flash_attn_wg_bwd_dkdv_d128",
            "flash_attn_wg_bwd_dq_d128",
        ]
    ),
    family!(
        "cross_entropy",
        [
            "xent_mean",
            "xent_backward",
            "xent_backward_bf16",
            "xent_row_loss",
            "xent_row_loss_bf16x",
            "xent_backward_bf16x_bf16"
        ]
    ),
    family!(
        "reduce",
        ["sumsq_partials", "grad_norm_finalize", "rms_finalize"]
    ),
    family!("soap", ["soap_adam_eigen", "soap_apply"]),
    family!(
        "kl_shampoo",
        [
            "kl_momentum",
            "kl_inv_sqrt",
            "kl_scale",
            "kl_precondition",
            "kl_eig_rows",
            "kl_eig_cols",
            "kl_apply"
        ]
    ),
    family!(
        "shampoo",
        [
            "shampoo_moments",
            "shampoo_graft_partials",
            "shampoo_graft_scale",
            "shampoo_graft_apply",
            "shampoo_apply"
        ]
    ),
    family!(
        "refresh",
        [
            "add_diag",
            "eigvecs_descending",
            "column_dots",
            "gather_cols_transpose",
            "permute_rows",
            "permute_cols",
            "count_nonfinite",
            "argsort_desc",
            "abs_max_bits",
            "first_nonzero_info",
            "add_diag_rel",
            "unit_lower_from_chol",
            "lower_identity_error_bits",
            "split_tf32",
            "newton_schulz_poly",
            "inverse_root_scale_cols"
        ]
    ),
];

/// What follows `extern "C" __global__ void ` once an optional `__launch_bounds__(...)` is
/// skipped: the kernel's name and parameter list.
fn after_qualifiers(rest: &str) -> &str {
    const BOUNDS: &str = "__launch_bounds__(";
    let rest = rest.trim_start();
    match rest.strip_prefix(BOUNDS) {
        Some(tail) => tail
            .find(')')
            .map_or(rest, |end| &tail[end + 1..])
            .trim_start(),
        None => rest,
    }
}

/// The names declared `extern "C" __global__ void [__launch_bounds__(..)] NAME(` in `source`,
/// in order.
pub fn extern_c_names(source: &str) -> Vec<String> {
    const MARK: &str = "extern \"C\" __global__ void ";
    source
        .match_indices(MARK)
        .filter_map(|(i, _)| {
            let rest = after_qualifiers(&source[i + MARK.len()..]);
            rest.find('(').map(|end| rest[..end].trim().to_string())
        })
        .collect()
}

/// The C type class of one kernel parameter, as far as the launch ABI cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgKind {
    /// Any pointer (8 bytes).
    Ptr,
    /// `int`.
    I32,
    /// `long long`.
    I64,
    /// `float`.
    F32,
    /// `double`.
    F64,
}

/// Every `extern "C"` kernel of `source` with its parameter kinds, in order. A parameter of a
/// type other than a pointer, `int`, `long long`, `float` or `double` is an error naming it.
pub fn kernel_signatures(source: &str) -> std::result::Result<Vec<(String, Vec<ArgKind>)>, String> {
    const MARK: &str = "extern \"C\" __global__ void ";
    let mut out = Vec::new();
    for (i, _) in source.match_indices(MARK) {
        let rest = after_qualifiers(&source[i + MARK.len()..]);
        let open = rest.find('(').ok_or("no parameter list")?;
        let close = rest.find(')').ok_or("unclosed parameter list")?;
        let name = rest[..open].trim().to_string();
        let mut kinds = Vec::new();
        for param in rest[open + 1..close].split(',') {
            let p = param.split_whitespace().collect::<Vec<_>>().join(" ");
            let kind = if p.contains('*') {
                ArgKind::Ptr
            } else if p.starts_with("long long ") {
                ArgKind::I64
            } else if p.starts_with("int ") {
                ArgKind::I32
            } else if p.starts_with("float ") {
                ArgKind::F32
            } else if p.starts_with("double ") {
                ArgKind::F64
            } else {
                return Err(format!("kernel `{name}`: unsupported parameter `{p}`"));
            };
            kinds.push(kind);
        }
        out.push((name, kinds));
    }
    Ok(out)
}

/// The family that defines `kernel`.
pub fn family_of(kernel: &str) -> Option<&'static Family> {
    FAMILIES.iter().find(|f| f.kernels.contains(&kernel))
}

/// How one family was loaded at start-up.
#[derive(Clone, Debug)]
pub struct FamilyLoad {
    /// The family.
    pub family: &'static str,
    /// Where its CUBIN came from (`None` when it failed).
    pub origin: Option<Origin>,
    /// Wall time of compile (or cache read) and module load, ms.
    pub ms: f64,
    /// The failure, if any.
    pub error: Option<String>,
}

/// Loaded kernels by name. A family that fails to compile or load leaves its kernels
/// unavailable (launching one is [`CudaError::KernelUnavailable`]) without failing the others.
pub(crate) struct Kernels {
    funcs: HashMap<&'static str, CudaFunction>,
    signatures: HashMap<String, Vec<ArgKind>>,
    failed: HashMap<&'static str, String>,
    pub(crate) loads: Vec<FamilyLoad>,
}

impl Kernels {
    pub(crate) fn load(
        ctx: &Arc<CudaContext>,
        arch: &str,
        options: &[String],
        cache: Option<&Path>,
    ) -> Kernels {
        let mut k = Kernels {
            funcs: HashMap::new(),
            signatures: HashMap::new(),
            failed: HashMap::new(),
            loads: Vec::new(),
        };
        for fam in FAMILIES {
            match kernel_signatures(fam.source) {
                Ok(sigs) => k.signatures.extend(sigs),
                Err(e) => tracing::error!("kernel family `{}`: {e}", fam.name),
            }
            let t0 = Instant::now();
            let source = format!("{COMMON}\n#line 1 \"{}.cu\"\n{}", fam.name, fam.source);
            let loaded = nvrtc::load_or_compile(fam.name, &source, arch, options, cache).and_then(
                |(cubin, origin)| {
                    let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin))?;
                    let funcs = fam
                        .kernels
                        .iter()
                        .map(|&name| Ok((name, module.load_function(name)?)))
                        .collect::<Result<Vec<_>>>()?;
                    Ok((funcs, origin))
                },
            );
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            match loaded {
                Ok((funcs, origin)) => {
                    k.funcs.extend(funcs);
                    k.loads.push(FamilyLoad {
                        family: fam.name,
                        origin: Some(origin),
                        ms,
                        error: None,
                    });
                }
                Err(e) => {
                    tracing::error!("kernel family `{}`: {e}", fam.name);
                    k.failed.insert(fam.name, e.to_string());
                    k.loads.push(FamilyLoad {
                        family: fam.name,
                        origin: None,
                        ms,
                        error: Some(e.to_string()),
                    });
                }
            }
        }
        k
    }

    /// The loaded function of `kernel`, after checking that `args` match its parameter list
    /// (count and kinds), so a launcher bug is an error instead of a garbage launch.
    pub(crate) fn get(&self, kernel: &'static str, args: &Args) -> Result<&CudaFunction> {
        if let Some(f) = self.funcs.get(kernel) {
            return match self.signatures.get(kernel) {
                Some(sig) if *sig == args.kinds => Ok(f),
                sig => Err(CudaError::Invalid {
                    op: kernel,
                    what: format!(
                        "launch arguments {:?} do not match the kernel's parameters {sig:?}",
                        args.kinds
                    ),
                }),
            };
        }
        let family = family_of(kernel).map_or("?", |f| f.name);
        let reason = self
            .failed
            .get(family)
            .cloned()
            .unwrap_or_else(|| "no such kernel".to_string());
        Err(CudaError::KernelUnavailable {
            kernel,
            family,
            reason,
        })
    }
}

/// Kernel arguments packed into 8-byte slots (little-endian: a 4-byte parameter reads the low
/// half of its slot), so the values live until the launch copies them.
#[derive(Debug, Default)]
pub(crate) struct Args {
    pub(crate) slots: Vec<u64>,
    pub(crate) kinds: Vec<ArgKind>,
}

impl Args {
    pub(crate) fn new() -> Args {
        Args {
            slots: Vec::with_capacity(16),
            kinds: Vec::with_capacity(16),
        }
    }
    fn push(mut self, v: u64, k: ArgKind) -> Args {
        self.slots.push(v);
        self.kinds.push(k);
        self
    }
    /// A pointer parameter.
    pub(crate) fn buf(self, b: &Buf) -> Args {
        self.push(b.ptr(), ArgKind::Ptr)
    }
    /// A nullable pointer parameter.
    pub(crate) fn opt(self, b: Option<&Buf>) -> Args {
        self.push(b.map_or(0, Buf::ptr), ArgKind::Ptr)
    }
    /// An `int` parameter.
    pub(crate) fn i32(self, v: i32) -> Args {
        self.push(v as u32 as u64, ArgKind::I32)
    }
    /// A `long long` parameter.
    pub(crate) fn i64(self, v: i64) -> Args {
        self.push(v as u64, ArgKind::I64)
    }
    /// A `float` parameter.
    pub(crate) fn f32(self, v: f32) -> Args {
        self.push(v.to_bits() as u64, ArgKind::F32)
    }
    /// A `double` parameter.
    pub(crate) fn f64(self, v: f64) -> Args {
        self.push(v.to_bits(), ArgKind::F64)
    }
}
