#include <cuda_bf16.h>

// LayerNorm over the last dim (plan ops `LayerNorm`, `LayerNormBackward`; Ba et al. 2016).
// x/out/dout/dx [n, c], weight/bias/dweight/dbias [c]; biased variance; statistics recomputed
// from x in the backward.
//
// Rows of c <= 32 * 64 = 2048 take the warp-per-row kernels (`*_w8` .. `*_w64`): one warp owns
// a row, lane l holds x[l], x[l + 32], ... in registers (V values, c <= 32 * V), reductions are
// warp shuffles only. The warp backward (`layernorm_backward_w*`) also sums its slab's
// dweight/dbias partials in the same pass. Wider rows take the block-per-row kernels
// `layernorm_forward` / `layernorm_backward_dx`, whose dweight/dbias come from a separate pass,
// `layernorm_backward_params` (slabs of rows per column into partials). Either way
// `layernorm_backward_params_finalize` adds the partials in a fixed order. No atomics anywhere:
// every result is deterministic for a given (n, c). The `layernorm_forward_bf16_w*` kernels
// write a bf16 output instead (for an output only bf16 GEMMs read).

__device__ __forceinline__ void ln_row_stats(const float* xr, int c, float eps, float* mean, float* rstd) {
    float s = 0.0f;
    for (int j = threadIdx.x; j < c; j += blockDim.x) s += xr[j];
    const float m = block_sum(s) / (float)c;
    float v = 0.0f;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        const float d = xr[j] - m;
        v += d * d;
    }
    const float var = block_sum(v) / (float)c;
    *mean = m;
    *rstd = 1.0f / sqrtf(var + eps);
}

// Warp-per-row helpers. The row index is warp-uniform, so a warp either returns whole or runs
// every shuffle with all 32 lanes. xv[i] holds x[row, i * 32 + lane] (0 past the row's end).

// Loads the lane's V values of row xr (0 past c) into xv; returns mean and rstd (two-pass
// variance from registers, as ln_row_stats).
template <int V>
__device__ __forceinline__ void ln_warp_load_stats(const float* __restrict__ xr, int c, float eps, float (&xv)[V],
                                                   float* mean, float* rstd) {
    const int lane = threadIdx.x & 31;
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const int j = i * 32 + lane;
        xv[i] = j < c ? xr[j] : 0.0f;
        s += xv[i];
    }
    const float m = warp_sum(s) / (float)c;
    float q = 0.0f;
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const int j = i * 32 + lane;
        const float d = j < c ? xv[i] - m : 0.0f;
        q += d * d;
    }
    const float var = warp_sum(q) / (float)c;
    *mean = m;
    *rstd = 1.0f / sqrtf(var + eps);
}

// out = (x - mean) * rstd * weight + bias (bias may be null); one warp per row.
// (out is float, or __nv_bfloat16 for the `_bf16` kernels: rounded to nearest even, the same
// bits as an f32 output cast afterwards.)
__device__ __forceinline__ void ln_put(float* o, int j, float v) { o[j] = v; }
__device__ __forceinline__ void ln_put(__nv_bfloat16* o, int j, float v) { o[j] = __float2bfloat16_rn(v); }

template <int V, typename OutT = float>
__device__ __forceinline__ void ln_forward_warp(const float* __restrict__ x, const float* __restrict__ weight,
                                                const float* __restrict__ bias, OutT* __restrict__ out, int n,
                                                int c, float eps) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= n) return;
    const int lane = threadIdx.x & 31;
    float xv[V];
    float mean, rstd;
    ln_warp_load_stats<V>(x + (long long)row * c, c, eps, xv, &mean, &rstd);
    OutT* o = out + (long long)row * c;
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const int j = i * 32 + lane;
        if (j < c) {
            const float b = bias ? bias[j] : 0.0f;
            ln_put(o, j, (xv[i] - mean) * rstd * weight[j] + b);
        }
    }
}

