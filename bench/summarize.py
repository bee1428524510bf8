"""Summarizes metrics JSONL files (asteria --metrics, bench/torch_steps.py) into the table of
BENCHMARKS.md, printed as markdown.
Usage: python3 summarize.py [--skip 12] NAME=metrics.jsonl[:log.txt] ...
Step statistics use the steps after the first `--skip`. tokens/s = batch tokens / median step
time. The peak GPU memory comes from the "GPU peak used X GiB" line of the log, when given
(asteria: the driver's used memory, context included; torch_steps.py: the caching allocator's
peak allocated tensors). "device GiB" is the driver's used memory (total - free) of both
sides, the CUDA context and allocator reserve included: asteria's "GPU peak used", the
"device used at end" line of torch_steps.py (its allocator keeps its peak reserve);
MFU and the time from process start to the end of the first step from asteria's "MFU" and
"first step done" lines.
"mean vs asteria AdamW mean" divides by the row named "asteria AdamW", "vs torch eager AdamW"
(tokens/s) by the row named "torch AdamW eager"."""
import json, re, sys

def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100.0
    f = int(k); c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)

args = sys.argv[1:]
skip, runs = 12, []
i = 0
while i < len(args):
    if args[i] == "--skip":
        skip = int(args[i + 1]); i += 2
    else:
        runs.append(args[i]); i += 1

rows = []
for r in runs:
    name, rest = r.split("=", 1)
    path, _, err = rest.partition(":")
    try:
        steps = [json.loads(l) for l in open(path) if l.strip()]
    except OSError:
        print(f"<!-- {name}: no metrics ({path} missing: the run failed, see its log) -->")
        continue
    tr = [s for s in steps if "loss" in s]
    val = [s for s in steps if "val_loss" in s]
    ms = [s["step_ms"] for s in tr[skip:]]
    tok = tr[0].get("tokens_per_s", 0) * tr[0]["step_ms"] / 1e3 if tr else 0
    peak = mfu = first = device = ""
    if err:
        log = open(err, errors="replace").read()
        m = re.search(r"GPU peak used ([0-9.]+) GiB", log)
        peak = m.group(1) if m else ""
        m = re.search(r"device used at end ([0-9.]+) GiB", log)
        device = m.group(1) if m else peak
        m = re.search(r"MFU ([0-9.]+)%", log)
        mfu = m.group(1) + "%" if m else ""
        m = re.search(r"first step done ([0-9.]+) s", log)
        first = m.group(1) if m else ""
    med = pct(ms, 50)
    rows.append(dict(name=name, steps=len(tr), median=med, p99=pct(ms, 99), max=max(ms) if ms else float("nan"),
                     mean=sum(ms) / max(len(ms), 1), tps=tok / (med / 1e3) if med == med and med > 0 else 0,
                     loss=tr[-1]["loss"] if tr else float("nan"), val=val[-1]["val_loss"] if val else float("nan"), peak=peak,
                     device=device, mfu=mfu, first=first))
ref = next((r for r in rows if r["name"].lower() == "torch adamw eager"), None)
ours = next((r for r in rows if r["name"].lower() == "asteria adamw"), None)
print("| run | steps | median ms | p99 ms | max ms | mean ms | max/median | mean vs asteria AdamW mean | tokens/s | vs torch eager AdamW | last loss | last val loss | peak GiB | device GiB | MFU | first step s |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    ratio = "%.2fx" % (r["tps"] / ref["tps"]) if ref and ref["tps"] else "-"
    vs_ours = "%.3fx" % (r["mean"] / ours["mean"]) if ours and ours["mean"] else "-"
    print("| %s | %d | %.1f | %.1f | %.1f | %.1f | %.3f | %s | %.0f | %s | %.3f | %.3f | %s | %s | %s | %s |" % (
        r["name"], r["steps"], r["median"], r["p99"], r["max"], r["mean"], r["max"] / r["median"], vs_ours,
        r["tps"], ratio, r["loss"], r["val"], r["peak"] or "-", r["device"] or "-", r["mfu"] or "-", r["first"] or "-"))
