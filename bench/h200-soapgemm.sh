#!/usr/bin/env bash
# H200 experiment (session 3): SOAP projection GEMMs in bf16 vs TF32 (ASTERIA_CUDA_SOAP_GEMM, present
# only at the commit that added this script; reverted after: no change in step time).
# Usage: bench/h200-soapgemm.sh OUT_DIR   (repository root, .gpu/ prepared)
set -uo pipefail
out=$1
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ASTERIA_CUDA_BF16_GEMM=cast
B=.gpu/bin/asteria; S=.gpu/specs; TC=/tmp/asteria-token-cache
start=$(date +%s); stamp() { echo "== $(date -u +%H:%M:%S) (+$(( $(date +%s) - start ))s) $*"; }
sed 's/staleness = 0/staleness = 5/' $S/gpt2-124m-soap.asteria > $S/gpt2-124m-soap-s5.asteria
run() { local n=$1 steps=$2 spec=$3; shift 3; stamp $n
  env "$@" timeout 120 $B train $spec --steps $steps --quiet --cache-dir $TC --metrics $out/$n.jsonl > $out/$n.txt 2>&1; echo "$n rc=$?"; }
run adamw 100 $S/gpt2-124m-adamw.asteria
run s5-tf32 100 $S/gpt2-124m-soap-s5.asteria
run s5-bf16 100 $S/gpt2-124m-soap-s5.asteria ASTERIA_CUDA_SOAP_GEMM=bf16
run s0-tf32 60 $S/gpt2-124m-soap.asteria
run s0-bf16 60 $S/gpt2-124m-soap.asteria ASTERIA_CUDA_SOAP_GEMM=bf16
python3 .gpu/bench/summarize.py --skip 12 "asteria AdamW=$out/adamw.jsonl:$out/adamw.txt" "SOAP S5 tf32=$out/s5-tf32.jsonl:$out/s5-tf32.txt" "SOAP S5 bf16 projections=$out/s5-bf16.jsonl:$out/s5-bf16.txt" "SOAP S0 tf32=$out/s0-tf32.jsonl:$out/s0-tf32.txt" "SOAP S0 bf16 projections=$out/s0-bf16.jsonl:$out/s0-bf16.txt" | tee $out/summary.md
stamp done
