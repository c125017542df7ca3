"""`python -m tilepd.router --config FILE`"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tilepd.router.server import serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tilepd.router", description="tilepd OpenAI-compatible router")
    parser.add_argument("--config", type=Path, required=True, help="RouterConfig JSON (rendered by `tilepd plan`)")
    args = parser.parse_args(argv)
    return serve(args.config)


if __name__ == "__main__":
    sys.exit(main())
