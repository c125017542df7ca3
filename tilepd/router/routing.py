"""Which pool a request goes to first, and why (header, served model name, default)."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.datastructures import Headers

from tilepd.contracts.service_configs import PoolName, RouterConfig
from tilepd.router.errors import RouterError, invalid

POOLS: tuple[PoolName, ...] = ("low_latency", "native")


@dataclass(frozen=True)
class Route:
    pool: PoolName
    reason: str


def served_models(config: RouterConfig) -> list[str]:
    return [config.served_model_name, *(m for m in config.routing.by_model if m != config.served_model_name)]


def choose_route(config: RouterConfig, model: str | None, headers: Headers) -> Route:
    """The header wins, then the model name, then the default; unknown names are refused."""
    if model is not None and model not in served_models(config):
        raise RouterError(404, f"model '{model}' is not served here; models: {', '.join(served_models(config))}",
                          code="model_not_found", param="model")
    routing = config.routing
    wanted = headers.get(routing.header)
    if wanted:
        if wanted not in POOLS:
            raise invalid(routing.header, f"header value {wanted!r} is not one of {', '.join(POOLS)}")
        route = Route(wanted, "header")  # type: ignore[arg-type]
    elif model is not None and model in routing.by_model:
        route = Route(routing.by_model[model], "model")
    else:
        route = Route(routing.default_pool, "default")
    if route.pool == "native" and config.native_pool is None:
        raise RouterError(400, f"the native pool was asked for ({route.reason}) but none is configured",
                          code="native_pool_not_configured", param=routing.header if route.reason == "header" else "model")
    return route