// Fused warp-per-row backward: dx and the slab's dweight/dbias partials in one pass over dout
// and x (the separate column-sum pass read both again: 5 row-sized transfers per LayerNorm
// instead of 3).
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dout * weight, one warp per row. The
// row statistics and the combination run in float64 (inputs and dx stay f32): for short rows
// the f32 formula cancels badly (an f32 emulation at c = 3 gave norm-wise errors up to 1e-4
// against float64; in float64 ~1e-7), and the kernel is memory-bound either way.
// Slabs: block s = blockIdx.x (LN_BWD_WARPS warps) owns rows [s * rows_per_slab,
// min(n, (s + 1) * rows_per_slab)); warp w takes the slab's rows w, w + LN_BWD_WARPS, ... in
// increasing order and adds dout * xhat and dout of each column into its own accumulators in
// dynamic shared memory (float [LN_BWD_WARPS][2][c]); then the block adds the warps'
// accumulators in warp order into pw[s * c + j] and pb[s * c + j] (pb may be null).
// layernorm_backward_params_finalize adds the slabs in order: deterministic for (n, c).
#define LN_BWD_WARPS 8
template <int V>
__device__ __forceinline__ void ln_backward_warp(const float* __restrict__ dout, const float* __restrict__ x,
                                                 const float* __restrict__ weight, float* __restrict__ dx,
                                                 float* __restrict__ pw, float* __restrict__ pb, int n, int c,
                                                 float eps, int rows_per_slab) {
    // RELOAD (the widest rows): dout is not kept in registers but read again from the cache
    // in each loop (one DRAM read; 64 more registers a lane would spill).
    constexpr bool RELOAD = V > 32;
    constexpr int DV = RELOAD ? 1 : V;
    extern __shared__ float ln_acc[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float* aw = ln_acc + (long long)(2 * warp) * c;
    float* ab = aw + c;
#pragma unroll
    for (int i = 0; i < V; ++i) {
        const int j = i * 32 + lane;
        if (j < c) {
            aw[j] = 0.0f;
            ab[j] = 0.0f;
        }
    }
    const long long r0 = (long long)blockIdx.x * rows_per_slab;
    const long long r1 = min((long long)n, r0 + rows_per_slab);
    for (long long row = r0 + warp; row < r1; row += LN_BWD_WARPS) {
        const float* dr = dout + row * c;
        const float* xr = x + row * c;
        float xv[V], dv[DV];
        // dout[row, i * 32 + lane] (0 past the row's end).
        auto g_of = [&](int i) -> float {
            const int j = i * 32 + lane;
            return RELOAD ? (j < c ? dr[j] : 0.0f) : dv[RELOAD ? 0 : i];
        };
        // Issue both rows' loads before the reductions so they stream in together. Two rounds
        // of warp sums, each of two independent values: (sum x, sum g), then (sum (x - mean)^2,
        // sum g (x - mean)), g = dout * weight.
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const int j = i * 32 + lane;
            if (!RELOAD) dv[RELOAD ? 0 : i] = j < c ? dr[j] : 0.0f;
            xv[i] = j < c ? xr[j] : 0.0f;
        }
        double s = 0.0, sg = 0.0;
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const int j = i * 32 + lane;
            s += (double)xv[i];
            sg += j < c ? (double)(g_of(i) * weight[j]) : 0.0;
        }
        const double mean = warp_sum_d(s) / (double)c;
        const double mg = warp_sum_d(sg) / (double)c;
        // xv becomes the deviation x - mean, subtracted in float64 and kept as f32 (a relative
        // rounding of 6e-8 per element; the cancellation is in the subtraction, not the
        // storage), so that no float64 copy of the row stays live in registers.
        double q = 0.0, sgx = 0.0;
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const int j = i * 32 + lane;
            xv[i] = j < c ? (float)((double)xv[i] - mean) : 0.0f;
            q += (double)xv[i] * (double)xv[i];
            sgx += j < c ? (double)(g_of(i) * weight[j]) * (double)xv[i] : 0.0;
        }
        const double rstd = 1.0 / sqrt(warp_sum_d(q) / (double)c + (double)eps);
        const double mgx = warp_sum_d(sgx) / (double)c * rstd;
        float* d = dx + row * c;
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const int j = i * 32 + lane;
            if (j < c) {
                const float gi = g_of(i);
                const double g = (double)(gi * weight[j]);
                d[j] = (float)(rstd * (g - mg - (double)xv[i] * rstd * mgx));
                aw[j] += gi * (float)((double)xv[i] * rstd);
                ab[j] += gi;
            }
        }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        float tw = 0.0f, tb = 0.0f;
        for (int w = 0; w < LN_BWD_WARPS; ++w) {
            tw += ln_acc[(long long)(2 * w) * c + j];
            tb += ln_acc[(long long)(2 * w + 1) * c + j];
        }
        const long long o = (long long)blockIdx.x * c + j;
        pw[o] = tw;
        if (pb) pb[o] = tb;
    }
}

