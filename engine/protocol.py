"""The tensor contract of the served models, as plain numpy (no Triton imports).

Input and output names follow Triton's vLLM backend so that its clients (and
`genai-perf --backend vllm`) work unchanged. The Triton models turn their request tensors into
a dict of numpy arrays, call `parse_request`, and turn `make_response` back into tensors.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, TypeVar

import numpy as np

from engine.outputs import RequestOutput
from engine.sampling_params import (MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams,
                                    load_json_object)

_FLAGS = ("stream", "exclude_input_in_output", "return_finish_reason",
          "return_num_input_tokens", "return_num_output_tokens", "return_logprobs",
          "return_output_ids", "return_num_cached_tokens", "return_cumulative_logprob")

INPUT_NAMES = ("text_input", "input_ids", "sampling_parameters") + _FLAGS
OUTPUT_NAMES = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens",
                "output_ids", "logprobs", "num_cached_tokens", "cumulative_logprob")
# The request's own parameters as a JSON object, which the models pass beside the tensors under
# this name (no input has it). They are where Triton's generate endpoint puts its "parameters"
# object and every key that is not an input (`{"text_input": ..., "parameters":
# {"temperature": 0}}`, or `{"text_input": ..., "max_tokens": 8}`), and gRPC its parameters
# map. Triton's vLLM backend reads them as the sampling parameters when the
# `sampling_parameters` input is absent (and ignores them when it is given); here they are
# merged under it (the input wins), and a key naming a flag input (`stream`,
# `return_finish_reason`, ...) sets that flag where its tensor is absent. Any other key is an
# error where the parameters are the request's sampling parameters (a misspelt key would
# otherwise go unheard); beside the input it is left alone, as the vLLM backend leaves it (e.g.
# headers tritonserver forwards as parameters).
REQUEST_PARAMETERS = "parameters"
# llm_bls's input to llm: abort the request the caller started with this id. Only ids of the
# requests llm_bls starts (BLS_REQUEST_ID_PREFIX...) are honoured: another client could guess.
CONTROL_INPUT_NAMES = ("abort_request_id",)
BLS_REQUEST_ID_PREFIX = "bls-"
# What a request in flight is told when a signal stops the server (llm and llm_bls).
SHUTTING_DOWN = "the server is shutting down"


class ServingError(str):
    """A request's error message (compared, logged and sent as the str it is) and its kind, which
    the model turns into the server's status code: INVALID the request itself (HTTP 400, gRPC
    INVALID_ARGUMENT: a client must not retry it as it is), CANCELLED, UNAVAILABLE (the server
    is stopping or the engine is gone: 503), INTERNAL (a fault of ours: 500)."""
    INVALID, CANCELLED, UNAVAILABLE, INTERNAL = "invalid", "cancelled", "unavailable", "internal"
    kind: str

    def __new__(cls, message: str, kind: str) -> ServingError:
        error = super().__new__(cls, message)
        error.kind = kind
        return error


# An error's kind as the name of Triton's status code; any other kind is INTERNAL. Triton
# 2.51's BLS responses drop an error's code (llm_bls sees INTERNAL for every error of llm's),
# so llm ends the message of an error it sends to llm_bls with its kind (tag_error_kind), and
# llm_bls takes the tag off (untag_error_kind) and answers with that kind's code: a prompt too
# long for the model is the client's fault (HTTP 400) through llm_bls as through llm.
ERROR_CODE_NAMES = {ServingError.INVALID: "INVALID_ARG", ServingError.CANCELLED: "CANCELLED",
                    ServingError.UNAVAILABLE: "UNAVAILABLE"}
_KIND_TAG = " [llm error kind: "


def error_code(codes: Any, kind: str | None) -> Any:
    """`kind`'s status code among `codes` (the Python backend's pb_utils.TritonError)."""
    return getattr(codes, ERROR_CODE_NAMES.get(kind, "INTERNAL"))


def tag_error_kind(message: str, kind: str | None) -> str:
    return f"{message}{_KIND_TAG}{kind or ServingError.INTERNAL}]"


def untag_error_kind(message: str) -> tuple[str, str | None]:
    """(the message without its tag, the kind), or (message, None) if it has no tag."""
    head, tag, kind = message.rpartition(_KIND_TAG)
    if not tag or not kind.endswith("]"):
        return message, None
    return head, kind[:-1]

# Sizes a request may have, checked before anything is parsed: prompts are tokenized and
# checked against the model's max_model_len later, and this bounds what reaches that point
# (and what llm_bls forwards). No model served here takes more than 1M tokens; 16 MiB of text
# is 16 bytes per token of that. gRPC (client and Triton) allows messages up to 2 GiB.
MAX_TEXT_INPUT_BYTES = 16 << 20
MAX_INPUT_IDS = 1 << 20
MAX_SAMPLING_PARAMETERS_BYTES = 1 << 20

# TensorRT-LLM's word-list inputs (llm_bls): stop_words are added to `stop`, bad_words to
# `bad_words` (TensorRT-LLM's README sends both as "": none).
TRTLLM_WORD_INPUTS = ("stop_words", "bad_words")
# TensorRT-LLM-style scalar inputs (llm_bls): they override the JSON sampling parameters.
SCALAR_OVERRIDES = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int,
                    "seed": int, "min_tokens": int, "repetition_penalty": float,
                    "presence_penalty": float, "frequency_penalty": float}


@dataclass
class GenerateRequest:
    prompt: str | list[int]
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_logprobs: bool = False
    return_output_ids: bool = False
    return_num_cached_tokens: bool = False
    return_cumulative_logprob: bool = False
    # The sampling parameters asked for no logprobs, but cumulative_logprob was: the engine
    # computes the sampled tokens' (logprobs 0) for the sum, and `logprobs` stays "null".
    logprobs_for_the_sum_only: bool = False


def _scalar(arr: np.ndarray, name: str) -> Any:
    flat = np.asarray(arr).reshape(-1)
    if flat.size != 1:
        raise ValueError(f"{name} must hold exactly one value, got {flat.size}")
    return flat[0]


def _text(arr: np.ndarray, name: str, max_bytes: int | None = None) -> str:
    v = _scalar(arr, name)
    if isinstance(v, (bytes, np.bytes_)):
        v = bytes(v)
        _check_size(name, len(v), max_bytes)
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{name} is not valid UTF-8: {e}") from None
    if isinstance(v, str):
        _check_size(name, len(v.encode("utf-8", errors="surrogatepass")), max_bytes)
        return v
    raise ValueError(f"{name} must be a string (TYPE_STRING / BYTES), got {type(v).__name__}")


def _check_size(name: str, num_bytes: int, max_bytes: int | None) -> None:
    if max_bytes is not None and num_bytes > max_bytes:
        raise ValueError(f"{name} is {num_bytes} bytes long; at most {max_bytes} bytes "
                         f"({max_bytes >> 20} MiB) are allowed")


def _flag(arr: np.ndarray, name: str) -> bool:
    v = _scalar(arr, name)
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    raise ValueError(f"{name} must be a boolean (TYPE_BOOL), got {np.asarray(arr).dtype}")


def _whole_number(v: float) -> int | float:
    return int(v) if v.is_integer() else v


def _coerce_json_values(d: dict) -> dict:
    """Clients of Triton's vLLM backend often send numbers and booleans as strings
    ("max_tokens": "64"), and JSON writers may give a whole number as 64.0 (Python's json
    for a float); accept those where they parse cleanly (vLLM's OpenAI server and its Triton
    backend do). A fraction where an integer belongs stays an error naming the field."""
    types = {f.name: f.type for f in fields(SamplingParams)}
    out = {}
    for k, v in d.items():
        t = str(types.get(k, ""))
        if isinstance(v, float) and "int" in t and "list" not in t and "dict" not in t:
            v = _whole_number(v)
        elif isinstance(v, str) and k in types and "list" not in t and "dict" not in t and t != "str":
            s = v.strip().lower()
            if "bool" in t and s in ("true", "false"):
                v = s == "true"
            elif "int" in t:
                try:
                    v = int(s)
                except ValueError:
                    try:
                        v = _whole_number(float(s))
                    except ValueError:
                        pass
            elif "float" in t:
                try:
                    v = float(s)
                except ValueError:
                    pass
        out[k] = v
    return out


def parse_sampling_parameters(text: str) -> dict:
    return _coerce_json_values(load_json_object(text, "sampling_parameters"))


def with_request_parameters(inputs: dict[str, np.ndarray], parameters: str | None) -> dict:
    """`inputs` with the request's parameters (the JSON object of Triton's
    `request.parameters()`) under REQUEST_PARAMETERS, where it has any."""
    if parameters and parameters.strip() not in ("", "{}"):
        inputs[REQUEST_PARAMETERS] = np.array([parameters.encode()], dtype=np.object_)
    return inputs


T = TypeVar("T")


def _only_value_errors(fn: Callable[..., T]) -> Callable[..., T]:
    """The server answers a ValueError with a per-request error; whatever else hostile input
    might raise is turned into one, so that it never escapes as another type."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - see the docstring
            raise ValueError(f"the request cannot be read: {type(e).__name__}: {e}") from None
    return wrapper


