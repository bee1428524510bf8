// Fused causal multi-head self-attention (plan ops `Attention`, `AttentionBackward`),
// FlashAttention-2 style: no T x T score matrix is ever materialised. fp32 SIMT arithmetic
// (fp32 inputs, fp32 accumulation, exp2 of pre-scaled scores).
//
// Layout: qkv [B*T, 3C] = [q | k | v], heads contiguous within each (head h = columns
// h*hd .. h*hd+hd-1 of its part); out / dout [B*T, C]; C = NH * hd. Head rows are read with a
// stride of 3C straight from the fused layout (no permute pass).
//
// Thread mapping (all kernels): a block owns 64 rows (queries, or keys for the dK/dV kernel) of
// one (batch, head) = blockIdx.y; each row is held by TPR = HDM / 32 adjacent threads, each
// thread keeping 32 of the (zero-padded) HDM head dimensions in registers as 8 float4 chunks,
// interleaved (thread `sub` owns chunks sub, sub+TPR, ...) so that the TPR threads of a row read
// contiguous shared memory. Dot products are reduced over the TPR threads with shuffles. The
// other operand streams through shared memory in tiles of 32 rows; causal masking skips the key
// tiles entirely above the block's last query (and query tiles entirely below its first key).
//
// Scores are kept in base 2: s2 = (q . k) * scale * log2(e), p = exp2(s2 - lse2), and the saved
// per-row log-sum-exp `lse2` (fp32 [B, NH, T]) is in the same base-2 units.
//
// Backward (AttentionBackward gets only dout and qkv): pass 1 reruns the forward kernel with
// `dout` given, which writes lse2 and delta_i = dout_i . o_i instead of out; pass 2 computes dK
// and dV per key block (loop over query tiles); pass 3 computes dQ per query block (loop over key
// tiles). Every element of dqkv is written exactly once (no atomics, deterministic).
// Kernel variants: _d32 (hd <= 32, TPR 1), _d64 (hd <= 64, TPR 2), _d128 (hd <= 128, TPR 4).

#define FA_ROWS 64
#define FA_TILE 32
#define FA_LOG2E 1.4426950408889634f
#define FA_NEG_INF __int_as_float(0xff800000)

template <int TPR>
__device__ __forceinline__ float fa_group_sum(float v) {
    if (TPR >= 2) v += __shfl_xor_sync(ASTERIA_FULL_MASK, v, 1);
    if (TPR >= 4) v += __shfl_xor_sync(ASTERIA_FULL_MASK, v, 2);
    return v;
}

__device__ __forceinline__ float fa_dot4(float4 a, float4 b, float acc) {
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
    acc = fmaf(a.z, b.z, acc);
    acc = fmaf(a.w, b.w, acc);
    return acc;
}

__device__ __forceinline__ void fa_axpy4(float4& y, float a, float4 x) {
    y.x = fmaf(a, x.x, y.x);
    y.y = fmaf(a, x.y, y.y);
    y.z = fmaf(a, x.z, y.z);
    y.w = fmaf(a, x.w, y.w);
}

__device__ __forceinline__ void fa_scale4(float4& y, float a) {
    y.x *= a;
    y.y *= a;
    y.z *= a;
    y.w *= a;
}

// Row `row` (< n_rows, else zeros) of a head slice `src` (row stride ld, hd valid columns) into
// this thread's 8 chunks, times `mul`.
template <int TPR>
__device__ __forceinline__ void fa_load_row(float4 (&r)[8], const float* __restrict__ src, long long ld, int row,
                                            int n_rows, int hd, int sub, float mul) {
#pragma unroll
    for (int m = 0; m < 8; ++m) {
        const int d0 = (m * TPR + sub) * 4;
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int d = d0 + e;
            v[e] = (row < n_rows && d < hd) ? src[(long long)row * ld + d] * mul : 0.0f;
        }
        r[m] = make_float4(v[0], v[1], v[2], v[3]);
    }
}

