"""eval.py (loss by position, the lm-eval adapter, routing) and research/ (reproduce.sh, sweep, frontier, scaling,
analysis.py), with their refusals."""

import csv
import errno
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import fields

import numpy as np
import torch
import torch.nn.functional as F
import pytest

import eval as evaluation
import fm_kernel
import prepare_data
from configurator import ConfigError, load_config
from conftest import REPO, build, defaults, reproduce_sh, save_model_checkpoint, tiny_config
from model import FactorizationMemory, Model, ModelConfig
from prepare_data import get_tokenizer
from research import analysis
from test_fm import MIXER_CASES, PAPERS, ROUTER, ContrarianFM


# ----------------------------------------------------------------------------- eval.py


def increment_model(block_size=16):
    """A hand-set byte model that predicts byte b + 1 after byte b (probability 1 - 4e-5): its blocks add nothing,
    the embedding is one-hot and the head a shifted identity."""
    model = Model(ModelConfig(vocab_size=256, block_size=block_size, n_layer=1, d_model=256, n_memory=4,
                              tie_embeddings=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(('out_proj.weight', 'down_proj.weight')):
                p.zero_()
        model.embed.weight.copy_(torch.eye(256))
        model.lm_head.weight.copy_(torch.eye(256).roll(1, 0))  # logit b + 1 reads input b
    return model.eval()


def test_position_buckets_and_loss_so_far():
    """Two documents of 5 and 2 positions: buckets [1, 2), [2, 4), [4, 8) and loss so far at 1, 2, 4, by hand."""
    buckets, so_far = evaluation.position_stats([np.array([1., 2., 3., 4., 5.]), np.array([10., 20.])])
    assert [(b['start'], b['end'], b['positions'], b['documents']) for b in buckets] == [
        (1, 2, 2, 2), (2, 4, 3, 2), (4, 8, 2, 1)]
    assert [b['loss'] for b in buckets] == pytest.approx([(1 + 10) / 2, (2 + 3 + 20) / 3, (4 + 5) / 2])
    assert [(s['t'], s['documents']) for s in so_far] == [(1, 2), (2, 2), (4, 1)]
    assert [s['loss'] for s in so_far] == pytest.approx([(1 + 10) / 2, (1 + 2 + 10 + 20) / 4, (1 + 2 + 3 + 4) / 4])


@pytest.mark.parametrize('name', MIXER_CASES)
def test_loss_by_position_chunked_equals_one_pass(name):
    """eval.py's document_losses in chunks of 7 (each from the last one's state) gives the losses of one pass,
    which are the model's forward cross-entropy."""
    torch.manual_seed(6)
    model = Model(tiny_config(init_std=0.1, **MIXER_CASES[name])).double().eval()
    tokens = torch.randint(0, 64, (60,))
    chunked = evaluation.document_losses(model, tokens.numpy(), chunk_len=7)
    whole = evaluation.document_losses(model, tokens.numpy(), chunk_len=1000)
    with torch.no_grad():
        forward = F.cross_entropy(model(tokens[None, :-1])[0][0], tokens[1:], reduction='none').numpy()
    assert chunked.shape == (59,) and chunked.dtype == np.float64
    np.testing.assert_allclose(chunked, whole, rtol=1e-12)
    np.testing.assert_allclose(whole, forward, rtol=1e-12)


def test_loss_by_position_end_to_end(tmp_path):
    """Text files, an FM and an attention checkpoint: tables, .csv, .json; attention stops at --max_len."""
    torch.manual_seed(7)
    texts = tmp_path / 'texts'
    texts.mkdir()
    for i, n in enumerate((90, 40)):
        (texts / f'{i}.txt').write_text(''.join(chr(97 + (j * 7 + i) % 26) for j in range(n)))
    dirs = [save_model_checkpoint(Model(tiny_config(vocab_size=256, block_size=8, **MIXER_CASES[name])),
                                  tmp_path / name) for name in ('fm_sparse', 'attn')]
    out = tmp_path / 'result' / 'positions'
    results = evaluation.main([f'--out_dir={d}' for d in dirs] + [f'--data={texts}', '--max_len=32',
                                                                  '--chunk_len=16', f'--out={out}'])
    fm, attn = results
    assert [b['start'] for b in fm['buckets']] == [1, 2, 4, 8, 16, 32, 64] and fm['max_positions'] is None
    assert [b['start'] for b in attn['buckets']] == [1, 2, 4, 8, 16] and attn['max_positions'] == 32
    assert [s['t'] for s in attn['loss_so_far']] == [1, 2, 4, 8, 16, 32]
    assert fm['buckets'][-1]['positions'] == 89 - 63 and fm['buckets'][-1]['documents'] == 1
    saved = json.loads(out.with_suffix('.json').read_text())
    assert [c['label'] for c in saved['checkpoints']] == ['fm_sparse', 'attn']
    rows = out.with_suffix('.csv').read_text().splitlines()
    assert rows[0].startswith('checkpoint,model,measure') and len(rows) == 1 + 2 + 7 + 7 + 5 + 6


def half_written_on_a_full_disk(obj, f, **kwargs):
    """json.dump on a full disk: the first bytes go in, then the write fails."""
    f.write('{"checkpoints": [')
    raise OSError(errno.ENOSPC, 'No space left on device')


@pytest.mark.parametrize('mode', ['positions', 'routing'])
def test_a_full_disk_keeps_the_earlier_results_and_says_so(mode, tmp_path, monkeypatch):
    """--out's .json, .csv and .png (routing: routing.json and .png in the out_dir) replace the earlier ones together,
    or not at all: a full disk is one line naming the fix, the earlier files stay whole, no temporary file is left."""
    texts = routing_texts(tmp_path / 'texts')
    out_dir = save_model_checkpoint(Model(tiny_config(vocab_size=256)), tmp_path / 'fm')
    out = tmp_path / 'results' / 'positions'
    folder, names, fix = ((out.parent, ['positions.json', 'positions.csv', 'positions.png'], '--out=') if mode ==
                          'positions' else (tmp_path / 'fm', ['routing.json', 'routing.png'], 'free some space'))
    folder.mkdir(exist_ok=True)
    for name in names:
        (folder / name).write_text('earlier')
    before = sorted(os.listdir(folder))
    monkeypatch.setattr(evaluation.json, 'dump', half_written_on_a_full_disk)
    with pytest.raises(evaluation.EvalError, match=rf'could not write {re.escape(str(folder / names[0]))}.*: the disk '
                                                   rf'is full \([0-9,.]+ MB free in .*\).*{fix}'):
        evaluation.main([*(['routing', '--tokens=100'] if mode == 'routing' else []), f'--out_dir={out_dir}',
                         f'--data={texts}', '--chunk_len=16', *([f'--out={out}'] if mode == 'positions' else [])])
    assert sorted(os.listdir(folder)) == before and all((folder / name).read_text() == 'earlier' for name in names)


def test_seed_groups_hold_runs_that_differ_in_seed_alone():
    """eval.py's spread over seeds groups the runs whose settings differ in the seed (and where they were written)
    alone: two out_dirs of one seed at 500 and 600 steps are two models, not two seeds."""
    def result(seed, steps=500, **changed):
        return {'model_config': {'d_model': 32}, 'tokenizer': 'bytes', 'iter_num': steps, 'train_config': {
            'seed': seed, 'out_dir': f'out-{seed}-{steps}', 'max_iters': steps, 'learning_rate': 1e-3, **changed}}
    groups = evaluation.seed_groups([result(1), result(2), result(1, 600), result(3, learning_rate=2e-3)])
    assert [[r['train_config']['out_dir'] for r in group] for group in groups] == [
        ['out-1-500', 'out-2-500'], ['out-1-600'], ['out-3-500']]


def test_eval_help_names_the_help_of_each_mode(capsys):
    evaluation.main(['--help'])
    assert 'python eval.py routing --help' in capsys.readouterr().out


def test_loss_by_position_refuses_another_tokenizer(trained, tmp_path, monkeypatch):
    """A checkpoint of cl100k_base on the bytes of the default corpus's long.bin: refused before any work."""
    monkeypatch.chdir(tmp_path)  # eval.py makes the default --out's folder, results/, here
    ckpt = torch.load(os.path.join(trained[0], 'ckpt.pt'), weights_only=True)
    cl100k = {**ckpt['model_config'], 'vocab_size': 100352}  # as a model of cl100k_base (never built here)
    torch.save({**ckpt, 'tokenizer': 'cl100k_base', 'model_config': cl100k}, tmp_path / 'ckpt.pt')
    long_bin = os.path.join(ckpt['data_state']['folder'], 'long.bin')
    with pytest.raises(evaluation.EvalError, match=r"long.bin holds tokens of 'bytes', but .* was trained with "
                                                   r"'cl100k_base': give data tokenized with 'cl100k_base'"):
        evaluation.main([f'--out_dir={trained[0]}', f'--out_dir={tmp_path}', f'--data={long_bin}'])


def test_a_missing_token_file_says_how_to_write_one_without_placeholders(tmp_path):
    out_dir = save_model_checkpoint(Model(tiny_config(vocab_size=256)), tmp_path / 'fm')
    with pytest.raises(evaluation.EvalError) as error:
        evaluation.main([f'--out_dir={out_dir}', f'--data={tmp_path / "missing.bin"}', f'--out={tmp_path / "x"}'])
    assert str(error.value) == (
        f'{tmp_path / "missing.bin"} does not exist: prepare_data.py writes token files: run it with --dataset set to '
        f'your corpus (a .txt/.jsonl/.parquet file or a folder of them) and give the train.bin or val.bin it writes (it '
        f'prints their folder); or give --data a .txt file or a folder of them, or leave it out (the default corpus)')


def test_eval_finds_the_default_corpus_from_any_folder(data_dir, tmp_path, monkeypatch):
    """data_dir '' (the default) is prepare_data.py's folder, the repository's data/, wherever eval.py runs."""
    assert evaluation.DEFAULT_DATA_DIR == prepare_data.DEFAULT_DATA_DIR
    monkeypatch.setattr(evaluation, 'DEFAULT_DATA_DIR', data_dir)  # the suite's prepared copy
    monkeypatch.chdir(tmp_path)
    docs, description = evaluation.load_documents('', evaluation.POSITION_SETTINGS['data_dir'], 'bytes', 'ckpt.pt')
    assert len(docs) == 3 and description.startswith(os.path.join(data_dir, 'default_bytes', 'long.bin'))
    assert not os.listdir(tmp_path)


def test_rolling_windows_score_every_token_once():
    tokens = list(range(100, 123))  # 23 tokens, windows of 8 predictions
    pairs = evaluation.rolling_windows(tokens, prefix=7, max_len=8)
    assert [t for _, continuation in pairs for t in continuation] == tokens
    sequence = [7] + tokens
    for context, continuation in pairs:
        inputs = (context + continuation)[:-1]
        assert len(inputs) == 8 and inputs == sequence[sequence.index(continuation[-1]) - 8:][:8]


@torch.no_grad()
def test_harness_loglikelihood_equals_the_forward():
    """The Scorer (the lm-eval adapter's logic): batched requests of any length, an empty context, contexts cut
    to the training context, rolling log-likelihoods; each against the model's own forward on that request."""
    torch.manual_seed(8)
    model = Model(tiny_config(vocab_size=256, block_size=12, init_std=0.3, mixer='fm', top_k=3)).double().eval()
    tok = get_tokenizer('bytes')
    scorer = evaluation.Scorer(model, tok, batch_size=2)
    requests = [('To be', ', or not'), ('', 'Hamlet'), ('Now is the winter of our discontent', ' made'),
                ('a', 'b'), ('ab \n ', 'cd'), (' \n', 'ab')]
    for (context, continuation), (logprob, greedy) in zip(requests, scorer.loglikelihood(requests)):
        stripped = context.rstrip()  # its trailing whitespace belongs to the continuation
        scored = tok.encode(context[len(stripped):] + continuation)
        n = len(scored)
        ids = ((tok.encode(stripped) or [scorer.prefix]) + scored)[-13:]  # at most 12 inputs
        logits = model(torch.tensor([ids[:-1]]))[0][0, -n:]
        want = logits.log_softmax(-1).gather(-1, torch.tensor(ids[-n:])[:, None]).sum().item()
        assert logprob == pytest.approx(want, rel=1e-12, abs=1e-12)
        assert greedy == (logits.argmax(-1) == torch.tensor(ids[-n:])).all().item()
    short, long_text = 'Nymph, in', 'O, what a rogue and peasant slave am I!'  # 9 + 1 and 39 + 1 tokens
    got = scorer.loglikelihood_rolling([short, long_text])
    ids = [scorer.prefix] + tok.encode(short)
    want = model(torch.tensor([ids[:-1]]))[0][0].log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None]).sum()
    assert got[0] == pytest.approx(want.item(), rel=1e-12)
    windows = evaluation.rolling_windows(tok.encode(long_text), scorer.prefix, 12)
    assert got[1] == pytest.approx(sum(lp for lp, _ in scorer.loglikelihood_tokens(windows)), rel=1e-12)


