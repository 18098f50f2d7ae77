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

Memory scaling (paper Figure 5), from the validation losses of FM runs (a folder of run folders, or the .csv this
command wrote, to merge runs of several machines):
    python eval.py scaling --runs=out-repro/scaling --out=results/scaling
Writes --out's .csv (every run) and .png (each m at its best tau).

Learning rates: every finished run of --runs (a run folder, or a folder of run folders; --runs may repeat) by
model and learning rate, the mean validation loss over seeds (min-max), each model's best rate, and a warning
where that rate is the lowest or highest trained (the rate to add):
    python eval.py sweep --runs=out-repro/extrapolation --out=results/extrapolation_lr
Writes --out's .csv (every run) and _best.txt (the run folders at each model's best rate, every seed).

The loss frontier (paper Figures 2-3): the sweep, then each model at its best learning rate against the forward
FLOPs of its training (Model.flops_per_token(block_size) / 3 x tokens trained: flops_per_token counts forward and
backward as 3 x forward, attention's quadratic term included): the validation loss at the training context, and
the loss so far at 2x and 8x it (on the long split, or --data, as above; one evaluation a best-rate run):
    python eval.py frontier --runs=out-repro/frontier --out=results/frontier
Writes --out's .csv (every run) and .png (the two panels).

Routing of FM checkpoints (which memory rows the tokens use), per layer, on the long split or --data:
    python eval.py routing --out_dir=out-fm-small [--out_dir=...] [--out=results/routing]
Writes routing.json and routing.png (a heat map of row usage, layers x rows) in each out_dir, and with --out a .csv
and .png of all of them.
"""
import csv
import functools
import json
import math
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import fm_kernel
from checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint, tokenizer_of
from configurator import ConfigError, help_text, load_config
from generate import Generator, Sampling
from model import Model, ModelConfig
from prepare_data import get_tokenizer, load_tokens, prepare, read_utf8

DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'
POSITION_SETTINGS = dict(
    ckpt='ckpt.pt',  # a file in each out_dir (best.pt: the best validation loss)
    data='',  # '': the default corpus's long.bin; or a token file (.bin), a .txt file or a folder of .txt files
    data_dir='data',  # where prepare_data.py writes the default corpus
    max_len=16384,  # attention: the most positions of a document run in its one pass
    chunk_len=8192,  # fm, mamba2: tokens a chunk
    out='results/loss_by_position',  # writes out.csv, out.json, out.png
    device=DEVICE,
    dtype='auto',  # 'auto': bfloat16 autocast on CUDA, float32 elsewhere; losses always from float32 logits
)
HARNESS_SETTINGS = dict(
    ckpt='ckpt.pt',
    tasks='',  # lm-eval task names, comma-separated
    num_fewshot=None,  # None: each task's default
    limit=None,  # None: every example; N: the first N of each task
    include_path='',  # a folder of local task YAML files
    batch_size=32,
    out='results/harness',  # writes out.json
    device=DEVICE,
    dtype='auto',
)
SCALING_SETTINGS = dict(out='results/scaling')  # writes out.csv and out.png
SWEEP_SETTINGS = dict(out='results/sweep')  # writes out.csv and out_best.txt
FRONTIER_SETTINGS = dict(  # the loss beyond the context: as POSITION_SETTINGS
    data='',
    data_dir='data',
    chunk_len=8192,
    out='results/frontier',  # writes out.csv and out.png
    device=DEVICE,
    dtype='auto',
)
ROUTING_SETTINGS = dict(
    ckpt='ckpt.pt',
    data='',  # as for loss by position: '' is the default corpus's long split
    data_dir='data',
    tokens=65536,  # tokens measured, taken evenly from the starts of the documents
    chunk_len=8192,
    out='',  # '': routing.json and routing.png in each out_dir; PREFIX: also PREFIX.csv and PREFIX.png for all
    device=DEVICE,
    dtype='float32',
)
ETA_BINS = 20  # the histogram of eta over [0, 1]
ROUTING_PLOT_MAX = 12  # checkpoints in the heat maps of --out.png
LOSS_SLICE = 1024  # positions whose logits are formed at once: (1024, V) float32 is 0.4 GB at a 100K vocabulary
SERIES = {  # the sparsity rules of paper Figure 5: name -> whether a run of m rows and top-k k follows it
    'dense (k = m)': lambda m, k: k == m,
    'k = m/4': lambda m, k: 4 * k == m,
    'k = 4': lambda m, k: k == 4,
}
SCALING_FIELDS = ('run', 'n_memory', 'top_k', 'tau', 'val_loss', 'iter_num', 'max_iters')
SWEEP_FIELDS = ('run', 'model', 'parameters', 'non_embedding_parameters', 'learning_rate', 'min_lr', 'seed',
                'val_loss', 'best_lr', 'iter_num', 'max_iters', 'block_size', 'tokens', 'forward_flops')


class EvalError(RuntimeError):
    """A problem the user can fix (data, checkpoint, settings); the message says how."""


class Progress:
    """Prints work done and its rate: on a terminal every second, in a log every 30 seconds."""

    def __init__(self, label, total, unit='tokens'):
        self.label, self.total, self.unit, self.done = label, total, unit, 0
        self.start = self.last = time.time()
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


# ----------------------------------------------------------------------------- checkpoints

def open_checkpoint(out_dir, ckpt_name):
    """Read out_dir/ckpt_name (memory-mapped) -> (checkpoint dict, path)."""
    path = os.path.join(out_dir, ckpt_name)
    return load_checkpoint(path), path


def describe(config):
    """A short name of a model config (a dict): '6x256 fm m=64 k=16 tau=1', '6x256 attn', '6x256 mamba2'."""
    name = f"{config['n_layer']}x{config['d_model']} {config['mixer']}"
    if config['mixer'] == 'fm':
        m, k = config['n_memory'], config['top_k'] or config['n_memory']
        name += f" m={m} {'dense' if k == m else f'k={k}'} tau={config['tau']:g}"
    return name


def summary(ckpt, path, model):
    """What the results say about a checkpoint: where it is, its model, its training and validation loss."""
    label = os.path.basename(os.path.normpath(os.path.dirname(path))) or path
    if os.path.basename(path) != 'ckpt.pt':
        label += '/' + os.path.basename(path)
    return {'label': label, 'checkpoint': path, 'model': describe(ckpt['model_config']),
            'model_config': ckpt['model_config'], 'tokenizer': ckpt['tokenizer'],
            'parameters': model.num_params(non_embedding=False), 'iter_num': ckpt['iter_num'],
            'tokens_seen': ckpt['data_state'].get('tokens_seen'), 'val_loss': ckpt['best_val_loss'],
            'block_size': ckpt['model_config']['block_size']}


def build_model(ckpt, path, device):
    """The checkpoint's model in float32 on device, in eval mode (autocast, if any, picks the compute dtype)."""
    return model_from_checkpoint(ckpt, path).float().eval().to(device)


def check_device(device, dtype):
    """ConfigError unless device names a device this machine has and dtype is one eval.py takes."""
    if dtype not in ('auto', 'float32', 'bfloat16', 'float16'):
        raise ConfigError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', not {dtype!r}")
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ConfigError(str(e)) from None
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise ConfigError(f'--device={device}: this machine has no CUDA GPU (or this torch has no CUDA); '
                          f'use --device=cpu')


def autocast(device, dtype):
    """The autocast context of the model's passes: 'auto' is bfloat16 on CUDA and none elsewhere."""
    device_type = torch.device(device).type
    if dtype == 'auto':
        dtype = 'bfloat16' if device_type == 'cuda' else 'float32'
    return nullcontext() if dtype == 'float32' else torch.autocast(device_type, dtype=getattr(torch, dtype))


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
    step = len(inputs) if model.config.mixer == 'attn' else chunk_len
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
    if not data:
        folder = prepare(dataset='default', tokenizer=tokenizer, data_dir=data_dir)  # nothing to do if prepared
        data = str(folder / 'long.bin')
    path = Path(data)
    if path.suffix == '.bin':
        try:
            token_file = load_tokens(path, verify=True)
        except (ValueError, FileNotFoundError) as e:
            raise EvalError(str(e)) from None
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
    cut = model.config.mixer == 'attn' and max(map(len, docs)) - 1 > cfg['max_len']
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
    """Checkpoints of the same model config and tokenizer (e.g. seeds of one model) -> list of lists."""
    groups = {}
    for result in results:
        key = json.dumps([result['model_config'], result['tokenizer']], sort_keys=True)
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


def write_positions(results, groups, settings, out):
    """out.json (everything) and out.csv (one row a checkpoint and measure: bucket, so_far, val)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(f'{out}.json', 'w') as f:
        json.dump({'settings': settings, 'checkpoints': results, 'seed_groups': groups}, f, indent=1)
    with open(f'{out}.csv', 'w', newline='') as f:
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
    fig.savefig(path, dpi=120)
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
    if cfg['max_len'] < 1 or cfg['chunk_len'] < 1:
        raise ConfigError('max_len and chunk_len must be at least 1')
    checkpoints = [open_checkpoint(out_dir, cfg['ckpt']) for out_dir in out_dirs]
    documents = {}  # tokenizer -> (docs, description); every checkpoint's data is checked before any evaluation
    for ckpt, path in checkpoints:
        tokenizer_of(ckpt, path)
        if ckpt['tokenizer'] not in documents:
            documents[ckpt['tokenizer']] = load_documents(cfg['data'], cfg['data_dir'], ckpt['tokenizer'], path)
    results = [evaluate_positions(ckpt, path, documents[ckpt['tokenizer']][0], cfg) for ckpt, path in checkpoints]
    groups = print_positions(results, '; '.join(description for _, description in documents.values()))
    write_positions(results, groups, cfg, cfg['out'])
    plotted = plot_positions(results, f"{cfg['out']}.png")
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
    Path(cfg['out']).parent.mkdir(parents=True, exist_ok=True)
    with open(f"{cfg['out']}.json", 'w') as f:
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
        with torch.autocast(x.device.type, enabled=False):
            scores = mixer.router_scores(x)  # (N, M + 2)
        idx, alpha, eta, mu = fm_kernel.route_naive(scores, mixer.top_k, mixer.tau)  # as mixer.route
        probs = torch.softmax(scores[:, :-2] / mixer.tau, -1)  # (N, M)
        logits = scores[:, :-2] / mixer.tau  # (N, M)
        if idx is None:
            self.usage += probs.sum(0).cpu()
        else:
            self.usage += torch.zeros_like(probs).scatter_(-1, idx, 1.0).sum(0).cpu()
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
        shares = usage / usage.sum()
        etas = torch.cat(self.etas)
        return {'usage': usage.tolist(),
                'dead_rows': int((usage < 1 / (10 * m)).sum()),
                'rare_rows': int((usage < fair / 10).sum()),
                'busiest_row': float(usage.max()),
                'effective_rows': float(torch.exp(-(shares * shares.clamp_min(1e-300).log()).sum())),
                'entropy': self.entropy / n, 'entropy_uniform': math.log(m),
                'eta_mean': float(etas.mean()), 'mu_mean': self.mu / n,
                'eta_quantiles': dict(zip(('0.1', '0.5', '0.9'), etas.quantile(torch.tensor([0.1, 0.5, 0.9])).tolist())),
                'eta_histogram': (torch.histc(etas, ETA_BINS, 0, 1) / n).tolist(),
                'logit_bias_share': float((self.logit_sum / n).pow(2).sum() / (self.logit_energy / n)),
                'input_mean_share': float((self.input_sum / n).pow(2).sum() / (self.input_energy / n))}


def routing_tokens(docs, n_tokens):
    """About n_tokens tokens, the same number from the start of each document (all of the shorter ones)."""
    per_doc = max(2, n_tokens // len(docs))
    return [doc[:per_doc] for doc in docs]


@torch.no_grad()
def measure_routing(model, docs, cfg):
    """Run the documents through the model in chunks, carrying the state -> one RoutingStats a FM layer."""
    mixers = [block.mixer for block in model.blocks]
    c = model.config
    stats = [RoutingStats(c.n_memory, c.k, c.d_model) for _ in mixers]
    hooks = [mixer.register_forward_hook(lambda mixer, args, out, s=s: s.add(mixer, args[0]))
             for mixer, s in zip(mixers, stats)]
    ctx = autocast(cfg['device'], cfg['dtype'])
    try:
        for doc in docs:
            ids = torch.as_tensor(np.asarray(doc, dtype=np.int64), device=model.embed.weight.device)
            state = None
            for start in range(0, len(ids), cfg['chunk_len']):
                with ctx:
                    _, state = model.hidden(ids[None, start:start + cfg['chunk_len']], state)
    finally:
        for hook in hooks:
            hook.remove()
    return stats


def print_routing(result):
    """One line a layer: dead and rare rows, the effective number of rows, entropy, the busiest row, eta."""
    print(f"\n{result['label']}: {result['model']}, {result['tokens']:,} tokens; usage = share of tokens selecting a "
          f"row (dense: mean alpha); dead < 1/(10 m), rare < a tenth of the fair share")
    print(f"{'layer':>6}{'dead':>6}{'rare':>6}{'eff. rows':>10}{'entropy':>9}{'busiest':>9}{'eta mean':>9}"
          f"{'eta med':>8}{'bias share':>11}{'input mean':>11}")
    for i, layer in enumerate(result['layers']):
        print(f"{i:>6}{layer['dead_rows']:>6}{layer['rare_rows']:>6}{layer['effective_rows']:>10.1f}"
              f"{layer['entropy']:>9.3f}{layer['busiest_row']:>9.3f}{layer['eta_mean']:>9.3f}"
              f"{layer['eta_quantiles']['0.5']:>8.3f}{layer['logit_bias_share']:>11.3f}{layer['input_mean_share']:>11.3f}")


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
    if cfg['tokens'] < 2 or cfg['chunk_len'] < 1:
        raise ConfigError('tokens must be at least 2 and chunk_len at least 1')
    checkpoints = [open_checkpoint(out_dir, cfg['ckpt']) for out_dir in out_dirs]
    for (ckpt, path), out_dir in zip(checkpoints, out_dirs):
        check_out(os.path.join(out_dir, 'routing'))  # routing.json goes there: refused now, not after the work
        if ckpt['model_config']['mixer'] != 'fm':
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
        stats = measure_routing(model, docs, cfg)
        result = {**summary(ckpt, path, model), 'data': description, 'tokens': stats[0].tokens,
                  'layers': [s.summary() for s in stats]}
        print_routing(result)
        with open(os.path.join(out_dir, 'routing.json'), 'w') as f:
            json.dump(result, f, indent=1)
        plot_routing([result], os.path.join(out_dir, 'routing.png'))
        results.append(result)
    if cfg['out']:
        write_routing(results, cfg['out'])
    return results


def write_routing(results, out):
    """out.csv, a row a checkpoint and layer (usage as its sorted values), and out.png, every checkpoint's map."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fields = ('dead_rows', 'rare_rows', 'effective_rows', 'entropy', 'busiest_row', 'eta_mean', 'mu_mean',
              'logit_bias_share', 'input_mean_share')
    with open(f'{out}.csv', 'w', newline='') as f:
        writer = csv.writer(f, lineterminator='\n')
        writer.writerow(['checkpoint', 'model', 'val_loss', 'layer', *fields])
        for r in results:
            for i, layer in enumerate(r['layers']):
                writer.writerow([r['label'], r['model'], r['val_loss'], i, *(layer[k] for k in fields)])
    shown = results[:ROUTING_PLOT_MAX]
    plotted = plot_routing(shown, f'{out}.png')
    note = f' (the first {len(shown)} of {len(results)} checkpoints; each out_dir has its own)' if len(shown) < len(
        results) else ''
    print(f"wrote {out}.csv{', .png' + note if plotted else ''}")


