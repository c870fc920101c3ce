"""Checkpoint protocol on the driver side: directory layout, atomic commit, discovery, resume, RNG state.

Nothing here touches torch.distributed; the fused workers write their own shard files (see
``fusedrl.workers.checkpoint_io``) into the directory the driver hands them.

Layout under ``trainer.default_local_dir``::

    global_step_{N}/
        actor/rank_{r}.safetensors     # rank r's local FSDP2 shards + optimizer state + torch RNG
        actor/rank_{r}.json            # sidecar: names, full shapes, placements, optimizer hyperparameters
        critic/rank_{r}.*              # (a critic role, same format, when there is one)
        trainer_state.json             # global step, dataloader position, driver RNG (JSON only)
        COMPLETE                       # written last: manifest of every file with its size and SHA-256
    latest_checkpointed_iteration.txt  # the step of the newest committed checkpoint

A save goes ``begin_checkpoint`` (fresh ``global_step_{N}.tmp-<pid>``) -> workers and driver write into it ->
``commit_checkpoint`` (fsync, write COMPLETE, rename to ``global_step_{N}``, update the tracker file, prune).
A crash at any point leaves either the previous checkpoints untouched or the new one complete: a directory
with a ``.tmp-``/``.old-``/``.deleting-``/``.corrupt-`` suffix, or without a valid COMPLETE manifest, is never
resumed from. A save that fails (disk full, permission denied) removes its temp folder and raises
`CheckpointSaveError` with the path and the free space; the previous checkpoints are not touched.

Resuming verifies the chosen checkpoint's files against the manifest (size and SHA-256). A damaged one is
renamed ``global_step_{N}.corrupt-<time>`` (kept for inspection, never resumed from) and the next older
complete one is used; a damaged ``trainer.resume_from_path`` is an error naming the file.

No pickle anywhere: tensors go through safetensors, everything else through JSON.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
COMPLETE_FILE = "COMPLETE"
TRAINER_STATE_FILE = "trainer_state.json"
ACTOR_DIR = "actor"
FORMAT_VERSION = 1
MANIFEST_VERSION = 2  # 1: {file: size}; 2: {file: {"size", "sha256"}}
RESUME_MODES = ("auto", "disable", "resume_path")

_STEP_DIR = re.compile(r"^global_step_(\d+)$")
# Leftovers of an interrupted save / replace / prune; all start with "global_step_{N}.".
_TRANSIENT_DIR = re.compile(r"^global_step_\d+\.(tmp|old|deleting)-\d+$")


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or inconsistent."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (disk full, no permission...); the previous ones are intact."""


# ---------------------------------------------------------------------- layout
def step_dir_name(step: int) -> str:
    return f"global_step_{int(step)}"


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step ``N`` of a ``.../global_step_{N}`` directory."""
    name = os.path.basename(os.path.normpath(os.fspath(path)))
    match = _STEP_DIR.match(name)
    if match is None:
        raise CheckpointError(f"{os.fspath(path)!r} is not a global_step_<N> checkpoint directory")
    return int(match.group(1))


def shard_prefix(ckpt_dir: str | os.PathLike, rank: int, role: str = ACTOR_DIR) -> str:
    """Path prefix (no extension) of rank ``rank``'s shard files of ``role`` (``actor``, ``critic``...)."""
    return os.path.join(os.fspath(ckpt_dir), role, f"rank_{int(rank)}")


def actor_shard_prefix(ckpt_dir: str | os.PathLike, rank: int) -> str:
    """Path prefix (no extension) of rank ``rank``'s actor shard files inside a checkpoint directory."""
    return shard_prefix(ckpt_dir, rank, ACTOR_DIR)


