// Reductions: sums of squares into fixed per-block partials (double), and the finalisers for
// the global gradient norm (plan op `ClipGradNorm`, PyTorch clip_grad_norm_) and for SOAP's
// RMS normalisation. Partials are always added in the same order: results are deterministic.

// partials[slot * gridDim.x + blockIdx.x] = sum over this block's grid-stride share of x^2,
// float4 steps where x is 16-byte aligned (two accumulators, so two loads are in flight per
// thread); the order is fixed by (n, grid, block), so the result is deterministic.
extern "C" __global__ void sumsq_partials(const float* __restrict__ x, long long n, double* __restrict__ partials,
                                          int slot) {
    double a0 = 0.0, a1 = 0.0;
    const long long n4 = asteria_aligned(x, 16) ? n / 4 : 0;
    for (long long i = gtid(); i < n4; i += gstride()) {
        const float4 v = reinterpret_cast<const float4*>(x)[i];
        a0 += (double)v.x * (double)v.x + (double)v.y * (double)v.y;
        a1 += (double)v.z * (double)v.z + (double)v.w * (double)v.w;
    }
    for (long long i = 4 * n4 + gtid(); i < n; i += gstride()) {
        const double v = (double)x[i];
        a0 += v * v;
    }
    const double acc = block_sum_d(a0 + a1);
    if (threadIdx.x == 0) partials[(long long)slot * gridDim.x + blockIdx.x] = acc;
}

// norm[0] = sqrt(sum partials); scale[0] = max_norm / norm when 0 < max_norm < norm and the
// norm is finite, else 1. max_norm <= 0 means no clipping. One block.
extern "C" __global__ void grad_norm_finalize(const double* __restrict__ partials, int count, float* __restrict__ norm,
                                              float* __restrict__ scale, double max_norm) {
    double acc = 0.0;
    for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
    acc = block_sum_d(acc);
    if (threadIdx.x == 0) {
        const double nrm = sqrt(acc);
        norm[0] = (float)nrm;
        const bool clip = max_norm > 0.0 && isfinite(nrm) && nrm > max_norm;
        scale[0] = clip ? (float)(max_norm / nrm) : 1.0f;
    }
}

// out[0] = 1e-30 + sqrt(sum partials / numel): the divisor of SOAP's normalize_grads. One block.
extern "C" __global__ void rms_finalize(const double* __restrict__ partials, int count, long long numel,
                                        float* __restrict__ out) {
    double acc = 0.0;
    for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
    acc = block_sum_d(acc);
    if (threadIdx.x == 0) out[0] = (float)(1e-30 + sqrt(acc / (double)numel));
}
