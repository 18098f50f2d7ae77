"""
Train a language model of model.py: Factorization Memory, or another mixer (--help lists them).

    python train.py                                   # small FM model, default corpus, a few minutes on a CPU
    python train.py config/fm_small.py --max_iters=2000 --batch_size=32
    torchrun --standalone --nproc_per_node=8 train.py config/fm_1b.py   # DDP (NCCL; gloo with --device=cpu)
Continue from out_dir/ckpt.pt with --init_from=resume. Nothing is lost: out_dir holds one run; saves are whole; a
value that is not finite or a blow-up stops the run unsaved; Ctrl-C or SIGTERM saves the step (resume goes on bit for
bit); --overwrite=True replaces the earlier run once a checkpoint is whole.
"""
import fcntl
import importlib.util
import math
import os
import random
import re
import resource
import signal
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, fields
from pathlib import Path
from types import SimpleNamespace

from configurator import ConfigError, help_text, load_config, optional_types, quit_on_ctrl_c, run_main, setting_notes

if __name__ == '__main__':
    quit_on_ctrl_c()

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import model as model_file
from checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint, nonfinite, save_checkpoint
from devices import DTYPES, check_batch_fits, check_device, resolve_dtype
from model import Model, ModelConfig
from prepare_data import dataset_dir, get_tokenizer, load_tokens, prepare

# default settings: a small FM model on the default corpus, minutes on a CPU
out_dir = 'out'  # the run's folder: ckpt.pt (the last step), best.pt (the best validation loss)
eval_interval = 100  # steps between evaluations, each writing ckpt.pt (and best.pt when val improves)
eval_iters = 16  # the validation set is eval_iters * batch_size fixed windows
log_interval = 10  # steps between log lines
always_save_checkpoint = True  # False: write ckpt.pt only at the end (best.pt whenever val improves)
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
mixer = 'fm'  # a mixer listed below, or module:Class extending one (e.g. research.levers:RowRatesFM)
n_layer = 4  # blocks
d_model = 128  # width of the residual stream
# fm
n_memory = 32  # m, memory rows
top_k = 8  # k rows read and written per token; None: dense
fm_conv = 4  # FM's block, not in the paper: a 4-tap convolution on xbar (0: none; config/paper_layer.py)
fm_gate = True  # FM's block, not in the paper: an output gate (False: none)

chunk_size = 16  # [fm, mamba2] tokens a chunk of the parallel scans: 16 is fastest for FM's PyTorch scan on a CPU

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
dtype = 'auto'  # 'float32', 'bfloat16' or 'float16' (autocast); 'auto': bfloat16 on CUDA, else float32
compile = False  # torch.compile the model
seed = 1337  # seed of the initial weights and of the batches
_TRAIN_KEYS = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (bool, int, float, str))]
AT_LEAST = dict(batch_size=1, block_size=1, gradient_accumulation_steps=1, max_iters=1, warmup_iters=0, eval_interval=1,
                eval_iters=1, log_interval=1, lr_decay_iters=0, min_lr=0, weight_decay=0, grad_clip=0, vocab_multiple=1,
                seed=0)
BLOW_UP = 0.5  # nats above the untrained model's validation loss: a blow-up (early noise moves it ~0.1)
EVAL_SEED = 2024  # of the validation windows alone: runs of other seeds compare
RUN_FILES = ('ckpt.pt', 'best.pt', 'routing.json', 'routing.png')  # a run's files (eval.py writes routing)
NEVER = 2 ** 62  # the step of a loss or gradient norm not finite, while there is none


class TrainError(RuntimeError):
    """A problem the user can fix (data, checkpoint, settings, a diverged run): the message says how."""


def default_config():
    """The settings above, and every other ModelConfig field at its default."""
    return {k: globals()[k] for k in _TRAIN_KEYS} | {f.name: f.default for f in fields(ModelConfig)
                                                    if f.name != 'vocab_size' and f.name not in _TRAIN_KEYS}


def model_args(cfg):
    return {f.name: getattr(cfg, f.name) for f in fields(ModelConfig) if f.name != 'vocab_size'}


