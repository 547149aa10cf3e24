"""The plugin turned on by the frameworks' own configuration, through the start-up hook
installed with the package, with nothing of ours in the script or on the command line:
a DeepSpeed script whose config has a ``"ccld"`` block (``ds_block.py``, under the
deepspeed launcher and under torchrun), and Megatron-LM's own ``pretrain_gpt.py --ccld``
(shared/vendor, on CPU through ``ccld_harness/megatron_lm_site``); each with a compute
hang and a straggler, named with rank, cause and group."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest
from job_runner import FAST, NO_SHORT_HANGS, SCRIPTS, TERMINAL, board_roles, run_until_verdict
from omegaconf import OmegaConf
from paths import MEGATRON_LM

import ccld_harness
from ccld_harness.launch import free_port

BIN = Path(sys.executable).parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--master-addr", "127.0.0.1"]


def _torchrun(world: int) -> list[str]:
    return [*TORCHRUN, "--master-port", str(free_port()), "--nproc-per-node", str(world)]


def _deepspeed(world: int) -> list[str]:
    return [str(BIN / "deepspeed"), "--num_gpus", str(world), "--master_port", str(free_port())]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", **extra}
    env.pop("CCLD_AUTOLOAD", None)  # the hook as installed: on
    # the deepspeed launcher finds the Python that runs the ranks on PATH
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _settings(tmp: Path, *sets: str) -> list[str]:
    """The plugin's settings of a test job: its boards kept in ``tmp / "j"``, its verdicts
    in ``tmp / "verdicts.jsonl"``."""
    return [
        *FAST,
        *sets,
        f"board.dir={tmp}",
        "job=j",
        "board.cleanup=false",
        f"sinks.jsonl={tmp / 'verdicts.jsonl'}",
    ]


def _log(tmp: Path) -> str:
    return (tmp / "job.log").read_text(errors="replace")[-4000:]


# ---------------------------------------------------------------------- DeepSpeed
def _ds_job(
    tmp: Path, launcher: list[str], fault: str, sets: tuple[str, ...] = (), end_on=TERMINAL
) -> list[dict]:
    block = OmegaConf.to_container(OmegaConf.from_dotlist(_settings(tmp, *sets)))
    config = {
        "train_micro_batch_size_per_gpu": 16,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "ccld": {"enabled": True, **block},  # type: ignore[dict-item]
    }
    (tmp / "ds_config.json").write_text(json.dumps(config))
    config_arg = ["--deepspeed_config", str(tmp / "ds_config.json")]
    cmd = [*launcher, str(SCRIPTS / "ds_block.py"), *config_arg]
    env = _env(FAULT=fault, STEPS="60", DS_ACCELERATOR="cpu")
    verdicts, _ = run_until_verdict(cmd, env, tmp / "verdicts.jsonl", tmp / "job.log", 240, end_on)
    return verdicts


def test_deepspeed_block_alone_hang_under_the_deepspeed_launcher(tmp_path):
    verdicts = _ds_job(tmp_path, _deepspeed(4), "hang@2:5")
    assert [(v["kind"], v["cause"], v["ranks"]) for v in verdicts] == [("hang", "compute", [2])], (
        verdicts,
        _log(tmp_path),
    )
    (v,) = verdicts
    assert (v["group"]["role"], v["group"]["ranks"]) == ("dp", [0, 1, 2, 3])
    assert v["step"] == 5  # steps from the engine (global_steps)
    roles = board_roles(tmp_path / "j")
    assert sorted(roles) == [0, 1, 2, 3] and all("dp" in roles[r] for r in roles), roles


def test_deepspeed_block_alone_straggler_under_torchrun(tmp_path):
    verdicts = _ds_job(tmp_path, _torchrun(4), "slow@1:0.15", NO_SHORT_HANGS, {"slow"})
    slow = [v for v in verdicts if v["kind"] == "slow"]
    assert slow and (slow[0]["cause"], slow[0]["ranks"]) == ("compute", [1]), (
        verdicts,
        _log(tmp_path),
    )
    assert slow[0]["group"]["role"] == "dp"
    assert not [v for v in verdicts if v["ranks"] != [1]]


# ---------------------------------------------------------------------- Megatron-LM
# A tiny GPT, TP2 x PP2 on 4 ranks, mock data: ranks (0, 1) and (2, 3) are TP pairs,
# (0, 2) and (1, 3) pipelines. The last three flags are what the local (non Transformer
# Engine) layers need on CPU.
GPT = shlex.split(
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 2 "
    "--hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 2 --global-batch-size 4 --eval-iters 0 --eval-interval 1000 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --distributed-backend gloo "
    "--lr 1e-4 --log-interval 1 --distributed-timeout-minutes 5 --transformer-impl local "
    "--no-persist-layer-norm --no-gradient-accumulation-fusion"
)

needs_megatron_lm = pytest.mark.skipif(
    not (MEGATRON_LM / "pretrain_gpt.py").is_file(),
    reason=f"no Megatron-LM at {MEGATRON_LM} (shared/vendor)",
)


def _pretrain_gpt(
    tmp: Path, faults: str, iterations: int, *sets: str, end_on=TERMINAL
) -> list[dict]:
    site = Path(ccld_harness.__file__).parent / "megatron_lm_site"
    ccld = ["--ccld", *sum((["--ccld-set", s] for s in _settings(tmp, *sets)), [])]
    cmd = [*_torchrun(4), str(MEGATRON_LM / "pretrain_gpt.py"), *GPT]
    cmd += ["--train-iters", str(iterations), *ccld]
    env = _env(CCLD_FAULTS=faults, PYTHONPATH=os.pathsep.join([str(site), str(MEGATRON_LM)]))
    verdicts, _ = run_until_verdict(
        cmd, env, tmp / "verdicts.jsonl", tmp / "job.log", 300, end_on, cwd=tmp
    )
    return verdicts


@needs_megatron_lm
def test_megatron_lm_pretrain_gpt_ccld_hang(tmp_path):
    verdicts = _pretrain_gpt(tmp_path, "compute-hang@1:step=3", 10)
    assert [(v["kind"], v["cause"], v["ranks"]) for v in verdicts] == [("hang", "compute", [1])], (
        verdicts,
        _log(tmp_path),
    )
    (v,) = verdicts
    assert (v["group"]["role"], v["group"]["ranks"]) == ("tp", [0, 1])
    assert v["step"] == 3  # Megatron-LM's iteration
    # every parallel_state group registered with its role, after initialize_model_parallel
    roles = board_roles(tmp_path / "j")
    assert sorted(roles) == [0, 1, 2, 3] and all({"tp", "pp", "dp"} <= roles[r] for r in roles)


@needs_megatron_lm
def test_megatron_lm_pretrain_gpt_ccld_straggler(tmp_path):
    verdicts = _pretrain_gpt(
        tmp_path, "compute-slow@2:factor=4,step=2", 30, *NO_SHORT_HANGS, end_on={"slow"}
    )
    slow = [v for v in verdicts if v["kind"] == "slow"]
    assert slow and (slow[0]["cause"], slow[0]["ranks"]) == ("compute", [2]), (
        verdicts,
        _log(tmp_path),
    )
    assert slow[0]["group"]["role"] in ("tp", "pp") and 2 in slow[0]["group"]["ranks"]
    assert not [v for v in verdicts if v["ranks"] != [2]]
