#!/usr/bin/env bash
# Train the tiny GPT of pretrain_gpt.py on 4 ranks: TP2 x PP2, with the repo's .venv.
# On a CPU-only machine the ranks use gloo and ccld_harness.megatron_cpu.
#
# 8 ranks, TP2 x PP2 x DP2, with the distributed optimizer:
#   NPROC=8 examples/megatron/run.sh --use-distributed-optimizer
# which runs
#   torchrun --nproc-per-node 8 examples/megatron/pretrain_gpt.py \
#       --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --train-iters 5 \
#       --use-distributed-optimizer
# Extra arguments are passed on to pretrain_gpt.py.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"

# One thread per rank: the ranks already share few cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Without a GPU: Megatron wraps small kernels in torch.compile at import; disabling dynamo
# up front saves ~2 s of import per rank (the CPU layer disables it at run time anyway).
if ! command -v nvidia-smi >/dev/null 2>&1; then
    export TORCHDYNAMO_DISABLE="${TORCHDYNAMO_DISABLE:-1}"
fi

exec "$python" -m torch.distributed.run \
    --nproc-per-node "${NPROC:-4}" \
    --master-port "${MASTER_PORT:-29500}" \
    "$repo/examples/megatron/pretrain_gpt.py" \
    --tensor-model-parallel-size 2 \
    --pipeline-model-parallel-size 2 \
    --train-iters "${TRAIN_ITERS:-5}" \
    "$@"
