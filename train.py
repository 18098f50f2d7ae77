"""
Train a language model whose mixer is Factorization Memory ('fm'), attention ('attn') or Mamba-2 ('mamba2').

One process, CPU or one GPU:
    python train.py                                   # small FM model, default corpus, a few minutes on a CPU
    python train.py config/fm_small.py --max_iters=2000 --batch_size=32
DDP on the GPUs of one node (NCCL; gloo with --device=cpu):
    torchrun --standalone --nproc_per_node=8 train.py config/fm_1b.py
Several nodes: run on each node
    torchrun --nnodes=2 --node_rank=R --master_addr=HOST --master_port=29500 --nproc_per_node=8 train.py config/fm_1b.py
Continue from out_dir/ckpt.pt: add --init_from=resume. Ctrl-C (or SIGTERM) finishes the current step, writes
out_dir/ckpt.pt and exits; a second Ctrl-C exits at once without saving. A new run refuses an out_dir that holds
a checkpoint unless --overwrite=True (which replaces ckpt.pt and best.pt when the new run saves its first
checkpoint), and a run holds out_dir/train.lock so that no second run trains there. A NaN or infinite loss or
gradient norm stops the run without saving anything after it.
"""
import fcntl
import math
import os
import random
import resource
import signal
import socket
import sys
import time
import typing
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict, fields
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint, nonfinite, save_checkpoint
from configurator import ConfigError, help_text, load_config
from model import Model, ModelConfig
from prepare_data import dataset_dir, get_tokenizer, load_tokens, prepare

# -----------------------------------------------------------------------------
# default config values: a small FM model on the default corpus, a few minutes on a 2-core CPU
# I/O
out_dir = 'out'
eval_interval = 100  # evaluate, and write ckpt.pt (and best.pt when val improves), every eval_interval steps
eval_iters = 16  # the validation set is eval_iters * batch_size fixed windows
log_interval = 10
always_save_checkpoint = True  # False: write ckpt.pt only at the end (best.pt is written whenever val improves)
init_from = 'scratch'  # 'scratch' or 'resume' (from out_dir/ckpt.pt)
overwrite = False  # True: a scratch run replaces the earlier run's ckpt.pt and best.pt when it first saves
# wandb logging
wandb_log = False
wandb_project = 'factorization-memory'
wandb_run_name = 'fm'
# data: data_dir/{dataset}_{tokenizer}/{train,val}.bin, written by prepare_data.py
dataset = 'default'  # 'default', or the --dataset given to prepare_data.py (a path or hf:NAME)
tokenizer = 'bytes'
data_dir = 'data'
hf_config = ''  # the --hf_config given to prepare_data.py, if any
verify_data = True  # check the checksums of train.bin and val.bin on opening them (0.4 s per GB); False: skip
gradient_accumulation_steps = 1  # micro-batches per step over all processes (divided by the world size under DDP)
batch_size = 16  # micro-batch size per process
block_size = 256
vocab_multiple = 64  # pad the model's vocab up to a multiple of this when the tokenizer has more than 256 tokens
# model: these and every other ModelConfig field (at ModelConfig's default) can be overridden
mixer = 'fm'
n_layer = 4
d_model = 128
n_memory = 32
top_k = 8
tau = 1.0
chunk_size = 16  # chunk length of the parallel scan: 16 is fastest for the PyTorch scan on a CPU
# AdamW
learning_rate = 4e-3
max_iters = 500
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # clip the gradient norm at this value; 0.0: no clipping
# learning rate: linear warmup, then cosine decay to min_lr at lr_decay_iters
warmup_iters = 50
lr_decay_iters = 0  # step where the cosine reaches min_lr; 0: max_iters
min_lr = 4e-4
# system
device = 'cuda' if torch.cuda.is_available() else 'cpu'  # 'cpu', 'cuda', 'cuda:1', 'mps', ...
dtype = 'auto'  # 'float32', 'bfloat16' or 'float16' (autocast; a GPU's); 'auto': bfloat16 on CUDA, else float32
compile = False  # torch.compile the model
seed = 1337
# -----------------------------------------------------------------------------
_TRAIN_KEYS = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (bool, int, float, str))]
_EVAL_SEED = 2024  # the validation windows depend on this only, so runs with different seeds compare
_NEVER = 2**62  # the step of a non-finite loss or gradient norm while there has been none


