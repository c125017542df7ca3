"""tilepd.deploy: put a plan on hosts with Ansible, and watch it.

- `deployment`: topology -> plan -> render + host_vars -> playbook run, exit codes
- `runner`: ansible-runner driver digesting the event stream (progress, changed, failures)
- `inventory`: per-host vars for the playbooks (service specs, rendered files, model paths)
- `proc`, `files`, `weights`: host-side helpers the playbooks call (`python -m ...`)
- `probes`, `status`, `logs`, `remote`: `tilepd status` / `tilepd logs` (local or paramiko)
- `convert`: `convert_on_nodes` for `tilepd convert-weights TOPOLOGY`
"""