@_only_value_errors
def parse_request(inputs: dict[str, np.ndarray]) -> GenerateRequest:
    """Validates a request's tensors; raises ValueError naming the offending input."""
    prompt = _prompt(inputs)
    params, flags = _sampling_dict(inputs)
    try:
        sampling = SamplingParams.from_dict(params)
    except TypeError as e:
        raise ValueError(f"sampling_parameters: {e}") from None

    flags.update({name: _flag(inputs[name], name) for name in _FLAGS
                  if inputs.get(name) is not None})
    if flags.get("stream") and flags.get("exclude_input_in_output") is False:
        raise ValueError("exclude_input_in_output=false is not allowed with stream=true (as in "
                         "Triton's vLLM backend): a stream's responses carry only new text")
    # The vLLM backend's cumulative_logprob came from vLLM's engine, which summed the sampled
    # tokens' logprobs whether or not logprobs were asked for (a NaN in its place, as a later
    # vLLM's None, makes an HTTP response's JSON invalid).
    sum_only = bool(flags.get("return_cumulative_logprob")) and sampling.logprobs is None
    if sum_only:
        sampling.logprobs = 0
    return GenerateRequest(prompt, sampling, **flags, logprobs_for_the_sum_only=sum_only)


def _prompt(inputs: dict[str, np.ndarray]) -> str | list[int]:
    """The request's prompt, checked first by llm and llm_bls alike: a request with several
    faults is told the same one by both."""
    has_ids = inputs.get("input_ids") is not None
    if has_ids and inputs.get("text_input") is not None:
        raise ValueError("give text_input or input_ids, not both")
    if has_ids:
        return _input_ids(inputs["input_ids"])
    if inputs.get("text_input") is None:
        raise ValueError("missing input: give text_input (a string) or input_ids")
    prompt = _text(inputs["text_input"], "text_input", MAX_TEXT_INPUT_BYTES)
    if not prompt:
        raise ValueError("text_input is empty")
    return prompt


