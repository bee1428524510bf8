#!/usr/bin/env bash
# Session 6 call 1: SOAP rows after the stale-bf16-basis fix (60589e6) with AdamW in the same
# call, 300 steps; an events profile of SOAP S=0 (40 steps); then bench/qr_variants.py on factors
# of a reference-SOAP run on the medium corpus's tokens.
set -uo pipefail
out=$1; mkdir -p $out
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
B=.gpu/bin/asteria; S=.gpu/specs; TC=/tmp/asteria-token-cache
start=$(date +%s); el() { echo $(( $(date +%s) - start )); }
sed 's/staleness = 0/staleness = 5/' $S/gpt2-124m-soap.asteria > $S/gpt2-124m-soap-s5.asteria
run() { local n=$1 steps=$2 spec=$3; shift 3
  env "$@" timeout 100 $B train $spec --steps $steps --quiet --cache-dir $TC --metrics $out/$n.jsonl > $out/$n.txt 2>&1; echo "$n rc=$? (+$(el)s)"; }
run soap-s5 300 $S/gpt2-124m-soap-s5.asteria
run adamw 300 $S/gpt2-124m-adamw.asteria
run soap-s0 300 $S/gpt2-124m-soap.asteria
run prof-s0 40 $S/gpt2-124m-soap.asteria ASTERIA_CUDA_PROFILE=events
python3 .gpu/bench/summarize.py --skip 12 "asteria AdamW=$out/adamw.jsonl:$out/adamw.txt" \
  "asteria SOAP S0=$out/soap-s0.jsonl:$out/soap-s0.txt" "asteria SOAP S5=$out/soap-s5.jsonl:$out/soap-s5.txt" | tee $out/summary.md
grep -h "refresh host ms" $out/soap-*.txt | cut -c1-300
tok=$(ls -S $TC/*.u16cache | head -1); ls -la $TC
timeout 240 python3 .gpu/bench/qr_variants.py $tok $out/qrv.jsonl --per-capture 6 > $out/qrv.txt 2>&1; echo "qrv rc=$? (+$(el)s)"
grep -v '"factor"' $out/qrv.txt | tail -8
cd $out && tar czf ../p22.tgz . && cd .. && rm -rf $out
