"""Anchor measurements on the GPU machine: ceilings, eigensolver costs, and
GPT-2-small training step times with AdamW vs the reference SOAP optimizer.
Run on the GPU machine: python3 torch_baseline.py [ceil] [eigh] [train] [big] [llama] [huge] [--quick]
(modes train, big, llama and huge give the PyTorch rows of BENCHMARKS.md's paper-scale table).
The SOAP runs need the reference soap.py (nikhilvyas/SOAP) importable from ../.ext,
../.gpu/.ext (bench/prepare-gpu puts it there) or PYTHONPATH;
never commit that file.
Prints one JSON object per measurement line, prefix 'RESULT '."""
import json, math, os, sys, time
import numpy as np
import torch, torch.nn as nn, torch.nn.functional as F

for _ext in (("..", ".ext"), ("..", ".gpu", ".ext")):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *_ext))
QUICK = "--quick" in sys.argv
dev = "cuda"

def out(**kw):
    print("RESULT " + json.dumps(kw), flush=True)

def timed(fn, iters=10, warm=3):
    for _ in range(warm): fn()
    torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(iters):
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    return float(np.median(ts))

def ceilings():
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16); b = torch.randn_like(a)
    ms = timed(lambda: a @ b)
    out(what="bf16_matmul_8192", ms=ms, tflops=2*n**3/ms/1e9)
    a32 = a.float(); b32 = b.float()
    torch.backends.cuda.matmul.allow_tf32 = False
    ms = timed(lambda: a32 @ b32, iters=5)
    out(what="fp32_matmul_8192", ms=ms, tflops=2*n**3/ms/1e9)
    torch.backends.cuda.matmul.allow_tf32 = True
    ms = timed(lambda: a32 @ b32, iters=5)
    out(what="tf32_matmul_8192", ms=ms, tflops=2*n**3/ms/1e9)
    x = torch.empty(2**30, device=dev, dtype=torch.float32); y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x))
    out(what="d2d_copy_4GiB", ms=ms, GBps=2*x.numel()*4/ms/1e6)
    h = torch.empty(2**28, dtype=torch.float32).pin_memory(); d = torch.empty(2**28, device=dev)
    ms = timed(lambda: d.copy_(h, non_blocking=True))
    out(what="h2d_pinned_1GiB", ms=ms, GBps=h.numel()*4/ms/1e6)
    ms = timed(lambda: h.copy_(d, non_blocking=True))
    out(what="d2h_pinned_1GiB", ms=ms, GBps=h.numel()*4/ms/1e6)
    hp = torch.empty(2**28, dtype=torch.float32)
    ms = timed(lambda: d.copy_(hp), iters=3)
    out(what="h2d_pageable_1GiB", ms=ms, GBps=hp.numel()*4/ms/1e6)
    del a, b, a32, b32, x, y, d

def eigh_costs():
    sizes = [768, 1024, 2048, 3072, 4096] if not QUICK else [768, 2048]
    for n in sizes:
        g = torch.randn(n, 4 * n, device=dev)
        m = g @ g.T / (4 * n)
        ms = timed(lambda: torch.linalg.eigh(m), iters=3, warm=1)
        out(what="gpu_eigh_fp32", n=n, ms=ms)
        q = torch.linalg.eigh(m)[1]
        ms = timed(lambda: torch.linalg.qr(m @ q), iters=3, warm=1)
        out(what="gpu_powiter_qr_fp32", n=n, ms=ms)
        mc = m.double().cpu().numpy()
        for dt in (np.float32, np.float64):
            mm = mc.astype(dt)
            t = time.perf_counter(); np.linalg.eigh(mm); t1 = time.perf_counter() - t
            t = time.perf_counter(); np.linalg.eigh(mm); t2 = time.perf_counter() - t
            out(what="cpu_numpy_eigh", dtype=str(np.dtype(dt)), n=n, ms=1e3 * min(t1, t2), threads=os.cpu_count())

# ---- a small GPT (GPT-2 124M shape), written for this measurement ----
class Block(nn.Module):
    def __init__(s, d, h):
        super().__init__()
        s.ln1 = nn.LayerNorm(d); s.attn = nn.Linear(d, 3 * d); s.proj = nn.Linear(d, d)
        s.ln2 = nn.LayerNorm(d); s.fc = nn.Linear(d, 4 * d); s.out = nn.Linear(4 * d, d); s.h = h
    def forward(s, x):
        B, T, C = x.shape
        q, k, v = s.attn(s.ln1(x)).split(C, dim=2)
        q, k, v = [t.view(B, T, s.h, C // s.h).transpose(1, 2) for t in (q, k, v)]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + s.proj(y)
        return x + s.out(F.gelu(s.fc(s.ln2(x)), approximate="tanh"))

class GPT(nn.Module):
    def __init__(s, V=50304, T=1024, L=12, d=768, h=12):
        super().__init__()
        s.wte = nn.Embedding(V, d); s.wpe = nn.Embedding(T, d)
        s.blocks = nn.ModuleList([Block(d, h) for _ in range(L)]); s.lnf = nn.LayerNorm(d)
        s.head = nn.Linear(d, V, bias=False); s.head.weight = s.wte.weight
    def forward(s, idx, tgt):
        x = s.wte(idx) + s.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in s.blocks: x = b(x)
        logits = s.head(s.lnf(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), tgt.view(-1))


# ---- a LLaMA/OLMo-style model (RMSNorm, RoPE, SwiGLU, no bias, untied head), written for this measurement ----
class RMSNorm(nn.Module):
    def __init__(s, d, eps=1e-5):
        super().__init__(); s.w = nn.Parameter(torch.ones(d)); s.eps = eps
    def forward(s, x):
        return s.w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + s.eps)).type_as(x)

