#!/usr/bin/env bash
# Session 7 call 1: the 3xTF32 Rayleigh-Cholesky QR (ASTERIA_CUDA_QR=rc-tc) and inline refreshes
# (ASTERIA_CUDA_REFRESH=inline). Self-test of the refresh and 3xTF32 GEMM cases, GPU refresh times
# per size (asteria calibrate) for rc-tc vs householder, then GPT-2 124M 300 steps side by side:
# AdamW, SOAP S=0 / S=5 (Householder, side stream: the session-6 configuration), S=5 rc-tc on the
# side stream, S=5 rc-tc inline, S=0 rc-tc; an events profile of SOAP S=0 (40 steps).
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
for qr in rc-tc householder; do
  ASTERIA_CUDA_QR=$qr timeout 100 $B calibrate --device cuda --sizes 768,2304,3072 --reps 3 --threads 16 -o $out/cal-$qr.json > $out/cal-$qr.txt 2>&1
  echo "cal $qr rc=$? (+$(el)s)"; grep -i "gpu" $out/cal-$qr.txt | head -4
done
sed 's/staleness = 0/staleness = 5/' $S/gpt2-124m-soap.asteria > $S/gpt2-124m-soap-s5.asteria
run() { local n=$1 steps=$2 spec=$3; shift 3
  env "$@" timeout 110 $B train $spec --steps $steps --quiet --cache-dir $TC --metrics $out/$n.jsonl > $out/$n.txt 2>&1; echo "$n rc=$? (+$(el)s)"; }
run adamw 300 $S/gpt2-124m-adamw.asteria
run tc-inline-s5 300 $S/gpt2-124m-soap-s5.asteria ASTERIA_CUDA_QR=rc-tc ASTERIA_CUDA_REFRESH=inline
run tc-side-s5 300 $S/gpt2-124m-soap-s5.asteria ASTERIA_CUDA_QR=rc-tc
run hh-s5 300 $S/gpt2-124m-soap-s5.asteria
run tc-s0 300 $S/gpt2-124m-soap.asteria ASTERIA_CUDA_QR=rc-tc
run hh-s0 300 $S/gpt2-124m-soap.asteria
run prof-s0 40 $S/gpt2-124m-soap.asteria ASTERIA_CUDA_PROFILE=events ASTERIA_CUDA_QR=rc-tc
python3 .gpu/bench/summarize.py --skip 12 "asteria AdamW=$out/adamw.jsonl:$out/adamw.txt" \
  "SOAP S0 householder=$out/hh-s0.jsonl:$out/hh-s0.txt" "SOAP S5 householder side=$out/hh-s5.jsonl:$out/hh-s5.txt" \
  "SOAP S0 rc-tc=$out/tc-s0.jsonl:$out/tc-s0.txt" "SOAP S5 rc-tc side=$out/tc-side-s5.jsonl:$out/tc-side-s5.txt" \
  "SOAP S5 rc-tc inline=$out/tc-inline-s5.jsonl:$out/tc-inline-s5.txt" | tee $out/summary.md
grep -h "refresh host ms" $out/*-s?.txt | cut -c1-420
for v in tc-s0 tc-side-s5 tc-inline-s5 hh-s5; do echo "== staleness/quality $v vs hh-s0"; python3 .gpu/bench/check_staleness.py $out/hh-s0.jsonl $out/$v.jsonl --tol 0.05 | tail -2; done
cd $out && tar czf ../p71.tgz . && cd .. && rm -rf $out
