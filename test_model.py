"""Tests of model.py: FM routing, decode parity of every mixer, overfitting, config validation, API."""

import math

import pytest
import torch
import torch.nn.functional as F

import fm_kernel
from model import FactorizationMemory, Model, ModelConfig

MIXERS = {  # name -> config overrides; the fm cases use m = 8
    'fm_dense': dict(mixer='fm'),
    'fm_sparse': dict(mixer='fm', top_k=3),
    'attn': dict(mixer='attn'),
    'mamba2': dict(mixer='mamba2'),
}


def tiny_config(**overrides):
    """2 layers, d_model 32, vocab 64, chunk 16: T = 37 spans three chunks, the last one partial."""
    config = dict(vocab_size=64, block_size=48, n_layer=2, d_model=32, n_memory=8, chunk_size=16,
                  n_head=4, n_kv_head=2, d_state=8, mamba_head_dim=16)
    config.update(overrides)
    return ModelConfig(**config)


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


# ----------------------------------------------------------------------------- FM routing

def fm_reference(layer, x):
    """The paper's equations written out: softmax router, top-k mask and renormalisation, naive scan."""
    alpha = torch.softmax(layer.router(x) / layer.tau, dim=-1)  # (B, T, M)
    mask = torch.zeros_like(alpha).scatter(-1, alpha.topk(layer.top_k, dim=-1).indices, 1.0)
    alpha = mask * alpha / (mask * alpha).sum(-1, keepdim=True)
    eta, mu = torch.sigmoid(layer.rates(x)).unbind(-1)  # (B, T)
    y, h = fm_kernel.fm_scan_naive(layer.in_proj(x), eta[..., None] * alpha, mu[..., None] * alpha, eps=layer.eps)
    return layer.out_proj(y), h


@pytest.mark.parametrize('top_k', [1, 3, 7, 8, None])
def test_fm_layer_matches_paper_equations(top_k):
    torch.manual_seed(0)
    layer = FactorizationMemory(tiny_config(top_k=top_k, tau=0.5)).double()
    for p in layer.parameters():  # weights large enough that routing is far from uniform
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 37, 32, dtype=torch.float64)
    y, state = layer(x)
    y_ref, h_ref = fm_reference(layer, x)
    assert rel_err(y, y_ref) < 1e-10
    assert rel_err(state['h'], h_ref) < 1e-10


def test_fm_sparse_with_k_equal_m_is_dense():
    torch.manual_seed(0)
    dense = FactorizationMemory(tiny_config(top_k=None)).double()
    sparse = FactorizationMemory(tiny_config(top_k=8)).double()
    sparse.load_state_dict(dense.state_dict())
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    assert torch.equal(sparse(x)[0], dense(x)[0])


@pytest.mark.parametrize('top_k', [1, 2, 5, 8])
def test_router_weights_sum_to_one_over_k_rows(top_k):
    torch.manual_seed(0)
    layer = FactorizationMemory(tiny_config(top_k=top_k))
    x = torch.randn(3, 10, 32)
    idx, alpha, eta, mu = layer.route(x)
    if idx is not None:
        alpha = torch.zeros(3, 10, 8).scatter(-1, idx, alpha)
    assert alpha.dtype == torch.float32
    assert ((alpha > 0).sum(-1) == top_k).all()
    torch.testing.assert_close(alpha.sum(-1), torch.ones(3, 10))
    kept = torch.softmax(layer.router(x), -1).topk(top_k, dim=-1).indices  # the k largest affinities
    assert (alpha.gather(-1, kept) > 0).all()
    assert ((eta > 0) & (eta < 1) & (mu > 0) & (mu < 1)).all()


# ----------------------------------------------------------------------------- every mixer

@pytest.mark.parametrize('name', MIXERS)
def test_step_and_prefill_match_forward(name):
    torch.manual_seed(0)
    model = Model(tiny_config(init_std=0.1, **MIXERS[name])).double().eval()
    idx = torch.randint(0, 64, (2, 37))
    logits, _ = model(idx)  # (B, T, V)

    state = model.init_state(2)
    stepped = []
    for t in range(idx.shape[1]):
        step_logits, state = model.step(idx[:, t], state)
        stepped.append(step_logits)
    assert rel_err(torch.stack(stepped, 1), logits) < 1e-9

    last_logits, state = model.prefill(idx[:, :21])
    continued = [last_logits]
    for t in range(21, idx.shape[1]):
        step_logits, state = model.step(idx[:, t], state)
        continued.append(step_logits)
    assert rel_err(torch.stack(continued, 1), logits[:, 20:]) < 1e-9


@pytest.mark.parametrize('name', MIXERS)
def test_overfits_one_batch(name):
    torch.manual_seed(0)
    model = Model(tiny_config(**MIXERS[name]))
    optimizer = model.configure_optimizers(0.0, 1e-2, (0.9, 0.95), 'cpu')
    idx = torch.randint(0, 64, (4, 33))
    losses = []
    for _ in range(40):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert math.isclose(losses[0], math.log(64), rel_tol=0.05)  # a fresh model predicts near uniformly
    assert losses[-1] < losses[0] / 2, losses


