#include <cuda_bf16.h>

// RMSNorm over the last dim (plan ops `RmsNorm`, `RmsNormBackward`; Zhang & Sennrich 2019).
// x/out/dout/dx [n, c], weight/dweight [c]; r = 1/sqrt(mean(x^2) + eps).

__device__ __forceinline__ float rms_rinv(const float* xr, int c, float eps) {
    float s = 0.0f;
    for (int j = threadIdx.x; j < c; j += blockDim.x) s += xr[j] * xr[j];
    return 1.0f / sqrtf(block_sum(s) / (float)c + eps);
}

// out = x * r * weight. One block per row.
extern "C" __global__ void rmsnorm_forward(const float* __restrict__ x, const float* __restrict__ weight,
                                           float* __restrict__ out, int n, int c, float eps) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const float* xr = x + (long long)row * c;
    float* o = out + (long long)row * c;
    const float r = rms_rinv(xr, c, eps);
    for (int j = threadIdx.x; j < c; j += blockDim.x) o[j] = xr[j] * r * weight[j];
}

// rmsnorm_forward with a bf16 output (round to nearest even), for an output only bf16 GEMMs read.
extern "C" __global__ void rmsnorm_forward_bf16(const float* __restrict__ x, const float* __restrict__ weight,
                                                __nv_bfloat16* __restrict__ out, int n, int c, float eps) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const float* xr = x + (long long)row * c;
    __nv_bfloat16* o = out + (long long)row * c;
    const float r = rms_rinv(xr, c, eps);
    for (int j = threadIdx.x; j < c; j += blockDim.x) o[j] = __float2bfloat16_rn(xr[j] * r * weight[j]);
}

// dx = r*g - r^3 * x * mean(g * x), g = dout * weight. Writes r to rinv[row].
extern "C" __global__ void rmsnorm_backward_dx(const float* __restrict__ dout, const float* __restrict__ x,
                                               const float* __restrict__ weight, float* __restrict__ dx,
                                               float* __restrict__ rinv, int n, int c, float eps) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const float* xr = x + (long long)row * c;
    const float* dr = dout + (long long)row * c;
    float* d = dx + (long long)row * c;
    const float r = rms_rinv(xr, c, eps);
    float s = 0.0f;
    for (int j = threadIdx.x; j < c; j += blockDim.x) s += dr[j] * weight[j] * xr[j];
    const float sgx = block_sum(s) / (float)c;
    for (int j = threadIdx.x; j < c; j += blockDim.x) d[j] = r * dr[j] * weight[j] - r * r * r * xr[j] * sgx;
    if (threadIdx.x == 0) rinv[row] = r;
}

// dweight partials: part[slab * c + j] = sum over the slab's rows n of dout[n,j] * x[n,j] * rinv[n],
// rows [slab * rows_per_slab, min(n, (slab + 1) * rows_per_slab)), slab = blockIdx.y. Block
// (32, 16) column tiles, fixed order; the partials are added in a fixed order by
// `layernorm_backward_params_finalize` (with one slab, part is dweight itself). Before, one
// slab of all N rows gave ceil(c / 32) blocks (64 at c = 2048): too few to stream the two
// [N, c] operands at the memory's rate.
extern "C" __global__ void rmsnorm_backward_weight(const float* __restrict__ dout, const float* __restrict__ x,
                                                   const float* __restrict__ rinv, float* __restrict__ part,
                                                   int n, int c, int rows_per_slab) {
    __shared__ float s_w[16][33];
    const int j = blockIdx.x * 32 + threadIdx.x;
    const long long r0 = (long long)blockIdx.y * rows_per_slab;
    const long long r1 = min((long long)n, r0 + rows_per_slab);
    float aw = 0.0f;
    if (j < c) {
#pragma unroll 4
        for (long long r = r0 + threadIdx.y; r < r1; r += blockDim.y) {
            const long long k = r * c + j;
            aw += dout[k] * x[k] * rinv[r];
        }
    }
    s_w[threadIdx.y][threadIdx.x] = aw;
    __syncthreads();
    if (threadIdx.y == 0 && j < c) {
        float t = 0.0f;
        for (int y = 0; y < (int)blockDim.y; ++y) t += s_w[y][threadIdx.x];
        part[(long long)blockIdx.y * c + j] = t;
    }
}
