"""The README's commands (Quickstart, Training, Sampling, Evaluating) in order, at toy size; the bench.py commands;
the numbers and verdict words of README.md's Results and research/README.md's Results in detail, each sentence built
from its data file in docs/results and found in each README that prints it; the README's paper table, each verdict
and evidence cell computed from its data by a function a row (VERDICTS), and research/README.md's numbers behind it;
research/README.md's redraws as published; reproduce.sh's Python (python3 or PYTHON)."""

import os
from pathlib import Path

import pytest
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
                                                                        ['research/analysis.py', 'scaling'])
               or any(a.startswith('hf:') for a in c)]
    assert [c[:2] for c in skipped] == [['test_fm.py'], ['prepare_data.py', '--dataset'], ['eval.py', 'harness'],
                                        ['research/analysis.py', 'scaling']]  # the network (DCLM, lm-eval), GPU
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
    """Every `python bench.py ...` of the READMEs (the Benchmarking block, the commands research/README cites) parses
    with bench.py's parser, and one with --sweep sweeps: bench.SWEEP when it names no lengths (it gave none, which
    turned the sweep off), else those."""
    import re
    import shlex
    import bench
    readme = readme_text() + open(os.path.join(REPO, RESEARCH), encoding='utf-8').read()
    cited = [shlex.split(c)[1:] for c in re.findall(r'`(python bench\.py [^`]*)`', ' '.join(readme.split()))]
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


def readme_table(after, path='README.md'):
    """The cells of the first Markdown table after the text `after` in a README, a list a row, less the header."""
    body = open(os.path.join(REPO, path), encoding='utf-8').read().split(after, 1)[1]
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
    cells = readme_table('**Quality at small scale**', RESEARCH)
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
    cells = readme_table('**Generation**', RESEARCH)
    assert [row[0] for row in cells] == list(names)
    keys = ('prefill_16k_ms', 'b1_ms_per_token', 'b1_of_floor', 'b64_ms_per_token', 'b64_of_floor')
    for label, *values in cells:
        for text, key in zip(values, keys, strict=True):
            assert close(text, float(data[names[label]][key])), (label, key, text)
    data = csv_rows('2026-11-25/generate_block.csv')
    names = {"fm_1b, the paper's layer": "fm_1b the paper's layer", 'fm_1b, with the block': 'fm_1b the block',
             "mamba2_1b (mamba-ssm's step)": "mamba2_1b mamba-ssm's step"}
    cells = readme_table("**FM's block at 1B**", RESEARCH)
    assert [row[0] for row in cells] == list(names)
    for label, prefill, batch_1, batch_64, training in cells:
        row = data[names[label]]
        tokens, mfu = training.split(', ')
        for text, key in ((prefill, 'prefill_16k_ms'), (batch_1, 'b1_ms_per_token'), (batch_64, 'b64_ms_per_token'),
                          (tokens, 'train_tokens_per_s'), (mfu, 'train_mfu')):
            assert close(text, float(row[key])), (label, key, text)


def test_readme_sparse_table_is_its_data():
    """The sparse-training table (research/README.md) and the recall step sentence are docs/results/2026-12-07's,
    rounded as printed."""
    import csv
    with open(RESULTS / '2026-12-07/sparse.csv', newline='') as f:
        data = {(row['B T D'], row['m']): row for row in csv.DictReader(f)}
    shapes = ['8 2048 2048', '8 2048 2048', '64 256 128', '64 256 128']
    keys = ['sparse ms', 'masked ms', 'sparse ms', 'masked ms']
    cells = readme_table('## Sparse training', RESEARCH)
    assert len(cells) == len(shapes)
    header = ['64', '128', '1,024', '4,096', '16,384']
    for row, shape, key in zip(cells, shapes, keys):
        for m, text in zip(header, row[1:], strict=True):
            value = data.get((shape, m.replace(',', '')), {}).get(key, '')
            assert (text == '-') == (value == ''), (row[0], m, text)
            assert text == '-' or close(text, float(value)), (row[0], m, text, value)
    with open(RESULTS / '2026-12-07/recall_steps.csv', newline='') as f:
        means = {(row['n_memory'], row['step']): float(row['ms_a_step_so_far']) for row in csv.DictReader(f)}
    last_100 = {m: (300 * means[m, '300'] - 200 * means[m, '200']) / 100 for m in ('64', '1024')}
    phrase = f"({rounded(last_100['1024'], 0)} and {rounded(last_100['64'], 0)} ms, H100;"
    assert phrase in flat(README), phrase


def so_far(name, t, *files):
    """The mean loss so far at t over a model's best-rate runs (those of its name) in docs/results' files."""
    import numpy as np
    rows = [r for f in files for r in analysis.positions_csv(str(RESULTS / f))
            if analysis.run_name(r['label']) == name]
    return float(np.mean([evaluation.loss_at(r, t) for r in rows]))


README, RESEARCH = 'README.md', 'research/README.md'


def flat(path):
    """A README's text with its whitespace runs made one space (a phrase may wrap)."""
    return ' '.join(open(os.path.join(REPO, path), encoding='utf-8').read().split())


def assert_printed(claims):
    """claims: (phrase built from the data, the READMEs that print it, a README named once a time it prints it, the
    data): each phrase, its numbers and its verdict words computed from its data, stands that often in each."""
    texts = {path: flat(path) for path in (README, RESEARCH)}
    missing = [f'{path}: "{phrase}" {paths.count(path)} time(s) (from {data})' for phrase, paths, data in claims
               for path in set(paths) if texts[path].count(phrase) < paths.count(path)]
    assert not missing, ('these sentences disagree with their data (a README bug; or, after docs/results changed, '
                         'print what the data now says):\n' + '\n'.join(missing))


def apart(a, b):
    """The verdict on two seed ranges: 'ranges apart' where they do not overlap, else 'within the spread'."""
    return 'ranges apart' if max(a) < min(b) or max(b) < min(a) else 'within the spread'


def percent(x, y):
    """'5.8% below' / '1.1% above': x against y."""
    return f"{rounded(100 * abs(x / y - 1), 1)}% {'below' if x < y else 'above'}"


def span(values, digits=1, unit=''):
    """'5.1-7.3' of several values, rounded as printed; one value if they round alike."""
    low, high = rounded(min(values), digits), rounded(max(values), digits)
    return f'{low}{unit}' if low == high else f'{low}-{high}{unit}'


def quality_rows():
    return table('2026-11-25/extrapolation_lr.csv', '2026-11-25/extrapolation_positions.csv')


def seed_losses(sweep_file, name):
    """The validation losses of a model's best-rate runs in a sweep .csv."""
    return [r['val_loss'] for r in analysis.csv_records(str(RESULTS / sweep_file))
            if r['best_lr'] and analysis.run_name(r['run']) == name]


def levers_rows():
    return table('2026-11-27/levers_lr.csv', '2026-11-27/mamba2_lr.csv', '2026-11-27/levers_positions.csv',
                 '2026-11-27/mamba2_positions.csv')


def test_readme_quality_sentences_are_their_data():
    """The block against the paper's layer and Mamba-2 (the percentages and their range verdicts), in each README
    that prints them; the parameters' match (a bound: rounded up)."""
    import math
    quality, levers = quality_rows(), levers_rows()
    data = 'docs/results/2026-11-25/extrapolation_lr.csv'
    block, layer = quality['fm-k16-block'], quality['fm-k16']
    verdict = apart(seed_losses('2026-11-25/extrapolation_lr.csv', 'fm-k16-block'),
                    seed_losses('2026-11-25/extrapolation_lr.csv', 'fm-k16'))
    sizes = {name: r['non_embedding_parameters'] for r in analysis.csv_records(str(RESULTS / '2026-11-25' /
             'extrapolation_lr.csv')) for name in [analysis.run_name(r['run'])] if name in quality}
    spread_of_sizes = 100 * (max(sizes.values()) / min(sizes.values()) - 1)
    claims = [(f"parameters matched within {math.ceil(10 * spread_of_sizes) / 10:g}%", [RESEARCH], data),
              (f"The block is {percent(block['val_loss'], layer['val_loss'])} the paper's layer at the context "
               f"({block['seeds']} seeds each, {verdict})", [RESEARCH], data)]
    block, mamba = levers['fm-k16-block'], levers['mamba2']
    data = 'docs/results/2026-11-27/levers_lr.csv, mamba2_lr.csv, *_positions.csv'
    at_context, at_64x = percent(block['val_loss'], mamba['val_loss']), percent(block['so_far_64x'],
                                                                                 mamba['so_far_64x'])
    verdict = apart(seed_losses('2026-11-27/levers_lr.csv', 'fm-k16-block'),
                    seed_losses('2026-11-27/mamba2_lr.csv', 'mamba2'))
    claims += [(f"it is {at_context} Mamba-2 at the context and {at_64x.split('%')[0]}% at 64x it", [RESEARCH], data),
               (f"the block is {at_context} it at the context ({rounded(block['val_loss'], 4)}, "
                f"{rounded(block['val_min'], 4)}-{rounded(block['val_max'], 4)}, against "
                f"{rounded(mamba['val_loss'], 4)}, {rounded(mamba['val_min'], 4)}-{rounded(mamba['val_max'], 4)}: "
                f"{verdict}) and {at_64x.split('%')[0]}% at 64x it ({rounded(block['so_far_64x'])} / "
                f"{rounded(mamba['so_far_64x'])})", [RESEARCH], data)]
    assert_printed(claims)


def frontier():
    """analysis.py frontier's points of docs/results, {architecture: [point a size, ascending]}."""
    return analysis.frontier_points(analysis.sweep([str(RESULTS / '2026-11-25' / 'frontier.csv'),
                                                    str(RESULTS / '2026-11-24' / 'frontier.csv')])[0])


BLOCK, LAYER = 'fm m=64 k=16 tau=1 conv4 gate', 'fm m=64 k=16 tau=1'


