"""
Train a language model whose mixer is Factorization Memory ('fm'), attention ('attn') or Mamba-2 ('mamba2').

    python train.py                                   # small FM model, default corpus, a few minutes on a CPU
    python train.py config/fm_small.py --max_iters=2000 --batch_size=32
    torchrun --standalone --nproc_per_node=8 train.py config/fm_1b.py   # DDP (NCCL; gloo with --device=cpu)
    torchrun --nnodes=2 --node_rank=R --master_addr=HOST --master_port=29500 --nproc_per_node=8 train.py ...  # nodes
Continue from out_dir/ckpt.pt with --init_from=resume. Nothing is lost (run_safety.py): Ctrl-C or SIGTERM finishes
the step and saves (a second Ctrl-C quits at once); a run that diverges (a loss or gradient not finite, a validation
loss above the untrained model's) stops without saving; --overwrite=True replaces an earlier run only when the new
run first saves.
"""
import math
import os
import random
import resource
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, fields
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import model as model_file
from checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint
from configurator import ConfigError, help_text, load_config, optional_types
from model import Model, ModelConfig
from prepare_data import dataset_dir, get_tokenizer, load_tokens, prepare
from run_safety import RunFolder, TrainError, check_resume, check_settings, on_rank_0, resume_states, rng_states

# -----------------------------------------------------------------------------
# default settings: a small FM model on the default corpus, a few minutes on a 2-core CPU
# I/O
out_dir = 'out'  # the run's folder: ckpt.pt (the last step), best.pt (the best validation loss)
eval_interval = 100  # evaluate, and write ckpt.pt (and best.pt when val improves), every eval_interval steps
eval_iters = 16  # the validation set is eval_iters * batch_size fixed windows
log_interval = 10  # steps between log lines
always_save_checkpoint = True  # False: write ckpt.pt only at the end (best.pt is written whenever val improves)
init_from = 'scratch'  # 'scratch' or 'resume' (from out_dir/ckpt.pt)
overwrite = False  # True: a scratch run replaces the earlier run's ckpt.pt and best.pt when it first saves
wandb_log = False  # log to Weights & Biases (pip install wandb)
wandb_project = 'factorization-memory'  # its project
wandb_run_name = 'fm'  # its run name
# data: data_dir/{dataset}_{tokenizer}/{train,val}.bin, written by prepare_data.py
dataset = 'default'  # 'default', or the --dataset given to prepare_data.py (a path or hf:NAME)
tokenizer = 'bytes'  # 'bytes' or a tiktoken encoding (e.g. cl100k_base)
data_dir = ''  # where prepare_data.py wrote the token files; '': data/ in this repository, its default
hf_config = ''  # the --hf_config given to prepare_data.py, if any
verify_data = True  # check the checksums of train.bin and val.bin on opening them (0.4 s per GB); False: skip
gradient_accumulation_steps = 1  # micro-batches per step over all processes (divided by the world size under DDP)
batch_size = 16  # micro-batch size per process
block_size = 256  # tokens a sequence: the training context
vocab_multiple = 64  # pad the model's vocab up to a multiple of this when the tokenizer has more than 256 tokens
# model: these and every other ModelConfig field (at ModelConfig's default) can be overridden
mixer = 'fm'  # 'fm', 'attn' or 'mamba2'
n_layer = 4  # blocks
d_model = 128  # width of the residual stream
n_memory = 32  # FM: m, memory rows
top_k = 8  # FM: k rows read and written per token; None: dense
tau = 1.0  # FM: router softmax temperature
fm_conv = 4  # FM's block, not in the paper: a 4-tap convolution on the values (0: none; config/paper_layer.py)
fm_gate = True  # FM's block, not in the paper: an output gate (False: none)
chunk_size = 16  # chunk length of the parallel scan: 16 is fastest for the PyTorch scan on a CPU
# AdamW
learning_rate = 4e-3  # the peak learning rate, reached after warmup_iters
max_iters = 500  # the step training ends at
weight_decay = 0.1  # AdamW's decoupled weight decay, on matrices and embeddings only
beta1 = 0.9  # AdamW's beta1
beta2 = 0.95  # AdamW's beta2
grad_clip = 1.0  # clip the gradient norm at this value; 0.0: no clipping
# learning rate: linear warmup, then cosine decay to min_lr at lr_decay_iters
warmup_iters = 50  # steps of linear warmup
lr_decay_iters = 0  # step where the cosine reaches min_lr; 0: max_iters
min_lr = 4e-4  # the learning rate the cosine decays to
# system
device = 'cuda' if torch.cuda.is_available() else 'cpu'  # 'cpu', 'cuda', 'cuda:1', 'mps', ...
dtype = 'auto'  # 'float32', 'bfloat16' or 'float16' (autocast; a GPU's); 'auto': bfloat16 on CUDA, else float32
compile = False  # torch.compile the model
seed = 1337  # seed of the initial weights and of the batches
# -----------------------------------------------------------------------------
_TRAIN_KEYS = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (bool, int, float, str))]
_EVAL_SEED = 2024  # the validation windows depend on this only, so runs with different seeds compare


