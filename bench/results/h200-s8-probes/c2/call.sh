#!/usr/bin/env bash
# Session 8 call 2: rc-tc with lower-fill Spotrf (the new default of the Rayleigh-Cholesky QRs;
# ASTERIA_CUDA_POTRF_FILL=upper is sessions 6-7's), and SOAP's step with bf16-output projection
# GEMMs and Adam writing bf16 (3 of 4 casts gone). Self-tests, refresh times per size, then
# GPT-2 124M 300 steps side by side and an events profile of SOAP S=0.
set -uo pipefail
out=$1; mkdir -p $out
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ASTERIA_CUDA_BF16_GEMM=cast
B=.gpu/bin/asteria; S=.gpu/specs; TC=/tmp/asteria-token-cache
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }
st() { local n=$1 f=$2; shift 2
  env "$@" timeout 150 $B selftest --device cuda --filter $f > $out/selftest-$n.txt 2>&1
  echo "selftest $n rc=$? (+$(el)s)"; grep -E "passed|failed" $out/selftest-$n.txt | tail -1; grep -E "FAIL" $out/selftest-$n.txt | head -8; }
st bf16out mat_mul_bf16_out
st soap soap_update
st rayleigh rayleigh
st rayleigh-upper rayleigh_tc ASTERIA_CUDA_POTRF_FILL=upper
for v in "rc-tc-lower ASTERIA_CUDA_QR=rc-tc" "rc-tc-upper ASTERIA_CUDA_QR=rc-tc ASTERIA_CUDA_POTRF_FILL=upper"; do
  set -- $v; n=$1; shift
  env "$@" ASTERIA_CUDA_REFRESH_PHASES=sync timeout 100 $B calibrate --device cuda --sizes 768,2304,3072 --reps 3 --threads 16 -o $out/cal-$n.json > $out/cal-$n.txt 2>&1
  echo "cal $n rc=$? (+$(el)s)"; grep -i "gpu\|phases" $out/cal-$n.txt | head -6
done
sed 's/staleness = 0/staleness = 5/' $S/gpt2-124m-soap.asteria > $S/gpt2-124m-soap-s5.asteria
run() { local n=$1 steps=$2 spec=$3; shift 3
  env "$@" timeout 110 $B train $spec --steps $steps --quiet --cache-dir $TC --metrics $out/$n.jsonl > $out/$n.txt 2>&1; echo "$n rc=$? (+$(el)s)"; }
run adamw 300 $S/gpt2-124m-adamw.asteria
run hh-s0 300 $S/gpt2-124m-soap.asteria
run hh-s5 300 $S/gpt2-124m-soap-s5.asteria
run tc-side-s5 300 $S/gpt2-124m-soap-s5.asteria ASTERIA_CUDA_QR=rc-tc
run tc-high-s5 300 $S/gpt2-124m-soap-s5.asteria ASTERIA_CUDA_QR=rc-tc ASTERIA_CUDA_SIDE_PRIORITY=high
run tc-s0 300 $S/gpt2-124m-soap.asteria ASTERIA_CUDA_QR=rc-tc
run prof-s0 40 $S/gpt2-124m-soap.asteria ASTERIA_CUDA_PROFILE=events
python3 .gpu/bench/summarize.py --skip 12 "asteria AdamW=$out/adamw.jsonl:$out/adamw.txt" \
  "SOAP S0 householder=$out/hh-s0.jsonl:$out/hh-s0.txt" "SOAP S5 householder side=$out/hh-s5.jsonl:$out/hh-s5.txt" \
  "SOAP S0 rc-tc=$out/tc-s0.jsonl:$out/tc-s0.txt" "SOAP S5 rc-tc side=$out/tc-side-s5.jsonl:$out/tc-side-s5.txt" \
  "SOAP S5 rc-tc side high=$out/tc-high-s5.jsonl:$out/tc-high-s5.txt" | tee $out/summary.md
grep -h "refresh host ms" $out/*-s?.txt | cut -c1-420
for v in tc-s0 tc-side-s5 tc-high-s5 hh-s5; do echo "== quality $v vs hh-s0"; python3 .gpu/bench/check_staleness.py $out/hh-s0.jsonl $out/$v.jsonl --tol 0.05 | tail -1; done
grep -E "soap_update|soap_factor" $out/prof-s0.txt | head -14
cd $out && tar czf ../c2.tgz . && cd .. && rm -rf $out
