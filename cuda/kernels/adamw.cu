// AdamW, PyTorch torch.optim.AdamW single-tensor semantics (plan op `AdamW`; Loshchilov &
// Hutter 2019), fused over param, grad, exp_avg, exp_avg_sq (all length n), in place:
//   p *= decay (decay = 1 - lr*wd, skipped when wd == 0)
//   m = lerp(m, g, w1) (torch.lerp's two-branch formula), v = beta2 v + w2 g^2
//   p -= step_size * m / (sqrt(v) / bc2_sqrt + eps)
// with w1 = 1 - beta1, w2 = 1 - beta2, step_size = lr / (1 - beta1^t), bc2_sqrt =
// sqrt(1 - beta2^t), all computed on the host in double.
__device__ __forceinline__ void adamw_one(float g, float& p, float& m, float& v, float decay, int apply_decay, float w1,
                                          float beta2, float w2, float step_size, float bc2_sqrt, float eps) {
    if (apply_decay) p = p * decay;
    m = w1 < 0.5f ? m + w1 * (g - m) : g - (g - m) * (1.0f - w1);
    v = v * beta2 + w2 * g * g;
    const float denom = sqrtf(v) / bc2_sqrt + eps;
    p = p - step_size * (m / denom);
}

// float4 steps where all four operands are 16-byte aligned; the same per-element arithmetic.
// grad_scale (nullable): a clip factor on the device (grad_norm_finalize's); the update reads
// grad * factor, the value an in-place clip (scale_by_device_scalar) would have stored.
extern "C" __global__ void adamw_step(float* __restrict__ param, const float* __restrict__ grad,
                                      float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq, long long n,
                                      float decay, int apply_decay, float w1, float beta2, float w2,
                                      float step_size, float bc2_sqrt, float eps,
                                      const float* __restrict__ grad_scale) {
    const float gs = grad_scale != nullptr ? *grad_scale : 1.0f;
    const bool vec = asteria_aligned(param, 16) && asteria_aligned(grad, 16) && asteria_aligned(exp_avg, 16) &&
                     asteria_aligned(exp_avg_sq, 16);
    const long long n4 = vec ? n / 4 : 0;
    for (long long i = gtid(); i < n4; i += gstride()) {
        float4 g = reinterpret_cast<const float4*>(grad)[i];
        if (gs != 1.0f) {
            g.x *= gs;
            g.y *= gs;
            g.z *= gs;
            g.w *= gs;
        }
        float4 p = reinterpret_cast<float4*>(param)[i];
        float4 m = reinterpret_cast<float4*>(exp_avg)[i];
        float4 v = reinterpret_cast<float4*>(exp_avg_sq)[i];
        adamw_one(g.x, p.x, m.x, v.x, decay, apply_decay, w1, beta2, w2, step_size, bc2_sqrt, eps);
        adamw_one(g.y, p.y, m.y, v.y, decay, apply_decay, w1, beta2, w2, step_size, bc2_sqrt, eps);
        adamw_one(g.z, p.z, m.z, v.z, decay, apply_decay, w1, beta2, w2, step_size, bc2_sqrt, eps);
        adamw_one(g.w, p.w, m.w, v.w, decay, apply_decay, w1, beta2, w2, step_size, bc2_sqrt, eps);
        reinterpret_cast<float4*>(exp_avg)[i] = m;
        reinterpret_cast<float4*>(exp_avg_sq)[i] = v;
        reinterpret_cast<float4*>(param)[i] = p;
    }
    for (long long i = 4 * n4 + gtid(); i < n; i += gstride()) {
        float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
        const float g = gs != 1.0f ? grad[i] * gs : grad[i];
        adamw_one(g, p, m, v, decay, apply_decay, w1, beta2, w2, step_size, bc2_sqrt, eps);
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        param[i] = p;
    }
}
