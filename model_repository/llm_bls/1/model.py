"""Triton adapter: one non-streaming response per request, over the `llm` model by BLS.

execute() only hands each request to a worker thread and returns None; the worker waits on
`llm` and sends the single response with the FINAL flag. So many requests run at once on one
instance and a long one never holds up a short one. A watcher passes cancellations on.
"""
import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

from engine.protocol import (BLS_REQUEST_ID_PREFIX, INPUT_NAMES, OUTPUT_NAMES,
                             SCALAR_OVERRIDES, bls_inner_inputs)

_OUTER_INPUTS = INPUT_NAMES + tuple(SCALAR_OVERRIDES) + ("stop_words",)
_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_CANCEL_POLL_S = 0.1


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        workers = int(params.get("max_concurrency", {}).get("string_value", "512"))
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="llm_bls")
        self.inflight = {}                      # inner request id -> outer request
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.watcher = threading.Thread(target=self._watch_cancellations, daemon=True)
        self.watcher.start()

    def execute(self, requests):
        for request in requests:
            self.pool.submit(self._serve, request, request.get_response_sender())
        return None

    def finalize(self):
        self.stopping.set()
        self.watcher.join()
        self.pool.shutdown(wait=True)

    def _serve(self, request, sender):
        inner_id = f"{BLS_REQUEST_ID_PREFIX}{uuid.uuid4().hex}"
        try:
            inputs = {}
            for name in _OUTER_INPUTS:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            try:
                inner = bls_inner_inputs(inputs)
            except ValueError as e:
                sender.send(_error(str(e)), flags=_FINAL)
                return
            with self.lock:
                self.inflight[inner_id] = request
            call = pb_utils.InferenceRequest(
                model_name="llm", requested_output_names=list(OUTPUT_NAMES),
                inputs=[pb_utils.Tensor(k, v) for k, v in inner.items()], request_id=inner_id)
            outputs, error = None, None
            for response in call.exec(decoupled=True):
                if response.has_error():
                    error = response.error().message()
                elif response.output_tensors():
                    outputs = [pb_utils.Tensor(t.name(), t.as_numpy())
                               for t in response.output_tensors()]
            cancelled = request.is_cancelled()
            # Once the FINAL response is sent Triton frees the request: the watcher must not
            # see it any more, so it leaves `inflight` first.
            self._forget(inner_id)
            if cancelled:
                sender.send(_error("request cancelled", pb_utils.TritonError.CANCELLED),
                            flags=_FINAL)
            elif error is not None or outputs is None:
                sender.send(_error(error or "llm returned no output"), flags=_FINAL)
            else:
                sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=_FINAL)
        except Exception as e:  # noqa: BLE001 - the client must always get its final response
            self._forget(inner_id)
            pb_utils.Logger.log_error(f"llm_bls: {e!r}")
            sender.send(_error(f"internal error: {e}"), flags=_FINAL)

    def _forget(self, inner_id):
        with self.lock:
            self.inflight.pop(inner_id, None)

    def _watch_cancellations(self):
        aborted = set()
        while not self.stopping.wait(_CANCEL_POLL_S):
            # is_cancelled() under the lock: a request out of `inflight` may be freed already.
            with self.lock:
                aborted &= set(self.inflight)
                cancelled = [inner_id for inner_id, request in self.inflight.items()
                             if inner_id not in aborted and request.is_cancelled()]
            for inner_id in cancelled:
                aborted.add(inner_id)
                self._abort_inner(inner_id)

    def _abort_inner(self, inner_id):
        call = pb_utils.InferenceRequest(
            model_name="llm", requested_output_names=["text_output"],
            inputs=[pb_utils.Tensor("abort_request_id",
                                    np.array([inner_id.encode()], dtype=np.object_))])
        for _ in call.exec(decoupled=True):
            pass


def _error(message, code=None):
    if code is None:
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
