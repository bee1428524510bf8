//! The element type the CPU kernels are generic over: `f32` for training, `f64` for gradient
//! checks. Every kernel is written once against [`Float`].
use std::fmt::{Debug, Display};

/// A real floating-point element type usable by every CPU kernel and by faer's GEMM.
///
/// Implemented for `f32` (training) and `f64` (finite-difference gradient checks). Arithmetic
/// comes from faer's `RealField` (which includes `num_traits::Num`); the transcendental
/// functions the kernels need are listed here.
pub trait Float:
    faer::traits::RealField
    + Copy
    + Send
    + Sync
    + Default
    + Debug
    + Display
    + std::ops::Neg<Output = Self>
    + 'static
{
    /// Number of bytes per element.
    const BYTES: usize;
    /// Converts from `f64` (rounding to nearest for `f32`).
    fn from_f64(v: f64) -> Self;
    /// Converts to `f64` (exact).
    fn to_f64(self) -> f64;
    /// `eˣ`.
    fn exp(self) -> Self;
    /// Natural logarithm.
    fn ln(self) -> Self;
    /// Square root.
    fn sqrt(self) -> Self;
    /// Hyperbolic tangent.
    fn tanh(self) -> Self;
    /// Sine.
    fn sin(self) -> Self;
    /// Cosine.
    fn cos(self) -> Self;
    /// Larger of two values (NaN-propagation unspecified).
    fn max(self, other: Self) -> Self;
    /// `v` as f32 when `Self` is `f32` (for the f32-only host kernels), else `None`.
    fn as_f32_mut(v: &mut [Self]) -> Option<&mut [f32]>;
    /// `v` as f32 when `Self` is `f32`, else `None`.
    fn as_f32(v: &[Self]) -> Option<&[f32]>;
    /// True when neither NaN nor ±∞.
    fn is_finite(self) -> bool;
    /// In-place `xs[i] = exp(xs[i] − shift)`; returns `Σ xs[i]` after the update.
    ///
    /// The `f32` version uses a vectorizable polynomial `exp` (Cody–Waite range reduction,
    /// degree-6 minimax-style Taylor polynomial, relative error ≲ 2·10⁻⁷), which keeps the
    /// 50k-wide softmax of a GPT-2 vocabulary cheap; the `f64` version calls `f64::exp`.
    fn exp_shift_sum(xs: &mut [Self], shift: Self) -> Self;
    /// Largest element (NaNs are ignored; `−∞` for an empty slice). Vectorized for `f32`.
    fn max_of(xs: &[Self]) -> Self;
    /// Stores the f64 `x` exactly at the start of `out` (an `f32` store: its bits in two
    /// words, as the CUDA engine's f64 partial sums sit in an f32 plan buffer; `f64`: one).
    /// `out` has at least two elements.
    fn put_f64(out: &mut [Self], x: f64);
    /// The f64 [`Float::put_f64`] stored at the start of `v`.
    fn get_f64(v: &[Self]) -> f64;
}

