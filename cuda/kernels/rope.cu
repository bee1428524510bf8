#include <cuda_bf16.h>
// Rotary position embedding, LLaMA rotate-half layout (plan ops `Rope`, `RopeBackward`;
// Su et al. 2021). x/out [n, width]; the first rotated_cols columns are rotated in chunks of
// head_dim = 2h: for i < h, out1 = x1 cos(a) - x2 sin(a), out2 = x2 cos(a) + x1 sin(a) with
// a = sign * p * theta^(-2i/head_dim), p = row mod seq_len; other columns are copied.
// `rope_table` computes the angles' cosine and sine once per call in double and rounds them to
// f32 (the CPU engine's tables, the same values); `rope_rotate` reads them. Computing them per
// element in double (pow and sincos for each of N·width elements) made the op ~8x slower than
// its memory traffic.

// cs[2 * (p * h + i)] = cos(p theta_i), cs[2 * (p * h + i) + 1] = sin(p theta_i), p < seq_len, i < h.
extern "C" __global__ void rope_table(float* __restrict__ cs, int seq_len, int head_dim, double theta) {
    const int h = head_dim / 2;
    const long long total = (long long)seq_len * h;
    for (long long e = gtid(); e < total; e += gstride()) {
        const int p = (int)(e / h);
        const int i = (int)(e - (long long)p * h);
        const double freq = pow(theta, -2.0 * (double)i / (double)head_dim);
        double sd, cd;
        sincos((double)p * freq, &sd, &cd);
        cs[2 * e] = (float)cd;
        cs[2 * e + 1] = (float)sd;
    }
}

// One thread per (row, pair) of the rotated columns, writing both of the pair's outputs, and
// per copied column. OUT is float, or __nv_bfloat16 (`rope_rotate_bf16`: round to nearest even,
// the bits a cast of the f32 result gives, for a rotated qkv that only the tensor-core attention
// reads).
template <typename OUT>
__device__ __forceinline__ OUT rope_out(float v);
template <>
__device__ __forceinline__ float rope_out<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 rope_out<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename OUT>
__device__ __forceinline__ void rope_rotate_t(const float* __restrict__ x, OUT* __restrict__ out,
                                              const float2* __restrict__ cs, long long rows, int width,
                                              int seq_len, int head_dim, int rotated_cols, float sign) {
    const int h = head_dim / 2;
    const int pairs = rotated_cols / 2;
    const int copies = width - rotated_cols;
    const int per_row = pairs + copies;
    const long long total = rows * (long long)per_row;
    for (long long e = gtid(); e < total; e += gstride()) {
        const long long r = e / per_row;
        const int k = (int)(e - r * per_row);
        const float* xr = x + r * width;
        OUT* o = out + r * width;
        if (k >= pairs) {
            const int j = rotated_cols + (k - pairs);
            o[j] = rope_out<OUT>(xr[j]);
            continue;
        }
        const int chunk = k / h;
        const int i = k - chunk * h;
        const int j1 = chunk * head_dim + i;
        const float2 t = cs[(long long)(r % seq_len) * h + i];
        const float c = t.x;
        const float s = sign * t.y;
        const float x1 = xr[j1], x2 = xr[j1 + h];
        o[j1] = rope_out<OUT>(x1 * c - x2 * s);
        o[j1 + h] = rope_out<OUT>(x2 * c + x1 * s);
    }
}

extern "C" __global__ void rope_rotate(const float* __restrict__ x, float* __restrict__ out,
                                       const float2* __restrict__ cs, long long rows, int width, int seq_len,
                                       int head_dim, int rotated_cols, float sign) {
    rope_rotate_t<float>(x, out, cs, rows, width, seq_len, head_dim, rotated_cols, sign);
}

extern "C" __global__ void rope_rotate_bf16(const float* __restrict__ x, __nv_bfloat16* __restrict__ out,
                                            const float2* __restrict__ cs, long long rows, int width,
                                            int seq_len, int head_dim, int rotated_cols, float sign) {
    rope_rotate_t<__nv_bfloat16>(x, out, cs, rows, width, seq_len, head_dim, rotated_cols, sign);
}
