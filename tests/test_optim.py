"""tilefuse.optim.Adam / AdamW and the adamw_step functional beyond the registry sweep:
trajectories against torch.optim, master weights, state_dict both ways, options, layouts,
empty and grad-less params, bad input, CUDA-graph capture (GPU)."""

import copy
import io

import pytest
import torch
from conftest import DEVICE, HAS_CUDA
from hypothesis import given, settings
from hypothesis import strategies as st

import tilefuse.ops._adam_kernels as K
import tilefuse.ops.adamw as A   # registers the "adamw" spec (before ops/__init__ imports it)
from tilefuse.optim import Adam, AdamW
from tilefuse.testing import rel_err

FP32_TOL = 1e-5
# The moments are averages of unit-scale random gradients; where one cancels to near 0 (a 1-element
# param, a few % of runs) its few ulps of rounding per step (~1e-7 each) are not small relative
# to it, so they are compared elementwise with this absolute floor (~16 ulps of 1.0) beside FP32_TOL.
# The params too: a 1-element param that ends a trajectory near 0 (|p| ~ 1e-3, ~3e-3 of runs) failed
# a relative norm at 2.7x with our steps and torch's 1.2e-7 apart (s45).
STATE_ATOL = 1e-6
SMALL = {"BLOCK": 128, "CHUNK": 512, "num_warps": 4}   # several chunks per tensor on tiny shapes
SHAPES = [(7,), (33, 17), (1,), (1500,), (3, 4, 5)]    # 1500: two whole chunks and a tail


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    """Interpreted runs use small chunks so whole (unmasked) and tail chunks both occur."""
    if not HAS_CUDA:
        monkeypatch.setattr(K, "_default_config", lambda: dict(SMALL))


def _twin_params(shapes, dtype=torch.float32, device=DEVICE):
    ours = [torch.nn.Parameter(torch.randn(s, device=device).to(dtype)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    return ours, theirs


def _groups(params, split, **second):
    return [{"params": params[:split]}, {"params": params[split:], **second}]


def _set_grads(ours, theirs, step, skip=None):
    for i, (p, q) in enumerate(zip(ours, theirs)):
        if skip is not None and i == skip and step % 3 == 1:
            p.grad = q.grad = None            # this param sits out some steps
            continue
        g = torch.randn_like(q, dtype=torch.float32)
        p.grad, q.grad = g.to(p.dtype), g.to(q.dtype)


def _assert_close(ours, theirs, opt, ref, tol=FP32_TOL):
    for i, (p, q) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(p, q, rtol=tol, atol=STATE_ATOL, msg=lambda m, i=i: f"param {i}: {m}")
        if q in ref.state:
            for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if k in ref.state[q]:
                    torch.testing.assert_close(opt.state[p][k], ref.state[q][k], rtol=tol, atol=STATE_ATOL,
                                               msg=lambda m, i=i, k=k: f"param {i} {k}: {m}")
            assert float(opt.state[p]["step"]) == float(ref.state[q]["step"])


# ----------------------------------------------------------------------------------------------
# trajectories against torch.optim
# ----------------------------------------------------------------------------------------------

CASES = [
    # (ours, torch's, shared kwargs, second group's overrides, steps)
    (AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, maximize=True),
     dict(lr=3e-3, weight_decay=0.3), 100),
    (AdamW, torch.optim.AdamW, dict(lr=5e-3, betas=(0.8, 0.99), eps=1e-6, amsgrad=True),
     dict(lr=1e-2), 30),
    (Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05), dict(lr=2e-3, weight_decay=0.0), 30),
    (Adam, torch.optim.Adam, dict(lr=1e-2, betas=(0.0, 0.9)), dict(maximize=True, amsgrad=True), 20),
]


@pytest.mark.parametrize("ours_cls,torch_cls,kwargs,second,steps", CASES,
                         ids=["adamw-wd-maximize", "adamw-amsgrad", "adam-l2", "adam-beta1-0"])
def test_trajectory_matches_torch(ours_cls, torch_cls, kwargs, second, steps):
    """Two groups with different lr / weight decay, odd sizes, a param whose grad is None on
    some steps: every param, moment and step count agrees with torch.optim to fp32 rounding."""
    ours, theirs = _twin_params(SHAPES)
    opt = ours_cls(_groups(ours, 2, **second), **kwargs)
    ref = torch_cls(_groups(theirs, 2, **second), foreach=False, **kwargs)
    for step in range(steps):
        _set_grads(ours, theirs, step, skip=1)
        opt.step()
        ref.step()
    _assert_close(ours, theirs, opt, ref)


