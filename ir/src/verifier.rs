//! The IR verifier (cranelift's `verifier` in spirit): checks every instruction of a [`Module`]
//! and returns *all* errors, each naming the IR entity (`inst5 (%y = mat_mul)` or `%name`).
//! [`Module::display_with_errors`] prints them inline under the offending instruction.
//!
//! Checked: argument and result counts of each op (with the optional `bias` / `left` / `right`
//! operands), dtypes (`ids` / `targets` and `input` results i32, bf16 only where
//! `schedule::operand_dtypes` allows it, everything else f32) and
//! shapes exactly as the plan op of the same name expects (`schedule/src/verify.rs`), values
//! defined before use in execution order (sections in order, layout order within a section) and
//! by a live instruction, section membership, the `loss` / `grad_of` markers and the buffers
//! that in-place optimizer ops update (per-op rules in `verifier/ops.rs`).
use crate::module::{InstId, Module, ValueId};
use crate::op::{Op, Section};
use crate::types::TensorType;
use schedule::BufferClass;
use std::collections::HashMap;
use thiserror::Error;

mod ctx;
mod ops;

/// One verifier error. Every variant names the entity it is about: `at` is the instruction as
/// `inst<n> (%results = op)`, `value` a value as `%name`.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum VerifierError {
    /// Wrong number of arguments for the op (and its `bias` / `left` / `right` variant).
    #[error("{at}: expects {expected} arguments, found {found}")]
    ArgCount {
        /// The instruction.
        inst: InstId,
        /// It, printed.
        at: String,
        /// Allowed count(s), e.g. `2 or 3`.
        expected: String,
        /// Actual count.
        found: usize,
    },
    /// Wrong number of results for the op.
    #[error("{at}: expects {expected} results, found {found}")]
    ResultCount {
        /// The instruction.
        inst: InstId,
        /// It, printed.
        at: String,
        /// Allowed count.
        expected: String,
        /// Actual count.
        found: usize,
    },
    /// An argument or result has the wrong dtype, shape or kind of definition.
    #[error("{at}: operand `{operand}` ({value}: {ty}) {problem}")]
    Operand {
        /// The instruction.
        inst: InstId,
        /// It, printed.
        at: String,
        /// Operand role as in the plan op (`x`, `weight`, `out`, `exp_avg`, ...).
        operand: &'static str,
        /// The value, `%name`.
        value: String,
        /// Its type.
        ty: TensorType,
        /// What is wrong (`must have shape [8, 16]`, ...).
        problem: String,
    },
    /// An attribute value is out of range.
    #[error("{at}: {problem}")]
    Attribute {
        /// The instruction.
        inst: InstId,
        /// It, printed.
        at: String,
        /// What is wrong.
        problem: String,
    },
    /// An argument is not a value of the module, or its defining instruction was removed.
    #[error("{at}: argument {index} ({value}) is not defined by any instruction of the module")]
    Undefined {
        /// The instruction.
        inst: InstId,
        /// It, printed.
        at: String,
        /// 0-based argument position.
        index: usize,
        /// The value, `%name`.
        value: String,
    },
    /// An argument is defined at or after its use in execution order.
    #[error("{at}: {value} is used before its definition by {def}")]
    UseBeforeDef {
        /// The instruction.
        inst: InstId,
        /// It, printed.
        at: String,
        /// The value, `%name`.
        value: String,
        /// Its defining instruction.
        def: InstId,
    },
    /// The op is not allowed in the instruction's section.
    #[error("{at}: `{op}` is not allowed in the {} section ({problem})", section.keyword())]
    Section {
        /// The instruction.
        inst: InstId,
        /// It, printed.
        at: String,
        /// The op name.
        op: &'static str,
        /// The section it is in.
        section: Section,
        /// Where it belongs.
        problem: String,
    },
    /// A `loss` or `grad_of` marker is inconsistent.
    #[error("{at}: {problem}")]
    Marker {
        /// The instruction.
        inst: InstId,
        /// It, printed.
        at: String,
        /// What is wrong.
        problem: String,
    },
    /// A value itself is malformed (empty or zero-sized shape, inconsistent definition).
    #[error("{value}: {problem}")]
    Value {
        /// The instruction that defines (lists) the value.
        inst: InstId,
        /// The value, `%name`.
        value: String,
        /// What is wrong.
        problem: String,
    },
    /// A property of the module as a whole (e.g. no `loss` marker).
    #[error("module: {problem}")]
    Module {
        /// What is wrong.
        problem: String,
    },
}

