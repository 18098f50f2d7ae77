"""research/levers.py (issue 39's levers for long-range memory): each decodes as it trains, starts where it promises,
routes as it says, survives a checkpoint and trains through train.py; the configs and reproduce.sh's levers subset
build the 4.1M block within 0.5% of its parameters."""

import math
import os
from dataclasses import asdict

import pytest
import torch

import train
from checkpoint import load_checkpoint, model_from_checkpoint
from conftest import (assert_decodes_as_it_trains, build, randomized, rel_err, reproduce_sh, save_model_checkpoint,
                      tiny, tiny_config)
from fm_kernel import DecodingError
from model import FactorizationMemory, Model, ModelConfig
from research import levers

MIXERS = {name: f'research.levers:{name}' for name in ('LowWriteFM', 'RowRatesFM', 'HeadsFM', 'SlowWriteFM')}
CASES = {'block-sparse': dict(top_k=4, fm_conv=4, fm_gate=True),
         'block-dense': dict(top_k=None, fm_conv=4, fm_gate=True), 'paper-sparse': dict(top_k=4)}


@pytest.mark.parametrize('case', CASES)
@pytest.mark.parametrize('lever', MIXERS)
def test_each_lever_decodes_as_it_trains(lever, case):
    """forward = prefill + steps in float64, every parameter random (m = 8; sparse k = 4); LowWriteFM routes as the
    standard router, the others through their own route (never the fused kernel), whose logits are not the standard
    router's."""
    torch.manual_seed(0)
    model = randomized(Model(tiny_config(mixer=MIXERS[lever], **CASES[case]))).double().eval()
    idx = torch.randint(0, 64, (2, 20))
    assert_decodes_as_it_trains(model, idx, 9)
    if lever != 'LowWriteFM':  # the same weights under the standard router
        assert not model.blocks[0].mixer.fused_router, 'the probe took the fused kernel for a route of its own'
        standard = Model(tiny_config(**CASES[case])).double().eval()
        standard.load_state_dict(model.state_dict(), strict=False)
        assert rel_err(standard(idx)[0], model(idx)[0]) > 1e-3


@pytest.mark.parametrize('top_k', [4, None])
def test_the_levers_start_at_the_rates_they_promise(top_k):
    """As Model initialises them: LowWriteFM's eta is 0.05 at a zero input (b_eta = logit(0.05), not zeroed by
    Model's init) and near it on inputs of unit scale; RowRatesFM's rows write at rates log-uniform in [1e-3, 0.5],
    its row_rate 1-D and without weight decay."""
    torch.manual_seed(0)
    x0, x = torch.zeros(3, 32), torch.randn(500, 32)
    low = Model(tiny_config(mixer=MIXERS['LowWriteFM'], top_k=top_k))
    for block in low.blocks:
        assert block.mixer.rates.bias.tolist() == pytest.approx([math.log(0.05 / 0.95), 0.0])
        assert block.mixer.route(x0)[2].flatten().tolist() == pytest.approx([0.05] * 3)
        assert 0.045 < block.mixer.route(x)[2].mean() < 0.055
    rows = Model(tiny_config(mixer=MIXERS['RowRatesFM'], top_k=top_k))
    expected = torch.logspace(math.log10(1e-3), math.log10(0.5), 8)
    for block in rows.blocks:
        layer = block.mixer
        assert torch.sigmoid(layer.row_rate).tolist() == pytest.approx(expected.tolist(), rel=1e-5)
        idx, alpha, eta, mu = layer.route(x)
        assert eta.shape == alpha.shape == (500, top_k or 8) and mu.shape == (500, 1)
        if idx is None:  # a zero input: every row at its own rate
            assert rel_err(layer.route(x0)[2], expected.expand(3, -1)) < 1e-5
        rates = torch.sigmoid(layer.row_rate) if idx is None else torch.sigmoid(layer.row_rate)[idx]
        assert (eta / rates).log().abs().max() < 1  # w_eta.x: small at init (std 0.02 sqrt(d_model))
    no_decay = rows.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu').param_groups[1]
    assert no_decay['weight_decay'] == 0.0 and any(p is rows.blocks[0].mixer.row_rate for p in no_decay['params'])


