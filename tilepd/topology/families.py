"""Model families the bundled decode runtime runs, and the aliases users may write.

`glm5` (GLM-5 / GLM-5.1) and `dsv32` (DeepSeek-V3.2) are DeepSeek-V3-shaped MoE
models with MLA attention (512 latent + 64 rope per token), so their KV handoff and
decode engine are the `deepseek_v3` family's. The alias is kept only for the user;
everything the plan renders uses the canonical family.
"""

from __future__ import annotations

RUNTIME_FAMILIES: tuple[str, ...] = ("llama", "deepseek_v3")
ALIASES: dict[str, str] = {"glm5": "deepseek_v3", "dsv32": "deepseek_v3"}
# families whose KV cache is MLA's compressed latent (one "head" of 576)
MLA_FAMILIES: frozenset[str] = frozenset({"deepseek_v3"})
# families whose checkpoints carry multi-token-prediction layers
MTP_FAMILIES: frozenset[str] = frozenset({"deepseek_v3"})


def known_families() -> tuple[str, ...]:
    return RUNTIME_FAMILIES + tuple(ALIASES)


def canonical_family(name: str) -> str | None:
    """The runtime family for `name` (an alias or a family), or None if unsupported."""
    if name in RUNTIME_FAMILIES:
        return name
    return ALIASES.get(name)