def rope(x, theta=10000.0):
    B, H, T, D = x.shape
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, device=x.device).float() / D))
    f = torch.outer(torch.arange(T, device=x.device).float(), inv)
    cos, sin = f.cos()[None, None].to(x.dtype), f.sin()[None, None].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

class LBlock(nn.Module):
    def __init__(s, d, h, m):
        super().__init__()
        s.n1 = RMSNorm(d); s.q = nn.Linear(d, d, bias=False); s.k = nn.Linear(d, d, bias=False)
        s.v = nn.Linear(d, d, bias=False); s.o = nn.Linear(d, d, bias=False)
        s.n2 = RMSNorm(d); s.g = nn.Linear(d, m, bias=False); s.u = nn.Linear(d, m, bias=False)
        s.dn = nn.Linear(m, d, bias=False); s.h = h
    def forward(s, x):
        B, T, C = x.shape
        y = s.n1(x)
        q, k, v = [t(y).view(B, T, s.h, C // s.h).transpose(1, 2) for t in (s.q, s.k, s.v)]
        a = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + s.o(a)
        y = s.n2(x)
        return x + s.dn(F.silu(s.g(y)) * s.u(y))

class Llama(nn.Module):
    def __init__(s, V=50304, L=24, d=2048, h=16, m=5632):
        super().__init__()
        s.emb = nn.Embedding(V, d); s.blocks = nn.ModuleList([LBlock(d, h, m) for _ in range(L)])
        s.nf = RMSNorm(d); s.head = nn.Linear(d, V, bias=False)
    def forward(s, idx, tgt):
        x = s.emb(idx)
        for b in s.blocks: x = b(x)
        logits = s.head(s.nf(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), tgt.view(-1))

def train_steps(opt_name, L=12, d=768, h=12, B=16, T=1024, steps=60, warm=12, compile_=False, pf=10, mpd=10000, family="gpt", m=None, tf32=False):
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    model = (GPT(L=L, d=d, h=h) if family == "gpt" else Llama(L=L, d=d, h=h, m=m)).to(dev)
    nparams = sum(p.numel() for p in model.parameters())
    if opt_name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    else:
        from soap import SOAP
        opt = SOAP(model.parameters(), lr=3e-3, betas=(0.95, 0.95), weight_decay=0.01, precondition_frequency=pf, max_precond_dim=mpd)
    fwd = torch.compile(model) if compile_ else model
    torch.cuda.reset_peak_memory_stats()
    x = torch.randint(0, 50257, (B, T), device=dev); y = torch.randint(0, 50257, (B, T), device=dev)
    ts = []; losses = []
    for i in range(warm + steps):
        torch.cuda.synchronize(); t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(); dt = time.perf_counter() - t
        if i >= warm: ts.append(dt * 1e3); losses.append(loss.item())
    ts = np.array(ts)
    out(what="gpt_train", family=family, tf32=tf32, opt=opt_name, compile=compile_, L=L, d=d, params=nparams, B=B, T=T, pf=pf, mpd=mpd,
        median_ms=float(np.median(ts)), p90_ms=float(np.percentile(ts, 90)), p99_ms=float(np.percentile(ts, 99)),
        max_ms=float(ts.max()), tokens_per_s=B * T / (np.median(ts) / 1e3), mean_ms=float(ts.mean()),
        peak_mem_GiB=torch.cuda.max_memory_allocated() / 2**30, last_loss=losses[-1])
    del model, opt, fwd; torch.cuda.empty_cache()

if __name__ == "__main__":
    out(what="env", gpu=torch.cuda.get_device_name(0), torch=torch.__version__, cpus=os.cpu_count())
    what = [a for a in sys.argv[1:] if not a.startswith("--")] or ["ceil", "eigh", "train"]
    if "ceil" in what: ceilings()
    if "eigh" in what: eigh_costs()
    if "big" in what:
        for mpd in (2048, 10000):
            try:
                train_steps("soap", L=16, d=2048, h=16, B=4, steps=30, warm=11, mpd=mpd)
            except Exception as e:
                out(what="gpt_train_fail", L=16, d=2048, mpd=mpd, err=str(e)[:200]); torch.cuda.empty_cache()
        train_steps("adamw", L=16, d=2048, h=16, B=4, steps=30, warm=5)
    if "llama" in what:
        for kw in (dict(opt_name="adamw"), dict(opt_name="adamw", compile_=True), dict(opt_name="soap", mpd=2048, tf32=True)):
            try:
                train_steps(family="llama", L=24, d=2048, h=16, m=5632, B=4, steps=30, warm=10, **kw)
            except Exception as e:
                out(what="gpt_train_fail", family="llama", cfg=str(kw), err=str(e)[:300]); torch.cuda.empty_cache()
        train_steps("adamw", L=16, d=2048, h=16, B=4, steps=30, warm=10, compile_=True)
    if "huge" in what:
        for kw in (dict(opt_name="adamw"), dict(opt_name="soap", mpd=4096, tf32=True), dict(opt_name="soap", mpd=2048, tf32=True)):
            try:
                train_steps(family="llama", L=32, d=4096, h=32, m=11008, B=1, steps=4, warm=3, **kw)
            except Exception as e:
                out(what="gpt_train_fail", family="llama7b", cfg=str(kw), err=str(e)[:300])
            import gc; gc.collect(); torch.cuda.empty_cache()
    if "train" in what:
        train_steps("adamw")
        train_steps("soap")
        train_steps("soap", pf=100)
        if not QUICK:
            train_steps("adamw", compile_=True)
            train_steps("adamw", L=24, d=1024, h=16, B=8)   # GPT-2 medium 350M
            train_steps("soap", L=24, d=1024, h=16, B=8)
