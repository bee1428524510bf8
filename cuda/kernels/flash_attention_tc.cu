// Fused causal multi-head self-attention on bf16 tensor cores (plan ops `Attention`,
// `AttentionBackward` under `precision = bf16`), FlashAttention-2 (Dao, 2023) with the MMA
// register layout of its CUTLASS kernels: Q, K, V, dO, P and dS enter `mma.sync m16n8k16` as
// bf16, every accumulation (scores, O, dQ, dK, dV, row sums) is fp32, and the softmax runs in
// fp32 registers on the score accumulators (base 2: s2 = (q . k) * scale * log2(e)). The
// backward runs in three passes (row statistics, dK/dV per key block, dQ per query block).
//
// Inputs are bf16 copies made by the launcher (one cast kernel per call): qkv [B*T, 3C] =
// [q | k | v] (head h = columns h*hd .. h*hd+hd-1 of its part) and, for the backward, dout
// [B*T, C]. Outputs fp32: out [B*T, C], dqkv [B*T, 3C]; lse2 and delta fp32 [B, NH, T].
// Forward: a block owns 128 query rows of one (batch, head) = blockIdx.y, 8 warps of 16 rows;
// K and V stream through shared memory in tiles of 64 keys up to the causal diagonal,
// double-buffered: cp.async fetches the next tile while the warps compute on the current one.
// Backward pass 1 gives lse2 and delta = rowsum(dout . o): from what the forward kept (its lse2
// and bf16 qkv, and a bf16 copy of o; kernel flash_attn_tc_delta) when the engine has them,
// else by rerunning the forward with dout. Pass 2 computes dK, dV for 128 keys per block
// (8 warps x 16 keys, looping over query tiles from the diagonal); pass 3 computes dQ for 128
// queries per block. Every element of dqkv is written exactly once (no atomics,
// deterministic).
//
// m16n8k16 fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16"), g = lane / 4, t = lane % 4:
//   A 16x16 row-major: a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B 16x8 (k x n):     b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C 16x8 fp32:        c0,c1 = (g, 2t), (g, 2t+1); c2,c3 = (g+8, 2t), (g+8, 2t+1)
// so the score accumulators of two adjacent 8-key tiles are, packed to bf16, the A fragment of
// the next MMA over those 16 keys (P V, dS K, P^T dO, dS^T Q) without a trip through shared
// memory. Every tile sits in shared memory row-major ([row][d], row stride HD + 8 bf16, which
// puts the 8 rows of a fragment load in distinct banks). B operands whose reduction index is
// d (Q K^T, dO V^T, K Q^T, V dO^T) are read as 32-bit pairs along d; those whose reduction
// index is the tile row (P V, dS K, P^T dO, dS^T Q) come from `ldmatrix.trans`, which hands each
// lane the (k = 2t..2t+1, n = g) pairs of the transposed 8x8 blocks.
//
// Head dims up to 128 (variants _d32, _d64, _d128; a head is padded with zeros up to its
// variant's width); wider heads take the GEMM path.
// d32/d64: the forward and dQ kernels are capped at 128 registers (__launch_bounds__(256, 2)) so
// that two blocks share an SM (a few bytes of spills; on the H200 GPT-2's attention forward
// 0.37 -> 0.31 ms and backward 1.21 -> 1.06 ms per layer); dK/dV needs ~220 registers and keeps
// one block. Their tiles live in static shared memory (at most 37 KB).
// d128: the forward and dQ kernels keep their A fragments (Q; Q and dO) in registers as the
// narrower variants do. The dK/dV kernel keeps the block's K and V rows, its MMA A operands, in
// shared memory and re-reads them per tile (tc_mma_rows_s) instead of holding them as
// fragments in registers: K, V, dK, dV and the two score tiles alone would be 256 registers.
// Same MMAs summed in the same order, so the numerics are those of the register path. All d128
// kernels run one block of 256 threads per SM (__launch_bounds__(256, 1), up to 255 registers;
// NVRTC 13.5 for sm_90: forward 210, dQ 226, dK/dV 249, no spills; NVRTC 12.9: dQ 237, dK/dV
// 255 with 12 bytes of spills). Capped at 128 registers for two blocks per SM
// (__launch_bounds__(256, 2)) the forward spills 280 bytes and dQ 720 (the forward with Q in
// shared memory instead, 56 with NVRTC 12.9).
// Shared memory is dynamic (extern tc_dyn_smem: the static limit is 48 KB; the launcher passes
// the byte count and raises the function's dynamic limit), row stride 136 bf16 = 272 bytes:
//   forward (both outputs): 2 stages x (64 K + 64 V rows) = 256 x 272 B = 69632 B
//                           (holding the block's 128 Q rows first)
//   dQ:    the same 69632 B (the 128 Q rows and 128 dO rows first)
//   dK/dV: 128 K + 128 V rows, then 2 stages x (64 Q + 64 dO rows) = 512 x 272 B = 139264 B
//          (+ 1 KB static: the staged lse2 / delta values)
// so d128 needs a device whose opt-in shared memory per block holds 137 KB (sm_80: 163 KB,
// sm_90: 227 KB; not sm_86 / sm_89: 99 KB). Every region starts at a multiple of 272 bytes, so
// the 16-byte alignment of cp.async and ldmatrix holds as in the static arrays.
// The shared helpers (bf16 packing, cp.async, row reductions, stores) are flash_common.cuh.

