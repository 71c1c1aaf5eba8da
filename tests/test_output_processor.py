"""engine/output_processor.py: per-step outputs, and pull requests rendered once per response."""
import random

import pytest

import engine.output_processor as output_processor_module
from engine.output_processor import OutputProcessor, PullOutput
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import EngineCoreOutput
from scripts.make_tiny_model import train_tokenizer

TEXT = "Zürich naïve café — 日本語のテキスト 🙂🚀 𝄞 plain words at the end."


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


def _steps(tok, finish="length"):
    """One EngineCoreOutput per token of TEXT (multi-byte characters split over tokens), the
    last one finished."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    return [EngineCoreOutput(7, [t], finish if i == len(ids) - 1 else None)
            for i, t in enumerate(ids)], ids


def _per_step(tok, params):
    proc = OutputProcessor(tok, stream_deltas=True)
    proc.add_request(7, "r", "Prompt", tok.encode("Prompt"), params)
    steps, _ = _steps(tok)
    outs = []
    for co in steps:
        got, _ = proc.process([co])
        outs += got
    return outs


def _joined(outs):
    comps = [o.outputs[0] for o in outs]
    return "".join(c.text for c in comps), [t for c in comps for t in c.token_ids]


@pytest.mark.parametrize("render_every", [1, 3, 1000])
def test_pull_renders_what_the_per_step_outputs_carry(tok, render_every):
    params = SamplingParams(max_tokens=1000)
    expected = _per_step(tok, params)
    proc = OutputProcessor(tok, stream_deltas=True)
    proc.add_request(7, "r", "Prompt", tok.encode("Prompt"), params, pull=True)
    steps, ids = _steps(tok)
    rendered, handles = [], set()
    for i, co in enumerate(steps):
        got, to_abort = proc.process([co])
        assert to_abort == [] and len(got) == 1 and isinstance(got[0], PullOutput)
        handles.add(id(got[0]))
        if (i + 1) % render_every == 0 or got[0].finished:
            out = proc.render(got[0])
            if out is not None:
                rendered.append(out)
    assert len(handles) == 1                        # the same handle every step
    assert _joined(rendered) == _joined(expected) == (TEXT, ids)
    assert rendered[-1].finished and rendered[-1].outputs[0].finish_reason == "length"
    assert not any(o.finished for o in rendered[:-1])
    assert not any("\ufffd" in o.outputs[0].text for o in rendered)
    assert not proc.has_unfinished()
    if render_every == 1000:
        assert len(rendered) == 1                   # one render, one output for everything


def test_render_with_nothing_new_gives_none_and_covers_only_the_tokens_it_decoded(tok):
    proc = OutputProcessor(tok, stream_deltas=True)
    proc.add_request(7, "r", None, [1, 2], SamplingParams(max_tokens=1000), pull=True)
    steps, ids = _steps(tok)
    (handle,), _ = proc.process(steps[:1])
    assert proc.render(handle).outputs[0].token_ids == ids[:1]
    assert proc.render(handle) is None              # nothing came since
    proc.process(steps[1:4])
    # The reader thread adds a step while a sender renders: the response's ids and text
    # cover the same tokens, the new one goes with the next render.
    decode = proc._decode_many

    def decode_while_a_step_arrives(seqs, skip):
        proc._decode_many = decode
        proc.process(steps[4:5])
        return decode(seqs, skip)
    proc._decode_many = decode_while_a_step_arrives
    second = proc.render(handle)
    assert second.outputs[0].token_ids == ids[1:4]
    assert second.outputs[0].text == tok.decode(ids[:4])[len(tok.decode(ids[:1])):]
    assert proc.render(handle).outputs[0].token_ids == ids[4:5]


def test_requests_with_stop_strings_or_not_streamed_are_not_pulled(tok):
    proc = OutputProcessor(tok, stream_deltas=True)
    proc.add_request(1, "stop", None, [1], SamplingParams(max_tokens=100, stop=["zzz"]),
                     pull=True)
    proc.add_request(2, "whole", None, [1], SamplingParams(max_tokens=100), stream=False,
                     pull=True)
    proc.add_request(3, "pulled", None, [1], SamplingParams(max_tokens=100), pull=True)
    t = tok.encode("hello", add_special_tokens=False)[0]
    outs, _ = proc.process([EngineCoreOutput(k, [t]) for k in (1, 2, 3)])
    assert {o.request_id: type(o) for o in outs} == {"stop": RequestOutput,
                                                     "pulled": PullOutput}


def test_pull_keeps_logprobs_one_per_token(tok):
    proc = OutputProcessor(tok, stream_deltas=True)
    proc.add_request(7, "r", None, [1], SamplingParams(max_tokens=100, logprobs=1), pull=True)
    rng = random.Random(0)
    ids = tok.encode("some words here", add_special_tokens=False)
    handle = None
    for i, t in enumerate(ids):
        lp = ([t, (t + 1) % 100], [-rng.random(), -5.0], 0)
        (handle,), _ = proc.process([EngineCoreOutput(7, [t], "length" if i == len(ids) - 1
                                                      else None, None, [lp])])
        if i == 1:
            out = proc.render(handle)
            assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids) == 2
    out = proc.render(handle)
    comp = out.outputs[0]
    assert out.finished and len(comp.logprobs) == len(comp.token_ids) == len(ids) - 2
    assert [next(iter(d)) for d in comp.logprobs] == comp.token_ids


@pytest.mark.parametrize("stream,pull", [(True, False), (True, True), (False, False)])
def test_every_output_carries_the_cached_prompt_tokens_told_with_the_first_token(tok, stream,
                                                                                  pull):
    proc = OutputProcessor(tok, stream_deltas=True)
    proc.add_request(7, "r", "Prompt", tok.encode("Prompt"), SamplingParams(max_tokens=1000),
                     stream=stream, pull=pull)
    steps, _ = _steps(tok)
    steps[0].num_cached_tokens = 32
    outs = []
    for co in steps:
        got, _ = proc.process([co])
        outs += [proc.render(o) if isinstance(o, PullOutput) else o for o in got]
    outs = [o for o in outs if o is not None]
    assert len(outs) == (len(steps) if stream else 1) and outs[-1].finished
    assert [o.num_cached_tokens for o in outs] == [32] * len(outs)


def _stop_token_run(tok, params, mode):
    """TEXT's tokens, the last one a stop token the core ended the request on: the joined
    text and ids of the outputs (mode: per step, pulled, or one final output)."""
    steps, ids = _steps(tok, finish="stop")
    steps[-1].stop_reason = ids[-1]
    proc = OutputProcessor(tok, stream_deltas=mode != "final")
    proc.add_request(7, "r", "Prompt", tok.encode("Prompt"), params, pull=mode == "pull")
    outs = []
    for co in steps:
        got, _ = proc.process([co])
        outs += [proc.render(o) if isinstance(o, PullOutput) else o for o in got]
    outs = [o for o in outs if o is not None]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"
    assert outs[-1].outputs[0].stop_reason == ids[-1]
    return _joined(outs), ids


@pytest.mark.parametrize("mode", ["step", "pull", "final"])
def test_the_stop_tokens_text_is_left_out_unless_asked_for(tok, mode):
    """vLLM leaves the text of the token that stopped a request (a stop_token_ids entry or
    EOS) out of the output text unless include_stop_str_in_output; the id stays."""
    (text, got_ids), ids = _stop_token_run(tok, SamplingParams(max_tokens=1000), mode)
    assert got_ids == ids
    assert text == tok.decode(ids[:-1]) and text != TEXT
    (text, got_ids), _ = _stop_token_run(
        tok, SamplingParams(max_tokens=1000, include_stop_str_in_output=True), mode)
    assert got_ids == ids and text == TEXT


def test_a_stop_string_in_the_first_min_tokens_tokens_text_is_not_searched(tok):
    """As vLLM: stop strings are looked for once more than min_tokens tokens are out, so a
    stop string within the first min_tokens tokens' text does not end the request."""
    ids = tok.encode("plain words at the end", add_special_tokens=False)
    steps = [EngineCoreOutput(7, [t], None) for t in ids]
    second = tok.decode(ids[:2])[len(tok.decode(ids[:1])):]
    assert second.strip() and second not in tok.decode(ids[:1]), second
    for min_tokens, stopped in ((1, True), (2, False)):
        proc = OutputProcessor(tok, stream_deltas=False)
        proc.add_request(7, "r", None, [1], SamplingParams(max_tokens=1000, stop=[second],
                                                           min_tokens=min_tokens))
        to_abort = [key for co in steps[:2] for key in proc.process([co])[1]]
        assert (to_abort == [7]) is stopped, (min_tokens, to_abort)