// Stores this thread's chunks of row `row` (if < n_rows) into dst (row stride ld, hd columns).
template <int TPR>
__device__ __forceinline__ void fa_store_row(const float4 (&r)[8], float* __restrict__ dst, long long ld, int row,
                                             int n_rows, int hd, int sub, float mul) {
    if (row >= n_rows) return;
#pragma unroll
    for (int m = 0; m < 8; ++m) {
        const int d0 = (m * TPR + sub) * 4;
        const float v[4] = {r[m].x, r[m].y, r[m].z, r[m].w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (d0 + e < hd) dst[(long long)row * ld + d0 + e] = v[e] * mul;
    }
}

// A tile of FA_TILE rows (from row0) of up to two head slices into shared memory [FA_TILE][HDM],
// zero-padded past n_rows and hd.
template <int HDM>
__device__ __forceinline__ void fa_load_tile(float* __restrict__ sa, const float* __restrict__ a, float* __restrict__ sb,
                                             const float* __restrict__ b, long long ld, int row0, int n_rows, int hd) {
    for (int e = threadIdx.x; e < FA_TILE * HDM; e += blockDim.x) {
        const int j = e / HDM, d = e % HDM, row = row0 + j;
        const bool ok = row < n_rows && d < hd;
        sa[e] = ok ? a[(long long)row * ld + d] : 0.0f;
        sb[e] = ok ? b[(long long)row * ld + d] : 0.0f;
    }
}

// Forward (and backward pass 1). grid (ceil(T/64), B*NH), block 64*TPR.
// out (may be null) [B*T, C]; lse2 [B*NH*T]; with dout non-null: delta[B*NH*T] = dout . o
// and out is not written.
template <int TPR>
__device__ __forceinline__ void fa_forward(const float* __restrict__ qkv, float* __restrict__ out,
                                           float* __restrict__ lse2, const float* __restrict__ dout,
                                           float* __restrict__ delta, int seq_len, int n_heads, int hd, float scale) {
    constexpr int HDM = 32 * TPR;
    __shared__ __align__(16) float ks[FA_TILE * HDM];
    __shared__ __align__(16) float vs[FA_TILE * HDM];
    const float4* ks4 = reinterpret_cast<const float4*>(ks);
    const float4* vs4 = reinterpret_cast<const float4*>(vs);
    const int bh = blockIdx.y, b = bh / n_heads, h = bh % n_heads;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * FA_ROWS;  // longest rows first
    const int sub = threadIdx.x % TPR, i = q0 + threadIdx.x / TPR;
    const int c = n_heads * hd;
    const long long ld = 3LL * c;
    const float* base = qkv + (long long)b * seq_len * ld + (long long)h * hd;
    float4 q[8], o[8];
    fa_load_row<TPR>(q, base, ld, i, seq_len, hd, sub, scale * FA_LOG2E);
#pragma unroll
    for (int m = 0; m < 8; ++m) o[m] = make_float4(0.f, 0.f, 0.f, 0.f);
    float mrow = FA_NEG_INF, l = 0.0f;
    const int kend = min(seq_len, q0 + FA_ROWS);
    for (int k0 = 0; k0 < kend; k0 += FA_TILE) {
        __syncthreads();
        fa_load_tile<HDM>(ks, base + c, vs, base + 2 * c, ld, k0, seq_len, hd);
        __syncthreads();
        float s[FA_TILE];
        float mt = mrow;
#pragma unroll
        for (int j = 0; j < FA_TILE; ++j) {
            float acc = 0.0f;
#pragma unroll
            for (int m = 0; m < 8; ++m) acc = fa_dot4(q[m], ks4[j * (HDM / 4) + m * TPR + sub], acc);
            acc = fa_group_sum<TPR>(acc);
            s[j] = (k0 + j <= i) ? acc : FA_NEG_INF;
            mt = fmaxf(mt, s[j]);
        }
        // Key k0 <= i for every real row once k0 = 0 has passed, so mt is finite for them; rows
        // past the diagonal of this tile see only -inf and keep their state (corr = 1, p = 0).
        const float corr = (mt == FA_NEG_INF) ? 1.0f : exp2f(mrow - mt);
        l *= corr;
#pragma unroll
        for (int m = 0; m < 8; ++m) fa_scale4(o[m], corr);
#pragma unroll
        for (int j = 0; j < FA_TILE; ++j) {
            const float p = (s[j] == FA_NEG_INF) ? 0.0f : exp2f(s[j] - mt);
            l += p;
#pragma unroll
            for (int m = 0; m < 8; ++m) fa_axpy4(o[m], p, vs4[j * (HDM / 4) + m * TPR + sub]);
        }
        mrow = mt;
    }
    // Rows past T (padding of the last block) compute but store nothing; no early return, so
    // every lane of a warp reaches the shuffles below.
    const bool real = i < seq_len;
    const float inv = 1.0f / l;
    const long long hrow = (long long)bh * seq_len + i;
    if (real && sub == 0) lse2[hrow] = mrow + log2f(l);
    const long long orow = (long long)b * seq_len + i;
    if (dout != nullptr) {
        float4 g[8];
        fa_load_row<TPR>(g, dout + orow * c + (long long)h * hd, 0, 0, real ? 1 : 0, hd, sub, 1.0f);
        float acc = 0.0f;
#pragma unroll
        for (int m = 0; m < 8; ++m) acc = fa_dot4(g[m], o[m], acc);
        acc = fa_group_sum<TPR>(acc) * inv;
        if (real && sub == 0) delta[hrow] = acc;
    } else if (out != nullptr) {
        fa_store_row<TPR>(o, out + orow * c + (long long)h * hd, 0, 0, real ? 1 : 0, hd, sub, inv);
    }
}

// Backward pass 2: dK, dV of 64 keys per block, looping over query tiles from the block's first
// key. grid (ceil(T/64), B*NH), block 64*TPR. Writes the k and v parts of dqkv.
template <int TPR>
__device__ __forceinline__ void fa_backward_dkdv(const float* __restrict__ dout, const float* __restrict__ qkv,
                                                 const float* __restrict__ lse2, const float* __restrict__ delta,
                                                 float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                 float scale) {
    constexpr int HDM = 32 * TPR;
    __shared__ __align__(16) float qs[FA_TILE * HDM];
    __shared__ __align__(16) float gs[FA_TILE * HDM];
    __shared__ float ls[FA_TILE], ds[FA_TILE];
    const float4* qs4 = reinterpret_cast<const float4*>(qs);
    const float4* gs4 = reinterpret_cast<const float4*>(gs);
    const int bh = blockIdx.y, b = bh / n_heads, h = bh % n_heads;
    const int j0 = blockIdx.x * FA_ROWS;  // first blocks have the most queries: launched first
    const int sub = threadIdx.x % TPR, j = j0 + threadIdx.x / TPR;
    const int c = n_heads * hd;
    const long long ld = 3LL * c;
    const float* base = qkv + (long long)b * seq_len * ld + (long long)h * hd;
    const float* gbase = dout + (long long)b * seq_len * c + (long long)h * hd;
    const float* lrow = lse2 + (long long)bh * seq_len;
    const float* drow = delta + (long long)bh * seq_len;
    const float sl = scale * FA_LOG2E;
    float4 k[8], v[8], dk[8], dv[8];
    fa_load_row<TPR>(k, base + c, ld, j, seq_len, hd, sub, sl);
    fa_load_row<TPR>(v, base + 2 * c, ld, j, seq_len, hd, sub, 1.0f);
#pragma unroll
    for (int m = 0; m < 8; ++m) {
        dk[m] = make_float4(0.f, 0.f, 0.f, 0.f);
        dv[m] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    for (int i0 = j0; i0 < seq_len; i0 += FA_TILE) {
        __syncthreads();
        for (int e = threadIdx.x; e < FA_TILE * HDM; e += blockDim.x) {
            const int r = e / HDM, d = e % HDM, row = i0 + r;
            const bool ok = row < seq_len && d < hd;
            qs[e] = ok ? base[(long long)row * ld + d] : 0.0f;
            gs[e] = ok ? gbase[(long long)row * c + d] : 0.0f;
        }
        if (threadIdx.x < FA_TILE) {
            const int row = i0 + threadIdx.x;
            ls[threadIdx.x] = row < seq_len ? lrow[row] : 0.0f;
            ds[threadIdx.x] = row < seq_len ? drow[row] : 0.0f;
        }
        __syncthreads();
#pragma unroll 2
        for (int r = 0; r < FA_TILE; ++r) {
            const int i = i0 + r;
            float s = 0.0f, dp = 0.0f;
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                s = fa_dot4(k[m], qs4[r * (HDM / 4) + m * TPR + sub], s);
                dp = fa_dot4(v[m], gs4[r * (HDM / 4) + m * TPR + sub], dp);
            }
            s = fa_group_sum<TPR>(s);
            dp = fa_group_sum<TPR>(dp);
            const float p = (j <= i && i < seq_len) ? exp2f(s - ls[r]) : 0.0f;
            const float dsc = p * (dp - ds[r]);
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                fa_axpy4(dv[m], p, gs4[r * (HDM / 4) + m * TPR + sub]);
                fa_axpy4(dk[m], dsc, qs4[r * (HDM / 4) + m * TPR + sub]);
            }
        }
    }
    float* drow_k = dqkv + (long long)b * seq_len * ld + c + (long long)h * hd;
    fa_store_row<TPR>(dk, drow_k, ld, j, seq_len, hd, sub, scale);
    fa_store_row<TPR>(dv, drow_k + c, ld, j, seq_len, hd, sub, 1.0f);
}

