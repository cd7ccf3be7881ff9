# What the GPU job scripts (one_gpu.sh, two_gpu.sh) share; sourced, not run. The caller sets
# RUN (its run's name) and may set PYTHON, OUT and GPU_JOB_LIMIT_S before sourcing.
#
# Each run keeps its whole device call under ~560 s: every python command runs under `timeout`,
# capped by what is left of that budget, and RUN_TIMEOUT_S (experiments/throughput.py's `run`)
# stops a slow child process so that its parent still writes its JSON (a child cut short is
# recorded as timed out). Results go to $OUT/<name>.json through the scripts' --out flags,
# everything printed to $OUT/<name>.log; at most 8 files come back from $OUT, so a run that
# leaves more packs all but its JSONs and logs into $OUT/run<RUN>_extras.tar.gz (the JSONs
# hold the command, the machine and the versions). The headline records are not made here:
# experiments/bench.py re-runs them and keeps them in experiments/records/.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
EXP=$ROOT/experiments
PY=${PYTHON:-python3}
LIMIT=${GPU_JOB_LIMIT_S:-560}  # Seconds, from the script's start, for the whole run.
OUT=${OUT:-/tmp/gpu_job_out}
mkdir -p "$OUT"

# The wheels the GPU machine lacks (../shared/wheels, copied to the git-ignored .whl/ and
# carried), tokamax with its xprof stand-in, and DeepSpeed from its sdist where .whl/ has it
# (the offload peer, ../shared/baselines/README.md).
setup() {
    (cd "$ROOT" \
        && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl/tokamax/*.whl \
        && cp -r .whl/tokamax/xprof-stub /tmp/site/xprof) || return 1
    local ds
    for ds in "$ROOT"/.whl/deepspeed-*.tar.gz; do
        [[ -f $ds ]] || continue
        DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site "$ds" || return 1
    done
}

environment() {  # Installs on a fresh machine; the exports every run takes.
    if [[ -z ${GPU_JOB_SKIP_SETUP:-} && ! -d /tmp/site/ml_collections ]]; then
        echo "setup: installing .whl/ into /tmp/site"
        setup || { echo "setup failed (is .whl carried?)"; exit 1; }
    fi
    export PYTHONPATH=/tmp/site XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
    fi
}

# py LOG TOTAL_S CHILD_S SCRIPT ARGS...: SCRIPT (in experiments/) under `timeout` of TOTAL_S
# seconds, or what is left of LIMIT if less; CHILD_S > 0 sets RUN_TIMEOUT_S for its children
# (at most that timeout less 30 s, so the parent outlives them and writes its JSON). Output
# is appended to $OUT/LOG.log.
py() {
    local log=$OUT/$1.log total=$2 child=$3
    shift 3
    local cap=$((LIMIT - SECONDS - 5))
    ((total > cap)) && total=$cap
    if ((total < 30)); then
        echo "skipped, ${cap} s left: $*" | tee -a "$log"
        return 124
    fi
    ((child > total - 30)) && child=$((total - 30))
    local env=()
    ((child > 0)) && env=(RUN_TIMEOUT_S="$child")
    echo "+ [${SECONDS} s] ${env[*]} timeout $total $PY $*" | tee -a "$log"
    (cd "$EXP" && env "${env[@]}" timeout -k 10 "$total" "$PY" "$@") 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "+ [${SECONDS} s] exit $rc: $1" | tee -a "$log"
    return "$rc"
}

finish() {  # At most 8 files come back from $OUT: pack the rest beside the JSONs and logs.
    local files
    files=$(find "$OUT" -type f | wc -l)
    if ((files > 8)); then
        (cd "$OUT" && find . -type f ! -name '*.json' ! -name '*.log' -print0 \
            | tar --null -czf "run${RUN}_extras.tar.gz" --remove-files -T -)
        find "$OUT" -mindepth 1 -type d -empty -delete
    fi
    echo "run $RUN: done in ${SECONDS} s"
    ls -la "$OUT"
}