def default_config():
    """The defaults above, plus every ModelConfig field not listed above, at ModelConfig's default."""
    config = {k: globals()[k] for k in _TRAIN_KEYS}
    config.update({f.name: f.default for f in fields(ModelConfig) if f.name != 'vocab_size' and f.name not in config})
    return config


def model_args(config):
    return {f.name: config[f.name] for f in fields(ModelConfig) if f.name in config}


def setup_ddp(device):
    """Under torchrun (RANK is set) join the process group: NCCL on CUDA, gloo on CPU -> (rank, world size, device,
    a CPU process group for small messages (no GPU syncs), None alone)."""
    if 'RANK' not in os.environ:
        return 0, 1, device, None
    rank, local_rank, world_size = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE'))
    if device.startswith('cuda'):
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
        dist.init_process_group('nccl', device_id=torch.device(device))
    else:
        dist.init_process_group('gloo')
    return rank, world_size, device, dist.new_group(backend='gloo')


def resolve_dtype(dtype, device_type):
    """The training dtype: 'auto' is bfloat16 on CUDA (float16 where it lacks bfloat16), else float32."""
    if dtype == 'auto':
        dtype = 'bfloat16' if device_type == 'cuda' else 'float32'
    if device_type == 'cuda' and dtype == 'bfloat16' and not torch.cuda.is_bf16_supported():
        dtype = 'float16'
    if device_type == 'cuda':
        torch.set_float32_matmul_precision('high')  # TF32 matmuls where float32 remains
    return dtype


def load_data(cfg, group):
    """The tokenizer, folder, train and val tokens of data_dir/{dataset}_{tokenizer} and the validation windows' starts;
    rank 0 prepares the default corpus if needed."""
    tok = get_tokenizer(cfg.tokenizer)  # checked by check_settings
    folder = dataset_dir(cfg.dataset, cfg.tokenizer, cfg.data_dir, cfg.hf_config or None)
    if cfg.dataset == 'default':  # written once
        on_rank_0(lambda: prepare(dataset='default', tokenizer=cfg.tokenizer, data_dir=cfg.data_dir), group)
    if not (folder / 'train.bin').exists():
        hf_config = f' --hf_config {cfg.hf_config}' if cfg.hf_config else ''
        data_dir = f' --data_dir {cfg.data_dir}' if cfg.data_dir else ''
        raise TrainError(f'no dataset at {folder}. Prepare it with:\n  python prepare_data.py '
                         f'--dataset {cfg.dataset} --tokenizer {cfg.tokenizer}{data_dir}{hf_config}')
    verify = cfg.verify_data and os.environ.get('LOCAL_RANK', '0') == '0'  # one process a node checks them
    try:
        train, val = (load_tokens(folder / f'{split}.bin', cfg.tokenizer, tok.vocab_size, verify=verify)
                      for split in ('train', 'val'))
    except (ValueError, FileNotFoundError) as e:
        raise TrainError(str(e)) from None
    for name, data in (('train', train), ('val', val)):
        if len(data.tokens) < cfg.block_size + 1:
            raise TrainError(f'{name}.bin in {folder} holds {len(data.tokens)} tokens, fewer than '
                             f'block_size + 1 = {cfg.block_size + 1}: use a smaller --block_size or more data')
    val_starts = np.random.default_rng(_EVAL_SEED).integers(0, len(val.tokens) - cfg.block_size,
                                                            size=cfg.eval_iters * cfg.batch_size)
    return SimpleNamespace(tok=tok, folder=folder, train=train.tokens, val=val.tokens, val_starts=val_starts)


