"""Roll forward after a restart: every rank continues from the newest step any rank committed.

After an in-process restart the ranks may disagree on where training is: a replacement of a
dead rank (`RestartState.respawned`) holds nothing, and a fault during a step's last
collective can leave one survivor a step ahead of another. Reloading a checkpoint would redo
every step since it; instead the rank with the newest committed step (the lowest such rank)
sends its state to the others over the iteration's process group:

    model, optimizer = build()                 # same shapes on every rank
    step = roll_forward(state, committed_step, {"model": model, "optimizer": optimizer,
                                                "rng": TorchRNG(), "data": sampler})

`committed_step` is the number of steps this rank has applied (None: it holds no state, as a
replacement). Steps are committed with `with state.atomic(): optimizer.step(); step += 1`, so
an interruption never leaves one half applied. The sender's state goes out as its structure
first (JSON: names, numbers, and each tensor's dtype and shape), then the tensors in a few
buckets, copied into the receiver's own tensor of that name where shape and dtype match
(a model's parameters) and into new ones otherwise (an optimizer that has not stepped yet);
then every object's load_state_dict. It assumes replicated state (DDP): a sharded model
has no single rank that holds all of it, and must reload its checkpoint instead.
"""

import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed.distributed_c10d as _c10d

from nvrx_core.collectives import Collectives, wait_released

_TENSOR, _TUPLE, _DICT = "__tensor__", "__tuple__", "__dict__"


class TorchRNG:
    """torch's random number generators as a stateful object for roll_forward (CPU, and CUDA's
    when this process initialised CUDA)."""

    def state_dict(self) -> Dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_initialized():
            torch.cuda.set_rng_state_all(state["cuda"])


def roll_forward(state: Any, committed_step: Optional[int], stateful: Mapping[str, Any],
                 group: Any = None) -> int:
    """Bring every rank of `group` to the newest committed step; returns that step (0 if no
    rank has any). `state` is the RestartState (its `respawned` ranks count as holding
    nothing); `stateful` maps names to objects with state_dict()/load_state_dict(), or to
    dicts (updated in place)."""
    coll = Collectives(group)
    mine = None if state is not None and state.rank in getattr(state, "respawned", ()) else committed_step
    if coll.alone:
        return mine or 0
    steps = coll.all_gather_json(mine)
    held = [s for s in steps if s is not None]
    if not held:
        return 0
    newest = max(held)
    if all(s == newest for s in steps):
        return newest
    src = steps.index(newest)
    receiving = steps[coll.rank] != newest
    own = _flatten({name: _state_of(obj) for name, obj in stateful.items()}) if coll.rank == src or receiving else None
    structure = coll.broadcast_json(own[0] if coll.rank == src else None, src)
    tensors = _transfer_tensors(coll, src, structure, own, receiving)
    if receiving:
        tree = _unflatten(structure, tensors)
        for name, obj in stateful.items():
            _load(obj, tree[name])
    return newest


def _state_of(obj: Any) -> Any:
    return obj if isinstance(obj, dict) else obj.state_dict()


def _load(obj: Any, value: Any) -> None:
    if isinstance(obj, dict):
        obj.clear()
        obj.update(value)
    else:
        obj.load_state_dict(value)


def _transfer_tensors(coll: Collectives, src: int, structure: Any, own: Optional[Tuple[Any, List[torch.Tensor]]],
                      receiving: bool) -> List[torch.Tensor]:
    """Broadcast every tensor of `structure` from `src`; the receivers' copies, in order.

    Tensors go in buckets (one dtype, up to BUCKET_BYTES each): a model's few hundred small
    tensors cost a few collectives, not a few hundred, and no bucket doubles the memory of
    more than BUCKET_BYTES.
    """
    mine = own[1] if own is not None else {}
    received: List[torch.Tensor] = []
    root = coll.global_rank(src)
    for bucket in _buckets(_tensor_specs(structure)):
        dtype = bucket[0][1]
        if coll.rank == src:
            flat = torch.cat([mine[path].detach().reshape(-1).to(coll.device) for path, _, _ in bucket])
        else:
            flat = torch.empty(sum(math.prod(shape) for _, _, shape in bucket), dtype=dtype, device=coll.device)
        _c10d.broadcast(flat, src=root, group=coll.group)
        if coll.device.type == "cpu":
            wait_released([flat])
        if receiving:
            offset = 0
            for path, _, shape in bucket:
                part = flat[offset:offset + math.prod(shape)].view(shape)
                offset += math.prod(shape)
                received.append(_receive_into(mine.get(path), part))
    return received


