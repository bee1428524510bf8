// Shared device helpers, prepended to every kernel family before NVRTC compiles it (NVRTC has
// no file system of its own for project headers). Reductions need blockDim.x to be a multiple
// of 32 and at most 1024.
#define ASTERIA_FULL_MASK 0xffffffffu
#define ASTERIA_NAN __int_as_float(0x7fc00000)

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(ASTERIA_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(ASTERIA_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(ASTERIA_FULL_MASK, v, o));
    return v;
}

// Sum over the whole block; every thread gets the result. Safe to call repeatedly.
__device__ float block_sum(float v) {
    __shared__ float s_sum[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) s_sum[warp] = v;
    __syncthreads();
    v = (lane < nwarps) ? s_sum[lane] : 0.0f;
    v = warp_sum(v);
    return v;
}

// Double-precision block sum; every thread gets the result.
__device__ double block_sum_d(double v) {
    __shared__ double s_sumd[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) s_sumd[warp] = v;
    __syncthreads();
    v = (lane < nwarps) ? s_sumd[lane] : 0.0;
    v = warp_sum_d(v);
    return v;
}

// Max over the whole block; every thread gets the result.
__device__ float block_max(float v) {
    __shared__ float s_max[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) s_max[warp] = v;
    __syncthreads();
    v = (lane < nwarps) ? s_max[lane] : __int_as_float(0xff800000);
    v = warp_max(v);
    return v;
}

// Global linear thread index and stride for grid-stride loops over 64-bit counts.
__device__ __forceinline__ long long gtid() { return (long long)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ long long gstride() { return (long long)gridDim.x * blockDim.x; }

// Whether a pointer is aligned to `bytes` (a power of two): the vectorised element-wise kernels
// take 16-byte (float4) steps where every operand allows it, and finish (or, unaligned, do all
// of it) one element at a time. Each element's arithmetic is the same on both paths.
__device__ __forceinline__ bool asteria_aligned(const void* p, unsigned bytes) {
    return (reinterpret_cast<unsigned long long>(p) & (unsigned long long)(bytes - 1)) == 0;
}

