"""ONNX Runtime sessions for the models that share the machine's few cores with the other engines."""

import onnxruntime as ort


def shared_cpu_options(threads: int = 0) -> ort.SessionOptions:
    """Session options for a model that runs beside the other engines: `threads` intra-op threads
    (0: one per core) that sleep when they run out of work instead of spinning.

    By default onnxruntime's threads spin-wait between operators. On 2 cores, beside the LLM
    decoding on the other core, that spinning took Piper's first sentence ("The capital of
    France", 1.4 s of audio) from 76 ms alone to 173 ms; without it, 91 ms alone and 114 ms beside
    the LLM.
    """
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def session(model: str, *, threads: int = 0, providers=("CPUExecutionProvider",)) -> ort.InferenceSession:
    """`model` loaded with shared_cpu_options(threads), on `providers`."""
    return ort.InferenceSession(model, sess_options=shared_cpu_options(threads), providers=list(providers))
