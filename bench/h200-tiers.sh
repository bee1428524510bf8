#!/usr/bin/env bash
# Offload tiers and recomputation on one H200, in one device call (issues 16 and 17), on the
# LLaMA-style 1.44B specs of bench/specs (d 2048, 24 layers, batch 4x1024, bf16):
# - AdamW unconstrained, under `gpu_memory = 24GiB` and `16GiB` (moments in pinned host
#   memory, copied in and out around their updates; rows `*-unhoisted`: the same plan with
#   every copy in left in the optimizer program, `--skip-pass copy-hoisting`; rows `*-nocarry`:
#   every copy out finished at the step's end, `--skip-pass copy-out-overlap`), with `rematerialize = selective |
#   layers`, and with `host_updates = sync | delayed` (the updates on the host cores);
# - SOAP (staleness 5, `refresh_swap = deadline`) unconstrained, under `gpu_memory = 30GiB`,
#   and under `24GiB` without recomputation, with `rematerialize = selective` and with `layers`
#   (the refresh shadows in pinned host memory, then the moments of the largest matrices;
#   refresh swaps re-project host-tier moments through a device staging buffer), under `16GiB`
#   with `layers` (the moments and then gradients in pinned host memory: the gradients are
#   copied out during the backward and back in for their updates), under `12GiB` with `layers`
#   (then the Kronecker factors and eigenbases too), under `8GiB` with `layers` (then the
#   parameters: copied in by the forward, the backward and the optimizer), and under `gpu_memory =
#   30GiB` with only 4 GiB of host memory, the rest of the offloaded moments in the NVMe tier
#   (a file in /tmp; STEPS steps: ~2.5 s of NVMe copies a step), the others SOAP_STEPS steps
#   each with the validation loss at the end;
# - row `train-match`: the CPU-vs-GPU train-matches (fp32) of the tiered tiny AdamW spec and of
#   tiny-soap under a budget that puts the embedding's moments (a refresh task's) in the host
#   tier, and of examples/tiny-tiers.asteria (AdamW) and its SOAP variant with moments in the
#   host and NVMe tiers (the NVMe file in /tmp), and of tiny-tiers under a budget that also
#   streams two gradients to host memory (`tiny-tiers-gpu-grads`: the clip from partial sums),
#   and under budgets that move parameters too (`tiny-tiers-gpu-params`, AdamW and SOAP), and
#   with AdamW's updates on the host (`tiny-tiers-gpu-host-sync`, `-delayed`);
# - row `pinned-shadows`: tiny-soap at staleness 2 on the GPU, unconstrained against budgets that
#   pin the refresh shadows (bit for bit) and move moments too, and at staleness 0.
# Each run prints its GPU peak, arenas and MFU; summarize.py puts them side by side.
#
# Needs: the repository root as working directory, .gpu/ from bench/prepare-gpu, an NVIDIA GPU
# with ~40 GiB free, CUDA 13 under $CUDA_HOME.
# Writes into OUT_DIR: per run NAME.jsonl, NAME.txt and NAME-placement.txt, summary.md, and
# OUT_DIR.tgz.
# Usage: bench/h200-tiers.sh OUT_DIR [STEPS [SOAP_STEPS [ROWS [MATCHES]]]]   (defaults 40 and
# 200; statistics skip 10 steps; ROWS: an extended regex of the row names to run, default all;
# MATCHES: one of the train-match spec names, e.g. '^tiny-tiers-gpu(-host.*)?$', default all)
set -uo pipefail
[[ $# -ge 1 ]] || { echo "usage: bench/h200-tiers.sh OUT_DIR [STEPS [SOAP_STEPS]]" >&2; exit 2; }
out="$1"; steps="${2:-40}"; soap_steps="${3:-200}"; only="${4:-.}"; matches="${5:-.}"
mkdir -p "$out"
here="$(dirname "${BASH_SOURCE[0]}")"
NAME=h200-tiers; source "$here/gpu-env.sh"
stamp machine
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
cat .gpu/BUILD 2>/dev/null

variant() { # base name target-lines train-line -> spec path
  local f="$S/tiers-$2.asteria"   # beside the base spec: its corpus path is relative
  python3 - "$S/$1.asteria" "$f" "$3" "$4" <<'PY'
import sys
src, dst, target, train = sys.argv[1:5]
s = open(src).read()
i = s.index("target cuda")
j = s.index("}", i)
s = s[:j] + "".join("  " + t.strip() + "\n" for t in target.split(";") if t.strip()) + s[j:]
for t in train.split(";"):
    if t.strip():
        s = s.replace("train {", "train {\n  " + t.strip(), 1)
open(dst, "w").write(s)
PY
  echo "$f"
}
run() { # name spec steps [flags]
  stamp "$1"
  # shellcheck disable=SC2086  # flags is a list
  timeout 300 $B train "$2" --steps "$3" ${4:-} --quiet --cache-dir "$TC" --metrics "$out/$1.jsonl" > "$out/$1.txt" 2>&1
  echo "$1 rc=$?"; grep -E "GPU peak|MFU|val loss|budget|ERROR|×" "$out/$1.txt" | tail -n 6
}
rows=()
budget() { printf 'gpu_memory = %s; host_memory = 96GiB' "$1"; }   # one line: `read` below
# SOAP rows install every refresh exactly S steps after its launch (`refresh_swap = deadline`):
# their losses then compare the plans, not the timing of the side stream.
dl="refresh_swap = deadline"
for spec in "llama-1.4b-adamw|unconstrained|||$steps" \
            "llama-1.4b-adamw|gpu24|$(budget 24GiB)||$steps" \
            "llama-1.4b-adamw|gpu24-unhoisted|$(budget 24GiB)||$steps" \
            "llama-1.4b-adamw|gpu24-nocarry|$(budget 24GiB)||$steps" \
            "llama-1.4b-adamw|gpu16|$(budget 16GiB)||$steps" \
            "llama-1.4b-adamw|gpu16-nocarry|$(budget 16GiB)||$steps" \
            "llama-1.4b-adamw|remat-selective||rematerialize = selective|$steps" \
            "llama-1.4b-adamw|remat-layers||rematerialize = layers|$steps" \
            "llama-1.4b-adamw|host-sync|host_updates = sync; host_memory = 96GiB||$steps" \
            "llama-1.4b-adamw|host-delayed|host_updates = delayed; host_memory = 96GiB||$steps" \
            "llama-1.4b-soap|soap-unconstrained||$dl|$soap_steps" \
            "llama-1.4b-soap|soap-gpu30|$(budget 30GiB)|$dl|$soap_steps" \
            "llama-1.4b-soap|soap-gpu24|$(budget 24GiB)|$dl|$soap_steps" \
            "llama-1.4b-soap|soap-gpu24-selective|$(budget 24GiB)|rematerialize = selective; $dl|$soap_steps" \
            "llama-1.4b-soap|soap-gpu24-layers|$(budget 24GiB)|rematerialize = layers; $dl|$soap_steps" \
            "llama-1.4b-soap|soap-gpu24-layers-unhoisted|$(budget 24GiB)|rematerialize = layers; $dl|$soap_steps" \
            "llama-1.4b-soap|soap-gpu16-layers|$(budget 16GiB)|rematerialize = layers; $dl|$soap_steps" \
            "llama-1.4b-soap|soap-gpu12-layers|$(budget 12GiB)|rematerialize = layers; $dl|$soap_steps" \
            "llama-1.4b-soap|soap-gpu8-layers|$(budget 8GiB)|rematerialize = layers; $dl|$soap_steps" \
            "llama-1.4b-soap|soap-gpu30-nvme|gpu_memory = 30GiB; host_memory = 4GiB; nvme = \"/tmp\"; nvme_memory = 20GiB||$steps" \
            "train-match|train-match|||"; do
  IFS='|' read -r base name target train n <<< "$spec"
  [[ $name =~ $only ]] || continue
  [[ $name == train-match ]] && break
  f=$(variant "$base" "$name" "$target" "$train")
  flags=""; [[ $name == *-unhoisted ]] && flags="--skip-pass copy-hoisting"
  [[ $name == *-nocarry ]] && flags="--skip-pass copy-out-overlap"
  # shellcheck disable=SC2086  # flags is a list
  $B compile "$f" $flags --print-after tier-placement --print-after copy-hoisting --print-after copy-out-overlap > "$out/$name-placement.txt" 2>&1
  run "llama-1.4b-$name" "$f" "$n" "$flags"
  rows+=("$name=$out/llama-1.4b-$name.jsonl:$out/llama-1.4b-$name.txt")
done
[[ ${#rows[@]} -gt 0 ]] && python3 "$here/summarize.py" --skip 10 "${rows[@]}" | tee "$out/summary.md"
if [[ train-match =~ $only ]]; then

# CPU vs GPU, fp32: moments in the host tier (the *-gpu specs), and in the host and NVMe tiers
# (examples/tiny-tiers.asteria as it is, and its SOAP variant: the train-match compiles the CPU
# spec's placement and runs it on the GPU without the CPU's working-memory budget).
stamp train-match
# SOAP with the moments of refreshed matrices on NVMe (frequency 3, staleness 1 and 0): refresh
# swaps page them in and out around the GPU's re-projection (host refreshes: the CPU's
# eigensolver on both engines) and host installs write them.
sed -e 's/^optimizer adamw {/optimizer soap {\n  precondition_frequency = 3/' \
    -e 's/^  memory = 5MiB.*/  memory = 17MiB\n  staleness = 1/' examples/tiny-tiers.asteria > "$out/tiny-tiers-soap-nvme-s1.asteria"
sed -e 's/^  staleness = 1/  staleness = 0/' "$out/tiny-tiers-soap-nvme-s1.asteria" > "$out/tiny-tiers-soap-nvme-s0.asteria"
# SOAP with Kronecker factors and eigenbases in the host tier too (`memory = 7MiB`): the
# optimizer stages them, refreshes read and write them where they live (the GPU's through its
# refreshers' and swap's device copies), staleness 1 (host refreshes) and 0 (GPU refreshes).
for s in 1 0; do
  sed -e "s/^  staleness = 1/  staleness = $s/" -e 's/^  memory = 17MiB/  memory = 7MiB/' \
      -e 's/^  host_memory = 1MiB.*/  host_memory = 64MiB/' -e '/^  nvme/d' \
      "$out/tiny-tiers-soap-nvme-s1.asteria" > "$out/tiny-tiers-soap-fb-s$s.asteria"
done
cp examples/tiny-tiers.asteria "$out/tiny-tiers-nvme.asteria"
sed -e 's/^  memory = 5MiB.*/  gpu_memory = 1029MiB\n  precision = fp32/' -e 's/^  host_memory = 1MiB.*/  host_memory = 64MiB/' \
    -e '/^  nvme/d' -e 's/^target cpu {/target cuda {/' examples/tiny-tiers.asteria > "$out/tiny-tiers-gpu.asteria"
# 1053000 KiB: the largest budget (500 KiB steps) at which gradients leave too (two of them).
sed -e 's/^  gpu_memory = 1029MiB/  gpu_memory = 1053000KiB/' "$out/tiny-tiers-gpu.asteria" > "$out/tiny-tiers-gpu-grads.asteria"
# Parameters in pinned host memory too (the forward and backward copy them in through staging
# buffers of their own): AdamW under 1027MiB, SOAP (frequency 3, CPU eigenbases injected) under
# 1047MiB, the budgets at which parameters leave as well.
sed -e 's/^  gpu_memory = 1029MiB/  gpu_memory = 1027MiB/' "$out/tiny-tiers-gpu.asteria" > "$out/tiny-tiers-gpu-params.asteria"
sed -e 's/^  gpu_memory = 1029MiB/  gpu_memory = 1047MiB/' -e 's/^optimizer adamw {/optimizer soap {\n  precondition_frequency = 3/' \
    "$out/tiny-tiers-gpu.asteria" > "$out/tiny-tiers-gpu-params-soap.asteria"
# AdamW's updates on the host (`host_updates`): parameters' master copies, gradients and moments
# in pinned host memory, the Cranelift kernel on the host-update worker, against the CPU engine.
for h in sync delayed; do
  sed -e "s/^  gpu_memory = 1029MiB/  host_updates = $h/" "$out/tiny-tiers-gpu.asteria" > "$out/tiny-tiers-gpu-host-$h.asteria"
done
sed -e 's/^target cpu {/target cuda {\n  precision = fp32\n  gpu_memory = 1485MiB\n  host_memory = 256MiB/' \
    -e 's/^  staleness = 0 .*/  staleness = 0/' examples/tiny-soap.asteria > "$out/tiny-soap-tiers-gpu.asteria"
# SOAP's matches inject the CPU's eigenbases as each refresh is installed (two correct
# eigensolvers, or one on two engines' factors that differ by rounding, return different bases
# for near-equal eigenvalues: every factor of the first step is rank-deficient; BENCHMARKS.md,
# correctness checks). At staleness 1 the match runs with `refresh_swap = deadline`, so both
# engines install each result at its bound and the injection lands at the same step.
for m in "tiny-tiers-gpu|" "tiny-tiers-gpu-host-sync|--compare-state" "tiny-tiers-gpu-host-delayed|--compare-state" "tiny-tiers-gpu-grads|--compare-state" "tiny-tiers-gpu-params|--compare-state" \
         "tiny-tiers-gpu-params-soap|--compare-state --inject-cpu-refreshes" "tiny-soap-tiers-gpu|--inject-cpu-refreshes" "tiny-tiers-nvme|--compare-state" \
         "tiny-tiers-soap-nvme-s1|--refresh host --steps 12 --inject-cpu-refreshes" \
         "tiny-tiers-soap-nvme-s0|--refresh gpu --steps 12 --inject-cpu-refreshes" \
         "tiny-tiers-soap-fb-s1|--refresh host --steps 12 --inject-cpu-refreshes" \
         "tiny-tiers-soap-fb-s0|--refresh gpu --steps 12 --inject-cpu-refreshes"; do
  IFS='|' read -r name extra <<< "$m"
  [[ $name =~ $matches ]] || continue
  $B compile "$out/$name.asteria" --print-after tier-placement > "$out/$name-placement.txt" 2>&1
  # shellcheck disable=SC2086  # extra is a list of flags
  timeout 300 $B selftest --device cuda --no-kernels --cache-dir "$TC" --train-match "$out/$name.asteria" \
    --match-precision fp32 $extra > "$out/train-match-$name.txt" 2>&1
  echo "train-match $name rc=$?"; tail -n 5 "$out/train-match-$name.txt"
done
ls /tmp/asteria-*.nvme 2>/dev/null && echo "NVMe files left behind (each run should remove its own)"
fi
[[ pinned-shadows =~ $only ]] || { stamp done; tar czf "$out.tgz" -C "$out" .; exit 0; }
# Refresh shadows in pinned host memory change where bytes live, not what is computed: tiny-soap
# at staleness 2 (GPU side-stream refreshes, `refresh_swap = deadline`) unconstrained and under
# `gpu_memory = 1506MiB`, which the pinned shadows alone meet, must give the same loss at every
# step, bit for bit. Reported beside it: 1490MiB (the embedding's moments in the host tier too),
# and at staleness 0 (no shadows) unconstrained against 1485MiB (the host-tier moments alone).
# (Budgets count the CUDA context's 1 GiB, `schedule::reserve::CUDA_CONTEXT_BYTES`.)
stamp pinned-shadows
sed -e 's/^target cpu {/target cuda {\n  precision = fp32/' -e 's/^train {/train {\n  refresh_swap = deadline/' \
    -e 's/^  staleness = 0 .*/  staleness = 2/' examples/tiny-soap.asteria > "$out/tiny-soap-s2.asteria"
sed -e 's/^  staleness = 2/  staleness = 0/' "$out/tiny-soap-s2.asteria" > "$out/tiny-soap-s0.asteria"
for v in s2:1506MiB s2:1490MiB s0:1485MiB; do
  sed -e "s/^  precision = fp32/  precision = fp32\n  gpu_memory = ${v#*:}\n  host_memory = 256MiB/" \
    "$out/tiny-soap-${v%%:*}.asteria" > "$out/tiny-soap-${v%%:*}-${v#*:}.asteria"
done
for name in tiny-soap-s2 tiny-soap-s2-1506MiB tiny-soap-s2-1490MiB tiny-soap-s0 tiny-soap-s0-1485MiB; do
  $B compile "$out/$name.asteria" --print-after tier-placement > "$out/$name-placement.txt" 2>&1
  echo "$name: $(grep -cE 'refresh shadows' "$out/$name-placement.txt") shadow line(s), $(grep -cE -- '-> host' "$out/$name-placement.txt") tensor(s) to host"
  timeout 300 $B train "$out/$name.asteria" --steps 40 --quiet --cache-dir "$TC" --metrics "$out/$name.jsonl" \
    > "$out/$name.txt" 2>&1 || echo "$name failed"
done
python3 - "$out" <<'PY'
import json, sys
def losses(name):
    return [r["loss"] for r in map(json.loads, open(f"{sys.argv[1]}/{name}.jsonl")) if "loss" in r and "step" in r]
for a, b, exact in [("tiny-soap-s2", "tiny-soap-s2-1506MiB", True), ("tiny-soap-s2", "tiny-soap-s2-1490MiB", False),
                    ("tiny-soap-s0", "tiny-soap-s0-1485MiB", False)]:
    x, y = losses(a), losses(b)
    diff = max((abs(p - q) / abs(p) for p, q in zip(x, y)), default=float("nan"))
    first = next((i + 1 for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
    verdict = ("PASS: identical" if first is None and len(x) == len(y) > 0 else "FAIL: differ") if exact else "reported"
    print(f"{b} vs {a}: {len(x)} steps, max rel loss diff {diff:.3g}, first differing step {first}; {verdict}")
PY
stamp done
tar czf "$out.tgz" -C "$out" .
