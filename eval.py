"""
Evaluate models trained by train.py.

Loss by position on long documents (paper Figures 3-4): for each checkpoint, the mean next-token loss in position
buckets [2^i, 2^(i+1)) from the first token to the end of each document, and the "loss so far", the mean over
positions 1..t for t = 2^i (over the documents with at least t positions). Position p is the token predicted from
the p tokens before it, so a model trained at a context of T tokens has seen positions 1..T.
    python eval.py --out_dir=out-fm-small --out_dir=out-transformer-small    # the default corpus's long.bin
    python eval.py --out_dir=out-fm-small --data=books/ --out=results/books  # .txt files, one document each
Data (--data): '' is the default corpus's long split (its longest validation works, whole), a token file (.bin,
written by prepare_data.py with the checkpoint's tokenizer), or a .txt file or folder of them, tokenized with each
checkpoint's tokenizer. FM and Mamba-2 run a document in chunks of --chunk_len tokens, each continuing from the
state the last one left (bounded memory at any length); attention runs a document in one pass, up to --max_len
positions. Writes --out's .csv, .json and .png (the plot needs matplotlib).

lm-evaluation-harness (pip install lm-eval), one checkpoint, inputs cut to its training context:
    python eval.py harness --out_dir=out-fm-1b --tasks=hellaswag,mmlu,truthfulqa_mc2,winogrande
    HF_DATASETS_OFFLINE=1 python eval.py harness --out_dir=out-fm-small --tasks=my_task --include_path=my_tasks/
Writes --out's .json. In Python, harness_model_class() is the lm-eval model (registered as 'fm-checkpoint').

Routing of FM checkpoints (which memory rows the tokens use), per layer, on the long split or --data:
    python eval.py routing --out_dir=out-fm-small [--out_dir=...] [--out=results/routing]
Writes routing.json and routing.png (a heat map of row usage, layers x rows) in each out_dir, and with --out a .csv
and .png of all of them.

The small-scale reproduction's analyses (learning-rate sweep, loss frontier, memory scaling): research/analysis.py.
Each mode's settings: python eval.py --help, python eval.py harness --help, python eval.py routing --help.
"""
from configurator import ConfigError, help_text, load_config, quit_on_ctrl_c, quit_on_sigterm, run_main

if __name__ == '__main__':  # first: a signal while the imports load is one line
    quit_on_ctrl_c()

import copy
import csv
import difflib
import errno
import functools
import json
import math
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import model as model_file
from checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint, tokenizer_of
import run
from generate import Generator, Sampling
from prepare_data import DEFAULT_DATA_DIR, get_tokenizer, load_tokens, prepare, read_utf8, replacing

DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'
POSITION_SETTINGS = dict(
    ckpt='ckpt.pt',  # a file in each out_dir (best.pt: the best validation loss)
    data='',  # '': the default corpus's long.bin; or a token file (.bin), a .txt file or a folder of .txt files
    data_dir='',  # the folder prepare_data.py writes the default corpus into; '': the repository's data/
    max_len=16384,  # attention: the most positions of a document run in its one pass
    chunk_len=8192,  # fm, mamba2: tokens a chunk, each continuing from the state the last one left
    out='results/loss_by_position',  # writes out.csv, out.json, out.png
    device=DEVICE,  # 'cuda' (or 'cuda:N') where there is a GPU, else 'cpu'
    dtype='auto',  # 'auto': bfloat16 autocast on CUDA, float32 elsewhere; losses always from float32 logits
)
HARNESS_SETTINGS = dict(
    ckpt='ckpt.pt',  # a file in the out_dir (best.pt: the best validation loss)
    tasks='',  # lm-eval task names, comma-separated
    num_fewshot=None,  # None: each task's default
    limit=None,  # None: every example; N: the first N of each task
    include_path='',  # a folder of local task YAML files
    batch_size=32,  # requests scored or generated at once
    out='results/harness',  # writes out.json
    device=DEVICE,  # 'cuda' (or 'cuda:N') where there is a GPU, else 'cpu'
    dtype='auto',  # 'auto': bfloat16 autocast on CUDA, float32 elsewhere; log-likelihoods from float32 logits
)
ROUTING_SETTINGS = dict(
    ckpt='ckpt.pt',  # a file in each out_dir (best.pt: the best validation loss)
    data='',  # as for loss by position: '' is the default corpus's long split
    data_dir='',  # the folder prepare_data.py writes the default corpus into; '': the repository's data/
    tokens=65536,  # tokens measured, taken evenly from the starts of the documents
    chunk_len=8192,  # tokens a chunk, each continuing from the state the last one left
    out='',  # '': routing.json and routing.png in each out_dir; PREFIX: also PREFIX.csv and PREFIX.png for all
    device=DEVICE,  # 'cuda' (or 'cuda:N') where there is a GPU, else 'cpu'
    dtype='float32',  # autocast of the passes: 'float32' (none), 'bfloat16', 'float16' or 'auto' (bfloat16 on CUDA)
)
LOWEST = {  # numeric setting -> (the lowest value it takes, what it is), for the message refusing a lower one
    'max_len': (1, "positions of attention's one pass"),
    'chunk_len': (1, 'tokens a chunk'),
    'tokens': (2, 'tokens measured'),
    'batch_size': (1, 'requests a batch'),
    'limit': (1, 'examples of each task; None: every one'),
    'num_fewshot': (0, "examples in each prompt; None: each task's default"),
}
RUN_NAMING = ('seed', 'out_dir', 'init_from', 'overwrite', 'wandb_log', 'wandb_project', 'wandb_run_name',  # train.py
              'log_interval', 'data_dir', 'verify_data', 'compile', 'device')  # settings that leave the model as it is
USAGE = 'eval.py [routing|harness] --key=value ...; sweep, frontier, scaling and gap are in research/analysis.py'
ETA_BINS = 20  # the histogram of eta over [0, 1]
ROUTING_PLOT_MAX = 12  # checkpoints in the heat maps of --out.png
LOSS_SLICE = 1024  # positions whose logits are formed at once: (1024, V) float32 is 0.4 GB at a 100K vocabulary
OUT_ELSEWHERE = ', or pass --out=PREFIX in a folder on another disk'  # the fix of a full disk besides freeing space


class EvalError(RuntimeError):
    """A problem the user can fix (data, checkpoint, settings); the message says how."""


