//! The [`PassManager`]: runs the pipeline with `--print-before`, `--print-after`,
//! `--print-after-all`, `--verify-each` and `--time-passes`, in the style of LLVM's and
//! Cranelift's pass drivers.
use crate::{Pass, PassContext, PassError};
use ir::Module;
use std::time::Instant;

/// What the pass manager prints and checks between passes.
#[derive(Clone, Debug, Default)]
pub struct PassOptions {
    /// Print the IR before these passes.
    pub print_before: Vec<String>,
    /// Print the IR after these passes.
    pub print_after: Vec<String>,
    /// Print the IR after every pass.
    pub print_after_all: bool,
    /// Run the IR verifier after every pass (it always runs once after the last IR pass).
    pub verify_each: bool,
    /// Record per-pass wall time.
    pub time_passes: bool,
    /// Optional passes not to run ([`PassManager::SKIPPABLE`]: `fuse`, `copy-hoisting`,
    /// `copy-out-overlap`), e.g. to compare a fused plan with the unfused one.
    pub skip: Vec<String>,
    /// `fuse` rules not to apply ([`crate::fuse::Fuse::SKIPPABLE_RULES`]: the instruction
    /// selections of composed optimizer steps), e.g. to measure a hand-written op against the
    /// composition it replaces.
    pub skip_rules: Vec<String>,
    /// `fuse` rules to apply where the target leaves them out by default
    /// ([`crate::fuse::Fuse::off_by_default`]: `soap-update` on CUDA targets), e.g. to measure
    /// the hand-written op against the composition.
    pub apply_rules: Vec<String>,
}

/// Wall time of one pass.
#[derive(Clone, Debug)]
pub struct PassTiming {
    /// Pass name.
    pub pass: &'static str,
    /// Wall time in milliseconds.
    pub ms: f64,
    /// The pass's one-line summary.
    pub summary: String,
}

/// Runs the fixed asteria pipeline.
pub struct PassManager {
    passes: Vec<Box<dyn Pass>>,
    options: PassOptions,
}

impl PassManager {
    /// The passes [`PassOptions::skip`] may name: those whose output the rest of the pipeline
    /// does not need (the others build the program or the plan).
    pub const SKIPPABLE: [&'static str; 3] = ["fuse", "copy-hoisting", "copy-out-overlap"];

    /// Names of the pipeline's passes, in order.
    pub fn pass_names() -> Vec<&'static str> {
        Self::default_passes().iter().map(|p| p.name()).collect()
    }

    fn default_passes() -> Vec<Box<dyn Pass>> {
        vec![
            Box::new(crate::expand_model::ExpandModel),
            Box::new(crate::autodiff::Autodiff),
            Box::new(crate::expand_optimizer::ExpandOptimizer),
            Box::new(crate::simplify::Simplify::default()),
            Box::new(crate::fuse::Fuse::default()),
            Box::new(crate::rematerialize::Rematerialize::default()),
            Box::new(crate::liveness::LivenessPass),
            Box::new(crate::precond_scheduling::PrecondScheduling::default()),
            Box::new(crate::lower::Lower),
            Box::new(crate::accumulate_gradients::AccumulateGradients),
            Box::new(crate::tier_placement::TierPlacement::default()),
            Box::new(crate::prefetch_insertion::PrefetchInsertion::default()),
            Box::new(crate::copy_hoisting::CopyHoisting),
            Box::new(crate::memory_planning::MemoryPlanning),
            Box::new(crate::copy_out_overlap::CopyOutOverlap),
        ]
    }

    /// A manager for the default pipeline. Fails if a print option names an unknown pass, or
    /// `skip` a pass that is not [`PassManager::SKIPPABLE`].
    pub fn new(options: PassOptions) -> Result<Self, PassError> {
        let names = Self::pass_names();
        for n in options
            .print_after
            .iter()
            .chain(&options.print_before)
            .chain(&options.skip)
        {
            if !names.contains(&n.as_str()) {
                return Err(PassError::UnknownPass { name: n.clone() });
            }
        }
        if let Some(n) = options
            .skip
            .iter()
            .find(|n| !Self::SKIPPABLE.contains(&n.as_str()))
        {
            return Err(PassError::Options(format!(
                "pass `{n}` cannot be skipped (skippable: {})",
                Self::SKIPPABLE.join(", ")
            )));
        }
        if let Some(r) = options
            .skip_rules
            .iter()
            .chain(&options.apply_rules)
            .find(|r| !crate::fuse::Fuse::SKIPPABLE_RULES.contains(&r.as_str()))
        {
            return Err(PassError::Options(format!(
                "`fuse` has no skippable rule `{r}` (skippable: {})",
                crate::fuse::Fuse::SKIPPABLE_RULES.join(", ")
            )));
        }
        if let Some(r) = options
            .apply_rules
            .iter()
            .find(|r| !crate::fuse::Fuse::APPLICABLE_RULES.contains(&r.as_str()))
        {
            return Err(PassError::Options(format!(
                "`fuse` rule `{r}` applies on every target already (--apply-rule takes: {})",
                crate::fuse::Fuse::APPLICABLE_RULES.join(", ")
            )));
        }
        if let Some(r) = options
            .skip_rules
            .iter()
            .find(|r| options.apply_rules.contains(r))
        {
            return Err(PassError::Options(format!(
                "`fuse` rule `{r}` is both skipped and applied"
            )));
        }
        let mut passes = Self::default_passes();
        for p in &mut passes {
            if p.name() == "fuse" {
                *p = Box::new(crate::fuse::Fuse::with_rules(
                    &options.skip_rules,
                    &options.apply_rules,
                ));
            }
        }
        Ok(PassManager { passes, options })
    }