def test_slow_writes_stay_below_their_cap():
    """SlowWriteFM's eta is ETA_MAX = 0.1 times the standard router's (below 0.1 at any input), the rest of the
    routing the standard router's."""
    torch.manual_seed(0)
    layer = randomized(Model(tiny_config(mixer=MIXERS['SlowWriteFM'], top_k=4))).double().blocks[0].mixer
    x = torch.randn(50, 32, dtype=torch.float64)
    (idx, alpha, eta, mu), standard = layer.route(x), FactorizationMemory.route(layer, x)
    assert torch.equal(idx, standard[0]) and torch.equal(alpha, standard[1]) and torch.equal(mu, standard[3])
    assert torch.equal(eta, 0.1 * standard[2]) and eta.max() <= 0.1 < standard[2].max()


class Heads2FM(levers.HeadsFM):
    HEADS = 2


@pytest.mark.parametrize('heads', [levers.HeadsFM, Heads2FM])
@pytest.mark.parametrize('top_k', [4, None])
def test_heads_route_within_each_group(heads, top_k):
    """Each head's selected rows are the top-(k/H) of the softmax within its group of m/H rows, their alpha summing
    to 1/H; dense keeps every row, each group's alpha its own softmax over H."""
    torch.manual_seed(0)
    config = tiny_config(mixer=MIXERS['HeadsFM'], top_k=top_k)
    layer = randomized(heads(config)).double()
    H, M, K = heads.HEADS, 8, top_k or 8
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    idx, alpha, eta, mu = layer.route(x)
    groups = torch.softmax(layer.router_scores(x)[..., :-2].unflatten(-1, (H, M // H)), -1)  # (2, 5, H, M/H)
    per_head = alpha.unflatten(-1, (H, K // H))
    assert rel_err(per_head.sum(-1), torch.full((2, 5, H), 1 / H, dtype=torch.float64)) < 1e-14
    if top_k is None:
        assert idx is None and rel_err(alpha, groups.flatten(-2) / H) < 1e-14
        return
    rows = idx.unflatten(-1, (H, K // H))
    assert ((rows // (M // H)) == torch.arange(H)[:, None]).all()  # head h's rows in its group
    top = groups.topk(K // H, -1)
    assert torch.equal(rows % (M // H), top.indices)
    assert rel_err(per_head, top.values / top.values.sum(-1, keepdim=True) / H) < 1e-14
    assert eta.shape == mu.shape == (2, 5, 1)


@pytest.mark.parametrize('mixer, n_memory, top_k', [('HeadsFM', 8, 2), ('HeadsFM', 6, None), ('Heads16FM', 8, 4)])
def test_heads_refuse_rows_they_cannot_split(mixer, n_memory, top_k):
    with pytest.raises(ValueError, match=r'must both be divisible by \d+$'):
        Model(tiny_config(mixer=f'research.levers:{mixer}', n_memory=n_memory, top_k=top_k))


@pytest.mark.parametrize('lever', MIXERS)
def test_a_checkpoint_round_trip_rebuilds_the_lever(lever, tmp_path):
    """ModelConfig(**asdict(config)) names the same class; a checkpoint as train.py writes one loads into it, the
    same logits."""
    model = randomized(Model(tiny_config(mixer=MIXERS[lever], top_k=4, fm_conv=4, fm_gate=True))).eval()
    again = Model(ModelConfig(**asdict(model.config)))
    assert type(again.blocks[0].mixer) is getattr(levers, lever)
    path = os.path.join(save_model_checkpoint(model, tmp_path / 'run'), 'ckpt.pt')
    loaded = model_from_checkpoint(load_checkpoint(path), path).eval()
    assert type(loaded.blocks[0].mixer) is getattr(levers, lever) and loaded.config.mixer == MIXERS[lever]
    idx = torch.randint(0, 64, (2, 20))
    assert torch.equal(loaded(idx)[0], model(idx)[0])


def test_train_py_trains_a_lever(data_dir, tmp_path, capsys):
    """python train.py --mixer=research.levers:RowRatesFM, 2 steps on the CPU: finite losses, the checkpoint holds
    the lever (its row_rate trained), and the closing line names sample.py."""
    history = train.main(tiny(data_dir, tmp_path, '--max_iters=2', '--lr_decay_iters=2', '--eval_interval=2',
                              '--mixer=research.levers:RowRatesFM', '--device=cpu'))
    assert all(math.isfinite(loss) for _, loss in history['train'] + history['val'])
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.endswith(f'; sample it with: python sample.py --out_dir={tmp_path}'), last
    ckpt = load_checkpoint(tmp_path / 'ckpt.pt')
    assert ckpt['model_config']['mixer'] == 'research.levers:RowRatesFM' and ckpt['iter_num'] == 2
    start = torch.logit(torch.logspace(math.log10(1e-3), math.log10(0.5), 8))
    assert not torch.allclose(ckpt['model']['blocks.0.mixer.row_rate'], start)


def test_train_py_says_the_conv_router_does_not_decode(data_dir, tmp_path, capsys):
    """A run of ConvRouterFM ends naming why it does not decode, not sample.py (which would refuse it; issue 62)."""
    train.main(tiny(data_dir, tmp_path, '--max_iters=2', '--lr_decay_iters=2', '--eval_interval=2',
                    '--mixer=research.levers:ConvRouterFM', '--device=cpu'))
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(f'saved {tmp_path / "ckpt.pt"} (step 2)') and 'sample.py' not in last, last
    assert '; research.levers:ConvRouterFM does not decode: its routing at a token moves' in last, last


def test_the_levers_subset_trains_the_block_and_each_lever_matched():
    """reproduce.sh levers: the block (the extrapolation subset's own run lines) and each lever, each rate x seed;
    every model the 4.1M block within 0.5% of its parameters, at the block's context or (ctx2048) 4x it with the
    same tokens a step, its convolution of 4 taps or (conv16) 16."""
    lines = reproduce_sh('levers_runs', LRS_FM_BLOCK='1e-3 2e-3', SEEDS='1 2', MODELS='', PREVIOUS='').splitlines()
    names = [line.split()[0] for line in lines]
    assert len(names) == 9 * 2 * 2 and 'extrapolation/fm-k16-block-lr2e-3-s2' in names
    assert 'levers/RowRatesFM-lr1e-3-s1' in names and 'levers/ctx2048-lr2e-3-s2' in names
    block_line = reproduce_sh('extrapolation_runs', LRS_FM_BLOCK='2e-3', SEEDS='1', MODELS='fm-k16-block')
    assert block_line.strip() in lines
    counts = {}
    for line in lines:
        c, model = build(*line.split()[1:])
        counts[line.split()[0].rsplit('-lr', 1)[0]] = model.num_params()
        assert (c['n_memory'], c['top_k'], c['fm_gate'], c['n_layer'], c['d_model']) == (64, 16, True, 6, 256), line
        assert c['fm_conv'] == (16 if 'conv16' in line.split()[0] else 4), line
        assert c['batch_size'] * c['block_size'] == 32 * 512 and c['max_iters'] == 640, line
    block = counts['extrapolation/fm-k16-block']
    assert block == 4_135_180 and counts['levers/RowRatesFM'] == block + 6 * 64
    assert all(abs(n / block - 1) < 0.005 for n in counts.values()), counts


@pytest.mark.parametrize('variant', ['conv16', 'NoSuchFM'])
def test_scaling_refuses_a_variant_that_is_no_lever(variant):
    """VARIANT=<a class of research/levers.py> puts that lever on the block; any other word is refused before a run."""
    out = reproduce_sh('scaling 2>&1 || echo "exit $?"', VARIANT=variant, MEMORIES='16', TAUS='1')
    assert out == f'VARIANT={variant}: give block or a class of research/levers.py\nexit 2\n'


def test_routing_statistics_take_a_rate_a_row():
    """eval.py routing's write weights per row with RowRatesFM's rate a selected row: eta_i * alpha_i where each
    row is selected, summed over the tokens."""
    import eval as evaluation
    model = randomized(Model(tiny_config(mixer='research.levers:RowRatesFM', top_k=4))).double()
    layer, x = model.blocks[0].mixer, torch.randn(5, 32, dtype=torch.float64)
    stats = evaluation.RoutingStats(8, 4, 32)
    stats.add(layer, x)
    idx, alpha, eta, _ = layer.route(x)
    assert eta.shape == (5, 4)
    want = torch.zeros(5, 8, dtype=torch.float64).scatter(-1, idx, eta * alpha).sum(0)
    assert torch.allclose(stats.theta.double(), want)


def conv_router(top_k):
    """A float64 ConvRouterFM layer of tiny_config, every parameter random."""
    config = tiny_config(mixer='research.levers:ConvRouterFM', top_k=top_k, fm_conv=4,
                         fm_gate=True)
    return randomized(Model(config)).double().blocks[0].mixer


@pytest.mark.parametrize('top_k', [4, None])
def test_the_conv_router_routes_on_the_last_four_inputs(top_k):
    """ConvRouterFM.route(x) at t is the standard router's on silu(b + sum_j w_j x_{t-3+j})
    (zeros before the start), computed here by a loop: an input moves the routing of its own
    position and the next 3, no other."""
    torch.manual_seed(0)
    layer = conv_router(top_k)
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    weight, bias = layer.router_conv.weight[:, 0], layer.router_conv.bias  # (32, 4), (32,)
    padded = torch.cat([x.new_zeros(2, 3, 32), x], 1)
    mixed = torch.stack([bias + sum(weight[:, j] * padded[:, t + j] for j in range(4))
                         for t in range(12)], 1)  # (2, 12, 32)
    standard = FactorizationMemory.route(layer, torch.nn.functional.silu(mixed))
    routed = layer.route(x)
    for got, want in zip(routed, standard):
        assert (got is None and want is None) or rel_err(got, want) < 1e-12
    moved = x.clone()
    moved[:, 5] += 1
    theta, before = layer.weights(*layer.route(moved))[0], layer.weights(*routed)[0]
    changed = (theta != before).any(-1).any(0)  # (T,)
    assert changed.tolist() == [t in range(5, 9) for t in range(12)]


def test_the_conv_router_counts_its_window_and_refuses_to_decode():
    """Its bytes count the router's window (d_model x 3 inputs, kept, and read and written by a
    step), and what it cannot do it refuses, naming itself: a decoding state (init_state's probe:
    its routing reads the tokens before), a pass after a state, padded rows."""
    layer = conv_router(4)
    window = 32 * 3 * 8  # float64
    standard = FactorizationMemory.step_state_bytes(layer, 10)
    assert layer.step_state_bytes(10) == standard + 2 * window
    state = layer.init_state(1, 10, 'meta')
    assert state['router_window'].shape == (1, 32, 3)
    refusal = ('^research.levers:ConvRouterFM does not decode: its routing at a token moves when '
               'only other tokens change')
    with pytest.raises(DecodingError, match=refusal):
        layer.init_state(1, 10, 'cpu')
    state = {k: torch.zeros_like(v, device='cpu') for k, v in state.items()}
    x = torch.randn(1, 5, 32, dtype=torch.float64)
    for kwargs in (dict(state=state), dict(lengths=torch.tensor([3]))):
        with pytest.raises(NotImplementedError, match='a pass from the start of unpadded rows'):
            layer(x, **kwargs)
