#!/usr/bin/env bash
# Fused attention call: selftest of the flash_attention cases, GPT-2 124M AdamW 60 steps fused,
# 30 steps with the old GEMM attention, then a 4-step per-op profile of the fused run.
set -uo pipefail
out="${1:?OUT}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
B=.gpu/bin/asteria; S=.gpu/specs; TC=/tmp/asteria-token-cache
start=$(date +%s)
stamp() { echo "== $(date -u +%H:%M:%S) (+$(( $(date +%s) - start ))s) $*"; }
med() { python3 -c "import json,statistics,sys;r=[json.loads(l) for l in open(sys.argv[1])];r=[x for x in r if 'loss' in x];s=[x['step_ms'] for x in r[5:]];print('median',statistics.median(s),'mean',statistics.mean(s),'n',len(s),'loss@last',r[-1].get('loss'))" "$1" 2>&1; }
stamp machine; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
stamp selftest
timeout 100 $B selftest --device cuda --filter flash_attention --cache-dir $TC; echo "selftest rc=$?"
stamp "fused 60"
timeout 100 $B train $S/gpt2-124m-adamw.asteria --steps 60 --quiet --cache-dir $TC --metrics "$out/fused.jsonl" > "$out/fused.txt" 2>&1
echo "fused rc=$?"; tail -3 "$out/fused.txt"; med "$out/fused.jsonl"
stamp "gemm 30"
ASTERIA_CUDA_ATTENTION=gemm timeout 70 $B train $S/gpt2-124m-adamw.asteria --steps 30 --quiet --cache-dir $TC --metrics "$out/gemm.jsonl" > "$out/gemm.txt" 2>&1
echo "gemm rc=$?"; tail -3 "$out/gemm.txt"; med "$out/gemm.jsonl"
stamp "profile fused"
ASTERIA_CUDA_PROFILE=1 timeout 50 $B train $S/gpt2-124m-adamw.asteria --steps 4 --quiet --cache-dir $TC > "$out/profile.txt" 2>&1
echo "profile rc=$?"; sed -n '/per-op/,$p' "$out/profile.txt" | head -24
python3 -c "import json;a=[json.loads(l) for l in open('$out/fused.jsonl')];b=[json.loads(l) for l in open('$out/gemm.jsonl')];a=[x for x in a if 'loss' in x];b=[x for x in b if 'loss' in x];print('loss fused vs gemm', [(x['step'],round(x['loss'],4),round(y['loss'],4)) for x,y in zip(a,b)][::5])" 2>&1
stamp done
