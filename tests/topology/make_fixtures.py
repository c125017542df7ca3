"""Regenerate tests/topology/fixtures/*.yaml from base_valid.yaml (run: python tests/topology/make_fixtures.py).

Each fixture is the valid base with one targeted change; the line the finding must
point at carries the marker comment `# <- expected`.
"""

import pathlib

HERE = pathlib.Path(__file__).resolve().parent
base = (HERE / "base_valid.yaml").read_text()
M = "  # <- expected"
NATIVE = "native_decode:\n  - name: n0\n    address: 10.1.0.3\n    gpus: 2\n    port: 8100\n"
def fx(name, *pairs):
    text = base
    for old, new in zip(pairs[::2], pairs[1::2]):
        assert text.count(old) == 1, (name, old)
        text = text.replace(old, new)
    assert text.count("# <- expected") == 1, name
    (HERE / "fixtures" / f"{name}.yaml").write_text(f"# bad topology for rule {name.split('__')[0]}; the marked line is where the finding must point\n" + text)
fx("duplicate-host__name", "  - name: n0\n", "  - name: d0" + M + "\n")
fx("duplicate-host__gpu", "    address: 10.1.0.3\n    gpus: 2\n", "    address: 10.1.0.1" + M + "\n    gpus: 2\n    nixl_side_channel_port: 5700\n")
fx("host-conflict__ssh", "  address: 10.1.0.4\n  port: 9000\n", "  address: 10.1.0.2\n  ssh: {user: other}" + M + "\n  port: 9000\n")
fx("port-collision__side-channel", "  address: 10.1.0.4\n  port: 9000\n", "  address: 10.1.0.1\n  port: 5601" + M + "\n")
fx("port-collision__decode", "    http_port: 5557\n", "    http_port: 5556" + M + "\n")
fx("port-collision__tcp-data", NATIVE, "", "  name: nixl\n", "  name: tcp\n", "    http_port: 5557\n", "    http_port: 5557\n    data_port: 5556" + M + "\n")
fx("tp-gpus", "    gpus: 2\n    port: 8000\n", "    gpus: 1" + M + "\n    port: 8000\n")
fx("tp-gpus__decode", "    gpu: {type: B200, count: 2}\n", "    gpu:\n      type: B200\n      count: 1" + M + "\n")
_LLAMA = ("  family: deepseek_v3\n", "  family: llama\n  generate_tiny: llama\n", "  kv_cache_dtype: {prefill: fp8_ds_mla, decode: fp8}\n", "",
          "  speculative:\n    prefill: {method: mtp, num_speculative_tokens: 1}\n    decode: {method: mtp, num_speculative_tokens: 1}\n", "")
fx("tp-heads", *_LLAMA, "  tensor_parallel: {prefill: 2, decode: 2}\n", "  tensor_parallel:\n    prefill: 2\n    decode: 4" + M + "\n",
   "    gpu: {type: B200, count: 2}\n", "    gpu: {type: B200, count: 4}\n")
fx("tp-heads__mla", "  family: deepseek_v3\n", "  family: deepseek_v3\n  generate_tiny: deepseek_v3\n",
   "  tensor_parallel: {prefill: 2, decode: 2}\n", "  tensor_parallel:\n    prefill: 2\n    decode: 8" + M + "\n",
   "    gpu: {type: B200, count: 2}\n", "    gpu: {type: B200, count: 8}\n")
fx("decode-device", "    gpu: {type: B200, count: 2}\n", "    gpu: {type: cpu}\n    recv_buffer: vram" + M + "\n", "  tensor_parallel: {prefill: 2, decode: 2}\n", "  tensor_parallel: {prefill: 2, decode: 1}\n")
fx("max-seq-len", "    http_port: 5557\n", "    http_port: 5557\n    max_seq_len: 2048" + M + "\n")
fx("kv-cache-dtype", "  kv_cache_dtype: {prefill: fp8_ds_mla, decode: fp8}\n", "  kv_cache_dtype:\n    prefill: fp8_ds_mla\n    decode: auto" + M + "\n")
fx("kv-cache-dtype__llama", "  family: deepseek_v3\n", "  family: llama\n", "  kv_cache_dtype: {prefill: fp8_ds_mla, decode: fp8}\n", "  kv_cache_dtype:\n    prefill: fp8_ds_mla\n    decode: fp8" + M + "\n",
   "  speculative:\n    prefill: {method: mtp, num_speculative_tokens: 1}\n    decode: {method: mtp, num_speculative_tokens: 1}\n", "")
