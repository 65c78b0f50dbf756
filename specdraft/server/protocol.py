"""OpenAI request bodies -> (prompt ids, SamplingParams, SpecConfig); responses and stream chunks.

Supported: ``model``, ``prompt`` (a string, a one-string list, or a list of token ids) /
``messages``, ``max_tokens`` (chat: also ``max_completion_tokens``), ``temperature`` (OpenAI's
default 1.0; 0 = greedy), ``top_p``, ``stop``, ``seed``, ``stream``, ``stream_options.include_usage``,
``n`` (1 only), ``user`` (ignored), ``presence_penalty``, ``frequency_penalty``, ``logit_bias``,
``logprobs`` (completions: an integer, the number of alternatives; chat: a boolean with
``top_logprobs``), ``response_format`` (``text``, ``json_object``, ``json_schema``); extensions
``top_k``, ``min_p``, ``ignore_eos``, ``repetition_penalty``, ``min_tokens``, vLLM's structured-output fields
(``guided_json``, ``guided_regex``, ``guided_grammar`` (Lark), ``guided_choice``, or one
``structured_outputs`` object with ``json`` / ``regex`` / ``grammar`` / ``choice``) and ``spec`` (a
SpecConfig object merged over the server's default), ``stream_mode`` (``"normal"`` or ``"fixed"``,
server/pacing.py), ``stream_options.include_steps`` (each chunk of a stream gains a ``specdraft`` object:
the step's draft and acceptance and the origin of every token, see ``StepTrace``). Parameters this server cannot honour
get a 400 naming them rather than being silently ignored.
"""

from __future__ import annotations

import bisect
import re
import time
import uuid
from collections import deque
from dataclasses import dataclass

from ..core.checks import is_int, is_num
from ..core.config import PATH_FIELDS, SamplingParams, SpecConfig, for_method, spec_keys
from ..core.errors import ConfigError, ContextLengthError, SpecDraftError
from ..core.processors import RequestProcessor
from ..engine import check_fits
from .pacing import STREAM_MODES


