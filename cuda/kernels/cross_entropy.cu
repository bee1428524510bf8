// Mean softmax cross-entropy over rows of logits (plan ops `CrossEntropy`,
// `CrossEntropyBackward`). logits/dlogits [n, v], targets i32 [n]. A target outside [0, v)
// records its row in status[0] (atomicMin) and gives a NaN row loss / NaN gradient row.
//
// One block per row (row_threads(ceil(v / 4)) threads). The row max m and s = sum exp(x - m)
// come from one pass over the logits (online softmax; Milakov & Gimelshein 2018, "Online
// normalizer calculation for softmax"): each thread keeps a running (m, s) and rescales s when
// its max grows; the threads' pairs are merged by warp shuffles and shared memory in a fixed
// order, so results are deterministic. Rows are read as float4 from the row's first 16-byte
// boundary on; the < 4 elements before it and the < 4 after the last whole float4 are read one
// by one. The forward reads each logit once, the backward twice (statistics, then the
// gradient) and writes each gradient once.

#include <cuda_bf16.h>

#define XENT_NEG_INF __int_as_float(0xff800000)

// exp(v - m) for v <= m, except that a -inf logit adds exactly 0 even while m is still -inf
// (where exp(-inf - -inf) would be NaN). NaN stays NaN.
__device__ __forceinline__ float xent_exp(float v, float m) { return v == XENT_NEG_INF ? 0.0f : expf(v - m); }

// exp(a - mm) for a <= mm, exactly 1 when a == mm (also when both are the same infinity).
__device__ __forceinline__ float xent_scale(float a, float mm) { return a == mm ? 1.0f : expf(a - mm); }

// (m, s) += one value. m is never NaN (fmaxf drops a NaN operand); a NaN value makes s NaN.
__device__ __forceinline__ void xent_add1(float& m, float& s, float a) {
    const float mm = fmaxf(m, a);
    s = s * xent_scale(m, mm) + xent_exp(a, mm);
    m = mm;
}

// (m, s) += four values: one rescale for the four.
__device__ __forceinline__ void xent_add4(float& m, float& s, float4 q) {
    const float mm = fmaxf(m, fmaxf(fmaxf(q.x, q.y), fmaxf(q.z, q.w)));
    s = s * xent_scale(m, mm) + ((xent_exp(q.x, mm) + xent_exp(q.y, mm)) + (xent_exp(q.z, mm) + xent_exp(q.w, mm)));
    m = mm;
}

// (m, s) merged with (m2, s2). Symmetric in its two pairs, so every lane of an xor butterfly
// ends with the same bits.
__device__ __forceinline__ void xent_merge(float& m, float& s, float m2, float s2) {
    const float mm = fmaxf(m, m2);
    s = s * xent_scale(m, mm) + s2 * xent_scale(m2, mm);
    m = mm;
}

__device__ __forceinline__ void xent_warp_merge(float& m, float& s) {
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(ASTERIA_FULL_MASK, m, o);
        const float s2 = __shfl_xor_sync(ASTERIA_FULL_MASK, s, o);
        xent_merge(m, s, m2, s2);
    }
}

// Elements of x before its first 16-byte boundary (x is 4-byte aligned), at most v.
__device__ __forceinline__ int xent_head(const float* x, int v) {
    const int h = (int)(((16u - ((unsigned)(unsigned long long)x & 15u)) & 15u) >> 2);
    return h < v ? h : v;
}

// Merges every thread's running (m, s) over the block in a fixed order and hands the row's
// (max, sum) to every thread (blockDim.x a multiple of 32). Once per kernel (its shared arrays
// are not re-synced).
__device__ __forceinline__ void xent_block_merge(float m, float s, float* m_out, float* s_out) {
    __shared__ float s_m[32];
    __shared__ float s_s[32];
    xent_warp_merge(m, s);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    if (lane == 0) {
        s_m[warp] = m;
        s_s[warp] = s;
    }
    __syncthreads();
    m = lane < nwarps ? s_m[lane] : XENT_NEG_INF;
    s = lane < nwarps ? s_s[lane] : 0.0f;
    xent_warp_merge(m, s);
    *m_out = m;
    *s_out = s;
}