#define TC_WARPS 8
#define TC_ROWS (16 * TC_WARPS)  // rows (queries, or keys for dK/dV) per block
#define TC_TILE 64               // keys (or queries) per shared-memory tile

// The d128 kernels' tile space (bytes passed at launch; see the header).
extern __shared__ __align__(16) unsigned char tc_dyn_smem[];

// Whether a variant's tiles live in dynamic shared memory (tc_dyn_smem) instead of a static
// array (whose 48 KB limit the d128 tiles exceed): the d128 kernels.
template <int HD>
__host__ __device__ constexpr bool tc_dyn() {
    return HD > 64;
}

// Whether the dK/dV kernel keeps the block's K and V rows (its MMA A operands) in shared memory
// and re-reads them per tile (tc_mma_rows_s) instead of holding them in registers: d128.
template <int HD>
__host__ __device__ constexpr bool tc_a_smem() {
    return HD > 64;
}

// Two consecutive bf16 of shared memory (even element index) as one 32-bit fragment register.
__device__ __forceinline__ unsigned tc_ld(const bf16* s, int idx) {
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

// Four transposed 8x8 bf16 blocks; lane l gives the address of row l % 8 of block l / 8 (16-byte
// aligned), and receives in r[j] the pair (rows 2t, 2t+1; column g) of block j.
__device__ __forceinline__ void tc_ldmatrix_t(unsigned (&r)[4], const bf16* p) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// A fragment (16 rows from r0, k columns k0..k0+15) of a row-major bf16 tile with row stride lds.
__device__ __forceinline__ void tc_frag_a(unsigned (&a)[4], const bf16* s, int lds, int r0, int k0, int g, int t) {
    a[0] = tc_ld(s, (r0 + g) * lds + k0 + 2 * t);
    a[1] = tc_ld(s, (r0 + g + 8) * lds + k0 + 2 * t);
    a[2] = tc_ld(s, (r0 + g) * lds + k0 + 2 * t + 8);
    a[3] = tc_ld(s, (r0 + g + 8) * lds + k0 + 2 * t + 8);
}

// Four 8x8 bf16 blocks, not transposed; lane l gives the address of row l % 8 of block l / 8
// (16-byte aligned), and receives in r[j] the pair (row g, columns 2t..2t+1) of block j.
__device__ __forceinline__ void tc_ldmatrix(unsigned (&r)[4], const bf16* p) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// The B fragments of two consecutive k-steps kk, kk+1 of n-tile j from a tile whose rows are
// the n index and d the reduction index (B[k][n] = s[(j * 8 + n) * lds + k]): one ldmatrix.x4
// over the blocks at columns 16kk, 16kk+8, 16kk+16, 16kk+24 of rows 8j..8j+7 gives b0, b1 of
// step kk in r[0], r[1] and of step kk+1 in r[2], r[3] -- the registers four 32-bit shared loads
// gave before (b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g)), in one instruction.
__device__ __forceinline__ void tc_frag_b2(unsigned (&r)[4], const bf16* s, int lds, int j, int kk, int lane) {
    tc_ldmatrix(r, s + (j * 8 + (lane & 7)) * lds + kk * 16 + (lane >> 3) * 8);
}

// acc[j] += A (16 x 16*KS, fragments a[ks]) times B with B[k][n] = s[(j * 8 + n) * lds + k]
// (the tile's rows are the n index, d the reduction index): NT n-tiles of 8. KS is even (head
// dims 32, 64, 128); every acc[j] sums its MMAs in the order kk = 0 .. KS-1.
template <int KS, int NT>
__device__ __forceinline__ void tc_mma_rows(float (&acc)[NT][4], const unsigned (&a)[KS][4], const bf16* s, int lds,
                                            int g, int t) {
    static_assert(KS % 2 == 0, "tc_frag_b2 loads two k-steps");
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int kk = 0; kk < KS; kk += 2) {
            unsigned b[4];
            tc_frag_b2(b, s, lds, j, kk, lane);
            tc_mma(acc[j], a[kk], b[0], b[1]);
            tc_mma(acc[j], a[kk + 1], b[2], b[3]);
        }
}

