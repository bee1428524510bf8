// Causal multi-head self-attention helpers (plan ops `Attention`, `AttentionBackward`). The
// GEMMs (S = scale Q K^T, O = P V and the backward products) run in cuBLAS strided-batched
// sgemm over B*NH heads; these kernels permute between the fused GPT-2 layout and per-head
// [B, NH, T, hd] blocks and do the causal row softmax (forward and backward).
// qkv [B*T, 3C] = [q | k | v], heads contiguous within each; C = NH * hd.

// q, k, v [B, NH, T, hd] <- qkv. Grid-stride over B*NH*T*hd.
extern "C" __global__ void attn_split_qkv(const float* __restrict__ qkv, float* __restrict__ q, float* __restrict__ k,
                                          float* __restrict__ v, int batch, int seq_len, int n_heads, int hd) {
    const long long total = (long long)batch * n_heads * seq_len * hd;
    const int c = n_heads * hd;
    for (long long e = gtid(); e < total; e += gstride()) {
        const int d = (int)(e % hd);
        long long rest = e / hd;
        const int t = (int)(rest % seq_len);
        rest /= seq_len;
        const int h = (int)(rest % n_heads);
        const int b = (int)(rest / n_heads);
        const long long src = ((long long)b * seq_len + t) * 3 * c + h * hd + d;
        q[e] = qkv[src];
        k[e] = qkv[src + c];
        v[e] = qkv[src + 2 * c];
    }
}

// dqkv <- dq, dk, dv [B, NH, T, hd] (inverse of attn_split_qkv; overwrites all of dqkv).
extern "C" __global__ void attn_merge_qkv(const float* __restrict__ dq, const float* __restrict__ dk,
                                          const float* __restrict__ dv, float* __restrict__ dqkv, int batch,
                                          int seq_len, int n_heads, int hd) {
    const long long total = (long long)batch * n_heads * seq_len * hd;
    const int c = n_heads * hd;
    for (long long e = gtid(); e < total; e += gstride()) {
        const int d = (int)(e % hd);
        long long rest = e / hd;
        const int t = (int)(rest % seq_len);
        rest /= seq_len;
        const int h = (int)(rest % n_heads);
        const int b = (int)(rest / n_heads);
        const long long dst = ((long long)b * seq_len + t) * 3 * c + h * hd + d;
        dqkv[dst] = dq[e];
        dqkv[dst + c] = dk[e];
        dqkv[dst + 2 * c] = dv[e];
    }
}

// Between [B*T, C] (heads contiguous) and [B, NH, T, hd]: to_heads = 1 gathers x -> y,
// to_heads = 0 scatters y -> x. Grid-stride over B*T*C.
extern "C" __global__ void attn_permute_heads(float* __restrict__ x, float* __restrict__ y, int batch, int seq_len,
                                              int n_heads, int hd, int to_heads) {
    const long long total = (long long)batch * n_heads * seq_len * hd;
    const int c = n_heads * hd;
    for (long long e = gtid(); e < total; e += gstride()) {
        const int d = (int)(e % hd);
        long long rest = e / hd;
        const int t = (int)(rest % seq_len);
        rest /= seq_len;
        const int h = (int)(rest % n_heads);
        const int b = (int)(rest / n_heads);
        const long long flat = ((long long)b * seq_len + t) * c + h * hd + d;
        if (to_heads) y[e] = x[flat]; else x[flat] = y[e];
    }
}

// In place on s [rows, T] (rows = B*NH*T, row i of a head has position i mod T): p = softmax
// over columns j <= i, zeros above the diagonal. One block per row.
extern "C" __global__ void attn_softmax_causal(float* __restrict__ s, long long rows, int seq_len) {
    const long long row = blockIdx.x;
    if (row >= rows) return;
    const int i = (int)(row % seq_len);
    float* p = s + row * seq_len;
    float m = __int_as_float(0xff800000);
    for (int j = threadIdx.x; j <= i; j += blockDim.x) m = fmaxf(m, p[j]);
    m = block_max(m);
    float sum = 0.0f;
    for (int j = threadIdx.x; j <= i; j += blockDim.x) {
        const float e = expf(p[j] - m);
        p[j] = e;
        sum += e;
    }
    const float inv = 1.0f / block_sum(sum);
    for (int j = threadIdx.x; j < seq_len; j += blockDim.x) p[j] = j <= i ? p[j] * inv : 0.0f;
}

// In place on dp [rows, T]: ds = p * (dp - sum_{j<=i} p_j dp_j), zeros above the diagonal.
extern "C" __global__ void attn_softmax_causal_backward(const float* __restrict__ p, float* __restrict__ dp,
                                                        long long rows, int seq_len) {
    const long long row = blockIdx.x;
    if (row >= rows) return;
    const int i = (int)(row % seq_len);
    const float* pr = p + row * seq_len;
    float* dr = dp + row * seq_len;
    float dot = 0.0f;
    for (int j = threadIdx.x; j <= i; j += blockDim.x) dot += pr[j] * dr[j];
    dot = block_sum(dot);
    for (int j = threadIdx.x; j < seq_len; j += blockDim.x) dr[j] = j <= i ? pr[j] * (dr[j] - dot) : 0.0f;
}