def test_readme_frontier_sentences_are_their_data():
    """The block against the paper's layer, Mamba-2 and the Transformer at each size (percentages, signs, 'at every
    size'), the gap at 8x, and the seed range at 4.1M, in each README that prints them."""
    points = frontier()
    data = 'docs/results/2026-11-25/frontier.csv and 2026-11-24/frontier.csv'
    loss = {arch: [p['val_loss'] for p in series] for arch, series in points.items()}
    to_layer = [100 * (b / p - 1) for b, p in zip(loss[BLOCK], loss[LAYER], strict=True)]
    to_mamba = [100 * (b / m - 1) for b, m in zip(loss[BLOCK], loss['mamba2'], strict=True)]
    word = {True: 'below', False: 'above'}
    assert len({x < 0 for x in to_layer}) == len({x > 0 for x in to_mamba}) == 1, (
        f'the block is not on one side of the paper\'s layer or Mamba-2 at every size ({data}): the frontier '
        f'sentences need rewording')
    sentence = (f"{span([abs(x) for x in to_layer])}% {word[to_layer[0] < 0]} the paper's layer's and "
                f"{span([abs(x) for x in to_mamba])}% {word[to_mamba[0] < 0]} Mamba-2's")
    ranges = [max(v) - min(v) for name in ('transformer', 'mamba2', 'fm-k16', 'fm-k16-block')
              for v in [seed_losses('2026-11-25/extrapolation_lr.csv', name)]]
    below_transformer = all(b < t for b, t in zip(loss[BLOCK], loss['attn'], strict=True))
    gaps = {f: [p[f'loss_so_far_{f}x'] - m[f'loss_so_far_{f}x'] for p, m in zip(points[BLOCK], points['mamba2'],
                                                                                  strict=True)] for f in (2, 8)}
    trails = all(g > 0 for g in gaps[2] + gaps[8])
    layer_gaps = [p['loss_so_far_8x'] - m['loss_so_far_8x'] for p, m in zip(points[LAYER], points['mamba2'],
                                                                             strict=True)]
    narrows = all(a > b for a, b in zip(layer_gaps, layer_gaps[1:]))
    monotone = all(a > b for a, b in zip(gaps[8], gaps[8][1:]))
    both_below = all(p['loss_so_far_8x'] < t['loss_so_far_8x'] for arch in (BLOCK, LAYER)
                     for p, t in zip(points[arch], points['attn'], strict=True))
    assert_printed([
        (f"{'' if monotone else ', not monotone'}; the paper's layer's gap at 8x "
         f"{'narrows' if narrows else 'does not narrow'}, {' / '.join(rounded(g) for g in layer_gaps)}; the "
         f"Transformer half: at 8x {'both FM layers below' if both_below else 'FM not below'} the Transformer at "
         f"every size", [RESEARCH], data),
        (sentence, [RESEARCH, RESEARCH], data),
        (f"(at 4.1M the seed range is {span(ranges, 3)})", [RESEARCH], '2026-11-25/extrapolation_lr.csv'),
        (f"the block's frontier is above Mamba-2's, {'below' if below_transformer else 'not below'} the "
         f"Transformer's", [RESEARCH], data),
        (f"the block trails Mamba-2 at 2x and 8x {'at every size' if trails else 'at some sizes'}; at 8x the gap goes "
         f"{' / '.join(rounded(g) for g in gaps[8])} nats from 1.1M to 8.3M", [RESEARCH], data),
    ])


def test_readme_routing_sentences_are_their_data():
    """Inside the memory (routing.csv: effective rows by selection and by weight, the heaviest row's write rate) and
    the levers' heaviest rows (levers_routing.csv, .txt), in each README that prints them."""
    import csv
    import math
    import numpy as np

    def medians(path, column):
        with open(RESULTS / path, newline='') as f:
            rows = list(csv.DictReader(f))
        groups = {}
        for row in rows:
            groups.setdefault(analysis.run_name(row['checkpoint']), []).append(float(row[column]))
        return {name: float(np.median(values)) for name, values in groups.items()}

    data = 'docs/results/2026-11-25/routing.csv'
    by_selection = medians('2026-11-25/routing.csv', 'effective_rows')
    by_weight = medians('2026-11-25/routing.csv', 'weight_effective_rows')
    theta = medians('2026-11-25/routing.csv', 'busiest_row_theta')
    models = ('fm-k16', 'fm-k16-block')
    every = [1 / theta[m] for m in models]
    claims = [(f"({span([by_selection[m] for m in models], 0)} effective rows of 64)", [RESEARCH], data),
              (f"a median of {rounded(by_weight['fm-k16'], 1)} effective rows a layer in the paper's layer, "
               f"{rounded(by_weight['fm-k16-block'], 1)} with the block", [RESEARCH], data),
              (f"rewritten every {math.floor(min(every))}-{math.ceil(max(every))} tokens (median write rate "
               f"{' / '.join(rounded(theta[m], 2) for m in models)})", [RESEARCH], data)]
    data = 'docs/results/2026-11-27/levers_routing.csv, levers_routing.txt'
    theta = medians('2026-11-27/levers_routing.csv', 'busiest_row_theta')
    heaviest = levers_heaviest()
    levers = ('fm-k16-block', 'RowRatesFM', 'LowWriteFM')
    claims += [(f"takes a median {span([100 * heaviest[m] for m in levers], 0)}% of its weight", [RESEARCH], data),
               (f"its median write rate is {rounded(theta['fm-k16-block'], 2)} (the block), "
                f"{rounded(theta['RowRatesFM'], 2)} (per-row rates) and {rounded(theta['LowWriteFM'], 2)} (the low "
                f"start): rewritten every {', '.join(rounded(1 / theta[m], 1) for m in levers[:2])} and "
                f"{rounded(1 / theta['LowWriteFM'], 1)} tokens", [RESEARCH], data)]
    assert_printed(claims)


def levers_heaviest():
    """{model: the median over layers and seeds of the heaviest row's share of the weight}, from the column
    'heaviest' of eval.py routing's printed tables (levers_routing.txt; the .csv lacks it)."""
    import re
    import numpy as np
    groups, name = {}, None
    for line in (RESULTS / '2026-11-27' / 'levers_routing.txt').read_text().splitlines():
        header = re.match(r'(\S+): ', line)
        if header and RUN_NAME_RE.search(header[1]):
            name = analysis.run_name(header[1])
        elif name and line.split()[:1] and line.split()[0].isdigit():
            groups.setdefault(name, []).append(float(line.split()[7]))  # layer dead rare eff entropy busiest weight
    return {name: float(np.median(values)) for name, values in groups.items()}


RUN_NAME_RE = analysis.RUN_NAME


def test_readme_scaling_sentences_are_their_data():
    """Memory scaling (3 seeds): every series at each m's best tau, the verdicts 'rises ... beyond the seed spread',
    'stays within it', k = m/4 against dense, tau's wins; the paper's layer's sweep of 2026-11-24; in each README
    that prints them."""
    import csv
    data = 'docs/results/2026-11-27b/scaling-block.csv'
    best = analysis.best_per_series(analysis.scaling_rows([str(RESULTS / '2026-11-27b' / 'scaling-block.csv')]))
    dense, quarter, four = best['dense (k = m)'], best['k = m/4'], best['k = 4']

    def point(p, whole=True):
        return (f"{rounded(p['val_loss'])} ({rounded(min(p['losses']))}-{rounded(max(p['losses']))})" if whole
                else rounded(p['val_loss']))

    def rises(series):
        return min(series[256]['losses']) > max(series[16]['losses'])

    def within(series):
        return apart(series[16]['losses'], series[256]['losses']) == 'within the spread'

    verdict = ('loss rises with m from 16 to 256 for dense and k = m/4, beyond the seed spread'
               if rises(dense) and rises(quarter) else 'NOT a rise beyond the spread for dense and k = m/4')
    verdict += ', and stays within it for k = 4' if within(four) else ', and moves beyond it for k = 4'
    at_or_below = all(quarter[m]['val_loss'] <= dense[m]['val_loss'] for m in dense)
    rows = analysis.scaling_rows([str(RESULTS / '2026-11-27b' / 'scaling-block.csv')])
    unfinished = [r for r in rows if r['iter_num'] < r['max_iters']]
    assert {(r['n_memory'], r['tau']) for r in unfinished} == {(256, 0.25)}, 'README: the unfinished runs'
    wins = tau_wins()
    cells = scaling_cells()
    won_by_one = sum(count - won for won, count in wins.values())
    three = {cell: paired(taus[0.25], taus[1.0]) for cell, taus in cells.items() if len(taus[0.25]) == 3}
    beyond = {cell: 0.25 if max(low) < min(one) else 1.0 for cell, (low, one) in three.items()
              if apart(low, one) == 'ranges apart'}
    assert set(beyond) == {(64, 64), (64, 16)}, ('research/README: the cells where tau is beyond the spread', beyond)
    seeds_256 = sorted({len(paired(taus[0.25], taus[1.0])[0]) for (m, _), taus in cells.items() if m == 256})
    apart_64, apart_256 = (apart(quarter[m]['losses'], dense[m]['losses']) for m in (64, 256))
    with open(RESULTS / '2026-11-24' / 'scaling-paper-layer.csv', newline='') as f:
        sweep = {(row['series'], int(row['n_memory'])): float(row['val_loss']) for row in csv.DictReader(f)}
    above = [m for m in (16, 32, 64, 128, 256) if sweep['k = m/4', m] > sweep['dense', m]]
    with open(RESULTS / '2026-11-24' / 'scaling-paper-layer.csv', newline='') as f:
        dense_taus = [float(row['tau']) for row in csv.DictReader(f) if row['series'] == 'dense']
    lower_tau_dense = all(a >= b for a, b in zip(dense_taus, dense_taus[1:])) and dense_taus[-1] < dense_taus[0]
    lowest = [m for m in (64, 256) if four[m]['val_loss'] < min(dense[m]['val_loss'], quarter[m]['val_loss'])]
    flat_four = apart(four[16]['losses'], four[256]['losses']) == 'within the spread'
    assert_printed([
        (verdict, [README, RESEARCH], data),
        (f"{'flat from m = 16' if flat_four else 'not flat'} and the lowest of the three, k = 4 lowest at m = "
         f"{' and '.join(map(str, lowest))} (3 seeds)", [RESEARCH], data),
        ('dense ' + ' / '.join(point(p) for p in dense.values()), [RESEARCH], data),
        ('k = m/4 ' + ' / '.join(point(p) for p in quarter.values()), [RESEARCH], data),
        ('k = 4 ' + ' / '.join(point(p, m != 16) for m, p in four.items()), [RESEARCH], data),
        (f"k = m/4 is {'below' if quarter[64]['val_loss'] < dense[64]['val_loss'] else 'above'} dense at m = 64 "
         f"({apart_64}) and 256 ({apart_256})", [RESEARCH], data),
        (f"k = m/4 {'at or below' if at_or_below else 'above'} dense at every m", [RESEARCH], data),
        (f"tau = 0.25 wins {wins[16][0]} of {wins[16][1]} cells at m = 16, {wins[64][0]} of {wins[64][1]} at m = 64 "
         f"and {wins[256][0]} of {wins[256][1]} at m = 256 ({'-'.join(map(str, seeds_256))} seeds there: the rest "
         f"did not finish); tau = 1 wins {won_by_one} of {len(cells)} cells in all", [RESEARCH], data),
        (f"With 3 seeds beyond the spread: tau = {beyond[64, 64]:g} for dense at m = 64, tau = {beyond[64, 16]:g} "
         f"for k = m/4 there", [RESEARCH], data),
        (f"{len(rows) - len(unfinished)} of its {len(rows)} runs finished, the {len(unfinished)} others at m = 256, "
         f"tau 0.25", [RESEARCH], data),
        (f"k = m/4 above dense at m = {' and '.join(map(str, above))}", [RESEARCH],
         'docs/results/2026-11-24/scaling-paper-layer.csv'),
        (f"and moved dense to a {'lower' if lower_tau_dense else 'NOT a lower'} tau as m grew", [RESEARCH],
         'docs/results/2026-11-24/scaling-paper-layer.csv'),
    ])


