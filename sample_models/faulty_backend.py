"""A torch.compile backend with a bug of the kind parity finds: it runs the graph Dynamo hands
it with the second batch-norm call's eps changed to 1e-2 (a constant-folding pass that
picked up another eps would do the same).

Use it with `bnaudit parity ... --against compile:sample_models/faulty_backend.py:faulty`.
A backend is a function fn(gm, example_inputs) -> callable (torch.compile's contract); this
one returns the graph's own code, run eagerly.
"""

from __future__ import annotations

from torch.nn import functional as F


def faulty(gm, example_inputs):
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is F.batch_norm]
    if len(calls) > 1:
        node = calls[1]
        # F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
        node.args = (*node.args[:7], 1e-2)
        gm.recompile()
    return gm.forward
