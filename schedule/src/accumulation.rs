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
        // Tier copies run once per program run: in the forward or backward they would run
        // once per micro-batch, and nothing orders a micro-batch's backward copies before the
        // next micro-batch's forward on the GPU's copy streams.
        for (section, program) in [("forward", &self.forward), ("backward", &self.backward)] {
            if let Some((i, op)) = program
                .iter()
                .enumerate()
                .find(|(_, o)| matches!(o, Op::CopyIn { .. } | Op::CopyOut { .. }))
            {
                return Err(PlanError::Invalid(format!(
                    "{section}[{i}] ({}): with train.grad_accum = {} tier copies belong in the \
                     optimizer program (the {section} runs once per micro-batch)",
                    op.name(),
                    self.train.grad_accum
                )));
            }
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
                    self.check_accumulation_operands(i, op, name)?;
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

    /// The operands of `op`, the accumulation at `backward[i]` into gradient `name`: a
    /// `GradAccumulate`'s micro-batch buffer is another buffer than its total and is written
    /// earlier in the backward (else it would add bytes left from an earlier use of the
    /// arena); a micro-accumulating `MatMul` reads neither operand from its output (β = 1
    /// would read and write the same bytes).
    fn check_accumulation_operands(&self, i: usize, op: &Op, name: &str) -> Result<(), PlanError> {
        match op {
            Op::GradAccumulate { micro, total, .. } => {
                if micro == total {
                    return Err(PlanError::Invalid(format!(
                        "backward[{i}] (grad_accumulate): `{name}` is both the micro-batch \
                         buffer and the total"
                    )));
                }
                let written = self.backward[..i].iter().any(|o| {
                    o.accesses()
                        .iter()
                        .any(|&(_, id, a)| id == *micro && a.writes())
                });
                if !written {
                    return Err(PlanError::Invalid(format!(
                        "backward[{i}] (grad_accumulate): `{}` is accumulated into `{name}` \
                         but no earlier backward op writes it",
                        self.buffer(*micro).name
                    )));
                }
            }
            Op::MatMul { a, b, out, .. } if a == out || b == out => {
                return Err(PlanError::Invalid(format!(
                    "backward[{i}] (mat_mul): the micro-accumulating product into `{name}` \
                     reads its own output"
                )));
            }
            _ => {}
        }
        Ok(())
    }
}
