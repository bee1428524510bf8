// Learned absolute position embeddings (plan ops `AddPositional`, `AddPositionalBackward`).
// x/out/dout [n, c] with n = batch * seq_len, pos/dpos [p, c], seq_len <= p.

// out[r, j] = x[r, j] + pos[r mod seq_len, j]; grid-stride over n*c elements.
extern "C" __global__ void add_positional(const float* __restrict__ x, const float* __restrict__ pos,
                                          float* __restrict__ out, long long total, int c, int seq_len) {
    for (long long i = gtid(); i < total; i += gstride()) {
        const long long r = i / c;
        const int j = (int)(i - r * c);
        const int t = (int)(r % seq_len);
        out[i] = x[i] + pos[(long long)t * c + j];
    }
}

// dpos[t, j] = sum_b dout[b*seq_len + t, j] for t < seq_len (b in order), 0 for t >= seq_len.
// Grid-stride over p*c elements of dpos; deterministic.
extern "C" __global__ void add_positional_backward(const float* __restrict__ dout, float* __restrict__ dpos,
                                                   long long total, int c, int seq_len, int batch) {
    for (long long i = gtid(); i < total; i += gstride()) {
        const long long t = i / c;
        const int j = (int)(i - t * c);
        float acc = 0.0f;
        if (t < seq_len) {
            for (int b = 0; b < batch; ++b) acc += dout[((long long)b * seq_len + t) * c + j];
        }
        dpos[i] = acc;
    }
}