// Block-per-row forward (rows wider than the warp kernels hold). Block of row_threads(c).
// out = (x - mean) * rstd * weight + bias (bias may be null).
extern "C" __global__ void layernorm_forward(const float* __restrict__ x, const float* __restrict__ weight,
                                             const float* __restrict__ bias, float* __restrict__ out,
                                             int n, int c, float eps) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const float* xr = x + (long long)row * c;
    float* o = out + (long long)row * c;
    float mean, rstd;
    ln_row_stats(xr, c, eps, &mean, &rstd);
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        const float b = bias ? bias[j] : 0.0f;
        o[j] = (xr[j] - mean) * rstd * weight[j] + b;
    }
}

// Block-per-row dx (rows wider than the warp kernels hold). Block of row_threads(c).
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dout * weight. Writes the row's mean
// and rstd to stats[2*row], stats[2*row+1] for layernorm_backward_params.
extern "C" __global__ void layernorm_backward_dx(const float* __restrict__ dout, const float* __restrict__ x,
                                                 const float* __restrict__ weight, float* __restrict__ dx,
                                                 float* __restrict__ stats, int n, int c, float eps) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const float* xr = x + (long long)row * c;
    const float* dr = dout + (long long)row * c;
    float* d = dx + (long long)row * c;
    // float64 statistics and combination, as ln_backward_dx_warp.
    double s = 0.0;
    for (int j = threadIdx.x; j < c; j += blockDim.x) s += (double)xr[j];
    const double mean = block_sum_d(s) / (double)c;
    double q = 0.0;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        const double dv = (double)xr[j] - mean;
        q += dv * dv;
    }
    const double rstd = 1.0 / sqrt(block_sum_d(q) / (double)c + (double)eps);
    double sg = 0.0, sgx = 0.0;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        const double g = (double)(dr[j] * weight[j]);
        sg += g;
        sgx += g * ((double)xr[j] - mean) * rstd;
    }
    const double mg = block_sum_d(sg) / (double)c;
    const double mgx = block_sum_d(sgx) / (double)c;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        const double xh = ((double)xr[j] - mean) * rstd;
        d[j] = (float)(rstd * ((double)(dr[j] * weight[j]) - mg - xh * mgx));
    }
    if (threadIdx.x == 0) {
        stats[2 * (long long)row] = (float)mean;
        stats[2 * (long long)row + 1] = (float)rstd;
    }
}

// Warp-per-row kernels, V values per lane (c <= 32 * V). Forward: block of 256 threads = 8
// rows, grid ceil(n / 8). Backward: block of LN_BWD_WARPS warps = one slab of rows, grid =
// slabs, 2 * LN_BWD_WARPS * c floats of dynamic shared memory.
extern "C" __global__ void layernorm_forward_w8(const float* __restrict__ x, const float* __restrict__ weight,
                                                const float* __restrict__ bias, float* __restrict__ out, int n,
                                                int c, float eps) {
    ln_forward_warp<8>(x, weight, bias, out, n, c, eps);
}
extern "C" __global__ void layernorm_forward_w16(const float* __restrict__ x, const float* __restrict__ weight,
                                                 const float* __restrict__ bias, float* __restrict__ out, int n,
                                                 int c, float eps) {
    ln_forward_warp<16>(x, weight, bias, out, n, c, eps);
}
extern "C" __global__ void layernorm_forward_w24(const float* __restrict__ x, const float* __restrict__ weight,
                                                 const float* __restrict__ bias, float* __restrict__ out, int n,
                                                 int c, float eps) {
    ln_forward_warp<24>(x, weight, bias, out, n, c, eps);
}
extern "C" __global__ void layernorm_forward_w32(const float* __restrict__ x, const float* __restrict__ weight,
                                                 const float* __restrict__ bias, float* __restrict__ out, int n,
                                                 int c, float eps) {
    ln_forward_warp<32>(x, weight, bias, out, n, c, eps);
}
extern "C" __global__ void layernorm_forward_w64(const float* __restrict__ x, const float* __restrict__ weight,
                                                 const float* __restrict__ bias, float* __restrict__ out, int n,
                                                 int c, float eps) {
    ln_forward_warp<64>(x, weight, bias, out, n, c, eps);
}

