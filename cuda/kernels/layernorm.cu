// LayerNorm over the last dim (plan ops `LayerNorm`, `LayerNormBackward`; Ba et al. 2016).
// x/out/dout/dx [n, c], weight/bias/dweight/dbias [c]; biased variance; statistics recomputed
// from x in the backward. One block per row for row kernels; column sums by column tiles.

__device__ __forceinline__ void ln_row_stats(const float* xr, int c, float eps, float* mean, float* rstd) {
    float s = 0.0f;
    for (int j = threadIdx.x; j < c; j += blockDim.x) s += xr[j];
    const float m = block_sum(s) / (float)c;
    float v = 0.0f;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        const float d = xr[j] - m;
        v += d * d;
    }
    const float var = block_sum(v) / (float)c;
    *mean = m;
    *rstd = 1.0f / sqrtf(var + eps);
}

// out = (x - mean) * rstd * weight + bias (bias may be null).
extern "C" __global__ void layernorm_forward(const float* __restrict__ x, const float* __restrict__ weight,
                                             const float* __restrict__ bias, float* __restrict__ out,
                                             int n, int c, float eps) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const float* xr = x + (long long)row * c;
    float* o = out + (long long)row * c;
    float mean, rstd;
    ln_row_stats(xr, c, eps, &mean, &rstd);
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        const float b = bias ? bias[j] : 0.0f;
        o[j] = (xr[j] - mean) * rstd * weight[j] + b;
    }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dout * weight. Writes the row's mean
// and rstd to stats[2*row], stats[2*row+1] for layernorm_backward_params.
extern "C" __global__ void layernorm_backward_dx(const float* __restrict__ dout, const float* __restrict__ x,
                                                 const float* __restrict__ weight, float* __restrict__ dx,
                                                 float* __restrict__ stats, int n, int c, float eps) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const float* xr = x + (long long)row * c;
    const float* dr = dout + (long long)row * c;
    float* d = dx + (long long)row * c;
    float mean, rstd;
    ln_row_stats(xr, c, eps, &mean, &rstd);
    float sg = 0.0f, sgx = 0.0f;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        const float g = dr[j] * weight[j];
        sg += g;
        sgx += g * (xr[j] - mean) * rstd;
    }
    const float mg = block_sum(sg) / (float)c;
    const float mgx = block_sum(sgx) / (float)c;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        const float xh = (xr[j] - mean) * rstd;
        d[j] = rstd * (dr[j] * weight[j] - mg - xh * mgx);
    }
    if (threadIdx.x == 0) {
        stats[2 * (long long)row] = mean;
        stats[2 * (long long)row + 1] = rstd;
    }
}

// dweight[j] = sum_n dout[n,j] * xhat[n,j]; dbias[j] = sum_n dout[n,j] (dbias may be null).
// Block (32, 16): threadIdx.x picks the column inside a 32-wide tile, threadIdx.y strides rows;
// partial sums are combined in a fixed order (deterministic).
extern "C" __global__ void layernorm_backward_params(const float* __restrict__ dout, const float* __restrict__ x,
                                                     const float* __restrict__ stats, float* __restrict__ dweight,
                                                     float* __restrict__ dbias, int n, int c) {
    __shared__ float s_w[16][33];
    __shared__ float s_b[16][33];
    const int j = blockIdx.x * 32 + threadIdx.x;
    float aw = 0.0f, ab = 0.0f;
    if (j < c) {
        for (int r = threadIdx.y; r < n; r += blockDim.y) {
            const long long k = (long long)r * c + j;
            const float g = dout[k];
            aw += g * (x[k] - stats[2 * (long long)r]) * stats[2 * (long long)r + 1];
            ab += g;
        }
    }
    s_w[threadIdx.y][threadIdx.x] = aw;
    s_b[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y == 0 && j < c) {
        float tw = 0.0f, tb = 0.0f;
        for (int y = 0; y < (int)blockDim.y; ++y) {
            tw += s_w[y][threadIdx.x];
            tb += s_b[y][threadIdx.x];
        }
        dweight[j] = tw;
        if (dbias) dbias[j] = tb;
    }
}