def _sampling_dict(inputs: dict[str, np.ndarray]) -> tuple[dict, dict[str, bool]]:
    """The request's sampling parameters as a dict (the request parameters', then the
    sampling_parameters input's over them) and the flags its parameters set."""
    params, flags = _request_parameters(inputs)
    if inputs.get("sampling_parameters") is not None:
        params.update(parse_sampling_parameters(_text(inputs["sampling_parameters"],
                                                      "sampling_parameters",
                                                      MAX_SAMPLING_PARAMETERS_BYTES)))
    return params, flags


def _request_parameters(inputs: dict[str, np.ndarray]) -> tuple[dict, dict[str, bool]]:
    """The request parameters (REQUEST_PARAMETERS) split into sampling parameters and flags."""
    if inputs.get(REQUEST_PARAMETERS) is None:
        return {}, {}
    text = _text(inputs[REQUEST_PARAMETERS], "parameters", MAX_SAMPLING_PARAMETERS_BYTES)
    given = _coerce_json_values(load_json_object(text, "parameters"))
    for key in _SERVER_PARAMETERS:
        given.pop(key, None)
    unknown = sorted(str(k) for k in given if k not in _FLAGS and k not in _SAMPLING_KEYS)
    if unknown and inputs.get("sampling_parameters") is not None:
        given = {k: v for k, v in given.items() if k in _FLAGS or k in _SAMPLING_KEYS}
    elif unknown:
        raise ValueError(f"unknown request parameter(s) {unknown}: the request's parameters "
                         f"may be sampling parameters {list(_SAMPLING_KEYS)} or the flags "
                         f"{list(_FLAGS)}")
    flags = {}
    for name in _FLAGS:
        if name in given:
            v = given.pop(name)
            if isinstance(v, str) and v.strip().lower() in ("true", "false"):
                v = v.strip().lower() == "true"
            if not isinstance(v, bool):
                raise ValueError(f"parameters: {name} must be true or false, got {v!r:.40}")
            flags[name] = v
    return given, flags


