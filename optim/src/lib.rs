//! Host-side optimizer math for the asteria engine: AdamW and SOAP (Vyas et al. 2024,
//! reference `nikhilvyas/SOAP` `soap.py`), plus the eigensolvers behind SOAP's eigenbasis
//! refresh.
//!
//! Everything here is a pure function on row-major slices with explicit dimensions; nothing
//! knows about plans, buffers or models. The functions are generic over the float type
//! through [`Real`] (f32 in training, f64 in tests).
//!
//! Conventions shared by every function:
//! - a matrix `[r, c]` is a row-major slice of `r * c` elements;
//! - a SOAP basis `Q` of side `d` is a row-major `[d, d]` matrix whose **columns** are the
//!   basis vectors (as in `soap.py`: `G' = Q_Lᵀ G Q_R`), in descending eigenvalue order;
//! - a missing basis/factor (`None`) means the identity (the dimension is over
//!   `max_precond_dim` and is never rotated);
//! - engine steps `t` are 1-based.
//!
//! The engine calls, per SOAP parameter and step: [`soap_update`], then
//! [`soap_factor_update`], then [`eigenbasis_refresh`] for each side that has a factor (or,
//! off the critical path, [`refresh_compute`] on snapshots on a worker thread and
//! [`refresh_apply`] at a later step boundary).
#![deny(missing_docs)]

mod adamw;
pub mod bench;
mod eigh;
mod kl_shampoo;
#[cfg(feature = "lapack")]
mod lapack_solver;
mod linalg;
pub mod optimizers;
mod real;
mod refresh;
mod shampoo;
mod soap;
pub mod update;

pub use adamw::{adamw_update, AdamWParams};
pub use eigh::{solver_by_name, solver_names, EigenError, Eigh, FaerEigensolver, HostEigensolver};
pub use kl_shampoo::{
    kl_eig_floor, kl_factor_update, kl_scale, kl_shampoo_step, kl_shampoo_update, KlShampooError,
    KlShampooParams, KlShampooState, KlSide,
};
#[cfg(feature = "lapack")]
pub use lapack_solver::LapackEigensolver;
pub use linalg::{matmul, thin_qr_q, with_sequential};
pub use real::Real;
pub use refresh::{
    eigenbasis_refresh, refresh_apply, refresh_compute, refresh_compute_method, RefreshError,
    RefreshOutcome, RefreshResult,
};
pub use shampoo::{
    blocks as shampoo_blocks, factor_coefficients, graft, merge_small_dims,
    refresh_compute_inverse_root, shampoo_factor_update, shampoo_inverse_root,
    shampoo_precondition, shampoo_step, shampoo_update, AdamGrafting, Block, BlockState,
    ShampooError, ShampooParams, ShampooState,
};
pub use soap::{precond_dims, project, project_back, soap_factor_update, soap_update, SoapParams};

/// A slice passed to an optimizer function has the wrong length for the dimensions given.
/// This is a caller bug (the plan verifier should have caught it); no state was modified.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{op}: operand `{operand}` has {got} elements, expected {expected}")]
pub struct ShapeError {
    /// The function that rejected the call (`"soap_update"`, ...).
    pub op: &'static str,
    /// The operand name (`"exp_avg"`, `"basis_left"`, ...).
    pub operand: &'static str,
    /// Elements expected from the dimensions.
    pub expected: usize,
    /// Elements received.
    pub got: usize,
}

/// Checks `slice.len() == expected`.
pub(crate) fn check_len(
    op: &'static str,
    operand: &'static str,
    got: usize,
    expected: usize,
) -> Result<(), ShapeError> {
    if got == expected {
        Ok(())
    } else {
        Err(ShapeError {
            op,
            operand,
            expected,
            got,
        })
    }
}
