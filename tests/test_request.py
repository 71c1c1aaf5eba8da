import numpy as np
import pytest

from engine.request import check_request
from engine.sampling_params import SamplingParams

VOCAB, MAX_LEN = 1000, 64


@pytest.mark.parametrize("ids,params,needle", [
    ([], SamplingParams(), "the prompt is empty"),
    ([1] * (MAX_LEN + 1), SamplingParams(), f"{MAX_LEN + 1} tokens long, more than max_model_len "
                                             f"({MAX_LEN})"),
    ([5, VOCAB], SamplingParams(), f"input_ids) must be in [0, {VOCAB}), got [{VOCAB}]"),
    ([-1, 5], SamplingParams(), f"input_ids) must be in [0, {VOCAB}), got [-1]"),
    (np.array([7, 2**40]), SamplingParams(), f"must be in [0, {VOCAB})"),
    ([10**30], SamplingParams(), f"input_ids) must be integers in [0, {VOCAB})"),
    ([1], SamplingParams(stop_token_ids=[3, VOCAB + 5]), f"stop_token_ids must be in [0, {VOCAB})"),
])
def test_what_the_engine_cannot_serve_is_named(ids, params, needle):
    with pytest.raises(ValueError) as e:
        check_request(ids, params, MAX_LEN, VOCAB)
    assert needle in str(e.value), str(e.value)


def test_a_servable_request_passes():
    check_request([0, VOCAB - 1] * (MAX_LEN // 2), SamplingParams(stop_token_ids=[VOCAB - 1]),
                  MAX_LEN, VOCAB)
