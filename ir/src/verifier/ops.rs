//! Per-op rules of the verifier: operand roles and counts, dtypes and shapes (ported from the
//! plan verifier, `schedule/src/verify.rs`, so a verified module lowers to a plan that
//! verifies), the markers, and which `state` buffers in-place optimizer ops may update.
use super::ctx::{Ctx, R};
use super::{describe, Verifier, VerifierError};
use crate::module::{InstId, ValueId};
use crate::op::{Op, Section};
use schedule::{BufferClass, DType, RefreshMethod};

/// Argument roles of `op` given `found` arguments, or the allowed count(s) as text.
fn arg_roles(op: &Op, found: usize) -> Result<Vec<&'static str>, String> {
    let exact: Vec<&'static str> = match op {
        Op::LayerNorm { .. } => {
            return match found {
                2 => Ok(vec!["x", "weight"]),
                3 => Ok(vec!["x", "weight", "bias"]),
                _ => Err("2 (x, weight) or 3 (x, weight, bias)".into()),
            }
        }
        Op::ClipGradNorm { .. } => {
            return if found >= 1 {
                Ok(vec!["grads"; found])
            } else {
                Err("at least 1 (the gradients)".into())
            };
        }
        Op::SoapUpdate { left, right, .. } => {
            let mut v = vec!["param", "grad", "exp_avg", "exp_avg_sq"];
            v.extend(left.then_some("basis_left"));
            v.extend(right.then_some("basis_right"));
            v
        }
        Op::KlShampooUpdate { left, right, .. } => {
            let mut v = vec!["param", "grad", "exp_avg", "eig_left", "eig_right"];
            if *left {
                v.extend(["factor_left", "basis_left"]);
            }
            if *right {
                v.extend(["factor_right", "basis_right"]);
            }
            v
        }
        Op::ShampooUpdate { hyper } => {
            let head = if hyper.grafting { 4 } else { 3 };
            if found < head + 2 || (found - head) % 2 != 0 {
                return Err(format!(
                    "{head} (param, grad, exp_avg{}) plus one (factor, root) pair per block side",
                    if hyper.grafting { ", graft_sq" } else { "" }
                ));
            }
            let mut v = vec!["param", "grad", "exp_avg"];
            v.extend(hyper.grafting.then_some("graft_sq"));
            for _ in 0..(found - head) / 2 {
                v.extend(["factor", "root"]);
            }
            v
        }
        Op::Project { left, right, .. } => {
            let mut v = vec!["x"];
            v.extend(left.then_some("basis_left"));
            v.extend(right.then_some("basis_right"));
            v
        }
        Op::BlockCopy { .. } => vec!["src"],
        Op::BlockWrite { .. } => vec!["dst", "src"],
        Op::ShampooFactorUpdate { .. } if found >= 2 => {
            let mut v = vec!["grad"];
            v.extend(std::iter::repeat("factor").take(found - 1));
            v
        }
        Op::ShampooPrecondition { .. } if found >= 2 => {
            let mut v = vec!["x"];
            v.extend(std::iter::repeat("root").take(found - 1));
            v
        }
        Op::ShampooFactorUpdate { .. } => {
            return Err("1 (grad) plus one factor per block side".into())
        }
        Op::ShampooPrecondition { .. } => return Err("1 (x) plus one root per block side".into()),
        Op::Graft { .. } => vec!["x", "graft"],
        Op::KlScale { .. } => vec!["x", "eig_left", "eig_right"],
        Op::KlFactorUpdate { left, right, .. } => {
            let mut v = vec!["grad", "eig_left", "eig_right"];
            if *left {
                v.extend(["factor_left", "basis_left"]);
            }
            if *right {
                v.extend(["factor_right", "basis_right"]);
            }
            v
        }
        Op::SoapFactorUpdate { left, right, .. } => {
            let mut v = vec!["grad"];
            v.extend(left.then_some("factor_left"));
            v.extend(right.then_some("factor_right"));
            v
        }
        Op::State { .. } | Op::Input { .. } => vec![],
        Op::Loss => vec!["loss"],
        Op::GradOf => vec!["param", "grad"],
        Op::Embedding => vec!["table", "ids"],
        Op::EmbeddingBackward => vec!["dout", "ids", "table"],
        Op::AddPositional { .. } => vec!["x", "pos"],
        Op::AddPositionalBackward { .. } => vec!["dout", "pos"],
        Op::LayerNormBackward { .. } | Op::RmsNormBackward { .. } => vec!["dout", "x", "weight"],
        Op::RmsNorm { .. } => vec!["x", "weight"],
        Op::MatMul { .. } | Op::Add => vec!["a", "b"],
        Op::MatMulBias { .. } => vec!["a", "b", "bias"],
        Op::BiasAdd => vec!["x", "bias"],
        Op::SumRows | Op::SumRowsCast | Op::Cast | Op::Gelu | Op::SwiGlu | Op::Rope { .. } => {
            vec!["x"]
        }
        Op::GeluBackward | Op::SwiGluBackward => vec!["dout", "x"],
        Op::RopeBackward { .. } => vec!["dout"],
        Op::Attention { .. } => vec!["qkv"],
        Op::AttentionBackward { .. } => {
            return match found {
                2 => Ok(vec!["dout", "qkv"]),
                4 => Ok(vec!["dout", "qkv", "fwd_out", "lse"]),
                _ => Err("2 (dout, qkv) or 4 (dout, qkv, fwd_out, lse)".into()),
            }
        }
        Op::CrossEntropy | Op::CrossEntropyBackward => vec!["logits", "targets"],
        Op::AdamW { .. } => {
            return match found {
                4 => Ok(vec!["param", "grad", "exp_avg", "exp_avg_sq"]),
                5 => Ok(vec!["param", "grad", "exp_avg", "exp_avg_sq", "grad_scale"]),
                _ => Err("4 (param, grad, exp_avg, exp_avg_sq) or 5 (and grad_scale)".into()),
            }
        }
        Op::EigenbasisRefresh {
            method: RefreshMethod::Soap,
            ..
        } => vec!["factor", "basis", "exp_avg", "exp_avg_sq"],
        Op::EigenbasisRefresh {
            method: RefreshMethod::Qr,
            ..
        } => vec!["factor", "basis", "exp_avg"],
        Op::EigenbasisRefresh {
            method: RefreshMethod::InverseRoot,
            ..
        } => vec!["factor", "basis"],
        Op::ElementwiseUpdate { rule } => {
            let mut v = vec!["param", "grad"];
            v.extend(std::iter::repeat("state").take(rule.state.len()));
            v
        }
    };
    match found == exact.len() {
        true => Ok(exact),
        false => Err(match op {
            Op::SoapUpdate { .. }
            | Op::SoapFactorUpdate { .. }
            | Op::KlShampooUpdate { .. }
            | Op::KlFactorUpdate { .. }
            | Op::Project { .. } => {
                format!("{} (given `left` / `right`)", exact.len())
            }
            Op::EigenbasisRefresh { method, .. } => {
                format!("{} (given `method = {method}`)", exact.len())
            }
            Op::ElementwiseUpdate { .. } => {
                format!("{} (param, grad and the rule's `state`)", exact.len())
            }
            _ => exact.len().to_string(),
        }),
    }
}

