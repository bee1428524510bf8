// Elementwise and broadcast kernels (plan ops `Add`, `BiasAdd`, `SumRows`), fills, scaling and
// the f32 -> bf16 cast feeding the bf16 GEMM path.
#include <cuda_bf16.h>

// out = a + b (float4 steps where a, b and out are 16-byte aligned).
extern "C" __global__ void add_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out,
                                   long long n) {
    const long long n4 = (asteria_aligned(a, 16) && asteria_aligned(b, 16) && asteria_aligned(out, 16)) ? n / 4 : 0;
    for (long long i = gtid(); i < n4; i += gstride()) {
        const float4 x = reinterpret_cast<const float4*>(a)[i], y = reinterpret_cast<const float4*>(b)[i];
        reinterpret_cast<float4*>(out)[i] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
    }
    for (long long i = 4 * n4 + gtid(); i < n; i += gstride()) out[i] = a[i] + b[i];
}

// out[r, j] = x[r, j] + bias[j]; x/out [rows, c].
extern "C" __global__ void bias_add(const float* __restrict__ x, const float* __restrict__ bias, float* __restrict__ out,
                                    long long total, int c) {
    for (long long i = gtid(); i < total; i += gstride()) out[i] = x[i] + bias[i % c];
}

// Stage 1 of the column sums (plan op `SumRows`): for the slab of rows
// [s * rows_per_slab, min(n, (s+1) * rows_per_slab)), s = blockIdx.y, writes
// out[s * c + j] = sum over the slab of x[r, j]. With one slab the launcher passes the result
// as out; with several, per-slab partials that `layernorm_backward_params_finalize` (layernorm
// family) adds in slab order. Block (32, 16): threadIdx.x picks the column inside a 32-wide
// tile (blockIdx.x), threadIdx.y strides the slab's rows; the 16 row-lane sums are combined in
// a fixed order (deterministic).
extern "C" __global__ void sum_rows(const float* __restrict__ x, float* __restrict__ out, int n, int c,
                                    int rows_per_slab) {
    __shared__ float s[16][33];
    const int j = blockIdx.x * 32 + threadIdx.x;
    const long long r0 = (long long)blockIdx.y * rows_per_slab;
    const long long r1 = min((long long)n, r0 + rows_per_slab);
    float acc = 0.0f;
    if (j < c) {
#pragma unroll 4
        for (long long r = r0 + threadIdx.y; r < r1; r += blockDim.y) acc += x[r * c + j];
    }
    s[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && j < c) {
        float t = 0.0f;
        for (int y = 0; y < (int)blockDim.y; ++y) t += s[y][threadIdx.x];
        out[(long long)blockIdx.y * c + j] = t;
    }
}

// sum_rows over bf16 x (a bias gradient summed from an activation gradient that only bf16 GEMMs
// and these sums read, as PyTorch's autocast sums a linear's bf16 output gradient), the sums in
// fp32: the same slabs, row lanes and order as sum_rows. Each thread owns V consecutive columns,
// read as one 8-byte load when V = 4 (c a multiple of 4, x 8-byte aligned: the launcher checks).
template <int V>
__device__ __forceinline__ void sum_rows_bf16x_impl(const __nv_bfloat16* __restrict__ x, float* __restrict__ out, int n,
                                                    int c, int rows_per_slab) {
    __shared__ float s[16][32 * V + 1];
    const int j0 = (blockIdx.x * 32 + threadIdx.x) * V;
    const long long r0 = (long long)blockIdx.y * rows_per_slab;
    const long long r1 = min((long long)n, r0 + rows_per_slab);
    float acc[V];
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] = 0.0f;
    if (j0 < c) {
#pragma unroll 4
        for (long long r = r0 + threadIdx.y; r < r1; r += blockDim.y) {
            if (V == 4) {
                const uint2 q = *reinterpret_cast<const uint2*>(x + r * c + j0);
                const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&q.x));
                const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&q.y));
                acc[0] += a.x;
                acc[1 % V] += a.y;
                acc[2 % V] += b.x;
                acc[3 % V] += b.y;
            } else {
                acc[0] += __bfloat162float(x[r * c + j0]);
            }
        }
    }
#pragma unroll
    for (int v = 0; v < V; ++v) s[threadIdx.y][threadIdx.x * V + v] = acc[v];
    __syncthreads();
    if (threadIdx.y == 0) {
#pragma unroll
        for (int v = 0; v < V; ++v) {
            if (j0 + v >= c) break;
            float t = 0.0f;
            for (int y = 0; y < (int)blockDim.y; ++y) t += s[y][threadIdx.x * V + v];
            out[(long long)blockIdx.y * c + j0 + v] = t;
        }
    }
}
extern "C" __global__ void sum_rows_bf16x(const __nv_bfloat16* __restrict__ x, float* __restrict__ out, int n, int c,
                                          int rows_per_slab) {
    sum_rows_bf16x_impl<1>(x, out, n, c, rows_per_slab);
}
extern "C" __global__ void sum_rows_bf16x4(const __nv_bfloat16* __restrict__ x, float* __restrict__ out, int n, int c,
                                           int rows_per_slab) {
    sum_rows_bf16x_impl<4>(x, out, n, c, rows_per_slab);
}