def test_harness_generation_cuts_at_stop_strings():
    scorer = evaluation.Scorer(increment_model(), get_tokenizer('bytes'), batch_size=2)
    requests = [('abc', {'until': ['g'], 'max_gen_toks': 6}), ('klm', {'until': 'q', 'max_gen_toks': 6}),
                ('xy', {'until': [], 'max_gen_toks': 3, 'do_sample': False, 'temperature': 0.0})]
    assert scorer.generate_until(requests) == ['def', 'nop', 'z{|']
    with pytest.raises(ValueError, match='does not take: num_beams'):
        scorer.generate_until([('abc', {'num_beams': 2})])


HARNESS_TASKS = {  # name -> (examples, task YAML lines): hand-made examples the increment model gets right
    'count_choice': ([{'context': 'abcd', 'choices': ['efgh', 'hgfe', 'xqzw'], 'label': 0},
                      {'context': 'klm', 'choices': ['qrs', 'nop', 'mlk'], 'label': 1},
                      {'context': 'n=1234', 'choices': ['5', '9', '0'], 'label': 0}],
                     ['output_type: multiple_choice', 'doc_to_text: "{{context}}"', 'doc_to_choice: "{{choices}}"',
                      'doc_to_target: "{{label}}"', 'target_delimiter: ""', 'metric_list:', '  - metric: acc']),
    'count_generation': ([{'context': 'abcd', 'answer': 'efg'}, {'context': 'n=0123', 'answer': '456'},
                          {'context': 'pq', 'answer': 'rs'}],
                         ['output_type: generate_until', 'doc_to_text: "{{context}}"', 'doc_to_target: "{{answer}}"',
                          'generation_kwargs:', '  until: ["7", "t"]', '  max_gen_toks: 3', '  do_sample: false',
                          'metric_list:', '  - metric: exact_match']),
    'count_text': ([{'text': 'abcdefghijklmnopqrstuvwxyz' * 2}, {'text': '0123456789'}],
                   ['output_type: loglikelihood_rolling', 'doc_to_text: ""', 'doc_to_target: "{{text}}"',
                    'metric_list:', '  - metric: bits_per_byte']),
}


@pytest.mark.skipif(importlib.util.find_spec('lm_eval') is None, reason='lm-eval is not installed')
def test_harness_runs_a_local_task_offline(tmp_path, monkeypatch):
    """python eval.py harness on tasks defined in local YAML files with JSON data, offline: the hand-set model
    gets every multiple-choice and generation example right, and the harness's bits per byte are the Scorer's."""
    monkeypatch.setenv('HF_DATASETS_OFFLINE', '1')
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    for name, (examples, lines) in HARNESS_TASKS.items():
        data = tmp_path / f'{name}.jsonl'
        data.write_text(''.join(json.dumps(example) + '\n' for example in examples))
        (tmp_path / f'{name}.yaml').write_text('\n'.join([f'task: {name}', 'dataset_path: json', 'dataset_kwargs:',
                                                          '  data_files:', f'    test: {data}', 'test_split: test',
                                                          *lines]) + '\n')
    out_dir = save_model_checkpoint(increment_model(), tmp_path / 'model')
    results = evaluation.main(['harness', f'--out_dir={out_dir}', f'--tasks={",".join(HARNESS_TASKS)}',
                               f'--include_path={tmp_path}', '--batch_size=2', f'--out={tmp_path / "harness"}'])
    scores = results['results']
    assert scores['count_choice']['acc,none'] == 1.0
    assert scores['count_generation']['exact_match,none'] == 1.0
    texts = [example['text'] for example in HARNESS_TASKS['count_text'][0]]
    scorer = evaluation.Scorer(increment_model(), get_tokenizer('bytes'))
    bits = -sum(scorer.loglikelihood_rolling(texts)) / sum(len(t) for t in texts) / math.log(2)
    assert scores['count_text']['bits_per_byte,none'] == pytest.approx(bits, rel=1e-6)
    assert json.loads((tmp_path / 'harness.json').read_text())['results']['count_choice']['acc,none'] == 1.0