class Progress:
    """Prints work done and its rate: at the first update, then every second on a terminal, every 30 s in a log."""

    def __init__(self, label, total, unit='tokens'):
        self.label, self.total, self.unit, self.done = label, total, unit, 0
        self.start, self.last = time.time(), -math.inf
        self.interval, self.end = (1, '\r') if sys.stderr.isatty() else (30, '\n')

    def update(self, n):
        self.done += n
        if time.time() - self.last >= self.interval:
            self.print(self.end)

    def print(self, end='\n'):
        self.last = time.time()
        rate = self.done / max(self.last - self.start, 1e-9)
        print(f'{self.label}: {self.done:,}/{self.total:,} {self.unit}, {rate:,.0f} {self.unit}/s', end=end,
              file=sys.stderr, flush=True)


@contextmanager
def replacing_results(*paths, fix=''):
    """prepare_data.replacing(paths) (all renamed once all are written, or none), in a folder made if need be; a
    failed write is an EvalError naming the fix: free some space, or fix (e.g. OUT_ELSEWHERE)."""
    folder = Path(paths[0]).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with replacing(paths) as temporaries:
            yield temporaries
    except OSError as e:
        names = ', '.join([str(paths[0]), *(Path(path).suffix for path in paths[1:])])
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        reason, remedy = ((f'the disk is full ({shutil.disk_usage(folder).free / 1e6:,.1f} MB free in {folder})',
                           'free some space there') if full else (e.strerror or str(e), f'make {folder} writable'))
        kept = 'the earlier files are unchanged' if any(map(os.path.exists, paths)) else 'none was written'
        raise EvalError(f'could not write {names}: {reason}; {kept} and the results are in the output above: '
                        f'{remedy}{fix}, and run again') from None


# ----------------------------------------------------------------------------- checkpoints

def open_checkpoint(out_dir, ckpt_name):
    """Read out_dir/ckpt_name (memory-mapped) -> (checkpoint dict, path)."""
    path = os.path.join(out_dir, ckpt_name)
    return load_checkpoint(path), path


def describe(config):
    """A short name of a model config (a dict): '6x256 fm m=64 k=16 tau=1', '6x256 fm m=64 k=16 tau=1 conv4 gate'
    (the block's parts beside the paper's layer), '6x256 attn', '6x256 mamba2', '6x256 RowRatesFM m=64 ...' (a
    mixer of one's own, research.levers:RowRatesFM)."""
    name = f"{config['n_layer']}x{config['d_model']} {config['mixer'].rpartition(':')[2]}"  # module:Class: Class
    if model_file.mixer_family(config['mixer']) == 'fm':
        m, k = config['n_memory'], config['top_k'] or config['n_memory']
        name += f" m={m} {'dense' if k == m else f'k={k}'} tau={config['tau']:g}"
        name += f" conv{config['fm_conv']}" * bool(config.get('fm_conv')) + ' gate' * bool(config.get('fm_gate'))
    return name


def summary(ckpt, path, model):
    """What the results say about a checkpoint: where it is, its model, its training and validation loss."""
    label = os.path.basename(os.path.normpath(os.path.dirname(path))) or path
    if os.path.basename(path) != 'ckpt.pt':
        label += '/' + os.path.basename(path)
    return {'label': label, 'checkpoint': path, 'model': describe(ckpt['model_config']),
            'model_config': ckpt['model_config'], 'tokenizer': ckpt['tokenizer'],
            'train_config': ckpt['train_config'], 'parameters': model.num_params(non_embedding=False),
            'iter_num': ckpt['iter_num'],
            'tokens_seen': ckpt['data_state'].get('tokens_seen'), 'val_loss': ckpt['best_val_loss'],
            'block_size': ckpt['model_config']['block_size']}


def build_model(ckpt, path, device):
    """The checkpoint's model in float32 on device, in eval mode (autocast, if any, picks the compute dtype)."""
    return model_from_checkpoint(ckpt, path).float().eval().to(device)


def check_device(device, dtype):
    """ConfigError unless device is one this machine has (as train.py and sample.py check it) and dtype is one eval.py
    takes."""
    if dtype not in run.DTYPES:
        raise ConfigError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', not {dtype!r}")
    run.check_device(device)


def autocast(device, dtype):
    """The autocast context of the model's passes: 'auto' is bfloat16 on CUDA and none elsewhere."""
    dtype = run.resolve_dtype(dtype, device)
    return nullcontext() if dtype == 'float32' else torch.autocast(torch.device(device).type, getattr(torch, dtype))


# ----------------------------------------------------------------------------- loss by position

def token_losses(model, x, targets):  # x (T, d_model), targets (T,)
    """Next-token losses (T,) from logits in the weights' dtype (float32 or wider, never autocast), formed
    LOSS_SLICE positions at a time."""
    losses = []
    with torch.autocast(x.device.type, enabled=False):
        for start in range(0, len(x), LOSS_SLICE):
            logits = model.head(x[start:start + LOSS_SLICE].to(model.lm_head.weight.dtype))  # (slice, V)
            losses.append(F.cross_entropy(logits, targets[start:start + LOSS_SLICE], reduction='none'))
    return torch.cat(losses)


@torch.no_grad()
def document_losses(model, tokens, chunk_len, ctx=nullcontext(), progress=None):
    """Next-token losses of one document (tokens, 1-D) -> (n - 1,) float64, entry p - 1 the loss of token p given
    tokens[:p]. FM and Mamba-2 run chunks of chunk_len tokens, each continuing from the state the last one left;
    attention runs the whole document in one pass."""
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=model.embed.weight.device)  # (n,)
    inputs, targets = ids[:-1], ids[1:]
    step = len(inputs) if model.config.family == 'attn' else chunk_len
    losses, state = [], None
    for start in range(0, len(inputs), step):  # attention: one pass, so it never gets a state
        with ctx:
            x, state = model.hidden(inputs[None, start:start + step], state)  # x (1, chunk, d_model)
        losses.append(token_losses(model, x[0], targets[start:start + step]).double().cpu())
        if progress is not None:
            progress.update(x.shape[1])
    return torch.cat(losses).numpy()


def position_stats(doc_losses):
    """Per-document losses at positions 1..n-1 -> (buckets, loss so far), lists of dicts: a bucket's loss is the
    mean over positions [start, end) = [2^i, 2^(i+1)) of every document reaching start; the loss so far at
    t = 2^i is the mean over positions 1..t of the documents with at least t positions."""
    sums = [np.concatenate([[0.0], np.cumsum(losses, dtype=np.float64)]) for losses in doc_losses]  # [p]: 1..p
    longest = max(len(losses) for losses in doc_losses)
    buckets, so_far = [], []
    for i in range(longest.bit_length()):
        start, end = 2 ** i, 2 ** (i + 1)
        reaching = [s for s in sums if len(s) - 1 >= start]  # documents with a position start
        last = [min(end - 1, len(s) - 1) for s in reaching]  # the last position of each in the bucket
        positions = sum(stop - start + 1 for stop in last)
        total = sum(s[stop] - s[start - 1] for s, stop in zip(reaching, last))
        buckets.append({'start': start, 'end': end, 'loss': total / positions, 'positions': positions,
                        'documents': len(reaching)})
        so_far.append({'t': start, 'loss': sum(s[start] for s in reaching) / (start * len(reaching)),
                       'documents': len(reaching)})
    return buckets, so_far


