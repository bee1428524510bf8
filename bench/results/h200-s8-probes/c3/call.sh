#!/usr/bin/env bash
# Session 8 call 3: does rc-tc (lower-fill Spotrf, this build) train like Householder? GPT-2 124M
# 300 steps for seeds 7 and 42 (call 2 had 1337): Householder S=0 and S=5, rc-tc S=0 and S=5
# (side stream, default priority); check_staleness.py of each against its seed's Householder S=0.
# (Run with commit 19f8a85's binary, whose default QR was still Householder and whose side stream
# was at the lowest priority: the runs without ASTERIA_CUDA_QR are Householder, as their logs'
# "QR Householder (orgqr)" lines say. With today's defaults, set ASTERIA_CUDA_QR=householder.)
set -uo pipefail
out=$1; mkdir -p $out
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ASTERIA_CUDA_BF16_GEMM=cast
B=.gpu/bin/asteria; S=.gpu/specs; TC=/tmp/asteria-token-cache
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }
run() { local n=$1 spec=$2; shift 2
  env "$@" timeout 110 $B train "$spec" --steps 300 --quiet --cache-dir $TC --metrics "$out/$n.jsonl" > "$out/$n.txt" 2>&1
  echo "$n rc=$? (+$(el)s)"; }
for seed in 7 42; do
  sed "s/^  steps = 300/  steps = 300\n  seed = $seed/" $S/gpt2-124m-soap.asteria > $S/seed$seed-s0.asteria
  sed 's/staleness = 0/staleness = 5/' $S/seed$seed-s0.asteria > $S/seed$seed-s5.asteria
  run hh-s0-$seed $S/seed$seed-s0.asteria
  run tc-s5-$seed $S/seed$seed-s5.asteria ASTERIA_CUDA_QR=rc-tc
  run tc-s0-$seed $S/seed$seed-s0.asteria ASTERIA_CUDA_QR=rc-tc
  run hh-s5-$seed $S/seed$seed-s5.asteria
  for v in tc-s5 tc-s0 hh-s5; do
    echo -n "seed $seed $v: "; python3 .gpu/bench/check_staleness.py "$out/hh-s0-$seed.jsonl" "$out/$v-$seed.jsonl" --tol 0.05 | tail -1
  done
done
python3 .gpu/bench/summarize.py --skip 12 $(for s in 7 42; do for v in hh-s0 hh-s5 tc-s0 tc-s5; do echo "$v seed$s=$out/$v-$s.jsonl:$out/$v-$s.txt"; done; done) | tee $out/summary.md
cd $out && tar czf ../c3.tgz . && cd .. && rm -rf $out