@pytest.mark.parametrize("include", [False, True])
def test_a_stream_holds_back_text_only_where_a_stop_string_would_be_cut(tok, include):
    """Streamed with a stop string, the text that could begin one is held back until it cannot
    (it would be cut); with include_stop_str_in_output nothing is cut before a stop string's
    end, so nothing is held back (as vLLM): each step sends what it sends with no stop string.
    The joined text is the same either way."""
    stop = "\u2603never\u2603"                      # 8 characters, never generated
    plain = [o.outputs[0].text for o in _per_step(tok, SamplingParams(max_tokens=1000))]
    outs = [o.outputs[0].text for o in _per_step(
        tok, SamplingParams(max_tokens=1000, stop=[stop], include_stop_str_in_output=include))]
    if include:
        assert outs == plain
    else:
        sent, sent_plain = "", ""
        for text, text_plain in zip(outs[:-1], plain[:-1]):
            sent, sent_plain = sent + text, sent_plain + text_plain
            assert sent == sent_plain[:max(0, len(sent_plain) - (len(stop) - 1))]
    assert "".join(outs) == "".join(plain) == TEXT


@pytest.mark.parametrize("mode", ["step", "pull", "final"])
def test_cumulative_logprob_sums_the_sampled_tokens_logprobs_so_far(tok, mode):
    """vLLM's CompletionOutput.cumulative_logprob: every output carries the sum over all the
    request's sampled tokens up to its last (not only its own); None without logprobs."""
    ids = tok.encode("some words here and more", add_special_tokens=False)
    rng = random.Random(1)
    sampled = [-rng.random() for _ in ids]
    for logprobs in (2, None):
        proc = OutputProcessor(tok, stream_deltas=mode != "final")
        proc.add_request(7, "r", None, [1], SamplingParams(max_tokens=100, logprobs=logprobs),
                         pull=mode == "pull")
        outs = []
        for i, t in enumerate(ids):
            # The sampled token first, then the top-2 (the sampled one among them: rank 1).
            lp = [([t, t, (t + 1) % 100], [sampled[i], sampled[i], -9.0], 1)]
            got, _ = proc.process([EngineCoreOutput(7, [t], "length" if i == len(ids) - 1
                                                    else None, None, lp if logprobs else None)])
            outs += [proc.render(o) if isinstance(o, PullOutput) else o for o in got]
        outs = [o for o in outs if o is not None]
        assert outs[-1].finished
        num = 0
        for out in outs:
            num += len(out.outputs[0].token_ids) if mode != "final" else len(ids)
            want = sum(sampled[:num]) if logprobs else None
            assert out.outputs[0].cumulative_logprob == pytest.approx(want), (mode, num)


