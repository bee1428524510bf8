//! Shared helpers for the engine's integration tests: seeded random inputs, the random
//! projection loss and the relative error metric.
#![allow(dead_code)]
use engine::Rng;

/// `n` standard-normal f64 values scaled by `scale`.
pub fn randn(rng: &mut Rng, n: usize, scale: f64) -> Vec<f64> {
    (0..n).map(|_| scale * rng.normal()).collect()
}

/// `n` ids uniform in `[0, bound)`.
pub fn rand_ids(rng: &mut Rng, n: usize, bound: usize) -> Vec<i32> {
    (0..n)
        .map(|_| (rng.next_u64() % bound as u64) as i32)
        .collect()
}

/// `Σ r ⊙ out`.
pub fn project(r: &[f64], out: &[f64]) -> f64 {
    assert_eq!(r.len(), out.len());
    r.iter().zip(out).map(|(a, b)| a * b).sum()
}

/// `max|a − b| / max(max|a|, max|b|, 1e-30)`.
pub fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    let scale = a.iter().chain(b).map(|x| x.abs()).fold(1e-30, f64::max);
    diff / scale
}

/// Central finite differences of `loss` with respect to every element of `x`, step `h`.
pub fn numeric_grad(x: &[f64], h: f64, mut loss: impl FnMut(&[f64]) -> f64) -> Vec<f64> {
    let mut xp = x.to_vec();
    (0..x.len())
        .map(|i| {
            let orig = xp[i];
            xp[i] = orig + h;
            let lp = loss(&xp);
            xp[i] = orig - h;
            let lm = loss(&xp);
            xp[i] = orig;
            (lp - lm) / (2.0 * h)
        })
        .collect()
}

/// Asserts `rel_err(analytic, numeric) ≤ tol` with a readable message.
pub fn assert_close(what: &str, analytic: &[f64], numeric: &[f64], tol: f64) {
    let e = rel_err(analytic, numeric);
    assert!(
        e <= tol,
        "{what}: relative error {e:e} > {tol:e}\nanalytic {analytic:?}\nnumeric  {numeric:?}"
    );
}
pub mod gpt;
