"""Supervised fine-tuning data: chat conversations tokenised with a loss mask on the assistant turns.

A parquet file holds one conversation per row in either of two forms:

* a ``messages`` column (``messages_key``): a list of ``{role, content}`` dicts, any number of turns;
* ``prompt`` / ``response`` columns (``prompt_key`` / ``response_key``): the prompt a string (or a list of
  messages) and the response a string; the row becomes ``[..., {user: prompt}, {assistant: response}]``.

The file decides: if it has the messages column, that is used; otherwise both pair columns must exist.

Loss mask. The chat template is rendered turn by turn: the text of ``messages[:k]`` must be a prefix of the
text of ``messages[:k+1]`` (the *prefix property*), so every turn owns the characters it adds. For an
assistant turn the rendering of ``messages[:k]`` with the generation prompt (``<|im_start|>assistant\\n`` in
ChatML) is the turn's header, which the model is *given*; the rest, up to and including the last end-of-turn
token (the tokenizer's EOS token, ``<|im_end|>``), is what the model must *produce*: loss mask 1. What the
template writes after the end token (ChatML's newline) and every system/user/tool turn get mask 0. Each piece
is tokenised on its own and the pieces are concatenated, so mask boundaries are exact token boundaries. A
template that rewrites earlier turns when a later one is appended (e.g. one that strips reasoning from past
assistant turns) breaks the prefix property; such a row is reported as a `DataError` instead of being
trained on a mask that is silently wrong.

Tool conversations (agentic warm starts): assistant messages may carry OpenAI-style ``tool_calls``
(``[{type: function, function: {name, arguments}}]``, content empty or null) and ``tool`` role messages hold
the tool responses; an optional ``tools`` column (a list of tool schemas, or a JSON string of one) is passed
to the chat template as ``tools=``. The template renders the calls (e.g. Qwen's ``<tool_call>`` blocks); the
loss stays on assistant tokens only, tool responses and the tool list are context. Calls written inline in
the assistant's text need nothing special.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from fusedrl.data.dataset import (
    DataError,
    _as_file_list,
    _epoch_seed,
    _file_tags,
    _read_parquet,
    tokenizer_pad_id,
)

logger = logging.getLogger(__name__)

SFT_TRUNCATION_MODES = ("error", "right")
_MAX_REPORTED_PROBLEMS = 5
TRAINED_ROLE = "assistant"

Piece = tuple[str, bool]  # (text, trained)


class _TemplateError(Exception):
    """The chat template does not render this conversation turn by turn (message for the row report)."""


def _check_conversation(messages: Any, column: str) -> str | None:
    """None if ``messages`` is a usable conversation, else what is wrong with it and how to fix it."""
    if isinstance(messages, str):
        return (
            f"column {column!r} holds a plain string; store a list of "
            '{"role": ..., "content": ...} messages (or use the prompt/response columns)'
        )
    if not isinstance(messages, (list, tuple)):
        return f"column {column!r} holds a {type(messages).__name__}, expected a list of {{role, content}} messages"
    if not messages:
        return f"column {column!r} is an empty conversation"
    for k, message in enumerate(messages):
        if not isinstance(message, Mapping):
            return f"message {k} is a {type(message).__name__}, expected a {{role, content}} dict"
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            return f"message {k} has no role (got {role!r}); use system, user or assistant"
        calls = message.get("tool_calls")
        if calls is not None:
            problem = _check_tool_calls(calls, role)
            if problem is not None:
                return f"message {k}: {problem}"
            if content is None:  # an assistant turn that only calls tools (OpenAI format)
                continue
        if not isinstance(content, str):
            return f"message {k} (role {role!r}) has content {content!r}, expected a string"
        if role == TRAINED_ROLE and not content.strip() and not calls:
            return f"message {k} is an assistant turn with empty content; there is nothing to learn from it"
    if not any(m["role"] == TRAINED_ROLE for m in messages):
        return "the conversation has no assistant turn, so no token would be trained; remove the row"
    if messages[0]["role"] == TRAINED_ROLE:
        return (
            "the conversation starts with an assistant turn; its header cannot be rendered on its own. "
            "Put a system or user message first"
        )
    return None


def _check_tool_calls(calls: Any, role: str) -> str | None:
    """None if ``calls`` is a usable OpenAI-style ``tool_calls`` list of an assistant message."""
    if role != TRAINED_ROLE:
        return f"only assistant messages carry tool_calls (this one is {role!r})"
    if not isinstance(calls, (list, tuple)) or not calls:
        return "tool_calls must be a non-empty list of {type: function, function: {name, arguments}}"
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn.get("name"):
            return f"tool_calls[{j}] needs function.name (OpenAI format {{type: function, function: {{name, arguments}}}})"
    return None


def _clean(messages: Sequence[Mapping]) -> list[dict]:
    # Parquet structs give every message every key seen in the column (None where absent); drop those.
    # An assistant turn that only calls tools keeps an empty content, as chat templates expect the key.
    out = [_drop_none(m) for m in messages]
    for m in out:
        m.setdefault("content", "")
    return out


def _drop_none(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_drop_none(v) for v in value]
    return value


def render_pieces(
    tokenizer: Any, messages: Sequence[Mapping], eos_token: str | None, tools: Sequence[Mapping] | None = None
) -> list[Piece]:
    """The conversation rendered by the chat template, cut into ``(text, trained)`` pieces.

    Concatenated, the pieces are exactly ``apply_chat_template(messages, tokenize=False, tools=tools)``.
    Raises `_TemplateError` when the template does not have the prefix property on this conversation.
    """
    extra = {"tools": list(tools)} if tools else {}

    def render(upto: int, generation_prompt: bool = False) -> str:
        text = tokenizer.apply_chat_template(
            list(messages[:upto]), tokenize=False, add_generation_prompt=generation_prompt, **extra
        )
        if not isinstance(text, str):
            raise _TemplateError(f"the chat template returned a {type(text).__name__}, expected text")
        return text

    pieces: list[Piece] = []
    prev = ""
    for k, message in enumerate(messages):
        full = render(k + 1)
        if not full.startswith(prev):
            raise _TemplateError(
                f"rendering messages[:{k + 1}] does not extend the rendering of messages[:{k}] (the template "
                "rewrites earlier turns), so the assistant tokens cannot be located"
            )
        if message["role"] != TRAINED_ROLE:
            pieces.append((full[len(prev) :], False))
            prev = full
            continue
        header = render(k, generation_prompt=True)
        if not header.startswith(prev) or not full.startswith(header):
            raise _TemplateError(
                f"the generation prompt after messages[:{k}] is not where assistant message {k} starts in the "
                "rendered conversation, so its header cannot be separated from its content"
            )
        body = full[len(header) :]
        cut = body.rfind(eos_token) if eos_token else -1
        end = cut + len(eos_token) if cut >= 0 and eos_token else len(body)
        pieces.append((header[len(prev) :], False))
        pieces.append((body[:end], True))
        pieces.append((body[end:], False))
        prev = full
    return [(text, trained) for text, trained in pieces if text]


def _tools_column(table: Any) -> list[Any]:
    """Per row: the tool schemas of an optional ``tools`` column (a list, or a JSON string of one)."""
    import json

    if "tools" not in table.column_names:
        return [None] * table.num_rows
    out = []
    for value in table.column("tools").to_pylist():
        out.append(_drop_none(json.loads(value) if isinstance(value, str) else value) or None)
    return out


def _messages_from_pair(prompt: Any, response: Any, prompt_key: str, response_key: str) -> list[dict] | str:
    """The conversation of a prompt/response row, or what is wrong with the row."""
    if isinstance(prompt, str):
        if not prompt.strip():
            return f"column {prompt_key!r} is empty"
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)):
        messages = _clean(prompt) if all(isinstance(m, Mapping) for m in prompt) else list(prompt)
    else:
        return (
            f"column {prompt_key!r} holds a {type(prompt).__name__}, expected a string or a list of messages"
        )
    if not isinstance(response, str) or not response.strip():
        return f"column {response_key!r} is {response!r}, expected a non-empty string"
    return [*messages, {"role": TRAINED_ROLE, "content": response}]


class SFTDataset:
    """Tokenised conversations with a loss mask, from one or more parquet files.

    Args:
        files: a parquet path or a list of them; rows are concatenated in file order.
        tokenizer: a Hugging Face tokenizer with a chat template (its EOS token ends an assistant turn).
        max_length: longest conversation in tokens (``data.max_length``).
        messages_key / prompt_key / response_key: column names (``data.messages_key`` ...).
        truncation: a conversation longer than ``max_length``: ``"error"`` raises a `DataError` naming the
            file and row, ``"right"`` keeps the first ``max_length`` tokens.

    Each item is ``{"input_ids": list[int], "loss_mask": list[int], "uid": "<file stem>-<row>"}``;
    ``loss_mask[t] == 1`` when token ``t`` is a training target (predicted from the tokens before it).
    """

    def __init__(
        self,
        files: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        max_length: int,
        messages_key: str = "messages",
        prompt_key: str = "prompt",
        response_key: str = "response",
        truncation: str = "error",
    ) -> None:
        if truncation not in SFT_TRUNCATION_MODES:
            raise ValueError(f"truncation must be one of {SFT_TRUNCATION_MODES}, got {truncation!r}")
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length <= 1:
            raise ValueError(f"max_length must be an integer > 1, got {max_length!r}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(
                "the tokenizer has no chat template, so conversations cannot be rendered; use a chat "
                "tokenizer or set tokenizer.chat_template"
            )
        self.files = _as_file_list(files)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.messages_key = messages_key
        self.prompt_key = prompt_key
        self.response_key = response_key
        self.truncation = truncation
        self.eos_token: str | None = getattr(tokenizer, "eos_token", None)
        self.num_truncated = 0
        self.num_without_loss = 0  # right-truncated rows that lost every assistant token
        self._input_ids: list[list[int]] = []
        self._loss_mask: list[list[int]] = []
        self._uid: list[str] = []
        for path, tag in zip(self.files, _file_tags(self.files)):
            self._load_file(path, tag)
        if self.num_truncated:
            logger.warning(
                "SFTDataset: right-truncated %d conversations to max_length=%d tokens (%d of them kept no "
                "assistant token and add nothing to the loss)",
                self.num_truncated,
                max_length,
                self.num_without_loss,
            )

    # ------------------------------------------------------------------ loading
    def _conversations(self, path: str, table: Any) -> list[Any]:
        """Per row: the message list, or a string saying what is wrong with the row."""
        names = table.column_names
        if self.messages_key in names:
            column = table.column(self.messages_key).to_pylist()
            out: list[Any] = []
            for messages in column:
                problem = _check_conversation(messages, self.messages_key)
                out.append(problem if problem is not None else _clean(messages))
            return out
        if self.prompt_key in names and self.response_key in names:
            prompts = table.column(self.prompt_key).to_pylist()
            responses = table.column(self.response_key).to_pylist()
            out = []
            for prompt, response in zip(prompts, responses):
                messages = _messages_from_pair(prompt, response, self.prompt_key, self.response_key)
                if isinstance(messages, list):
                    problem = _check_conversation(messages, self.prompt_key)
                    out.append(problem if problem is not None else messages)
                else:
                    out.append(messages)
            return out
        missing = [k for k in (self.prompt_key, self.response_key) if k not in names]
        raise DataError(
            f"{path}: missing column(s): neither a {self.messages_key!r} column (chat messages) nor the "
            f"prompt/response pair ({missing} absent); the file has columns {names}. Set data.messages_key, "
            "or data.prompt_key and data.response_key, to the file's column names"
        )

    def _load_file(self, path: str, tag: str) -> None:
        table = _read_parquet(path)
        if table.num_rows == 0:
            raise DataError(f"{path}: the file has no rows; regenerate it or remove it from the file list")
        problems: list[str] = []
        rows: list[int] = []
        row_pieces: list[list[Piece]] = []
        tools = _tools_column(table)
        for row, conv in enumerate(self._conversations(path, table)):
            if isinstance(conv, str):
                problems.append(f"row {row}: {conv}")
                continue
            try:
                pieces = render_pieces(self.tokenizer, conv, self.eos_token, tools[row])
            except _TemplateError as exc:
                problems.append(f"row {row}: {exc}")
                continue
            except Exception as exc:  # the template itself raised (e.g. it rejects a role order)
                problems.append(f"row {row}: the chat template failed ({type(exc).__name__}: {exc})")
                continue
            rows.append(row)
            row_pieces.append(pieces)
        if problems:
            shown = "\n  ".join(problems[:_MAX_REPORTED_PROBLEMS])
            more = len(problems) - _MAX_REPORTED_PROBLEMS
            tail = f"\n  ... and {more} more bad rows" if more > 0 else ""
            raise DataError(f"{path}: {len(problems)} bad row(s) (0-based row index):\n  {shown}{tail}")

        # One tokenizer call for every piece of the file; add_special_tokens=False because the rendered
        # text already holds every special token the template wants.
        flat = [text for pieces in row_pieces for text, _ in pieces]
        encoded = iter(self.tokenizer(flat, add_special_tokens=False)["input_ids"]) if flat else iter(())
        limit = self.max_length
        for row, pieces in zip(rows, row_pieces):
            ids: list[int] = []
            mask: list[int] = []
            for (_text, trained), piece_ids in zip(pieces, encoded):
                ids.extend(int(i) for i in piece_ids)
                mask.extend([int(trained)] * len(piece_ids))
            if len(ids) > limit:
                if self.truncation == "error":
                    raise DataError(
                        f"{path}: row {row}: the conversation is {len(ids)} tokens after the chat template, "
                        f"longer than data.max_length={limit}; raise data.max_length, shorten or drop the "
                        "row, or set data.truncation=right to keep its first max_length tokens"
                    )
                ids, mask = ids[:limit], mask[:limit]
                self.num_truncated += 1
                if not any(mask[1:]):
                    self.num_without_loss += 1
            self._input_ids.append(ids)
            self._loss_mask.append(mask)
            self._uid.append(f"{tag}-{row}")

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self._uid)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"SFTDataset index {i} out of range for {len(self)} conversations")
        return {
            "input_ids": list(self._input_ids[i]),
            "loss_mask": list(self._loss_mask[i]),
            "uid": self._uid[i],
        }

    @property
    def pad_token_id(self) -> int:
        return tokenizer_pad_id(self.tokenizer)

    def num_loss_tokens(self) -> int:
        """Training targets over the whole dataset (the first token of a row is never a target)."""
        return sum(sum(mask[1:]) for mask in self._loss_mask)


# ---------------------------------------------------------------------- batching
def collate(rows: Sequence[Mapping[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad dataset items to the longest row: ``input_ids``, ``attention_mask``, ``loss_mask``, each [B, T]."""
    if not rows:
        raise ValueError("collate() of no rows")
    b = len(rows)
    t = max(len(row["input_ids"]) for row in rows)
    input_ids = torch.full((b, t), int(pad_id), dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((b, t), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((b, t), dtype=torch.long)  # [B, T]
    for r, row in enumerate(rows):
        ids, mask = row["input_ids"], row["loss_mask"]
        n = len(ids)
        if n == 0 or len(mask) != n:
            raise ValueError(f"collate: row {r} has {n} tokens and a loss mask of {len(mask)}")
        input_ids[r, :n] = torch.as_tensor(ids, dtype=torch.long)
        attention_mask[r, :n] = 1
        loss_mask[r, :n] = torch.as_tensor(mask, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def shard_batch(batch: Mapping[str, torch.Tensor], world_size: int) -> list[dict[str, torch.Tensor]]:
    """Cut a ``[B, ...]`` dict batch into ``world_size`` equal contiguous shards, one per DP rank.

    When ``B`` is not a multiple of ``world_size`` the batch is padded with copies of its first rows whose
    ``loss_mask`` is all 0: they run through the model like real rows (so every rank does the same number
    of forward/backward passes, and no row is fully masked) but add nothing to any loss or token count.
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    sizes = {key: int(t.shape[0]) for key, t in batch.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"shard_batch: tensors disagree on the batch size: {sizes}")
    if "loss_mask" not in batch:
        raise ValueError("shard_batch: the batch has no loss_mask to zero on padding rows")
    b = next(iter(sizes.values()))
    if b == 0:
        raise ValueError("shard_batch: empty batch")
    pad = (-b) % world_size
    padded = dict(batch)
    if pad:
        index = torch.arange(pad) % b
        for key, t in batch.items():
            extra = t[index]
            if key == "loss_mask":
                extra = torch.zeros_like(extra)
            padded[key] = torch.cat([t, extra], dim=0)
    chunk = (b + pad) // world_size
    return [{key: t[r * chunk : (r + 1) * chunk] for key, t in padded.items()} for r in range(world_size)]


class SFTLoader:
    """Collated training batches, one epoch per ``iter()``, resumable mid-epoch.

    Epoch ``e`` visits the dataset in a ``torch.randperm`` order seeded from ``(seed, e)`` (dataset order
    without ``shuffle``); the incomplete last batch is dropped. The position ``(epoch, index_in_epoch)`` is
    what a checkpoint stores; a batch counts as consumed once it is yielded.
    """

    def __init__(self, dataset: SFTDataset, batch_size: int, shuffle: bool = True, seed: int = 0) -> None:
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"data.train_batch_size must be a positive integer, got {batch_size!r}")
        if batch_size > len(dataset):
            raise DataError(
                f"data.train_batch_size={batch_size} is larger than the dataset ({len(dataset)} "
                "conversations); lower data.train_batch_size or add data"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.index_in_epoch = 0

    def __len__(self) -> int:
        return len(self.dataset) // self.batch_size

    def epoch_order(self, epoch: int) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        generator = torch.Generator()
        generator.manual_seed(_epoch_seed(self.seed, epoch))
        return torch.randperm(n, generator=generator).tolist()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        order = self.epoch_order(self.epoch)
        while self.index_in_epoch < len(self):
            start = self.index_in_epoch * self.batch_size
            indices = order[start : start + self.batch_size]
            self.index_in_epoch += 1
            yield collate([self.dataset[i] for i in indices], self.dataset.pad_token_id)
        self.epoch += 1
        self.index_in_epoch = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index_in_epoch": self.index_in_epoch}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        epoch, index = int(state["epoch"]), int(state["index_in_epoch"])
        if epoch < 0 or not 0 <= index <= len(self):
            raise ValueError(
                f"SFTLoader.load_state_dict: position (epoch {epoch}, batch {index}) is invalid for {len(self)} "
                "batches per epoch; was the checkpoint made with another dataset or batch size?"
            )
        self.epoch, self.index_in_epoch = epoch, index


def eval_batches(dataset: SFTDataset, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """The whole dataset in order, ``batch_size`` rows at a time (the last batch may be smaller)."""
    for start in range(0, len(dataset), batch_size):
        rows = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        yield collate(rows, dataset.pad_token_id)
