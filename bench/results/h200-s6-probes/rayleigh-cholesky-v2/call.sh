#!/usr/bin/env bash
# Session 6 call 6: the Rayleigh-Cholesky QR with its second pass on Q_p·W1: refresh self-test
# (with 60 refreshes in a row), and 40 steps of GPT-2 124M SOAP S=0 with it.
set -uo pipefail
out=$1; mkdir -p $out/r
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
B=.gpu/bin/asteria; S=.gpu/specs; TC=/tmp/asteria-token-cache
timeout 80 $B selftest --device cuda --filter eigenbasis_refresh > $out/r/selftest-refresh.txt 2>&1; echo "selftest rc=$?"
grep -E "passed|FAIL|repeated" $out/r/selftest-refresh.txt | cut -c1-120
ASTERIA_CUDA_QR=rc timeout 60 $B train $S/gpt2-124m-soap.asteria --steps 40 --quiet --cache-dir $TC --metrics $out/r/rc-s0.jsonl > $out/r/rc-s0.txt 2>&1; echo "rc-s0 rc=$?"
tail -2 $out/r/rc-s0.txt | cut -c1-400
cd $out/r && tar czf ../p26.tgz . && cd .. && rm -rf r
