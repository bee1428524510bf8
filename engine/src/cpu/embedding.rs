//! Token embedding lookup and its gradient (scatter-add into the table).
use super::{check_len, Float};
use crate::EngineError;
use rayon::prelude::*;

/// Checks that every id is in `[0, vocab)`.
fn check_ids(
    op: &'static str,
    what: &'static str,
    ids: &[i32],
    vocab: usize,
) -> Result<(), EngineError> {
    match ids.iter().position(|&id| id < 0 || id as usize >= vocab) {
        Some(position) => Err(EngineError::IndexOutOfRange {
            op,
            what,
            position,
            value: ids[position] as i64,
            bound: vocab,
        }),
        None => Ok(()),
    }
}

/// `out[n, :] = table[ids[n], :]`.
///
/// table `[vocab, c]`, ids i32 `[N]`, out `[N, c]`. An id outside `[0, vocab)` is
/// [`EngineError::IndexOutOfRange`] (nothing is written).
pub fn embedding_forward<T: Float>(
    table: &[T],
    vocab: usize,
    c: usize,
    ids: &[i32],
    out: &mut [T],
) -> Result<(), EngineError> {
    check_len("embedding", "table", table.len(), vocab * c)?;
    check_len("embedding", "out", out.len(), ids.len() * c)?;
    check_ids("embedding", "token id", ids, vocab)?;
    out.par_chunks_mut(c)
        .with_min_len(super::min_rows(c))
        .zip(ids.par_iter())
        .for_each(|(row, &id)| {
            let id = id as usize;
            row.copy_from_slice(&table[id * c..(id + 1) * c]);
        });
    Ok(())
}

/// `dtable = 0; dtable[ids[n], :] += dout[n, :]` (overwrites `dtable`).
///
/// dout `[N, c]`, ids i32 `[N]`, dtable `[vocab, c]`. Rows are accumulated in order `n = 0..N`,
/// so the result is deterministic.
pub fn embedding_backward<T: Float>(
    dout: &[T],
    ids: &[i32],
    dtable: &mut [T],
    vocab: usize,
    c: usize,
) -> Result<(), EngineError> {
    check_len("embedding_backward", "dtable", dtable.len(), vocab * c)?;
    check_len("embedding_backward", "dout", dout.len(), ids.len() * c)?;
    check_ids("embedding_backward", "token id", ids, vocab)?;
    dtable
        .par_iter_mut()
        .with_min_len(1 << 14)
        .for_each(|x| *x = T::zero());
    for (n, &id) in ids.iter().enumerate() {
        let id = id as usize;
        let dst = &mut dtable[id * c..(id + 1) * c];
        for (d, &g) in dst.iter_mut().zip(&dout[n * c..(n + 1) * c]) {
            *d += g;
        }
    }
    Ok(())
}