def test_readme_levers_sentences_are_their_data():
    """The levers' numbers (research/README.md), the verdict 'none below the block beyond the seed spread' and the
    gap to Mamba-2 past the context (both READMEs), 8.3M and per-row rates' scaling."""
    import numpy as np
    phrases = []
    levers = levers_rows()
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
    block = seed_losses('2026-11-27/levers_lr.csv', 'fm-k16-block')
    beyond = [name for name in ('RowRatesFM', 'LowWriteFM', 'HeadsFM', 'Heads16FM')
              if max(seed_losses('2026-11-27/levers_lr.csv', name)) < min(block)]
    beyond += [name for name in ('SlowWriteFM', 'conv16') if max(seed_losses(
        '2026-11-27/second-start/slow_writes_lr.csv', name)) < min(seed_losses(
            '2026-11-27/second-start/slow_writes_lr.csv', 'fm-k16-block'))]
    verdict = 'none is below the block beyond the seed spread' if not beyond else f'{beyond} below the block'
    claims = [(phrase, [RESEARCH], 'docs/results/2026-11-27/') for phrase in phrases]
    claims += [(verdict, [RESEARCH], 'docs/results/2026-11-27/*_lr.csv'),
               (verdict.replace('none is', 'No lever is').capitalize().replace('no lever', 'No lever'),
                [RESEARCH], 'docs/results/2026-11-27/*_lr.csv')]
    # the gap past the context, seed by seed (the block against Mamba-2, both at their best rates)
    pairs = [(f'fm-k16-block-lr2e-3-s{s}', f'mamba2-lr4e-3-s{s}') for s in (1, 2, 3)]
    results = {r['label']: r for f in ('levers_positions.csv', 'mamba2_positions.csv')
               for r in analysis.positions_csv(str(RESULTS / '2026-11-27' / f))}
    data = 'docs/results/2026-11-27/levers_positions.csv, mamba2_positions.csv'
    for t in (32768, 512):
        gaps = [evaluation.loss_at(results[b], t) - evaluation.loss_at(results[m], t) for b, m in pairs]
        claims.append((' / '.join(rounded(g) for g in gaps) + ' (seeds 1 / 2 / 3)' * (t == 32768), [RESEARCH], data))
    claims.append(('validation ' + ' / '.join(rounded(results[b]['val_loss'] - results[m]['val_loss'])
                                              for b, m in pairs), [RESEARCH], data))
    buckets = [np.mean([next(x['loss'] for x in results[b]['buckets'] if x['start'] == start)
                        - next(x['loss'] for x in results[m]['buckets'] if x['start'] == start) for b, m in pairs])
               for start in (2 ** i for i in range(11, 19))]
    trails = 'trails Mamba-2 by a constant' if min(buckets) > 0 else 'does not trail Mamba-2 throughout'
    gap = f'{rounded(min(buckets))}-{rounded(max(buckets))}'
    claims += [(f'the block {trails}, {gap} nats from 2K to 256K positions', [RESEARCH], data),
               (f'the block {trails}: by position bucket from 2K to 256K the gap is {gap} nats', [RESEARCH], data)]
    at_8m = table('2026-11-27/frontier_8M.csv')
    claims.append((f"Mamba-2 {rounded(at_8m['mamba2-8M']['val_loss'])}, the block "
                   f"{rounded(at_8m['fm-k16-block-8M']['val_loss'])}, per-row rates "
                   f"{rounded(at_8m['fm-k16-rowrates-block-8M']['val_loss'])}", [RESEARCH],
                   'docs/results/2026-11-27/frontier_8M.csv'))
    rates = analysis.best_per_series(analysis.scaling_rows([str(RESULTS / '2026-11-27' / 'scaling-RowRatesFM.csv')]))
    claims.append((f"k = m/4 {' / '.join(rounded(p['val_loss']) for p in rates['k = m/4'].values())}, dense "
                   f"{' / '.join(rounded(p['val_loss']) for p in rates['dense (k = m)'].values())}", [RESEARCH],
                   'docs/results/2026-11-27/scaling-RowRatesFM.csv'))
    assert_printed(claims)


def recall_rows():
    """The rows of the 4,000-step sweep's .csv."""
    return analysis.recall_rows([str(RESULTS / '2026-11-29' / 'recall' / 'recall.csv')])


def recall_best_table():
    """{model: research/analysis.py's recall table entry at its best rate} of the 4,000-step
    sweep, the model named without -d128."""
    rows = recall_rows()
    table = analysis.recall_table(rows, analysis.recall_best(rows))
    return {entry['model'].removesuffix('-d128'): entry for entry in table}


