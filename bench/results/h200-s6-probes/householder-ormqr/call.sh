#!/usr/bin/env bash
# Session 6 call 4: Householder QR with Q formed by Sormqr instead of Sorgqr. Refresh self-test
# (all methods); GPU refresh times (asteria calibrate) for householder-ormqr vs householder;
# then the whole h200-async.sh call with ASTERIA_CUDA_QR=householder-ormqr when the self-test
# passed (householder otherwise), plus a SOAP S=5 row with householder from the same call.
set -uo pipefail
out=$1; mkdir -p $out/r
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
B=.gpu/bin/asteria; S=.gpu/specs; TC=/tmp/asteria-token-cache
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }
timeout 150 $B selftest --device cuda --filter eigenbasis > $out/r/selftest-refresh.txt 2>&1; st=$?
echo "selftest rc=$st (+$(el)s)"; grep -E "passed|failed" $out/r/selftest-refresh.txt | tail -2; grep -E "FAIL" $out/r/selftest-refresh.txt | head -8
grep -E "householder|ormqr" $out/r/selftest-refresh.txt | grep "783\|m=50 n=783" | cut -c1-120
for qr in householder-ormqr householder; do
  ASTERIA_CUDA_QR=$qr timeout 100 $B calibrate --device cuda --sizes 768,2304,3072 --reps 3 --threads 16 -o $out/r/cal-$qr.json > $out/r/cal-$qr.txt 2>&1
  echo "cal $qr rc=$? (+$(el)s)"; grep "GPU n" $out/r/cal-$qr.txt
done
qr=householder; [[ $st == 0 ]] && qr=householder-ormqr
echo "QR for the benchmark rows: $qr"
ASTERIA_CUDA_QR=$qr TORCH_STEPS=100 bash .gpu/bench/h200-async.sh $out/r 300 2>&1 | grep -E "rc=|PASS|FAIL|^\| |passed|failed"
sed 's/staleness = 0/staleness = 5/' $S/gpt2-124m-soap.asteria > $S/gpt2-124m-soap-s5.asteria
ASTERIA_CUDA_QR=householder timeout 100 $B train $S/gpt2-124m-soap-s5.asteria --steps 300 --quiet --cache-dir $TC --metrics $out/r/hh-s5.jsonl > $out/r/hh-s5.txt 2>&1; echo "hh-s5 rc=$? (+$(el)s)"
python3 .gpu/bench/summarize.py --skip 12 "asteria AdamW=$out/r/adamw.jsonl:$out/r/adamw.txt" \
  "SOAP S5 $qr=$out/r/soap-s5.jsonl:$out/r/soap-s5.txt" "SOAP S5 householder=$out/r/hh-s5.jsonl:$out/r/hh-s5.txt" | tee $out/r/summary-qr.md
grep -h "refresh host ms" $out/r/hh-s5.txt | cut -c1-300
rm -f $out/bench-results.tgz; cd $out/r && tar czf ../p24.tgz . && cd .. && rm -rf r
