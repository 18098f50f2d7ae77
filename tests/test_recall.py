"""research/mqar.py, research/recall.py and reproduce.sh recall (issue 55): the task is as the
Zoology paper defines it, the loss is Model.forward's at the answers, the bytes are init_state's and
step_state_bytes', and the sweep runs, resumes and picks each model's best rate."""

import csv
import os
import subprocess

import pytest
import torch
import torch.nn.functional as F

import train
from configurator import ConfigError
from conftest import REPO, randomized, rel_err, reproduce_sh, tiny_config
from model import Model
from research import analysis, recall
from research.mqar import TEST, TRAIN, fillers, held_out, mqar

SHAPES = [*TRAIN, *TEST, (16, 4)]  # (16, 4): every query slot asked


@pytest.mark.parametrize('seq_len, n_pairs', SHAPES)
def test_each_key_is_asked_once_after_its_pair_and_answered_by_its_value(seq_len, n_pairs):
    """Keys distinct in the lower half (not 0), values in the upper; each key asked exactly once, at
    an even offset after the pairs, where it has been seen once before (at its pair); the target
    there is the value that followed it; targets -1 elsewhere; no other token is a key of its
    example."""
    vocab = 8192 if seq_len > 64 else 64  # a small vocabulary: filler tokens clash with keys often
    inputs, targets = mqar(50, seq_len, n_pairs, torch.Generator().manual_seed(0), vocab=vocab)
    assert inputs.shape == targets.shape == (50, seq_len)
    keys, values = inputs[:, 0:2 * n_pairs:2], inputs[:, 1:2 * n_pairs:2]
    assert ((1 <= keys) & (keys < vocab // 2)).all()
    assert ((vocab // 2 <= values) & (values < vocab)).all()
    for row in range(50):
        assert len(set(keys[row].tolist())) == n_pairs
        asked = (targets[row] != -1).nonzero().flatten()
        assert len(asked) == n_pairs and (asked >= 2 * n_pairs).all() and (asked % 2 == 0).all()
        assert sorted(inputs[row, asked].tolist()) == sorted(keys[row].tolist())  # each key once
        for q in asked.tolist():
            seen = (inputs[row, :q] == inputs[row, q]).nonzero().flatten().tolist()
            assert len(seen) == 1 and seen[0] < 2 * n_pairs
            assert targets[row, q] == inputs[row, seen[0] + 1]
        others = torch.ones(seq_len, dtype=torch.bool)
        others[:2 * n_pairs], others[asked] = False, False
        assert not torch.isin(inputs[row, others], keys[row]).any()


def test_seeds_reproduce_and_the_test_set_is_apart():
    """The same seed gives the same examples, another seed others; the test set is the same at every
    call and none of its examples is one of the first training batches of seeds 1-3."""
    def draw(seed):
        return mqar(8, 64, 4, torch.Generator().manual_seed(seed))
    assert all(torch.equal(a, b) for a, b in zip(draw(1), draw(1)))
    assert not torch.equal(draw(1)[0], draw(2)[0])
    first, again = held_out(16), held_out(16)
    assert list(first) == list(TEST)
    for shape in TEST:
        assert all(torch.equal(a, b) for a, b in zip(first[shape], again[shape]))
    trained = torch.cat([draw(seed)[0] for seed in (1, 2, 3)])
    assert not (first[64, 4][0][:, None] == trained[None]).all(-1).any()


def test_queries_come_soon_after_the_pairs_as_the_power_law_draws():
    """Query slot g is drawn with weight g^(a - 1), a = 0.01: at 256 tokens and 16 pairs (112 slots)
    the first slot is asked in nearly every example and the last in few (uniform draws: both in 1 of
    7)."""
    _, targets = mqar(2000, 256, 16, torch.Generator().manual_seed(0))
    asked = (targets != -1).float().mean(0)  # (256,): the share of examples with a query there
    assert asked[32] > 0.9 and asked[254] < 0.06


def test_the_loss_is_model_forwards_at_the_answers():
    """recall.answers (the head at the answers alone) + cross-entropy is Model.forward's loss with
    targets -1 elsewhere (float64, every parameter random), for each mixer."""
    for mixer in ('fm', 'attn', 'mamba2'):
        model = randomized(Model(tiny_config(mixer=mixer, top_k=4, vocab_size=64))).double()
        inputs, targets = mqar(3, 32, 4, torch.Generator().manual_seed(0), vocab=64)
        _, want = model(inputs, targets)
        assert rel_err(F.cross_entropy(*recall.answers(model, inputs, targets)), want) < 1e-12


def test_state_bytes_are_the_layers_buffers():
    """FM: m rows of d_memory floats (the block: and its convolution's window); Mamba-2: its SSM and
    convolution states; attention: keys and values of every token so far, and its position."""
    def layer(**kw):
        return Model(tiny_config(**kw)).blocks[0].mixer
    assert recall.state_bytes(layer(mixer='fm', n_memory=8), 64) == 8 * 32 * 4
    block = layer(mixer='fm', n_memory=8, fm_conv=4, fm_gate=True)
    assert recall.state_bytes(block, 64) == 8 * 32 * 4 + 32 * 3 * 4
    mamba = layer(mixer='mamba2')  # 4 heads of 16, d_state 8; conv: x, B, C (64 + 2 x 8)
    assert recall.state_bytes(mamba, 64) == 4 * 16 * 8 * 4 + 80 * 3 * 4
    attention = layer(mixer='attn')  # 2 KV heads of 8
    assert recall.state_bytes(attention, 100) == 2 * 100 * 2 * 8 * 4 + 8


def test_recall_runs_and_appends_a_row_a_slice(tmp_path):
    """research/recall.py, a step on the CPU: a row a test slice, accuracies in [0, 1], its bytes; a
    second run appends below the same header."""
    out = tmp_path / 'recall.csv'
    args = ['--mixer=fm', '--d_model=32', '--n_memory=8', '--top_k=4', '--device=cpu', '--steps=1',
            '--batch_tokens=128', '--test_examples=1', '--stop_examples=1', f'--out={out}']
    recall.main([*args, '--name=a-lr1e-3-s1'])
    rows = recall.main([*args, '--name=a-lr1e-3-s2', '--seed=2'])
    assert [(r['seq_len'], r['n_pairs']) for r in rows] == list(TEST)
    with open(out, newline='') as f:
        written = list(csv.DictReader(f))
    assert [r['run'] for r in written] == ['a-lr1e-3-s1'] * 7 + ['a-lr1e-3-s2'] * 7
    assert {r['model'] for r in written} == {'a'}
    assert all(0 <= float(r['accuracy']) <= 1 for r in written)
    assert all(r['state_bytes'] == str(8 * 32 * 4) for r in written)
    assert written[0]['step_bytes'] == str(2 * 4 * 32 * 4)  # k rows read and written
    assert {(r['steps'], r['stopped']) for r in written} == {('1', 'budget')}


def write_recall(path, rows):
    fields = ('run', 'model', 'learning_rate', 'seed', 'seq_len', 'n_pairs', 'accuracy',
              'state_bytes', 'step_bytes')
    with open(path, 'w', newline='') as f:
        writer = csv.writer(f)
        writer.writerow(fields)
        writer.writerows(rows)


def test_the_best_rate_is_chosen_on_the_first_seed_within_the_training_lengths(tmp_path, capsys):
    """analysis.py recall: a model's best rate is the one whose first seed is most accurate up to
    256 tokens (the longer slices do not choose); its table cell holds its seeds at that rate;
    best.txt names the rate as the runs do; a best rate at an edge is warned about."""
    rows = []
    for lr, short, long in (('1e-3', 0.5, 0.9), ('3e-3', 0.7, 0.1), ('1e-2', 0.6, 0.1)):
        rows += [(f'm-lr{lr}-s1', 'm', float(lr), 1, 64, 4, short, 100, 50),
                 (f'm-lr{lr}-s1', 'm', float(lr), 1, 1024, 256, long, 100, 50)]
    rows += [('m-lr3e-3-s2', 'm', 3e-3, 2, 64, 4, 0.3, 100, 50),
             ('e-lr1e-3-s1', 'e', 1e-3, 1, 64, 4, 0.9, 10, 5),
             ('e-lr3e-3-s1', 'e', 3e-3, 1, 64, 4, 0.1, 10, 5)]
    write_recall(tmp_path / 'recall.csv', rows)
    table = analysis.main(['recall', f'--runs={tmp_path / "recall.csv"}',
                           f'--out={tmp_path / "r"}'])
    assert (tmp_path / 'r_best.txt').read_text() == 'e 1e-3\nm 3e-3\n'
    cell = {entry['model']: entry for entry in table}['m']
    assert cell['learning_rate'] == 3e-3 and cell['seeds'] == [1, 2] and cell[64, 4] == [0.7, 0.3]
    printed = capsys.readouterr().out
    assert "e's best rate 0.001 is the lowest" in printed and "m's best" not in printed


def test_the_recall_sweep_lists_every_model_at_each_rate_then_seeds_at_the_best(tmp_path):
    """reproduce.sh recall's run lines: seed 1 at each rate of LRS_RECALL, every model at the first
    rate first, names unique; a later seed at the rate of RESULTS/recall_best.txt alone (none where
    it has no line)."""
    env = dict(MODELS='', D_MODELS='128', LRS_RECALL='1e-3 3e-3 3e-4 1e-2', RESULTS=str(tmp_path))
    lines = reproduce_sh('recall_runs 1', **env).splitlines()
    names = [line.split()[0] for line in lines]
    assert len(names) == len(set(names)) == 20 * 4
    assert all('-lr1e-3-s1' in name for name in names[:20])
    assert names[0] == 'fm-block-m4096-k8-d128-lr1e-3-s1'
    attention = 'attn-d128-lr1e-2-s1 --mixer=attn --n_head=2 --d_model=128 --learning_rate=1e-2'
    assert f'{attention} --seed=1' in lines
    assert '--chunk_size=16' in lines[0] and '--chunk_size' not in lines[19]
    (tmp_path / 'recall_best.txt').write_text('attn-d128 3e-3\nmamba2-n16-d128 1e-2\n')
    seeds = reproduce_sh('recall_runs 2 2> /dev/null', **env).split('\n')
    assert [line.split()[0] for line in seeds if line] == ['mamba2-n16-d128-lr1e-2-s2',
                                                          'attn-d128-lr3e-3-s2']


def test_reproduce_recall_dry_run(tmp_path):
    """bash research/reproduce.sh recall on the CPU (a step a run, attention at one rate, seeds 1
    and 2): seed 1, then seed 2 at its best rate, 7 rows each, the table."""
    env = {**os.environ, 'RUNS': str(tmp_path / 'runs'), 'RESULTS': str(tmp_path / 'results'),
           'JOBS': '2', 'MODELS': 'attn', 'D_MODELS': '32', 'LRS_RECALL': '3e-3', 'SEEDS': '1 2',
           'PREVIOUS': '',
           'RECALL_ARGS': '--device=cpu --steps=1 --batch_tokens=128 --test_examples=1 '
                          '--stop_examples=1'}
    run = subprocess.run(['bash', 'research/reproduce.sh', 'recall'], cwd=REPO, capture_output=True,
                         text=True, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count('finished attn-d32') == 2, run.stdout
    with open(tmp_path / 'results' / 'recall.csv', newline='') as f:
        runs = [row['run'] for row in csv.DictReader(f)]
    assert (tmp_path / 'results' / 'recall_best.txt').read_text() == 'attn-d32 3e-3\n'
    assert runs == ['attn-d32-lr3e-3-s1'] * 7 + ['attn-d32-lr3e-3-s2'] * 7
    assert 'attn-d32 ' in run.stdout  # the table


@pytest.mark.parametrize('where', ['RESULTS', 'PREVIOUS'])
def test_a_run_with_rows_in_results_or_previous_is_not_trained_again(where, tmp_path):
    """recall_one skips a run whose rows RESULTS/recall.csv or a PREVIOUS folder's holds (else it
    would start research/recall.py, which fails on --no_such_setting)."""
    for folder in ('results', 'earlier'):
        (tmp_path / folder).mkdir()
    write_recall(tmp_path / ('results' if where == 'RESULTS' else 'earlier') / 'recall.csv',
                 [('attn-d32-lr3e-3-s1', 'attn-d32', 3e-3, 1, 64, 4, 0.5, 1, 1)])
    out = reproduce_sh('recall_one attn-d32-lr3e-3-s1 --no_such_setting=1',
                       RESULTS=str(tmp_path / 'results'), RUNS=str(tmp_path / 'runs'),
                       PREVIOUS=str(tmp_path / 'earlier'), TRAIN_SECONDS='0', DEADLINE='0', GPUS='',
                       RECALL_ARGS='')
    assert out == '' and not (tmp_path / 'runs').exists()


def test_fillers_are_uniform_over_the_tokens_that_are_not_keys():
    """Keys 1 and 2 of 5 tokens: fillers 0, 3 and 4 alike; keys 0 and 4: 1, 2 and 3."""
    counts = torch.stack([torch.bincount(row, minlength=5) for row in fillers(
        2, 30000, torch.tensor([[2, 1], [0, 4]]), 5, torch.Generator().manual_seed(0))]) / 10000
    assert rel_err(counts, torch.tensor([[1, 0, 0, 1, 1], [0, 1, 1, 1, 0]]).double()) < 0.03


def test_another_seed_alone_is_not_refused_before_its_best_rate_is_read(tmp_path):
    """SEEDS=2 in a new RESULTS folder: the settings check lists the call's models (the best rate
    comes from PREVIOUS's seed-1 rows once the call runs), not a refusal of 'no run'."""
    out = reproduce_sh('subset=recall; check_settings && echo accepted', RESULTS=str(tmp_path),
                       MODELS='attn', D_MODELS='32', SEEDS='2', LRS_RECALL='3e-3', PREVIOUS='',
                       JOBS='1', TRAIN_SECONDS='0', GPUS='', MEMORIES='16', TAUS='1',
                       SIZES='1M', LRS_TRANSFORMER='1e-3', LRS_MAMBA2='1e-3', LRS_FM='1e-3',
                       LRS_FM_BLOCK='1e-3')
    assert out.strip() == 'accepted'


ARGS = ['--mixer=fm', '--d_model=32', '--n_memory=8', '--top_k=4', '--device=cpu', '--steps=1',
        '--batch_tokens=128', '--test_examples=1', '--stop_examples=1']


def refusal(main, argv):
    """The message of the ConfigError main(argv) raises."""
    with pytest.raises(ConfigError) as error:
        main(argv)
    return str(error.value)


@pytest.mark.parametrize('arg', ['--learning_rate=0', '--learning_rate=1e308',
                                 '--learning_rate=-1', '--weight_decay=-1', '--grad_clip=-1',
                                 '--beta1=1.5', '--beta2=-0.1', f'--seed={2 ** 64}', '--seed=-1'])
def test_settings_train_py_refuses_are_refused_with_its_message(arg, tmp_path, monkeypatch):
    """A setting recall.py shares with train.py, out of range: refused before training, in
    train.py's words."""
    monkeypatch.setattr(recall, 'train', None)  # no training
    out = tmp_path / 'recall.csv'
    assert refusal(recall.main, [*ARGS, f'--out={out}', arg]) == refusal(train.settings, [arg])
    assert not out.exists()


@pytest.mark.parametrize('arg, message', [
    ('--warmup_steps=-1', '--warmup_steps=-1 is out of range: set it to at least 0'),
    ('--steps=0', '--steps=0 is out of range: set it to at least 1'),
    ('--stop_interval=0', '--stop_interval=0 is out of range: set it to at least 1'),
    ('--stop_examples=0', '--stop_examples=0 is out of range: set it to at least 1'),
    ('--decay_to=-0.1', '--decay_to=-0.1 is out of range: set it to at least 0 and at most 1'),
    ('--decay_to=1.5', '--decay_to=1.5 is out of range: set it to at least 0 and at most 1'),
    ('--stop_accuracy=0', '--stop_accuracy=0.0 is out of range: set it above 0 and at most 1'),
    ('--stop_accuracy=1.01', '--stop_accuracy=1.01 is out of range: set it above 0 and at most 1'),
    ('--n_memory=1000000000000', "parameters need 1,024,000.0 GB"),  # counted, not allocated
    ('--out=', '--out= cannot take the rows (No such file or directory)'),
    ('--out=TMP', 'cannot take the rows (Is a directory)'),
    ('--out=TMP/file/recall.csv', 'cannot take the rows'),
    ('--out=TMP/other.csv', 'holds other columns than research/recall.py writes: pass a new --out'),
    ('--out=TMP/binary.csv', 'cannot take the rows (not text)'),
    ('research/extrapolation_fm.py', 'research/recall.py takes no config files, only --key=value'),
])
def test_bad_settings_and_outputs_are_refused_before_training(arg, message, tmp_path, monkeypatch):
    """Each a line naming the setting, before any training (recall.train is gone): an --out that
    cannot be written or is another file's, an --n_memory no memory holds, a config file."""
    monkeypatch.setattr(recall, 'train', None)
    (tmp_path / 'file').write_text('')
    (tmp_path / 'other.csv').write_text('a,b\n1,2\n')
    (tmp_path / 'binary.csv').write_bytes(b'\xff\xfe\x00\x01')
    error = refusal(recall.main, [*ARGS, arg.replace('TMP', str(tmp_path))])
    assert message in error and '\n' not in error and '--out_dir' not in error


def test_each_row_is_written_as_its_slice_ends(tmp_path, monkeypatch):
    """A run stopped during its third test slice has written the first two rows."""
    real, calls = recall.accuracy, []

    def stopped_at_the_third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)
    monkeypatch.setattr(recall, 'accuracy', stopped_at_the_third)
    monkeypatch.setattr(recall, 'train_accuracy', lambda *args: 0.0)  # accuracy: the test's alone
    out = tmp_path / 'recall.csv'
    with pytest.raises(KeyboardInterrupt):
        recall.main([*ARGS, f'--out={out}'])
    with open(out, newline='') as f:
        assert [(int(r['seq_len']), int(r['n_pairs'])) for r in csv.DictReader(f)] == list(TEST)[:2]


def test_the_schedule_is_zoologys_by_default_and_train_pys_when_asked():
    """Defaults: no warmup, the peak at step 0, cosine to 0 at the end (half way: half the peak);
    warmup_steps=200, decay_to=0.1: train.py's linear warmup and floor of a tenth."""
    cfg = {key: recall.SETTINGS[key] for key in ('steps', 'warmup_steps', 'decay_to')}
    cfg.update(learning_rate=1e-2, steps=1000)
    assert cfg['warmup_steps'] == 0 and cfg['decay_to'] == 0 and recall.SETTINGS['steps'] >= 22624
    assert recall.learning_rate(0, cfg) == 1e-2
    assert abs(recall.learning_rate(500, cfg) - 5e-3) < 1e-12
    assert abs(recall.learning_rate(1000, cfg)) < 1e-12
    cfg.update(warmup_steps=200, decay_to=0.1)
    assert abs(recall.learning_rate(99, cfg) - 5e-3) < 1e-12
    assert abs(recall.learning_rate(1000, cfg) - 1e-3) < 1e-12


@pytest.mark.parametrize('stop_accuracy, steps, stopped', [(0.99, 3, 'early'), (1, 7, 'budget')])
def test_training_stops_once_the_training_shapes_pass_stop_accuracy(stop_accuracy, steps, stopped,
                                                                   tmp_path, monkeypatch):
    """The check (every stop_interval steps) says 0.995 each time: above 0.99 the run stops at the
    first check (step 3 of 7) and its rows say early; with stop_accuracy 1 it trains all 7 steps,
    budget. The check runs on held-out examples of the training shapes, not the test's."""
    checked = []

    def says(model, checks, batch_tokens, autocast):
        checked.append(list(checks))
        return 0.995
    monkeypatch.setattr(recall, 'train_accuracy', says)
    out = tmp_path / 'recall.csv'
    rows = recall.main([*ARGS, '--steps=7', '--stop_interval=3', f'--stop_accuracy={stop_accuracy}',
                        f'--out={out}'])
    assert {(r['steps'], r['stopped'], r['train_accuracy']) for r in rows} == {
        (steps, stopped, 0.995)}
    assert len(checked) == (1 if stopped == 'early' else 3)  # steps 3, 6 and the last
    assert all(shapes == list(TRAIN) for shapes in checked)
    assert all(r['train_loss'] == r['train_loss'] for r in rows)  # not NaN: the steps trained


def test_zoologys_metric_is_each_runs_mean_over_the_test_slices(tmp_path):
    """analysis.py recall: a run's mean over the 7 test slices (Zoology's metric), mean over the
    seeds with all 7, in the table and out_table.csv beside each slice: seed 1 0.1 ... 0.7 (mean
    0.4), seed 2 all 1.0 (mean 1.0): 0.7; seed 3 has 2 slices only and is left out of the mean; of
    the 2 seeds that say, 1 stopped early."""
    fields = ('run', 'model', 'learning_rate', 'seed', 'seq_len', 'n_pairs', 'accuracy',
              'state_bytes', 'step_bytes', 'stopped')
    rows = [('m-lr1e-3-s1', 'm', 1e-3, 1, t, p, (i + 1) / 10, 100, 50, 'budget')
            for i, (t, p) in enumerate(TEST)]
    rows += [('m-lr1e-3-s2', 'm', 1e-3, 2, t, p, 1.0, 100, 50, 'early') for t, p in TEST]
    rows += [('m-lr1e-3-s3', 'm', 1e-3, 3, t, p, 0.0, 100, 50, '') for t, p in TEST[:2]]
    with open(tmp_path / 'recall.csv', 'w', newline='') as f:
        writer = csv.writer(f)
        writer.writerow(fields)
        writer.writerows(rows)
    table = analysis.main(['recall', f'--runs={tmp_path / "recall.csv"}',
                           f'--out={tmp_path / "r"}'])
    entry = table[0]
    assert entry['mean'] == pytest.approx([0.4, 1.0]) and entry['early'] == (1, 2)
    with open(tmp_path / 'r_table.csv', newline='') as f:
        written = list(csv.DictReader(f))
    assert len(written) == 1
    assert float(written[0]['mean']) == pytest.approx(0.7) and written[0]['mean_seeds'] == '2'
    assert float(written[0]['64/4']) == pytest.approx((0.1 + 1.0 + 0.0) / 3, abs=1e-4)  # 3 seeds
    assert float(written[0]['1024/256']) == pytest.approx((0.7 + 1.0) / 2)
    assert written[0]['stopped_early'] == '1/2'


ISSUE_66 = {*(f'{kind}-m{m}-k8' for kind in ('fm-block', 'fm') for m in (16, 64, 256, 1024, 4096)),
            *(f'{kind}-m{m}-dense' for kind in ('fm-block', 'fm') for m in (16, 64)),
            *(f'mamba2-n{n}' for n in (16, 32, 64, 128, 256)), 'attn'}


def test_the_default_recall_sweep_is_issue_66s_and_lists_without_training(tmp_path):
    """LIST=1 bash research/reproduce.sh recall with its defaults: FM's block and the paper's layer
    at k = 8, m = 16-4,096, both dense at m <= 128, Mamba-2 at d_state 16-256, attention; each at
    Zoology's 4 rates, d_model 128 first (all its runs), then 64 and 256; nothing written."""
    env = {key: value for key, value in os.environ.items()
           if key not in ('D_MODELS', 'LRS_RECALL', 'MODELS', 'SEEDS', 'RECALL_ARGS')}
    env.update(LIST='1', RESULTS=str(tmp_path / 'results'), RUNS=str(tmp_path / 'runs'))
    run = subprocess.run(['bash', 'research/reproduce.sh', 'recall'], cwd=REPO, capture_output=True,
                         text=True, env=env)
    assert run.returncode == 0, run.stderr
    names = [line.split()[0] for line in run.stdout.splitlines()]
    assert len(names) == len(set(names)) == 20 * 4 * 3 and not os.listdir(tmp_path)
    parsed = [recall.RUN_NAME.split(name)[:3] for name in names]  # model-dD, lr, seed
    assert {model.rsplit('-d', 1)[0] for model, _, _ in parsed} == ISSUE_66
    assert [model.rsplit('-d', 1)[1] for model, _, _ in parsed] == ['128'] * 80 + ['64'] * 80 + \
        ['256'] * 80
    assert {lr for _, lr, _ in parsed} == {'1e-3', '3e-3', '1e-2', '3e-2'}
    assert {seed for _, _, seed in parsed} == {'1'}


def test_a_run_killed_after_a_checkpoint_goes_on_from_it_as_if_never_stopped(tmp_path,
                                                                            monkeypatch):
    """30 steps, a checkpoint at step 28: killed at step 29, then run again, the run resumes at step
    28 and writes the rows of a run never stopped (the same accuracies, steps and loss, the last 3
    steps' mean: one from before the kill); the file is gone once the rows are written; another
    run's settings are refused with what to do."""
    args = [*ARGS, '--steps=30', '--stop_interval=28', '--stop_accuracy=1']
    whole = recall.main([*args, f'--out={tmp_path / "whole.csv"}'])
    state = tmp_path / 'state.pt'
    args += [f'--checkpoint={state}', f'--out={tmp_path / "resumed.csv"}']
    real, drawn = recall.mqar, []

    def killed_at_step_29(*a, **k):
        drawn.append(1)
        if len(drawn) == 29:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(recall, 'mqar', killed_at_step_29)
    with pytest.raises(KeyboardInterrupt):
        recall.main(args)
    assert torch.load(state, weights_only=False)['progress'][0] == 28
    with pytest.raises(ConfigError, match='holds a run of other settings'):
        recall.main([*args, '--learning_rate=3e-3'])
    resumed = recall.main(args)
    assert len(drawn) == 29 + 2  # steps 29 and 30 drawn again
    keep = ('accuracy', 'train_loss', 'steps', 'stopped', 'train_accuracy')
    assert [[r[k] for k in keep] for r in resumed] == [[r[k] for k in keep] for r in whole]
    assert not state.exists()
