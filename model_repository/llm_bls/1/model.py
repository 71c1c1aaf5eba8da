"""Triton adapter: one non-streaming response per request, over the `llm` model by BLS (the
model named by the `llm_model` parameter, `llm` unless set).

execute() only registers each request and queues it for a worker; the worker makes the BLS call
to `llm` and sends the single response with the FINAL flag, so many requests run at once on one
instance and a long one never holds up a short one. This Triton version has no BLS call that
does not hold a thread until `llm` answers (engine/bls_calls.py has the evidence), so the
workers are a bounded pool whose threads wait without the GIL: at most `max_concurrency`
requests, and one fewer than the server's Python thread pool, are in a BLS call at once; the
rest wait in the queue, holding no thread. A watcher asks a bounded number of requests per
round whether their clients cancelled them and aborts their `llm` requests; each request is
asked once more when llm has answered, before its BLS call's objects may be freed.
"""
import faulthandler
import gc
import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

from engine.bls_calls import BlsCalls, BlsSettings, python_backend_thread_pool_size
from engine.config import refuse_triton_batching
from engine.protocol import (INPUT_NAMES, SCALAR_OVERRIDES, SHUTTING_DOWN, TRTLLM_WORD_INPUTS,
                             bls_inner_inputs, bls_inner_outputs, error_code, untag_error_kind,
                             with_request_parameters)
from engine.signal_watch import SignalWatch

_OUTER_INPUTS = frozenset(INPUT_NAMES + tuple(SCALAR_OVERRIDES) + TRTLLM_WORD_INPUTS)
_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        refuse_triton_batching(model_config)
        settings = BlsSettings.from_parameters(model_config.get("parameters", {}),
                                               args["model_name"])
        self.llm = settings.llm_model
        server_threads = python_backend_thread_pool_size(_server_argv())
        # One server thread stays free for the BLS calls that abort cancelled requests.
        self.max_in_llm = max(1, min(settings.max_concurrency, server_threads - 1))
        self.pool = ThreadPoolExecutor(self.max_in_llm, thread_name_prefix="llm_bls")
        self.calls = BlsCalls(self._cancelled)
        # SIGINT / SIGTERM to the server's process group: the server is stopping (llm's
        # model.py says more). Requests still waiting here are answered at once, and no error
        # asks the server whether llm is ready: that call, made while the server stops, killed
        # this stub (SIGSEGV in IsModelReady), its requests never answered.
        self.stopping = threading.Event()
        self.signal_watch = SignalWatch((signal.SIGINT, signal.SIGTERM),
                                        lambda signum: self.stopping.set())
        faulthandler.enable(all_threads=True)   # a crash writes its threads' stacks to the log
        pb_utils.Logger.log_info(
            f"llm_bls: up to {self.max_in_llm} requests in {self.llm} at once on this instance "
            f"(max_concurrency {settings.max_concurrency}; the server's Python thread-pool-size "
            f"{server_threads}, raise it with --backend-config=python,thread-pool-size=N)")

    def execute(self, requests):
        for request in requests:
            call = self.calls.add(request.is_cancelled, request.get_response_sender())
            self.pool.submit(self._serve, request, call)
        return None

    def finalize(self):
        # No thread of ours may be inside a pb_utils call once this returns (README).
        self.signal_watch.close()
        self.pool.shutdown(wait=True)
        self.calls.close()
        # Triton's objects (BLS responses, senders) must go while the stub still runs: held in
        # reference cycles (callbacks to this model), they were freed by the stub's collection
        # at its exit, after its shared memory was gone, and it crashed (SIGSEGV).
        self.calls = None
        gc.collect()

    def _serve(self, request, call):
        if not self.calls.start(call):
            return                      # cancelled while it waited: the watcher answered it
        keep = None
        try:
            if self.stopping.is_set():
                response = _error(SHUTTING_DOWN, pb_utils.TritonError.UNAVAILABLE)
            else:
                response, keep = _answer_from_llm(self.llm, request, call.inner_id,
                                                  self.stopping)
        except Exception as e:  # noqa: BLE001 - the client must always get its final response
            pb_utils.Logger.log_error(f"llm_bls: {e!r}")
            response = _error(f"internal error: {e}")
        # The BLS call's iterator lives until the stub has dropped its own reference to it
        # (engine/bls_calls.py): finish's last ask, or a later one, comes after that.
        if self.calls.finish(call, keep):
            response = _error("request cancelled", pb_utils.TritonError.CANCELLED)
        try:
            call.payload.send(response, flags=_FINAL)
        except Exception as e:  # noqa: BLE001 - e.g. the request was cancelled and freed
            pb_utils.Logger.log_error(f"llm_bls: sending the response failed: {e!r}")

    def _cancelled(self, call, started):
        """On the watcher's thread: `call`'s client cancelled it."""
        if started:
            self.calls.keep_until_next_ask(_abort_in_llm(self.llm, call.inner_id))
        else:
            self.calls.finish(call)
            call.payload.send(_error("request cancelled", pb_utils.TritonError.CANCELLED),
                              flags=_FINAL)