// Row max *m_out and *s_out = sum_j exp(x[j] - m) over x[0..v), for every thread of the block
// (blockDim.x a multiple of 32). Call once per kernel (its shared arrays are not re-synced).
__device__ void xent_row_stats(const float* __restrict__ x, int v, float* m_out, float* s_out) {
    const int tid = threadIdx.x;
    const int head = xent_head(x, v);
    const int nvec = (v - head) >> 2;
    const int rest = head + 4 * nvec;
    float m = XENT_NEG_INF, s = 0.0f;
    if (tid < head) xent_add1(m, s, x[tid]);
    if (tid < v - rest) xent_add1(m, s, x[rest + tid]);
    const float4* xv = reinterpret_cast<const float4*>(x + head);
#pragma unroll 4
    for (int i = tid; i < nvec; i += blockDim.x) xent_add4(m, s, xv[i]);
    xent_block_merge(m, s, m_out, s_out);
}

// loss[0] = (1/n) sum_r row_loss[r], in double, fixed order. Launch with one block.
extern "C" __global__ void xent_mean(const double* __restrict__ row_loss, float* __restrict__ loss, int n) {
    double acc = 0.0;
    for (int r = threadIdx.x; r < n; r += blockDim.x) acc += row_loss[r];
    acc = block_sum_d(acc);
    if (threadIdx.x == 0) loss[0] = n > 0 ? (float)(acc / (double)n) : 0.0f;
}

// dlogits = (softmax(logits) - onehot(targets)) * inv_n. One block per row. The gradient pass
// reads with evict-first loads and writes with streaming stores, leaving L2 to the logits the
// statistics pass just read.
extern "C" __global__ void xent_backward(const float* __restrict__ logits, const int* __restrict__ targets,
                                         float* __restrict__ dlogits, int n, int v, float inv_n, int* status) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const float* x = logits + (long long)row * v;
    float* d = dlogits + (long long)row * v;
    const int t = targets[row];
    if (t < 0 || t >= v) {
        if (threadIdx.x == 0) atomicMin(status, row);
        for (int j = threadIdx.x; j < v; j += blockDim.x) d[j] = ASTERIA_NAN;
        return;
    }
    float m, s;
    xent_row_stats(x, v, &m, &s);
    const float k = inv_n / s;
    const int tid = threadIdx.x;
    const int head = xent_head(x, v);
    if (head != xent_head(d, v)) {
        // logits and dlogits differ in 16-byte alignment: scalar (still coalesced).
        for (int j = tid; j < v; j += blockDim.x) d[j] = xent_exp(x[j], m) * k - (j == t ? inv_n : 0.0f);
        return;
    }
    const int nvec = (v - head) >> 2;
    const int rest = head + 4 * nvec;
    if (tid < head) d[tid] = xent_exp(x[tid], m) * k - (tid == t ? inv_n : 0.0f);
    if (tid < v - rest) {
        const int j = rest + tid;
        d[j] = xent_exp(x[j], m) * k - (j == t ? inv_n : 0.0f);
    }
    const float4* xv = reinterpret_cast<const float4*>(x + head);
    float4* dv = reinterpret_cast<float4*>(d + head);
#pragma unroll 4
    for (int i = tid; i < nvec; i += blockDim.x) {
        const float4 q = __ldcs(xv + i);
        const int j = head + 4 * i;
        float4 r;
        r.x = xent_exp(q.x, m) * k - (j == t ? inv_n : 0.0f);
        r.y = xent_exp(q.y, m) * k - (j + 1 == t ? inv_n : 0.0f);
        r.z = xent_exp(q.z, m) * k - (j + 2 == t ? inv_n : 0.0f);
        r.w = xent_exp(q.w, m) * k - (j + 3 == t ? inv_n : 0.0f);
        __stcs(dv + i, r);
    }
}

