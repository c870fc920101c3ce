"""Generate docs/config.md from the trainer YAML files, so the reference cannot drift from the defaults.

    python scripts/gen_config_docs.py            # (re)write docs/config.md
    python scripts/gen_config_docs.py --check    # exit 1 if docs/config.md is out of date

Keys and default values come from OmegaConf, *without* resolving interpolations, so a default such as
``${actor_rollout_ref.model.path}`` is shown as written. Descriptions come from the YAML comments, which
OmegaConf drops: a small line scanner tracks indentation to give every comment its dotted key. A key's
description is the comment block directly above it (no blank line in between) followed by its trailing
``# ...`` comment, which may go on over the next lines as comments whose ``#`` is in the same column.
The scanner and OmegaConf must agree on the set of keys, or generation fails: a key the scanner misread
(a block-style list, say) would otherwise lose its description silently.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "config.md"


@dataclass(frozen=True, kw_only=True, slots=True)
class ConfigFile:
    """One YAML file documented in config.md."""

    path: str  # relative to the repository root
    title: str
    entry_point: str  # the command that reads it, for the section intro


CONFIG_FILES = (
    ConfigFile(
        path="trainer/config/ppo_trainer.yaml",
        title="PPO-family trainer",
        entry_point="python -m fusedrl.trainer.main_ppo key=value ...",
    ),
    ConfigFile(
        path="trainer/config/sft_trainer.yaml",
        title="SFT trainer",
        entry_point="python -m fusedrl.trainer.main_sft key=value ...",
    ),
)

_KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][A-Za-z0-9_\-]*)\s*:(?P<rest>.*)$")
_COMMENT_LINE = re.compile(r"^\s*#(?P<text>.*)$")


# ---------------------------------------------------------------------- comments
def comment_start(text: str) -> int:
    """Index of the ``#`` that starts a comment in ``text`` (outside quotes, after a blank), or -1."""
    quote = ""
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1] in " \t"):
            return i
    return -1


def split_comment(text: str) -> tuple[str, str]:
    """``"value  # note"`` -> ``("value", "note")``."""
    i = comment_start(text)
    return (text.rstrip(), "") if i < 0 else (text[:i].rstrip(), text[i + 1 :].strip())


def header_comment(lines: list[str]) -> list[str]:
    """The comment block at the top of the file (up to the first non-comment line)."""
    out: list[str] = []
    for line in lines:
        match = _COMMENT_LINE.match(line)
        if match is None:
            break
        out.append(match.group("text").strip())
    return out


def scan_comments(text: str) -> dict[str, str]:
    """``{dotted key: description}`` for every mapping key of a block-style YAML document.

    Handles what the trainer YAMLs use: nested mappings by indentation, scalar and flow-style (``[...]``,
    ``{...}``) values, full-line and trailing comments. A comment line whose ``#`` sits in the same column
    as the trailing comment of the line just before it continues that trailing comment; any other comment
    line belongs to the next key. Block sequences (``- item``) are skipped.
    """
    lines = text.splitlines()
    skip = len(header_comment(lines))  # the file's header describes the file, not its first key
    stack: list[tuple[int, str]] = []  # (indent, key) of the open mappings
    above: list[str] = []  # comment lines directly above the next key
    out: dict[str, str] = {}
    trailing_key, trailing_col = "", -1  # the previous line's key and its trailing '#' column, if any
    for line in lines[skip:]:
        if not line.strip():
            above, trailing_col = [], -1
            continue
        comment = _COMMENT_LINE.match(line)
        if comment is not None:
            note = comment.group("text").strip()
            if line.index("#") == trailing_col:  # aligned under a trailing comment: its next line
                out[trailing_key] = f"{out[trailing_key]} {note}".strip()
            else:
                above.append(note)
                trailing_col = -1
            continue
        match = _KEY_LINE.match(line)
        if match is None:  # a block-sequence item or a continuation line: nothing to document
            above, trailing_col = [], -1
            continue
        indent = len(match.group("indent"))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = ".".join([k for _, k in stack] + [match.group("key")])
        value, trailing = split_comment(match.group("rest"))
        out[key] = " ".join(part for part in [*above, trailing] if part)
        above = []
        trailing_key, trailing_col = key, comment_start(line)
        if not value.strip():  # "key:" opens a nested mapping
            stack.append((indent, match.group("key")))
    return out


# ---------------------------------------------------------------------- values
def _format_float(value: float) -> str:
    text = repr(value)
    if "e" in text:  # 1e-06 -> 1e-6, as one writes it in YAML
        mantissa, exponent = text.split("e")
        text = f"{mantissa}e{int(exponent)}"
    return text