# ----------------------------------------------------------------------------- memory scaling

def scaling_row(path):
    """The scaling record of one FM run's checkpoint (its final validation loss when eval_interval = max_iters)."""
    ckpt = load_checkpoint(path)
    config = ckpt['model_config']
    if config['mixer'] != 'fm':
        raise EvalError(f"{path} is a {config['mixer']} run, not an FM run: give --runs folders of FM runs only")
    return {'run': path.parent.name, 'n_memory': config['n_memory'], 'top_k': config['top_k'] or config['n_memory'],
            'tau': config['tau'], 'val_loss': ckpt['best_val_loss'], 'iter_num': ckpt['iter_num'],
            'max_iters': ckpt['train_config']['max_iters']}


def scaling_rows(sources):
    """Run records from folders of run folders (each */ckpt.pt) and from .csv files eval.py scaling wrote; a
    later record of a run replaces an earlier one."""
    rows = {}
    for source in sources:
        path = Path(source)
        if path.suffix == '.csv' and path.is_file():
            with open(path, newline='') as f:
                for row in csv.DictReader(f):
                    rows[row['run']] = {'run': row['run'], **{k: int(row[k]) for k in ('n_memory', 'top_k',
                                                                                        'iter_num', 'max_iters')},
                                        'tau': float(row['tau']), 'val_loss': float(row['val_loss'])}
        elif path.is_dir():
            for ckpt in sorted(path.glob('*/ckpt.pt')):
                rows[ckpt.parent.name] = scaling_row(ckpt)
        else:
            raise EvalError(f'--runs={source}: not a folder of run folders or a .csv of eval.py scaling')
    if not rows:
        raise EvalError(f'no runs (*/ckpt.pt) in {", ".join(sources)}')
    return sorted(rows.values(), key=lambda r: (r['n_memory'], r['top_k'], -r['tau']))


