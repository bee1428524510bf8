// Reductions: sums of squares into fixed per-block partials (double), and the finalisers for
// the global gradient norm (plan op `ClipGradNorm`, PyTorch clip_grad_norm_) and for SOAP's
// RMS normalisation. Partials are always added in the same order: results are deterministic.

// partials[slot * gridDim.x + blockIdx.x] = sum over this block's grid-stride share of x^2.
extern "C" __global__ void sumsq_partials(const float* __restrict__ x, long long n, double* __restrict__ partials,
                                          int slot) {
    double acc = 0.0;
    for (long long i = gtid(); i < n; i += gstride()) {
        const double v = (double)x[i];
        acc += v * v;
    }
    acc = block_sum_d(acc);
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
