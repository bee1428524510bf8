//! Optimizers defined once, as data: the keys of their spec block (defaults, ranges), their
//! state tensors and their element-wise update as an [`crate::update`] expression. The
//! frontend reads the keys, `expand-optimizer` creates the state and the plan's
//! `elementwise_update` op from the expression ([`Definition::plan_rule`]), `simplify`
//! rewrites it, and the engines interpret it (CPU) or compile it (CUDA); nothing else names a
//! particular optimizer. Adding one is a file here with its [`Definition`] and its test against
//! a float64 reference, its line in [`DEFINITIONS`], and an example spec.
//!
//! An update expression reads the tensors `p` (the parameter), `g` (its gradient, after
//! clipping) and the definition's state, `$key` holes (replaced by the f32 value of that
//! hyperparameter; pairs by their two names, `$beta1`), and the step scalars of
//! [`schedule::StepScalar`] (`lr`, `decay`, `step_size`, `bc2_sqrt`), whose hyperparameters
//! come from the keys `weight_decay`, `beta1` and `beta2`. Every definition has an `lr` key.
//! Weight decay applies to parameters of two or more dimensions only (the nanoGPT convention
//! asteria's AdamW follows): `expand-optimizer` passes `weight_decay = 0` for the others, and a
//! zero weight decay makes `decay` the constant 1 (which `simplify` folds away).
use crate::update::{parse_template, Const, RuleError, Update, UpdateRule};
use egg::RecExpr;
use schedule::limits::FloatRange;
use schedule::{BufferClass, ElementwiseRule, StepScalar};
use std::collections::HashMap;

mod adabelief;
pub mod kl_shampoo;
mod lion;
pub mod shampoo;
pub mod soap;

/// Every optimizer defined by an element-wise rule, by spec name.
pub const DEFINITIONS: &[&Definition] = &[&lion::LION, &adabelief::ADABELIEF];

/// The definition named `name`.
pub fn find(name: &str) -> Option<&'static Definition> {
    DEFINITIONS.iter().copied().find(|d| d.name == name)
}

/// One optimizer: what the spec block accepts, the state it keeps and its update.
#[derive(Debug)]
pub struct Definition {
    /// Spec name (`optimizer lion { }`); letters, digits and `_`.
    pub name: &'static str,
    /// One line: what it is and its reference.
    pub summary: &'static str,
    /// The keys of its spec block, each with its default.
    pub keys: &'static [Key],
    /// State tensors, one per parameter each, of the parameter's shape, zero-initialised.
    pub state: &'static [StateTensor],
    /// The tensor each item of the rule's `list` overwrites (`p` or a state variable).
    pub outputs: &'static [&'static str],
    /// The update expression (see the module docs).
    pub rule: &'static str,
}

/// A key of an optimizer's spec block.
#[derive(Debug)]
pub struct Key {
    /// Spec key (`lr`, `betas`).
    pub name: &'static str,
    /// A number or a pair.
    pub kind: KeyKind,
    /// Allowed values (each of a pair's two).
    pub range: FloatRange,
}