def text_documents(path, tok):
    """A .txt file or the .txt files under a folder, one document each, tokenized as prepare_data.py does
    ([end-of-text] + tokens with a tiktoken encoding)."""
    files = sorted(path.rglob('*.txt')) if path.is_dir() else [path]
    if not files:
        raise EvalError(f'--data={path}: the folder holds no .txt files')
    prefix = [] if tok.eot is None else [tok.eot]
    try:
        return [np.array(prefix + tok.encode(read_utf8(file)), dtype=np.int64) for file in files]
    except ValueError as e:  # not UTF-8: refused, as prepare_data.py refuses it
        raise EvalError(str(e)) from None


def load_documents(data, data_dir, tokenizer, ckpt_path):
    """The documents (1-D token arrays) of --data for a checkpoint of this tokenizer, and a description."""
    if not data:  # the default corpus's long split, prepared once; data_dir '': the repository's data/
        try:
            folder = prepare(dataset='default', tokenizer=tokenizer, data_dir=data_dir or DEFAULT_DATA_DIR)
        except (ValueError, RuntimeError) as e:  # a data_dir that is a file, a full disk
            raise EvalError(str(e)) from None
        data = str(folder / 'long.bin')
    path = Path(data)
    if path.suffix == '.bin':
        try:
            token_file = load_tokens(path, verify=True)
        except (ValueError, FileNotFoundError) as e:
            other_data = '; or give --data a .txt file or a folder of them, or leave it out (the default corpus)'
            raise EvalError(str(e) + other_data * isinstance(e, FileNotFoundError)) from None
        if token_file.tokenizer != tokenizer:
            raise EvalError(f'{path} holds tokens of {token_file.tokenizer!r}, but {ckpt_path} was trained with '
                            f'{tokenizer!r}: give data tokenized with {tokenizer!r} (python prepare_data.py '
                            f'--tokenizer {tokenizer} ...), or text (--data=FILE.txt or a folder of .txt files), '
                            f'which is tokenized for each checkpoint')
        docs = [token_file.document(i) for i in range(len(token_file.doc_offsets))]
    elif path.is_dir() or (path.is_file() and path.suffix == '.txt'):
        docs = text_documents(path, get_tokenizer(tokenizer))
    else:
        raise EvalError(f'--data={data}: not a token file (.bin), a .txt file or a folder of them')
    docs = [doc for doc in docs if len(doc) >= 2]  # a document of one token predicts nothing
    if not docs:
        raise EvalError(f'--data={data}: no document of two tokens or more')
    return docs, f'{data} ({len(docs)} documents, {sum(map(len, docs)):,} tokens of {tokenizer})'


def evaluate_positions(ckpt, path, docs, cfg):
    """Loss by position of one checkpoint on docs -> its summary with 'buckets', 'loss_so_far' and
    'max_positions' (attention's cut at --max_len positions; None: every document whole)."""
    model = build_model(ckpt, path, cfg['device'])
    result = summary(ckpt, path, model)
    cut = model.config.family == 'attn' and max(map(len, docs)) - 1 > cfg['max_len']
    if cut:
        print(f'{result["label"]}: attention runs each document in one pass, here the first {cfg["max_len"]:,} '
              f'positions (--max_len); the positions after them are left out')
        docs = [doc[:cfg['max_len'] + 1] for doc in docs]
    progress = Progress(f'{result["label"]} ({result["model"]})', sum(len(doc) - 1 for doc in docs))
    try:
        losses = [document_losses(model, doc, cfg['chunk_len'], autocast(cfg['device'], cfg['dtype']), progress)
                  for doc in docs]
    except torch.OutOfMemoryError:
        raise EvalError(f'{path}: out of memory on {cfg["device"]}: lower --max_len (attention) or --chunk_len '
                        f'(fm, mamba2)') from None
    progress.print()
    buckets, so_far = position_stats(losses)
    if cut:  # only what the cut leaves whole: the same positions of the same documents as without a cut
        buckets = [b for b in buckets if b['end'] - 1 <= cfg['max_len']]
        so_far = [s for s in so_far if s['t'] <= cfg['max_len']]
    result.update(buckets=buckets, loss_so_far=so_far, max_positions=cfg['max_len'] if cut else None)
    return result


def seed_groups(results):
    """Checkpoints of runs that differ in their seed alone (the settings that name, log or place a run aside), at the
    same step -> list of lists."""
    groups = {}
    for result in results:
        settings = {k: v for k, v in result['train_config'].items() if k not in RUN_NAMING}
        key = json.dumps([result['model_config'], result['tokenizer'], result['iter_num'], settings], sort_keys=True)
        groups.setdefault(key, []).append(result)
    return list(groups.values())


def loss_at(result, t):
    """The loss so far at t, or None where the checkpoint has none."""
    return next((row['loss'] for row in result['loss_so_far'] if row['t'] == t), None)


def group_summary(members):
    """Mean, min and max over a group's checkpoints: validation loss and loss so far at 1, 8 and 64 times the
    training context."""
    block = members[0]['block_size']
    columns = {'val loss': [m['val_loss'] for m in members]}
    for factor in (1, 8, 64):
        columns[f'so far @{factor * block}'] = [loss_at(m, factor * block) for m in members]
    stats = {name: {'mean': float(np.mean(values)), 'min': min(values), 'max': max(values)}
             for name, values in columns.items() if None not in values and math.isfinite(sum(values))}
    return {'model': members[0]['model'], 'checkpoints': [m['label'] for m in members], **stats}


