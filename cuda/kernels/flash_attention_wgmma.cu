// Fused causal multi-head self-attention on Hopper's warpgroup MMA (`wgmma.mma_async`, sm_90a):
// the same algorithm, operands and outputs as flash_attention_tc.cu (FlashAttention-2, Dao 2023:
// bf16 Q, K, V, dO, P and dS into the tensor cores, fp32 accumulation and softmax in base 2, a
// deterministic backward in three passes: row statistics, dK/dV per key block, dQ per query
// block, every element of dqkv written once), for head dims 33..128 (variants _d64, _d128; a
// head is padded with zeros up to its variant's width). Launch geometry as there: grid
// (ceil(T/128), B*NH), block 256 = two warpgroups of 64 rows (queries, or keys for dK/dV); K/V
// (Q/dO for dK/dV) stream through shared memory in tiles of 64 rows, double-buffered with
// cp.async. What changes is the MMA: one warpgroup instruction computes a 64 x N block
// (N = 64 score columns or N = head dim) from shared-memory operands, asynchronously, at about
// twice the rate `mma.sync` reaches on an H100/H200.
//
// Shared-memory tiles use wgmma's canonical no-swizzle layout (PTX ISA, "Shared Memory Matrix
// Layout", INTERLEAVE): a tile of R rows x HD bf16 columns is a grid of 8 x 8 core matrices of
// 128 contiguous bytes (8 rows of 16 bytes), column chunk major: row r, 16-byte chunk c at byte
// ((c * R/8 + r/8) * 128 + (r % 8) * 16). One tile serves both ways an MMA reads it:
//   K-major (rows = M or N index, columns = the reduction index; Q K^T's B, K Q^T's A, ...):
//     leading byte offset (next 8 reduction columns) R*16, stride byte offset (next 8 rows) 128;
//   N-major (rows = the reduction index, columns = N; P V's B, dS K's B, P^T dO's B, ...):
//     leading byte offset (next 8 reduction rows) 128, stride byte offset (next 8 columns) R*16,
//     with the instruction's B-transpose bit set.
// A warp's loads cover 8 rows x 4 chunks: 64 contiguous bytes of each global row, 4 whole core
// matrices in shared memory (no bank conflicts).
// The score accumulators (per warp the m16n8 layout of flash_common.cuh) become, packed to
// bf16, the register A operand of the next MMA (P V, dS K, P^T dO, dS^T Q) as in the mma.sync
// kernels. wgmma reads shared memory through the async proxy: every cp.async tile is followed
// by fence.proxy.async before the barrier that publishes it.
//
// Dynamic shared memory (bytes; the launcher passes the same, attention.rs's flash_variant):
//   forward: Q 128 rows + 2 stages x (K 64 + V 64 rows) = 384 rows x HD x 2 (d64 49152, d128 98304);
//   dQ and dK/dV: 2 x 128 rows (Q and dO, or K and V) + the same stages = 512 rows x HD x 2
//   (d64 65536, d128 131072); dK/dV also 1 KB static (the staged lse2 / delta values).
// Compiled for every arch (the NVRTC check builds sm_80 and sm_90 too); only an sm_90a build
// has the wgmma bodies (elsewhere they trap), and the launcher takes these kernels only on
// compute capability 9.0.

#define WG_ROWS 128  // rows per block: two warpgroups of 64
#define WG_TILE 64   // rows per streamed tile
#define WG_THREADS 256  // threads per block (every kernel's launch)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_OK 1
#else
#define WG_OK 0
#endif

extern __shared__ __align__(128) unsigned char wg_smem[];

// Byte offset of row r, 16-byte chunk c in a core-matrix tile of R rows.
template <int R>
__device__ __forceinline__ int wg_at(int r, int c) {
    return ((c * (R / 8) + (r >> 3)) << 7) + ((r & 7) << 4);
}

