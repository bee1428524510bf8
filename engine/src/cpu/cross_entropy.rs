//! Mean softmax cross-entropy over the rows of a logits matrix (numerically stable
//! log-sum-exp), and its gradient.
use super::{check_len, Float};
use crate::EngineError;
use rayon::prelude::*;

/// Checks targets are in `[0, vocab)` and the sizes agree; returns N.
fn check<T>(
    op: &'static str,
    logits: &[T],
    targets: &[i32],
    vocab: usize,
) -> Result<usize, EngineError> {
    let n = targets.len();
    check_len(op, "logits", logits.len(), n * vocab)?;
    if let Some(position) = targets.iter().position(|&t| t < 0 || t as usize >= vocab) {
        return Err(EngineError::IndexOutOfRange {
            op,
            what: "target",
            position,
            value: targets[position] as i64,
            bound: vocab,
        });
    }
    Ok(n)
}

/// Rows per rayon task: about 64k logits.
fn rows_per_task(vocab: usize) -> usize {
    (1 << 16) / vocab.max(1) + 1
}

/// Mean cross-entropy in nats: `loss = (1/N) Σ_n [logsumexp(logits[n, :]) − logits[n, targets[n]]]`.
///
/// logits `[N, vocab]`, targets i32 `[N]`. A target outside `[0, vocab)` is
/// [`EngineError::IndexOutOfRange`]. Per-row losses are added in row order in f64, so the
/// result does not depend on the thread count. Returns the loss as f64 (non-finite logits give
/// a non-finite loss, not an error).
pub fn cross_entropy_forward<T: Float>(
    logits: &[T],
    targets: &[i32],
    vocab: usize,
) -> Result<f64, EngineError> {
    let n = check("cross_entropy", logits, targets, vocab)?;
    if n == 0 {
        return Ok(0.0);
    }
    let rows: Vec<f64> = logits
        .par_chunks(vocab)
        .with_min_len(rows_per_task(vocab))
        .zip(targets.par_iter())
        .map_init(
            || vec![T::zero(); vocab],
            |scratch, (row, &t)| {
                let m = T::max_of(row);
                scratch.copy_from_slice(row);
                let sum = T::exp_shift_sum(scratch, m);
                m.to_f64() + sum.to_f64().ln() - row[t as usize].to_f64()
            },
        )
        .collect();
    Ok(rows.iter().sum::<f64>() / n as f64)
}

/// `dlogits = (softmax(logits) − onehot(targets)) / N`, the gradient of
/// [`cross_entropy_forward`] (overwrites `dlogits`). logits/dlogits `[N, vocab]`, targets `[N]`.
pub fn cross_entropy_backward<T: Float>(
    logits: &[T],
    targets: &[i32],
    dlogits: &mut [T],
    vocab: usize,
) -> Result<(), EngineError> {
    let n = check("cross_entropy_backward", logits, targets, vocab)?;
    check_len(
        "cross_entropy_backward",
        "dlogits",
        dlogits.len(),
        logits.len(),
    )?;
    if n == 0 {
        return Ok(());
    }
    let inv_n = T::from_f64(1.0 / n as f64);
    dlogits
        .par_chunks_mut(vocab)
        .with_min_len(rows_per_task(vocab))
        .zip(logits.par_chunks(vocab).zip(targets.par_iter()))
        .for_each(|(d, (row, &t))| {
            let m = T::max_of(row);
            d.copy_from_slice(row);
            let sum = T::exp_shift_sum(d, m);
            let k = inv_n / sum;
            d.iter_mut().for_each(|v| *v *= k);
            d[t as usize] -= inv_n;
        });
    Ok(())
}
