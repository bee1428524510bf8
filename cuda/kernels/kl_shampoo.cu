// KL-Shampoo's element-wise parts and reductions (plan op `KlShampooUpdate`; Lin et al. 2025,
// arXiv 2509.03378, reference yorkerlin/KL-Methods `KLOpt`, docs/kl-shampoo.md). The basis
// projections and the factor EMAs are cuBLAS GEMMs around these kernels
// (cuda/src/ops/kl_shampoo.rs); the semantics are optim::kl_shampoo_update's. Matrices are
// row-major f32 [rows, cols]; D are the eigenvalue estimates, s = 1 / sqrt(D).

// Momentum (unrotated): m = b1 * m + w1 * g.
extern "C" __global__ void kl_momentum(float* __restrict__ exp_avg, const float* __restrict__ grad, long long n,
                                       float b1, float w1) {
    for (long long i = gtid(); i < n; i += gstride()) exp_avg[i] = b1 * exp_avg[i] + w1 * grad[i];
}

// s[i] = 1 / sqrt(d[i]) for i < n.
extern "C" __global__ void kl_inv_sqrt(const float* __restrict__ d, float* __restrict__ s, int n) {
    for (long long i = gtid(); i < n; i += gstride()) s[i] = 1.0f / sqrtf(d[i]);
}

// out[i, j] = x[i, j] * row[i] * col[j], a null row or col meaning ones: X diag(s) (the factor
// EMA's operands: columns scaled by s_R, or rows by s_L). x and out must not overlap.
extern "C" __global__ void kl_scale(const float* __restrict__ x, float* __restrict__ out,
                                    const float* __restrict__ row, const float* __restrict__ col, int rows,
                                    int cols) {
    const long long total = (long long)rows * cols;
    for (long long k = gtid(); k < total; k += gstride()) {
        float v = x[k];
        if (row) v *= row[k / cols];
        if (col) v *= col[k % cols];
        out[k] = v;
    }
}

// The preconditioner in the eigenbasis: out[i, j] = x[i, j] * r / (1 + r * eps) with
// r = sl[i] * sr[j] (= x / (sqrt(D_L[i] D_R[j]) + eps), as the reference computes it).
// x and out must not overlap.
extern "C" __global__ void kl_precondition(const float* __restrict__ x, float* __restrict__ out,
                                           const float* __restrict__ sl, const float* __restrict__ sr, int rows,
                                           int cols, float eps) {
    const long long total = (long long)rows * cols;
    for (long long k = gtid(); k < total; k += gstride()) {
        const float r = sl[k / cols] * sr[k % cols];
        out[k] = x[k] * (r / (1.0f + r * eps));
    }
}

// Left eigenvalue estimates: out[i] = max(beta * dl[i] + w * (sum_j gt[i, j]^2 / dr[j]) / cols,
// min_d) for gt = Q_L^T G Q_R [rows, cols], from the old dl and dr (min_d: the clamp 1 / c^2).
// One block per row (grid-stride over rows), blockDim a multiple of 32.
extern "C" __global__ void kl_eig_rows(const float* __restrict__ gt, const float* __restrict__ dl,
                                       const float* __restrict__ dr, float* __restrict__ out, int rows, int cols,
                                       float beta, float w, float min_d) {
    for (int i = blockIdx.x; i < rows; i += gridDim.x) {
        const float* row = gt + (long long)i * cols;
        float acc = 0.0f;
        for (int j = threadIdx.x; j < cols; j += blockDim.x) acc += row[j] * row[j] / dr[j];
        acc = block_sum(acc);
        if (threadIdx.x == 0) out[i] = fmaxf(beta * dl[i] + w * (acc / (float)cols), min_d);
    }
}

// Right eigenvalue estimates: out[j] = max(beta * dr[j] + w * (sum_i gt[i, j]^2 / dl[i]) / rows,
// min_d), from the old dl and dr. Blocks of (32, 32) threads, one block per 32 columns: thread
// (x, y) sums rows y, y + 32, ... of column 32 * blockIdx.x + x (a warp reads 32 adjacent floats
// of a row), then row 0 of the block adds the 32 partial sums in order.
extern "C" __global__ void kl_eig_cols(const float* __restrict__ gt, const float* __restrict__ dl,
                                       const float* __restrict__ dr, float* __restrict__ out, int rows, int cols,
                                       float beta, float w, float min_d) {
    __shared__ float part[32][33];
    const long long j = (long long)blockIdx.x * 32 + threadIdx.x;
    float acc = 0.0f;
    if (j < cols)
        for (long long i = threadIdx.y; i < rows; i += 32) {
            const float g = gt[i * cols + j];
            acc += g * g / dl[i];
        }
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && j < cols) {
        float s = 0.0f;
        for (int y = 0; y < 32; ++y) s += part[y][threadIdx.x];
        out[j] = fmaxf(beta * dr[j] + w * (s / (float)rows), min_d);
    }
}

// The step with decoupled weight decay after it: p = (p - lr * u / div) * decay, div = *d when
// d is non-null (normalize_grads: 1e-30 + RMS(u), rms_finalize of family reduce), else no division.
extern "C" __global__ void kl_apply(float* __restrict__ param, const float* __restrict__ update, long long n,
                                    float lr, const float* __restrict__ d, float decay) {
    const float div = d ? *d : 1.0f;
    for (long long i = gtid(); i < n; i += gstride()) {
        float u = update[i];
        if (d) u = u / div;
        param[i] = (param[i] - lr * u) * decay;
    }
}