class TrainError(RuntimeError):
    """A problem the user can fix (data, checkpoint, settings); the message says how."""


def default_config():
    """The defaults above, plus every ModelConfig field not listed above, at ModelConfig's default."""
    config = {k: globals()[k] for k in _TRAIN_KEYS}
    for f in fields(ModelConfig):
        if f.name != 'vocab_size' and f.name not in config:
            config[f.name] = f.default
    return config


def optional_types():
    """For ModelConfig fields that default to None (e.g. top_k: int | None), the type a value must have."""
    out = {}
    for name, hint in typing.get_type_hints(ModelConfig).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        if len(args) == 1 and isinstance(args[0], type):
            out[name] = args[0]
    return out


def setup_ddp(device):
    """Under torchrun (RANK is set) join the process group: NCCL on CUDA, gloo on CPU.
    Returns (rank, world_size, device)."""
    if 'RANK' not in os.environ:
        return 0, 1, device
    rank, local_rank, world_size = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE'))
    if device.startswith('cuda'):
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
        dist.init_process_group('nccl', device_id=torch.device(device))
    else:
        dist.init_process_group('gloo')
    return rank, world_size, device


def load_data(cfg, rank, cpu_group):
    """Open train.bin and val.bin of data_dir/{dataset}_{tokenizer}; rank 0 prepares the default corpus if needed."""
    try:
        tok = get_tokenizer(cfg.tokenizer)
    except (ValueError, ImportError, RuntimeError) as e:
        raise TrainError(str(e)) from None
    folder = dataset_dir(cfg.dataset, cfg.tokenizer, cfg.data_dir, cfg.hf_config or None)
    if cfg.dataset == 'default' and rank == 0:
        prepare(dataset='default', tokenizer=cfg.tokenizer, data_dir=cfg.data_dir)  # does nothing if done already
    if cpu_group is not None:
        dist.barrier(group=cpu_group)  # the other ranks wait for rank 0 to prepare the data
    if not (folder / 'train.bin').exists():
        hf_config = f' --hf_config {cfg.hf_config}' if cfg.hf_config else ''
        raise TrainError(f'no dataset at {folder}. Prepare it with:\n  python prepare_data.py '
                         f'--dataset {cfg.dataset} --tokenizer {cfg.tokenizer} --data_dir {cfg.data_dir}{hf_config}')
    verify = cfg.verify_data and os.environ.get('LOCAL_RANK', '0') == '0'  # one process a node checks them
    try:
        train = load_tokens(folder / 'train.bin', cfg.tokenizer, tok.vocab_size, verify=verify)
        val = load_tokens(folder / 'val.bin', cfg.tokenizer, tok.vocab_size, verify=verify)
    except (ValueError, FileNotFoundError) as e:
        raise TrainError(str(e)) from None
    for name, data in (('train', train), ('val', val)):
        if len(data.tokens) < cfg.block_size + 1:
            raise TrainError(f'{name}.bin in {folder} holds {len(data.tokens)} tokens, fewer than '
                             f'block_size + 1 = {cfg.block_size + 1}: use a smaller --block_size or more data')
    return tok, folder, train.tokens, val.tokens


def get_batch(tokens, starts, block_size, device):
    """Inputs x = tokens[s : s+block_size] and targets y = tokens[s+1 : s+block_size+1] for each start s."""
    xy = torch.from_numpy(np.stack([tokens[s:s + block_size + 1] for s in starts]).astype(np.int64))
    if device.type == 'cuda':
        xy = xy.pin_memory().to(device, non_blocking=True)
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()


def random_starts(gen, n_tokens, batch_size, block_size):
    return gen.integers(0, n_tokens - block_size, size=batch_size)