// Rows row0 .. row0+R-1 (zeros past n_valid) of a bf16 head slice `src` (row stride ld, hd
// valid columns, zeros up to HD) into the core-matrix tile dst: asynchronous (cp.async, one
// group committed by the caller) on the 16-byte path, synchronous on the element path (odd
// head dims or unaligned rows).
template <int HD, int R>
__device__ __forceinline__ void wg_load(unsigned char* dst, const bf16* __restrict__ src, long long ld, int row0,
                                        int n_valid, int hd, bool vec) {
    constexpr int CH = HD / 8;  // 16-byte chunks per row
    static_assert(R % 8 == 0 && CH % 4 == 0 && (R * CH) % WG_THREADS == 0, "a warp covers 8 rows x 4 chunks");
    if (vec) {
#pragma unroll
        for (int i = 0; i < R * CH / WG_THREADS; ++i) {
            const int e = threadIdx.x + i * WG_THREADS, rest = e >> 5;
            const int c = (rest % (CH / 4)) * 4 + ((e >> 3) & 3), r = (rest / (CH / 4)) * 8 + (e & 7);
            const int row = row0 + r;
            const bool ok = row < n_valid && c * 8 < hd;
            tc_cp16(reinterpret_cast<bf16*>(dst + wg_at<R>(r, c)), ok ? src + (long long)row * ld + c * 8 : src, ok);
        }
    } else {
        const bf16 zero = __float2bfloat16_rn(0.0f);
        for (int e = threadIdx.x; e < R * HD; e += blockDim.x) {
            const int r = e / HD, d = e % HD, row = row0 + r;
            *reinterpret_cast<bf16*>(dst + wg_at<R>(r, d >> 3) + (d & 7) * 2) =
                (row < n_valid && d < hd) ? src[(long long)row * ld + d] : zero;
        }
    }
}

