"""Tests of train.py, sample.py, configurator.py and config/ on the CPU: python -m pytest -q test_train.py"""
import glob
import os
import signal
import subprocess
import sys
from dataclasses import fields

import pytest
import torch

import sample
import train
from configurator import ConfigError, load_config
from model import Model, ModelConfig
from prepare_data import prepare

REPO = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp('data')
    prepare(dataset='default', tokenizer='bytes', data_dir=str(data_dir))
    return str(data_dir)


def tiny(data_dir, out_dir, *extra):
    """Arguments for a tiny FM model that trains in about 20 ms a step."""
    return [f'--data_dir={data_dir}', f'--out_dir={out_dir}', '--n_layer=2', '--d_model=32', '--n_memory=8',
            '--top_k=2', '--chunk_size=16', '--block_size=48', '--batch_size=4', '--eval_iters=2',
            '--eval_interval=4', '--log_interval=1', '--warmup_iters=2', '--learning_rate=1e-2', '--min_lr=1e-3',
            *extra]


@pytest.fixture(scope='module')
def trained(data_dir, tmp_path_factory):
    """out_dir of a tiny model trained for 8 steps, and its history."""
    out_dir = str(tmp_path_factory.mktemp('out'))
    history = train.main(tiny(data_dir, out_dir, '--max_iters=8', '--lr_decay_iters=8'))
    return out_dir, history


# ----------------------------------------------------------------------------- configuration

def defaults():
    return train.default_config(), train.optional_types()


def test_overrides_parse_to_the_default_types():
    config, types = defaults()
    c = load_config(config, ['--batch_size=3', '--learning_rate=1', '--compile=True', '--wandb_log=false',
                             '--mixer=attn', '--out_dir="my out"', '--top_k=None', '--d_ff=512', '--tau=0.5'], types)
    assert c['batch_size'] == 3 and c['learning_rate'] == 1.0 and isinstance(c['learning_rate'], float)
    assert c['compile'] is True and c['wandb_log'] is False
    assert c['mixer'] == 'attn' and c['out_dir'] == 'my out'
    assert c['top_k'] is None and c['d_ff'] == 512 and c['tau'] == 0.5
    assert config['batch_size'] == 16  # the defaults are left alone
    assert set(f.name for f in fields(ModelConfig)) - {'vocab_size'} <= set(config)  # every model field


@pytest.mark.parametrize('arg, message', [
    ('--batch_size=2.5', "bad value for 'batch_size'"),
    ('--batch_size=x', "bad value for 'batch_size'"),
    ('--compile=1', "bad value for 'compile'"),  # bools take True/False only
    ('--n_layer=True', "bad value for 'n_layer'"),
    ('--learning_rate=fast', "bad value for 'learning_rate'"),
    ('--top_k=2.0', "bad value for 'top_k'"),
    ('--batch_size', 'expected --key=value'),
    ('--batch_sise=4', "unknown config key 'batch_sise'. Did you mean batch_size"),
    ('config/nothing_here.py', 'config file not found: config/nothing_here.py'),
])
def test_bad_overrides_are_refused(arg, message):
    config, types = defaults()
    with pytest.raises(ConfigError, match=message.replace('.', r'\.').replace('(', r'\(')):
        load_config(config, [arg], types)


def test_config_files(tmp_path):
    config, types = defaults()
    good = tmp_path / 'good.py'
    good.write_text('import math\n_helper = 3\nmax_iters = 2 * warmup_iters\nd_model = 64\ntop_k = None\n')
    c = load_config(config, [str(good), '--d_model=96'], types)  # later arguments win
    assert c['max_iters'] == 2 * config['warmup_iters'] and c['d_model'] == 96 and c['top_k'] is None
    bad = tmp_path / 'bad.py'
    bad.write_text('n_layers = 4\n')
    with pytest.raises(ConfigError, match="bad.py: unknown config key 'n_layers'. Did you mean n_layer"):
        load_config(config, [str(bad)], types)
    bad.write_text('batch_size = "16"\n')
    with pytest.raises(ConfigError, match="bad value for 'batch_size'"):
        load_config(config, [str(bad)], types)


def build(path, meta=False):
    config, types = defaults()
    c = load_config(config, [path], types)
    model_args = {f.name: c[f.name] for f in fields(ModelConfig) if f.name in c}
    vocab = 100288 if c['tokenizer'] == 'cl100k_base' else 256  # cl100k_base's 100,277 padded to a multiple of 64
    with torch.device('meta' if meta else 'cpu'):
        return Model(ModelConfig(**model_args, vocab_size=vocab))


def test_every_config_builds():
    paths = sorted(glob.glob(os.path.join(REPO, 'config', '*.py')))
    assert len(paths) >= 6
    for path in paths:
        build(path, meta=True)