// Backward pass 3: dQ of 64 queries per block, looping over key tiles up to the diagonal.
// grid (ceil(T/64), B*NH), block 64*TPR. Writes the q part of dqkv.
template <int TPR>
__device__ __forceinline__ void fa_backward_dq(const float* __restrict__ dout, const float* __restrict__ qkv,
                                               const float* __restrict__ lse2, const float* __restrict__ delta,
                                               float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                               float scale) {
    constexpr int HDM = 32 * TPR;
    __shared__ __align__(16) float ks[FA_TILE * HDM];
    __shared__ __align__(16) float vs[FA_TILE * HDM];
    const float4* ks4 = reinterpret_cast<const float4*>(ks);
    const float4* vs4 = reinterpret_cast<const float4*>(vs);
    const int bh = blockIdx.y, b = bh / n_heads, h = bh % n_heads;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * FA_ROWS;
    const int sub = threadIdx.x % TPR, i = q0 + threadIdx.x / TPR;
    const int c = n_heads * hd;
    const long long ld = 3LL * c;
    const float* base = qkv + (long long)b * seq_len * ld + (long long)h * hd;
    const float* gbase = dout + (long long)b * seq_len * c + (long long)h * hd;
    const float sl = scale * FA_LOG2E;
    float4 q[8], g[8], dq[8];
    fa_load_row<TPR>(q, base, ld, i, seq_len, hd, sub, sl);
    fa_load_row<TPR>(g, gbase, c, i, seq_len, hd, sub, 1.0f);
#pragma unroll
    for (int m = 0; m < 8; ++m) dq[m] = make_float4(0.f, 0.f, 0.f, 0.f);
    const long long hrow = (long long)bh * seq_len + i;
    const float lse = i < seq_len ? lse2[hrow] : 0.0f;
    const float dlt = i < seq_len ? delta[hrow] : 0.0f;
    const int kend = min(seq_len, q0 + FA_ROWS);
    for (int k0 = 0; k0 < kend; k0 += FA_TILE) {
        __syncthreads();
        fa_load_tile<HDM>(ks, base + c, vs, base + 2 * c, ld, k0, seq_len, hd);
        __syncthreads();
#pragma unroll 2
        for (int jj = 0; jj < FA_TILE; ++jj) {
            float s = 0.0f, dp = 0.0f;
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                s = fa_dot4(q[m], ks4[jj * (HDM / 4) + m * TPR + sub], s);
                dp = fa_dot4(g[m], vs4[jj * (HDM / 4) + m * TPR + sub], dp);
            }
            s = fa_group_sum<TPR>(s);
            dp = fa_group_sum<TPR>(dp);
            const float p = (k0 + jj <= i && i < seq_len) ? exp2f(s - lse) : 0.0f;
            const float dsc = p * (dp - dlt);
#pragma unroll
            for (int m = 0; m < 8; ++m) fa_axpy4(dq[m], dsc, ks4[jj * (HDM / 4) + m * TPR + sub]);
        }
    }
    fa_store_row<TPR>(dq, dqkv + (long long)b * seq_len * ld + (long long)h * hd, ld, i, seq_len, hd, sub, scale);
}

