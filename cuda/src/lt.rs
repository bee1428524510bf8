//! cuBLASLt on the compute stream: bf16 GEMMs with the bias add fused into the epilogue
//! (`CUBLASLT_EPILOGUE_BIAS`), so that a plan's `MatMul` + `BiasAdd` pair writes its output
//! once instead of a GEMM followed by a read-modify-write pass over `[N, C]` (on GPT-2 124M,
//! batch 16×1024, the separate bias adds cost 3.5 ms per forward on the H200).
//!
//! One handle and one 32 MiB workspace (NVIDIA's recommendation for Hopper; 4 MiB before) per
//! device. The heuristic's algorithm is cached per GEMM geometry; descriptors and layouts are
//! created per call (host-only, microseconds).
use crate::error::{CudaError, Result};
use crate::memory::{Arena, Buf, Elem, MemCounters};
use crate::Tier;
use cudarc::cublaslt::{result as lt, sys as ltsys};
use cudarc::driver::CudaContext;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// Workspace bytes handed to cuBLASLt: 32 MiB on compute capability ≥ 9, else 4 MiB.
fn workspace_bytes(major: u32) -> usize {
    if major >= 9 {
        32 << 20
    } else {
        4 << 20
    }
}

/// Column-major geometry of one cuBLASLt call: `D[m, n] = op(A)[m, k] · op(B)[k, n] + bias[m]`
/// (bias broadcast along n), with the stored `(rows, cols, ld)` of A and B.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct LtGeometry {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub trans_a: bool,
    pub trans_b: bool,
    /// Stored A: `(rows, cols, ld)` (column-major, before the transpose).
    pub a: (u64, u64, i64),
    /// Stored B: `(rows, cols, ld)`.
    pub b: (u64, u64, i64),
    /// D and the bias are bf16 (the fp32 result plus the bias, rounded to nearest even in the
    /// epilogue) instead of f32.
    pub d_bf16: bool,
}

/// A cuBLASLt handle with its workspace and the calls planned so far (per geometry).
pub(crate) struct BlasLt {
    handle: ltsys::cublasLtHandle_t,
    workspace: Buf,
    _arena: Arena,
    plans: Mutex<HashMap<LtGeometry, LtPlan>>,
}

// SAFETY: the handle is used only by the engine thread that owns the compute stream (the same
// rule as the compute stream's cuBLAS handle, `device.rs`); cuBLASLt handles may move between
// threads. The plan cache (descriptors, layouts, algorithms) is behind a mutex.
unsafe impl Send for BlasLt {}
// SAFETY: as above.
unsafe impl Sync for BlasLt {}

impl Drop for BlasLt {
    fn drop(&mut self) {
        // SAFETY: created by `create_handle`, destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

fn lt_err(op: &'static str) -> impl Fn(lt::CublasError) -> CudaError {
    move |e| CudaError::Invalid {
        op,
        what: format!(
            "cuBLASLt: {e:?} (`asteria compile --skip-pass fuse` keeps GEMM and bias add separate)"
        ),
    }
}

/// Destroys what the guard holds when a call returns (also on errors).
struct Descs {
    desc: Option<ltsys::cublasLtMatmulDesc_t>,
    layouts: Vec<ltsys::cublasLtMatrixLayout_t>,
    pref: Option<ltsys::cublasLtMatmulPreference_t>,
}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: each was created once by the matching `create_*` and is destroyed once.
        unsafe {
            if let Some(d) = self.desc {
                let _ = lt::destroy_matmul_desc(d);
            }
            for l in &self.layouts {
                let _ = lt::destroy_matrix_layout(*l);
            }
            if let Some(p) = self.pref {
                let _ = lt::destroy_matmul_pref(p);
            }
        }
    }
}