// 2^x on the MUFU unit (ex2.approx, subnormal results flushed to zero): the softmax's
// exponentials, one instruction each (exp2f adds a subnormal range fix-up around it).
// ex2(-inf) = +0.
__device__ __forceinline__ float wg_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// A wgmma shared-memory matrix descriptor (no swizzle): start address, leading and stride byte
// offsets (PTX ISA, "Matrix Descriptor Format"; each field in units of 16 bytes).
__device__ __forceinline__ unsigned long long wg_desc(const unsigned char* p, int lbo, int sbo) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    return (unsigned long long)((a & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
           ((unsigned long long)(sbo >> 4) << 32);
}

// K-major operand: rows r0 .. r0+63 (r0 a multiple of 8) of an R-row tile, reduction columns
// 16kk .. 16kk+15.
template <int R>
__device__ __forceinline__ unsigned long long wg_kmajor(const unsigned char* tile, int r0, int kk) {
    return wg_desc(tile + (r0 >> 3) * 128 + kk * 2 * R * 16, R * 16, 128);
}

// N-major B operand: rows (the reduction index) 16ks .. 16ks+15 of an R-row tile, every column.
template <int R>
__device__ __forceinline__ unsigned long long wg_nmajor(const unsigned char* tile, int ks) {
    return wg_desc(tile + ks * 2 * 128, 128, R * 16);
}

__device__ __forceinline__ void wg_fence() {
#if WG_OK
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {
#if WG_OK
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_wait0() {
#if WG_OK
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}
// Makes shared-memory writes of the generic proxy (cp.async, stores) visible to wgmma's async
// proxy; each thread after its own writes, before the barrier.
__device__ __forceinline__ void wg_proxy_fence() {
#if WG_OK
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Pins an accumulator's registers at this point of the program: reads after a wg_wait0 stay
// after it, writes before a wgmma stay before it (the compiler sees the asynchronous MMA only
// as the asm statement that issued it).
template <int N>
__device__ __forceinline__ void wg_pin(float (&d)[N][4]) {
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

// d (+)= A B, m64n64k16: A (64 x 16) and B (16 x 64) both K-major in shared memory
// (descriptors da, db); accumulate = 0 overwrites d.
__device__ __forceinline__ void wg_ss_n64(float (&d)[8][4], unsigned long long da, unsigned long long db, int accumulate) {
#if WG_OK
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(da), "l"(db), "r"(accumulate));
#else
    __trap();
#endif
}

// d += A B, m64n64k16: A (64 x 16) in registers (per warp the m16n8k16 A fragment of its 16
// rows), B (16 x 64) N-major ("transposed") in shared memory (descriptor db).
__device__ __forceinline__ void wg_rs_n64(float (&d)[8][4], const unsigned (&a)[4], unsigned long long db) {
#if WG_OK
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
#else
    __trap();
#endif
}

// d (+)= A B, m64n128k16: A (64 x 16) and B (16 x 128) both K-major in shared memory
// (descriptors da, db); accumulate = 0 overwrites d.
__device__ __forceinline__ void wg_ss_n128(float (&d)[16][4], unsigned long long da, unsigned long long db, int accumulate) {
#if WG_OK
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(da), "l"(db), "r"(accumulate));
#else
    __trap();
#endif
}

// d += A B, m64n128k16: A (64 x 16) in registers (per warp the m16n8k16 A fragment of its 16
// rows), B (16 x 128) N-major ("transposed") in shared memory (descriptor db).
__device__ __forceinline__ void wg_rs_n128(float (&d)[16][4], const unsigned (&a)[4], unsigned long long db) {
#if WG_OK
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
#else
    __trap();
#endif
}

template <int ND>
__device__ __forceinline__ void wg_rs(float (&d)[ND][4], const unsigned (&a)[4], unsigned long long db) {
    if constexpr (ND == 8) {
        wg_rs_n64(d, a, db);
    } else {
        static_assert(ND == 16, "head dims 64 and 128");
        wg_rs_n128(d, a, db);
    }
}

// The register A operands of P (64 rows x 64 reduction columns, held as score accumulators
// p[8][4]): k-step ks takes columns 16ks .. 16ks+15.
__device__ __forceinline__ void wg_pack(unsigned (&a)[4][4], const float (&p)[8][4]) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        a[ks][0] = tc_pack(p[2 * ks][0], p[2 * ks][1]);
        a[ks][1] = tc_pack(p[2 * ks][2], p[2 * ks][3]);
        a[ks][2] = tc_pack(p[2 * ks + 1][0], p[2 * ks + 1][1]);
        a[ks][3] = tc_pack(p[2 * ks + 1][2], p[2 * ks + 1][3]);
    }
}

template <int N>
__device__ __forceinline__ void wg_zero(float (&d)[N][4]) {
#pragma unroll
    for (int j = 0; j < N; ++j) d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.0f;
}

// The K/V streaming of the forward and dQ kernels (two stages of (K tile, V tile) at stg, each
// tile WG_TILE rows): before iteration `it` computes on stage it & 1, starts the copy of tile it+1
// into the other stage (released by the previous iteration's closing barrier), waits for tile
// it, and publishes it to wgmma's async proxy and to the block.
template <int HD>
__device__ __forceinline__ void wg_next_kv(unsigned char* stg, const bf16* __restrict__ base, long long ld, int c,
                                           int it, int ntiles, int seq_len, int hd, bool vec) {
    constexpr int TB = WG_TILE * HD * 2;
    if (it + 1 < ntiles) {
        unsigned char* nx = stg + ((it + 1) & 1) * 2 * TB;
        const int k1 = (it + 1) * WG_TILE;
        wg_load<HD, WG_TILE>(nx, base + c, ld, k1, seq_len, hd, vec);
        wg_load<HD, WG_TILE>(nx + TB, base + 2 * c, ld, k1, seq_len, hd, vec);
        tc_cp_commit();
        tc_cp_wait<1>();
    } else {
        tc_cp_wait<0>();
    }
    wg_proxy_fence();
    __syncthreads();
}

// Shared-memory bytes of each kernel (attention.rs's flash_variant passes the same).
template <int HD>
__host__ __device__ constexpr int wg_fwd_smem() {
    return (WG_ROWS + 4 * WG_TILE) * HD * 2;
}
template <int HD>
__host__ __device__ constexpr int wg_bwd_smem() {
    return (2 * WG_ROWS + 4 * WG_TILE) * HD * 2;
}
static_assert(wg_fwd_smem<64>() == 49152 && wg_fwd_smem<128>() == 98304, "attention.rs's fwd_smem");
static_assert(wg_bwd_smem<64>() == 65536 && wg_bwd_smem<128>() == 131072, "attention.rs's dkdv/dq_smem");

// Forward (and backward pass 1), as tc_forward: out (may be null) [B*T, C]; lse2 [B*NH*T];
// with dout non-null, delta [B*NH*T] = dout . o instead of out.
template <int HD, typename OutT = float>
__device__ __forceinline__ void wg_forward(const bf16* __restrict__ qkv, OutT* __restrict__ out,
                                           float* __restrict__ lse2, const bf16* __restrict__ dout,
                                           float* __restrict__ delta, int seq_len, int n_heads, int hd, float scale) {
    constexpr int KS = HD / 16, ND = HD / 8, NT = WG_TILE / 8;
    constexpr int TB = WG_TILE * HD * 2;  // bytes of one streamed tile
    unsigned char* const sq = wg_smem;
    unsigned char* const stg = wg_smem + WG_ROWS * HD * 2;  // stage s: K at stg + 2s*TB, V after it
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.y, b = bh / n_heads, h = bh % n_heads;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * WG_ROWS;  // longest rows first
    const int c = n_heads * hd;
    const long long ld = 3LL * c;
    const bf16* base = qkv + (long long)b * seq_len * ld + (long long)h * hd;
    const bool vec = tc_vec(base, ld, hd);
    const int r0 = q0 + wg * 64;   // this warpgroup's first query
    const int w0 = r0 + warp * 16;  // this warp's
    const int rows[2] = {w0 + g, w0 + g + 8};
    const float sl = scale * TC_LOG2E;

    wg_load<HD, WG_ROWS>(sq, base, ld, q0, seq_len, hd, vec);
    wg_load<HD, WG_TILE>(stg, base + c, ld, 0, seq_len, hd, vec);
    wg_load<HD, WG_TILE>(stg + TB, base + 2 * c, ld, 0, seq_len, hd, vec);
    tc_cp_commit();
    float o[ND][4];
    wg_zero(o);
    float m[2] = {TC_NEG_INF, TC_NEG_INF}, l[2] = {0.0f, 0.0f};
    const int kend = min(seq_len, q0 + WG_ROWS);
    const int ntiles = (kend + WG_TILE - 1) / WG_TILE;
    for (int it = 0; it < ntiles; ++it) {
        const int k0 = it * WG_TILE;
        const unsigned char* ks = stg + (it & 1) * 2 * TB;
        const unsigned char* vs = ks + TB;
        wg_next_kv<HD>(stg, base, ld, c, it, ntiles, seq_len, hd, vec);
        if (k0 <= r0 + 63) {  // warpgroup-uniform: else every key is above its rows
            float s[NT][4];
            wg_zero(s);
            wg_pin(s);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < KS; ++kk)
                wg_ss_n64(s, wg_kmajor<WG_ROWS>(sq, wg * 64, kk), wg_kmajor<WG_TILE>(ks, 0, kk), kk > 0);
            wg_commit();
            wg_wait0();
            wg_pin(s);
            // Row maxima of the raw scores (max(s) * sl is max(s * sl): rounding is monotonic),
            // then p = 2^(s * sl - m) as one FMA and one exponential per score.
            const bool full = k0 + WG_TILE - 1 <= w0 && k0 + WG_TILE <= seq_len;  // nothing masked
            float mx[2] = {TC_NEG_INF, TC_NEG_INF};
            if (full) {
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
            } else {
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = k0 + j * 8 + 2 * t + (e & 1);
                        if (!(key <= rows[e >> 1] && key < seq_len)) s[j][e] = TC_NEG_INF;
                        mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
                    }
            }
            float corr[2], nm[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                mx[i] = tc_row_max(mx[i]);
                const float mi = (mx[i] == TC_NEG_INF) ? TC_NEG_INF : mx[i] * sl;
                // A row with no visible key yet keeps its (empty) state.
                const float mn = fmaxf(m[i], mi);
                corr[i] = (mn == TC_NEG_INF) ? 1.0f : wg_exp2(m[i] - mn);
                l[i] *= corr[i];
                m[i] = mn;
                nm[i] = (mn == TC_NEG_INF) ? 0.0f : -mn;  // -inf scores give 2^-inf = 0
            }
            // O keeps its scale where no row maximum moved (exactly: every factor is 1).
            if (!__all_sync(0xffffffffu, corr[0] == 1.0f && corr[1] == 1.0f)) {
#pragma unroll
                for (int n = 0; n < ND; ++n) {
                    o[n][0] *= corr[0];
                    o[n][1] *= corr[0];
                    o[n][2] *= corr[1];
                    o[n][3] *= corr[1];
                }
            }
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float p = wg_exp2(fmaf(s[j][e], sl, nm[e >> 1]));
                    s[j][e] = p;
                    l[e >> 1] += p;
                }
            unsigned pa[4][4];
            wg_pack(pa, s);
            wg_pin(o);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) wg_rs(o, pa[kk], wg_nmajor<WG_TILE>(vs, kk));  // O += P V
            wg_commit();
            wg_wait0();
            wg_pin(o);
        }
        __syncthreads();  // this stage is refilled next iteration
    }
    tc_forward_finish<ND>(o, m, l, rows, w0, bh, b, h, seq_len, c, hd, g, t, lse2, dout, delta, out);
}

