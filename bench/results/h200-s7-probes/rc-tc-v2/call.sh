#!/usr/bin/env bash
# Session 7 call 2: rc-tc after the kernel fixes (coalesced column_dots and unit_lower_from_chol,
# L row-major, the Newton-Schulz product as M + M E in one TF32 GEMM). Refresh + 3xTF32 self-test,
# refresh times (calibrate), a phase-synchronised S=0 run (GPU time per refresh phase), then
# GPT-2 124M 300 steps: AdamW, S=5 rc-tc inline and on the side stream.
set -uo pipefail
out=$1; mkdir -p $out
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ASTERIA_CUDA_BF16_GEMM=cast
B=.gpu/bin/asteria; S=.gpu/specs; TC=/tmp/asteria-token-cache
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }
for f in eigenbasis gemm_3xtf32; do
  timeout 150 $B selftest --device cuda --filter $f > $out/selftest-$f.txt 2>&1
  echo "selftest $f rc=$? (+$(el)s)"; grep -E "passed|failed" $out/selftest-$f.txt | tail -1; grep -E "FAIL" $out/selftest-$f.txt | head -8
done
ASTERIA_CUDA_QR=rc-tc timeout 100 $B calibrate --device cuda --sizes 768,2304,3072 --reps 5 --threads 16 -o $out/cal-rc-tc.json > $out/cal-rc-tc.txt 2>&1
echo "cal rc=$? (+$(el)s)"; grep -i "gpu n" $out/cal-rc-tc.txt | head -4
sed 's/staleness = 0/staleness = 5/' $S/gpt2-124m-soap.asteria > $S/gpt2-124m-soap-s5.asteria
run() { local n=$1 steps=$2 spec=$3; shift 3
  env "$@" timeout 110 $B train $spec --steps $steps --quiet --cache-dir $TC --metrics $out/$n.jsonl > $out/$n.txt 2>&1; echo "$n rc=$? (+$(el)s)"; }
run phases-s0 40 $S/gpt2-124m-soap.asteria ASTERIA_CUDA_QR=rc-tc ASTERIA_CUDA_REFRESH_PHASES=sync
grep -h "refresh host ms" $out/phases-s0.txt | cut -c1-420
run adamw 300 $S/gpt2-124m-adamw.asteria
run tc-inline-s5 300 $S/gpt2-124m-soap-s5.asteria ASTERIA_CUDA_QR=rc-tc ASTERIA_CUDA_REFRESH=inline
run tc-side-s5 300 $S/gpt2-124m-soap-s5.asteria ASTERIA_CUDA_QR=rc-tc
python3 .gpu/bench/summarize.py --skip 12 "asteria AdamW=$out/adamw.jsonl:$out/adamw.txt" \
  "SOAP S5 rc-tc side=$out/tc-side-s5.jsonl:$out/tc-side-s5.txt" \
  "SOAP S5 rc-tc inline=$out/tc-inline-s5.jsonl:$out/tc-inline-s5.txt" | tee $out/summary.md
grep -h "refresh host ms" $out/tc-*.txt | cut -c1-420
cd $out && tar czf ../p72.tgz . && cd .. && rm -rf $out
