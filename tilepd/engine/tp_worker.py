"""Entry point of tensor-parallel ranks 1..N-1 (started by tp_engine.launch_tp_engine; not for people).

`python -m tilepd.engine.tp_worker --rank R --size N --store HOST:PORT --options JSON`
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch.distributed as dist

from tilepd.engine.tp_engine import TIMEOUT, init_group, leave_group, load_rank_engine, serve_rank

log = logging.getLogger("tilepd.engine.tp")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tilepd.engine.tp_worker")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--store", required=True, help="HOST:PORT of rank 0's TCPStore")
    ap.add_argument("--options", required=True, help="JSON: load_rank_engine's keyword arguments and weights_dir")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank{a.rank} %(message)s", stream=sys.stderr)
    opts = json.loads(a.options)
    host, port = a.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world_size=a.size, is_master=False, timeout=TIMEOUT)
    tp = init_group(a.rank, a.size, store, opts["device"])
    engine = None
    try:
        engine = load_rank_engine(Path(opts.pop("weights_dir")), tp, **opts)
        log.info("event=tp_rank_ready rank=%d size=%d", a.rank, a.size)
        serve_rank(engine, tp)
    except (RuntimeError, dist.DistError) as exc:  # rank 0 gone (killed, crashed): nothing left to serve
        log.error("event=tp_rank_exit rank=%d reason=%s", a.rank, str(exc).splitlines()[0][:300])
        return 1
    finally:
        leave_group(engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
