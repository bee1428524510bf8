"""Regression check of the S > 0 refresh paths on the GPU host: the last validation loss of a
SOAP run with staleness S > 0 must be within TOL of the same run with S = 0 (issue 4's
criterion; the CI test on the CPU engine asks 0.02 of tiny-soap). Per-step losses are not
comparable: with S > 0 the precond-scheduling pass staggers the refreshes over the period, so
the runs differ from step 2 on. A stale-bf16-basis bug (a synchronous host refresh that did not
mark the basis's cached bf16 copy stale; fixed in 60589e6) once left GPT-2 124M's S = 5 run
0.141 behind S = 0 at step 300 (5.742 vs 5.601); after the fix the gap is within ±0.02.
Usage: python3 check_staleness.py S0.jsonl S5.jsonl [--tol 0.05]   (asteria --metrics files)
Prints one PASS/FAIL line; exit status 1 on FAIL (including a missing or non-finite last
validation loss, or last validation losses at different steps)."""
import argparse, json, math, sys

ap = argparse.ArgumentParser(description="S > 0 vs S = 0: last validation loss")
ap.add_argument("s0"); ap.add_argument("s5")
ap.add_argument("--tol", type=float, default=0.05)
args = ap.parse_args()

def last_val(path):
    val = None
    for line in open(path):
        r = json.loads(line)
        if "val_loss" in r:
            val = (r.get("step"), r["val_loss"])
    return val

a, b = last_val(args.s0), last_val(args.s5)
if a is None or b is None:
    print(f"FAIL: no validation loss in {args.s0 if a is None else args.s5}")
    sys.exit(1)
# asteria writes a non-finite loss as null.
bad = [p for p, v in ((args.s0, a), (args.s5, b)) if not isinstance(v[1], (int, float)) or not math.isfinite(v[1])]
if bad:
    print(f"FAIL: non-finite last validation loss in {', '.join(bad)}")
    sys.exit(1)
if a[0] != b[0]:
    print(f"FAIL: last validation losses at different steps ({a[0]} vs {b[0]}): a run stopped early")
    sys.exit(1)
gap = b[1] - a[1]
ok = abs(gap) <= args.tol
print(f"{'PASS' if ok else 'FAIL'}: val loss S>0 {b[1]:.4f} vs S=0 {a[1]:.4f} at step {a[0]}: "
      f"gap {gap:+.4f}, tol {args.tol}")
sys.exit(0 if ok else 1)
