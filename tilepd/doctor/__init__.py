"""`tilepd doctor`: preflight checks on every host of a topology, and the on-call runbooks they point to.

Torch- and vLLM-free (an operator verb): the checks run small commands on the hosts (locally or
over SSH) and parse the tools' documented output formats.
"""

from tilepd.doctor.result import Finding, exit_code

__all__ = ["Finding", "exit_code"]
