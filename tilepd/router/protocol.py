"""Request bodies of the OpenAI API the router accepts.

Fields the router honours are declared; any other field is kept (extra="allow") so
the capability gate can name it, route the request to the native pool, or refuse it.

Every field has an explicit bound (the constants below), so no request can make the
router tokenize, template, scan or forward an unbounded amount of work: a body over a
bound gets a 400 naming the field (the whole body is bounded by `max_body_bytes`, 413).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TEXT_CHARS = 1 << 20  # one prompt or message content string
MAX_NAME_CHARS = 256  # model, user, role, name, content-part type
MAX_PROMPT_TOKENS = 1 << 20  # token ids in one prompt
MAX_BATCH = 64  # prompts in a completions batch (the low-latency pool takes one)
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256
MAX_STOP = 16  # stop strings, as vLLM's OpenAI layer takes a list
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_TOKENS = 1 << 20
MAX_TOOLS = 128
MAX_N = 128
MAX_LOGPROBS = 20
MAX_CHOICES = 4096  # structured_outputs.choice entries
TOKEN_ID_MAX = (1 << 31) - 1
INT64 = (-(1 << 63), (1 << 63) - 1)

TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]
# finite floats only: json.loads accepts NaN and Infinity, which no sampler takes
Real = Annotated[float, Field(allow_inf_nan=False, ge=-1e6, le=1e6)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Name
    text: Text | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Name
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: Name | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` field (StructuredOutputsParams, v0.32): one constraint kind plus options.

    Only types are checked here (a 400 naming `structured_outputs.<field>`, as vLLM's own validation names it);
    which kinds and options the low-latency pool serves is the gate's business (tilepd.router.structured)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    json_: Text | dict[str, Any] | None = Field(default=None, alias="json")  # `json` would shadow BaseModel.json
    regex: Text | None = None
    choice: Annotated[list[Text], Field(max_length=MAX_CHOICES)] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    structural_tag: Text | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Text | None = None


class _SamplingFields(BaseModel):
    """Fields shared by chat and completions."""

    model_config = ConfigDict(extra="allow")

    model: Name | None = None
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS)
    temperature: Real | None = Field(default=None, ge=0)
    top_p: Real | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=TOKEN_ID_MAX)
    seed: int | None = Field(default=None, ge=INT64[0], le=INT64[1])
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: Real | None = None
    frequency_penalty: Real | None = None
    repetition_penalty: Real | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    # never forwarded: only the router marks requests for the low-latency pool
    kv_transfer_params: dict[str, Any] | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    prompt: (Text | TokenIds | Annotated[list[Text], Field(max_length=MAX_BATCH)]
             | Annotated[list[TokenIds], Field(max_length=MAX_BATCH)])
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Text | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Any = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


Endpoint = Literal["chat", "completions"]