@pytest.mark.parametrize('name', MIXERS)
def test_bf16_autocast_trains(name):
    torch.manual_seed(0)
    model = Model(tiny_config(**MIXERS[name]))
    idx = torch.randint(0, 64, (2, 20))
    targets = idx.roll(-1, 1)
    targets[:, -1] = -1  # ignored
    with torch.autocast('cpu', dtype=torch.bfloat16):
        logits, loss = model(idx, targets)
    loss.backward()
    assert logits.dtype == torch.float32
    assert all(p.grad is None or p.grad.isfinite().all() for p in model.parameters())
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, :-1].flatten())
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize('name', MIXERS)
def test_generate(name):
    torch.manual_seed(0)
    model = Model(tiny_config(init_std=0.1, **MIXERS[name]))
    prompt = torch.randint(0, 64, (2, 5))
    out = model.generate(prompt, max_new_tokens=7, temperature=0.8, top_k=10)
    assert out.shape == (2, 12) and torch.equal(out[:, :5], prompt)
    assert out.min() >= 0 and out.max() < 64
    assert torch.equal(model.generate(prompt, max_new_tokens=0), prompt)

    greedy = model.generate(prompt, max_new_tokens=6, top_k=1)  # top_k=1 is argmax decoding
    expected = prompt
    for _ in range(6):
        next_token = model(expected)[0][:, -1].argmax(-1, keepdim=True)
        expected = torch.cat([expected, next_token], 1)
    assert torch.equal(greedy, expected)


# ----------------------------------------------------------------------------- config and accounting

@pytest.mark.parametrize('overrides, field', [
    (dict(top_k=0), 'top_k'),
    (dict(top_k=9), 'top_k'),
    (dict(mixer='rnn'), 'mixer'),
    (dict(d_model=0), 'd_model'),
    (dict(n_layer=-1), 'n_layer'),
    (dict(tau=0.0), 'tau'),
    (dict(n_memory=0), 'n_memory'),
    (dict(mixer='attn', d_model=30), 'd_model'),
    (dict(mixer='attn', n_kv_head=3), 'n_kv_head'),
    (dict(mixer='attn', d_model=36), 'n_head'),
    (dict(mixer='mamba2', mamba_head_dim=24), 'mamba_head_dim'),
    (dict(mixer='mamba2', d_state=0), 'd_state'),
])
def test_bad_config_raises_naming_the_field(overrides, field):
    config = tiny_config(**overrides)
    with pytest.raises(ValueError, match=rf'\b{field}\b'):
        config.validate()
    with pytest.raises(ValueError, match=rf'\b{field}\b'):
        Model(config)


def test_defaults_resolve():
    config = ModelConfig()
    config.validate()
    assert (config.ffn_dim, config.memory_dim, config.k, config.kv_heads) == (704, 256, 64, 8)


@pytest.mark.parametrize('tie', [True, False])
def test_num_params(tie):
    model = Model(tiny_config(tie_embeddings=tie))
    embedding = 64 * 32
    total = sum(p.numel() for p in model.parameters())
    assert model.num_params(non_embedding=False) == total
    assert model.num_params() == total - embedding * (1 if tie else 2) > 0


def test_flops_per_token():
    fm_dense, fm_sparse, attn, mamba2 = (Model(tiny_config(**MIXERS[name])) for name in MIXERS)
    for model in (fm_dense, fm_sparse, attn, mamba2):
        assert model.flops_per_token(48) > 6 * model.num_params()
    assert fm_dense.flops_per_token(48) == fm_dense.flops_per_token(4096)  # recurrent: no context term
    assert mamba2.flops_per_token(48) == mamba2.flops_per_token(4096)
    assert attn.flops_per_token(4096) - attn.flops_per_token(48) == 12 * 2 * (4096 - 48) * 32
    assert fm_dense.flops_per_token(48) - fm_sparse.flops_per_token(48) == 3 * 2 * (8 - 3) * (9 * 32 + 5)


def test_estimate_mfu():
    model = Model(tiny_config())
    flops = model.flops_per_token(48)
    assert model.estimate_mfu(1e9, 'NVIDIA H100 80GB HBM3') == pytest.approx(flops * 1e9 / 989e12)
    assert model.estimate_mfu(1e9, 'NVIDIA A100-SXM4-40GB') == pytest.approx(flops * 1e9 / 312e12)
    assert model.estimate_mfu(1e9, 'cpu') == 0.0
    if not torch.cuda.is_available():
        assert model.estimate_mfu(1e9) == 0.0


def test_configure_optimizers_decays_only_matrices():
    model = Model(tiny_config(mixer='mamba2'))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    decay, no_decay = optimizer.param_groups
    assert decay['weight_decay'] == 0.1 and no_decay['weight_decay'] == 0.0
    assert all(p.dim() >= 2 for p in decay['params']) and all(p.dim() < 2 for p in no_decay['params'])
    assert len(decay['params']) + len(no_decay['params']) == len(list(model.parameters()))
