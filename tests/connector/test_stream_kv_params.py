"""The connector's hand-off report in vLLM's responses: a non-streamed body (every supported vLLM) and, from vLLM
0.33, the streamed chunk that carries `kv_transfer_params` (the one with the finish_reason; a trailing usage chunk
has none). Chunk shapes as 0.33's CompletionStreamResponse / ChatCompletionStreamResponse serialise them
(test_vllm_source_api.py checks the field in vLLM's source)."""

from __future__ import annotations

from tilepd.contracts.marker import RESULT_KEY, handoff_result, handoff_result_of_stream

REPORT = {"transfer_id": "tx-1", "state": "sending"}
NIXL = {"do_remote_decode": True, "remote_engine_id": "e0", "remote_block_ids": [1, 2], "remote_registration_generation": 3}


def _completion_chunk(text: str, finish: str | None, kv: dict | None) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}],
            "usage": None, "kv_transfer_params": kv}


def test_non_streamed_body_and_merged_params_keep_every_other_key() -> None:
    body = {"choices": [{"text": "x"}], "kv_transfer_params": {**NIXL, RESULT_KEY: REPORT}}  # a MultiConnector's merge
    assert handoff_result(body) == REPORT
    assert body["kv_transfer_params"]["remote_registration_generation"] == 3  # read, never rewritten
    assert handoff_result({"choices": []}) is None and handoff_result({"kv_transfer_params": None}) is None
    assert handoff_result({"kv_transfer_params": {RESULT_KEY: "garbage"}}) is None


def test_the_0_33_stream_carries_it_on_the_finishing_chunk_only() -> None:
    chunks = [_completion_chunk("a", None, None), _completion_chunk("b", "length", {RESULT_KEY: REPORT}),
              {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [],
               "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}]  # stream_options.include_usage
    assert handoff_result_of_stream(chunks) == REPORT
    chat = [{"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "b"},
             "finish_reason": "stop"}], "kv_transfer_params": {RESULT_KEY: {"transfer_id": "tx-2", "state": "refused", "reason": "r"}}}]
    assert handoff_result_of_stream(chat) == {"transfer_id": "tx-2", "state": "refused", "reason": "r"}
    assert handoff_result_of_stream([_completion_chunk("a", "length", None)]) is None  # vLLM 0.31-0.32 streams


def test_the_connector_reports_under_its_one_key_and_leaves_nixls_alone() -> None:
    """request_finished's params hold only `tilepd_handoff`: MultiConnector merges them with NixlConnector's
    (do_remote_*, remote_*, remote_registration_generation since 0.33) and refuses a clash; the router forwards
    Nixl's to the native decode as they came (router/native.py)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from tilepd.connector.vllm_connector import KVConnectorRole, TilePDConnector
    from tilepd.contracts.service_configs import ConnectorExtraConfig, DecodeEndpoint, TransportConfig

    node = DecodeEndpoint(name="d0", host="127.0.0.1", ctrl_port=5556, http_port=8100)
    c = TilePDConnector.__new__(TilePDConnector)
    c._setup(ConnectorExtraConfig(decode_allowlist=(node,), transport=TransportConfig(name="tcp"), model_family="llama",
                                  max_seq_len=256), KVConnectorRole.SCHEDULER)

    def request(rid: str, host: str) -> Request:
        params = {**NIXL, "tilepd": {"host": host, "ctrl_port": 5556, "transfer_id": f"tx-{rid}", "token": "t"}}
        return Request(request_id=rid, prompt_token_ids=list(range(1, 20)), pooling_params=None,
                       sampling_params=SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}))

    outcomes = []
    for rid, host in (("a", "127.0.0.1"), ("b", "10.255.0.9")):  # claimed then aborted; refused (not allowlisted)
        r = request(rid, host)
        c.on_new_request(r)
        outcomes.append(c.request_finished(r, [])[1])
    assert [o[RESULT_KEY]["state"] for o in outcomes] == ["not_sent", "refused"]
    assert all(set(o) == {RESULT_KEY} for o in outcomes), outcomes
    assert c.get_handshake_metadata() is None and c.get_handshake_metadata() is None  # asked again after a wake-up
    c.set_xfer_handshake_metadata_pp_aware({(1, 0): object(), (0, 0): object()})  # ignored, whatever ranks
    assert c.get_handshake_metadata() is None
