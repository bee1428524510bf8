#!/usr/bin/env bash
# Does rc-tc (ASTERIA_CUDA_QR=rc-tc) train like Householder at S=5 now that its Newton-Schulz
# step is gated on ||MtM - I||_F (session 7's open question, BENCHMARKS.md)? One H200 call:
# the rc-tc refresh self-test (with the stiff-factor case), then GPT-2 124M 300 steps for two
# seeds: Householder S=0, rc-tc S=5 on the side stream, Householder S=5; check_staleness.py of
# each S=5 run against its seed's S=0, and the refreshers' Newton-Schulz / CholeskyQR counts.
# Usage: bench/h200-rctc-check.sh OUT_DIR   (repository root, .gpu/ from bench/prepare-gpu)
set -uo pipefail
out="${1:?usage: bench/h200-rctc-check.sh OUT_DIR}"; mkdir -p "$out"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ASTERIA_CUDA_BF16_GEMM=cast
B=.gpu/bin/asteria; S=.gpu/specs; TC=/tmp/asteria-token-cache
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }
timeout 200 $B selftest --device cuda --filter rayleigh_tc > "$out/selftest-rctc.txt" 2>&1
echo "selftest rc=$? (+$(el)s)"; grep -E "passed|failed" "$out/selftest-rctc.txt" | tail -1; grep FAIL "$out/selftest-rctc.txt" | head -5
run() { local n=$1 spec=$2; shift 2
  env "$@" timeout 120 $B train "$spec" --steps 300 --quiet --cache-dir $TC --metrics "$out/$n.jsonl" > "$out/$n.txt" 2>&1
  echo "$n rc=$? (+$(el)s)"; grep -ho "Rayleigh-Cholesky 3xTF32 [0-9]* ([^)]*), Householder fallbacks [0-9]*" "$out/$n.txt" | head -1; }
for seed in 1337 7; do
  sed "s/^  steps = 300/  steps = 300\n  seed = $seed/" $S/gpt2-124m-soap.asteria > $S/seed$seed-s0.asteria
  sed 's/staleness = 0/staleness = 5/' $S/seed$seed-s0.asteria > $S/seed$seed-s5.asteria
  run hh-s0-$seed $S/seed$seed-s0.asteria ASTERIA_CUDA_QR=householder
  run tc-s5-$seed $S/seed$seed-s5.asteria ASTERIA_CUDA_QR=rc-tc
  run hh-s5-$seed $S/seed$seed-s5.asteria ASTERIA_CUDA_QR=householder
  for v in tc-s5 hh-s5; do
    python3 .gpu/bench/check_staleness.py "$out/hh-s0-$seed.jsonl" "$out/$v-$seed.jsonl" --tol 0.05 | tail -1
  done
done
( cd "$out" && tar czf ../rctc-check.tgz . )