// Backward pass 2: dK, dV of 128 keys per block (64 per warpgroup), looping over query tiles
// from the block's first key. Writes the k and v parts of dqkv.
template <int HD>
__device__ __forceinline__ void wg_backward_dkdv(const bf16* __restrict__ dout, const bf16* __restrict__ qkv,
                                                 const float* __restrict__ lse2, const float* __restrict__ delta,
                                                 float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                                 float scale) {
    constexpr int KS = HD / 16, ND = HD / 8, NT = WG_TILE / 8;
    constexpr int RB = WG_ROWS * HD * 2, TB = WG_TILE * HD * 2;
    unsigned char* const sk = wg_smem;
    unsigned char* const sv = wg_smem + RB;
    unsigned char* const stg = wg_smem + 2 * RB;  // stage s: Q at stg + 2s*TB, dO after it
    __shared__ float ls[2][WG_TILE], dls[2][WG_TILE];
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.y, b = bh / n_heads, h = bh % n_heads;
    const int j0 = blockIdx.x * WG_ROWS;  // first blocks have the most queries: launched first
    const int c = n_heads * hd;
    const long long ld = 3LL * c;
    const bf16* base = qkv + (long long)b * seq_len * ld + (long long)h * hd;
    const bf16* gbase = dout + (long long)b * seq_len * c + (long long)h * hd;
    const bool vec = tc_vec(base, ld, hd) && tc_vec(gbase, c, hd);
    const float* lrow = lse2 + (long long)bh * seq_len;
    const float* drow = delta + (long long)bh * seq_len;
    const int r0 = j0 + wg * 64, w0 = r0 + warp * 16;
    const int keys[2] = {w0 + g, w0 + g + 8};
    const float sl = scale * TC_LOG2E;

    auto issue = [&](int i0, int st) {
        unsigned char* qs = stg + st * 2 * TB;
        wg_load<HD, WG_TILE>(qs, base, ld, i0, seq_len, hd, vec);
        wg_load<HD, WG_TILE>(qs + TB, gbase, c, i0, seq_len, hd, vec);
        tc_cp_commit();
        if (threadIdx.x < WG_TILE) {
            const int row = i0 + threadIdx.x;
            ls[st][threadIdx.x] = row < seq_len ? lrow[row] : 0.0f;
            dls[st][threadIdx.x] = row < seq_len ? drow[row] : 0.0f;
        }
    };
    wg_load<HD, WG_ROWS>(sk, base + c, ld, j0, seq_len, hd, vec);
    wg_load<HD, WG_ROWS>(sv, base + 2 * c, ld, j0, seq_len, hd, vec);
    issue(j0, 0);  // commits the K and V rows with the first stage
    float dk[ND][4], dv[ND][4];
    wg_zero(dk);
    wg_zero(dv);
    const int ntiles = (seq_len - j0 + WG_TILE - 1) / WG_TILE;
    for (int it = 0; it < ntiles; ++it) {
        const int i0 = j0 + it * WG_TILE, stage = it & 1;
        if (it + 1 < ntiles) {
            issue(i0 + WG_TILE, stage ^ 1);
            tc_cp_wait<1>();
        } else {
            tc_cp_wait<0>();
        }
        wg_proxy_fence();
        __syncthreads();
        const unsigned char* qs = stg + stage * 2 * TB;
        const unsigned char* gs = qs + TB;
        if (i0 + WG_TILE - 1 >= r0) {  // warpgroup-uniform: else every query is before its keys
            // S^T = K Q^T and dP^T = V dO^T: 64 keys x 64 queries.
            float st[NT][4], dpt[NT][4];
            wg_zero(st);
            wg_zero(dpt);
            wg_pin(st);
            wg_pin(dpt);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < KS; ++kk)
                wg_ss_n64(st, wg_kmajor<WG_ROWS>(sk, wg * 64, kk), wg_kmajor<WG_TILE>(qs, 0, kk), kk > 0);
#pragma unroll
            for (int kk = 0; kk < KS; ++kk)
                wg_ss_n64(dpt, wg_kmajor<WG_ROWS>(sv, wg * 64, kk), wg_kmajor<WG_TILE>(gs, 0, kk), kk > 0);
            wg_commit();
            wg_wait0();
            wg_pin(st);
            wg_pin(dpt);
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int qi = j * 8 + 2 * t + (e & 1), q = i0 + qi;
                    const float p =
                        (keys[e >> 1] <= q && q < seq_len) ? wg_exp2(fmaf(st[j][e], sl, -ls[stage][qi])) : 0.0f;
                    st[j][e] = p;                                    // P^T
                    dpt[j][e] = p * (dpt[j][e] - dls[stage][qi]);  // dS^T
                }
            unsigned pa[4][4], da[4][4];
            wg_pack(pa, st);
            wg_pack(da, dpt);
            wg_pin(dv);
            wg_pin(dk);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) wg_rs(dv, pa[kk], wg_nmajor<WG_TILE>(gs, kk));  // dV += P^T dO
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) wg_rs(dk, da[kk], wg_nmajor<WG_TILE>(qs, kk));  // dK += dS^T Q
            wg_commit();
            wg_wait0();
            wg_pin(dv);
            wg_pin(dk);
        }
        __syncthreads();  // this stage is refilled next iteration
    }
    float* dk_base = dqkv + (long long)b * seq_len * ld + c + (long long)h * hd;
    tc_store<ND>(dk, dk_base, ld, w0, seq_len, hd, g, t, scale);
    tc_store<ND>(dv, dk_base + c, ld, w0, seq_len, hd, g, t, 1.0f);
}