/// The value of a [`Key`].
#[derive(Debug)]
pub enum KeyKind {
    /// A number, with its default.
    Float(f64),
    /// A pair `(a, b)` (written `betas = (0.9, 0.99)`), whose halves are the hyperparameters
    /// named here, with its default.
    Pair([&'static str; 2], (f64, f64)),
}

/// A state tensor of an optimizer.
#[derive(Debug)]
pub struct StateTensor {
    /// Its variable in the update expression (`m`).
    pub var: &'static str,
    /// Its buffer name after the parameter's (`exp_avg`: `wte.exp_avg`).
    pub suffix: &'static str,
    /// Its buffer class (what `tier-placement` and `explain` see).
    pub class: BufferClass,
}

impl Definition {
    /// Hyperparameter names (pairs expanded) with their defaults, in key order.
    pub fn defaults(&self) -> Vec<(String, f64)> {
        let mut v = Vec::new();
        for k in self.keys {
            match k.kind {
                KeyKind::Float(d) => v.push((k.name.to_string(), d)),
                KeyKind::Pair(names, d) => {
                    v.push((names[0].to_string(), d.0));
                    v.push((names[1].to_string(), d.1));
                }
            }
        }
        v
    }

    /// The plan's rule for one parameter with hyperparameters `hyper` (by name, pairs
    /// expanded; a missing one takes its default): holes filled with f32 constants, step
    /// scalars resolved with their hyperparameters.
    ///
    /// # Errors
    /// [`RuleError`] for an expression that does not parse, a hole or variable that names
    /// nothing, or outputs that do not match the expression.
    pub fn plan_rule(&self, hyper: &[(String, f64)]) -> Result<ElementwiseRule, RuleError> {
        let mut values = self.defaults();
        for (k, x) in hyper {
            match values.iter_mut().find(|(n, _)| n == k) {
                Some(slot) => slot.1 = *x,
                None => return Err(RuleError::Unbound(format!("hyperparameter `{k}`"))),
            }
        }
        let get = |n: &str| values.iter().find(|(k, _)| k == n).map(|(_, x)| *x);
        let subs: HashMap<&str, f32> = values
            .iter()
            .map(|(k, x)| (k.as_str(), *x as f32))
            .collect();
        let mut expr = parse_template(self.rule, &subs)?;
        if get("weight_decay") == Some(0.0) {
            // `decay` = 1 − lr·0 is 1 at every step: a constant `simplify` folds away.
            let nodes: Vec<Update> = expr
                .as_ref()
                .iter()
                .map(|n| match n {
                    Update::Var(v) if v.as_str() == "decay" => Update::Num(Const::new(1.0)),
                    n => n.clone(),
                })
                .collect();
            expr = RecExpr::from(nodes);
        }
        let mut scalars = Vec::new();
        for node in expr.as_ref() {
            if let Update::Var(v) = node {
                let v = v.as_str();
                if v == "p" || v == "g" || self.state.iter().any(|s| s.var == v) {
                    continue;
                }
                let sc =
                    StepScalar::from_name(v, get).ok_or_else(|| RuleError::Unbound(v.into()))?;
                if !scalars.contains(&sc) {
                    scalars.push(sc);
                }
            }
        }
        let lr = get("lr").ok_or_else(|| RuleError::Unbound("hyperparameter `lr`".into()))?;
        let rule = ElementwiseRule {
            optimizer: self.name.to_string(),
            lr,
            state: self.state.iter().map(|s| s.var.to_string()).collect(),
            outputs: self.outputs.iter().map(|s| s.to_string()).collect(),
            scalars,
            expr: expr.to_string(),
            results: Vec::new(),
            hyper: Vec::new(),
        };
        rule.check().map_err(RuleError::Outputs)?;
        // Resolves every name and the outputs against the expression.
        crate::update::Program::new(&update_rule(&rule)?)?;
        Ok(rule)
    }
}

/// A plan's rule as an [`UpdateRule`] (for [`crate::update::Program`] and
/// [`crate::update::cuda_kernel`]): tensors `p g` and the state, scalars by name.
///
/// # Errors
/// [`RuleError::Syntax`] when the expression does not parse; [`RuleError::Outputs`] for a rule
/// that fails [`ElementwiseRule::check`].
pub fn update_rule(rule: &ElementwiseRule) -> Result<UpdateRule, RuleError> {
    rule.check().map_err(RuleError::Outputs)?;
    let expr: RecExpr<Update> = rule
        .expr
        .parse()
        .map_err(|e| RuleError::Syntax(format!("{e}")))?;
    // A result's buffer holds nothing before the update writes it.
    if let Some(r) = expr.as_ref().iter().find_map(|n| match n {
        Update::Var(v) if rule.results.iter().any(|r| r == v.as_str()) => Some(v.to_string()),
        _ => None,
    }) {
        return Err(RuleError::Outputs(format!(
            "result `{r}` is read by the expression (a result is written only)"
        )));
    }
    Ok(UpdateRule {
        name: rule.optimizer.clone(),
        tensors: rule.tensors(),
        scalars: rule.scalars.iter().map(|s| s.name().to_string()).collect(),
        outputs: rule.outputs.clone(),
        expr,
    })
}

/// This step's scalar values of `rule` (in its order) at 1-based step `t` with scheduled
/// learning rate `lr_t`, rounded to `T`.
pub fn step_scalars<T: crate::Real>(rule: &ElementwiseRule, lr_t: f64, t: u64) -> Vec<T> {
    rule.scalars
        .iter()
        .map(|s| T::of(s.value(lr_t, t)))
        .collect()
}

/// What the float64 reference tests of the rule-defined optimizers share.
#[cfg(test)]
pub(crate) mod reference {
    /// A deterministic stream of uniform values in [-0.5, 0.5) (splitmix64) from `seed`.
    pub fn uniform(seed: u64) -> impl FnMut() -> f64 {
        let mut state = seed;
        move || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64 - 0.5
        }
    }

    /// `def`'s plan rule at `weight_decay = wd` and its program as the plan runs it, after
    /// `simplify` (which must shrink it: constants folded, shared subterms found).
    pub fn simplified(
        def: &super::Definition,
        wd: f64,
    ) -> (schedule::ElementwiseRule, crate::update::Program) {
        let rule = def
            .plan_rule(&[("weight_decay".to_string(), wd)])
            .expect("rule");
        let r = super::update_rule(&rule).expect("update rule");
        let (expr, report) = crate::update::simplify(&r.expr);
        assert!(report.after < report.before, "{report:?}");
        let prog =
            crate::update::Program::new(&crate::update::UpdateRule { expr, ..r }).expect("program");
        (rule, prog)
    }

    /// max |a − b| / max |b|.
    pub fn rel(a: &[f64], b: &[f64]) -> f64 {
        let num = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        num / b.iter().map(|y| y.abs()).fold(0.0, f64::max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every definition's rule builds at its defaults, has an `lr`, distinct state names and
    /// buffer suffixes, and keys in their ranges.
    #[test]
    fn every_definition_is_well_formed() {
        for d in DEFINITIONS {
            let rule = d
                .plan_rule(&[])
                .unwrap_or_else(|e| panic!("{}: {e}", d.name));
            assert_eq!(rule.optimizer, d.name);
            assert!(d.defaults().iter().any(|(k, _)| k == "lr"), "{}", d.name);
            for k in d.keys {
                match k.kind {
                    KeyKind::Float(x) => assert!(k.range.contains(x), "{}.{}", d.name, k.name),
                    KeyKind::Pair(_, (a, b)) => {
                        assert!(k.range.contains(a) && k.range.contains(b), "{}", k.name)
                    }
                }
            }
            for (i, s) in d.state.iter().enumerate() {
                assert!(d.state[..i]
                    .iter()
                    .all(|o| o.var != s.var && o.suffix != s.suffix));
                // The plan verifier and the checkpoints know optimizer state by these classes.
                assert!(
                    matches!(s.class, BufferClass::ExpAvg | BufferClass::ExpAvgSq),
                    "{}.{}: state class {:?}",
                    d.name,
                    s.var,
                    s.class
                );
            }
            // The spec's built-in optimizers keep their names.
            assert!(
                !["adamw", "soap"].contains(&d.name),
                "{} shadows a built-in",
                d.name
            );
            assert_eq!(find(d.name).map(|f| f.name), Some(d.name));
        }
    }

    #[test]
    fn bad_hyperparameters_and_templates_are_errors() {
        let d = &lion::LION;
        assert!(matches!(
            d.plan_rule(&[("bogus".into(), 1.0)]),
            Err(RuleError::Unbound(_))
        ));
        let bad = Definition {
            rule: "(list (+ m $nothing) p)",
            ..lion::LION
        };
        assert!(matches!(bad.plan_rule(&[]), Err(RuleError::Syntax(_))));
        let bad = Definition {
            rule: "(list (+ m unknown) p)",
            ..lion::LION
        };
        assert_eq!(
            bad.plan_rule(&[]),
            Err(RuleError::Unbound("unknown".into()))
        );
        let bad = Definition {
            rule: "(list m)",
            ..lion::LION
        };
        assert!(matches!(bad.plan_rule(&[]), Err(RuleError::Outputs(_))));
    }

    #[test]
    fn step_scalars_follow_the_schedule() {
        let rule = lion::LION
            .plan_rule(&[("weight_decay".into(), 0.5)])
            .expect("rule");
        let names: Vec<&str> = rule.scalars.iter().map(|s| s.name()).collect();
        assert_eq!(names, ["decay", "lr"]);
        let v: Vec<f64> = step_scalars(&rule, 0.01, 3);
        assert_eq!(v, [1.0 - 0.01 * 0.5, 0.01]);
    }
}
