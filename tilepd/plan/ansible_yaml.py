"""YAML for Ansible's inventory and host_vars in which every string is data, never a template.

Ansible templates any string it reads from inventory or host_vars, so a topology value holding
`{{ lookup('pipe', 'id') }}` would run on the operator's machine and an inline `--chat-template`
with Jinja in `extra_args` would break `up`. Each string (at any depth) is written with the `!unsafe`
tag, which Ansible documents as "never template this value"; mapping keys, numbers, booleans and
nulls are untagged (keys are names the topology validates, the rest cannot hold Jinja).

Ansible (2.19) resolves the type of an `!unsafe` scalar as if it were plain, quoted or not: `!unsafe '0600'`
reads as the int 384. So a string that YAML 1.1 would read as another type ("0600", "true", "1.5") stays an
untagged quoted string: such a string cannot hold `{` and so cannot be a template.
"""

from __future__ import annotations

import io
from typing import Any

import yaml as pyyaml
from ruamel.yaml import YAML
from ruamel.yaml.representer import SafeRepresenter

_STR_TAG = "tag:yaml.org,2002:str"
_RESOLVER = pyyaml.resolver.Resolver()  # YAML 1.1 implicit types, as Ansible's loader (PyYAML) resolves them


class Unsafe(str):
    """A string Ansible must take literally."""


class Quoted(str):
    """A string that YAML 1.1 (PyYAML, which Ansible reads with) would take as another type: written quoted."""


def _represent_quoted(representer: SafeRepresenter, value: Quoted) -> Any:
    # ruamel writes by YAML 1.2, where `yes`, `on` or `1:20` are plain strings and go bare; PyYAML would read them back
    # as True or 80
    return representer.represent_scalar("tag:yaml.org,2002:str", str(value), style="'")


def _represent_unsafe(representer: SafeRepresenter, value: Unsafe) -> Any:
    style = "|" if "\n" in value else None
    return representer.represent_scalar("!unsafe", str(value), style=style)


def mark_unsafe(value: Any) -> Any:
    """The same data with every string (not keys) that reads back as a string wrapped as Unsafe."""
    if isinstance(value, str):
        if _RESOLVER.resolve(pyyaml.ScalarNode, value, (True, False)) != _STR_TAG:
            assert "{" not in value  # YAML 1.1's int/float/bool/null/timestamp forms hold no brace
            return Quoted(value)
        return Unsafe(value)
    if isinstance(value, dict):
        return {k: mark_unsafe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mark_unsafe(v) for v in value]
    return value


def ansible_yaml(value: Any, header: str) -> str:
    """`value` as YAML for Ansible (every string `!unsafe`), after a `# header` comment line."""
    yaml = YAML(typ="safe", pure=True)
    yaml.default_flow_style = False
    yaml.width = 100_000  # never fold long values (hashes, argv words)
    yaml.sort_base_mapping_type_on_output = False  # type: ignore[attr-defined]
    yaml.representer.add_representer(Unsafe, _represent_unsafe)
    yaml.representer.add_representer(Quoted, _represent_quoted)
    buf = io.StringIO()
    yaml.dump(mark_unsafe(value), buf)
    return f"# {header}\n" + buf.getvalue()


def load_ansible_yaml(text: str) -> Any:
    """Read back what ansible_yaml wrote (the `!unsafe` strings as plain str), for tools and tests outside Ansible."""
    yaml = YAML(typ="safe", pure=True)
    yaml.constructor.add_constructor("!unsafe", lambda loader, node: loader.construct_scalar(node))
    return yaml.load(text)