def test_reproduction_configs_differ_only_in_the_model():
    """The extrapolation baselines have FM's parameter count (within 0.5%) and its data, context, tokens and
    schedule; each its own learning rate (the best of reproduce.sh's sweep)."""
    config, types = defaults()
    architecture = {f.name for f in fields(ModelConfig)} - {'block_size'} | {'out_dir', 'wandb_run_name',
                                                                             'learning_rate', 'min_lr'}
    paths = {name: os.path.join(REPO, 'research', f'extrapolation_{name}.py')
             for name in ('fm', 'transformer', 'mamba2')}
    training = {name: {k: v for k, v in load_config(config, [path], types).items() if k not in architecture}
                for name, path in paths.items()}
    n_params = {name: build(path)[1].num_params(non_embedding=False) for name, path in paths.items()}
    for name in paths:
        assert abs(n_params[name] / n_params['fm'] - 1) < 0.005, n_params
        assert training[name] == training['fm'], name
    assert training['fm']['block_size'] == 512


def test_frontier_sizes_match_in_parameters():
    """At each size of reproduce.sh's frontier the Transformer (heads of 64, n_kv_head = n_head / 2), Mamba-2
    (expand 1, heads of 64, d_state 64) and FM (m = 64, k = 16, tau = 1) have the same non-embedding parameters
    within 1%, about the size's name; the 4M runs are the extrapolation subset's seed-1 runs, the same lines. At 8M
    also the best lever of research/levers.py (issue 39)."""
    sizes = {}
    for line in reproduce_sh('frontier_sizes | while read -r size model lrs args; do '
                             'echo "$size $model $(extrapolation_model "$model") $args"; done').splitlines():
        size, model, *args = line.split()
        c, built = build(*args)
        n = built.num_params()
        sizes.setdefault(size, {})[model] = n
        if c['mixer'] == 'attn':
            assert c['d_model'] == 64 * c['n_head'] == 128 * c['n_kv_head'], line
        elif c['mixer'] == 'mamba2':
            assert (c['mamba_expand'], c['mamba_head_dim'], c['d_state']) == (1, 64, 64), line
        else:
            assert (c['n_memory'], c['top_k'], c['tau']) == (64, 16, 1.0), line
    assert list(sizes) == ['8M', '4M', '2M', '1M']
    for size, n_params in sizes.items():
        lever = {'fm-k16-rowrates-block'} if size == '8M' else set()  # the best lever of research/levers.py
        assert set(n_params) == {'transformer', 'mamba2', 'fm-k16', 'fm-k16-block'} | lever, size
        assert max(n_params.values()) / min(n_params.values()) < 1.01, (size, n_params)
        assert 0.8 < n_params['fm-k16'] / (int(size[:-1]) * 1e6) < 1.25, (size, n_params)
    grids = dict(LRS_TRANSFORMER='1e-3 2e-3', LRS_MAMBA2='2e-3', LRS_FM='5e-4 1e-3', LRS_FM_BLOCK='2e-3', SEEDS='1 2',
                 MODELS='transformer mamba2 fm-k16 fm-k16-block fm-dense')
    at_4m = reproduce_sh('frontier_runs', SIZES='4M', **grids).splitlines()
    extrapolation = reproduce_sh('extrapolation_runs', **grids).splitlines()
    assert len(at_4m) == 6 and set(at_4m) == {line for line in extrapolation if ' --seed=1' in line
                                              and not line.startswith('extrapolation/fm-dense')}
    at_8m = [line.split()[0] for line in reproduce_sh('frontier_runs', SIZES='8M', **{**grids, 'MODELS': ''})
             .splitlines()]  # every model, the lever only where MODELS names it
    assert len(at_8m) == 6 and not any('rowrates' in name for name in at_8m)
    lever = reproduce_sh('frontier_runs', SIZES='8M', **{**grids, 'MODELS': 'fm-k16-rowrates-block'}).split()
    assert lever[0] == 'frontier/fm-k16-rowrates-block-8M-lr2e-3-s1' and '--mixer=research.levers:RowRatesFM' in lever


def test_extrapolation_models_match_in_parameters():
    """Every model of reproduce.sh's extrapolation subset (the variants of FM's block through d_ff) has the
    non-embedding parameters of FM k = 16 within 0.3%; its runs are the README's quality table's: the paper's layer
    and the block with three seeds, the others two, the Transformer and Mamba-2 at one rate."""
    params, seeds, rates = {}, {}, {}
    for line in reproduce_sh('extrapolation_models | while read -r model lrs seeds; do '
                             'echo "$model $(extrapolation_model "$model")"; done').splitlines():
        model, *args = line.split()
        params[model] = build(*args)[1].num_params()
    for line in reproduce_sh('extrapolation_models').splitlines():
        model, model_rates, model_seeds = line.split()
        seeds[model], rates[model] = model_seeds.split(','), model_rates.split(',')
    assert {'fm-k16-gate', 'fm-k16-conv', 'fm-k16-block', 'fm-dense-block', 'fm-k4-block'} <= set(params)
    for model, n in params.items():
        assert abs(n / params['fm-k16'] - 1) < 0.003, (model, n)
    assert seeds['fm-k16'] == seeds['fm-k16-block'] == ['1', '2', '3']
    assert seeds['mamba2'] == seeds['transformer'] == seeds['fm-k16-gate'] == ['1', '2']
    assert (rates['transformer'], rates['mamba2'], rates['fm-k16']) == (['2e-3'], ['4e-3'], ['5e-4', '1e-3', '2e-3'])


def test_reproduce_frontier_dry_run(repo_corpus, tmp_path):
    """bash research/reproduce.sh frontier on the CPU, 2 steps a run, one size and one learning rate a model: every
    run in frontier.csv, at its best rate, with its training FLOPs and losses at 2x and 8x the context."""
    env = dict(RUNS=str(tmp_path / 'runs'), RESULTS=str(tmp_path / 'results'), JOBS='3', SIZES='1M',
               LRS_TRANSFORMER='1e-3', LRS_MAMBA2='2e-3', LRS_FM='1e-3', MODELS='transformer mamba2 fm-k16',
               TRAIN_ARGS='--max_iters=2 --warmup_iters=0 --batch_size=2 --eval_iters=1 --device=cpu')
    run = subprocess.run(['bash', 'research/reproduce.sh', 'frontier'], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, **env})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(tmp_path / 'results' / 'frontier.csv') as f:
        rows = {os.path.basename(row['run']): row for row in csv.DictReader(f)}
    assert set(rows) == {'transformer-1M-lr1e-3-s1', 'mamba2-1M-lr2e-3-s1', 'fm-k16-1M-lr1e-3-s1'}
    for row in rows.values():
        assert row['best_lr'] == '1' and int(row['tokens']) == 2 * 2 * 512
        assert float(row['forward_flops']) > 2 * 1e6 * 2048  # at least 2 FLOPs a parameter and token
        assert float(row['loss_so_far_2x']) > 0 and float(row['loss_so_far_8x']) > 0
    assert 'the frontier: each model at its best learning rate' in run.stdout


