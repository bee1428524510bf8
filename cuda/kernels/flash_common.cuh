// Helpers shared by the fused attention families (flash_attention_tc.cu, mma.sync; and
// flash_attention_wgmma.cu, Hopper wgmma), prepended to each family's source before NVRTC
// compiles it: bf16 packing, 16-byte cp.async, row reductions over the 4 lanes of an MMA
// accumulator row, and the accumulator store. m16n8k16 accumulator layout (also the per-warp
// layout of a wgmma m64nNk16 accumulator): g = lane / 4, t = lane % 4, c[4j + 0..1] = (row g,
// columns 8j + 2t, +1), c[4j + 2..3] = (row g + 8, the same columns).

#include <cuda_bf16.h>

#define TC_LOG2E 1.4426950408889634f
#define TC_NEG_INF __int_as_float(0xff800000)

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ unsigned tc_pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
    return *reinterpret_cast<unsigned*>(&v);
}

// Whether a head slice's rows can be copied 16 bytes at a time.
__device__ __forceinline__ bool tc_vec(const bf16* src, long long ld, int hd) {
    return (hd & 7) == 0 && (ld & 7) == 0 && (reinterpret_cast<unsigned long long>(src) & 15) == 0;
}

// cp.async of 16 bytes global -> shared; `valid` false zero-fills the destination (source size
// 0: nothing is read).
__device__ __forceinline__ void tc_cp16(bf16* dst, const bf16* src, bool valid) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void tc_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void tc_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Max, then sum, over the 4 lanes that hold one row of an accumulator.
__device__ __forceinline__ float tc_row_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float tc_row_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Stores accumulator tiles acc (16 rows from row0 of this warp, columns n*8 + 2t + {0,1}) times
// mul into dst (row stride ld, hd columns), rows below n_valid only.
__device__ __forceinline__ void tc_put(float* d, long long i, float v) { d[i] = v; }
__device__ __forceinline__ void tc_put(bf16* d, long long i, float v) { d[i] = __float2bfloat16_rn(v); }

template <int ND, typename OutT>
__device__ __forceinline__ void tc_store(const float (&acc)[ND][4], OutT* __restrict__ dst, long long ld, int row0,
                                         int n_valid, int hd, int g, int t, float mul) {
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = row0 + g + (e >= 2 ? 8 : 0), col = n * 8 + 2 * t + (e & 1);
            if (row < n_valid && col < hd) tc_put(dst, (long long)row * ld + col, acc[n][e] * mul);
        }
}

// The forward's end, both families: each row's sums over its 4 lanes, lse2 = m + log2(l)
// (base 2), then either (dout non-null: backward pass 1) delta = rowsum(dout . o) / l, or out =
// o / l. This warp's 16 rows start at w0; the lane holds rows[0] = w0 + g and rows[1] = w0 + g + 8
// of (batch b, head h) = bh, with the row state m, l and the unnormalised output o.
template <int ND, typename OutT>
__device__ __forceinline__ void tc_forward_finish(float (&o)[ND][4], const float (&m)[2], float (&l)[2],
                                                  const int (&rows)[2], int w0, int bh, int b, int h,
                                                  int seq_len, int c, int hd, int g, int t,
                                                  float* __restrict__ lse2, const bf16* __restrict__ dout,
                                                  float* __restrict__ delta, OutT* __restrict__ out) {
    l[0] = tc_row_sum(l[0]);
    l[1] = tc_row_sum(l[1]);
    const float inv[2] = {1.0f / l[0], 1.0f / l[1]};
    if (t == 0)
#pragma unroll
        for (int i = 0; i < 2; ++i)
            if (rows[i] < seq_len) lse2[(long long)bh * seq_len + rows[i]] = m[i] + log2f(l[i]);
    if (dout != nullptr) {
        // delta from the same bf16 dout the backward's dP = dO V^T uses, so that
        // sum_k P dP - delta stays consistent and dS = P (dP - delta) sums to ~0 over keys.
        const bf16* gb = dout + (long long)b * seq_len * c + (long long)h * hd;
        float acc[2] = {0.0f, 0.0f};
#pragma unroll
        for (int n = 0; n < ND; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = rows[e >> 1], col = n * 8 + 2 * t + (e & 1);
                if (row < seq_len && col < hd) acc[e >> 1] += __bfloat162float(gb[(long long)row * c + col]) * o[n][e];
            }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            acc[i] = tc_row_sum(acc[i]) * inv[i];
            if (t == 0 && rows[i] < seq_len) delta[(long long)bh * seq_len + rows[i]] = acc[i];
        }
    } else if (out != nullptr) {
#pragma unroll
        for (int n = 0; n < ND; ++n) {
            o[n][0] *= inv[0];
            o[n][1] *= inv[0];
            o[n][2] *= inv[1];
            o[n][3] *= inv[1];
        }
        tc_store<ND>(o, out + (long long)b * seq_len * c + (long long)h * hd, c, w0, seq_len, hd, g, t, 1.0f);
    }
}
