"""The connector's GPU path on DSA caches: what it sends from CUDA caches equals what it sends from CPU caches.

    python bench/connector_gpu_parity.py [--tokens 1000] [--chunk 256]

For each latent format vLLM uses with FlashMLA-sparse on CUDA (bf16, and fp8_ds_mla: 656 bytes per token), plus
the lightning-indexer cache (uint8, 132 bytes per token, values then scales per block), at block size 64:
builds vLLM's cache tensors for one request on the GPU and the same on the CPU (a scattered block table, four
layers of which layer 2 has no indexer, GLM-style, and layer 3 stands for an MTP layer), drives the real
TilePDConnector through the hooks vLLM calls (register_kv_caches, bind_connector_metadata, save_kv_layer per
layer, wait_for_save, in `--chunk`-token prefill steps; on CUDA: device gathers, async copies into the pinned
staging buffer, a CUDA event the sender thread waits on), sends over tcp into an in-process decode-node receiver
that verifies the transfer checksums, and compares what landed: GPU run == CPU run == each cache's blocks as
held (computed independently). Prints one line per case and OK / FAIL; exit status 1 on any FAIL.

Needs torch with CUDA, pydantic and xxhash (and this repository on PYTHONPATH, which the script sets). vLLM is
used when installed (its allocator views and KVConnectorBase_V1); on a GPU host without vLLM the connector's base
class is replaced by a minimal stand-in holding only what the connector uses of it (the metadata binding, as
vLLM's base.py:243-258 does it) and the caches are laid out LBHNC by hand; the script says which it used.
"""

from __future__ import annotations

import argparse
import enum
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _vllm_base() -> str:
    """vLLM's KVConnectorBase_V1 when vLLM is installed, else a stand-in (see the module doc)."""
    try:
        import vllm
        import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401

        return f"vllm {vllm.__version__}"
    except ImportError:
        pass

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
             "vllm.distributed.kv_transfer.kv_connector.v1", "vllm.distributed.kv_transfer.kv_connector.v1.base"]
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    base = sys.modules[names[-1]]
    base.KVConnectorRole, base.KVConnectorMetadata, base.KVConnectorBase_V1 = KVConnectorRole, KVConnectorMetadata, KVConnectorBase_V1
    return "stand-in base class (vLLM not installed)"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself (compares the CPU path with itself)")
    a = ap.parse_args()
    base = _vllm_base()
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("FAIL: no CUDA device")
        return 1
    from tests.connector.dsa_drive import expected_wire, random_dsa_state, send_to_receiver

    name = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu dry run"
    print(f"torch {torch.__version__}, {name}, connector base: {base}", flush=True)
    failed = 0
    for latent, chunk in (("bfloat16", a.chunk), ("fp8_ds_mla", a.chunk), ("bfloat16", 48)):
        state = random_dsa_state(a.tokens, seed=len(latent) + chunk)
        nb = -(-a.tokens // 64) + 8
        cpu_probe: dict = {}
        gpu_probe: dict = {}
        t0 = time.perf_counter()
        cpu, lay_c, caches = send_to_receiver(state, latent=latent, device="cpu", chunk=chunk, num_blocks=nb, max_seq_len=2048,
                                              probe=cpu_probe)
        t1 = time.perf_counter()
        gpu, lay_g, _ = send_to_receiver(state, latent=latent, device=a.device, chunk=chunk, num_blocks=nb, max_seq_len=2048,
                                         probe=gpu_probe)
        t2 = time.perf_counter()
        want = expected_wire(caches, lay_c, a.tokens, max_seq_len=2048)
        checks = {
            "same layout": lay_c == lay_g,
            "indexer segment": lay_g.indexer is not None and lay_g.indexer.layers == [0, 1, 3] and lay_g.indexer.token_bytes == 132,
            "gpu bytes == cpu bytes": torch.equal(gpu, cpu),
            "cpu bytes == blocks as held": torch.equal(cpu[:want.numel()], want),
            "cuda path used": a.device != "cuda" or (gpu_probe.get("device", "").startswith("cuda") and bool(gpu_probe.get("staging_pinned"))),
        }
        ok = all(checks.values())
        failed += not ok
        print(f"{'OK' if ok else 'FAIL'} latent={latent} tokens={a.tokens} chunk={chunk} layout={lay_g.layout_id} "
              f"bytes={gpu_probe.get('counters', {}).get('bytes')} cpu_s={t1 - t0:.2f} gpu_s={t2 - t1:.2f} "
              + " ".join(f"[{k}: {'yes' if v else 'NO'}]" for k, v in checks.items()), flush=True)
    print("OK" if not failed else f"FAIL ({failed} case(s))")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