def print_positions(results, data_description):
    """The tables: checkpoints, loss by bucket, loss so far, and the spread over seeds of one model."""
    print(f'\ndata: {data_description}')
    for i, r in enumerate(results, 1):
        tokens = f"{r['tokens_seen']:,} tokens" if r['tokens_seen'] else f"{r['iter_num']} steps"
        stop = f", positions up to {r['max_positions']:,}" if r['max_positions'] else ''
        print(f"[{i}] {r['label']}: {r['model']}, {r['parameters']:,} parameters, {tokens}, trained at "
              f"{r['block_size']}, val loss {r['val_loss']:.4f}{stop}")
    heads = ''.join(f'{f"[{i}]":>8}' for i in range(1, len(results) + 1))
    rows = max(len(r['buckets']) for r in results)
    print(f'\nloss by position (nats/token), mean over the positions of each bucket\n{"positions":>16}{heads}')
    for i in range(rows):
        losses = [r['buckets'][i]['loss'] if i < len(r['buckets']) else None for r in results]
        name = f'{2 ** i}-{2 ** (i + 1) - 1}'
        print(f'{name:>16}' + ''.join(f'{x:8.3f}' if x is not None else f'{"-":>8}' for x in losses))
    trained = {r['block_size'] for r in results}
    print(f'\nloss so far (nats/token), mean over positions 1..t\n{"t":>16}{heads}')
    for i in range(rows):
        t = 2 ** i
        name = f'{t} (trained)' if t in trained else str(t)
        print(f'{name:>16}' + ''.join(f'{x:8.3f}' if x is not None else f'{"-":>8}'
                                      for x in (loss_at(r, t) for r in results)))
    groups = [group_summary(members) for members in seed_groups(results) if len(members) > 1]
    if groups:
        print('\nover checkpoints of one model (seeds): mean (min-max)')
        for g in groups:
            stats = ', '.join(f"{name} {s['mean']:.4f} ({s['min']:.4f}-{s['max']:.4f})" for name, s in g.items()
                              if isinstance(s, dict))
            print(f"{g['model']} x{len(g['checkpoints'])}: {stats}")
    return groups


def write_positions(results, groups, settings, json_path, csv_path):
    """The .json (everything) and .csv (one row a checkpoint and measure: bucket, so_far, val)."""
    with open(json_path, 'w') as f:
        json.dump({'settings': settings, 'checkpoints': results, 'seed_groups': groups}, f, indent=1)
    with open(csv_path, 'w', newline='') as f:
        writer = csv.writer(f, lineterminator='\n')
        writer.writerow(['checkpoint', 'model', 'measure', 'start', 'end', 'loss', 'positions', 'documents'])
        for r in results:
            writer.writerow([r['label'], r['model'], 'val', 1, r['block_size'], r['val_loss'], '', ''])
            for b in r['buckets']:
                writer.writerow([r['label'], r['model'], 'bucket', b['start'], b['end'] - 1, b['loss'],
                                 b['positions'], b['documents']])
            for s in r['loss_so_far']:
                writer.writerow([r['label'], r['model'], 'so_far', 1, s['t'], s['loss'], s['t'] * s['documents'],
                                 s['documents']])


