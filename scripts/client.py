"""Streams one prompt to the `llm` model over gRPC ModelStreamInfer and prints the text as it
arrives, then the finish reason.

    .venv/bin/python scripts/client.py --prompt "Hello, my name is" [--url localhost:8001]
        [--model llm] [--max-tokens 64] [--temperature 0]

stdout: the generated text, then a line `finish_reason: <stop|length|abort>`.
stderr: time to first response and total time, in ms. Exit status 1 on a server error.
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import time

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def build_inputs(prompt: str, sampling_parameters: dict) -> list[grpcclient.InferInput]:
    """The `llm` model's inputs (the tensor names of Triton's vLLM backend)."""
    def tensor(name: str, datatype: str, value) -> grpcclient.InferInput:
        array = np.array([value], dtype=object if datatype == "BYTES" else bool)
        t = grpcclient.InferInput(name, [1], datatype)
        t.set_data_from_numpy(array)
        return t

    return [tensor("text_input", "BYTES", prompt.encode()),
            tensor("stream", "BOOL", True),
            tensor("sampling_parameters", "BYTES", json.dumps(sampling_parameters).encode()),
            tensor("return_finish_reason", "BOOL", True)]


def _first(result, name: str) -> str | None:
    array = result.as_numpy(name)
    if array is None or array.size == 0:
        return None
    value = array.reshape(-1)[0]
    return value.decode() if isinstance(value, bytes) else str(value)


def _is_final(result) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


def stream(url: str, model: str, prompt: str, sampling_parameters: dict,
           timeout_s: float, out=sys.stdout) -> str | None:
    """Prints the text of each response as it arrives; returns the finish reason."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    finish_reason = None
    started = time.perf_counter()
    first_ms = None
    try:
        # With enable_empty_final_response every response says whether it is the last one; the
        # server sends an extra empty one only when the model ends the stream without data.
        try:
            client.async_stream_infer(model, build_inputs(prompt, sampling_parameters),
                                      request_id="client-1", enable_empty_final_response=True)
        except InferenceServerException:
            # The stream failed as it opened (no server there, say): its callback has the
            # cause; tritonclient's own error only points there.
            try:
                _, error = responses.get(timeout=1.0)
            except queue.Empty:
                error = None
            if error is not None:
                raise error from None
            raise
        while True:
            result, error = responses.get(timeout=timeout_s)
            if error is not None:
                raise error
            if first_ms is None:
                first_ms = (time.perf_counter() - started) * 1e3
            text = _first(result, "text_output")
            if text:
                out.write(text)
                out.flush()
            finish_reason = _first(result, "finish_reason") or finish_reason
            if _is_final(result):
                break
    finally:
        client.stop_stream(cancel_requests=True)  # cancels the request if we stop early
        client.close()
    total_ms = (time.perf_counter() - started) * 1e3
    print(f"first response {first_ms or 0:.1f} ms, total {total_ms:.1f} ms", file=sys.stderr)
    return finish_reason


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="localhost:8001", help="gRPC host:port")
    parser.add_argument("--model", default="llm")
    parser.add_argument("--prompt", default="Hello, my name is")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="longest wait for the next response")
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")

    sampling_parameters = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    try:
        finish_reason = stream(args.url, args.model, args.prompt, sampling_parameters,
                               args.timeout_s)
    except InferenceServerException as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    except queue.Empty:
        print(f"\nerror: no response within {args.timeout_s} s", file=sys.stderr)
        return 1
    print(f"\nfinish_reason: {finish_reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