def test_readme_recall_sentences_are_their_data():
    """Recall (MQAR): each number of the paragraph, the paper table's row and research/README
    (accuracy, mean and min-max over seeds; bytes; beyond training), each verdict (flat in m;
    below Mamba-2 on the mean, within the spread or ranges apart), the seeds and rates counted."""
    import numpy as np
    best = recall_best_table()
    rates = {model.removesuffix('-d128'): trained
             for model, (_, trained) in analysis.recall_best(recall_rows()).items()}
    hardest, far = (256, 64), ((512, 128), (1024, 256))

    def mean(model, at=hardest):
        return rounded(np.mean(best[model][at]))

    def spread(model, at=hardest):
        seeds = best[model][at]
        return f'{rounded(min(seeds))}-{rounded(max(seeds))}'

    def both(model):
        return f'{mean(model)} ({spread(model)})'

    def state_bytes(model):
        return best[model]['bytes'][hardest][0]

    def step_bytes(model):
        return best[model]['bytes'][hardest][1]

    def verdict(model, other, at=hardest):
        return apart(best[model][at], best[other][at])

    sizes = ('fm-block-m16-k8', 'fm-block-m64-k8', 'fm-block-m128-k8')
    conv = ('fm-block-cr-m64-k8', 'fm-block-cr-m128-k8')
    k8 = (*sizes, *conv, 'fm-block-cr-m16-k8')
    dense, mamba, small = 'fm-block-m128-dense', 'mamba2-n64', 'mamba2-n16'
    unnamed = ('fm-block-m16-dense', 'fm-block-m64-dense')  # one seed, not in the README
    one_seed = ('attn', 'mamba2-n256', 'fm-block-cr-m16-k8', 'fm-block-cr-m64-dense', 'fm-m64-k8',
                'fm-m64-dense', *unnamed)
    for model, entry in best.items():
        assert len(entry['seeds']) == (1 if model in one_seed else 3), (model, entry['seeds'])
    assert sorted(len(r) for r in rates.values()).count(1) == 5, 'README: five models at one rate'
    assert {len(r) for r in rates.values()} == {1, 3, 4}
    flat = all(verdict(a, b) == 'within the spread' for a in sizes for b in sizes)
    assert flat, 'README: flat in m'
    assert {step_bytes(m) for m in sizes} == {11264}
    by_size = [best[m][hardest] for m in sizes]
    learned = [max(seeds) for seeds in by_size]
    runner_up = max(sorted(seeds)[1] for seeds in by_size)
    assert runner_up < 0.05 and min(learned) > 0.15, 'README: one seed learned at each m'
    assert min(min(best[m][hardest]) for m in conv) > 0.2, 'README: the lever learned in every seed'
    for m in ('fm-block-m128-k8', dense, 'fm-block-cr-m128-k8'):
        assert np.mean(best[m][hardest]) < np.mean(best[mamba][hardest]), 'README: below, mean'
    assert verdict('fm-block-m128-k8', mamba) == verdict(dense, mamba) == 'within the spread'
    assert verdict('fm-block-cr-m128-k8', mamba) == 'ranges apart'
    assert max(np.mean(best[m][hardest]) for m in conv) > np.mean(best[small][hardest])
    assert verdict(conv[0], small) == verdict(conv[1], small) == 'within the spread'
    for m in sizes:
        assert np.mean(best[m][hardest]) < np.mean(best[small][hardest]), 'README: k = 8 below'
    for at in far:
        assert verdict(dense, mamba, at) == 'within the spread'
        top = max(k8, key=lambda m: np.mean(best[m][at]))
        assert top == 'fm-block-cr-m128-k8', ('README: the best FM at k = 8 beyond training', top)
    for m in ('fm-m64-k8', 'fm-m64-dense'):
        assert np.mean(best[m][hardest]) < 2 / 64, "README: the paper's layer did not learn"
    state = [state_bytes(m) for m in (mamba, 'fm-block-m128-k8', 'fm-block-cr-m128-k8')]
    by_m = ' / '.join(mean(m) for m in sizes)

    def beyond(model):
        return ' / '.join(mean(model, at) for at in far)

    data = 'docs/results/2026-11-29/recall/recall.csv'
    paragraph = [
        f"{by_m} at m = 16 / 64 / 128. At each m one seed learned "
        f"({' / '.join(rounded(x) for x in learned)}); at 256 tokens the other two reached at "
        f"most {rounded(runner_up)} (chance 1/64)",
        f"{both(conv[0])} at m = 64, {both(conv[1])} at m = 128; "
        f"{mean('fm-block-cr-m16-k8')} at m = 16 (one seed): still flat in m. Dense at m = 64 it "
        f"reached {mean('fm-block-cr-m64-dense')} (one seed)",
        f"At equal state bytes ({round(min(state) / 1000)}-{round(max(state) / 1000)} KB a layer) "
        f"FM is below Mamba-2 with d_state 64, {both(mamba)}, on the mean: FM's block at m = 128, "
        f"k = 8 {both('fm-block-m128-k8')} and dense {both(dense)}, both within the spread; the "
        f"convolved router {both(conv[1])}, ranges apart",
        f"dense FM at m = 128 ({step_bytes(dense):,} bytes) {mean(dense)} against Mamba-2 with "
        f"d_state 64 ({step_bytes(mamba):,} bytes) {mean(mamba)}, within the spread",
        f"the smallest (d_state 16, {step_bytes(small):,} bytes) recalls {both(small)}; "
        f"FM with the convolved router at {step_bytes(conv[0]):,} bytes is above it on the mean, within the "
        f"spread; FM's block at {step_bytes(sizes[0]):,} bytes is below",
        f"dense FM at m = 128 {beyond(dense)} against Mamba-2 with d_state 64 {beyond(mamba)}, "
        f"within the spread; FM at k = 8 at most {beyond(conv[1])} (the convolved router, "
        f"m = 128); Mamba-2 with d_state 256 {beyond('mamba2-n256')} (one seed); attention {beyond('attn')} "
        f"(one seed)",
        f"FM's block recalls {by_m} at m = 16 / 64 / 128, within the seed spread; at equal state "
        f"bytes below Mamba-2 on the mean ({mean('fm-block-m128-k8')} against {mean(mamba)}, "
        f"within the spread)"]
    research = (
        f"at k = 8 {by_m} at m = 16 / 64 / 128, each with one seed that learned and two at most "
        f"{rounded(runner_up)}; with the router on the convolution {both(conv[0])} at m = 64 and "
        f"{both(conv[1])} at m = 128; Mamba-2 {both(small)} at d_state 16, {both(mamba)} at 64; "
        f"attention {mean('attn')} (one seed)")
    readme = (f"at k = 8 FM's block is {'flat in m' if flat else 'NOT flat in m'}, and below Mamba-2 of the same "
              f"state bytes on the mean, within the spread")
    claims = [(phrase, [RESEARCH], data) for phrase in paragraph] + [(research, [RESEARCH], data),
                                                                      (readme, [README], data)]
    assert_printed(claims)



# ----------------------------------------------------------------------------- the paper table: every verdict computed

VERDICTS = {}  # {the first words of a claim as the README quotes it: () -> (its verdict, its evidence cell)}
VERDICT_WORDS = ('reproduced', 'not reproduced', 'contradicted', 'not run')


def verdict_of(claim):
    """Registers the function that computes (the verdict, the evidence cell) of the paper-table row whose quote starts
    with claim from its data; its docstring names the data and the rule (research/README.md says them too)."""
    def register(compute):
        VERDICTS[claim] = compute
        return compute
    return register


def by_seed(sweep_file, name):
    """{seed: validation loss} of a model's best-rate runs in a sweep .csv of docs/results."""
    return {r['seed']: r['val_loss'] for r in analysis.csv_records(str(RESULTS / sweep_file))
            if r['best_lr'] and analysis.run_name(r['run']) == name}


def paired(a, b):
    """Two {seed: value} on the seeds both have (a comparison over equal seeds): (a's values, b's values)."""
    seeds = sorted(set(a) & set(b))
    assert seeds, 'no seed in common'
    return [a[s] for s in seeds], [b[s] for s in seeds]


def quality_pair(name, other):
    """The validation losses of two quality models (2026-11-25) on their common seeds."""
    return paired(by_seed('2026-11-25/extrapolation_lr.csv', name), by_seed('2026-11-25/extrapolation_lr.csv', other))


def so_far_means(name):
    """{t: the mean over a quality model's best-rate runs of its loss so far at t} (2026-11-25)."""
    import numpy as np
    rows = [r for r in analysis.positions_csv(str(RESULTS / '2026-11-25' / 'extrapolation_positions.csv'))
            if analysis.run_name(r['label']) == name]
    ts = sorted({x['t'] for x in rows[0]['loss_so_far']})
    return {t: float(np.mean([evaluation.loss_at(r, t) for r in rows])) for t in ts
            if all(evaluation.loss_at(r, t) is not None for r in rows)}


def scaling_cells():
    """{(m, k): {tau: {seed: validation loss}}} of the finished runs of the block's memory scaling (2026-11-27b)."""
    cells = {}
    for r in analysis.scaling_rows([str(RESULTS / '2026-11-27b' / 'scaling-block.csv')]):
        if r['iter_num'] >= r['max_iters']:
            cells.setdefault((r['n_memory'], r['top_k']), {}).setdefault(r['tau'], {})[r['seed']] = r['val_loss']
    return cells


def scaling_best():
    return analysis.best_per_series(analysis.scaling_rows([str(RESULTS / '2026-11-27b' / 'scaling-block.csv')]))


def change_with_m(series):
    """'improves' / 'worsens' where the loss at the largest m is below / above the smallest m's beyond the seed
    spread, else 'flat'."""
    first, last = series[min(series)]['losses'], series[max(series)]['losses']
    if apart(first, last) == 'within the spread':
        return 'flat'
    return 'improves' if max(last) < min(first) else 'worsens'


def tau_wins():
    """{m: (cells where tau = 0.25 has the lower mean, cells)} over the seeds both taus finished, a cell an (m, k)."""
    import numpy as np
    wins = {}
    for (m, _), taus in sorted(scaling_cells().items()):
        low, one = paired(taus[0.25], taus[1.0])
        won, count = wins.get(m, (0, 0))
        wins[m] = (won + int(np.mean(low) < np.mean(one)), count + 1)
    return wins


def frontier_gap(arch, key):
    """An architecture's loss minus Mamba-2's at each frontier size."""
    points = frontier()
    return [p[key] - m[key] for p, m in zip(points[arch], points['mamba2'], strict=True)]


def flops_to_reach(series, loss):
    """The forward FLOPs at which a frontier series reaches a validation loss (log-linear between its points), or
    None where it does not between its sizes."""
    import math
    for a, b in zip(series, series[1:]):
        if a['val_loss'] >= loss >= b['val_loss']:
            share = (a['val_loss'] - loss) / (a['val_loss'] - b['val_loss'])
            return math.exp(math.log(a['forward_flops']) + share * math.log(b['forward_flops'] / a['forward_flops']))
    return None


def compute_multiples():
    """{peer: (the multiples of the peer's forward FLOPs the paper's layer spends for each loss of its own that the
    peer's frontier reaches, whether they are only a lower bound)}: where the peer's smallest model is below the
    layer's largest already, the bound is the layer's largest FLOPs over the peer's smallest."""
    points = frontier()
    layer, multiples = points[LAYER], {}
    for peer in ('attn', 'mamba2'):
        reached = [p['forward_flops'] / f for p in layer for f in [flops_to_reach(points[peer], p['val_loss'])] if f]
        below = points[peer][0]['val_loss'] < layer[-1]['val_loss']
        multiples[peer] = (reached, False) if reached else (
            [layer[-1]['forward_flops'] / points[peer][0]['forward_flops']], below)
    return multiples


def slope_per_decade(series, key):
    """The least-squares slope of a frontier series' key against log10 forward FLOPs."""
    import numpy as np
    return float(np.polyfit(np.log10([p['forward_flops'] for p in series]), [p[key] for p in series], 1)[0])


def speedups():
    """{batch: (fm_1b k = 8's speed-up over mamba2_1b (mamba-ssm's step), over transformer_1b)}, 2026-11-24."""
    gen = csv_rows('2026-11-24/generate.csv')
    fm, mamba, attn = gen['fm_1b k=8'], gen['mamba2_1b mamba-ssm step'], gen['transformer_1b']
    return {b: (float(mamba[f'b{b}_ms_per_token']) / float(fm[f'b{b}_ms_per_token']),
                float(attn[f'b{b}_ms_per_token']) / float(fm[f'b{b}_ms_per_token'])) for b in (1, 64)}


def recall_bytes(model):
    """(state bytes, step bytes) of a recall model at 256 tokens / 64 pairs."""
    return recall_best_table()[model]['bytes'][256, 64]


