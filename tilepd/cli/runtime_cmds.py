"""`tilepd decode-server`: run one decode node from its config file, or from flags for development."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from pydantic import ValidationError

from tilepd.contracts.exit_codes import ExitCode
from tilepd.contracts.service_configs import DecodeServerConfig, TransportConfig


def _config_from_flags(**kw: Any) -> DecodeServerConfig:
    transport = TransportConfig(name=kw.pop("transport"), data_port=kw.pop("data_port"))
    return DecodeServerConfig(transport=transport, **{k: v for k, v in kw.items() if v is not None})


def decode_server(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="DecodeServerConfig JSON rendered by `tilepd render`."),
    weights: Optional[Path] = typer.Option(None, "--weights", help="Without --config: the model (tilepd weights or HF folder)."),
    family: str = typer.Option("llama", "--family", help="Without --config: model family."),
    name: str = typer.Option("dev", "--name"),
    max_seq_len: int = typer.Option(4096, "--max-seq-len"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    host: str = typer.Option("127.0.0.1", "--host", help="bind address"),
    advertise_host: Optional[str] = typer.Option(None, "--advertise-host", help="address senders reach (default: --host)"),
    http_port: int = typer.Option(8200, "--http-port"),
    ctrl_port: int = typer.Option(5556, "--ctrl-port"),
    transport: str = typer.Option("tcp", "--transport", help="tcp, nixl or mooncake"),
    data_port: Optional[int] = typer.Option(None, "--data-port", help="tcp: data port (default: any free port)"),
    kv_timeout_s: float = typer.Option(30.0, "--kv-timeout-s"),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype"),
    tp_size: int = typer.Option(1, "--tp-size", min=1, help="Tensor-parallel ranks (GPUs on cuda); weights converted with --tp N."),
) -> None:
    """Run a tilepd decode node: control port for KV handoff, HTTP API on --http-port."""
    from tilepd.otel import TracingUnavailable
    from tilepd.contracts.config_file import ServiceConfigError, read_service_config
    from tilepd.contracts.logging_setup import setup_logging
    from tilepd.runtime.server import EngineLoadError, serve

    try:
        if config is not None:
            cfg = read_service_config(config, DecodeServerConfig)
        else:
            if weights is None:
                typer.echo("decode-server: give --config FILE, or --weights DIR for a development node", err=True)
                raise typer.Exit(int(ExitCode.USAGE))
            cfg = _config_from_flags(
                name=name, served_model_name=weights.name, family=family, weights_dir=weights, max_seq_len=max_seq_len,
                device=device, bind_host=host, advertise_host=advertise_host or host, http_port=http_port,
                ctrl_port=ctrl_port, transport=transport, data_port=data_port, kv_timeout_s=kv_timeout_s,
                kv_cache_dtype=kv_cache_dtype, tp_size=tp_size, recv_buffer="vram" if device == "cuda" and transport != "tcp" else "dram",
            )
    except ServiceConfigError as exc:
        typer.echo(f"decode-server: {exc}", err=True)
        raise typer.Exit(int(ExitCode.INPUT)) from exc
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        typer.echo(f"decode-server: flags: {where}: {err['msg']}", err=True)
        raise typer.Exit(int(ExitCode.INPUT)) from exc
    setup_logging(cfg.log_file)
    try:
        serve(cfg)
    except EngineLoadError as exc:
        typer.echo(f"decode-server: {exc}", err=True)
        raise typer.Exit(int(ExitCode.INPUT)) from exc
    except TracingUnavailable as exc:
        typer.echo(f"decode-server: {exc}", err=True)
        raise typer.Exit(int(ExitCode.NOT_AVAILABLE)) from exc
    except OSError as exc:
        typer.echo(f"decode-server: {exc}", err=True)
        raise typer.Exit(int(ExitCode.ERROR)) from exc


def register(app: typer.Typer) -> None:
    app.command("decode-server")(decode_server)


def main() -> None:
    """Entry point of `python -m tilepd.runtime`."""
    cli = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    cli.command()(decode_server)
    cli()
