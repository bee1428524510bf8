#!/usr/bin/env bash
# CPU-side benchmarks on the GPU host (CUDA hidden): asteria CPU engine vs PyTorch on the
# same tiny GPT-2, and the host eigensolvers. Output: $OUT/cpu-bench.log
# Expects beside it: the stripped `asteria` (built with --features lapack), tiny-t2.asteria and
# tiny-t16.asteria (examples/tiny.asteria with steps = 40, eval_interval = 0, threads = 2 / 16)
# and torch_cpu_tiny.py; copy them into a git-ignored folder and carry it to the GPU host.
set -o pipefail
cd "$(dirname "$0")"
export CUDA_VISIBLE_DEVICES=
{
echo "== machine"; nproc; lscpu | grep -E "Model name|Socket|Thread|NUMA node\(s\)"; python3 -c "import torch; print('torch', torch.__version__)"
for t in 2 16; do
  echo "== torch threads=$t"; python3 torch_cpu_tiny.py --threads $t --steps 30 --warmup 5
  echo "== asteria threads=$t"; ./asteria train tiny-t$t.asteria --quiet --metrics m$t.jsonl --cache-dir /tmp/ac
  python3 -c "
import json,sys
ms=[json.loads(l)['step_ms'] for l in open('m$t.jsonl') if 'step_ms' in l][5:]
ms.sort(); med=ms[len(ms)//2]
print('RESULT', json.dumps(dict(what='asteria_cpu_tiny_adamw', threads=$t, median_step_ms=med, tokens_per_s=1024/med*1e3)))"
done
echo "== eigh"; ./asteria bench eigh --sizes 512,1024,2048 --threads 2,16 --reps 3
} 2>&1 | tee $OUT/cpu-bench.log