// As xent_backward, but dlogits is written in bf16 (round to nearest even) for consumers that
// read bf16 anyway: the LM head's backward GEMMs under `precision = bf16`, which then need no
// fp32 copy of the [n, v] gradient nor a cast of it. One block per row.
extern "C" __global__ void xent_backward_bf16(const float* __restrict__ logits, const int* __restrict__ targets,
                                              __nv_bfloat16* __restrict__ dlogits, int n, int v, float inv_n,
                                              int* status) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const float* x = logits + (long long)row * v;
    __nv_bfloat16* d = dlogits + (long long)row * v;
    const int t = targets[row];
    if (t < 0 || t >= v) {
        if (threadIdx.x == 0) atomicMin(status, row);
        for (int j = threadIdx.x; j < v; j += blockDim.x) d[j] = __float2bfloat16_rn(ASTERIA_NAN);
        return;
    }
    float m, s;
    xent_row_stats(x, v, &m, &s);
    const float k = inv_n / s;
    const int tid = threadIdx.x;
    const int head = xent_head(x, v);
    const int nvec = (v - head) >> 2;
    const int rest = head + 4 * nvec;
    if (tid < head) d[tid] = __float2bfloat16_rn(xent_exp(x[tid], m) * k - (tid == t ? inv_n : 0.0f));
    if (tid < v - rest) {
        const int j = rest + tid;
        d[j] = __float2bfloat16_rn(xent_exp(x[j], m) * k - (j == t ? inv_n : 0.0f));
    }
    const float4* xv = reinterpret_cast<const float4*>(x + head);
#pragma unroll 4
    for (int i = tid; i < nvec; i += blockDim.x) {
        const float4 q = __ldcs(xv + i);
        const int j = head + 4 * i;
        d[j] = __float2bfloat16_rn(xent_exp(q.x, m) * k - (j == t ? inv_n : 0.0f));
        d[j + 1] = __float2bfloat16_rn(xent_exp(q.y, m) * k - (j + 1 == t ? inv_n : 0.0f));
        d[j + 2] = __float2bfloat16_rn(xent_exp(q.z, m) * k - (j + 2 == t ? inv_n : 0.0f));
        d[j + 3] = __float2bfloat16_rn(xent_exp(q.w, m) * k - (j + 3 == t ? inv_n : 0.0f));
    }
}

// bf16 logits (the LM head's bf16 GEMM rounds its fp32 result; PyTorch's autocast head does
// the same): the statistics, loss and gradient are computed in fp32 from the bf16 values. Rows
// are read 8 values (16 bytes) a thread per step from the row's first 16-byte boundary on, one
// rescale of the running sum per 8 values; the < 8 elements before it and after the last whole
// group one by one.

// Elements of x before its first 16-byte boundary (x is 2-byte aligned), at most v.
__device__ __forceinline__ int xent_head(const __nv_bfloat16* x, int v) {
    const int h = (int)(((16u - ((unsigned)(unsigned long long)x & 15u)) & 15u) >> 1);
    return h < v ? h : v;
}

// The eight bf16 values of q, in memory order.
__device__ __forceinline__ void xent_unpack8(uint4 q, float (&f)[8]) {
    const unsigned w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 t = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[k]));
        f[2 * k] = t.x;
        f[2 * k + 1] = t.y;
    }
}

// (m, s) += eight values: one rescale for the eight.
__device__ __forceinline__ void xent_add8(float& m, float& s, const float (&f)[8]) {
    const float mx = fmaxf(fmaxf(fmaxf(f[0], f[1]), fmaxf(f[2], f[3])), fmaxf(fmaxf(f[4], f[5]), fmaxf(f[6], f[7])));
    const float mm = fmaxf(m, mx);
    const float e = ((xent_exp(f[0], mm) + xent_exp(f[1], mm)) + (xent_exp(f[2], mm) + xent_exp(f[3], mm))) +
                    ((xent_exp(f[4], mm) + xent_exp(f[5], mm)) + (xent_exp(f[6], mm) + xent_exp(f[7], mm)));
    s = s * xent_scale(m, mm) + e;
    m = mm;
}

__device__ void xent_row_stats(const __nv_bfloat16* __restrict__ x, int v, float* m_out, float* s_out) {
    const int tid = threadIdx.x;
    const int head = xent_head(x, v);
    const int nvec = (v - head) >> 3;
    const int rest = head + 8 * nvec;
    float m = XENT_NEG_INF, s = 0.0f;
    if (tid < head) xent_add1(m, s, __bfloat162float(x[tid]));
    if (tid < v - rest) xent_add1(m, s, __bfloat162float(x[rest + tid]));
    const uint4* xv = reinterpret_cast<const uint4*>(x + head);
#pragma unroll 2
    for (int i = tid; i < nvec; i += blockDim.x) {
        float f[8];
        xent_unpack8(xv[i], f);
        xent_add8(m, s, f);
    }
    xent_block_merge(m, s, m_out, s_out);
}

