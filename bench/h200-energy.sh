#!/usr/bin/env bash
# Energy to a loss (issue 18): GPT-2 124M on the medium corpus, 300 steps each of AdamW, SOAP at
# staleness 0 and SOAP at staleness 5 (bench/specs/gpt2-124m-{adamw,soap}.asteria: batch 16x1024,
# bf16, SOAP max_precond_dim 10000), GPU joules from NVML's energy counter (`energy_j` in the
# metrics); validation every 25 steps. Then a 30-step SOAP S=5 run with `--trace`, summarised by
# bench/trace_summary.py (the side stream's refreshes against the compute stream).
#
# Needs: the repository root as working directory, .gpu/ from bench/prepare-gpu, an H200, CUDA 13
# under $CUDA_HOME. Takes ~4 minutes.
# Writes into OUT_DIR: {adamw,soap-s0,soap-s5}.{jsonl,txt}, trace-s5.json(.gz),
# trace-summary.md, energy.md (the table), loss-energy.svg, the AdamW run's final checkpoint
# ck-adamw/ (left out of OUT_DIR.tgz), and OUT_DIR.tgz.
# Usage: bench/h200-energy.sh OUT_DIR [STEPS]   (default 300)
set -uo pipefail
[[ $# -ge 1 ]] || { echo "usage: bench/h200-energy.sh OUT_DIR [STEPS]" >&2; exit 2; }
out="$1"; steps="${2:-300}"
mkdir -p "$out"
here="$(dirname "${BASH_SOURCE[0]}")"
NAME=h200-energy; source "$here/gpu-env.sh"
stamp machine
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
cat .gpu/BUILD 2>/dev/null
run() {  # name spec extra-args...
  local name="$1" spec="$2"; shift 2
  stamp "$name"
  timeout 300 $B train "$S/$spec" --steps "$steps" --set train.eval_interval=25 --quiet \
    --cache-dir "$TC" --metrics "$out/$name.jsonl" "$@" > "$out/$name.txt" 2>&1
  echo "$name rc=$?"; grep -E "energy|MFU|val loss|rror" "$out/$name.txt" | tail -n 4
}
run adamw gpt2-124m-adamw.asteria --checkpoint-dir "$out/ck-adamw"
run soap-s0 gpt2-124m-soap.asteria
run soap-s5 gpt2-124m-soap.asteria --set target.staleness=5
stamp trace
timeout 200 $B train "$S/gpt2-124m-soap.asteria" --steps 30 --set target.staleness=5 \
  --set train.eval_interval=0 --quiet --cache-dir "$TC" --trace "$out/trace-s5.json" \
  > "$out/trace-s5.txt" 2>&1
echo "trace rc=$?"
python3 "$here/trace_summary.py" "$out/trace-s5.json" 5 | tee "$out/trace-summary.md"
gzip -f "$out/trace-s5.json"
python3 - "$out" <<'PY' | tee "$out/energy.md"
import json, sys
out = sys.argv[1]
runs = {}
for name in ["adamw", "soap-s0", "soap-s5"]:
    steps, evals = [], []
    for line in open(f"{out}/{name}.jsonl"):
        r = json.loads(line)
        (evals if "val_loss" in r else steps).append(r)
    runs[name] = (steps, evals)
target = runs["adamw"][1][-1]["val_loss"]
print(f"GPT-2 124M, {len(runs['adamw'][0])} steps of 16x1024 tokens; target = AdamW's final validation loss {target:.4f}\n")
print("| run | final val loss | GPU J | mJ per token | step ms median / mean | W (mean) | J to AdamW's final val loss (step) | vs AdamW |")
print("|---|---|---|---|---|---|---|---|")
base = None
for name, (steps, evals) in runs.items():
    j = steps[-1].get("energy_j")
    tok = 16 * 1024 * len(steps)
    ms = sorted(s["step_ms"] for s in steps)[len(steps) // 2]
    mean = sum(s["step_ms"] for s in steps) / len(steps)
    watts = j / (sum(s["step_ms"] for s in steps) / 1e3) if j else float("nan")
    hit = next((e for e in evals if e["val_loss"] <= target and e.get("energy_j") is not None), None)
    reach = f"{hit['energy_j']:.0f} (step {hit['step']})" if hit else "not reached"
    base = base or (hit["energy_j"] if hit else None)
    ratio = f"{hit['energy_j'] / base:.2f}x" if hit and base else "-"
    print(f"| {name} | {evals[-1]['val_loss']:.4f} | {j:.0f} | {1e3 * j / tok:.2f} | {ms:.1f} / {mean:.1f} | {watts:.0f} | {reach} | {ratio} |")
PY
$B plot "AdamW=$out/adamw.jsonl" "SOAP-S0=$out/soap-s0.jsonl" "SOAP-S5=$out/soap-s5.jsonl" \
  --x energy_j -o "$out/loss-energy.svg" --title "GPT-2 124M: loss against GPU energy"
stamp done
tar czf "$out.tgz" --exclude=ck-adamw -C "$(dirname "$out")" "$(basename "$out")"