extern "C" __global__ void __launch_bounds__(32 * LN_BWD_WARPS, 2) layernorm_backward_w8(
    const float* __restrict__ dout, const float* __restrict__ x, const float* __restrict__ weight,
    float* __restrict__ dx, float* __restrict__ pw, float* __restrict__ pb, int n, int c, float eps,
    int rows_per_slab) {
    ln_backward_warp<8>(dout, x, weight, dx, pw, pb, n, c, eps, rows_per_slab);
}
extern "C" __global__ void __launch_bounds__(32 * LN_BWD_WARPS, 2) layernorm_backward_w16(
    const float* __restrict__ dout, const float* __restrict__ x, const float* __restrict__ weight,
    float* __restrict__ dx, float* __restrict__ pw, float* __restrict__ pb, int n, int c, float eps,
    int rows_per_slab) {
    ln_backward_warp<16>(dout, x, weight, dx, pw, pb, n, c, eps, rows_per_slab);
}
extern "C" __global__ void __launch_bounds__(32 * LN_BWD_WARPS, 2) layernorm_backward_w24(
    const float* __restrict__ dout, const float* __restrict__ x, const float* __restrict__ weight,
    float* __restrict__ dx, float* __restrict__ pw, float* __restrict__ pb, int n, int c, float eps,
    int rows_per_slab) {
    ln_backward_warp<24>(dout, x, weight, dx, pw, pb, n, c, eps, rows_per_slab);
}
extern "C" __global__ void __launch_bounds__(32 * LN_BWD_WARPS) layernorm_backward_w32(
    const float* __restrict__ dout, const float* __restrict__ x, const float* __restrict__ weight,
    float* __restrict__ dx, float* __restrict__ pw, float* __restrict__ pb, int n, int c, float eps,
    int rows_per_slab) {
    ln_backward_warp<32>(dout, x, weight, dx, pw, pb, n, c, eps, rows_per_slab);
}
extern "C" __global__ void __launch_bounds__(32 * LN_BWD_WARPS, 1) layernorm_backward_w64(
    const float* __restrict__ dout, const float* __restrict__ x, const float* __restrict__ weight,
    float* __restrict__ dx, float* __restrict__ pw, float* __restrict__ pb, int n, int c, float eps,
    int rows_per_slab) {
    ln_backward_warp<64>(dout, x, weight, dx, pw, pb, n, c, eps, rows_per_slab);
}

// Stage 1 of dweight/dbias: for the slab of rows [s * rows_per_slab, min(n, (s+1) * rows_per_slab)),
// s = blockIdx.y, writes pw[s * c + j] = sum dout[r,j] * xhat[r,j] and pb[s * c + j] =
// sum dout[r,j] (pb may be null). With one slab the launcher passes dweight/dbias as pw/pb.
// Block (32, 8): threadIdx.x picks the column inside a 32-wide tile (blockIdx.x), threadIdx.y
// strides the slab's rows; the 8 row-lane sums are combined in a fixed order (deterministic).
extern "C" __global__ void layernorm_backward_params(const float* __restrict__ dout, const float* __restrict__ x,
                                                     const float* __restrict__ stats, float* __restrict__ pw,
                                                     float* __restrict__ pb, int n, int c, int rows_per_slab) {
    __shared__ float s_w[8][33];
    __shared__ float s_b[8][33];
    const int j = blockIdx.x * 32 + threadIdx.x;
    const long long r0 = (long long)blockIdx.y * rows_per_slab;
    const long long r1 = min((long long)n, r0 + rows_per_slab);
    float aw = 0.0f, ab = 0.0f;
    if (j < c) {
#pragma unroll 4
        for (long long r = r0 + threadIdx.y; r < r1; r += blockDim.y) {
            const long long k = r * c + j;
            const float g = dout[k];
            aw += g * (x[k] - stats[2 * r]) * stats[2 * r + 1];
            ab += g;
        }
    }
    s_w[threadIdx.y][threadIdx.x] = aw;
    s_b[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y == 0 && j < c) {
        float tw = 0.0f, tb = 0.0f;
        for (int y = 0; y < (int)blockDim.y; ++y) {
            tw += s_w[y][threadIdx.x];
            tb += s_b[y][threadIdx.x];
        }
        const long long o = (long long)blockIdx.y * c + j;
        pw[o] = tw;
        if (pb) pb[o] = tb;
    }
}

