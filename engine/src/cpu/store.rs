//! The interpreter's buffer store: one `Vec` per plan buffer (f32-family or i32), with
//! take/put access so an op can mutate its outputs while reading its inputs.
//!
//! bf16 buffers (`DType::Bf16`, outputs the `fuse` pass has their producer write in bf16) are
//! kept in the float storage `T` like f32 ones, and every value written to them — by an op
//! ([`Store::with_outs`]) or by `set_buffer` — is rounded to the nearest bf16, ties to even
//! ([`schedule::round_to_bf16`], through f32 for `T = f64`): the values the CUDA engine's
//! bf16 buffers hold, so both engines compute with the same numbers.
use super::Float;
use crate::EngineError;
use schedule::{BufferId, DType, Plan};

/// Contents of one buffer.
#[derive(Clone, Debug)]
pub(crate) enum Data<T> {
    /// A float buffer (`DType::F32` in the plan; `T` in this engine).
    F(Vec<T>),
    /// An i32 buffer (token ids, targets).
    I(Vec<i32>),
}

/// Where an op sits in the plan, for error messages (`forward[3] (mat_mul)`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Loc {
    pub section: &'static str,
    pub index: usize,
    pub op: &'static str,
}

impl std::fmt::Display for Loc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}[{}] ({})", self.section, self.index, self.op)
    }
}

/// All buffers of a plan, indexed by [`BufferId`].
#[derive(Clone, Debug)]
pub(crate) struct Store<T> {
    pub(crate) data: Vec<Data<T>>,
    pub(crate) names: Vec<String>,
    pub(crate) shapes: Vec<Vec<usize>>,
    /// Per buffer: a bf16 buffer (values rounded to bf16 on every write).
    pub(crate) bf16: Vec<bool>,
}

/// Rounds every value of `v` to the nearest bf16 (ties to even), kept in `T`.
pub(crate) fn round_slice_to_bf16<T: Float>(v: &mut [T]) {
    for x in v.iter_mut() {
        let r = schedule::round_to_bf16(Float::to_f64(*x) as f32);
        *x = <T as Float>::from_f64(f64::from(r));
    }
}