def test_scaling_takes_each_m_at_its_best_tau(tmp_path):
    """Runs as checkpoints and as the .csv of an earlier machine (without a seed column: train.py's 1337): each
    series keeps, per m, its tau of lowest mean loss over seeds among those with the most seeds (m = 16, k = 4 is in
    both sparse series); unfinished runs are left out."""
    runs = tmp_path / 'runs'
    cases = {'m16-k4-tau1-s1': (16, 4, 1.0, 1, 2.0, 10), 'm16-k4-tau1-s2': (16, 4, 1.0, 2, 1.7, 10),
             'm16-k4-tau0.5-s1': (16, 4, 0.5, 1, 1.6, 10), 'm16-k4-tau0.5-s2': (16, 4, 0.5, 2, 2.3, 10),
             'm16-dense-tau1-s1': (16, None, 1.0, 1, 1.8, 10), 'm16-dense-tau1-s2': (16, None, 1.0, 2, 1.9, 10),
             'm16-dense-tau0.5-s1': (16, None, 0.5, 1, 1.0, 10), 'm64-k16-tau1-s1': (64, 16, 1.0, 1, 1.5, 4)}
    for name, (m, k, tau, seed, loss, iters) in cases.items():
        model = Model(tiny_config(n_memory=m, top_k=k, tau=tau))
        save_model_checkpoint(model, runs / name, best_val_loss=loss, iter_num=iters,
                              train_config={'max_iters': 10, 'seed': seed})
    earlier = tmp_path / 'earlier.csv'
    earlier.write_text('run,n_memory,top_k,tau,val_loss,iter_num,max_iters\n'
                       'm64-k16-tau0.25,64,16,0.25,1.6,10,10\nm16-k4-tau1-s1,16,4,1.0,9.9,10,10\n')
    rows, best = analysis.main(['scaling', f'--runs={earlier}', f'--runs={runs}', f'--out={tmp_path / "s"}'])
    by_run = {r['run']: r for r in rows}
    assert len(rows) == 9 and by_run['m16-k4-tau1-s1']['val_loss'] == 2.0  # the later source
    assert by_run['m64-k16-tau0.25']['seed'] == 1337 and by_run['m16-k4-tau1-s2']['seed'] == 2
    assert {name: {m: (p['tau'], p['losses']) for m, p in series.items()} for name, series in best.items()} == {
        'dense (k = m)': {16: (1.0, [1.8, 1.9])},  # not tau 0.5's one seed, 1.0
        'k = m/4': {16: (1.0, [2.0, 1.7]), 64: (0.25, [1.6])},
        'k = 4': {16: (1.0, [2.0, 1.7])}}  # tau 1: mean 1.85 against tau 0.5's 1.95 (whose lowest seed, 1.6, is lower)
    again, _ = analysis.main(['scaling', f'--runs={tmp_path / "s.csv"}', f'--out={tmp_path / "t"}'])
    assert again == rows


def positions_result(model, seed, losses, block_size=512):
    """A hand-made checkpoint of eval.py's loss-by-position .json: loss so far {t: loss}."""
    return {'checkpoint': f'{model}-{block_size}-s{seed}', 'model': model, 'block_size': block_size,
            'model_config': {'mixer': model, 'block_size': block_size}, 'tokenizer': 'bytes', 'iter_num': 10,
            'train_config': {'seed': seed, 'out_dir': f'{model}-s{seed}', 'learning_rate': 2e-3},
            'loss_so_far': [{'t': t, 'loss': loss} for t, loss in losses.items()]}


def test_gap_takes_each_model_against_the_reference_mean_over_seeds(tmp_path, capsys):
    """analysis.py gap: each seed group's mean loss so far minus the reference's, at the positions both have, from
    several .json files (a checkpoint in two of them counted once); refused: a reference word naming no model or
    two, two groups that only other settings tell apart, a file that is not eval.py's .json."""
    first, second, third = tmp_path / 'a.json', tmp_path / 'b.json', tmp_path / 'c.json'
    mamba = [positions_result('6x256 mamba2', 1, {512: 1.5, 4096: 1.4}),
             positions_result('6x256 mamba2', 2, {512: 1.7, 4096: 1.6})]
    fm = [positions_result('6x256 fm m=64', 1, {512: 1.9, 4096: 1.5, 32768: 1.4}),
          positions_result('6x256 fm m=64', 2, {512: 1.7, 4096: 1.7}),
          positions_result('6x256 fm m=64', 1, {512: 2.0, 4096: 1.6}, block_size=2048)]
    first.write_text(json.dumps({'checkpoints': mamba + fm[:1]}))
    second.write_text(json.dumps({'checkpoints': fm}))
    out = f'--out={tmp_path / "gap"}'
    table = analysis.main(['gap', f'--runs={first}', f'--runs={second}', out])
    assert table.keys() == {'6x256 fm m=64, context 512, lr 0.002 (seeds: 2)',
                            '6x256 fm m=64, context 2048, lr 0.002 (seeds: 1)'}
    assert table['6x256 fm m=64, context 512, lr 0.002 (seeds: 2)'] == pytest.approx({512: 0.2, 4096: 0.1})
    assert table['6x256 fm m=64, context 2048, lr 0.002 (seeds: 1)'] == pytest.approx({512: 0.4, 4096: 0.1})
    assert 'loss so far minus that of 6x256 mamba2, context 512, lr 0.002 (seeds: 2)' in capsys.readouterr().out
    for word, named in (('transformer', 0), ('fm', 2)):
        with pytest.raises(evaluation.EvalError, match=f'--reference={word} names {named} of the models'):
            analysis.main(['gap', f'--runs={first}', f'--runs={second}', f'--reference={word}', out])
    longer = {**fm[1], 'checkpoint': 'longer', 'iter_num': 20}  # the same label, trained to another step
    third.write_text(json.dumps({'checkpoints': [longer]}))
    with pytest.raises(evaluation.EvalError, match='two groups of checkpoints are both 6x256 fm m=64, context 512'):
        analysis.main(['gap', f'--runs={first}', f'--runs={second}', f'--runs={third}', out])
    third.write_text('{"run": 1}')
    with pytest.raises(evaluation.EvalError, match=r"c.json: not a .json of eval.py's loss by position \(KeyError\)"):
        analysis.main(['gap', f'--runs={third}', out])


def test_positions_and_gap_read_evals_csv_as_its_json(tmp_path):
    """eval.py's loss-by-position .csv gives analysis.py gap the same table as its .json, and positions its curves
    (the plot redrawn from the .csv alone); a .csv whose runs are not named NAME-lrLR-sSEED is refused."""
    results = []
    for name, model, seed, losses in (('mamba2', '6x256 mamba2', 1, (1.5, 1.4)),
                                      ('mamba2', '6x256 mamba2', 2, (1.7, 1.6)),
                                      ('fm-k16-block', '6x256 fm m=64', 1, (1.9, 1.5))):
        label = f'{name}-lr2e-3-s{seed}'
        results.append({**positions_result(model, seed, dict(zip((512, 4096), losses))), 'checkpoint': label,
                        'label': label, 'val_loss': losses[0],
                        'buckets': [{'start': 1, 'end': 2, 'loss': 3.0, 'positions': 3, 'documents': 3}]})
        for row in results[-1]['loss_so_far']:
            row['documents'] = 3
    evaluation.write_positions(results, [], {}, str(tmp_path / 'p.json'), str(tmp_path / 'p.csv'))
    tables = [analysis.main(['gap', f'--runs={tmp_path / f"p.{kind}"}', f'--out={tmp_path / kind}'])
              for kind in ('json', 'csv')]
    assert tables[0] == tables[1] and tables[1]['6x256 fm m=64, context 512, lr 0.002 (seeds: 1)'] == pytest.approx(
        {512: 0.3, 4096: 0.0})
    redrawn = analysis.main(['positions', f'--runs={tmp_path / "p.csv"}', f'--out={tmp_path / "redrawn"}'])
    assert [(r['label'], r['block_size'], r['val_loss'], r['loss_so_far'], r['buckets']) for r in redrawn] == [
        (r['label'], 512, r['val_loss'], [{'t': s['t'], 'loss': s['loss']} for s in r['loss_so_far']],
         [{'start': 1, 'end': 2, 'loss': 3.0}]) for r in results]
    (tmp_path / 'q.csv').write_text((tmp_path / 'p.csv').read_text().replace('mamba2-lr2e-3-s2', 'mamba2-two'))
    with pytest.raises(evaluation.EvalError, match="q.csv: not a .csv of eval.py's loss by position of reproduce.sh"):
        analysis.main(['gap', f'--runs={tmp_path / "q.csv"}', f'--out={tmp_path / "q"}'])
    lines = (tmp_path / 'p.csv').read_text().splitlines(keepends=True)  # without its val rows: no context to draw
    (tmp_path / 'r.csv').write_text(''.join(line for line in lines if ',val,' not in line))
    with pytest.raises(evaluation.EvalError, match="r.csv: not a whole .csv .* mamba2-lr2e-3-s1 has no val row"):
        analysis.main(['positions', f'--runs={tmp_path / "r.csv"}', f'--out={tmp_path / "r"}'])


def sweep_record(model, lr, seed, loss, finished=True):
    """A hand-made run record of analysis.py's sweep."""
    return {'run': f'{model}-lr{lr:g}-s{seed}', 'model': model, 'learning_rate': lr, 'seed': seed, 'val_loss': loss,
            'iter_num': 10 if finished else 5, 'max_iters': 10}


