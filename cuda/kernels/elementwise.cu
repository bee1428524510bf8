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

// Stage 1 of the column sums (plan ops `SumRows`, `SumRowsCast`): for the slab of rows
// [s * rows_per_slab, min(n, (s+1) * rows_per_slab)), s = blockIdx.y, writes
// out[s * c + j] = sum over the slab of x[r, j]. With one slab the launcher passes the result
// as out; with several, per-slab partials that `layernorm_backward_params_finalize` (layernorm
// family) adds in a fixed order. Block (32, 16); grid (ceil(c / (32 * V)), slabs): each thread
// owns V consecutive columns of a 32 * V-wide tile (blockIdx.x), threadIdx.y strides the slab's
// rows, and the 16 row-lane sums are combined in a fixed order (deterministic). Every variant
// adds the same values in the same order, so its column sums are bit-identical to sum_rows's:
//   sum_rows          f32 x, V = 1;
//   sum_rows_bf16x(4) bf16 x (a bias gradient summed from an activation gradient that only bf16
//                     GEMMs and these sums read, as PyTorch's autocast sums a linear's bf16
//                     output gradient), fp32 sums; V = 4 reads 8 bytes a row;
//   sum_rows_cast(4)  f32 x, and for every element read out_bf16[r, j] = bf16(x[r, j]) (round
//                     to nearest even, as cast_f32_bf16); V = 4 reads a float4 a row.
// V = 4 needs c a multiple of 4 and x (and out_bf16) aligned to the vector: the launcher checks.

// The V values of x at element k (f32 or bf16 x), as floats.
template <int V>
__device__ __forceinline__ void sr_load(const float* __restrict__ x, long long k, float (&q)[V]) {
    if (V == 4) {
        const float4 f = *reinterpret_cast<const float4*>(x + k);
        q[0] = f.x;
        q[1 % V] = f.y;
        q[2 % V] = f.z;
        q[3 % V] = f.w;
    } else {
        q[0] = x[k];
    }
}
template <int V>
__device__ __forceinline__ void sr_load(const __nv_bfloat16* __restrict__ x, long long k, float (&q)[V]) {
    if (V == 4) {
        const uint2 u = *reinterpret_cast<const uint2*>(x + k);
        const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
        const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
        q[0] = a.x;
        q[1 % V] = a.y;
        q[2 % V] = b.x;
        q[3 % V] = b.y;
    } else {
        q[0] = __bfloat162float(x[k]);
    }
}
// o[k .. k + V) = bf16(q), round to nearest even.
template <int V>
__device__ __forceinline__ void sr_store_bf16(__nv_bfloat16* __restrict__ o, long long k, const float (&q)[V]) {
    if (V == 4) {
        __nv_bfloat162 lo = __floats2bfloat162_rn(q[0], q[1 % V]), hi = __floats2bfloat162_rn(q[2 % V], q[3 % V]);
        uint2 u;
        u.x = *reinterpret_cast<unsigned*>(&lo);
        u.y = *reinterpret_cast<unsigned*>(&hi);
        *reinterpret_cast<uint2*>(o + k) = u;
    } else {
        o[k] = __float2bfloat16_rn(q[0]);
    }
}

template <int V, typename T, bool CAST>
__device__ __forceinline__ void sum_rows_slab(const T* __restrict__ x, float* __restrict__ out,
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
            float q[V];
            sr_load<V>(x, r * c + j0, q);
#pragma unroll
            for (int v = 0; v < V; ++v) acc[v] += q[v];
            if (CAST) sr_store_bf16<V>(out_bf16, r * c + j0, q);
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
extern "C" __global__ void sum_rows(const float* __restrict__ x, float* __restrict__ out, int n, int c,
                                    int rows_per_slab) {
    sum_rows_slab<1, float, false>(x, out, nullptr, n, c, rows_per_slab);
}
extern "C" __global__ void sum_rows_bf16x(const __nv_bfloat16* __restrict__ x, float* __restrict__ out, int n, int c,
                                          int rows_per_slab) {
    sum_rows_slab<1, __nv_bfloat16, false>(x, out, nullptr, n, c, rows_per_slab);
}
extern "C" __global__ void sum_rows_bf16x4(const __nv_bfloat16* __restrict__ x, float* __restrict__ out, int n, int c,
                                           int rows_per_slab) {
    sum_rows_slab<4, __nv_bfloat16, false>(x, out, nullptr, n, c, rows_per_slab);
}
extern "C" __global__ void sum_rows_cast(const float* __restrict__ x, float* __restrict__ out,
                                         __nv_bfloat16* __restrict__ out_bf16, int n, int c, int rows_per_slab) {
    sum_rows_slab<1, float, true>(x, out, out_bf16, n, c, rows_per_slab);
}
extern "C" __global__ void sum_rows_cast4(const float* __restrict__ x, float* __restrict__ out,
                                          __nv_bfloat16* __restrict__ out_bf16, int n, int c, int rows_per_slab) {
    sum_rows_slab<4, float, true>(x, out, out_bf16, n, c, rows_per_slab);
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

// Gradient accumulation over micro-batches: total = s * micro (first) or total + s * micro,
// each operation rounded once (no fused multiply-add: the CPU engine's bits).
extern "C" __global__ void grad_accumulate(const float* __restrict__ micro, float* __restrict__ total, float s,
                                           int first, long long n) {
    const long long n4 = (asteria_aligned(micro, 16) && asteria_aligned(total, 16)) ? n / 4 : 0;
    for (long long i = gtid(); i < n4; i += gstride()) {
        const float4 m = reinterpret_cast<const float4*>(micro)[i];
        float4 t = first ? make_float4(0.f, 0.f, 0.f, 0.f) : reinterpret_cast<float4*>(total)[i];
        t.x = first ? __fmul_rn(m.x, s) : __fadd_rn(t.x, __fmul_rn(m.x, s));
        t.y = first ? __fmul_rn(m.y, s) : __fadd_rn(t.y, __fmul_rn(m.y, s));
        t.z = first ? __fmul_rn(m.z, s) : __fadd_rn(t.z, __fmul_rn(m.z, s));
        t.w = first ? __fmul_rn(m.w, s) : __fadd_rn(t.w, __fmul_rn(m.w, s));
        reinterpret_cast<float4*>(total)[i] = t;
    }
    for (long long i = 4 * n4 + gtid(); i < n; i += gstride()) {
        const float v = __fmul_rn(micro[i], s);
        total[i] = first ? v : __fadd_rn(total[i], v);
    }
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