def settings(argv):
    """argv -> the run's settings (None for --help); ConfigError for one out of range."""
    defaults = default_config()
    if '-h' in argv or '--help' in argv:
        mixers = ', '.join(f'{name} ({cls.__name__})' for name, cls in model_file.MIXER_CLASSES.items())
        return print(f'{__doc__}\nsettings (--key=value; [fm], [attn], [mamba2]: the model settings of one mixer):\n'
                     f'{help_text(defaults, __file__, model_file.__file__)}\nmixers: {mixers}')
    cfg = SimpleNamespace(**load_config(defaults, argv, optional_types(ModelConfig)))
    world_size = int(os.environ.get('WORLD_SIZE', '1'))  # torchrun's
    for refused, message in (
            (cfg.init_from not in ('scratch', 'resume'), f"--init_from={cfg.init_from!r}: use 'scratch' or 'resume'"),
            (cfg.dtype not in DTYPES, f"--dtype={cfg.dtype!r}: use one of {', '.join(DTYPES)}"),
            *[(not getattr(cfg, key) >= low, f'--{key}={getattr(cfg, key)} is out of range: set it to at least {low}')
              for key, low in AT_LEAST.items()],
            (not cfg.out_dir, '--out_dir is empty: name the folder the checkpoints go to'),
            (cfg.gradient_accumulation_steps % world_size, f'--gradient_accumulation_steps counts micro-batches over '
             f'all {world_size} processes: make it a multiple of {world_size}'),
            (not cfg.learning_rate > 0, f'--learning_rate={cfg.learning_rate} is out of range: set it above 0'),
            (cfg.min_lr > cfg.learning_rate, f'--min_lr={cfg.min_lr} is above --learning_rate={cfg.learning_rate}: '
             f'the cosine decays from learning_rate to min_lr; set min_lr lower (e.g. learning_rate / 10)'),
            (cfg.warmup_iters > cfg.max_iters, f'--warmup_iters={cfg.warmup_iters} is beyond --max_iters='
             f'{cfg.max_iters}: set at most {cfg.max_iters}'),
            (0 < cfg.lr_decay_iters <= cfg.warmup_iters, f'--lr_decay_iters={cfg.lr_decay_iters} is not after '
             f'--warmup_iters={cfg.warmup_iters}: set it above warmup_iters (or 0: max_iters)'),
            (cfg.hf_config and not cfg.dataset.startswith('hf:'),
             f'--hf_config={cfg.hf_config} applies to hf: datasets only: drop it, or pass --dataset=hf:NAME'),
            *[(not 0 <= getattr(cfg, key) < 1, f'--{key}={getattr(cfg, key)} is out of range: set it to at least 0 '
               f'and below 1') for key in ('beta1', 'beta2')],
            (os.path.isfile(cfg.data_dir), f'--data_dir={cfg.data_dir} is a file: give the folder of prepare_data.py'),
            (cfg.wandb_log and not importlib.util.find_spec('wandb'), '--wandb_log=True needs wandb: pip install it')):
        if refused:
            raise ConfigError(message)
    try:
        config = ModelConfig(**model_args(cfg), vocab_size=get_tokenizer(cfg.tokenizer).vocab_size)
        with torch.device('meta'):  # a mixer of one's own checks its settings when built
            n_params = Model(config).num_params(non_embedding=False)
    except (ValueError, ImportError, RuntimeError) as e:
        raise ConfigError(str(e)) from None
    notes = setting_notes(defaults, __file__, model_file.__file__)  # {key: '[fm] comment'}
    tags = {k: tag[1].split(', ') for k, note in notes.items() if (tag := re.match(r'\[([\w, ]+)\] ', note))}
    ignored = [k for k, mixers in tags.items() if config.family not in mixers and getattr(cfg, k) != defaults[k]]
    if ignored and cfg.init_from == 'scratch' and any(config.family in mixers for mixers in tags.values()):
        mixers = ', '.join(sorted({mixer for k in ignored for mixer in tags[k]}))
        print(f"warning: --mixer={cfg.mixer} ignores {', '.join(f'--{k}={getattr(cfg, k)!r}' for k in ignored)} "
              f'(settings of {mixers}): not used, and recorded at the default')
        vars(cfg).update({k: defaults[k] for k in ignored})
    if config.family == 'fm' and cfg.chunk_size > cfg.block_size:
        print(f"warning: --chunk_size={cfg.chunk_size} is above --block_size={cfg.block_size}: FM's scan pads each "
              f"sequence to a whole chunk (10 times slower); set chunk_size at most {cfg.block_size}")
    check_device(cfg.device)
    check_batch_fits(cfg.batch_size, cfg.block_size, config, n_params, torch.device(cfg.device))
    if cfg.dtype == 'float16' and torch.device(cfg.device).type == 'cpu':
        print("warning: --dtype=float16 on the CPU is slow (10 times float32's step): use --dtype=float32")
    return cfg


