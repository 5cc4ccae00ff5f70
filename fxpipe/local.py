"""The single-process reference executor: run a split model's stages in order.

``run_local`` binds ``passes.comm.ConnectedTransport`` (a received tensor *is*
the sent tensor), so autograd runs through all stages and ``loss.backward()``
fills every stage's gradients, as one model would. It is what tests compare
with the unsplit model and what the pipeline runtime is compared with.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from passes import comm

if TYPE_CHECKING:
    from fxpipe.split_model import SplitModel


def run_local(split_model: "SplitModel", *inputs: Any, **kwargs: Any) -> Any:
    """Run every stage in order on one minibatch; return what the original returns.

    ``inputs`` (and ``kwargs``, for exported models that take them) are the
    original model's inputs. Parameters are the stages' own (shared with the
    original model in-process), so gradients land on them.
    """
    flat = split_model.flatten_inputs(inputs, kwargs)
    transport = comm.ConnectedTransport()
    outputs = None
    with comm.bind(transport):
        for stage, wanted in zip(split_model.stages, split_model.stage_inputs):
            outputs, _tokens = stage(*[flat[i] for i in wanted])
    return split_model.unflatten_outputs(outputs)
