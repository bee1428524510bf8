#!/usr/bin/env bash
# CPU benchmarks of BENCHMARKS.md, on any Linux host (the reference numbers are the H200 host's
# CPU, CUDA hidden): the tiny GPT-2 of examples/tiny.asteria (AdamW, 40 steps, no evaluation) on
# asteria's CPU engine against PyTorch eager on the same model (bench/torch_cpu_tiny.py), at 2
# and 16 threads; then the host eigensolvers, `asteria bench eigh` (faer and LAPACK ssyevd,
# n = 512/1024/2048, 2 and 16 threads).
#
# Needs: the repository root as working directory, .gpu/ from `bench/prepare-gpu --lapack`
# (the binary must have the LAPACK eigensolver), python3 with PyTorch (CPU build is enough).
# Writes into OUT_DIR: cpu-bench.log (RESULT lines with the median step and tokens/s of each side,
# and the eigensolver table), m2.jsonl / m16.jsonl (asteria's metrics).
# Takes ~3 minutes.
# Usage: bench/cpu-bench.sh OUT_DIR
set -uo pipefail
out="${1:?usage: bench/cpu-bench.sh OUT_DIR}"; mkdir -p "$out"
export CUDA_VISIBLE_DEVICES=
here="$(dirname "${BASH_SOURCE[0]}")"
B=.gpu/bin/asteria; S=.gpu/specs; TC="${TMPDIR:-/tmp}/asteria-token-cache"
[[ -x $B ]] || { echo "cpu-bench: $B is missing: run bench/prepare-gpu --lapack and carry .gpu/" >&2; exit 2; }
for t in 2 16; do
  sed -e 's/^  steps = 400\b.*/  steps = 40/' -e 's/^  eval_interval = 100\b.*/  eval_interval = 0/' \
    -e "s/^  # threads = 2\b.*/  threads = $t/" $S/tiny.asteria > $S/tiny-t$t.asteria
done
{
echo "== machine"; cat .gpu/BUILD 2>/dev/null; nproc; lscpu | grep -E "Model name|Socket|Thread|NUMA node\(s\)"
python3 -c 'import torch; print("torch", torch.__version__)'
for t in 2 16; do
  echo "== torch threads=$t"; python3 "$here/torch_cpu_tiny.py" --threads $t --steps 30 --warmup 5
  echo "== asteria threads=$t"; $B train $S/tiny-t$t.asteria --quiet --metrics "$out/m$t.jsonl" --cache-dir "$TC"
  python3 - "$out/m$t.jsonl" $t <<'PY'
import json, sys
ms = sorted([json.loads(l)["step_ms"] for l in open(sys.argv[1]) if "step_ms" in l][5:])
med = ms[len(ms) // 2]
print("RESULT", json.dumps(dict(what="asteria_cpu_tiny_adamw", threads=int(sys.argv[2]), median_step_ms=med,
                                tokens_per_s=1024 / med * 1e3)))
PY
done
echo "== eigh"; $B bench eigh --sizes 512,1024,2048 --threads 2,16 --reps 3
} 2>&1 | tee "$out/cpu-bench.log"