def test_sweep_takes_each_model_at_its_best_mean_learning_rate(capsys):
    """The best rate has the lowest mean over seeds (not the lowest single run); unfinished runs are left out; a best
    rate at an end of its model's grid is warned about, with the rate to add."""
    grids = {
        'middle': [(1e-3, 1, 1.7), (1e-3, 2, 1.7), (2e-3, 1, 1.45), (2e-3, 2, 1.55), (4e-3, 1, 1.4), (4e-3, 2, 1.8)],
        'lowest': [(5e-4, 1, 1.6), (1e-3, 1, 1.7), (2e-3, 1, 1.8)],
        'highest': [(2e-3, 1, 1.9), (4e-3, 1, 1.8), (8e-3, 1, 1.7)],
        'single': [(1e-3, 1, 2.0)],
    }
    records = [sweep_record(model, *run) for model, runs in grids.items() for run in runs]
    records.append(sweep_record('lowest', 2e-3, 2, 1.0, finished=False))
    table = analysis.by_model_and_lr(records)
    best = analysis.best_learning_rates(table)
    assert best == {'middle': 2e-3, 'lowest': 5e-4, 'highest': 8e-3, 'single': 1e-3}
    assert [len(members) for members in table['lowest'].values()] == [1, 1, 1]  # the unfinished run is not in it
    warnings = analysis.edge_warnings(table, best)
    assert len(warnings) == 2 and not any('middle' in w or 'single' in w for w in warnings)  # one rate: no sweep
    assert 'lowest:' in warnings[0] and warnings[0].endswith('train at 0.00025 too')
    assert 'highest:' in warnings[1] and warnings[1].endswith('train at 0.016 too')
    analysis.print_sweep(records, table, best)
    out = capsys.readouterr().out
    assert 'left out, not finished: lowest-lr0.002-s2' in out
    assert ['middle', '0.002', '2', '1.5000', '(1.4500-1.5500)', '*'] in [line.split() for line in out.splitlines()]


# ----------------------------------------------------------------------------- FM's router settings, eval.py routing,
# the results of an earlier machine

def planted_router_model(top_k):
    """A byte FM model (m = 8) whose blocks add nothing (out_proj and down_proj zero), so that every layer's router
    sees norm(embed[token]). The embedding's first coordinate is 1 for every token, so that input's first coordinate
    is positive; row 0 of each router, -20 on it and 0 elsewhere, loses to every other row (0 on it): a dead row."""
    torch.manual_seed(11)
    model = Model(tiny_config(vocab_size=256, top_k=top_k))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(('out_proj.weight', 'down_proj.weight')):
                p.zero_()
        model.embed.weight.normal_(std=0.3)[:, 0] = 1.0
        for block in model.blocks:
            weight = block.mixer.router.weight.normal_(std=0.5)  # (8, 32): routing far from uniform
            weight[:, 0] = 0.0
            weight[0] = 0.0
            weight[0, 0] = -20.0
    for block in model.blocks:  # row 0's logit is below every other row's for every token of the vocabulary
        logits = block.mixer.router(block.mixer_norm(model.embed.weight)).detach()  # (256, 8)
        assert (logits[:, 1:].min(-1).values - logits[:, 0] > 5).all()
    return model


def routing_by_hand(model, tokens):
    """Each layer's usage (dense: mean alpha a row; sparse: the share of tokens selecting it), mean entropy of the
    softmax and mean eta, for a planted_router_model, whose every layer sees norm(embed[token])."""
    layers = []
    for block in model.blocks:
        mixer = block.mixer
        x = block.mixer_norm(model.embed(tokens)).detach().double()  # (N, 32)
        probs = torch.softmax(x @ mixer.router.weight.detach().double().T, -1)  # (N, 8), tau = 1
        if mixer.top_k < 8:  # a selection counts 1
            probs_or_selections = torch.zeros_like(probs).scatter(-1, probs.topk(mixer.top_k).indices, 1.0)
        else:
            probs_or_selections = probs
        eta = torch.sigmoid(x @ mixer.rates.weight[0].detach().double() + mixer.rates.bias[0].item())
        kept = probs_or_selections if mixer.top_k < 8 else torch.ones_like(probs)  # the rows a token reads
        weight = probs * kept / (probs * kept).sum(-1, keepdim=True)  # alpha renormalised over them
        heaviest = weight.mean(0).argmax()
        layers.append({'usage': probs_or_selections.mean(0), 'entropy': float(-(probs * probs.log()).sum(-1).mean()),
                       'eta_mean': float(eta.mean()), 'weight_usage': weight.mean(0),
                       'busiest_row_theta': float((eta * weight[:, heaviest]).mean())})
    return layers


def routing_texts(folder):
    """Two .txt files of 90 and 40 printable bytes."""
    folder.mkdir()
    for i, n in enumerate((90, 40)):
        (folder / f'{i}.txt').write_text(''.join(chr(33 + (j * 37 + i * 11) % 90) for j in range(n)))
    return folder


def test_routing_measures_usage_dead_rows_entropy_and_eta(tmp_path):
    """eval.py routing on a sparse (k = 3) and a dense FM checkpoint, every token measured: usage, dead rows, entropy
    and eta as counted by hand; usage sums to k (dense: 1); the planted dead row is counted, with usage 0 (dense: below
    1/(10 m)); routing.json in each out_dir, --out's .csv a row a checkpoint and layer."""
    texts = routing_texts(tmp_path / 'texts')
    models = {'sparse': planted_router_model(3), 'dense': planted_router_model(None)}
    dirs = {name: save_model_checkpoint(model, tmp_path / name) for name, model in models.items()}
    out = tmp_path / 'all' / 'routing'
    results = evaluation.main(['routing', *(f'--out_dir={d}' for d in dirs.values()), f'--data={texts}',
                               '--tokens=1000', '--chunk_len=16', f'--out={out}', '--device=cpu'])
    tokens = torch.tensor([b for i in (0, 1) for b in (texts / f'{i}.txt').read_bytes()])
    assert [r['label'] for r in results] == ['sparse', 'dense']
    for (name, model), result in zip(models.items(), results):
        k = 3 if name == 'sparse' else 1
        assert result['tokens'] == 130 and len(result['layers']) == 2
        for layer, want in zip(result['layers'], routing_by_hand(model, tokens)):  # the paper's router, by hand
            usage = torch.tensor(layer['usage'], dtype=torch.float64)
            assert (usage - want['usage']).abs().max() < 1e-9, f'{name}: {PAPERS}'
            assert abs(usage.sum() - k) < 1e-9
            assert usage[0] == 0 if name == 'sparse' else usage[0] < 1e-3
            assert layer['dead_rows'] == int((want['usage'] < 1 / 80).sum()) >= 1, PAPERS
            assert layer['entropy'] == pytest.approx(want['entropy'], abs=1e-9), PAPERS
            assert layer['eta_mean'] == pytest.approx(want['eta_mean'], abs=1e-6), PAPERS
            weight = torch.tensor(layer['weight_usage'], dtype=torch.float64)
            assert (weight - want['weight_usage']).abs().max() < 1e-9 and abs(weight.sum() - 1) < 1e-9, PAPERS
            entropy = -torch.special.xlogy(want['weight_usage'], want['weight_usage']).sum()  # 0 log 0 = 0
            assert layer['weight_effective_rows'] == pytest.approx(float(torch.exp(entropy))), PAPERS
            assert layer['busiest_row_theta'] == pytest.approx(want['busiest_row_theta'], abs=1e-6), PAPERS
            assert layer['busiest_row_ablation'] == 0  # the planted blocks add nothing: no read-out reaches the loss
        saved = json.loads((tmp_path / name / 'routing.json').read_text())
        keys = ('usage', 'dead_rows', 'entropy', 'eta_mean')
        assert [[layer[key] for key in keys] for layer in saved['layers']] == [
            [layer[key] for key in keys] for layer in result['layers']]
    with open(out.with_suffix('.csv')) as f:
        rows = list(csv.DictReader(f))
    assert [(row['checkpoint'], row['layer']) for row in rows] == [('sparse', '0'), ('sparse', '1'), ('dense', '0'),
                                                                   ('dense', '1')]
    assert [int(row['dead_rows']) for row in rows] == [layer['dead_rows'] for r in results for layer in r['layers']]


def test_routing_shows_its_progress(tmp_path, capsys):
    """eval.py routing says what it is doing as it goes, on stderr as loss by position does: a line as each part (the
    routing pass, the ablations: a loss pass a layer and one without) begins, then every few seconds, then its total."""
    out_dir = save_model_checkpoint(planted_router_model(3), tmp_path / 'fm')
    evaluation.main(['routing', f'--out_dir={out_dir}', f'--data={routing_texts(tmp_path / "texts")}', '--tokens=1000',
                     '--chunk_len=16', '--device=cpu'])
    out, err = capsys.readouterr()
    assert f"wrote {os.path.join(out_dir, 'routing.json')}" in out  # where the results are (and .png, with matplotlib)
    err = err.splitlines()
    assert [line.split(', ')[0] for line in err] == [  # 130 tokens, 128 predicted: 3 passes for 2 layers
        'fm routing: 16/130 tokens', 'fm routing: 130/130 tokens', 'fm ablations: 16/384 tokens',
        'fm ablations: 384/384 tokens'], err


