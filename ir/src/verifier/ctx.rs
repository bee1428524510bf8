//! The instruction under check and its operand helpers (shape, dtype, class and gradient
//! checks that produce [`VerifierError::Operand`] errors naming the operand and value).
use super::{Verifier, VerifierError};
use crate::module::{InstId, ValueId};
use crate::types::TensorType;
use schedule::BufferClass;

/// One instruction under check: its operands by role.
pub(super) struct Ctx<'a, 'm> {
    pub(super) v: &'a Verifier<'m>,
    pub(super) id: InstId,
    pub(super) at: String,
    pub(super) operands: Vec<(&'static str, ValueId)>,
}

pub(super) type R<T = ()> = Result<T, VerifierError>;

impl Ctx<'_, '_> {
    pub(super) fn get(&self, role: &'static str) -> R<(ValueId, &TensorType)> {
        match self.operands.iter().find(|o| o.0 == role) {
            Some(&(_, id)) => Ok((id, &self.v.m.value(id).ty)),
            None => Err(self.attr(format!("internal: operand `{role}` missing"))),
        }
    }
    pub(super) fn fail_value(
        &self,
        role: &'static str,
        id: ValueId,
        problem: impl Into<String>,
    ) -> VerifierError {
        let m = self.v.m;
        VerifierError::Operand {
            inst: self.id,
            at: self.at.clone(),
            operand: role,
            value: m.display_value(id),
            ty: m.value(id).ty.clone(),
            problem: problem.into(),
        }
    }
    pub(super) fn fail(&self, role: &'static str, problem: impl Into<String>) -> VerifierError {
        match self.get(role) {
            Ok((id, _)) => self.fail_value(role, id, problem),
            Err(e) => e,
        }
    }
    pub(super) fn attr(&self, problem: String) -> VerifierError {
        VerifierError::Attribute {
            inst: self.id,
            at: self.at.clone(),
            problem,
        }
    }
    pub(super) fn shape(&self, role: &'static str) -> R<&[usize]> {
        Ok(&self.get(role)?.1.shape)
    }
    pub(super) fn dims(&self, role: &'static str, want: &[usize]) -> R {
        match self.shape(role)? == want {
            true => Ok(()),
            false => Err(self.fail(role, format!("must have shape {want:?}"))),
        }
    }
    pub(super) fn rank2(&self, role: &'static str) -> R<(usize, usize)> {
        match *self.shape(role)? {
            [r, c] => Ok((r, c)),
            _ => Err(self.fail(role, "must be 2-D")),
        }
    }
    pub(super) fn same(&self, a: &'static str, b: &'static str) -> R {
        let want = self.shape(a)?;
        match self.shape(b)? == want {
            true => Ok(()),
            false => Err(self.fail(b, format!("must have the shape of `{a}` {want:?}"))),
        }
    }
    /// The operand must be a `state <class>` buffer.
    pub(super) fn class(&self, role: &'static str, want: BufferClass) -> R {
        let (id, _) = self.get(role)?;
        match self.v.state_class(id) == Some(want) {
            true => Ok(()),
            false => Err(self.fail(
                role,
                format!(
                    "must be a `state {}` buffer",
                    crate::printer::class_keyword(want)
                ),
            )),
        }
    }
    /// The `block_copy` that defines `id`: its source and the block's (row, col).
    pub(super) fn block_of(&self, id: ValueId) -> Option<(ValueId, usize, usize)> {
        let def = self.v.m.inst(self.v.m.value(id).def);
        match def.op {
            crate::op::Op::BlockCopy { row, col } => Some((def.args[0], row, col)),
            _ => None,
        }
    }
    /// `param` and `grad` of an optimizer op: a parameter and its gradient, or (a blocked
    /// optimizer) the blocks `block_copy` cut at the same place out of a parameter and its
    /// gradient.
    pub(super) fn param_and_grad(&self) -> R {
        let (p, _) = self.get("param")?;
        let (g, _) = self.get("grad")?;
        match (self.block_of(p), self.block_of(g)) {
            (Some((ps, pr, pc)), Some((gs, gr, gc))) => {
                if self.v.state_class(ps) != Some(BufferClass::Parameter) {
                    return Err(self.fail("param", "must be a block of a parameter"));
                }
                if self.v.grads.get(&ps) != Some(&gs) || (pr, pc) != (gr, gc) {
                    return Err(
                        self.fail("grad", "must be the same block of the parameter's gradient")
                    );
                }
                Ok(())
            }
            _ => {
                self.class("param", BufferClass::Parameter)?;
                self.gradient("grad", Some(p))
            }
        }
    }
    /// The operand must be a gradient marked by `grad_of` (of `param` when given), or a block
    /// `block_copy` cut out of one.
    pub(super) fn gradient(&self, role: &'static str, param: Option<ValueId>) -> R {
        let (id, _) = self.get(role)?;
        let id = match (param, self.block_of(id)) {
            (None, Some((src, _, _))) => src,
            _ => id,
        };
        let m = self.v.m;
        match param {
            Some(p) => match self.v.grads.get(&p) {
                Some(&g) if g == id => Ok(()),
                Some(&g) => Err(self.fail(
                    role,
                    format!(
                        "must be the gradient of {} ({})",
                        m.display_value(p),
                        m.display_value(g)
                    ),
                )),
                None => Err(self.fail(
                    role,
                    format!(
                        "has no `grad_of` marker for parameter {}",
                        m.display_value(p)
                    ),
                )),
            },
            None => match self.v.grads.values().any(|&g| g == id) {
                true => Ok(()),
                false => Err(self.fail(role, "must be a gradient marked by `grad_of`")),
            },
        }
    }
    /// SOAP side factors / bases: `[m, m]` left and `[n, n]` right of a 2-D `[m, n]` base; a 1-D
    /// base takes none.
    pub(super) fn sides(
        &self,
        base: &'static str,
        left: Option<&'static str>,
        right: Option<&'static str>,
    ) -> R {
        match (self.shape(base)?, left, right) {
            (&[m, n], l, r) => {
                if let Some(l) = l {
                    self.dims(l, &[m, m])?;
                }
                if let Some(r) = r {
                    self.dims(r, &[n, n])?;
                }
                Ok(())
            }
            ([_], None, None) => Ok(()),
            _ => Err(self.fail(base, "must be 2-D, or 1-D without Kronecker factors")),
        }
    }
}
