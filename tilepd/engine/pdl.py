"""Programmatic dependent launch (PDL) for the decode step's Triton kernels: the switch and the device functions.

Why: the step is a chain of ~9 dependent launches a layer replayed from a CUDA graph, and between two of them the
GPU idles for the next launch and for the next kernel's first memory round trip (~1.8 us a boundary on an H200,
docs/PERFORMANCE.md). With PDL (sm_90+) a kernel's programs are scheduled while the previous kernel finishes; each
one waits (`griddepcontrol.wait`) before touching anything the step writes. Before that wait a program may only
read what no kernel of the step writes (the weights): `prefetch_l2` pulls its first weight tile into L2 there, so
the read that starts the kernel's work comes from L2, not HBM.

The rule every kernel launched with `launch_args()` follows (they take the `PDL` constexpr it sets, `flag()`):

  * `wait(PDL)` in every program before its first load of an activation, a cache, a routing result or a counter,
    and before its first store (so it never overwrites what the previous kernel still reads); in the early form
    (TILEPD_PDL_TRIGGER=1) it also lets the next kernel's programs be scheduled (`gdc_launch_dependents` right after
    the wait: a kernel can only trigger once all of its programs have started, so the next kernel's programs take
    only slots left over);
  * before the wait: loads of weights only (never written by the step), and L2 prefetches of them;
  * `trigger(PDL)` as each program's last statement: in the late form (TILEPD_PDL_TRIGGER=2) the next kernel's
    launch is let go there, so its programs take the slots this kernel's finished programs free and (with the
    prefetch) pull their first weight tile while this kernel's last programs finish, instead of parking beside it
    for its whole run as with the early trigger.

A kernel launched without PDL after one that never triggers (torch's, cuBLAS's, a memset) starts when that one
has completed, as without PDL; `griddepcontrol.wait` is a no-op in a kernel launched without it. So mixing is safe.

The switches (env, read at import): TILEPD_PDL (1 on, the default; 0 off), TILEPD_PDL_TRIGGER (1: the next kernel may
be scheduled right after this one's wait; 2, the default: once every program of this one has reached its end, the late
form; 0: wait only, the next kernel launches as this one completes), TILEPD_PDL_PREFETCH (the weight prefetch before the
wait; default 0, it only pays with the early trigger), TILEPD_PDL_SKIP (kernel kinds launched without it), and per launch
site (SITES) TILEPD_PDL_EARLY (sites that trigger right after their wait, whatever TILEPD_PDL_TRIGGER says; default
EARLY, set empty for none), TILEPD_PDL_PREFETCH_AT (sites that prefetch; default none) and TILEPD_PDL_PRELOAD_AT
(sites whose programs load their first weight chunk into registers before the wait, rather than into L2: no second
read of it, nothing to evict; default PRELOAD, the fp8 GEMVs g1, g2 and wo; set empty for none). The defaults, the late form
without the prefetch and the early trigger at EARLY's seven sites, because on one H100 GLM-5.1 fp8 at 78 layers
stepped faster with the late form than without PDL in three pairs (2026-12-07, docs/PERFORMANCE.md "PDL's late form":
1K 17.39 / 17.33 / 17.42 -> 17.20 / 17.24 / 17.29 ms/token; 32K 20.28 -> 20.15), and faster again with the early trigger
at those sites (the same day, "PDL's early trigger at seven sites": 1K 17.21 / 17.18 / 17.19 -> 17.01 / 17.01 / 17.02,
32K 20.05 -> 19.85, DeepSeek-V3 1K 15.73 -> 15.62), while the early trigger everywhere had been slower (14.80 -> 16.48
on an H200, 2026-12-03) and every form with the prefetch was too (the late form with it 18.01). One TP8 rank's shard
is faster with the early trigger everywhere and the prefetch (5.23 ms a step against 5.56 late), so a TP rank's step
takes those unless the environment says otherwise (`shard_form`). Always off under TRITON_INTERPRET=1, on a CPU
tensor, below compute capability 9.0, or where this Triton has no griddepcontrol.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

from tilepd.engine.tuning import env_int

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _GDC = True
except ImportError:  # pragma: no cover - a Triton without griddepcontrol: the kernels run, without PDL
    _GDC = False

# Read at import; tests and benches may set SWITCH's entries before the first launch of a kernel (each launch form is
# compiled once per value: a CUDA graph captured with one value keeps it). trigger 1: gdc_launch_dependents right
# after the wait (the next kernel's programs may be scheduled while this one runs); 2: at each program's end (the
# late form: `bench/pdl_chain.py`'s "pdl" form, 1.27 -> 0.81 us a one-wave launch on an H200); 0: no explicit
# trigger (the next kernel is launched as this one completes: PDL then saves only the launch's own latency). skip: the kernel kinds
# (KINDS) launched without PDL, e.g. TILEPD_PDL_SKIP=gate_up,down.
TRIGGERS = {0: 2, 1: 1, 2: 3}  # TILEPD_PDL_TRIGGER -> the kernels' PDL constexpr (flag())
KINDS = ("gemv", "prepare", "split", "merge", "gate", "gate_up", "down", "dsa")
# Launch sites: a kind, or one launch of a kind the step makes more than once a layer (the attention's G1, G2 and wo
# GEMVs are "gemv", the routing launch is "gate", mla_core_triton's persistent attention core "core" is a "merge").
# early: the sites whose launch triggers right after its wait whatever TILEPD_PDL_TRIGGER says (TILEPD_PDL_EARLY=
# route,merge: the next launch, gate-up or wo, is placed while this one runs); prefetch_at: the sites that prefetch
# their weights before the wait whatever TILEPD_PDL_PREFETCH says.
SITES = KINDS + ("g1", "g2", "wo", "route", "core")


def _names(variable: str, allowed: tuple[str, ...], default: frozenset[str] = frozenset()) -> frozenset[str]:
    """The names the variable lists ("," or "+" between them: bench/depth_step.sh's tags split their settings on ","),
    or `default` where it is unset (set, even empty, it wins)."""
    if variable not in os.environ:
        return default
    names = frozenset(k for k in os.environ[variable].replace("+", ",").split(",") if k)
    if not names <= set(allowed):
        raise ValueError(f"{variable}={os.environ.get(variable)!r}: one of {', '.join(allowed)} each")
    return names


# EARLY: the sites where the early trigger measured faster than the late form. Their next launch is a GEMV of many
# programs (G1 -> G2, merge -> wo, route -> gate-up, gate-up -> down, down -> the next layer's G1), the gate's 128 light
# programs (after wo) or the routing's one (after the gate): its programs, placed while this one's last wave runs, start
# the moment it completes. At G2, prepare and split the early trigger measured slower: their next kernels (prepare, the
# split MLA kernel, its merge) run ~100-130 programs that each carry an SM's share of the work, and placed early they
# can pile onto the SMs that freed first (a hypothesis: the profiles of a PDL step cannot separate it). One H100, GLM-5.1
# fp8 78L 1K, one warm machine (2026-12-07, docs/PERFORMANCE.md "PDL's early trigger at seven sites"): 17.18-17.21
# ms/token late everywhere, 17.06-17.08 early at the first five, 17.04 / 17.03 with wo / gate beside them, 17.01-17.02
# with all seven; 17.28 / 17.44 / 17.52 with split / g2 / prepare beside the five; every form with the prefetch slower.
EARLY = frozenset({"g1", "merge", "route", "gate_up", "down", "wo", "gate"})
# PRELOAD: the sites whose programs load their first weight chunk (and its scales) into registers before the wait: the
# attention's three fp8 GEMVs, each after an early-trigger site (G1 after down, G2 after G1, wo after merge), so their
# programs are placed while the previous kernel runs and their first HBM round trip overlaps it. One H100, one warm
# machine (2026-12-07, eighth session; docs/PERFORMANCE.md "The attention GEMVs' first chunk loaded before PDL's wait"):
# GLM-5.1 fp8 78L 1K 17.21-17.26 -> 16.97-17.00 ms/token, 32K 20.13 -> 19.85, DeepSeek-V3 fp8 61L 1K 15.87 -> 15.58,
# the TP8 shard 5.26 -> 5.19 ms a step. Measured and not taken: the MoE down kernel's shared-expert tile preloaded
# (GLM-5.1 +0.8 ms, the shard +0.1), and wo's first two chunks (fp8_triton's preload_k 2048: GLM-5.1 16.80, the shard 5.15,
# but DeepSeek-V3 16.16-16.20).
PRELOAD = frozenset({"g1", "g2", "wo"})
SWITCH: dict = {"on": env_int("TILEPD_PDL", 1), "prefetch": env_int("TILEPD_PDL_PREFETCH", 0), "trigger": env_int("TILEPD_PDL_TRIGGER", 2),
                "skip": _names("TILEPD_PDL_SKIP", KINDS), "early": _names("TILEPD_PDL_EARLY", SITES, EARLY),
                "prefetch_at": _names("TILEPD_PDL_PREFETCH_AT", SITES), "preload_at": _names("TILEPD_PDL_PRELOAD_AT", SITES, PRELOAD)}
if SWITCH["trigger"] not in TRIGGERS:
    raise ValueError(f"TILEPD_PDL_TRIGGER={SWITCH['trigger']}: 0 (wait only), 1 (early) or 2 (late)")


# The shard form: what a TP rank's step (tp.TPDeepseekV3Model.forward) launches with where the environment leaves a
# switch unset. One rank reads 1/8 of the bytes at TP8, so its step is launch-bound, and the early trigger with the
# prefetch measured faster there: one TP8 rank of GLM-5.1 fp8 at 1K 5.733 -> 5.301 / 5.355 ms a step on an H100
# (2026-12-06; 7.11 -> 6.86 on an H200, 2026-12-03), while the whole model on one GPU is slower with them (17.71 ->
# 18.55 ms, the same H100 call); the late form, the one-GPU default, was slower on the shard (5.23 -> 5.56 ms a step,
# 5.58 without the prefetch; one H100, 2026-12-07). docs/PERFORMANCE.md, "Programmatic dependent launch on a TP rank's
# step" and "PDL's late form".
SHARD_FORM: dict[str, tuple[str, int]] = {"on": ("TILEPD_PDL", 1), "trigger": ("TILEPD_PDL_TRIGGER", 1), "prefetch": ("TILEPD_PDL_PREFETCH", 1)}


@contextlib.contextmanager
def shard_form(active: bool = True) -> Iterator[None]:
    """Within (when active): SWITCH takes SHARD_FORM's value for each switch its environment variable leaves unset
    (one set, even to 0, wins); after, its own values again. Kernels launched or captured within keep the form."""
    saved = dict(SWITCH)
    if active:
        SWITCH.update({key: value for key, (name, value) in SHARD_FORM.items() if os.environ.get(name, "") == ""})
    try:
        yield
    finally:
        SWITCH.clear()
        SWITCH.update(saved)


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    major, _ = torch.cuda.get_device_capability(index)
    return major >= 9


def enabled(t: torch.Tensor, kind: str = "gemv") -> bool:
    """PDL for a launch of a `kind` kernel whose tensors live where `t` does: switch on and the kind not skipped, a
    CUDA tensor, sm_90+, not the interpreter."""
    if triton is None or not _GDC or not SWITCH["on"] or kind in SWITCH["skip"] or not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _device_supports(t.device.index if t.device.index is not None else torch.cuda.current_device())


def flag(t: torch.Tensor, kind: str = "gemv", site: str | None = None) -> int:
    """The kernels' PDL constexpr: 0 without PDL, 1 wait then trigger, 2 wait only (SWITCH["trigger"] 0), 3 wait,
    then trigger at the program's end (SWITCH["trigger"] 2); 1 at a site in SWITCH["early"] (site: the kind's)."""
    if not enabled(t, kind):
        return 0
    if (site or kind) in SWITCH["early"]:
        return TRIGGERS[1]
    return TRIGGERS[SWITCH["trigger"]]


def prefetch_flag(t: torch.Tensor, kind: str = "gemv", site: str | None = None) -> bool:
    """The kernels' PREFETCH constexpr: the L2 prefetch of weights before the wait (only with PDL, where it overlaps
    the previous kernel's tail; without PDL it would only add instructions in front of the same loads)."""
    return enabled(t, kind) and (bool(SWITCH["prefetch"]) or (site or kind) in SWITCH["prefetch_at"])