def new_model(cfg, config, vocab_size):
    """A fresh Model from the run's settings; a tokenizer of more than 256 ids pads to vocab_multiple."""
    if vocab_size > 256:
        vocab_size = -(-vocab_size // cfg.vocab_multiple) * cfg.vocab_multiple
    return Model(ModelConfig(**model_args(config), vocab_size=vocab_size))


def resumed_model(ckpt, path, cfg, config):
    """The checkpoint's model (check_resume refuses other model settings); the training settings, block_size too,
    are this run's."""
    check_resume(ckpt, path, cfg, config)
    for k, v in ckpt['train_config'].items():
        if k in config and (k == 'block_size' or k not in ckpt['model_config']) and config[k] != v and cfg.master:
            print(f'resume: {k}={config[k]!r} (the checkpoint\'s run had {v!r})')
    model = model_from_checkpoint(ckpt, path)
    model.config.block_size = cfg.block_size  # the context trained from now on (the model has no limit)
    return model


def get_batch(tokens, starts, block_size, device):
    """Inputs x = tokens[s : s+block_size] and targets y = tokens[s+1 : s+block_size+1] for each start s."""
    xy = torch.from_numpy(np.stack([tokens[s:s + block_size + 1] for s in starts]).astype(np.int64))
    if device.type == 'cuda':
        xy = xy.pin_memory().to(device, non_blocking=True)
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()


def random_batch(gen, tokens, cfg, device):
    return get_batch(tokens, gen.integers(0, len(tokens) - cfg.block_size, size=cfg.batch_size), cfg.block_size,
                     device)


@torch.no_grad()
def estimate_loss(model, data, cfg, device, ctx, group):
    """Mean loss per token over the fixed validation windows (split over the ranks under DDP)."""
    model = model.module if isinstance(model, DDP) else model  # no gradient sync in evaluation
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if group is not None else (0, 1)
    mine = data.val_starts[rank::world_size]
    for i in range(0, len(mine), cfg.batch_size):
        x, y = get_batch(data.val, mine[i:i + cfg.batch_size], cfg.block_size, device)
        with ctx:
            _, loss = model(x, y)
        total += torch.tensor([loss.item() * len(x), len(x)], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(total, group=group)
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


def settings(argv):
    """The run's settings from argv, checked before anything is written -> (cfg, config dict); None for --help."""
    if '-h' in argv or '--help' in argv:
        print(__doc__ + '\nsettings (--key=value):\n' + help_text(default_config(), __file__, model_file.__file__))
        return None, None
    config = load_config(default_config(), argv, optional_types(ModelConfig))
    cfg = SimpleNamespace(**config)
    check_settings(cfg, default_config(), model_args(config))
    return cfg, config


def main(argv=()):
    cfg, config = settings(list(argv))
    if cfg is None:
        return None
    rank, world_size, cfg.device, group = setup_ddp(cfg.device)
    cfg.master, cfg.dtype = rank == 0, resolve_dtype(cfg.dtype, torch.device(cfg.device).type)
    try:
        with RunFolder(cfg, group) as run:
            data = load_data(cfg, group)
            return train(cfg, config, run, data, *setup(cfg, config, run, data, rank, world_size, group))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def setup(cfg, config, run, data, rank, world_size, group):
    """The model, its optimizer and loss scaler, and the batch generator: new, or as ckpt.pt left them -> also the
    step, the best validation loss and the untrained model's (None before a scratch run's first evaluation)."""
    device = torch.device(cfg.device)
    iter_num, best_val_loss, untrained_loss, ckpt = 0, math.inf, None, None
    if cfg.init_from == 'resume':
        path = os.path.join(cfg.out_dir, 'ckpt.pt')
        ckpt = load_checkpoint(path)
        iter_num, best_val_loss = ckpt['iter_num'], ckpt['best_val_loss']
        untrained_loss = ckpt.get('untrained_loss', math.log(data.tok.vocab_size))  # older files: a uniform guess
        if iter_num >= cfg.max_iters:
            raise TrainError(f'{path} is at step {iter_num}, which --max_iters={cfg.max_iters} does not pass: set '
                             f'--max_iters above {iter_num} to train on')
        run.saved['ckpt.pt'] = iter_num  # the last good checkpoint until this run saves
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    raw_model = resumed_model(ckpt, path, cfg, config) if ckpt else new_model(cfg, config, data.tok.vocab_size)
    raw_model.to(device)
    optimizer = raw_model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2),
                                               device.type)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.dtype == 'float16')
    gen = np.random.default_rng([cfg.seed, rank])  # this rank's batches
    if ckpt is not None:  # and every random state as ckpt.pt left them: the run goes on as if uninterrupted
        gen = resume_states(ckpt, optimizer, scaler, gen, cfg, rank, world_size, len(data.train))
    if cfg.master:
        tokens = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
        print(f'device {device} ({torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}), dtype '
              f'{cfg.dtype}, world size {world_size}, tokens per step {tokens:,} ({cfg.gradient_accumulation_steps} x '
              f'{cfg.batch_size} x {cfg.block_size})\nmodel: {raw_model.config}\nparameters: '
              f'{raw_model.num_params(non_embedding=False):,} ({raw_model.num_params():,} without embeddings)')
    if cfg.wandb_log and cfg.master:
        import wandb
        wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=config)
    model = torch.compile(raw_model) if cfg.compile else raw_model
    if group is not None:
        model = DDP(model, device_ids=[device.index] if device.type == 'cuda' else None)
    return raw_model, model, optimizer, scaler, gen, iter_num, best_val_loss, untrained_loss


