"""Every framework internal the integrations rely on (``ccld_plugin.integrations.internals``)
is there in the installed torch, megatron-core, DeepSpeed and (from shared/vendor)
Megatron-LM, with the parameters and attributes the plugin uses: a release that renames or
moves one fails here, not in a user's job."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from types import SimpleNamespace
from typing import Any

import pytest
from paths import MEGATRON_LM

from ccld_plugin.integrations.internals import INTERNALS, Internal

DISTRIBUTIONS = {"torch": "torch", "megatron-core": "megatron.core", "DeepSpeed": "deepspeed"}


def problems(entry: Internal, owner: Any, name: str) -> list[str]:
    """What ``owner.name`` lacks of what ``entry`` says the plugin relies on."""
    if not hasattr(owner, name):
        return [f"{entry.module}: no {entry.name}"]
    found: list[str] = []
    value = getattr(owner, name)
    if entry.params:
        names = list(inspect.signature(value).parameters)
        if inspect.isclass(owner):
            names = names[1:]  # self
        found += [f"{entry.name}: no parameter {p!r}" for p in entry.params if p not in names]
        last = entry.params[-1]
        if entry.position is not None and last in names and names.index(last) != entry.position:
            found.append(f"{entry.name}: {last!r} is parameter {names.index(last)}")
    if entry.instance_attrs:
        source = inspect.getsource(owner)
        for attr in entry.instance_attrs:
            if not hasattr(owner, attr) and not re.search(rf"self\.{attr}\s*[:=]", source):
                found.append(f"{entry.name}: instances have no {attr!r}")
    return found


def _resolve(entry: Internal) -> tuple[Any, str]:
    if entry.framework == "Megatron-LM":
        if not MEGATRON_LM.is_dir():
            pytest.skip(f"no Megatron-LM at {MEGATRON_LM} (shared/vendor)")
        if str(MEGATRON_LM) not in sys.path:
            sys.path.append(str(MEGATRON_LM))
    elif importlib.util.find_spec(DISTRIBUTIONS[entry.framework]) is None:
        pytest.skip(f"{entry.framework} is not installed")
    owner: Any = importlib.import_module(entry.module)
    *outer, name = entry.name.split(".")
    for part in outer:
        owner = getattr(owner, part)
    return owner, name


@pytest.mark.parametrize("entry", INTERNALS, ids=lambda e: f"{e.module}.{e.name}")
def test_internal_is_as_the_plugin_uses_it(entry: Internal) -> None:
    owner, name = _resolve(entry)
    assert problems(entry, owner, name) == []


def test_a_changed_internal_is_found():
    # train_step as a release might change it: iteration renamed, then moved first
    (entry,) = [e for e in INTERNALS if e.name == "train_step"]
    renamed = SimpleNamespace(train_step=lambda forward_step_func, *a, step=None: None)
    assert "train_step: no parameter 'iteration'" in problems(entry, renamed, "train_step")

    def moved(iteration, forward_step_func, data_iterator, model, optimizer,
              opt_param_scheduler, config, forward_backward_func):  # fmt: skip
        pass

    found = problems(entry, SimpleNamespace(train_step=moved), "train_step")
    assert found == ["train_step: 'iteration' is parameter 0"]
    (engine,) = [e for e in INTERNALS if e.name == "DeepSpeedEngine.step"]

    class DeepSpeedEngine:
        def __init__(self) -> None:
            self.steps_done = 0

        def step(self) -> None:
            pass

    assert problems(engine, DeepSpeedEngine, "step") == [
        f"DeepSpeedEngine.step: instances have no {a!r}" for a in engine.instance_attrs
    ]
    assert problems(engine, SimpleNamespace(), "step") == [
        "deepspeed.runtime.engine: no DeepSpeedEngine.step"
    ]


def test_the_table_in_the_docs_is_the_list():
    import importlib.util as iu

    from paths import REPO

    spec = iu.spec_from_file_location("internals_table", REPO / "tools" / "internals_table.py")
    assert spec is not None and spec.loader is not None
    tool = iu.module_from_spec(spec)
    spec.loader.exec_module(tool)
    text = tool.DOC.read_text()
    assert tool.with_table(text, tool.table()) == text, (
        "docs/integrations.md's internals table is stale: run python tools/internals_table.py"
    )
