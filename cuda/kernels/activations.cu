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

// Kernel-name suffixes below give the operands' dtypes in order, `f` f32 and `b` bf16 (a bf16
// input is a bf16 GEMM's output; a bf16 output is read only by bf16 GEMMs, rounded to nearest
// even: the bits of an f32 result cast afterwards). The math is fp32 in every variant.

// out = 0.5 x (1 + tanh u) = x sigmoid(2u). Suffix: x, out.
template <typename TX, typename TO>
__device__ __forceinline__ void gelu_fwd(const TX* __restrict__ x, TO* __restrict__ out, long long n) {
    for (long long i = gtid(); i < n; i += gstride()) {
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
// written with s = sigmoid(2u): 0.5 (1 + t) = s, 1 - t^2 = 4 s (1 - s). dx f32 (GPT's MLP
// gradient also feeds the bias gradient's column sums). Suffix: dout, x.
template <typename TD, typename TX>
__device__ __forceinline__ void gelu_bwd(const TD* __restrict__ dout, const TX* __restrict__ x, float* __restrict__ dx,
                                         long long n) {
    for (long long i = gtid(); i < n; i += gstride()) {
        const float v = ld_f(x, i);
        const float s = gelu_s(v);
        const float g = s + 2.0f * v * s * (1.0f - s) * GELU_S * (1.0f + 3.0f * GELU_C * v * v);
        dx[i] = ld_f(dout, i) * g;
    }
}
extern "C" __global__ void gelu_backward_ff(const float* __restrict__ dout, const float* __restrict__ x,
                                   float* __restrict__ dx, long long n) {
    gelu_bwd(dout, x, dx, n);
}
extern "C" __global__ void gelu_backward_fb(const float* __restrict__ dout, const __nv_bfloat16* __restrict__ x,
                                   float* __restrict__ dx, long long n) {
    gelu_bwd(dout, x, dx, n);
}
extern "C" __global__ void gelu_backward_bf(const __nv_bfloat16* __restrict__ dout, const float* __restrict__ x,
                                   float* __restrict__ dx, long long n) {
    gelu_bwd(dout, x, dx, n);
}
extern "C" __global__ void gelu_backward_bb(const __nv_bfloat16* __restrict__ dout, const __nv_bfloat16* __restrict__ x,
                                   float* __restrict__ dx, long long n) {
    gelu_bwd(dout, x, dx, n);
}

// x [rows, 2f] = [gate | up]; out[r, k] = silu(gate) * up, out [rows, f]. Suffix: x, out.
template <typename TX, typename TO>
__device__ __forceinline__ void swiglu_fwd(const TX* __restrict__ x, TO* __restrict__ out, long long total, int f) {
    for (long long i = gtid(); i < total; i += gstride()) {
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
    for (long long i = gtid(); i < total; i += gstride()) {
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
