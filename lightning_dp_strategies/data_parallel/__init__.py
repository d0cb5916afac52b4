"""The four steps of ``torch.nn.DataParallel.forward`` as pure functions: scatter, replicate, parallel_apply, gather.

They know nothing of Lightning. On CUDA they use the ``torch.nn.parallel`` primitives; on CPU the replicas are
*logical*: several modules on the one CPU device that share the root module's parameters, so the whole data flow
runs (and is tested) without a GPU::

    inputs ──scatter──▶ chunk 0 ─▶ replica 0 ─┐
      (dim 0, even      chunk 1 ─▶ replica 1 ─┼─parallel_apply (threads)──▶ outputs ──gather──▶ root device
       split ± 1)       chunk 2 ─▶ replica 2 ─┘                               (cat along dim 0)

Gradients need no averaging step: the replicas' parameters are differentiable aliases of the root parameters (CPU)
or differentiable broadcasts of them (CUDA), so autograd sums each replica's contribution into the root ``.grad``, in
replica order (bitwise the same sum in every run). A loss computed on
the gathered outputs is the loss of the whole batch, hence the gradients are the single-device gradients, also when
the batch does not split evenly.

One step per module, as in ``torch.nn.parallel`` (named apart from the functions they define, which the package
re-exports, so that neither hides the other):

- :mod:`.devices`: the devices replicas may run on (:func:`as_devices`).
- :mod:`.pytree`: the walk through nested containers that scatter and gather share.
- :mod:`.scatter_gather`: :func:`scatter` (with :func:`split_sizes`) and :func:`gather`.
- :mod:`.replicas`: :func:`replicate`, logical replicas on the CPU.
- :mod:`.apply`: :func:`parallel_apply` and the :class:`ThreadContext` it carries into the replicas' threads.
- :mod:`.forward`: :class:`ParallelForward`, the four steps as overridable methods a strategy inherits.
"""

from lightning_dp_strategies.data_parallel.apply import ThreadContext, parallel_apply
from lightning_dp_strategies.data_parallel.devices import as_devices
from lightning_dp_strategies.data_parallel.replicas import replicate
from lightning_dp_strategies.data_parallel.scatter_gather import gather, scatter, split_sizes

__all__ = [
    "ThreadContext",
    "as_devices",
    "gather",
    "parallel_apply",
    "replicate",
    "scatter",
    "split_sizes",
]
