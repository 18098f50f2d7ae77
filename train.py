"""
Train a language model of model.py: Factorization Memory, or another mixer (--help lists them).

    python train.py                        # small FM model, default corpus, minutes on a CPU
    python train.py config/fm_small.py --max_iters=2000 --batch_size=32
    torchrun --standalone --nproc_per_node=8 train.py config/fm_1b.py  # DDP (gloo on CPU)
Continue from out_dir/ckpt.pt with --init_from=resume. Nothing is lost: out_dir holds one run;
saves are whole; a value not finite or a blow-up stops the run unsaved; Ctrl-C, SIGTERM or SIGHUP
saves the step and exits 130, 143 or 129 (resume goes on bit for bit); --overwrite=True replaces the
earlier run once a checkpoint is whole.
"""
from configurator import (ConfigError, check_training, help_text, load_config, optional_types,
                          quit_on_ctrl_c, quit_on_sigterm, run_main)

if __name__ == '__main__':  # first: a signal while the imports load is one line
    quit_on_ctrl_c()

import fcntl
import importlib.util
import json
import math
import os
import random
import shlex
import signal
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, fields
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import model as model_file
from checkpoint import (CheckpointError, load_checkpoint, model_from_checkpoint, nonfinite,
                        save_checkpoint)
from devices import (DTYPES, check_batch_fits, check_device, check_model_fits, peak_memory,
                     resolve_dtype)
from model import Model, ModelConfig
from prepare_data import dataset_dir, get_tokenizer, load_tokens, prepare

# default settings: a small FM model on the default corpus, minutes on a CPU
out_dir = 'out'  # the run's folder: ckpt.pt (the last step), best.pt (the best val loss)
eval_interval = 100  # steps between evaluations, each writing ckpt.pt (best.pt if val improves)
eval_iters = 16  # the validation set is eval_iters * batch_size fixed windows
log_interval = 10  # steps between log lines
always_save_checkpoint = True  # False: ckpt.pt only at the end (best.pt as val improves)
init_from = 'scratch'  # 'scratch' or 'resume' (from out_dir/ckpt.pt)
overwrite = False  # True: a scratch run replaces out_dir's earlier run at its first save
wandb_log = False  # log to Weights & Biases (pip install wandb)
wandb_project = 'factorization-memory'  # its project
wandb_run_name = 'fm'  # its run name
# data: data_dir/{dataset}_{tokenizer}/{train,val}.bin, written by prepare_data.py
dataset = 'default'  # 'default', or prepare_data.py's --dataset (a path or hf:NAME)
tokenizer = 'bytes'  # 'bytes' or a tiktoken encoding (e.g. cl100k_base)
data_dir = ''  # prepare_data.py's --data_dir; '': its default, data/ here
hf_config = ''  # prepare_data.py's --hf_config, if any
verify_data = True  # check the token files' checksums (0.4 s a GB)
gradient_accumulation_steps = 1  # micro-batches a step, over all processes
batch_size = 16  # micro-batch size per process
block_size = 256  # tokens a sequence: the training context
vocab_multiple = 64  # pad a vocab of more than 256 tokens to a multiple of this
# model: these, and every other ModelConfig field of model.py
mixer = 'fm'  # a mixer listed below, or module:Class extending one (research.levers:RowRatesFM)
n_layer = 4  # blocks
d_model = 128  # width of the residual stream
# fm
n_memory = 32  # m, memory rows
top_k = 8  # k rows read and written per token; None: dense
fm_conv = 4  # FM's block, not the paper's: 4-tap convolution on xbar (0: none; paper_layer.py)
fm_gate = True  # FM's block, not in the paper: an output gate (False: none)

chunk_size = 16  # tokens a chunk of the parallel scans: 16 is fastest for FM's on a CPU

# AdamW, its learning rate: linear warmup, then cosine decay to min_lr at lr_decay_iters
learning_rate = 4e-3  # the peak learning rate, after warmup_iters
max_iters = 500  # the step training ends at
weight_decay = 0.1  # AdamW's decoupled weight decay, on matrices and embeddings only
beta1 = 0.9  # AdamW's beta1
beta2 = 0.95  # AdamW's beta2
grad_clip = 1.0  # clip the gradient norm at this value; 0.0: no clipping
warmup_iters = 50  # steps of linear warmup (at most max_iters)
lr_decay_iters = 0  # step where the cosine reaches min_lr; 0: max_iters
min_lr = 4e-4  # the learning rate the cosine decays to
# the machine
device = 'cuda' if torch.cuda.is_available() else 'cpu'  # 'cpu', 'cuda', 'cuda:1', 'mps', ...
dtype = 'auto'  # float32, bfloat16 or float16 (autocast); auto: bfloat16 on CUDA, else float32
compile = False  # torch.compile the model
seed = 1337  # seed of the initial weights and of the batches
_TRAIN_KEYS = [k for k, v in globals().items() if k[0] != '_' and isinstance(v, (int, float, str))]
AT_LEAST = dict(batch_size=1, block_size=1, gradient_accumulation_steps=1, max_iters=1,
                warmup_iters=0, eval_interval=1, eval_iters=1, log_interval=1, lr_decay_iters=0,
                min_lr=0, vocab_multiple=1)
