"""How SOAP's power-iteration QR could be computed, on real Kronecker factors (GPU host, PyTorch).

The reference refresh (nikhilvyas/SOAP soap.py `get_orthogonal_matrix_QR`) is
    est = diag(Qᵀ F Q); idx = argsort(est, descending); Q_p = Q[:, idx]
    Q_new = qr(F Q_p).Q                       (Householder: cuSOLVER Sgeqrf + Sorgqr)
Because Q_p is orthonormal, F Q_p = Q_p B with B = Q_pᵀ F Q_p (symmetric positive
semidefinite), and with B = C Cᵀ (Cholesky, C lower) F Q_p = Q_p C Cᵀ, Cᵀ upper triangular, so
    qr(F Q_p).Q = Q_p · qr(C).Q = Q_p · qr(L).Q,   L = C diag(C)⁻¹ (unit lower triangular).
The ill-conditioning of F Q_p (cond(F), 1e6–1e10 on GPT-2's factors, which is why fp32
CholeskyQR2 failed in BENCHMARKS.md) sits in diag(C) and Cᵀ; L's strictly-lower entries are the
rotation of the old basis toward the new one, scaled by eigenvalue ratios ≤ 1 (sorted order),
so L is well-conditioned and an ordinary CholeskyQR2 of L is accurate. The work is GEMMs, two
Cholesky factorisations and triangular solves instead of Householder's latency-bound panels.
This script measures, on factors captured from a real training run (GPT-2 124M of
torch_baseline.py, the reference SOAP, real text), how close the variants come to a float64
Householder QR of F Q_p, and what each primitive costs on this GPU.

The `rc` variant here symmetrises B and runs both CholeskyQR passes on L; asteria's
`QrMethod::RayleighCholesky` reads one triangle of B and runs the second pass on Q_p·W₁ (which
also keeps the basis orthonormal across refreshes); the accuracy numbers are the variant's.

Usage (GPU host): python3 qr_variants.py TOKENS.u16 OUT.jsonl [--per-capture N]
TOKENS: an llm.c token file (asteria's --cache-dir writes one per corpus).
QRV_SMALL=1: a 2-layer d=128 model on 4x64 tokens and factors from 128 up (a smoke test of
this script on a CPU-only machine; its numbers mean nothing)."""
import json, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".ext"))
import numpy as np
import torch_baseline as tb
torch = tb.torch
from soap import SOAP

tok_path, out_path = sys.argv[1], sys.argv[2]
per_capture = int(sys.argv[sys.argv.index("--per-capture") + 1]) if "--per-capture" in sys.argv else 10
dev = tb.dev if torch.cuda.is_available() else "cpu"
torch.backends.cuda.matmul.allow_tf32 = False
if dev != "cpu": torch.backends.cuda.preferred_linalg_library("cusolver")
out = open(out_path, "w")
def emit(**kw):
    out.write(json.dumps(kw) + "\n"); out.flush(); print(json.dumps(kw))

# ---- real factors: train with the reference SOAP on real text, capture refresh inputs ----
raw = np.fromfile(tok_path, dtype=np.uint8)
hdr = raw[:1024].view(np.int32)
assert hdr[0] == 20240520, "not an llm.c token file"
toks = torch.from_numpy(raw[1024:1024 + 2 * int(hdr[2])].view(np.uint16).astype(np.int64))
small = os.environ.get("QRV_SMALL") == "1"
B, T = (4, 64) if small else (16, 1024)
min_dim = 128 if small else 768
captures, capture_at = [], {10, 30}
orig = SOAP.get_orthogonal_matrix_QR
def hooked(self, state, *a, **k):
    if state["step"] in capture_at:
        for m, o in zip(state["GG"], state["Q"]):
            if len(m) and m.shape[0] >= min_dim:
                captures.append((state["step"], m.detach().clone(), o.detach().clone()))
    return orig(self, state, *a, **k)
SOAP.get_orthogonal_matrix_QR = hooked
torch.manual_seed(0)
model = (tb.GPT(T=64, L=2, d=128, h=4) if small else tb.GPT()).to(dev)
opt = SOAP(model.parameters(), lr=3e-3, betas=(0.95, 0.95), weight_decay=0.01,
           precondition_frequency=10, max_precond_dim=10000)
pos = 0
for step in range(1, 32):
    if pos + B * T + 1 > len(toks): pos = 0
    chunk = toks[pos:pos + B * T + 1].to(dev); pos += B * T
    x, y = chunk[:-1].view(B, T), chunk[1:].view(B, T)
    with torch.autocast("cuda" if dev != "cpu" else "cpu", dtype=torch.bfloat16):
        loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad(set_to_none=True)
    if step in (1, 10, 20, 31): emit(what="train", step=step, loss=loss.item())
del opt, model
torch.cuda.empty_cache()