_SAMPLING_KEYS = tuple(SamplingParams.field_names())
# What Triton itself takes from a request and passes on among its parameters: the generate
# endpoint's body "id" is the request's id (echoed in the response), not a sampling key.
_SERVER_PARAMETERS = ("id",)


def _input_ids(arr: np.ndarray) -> list[int]:
    """Token ids as ints. Their range is the model's vocabulary: checked by the engine."""
    ids = np.asarray(arr).reshape(-1)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be integers (TYPE_INT32), got {ids.dtype}")
    if ids.size == 0:
        raise ValueError("input_ids is empty: give at least one token id")
    if ids.size > MAX_INPUT_IDS:
        raise ValueError(f"input_ids holds {ids.size} token ids; at most {MAX_INPUT_IDS} are "
                         f"allowed")
    return ids.tolist()


@_only_value_errors
def bls_inner_inputs(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The llm_bls request turned into an llm request: TensorRT-LLM-style scalar inputs merged
    into `sampling_parameters` (they win), the request parameters folded in as `llm` reads
    them, one response (`stream` false). Raises ValueError for a request `llm` would refuse, so
    that it is not forwarded, with the message `llm` would give (the prompt is checked first)."""
    _prompt(inputs)
    params, flags = _sampling_dict(inputs)
    for name, kind in SCALAR_OVERRIDES.items():
        if inputs.get(name) is not None:
            params[name] = kind(_scalar(inputs[name], name))
    for name, key in (("stop_words", "stop"), ("bad_words", "bad_words")):
        if inputs.get(name) is not None:
            params[key] = _word_list(inputs[name], name, key, params.get(key))
    inner = {name: np.array([v]) for name, v in flags.items()}
    inner.update({k: v for k, v in inputs.items() if k in INPUT_NAMES and v is not None})
    inner["sampling_parameters"] = np.array([json.dumps(params).encode()], dtype=np.object_)
    if parse_request(inner).stream and inner.get("exclude_input_in_output") is None:
        # One response with the text a stream of it would carry, joined: no prompt.
        inner["exclude_input_in_output"] = np.array([True])
    inner["stream"] = np.array([False])
    return inner


# Each output `llm` sends only where its flag is set (text_output always).
_OUTPUT_FLAGS = {name: f"return_{name}" for name in OUTPUT_NAMES if name != "text_output"}


def bls_inner_outputs(inner: dict[str, np.ndarray], requested: list[str]) -> list[str]:
    """The outputs llm_bls asks `llm` for: those its client asked for (Triton lists every one
    of llm_bls's outputs where the client named none) that `llm` sends for this request. So an
    output that `llm`'s config does not declare (a repository trimmed on one side) fails only
    the requests that ask for it by their flags, not every request."""
    def asked(flag: str) -> bool:       # bls_inner_inputs checked them: no second parse
        return inner.get(flag) is not None and _flag(inner[flag], flag)
    names = [n for n in requested if n == "text_output"
             or (n in _OUTPUT_FLAGS and asked(_OUTPUT_FLAGS[n]))]
    return names or ["text_output"]


def _word_list(arr: np.ndarray, name: str, key: str, given: Any) -> list[str]:
    """TensorRT-LLM's stop_words / bad_words input, checked by its own name, added to the
    JSON's `stop` / `bad_words`. Empty words are skipped, as TensorRT-LLM's preprocessing skips
    them (its README's request sends `"stop_words": ""` and `"bad_words": ""`)."""
    words = np.asarray(arr).reshape(-1)
    if words.size > MAX_STOP_STRINGS:
        raise ValueError(f"{name} holds {words.size} strings; at most {MAX_STOP_STRINGS} "
                         f"are allowed")
    out = list(given) if isinstance(given, list) else [] if given is None else [given]
    for w in words:
        word = _text(np.array([w], dtype=np.object_), name)
        if len(word) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"{name} must be strings of at most {MAX_STOP_STRING_CHARS} "
                             f"characters, got one of {len(word)}")
        if word and word not in out:
            out.append(word)
    if len(out) > MAX_STOP_STRINGS:
        raise ValueError(f"{key} and {name} hold {len(out)} strings together; at most "
                         f"{MAX_STOP_STRINGS} are allowed")
    return out


class Completion(NamedTuple):
    """What one response carries of one of the request's completions."""
    text: str
    token_ids: list[int]
    logprobs: list | None               # per token; None when none were asked for
    finish_reason: str | None           # None until it has finished
    cumulative_logprob: float | None


def make_response(req: GenerateRequest, out: RequestOutput, text: str,
                  token_ids: list[int], logprobs: list | None) -> dict[str, np.ndarray]:
    """Output tensors for one response of a one-completion request. `text` / `token_ids` /
    `logprobs` are what this response carries: the new part when streaming, everything when
    not."""
    comp = out.outputs[0]
    return make_response_n(req, out, [Completion(
        text, token_ids, logprobs, comp.finish_reason if out.finished else None,
        comp.cumulative_logprob)])


def make_response_n(req: GenerateRequest, out: RequestOutput, completions: list[Completion],
                    num_cached_tokens: int | None = None) -> dict[str, np.ndarray]:
    """Output tensors for one response, one entry per completion (n of them, in index order),
    the layout of Triton's vLLM backend: `text_output`, `finish_reason`, `num_output_tokens`,
    `cumulative_logprob` and `logprobs` have an entry per completion. As there,
    `num_output_tokens` counts this response's tokens (a stream's add up to the request's) and
    `finish_reason` is in every response ("None" until that completion has finished).
    `output_ids` holds the completions' tokens one after another, each `num_output_tokens` long.
    `out` gives the prompt (the completions share it), and `num_cached_tokens` unless given
    (with n completions, the first's, as LLM.generate reports it)."""
    prefix = ""
    if not req.stream and not req.exclude_input_in_output and isinstance(out.prompt, str):
        prefix = out.prompt
    tensors: dict[str, np.ndarray] = {"text_output": np.array(
        [(prefix + c.text).encode("utf-8") for c in completions], dtype=np.object_)}
    if req.return_output_ids:
        tensors["output_ids"] = np.array(
            [t for c in completions for t in c.token_ids] if len(completions) > 1
            else completions[0].token_ids, dtype=np.int32)
    if req.return_finish_reason:
        tensors["finish_reason"] = np.array([str(c.finish_reason).encode() for c in completions],
                                            dtype=np.object_)
    if req.return_num_input_tokens:
        tensors["num_input_tokens"] = np.array([len(out.prompt_token_ids)], dtype=np.uint32)
    if req.return_num_output_tokens:
        tensors["num_output_tokens"] = np.array([len(c.token_ids) for c in completions],
                                                dtype=np.uint32)
    if req.return_num_cached_tokens:
        # The prompt tokens the prefix cache held (not computed for this request).
        tensors["num_cached_tokens"] = np.array(
            [out.num_cached_tokens if num_cached_tokens is None else num_cached_tokens],
            dtype=np.uint32)
    if req.return_cumulative_logprob:
        # The completion's sampled tokens' logprobs summed up to this response's last (always
        # computed when asked for: parse_request).
        tensors["cumulative_logprob"] = np.array(
            [np.nan if c.cumulative_logprob is None else c.cumulative_logprob
             for c in completions], dtype=np.float32)
    if req.return_logprobs:
        # Triton's vLLM backend's layout: per token of this response, {token id: {"logprob",
        # "rank", "decoded_token"}} for the sampled token and the top-n; "null" when the
        # sampling parameters asked for no logprobs.
        hidden = req.logprobs_for_the_sum_only
        tensors["logprobs"] = np.array([json.dumps(None if c.logprobs is None or hidden else [
            {str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in step.items()} for step in c.logprobs]).encode()
            for c in completions], dtype=np.object_)
    return tensors
