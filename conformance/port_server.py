"""Serve the port protocol (conformance/port_protocol.py) from Python: the suite's own
backends and the deliberately wrong ports, wrapped as commands the runner can drive.

    python -m kvspec.conformance.port_server accelerated     # or: reference
    python -m kvspec.conformance.port_server mutant          # the faithful spec port
    python -m kvspec.conformance.port_server mutant FAULT    # one of vector_mutants.FAULTS
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from kvspec.conformance.backend import Backend, load_backend
from kvspec.conformance.cache_scenarios import play
from kvspec.conformance.port_protocol import (
    AFFINE_OUTPUTS,
    TURBOQUANT_OUTPUTS,
    decode_array,
    encode_array,
)
from kvspec.conformance.vector_mutants import FAULTS, Port

Handler = Callable[[dict[str, Any]], dict[str, Any]]


def backend_handlers(backend: Backend) -> dict[str, Handler]:
    """The three operations on a conformance backend (reference, accelerated, a port's)."""
    affine, turboquant = backend.module("affine"), backend.module("turboquant")

    def as_backend(message: dict[str, Any]) -> Any:
        return backend.from_numpy(decode_array(message))

    def quantize(inputs: dict[str, Any]) -> dict[str, Any]:
        stored = affine.quantize(as_backend(inputs["w"]), inputs["groupSize"], inputs["bits"])
        return {name: backend.to_numpy(a) for name, a in zip(AFFINE_OUTPUTS, stored, strict=True)}

    def encode(inputs: dict[str, Any]) -> dict[str, Any]:
        k, v = as_backend(inputs["k"]), as_backend(inputs["v"])
        t = turboquant.encode(k, v, inputs["kBits"], inputs["vBits"])
        _, _, L, D = inputs["k"]["shape"]
        keys, values = turboquant.decode(t, L, D)
        _, rotated = turboquant.decode(t, L, D, defer_v=True)
        arrays = [*(getattr(t, name) for name in TURBOQUANT_OUTPUTS[:5]), keys, values, rotated]
        return {
            name: backend.to_numpy(a) for name, a in zip(TURBOQUANT_OUTPUTS, arrays, strict=True)
        }

    def run(inputs: dict[str, Any]) -> dict[str, Any]:
        caches = backend.module("caches")
        return {
            "outcomes": play(caches, backend.from_numpy, backend.to_numpy, inputs, inputs["steps"])
        }

    return {"affine.quantize": quantize, "turboquant.encode": encode, "cache.run": run}


def mutant_handlers(port: Port) -> dict[str, Handler]:
    """The codec operations of a vector_mutants.Port (it has no caches)."""

    def quantize(inputs: dict[str, Any]) -> dict[str, Any]:
        w = decode_array(inputs["w"])
        stored = port.affine_quantize(w, inputs["groupSize"], inputs["bits"])
        return dict(zip(AFFINE_OUTPUTS, stored, strict=True))

    def encode(inputs: dict[str, Any]) -> dict[str, Any]:
        k, v = decode_array(inputs["k"]), decode_array(inputs["v"])
        return port.turboquant(k, v, inputs["kBits"], inputs["vBits"])

    return {"affine.quantize": quantize, "turboquant.encode": encode}


def _encoded(outputs: dict[str, Any]) -> dict[str, Any]:
    return {
        name: encode_array(value) if hasattr(value, "dtype") else value
        for name, value in outputs.items()
    }


def serve(handlers: dict[str, Handler], requests: TextIO, responses: TextIO) -> None:
    """Answer each request line with one response line until the input ends."""
    for line in requests:
        request = json.loads(line)
        answer: dict[str, Any] = {"id": request["id"]}
        handler = handlers.get(request["op"])
        if handler is None:
            answer["unsupported"] = True
        else:
            try:
                answer["outputs"] = _encoded(handler(request["inputs"]))
            except ValueError as error:
                answer["error"] = str(error)
        responses.write(json.dumps(answer) + "\n")
        responses.flush()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("implementation", choices=["accelerated", "reference", "mutant"])
    parser.add_argument("fault", nargs="?", choices=sorted(FAULTS), help="mutant: its fault")
    args = parser.parse_args(argv)
    if args.implementation == "mutant":
        handlers = mutant_handlers(Port(args.fault))
    else:
        handlers = backend_handlers(load_backend(args.implementation))
    serve(handlers, sys.stdin, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
