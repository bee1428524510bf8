// Helpers of the GPU eigenbasis refresh (plan host task `EigenbasisRefresh`, SOAP's
// `get_orthogonal_matrix` / `get_orthogonal_matrix_QR`): cuSOLVER does the eigendecomposition
// and the QR; these kernels move columns between the row-major plan layout and cuSOLVER's
// column-major one, sort, permute and check. All matrices are f32.

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

// est[j] = sum_i q[i, j] * fq[i, j] (f64 accumulation, fixed order); one thread per column.
extern "C" __global__ void column_dots(const float* __restrict__ q, const float* __restrict__ fq,
                                       double* __restrict__ est, int d) {
    for (long long j = gtid(); j < d; j += gstride()) {
        double acc = 0.0;
        for (long long i = 0; i < d; ++i) acc += (double)q[i * d + j] * (double)fq[i * d + j];
        est[j] = acc;
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

// Column normalisation (the first step of CholeskyQR: same Q, better-conditioned Gram matrix):
// x[:, j] /= ||x[:, j]||_2 for the columns of row-major x [rows, cols] with a non-zero norm
// (a zero column is left as it is: its Gram diagonal is 0 and the Cholesky factorisation then
// fails, which sends the refresh to Householder QR). One thread per column, f64 accumulation.
extern "C" __global__ void normalize_cols(float* __restrict__ x, int rows, int cols) {
    for (long long j = gtid(); j < cols; j += gstride()) {
        double acc = 0.0;
        for (long long i = 0; i < rows; ++i) {
            const double v = (double)x[i * cols + j];
            acc += v * v;
        }
        if (acc > 0.0) {
            const float s = (float)(1.0 / sqrt(acc));
            for (long long i = 0; i < rows; ++i) x[i * cols + j] *= s;
        }
    }
}

// *out = max(*out, bits of |g[i, j] - delta_ij|) over row-major g [d, d] (the orthonormality
// error of Q when g = Q^T Q; non-negative floats order as their bit patterns, NaN above Inf).
extern "C" __global__ void ortho_error_bits(const float* __restrict__ g, int d, int* __restrict__ out) {
    const long long total = (long long)d * d;
    int local = 0;
    for (long long k = gtid(); k < total; k += gstride()) {
        const long long i = k / d, j = k % d;
        const float e = fabsf(g[k] - (i == j ? 1.0f : 0.0f));
        local = max(local, isnan(e) ? 0x7fffffff : __float_as_int(e));
    }
    if (local) atomicMax(out, local);
}
