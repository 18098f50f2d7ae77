"""The README's commands (Quickstart, Training, Sampling, Evaluating) in order, at toy size; its bench.py commands;
the numbers and verdict words of README.md's Results and research/README.md's Results in detail, each sentence built
from its data file in docs/results and found in each README that prints it; research/README.md's redraws as
published."""

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
    claims = [(f"parameters matched within {math.ceil(10 * spread_of_sizes) / 10:g}%", [README], data),
              (f"The block is {percent(block['val_loss'], layer['val_loss'])} the paper's layer at the context "
               f"({block['seeds']} seeds each, {verdict})", [README], data)]
    block, mamba = levers['fm-k16-block'], levers['mamba2']
    data = 'docs/results/2026-11-27/levers_lr.csv, mamba2_lr.csv, *_positions.csv'
    at_context, at_64x = percent(block['val_loss'], mamba['val_loss']), percent(block['so_far_64x'],
                                                                                 mamba['so_far_64x'])
    verdict = apart(seed_losses('2026-11-27/levers_lr.csv', 'fm-k16-block'),
                    seed_losses('2026-11-27/mamba2_lr.csv', 'mamba2'))
    claims += [(f"it is {at_context} Mamba-2 at the context and {at_64x.split('%')[0]}% at 64x it", [README], data),
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
         f"every size", [README], data),
        (sentence, [README, RESEARCH], data),
        (f"(at 4.1M the seed range is {span(ranges, 3)})", [RESEARCH], '2026-11-25/extrapolation_lr.csv'),
        (f"with the block, above Mamba-2's, {'below' if below_transformer else 'not below'} the Transformer's",
         [README], data),
        (f"the block trails Mamba-2 at 2x and 8x {'at every size' if trails else 'at some sizes'}; at 8x the gap goes "
         f"{' / '.join(rounded(g) for g in gaps[8])} nats from 1.1M to 8.3M", [README], data),
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
    claims = [(f"({span([by_selection[m] for m in models], 0)} effective rows of 64)", [README], data),
              (f"a median of {rounded(by_weight['fm-k16'], 1)} effective rows a layer in the paper's layer, "
               f"{rounded(by_weight['fm-k16-block'], 1)} with the block", [README], data),
              (f"rewritten every {math.floor(min(every))}-{math.ceil(max(every))} tokens (median write rate "
               f"{' / '.join(rounded(theta[m], 2) for m in models)})", [README], data)]
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
    at_256 = [r for r in rows if r['n_memory'] == 256 and r['tau'] == 0.25]
    unfinished = [r for r in at_256 if r['iter_num'] < r['max_iters']]
    taus = [p['tau'] for series in best.values() for p in series.values()]
    apart_64, apart_256 = (apart(quarter[m]['losses'], dense[m]['losses']) for m in (64, 256))
    with open(RESULTS / '2026-11-24' / 'scaling-paper-layer.csv', newline='') as f:
        sweep = {(row['series'], int(row['n_memory'])): float(row['val_loss']) for row in csv.DictReader(f)}
    above = [m for m in (16, 32, 64, 128, 256) if sweep['k = m/4', m] > sweep['dense', m]]
    lowest = [m for m in (64, 256) if four[m]['val_loss'] < min(dense[m]['val_loss'], quarter[m]['val_loss'])]
    flat_four = apart(four[16]['losses'], four[256]['losses']) == 'within the spread'
    assert_printed([
        (verdict, [README, README], data),
        (f"{'flat from m = 16' if flat_four else 'not flat'} and the lowest of the three, k = 4 lowest at m = "
         f"{' and '.join(map(str, lowest))} (3 seeds)", [README], data),
        ('dense ' + ' / '.join(point(p) for p in dense.values()), [RESEARCH], data),
        ('k = m/4 ' + ' / '.join(point(p) for p in quarter.values()), [RESEARCH], data),
        ('k = 4 ' + ' / '.join(point(p, m != 16) for m, p in four.items()), [RESEARCH], data),
        (f"k = m/4 is {'below' if quarter[64]['val_loss'] < dense[64]['val_loss'] else 'above'} dense at m = 64 "
         f"({apart_64}) and 256 ({apart_256})", [RESEARCH], data),
        (f"k = m/4 {'at or below' if at_or_below else 'above'} dense at every m", [README], data),
        (f"tau = 1 wins {taus.count(1.0)} of {len(taus)} cells", [README], data),
        (f"m = 256 at 0.25 has {len(unfinished)} of its {len(at_256)} runs unfinished", [README], data),
        (f"k = m/4 above dense at m = {' and '.join(map(str, above))}", [README],
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
    claims += [(verdict, [README], 'docs/results/2026-11-27/*_lr.csv'),
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
    claims += [(f'the block {trails}, {gap} nats from 2K to 256K positions', [README, README], data),
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
    for a in sizes:
        for b in sizes:
            assert verdict(a, b) == 'within the spread', 'README: flat in m'
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
    claims = [(phrase, [README], data) for phrase in paragraph] + [(research, [RESEARCH], data)]
    assert_printed(claims)


def test_readme_paper_table_is_its_data():
    """The numbers and verdicts of "The paper against this reproduction" that come from the quality table, and the
    rerun sentence (docs/results/rerun.csv against the committed seed-1 runs)."""
    import csv
    import numpy as np
    quality = quality_rows()
    data = 'docs/results/2026-11-25/extrapolation_lr.csv, extrapolation_positions.csv'
    layer, attn, mamba = quality['fm-k16'], quality['transformer'], quality['mamba2']
    falls = layer['so_far_64x'] < layer['so_far_1x'] and mamba['so_far_64x'] < mamba['so_far_1x']
    losses = {name: seed_losses('2026-11-25/extrapolation_lr.csv', name)
              for name in ('fm-k16', 'fm-dense', 'fm-k16-block', 'fm-dense-block')}
    matches = all(np.mean(losses[k]) <= np.mean(losses[d]) or apart(losses[k], losses[d]) == 'within the spread'
                  for k, d in (('fm-k16', 'fm-dense'), ('fm-k16-block', 'fm-dense-block')))
    with open(RESULTS / 'rerun.csv', newline='') as f:
        rerun = list(csv.DictReader(f))
    committed = {r['run'].rsplit('/', 1)[1]: r['val_loss'] for r in analysis.csv_records(
        str(RESULTS / '2026-11-25' / 'extrapolation_lr.csv'))}
    moved = [float(r['rerun_val_loss']) - committed[r['run']] for r in rerun]
    assert_printed([
        (f"the paper's layer {rounded(layer['so_far_1x'], 2)} -> {rounded(layer['so_far_64x'], 2)} from 512 to "
         f"32,768, the Transformer {rounded(attn['so_far_1x'], 2)} -> {rounded(attn['so_far_64x'], 2)}, Mamba-2 "
         f"{rounded(mamba['so_far_1x'], 2)} -> {rounded(mamba['so_far_64x'], 2)}", [README], data),
        ('FM\'s and Mamba-2\'s fall' if falls else 'FM\'s or Mamba-2\'s does not fall', [README], data),
        (f"{'reproduced' if matches else 'not reproduced'}: at 4.1M, m = 64, the paper's layer k = 16 "
         f"{rounded(np.mean(losses['fm-k16']))} ({len(losses['fm-k16'])} seeds) against dense "
         f"{rounded(np.mean(losses['fm-dense']))} ({len(losses['fm-dense'])}), the block "
         f"{rounded(np.mean(losses['fm-k16-block']))} ({len(losses['fm-k16-block'])}) against "
         f"{rounded(np.mean(losses['fm-dense-block']))} ({len(losses['fm-dense-block'])}, "
         f"{apart(losses['fm-k16-block'], losses['fm-dense-block'])})", [README], data),
        (f"validation losses within {rounded(min(moved))} to +{rounded(max(moved))} of the committed seed-1 runs",
         [README], 'docs/results/rerun.csv'),
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
         f"than dense (batch 1 / 64)", [README], 'docs/results/2026-11-24/generate.csv'),
        (f"fm_1b's batch-1 step {sweep['1024']['b1_ms_per_token']} ms after a 1K-token prompt, "
         f"{sweep['65536']['b1_ms_per_token']} ms after 64K", [README], 'docs/results/2026-11-24/generate_sweep.csv'),
        (f"fm_1b trains at {rounded(fm_tokens / float(train['transformer_1b']['tokens_per_s']), 2)}x the "
         f"Transformer's tokens/s and {rounded(fm_tokens / float(train['mamba2_1b']['tokens_per_s']), 2)}x Mamba-2's",
         [README], 'docs/results/2026-11-23/train.csv'),
        (f"FM decodes {times(fm, mamba, 'b1_ms_per_token')} faster than Mamba-2 at batch 1 and "
         f"{times(fm, mamba, 'b64_ms_per_token')} at batch 64 (mamba-ssm's step), {times(fm, attn, 'b1_ms_per_token')}"
         f" / {times(fm, attn, 'b64_ms_per_token')} faster than the Transformer", [README],
         'docs/results/2026-11-24/generate.csv'),
        (f"the block costs {rounded(cost_b1, 0)}% at batch 1 and {rounded(cost_train, 0)}% in training; FM with it "
         f"decodes {times(with_block, peer, 'b1_ms_per_token', 2)} / {times(with_block, peer, 'b64_ms_per_token', 2)}"
         f" faster than Mamba-2 and trains "
         f"{rounded(float(with_block['train_tokens_per_s']) / float(peer['train_tokens_per_s']), 2)}x faster",
         [README], 'docs/results/2026-11-25/generate_block.csv'),
        (f"fm_1b's batch-1 step took {sweep['1024']['b1_ms_per_token']} ms after a 1K-token prompt and "
         f"{sweep['65536']['b1_ms_per_token']} ms after 64K", [RESEARCH], 'docs/results/2026-11-24/generate_sweep.csv'),
        (f"FM's scan forward+backward {span(kernels['fm_scan k=8 fwd+bwd'], 2)} ms from T = 1K to 16K, against "
         f"Mamba-2's SSD {span(kernels['mamba2 ssd fwd+bwd'], 2)} ms and causal SDPA "
         f"{span(kernels['sdpa causal fwd+bwd'], 2)} ms", [README], 'docs/results/2026-11-23/kernels.csv'),
        (f"`fm_step` k = 8 {micro('fm_step k=8')} µs, Mamba-2's fused step {micro('mamba2 fused step')} µs", [README],
         'docs/results/2026-11-23/kernels.csv'),
        (f"fm_1b with the paper's layer {rounded(float(train['fm_1b']['tokens_per_s']) / 1000, 1)}K tokens/s "
         f"({rounded(100 * float(train['fm_1b']['mfu']), 0)}% MFU), transformer_1b "
         f"{rounded(float(train['transformer_1b']['tokens_per_s']) / 1000, 1)}K, mamba2_1b "
         f"{rounded(float(train['mamba2_1b']['tokens_per_s']) / 1000, 1)}K", [README],
         'docs/results/2026-11-23/train.csv'),
        (f"training took {minutes(int(newest['seconds']))} ({newest['date']}, a fresh clone, one run; the code of "
         f"{other['date']} took {minutes(int(before['seconds']))} on the same machine and "
         f"{minutes(int(other['seconds']))} on another", [README], 'docs/results/quickstart.csv'),
        (f"from {rounded(start, 2)} to {rounded(float(cpu['fm_small']['val_loss']))} nats per byte", [README],
         'docs/results/quickstart.csv, 2026-11-27b/cpu_small.csv'),
        (f"torch's default threads took {minutes(busy)} there", [README], 'docs/results/quickstart.csv'),
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
