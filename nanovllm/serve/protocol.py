"""The OpenAI API's request bodies (`/v1/completions`, `/v1/chat/completions`), checked field by
field and mapped onto SamplingParams, with vLLM's extra sampling fields (`top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`).

A body is untrusted data: every field has a type and a range, an unknown field is refused, and
each refusal is an APIError (a 400 naming the field) rather than an exception deeper down.
"""
import json
import math
import reprlib
from dataclasses import dataclass

from nanovllm.sampling_params import SamplingParams

SHORT = reprlib.Repr()  # bounded reprs of values in error messages
SHORT.maxlevel, SHORT.maxstring, SHORT.maxother = 3, 60, 60


class APIError(Exception):
    """An OpenAI-style error: the HTTP status, the message, the error type, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}


def is_int(v) -> bool:
    return type(v) is int


def is_number(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def is_str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(s, str) and s for s in v)


def is_token_list(v) -> bool:
    return isinstance(v, list) and all(is_int(t) and t >= 0 for t in v)


def is_prompt(v) -> bool:
    """A string, a list of strings, token ids, or a list of token-id lists; never empty."""
    return isinstance(v, str) or (isinstance(v, list) and bool(v) and (
        all(isinstance(p, str) for p in v) or is_token_list(v)
        or all(is_token_list(p) and p for p in v)))


SAMPLING = {  # field: (test, what is allowed); None is always allowed and means the default
    "max_tokens": (lambda v: is_int(v) and v >= 1, "an integer >= 1"),
    "temperature": (lambda v: is_number(v) and 0 <= v <= 2, "a number in [0, 2]"),
    "top_p": (lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "n": (lambda v: is_int(v) and 1 <= v <= 128, "an integer in [1, 128]"),
    "seed": (lambda v: is_int(v) and -2**63 <= v < 2**64, "an integer in [-2**63, 2**64)"),
    "stop": (lambda v: (isinstance(v, str) and v) or (is_str_list(v) and len(v) <= 16),
             "a non-empty string or a list of at most 16"),
    "presence_penalty": (lambda v: is_number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "frequency_penalty": (lambda v: is_number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "top_k": (lambda v: is_int(v) and v >= -1, "-1, 0 (all tokens) or a positive integer"),
    "min_p": (lambda v: is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": (lambda v: is_number(v) and 1e-3 <= v <= 10, "a number in [0.001, 10]"),
    "min_tokens": (lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
    "stop_token_ids": (lambda v: is_token_list(v) and len(v) <= 64, "a list of token ids"),
    "skip_special_tokens": (lambda v: isinstance(v, bool), "true or false"),
    "stream": (lambda v: isinstance(v, bool), "true or false"),
    "stream_options": (lambda v: isinstance(v, dict) and set(v) <= {"include_usage"} and
                       isinstance(v.get("include_usage", False), bool),
                       'an object {"include_usage": true or false}'),
    "user": (lambda v: isinstance(v, str), "a string"),
    "model": (lambda v: isinstance(v, str), "a string"),
}
IGNORED_WHEN_EMPTY = ("logit_bias", "tools", "functions", "suffix")  # features not served
COMPLETION = {
    **SAMPLING,
    "prompt": (is_prompt, "a string, a list of strings, token ids or a list of token-id lists"),
    "logprobs": (lambda v: is_int(v) and 0 <= v <= 20, "an integer in [0, 20]"),
    "echo": (lambda v: v is False, "false (echo is not supported)"),
    "best_of": (lambda v: is_int(v) and v >= 1, "an integer equal to n"),
}
CHAT = {
    **SAMPLING,
    "messages": (lambda v: isinstance(v, list) and 0 < len(v) <= 4096,
                 "a list of 1 to 4096 messages"),
    "max_completion_tokens": SAMPLING["max_tokens"],
    "logprobs": (lambda v: isinstance(v, bool), "true or false"),
    "top_logprobs": (lambda v: is_int(v) and 0 <= v <= 20, "an integer in [0, 20]"),
    "response_format": (lambda v: v == {"type": "text"},
                        '{"type": "text"} (the only format served)'),
    "tool_choice": (lambda v: v == "none", '"none" (tools are not served)'),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "true or false"),
}
ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclass
class Request:
    """A checked request: its prompts (text or token ids), how to sample, and how to answer."""
    prompts: list
    params: SamplingParams
    stream: bool
    include_usage: bool
    num_logprobs: int | None  # top log-probabilities to report per token (None: none)


def parse_json(body: bytes):
    """The body's JSON object; a 400 for anything else (bad UTF-8, NaN, 1e999, nesting so deep
    that the parser gives up)."""
    try:
        value = json.loads(body, parse_constant=reject_constant, parse_float=finite_float)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError included
        raise APIError(400, f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(value, dict):
        raise APIError(400, f"the body must be a JSON object, not {type(value).__name__}")
    for name, field in value.items():  # JSON's "\ud800" escape: a str no tokenizer can encode
        if not is_unicode(name):
            raise APIError(400, "a field's name holds a lone surrogate (\\ud800 to \\udfff): "
                           "not Unicode text")
        if not is_unicode(field):
            raise APIError(400, f"'{name[:64]}' holds a lone surrogate (\\ud800 to \\udfff): "
                           "not Unicode text", name[:64])
    return value


def is_unicode(value) -> bool:
    """Whether every string in a parsed JSON value is Unicode text (UTF-8 encodes it)."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def short(value) -> str:
    """A value for an error message: a bounded repr, whatever its size and depth."""
    return SHORT.repr(value)


def reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is out of the range of a 64-bit float")
    return value


def check_fields(body: dict, rules: dict, required: tuple[str, ...]):
    """Every field known, present where required, and of the allowed type and range."""
    for name in required:
        if body.get(name) is None:
            raise APIError(400, f"'{name}' is required", name)
    for name, value in body.items():
        if name in IGNORED_WHEN_EMPTY and not value:
            continue
        if name in IGNORED_WHEN_EMPTY:
            raise APIError(400, f"'{name}' is not supported by this server", name)
        if name not in rules:
            raise APIError(400, f"unknown field '{name[:64]}'", name[:64])
        test, allowed = rules[name]
        if value is not None and not test(value):
            raise APIError(400, f"'{name}' must be {allowed}, not {short(value)}", name)


def sampling_params(body: dict, max_tokens, num_logprobs: int | None, output_kind: str):
    """SamplingParams from the sampling fields (OpenAI's defaults where absent)."""
    fields = {name: body[name] for name in ("n", "temperature", "top_p", "seed", "presence_penalty",
                                            "frequency_penalty", "top_k", "min_p",
                                            "repetition_penalty", "min_tokens", "ignore_eos",
                                            "stop_token_ids", "skip_special_tokens", "stop")
              if body.get(name) is not None}
    fields["max_tokens"] = max_tokens
    try:
        return SamplingParams(logprobs=num_logprobs, output_kind=output_kind, **fields)
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), str(e).split("=")[0] if "=" in str(e) else None) from None


def stream_fields(body: dict) -> tuple[bool, bool]:
    stream = bool(body.get("stream"))
    if body.get("stream_options") is not None and not stream:
        raise APIError(400, "'stream_options' is only allowed with stream=true", "stream_options")
    return stream, bool((body.get("stream_options") or {}).get("include_usage"))


def completion_request(body: dict) -> Request:
    """A /v1/completions body, checked."""
    check_fields(body, COMPLETION, ("prompt",))
    if body.get("best_of") not in (None, body.get("n") or 1):
        raise APIError(400, "'best_of' must equal n (no server-side best-of)", "best_of")
    prompt = body["prompt"]
    prompts = [prompt] if isinstance(prompt, str) or is_token_list(prompt) else prompt
    if len(prompts) > 256:
        raise APIError(400, f"'prompt' holds {len(prompts)} prompts; at most 256 per request",
                       "prompt")
    stream, include_usage = stream_fields(body)
    num_logprobs = body.get("logprobs")
    max_tokens = 16 if body.get("max_tokens") is None else body["max_tokens"]  # OpenAI's default
    params = sampling_params(body, max_tokens, num_logprobs, "delta" if stream else "final")
    return Request(prompts, params, stream, include_usage, num_logprobs)


def chat_request(body: dict, max_model_len: int) -> Request:
    """A /v1/chat/completions body, checked; its prompt is the messages (the template is applied
    by the caller, who holds the tokenizer)."""
    check_fields(body, CHAT, ("messages",))
    messages = [check_message(m, i) for i, m in enumerate(body["messages"])]
    stream, include_usage = stream_fields(body)
    if body.get("top_logprobs") is not None and not body.get("logprobs"):
        raise APIError(400, "'top_logprobs' needs logprobs=true", "top_logprobs")
    num_logprobs = (body.get("top_logprobs") or 0) if body.get("logprobs") else None
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or max_model_len
    params = sampling_params(body, max_tokens, num_logprobs, "delta" if stream else "final")
    return Request([messages], params, stream, include_usage, num_logprobs)


def check_message(message, i: int) -> dict:
    """One chat message: a role and its text (a string, or a list of {"type": "text"} parts)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or not set(message) <= {"role", "content", "name"}:
        raise APIError(400, f"{where} must be an object with 'role' and 'content' (and 'name')",
                       where)
    if message.get("role") not in ROLES:
        raise APIError(400, f"{where}.role must be one of {ROLES}", f"{where}.role")
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) and len(p) == 2
                                         for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(400, f"{where}.content must be a string or a list of text parts",
                       f"{where}.content")
    if not isinstance(message.get("name", ""), str):
        raise APIError(400, f"{where}.name must be a string", f"{where}.name")
    return {"role": message["role"], "content": content}
