//! asteria's compiler passes and the [`PassManager`] that runs them.
//!
//! The pipeline (in order; names are identical in the CLI flags, file names, dump headers and
//! timing lines): `expand-model`, `autodiff`, `expand-optimizer`, `fuse`, `rematerialize`,
//! `liveness`, `precond-scheduling`, `lower`, `accumulate-gradients`, `tier-placement`,
//! `prefetch-insertion`, `copy-hoisting`, `memory-planning`, `copy-out-overlap` (the last six
//! work on the plan).
#![deny(missing_docs)]

pub mod accumulate_gradients;
pub mod autodiff;
pub mod budget;
pub mod copy_hoisting;
pub mod copy_out_overlap;
pub mod cost_model;
pub mod expand_model;
pub mod expand_optimizer;
pub mod fuse;
mod host_updates;
pub mod liveness;
pub mod lower;
mod manager;
pub mod memory_planning;
pub mod precond_scheduling;
pub mod prefetch_insertion;
pub mod rematerialize;
pub mod simplify;
pub mod tier_placement;

pub use manager::{PassManager, PassOptions, PassTiming};

use ir::Module;
use thiserror::Error;

/// Error raised by a pass or by the verifier between passes.
#[derive(Debug, Error)]
pub enum PassError {
    /// The module failed verification after (or before) a pass; `ir_text` is the module with
    /// the errors printed inline.
    #[error("IR verification failed after `{pass}`: {count} error(s)\n{ir_text}")]
    Verify {
        /// Pass after which verification ran.
        pass: String,
        /// Number of errors.
        count: usize,
        /// The IR with `; error:` annotations.
        ir_text: String,
    },
    /// A pass found the module in a state it cannot handle (e.g. `autodiff` before
    /// `expand-model`).
    #[error("pass `{pass}`: {message}")]
    Invalid {
        /// Pass name.
        pass: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The pass-manager flags ask for something it cannot do (skip a pass that is not
    /// skippable, an unknown `fuse` rule).
    #[error("{0}")]
    Options(String),
    /// The module's tensors need more memory than any target holds (see [`budget`]).
    #[error(
        "pass `{pass}`: the tensors of this spec need {total} with one place each, more than the \
         16 TiB any host or device holds (or one tensor has more than 2^40 elements); \
         the largest: {}; reduce batch_size, seq_len, vocab, d_model, mlp_hidden, layers or \
         max_precond_dim",
        largest.join(", ")
    )]
    TooLarge {
        /// The pass after which the ceiling was exceeded.
        pass: &'static str,
        /// All tensors together (`16.50 TiB`, or `more than 2^64 bytes`).
        total: String,
        /// The largest tensors: `%logits f32[1048576, 1048576] (4.00 TiB)`.
        largest: Vec<String>,
    },
    /// An unknown pass name was given to `--print-after` / `--print-before`.
    #[error("unknown pass `{name}`; passes are: {}", PassManager::pass_names().join(", "))]
    UnknownPass {
        /// The name given.
        name: String,
    },
}

/// Results of analyses and lowering that passes leave for later passes and for the caller.
#[derive(Default, Debug)]
pub struct PassContext {
    /// Filled by `liveness`.
    pub liveness: Option<liveness::Liveness>,
    /// Filled by `lower` (memory plan: one place per buffer), updated by `memory-planning`.
    pub plan: Option<schedule::Plan>,
    /// Filled by `memory-planning`: arena sizes, peak live bytes, bytes saved.
    pub memory: Option<memory_planning::MemorySummary>,
}

/// One compiler pass: a named transformation (or analysis) of a [`Module`].
pub trait Pass {
    /// The pass name (kebab-case, as in `--print-after`).
    fn name(&self) -> &'static str;
    /// Runs the pass. Returns a one-line summary of what it did (for `--time-passes` / logs).
    fn run(&mut self, module: &mut Module, cx: &mut PassContext) -> Result<String, PassError>;
    /// Extra text printed after the IR in `--print-after` dumps (analysis results).
    fn dump_extra(&self, _module: &Module, _cx: &PassContext) -> Option<String> {
        None
    }
    /// What `--print-after` prints for this pass: by default `; IR after <name>`, the IR and
    /// [`Pass::dump_extra`]; passes that work on the plan print the plan (or a report on it).
    fn dump_after(&self, module: &Module, cx: &PassContext) -> String {
        let mut s = format!("; IR after {}\n{module}", self.name());
        if let Some(extra) = self.dump_extra(module, cx) {
            s.push('\n');
            s.push_str(&extra);
        }
        s
    }
}