# ---------------------------------------------------------------------- durability helpers
def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (creations, renames) durable. Best effort where unsupported."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file + fsync + ``os.replace``."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def _fsync_tree(root: str) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(os.fspath(path), "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _manifest(root: str) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size", "sha256"}}`` of every file under ``root`` (POSIX separators, sorted)."""
    files: dict[str, dict[str, Any]] = {}
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if rel != COMPLETE_FILE:
                files[rel] = {"size": os.path.getsize(full), "sha256": file_sha256(full)}
    return dict(sorted(files.items()))


# ---------------------------------------------------------------------- save protocol
def begin_checkpoint(root: str | os.PathLike, step: int) -> str:
    """Create and return an empty ``{root}/global_step_{step}.tmp-<pid>`` directory to write a checkpoint into.

    The directory must be reachable by every worker that writes into it (same node or a shared file system).
    """
    root = os.fspath(root)
    os.makedirs(root, exist_ok=True)
    tmp_dir = os.path.join(root, f"{step_dir_name(step)}.tmp-{os.getpid()}")
    if os.path.exists(tmp_dir):
        shutil.rmtree(tmp_dir)
    os.makedirs(os.path.join(tmp_dir, ACTOR_DIR))
    return tmp_dir


def commit_checkpoint(
    root: str | os.PathLike, step: int, tmp_dir: str | os.PathLike, max_to_keep: int | None = None
) -> str:
    """Seal ``tmp_dir`` as the checkpoint of ``step`` and return its final path ``{root}/global_step_{step}``.

    In order: fsync every file, write the COMPLETE manifest (fsync), rename the directory into place (an
    existing checkpoint of the same step is moved aside first and removed after), fsync ``root``, update the
    tracker file atomically, then delete the oldest complete checkpoints beyond ``max_to_keep`` (``None`` or
    ``<= 0``: keep all) and any leftover temporary directories.
    """
    root, tmp_dir = os.fspath(root), os.fspath(tmp_dir)
    if not os.path.isdir(tmp_dir):
        raise CheckpointError(f"commit_checkpoint: {tmp_dir!r} does not exist (call begin_checkpoint first)")
    final_dir = os.path.join(root, step_dir_name(step))
    _fsync_tree(tmp_dir)
    manifest = {
        "format_version": FORMAT_VERSION,
        "manifest_version": MANIFEST_VERSION,
        "global_step": int(step),
        "files": _manifest(tmp_dir),
    }
    complete = os.path.join(tmp_dir, COMPLETE_FILE)
    with open(complete, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp_dir)

    old_dir = None
    if os.path.exists(final_dir):
        old_dir = os.path.join(root, f"{step_dir_name(step)}.old-{os.getpid()}")
        if os.path.exists(old_dir):
            shutil.rmtree(old_dir)
        os.replace(final_dir, old_dir)
    os.replace(tmp_dir, final_dir)
    fsync_dir(root)
    atomic_write_text(os.path.join(root, TRACKER_FILE), f"{int(step)}\n")
    if old_dir is not None:
        shutil.rmtree(old_dir, ignore_errors=True)
    prune_checkpoints(root, max_to_keep, keep_step=int(step))
    return final_dir


def prune_checkpoints(root: str | os.PathLike, max_to_keep: int | None, keep_step: int | None = None) -> None:
    """Remove leftover temporary directories and, with ``max_to_keep > 0``, the oldest complete checkpoints
    beyond that many (never ``keep_step``). Incomplete ``global_step_N`` directories are left alone."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if _TRANSIENT_DIR.match(name):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    if max_to_keep is None or int(max_to_keep) <= 0:
        return
    complete = list_complete_checkpoints(root)
    excess = complete[: max(0, len(complete) - int(max_to_keep))]
    for step, path in excess:
        if step == keep_step:
            continue
        # Rename first (atomic), so a crash mid-delete never leaves a half-deleted "complete" directory.
        doomed = os.path.join(root, f"{step_dir_name(step)}.deleting-{os.getpid()}")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    fsync_dir(root)


# ---------------------------------------------------------------------- discovery
def checkpoint_problem(path: str | os.PathLike, verify: bool = False) -> str | None:
    """Why ``path`` is not a complete checkpoint directory, or ``None`` when it is one.

    Every file listed in the COMPLETE manifest must exist with its recorded size; with ``verify`` its
    SHA-256 must match too (reads every byte: done for the checkpoint a run resumes from)."""
    path = os.fspath(path)
    name = os.path.basename(os.path.normpath(path))
    if not _STEP_DIR.match(name):
        return f"its name {name!r} is not global_step_<N> (a '.tmp-' directory is an unfinished save)"
    if not os.path.isdir(path):
        return "it does not exist or is not a directory"
    complete = os.path.join(path, COMPLETE_FILE)
    if not os.path.isfile(complete):
        return f"it has no {COMPLETE_FILE} marker (the save did not finish)"
    try:
        with open(complete, encoding="utf-8") as f:
            manifest = json.load(f)
        files = dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {COMPLETE_FILE} manifest is unreadable ({e})"
    for rel, entry in files.items():
        full = os.path.join(path, *rel.split("/"))
        size, sha = (entry.get("size"), entry.get("sha256")) if isinstance(entry, dict) else (entry, None)
        if not os.path.isfile(full):
            return f"{rel} listed in {COMPLETE_FILE} is missing"
        if os.path.getsize(full) != int(size):
            return f"{rel} has {os.path.getsize(full)} bytes, {COMPLETE_FILE} says {size} (truncated or overwritten)"
        if verify and sha is not None and file_sha256(full) != sha:
            return f"{rel} fails its SHA-256 check against {COMPLETE_FILE} (the file's content is corrupt)"
    return None


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    return checkpoint_problem(path) is None