def train(cfg, config, run, data, raw_model, model, optimizer, scaler, gen, iter_num, best_val_loss, untrained_loss):
    """The training loop, from iter_num to max_iters -> the losses logged, {'train': [(step, loss)], 'val': ...}."""
    device = torch.device(cfg.device)
    ctx = nullcontext() if cfg.dtype == 'float32' else torch.autocast(device.type, dtype=getattr(torch, cfg.dtype))
    group, world_size = run.group, dist.get_world_size() if dist.is_initialized() else 1
    grad_accum = cfg.gradient_accumulation_steps // world_size
    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size

    def checkpoint():  # what a resume needs to go on as if uninterrupted (built on every rank; rank 0 writes it)
        return {'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(), 'scaler': scaler.state_dict(),
                'model_config': asdict(raw_model.config), 'train_config': config, 'tokenizer': cfg.tokenizer,
                'iter_num': iter_num, 'best_val_loss': best_val_loss, 'untrained_loss': untrained_loss,
                'rng': rng_states(batch_state, group), 'data_state': {
                    'folder': str(data.folder), 'train_tokens': len(data.train), 'world_size': world_size,
                    'tokens_seen': iter_num * tokens_per_iter}}

    history, start_iter, resumed, stop = {'train': [], 'val': []}, iter_num, cfg.init_from == 'resume', False
    batch_state = gen.bit_generator.state  # before drawing the pending batch: what a resume draws again
    X, Y = random_batch(gen, data.train, cfg, device)
    t_log, iters_since_log, loss_sum = time.time(), 0, torch.zeros((), device=device)
    run.catch_signals()
    while True:
        # evaluate, and save ckpt.pt (and best.pt when val improves); not again right after resuming
        if (iter_num % cfg.eval_interval == 0 or iter_num >= cfg.max_iters) and (iter_num > start_iter or not resumed):
            run.check_finite(iter_num)
            val_loss = estimate_loss(model, data, cfg, device, ctx, group)
            untrained_loss = val_loss if untrained_loss is None else untrained_loss  # a scratch run's first
            run.check_val_loss(val_loss, untrained_loss, iter_num)
            history['val'].append((iter_num, val_loss))
            new_best = iter_num > start_iter and val_loss < best_val_loss
            best_val_loss = val_loss if new_best else best_val_loss
            if cfg.master:
                bpb = f', {val_loss / math.log(2):.4f} bits per byte' if cfg.tokenizer == 'bytes' else ''
                log(cfg, f'step {iter_num}: val loss {val_loss:.4f}{bpb}{" (best)" if new_best else ""}',
                    {'iter': iter_num, 'val/loss': val_loss, 'lr': get_lr(iter_num, cfg)})
            save_last = cfg.always_save_checkpoint or iter_num >= cfg.max_iters
            names = [name for name, wanted in (('ckpt.pt', save_last), ('best.pt', new_best)) if wanted]
            if iter_num > start_iter and names:
                run.save(checkpoint(), names, iter_num)
            t_log = time.time()  # leave evaluation out of the timings
        if iter_num >= cfg.max_iters:
            break
        if stop:  # Ctrl-C or SIGTERM during the last step
            run.save_on_stop(checkpoint(), iter_num)
            return history

        # forward and backward over grad_accum micro-batches, clip, step
        lr = get_lr(iter_num, cfg)
        for param_group in optimizer.param_groups:
            param_group['lr'] = lr
        step_loss = torch.zeros((), device=device)
        for micro_step in range(grad_accum):
            last = micro_step == grad_accum - 1
            with model.no_sync() if group is not None and not last else nullcontext(), ctx:
                _, loss = model(X, Y)
            batch_state = gen.bit_generator.state
            X, Y = random_batch(gen, data.train, cfg, device)  # the next batch, while the accelerator works
            scaler.scale(loss / grad_accum).backward()
            step_loss += loss.detach() / grad_accum
        scaler.unscale_(optimizer)  # float16: the true gradients, to clip and check; otherwise nothing
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
        run.watch(step_loss, None if scaler.is_enabled() else grad_norm, iter_num + 1, lr)  # checked at log, save
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        iter_num, iters_since_log, loss_sum = iter_num + 1, iters_since_log + 1, loss_sum + step_loss

        # log: this rank's loss, averaged over the steps since the last log line
        if iter_num % cfg.log_interval == 0 or iter_num == cfg.max_iters:
            run.check_finite(iter_num)
            lossf = loss_sum.item() / iters_since_log  # .item() waits for the GPU, so the timing is right
            dt = (time.time() - t_log) / iters_since_log
            history['train'].append((iter_num, lossf))
            if cfg.master:
                log_step(cfg, raw_model, iter_num, lossf, lr, tokens_per_iter / dt, dt, device, world_size)
            t_log, iters_since_log, loss_sum = time.time(), 0, torch.zeros((), device=device)
        stop = run.stop_requested()
    if cfg.master:
        finish(cfg, run, iter_num, best_val_loss)
    return history


