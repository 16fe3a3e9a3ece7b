#!/bin/bash
# Lightning DDP under torchrun: torchrun starts one process per GPU and sets the ranks; Lightning reads them
# (TorchElasticEnvironment) and starts nothing itself. Extra arguments are Hydra overrides.
#
# One node, 8 GPUs:
#   scripts/torchrun_example.sh
# Two nodes (run on each, same RUN_NAME and MASTER_ADDR, NODE_RANK 0 and 1):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 RUN_NAME=ssd300_2x8_try1 scripts/torchrun_example.sh
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 RUN_NAME=ssd300_2x8_try1 scripts/torchrun_example.sh
# CPU smoke test (2 processes, gloo):
#   NPROC=2 EXPERIMENT=demo scripts/torchrun_example.sh trainer=ddp_cpu trainer.devices=2 debug=fast
#
# Every rank enters train.py's @hydra.main by itself, so the run directory is passed explicitly: Hydra's
# default (outputs/<task>/<date>_<time>) is evaluated per process and can differ by a second between ranks.
set -euo pipefail

NNODES=${NNODES:-1}
NPROC=${NPROC:-8}                      # processes (GPUs) per node
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
EXPERIMENT=${EXPERIMENT:-ssd300_fp16_8gpu}
DATA_ROOT=${DATA_ROOT:-/coco}
if [ "${NNODES}" -gt 1 ] && [ -z "${RUN_NAME:-}" ]; then
    echo "set RUN_NAME to the same value on every node (it names the shared run directory)" >&2
    exit 2
fi
RUN_NAME=${RUN_NAME:-$(date +%Y-%m-%d_%H-%M-%S)}   # one node: computed once, here, for all its ranks
RUN_DIR=${RUN_DIR:-outputs/${EXPERIMENT}/${RUN_NAME}}

if [ "${EXPERIMENT}" = demo ] || [ "${EXPERIMENT}" = mobilenetv2_demo ]; then
    DATA_ARGS=()                       # demos generate their own data
else
    DATA_ARGS=("data.root=${DATA_ROOT}")
fi

exec torchrun \
    --nnodes "${NNODES}" \
    --nproc-per-node "${NPROC}" \
    --node-rank "${NODE_RANK}" \
    --master-addr "${MASTER_ADDR}" \
    --master-port "${MASTER_PORT}" \
    train.py \
    experiment="${EXPERIMENT}" \
    trainer.num_nodes="${NNODES}" \
    trainer.devices="${NPROC}" \
    "${DATA_ARGS[@]}" \
    hydra.run.dir="${RUN_DIR}" \
    "$@"