def list_complete_checkpoints(root: str | os.PathLike) -> list[tuple[int, str]]:
    """``[(step, path)]`` of the complete checkpoints under ``root``, oldest first."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if match and is_complete_checkpoint(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def read_tracker(root: str | os.PathLike) -> int | None:
    """The step recorded in ``latest_checkpointed_iteration.txt``, or ``None`` if absent/unreadable."""
    try:
        with open(os.path.join(os.fspath(root), TRACKER_FILE), encoding="utf-8") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def find_latest_checkpoint(root: str | os.PathLike) -> str | None:
    """Path of the newest complete checkpoint under ``root``, or ``None``.

    The directory scan is authoritative (only ``global_step_N`` with a valid COMPLETE manifest count); the
    tracker file is cross-checked and a disagreement is logged: a newer complete checkpoint than the tracker
    names means a crash between rename and tracker update; an older one means the tracker's directory was
    lost or damaged.
    """
    complete = list_complete_checkpoints(root)
    tracked = read_tracker(root)
    if not complete:
        if tracked is not None:
            logger.warning(
                "%s names step %d but %s holds no complete checkpoint", TRACKER_FILE, tracked, os.fspath(root)
            )
        return None
    step, path = complete[-1]
    if tracked is not None and tracked != step:
        logger.warning(
            "%s names step %s but the newest complete checkpoint is step %d; using %s",
            TRACKER_FILE,
            tracked,
            step,
            path,
        )
    return path


def resolve_resume(
    root: str | os.PathLike, resume_mode: str = "auto", resume_from_path: str | os.PathLike | None = None
) -> str | None:
    """The checkpoint to resume from (``None``: start fresh), per ``trainer.resume_mode``.

    ``disable``: never resume. ``auto``: the newest complete checkpoint under ``root``, if any.
    ``resume_path``: exactly ``trainer.resume_from_path``, which must be a complete checkpoint directory.
    """
    if resume_mode not in RESUME_MODES:
        raise CheckpointError(f"trainer.resume_mode must be one of {list(RESUME_MODES)}, got {resume_mode!r}")
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        return _newest_verified_checkpoint(root)
    if not resume_from_path:
        raise CheckpointError("trainer.resume_mode=resume_path needs trainer.resume_from_path (got none)")
    path = os.path.abspath(os.fspath(resume_from_path))
    problem = checkpoint_problem(path, verify=True)
    if problem is not None:
        raise CheckpointError(
            f"trainer.resume_from_path={os.fspath(resume_from_path)!r} is not a complete checkpoint: {problem}. "
            "Point it at another global_step_<N> folder, or use trainer.resume_mode=auto to take the newest "
            "intact one."
        )
    return path


def _newest_verified_checkpoint(root: str | os.PathLike) -> str | None:
    """The newest complete checkpoint under ``root`` whose files pass their checksums. Each newer one that
    fails is reported (which file, why) and renamed ``.corrupt-<time>`` so no later resume or prune picks
    it; the search then falls back to the next older one."""
    root = os.fspath(root)
    candidates = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            match = _STEP_DIR.match(name)
            if match and os.path.isfile(os.path.join(root, name, COMPLETE_FILE)):
                candidates.append((int(match.group(1)), os.path.join(root, name)))
    for step, path in sorted(candidates, reverse=True):
        problem = checkpoint_problem(path, verify=True)
        if problem is None:
            return path
        aside = os.path.join(root, f"{step_dir_name(step)}.corrupt-{int(time.time())}")
        os.replace(path, aside)
        logger.warning(
            "checkpoint %s is damaged: %s. Moved it to %s; falling back to the previous complete checkpoint.",
            path,
            problem,
            aside,
        )
    return None


# ---------------------------------------------------------------------- trainer state
def save_trainer_state(ckpt_dir: str | os.PathLike, state: dict[str, Any]) -> str:
    """Write the driver's JSON state (global step, dataloader position, RNG...) into ``ckpt_dir``."""
    path = os.path.join(os.fspath(ckpt_dir), TRAINER_STATE_FILE)
    payload = {"format_version": FORMAT_VERSION, **state}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return path


def load_trainer_state(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    path = os.path.join(os.fspath(ckpt_dir), TRAINER_STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} is missing: not a fusedrl checkpoint directory?") from e
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    state.pop("format_version", None)
    return state


# ---------------------------------------------------------------------- RNG
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _from_b64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def seed_rng(seed: int) -> None:
    """Seed Python ``random``, numpy's global and torch's generators: a fresh run's driver RNG streams (used by
    reward functions and trainer plugins) are then the same on every run of the same command, so a resumed run,
    which restores them from its checkpoint (`restore_rng_state`), continues exactly the uninterrupted run's."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng_state() -> dict[str, Any]:
    """Python ``random``, numpy's global and torch's CPU (and initialised CUDA) generators, as plain JSON."""
    version, internal, gauss_next = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "kind": np_kind,
            "keys": np.asarray(np_keys).tolist(),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "torch_cpu": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng_state` (keys that are absent are left alone)."""
    if "python" in state:
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["internal"]), py["gauss_next"]))
    if "numpy" in state:
        npst = state["numpy"]
        np.random.set_state(
            (
                npst["kind"],
                np.asarray(npst["keys"], dtype=np.uint32),
                int(npst["pos"]),
                int(npst["has_gauss"]),
                float(npst["cached_gaussian"]),
            )
        )
    if "torch_cpu" in state:
        torch.set_rng_state(_from_b64(state["torch_cpu"]))
    if "torch_cuda" in state and torch.cuda.is_available():
        saved = [_from_b64(s) for s in state["torch_cuda"]]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)
        else:
            logger.warning(
                "checkpoint has CUDA RNG states for %d devices, this process sees %d; not restored",
                len(saved),
                torch.cuda.device_count(),
            )


