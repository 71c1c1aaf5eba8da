"""Triton adapter: one non-streaming response per request, over the `llm` model by BLS.

execute() only parses each request and hands it to engine/bls_client.py, which sends it to
`llm` and answers it when its result comes back on a result stream: many requests at once on
one instance, none holding a thread or a server thread while it is generated. This file is the
Triton side of it: the BLS calls (`_Transport`) and the answer to the client (`_Client`).
"""
import numpy as np
import triton_python_backend_utils as pb_utils

from engine.bls_client import BlsClient, Result, SubmitError
from engine.protocol import (CONTROL_OUTPUT_NAMES, INPUT_NAMES, OUTPUT_NAMES,
                             SCALAR_OVERRIDES, bls_inner_inputs)

_OUTER_INPUTS = INPUT_NAMES + tuple(SCALAR_OVERRIDES) + ("stop_words",)
_RESULT_OUTPUTS = list(OUTPUT_NAMES + CONTROL_OUTPUT_NAMES)
_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        self.client = BlsClient(_Transport())

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            inputs = {}
            for name in _OUTER_INPUTS:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            try:
                inner = bls_inner_inputs(inputs)
            except ValueError as e:
                sender.send(_error(str(e)), flags=_FINAL)
                continue
            self.client.submit(_Client(request, sender), inner)
        return None

    def finalize(self):
        self.client.close()


class _Client:
    """The caller's request: asked if it was cancelled, answered once."""

    def __init__(self, request, sender):
        self.request, self.sender = request, sender

    def is_cancelled(self):
        return self.request.is_cancelled()

    def respond(self, outputs, error, cancelled):
        if cancelled:
            response = _error("request cancelled", pb_utils.TritonError.CANCELLED)
        elif error is not None:
            response = _error(error)
        else:
            response = pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor(k, v) for k, v in outputs.items() if k in OUTPUT_NAMES])
        self.sender.send(response, flags=_FINAL)


class _Transport:
    """engine.bls_client.Transport over BLS calls to `llm`. Each call's request object lives as
    long as its responses are read, and on the thread that reads them."""

    def open(self, owner):
        responses = _exec({"bls_open": _str(owner)})
        first = next(responses)
        if first.has_error():
            raise SubmitError(first.error().message())
        yield _out_text(first, "bls_stream_id")
        for r in responses:
            if r.has_error():
                raise RuntimeError(r.error().message())
            request_id = _out_text(r, "bls_request_id")
            if request_id is None:
                continue                    # the empty final response: the stream ended
            # Copies: nothing of ours may point into the response's shared memory later.
            outputs = {t.name(): np.array(t.as_numpy(), copy=True) for t in r.output_tensors()}
            yield Result(request_id, outputs, _out_text(r, "bls_error"))

    def submit(self, owner, request_id, inputs):
        stream_id = None
        for r in _exec({**inputs, "bls_owner": _str(owner), "bls_request_id": _str(request_id)}):
            if r.has_error():
                raise SubmitError(r.error().message())
            stream_id = _out_text(r, "bls_stream_id") or stream_id
        if stream_id is None:
            raise SubmitError("llm accepted the request without naming its result stream")
        return stream_id

    def abort(self, request_id):
        for _ in _exec({"abort_request_id": _str(request_id)}):
            pass


def _exec(inputs):
    """The responses of one BLS call to llm; the request object lives while they are read."""
    request = pb_utils.InferenceRequest(
        model_name="llm", requested_output_names=_RESULT_OUTPUTS,
        inputs=[pb_utils.Tensor(k, v) for k, v in inputs.items()])
    yield from request.exec(decoupled=True)


def _str(value):
    return np.array([value.encode("utf-8")], dtype=np.object_)


def _out_text(response, name):
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    if tensor is None:
        return None
    v = tensor.as_numpy().reshape(-1)[0]
    return v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)


def _error(message, code=None):
    if code is None:
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
