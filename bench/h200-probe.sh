#!/usr/bin/env bash
# Short probe of where asteria's asynchronous refreshes spend host time on the H200: GPT-2 124M
# SOAP S=5 for 40 steps with the plan's placement, everything on the side stream, everything
# on the host pool (`refresh host ms` lines), plus the median step of each.
# Usage: bench/h200-probe.sh OUT_DIR
set -uo pipefail
out="${1:?usage: bench/h200-probe.sh OUT_DIR}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ASTERIA_CUDA_BF16_GEMM=cast
B=.gpu/bin/asteria; S=.gpu/specs; TC=/tmp/asteria-token-cache
sed 's/staleness = 0/staleness = 5/' $S/gpt2-124m-soap.asteria > $S/gpt2-124m-soap-s5.asteria
med() { python3 -c "import json,statistics,sys;r=[json.loads(l) for l in open(sys.argv[1])];r=[x for x in r if 'loss' in x];print('median %.1f max %.1f'%(statistics.median([x['step_ms'] for x in r[12:]]),max([x['step_ms'] for x in r[12:]])))" "$1"; }
for mode in plan gpu host; do
  echo "== S=5 refresh=$mode"
  ASTERIA_CUDA_REFRESH=$mode timeout 100 $B train $S/gpt2-124m-soap-s5.asteria --steps ${STEPS:-40} --quiet --cache-dir $TC \
    --metrics "$out/probe-$mode.jsonl" > "$out/probe-$mode.txt" 2>&1; echo "rc=$?"
  med "$out/probe-$mode.jsonl"; grep "refresh host ms\|host tasks" "$out/probe-$mode.txt"
done