def generate_sweep():
    import csv
    with open(RESULTS / '2026-11-24' / 'generate_sweep.csv', newline='') as f:
        return {row['prompt_tokens']: float(row['b1_ms_per_token']) for row in csv.DictReader(f)}


@verdict_of('Our model builds upon Mamba-2, enabling FM to exploit parallel')
def parallel_training():
    """docs/results/2026-11-23/train.csv: fm_1b's training tokens/s at least the Transformer's (attention trains in
    parallel over the sequence)."""
    train = csv_rows('2026-11-23/train.csv')
    ratio = float(train['fm_1b']['tokens_per_s']) / float(train['transformer_1b']['tokens_per_s'])
    return 'reproduced' if ratio >= 1 else 'not reproduced', f"fm_1b {rounded(ratio, 2)}x transformer_1b's tokens/s"


@verdict_of('while preserving constant computational and memory complexity')
def constant_inference():
    """docs/results/2026-11-24/generate_sweep.csv (fm_1b's batch-1 step after 64K tokens within 5% of 1K) and
    2026-11-29/recall/recall.csv (FM's state bytes the same at every length, attention's growing)."""
    sweep, table = generate_sweep(), recall_best_table()
    fm_state = {state for state, _ in table['fm-block-m64-k8']['bytes'].values()}
    attn_state = {state for state, _ in table['attn']['bytes'].values()}
    flat = sweep['65536'] <= 1.05 * sweep['1024']
    constant = flat and len(fm_state) == 1 and len(attn_state) > 1
    return ('reproduced' if constant else 'not reproduced',
            f"the step {'flat' if flat else 'grows'} from 1K to 64K tokens")


@verdict_of('Increasing the hidden state size can help')
def state_size_helps():
    """docs/results/2026-11-29/recall/recall.csv: Mamba-2 at d_state 64 against 16, accuracy at 256 tokens / 64
    pairs higher beyond the seed spread, with a larger step (the cost)."""
    helps = min(recall_best_table()['mamba2-n64'][256, 64]) > max(recall_best_table()['mamba2-n16'][256, 64])
    costs = recall_bytes('mamba2-n64')[1] > recall_bytes('mamba2-n16')[1]
    return ('reproduced' if helps and costs else 'not reproduced',
            f"Mamba-2 recalls {'more' if helps else 'no more'} with a larger state")


@verdict_of('This reduces the computational overhead associated with recurrent')
def bounded_step():
    """docs/results/2026-11-29/recall/recall.csv: at k = 8 a step's bytes the same at m = 16, 64 and 128 while the
    state grows with m."""
    sizes = ('fm-block-m16-k8', 'fm-block-m64-k8', 'fm-block-m128-k8')
    state = [recall_bytes(m)[0] for m in sizes]
    same = len({recall_bytes(m)[1] for m in sizes}) == 1
    return ('reproduced' if same and state == sorted(set(state)) else 'not reproduced',
            f"{'the same' if same else 'not the same'} k = 8 step bytes at m = 16, 64, 128")


@verdict_of('Its loss frontier is shifted upward')
def frontier_upward():
    """docs/results/2026-11-24/frontier.csv: the paper's layer's validation loss against the Transformer's and
    Mamba-2's at each size (above both at every size: reproduced; below both at every size: contradicted)."""
    points = frontier()
    trios = list(zip(points[LAYER], points['attn'], points['mamba2'], strict=True))
    if all(p['val_loss'] > max(t['val_loss'], m['val_loss']) for p, t, m in trios):
        return 'reproduced', 'above both at every size'
    if all(p['val_loss'] < min(t['val_loss'], m['val_loss']) for p, t, m in trios):
        return 'contradicted', 'below both at every size'
    return 'not reproduced', 'not above both at every size'


@verdict_of('which suggests that, under the same training conditions')
def slightly_more_compute():
    """docs/results/2026-11-24/frontier.csv: the forward FLOPs the paper's layer spends for a loss against a peer's
    frontier (log-linear): more, under 2x against both peers ('slightly'): reproduced; less against both:
    contradicted."""
    multiples = compute_multiples()
    bound, is_bound = multiples['mamba2']
    evidence = f"{'over ' if is_bound else ''}{rounded(max(bound), 1)}x Mamba-2's FLOPs"
    if all(max(m) < 1 for m, _ in multiples.values()):
        return 'contradicted', evidence
    slight = all(1 <= min(m) and max(m) < 2 for m, _ in multiples.values())
    return 'reproduced' if slight else 'not reproduced', evidence


@verdict_of('All the tested models consistently improve')
def all_improve():
    """docs/results/2026-11-24/frontier.csv, 2026-11-25/frontier.csv: each model's validation loss falls at every
    larger size."""
    losses = [[p['val_loss'] for p in series] for series in frontier().values()]
    every = all(a > b for ls in losses for a, b in zip(ls, ls[1:]))
    return ('reproduced', 'every model, every size') if every else ('not reproduced', 'not every model')


@verdict_of('FM demonstrates a scaling trend in the loss frontier')
def lower_degree():
    """docs/results/2026-11-24/frontier.csv: the slope of the loss so far at 2x the context against log10 forward
    FLOPs; the paper's layer's steeper than both peers': reproduced; shallower than both: contradicted."""
    points = frontier()
    fm = slope_per_decade(points[LAYER], 'loss_so_far_2x')
    attn, mamba = (slope_per_decade(points[p], 'loss_so_far_2x') for p in ('attn', 'mamba2'))
    steeper = [name for name, s in (("the Transformer's", attn), ("Mamba-2's", mamba)) if s < fm]
    evidence = f"{' and '.join(steeper)} slope steeper" if steeper else "FM's slope the steepest"
    return ('reproduced' if fm < min(attn, mamba) else 'contradicted' if fm > max(attn, mamba)
            else 'not reproduced'), evidence


@verdict_of('Mamba-2 generally achieves better long-context generalization')
def mamba_beats_transformer():
    """docs/results/2026-11-24/frontier.csv: Mamba-2's loss so far at 2x and 8x the context below the Transformer's
    at every size (above at every size: contradicted)."""
    points = frontier()
    pairs = [(m[f'loss_so_far_{f}x'], t[f'loss_so_far_{f}x']) for f in (2, 8)
             for m, t in zip(points['mamba2'], points['attn'], strict=True)]
    if all(m < t for m, t in pairs):
        return 'reproduced', 'lower at 2x and 8x, every size'
    return ('contradicted' if all(m > t for m, t in pairs) else 'not reproduced'), 'not lower at every size'


@verdict_of('However, FM surpasses Mamba-2')
def surpasses_mamba():
    """docs/results/2026-11-24/frontier.csv: the paper's layer's loss so far at 2x the context against Mamba-2's:
    below at the largest size: reproduced; a gap wider at the largest size than at the smallest: contradicted."""
    gaps = frontier_gap(LAYER, 'loss_so_far_2x')
    narrows = all(a > b for a, b in zip(gaps, gaps[1:]))
    evidence = f"the gap {'narrows' if narrows else 'does not narrow'}, FM still {'above' if gaps[-1] > 0 else 'below'}"
    return ('reproduced' if gaps[-1] < 0 else 'contradicted' if gaps[-1] > gaps[0] else 'not reproduced'), evidence


@verdict_of('Transformer and Mamba-2 exhibit limited extrapolation')
def peers_rise():
    """docs/results/2026-11-25/extrapolation_positions.csv: the loss so far of the Transformer and Mamba-2 at 64x the
    context (32,768) against 1x (both higher: reproduced; one lower: contradicted)."""
    falls = [name for name, label in (('transformer', 'the Transformer'), ('mamba2', 'Mamba-2'))
             if so_far_means(name)[32768] < so_far_means(name)[512]]
    labels = {'transformer': "the Transformer's", 'mamba2': "Mamba-2's"}
    if not falls:
        return 'reproduced', 'both rise past the context'
    return 'contradicted', f"{' and '.join(labels[n] for n in falls)} loss falls past the context"


@verdict_of('While FM also experiences increased test loss')
def within_uncertainty():
    """docs/results/2026-11-25/extrapolation_positions.csv: the paper's layer's loss so far beyond the context (512)
    above its loss so far at 128 at no more than a quarter of the lengths: reproduced; at more than half:
    contradicted."""
    means = so_far_means('fm-k16')
    beyond = [loss > means[128] for t, loss in means.items() if t > 512]
    share = sum(beyond) / len(beyond)
    evidence = 'never above its level at 128' if not any(beyond) else f'above its level at 128 at {sum(beyond)} lengths'
    return ('reproduced' if share <= 0.25 else 'contradicted' if share > 0.5 else 'not reproduced'), evidence


@verdict_of('FM consistently achieves performance comparable')
def comparable_at_context():
    """docs/results/2026-11-25/extrapolation_lr.csv: the paper's layer against the Transformer and Mamba-2 at the
    context over their common seeds (below, or within the spread of, both: reproduced)."""
    pairs = [quality_pair('fm-k16', peer) for peer in ('transformer', 'mamba2')]
    comparable = all(max(fm) < min(other) or apart(fm, other) == 'within the spread' for fm, other in pairs)
    above_apart = all(min(fm) > max(other) for fm, other in pairs)
    return ('reproduced' if comparable else 'not reproduced',
            'above both, ranges apart' if above_apart else 'not above both beyond the spread')


@verdict_of('At the same time FM shows better extrapolation')
def better_at_long_context():
    """docs/results/2026-11-25/extrapolation_positions.csv: the paper's layer's loss so far at 64x the context below
    both peers'."""
    fm, mamba, attn = (so_far_means(name)[32768] for name in ('fm-k16', 'mamba2', 'transformer'))
    if fm < min(mamba, attn):
        return 'reproduced', 'FM lowest at 32K'
    return 'not reproduced', f"{'Mamba-2' if mamba < fm else 'the Transformer'} lower at 32K"