impl VerifierError {
    /// The instruction the error is attached to (printed under it by
    /// [`Module::display_with_errors`]); `None` for module-level errors.
    pub fn inst(&self) -> Option<InstId> {
        match self {
            VerifierError::ArgCount { inst, .. }
            | VerifierError::ResultCount { inst, .. }
            | VerifierError::Operand { inst, .. }
            | VerifierError::Attribute { inst, .. }
            | VerifierError::Undefined { inst, .. }
            | VerifierError::UseBeforeDef { inst, .. }
            | VerifierError::Section { inst, .. }
            | VerifierError::Marker { inst, .. }
            | VerifierError::Value { inst, .. } => Some(*inst),
            VerifierError::Module { .. } => None,
        }
    }
}

/// Checks `module` (see the module docs for the rules). Returns every error found, in program
/// order, or `Ok(())` for a well-formed module.
pub fn verify(module: &Module) -> Result<(), Vec<VerifierError>> {
    let mut v = Verifier::new(module);
    v.run();
    if v.errors.is_empty() {
        Ok(())
    } else {
        Err(v.errors)
    }
}

impl Module {
    /// Runs the verifier on this module; see [`verify`].
    pub fn verify(&self) -> Result<(), Vec<VerifierError>> {
        verify(self)
    }
}

/// Module-wide facts collected before the per-instruction checks.
pub(crate) struct Verifier<'m> {
    pub(crate) m: &'m Module,
    /// Execution position of every live instruction.
    pub(crate) order: HashMap<InstId, usize>,
    /// `grad_of` markers: parameter → gradient.
    pub(crate) grads: HashMap<ValueId, ValueId>,
    pub(crate) errors: Vec<VerifierError>,
}

/// `inst<n> (%a, %b = op)` or `inst<n> (op)`.
pub(crate) fn describe(m: &Module, id: InstId) -> String {
    let inst = m.inst(id);
    let results: Vec<String> = inst.results.iter().map(|&r| m.display_value(r)).collect();
    match results.is_empty() {
        true => format!("{id} ({})", inst.op.name()),
        false => format!("{id} ({} = {})", results.join(", "), inst.op.name()),
    }
}

impl<'m> Verifier<'m> {
    fn new(m: &'m Module) -> Self {
        let order = Section::ALL
            .iter()
            .flat_map(|&s| m.section(s))
            .enumerate()
            .map(|(i, id)| (id, i))
            .collect();
        Verifier {
            m,
            order,
            grads: HashMap::new(),
            errors: Vec::new(),
        }
    }

    /// The live instruction defining `v`, if any.
    pub(crate) fn def(&self, v: ValueId) -> Option<InstId> {
        if !self.m.contains_value(v) {
            return None;
        }
        let d = self.m.value(v).def;
        self.order.contains_key(&d).then_some(d)
    }

    /// The `state` class of `v`'s definition, if `v` is a `state` buffer.
    pub(crate) fn state_class(&self, v: ValueId) -> Option<BufferClass> {
        match self.def(v).map(|d| &self.m.inst(d).op) {
            Some(Op::State { class, .. }) => Some(*class),
            _ => None,
        }
    }