def pyplot():
    """matplotlib.pyplot without a display, or None (with a note) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print('no plot: matplotlib is not installed (pip install matplotlib)')
        return None
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


def save_figure(plt, fig, path):
    """Lay out, write and close a figure -> True (what the plot functions return when they wrote one)."""
    fig.tight_layout()
    fig.savefig(path, dpi=120, format='png')  # path may be a temporary file's, without .png
    plt.close(fig)
    return True


def plot_positions(results, path):
    """Loss by bucket and loss so far against the position (log scale), a line a checkpoint (a colour a model,
    a line style a seed), the training contexts marked. -> whether it wrote the plot (False without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return False
    fig, (by_bucket, so_far) = plt.subplots(1, 2, figsize=(14, 5.5))
    for colour, members in enumerate(seed_groups(results)):
        for style, r in zip(('-', '--', ':', '-.') * len(members), members):
            kw = dict(color=f'C{colour % 10}', linestyle=style, marker='.', linewidth=1.2)
            by_bucket.plot([b['start'] for b in r['buckets']], [b['loss'] for b in r['buckets']], **kw)
            so_far.plot([s['t'] for s in r['loss_so_far']], [s['loss'] for s in r['loss_so_far']],
                        label=f"{r['model']} ({r['label']})", **kw)
    for ax, title, xlabel in ((by_bucket, 'loss by position: mean over positions [p, 2p)', 'position p'),
                              (so_far, 'loss so far: mean over positions 1..t', 't')):
        for block in sorted({r['block_size'] for r in results}):
            ax.axvline(block, color='grey', linestyle=':', linewidth=1)
            ax.annotate(f'training context {block}', (block, 1), xycoords=('data', 'axes fraction'), rotation=90,
                        va='top', ha='right', fontsize=7, color='grey')
        ax.set_xscale('log', base=2)
        ax.set(title=title, xlabel=xlabel, ylabel='loss (nats/token)')
        ax.grid(alpha=0.3)
    so_far.legend(fontsize=6)
    return save_figure(plt, fig, path)


def run_positions(cfg, out_dirs):
    """Loss by position of every checkpoint: tables, out.csv, out.json, out.png."""
    checkpoints = [open_checkpoint(out_dir, cfg['ckpt']) for out_dir in out_dirs]
    documents = {}  # tokenizer -> (docs, description); every checkpoint's data is checked before any evaluation
    for ckpt, path in checkpoints:
        tokenizer_of(ckpt, path)
        if ckpt['tokenizer'] not in documents:
            documents[ckpt['tokenizer']] = load_documents(cfg['data'], cfg['data_dir'], ckpt['tokenizer'], path)
    if len(documents) > 1:
        print(f"warning: the checkpoints use the tokenizers {' and '.join(documents)}: their losses (nats a token) do "
              f"not compare across tokenizers; compare those of one tokenizer", file=sys.stderr)
    results = [evaluate_positions(ckpt, path, documents[ckpt['tokenizer']][0], cfg) for ckpt, path in checkpoints]
    groups = print_positions(results, '; '.join(description for _, description in documents.values()))
    with replacing_results(*(f"{cfg['out']}{suffix}" for suffix in ('.json', '.csv', '.png')), fix=OUT_ELSEWHERE) as (
            json_file, csv_file, png_file):
        write_positions(results, groups, cfg, json_file, csv_file)
        plotted = plot_positions(results, png_file)
    print(f"wrote {cfg['out']}.csv, .json{', .png' if plotted else ''}")
    return results


# ----------------------------------------------------------------------------- lm-evaluation-harness

def rolling_windows(tokens, prefix, max_len):
    """A text's tokens -> (context, continuation) id pairs that score every token once, as lm-eval's rolling
    log-likelihood does: after the prefix token, windows of max_len predictions, each with a full input of
    max_len tokens where the text has them."""
    sequence = [prefix] + list(tokens)
    pairs = []
    for start in range(1, len(sequence), max_len):
        end = min(start + max_len, len(sequence))
        pairs.append((sequence[max(0, end - 1 - max_len):start], sequence[start:end]))
    return pairs


def cut_at_stop(text, stops):
    """text up to the first occurrence of any stop string."""
    return text[:min([text.find(s) for s in stops if s and s in text], default=len(text))]


class Scorer:
    """What lm-evaluation-harness asks of a model, in plain code (the adapter in harness_model_class is a thin layer
    over it): log-likelihoods of continuations and of whole texts, batched, and generation through the model's
    Generator. Inputs are cut to the last block_size tokens (the training context); an empty context is the
    prefix token: end-of-text, or a newline for the byte tokenizer, which has none."""

    def __init__(self, model, tok, batch_size=32, ctx=nullcontext()):
        self.model, self.tok, self.batch_size, self.ctx = model, tok, batch_size, ctx
        self.max_len = model.config.block_size
        self.device = model.embed.weight.device
        self.prefix = tok.eot if tok.eot is not None else tok.encode('\n')[0]

    def encode_pair(self, context, continuation):
        """-> (context ids, continuation ids), split as lm-eval splits them for causal models: the context's
        trailing whitespace moves to the continuation, whose ids are those of the whole text after the context's."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:  # no context, or only whitespace: the continuation follows the end-of-text or newline prefix
            return [self.prefix], self.tok.encode(continuation)
        context_ids = self.tok.encode(context)
        return context_ids, self.tok.encode(context + continuation)[len(context_ids):]

    def loglikelihood(self, requests):
        """(context, continuation) strings -> (log-probability of the continuation, whether greedy decoding
        gives it) each."""
        return self.loglikelihood_tokens([self.encode_pair(*request) for request in requests])

    def loglikelihood_rolling(self, texts):
        """Texts -> the log-probability of each, whole, after the prefix token (windows of the training context)."""
        windows = [(i, pair) for i, text in enumerate(texts)
                   for pair in rolling_windows(self.tok.encode(text), self.prefix, self.max_len)]
        totals = [0.0] * len(texts)
        for (i, _), (logprob, _) in zip(windows, self.loglikelihood_tokens([pair for _, pair in windows])):
            totals[i] += logprob
        return totals

    def loglikelihood_tokens(self, pairs):
        """(context ids, continuation ids) pairs -> (sum of the continuation's log-probabilities, whether each of
        its tokens is the most likely one) each; batches of batch_size, longest first."""
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        scores = [None] * len(pairs)
        progress = Progress('log-likelihoods', len(pairs), 'requests')
        for first in range(0, len(order), self.batch_size):
            batch = order[first:first + self.batch_size]
            for i, score in zip(batch, self.score_batch([pairs[i] for i in batch])):
                scores[i] = score
            progress.update(len(batch))
        return scores

    @torch.no_grad()
    def score_batch(self, pairs):
        """One batch of loglikelihood_tokens: the inputs right-padded into one pass (every mixer is causal, so
        padding after a row changes none of its scores); logits only at the continuations, in float32."""
        inputs = []
        for context, continuation in pairs:
            if not context or len(continuation) > self.max_len:
                raise ValueError(f'a request needs a context and a continuation of at most {self.max_len} tokens '
                                 f'(the training context), not {len(context)} and {len(continuation)}')
            inputs.append((context + continuation)[:-1][-self.max_len:])
        width = max(map(len, inputs))
        idx = torch.tensor([row + [0] * (width - len(row)) for row in inputs], device=self.device)  # (B, width)
        with self.ctx:
            x, _ = self.model.hidden(idx)  # (B, width, d_model)
        rows = torch.cat([torch.full((len(c),), b) for b, (_, c) in enumerate(pairs)]).to(self.device)  # (N,)
        cols = torch.cat([torch.arange(len(row) - len(c), len(row)) for row, (_, c) in zip(inputs, pairs)])
        targets = torch.tensor([t for _, c in pairs for t in c], device=self.device)  # (N,)
        with torch.autocast(self.device.type, enabled=False):
            logits = self.model.head(x[rows, cols.to(self.device)].to(self.model.lm_head.weight.dtype))  # (N, V)
        logprobs = -F.cross_entropy(logits, targets, reduction='none').double().cpu()  # (N,)
        greedy = (logits[:, :self.tok.vocab_size].argmax(-1) == targets).cpu()  # (N,)
        lengths = [len(c) for _, c in pairs]
        return [(lp.sum().item(), bool(g.all())) for lp, g in zip(logprobs.split(lengths), greedy.split(lengths))]

    def generation_settings(self, gen_kwargs):
        """lm-eval's generation arguments -> (stop strings, max new tokens, Sampling); greedy unless do_sample."""
        kwargs = dict(gen_kwargs)
        stops = kwargs.pop('until', [])
        stops = [stops] if isinstance(stops, str) else list(stops)
        max_new_tokens = kwargs.pop('max_gen_toks', 256)
        temperature = kwargs.pop('temperature', 1.0)
        sampling = Sampling(temperature if kwargs.pop('do_sample', False) else 0.0, kwargs.pop('top_k', None),
                            kwargs.pop('top_p', 1.0), n_tokens=self.tok.vocab_size)
        if kwargs:
            raise ValueError(f'generation arguments this model does not take: {", ".join(sorted(kwargs))} (it takes '
                             f'until, max_gen_toks, do_sample, temperature, top_k, top_p)')
        return stops, max_new_tokens, sampling

    def generate_until(self, requests):
        """(context, generation arguments) -> the text generated after each context, cut at the first stop
        string; requests with the same arguments are generated in batches of batch_size."""
        groups = {}
        for i, (_, gen_kwargs) in enumerate(requests):
            groups.setdefault(json.dumps(gen_kwargs, sort_keys=True), []).append(i)
        texts = [None] * len(requests)
        progress = Progress('generations', len(requests), 'requests')
        for indices in groups.values():
            stops, max_new_tokens, sampling = self.generation_settings(requests[indices[0]][1])
            generator = Generator(self.model, sampling, eot=self.tok.eot)
            prompts = {i: (self.tok.encode(requests[i][0]) or [self.prefix])[-self.max_len:] for i in indices}
            indices.sort(key=lambda i: -len(prompts[i]))
            for first in range(0, len(indices), self.batch_size):
                batch = indices[first:first + self.batch_size]
                new = generator.generate([prompts[i] for i in batch], max_new_tokens)
                for i, ids in zip(batch, new):
                    texts[i] = cut_at_stop(self.tok.decode(ids), stops)
                progress.update(len(batch))
        return texts


@functools.cache
def harness_model_class():
    """The lm-eval model class of this project's checkpoints, registered as 'fm-checkpoint' (needs lm-eval)."""
    try:
        from lm_eval.api.model import LM
        from lm_eval.api.registry import register_model
    except ImportError:
        raise EvalError('the harness needs lm-evaluation-harness: pip install lm-eval') from None

    @register_model('fm-checkpoint')
    class CheckpointLM(LM):
        """A checkpoint of train.py for lm-eval: model_args out_dir, ckpt, batch_size, device, dtype."""

        def __init__(self, out_dir='out', ckpt='ckpt.pt', batch_size=32, device=DEVICE, dtype='auto'):
            super().__init__()
            check_device(device, dtype)
            checkpoint, path = open_checkpoint(out_dir, ckpt)
            tok = tokenizer_of(checkpoint, path)
            self.scorer = Scorer(build_model(checkpoint, path, device), tok, int(batch_size), autocast(device, dtype))
            self.summary = summary(checkpoint, path, self.scorer.model)

        def loglikelihood(self, requests, disable_tqdm=False):
            return self.scorer.loglikelihood([request.args for request in requests])

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            return self.scorer.loglikelihood_rolling([request.args[0] for request in requests])

        def generate_until(self, requests, disable_tqdm=False):
            return self.scorer.generate_until([request.args for request in requests])

    return CheckpointLM


def run_harness(cfg, out_dir):
    """lm-eval's tasks on one checkpoint: its results table, and out.json."""
    tasks = [task for task in cfg['tasks'].split(',') if task]
    if not tasks:
        raise ConfigError('name the tasks: --tasks=hellaswag,winogrande (lm-eval task names, comma-separated)')
    lm = harness_model_class()(out_dir, cfg['ckpt'], cfg['batch_size'], cfg['device'], cfg['dtype'])
    import lm_eval
    from lm_eval.tasks import TaskManager
    task_manager = TaskManager(include_path=cfg['include_path'] or None)
    unknown = [task for task in tasks if task not in task_manager.all_tasks]
    if unknown:
        raise ConfigError(f'unknown lm-eval tasks: {", ".join(unknown)} (lm-eval lists its tasks with `lm_eval ls '
                          f'tasks`; local YAML tasks need --include_path=FOLDER)')
    results = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=cfg['num_fewshot'], limit=cfg['limit'],
                                      task_manager=task_manager, log_samples=False)
    print(lm_eval.utils.make_table(results))
    if results.get('groups'):  # e.g. mmlu: its subjects above, the group's mean here
        print(lm_eval.utils.make_table(results, 'groups'))
    with replacing_results(f"{cfg['out']}.json", fix=OUT_ELSEWHERE) as (json_file,), open(json_file, 'w') as f:
        json.dump({'checkpoint': lm.summary, 'settings': cfg, 'results': results['results'],
                   'groups': results.get('groups'), 'n-shot': results.get('n-shot'),
                   'versions': results.get('versions')}, f, indent=1, default=str)
    print(f"wrote {cfg['out']}.json")
    return results


