#include <cuda_bf16.h>

// GELU (tanh approximation, GPT-2) and SwiGLU, forward and backward (plan ops `Gelu`,
// `GeluBackward`, `SwiGlu`, `SwiGluBackward`). Grid-stride loops over 64-bit element counts.

#define GELU_S 0.7978845608028654f
#define GELU_C 0.044715f

// s = sigmoid(2u) = (1 + tanh u) / 2 with u = sqrt(2/pi) (x + 0.044715 x^3): the GELU written
// without 1 + tanh u, which cancels catastrophically in fp32 for x below about -3 (relative
// error 1e-4 and worse against float64; the sigmoid form stays at fp32 rounding).
__device__ __forceinline__ float gelu_s(float v) {
    return 1.0f / (1.0f + expf(-2.0f * GELU_S * (v + GELU_C * v * v * v)));
}

__device__ __forceinline__ float sigmoidf_(float v) { return 1.0f / (1.0f + expf(-v)); }

__device__ __forceinline__ float ld_f(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float ld_f(const __nv_bfloat16* p, long long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void st_f(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void st_f(__nv_bfloat16* p, long long i, float v) { p[i] = __float2bfloat16_rn(v); }

// Four consecutive elements at p + i (i a multiple of 4, p 4-element aligned: al4): one
// 16-byte (f32) or 8-byte (bf16) access each way.
__device__ __forceinline__ void ld4(const float* p, long long i, float (&v)[4]) {
    const float4 q = *reinterpret_cast<const float4*>(p + i);
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
}
__device__ __forceinline__ void ld4(const __nv_bfloat16* p, long long i, float (&v)[4]) {
    const uint2 q = *reinterpret_cast<const uint2*>(p + i);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&q.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&q.y));
    v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
}
__device__ __forceinline__ void st4(float* p, long long i, const float (&v)[4]) {
    *reinterpret_cast<float4*>(p + i) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void st4(__nv_bfloat16* p, long long i, const float (&v)[4]) {
    const __nv_bfloat162 a = __floats2bfloat162_rn(v[0], v[1]);
    const __nv_bfloat162 b = __floats2bfloat162_rn(v[2], v[3]);
    uint2 q;
    q.x = *reinterpret_cast<const unsigned*>(&a);
    q.y = *reinterpret_cast<const unsigned*>(&b);
    *reinterpret_cast<uint2*>(p + i) = q;
}
template <typename T>
__device__ __forceinline__ bool al4(const T* p) {
    return ((unsigned long long)p % (4 * sizeof(T))) == 0;
}

// Kernel-name suffixes below give the operands' dtypes in order, `f` f32 and `b` bf16 (a bf16
// input is a bf16 GEMM's output; a bf16 output is read only by bf16 GEMMs, rounded to nearest
// even: the bits of an f32 result cast afterwards). The math is fp32 in every variant.

// out = 0.5 x (1 + tanh u) = x sigmoid(2u). Suffix: x, out.
template <typename TX, typename TO>
__device__ __forceinline__ void gelu_fwd(const TX* __restrict__ x, TO* __restrict__ out, long long n) {
    // Groups of four where the operands allow it (the plan's arenas align every buffer), then
    // the rest one by one.
    const long long n4 = (al4(x) && al4(out)) ? n / 4 : 0;
    for (long long g = gtid(); g < n4; g += gstride()) {
        float v[4];
        ld4(x, 4 * g, v);
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k] *= gelu_s(v[k]);
        st4(out, 4 * g, v);
    }
    for (long long i = 4 * n4 + gtid(); i < n; i += gstride()) {
        const float v = ld_f(x, i);
        st_f(out, i, v * gelu_s(v));
    }
}
extern "C" __global__ void gelu_forward_ff(const float* __restrict__ x, float* __restrict__ out, long long n) {
    gelu_fwd(x, out, n);
}
extern "C" __global__ void gelu_forward_fb(const float* __restrict__ x, __nv_bfloat16* __restrict__ out, long long n) {
    gelu_fwd(x, out, n);
}
extern "C" __global__ void gelu_forward_bf(const __nv_bfloat16* __restrict__ x, float* __restrict__ out, long long n) {
    gelu_fwd(x, out, n);
}
extern "C" __global__ void gelu_forward_bb(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ out, long long n) {
    gelu_fwd(x, out, n);
}

// dx = dout * (0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)) with t = tanh u,
// written with s = sigmoid(2u): 0.5 (1 + t) = s, 1 - t^2 = 4 s (1 - s). Suffix: dout, x, dx.
__device__ __forceinline__ float gelu_grad(float v) {
    const float s = gelu_s(v);
    return s + 2.0f * v * s * (1.0f - s) * GELU_S * (1.0f + 3.0f * GELU_C * v * v);
}
template <typename TD, typename TX, typename TO>
__device__ __forceinline__ void gelu_bwd(const TD* __restrict__ dout, const TX* __restrict__ x, TO* __restrict__ dx,
                                         long long n) {
    const long long n4 = (al4(dout) && al4(x) && al4(dx)) ? n / 4 : 0;
    for (long long g = gtid(); g < n4; g += gstride()) {
        float v[4], d[4];
        ld4(x, 4 * g, v);
        ld4(dout, 4 * g, d);
#pragma unroll
        for (int k = 0; k < 4; ++k) d[k] *= gelu_grad(v[k]);
        st4(dx, 4 * g, d);
    }
    for (long long i = 4 * n4 + gtid(); i < n; i += gstride()) st_f(dx, i, ld_f(dout, i) * gelu_grad(ld_f(x, i)));
}
extern "C" __global__ void gelu_backward_fff(const float* __restrict__ dout, const float* __restrict__ x,
                                   float* __restrict__ dx, long long n) {
    gelu_bwd(dout, x, dx, n);
}
extern "C" __global__ void gelu_backward_ffb(const float* __restrict__ dout, const float* __restrict__ x,
                                   __nv_bfloat16* __restrict__ dx, long long n) {
    gelu_bwd(dout, x, dx, n);
}
extern "C" __global__ void gelu_backward_fbf(const float* __restrict__ dout, const __nv_bfloat16* __restrict__ x,
                                   float* __restrict__ dx, long long n) {
    gelu_bwd(dout, x, dx, n);
}
extern "C" __global__ void gelu_backward_fbb(const float* __restrict__ dout, const __nv_bfloat16* __restrict__ x,
                                   __nv_bfloat16* __restrict__ dx, long long n) {
    gelu_bwd(dout, x, dx, n);
}
extern "C" __global__ void gelu_backward_bff(const __nv_bfloat16* __restrict__ dout, const float* __restrict__ x,
                                   float* __restrict__ dx, long long n) {
    gelu_bwd(dout, x, dx, n);
}
extern "C" __global__ void gelu_backward_bfb(const __nv_bfloat16* __restrict__ dout, const float* __restrict__ x,
                                   __nv_bfloat16* __restrict__ dx, long long n) {
    gelu_bwd(dout, x, dx, n);
}
extern "C" __global__ void gelu_backward_bbf(const __nv_bfloat16* __restrict__ dout, const __nv_bfloat16* __restrict__ x,
                                   float* __restrict__ dx, long long n) {
    gelu_bwd(dout, x, dx, n);
}
extern "C" __global__ void gelu_backward_bbb(const __nv_bfloat16* __restrict__ dout, const __nv_bfloat16* __restrict__ x,
                                   __nv_bfloat16* __restrict__ dx, long long n) {
    gelu_bwd(dout, x, dx, n);
}

// x [rows, 2f] = [gate | up]; out[r, k] = silu(gate) * up, out [rows, f]. Suffix: x, out.
template <typename TX, typename TO>
__device__ __forceinline__ void swiglu_fwd(const TX* __restrict__ x, TO* __restrict__ out, long long total, int f) {
    // Groups of four along a row where f allows it and the operands are aligned.
    const long long n4 = (f % 4 == 0 && al4(x) && al4(out)) ? total / 4 : 0;
    for (long long g = gtid(); g < n4; g += gstride()) {
        const long long i = 4 * g, r = i / f;
        const int k = (int)(i - r * f);
        float gt[4], up[4];
        ld4(x, r * 2 * f + k, gt);
        ld4(x, r * 2 * f + f + k, up);
#pragma unroll
        for (int e = 0; e < 4; ++e) gt[e] = gt[e] * sigmoidf_(gt[e]) * up[e];
        st4(out, i, gt);
    }
    for (long long i = 4 * n4 + gtid(); i < total; i += gstride()) {
        const long long r = i / f;
        const int k = (int)(i - r * f);
        const float g = ld_f(x, r * 2 * f + k);
        const float u = ld_f(x, r * 2 * f + f + k);
        st_f(out, i, g * sigmoidf_(g) * u);
    }
}
extern "C" __global__ void swiglu_forward_ff(const float* __restrict__ x, float* __restrict__ out,
                                   long long total, int f) {
    swiglu_fwd(x, out, total, f);
}
extern "C" __global__ void swiglu_forward_fb(const float* __restrict__ x, __nv_bfloat16* __restrict__ out,
                                   long long total, int f) {
    swiglu_fwd(x, out, total, f);
}
extern "C" __global__ void swiglu_forward_bf(const __nv_bfloat16* __restrict__ x, float* __restrict__ out,
                                   long long total, int f) {
    swiglu_fwd(x, out, total, f);
}
extern "C" __global__ void swiglu_forward_bb(const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ out,
                                   long long total, int f) {
    swiglu_fwd(x, out, total, f);
}

// dgate = dout * up * s (1 + g (1 - s)), dup = dout * g * s with s = sigmoid(g). Suffix: dout,
// x, dx.
template <typename TD, typename TX, typename TO>
__device__ __forceinline__ void swiglu_bwd(const TD* __restrict__ dout, const TX* __restrict__ x,
                                           TO* __restrict__ dx, long long total, int f) {
    const long long n4 = (f % 4 == 0 && al4(dout) && al4(x) && al4(dx)) ? total / 4 : 0;
    for (long long g4 = gtid(); g4 < n4; g4 += gstride()) {
        const long long i = 4 * g4, r = i / f;
        const int k = (int)(i - r * f);
        float gt[4], up[4], d[4], dg[4], du[4];
        ld4(x, r * 2 * f + k, gt);
        ld4(x, r * 2 * f + f + k, up);
        ld4(dout, i, d);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float s = sigmoidf_(gt[e]);
            dg[e] = d[e] * up[e] * s * (1.0f + gt[e] * (1.0f - s));
            du[e] = d[e] * gt[e] * s;
        }
        st4(dx, r * 2 * f + k, dg);
        st4(dx, r * 2 * f + f + k, du);
    }
    for (long long i = 4 * n4 + gtid(); i < total; i += gstride()) {
        const long long r = i / f;
        const int k = (int)(i - r * f);
        const float g = ld_f(x, r * 2 * f + k);
        const float u = ld_f(x, r * 2 * f + f + k);
        const float s = sigmoidf_(g);
        const float d = ld_f(dout, i);
        st_f(dx, r * 2 * f + k, d * u * s * (1.0f + g * (1.0f - s)));
        st_f(dx, r * 2 * f + f + k, d * g * s);
    }
}
extern "C" __global__ void swiglu_backward_fff(const float* __restrict__ dout, const float* __restrict__ x,
                                   float* __restrict__ dx, long long total, int f) {
    swiglu_bwd(dout, x, dx, total, f);
}
extern "C" __global__ void swiglu_backward_ffb(const float* __restrict__ dout, const float* __restrict__ x,
                                   __nv_bfloat16* __restrict__ dx, long long total, int f) {
    swiglu_bwd(dout, x, dx, total, f);
}
extern "C" __global__ void swiglu_backward_fbf(const float* __restrict__ dout, const __nv_bfloat16* __restrict__ x,
                                   float* __restrict__ dx, long long total, int f) {
    swiglu_bwd(dout, x, dx, total, f);
}
extern "C" __global__ void swiglu_backward_fbb(const float* __restrict__ dout, const __nv_bfloat16* __restrict__ x,
                                   __nv_bfloat16* __restrict__ dx, long long total, int f) {
    swiglu_bwd(dout, x, dx, total, f);
}
extern "C" __global__ void swiglu_backward_bff(const __nv_bfloat16* __restrict__ dout, const float* __restrict__ x,
                                   float* __restrict__ dx, long long total, int f) {
    swiglu_bwd(dout, x, dx, total, f);
}
extern "C" __global__ void swiglu_backward_bfb(const __nv_bfloat16* __restrict__ dout, const float* __restrict__ x,
                                   __nv_bfloat16* __restrict__ dx, long long total, int f) {
    swiglu_bwd(dout, x, dx, total, f);
}
extern "C" __global__ void swiglu_backward_bbf(const __nv_bfloat16* __restrict__ dout, const __nv_bfloat16* __restrict__ x,
                                   float* __restrict__ dx, long long total, int f) {
    swiglu_bwd(dout, x, dx, total, f);
}
extern "C" __global__ void swiglu_backward_bbb(const __nv_bfloat16* __restrict__ dout, const __nv_bfloat16* __restrict__ x,
                                   __nv_bfloat16* __restrict__ dx, long long total, int f) {
    swiglu_bwd(dout, x, dx, total, f);
}
