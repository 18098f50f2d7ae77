"""
Train a language model of model.py: Factorization Memory, or another mixer (--help lists them).

    python train.py                        # small FM model, default corpus, minutes on a CPU
    python train.py config/fm_small.py --max_iters=2000 --batch_size=32
    torchrun --standalone --nproc_per_node=8 train.py config/fm_1b.py  # DDP (gloo on CPU)
Continue from out_dir/ckpt.pt with --init_from=resume. Nothing is lost (run.py): out_dir holds
one run; saves are whole; a value not finite or a blow-up stops the run unsaved; Ctrl-C, SIGTERM
or SIGHUP saves the step and exits 130, 143 or 129 (resume goes on bit for bit);
--overwrite=True replaces the earlier run once a checkpoint is whole.
"""
from configurator import (help_text, load_config, optional_types, quit_on_ctrl_c, quit_on_sigterm,
                          run_main)

if __name__ == '__main__':  # first: a signal while the imports load is one line
    quit_on_ctrl_c()

import math
import os
import random
import time
from contextlib import nullcontext
from dataclasses import fields
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import model as model_file
import run
from checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint
from model import Model, ModelConfig
from prepare_data import dataset_dir, get_tokenizer, load_tokens, prepare
from run import TrainError, model_args, peak_memory, resolve_dtype

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
EVAL_SEED = 2024  # of the validation windows alone: runs of other seeds compare


# ----------------------------------------------------------------------------- settings

def default_config():
    """The settings above, and every other ModelConfig field at its default."""
    model = {f.name: f.default for f in fields(ModelConfig)
             if f.name not in ('vocab_size', *_TRAIN_KEYS)}
    return {k: globals()[k] for k in _TRAIN_KEYS} | model


def settings(argv):
    """argv -> the run's settings (None for --help); ConfigError for one out of range."""
    defaults = default_config()
    if '-h' in argv or '--help' in argv:
        mixers = [f'{name} ({cls.__name__})' for name, cls in model_file.MIXER_CLASSES.items()]
        notes = help_text(defaults, __file__, model_file.__file__, tags=run.mixer_tags())
        print(f'{__doc__}\nsettings (--key=value; [fm]: a model setting of fm alone):\n{notes}')
        return print(f"mixers: {', '.join(mixers)}")
    cfg = SimpleNamespace(**load_config(defaults, argv, optional_types(ModelConfig)))
    run.check_settings(cfg, defaults)
    return cfg


# ----------------------------------------------------------------------------- setup

def main(argv=(), exit_when_stopped=False):
    """python train.py [config files] [--key=value ...] -> the losses logged: {'train': [(step,
    loss)], 'val': ...}; a run a signal stopped exits 128 + the signal if exit_when_stopped."""
    cfg = settings(list(argv))
    if cfg is None:
        return None
    guard = run.Run(cfg.out_dir)
    try:
        device, dtype = start_processes(cfg, guard)
        guard.claim(cfg.init_from == 'resume', cfg.overwrite)
        history = train(cfg, guard, device, dtype)
    finally:
        guard.release()
        if dist.is_initialized():
            dist.destroy_process_group()
    if guard.stop and exit_when_stopped:
        raise SystemExit(128 + guard.stop)  # 130, 143: a script can tell it from a finished run
    return history


def start_processes(cfg, guard):
    """torchrun's processes (guard.group: gloo for small messages) -> the device and dtype."""
    device = cfg.device
    if 'RANK' in os.environ:
        guard.rank, guard.world_size = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
        guard.master = guard.rank == 0
        if cfg.device.startswith('cuda'):
            device = f"cuda:{os.environ['LOCAL_RANK']}"
            torch.cuda.set_device(device)
            dist.init_process_group('nccl', device_id=torch.device(device))
        else:
            dist.init_process_group('gloo')
        guard.group = dist.new_group(backend='gloo')
    device = torch.device(device)
    dtype = resolve_dtype(cfg.dtype, device)
    if device.type == 'cuda':
        if dtype == 'bfloat16' and not torch.cuda.is_bf16_supported():
            dtype = 'float16'
        torch.set_float32_matmul_precision('high')  # TF32 matmuls where float32 remains
    return device, dtype


