"""`bnaudit parity --against compile[:BACKEND]`: the model under torch.compile, every BN layer's
output made visible.

torch.compile hands each graph Dynamo captures to a backend, `fn(gm, example_inputs) ->
callable`. A wrapping backend stands between them: in the captured FX graph it finds each
batch-norm call (`bnaudit.normkinds`'s table: `F.batch_norm`, `torch.batch_norm`, the aten
operators, or a call of a BatchNorm module left whole), names its layer by the storage of the
statistics it reads (the layer's own running_mean, a graph input or attribute that is the
module's buffer), adds the call's result to the graph's outputs and hands that graph to the
chosen backend. The compiled callable's extra outputs are the layers' outputs; the model
sees only its own.

Why visible outputs rather than a bisection over compiled prefixes: a value that is also a
graph output is computed by the same operations; the backend may no longer fuse it away into
its consumer's kernel, but a pointwise fusion (BN with the ReLU after it) still computes the
BN arithmetic the same way, and a pass that folds BN into the convolution before it moves the
output onto the folded convolution, which is what is read then. Measured on inductor (CPU):
the final outputs with the layers visible are bit-identical to plain `torch.compile`'s. A
bisection would compile one graph per prefix (inductor takes tens of seconds per graph) and
compare final outputs only.

After the backend returns, the graph is read again: a backend that rewrote the batch-norm
call in place (a pass that changes its eps, or switches it to training) leaves its arguments
there, and they are compared with the model's own (`static`).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from bnaudit.errors import BnauditError
from bnaudit.normkinds import NormKind, op_kind
from bnaudit.runtime.models import import_callable
from bnaudit.runtime.norms import batchnorm_modules, is_batchnorm, is_script
from bnaudit.runtime.sites import layer_storages
from bnaudit.text import exception_line, listing

DEFAULT_BACKEND = "inductor"


def resolve_backend(backend: str) -> Callable[..., Any]:
    """A registered torch.compile backend by name, or FILE.py:fn / MODULE:fn, a backend
    function fn(gm, example_inputs) -> callable; one line when there is none."""
    import torch._dynamo

    if ":" in backend:
        return import_callable(backend, "--against", shown=f"--against compile:{backend}")
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise BnauditError(
            f"--against compile:{backend}: no torch.compile backend of that name (registered: {listing(known, 8)}; "
            "or give FILE.py:fn, a function fn(gm, example_inputs) -> callable)"
        )
    found: Callable[..., Any] = torch._dynamo.lookup_backend(backend)
    return found


def _call_name(target: Any) -> str:
    """The operator name an FX call_function target goes by in bnaudit.normkinds."""
    name = getattr(target, "name", None)
    if callable(name) and hasattr(target, "overloadpacket"):  # an aten OpOverload
        return str(name())
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__name__', '')}" if module else str(getattr(target, "__name__", target))


def _storage(value: Any) -> int | None:
    try:
        return int(value.data_ptr()) if isinstance(value, torch.Tensor) else None
    except Exception:  # a fake or meta tensor has no storage to name
        return None


def _stack_name(node: Any, layers: Mapping[str, Any]) -> str | None:
    """The layer Dynamo's `nn_module_stack` says the node belongs to (innermost module)."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _cls in reversed(list(stack.values())):
        name = str(path)
        for prefix in ("L['self'].", "L__self__.", "self."):
            name = name.removeprefix(prefix)
        if name in layers:
            return name
    return None


def _bound(node: Any) -> dict[str, Any]:
    """The batch-norm call's `training` and `eps` arguments as the graph holds them."""
    target = node.target
    if target is torch.nn.functional.batch_norm:
        try:
            bound = inspect.signature(target).bind(*node.args, **node.kwargs)
        except TypeError:
            return {}
        bound.apply_defaults()
        return {"training": bound.arguments.get("training"), "eps": bound.arguments.get("eps")}
    # torch.batch_norm and the aten operators: (input, weight, bias, mean, var, training, momentum, eps)
    args = list(node.args)
    return {"training": args[5] if len(args) > 5 else None, "eps": args[7] if len(args) > 7 else None}


