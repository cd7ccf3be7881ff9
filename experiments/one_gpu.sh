#!/usr/bin/env bash
# The one-GPU offload runs of issue 21 (ZeRO-Cache), one device call each, on nvidia-h200:
#
#     cp -r ../shared/wheels .whl && cp DEEPSPEED_SDIST HJSON_WHEEL .whl/  # the peer, optional
#     # (pip download --no-deps --no-binary=:all: deepspeed==0.19.8; pip download --no-deps hjson)
#     cp -r ../shared/baselines .baselines
#     run(carry=[".whl", ".baselines"], timeout_s=600, command="bash experiments/one_gpu.sh llama_1b")
#
# llama_1b  `llama_1b` at the issue's 8 x 2048 tokens a step: `none`, the device's update after
#           the step (8 chunks in flight) and, in 4 microbatches, the update delayed by one step
#           between the next step's microbatches; split masters (the default), whole ones, and
#           AdamW's first moment in bfloat16; then the DeepSpeed ZeRO-Offload peer when
#           .baselines/ is carried (and DeepSpeed in .whl/) -> offload_policies_llama_1b.json.
#           ~8.5 min (501 s on an H100 on 2026-12-05, the peer included).
# 8b        `llama3_8b` at 16 x 8192 tokens a step (`policy=auto`): the delayed update between
#           microbatches, then the exact one after the step -> offload_8b_128k.json. ~8 min.
# bound     What bounds `llama_1b`'s offloaded step at 8 x 2048: its update's bytes (11.0 GB each
#           way with split masters) as runtime copies beside 0.25 s of matmuls (its step
#           without offload), in each order the runtime offers, a round trip of the same
#           arrays among them (copy_overlap_probe.py -> copy_overlap_probe_llama_1b_bytes.json;
#           78 s on an H100 on 2026-12-05); then a profile of the delayed update between 4
#           microbatches (profile_step.py -> profile_llama_1b_8x2048_delayed.*). ~4 min.
#
# Each run keeps its call under ~560 s (experiments/gpu_job.sh says how); copy what comes back
# into experiments/results/. Local dry checks: PYTHON=... OUT=... GPU_JOB_SKIP_SETUP=1 bash
# experiments/one_gpu.sh RUN.

set -uo pipefail

RUN=${1:-}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_job.sh"

usage() {
    echo "usage: bash experiments/one_gpu.sh setup|llama_1b|8b|bound"
}

V1="llama_1b optimizer, device update, 8 in flight"
V4="llama_1b/8x2048 in 4 optimizer, delayed, device update"

case $RUN in
setup)
    setup && echo "installed into /tmp/site"
    exit
    ;;
llama_1b)
    environment
    peer=()
    [[ -d $ROOT/.baselines ]] && peer=(--baselines "$ROOT/.baselines")
    XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=60 py offload_policies_llama_1b 550 150 \
        offload_throughput.py --out "$OUT/offload_policies_llama_1b.json" \
        --only "=llama_1b none;=$V1;=$V1, whole masters;=$V1, bf16 mu;=llama_1b/8x2048 in 4 none;=$V4;=$V4, whole masters;=$V4, bf16 mu" \
        "${peer[@]}"
    ;;
8b)
    environment
    V8="llama3_8b auto, 16 x 8192 in 16 microbatches"
    XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=95 py offload_8b_128k 550 260 offload_throughput.py \
        --warmup 3 --steps 2 --only "=$V8, delayed, device update;=$V8, device update" \
        --out "$OUT/offload_8b_128k.json"
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
