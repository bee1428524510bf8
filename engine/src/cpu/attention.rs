//! Causal multi-head self-attention on a fused `qkv` buffer (GPT-2 layout), forward and
//! backward. Work is split over (batch, head) pairs on the rayon pool; each pair uses faer
//! GEMMs on strided views of `qkv`, and the backward recomputes the probabilities.
//!
//! For one (b, h) with `Q, K, V` `[T, d]` (`d = C / n_heads`), `s = 1/√d`:
//! `S = s·Q Kᵀ`, `P = softmax(S + causal mask)` row-wise, `O = P V`. Backward:
//! `dV = Pᵀ dO`, `dP = dO Vᵀ`, `dS = P ⊙ (dP − rowsum(P ⊙ dP))`, `dQ = s·dS K`, `dK = s·dSᵀ Q`.
use super::{check_len, Float};
use crate::EngineError;
use faer::linalg::matmul::matmul as faer_matmul;
use faer::{Accum, MatMut, MatRef, Par};
use rayon::prelude::*;

/// Geometry of an attention call: qkv `[batch·seq_len, 3C]`, `C = n_heads · head_dim`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    /// Sequences in the batch.
    pub batch: usize,
    /// Tokens per sequence `T`.
    pub seq_len: usize,
    /// Number of heads.
    pub n_heads: usize,
    /// Model width `C` (`out` is `[N, C]`, `qkv` is `[N, 3C]`).
    pub channels: usize,
}

impl AttnDims {
    fn check(&self, op: &'static str, qkv_len: usize) -> Result<usize, EngineError> {
        let n = self.batch * self.seq_len;
        if self.n_heads == 0 || self.channels % self.n_heads != 0 || n == 0 {
            return Err(EngineError::Shape {
                op,
                operand: "qkv",
                expected: 3 * n * self.channels,
                got: qkv_len,
            });
        }
        check_len(op, "qkv", qkv_len, 3 * n * self.channels)?;
        Ok(self.channels / self.n_heads)
    }
}

/// Row-major `[rows, cols]` view of `qkv` starting at `offset` with row stride `stride`.
fn view<T: Float>(
    s: &[T],
    offset: usize,
    rows: usize,
    cols: usize,
    stride: usize,
) -> MatRef<'_, T> {
    MatRef::from_row_major_slice_with_stride(&s[offset..], rows, cols, stride)
}

/// Fills `p` `[T, T]` with the causal softmax probabilities of `s·Q Kᵀ` (zeros above the
/// diagonal).
fn probs<T: Float>(q: MatRef<'_, T>, k: MatRef<'_, T>, p: &mut [T], t: usize, scale: T) {
    faer_matmul(
        MatMut::from_row_major_slice_mut(p, t, t),
        Accum::Replace,
        q,
        k.transpose(),
        scale,
        Par::Seq,
    );
    for i in 0..t {
        let row = &mut p[i * t..(i + 1) * t];
        let (live, masked) = row.split_at_mut(i + 1);
        let m = T::max_of(live);
        let sum = T::exp_shift_sum(live, m);
        let inv = T::one() / sum;
        live.iter_mut().for_each(|v| *v *= inv);
        masked.iter_mut().for_each(|v| *v = T::zero());
    }
}

/// Causal self-attention forward: qkv `[N, 3C]` (`[q | k | v]`, heads contiguous within each),
/// out `[N, C]`, softmax scale `1/√(C/n_heads)`.
pub fn attention_forward<T: Float>(
    qkv: &[T],
    out: &mut [T],
    d: &AttnDims,
) -> Result<(), EngineError> {
    let hd = d.check("attention", qkv.len())?;
    let (t, c) = (d.seq_len, d.channels);
    check_len("attention", "out", out.len(), d.batch * t * c)?;
    let w = 3 * c;
    let scale = T::from_f64(1.0 / (hd as f64).sqrt());
    let heads: Vec<Vec<T>> = (0..d.batch * d.n_heads)
        .into_par_iter()
        .map_init(
            || vec![T::zero(); t * t],
            |p, bh| {
                let (b, h) = (bh / d.n_heads, bh % d.n_heads);
                let base = b * t * w + h * hd;
                let q = view(qkv, base, t, hd, w);
                let k = view(qkv, base + c, t, hd, w);
                let v = view(qkv, base + 2 * c, t, hd, w);
                probs(q, k, p, t, scale);
                let mut o = vec![T::zero(); t * hd];
                let pv = MatRef::from_row_major_slice(p.as_slice(), t, t);
                faer_matmul(
                    MatMut::from_row_major_slice_mut(&mut o, t, hd),
                    Accum::Replace,
                    pv,
                    v,
                    T::one(),
                    Par::Seq,
                );
                o
            },
        )
        .collect();
    for (bh, o) in heads.iter().enumerate() {
        let (b, h) = (bh / d.n_heads, bh % d.n_heads);
        for i in 0..t {
            let dst = (b * t + i) * c + h * hd;
            out[dst..dst + hd].copy_from_slice(&o[i * hd..(i + 1) * hd]);
        }
    }
    Ok(())
}

