// Helpers of the GPU eigenbasis refresh (plan host task `EigenbasisRefresh`, SOAP's
// `get_orthogonal_matrix` / `get_orthogonal_matrix_QR`; cuda/src/refresh/): cuSOLVER and cuBLAS
// do the factorisations; these kernels move columns between the row-major plan layout and
// cuSOLVER's column-major one, sort, permute, check, and do the element-wise steps of the
// Rayleigh-Cholesky QR. All matrices are f32.

// a[i, i] += v for i < d (a row-major [d, d]).
extern "C" __global__ void add_diag(float* __restrict__ a, int d, float v) {
    for (long long i = gtid(); i < d; i += gstride()) a[i * (long long)d + i] += v;
}

// Eigenvectors from cuSOLVER (column-major, ascending eigenvalues) to a row-major basis with
// columns in descending eigenvalue order: q[i, j] = w[(d - 1 - j) * d + i].
extern "C" __global__ void eigvecs_descending(const float* __restrict__ w, float* __restrict__ q, int d) {
    const long long total = (long long)d * d;
    for (long long k = gtid(); k < total; k += gstride()) {
        const long long i = k / d, j = k % d;
        q[k] = w[(long long)(d - 1 - j) * d + i];
    }
}

// est[j] = sum_i q[i, j] * fq[i, j] (f64 accumulation, fixed order for a given d). Launch with
// blocks of (32, 32) threads, one block per 32 columns: thread (x, y) sums rows y, y + 32, ...
// of column 32 * blockIdx.x + x (a warp reads 32 adjacent floats of a row: coalesced), then row
// 0 of the block adds the 32 partial sums in order. (One thread per column, as before, read
// strided and ran on d / 256 SMs.)
extern "C" __global__ void column_dots(const float* __restrict__ q, const float* __restrict__ fq,
                                       double* __restrict__ est, int d) {
    __shared__ double part[32][33];
    const long long j = (long long)blockIdx.x * 32 + threadIdx.x;
    double acc = 0.0;
    if (j < d)
        for (long long i = threadIdx.y; i < d; i += 32) acc += (double)q[i * d + j] * (double)fq[i * d + j];
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && j < d) {
        double s = 0.0;
        for (int y = 0; y < 32; ++y) s += part[y][threadIdx.x];
        est[j] = s;
    }
}

// out[j * rows + i] = x[i * cols + idx[j]] for j < cols: the columns idx of row-major x
// [rows, cols], written column-major (= the row-major transpose). idx = null means identity.
extern "C" __global__ void gather_cols_transpose(const float* __restrict__ x, const int* __restrict__ idx,
                                                 float* __restrict__ out, int rows, int cols) {
    const long long total = (long long)rows * cols;
    for (long long k = gtid(); k < total; k += gstride()) {
        const long long j = k / rows, i = k % rows;
        const long long src = idx ? idx[j] : j;
        out[k] = x[i * cols + src];
    }
}

// Row permutation: out[i, :] = x[idx[i], :]; x/out row-major [rows, cols].
extern "C" __global__ void permute_rows(const float* __restrict__ x, const int* __restrict__ idx,
                                        float* __restrict__ out, int rows, int cols) {
    const long long total = (long long)rows * cols;
    for (long long k = gtid(); k < total; k += gstride()) {
        const long long i = k / cols, j = k % cols;
        out[k] = x[(long long)idx[i] * cols + j];
    }
}

// Column permutation: out[:, j] = x[:, idx[j]]; x/out row-major [rows, cols].
extern "C" __global__ void permute_cols(const float* __restrict__ x, const int* __restrict__ idx,
                                        float* __restrict__ out, int rows, int cols) {
    const long long total = (long long)rows * cols;
    for (long long k = gtid(); k < total; k += gstride()) {
        const long long i = k / cols, j = k % cols;
        out[k] = x[i * cols + idx[j]];
    }
}