@pytest.mark.parametrize('name, code, line', [('SIGINT', 130, 'interrupted'), ('SIGTERM', 143, 'terminated')])
def test_a_signal_stops_eval_within_seconds_and_writes_nothing(name, code, line, tmp_path):
    """Ctrl-C or SIGTERM during a long routing: it stops within seconds, one line, exit code 130 / 143, no file."""
    out_dir = save_model_checkpoint(Model(tiny_config(vocab_size=256)), tmp_path / 'fm')
    (tmp_path / 'long.txt').write_text('To be, or not to be. ' * 10_000)  # 210,000 tokens: minutes in chunks of 16
    proc = subprocess.Popen([sys.executable, 'eval.py', 'routing', f'--out_dir={out_dir}', f'--data={tmp_path}/long.txt',
                             '--tokens=1000000', '--chunk_len=16', '--device=cpu'], cwd=REPO, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    try:
        first = proc.stderr.readline()  # the routing pass's first progress line: the work is under way
        start = time.time()
        proc.send_signal(getattr(signal, name))
        err = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
    assert first.startswith('fm routing: 16/210,000 tokens') and (proc.returncode, err) == (code, f'{line}\n'), (
        first, proc.returncode, err)
    assert time.time() - start < 10 and os.listdir(out_dir) == ['ckpt.pt']


def test_busiest_row_ablation_zeroes_that_rows_read_out_only():
    """The ablation of a layer's heaviest row is the loss with that row's phi zeroed in that layer alone (the row
    still written), written out by hand; the model computes as before afterwards."""
    torch.manual_seed(12)
    model = Model(tiny_config(top_k=3, init_std=0.3)).double().eval()
    tokens = torch.randint(0, 64, (40,))
    layers = [{'weight_usage': [0.0] * 8} for _ in model.blocks]
    layers[1]['weight_usage'][5] = 1.0  # layer 1's row 5
    cfg = {'device': 'cpu', 'dtype': 'float32', 'chunk_len': 16}
    base = model(tokens[None, :-1], tokens[None, 1:])[1].item()
    evaluation.add_ablations(model, [tokens.numpy()], cfg, layers)
    x = model.embed(tokens[None, :-1])
    x, _ = model.blocks[0](x)
    block, mixer = model.blocks[1], model.blocks[1].mixer
    h = block.mixer_norm(x)
    idx, alpha, eta, mu = mixer.route(h)
    alpha = torch.zeros(*h.shape[:-1], 8, dtype=alpha.dtype).scatter(-1, idx, alpha)
    phi = (mu * alpha).index_fill(-1, torch.tensor([5]), 0.0)
    y, _ = fm_kernel.fm_scan_naive(mixer.in_proj(h), eta * alpha, phi, eps=mixer.eps)
    x = block.add_mlp(x + mixer.out_proj(y))
    ablated = F.cross_entropy(model.head(x)[0], tokens[1:]).item()
    got = layers[1]['busiest_row_ablation']
    assert got == pytest.approx(ablated - base, abs=1e-9), f'{got} against {ablated - base} by hand: {ROUTER}'
    assert abs(ablated - base) > 1e-4
    assert model(tokens[None, :-1], tokens[None, 1:])[1].item() == base


@pytest.mark.parametrize('name', ['attn', 'mamba2'])
def test_routing_refuses_a_checkpoint_of_another_mixer(name, tmp_path):
    """An FM and a non-FM checkpoint: refused before any work, naming the other one and its mixer."""
    fm = save_model_checkpoint(Model(tiny_config(vocab_size=256)), tmp_path / 'fm')
    other = save_model_checkpoint(Model(tiny_config(vocab_size=256, **MIXER_CASES[name])), tmp_path / name)
    with pytest.raises(evaluation.EvalError, match=rf'{os.path.join(other, "ckpt.pt")} is a {name} model: .*FM'):
        evaluation.main(['routing', f'--out_dir={fm}', f'--out_dir={other}', '--device=cpu'])
    assert not (tmp_path / 'fm' / 'routing.json').exists()


def test_routing_stats_of_uniform_and_token_independent_routers():
    """A router of zero weights is uniform: entropy log m, dense usage 1/m a row, m effective rows. The same input for
    every token leaves only a token-independent part in the router's input and centred logits (shares 1); inputs
    drawn around zero have almost none."""
    torch.manual_seed(0)
    mixer = FactorizationMemory(tiny_config())
    torch.nn.init.zeros_(mixer.router.weight)
    stats = evaluation.RoutingStats(8, 8, 32)
    stats.add(mixer, torch.randn(3, 20, 32))
    layer = stats.summary()
    assert layer['entropy'] == pytest.approx(math.log(8), abs=1e-12) and layer['entropy_uniform'] == math.log(8)
    assert layer['usage'] == pytest.approx([1 / 8] * 8, abs=1e-12)
    assert layer['effective_rows'] == pytest.approx(8) and layer['dead_rows'] == layer['rare_rows'] == 0
    mixer = FactorizationMemory(tiny_config(top_k=3))
    torch.nn.init.normal_(mixer.router.weight, std=0.5)
    same, spread = evaluation.RoutingStats(8, 3, 32), evaluation.RoutingStats(8, 3, 32)
    same.add(mixer, torch.randn(32).expand(2, 50, 32))
    spread.add(mixer, torch.randn(2, 2000, 32))
    same, spread = same.summary(), spread.summary()
    assert same['logit_bias_share'] == pytest.approx(1, abs=1e-9) and same['input_mean_share'] == pytest.approx(1)
    assert same['usage'].count(1.0) == 3 and same['dead_rows'] == 5 and same['busiest_row'] == 1.0
    assert spread['logit_bias_share'] < 0.01 and spread['input_mean_share'] < 0.01


def test_routing_stats_read_route():
    """An edited router (test_fm.ContrarianFM: the rows the standard router likes least) is measured as it routes:
    the entropy of its own softmax and the usage of its own rows."""
    torch.manual_seed(0)
    mixer = ContrarianFM(tiny_config(top_k=3))
    torch.nn.init.normal_(mixer.router.weight, std=0.5)
    x = torch.randn(2, 50, 32)
    stats = evaluation.RoutingStats(8, 3, 32)
    stats.add(mixer, x)
    layer = stats.summary()
    probs = torch.softmax(-mixer.router_scores(x.flatten(0, 1)).detach().double()[:, :-2], -1)  # (100, 8), tau 1
    usage = torch.zeros(8, dtype=torch.float64).scatter_add_(0, probs.topk(3).indices.flatten(), torch.ones(300, dtype=torch.float64))
    assert layer['entropy'] == pytest.approx(float(-(probs * probs.log()).sum(-1).mean()), abs=1e-6)
    assert layer['usage'] == pytest.approx((usage / 100).tolist(), abs=1e-12)


def sweep_run(folder, lr, loss, block_size=48, **model):
    """A finished run folder of tiny_config(**model), block_size as given, trained at lr to validation loss."""
    return save_model_checkpoint(Model(tiny_config(block_size=block_size, **model)), folder, best_val_loss=loss,
                                 iter_num=10, data_state={'tokens_seen': 10 * 4 * block_size},
                                 train_config={'max_iters': 10, 'learning_rate': lr, 'min_lr': lr / 10, 'seed': 1})


def test_sweep_merges_the_csv_of_an_earlier_machine(tmp_path):
    """analysis.py sweep of an earlier machine's .csv and this machine's runs: every run once (the later source's
    record of a run of the same subset/name), the best learning rate over both."""
    earlier, here = tmp_path / 'earlier' / 'extrapolation', tmp_path / 'here' / 'extrapolation'
    for folder, lr, loss in ((earlier, 5e-4, 1.5), (earlier, 1e-3, 9.9), (here, 1e-3, 2.0), (here, 2e-3, 1.9)):
        sweep_run(folder / f'fm-lr{lr:g}-s1', lr, loss, **MIXER_CASES['fm_sparse'])
    analysis.main(['sweep', f'--runs={earlier}', f'--out={tmp_path / "earlier_lr"}'])
    records, best = analysis.main(['sweep', f'--runs={tmp_path / "earlier_lr.csv"}', f'--runs={here}',
                                     f'--out={tmp_path / "lr"}'])
    assert {analysis.run_key(r): r['val_loss'] for r in records} == {
        'extrapolation/fm-lr0.0005-s1': 1.5, 'extrapolation/fm-lr0.001-s1': 2.0, 'extrapolation/fm-lr0.002-s1': 1.9}
    assert list(best.values()) == [5e-4] and sum(r['best_lr'] for r in records) == 1
    assert (tmp_path / 'lr_best.txt').read_text() == f"{earlier / 'fm-lr0.0005-s1'}\n"
    with open(tmp_path / 'lr.csv') as f:
        assert len(list(csv.DictReader(f))) == 3
    records, _ = analysis.main(['sweep', f'--runs={here}', f'--runs={tmp_path / "earlier_lr.csv"}',
                                  f'--out={tmp_path / "lr2"}'])
    assert {analysis.run_key(r): r['val_loss'] for r in records}['extrapolation/fm-lr0.001-s1'] == 9.9


def test_frontier_evaluates_only_the_runs_without_losses(tmp_path, monkeypatch):
    """analysis.py frontier of an earlier machine's frontier.csv (FM, its best rate with its losses) and this
    machine's attention run: only the attention checkpoint is opened; frontier.csv holds both, the earlier losses as
    they were."""
    earlier = tmp_path / 'earlier' / 'frontier'
    for lr, loss in ((5e-4, 1.5), (1e-3, 1.7)):
        sweep_run(earlier / f'fm-lr{lr:g}-s1', lr, loss, block_size=8, vocab_size=256, **MIXER_CASES['fm_sparse'])
    records, _, _ = analysis.sweep([str(earlier)])
    for r in records:
        if r['best_lr']:
            r['loss_so_far_2x'], r['loss_so_far_8x'] = 1.25, 1.125
    fields = analysis.SWEEP_FIELDS + ('loss_so_far_2x', 'loss_so_far_8x')
    analysis.write_records(records, fields, tmp_path / 'earlier_frontier.csv')
    attn = sweep_run(tmp_path / 'here' / 'frontier' / 'attn-lr1e-3-s1', 1e-3, 2.0, block_size=8, vocab_size=256,
                     **MIXER_CASES['attn'])
    opened, open_checkpoint = [], analysis.open_checkpoint
    monkeypatch.setattr(analysis, 'open_checkpoint', lambda out_dir, name: opened.append(out_dir) or (
        open_checkpoint(out_dir, name) if out_dir == attn else pytest.fail(f'opened {out_dir}')))
    texts = routing_texts(tmp_path / 'texts')
    _, points = analysis.main(['frontier', f'--runs={tmp_path / "earlier_frontier.csv"}',
                                 f'--runs={tmp_path / "here" / "frontier"}', f'--data={texts}',
                                 f'--out={tmp_path / "frontier"}', '--device=cpu'])
    assert opened == [attn]
    with open(tmp_path / 'frontier.csv') as f:
        rows = {analysis.run_key(row): row for row in csv.DictReader(f)}
    assert set(rows) == {'frontier/fm-lr0.0005-s1', 'frontier/fm-lr0.001-s1', 'frontier/attn-lr1e-3-s1'}
    fm, attn_row = rows['frontier/fm-lr0.0005-s1'], rows['frontier/attn-lr1e-3-s1']
    assert (fm['best_lr'], float(fm['loss_so_far_2x']), float(fm['loss_so_far_8x'])) == ('1', 1.25, 1.125)
    assert attn_row['best_lr'] == '1' and float(attn_row['loss_so_far_8x']) > 0
    assert rows['frontier/fm-lr0.001-s1']['loss_so_far_8x'] == ''
    assert sorted(points) == ['attn', 'fm m=8 k=3 tau=1']


def test_reproduce_skips_the_runs_of_an_earlier_machine(repo_corpus, tmp_path):
    """bash research/reproduce.sh frontier on the CPU (2 steps a run, one size, one rate a model) with PREVIOUS, whose
    frontier.csv lists the Mamba-2 run: that run is not trained here, the others are, and frontier.csv holds all
    three, the earlier one as it was."""
    previous = tmp_path / 'previous'
    earlier = {'run': 'out-old/frontier/mamba2-1M-lr2e-3-s1', 'model': '6x128 mamba2 (1.13M)', 'parameters': 1163008,
               'non_embedding_parameters': 1130240, 'learning_rate': 2e-3, 'min_lr': 2e-4, 'seed': 1,
               'val_loss': 3.5, 'best_lr': 1, 'iter_num': 2, 'max_iters': 2, 'block_size': 512, 'tokens': 2048,
               'forward_flops': 1e10, 'loss_so_far_2x': 3.25, 'loss_so_far_8x': 3.125}
    analysis.write_records([earlier], analysis.SWEEP_FIELDS + ('loss_so_far_2x', 'loss_so_far_8x'),
                             previous / 'frontier.csv')
    env = dict(RUNS=str(tmp_path / 'runs'), RESULTS=str(tmp_path / 'results'), PREVIOUS=str(previous), JOBS='2',
               SIZES='1M', LRS_TRANSFORMER='1e-3', LRS_MAMBA2='2e-3', LRS_FM='1e-3', MODELS='transformer mamba2 fm-k16',
               TRAIN_ARGS='--max_iters=2 --warmup_iters=0 --batch_size=2 --eval_iters=1 --device=cpu')
    run = subprocess.run(['bash', 'research/reproduce.sh', 'frontier'], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, **env})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    trained = tmp_path / 'runs' / 'frontier'
    assert sorted(os.listdir(trained)) == ['fm-k16-1M-lr1e-3-s1', 'transformer-1M-lr1e-3-s1']
    assert all((trained / name / 'finished').is_file() for name in os.listdir(trained))
    with open(tmp_path / 'results' / 'frontier.csv') as f:
        rows = {os.path.basename(row['run']): row for row in csv.DictReader(f)}
    assert set(rows) == {'transformer-1M-lr1e-3-s1', 'mamba2-1M-lr2e-3-s1', 'fm-k16-1M-lr1e-3-s1'}
    old = rows['mamba2-1M-lr2e-3-s1']
    assert (old['run'], old['val_loss'], old['loss_so_far_8x']) == (earlier['run'], '3.5', '3.125')
    for row in rows.values():
        assert row['best_lr'] == '1' and float(row['loss_so_far_8x']) > 0


