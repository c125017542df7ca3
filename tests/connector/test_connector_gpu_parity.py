"""GPU parity (marker gpu): what the connector sends from CUDA caches of a DSA model equals what it sends from CPU caches.

For each latent format vLLM uses with FlashMLA-sparse on CUDA (bf16, and fp8_ds_mla: 656 bytes per token), plus
the lightning-indexer cache (uint8, 132 bytes per token, values then scales per block), at block size 64:
builds vLLM's cache tensors for one request on the GPU and the same on the CPU (a scattered block table, four
layers of which layer 2 has no indexer, GLM-style, and layer 3 stands for an MTP layer), drives the real
TilePDConnector through the hooks vLLM calls (dsa_drive.py; on CUDA: device gathers, async copies into the pinned
staging buffer, a CUDA event the sender thread waits on), sends over tcp into an in-process decode-node receiver
that verifies the transfer checksums, and compares what landed: GPU run == CPU run == each cache's blocks as held.

vLLM is used when installed (its allocator views and KVConnectorBase_V1); on a GPU host without vLLM the
connector's base class is replaced, for this module only, by a stand-in holding what the connector uses of it
(the metadata binding, as vLLM's base.py:243-258 does it), and the caches are laid out LBHNC by hand.

    pytest -m gpu tests/connector/test_connector_gpu_parity.py     # was `python bench/connector_gpu_parity.py`
"""

from __future__ import annotations

import enum
import sys
import types
from collections.abc import Iterator

import pytest
import torch

pytestmark = pytest.mark.gpu

TOKENS = 1000
CHUNK = 256
VLLM_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


def _stand_in_base() -> dict[str, types.ModuleType]:
    """The modules of a minimal KVConnectorBase_V1: only what the connector uses of it (see the module doc)."""

    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:
        pass

    class KVConnectorBase_V1:
        _connector_metadata = None

        def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

    names = ["vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
             "vllm.distributed.kv_transfer.kv_connector.v1", VLLM_BASE]
    modules = {n: types.ModuleType(n) for n in names}
    base = modules[VLLM_BASE]
    base.KVConnectorRole, base.KVConnectorMetadata, base.KVConnectorBase_V1 = KVConnectorRole, KVConnectorMetadata, KVConnectorBase_V1
    return modules


@pytest.fixture(scope="module")
def dsa_drive() -> Iterator[types.ModuleType]:
    """tests.connector.dsa_drive over vLLM's base class, or over the stand-in (removed again after the module)."""
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401 - the real base when vLLM is installed
    except ImportError:
        before = set(sys.modules)
        sys.modules.update(_stand_in_base())
        try:
            from tests.connector import dsa_drive

            yield dsa_drive
        finally:  # nothing built on the stand-in outlives this module
            for name in set(sys.modules) - before:
                if name.startswith(("vllm", "tilepd.connector", "tests.connector.dsa_drive")):
                    del sys.modules[name]
        return
    from tests.connector import dsa_drive

    yield dsa_drive


@pytest.mark.parametrize("latent,chunk", [("bfloat16", CHUNK), ("fp8_ds_mla", CHUNK), ("bfloat16", 48)])
def test_cuda_caches_send_the_cpu_caches_bytes(latent: str, chunk: int, dsa_drive: types.ModuleType) -> None:
    state = dsa_drive.random_dsa_state(TOKENS, seed=len(latent) + chunk)
    nb = -(-TOKENS // 64) + 8
    gpu_probe: dict = {}
    cpu, lay_c, caches = dsa_drive.send_to_receiver(state, latent=latent, device="cpu", chunk=chunk, num_blocks=nb, max_seq_len=2048)
    gpu, lay_g, _ = dsa_drive.send_to_receiver(state, latent=latent, device="cuda", chunk=chunk, num_blocks=nb, max_seq_len=2048,
                                               probe=gpu_probe)
    want = dsa_drive.expected_wire(caches, lay_c, TOKENS, max_seq_len=2048)
    assert lay_c == lay_g
    assert lay_g.indexer is not None and lay_g.indexer.layers == [0, 1, 3] and lay_g.indexer.token_bytes == 132
    assert gpu_probe.get("device", "").startswith("cuda") and gpu_probe.get("staging_pinned"), f"the CUDA path was not used: {gpu_probe}"
    assert torch.equal(gpu, cpu), "the bytes staged from CUDA caches differ from the CPU path's"
    assert torch.equal(cpu[:want.numel()], want), "the CPU path's bytes differ from the blocks as held"