def claim(cfg, run):
    """Rank 0's lock on out_dir -> the earlier run's files this run replaces; refuses a second run, or one over it."""
    lock = run.folder / 'train.lock'
    while run.lock is None:  # until the file locked is the one at lock (a run ending removes it)
        try:
            run.folder.mkdir(parents=True, exist_ok=True)
            run.lock = open(lock, 'a+')
            fcntl.flock(run.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder, run.lock = run.lock.seek(0) or run.lock.read().strip() or 'a process that is starting', None
            raise TrainError(f'{run.folder} is in use by {holder}: wait for it, or use another --out_dir') from None
        except OSError as e:  # no folder, or a file system without locks (Lustre's)
            if run.lock is None:
                reason = 'it is a file' if run.folder.is_file() else e.strerror
                raise TrainError(f'cannot write --out_dir={run.folder} ({reason}): pass a writable folder') from None
            print(f'warning: cannot lock {lock} ({e.strerror}): nothing stops a second run in {run.folder}')
        if not lock.exists() or lock.stat().st_ino != os.fstat(run.lock.fileno()).st_ino:
            run.lock = run.lock.close()
    run.lock.truncate(0)
    print(f'process {os.getpid()} on {os.uname().nodename}, since {time.strftime("%F %T")}', file=run.lock, flush=True)
    if (run.folder / 'replacing').exists():  # the new files are whole: finish the swap
        swap_in(run.folder, (run.folder / 'replacing').read_text().split())
    for name in ('ckpt.pt', 'best.pt', 'replacing'):  # half-written by a killed run
        (run.folder / f'{name}.tmp').unlink(missing_ok=True)
    earlier = [name for name in RUN_FILES if (run.folder / name).exists()]
    if cfg.init_from == 'scratch' and {'ckpt.pt', 'best.pt'} & set(earlier) and not cfg.overwrite:
        raise TrainError(f'{run.folder} holds {" and ".join(n for n in earlier if n.endswith(".pt"))} of an earlier '
                         f'run: continue it (--init_from=resume), use a new --out_dir, or pass --overwrite=True')
    return earlier if cfg.init_from == 'scratch' else []


def save(cfg, run, names):
    """Write names (ckpt.pt, best.pt) whole, then rename them in, if finite; the first removes the earlier run's."""
    batches, np_state, model_config = [run.batch_state], np.random.get_state(), asdict(run.raw_model.config)
    if run.group is not None:
        batches = [None] * run.world_size
        dist.all_gather_object(batches, run.batch_state, group=run.group)
    ckpt = {'model': run.raw_model.state_dict(), 'optimizer': run.optimizer.state_dict(),  # all a resume needs
            'scaler': run.scaler.state_dict(), 'model_config': model_config, 'tokenizer': cfg.tokenizer,
            'train_config': {k: model_config.get(k, v) for k, v in vars(cfg).items()},
            'iter_num': run.iter_num, 'best_val_loss': run.best_val_loss, 'untrained_loss': run.untrained_loss,
            'eval_cut': run.eval_cut,  # a stop cut this step's evaluation: a resume runs it
            'rng': {'python': random.getstate(), 'numpy': (np_state[0], np_state[1].tolist(), *np_state[2:]),
                    'torch': torch.get_rng_state(), 'batch': batches,
                    'cuda': torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None},
            'data_state': {'folder': str(run.data.folder), 'train_tokens': len(run.data.train), 'world_size':
                           run.world_size, 'val_set': run.data.val_set, 'tokens_seen': run.iter_num *
                           run.tokens_per_iter}}
    state = {**ckpt['model'], **{f"the optimizer's {key} of parameter {i}": value
                                 for i, values in ckpt['optimizer']['state'].items() for key, value in values.items()}}
    broken = nonfinite(state)
    if broken:
        diverged(run, f'{broken[0]} is not finite (NaN or infinity) at step {run.iter_num}')
    then = 'continue with --init_from=resume' if 'ckpt.pt' in run.saved else 'start this run again' + (
        ' with --overwrite=True (the earlier run is untouched)' if run.earlier else '')
    gone = [name for name in run.earlier if name != names[0]]  # the earlier names[0] is replaced by a rename

    def write():  # rank 0's part
        try:
            for name in names:
                save_checkpoint(ckpt, run.folder / name, then, rename=False)
        except CheckpointError:  # e.g. a full disk: no whole .tmp of this save stays either
            for name in names:
                (run.folder / f'{name}.tmp').unlink(missing_ok=True)
            raise
        if run.earlier:
            (run.folder / 'replacing.tmp').write_text('\n'.join(gone))
            os.replace(run.folder / 'replacing.tmp', run.folder / 'replacing')
        swap_in(run.folder, gone)
    on_rank_0(write, run.group)
    if run.earlier and run.master:
        print(f"replaced the earlier run's {' and '.join(run.earlier)} in {run.folder}")
    run.earlier = []
    run.saved.update(dict.fromkeys(names, run.iter_num))


def swap_in(folder, gone):
    """Remove the earlier run's files gone, rename the whole .tmp checkpoints in, then remove the journal: out_dir
    holds one run's files at every point, and each step can be done again."""
    if any(folder.glob('*.pt.tmp')):  # none once all are renamed in: gone is gone
        for name in gone:
            (folder / name).unlink(missing_ok=True)
    for name in ('ckpt.pt', 'best.pt'):
        if (folder / f'{name}.tmp').exists():
            os.replace(folder / f'{name}.tmp', folder / name)
    (folder / 'replacing').unlink(missing_ok=True)


def on_rank_0(step, group):
    """step() on rank 0 -> its result, or its error raised, on every rank (which would wait forever else)."""
    shared = [None, None]  # the result, the error
    if group is None or dist.get_rank() == 0:
        try:
            shared[0] = step()
        except Exception as e:  # e.g. a full disk while preparing the data
            shared[1] = e if isinstance(e, (TrainError, CheckpointError)) else TrainError(
                str(e) if isinstance(e, (OSError, ValueError, RuntimeError)) else repr(e))
    if group is not None:
        dist.broadcast_object_list(shared, src=0, group=group)
    if shared[1] is not None:
        raise shared[1]
    return shared[0]


def setup(cfg, run):
    """The data, the model, its optimizer and loss scaler, the batch generator: new, or as ckpt.pt left them."""
    folder = dataset_dir(cfg.dataset, cfg.tokenizer, cfg.data_dir, cfg.hf_config or None)
    if cfg.dataset == 'default':
        on_rank_0(lambda: prepare(dataset='default', tokenizer=cfg.tokenizer, data_dir=cfg.data_dir), run.group)
    if not (folder / 'train.bin').exists():
        raise TrainError(f'no dataset at {folder}. Prepare it with:\n  python prepare_data.py --dataset {cfg.dataset} '
                         f'--tokenizer {cfg.tokenizer}' + f' --data_dir {cfg.data_dir}' * bool(cfg.data_dir) +
                         f' --hf_config {cfg.hf_config}' * bool(cfg.hf_config))
    tok, verify = get_tokenizer(cfg.tokenizer), cfg.verify_data and os.environ.get('LOCAL_RANK', '0') == '0'
    try:  # one process a node checks the token files
        train, val = (load_tokens(folder / f'{split}.bin', cfg.tokenizer, tok.vocab_size, verify=verify).tokens
                      for split in ('train', 'val'))
    except (ValueError, FileNotFoundError) as e:
        raise TrainError(str(e)) from None
    for name, tokens in (('train', train), ('val', val)):
        if len(tokens) < cfg.block_size + 1:
            raise TrainError(f'{name}.bin in {folder} holds {len(tokens)} tokens: set --block_size below that, or use '
                             f'more data')
    windows = cfg.eval_iters * cfg.batch_size  # fixed validation windows
    run.data = SimpleNamespace(tok=tok, folder=folder, train=train, val=val, val_set=[str(folder), len(val),
                               cfg.block_size, windows], val_starts=np.random.default_rng(EVAL_SEED).integers(
                                   0, len(val) - cfg.block_size, windows))
    run.iter_num, run.best_val_loss, run.untrained_loss, run.eval_cut = 0, math.inf, None, False
    ckpt = load_checkpoint(run.folder / 'ckpt.pt') if cfg.init_from == 'resume' else None
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # the same weights on every rank
    vocab_size = run.data.tok.vocab_size
    vocab_size = -(-vocab_size // cfg.vocab_multiple) * cfg.vocab_multiple if vocab_size > 256 else vocab_size
    run.raw_model = Model(ModelConfig(**model_args(cfg), vocab_size=vocab_size)) if ckpt is None else \
        model_from_checkpoint(ckpt, run.folder / 'ckpt.pt')
    run.raw_model.config.block_size = cfg.block_size  # a resume trains at this run's context
    run.raw_model.to(run.device)
    run.optimizer = run.raw_model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2),
                                                       run.device.type)
    run.scaler = torch.amp.GradScaler(run.device.type, enabled=run.dtype == 'float16')
    run.gen = np.random.default_rng([cfg.seed, run.rank])  # this rank's batches
    if ckpt is not None:
        resume(cfg, run, ckpt)
    run.bad = torch.full((2,), NEVER, device=run.device)  # the first bad step of the loss, the gradient norm
    run.tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
    if run.master:
        print(f'device {run.device}, dtype {run.dtype}, world size {run.world_size}, tokens per step '
              f'{run.tokens_per_iter:,} ({cfg.gradient_accumulation_steps} x {cfg.batch_size} x {cfg.block_size})\n'
              f'model: {run.raw_model.config}\nparameters: {run.raw_model.num_params(non_embedding=False):,} '
              f'({run.raw_model.num_params():,} without embeddings)')
    run.wandb = cfg.wandb_log and run.master and __import__('wandb').init(
        project=cfg.wandb_project, name=cfg.wandb_run_name, config=vars(cfg))  # a wandb Run, or False
    run.model = torch.compile(run.raw_model) if cfg.compile else run.raw_model
    if run.group is not None:
        run.model = DDP(run.model, device_ids=[run.device.index] if run.device.type == 'cuda' else None)