def test_a_sampled_token_tied_with_a_top_n_token_takes_its_place_there_as_in_vllm():
    """Greedy takes id 1 of two tied top logits; the sampler's top-2 lists the other first.
    vLLM's logprob dict gives the top-n their ranks by position, the sampled token's entry
    included (a later key overwrites): ranks 1..n once each. Here both claimed rank 1."""
    import torch

    from engine.sampler import Sampler, SamplingMetadata
    V = 1024
    logits = torch.zeros(1, V)
    logits[0, 1] = logits[0, V - 2] = 5.0
    params = SamplingParams(temperature=0.0, logprobs=2, max_tokens=4)
    meta = SamplingMetadata.from_params([params], [[3]], [[]], [], "cpu", vocab_size=V)
    out = Sampler(seed=0)(logits, meta)
    ids, lps = out.logprob_token_ids[0].tolist(), out.logprobs[0].tolist()
    assert out.sampled_token_ids.item() == 1 and ids[1:] == [V - 2, 1]   # the tie, as topk gave it
    proc = OutputProcessor(None, stream_deltas=False)
    proc.add_request(0, "r", None, [3], params)
    (res,), _ = proc.process([EngineCoreOutput(
        0, [1], "length", None, [(ids, lps, out.sampled_token_ranks[0].item())])])
    step = res.outputs[0].logprobs[0]
    assert {t: lp.rank for t, lp in step.items()} == {V - 2: 1, 1: 2}
    assert next(iter(step)) == 1                       # the sampled token first, as before
    assert res.outputs[0].cumulative_logprob == pytest.approx(lps[0])