/// Result roles of `op` given `found` results (`attention` has 1 or 2).
fn result_roles(op: &Op, found: usize) -> Vec<&'static str> {
    match op {
        Op::Attention { .. } if found == 2 => vec!["out", "lse"],
        Op::State { .. } | Op::Input { .. } => vec!["value"],
        Op::LayerNormBackward { bias: true, .. } => vec!["dx", "dweight", "dbias"],
        Op::LayerNormBackward { bias: false, .. } | Op::RmsNormBackward { .. } => {
            vec!["dx", "dweight"]
        }
        Op::EmbeddingBackward => vec!["dtable"],
        Op::AddPositionalBackward { .. } => vec!["dpos"],
        Op::GeluBackward | Op::SwiGluBackward | Op::RopeBackward { .. } => vec!["dx"],
        Op::AttentionBackward { .. } => vec!["dqkv"],
        Op::CrossEntropy => vec!["loss"],
        Op::CrossEntropyBackward => vec!["dlogits"],
        Op::ClipGradNorm { .. } if found == 2 => vec!["norm", "scale"],
        Op::ClipGradNorm { .. } => vec!["norm"],
        Op::SumRowsCast => vec!["out", "out_bf16"],
        Op::ElementwiseUpdate { rule } => vec!["result"; rule.results.len()],
        Op::Loss
        | Op::GradOf
        | Op::AdamW { .. }
        | Op::SoapUpdate { .. }
        | Op::SoapFactorUpdate { .. }
        | Op::KlShampooUpdate { .. }
        | Op::ShampooUpdate { .. }
        | Op::ShampooFactorUpdate { .. }
        | Op::KlFactorUpdate { .. }
        | Op::BlockWrite { .. }
        | Op::EigenbasisRefresh { .. } => vec![],
        _ => vec!["out"],
    }
}

