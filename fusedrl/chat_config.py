"""Checks of the model folder's chat template, called by `fusedrl.config_checks.validate` so that a folder whose
prompts cannot be rendered, or whose responses would never stop, is named before Ray starts instead of
failing in the data pipeline (no template) or silently generating to ``data.max_response_length`` every
time (a template whose assistant turn ends with a token the engine does not stop on).

The data pipeline renders every prompt from chat messages (`fusedrl.data.dataset.RLDataset`: prompts are
``[{role, content}]`` lists, plain strings are refused), and so do agent loops, so a PPO run always needs
the template. The engine stops on the tokenizer's eos token (the trainer's ``stop_token_ids``) and on the
eos ids of ``generation_config.json`` (vLLM's own stop set); the token the template writes right after an
assistant message must be one of those.

A path without a ``config.json`` (a hub id, a test's placeholder) gets no check here, as in
`fusedrl.architecture_config`.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

_PROBE = "fusedrl-end-of-turn-probe"
_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def _generation_eos_ids(path: str) -> set[int]:
    try:
        with open(os.path.join(path, "generation_config.json")) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return set()
    if isinstance(eos, int):
        return {eos}
    if isinstance(eos, list):
        return {e for e in eos if isinstance(e, int)}
    return set()


def _fingerprint(path: str) -> tuple:
    out = []
    for name in _FILES:
        try:
            out.append(os.stat(os.path.join(path, name)).st_mtime_ns)
        except OSError:
            out.append(None)
    return tuple(out)


def template_problems(path: str) -> list[str]:
    """Problems of ``path``'s chat template and end-of-turn token (module docstring)."""
    return list(_template_problems(str(path), _fingerprint(str(path))))


@functools.lru_cache(maxsize=16)
def _template_problems(path: str, _fingerprint: tuple) -> tuple[str, ...]:
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception:  # noqa: BLE001 - no loadable tokenizer: the trainer's own load reports it
        return ()
    key = "`actor_rollout_ref.model.path`"
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return (
            f"{key}={path}: the tokenizer has no chat template, and fusedrl renders every prompt from chat "
            "messages (data.prompt_key). Use an instruct/chat model, or add the template to the folder: "
            f"a `chat_template.jinja` file or a `chat_template` entry in {path}/tokenizer_config.json.",
        )
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return (
            f"{key}={path}: the tokenizer has no eos token, so the engine cannot stop a response. Set "
            f"`eos_token` in {path}/tokenizer_config.json to the token the chat template ends an assistant "
            "turn with.",
        )
    stops = {int(eos), *_generation_eos_ids(path)}
    messages = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - templates that refuse this probe (role rules): nothing to check
        return ()
    if not isinstance(text, str) or _PROBE not in text:
        return ()  # the template drops or rewrites the assistant's text: the end token cannot be read off
    suffix = text[text.rindex(_PROBE) + len(_PROBE) :]
    ids = tokenizer.encode(suffix, add_special_tokens=False) if suffix else []
    first = ids[0] if ids else None
    if first in stops:
        return ()
    names = ", ".join(f"{tokenizer.convert_ids_to_tokens(i)!r} (id {i})" for i in sorted(stops))
    written = f"{suffix[:40]!r} (first token {tokenizer.convert_ids_to_tokens(first)!r}, id {first})"
    if first is None:
        written = "nothing"
    return (
        f"{key}={path}: the chat template ends an assistant turn with {written}, which is not a token the "
        f"engine stops on ({names}), so responses would never end before data.max_response_length. Make "
        f"them agree: set `eos_token` in {path}/tokenizer_config.json (or eos_token_id in "
        f"{path}/generation_config.json) to the template's end-of-turn token, or fix the template "
        "(`chat_template` in tokenizer_config.json / chat_template.jinja).",
    )


def chat_template_problems(run: Any) -> list[str]:
    """Problems of the policy's chat template (module docstring); ``run``: the typed sections."""
    from fusedrl.architecture_config import model_config

    path = run.model.path
    if model_config(path) is None:
        return []
    return template_problems(str(path))