MAX_ACCUMULATION = 2 ** 14  # micro-batches a step: beyond, a larger --batch_size
BLOW_UP = 0.5  # nats above the untrained model's val loss: a blow-up (early noise moves ~0.1)
EVAL_SEED = 2024  # of the validation windows alone: runs of other seeds compare
RUN_FILES = ('ckpt.pt', 'best.pt', 'routing.json', 'routing.png')  # eval.py writes routing
NEVER = 2 ** 62  # the step of a loss or gradient norm not finite, while there is none


class TrainError(RuntimeError):
    """A problem the user can fix (data, checkpoint, settings, divergence): the message says how."""


def default_config():
    """The settings above, and every other ModelConfig field at its default."""
    model = {f.name: f.default for f in fields(ModelConfig)
             if f.name not in ('vocab_size', *_TRAIN_KEYS)}
    return {k: globals()[k] for k in _TRAIN_KEYS} | model


def model_args(cfg):
    return {f.name: getattr(cfg, f.name) for f in fields(ModelConfig) if f.name != 'vocab_size'}


def mixer_tags():
    """{setting: the mixers that read it}, from ModelConfig.MIXER_SETTINGS."""
    tags = {}
    for family, keys in ModelConfig.MIXER_SETTINGS.items():
        for key in keys:
            tags.setdefault(key, []).append(family)
    return tags


def settings(argv):
    """argv -> the run's settings (None for --help); ConfigError for one out of range."""
    defaults = default_config()
    if '-h' in argv or '--help' in argv:
        mixers = [f'{name} ({cls.__name__})' for name, cls in model_file.MIXER_CLASSES.items()]
        notes = help_text(defaults, __file__, model_file.__file__, tags=mixer_tags())
        print(f'{__doc__}\nsettings (--key=value; [fm]: a model setting of fm alone):\n{notes}')
        return print(f"mixers: {', '.join(mixers)}")
    cfg = SimpleNamespace(**load_config(defaults, argv, optional_types(ModelConfig)))
    check_settings(cfg)
    check_device(cfg.device)
    try:
        vocab_size = get_tokenizer(cfg.tokenizer).vocab_size
        config = ModelConfig(**model_args(cfg), vocab_size=vocab_size)
        n_params = check_model_fits(config, torch.device(cfg.device))
    except (ValueError, ImportError, RuntimeError) as e:
        raise ConfigError(str(e)) from None
    ignored = ignored_settings(cfg, config.family, defaults)
    if ignored and cfg.init_from == 'scratch':
        mixers = sorted({family for key in ignored for family in mixer_tags()[key]})
        given = ', '.join(f'--{k}={getattr(cfg, k)!r}' for k in ignored)
        print(f"warning: --mixer={cfg.mixer} ignores {given} (settings of {', '.join(mixers)}): "
              f'not used, and recorded at the default')
        vars(cfg).update({k: defaults[k] for k in ignored})
    if config.family == 'fm' and cfg.chunk_size > cfg.block_size:
        print(f'warning: --chunk_size={cfg.chunk_size} is above --block_size={cfg.block_size}: '
              f"FM's scan pads each sequence to a whole chunk (10 times slower); set chunk_size at "
              f'most {cfg.block_size}')
    if cfg.weight_decay * cfg.learning_rate >= 1:
        print(f'warning: --weight_decay={cfg.weight_decay} x --learning_rate={cfg.learning_rate} '
              f"is at least 1: AdamW's decay step flips the weights' sign, and the run will "
              f'diverge; set weight_decay below 1 / learning_rate (typical: 0.1)')
    check_batch_fits(cfg.batch_size, cfg.block_size, config, n_params, torch.device(cfg.device))
    if cfg.dtype == 'float16' and torch.device(cfg.device).type == 'cpu':
        print('warning: --dtype=float16 on the CPU is slow (10 times float32\'s step): use '
              '--dtype=float32')
    return cfg


def check_settings(cfg):
    """ConfigError naming the first setting out of range, and its fix."""
    check_training(vars(cfg), AT_LEAST)
    lr, decay, accum = cfg.learning_rate, cfg.lr_decay_iters, cfg.gradient_accumulation_steps
    world_size = int(os.environ.get('WORLD_SIZE', '1'))  # torchrun's
    refusals = {
        f"--init_from={cfg.init_from!r}: use 'scratch' or 'resume'":
            cfg.init_from not in ('scratch', 'resume'),
        f"--dtype={cfg.dtype!r}: use one of {', '.join(DTYPES)}": cfg.dtype not in DTYPES,
        f'--gradient_accumulation_steps={accum} is out of range: set it to at most '
        f'{MAX_ACCUMULATION} (a larger step: raise --batch_size)': accum > MAX_ACCUMULATION,
        '--out_dir is empty: name the folder the checkpoints go to': not cfg.out_dir,
        f'--gradient_accumulation_steps counts micro-batches over all {world_size} processes: '
        f'make it a multiple of {world_size}': cfg.gradient_accumulation_steps % world_size,
        f'--min_lr={cfg.min_lr} is above --learning_rate={lr}: the cosine decays from '
        f'learning_rate to min_lr; set min_lr lower (e.g. learning_rate / 10)': cfg.min_lr > lr,
        f'--warmup_iters={cfg.warmup_iters} is beyond --max_iters={cfg.max_iters}: set at most '
        f'{cfg.max_iters}': cfg.warmup_iters > cfg.max_iters,
        f'--lr_decay_iters={decay} is not after --warmup_iters={cfg.warmup_iters}: set it above '
        f'warmup_iters (or 0: max_iters)': 0 < decay <= cfg.warmup_iters,
        f'--hf_config={cfg.hf_config} applies to hf: datasets only: drop it, or pass '
        f'--dataset=hf:NAME': cfg.hf_config and not cfg.dataset.startswith('hf:'),
        f'--data_dir={cfg.data_dir} is a file: give the folder of prepare_data.py':
            os.path.isfile(cfg.data_dir),
        '--wandb_log=True needs wandb: pip install it':
            cfg.wandb_log and not importlib.util.find_spec('wandb'),
    }
    for message, refused in refusals.items():
        if refused:
            raise ConfigError(message)


