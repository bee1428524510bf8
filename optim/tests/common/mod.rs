//! Shared helpers of the optim integration tests: a tiny deterministic RNG, matrix checks,
//! and a driver that runs the library's SOAP functions in the engine's order.
#![allow(dead_code)]

use optim::{
    eigenbasis_refresh, soap_factor_update, soap_update, HostEigensolver, Real, SoapParams,
};

/// SplitMix64: deterministic, dependency-free pseudo-random numbers.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
    pub fn vec(&mut self, len: usize) -> Vec<f64> {
        (0..len).map(|_| self.uniform()).collect()
    }
}

/// max |a − b| / max |b|.
pub fn rel_err<T: Real>(a: &[T], b: &[T]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x.f64() - y.f64()).abs())
        .fold(0.0, f64::max);
    let den = b.iter().map(|y| y.f64().abs()).fold(0.0, f64::max);
    if den == 0.0 {
        num
    } else {
        num / den
    }
}

/// max |QᵀQ − I| of a row-major `[d, d]` matrix.
pub fn orthonormality_error<T: Real>(q: &[T], d: usize) -> f64 {
    let mut worst = 0.0f64;
    for a in 0..d {
        for b in 0..d {
            let dot: f64 = (0..d)
                .map(|i| q[i * d + a].f64() * q[i * d + b].f64())
                .sum();
            let target = if a == b { 1.0 } else { 0.0 };
            worst = worst.max((dot - target).abs());
        }
    }
    worst
}

pub fn bits<T: Real>(x: &[T]) -> Vec<u64> {
    x.iter().map(|v| v.f64().to_bits()).collect()
}

pub fn cast<T: Real>(x: &[f64]) -> Vec<T> {
    x.iter().map(|&v| T::of(v)).collect()
}

/// The state of one SOAP parameter as the engine holds it, driven through the library.
#[derive(Clone, Debug)]
pub struct LibParam<T> {
    pub m: usize,
    pub n: usize,
    pub param: Vec<T>,
    pub exp_avg: Vec<T>,
    pub exp_avg_sq: Vec<T>,
    pub factor_left: Option<Vec<T>>,
    pub factor_right: Option<Vec<T>>,
    pub basis_left: Option<Vec<T>>,
    pub basis_right: Option<Vec<T>>,
}

impl<T: Real> LibParam<T> {
    /// A 2-D parameter `[m, n]` with zero moments and factors; sides over `max_precond_dim`
    /// get no factor/basis. A 1-D parameter is `m = 1, one_d = true` (no factors at all).
    pub fn new(param: Vec<T>, m: usize, n: usize, max_precond_dim: usize, one_d: bool) -> Self {
        let [dl, dr] = if one_d {
            [None, None]
        } else {
            optim::precond_dims(m, n, max_precond_dim)
        };
        let ident = |d: usize| {
            let mut q = vec![T::zero(); d * d];
            for i in 0..d {
                q[i * d + i] = T::one();
            }
            q
        };
        LibParam {
            m,
            n,
            param,
            exp_avg: vec![T::zero(); m * n],
            exp_avg_sq: vec![T::zero(); m * n],
            factor_left: dl.map(|d| vec![T::zero(); d * d]),
            factor_right: dr.map(|d| vec![T::zero(); d * d]),
            basis_left: dl.map(ident),
            basis_right: dr.map(ident),
        }
    }

    /// SoapUpdate only.
    pub fn update(&mut self, t: u64, lr: f64, hp: &SoapParams, grad: &[T]) {
        soap_update(
            t,
            lr,
            hp,
            &mut self.param,
            grad,
            &mut self.exp_avg,
            &mut self.exp_avg_sq,
            self.basis_left.as_deref(),
            self.basis_right.as_deref(),
            self.m,
            self.n,
        )
        .expect("shapes");
    }

    /// SoapFactorUpdate then EigenbasisRefresh for each side with a factor.
    pub fn after_update(
        &mut self,
        solver: &dyn HostEigensolver,
        t: u64,
        freq: u64,
        shampoo_beta: f64,
        grad: &[T],
    ) {
        soap_factor_update(
            grad,
            self.factor_left.as_deref_mut(),
            self.factor_right.as_deref_mut(),
            self.m,
            self.n,
            shampoo_beta,
        )
        .expect("shapes");
        for side in 0..2u8 {
            let (factor, basis) = if side == 0 {
                (&self.factor_left, &mut self.basis_left)
            } else {
                (&self.factor_right, &mut self.basis_right)
            };
            if let (Some(f), Some(q)) = (factor, basis) {
                eigenbasis_refresh(
                    solver,
                    t,
                    freq,
                    side,
                    f,
                    q,
                    &mut self.exp_avg,
                    &mut self.exp_avg_sq,
                    self.m,
                    self.n,
                )
                .expect("refresh");
            }
        }
    }

    /// One full engine step: update, factor update, refreshes.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        solver: &dyn HostEigensolver,
        t: u64,
        lr: f64,
        hp: &SoapParams,
        freq: u64,
        shampoo_beta: f64,
        grad: &[T],
    ) {
        self.update(t, lr, hp, grad);
        self.after_update(solver, t, freq, shampoo_beta, grad);
    }
}

/// Deterministic gradient of step `t` for a `[m, n]` parameter. At t = 1, rows (or
/// columns) past `min(m, n)` are zero on a side that has a factor, so the step-1 factor's
/// null space is spanned by coordinate vectors: its eigenvectors are then unique up to
/// order and sign (which SOAP is invariant to while the moments are zero), and two
/// independent eigensolvers agree.
pub fn gradient(
    seed: u64,
    t: u64,
    m: usize,
    n: usize,
    rotate_left: bool,
    rotate_right: bool,
) -> Vec<f64> {
    let mut rng = Rng(seed.wrapping_mul(1_000_003).wrapping_add(t));
    let mut g = rng.vec(m * n);
    if t == 1 {
        let r = m.min(n);
        for i in 0..m {
            for j in 0..n {
                if (rotate_left && i >= r) || (rotate_right && j >= r) {
                    g[i * n + j] = 0.0;
                }
            }
        }
    }
    g
}
