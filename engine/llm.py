"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import array
import contextlib
import gc
import itertools
import json
import os
import time
from collections.abc import Iterator, Sequence

import numpy as np
from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.engine_core import EngineCore, EngineStats
from engine.output_processor import OutputProcessor, RequestFailed
from engine.outputs import RequestOutput
from engine.prefix_groups import group_prompts
from engine.sampling_params import SamplingParams
from engine.tokenize import not_text_error

# A text, token ids, or vLLM's TextPrompt / TokensPrompt dicts: {"prompt": text} and
# {"prompt_token_ids": ids}.
Prompt = str | list[int] | dict

_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def load_tokenizer(config: EngineConfig):
    if config.skip_tokenizer_init:
        return None
    try:
        return AutoTokenizer.from_pretrained(config.tokenizer or config.model)
    except Exception as e:  # transformers raises several types for a bad folder
        raise ValueError(f"cannot load a tokenizer from {config.tokenizer or config.model!r}: "
                         f"{e}") from e


def unwrap_prompt(prompt: Prompt) -> str | list[int]:
    """vLLM's prompt dicts as the text or the token ids they hold: {"prompt": text} (TextPrompt)
    or {"prompt_token_ids": ids} (TokensPrompt); keys whose value is None are left out (e.g.
    multi_modal_data=None), any other key is an error naming it."""
    if not isinstance(prompt, dict):
        return prompt
    given = {k: v for k, v in prompt.items() if v is not None}
    other = sorted(str(k) for k in given if k not in _PROMPT_KEYS)
    if other:
        raise ValueError(f"a prompt dict may hold {list(_PROMPT_KEYS)} (vLLM's TextPrompt / "
                         f"TokensPrompt); {other} are not supported")
    if "prompt_token_ids" in given:         # a TokensPrompt's optional text is not re-encoded
        ids = given["prompt_token_ids"]
        if isinstance(ids, (str, bytes)):
            raise ValueError("a prompt dict's prompt_token_ids must be token ids (a list of "
                             "ints), got a string: give text as {'prompt': text}")
        return ids
    if "prompt" in given:
        if not isinstance(given["prompt"], str):
            raise ValueError(f"a prompt dict's prompt must be text, got "
                             f"{type(given['prompt']).__name__}: give token ids as "
                             f"{{'prompt_token_ids': ids}}")
        return given["prompt"]
    raise ValueError(f"a prompt dict must hold one of {list(_PROMPT_KEYS)}")


def _type_names(value) -> str:
    """`value`'s type, or for a list or tuple its elements' types: for error messages."""
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {sorted({type(v).__name__ for v in value})}"
    return type(value).__name__


def encode_prompt(tokenizer, prompt: Prompt) -> tuple[str | None, list[int]]:
    """Text is tokenized with the tokenizer's special tokens (e.g. BOS); a list or tuple of
    ints (Python or NumPy integers, not bools) is taken as token ids; a prompt dict as what it
    holds (unwrap_prompt)."""
    prompt = unwrap_prompt(prompt)
    if isinstance(prompt, np.ndarray) and prompt.ndim == 1:
        prompt = prompt.tolist()
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer, and skip_tokenizer_init is set: "
                             "give token ids")
        try:
            return prompt, tokenizer.encode(prompt)
        except TypeError:               # the tokenizers library's word for a str not text
            error = not_text_error(prompt)
            if error is None:
                raise
            raise error from None
    if isinstance(prompt, (list, tuple)):
        # The element types checked once each, not per token (an offline job's millions of
        # ids took seconds, with the GPU idle, in a per-token isinstance loop).
        types = set(map(type, prompt))
        if types <= {int}:
            return None, list(prompt)
        if all(t is int or issubclass(t, np.integer) for t in types):
            return None, [int(t) for t in prompt]
    raise ValueError(f"a prompt must be a string or a list of token ids, got "
                     f"{type(prompt).__name__}")


# generation_config.json's fields that vLLM (generation_config="auto", its default since 0.8)
# takes as the defaults of a generate() given no SamplingParams, and our names for them.
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                        "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                        "max_new_tokens": "max_tokens"}