def test_zero_grad_skips_every_param():
    ours, theirs = _twin_params(SHAPES[:2])
    opt = AdamW(ours, lr=0.1)
    _set_grads(ours, theirs, 0)
    opt.step()
    before = [p.detach().clone() for p in ours]
    opt.zero_grad()
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ours, before))
    assert all(float(opt.state[p]["step"]) == 1.0 for p in ours)


def test_tensor_lr_is_read_on_device_each_step():
    """A tensor lr changed in place between steps (what a scheduler does under CUDA graphs)."""
    ours, theirs = _twin_params(SHAPES[:3])
    lr = torch.tensor(0.01, device=DEVICE)
    opt = AdamW(ours, lr=lr, capturable=True)
    ref = torch.optim.AdamW(theirs, lr=0.01, foreach=False)
    for step in range(6):
        _set_grads(ours, theirs, step)
        lr.fill_(0.01 * (step + 1))
        ref.param_groups[0]["lr"] = 0.01 * (step + 1)
        opt.step()
        ref.step()
    _assert_close(ours, theirs, opt, ref)


def test_non_contiguous_and_unaligned_params():
    """A transposed (dense, non-contiguous) param and params that are views at odd offsets
    into one flat buffer (not 16-byte aligned: the kernel must not promise alignment)."""
    flat = torch.randn(1 + 300 + 2 + 77, device=DEVICE)
    ours = [torch.nn.Parameter(torch.randn(40, 9, device=DEVICE).t()),
            torch.nn.Parameter(flat[1:301].view(20, 15)), torch.nn.Parameter(flat[303:380])]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt, ref = AdamW(ours, lr=0.02), torch.optim.AdamW(theirs, lr=0.02, foreach=False)
    for step in range(5):
        _set_grads(ours, theirs, step)
        ours[0].grad = ours[0].grad.contiguous()    # a grad not in the param's layout
        opt.step()
        ref.step()
    _assert_close(ours, theirs, opt, ref)
    assert not ours[0].is_contiguous()


def test_empty_params_are_counted_but_untouched():
    ours, theirs = _twin_params([(0,), (5,), (3, 0)])
    opt, ref = AdamW(ours, lr=0.1), torch.optim.AdamW(theirs, lr=0.1, foreach=False)
    for step in range(3):
        _set_grads(ours, theirs, step)
        opt.step()
        ref.step()
    _assert_close(ours, theirs, opt, ref)
    assert float(opt.state[ours[0]]["step"]) == 3.0


