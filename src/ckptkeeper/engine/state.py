"""Turning a training state into checkpoint content and back.

A state is split into two trees with the same keys: the tensors (written in stock DCP format)
and everything else (plain JSON: optimizer hyper-parameters, counters, user state). Loading
rebuilds the full state from both, so nothing in a checkpoint is ever unpickled.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import importlib.util
import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import FunctionType
from typing import Any, NamedTuple, Protocol, cast, runtime_checkable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from ..errors import CheckpointMismatchError, ConfigurationError, CorruptCheckpointError
from .gcpause import paused_gc

__all__ = [
    "CheckpointMismatchError",
    "LoadPlan",
    "LoadReport",
    "SavedTensor",
    "Stateful",
    "TrainingState",
    "capture_to_write",
    "detached_tree",
    "flatten_tensors",
    "merge_trees",
    "split_tensors",
    "state_digest",
    "to_json_tree",
]

log = logging.getLogger(__name__)


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()`` (schedulers, data loaders, counters)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def memory_shortfall(t: torch.Tensor) -> tuple[int, int] | None:
    """``(bytes t reaches into its storage, bytes the storage holds)`` when the first is more:
    its storage was resized under it (as FSDP2 does to the parameters it has unsharded), so its
    memory ends before its values do. None for a tensor whose memory is all there.

    Reading such a tensor's memory (a raw write, ``copy_``, ``contiguous()``) crashed the process
    (a storage resized to 0) or read whatever lay past its end, which the checksums then vouched
    for; writing into it (a load) corrupted the heap. Torch checks this only where a view is made.
    """
    try:
        # Asked per tensor per async save (before staging): the contiguous case in five calls.
        if t.is_contiguous():
            need = t.storage_offset() * t.itemsize + t.nbytes
            have = t.untyped_storage().nbytes()
            if need <= have or t.nbytes == 0 or t.is_meta:
                return None
            return int(need), have
        n = t.numel()
        if n == 0 or t.is_meta:
            return None
        last = t.storage_offset() + 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
        have = t.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):
        # No plain storage (sparse), or a wrapper that answers none of this (FSDP1's
        # ShardedTensor): not read as raw memory here; refused where it would be written.
        return None
    need = int(last) * t.element_size()
    return (need, have) if need > have else None


def refuse_short_memory(name: str, t: torch.Tensor) -> None:
    """Raise :func:`short_memory_error` for ``t`` (a DTensor's local shard) when its memory is
    shorter than its shape (:func:`memory_shortfall`)."""
    short = memory_shortfall(t._local_tensor if isinstance(t, DTensor) else t)
    if short is not None:
        raise short_memory_error(name, *short)


def unloadable(local: Any) -> str | None:
    """Why a load cannot read values into ``local`` (a tensor, or a DTensor's local shard) in
    place, or None: it is sparse (any layout) or otherwise not strided, nested, or its elements
    overlap in memory (``expand()``, ``unfold()``, ``as_strided()`` views). Torch's own words for
    those name no tensor, a nested one's ("Internal error ... Please file an issue") blames
    torch, an expanded one's came after the load had begun (its undo then failed on it too), and
    an unfolded one loaded without a word, each value written over its neighbours' (found by
    outside attacks)."""
    try:
        nested, layout = local.is_nested, local.layout
    except (NotImplementedError, RuntimeError):
        return None  # a wrapper that answers none of this (FSDP1's ShardedTensor): DCP's reader loads it
    if nested or layout is not torch.strided:
        kind = "nested" if nested else str(layout).removeprefix("torch.")
        return (
            f"it is a {kind} tensor, and a load reads values into plain (dense, strided) tensors in place; make "
            "it a plain tensor before loading (e.g. to_dense(), or a torch.empty of its shape) and convert it after"
        )
    # A contiguous tensor's elements are all its own; the usual case stops at that one question.
    if not local.is_contiguous() and _may_overlap(local.shape, local.stride()):
        return (
            "its elements overlap in memory (a view made by expand(), unfold() or as_strided()), so they cannot "
            "each take a value; give it memory of its own first (clone()), then load"
        )
    return None


def _nested(t: Any) -> bool:
    try:
        return bool(t.is_nested)
    except (NotImplementedError, RuntimeError):  # FSDP1's ShardedTensor answers nothing
        return False


def _may_overlap(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether two elements of a strided tensor may share an address: taken by growing stride,
    each dimension's step must pass the farthest element the smaller ones reach. Sufficient for
    no overlap, not necessary: an exotic interleaving as_strided() view is taken to overlap (and
    refused with the fix, clone()), never the other way round. Torch's own check
    (``has_internal_overlap``) finds only zero strides."""
    reach = 0
    for st, n in sorted((st, n) for n, st in zip(shape, stride, strict=True) if n > 1):
        if st <= reach:
            return True
        reach += (n - 1) * st
    return False


def refuse_unloadable(name: str, local: Any) -> None:
    """Raise :class:`ConfigurationError` naming ``name`` when :func:`unloadable` finds why
    ``local`` cannot be read into in place."""
    why = unloadable(local)
    if why is not None:
        raise ConfigurationError(f"cannot load into {name[:200]}: {why}")


def short_memory_error(name: str, need: int, have: int) -> ConfigurationError:
    """The error for a tensor :func:`memory_shortfall` found short, naming it."""
    return ConfigurationError(
        f"{name} reaches {need} bytes into its storage, which holds {have}: the storage was resized under "
        "the tensor (as FSDP2 does to the parameters it has unsharded, or untyped_storage().resize_()); "
        "save or load with every tensor's memory in place (with FSDP2, outside forward and backward)"
    )


def to_json_tree(value: Any, where: str = "state") -> Any:
    """``value`` as plain JSON types (tuples become lists); ConfigurationError names what cannot be stored."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [to_json_tree(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        return {str(k): to_json_tree(v, f"{where}.{k}") for k, v in value.items()}
    raise ConfigurationError(
        f"{where} holds a {type(value).__name__}, which a checkpoint cannot store without pickle; "
        "return tensors, numbers, strings, lists or dicts from state_dict()"
    )


def split_tensors(tree: Mapping[str, Any], where: str = "state") -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a nested dict into (tensor leaves, JSON leaves), each keeping the nesting."""
    tensors: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in tree.items():
        k = str(key)
        if _is_tensor(value):
            tensors[k] = value
        elif isinstance(value, Mapping):
            t, r = split_tensors(value, f"{where}.{k}")
            if t:
                tensors[k] = t
            rest[k] = r
        else:
            if isinstance(value, (list, tuple)) and any(_is_tensor(v) for v in value):
                raise ConfigurationError(
                    f"{where}.{k} is a list holding tensors, which a checkpoint cannot store yet (an optimizer "
                    "keeping lists of tensors, such as LBFGS, is not supported); put tensors in a dict with string keys"
                )
            rest[k] = to_json_tree(value, f"{where}.{k}")
    return tensors, rest


def merge_trees(rest: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`split_tensors`."""
    out: dict[str, Any] = dict(rest)
    for key, value in tensors.items():
        if isinstance(value, Mapping):
            out[key] = merge_trees(rest.get(key, {}) or {}, value)
        else:
            out[key] = value
    return out


def flatten_tensors(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted path, tensor) for every tensor leaf, in insertion order."""
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flatten_tensors(value, path + ".")
        elif _is_tensor(value):
            yield path, value


class SavedTensor(NamedTuple):
    """What a checkpoint says about one tensor: its global shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None


@dataclass(frozen=True)
class LoadReport:
    """What a load did not take over one-to-one (``TrainingState.load_report`` after each load).

    Keys are checkpoint keys: ``model.<fqn>``, ``optim.state.<fqn>.<slot>``,
    ``optim.param_groups.<i>``, ``extra.<name>``. With ``strict=True`` a load only succeeds when all
    three lists are empty.
    """

    missing_keys: list[str] = field(default_factory=list)
    """In this state but not in the checkpoint: left as they were."""
    unexpected_keys: list[str] = field(default_factory=list)
    """In the checkpoint but not in this state: not loaded."""
    mismatched_keys: list[str] = field(default_factory=list)
    """In both, with another shape: left as they were (the warning and error name both shapes)."""


@dataclass
class LoadPlan:
    """Where a load reads each tensor to, and what it applies afterwards (see :meth:`TrainingState.plan_load`)."""

    tensors: dict[str, Any]
    """Every destination tensor, nested like :meth:`TrainingState.capture`'s tensor tree."""
    live: dict[str, Any]
    """The destinations that are live state (parameters, buffers): back them up before reading."""
    meta: dict[str, Any]
    """The JSON tree applied together with ``tensors``."""
    report: LoadReport
    same_dtypes: bool
    """Whether every destination has the checkpoint's dtype (the fast reader needs it)."""
    generic: bool = False
    """A subclass with its own capture()/restore() (or an FSDP1 model): restore() applies it."""
    undo: dict[str, Any] = field(default_factory=dict)
    """What :meth:`TrainingState.undo_load` puts back after a failed apply."""
    flat: list[FlatLeaf] | None = None
    """Every leaf of ``tensors`` as (dotted checkpoint key, tensor, twin), made while planning; None
    when not made (readers then walk ``tensors``). Walking the tree again cost a readers' planning a
    tenth of its time at 10,000 tensors: a path tuple and a joined name per leaf. See
    :data:`FlatLeaf` for the twin."""


FlatLeaf = tuple[str, torch.Tensor, Any]
"""A leaf of :attr:`LoadPlan.flat`: (dotted checkpoint key, tensor, twin). The twin says what the
plan knows of a tensor it made itself, so that a reader need not look at it again (each look at a
tensor's facts is a Python call, and the plan makes two of every three tensors of an AdamW state):

- the parameter it was made from (an optimizer slot of the parameter's shape): it has the
  checkpoint's dtype, and the parameter's device, layout, strides and sharding spec, so it can be
  read however the parameter can;
- :data:`MADE_PLAIN`: a new contiguous CPU tensor of the checkpoint's shape and dtype, neither
  sparse nor quantized (``torch.empty`` on the CPU, for a dtype that is not a quantized one);
- None: nothing is known (a live tensor, or one made otherwise): a reader looks at it.

A twin other than None also says the tensor is new memory the plan allocated, which shares no
byte with any other destination.
"""

MADE_PLAIN: Any = object()
"""The twin of a tensor the plan made with ``torch.empty`` (see :data:`FlatLeaf`)."""


def _leaves(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _leaves(value, (*prefix, str(key)))
        elif _is_tensor(value):
            yield (*prefix, str(key)), value


def _put(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _split_rest(node: Any, rest: str) -> tuple[str, ...]:
    """A dotted checkpoint key below ``node`` as a path, following the dicts the JSON tree has.

    The JSON tree keeps every dict of the saved state (even one holding only tensors), so a key
    ``a.b.c`` is ``{"a": {"b.c": t}}`` when the saved state had a dict ``a``, else ``{"a.b.c": t}``.
    """
    if "." not in rest:
        return (rest,)  # an optimizer slot's usual name ("exp_avg", "step"): nothing to follow
    parts = rest.split(".")
    path: list[str] = []
    i = 0
    while i < len(parts) - 1 and isinstance(node, Mapping):
        for j in range(len(parts) - 1, i, -1):
            key = ".".join(parts[i:j])
            if isinstance(node.get(key), Mapping):
                path.append(key)
                node, i = node[key], j
                break
        else:
            break
    path.append(".".join(parts[i:]))
    return tuple(path)


def _owner(rest: str, names: Mapping[str, Any] | set[str]) -> str | None:
    """The longest ``name`` with ``rest == name + "." + something`` (parameter names hold dots)."""
    end = len(rest)
    while (end := rest.rfind(".", 0, end)) > 0:
        if rest[:end] in names:
            return rest[:end]
    return None


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)  # a DTensor's shape is the global one, as DCP's metadata records


_NAMES: weakref.WeakKeyDictionary[nn.Module, tuple[list[tuple[str, Any, type]], dict[str, str]]] = (
    weakref.WeakKeyDictionary()
)


def _names_of(model: nn.Module) -> dict[str, str] | None:
    """The checkpoint names kept for ``model``'s names, while each of its modules is the same
    object of the same class under the same name (a name's answer depends on the module at each
    part of it: a DDP or compiled one drops its part). None: nothing may be kept for this model
    (a module's ``_fqn_modifiers()`` can change its answers with no module changing)."""
    modules = list(model.named_modules(remove_duplicate=False))
    if any(hasattr(type(m), "_fqn_modifiers") or "_fqn_modifiers" in m.__dict__ for _, m in modules):
        return None
    kept = _NAMES.get(model)
    # Weak references: the entry must not keep the model (its own key) or a swapped-out module
    # alive, and a dead one never compares equal to a new module at the same address.
    if (
        kept is None
        or len(kept[0]) != len(modules)
        or any(
            name != n or ref() is not m or cls is not type(m)
            for (name, ref, cls), (n, m) in zip(kept[0], modules, strict=True)
        )
    ):
        paths = _plain_paths(model)
        same: dict[str, str] = {} if paths is None else _SameNames(paths)
        kept = _NAMES[model] = ([(n, weakref.ref(m), type(m)) for n, m in modules], same)
    return kept[1]


class _SameNames(dict[str, str]):
    """The kept names of a model where no module drops its part of a name (see
    :func:`_plain_paths`): the names in ``paths`` are their own checkpoint names, unless they hold
    activation checkpointing's part; :func:`_canonical_fqn` asks DCP about every other name."""

    def __init__(self, paths: frozenset[str]) -> None:
        super().__init__()
        self.paths = paths


def _plain_paths(model: nn.Module) -> frozenset[str] | None:
    """The attribute paths of ``model``'s parameters and buffers, when DCP's name helper would give
    each back as it is: no module is DDP, FSDP1 or compiled (the helper drops their parts) or has
    ``_fqn_modifiers`` (even through ``__getattr__``), and no key holds a dot (the helper splits
    names on dots). The modules are walked through their own ``_modules``, not ``named_modules()``,
    which a module may replace with a list that leaves one of those out (found by an outside
    attack). None otherwise: every name is asked of the helper, as before."""
    renamers = _renaming_kinds()
    if not renamers:
        return None
    paths: set[str] = set()
    stack: list[tuple[str, nn.Module]] = [("", model)]
    visits = 0
    while stack:
        prefix, m = stack.pop()
        visits += 1
        if visits > 1 << 20:
            return None  # (a module graph with a cycle: nothing is taken for granted)
        if isinstance(m, renamers) or hasattr(m, "_fqn_modifiers"):
            return None
        for key in (*m._parameters, *m._buffers, *m._modules):
            if "." in key:
                return None
        paths.update(f"{prefix}{key}" for key in (*m._parameters, *m._buffers))
        stack.extend((f"{prefix}{key}.", c) for key, c in m._modules.items() if c is not None)
    return frozenset(paths)


def _renaming_kinds() -> tuple[type, ...]:
    # The module classes DCP's name helper drops a part of a name for, as it imports them; ()
    # when torch moved any (every name is then asked of the helper, as before).
    try:
        from torch._dynamo.eval_frame import OptimizedModule
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.nn.parallel import DistributedDataParallel

        return (DistributedDataParallel, FullyShardedDataParallel, OptimizedModule)
    except (ImportError, AttributeError):  # pragma: no cover - torch moved its private names
        return ()


def _canonical_fqn(model: nn.Module, name: str, names: dict[str, str] | None = None) -> str:
    # DCP names parameters without wrapper prefixes (torch.compile's _orig_mod, activation
    # checkpointing, DDP's module); the optimizer's keys must match the model's, so ask DCP's own
    # helper. It walks the modules along the name (a getattr per part, ~30 us a name), so the
    # answers are kept (``names``, from :func:`_names_of`) while the modules stay the same.
    found = names.get(name) if names is not None else None
    if found is not None:
        return found
    if type(names) is _SameNames and name in names.paths and _CHECKPOINT_PART not in name:
        # No module on any path renames (a walk of thousands of names cost a fresh model's
        # load 18 ms of its 250 ms of CPU at 2,500 parameters).
        return name
    try:
        from torch.distributed.checkpoint.state_dict import _get_fqns
    except ImportError:  # pragma: no cover - torch moved its private helper
        return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
    fqns = _get_fqns(model, name)
    if len(fqns) != 1:  # pragma: no cover - FSDP1 flat parameters take the DCP route instead
        raise ConfigurationError(f"parameter {name} stands for {len(fqns)} parameters; ckptkeeper cannot key it")
    found = next(iter(fqns))
    if names is not None:
        names[name] = found
    return found


_UNSET: Any = object()
_CHECKPOINT_PART = "_checkpoint_wrapped_module"
"""Activation checkpointing's part of a name (DCP drops it; ``_CHECKPOINT_PREFIX`` there)."""


def _param_fqns(model: nn.Module, names: dict[str, str] | None = _UNSET) -> dict[int, str]:
    """Each parameter of ``model`` (tied ones once, as DCP does) with its checkpoint name, by the
    parameter's ``id`` (the caller holds the model, so the ids stay its parameters').

    The names ``named_parameters()`` gives, in its order, from a walk over the modules' own dicts:
    its generator per module and a Python-level tensor hash per parameter cost as much as the
    rest of an optimizer's capture at thousands of parameters. ``names``: :func:`_names_of`'s
    answer when the caller has it already.
    """
    if names is _UNSET:
        names = _names_of(model)
    walked = None if _own_walk(model, ("named_parameters", "parameters", "_named_members")) else _walk_params(model)
    if walked is None:
        # A model or module that says itself which parameters or modules it has (torchrec-style): asked.
        walked = list(model.named_parameters())
    return {id(p): _canonical_fqn(model, name, names) for name, p in walked}


def _walk_params(model: nn.Module) -> list[tuple[str, Any]] | None:
    """``list(model.named_parameters())`` from the modules' own dicts; None when a module
    replaces ``named_modules`` (only its own answer counts then)."""
    out: list[tuple[str, Any]] = []
    taken: set[int] = set()
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:  # pre-order, children in order, each module once: named_modules()'s walk
        prefix, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if type(module).named_modules is not _NAMED_MODULES or "named_modules" in module.__dict__:
            return None
        for key, p in module._parameters.items():
            if p is not None and id(p) not in taken:
                taken.add(id(p))
                out.append((f"{prefix}.{key}" if prefix else key, p))
        children = [(f"{prefix}.{key}" if prefix else key, m) for key, m in module._modules.items() if m is not None]
        stack.extend(reversed(children))
    return out


_NAMED_MODULES = nn.Module.named_modules


def _own_walk(model: nn.Module, methods: tuple[str, ...]) -> bool:
    """Whether ``model`` replaces one of torch's ``methods`` (on its class or on itself)."""
    return any(getattr(type(model), m) is not getattr(nn.Module, m) or m in model.__dict__ for m in methods)


def model_state_dict(model: nn.Module, detached: bool = True, names: dict[str, str] | None = _UNSET) -> dict[str, Any]:
    """What ``get_model_state_dict(model)`` returns (default options), in a fraction of the time.

    DCP's version checks its options and renames every key with a walk over the modules on each
    call (0.3 s for 3,000 parameters, more than writing them). Here ``model.state_dict()`` is renamed
    with the answers :func:`_canonical_fqn` keeps. FSDP1 models, and models whose state dict is empty
    (DCP's error names the problem), go to DCP's own function.
    """
    own = type(model).state_dict is not nn.Module.state_dict or "state_dict" in model.__dict__
    if own or _uses_fsdp1(model):
        return get_model_state_dict(model)  # an own state_dict() may not take keep_vars
    with paused_gc():
        # keep_vars, then detached here: a DTensor's detach() goes through DTensor's dispatcher
        # (~20 us); rewrapping its detached shard under its own spec gives the same tensor.
        # A save, which only reads the bytes, takes the tensors as they are (detached=False):
        # rewrapping cost a few microseconds per parameter.
        sd = model.state_dict(keep_vars=True)
        if detached:
            sd = {key: _detached(value) for key, value in sd.items()}
        else:
            # Only tensors of the three plain types are taken as they are: anything else (a tensor
            # subclass held as a parameter, whose Parameter flag would make it pass for a plain
            # one) is detached as capture() gives it, and the writers and readers judge that.
            sd = {key: value if type(value) in _PLAIN else _detached(value) for key, value in sd.items()}
        if not sd:
            return get_model_state_dict(model)
        if names is _UNSET:
            names = _names_of(model)
        renamed = {key: fqn for key in sd if (fqn := _canonical_fqn(model, key, names)) != key}
        if not renamed:
            return sd
        # DCP pops each renamed key and puts it back under its new name: those come last.
        out = {key: value for key, value in sd.items() if key not in renamed}
        for key, fqn in renamed.items():
            out[fqn] = sd[key]
        return out


# FSDP2's own state-dict hooks: before a load or a state_dict() it reshards the parameters (they
# already are: the load asked for the state dict first), and after a load it re-pads a local
# shard whose storage changed (a load in place changes none).
_FSDP2 = "torch.distributed.fsdp._fully_shard."
_FSDP2_HOOKS = {
    (_FSDP2 + "_fsdp_param_group", "FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook"),
    (_FSDP2 + "_fsdp_param", "FSDPParam.__init__.<locals>.<lambda>"),
}


def _known_hooks(hooks: Mapping[Any, Any]) -> bool:
    # Every hook by its own module and name each time: remembering FSDP2's by code object let a
    # user's function built on that code object (with its own closure and name) pass for FSDP2's
    # (found by an outside attack).
    for hook in hooks.values():
        # torch wraps some hooks in a _WrappedHook. A plain function is not asked for ``hook``: the
        # failed look (an exception made and dropped) was most of this check, which runs for three
        # hooks of each of thousands of FSDP2 modules per load.
        fn = hook if type(hook) is FunctionType else getattr(hook, "hook", hook)
        try:
            key = (fn.__module__, fn.__qualname__)
        except AttributeError:  # a callable object without a function's names: not FSDP2's
            return False
        if key not in _FSDP2_HOOKS:
            return False
    return True


def _all_modules(model: nn.Module) -> list[nn.Module]:
    """Every module of ``model`` once (as ``model.modules()``, in another order): a loop over the
    children's dicts instead of a generator per module (half the time for a model of thousands,
    walked several times per load)."""
    found = [model]
    seen = {id(model)}
    i = 0
    while i < len(found):
        for child in found[i]._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                found.append(child)
        i += 1
    return found


_OWN_LOADING = frozenset(
    ("load_state_dict", "state_dict", "_load_from_state_dict", "_save_to_state_dict", "set_extra_state")
)
# Tensors whose copy_ is a plain copy (a subclass may do more on copy_, which reading in place skips).
_PLAIN = (torch.Tensor, nn.Parameter, DTensor)


def _loads_by_copying(model: nn.Module) -> bool:
    """Whether ``load_state_dict`` of ``model`` only copies each tensor into the one its
    ``state_dict()`` returned (so tensors read into those need no load_state_dict at all)."""
    if type(model).load_state_dict is not nn.Module.load_state_dict:
        return False
    # FSDP1 wrappers are looked for in the same walk (a walk of its own cost 1 ms per load at
    # 1,350 modules); older torch's composable FSDP1 leaves none, and DCP's traversal finds it.
    fsdp1 = _fsdp1_class()
    if fsdp1 is None and _uses_fsdp1(model):
        return False
    # A few classes for thousands of modules: each is looked at once (by identity: a metaclass
    # can make classes compare equal).
    plain_classes: set[int] = set()
    plain, own_loading, dict_has = _PLAIN, _OWN_LOADING, dict.__contains__
    for m in _all_modules(model):
        cls = type(m)
        if id(cls) not in plain_classes:
            if (
                cls._load_from_state_dict is not nn.Module._load_from_state_dict
                or cls._save_to_state_dict is not nn.Module._save_to_state_dict
                or cls.state_dict is not nn.Module.state_dict
                # Extra state is handed out by get_extra_state() (a tensor is read into that copy)
                # and only applied by set_extra_state() inside load_state_dict.
                or cls.set_extra_state is not nn.Module.set_extra_state
                or (fsdp1 is not None and issubclass(cls, fsdp1))
            ):
                return False
            plain_classes.add(id(cls))
        # Set on the instance, torch calls those. Asked of the dict's own storage, a look-up per
        # name (a set intersected with the dict went over every key): attribute look-ups find a
        # function there whatever a dict subclass's keys() or iteration say (an outside attack).
        found = m.__dict__
        for name in own_loading:
            if dict_has(found, name):
                return False
        for p in m._parameters.values():
            if p is not None and type(p) not in plain:
                return False
        for b in m._buffers.values():
            if b is not None and type(b) not in plain:
                return False
        if (
            m._state_dict_hooks
            or (m._load_state_dict_pre_hooks and not _known_hooks(m._load_state_dict_pre_hooks))
            or (m._load_state_dict_post_hooks and not _known_hooks(m._load_state_dict_post_hooks))
            or (m._state_dict_pre_hooks and not _known_hooks(m._state_dict_pre_hooks))
        ):
            return False
    return True


def _dtensor(local: torch.Tensor, spec: Any) -> torch.Tensor:
    """A DTensor of ``local`` under ``spec``, as DTensor's own ops make them: through ``__new__``
    alone (its ``__init__`` does nothing but pass a dynamo guard, a few microseconds per call)."""
    return cast(torch.Tensor, DTensor.__new__(DTensor, local, spec, requires_grad=False))


def _detached(value: Any) -> Any:
    if isinstance(value, DTensor):
        return _dtensor(value._local_tensor.detach(), value._spec)
    if isinstance(value, torch.Tensor):
        return value.detach()
    return value


def _empty_like(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty_like(p, dtype=dtype)``; for a DTensor of that dtype, made from its local shard
    and its own sharding spec (DTensor's dispatcher took ~35 us per call, a third of a second for
    a 10,000-slot optimizer)."""
    if isinstance(p, DTensor) and p.dtype == dtype:
        return _dtensor(torch.empty_like(p._local_tensor), p._spec)
    return torch.empty_like(p, dtype=dtype)


# Older torch also had a composable FSDP1 (``torch.distributed._composable.fully_shard``), which
# leaves no wrapper to find: only DCP's own traversal sees it there.
_COMPOSABLE_FSDP1 = importlib.util.find_spec("torch.distributed._composable.fully_shard") is not None


def _fsdp1_class() -> type | None:
    """FSDP1's wrapper class, where a walk over the modules finds every FSDP1 use (None: older
    torch's composable FSDP1, which leaves no wrapper, or torch without distributed)."""
    if _COMPOSABLE_FSDP1:  # pragma: no cover - torch < 2.6
        return None
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return FullyShardedDataParallel


def _uses_fsdp1(model: nn.Module) -> bool:
    fsdp1 = _fsdp1_class()
    if fsdp1 is not None:
        # A scan for the wrapper class: DCP's traversal asks every module for composable state
        # (a tenth of planning a 10,000-tensor load, asked several times per load).
        return any(isinstance(m, fsdp1) for m in _all_modules(model))
    if not _COMPOSABLE_FSDP1:
        return False  # torch built without distributed
    from torch.distributed.fsdp import FullyShardedDataParallel  # pragma: no cover - torch < 2.6

    return bool(FullyShardedDataParallel.fsdp_modules(model))  # pragma: no cover


def _optimizer_params(
    model: nn.Module, optimizer: torch.optim.Optimizer, known: dict[str, str] | None = _UNSET
) -> list[list[str]]:
    """The checkpoint names of each param group's parameters, in the optimizer's order
    (``known``: :func:`_names_of`'s answer when the caller has it already)."""
    fqn_of = _param_fqns(model, known)
    out: list[list[str]] = []
    for i, group in enumerate(optimizer.param_groups):
        names = []
        for p in group["params"]:
            fqn = fqn_of.get(id(p))
            if fqn is None:
                raise ConfigurationError(
                    f"optimizer param group {i} holds a parameter of shape {list(p.shape)} that is not in the model; "
                    "give the optimizer the model's own parameters (model.parameters())"
                )
            names.append(fqn)
        out.append(names)
    return out


def _optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, known: dict[str, str] | None = _UNSET
) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, in DCP's layout, without touching the optimizer.

    DCP's ``get_state_dict`` first runs a step with zero gradients when the optimizer has no state
    yet, which changes the run (AdamW's ``step`` starts one higher); this reads what is there.
    """
    osd = optimizer.state_dict()
    names = [fqn for group in _optimizer_params(model, optimizer, known) for fqn in group]
    # state_dict() numbers the parameters in param_groups order, which is the order of `names`.
    state = {names[pid]: value for pid, value in osd["state"].items()}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[pid] for pid in g["params"]]}
        for g in osd["param_groups"]
    ]
    # Which optimizer wrote it: loading AdamW's state into SGD would "work" and fail at step().
    return {"state": state, "param_groups": groups, "class": _class_name(optimizer)}


_PLAIN_STATE = (int, float, bool, str, type(None))
_ABSENT = object()


def _set_optimizer_state(
    opt: torch.optim.Optimizer,
    names: list[list[str]],
    state: Mapping[str, Any],
    groups: list[dict[str, Any]],
) -> bool:
    """What ``opt.load_state_dict({"state": state, "param_groups": groups})`` does, for the common
    case only; False (nothing done) outside it, and the caller then calls load_state_dict.

    The common case: the optimizer does not override ``load_state_dict`` and has no load hooks,
    and each parameter's state is a flat dict of tensors and plain values. The same casts are
    made (a slot takes its parameter's dtype and device; ``step`` is made float32 on that device
    for capturable or fused groups), the groups take the given settings (deep-copied, as there)
    and ``__setstate__`` runs (which optimizers use to fill defaults). Why not load_state_dict
    itself: its cast looks up every slot's group and goes through ``Tensor.to`` even where nothing
    changes, about a tenth of loading a 10,000-tensor state at two ranks.
    """
    if (
        type(opt).load_state_dict is not torch.optim.Optimizer.load_state_dict
        or opt._optimizer_load_state_dict_pre_hooks
        or opt._optimizer_load_state_dict_post_hooks
        or len(groups) != len(opt.param_groups)
    ):
        return False
    # Every entry of ``state`` is looked at in the loop below (the caller keeps only the groups'
    # names), which gives up on anything outside the common case before it changes anything.
    new_state: collections.defaultdict[torch.Tensor, dict[Any, Any]] = collections.defaultdict(dict)
    param_groups = []
    for group_names, current, settings in zip(names, opt.param_groups, groups, strict=True):
        params = current["params"]
        if len(params) != len(group_names) or len(settings["params"]) != len(params):
            return False
        new_group = {k: copy.deepcopy(v) for k, v in settings.items() if k != "params"}
        new_group["params"] = params
        if "param_names" in current and "param_names" not in new_group:
            new_group["param_names"] = current["param_names"]
        param_groups.append(new_group)
        float_step = bool(settings.get("capturable", False) or settings.get("fused", False))
        for fqn, p in zip(group_names, params, strict=True):
            slots = state.get(fqn, _ABSENT)
            if slots is _ABSENT:
                continue
            if type(slots) is not dict:
                return False  # None included: load_state_dict decides (and names the problem)
            out = {}
            now = opt.state.get(p)
            if now and list(now) != list(slots):
                # In the order the optimizer keeps them now (what load_state_dict gives when fed
                # the optimizer's own state_dict, as DCP does): the next save then has the layout
                # the last one had, and reuses its metadata instead of rebuilding it.
                if now.keys() == slots.keys():  # the usual case (AdamW's saved order differs): one pass
                    slots = {k: slots[k] for k in now}
                else:
                    slots = {
                        k: slots[k] for k in [*(k for k in now if k in slots), *(k for k in slots if k not in now)]
                    }
            # The parameter's facts once, and the CPU compared by flag: each ``.device`` makes an
            # object, and this runs for every slot of every parameter.
            p_dtype, p_float, p_cpu = p.dtype, p.is_floating_point(), p.is_cpu
            for key, v in slots.items():
                if isinstance(v, torch.Tensor):
                    elsewhere = not v.is_cpu if p_cpu else v.device != p.device
                    if key == "step":
                        if float_step and (v.dtype != torch.float32 or elsewhere):
                            v = v.to(dtype=torch.float32, device=p.device)
                    elif p_float:
                        if v.dtype != p_dtype or elsewhere:
                            v = v.to(dtype=p_dtype, device=p.device)
                    elif elsewhere:
                        v = v.to(device=p.device)
                elif type(v) not in _PLAIN_STATE:
                    return False
                out[key] = v
            new_state[p] = out
    opt.__setstate__({"state": new_state, "param_groups": param_groups})
    return True


def _class_name(optimizer: torch.optim.Optimizer) -> str:
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _as_before(current: Any, loaded: Any) -> Any:
    # JSON has no tuples: give a hyper-parameter back the tuple it was (AdamW's betas).
    if isinstance(current, tuple) and isinstance(loaded, list):
        return tuple(loaded)
    return loaded


def _holds_str(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_str(v) for v in value)
    return False


def _put_back_strings(dest: dict[Any, Any], loaded: Mapping[str, Any]) -> None:
    # Optimizer.load_state_dict rebuilds every iterable as type(value)(generator), which turns a
    # string into "<generator object ...>"; put the loaded value back where that happened.
    for key, value in loaded.items():
        if isinstance(value, Mapping) and isinstance(dest.get(key), dict):
            _put_back_strings(dest[key], value)
        elif _holds_str(value):
            dest[key] = copy.deepcopy(value)


def _match_groups(current: list[list[str]], saved: list[list[str]]) -> dict[int, int]:
    """Current param group index -> saved one whose settings it takes.

    A group pairs with the saved group of exactly its parameters; failing that, with the one saved
    group that holds all of its parameters that were saved at all (a group that gained or lost a
    parameter the model gained or lost: the keys report those). Empty groups pair up in order.
    """
    by_set: dict[frozenset[str], list[int]] = {}
    owner: dict[str, int] = {}
    for j, names in enumerate(saved):
        by_set.setdefault(frozenset(names), []).append(j)
        for name in names:
            owner.setdefault(name, j)
    out: dict[int, int] = {}
    for i, names in enumerate(current):
        candidates = by_set.get(frozenset(names))
        if candidates:
            out[i] = candidates.pop(0)
    taken = set(out.values())
    for i, names in enumerate(current):
        if i in out:
            continue
        homes = {owner[n] for n in names if n in owner}
        if len(homes) == 1 and (j := homes.pop()) not in taken:
            out[i] = j
            taken.add(j)
    return out


class _Names(list[str]):
    """A parameter group's names whose ``in`` is a set look-up.

    ``torch.optim.Optimizer.load_state_dict`` asks ``name in group["params"]`` once for every
    state tensor it loads: with a list, quadratic in the number of parameters (measured at 10,000
    parameters with AdamW: seconds per load, the largest part of a 2-rank load). Still a list
    (its length and order are what the optimizer checks and pairs parameters by).
    """

    def __init__(self, names: list[str]) -> None:
        super().__init__(names)
        self._set = frozenset(names)

    def __contains__(self, name: object) -> bool:
        return name in self._set


def _dict_at(tree: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    value = tree.get(key, {})
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{where}: state_meta.{key} is malformed (not a JSON object)")
    return value


class _Fit:
    """Collects, key by key, whether a destination fits the checkpoint."""

    def __init__(self, saved: Mapping[str, SavedTensor | None], where: str) -> None:
        self.saved = saved
        self.where = where
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        self.incompatible: list[tuple[str, str]] = []
        """(key, why) of what fits in no shape: another optimizer type."""
        self.same_dtypes = True

    def info(self, key: str) -> SavedTensor:
        info = self.saved[key]
        if info is None:
            raise CorruptCheckpointError(
                f"checkpoint {self.where} stores {key} as bytes, not a tensor; the checkpoint may be tampered with: "
                "load an earlier checkpoint or restore this one from a copy"
            )
        return info

    def take(self, key: str, t: torch.Tensor) -> bool:
        if key not in self.saved:
            self.missing.append(key)
            return False
        info = self.info(key)
        if info.shape != t.shape:  # torch.Size is a tuple: compared without a copy
            self.mismatched.append((key, info.shape, _shape(t)))
            return False
        if info.dtype != t.dtype:
            self.same_dtypes = False
        return True

    def report(self) -> LoadReport:
        def unique(keys: list[str]) -> list[str]:
            return list(dict.fromkeys(keys))

        mismatched = [k for k, _, _ in self.mismatched] + [k for k, _ in self.incompatible]
        return LoadReport(unique(self.missing), unique(self.unexpected), unique(mismatched))

    def problems(self) -> str:
        def listed(keys: list[str]) -> str:
            more = f" (and {len(keys) - 3} more)" if len(keys) > 3 else ""
            return ", ".join(keys[:3]) + more

        parts = [
            f"{key} has shape {list(saved)} in the checkpoint and {list(here)} in the model"
            for key, saved, here in self.mismatched[:3]
        ]
        if len(self.mismatched) > 3:
            parts[-1] += f" (and {len(self.mismatched) - 3} more of another shape)"
        parts += [why for _, why in self.incompatible]
        if self.missing:
            parts.append(f"it has no {listed(self.missing)}")
        if self.unexpected:
            parts.append(f"it holds {listed(self.unexpected)}, which this model/optimizer does not have")
        return "; ".join(parts)

    def raise_if_strict(self, strict: bool) -> None:
        if not (self.missing or self.unexpected or self.mismatched or self.incompatible):
            return
        if strict:
            raise CheckpointMismatchError(
                f"checkpoint {self.where} does not fit this model/optimizer: {self.problems()}. Load it into the "
                "model and optimizer it was saved from, or pass strict=False to TrainingState to load what fits "
                "(the rest is listed in state.load_report)"
            )
        log.warning("checkpoint %s: loading what fits (strict=False); %s", self.where, self.problems())


class TrainingState:
    """A model, its optimizer and any extra stateful objects, as one checkpointable unit.

    The model goes through ``torch.distributed.checkpoint.state_dict`` so that sharded
    (FSDP2/DTensor) and plain modules are handled alike; optimizer state is keyed by parameter
    name in DCP's layout (``optim.state.<fqn>.<slot>``, ``optim.param_groups``), which is what
    makes checkpoints loadable at another world size. Capturing never changes anything: unlike
    DCP's ``get_state_dict`` it does not initialise empty optimizer state.

    Args:
        strict: a load must match key for key (the default): every model key, the optimizer's
            param groups and every extra named here must be in the checkpoint, and the checkpoint
            must hold no model key or optimizer state this state lacks, all of the same shape;
            otherwise :class:`CheckpointMismatchError`, before anything changes. With
            ``strict=False`` what fits is loaded and the rest is left as it was and listed in
            :attr:`load_report`. Parameters without optimizer state in the checkpoint (never
            updated yet) are fine either way: they get none. Optimizer state in a checkpoint is
            only checked when an optimizer is given, and extras only when named.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        extra: Mapping[str, Stateful] | None = None,
        *,
        strict: bool = True,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.extra: dict[str, Stateful] = dict(extra or {})
        self.strict = strict
        self.load_report: LoadReport | None = None
        """What the last successful load did not take over one-to-one; None before any load."""

    # ------------------------------------------------------------------ capture

    def _full(self, detached: bool = True) -> dict[str, Any]:
        if self.optimizer is not None and _uses_fsdp1(self.model):
            # FSDP1's flat parameters need DCP's own conversion (which initialises empty state).
            msd, osd = get_state_dict(self.model, self.optimizer)
        else:
            names = _names_of(self.model)  # asked once for both
            msd = model_state_dict(self.model, detached, names)
            osd = _optimizer_state_dict(self.model, self.optimizer, names) if self.optimizer is not None else {}
        return {"model": msd, "optim": osd, "extra": {k: v.state_dict() for k, v in self.extra.items()}}

    def capture(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(tensor tree, JSON tree) of the current state, changing nothing. Tensors may alias live state."""
        return split_tensors(self._full())

    def _capture_to_write(self) -> tuple[dict[str, Any], dict[str, Any]]:
        # What capture() returns, but the model's tensors as the model holds them (parameters not
        # detached): a save only reads their bytes (see capture_to_write).
        return split_tensors(self._full(detached=False))

    # ------------------------------------------------------------------ restore

    def restore(self, tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
        """Apply a (tensor tree, JSON tree) pair as :meth:`capture` makes them (strictness as :attr:`strict`)."""
        full = merge_trees(meta, tensors)
        if self.optimizer is not None and _uses_fsdp1(self.model):
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=full["model"],
                optim_state_dict=full.get("optim", {}),
                options=StateDictOptions(strict=self.strict),
            )
        else:
            set_model_state_dict(self.model, full["model"], options=StateDictOptions(strict=self.strict))
            osd = full.get("optim") or {}
            if self.optimizer is not None and osd:
                names = _optimizer_params(self.model, self.optimizer)
                saved = [list(g.get("params", [])) for g in osd.get("param_groups", [])]
                pairs = _match_groups(names, saved)
                if self.strict and (len(pairs) != len(names) or len(saved) != len(names)):
                    raise CheckpointMismatchError(
                        "the optimizer's param groups hold other parameters than the ones given; build the "
                        "optimizer as it was saved, or pass strict=False"
                    )
                self._load_optimizer(names, osd.get("state", {}), osd.get("param_groups", []), pairs)
        for name, obj in self.extra.items():
            if name in full.get("extra", {}):
                obj.load_state_dict(full["extra"][name])

    def _load_optimizer(
        self,
        names: list[list[str]],
        state: Mapping[str, Any],
        saved_groups: list[Mapping[str, Any]],
        pairs: Mapping[int, int],
    ) -> None:
        """Load FQN-keyed optimizer state: groups in ``pairs`` take the saved settings, others keep theirs."""
        opt = self.optimizer
        assert opt is not None
        groups = []
        for i, group in enumerate(opt.param_groups):
            j = pairs.get(i)
            settings = saved_groups[j] if j is not None else group
            hyper = {k: _as_before(group.get(k), v) for k, v in settings.items() if k != "params"}
            # Settings this torch has and the saving one had not (a newer default) stay as they are.
            kept_here = {k: v for k, v in group.items() if k != "params" and k not in hyper}
            groups.append({**kept_here, **hyper, "params": _Names(names[i])})
        own = {fqn for group in names for fqn in group}
        kept = {fqn: value for fqn, value in state.items() if fqn in own}
        if _set_optimizer_state(opt, names, kept, groups):
            return  # strings are kept as they are there
        # Optimizer.load_state_dict maps the names in "params" to this optimizer's parameters in
        # order, and with them the state keyed by those names (as DCP's own loader relies on).
        opt.load_state_dict({"state": kept, "param_groups": groups})
        by_name = {
            fqn: p
            for group, params in zip(names, opt.param_groups, strict=True)
            for fqn, p in zip(group, params["params"], strict=True)
        }
        for fqn, value in kept.items():
            if isinstance(value, Mapping):
                _put_back_strings(opt.state[by_name[fqn]], value)

    # ------------------------------------------------------------------ loading

    def _generic(self) -> bool:
        # A subclass with its own capture()/restore() (the benchmark's ready-made tree, say) is
        # loaded through them; so is an FSDP1 model, whose flat parameters only DCP can convert.
        cls = type(self)
        if cls.capture is not TrainingState.capture or cls.restore is not TrainingState.restore:
            return True
        return self.optimizer is not None and _uses_fsdp1(self.model)

    def plan_load(
        self, saved: Mapping[str, SavedTensor | None], saved_meta: Mapping[str, Any] | None, where: str
    ) -> LoadPlan:
        """Decide where each tensor of a checkpoint is read to, checking that it fits; changes nothing.

        ``saved`` is every key of the checkpoint's DCP metadata (None for one stored as bytes),
        ``saved_meta`` its JSON tree (None for an OLMo-core checkpoint, which has none: settings and
        extras then keep their current values). Model tensors are read in place (they are listed in
        ``live`` for the caller's backup); optimizer state is read into new tensors, one per saved
        slot, with the parameter's device and sharding where it has the parameter's shape, so that a
        fresh optimizer gets state exactly for the parameters that had it. Raises
        :class:`CheckpointMismatchError` when it does not fit and :attr:`strict` is set.
        """
        strict = getattr(self, "strict", True)
        fit = _Fit(saved, where)
        if self._generic():
            now_t, now_m = self.capture()
            for path, t in _leaves(now_t):
                key = ".".join(path)
                local = t._local_tensor if isinstance(t, DTensor) else t
                if key in saved and _nested(local):
                    refuse_unloadable(key, local)  # before take(): a nested tensor has no shape
                if fit.take(key, t):
                    refuse_unloadable(key, local)  # what is read in place; the rest is left as it is
                refuse_short_memory(key, t)
            fit.raise_if_strict(True)
            apply = dict(now_m if saved_meta is None else saved_meta)
            back = {"tensors": now_t, "meta": now_m}
            return LoadPlan(now_t, now_t, apply, fit.report(), fit.same_dtypes, generic=True, undo=back)

        tensors: dict[str, Any] = {}
        live: dict[str, Any] = {}
        meta: dict[str, Any] = {}
        undo: dict[str, Any] = {}  # values of several kinds: see undo_load
        flat: list[FlatLeaf] = []  # LoadPlan.flat

        # The model: read in place, key for key. Its tensors as the model holds them (not detached:
        # rewrapping cost a few microseconds per parameter): every reader writes their memory
        # without autograd (raw reads, copies under no_grad, DCP's reader into detached views).
        names = _names_of(self.model)  # asked once, for the model and the optimizer's slots
        msd = model_state_dict(self.model, False, names)
        cur_t, cur_m = split_tensors(msd, "model")
        known: set[str] = set()
        model_t: dict[str, Any] = {}
        unmade: list[str] = []  # on the meta device: no memory to read into
        for path, t in _leaves(cur_t):
            key = "model." + ".".join(path)
            known.add(key)
            local = t._local_tensor if isinstance(t, DTensor) else t
            if local.is_nested and key in saved:
                refuse_unloadable(key[len("model.") :], local)  # before take(): a nested tensor has no shape
            if fit.take(key, t):
                refuse_unloadable(key[len("model.") :], local)  # read in place: missing or mismatched ones are not
                _put(model_t, path, t)
                flat.append((key, t, None))
                if local.is_meta:
                    unmade.append(key[len("model.") :])
                else:
                    # Reads write its memory straight: past a shrunk storage's end is the heap.
                    refuse_short_memory(key[len("model.") :], t)
        if unmade:
            more = f" (and {len(unmade) - 1} more)" if len(unmade) > 1 else ""
            raise ConfigurationError(
                f"cannot load {where} into this model: {unmade[0]}{more} is on the meta device (made without "
                "memory); materialise the model first, e.g. model.to_empty(device='cpu'), then load"
            )
        fit.unexpected += [k for k, v in saved.items() if k.startswith("model.") and k not in known and v is not None]
        model_m = cur_m
        if saved_meta is not None:
            saved_m = _dict_at(saved_meta, "model", where)
            model_m = {k: v for k, v in saved_m.items() if k in cur_m}
            fit.unexpected += [f"model.{k}" for k in saved_m if k not in msd]
            fit.missing += [f"model.{k}" for k in cur_m if k not in saved_m]
        tensors["model"], live["model"], meta["model"] = model_t, model_t, model_m
        undo["model"] = (cur_t, cur_m)

        if self.optimizer is not None:
            optim = self._plan_optimizer(saved, saved_meta, fit, where, names, flat)
            if optim is not None:
                tensors["optim"] = {"state": optim.pop("tensors")}
                meta["optim"] = {"state": optim["json"]}
                undo["optim"] = (self.optimizer.state, self.optimizer.param_groups)
                undo["optim_plan"] = optim

        undo["extra"] = {}
        if saved_meta is not None and self.extra:
            saved_x = _dict_at(saved_meta, "extra", where)
            keys: dict[str, list[str]] = {}
            for key in saved:
                if key.startswith("extra."):
                    name = _owner(key[len("extra.") :], self.extra)
                    if name is not None:
                        keys.setdefault(name, []).append(key)
            tensors["extra"], live["extra"], meta["extra"] = {}, {}, {}
            for name, obj in self.extra.items():
                if name not in saved_x:
                    fit.missing.append(f"extra.{name}")
                    continue
                node = saved_x[name]
                if not isinstance(node, dict):
                    raise CorruptCheckpointError(f"{where}: state_meta.extra.{name} is malformed (not a JSON object)")
                old_t, old_m = split_tensors(obj.state_dict(), f"extra.{name}")
                current = dict(_leaves(old_t))
                sub: dict[str, Any] = {}
                for key in keys.get(name, []):
                    info = fit.info(key)
                    path = _split_rest(node, key[len(f"extra.{name}.") :])
                    cur = current.get(path)
                    here = cur._local_tensor if isinstance(cur, DTensor) else cur
                    if here is not None and _nested(here):
                        refuse_unloadable(key, here)  # before _shape(): a nested tensor has none
                    if cur is not None and _shape(cur) == info.shape and cur.dtype == info.dtype:
                        # Read in place, as the model is: refused if it cannot be (an extra whose
                        # load_state_dict copies into it would fail on it, or, overlapping, load
                        # wrong without a word; found by an outside attack). A tensor of another
                        # shape or dtype is not read into: the extra gets a new one, and decides.
                        refuse_unloadable(key, here)
                        refuse_short_memory(key, cur)
                        t = cur  # read in place, as the model is
                        _put(live["extra"].setdefault(name, {}), path, cur)
                    elif cur is not None and _shape(cur) == info.shape and unloadable(here) is None:
                        t = torch.empty_like(cur, dtype=info.dtype)
                    else:
                        t = torch.empty(info.shape, dtype=info.dtype or torch.float32, device="cpu")
                    _put(sub, path, t)
                    flat.append((key, t, None))
                tensors["extra"][name], meta["extra"][name] = sub, node
                undo["extra"][name] = (old_t, old_m)

        fit.raise_if_strict(strict)
        return LoadPlan(_pruned_plan(tensors), _pruned(live), meta, fit.report(), fit.same_dtypes, undo=undo, flat=flat)

    def _plan_optimizer(
        self,
        saved: Mapping[str, SavedTensor | None],
        saved_meta: Mapping[str, Any] | None,
        fit: _Fit,
        where: str,
        known: dict[str, str] | None = _UNSET,
        flat: list[FlatLeaf] | None = None,
    ) -> dict[str, Any] | None:
        """The optimizer's part of :meth:`plan_load`; each tensor it makes is also added to ``flat``
        (see :attr:`LoadPlan.flat`) under its checkpoint key."""
        opt = self.optimizer
        assert opt is not None
        names = _optimizer_params(self.model, opt, known)
        own = {
            fqn: p
            for group, g in zip(names, opt.param_groups, strict=True)
            for fqn, p in zip(group, g["params"], strict=True)
        }
        json_state: dict[str, Any] = {}
        saved_groups: list[dict[str, Any]] = []
        if saved_meta is not None:
            saved_optim = _dict_at(saved_meta, "optim", where)
            json_state = _dict_at(saved_optim, "state", where)
            raw = saved_optim.get("param_groups", [])
            ok = isinstance(raw, list) and all(
                isinstance(g, dict)
                and isinstance(g.get("params"), list)
                and all(isinstance(n, str) for n in g["params"])
                for g in raw
            )
            if not ok or not all(isinstance(v, dict) for v in json_state.values()):
                raise CorruptCheckpointError(f"{where}: state_meta.optim is malformed")
            saved_groups = raw
        by_fqn: dict[str, dict[str, SavedTensor]] = {}
        slots_of = by_fqn.get
        for key, info in saved.items():
            if key.startswith("optim.state."):
                # The usual key is a parameter's name and a slot without dots: the longest owner,
                # which _owner would try first, is tried here without the call.
                cut = key.rfind(".")
                fqn: str | None = key[12:cut]  # len("optim.state.")
                if cut > 12 and fqn in own:
                    slot = key[cut + 1 :]
                else:
                    rest = key[12:]
                    fqn = _owner(rest, own)
                    if fqn is None:
                        fit.unexpected.append(key)
                        continue
                    slot = rest[len(fqn) + 1 :]
                found = slots_of(fqn)
                if found is None:
                    found = by_fqn[fqn] = {}
                found[slot] = fit.info(key) if info is None else info
        listed = tuple(fit.unexpected)
        fit.unexpected += [
            f"optim.state.{fqn}"
            for fqn in json_state
            if fqn not in own and fqn not in by_fqn and not any(k.startswith(f"optim.state.{fqn}.") for k in listed)
        ]

        pairs: dict[int, int] = {}
        if saved_meta is not None:
            if not saved_groups and not json_state and not by_fqn:
                fit.missing.append("optim")  # saved without an optimizer
                return None
            pairs = _match_groups(names, [g["params"] for g in saved_groups])
            fit.missing += [f"optim.param_groups.{i}" for i in range(len(names)) if i not in pairs]
            matched = set(pairs.values())
            fit.unexpected += [f"optim.param_groups.{j}" for j in range(len(saved_groups)) if j not in matched]
            saved_class = saved_optim.get("class")
            if isinstance(saved_class, str) and saved_class != _class_name(opt):
                # Checkpoints written before the class was recorded are not checked.
                fit.incompatible.append(
                    (
                        "optim",
                        f"its optimizer state is {saved_class.rsplit('.', 1)[-1]}'s, not {type(opt).__name__}'s "
                        f"({saved_class} vs {_class_name(opt)})",
                    )
                )
            if fit.incompatible:
                return None  # strict raises; otherwise the optimizer keeps its own state

        state_t: dict[str, Any] = {}
        state_m: dict[str, Any] = {}
        for fqn in [*json_state, *(f for f in by_fqn if f not in json_state)]:
            p = own.get(fqn)
            if p is None:
                continue
            slots = by_fqn.get(fqn, {})
            was = saved.get(f"model.{fqn}")
            shape = _shape(p)  # once per parameter: a DTensor's shape is ~1 us a look
            # A slot that had the parameter's shape when saved must have it now (AdamW's moments).
            # Only possible where the parameter's own shape changed: the slots are looked at then.
            if was is not None and was.shape != shape:
                bad = [
                    (f"optim.state.{fqn}.{rest}", info.shape, shape)
                    for rest, info in slots.items()
                    if info.shape == was.shape
                ]
                if bad:
                    fit.mismatched += bad
                    continue
            node = json_state.get(fqn, {})
            sub: dict[str, Any] = {}
            # A DTensor's shard and spec, looked up once per parameter (each look is a Python call).
            like = (p._local_tensor, p._spec, p.dtype) if isinstance(p, DTensor) else None
            plain = type(p) in _PLAIN and not isinstance(p, DTensor)
            for rest, info in slots.items():
                dtype = info.dtype
                # With the parameter's shape: its device and sharding (a DTensor); otherwise a plain
                # tensor that load_state_dict moves where it belongs. The twin (see FlatLeaf) only
                # where the checkpoint gives the dtype (a reader refuses a slot of none).
                if not (shape and info.shape == shape):
                    # On the CPU whatever the default device (as torch.load gives it; the optimizer's
                    # load moves a slot where its parameter is), and plain unless the dtype is a
                    # quantized one (torch.empty then makes a quantized tensor, whose scale raw
                    # bytes do not carry; found by an outside attack): a reader looks at those.
                    t = torch.empty(info.shape, dtype=dtype or torch.float32, device="cpu")
                    twin = MADE_PLAIN if dtype is not None and not t.is_quantized else None
                elif like is not None and like[2] == dtype:
                    # What _empty_like makes, without its checks: empty_like keeps the shard's strides.
                    t = _dtensor(torch.empty_like(like[0]), like[1])
                    twin = p
                else:
                    t = _empty_like(p, dtype or torch.float32)
                    twin = p if plain and dtype is not None else None
                if "." in rest:
                    _put(sub, _split_rest(node, rest), t)
                else:
                    sub[rest] = t  # an optimizer slot's usual name: nothing to follow (see _split_rest)
                if flat is not None:
                    flat.append((f"optim.state.{fqn}.{rest}", t, twin))
            state_t[fqn], state_m[fqn] = sub, node
        return {"tensors": state_t, "json": state_m, "names": names, "groups": saved_groups, "pairs": pairs}

    def apply_load(self, plan: LoadPlan) -> None:
        """Apply a plan whose tensors have been read: model, optimizer, then extras."""
        if plan.generic:
            self.restore(plan.tensors, plan.meta)
        else:
            # Model tensors were read into the live ones; load_state_dict would copy each onto
            # itself (a DTensor copy_ is ~100 us, 1 s at 10,000 tensors). It is still called when
            # there are non-tensor entries, or when some module could do more than copy (its own
            # _load_from_state_dict, a load or state-dict hook other than FSDP2's own).
            if plan.meta.get("model") or not _loads_by_copying(self.model):
                model_sd = merge_trees(plan.meta.get("model", {}), plan.tensors.get("model", {}))
                whole = not any(k.startswith("model.") for k in plan.report.missing_keys + plan.report.mismatched_keys)
                set_model_state_dict(self.model, model_sd, options=StateDictOptions(strict=whole))
            optim = plan.undo.get("optim_plan")
            if optim is not None:
                read = plan.tensors.get("optim", {}).get("state", {})
                # A parameter's JSON node is empty when all its state is tensors (AdamW's): its
                # read slots are then its state as they are (nothing keeps or changes that dict).
                state = {
                    fqn: merge_trees(node, read.get(fqn, {})) if node else read.get(fqn, {})
                    for fqn, node in optim["json"].items()
                }
                self._load_optimizer(optim["names"], state, optim["groups"], optim["pairs"])
            for name in plan.undo.get("extra", {}):
                tree = merge_trees(plan.meta["extra"][name], plan.tensors.get("extra", {}).get(name, {}))
                self.extra[name].load_state_dict(tree)
        self.load_report = plan.report

    def undo_load(self, plan: LoadPlan) -> None:
        """After a failed :meth:`apply_load` (and the caller's restore of ``plan.live``): put the rest back."""
        if plan.generic:
            self.restore(plan.undo["tensors"], plan.undo["meta"])
            return
        old_t, old_m = plan.undo["model"]
        if old_m:  # non-tensor entries (a module's extra state); the tensors are back already
            set_model_state_dict(self.model, merge_trees(old_m, old_t), options=StateDictOptions(strict=False))
        if "optim" in plan.undo and self.optimizer is not None:
            # load_state_dict built new state and groups; the old objects are untouched.
            self.optimizer.state, self.optimizer.param_groups = plan.undo["optim"]
        for name, (old_t, old_m) in plan.undo["extra"].items():
            self.extra[name].load_state_dict(merge_trees(old_m, old_t))


def capture_to_write(state: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``state.capture()`` for a save, which only reads the tensors' bytes.

    A plain :class:`TrainingState` (not a subclass, its ``capture`` replaced neither on the class
    nor on the object) hands out its parameters without detaching each (see
    :func:`model_state_dict`): the fast writers and the stager read their bytes only, and what goes
    to DCP's writer is detached first (:func:`detached_tree`). Any other state is asked for its
    own ``capture()``, whatever it does.
    """
    if type(state) is TrainingState and TrainingState.capture is _CAPTURE and "capture" not in vars(state):
        return state._capture_to_write()
    return cast("tuple[dict[str, Any], dict[str, Any]]", state.capture())


_CAPTURE = TrainingState.capture


def detached_tree(tree: Mapping[str, Any]) -> dict[str, Any]:
    """``tree`` with every tensor detached as ``capture()`` gives them (a parameter, of a subclass
    too, becomes a plain tensor; a DTensor is rewrapped under its own spec): for DCP's writer."""
    return {k: detached_tree(v) if isinstance(v, Mapping) else _detached(v) for k, v in tree.items()}


def _pruned(tree: Mapping[str, Any]) -> dict[str, Any]:
    # Readers are given no empty dicts (a parameter whose saved state has no tensors, say).
    out: dict[str, Any] = {}
    for key, value in tree.items():
        # A tensor is told apart before asking Mapping (an ABC check, slow per tensor of a big state).
        if type(value) is dict or (not isinstance(value, torch.Tensor) and isinstance(value, Mapping)):
            sub = _pruned(value)
            if sub:
                out[key] = sub
        else:
            out[key] = value
    return out


def _pruned_plan(tensors: dict[str, Any]) -> dict[str, Any]:
    """:func:`_pruned` of a plan's tensor tree, which :meth:`TrainingState.plan_load` builds with
    :func:`_put` (every dict it makes holds a tensor): only the model's tree, each parameter's
    optimizer slots and the extras can be empty, and only those are looked at (the generic walk
    visited every tensor, milliseconds at 10,000)."""
    out: dict[str, Any] = {}
    for key, value in tensors.items():
        if key == "model":
            if value:
                out[key] = value
        elif key == "optim":
            state = {fqn: slots for fqn, slots in value["state"].items() if slots}
            if state:
                out[key] = {"state": state}
        else:
            sub = _pruned(value)
            if sub:
                out[key] = sub
    return out


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """SHA-256 of every model and optimizer tensor (full, unsharded values), by parameter name.

    Comparable across runs and world sizes: two digests are equal exactly when the weights and
    optimizer state are bit-identical. Raises :class:`ConfigurationError` naming a tensor whose
    storage was resized under it (its values are not all in memory) or one on the meta device.
    """
    tensors, _ = TrainingState(model, optimizer).capture()
    h = hashlib.sha256()
    for path, t in sorted(flatten_tensors(tensors), key=lambda p: p[0]):
        # Its bytes are read below: past a shrunk storage's end they are whatever lies there.
        refuse_short_memory(path, t)
        if (t._local_tensor if isinstance(t, DTensor) else t).is_meta:
            raise ConfigurationError(
                f"{path} is on the meta device (made without memory: it holds no values to hash); materialise "
                "the model first, e.g. model.to_empty(device='cpu') and initialise it"
            )
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        # A lazy conjugate or negation has no byte view of its values: they are made first.
        data = full.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
        h.update(f"{path}|{data.dtype}|{tuple(full.shape)}|".encode())
        h.update(data.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
