"""The README's commands (Quickstart, Training, Sampling, Evaluating) in order, at toy size; its bench.py commands;
the numbers of its Results against docs/results."""

import os
from pathlib import Path

import torch

import eval as evaluation
import prepare_data
import sample
import train
from conftest import REPO
from research import analysis


def readme_text():
    return open(os.path.join(REPO, 'README.md'), encoding='utf-8').read()


def readme_section(name):
    """The text of the README's section `## name`, up to the next section."""
    return readme_text().split(f'\n## {name}\n')[1].split('\n## ')[0]


def readme_commands(sections=('Quickstart', 'Training', 'Sampling', 'Evaluating')):
    """The python commands in the code blocks of these README sections, in order, as argument lists."""
    import shlex
    commands = []
    for section in sections:
        for block in readme_section(section).split('```')[1::2]:
            if block.startswith('python\n'):  # Python code, not commands
                continue
            for line in block.splitlines():
                for command in line.split('#')[0].split('&&'):
                    words = shlex.split(command)
                    if words[:1] == ['python']:
                        commands.append(words[1:])
    return commands


def toy(command):
    """A README command at toy size: for train.py a tiny model and a hundredth of the steps (500 by default: 5), for
    sample.py 10 tokens; eval.py and research/analysis.py as written."""
    script, args = command[0], command[1:]
    if script == 'train.py':
        steps = [a.split('=')[0] + f"={int(a.split('=')[1]) // 100}" if a.startswith(('--max_iters=',
                 '--lr_decay_iters=', '--warmup_iters=')) else a for a in args]
        default_steps = ([] if any(a.startswith('--max_iters=') for a in args) else ['--max_iters=5']) + (
            [] if any(a.startswith('--warmup_iters=') for a in args) else ['--warmup_iters=0'])
        return steps + default_steps + ['--n_layer=1', '--d_model=32', '--n_memory=8', '--top_k=2', '--batch_size=2',
                                        '--block_size=32', '--eval_iters=1', '--log_interval=1']
    if script == 'sample.py':
        return args + ['--max_new_tokens=10']
    return args


def test_readme_commands_work_in_order(data_dir, tmp_path, monkeypatch, capsys):
    """The commands of the README's Quickstart, Training, Sampling and Evaluating, in order in a fresh folder (the
    default corpus prepared), at toy size; a training run's last line says where it saved."""
    commands = readme_commands()
    skipped = [c for c in commands if c[0] == 'test_fm.py' or c[:2] in (['eval.py', 'harness'],
                                                                        ['research/analysis.py', 'scaling'])]
    assert [c[:2] for c in skipped] == [['test_fm.py'], ['eval.py', 'harness'],
                                        ['research/analysis.py', 'scaling']]  # lm-eval, GPU
    assert len(commands) - len(skipped) >= 9
    os.symlink(os.path.join(REPO, 'config'), tmp_path / 'config')
    os.symlink(data_dir, tmp_path / 'data')
    monkeypatch.setattr(prepare_data, 'DEFAULT_DATA_DIR', Path(data_dir))  # the default: the suite's prepared copy,
    monkeypatch.setattr(evaluation, 'DEFAULT_DATA_DIR', data_dir)  # not the repository's data/ (parallel workers)
    monkeypatch.chdir(tmp_path)
    mains = {'train.py': train.main, 'sample.py': sample.main, 'eval.py': evaluation.main,
             'research/analysis.py': analysis.main}
    for command in commands:
        if command not in skipped:
            mains[command[0]](toy(command))
            last = capsys.readouterr().out.strip().splitlines()[-1]
            if command[0] == 'train.py':
                assert last.startswith('saved ') and 'ckpt.pt (step ' in last and 'python sample.py --out_dir=' in last
    assert {'out', 'out-fm-small', 'out-transformer-small', 'out-attn'} <= set(os.listdir(tmp_path))
    assert torch.load(tmp_path / 'out' / 'ckpt.pt', weights_only=True)['iter_num'] == 6  # resumed
    assert os.path.exists(tmp_path / 'results' / 'loss_by_position.csv')
    assert os.path.exists(tmp_path / 'out-fm-small' / 'routing.json')
    assert os.path.exists(tmp_path / 'results' / 'sweep.csv')


def test_readme_commands_say_what_they_need():
    """Each Sampling and Evaluating block names the training run of every folder its commands read (the command a
    missing checkpoint's error gives); the Quickstart gives the threads advice of a busy machine."""
    import re
    from checkpoint import training_command
    for section in ('Sampling', 'Evaluating'):
        for block in readme_section(section).split('```')[1::2]:
            default = {'out'} if 'python sample.py  ' in block else set()  # sample.py without --out_dir
            for folder in set(re.findall(r'--(?:out_dir|runs)=(out[\w-]*)(?:\s|$)', block)) | default:
                needs = training_command(folder).removeprefix('python train.py ')
                assert (needs if needs.startswith('config/') else 'python train.py') in block, (section, folder)
    assert 'OMP_NUM_THREADS=1 python train.py' in readme_section('Quickstart')