// *count += number of NaN / Inf entries of x (count must be zeroed first).
extern "C" __global__ void count_nonfinite(const float* __restrict__ x, long long n, int* __restrict__ count) {
    int local = 0;
    for (long long i = gtid(); i < n; i += gstride()) local += isfinite(x[i]) ? 0 : 1;
    if (local) atomicAdd(count, local);
}

// Stable descending argsort of est[0..d) under IEEE total order (Rust's f64::total_cmp):
// idx[r] = j where r = #{k : est[k] > est[j]} + #{k < j : est[k] == est[j]}. One thread per
// element, O(d^2) comparisons (d <= max_precond_dim: microseconds), no host round trip.
__device__ __forceinline__ long long total_key(double x) {
    const long long b = __double_as_longlong(x);
    return b ^ (long long)(((unsigned long long)(b >> 63)) >> 1);
}
extern "C" __global__ void argsort_desc(const double* __restrict__ est, int* __restrict__ idx, int d) {
    for (long long j = gtid(); j < d; j += gstride()) {
        const long long kj = total_key(est[j]);
        int rank = 0;
        for (int k = 0; k < d; ++k) {
            const long long kk = total_key(est[k]);
            rank += (kk > kj) || (kk == kj && k < j);
        }
        idx[rank] = (int)j;
    }
}

// *out = max(*out, bits of |x[i]|) over i < n (non-negative floats order as their bit
// patterns; NaN payloads sort above +Inf). *out must be zeroed first: 0 afterwards means an
// all-zero x.
extern "C" __global__ void abs_max_bits(const float* __restrict__ x, long long n, int* __restrict__ out) {
    int local = 0;
    for (long long i = gtid(); i < n; i += gstride()) local = max(local, __float_as_int(fabsf(x[i])));
    if (local) atomicMax(out, local);
}

// Rayleigh–Cholesky QR (refresh/rayleigh.rs): f32, cuSOLVER column-major.

// *all = *pass when *all is still 0 (keeps the first failing potrf's info). One thread.
extern "C" __global__ void first_nonzero_info(const int* __restrict__ pass, int* __restrict__ all) {
    if (gtid() == 0 && *all == 0) *all = *pass;
}

// a[i, i] += rel * max_k a[k, k] for i < d (a [d, d]; the diagonal is the same in either
// layout). One block: the block reduces the diagonal's maximum, then adds the shift. A
// non-positive maximum adds nothing (the Cholesky factorisation then fails and the refresh goes
// to Householder QR).
extern "C" __global__ void add_diag_rel(float* __restrict__ a, int d, float rel) {
    __shared__ float red[256];
    float m = -3.0e38f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) m = fmaxf(m, a[(long long)i * d + i]);
    red[threadIdx.x] = m;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
        __syncthreads();
    }
    const float shift = red[0] > 0.0f ? rel * red[0] : 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) a[(long long)i * d + i] += shift;
}

// The unit lower-triangular L = C diag(C)^-1 of a Cholesky factorisation B = C C^T, from
// cuSOLVER's lower factor C (column-major, C(r, c) at u[c * d + r], r >= c; the strictly upper
// part of u is not read): x column-major, x[j * d + i] = L(i, j) = u[j * d + i] / u[j * d + j]
// for i > j, 1 on the diagonal, 0 above. Reads and writes are at the same index: coalesced.
extern "C" __global__ void unit_lower_from_chol(const float* __restrict__ u, float* __restrict__ x, int d) {
    const long long total = (long long)d * d;
    for (long long k = gtid(); k < total; k += gstride()) {
        const long long i = k % d, j = k / d;
        x[k] = i > j ? u[k] / u[j * d + j] : (i == j ? 1.0f : 0.0f);
    }
}

// *out = max(*out, bits of |r[i, j] - delta_ij|) over the lower triangle (i >= j) of the
// column-major f32 lower Cholesky factor r [d, d] (element (i, j) at r[j * d + i]); the upper
// triangle still holds the Gram matrix and is skipped. NaN counts as the largest error.
extern "C" __global__ void lower_identity_error_bits(const float* __restrict__ r, int d, int* __restrict__ out) {
    const long long total = (long long)d * d;
    int local = 0;
    for (long long k = gtid(); k < total; k += gstride()) {
        const long long j = k / d, i = k % d;
        if (i < j) continue;
        const float e = fabsf(r[k] - (i == j ? 1.0f : 0.0f));
        local = max(local, isnan(e) ? 0x7fffffff : __float_as_int(fminf(e, 3.0e38f)));
    }
    if (local) atomicMax(out, local);
}

