// Rotary position embedding, LLaMA rotate-half layout (plan ops `Rope`, `RopeBackward`;
// Su et al. 2021). x/out [n, width]; the first rotated_cols columns are rotated in chunks of
// head_dim = 2h: for i < h, out1 = x1 cos(a) - x2 sin(a), out2 = x2 cos(a) + x1 sin(a) with
// a = sign * p * theta^(-2i/head_dim), p = row mod seq_len; other columns are copied.
// The angle and its sine/cosine are computed in double (like the CPU tables) then rounded.
extern "C" __global__ void rope_rotate(const float* __restrict__ x, float* __restrict__ out, long long total,
                                       int width, int seq_len, int head_dim, int rotated_cols, double theta,
                                       float sign) {
    const int h = head_dim / 2;
    for (long long e = gtid(); e < total; e += gstride()) {
        const long long r = e / width;
        const int j = (int)(e - r * width);
        if (j >= rotated_cols) {
            out[e] = x[e];
            continue;
        }
        const int base = (j / head_dim) * head_dim;
        const int k = j - base;
        const int i = k < h ? k : k - h;
        const double freq = pow(theta, -2.0 * (double)i / (double)head_dim);
        const double a = (double)(r % seq_len) * freq;
        double sd, cd;
        sincos(a, &sd, &cd);
        const float c = (float)cd;
        const float s = sign * (float)sd;
        const float* xr = x + r * width + base;
        const float x1 = xr[i], x2 = xr[h + i];
        out[e] = k < h ? x1 * c - x2 * s : x2 * c + x1 * s;
    }
}