def preload_flag(t: torch.Tensor, kind: str = "gemv", site: str | None = None) -> bool:
    """Whether a launch loads its first weight chunk into registers before the wait (fp8_triton's PRELOAD_K): at the
    sites in SWITCH["preload_at"], only with PDL (placed early, the program's first round trip to HBM overlaps the
    previous kernel; without PDL the wait is a no-op and the preload would only reorder the same loads)."""
    return enabled(t, kind) and (site or kind) in SWITCH["preload_at"]


def launch_args(t: torch.Tensor, kind: str = "gemv", site: str | None = None) -> dict:
    """A launch's PDL arguments, read once: the kernel's `PDL` constexpr (flag()) and, with PDL, `launch_pdl`."""
    on = flag(t, kind, site)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": 0}


OFF: dict = {"PDL": 0}  # a launch that never takes PDL (gemv_triton's unchained GEMVs)


if triton is not None:

    @triton.jit
    def wait(PDL: tl.constexpr):  # noqa: ANN201 - a Triton device function
        """Before the first read of anything the step writes: the previous kernel has completed and its writes are
        visible; then the next kernel may be scheduled."""
        if PDL:
            gdc_wait()
            if PDL == 1:
                gdc_launch_dependents()

    @triton.jit
    def trigger(PDL: tl.constexpr):  # noqa: ANN201 - a Triton device function
        """A program's last statement: in the late form (PDL 3) the next kernel may be scheduled once every program
        of this one has got here (or exited)."""
        if PDL == 3:
            gdc_launch_dependents()

    @triton.jit
    def prefetch_l2(ptrs, mask):  # noqa: ANN001, ANN201 - a Triton device function
        """prefetch.global.L2 of each address where mask is set (no registers written, nothing waits on it)."""
        tl.inline_asm_elementwise(
            asm="{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            constraints="=r,l,r", args=[ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