BUCKET_BYTES = 32 << 20


def _buckets(specs: List[Tuple[str, torch.dtype, List[int]]]) -> List[List[Tuple[str, torch.dtype, List[int]]]]:
    """Consecutive specs of one dtype, up to BUCKET_BYTES each (a larger tensor is a bucket alone)."""
    buckets: List[List[Tuple[str, torch.dtype, List[int]]]] = []
    size = 0
    for spec in specs:
        nbytes = math.prod(spec[2]) * spec[1].itemsize
        if not buckets or buckets[-1][0][1] != spec[1] or size + nbytes > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(spec)
        size += nbytes
    return buckets


def _receive_into(own: Optional[torch.Tensor], part: torch.Tensor) -> torch.Tensor:
    """The receiver's own tensor, overwritten in place where it can take the data, else a copy."""
    if own is not None and own.dtype == part.dtype and own.shape == part.shape and own.device == part.device:
        return own.detach().copy_(part)
    return part.clone()


def _tensor_specs(structure: Any) -> List[Tuple[str, torch.dtype, List[int]]]:
    """(path, dtype, shape) of each tensor placeholder, in placeholder order."""
    specs: List[Tuple[str, torch.dtype, List[int]]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if _TENSOR in node:
                specs.append((node["path"], getattr(torch, node["dtype"]), list(node["shape"])))
            else:
                for child in node.get(_DICT, node.get(_TUPLE, [])):
                    walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(structure)
    return specs


def _flatten(value: Any, path: str = "") -> Tuple[Any, Dict[str, torch.Tensor]]:
    """(JSON structure with tensor placeholders, {path: tensor}): receivers match their own
    tensors to the sender's by path (their optimizer may hold fewer)."""
    tensors: Dict[str, torch.Tensor] = {}

    def encode(node: Any, where: str) -> Any:
        if isinstance(node, torch.Tensor):
            tensors[where] = node
            return {_TENSOR: len(tensors) - 1, "path": where, "dtype": str(node.dtype).removeprefix("torch."),
                    "shape": list(node.shape)}
        if isinstance(node, dict):
            return {_DICT: [[key, encode(child, f"{where}/{key!r}")] for key, child in node.items()
                            if _check_key(key, where)]}
        if isinstance(node, tuple):
            return {_TUPLE: [encode(child, f"{where}[{i}]") for i, child in enumerate(node)]}
        if isinstance(node, list):
            return [encode(child, f"{where}[{i}]") for i, child in enumerate(node)]
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise TypeError(f"roll_forward: {where or '/'} is a {type(node).__name__}; only tensors, numbers, "
                        "strings, None, lists, tuples and dicts can be sent to another rank")

    return encode(value, path), tensors


def _check_key(key: Any, where: str) -> bool:
    if key is None or isinstance(key, (bool, int, float, str)):
        return True
    raise TypeError(f"roll_forward: {where or '/'} has a key of type {type(key).__name__}; only numbers and "
                    "strings can be sent to another rank")


def _unflatten(structure: Any, tensors: List[torch.Tensor]) -> Any:
    if isinstance(structure, dict):
        if _TENSOR in structure:
            return tensors[structure[_TENSOR]]
        if _TUPLE in structure:
            return tuple(_unflatten(child, tensors) for child in structure[_TUPLE])
        return {key: _unflatten(child, tensors) for key, child in structure[_DICT]}
    if isinstance(structure, list):
        return [_unflatten(child, tensors) for child in structure]
    return structure