class RequestError(SpecDraftError):
    """An error answered to the client as OpenAI error JSON."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# accepted only at their "off" value; anything else is refused with a precise message
UNSUPPORTED = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "parallel_tool_calls": (None,),
}
SAMPLING_PARAM = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop": "stop",
    "ignore_eos": "ignore_eos",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "logit_bias": "logit_bias",
    "min_tokens": "min_tokens",
    "logprobs": "logprobs",
    "min_p": "min_p",
}
# vLLM's names for structured output: the flat guided_* fields and the keys of structured_outputs
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar", "guided_choice": "choice"}


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    sampling: SamplingParams
    spec: SpecConfig
    stream: bool
    include_usage: bool
    chat: bool
    stream_mode: str | None = None  # None: the server's default (server/pacing.py)
    include_steps: bool = False  # stream_options.include_steps: per-step speculation in each chunk (StepTrace)
    processor: RequestProcessor | None = None  # its logits processing, compiled once (None: none asked)
    cache_salt: str | None = None  # only requests with the same salt (and API key) share cached prefixes


def _check_types(body: dict) -> None:
    for name, kind, ok in [
        ("max_tokens", "an integer", is_int),
        ("max_completion_tokens", "an integer", is_int),
        ("temperature", "a number", is_num),
        ("top_p", "a number", is_num),
        ("top_k", "an integer", is_int),
        ("seed", "an integer", is_int),
        ("n", "an integer", is_int),
        ("stream", "a boolean", lambda v: isinstance(v, bool)),
        ("ignore_eos", "a boolean", lambda v: isinstance(v, bool)),
        ("presence_penalty", "a number", is_num),
        ("frequency_penalty", "a number", is_num),
        ("repetition_penalty", "a number", is_num),
        ("min_tokens", "an integer", is_int),
        ("top_logprobs", "an integer", is_int),
        ("min_p", "a number", is_num),
        ("logit_bias", "an object", lambda v: isinstance(v, dict)),
        ("cache_salt", "a non-empty string", lambda v: isinstance(v, str) and v != ""),
    ]:
        v = body.get(name)
        if v is not None and not ok(v):
            raise RequestError(f"{name} must be {kind}, got {v!r}", param=name, code="invalid_type")
    stop = body.get("stop")
    if (
        stop is not None
        and not isinstance(stop, str)
        and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise RequestError(
            f"stop must be a string or a list of strings, got {stop!r}", param="stop", code="invalid_type"
        )
    if isinstance(stop, list) and len(stop) > 4:
        raise RequestError(f"stop takes at most 4 strings, got {len(stop)}", param="stop")
    n = body.get("n")
    if n is not None and n != 1:
        raise RequestError(f"n must be 1 (this server returns one choice per request), got {n}", param="n")
    for name, off in UNSUPPORTED.items():
        if name in body and body[name] not in off:
            raise RequestError(f"{name} is not supported by this server", param=name, code="unsupported_parameter")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise RequestError("stream_options must be an object", param="stream_options", code="invalid_type")
    for name in ("include_usage", "include_steps"):
        v = (so or {}).get(name)
        if v is not None and not isinstance(v, bool):
            raise RequestError(
                f"stream_options.{name} must be a boolean, got {v!r}",
                param=f"stream_options.{name}",
                code="invalid_type",
            )
    steps = (so or {}).get("include_steps")
    if steps and not body.get("stream"):
        raise RequestError('stream_options.include_steps needs "stream": true', param="stream_options.include_steps")
    mode = body.get("stream_mode")
    if mode is not None and mode not in STREAM_MODES:
        raise RequestError(
            f"stream_mode must be one of {', '.join(map(repr, STREAM_MODES))}, got {mode!r}", param="stream_mode"
        )


def _is_text(s: str) -> bool:
    """Whether ``s`` is Unicode text, i.e. holds no lone surrogate (UTF-8 cannot encode one)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _field_name(path: tuple) -> str:
    """("messages", 0, "content") -> "messages[0].content"."""
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")


_SCALARS = {int, float, bool, type(None)}


def _check_text(body: dict) -> None:
    """A 400 naming a field whose string (or key) holds a lone surrogate: valid JSON ("\\ud800" is an
    escape), but no text: tokenizers, chat templates and the grammar compiler fail on it (they were 500s).
    Walked with a queue, not recursion: the parser takes nesting deeper than the recursion limit left here."""
    todo = deque([((), body)])
    while todo:
        path, obj = todo.popleft()
        if isinstance(obj, list) and set(map(type, obj)) <= _SCALARS:  # token ids: skipped at C speed
            continue
        for k, v in obj.items() if isinstance(obj, dict) else enumerate(obj):
            if isinstance(k, str) and not _is_text(k):
                where = _field_name(path)
                raise RequestError(
                    f"{where or 'the request body'} has a key that holds a lone surrogate (an "
                    "unpaired \\ud800-\\udfff escape): not Unicode text",
                    param=where or None,
                )
            if isinstance(v, str) and not _is_text(v):
                where = _field_name(path + (k,))
                raise RequestError(
                    f"{where} holds a lone surrogate (an unpaired \\ud800-\\udfff escape): not Unicode text",
                    param=where,
                )
            if isinstance(v, (dict, list)):
                todo.append((path + (k,), v))


def _spec(body: dict, default: SpecConfig, resources: dict | None = None) -> SpecConfig:
    s = body.get("spec")
    return default if s is None else spec_over(s, default, resources)


