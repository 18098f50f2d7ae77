"""
The small-scale reproduction's analyses of finished training runs (research/reproduce.sh runs them); --runs names
a run folder, a folder of run folders, or the .csv a subcommand wrote on an earlier machine (to merge runs of several
machines), and may repeat.

Learning rates: every finished run by model and learning rate, the mean validation loss over seeds (min-max), each
model's best rate, and a warning where that rate is the lowest or highest trained (the rate to add):
    python research/analysis.py sweep --runs=out-repro/extrapolation --out=results/extrapolation_lr
Writes --out's .csv (every run) and _best.txt (the run folders at each model's best rate, every seed).

The loss frontier (paper Figures 2-3): the sweep, then each model at its best learning rate against the forward
FLOPs of its training (Model.flops_per_token(block_size) / 3 x tokens trained: flops_per_token counts forward and
backward as 3 x forward, attention's quadratic term included): the validation loss at the training context, and
the loss so far at 2x and 8x it (on the default corpus's long split, or --data as for eval.py; one evaluation a
best-rate run):
    python research/analysis.py frontier --runs=out-repro/frontier --out=results/frontier
Writes --out's .csv (every run) and .png (the two panels).

Memory scaling (paper Figure 5), from the validation losses of FM runs (a folder of run folders, or the .csv this
command wrote):
    python research/analysis.py scaling --runs=out-repro/scaling --out=results/scaling
Writes --out's .csv (every run) and .png (each m at its best tau).

The README's tables: each model (a run name less -lrLR-sSEED) at its best learning rate (a sweep's best_lr), its
seeds' range, and the mean loss so far at 1x, 8x and 64x its context over its runs in eval.py's loss by position:
    python research/analysis.py table --runs=docs/results/2026-11-25/extrapolation_lr.csv \\
        --runs=docs/results/2026-11-25/extrapolation_positions.csv --out=results/quality
Writes --out's .csv.

eval.py's loss-by-position plot redrawn from its .json or .csv files (the .csv: runs named as reproduce.sh names
them, NAME-lrLR-sSEED):
    python research/analysis.py positions --runs=docs/results/2026-11-25/extrapolation_positions.csv --out=results/x
Writes --out's .png.

The README's "Inside the memory" from eval.py routing's .csv (no checkpoints needed): each model's effective rows a
layer by selection and by weight and its heaviest row's write rate, medians over layers and seeds:
    python research/analysis.py routing --runs=docs/results/2026-11-25/routing.csv --out=results/routing
Writes --out.png (by-weight effective rows, a point a layer and seed). Measuring checkpoints: python eval.py routing.

The gap to a reference model past the context, from eval.py's loss by position (its .json or .csv, here --runs):
each model's loss so far, mean over its seeds, minus the reference's (a word of its model name), by position:
    python research/analysis.py gap --runs=results/levers.json --runs=results/extrapolation.json --reference=mamba2
Writes --out's .png.

Multi-query associative recall (research/recall.py's rows, a run and test slice each; issue 55):
each model at its best learning rate (the highest mean accuracy over the slices up to 256 tokens of
its first seed), its accuracy by test slice (mean over seeds), beside them Zoology's metric (a run's
mean accuracy over the 7 test slices, mean over seeds), how many seeds stopped early, and accuracy
against the bytes of a layer's state and of a decoding step:
    python research/analysis.py recall --runs=docs/results/2026-11-29/recall.csv --out=results/r
Writes --out's _best.txt (MODEL LR a line), _table.csv (the table), _state.png and _step.png.
"""
import csv
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: eval.py, model.py

import numpy as np

from checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint
from configurator import ConfigError, help_text, load_config, run_main
from eval import (DEVICE, EvalError, check_device, check_out, check_ranges, describe, evaluate_positions,
                  load_documents, loss_at, open_checkpoint, plot_positions, pyplot, save_figure, seed_groups,
                  take_all, take_subcommand)

SCALING_SETTINGS = dict(
    out='results/scaling',  # writes out.csv and out.png
)
SWEEP_SETTINGS = dict(
    out='results/sweep',  # writes out.csv and out_best.txt
)
TABLE_SETTINGS = dict(
    out='results/table',  # writes out.csv
)
POSITIONS_SETTINGS = dict(
    out='results/positions',  # writes out.png
)
RECALL_SETTINGS = dict(
    out='results/recall',  # writes out_best.txt, out_table.csv, out_state.png and out_step.png
)
ROUTING_SETTINGS = dict(
    out='results/routing',  # writes out.png
)
GAP_SETTINGS = dict(
    reference='mamba2',  # the model the others are measured against: a word of its name in eval.py's tables
    out='results/gap',  # writes out.png
)
FRONTIER_SETTINGS = dict(  # the loss beyond the context: as eval.py's loss by position
    data='',  # '': the default corpus's long.bin; or a token file (.bin), a .txt file or a folder of .txt files
    data_dir='',  # the folder prepare_data.py writes the default corpus into; '': the repository's data/
    chunk_len=8192,  # fm, mamba2: tokens a chunk, each continuing from the state the last one left
    out='results/frontier',  # writes out.csv and out.png
    device=DEVICE,  # 'cuda' (or 'cuda:N') where there is a GPU, else 'cpu'
    dtype='auto',  # 'auto': bfloat16 autocast on CUDA, float32 elsewhere; losses always from float32 logits
)
SERIES = {  # the sparsity rules of paper Figure 5: name -> whether a run of m rows and top-k k follows it
    'dense (k = m)': lambda m, k: k == m,
    'k = m/4': lambda m, k: 4 * k == m,
    'k = 4': lambda m, k: k == 4,
}
USAGE = ('research/analysis.py sweep|frontier|scaling|table|positions|routing|gap|recall --runs=PATH --key=value ...; '
         "measuring a checkpoint's routing and harness are in eval.py")
RUNS = {  # what --runs takes
    'sweep': 'a run folder (with ckpt.pt), a folder of run folders or a .csv that sweep or frontier wrote',
    'scaling': 'a folder of FM run folders or a .csv that scaling wrote',
    'table': "the .csv of a sweep and the .json or .csv of eval.py's loss by position",
    'positions': "a .json or .csv that eval.py's loss by position wrote",
    'gap': "a .json or .csv that eval.py's loss by position wrote",
    'recall': 'a .csv that research/recall.py wrote',
    'routing': "the .csv that eval.py routing --out=PREFIX wrote (PREFIX.csv; checkpoints: python eval.py routing)",
}
SCALING_FIELDS = ('run', 'n_memory', 'top_k', 'tau', 'seed', 'val_loss', 'iter_num', 'max_iters')
SWEEP_FIELDS = ('run', 'model', 'parameters', 'non_embedding_parameters', 'learning_rate', 'min_lr', 'seed',
                'val_loss', 'best_lr', 'iter_num', 'max_iters', 'block_size', 'tokens', 'forward_flops')