def scaling_verdict(changes):
    """'reproduced' where every series improves with m, 'contradicted' where one worsens, else 'not reproduced'."""
    return ('reproduced' if all(c == 'improves' for c in changes) else 'contradicted' if 'worsens' in changes
            else 'not reproduced')


WITH_M = {'improves': 'better with m', 'worsens': 'worse with m', 'flat': 'flat'}


@verdict_of('For the dense memory, the results in Figure 5')
def dense_improves():
    """docs/results/2026-11-27b/scaling-block.csv: dense FM's loss from m = 16 to 256 at each m's best tau (lower
    beyond the seed spread: reproduced; higher beyond it: contradicted)."""
    change = change_with_m(scaling_best()['dense (k = m)'])
    return scaling_verdict([change]), f"{WITH_M[change]}{', ranges apart' if change != 'flat' else ''}"


@verdict_of('First, increasing memory width improves performance')
def sparse_improve():
    """docs/results/2026-11-27b/scaling-block.csv: k = 4 and k = m/4 from m = 16 to 256 (both lower beyond the seed
    spread: reproduced; either higher beyond it: contradicted)."""
    best = scaling_best()
    quarter, four = change_with_m(best['k = m/4']), change_with_m(best['k = 4'])
    return scaling_verdict([four, quarter]), f'k = m/4 {WITH_M[quarter]}, k = 4 {WITH_M[four]}'


@verdict_of('While the fixed memory activation approach offers')
def fixed_limits():
    """docs/results/2026-11-27b/scaling-block.csv: k = 4 against dense and k = m/4 at each m above 16 (k = 4 the
    highest mean at each: reproduced; the lowest at each, beyond the spread at the largest m: contradicted)."""
    best = scaling_best()
    ms = [m for m in best['k = 4'] if m > 16]
    rows = [(best['k = 4'][m], [best[s][m] for s in ('dense (k = m)', 'k = m/4')]) for m in ms]
    lowest = [m for m, (four, others) in zip(ms, rows) if four['val_loss'] < min(o['val_loss'] for o in others)]
    evidence = f"k = 4 the lowest at m = {' and '.join(map(str, lowest))}" if lowest else 'k = 4 never the lowest'
    if all(four['val_loss'] > max(o['val_loss'] for o in others) for four, others in rows):
        return 'reproduced', evidence
    four, others = rows[-1]
    apart_last = all(max(four['losses']) < min(o['losses']) for o in others)
    return ('contradicted' if lowest == ms and apart_last else 'not reproduced'), evidence


@verdict_of('The performance for fixed memory activation plateaus')
def proportional_continues():
    """docs/results/2026-11-27b/scaling-block.csv: k = m/4 from m = 16 to 256 (the proportional activation that the
    claim says keeps improving; lower beyond the spread: reproduced; higher: contradicted)."""
    change = change_with_m(scaling_best()['k = m/4'])
    return scaling_verdict([change]), f'k = m/4 {WITH_M[change]}'


@verdict_of('According to the model definition, this shows')
def stationary_router():
    """None: the paper infers it from Figure 5 and names no measure of a stationary router or of redundancy."""
    return 'not run', 'no measure named'


@verdict_of('Notably, updating only 25% of memory states')
def quarter_matches_dense():
    """docs/results/2026-11-27b/scaling-block.csv at the largest m, 2026-11-25/extrapolation_lr.csv at m = 64 (the
    paper's layer and the block, common seeds): k = m/4 at or below dense on the mean, or within the spread, in
    each: reproduced; above beyond the spread in one: contradicted."""
    import numpy as np
    best = scaling_best()
    largest = max(best['k = m/4'])
    pairs = [(best['k = m/4'][largest]['losses'], best['dense (k = m)'][largest]['losses']),
             quality_pair('fm-k16', 'fm-dense'), quality_pair('fm-k16-block', 'fm-dense-block')]
    k, d = pairs[0]
    evidence = f"k = m/4 {'below' if np.mean(k) < np.mean(d) else 'above'} dense at m = {largest}"
    if any(min(k) > max(d) for k, d in pairs):
        return 'contradicted', evidence
    matches = all(np.mean(k) <= np.mean(d) or apart(k, d) == 'within the spread' for k, d in pairs)
    return 'reproduced' if matches else 'not reproduced', evidence


@verdict_of('while reducing computational cost by 75%')
def quarter_cost():
    """None: no timing of k = m/4 against dense was run."""
    return 'not run', 'no timing of k = m/4'


@verdict_of('Additionally, we observe that the optimal test loss')
def lower_tau():
    """docs/results/2026-11-27b/scaling-block.csv: at each m the share of (m, k) cells where tau = 0.25 has the lower
    mean over the seeds both taus finished; rising with m: reproduced; falling: contradicted."""
    shares = [won / count for won, count in tau_wins().values()]
    rising = all(a <= b for a, b in zip(shares, shares[1:])) and shares[-1] > shares[0]
    falling = all(a >= b for a, b in zip(shares, shares[1:])) and shares[-1] < shares[0]
    evidence = f"tau = 0.25 wins {'more' if rising else 'fewer' if falling else 'as many'} cells as m grows"
    return ('reproduced' if rising else 'contradicted' if falling else 'not reproduced'), evidence


def harness_results():
    """lm-evaluation-harness results in docs/results (none: no 1B model was trained here)."""
    return sorted(str(p) for p in RESULTS.rglob('*harness*'))


@verdict_of('On the English tasks, FM achieves the highest average')
def english_tasks():
    """None: no 1B model was trained, so docs/results holds no harness scores."""
    assert not harness_results(), f'compute this row from {harness_results()}'
    return 'not run', 'no 1B model trained'


@verdict_of('On Japanese metrics, the our proposed model')
def japanese_tasks():
    """None: no Japanese data offline, no 1B model trained."""
    assert not harness_results(), f'compute this row from {harness_results()}'
    return 'not run', 'no Japanese data offline'


@verdict_of('The experiments concur with our previous observation')
def dclm_tasks():
    """None: no DCLM data offline (hf: needs the network), no 1B model trained."""
    assert not harness_results(), f'compute this row from {harness_results()}'
    return 'not run', 'no DCLM data offline'


@verdict_of('FM consistently outperforms Transformer')
def faster_than_transformer():
    """docs/results/2026-11-24/generate.csv: fm_1b's decoding step against transformer_1b's at batch 1 and 64 (faster
    at both: reproduced; slower at both: contradicted)."""
    ratios = [attn for _, attn in speedups().values()]
    if all(r > 1 for r in ratios):
        return 'reproduced', 'faster at batch 1 and 64'
    return ('contradicted' if all(r < 1 for r in ratios) else 'not reproduced'), 'not faster at both batches'


@verdict_of('it also exhibits a consistent 35-40% speed-up')
def speedup_over_mamba():
    """docs/results/2026-11-24/generate.csv: fm_1b's speed-up over mamba2_1b (mamba-ssm's step) at batch 1 and 64,
    each within 30-45% (the claimed 35-40% and the few % timings vary): reproduced; FM slower at one: contradicted."""
    ups = {b: mamba for b, (mamba, _) in speedups().items()}
    evidence = f'{rounded(ups[1], 2)}x at batch 1, {rounded(ups[64], 2)}x at 64'
    return ('reproduced' if all(1.30 <= u <= 1.45 for u in ups.values()) else 'contradicted' if min(ups.values()) < 1
            else 'not reproduced'), evidence


def paper_table():
    """The rows of the README's table "The paper against this reproduction": [{'number', 'claim', 'where',
    'verdict', 'evidence'}]."""
    lines = [line for line in readme_section('The paper against this reproduction').splitlines()
             if line.startswith('| ')]
    assert lines[0].startswith("| # | the paper's claim |"), lines[0]
    keys = ('number', 'claim', 'where', 'verdict', 'evidence')
    return [dict(zip(keys, [c.strip() for c in line.strip().strip('|').split('|')], strict=True)) for line in lines[2:]]


def test_readme_paper_table_verdicts_are_computed():
    """Each row of the paper table: its quote is a claim that a function here names, once; its verdict is one of
    four words and the one that function computes from the data it names, and so is its evidence cell. A row whose
    verdict disagrees fails, naming the row, the word printed and the word computed."""
    rows = paper_table()
    assert [row['number'] for row in rows] == [str(i) for i in range(1, len(rows) + 1)], 'rows numbered 1..N'
    seen, wrong = {}, []
    for row in rows:
        claim = row['claim']
        assert claim.startswith('"') and claim.endswith('"'), f"row {row['number']}: the paper's words, quoted"
        keys = [key for key in VERDICTS if claim[1:].startswith(key)]
        assert len(keys) == 1, f"row {row['number']} ({claim[:60]}): no function computes its verdict"
        assert keys[0] not in seen, f"row {row['number']}: the claim of row {seen[keys[0]]} again"
        seen[keys[0]] = row['number']
        verdict, evidence = VERDICTS[keys[0]]()
        assert verdict in VERDICT_WORDS
        if row['verdict'] != verdict:
            wrong.append(f"row {row['number']} ({claim[:70]}...): the table says '{row['verdict']}', its data say "
                         f"'{verdict}' ({' '.join(VERDICTS[keys[0]].__doc__.split())})")
        if row['evidence'] != evidence:
            wrong.append(f"row {row['number']} ({claim[:70]}...): the evidence says '{row['evidence']}', its data "
                         f"say '{evidence}'")
    assert set(seen) == set(VERDICTS), f'claims with no row: {set(VERDICTS) - set(seen)}'
    assert not wrong, 'the paper table disagrees with its data:\n' + '\n'.join(wrong)