def default_sampling_params(model_dir: str) -> SamplingParams:
    """SamplingParams() with the checkpoint's generation_config.json sampling fields over its
    defaults, as vLLM's LLM.get_default_sampling_params()."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return SamplingParams()
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    given = {ours: raw[theirs] for theirs, ours in _GENERATION_DEFAULTS.items()
             if raw.get(theirs) is not None}
    try:
        return SamplingParams(**given)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _joined(outs: list[RequestOutput]) -> RequestOutput:
    """A prompt's n completions as one RequestOutput (vLLM's): outputs[k] is the k-th's, under
    the prompt's request id; the prefix cache and timing figures are the first's."""
    if len(outs) == 1:
        return outs[0]
    first = outs[0]
    completions = []
    for k, out in enumerate(outs):
        completion = out.outputs[0]
        completion.index = k
        completions.append(completion)
    return RequestOutput(first.request_id.rsplit("_", 1)[0], first.prompt, first.prompt_token_ids,
                         completions, True, first.num_cached_tokens, first.metrics)


def token_array(ids: list[int]) -> np.ndarray | None:
    """The ids as an int64 array, made in one pass over them (`array`; NumPy's conversion of a
    list of ints took about three times as long), for the request check and the grouping to
    share; None if one does not fit int64 (the check on the list then names it)."""
    try:
        return np.frombuffer(array.array("q", ids), dtype=np.int64)
    except OverflowError:
        return None


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside (back on after, if it was on). Taking in an
    offline job's prompts makes containers by the thousand, and each collection the allocations
    set off walks every tracked list made so far, the prompts' token lists included: for issue
    12's job (6,400 prompts x 2,200 ids) a quarter of the intake's time on a 2-core CPU
    (benchmarks/prompt_intake.md). Reference counting still frees everything dropped."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def gc_young_only() -> Iterator[None]:
    """An offline job's steps with the cyclic collector on young objects only. On entry every
    tracked object (the prompts and requests just taken in, the caller's own) is frozen, and
    the full pass (threshold 2) is put off; on exit both are undone. A full pass walks every
    tracked list's items: issue 12's job holds its 6,400 x 2,200 prompt ids three times over,
    and each pass took 0.4-0.6 s on the GPU machine, ~15 times a run at 512 rows, the GPU
    waiting (benchmarks/h200/gc_pauses.md). Objects the steps make are collected as before;
    cyclic garbage that reached the oldest generation waits for the first full pass after.
    Unfreezing also hands the engine's start-up objects (EngineCore) back to the collector:
    outside a step loop their passes cost no GPU time, and the next call freezes them again."""
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(thresholds[0], thresholds[1], 2 ** 31 - 1)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def eos_token_ids(tokenizer) -> list[int]:
    """The tokenizer's EOS, used when the model's config names none."""
    if tokenizer is None or tokenizer.eos_token_id is None:
        return []
    return [tokenizer.eos_token_id]


class LLM:
    def __init__(self, model: str, **settings) -> None:
        self.config = EngineConfig(model=model, **settings)
        self.tokenizer = load_tokenizer(self.config)
        self.core = EngineCore(self.config, eos_token_ids(self.tokenizer))
        self._ids = itertools.count()
        # The last generate's host time before its first step, by phase (seconds): the prompts'
        # checks and requests, finding the groups, handing them to the scheduler. Benchmarks
        # read it (scripts/bench_shared_prefix.py, scripts/bench_prompt_intake.py).
        self.intake_s: dict[str, float] = {}

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() samples with when given no SamplingParams (vLLM's)."""
        return default_sampling_params(self.config.model)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """vLLM's call: one prompt or a list (text, token ids, or vLLM's prompt dicts), one
        SamplingParams for all or one per prompt (none: the checkpoint's generation_config.json
        defaults). use_tqdm is accepted and ignored (no progress bar); LoRA is not supported."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported")
        if isinstance(prompts, np.ndarray):     # a 1-D array is one prompt's ids, 2-D a batch
            prompts = prompts.tolist()
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, (list, tuple)) and prompts
                and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be text, token ids, a prompt dict or a list of them, "
                            f"got {type(prompts).__name__}")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)) or not all(
                isinstance(p, SamplingParams) for p in sampling_params):
            # e.g. a dict of settings: SamplingParams(**settings) is what is meant
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them (one "
                            f"per prompt), got {_type_names(sampling_params)}")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for "
                             f"{len(prompts)} prompts")
        # Validate everything before starting anything. The GPU idles meanwhile, so no
        # collector passes over the growing prompt lists (see gc_paused).
        processor = OutputProcessor(self.tokenizer, stream_deltas=False)
        requests, prompt_ids = [], []
        parents: list[list[str]] = []       # per prompt, its completions' request ids
        finished: dict[str, RequestOutput] = {}
        try:
            with contextlib.ExitStack() as collector:
                with gc_paused():
                    t_start = time.perf_counter()
                    checked: dict[int, SamplingParams] = {}
                    for prompt, params in zip(prompts, sampling_params):
                        # Checked again (n among them, which the completions' own do not
                        # show), once per object: a field may have changed since it was built.
                        if id(params) not in checked:
                            own = checked[id(params)] = params.clone()
                            own.tokenize_bad_words(self.tokenizer)
                        params = checked[id(params)]
                        text, ids = encode_prompt(self.tokenizer, prompt)
                        arr = token_array(ids)
                        parent = str(next(self._ids))
                        # n completions are n requests of the prompt: they share its KV blocks
                        # (prefix groups or the prefix cache) and run as any others.
                        children = ([(parent, params)] if params.n == 1 else
                                    [(f"{parent}_{k}", params.child(k)) for k in range(params.n)])
                        parents.append([])
                        for request_id, child_params in children:
                            req = self.core.make_request(request_id, ids, child_params, arr)
                            processor.add_request(request_id, request_id, text, ids, child_params)
                            requests.append(req)
                            prompt_ids.append(ids if arr is None else arr)
                            parents[-1].append(request_id)
                    t_prompts = t_grouped = time.perf_counter()
                    if self.config.enable_prefix_groups and len(requests) > 1:
                        # Prompts sharing a prefix run as groups: the prefix computed once, kept
                        # resident.
                        groups = group_prompts(prompt_ids, self.config.block_size)
                        t_grouped = time.perf_counter()
                        for group in groups:
                            self.core.add_group([requests[i] for i in group.members],
                                                group.prefix_len)
                    else:
                        for req in requests:
                            self.core.add_request(req)
                    t_end = time.perf_counter()
                    self.intake_s = {"prompts": t_prompts - t_start,
                                     "grouping": t_grouped - t_prompts,
                                     "scheduling": t_end - t_grouped}
                    # Frozen while the collector is still off: its first pass after would walk
                    # everything the intake made (0.2 s for issue 12's job on a 2-core CPU).
                    collector.enter_context(gc_young_only())
                while processor.has_unfinished():
                    outs, to_abort = processor.process(self.core.step())
                    if to_abort:
                        self.core.abort_requests(to_abort)
                    for out in outs:
                        if isinstance(out, RequestFailed):
                            raise out           # (the except below aborts the others)
                        finished[out.request_id] = out
        except BaseException:
            # Ctrl-C or an error midway: its requests must not stay in the engine, holding
            # KV blocks and running inside the next call for outputs nobody reads.
            self.core.abort_requests([r for children in parents for r in children
                                      if r not in finished])
            # Interrupted inside a step: that step's plan cannot be trusted (see there).
            self.core.reset_after_lost_step()
            raise
        return [_joined([finished[c] for c in children]) for children in parents]

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request=None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's call: one conversation (a list of {"role": ..., "content": ...} messages) or
        a list of them, each rendered with the tokenizer's chat template (or `chat_template`,
        a Jinja string; `chat_template_kwargs` go to it) and generated as `generate` does. The
        rendered text is tokenized without the tokenizer's own special tokens (the template
        writes them: no second BOS) and is each output's `prompt`."""
        if self.tokenizer is None:
            raise ValueError("chat needs the model's tokenizer, and skip_tokenizer_init is set")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "true: the last message is continued, no new turn is begun")
        conversations = ([messages] if isinstance(messages, (list, tuple)) and messages
                         and isinstance(messages[0], dict) else messages)
        if not isinstance(conversations, (list, tuple)) or not conversations or not all(
                isinstance(c, (list, tuple)) and c and all(isinstance(m, dict) for m in c)
                for c in conversations):
            raise TypeError("messages must be a conversation (a non-empty list of "
                            "{'role': ..., 'content': ...} dicts) or a list of them")
        texts = []
        for conversation in conversations:
            try:
                texts.append(self.tokenizer.apply_chat_template(
                    list(conversation), chat_template=chat_template, tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    **(chat_template_kwargs or {})))
            except ValueError as e:
                if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
                    raise ValueError("the model's tokenizer has no chat template: give "
                                     "chat_template (a Jinja template string)") from e
                raise
        prompts = [{"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}
                   for text in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm, lora_request)
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs

    def reset_prefix_cache(self) -> bool:
        """vLLM's: the prefix cache forgets every block, so the next prompts are computed
        whole (between generate calls no request holds blocks: True)."""
        return self.core.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        return self.core.get_stats()
