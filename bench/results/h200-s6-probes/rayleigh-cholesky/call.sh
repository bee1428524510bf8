#!/usr/bin/env bash
# Session 6 call 2: the Rayleigh-Cholesky QR (ASTERIA_CUDA_QR=rc). Refresh self-test (all
# methods), GPU refresh times per size for rc vs householder (asteria calibrate), GPT-2 124M
# AdamW and SOAP S=5 / S=0 with rc, 300 steps, side by side.
set -uo pipefail
out=$1; mkdir -p $out
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
B=.gpu/bin/asteria; S=.gpu/specs; TC=/tmp/asteria-token-cache
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }
timeout 150 $B selftest --device cuda --filter eigenbasis > $out/selftest-refresh.txt 2>&1
echo "selftest rc=$? (+$(el)s)"; grep -E "passed|failed" $out/selftest-refresh.txt | tail -2; grep -E "FAIL" $out/selftest-refresh.txt | head -8
for qr in rc householder; do
  ASTERIA_CUDA_QR=$qr timeout 100 $B calibrate --device cuda --sizes 768,2304,3072 --reps 3 --threads 16 -o $out/cal-$qr.json > $out/cal-$qr.txt 2>&1
  echo "cal $qr rc=$? (+$(el)s)"; grep -i "gpu" $out/cal-$qr.txt | head -4
done
sed 's/staleness = 0/staleness = 5/' $S/gpt2-124m-soap.asteria > $S/gpt2-124m-soap-s5.asteria
run() { local n=$1 steps=$2 spec=$3; shift 3
  env "$@" timeout 100 $B train $spec --steps $steps --quiet --cache-dir $TC --metrics $out/$n.jsonl > $out/$n.txt 2>&1; echo "$n rc=$? (+$(el)s)"; }
run adamw 300 $S/gpt2-124m-adamw.asteria
run rc-s5 300 $S/gpt2-124m-soap-s5.asteria ASTERIA_CUDA_QR=rc
run rc-s0 300 $S/gpt2-124m-soap.asteria ASTERIA_CUDA_QR=rc
python3 .gpu/bench/summarize.py --skip 12 "asteria AdamW=$out/adamw.jsonl:$out/adamw.txt" \
  "SOAP S0 rc=$out/rc-s0.jsonl:$out/rc-s0.txt" "SOAP S5 rc=$out/rc-s5.jsonl:$out/rc-s5.txt" | tee $out/summary.md
grep -h "refresh host ms" $out/rc-*.txt | cut -c1-400
cd $out && tar czf ../p23.tgz . && cd .. && rm -rf $out