def resume(cfg, run, ckpt):
    """Go on from ckpt (its step, losses, optimizer, random states) as if the run had not stopped."""
    path, step = run.folder / 'ckpt.pt', ckpt['iter_num']
    saved = asdict(run.raw_model.config) | {'tokenizer': ckpt['tokenizer']}
    asked = asdict(ModelConfig(**model_args(cfg), vocab_size=saved['vocab_size'])) | {'tokenizer': cfg.tokenizer}
    changed = [k for k, v in saved.items() if k != 'block_size' and asked[k] != v]
    if changed:
        raise TrainError(f'{path} holds a model with {", ".join(f"{k}={saved[k]!r}" for k in changed)}; this run asks '
                         f'for {", ".join(f"{k}={asked[k]!r}" for k in changed)}: pass '
                         f'{" ".join(f"--{k}={saved[k]}" for k in changed)} (or its config file), or use a new '
                         f'--out_dir')
    if step >= cfg.max_iters and not ckpt.get('eval_cut'):  # a last evaluation cut short: run it
        raise TrainError(f'{path} is at step {step}, which --max_iters={cfg.max_iters} does not pass: set it higher')
    seed, cfg.seed = cfg.seed, ckpt['train_config']['seed']  # its random states are restored: its seed is the run's
    notes = [f'{k}={vars(cfg)[k]!r} (was {v!r})' for k, v in ckpt['train_config'].items() if vars(cfg).get(k, v) != v
             and (k == 'block_size' or k not in (*saved, 'init_from', 'out_dir'))] + [f'--seed={seed} is not used: '
             f'the random states are restored from the checkpoint (seed {cfg.seed})'] * (seed != cfg.seed)
    run.iter_num, run.best_val_loss, run.untrained_loss = step, ckpt['best_val_loss'], ckpt.get('untrained_loss')
    run.eval_cut, run.saved = ckpt.get('eval_cut', False), {'ckpt.pt': step}  # its last good checkpoint till a save
    if ckpt['data_state'].get('val_set') != run.data.val_set:  # losses that do not compare
        run.best_val_loss, run.untrained_loss = math.inf, math.log(run.data.tok.vocab_size)  # a uniform model's
        notes.append("the validation set is not the checkpoint's (other data, block_size, eval_iters or batch_size): "
                     'the best loss starts over')
    run.optimizer.load_state_dict(ckpt['optimizer'])
    if ckpt.get('scaler') and run.scaler.is_enabled():  # float16 runs only
        run.scaler.load_state_dict(ckpt['scaler'])
    rng = ckpt['rng']
    random.setstate(rng['python'])
    np.random.set_state((rng['numpy'][0], np.array(rng['numpy'][1], dtype=np.uint32), *rng['numpy'][2:]))
    torch.set_rng_state(rng['torch'])
    if rng['cuda'] is not None and torch.cuda.is_available() and len(rng['cuda']) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng['cuda'])
    if (ckpt['data_state']['world_size'], ckpt['data_state']['train_tokens']) == (run.world_size, len(run.data.train)):
        run.gen.bit_generator.state = rng['batch'][run.rank]
    else:
        run.gen = np.random.default_rng([cfg.seed, run.rank, step])
        notes.append('the world size or the training data changed: the batches differ from a straight run')
    if run.master and notes:
        print(f"resume: {', '.join(notes)}")


