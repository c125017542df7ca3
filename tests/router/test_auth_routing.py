"""API keys and the routing policy (header, model name, default; unknown names refused)."""

from __future__ import annotations

from pathlib import Path

import pytest
from starlette.datastructures import Headers

from tilepd.contracts.service_configs import NativePoolConfig, RouterConfig, RoutingConfig
from tilepd.router.auth import ApiKeyConfigError, ApiKeys
from tilepd.router.errors import RouterError
from tilepd.router.routing import Route, choose_route


def test_keys_from_env_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TILEPD_TEST_KEYS", "k1, k2")
    key_file = tmp_path / "keys"
    key_file.write_text("# comment\n\nk3\n")
    keys = ApiKeys.load("TILEPD_TEST_KEYS", key_file)
    for good in ("Bearer k1", "bearer k2", "Bearer k3"):
        keys.check(good)
    for bad in (None, "", "Bearer", "Bearer k4", "k1", "Basic k1", "Bearer k1x"):
        with pytest.raises(RouterError) as err:
            keys.check(bad)
        assert err.value.status == 401 and err.value.code == "invalid_api_key"


def test_named_but_missing_key_source_refuses_to_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TILEPD_TEST_NOPE", raising=False)
    with pytest.raises(ApiKeyConfigError, match="TILEPD_TEST_NOPE"):
        ApiKeys.load("TILEPD_TEST_NOPE", None)
    with pytest.raises(ApiKeyConfigError, match="nokeys"):
        ApiKeys.load(None, tmp_path / "nokeys")
    assert ApiKeys.load(None, None).open


def _config(native: bool, **routing: object) -> RouterConfig:
    return RouterConfig(port=1, served_model_name="m", tokenizer_dir=Path("/x"), prefill_urls=("http://p",), decode_nodes=(),
                        native_pool=NativePoolConfig(prefill_urls=("http://p",), decode_urls=("http://d",)) if native else None,
                        routing=RoutingConfig(**routing))  # type: ignore[arg-type]


def test_header_beats_model_beats_default() -> None:
    cfg = _config(True, by_model={"m-throughput": "native"})
    hdr = "x-tilepd-latency-class"
    assert choose_route(cfg, "m", Headers({})) == Route("low_latency", "default")
    assert choose_route(cfg, "m-throughput", Headers({})) == Route("native", "model")
    assert choose_route(cfg, "m-throughput", Headers({hdr: "low_latency"})) == Route("low_latency", "header")
    assert choose_route(cfg, None, Headers({hdr: "native"})) == Route("native", "header")


def test_routing_errors_name_what_is_wrong() -> None:
    with pytest.raises(RouterError) as err:
        choose_route(_config(True), "other", Headers({}))
    assert err.value.status == 404 and err.value.param == "model"
    with pytest.raises(RouterError) as err:
        choose_route(_config(True), "m", Headers({"x-tilepd-latency-class": "fast"}))
    assert err.value.status == 400 and err.value.param == "x-tilepd-latency-class"
    with pytest.raises(RouterError) as err:
        choose_route(_config(False), "m", Headers({"x-tilepd-latency-class": "native"}))
    assert err.value.code == "native_pool_not_configured"