fx("mtp", "    prefill: {method: mtp, num_speculative_tokens: 1}\n    decode: {method: mtp, num_speculative_tokens: 1}\n", "    decode: {method: mtp, num_speculative_tokens: 1}" + M + "\n")
fx("mtp__family", "  family: deepseek_v3\n", "  family: llama\n", "  kv_cache_dtype: {prefill: fp8_ds_mla, decode: fp8}\n", "",
   "    prefill: {method: mtp, num_speculative_tokens: 1}\n    decode: {method: mtp, num_speculative_tokens: 1}\n", "    prefill: {method: mtp, num_speculative_tokens: 1}" + M + "\n")
fx("model-family", "  family: deepseek_v3\n", "  family: glm-5" + M + "\n")
fx("tiny-model-family", "  max_seq_len: 4096\n", "  max_seq_len: 4096\n  generate_tiny: llama" + M + "\n")
fx("native-pool-transport", "  name: nixl\n", "  name: tcp" + M + "\n")
fx("vllm-release", NATIVE, NATIVE.replace("    gpus: 2\n", "    gpus: 0" + M + "\n"))
fx("routing-native", NATIVE, "", "  port: 9000\n", "  port: 9000\n  routing:\n    default_pool: native" + M + "\n")
fx("absolute-path", "  hf_path: /models/tiny\n", "  hf_path: models/tiny" + M + "\n")
fx("extra-args-conflict", '    extra_args: ["--max-num-seqs", "64"]\n', '    extra_args:\n      - --max-num-seqs\n      - "64"\n      - --max-model-len=8192' + M + "\n")
fx("host-conflict__base-dir", "  address: 10.1.0.4\n  port: 9000\n", "  address: 10.1.0.2\n  base_dir: /srv/other" + M + "\n  port: 9000\n")
fx("install-python", "  name: router\n", "  name: router\n  install: operator" + M + "\n")
# 560 decode nodes with 200-character DNS names: the allowlist no longer fits one argv word
_long = "".join(f"  - {{name: x{i}, address: node-{i:04d}.{'x' * 180}.example, gpu: {{type: B200, count: 2}}}}\n" for i in range(560))
fx("argv-limit", "\ndecode:\n", "\ndecode:" + M + "\n" + _long)
# schema findings
fx("schema__unknown-key", "    ctrl_port: 5556\n", "    ctrl_prot: 5556" + M + "\n")
fx("schema__missing", "  - name: p0\n    address: 10.1.0.1\n    gpus: 2\n    port: 8000\n", "  - name: p0" + M + "\n    address: 10.1.0.1\n    gpus: 2\n")
fx("schema__invalid", "  services: process\n", "  services: proces" + M + "\n")
fx("schema__api-key", "  port: 9000\n", "  port: 9000\n  api_key: {env: KEY, file: /etc/key}" + M + "\n")
# memory-fit: DeepSeek-V3's bundled figures (hf_path is not readable here) in bf16 on 2 GPUs
_DSV3 = ("  hf_path: /models/tiny\n", "  hf_path: /models/tiny\n  hf_id: deepseek-ai/DeepSeek-V3\n")
fx("memory-fit", *_DSV3, "    gpu: {type: B200, count: 2}\n", "    gpu: {type: B200, count: 2}" + M + "\n")
fx("memory-fit__gpu-type", *_DSV3, "    gpu: {type: B200, count: 2}\n", "    gpu: {type: RTX-9090, count: 2}" + M + "\n")
fx("memory-fit__prefill", *_DSV3, "    gpu: {type: B200, count: 2}\n", "    gpu: {type: cpu}\n", "  tensor_parallel: {prefill: 2, decode: 2}\n",
   "  tensor_parallel: {prefill: 2, decode: 1}\n", "    gpus: 2\n    port: 8000\n", "    gpus: 2\n    gpu_type: H100" + M + "\n    port: 8000\n")
fx("memory-fit__hf-id", "  hf_path: /models/tiny\n", "  hf_path: /models/tiny\n  hf_id: acme/NoSuchModel-1B" + M + "\n")
# several routers: they answer alike (routers-agree), and the file gives one form, `router` or `routers`
_ROUTERS = "routers:\n  - name: r0\n    address: 10.1.0.4\n    port: 9000\n  - name: r1\n    address: 10.1.0.5\n    port: 9000\n"
fx("routers-agree", "router:\n  name: router\n  address: 10.1.0.4\n  port: 9000\n",
   _ROUTERS + "    otlp_endpoint: http://collector:4318" + M + "\n")
fx("schema__router-form", "  port: 9000\n", "  port: 9000\nrouters:" + M + "\n  - name: r0\n    address: 10.1.0.5\n    port: 9000\n")