@torch.no_grad()
def estimate_loss(model, tokens, starts, cfg, device, ctx, cpu_group, rank, world_size):
    """Mean loss per token over the fixed validation windows (split over the ranks under DDP)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    mine = starts[rank::world_size]
    for i in range(0, len(mine), cfg.batch_size):
        x, y = get_batch(tokens, mine[i:i + cfg.batch_size], cfg.block_size, device)
        with ctx:
            _, loss = model(x, y)
        total += torch.tensor([loss.item() * len(x), len(x)], dtype=torch.float64)
    if cpu_group is not None:
        dist.all_reduce(total, group=cpu_group)
    model.train()
    return (total[0] / total[1]).item()


def get_lr(it, cfg):
    """Linear warmup for warmup_iters steps, cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it >= decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def rng_states():
    """Python, NumPy, torch CPU and CUDA random states (the batch generators are added by the caller)."""
    np_state = np.random.get_state()
    return {'python': random.getstate(),
            'numpy': (np_state[0], np_state[1].tolist(), *np_state[2:]),
            'torch': torch.get_rng_state(),
            'cuda': torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None}


def set_rng_states(rng):
    random.setstate(rng['python'])
    np.random.set_state((rng['numpy'][0], np.array(rng['numpy'][1], dtype=np.uint32), *rng['numpy'][2:]))
    torch.set_rng_state(rng['torch'])
    if rng['cuda'] is not None and torch.cuda.is_available() and len(rng['cuda']) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng['cuda'])


def peak_memory_gb(device):
    if device.type == 'cuda':
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS, KiB on Linux


def main(argv=()):
    argv = list(argv)
    if '-h' in argv or '--help' in argv:
        print(__doc__ + '\nsettings (--key=value):\n' + help_text(default_config()))
        return None
    config = load_config(default_config(), argv, optional_types())
    cfg = SimpleNamespace(**config)
    check_settings(cfg)

    rank, world_size, device_name = setup_ddp(cfg.device)
    # under DDP, a CPU process group for small messages (stop flag, eval sums, batch generator states): no GPU syncs
    cpu_group = dist.new_group(backend='gloo') if dist.is_initialized() else None
    try:
        with ExitStack() as stack:
            earlier = []  # rank 0 writes checkpoints; these files of an earlier run go when it first does
            on_rank_0(lambda: earlier.extend(stack.enter_context(claim_out_dir(cfg))), rank, cpu_group)
            return train(cfg, config, rank, world_size, device_name, cpu_group, earlier)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_AT_LEAST = {  # setting: (its smallest value, what it counts)
    'batch_size': (1, 'sequences in a micro-batch of each process'),
    'block_size': (1, 'tokens in a sequence'),
    'gradient_accumulation_steps': (1, 'micro-batches in a step'),
    'max_iters': (1, 'the step training ends at'),
    'warmup_iters': (0, 'steps of learning rate warmup'),
    'lr_decay_iters': (0, 'the step the cosine ends at; 0: max_iters'),
    'eval_interval': (1, 'steps between evaluations'),
    'eval_iters': (1, 'validation batches'),
    'log_interval': (1, 'steps between log lines'),
    'min_lr': (0, 'the learning rate the cosine decays to'),
    'weight_decay': (0, "AdamW's decoupled weight decay"),
    'grad_clip': (0, 'the gradient norm clipped to; 0: no clipping'),
}


def check_settings(cfg):
    """Raise ConfigError naming the first setting out of range, and what to set instead."""
    if cfg.init_from not in ('scratch', 'resume'):
        raise ConfigError(f"init_from must be 'scratch' or 'resume', not {cfg.init_from!r}")
    if cfg.dtype not in ('auto', 'float32', 'bfloat16', 'float16'):
        raise ConfigError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', not {cfg.dtype!r}")
    if not cfg.out_dir:
        raise ConfigError('--out_dir is empty: name the folder the checkpoints go to (the default is out)')
    for key, (low, meaning) in _AT_LEAST.items():
        if not getattr(cfg, key) >= low:
            raise ConfigError(f'--{key}={getattr(cfg, key)} is out of range: set it to at least {low} ({meaning})')
    if not cfg.learning_rate > 0:
        raise ConfigError(f'--learning_rate={cfg.learning_rate} is out of range: set it above 0 (the peak learning '
                          f'rate, reached after warmup_iters)')
    for key in ('beta1', 'beta2'):
        if not 0 <= getattr(cfg, key) < 1:
            raise ConfigError(f"--{key}={getattr(cfg, key)} is out of range: AdamW's {key} must be at least 0 and "
                              f"below 1 (the default is {globals()[key]})")
    check_device(cfg.device)


