// SOAP's elementwise parts (plan op `SoapUpdate`; Vyas et al. 2024, reference soap.py). The
// projections G' = Q_L^T G Q_R and N = Q_L pre Q_R^T are cuBLAS GEMMs around these kernels.
#include <cuda_bf16.h>

// Adam in the eigenbasis, fused: m = b1 m + w1 g', v = b2 v + w2 g'^2, pre = m / (sqrt(v) + eps).
// pre_bf non-null: pre is written there as bf16 (round to nearest even, what cast_f32_bf16 does;
// the input of the bf16 back-projection GEMM) instead of as f32 into pre.
extern "C" __global__ void soap_adam_eigen(const float* __restrict__ gproj, float* __restrict__ exp_avg,
                                           float* __restrict__ exp_avg_sq, float* __restrict__ pre,
                                           __nv_bfloat16* __restrict__ pre_bf, long long n, float b1, float w1,
                                           float b2, float w2, float eps) {
    for (long long i = gtid(); i < n; i += gstride()) {
        const float g = gproj[i];
        const float m = exp_avg[i] * b1 + g * w1;
        const float v = exp_avg_sq[i] * b2 + g * g * w2;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        const float r = m / (sqrtf(v) + eps);
        if (pre_bf) {
            pre_bf[i] = __float2bfloat16_rn(r);
        } else {
            pre[i] = r;
        }
    }
}

// p += neg_step * u / divisor (divisor = *div when div is non-null: normalize_grads), then
// p += neg_decay * p when apply_decay (decoupled weight decay after the step, as soap.py).
extern "C" __global__ void soap_apply(float* __restrict__ param, const float* __restrict__ update, long long n,
                                      float neg_step, const float* __restrict__ div, int apply_decay, float neg_decay) {
    const float d = div ? *div : 1.0f;
    for (long long i = gtid(); i < n; i += gstride()) {
        float u = update[i];
        if (div) u = u / d;
        float p = param[i] + neg_step * u;
        if (apply_decay) p = p + neg_decay * p;
        param[i] = p;
    }
}
