"""tilepd.contracts: what two processes (or two packages) must agree on, in one room below all the others.

Each module is one contract whose both ends import it, so a field cannot change on one side only:

- `service_configs`: the config files the planner renders and the decode node, the router and the vLLM
  connector read at startup (INTERFACES §6);
- `exit_codes`: every `tilepd` verb's exit codes and their meanings (README's table);
- `decode_http`: the decode node's HTTP request bodies (INTERFACES §4), sent by the router and the canary;
- `marker`: the tilepd marker in vLLM's `kv_transfer_params` (INTERFACES §3), set by the router and the canary;
- `cpu_bind`: vLLM's `VLLM_CPU_OMP_THREADS_BIND`, written by the planner, read back by the connector;
- `config_file`: reading a service config file, the same way in every process;
- `logging_setup`: the one log format of every long-running process.

It imports nothing of tilepd (tests/test_import_layers.py checks), so a vLLM worker or the router loads it
without the planner, the topology validator or ruamel.yaml.
"""