@pytest.mark.parametrize('size', ['1b', 'small'])
def test_baselines_match_fm_in_parameters(size):
    n_fm = build(os.path.join(REPO, 'config', f'fm_{size}.py'), meta=True).num_params(non_embedding=False)
    for mixer in ('transformer', 'mamba2'):
        n = build(os.path.join(REPO, 'config', f'{mixer}_{size}.py'), meta=True).num_params(non_embedding=False)
        assert abs(n / n_fm - 1) < 0.02, (mixer, n, n_fm)


def test_missing_data_and_unknown_tokenizer(data_dir, tmp_path):
    with pytest.raises(train.TrainError, match='no dataset at .*Prepare it with:\n  python prepare_data.py'):
        train.main(tiny(data_dir, tmp_path, f'--dataset={tmp_path / "corpus.txt"}'))
    with pytest.raises(train.TrainError, match="unknown tokenizer 'nope'"):
        train.main(tiny(data_dir, tmp_path, '--tokenizer=nope'))


def test_command_line_errors_are_clear():
    run = subprocess.run([sys.executable, 'train.py', '--batch_sise=4'], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 1
    assert "error: unknown config key 'batch_sise'. Did you mean batch_size or" in run.stderr
    assert 'Traceback' not in run.stderr


# ----------------------------------------------------------------------------- training

def test_lr_schedule():
    cfg = train.SimpleNamespace(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110)
    assert train.get_lr(0, cfg) == pytest.approx(1 / 11)
    assert train.get_lr(10, cfg) == pytest.approx(1.0)
    assert train.get_lr(60, cfg) == pytest.approx(0.55)
    assert train.get_lr(110, cfg) == train.get_lr(1000, cfg) == 0.1


def test_loss_falls(data_dir, tmp_path):
    history = train.main(tiny(data_dir, tmp_path, '--max_iters=40', '--lr_decay_iters=40', '--eval_interval=40',
                              '--batch_size=8', '--block_size=64'))
    (_, first), (_, last) = history['val'][0], history['val'][-1]
    assert first > 5.0 and last < first - 1.5, history['val']
    assert {'ckpt.pt', 'best.pt'} <= set(os.listdir(tmp_path)) and not glob.glob(str(tmp_path / '*.tmp'))


def test_resume_is_exact(data_dir, tmp_path, trained):
    """8 steps straight == 4 steps, save, resume, 4 steps: same losses and weights, bit for bit."""
    straight_dir, straight = trained
    out_dir = str(tmp_path)
    first = train.main(tiny(data_dir, out_dir, '--max_iters=4', '--lr_decay_iters=8'))
    second = train.main(tiny(data_dir, out_dir, '--max_iters=8', '--lr_decay_iters=8', '--init_from=resume'))
    assert first['train'] + second['train'] == straight['train']  # float losses compared exactly
    assert first['val'] + second['val'] == straight['val']
    a = torch.load(os.path.join(straight_dir, 'ckpt.pt'), weights_only=True)
    b = torch.load(os.path.join(out_dir, 'ckpt.pt'), weights_only=True)
    assert a['iter_num'] == b['iter_num'] == 8 and a['best_val_loss'] == b['best_val_loss']
    for name, tensor in a['model'].items():
        assert torch.equal(tensor, b['model'][name]), name
    for i, state in a['optimizer']['state'].items():
        assert all(torch.equal(v, b['optimizer']['state'][i][k]) for k, v in state.items())
    assert a['rng']['batch'] == b['rng']['batch']


def test_resume_with_gradient_accumulation_is_exact(data_dir, tmp_path):
    args = ['--gradient_accumulation_steps=2', '--lr_decay_iters=6', '--eval_interval=3']
    straight = train.main(tiny(data_dir, tmp_path / 'a', '--max_iters=6', *args))
    first = train.main(tiny(data_dir, tmp_path / 'b', '--max_iters=3', *args))
    second = train.main(tiny(data_dir, tmp_path / 'b', '--max_iters=6', '--init_from=resume', *args))
    assert first['train'] + second['train'] == straight['train']


def test_checkpoint_contents(trained):
    ckpt = torch.load(os.path.join(trained[0], 'ckpt.pt'), weights_only=True)
    assert set(train.CKPT_KEYS) <= set(ckpt)
    assert ckpt['tokenizer'] == 'bytes' and ckpt['model_config']['d_model'] == 32
    assert ckpt['train_config']['max_iters'] == 8
    assert {'python', 'numpy', 'torch', 'cuda', 'batch'} <= set(ckpt['rng'])
    assert not any(k.startswith(('_orig_mod.', 'module.')) for k in ckpt['model'])
    best = torch.load(os.path.join(trained[0], 'best.pt'), weights_only=True)
    assert best['best_val_loss'] == min(v for i, v in trained[1]['val'] if i > 0)


def test_missing_and_corrupt_checkpoints(data_dir, tmp_path, trained):
    args = tiny(data_dir, tmp_path, '--max_iters=10', '--init_from=resume')
    with pytest.raises(train.TrainError, match='no checkpoint at .*ckpt.pt: train one first'):
        train.main(args)
    good = open(os.path.join(trained[0], 'ckpt.pt'), 'rb').read()
    for damaged in (b'not a checkpoint', good[:len(good) // 2]):
        (tmp_path / 'ckpt.pt').write_bytes(damaged)
        with pytest.raises(train.TrainError, match='is not a readable checkpoint .* --init_from=scratch'):
            train.main(args)
        with pytest.raises(train.TrainError, match='is not a readable checkpoint'):
            sample.main([f'--out_dir={tmp_path}'])
    torch.save({'model': {}}, tmp_path / 'ckpt.pt')
    with pytest.raises(train.TrainError, match='missing optimizer, model_config'):
        train.main(args)


def test_incompatible_checkpoints(trained, tmp_path):
    ckpt = torch.load(os.path.join(trained[0], 'ckpt.pt'), weights_only=True)
    cases = [({'model_config': {**ckpt['model_config'], 'd_model': 48}}, 'do not fit the model'),
             ({'model_config': {**ckpt['model_config'], 'n_experts': 2}}, 'cannot build'),
             ({'model': {k: v for k, v in ckpt['model'].items() if 'router' not in k}}, 'do not fit the model'),
             ({'tokenizer': 'no_such_tokenizer'}, "tokenizer 'no_such_tokenizer', which cannot be loaded")]
    for change, message in cases:
        torch.save({**ckpt, **change}, tmp_path / 'ckpt.pt')
        with pytest.raises(train.TrainError, match=message):
            sample.main([f'--out_dir={tmp_path}', '--max_new_tokens=2'])


def test_sample(trained, tmp_path):
    out_dir = trained[0]
    samples = sample.main([f'--out_dir={out_dir}', '--start=ROMEO:', '--num_samples=2', '--max_new_tokens=20'])
    assert len(samples) == 2 and all(s.startswith('ROMEO:') for s in samples)
    (tmp_path / 'prompt.txt').write_text('To be')
    again = sample.main([f'--out_dir={out_dir}', '--ckpt=best.pt', f'--start=FILE:{tmp_path / "prompt.txt"}',
                         '--num_samples=1', '--max_new_tokens=20', '--top_k=5', '--temperature=0.5'])
    assert again[0].startswith('To be')
    run = subprocess.run([sys.executable, 'sample.py', f'--out_dir={out_dir}', '--num_samples=1',
                          '--max_new_tokens=10', '--seed=1'], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0 and '---------------' in run.stdout, run.stderr


def test_ctrl_c_saves_the_last_step(data_dir, tmp_path):
    cmd = [sys.executable, 'train.py', *tiny(data_dir, tmp_path, '--max_iters=100000', '--eval_interval=100000')]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if line.startswith('iter 3:'):
                proc.send_signal(signal.SIGINT)
                break
        output = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] >= 3 and f'saved {tmp_path / "ckpt.pt"} at step {ckpt["iter_num"]}' in output
    history = train.main(tiny(data_dir, tmp_path, f'--max_iters={ckpt["iter_num"] + 2}', '--init_from=resume'))
    assert [i for i, _ in history['train']] == [ckpt['iter_num'] + 1, ckpt['iter_num'] + 2]


def test_ddp_on_cpu(data_dir, tmp_path):
    """Two gloo processes: 4 steps straight == 2 steps, resume, 2 steps."""
    def torchrun(out_dir, *extra):
        cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py',
               *tiny(data_dir, out_dir, '--device=cpu', '--gradient_accumulation_steps=2', '--lr_decay_iters=4',
                     '--eval_interval=2', *extra)]
        run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'})
        assert run.returncode == 0, run.stdout + run.stderr
        return [line.split(',')[0] for line in run.stdout.splitlines() if line.startswith(('iter', 'step'))]
    straight = torchrun(tmp_path / 'a', '--max_iters=4')
    resumed = torchrun(tmp_path / 'b', '--max_iters=2')
    resumed += torchrun(tmp_path / 'b', '--max_iters=4', '--init_from=resume')
    assert straight == resumed and len(straight) == 4 + 3
    ckpt = torch.load(tmp_path / 'a' / 'ckpt.pt', weights_only=True)
    assert ckpt['data_state']['world_size'] == 2 and len(ckpt['rng']['batch']) == 2
    assert ckpt['rng']['batch'][0] != ckpt['rng']['batch'][1]