def test_research_readme_paper_numbers_are_their_data():
    """research/README.md's "The paper table in numbers": each number from its data file."""
    import numpy as np
    points, quality, best = frontier(), quality_rows(), scaling_best()
    table = recall_best_table()
    sweep = generate_sweep()
    attn_states = sorted({state for state, _ in table['attn']['bytes'].values()})

    def both(model):
        seeds = table[model][256, 64]
        return f'{rounded(np.mean(seeds))} ({rounded(min(seeds))}-{rounded(max(seeds))})'

    def series(arch, key='val_loss'):
        return ' / '.join(rounded(p[key]) for p in points[arch])

    def change(name):
        s = best[name]
        return f"{rounded(s[min(s)]['val_loss'])} -> {rounded(s[max(s)]['val_loss'])}"

    multiples = compute_multiples()
    slopes = {arch: rounded(slope_per_decade(points[arch], 'loss_so_far_2x'), 2) for arch in points}
    means = so_far_means('fm-k16')
    beyond = {t: loss for t, loss in means.items() if t > 512}
    top = max(beyond, key=beyond.get)
    pairs = {peer: quality_pair('fm-k16', peer) for peer in ('transformer', 'mamba2')}
    block = {peer: quality_pair('fm-k16-block', peer) for peer in ('transformer', 'mamba2')}
    layer_dense, block_dense = quality_pair('fm-k16', 'fm-dense'), quality_pair('fm-k16-block', 'fm-dense-block')
    ups = speedups()
    gen = csv_rows('2026-11-25/generate_block.csv')
    with_block, peer = gen['fm_1b the block'], gen["mamba2_1b mamba-ssm's step"]

    def pct(a, b):
        side = 'below' if np.mean(a) < np.mean(b) else 'above'
        return f"{rounded(100 * abs(np.mean(a) / np.mean(b) - 1), 1)}% {side}"

    assert all(apart(*pairs[p]) == 'ranges apart' for p in pairs) and np.mean(block['transformer'][0]) < np.mean(
        block['transformer'][1])
    assert multiples['mamba2'][1] and not multiples['attn'][1]
    sizes = ' / '.join(f"{p['non_embedding_parameters'] / 1e6:.1f}M" for p in points[LAYER])
    improve = 'it does for all four' if all_improve()[0] == 'reproduced' and len(points) == 4 else 'NOT for all'
    data = 'docs/results/'
    assert_printed([(phrase, [RESEARCH], data) for phrase in [
        f"a layer's state at m = 64 {recall_bytes('fm-block-m64-k8')[0]:,} bytes from 64 to 1,024 tokens, "
        f"attention's {attn_states[0]:,} to {attn_states[-1]:,}",
        f"{both('mamba2-n16')} against {both('mamba2-n64')}, a step of {recall_bytes('mamba2-n16')[1]:,} against "
        f"{recall_bytes('mamba2-n64')[1]:,} bytes",
        f"{recall_bytes('fm-block-m16-k8')[1]:,} bytes a step, a state of "
        f"{' / '.join(f'{recall_bytes(m)[0]:,}' for m in ('fm-block-m16-k8', 'fm-block-m64-k8', 'fm-block-m128-k8'))}"
        f" bytes",
        f"FM {series(LAYER)} at {sizes} parameters, the Transformer {series('attn')}, Mamba-2 {series('mamba2')}",
        f"FM spends {span(multiples['attn'][0])}x the Transformer's FLOPs where the Transformer's frontier reaches its "
        f"loss, and more than {rounded(multiples['mamba2'][0][0], 1)}x Mamba-2's",
        f"FM {slopes[LAYER]}, the block {slopes[BLOCK]}, Mamba-2 {slopes['mamba2']}, the Transformer "
        f"{slopes['attn']} a decade",
        f"at 2x {series('mamba2', 'loss_so_far_2x')} against {series('attn', 'loss_so_far_2x')}",
        f"the gap narrows, {' / '.join(rounded(g) for g in frontier_gap(LAYER, 'loss_so_far_2x'))} nats from 1.1M to "
        f"8.3M, FM still above",
        f"the paper's layer {rounded(quality['fm-k16']['so_far_1x'], 2)} -> "
        f"{rounded(quality['fm-k16']['so_far_64x'], 2)} from 512 to 32,768, the Transformer {rounded(quality['transformer']['so_far_1x'], 2)} -> "
        f"{rounded(quality['transformer']['so_far_64x'], 2)}, Mamba-2 {rounded(quality['mamba2']['so_far_1x'], 2)} -> "
        f"{rounded(quality['mamba2']['so_far_64x'], 2)}",
        f"at most {rounded(beyond[top])} beyond 512 (at {top:,}), against {rounded(means[128])} at 128, at every "
        f"length up to {max(means):,}",
        f"FM {rounded(np.mean(pairs['transformer'][0]))}, {pct(*pairs['transformer'])} the Transformer and "
        f"{pct(*pairs['mamba2'])} Mamba-2, ranges apart; FM's block {rounded(np.mean(block['mamba2'][0]))}, below the "
        f"Transformer and {pct(*block['mamba2'])} Mamba-2",
        f"FM {rounded(quality['fm-k16']['so_far_64x'], 2)}, Mamba-2 {rounded(quality['mamba2']['so_far_64x'], 2)}, "
        f"the Transformer {rounded(quality['transformer']['so_far_64x'], 2)}; the block "
        f"{rounded(quality['fm-k16-block']['so_far_64x'], 2)} trails Mamba-2",
        f"dense {change('dense (k = m)')}",
        f"k = m/4 {change('k = m/4')}, {'beyond the spread' if change_with_m(best['k = m/4']) != 'flat' else 'within'}"
        f"; k = 4 {change('k = 4')}, {'within it' if change_with_m(best['k = 4']) == 'flat' else 'beyond it'}",
        f"at 4.1M the paper's layer k = 16 {rounded(np.mean(layer_dense[0]))} against dense "
        f"{rounded(np.mean(layer_dense[1]))}, the block {rounded(np.mean(block_dense[0]))} against "
        f"{rounded(np.mean(block_dense[1]))} ({apart(*block_dense)})",
        f"FM decodes {rounded(ups[1][1], 1)}x / {rounded(ups[64][1], 1)}x faster than the Transformer",
        f"{rounded(ups[1][0], 2)}x at batch 1, {rounded(ups[64][0], 2)}x at batch 64; with the block "
        f"{rounded(float(peer['b1_ms_per_token']) / float(with_block['b1_ms_per_token']), 2)}x / "
        f"{rounded(float(peer['b64_ms_per_token']) / float(with_block['b64_ms_per_token']), 2)}x",
        f"fm_1b's batch-1 step {sweep['1024']:g} ms after a 1K-token prompt, {sweep['65536']:g} ms after 64K",
        improve,
    ]] + [(f"k = m/4 {change('k = m/4')}", [RESEARCH, RESEARCH], data)])


def test_readme_rerun_sentence_is_its_data():
    """The rerun sentence (docs/results/rerun.csv against the committed seed-1 runs), in research/README.md."""
    import csv
    with open(RESULTS / 'rerun.csv', newline='') as f:
        rerun = list(csv.DictReader(f))
    committed = {r['run'].rsplit('/', 1)[1]: r['val_loss'] for r in analysis.csv_records(
        str(RESULTS / '2026-11-25' / 'extrapolation_lr.csv'))}
    moved = [float(r['rerun_val_loss']) - committed[r['run']] for r in rerun]
    assert_printed([
        (f"validation losses within {rounded(min(moved))} to +{rounded(max(moved))} of the committed seed-1 runs",
         [RESEARCH], 'docs/results/rerun.csv'),
    ])


def test_readme_results_summary_is_its_data():
    """The README's Results, a few numbers each with its date and device: the quality table's validation losses and
    losses so far at 64x, the 1B decoding steps (batch 1) and training tokens/s."""
    quality = quality_rows()
    gen, train = csv_rows('2026-11-24/generate.csv'), csv_rows('2026-11-23/train.csv')
    names = {"FM's block": 'fm-k16-block', 'Mamba-2': 'mamba2', 'the Transformer': 'transformer',
             "the paper's layer": 'fm-k16'}
    loss = ', '.join(f"{label} {rounded(quality[name]['val_loss'])}" for label, name in names.items())
    far = ', '.join(f"{label} {rounded(quality[name]['so_far_64x'], 2)}" for label, name in list(names.items())[:3])
    step = ', '.join(f"{label} {rounded(float(gen[name]['b1_ms_per_token']), 2)} ms" for label, name in (
        ('fm_1b', 'fm_1b k=8'), ('mamba2_1b', 'mamba2_1b mamba-ssm step'), ('transformer_1b', 'transformer_1b')))
    tokens = {name: f"{rounded(float(train[name]['tokens_per_s']) / 1000, 1)}K" for name in train}
    assert_printed([
        (f"(2026-11-25, two H100s, 4.1M parameters; [table](research/README.md#results-in-detail)): validation loss "
         f"{loss}", [README], 'docs/results/2026-11-25/extrapolation_lr.csv'),
        (f"the first 32,768 positions {far}", [README], 'docs/results/2026-11-25/extrapolation_positions.csv'),
        (f"(2026-11-24, one H200; [data](docs/results/2026-11-24/generate.csv)): a token after a 16K-token prompt {step}",
         [README], 'docs/results/2026-11-24/generate.csv'),
        (f"(2026-11-23, one H200; [data](docs/results/2026-11-23/train.csv)): fm_1b {tokens['fm_1b']} tokens/s, "
         f"transformer_1b {tokens['transformer_1b']}, mamba2_1b {tokens['mamba2_1b']}", [README],
         'docs/results/2026-11-23/train.csv'),
    ])


