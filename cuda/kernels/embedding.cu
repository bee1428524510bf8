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

// The gradient of the table, bitwise reproducible: every table row sums its tokens' rows of dout
// in increasing token order (float atomics would add them in an unspecified order). Three
// launches on one stream, with `span` int [2 * vocab] scratch and dtable zeroed first:
// embedding_backward_span_init: span = (INT_MAX, -1) per table row;
// embedding_backward_span: per token, the first and last position of its id (integer atomics:
//   their results do not depend on the order); an id outside [0, vocab) records its row in
//   status[0] and is skipped;
// embedding_backward_rows: one block per table row v with tokens, over [first, last] in chunks
//   of blockDim.x positions (blockDim.x <= 1024): the chunk's hits are flagged in shared memory
//   and added in position order, each thread owning the columns j = threadIdx.x (mod blockDim.x).
extern "C" __global__ void embedding_backward_span_init(int* __restrict__ span, int vocab) {
    for (long long v = (long long)blockIdx.x * blockDim.x + threadIdx.x; v < vocab;
         v += (long long)gridDim.x * blockDim.x) {
        span[2 * v] = 0x7fffffff;
        span[2 * v + 1] = -1;
    }
}

extern "C" __global__ void embedding_backward_span(const int* __restrict__ ids, int* __restrict__ span,
                                                   int n, int vocab, int* status) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int id = ids[i];
        if (id < 0 || id >= vocab) {
            atomicMin(status, i);
            continue;
        }
        atomicMin(span + 2 * (long long)id, i);
        atomicMax(span + 2 * (long long)id + 1, i);
    }
}

extern "C" __global__ void embedding_backward_rows(const float* __restrict__ dout, const int* __restrict__ ids,
                                                   const int* __restrict__ span, float* __restrict__ dtable,
                                                   int c) {
    __shared__ unsigned char hit[1024];
    const int v = blockIdx.x;
    const int first = span[2 * (long long)v], last = span[2 * (long long)v + 1];
    if (last < first) return;
    float* d = dtable + (long long)v * c;
    for (int base = first; base <= last; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const bool h = i <= last && ids[i] == v;
        hit[threadIdx.x] = h;
        if (!__syncthreads_or(h)) continue;
        const int end = min((int)blockDim.x, last - base + 1);
        for (int k = 0; k < end; ++k) {
            if (!hit[k]) continue;
            const float* g = dout + (long long)(base + k) * c;
            for (int j = threadIdx.x; j < c; j += blockDim.x) d[j] += g[j];
        }
        __syncthreads();
    }
}