def best_per_series(rows):
    """{series: {m: the finished run of lowest validation loss over tau}} for each series of SERIES."""
    best = {name: {} for name in SERIES}
    for row in rows:
        if row['iter_num'] < row['max_iters']:
            continue
        for name, follows in SERIES.items():
            m = row['n_memory']
            if follows(m, row['top_k']) and (m not in best[name] or row['val_loss'] < best[name][m]['val_loss']):
                best[name][m] = row
    return {name: dict(sorted(runs.items())) for name, runs in best.items() if runs}


def print_scaling(rows, best):
    """Every run's validation loss (tau x m, a table a series), then each m at its best tau."""
    unfinished = [r['run'] for r in rows if r['iter_num'] < r['max_iters']]
    if unfinished:
        print(f'left out, not finished: {", ".join(unfinished)}')
    for name in best:
        runs = [r for r in rows if SERIES[name](r['n_memory'], r['top_k']) and r['iter_num'] >= r['max_iters']]
        ms, taus = sorted({r['n_memory'] for r in runs}), sorted({r['tau'] for r in runs}, reverse=True)
        print(f'\nvalidation loss, {name}\n{"tau / m":>10}' + ''.join(f'{m:>9}' for m in ms))
        for tau in taus:
            losses = {r['n_memory']: r['val_loss'] for r in runs if r['tau'] == tau}
            print(f'{tau:>10g}' + ''.join(f'{losses[m]:9.4f}' if m in losses else f'{"-":>9}' for m in ms))
    print('\nbest over tau: validation loss (tau)')
    for name, runs in best.items():
        print(f'{name:>14}: ' + ', '.join(f"m={m} {r['val_loss']:.4f} ({r['tau']:g})" for m, r in runs.items()))