# ----------------------------------------------------------------------------- memory scaling

def scaling_row(path):
    """The scaling record of one FM run's checkpoint (its final validation loss when eval_interval = max_iters)."""
    ckpt = load_checkpoint(path)
    config = ckpt['model_config']
    if model_from_checkpoint(ckpt, path, 'meta').config.family != 'fm':  # the paper's layer, the block, a lever
        raise EvalError(f"{path} is a {config['mixer']} run, not an FM run: give --runs folders of FM runs only")
    return {'run': path.parent.name, 'n_memory': config['n_memory'], 'top_k': config['top_k'] or config['n_memory'],
            'tau': config['tau'], 'seed': ckpt['train_config']['seed'], 'val_loss': ckpt['best_val_loss'],
            'iter_num': ckpt['iter_num'], 'max_iters': ckpt['train_config']['max_iters']}


def scaling_csv(path):
    """The run records of a .csv that scaling wrote (one without a seed column: train.py's default seed, 1337)."""
    with open(path, newline='') as f:
        rows = list(csv.DictReader(f))
    if not rows or not set(SCALING_FIELDS) - {'seed'} <= set(rows[0]):
        raise EvalError(f'--runs={path}: not a .csv that analysis.py scaling wrote')
    return [{'run': row['run'], **{k: int(row[k]) for k in ('n_memory', 'top_k', 'iter_num', 'max_iters')},
             'tau': float(row['tau']), 'seed': int(row.get('seed', 1337)), 'val_loss': float(row['val_loss'])}
            for row in rows]


def scaling_rows(sources):
    """Run records from folders of run folders (each */ckpt.pt) and from .csv files analysis.py scaling wrote; a
    later record of a run replaces an earlier one."""
    rows = {}
    for source in sources:
        path = Path(source)
        if path.suffix == '.csv' and path.is_file():
            rows.update((row['run'], row) for row in scaling_csv(path))
        elif path.is_dir():
            for ckpt in sorted(path.glob('*/ckpt.pt')):
                rows[ckpt.parent.name] = scaling_row(ckpt)
        else:
            raise EvalError(f'--runs={source}: not a folder of run folders or a .csv of analysis.py scaling')
    if not rows:
        raise EvalError(f'no runs (*/ckpt.pt) in {", ".join(sources)}')
    return sorted(rows.values(), key=lambda r: (r['n_memory'], r['top_k'], -r['tau']))


def best_per_series(rows):
    """{series: {m: its best tau's point}} for each series of SERIES, a point the finished runs of one (m, k, tau):
    tau, val_loss (the mean over their seeds), losses and runs (a seed each); the best tau: the lowest mean of those
    with the most seeds of that (m, k) (a tau with fewer finished seeds is left out: its mean compares unfairly)."""
    points = {}
    for row in rows:
        if row['iter_num'] >= row['max_iters']:
            point = points.setdefault((row['n_memory'], row['top_k'], row['tau']), {'tau': row['tau'], 'losses': [],
                                                                                   'runs': []})
            point['losses'].append(row['val_loss'])
            point['runs'].append(row['run'])
    most = {}
    for (m, k, _), point in points.items():
        most[m, k] = max(most.get((m, k), 0), len(point['losses']))
    best = {name: {} for name in SERIES}
    for (m, k, _), point in points.items():
        point['val_loss'] = float(np.mean(point['losses']))
        if len(point['losses']) < most[m, k]:
            continue
        for name, follows in SERIES.items():
            if follows(m, k) and (m not in best[name] or point['val_loss'] < best[name][m]['val_loss']):
                best[name][m] = point
    return {name: dict(sorted(runs.items())) for name, runs in best.items() if runs}


def spread(losses):
    """'1.6100' for one loss; '1.6100 (1.6050-1.6150, 3)': the mean, min-max and count of several."""
    return f'{np.mean(losses):.4f}' + (f' ({min(losses):.4f}-{max(losses):.4f}, {len(losses)})' if len(losses) > 1
                                       else '')


def print_scaling(rows, best):
    """Every run's validation loss (tau x m, a table a series; several seeds: their mean), then each m at its best
    tau with its seeds' range."""
    unfinished = [r['run'] for r in rows if r['iter_num'] < r['max_iters']]
    if unfinished:
        print(f'left out, not finished: {", ".join(unfinished)}')
    for name in best:
        runs = [r for r in rows if SERIES[name](r['n_memory'], r['top_k']) and r['iter_num'] >= r['max_iters']]
        cells = {}  # {(tau, m): its runs' losses}
        for r in runs:
            cells.setdefault((r['tau'], r['n_memory']), []).append(r['val_loss'])
        ms, taus = sorted({m for _, m in cells}), sorted({tau for tau, _ in cells}, reverse=True)
        print(f'\nvalidation loss, {name}\n{"tau / m":>10}' + ''.join(f'{m:>9}' for m in ms))
        for tau in taus:
            print(f'{tau:>10g}' + ''.join(f'{np.mean(cells[tau, m]):9.4f}' if (tau, m) in cells else f'{"-":>9}'
                                          for m in ms))
    print('\nbest over tau: validation loss, mean over seeds (min-max, seeds) (tau)')
    for name, points in best.items():
        print(f'{name:>14}: ' + ', '.join(f"m={m} {spread(p['losses'])} ({p['tau']:g})" for m, p in points.items()))


