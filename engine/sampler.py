"""Batched next-token sampler: allowed_token_ids, bad_words, logit_bias, penalties, min_tokens,
greedy / temperature / min-p / top-k / top-p, per-request seeds, raw logprobs.

Plain device-agnostic torch; on CUDA the argmax is kernels/argmax.py's, the random rows' noise
kernels/exp_noise.py's (one launch, seeded rows or not) and their top-k / top-p and draw
kernels/race_sample.py's (no sort). Per step the host only builds index tensors from Python lists
and copies them to the device; nothing reads a device value back, so on CUDA a step never waits
on the GPU.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.host_copy import list_to_device
from engine.sampling_params import SamplingParams
from kernels.argmax import argmax_rows
from kernels.exp_noise import exponential_noise, exponential_noise_ref
from kernels.race_sample import race_sample, race_sample_ref

# Temperatures below this are greedy: dividing fp32 logits by them can overflow, and the
# distribution is a point mass to within rounding anyway (vLLM uses the same cut-off).
_MIN_TEMPERATURE = 1e-5
_MASK64 = (1 << 64) - 1


@dataclass
class RowControls:
    """One request's logit_bias and allowed_token_ids on the device: built once a request (the
    model runner keeps them), so that a step copies no id lists from the host."""

    bias_ids: Tensor                # [nb] int64 (nb may be 0)
    bias_values: Tensor             # [nb] float32
    allowed_ids: Tensor | None      # [na] int64; None: every token is allowed

    @classmethod
    def of(cls, params: SamplingParams, device: torch.device | str) -> "RowControls | None":
        """None for a request with neither (the usual case: it costs nothing)."""
        if not params.logit_bias and params.allowed_token_ids is None:
            return None
        bias = params.logit_bias or {}
        return cls(list_to_device(list(bias), torch.int64, device),
                   list_to_device(list(bias.values()), torch.float32, device),
                   None if params.allowed_token_ids is None
                   else list_to_device(params.allowed_token_ids, torch.int64, device))


def _batch_controls(controls: list[RowControls | None], device: torch.device | str
                    ) -> tuple[tuple[Tensor, Tensor, Tensor] | None, tuple[Tensor, Tensor, Tensor] | None]:
    """The rows' controls as (rows, ids, biases) for logit_bias and (rows, local rows, ids) for
    allowed_token_ids, where `local` numbers the rows that have a list (the sampler's mask)."""
    bias = [(i, c) for i, c in enumerate(controls) if c is not None and c.bias_ids.numel()]
    allowed = [(i, c.allowed_ids) for i, c in enumerate(controls)
               if c is not None and c.allowed_ids is not None]
    logit_bias = allowed_ids = None
    if bias:
        rows = list_to_device([i for i, _ in bias], torch.int64, device)
        logit_bias = (_repeated(rows, [c.bias_ids.numel() for _, c in bias], device),
                      torch.cat([c.bias_ids for _, c in bias]),
                      torch.cat([c.bias_values for _, c in bias]))
    if allowed:
        local = torch.arange(len(allowed), device=device)
        allowed_ids = (list_to_device([i for i, _ in allowed], torch.int64, device),
                       _repeated(local, [ids.numel() for _, ids in allowed], device),
                       torch.cat([ids for _, ids in allowed]))
    return logit_bias, allowed_ids


def _repeated(values: Tensor, counts: list[int], device: torch.device | str) -> Tensor:
    """values[i] counts[i] times, on the device (the total given: no wait for the GPU)."""
    return values.repeat_interleave(list_to_device(counts, torch.int64, device),
                                    output_size=sum(counts))


def bad_word_bans(words: list[list[int]], tail: list[int], pending: bool) -> list[tuple[int, int]]:
    """What a row's bad words ban next, as (token, needs) pairs: `token` is banned if `needs` is
    -1, or if the token being sampled by the step in flight (`pending`: one the host does not
    know yet) turns out to be `needs`. tail: the row's output as the host knows it (its last
    max(len(word)) - 1 tokens are enough; the prompt is not matched, as in vLLM)."""
    bans = []
    for word in words:
        prefix = word[:-1]
        if pending and prefix:          # the prefix's last token is the one in flight
            prefix, needs = prefix[:-1], prefix[-1]
        else:
            needs = -1
        if len(prefix) <= len(tail) and tail[len(tail) - len(prefix):] == prefix:
            bans.append((word[-1], needs))
    return bans


@dataclass
class SamplingMetadata:
    """The batch's sampling settings, one row per request sampled this step (B rows).

    Tensors live on the logits' device. A feature no row uses is None and costs nothing.
    """

    temperature: Tensor | None               # [B] float32, 0 = greedy; None: every row greedy
    top_k: Tensor | None                     # [B] int64, 0 = off
    top_p: Tensor | None                     # [B] float32, 1.0 = off
    min_p: Tensor | None                     # [B] float32, 0 = off
    repetition_penalty: Tensor | None        # [B] float32, 1 = off
    presence_penalty: Tensor | None          # [B] float32, 0 = off
    frequency_penalty: Tensor | None         # [B] float32, 0 = off
    prompt_token_ids: list[list[int]] | None  # only when repetition_penalty is not None
    # Generated so far; only when a penalty reads them (None otherwise: copying every row's
    # outputs each step grows with the whole batch's length).
    output_token_ids: list[list[int]] | None
    num_output_tokens: list[int]             # how many generated: the seed position
    seeds: list[int | None]                  # None: the sampler's shared generator
    no_stop_token_ids: list[list[int]]       # ids masked to -inf this step (min_tokens)
    max_num_logprobs: int | None             # max SamplingParams.logprobs over rows
    all_greedy: bool
    all_random: bool
    # What the penalties read, when the caller keeps it on the device (engine/penalty_rows.py):
    # each row's output token counts [B, V] and its prompt's ids [B, V] bool. Given, they stand
    # in for output_token_ids and prompt_token_ids (the same penalties, no lists per step).
    output_counts: Tensor | None = None
    prompt_seen: Tensor | None = None
    max_top_k: int = 0                       # the largest k of the random rows (0: top-k off)
    # vLLM's token controls (RowControls), batched: logit_bias as (rows, token ids, biases);
    # allowed_token_ids as (rows, each id's index among those rows, token ids).
    logit_bias: tuple[Tensor, Tensor, Tensor] | None = None
    allowed_token_ids: tuple[Tensor, Tensor, Tensor] | None = None
    # bad_words this step (bad_word_bans): (rows, token ids, whether each is banned), the last
    # decided on the device where it waits on the token in flight.
    bad_words: tuple[Tensor, Tensor, Tensor] | None = None

    @classmethod
    def from_params(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
                    output_token_ids: list[list[int]] | None, eos_token_ids: list[int],
                    device: torch.device | str,
                    num_output_tokens: list[int] | None = None, output_counts: Tensor | None = None,
                    prompt_seen: Tensor | None = None,
                    vocab_size: int | None = None,
                    controls: list[RowControls | None] | None = None,
                    bans: list[list[tuple[int, int]]] | None = None,
                    pending_tokens: Tensor | None = None) -> "SamplingMetadata":
        """Build the batch's metadata; row i is request i.

        Top-k / top-p / min-p and seeds only matter for random rows, so greedy rows leave them
        off (a batch whose random rows never use top-k gets `top_k=None`). Penalties apply to
        greedy rows too. While the output is shorter than min_tokens a row masks its
        stop_token_ids and the model's EOS ids (also under ignore_eos, as vLLM does). `num_output_tokens` may
        stand in for `output_token_ids` (None) when no row has a presence or frequency
        penalty or a repetition penalty: those read the outputs themselves, or
        `output_counts` and `prompt_seen` where the caller keeps them (engine/penalty_rows.py).
        A top-k of `vocab_size` or more keeps every token: off (as its k it made the sampler
        take the top V of every row, almost a sort, at every step).
        `controls`: each row's RowControls as the caller keeps them (None: built from `params`).
        `bans`: each row's bad_word_bans, where the caller has a token in flight; `pending_tokens`
        [B] (device) is then each row's token in flight. None: from `output_token_ids`.
        """
        if num_output_tokens is None:
            num_output_tokens = [len(out) for out in output_token_ids]
        assert len(prompt_token_ids) == len(num_output_tokens) == len(params)
        greedy = [p.temperature < _MIN_TEMPERATURE for p in params]
        rows = list(zip(params, greedy))

        def per_row(values: list, off: float, dtype: torch.dtype) -> Tensor | None:
            return None if all(v == off for v in values) else list_to_device(values, dtype, device)

        repetition_penalty = per_row([p.repetition_penalty for p in params], 1.0, torch.float32)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        top_k = [0 if g or (vocab_size is not None and p.top_k >= vocab_size) else p.top_k
                 for p, g in rows]
        if controls is None:
            controls = [RowControls.of(p, device) for p in params]
        logit_bias, allowed_token_ids = _batch_controls(controls, device)
        if bans is None and any(p.bad_words_token_ids for p in params):
            assert output_token_ids is not None, "bad_words need output_token_ids or bans"
            bans = [bad_word_bans(p.bad_words_token_ids or [], out, False)
                    for p, out in zip(params, output_token_ids)]
        bad_words = _batch_bans(bans, pending_tokens, device) if bans else None
        return cls(
            temperature=None if all(greedy) else list_to_device(
                [0.0 if g else p.temperature for p, g in rows], torch.float32, device),
            top_k=per_row(top_k, 0, torch.int64),
            top_p=per_row([1.0 if g else p.top_p for p, g in rows], 1.0, torch.float32),
            min_p=per_row([0.0 if g else p.min_p for p, g in rows], 0.0, torch.float32),
            repetition_penalty=repetition_penalty,
            presence_penalty=per_row([p.presence_penalty for p in params], 0.0, torch.float32),
            frequency_penalty=per_row([p.frequency_penalty for p in params], 0.0, torch.float32),
            prompt_token_ids=prompt_token_ids if repetition_penalty is not None and prompt_seen is None else None,
            output_token_ids=output_token_ids,
            num_output_tokens=num_output_tokens,
            seeds=[None if g else p.seed for p, g in rows],
            no_stop_token_ids=[_no_stop_token_ids(p, n, eos_token_ids)
                               for p, n in zip(params, num_output_tokens)],
            max_num_logprobs=max(logprobs) if logprobs else None,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            output_counts=output_counts,
            prompt_seen=prompt_seen if repetition_penalty is not None else None,
            max_top_k=max(top_k, default=0),
            logit_bias=logit_bias,
            allowed_token_ids=allowed_token_ids,
            bad_words=bad_words,
        )


def _batch_bans(bans: list[list[tuple[int, int]]], pending_tokens: Tensor | None,
                device: torch.device | str) -> tuple[Tensor, Tensor, Tensor] | None:
    flat = [(row, token, needs) for row, pairs in enumerate(bans) for token, needs in pairs]
    if not flat:
        return None
    rows, tokens, needs = (list_to_device(list(v), torch.int64, device) for v in zip(*flat))
    banned = needs < 0
    if pending_tokens is not None and any(n >= 0 for _, _, n in flat):
        banned = banned | (pending_tokens.index_select(0, rows) == needs)
    return rows, tokens, banned


@dataclass
class SamplerOutput:
    sampled_token_ids: Tensor            # [B] int64
    # The rest only when some row asked for logprobs; N = max_num_logprobs. Column 0 is the
    # sampled token, then the top-N by descending raw logprob (callers trim rows wanting fewer).
    logprob_token_ids: Tensor | None     # [B, 1 + N] int64
    logprobs: Tensor | None              # [B, 1 + N] float32
    sampled_token_ranks: Tensor | None   # [B] int64, 1 = the most likely raw token


class Sampler:
    """Picks one token per row of `logits` [B, V].

    Order: raw logprobs (before anything else) -> allowed_token_ids -> bad_words -> logit_bias
    (vLLM V1's order) -> penalties -> min_tokens mask -> greedy argmax
    | temperature -> min-p -> top-k -> top-p (on the renormalized survivors) -> exponential race
    `argmax(p / q)`, q ~ Exp(1) per vocabulary entry. A seeded row's q is keyed by (seed,
    len(output)), so its tokens do not depend on the rest of the batch; unseeded rows' by a key
    drawn each call from a generator seeded by `seed` (None: nondeterministic) and their row.
    """

    def __init__(self, seed: int | None = None, kernels: bool | None = None) -> None:
        self.seed = seed
        self._rng = random.Random(seed)
        # The draw's Triton kernels (noise and race) or their references; None: the kernels on
        # CUDA tensors. True on CPU runs the kernels under TRITON_INTERPRET (the tests).
        self.kernels = kernels

    def __call__(self, logits: Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # Logits may come in the model's dtype (a decode graph's buffer). Greedy rows with no
        # penalty and no logprobs need only the argmax (and the min_tokens masks, -inf in any
        # dtype), which float32 copies of the same values would not change: they are taken as
        # they are. So are random rows the race kernel takes as they are (no min-p: it divides
        # by the temperature itself). Everything else computes in float32 (no copy for fp32;
        # nothing below writes into it).
        kernels = logits.is_cuda if self.kernels is None else self.kernels
        as_they_are = meta.all_greedy or _race_takes_raw(meta, kernels)
        if not (as_they_are and meta.max_num_logprobs is None and meta.repetition_penalty is None
                and meta.presence_penalty is None and meta.frequency_penalty is None
                and meta.logit_bias is None and meta.allowed_token_ids is None
                and meta.bad_words is None):
            logits = logits.float()
        raw_logprobs = logits.log_softmax(-1) if meta.max_num_logprobs is not None else None
        logits = apply_token_controls(logits, meta)
        logits = apply_penalties(logits, meta)
        logits = _mask_tokens(logits, meta.no_stop_token_ids)

        if meta.all_greedy:
            sampled = _argmax(logits)
        else:
            sampled = self._sample_random(logits, meta, kernels)
            if not meta.all_random:
                greedy = meta.temperature < _MIN_TEMPERATURE
                sampled = torch.where(greedy, _argmax(logits), sampled)

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        num_top = min(meta.max_num_logprobs, raw_logprobs.shape[1])
        sampled_logprobs = raw_logprobs.gather(1, sampled.unsqueeze(1))     # [B, 1]
        top_logprobs, top_ids = raw_logprobs.topk(num_top, dim=-1)          # [B, N], descending
        # vLLM's (V1) rank: the entries whose raw logprob is >= the sampled token's, its ties
        # counted ahead of it.
        ranks = (raw_logprobs >= sampled_logprobs).sum(-1)
        return SamplerOutput(
            sampled_token_ids=sampled,
            logprob_token_ids=torch.cat([sampled.unsqueeze(1), top_ids], dim=1),
            logprobs=torch.cat([sampled_logprobs, top_logprobs], dim=1),
            sampled_token_ranks=ranks,
        )

    def _sample_random(self, logits: Tensor, meta: SamplingMetadata, kernels: bool) -> Tensor:
        # Greedy rows (their result is discarded) divide by 1 so nothing overflows.
        temperature = torch.where(meta.temperature < _MIN_TEMPERATURE, 1.0, meta.temperature)
        noise = self._exponential_noise(logits, meta, kernels)
        if not _race_takes_raw(meta, kernels):   # min-p and the reference need the divided logits
            logits, temperature = logits.float() / temperature.unsqueeze(1), None
            if meta.min_p is not None:
                logits = _apply_min_p(logits, meta.min_p)
        # The kernel does not sort the logits (the sort took 3.9 ms at 256 rows, the kernel
        # 0.25); its reference does.
        if kernels:
            return race_sample(logits, noise, meta.top_k, meta.top_p, meta.max_top_k, temperature=temperature)
        return race_sample_ref(logits, noise, meta.top_k, meta.top_p)

    def _exponential_noise(self, logits: Tensor, meta: SamplingMetadata, kernels: bool) -> Tensor:
        """q ~ Exp(1), shaped like `logits` [B, V], in one launch (kernels/exp_noise.py, or
        its reference): a seeded row's keyed by (seed, position), the others' by one key a
        call from the sampler's generator and their row."""
        step_key = self._rng.getrandbits(64)
        keys = [step_key if seed is None else _row_seed(seed, n)
                for seed, n in zip(meta.seeds, meta.num_output_tokens)]
        streams = [row + 1 if seed is None else 0 for row, seed in enumerate(meta.seeds)]
        keys = list_to_device([k - (1 << 64) if k >> 63 else k for k in keys], torch.int64, logits.device)
        streams = list_to_device(streams, torch.int32, logits.device)
        draw = exponential_noise if kernels else exponential_noise_ref
        return draw(keys, streams, logits.shape[1])


def _argmax(x: Tensor) -> Tensor:
    """x.argmax(-1) for [B, V]: on CUDA by kernels/argmax.py (torch's takes 37 us for one row of a
    128k vocabulary on an H200, ~1% of a single stream's step), the same indices."""
    return argmax_rows(x) if x.is_cuda else x.argmax(-1)


def _race_takes_raw(meta: SamplingMetadata, kernels: bool) -> bool:
    """Whether the race kernel takes the logits as they come (any float dtype, undivided: it
    divides by the temperature as it reads), sparing the [B, V] fp32 copies; min-p needs them."""
    return kernels and meta.min_p is None


def apply_token_controls(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """allowed_token_ids, bad_words, then logit_bias: a row with a list keeps only its tokens
    (every other logit -inf), a banned token's logit is -inf, a bias is added to its token's
    logit. `logits` itself is never written."""
    if meta.allowed_token_ids is not None:
        rows, local, ids = meta.allowed_token_ids
        keep = torch.zeros(rows.shape[0], logits.shape[1], dtype=torch.bool, device=logits.device)
        keep[local, ids] = True
        kept = logits.index_select(0, rows).masked_fill(~keep, float("-inf"))
        logits = logits.index_copy(0, rows, kept)
    if meta.bad_words is not None:      # -inf where banned, + 0 elsewhere (the same bits)
        rows, tokens, banned = meta.bad_words
        ban = torch.zeros(banned.shape, dtype=logits.dtype, device=logits.device)
        logits = logits.index_put((rows, tokens), ban.masked_fill(banned, float("-inf")),
                                  accumulate=True)
    if meta.logit_bias is not None:
        rows, ids, biases = meta.logit_bias
        logits = logits.index_put((rows, ids), biases.to(logits.dtype), accumulate=True)
    return logits


def apply_penalties(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """Penalized logits [B, V]; `logits` itself is never written.

    With c_t the count of token t in the row's output:
      repetition r, for t in prompt or output:  l_t <- l_t / r if l_t > 0 else l_t * r
      then frequency f and presence p:         l_t <- l_t - f * c_t - p * [c_t > 0]
    Rows with a penalty off (r = 1, f = p = 0) come out unchanged.
    """
    repetition, frequency = meta.repetition_penalty, meta.frequency_penalty
    presence = meta.presence_penalty
    if repetition is None and frequency is None and presence is None:
        return logits
    num_rows, vocab_size = logits.shape
    if meta.output_counts is not None:
        counts = meta.output_counts.to(logits.dtype)
    else:
        assert meta.output_token_ids is not None, "penalties need output_token_ids or output_counts"
        # Rows are padded with the id `vocab_size`, which lands in an extra column that is dropped.
        output_ids = _padded(meta.output_token_ids, vocab_size, logits.device)
        counts = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=logits.device)
        counts.scatter_add_(1, output_ids, torch.ones(output_ids.shape, dtype=logits.dtype,
                                                      device=logits.device))
        counts = counts[:, :vocab_size]                                      # [B, V]
    if repetition is not None:
        if meta.prompt_seen is not None:
            seen = meta.prompt_seen
        else:
            assert meta.prompt_token_ids is not None, "repetition_penalty needs prompt_token_ids or prompt_seen"
            prompt_ids = _padded(meta.prompt_token_ids, vocab_size, logits.device)
            seen = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
            seen.scatter_(1, prompt_ids, True)
            seen = seen[:, :vocab_size]
        seen = seen | (counts > 0)
        r = repetition.unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    if frequency is not None:
        logits = logits - frequency.unsqueeze(1) * counts
    if presence is not None:
        logits = logits - presence.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def _mask_tokens(logits: Tensor, token_ids: list[list[int]]) -> Tensor:
    """Set logits[row, t] = -inf for t in token_ids[row] (min_tokens not reached yet)."""
    vocab_size = logits.shape[1]
    # A user's stop id past the model's vocabulary can never be sampled; indexing it would fault.
    pairs = [(row, t) for row, ids in enumerate(token_ids) for t in ids if t < vocab_size]
    if not pairs:
        return logits
    rows, cols = zip(*pairs)
    index = tuple(list_to_device(ids, torch.int64, logits.device) for ids in (rows, cols))
    return logits.index_put(index, logits.new_full((), float("-inf")))


def _apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    # p_t < min_p * p_max  <=>  l_t < l_max + log(min_p); log(0) = -inf drops nothing.
    threshold = logits.amax(-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def _no_stop_token_ids(params: SamplingParams, num_output_tokens: int,
                       eos_token_ids: list[int]) -> list[int]:
    if num_output_tokens >= params.min_tokens:
        return []
    ids = list(eos_token_ids) + params.stop_token_ids     # EOS too under ignore_eos, as vLLM
    return list(dict.fromkeys(ids))


def _row_seed(seed: int, position: int) -> int:
    """64-bit noise key for (request seed, output position): splitmix64's output number
    `position + 1` from state `seed`, so neighbouring seeds and positions give unrelated streams."""
    z = ((seed & _MASK64) + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> Tensor:
    width = max((len(r) for r in rows), default=0)
    data = [list(r) + [pad] * (width - len(r)) for r in rows]
    return list_to_device(data, torch.int64, device).view(len(rows), width)
