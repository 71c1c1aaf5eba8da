"""Triton adapter for the engine: decoupled, streaming. All logic is in engine/serving.py."""
import faulthandler
import gc
import json
import os
import signal

import triton_python_backend_utils as pb_utils

from engine.config import (EngineConfig, engine_device, instance_device, refuse_triton_batching,
                           settings_from_triton)
from engine.instance_board import InstanceBoard, load_generation
from engine.metrics import TritonMetrics, instance_labels
from engine.protocol import (BLS_REQUEST_ID_PREFIX, CONTROL_INPUT_NAMES, INPUT_NAMES,
                             SHUTTING_DOWN, error_code, tag_error_kind, with_request_parameters)
from engine.signal_watch import SignalWatch


class TritonPythonModel:
    def initialize(self, args):
        # Imported here, not above: the server also loads this file in a stub of its own to
        # complete the model's config, and the serving engine's imports (the tokenizer's
        # transformers, torch) take seconds there for nothing.
        from engine.serving import ServingEngine

        self.logger = pb_utils.Logger
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("the llm model must be decoupled")
        refuse_triton_batching(model_config)
        device = instance_device(args["model_instance_kind"], args["model_instance_device_id"])
        repository = os.path.dirname(args["model_repository"].rstrip("/"))
        config = EngineConfig.from_strings(settings_from_triton(model_config, repository, device))
        # The engine's device (a `device` parameter overrides the instance's), as it will run.
        device = engine_device(config.device)
        # Each instance publishes its own series (one instance per GPU): sum them by model.
        labels = instance_labels(args["model_name"], args["model_version"],
                                 args["model_instance_name"], device)
        self.model_name = args["model_name"]
        self.board = _open_board(args["model_name"], args["model_version"],
                                 load_generation(args["model_config"], args["model_repository"]))
        self.metrics = TritonMetrics(pb_utils, labels)
        try:
            self.serving = ServingEngine(config, publisher=self.metrics,
                                         on_dead=self._engine_died, board=self.board)
        except BaseException:
            if self.board is not None:
                self.board.close()
            self.metrics.close()
            raise
        # The stub ignores SIGINT and SIGTERM; one reaches it only as a signal to the server's
        # whole process group (Ctrl-C): the server is stopping, and it unloads this model only
        # once every stream has ended. So end them (engine/signal_watch.py).
        self.signal_watch = SignalWatch((signal.SIGINT, signal.SIGTERM), self._server_stopping)
        # `kill -USR1 <stub pid>` prints every thread's stack to the server's log: for a model
        # that seems stuck (e.g. a stop whose finalize never comes).
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        # A crash of this stub (SIGSEGV, SIGABRT) writes its threads' stacks to the log.
        faulthandler.enable(all_threads=True)
        self.logger.log_info(f"llm: engine ready on {device} with {config.model}")

    def execute(self, requests):
        # Triton calls this once per request and holds the next one until it returns, so the
        # tensors are read later, on the serving loop (a request's inputs stay valid after
        # execute returns in a decoupled model).
        for request in requests:
            request_id = request.request_id() or None
            for_bls = bool(request_id) and request_id.startswith(BLS_REQUEST_ID_PREFIX)
            self.serving.submit(_inputs_of(request),
                                _sender(request.get_response_sender(), for_bls),
                                request.is_cancelled, request_id)
        if self.board is not None:
            # Holding this call a moment while this instance has more requests than another
            # makes Triton give the next ones to the others (engine/instance_board.py).
            self.board.wait_turn()
        return None

    def _engine_died(self, reason):
        """The engine core process is gone and every in-flight request has its error. Unload
        ourselves so that Triton reports the model not ready (readiness in this Triton version
        follows load state only); that needs --model-control-mode=explicit."""
        self.logger.log_error(f"llm: the engine core died ({reason}); unloading the model")
        if self.board is not None:
            self.board.close()              # no instance waits for this one any more
        try:
            pb_utils.unload_model(self.model_name)
        except Exception as e:  # noqa: BLE001 - e.g. model control mode NONE
            self.logger.log_error(
                f"llm: cannot unload the model ({e}); it stays loaded and answers every request "
                f"with an error. Run tritonserver with --model-control-mode=explicit "
                f"--load-model=* for readiness to follow the engine")

    def _server_stopping(self, signum):
        self.logger.log_info(f"llm: {signal.Signals(signum).name}: the server is stopping; "
                             f"requests in flight end now")
        self.serving.stop_serving(SHUTTING_DOWN)

    def finalize(self):
        # Every thread of ours that calls pb_utils has ended when this returns: a call under
        # way as the stub exits can leave the server a lock held by a dead process (README).
        # The first line says the server got as far as unloading us (a stop that hangs before
        # it is the server's: a gRPC stream it still counts open holds the model).
        self.logger.log_info("llm: finalize: stopping the engine")
        self.signal_watch.close()
        self.serving.shutdown()
        if self.board is not None:
            self.board.close()
        # Triton's objects must not be freed by the stub's last collection, at its exit, after
        # its shared memory is gone (a segfault on every unload): the engine's objects hold
        # them in reference cycles (callbacks to this model). The metrics' are kept for good
        # (TritonMetrics.close says why), the others are freed here.
        self.metrics.close()
        self.serving = None
        gc.collect()
        self.logger.log_info("llm: engine stopped")


def _open_board(model_name, model_version, generation):
    """The board this load of the model version's instances in this server share (the stub's
    parent is the server), or None, with a warning, if there can be none."""
    try:
        return InstanceBoard(os.getppid(), model_name, model_version=model_version,
                             generation=generation)
    except (OSError, RuntimeError) as e:
        pb_utils.Logger.log_warn(f"llm: no instance board ({e}): each request goes to the "
                                 f"instance Triton picks, and llm_bls's aborts reach only it")
        return None


def _inputs_of(request):
    def read():
        inputs = {t.name(): t.as_numpy() for t in request.inputs() if t.name() in _KNOWN_INPUTS}
        return with_request_parameters(inputs, request.parameters())
    return read


_KNOWN_INPUTS = frozenset(INPUT_NAMES + CONTROL_INPUT_NAMES)


def _sender(sender, for_bls):
    """`send` for the serving engine. An error's kind (engine.protocol.ServingError) is its status
    code (HTTP 400 / 499 / 503 / 500), and for llm_bls also a tag on its message: Triton's BLS
    drops the code (engine/protocol.py, tag_error_kind)."""
    def send(tensors, error, final):
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        if error is not None:
            kind = getattr(error, "kind", None)
            message = tag_error_kind(str(error), kind) if for_bls else str(error)
            response = pb_utils.InferenceResponse(
                error=pb_utils.TritonError(message, error_code(pb_utils.TritonError, kind)))
        else:
            response = pb_utils.InferenceResponse(
                [pb_utils.Tensor(name, value) for name, value in tensors.items()])
        sender.send(response, flags=flags)
    return send