def plot_scaling(best, path):
    """Validation loss at the best tau against m (log scale; the mean over seeds, a bar their min-max), a line a
    series, each point's tau written by it. -> whether it wrote the plot (False without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 5))
    for name, runs in best.items():
        means = [r['val_loss'] for r in runs.values()]
        bars = [[mean - min(r['losses']) for mean, r in zip(means, runs.values())],
                [max(r['losses']) - mean for mean, r in zip(means, runs.values())]]
        line, _, _ = ax.errorbar(list(runs), means, yerr=bars, marker='o', capsize=3, label=name)
        for m, r in runs.items():
            ax.annotate(f"tau={r['tau']:g}", (m, r['val_loss']), textcoords='offset points', xytext=(4, 4),
                        fontsize=7, color=line.get_color())
    ax.set_xscale('log', base=2)
    ax.set(title='memory scaling: validation loss at the best tau', xlabel='memory rows m',
           ylabel='validation loss (nats/token)')
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(plt, fig, path)


def run_scaling(cfg, sources):
    """The memory-scaling tables, out.csv (every run) and out.png."""
    rows = scaling_rows(sources)
    best = best_per_series(rows)
    print_scaling(rows, best)
    Path(cfg['out']).parent.mkdir(parents=True, exist_ok=True)
    with open(f"{cfg['out']}.csv", 'w', newline='') as f:
        writer = csv.DictWriter(f, SCALING_FIELDS, lineterminator='\n')
        writer.writeheader()
        writer.writerows(rows)
    plotted = bool(best) and plot_scaling(best, f"{cfg['out']}.png")
    print(f"wrote {cfg['out']}.csv{', .png' if plotted else ''}")
    return rows, best


# ----------------------------------------------------------------------------- learning rates and the loss frontier

def run_folders(source):
    """The run folders (holding ckpt.pt) of a --runs value: a run folder or a folder of run folders."""
    path = Path(source)
    if (path / 'ckpt.pt').is_file():
        return [path]
    if not path.is_dir():
        raise EvalError(f'--runs={source}: not a run folder (with ckpt.pt), a folder of run folders or a .csv')
    folders = [ckpt.parent for ckpt in sorted(path.glob('*/ckpt.pt'))]
    if not folders:
        raise EvalError(f'no runs (ckpt.pt) in {source}')
    return folders


def csv_records(path):
    """The run records of a .csv that sweep or frontier wrote (runs of an earlier machine)."""
    ints = ('parameters', 'non_embedding_parameters', 'seed', 'best_lr', 'iter_num', 'max_iters', 'block_size',
            'tokens')
    floats = ('learning_rate', 'min_lr', 'val_loss', 'forward_flops', 'loss_so_far_2x', 'loss_so_far_8x')
    with open(path, newline='') as f:
        rows = list(csv.DictReader(f))
    if not rows or not {'run', 'model', *ints, 'learning_rate', 'val_loss'} <= set(rows[0]):
        raise EvalError(f'--runs={path}: not a .csv that analysis.py sweep or frontier wrote')
    return [{'run': row['run'], 'model': row['model'], 'from_csv': True,
             'architecture': row['model'].split(' ', 1)[1].rsplit(' (', 1)[0], **{k: int(row[k]) for k in ints},
             **{k: float(row[k]) for k in floats if row.get(k)}} for row in rows]


def run_key(record):
    """A run's name in its subset (the last two parts of its folder): the same run on another machine."""
    return '/'.join(Path(record['run']).parts[-2:])


def run_record(folder):
    """The sweep record of one run: its model, learning rate, seed, final validation loss (the configs evaluate once,
    at the end), parameters and forward training FLOPs = Model.flops_per_token(block_size) / 3 x tokens trained
    (flops_per_token counts forward + backward as 3 x forward, attention's quadratic term included)."""
    ckpt = load_checkpoint(folder / 'ckpt.pt')
    config, train = ckpt['model_config'], ckpt['train_config']
    model = model_from_checkpoint(ckpt, folder / 'ckpt.pt', device='meta')  # shapes only: no weights are made
    tokens = ckpt['data_state']['tokens_seen']
    return {'run': str(folder), 'model': f"{describe(config)} ({model.num_params() / 1e6:.2f}M)", 'from_csv': False,
            'architecture': describe(config).split(' ', 1)[1], 'parameters': model.num_params(non_embedding=False),
            'non_embedding_parameters': model.num_params(), 'learning_rate': train['learning_rate'],
            'min_lr': train['min_lr'], 'seed': train['seed'], 'val_loss': ckpt['best_val_loss'],
            'iter_num': ckpt['iter_num'], 'max_iters': train['max_iters'], 'block_size': config['block_size'],
            'tokens': tokens, 'forward_flops': model.flops_per_token(config['block_size']) / 3 * tokens}


def by_model_and_lr(records):
    """Finished runs -> {model: {learning rate: [records]}}, learning rates ascending."""
    table = {}
    for r in records:
        if r['iter_num'] >= r['max_iters']:
            table.setdefault(r['model'], {}).setdefault(r['learning_rate'], []).append(r)
    return {model: dict(sorted(runs.items())) for model, runs in table.items()}


def best_learning_rates(table):
    """{model: the learning rate of lowest mean validation loss over its seeds}."""
    return {model: min(runs, key=lambda lr: np.mean([r['val_loss'] for r in runs[lr]]))
            for model, runs in table.items()}


def edge_warnings(table, best):
    """A line for each model whose best learning rate is the lowest or highest it was trained at: the rate to add."""
    warnings = []
    for model, lr in best.items():
        lrs = list(table[model])
        add = [f'{rate:g}' for rate, at_edge in ((lr / 2, lr == lrs[0]), (lr * 2, lr == lrs[-1])) if at_edge]
        if add and len(lrs) > 1:  # one rate trained: no sweep to warn about
            warnings.append(f"warning: {model}: the best learning rate {lr:g} is at the edge of those trained "
                            f"({' '.join(f'{x:g}' for x in lrs)}): train at {' and '.join(add)} too")
    return warnings


def print_sweep(records, table, best):
    """Each model's validation loss at each learning rate (mean over seeds, min-max), its best marked; warnings."""
    unfinished = [r['run'] for r in records if r['iter_num'] < r['max_iters']]
    if unfinished:
        print(f'left out, not finished: {", ".join(unfinished)}')
    width = max(len(model) for model in table)
    print(f'\nvalidation loss at each learning rate: mean over seeds (min-max), * the best\n'
          f'{"model":<{width}} {"lr":>8} {"seeds":>5}  val loss')
    for model, runs in table.items():
        for lr, members in runs.items():
            losses = [r['val_loss'] for r in members]
            spread = f' ({min(losses):.4f}-{max(losses):.4f})' if len(losses) > 1 else ''
            print(f"{model:<{width}} {lr:>8g} {len(losses):>5}  {np.mean(losses):.4f}{spread}"
                  f"{' *' if lr == best[model] else ''}")
    for line in edge_warnings(table, best):
        print(line)


