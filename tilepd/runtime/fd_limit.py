"""Raise this process's open-file soft limit to its hard limit at start.

A process-mode node inherits the shell's soft limit (often 1024) while the hard limit allows far more: every
HTTP, control and data connection costs an fd, so 1024 is a limit a flood of connections reaches. systemd units
set `LimitNOFILE=` (plan/systemd.py); this covers the processes no unit starts.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("tilepd.runtime")


def raise_nofile_limit(node: str) -> tuple[int, int]:
    """Set the soft RLIMIT_NOFILE to the hard one; returns (soft before, soft now). A refusal is logged, not fatal."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        # Linux has no unlimited fd limit; an infinite hard one is left to the kernel's nr_open
        log.info("event=nofile_limit node=%s soft=%s hard=%s", node, soft, hard)
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("event=nofile_limit_unchanged node=%s soft=%d hard=%d error=%s", node, soft, hard, exc)
        return soft, soft
    log.info("event=nofile_limit node=%s soft=%d raised_to=%d", node, soft, hard)
    return soft, hard
