#!/usr/bin/env bash
# Validation loss at equal step time (BENCHMARKS.md), one H200 device call: GPT-2 124M on the
# medium corpus, for seeds 1337 and 7, each run given the same ~24.2 s of step time:
#   AdamW                          462 steps
#   SOAP max_precond_dim 2048, S=5 416 steps
#   SOAP max_precond_dim 10000, S=5 300 steps
# The step counts come from the mean steps bench/h200-async.sh measured on 2026-12-01 (AdamW
# 52.3 ms, SOAP 2048 S=5 58.1 ms, SOAP 10000 S=5 80.5 ms: 300 x 80.5 ms = 24.2 s); remeasure and
# change them here when those step times move. Each run's spec sets its own `steps` (so the
# cosine schedule spans the run) and `seed`; validation every 100 steps and at the end.
#
# Needs: the repository root as working directory, .gpu/ from bench/prepare-gpu, an NVIDIA GPU,
# CUDA 13 under $CUDA_HOME (default /usr/local/cuda), python3.
# Writes into OUT_DIR: NAME.jsonl (asteria --metrics) and NAME.txt per run, summary.txt (per run:
# steps, median and mean step, total step time, validation losses), and OUT_DIR.tgz.
# Takes ~5 minutes (six runs of ~45 s).
# Usage: bench/h200-equal-time.sh OUT_DIR
set -uo pipefail
out="${1:?usage: bench/h200-equal-time.sh OUT_DIR}"; mkdir -p "$out"
NAME=h200-equal-time; source "$(dirname "${BASH_SOURCE[0]}")/gpu-env.sh"
cat .gpu/BUILD 2>/dev/null
mk() { # base staleness steps seed -> spec path (beside the base, so its corpus path still holds)
  local f=$S/eq-$(basename "$1" .asteria)-s$2-n$3-seed$4.asteria
  sed -e "s/staleness = 0/staleness = $2/" -e "s/^  steps = 300/  steps = $3\n  seed = $4/" "$1" > "$f"
  echo "$f"
}
for seed in 1337 7; do
  for row in "adamw gpt2-124m-adamw 0 462" "mpd2048-s5 gpt2-124m-soap-mpd2048 5 416" "soap-s5 gpt2-124m-soap 5 300"; do
    set -- $row; name=$1-seed$seed
    spec=$(mk $S/$2.asteria $3 $4 $seed)
    grep -E "^  (steps|seed) =" "$spec" | tr '\n' ' '; echo
    echo "== $(date -u +%T) $name"
    timeout 150 $B train "$spec" --quiet --cache-dir "$TC" --metrics "$out/$name.jsonl" > "$out/$name.txt" 2>&1
    echo "rc=$?"; tail -n 1 "$out/$name.txt" | cut -c1-200
  done
done
python3 - "$out" <<'PY' | tee "$out/summary.txt"
import json, sys, glob, os
for f in sorted(glob.glob(sys.argv[1] + "/*.jsonl")):
    st = [json.loads(l) for l in open(f) if l.strip()]
    tr = [s for s in st if "step_ms" in s]; va = [s for s in st if "val_loss" in s]
    ms = sorted(s["step_ms"] for s in tr[12:])
    tot = sum(s["step_ms"] for s in tr) / 1e3
    print("%-22s steps %d  median %.1f ms  mean %.1f  total step time %.1f s  val %s" % (
        os.path.basename(f), len(tr), ms[len(ms)//2], sum(ms)/len(ms), tot,
        " ".join("%d:%.4f" % (v["step"], v["val_loss"]) for v in va)))
PY
tar czf "$out.tgz" -C "$out" .
