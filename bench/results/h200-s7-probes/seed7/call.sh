#!/usr/bin/env bash
# Session 7 call 6: a second seed (train seed = 7) for the quality question: does rc-tc on the side
# stream at S=5 end behind S=0, where Householder does not? GPT-2 124M 300 steps: Householder S=0
# and S=5 (side), rc-tc S=5 side and inline.
set -uo pipefail
out=$1; mkdir -p $out
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ASTERIA_CUDA_BF16_GEMM=cast
B=.gpu/bin/asteria; S=.gpu/specs; TC=/tmp/asteria-token-cache
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }
sed 's/^  steps = 300/  steps = 300\n  seed = 7/' $S/gpt2-124m-soap.asteria > $S/seed7-s0.asteria
sed 's/staleness = 0/staleness = 5/' $S/seed7-s0.asteria > $S/seed7-s5.asteria
run() { local n=$1 steps=$2 spec=$3; shift 3
  env "$@" timeout 110 $B train $spec --steps $steps --quiet --cache-dir $TC --metrics $out/$n.jsonl > $out/$n.txt 2>&1; echo "$n rc=$? (+$(el)s)"; }
run hh-s5 300 $S/seed7-s5.asteria
run tc-side-s5 300 $S/seed7-s5.asteria ASTERIA_CUDA_QR=rc-tc
run tc-inline-s5 300 $S/seed7-s5.asteria ASTERIA_CUDA_QR=rc-tc ASTERIA_CUDA_REFRESH=inline
run hh-s0 300 $S/seed7-s0.asteria
for v in hh-s5 tc-side-s5 tc-inline-s5; do echo "== $v vs hh-s0"; python3 .gpu/bench/check_staleness.py $out/hh-s0.jsonl $out/$v.jsonl --tol 0.05 | tail -1; done
python3 .gpu/bench/summarize.py --skip 12 "SOAP S0 householder=$out/hh-s0.jsonl:$out/hh-s0.txt" "SOAP S5 householder side=$out/hh-s5.jsonl:$out/hh-s5.txt" \
  "SOAP S5 rc-tc side=$out/tc-side-s5.jsonl:$out/tc-side-s5.txt" "SOAP S5 rc-tc inline=$out/tc-inline-s5.jsonl:$out/tc-inline-s5.txt" | tee $out/summary.md
cd $out && tar czf ../p76.tgz . && cd .. && rm -rf $out
