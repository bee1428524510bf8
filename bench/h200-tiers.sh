#!/usr/bin/env bash
# Offload tiers and recomputation on one H200, in one device call (issues 16 and 17): the
# LLaMA-style 1.44B spec of bench/specs (d 2048, 24 layers, batch 4x1024, bf16, AdamW)
# unconstrained, under `gpu_memory = 24GiB` and `16GiB` (moments in pinned host memory, copied
# in and out around their updates), and with `rematerialize = selective | layers`; then the
# CPU-vs-GPU train-match of the tiered tiny spec (host tier only: the CUDA engine has no NVMe
# tier yet). Each run prints its GPU peak, arenas and MFU; summarize.py puts them side by side.
#
# Needs: the repository root as working directory, .gpu/ from bench/prepare-gpu, an NVIDIA GPU
# with ~30 GiB free, CUDA 13 under $CUDA_HOME.
# Writes into OUT_DIR: per run NAME.jsonl and NAME.txt, summary.md, and OUT_DIR.tgz.
# Usage: bench/h200-tiers.sh OUT_DIR [STEPS]   (default 40 steps; statistics skip 10)
set -uo pipefail
[[ $# -ge 1 ]] || { echo "usage: bench/h200-tiers.sh OUT_DIR [STEPS]" >&2; exit 2; }
out="$1"; steps="${2:-40}"
mkdir -p "$out"
here="$(dirname "${BASH_SOURCE[0]}")"
NAME=h200-tiers; source "$here/gpu-env.sh"
stamp machine
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
cat .gpu/BUILD 2>/dev/null

base="$S/llama-1.4b-adamw.asteria"
variant() { # name target-lines train-line -> spec path
  local f="$S/tiers-$1.asteria"   # beside the base spec: its corpus path is relative
  python3 - "$base" "$f" "$2" "$3" <<'PY'
import sys
src, dst, target, train = sys.argv[1:5]
s = open(src).read()
i = s.index("target cuda")
s = s[:i] + "target cuda {\n  device = 0\n  staleness = 0\n  precision = bf16\n" + target + "\n}\n"
if train:
    s = s.replace("train {", "train {\n  " + train, 1)
open(dst, "w").write(s)
PY
  echo "$f"
}
run() { # name spec
  stamp "$1"
  timeout 300 $B train "$2" --steps "$steps" --quiet --cache-dir "$TC" --metrics "$out/$1.jsonl" > "$out/$1.txt" 2>&1
  echo "$1 rc=$?"; grep -E "GPU peak|MFU|arena|budget" "$out/$1.txt" | tail -n 6
}
rows=()
for spec in "unconstrained||" "gpu24|  gpu_memory = 24GiB\n  host_memory = 96GiB\n|" \
            "gpu16|  gpu_memory = 16GiB\n  host_memory = 96GiB\n|" \
            "remat-selective||rematerialize = selective" "remat-layers||rematerialize = layers"; do
  IFS='|' read -r name target train <<< "$spec"
  f=$(variant "$name" "$(printf '%b' "$target")" "$train")
  $B compile "$f" --print-after tier-placement > "$out/$name-placement.txt" 2>&1
  run "llama-1.4b-$name" "$f"
  rows+=("$name=$out/llama-1.4b-$name.jsonl:$out/llama-1.4b-$name.txt")
done
python3 "$here/summarize.py" --skip 10 "${rows[@]}" | tee "$out/summary.md"

# CPU vs GPU on the tiered tiny spec, host tier only.
stamp train-match
sed -e 's/^  memory = 5MiB.*/  gpu_memory = 5MiB/' -e 's/^  host_memory = 1MiB.*/  host_memory = 64MiB/' \
    -e '/^  nvme/d' -e 's/^target cpu {/target cuda {/' examples/tiny-tiers.asteria > "$out/tiny-tiers-gpu.asteria"
timeout 300 $B selftest --device cuda --no-kernels --train-match "$out/tiny-tiers-gpu.asteria" \
  --match-precision fp32 > "$out/train-match-tiers.txt" 2>&1
echo "train-match rc=$?"; tail -n 5 "$out/train-match-tiers.txt"
stamp done
tar czf "$out.tgz" -C "$out" .
