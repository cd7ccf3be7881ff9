#!/usr/bin/env bash
# What bounds `llama_1b`'s offloaded step, one device call on nvidia-h200 or nvidia-h100-x1 (the
# offload records themselves re-run with experiments/bench.py):
#
#     cp -r ../shared/wheels .whl
#     run(carry=[".whl"], timeout_s=600, command="bash experiments/one_gpu.sh bound")
#
# bound     What bounds `llama_1b`'s offloaded step at 8 x 2048: its update's bytes (11.0 GB each
#           way with split masters) as runtime copies beside 0.25 s of matmuls (its step
#           without offload), in each order the runtime offers, a round trip of the same
#           arrays among them (copy_overlap_probe.py -> copy_overlap_probe_llama_1b_bytes.json;
#           78 s on an H100); then a profile of the delayed update between 4 microbatches
#           (profile_step.py -> profile_llama_1b_8x2048_delayed.*). ~4 min.
#
# The run keeps its call under ~560 s (experiments/gpu_job.sh says how). Local dry checks:
# PYTHON=... OUT=... GPU_JOB_SKIP_SETUP=1 bash experiments/one_gpu.sh bound.

set -uo pipefail

RUN=${1:-}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_job.sh"

usage() {
    echo "usage: bash experiments/one_gpu.sh setup|bound"
}

case $RUN in
setup)
    setup && echo "installed into /tmp/site"
    exit
    ;;
bound)
    environment
    export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=60
    py copy_overlap_probe_llama_1b_bytes 150 0 copy_overlap_probe.py --gib 10.24 --chunks 40 \
        --matmuls 182 --out "$OUT/copy_overlap_probe_llama_1b_bytes.json"
    py profile_llama_1b_8x2048_delayed 360 0 profile_step.py --steps 2 --warmup 3 \
        --out "$OUT/profile_llama_1b_8x2048_delayed.json" -- --config.train.microbatches=4 \
        --config.offload.policy=optimizer --config.offload.cpu_update=0 \
        --config.offload.delayed_update=true
    ;;
*)
    usage
    exit 2
    ;;
esac
finish
