//! `simplify`: rewrites the expression of every `elementwise_update` (an optimizer defined by
//! its rule, `optim::optimizers`) with `optim::update::simplify` — egg's equality saturation
//! over named rules that are exact in IEEE f32, plus constant folding of the hyperparameters
//! `expand-optimizer` substituted (`(- 1 0.9)` becomes `0.100000024`) — and extracts the smallest
//! equivalent expression, shared subterms once. Values are unchanged bit for bit (each rule is
//! tested on random and special f32 inputs in `optim::update`); the engines then run fewer
//! operations per element. Runs after `expand-optimizer`; visible with `--print-after simplify`,
//! whose extra lines give each distinct rule's node counts before and after.
use crate::{Pass, PassContext, PassError};
use ir::{Module, Op, Section};
use optim::update::{simplify, Update};
use std::collections::BTreeMap;

/// The `simplify` pass.
#[derive(Default)]
pub struct Simplify {
    /// Per distinct input expression: (label: the optimizer, whether it decays weights, the
    /// results it writes; nodes before, nodes after, updates, stop reason).
    report: BTreeMap<String, (String, usize, usize, usize, String)>,
}

impl Pass for Simplify {
    fn name(&self) -> &'static str {
        "simplify"
    }

    fn run(&mut self, module: &mut Module, _cx: &mut PassContext) -> Result<String, PassError> {
        self.report.clear();
        let ids: Vec<_> = module.section(Section::Optimizer).collect();
        let mut done: BTreeMap<String, String> = BTreeMap::new();
        for id in ids {
            let Op::ElementwiseUpdate { rule } = module.inst(id).op.clone() else {
                continue;
            };
            let simplified = match done.get(&rule.expr) {
                Some(s) => s.clone(),
                None => {
                    let expr: egg::RecExpr<Update> =
                        rule.expr.parse().map_err(|e| PassError::Invalid {
                            pass: "simplify",
                            message: format!("the `{}` rule does not parse: {e}", rule.optimizer),
                        })?;
                    let (best, r) = simplify(&expr);
                    let text = best.to_string();
                    let decay = rule.scalars.iter().any(|s| {
                        matches!(
                            s,
                            schedule::StepScalar::Decay { .. }
                                | schedule::StepScalar::NegLrWd { .. }
                        )
                    });
                    let mut label = format!(
                        "{} ({} weight decay",
                        rule.optimizer,
                        if decay { "with" } else { "without" }
                    );
                    if !rule.results.is_empty() {
                        label.push_str(&format!("; writes {}", rule.results.join(", ")));
                    }
                    label.push(')');
                    self.report
                        .insert(rule.expr.clone(), (label, r.before, r.after, 0, r.stop));
                    done.insert(rule.expr.clone(), text.clone());
                    text
                }
            };
            if let Some(e) = self.report.get_mut(&rule.expr) {
                e.3 += 1;
            }
            if let Op::ElementwiseUpdate { rule } = module.op_mut(id) {
                rule.expr = simplified;
            }
        }
        if self.report.is_empty() {
            return Ok("no element-wise update rules".into());
        }
        let (before, after) = self
            .report
            .values()
            .fold((0, 0), |(b, a), r| (b + r.1 * r.3, a + r.2 * r.3));
        Ok(format!(
            "{} distinct update rules: {before} -> {after} expression nodes over all updates",
            self.report.len()
        ))
    }

    fn dump_extra(&self, _module: &Module, _cx: &PassContext) -> Option<String> {
        if self.report.is_empty() {
            return None;
        }
        let mut s = String::from(
            "; simplify (egg: exact f32 rules + constant folding), per distinct rule:\n",
        );
        for (label, before, after, n, stop) in self.report.values() {
            let stop = stop.to_lowercase();
            s.push_str(&format!(
                ";   {label}: {before} -> {after} expression nodes, {n} parameters \
                 (egg: {stop})\n"
            ));
        }
        Some(s)
    }
}
