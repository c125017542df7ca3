"""`lookup('tilepd_secret', NAME)`: one secret from the `tilepd up` that runs this playbook (tilepd.deploy.secrets).

Use it only in tasks marked `no_log`; the value never touches the operator's disk.
"""

from __future__ import annotations

from ansible.errors import AnsibleError
from ansible.plugins.lookup import LookupBase


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):  # noqa: ANN001, ANN003, ANN201 - Ansible's plugin signature
        from tilepd.deploy.secrets import SecretsError, fetch

        try:
            return [fetch(str(term)) for term in terms]
        except SecretsError as exc:
            raise AnsibleError(f"tilepd_secret: {exc}") from exc
