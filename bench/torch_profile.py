"""Where the PyTorch reference's AdamW step spends its GPU time, and how fast cuBLAS
runs the model's GEMM shapes on their own: the yardstick for asteria's per-op profile
(`asteria train SPEC --profile events`; bench/h200-async.sh --profile runs both).

Usage (GPU host, PyTorch with CUDA): python3 torch_profile.py [STEPS] [--model M]   (~1 minute;
prints two markdown tables)
  --model: one of bench/torch_models.py (gpt2-124m, the default, batch 16x1024; gpt-0.9b,
     llama-1.4b, llama-6.9b).
  1. torch.profiler over STEPS (default 5) eager AdamW steps of the model (bf16 autocast, fused
     AdamW, grad clip 1.0): the CUDA kernels by total time, and the share of GEMM kernels.
  2. Each linear layer's GEMM shapes of one training step (forward y = x Wᵀ, backward dx = dy W
     and dW = dyᵀ x, M = batch x 1024 tokens) timed alone with bf16 operands, bf16 and fp32
     output (torch.mm(..., out_dtype=torch.float32) where this PyTorch has it): median of 20,
     TFLOP/s.
"""
import os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_baseline as tb
torch = tb.torch

import torch_models
argv = sys.argv[1:]
model_name, make_model, batch = torch_models.pop_model(argv)
steps = int(argv[0]) if argv else 5
dev = tb.dev
torch.manual_seed(0)
model = make_model().to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
B, T = batch, 1024
x = torch.randint(0, 50257, (B, T), device=dev); y = torch.randint(0, 50257, (B, T), device=dev)


def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad(set_to_none=True)


for _ in range(5):
    step()
torch.cuda.synchronize()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
ev = [e for e in prof.key_averages() if e.device_time_total > 0]
total = sum(e.device_time_total for e in ev)
gemm = sum(e.device_time_total for e in ev if any(k in e.key.lower() for k in ("gemm", "sm90_xmma", "cutlass", "nvjet")))
print(f"torch eager AdamW step, {model_name} batch {B}x{T}: GPU kernel time {total / 1e3 / steps:.2f} ms per step, GEMM kernels {gemm / 1e3 / steps:.2f} ms ({100 * gemm / total:.0f}%)")
print("| kernel | calls/step | ms/step |")
print("|---|---|---|")
for e in sorted(ev, key=lambda e: -e.device_time_total)[:30]:
    print(f"| {e.key[:90]} | {e.count / steps:.0f} | {e.device_time_total / 1e3 / steps:.3f} |")


def timed(fn, iters=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


M = B * T
bf = torch.bfloat16
print("\n| GEMM (m x k . k x n) | role | bf16 out ms | TFLOP/s | fp32 out ms | TFLOP/s |")
print("|---|---|---|---|---|---|")
tot16 = tot32 = 0.0
# Each distinct linear shape of the model (nn.Linear weights [out, in]) and how many layers use it.
shapes = {}
for name, mod in model.named_modules():
    if isinstance(mod, torch.nn.Linear):
        key = (mod.in_features, mod.out_features)
        shapes.setdefault(key, [name.split(".")[-1], 0])[1] += 1
for (cin, cout), (name, n) in shapes.items():
    X = torch.randn(M, cin, device=dev, dtype=bf); W = torch.randn(cout, cin, device=dev, dtype=bf)
    dY = torch.randn(M, cout, device=dev, dtype=bf)
    for role, a, b in [("fwd x Wt", X, W.t()), ("bwd dy W", dY, W), ("bwd dyt x", dY.t(), X)]:
        flop = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        t16 = timed(lambda: torch.mm(a, b))
        try:
            t32 = timed(lambda: torch.mm(a, b, out_dtype=torch.float32))
        except Exception:
            t32 = float("nan")
        tot16 += n * t16; tot32 += n * t32
        print(f"| {a.shape[0]}x{a.shape[1]} . {b.shape[0]}x{b.shape[1]} | {name} x{n} {role} | {t16:.3f} | {flop / t16 / 1e9:.0f} | {t32:.3f} | {flop / t32 / 1e9:.0f} |")
print(f"one training step's linear GEMMs: bf16 out {tot16:.2f} ms, fp32 out {tot32:.2f} ms")
