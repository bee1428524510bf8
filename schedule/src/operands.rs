//! Operand lists of plan ops and host tasks: every buffer an op or a task names, with its
//! field name (what the plan verifier, the memory planner and the engines iterate over).
use crate::{BufferId, HostTask, Op};

impl Op {
    /// Short snake_case name of the op (as in the JSON `op` tag).
    pub fn name(&self) -> &'static str {
        match self {
            Op::Embedding { .. } => "embedding",
            Op::EmbeddingBackward { .. } => "embedding_backward",
            Op::AddPositional { .. } => "add_positional",
            Op::AddPositionalBackward { .. } => "add_positional_backward",
            Op::LayerNorm { .. } => "layer_norm",
            Op::LayerNormBackward { .. } => "layer_norm_backward",
            Op::RmsNorm { .. } => "rms_norm",
            Op::RmsNormBackward { .. } => "rms_norm_backward",
            Op::MatMul { .. } => "mat_mul",
            Op::MatMulBias { .. } => "mat_mul_bias",
            Op::BiasAdd { .. } => "bias_add",
            Op::SumRows { .. } => "sum_rows",
            Op::SumRowsCast { .. } => "sum_rows_cast",
            Op::Add { .. } => "add",
            Op::Cast { .. } => "cast",
            Op::Gelu { .. } => "gelu",
            Op::GeluBackward { .. } => "gelu_backward",
            Op::SwiGlu { .. } => "swi_glu",
            Op::SwiGluBackward { .. } => "swi_glu_backward",
            Op::Rope { .. } => "rope",
            Op::RopeBackward { .. } => "rope_backward",
            Op::Attention { .. } => "attention",
            Op::AttentionBackward { .. } => "attention_backward",
            Op::CrossEntropy { .. } => "cross_entropy",
            Op::CrossEntropyBackward { .. } => "cross_entropy_backward",
            Op::ClipGradNorm { .. } => "clip_grad_norm",
            Op::GradSumSquares { .. } => "grad_sum_squares",
            Op::ScaleByScalar { .. } => "scale_by_scalar",
            Op::GradAccumulate { .. } => "grad_accumulate",
            Op::AdamW { .. } => "adam_w",
            Op::SoapUpdate { .. } => "soap_update",
            Op::SoapFactorUpdate { .. } => "soap_factor_update",
            Op::ShampooFactorUpdate { .. } => "shampoo_factor_update",
            Op::ShampooPrecondition { .. } => "shampoo_precondition",
            Op::Graft { .. } => "graft",
            Op::KlScale { .. } => "kl_scale",
            Op::KlFactorUpdate { .. } => "kl_factor_update",
            Op::KlShampooUpdate { .. } => "kl_shampoo_update",
            Op::ShampooUpdate { .. } => "shampoo_update",
            Op::ElementwiseUpdate { .. } => "elementwise_update",
            Op::Project { .. } => "project",
            Op::BlockCopy { .. } => "block_copy",
            Op::BlockWrite { .. } => "block_write",
            Op::CopyIn { .. } => "copy_in",
            Op::CopyOut { .. } => "copy_out",
        }
    }

    /// Whether the op runs on the host, where its (host-tier) operands live: an `adam_w` that
    /// `tier-placement` placed there under `host_updates`.
    pub fn on_host(&self) -> bool {
        matches!(self, Op::AdamW { on_host: true, .. })
    }

    /// Every buffer operand with its field name (optional operands only when present).
    pub fn operands(&self) -> Vec<(&'static str, BufferId)> {
        let mut v: Vec<(&'static str, BufferId)> = Vec::new();
        let opt = |v: &mut Vec<(&'static str, BufferId)>, n: &'static str, b: &Option<BufferId>| {
            if let Some(b) = b {
                v.push((n, *b));
            }
        };
        match self {
            Op::Embedding { table, ids, out } => {
                v.extend([("table", *table), ("ids", *ids), ("out", *out)])
            }
            Op::EmbeddingBackward { dout, ids, dtable } => {
                v.extend([("dout", *dout), ("ids", *ids), ("dtable", *dtable)])
            }
            Op::AddPositional { x, pos, out, .. } => {
                v.extend([("x", *x), ("pos", *pos), ("out", *out)])
            }
            Op::AddPositionalBackward { dout, dpos, .. } => {
                v.extend([("dout", *dout), ("dpos", *dpos)])
            }
            Op::LayerNorm {
                x,
                weight,
                bias,
                out,
                ..
            } => {
                v.extend([("x", *x), ("weight", *weight), ("out", *out)]);
                opt(&mut v, "bias", bias);
            }
            Op::LayerNormBackward {
                dout,
                x,
                weight,
                dx,
                dweight,
                dbias,
                ..
            } => {
                v.extend([
                    ("dout", *dout),
                    ("x", *x),
                    ("weight", *weight),
                    ("dx", *dx),
                    ("dweight", *dweight),
                ]);
                opt(&mut v, "dbias", dbias);
            }
            Op::RmsNorm { x, weight, out, .. } => {
                v.extend([("x", *x), ("weight", *weight), ("out", *out)])
            }
            Op::RmsNormBackward {
                dout,
                x,
                weight,
                dx,
                dweight,
                ..
            } => v.extend([
                ("dout", *dout),
                ("x", *x),
                ("weight", *weight),
                ("dx", *dx),
                ("dweight", *dweight),
            ]),
            Op::MatMul { a, b, out, .. } => v.extend([("a", *a), ("b", *b), ("out", *out)]),
            Op::MatMulBias {
                a, b, bias, out, ..
            } => v.extend([("a", *a), ("b", *b), ("bias", *bias), ("out", *out)]),
            Op::BiasAdd { x, bias, out } => v.extend([("x", *x), ("bias", *bias), ("out", *out)]),
            Op::SumRows { x, out } => v.extend([("x", *x), ("out", *out)]),
            Op::SumRowsCast { x, out, out_bf16 } => {
                v.extend([("x", *x), ("out", *out), ("out_bf16", *out_bf16)])
            }
            Op::Add { a, b, out } => v.extend([("a", *a), ("b", *b), ("out", *out)]),
            Op::Cast { x, out } | Op::Gelu { x, out } | Op::SwiGlu { x, out } => {
                v.extend([("x", *x), ("out", *out)])
            }
            Op::GeluBackward { dout, x, dx } | Op::SwiGluBackward { dout, x, dx } => {
                v.extend([("dout", *dout), ("x", *x), ("dx", *dx)])
            }
            Op::Rope { x, out, .. } => v.extend([("x", *x), ("out", *out)]),
            Op::RopeBackward { dout, dx, .. } => v.extend([("dout", *dout), ("dx", *dx)]),
            Op::Attention { qkv, out, lse, .. } => {
                v.extend([("qkv", *qkv), ("out", *out)]);
                opt(&mut v, "lse", lse);
            }
            Op::AttentionBackward {
                dout,
                qkv,
                fwd_out,
                lse,
                dqkv,
                ..
            } => {
                v.extend([("dout", *dout), ("qkv", *qkv), ("dqkv", *dqkv)]);
                opt(&mut v, "fwd_out", fwd_out);
                opt(&mut v, "lse", lse);
            }
            Op::CrossEntropy {
                logits,
                targets,
                loss,
            } => v.extend([("logits", *logits), ("targets", *targets), ("loss", *loss)]),
            Op::CrossEntropyBackward {
                logits,
                targets,
                dlogits,
            } => v.extend([
                ("logits", *logits),
                ("targets", *targets),
                ("dlogits", *dlogits),
            ]),
            Op::ClipGradNorm {
                grads,
                norm,
                scale,
                partials,
                ..
            } => {
                v.extend(grads.iter().map(|g| ("grads", *g)));
                v.push(("norm", *norm));
                v.extend(scale.map(|s| ("scale", s)));
                opt(&mut v, "partials", partials);
            }
            Op::GradSumSquares { grad, partials, .. } => {
                v.extend([("grad", *grad), ("partials", *partials)])
            }
            Op::ScaleByScalar { x, scale } => v.extend([("x", *x), ("scale", *scale)]),
            Op::GradAccumulate { micro, total, .. } => {
                v.extend([("micro", *micro), ("total", *total)])
            }
            Op::AdamW {
                param,
                grad,
                exp_avg,
                exp_avg_sq,
                grad_scale,
                ..
            } => {
                v.extend([
                    ("param", *param),
                    ("grad", *grad),
                    ("exp_avg", *exp_avg),
                    ("exp_avg_sq", *exp_avg_sq),
                ]);
                v.extend(grad_scale.map(|s| ("grad_scale", s)));
            }
            Op::SoapUpdate {
                param,
                grad,
                exp_avg,
                exp_avg_sq,
                basis_left,
                basis_right,
                ..
            } => {
                v.extend([
                    ("param", *param),
                    ("grad", *grad),
                    ("exp_avg", *exp_avg),
                    ("exp_avg_sq", *exp_avg_sq),
                ]);
                opt(&mut v, "basis_left", basis_left);
                opt(&mut v, "basis_right", basis_right);
            }
            Op::SoapFactorUpdate {
                grad,
                factor_left,
                factor_right,
                ..
            } => {
                v.push(("grad", *grad));
                opt(&mut v, "factor_left", factor_left);
                opt(&mut v, "factor_right", factor_right);
            }
            Op::ShampooFactorUpdate { grad, factors, .. } => {
                v.push(("grad", *grad));
                v.extend(factors.iter().map(|f| ("factor", *f)));
            }
            Op::ShampooPrecondition { x, out, roots, .. } => {
                v.extend([("x", *x), ("out", *out)]);
                v.extend(roots.iter().map(|r| ("root", *r)));
            }
            Op::Graft { x, graft, out, .. } => {
                v.extend([("x", *x), ("graft", *graft), ("out", *out)]);
            }
            Op::KlScale {
                x,
                out,
                eig_left,
                eig_right,
                ..
            } => v.extend([
                ("x", *x),
                ("out", *out),
                ("eig_left", *eig_left),
                ("eig_right", *eig_right),
            ]),
            Op::KlFactorUpdate {
                grad,
                factor_left,
                factor_right,
                basis_left,
                basis_right,
                eig_left,
                eig_right,
                ..
            } => {
                v.push(("grad", *grad));
                opt(&mut v, "factor_left", factor_left);
                opt(&mut v, "factor_right", factor_right);
                opt(&mut v, "basis_left", basis_left);
                opt(&mut v, "basis_right", basis_right);
                v.extend([("eig_left", *eig_left), ("eig_right", *eig_right)]);
            }
            Op::KlShampooUpdate {
                param,
                grad,
                exp_avg,
                factor_left,
                factor_right,
                basis_left,
                basis_right,
                eig_left,
                eig_right,
                ..
            } => {
                v.extend([("param", *param), ("grad", *grad), ("exp_avg", *exp_avg)]);
                opt(&mut v, "factor_left", factor_left);
                opt(&mut v, "factor_right", factor_right);
                opt(&mut v, "basis_left", basis_left);
                opt(&mut v, "basis_right", basis_right);
                v.extend([("eig_left", *eig_left), ("eig_right", *eig_right)]);
            }
            Op::ShampooUpdate {
                param,
                grad,
                exp_avg,
                graft_sq,
                factors,
                roots,
                ..
            } => {
                v.extend([("param", *param), ("grad", *grad), ("exp_avg", *exp_avg)]);
                opt(&mut v, "graft_sq", graft_sq);
                v.extend(factors.iter().map(|f| ("factor", *f)));
                v.extend(roots.iter().map(|r| ("root", *r)));
            }
            Op::ElementwiseUpdate {
                param,
                grad,
                state,
                results,
                ..
            } => {
                v.extend([("param", *param), ("grad", *grad)]);
                v.extend(state.iter().map(|s| ("state", *s)));
                v.extend(results.iter().map(|r| ("result", *r)));
            }
            Op::Project {
                x,
                out,
                basis_left,
                basis_right,
                ..
            } => {
                v.extend([("x", *x), ("out", *out)]);
                opt(&mut v, "basis_left", basis_left);
                opt(&mut v, "basis_right", basis_right);
            }
            Op::BlockCopy { src, dst, .. } | Op::BlockWrite { src, dst, .. } => {
                v.extend([("src", *src), ("dst", *dst)])
            }
            Op::CopyIn { src, dst, .. } | Op::CopyOut { src, dst } => {
                v.extend([("src", *src), ("dst", *dst)])
            }
        }
        v
    }
}

impl HostTask {
    /// Every buffer operand with its field name.
    pub fn operands(&self) -> Vec<(&'static str, BufferId)> {
        match self {
            HostTask::EigenbasisRefresh {
                factor,
                basis,
                exp_avg,
                exp_avg_sq,
                ..
            } => vec![
                ("factor", *factor),
                ("basis", *basis),
                ("exp_avg", *exp_avg),
                ("exp_avg_sq", *exp_avg_sq),
            ],
        }
    }
}
