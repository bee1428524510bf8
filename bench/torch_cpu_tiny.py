"""PyTorch reference for the CPU-engine benchmark: the same tiny GPT-2 as examples/tiny.asteria
(vocab 50257, context 64, d_model 64, 2 layers, 4 heads, MLP 256, tied embeddings, fp32),
batch 16x64 tokens, AdamW (fused=False, foreach), eager, on the CPU with a given thread count.
Prints one `RESULT {json}` line with the median step time and tokens/s over the timed steps.

usage: python3 bench/torch_cpu_tiny.py --threads 2 [--steps 30] [--warmup 5]
Random token ids are used: step time does not depend on the text."""
import argparse, json, math, os, time
import torch, torch.nn as nn, torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--warmup", type=int, default=5)
p.add_argument("--vocab", type=int, default=50257)
p.add_argument("--ctx", type=int, default=64)
p.add_argument("--d", type=int, default=64)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--mlp", type=int, default=256)
p.add_argument("--batch", type=int, default=16)
a = p.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(0)

class Block(nn.Module):
    def __init__(s):
        super().__init__()
        s.ln_1 = nn.LayerNorm(a.d); s.c_attn = nn.Linear(a.d, 3 * a.d); s.c_proj = nn.Linear(a.d, a.d)
        s.ln_2 = nn.LayerNorm(a.d); s.c_fc = nn.Linear(a.d, a.mlp); s.mlp_proj = nn.Linear(a.mlp, a.d)
    def forward(s, x):
        B, T, C = x.shape
        q, k, v = s.c_attn(s.ln_1(x)).split(C, dim=2)
        sh = lambda t: t.view(B, T, a.heads, C // a.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(sh(q), sh(k), sh(v), is_causal=True)
        x = x + s.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + s.mlp_proj(F.gelu(s.c_fc(s.ln_2(x)), approximate="tanh"))

class GPT(nn.Module):
    def __init__(s):
        super().__init__()
        s.wte = nn.Embedding(a.vocab, a.d); s.wpe = nn.Embedding(a.ctx, a.d)
        for w in (s.wte.weight, s.wpe.weight): nn.init.normal_(w, std=0.02)  # GPT-2 init, as asteria
        s.h = nn.ModuleList([Block() for _ in range(a.layers)]); s.ln_f = nn.LayerNorm(a.d)
    def forward(s, idx, tgt):
        x = s.wte(idx) + s.wpe(torch.arange(idx.shape[1]))
        for b in s.h: x = b(x)
        logits = s.ln_f(x) @ s.wte.weight.T
        return F.cross_entropy(logits.view(-1, a.vocab), tgt.view(-1))

m = GPT()
opt = torch.optim.AdamW(m.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
idx = torch.randint(0, a.vocab, (a.batch, a.ctx)); tgt = torch.randint(0, a.vocab, (a.batch, a.ctx))
ts = []
for i in range(a.warmup + a.steps):
    t0 = time.perf_counter()
    loss = m(idx, tgt); opt.zero_grad(set_to_none=True); loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step()
    if i >= a.warmup: ts.append((time.perf_counter() - t0) * 1e3)
ts.sort(); med = ts[len(ts) // 2]
print("RESULT " + json.dumps(dict(what="torch_cpu_tiny_adamw", threads=a.threads, torch=torch.__version__,
      median_step_ms=med, tokens_per_s=a.batch * a.ctx / med * 1e3, loss=loss.item())), flush=True)