class _RefusingDecode:
    """A tokenizer whose decode raises for one id (as a slow SentencePiece tokenizer raises
    IndexError for an id past its vocabulary), in every decode path the processor takes."""

    def __init__(self, tok, bad):
        self.tok, self.bad = tok, bad

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __len__(self):
        return len(self.tok)

    def decode(self, ids, *args, **kwargs):
        if self.bad in ([ids] if isinstance(ids, int) else list(ids)):
            raise IndexError(f"piece id {self.bad} is out of range")
        return self.tok.decode(ids, *args, **kwargs)


@pytest.mark.parametrize("where", ["text", "logprobs", "stop strings"])
def test_a_request_whose_output_fails_ends_alone(tok, where, monkeypatch):
    """One request's decode (of its tokens or its logprobs' tokens) or stop-string search
    raising was the whole step's exception: the engine's reader thread died with it, and every
    request with it. That request alone now ends (a RequestFailed in its place, its key to
    abort in the core); the step's others get their outputs."""
    from engine.output_processor import RequestFailed
    good_ids = tok.encode("plain words", add_special_tokens=False)
    bad = next(t for t in range(len(tok)) if t not in good_ids)
    proc = OutputProcessor(_RefusingDecode(tok, bad), stream_deltas=True)
    logprobs = 1 if where == "logprobs" else None
    proc.add_request(1, "good", "P", [5], SamplingParams(max_tokens=100, stop=["zz"],
                                                         logprobs=logprobs))
    proc.add_request(2, "bad", "P", [5], SamplingParams(max_tokens=100, stop=["zz"],
                                                        logprobs=logprobs))
    if where == "stop strings":
        proc.states[2].stop.find = lambda *a: (_ for _ in ()).throw(RuntimeError("no search"))
    for i, t in enumerate(good_ids):
        lp = [([t], [-0.5], 1)] if logprobs else None
        other = t if where == "stop strings" else bad
        outs, to_abort = proc.process([EngineCoreOutput(1, [t], None, new_logprobs=lp),
                                       EngineCoreOutput(2, [other], None, new_logprobs=(
                                           [([other], [-0.5], 1)] if logprobs else None))])
        if i == 0:
            failed = [o for o in outs if isinstance(o, RequestFailed)]
            assert len(failed) == 1 and failed[0].request_id == "bad", outs
            assert to_abort == [2] and 2 not in proc.states
        else:
            assert to_abort == [] and not any(isinstance(o, RequestFailed) for o in outs)
        assert [o.request_id for o in outs if isinstance(o, RequestOutput)] == ["good"]
    assert proc.states[1].text == "plain words"


@pytest.mark.parametrize("stream", [False, True])
def test_first_token_time_is_kept_after_later_tokens(tok, monkeypatch, stream):
    """metrics["first_token_time"] stays the first token's over later steps (serving turns it
    into TTFT and inter-token latency). Found by a mutation review."""
    clock = iter([10.0, 11.0, 12.0])
    monkeypatch.setattr(output_processor_module.time, "monotonic", lambda: next(clock))
    proc = OutputProcessor(tok, stream_deltas=True)
    ids = tok.encode("plain words", add_special_tokens=False)[:3]
    assert len(ids) == 3
    proc.add_request(7, "r", "p", tok.encode("p"), SamplingParams(max_tokens=3), stream=stream)
    outs = []
    for i, t in enumerate(ids):
        got, _ = proc.process([EngineCoreOutput(7, [t], "length" if i == 2 else None)])
        outs += got
    last = outs[-1]
    assert last.finished
    assert last.metrics == {"first_token_time": 10.0, "last_token_time": 12.0}