def test_cpu_reference_path_matches_torch(monkeypatch):
    """Without TRITON_INTERPRET, CPU params take the plain-PyTorch loop; same trajectory."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ours, theirs = _twin_params(SHAPES, device="cpu")
    opt = AdamW(_groups(ours, 2, lr=1e-3), lr=1e-2, amsgrad=True)
    ref = torch.optim.AdamW(_groups(theirs, 2, lr=1e-3), lr=1e-2, amsgrad=True, foreach=False)
    for step in range(10):
        _set_grads(ours, theirs, step, skip=0)
        opt.step()
        ref.step()
    _assert_close(ours, theirs, opt, ref)


# ----------------------------------------------------------------------------------------------
# master weights
# ----------------------------------------------------------------------------------------------

LOW_DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_master_weights_follow_fp32_trajectory(dtype):
    """fp16/bf16 params with fp32 masters track an fp32 AdamW fed the same (rounded) grads;
    each param is exactly its master rounded; the moments are fp32."""
    ours = [torch.nn.Parameter(torch.randn(s, device=DEVICE).to(dtype)) for s in SHAPES]
    theirs = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt = AdamW(_groups(ours, 2, lr=3e-3), lr=1e-2, weight_decay=0.1, master_weights=True)
    ref = torch.optim.AdamW(_groups(theirs, 2, lr=3e-3), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(25):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.float()
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32 and opt.state[p]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(master, q.detach(), rtol=FP32_TOL, atol=STATE_ATOL)
        assert torch.equal(p.detach(), master.to(dtype))


def test_without_master_weights_state_is_in_param_dtype():
    p = torch.nn.Parameter(torch.randn(100, device=DEVICE).half())
    opt = AdamW([p])
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float16 and "master_param" not in opt.state[p]


# ----------------------------------------------------------------------------------------------
# state_dict interchange with torch.optim.AdamW
# ----------------------------------------------------------------------------------------------


def _save_load(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _torch_adamw(params, **kw):
    return torch.optim.AdamW(_groups(params, 2, lr=4e-3), foreach=False, **kw)


def _our_adamw(params, **kw):
    return AdamW(_groups(params, 2, lr=4e-3), **kw)


@pytest.mark.parametrize("first_is_torch", [True, False], ids=["torch_to_ours", "ours_to_torch"])
def test_state_dict_interchange(first_is_torch):
    """Train a few steps with one, checkpoint, continue with the other: same trajectory as
    continuing with the first; keys and step type are torch's."""
    kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=True)
    make_first, make_second = (_torch_adamw, _our_adamw) if first_is_torch else (_our_adamw, _torch_adamw)
    first_params, second_params = _twin_params(SHAPES)
    first = make_first(first_params, **kw)
    for step in range(4):
        _set_grads(first_params, second_params, step, skip=3)
        first.step()
    with torch.no_grad():
        for p, q in zip(first_params, second_params):
            q.copy_(p)
    sd = _save_load(first.state_dict())
    second = make_second(second_params, **kw)
    second.load_state_dict(sd)
    for group in sd["state"].values():
        assert set(group) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
        assert group["step"].dtype == torch.float32 and group["step"].device.type == "cpu"
    assert second.state_dict()["param_groups"] == first.state_dict()["param_groups"]
    for step in range(4, 10):
        _set_grads(first_params, second_params, step, skip=3)
        first.step()
        second.step()
    if first_is_torch:
        _assert_close(second_params, first_params, second, first)
    else:
        _assert_close(first_params, second_params, first, second)


def test_master_state_survives_a_round_trip():
    """Our checkpoint keeps the fp32 master and moments; loading it back is lossless even though
    torch's loader casts state to the param dtype. A torch (fp16-state) checkpoint rebuilds them."""
    ps = [torch.nn.Parameter(torch.randn(s, device=DEVICE).half()) for s in SHAPES[:3]]
    opt = AdamW(ps, lr=1e-2, master_weights=True)
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    sd = _save_load(opt.state_dict())
    clone = AdamW([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=1e-2, master_weights=True)
    clone.load_state_dict(sd)
    for p, q in zip(ps, clone.param_groups[0]["params"]):
        for k in ("exp_avg", "exp_avg_sq", "master_param"):
            assert clone.state[q][k].dtype == torch.float32
            assert torch.equal(clone.state[q][k], opt.state[p][k])
    torch_opt = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=1e-2)
    torch_opt.load_state_dict(copy.deepcopy(sd))
    again = AdamW([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=1e-2, master_weights=True)
    again.load_state_dict(_save_load(torch_opt.state_dict()))
    for q in again.param_groups[0]["params"]:
        q.grad = torch.randn_like(q)
    again.step()
    for q in again.param_groups[0]["params"]:
        assert again.state[q]["master_param"].dtype == torch.float32


@pytest.mark.parametrize("weights_first", [True, False])
def test_master_copy_that_torch_carried_does_not_roll_params_back(weights_first):
    """Our checkpoint -> torch's AdamW trains on (keeping our master_param key) -> back to ours: the
    stale master copy must not replace the params, whichever of the model's and the optimizer's
    state is loaded first; a consistent master copy keeps its fp32 bits."""
    p = torch.nn.Parameter(torch.randn(300, device=DEVICE).half())
    ours = AdamW([p], lr=0.05, master_weights=True)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        ours.step()
    q = torch.nn.Parameter(p.detach().clone())
    theirs = torch.optim.AdamW([q], lr=0.05)
    theirs.load_state_dict(_save_load(ours.state_dict()))
    for _ in range(10):
        q.grad = torch.randn_like(q)
        theirs.step()
    sd = _save_load(theirs.state_dict())
    assert "master_param" in sd["state"][0]
    r = torch.nn.Parameter(torch.zeros_like(q) if not weights_first else q.detach().clone())
    again = AdamW([r], lr=0.05, master_weights=True)
    again.load_state_dict(sd)
    if not weights_first:
        with torch.no_grad():
            r.copy_(q)                                    # the model's weights loaded after
    again.param_groups[0]["lr"] = 0.0
    r.grad = torch.randn_like(r)
    again.step()
    assert torch.equal(r, q)                              # lr 0: the params as torch left them
    mine = AdamW([torch.nn.Parameter(p.detach().clone())], lr=0.0, master_weights=True)
    mine.load_state_dict(_save_load(ours.state_dict()))
    mine.param_groups[0]["lr"] = 0.0                      # (the load restored the checkpoint's lr)
    mine.param_groups[0]["params"][0].grad = torch.randn_like(p)
    mine.step()
    assert torch.equal(mine.state[mine.param_groups[0]["params"][0]]["master_param"],
                       ours.state[p]["master_param"])     # consistent: the fp32 bits kept


# ----------------------------------------------------------------------------------------------
# the functional, against the fp64 reference
# ----------------------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.integers(0, 1300), min_size=1, max_size=4), maximize=st.booleans(),
       amsgrad=st.booleans(), decoupled=st.booleans(), weight_decay=st.sampled_from([0.0, 0.2]),
       master=st.booleans(), lr_tensor=st.booleans(), half=st.booleans())