def write_records(records, fields, path):
    """One CSV row a run."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fields, extrasaction='ignore', lineterminator='\n')
        writer.writeheader()
        writer.writerows(records)


def sweep(sources):
    """Every run's record (best_lr marked), the table by model and learning rate, and the best rates; printed."""
    merged = {}  # a later source's record of a run replaces an earlier one
    for source in sources:
        is_csv = source.endswith('.csv') and Path(source).is_file()
        found = csv_records(source) if is_csv else [run_record(folder) for folder in run_folders(source)]
        merged.update((run_key(r), r) for r in found)
    records = list(merged.values())
    table = by_model_and_lr(records)
    if not table:
        raise EvalError(f'no finished runs in {", ".join(sources)}: train them to the end first')
    best = best_learning_rates(table)
    for r in records:
        r['best_lr'] = int(best.get(r['model']) == r['learning_rate'] and r['iter_num'] >= r['max_iters'])
    print_sweep(records, table, best)
    return records, table, best


def run_sweep(cfg, sources):
    """The learning-rate tables, out.csv (every run) and out_best.txt (the run folders at each model's best
    learning rate, every seed, one a line)."""
    records, table, best = sweep(sources)
    write_records(records, SWEEP_FIELDS, f"{cfg['out']}.csv")
    with open(f"{cfg['out']}_best.txt", 'w') as f:
        f.writelines(f"{r['run']}\n" for r in records if r['best_lr'])
    print(f"wrote {cfg['out']}.csv, {cfg['out']}_best.txt")
    return records, best


def frontier_losses(records, cfg):
    """The loss so far at 2x and 8x the training context of each best-learning-rate run (the mean loss over
    positions 1..t of the long documents with at least t positions), set in its record. The documents are cut
    at 8x the context, which leaves those losses as they are. A record of a .csv keeps the losses it has: where
    its checkpoint is gone (an earlier machine's run), it has none."""
    documents = {}
    for r in records:
        if not r['best_lr'] or r.get('loss_so_far_8x') is not None:  # a record from a .csv has them
            continue
        if r['from_csv'] and not (Path(r['run']) / 'ckpt.pt').is_file():
            print(f"{r['run']}: no checkpoint here (a record of a .csv): its losses past the context left out")
            continue
        ckpt, path = open_checkpoint(r['run'], 'ckpt.pt')
        if ckpt['tokenizer'] not in documents:
            documents[ckpt['tokenizer']] = load_documents(cfg['data'], cfg['data_dir'], ckpt['tokenizer'], path)[0]
        last = 8 * r['block_size']
        docs = [doc[:last + 1] for doc in documents[ckpt['tokenizer']]]
        result = evaluate_positions(ckpt, path, docs, {**cfg, 'max_len': last})
        r['loss_so_far_2x'], r['loss_so_far_8x'] = loss_at(result, 2 * r['block_size']), loss_at(result, last)


def frontier_points(records):
    """{architecture: [point, ...]} ascending in FLOPs, a point a model at its best learning rate: the mean over
    its seeds of the forward FLOPs, the validation loss and the losses so far."""
    groups = {}
    for r in records:
        if r['best_lr']:
            groups.setdefault(r['model'], []).append(r)
    points = {}
    for members in groups.values():
        point = {key: members[0][key] for key in ('model', 'architecture', 'non_embedding_parameters',
                                                   'learning_rate', 'block_size')}
        for key in ('forward_flops', 'val_loss', 'loss_so_far_2x', 'loss_so_far_8x'):
            values = [m.get(key) for m in members]
            point[key] = None if None in values else float(np.mean(values))
        points.setdefault(point['architecture'], []).append(point)
    return {arch: sorted(ps, key=lambda p: p['forward_flops']) for arch, ps in sorted(points.items())}


def print_frontier(points):
    """Each architecture's best-learning-rate model of each size."""
    print('\nthe frontier: each model at its best learning rate (forward FLOPs of training = flops_per_token / 3 x '
          'tokens;\nloss so far at t: mean over positions 1..t of the long documents with at least t positions)')
    print(f'{"architecture":<22} {"parameters":>12} {"lr":>8} {"forward FLOPs":>14} {"val loss":>9} '
          f'{"so far 2x":>10} {"so far 8x":>10}')
    for arch, series in points.items():
        for p in series:
            so_far = ''.join(f' {p[k]:>10.4f}' if p[k] is not None else f' {"-":>10}'
                             for k in ('loss_so_far_2x', 'loss_so_far_8x'))
            print(f"{arch:<22} {p['non_embedding_parameters']:>12,} {p['learning_rate']:>8g} "
                  f"{p['forward_flops']:>14.3e} {p['val_loss']:>9.4f}{so_far}")