def train(cfg, guard, device, dtype):
    """Data, model, optimizer (new, or as ckpt.pt left them), then the loop -> the losses."""
    data = load_data(cfg, guard)
    ckpt = None
    if cfg.init_from == 'resume':
        ckpt = load_checkpoint(guard.folder / 'ckpt.pt')
    model, optimizer, scaler = build(cfg, data, device, dtype, ckpt, guard.folder)
    learner = SimpleNamespace(model=model, optimizer=optimizer, scaler=scaler, net=model,
                              batches=Batches(data, cfg, guard.rank, device), device=device,
                              ctx=nullcontext(), bad=torch.full((2,), run.NEVER, device=device),
                              tokens=cfg.gradient_accumulation_steps * cfg.batch_size
                              * cfg.block_size, wandb=None)  # bad: a loss's, a norm's first step
    progress = dict(iter_num=0, best_val_loss=math.inf, untrained_loss=None, eval_cut=False)
    if ckpt is not None:
        progress = guard.resume(cfg, ckpt, learner, data)
    if guard.master:
        print(f'device {device}, dtype {dtype}, world size {guard.world_size}, tokens per step '
              f'{learner.tokens:,} ({cfg.gradient_accumulation_steps} x {cfg.batch_size} x '
              f'{cfg.block_size})\nmodel: {model.config}\nparameters: '
              f'{model.num_params(False):,} ({model.num_params():,} without embeddings)')
    if cfg.wandb_log and guard.master:
        learner.wandb = __import__('wandb').init(project=cfg.wandb_project,
                                                 name=cfg.wandb_run_name, config=vars(cfg))
    if dtype != 'float32':
        learner.ctx = torch.autocast(device.type, getattr(torch, dtype))
    if cfg.compile:
        learner.net = torch.compile(model)
    learner.eval_net = learner.net  # not DDP's: no gradient sync
    if guard.group is not None:
        ids = [device.index] if device.type == 'cuda' else None
        learner.net = DDP(learner.net, device_ids=ids)
    guard.catch_signals(cfg.compile)
    return loop(cfg, guard, data, learner, progress)


# ----------------------------------------------------------------------------- data

def load_data(cfg, guard):
    """The token files (the default corpus prepared first) and the validation windows."""
    folder = dataset_dir(cfg.dataset, cfg.tokenizer, cfg.data_dir, cfg.hf_config or None)
    if cfg.dataset == 'default':
        guard.on_rank_0(lambda: prepare(tokenizer=cfg.tokenizer, data_dir=cfg.data_dir))
    if not (folder / 'train.bin').exists():
        raise TrainError(f'no dataset at {folder}. Prepare it with:\n  {run.prepare_command(cfg)}')
    tok = get_tokenizer(cfg.tokenizer)
    verify = cfg.verify_data and os.environ.get('LOCAL_RANK', '0') == '0'  # one a node
    splits = {}
    for split in ('train', 'val'):
        try:
            path = folder / f'{split}.bin'
            splits[split] = load_tokens(path, cfg.tokenizer, tok.vocab_size, verify).tokens
        except (ValueError, FileNotFoundError) as e:
            raise TrainError(str(e)) from None
        run.check_tokens(cfg, folder, split, len(splits[split]), verify)
    windows = cfg.eval_iters * cfg.batch_size  # fixed validation windows
    val_set = [str(folder), len(splits['val']), cfg.block_size, windows]
    high = len(splits['val']) - cfg.block_size
    val_starts = np.random.default_rng(EVAL_SEED).integers(0, high, windows)
    return SimpleNamespace(tok=tok, folder=folder, val_set=val_set, val_starts=val_starts,
                           **splits)


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


class Batches:
    """This rank's training batches, drawn at random; state: the generator's before the last."""

    def __init__(self, data, cfg, rank, device):
        self.data, self.cfg, self.device = data, cfg, device
        self.gen = np.random.default_rng([cfg.seed, rank])

    def next(self):
        """The next batch (inputs, targets)."""
        self.state = self.gen.bit_generator.state
        high = len(self.data.train) - self.cfg.block_size
        starts = self.gen.integers(0, high, self.cfg.batch_size)
        return get_batch(self.data.train, starts, self.cfg.block_size, self.device, self.data)


# ----------------------------------------------------------------------------- model and optimizer

def build(cfg, data, device, dtype, ckpt, folder):
    """The model (ckpt's if resuming), its AdamW optimizer, the float16 loss scaler."""
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # the same weights on every rank
    vocab_size = data.tok.vocab_size
    if vocab_size > 256:  # padded to a multiple of vocab_multiple
        vocab_size = -(-vocab_size // cfg.vocab_multiple) * cfg.vocab_multiple
    if ckpt is None:
        model = Model(ModelConfig(**model_args(cfg), vocab_size=vocab_size))
    else:
        model = model_from_checkpoint(ckpt, folder / 'ckpt.pt')
    model.config.block_size = cfg.block_size  # a resume trains at this run's context
    model.to(device)
    betas = (cfg.beta1, cfg.beta2)
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, betas,
                                           device.type)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == 'float16')
    return model, optimizer, scaler


