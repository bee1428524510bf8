// Elementwise and broadcast kernels (plan ops `Add`, `BiasAdd`, `SumRows`), fills, scaling and
// the f32 -> bf16 cast feeding the bf16 GEMM path.
#include <cuda_bf16.h>

// out = a + b.
extern "C" __global__ void add_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out,
                                   long long n) {
    for (long long i = gtid(); i < n; i += gstride()) out[i] = a[i] + b[i];
}

// out[r, j] = x[r, j] + bias[j]; x/out [rows, c].
extern "C" __global__ void bias_add(const float* __restrict__ x, const float* __restrict__ bias, float* __restrict__ out,
                                    long long total, int c) {
    for (long long i = gtid(); i < total; i += gstride()) out[i] = x[i] + bias[i % c];
}

// out[j] = sum_r x[r, j]; block (32, 16) column tiles, rows strided by threadIdx.y, fixed order.
extern "C" __global__ void sum_rows(const float* __restrict__ x, float* __restrict__ out, int n, int c) {
    __shared__ float s[16][33];
    const int j = blockIdx.x * 32 + threadIdx.x;
    float acc = 0.0f;
    if (j < c) {
        for (int r = threadIdx.y; r < n; r += blockDim.y) acc += x[(long long)r * c + j];
    }
    s[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && j < c) {
        float t = 0.0f;
        for (int y = 0; y < (int)blockDim.y; ++y) t += s[y][threadIdx.x];
        out[j] = t;
    }
}

// x *= *scale (a device scalar, e.g. the clip factor written by grad_norm_finalize).
extern "C" __global__ void scale_by_device_scalar(float* __restrict__ x, const float* __restrict__ scale, long long n) {
    const float s = *scale;
    if (s == 1.0f) return;
    for (long long i = gtid(); i < n; i += gstride()) x[i] *= s;
}

// out = bf16(x), round to nearest even.
extern "C" __global__ void cast_f32_bf16(const float* __restrict__ x, __nv_bfloat16* __restrict__ out, long long n) {
    for (long long i = gtid(); i < n; i += gstride()) out[i] = __float2bfloat16_rn(x[i]);
}