def test_readme_generation_and_kernel_sentences_are_their_data():
    """The ratios under the generation tables, the long-prompt sweep, the Kernels and Training paragraph and the
    Quickstart's time and losses, each from its data file."""
    import csv
    gen = csv_rows('2026-11-24/generate.csv')
    fm, mamba, attn = gen['fm_1b k=8'], gen['mamba2_1b mamba-ssm step'], gen['transformer_1b']

    def times(a, b, key, digits=1):
        return f"{rounded(float(b[key]) / float(a[key]), digits)}x"

    block = csv_rows('2026-11-25/generate_block.csv')
    layer, with_block, peer = (block["fm_1b the paper's layer"], block['fm_1b the block'],
                               block["mamba2_1b mamba-ssm's step"])
    cost_b1 = 100 * (float(with_block['b1_ms_per_token']) / float(layer['b1_ms_per_token']) - 1)
    cost_train = 100 * (1 - float(with_block['train_tokens_per_s']) / float(layer['train_tokens_per_s']))
    sweep = {row['prompt_tokens']: row for row in csv.DictReader(open(RESULTS / '2026-11-24' / 'generate_sweep.csv'))}
    with open(RESULTS / '2026-11-23' / 'kernels.csv', newline='') as f:
        kernels = {}
        for row in csv.DictReader(f):
            kernels.setdefault(row['kernel'], []).append(float(row['ms']))
    train = csv_rows('2026-11-23/train.csv')
    with open(RESULTS / 'quickstart.csv', newline='') as f:
        quick = list(csv.DictReader(f))
    quiet = [r for r in quick if r['machine'].startswith('a quiet') and r['seconds']]
    newest, before, other = quiet[-2], quiet[-1], quiet[1]  # this code, the code before, another machine
    busy = next(int(r['seconds']) for r in quick if r['machine'].startswith('a busy'))
    start = next(float(r['start_val_loss']) for r in quick if r['start_val_loss'])
    cpu = csv_rows('2026-11-27b/cpu_small.csv')

    def minutes(seconds):
        return f'{seconds // 60} min {seconds % 60} s'

    def micro(name):
        return ' / '.join(f'{1000 * t:.1f}' if 1000 * t < 10 else f'{1000 * t:.0f}' for t in kernels[name])

    dense = gen['fm_1b dense']
    fm_tokens = float(train['fm_1b']['tokens_per_s'])
    assert_printed([
        (f"fm_1b k = 8 decodes {times(fm, dense, 'b1_ms_per_token')} / {times(fm, dense, 'b64_ms_per_token')} faster "
         f"than dense (batch 1 / 64)", [RESEARCH], 'docs/results/2026-11-24/generate.csv'),
        (f"fm_1b's batch-1 step {sweep['1024']['b1_ms_per_token']} ms after a 1K-token prompt, "
         f"{sweep['65536']['b1_ms_per_token']} ms after 64K", [RESEARCH], 'docs/results/2026-11-24/generate_sweep.csv'),
        (f"fm_1b trains at {rounded(fm_tokens / float(train['transformer_1b']['tokens_per_s']), 2)}x the "
         f"Transformer's tokens/s and {rounded(fm_tokens / float(train['mamba2_1b']['tokens_per_s']), 2)}x Mamba-2's",
         [RESEARCH, RESEARCH], 'docs/results/2026-11-23/train.csv'),
        (f"FM decodes {times(fm, mamba, 'b1_ms_per_token')} faster than Mamba-2 at batch 1 and "
         f"{times(fm, mamba, 'b64_ms_per_token')} at batch 64 (mamba-ssm's step), {times(fm, attn, 'b1_ms_per_token')}"
         f" / {times(fm, attn, 'b64_ms_per_token')} faster than the Transformer", [RESEARCH],
         'docs/results/2026-11-24/generate.csv'),
        (f"the block costs {rounded(cost_b1, 0)}% at batch 1 and {rounded(cost_train, 0)}% in training; FM with it "
         f"decodes {times(with_block, peer, 'b1_ms_per_token', 2)} / {times(with_block, peer, 'b64_ms_per_token', 2)}"
         f" faster than Mamba-2 and trains "
         f"{rounded(float(with_block['train_tokens_per_s']) / float(peer['train_tokens_per_s']), 2)}x faster",
         [RESEARCH], 'docs/results/2026-11-25/generate_block.csv'),
        (f"fm_1b's batch-1 step took {sweep['1024']['b1_ms_per_token']} ms after a 1K-token prompt and "
         f"{sweep['65536']['b1_ms_per_token']} ms after 64K", [RESEARCH], 'docs/results/2026-11-24/generate_sweep.csv'),
        (f"FM's scan forward+backward {span(kernels['fm_scan k=8 fwd+bwd'], 2)} ms from T = 1K to 16K, against "
         f"Mamba-2's SSD {span(kernels['mamba2 ssd fwd+bwd'], 2)} ms and causal SDPA "
         f"{span(kernels['sdpa causal fwd+bwd'], 2)} ms", [RESEARCH], 'docs/results/2026-11-23/kernels.csv'),
        (f"`fm_step` k = 8 {micro('fm_step k=8')} µs, Mamba-2's fused step {micro('mamba2 fused step')} µs",
         [RESEARCH],
         'docs/results/2026-11-23/kernels.csv'),
        (f"fm_1b with the paper's layer {rounded(float(train['fm_1b']['tokens_per_s']) / 1000, 1)}K tokens/s "
         f"({rounded(100 * float(train['fm_1b']['mfu']), 0)}% MFU), transformer_1b "
         f"{rounded(float(train['transformer_1b']['tokens_per_s']) / 1000, 1)}K, mamba2_1b "
         f"{rounded(float(train['mamba2_1b']['tokens_per_s']) / 1000, 1)}K", [RESEARCH],
         'docs/results/2026-11-23/train.csv'),
        (f"training took {minutes(int(newest['seconds']))} ({newest['date']}, a fresh clone, one run; the code of "
         f"{other['date']} took {minutes(int(before['seconds']))} on the same machine and "
         f"{minutes(int(other['seconds']))} on another", [RESEARCH], 'docs/results/quickstart.csv'),
        (f"from {rounded(start, 2)} to {rounded(float(cpu['fm_small']['val_loss']))} nats per byte", [RESEARCH],
         'docs/results/quickstart.csv, 2026-11-27b/cpu_small.csv'),
        (f"torch's default threads took {minutes(busy)} there", [RESEARCH], 'docs/results/quickstart.csv'),
        (f"{minutes(int(newest['seconds']))} on a quiet 2-core CPU ({newest['date']}", [README],
         'docs/results/quickstart.csv'),
    ])


def test_readme_cpu_configs_are_their_data():
    """The small configs' validation losses on a 2-core CPU (research/README.md)."""
    cpu = {name: rounded(float(row['val_loss'])) for name, row in csv_rows('2026-11-27b/cpu_small.csv').items()}
    data = 'docs/results/2026-11-27b/cpu_small.csv'
    assert_printed([(f"`fm_small` {cpu['fm_small']} (with the block, 2026-11-25; the paper's layer "
                     f"{cpu['fm_small config/paper_layer.py']},", [RESEARCH], data),
                    (f"`transformer_small` {cpu['transformer_small']} and `mamba2_small` {cpu['mamba2_small']} "
                     f"(2026-11-27", [RESEARCH], data)])


def redraws():
    """(call, the first command of its 'redrawn without a GPU' cell) of each row of research/README.md's table."""
    import re
    rows = []
    for line in open(os.path.join(REPO, RESEARCH), encoding='utf-8'):
        cells = [cell.strip() for cell in line.strip().strip('|').split('|')]
        if line.startswith('| `bash research/reproduce.sh'):
            call = cells[0].split()[-1].rstrip('`')
            rows.append((call, re.search(r'`([^`]*)`', cells[4])[1]))
    return rows


def test_research_readme_lists_a_redraw_for_each_call():
    assert [call for call, _ in redraws()] == ['quality', 'frontier', 'routing', 'scaling', 'levers']


@pytest.mark.parametrize('call', ['quality', 'frontier', 'routing', 'scaling', 'levers'])
def test_research_readme_redraws_work_as_published(call, repo_corpus, tmp_path):
    """Each redraw of research/README.md's table, as written there: an analysis.py command runs (its --out in
    tmp_path); a reproduce.sh one (its PREVIOUS and MODELS) trains nothing and exits 0 (TRAIN_SECONDS=1: a run it would
    train is not started, which exits 3)."""
    import shlex
    import subprocess
    command = dict(redraws())[call]
    if command.startswith('python research/analysis.py'):
        analysis.main(shlex.split(command)[2:] + [f'--out={tmp_path / "out"}'])
        return
    env = dict(word.split('=', 1) for word in shlex.split(command))
    run = subprocess.run(['bash', 'research/reproduce.sh', call], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, **env, 'TRAIN_SECONDS': '1', 'RUNS': str(tmp_path / 'runs'),
                              'RESULTS': str(tmp_path / 'results')})
    assert run.returncode == 0, f'{command} bash research/reproduce.sh {call}: ' + run.stdout[-2000:] + run.stderr
    assert 'not started' not in run.stdout


def test_reproduce_sh_runs_python3_or_the_python_set(tmp_path):
    """research/reproduce.sh calls no bare `python` (a machine with only python3 has none): every Python it runs is
    "$PYTHON", python3 unless set; a PYTHON that is no command is refused before anything runs (exit 2)."""
    import re
    import subprocess
    script = Path(REPO) / 'research' / 'reproduce.sh'
    bare = [line for line in script.read_text().splitlines()
            if not line.lstrip().startswith('#') and re.search(r'(^|[\s;&|(])python\s', line)]
    assert not bare, f'bare python in reproduce.sh: {bare}'
    assert 'export PYTHON=${PYTHON:-python3}' in script.read_text()  # train_one runs in a child shell
    run = subprocess.run(['bash', str(script), 'quality'], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, 'PYTHON': str(tmp_path / 'no-such-python'),
                              'RUNS': str(tmp_path / 'runs'), 'RESULTS': str(tmp_path / 'results')})
    assert run.returncode == 2 and 'no such command' in run.stderr, run.stderr
    assert not (tmp_path / 'runs').exists()
