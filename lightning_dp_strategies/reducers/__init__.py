"""The gradient-reduction contract (a bucket in, a future out) and the built-in reducers.

A reducer is a :class:`ReducerBase` subclass, or any callable ``reducer(bucket) -> torch.futures.Future`` (the
:class:`Reducer` protocol, the shape of torch DDP's communication hooks; :func:`as_reducer` adapts it). It must leave
``bucket.buffer`` holding the average (``bucket.op == "avg"``) or the sum (``"sum"``) of every rank's buffer over
``bucket.group`` by the time the future completes, add what it sent to ``bucket.counter``, and be called in the same
order on every rank (:class:`~lightning_dp_strategies.bucketing.GradientBuckets` guarantees that: buckets launch
strictly in index order). :class:`ReducerBase` declares the optional steps, each doing nothing by default: a reducer
that needs process groups of its own (a second connection, a hierarchy's intra- and inter-node groups) makes them in
``setup`` (see :func:`setup_reducer`) and releases them in ``close``; ``observe_step`` sees every optimizer step's
timing; ``hands_raw_gradients``, ``scatters`` and ``failure_hint`` tell the buckets how to treat it. The strategies'
buckets ask for ``"sum"``: every gradient is divided by the world size on its way into the bucket (fused into that
copy, as torch DDP does), so the sum is the average; ``"avg"`` is for direct callers. Compression wraps a reducer
(:class:`ReducerWrapper` hands every optional step to the wrapped one): the casts
(:mod:`~lightning_dp_strategies.reducers.casts`) and PowerSGD (:mod:`~lightning_dp_strategies.reducers.powersgd`);
torch's DDP communication hooks run through an adapter (:mod:`~lightning_dp_strategies.reducers.comm_hooks`).

==============  ==============================================================  ==========================
name            what it does                                                    runs on
==============  ==============================================================  ==========================
``ring``        this package's ring all-reduce (reduce-scatter + all-gather)    a communication thread
``native``      the backend's ``all_reduce`` (gloo's ring, NCCL's ring/tree)     the backend's own threads
``per_tensor``  one blocking ``all_reduce`` per gradient: the naive reference   the caller (blocks backward)
``int8``        8 bits a value with a scale a block, summed in fp32 (lossy)     the caller
``int4``        4 bits a value with a scale a block, summed in fp32 (lossy)     the caller
==============  ==============================================================  ==========================


Compression wrappers, and what goes over the wire per rank with N ranks and a ring inner reducer:

====================  ===============================================  ==========================================
wrapper               payload                                          exact?
====================  ===============================================  ==========================================
none                  the fp32 bucket                                  yes (to summation order)
``fp16_compress``     half the bytes                                   fp16 rounding: about 1e-3 relative
``bf16_compress``     half the bytes                                   bf16 rounding: about 1e-2 relative
``PowerSGD(rank=r)``  ``r(n + m)`` per ``n x m`` matrix, the rest fp32  low-rank; error feedback keeps what is lost
====================  ===============================================  ==========================================
"""

import functools

from lightning_dp_strategies.reducers.auto import AutoDecision, AutoReducer
from lightning_dp_strategies.reducers.base import (
    CallableReducer,
    GradBucket,
    ReduceKind,
    Reducer,
    ReducerBase,
    ReducerWrapper,
    StepTiming,
    as_reducer,
    close_reducer,
    completed,
    set_event as set_event,
    setup_reducer,
    views as views,
)
from lightning_dp_strategies.reducers.builtin import (
    REDUCERS,
    NativeReducer,
    PerTensorReducer,
    RingReducer,
    check_reducer,
    resolve_reducer,
)
from lightning_dp_strategies.reducers.calibrate import calibrate_cpu
from lightning_dp_strategies.reducers.casts import CastCompression, bf16_compress, fp16_compress
from lightning_dp_strategies.reducers.comm_hooks import (
    CommHook,
    CommHookReducer,
    HookBucket,
    check_comm_hook,
    hook_name,
    make_reducer,
)
from lightning_dp_strategies.reducers.powersgd import PowerSGD
from lightning_dp_strategies.reducers.quantized import QuantizedReducer
from lightning_dp_strategies.reducers.scatter import ScatterReducer
from lightning_dp_strategies.reducers.thread import CommThread as CommThread
from lightning_dp_strategies.reducers.two_level import TwoLevelReducer

REDUCERS["auto"] = AutoReducer  # built on the others, so named here rather than beside them
REDUCERS["int8"] = functools.partial(QuantizedReducer, 8)
REDUCERS["int4"] = functools.partial(QuantizedReducer, 4)

__all__ = [
    "REDUCERS",
    "AutoDecision",
    "AutoReducer",
    "CallableReducer",
    "CastCompression",
    "CommHook",
    "CommHookReducer",
    "GradBucket",
    "HookBucket",
    "NativeReducer",
    "PerTensorReducer",
    "PowerSGD",
    "QuantizedReducer",
    "ReduceKind",
    "Reducer",
    "ReducerBase",
    "ReducerWrapper",
    "RingReducer",
    "ScatterReducer",
    "StepTiming",
    "TwoLevelReducer",
    "as_reducer",
    "bf16_compress",
    "calibrate_cpu",
    "check_comm_hook",
    "check_reducer",
    "close_reducer",
    "completed",
    "fp16_compress",
    "hook_name",
    "make_reducer",
    "resolve_reducer",
    "setup_reducer",
]
