// Mean softmax cross-entropy over rows of logits (plan ops `CrossEntropy`,
// `CrossEntropyBackward`). logits/dlogits [n, v], targets i32 [n]. A target outside [0, v)
// records its row in status[0] (atomicMin) and gives a NaN row loss / NaN gradient row.

// row_loss[r] = logsumexp(logits[r, :]) - logits[r, targets[r]] (double). One block per row.
extern "C" __global__ void xent_row_loss(const float* __restrict__ logits, const int* __restrict__ targets,
                                         double* __restrict__ row_loss, int n, int v, int* status) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const float* x = logits + (long long)row * v;
    const int t = targets[row];
    float m = __int_as_float(0xff800000);
    for (int j = threadIdx.x; j < v; j += blockDim.x) m = fmaxf(m, x[j]);
    m = block_max(m);
    float s = 0.0f;
    for (int j = threadIdx.x; j < v; j += blockDim.x) s += expf(x[j] - m);
    s = block_sum(s);
    if (threadIdx.x == 0) {
        if (t < 0 || t >= v) {
            atomicMin(status, row);
            row_loss[row] = __longlong_as_double(0x7ff8000000000000ll);
        } else {
            row_loss[row] = (double)m + log((double)s) - (double)x[t];
        }
    }
}

// loss[0] = (1/n) sum_r row_loss[r], in double, fixed order. Launch with one block.
extern "C" __global__ void xent_mean(const double* __restrict__ row_loss, float* __restrict__ loss, int n) {
    double acc = 0.0;
    for (int r = threadIdx.x; r < n; r += blockDim.x) acc += row_loss[r];
    acc = block_sum_d(acc);
    if (threadIdx.x == 0) loss[0] = n > 0 ? (float)(acc / (double)n) : 0.0f;
}

// dlogits = (softmax(logits) - onehot(targets)) * inv_n. One block per row.
extern "C" __global__ void xent_backward(const float* __restrict__ logits, const int* __restrict__ targets,
                                         float* __restrict__ dlogits, int n, int v, float inv_n, int* status) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const float* x = logits + (long long)row * v;
    float* d = dlogits + (long long)row * v;
    const int t = targets[row];
    if (t < 0 || t >= v) {
        if (threadIdx.x == 0) atomicMin(status, row);
        for (int j = threadIdx.x; j < v; j += blockDim.x) d[j] = ASTERIA_NAN;
        return;
    }
    float m = __int_as_float(0xff800000);
    for (int j = threadIdx.x; j < v; j += blockDim.x) m = fmaxf(m, x[j]);
    m = block_max(m);
    float s = 0.0f;
    for (int j = threadIdx.x; j < v; j += blockDim.x) s += expf(x[j] - m);
    const float k = inv_n / block_sum(s);
    for (int j = threadIdx.x; j < v; j += blockDim.x) d[j] = expf(x[j] - m) * k - (j == t ? inv_n : 0.0f);
}
