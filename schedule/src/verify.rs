//! Plan verification: a plan is checked before the engine allocates or runs anything, so a
//! truncated, malformed or tampered plan is rejected with an error that names the offending
//! instruction and buffer.
use crate::{
    BufferId, Corpus, DType, HostTask, Op, Plan, PlanError, Tokenizer, PLAN_FORMAT, PLAN_VERSION,
};

struct Checker<'a> {
    plan: &'a Plan,
    location: String,
}

impl Checker<'_> {
    fn shape(&self, _operand: &'static str, id: BufferId) -> &[usize] {
        &self.plan.buffers[id.index()].shape
    }
    fn fail(&self, operand: &'static str, id: BufferId, problem: impl Into<String>) -> PlanError {
        let b = &self.plan.buffers[id.index()];
        PlanError::Operand {
            location: self.location.clone(),
            operand,
            id,
            name: b.name.clone(),
            shape: b.shape.clone(),
            dtype: b.dtype,
            problem: problem.into(),
        }
    }
    fn dtype(
        &self,
        operand: &'static str,
        id: BufferId,
        allowed: &[DType],
    ) -> Result<(), PlanError> {
        if !allowed.contains(&self.plan.buffers[id.index()].dtype) {
            let names: Vec<&str> = allowed.iter().map(|d| d.name()).collect();
            return Err(self.fail(operand, id, format!("must be {}", names.join(" or "))));
        }
        Ok(())
    }
    fn dims(&self, operand: &'static str, id: BufferId, want: &[usize]) -> Result<(), PlanError> {
        if self.shape(operand, id) != want {
            return Err(self.fail(operand, id, format!("must have shape {want:?}")));
        }
        Ok(())
    }
    fn rank2(&self, operand: &'static str, id: BufferId) -> Result<(usize, usize), PlanError> {
        match *self.shape(operand, id) {
            [r, c] => Ok((r, c)),
            _ => Err(self.fail(operand, id, "must be 2-D")),
        }
    }
    fn same(
        &self,
        a: (&'static str, BufferId),
        b: (&'static str, BufferId),
    ) -> Result<(), PlanError> {
        if self.shape(a.0, a.1) != self.shape(b.0, b.1) {
            let want = self.shape(a.0, a.1).to_vec();
            return Err(self.fail(
                b.0,
                b.1,
                format!("must have the shape of `{}` {want:?}", a.0),
            ));
        }
        Ok(())
    }
    /// A gradient-norm partials buffer (f32 `[2 · SUMSQ_BLOCKS · k]`, k ≥ 1) and, when given,
    /// a slot of it (`slot < k`).
    fn partials(&self, id: BufferId, slot: Option<usize>) -> Result<(), PlanError> {
        let words = 2 * crate::reserve::SUMSQ_BLOCKS;
        let len = match *self.shape("partials", id) {
            [n] if n >= words && n % words == 0 => n,
            _ => {
                return Err(self.fail(
                    "partials",
                    id,
                    format!("must be 1-D with a positive multiple of {words} elements"),
                ))
            }
        };
        if let Some(s) = slot.filter(|&s| s >= len / words) {
            return Err(self.fail(
                "partials",
                id,
                format!("has {} slots; slot {s} is outside it", len / words),
            ));
        }
        Ok(())
    }
    fn is_bf16(&self, id: BufferId) -> bool {
        self.plan.buffers[id.index()].dtype == DType::Bf16
    }
    /// An attention operand may be bf16 only where the tensor-core kernels run: heads of at
    /// most [`crate::BF16_ATTENTION_MAX_HEAD_DIM`].
    fn bf16_head(&self, name: &'static str, id: BufferId, head: usize) -> Result<(), PlanError> {
        if self.is_bf16(id) && head > crate::BF16_ATTENTION_MAX_HEAD_DIM {
            return Err(self.fail(
                name,
                id,
                format!(
                    "may be bf16 only for heads of at most {} (this has {head})",
                    crate::BF16_ATTENTION_MAX_HEAD_DIM
                ),
            ));
        }
        Ok(())
    }
    fn numel(&self, id: BufferId) -> usize {
        self.plan.buffers[id.index()].numel()
    }

    fn check_op(&self, op: &Op) -> Result<(), PlanError> {
        for (name, id) in op.operands() {
            self.dtype(name, id, crate::operand_dtypes(op.name(), name))?;
        }
        match op {
            Op::Embedding { table, ids, out } => {
                let (_, c) = self.rank2("table", *table)?;
                self.dims("out", *out, &[self.numel(*ids), c])?;
            }
            Op::EmbeddingBackward { dout, ids, dtable } => {
                let (_, c) = self.rank2("dtable", *dtable)?;
                self.dims("dout", *dout, &[self.numel(*ids), c])?;
            }
            Op::AddPositional {
                x,
                pos,
                out,
                seq_len,
            } => {
                let (n, c) = self.rank2("x", *x)?;
                let (p, pc) = self.rank2("pos", *pos)?;
                if pc != c || *seq_len == 0 || *seq_len > p || n % seq_len != 0 {
                    return Err(self.fail(
                        "pos",
                        *pos,
                        format!("incompatible with x [{n}, {c}] and seq_len {seq_len}"),
                    ));
                }
                self.same(("x", *x), ("out", *out))?;
            }
            Op::AddPositionalBackward {
                dout,
                dpos,
                seq_len,
            } => {
                let (n, c) = self.rank2("dout", *dout)?;
                let (p, pc) = self.rank2("dpos", *dpos)?;
                if pc != c || *seq_len == 0 || *seq_len > p || n % seq_len != 0 {
                    return Err(self.fail(
                        "dpos",
                        *dpos,
                        format!("incompatible with dout [{n}, {c}] and seq_len {seq_len}"),
                    ));
                }
            }
            Op::LayerNorm {
                x,
                weight,
                bias,
                out,
                ..
            } => {
                let (_, c) = self.rank2("x", *x)?;
                self.dims("weight", *weight, &[c])?;
                if let Some(b) = bias {
                    self.dims("bias", *b, &[c])?;
                }
                self.same(("x", *x), ("out", *out))?;
                if self.is_bf16(*out) && c > crate::BF16_LAYERNORM_MAX_C {
                    return Err(self.fail(
                        "out",
                        *out,
                        format!(
                            "may be bf16 only for rows of at most {} (this has {c})",
                            crate::BF16_LAYERNORM_MAX_C
                        ),
                    ));
                }
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
                let (_, c) = self.rank2("x", *x)?;
                self.dims("weight", *weight, &[c])?;
                self.dims("dweight", *dweight, &[c])?;
                if let Some(b) = dbias {
                    self.dims("dbias", *b, &[c])?;
                }
                self.same(("x", *x), ("dout", *dout))?;
                self.same(("x", *x), ("dx", *dx))?;
            }
            Op::RmsNorm { x, weight, out, .. } => {
                let (_, c) = self.rank2("x", *x)?;
                self.dims("weight", *weight, &[c])?;
                self.same(("x", *x), ("out", *out))?;
            }
            Op::RmsNormBackward {
                dout,
                x,
                weight,
                dx,
                dweight,
                ..
            } => {
                let (_, c) = self.rank2("x", *x)?;
                self.dims("weight", *weight, &[c])?;
                self.dims("dweight", *dweight, &[c])?;
                self.same(("x", *x), ("dout", *dout))?;
                self.same(("x", *x), ("dx", *dx))?;
            }
            Op::MatMul {
                a,
                b,
                out,
                trans_a,
                trans_b,
                ..
            }
            | Op::MatMulBias {
                a,
                b,
                out,
                trans_a,
                trans_b,
                ..
            } => {
                let (ar, ac) = self.rank2("a", *a)?;
                let (br, bc) = self.rank2("b", *b)?;
                let (m, k) = if *trans_a { (ac, ar) } else { (ar, ac) };
                let (k2, p) = if *trans_b { (bc, br) } else { (br, bc) };
                if k != k2 {
                    return Err(self.fail(
                        "b",
                        *b,
                        format!("inner dimension {k2} does not match a's {k}"),
                    ));
                }
                self.dims("out", *out, &[m, p])?;
                if let Op::MatMul {
                    accumulate,
                    micro_accumulate,
                    ..
                } = op
                {
                    if (*accumulate || micro_accumulate.is_some())
                        && self.plan.buffer(*out).dtype != DType::F32
                    {
                        return Err(self.fail("out", *out, "must be f32 to accumulate into"));
                    }
                    if *accumulate && micro_accumulate.is_some() {
                        return Err(PlanError::Invalid(format!(
                            "{}: `accumulate` and `micro_accumulate` exclude each other",
                            self.location
                        )));
                    }
                }
                let (da, db) = (self.plan.buffer(*a).dtype, self.plan.buffer(*b).dtype);
                if da != db {
                    return Err(self.fail(
                        "b",
                        *b,
                        format!("is {db:?} but a is {da:?}: GEMM operands share one dtype"),
                    ));
                }
                if let Op::MatMulBias { bias, out, .. } = op {
                    self.dims("bias", *bias, &[p])?;
                    if self.is_bf16(*bias) != self.is_bf16(*out) {
                        return Err(self.fail(
                            "bias",
                            *bias,
                            "must have the output's dtype (cuBLASLt's bias epilogue reads it so)",
                        ));
                    }
                }
            }
            Op::BiasAdd { x, bias, out } => {
                let (_, c) = self.rank2("x", *x)?;
                self.dims("bias", *bias, &[c])?;
                self.same(("x", *x), ("out", *out))?;
            }
            Op::SumRows { x, out } => {
                let (_, c) = self.rank2("x", *x)?;
                self.dims("out", *out, &[c])?;
            }
            Op::SumRowsCast { x, out, out_bf16 } => {
                let (_, c) = self.rank2("x", *x)?;
                self.dims("out", *out, &[c])?;
                self.same(("x", *x), ("out_bf16", *out_bf16))?;
            }
            Op::Add { a, b, out } => {
                self.same(("a", *a), ("b", *b))?;
                self.same(("a", *a), ("out", *out))?;
            }
            Op::Cast { x, out } | Op::Gelu { x, out } => self.same(("x", *x), ("out", *out))?,
            Op::GeluBackward { dout, x, dx } => {
                self.same(("x", *x), ("dout", *dout))?;
                self.same(("x", *x), ("dx", *dx))?;
            }
            Op::SwiGlu { x, out } => {
                let (n, w) = self.rank2("x", *x)?;
                if w % 2 != 0 {
                    return Err(self.fail(
                        "x",
                        *x,
                        "must have an even number of columns [gate | up]",
                    ));
                }
                self.dims("out", *out, &[n, w / 2])?;
            }
            Op::SwiGluBackward { dout, x, dx } => {
                let (n, w) = self.rank2("x", *x)?;
                if w % 2 != 0 {
                    return Err(self.fail(
                        "x",
                        *x,
                        "must have an even number of columns [gate | up]",
                    ));
                }
                self.dims("dout", *dout, &[n, w / 2])?;
                self.same(("x", *x), ("dx", *dx))?;
            }
            Op::Rope {
                x: a,
                out: b,
                seq_len,
                head_dim,
                rotated_cols,
                ..
            }
            | Op::RopeBackward {
                dout: a,
                dx: b,
                seq_len,
                head_dim,
                rotated_cols,
                ..
            } => {
                let (n, w) = self.rank2("x", *a)?;
                if *seq_len == 0
                    || n % seq_len != 0
                    || *head_dim == 0
                    || head_dim % 2 != 0
                    || rotated_cols % head_dim != 0
                    || *rotated_cols > w
                {
                    return Err(self.fail("x", *a, format!(
                        "incompatible with seq_len {seq_len}, head_dim {head_dim}, rotated_cols {rotated_cols}")));
                }
                self.same(("x", *a), ("out", *b))?;
            }
            Op::Attention {
                qkv,
                out,
                lse,
                batch,
                seq_len,
                n_heads,
            } => {
                let (n, w) = self.rank2("qkv", *qkv)?;
                if n != batch * seq_len || w % 3 != 0 || *n_heads == 0 || (w / 3) % n_heads != 0 {
                    return Err(self.fail(
                        "qkv",
                        *qkv,
                        format!(
                            "incompatible with batch {batch}, seq_len {seq_len}, n_heads {n_heads}"
                        ),
                    ));
                }
                self.dims("out", *out, &[n, w / 3])?;
                let head = w / 3 / n_heads;
                for (name, id) in [("out", *out), ("qkv", *qkv)] {
                    self.bf16_head(name, id, head)?;
                }
                if let Some(l) = lse {
                    self.dims("lse", *l, &[batch * n_heads * seq_len])?;
                }
            }
            Op::AttentionBackward {
                dout,
                qkv,
                fwd_out,
                lse,
                dqkv,
                batch,
                seq_len,
                n_heads,
            } => {
                let (n, w) = self.rank2("qkv", *qkv)?;
                if n != batch * seq_len || w % 3 != 0 || *n_heads == 0 || (w / 3) % n_heads != 0 {
                    return Err(self.fail(
                        "qkv",
                        *qkv,
                        format!(
                            "incompatible with batch {batch}, seq_len {seq_len}, n_heads {n_heads}"
                        ),
                    ));
                }
                self.dims("dout", *dout, &[n, w / 3])?;
                self.same(("qkv", *qkv), ("dqkv", *dqkv))?;
                let head = w / 3 / n_heads;
                for (name, id) in [("dout", *dout), ("qkv", *qkv)] {
                    self.bf16_head(name, id, head)?;
                }
                match (fwd_out, lse) {
                    (Some(o), Some(l)) => {
                        self.dims("fwd_out", *o, &[n, w / 3])?;
                        self.dims("lse", *l, &[batch * n_heads * seq_len])?;
                    }
                    (None, None) => {}
                    (Some(o), None) => {
                        return Err(self.fail("fwd_out", *o, "comes with `lse` (saved statistics)"))
                    }
                    (None, Some(l)) => {
                        return Err(self.fail("lse", *l, "comes with `fwd_out` (saved statistics)"))
                    }
                }
            }
            Op::CrossEntropy {
                logits,
                targets,
                loss,
            } => {
                let (n, _) = self.rank2("logits", *logits)?;
                self.dims("targets", *targets, &[n])?;
                self.dims("loss", *loss, &[1])?;
            }
            Op::CrossEntropyBackward {
                logits,
                targets,
                dlogits,
            } => {
                let (n, _) = self.rank2("logits", *logits)?;
                self.dims("targets", *targets, &[n])?;
                self.same(("logits", *logits), ("dlogits", *dlogits))?;
                if self.plan.buffer(*logits).dtype == DType::Bf16
                    && self.plan.buffer(*dlogits).dtype != DType::Bf16
                {
                    return Err(self.fail("dlogits", *dlogits, "must be bf16 when the logits are"));
                }
            }
            Op::ClipGradNorm {
                grads,
                norm,
                scale,
                max_norm,
                partials,
            } => {
                self.dims("norm", *norm, &[1])?;
                if let Some(s) = scale {
                    self.dims("scale", *s, &[1])?;
                }
                if let Some(p) = partials {
                    if !grads.is_empty() || scale.is_none() {
                        return Err(self.fail(
                            "partials",
                            *p,
                            "reads the gradients' sums of squares instead of the gradients: \
                             `grads` must be empty and a `scale` output given",
                        ));
                    }
                    self.partials(*p, None)?;
                }
                if let Some(m) = max_norm {
                    if !(m.is_finite() && *m > 0.0) {
                        return Err(PlanError::Invalid(format!(
                            "{}: max_norm must be positive, got {m}",
                            self.location
                        )));
                    }
                }
            }
            Op::GradSumSquares { partials, slot, .. } => self.partials(*partials, Some(*slot))?,
            Op::ScaleByScalar { scale, .. } => self.dims("scale", *scale, &[1])?,
            Op::GradAccumulate {
                micro,
                total,
                scale,
            } => {
                self.same(("micro", *micro), ("total", *total))?;
                if !(scale.is_finite() && *scale > 0.0 && *scale <= 1.0) {
                    return Err(PlanError::Invalid(format!(
                        "{}: scale must be in (0, 1] (1 / micro-batches), got {scale}",
                        self.location
                    )));
                }
            }
            Op::AdamW {
                param,
                grad,
                exp_avg,
                exp_avg_sq,
                grad_scale,
                ..
            } => {
                self.same(("param", *param), ("grad", *grad))?;
                self.same(("param", *param), ("exp_avg", *exp_avg))?;
                self.same(("param", *param), ("exp_avg_sq", *exp_avg_sq))?;
                if let Some(s) = grad_scale {
                    self.dims("grad_scale", *s, &[1])?;
                }
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
                self.same(("param", *param), ("grad", *grad))?;
                self.same(("param", *param), ("exp_avg", *exp_avg))?;
                self.same(("param", *param), ("exp_avg_sq", *exp_avg_sq))?;
                self.side_factors(
                    *param,
                    *basis_left,
                    *basis_right,
                    ("basis_left", "basis_right"),
                )?;
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
                self.same(("param", *param), ("grad", *grad))?;
                self.same(("param", *param), ("exp_avg", *exp_avg))?;
                let (m, n) = self.rank2("param", *param)?;
                self.dims("eig_left", *eig_left, &[m])?;
                self.dims("eig_right", *eig_right, &[n])?;
                if factor_left.is_some() != basis_left.is_some()
                    || factor_right.is_some() != basis_right.is_some()
                {
                    return Err(PlanError::Invalid(format!(
                        "{}: a side has a Kronecker factor without its basis or the reverse",
                        self.location
                    )));
                }
                self.side_factors(
                    *param,
                    *factor_left,
                    *factor_right,
                    ("factor_left", "factor_right"),
                )?;
                self.side_factors(
                    *param,
                    *basis_left,
                    *basis_right,
                    ("basis_left", "basis_right"),
                )?;
            }
            Op::ShampooUpdate {
                param,
                grad,
                exp_avg,
                graft_sq,
                factors,
                roots,
                hyper,
            } => {
                self.same(("param", *param), ("grad", *grad))?;
                self.same(("param", *param), ("exp_avg", *exp_avg))?;
                if let Some(v) = graft_sq {
                    self.same(("param", *param), ("graft_sq", *v))?;
                }
                if graft_sq.is_some() != hyper.grafting {
                    return Err(PlanError::Invalid(format!(
                        "{}: `graft_sq` must be present exactly when grafting is on",
                        self.location
                    )));
                }
                let shape = &self.plan.buffers[param.index()].shape;
                let b = usize::try_from(hyper.max_preconditioner_dim).unwrap_or(usize::MAX);
                let (_, blocks) = crate::blocking::blocks(shape, b);
                let sides: Vec<usize> = blocks.iter().flat_map(|bl| bl.sides()).collect();
                if factors.len() != sides.len() || roots.len() != sides.len() {
                    return Err(PlanError::Invalid(format!(
                        "{}: {} blocks of max_preconditioner_dim {} have {} sides; got {} factors \
                         and {} roots",
                        self.location,
                        blocks.len(),
                        hyper.max_preconditioner_dim,
                        sides.len(),
                        factors.len(),
                        roots.len()
                    )));
                }
                for ((f, r), d) in factors.iter().zip(roots).zip(&sides) {
                    self.dims("factor", *f, &[*d, *d])?;
                    self.dims("root", *r, &[*d, *d])?;
                }
            }
            Op::KlScale {
                x,
                out,
                eig_left,
                eig_right,
                ..
            } => {
                self.same(("x", *x), ("out", *out))?;
                let (m, n) = self.rank2("x", *x)?;
                self.dims("eig_left", *eig_left, &[m])?;
                self.dims("eig_right", *eig_right, &[n])?;
            }
            Op::KlFactorUpdate {
                grad,
                factor_left,
                factor_right,
                basis_left,
                basis_right,
                eig_left,
                eig_right,
                shampoo_beta,
                ..
            } => {
                if !(0.0..1.0).contains(shampoo_beta) {
                    return Err(PlanError::Invalid(format!(
                        "{}: shampoo_beta must be in [0, 1)",
                        self.location
                    )));
                }
                let (m, n) = self.rank2("grad", *grad)?;
                self.dims("eig_left", *eig_left, &[m])?;
                self.dims("eig_right", *eig_right, &[n])?;
                if factor_left.is_some() != basis_left.is_some()
                    || factor_right.is_some() != basis_right.is_some()
                {
                    return Err(PlanError::Invalid(format!(
                        "{}: a side has a Kronecker factor without its basis or the reverse",
                        self.location
                    )));
                }
                self.side_factors(
                    *grad,
                    *factor_left,
                    *factor_right,
                    ("factor_left", "factor_right"),
                )?;
                self.side_factors(
                    *grad,
                    *basis_left,
                    *basis_right,
                    ("basis_left", "basis_right"),
                )?;
            }
            Op::ShampooFactorUpdate {
                grad,
                factors,
                beta2,
                max_preconditioner_dim,
                ..
            } => {
                if !(*beta2 > 0.0 && *beta2 <= 1.0) {
                    return Err(PlanError::Invalid(format!(
                        "{}: beta2 must be in (0, 1], got {beta2:?}",
                        self.location
                    )));
                }
                self.blocked_sides(
                    ("grad", *grad),
                    ("factor", factors),
                    *max_preconditioner_dim,
                )?;
            }
            Op::ShampooPrecondition {
                x,
                out,
                roots,
                max_preconditioner_dim,
            } => {
                self.same(("x", *x), ("out", *out))?;
                self.blocked_sides(("x", *x), ("root", roots), *max_preconditioner_dim)?;
            }
            Op::Graft {
                x,
                graft,
                out,
                max_preconditioner_dim,
            } => {
                self.same(("x", *x), ("graft", *graft))?;
                self.same(("x", *x), ("out", *out))?;
                if *max_preconditioner_dim == 0 {
                    return Err(PlanError::Invalid(format!(
                        "{}: max_preconditioner_dim must be at least 1",
                        self.location
                    )));
                }
            }
            Op::SoapFactorUpdate {
                grad,
                factor_left,
                factor_right,
                shampoo_beta,
            } => {
                if !(0.0..1.0).contains(shampoo_beta) {
                    return Err(PlanError::Invalid(format!(
                        "{}: shampoo_beta must be in [0, 1)",
                        self.location
                    )));
                }
                self.side_factors(
                    *grad,
                    *factor_left,
                    *factor_right,
                    ("factor_left", "factor_right"),
                )?;
            }
            Op::ElementwiseUpdate {
                param,
                grad,
                state,
                results,
                rule,
            } => {
                rule.check().map_err(|e| {
                    PlanError::Invalid(format!("{}: update rule: {e}", self.location))
                })?;
                if state.len() != rule.state.len() {
                    return Err(PlanError::Invalid(format!(
                        "{}: {} state operands for a rule of {} state tensors",
                        self.location,
                        state.len(),
                        rule.state.len()
                    )));
                }
                if results.len() != rule.results.len() {
                    return Err(PlanError::Invalid(format!(
                        "{}: {} result operands for a rule of {} results",
                        self.location,
                        results.len(),
                        rule.results.len()
                    )));
                }
                self.same(("param", *param), ("grad", *grad))?;
                for s in state {
                    self.same(("param", *param), ("state", *s))?;
                }
                for r in results {
                    self.same(("param", *param), ("result", *r))?;
                }
            }
            Op::Project {
                x,
                out,
                basis_left,
                basis_right,
                ..
            } => {
                self.same(("x", *x), ("out", *out))?;
                self.rank2("x", *x)?;
                if basis_left.is_none() && basis_right.is_none() {
                    return Err(PlanError::Invalid(format!(
                        "{}: a projection without a basis (the identity) is not an op",
                        self.location
                    )));
                }
                self.side_factors(*x, *basis_left, *basis_right, ("basis_left", "basis_right"))?;
            }
            Op::BlockCopy { src, dst, row, col } | Op::BlockWrite { src, dst, row, col } => {
                let (whole, block) = match op {
                    Op::BlockCopy { .. } => (("src", *src), ("dst", *dst)),
                    _ => (("dst", *dst), ("src", *src)),
                };
                let (m, n) = self.rank2(whole.0, whole.1)?;
                let (r, c) = self.rank2(block.0, block.1)?;
                if row.checked_add(r).is_none_or(|e| e > m)
                    || col.checked_add(c).is_none_or(|e| e > n)
                {
                    return Err(self.fail(
                        block.0,
                        block.1,
                        format!("at ({row}, {col}) does not fit in [{m}, {n}]"),
                    ));
                }
            }
            Op::CopyIn { src, dst, .. } | Op::CopyOut { src, dst } => {
                self.same(("src", *src), ("dst", *dst))?;
                let (ds, dd) = (self.plan.buffer(*src).dtype, self.plan.buffer(*dst).dtype);
                if ds != dd {
                    return Err(self.fail(
                        "dst",
                        *dst,
                        format!("is {dd:?} but src is {ds:?}: a tier copy moves bytes"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// `bufs` (operands named `role`) are the `[d, d]` matrices of every side of every block
    /// of `whole`'s shape under block size `b` (`crate::blocking::blocks`), in block order.
    fn blocked_sides(
        &self,
        (name, whole): (&'static str, BufferId),
        (role, bufs): (&'static str, &[BufferId]),
        b: u64,
    ) -> Result<(), PlanError> {
        if b == 0 {
            return Err(PlanError::Invalid(format!(
                "{}: max_preconditioner_dim must be at least 1",
                self.location
            )));
        }
        let shape = &self.plan.buffers[whole.index()].shape;
        let (_, blocks) = crate::blocking::blocks(shape, usize::try_from(b).unwrap_or(usize::MAX));
        let sides: Vec<usize> = blocks.iter().flat_map(|bl| bl.sides()).collect();
        if bufs.len() != sides.len() {
            return Err(PlanError::Invalid(format!(
                "{}: `{name}` {shape:?} in blocks of at most {b} has {} block sides; got {} `{role}` operands",
                self.location,
                sides.len(),
                bufs.len()
            )));
        }
        for (f, d) in bufs.iter().zip(&sides) {
            self.dims(role, *f, &[*d, *d])?;
        }
        Ok(())
    }

    fn side_factors(
        &self,
        param: BufferId,
        left: Option<BufferId>,
        right: Option<BufferId>,
        names: (&'static str, &'static str),
    ) -> Result<(), PlanError> {
        let shape = self.shape("param", param).to_vec();
        match (shape.as_slice(), left, right) {
            ([m, n], l, r) => {
                if let Some(l) = l {
                    self.dims(names.0, l, &[*m, *m])?;
                }
                if let Some(r) = r {
                    self.dims(names.1, r, &[*n, *n])?;
                }
            }
            ([_], None, None) => {}
            _ => {
                return Err(self.fail(
                    "param",
                    param,
                    "must be 2-D, or 1-D without Kronecker factors",
                ))
            }
        }
        Ok(())
    }
}

impl Plan {
    /// Checks the whole plan: format and version, buffer shapes, hyperparameters and settings in
    /// the ranges of their spec keys ([`crate::limits`]), every operand in range with the
    /// dtype and shape its op expects, parameters and gradients paired with equal shapes, the
    /// data inputs and loss buffers, the host tasks, and the memory plan (every buffer inside
    /// its arena at an aligned offset; bytes shared only by step-local buffers whose live
    /// ranges are disjoint — see [`crate::memory`]).
    pub fn verify(&self) -> Result<(), PlanError> {
        if self.format != PLAN_FORMAT || self.version != PLAN_VERSION {
            return Err(PlanError::Version {
                format: self.format.clone(),
                version: self.version,
            });
        }
        let mut names = std::collections::HashSet::new();
        for (i, b) in self.buffers.iter().enumerate() {
            if b.shape.is_empty() || b.shape.contains(&0) {
                return Err(PlanError::Invalid(format!(
                    "buffer {i} `{}` has an empty or zero-sized shape {:?}",
                    b.name, b.shape
                )));
            }
            if b.shape
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .is_none_or(|n| n as u64 > crate::limits::MAX_BUFFER_ELEMENTS)
            {
                return Err(PlanError::Invalid(format!(
                    "buffer {i} `{}` is absurdly large: {:?}",
                    b.name, b.shape
                )));
            }
            if b.dtype == DType::Bf16 && b.class != crate::BufferClass::Activation {
                return Err(PlanError::Invalid(format!(
                    "buffer {i} `{}` is bf16 but a {:?}: only activations may be bf16",
                    b.name, b.class
                )));
            }
            if !names.insert(b.name.as_str()) {
                return Err(PlanError::Invalid(format!(
                    "buffer name `{}` is used twice",
                    b.name
                )));
            }
        }
        self.verify_ranges()?;
        let count = self.buffers.len();
        let in_range = |location: &str, operand: &'static str, id: BufferId| {
            if id.index() >= count {
                Err(PlanError::BufferOutOfRange {
                    location: location.to_string(),
                    operand,
                    id,
                    count,
                })
            } else {
                Ok(())
            }
        };
        in_range("plan", "loss", self.loss)?;
        in_range("data", "tokens", self.data.tokens)?;
        in_range("data", "targets", self.data.targets)?;
        for (i, p) in self.params.iter().enumerate() {
            let loc = format!("params[{i}]");
            in_range(&loc, "param", p.param)?;
            in_range(&loc, "grad", p.grad)?;
            if self.buffer(p.param).shape != self.buffer(p.grad).shape {
                return Err(PlanError::Invalid(format!(
                    "{loc}: gradient shape differs from parameter shape"
                )));
            }
        }
        let n = self.data.batch_size * self.data.seq_len;
        if n == 0 {
            return Err(PlanError::Invalid(
                "data: batch_size and seq_len must be positive".into(),
            ));
        }
        if !(self.data.val_fraction > 0.0 && self.data.val_fraction < 1.0) {
            return Err(PlanError::Invalid(
                "data: val_fraction must be in (0, 1)".into(),
            ));
        }
        if let Corpus::Shards { train, .. } = &self.data.corpus {
            if train.is_empty() {
                return Err(PlanError::Invalid(
                    "data: the shard corpus lists no training shard".into(),
                ));
            }
            if self.data.tokenizer != Tokenizer::Gpt2 {
                return Err(PlanError::Invalid(
                    "data: token shards hold GPT-2 token ids; the tokenizer must be `gpt2`".into(),
                ));
            }
        }
        for (what, id) in [("tokens", self.data.tokens), ("targets", self.data.targets)] {
            let b = self.buffer(id);
            if b.dtype != DType::I32 || b.shape != [n] {
                return Err(PlanError::Invalid(format!(
                    "data.{what}: buffer `{}` must be i32 [{n}]",
                    b.name
                )));
            }
        }
        if self.buffer(self.loss).shape != [1] {
            return Err(PlanError::Invalid("loss buffer must have shape [1]".into()));
        }
        for (section, prog) in [
            ("forward", &self.forward),
            ("backward", &self.backward),
            ("optimizer", &self.optimizer),
        ] {
            for (i, op) in prog.iter().enumerate() {
                let location = format!("{section}[{i}] ({})", op.name());
                self.check_accumulation_op(section, &location, op)?;
                for (name, id) in op.operands() {
                    in_range(&location, name, id)?;
                }
                Checker {
                    plan: self,
                    location,
                }
                .check_op(op)?;
            }
        }
        self.verify_accumulation()?;
        for (i, task) in self.host_tasks.iter().enumerate() {
            let location = format!("host_tasks[{i}]");
            for (name, id) in task.operands() {
                in_range(&location, name, id)?;
            }
            let HostTask::EigenbasisRefresh {
                factor,
                basis,
                side,
                exp_avg,
                exp_avg_sq,
                frequency,
                offset,
                staleness,
                placement,
                method,
                root,
            } = task;
            match (method, root) {
                (crate::RefreshMethod::InverseRoot, None) => {
                    return Err(PlanError::Invalid(format!(
                        "{location}: method inverse_root needs its `root` (exponent, epsilon)"
                    )))
                }
                (crate::RefreshMethod::InverseRoot, Some(r)) => {
                    if r.exponent == 0 || !(r.epsilon.is_finite() && r.epsilon > 0.0) {
                        return Err(PlanError::Invalid(format!(
                            "{location}: inverse root exponent must be positive and epsilon \
                             finite and positive (got {}, {})",
                            r.exponent, r.epsilon
                        )));
                    }
                }
                (_, Some(_)) => {
                    return Err(PlanError::Invalid(format!(
                        "{location}: a `root` belongs to method inverse_root only (got {method})"
                    )))
                }
                (_, None) => {}
            }
            let bound = self.target.staleness();
            if *staleness > bound {
                return Err(PlanError::Invalid(format!(
                    "{location}: staleness {staleness} exceeds the target's staleness bound {bound}"
                )));
            }
            if let crate::TargetPlan::Cuda {
                refresh_placement, ..
            } = self.target
            {
                let want = match refresh_placement {
                    crate::RefreshPlacement::Auto => None,
                    crate::RefreshPlacement::Gpu => Some(crate::Placement::GpuSide),
                    crate::RefreshPlacement::Host => Some(crate::Placement::Host),
                };
                if want.is_some_and(|w| w != *placement) {
                    return Err(PlanError::Invalid(format!(
                        "{location}: placement `{placement}` contradicts the target's \
                         refresh_placement = {refresh_placement}"
                    )));
                }
            }
            let c = Checker {
                plan: self,
                location: location.clone(),
            };
            let (d, d2) = c.rank2("factor", *factor)?;
            if d != d2 {
                return Err(c.fail("factor", *factor, "must be square"));
            }
            c.dims("basis", *basis, &[d, d])?;
            c.same(("exp_avg", *exp_avg), ("exp_avg_sq", *exp_avg_sq))?;
            let (m, n2) = c.rank2("exp_avg", *exp_avg)?;
            let want = if *side == 0 { m } else { n2 };
            if *side > 1 || want != d {
                return Err(c.fail(
                    "exp_avg",
                    *exp_avg,
                    format!("side {side} does not have length {d}"),
                ));
            }
            if *frequency == 0 || offset >= frequency {
                return Err(PlanError::Invalid(format!(
                    "{location}: frequency must be positive and offset below it (got {frequency}, {offset})"
                )));
            }
        }
        crate::memory::verify_memory(self)
    }
}

#[cfg(test)]
#[path = "verify_tests.rs"]
mod tests;