def format_value(value: Any) -> str:
    """A default in YAML's flow syntax: ``null``, ``true``, ``[0.9, 0.999]``, ``{}``, ``${a.b}`` as written."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return _format_float(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    return text if text else '""'


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    """One row of a table: a key, its default (None for a group of keys) and its description."""

    key: str
    default: str | None
    description: str


def config_entries(path: Path) -> list[Entry]:
    """Every key of the YAML at ``path`` in file order, groups included, with default and description."""
    text = path.read_text(encoding="utf-8")
    cfg = OmegaConf.load(path)
    if not isinstance(cfg, DictConfig):
        raise ValueError(f"{path}: the top level is not a mapping")
    raw = OmegaConf.to_container(cfg, resolve=False)  # interpolations and ??? stay as written
    comments = scan_comments(text)

    entries: list[Entry] = []

    def walk(node: DictConfig, value: dict[Any, Any], prefix: str) -> None:
        for key in node:
            dotted = f"{prefix}{key!s}"
            child = node._get_node(key)
            is_group = isinstance(child, DictConfig) and not child._is_interpolation() and len(child) > 0
            entries.append(
                Entry(
                    key=dotted,
                    default=None if is_group else format_value(value[key]),
                    description=comments.get(dotted, ""),
                )
            )
            if is_group:
                assert isinstance(child, DictConfig)
                walk(child, value[key], dotted + ".")

    assert isinstance(raw, dict)
    walk(cfg, raw, "")
    found = {e.key for e in entries}
    if found != set(comments):
        raise ValueError(
            f"{path}: the comment scanner and OmegaConf disagree on the keys "
            f"(only OmegaConf: {sorted(found - set(comments))}; only the scanner: {sorted(set(comments) - found)}). "
            "Keep the file in plain block style, or teach scan_comments the new syntax."
        )
    return entries


# ---------------------------------------------------------------------- markdown
def _cell(text: str) -> str:
    # A '|' ends a table cell even inside a code span on GitHub, so escape it everywhere.
    return text.replace("|", "\\|").replace("\n", " ")


def _prose(text: str) -> str:
    # Outside code spans "<name>" would be read as an HTML tag and vanish.
    return _cell(text).replace("<", "&lt;")


def _section_table(entries: list[Entry]) -> list[str]:
    lines = ["| key | default | description |", "|---|---|---|"]
    for e in entries:
        default = "*(group)*" if e.default is None else f"`{_cell(e.default)}`"
        lines.append(f"| `{e.key}` | {default} | {_prose(e.description)} |")
    return lines


def render_file(spec: ConfigFile, root: Path = ROOT) -> list[str]:
    path = root / spec.path
    lines_in = path.read_text(encoding="utf-8").splitlines()
    entries = config_entries(path)
    out = [f"## {spec.title}: `{spec.path}`", ""]
    intro = _prose(" ".join(header_comment(lines_in)))
    if intro:
        out += [intro, ""]
    out += [f"Read by `{spec.entry_point}`.", ""]
    for section in [e for e in entries if "." not in e.key]:
        out += [f"### `{section.key}`", ""]
        if section.description:
            out += [_prose(section.description), ""]
        rows = [e for e in entries if e.key == section.key or e.key.startswith(section.key + ".")]
        if section.default is not None:  # a top-level scalar: a one-row table
            out += _section_table(rows)
        else:
            out += _section_table(rows[1:])
        out.append("")
    return out


def render(root: Path = ROOT) -> str:
    """The whole docs/config.md text."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by scripts/gen_config_docs.py from the YAML files below. Do not edit by hand. -->",
        "",
        "This file is generated from the trainer YAML files, which are the single source of truth for every",
        "key and its default. Do not edit it by hand: change the YAML (values, or the `#` comment on or",
        "directly above a key), then regenerate it with",
        "",
        "```bash",
        ".venv/bin/python scripts/gen_config_docs.py          # rewrite docs/config.md",
        ".venv/bin/python scripts/gen_config_docs.py --check  # exit 1 if it is out of date (tests run this)",
        "```",
        "",
        "Defaults are shown as written in the YAML: `???` is a required key with no default, and `${a.b}`",
        "is an interpolation that takes the value of key `a.b` when the config is resolved. Override any key",
        "on the command line as `key=value` (Hydra syntax); a key that is not in the YAML needs `++key=value`.",
        "Rows marked *(group)* hold the keys below them. For what the algorithm keys do, see",
        "[algorithms.md](algorithms.md).",
        "",
    ]
    for spec in CONFIG_FILES:
        lines += render_file(spec, root)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the file is out of date; write nothing"
    )
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"default: {OUTPUT.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    text = render()
    current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
    if args.check:
        if current == text:
            return 0
        diff = difflib.unified_diff(
            current.splitlines(), text.splitlines(), str(args.output), "generated", lineterm="", n=1
        )
        print("\n".join(list(diff)[:40]), file=sys.stderr)
        print(
            f"{args.output} is out of date: run `python scripts/gen_config_docs.py` and commit the result.",
            file=sys.stderr,
        )
        return 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    if current != text:
        args.output.write_text(text, encoding="utf-8")
        print(f"wrote {args.output}")
    else:
        print(f"{args.output} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