// As tc_mma_rows, with A read from shared memory instead of registers: rows r0 .. r0+15,
// columns 0 .. 16*KS-1 of the row-major tile sa (row stride lds). Every acc[j] sums its MMAs
// in the same order (kk = 0 .. KS-1) as tc_mma_rows.
template <int KS, int NT>
__device__ __forceinline__ void tc_mma_rows_s(float (&acc)[NT][4], const bf16* sa, int r0, const bf16* s, int lds,
                                              int g, int t) {
    // (B stays on 32-bit shared loads here: this path is for the register-tight d128 dK/dV
    // kernel, where tc_frag_b2's two A fragments would add registers.)
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        unsigned a[4];
        tc_frag_a(a, sa, lds, r0, kk * 16, g, t);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int base = (j * 8 + g) * lds + kk * 16 + 2 * t;
            tc_mma(acc[j], a, tc_ld(s, base), tc_ld(s, base + 8));
        }
    }
}

// acc[n] += P (16 x TC_TILE, held as score accumulators p[TC_TILE / 8][4]) times B with
// B[k][n] = s[k * lds + n] (the tile's rows are the reduction index): P V, dS K, P^T dO, dS^T Q.
template <int ND>
__device__ __forceinline__ void tc_mma_p(float (&acc)[ND][4], const float (&p)[TC_TILE / 8][4], const bf16* s, int lds,
                                         int lane) {
    const int blk = lane >> 3, r = lane & 7;
#pragma unroll
    for (int kk = 0; kk < TC_TILE / 16; ++kk) {
        const unsigned a[4] = {tc_pack(p[2 * kk][0], p[2 * kk][1]), tc_pack(p[2 * kk][2], p[2 * kk][3]),
                               tc_pack(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                               tc_pack(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
        for (int np = 0; np < ND / 2; ++np) {
            // Blocks: (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15).
            unsigned b[4];
            tc_ldmatrix_t(b, s + (kk * 16 + (blk & 1) * 8 + r) * lds + np * 16 + (blk >> 1) * 8);
            tc_mma(acc[2 * np], a, b[0], b[1]);
            tc_mma(acc[2 * np + 1], a, b[2], b[3]);
        }
    }
}

// Rows row0 .. row0+nrows-1 (zeros past n_valid) of a bf16 head slice `src` (row stride ld, hd
// valid columns, zeros up to HD) into shared memory dst[r * (HD + 8) + d].
template <int HD>
__device__ __forceinline__ void tc_load(bf16* dst, const bf16* __restrict__ src, long long ld, int row0, int nrows,
                                        int n_valid, int hd, bool vec) {
    constexpr int LD = HD + 8;
    if (vec) {
        for (int e = threadIdx.x; e < nrows * (HD / 8); e += blockDim.x) {
            const int r = e / (HD / 8), d = 8 * (e % (HD / 8)), row = row0 + r;
            uint4 x = make_uint4(0u, 0u, 0u, 0u);
            if (row < n_valid && d < hd) x = *reinterpret_cast<const uint4*>(src + (long long)row * ld + d);
            *reinterpret_cast<uint4*>(dst + r * LD + d) = x;
        }
    } else {
        const bf16 zero = __float2bfloat16_rn(0.0f);
        for (int e = threadIdx.x; e < nrows * HD; e += blockDim.x) {
            const int r = e / HD, d = e % HD, row = row0 + r;
            dst[r * LD + d] = (row < n_valid && d < hd) ? src[(long long)row * ld + d] : zero;
        }
    }
}

// As tc_load, but the 16-byte path is asynchronous (cp.async, one group committed by the
// caller), so that the next tile streams in while the block computes on the current one. The
// caller waits (tc_cp_wait) and __syncthreads before reading dst. The element path (odd head
// dims or unaligned rows) stays synchronous.
template <int HD>
__device__ __forceinline__ void tc_load_async(bf16* dst, const bf16* __restrict__ src, long long ld, int row0,
                                              int nrows, int n_valid, int hd, bool vec) {
    constexpr int LD = HD + 8;
    if (vec) {
        for (int e = threadIdx.x; e < nrows * (HD / 8); e += blockDim.x) {
            const int r = e / (HD / 8), d = 8 * (e % (HD / 8)), row = row0 + r;
            const bool ok = row < n_valid && d < hd;
            tc_cp16(dst + r * LD + d, ok ? src + (long long)row * ld + d : src, ok);
        }
    } else {
        tc_load<HD>(dst, src, ld, row0, nrows, n_valid, hd, false);
    }
}

// Forward (and backward pass 1). grid (ceil(T/128), B*NH), block 256.
// out (may be null) [B*T, C]; lse2 [B*NH*T]; with dout non-null: delta [B*NH*T] = dout . o and
// out is not written.
template <int HD, typename OutT = float>
__device__ __forceinline__ void tc_forward(const bf16* __restrict__ qkv, OutT* __restrict__ out,
                                           float* __restrict__ lse2, const bf16* __restrict__ dout,
                                           float* __restrict__ delta, int seq_len, int n_heads, int hd, float scale) {
    constexpr int LD = HD + 8, KS = HD / 16, ND = HD / 8, NT = TC_TILE / 8;
    // Two stages of (K tile, V tile), double-buffered; at the start the block's 128 Q rows.
    __shared__ __align__(16) bf16 sm_static[tc_dyn<HD>() ? 8 : 2 * 2 * TC_TILE * LD];
    bf16* const sm = tc_dyn<HD>() ? reinterpret_cast<bf16*>(tc_dyn_smem) : sm_static;
    static_assert(!tc_dyn<HD>() || 2 * 2 * TC_TILE * LD * 2 == 69632, "attention.rs's fwd_smem");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.y, b = bh / n_heads, h = bh % n_heads;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * TC_ROWS;  // longest rows first
    const int c = n_heads * hd;
    const long long ld = 3LL * c;
    const bf16* base = qkv + (long long)b * seq_len * ld + (long long)h * hd;
    const bool vec = tc_vec(base, ld, hd);
    const int w0 = q0 + warp * 16;                    // this warp's first query
    const int rows[2] = {w0 + g, w0 + g + 8};         // the two rows this lane holds
    const float sl = scale * TC_LOG2E;

    unsigned qa[KS][4];
    tc_load<HD>(sm, base, ld, q0, TC_ROWS, seq_len, hd, vec);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) tc_frag_a(qa[kk], sm, LD, warp * 16, kk * 16, g, t);

    float o[ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {TC_NEG_INF, TC_NEG_INF}, l[2] = {0.0f, 0.0f};
    const int kend = min(seq_len, q0 + TC_ROWS);
    const int ntiles = (kend + TC_TILE - 1) / TC_TILE;
    __syncthreads();  // the Q rows' space becomes the first stage
    tc_load_async<HD>(sm, base + c, ld, 0, TC_TILE, seq_len, hd, vec);
    tc_load_async<HD>(sm + TC_TILE * LD, base + 2 * c, ld, 0, TC_TILE, seq_len, hd, vec);
    tc_cp_commit();
    for (int it = 0; it < ntiles; ++it) {
        const int k0 = it * TC_TILE;
        const bf16* ks = sm + (it & 1) * 2 * TC_TILE * LD;
        const bf16* vs = ks + TC_TILE * LD;
        if (it + 1 < ntiles) {  // the other stage was released by the last iteration's barrier
            bf16* nx = sm + ((it + 1) & 1) * 2 * TC_TILE * LD;
            tc_load_async<HD>(nx, base + c, ld, k0 + TC_TILE, TC_TILE, seq_len, hd, vec);
            tc_load_async<HD>(nx + TC_TILE * LD, base + 2 * c, ld, k0 + TC_TILE, TC_TILE, seq_len, hd, vec);
            tc_cp_commit();
            tc_cp_wait<1>();
        } else {
            tc_cp_wait<0>();
        }
        __syncthreads();
        if (k0 <= w0 + 15) {  // else every key of this tile is above this warp's rows
        float s[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
        tc_mma_rows<KS, NT>(s, qa, ks, LD, g, t);
        float mx[2] = {m[0], m[1]};
        // Only a tile that crosses this warp's diagonal or the sequence's end needs the mask
        // (warp-uniform; the unmasked branch computes the same values where nothing is masked).
        if (k0 + TC_TILE - 1 <= w0 && k0 + TC_TILE <= seq_len) {
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    s[j][e] *= sl;
                    mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
                }
        } else {
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + j * 8 + 2 * t + (e & 1);
                    const float v = (key <= rows[e >> 1] && key < seq_len) ? s[j][e] * sl : TC_NEG_INF;
                    s[j][e] = v;
                    mx[e >> 1] = fmaxf(mx[e >> 1], v);
                }
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
        tc_mma_p<ND>(o, s, vs, LD, lane);
        }
        __syncthreads();  // this stage is refilled next iteration
    }
    tc_forward_finish<ND>(o, m, l, rows, w0, bh, b, h, seq_len, c, hd, g, t, lse2, dout, delta, out);
}

// Backward pass 2: dK, dV of 128 keys per block (16 per warp), looping over query tiles from the
// block's first key. grid (ceil(T/128), B*NH), block 256. Writes the k and v parts of dqkv.
template <int HD>
__device__ __forceinline__ void tc_backward_dkdv(const bf16* __restrict__ dout, const bf16* __restrict__ qkv,
                                                 const float* __restrict__ lse2, const float* __restrict__ delta,
                                                 float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                 float scale) {
    constexpr int LD = HD + 8, KS = HD / 16, ND = HD / 8, NT = TC_TILE / 8;
    constexpr bool AS = tc_a_smem<HD>();
    // Q tile then dO tile; at the start the block's 128 K rows, then its 128 V rows.
    // (Two stages of (Q tile, dO tile), double-buffered, in the same space; with AS the K and V
    // rows keep their own space, before the stages.)
    constexpr int KVSP = AS ? 2 * TC_ROWS * LD : 0;
    __shared__ __align__(16) bf16 sm_static[tc_dyn<HD>() ? 8 : 2 * TC_ROWS * LD];
    bf16* const sm = tc_dyn<HD>() ? reinterpret_cast<bf16*>(tc_dyn_smem) : sm_static;
    bf16* const stg = sm + KVSP;
    static_assert(!tc_dyn<HD>() || (KVSP + 2 * TC_ROWS * LD) * 2 == 139264, "attention.rs's dkdv_smem");
    __shared__ float ls[2][TC_TILE], dls[2][TC_TILE];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.y, b = bh / n_heads, h = bh % n_heads;
    const int j0 = blockIdx.x * TC_ROWS;  // first blocks have the most queries: launched first
    const int c = n_heads * hd;
    const long long ld = 3LL * c;
    const bf16* base = qkv + (long long)b * seq_len * ld + (long long)h * hd;
    const bf16* gbase = dout + (long long)b * seq_len * c + (long long)h * hd;
    const bool vec = tc_vec(base, ld, hd) && tc_vec(gbase, c, hd);
    const float* lrow = lse2 + (long long)bh * seq_len;
    const float* drow = delta + (long long)bh * seq_len;
    const int w0 = j0 + warp * 16;
    const int keys[2] = {w0 + g, w0 + g + 8};
    const float sl = scale * TC_LOG2E;

    unsigned ka[AS ? 1 : KS][4], va[AS ? 1 : KS][4];
    tc_load<HD>(sm, base + c, ld, j0, TC_ROWS, seq_len, hd, vec);
    tc_load<HD>(sm + TC_ROWS * LD, base + 2 * c, ld, j0, TC_ROWS, seq_len, hd, vec);
    __syncthreads();
    if constexpr (!AS) {
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            tc_frag_a(ka[kk], sm, LD, warp * 16, kk * 16, g, t);
            tc_frag_a(va[kk], sm + TC_ROWS * LD, LD, warp * 16, kk * 16, g, t);
        }
    }
    float dk[ND][4], dv[ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;

    static_assert(2 * 2 * TC_TILE <= 2 * TC_ROWS, "two stages fit in the K/V rows' space");
    auto issue = [&](int i0, int st) {
        bf16* qs = stg + st * 2 * TC_TILE * LD;
        tc_load_async<HD>(qs, base, ld, i0, TC_TILE, seq_len, hd, vec);
        tc_load_async<HD>(qs + TC_TILE * LD, gbase, c, i0, TC_TILE, seq_len, hd, vec);
        tc_cp_commit();
        if (threadIdx.x < TC_TILE) {
            const int row = i0 + threadIdx.x;
            ls[st][threadIdx.x] = row < seq_len ? lrow[row] : 0.0f;
            dls[st][threadIdx.x] = row < seq_len ? drow[row] : 0.0f;
        }
    };
    const int ntiles = (seq_len - j0 + TC_TILE - 1) / TC_TILE;
    __syncthreads();  // the K/V rows' space becomes the stages
    issue(j0, 0);
    for (int it = 0; it < ntiles; ++it) {
        const int i0 = j0 + it * TC_TILE, stage = it & 1;
        if (it + 1 < ntiles) {
            issue(i0 + TC_TILE, stage ^ 1);
            tc_cp_wait<1>();
        } else {
            tc_cp_wait<0>();
        }
        __syncthreads();
        const bf16* qs = stg + stage * 2 * TC_TILE * LD;
        const bf16* gs = qs + TC_TILE * LD;
        if (i0 + TC_TILE - 1 >= w0) {  // else every query of this tile is before this warp's keys
        // S^T = K Q^T and dP^T = V dO^T: 16 keys x 64 queries.
        float st[NT][4], dpt[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.0f;
        if constexpr (AS) {
            tc_mma_rows_s<KS, NT>(st, sm, warp * 16, qs, LD, g, t);
            tc_mma_rows_s<KS, NT>(dpt, sm + TC_ROWS * LD, warp * 16, gs, LD, g, t);
        } else {
            tc_mma_rows<KS, NT>(st, ka, qs, LD, g, t);
            tc_mma_rows<KS, NT>(dpt, va, gs, LD, g, t);
        }
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int qi = j * 8 + 2 * t + (e & 1), q = i0 + qi;
                const float p = (keys[e >> 1] <= q && q < seq_len) ? exp2f(st[j][e] * sl - ls[it & 1][qi]) : 0.0f;
                st[j][e] = p;                                  // P^T
                dpt[j][e] = p * (dpt[j][e] - dls[it & 1][qi]);  // dS^T
            }
        tc_mma_p<ND>(dv, st, gs, LD, lane);   // dV += P^T dO
        tc_mma_p<ND>(dk, dpt, qs, LD, lane);  // dK += dS^T Q
        }
        __syncthreads();  // this stage is refilled next iteration
    }
    float* dk_base = dqkv + (long long)b * seq_len * ld + c + (long long)h * hd;
    tc_store<ND>(dk, dk_base, ld, w0, seq_len, hd, g, t, scale);
    tc_store<ND>(dv, dk_base + c, ld, w0, seq_len, hd, g, t, 1.0f);
}

// Backward pass 3: dQ of 128 queries per block (16 per warp), looping over key tiles up to the
// diagonal. grid (ceil(T/128), B*NH), block 256. Writes the q part of dqkv.
template <int HD>
__device__ __forceinline__ void tc_backward_dq(const bf16* __restrict__ dout, const bf16* __restrict__ qkv,
                                               const float* __restrict__ lse2, const float* __restrict__ delta,
                                               float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                               float scale) {
    constexpr int LD = HD + 8, KS = HD / 16, ND = HD / 8, NT = TC_TILE / 8;
    // Two stages of (K tile, V tile), double-buffered; at the start the block's 128 Q rows,
    // then its 128 dO rows.
    __shared__ __align__(16) bf16 sm_static[tc_dyn<HD>() ? 8 : 2 * TC_ROWS * LD];
    bf16* const sm = tc_dyn<HD>() ? reinterpret_cast<bf16*>(tc_dyn_smem) : sm_static;
    static_assert(!tc_dyn<HD>() || 2 * TC_ROWS * LD * 2 == 69632, "attention.rs's dq_smem");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.y, b = bh / n_heads, h = bh % n_heads;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * TC_ROWS;
    const int c = n_heads * hd;
    const long long ld = 3LL * c;
    const bf16* base = qkv + (long long)b * seq_len * ld + (long long)h * hd;
    const bf16* gbase = dout + (long long)b * seq_len * c + (long long)h * hd;
    const bool vec = tc_vec(base, ld, hd) && tc_vec(gbase, c, hd);
    const int w0 = q0 + warp * 16;
    const int rows[2] = {w0 + g, w0 + g + 8};
    const float sl = scale * TC_LOG2E;

    unsigned qa[KS][4], ga[KS][4];
    tc_load<HD>(sm, base, ld, q0, TC_ROWS, seq_len, hd, vec);
    tc_load<HD>(sm + TC_ROWS * LD, gbase, c, q0, TC_ROWS, seq_len, hd, vec);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        tc_frag_a(qa[kk], sm, LD, warp * 16, kk * 16, g, t);
        tc_frag_a(ga[kk], sm + TC_ROWS * LD, LD, warp * 16, kk * 16, g, t);
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
    const int ntiles = (kend + TC_TILE - 1) / TC_TILE;
    __syncthreads();  // the Q/dO rows' space becomes the stages
    tc_load_async<HD>(sm, base + c, ld, 0, TC_TILE, seq_len, hd, vec);
    tc_load_async<HD>(sm + TC_TILE * LD, base + 2 * c, ld, 0, TC_TILE, seq_len, hd, vec);
    tc_cp_commit();
    for (int it = 0; it < ntiles; ++it) {
        const int k0 = it * TC_TILE;
        const bf16* ks = sm + (it & 1) * 2 * TC_TILE * LD;
        const bf16* vs = ks + TC_TILE * LD;
        if (it + 1 < ntiles) {
            bf16* nx = sm + ((it + 1) & 1) * 2 * TC_TILE * LD;
            tc_load_async<HD>(nx, base + c, ld, k0 + TC_TILE, TC_TILE, seq_len, hd, vec);
            tc_load_async<HD>(nx + TC_TILE * LD, base + 2 * c, ld, k0 + TC_TILE, TC_TILE, seq_len, hd, vec);
            tc_cp_commit();
            tc_cp_wait<1>();
        } else {
            tc_cp_wait<0>();
        }
        __syncthreads();
        if (k0 <= w0 + 15) {  // else every key of this tile is above this warp's rows
        float s[NT][4], dp[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.0f;
        tc_mma_rows<KS, NT>(s, qa, ks, LD, g, t);   // S = Q K^T
        tc_mma_rows<KS, NT>(dp, ga, vs, LD, g, t);  // dP = dO V^T
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + j * 8 + 2 * t + (e & 1), i = e >> 1;
                const float p = (key <= rows[i] && rows[i] < seq_len) ? exp2f(s[j][e] * sl - lse[i]) : 0.0f;
                dp[j][e] = p * (dp[j][e] - dlt[i]);  // dS
            }
        tc_mma_p<ND>(dq, dp, ks, LD, lane);  // dQ += dS K
        }
        __syncthreads();  // this stage is refilled next iteration
    }
    tc_store<ND>(dq, dqkv + (long long)b * seq_len * ld + (long long)h * hd, ld, w0, seq_len, hd, g, t, scale);
}

extern "C" __global__ void __launch_bounds__(256, 2) flash_attn_tc_fwd_d32(const bf16* __restrict__ qkv, float* __restrict__ out,
                                                 float* __restrict__ lse2, const bf16* __restrict__ dout,
                                                 float* __restrict__ delta, int seq_len, int n_heads, int hd,
                                                 float scale) {
    tc_forward<32>(qkv, out, lse2, dout, delta, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void flash_attn_tc_bwd_dkdv_d32(const bf16* __restrict__ dout, const bf16* __restrict__ qkv,
                                                      const float* __restrict__ lse2, const float* __restrict__ delta,
                                                      float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                      float scale) {
    tc_backward_dkdv<32>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void __launch_bounds__(256, 2) flash_attn_tc_bwd_dq_d32(const bf16* __restrict__ dout, const bf16* __restrict__ qkv,
                                                    const float* __restrict__ lse2, const float* __restrict__ delta,
                                                    float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                    float scale) {
    tc_backward_dq<32>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void __launch_bounds__(256, 2) flash_attn_tc_fwd_d64(const bf16* __restrict__ qkv, float* __restrict__ out,
                                                 float* __restrict__ lse2, const bf16* __restrict__ dout,
                                                 float* __restrict__ delta, int seq_len, int n_heads, int hd,
                                                 float scale) {
    tc_forward<64>(qkv, out, lse2, dout, delta, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void flash_attn_tc_bwd_dkdv_d64(const bf16* __restrict__ dout, const bf16* __restrict__ qkv,
                                                      const float* __restrict__ lse2, const float* __restrict__ delta,
                                                      float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                      float scale) {
    tc_backward_dkdv<64>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void __launch_bounds__(256, 2) flash_attn_tc_bwd_dq_d64(const bf16* __restrict__ dout, const bf16* __restrict__ qkv,
                                                    const float* __restrict__ lse2, const float* __restrict__ delta,
                                                    float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                    float scale) {
    tc_backward_dq<64>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}
// The forward with a bf16 output (round to nearest even), for an output only bf16 GEMMs read.
extern "C" __global__ void __launch_bounds__(256, 2)
    flash_attn_tc_fwd_bf16out_d32(const bf16* __restrict__ qkv, bf16* __restrict__ out, float* __restrict__ lse2,
                                  const bf16* __restrict__ dout, float* __restrict__ delta, int seq_len,
                                  int n_heads, int hd, float scale) {
    tc_forward<32>(qkv, out, lse2, dout, delta, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void __launch_bounds__(256, 2)
    flash_attn_tc_fwd_bf16out_d64(const bf16* __restrict__ qkv, bf16* __restrict__ out, float* __restrict__ lse2,
                                  const bf16* __restrict__ dout, float* __restrict__ delta, int seq_len,
                                  int n_heads, int hd, float scale) {
    tc_forward<64>(qkv, out, lse2, dout, delta, seq_len, n_heads, hd, scale);
}
// d128: one block per SM, up to 255 registers (see the header).
extern "C" __global__ void __launch_bounds__(256, 1) flash_attn_tc_fwd_d128(const bf16* __restrict__ qkv, float* __restrict__ out,
                                                 float* __restrict__ lse2, const bf16* __restrict__ dout,
                                                 float* __restrict__ delta, int seq_len, int n_heads, int hd,
                                                 float scale) {
    tc_forward<128>(qkv, out, lse2, dout, delta, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void __launch_bounds__(256, 1) flash_attn_tc_bwd_dkdv_d128(const bf16* __restrict__ dout, const bf16* __restrict__ qkv,
                                                      const float* __restrict__ lse2, const float* __restrict__ delta,
                                                      float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                      float scale) {
    tc_backward_dkdv<128>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void __launch_bounds__(256, 1) flash_attn_tc_bwd_dq_d128(const bf16* __restrict__ dout, const bf16* __restrict__ qkv,
                                                    const float* __restrict__ lse2, const float* __restrict__ delta,
                                                    float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                    float scale) {
    tc_backward_dq<128>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void __launch_bounds__(256, 1)
    flash_attn_tc_fwd_bf16out_d128(const bf16* __restrict__ qkv, bf16* __restrict__ out, float* __restrict__ lse2,
                                  const bf16* __restrict__ dout, float* __restrict__ delta, int seq_len,
                                  int n_heads, int hd, float scale) {
    tc_forward<128>(qkv, out, lse2, dout, delta, seq_len, n_heads, hd, scale);
}

// delta[bh * T + t] = sum_d dout[b, t, h*hd + d] * o[b, t, h*hd + d] (fp32 accumulation) from bf16
// dout and o [B*T, C]: the backward's row term when the forward's output is at hand (its bf16
// copy), instead of rerunning the forward (pass 1). One warp per (b, t, h) row, 8 per block.
extern "C" __global__ void flash_attn_tc_delta(const bf16* __restrict__ dout, const bf16* __restrict__ o,
                                               float* __restrict__ delta, int rows, int seq_len, int n_heads,
                                               int hd) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = blockIdx.x * 8 + warp;  // r = (b * NH + h) * T + t
    if (r >= rows) return;
    const int t = r % seq_len, bh = r / seq_len, h = bh % n_heads, b = bh / n_heads;
    const long long off = ((long long)b * seq_len + t) * (long long)n_heads * hd + (long long)h * hd;
    float acc = 0.0f;
    for (int d = lane; d < hd; d += 32) acc += __bfloat162float(dout[off + d]) * __bfloat162float(o[off + d]);
    for (int w = 16; w > 0; w >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, w);
    if (lane == 0) delta[r] = acc;
}