def get_batch(tokens, starts, block_size, device, data):
    """Inputs tokens[s : s+block_size] and targets tokens[s+1 : s+block_size+1] for each start s."""
    xy = np.stack([tokens[s:s + block_size + 1] for s in starts])
    if xy.max() >= data.tok.vocab_size:  # --verify_data=False: before the embedding fails
        raise TrainError(f'a batch holds token id {xy.max()}, beyond the vocabulary of {data.tok.vocab_size}'
                         f': the token files in {data.folder} are damaged or of another tokenizer: prepare them again '
                         f'(prepare_data.py)')
    xy = torch.from_numpy(xy.astype(np.int64))
    if device.type == 'cuda':
        xy = xy.pin_memory().to(device, non_blocking=True)
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()  # (B, T) each


def next_batch(cfg, run):
    """This rank's next random batch; run.batch_state: the generator's state before it, for a resume."""
    run.batch_state = run.gen.bit_generator.state
    starts = run.gen.integers(0, len(run.data.train) - cfg.block_size, cfg.batch_size)
    return get_batch(run.data.train, starts, cfg.block_size, run.device, run.data)


@torch.no_grad()
def estimate_loss(cfg, run):
    """Mean loss per token over the fixed validation windows, split over the ranks; None if a signal stopped it."""
    model = run.model.module if isinstance(run.model, DDP) else run.model  # no gradient sync
    model.eval()
    total, mine = torch.zeros(3, dtype=torch.float64), run.data.val_starts[run.rank::run.world_size]
    for i in range(0, len(mine), cfg.batch_size):
        if run.stop:
            break
        x, y = get_batch(run.data.val, mine[i:i + cfg.batch_size], cfg.block_size, run.device, run.data)
        with run.ctx:
            total += torch.tensor([model(x, y)[1].item() * len(x), len(x), 0], dtype=torch.float64)
    total[2] = run.stop
    if run.group is not None:
        dist.all_reduce(total, group=run.group)  # the stop too: every rank agrees
    model.train()
    run.stop = bool(total[2])
    return None if run.stop else (total[0] / total[1]).item()