# ----------------------------------------------------------------------------- the loop

def loop(cfg, guard, data, learner, progress):
    """The training loop, from progress['iter_num'] to max_iters -> the losses logged."""
    history, start = {'train': [], 'val': []}, progress['iter_num']
    learner.batch = learner.batches.next()
    t0, steps, loss_sum = time.time(), 0, torch.zeros((), device=learner.device)
    while True:
        if evaluate_and_save(cfg, guard, data, learner, progress, history, start):
            t0 = time.time()  # evaluation out of the timings
        it = progress['iter_num']
        if it >= cfg.max_iters and not progress['eval_cut']:  # its evaluation ran whole: done
            break
        if guard.stopped():
            return stop(cfg, guard, data, learner, progress, start, history)

        lr = get_lr(it, cfg)
        for param_group in learner.optimizer.param_groups:
            param_group['lr'] = lr
        loss = train_step(cfg, guard, learner, it)
        if loss is None:  # a signal came between micro-batches
            return stop(cfg, guard, data, learner, progress, start, history)
        guard.stepped, steps, loss_sum = True, steps + 1, loss_sum + loss
        progress['iter_num'] = it = it + 1

        if it % cfg.log_interval == 0 or it == cfg.max_iters:
            log(cfg, guard, learner, history, it, lr, loss_sum / steps, steps, t0)
            t0, steps, loss_sum = time.time(), 0, torch.zeros((), device=learner.device)
    if guard.master:
        best = ''
        if (guard.folder / 'best.pt').exists():
            best = f" and best.pt (val loss {progress['best_val_loss']:.4f})"
        then = (learner.model.decoding_refusal()
                or f'sample it with: python sample.py --out_dir={cfg.out_dir}')
        print(f'saved {guard.folder / "ckpt.pt"} (step {progress["iter_num"]}){best}; {then}')
    if learner.wandb:
        learner.wandb.finish()
    guard.stop = 0  # finished: a signal now changes nothing
    return history