def check_device(name):
    """Raise ConfigError if the device cannot be used here."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device={name} is not a device: use 'cpu', 'cuda', 'cuda:N' or 'mps'") from None
    if device.type == 'cuda' and not torch.cuda.is_available():
        reason = 'no CUDA GPU is visible' if torch.backends.cuda.is_built() else 'this PyTorch has no CUDA support'
        raise ConfigError(f'--device={name}, but {reason}: use --device=cpu (the default where no GPU is found), '
                          f'or install a PyTorch build for your GPU')
    if device.type == 'cuda' and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f'--device={name}, but there are {torch.cuda.device_count()} GPUs: use cuda:0 to '
                          f'cuda:{torch.cuda.device_count() - 1}')
    if device.type == 'mps' and not torch.backends.mps.is_available():
        raise ConfigError(f'--device={name}, but MPS is not available here: use --device=cpu')


def precision(dtype, device_type):
    """The training dtype ('auto': bfloat16 on CUDA, float16 where it lacks bfloat16, else float32)
    and the autocast context for it."""
    if dtype == 'auto':
        dtype = 'bfloat16' if device_type == 'cuda' else 'float32'
    if device_type == 'cuda' and dtype == 'bfloat16' and not torch.cuda.is_bf16_supported():
        dtype = 'float16'
    if device_type == 'cuda':
        torch.set_float32_matmul_precision('high')  # TF32 matmuls where float32 remains
    ctx = nullcontext() if dtype == 'float32' else torch.autocast(device_type, dtype=getattr(torch, dtype))
    return dtype, ctx


def new_model(cfg, config, vocab_size):
    """A fresh Model from the run's settings; a tokenizer of more than 256 ids pads to vocab_multiple."""
    if vocab_size > 256 and cfg.vocab_multiple > 1:
        vocab_size = -(-vocab_size // cfg.vocab_multiple) * cfg.vocab_multiple
    model_args = {f.name: config[f.name] for f in fields(ModelConfig) if f.name in config}
    try:
        return Model(ModelConfig(**{**model_args, 'vocab_size': vocab_size}))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def resumed_model(ckpt, ckpt_path, cfg, config, master):
    """The checkpoint's model, refused if this run's model settings differ from it; training settings (block_size
    too) are this run's."""
    if ckpt['tokenizer'] != cfg.tokenizer:
        raise TrainError(f'{ckpt_path} was trained with tokenizer {ckpt["tokenizer"]!r}, this run uses '
                         f'{cfg.tokenizer!r}: pass --tokenizer={ckpt["tokenizer"]}')
    saved = ckpt['model_config']
    changed = [k for k, v in saved.items() if k in config and k != 'block_size' and config[k] != v]
    if changed:
        raise TrainError(f'{ckpt_path} holds a model with {", ".join(f"{k}={saved[k]!r}" for k in changed)}; this run '
                         f'asks for {", ".join(f"{k}={config[k]!r}" for k in changed)}. A run resumes with the model '
                         f'it trained: drop those settings (or give the config file the run was started with), or '
                         f'train the new model from scratch in a new --out_dir')
    if master:
        for k, v in ckpt['train_config'].items():
            if k in config and (k == 'block_size' or k not in saved) and config[k] != v:
                print(f'resume: {k}={config[k]!r} (the checkpoint\'s run had {v!r})')
    model = model_from_checkpoint(ckpt, ckpt_path)
    model.config.block_size = cfg.block_size  # the context trained from now on (the model has no limit)
    return model


def on_rank_0(step, rank, cpu_group):
    """Run step() on rank 0 only; an error it raises is raised on every rank as a TrainError (under DDP the others
    would otherwise wait for rank 0 and die of a closed connection)."""
    error = None
    if rank == 0:
        try:
            step()
        except Exception as e:  # any error: the other ranks must not wait for rank 0 forever
            error = str(e) if isinstance(e, TrainError) else f'{type(e).__name__}: {e}'
    if cpu_group is not None:
        shared = [error]
        dist.broadcast_object_list(shared, src=0, group=cpu_group)
        error = shared[0]
    if error is not None:
        raise TrainError(error)


@contextmanager
def claim_out_dir(cfg):
    """Hold out_dir/train.lock while the run trains, so that a second run refuses the same out_dir (the kernel
    drops the lock of a process that dies, so a later run takes it over), and refuse a scratch run into an out_dir
    that holds checkpoints unless --overwrite=True. Yields the names of the earlier run's checkpoints that this run
    replaces when it first saves (until then they stay as they were)."""
    path = os.path.join(cfg.out_dir, 'train.lock')
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        lock = open(path, 'a+')
    except OSError as e:
        reason = 'it is a file' if os.path.isfile(cfg.out_dir) else e.strerror
        raise TrainError(f'cannot write to --out_dir={cfg.out_dir} ({reason}): pass a folder you can write '
                         f'to') from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or 'a process that is starting'
            raise TrainError(f'{cfg.out_dir} is in use by another training run ({holder}; lock file {path}): wait '
                             f'for it to finish or stop it, or train in another --out_dir') from None
        except OSError as e:  # a file system without locks, e.g. Lustre mounted without flock
            print(f'warning: cannot lock {path} ({e.strerror}): nothing stops a second run in {cfg.out_dir}')
        lock.truncate(0)
        lock.write(f'process {os.getpid()} on {socket.gethostname()}, started {time.strftime("%Y-%m-%d %H:%M:%S")}\n')
        lock.flush()
        earlier = [name for name in ('ckpt.pt', 'best.pt') if os.path.exists(os.path.join(cfg.out_dir, name))]
        if cfg.init_from == 'scratch' and earlier and not cfg.overwrite:
            raise TrainError(f'{cfg.out_dir} holds {" and ".join(earlier)} of an earlier run, which this new run '
                             f'would replace: continue that run with --init_from=resume, start this one in a new '
                             f'--out_dir, or pass --overwrite=True to replace it')
        for name in ('ckpt.pt.tmp', 'best.pt.tmp'):  # of a run killed while saving; this run holds the lock
            Path(cfg.out_dir, name).unlink(missing_ok=True)
        yield earlier if cfg.init_from == 'scratch' else []


@contextmanager
def stop_requests(announce):
    """While active, Ctrl-C or SIGTERM sets stop[0] (the loop then finishes its step, saves and stops) instead of
    stopping the process; a second Ctrl-C raises KeyboardInterrupt at once. Yields stop, a list of one bool."""
    stop, previous = [False], {}

    def request_stop(signum, frame):
        stop[0] = True
        signal.signal(signum, previous[signum])
        if announce:
            print(f'\n{signal.Signals(signum).name}: saving a checkpoint after this step (Ctrl-C again to quit now)',
                  flush=True)

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, request_stop)
        except ValueError:  # not the main thread: no handlers
            pass
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def train(cfg, config, rank, world_size, device_name, cpu_group, earlier=()):
    """Train; earlier: the names of an earlier run's checkpoints in out_dir that the first save replaces."""
    master = rank == 0
    if cfg.gradient_accumulation_steps % world_size:
        raise ConfigError(f'gradient_accumulation_steps={cfg.gradient_accumulation_steps} counts the micro-batches '
                          f'of a step over all {world_size} processes: make it a multiple of {world_size}')
    grad_accum = cfg.gradient_accumulation_steps // world_size
    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
    device = torch.device(device_name)
    device_type = device.type
    dtype, ctx = precision(cfg.dtype, device_type)
    if master:
        print(f'device {device} ({torch.cuda.get_device_name(device) if device_type == "cuda" else "cpu"}), '
              f'dtype {dtype}, world size {world_size}, tokens per step {tokens_per_iter:,} '
              f'({cfg.gradient_accumulation_steps} x {cfg.batch_size} x {cfg.block_size})')
        if dtype == 'float16' and device_type == 'cpu':
            print('warning: --dtype=float16 on the CPU is slow: with PyTorch\'s float16 CPU kernels a step of the '
                  'default model takes about 10 times as long as in float32. Use --dtype=float32, the default here')

    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    tok, folder, train_tokens, val_tokens = load_data(cfg, rank, cpu_group)

    # model, optimizer, and the state of a resumed run
    ckpt_path = os.path.join(cfg.out_dir, 'ckpt.pt')
    iter_num, best_val_loss, ckpt = 0, float('inf'), None
    if cfg.init_from == 'resume':
        ckpt = load_checkpoint(ckpt_path)
        iter_num, best_val_loss = ckpt['iter_num'], ckpt['best_val_loss']
        if iter_num >= cfg.max_iters:
            raise TrainError(f'{ckpt_path} is at step {iter_num}, which --max_iters={cfg.max_iters} does not pass: '
                             f'set --max_iters above {iter_num} to train on')
        raw_model = resumed_model(ckpt, ckpt_path, cfg, config, master)
    else:
        raw_model = new_model(cfg, config, tok.vocab_size)
    raw_model.to(device)
    model_config = raw_model.config
    if master:
        print(f'model: {model_config}')
        print(f'parameters: {raw_model.num_params(non_embedding=False):,} '
              f'({raw_model.num_params():,} without embeddings)')
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2),
                                               device_type)
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16'))
    if ckpt is not None:
        try:
            optimizer.load_state_dict(ckpt['optimizer'])
        except ValueError:  # parameters the checkpoint's optimizer holds apart that this code holds as one
            raise TrainError(f'{ckpt_path} was saved by code with separate gate/up (and q/k/v) products; this code '
                             f'fuses them. The model loads (sample.py and eval.py use it), but its optimizer state '
                             f'cannot be resumed: start a new run, or resume with the code that wrote it') from None
        if ckpt.get('scaler') and scaler.is_enabled():  # float16 runs only; empty for bfloat16 / float32
            scaler.load_state_dict(ckpt['scaler'])
    model = torch.compile(raw_model) if cfg.compile else raw_model
    eval_model = model  # evaluation needs no gradient sync: call the model without the DDP wrapper
    if cpu_group is not None:
        model = DDP(model, device_ids=[device.index] if device_type == 'cuda' else None)

    # the batch generator of this rank; its state before drawing the pending batch goes in the checkpoint
    gen = np.random.default_rng([cfg.seed, rank])
    if ckpt is not None:
        set_rng_states(ckpt['rng'])
        if ckpt['data_state']['world_size'] == world_size and ckpt['data_state']['train_tokens'] == len(train_tokens):
            gen.bit_generator.state = ckpt['rng']['batch'][rank]
        else:
            gen = np.random.default_rng([cfg.seed, rank, iter_num])
            if master:
                print('resume: the world size or the training data changed, so the batches differ from an '
                      'uninterrupted run')
        del ckpt  # free the memory
    val_starts = random_starts(np.random.default_rng(_EVAL_SEED), len(val_tokens), cfg.eval_iters * cfg.batch_size,
                               cfg.block_size)

    saved_iter = iter_num if cfg.init_from == 'resume' else None  # the step of out_dir/ckpt.pt of this run
    best_iter = None  # the step of a best.pt this run wrote

    def stop_diverged(what, step):
        """Raise the TrainError of a non-finite value: nothing is saved after it."""
        if saved_iter is not None:
            kept = f'{ckpt_path} (step {saved_iter}) is the last good checkpoint'
        elif best_iter is not None:
            kept = f'{os.path.join(cfg.out_dir, "best.pt")} (step {best_iter}) is the last good checkpoint'
        elif earlier:
            kept = f'the earlier run\'s {" and ".join(earlier)} in {cfg.out_dir} stay as they were'
        else:
            kept = 'no checkpoint was written'
        raise TrainError(f'{what} at step {step} (learning rate {get_lr(step - 1, cfg):.2e}): training stopped '
                         f'without saving; {kept}. Likely causes: a learning rate too high for this model '
                         f'(--learning_rate, --warmup_iters, --grad_clip), bad values in the data, or a damaged '
                         f'checkpoint this run resumed from')

    nonfinite_at = torch.full((2,), _NEVER, device=device)  # the first step of a non-finite loss, gradient norm

    def check_finite():
        """Stop if a step so far had a non-finite loss or gradient norm on any rank (one sync; at log and save)."""
        at = nonfinite_at.cpu()
        if cpu_group is not None:
            dist.all_reduce(at, op=dist.ReduceOp.MIN, group=cpu_group)
        if at.min() < _NEVER:
            stop_diverged(f'the {"loss" if at[0] <= at[1] else "gradient norm"} is not finite (NaN or infinity)',
                          int(at.min()))

    def checkpoint(batch_state):
        """Gather every rank's batch generator state; rank 0 returns the checkpoint dict, the others None. Stops
        the run instead if a weight or an optimizer state is not finite (checked on every rank)."""
        optimizer_tensors = {f'the optimizer\'s {key} of parameter {i}': value
                             for i, state in optimizer.state_dict()['state'].items() for key, value in state.items()}
        broken = nonfinite({**raw_model.state_dict(), **optimizer_tensors})
        if broken:
            stop_diverged(f'{broken[0]} is not finite (NaN or infinity)', iter_num)
        batch_states = [batch_state]
        if cpu_group is not None:
            batch_states = [None] * world_size
            dist.all_gather_object(batch_states, batch_state, group=cpu_group)
        if not master:
            return None
        return {'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(), 'scaler': scaler.state_dict(),
                'model_config': asdict(model_config), 'train_config': config, 'iter_num': iter_num,
                'best_val_loss': best_val_loss, 'rng': {**rng_states(), 'batch': batch_states},
                'data_state': {'folder': str(folder), 'train_tokens': len(train_tokens), 'world_size': world_size,
                               'tokens_seen': iter_num * tokens_per_iter},
                'tokenizer': cfg.tokenizer}

    if cfg.wandb_log and master:
        import wandb
        wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=config)

    def save(ckpt, names):
        """Write ckpt to each out_dir/name (rank 0); the first save also removes the earlier run's other files."""
        for name in names:
            save_checkpoint(ckpt, os.path.join(cfg.out_dir, name))
        for name in earlier:
            if name not in names:
                os.remove(os.path.join(cfg.out_dir, name))
        if earlier:
            print(f'replaced the earlier run\'s {" and ".join(earlier)} in {cfg.out_dir}')
            earlier.clear()

    history = {'train': [], 'val': []}
    start_iter, stop_now = iter_num, False
    batch_state = gen.bit_generator.state
    X, Y = get_batch(train_tokens, random_starts(gen, len(train_tokens), cfg.batch_size, cfg.block_size),
                     cfg.block_size, device)
    t_log, iters_since_log, loss_sum = time.time(), 0, torch.zeros((), device=device)
    with stop_requests(announce=master) as stop:
        while True:
            # evaluate, checkpoint
            due = iter_num % cfg.eval_interval == 0 or iter_num >= cfg.max_iters
            if due and (iter_num > start_iter or cfg.init_from == 'scratch'):  # not again right after resuming
                check_finite()
                val_loss = estimate_loss(eval_model, val_tokens, val_starts, cfg, device, ctx, cpu_group, rank,
                                         world_size)
                if not math.isfinite(val_loss):
                    stop_diverged(f'the validation loss is {val_loss}', iter_num)
                history['val'].append((iter_num, val_loss))
                new_best = iter_num > start_iter and val_loss < best_val_loss
                if new_best:
                    best_val_loss = val_loss
                if master:
                    bpb = f', {val_loss / math.log(2):.4f} bits per byte' if cfg.tokenizer == 'bytes' else ''
                    print(f'step {iter_num}: val loss {val_loss:.4f}{bpb}{" (best)" if new_best else ""}')
                    if cfg.wandb_log:
                        wandb.log({'iter': iter_num, 'val/loss': val_loss, 'lr': get_lr(iter_num, cfg)})
                save_last = cfg.always_save_checkpoint or iter_num >= cfg.max_iters
                names = [name for name, wanted in (('ckpt.pt', save_last), ('best.pt', new_best)) if wanted]
                if iter_num > start_iter and names:
                    ckpt = checkpoint(batch_state)
                    if master:
                        save(ckpt, names)  # best.pt: a file of its own
                    if 'ckpt.pt' in names:
                        saved_iter = iter_num
                    if 'best.pt' in names:
                        best_iter = iter_num
                    del ckpt
                t_log = time.time()  # leave evaluation out of the timings
            if iter_num >= cfg.max_iters:
                if master:
                    best_path = os.path.join(cfg.out_dir, 'best.pt')
                    best = f' and {best_path} (val loss {best_val_loss:.4f})' if os.path.exists(best_path) else ''
                    print(f'saved {ckpt_path} (step {iter_num}){best}; sample it with: python sample.py '
                          f'--out_dir={cfg.out_dir}')
                break
            if stop_now:
                check_finite()
                if saved_iter != iter_num:
                    ckpt = checkpoint(batch_state)
                    if master:
                        save(ckpt, ['ckpt.pt'])
                    saved_iter = iter_num
                if master:
                    print(f'saved {ckpt_path} at step {iter_num}; continue with --init_from=resume')
                break

            # one optimizer step over grad_accum micro-batches
            lr = get_lr(iter_num, cfg)
            for param_group in optimizer.param_groups:
                param_group['lr'] = lr
            step_loss = torch.zeros((), device=device)
            for micro_step in range(grad_accum):
                last = micro_step == grad_accum - 1
                with model.no_sync() if cpu_group is not None and not last else nullcontext():
                    with ctx:
                        _, loss = model(X, Y)
                    # draw the next batch while the accelerator works on this one
                    batch_state = gen.bit_generator.state
                    X, Y = get_batch(train_tokens, random_starts(gen, len(train_tokens), cfg.batch_size,
                                                                 cfg.block_size), cfg.block_size, device)
                    scaler.scale(loss / grad_accum).backward()
                step_loss += loss.detach() / grad_accum
            loss_sum += step_loss
            scaler.unscale_(optimizer)  # float16: the true gradients, to clip and check; otherwise nothing
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
            # no sync here: check_finite reads the first bad step at the next log line or save. float16: the scaler
            # skips the step of a non-finite gradient itself (and lowers its scale), so only the loss counts
            finite = torch.stack([torch.isfinite(step_loss), torch.isfinite(grad_norm) | scaler.is_enabled()])
            nonfinite_at = torch.where(~finite & (nonfinite_at == _NEVER), iter_num + 1, nonfinite_at)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            iter_num += 1
            iters_since_log += 1

            # log: loss of this rank averaged over the steps since the last log
            if iter_num % cfg.log_interval == 0 or iter_num == cfg.max_iters:
                check_finite()
                lossf = loss_sum.item() / iters_since_log  # .item() waits for the GPU, so the timing is right
                dt = (time.time() - t_log) / iters_since_log
                history['train'].append((iter_num, lossf))
                if master:
                    tok_s = tokens_per_iter / dt
                    mfu = raw_model.estimate_mfu(tok_s / world_size)  # 0.0 off CUDA
                    mfu_text = f', mfu {100 * mfu:.1f}%' if device_type == 'cuda' else ''
                    print(f'iter {iter_num}: loss {lossf:.4f}, lr {lr:.2e}, {tok_s:,.0f} tok/s{mfu_text}, '
                          f'mem {peak_memory_gb(device):.2f}GB, {1000 * dt:.1f}ms/iter', flush=True)
                    if cfg.wandb_log:
                        wandb.log({'iter': iter_num, 'train/loss': lossf, 'lr': lr, 'mfu': mfu, 'tok_s': tok_s})
                t_log, iters_since_log, loss_sum = time.time(), 0, torch.zeros((), device=device)

            stop_now = stop[0]
            if cpu_group is not None:  # every rank stops at the same step
                flag = torch.tensor([float(stop_now)])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=cpu_group)
                stop_now = bool(flag.item())
    if cfg.wandb_log and master:
        wandb.finish()
    return history


if __name__ == '__main__':
    try:
        main(sys.argv[1:])
    except (ConfigError, TrainError, CheckpointError) as e:
        sys.exit(f'error: {e}')
