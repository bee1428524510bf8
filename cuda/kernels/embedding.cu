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
// launches on one stream, with `span` int [2 * vocab] scratch:
// embedding_backward_span_init: span = (INT_MAX, -1) per table row;
// embedding_backward_span: per token, the first and last position of its id (integer atomics:
//   their results do not depend on the order); an id outside [0, vocab) records its row in
//   status[0] and is skipped;
// embedding_backward_rows: writes every table row (zeros where no token has its id), so dtable
//   needs no clearing first. Grid (vocab, column tiles), block of EMB_T threads (a multiple of
//   32, <= 1024); thread t of tile y owns the columns y * 4 * EMB_T + t + u * EMB_T, u < 4, and
//   keeps their sums in registers. The block walks [first, last] in chunks of EMB_T positions:
//   each chunk's hits are compacted in position order into shared memory (warp ballots and a
//   prefix over the warps' counts), then every thread adds the hit rows of its columns. The loads
//   of successive hit rows are independent, so a frequent token's many rows stream in together
//   (the block-serial version, one read-modify-write of the table row per hit, took 0.97 ms for
//   7 ids over 5003 tokens of 1025 columns).
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

#define EMB_COLS 4
extern "C" __global__ void embedding_backward_rows(const float* __restrict__ dout, const int* __restrict__ ids,
                                                   const int* __restrict__ span, float* __restrict__ dtable,
                                                   int c) {
    __shared__ int pos[1024];
    __shared__ int warp_hits[32];
    const int v = blockIdx.x;
    const int first = span[2 * (long long)v], last = span[2 * (long long)v + 1];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, warps = blockDim.x >> 5;
    const int j0 = blockIdx.y * EMB_COLS * blockDim.x + t;
    float acc[EMB_COLS];
#pragma unroll
    for (int u = 0; u < EMB_COLS; ++u) acc[u] = 0.0f;
    for (int base = first; base <= last; base += blockDim.x) {
        const int i = base + t;
        const bool h = i <= last && ids[i] == v;
        const unsigned m = __ballot_sync(0xffffffffu, h);
        if (lane == 0) warp_hits[warp] = __popc(m);
        __syncthreads();
        int before = 0, total = 0;
        for (int w = 0; w < warps; ++w) {
            const int k = warp_hits[w];
            before += w < warp ? k : 0;
            total += k;
        }
        if (h) pos[before + __popc(m & ((1u << lane) - 1u))] = i;
        __syncthreads();
#pragma unroll 4
        for (int k = 0; k < total; ++k) {
            const float* g = dout + (long long)pos[k] * c;
#pragma unroll
            for (int u = 0; u < EMB_COLS; ++u) {
                const int j = j0 + u * blockDim.x;
                if (j < c) acc[u] += g[j];
            }
        }
        __syncthreads();
    }
    float* d = dtable + (long long)v * c;
#pragma unroll
    for (int u = 0; u < EMB_COLS; ++u) {
        const int j = j0 + u * blockDim.x;
        if (j < c) d[j] = acc[u];
    }
}