def spec_over(s, default: SpecConfig, resources: dict | None = None) -> SpecConfig:
    """A request's ``spec`` merged over the server's default (less the default's keys that only other
    methods read, when the request names another method). Fields naming files take only the names
    of ``resources`` ({field: {name: path}}, the operator's, from the server's start): a request never
    names a path (a FIFO or /dev/zero would block the server; error messages would tell which files exist)."""
    if not isinstance(s, dict):
        raise RequestError(
            f"spec must be a JSON object (a SpecConfig), got {type(s).__name__}", param="spec", code="invalid_type"
        )
    if "params" in s:  # merged over the default's flat keys, a nested object would be dropped unread
        raise RequestError(
            "spec.params is not a spec key: a method's own parameters are flat keys of spec "
            '(e.g. {"method": "auto", "learn_costs": false})',
            param="spec.params",
        )
    s = {k: (_resource(k, v, resources or {}) if k in PATH_FIELDS else v) for k, v in s.items()}
    d = for_method(default.to_dict(), s.get("method", default.method))
    if "k" in s and "max_k" not in s:
        d["max_k"] = max(d["max_k"], s["k"]) if is_int(s["k"]) else d["max_k"]
    d.update(s)
    try:
        return SpecConfig.from_dict(d)
    except ConfigError as e:
        raise RequestError(f"spec: {e}", param=spec_param(str(e))) from None


def _resource(field: str, name, resources: dict):
    """The path the operator configured under ``name`` for a path field (None and autotune's "off" pass)."""
    if name is None or (field == "autotune" and name == "off"):
        return name
    table = resources.get(field) or {}
    if isinstance(name, str) and name in table:
        return table[name]
    names = ", ".join(map(repr, sorted(table))) or "none are configured"
    raise RequestError(
        f"spec.{field} must name a {field} this server was started with ({names}); a request may not name a file path",
        param=f"spec.{field}",
    )


def spec_param(message: str) -> str:
    """``spec.<field>`` for the first spec key (a field, a method's parameter) a validation message names
    (else ``spec``)."""
    message = message.split("; valid fields")[0]  # (the list of every field names them all)
    keys = spec_keys() | {"params"}
    hits = [(m.start(), f) for f in keys for m in [re.search(rf"(?<![\w.]){f}(?!\w)", message)] if m]
    return f"spec.{min(hits)[1]}" if hits else "spec"


CHARS_PER_TOKEN = 32  # a text longer than the context x this cannot fit: refused before tokenizing it


def _check_chars(n_chars: int, ctx: int, param: str) -> None:
    if n_chars > CHARS_PER_TOKEN * ctx:
        raise RequestError(
            f"the {param} has {n_chars} characters; the model's context of {ctx} tokens takes at "
            f"most {CHARS_PER_TOKEN * ctx}",
            param=param,
            code="context_length_exceeded",
        )