// Stage 2: dweight[j] = sum_s pw[s * c + j], dbias[j] = sum_s pb[s * c + j] (dbias, pb may be
// null). Block (32, 8) over a 32-column tile (blockIdx.x): row lane y adds the slabs
// [y * k, min(slabs, (y + 1) * k)), k = ceil(slabs / 8), in order, then lane 0 adds the 8 lane
// sums in order (deterministic; 8 independent load streams per column instead of one chain of
// `slabs` dependent loads).
extern "C" __global__ void layernorm_backward_params_finalize(const float* __restrict__ pw,
                                                              const float* __restrict__ pb,
                                                              float* __restrict__ dweight, float* __restrict__ dbias,
                                                              int c, int slabs) {
    __shared__ float s_w[8][33];
    __shared__ float s_b[8][33];
    const int j = blockIdx.x * 32 + threadIdx.x;
    const int k = (slabs + 7) / 8;
    const int s0 = threadIdx.y * k, s1 = min(slabs, s0 + k);
    float tw = 0.0f, tb = 0.0f;
    if (j < c) {
#pragma unroll 4
        for (int s = s0; s < s1; ++s) {
            tw += pw[(long long)s * c + j];
            if (pb) tb += pb[(long long)s * c + j];
        }
    }
    s_w[threadIdx.y][threadIdx.x] = tw;
    s_b[threadIdx.y][threadIdx.x] = tb;
    __syncthreads();
    if (threadIdx.y == 0 && j < c) {
        float w = 0.0f, b = 0.0f;
        for (int y = 0; y < 8; ++y) {
            w += s_w[y][threadIdx.x];
            b += s_b[y][threadIdx.x];
        }
        dweight[j] = w;
        if (dbias) dbias[j] = b;
    }
}

// bf16 output (warp-per-row only; c <= 2048).
extern "C" __global__ void layernorm_forward_bf16_w8(const float* __restrict__ x, const float* __restrict__ weight,
                                                     const float* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                                                     int n, int c, float eps) {
    ln_forward_warp<8>(x, weight, bias, out, n, c, eps);
}
extern "C" __global__ void layernorm_forward_bf16_w16(const float* __restrict__ x, const float* __restrict__ weight,
                                                     const float* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                                                     int n, int c, float eps) {
    ln_forward_warp<16>(x, weight, bias, out, n, c, eps);
}
extern "C" __global__ void layernorm_forward_bf16_w24(const float* __restrict__ x, const float* __restrict__ weight,
                                                     const float* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                                                     int n, int c, float eps) {
    ln_forward_warp<24>(x, weight, bias, out, n, c, eps);
}
extern "C" __global__ void layernorm_forward_bf16_w32(const float* __restrict__ x, const float* __restrict__ weight,
                                                     const float* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                                                     int n, int c, float eps) {
    ln_forward_warp<32>(x, weight, bias, out, n, c, eps);
}
extern "C" __global__ void layernorm_forward_bf16_w64(const float* __restrict__ x, const float* __restrict__ weight,
                                                     const float* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                                                     int n, int c, float eps) {
    ln_forward_warp<64>(x, weight, bias, out, n, c, eps);
}
