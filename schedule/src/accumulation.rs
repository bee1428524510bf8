//! The plan verifier's check of gradient accumulation (`train.grad_accum`, the
//! `accumulate-gradients` pass): every gradient of an accumulating plan is accumulated exactly
//! once in the backward program.
use crate::{Op, Plan, PlanError};

impl Plan {
    /// An accumulation op (`GradAccumulate`, or a `MatMul` with `micro_accumulate`) belongs in
    /// the backward program of a plan with `train.grad_accum` ≥ 2, scaled by exactly
    /// 1 / grad_accum.
    pub(crate) fn check_accumulation_op(
        &self,
        section: &str,
        location: &str,
        op: &Op,
    ) -> Result<(), PlanError> {
        let scale = match op {
            Op::GradAccumulate { scale, .. }
            | Op::MatMul {
                micro_accumulate: Some(scale),
                ..
            } => scale,
            _ => return Ok(()),
        };
        // Only the backward runs once per micro-batch; its scale averages them.
        let want = 1.0 / self.train.grad_accum as f64;
        if section != "backward" || self.train.grad_accum < 2 || *scale != want {
            return Err(PlanError::Invalid(format!(
                "{location}: gradient accumulation belongs in the backward of a plan with \
                 train.grad_accum >= 2, with scale 1 / grad_accum ({want}); this plan has \
                 grad_accum {} and scale {scale}",
                self.train.grad_accum
            )));
        }
        Ok(())
    }

    /// With `train.grad_accum` ≥ 2 every parameter's gradient must be accumulated exactly once
    /// in the backward — the `total` of one [`Op::GradAccumulate`] or the `out` of one
    /// `MatMul` with `micro_accumulate` — and touched by no other backward op: otherwise the
    /// engine's N backward runs would each overwrite it and the optimizer would see only the
    /// last micro-batch. Nothing may touch a micro-batch buffer after its accumulation.
    pub(crate) fn verify_accumulation(&self) -> Result<(), PlanError> {
        if self.train.grad_accum < 2 {
            return Ok(());
        }
        for p in &self.params {
            let g = p.grad;
            let name = &self.buffer(g).name;
            let touching: Vec<(usize, &Op)> = self
                .backward
                .iter()
                .enumerate()
                .filter(|(_, op)| op.operands().iter().any(|&(_, id)| id == g))
                .collect();
            let accumulates = |op: &Op| match op {
                Op::GradAccumulate { total, .. } => *total == g,
                Op::MatMul {
                    out,
                    micro_accumulate: Some(_),
                    ..
                } => *out == g,
                _ => false,
            };
            match touching[..] {
                [(i, op)] if accumulates(op) => {
                    if let Op::GradAccumulate { micro, .. } = op {
                        if let Some((j, later)) = self.backward[i + 1..]
                            .iter()
                            .enumerate()
                            .find(|(_, o)| o.operands().iter().any(|&(_, id)| id == *micro))
                        {
                            return Err(PlanError::Invalid(format!(
                                "backward[{}] ({}) touches `{}` after its accumulation into \
                                 `{name}`",
                                i + 1 + j,
                                later.name(),
                                self.buffer(*micro).name
                            )));
                        }
                    }
                }
                _ => {
                    return Err(PlanError::Invalid(format!(
                        "train.grad_accum = {} but gradient `{name}` is not accumulated \
                         exactly once in the backward (by one grad_accumulate or one \
                         micro-accumulating mat_mul, and touched by no other backward op): \
                         each micro-batch would overwrite it; recompile the spec",
                        self.train.grad_accum
                    )))
                }
            }
        }
        Ok(())
    }
}
