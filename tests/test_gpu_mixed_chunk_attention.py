"""scripts/gpu_mixed_chunk_attention.py's cases and forms (the timing needs a GPU; the kernel's
split-KV over prompt tiles is tests/test_paged_attention.py's)."""
from scripts import gpu_mixed_chunk_attention as probe


def test_cases_fit_their_contexts():
    for decode_rows, decode_ctx, chunk, chunk_ctx in probe.CASES:
        assert decode_rows >= 1 and decode_ctx >= 1 and 1 < chunk <= chunk_ctx


def test_forms_hold_the_engines_form_and_each_split():
    names = probe.forms((2, 4))
    assert names[:3] == ["decode_only", "chunk_only", "two_calls"]
    assert names[3:] == ["two_calls_s2", "two_calls_s4", "chunk_side"]
    assert len(set(probe.forms())) == len(probe.forms())
