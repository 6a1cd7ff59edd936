"""What a Keras checkpoint keeps beside the weights: every RNG stream the backend draws from, as
plain JSON values. Imports no framework: Keras when called, TensorFlow's internals only where the
program loaded TensorFlow, torch's streams (`steadytrain.device.rng`) only where torch is loaded."""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np

from steadytrain.errors import RNGStateError


def seed_generators(model) -> list:
    """The model's `keras.random.SeedGenerator`s (Dropout's, a layer's own), in layer order."""
    found, seen = [], set()
    for layer in model._flatten_layers(include_self=True, recursive=True):
        for generator in getattr(layer, "_seed_generators", ()):
            if id(generator) not in seen:
                seen.add(id(generator))
                found.append(generator)
    return found


def rng_state(model) -> dict[str, Any]:
    """Every stream the run draws from: Python's and numpy's (with torch's, CUDA's and MPS's
    where torch is loaded), Keras's seed generators (the model's and the global one), and
    TensorFlow's global generator and op seeds where TensorFlow is loaded."""
    import keras
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR

    if "torch" in sys.modules:
        from steadytrain.device.rng import get_rng_state

        rng = get_rng_state()
    else:
        rng = {"python": random.getstate(), "numpy": np.random.get_state()}
    seeds = [keras.ops.convert_to_numpy(g.state) for g in seed_generators(model)]
    shared = global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)
    return {
        "rng": rng,
        "keras_seeds": seeds,
        "keras_global_seed": (None if shared is None else keras.ops.convert_to_numpy(shared.state)),
        "tensorflow": _tensorflow_rng(),
    }


def set_rng_state(model, state: dict[str, Any]) -> None:
    """Restore `_rng_state`; a checkpoint written before the Keras streams were saved restores
    the streams it has."""
    from keras.src.random.seed_generator import global_seed_generator

    rng = state["rng"]
    if "torch" in rng:
        from steadytrain.device.rng import set_rng_state

        set_rng_state(rng)
    else:
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
    seeds = state.get("keras_seeds") or ()
    generators = seed_generators(model)
    if seeds and len(seeds) != len(generators):
        raise RNGStateError(
            f"RNG state: the checkpoint holds {len(seeds)} Keras seed generator state(s) but the "
            f"model has {len(generators)}: resume with the model that saved it, or start the run "
            "afresh (a new run_dir) to accept different random draws."
        )
    for generator, value in zip(generators, seeds, strict=False):
        generator.state.assign(np.asarray(value).astype(generator.state.dtype))
    if state.get("keras_global_seed") is not None:
        shared = global_seed_generator()
        shared.state.assign(np.asarray(state["keras_global_seed"]).astype(shared.state.dtype))
    if state.get("tensorflow"):
        _set_tensorflow_rng(state["tensorflow"])


def _tensorflow_rng() -> dict[str, Any] | None:
    """TensorFlow's own streams, where the program loaded it (never imported here): the global
    ``tf.random.Generator`` once made, and the op seeds unseeded ``tf.random`` ops draw."""
    if "tensorflow" not in sys.modules:
        return None
    from tensorflow.python.eager import context
    from tensorflow.python.ops import stateful_random_ops

    state: dict[str, Any] = {}
    ops = getattr(context.context(), "_rng", None)
    if ops is not None:
        state["op_seeds"] = ops.getstate()
    generator = stateful_random_ops.global_generator
    if generator is not None:
        state["generator"] = generator.state.numpy()
    return state


def _set_tensorflow_rng(state: dict[str, Any]) -> None:
    import tensorflow as tf  # the checkpoint has TensorFlow's streams: the run uses it
    from tensorflow.python.eager import context

    if "op_seeds" in state:
        ctx = context.context()
        if getattr(ctx, "_rng", None) is None:
            ctx._rng = random.Random()
        ctx._rng.setstate(state["op_seeds"])
    if "generator" in state:
        tf.random.get_global_generator().reset(np.asarray(state["generator"]))


def plain(value: Any) -> Any:
    """JSON-ready: numpy arrays and tensors as lists (the RNG streams, fit's params)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "tolist"):
        return {"__array__": value.tolist(), "dtype": str(value.dtype)}
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def unplain(value: Any) -> Any:
    if isinstance(value, dict) and "__array__" in value:
        dtype = value["dtype"]
        if dtype.startswith("torch."):  # saved where torch was loaded
            import torch

            return torch.tensor(value["__array__"], dtype=getattr(torch, dtype[6:]))
        return np.asarray(value["__array__"], dtype=dtype)
    if isinstance(value, dict):
        return {k: unplain(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(unplain(v) for v in value)
    return value