def _answer_from_llm(llm, request, inner_id, stopping):
    """The response to send, and what must outlive its sending: the BLS call's iterator (see
    _serve) and the output tensors (a response sender drops the tensors the client did not ask
    for without the GIL: never their last reference)."""
    inputs = with_request_parameters(
        {t.name(): t.as_numpy() for t in request.inputs() if t.name() in _OUTER_INPUTS},
        request.parameters())
    try:
        inner = bls_inner_inputs(inputs)
    except ValueError as e:
        return _error(str(e), pb_utils.TritonError.INVALID_ARG), None
    # The outputs this request's client asked for that llm sends it (bls_inner_outputs): a
    # repository may declare fewer outputs than engine.protocol.OUTPUT_NAMES
    # (scripts/bench_serving.py's copy does), and llm refuses a call for an output it does not
    # declare.
    call = pb_utils.InferenceRequest(
        model_name=llm,
        requested_output_names=bls_inner_outputs(inner, list(request.requested_output_names())),
        inputs=[pb_utils.Tensor(k, v) for k, v in inner.items()], request_id=inner_id)
    outputs, error, answered = None, None, False
    # Returns (without the GIL) when llm answers: one response, with the FINAL flag.
    responses = call.exec(decoupled=True)
    for response in responses:
        if response.has_error():
            error = response.error()
            continue
        answered = True
        if response.output_tensors():
            outputs = [pb_utils.Tensor(t.name(), t.as_numpy()) for t in response.output_tensors()]
    if error is not None:
        return _error(*_message_and_code(llm, error, stopping)), responses
    if not answered:
        return _error(f"{llm} returned no output"), responses
    # No tensors: the client asked only for outputs its return_* flags leave out; llm (and
    # Triton's vLLM backend) answer that with a response without them, and so does this.
    outputs = outputs or []
    return pb_utils.InferenceResponse(output_tensors=outputs), (responses, outputs)


def _message_and_code(llm, error, stopping):
    """The message and code to answer an error of the BLS call with. Triton 2.51's BLS
    responses carry every error as INTERNAL, so llm's own errors carry their kind on the
    message. One without is Triton's (its code lost too): when llm cannot take requests (its
    engine died and it unloaded itself, or it is not loaded: "Model 'llm' is not ready",
    "unknown model"), or the server is stopping, it is UNAVAILABLE (HTTP 503), as llm answers
    when its engine is gone. The server is not asked while it stops (see initialize)."""
    message, kind = untag_error_kind(error.message())
    if kind is not None:
        return message, error_code(pb_utils.TritonError, kind)
    code = error.code()
    if code == pb_utils.TritonError.INTERNAL and (
            stopping.is_set() or "Server not ready" in message
            or not _llm_is_ready(llm, message)):
        code = pb_utils.TritonError.UNAVAILABLE
    return message, code


def _llm_is_ready(llm, message):
    """Asks the server; should that fail, Triton's words for a model that cannot serve."""
    try:
        return pb_utils.is_model_ready(llm)
    except Exception as e:  # noqa: BLE001 - the answer is only the error's code
        pb_utils.Logger.log_warn(f"llm_bls: asking whether {llm} is ready failed: {e!r}")
        return not any(s in message for s in ("is not ready", "unknown model",
                                              "has no available versions"))


def _abort_in_llm(llm, inner_id):
    """Returns the call's iterator, to be dropped after a later ask (see _serve)."""
    call = pb_utils.InferenceRequest(
        model_name=llm, requested_output_names=["text_output"],
        inputs=[pb_utils.Tensor("abort_request_id",
                                np.array([inner_id.encode()], dtype=np.object_))])
    responses = call.exec(decoupled=True)
    for response in responses:
        if response.has_error():
            # e.g. llm is being unloaded: Triton takes no new request for it, so the aborted
            # request runs to its end (and the unload waits for it). Said, not swallowed.
            pb_utils.Logger.log_error(
                f"llm_bls: could not abort request {inner_id} in {llm}, which runs on to its "
                f"end: {response.error().message()}")
    return responses


def _server_argv():
    """The tritonserver command line (the stub's parent), for its thread-pool-size."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _error(message, code=None):
    if code is None:
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
