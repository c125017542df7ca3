"""Start the router from its config file: `python -m tilepd.router --config FILE`."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from pydantic import ValidationError

from tilepd.auth import SecretFileError, load_secret
from tilepd.cli.exitcodes import ExitCode
from tilepd.otel import TracingUnavailable, require_otel
from tilepd.plan.service_configs import RouterConfig
from tilepd.router.auth import ApiKeyConfigError, ApiKeys

log = logging.getLogger("tilepd.router")
GRACEFUL_SHUTDOWN_S = 5


class ConfigError(Exception):
    """The config file is missing or invalid; the message names the file and the field."""


def load_config(path: Path) -> RouterConfig:
    try:
        raw = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from exc
    try:
        return RouterConfig.model_validate_json(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{path}: invalid router config: {problems}") from exc


def setup_logging(log_file: Path | None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s", handlers=handlers, force=True)


def serve(config_path: Path) -> int:
    """Run until SIGINT/SIGTERM; returns an exit code (see tilepd/cli/exitcodes.py)."""
    try:
        config = load_config(config_path)
        keys = ApiKeys.load(config.api_key_env, config.api_key_file)
        if config.secret_file is not None:
            load_secret(config.secret_file)  # checked here so a bad file is a config error, not a traceback
        require_otel(config.otlp_endpoint, "router.otlp_endpoint")
    except (ConfigError, ApiKeyConfigError, SecretFileError) as exc:
        print(f"tilepd router: {exc}", file=sys.stderr)
        return int(ExitCode.INPUT)
    except TracingUnavailable as exc:
        print(f"tilepd router: {exc}", file=sys.stderr)
        return int(ExitCode.NOT_AVAILABLE)
    setup_logging(config.log_file)
    if keys.open:
        log.warning("event=auth_open no API key configured (api_key_env/api_key_file): anyone who reaches port %d can use the router",
                    config.port)
    import uvicorn

    from tilepd.router.app import create_app

    app = create_app(config, keys)
    uvicorn.run(app, host=config.bind_host, port=config.port, loop="uvloop", http="httptools", access_log=False,
                log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, server_header=False)
    return 0
