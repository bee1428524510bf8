//! Learned absolute position embeddings (GPT-2 `wpe`): add and its gradient.
use super::{check_len, Float};
use crate::EngineError;
use rayon::prelude::*;

/// `out[b·T + t, :] = x[b·T + t, :] + pos[t, :]`.
///
/// x/out `[N, c]` with `N` a multiple of `seq_len = T`; pos `[P, c]` with `T ≤ P` (only the first
/// `T` rows are read).
pub fn add_positional<T: Float>(
    x: &[T],
    pos: &[T],
    out: &mut [T],
    c: usize,
    seq_len: usize,
) -> Result<(), EngineError> {
    check_len("add_positional", "out", out.len(), x.len())?;
    if seq_len == 0 || c == 0 || x.len() % (seq_len * c) != 0 || pos.len() < seq_len * c {
        return Err(EngineError::Shape {
            op: "add_positional",
            operand: "pos",
            expected: seq_len * c,
            got: pos.len(),
        });
    }
    out.par_chunks_mut(c)
        .with_min_len(super::min_rows(c))
        .zip(x.par_chunks(c))
        .enumerate()
        .for_each(|(n, (o, xr))| {
            let t = n % seq_len;
            let p = &pos[t * c..(t + 1) * c];
            for ((o, &a), &b) in o.iter_mut().zip(xr).zip(p) {
                *o = a + b;
            }
        });
    Ok(())
}

/// `dpos[t, :] = Σ_b dout[b·T + t, :]` for `t < T`, and zero for `t ≥ T` (overwrites `dpos`).
///
/// dout `[N, c]`, dpos `[P, c]`.
pub fn add_positional_backward<T: Float>(
    dout: &[T],
    dpos: &mut [T],
    c: usize,
    seq_len: usize,
) -> Result<(), EngineError> {
    if seq_len == 0
        || c == 0
        || dout.len() % (seq_len * c) != 0
        || dpos.len() < seq_len * c
        || dpos.len() % c != 0
    {
        return Err(EngineError::Shape {
            op: "add_positional_backward",
            operand: "dpos",
            expected: seq_len * c,
            got: dpos.len(),
        });
    }
    let block = seq_len * c;
    let (head, tail) = dpos.split_at_mut(block);
    tail.iter_mut().for_each(|x| *x = T::zero());
    head.par_chunks_mut(c)
        .enumerate()
        .with_min_len(super::min_rows(c))
        .for_each(|(t, d)| {
            d.iter_mut().for_each(|x| *x = T::zero());
            for b in dout.chunks_exact(block) {
                for (d, &g) in d.iter_mut().zip(&b[t * c..(t + 1) * c]) {
                    *d += g;
                }
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positional_rows_wrap_per_sequence() {
        let x = vec![0.0f64; 2 * 3 * 2];
        let pos: Vec<f64> = (0..8).map(|v| v as f64).collect();
        let mut out = vec![0.0; 12];
        add_positional(&x, &pos, &mut out, 2, 3).expect("valid sizes");
        assert_eq!(out, vec![0., 1., 2., 3., 4., 5., 0., 1., 2., 3., 4., 5.]);
        let mut dpos = vec![9.0; 8];
        add_positional_backward(&out, &mut dpos, 2, 3).expect("valid sizes");
        assert_eq!(dpos, vec![0., 2., 4., 6., 8., 10., 0., 0.]);
    }
}