/// The softmax statistics of [`attention_forward`] that a saving forward keeps for its
/// backward (plan `Attention { lse: Some(..) }`): `lse[(b·NH + h)·T + t]` = the base-2
/// log-sum-exp `log₂ Σ_{s ≤ t} 2^(q_t·k_s · scale · log₂e)` of row t's scaled causal scores
/// (the CUDA tensor-core kernels' convention), accumulated in f64. lse f32-family
/// `[B·NH·T]` (overwritten).
pub fn attention_lse<T: Float>(qkv: &[T], lse: &mut [T], d: &AttnDims) -> Result<(), EngineError> {
    let hd = d.check("attention", qkv.len())?;
    let (t, c) = (d.seq_len, d.channels);
    check_len("attention", "lse", lse.len(), d.batch * d.n_heads * t)?;
    let w = 3 * c;
    let scale = 1.0 / (hd as f64).sqrt();
    lse.par_chunks_mut(t).enumerate().for_each(|(bh, rows)| {
        let (b, h) = (bh / d.n_heads, bh % d.n_heads);
        let base = b * t * w + h * hd;
        let dot = |i: usize, j: usize| -> f64 {
            (0..hd)
                .map(|e| qkv[base + i * w + e].to_f64() * qkv[base + c + j * w + e].to_f64())
                .sum::<f64>()
                * scale
        };
        for (i, out) in rows.iter_mut().enumerate() {
            let s: Vec<f64> = (0..=i).map(|j| dot(i, j)).collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = s.iter().map(|v| (v - m).exp()).sum();
            *out = T::from_f64((m + sum.ln()) * std::f64::consts::LOG2_E);
        }
    });
    Ok(())
}

/// Causal self-attention backward (probabilities recomputed from `qkv`): dout `[N, C]`,
/// qkv/dqkv `[N, 3C]` (dqkv fully overwritten).
pub fn attention_backward<T: Float>(
    dout: &[T],
    qkv: &[T],
    dqkv: &mut [T],
    d: &AttnDims,
) -> Result<(), EngineError> {
    let hd = d.check("attention_backward", qkv.len())?;
    let (t, c) = (d.seq_len, d.channels);
    check_len("attention_backward", "dout", dout.len(), d.batch * t * c)?;
    check_len("attention_backward", "dqkv", dqkv.len(), qkv.len())?;
    let w = 3 * c;
    let scale = T::from_f64(1.0 / (hd as f64).sqrt());
    let grads: Vec<[Vec<T>; 3]> = (0..d.batch * d.n_heads)
        .into_par_iter()
        .map_init(
            || (vec![T::zero(); t * t], vec![T::zero(); t * t]),
            |(p, dp), bh| {
                let (b, h) = (bh / d.n_heads, bh % d.n_heads);
                let base = b * t * w + h * hd;
                let q = view(qkv, base, t, hd, w);
                let k = view(qkv, base + c, t, hd, w);
                let v = view(qkv, base + 2 * c, t, hd, w);
                let go = view(dout, b * t * c + h * hd, t, hd, c);
                probs(q, k, p, t, scale);
                let pm = MatRef::from_row_major_slice(p.as_slice(), t, t);
                let mut dv = vec![T::zero(); t * hd];
                faer_matmul(
                    MatMut::from_row_major_slice_mut(&mut dv, t, hd),
                    Accum::Replace,
                    pm.transpose(),
                    go,
                    T::one(),
                    Par::Seq,
                );
                faer_matmul(
                    MatMut::from_row_major_slice_mut(dp, t, t),
                    Accum::Replace,
                    go,
                    v.transpose(),
                    T::one(),
                    Par::Seq,
                );
                for i in 0..t {
                    let (pr, dr) = (&p[i * t..i * t + i + 1], &mut dp[i * t..(i + 1) * t]);
                    let dot = pr
                        .iter()
                        .zip(dr.iter())
                        .fold(T::zero(), |a, (&x, &y)| a + x * y);
                    let (live, masked) = dr.split_at_mut(i + 1);
                    for (g, &pv) in live.iter_mut().zip(pr) {
                        *g = pv * (*g - dot);
                    }
                    masked.iter_mut().for_each(|g| *g = T::zero());
                }
                let ds = MatRef::from_row_major_slice(dp.as_slice(), t, t);
                let mut dq = vec![T::zero(); t * hd];
                let mut dk = vec![T::zero(); t * hd];
                faer_matmul(
                    MatMut::from_row_major_slice_mut(&mut dq, t, hd),
                    Accum::Replace,
                    ds,
                    k,
                    scale,
                    Par::Seq,
                );
                faer_matmul(
                    MatMut::from_row_major_slice_mut(&mut dk, t, hd),
                    Accum::Replace,
                    ds.transpose(),
                    q,
                    scale,
                    Par::Seq,
                );
                [dq, dk, dv]
            },
        )
        .collect();
    for (bh, g) in grads.iter().enumerate() {
        let (b, h) = (bh / d.n_heads, bh % d.n_heads);
        for (part, src) in g.iter().enumerate() {
            for i in 0..t {
                let dst = (b * t + i) * w + part * c + h * hd;
                dqkv[dst..dst + hd].copy_from_slice(&src[i * hd..(i + 1) * hd]);
            }
        }
    }
    Ok(())
}