def test_reproduce_regenerates_a_table_from_previous_alone(tmp_path):
    """bash research/reproduce.sh quality with PREVIOUS (two folders, the later's record of a run winning) and no time
    to train: nothing trained, and quality.csv is the table of PREVIOUS's records of the quality runs alone (an
    earlier folder's same-named run, and a run of no quality model, left out)."""
    old, new = tmp_path / 'old', tmp_path / 'new'
    fields = analysis.SWEEP_FIELDS
    record = dict(model='6x256 mamba2 (4.13M)', parameters=1, non_embedding_parameters=1, min_lr=4e-4, seed=1,
                  best_lr=1, iter_num=640, max_iters=640, block_size=512, tokens=1, forward_flops=1.0)
    analysis.write_records([{**record, 'run': 'x/extrapolation/mamba2-lr4e-3-s1', 'learning_rate': 4e-3,
                             'val_loss': 9.0}], fields, old / 'extrapolation_lr.csv')
    analysis.write_records([{**record, 'run': 'y/extrapolation/mamba2-lr4e-3-s1', 'learning_rate': 4e-3,
                             'val_loss': 1.5},
                            {**record, 'run': 'y/extrapolation/mamba2-lr4e-3-s2', 'learning_rate': 4e-3,
                             'val_loss': 1.7, 'seed': 2},
                            {**record, 'run': 'y/other/mamba2-lr4e-3-s3', 'learning_rate': 4e-3, 'val_loss': 0.1,
                             'seed': 3}], fields, new / 'extrapolation_lr.csv')
    (new / 'extrapolation_positions.csv').write_text(
        'checkpoint,model,measure,start,end,loss,positions,documents\n'
        + ''.join(f'mamba2-lr4e-3-s{seed},6x256 mamba2,val,1,512,{loss},,\n' + ''.join(
            f'mamba2-lr4e-3-s{seed},6x256 mamba2,so_far,1,{t},{loss},{t},1\n' for t in (512, 4096, 32768))
                  for seed, loss in ((1, 2.0), (2, 3.0))))
    env = dict(RUNS=str(tmp_path / 'runs'), RESULTS=str(tmp_path / 'results'), PREVIOUS=f'{old} {new}',
               TRAIN_SECONDS='1', MODELS='mamba2')
    run = subprocess.run(['bash', 'research/reproduce.sh', 'quality'], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, **env})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert not (tmp_path / 'runs').exists() and 'not started' not in run.stdout
    with open(tmp_path / 'results' / 'quality.csv') as f:
        rows = list(csv.DictReader(f))
    assert [(r['name'], r['seeds'], float(r['val_loss']), float(r['so_far_1x']), float(r['so_far_64x']))
            for r in rows] == [('mamba2', '2', 1.6, 2.5, 2.5)]