def _messages_ids(tokenizer, messages, ctx: int) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    msgs = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]")
        if m["role"] not in ("system", "developer", "user", "assistant"):
            raise RequestError(
                f"messages[{i}].role {m['role']!r} is not supported; use system, user or assistant",
                param=f"messages[{i}].role",
            )
        c = m.get("content")
        if isinstance(c, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c):
                raise RequestError(
                    f"messages[{i}].content: only text parts are supported", param=f"messages[{i}].content"
                )
            c = "".join(p["text"] for p in c)
        if not isinstance(c, str):
            raise RequestError(
                f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content"
            )
        msgs.append({"role": "system" if m["role"] == "developer" else m["role"], "content": c})
    _check_chars(sum(len(m["content"]) for m in msgs), ctx, "messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("this model has no chat template; use /v1/completions", param="messages")
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _prompt_ids(tokenizer, prompt, vocab: int, ctx: int) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        _check_chars(len(prompt), ctx, "prompt")
        if tokenizer is None:
            raise RequestError("this model has no tokenizer; send prompt as a list of token ids", param="prompt")
        return [int(t) for t in tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}", param="prompt")
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError(f"one prompt per request is supported, got {len(prompt)}", param="prompt")
    raise RequestError(
        "prompt must be a string, a list with one string, or a non-empty list of token ids", param="prompt"
    )


def _regex_literal(s: str) -> str:
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$-#&~" else c for c in s)


def _constraint(body: dict) -> tuple[dict, str | None]:
    """The structured-output fields of SamplingParams from response_format / guided_* /
    structured_outputs, and the body field they came from (for error messages)."""
    found = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise RequestError(
                'response_format must be {"type": "text" | "json_object" | "json_schema"}', param="response_format"
            )
        if rf["type"] == "json_object":
            found.append(("response_format", "json", {"type": "object"}))
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), (dict, bool)):
                raise RequestError(
                    "response_format.json_schema must be an object with a 'schema' (a JSON schema)",
                    param="response_format.json_schema",
                )
            if js["schema"] is False:
                raise RequestError(
                    "response_format.json_schema.schema is false: no document is valid",
                    param="response_format.json_schema",
                )
            schema = js["schema"] if isinstance(js["schema"], dict) else {}  # true: any JSON value
            found.append(("response_format", "json", schema))
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, kind, body[name]))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise RequestError("structured_outputs must be an object", param="structured_outputs", code="invalid_type")
        found += [(f"structured_outputs.{k}", k, v) for k, v in so.items() if k in GUIDED.values() and v is not None]
    if not found:
        return {}, None
    if len(found) > 1:
        raise RequestError(
            f"set one structured-output constraint, got {', '.join(f[0] for f in found)}", param=found[1][0]
        )
    param, kind, v = found[0]
    if kind == "choice":
        if not (isinstance(v, list) and v and all(isinstance(c, str) and c for c in v)):
            raise RequestError(f"{param} must be a non-empty list of non-empty strings", param=param)
        return {"regex": "(" + "|".join(_regex_literal(c) for c in v) + ")"}, param
    if kind in ("regex", "grammar") and not (isinstance(v, str) and v):
        raise RequestError(f"{param} must be a non-empty string", param=param, code="invalid_type")
    return {"json_schema" if kind == "json" else kind: v}, param


def _logprobs(body: dict, chat: bool) -> int | None:
    """SamplingParams.logprobs: completions send the number of alternatives, chat a boolean and
    top_logprobs."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            raise RequestError(f"logprobs must be a boolean, got {lp!r}", param="logprobs", code="invalid_type")
        if top is not None and not lp:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (top or 0) if lp else None
    if top is not None:
        raise RequestError(
            "top_logprobs is a chat parameter; completions take logprobs: <number>", param="top_logprobs"
        )
    if lp is not None and not is_int(lp):
        raise RequestError(
            f"logprobs must be an integer (the number of alternatives), got {lp!r}",
            param="logprobs",
            code="invalid_type",
        )
    return lp


def _prompt(body: dict, chat: bool, target, tokenizer) -> tuple[list[int], object]:
    """-> (the prompt's token ids, the requested max_tokens or None)."""
    if chat:
        if "messages" not in body:
            raise RequestError(
                "missing required parameter: messages", param="messages", code="missing_required_parameter"
            )
        ids = _messages_ids(tokenizer, body["messages"], target.max_context)
        prompt_param = "messages"
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        if "prompt" not in body:
            raise RequestError("missing required parameter: prompt", param="prompt", code="missing_required_parameter")
        ids = _prompt_ids(tokenizer, body["prompt"], target.vocab_size, target.max_context)
        prompt_param = "prompt"
        max_tokens = body.get("max_tokens")
    if not ids:
        raise RequestError("the prompt is empty: need at least one token", param=prompt_param)
    ctx = target.max_context
    if len(ids) >= ctx:
        raise RequestError(
            f"the prompt has {len(ids)} tokens; the model's context is {ctx} tokens",
            param=prompt_param,
            code="context_length_exceeded",
        )
    return ids, max_tokens


def _sampling(body: dict, chat: bool, ids: list[int], max_tokens: int, target, tokenizer):
    """(the request's checked SamplingParams, its processor: compiled here, once, so that a bad grammar or
    logit_bias is a 400 before queueing)."""
    """The request's sampling fields -> SamplingParams, checked here (its grammar compiled, its logit_bias ids
    and its length against the context), so that a bad one is a 400 before queueing."""
    stop = body.get("stop")
    d = {
        "max_new_tokens": max_tokens,
        "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
        "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
        "top_k": body.get("top_k") or 0,
        "seed": body.get("seed"),
        "stop": [] if stop is None else ([stop] if isinstance(stop, str) else list(stop)),
        "ignore_eos": bool(body.get("ignore_eos", False)),
        "logprobs": _logprobs(body, chat),
    }
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "min_p"):
        if body.get(name) is not None:
            d[name] = body[name]
    extra, cparam = _constraint(body)
    d.update(extra)
    try:
        sp = SamplingParams.from_dict(d)
    except ConfigError as e:
        msg = str(e)
        field = msg.split(" ", 1)[0].split("[")[0]
        param = SAMPLING_PARAM.get(field, cparam if field in ("json_schema", "regex", "grammar") else None)
        raise RequestError(msg.replace("max_new_tokens", "max_tokens"), param=param) from None
    try:
        processor = RequestProcessor.for_request(sp, ids, target.vocab_size, target.eos_token_ids(), tokenizer)
    except ConfigError as e:
        raise RequestError(
            str(e), param=cparam if sp.constrained and "logit_bias" not in str(e) else "logit_bias"
        ) from None
    try:
        check_fits(target, len(ids), sp)
    except ContextLengthError as e:
        raise RequestError(
            str(e).replace("max_new_tokens", "max_tokens"), param="max_tokens", code="context_length_exceeded"
        ) from None
    return sp, processor