def save_run_checkpoint(
    root: str,
    step: int,
    workers: Any,
    state: dict[str, Any],
    max_to_keep: int | None = None,
    extra: Callable[[str], None] | None = None,
) -> str:
    """One trainer checkpoint: every worker writes its shards (``w.save_checkpoint``) into a temp folder,
    the driver adds ``state`` plus its RNG (and ``extra(folder)`` writes its own files there, e.g. the
    async trainer's batch in flight), then the folder is committed atomically. Returns its path."""
    tmp: str | None = None
    try:
        tmp = begin_checkpoint(root, step)
        workers.run_all(lambda w: w.save_checkpoint.remote(tmp))
        if extra is not None:
            extra(tmp)
        save_trainer_state(tmp, {**state, "rng": capture_rng_state()})
        return commit_checkpoint(root, step, tmp, max_to_keep=max_to_keep)
    except Exception as err:
        if tmp is not None:  # a half-written folder is never resumed from; remove it now to free the space
            shutil.rmtree(tmp, ignore_errors=True)
        disk = disk_error(err)
        if disk is None:
            raise
        raise CheckpointSaveError(
            f"saving the checkpoint of step {step} into {root} failed: {disk}. {free_space(root)} The half-written "
            f"folder was removed; the previous checkpoint ({find_latest_checkpoint(root) or 'none'}) is intact. "
            "Free some space (or fix the permissions), or point trainer.default_local_dir at another disk, then "
            "rerun the same command: it resumes from that checkpoint."
        ) from err


_DISK_ERRNOS = {errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT, errno.EPERM, errno.EFBIG}


def disk_error(err: BaseException) -> str | None:
    """``"[Errno 28] No space left on device"``-like text when ``err`` (or what caused it: a worker's error
    through Ray, a safetensors error carrying "os error N") is a full / read-only / forbidden disk."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:
            return f"[Errno {e.errno}] {os.strerror(e.errno)}"
        match = re.search(r"os error (\d+)|\[Errno (\d+)\]", str(e))
        if match and int(match.group(1) or match.group(2)) in _DISK_ERRNOS:
            code = int(match.group(1) or match.group(2))
            return f"[Errno {code}] {os.strerror(code)}"
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]
    return None


def free_space(path: str | os.PathLike) -> str:
    """``Free space on <fs of path>: 1.2 MB of 4.0 MB.`` (the nearest existing folder of ``path``)."""
    path = os.path.abspath(os.fspath(path))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        usage = shutil.disk_usage(path)
    except OSError as e:
        return f"(free space of {path} unknown: {e})"
    return f"Free space on the file system of {path}: {_human(usage.free)} of {_human(usage.total)}."


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def check_writable(root: str | os.PathLike) -> str | None:
    """Why checkpoints cannot be written under ``root`` (None: they can). Probes the nearest existing
    folder with a temporary file, since permission bits alone say nothing for root or read-only mounts."""
    import tempfile

    path = os.path.abspath(os.fspath(root))
    while not os.path.isdir(path):
        if os.path.exists(path):
            return f"{path} exists and is not a folder"
        path = os.path.dirname(path)
    try:
        fd, probe = tempfile.mkstemp(prefix=".fusedrl-write-check-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"cannot create files in {path}: {e.strerror or e}"
    return None


def load_run_checkpoint(
    root: str, resume_mode: str, resume_from_path: str | None, workers: Any, loader: Any
) -> tuple[str, dict[str, Any]] | None:
    """Resume per ``trainer.resume_mode``: workers reload their shards (``w.load_checkpoint``), the data
    loader its position, the driver its RNG. Returns ``(path, trainer_state)``, or None for a fresh run."""
    path = resolve_resume(root, resume_mode, resume_from_path)
    if path is None:
        return None
    state = load_trainer_state(path)
    workers.run_all(lambda w: w.load_checkpoint.remote(path))
    loader.load_state_dict(state["dataloader"])
    restore_rng_state(state["rng"])
    return path, state
