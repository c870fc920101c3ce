"""Rendering observations into token ids once (token in, token out) and the optional re-render check.

A trajectory's ids are the prompt ids, each turn's *sampled* ids and each observation's ids. An
observation (tool responses, a user / environment message) is rendered by the chat template as the
*delta* it adds after an assistant turn: the template's text for ``history + observation`` (with the
generation prompt for the next assistant turn) minus its text for ``history``. The delta starts with the
turn separator the template writes after the assistant's stop token (``"\\n"`` after ``<|im_end|>`` in
ChatML), which the model did not sample. Decoded text is never re-tokenized into training data.

That only equals rendering the whole conversation when the template is *prefix-preserving* (adding a
message never changes the text of earlier ones). `tokenization_mismatch` checks a finished trajectory
against a full re-render (``multi_turn.tokenization_check: strict``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_PROBE = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": "probe reply"}]


class TemplateError(ValueError):
    """The chat template cannot be used for token-in-token-out multi-turn rollouts."""


class ChatRenderer:
    """Renders observation deltas with a Hugging Face tokenizer's chat template."""

    def __init__(self, tokenizer: Any, tools: Sequence[dict] | None = None) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise TemplateError("the tokenizer has no chat template; multi-turn rollouts need one")
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.stop_text = str(tokenizer.eos_token)
        base = self.render(_PROBE)
        reply_at = base.rindex("probe reply") + len("probe reply")
        after = base[reply_at:]
        if not after.startswith(self.stop_text):
            raise TemplateError(
                f"the chat template does not close an assistant turn with the EOS token {self.stop_text!r} "
                f"(it writes {after!r}); the model's stop token would not match the template"
            )
        # What the template writes after the stop token: sampled by nobody, part of the next observation.
        self.separator = after[len(self.stop_text) :]

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        if self.tools:
            kwargs["tools"] = self.tools
        return str(self.tokenizer.apply_chat_template(list(messages), **kwargs))

    def observation_ids(self, messages: Sequence[dict], *, after_stop: bool = True) -> list[int]:
        """Ids of ``messages`` appended after an assistant turn, ending with the next generation prompt.

        ``after_stop``: the assistant turn ended with the stop token (else the template's stop text is
        written first, so the model sees a closed turn).
        """
        base = self.render(_PROBE)
        full = self.render([*_PROBE, *messages], add_generation_prompt=True)
        if not full.startswith(base):
            raise TemplateError(
                "the chat template is not prefix-preserving: appending a message changed the text of earlier "
                f"messages (first difference at char {_first_diff(base, full)}); multi-turn rollouts need a "
                "template that only appends"
            )
        delta = self.separator + full[len(base) :]
        if not after_stop:
            delta = self.stop_text + delta
        return list(self.tokenizer.encode(delta, add_special_tokens=False))

    def decode_turn(self, ids: Sequence[int]) -> str:
        """The assistant's text of one turn (stop token removed), for tool parsing and environments."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        return text[: -len(self.stop_text)] if text.endswith(self.stop_text) else text


def _first_diff(a: Sequence, b: Sequence) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def tokenization_mismatch(
    renderer: ChatRenderer, messages: Sequence[dict], ids: Sequence[int], *, ends_with_generation_prompt: bool
) -> str | None:
    """None when ``ids`` (prompt + response of one trajectory) decode to exactly what the chat template
    renders for ``messages``; otherwise the first differing token position and the tokens around it.

    Text is compared, not token lists: a sampled turn may be a valid but non-canonical tokenization of its
    text, which is fine for training. When the texts differ, the position is reported in tokens of the
    re-rendered conversation.
    """
    tok = renderer.tokenizer
    expected = renderer.render(messages, add_generation_prompt=ends_with_generation_prompt)
    got = tok.decode(list(ids), skip_special_tokens=False)
    # A trajectory ending on a sampled turn lacks what the template writes after it (the separator after
    # the stop token, or the whole closing when the turn was cut by the length limit).
    closings = ("", renderer.separator, renderer.stop_text + renderer.separator)
    if any(got + closing == expected for closing in closings):
        return None
    exp_ids = list(tok.encode(expected, add_special_tokens=False))
    pos = _first_diff(exp_ids, list(ids))
    return (
        f"token {pos}: the trajectory has {list(ids[pos : pos + 5])} ({tok.decode(list(ids[pos : pos + 5]))!r}) "
        f"where re-rendering the conversation gives {exp_ids[pos : pos + 5]} "
        f"({tok.decode(exp_ids[pos : pos + 5])!r}); char {_first_diff(got, expected)} of the text"
    )