def test_functional_options_match_reference(sizes, maximize, amsgrad, decoupled, weight_decay,
                                            master, lr_tensor, half):
    dtype = torch.float16 if half else torch.float32
    n = len(sizes)
    params = [torch.randn(s, device=DEVICE).to(dtype) for s in sizes]
    masters = [p.float() for p in params] if master else None
    state_dtype = torch.float32 if master else dtype
    grads = [torch.randn_like(p) for p in params]
    ms = [(0.1 * torch.randn(s, device=DEVICE)).to(state_dtype) for s in sizes]
    vs = [(0.01 * torch.rand(s, device=DEVICE) + 1e-3).to(state_dtype) for s in sizes]
    vmax = [v + 0.01 * torch.rand_like(v) for v in vs] if amsgrad else None
    steps = torch.randint(0, 9, (n,), device=DEVICE).float()
    lr = torch.tensor(0.05, device=DEVICE) if lr_tensor else 0.05
    wide = lambda ts: None if ts is None else [t.double() for t in ts]   # noqa: E731
    ref = dict(params=wide(masters or params), grads=wide(grads), ms=wide(ms), vs=wide(vs),
               vmax=wide(vmax))
    ref_steps = steps.double()
    A.adamw_step(params, grads, ms, vs, steps, lr, 0.9, 0.999, 1e-8, weight_decay, maximize,
                 max_exp_avg_sqs=vmax, master_params=masters, decoupled_weight_decay=decoupled)
    A.adam_reference(ref["params"], ref["grads"], ref["ms"], ref["vs"], ref_steps, 0.05, 0.9, 0.999,
                     1e-8, weight_decay, maximize, max_exp_avg_sqs=ref["vmax"],
                     decoupled_weight_decay=decoupled)
    assert torch.equal(steps.double(), ref_steps)
    for i in range(n):
        pairs = [(params[i], ref["params"][i]), (ms[i], ref["ms"][i]), (vs[i], ref["vs"][i])]
        pairs += [(masters[i], ref["params"][i])] if master else []
        pairs += [(vmax[i], ref["vmax"][i])] if amsgrad else []
        for j, (out, expect) in enumerate(pairs):
            # elementwise with STATE_ATOL: a 1-element m' = 0.9·m + 0.1·g can land near 0 (s45)
            torch.testing.assert_close(out.double(), expect, rtol=FP32_TOL if out.dtype == torch.float32 else 2e-3,
                                       atol=STATE_ATOL, msg=lambda m, i=i, j=j: f"tensor {i}, state {j}: {m}")


def test_stacked_rows_and_lists_agree():
    """A 2-D tensor stands for the list of its rows (the registry's form)."""
    inp = A._make_inputs((3, 700), torch.float32, DEVICE)
    lists = [[r.clone() for r in t] for t in inp.args[:4]] + [inp.args[4].clone()]
    out = A.adamw_step(*inp.args, **inp.kwargs)
    A.adamw_step(*lists, **inp.kwargs)
    assert out[0] is inp.args[0]
    for stacked, rows in zip(inp.args[:4], lists[:4]):
        assert torch.equal(stacked, torch.stack(rows))