def test_readme_bench_commands_parse_and_sweep():
    """Every `python bench.py ...` of the README (its Benchmarking block and the commands its Results cite) parses
    with bench.py's parser, and one with --sweep sweeps: bench.SWEEP when it names no lengths (it gave none, which
    turned the sweep off), else those."""
    import re
    import shlex
    import bench
    readme = readme_text()
    cited = [shlex.split(c)[1:] for c in re.findall(r'`(python bench\.py [^`]*)`', readme)]
    commands = [c for c in readme_commands(('Benchmarking',)) if c[0] == 'bench.py'] + cited
    assert len(commands) >= 7 and any(c[-1] == '--sweep' for c in commands)  # --sweep naming no lengths
    for command in commands:
        assert bool(bench.parse_args(command[1:]).sweep) == ('--sweep' in command), command
    assert bench.parse_args(['generate', '--sweep']).sweep == bench.SWEEP == [1024, 4096, 16384, 65536]
    assert bench.parse_args(['generate', '--sweep', '1024', '65536', '--batch', '1']).sweep == [1024, 65536]


# ----------------------------------------------------------------------------- the Results' numbers against their data

RESULTS = Path(REPO) / 'docs' / 'results'


def rounded(value, digits=3):
    """value as the README prints it: rounded half up to digits decimals."""
    from decimal import ROUND_HALF_UP, Decimal
    return str(Decimal(repr(float(value))).quantize(Decimal(1).scaleb(-digits), ROUND_HALF_UP))


def readme_table(after):
    """The cells of the first Markdown table after the text `after` in the README, a list a row, less the header."""
    body = readme_text().split(after, 1)[1]
    lines = [line for line in body.split('\n\n| ', 1)[1].split('\n\n')[0].splitlines()]
    return [[cell.strip().strip('*').strip() for cell in line.strip('|').split('|')] for line in lines[2:]]


def table(*files):
    """analysis.py table's rows of docs/results files (sweep .csv and loss-by-position .csv), by run name."""
    rows = analysis.table_rows(*analysis.table_inputs([str(RESULTS / f) for f in files]))
    return {row['name']: row for row in rows}


def seeds_text(row, digits=3):
    """'1.538 (1.534-1.543, 2)' of a table row."""
    return (f"{rounded(row['val_loss'], digits)} ({rounded(row['val_min'], digits)}-{rounded(row['val_max'], digits)}, "
            f"{row['seeds']})")


def test_readme_quality_table_is_its_data():
    """Every number of the quality table is docs/results/2026-11-25's (each model at its best rate: the rate, the
    validation loss's mean, range and seeds, the loss so far at 1x, 8x and 64x the context, rounded as printed)."""
    rows = table('2026-11-25/extrapolation_lr.csv', '2026-11-25/extrapolation_positions.csv')
    names = {'Transformer': 'transformer', 'Mamba-2': 'mamba2', "FM k = m/4 = 16, the paper's layer": 'fm-k16',
             '+ output gate': 'fm-k16-gate', '+ convolution': 'fm-k16-conv', "+ both: FM's block": 'fm-k16-block'}
    cells = readme_table('**Quality at small scale**')
    assert len(cells) == len(names)
    for label, val, *so_far in cells:
        model, rate = label.rsplit(' (', 1)
        row = rows[names[model.strip('* ')]]
        assert rate.rstrip(')*') == f"{row['learning_rate']:.0e}".replace('e-0', 'e-'), label
        assert val == seeds_text(row), label
        assert so_far == [rounded(row[f'so_far_{f}x'], 2) for f in (1, 8, 64)], label


def close(text, value):
    """Whether a README number ('68.3 ms', '50%', '94.3K') is value rounded to the digits it prints."""
    import re
    number = re.search(r'-?[\d.]+', text.replace(',', ''))[0]
    scale = 1e3 if text.split()[0].endswith('K') else 0.01 if '%' in text else 1
    digits = len(number.split('.')[1]) if '.' in number else 0
    return abs(float(number) * scale - value) <= 0.5 * 10 ** -digits * scale + 1e-9


def csv_rows(path):
    import csv
    with open(RESULTS / path, newline='') as f:
        return {row['model']: row for row in csv.DictReader(f)}