def plot_scaling(best, path):
    """Validation loss at the best tau against m (log scale), a line a series, each point's tau written by it.
    -> whether it wrote the plot (False without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 5))
    for name, runs in best.items():
        line, = ax.plot(list(runs), [r['val_loss'] for r in runs.values()], marker='o', label=name)
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

def run_folders(sources):
    """Run folders (holding ckpt.pt) from --runs values, each a run folder or a folder of run folders."""
    if not sources:
        raise ConfigError('--runs=FOLDER: a run folder (with ckpt.pt) or a folder of run folders; --runs may repeat')
    folders = []
    for source in sources:
        path = Path(source)
        if (path / 'ckpt.pt').is_file():
            folders.append(path)
        elif path.is_dir():
            folders.extend(ckpt.parent for ckpt in sorted(path.glob('*/ckpt.pt')))
        else:
            raise EvalError(f'--runs={source}: not a run folder (with ckpt.pt) or a folder of run folders')
    if not folders:
        raise EvalError(f'no runs (ckpt.pt) in {", ".join(sources)}')
    return folders


def csv_records(path):
    """The run records of a .csv that eval.py sweep or frontier wrote (runs of an earlier machine)."""
    ints = ('parameters', 'non_embedding_parameters', 'seed', 'iter_num', 'max_iters', 'block_size', 'tokens')
    floats = ('learning_rate', 'min_lr', 'val_loss', 'forward_flops', 'loss_so_far_2x', 'loss_so_far_8x')
    with open(path, newline='') as f:
        rows = list(csv.DictReader(f))
    if rows and not {'run', 'model', *ints, 'learning_rate', 'val_loss'} <= set(rows[0]):
        raise EvalError(f'--runs={path}: not a .csv that eval.py sweep or frontier wrote')
    return [{'run': row['run'], 'model': row['model'], 'architecture': row['model'].split(' ', 1)[1].rsplit(' (', 1)[0],
             **{k: int(row[k]) for k in ints}, **{k: float(row[k]) for k in floats if row.get(k)}} for row in rows]


def run_key(record):
    """A run's name in its subset (the last two parts of its folder): the same run on another machine."""
    return '/'.join(Path(record['run']).parts[-2:])