def test_adam_step_is_l2_adamw_step():
    inp = A._make_inputs((2, 300), torch.float32, DEVICE)
    twin = [t.clone() for t in inp.args]
    A.adam_step(*inp.args, **inp.kwargs)
    A.adamw_step(*twin, **inp.kwargs, decoupled_weight_decay=False)
    assert all(torch.equal(a, b) for a, b in zip(inp.args, twin))


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------


def _good(n=2, size=10):
    ps = [torch.randn(size, device=DEVICE) for _ in range(n)]
    return dict(params=ps, grads=[torch.randn_like(p) for p in ps],
                exp_avgs=[torch.zeros_like(p) for p in ps], exp_avg_sqs=[torch.zeros_like(p) for p in ps],
                state_steps=torch.zeros(n, device=DEVICE))


def _int_param(a):
    a["params"][0] = torch.arange(10, device=DEVICE)


@pytest.mark.parametrize("change,error,match", [
    (_int_param, TypeError, "params\\[0\\]"),
    (lambda a: a.update(grads=a["grads"][:1]), ValueError, "grads has 1"),
    (lambda a: a["grads"].__setitem__(1, a["grads"][1].half()), TypeError, "grads\\[1\\]"),
    (lambda a: a["grads"].__setitem__(0, a["grads"][0].to_sparse()), ValueError, "is sparse"),
    (lambda a: a["exp_avgs"].__setitem__(1, torch.zeros(11, device=DEVICE)), ValueError, "exp_avgs"),
    (lambda a: a.update(state_steps=torch.zeros(2, dtype=torch.int64)), TypeError, "state_steps"),
    (lambda a: a.update(state_steps=torch.zeros(3, device=DEVICE)), ValueError, "state_steps"),
    (lambda a: a["params"].__setitem__(1, a["params"][1].half()), TypeError, "params\\[1\\]"),
    (lambda a: a.update(lr=-1.0), ValueError, "lr"),
    (lambda a: a.update(beta2=1.0), ValueError, "beta2"),
    (lambda a: a.update(params=5), TypeError, "params"),
], ids=["int-param", "lengths", "grad-dtype", "sparse-grad", "state-shape", "steps-dtype",
        "steps-length", "mixed-dtypes", "lr", "beta2", "not-a-list"])
def test_functional_rejects_bad_input(change, error, match):
    args = _good()
    change(args)
    with pytest.raises(error, match=match):
        A.adamw_step(**args)


def test_optimizer_rejects_bad_input():
    with pytest.raises(TypeError, match="dtype"):
        AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    with pytest.raises(ValueError, match="differentiable"):
        AdamW([torch.nn.Parameter(torch.zeros(3))], differentiable=True)
    base = torch.zeros(10, 20, device=DEVICE)
    with pytest.raises(ValueError, match="not one dense block"):          # the kernel walks numel
        AdamW([torch.nn.Parameter(base[:, :5])])                         # elements from data_ptr
    p = torch.nn.Parameter(torch.zeros(4, 4, device=DEVICE))
    p.grad = torch.eye(4, device=DEVICE).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        AdamW([p]).step()
    # named parameters get the same checks (a (name, tensor) pair used to skip them)
    with pytest.raises(TypeError, match="dtype"):
        AdamW([("w", torch.nn.Parameter(torch.zeros(3, dtype=torch.cfloat)))])
    with pytest.raises(ValueError, match="not one dense block"):
        AdamW([("w", torch.nn.Parameter(base[:, :5]))])


@pytest.mark.parametrize("named", [False, True])
def test_param_groups_from_generators_match_torch(named):
    """Groups given as generators (``{'params': m.parameters()}``, add_param_group(...)) keep
    their params, as torch's do (the checks used to consume the generator: empty groups whose
    params never trained), with plain and named parameters."""
    torch.manual_seed(0)
    mods = [torch.nn.Linear(3, 4).to(DEVICE) for _ in range(3)]
    twins = copy.deepcopy(mods)

    def params(m):
        return m.named_parameters() if named else m.parameters()

    def build(cls, ms):
        opt = cls([{"params": params(ms[0])}, {"params": params(ms[1]), "lr": 1e-2}], lr=0.1, weight_decay=0.1)
        opt.add_param_group({"params": params(ms[2]), "lr": 3e-2})
        return opt

    ours, ref = build(AdamW, mods), build(torch.optim.AdamW, twins)
    assert [len(g["params"]) for g in ours.param_groups] == [2, 2, 2]
    x = torch.randn(5, 3, device=DEVICE)
    for _ in range(3):
        for opt, ms in ((ours, mods), (ref, twins)):
            opt.zero_grad()
            sum(m(x).square().sum() for m in ms).backward()
            opt.step()
    for m, t in zip(mods, twins):
        for p, q in zip(m.parameters(), t.parameters()):
            assert rel_err(p, q) < 1e-6
    with pytest.raises(TypeError):      # torch's own error for a set
        AdamW([{"params": set(mods[0].parameters())}])