// 3xTF32 operand split (refresh::gemm_3xtf32): hi = x rounded to TF32 (10 explicit mantissa
// bits, round to nearest, ties away; exact in TF32, so the tensor cores read it unchanged),
// lo = x - hi (exact in fp32). Non-finite x passes through in hi with lo = 0.
extern "C" __global__ void split_tf32(const float* __restrict__ x, float* __restrict__ hi, float* __restrict__ lo,
                                      long long n) {
    for (long long i = gtid(); i < n; i += gstride()) {
        const float v = x[i];
        float h = v;
        if (isfinite(v)) {
            const unsigned int r = (__float_as_uint(v) + 0x1000u) & 0xffffe000u;
            const float t = __uint_as_float(r);
            if (isfinite(t)) h = t;
        }
        hi[i] = h;
        lo[i] = isfinite(v) ? v - h : 0.0f;
    }
}

// One Newton-Schulz step's polynomial on the Gram matrix g = M^T M [d, d] (either layout: g is
// symmetric): *fro2 += ||g - I||_F^2 (float atomics, one per warp; NaN propagates), then
// g <- (I - g) / 2, so that M + M g = M (3I - M^T M) / 2 (refresh/rayleigh.rs). The Frobenius
// norm bounds the spectral norm that decides the step's error (3/4 ||g - I||_2^2); the largest
// entry does not (up to d times smaller).
extern "C" __global__ void newton_schulz_poly(float* __restrict__ g, int d, float* __restrict__ fro2) {
    const long long total = (long long)d * d;
    float local = 0.0f;
    for (long long k = gtid(); k < total; k += gstride()) {
        const bool diag = (k / d) == (k % d);
        const float e = g[k] - (diag ? 1.0f : 0.0f);
        local += e * e;
        g[k] = -0.5f * e;
    }
    for (int off = 16; off > 0; off >>= 1) local += __shfl_down_sync(0xffffffffu, local, off);
    if ((threadIdx.x & 31) == 0 && local != 0.0f) atomicAdd(fro2, local);
}

// Shampoo's inverse root (refresh/mod.rs `GpuRefresher::compute_inverse_root`,
// optim::shampoo_inverse_root): the columns of cuSOLVER's eigenvectors v (column-major [d, d],
// eigenvector j at v[j * d ..]) scaled by w_j = (lam_j + shift)^expo in f64, where
// shift = eps - min(lam) when min(lam) < eps, else 0 (the smallest eigenvalue lifted to eps):
// out[j * d + i] = v[j * d + i] * w_j. NaN eigenvalues are skipped by the minimum (as the host's
// f64::min) and give NaN columns. Launch with blocks of 256 threads; each block reduces
// min(lam) itself (d reads: no second launch), then scales columns blockIdx.x, + gridDim.x, ...
extern "C" __global__ void inverse_root_scale_cols(const float* __restrict__ v, const float* __restrict__ lam,
                                                   float* __restrict__ out, int d, double eps, double expo) {
    __shared__ float red[256];
    float m = __int_as_float(0x7f800000);
    for (int k = threadIdx.x; k < d; k += blockDim.x) m = fminf(m, lam[k]);
    red[threadIdx.x] = m;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) red[threadIdx.x] = fminf(red[threadIdx.x], red[threadIdx.x + s]);
        __syncthreads();
    }
    const double mn = (double)red[0];
    const double shift = mn < eps ? eps - mn : 0.0;
    for (long long j = blockIdx.x; j < d; j += gridDim.x) {
        const double w = pow((double)lam[j] + shift, expo);
        for (long long i = threadIdx.x; i < d; i += blockDim.x)
            out[j * d + i] = (float)((double)v[j * d + i] * w);
    }
}