def test_readme_benchmark_tables_are_their_data():
    """The generation tables' numbers are docs/results' (transcribed from the log: bench.py prints, writes no file),
    rounded as printed."""
    data = csv_rows('2026-11-24/generate.csv')
    names = {"fm_1b, the paper's layer (k = 8)": 'fm_1b k=8',
             "mamba2_1b (mamba-ssm's step)": 'mamba2_1b mamba-ssm step',
             'transformer_1b (static KV cache)': 'transformer_1b'}
    cells = readme_table('**Generation**')
    assert [row[0] for row in cells] == list(names)
    keys = ('prefill_16k_ms', 'b1_ms_per_token', 'b1_of_floor', 'b64_ms_per_token', 'b64_of_floor')
    for label, *values in cells:
        for text, key in zip(values, keys, strict=True):
            assert close(text, float(data[names[label]][key])), (label, key, text)
    data = csv_rows('2026-11-25/generate_block.csv')
    names = {"fm_1b, the paper's layer": "fm_1b the paper's layer", 'fm_1b, with the block': 'fm_1b the block',
             "mamba2_1b (mamba-ssm's step)": "mamba2_1b mamba-ssm's step"}
    cells = readme_table("**FM's block at 1B**")
    assert [row[0] for row in cells] == list(names)
    for label, prefill, batch_1, batch_64, training in cells:
        row = data[names[label]]
        tokens, mfu = training.split(', ')
        for text, key in ((prefill, 'prefill_16k_ms'), (batch_1, 'b1_ms_per_token'), (batch_64, 'b64_ms_per_token'),
                          (tokens, 'train_tokens_per_s'), (mfu, 'train_mfu')):
            assert close(text, float(row[key])), (label, key, text)


def so_far(name, t, *files):
    """The mean loss so far at t over a model's best-rate runs (those of its name) in docs/results' files."""
    import numpy as np
    rows = [r for f in files for r in analysis.positions_csv(str(RESULTS / f))
            if analysis.run_name(r['label']) == name]
    return float(np.mean([evaluation.loss_at(r, t) for r in rows]))