/// Checks one instruction whose arguments are all defined values.
pub(super) fn check_inst(v: &Verifier<'_>, id: InstId) -> R {
    let m = v.m;
    let inst = m.inst(id);
    let at = describe(m, id);
    let roles =
        arg_roles(&inst.op, inst.args.len()).map_err(|expected| VerifierError::ArgCount {
            inst: id,
            at: at.clone(),
            expected,
            found: inst.args.len(),
        })?;
    let results = result_roles(&inst.op, inst.results.len());
    if results.len() != inst.results.len() {
        let (expected, found) = (results.len().to_string(), inst.results.len());
        return Err(VerifierError::ResultCount {
            inst: id,
            at,
            expected,
            found,
        });
    }
    let operands = roles
        .into_iter()
        .zip(inst.args.iter().copied())
        .chain(results.into_iter().zip(inst.results.iter().copied()));
    let c = Ctx {
        v,
        id,
        at,
        operands: operands.collect(),
    };
    for &(role, val) in &c.operands {
        // The plan's rule (`schedule::operand_dtypes`), plus IR-only `input` values (i32).
        let allowed: &[DType] = match inst.op {
            Op::Input { .. } => &[DType::I32],
            _ => schedule::operand_dtypes(inst.op.name(), role),
        };
        if !allowed.contains(&m.value(val).ty.dtype) {
            let names: Vec<&str> = allowed.iter().map(|d| d.name()).collect();
            return Err(c.fail_value(role, val, format!("must be {}", names.join(" or "))));
        }
    }
    check_shapes(&c, &inst.op)
}

