// AdamW, PyTorch torch.optim.AdamW single-tensor semantics (plan op `AdamW`; Loshchilov &
// Hutter 2019), fused over param, grad, exp_avg, exp_avg_sq (all length n), in place:
//   p *= decay (decay = 1 - lr*wd, skipped when wd == 0)
//   m = lerp(m, g, w1) (torch.lerp's two-branch formula), v = beta2 v + w2 g^2
//   p -= step_size * m / (sqrt(v) / bc2_sqrt + eps)
// with w1 = 1 - beta1, w2 = 1 - beta2, step_size = lr / (1 - beta1^t), bc2_sqrt =
// sqrt(1 - beta2^t), all computed on the host in double.
extern "C" __global__ void adamw_step(float* __restrict__ param, const float* __restrict__ grad,
                                      float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq, long long n,
                                      float decay, int apply_decay, float w1, float beta2, float w2,
                                      float step_size, float bc2_sqrt, float eps) {
    for (long long i = gtid(); i < n; i += gstride()) {
        const float g = grad[i];
        float p = param[i];
        if (apply_decay) p = p * decay;
        float m = exp_avg[i];
        m = w1 < 0.5f ? m + w1 * (g - m) : g - (g - m) * (1.0f - w1);
        const float v = exp_avg_sq[i] * beta2 + w2 * g * g;
        const float denom = sqrtf(v) / bc2_sqrt + eps;
        p = p - step_size * (m / denom);
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        param[i] = p;
    }
}