# ----------------------------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("evict", [False, True])
def test_cuda_graph_capture_matches_eager_torch(evict):
    """step() captured in a CUDA graph (device steps, tensor lr changed between replays) follows
    torch.optim.AdamW(capturable=True) run eagerly. ``evict``: between capture and replay, 20
    other optimizers of the same sizes step (more than the table cache holds): the captured
    pointer tables must outlive their cache entries, or a replay reads freed memory that the
    others' tables now occupy and updates their params (s38 audit)."""
    ours, theirs = _twin_params([(4097,), (33, 65), (1,)], device="cuda")
    lr, ref_lr = torch.tensor(1e-2, device="cuda"), torch.tensor(1e-2, device="cuda")
    opt = AdamW(ours, lr=lr, capturable=True, weight_decay=0.1)
    ref = torch.optim.AdamW(theirs, lr=ref_lr, capturable=True, weight_decay=0.1)
    static_grads = [torch.randn_like(p) for p in ours]
    for p, g in zip(ours, static_grads):
        p.grad = g
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.step()                                   # warm-up: builds the pointer tables
    torch.cuda.current_stream().wait_stream(side)
    for q, g in zip(theirs, static_grads):
        q.grad = g.clone()
    ref.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    others = []
    for _ in range(20 if evict else 0):
        params = [torch.nn.Parameter(torch.randn(p.shape, device="cuda")) for p in ours]
        for p in params:
            p.grad = torch.randn_like(p)
        AdamW(params, lr=1e-2).step()
        others.append((params, [p.detach().clone() for p in params]))
    for step in range(5):
        new = [torch.randn_like(g) for g in static_grads]
        for g, n_, q in zip(static_grads, new, theirs):
            g.copy_(n_)
            q.grad = n_.clone()
        lr.fill_(1e-2 / (step + 2))
        ref_lr.fill_(1e-2 / (step + 2))
        graph.replay()
        ref.step()
    torch.cuda.synchronize()
    _assert_close(ours, theirs, opt, ref)
    for params, after_their_step in others:        # the replays never touched them
        assert all(torch.equal(p, q) for p, q in zip(params, after_their_step))


@pytest.mark.gpu
@pytest.mark.bigmem
def test_int64_offsets_past_2_31_elements():
    """One fp16 tensor of 2^31 + 2^12 + 5 elements: the tail is updated at the right offsets
    (checked elementwise against the reference on copies of the tail)."""
    n = 2**31 + 2**12 + 5
    p = torch.randn(n, device="cuda", dtype=torch.float16)
    g = torch.randn(n, device="cuda", dtype=torch.float16)
    m = torch.zeros(n, device="cuda", dtype=torch.float16)
    v = torch.zeros(n, device="cuda", dtype=torch.float16)
    tail = slice(n - 10000, n)
    ref = [t[tail].double() for t in (p, g, m, v)]
    A.adamw_step([p], [g], [m], [v], torch.zeros(1, device="cuda"), lr=0.1)
    ref_steps = torch.zeros(1, dtype=torch.float64, device="cuda")
    A.adamw_reference([ref[0]], [ref[1]], [ref[2]], [ref[3]], ref_steps, lr=0.1)
    assert rel_err(p[tail], ref[0]) <= 2e-3 and rel_err(m[tail], ref[2]) <= 2e-3


# ----------------------------------------------------------------------------------------------
# params changed after the launch group was cached (s41 audit)
# ----------------------------------------------------------------------------------------------


def _grads_like(ours, theirs):
    for p, q in zip(ours, theirs):
        g = torch.randn_like(q)
        p.grad, q.grad = g.clone(), g.clone()


