"""Start the router from its config file: `python -m tilepd.router --config FILE`."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from tilepd.auth import SecretFileError, load_secret
from tilepd.contracts.config_file import ServiceConfigError, read_service_config
from tilepd.contracts.exit_codes import ExitCode
from tilepd.contracts.logging_setup import setup_logging
from tilepd.otel import TracingUnavailable, require_otel
from tilepd.contracts.service_configs import RouterConfig
from tilepd.router.auth import ApiKeyConfigError, ApiKeys

log = logging.getLogger("tilepd.router")
GRACEFUL_SHUTDOWN_S = 5


def serve(config_path: Path) -> int:
    """Run until SIGINT/SIGTERM; returns an exit code (see tilepd/contracts/exit_codes.py)."""
    try:
        config = read_service_config(config_path, RouterConfig)
        keys = ApiKeys.load(config.api_key_env, config.api_key_file)
        if config.secret_file is not None:
            load_secret(config.secret_file)  # checked here so a bad file is a config error, not a traceback
        require_otel(config.otlp_endpoint, "router.otlp_endpoint")
    except (ServiceConfigError, ApiKeyConfigError, SecretFileError) as exc:
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