def ignored_settings(cfg, family, defaults):
    """The model settings changed in cfg that family does not read."""
    tags = mixer_tags()
    others = [key for key in defaults if key in tags and family not in tags[key]]
    return [key for key in others if getattr(cfg, key) != defaults[key]]


def claim(cfg, run):
    """Rank 0's lock on out_dir -> the earlier run's files this run replaces (or refuses)."""
    lock = run.folder / 'train.lock'
    while run.lock is None:  # till the file locked is the one at lock (an ending run removes it)
        try:
            run.folder.mkdir(parents=True, exist_ok=True)
            run.lock = open(lock, 'a+')
            fcntl.flock(run.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            run.lock.seek(0)
            holder = run.lock.read().strip() or 'a process that is starting'
            run.lock = None
            raise TrainError(f'{run.folder} is in use by {holder}: wait for it, or use another '
                             f'--out_dir') from None
        except OSError as e:  # no folder, or a file system without locks (Lustre's)
            if run.lock is None:
                reason = 'it is a file' if run.folder.is_file() else e.strerror
                raise TrainError(f'cannot write --out_dir={run.folder} ({reason}): pass a writable '
                                 f'folder') from None
            print(f'warning: cannot lock {lock} ({e.strerror}): nothing stops a second run in '
                  f'{run.folder}')
        if not lock.exists() or lock.stat().st_ino != os.fstat(run.lock.fileno()).st_ino:
            run.lock = run.lock.close()
    run.lock.truncate(0)
    since = time.strftime('%F %T')
    holder = f'process {os.getpid()} on {os.uname().nodename}, since {since}'
    print(holder, file=run.lock, flush=True)
    if (run.folder / 'replacing').exists():  # the new files are whole: finish the swap
        swap_in(run.folder, (run.folder / 'replacing').read_text().split())
    for name in ('ckpt.pt', 'best.pt', 'replacing'):  # written by a run killed before its journal
        (run.folder / f'{name}.tmp').unlink(missing_ok=True)
    earlier = [name for name in RUN_FILES if (run.folder / name).exists()]
    if cfg.init_from == 'resume':
        return []
    checkpoints = [name for name in earlier if name.endswith('.pt')]
    if checkpoints and not cfg.overwrite:
        raise TrainError(f'{run.folder} holds {" and ".join(checkpoints)} of an earlier run: '
                         f'continue it (--init_from=resume), use a new --out_dir, or pass '
                         f'--overwrite=True')
    return earlier


def save(cfg, run, names):
    """Write names (ckpt.pt, best.pt) whole if finite, then rename them in."""
    ckpt = checkpoint_of(cfg, run)
    optimizer_state = ckpt['optimizer']['state']
    state = {**ckpt['model'], **{f"the optimizer's {key} of parameter {i}": value
                                 for i, values in optimizer_state.items()
                                 for key, value in values.items()}}
    broken = nonfinite(state)
    if broken:
        diverged(run, f'{broken[0]} is not finite (NaN or infinity) at step {run.iter_num}')
    then = 'continue with --init_from=resume'
    if 'ckpt.pt' not in run.saved:
        then = 'start this run again'
    if 'ckpt.pt' not in run.saved and run.earlier:
        then += ' with --overwrite=True (the earlier run is untouched)'
    gone = [name for name in run.earlier if name != names[0]]  # names[0] is renamed over

    def write():  # rank 0's part
        try:
            for name in names:
                save_checkpoint(ckpt, run.folder / name, then, rename=False)
        except CheckpointError:  # e.g. a full disk: no whole .tmp of this save stays either
            for name in names:
                (run.folder / f'{name}.tmp').unlink(missing_ok=True)
            raise
        (run.folder / 'replacing.tmp').write_text('\n'.join(gone))  # the journal: all whole
        os.replace(run.folder / 'replacing.tmp', run.folder / 'replacing')
        swap_in(run.folder, gone)
    on_rank_0(write, run.group)
    if run.earlier and run.master:
        print(f"replaced the earlier run's {' and '.join(run.earlier)} in {run.folder}")
    run.earlier = []
    run.saved.update(dict.fromkeys(names, run.iter_num))


def checkpoint_of(cfg, run):
    """This step's checkpoint: all a resume needs to go on bit for bit."""
    batches, np_state = [run.batch_state], np.random.get_state()
    if run.group is not None:
        batches = [None] * run.world_size
        dist.all_gather_object(batches, run.batch_state, group=run.group)
    cuda = None
    if torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state_all()
    model_config = asdict(run.raw_model.config)
    return {
        'model': run.raw_model.state_dict(), 'optimizer': run.optimizer.state_dict(),
        'scaler': run.scaler.state_dict(), 'model_config': model_config,
        'tokenizer': cfg.tokenizer,
        'train_config': {k: model_config.get(k, v) for k, v in vars(cfg).items()},
        'iter_num': run.iter_num, 'best_val_loss': run.best_val_loss,
        'untrained_loss': run.untrained_loss,
        'eval_cut': run.eval_cut,  # a stop cut this step's evaluation: a resume runs it
        'rng': {'python': random.getstate(),
                'numpy': (np_state[0], np_state[1].tolist(), *np_state[2:]),
                'torch': torch.get_rng_state(), 'batch': batches, 'cuda': cuda},
        'data_state': {'folder': str(run.data.folder), 'train_tokens': len(run.data.train),
                       'world_size': run.world_size, 'val_set': run.data.val_set,
                       'tokens_seen': run.iter_num * run.tokens_per_iter}}


def swap_in(folder, gone):
    """Remove the earlier run's files gone, rename the whole .tmp checkpoints in, then remove the
    journal: out_dir holds one run's files at every point, and each step can be done again."""
    if any(folder.glob('*.pt.tmp')):  # none once all are renamed in: gone is gone
        for name in gone:
            (folder / name).unlink(missing_ok=True)
    for name in ('ckpt.pt', 'best.pt'):
        if (folder / f'{name}.tmp').exists():
            os.replace(folder / f'{name}.tmp', folder / name)
    (folder / 'replacing').unlink(missing_ok=True)


def on_rank_0(step, group):
    """step() on rank 0 -> its result, or its error raised, on every rank (else they hang)."""
    shared = [None, None]  # the result, the error
    if group is None or dist.get_rank() == 0:
        try:
            shared[0] = step()
        except (TrainError, CheckpointError) as e:
            shared[1] = e
        except (OSError, ValueError, RuntimeError) as e:  # e.g. a full disk preparing the data
            shared[1] = TrainError(str(e))
        except Exception as e:
            shared[1] = TrainError(repr(e))
    if group is not None:
        dist.broadcast_object_list(shared, src=0, group=group)
    if shared[1] is not None:
        raise shared[1]
    return shared[0]


def load_data(cfg, run):
    """The token files (the default corpus prepared first) and the validation windows."""
    folder = dataset_dir(cfg.dataset, cfg.tokenizer, cfg.data_dir, cfg.hf_config or None)
    if cfg.dataset == 'default':
        on_rank_0(lambda: prepare(tokenizer=cfg.tokenizer, data_dir=cfg.data_dir), run.group)
    if not (folder / 'train.bin').exists():
        raise TrainError(f'no dataset at {folder}. Prepare it with:\n  {prepare_command(cfg)}')
    tok = get_tokenizer(cfg.tokenizer)
    verify = cfg.verify_data and os.environ.get('LOCAL_RANK', '0') == '0'  # one a node
    splits = {}
    for split in ('train', 'val'):
        try:
            path = folder / f'{split}.bin'
            splits[split] = load_tokens(path, cfg.tokenizer, tok.vocab_size, verify).tokens
        except (ValueError, FileNotFoundError) as e:
            raise TrainError(str(e)) from None
        check_tokens(cfg, folder, split, len(splits[split]), verify)
    windows = cfg.eval_iters * cfg.batch_size  # fixed validation windows
    val_set = [str(folder), len(splits['val']), cfg.block_size, windows]
    high = len(splits['val']) - cfg.block_size
    val_starts = np.random.default_rng(EVAL_SEED).integers(0, high, windows)
    run.data = SimpleNamespace(tok=tok, folder=folder, val_set=val_set, val_starts=val_starts,
                               **splits)


def prepare_command(cfg):
    """The prepare_data.py command of the run's token files, quoted to paste."""
    args = ['python', 'prepare_data.py', '--dataset', cfg.dataset, '--tokenizer', cfg.tokenizer]
    if cfg.data_dir:
        args += ['--data_dir', cfg.data_dir]
    if cfg.hf_config:
        args += ['--hf_config', cfg.hf_config]
    return shlex.join(args)


def check_tokens(cfg, folder, split, n_tokens, verify):
    """TrainError if a token file is shorter than a sequence, or (verify) not meta.json's."""
    if n_tokens < cfg.block_size + 1:
        raise TrainError(f'{split}.bin in {folder} holds {n_tokens} tokens: set --block_size below '
                         f'that, or use more data')
    if not verify:
        return
    try:
        listed = json.loads((folder / 'meta.json').read_text())['files'][f'{split}.bin']['tokens']
    except (OSError, ValueError, KeyError, TypeError):
        return  # token files written without prepare_data.py's meta.json
    if listed != n_tokens:
        raise TrainError(f'{split}.bin in {folder} holds {n_tokens:,} tokens; its meta.json lists '
                         f'{listed:,}: the files changed after prepare_data.py wrote them; '
                         f'write them again: {prepare_command(cfg)}')


def setup(cfg, run):
    """Data, model, optimizer, loss scaler, batch generator: new, or as ckpt.pt left them."""
    load_data(cfg, run)
    run.iter_num, run.best_val_loss, run.untrained_loss, run.eval_cut = 0, math.inf, None, False
    ckpt = None
    if cfg.init_from == 'resume':
        ckpt = load_checkpoint(run.folder / 'ckpt.pt')
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # the same weights on every rank
    vocab_size = run.data.tok.vocab_size
    if vocab_size > 256:
        vocab_size = -(-vocab_size // cfg.vocab_multiple) * cfg.vocab_multiple
    if ckpt is None:
        run.raw_model = Model(ModelConfig(**model_args(cfg), vocab_size=vocab_size))
    else:
        run.raw_model = model_from_checkpoint(ckpt, run.folder / 'ckpt.pt')
    run.raw_model.config.block_size = cfg.block_size  # a resume trains at this run's context
    run.raw_model.to(run.device)
    betas = (cfg.beta1, cfg.beta2)
    run.optimizer = run.raw_model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, betas,
                                                       run.device.type)
    scaled = run.dtype == 'float16'
    run.scaler = torch.amp.GradScaler(run.device.type, enabled=scaled)
    run.gen = np.random.default_rng([cfg.seed, run.rank])  # this rank's batches
    if ckpt is not None:
        resume(cfg, run, ckpt)
    run.bad = torch.full((2,), NEVER, device=run.device)  # the first bad step: loss, grad norm
    accum, batch, block = cfg.gradient_accumulation_steps, cfg.batch_size, cfg.block_size
    run.tokens_per_iter = accum * batch * block
    model = run.raw_model
    if run.master:
        print(f'device {run.device}, dtype {run.dtype}, world size {run.world_size}, tokens per '
              f'step {run.tokens_per_iter:,} ({accum} x {batch} x {block})\nmodel: {model.config}'
              f'\nparameters: {model.num_params(False):,} ({model.num_params():,} without '
              f'embeddings)')
    run.wandb = None
    if cfg.wandb_log and run.master:
        run.wandb = __import__('wandb').init(project=cfg.wandb_project, name=cfg.wandb_run_name,
                                             config=vars(cfg))
    run.model = model
    if cfg.compile:
        run.model = torch.compile(model)
    if run.group is not None:
        device_ids = None
        if run.device.type == 'cuda':
            device_ids = [run.device.index]
        run.model = DDP(run.model, device_ids=device_ids)


def resume(cfg, run, ckpt):
    """Go on from ckpt (step, losses, optimizer, random states) as if never stopped."""
    path, step = run.folder / 'ckpt.pt', ckpt['iter_num']
    saved = asdict(run.raw_model.config) | {'tokenizer': ckpt['tokenizer']}
    asked = asdict(ModelConfig(**model_args(cfg), vocab_size=saved['vocab_size']))
    asked['tokenizer'] = cfg.tokenizer
    changed = [k for k, v in saved.items() if k != 'block_size' and asked[k] != v]
    if changed:
        has = ', '.join(f'{k}={saved[k]!r}' for k in changed)
        wants = ', '.join(f'{k}={asked[k]!r}' for k in changed)
        flags = ' '.join(f'--{k}={saved[k]}' for k in changed)
        raise TrainError(f'{path} holds a model with {has}; this run asks for {wants}: pass '
                         f'{flags} (or its config file), or use a new --out_dir')
    if step >= cfg.max_iters and not ckpt.get('eval_cut'):  # a last evaluation cut short: run it
        raise TrainError(f'{path} is at step {step}, which --max_iters={cfg.max_iters} does not '
                         f'pass: set it higher')
    seed, cfg.seed = cfg.seed, ckpt['train_config']['seed']  # its random states are the run's
    kept = (*saved, 'init_from', 'out_dir')
    notes = []
    for k, v in ckpt['train_config'].items():
        if vars(cfg).get(k, v) != v and (k == 'block_size' or k not in kept):
            notes.append(f'{k}={vars(cfg)[k]!r} (was {v!r})')
    if seed != cfg.seed:
        notes.append(f'--seed={seed} is not used: the random states are restored from the '
                     f'checkpoint (seed {cfg.seed})')
    run.iter_num, run.best_val_loss = step, ckpt['best_val_loss']
    run.untrained_loss, run.eval_cut = ckpt.get('untrained_loss'), ckpt.get('eval_cut', False)
    run.saved = {'ckpt.pt': step}  # its last good checkpoint till a save
    if ckpt['data_state'].get('val_set') != run.data.val_set:  # losses that do not compare
        run.best_val_loss = math.inf
        run.untrained_loss = math.log(run.data.tok.vocab_size)  # a uniform model's
        notes.append("the validation set is not the checkpoint's (other data, block_size, "
                     'eval_iters or batch_size): the best loss starts over')
    run.optimizer.load_state_dict(ckpt['optimizer'])
    if ckpt.get('scaler') and run.scaler.is_enabled():  # float16 runs only
        run.scaler.load_state_dict(ckpt['scaler'])
    rng = ckpt['rng']
    random.setstate(rng['python'])
    np_state = np.array(rng['numpy'][1], dtype=np.uint32)
    np.random.set_state((rng['numpy'][0], np_state, *rng['numpy'][2:]))
    torch.set_rng_state(rng['torch'])
    cuda = rng['cuda']
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    data = ckpt['data_state']
    if (data['world_size'], data['train_tokens']) == (run.world_size, len(run.data.train)):
        run.gen.bit_generator.state = rng['batch'][run.rank]
    else:
        run.gen = np.random.default_rng([cfg.seed, run.rank, step])
        notes.append('the world size or the training data changed: the batches differ from a '
                     'straight run')
    if run.master and notes:
        print(f"resume: {', '.join(notes)}")


def get_batch(tokens, starts, block_size, device, data):
    """Inputs tokens[s : s+block_size] and targets tokens[s+1 : s+block_size+1] for each s."""
    xy = np.stack([tokens[s:s + block_size + 1] for s in starts])
    if xy.max() >= data.tok.vocab_size:  # --verify_data=False: before the embedding fails
        raise TrainError(f'a batch holds token id {xy.max()}, beyond the vocabulary of '
                         f'{data.tok.vocab_size}: the token files in {data.folder} are damaged or '
                         f'of another tokenizer: prepare them again (prepare_data.py)')
    xy = torch.from_numpy(xy.astype(np.int64))
    if device.type == 'cuda':
        xy = xy.pin_memory().to(device, non_blocking=True)
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()  # (B, T) each


def next_batch(cfg, run):
    """This rank's next batch; run.batch_state: the generator's state before it."""
    run.batch_state = run.gen.bit_generator.state
    starts = run.gen.integers(0, len(run.data.train) - cfg.block_size, cfg.batch_size)
    return get_batch(run.data.train, starts, cfg.block_size, run.device, run.data)


@torch.no_grad()
def estimate_loss(cfg, run):
    """Mean loss a token on the fixed val windows, split over ranks; None if a signal stopped it."""
    model = run.model
    if isinstance(model, DDP):
        model = run.model.module  # no gradient sync
    model.eval()
    total = torch.zeros(3, dtype=torch.float64)
    mine = run.data.val_starts[run.rank::run.world_size]
    for i in range(0, len(mine), cfg.batch_size):
        if run.stop:
            break
        starts = mine[i:i + cfg.batch_size]
        x, y = get_batch(run.data.val, starts, cfg.block_size, run.device, run.data)
        with run.ctx:
            loss = model(x, y)[1].item()
        total += torch.tensor([loss * len(x), len(x), 0], dtype=torch.float64)
    total[2] = run.stop
    if run.group is not None:
        dist.all_reduce(total, group=run.group)  # the stop too: every rank agrees
    model.train()
    if total[2]:  # the same on every rank: a signal on one stops all
        agreed_stop(run)
        return None
    return (total[0] / total[1]).item()


def get_lr(it, cfg):
    """Linear warmup for warmup_iters steps, cosine decay to min_lr at lr_decay_iters, min_lr."""
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it >= decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / (decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def check_finite(cfg, run):
    """Stop the run if a step had a loss or gradient norm not finite, on any rank (one sync)."""
    bad = run.bad.cpu()
    if run.group is not None:
        dist.all_reduce(bad, op=dist.ReduceOp.MIN, group=run.group)
    if bad.min() < NEVER:
        step = int(bad.min())
        what = 'loss'
        if bad[0] > bad[1]:
            what = 'gradient norm'
        diverged(run, f'the {what} is not finite (NaN or infinity) at step {step} (learning rate '
                      f'{get_lr(step - 1, cfg):.2e})')


def diverged(run, what):
    """The TrainError of a diverged run: nothing saved after it."""
    kept = 'no checkpoint was written'
    if run.earlier:
        kept = f"the earlier run's {' and '.join(run.earlier)} in {run.folder} stay as they were"
    if run.saved:
        name = 'ckpt.pt' if 'ckpt.pt' in run.saved else 'best.pt'
        kept = f'{run.folder / name} (step {run.saved[name]}) is the last good checkpoint'
    raise TrainError(f'{what}: training stopped without saving; {kept}. Likely causes: a learning '
                     f'rate too high (--learning_rate, --warmup_iters, --grad_clip), too strong a '
                     f'--weight_decay, bad data, or a damaged checkpoint resumed')


def catch_signals(cfg, run):
    """Ctrl-C, SIGTERM or SIGHUP now stops the run after its step, saved (run.stop: the signal);
    a second Ctrl-C quits at once, as does the first before a compiled model's first step (its
    compiles can outlast torchrun's 30 s grace) -> the handlers it replaced."""
    start = run.iter_num

    def request_stop(signum, frame):
        name = signal.Signals(signum).name
        if cfg.compile and run.iter_num == start:
            if run.master:
                print(f'\n{name}: nothing trained yet to save: quitting now', flush=True)
            raise SystemExit(128 + signum)
        run.stop = signum
        signal.signal(signum, handlers[signum])
        if run.master:
            print(f'\n{name}: stopping after this step (Ctrl-C again to quit now)', flush=True)
    handlers = {}
    if threading.current_thread() is threading.main_thread():  # the one that takes signals
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            handlers[sig] = signal.signal(sig, request_stop)
    return handlers


def main(argv=(), exit_when_stopped=False):
    """python train.py [config files] [--key=value ...] -> the losses logged: {'train': [(step,
    loss)], 'val': ...}; a run a signal stopped exits 128 + the signal if exit_when_stopped."""
    cfg = settings(list(argv))
    if cfg is None:
        return None
    created, handlers = not os.path.exists(cfg.out_dir), {}
    run = SimpleNamespace(folder=Path(cfg.out_dir), lock=None, saved={}, earlier=[], stop=0,
                          rank=0, world_size=1, group=None, device=cfg.device)
    try:
        start_processes(cfg, run)
        run.earlier = on_rank_0(lambda: claim(cfg, run), run.group)
        setup(cfg, run)
        handlers = catch_signals(cfg, run)
        history = train(cfg, run)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if run.lock is not None:  # removed while held (a run that locked this file retries)
            (run.folder / 'train.lock').unlink(missing_ok=True)
            run.lock.close()
        if created and run.rank == 0 and run.folder.is_dir() and not any(run.folder.iterdir()):
            run.folder.rmdir()  # a refused run leaves no folder behind
        if dist.is_initialized():
            dist.destroy_process_group()
    if run.stop and exit_when_stopped:
        raise SystemExit(128 + run.stop)  # 130, 143: a script can tell it from a finished run
    return history


def start_processes(cfg, run):
    """torchrun's processes (run.group: gloo for small messages), the device and dtype."""
    if 'RANK' in os.environ:
        run.rank, run.world_size = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
        if cfg.device.startswith('cuda'):
            run.device = f"cuda:{os.environ['LOCAL_RANK']}"
            torch.cuda.set_device(run.device)
            dist.init_process_group('nccl', device_id=torch.device(run.device))
        else:
            dist.init_process_group('gloo')
        run.group = dist.new_group(backend='gloo')
    run.device, run.master = torch.device(run.device), run.rank == 0
    run.dtype = resolve_dtype(cfg.dtype, run.device)
    if run.device.type == 'cuda':
        if run.dtype == 'bfloat16' and not torch.cuda.is_bf16_supported():
            run.dtype = 'float16'
        torch.set_float32_matmul_precision('high')  # TF32 matmuls where float32 remains
    run.ctx = nullcontext()
    if run.dtype != 'float32':
        run.ctx = torch.autocast(run.device.type, getattr(torch, run.dtype))


def train(cfg, run):
    """The training loop, from run.iter_num to max_iters -> the losses logged."""
    history, run.start = {'train': [], 'val': []}, run.iter_num
    run.batch = next_batch(cfg, run)
    t0, steps, loss_sum = time.time(), 0, torch.zeros((), device=run.device)
    while True:
        if evaluate_and_save(cfg, run, history):
            t0 = time.time()  # evaluation out of the timings
        if run.iter_num >= cfg.max_iters and not run.eval_cut:  # its evaluation ran whole: done
            break
        if agreed_stop(run):
            return stop(cfg, run, history)

        lr = get_lr(run.iter_num, cfg)
        for param_group in run.optimizer.param_groups:
            param_group['lr'] = lr
        loss = train_step(cfg, run)
        if loss is None:  # a signal came between micro-batches
            return stop(cfg, run, history)
        run.iter_num, steps, loss_sum = run.iter_num + 1, steps + 1, loss_sum + loss

        if run.iter_num % cfg.log_interval == 0 or run.iter_num == cfg.max_iters:
            log(cfg, run, history, lr, loss_sum, steps, t0)
            t0, steps, loss_sum = time.time(), 0, torch.zeros((), device=run.device)
    if run.master:
        best = ''
        if (run.folder / 'best.pt').exists():
            best = f' and best.pt (val loss {run.best_val_loss:.4f})'
        print(f'saved {run.folder / "ckpt.pt"} (step {run.iter_num}){best}; sample it with: '
              f'python sample.py --out_dir={cfg.out_dir}')
    if run.wandb:
        run.wandb.finish()
    run.stop = 0  # finished: a signal now changes nothing
    return history


def train_step(cfg, run):
    """One optimizer step on gradient_accumulation_steps micro-batches (the next fetched meanwhile)
    -> its mean loss; None if a signal came between micro-batches: the step is undone."""
    grad_accum = cfg.gradient_accumulation_steps // run.world_size
    first, step_loss = run.batch_state, torch.zeros((), device=run.device)
    for micro_step in range(grad_accum):
        if micro_step and agreed_stop(run):
            run.optimizer.zero_grad(set_to_none=True)
            run.batch_state = first  # a resume starts this step again
            return None
        sync = run.group is None or micro_step == grad_accum - 1  # DDP: all-reduced once
        with nullcontext() if sync else run.model.no_sync(), run.ctx:
            _, loss = run.model(*run.batch)
        run.batch = next_batch(cfg, run)  # while the accelerator works
        run.scaler.scale(loss / grad_accum).backward()
        step_loss += loss.detach() / grad_accum
    run.scaler.unscale_(run.optimizer)  # float16: the true gradients, to clip and check
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip or math.inf)
    grad_finite = grad_norm.isfinite() | run.scaler.is_enabled()
    finite = torch.stack([step_loss.isfinite(), grad_finite])
    new_bad = ~finite & (run.bad == NEVER)
    run.bad = torch.where(new_bad, run.iter_num + 1, run.bad)  # no sync: check_finite acts
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    return step_loss


def evaluate_and_save(cfg, run, history):
    """At an evaluation step: the val loss, logged; ckpt.pt and best.pt saved as due -> whether it
    evaluated. Not again at the step a run resumes from, unless a stop cut it short."""
    fresh = run.iter_num > run.start or run.eval_cut
    due = run.iter_num % cfg.eval_interval == 0 or run.iter_num >= cfg.max_iters
    if not due:
        return False
    if not fresh and cfg.init_from == 'resume':  # evaluated before the run stopped
        return False
    check_finite(cfg, run)
    val_loss = estimate_loss(cfg, run)
    run.eval_cut = val_loss is None
    if val_loss is None:  # a signal stopped it
        return True
    if run.untrained_loss is None:
        run.untrained_loss = val_loss
    check_blow_up(run, val_loss)
    history['val'].append((run.iter_num, val_loss))
    new_best = fresh and val_loss < run.best_val_loss
    if new_best:
        run.best_val_loss = val_loss
    if run.master:
        line = f'step {run.iter_num}: val loss {val_loss:.4f}'
        if cfg.tokenizer == 'bytes':
            line += f', {val_loss / math.log(2):.4f} bits per byte'
        if new_best:
            line += ' (best)'
        print(line, flush=True)
    if run.wandb:
        lr = get_lr(run.iter_num, cfg)
        run.wandb.log({'iter': run.iter_num, 'val/loss': val_loss, 'lr': lr})
    names = []
    if fresh and (cfg.always_save_checkpoint or run.iter_num >= cfg.max_iters):
        names.append('ckpt.pt')
    if new_best:
        names.append('best.pt')
    if names:
        save(cfg, run, names)
    return True


def check_blow_up(run, val_loss):
    """Stop the run, unsaved, if the val loss is not finite or BLOW_UP above the untrained's."""
    at = f'the validation loss is {val_loss:.4f} at step {run.iter_num}'
    if not math.isfinite(val_loss):
        diverged(run, f'{at}: not finite')
    if val_loss > run.untrained_loss + BLOW_UP:
        diverged(run, f"{at}, more than {BLOW_UP} above the untrained model's "
                      f'{run.untrained_loss:.4f}')


def agreed_stop(run):
    """The signal that stops the run (0: none): any rank's stops all."""
    if run.group is not None:
        stop = torch.tensor([float(run.stop)])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=run.group)
        run.stop = int(stop.item())
    return run.stop