def test_data_swapped_to_another_layout_rebuilds_the_step():
    """``model.to(memory_format=torch.channels_last)`` swaps a param's .data after steps were
    taken: the cached launch walked the NHWC param beside NCHW moments (exp_avg 1.03 off, weight
    1.2e-2 off after two steps under the interpreter). Now the group is rebuilt with the moments
    in the param's layout: the trajectory stays torch's."""
    ours, theirs = _twin_params([(2, 3, 2, 2), (5,)])
    opt, ref = AdamW(ours, lr=1e-2), torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    _grads_like(ours, theirs)
    opt.step(), ref.step()
    for p in ours[:1] + theirs[:1]:
        p.data = p.data.to(memory_format=torch.channels_last)
    for _ in range(2):
        _grads_like(ours, theirs)
        ours[0].grad = ours[0].grad.to(memory_format=torch.channels_last)
        opt.step(), ref.step()
    for p, q in zip(ours, theirs):
        assert rel_err(p, q) <= FP32_TOL
        assert rel_err(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"]) <= FP32_TOL


def test_data_resized_raises_instead_of_writing_past_the_state():
    """A param's .data replaced by a larger tensor: the cached launch wrote past the 4-element
    moments (heap corruption under the interpreter); torch raises, and so does this now."""
    (p,), _ = _twin_params([(4,)])
    opt = Adam([p])
    p.grad = torch.randn_like(p)
    opt.step()
    p.data = torch.randn(40, device=DEVICE)
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match="shape"):
        opt.step()


def test_non_dense_param_put_in_param_groups_by_hand_raises():
    """add_param_group refuses a non-dense param; one appended to param_groups[i]["params"]
    directly was walked as a flat block (elements outside the view overwritten)."""
    base = torch.randn(4, 6, device=DEVICE)
    q = torch.nn.Parameter(torch.randn(3, device=DEVICE))
    opt = AdamW([q])
    view = base[:, :3]
    view.grad = torch.randn_like(view)
    opt.param_groups[0]["params"].append(view)
    before = base[:, 3:].clone()
    q.grad = torch.randn_like(q)
    with pytest.raises(ValueError, match="dense"):
        opt.step()
    assert torch.equal(base[:, 3:], before)


def test_duplicate_param_in_a_group_raises():
    """torch warns and steps a param listed twice twice; the fused step would write it from two
    places and count one step (3 against torch's 6 after 3 steps). Refused, in add_param_group
    and for a list edited by hand."""
    (p,), _ = _twin_params([(5,)])
    with pytest.raises(ValueError, match="twice"):
        AdamW([p, p])
    opt = AdamW([p])
    opt.param_groups[0]["params"].append(p)
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match="twice"):
        opt.step()


def test_deepcopy_and_pickle_keep_master_weights():
    """copy.deepcopy / torch.save of the optimizer kept torch's keys only: the copy trained
    without its fp32 masters (fp16 moments, a stale master 0.028 off after 20 steps)."""
    (p,), _ = _twin_params([(8,)], dtype=torch.float16)
    opt = AdamW([p], master_weights=True)
    p.grad = torch.randn_like(p)
    opt.step()
    for copied in (copy.deepcopy(opt), _pickled(opt)):
        assert copied.master_weights and copied._decoupled == opt._decoupled


def _pickled(opt):
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_negative_views_step_the_right_way():
    """A grad or a tensor lr with the negative bit set (values stored negated: torch._neg_view,
    z.conj().imag) was read raw by the optimizer's kernel, so the param moved the wrong way (3.6e-2
    relative after 3 steps; the 2026-12-07 audit): both are resolved now and the trajectory is
    torch's. A param that is a negative view is refused (the step writes it in place), as the
    functional adamw_step refuses it."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(50, device=DEVICE))
    q = torch.nn.Parameter(p.detach().clone())
    lr = torch._neg_view(torch.tensor(-1e-2, device=DEVICE))
    ours = AdamW([p], lr=lr)
    ref = torch.optim.AdamW([q], lr=1e-2, foreach=False)
    for _ in range(3):
        g = torch.randn(50, device=DEVICE)
        p.grad, q.grad = torch._neg_view(-g), g.clone()
        assert p.grad.is_neg()
        ours.step()
        ref.step()
    assert rel_err(p.detach(), q.detach()) <= 1e-6
    assert rel_err(ours.state[p]["exp_avg"], ref.state[q]["exp_avg"]) <= 1e-6
    bad = torch.nn.Parameter(torch._neg_view(torch.randn(8, device=DEVICE)))
    assert bad.is_neg()
    bad.grad = torch.randn(8, device=DEVICE)
    with pytest.raises(TypeError, match="negative view"):
        AdamW([bad]).step()
