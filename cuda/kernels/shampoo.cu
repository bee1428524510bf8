// Shampoo's element-wise parts and per-block reductions (plan op `ShampooUpdate`; Distributed
// Shampoo's semantics, docs/shampoo.md). The factor contractions and root_L * Gbar * root_R are
// cuBLAS GEMMs on sub-matrices around these kernels (cuda/src/ops/shampoo.rs); the semantics
// are optim::shampoo_update's. Every matrix is the parameter's merged view [vm, vn], row-major
// f32; its blocks are the regular tiling by bsz x bsz tiles (schedule::blocking::blocks: row
// chunks slowest, nbc column chunks per row chunk, a merged vector being the [1, vn] view), so
// block (br, bc) has index br * nbc + bc and holds element (i, j) iff br = i / bsz, bc = j / bsz.

// The moments, element-wise over the whole parameter (n elements):
//   with exp_avg (beta1 != 0): m = b1 * m + w1 * g, gbar = m / bc1 (in double, rounded);
//   without: gbar is the gradient itself (gbar is then null and not written);
//   with graft_sq: v = gb2 * v + gw2 * g * g, pg = gbar / (sqrt(v / gbc) + geps) (in double),
//   the Adam grafting step.
extern "C" __global__ void shampoo_moments(const float* __restrict__ grad, float* __restrict__ exp_avg,
                                           float* __restrict__ gbar, float* __restrict__ graft_sq,
                                           float* __restrict__ pg, long long n, float b1, float w1, double bc1,
                                           float gb2, float gw2, double gbc, double geps) {
    for (long long i = gtid(); i < n; i += gstride()) {
        const float g = grad[i];
        float gb = g;
        if (exp_avg) {
            const float m = b1 * exp_avg[i] + w1 * g;
            exp_avg[i] = m;
            gb = (float)((double)m / bc1);
            gbar[i] = gb;
        }
        if (graft_sq) {
            const float v = gb2 * graft_sq[i] + gw2 * g * g;
            graft_sq[i] = v;
            pg[i] = (float)((double)gb / (sqrt((double)v / gbc) + geps));
        }
    }
}

// Per-block partial sums of squares of p and pg in double: grid (chunks, min(nblocks, 65535)),
// blockDim a multiple of 32; CUDA block (x, y) sums the elements x * blockDim.x + tid,
// + chunks * blockDim.x, ... of Shampoo blocks y, y + gridDim.y, ... and writes
// partials[(blk * chunks + x) * 2 + {0: p, 1: pg}]. Fixed order: deterministic.
extern "C" __global__ void shampoo_graft_partials(const float* __restrict__ p, const float* __restrict__ pg,
                                                  double* __restrict__ partials, int vm, int vn, int bsz,
                                                  int nbc, int nblocks) {
    const int chunks = gridDim.x;
    for (int blk = blockIdx.y; blk < nblocks; blk += gridDim.y) {
        const int r0 = (blk / nbc) * bsz, c0 = (blk % nbc) * bsz;
        const int rows = min(bsz, vm - r0), cols = min(bsz, vn - c0);
        const long long total = (long long)rows * cols;
        double sp = 0.0, spg = 0.0;
        for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total;
             k += (long long)chunks * blockDim.x) {
            const long long at = (long long)(r0 + k / cols) * vn + c0 + k % cols;
            const double a = p[at], b = pg[at];
            sp += a * a;
            spg += b * b;
        }
        sp = block_sum_d(sp);
        spg = block_sum_d(spg);
        if (threadIdx.x == 0) {
            partials[((long long)blk * chunks + blockIdx.x) * 2] = sp;
            partials[((long long)blk * chunks + blockIdx.x) * 2 + 1] = spg;
        }
    }
}

// The grafting scale of every block, one thread each: scale[blk] = |pg| / (|p| + 1e-16) from
// the chunks partials of shampoo_graft_partials, summed in order (double).
extern "C" __global__ void shampoo_graft_scale(const double* __restrict__ partials, double* __restrict__ scale,
                                               int nblocks, int chunks) {
    for (long long blk = gtid(); blk < nblocks; blk += gstride()) {
        double sp = 0.0, spg = 0.0;
        for (int c = 0; c < chunks; ++c) {
            sp += partials[(blk * chunks + c) * 2];
            spg += partials[(blk * chunks + c) * 2 + 1];
        }
        scale[blk] = sqrt(spg) / (sqrt(sp) + 1e-16);
    }
}

// Plan op Graft (ops/shampoo.rs `graft`): out = (float)(x * scale[block of the element]) with
// the double product, over the whole parameter (n = vm * vn elements).
extern "C" __global__ void shampoo_graft_apply(const float* __restrict__ x, const double* __restrict__ scale,
                                               float* __restrict__ out, long long n, int vn, int bsz, int nbc) {
    for (long long i = gtid(); i < n; i += gstride()) {
        const long long r = i / vn, c = i % vn;
        out[i] = (float)((double)x[i] * scale[(r / bsz) * nbc + c / bsz]);
    }
}

// The weight update over the whole parameter (n = vm * vn elements): with scale,
// q = (float)(p * scale[block of the element]) (double product), else q = p; then
// w = w - lr * (q + wd * w).
extern "C" __global__ void shampoo_apply(float* __restrict__ param, const float* __restrict__ p,
                                         const double* __restrict__ scale, long long n, int vn, int bsz,
                                         int nbc, float lr, float wd) {
    for (long long i = gtid(); i < n; i += gstride()) {
        float q = p[i];
        if (scale) {
            const long long r = i / vn, c = i % vn;
            q = (float)((double)q * scale[(r / bsz) * nbc + c / bsz]);
        }
        const float w = param[i];
        param[i] = w - lr * (q + wd * w);
    }
}