__device__ __forceinline__ float xent_f(float x) { return x; }
__device__ __forceinline__ float xent_f(__nv_bfloat16 x) { return __bfloat162float(x); }

// row_loss[r] = logsumexp(logits[r, :]) - logits[r, targets[r]] (double), logits f32 or bf16
// (a bf16 LM head's output; the statistics are fp32 either way). One block per row.
template <typename T>
__device__ void xent_row_loss_t(const T* __restrict__ logits, const int* __restrict__ targets,
                                double* __restrict__ row_loss, int n, int v, int* status) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const T* x = logits + (long long)row * v;
    const int t = targets[row];
    float m, s;
    xent_row_stats(x, v, &m, &s);
    if (threadIdx.x == 0) {
        if (t < 0 || t >= v) {
            atomicMin(status, row);
            row_loss[row] = __longlong_as_double(0x7ff8000000000000ll);
        } else {
            row_loss[row] = (double)m + log((double)s) - (double)xent_f(x[t]);
        }
    }
}
extern "C" __global__ void xent_row_loss(const float* __restrict__ logits, const int* __restrict__ targets,
                                         double* __restrict__ row_loss, int n, int v, int* status) {
    xent_row_loss_t(logits, targets, row_loss, n, v, status);
}
extern "C" __global__ void xent_row_loss_bf16x(const __nv_bfloat16* __restrict__ logits, const int* __restrict__ targets,
                                               double* __restrict__ row_loss, int n, int v, int* status) {
    xent_row_loss_t(logits, targets, row_loss, n, v, status);
}

// xent_backward over bf16 logits, dlogits written in bf16 (round to nearest even).
extern "C" __global__ void xent_backward_bf16x_bf16(const __nv_bfloat16* __restrict__ logits,
                                                    const int* __restrict__ targets,
                                                    __nv_bfloat16* __restrict__ dlogits, int n, int v, float inv_n,
                                                    int* status) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const __nv_bfloat16* x = logits + (long long)row * v;
    __nv_bfloat16* d = dlogits + (long long)row * v;
    const int t = targets[row];
    if (t < 0 || t >= v) {
        if (threadIdx.x == 0) atomicMin(status, row);
        for (int j = threadIdx.x; j < v; j += blockDim.x) d[j] = __float2bfloat16_rn(ASTERIA_NAN);
        return;
    }
    float m, s;
    xent_row_stats(x, v, &m, &s);
    const float k = inv_n / s;
    const int tid = threadIdx.x;
    const int head = xent_head(x, v);
    if (head != xent_head(d, v)) {
        // logits and dlogits differ in 16-byte alignment: one by one (still coalesced).
        for (int j = tid; j < v; j += blockDim.x)
            d[j] = __float2bfloat16_rn(xent_exp(__bfloat162float(x[j]), m) * k - (j == t ? inv_n : 0.0f));
        return;
    }
    const int nvec = (v - head) >> 3;
    const int rest = head + 8 * nvec;
    if (tid < head) d[tid] = __float2bfloat16_rn(xent_exp(__bfloat162float(x[tid]), m) * k - (tid == t ? inv_n : 0.0f));
    if (tid < v - rest) {
        const int j = rest + tid;
        d[j] = __float2bfloat16_rn(xent_exp(__bfloat162float(x[j]), m) * k - (j == t ? inv_n : 0.0f));
    }
    const uint4* xv = reinterpret_cast<const uint4*>(x + head);
    uint4* dv = reinterpret_cast<uint4*>(d + head);
#pragma unroll 2
    for (int i = tid; i < nvec; i += blockDim.x) {
        float f[8];
        xent_unpack8(__ldcs(xv + i), f);
        const int j = head + 8 * i;
        unsigned w[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float a = xent_exp(f[2 * e], m) * k - (j + 2 * e == t ? inv_n : 0.0f);
            const float b = xent_exp(f[2 * e + 1], m) * k - (j + 2 * e + 1 == t ? inv_n : 0.0f);
            const __nv_bfloat162 p = __floats2bfloat162_rn(a, b);
            w[e] = *reinterpret_cast<const unsigned*>(&p);
        }
        __stcs(dv + i, make_uint4(w[0], w[1], w[2], w[3]));
    }
}
