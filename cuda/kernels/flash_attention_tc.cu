// Fused causal multi-head self-attention on bf16 tensor cores (plan ops `Attention`,
// `AttentionBackward` under `precision = bf16`), FlashAttention-2 (Dao, 2023) with the MMA
// register layout of its CUTLASS kernels: Q, K, V, dO, P and dS enter `mma.sync m16n8k16` as
// bf16, every accumulation (scores, O, dQ, dK, dV, row sums) is fp32, and the softmax runs in
// fp32 registers on the score accumulators (base 2: s2 = (q . k) * scale * log2(e)). Same
// layout and the same three-pass backward as flash_attention.cu (the fp32 SIMT family):
//
// qkv [B*T, 3C] = [q | k | v] (head h = columns h*hd .. h*hd+hd-1 of its part); out / dout
// [B*T, C]; lse2 and delta fp32 [B, NH, T]. Forward: a block owns 64 query rows of one
// (batch, head) = blockIdx.y, 4 warps of 16 rows; K and V stream through shared memory in tiles
// of 64 keys up to the causal diagonal. Backward pass 1 reruns the forward with dout and writes
// lse2 and delta = dout . o; pass 2 computes dK, dV for 64 keys per block (4 warps x 16 keys,
// looping over query tiles from the diagonal); pass 3 computes dQ for 64 queries per block. Every
// element of dqkv is written exactly once (no atomics, deterministic).
//
// m16n8k16 fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16"), g = lane / 4, t = lane % 4:
//   A 16x16 row-major: a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B 16x8 (k x n):     b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C 16x8 fp32:        c0,c1 = (g, 2t), (g, 2t+1); c2,c3 = (g+8, 2t), (g+8, 2t+1)
// so the score accumulators of two adjacent 8-key tiles are, packed to bf16, the A fragment of
// the next MMA over those 16 keys (P V, dS K, ...), without a trip through shared memory.
// B operands are read from shared memory with the reduction index contiguous: [n][k] tiles
// (K for Q K^T, or the transposed tiles Vt, Qt, dOt, Kt written at load time). Row strides of
// HD + 8 and 64 + 8 bf16 make the 32 lanes' 4-byte fragment loads hit 32 distinct banks.
//
// Head dims up to 64 (variants _d32, _d64; padded with zeros); wider heads use the SIMT family.

#include <cuda_bf16.h>

#define TC_ROWS 64   // rows (queries, or keys for dK/dV) per block: 4 warps x 16
#define TC_TILE 64   // keys (or queries) per shared-memory tile
#define TC_LOG2E 1.4426950408889634f
#define TC_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ unsigned tc_pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
    return *reinterpret_cast<unsigned*>(&v);
}

// Two consecutive bf16 of shared memory (even element index) as one 32-bit fragment register.
__device__ __forceinline__ unsigned tc_ld(const __nv_bfloat16* s, int idx) {
    return *reinterpret_cast<const unsigned*>(s + idx);
}

// d += a * b (m16n8k16, bf16 in, fp32 accumulate).
__device__ __forceinline__ void tc_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A fragment (16 rows from r0, k columns k0..k0+15) of a row-major bf16 tile with row stride lds.
__device__ __forceinline__ void tc_frag_a(unsigned (&a)[4], const __nv_bfloat16* s, int lds, int r0, int k0,
                                          int g, int t) {
    a[0] = tc_ld(s, (r0 + g) * lds + k0 + 2 * t);
    a[1] = tc_ld(s, (r0 + g + 8) * lds + k0 + 2 * t);
    a[2] = tc_ld(s, (r0 + g) * lds + k0 + 2 * t + 8);
    a[3] = tc_ld(s, (r0 + g + 8) * lds + k0 + 2 * t + 8);
}

// acc[n-tile j] += A (16 x 16*KS, fragments a[ks]) times B where B[k][n] = s[(n0 + n) * lds + k]:
// NT n-tiles of 8 from n0.
template <int KS, int NT>
__device__ __forceinline__ void tc_mma_rows(float (&acc)[NT][4], const unsigned (&a)[KS][4],
                                            const __nv_bfloat16* s, int lds, int n0, int g, int t) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            const int base = (n0 + j * 8 + g) * lds + kk * 16 + 2 * t;
            tc_mma(acc[j], a[kk], tc_ld(s, base), tc_ld(s, base + 8));
        }
}