@pytest.mark.parametrize('device, message', [
    ('cuda:7', 'cuda:7, but this machine has'),  # a GPU it lacks: refused before any work, as train.py does
    ('gpu', "--device=gpu is not a device: use 'cpu', 'cuda', 'cuda:N' or 'mps'"),
])
def test_eval_and_analysis_refuse_a_device_this_machine_lacks(device, message, tmp_path):
    out = f'--out={tmp_path / "out"}'
    for main, argv in ((evaluation.main, [out]), (analysis.main, ['frontier', f'--runs={tmp_path}', out])):
        with pytest.raises(ConfigError, match=re.escape(f'--device={device}')) as error:
            main(argv + [f'--device={device}'])
        assert message in str(error.value)


@pytest.mark.parametrize('script, argv, message', [
    ('eval.py', ['rooting'], "unknown subcommand 'rooting': did you mean routing? (eval.py [routing|harness] --key"),
    ('eval.py', ['sweep', '--runs=x'], 'sweep is in research/analysis.py: run python research/analysis.py sweep --'),
    ('analysis.py', ['scalling'], "unknown subcommand 'scalling': did you mean scaling? (research/analysis.py sweep"),
    ('analysis.py', ['harness'], 'harness is in eval.py: run python eval.py harness --key=value'),
    ('analysis.py', ['--runs=x'], 'name a subcommand (research/analysis.py sweep|frontier|scaling'),
])
def test_a_mistyped_or_moved_subcommand_says_what_to_run(script, argv, message):
    main = evaluation.main if script == 'eval.py' else analysis.main
    with pytest.raises(ConfigError) as error:
        main(argv)
    assert message in str(error.value)


@pytest.mark.parametrize('script, argv, message', [
    ('eval.py', ['--chunk_len=0'], '--chunk_len=0 is out of range: set it to at least 1 (tokens a chunk)'),
    ('eval.py', ['--max_len=-1'], '--max_len=-1 is out of range: set it to at least 1'),
    ('eval.py', ['routing', '--tokens=1'], '--tokens=1 is out of range: set it to at least 2'),
    ('eval.py', ['routing', '--chunk_len=0'], '--chunk_len=0 is out of range: set it to at least 1'),
    ('eval.py', ['harness', '--batch_size=0'], '--batch_size=0 is out of range: set it to at least 1'),
    ('eval.py', ['harness', '--limit=0'], '--limit=0 is out of range: set it to at least 1'),
    ('eval.py', ['harness', '--num_fewshot=-1'], '--num_fewshot=-1 is out of range: set it to at least 0'),
    ('analysis.py', ['frontier', '--runs=x', '--chunk_len=0'], '--chunk_len=0 is out of range: set it to at least 1'),
])
def test_eval_and_analysis_refuse_numbers_out_of_range(tmp_path, script, argv, message):
    """Refused before anything is read or written."""
    main, more = (evaluation.main, [f'--out_dir={tmp_path / "none"}']) if script == 'eval.py' else (analysis.main, [])
    with pytest.raises(ConfigError) as error:
        main([*argv, *more, f'--out={tmp_path / "results" / "x"}'])
    assert message in str(error.value) and not os.listdir(tmp_path)


def test_sweep_and_scaling_name_a_missing_or_foreign_runs_path(tmp_path):
    """--runs: missing, a path that does not exist, an empty .csv, the .csv of another subcommand."""
    sweep_like = 'a run folder (with ckpt.pt), a folder of run folders or a .csv that sweep or frontier wrote'
    with pytest.raises(ConfigError, match=re.escape(f'--runs is missing: give {sweep_like} (--runs may repeat)')):
        analysis.main(['frontier', f'--out={tmp_path / "f"}'])
    for mode, what in (('sweep', sweep_like), ('scaling', 'a folder of FM run folders or a .csv that scaling')):
        with pytest.raises(ConfigError, match=re.escape(f'--runs={tmp_path / "bad.csv"} does not exist: give {what}')):
            analysis.main([mode, f'--runs={tmp_path / "bad.csv"}', f'--out={tmp_path / "s"}'])
    (tmp_path / 'empty.csv').write_text('')
    with pytest.raises(evaluation.EvalError, match='empty.csv: not a .csv that analysis.py sweep or frontier wrote'):
        analysis.main(['sweep', f'--runs={tmp_path / "empty.csv"}', f'--out={tmp_path / "s"}'])
    analysis.write_records([sweep_record('m', 1e-3, 1, 2.0)], ('run', 'model', 'val_loss'), tmp_path / 'sweep.csv')
    with pytest.raises(evaluation.EvalError, match='sweep.csv: not a .csv that analysis.py scaling wrote'):
        analysis.main(['scaling', f'--runs={tmp_path / "sweep.csv"}', f'--out={tmp_path / "s"}'])


def test_eval_and_analysis_give_one_line_errors_from_any_folder(tmp_path):
    """The scripts run from another working directory (analysis.py finds eval.py) and say what is wrong in one line."""
    for script, args, message in (
            ('eval.py', ['rooting'], "error: unknown subcommand 'rooting': did you mean routing?"),
            ('research/analysis.py', ['sweep', '--runs=bad.csv'], 'error: --runs=bad.csv does not exist: give a run')):
        run = subprocess.run([sys.executable, os.path.join(REPO, script), *args], cwd=tmp_path, capture_output=True,
                             text=True)
        assert run.returncode == 1 and run.stderr.startswith(message) and len(run.stderr.splitlines()) == 1, run.stderr


def test_eval_reads_text_as_prepare_data_does_and_writes_under_results(trained, tmp_path, monkeypatch, capsys):
    """A .txt file that is not UTF-8 is refused as prepare_data.py refuses it; an --out that cannot be written is
    refused before the evaluation; the default output goes to results/, which git ignores; the plot where matplotlib
    (optional) is installed, else a note that it was skipped."""
    latin1 = tmp_path / 'latin1.txt'
    latin1.write_bytes('café au lait'.encode('latin-1'))
    with pytest.raises(evaluation.EvalError, match=r'latin1.txt is not UTF-8 text \(byte 3 of 12 is 0xe9\): convert'):
        evaluation.main([f'--out_dir={trained[0]}', f'--data={latin1}', f'--out={tmp_path / "x"}'])
    with pytest.raises(ConfigError, match=rf'--out={latin1}/x: cannot write to {latin1} \(it is a file\)'):
        evaluation.main([f'--out_dir={trained[0]}', f'--out={latin1}/x'])
    with pytest.raises(ConfigError, match="--out='' is not a path prefix"):
        evaluation.main([f'--out_dir={trained[0]}', '--out='])
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'doc.txt').write_text('To be, or not to be, that is the question.\n')
    evaluation.main([f'--out_dir={trained[0]}', '--data=doc.txt'])
    plotted = importlib.util.find_spec('matplotlib') is not None
    assert sorted(os.listdir(tmp_path / 'results')) == ['loss_by_position.csv', 'loss_by_position.json'] + [
        'loss_by_position.png'] * plotted
    assert plotted or 'no plot: matplotlib is not installed (pip install matplotlib)' in capsys.readouterr().out
    assert '/results/' in open(os.path.join(REPO, '.gitignore')).read().split()


def test_loss_by_position_warns_that_tokenizers_do_not_compare(tmp_path, capsys):
    """A bytes and a cl100k_base checkpoint in one table: their nats per token do not compare, and a line says so."""
    texts = routing_texts(tmp_path / 'texts')
    torch.manual_seed(0)
    bytes_dir = save_model_checkpoint(Model(tiny_config(vocab_size=256)), tmp_path / 'b')
    cl100k_dir = save_model_checkpoint(Model(tiny_config(vocab_size=100352)), tmp_path / 'c', 'cl100k_base')
    evaluation.main([f'--out_dir={bytes_dir}', f'--out_dir={cl100k_dir}', f'--data={texts}', '--chunk_len=16',
                     f'--out={tmp_path / "results" / "pos"}', '--device=cpu'])
    assert 'warning: the checkpoints use the tokenizers bytes and cl100k_base: their losses (nats a token) do ' \
           'not compare' in capsys.readouterr().err
