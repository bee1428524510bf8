//! The engine's one error type. Every runtime problem (a bad plan, an out-of-range token id, a
//! failed data load, repeated eigensolver failures) is an [`EngineError`], never a panic.
use thiserror::Error;

/// Anything that can go wrong while building or running a plan.
#[derive(Debug, Error)]
pub enum EngineError {
    /// The plan failed [`schedule::Plan::verify`].
    #[error("invalid plan: {0}")]
    Plan(#[from] schedule::PlanError),
    /// A kernel received a slice of the wrong length (only possible when buffers were
    /// replaced behind the engine's back, or a kernel is called directly with bad sizes).
    #[error("{op}: operand `{operand}` has {got} elements, expected {expected}")]
    Shape {
        /// Kernel name.
        op: &'static str,
        /// Operand name.
        operand: &'static str,
        /// Required element count.
        expected: usize,
        /// Actual element count.
        got: usize,
    },
    /// A token id or target is outside `[0, bound)`.
    #[error("{op}: {what} {value} at position {position} is outside [0, {bound})")]
    IndexOutOfRange {
        /// Kernel name.
        op: &'static str,
        /// `token id` or `target`.
        what: &'static str,
        /// Row of the offending value.
        position: usize,
        /// The value.
        value: i64,
        /// Exclusive upper bound (vocabulary size).
        bound: usize,
    },
    /// An op writes a buffer that it also reads (the plan format forbids in-place kernels
    /// except the optimizer's).
    #[error("{location}: output `{operand}` aliases one of its inputs (buffer {buffer})")]
    Aliased {
        /// Where (`forward[3] (mat_mul)`).
        location: String,
        /// Output operand name.
        operand: &'static str,
        /// Buffer name.
        buffer: String,
    },
    /// A buffer has the wrong element type for how it is used.
    #[error("buffer `{buffer}` is {actual}, expected {expected}")]
    DType {
        /// Buffer name.
        buffer: String,
        /// Required dtype.
        expected: &'static str,
        /// Actual dtype.
        actual: &'static str,
    },
    /// No buffer with this name.
    #[error("no buffer named `{0}`")]
    UnknownBuffer(String),
    /// `set_buffer` / `load_batch` got the wrong number of values.
    #[error("buffer `{buffer}` has {expected} elements, got {got} values")]
    Length {
        /// Buffer name.
        buffer: String,
        /// Buffer element count.
        expected: usize,
        /// Values given.
        got: usize,
    },
    /// The same eigenbasis refresh failed too many times in a row.
    #[error("host task {task} (eigenbasis refresh of `{factor}`) failed {failures} times in a row (limit {limit}); last error: {last}")]
    RefreshFailures {
        /// Index in `plan.host_tasks`.
        task: usize,
        /// Name of the factor buffer.
        factor: String,
        /// Consecutive failures.
        failures: u32,
        /// The configured limit.
        limit: u32,
        /// The last failure's message.
        last: String,
    },
    /// The run diverged: `skipped` consecutive optimizer steps, the last at `step`, were
    /// skipped for a non-finite gradient norm, reaching the plan's `train.max_skipped_steps`.
    #[error(
        "training stopped at step {step}: {skipped} consecutive steps were skipped for a \
         non-finite gradient norm (max_skipped_steps = {limit}); {}; the run has diverged: \
         lower the optimizer's `lr` (or its `weight_decay`, or lengthen `warmup`), or clip \
         harder with a smaller `grad_clip`",
        last_finite(.last_finite_loss)
    )]
    Diverged {
        /// 1-based step at which the limit was reached.
        step: u64,
        /// Consecutive skipped steps (= the limit).
        skipped: u64,
        /// The plan's `train.max_skipped_steps`.
        limit: u64,
        /// `(step, training loss in nats)` of the last step whose loss was finite; `None`
        /// when no step had a finite loss.
        last_finite_loss: Option<(u64, f64)>,
    },
    /// An optimizer kernel from `asteria-optim` rejected its inputs.
    #[error("{location}: optimizer kernel failed: {message}")]
    Optim {
        /// Where (`optimizer[2] (soap_update)`).
        location: String,
        /// The optimizer crate's message.
        message: String,
    },
    /// Loading or tokenizing the corpus, or sampling batches, failed.
    #[error("data: {0}")]
    Data(#[from] data::DataError),
    /// Creating or writing a file of the run failed (the `--metrics` file); the run stops.
    #[error("{what} {path} failed: {source}")]
    Io {
        /// What was being done (`writing the metrics file`).
        what: &'static str,
        /// File path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The plan asks for something this engine cannot do (a CUDA target, ...).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The plan's buffers need more memory than the machine has free (checked before
    /// allocating; see [`crate::fits`]).
    #[error(
        "plan `{plan}` needs {needed} for its buffers but {place} has {available} available; \
         the largest buffers: {largest}; reduce batch_size, seq_len or the model"
    )]
    OutOfMemory {
        /// The plan's name.
        plan: String,
        /// Where (`host memory`, `GPU 0 (NVIDIA H200)`).
        place: String,
        /// Bytes needed, human-readable.
        needed: String,
        /// Bytes free, human-readable.
        available: String,
        /// The largest buffers with their shapes and sizes.
        largest: String,
    },
    /// A training option is invalid.
    #[error("invalid option: {0}")]
    Option(String),
    /// An offload tier (host store, NVMe store) failed: a full or missing directory, a failed
    /// read or write, or a block whose checksum does not match (the step stops before the
    /// corrupt state is used).
    #[error("offload tier: {0}")]
    Tier(String),
    /// A checkpoint that cannot be written, read or used: an I/O error, a corrupt or
    /// truncated file (checksum), or state that does not match the plan.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// The run was interrupted (SIGINT / SIGTERM) after finishing a step; the message says
    /// where its checkpoint is, if one was taken.
    #[error("interrupted: {0}")]
    Interrupted(String),
}

/// The last finite training loss for [`EngineError::Diverged`]'s message.
fn last_finite(last: &Option<(u64, f64)>) -> String {
    match last {
        Some((step, loss)) if loss.abs() < 1e6 => {
            format!("last finite training loss {loss:.4} at step {step}")
        }
        Some((step, loss)) => format!("last finite training loss {loss:.4e} at step {step}"),
        None => "no step had a finite training loss".into(),
    }
}