def plot_frontier(points, path):
    """Two panels against forward training FLOPs (log scale), a colour an architecture: the validation loss at the
    training context, and the loss so far at 2x (solid) and 8x (dashed) it. -> whether it wrote the plot."""
    plt = pyplot()
    if plt is None:
        return False
    fig, (at_context, beyond) = plt.subplots(1, 2, figsize=(14, 5.5))
    for colour, (arch, series) in enumerate(points.items()):
        flops = [p['forward_flops'] for p in series]
        kw = dict(color=f'C{colour % 10}', marker='o')
        at_context.plot(flops, [p['val_loss'] for p in series], label=arch, **kw)
        for p in series:
            at_context.annotate(f"{p['non_embedding_parameters'] / 1e6:.1f}M, lr {p['learning_rate']:g}",
                                (p['forward_flops'], p['val_loss']), textcoords='offset points', xytext=(4, 4),
                                fontsize=7, color=kw['color'])
        for key, style, factor in (('loss_so_far_2x', '-', 2), ('loss_so_far_8x', '--', 8)):
            shown = [(f, p[key]) for f, p in zip(flops, series) if p[key] is not None]
            if shown:
                beyond.plot(*zip(*shown), linestyle=style, label=f'{arch}, {factor}x the context', **kw)
    block = next(iter(points.values()))[0]['block_size']
    for ax, title, ylabel in (
            (at_context, f'validation loss at the training context ({block})', 'validation loss (nats/token)'),
            (beyond, f'loss so far at 2x ({2 * block}, solid) and 8x ({8 * block}, dashed) the context',
             'loss so far (nats/token)')):
        ax.set_xscale('log')
        ax.set(title=title, xlabel='forward FLOPs of training (flops_per_token / 3 x tokens)', ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(plt, fig, path)


def run_frontier(cfg, sources):
    """The learning-rate tables, the best-rate runs' losses beyond the context, the frontier table, out.csv (every
    run) and out.png."""
    records, _, _ = sweep(sources)
    frontier_losses(records, cfg)
    points = frontier_points(records)
    print_frontier(points)
    write_records(records, SWEEP_FIELDS + ('loss_so_far_2x', 'loss_so_far_8x'), f"{cfg['out']}.csv")
    plotted = bool(points) and plot_frontier(points, f"{cfg['out']}.png")
    print(f"wrote {cfg['out']}.csv{', .png' if plotted else ''}")
    return records, points


# ----------------------------------------------------------------------------- loss by position from eval.py's files

RUN_NAME = re.compile(r'-lr([0-9.e-]+)-s(\d+)$')  # reproduce.sh's run names: NAME-lrLR-sSEED


def positions_csv(path):
    """eval.py's loss-by-position .csv -> its checkpoints as in its .json, as far as the plots and gap use them (a
    checkpoint's learning rate and seed from its name, NAME-lrLR-sSEED as reproduce.sh names runs)."""
    results = {}
    with open(path, newline='') as f:
        for row in csv.DictReader(f):
            name = RUN_NAME.search(row['checkpoint'])
            if name is None or row['measure'] not in ('val', 'bucket', 'so_far'):
                raise EvalError(f"--runs={path}: not a .csv of eval.py's loss by position of reproduce.sh's runs "
                                f"(NAME-lrLR-sSEED): {row['checkpoint']}, {row['measure']}")
            r = results.setdefault(row['checkpoint'], {
                'checkpoint': row['checkpoint'], 'label': row['checkpoint'], 'model': row['model'], 'tokenizer': '',
                'iter_num': 0, 'train_config': {'learning_rate': float(name[1]), 'seed': int(name[2])},
                'buckets': [], 'loss_so_far': []})
            start, end, loss = int(row['start']), int(row['end']), float(row['loss'])
            if row['measure'] == 'val':
                r.update(block_size=end, val_loss=loss, model_config={'model': row['model'], 'block_size': end})
            elif row['measure'] == 'bucket':
                r['buckets'].append({'start': start, 'end': end + 1, 'loss': loss})
            else:
                r['loss_so_far'].append({'t': end, 'loss': loss})
    for checkpoint, r in results.items():
        if 'val_loss' not in r:
            raise EvalError(f"--runs={path}: not a whole .csv of eval.py's loss by position: {checkpoint} has no val "
                            f"row (its context)")
    return list(results.values())


def positions_file(path):
    """The checkpoints of eval.py's loss-by-position .json or .csv."""
    if path.endswith('.csv'):
        return positions_csv(path)
    try:
        with open(path) as f:
            return json.load(f)['checkpoints']
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EvalError(f"--runs={path}: not a .json of eval.py's loss by position ({type(e).__name__}): give "
                        f"the out.json or out.csv of `python eval.py --out_dir=... --out=out`") from None


def positions_by_checkpoint(sources):
    """The checkpoints of eval.py's loss-by-position .json or .csv files, {checkpoint: result}, each once: a
    checkpoint that two files hold is the later one's."""
    return {r['checkpoint']: r for path in sources for r in positions_file(path)}


def run_positions(cfg, sources):
    """eval.py's loss-by-position plot, out.png, redrawn from its .json or .csv files; a checkpoint that two files
    hold: the later one's."""
    results = positions_by_checkpoint(sources)
    if plot_positions(list(results.values()), f"{cfg['out']}.png"):
        print(f"wrote {cfg['out']}.png")
    return list(results.values())


TABLE_FIELDS = ('name', 'model', 'learning_rate', 'seeds', 'val_loss', 'val_min', 'val_max', 'block_size',
                'so_far_1x', 'so_far_8x', 'so_far_64x', 'so_far_seeds')


def run_name(run):
    """A run's name less its rate and seed: out-repro/extrapolation/fm-k16-lr1e-3-s2 -> fm-k16."""
    return RUN_NAME.sub('', Path(run).name)


def table_rows(sweeps, positions):
    """The README's table: each run name of the sweeps' records at its best rate (best_lr) -> its rate, seeds, the
    validation loss's mean, min and max, and the mean loss so far at 1x, 8x and 64x its context over those of its
    runs that positions holds ({checkpoint label: result})."""
    groups = {}
    for r in sweeps:
        if r['best_lr']:
            groups.setdefault(run_name(r['run']), []).append(r)
    rows = []
    for name, members in groups.items():
        losses = [m['val_loss'] for m in members]
        found = [positions[Path(m['run']).name] for m in members if Path(m['run']).name in positions]
        block = members[0]['block_size']
        so_far = {f'so_far_{f}x': float(np.mean([loss_at(r, f * block) for r in found]))
                  if found and all(loss_at(r, f * block) is not None for r in found) else None for f in (1, 8, 64)}
        rows.append({'name': name, 'model': members[0]['model'], 'learning_rate': members[0]['learning_rate'],
                     'seeds': len(members), 'val_loss': float(np.mean(losses)), 'val_min': min(losses),
                     'val_max': max(losses), 'block_size': block, **so_far, 'so_far_seeds': len(found)})
    return rows


def table_inputs(sources):
    """Sweep .csv files (told by their header) and loss-by-position .json/.csv files -> (the sweeps' records,
    {checkpoint label: result}), table_rows' arguments."""
    sweeps, positions = [], {}
    for source in sources:
        with open(source, newline='') as f:
            header = f.readline()
        if source.endswith('.csv') and header.startswith('run,model,'):
            sweeps += csv_records(source)
        else:
            positions.update((r['label'], r) for r in positions_file(source))
    return sweeps, positions


def run_table(cfg, sources):
    """The README's table from sweep .csv files (their best_lr marks) and loss-by-position .json/.csv files:
    printed, and out.csv."""
    rows = table_rows(*table_inputs(sources))
    if not rows:
        raise EvalError(f'no runs at a best learning rate in {", ".join(sources)}: give the .csv of a sweep')
    print(f'{"name":<20} {"lr":>8} {"val loss (min-max, seeds)":>30} {"so far @1x":>10} {"@8x":>7} {"@64x":>7}')
    for r in rows:
        val = f"{r['val_loss']:.4f} ({r['val_min']:.4f}-{r['val_max']:.4f}, {r['seeds']})"
        print(f"{r['name']:<20} {r['learning_rate']:>8g} {val:>30}" + ''.join(
            f' {r[k]:>{w}.3f}' if r[k] is not None else f' {"-":>{w}}'
            for k, w in (('so_far_1x', 10), ('so_far_8x', 7), ('so_far_64x', 7))))
    write_records(rows, TABLE_FIELDS, f"{cfg['out']}.csv")
    print(f"wrote {cfg['out']}.csv")
    return rows


# ----------------------------------------------------------------------------- the gap to a reference past the context

def mean_so_far(group):
    """A seed group's checkpoints -> {t: loss so far, mean over them} at each t that all of them have."""
    tables = [{row['t']: row['loss'] for row in result['loss_so_far']} for result in group]
    return {t: float(np.mean([table[t] for table in tables])) for t in sorted(set.intersection(*map(set, tables)))}


def gaps(results, reference):
    """eval.py's loss-by-position results -> (the reference's label, {model label: {t: its mean loss so far minus the
    reference's}}), the reference the one seed group whose model name holds that word."""
    means, names = {}, set()
    for group in seed_groups(results):
        first = group[0]
        name = f"{first['model']}, context {first['block_size']}, lr {first['train_config']['learning_rate']:g}"
        if name in names:
            raise EvalError(f'two groups of checkpoints are both {name} (trained with other settings or to another '
                            f'step): give --runs files that hold one of them')
        names.add(name)
        means[f'{name} (seeds: {len(group)})'] = mean_so_far(group)
    matches = [label for label in means if reference in label.split(',')[0].split()]
    if len(matches) != 1:
        raise EvalError(f"--reference={reference} names {len(matches)} of the models ({'; '.join(means)}): give a "
                        f"word of one model's name")
    base = means.pop(matches[0])
    return matches[0], {label: {t: loss - base[t] for t, loss in m.items() if t in base} for label, m in means.items()}


def plot_gaps(reference, table, contexts, path):
    """Each model's gap to the reference against t from 64 on (log scale; before, the gap swings by nats), the
    training contexts marked. -> whether it wrote the plot (False without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for label, gap in table.items():
        shown = {t: g for t, g in gap.items() if t >= 64}
        ax.plot(list(shown), list(shown.values()), marker='.', label=label)
    ax.axhline(0, color='black', linewidth=1)
    for block in contexts:
        ax.axvline(block, color='grey', linestyle=':', linewidth=1)
    ax.set_xscale('log', base=2)
    ax.set(title=f"loss so far minus {reference}'s, mean over seeds", xlabel='t (positions 1..t)',
           ylabel='gap (nats/token)')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(plt, fig, path)


def run_gap(cfg, sources):
    """The gaps at 1x, 8x, 64x and 512x the shortest training context, and out.png."""
    results = positions_by_checkpoint(sources)  # a checkpoint counts once
    reference, table = gaps(list(results.values()), cfg['reference'])
    contexts = sorted({r['block_size'] for r in results.values()})
    columns = [contexts[0] * 8 ** i for i in range(4)]
    width = max(map(len, table), default=0)
    print(f'loss so far minus that of {reference}')
    print(f"{'model, training context, lr (seeds)':<{width}}" + ''.join(f'{f"t = {t:,}":>12}' for t in columns))
    for label, gap in table.items():
        print(f'{label:<{width}}' + ''.join(f'{gap[t]:>+12.4f}' if t in gap else f"{'-':>12}" for t in columns))
    if plot_gaps(cfg['reference'], table, contexts, f"{cfg['out']}.png"):
        print(f"wrote {cfg['out']}.png")
    return table


# ------------------------------------------------------------------ multi-query associative recall

RECALL_SLICES = ((64, 4), (64, 8), (64, 16), (128, 32), (256, 64), (512, 128), (1024, 256))  # TEST
RECALL_TRAINED = 256  # the longest training length: the best rate is chosen on the slices up to it
RECALL_PANELS = {'64-256 tokens (mean of 5 slices)': (64, 256), '512 tokens, 128 pairs': (512, 512),
                 '1,024 tokens, 256 pairs': (1024, 1024),
                 "all 7 slices (Zoology's metric)": (64, 1024)}  # title -> the slices' seq_len range


def recall_rows(sources):
    """The rows of research/recall.py's .csv files (a row a run and test slice); a later file's row
    of the same run and slice wins."""
    rows = {}
    for source in sources:
        with open(source, newline='') as f:
            found = list(csv.DictReader(f))
        wanted = {'run', 'model', 'learning_rate', 'seed', 'seq_len', 'n_pairs', 'accuracy',
                  'state_bytes', 'step_bytes'}
        if not found or not wanted <= set(found[0]):
            raise EvalError(f'--runs={source}: not a .csv that research/recall.py wrote')
        for row in found:
            for key in ('seed', 'seq_len', 'n_pairs', 'state_bytes', 'step_bytes'):
                row[key] = int(row[key])
            row.update(learning_rate=float(row['learning_rate']), accuracy=float(row['accuracy']))
            rows[row['run'], row['seq_len'], row['n_pairs']] = row
    return list(rows.values())


def recall_rate_name(rows, model, lr):
    """The learning rate as the names of the model's runs at lr write it (1e-3 in NAME-lr1e-3-s1),
    else as %g."""
    for r in rows:
        name = RUN_NAME.search(r['run'])
        if r['model'] == model and r['learning_rate'] == lr and name:
            return name[1]
    return f'{lr:g}'


def recall_best(rows):
    """{model: (its best learning rate, the rates trained)}: the highest mean accuracy over the
    slices up to RECALL_TRAINED tokens of the model's first seed (its lowest, trained at every
    rate)."""
    best = {}
    for model in sorted({r['model'] for r in rows}):
        runs = [r for r in rows if r['model'] == model]
        first = min(r['seed'] for r in runs)
        scores = {}
        for r in runs:
            if r['seed'] == first and r['seq_len'] <= RECALL_TRAINED:
                scores.setdefault(r['learning_rate'], []).append(r['accuracy'])
        if scores:
            best[model] = (max(scores, key=lambda lr: np.mean(scores[lr])), sorted(scores))
    return best


def recall_mean(rows, run):
    """Zoology's metric of a run: its mean accuracy over the test slices (RECALL_SLICES), each
    slice alike (Zoology's test holds as many examples a slice); None unless it has them all."""
    found = {(r['seq_len'], r['n_pairs']): r['accuracy'] for r in rows if r['run'] == run}
    if not all(s in found for s in RECALL_SLICES):
        return None
    return float(np.mean([found[s] for s in RECALL_SLICES]))


def recall_table(rows, best):
    """Each model at its best rate -> {'model', 'learning_rate', 'seeds', (seq_len, n_pairs): the
    accuracies of its seeds, 'mean': Zoology's metric of each seed with every slice (recall_mean),
    'early': how many seeds stopped early of those that say (None: none says; an older .csv),
    'bytes': {(seq_len, n_pairs): (state bytes, step bytes)}}."""
    table = []
    for model, (lr, _) in best.items():
        runs = [r for r in rows if r['model'] == model and r['learning_rate'] == lr]
        entry = {'model': model, 'learning_rate': lr, 'seeds': sorted({r['seed'] for r in runs}),
                 'bytes': {}}
        for r in runs:
            entry.setdefault((r['seq_len'], r['n_pairs']), []).append(r['accuracy'])
            entry['bytes'][r['seq_len'], r['n_pairs']] = (r['state_bytes'], r['step_bytes'])
        names = sorted({r['run'] for r in runs})
        means = [recall_mean(runs, name) for name in names]
        entry['mean'] = [m for m in means if m is not None]
        stops = {r['run']: r.get('stopped') for r in runs if r.get('stopped')}
        entry['early'] = (sum(how == 'early' for how in stops.values()), len(stops)) if stops \
            else None
        table.append(entry)
    return table


def write_recall_table(table, path):
    """The table as a .csv: a row a model at its best rate, the mean over seeds of each slice and of
    Zoology's metric (mean), its seeds and how many stopped early, the bytes at the longest slice."""
    fields = ['model', 'learning_rate', 'seeds', *(f'{t}/{p}' for t, p in RECALL_SLICES), 'mean',
              'mean_seeds', 'stopped_early', 'state_bytes', 'step_bytes']
    with open(path, 'w', newline='') as f:
        writer = csv.writer(f, lineterminator='\n')
        writer.writerow(fields)
        for entry in table:
            cells = [round(float(np.mean(entry[s])), 4) if s in entry else '' for s in RECALL_SLICES]
            mean = round(float(np.mean(entry['mean'])), 4) if entry['mean'] else ''
            early = '' if entry['early'] is None else f"{entry['early'][0]}/{entry['early'][1]}"
            writer.writerow([entry['model'], f"{entry['learning_rate']:g}",
                             ' '.join(map(str, entry['seeds'])), *cells, mean, len(entry['mean']),
                             early, *entry['bytes'][max(entry['bytes'])]])


def print_recall(table, best):
    """The accuracy table (mean over seeds; min-max where several) and a warning for a best rate at
    an edge."""
    slices = [s for s in RECALL_SLICES if any(s in entry for entry in table)]
    print('accuracy at the answers, each model at its best rate (mean over seeds, min-max where '
          "several);\nmean: Zoology's metric, a run's mean over the 7 test slices (mean over the "
          'seeds with all 7); early: seeds stopped early\nbytes of a layer: its state, a step (at the '
          'longest slice)')
    print(f'{"model":<28} {"lr":>7} {"seeds":>5}' + ''.join(f'{f"{t}/{p}":>10}' for t, p in slices)
          + f'{"mean":>8} {"early":>5}{"state":>10} {"step":>9}')
    for entry in table:
        cells = ''.join(f'{np.mean(entry[s]):>10.3f}' if s in entry else f'{"-":>10}'
                        for s in slices)
        mean = f"{np.mean(entry['mean']):>8.3f}" if entry['mean'] else f'{"-":>8}'
        early = '-' if entry['early'] is None else f"{entry['early'][0]}/{entry['early'][1]}"
        state, step = entry['bytes'][max(entry['bytes'])]
        print(f"{entry['model']:<28} {entry['learning_rate']:>7g} {len(entry['seeds']):>5}{cells}"
              f"{mean} {early:>5}{state:>10,} {step:>9,}")
        ranges = [f'{t}/{p} {min(entry[t, p]):.3f}-{max(entry[t, p]):.3f}' for t, p in slices
                  if len(entry.get((t, p), ())) > 1]
        if ranges:
            print(f"{'':<28} seeds {entry['seeds']}: {', '.join(ranges)}")
    for model, (lr, rates) in best.items():
        if len(rates) > 1 and lr in (rates[0], rates[-1]):
            edge = 'lowest' if lr == rates[0] else 'highest'
            print(f"warning: {model}'s best rate {lr:g} is the {edge} of those trained "
                  f"({', '.join(f'{r:g}' for r in rates)}): train one beyond it")


def recall_family(model):
    """A model's series in the plots: its name less its size (-mM rows, -nN state):
    fm-block-m64-k8-d128 -> fm-block-k8-d128."""
    return re.sub(r'-[mn]\d+', '', model)


def recall_size(model):
    """The size in a model's name (m64: FM's rows, n16: Mamba-2's d_state), '' for none."""
    found = re.search(r'-([mn]\d+)', model)
    return found[1] if found else ''


def plot_recall(table, index, label, path):
    """Accuracy against bytes (index 0: the state's a layer, 1: a step's; log scale), a panel a
    length of RECALL_PANELS, a line a family of models, a point a size. -> whether it wrote it."""
    plt = pyplot()
    if plt is None:
        return False
    panels = len(RECALL_PANELS)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 5), sharey=True)
    families = sorted({recall_family(entry['model']) for entry in table})
    for ax, (title, (low, high)) in zip(axes, RECALL_PANELS.items()):
        for colour, family in enumerate(families):
            points = []
            for entry in table:
                slices = [s for s in RECALL_SLICES if low <= s[0] <= high and s in entry]
                if recall_family(entry['model']) == family and slices:
                    x = max(entry['bytes'][s][index] for s in slices)  # attention's grows
                    y = np.mean([np.mean(entry[s]) for s in slices])
                    points.append((x, y, recall_size(entry['model'])))
            if points:
                xs, ys, sizes = zip(*sorted(points))
                ax.plot(xs, ys, marker='o', color=f'C{colour % 10}', label=family)
                for x, y, size in points:  # which size a point is: k = 8 shares one x
                    ax.annotate(size, (x, y), xytext=(4, 2), textcoords='offset points', fontsize=6)
        ax.set_xscale('log', base=2)
        ax.set(title=title, xlabel=label, ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel('accuracy at the answers (best rate, mean over seeds)')
    axes[-1].legend(fontsize=7)
    return save_figure(plt, fig, path)


def run_recall(cfg, sources):
    """The accuracy table, out_best.txt (MODEL LR: each model's best rate, for reproduce.sh's
    seeds), out_state.png and out_step.png."""
    rows = recall_rows(sources)
    best = recall_best(rows)
    table = recall_table(rows, best)
    print_recall(table, best)
    with open(f"{cfg['out']}_best.txt", 'w') as f:
        for model, (lr, _) in best.items():
            f.write(f'{model} {recall_rate_name(rows, model, lr)}\n')
    write_recall_table(table, f"{cfg['out']}_table.csv")
    plotted = []
    for index, name, label in (
            (0, 'state', "bytes of a layer's state (init_state's buffers, one sequence)"),
            (1, 'step', 'bytes a decoding step reads and writes a layer (step_state_bytes)')):
        if plot_recall(table, index, label, f"{cfg['out']}_{name}.png"):
            plotted.append(f"{cfg['out']}_{name}.png")
    print(f"wrote {cfg['out']}_best.txt, {cfg['out']}_table.csv" + ''.join(f', {path}' for path in plotted))
    return table


# ----------------------------------------------------------------------------- routing from eval.py's .csv

ROUTING_COLUMNS = ('effective_rows', 'weight_effective_rows', 'busiest_row_theta')


def routing_groups(sources):
    """eval.py routing's .csv files -> {model (run name less -lrLR-sSEED, or its checkpoint): [layer rows]}, each
    row's ROUTING_COLUMNS as floats; a checkpoint two files hold: the later one's."""
    rows = {}
    for source in sources:
        if not (source.endswith('.csv') and Path(source).is_file()):
            raise EvalError(f'--runs={source}: not a .csv: give {RUNS["routing"]}')
        with open(source, newline='') as f:
            found = list(csv.DictReader(f))
        if not found or not {'checkpoint', 'layer', *ROUTING_COLUMNS} <= set(found[0]):
            raise EvalError(f'--runs={source}: not a .csv of eval.py routing: give {RUNS["routing"]}')
        rows.update(((row['checkpoint'], row['layer']), row) for row in found)
    groups = {}
    for (checkpoint, _), row in rows.items():
        groups.setdefault(run_name(checkpoint), []).append({k: float(row[k]) for k in ROUTING_COLUMNS})
    return groups


def run_routing(cfg, sources):
    """Each model's medians over its layers and seeds: effective rows by selection and by weight, the heaviest
    row's write rate and the tokens between its rewrites; out.png. -> {model: medians}."""
    groups = routing_groups(sources)
    summary = {name: {k: float(np.median([r[k] for r in rows])) for k in ROUTING_COLUMNS} | {'layers': len(rows)}
               for name, rows in groups.items()}
    print(f'{"model":<22} {"layers":>6} {"eff. rows by selection":>22} {"by weight":>10} {"heaviest row theta":>18} '
          f'{"rewritten every":>15}   (medians over layers and seeds)')
    for name, m in summary.items():
        print(f"{name:<22} {m['layers']:>6} {m['effective_rows']:>22.1f} {m['weight_effective_rows']:>10.1f} "
              f"{m['busiest_row_theta']:>18.3f} {1 / m['busiest_row_theta']:>9.1f} tokens")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for i, (name, rows) in enumerate(groups.items()):
            ax.plot([i] * len(rows), [r['weight_effective_rows'] for r in rows], 'o', alpha=0.5)
        ax.set_xticks(range(len(groups)), list(groups), rotation=30, ha='right', fontsize=8)
        ax.set(title='effective rows by weight, a point a layer and seed', ylabel='effective rows (of m)')
        ax.grid(alpha=0.3)
        if save_figure(plt, fig, f"{cfg['out']}.png"):
            print(f"wrote {cfg['out']}.png")
    return summary


# ----------------------------------------------------------------------------- command line

def main(argv=()):
    """python research/analysis.py sweep|frontier|scaling|table|positions|routing|gap --runs=... --key=value ... -> the
    subcommand's results (None for --help)."""
    argv = list(argv)
    if argv[:1] in (['-h'], ['--help']):
        print(__doc__)
        return None
    modes = {'scaling': SCALING_SETTINGS, 'sweep': SWEEP_SETTINGS, 'frontier': FRONTIER_SETTINGS,
             'table': TABLE_SETTINGS, 'positions': POSITIONS_SETTINGS, 'gap': GAP_SETTINGS,
             'routing': ROUTING_SETTINGS, 'recall': RECALL_SETTINGS}
    mode = take_subcommand(argv, modes, USAGE, {'harness': 'eval.py'})
    if '-h' in argv or '--help' in argv:
        print(__doc__ + f'\nsettings of {mode} (--key=value; --runs may repeat):\n' + help_text(modes[mode], __file__))
        return None
    sources, argv = take_all(argv, 'runs')
    cfg = load_config(modes[mode], argv, config_files=False, program='research/analysis.py')
    check_ranges(cfg)
    check_out(cfg['out'])
    runs = RUNS.get(mode, RUNS['sweep'])
    if not sources:
        raise ConfigError(f'--runs is missing: give {runs} (--runs may repeat)')
    for source in sources:
        if not os.path.exists(source):
            raise ConfigError(f'--runs={source} does not exist: give {runs}')
    if mode == 'scaling':
        return run_scaling(cfg, sources)
    if mode == 'sweep':
        return run_sweep(cfg, sources)
    if mode == 'table':
        return run_table(cfg, sources)
    if mode == 'positions':
        return run_positions(cfg, sources)
    if mode == 'gap':
        return run_gap(cfg, sources)
    if mode == 'recall':
        return run_recall(cfg, sources)
    if mode == 'routing':
        return run_routing(cfg, sources)
    check_device(cfg['device'], cfg['dtype'])
    return run_frontier(cfg, sources)


if __name__ == '__main__':
    run_main(main, CheckpointError, EvalError)