def get_lr(it, cfg):
    """Linear warmup for warmup_iters steps, cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it >= decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / (decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def check_finite(cfg, run):
    """Stop the run if a step so far had a loss or gradient norm not finite, on any rank (one sync)."""
    bad = run.bad.cpu()
    if run.group is not None:
        dist.all_reduce(bad, op=dist.ReduceOp.MIN, group=run.group)
    if bad.min() < NEVER:
        step = int(bad.min())
        diverged(run, f'the {"loss" if bad[0] <= bad[1] else "gradient norm"} is not finite (NaN or infinity) at step '
                      f'{step} (learning rate {get_lr(step - 1, cfg):.2e})')


def diverged(run, what):
    """The TrainError of a diverged run: nothing is saved after it."""
    name = 'ckpt.pt' if 'ckpt.pt' in run.saved else 'best.pt'
    kept = (f'{run.folder / name} (step {run.saved[name]}) is the last good checkpoint' if run.saved else
            f"the earlier run's {' and '.join(run.earlier)} in {run.folder} stay as they were" if run.earlier else
            'no checkpoint was written')
    raise TrainError(f'{what}: training stopped without saving; {kept}. Likely causes: a learning rate too high '
                     f'(--learning_rate, --warmup_iters, --grad_clip), bad data, or a damaged checkpoint resumed')


def catch_signals(cfg, run):
    """Ctrl-C or SIGTERM now stops the run after its step, saved; a second Ctrl-C quits at once, as does the first
    before a compiled model's first step (its compiles can outlast torchrun's 30 s grace)."""
    start = run.iter_num

    def request_stop(signum, frame):
        if cfg.compile and run.iter_num == start:
            if run.master:
                print(f'\n{signal.Signals(signum).name}: nothing trained yet to save: quitting now', flush=True)
            raise SystemExit(128 + signum)
        run.stop = True
        signal.signal(signum, run.handlers[signum])
        if run.master:
            print(f'\n{signal.Signals(signum).name}: stopping after this step (Ctrl-C again to quit now)', flush=True)
    if threading.current_thread() is threading.main_thread():  # the one that takes signals
        run.handlers = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}


def main(argv=()):
    """python train.py [config files] [--key=value ...] -> the losses logged: {'train': [(step, loss)], 'val': ...}."""
    cfg = settings(list(argv))
    if cfg is None:
        return None
    run = SimpleNamespace(folder=Path(cfg.out_dir), created=not os.path.exists(cfg.out_dir), lock=None, handlers={},
                          saved={}, earlier=[], stop=False, rank=0, world_size=1, group=None, device=cfg.device)
    try:
        if 'RANK' in os.environ:  # torchrun's; run.group: gloo for small messages
            run.rank, local_rank, run.world_size = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE'))
            if cfg.device.startswith('cuda'):
                run.device = f'cuda:{local_rank}'
                torch.cuda.set_device(run.device)
                dist.init_process_group('nccl', device_id=torch.device(run.device))
            else:
                dist.init_process_group('gloo')
            run.group = dist.new_group(backend='gloo')
        run.device, run.master = torch.device(run.device), run.rank == 0
        run.dtype = resolve_dtype(cfg.dtype, run.device)
        if run.device.type == 'cuda':
            run.dtype = 'float16' if run.dtype == 'bfloat16' and not torch.cuda.is_bf16_supported() else run.dtype
            torch.set_float32_matmul_precision('high')  # TF32 matmuls where float32 remains
        half = getattr(torch, run.dtype)
        run.ctx = nullcontext() if run.dtype == 'float32' else torch.autocast(run.device.type, half)
        run.earlier = on_rank_0(lambda: claim(cfg, run), run.group)
        setup(cfg, run)
        catch_signals(cfg, run)
        return train(cfg, run)
    finally:
        for sig, handler in run.handlers.items():
            signal.signal(sig, handler)
        if run.lock is not None:
            (run.folder / 'train.lock').unlink(missing_ok=True)  # while held (a run that locked this file retries)
            run.lock.close()
        if run.created and run.rank == 0 and run.folder.is_dir() and not any(run.folder.iterdir()):
            run.folder.rmdir()  # a refused run leaves no folder behind
        if dist.is_initialized():
            dist.destroy_process_group()


def train(cfg, run):
    """The training loop, from run.iter_num to max_iters -> the losses logged."""
    history, start, resumed = {'train': [], 'val': []}, run.iter_num, cfg.init_from == 'resume'
    grad_accum, tokens_per_iter = cfg.gradient_accumulation_steps // run.world_size, run.tokens_per_iter
    X, Y = next_batch(cfg, run)
    t_log, steps_since_log, loss_sum = time.time(), 0, torch.zeros((), device=run.device)
    while True:
        # evaluate and save (not again right after resuming, unless a stop cut the evaluation short)
        fresh = run.iter_num > start or run.eval_cut
        if (run.iter_num % cfg.eval_interval == 0 or run.iter_num >= cfg.max_iters) and (fresh or not resumed):
            check_finite(cfg, run)
            val_loss = estimate_loss(cfg, run)
            run.eval_cut = val_loss is None
            if val_loss is not None:  # None: a signal stopped it
                run.untrained_loss = val_loss if run.untrained_loss is None else run.untrained_loss
                if not (math.isfinite(val_loss) and val_loss <= run.untrained_loss + BLOW_UP):
                    diverged(run, f'the validation loss is {val_loss:.4f} at step {run.iter_num}' + (
                        f", more than {BLOW_UP} above the untrained model's {run.untrained_loss:.4f}" if
                        math.isfinite(val_loss) else ': not finite'))
                history['val'].append((run.iter_num, val_loss))
                new_best = fresh and val_loss < run.best_val_loss
                run.best_val_loss = val_loss if new_best else run.best_val_loss
                if run.master:
                    bpb = f', {val_loss / math.log(2):.4f} bits per byte' if cfg.tokenizer == 'bytes' else ''
                    print(f'step {run.iter_num}: val loss {val_loss:.4f}{bpb}{" (best)" * new_best}', flush=True)
                if run.wandb:
                    run.wandb.log({'iter': run.iter_num, 'val/loss': val_loss, 'lr': get_lr(run.iter_num, cfg)})
                last = cfg.always_save_checkpoint or run.iter_num >= cfg.max_iters
                if fresh and (last or new_best):
                    save(cfg, run, ['ckpt.pt'] * last + ['best.pt'] * new_best)
            t_log = time.time()  # evaluation out of the timings
        if run.iter_num >= cfg.max_iters and not run.eval_cut:  # its evaluation ran whole: done
            break
        if run.group is not None:  # a signal on any rank stops every rank here
            stop = torch.tensor([float(run.stop)])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=run.group)
            run.stop = bool(stop.item())
        if run.stop:  # an --overwrite run not yet saved keeps the earlier run whole
            if not run.earlier and start < run.iter_num != run.saved.get('ckpt.pt'):  # a step trained, not saved
                check_finite(cfg, run)
                save(cfg, run, ['ckpt.pt'])
            if run.master:
                print(f'saved {run.folder / "ckpt.pt"} at step {run.iter_num}; continue with --init_from=resume' if
                      start < run.iter_num and not run.earlier else f'stopped at step {run.iter_num}: nothing saved' +
                      f" (the earlier run's {' and '.join(run.earlier)} in {run.folder} stay)" * bool(run.earlier))
            return history

        lr = get_lr(run.iter_num, cfg)
        for param_group in run.optimizer.param_groups:
            param_group['lr'] = lr
        step_loss = torch.zeros((), device=run.device)
        for micro_step in range(grad_accum):
            sync = run.group is None or micro_step == grad_accum - 1  # DDP: the gradients all-reduced once
            with nullcontext() if sync else run.model.no_sync(), run.ctx:
                _, loss = run.model(X, Y)
            X, Y = next_batch(cfg, run)  # while the accelerator works
            run.scaler.scale(loss / grad_accum).backward()
            step_loss += loss.detach() / grad_accum
        run.scaler.unscale_(run.optimizer)  # float16: the true gradients, to clip and check
        grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip or math.inf)
        finite = torch.stack([step_loss.isfinite(), grad_norm.isfinite() | run.scaler.is_enabled()])
        run.bad = torch.where(~finite & (run.bad == NEVER), run.iter_num + 1, run.bad)  # no sync: check_finite acts
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
        run.iter_num, steps_since_log, loss_sum = run.iter_num + 1, steps_since_log + 1, loss_sum + step_loss

        if run.iter_num % cfg.log_interval == 0 or run.iter_num == cfg.max_iters:
            check_finite(cfg, run)
            lossf = loss_sum.item() / steps_since_log  # waits for the GPU: the timing is right
            dt = (time.time() - t_log) / steps_since_log
            history['train'].append((run.iter_num, lossf))  # this rank's, averaged since the last log
            if run.master:
                mfu = run.raw_model.estimate_mfu(tokens_per_iter / dt / run.world_size)
                memory = torch.cuda.max_memory_allocated(run.device) / 2**30 if run.device.type == 'cuda' else \
                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS, KiB on Linux
                left = round(dt * (cfg.max_iters - run.iter_num))  # s, at the mean step time since the last line
                print(f'iter {run.iter_num}/{cfg.max_iters}: loss {lossf:.4f}, lr {lr:.2e}, '
                      f'{tokens_per_iter / dt:,.0f} tok/s{f", mfu {100 * mfu:.1f}%" * (run.device.type == "cuda")}, '
                      f'mem {memory:.2f}GB, {1000 * dt:.1f}ms/iter, {left // 60}m {left % 60}s left', flush=True)
            if run.wandb:
                run.wandb.log({'iter': run.iter_num, 'train/loss': lossf, 'lr': lr, 'tok_s': tokens_per_iter / dt})
            t_log, steps_since_log, loss_sum = time.time(), 0, torch.zeros((), device=run.device)
    if run.master:
        best = f' and best.pt (val loss {run.best_val_loss:.4f})' if (run.folder / 'best.pt').exists() else ''
        print(f'saved {run.folder / "ckpt.pt"} (step {run.iter_num}){best}; sample it with: python sample.py '
              f'--out_dir={cfg.out_dir}')
    if run.wandb:
        run.wandb.finish()
    return history


if __name__ == '__main__':
    run_main(main, TrainError, CheckpointError)