    fn run(&mut self) {
        let m = self.m;
        let exec: Vec<InstId> = Section::ALL.iter().flat_map(|&s| m.section(s)).collect();
        // grad_of markers first: optimizer ops refer to them.
        for &id in &exec {
            let inst = m.inst(id);
            if inst.op == Op::GradOf
                && inst.args.len() == 2
                && inst.args.iter().all(|&a| self.def(a).is_some())
            {
                let (p, g) = (inst.args[0], inst.args[1]);
                if self.grads.insert(p, g).is_some() {
                    let problem =
                        format!("{} has more than one `grad_of` marker", m.display_value(p));
                    self.errors.push(VerifierError::Marker {
                        inst: id,
                        at: describe(m, id),
                        problem,
                    });
                }
            }
        }
        let mut first_loss: Option<InstId> = None;
        for &id in &exec {
            self.check_values(id);
            self.check_section(id);
            if m.inst(id).op == Op::Loss {
                match first_loss {
                    None => first_loss = Some(id),
                    Some(first) => self.errors.push(VerifierError::Marker {
                        inst: id,
                        at: describe(m, id),
                        problem: format!("more than one `loss` marker (the first is {first})"),
                    }),
                }
            }
            if self.check_operands_defined(id) {
                if let Err(e) = ops::check_inst(self, id) {
                    self.errors.push(e);
                }
            }
        }
        if first_loss.is_none() {
            self.errors.push(VerifierError::Module {
                problem: "no `loss` marker (exactly one is required)".into(),
            });
        }
    }

    /// Results: listed by exactly this instruction, with a non-empty, non-zero shape.
    fn check_values(&mut self, id: InstId) {
        let m = self.m;
        for &r in &m.inst(id).results {
            let value = m.display_value(r);
            let problem = if !m.contains_value(r) {
                Some("is not a value of the module".to_string())
            } else if m.value(r).def != id {
                Some(format!(
                    "is listed as a result of {id} but defined by {}",
                    m.value(r).def
                ))
            } else {
                let ty = &m.value(r).ty;
                let numel = ty.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
                if ty.shape.is_empty() || ty.shape.contains(&0) {
                    Some(format!("has an empty or zero-sized shape {ty}"))
                } else if numel.is_none_or(|n| n > (1usize << 40)) {
                    Some(format!("is absurdly large: {ty}"))
                } else {
                    None
                }
            };
            if let Some(problem) = problem {
                self.errors.push(VerifierError::Value {
                    inst: id,
                    value,
                    problem,
                });
            }
        }
    }

    fn check_section(&mut self, id: InstId) {
        let inst = self.m.inst(id);
        let (op, section) = (&inst.op, inst.section);
        let home = match op {
            Op::State { .. } | Op::Input { .. } => {
                Some((Section::State, "state buffers and inputs"))
            }
            Op::Loss => Some((Section::Forward, "the loss marker")),
            Op::GradOf => Some((Section::Backward, "gradient markers")),
            Op::EigenbasisRefresh { .. } => Some((Section::Refresh, "host tasks")),
            _ if op.is_in_place() => Some((Section::Optimizer, "in-place optimizer ops")),
            _ => None,
        };
        let problem = match home {
            Some((s, what)) if s != section => {
                Some(format!("{what} belong in the {} section", s.keyword()))
            }
            None if section == Section::State => {
                Some("the state section holds only `state` and `input`".into())
            }
            None if section == Section::Refresh => {
                Some("the refresh section holds only `eigenbasis_refresh` host tasks".into())
            }
            _ => None,
        };
        if let Some(problem) = problem {
            let at = describe(self.m, id);
            self.errors.push(VerifierError::Section {
                inst: id,
                at,
                op: op.name(),
                section,
                problem,
            });
        }
    }

    /// Every argument is defined by a live instruction that runs earlier. Returns whether the
    /// per-op checks can look at the arguments' types.
    fn check_operands_defined(&mut self, id: InstId) -> bool {
        let m = self.m;
        let here = self.order.get(&id).copied().unwrap_or(usize::MAX);
        let mut ok = true;
        for (index, &a) in m.inst(id).args.iter().enumerate() {
            let value = m.display_value(a);
            match self.def(a) {
                None => {
                    ok = false;
                    self.errors.push(VerifierError::Undefined {
                        inst: id,
                        at: describe(m, id),
                        index,
                        value,
                    });
                }
                Some(def) if self.order.get(&def).is_none_or(|&d| d >= here) => {
                    self.errors.push(VerifierError::UseBeforeDef {
                        inst: id,
                        at: describe(m, id),
                        value,
                        def,
                    });
                }
                Some(_) => {}
            }
        }
        ok && m.inst(id).results.iter().all(|&r| m.contains_value(r))
    }
}
