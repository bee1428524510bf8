// Token embedding lookup and its gradient (plan ops `Embedding`, `EmbeddingBackward`).
// table [vocab, c], ids i32 [n], out/dout [n, c], dtable [vocab, c].
// An id outside [0, vocab) records its row in status[0] (atomicMin; INT_MAX = none) and the
// row is filled with NaN (forward) or skipped (backward); the host reads the status word back.

// One block per row n; threads stride over columns.
extern "C" __global__ void embedding_forward(const float* __restrict__ table, const int* __restrict__ ids,
                                             float* __restrict__ out, int n, int c, int vocab, int* status) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const int id = ids[row];
    float* o = out + (long long)row * c;
    if (id < 0 || id >= vocab) {
        if (threadIdx.x == 0) atomicMin(status, row);
        for (int j = threadIdx.x; j < c; j += blockDim.x) o[j] = ASTERIA_NAN;
        return;
    }
    const float* t = table + (long long)id * c;
    for (int j = threadIdx.x; j < c; j += blockDim.x) o[j] = t[j];
}

// dtable must be zeroed first (the launcher does it on the same stream). One block per row n,
// scatter-add with float atomics (order of additions into a shared table row is unspecified).
extern "C" __global__ void embedding_backward(const float* __restrict__ dout, const int* __restrict__ ids,
                                              float* dtable, int n, int c, int vocab, int* status) {
    const int row = blockIdx.x;
    if (row >= n) return;
    const int id = ids[row];
    if (id < 0 || id >= vocab) {
        if (threadIdx.x == 0) atomicMin(status, row);
        return;
    }
    const float* g = dout + (long long)row * c;
    float* d = dtable + (long long)id * c;
    for (int j = threadIdx.x; j < c; j += blockDim.x) atomicAdd(d + j, g[j]);
}