// Stage 1 of plan op `SumRowsCast`: sum_rows's slab partials (the same rows per slab, the same
// 16 row lanes, each lane's rows added in the same order and the lanes combined in the same
// order, so every column sum is bit-identical to sum_rows's) and, for every element read,
// out_bf16[r, j] = bf16(x[r, j]) (round to nearest even, as cast_f32_bf16). Block (32, 16);
// grid (ceil(c / (32 * V)), slabs): each thread owns V consecutive columns, read as one float4
// when V = 4 (c a multiple of 4, x 16- and out_bf16 8-byte aligned: the launcher checks).
template <int V>
__device__ __forceinline__ void sum_rows_cast_impl(const float* __restrict__ x, float* __restrict__ out,
                                                   __nv_bfloat16* __restrict__ out_bf16, int n, int c,
                                                   int rows_per_slab) {
    __shared__ float s[16][32 * V + 1];
    const int j0 = (blockIdx.x * 32 + threadIdx.x) * V;
    const long long r0 = (long long)blockIdx.y * rows_per_slab;
    const long long r1 = min((long long)n, r0 + rows_per_slab);
    float acc[V];
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] = 0.0f;
    if (j0 < c) {
#pragma unroll 4
        for (long long r = r0 + threadIdx.y; r < r1; r += blockDim.y) {
            if (V == 4) {
                const float4 q = *reinterpret_cast<const float4*>(x + r * c + j0);
                acc[0] += q.x;
                acc[1 % V] += q.y;
                acc[2 % V] += q.z;
                acc[3 % V] += q.w;
                __nv_bfloat162 lo = __floats2bfloat162_rn(q.x, q.y), hi = __floats2bfloat162_rn(q.z, q.w);
                uint2 u;
                u.x = *reinterpret_cast<unsigned*>(&lo);
                u.y = *reinterpret_cast<unsigned*>(&hi);
                *reinterpret_cast<uint2*>(out_bf16 + r * c + j0) = u;
            } else {
                const float q = x[r * c + j0];
                acc[0] += q;
                out_bf16[r * c + j0] = __float2bfloat16_rn(q);
            }
        }
    }
#pragma unroll
    for (int v = 0; v < V; ++v) s[threadIdx.y][threadIdx.x * V + v] = acc[v];
    __syncthreads();
    if (threadIdx.y == 0) {
#pragma unroll
        for (int v = 0; v < V; ++v) {
            if (j0 + v >= c) break;
            float t = 0.0f;
            for (int y = 0; y < (int)blockDim.y; ++y) t += s[y][threadIdx.x * V + v];
            out[(long long)blockIdx.y * c + j0 + v] = t;
        }
    }
}
extern "C" __global__ void sum_rows_cast(const float* __restrict__ x, float* __restrict__ out,
                                         __nv_bfloat16* __restrict__ out_bf16, int n, int c, int rows_per_slab) {
    sum_rows_cast_impl<1>(x, out, out_bf16, n, c, rows_per_slab);
}
extern "C" __global__ void sum_rows_cast4(const float* __restrict__ x, float* __restrict__ out,
                                          __nv_bfloat16* __restrict__ out_bf16, int n, int c, int rows_per_slab) {
    sum_rows_cast_impl<4>(x, out, out_bf16, n, c, rows_per_slab);
}

// x *= *scale (a device scalar, e.g. the clip factor written by grad_norm_finalize).
extern "C" __global__ void scale_by_device_scalar(float* __restrict__ x, const float* __restrict__ scale, long long n) {
    const float s = *scale;
    if (s == 1.0f) return;
    const long long n4 = asteria_aligned(x, 16) ? n / 4 : 0;
    for (long long i = gtid(); i < n4; i += gstride()) {
        float4 v = reinterpret_cast<float4*>(x)[i];
        v.x *= s;
        v.y *= s;
        v.z *= s;
        v.w *= s;
        reinterpret_cast<float4*>(x)[i] = v;
    }
    for (long long i = 4 * n4 + gtid(); i < n; i += gstride()) x[i] *= s;
}

// out = bf16(x), round to nearest even.
extern "C" __global__ void cast_f32_bf16(const float* __restrict__ x, __nv_bfloat16* __restrict__ out, long long n) {
    // float4 in, four bf16 (8 bytes) out, where x is 16- and out 8-byte aligned.
    const long long n4 = (asteria_aligned(x, 16) && asteria_aligned(out, 8)) ? n / 4 : 0;
    for (long long i = gtid(); i < n4; i += gstride()) {
        const float4 v = reinterpret_cast<const float4*>(x)[i];
        __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
        uint2 u;
        u.x = *reinterpret_cast<unsigned*>(&lo);
        u.y = *reinterpret_cast<unsigned*>(&hi);
        reinterpret_cast<uint2*>(out)[i] = u;
    }
    for (long long i = 4 * n4 + gtid(); i < n; i += gstride()) out[i] = __float2bfloat16_rn(x[i]);
}