def get_lr(it, cfg):
    """Linear warmup for warmup_iters steps, cosine decay to min_lr at lr_decay_iters, min_lr."""
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if it >= decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / (decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


@torch.no_grad()
def estimate_loss(cfg, guard, data, learner):
    """Mean loss a token on the fixed val windows, split over ranks; None if a signal stopped it."""
    model = learner.eval_net
    model.eval()
    total = torch.zeros(3, dtype=torch.float64)
    mine = data.val_starts[guard.rank::guard.world_size]
    for i in range(0, len(mine), cfg.batch_size):
        if guard.stop:
            break
        starts = mine[i:i + cfg.batch_size]
        x, y = get_batch(data.val, starts, cfg.block_size, learner.device, data)
        with learner.ctx:
            loss = model(x, y)[1].item()
        total += torch.tensor([loss * len(x), len(x), 0], dtype=torch.float64)
    total[2] = guard.stop
    if guard.group is not None:
        dist.all_reduce(total, group=guard.group)  # the stop too: every rank agrees
    model.train()
    if total[2]:  # the same on every rank: a signal on one stops all
        guard.stopped()
        return None
    return (total[0] / total[1]).item()


def train_step(cfg, guard, learner, it):
    """One optimizer step on gradient_accumulation_steps micro-batches (the next fetched meanwhile)
    -> its mean loss; None if a signal came between micro-batches: the step is undone."""
    grad_accum = cfg.gradient_accumulation_steps // guard.world_size
    first, step_loss = learner.batches.state, torch.zeros((), device=learner.device)
    for micro_step in range(grad_accum):
        if micro_step and guard.stopped():
            learner.optimizer.zero_grad(set_to_none=True)
            learner.batches.state = first  # a resume starts this step again
            return None
        sync = guard.group is None or micro_step == grad_accum - 1  # DDP: all-reduced once
        with nullcontext() if sync else learner.net.no_sync(), learner.ctx:
            _, loss = learner.net(*learner.batch)
        learner.batch = learner.batches.next()  # while the accelerator works
        learner.scaler.scale(loss / grad_accum).backward()
        step_loss += loss.detach() / grad_accum
    learner.scaler.unscale_(learner.optimizer)  # float16: the true gradients, to clip and check
    clip = cfg.grad_clip or math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(learner.model.parameters(), clip)
    grad_finite = grad_norm.isfinite() | learner.scaler.is_enabled()
    finite = torch.stack([step_loss.isfinite(), grad_finite])
    new_bad = ~finite & (learner.bad == run.NEVER)
    learner.bad = torch.where(new_bad, it + 1, learner.bad)  # no sync: check_finite acts
    learner.scaler.step(learner.optimizer)
    learner.scaler.update()
    learner.optimizer.zero_grad(set_to_none=True)
    return step_loss


def evaluate_and_save(cfg, guard, data, learner, progress, history, start):
    """At an evaluation step: the val loss, logged; ckpt.pt and best.pt saved as due -> whether it
    evaluated. Not again at the step a run resumes from, unless a stop cut it short."""
    it = progress['iter_num']
    fresh = it > start or progress['eval_cut']
    due = it % cfg.eval_interval == 0 or it >= cfg.max_iters
    if not due or not fresh and cfg.init_from == 'resume':  # resumed: evaluated before the stop
        return False
    guard.check_finite(learner.bad, lambda step: get_lr(step, cfg))
    val_loss = estimate_loss(cfg, guard, data, learner)
    progress['eval_cut'] = val_loss is None
    if val_loss is None:  # a signal stopped it
        return True
    if progress['untrained_loss'] is None:
        progress['untrained_loss'] = val_loss
    guard.check_blow_up(val_loss, progress['untrained_loss'], it)
    history['val'].append((it, val_loss))
    new_best = fresh and val_loss < progress['best_val_loss']
    if new_best:
        progress['best_val_loss'] = val_loss
    if guard.master:
        line = f'step {it}: val loss {val_loss:.4f}'
        if cfg.tokenizer == 'bytes':
            line += f', {val_loss / math.log(2):.4f} bits per byte'
        if new_best:
            line += ' (best)'
        print(line, flush=True)
    if learner.wandb:
        learner.wandb.log({'iter': it, 'val/loss': val_loss, 'lr': get_lr(it, cfg)})
    names = []
    if fresh and (cfg.always_save_checkpoint or it >= cfg.max_iters):
        names.append('ckpt.pt')
    if new_best:
        names.append('best.pt')
    if names:
        guard.save(guard.checkpoint(cfg, learner, data, progress), names)
    return True


def log(cfg, guard, learner, history, it, lr, mean_loss, steps, t0):
    """The mean loss of the steps since t0: history, a line with speed, memory, time left."""
    guard.check_finite(learner.bad, lambda step: get_lr(step, cfg))
    lossf = mean_loss.item()  # waits for the GPU: the timing is right
    dt = (time.time() - t0) / steps
    history['train'].append((it, lossf))  # this rank's, averaged since the last log
    tok_s = learner.tokens / dt
    if guard.master:
        line = f'iter {it}/{cfg.max_iters}: loss {lossf:.4f}, lr {lr:.2e}, {tok_s:,.0f} tok/s'
        if learner.device.type == 'cuda':
            mfu = learner.model.estimate_mfu(tok_s / guard.world_size)
            line += f', mfu {100 * mfu:.1f}%'
        left = round(dt * (cfg.max_iters - it))  # s, at the mean step since the last
        print(f'{line}, mem {peak_memory(learner.device):.2f}GB, {1000 * dt:.1f}ms/iter, '
              f'{left // 60}m {left % 60}s left', flush=True)
    if learner.wandb:
        learner.wandb.log({'iter': it, 'train/loss': lossf, 'lr': lr, 'tok_s': tok_s})


def stop(cfg, guard, data, learner, progress, start, history):
    """Save the steps trained since the last save, unless an --overwrite run has not replaced the
    earlier run yet (it stays whole) -> the losses logged."""
    it = progress['iter_num']
    trained = start < it and not guard.earlier
    if trained and it != guard.saved.get('ckpt.pt'):
        guard.check_finite(learner.bad, lambda step: get_lr(step, cfg))
        guard.save(guard.checkpoint(cfg, learner, data, progress), ['ckpt.pt'])
    guard.say_stopped(it, trained)
    return history


if __name__ == '__main__':
    quit_on_sigterm()
    run_main(lambda argv: main(argv, exit_when_stopped=True), TrainError, CheckpointError)