def parse_request(
    body,
    *,
    chat: bool,
    model_name: str,
    target,
    tokenizer,
    default_spec: SpecConfig,
    default_max_tokens: int,
    resources: dict | None = None,
) -> ParsedRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_text(body)
    model = body.get("model")
    if model is not None and model != model_name:
        raise RequestError(
            f"the model {model!r} does not exist; this server serves {model_name!r}",
            param="model",
            code="model_not_found",
            status=404,
        )
    _check_types(body)
    ids, max_tokens = _prompt(body, chat, target, tokenizer)
    if max_tokens is None:
        max_tokens = min(default_max_tokens, target.max_context - len(ids))
    sp, processor = _sampling(body, chat, ids, max_tokens, target, tokenizer)
    spec = _spec(body, default_spec, resources)
    so = body.get("stream_options") or {}
    return ParsedRequest(
        ids,
        sp,
        spec,
        bool(body.get("stream", False)),
        bool(so.get("include_usage", False)),
        chat,
        body.get("stream_mode"),
        bool(so.get("include_steps", False)),
        processor,
        body.get("cache_salt"),
    )


def usage(stats, method: str, hide_acceptance: bool = False) -> dict:
    """OpenAI's usage plus this request's speculation; ``hide_acceptance`` (fixed streams) leaves out
    everything that counts steps or accepted drafts (the side channel fixed mode closes)."""
    u = {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.new_tokens,
        "total_tokens": stats.prompt_tokens + stats.new_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},  # from the prefix cache
        "method": method,  # extensions: speculative decoding of this request
    }
    if not hide_acceptance:
        u.update(
            {
                "steps": len(stats.steps),
                "drafted": stats.drafted,
                "accepted": stats.accepted,
                "mean_accepted_tokens": stats.mat,
                "acceptance_rate": stats.acceptance_rate,
            }
        )
    if getattr(stats, "lossy", None):  # an opt-in lossy verification rule made this output
        u["lossy"] = stats.lossy
    if getattr(stats, "arms", None) and not hide_acceptance:  # a composite drafter (auto, hybrid): steps per arm
        u["arms"] = stats.arms
    if getattr(stats, "reproducible", None) is not None:  # seeded sampling: does the seed pin the tokens
        u["reproducible"] = stats.reproducible
    return u


def finish_reason(stats) -> str:
    return "stop" if stats.finish_reason == "stop" else "length"


