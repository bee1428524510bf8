//! `lower`: IR → execution plan (`schedule::Plan`), via `codegen::lower`, with every buffer in
//! its own place (`memory-planning` then shares the bytes of step-local buffers).
use crate::{Pass, PassContext, PassError};
use ir::Module;

/// The `lower` pass. The module is unchanged; the plan is left in [`PassContext::plan`].
pub struct Lower;

impl Pass for Lower {
    fn name(&self) -> &'static str {
        "lower"
    }
    fn run(&mut self, module: &mut Module, cx: &mut PassContext) -> Result<String, PassError> {
        let plan = codegen::lower(module).map_err(|e| PassError::Invalid {
            pass: "lower",
            message: e.to_string(),
        })?;
        let summary = format!(
            "{} buffers, {} forward / {} backward / {} optimizer ops, {} host tasks",
            plan.buffers.len(),
            plan.forward.len(),
            plan.backward.len(),
            plan.optimizer.len(),
            plan.host_tasks.len()
        );
        cx.plan = Some(plan);
        Ok(summary)
    }
    fn dump_after(&self, _module: &Module, cx: &PassContext) -> String {
        match &cx.plan {
            Some(plan) => format!("; plan after lower\n{}", plan.to_json()),
            None => "; plan after lower: none".into(),
        }
    }
}
