#!/usr/bin/env bash
# H200 call: float64 shifted CholeskyQR3 vs cuSOLVER Householder QR for the GPU refreshes.
# The refresh self-test (both methods, the fallback), GPU refresh times per factor size for
# both methods (`asteria calibrate --device cuda`), a per-op profile of the SOAP step, and
# GPT-2 124M AdamW vs SOAP S=5 (both QR methods) side by side.
# Usage: bench/h200-qr.sh OUT_DIR [STEPS]   (repository root, .gpu/ from bench/prepare-gpu)
set -uo pipefail
out="${1:?usage: bench/h200-qr.sh OUT_DIR [STEPS]}"; steps="${2:-100}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1 ASTERIA_CUDA_BF16_GEMM=cast
B=.gpu/bin/asteria; S=.gpu/specs; TC=/tmp/asteria-token-cache
start=$(date +%s)
stamp() { echo "== $(date -u +%H:%M:%S) (+$(( $(date +%s) - start ))s) $*"; }
stamp machine; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
stamp selftest
timeout 150 $B selftest --device cuda --filter eigenbasis > "$out/selftest-refresh.txt" 2>&1
echo "selftest rc=$?"; grep -E "passed|failed" "$out/selftest-refresh.txt" | tail -2; grep -E "FAIL" "$out/selftest-refresh.txt" | head -5
for qr in cholesky3 householder; do
  stamp "calibrate $qr"
  ASTERIA_CUDA_QR=$qr timeout 150 $B calibrate --device cuda --sizes 768,2304,3072 --reps 3 -o "$out/cal-$qr.json" > "$out/cal-$qr.txt" 2>&1
  echo "rc=$?"; grep GPU "$out/cal-$qr.txt"
done
sed 's/staleness = 0/staleness = 5/' $S/gpt2-124m-soap.asteria > $S/gpt2-124m-soap-s5.asteria
run() { # name timeout spec [env...]
  local n=$1 t=$2 spec=$3; shift 3
  stamp "$n"
  env "$@" timeout "$t" $B train "$spec" --steps $steps --quiet --cache-dir $TC --metrics "$out/$n.jsonl" > "$out/$n.txt" 2>&1
  echo "$n rc=$?"; tail -3 "$out/$n.txt"
}
run adamw 90 $S/gpt2-124m-adamw.asteria
run soap-s5-chol3 120 $S/gpt2-124m-soap-s5.asteria ASTERIA_CUDA_QR=cholesky3
run soap-s5-hh 120 $S/gpt2-124m-soap-s5.asteria ASTERIA_CUDA_QR=householder
run soap-s0-chol3 120 $S/gpt2-124m-soap.asteria ASTERIA_CUDA_QR=cholesky3
stamp profile
ASTERIA_CUDA_PROFILE=1 timeout 90 $B train $S/gpt2-124m-soap.asteria --steps 8 --quiet --cache-dir $TC > "$out/profile-soap.txt" 2>&1
echo "profile rc=$?"
stamp summary
python3 .gpu/bench/summarize.py --skip 12 "asteria AdamW=$out/adamw.jsonl:$out/adamw.txt" \
  "SOAP S5 cholesky3=$out/soap-s5-chol3.jsonl:$out/soap-s5-chol3.txt" "SOAP S5 householder=$out/soap-s5-hh.jsonl:$out/soap-s5-hh.txt" \
  "SOAP S0 cholesky3=$out/soap-s0-chol3.jsonl:$out/soap-s0-chol3.txt" | tee "$out/summary.md"
grep -h "refresh host ms" "$out"/soap-*.txt
stamp done