// Backward pass 3: dQ of 128 queries per block (64 per warpgroup), looping over key tiles up to
// the diagonal. Writes the q part of dqkv.
template <int HD>
__device__ __forceinline__ void wg_backward_dq(const bf16* __restrict__ dout, const bf16* __restrict__ qkv,
                                               const float* __restrict__ lse2, const float* __restrict__ delta,
                                               float* __restrict__ dqkv, int seq_len, int n_heads, int hd,
                                               float scale) {
    constexpr int KS = HD / 16, ND = HD / 8, NT = WG_TILE / 8;
    constexpr int RB = WG_ROWS * HD * 2, TB = WG_TILE * HD * 2;
    unsigned char* const sq = wg_smem;
    unsigned char* const sg = wg_smem + RB;
    unsigned char* const stg = wg_smem + 2 * RB;  // stage s: K at stg + 2s*TB, V after it
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.y, b = bh / n_heads, h = bh % n_heads;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * WG_ROWS;
    const int c = n_heads * hd;
    const long long ld = 3LL * c;
    const bf16* base = qkv + (long long)b * seq_len * ld + (long long)h * hd;
    const bf16* gbase = dout + (long long)b * seq_len * c + (long long)h * hd;
    const bool vec = tc_vec(base, ld, hd) && tc_vec(gbase, c, hd);
    const int r0 = q0 + wg * 64, w0 = r0 + warp * 16;
    const int rows[2] = {w0 + g, w0 + g + 8};
    const float sl = scale * TC_LOG2E;

    wg_load<HD, WG_ROWS>(sq, base, ld, q0, seq_len, hd, vec);
    wg_load<HD, WG_ROWS>(sg, gbase, c, q0, seq_len, hd, vec);
    wg_load<HD, WG_TILE>(stg, base + c, ld, 0, seq_len, hd, vec);
    wg_load<HD, WG_TILE>(stg + TB, base + 2 * c, ld, 0, seq_len, hd, vec);
    tc_cp_commit();
    float lse[2], dlt[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const bool real = rows[i] < seq_len;
        lse[i] = real ? lse2[(long long)bh * seq_len + rows[i]] : 0.0f;
        dlt[i] = real ? delta[(long long)bh * seq_len + rows[i]] : 0.0f;
    }
    float dq[ND][4];
    wg_zero(dq);
    const int kend = min(seq_len, q0 + WG_ROWS);
    const int ntiles = (kend + WG_TILE - 1) / WG_TILE;
    for (int it = 0; it < ntiles; ++it) {
        const int k0 = it * WG_TILE;
        const unsigned char* ks = stg + (it & 1) * 2 * TB;
        const unsigned char* vs = ks + TB;
        wg_next_kv<HD>(stg, base, ld, c, it, ntiles, seq_len, hd, vec);
        if (k0 <= r0 + 63) {  // warpgroup-uniform: else every key is above its rows
            float s[NT][4], dp[NT][4];
            wg_zero(s);
            wg_zero(dp);
            wg_pin(s);
            wg_pin(dp);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < KS; ++kk)  // S = Q K^T
                wg_ss_n64(s, wg_kmajor<WG_ROWS>(sq, wg * 64, kk), wg_kmajor<WG_TILE>(ks, 0, kk), kk > 0);
#pragma unroll
            for (int kk = 0; kk < KS; ++kk)  // dP = dO V^T
                wg_ss_n64(dp, wg_kmajor<WG_ROWS>(sg, wg * 64, kk), wg_kmajor<WG_TILE>(vs, 0, kk), kk > 0);
            wg_commit();
            wg_wait0();
            wg_pin(s);
            wg_pin(dp);
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + j * 8 + 2 * t + (e & 1), i = e >> 1;
                    const float p = (key <= rows[i] && rows[i] < seq_len) ? wg_exp2(fmaf(s[j][e], sl, -lse[i])) : 0.0f;
                    dp[j][e] = p * (dp[j][e] - dlt[i]);  // dS
                }
            unsigned da[4][4];
            wg_pack(da, dp);
            wg_pin(dq);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) wg_rs(dq, da[kk], wg_nmajor<WG_TILE>(ks, kk));  // dQ += dS K
            wg_commit();
            wg_wait0();
            wg_pin(dq);
        }
        __syncthreads();  // this stage is refilled next iteration
    }
    tc_store<ND>(dq, dqkv + (long long)b * seq_len * ld + (long long)h * hd, ld, w0, seq_len, hd, g, t, scale);
}