impl BlasLt {
    /// A handle and a workspace arena on `ctx`; `None` when the cuBLASLt library is missing or
    /// its handle or workspace cannot be made (logged), so that callers fall back to unfused
    /// GEMMs instead of failing the device.
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        counters: &Arc<MemCounters>,
        major: u32,
    ) -> Option<BlasLt> {
        // SAFETY: only a dlopen attempt.
        if !unsafe { ltsys::is_culib_present() } {
            tracing::debug!("libcublasLt not found: bias epilogues stay separate kernels");
            return None;
        }
        let handle = match lt::create_handle() {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(error = ?e, "cublasLtCreate failed: bias epilogues stay separate kernels");
                return None;
            }
        };
        let bytes = workspace_bytes(major);
        let made = Arena::new(ctx, counters, "cublaslt-workspace", Tier::Device, bytes)
            .and_then(|mut arena| Ok((arena.buf(Elem::F32, bytes / 4)?, arena)));
        match made {
            Ok((workspace, arena)) => Some(BlasLt {
                handle,
                workspace,
                _arena: arena,
                plans: Mutex::new(HashMap::new()),
            }),
            Err(e) => {
                tracing::warn!(error = %e, "no cuBLASLt workspace: bias epilogues stay separate kernels");
                // SAFETY: created above, not owned by anything else.
                let _ = unsafe { lt::destroy_handle(handle) };
                None
            }
        }
    }

    /// `d = op(a)·op(b) + bias` in cuBLASLt's column-major terms (see [`LtGeometry`]): `a`, `b`
    /// bf16, `d` and `bias` f32, fp32 accumulation (`CUBLAS_COMPUTE_32F`), on `stream`.
    ///
    /// # Safety
    /// `a`, `b`, `bias`, `d` must be live device pointers covering the geometry (checked by
    /// the caller, `gemm::gemm_bf16_bias`), valid on `stream`'s context.
    pub(crate) unsafe fn matmul_bias(
        &self,
        g: LtGeometry,
        a: u64,
        b: u64,
        bias: u64,
        d: u64,
        stream: ltsys::cudaStream_t,
    ) -> Result<()> {
        const OP: &str = "gemm_bf16_bias";
        let e = lt_err(OP);
        let mut plans = self.plans.lock().map_err(|_| CudaError::Invalid {
            op: OP,
            what: "the cuBLASLt plan cache was poisoned by an earlier panic".into(),
        })?;
        if !plans.contains_key(&g) {
            let plan = self.plan(g)?;
            plans.insert(g, plan);
        }
        let Some(plan) = plans.get(&g) else {
            return Err(CudaError::Invalid {
                op: OP,
                what: "cuBLASLt plan missing after insertion".into(),
            });
        };
        // Only the bias pointer changes between calls of one geometry.
        let bias_ptr = bias;
        lt::set_matmul_desc_attribute(
            plan.desc,
            ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
            (&bias_ptr as *const u64).cast(),
            std::mem::size_of_val(&bias_ptr),
        )
        .map_err(&e)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let [la, lb, ld] = plan.layouts;
        lt::matmul(
            self.handle,
            plan.desc,
            (&alpha as *const f32).cast(),
            (&beta as *const f32).cast(),
            a as *const c_void,
            la,
            b as *const c_void,
            lb,
            d as *const c_void,
            ld,
            d as *mut c_void,
            ld,
            &plan.algo,
            self.workspace.ptr() as *mut c_void,
            self.workspace.bytes(),
            stream,
        )
        .map_err(&e)
    }

    /// The descriptor, layouts and heuristic algorithm of one geometry, made once and kept
    /// (creating them took ~0.1 ms of host time per call, during which the GPU could drain).
    fn plan(&self, g: LtGeometry) -> Result<LtPlan> {
        const OP: &str = "gemm_bf16_bias";
        let e = lt_err(OP);
        let mut guard = Descs {
            desc: None,
            layouts: Vec::new(),
            pref: None,
        };
        let desc = lt::create_matmul_desc(
            ltsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ltsys::cudaDataType_t::CUDA_R_32F,
        )
        .map_err(&e)?;
        guard.desc = Some(desc);
        // cublasOperation_t as a 32-bit int: 0 = CUBLAS_OP_N, 1 = CUBLAS_OP_T.
        let (ta, tb) = (g.trans_a as i32, g.trans_b as i32);
        let epilogue = ltsys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
        // SAFETY (every call below): descriptors created here, attribute sizes those of the
        // values passed.
        let set = |attr, p: *const c_void, size: usize| unsafe {
            lt::set_matmul_desc_attribute(desc, attr, p, size).map_err(&e)
        };
        use ltsys::cublasLtMatmulDescAttributes_t as A;
        set(
            A::CUBLASLT_MATMUL_DESC_TRANSA,
            (&ta as *const i32).cast(),
            std::mem::size_of_val(&ta),
        )?;
        set(
            A::CUBLASLT_MATMUL_DESC_TRANSB,
            (&tb as *const i32).cast(),
            std::mem::size_of_val(&tb),
        )?;
        set(
            A::CUBLASLT_MATMUL_DESC_EPILOGUE,
            (&epilogue as *const ltsys::cublasLtEpilogue_t).cast(),
            std::mem::size_of_val(&epilogue),
        )?;
        let bf = ltsys::cudaDataType_t::CUDA_R_16BF;
        let f32t = ltsys::cudaDataType_t::CUDA_R_32F;
        // The bias has D's type (cuBLASLt's default; an f32 bias with a bf16 D is refused with
        // CUBLAS_STATUS_INVALID_VALUE on the H200, cuBLAS 13).
        let dt = if g.d_bf16 { bf } else { f32t };
        for (ty, (r, c, ld)) in [(bf, g.a), (bf, g.b), (dt, (g.m, g.n, g.m as i64))] {
            guard
                .layouts
                .push(lt::create_matrix_layout(ty, r, c, ld).map_err(&e)?);
        }
        let (la, lb, ld) = (guard.layouts[0], guard.layouts[1], guard.layouts[2]);
        // SAFETY: plain descriptor creation and a heuristic query on this handle.
        let algo = unsafe {
            let pref = lt::create_matmul_pref().map_err(&e)?;
            guard.pref = Some(pref);
            let ws = self.workspace.bytes();
            lt::set_matmul_pref_attribute(
                pref,
                ltsys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const usize).cast(),
                std::mem::size_of_val(&ws),
            )
            .map_err(&e)?;
            lt::get_matmul_algo_heuristic(self.handle, desc, la, lb, ld, ld, pref)
                .map_err(&e)?
                .algo
        };
        // The plan owns the descriptor and layouts from here; the guard keeps the preference.
        guard.desc = None;
        guard.layouts.clear();
        Ok(LtPlan {
            desc,
            layouts: [la, lb, ld],
            algo,
        })
    }
}

/// A cached cuBLASLt call of one [`LtGeometry`]: its matmul descriptor (epilogue, transposes;
/// the bias pointer is set per call), the A, B and C/D layouts and the chosen algorithm.
struct LtPlan {
    desc: ltsys::cublasLtMatmulDesc_t,
    layouts: [ltsys::cublasLtMatrixLayout_t; 3],
    algo: ltsys::cublasLtMatmulAlgo_t,
}

impl Drop for LtPlan {
    fn drop(&mut self) {
        // SAFETY: created once by `BlasLt::plan`, owned here, destroyed once.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for l in &self.layouts {
                let _ = lt::destroy_matrix_layout(*l);
            }
        }
    }
}