def stop(cfg, run, history):
    """Save the steps trained since the last save, unless an --overwrite run has not replaced the
    earlier run yet (it stays whole) -> the losses logged."""
    trained = run.start < run.iter_num and not run.earlier
    if trained and run.iter_num != run.saved.get('ckpt.pt'):
        check_finite(cfg, run)
        save(cfg, run, ['ckpt.pt'])
    if not run.master:
        return history
    if trained:
        print(f'saved {run.folder / "ckpt.pt"} at step {run.iter_num}; continue with '
              f'--init_from=resume')
    elif run.earlier:
        print(f'stopped at step {run.iter_num}: nothing saved (the earlier run\'s '
              f"{' and '.join(run.earlier)} in {run.folder} stay)")
    else:
        print(f'stopped at step {run.iter_num}: nothing saved')
    return history


def log(cfg, run, history, lr, loss_sum, steps, t0):
    """The mean loss of the steps since t0: history, a line with speed, memory, time left."""
    check_finite(cfg, run)
    lossf = loss_sum.item() / steps  # waits for the GPU: the timing is right
    dt = (time.time() - t0) / steps
    history['train'].append((run.iter_num, lossf))  # this rank's, averaged since the last log
    tok_s = run.tokens_per_iter / dt
    if run.master:
        line = f'iter {run.iter_num}/{cfg.max_iters}: loss {lossf:.4f}, lr {lr:.2e}, ' \
               f'{tok_s:,.0f} tok/s'
        if run.device.type == 'cuda':
            line += f', mfu {100 * run.raw_model.estimate_mfu(tok_s / run.world_size):.1f}%'
        left = round(dt * (cfg.max_iters - run.iter_num))  # s, at the mean step since the last
        print(f'{line}, mem {peak_memory(run.device):.2f}GB, {1000 * dt:.1f}ms/iter, '
              f'{left // 60}m {left % 60}s left', flush=True)
    if run.wandb:
        run.wandb.log({'iter': run.iter_num, 'train/loss': lossf, 'lr': lr, 'tok_s': tok_s})


if __name__ == '__main__':
    quit_on_sigterm()
    run_main(lambda argv: main(argv, exit_when_stopped=True), TrainError, CheckpointError)