def test_readme_sentences_are_their_data():
    """The numbers of the Results' sentences (levers, memory scaling, the frontier, the block against the others)
    as docs/results gives them, rounded as printed: each phrase built from the data is in the README."""
    import numpy as np
    readme = ' '.join((readme_text() + open(os.path.join(REPO, 'research', 'README.md'), encoding='utf-8').read())
                      .split())  # the levers' numbers stand in research/README.md
    phrases = []
    levers = table('2026-11-27/levers_lr.csv', '2026-11-27/mamba2_lr.csv', '2026-11-27/levers_positions.csv',
                   '2026-11-27/mamba2_positions.csv')
    for label, name in (('Mamba-2', 'mamba2'), ('the block', 'fm-k16-block'), ('a learned write rate per row',
                        'RowRatesFM'), ('the write gate started at 0.05', 'LowWriteFM'), ('4 routers of 16 rows',
                        'HeadsFM'), ('16 of 4', 'Heads16FM')):
        row = levers[name]
        phrases.append(f"{label} {seeds_text(row).rsplit(', ', 1)[0]}) / {rounded(row['so_far_64x'])}")
    ctx = table('2026-11-27/levers_ctx2048_lr.csv')['ctx2048']
    phrases.append(f"2,048 {seeds_text(ctx).rsplit(', ', 1)[0]}, at 2,048) / "
                   f"{rounded(so_far('ctx2048', 32768, '2026-11-27/levers_positions.csv'))}")
    second = table('2026-11-27/second-start/slow_writes_lr.csv')
    for label, name in (('writes capped at 0.1', 'SlowWriteFM'), ('a 16-tap convolution', 'conv16'),
                        ("the block's", 'fm-k16-block')):
        phrases.append(f"{label} {seeds_text(second[name]).rsplit(', ', 1)[0]})")
    block, mamba = levers['fm-k16-block'], levers['mamba2']
    phrases.append(f"{rounded(block['val_loss'], 4)}, {rounded(block['val_min'], 4)}-{rounded(block['val_max'], 4)}, "
                   f"against {rounded(mamba['val_loss'], 4)}, {rounded(mamba['val_min'], 4)}-"
                   f"{rounded(mamba['val_max'], 4)}: ranges apart")
    phrases.append(f"{rounded(100 * (block['val_loss'] / mamba['val_loss'] - 1), 1)}% above it at the context")
    phrases.append(f"{rounded(100 * (block['so_far_64x'] / mamba['so_far_64x'] - 1), 1)}% at 64x it "
                   f"({rounded(block['so_far_64x'])} / {rounded(mamba['so_far_64x'])})")
    quality = table('2026-11-25/extrapolation_lr.csv')
    phrases.append(f"{rounded(100 * (1 - quality['fm-k16-block']['val_loss'] / quality['fm-k16']['val_loss']), 1)}% "
                   f"below the paper's layer at the context")
    # the gap past the context, seed by seed (the block against Mamba-2, both at their best rates)
    pairs = [(f'fm-k16-block-lr2e-3-s{s}', f'mamba2-lr4e-3-s{s}') for s in (1, 2, 3)]
    results = {r['label']: r for f in ('levers_positions.csv', 'mamba2_positions.csv')
               for r in analysis.positions_csv(str(RESULTS / '2026-11-27' / f))}
    for t in (32768, 512):
        gaps = [evaluation.loss_at(results[b], t) - evaluation.loss_at(results[m], t) for b, m in pairs]
        phrases.append(' / '.join(rounded(g) for g in gaps) + ' (seeds 1 / 2 / 3)' * (t == 32768))
    phrases.append('validation ' + ' / '.join(rounded(results[b]['val_loss'] - results[m]['val_loss'])
                                              for b, m in pairs))
    buckets = [np.mean([next(x['loss'] for x in results[b]['buckets'] if x['start'] == start)
                        - next(x['loss'] for x in results[m]['buckets'] if x['start'] == start) for b, m in pairs])
               for start in (2 ** i for i in range(11, 19))]
    phrases.append(f"256K the gap is {rounded(min(buckets))}-{rounded(max(buckets))} nats")
    # memory scaling, 3 seeds: each series at each m's best tau
    rows = analysis.scaling_rows([str(RESULTS / '2026-11-27b' / 'scaling-block.csv')])
    best = analysis.best_per_series(rows)
    for label, series in (('dense', 'dense (k = m)'), ('k = m/4', 'k = m/4')):
        phrases.append(f'{label} ' + ' / '.join(
            f"{rounded(p['val_loss'])} ({rounded(min(p['losses']))}-{rounded(max(p['losses']))})"
            for p in best[series].values()))
    # the frontier: the block against the paper's layer and Mamba-2 at each size, one run each
    points = analysis.frontier_points(analysis.sweep([str(RESULTS / '2026-11-25' / 'frontier.csv'),
                                                      str(RESULTS / '2026-11-24' / 'frontier.csv')])[0])
    losses = {arch: [p['val_loss'] for p in series] for arch, series in points.items()}
    block = losses['fm m=64 k=16 tau=1 conv4 gate']
    block_fm = [100 * (1 - b / p) for b, p in zip(block, losses['fm m=64 k=16 tau=1'], strict=True)]
    block_mamba = [100 * (b / m - 1) for b, m in zip(block, losses['mamba2'], strict=True)]
    phrases.append(f"{rounded(min(block_fm), 1)}-{rounded(max(block_fm), 1)}% below the paper's layer's and "
                   f"{rounded(min(block_mamba), 1)}-{rounded(max(block_mamba), 1)}% above Mamba-2's")
    at_8x = [p['loss_so_far_8x'] - m['loss_so_far_8x'] for p, m in zip(points['fm m=64 k=16 tau=1 conv4 gate'],
                                                                         points['mamba2'], strict=True)]
    phrases.append(f'at 8x the gap goes {rounded(at_8x[0])} -> {rounded(at_8x[-1])} nats from 1.1M to 8.3M')
    # 8.3M and memory scaling with per-row rates, one seed
    at_8m = table('2026-11-27/frontier_8M.csv')
    phrases.append(f"Mamba-2 {rounded(at_8m['mamba2-8M']['val_loss'])}, the block "
                   f"{rounded(at_8m['fm-k16-block-8M']['val_loss'])}, per-row rates "
                   f"{rounded(at_8m['fm-k16-rowrates-block-8M']['val_loss'])}")
    rates = analysis.best_per_series(analysis.scaling_rows([str(RESULTS / '2026-11-27' / 'scaling-RowRatesFM.csv')]))
    phrases.append(f"k = m/4 {' / '.join(rounded(p['val_loss']) for p in rates['k = m/4'].values())}, dense "
                   f"{' / '.join(rounded(p['val_loss']) for p in rates['dense (k = m)'].values())}")
    cpu = {name: rounded(float(row['val_loss'])) for name, row in csv_rows('2026-11-27b/cpu_small.csv').items()}
    phrases += [f"`fm_small` {cpu['fm_small']} (with the block, 2026-11-25; the paper's layer "
                f"{cpu['fm_small config/paper_layer.py']},", f"`transformer_small` {cpu['transformer_small']} and "
                f"`mamba2_small` {cpu['mamba2_small']} (2026-11-27"]
    missing = [phrase for phrase in phrases if phrase not in readme]
    assert not missing, missing