    /// Runs the single pass `name` on `module` (file tests: IR in, IR out), then verifies.
    /// Returns the context and the pass's extra dump text (analysis report, decisions).
    pub fn run_one(
        name: &str,
        module: &mut Module,
    ) -> Result<(PassContext, Option<String>), PassError> {
        let mut cx = PassContext::default();
        let mut pass = Self::default_passes()
            .into_iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| PassError::UnknownPass {
                name: name.to_string(),
            })?;
        pass.run(module, &mut cx)?;
        crate::budget::check(module, pass.name())?;
        if let Err(errors) = module.verify() {
            return Err(PassError::Verify {
                pass: name.to_string(),
                count: errors.len(),
                ir_text: module.display_with_errors(&errors),
            });
        }
        let extra = pass.dump_extra(module, &cx);
        Ok((cx, extra))
    }

    /// Runs every pass up to and including `stop_after` (all when `None`) on `module`.
    /// Dumps requested by the options are written to `out`. Returns the context (liveness,
    /// plan) and the per-pass timings.
    pub fn run(
        &mut self,
        module: &mut Module,
        stop_after: Option<&str>,
        out: &mut dyn std::io::Write,
    ) -> Result<(PassContext, Vec<PassTiming>), PassError> {
        let mut cx = PassContext::default();
        let mut timings = Vec::new();
        for pass in &mut self.passes {
            let name = pass.name();
            if self.options.print_before.iter().any(|p| p == name) {
                // Passes after `lower` work on the plan: show it as it stands.
                match &cx.plan {
                    Some(plan) => {
                        let _ = writeln!(out, "{}", plan_listing(plan, name));
                    }
                    None => {
                        let _ = writeln!(out, "; IR before {name}\n{module}");
                    }
                }
            }
            let _span = tracing::info_span!("pass", name).entered();
            let start = Instant::now();
            let summary = match self.options.skip.iter().any(|p| p == name) {
                true => "skipped".to_string(),
                false => pass.run(module, &mut cx)?,
            };
            crate::budget::check(module, name)?;
            let ms = start.elapsed().as_secs_f64() * 1e3;
            tracing::debug!(pass = name, ms, %summary, "pass done");
            if self.options.verify_each || stop_after == Some(name) || name == "liveness" {
                if let Err(errors) = module.verify() {
                    return Err(PassError::Verify {
                        pass: name.to_string(),
                        count: errors.len(),
                        ir_text: module.display_with_errors(&errors),
                    });
                }
            }
            if self.options.print_after_all || self.options.print_after.iter().any(|p| p == name) {
                let _ = writeln!(out, "{}", pass.dump_after(module, &cx));
            }
            timings.push(PassTiming {
                pass: name,
                ms,
                summary,
            });
            if stop_after == Some(name) {
                break;
            }
        }
        Ok((cx, timings))
    }
}

/// `--print-before` of a pass that works on the plan: every op of the step's programs with its
/// operands by name, then the memory plan's arenas and each host task.
fn plan_listing(plan: &schedule::Plan, pass: &str) -> String {
    use std::fmt::Write as _;
    let mut s = format!("; plan before {pass}\n");
    for (section, program) in [
        ("forward", &plan.forward),
        ("backward", &plan.backward),
        ("optimizer", &plan.optimizer),
    ] {
        for (i, op) in program.iter().enumerate() {
            let names: Vec<String> = op
                .operands()
                .iter()
                .map(|(f, id)| format!("{f}=%{}", plan.buffer(*id).name))
                .collect();
            let _ = writeln!(s, ";   {section}[{i}] {} {}", op.name(), names.join(" "));
        }
    }
    for t in &plan.host_tasks {
        let names: Vec<String> = t
            .operands()
            .iter()
            .map(|(f, id)| format!("{f}=%{}", plan.buffer(*id).name))
            .collect();
        let _ = writeln!(s, ";   host eigenbasis_refresh {}", names.join(" "));
    }
    for a in &plan.memory.arenas {
        let _ = writeln!(s, "; arena {} {} bytes", a.kind.name(), a.bytes);
    }
    s
}