def run_record(folder):
    """The sweep record of one run: its model, learning rate, seed, final validation loss (the configs evaluate once,
    at the end), parameters and forward training FLOPs = Model.flops_per_token(block_size) / 3 x tokens trained
    (flops_per_token counts forward + backward as 3 x forward, attention's quadratic term included)."""
    ckpt = load_checkpoint(folder / 'ckpt.pt')
    config, train = ckpt['model_config'], ckpt['train_config']
    with torch.device('meta'):  # shapes only: no weights are made
        model = Model(ModelConfig(**config))
    tokens = ckpt['data_state']['tokens_seen']
    return {'run': str(folder), 'model': f"{describe(config)} ({model.num_params() / 1e6:.2f}M)",
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
    return {model: min(runs, key=lambda lr: np.mean([r['val_loss'] for r in runs[lr]])) for model, runs in table.items()}


def edge_warnings(table, best):
    """A line for each model whose best learning rate is the lowest or highest it was trained at: the rate to add."""
    warnings = []
    for model, lr in best.items():
        lrs = list(table[model])
        add = [f'{rate:g}' for rate, at_edge in ((lr / 2, lr == lrs[0]), (lr * 2, lr == lrs[-1])) if at_edge]
        if add:
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
    if not sources:
        run_folders(sources)  # the message saying what --runs takes
    merged = {}  # a later source's record of a run replaces an earlier one
    for source in sources:
        is_csv = source.endswith('.csv') and Path(source).is_file()
        found = csv_records(source) if is_csv else [run_record(folder) for folder in run_folders([source])]
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
    at 8x the context, which leaves those losses as they are."""
    documents = {}
    for r in records:
        if not r['best_lr'] or r.get('loss_so_far_8x') is not None:  # a record from a .csv has them
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


def take_all(argv, key):
    """Every --key=value of argv (a key that may repeat) -> (the values, the other arguments)."""
    flag = f'--{key}='
    return [a[len(flag):] for a in argv if a.startswith(flag)], [a for a in argv if not a.startswith(flag)]


def main(argv=()):
    argv = list(argv)
    modes = {'positions': POSITION_SETTINGS, 'harness': HARNESS_SETTINGS, 'scaling': SCALING_SETTINGS,
             'sweep': SWEEP_SETTINGS, 'frontier': FRONTIER_SETTINGS, 'routing': ROUTING_SETTINGS}
    mode = argv.pop(0) if argv and argv[0] in modes else 'positions'
    settings = modes[mode]
    repeated = 'runs' if mode in ('scaling', 'sweep', 'frontier') else 'out_dir'
    if '-h' in argv or '--help' in argv:
        print(__doc__ + f'\nsettings of {mode} (--key=value; --{repeated} may repeat):\n' + help_text(settings))
        return None
    values, argv = take_all(argv, repeated)
    cfg = load_config(settings, argv, types={'num_fewshot': int, 'limit': int})
    if mode != 'routing' or cfg['out']:  # routing's default writes into each out_dir
        check_out(cfg['out'])
    if mode == 'scaling':
        if not values:
            raise ConfigError('--runs=FOLDER: a folder of FM run folders (or a .csv that eval.py scaling wrote)')
        return run_scaling(cfg, values)
    if mode == 'sweep':
        return run_sweep(cfg, values)
    check_device(cfg['device'], cfg['dtype'])
    if mode == 'frontier':
        return run_frontier(cfg, values)
    out_dirs = values or ['out']
    if mode == 'routing':
        return run_routing(cfg, out_dirs)
    if mode == 'harness':
        if len(out_dirs) > 1:
            raise ConfigError('the harness evaluates one checkpoint a run: give one --out_dir')
        return run_harness(cfg, out_dirs[0])
    return run_positions(cfg, out_dirs)


if __name__ == '__main__':
    try:
        main(sys.argv[1:])
    except (ConfigError, CheckpointError, EvalError) as e:
        sys.exit(f'error: {e}')
