"""Does rc-tc's Newton-Schulz gate matter on real Kronecker factors? (CPU, float32)

QrMethod::RayleighCholeskyTc (cuda/src/refresh.rs) finishes M = Q_p W1 with one Newton-Schulz
step when M is nearly orthonormal. Until the session-7 review the gate was the largest entry of
D = MtM - I; the step's error is 3/4 ||D||_2^2, and ||D||_2 can be up to d times the largest
entry. Now the gate is ||D||_F <= 1e-2. This script captures SOAP refresh inputs (factor,
stored basis) from a reference-SOAP run (nikhilvyas/SOAP soap.py, not committed: pass
.gpu/.ext or any folder holding it) of a small GPT on real tokens, runs the rc-tc pipeline on
each in float32 (standing in for 3xTF32, which has fp32 accuracy) and reports, per factor,
cond(L), max|D|, ||D||_2, ||D||_F, which gates pass, and ||QtQ - I||_2 after the step.

Usage: python3 bench/rc_tc_gate.py TOKENS.u16cache SOAP_DIR OUT.jsonl
  (an llm.c token file, e.g. asteria's --cache-dir; ~5 minutes on 2 cores)"""
import json, math, os, sys
import numpy as np
tok_path, soap_dir, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, soap_dir)
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
sys.path.insert(0, os.path.join(here, "..", "..", "shared", "bench"))
import torch_baseline as tb
torch = tb.torch
from soap import SOAP

torch.manual_seed(0)
torch.set_num_threads(max(1, os.cpu_count() or 1))
raw = np.fromfile(tok_path, dtype=np.uint8)
hdr = raw[:1024].view(np.int32)
assert hdr[0] == 20240520, "not an llm.c token file"
toks = torch.from_numpy(raw[1024:1024 + 2 * int(hdr[2])].view(np.uint16).astype(np.int64))
B, T = 8, 128
captures, capture_at = [], {10, 20}
orig = SOAP.get_orthogonal_matrix_QR
def hooked(self, state, *a, **k):
    if state["step"] in capture_at:
        for m, o in zip(state["GG"], state["Q"]):
            if len(m) and m.shape[0] >= 384:
                captures.append((state["step"], m.detach().clone(), o.detach().clone()))
    return orig(self, state, *a, **k)
SOAP.get_orthogonal_matrix_QR = hooked
model = tb.GPT(T=T, L=4, d=384, h=6)
# GPT-2's initialisation (torch_baseline's model keeps PyTorch's N(0, 1) embeddings: fine for
# timing, but its first losses are ~250).
for p in model.parameters():
    if p.dim() >= 2:
        torch.nn.init.normal_(p, std=0.02)
opt = SOAP(model.parameters(), lr=3e-3, betas=(0.95, 0.95), weight_decay=0.01,
           precondition_frequency=10, max_precond_dim=10000)
pos, losses = 0, []
for step in range(1, 22):
    chunk = toks[pos:pos + B * T + 1]; pos += B * T
    x, y = chunk[:-1].view(B, T), chunk[1:].view(B, T)
    loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad(set_to_none=True)
    losses.append(round(loss.item(), 4))
out = open(out_path, "w")
def emit(**kw):
    out.write(json.dumps(kw) + "\n"); out.flush(); print(json.dumps(kw))
emit(what="train", steps=21, losses=losses, captures=len(captures))

def rc_tc(m, o, shift=1e-6):
    """The rc-tc pipeline of refresh.rs in float32 up to M, then the Newton-Schulz step."""
    n = m.shape[0]
    a = m @ o
    est = (o * a).sum(0)
    idx = torch.argsort(est, descending=True)
    qp, ap = o[:, idx], a[:, idx]
    b = qp.T @ ap
    b = torch.triu(b) + torch.triu(b, 1).T          # potrf reads one triangle
    b.diagonal().add_(shift * b.diagonal().max())
    c, info = torch.linalg.cholesky_ex(b)
    if int(info):
        return None
    l = c / c.diagonal()[None, :]
    r1, info = torch.linalg.cholesky_ex(l.T @ l, upper=True)
    if int(info):
        return None
    w1 = torch.linalg.solve_triangular(r1, l, upper=True, left=False)
    mm = qp @ w1
    d = (mm.T @ mm - torch.eye(n)).double()
    q = mm + mm @ (0.5 * (torch.eye(n) - mm.T @ mm))
    after = torch.linalg.matrix_norm((q.T @ q).double() - torch.eye(n, dtype=torch.float64), 2)
    return dict(cond_L=float(torch.linalg.cond(l.double())), max=float(d.abs().max()),
                two=float(torch.linalg.matrix_norm(d, 2)), fro=float(d.norm()),
                after_ns_two=float(after))

for step, m, o in captures:
    r = rc_tc(m.float(), o.float())
    if r is None:
        emit(what="factor", step=step, n=m.shape[0], fallback=True); continue
    emit(what="factor", step=step, n=m.shape[0], old_gate=r["max"] <= 1e-2,
         new_gate=r["fro"] <= 1e-2, **r)
out.close()
