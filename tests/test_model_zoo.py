"""The model zoo behind `antman bench models`: every model has its published parameter count, trains
for real on CPU (the cheap ones, at a tiny batch), runs a full-size step on the meta device (the
memory tracer's), and the meta-only paths (CTC kernels, batched GRU, fused attention and dropout)
match the operators they stand for."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from slurm_antman.lab.evaluation import model_zoo as mz
from slurm_antman.lab.evaluation import workloads


def test_names_are_the_workload_models():
    assert mz.NAMES == tuple(p.name for p in workloads.ZOO)
    assert set(mz.PUBLISHED_PARAMS_M) == set(mz.NAMES)


@pytest.mark.parametrize("name", mz.NAMES)
def test_param_count_matches_published(name):
    got = mz.build(name, "meta").param_count() / 1e6
    want = mz.PUBLISHED_PARAMS_M[name]
    assert abs(got / want - 1) <= 0.02, f"{name}: {got:.3f} M parameters, published {want:.3f} M"


def _keeps_state(opt: torch.optim.Optimizer) -> bool:
    # Plain SGD (no momentum) is the one optimizer here that keeps nothing per parameter.
    return not (isinstance(opt, torch.optim.SGD) and all(g["momentum"] == 0 for g in opt.param_groups))


@pytest.mark.parametrize("name", mz.NAMES)
def test_meta_step_at_profile_batch(name):
    loop = mz.build(name, "meta")
    assert loop.batch == workloads.BY_NAME[name].batch and loop.input_desc
    loop.step()
    assert loop.last_loss is not None and loop.last_loss.dim() == 0 and loop.last_loss.is_meta
    assert loop.inputs and all(t.is_meta for t in loop.inputs)
    stateful = _keeps_state(loop.optimizer)
    for pname, p in loop.model.named_parameters():
        assert p.is_meta, f"{name}.{pname} is on {p.device}"
        # Backward reached every parameter (zero_grad set them to None first).
        assert p.grad is not None and p.grad.shape == p.shape, f"{name}.{pname}: no gradient of its shape"
        state = loop.optimizer.state.get(p, {})
        assert state or not stateful, f"{name}.{pname}: the optimizer did not step it"
        for key, v in state.items():
            if torch.is_tensor(v) and v.dim() > 0:
                assert v.shape == p.shape, f"{name}.{pname}: optimizer state {key} is {tuple(v.shape)}"


@pytest.mark.parametrize("name,batch", [("rl_ppo_atari", 4), ("lstm_lm", 2), ("resnet50", 1),
                                        ("transformer_nmt", 1)])
def test_cpu_steps_train(name, batch):
    torch.manual_seed(0)
    loop = mz.build(name, "cpu", batch=batch)
    named = list(loop.model.named_parameters())
    before = [p.detach().clone() for _, p in named]
    losses = []
    for _ in range(2):
        loop.step()
        losses.append(loop.last_loss.item())
    assert all(math.isfinite(x) for x in losses), f"{name}: losses {losses}"
    assert losses[0] != losses[1], f"{name}: the first step changed nothing the second saw"
    unchanged = [n for (n, p), b in zip(named, before) if torch.equal(p.detach(), b)]
    assert not unchanged, f"{name}: parameters not trained: {unchanged[:5]}"


def test_ctc_meta_kernels_match_cpu():
    mz._ensure_ctc_meta_kernel()
    g = torch.Generator().manual_seed(0)
    t, b, c, lens = 30, 3, 29, [8, 5, 7]
    got = {}
    for dev in ("cpu", "meta"):
        log_probs = torch.randn(t, b, c, generator=g).log_softmax(-1).to(dev).requires_grad_()
        targets = torch.randint(1, c, (b, max(lens)), generator=g).to(dev)
        loss = F.ctc_loss(log_probs, targets, [t] * b, lens, reduction="none")
        loss.sum().backward()
        got[dev] = (loss.shape, log_probs.grad.shape, log_probs.grad.dtype)
    assert got["meta"] == got["cpu"]
    # The forward's saved variables too, in case the forward kernel is ours on this PyTorch.
    lp, tg = torch.randn(t, b, c, generator=g).log_softmax(-1), torch.randint(1, c, (b, 8), generator=g)
    real = torch.ops.aten._ctc_loss(lp, tg, [t] * b, lens)
    ours = mz._ctc_loss_meta(lp.to("meta"), tg.to("meta"), [t] * b, lens)
    assert [x.shape for x in ours] == [x.shape for x in real]


def test_meta_gru_standin_is_the_gru():
    torch.manual_seed(0)
    rnn = torch.nn.GRU(6, 5, bidirectional=True)
    # One time step from a zero state is where the batched stand-in and the recurrence agree exactly:
    # that pins the gate layout and equations. Longer sequences: same shapes.
    x = torch.randn(1, 3, 6)
    torch.testing.assert_close(mz._gru_all_steps(rnn, x), rnn(x)[0])
    x = torch.randn(7, 3, 6)
    assert mz._gru_all_steps(rnn.to("meta"), x.to("meta")).shape == rnn(x.to("meta"))[0].shape


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an operator returns, and which operators ran."""

    def __init__(self):
        super().__init__()
        self.most, self.ops = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(func.overloadpacket.__name__)
        self.most = max([self.most] + [t.numel() for t in tree_flatten(out)[0] if torch.is_tensor(t)])
        return out


def test_meta_attention_and_dropout_keep_what_cuda_keeps():
    # Self-attention over 512 positions: no (512 x 512) matrix per head may appear on meta, forward
    # or backward, as none does on a GPU; and dropout keeps a 1-byte mask, as CUDA's kernel does.
    b, h, t, hd = 2, 4, 512, 16
    attn = mz._Attention(h * hd, h, dropout=0.1, causal=True).to("meta")
    x = torch.empty(b, t, h * hd, device="meta", requires_grad=True)
    with _Largest() as seen:
        y = attn(x)
        y.sum().backward()
    assert y.shape == x.shape and x.grad.shape == x.shape
    assert seen.most < b * h * t * t, f"a {seen.most}-element tensor: the attention matrix was built"
    out, mask = torch.ops.aten.native_dropout(torch.empty(8, device="meta"), 0.1, True)
    with _Largest() as seen:
        mz._Dropout(0.1)(x)
    assert "native_dropout" in seen.ops and mask.dtype == torch.bool
    # Off meta they are the ordinary modules.
    cpu = mz._Attention(32, 4, dropout=0.0, causal=False)
    z = torch.randn(2, 5, 32)
    q, k, v = (t.view(2, 5, 4, 8).transpose(1, 2) for t in (cpu.q(z), *cpu.kv(z).chunk(2, -1)))
    want = cpu.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 32))
    torch.testing.assert_close(cpu(z), want)


def test_unknown_name_and_bad_batch():
    with pytest.raises(ValueError) as e:
        mz.build("nope")
    assert all(n in str(e.value) for n in mz.NAMES), str(e.value)
    with pytest.raises(ValueError, match="inception_v3"):
        mz.build("inception_v3", "meta", batch=1)