class ResponseBuilder:
    def __init__(self, chat: bool, model: str, tokenizer=None, hide_acceptance: bool = False):
        self.chat = chat
        self.hide_acceptance = hide_acceptance  # fixed mode: usage without steps and acceptance
        self.model = model
        self.tok = tokenizer
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, stats, method: str, logprobs: list | None = None) -> dict:
        fr = finish_reason(stats)
        lp = self.logprobs(logprobs)
        if self.chat:
            d = self._base("chat.completion")
            d["choices"] = [
                {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": fr}
            ]
        else:
            d = self._base("text_completion")
            d["choices"] = [{"index": 0, "text": text, "logprobs": lp, "finish_reason": fr}]
        d["usage"] = usage(stats, method, self.hide_acceptance)
        return d

    def chunk(
        self,
        delta: str | None,
        finish: str | None = None,
        first: bool = False,
        logprobs: list | None = None,
        steps: dict | None = None,
    ) -> dict:
        lp = self.logprobs(logprobs)
        if self.chat:
            d = self._base("chat.completion.chunk")
            dl = {} if delta is None else {"content": delta}
            if first:
                dl = {"role": "assistant", "content": ""}
            d["choices"] = [{"index": 0, "delta": dl, "logprobs": lp, "finish_reason": finish}]
        else:
            d = self._base("text_completion")
            d["choices"] = [{"index": 0, "text": delta or "", "logprobs": lp, "finish_reason": finish}]
        if steps is not None:  # stream_options.include_steps (StepTrace): an extension field, beside OpenAI's
            d["specdraft"] = steps
        return d

    def logprobs(self, entries: list | None) -> dict | None:
        """OpenAI's logprobs object of some emitted tokens (``processors.logprob_entries``): chat's
        ``{"content": [{token, logprob, bytes, top_logprobs}]}``, completions' parallel lists."""
        if entries is None:
            return None
        word = (lambda t: self.tok.decode([t])) if self.tok is not None else str
        if self.chat:

            def item(t, lp):
                w = word(t)
                return {"token": w, "logprob": lp, "bytes": list(w.encode("utf-8"))}

            return {
                "content": [
                    {**item(e["token_id"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]}
                    for e in entries
                ],
                "refusal": None,
            }
        words = [word(e["token_id"]) for e in entries]
        offsets, at = [], 0
        for w in words:
            offsets.append(at)
            at += len(w)
        return {
            "tokens": words,
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{word(t): lp for t, lp in e["top"]} for e in entries],
            "text_offset": offsets,
        }

    def usage_chunk(self, stats, method: str) -> dict:
        d = self._base("chat.completion.chunk" if self.chat else "text_completion")
        d["choices"] = []
        d["usage"] = usage(stats, method, self.hide_acceptance)
        return d


class Detokenizer:
    """Incremental detokenization, linear in the output's length (the offset-based scheme of vLLM and TGI):
    each push decodes a window of the last tokens only, from ``CONTEXT`` tokens before the new ones, so that
    what a tokenizer joins across tokens (a word's leading space, a UTF-8 character split over byte tokens)
    comes out as in the whole text. A partial character at the end is held back until it completes."""

    CONTEXT = 6  # tokens kept before the new ones: more than the 4 bytes of the longest UTF-8 character

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.start = 0  # the window: ids[start:]
        self.done = 0  # characters of the window's text already returned

    def _decode(self) -> str:
        return self.tok.decode(self.ids[self.start :], skip_special_tokens=True)

    def push(self, new: list[int]) -> str:
        """The text the ``new`` tokens complete."""
        self.ids.extend(int(t) for t in new)
        window = self._decode()
        ready = window.rstrip("\ufffd")
        delta = ready[self.done :]
        self.done = max(self.done, len(ready))
        if len(ready) == len(window) and len(self.ids) - self.start > 2 * self.CONTEXT:  # nothing held: slide
            self.start = len(self.ids) - self.CONTEXT
            self.done = len(self._decode())
        return delta


def _cut_at_stop(text: str, stops: list[str], after: int = 0) -> int:
    """Where the first stop string found at or after char ``after`` starts, or -1."""
    return min((i for i in (text.find(s, after) for s in stops) if i >= 0), default=-1)


class TextStream:
    """Incremental detokenization for streaming: emits only text that is final (no partial UTF-8
    character, nothing that might become part of a stop string), cut at the first stop string. The last
    push decodes the whole output once, so that the stream's text is exactly the non-streamed answer's."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tok = tokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.detok = Detokenizer(tokenizer)
        self.text = ""  # decoded so far, cut at a stop string once one is found
        self.stopped = False
        self.sent = 0

    def push(self, new: list[int], final: bool = False) -> str:
        after = max(0, len(self.text) - self.hold)  # a stop string ending in the new text starts here or later
        if final:
            self.detok.ids.extend(int(t) for t in new)
            self.text, self.stopped, after = self.tok.decode(self.detok.ids, skip_special_tokens=True), False, 0
        elif not self.stopped:
            self.text += self.detok.push(new)
        cut = -1 if self.stopped else _cut_at_stop(self.text, self.stops, after)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
        t = self.text if final or self.stopped else self.text[: max(self.sent, len(self.text) - self.hold)]
        delta = t[self.sent :]
        self.sent = max(self.sent, len(t))
        return delta


class StepTrace:
    """``stream_options.include_steps``: what each step drafted and accepted, and which characters of the
    streamed text each token made, so that a client can colour every token by its origin. ``step`` gives a
    chunk's ``specdraft`` object: ``step`` {n, drafted, accepted, emitted, arm} (``arm``: what drafted
    it under auto / hybrid, else null), ``tokens`` (this step's, each {index, step, position, accepted,
    arm[, logprob]}: ``accepted`` true for a draft the target accepted, false for the target's own token)
    and ``pieces``: [text, token index] pairs that split the chunk's text exactly (text held back by
    the stream, e.g. half a UTF-8 character, comes with a later chunk, still under its own token)."""

    def __init__(self, tokenizer):
        self.detok = Detokenizer(tokenizer)
        self.ends: list[int] = []  # characters of the decoded output through each token
        self.n = 0

    def step(self, new: list[int], rec, logprobs: list | None, start: int, delta: str) -> dict:
        """After a step: ``rec`` its StepRecord (None if unknown), ``delta`` the chunk's text from char ``start``."""
        self.n += 1
        acc = rec.accepted if rec is not None else 0
        arm = getattr(rec, "arm", None)
        tokens = []
        for j, t in enumerate(new):  # one short decode per emitted token
            self.ends.append((self.ends[-1] if self.ends else 0) + len(self.detok.push([t])))
            tok = {"index": len(self.ends) - 1, "step": self.n, "position": j, "accepted": j < acc, "arm": arm}
            if logprobs is not None and j < len(logprobs):
                tok["logprob"] = logprobs[j]["logprob"]
            tokens.append(tok)
        step = (
            None
            if rec is None
            else {"n": self.n, "drafted": rec.drafted, "accepted": rec.accepted, "emitted": rec.emitted, "arm": arm}
        )
        return {"step": step, "tokens": tokens, "pieces": self.pieces(start, delta)}

    def pieces(self, start: int, delta: str) -> list:
        """``delta`` (the text from char ``start``) cut at the tokens' ends: [[text, token index], ...]."""
        out, at, stop = [], start, start + len(delta)
        i = bisect.bisect_right(self.ends, start)
        while at < stop:
            end = min(self.ends[i], stop) if i < len(self.ends) - 1 else stop  # the last token takes the rest
            if end > at:
                out.append([delta[at - start : end - start], min(i, len(self.ends) - 1)])
                at = end
            i += 1
        return out

    def tail(self, start: int, delta: str) -> dict:
        """The stream's last chunk: the text released at the end, under its tokens."""
        return {"step": None, "tokens": [], "pieces": self.pieces(start, delta)}