impl<T: Float> Store<T> {
    /// Zero-filled buffers for every plan buffer; a buffer offloaded to the `host` or `nvme`
    /// tier gets no working storage (its bytes live in the engine's tier stores and reach ops
    /// through its staging buffer).
    pub(crate) fn zeros(plan: &Plan) -> Self {
        let data = plan
            .buffers
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let n = if plan
                    .memory
                    .tier(BufferId(i as u32))
                    .is_some_and(|t| !t.on_device())
                {
                    0
                } else {
                    b.numel()
                };
                match b.dtype {
                    DType::F32 | DType::Bf16 => Data::F(vec![T::zero(); n]),
                    DType::I32 => Data::I(vec![0; n]),
                }
            })
            .collect();
        Store {
            data,
            names: plan.buffers.iter().map(|b| b.name.clone()).collect(),
            shapes: plan.buffers.iter().map(|b| b.shape.clone()).collect(),
            bf16: plan
                .buffers
                .iter()
                .map(|b| b.dtype == DType::Bf16)
                .collect(),
        }
    }

    fn name(&self, id: BufferId) -> String {
        self.names
            .get(id.index())
            .cloned()
            .unwrap_or_else(|| id.to_string())
    }

    /// The float contents of `id`.
    pub(crate) fn f(&self, id: BufferId) -> Result<&[T], EngineError> {
        match self.data.get(id.index()) {
            Some(Data::F(v)) => Ok(v),
            Some(Data::I(_)) => Err(EngineError::DType {
                buffer: self.name(id),
                expected: "f32",
                actual: "i32",
            }),
            None => Err(EngineError::UnknownBuffer(id.to_string())),
        }
    }

    /// The optional float contents of `id`.
    pub(crate) fn opt_f(&self, id: Option<BufferId>) -> Result<Option<&[T]>, EngineError> {
        id.map(|id| self.f(id)).transpose()
    }

    /// The i32 contents of `id`.
    pub(crate) fn i(&self, id: BufferId) -> Result<&[i32], EngineError> {
        match self.data.get(id.index()) {
            Some(Data::I(v)) => Ok(v),
            Some(Data::F(_)) => Err(EngineError::DType {
                buffer: self.name(id),
                expected: "i32",
                actual: "f32",
            }),
            None => Err(EngineError::UnknownBuffer(id.to_string())),
        }
    }

    /// Mutable float contents of `id`.
    pub(crate) fn f_mut(&mut self, id: BufferId) -> Result<&mut Vec<T>, EngineError> {
        let name = self.name(id);
        match self.data.get_mut(id.index()) {
            Some(Data::F(v)) => Ok(v),
            Some(Data::I(_)) => Err(EngineError::DType {
                buffer: name,
                expected: "f32",
                actual: "i32",
            }),
            None => Err(EngineError::UnknownBuffer(id.to_string())),
        }
    }

    /// Shape of buffer `id` (empty for an unknown id).
    pub(crate) fn shape(&self, id: BufferId) -> &[usize] {
        self.shapes.get(id.index()).map_or(&[], Vec::as_slice)
    }

    /// Shape `[rows, cols]` of a 2-D buffer (a 1-D buffer `[n]` is `[1, n]`).
    pub(crate) fn dims2(&self, id: BufferId) -> (usize, usize) {
        match self.shapes.get(id.index()).map(Vec::as_slice) {
            Some([r, c]) => (*r, *c),
            Some([n]) => (1, *n),
            Some(s) => (s.first().copied().unwrap_or(0), s.iter().skip(1).product()),
            None => (0, 0),
        }
    }

    /// Overwrites buffer `id` with NaN (float) or `i32::MIN` (i32): garbage that reaches the
    /// results if anything reads it before writing it (see `EngineOptions::poison_transients`).
    pub(crate) fn poison(&mut self, id: BufferId) {
        match self.data.get_mut(id.index()) {
            Some(Data::F(v)) => v.fill(T::from_f64(f64::NAN)),
            Some(Data::I(v)) => v.fill(i32::MIN),
            None => {}
        }
    }

    /// Runs `f` with the float buffers `outs` taken out of the store (mutable, in that order)
    /// while the rest of the store stays readable, then puts them back (also on error),
    /// rounding the values of bf16 outputs to bf16.
    ///
    /// `reads` are the op's input operands: an output that is also an input is
    /// [`EngineError::Aliased`] (optimizer ops list their in-place state only as outputs).
    /// Outputs must be distinct.
    pub(crate) fn with_outs<R>(
        &mut self,
        loc: Loc,
        outs: &[(&'static str, BufferId)],
        reads: &[BufferId],
        f: impl FnOnce(&Store<T>, &mut [Vec<T>]) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        for (i, &(operand, id)) in outs.iter().enumerate() {
            if reads.contains(&id) || outs[..i].iter().any(|o| o.1 == id) {
                return Err(EngineError::Aliased {
                    location: loc.to_string(),
                    operand,
                    buffer: self.name(id),
                });
            }
            self.f(id)?;
        }
        let mut taken: Vec<Vec<T>> = Vec::with_capacity(outs.len());
        for &(_, id) in outs {
            taken.push(std::mem::take(self.f_mut(id)?));
        }
        let result = f(self, &mut taken);
        for (&(_, id), v) in outs.iter().zip(taken.iter_mut()) {
            if self.bf16.get(id.index()).copied().unwrap_or(false) {
                round_slice_to_bf16(v);
            }
        }
        for (&(_, id), v) in outs.iter().zip(taken) {
            if let Some(Data::F(slot)) = self.data.get_mut(id.index()) {
                *slot = v;
            }
        }
        result
    }
}
