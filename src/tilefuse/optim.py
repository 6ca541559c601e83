"""Fused Adam / AdamW optimizers: one multi-tensor launch per (param group, device, dtype).

Drop-in for ``torch.optim.Adam`` / ``torch.optim.AdamW`` (they subclass them): same
hyperparameters, same ``param_groups`` keys, and a ``state_dict`` either can load -- per-param
``step`` (float32 scalar tensor), ``exp_avg``, ``exp_avg_sq`` (, ``max_exp_avg_sq``).

* ``step()`` never synchronizes with the host: every param's step count lives on its device
  (``state["step"]`` is a 0-d view of one float32 buffer per launch group, incremented by the
  kernel's prep launch), ``lr`` is read from device memory when it is a tensor. So any step can
  be captured in a CUDA graph (warm up with one eager step first, which builds the cached
  pointer tables; pass ``lr`` as a device tensor if a scheduler changes it between replays).
  ``capturable`` only decides where ``state_dict()`` puts ``step``: the param's device (True) or
  the CPU (False), as torch.optim.Adam keeps it.
* ``master_weights=True``: fp16/bf16 params keep an fp32 copy in ``state["master_param"]`` (and
  fp32 ``exp_avg``/``exp_avg_sq``); the kernel updates the master and writes the rounded param
  in the same pass. torch ignores the extra key; a state without it rebuilds it from the param.
  The master is the weight the step updates: an in-place edit of the param between steps (a
  clamp, a re-initialization) is overwritten from the master at the next step, as with apex's
  master weights; edit ``state[p]["master_param"]`` as well.
* Params whose ``grad`` is None are skipped. Groups with different hyperparameters are
  separate launches (one per group and (device, dtype)), as are params of different dtypes.
* ``foreach`` / ``fused`` are accepted and ignored (always fused); ``differentiable`` is not
  supported; ``betas`` are read on the host (floats, as usual).
"""

from __future__ import annotations

import inspect
import itertools

import torch

from ._checks import FLOAT_DTYPES
from .ops.adamw import _check_not_negative_view, _dense, run_step

_LOW_PRECISION = (torch.float16, torch.bfloat16)
# torch >= 2.7 keeps decoupled_weight_decay in Adam's param groups (AdamW is Adam with it True);
# older torch has no such key, so neither do we (the flag then lives on the optimizer)
_GROUP_HAS_DECOUPLED = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam).parameters


class _StepGroup:
    """One launch's params, their state tensors, and the float32 buffer that their
    ``state["step"]`` views live in. Reused while the params and state objects are the same
    ones and every param keeps its shape and strides (then the per-tensor dtype/layout checks of
    ``_init_state`` need not run again; a ``.data`` swap -- ``model.to(memory_format=...)``, a
    resize -- changes them and rebuilds the group: the kernel walks param and state as one flat
    block each, so a stale layout would pair moments with the wrong elements)."""

    def __init__(self, params: list, states: list, device: torch.device, state_keys: tuple):
        steps = [torch.as_tensor(s["step"]).detach().reshape(()).to(device, torch.float32)
                 for s in states]
        self.params = params
        self.layouts = [(p.shape, p.stride()) for p in params]
        self.steps = torch.stack(steps)
        for state, view in zip(states, self.steps.unbind(0)):
            state["step"] = view
        self.state_keys = ("step",) + state_keys
        self.tensors = {k: [s[k] for s in states] for k in self.state_keys}

    def matches(self, params: list, state: dict, state_keys: tuple) -> bool:
        if len(params) != len(self.params) or self.state_keys[1:] != state_keys:
            return False
        columns = [self.tensors[k] for k in self.state_keys]
        for i, (p, mine, layout) in enumerate(zip(params, self.params, self.layouts)):
            st = state.get(p) if p is mine else None
            if st is None or any(st.get(k) is not col[i] for k, col in zip(self.state_keys, columns)):
                return False
            if p.stride() != layout[1] or p.shape != layout[0] or p.is_neg():
                return False
        return True


def _check_no_duplicates(params: list, where: str) -> None:
    """One param twice in a group: torch warns and steps it twice; the fused step would write it
    from two places at once (and count one step). Refused."""
    seen = set()
    for p in params:
        t = p[1] if isinstance(p, tuple) and len(p) == 2 else p
        if id(t) in seen:
            raise ValueError(f"{where} lists a param twice (shape {tuple(t.shape)}); list each param once")
        seen.add(id(t))


