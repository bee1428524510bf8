"""Would batching same-sized refreshes pay? (session 8 probe, PyTorch on the H200.)

rc-tc's refresh at d = 3072 spends 64% of its 12 ms in cuSOLVER's Spotrf and cuBLAS's Strsm
(BENCHMARKS.md session 7), both latency-bound at this size: a blocked factorisation is a chain
of d/nb panel steps whatever the flop rate. GPT-2 124M has 12 factors of each large size
(2304: attention qkv left; 3072: MLP fc left, MLP proj right), refreshed once per period. If
the 12 ran as one batch, each panel step would carry 12 matrices for about the latency of one.
This script times, on factor-like SPD matrices (eigenvalues log-spaced over 9 decades, a random
eigenbasis), medians over repetitions with CUDA events:

- `torch.linalg.cholesky` one matrix at a time vs one batched call;
- a right-looking blocked Cholesky written here over the whole batch (diagonal blocks by the
  batched small-matrix Cholesky, panels by a triangular solve, trailing update by `baddbmm`),
  in fp32 and with TF32 trailing updates, and its accuracy against float64;
- `torch.linalg.solve_triangular` one at a time vs batched;
- `torch.linalg.qr` one at a time (the Householder refresh) for scale.

Usage: python3 bench/batched_chol_probe.py [--sizes 2304,3072] [--batch 12] [--reps 5]
Prints one markdown table; nothing here runs in asteria itself.
"""

import argparse
import statistics
import time

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def timed(fn, reps):
    ts = []
    for _ in range(reps + 1):
        if DEV == "cpu":  # local smoke run only
            t0 = time.perf_counter()
            fn()
            ts.append(1e3 * (time.perf_counter() - t0))
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts[1:])


def factors(batch, n, gen):
    q, _ = torch.linalg.qr(torch.randn(batch, n, n, device=DEV, dtype=torch.float64, generator=gen))
    lam = torch.logspace(0, -9, n, device=DEV, dtype=torch.float64)
    f = (q * lam) @ q.transpose(-1, -2)
    return (f + 1e-6 * lam[0] * torch.eye(n, device=DEV, dtype=torch.float64)).float()


def blocked_cholesky(a, nb, tf32):
    """Lower Cholesky of every matrix in `a` ([B, n, n], fp32, overwritten), right-looking."""
    n = a.shape[-1]
    torch.backends.cuda.matmul.allow_tf32 = tf32
    for k in range(0, n, nb):
        e = min(k + nb, n)
        lkk = torch.linalg.cholesky(a[:, k:e, k:e])
        a[:, k:e, k:e] = lkk
        if e < n:
            # L21 = A21 L11^{-T}: solve X L11ᵀ = A21.
            l21 = torch.linalg.solve_triangular(lkk.transpose(-1, -2), a[:, e:, k:e], upper=True, left=False)
            a[:, e:, k:e] = l21
            a[:, e:, e:].baddbmm_(l21, l21.transpose(-1, -2), alpha=-1.0)
    torch.backends.cuda.matmul.allow_tf32 = False
    return a.tril_()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="2304,3072")
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device=DEV).manual_seed(0)
    print(f"device: {torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu'}, torch {torch.__version__}, batch {args.batch}")
    print("| n | what | ms for the batch | ms per matrix | rel. error vs f64 |")
    print("|---|---|---|---|---|")
    for n in [int(s) for s in args.sizes.split(",")]:
        f = factors(args.batch, n, gen)
        ref = torch.linalg.cholesky(f.double())

        def err(l):
            return ((l.double() - ref).norm() / ref.norm()).item()

        def row(what, ms, e=float("nan")):
            print(f"| {n} | {what} | {ms:.2f} | {ms / args.batch:.3f} | {e:.1e} |")

        row("cholesky, one at a time", timed(lambda: [torch.linalg.cholesky(f[i]) for i in range(args.batch)], args.reps),
            err(torch.stack([torch.linalg.cholesky(f[i]) for i in range(args.batch)])))
        row("cholesky, one batched call", timed(lambda: torch.linalg.cholesky(f), args.reps), err(torch.linalg.cholesky(f)))
        for nb in (128, 256, 512):
            for tf32 in (False, True):
                w = f.clone()
                ms = timed(lambda: blocked_cholesky(w.copy_(f), nb, tf32), args.reps)
                row(f"blocked batched, nb={nb}, {'tf32' if tf32 else 'fp32'} updates", ms, err(blocked_cholesky(f.clone(), nb, tf32)))
        l = torch.linalg.cholesky(f)
        x = torch.randn(args.batch, n, n, device=DEV, generator=gen)
        row("trsm, one at a time", timed(lambda: [torch.linalg.solve_triangular(l[i], x[i], upper=False) for i in range(args.batch)], args.reps))
        row("trsm, one batched call", timed(lambda: torch.linalg.solve_triangular(l, x, upper=False), args.reps))
        row("bmm fp32 (one GEMM per matrix, batched)", timed(lambda: torch.bmm(x, x), args.reps))
        torch.backends.cuda.matmul.allow_tf32 = True
        row("bmm tf32 (batched)", timed(lambda: torch.bmm(x, x), args.reps))
        torch.backends.cuda.matmul.allow_tf32 = False
        row("Householder qr, one at a time", timed(lambda: [torch.linalg.qr(x[i]) for i in range(args.batch)], 2))
        del f, ref, x, l
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
