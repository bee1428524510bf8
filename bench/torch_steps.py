"""Per-step timings of the PyTorch reference (bench/torch_baseline.py's GPT-2 124M and
its optimizers), written as asteria-style metrics JSONL ({"step","loss","step_ms"}) so that
`asteria plot --metric step_ms` and bench/summarize.py read both sides alike. Same model,
batch (16x1024), bf16 autocast, grad clip 1.0 and timing (synchronize around each step) as
torch_baseline.train_steps; the reference SOAP is nikhilvyas/SOAP soap.py (not committed:
bench/prepare-gpu puts it in .gpu/.ext, found from bench/ and from .gpu/bench/), frequency 10,
max_precond_dim 10000 (soap.py's default) unless --mpd N. Random token ids: step time does not
depend on the text, and the losses are not comparable with asteria's.
`kl` is the reference KL-Shampoo (KLOpt of yorkerlin/KL-Methods, optim/kl_opt.py, bf16
computation, found as kl_opt where soap.py is; never commit it): KLOpt takes every 2-D weight
but the embedding and LM head (it has no dimension cap: their 50304-wide side would need a
50304^2 factor), fused AdamW the rest (and the 1-D parameters, which KLOpt does not support),
lr 3e-3, betas (0.9, 0.98), frequency 10.
`shampoo` is the reference Shampoo (DistributedShampoo of facebookresearch/optimizers, the
`distributed_shampoo` package directory, found where soap.py is; never commit it) on every
parameter, as bench/specs/*-shampoo.asteria: lr 6e-4 (124M) / 3e-4 (the rest), betas (0.95, 0.95), epsilon 1e-8,
weight decay 0.01 (decoupled), blocks of 1024, frequency 10, Adam grafting (0.999, 1e-10).
Usage (GPU host, PyTorch with CUDA): python3 torch_steps.py {adamw|soap|kl|shampoo} STEPS OUT.jsonl [--tf32] [--compile] [--mpd N] [--model M] [--accum N]
  Writes OUT.jsonl, one line per step; prints the peak GPU memory. ~15 s plus STEPS steps
  (soap at 10000 in fp32: ~0.2 s a step).
  --tf32: torch.backends.cuda.matmul.allow_tf32 = True (fp32 matmuls on TF32 tensor cores, as
          asteria's `precision = bf16` runs SOAP's per-step GEMMs).
  --compile: the model's forward through torch.compile (default mode), as torch_baseline's
          compile row; the compilation happens in the first steps, which summarize.py skips.
  --accum N: gradient accumulation, N micro-batches (each the model's batch, the same random
          tokens) of (loss / N).backward() before each clip and optimizer step, as asteria's
          `train { grad_accum = N }`; tokens/s count every micro-batch.
  --mpd N: SOAP's max_precond_dim (2048 is the paper's setting: dimensions above it,
          here the 2304/3072 sides and the vocabulary, stay unrotated).
  --model M: gpt2-124m (default, batch 16), gpt-0.9b (d 2048, 16 layers, batch 4), llama-1.4b
          (d 2048, 24 layers, SwiGLU 5632, batch 4) or llama-6.9b (d 4096, 32 layers, SwiGLU
          11008, batch 1): the models of bench/specs/*.asteria and bench/h200-scale.sh, built as
          torch_baseline's `big`, `llama` and `huge` modes build them."""
import json, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
for ext in (("..", ".ext"), ("..", ".gpu", ".ext")):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *ext))
import torch_baseline as tb
torch = tb.torch

argv = sys.argv[1:]
mpd = 10000
accum = 1
if "--accum" in argv:
    k = argv.index("--accum"); accum = int(argv[k + 1]); del argv[k:k + 2]
if "--mpd" in argv:
    k = argv.index("--mpd"); mpd = int(argv[k + 1]); del argv[k:k + 2]
import torch_models
model_name, make_model, batch = torch_models.pop_model(argv)
pos = [a for a in argv if not a.startswith("--")]
opt_name, steps, out = pos[0], int(pos[1]), pos[2]
torch.backends.cuda.matmul.allow_tf32 = "--tf32" in sys.argv
dev = tb.dev
torch.manual_seed(0)
model = make_model().to(dev)
if opt_name == "adamw":
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
elif opt_name == "kl":
    from kl_opt import KLOpt
    mats = [p for p in model.parameters() if p.dim() == 2 and max(p.shape) <= 10000]
    ids = {id(p) for p in mats}
    rest = [p for p in model.parameters() if id(p) not in ids]
    kl = KLOpt(mats, lr=3e-3, betas=(0.9, 0.98), weight_decay=0.01, precondition_frequency=10)
    aux = torch.optim.AdamW(rest, lr=3e-3, betas=(0.9, 0.98), weight_decay=0.0, fused=True)
    class Both:
        """KLOpt on the matrices and AdamW on the rest, stepped together."""
        def step(self):
            kl.step(); aux.step()
        def zero_grad(self, set_to_none=True):
            kl.zero_grad(set_to_none=set_to_none); aux.zero_grad(set_to_none=set_to_none)
    opt = Both()
elif opt_name == "shampoo":
    from distributed_shampoo import AdamPreconditionerConfig, DistributedShampoo
    opt = DistributedShampoo(model.parameters(), lr=6e-4 if model_name == "gpt2-124m" else 3e-4,
                             betas=(0.95, 0.95), epsilon=1e-8,
                             weight_decay=0.01, max_preconditioner_dim=1024,
                             precondition_frequency=10,
                             grafting_config=AdamPreconditionerConfig(beta2=0.999, epsilon=1e-10))
else:
    from soap import SOAP
    opt = SOAP(model.parameters(), lr=3e-3, betas=(0.95, 0.95), weight_decay=0.01,
               precondition_frequency=10, max_precond_dim=mpd)
fwd = torch.compile(model) if "--compile" in sys.argv else model
B, T = batch, 1024
x = torch.randint(0, 50257, (B, T), device=dev); y = torch.randint(0, 50257, (B, T), device=dev)
torch.cuda.reset_peak_memory_stats()
with open(out, "w") as f:
    for i in range(1, steps + 1):
        torch.cuda.synchronize(); t = time.perf_counter()
        if accum == 1:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fwd(x, y)
            loss.backward()
        else:
            total = 0.0
            for _ in range(accum):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = fwd(x, y) / accum
                loss.backward()
                total += loss.detach()
            loss = total
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(); dt = (time.perf_counter() - t) * 1e3
        f.write(json.dumps({"step": i, "loss": loss.item(), "step_ms": dt, "tokens_per_s": accum * B * T / (dt / 1e3)}) + "\n")
free, total = torch.cuda.mem_get_info()
print("GPU peak used %.2f GiB" % (torch.cuda.max_memory_allocated() / 2**30))
# What the whole GPU held at the end (context + the caching allocator's reserve), the measure
# asteria's "GPU peak used" line takes (total - free, sampled).
print("device used at end %.2f GiB; allocator reserved peak %.2f GiB" % (
    (total - free) / 2**30, torch.cuda.max_memory_reserved() / 2**30))
print(json.dumps({"what": "torch_steps", "model": model_name, "opt": opt_name, "max_precond_dim": mpd, "tf32": torch.backends.cuda.matmul.allow_tf32,
                  "compile": "--compile" in sys.argv, "accum": accum,
                  "steps": steps, "peak_mem_GiB": torch.cuda.max_memory_allocated() / 2**30}))
