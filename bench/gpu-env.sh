# Sourced by the bench/h200-*.sh scripts (set NAME first, the script's name for messages): the
# CUDA environment of the GPU host, the carried binary, specs and token cache, and `stamp`
# (a timestamped progress line). Needs the repository root as working directory and .gpu/
# from bench/prepare-gpu.
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
B=.gpu/bin/asteria; S=.gpu/specs; TC="${TMPDIR:-/tmp}/asteria-token-cache"
[[ -x $B ]] || { echo "$NAME: $B is missing: run bench/prepare-gpu on the build machine and carry .gpu/" >&2; exit 2; }
start=$(date +%s)
stamp() { echo "== $(date -u +%H:%M:%S) (+$(( $(date +%s) - start ))s) $*"; }
