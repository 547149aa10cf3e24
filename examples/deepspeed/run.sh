#!/usr/bin/env bash
# Train the tiny MLP of train.py with DeepSpeed on 4 ranks, with the repo's .venv. The
# plugin is on through the "ccld" block of ds_config.json. Without a GPU, DeepSpeed runs on
# its CPU accelerator with gloo.
#
#   examples/deepspeed/run.sh --zero-stage 3
#   CCLD_FAULTS="compute-slow@1:factor=3" examples/deepspeed/run.sh --steps 30
#   LAUNCHER=deepspeed examples/deepspeed/run.sh            # the deepspeed launcher
#
# Extra arguments are passed on to train.py (--zero-stage, --steps, --ccld-set KEY=VALUE, ...).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
nproc="${NPROC:-4}"

# One thread per rank: the ranks already share few cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
    # DeepSpeed's import of torch.compile costs ~1.5 s per rank and is unused on CPU.
    export TORCHDYNAMO_DISABLE="${TORCHDYNAMO_DISABLE:-1}"
fi

if [[ "${LAUNCHER:-torchrun}" == deepspeed ]]; then
    # The deepspeed launcher runs "python -u train.py --local_rank=N ..." on this host.
    export PATH="$(dirname "$python"):$PATH"
    exec "$(dirname "$python")/deepspeed" --num_gpus "$nproc" \
        --master_port "${MASTER_PORT:-29500}" "$repo/examples/deepspeed/train.py" "$@"
fi
exec "$python" -m torch.distributed.run \
    --nproc-per-node "$nproc" \
    --master-port "${MASTER_PORT:-29500}" \
    "$repo/examples/deepspeed/train.py" "$@"