extern "C" __global__ void flash_attn_fwd_d32(const float* __restrict__ qkv, float* __restrict__ out,
                                              float* __restrict__ lse2, const float* __restrict__ dout,
                                              float* __restrict__ delta, int seq_len, int n_heads, int hd,
                                              float scale) {
    fa_forward<1>(qkv, out, lse2, dout, delta, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void flash_attn_fwd_d64(const float* __restrict__ qkv, float* __restrict__ out,
                                              float* __restrict__ lse2, const float* __restrict__ dout,
                                              float* __restrict__ delta, int seq_len, int n_heads, int hd,
                                              float scale) {
    fa_forward<2>(qkv, out, lse2, dout, delta, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void flash_attn_fwd_d128(const float* __restrict__ qkv, float* __restrict__ out,
                                               float* __restrict__ lse2, const float* __restrict__ dout,
                                               float* __restrict__ delta, int seq_len, int n_heads, int hd,
                                               float scale) {
    fa_forward<4>(qkv, out, lse2, dout, delta, seq_len, n_heads, hd, scale);
}

extern "C" __global__ void flash_attn_bwd_dkdv_d32(const float* __restrict__ dout, const float* __restrict__ qkv,
                                                   const float* __restrict__ lse2, const float* __restrict__ delta,
                                                   float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                   float scale) {
    fa_backward_dkdv<1>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void flash_attn_bwd_dkdv_d64(const float* __restrict__ dout, const float* __restrict__ qkv,
                                                   const float* __restrict__ lse2, const float* __restrict__ delta,
                                                   float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                   float scale) {
    fa_backward_dkdv<2>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void flash_attn_bwd_dkdv_d128(const float* __restrict__ dout, const float* __restrict__ qkv,
                                                    const float* __restrict__ lse2, const float* __restrict__ delta,
                                                    float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                    float scale) {
    fa_backward_dkdv<4>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}

extern "C" __global__ void flash_attn_bwd_dq_d32(const float* __restrict__ dout, const float* __restrict__ qkv,
                                                 const float* __restrict__ lse2, const float* __restrict__ delta,
                                                 float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                 float scale) {
    fa_backward_dq<1>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void flash_attn_bwd_dq_d64(const float* __restrict__ dout, const float* __restrict__ qkv,
                                                 const float* __restrict__ lse2, const float* __restrict__ delta,
                                                 float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                 float scale) {
    fa_backward_dq<2>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void flash_attn_bwd_dq_d128(const float* __restrict__ dout, const float* __restrict__ qkv,
                                                  const float* __restrict__ lse2, const float* __restrict__ delta,
                                                  float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                  float scale) {
    fa_backward_dq<4>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}