def ev_time(fn, iters=5):
    if dev == "cpu":
        ts = []
        for _ in range(iters):
            t = time.perf_counter(); fn(); ts.append(1e3 * (time.perf_counter() - t))
        return float(np.median(ts))
    ts = []
    for _ in range(iters + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return float(np.median(ts[1:]))

def chol_qr2(x):
    """CholeskyQR2 of a well-conditioned x: twice R = chol(xᵀx)ᵀ, x ← x R⁻¹."""
    for _ in range(2):
        r, info = torch.linalg.cholesky_ex(x.T @ x, upper=True)
        x = torch.linalg.solve_triangular(r, x, upper=True, left=False)
    return x, int(info)

def rc(op, a, shift, tf32=False):
    """The Rayleigh–Cholesky QR: returns Q_new, the Cholesky info, L."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    b = op.T @ a
    b = 0.5 * (b + b.T)
    n = b.shape[0]
    b.diagonal().add_(shift * b.diagonal().max())
    c, info = torch.linalg.cholesky_ex(b)
    l = c / c.diagonal()[None, :]
    w, info2 = chol_qr2(l)
    q = op @ w
    torch.backends.cuda.matmul.allow_tf32 = prev
    return q, int(info) or info2, l

def agree(q, ref, est, taus=(1e-2, 1e-4, 1e-6)):
    cos = (q * ref).sum(0).abs()
    res = {}
    for t in taus:
        sel = est >= t * est[0]
        res[f"1-cos@{t:g}"] = float((1 - cos[sel]).max()) if sel.any() else None
        res[f"ncols@{t:g}"] = int(sel.sum())
    return res

by_size = {}
for (step, m, o) in captures:
    by_size.setdefault((step, m.shape[0]), []).append((m, o))
emit(what="captures", n=len(captures), groups={f"{k[0]}:{k[1]}": len(v) for k, v in by_size.items()})
for (step, n), items in sorted(by_size.items()):
    for k, (m, o) in enumerate(items[:per_capture]):
        m, o = m.float(), o.float()
        est = torch.diag(o.T @ m @ o)
        idx = torch.argsort(est, descending=True)
        est, op = est[idx], o[:, idx]
        a = m @ op
        ref64 = torch.linalg.qr(m.double() @ op.double()).Q.float()
        ref32 = torch.linalg.qr(a).Q
        ev = torch.linalg.eigvalsh(m.double())
        row = dict(what="factor", step=step, n=n, k=k,
                   cond_f=float(ev[-1] / ev.clamp_min(1e-300)[0]) if ev[0] > 0 else None,
                   eig_max=float(ev[-1]), eig_min=float(ev[0]),
                   orth_basis_in=float((o.T @ o - torch.eye(n, device=dev)).abs().max()))
        row["householder32"] = agree(ref32, ref64, est)
        for shift in (1e-7, 1e-6, 1e-5):
            for tf in (False, True):
                q, info, l = rc(op, a, shift, tf)
                key = f"rc_s{shift:g}{'_tf32' if tf else ''}"
                r = agree(q, ref64, est)
                r["info"] = info
                r["orth"] = float((q.T @ q - torch.eye(n, device=dev)).abs().max())
                if not tf and shift == 1e-6:
                    r["cond_L"] = float(torch.linalg.cond(l.double()))
                    r["max_offdiag_L"] = float(l.tril(-1).abs().max())
                row[key] = r
        emit(**row)
        del ref64, ref32, a

# ---- what each primitive costs on this GPU (cuda events, median of 5) ----
for n in ((128, 384) if small else (768, 2304, 3072)):
    g = torch.randn(n, 4 * n, device=dev)
    f = (g @ g.T) / (4 * n)
    q = torch.linalg.qr(torch.randn(n, n, device=dev)).Q
    l = torch.eye(n, device=dev) + 0.01 * torch.randn(n, n, device=dev).tril(-1)
    r = torch.linalg.cholesky(l.T @ l, upper=True)
    row = dict(what="primitive_ms", n=n)
    torch.backends.cuda.matmul.allow_tf32 = False
    row["gemm_fp32"] = ev_time(lambda: f @ q)
    torch.backends.cuda.matmul.allow_tf32 = True
    row["gemm_tf32"] = ev_time(lambda: f @ q)
    torch.backends.cuda.matmul.allow_tf32 = False
    qb = q.bfloat16(); fb = f.bfloat16()
    row["gemm_bf16"] = ev_time(lambda: fb @ qb)
    row["householder_qr"] = ev_time(lambda: torch.linalg.qr(f @ q))
    row["potrf"] = ev_time(lambda: torch.linalg.cholesky_ex(f + 1e-3 * torch.eye(n, device=dev)))
    row["trsm"] = ev_time(lambda: torch.linalg.solve_triangular(r, l, upper=True, left=False))
    row["cholqr2_of_L"] = ev_time(lambda: chol_qr2(l))
    row["rc_total_fp32"] = ev_time(lambda: rc(q, f @ q, 1e-6, False))
    row["rc_total_tf32"] = ev_time(lambda: rc(q, f @ q, 1e-6, True))
    row["ref_total"] = ev_time(lambda: torch.linalg.qr(f @ q))
    emit(**row)
out.close()