fn check_shapes(c: &Ctx<'_, '_>, op: &Op) -> R {
    let m = c.v.m;
    match *op {
        Op::State { .. } => {}
        Op::Input { role } => {
            let n = m
                .config
                .data
                .batch_size
                .saturating_mul(m.config.data.seq_len);
            c.dims("value", &[n])?;
            let earlier = m
                .section(Section::State)
                .take_while(|&i| i != c.id)
                .find(|&i| m.inst(i).op == *op);
            if let Some(first) = earlier {
                return Err(c.attr(format!(
                    "a second `{}` input (the first is {first})",
                    crate::printer::role_keyword(role)
                )));
            }
        }
        Op::Loss => {
            c.dims("loss", &[1])?;
            let (id, _) = c.get("loss")?;
            if c.v
                .def(id)
                .is_some_and(|d| m.inst(d).section != Section::Forward)
            {
                let problem = format!(
                    "the loss {} must be computed in the forward section",
                    m.display_value(id)
                );
                return Err(VerifierError::Marker {
                    inst: c.id,
                    at: c.at.clone(),
                    problem,
                });
            }
        }
        Op::GradOf => {
            c.class("param", BufferClass::Parameter)?;
            c.same("param", "grad")?;
        }
        Op::Embedding => {
            let (_, ch) = c.rank2("table")?;
            let n = c.get("ids")?.1.numel();
            c.dims("out", &[n, ch])?;
        }
        Op::EmbeddingBackward => {
            let (_, ch) = c.rank2("table")?;
            let n = c.get("ids")?.1.numel();
            c.dims("dout", &[n, ch])?;
            c.same("table", "dtable")?;
        }
        Op::AddPositional { seq_len } | Op::AddPositionalBackward { seq_len } => {
            let x = if matches!(op, Op::AddPositional { .. }) {
                "x"
            } else {
                "dout"
            };
            let (n, ch) = c.rank2(x)?;
            let (p, pc) = c.rank2("pos")?;
            if pc != ch || seq_len == 0 || seq_len > p || n % seq_len != 0 {
                return Err(c.fail(
                    "pos",
                    format!("incompatible with {x} [{n}, {ch}] and seq_len {seq_len}"),
                ));
            }
            match op {
                Op::AddPositional { .. } => c.same("x", "out")?,
                _ => c.same("pos", "dpos")?,
            }
        }
        Op::LayerNorm { .. } | Op::RmsNorm { .. } => {
            let (_, ch) = c.rank2("x")?;
            c.dims("weight", &[ch])?;
            if c.get("bias").is_ok() {
                c.dims("bias", &[ch])?;
            }
            c.same("x", "out")?;
            // The bf16 LayerNorm kernels are warp-per-row; RMSNorm's bf16 kernel takes any row.
            let layer_norm = matches!(op, Op::LayerNorm { .. });
            if layer_norm
                && c.get("out")?.1.dtype == DType::Bf16
                && ch > schedule::BF16_LAYERNORM_MAX_C
            {
                return Err(c.fail(
                    "out",
                    format!(
                        "may be bf16 only for rows of at most {} (this has {ch})",
                        schedule::BF16_LAYERNORM_MAX_C
                    ),
                ));
            }
        }
        Op::LayerNormBackward { .. } | Op::RmsNormBackward { .. } => {
            let (_, ch) = c.rank2("x")?;
            c.dims("weight", &[ch])?;
            c.dims("dweight", &[ch])?;
            if c.get("dbias").is_ok() {
                c.dims("dbias", &[ch])?;
            }
            c.same("x", "dout")?;
            c.same("x", "dx")?;
        }
        Op::MatMul { trans_a, trans_b } | Op::MatMulBias { trans_a, trans_b } => {
            let (ar, ac) = c.rank2("a")?;
            let (br, bc) = c.rank2("b")?;
            let (rows, k) = if trans_a { (ac, ar) } else { (ar, ac) };
            let (k2, cols) = if trans_b { (bc, br) } else { (br, bc) };
            if k != k2 {
                return Err(c.fail("b", format!("inner dimension {k2} does not match a's {k}")));
            }
            c.dims("out", &[rows, cols])?;
            if matches!(op, Op::MatMulBias { .. }) {
                c.dims("bias", &[cols])?;
            }
        }
        Op::BiasAdd => {
            let (_, ch) = c.rank2("x")?;
            c.dims("bias", &[ch])?;
            c.same("x", "out")?;
        }
        Op::SumRows => {
            let (_, ch) = c.rank2("x")?;
            c.dims("out", &[ch])?;
        }
        Op::SumRowsCast => {
            let (_, ch) = c.rank2("x")?;
            c.dims("out", &[ch])?;
            c.same("x", "out_bf16")?;
        }
        Op::Add => {
            c.same("a", "b")?;
            c.same("a", "out")?;
        }
        Op::Cast | Op::Gelu => c.same("x", "out")?,
        Op::GeluBackward => {
            c.same("x", "dout")?;
            c.same("x", "dx")?;
        }
        Op::SwiGlu | Op::SwiGluBackward => {
            let (n, w) = c.rank2("x")?;
            if w % 2 != 0 {
                return Err(c.fail("x", "must have an even number of columns [gate | up]"));
            }
            match op {
                Op::SwiGlu => c.dims("out", &[n, w / 2])?,
                _ => {
                    c.dims("dout", &[n, w / 2])?;
                    c.same("x", "dx")?;
                }
            }
        }
        Op::Rope {
            seq_len,
            head_dim,
            rotated_cols,
            ..
        }
        | Op::RopeBackward {
            seq_len,
            head_dim,
            rotated_cols,
            ..
        } => {
            let (x, out) = if matches!(op, Op::Rope { .. }) {
                ("x", "out")
            } else {
                ("dout", "dx")
            };
            let (n, w) = c.rank2(x)?;
            if seq_len == 0
                || n % seq_len != 0
                || head_dim == 0
                || head_dim % 2 != 0
                || rotated_cols % head_dim != 0
                || rotated_cols > w
            {
                let p = format!("incompatible with seq_len {seq_len}, head_dim {head_dim}, rotated_cols {rotated_cols}");
                return Err(c.fail(x, p));
            }
            c.same(x, out)?;
        }
        Op::Attention {
            batch,
            seq_len,
            n_heads,
        }
        | Op::AttentionBackward {
            batch,
            seq_len,
            n_heads,
        } => {
            let (n, w) = c.rank2("qkv")?;
            if Some(n) != batch.checked_mul(seq_len)
                || w % 3 != 0
                || n_heads == 0
                || (w / 3) % n_heads != 0
            {
                return Err(c.fail(
                    "qkv",
                    format!(
                        "incompatible with batch {batch}, seq_len {seq_len}, n_heads {n_heads}"
                    ),
                ));
            }
            match op {
                Op::Attention { .. } => {
                    c.dims("out", &[n, w / 3])?;
                    if c.get("lse").is_ok() {
                        c.dims("lse", &[batch * n_heads * seq_len])?;
                    }
                    let head = w / 3 / n_heads;
                    let bf16 = c.get("out")?.1.dtype == DType::Bf16;
                    if bf16 && head > schedule::BF16_ATTENTION_MAX_HEAD_DIM {
                        return Err(c.fail(
                            "out",
                            format!(
                                "may be bf16 only for heads of at most {} (this has {head})",
                                schedule::BF16_ATTENTION_MAX_HEAD_DIM
                            ),
                        ));
                    }
                }
                _ => {
                    c.dims("dout", &[n, w / 3])?;
                    c.same("qkv", "dqkv")?;
                    if c.get("lse").is_ok() {
                        c.dims("fwd_out", &[n, w / 3])?;
                        c.dims("lse", &[batch * n_heads * seq_len])?;
                    }
                }
            }
        }
        Op::CrossEntropy | Op::CrossEntropyBackward => {
            let (n, _) = c.rank2("logits")?;
            c.dims("targets", &[n])?;
            match op {
                Op::CrossEntropy => c.dims("loss", &[1])?,
                _ => c.same("logits", "dlogits")?,
            }
        }
        Op::ClipGradNorm { max_norm } => {
            c.dims("norm", &[1])?;
            if c.operands.iter().any(|o| o.0 == "scale") {
                c.dims("scale", &[1])?;
            }
            if let Some(x) = max_norm.filter(|x| !(x.is_finite() && *x > 0.0)) {
                return Err(c.attr(format!("max_norm must be positive, got {x:?}")));
            }
            for &(_, g) in c.operands.iter().filter(|o| o.0 == "grads") {
                if !c.v.grads.values().any(|&x| x == g) {
                    return Err(c.fail_value("grads", g, "must be a gradient marked by `grad_of`"));
                }
            }
        }
        Op::AdamW { .. } | Op::SoapUpdate { .. } => {
            c.param_and_grad()?;
            for (role, class) in [
                ("exp_avg", BufferClass::ExpAvg),
                ("exp_avg_sq", BufferClass::ExpAvgSq),
            ] {
                c.same("param", role)?;
                c.class(role, class)?;
            }
            c.same("param", "grad")?;
            if c.operands.iter().any(|o| o.0 == "grad_scale") {
                c.dims("grad_scale", &[1])?;
            }
            if let Op::SoapUpdate { left, right, .. } = *op {
                let (l, r) = (left.then_some("basis_left"), right.then_some("basis_right"));
                c.sides("param", l, r)?;
                for role in [l, r].into_iter().flatten() {
                    c.class(role, BufferClass::Eigenbasis)?;
                }
            }
        }
        Op::ElementwiseUpdate { ref rule } => {
            rule.check()
                .map_err(|e| c.attr(format!("update rule: {e}")))?;
            let (g, _) = c.get("grad")?;
            let derived = matches!(
                m.inst(m.value(g).def).op,
                Op::Project { .. }
                    | Op::ElementwiseUpdate { .. }
                    | Op::ShampooPrecondition { .. }
                    | Op::Graft { .. }
                    | Op::KlScale { .. }
            );
            if derived {
                // A composed optimizer's later step: `grad` is computed from the gradient. Its
                // source (through `project`s and earlier updates' results) must be this
                // parameter's gradient, or the same block of it.
                let (p, _) = c.get("param")?;
                let base = c.block_of(p).map_or(p, |b| b.0);
                if c.v.state_class(base) != Some(BufferClass::Parameter) {
                    return Err(c.fail("param", "must be a parameter or a block of one"));
                }
                let src = derived_from(m, g);
                let own = match (c.block_of(p), c.block_of(src)) {
                    (Some((ps, pr, pc)), Some((gs, gr, gc))) => {
                        c.v.grads.get(&ps) == Some(&gs) && (pr, pc) == (gr, gc)
                    }
                    (None, None) => c.v.grads.get(&p) == Some(&src),
                    _ => false,
                };
                if !own {
                    return Err(c.fail(
                        "grad",
                        format!(
                            "is computed from {}, not from the gradient of `param` (or the same \
                             block of it)",
                            m.display_value(src)
                        ),
                    ));
                }
            } else {
                c.param_and_grad()?;
            }
            c.same("param", "grad")?;
            let want = c.shape("param")?;
            for &(_, r) in c.operands.iter().filter(|o| o.0 == "result") {
                if m.value(r).ty.shape != want || m.value(r).ty.dtype != DType::F32 {
                    return Err(c.fail_value(
                        "result",
                        r,
                        format!("must be f32 of the shape {want:?} of `param`"),
                    ));
                }
            }
            for &(_, s) in c.operands.iter().filter(|o| o.0 == "state") {
                if m.value(s).ty.shape != want {
                    return Err(c.fail_value(
                        "state",
                        s,
                        format!("must have the shape {want:?} of `param`"),
                    ));
                }
                if !matches!(
                    c.v.state_class(s),
                    Some(BufferClass::ExpAvg | BufferClass::ExpAvgSq)
                ) {
                    return Err(c.fail_value(
                        "state",
                        s,
                        "must be a `state exp_avg` or `state exp_avg_sq` buffer",
                    ));
                }
            }
        }
        Op::KlShampooUpdate { hyper, left, right } => {
            if !(0.0..1.0).contains(&hyper.shampoo_beta) || !(0.0..1.0).contains(&hyper.beta1) {
                return Err(c.attr(format!(
                    "beta1 and shampoo_beta must be in [0, 1), got {:?} and {:?}",
                    hyper.beta1, hyper.shampoo_beta
                )));
            }
            c.class("param", BufferClass::Parameter)?;
            c.gradient("grad", Some(c.get("param")?.0))?;
            c.same("param", "grad")?;
            c.same("param", "exp_avg")?;
            c.class("exp_avg", BufferClass::ExpAvg)?;
            let (rows, cols) = c.rank2("param")?;
            c.dims("eig_left", &[rows])?;
            c.dims("eig_right", &[cols])?;
            c.class("eig_left", BufferClass::EigenvalueEstimate)?;
            c.class("eig_right", BufferClass::EigenvalueEstimate)?;
            let (fl, fr) = (
                left.then_some("factor_left"),
                right.then_some("factor_right"),
            );
            let (ql, qr) = (left.then_some("basis_left"), right.then_some("basis_right"));
            c.sides("param", fl, fr)?;
            c.sides("param", ql, qr)?;
            for role in [fl, fr].into_iter().flatten() {
                c.class(role, BufferClass::KroneckerFactor)?;
            }
            for role in [ql, qr].into_iter().flatten() {
                c.class(role, BufferClass::Eigenbasis)?;
            }
        }
        Op::ShampooUpdate { hyper } => {
            if !(0.0..1.0).contains(&hyper.beta1) || !(hyper.beta2 > 0.0 && hyper.beta2 <= 1.0) {
                return Err(c.attr(format!(
                    "beta1 must be in [0, 1) and beta2 in (0, 1], got {:?} and {:?}",
                    hyper.beta1, hyper.beta2
                )));
            }
            c.class("param", BufferClass::Parameter)?;
            c.gradient("grad", Some(c.get("param")?.0))?;
            c.same("param", "grad")?;
            c.same("param", "exp_avg")?;
            c.class("exp_avg", BufferClass::ExpAvg)?;
            if hyper.grafting {
                c.same("param", "graft_sq")?;
                c.class("graft_sq", BufferClass::ExpAvgSq)?;
            }
            let b = usize::try_from(hyper.max_preconditioner_dim).unwrap_or(usize::MAX);
            let (_, blocks) = schedule::blocking::blocks(c.shape("param")?, b);
            let sides: Vec<usize> = blocks.iter().flat_map(|bl| bl.sides()).collect();
            let pairs: Vec<(ValueId, ValueId)> = c
                .operands
                .iter()
                .filter(|o| o.0 == "factor")
                .map(|o| o.1)
                .zip(c.operands.iter().filter(|o| o.0 == "root").map(|o| o.1))
                .collect();
            if pairs.len() != sides.len() {
                return Err(c.attr(format!(
                    "{} blocks of max_preconditioner_dim {} have {} sides, got {} (factor, root) \
                     pairs",
                    blocks.len(),
                    hyper.max_preconditioner_dim,
                    sides.len(),
                    pairs.len()
                )));
            }
            for ((f, r), d) in pairs.into_iter().zip(sides) {
                for (role, id, class) in [
                    ("factor", f, BufferClass::KroneckerFactor),
                    ("root", r, BufferClass::InverseRoot),
                ] {
                    if c.v.m.value(id).ty.shape != [d, d] {
                        return Err(c.fail_value(
                            role,
                            id,
                            format!("must have shape {:?}", [d, d]),
                        ));
                    }
                    if c.v.state_class(id) != Some(class) {
                        return Err(c.fail_value(
                            role,
                            id,
                            format!(
                                "must be a `state {}` buffer",
                                crate::printer::class_keyword(class)
                            ),
                        ));
                    }
                }
            }
        }
        Op::KlScale { .. } => {
            c.same("x", "out")?;
            let (rows, cols) = c.rank2("x")?;
            if c.get("x")?.1.dtype != DType::F32 {
                return Err(c.fail("x", "must be f32"));
            }
            c.dims("eig_left", &[rows])?;
            c.dims("eig_right", &[cols])?;
            c.class("eig_left", BufferClass::EigenvalueEstimate)?;
            c.class("eig_right", BufferClass::EigenvalueEstimate)?;
        }
        Op::KlFactorUpdate {
            shampoo_beta,
            left,
            right,
            ..
        } => {
            if !(0.0..1.0).contains(&shampoo_beta) {
                return Err(c.attr(format!(
                    "shampoo_beta must be in [0, 1), got {shampoo_beta:?}"
                )));
            }
            c.gradient("grad", None)?;
            let (rows, cols) = c.rank2("grad")?;
            c.dims("eig_left", &[rows])?;
            c.dims("eig_right", &[cols])?;
            c.class("eig_left", BufferClass::EigenvalueEstimate)?;
            c.class("eig_right", BufferClass::EigenvalueEstimate)?;
            let (fl, fr) = (
                left.then_some("factor_left"),
                right.then_some("factor_right"),
            );
            let (ql, qr) = (left.then_some("basis_left"), right.then_some("basis_right"));
            c.sides("grad", fl, fr)?;
            c.sides("grad", ql, qr)?;
            for role in [fl, fr].into_iter().flatten() {
                c.class(role, BufferClass::KroneckerFactor)?;
            }
            for role in [ql, qr].into_iter().flatten() {
                c.class(role, BufferClass::Eigenbasis)?;
            }
        }
        Op::ShampooFactorUpdate {
            beta2,
            max_preconditioner_dim,
            ..
        } => {
            if !(beta2 > 0.0 && beta2 <= 1.0) {
                return Err(c.attr(format!("beta2 must be in (0, 1], got {beta2:?}")));
            }
            c.gradient("grad", None)?;
            blocked_sides(
                &c,
                "grad",
                "factor",
                BufferClass::KroneckerFactor,
                max_preconditioner_dim,
            )?;
        }
        Op::ShampooPrecondition {
            max_preconditioner_dim,
        } => {
            c.same("x", "out")?;
            if c.get("x")?.1.dtype != DType::F32 {
                return Err(c.fail("x", "must be f32"));
            }
            blocked_sides(
                &c,
                "x",
                "root",
                BufferClass::InverseRoot,
                max_preconditioner_dim,
            )?;
        }
        Op::Graft {
            max_preconditioner_dim,
        } => {
            if max_preconditioner_dim == 0 {
                return Err(c.attr("max_preconditioner_dim must be at least 1".into()));
            }
            c.same("x", "graft")?;
            c.same("x", "out")?;
            // Both come from one gradient: the preconditioned step and the Adam step of it.
            let (x, _) = c.get("x")?;
            let (gr, _) = c.get("graft")?;
            if derived_from(m, x) != derived_from(m, gr) {
                return Err(c.fail(
                    "graft",
                    format!(
                        "is computed from {}, not from the gradient `x` is computed from ({})",
                        m.display_value(derived_from(m, gr)),
                        m.display_value(derived_from(m, x))
                    ),
                ));
            }
            if c.get("x")?.1.dtype != DType::F32 {
                return Err(c.fail("x", "must be f32"));
            }
        }
        Op::Project { left, right, .. } => {
            if !left && !right {
                return Err(c.attr(
                    "a projection rotates at least one side (`left` or `right`)".to_string(),
                ));
            }
            let (x, _) = c.get("x")?;
            let src = c.block_of(x).map_or(x, |b| b.0);
            let from_update = matches!(
                m.inst(m.value(x).def).op,
                Op::ElementwiseUpdate { .. } | Op::KlScale { .. }
            );
            if !from_update && !c.v.grads.values().any(|&g| g == src) {
                return Err(c.fail(
                    "x",
                    "must be a gradient (or a block of one), an `elementwise_update` result or a \
                     `kl_scale`",
                ));
            }
            c.rank2("x")?;
            c.same("x", "out")?;
            let (l, r) = (left.then_some("basis_left"), right.then_some("basis_right"));
            c.sides("x", l, r)?;
            for role in [l, r].into_iter().flatten() {
                c.class(role, BufferClass::Eigenbasis)?;
            }
        }
        Op::BlockCopy { row, col } | Op::BlockWrite { row, col } => {
            let (whole, block) = match *op {
                Op::BlockCopy { .. } => ("src", "out"),
                _ => ("dst", "src"),
            };
            let (m_, n) = c.rank2(whole)?;
            let (r, k) = c.rank2(block)?;
            if row.checked_add(r).is_none_or(|e| e > m_) || col.checked_add(k).is_none_or(|e| e > n)
            {
                return Err(c.fail(
                    block,
                    format!("at ({row}, {col}) does not fit in [{m_}, {n}]"),
                ));
            }
            if let Op::BlockWrite { .. } = *op {
                c.class("dst", BufferClass::Parameter)?;
            }
        }
        Op::SoapFactorUpdate {
            shampoo_beta,
            left,
            right,
        } => {
            if !(0.0..1.0).contains(&shampoo_beta) {
                return Err(c.attr(format!(
                    "shampoo_beta must be in [0, 1), got {shampoo_beta:?}"
                )));
            }
            c.gradient("grad", None)?;
            let (l, r) = (
                left.then_some("factor_left"),
                right.then_some("factor_right"),
            );
            c.sides("grad", l, r)?;
            for role in [l, r].into_iter().flatten() {
                c.class(role, BufferClass::KroneckerFactor)?;
            }
        }
        Op::EigenbasisRefresh {
            side,
            frequency,
            offset,
            method,
            root,
            ..
        } => {
            if side > 1 || frequency == 0 || offset >= frequency {
                return Err(c.attr(format!(
                    "side must be 0 or 1, frequency positive and offset below it; got side {side}, \
                     frequency {frequency}, offset {offset}"
                )));
            }
            let (d, d2) = c.rank2("factor")?;
            if d != d2 {
                return Err(c.fail("factor", "must be square"));
            }
            c.dims("basis", &[d, d])?;
            if method == RefreshMethod::InverseRoot {
                if root.is_none_or(|r| r.exponent == 0 || !(r.epsilon > 0.0)) {
                    return Err(
                        c.attr("method inverse_root needs a positive exponent and epsilon".into())
                    );
                }
                c.class("factor", BufferClass::KroneckerFactor)?;
                return c.class("basis", BufferClass::InverseRoot);
            }
            if root.is_some() {
                return Err(c.attr(format!(
                    "exponent and epsilon belong to method inverse_root, not {method}"
                )));
            }
            if method == RefreshMethod::Soap {
                c.same("exp_avg", "exp_avg_sq")?;
                c.class("exp_avg_sq", BufferClass::ExpAvgSq)?;
            }
            let (rows, cols) = c.rank2("exp_avg")?;
            if [rows, cols][side as usize] != d {
                return Err(c.fail("exp_avg", format!("side {side} does not have length {d}")));
            }
            c.class("factor", BufferClass::KroneckerFactor)?;
            c.class("basis", BufferClass::Eigenbasis)?;
            c.class("exp_avg", BufferClass::ExpAvg)?;
        }
    }
    Ok(())
}