class CompiledTarget:
    """A copy of the eager model under torch.compile with `backend` (a name or FILE.py:fn)."""

    def __init__(self, model: Any, backend: str, device: Any) -> None:
        import torch._dynamo

        self.backend = backend
        if is_script(model):
            raise BnauditError(
                f"--against compile:{backend}: the checkpoint is a TorchScript module, which torch.compile does not "
                "compile: pass the state dict with --arch (the eager model)"
            )
        self.inner = resolve_backend(backend)
        self.model = copy.deepcopy(model).to(device).eval()
        self.layers = batchnorm_modules(self.model)
        self.storages = layer_storages(self.model, self.layers)
        self.values: dict[str, list[Any]] = {}
        self.static: dict[str, tuple[str, ...]] = {}
        self.graphs = 0
        torch._dynamo.reset()  # no graph compiled for another module or backend is reused
        self.compiled = torch.compile(self.model, backend=self._wrap)

    def _layer(self, node: Any, inputs: Mapping[Any, Any], gm: Any) -> str | None:
        for arg in [*node.args, *node.kwargs.values()]:
            if not isinstance(arg, torch.fx.Node):
                continue
            value = inputs.get(arg)
            if arg.op == "get_attr":
                try:
                    value = gm.get_parameter(str(arg.target))
                except AttributeError:
                    try:
                        value = gm.get_buffer(str(arg.target))
                    except AttributeError:
                        value = None
            name = self.storages.get(_storage(value) or -1)
            if name is not None:
                return name
        return _stack_name(node, self.layers)

    def _sites(self, gm: Any, example_inputs: list[Any]) -> list[tuple[str, Any]]:
        """(layer, node) of every batch-norm call of `gm`, in graph order."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        inputs = dict(zip(placeholders, example_inputs))
        found = []
        for node in gm.graph.nodes:
            if node.op == "call_function" and op_kind(_call_name(node.target)) is NormKind.BATCH_NORM:
                value = node.meta.get("example_value")
                if value is not None and not isinstance(value, torch.Tensor):
                    continue  # an operator returning a tuple: its first element is another node
                name = self._layer(node, inputs, gm)
            elif node.op == "call_module" and is_batchnorm(gm.get_submodule(str(node.target))):
                name = self._layer(node, inputs, gm) or _stack_name(node, self.layers) or str(node.target)
            else:
                continue
            if name is not None:
                found.append((name, node))
        return found

    def _wrap(self, gm: Any, example_inputs: list[Any]) -> Callable[..., Any]:
        sites = self._sites(gm, example_inputs)
        output = gm.graph.output_node()
        own = output.args[0]
        single = not isinstance(own, (tuple, list))
        own_outputs = (own,) if single else tuple(own)
        output.args = (own_outputs + tuple(node for _, node in sites),)
        gm.recompile()
        compiled = self.inner(gm, example_inputs)
        self._read_graph(sites)
        self.graphs += 1
        count = len(own_outputs)
        names = [name for name, _ in sites]

        def run(*args: Any) -> Any:
            results = compiled(*args)
            for name, value in zip(names, results[count:]):
                self.values.setdefault(name, []).append(value)
            kept = results[:count]
            return kept[0] if single else type(own)(kept) if isinstance(own, tuple) else list(kept)

        return run

    def _read_graph(self, sites: list[tuple[str, Any]]) -> None:
        """What the graph holds at each site after the backend had it (module docstring)."""
        for name, node in sites:
            module = self.layers.get(name)
            if module is None or node.op != "call_function":
                continue
            held = _bound(node)
            words = []
            eps = held.get("eps")
            if isinstance(eps, (int, float)) and float(torch.tensor(eps, dtype=torch.float32)) != float(
                torch.tensor(module.eps, dtype=torch.float32)
            ):
                words.append(f"eps {eps:.3g} in the compiled graph, {module.eps:.3g} in the model")
            if held.get("training") is True:
                words.append("the compiled graph calls it in training mode (batch statistics)")
            if words:
                self.static[name] = tuple(words)

    def run(self, inputs: Any, forward: Callable[[Any, Any], Any]) -> tuple[Any, dict[str, list[Any]]]:
        """The compiled model's output on one batch, and each layer's outputs (every call)."""
        self.values = {}
        try:
            out = forward(self.compiled, inputs)
        except BnauditError:
            raise
        except Exception as exc:
            inner = getattr(exc, "inner_exception", None)
            if inner is not None:  # Dynamo's BackendCompilerFailed: the backend's own error
                raise BnauditError(
                    f"--against compile:{self.backend}: the backend failed: {exception_line(inner)}"
                ) from None
            raise BnauditError(
                f"--against compile:{self.backend}: the compiled model failed: {exception_line(exc)}"
            ) from None
        return out, self.values