# ----------------------------------------------------------------------------- routing

class RoutingStats:
    """Running sums, over tokens, of what one FM layer's router does (see summary)."""

    def __init__(self, n_memory, top_k, d_model):
        self.m, self.k, self.tokens = n_memory, top_k, 0
        self.usage = torch.zeros(n_memory, dtype=torch.float64)  # selections (sparse) or alpha (dense), summed
        self.weight = torch.zeros(n_memory, dtype=torch.float64)  # alpha renormalised over the k rows, summed
        self.theta = torch.zeros(n_memory, dtype=torch.float64)  # write rates theta = eta alpha, summed
        self.entropy = 0.0  # of the full softmax, summed
        self.etas, self.mu = [], 0.0  # eta of every token; mu summed
        self.logit_sum = torch.zeros(n_memory, dtype=torch.float64)  # logits centred over the rows, summed
        self.logit_energy = 0.0  # their squares, summed
        self.input_sum = torch.zeros(d_model, dtype=torch.float64)  # the router's input, summed
        self.input_energy = 0.0

    @torch.no_grad()
    def add(self, mixer, x):
        """Add the tokens of x (..., d_model), the layer's input (after its norm)."""
        x = x.flatten(0, -2).double()  # (N, d_model)
        idx, alpha, eta, mu = mixer.route(x)
        dense = copy.copy(mixer)  # the same router keeping every row: its alpha is the full softmax
        dense.top_k = mixer.n_memory
        probs = dense.route(x)[1]  # (N, M)
        logits = probs.clamp_min(1e-300).log()  # W_alpha x / tau, less a constant a token (centred below)
        weight, theta = ((w if idx is None else torch.zeros_like(probs).scatter_(-1, idx, w))  # (N, M)
                         for w in (alpha, eta * alpha))  # eta: a token's (N, 1), or a rate a selected row (N, K)
        self.usage += (probs if idx is None else (weight > 0).double()).sum(0).cpu()
        self.weight += weight.sum(0).cpu()
        self.theta += theta.sum(0).cpu()
        self.entropy += float(-(probs * probs.clamp_min(1e-300).log()).sum())
        self.etas.append(eta.flatten().float().cpu())
        self.mu += float(mu.sum())
        centred = logits - logits.mean(-1, keepdim=True)
        self.logit_sum += centred.sum(0).cpu()
        self.logit_energy += float(centred.pow(2).sum())
        self.input_sum += x.sum(0).cpu()
        self.input_energy += float(x.pow(2).sum())
        self.tokens += len(x)

    def summary(self):
        """The layer's record for routing.json."""
        n, m = self.tokens, self.m
        usage = self.usage / n  # sums to k (sparse) or 1 (dense)
        fair = (self.k if self.k < m else 1) / m
        shares, weight = usage / usage.sum(), self.weight / n  # weight: each row's mean alpha, summing to 1
        etas = torch.cat(self.etas)
        return {'usage': usage.tolist(),
                'weight_usage': weight.tolist(),
                'weight_effective_rows': effective(weight),
                'busiest_row_theta': float(self.theta[weight.argmax()] / n),
                'dead_rows': int((usage < 1 / (10 * m)).sum()),
                'rare_rows': int((usage < fair / 10).sum()),
                'busiest_row': float(usage.max()),
                'effective_rows': effective(shares),
                'entropy': self.entropy / n, 'entropy_uniform': math.log(m),
                'eta_mean': float(etas.mean()), 'mu_mean': self.mu / n,
                'eta_quantiles': dict(zip(('0.1', '0.5', '0.9'),
                                          etas.quantile(torch.tensor([0.1, 0.5, 0.9])).tolist())),
                'eta_histogram': (torch.histc(etas, ETA_BINS, 0, 1) / n).tolist(),
                'logit_bias_share': float((self.logit_sum / n).pow(2).sum() / (self.logit_energy / n)),
                'input_mean_share': float((self.input_sum / n).pow(2).sum() / (self.input_energy / n))}