/// The operands named `role` are the `[d, d]` state buffers of class `class` of every side of
/// every block of `whole`'s shape in blocks of at most `b` (`schedule::blocking::blocks`), in
/// block order.
fn blocked_sides(
    c: &Ctx<'_, '_>,
    whole: &'static str,
    role: &'static str,
    class: BufferClass,
    b: u64,
) -> R {
    if b == 0 {
        return Err(c.attr("max_preconditioner_dim must be at least 1".into()));
    }
    let shape = c.shape(whole)?.to_vec();
    let (_, blocks) = schedule::blocking::blocks(&shape, usize::try_from(b).unwrap_or(usize::MAX));
    let sides: Vec<usize> = blocks.iter().flat_map(|bl| bl.sides()).collect();
    let ops: Vec<ValueId> = c
        .operands
        .iter()
        .filter(|o| o.0 == role)
        .map(|o| o.1)
        .collect();
    if ops.len() != sides.len() {
        return Err(c.attr(format!(
            "{shape:?} in blocks of at most {b} has {} block sides, got {} `{role}` operands",
            sides.len(),
            ops.len()
        )));
    }
    for (id, d) in ops.into_iter().zip(sides) {
        if c.v.m.value(id).ty.shape != [d, d] {
            return Err(c.fail_value(role, id, format!("must have shape {:?}", [d, d])));
        }
        if c.v.state_class(id) != Some(class) {
            return Err(c.fail_value(
                role,
                id,
                format!(
                    "must be a `state {}` buffer",
                    crate::printer::class_keyword(class)
                ),
            ));
        }
    }
    Ok(())
}

/// The value `v` is computed from in a composed optimizer step: followed back through
/// `project`, `shampoo_precondition`, `graft`, `kl_scale` (their first operand) and
/// `elementwise_update` results (its `grad`) to the first value that is none of these (a
/// gradient, or a block of one, in a well-formed step).
fn derived_from(m: &crate::module::Module, v: ValueId) -> ValueId {
    let mut src = v;
    for _ in 0..m.num_values() {
        let def = m.inst(m.value(src).def);
        src = match def.op {
            Op::Project { .. }
            | Op::ShampooPrecondition { .. }
            | Op::Graft { .. }
            | Op::KlScale { .. } => def.args[0],
            Op::ElementwiseUpdate { .. } if def.args.len() > 1 => def.args[1],
            _ => break,
        };
    }
    src
}