// The kernels. Forwards and the d64 dQ: two blocks per SM (at most 128 registers; the d128
// forward spills 52 bytes there and still runs 2-3% faster than with one block of up to 255
// registers, measured on the H200 at GPT 0.9B and GPT-2 124M). dK/dV and the d128 dQ: one block
// per SM (dK, dV and the two score tiles are 192 registers at d128; 128 KB of shared memory).
extern "C" __global__ void __launch_bounds__(256, 2) flash_attn_wg_fwd_d64(const bf16* __restrict__ qkv, float* __restrict__ out, float* __restrict__ lse2, const bf16* __restrict__ dout, float* __restrict__ delta, int seq_len, int n_heads, int hd, float scale) {
    wg_forward<64>(qkv, out, lse2, dout, delta, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void __launch_bounds__(256, 2) flash_attn_wg_fwd_bf16out_d64(const bf16* __restrict__ qkv, bf16* __restrict__ out, float* __restrict__ lse2, const bf16* __restrict__ dout, float* __restrict__ delta, int seq_len, int n_heads, int hd, float scale) {
    wg_forward<64>(qkv, out, lse2, dout, delta, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void __launch_bounds__(256, 1) flash_attn_wg_bwd_dkdv_d64(const bf16* __restrict__ dout, const bf16* __restrict__ qkv, const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dqkv, int seq_len, int n_heads, int hd, float scale) {
    wg_backward_dkdv<64>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void __launch_bounds__(256, 2) flash_attn_wg_bwd_dq_d64(const bf16* __restrict__ dout, const bf16* __restrict__ qkv, const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dqkv, int seq_len, int n_heads, int hd, float scale) {
    wg_backward_dq<64>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void __launch_bounds__(256, 2) flash_attn_wg_fwd_d128(const bf16* __restrict__ qkv, float* __restrict__ out, float* __restrict__ lse2, const bf16* __restrict__ dout, float* __restrict__ delta, int seq_len, int n_heads, int hd, float scale) {
    wg_forward<128>(qkv, out, lse2, dout, delta, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void __launch_bounds__(256, 2) flash_attn_wg_fwd_bf16out_d128(const bf16* __restrict__ qkv, bf16* __restrict__ out, float* __restrict__ lse2, const bf16* __restrict__ dout, float* __restrict__ delta, int seq_len, int n_heads, int hd, float scale) {
    wg_forward<128>(qkv, out, lse2, dout, delta, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void __launch_bounds__(256, 1) flash_attn_wg_bwd_dkdv_d128(const bf16* __restrict__ dout, const bf16* __restrict__ qkv, const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dqkv, int seq_len, int n_heads, int hd, float scale) {
    wg_backward_dkdv<128>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}
extern "C" __global__ void __launch_bounds__(256, 1) flash_attn_wg_bwd_dq_d128(const bf16* __restrict__ dout, const bf16* __restrict__ qkv, const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dqkv, int seq_len, int n_heads, int hd, float scale) {
    wg_backward_dq<128>(dout, qkv, lse2, delta, dqkv, seq_len, n_heads, hd, scale);
}