class Adam(torch.optim.Adam):
    """``torch.optim.Adam`` whose step is one fused multi-tensor launch per group (see module doc).

    Extra keyword: ``master_weights`` (fp32 master copies for fp16/bf16 params).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False,
                 master_weights=False):
        if differentiable:
            raise ValueError("differentiable=True is not supported by tilefuse's fused Adam")
        self.master_weights = bool(master_weights)
        self._decoupled = bool(decoupled_weight_decay)
        self._step_groups: dict = {}
        extra = {"decoupled_weight_decay": self._decoupled} if _GROUP_HAS_DECOUPLED else {}
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable, differentiable=False,
                         fused=fused, **extra)
        # torch sets this for fused=True (GradScaler then passes grad_scale/found_inf): not ours
        self._step_supports_amp_scaling = False

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        if isinstance(params, set):     # torch's own TypeError (a set has no stable order)
            return super().add_param_group(param_group)
        # a generator (``m.parameters()``) is consumed here: the group keeps the list, as torch's does
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        param_group["params"] = params
        _check_no_duplicates(params, "the new group")
        for i, p in enumerate(params):
            if isinstance(p, tuple) and len(p) == 2:    # named parameters: (name, tensor)
                p = p[1]
            if isinstance(p, torch.Tensor) and p.dtype not in FLOAT_DTYPES:
                raise TypeError(f"param {i} of the new group has dtype {p.dtype}; tilefuse Adam "
                                f"supports float32, float16 and bfloat16 params")
            if isinstance(p, torch.Tensor) and (p.layout != torch.strided or not _dense(p)):
                raise ValueError(f"param {i} of the new group is not one dense block (shape {tuple(p.shape)}, "
                                 f"strides {p.stride()}): the fused step walks each param as one flat "
                                 f"block; pass a contiguous parameter")
        super().add_param_group(param_group)

    def __getstate__(self):
        # torch's keeps defaults, state and param_groups only: a deepcopy / pickle of the
        # optimizer would come back without its master copies' flag and train in 16 bits
        return {**super().__getstate__(), "master_weights": self.master_weights, "_decoupled": self._decoupled}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("master_weights", False)
        self.__dict__.setdefault("_decoupled", False)
        self._step_groups = {}

    # ------------------------------------------------------------------------------------------
    # step
    # ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One step for every param with a grad; returns ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_all()
        return loss

    def _masters_follow_params(self) -> None:
        """After a load: a master copy that no longer rounds to its param is replaced by the param.
        torch.optim keeps state keys it does not know, so a checkpoint that went through torch's
        AdamW carries our old master copy while the params trained on; stepping from that copy
        would roll them back. Checked at the first step after the load (the model's weights may be
        loaded after the optimizer's), not under CUDA-graph capture (it reads values)."""
        self._check_masters = False
        for group in self.param_groups:
            for p in group["params"]:
                master = self.state.get(p, {}).get("master_param")
                if master is not None and not torch.equal(master.to(p.dtype), p.detach()):
                    master.copy_(p.detach())

    @torch.compiler.disable
    def _step_all(self):
        if getattr(self, "_check_masters", False) and not any(
                p.is_cuda and torch.cuda.is_current_stream_capturing()
                for g in self.param_groups for p in g["params"][:1]):
            self._masters_follow_params()
        for index, group in enumerate(self.param_groups):
            buckets: dict = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(f"a param of group {index} has a sparse grad; Adam needs dense "
                                     f"gradients")
                buckets.setdefault((p.device, p.dtype), []).append(p)
            for key, params in buckets.items():
                self._step_bucket(group, (index, *key), params)

    def _step_bucket(self, group: dict, key: tuple, params: list) -> None:
        master = self.master_weights and key[2] in _LOW_PRECISION
        state_keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ()) \
            + (("master_param",) if master else ())
        step_group = self._step_groups.get(key)
        if step_group is None or not step_group.matches(params, self.state, state_keys):
            _check_no_duplicates(params, f"group {key[0]}")     # params put in param_groups by hand
            states = [self._init_state(p, group, master) for p in params]
            step_group = self._step_groups[key] = _StepGroup(params, states, key[1], state_keys)
        tensors = step_group.tensors
        beta1, beta2 = (float(b) for b in group["betas"])
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and (lr.device != key[1] or lr.is_neg()):
            # the kernel reads lr from the params' device, and reads storage raw: a negative
            # view (values stored negated) is resolved first (it stepped the wrong way)
            lr = lr.resolve_neg().to(key[1])
        run_step(
            params, [_grad_like_param(p) for p in params], tensors["exp_avg"], tensors["exp_avg_sq"],
            tensors.get("max_exp_avg_sq"), tensors.get("master_param"), step_group.steps, lr,
            beta1, beta2, float(group["eps"]), float(group["weight_decay"]), bool(group["maximize"]),
            bool(group.get("decoupled_weight_decay", self._decoupled)),
        )

    def _init_state(self, p: torch.Tensor, group: dict, master: bool) -> dict:
        """torch's lazy state init; also brings loaded state to the dtypes this step needs
        (fp32 moments beside an fp32 master, else the param's dtype) and adds missing pieces."""
        if p.layout != torch.strided or not _dense(p):    # a param put in param_groups by hand, or its .data swapped
            raise ValueError(f"a param of shape {tuple(p.shape)} has strides {p.stride()}, not one dense block: "
                             f"the fused step walks each param as one flat block; use a contiguous parameter")
        _check_not_negative_view(f"a param of shape {tuple(p.shape)}", p)   # the step writes it in place
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        wanted = {"exp_avg": None, "exp_avg_sq": None}
        if group["amsgrad"]:
            wanted["max_exp_avg_sq"] = None
        if master:
            wanted["master_param"] = p      # rebuilt from the param when a checkpoint lacks it
        for k, init in wanted.items():
            dtype = torch.float32 if master else p.dtype
            t = state.get(k)
            if t is not None and t.shape != p.shape:
                raise ValueError(f"state[{k!r}] of a param has shape {tuple(t.shape)}, the param "
                                 f"{tuple(p.shape)} (a checkpoint of another model?)")
            if t is None:
                t = torch.zeros_like(p, dtype=dtype) if init is None else init
            if t.dtype != dtype or t.device != p.device or t.stride() != p.stride() or t is p or t.is_neg():
                t = torch.empty_like(p, dtype=dtype).copy_(t)   # the param's layout: one flat walk
            state[k] = t
        return state

    # ------------------------------------------------------------------------------------------
    # state_dict: torch's layout both ways
    # ------------------------------------------------------------------------------------------

    def state_dict(self):
        """torch's state_dict; each ``step`` a standalone float32 scalar tensor, on the CPU unless
        the group is capturable or fused (where torch.optim.Adam keeps it too)."""
        sd = super().state_dict()
        on_host = {}
        for group in sd["param_groups"]:
            for idx in group["params"]:
                on_host[idx] = not (group.get("capturable") or group.get("fused"))
        state = {}
        for idx, st in sd["state"].items():
            st = dict(st)   # torch hands out our live per-param dicts; never rewrite those
            if "step" in st:
                step = st["step"].detach().to(torch.float32)
                st["step"] = step.cpu().clone() if on_host.get(idx, True) else step.clone()
            state[idx] = st
        sd["state"] = state
        return sd

    def load_state_dict(self, state_dict):
        """torch's load (which casts float state to each param's dtype); then the fp32 master
        state of master-weight params is restored at full precision from the checkpoint."""
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        super().load_state_dict(state_dict)
        self._step_groups = {}
        if not self.master_weights:
            return
        saved_ids = itertools.chain.from_iterable(g["params"] for g in saved_groups)
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for idx, p in zip(saved_ids, params):
            if p.dtype not in _LOW_PRECISION or idx not in saved_state:
                continue
            for k, v in saved_state[idx].items():
                if k != "step" and isinstance(v, torch.Tensor) and v.shape == p.shape:
                    self.state[p][k] = torch.empty_like(p, dtype=torch.float32).copy_(v)
        self._check_masters = True      # against the params at the next step (see _masters_follow_params)


class AdamW(Adam):
    """``torch.optim.AdamW`` (decoupled weight decay) whose step is one fused multi-tensor launch
    per group (see the module doc). Extra keyword: ``master_weights``."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, master_weights=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=True, master_weights=master_weights)

    def __setstate__(self, state):
        super().__setstate__(state)
        self._decoupled = True
        if _GROUP_HAS_DECOUPLED:
            for group in self.param_groups:
                group["decoupled_weight_decay"] = True   # as torch.optim.AdamW: loaded state is AdamW


def _grad_like_param(p: torch.Tensor) -> torch.Tensor:
    """The kernel walks param and grad as one flat block each: a grad laid out differently
    (possible for non-contiguous params) is copied into the param's layout first."""
    g = p.grad
    if g.is_neg():          # values stored negated (torch._neg_view, z.conj().imag): the kernel reads storage raw
        g = g.resolve_neg()
    if g.stride() == p.stride() or p.numel() <= 1:
        return g
    return torch.empty_like(p).copy_(g)
