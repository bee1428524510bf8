//! [`PlanError`]: why a plan document was rejected, by [`crate::Plan::from_json`] or
//! [`crate::Plan::verify`] (module `verify`) — before the engine allocates or runs anything.
use crate::{BufferId, DType, PLAN_FORMAT, PLAN_VERSION};
use thiserror::Error;

/// Why a plan was rejected.
#[derive(Debug, Error, PartialEq)]
pub enum PlanError {
    /// The JSON did not parse (truncated, not JSON, missing or mistyped field).
    #[error("plan is not a valid asteria plan document (line {line}, column {column}): {message}")]
    Json {
        /// 1-based line of the JSON error.
        line: usize,
        /// 1-based column.
        column: usize,
        /// serde_json's message.
        message: String,
    },
    /// Wrong `format` or `version`.
    #[error("unsupported plan format {format:?} version {version} (this engine reads {PLAN_FORMAT:?} version {PLAN_VERSION}; recompile the spec with `asteria compile`)")]
    Version {
        /// The document's format string.
        format: String,
        /// The document's version.
        version: u32,
    },
    /// An operand refers to a buffer that does not exist.
    #[error("{location}: operand `{operand}` refers to buffer {id}, but the plan has only {count} buffers")]
    BufferOutOfRange {
        /// Where (`forward[3] (matmul)`).
        location: String,
        /// Operand name.
        operand: &'static str,
        /// The bad id.
        id: BufferId,
        /// Number of buffers.
        count: usize,
    },
    /// An operand has the wrong shape or dtype for its op.
    #[error("{location}: operand `{operand}` (buffer {id} `{name}`, shape {shape:?}, {dtype:?}) {problem}")]
    Operand {
        /// Where (`forward[3] (matmul)`).
        location: String,
        /// Operand name.
        operand: &'static str,
        /// Buffer id.
        id: BufferId,
        /// Buffer name.
        name: String,
        /// Buffer shape.
        shape: Vec<usize>,
        /// Buffer dtype.
        dtype: DType,
        /// What is wrong.
        problem: String,
    },
    /// Any other inconsistency (empty shape, zero-sized dimension, duplicate names, bad
    /// attribute values).
    #[error("{0}")]
    Invalid(String),
    /// A hyperparameter or setting is outside the range its spec key allows
    /// ([`crate::limits`]).
    #[error("{field} = {value} is outside the allowed range {range}")]
    OutOfRange {
        /// Where (`optimizer[3] (adam_w): lr`, `train.eval_batches`).
        field: String,
        /// The value found.
        value: String,
        /// The allowed range (`(0, 10]`, `1..=100_000`).
        range: String,
    },
    /// The memory plan is unsafe or inconsistent (a slot outside its arena, a misaligned
    /// offset, a persistent buffer sharing bytes, two live buffers sharing bytes).
    #[error("memory plan: {0}")]
    Memory(String),
}