def finish(cfg, run, iter_num, best_val_loss):
    """The end of a run: where it saved, and how to sample it."""
    best = f' and best.pt (val loss {best_val_loss:.4f})' if (run.folder / 'best.pt').exists() else ''
    print(f'saved {run.folder / "ckpt.pt"} (step {iter_num}){best}; sample it with: python sample.py '
          f'--out_dir={cfg.out_dir}')
    if cfg.wandb_log:
        import wandb
        wandb.finish()


def log(cfg, line, values):
    """Print a log line (rank 0), and log its values to wandb when --wandb_log."""
    print(line, flush=True)
    if cfg.wandb_log:
        import wandb
        wandb.log(values)


def log_step(cfg, raw_model, iter_num, lossf, lr, tok_s, dt, device, world_size):
    """One log line: loss, learning rate, speed, model FLOPs utilisation (CUDA), peak memory."""
    mfu = raw_model.estimate_mfu(tok_s / world_size)  # 0.0 off CUDA
    mfu_text = f', mfu {100 * mfu:.1f}%' if device.type == 'cuda' else ''
    if device.type == 'cuda':
        memory = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS, KiB on Linux
    log(cfg, f'iter {iter_num}: loss {lossf:.4f}, lr {lr:.2e}, {tok_s:,.0f} tok/s{mfu_text}, mem {memory:.2f}GB, '
             f'{1000 * dt:.1f}ms/iter', {'iter': iter_num, 'train/loss': lossf, 'lr': lr, 'mfu': mfu, 'tok_s': tok_s})


if __name__ == '__main__':
    try:
        main(sys.argv[1:])
    except (ConfigError, TrainError, CheckpointError) as e:
        sys.stderr.write(f'error: {e}\n')  # one write: the lines of DDP ranks sharing stderr do not interleave
        sys.exit(1)