// acc[j] += P (16 x 64, held as score accumulators p[8][4]) times B where
// B[k][n] = s[(n * 8 + g...) * lds + k]: the P V / dS K / P^T dO / dS^T Q products.
template <int ND>
__device__ __forceinline__ void tc_mma_p(float (&acc)[ND][4], const float (&p)[TC_TILE / 8][4],
                                         const __nv_bfloat16* s, int lds, int g, int t) {
#pragma unroll
    for (int kk = 0; kk < TC_TILE / 16; ++kk) {
        const unsigned a[4] = {tc_pack(p[2 * kk][0], p[2 * kk][1]), tc_pack(p[2 * kk][2], p[2 * kk][3]),
                               tc_pack(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                               tc_pack(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
        for (int n = 0; n < ND; ++n) {
            const int base = (n * 8 + g) * lds + kk * 16 + 2 * t;
            tc_mma(acc[n], a, tc_ld(s, base), tc_ld(s, base + 8));
        }
    }
}

// Rows row0 .. row0+nrows-1 (zeros past n_valid) of a head slice `src` (row stride ld, hd valid
// columns, zeros up to HD) into bf16 shared memory: dst[r * lds + d], or with TRANS dst[d * lds + r].
// 16-byte loads when every row start is 16-byte aligned and hd is a multiple of 4 (GPT-2's
// layout), else pairs of scalar loads.
template <int HD, bool TRANS>
__device__ __forceinline__ void tc_load(__nv_bfloat16* dst, int lds, const float* __restrict__ src, long long ld,
                                        int row0, int nrows, int n_valid, int hd) {
    const bool vec = (hd & 3) == 0 && (ld & 3) == 0 && (reinterpret_cast<unsigned long long>(src) & 15) == 0;
    if (vec) {
        for (int e = threadIdx.x; e < nrows * (HD / 4); e += blockDim.x) {
            const int r = e / (HD / 4), d = 4 * (e % (HD / 4)), row = row0 + r;
            float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (row < n_valid && d < hd) x = *reinterpret_cast<const float4*>(src + (long long)row * ld + d);
            if (TRANS) {
                dst[d * lds + r] = __float2bfloat16_rn(x.x);
                dst[(d + 1) * lds + r] = __float2bfloat16_rn(x.y);
                dst[(d + 2) * lds + r] = __float2bfloat16_rn(x.z);
                dst[(d + 3) * lds + r] = __float2bfloat16_rn(x.w);
            } else {
                *reinterpret_cast<uint2*>(dst + r * lds + d) = make_uint2(tc_pack(x.x, x.y), tc_pack(x.z, x.w));
            }
        }
        return;
    }
    for (int e = threadIdx.x; e < nrows * (HD / 2); e += blockDim.x) {
        const int r = e / (HD / 2), d = 2 * (e % (HD / 2)), row = row0 + r;
        const bool ok = row < n_valid;
        const float* p = src + (long long)row * ld + d;
        const float x0 = (ok && d < hd) ? p[0] : 0.0f;
        const float x1 = (ok && d + 1 < hd) ? p[1] : 0.0f;
        if (TRANS) {
            dst[d * lds + r] = __float2bfloat16_rn(x0);
            dst[(d + 1) * lds + r] = __float2bfloat16_rn(x1);
        } else {
            *reinterpret_cast<unsigned*>(dst + r * lds + d) = tc_pack(x0, x1);
        }
    }
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
template <int ND>
__device__ __forceinline__ void tc_store(const float (&acc)[ND][4], float* __restrict__ dst, long long ld, int row0,
                                         int n_valid, int hd, int g, int t, float mul) {
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = row0 + g + (e >= 2 ? 8 : 0), col = n * 8 + 2 * t + (e & 1);
            if (row < n_valid && col < hd) dst[(long long)row * ld + col] = acc[n][e] * mul;
        }
}

// Forward (and backward pass 1). grid (ceil(T/64), B*NH), block 128.
// out (may be null) [B*T, C]; lse2 [B*NH*T]; with dout non-null: delta [B*NH*T] = dout . o and
// out is not written.
template <int HD>
__device__ __forceinline__ void tc_forward(const float* __restrict__ qkv, float* __restrict__ out,
                                           float* __restrict__ lse2, const float* __restrict__ dout,
                                           float* __restrict__ delta, int seq_len, int n_heads, int hd, float scale) {
    constexpr int LD = HD + 8, LDT = TC_TILE + 8, KS = HD / 16, ND = HD / 8, NT = TC_TILE / 8;
    __shared__ __align__(16) __nv_bfloat16 ks[TC_TILE * LD];
    __shared__ __align__(16) __nv_bfloat16 vt[HD * LDT];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.y, b = bh / n_heads, h = bh % n_heads;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * TC_ROWS;  // longest rows first
    const int c = n_heads * hd;
    const long long ld = 3LL * c;
    const float* base = qkv + (long long)b * seq_len * ld + (long long)h * hd;
    const int w0 = q0 + warp * 16;            // this warp's first query
    const int row_a = w0 + g, row_b = row_a + 8;  // the two rows this lane holds
    const float sl = scale * TC_LOG2E;

    // Q fragments, staged through the K tile's shared memory.
    unsigned qa[KS][4];
    tc_load<HD, false>(ks, LD, base, ld, q0, TC_ROWS, seq_len, hd);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) tc_frag_a(qa[kk], ks, LD, warp * 16, kk * 16, g, t);

    float o[ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {TC_NEG_INF, TC_NEG_INF}, l[2] = {0.0f, 0.0f};
    const int kend = min(seq_len, q0 + TC_ROWS);
    for (int k0 = 0; k0 < kend; k0 += TC_TILE) {
        __syncthreads();
        tc_load<HD, false>(ks, LD, base + c, ld, k0, TC_TILE, seq_len, hd);
        tc_load<HD, true>(vt, LDT, base + 2 * c, ld, k0, TC_TILE, seq_len, hd);
        __syncthreads();
        float s[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
        tc_mma_rows<KS, NT>(s, qa, ks, LD, 0, g, t);
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + j * 8 + 2 * t + (e & 1), row = e < 2 ? row_a : row_b;
                const float v = (key <= row && key < seq_len) ? s[j][e] * sl : TC_NEG_INF;
                s[j][e] = v;
                mx[e >> 1] = fmaxf(mx[e >> 1], v);
            }
        float corr[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mx[i] = tc_row_max(mx[i]);
            // A row with no visible key yet keeps its (empty) state.
            corr[i] = (mx[i] == TC_NEG_INF) ? 1.0f : exp2f(m[i] - mx[i]);
            l[i] *= corr[i];
            m[i] = mx[i];
        }
#pragma unroll
        for (int n = 0; n < ND; ++n) {
            o[n][0] *= corr[0];
            o[n][1] *= corr[0];
            o[n][2] *= corr[1];
            o[n][3] *= corr[1];
        }
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = (s[j][e] == TC_NEG_INF) ? 0.0f : exp2f(s[j][e] - m[e >> 1]);
                s[j][e] = p;
                l[e >> 1] += p;  // this lane's part of the row sum
            }
        tc_mma_p<ND>(o, s, vt, LDT, g, t);
    }
    l[0] = tc_row_sum(l[0]);
    l[1] = tc_row_sum(l[1]);
    const float inv[2] = {1.0f / l[0], 1.0f / l[1]};
    const int rows[2] = {row_a, row_b};
    if (t == 0)
#pragma unroll
        for (int i = 0; i < 2; ++i)
            if (rows[i] < seq_len) lse2[(long long)bh * seq_len + rows[i]] = m[i] + log2f(l[i]);
    if (dout != nullptr) {
        const float* gb = dout + (long long)b * seq_len * c + (long long)h * hd;
        float acc[2] = {0.0f, 0.0f};
#pragma unroll
        for (int n = 0; n < ND; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = rows[e >> 1], col = n * 8 + 2 * t + (e & 1);
                // dout rounded to bf16 as the backward's dP = dO V^T sees it, so that
                // sum_k P dP - delta stays consistent and dS = P (dP - delta) sums to ~0.
                if (row < seq_len && col < hd)
                    acc[e >> 1] += __bfloat162float(__float2bfloat16_rn(gb[(long long)row * c + col])) * o[n][e];
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

// Backward pass 2: dK, dV of 64 keys per block (16 per warp), looping over query tiles from the
// block's first key. grid (ceil(T/64), B*NH), block 128. Writes the k and v parts of dqkv.
template <int HD>
__device__ __forceinline__ void tc_backward_dkdv(const float* __restrict__ dout, const float* __restrict__ qkv,
                                                 const float* __restrict__ lse2, const float* __restrict__ delta,
                                                 float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                 float scale) {
    constexpr int LD = HD + 8, LDT = TC_TILE + 8, KS = HD / 16, ND = HD / 8, NT = TC_TILE / 8;
    __shared__ __align__(16) __nv_bfloat16 qs[TC_TILE * LD];   // Q tile [q][d]
    __shared__ __align__(16) __nv_bfloat16 gs[TC_TILE * LD];   // dO tile [q][d]
    __shared__ __align__(16) __nv_bfloat16 qt[HD * LDT];       // Q tile [d][q]
    __shared__ __align__(16) __nv_bfloat16 gt[HD * LDT];       // dO tile [d][q]
    __shared__ float ls[TC_TILE], dls[TC_TILE];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.y, b = bh / n_heads, h = bh % n_heads;
    const int j0 = blockIdx.x * TC_ROWS;  // first blocks have the most queries: launched first
    const int c = n_heads * hd;
    const long long ld = 3LL * c;
    const float* base = qkv + (long long)b * seq_len * ld + (long long)h * hd;
    const float* gbase = dout + (long long)b * seq_len * c + (long long)h * hd;
    const float* lrow = lse2 + (long long)bh * seq_len;
    const float* drow = delta + (long long)bh * seq_len;
    const int w0 = j0 + warp * 16;
    const int key_a = w0 + g, key_b = key_a + 8;
    const float sl = scale * TC_LOG2E;

    // K and V fragments of this warp's 16 keys, staged through qs / gs.
    unsigned ka[KS][4], va[KS][4];
    tc_load<HD, false>(qs, LD, base + c, ld, j0, TC_ROWS, seq_len, hd);
    tc_load<HD, false>(gs, LD, base + 2 * c, ld, j0, TC_ROWS, seq_len, hd);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        tc_frag_a(ka[kk], qs, LD, warp * 16, kk * 16, g, t);
        tc_frag_a(va[kk], gs, LD, warp * 16, kk * 16, g, t);
    }
    float dk[ND][4], dv[ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;

    for (int i0 = j0; i0 < seq_len; i0 += TC_TILE) {
        __syncthreads();
        tc_load<HD, false>(qs, LD, base, ld, i0, TC_TILE, seq_len, hd);
        tc_load<HD, true>(qt, LDT, base, ld, i0, TC_TILE, seq_len, hd);
        tc_load<HD, false>(gs, LD, gbase, c, i0, TC_TILE, seq_len, hd);
        tc_load<HD, true>(gt, LDT, gbase, c, i0, TC_TILE, seq_len, hd);
        if (threadIdx.x < TC_TILE) {
            const int row = i0 + threadIdx.x;
            ls[threadIdx.x] = row < seq_len ? lrow[row] : 0.0f;
            dls[threadIdx.x] = row < seq_len ? drow[row] : 0.0f;
        }
        __syncthreads();
        // S^T = K Q^T and dP^T = V dO^T: 16 keys x 64 queries.
        float st[NT][4], dpt[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.0f;
        tc_mma_rows<KS, NT>(st, ka, qs, LD, 0, g, t);
        tc_mma_rows<KS, NT>(dpt, va, gs, LD, 0, g, t);
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int qi = j * 8 + 2 * t + (e & 1), q = i0 + qi, key = e < 2 ? key_a : key_b;
                const float p = (key <= q && q < seq_len) ? exp2f(st[j][e] * sl - ls[qi]) : 0.0f;
                st[j][e] = p;                       // P^T
                dpt[j][e] = p * (dpt[j][e] - dls[qi]);  // dS^T
            }
        tc_mma_p<ND>(dv, st, gt, LDT, g, t);   // dV += P^T dO
        tc_mma_p<ND>(dk, dpt, qt, LDT, g, t);  // dK += dS^T Q
    }
    float* dk_base = dqkv + (long long)b * seq_len * ld + c + (long long)h * hd;
    tc_store<ND>(dk, dk_base, ld, w0, seq_len, hd, g, t, scale);
    tc_store<ND>(dv, dk_base + c, ld, w0, seq_len, hd, g, t, 1.0f);
}

// Backward pass 3: dQ of 64 queries per block (16 per warp), looping over key tiles up to the
// diagonal. grid (ceil(T/64), B*NH), block 128. Writes the q part of dqkv.
template <int HD>
__device__ __forceinline__ void tc_backward_dq(const float* __restrict__ dout, const float* __restrict__ qkv,
                                               const float* __restrict__ lse2, const float* __restrict__ delta,
                                               float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                               float scale) {
    constexpr int LD = HD + 8, LDT = TC_TILE + 8, KS = HD / 16, ND = HD / 8, NT = TC_TILE / 8;
    __shared__ __align__(16) __nv_bfloat16 ks[TC_TILE * LD];  // K tile [key][d]
    __shared__ __align__(16) __nv_bfloat16 vs[TC_TILE * LD];  // V tile [key][d]
    __shared__ __align__(16) __nv_bfloat16 kt[HD * LDT];      // K tile [d][key]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.y, b = bh / n_heads, h = bh % n_heads;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * TC_ROWS;
    const int c = n_heads * hd;
    const long long ld = 3LL * c;
    const float* base = qkv + (long long)b * seq_len * ld + (long long)h * hd;
    const float* gbase = dout + (long long)b * seq_len * c + (long long)h * hd;
    const int w0 = q0 + warp * 16;
    const int rows[2] = {w0 + g, w0 + g + 8};
    const float sl = scale * TC_LOG2E;

    unsigned qa[KS][4], ga[KS][4];
    tc_load<HD, false>(ks, LD, base, ld, q0, TC_ROWS, seq_len, hd);
    tc_load<HD, false>(vs, LD, gbase, c, q0, TC_ROWS, seq_len, hd);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        tc_frag_a(qa[kk], ks, LD, warp * 16, kk * 16, g, t);
        tc_frag_a(ga[kk], vs, LD, warp * 16, kk * 16, g, t);
    }
    float lse[2], dlt[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const bool real = rows[i] < seq_len;
        lse[i] = real ? lse2[(long long)bh * seq_len + rows[i]] : 0.0f;
        dlt[i] = real ? delta[(long long)bh * seq_len + rows[i]] : 0.0f;
    }
    float dq[ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
    const int kend = min(seq_len, q0 + TC_ROWS);
    for (int k0 = 0; k0 < kend; k0 += TC_TILE) {
        __syncthreads();
        tc_load<HD, false>(ks, LD, base + c, ld, k0, TC_TILE, seq_len, hd);
        tc_load<HD, true>(kt, LDT, base + c, ld, k0, TC_TILE, seq_len, hd);
        tc_load<HD, false>(vs, LD, base + 2 * c, ld, k0, TC_TILE, seq_len, hd);
        __syncthreads();
        float s[NT][4], dp[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.0f;
        tc_mma_rows<KS, NT>(s, qa, ks, LD, 0, g, t);   // S = Q K^T
        tc_mma_rows<KS, NT>(dp, ga, vs, LD, 0, g, t);  // dP = dO V^T
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + j * 8 + 2 * t + (e & 1), i = e >> 1;
                const float p = (key <= rows[i] && rows[i] < seq_len) ? exp2f(s[j][e] * sl - lse[i]) : 0.0f;
                dp[j][e] = p * (dp[j][e] - dlt[i]);  // dS
            }
        tc_mma_p<ND>(dq, dp, kt, LDT, g, t);  // dQ += dS K
    }
    tc_store<ND>(dq, dqkv + (long long)b * seq_len * ld + (long long)h * hd, ld, w0, seq_len, hd, g, t, scale);
}

extern "C" __global__ void flash_attn_tc_fwd_d32(const float* __restrict__ qkv, float* __restrict__ out,
                                                 float* __restrict__ lse2, const float* __restrict__ dout,
                                                 float* __restrict__ delta, int seq_len, int n_heads, int hd,
                                                 float scale) {
    tc_forward<32>(qkv, out, lse2, dout, delta, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void flash_attn_tc_bwd_dkdv_d32(const float* __restrict__ dout, const float* __restrict__ qkv,
                                                      const float* __restrict__ lse2, const float* __restrict__ delta,
                                                      float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                      float scale) {
    tc_backward_dkdv<32>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void flash_attn_tc_bwd_dq_d32(const float* __restrict__ dout, const float* __restrict__ qkv,
                                                    const float* __restrict__ lse2, const float* __restrict__ delta,
                                                    float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                    float scale) {
    tc_backward_dq<32>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void flash_attn_tc_fwd_d64(const float* __restrict__ qkv, float* __restrict__ out,
                                                 float* __restrict__ lse2, const float* __restrict__ dout,
                                                 float* __restrict__ delta, int seq_len, int n_heads, int hd,
                                                 float scale) {
    tc_forward<64>(qkv, out, lse2, dout, delta, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void flash_attn_tc_bwd_dkdv_d64(const float* __restrict__ dout, const float* __restrict__ qkv,
                                                      const float* __restrict__ lse2, const float* __restrict__ delta,
                                                      float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                      float scale) {
    tc_backward_dkdv<64>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void flash_attn_tc_bwd_dq_d64(const float* __restrict__ dout, const float* __restrict__ qkv,
                                                    const float* __restrict__ lse2, const float* __restrict__ delta,
                                                    float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                    float scale) {
    tc_backward_dq<64>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}