def effective(shares):
    """The effective number of rows of shares summing to 1: exp of their entropy."""
    return float(torch.exp(-(shares * shares.clamp_min(1e-300).log()).sum()))


def routing_tokens(docs, n_tokens):
    """About n_tokens tokens, the same number from the start of each document (all of the shorter ones)."""
    per_doc = max(2, n_tokens // len(docs))
    return [doc[:per_doc] for doc in docs]


@torch.no_grad()
def measure_routing(model, docs, cfg, progress):
    """Run the documents through the model in chunks, carrying the state -> one RoutingStats a FM layer."""
    mixers = [block.mixer for block in model.blocks]
    c = model.config
    stats = [RoutingStats(c.n_memory, c.top_k, c.d_model) for _ in mixers]
    hooks = [mixer.register_forward_hook(lambda mixer, args, out, s=s: s.add(mixer, args[0]))
             for mixer, s in zip(mixers, stats)]
    ctx = autocast(cfg['device'], cfg['dtype'])
    try:
        for doc in docs:
            ids = torch.as_tensor(np.asarray(doc, dtype=np.int64), device=model.embed.weight.device)
            state = None
            for start in range(0, len(ids), cfg['chunk_len']):
                with ctx:
                    x, state = model.hidden(ids[None, start:start + cfg['chunk_len']], state)  # x (1, chunk, d_model)
                progress.update(x.shape[1])
    finally:
        for hook in hooks:
            hook.remove()
    return stats


def add_ablations(model, docs, cfg, layers, progress=None):
    """Set each layer's 'busiest_row_ablation': the increase of the mean loss on docs (nats a token) with the
    read-out of its row of the most weight zeroed (phi = 0 there; the row is still written)."""
    base = mean_loss(model, docs, cfg, progress)
    for block, layer in zip(model.blocks, layers):
        with read_out_zeroed(block.mixer, int(np.argmax(layer['weight_usage']))):
            layer['busiest_row_ablation'] = mean_loss(model, docs, cfg, progress) - base


def mean_loss(model, docs, cfg, progress=None):
    ctx = autocast(cfg['device'], cfg['dtype'])
    return float(np.concatenate([document_losses(model, doc, cfg['chunk_len'], ctx, progress) for doc in docs]).mean())


@contextmanager
def read_out_zeroed(mixer, row):
    """Within: the FM layer mixer reads nothing from memory row `row` (its phi zeroed in the scan it calls)."""
    scan = model_file.memory_scan

    def scan_without_row(xbar, idx, theta, phi, *args):
        if idx is None:  # dense: phi (..., M)
            return scan(xbar, idx, theta, phi.index_fill(-1, torch.tensor([row], device=phi.device), 0.0), *args)
        return scan(xbar, idx, theta, phi.masked_fill(idx == row, 0.0), *args)  # phi (..., K) of the rows idx

    def use(function):
        return lambda *args: setattr(model_file, 'memory_scan', function)

    hooks = [mixer.register_forward_pre_hook(use(scan_without_row)), mixer.register_forward_hook(use(scan))]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        model_file.memory_scan = scan


def print_routing(result):
    """One line a layer: by selection (dead and rare rows, effective rows, entropy, the busiest row), by weight
    (effective rows, the heaviest row's share, its write rate, the loss without its read-out), eta."""
    print(f"\n{result['label']}: {result['model']}, {result['tokens']:,} tokens; usage = share of tokens selecting a "
          f"row (dense: mean alpha); dead < 1/(10 m), rare < a tenth of the fair share; weight = mean renormalised "
          f"alpha; heaviest: the row of the most weight, its theta and the loss increase without its read-out")
    print(f"{'layer':>6}{'dead':>6}{'rare':>6}{'eff. rows':>10}{'entropy':>9}{'busiest':>9}{'by weight':>10}"
          f"{'heaviest':>9}{'theta':>7}{'ablation':>9}{'eta mean':>9}{'bias share':>11}{'input mean':>11}")
    for i, layer in enumerate(result['layers']):
        print(f"{i:>6}{layer['dead_rows']:>6}{layer['rare_rows']:>6}{layer['effective_rows']:>10.1f}"
              f"{layer['entropy']:>9.3f}{layer['busiest_row']:>9.3f}{layer['weight_effective_rows']:>10.1f}"
              f"{max(layer['weight_usage']):>9.3f}{layer['busiest_row_theta']:>7.3f}"
              f"{layer['busiest_row_ablation']:>9.4f}{layer['eta_mean']:>9.3f}{layer['logit_bias_share']:>11.3f}"
              f"{layer['input_mean_share']:>11.3f}")


def plot_routing(results, path):
    """A heat map a checkpoint: layers x rows (each layer's rows sorted by usage), usage over the fair share on a
    log scale. -> whether it wrote the plot (False without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return False
    from matplotlib.colors import LogNorm
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 0.9 + 0.45 * sum(len(r['layers']) for r in results)),
                             squeeze=False)
    for ax, r in zip(axes[:, 0], results):
        m, k = r['model_config']['n_memory'], r['model_config']['top_k'] or r['model_config']['n_memory']
        fair = (k if k < m else 1) / m
        usage = np.array([sorted(layer['usage'], reverse=True) for layer in r['layers']]) / fair
        image = ax.imshow(np.clip(usage, 1e-2, 1e2), aspect='auto', cmap='viridis', norm=LogNorm(1e-2, 1e2),
                          interpolation='nearest')
        ax.set(title=f"{r['label']}: {r['model']}", xlabel='memory rows, sorted by usage', ylabel='layer')
        ax.set_yticks(range(len(r['layers'])))
        fig.colorbar(image, ax=ax, label='usage / fair share', fraction=0.03)
    return save_figure(plt, fig, path)


def run_routing(cfg, out_dirs):
    """Routing of each FM checkpoint: a table, routing.json and routing.png in its out_dir (and at --out, a .csv
    and .png of all)."""
    checkpoints = [open_checkpoint(out_dir, cfg['ckpt']) for out_dir in out_dirs]
    for (ckpt, path), out_dir in zip(checkpoints, out_dirs):
        check_out(os.path.join(out_dir, 'routing'))  # routing.json goes there: refused now, not after the work
        if model_from_checkpoint(ckpt, path, 'meta').config.family != 'fm':  # CheckpointError: a mixer not here
            raise EvalError(f"{path} is a {ckpt['model_config']['mixer']} model: routing is measured on FM "
                            f"checkpoints only")
        tokenizer_of(ckpt, path)
    results, documents = [], {}  # tokenizer -> (docs, description)
    for (ckpt, path), out_dir in zip(checkpoints, out_dirs):
        if ckpt['tokenizer'] not in documents:
            docs, description = load_documents(cfg['data'], cfg['data_dir'], ckpt['tokenizer'], path)
            documents[ckpt['tokenizer']] = routing_tokens(docs, cfg['tokens']), description
        docs, description = documents[ckpt['tokenizer']]
        model = build_model(ckpt, path, cfg['device'])
        result = summary(ckpt, path, model)
        progress = Progress(f"{result['label']} routing", sum(map(len, docs)))  # to stderr, as loss by position's
        stats = measure_routing(model, docs, cfg, progress)
        progress.print()
        result.update(data=description, tokens=stats[0].tokens, layers=[s.summary() for s in stats])
        progress = Progress(f"{result['label']} ablations", (len(stats) + 1) * sum(len(doc) - 1 for doc in docs))
        add_ablations(model, docs, cfg, result['layers'], progress)
        progress.print()
        print_routing(result)
        with replacing_results(os.path.join(out_dir, 'routing.json'), os.path.join(out_dir, 'routing.png')) as (
                json_file, png_file):
            with open(json_file, 'w') as f:
                json.dump(result, f, indent=1)
            plotted = plot_routing([result], png_file)
        print(f"wrote {os.path.join(out_dir, 'routing.json')}{' and routing.png' if plotted else ''}")
        results.append(result)
    if cfg['out']:
        write_routing(results, cfg['out'])
    return results


def write_routing(results, out):
    """out.csv, a row a checkpoint and layer (usage as its sorted values), and out.png, every checkpoint's map."""
    fields = ('dead_rows', 'rare_rows', 'effective_rows', 'entropy', 'busiest_row', 'weight_effective_rows',
              'busiest_row_theta', 'busiest_row_ablation', 'eta_mean', 'mu_mean', 'logit_bias_share',
              'input_mean_share')
    shown = results[:ROUTING_PLOT_MAX]
    with replacing_results(f'{out}.csv', f'{out}.png', fix=OUT_ELSEWHERE) as (csv_file, png_file):
        with open(csv_file, 'w', newline='') as f:
            writer = csv.writer(f, lineterminator='\n')
            writer.writerow(['checkpoint', 'model', 'val_loss', 'layer', *fields])
            for r in results:
                for i, layer in enumerate(r['layers']):
                    writer.writerow([r['label'], r['model'], r['val_loss'], i, *(layer[k] for k in fields)])
        plotted = plot_routing(shown, png_file)
    note = f' (the first {len(shown)} of {len(results)} checkpoints; each out_dir has its own)' if len(shown) < len(
        results) else ''
    print(f"wrote {out}.csv{', .png' + note if plotted else ''}")


# ----------------------------------------------------------------------------- command line

def check_out(out):
    """Create the folder of --out (a path prefix) now: one that cannot be written is refused before, not after, the
    evaluation."""
    folder = Path(out).parent
    if not Path(out).name or out.endswith(os.sep):
        raise ConfigError(f'--out={out!r} is not a path prefix: give one such as results/run1 (writes results/run1.csv '
                          f'and so on)')
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        reason = 'it is a file' if folder.is_file() else e.strerror
        raise ConfigError(f'--out={out}: cannot write to {folder} ({reason}): give an --out in a folder you can '
                          f'write to') from None


def check_ranges(cfg):
    """ConfigError naming the first numeric setting of cfg (of LOWEST) below its lowest value."""
    for key, (lowest, meaning) in LOWEST.items():
        if cfg.get(key) is not None and cfg[key] < lowest:
            raise ConfigError(f'--{key}={cfg[key]} is out of range: set it to at least {lowest} ({meaning})')


def take_subcommand(argv, modes, usage, elsewhere, default=None):
    """Pop argv's subcommand (a first word that is neither --key=value nor a .py config file) -> one of modes, or
    default where there is none; ConfigError for a subcommand of another script (elsewhere: {name: script}) or an
    unknown word (with the closest name)."""
    word = argv.pop(0) if argv and not argv[0].startswith('-') and not argv[0].endswith('.py') else None
    if word is None:
        if default is None:
            raise ConfigError(f'name a subcommand ({usage})')
        return default
    if word in elsewhere:
        raise ConfigError(f'{word} is in {elsewhere[word]}: run python {elsewhere[word]} {word} --key=value ...')
    if word not in modes:
        close = difflib.get_close_matches(word, [*modes, *elsewhere], n=1)
        raise ConfigError(f"unknown subcommand '{word}'{f': did you mean {close[0]}?' if close else ''} ({usage})")
    return word


def take_all(argv, key):
    """Every --key=value of argv (a key that may repeat) -> (the values, the other arguments)."""
    flag = f'--{key}='
    return [a[len(flag):] for a in argv if a.startswith(flag)], [a for a in argv if not a.startswith(flag)]


def main(argv=()):
    """python eval.py [routing|harness] --key=value ... -> the subcommand's results (None for --help)."""
    argv = list(argv)
    modes = {'positions': POSITION_SETTINGS, 'harness': HARNESS_SETTINGS, 'routing': ROUTING_SETTINGS}
    moved = dict.fromkeys(('sweep', 'frontier', 'scaling', 'gap'), 'research/analysis.py')
    mode = take_subcommand(argv, modes, USAGE, moved, default='positions')
    settings = modes[mode]
    if '-h' in argv or '--help' in argv:
        print(__doc__ + f'\nsettings of {mode} (--key=value; --out_dir may repeat):\n' + help_text(settings, __file__))
        return None
    out_dirs, argv = take_all(argv, 'out_dir')  # out_dir stays a key: '--out_dir value' gets its advice
    cfg = load_config({**settings, 'out_dir': None}, argv, types={'num_fewshot': int, 'limit': int}, config_files=False,
                      program='eval.py')
    check_ranges(cfg)
    if mode != 'routing' or cfg['out']:  # routing's default writes into each out_dir
        check_out(cfg['out'])
    check_device(cfg['device'], cfg['dtype'])
    out_dirs = out_dirs or ['out']
    if mode == 'routing':
        return run_routing(cfg, out_dirs)
    if mode == 'harness':
        if len(out_dirs) > 1:
            raise ConfigError('the harness evaluates one checkpoint a run: give one --out_dir')
        return run_harness(cfg, out_dirs[0])
    return run_positions(cfg, out_dirs)


if __name__ == '__main__':
    quit_on_sigterm()
    run_main(main, CheckpointError, EvalError)
