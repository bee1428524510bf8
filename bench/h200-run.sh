#!/usr/bin/env bash
# The H200 run behind BENCHMARKS.md ("CUDA backend"), in one device call, from the repository
# root with .gpu/ prepared by bench/prepare-gpu:
#   1. `asteria selftest --device cuda`: every kernel vs the CPU kernels, then CPU-vs-GPU
#      train-matches (20 steps, fp32, loss within 1e-4 relative each step);
#   2. 30-step GPT-2 124M AdamW runs with each bf16 GEMM flavour (cast / fast): the faster is used;
#   3. GPT-2 124M, B=16x1024, medium corpus: 300 steps AdamW, 300 steps SOAP (bf16, metrics JSONL);
#   4. the PyTorch reference (bench/run_torch.py over shared/bench/torch_baseline.py);
#   5. a 4-step per-op profile (ASTERIA_CUDA_PROFILE) of the AdamW step; 6. the summary table.
# Usage: bench/h200-run.sh OUT_DIR      (logs and metrics land in OUT_DIR)
set -uo pipefail
out="${1:?usage: bench/h200-run.sh OUT_DIR}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
B=.gpu/bin/asteria
S=.gpu/specs
TC=/tmp/asteria-token-cache
start=$(date +%s)
left() { echo $(( ${BUDGET:-570} - ($(date +%s) - start) )); }
stamp() { echo "== $(date -u +%H:%M:%S) (+$(( $(date +%s) - start ))s) $*"; }

stamp machine
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
nproc; python3 -c 'import torch; print("torch", torch.__version__)'

stamp selftest
timeout 150 $B selftest --device cuda --quick --cache-dir $TC \
  --train-match $S/tiny.asteria --train-match $S/tiny-soap-mpd64.asteria > "$out/selftest.txt" 2>&1
echo "selftest (kernels + train-match, gpu refresh) rc=$?"
timeout 90 $B selftest --device cuda --no-kernels --refresh host --cache-dir $TC \
  --train-match $S/tiny-soap-mpd64.asteria --train-match $S/tiny-soap.asteria >> "$out/selftest.txt" 2>&1
echo "selftest (train-match, host refresh; tiny-soap mpd 10000 is informative) rc=$?"
grep -E "^(PASS|FAIL)|passed, |ERROR|error" "$out/selftest.txt"

stamp "bf16 gemm flavour"
best=cast; best_ms=1e9
for mode in cast fast; do
  ASTERIA_CUDA_BF16_GEMM=$mode timeout 75 $B train $S/gpt2-124m-adamw.asteria --steps 30 --quiet \
    --cache-dir $TC --metrics /tmp/perf-$mode.jsonl > /tmp/perf-$mode.txt 2>&1
  echo "$mode rc=$?"; tail -2 /tmp/perf-$mode.txt
  ms=$(python3 -c "import json,statistics;r=[json.loads(l) for l in open('/tmp/perf-$mode.jsonl') if '\"loss\"' in l];print(statistics.median(x['step_ms'] for x in r[5:]))" 2>/dev/null || echo 1e9)
  echo "$mode median step ms (steps 6-30): $ms"
  if python3 -c "import sys; sys.exit(0 if float('$ms') < float('$best_ms') else 1)"; then best=$mode; best_ms=$ms; fi
done
export ASTERIA_CUDA_BF16_GEMM=$best
echo "using ASTERIA_CUDA_BF16_GEMM=$best"

stamp "gpt2 adamw 300"
timeout 150 $B train $S/gpt2-124m-adamw.asteria --quiet --cache-dir $TC --metrics "$out/adamw.jsonl" > "$out/adamw.txt" 2>&1
echo "adamw rc=$?"; tail -3 "$out/adamw.txt"

stamp "gpt2 soap 300"
timeout $(( $(left) - 200 )) $B train $S/gpt2-124m-soap.asteria --quiet --cache-dir $TC --metrics "$out/soap.jsonl" > "$out/soap.txt" 2>&1
echo "soap rc=$?"; tail -3 "$out/soap.txt"

stamp torch
timeout $(( $(left) - 40 )) python3 .gpu/bench/run_torch.py > "$out/torch.txt" 2>&1
echo "torch rc=$?"; grep RESULT "$out/torch.txt"

stamp profile
ASTERIA_CUDA_PROFILE=1 timeout $(( $(left) - 8 )) $B train $S/gpt2-124m-adamw.asteria --steps 4 --quiet \
  --cache-dir $TC > "$out/profile.txt" 2>&1
echo "profile rc=$?"; grep -A14 "per-op" "$out/profile.txt"

stamp summary
python3 .gpu/bench/summarize.py --skip 12 "asteria adamw=$out/adamw.jsonl:$out/adamw.txt" \
  "asteria soap=$out/soap.jsonl:$out/soap.txt" --torch "$out/torch.txt"