impl Float for f64 {
    fn put_f64(out: &mut [Self], x: f64) {
        out[0] = x;
    }
    fn get_f64(v: &[Self]) -> f64 {
        v[0]
    }
    fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    const BYTES: usize = 8;
    fn from_f64(v: f64) -> Self {
        v
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn ln(self) -> Self {
        f64::ln(self)
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    fn tanh(self) -> Self {
        f64::tanh(self)
    }
    fn sin(self) -> Self {
        f64::sin(self)
    }
    fn cos(self) -> Self {
        f64::cos(self)
    }
    fn max(self, other: Self) -> Self {
        f64::max(self, other)
    }
    fn is_finite(self) -> bool {
        f64::is_finite(self)
    }
    fn exp_shift_sum(xs: &mut [Self], shift: Self) -> Self {
        let mut s = 0.0;
        for x in xs.iter_mut() {
            *x = (*x - shift).exp();
            s += *x;
        }
        s
    }
    fn max_of(xs: &[Self]) -> Self {
        xs.iter()
            .fold(f64::NEG_INFINITY, |a, &v| if v > a { v } else { a })
    }
}

impl Float for f32 {
    fn put_f64(out: &mut [Self], x: f64) {
        let b = x.to_bits();
        out[0] = f32::from_bits(b as u32);
        out[1] = f32::from_bits((b >> 32) as u32);
    }
    fn get_f64(v: &[Self]) -> f64 {
        f64::from_bits(u64::from(v[0].to_bits()) | (u64::from(v[1].to_bits()) << 32))
    }
    fn as_f32_mut(v: &mut [Self]) -> Option<&mut [f32]> {
        Some(v)
    }
    fn as_f32(v: &[Self]) -> Option<&[f32]> {
        Some(v)
    }
    const BYTES: usize = 4;
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn exp(self) -> Self {
        f32::exp(self)
    }
    fn ln(self) -> Self {
        f32::ln(self)
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    fn tanh(self) -> Self {
        f32::tanh(self)
    }
    fn sin(self) -> Self {
        f32::sin(self)
    }
    fn cos(self) -> Self {
        f32::cos(self)
    }
    fn max(self, other: Self) -> Self {
        f32::max(self, other)
    }
    fn is_finite(self) -> bool {
        f32::is_finite(self)
    }
    fn exp_shift_sum(xs: &mut [Self], shift: Self) -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above).
            return unsafe { avx2::exp_shift_sum(xs, shift) };
        }
        exp_shift_sum_f32(xs, shift)
    }
    fn max_of(xs: &[Self]) -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above).
            return unsafe { avx2::max_of(xs) };
        }
        max_of_f32(xs)
    }
}

/// The same loops compiled with AVX2 enabled (8 f32 lanes instead of SSE2's 4), selected at
/// run time.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn exp_shift_sum(xs: &mut [f32], shift: f32) -> f32 {
        super::exp_shift_sum_f32(xs, shift)
    }
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn max_of(xs: &[f32]) -> f32 {
        super::max_of_f32(xs)
    }
}

/// Portable body of `<f32 as Float>::exp_shift_sum`: eight independent lanes so the loop
/// vectorizes.
#[inline(always)]
fn exp_shift_sum_f32(xs: &mut [f32], shift: f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = xs.chunks_exact_mut(8);
    for c in &mut chunks {
        let mut e = [0.0f32; 8];
        for j in 0..8 {
            e[j] = fast_exp_f32(c[j] - shift);
        }
        for j in 0..8 {
            acc[j] += e[j];
        }
        c.copy_from_slice(&e);
    }
    let mut s: f32 = 0.0;
    for x in chunks.into_remainder() {
        *x = fast_exp_f32(*x - shift);
        s += *x;
    }
    s + acc.iter().sum::<f32>()
}

/// Portable body of `<f32 as Float>::max_of` (eight lanes, NaNs ignored).
#[inline(always)]
fn max_of_f32(xs: &[f32]) -> f32 {
    let Some(&first) = xs.first() else {
        return f32::NEG_INFINITY;
    };
    let mut acc = [first; 8];
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for j in 0..8 {
            acc[j] = if c[j] > acc[j] { c[j] } else { acc[j] };
        }
    }
    let m = chunks
        .remainder()
        .iter()
        .fold(first, |a, &v| if v > a { v } else { a });
    acc.iter().fold(m, |a, &v| if v > a { v } else { a })
}

/// Branch-free `eˣ` for `f32`, accurate to about 2 ulp on `[−87, 88]`; returns 0 below −87
/// (inputs here are `≤ 0` after the max shift). NaN in gives NaN out.
#[inline(always)]
#[allow(clippy::manual_clamp)] // `clamp` would not let NaN through branch-free
pub fn fast_exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let xc = if x < -87.0 {
        -87.0
    } else if x > 88.0 {
        88.0
    } else {
        x
    };
    // Round to nearest with the 1.5·2²³ trick (vectorizes without SSE4.1's roundps).
    const MAGIC: f32 = 12_582_912.0;
    let kf = xc * LOG2E + MAGIC;
    let ki = kf.to_bits() as i32 - MAGIC.to_bits() as i32;
    let k = kf - MAGIC;
    let r = xc - k * LN2_HI - k * LN2_LO;
    // exp(r) on |r| ≤ ln2/2 with a degree-6 Taylor polynomial (error < 2e-8 relative).
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let bits = ((ki + 127) << 23) as u32;
    let y = p * f32::from_bits(bits);
    let y = if x < -87.0 { 0.0 } else { y };
    if x.is_nan() {
        x
    } else {
        y
    }
}
