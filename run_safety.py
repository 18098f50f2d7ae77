"""What keeps train.py (and sample.py) from failing late, or losing or mixing work, apart from the loops that call it:

- check_settings refuses a bad setting, and a batch that cannot fit, before anything is written (sample.py:
  check_generation_fits);
- RunFolder claims out_dir for one run (train.lock), saves its checkpoints, replaces an earlier run's ckpt.pt and
  best.pt as a pair and only at the new run's first save, turns Ctrl-C / SIGTERM into a stop after the current step,
  and stops the run without saving once a loss, gradient norm, weight or validation loss is not finite or the
  validation loss rises above the untrained model's (a blow-up).
"""
import errno
import fcntl
import math
import os
import random
import shutil
import signal
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from checkpoint import CheckpointError, nonfinite, save_checkpoint
from configurator import ConfigError
from model import ModelConfig
from prepare_data import get_tokenizer

CHECKPOINTS = ('ckpt.pt', 'best.pt')
ASIDE = 'earlier-run'  # out_dir/earlier-run/: an earlier run's checkpoints while an --overwrite run's first save runs
_NEVER = 2**62  # the step of a non-finite loss or gradient norm while there has been none


class TrainError(RuntimeError):
    """A problem the user can fix (data, checkpoint, settings); the message says how."""


# ----------------------------------------------------------------------------- settings

AT_LEAST = {  # setting: (its smallest value, what it counts)
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
    'vocab_multiple': (1, 'the multiple the vocabulary is padded to'),
    'seed': (0, 'the seed of the initial weights and the batches'),
}
CHOICES = {'init_from': ('scratch', 'resume'), 'dtype': ('auto', 'float32', 'bfloat16', 'float16')}


def check_settings(cfg, defaults, model_args):
    """Raise ConfigError naming the first setting out of range, and what to set instead."""
    for key, choices in CHOICES.items():
        if getattr(cfg, key) not in choices:
            raise ConfigError(f"--{key}={getattr(cfg, key)!r}: use one of {', '.join(choices)}")
    if not cfg.out_dir:
        raise ConfigError('--out_dir is empty: name the folder the checkpoints go to (the default is out)')
    for key, (low, meaning) in AT_LEAST.items():
        if not getattr(cfg, key) >= low:
            raise ConfigError(f'--{key}={getattr(cfg, key)} is out of range: set it to at least {low} ({meaning})')
    world_size = int(os.environ.get('WORLD_SIZE', '1'))  # torchrun's
    if cfg.gradient_accumulation_steps % world_size:
        raise ConfigError(f'--gradient_accumulation_steps={cfg.gradient_accumulation_steps} counts the micro-batches '
                          f'of a step over all {world_size} processes: make it a multiple of {world_size}')
    if not 0 < cfg.learning_rate:
        raise ConfigError(f'--learning_rate={cfg.learning_rate} is out of range: set it above 0 (the peak learning '
                          f'rate, reached after warmup_iters)')
    if cfg.min_lr > cfg.learning_rate:
        raise ConfigError(f'--min_lr={cfg.min_lr} is above --learning_rate={cfg.learning_rate}: the cosine decays '
                          f'from learning_rate to min_lr; set min_lr lower (e.g. learning_rate / 10)')
    for key in ('beta1', 'beta2'):
        if not 0 <= getattr(cfg, key) < 1:
            raise ConfigError(f"--{key}={getattr(cfg, key)} is out of range: AdamW's {key} must be at least 0 and "
                              f"below 1 (the default is {defaults[key]})")
    if cfg.data_dir and os.path.isfile(cfg.data_dir):
        raise ConfigError(f'--data_dir={cfg.data_dir} is a file: give the folder prepare_data.py writes to')
    if cfg.wandb_log:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError('--wandb_log=True needs wandb: pip install wandb, or leave --wandb_log off') from None
    try:
        vocab_size = get_tokenizer(cfg.tokenizer).vocab_size
        config = ModelConfig(**model_args, vocab_size=vocab_size)
        config.validate()
    except (ValueError, ImportError, RuntimeError) as e:
        raise ConfigError(str(e)) from None
    check_device(cfg.device)
    check_batch_fits(cfg, config, torch.device(cfg.device))
    if cfg.dtype == 'float16' and torch.device(cfg.device).type == 'cpu':
        print("warning: --dtype=float16 on the CPU is slow: with PyTorch's float16 CPU kernels a step of the default "
              "model takes about 10 times as long as in float32. Use --dtype=float32, the default here")


def check_resume(ckpt, path, cfg, config):
    """Refuse to resume a checkpoint of another tokenizer or with other model settings (block_size aside)."""
    if ckpt['tokenizer'] != cfg.tokenizer:
        raise TrainError(f'{path} was trained with tokenizer {ckpt["tokenizer"]!r}, this run uses '
                         f'{cfg.tokenizer!r}: pass --tokenizer={ckpt["tokenizer"]}')
    saved = ckpt['model_config']
    changed = [k for k, v in saved.items() if k in config and k != 'block_size' and config[k] != v]
    if changed:
        raise TrainError(f'{path} holds a model with {", ".join(f"{k}={saved[k]!r}" for k in changed)}; this run '
                         f'asks for {", ".join(f"{k}={config[k]!r}" for k in changed)}. A run resumes with the model '
                         f'it trained: drop those settings (or give the config file the run was started with), or '
                         f'train the new model from scratch in a new --out_dir')


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


def device_memory(device):
    """Bytes of memory of a device: a GPU's, or the machine's RAM."""
    if device.type == 'cuda':
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')


def check_batch_fits(cfg, config, device):
    """Refuse a micro-batch that cannot fit the device, by a lower bound of its memory: the token windows, the
    logits and their gradient in float32, and one float32 activation of every layer's input."""
    tokens = cfg.batch_size * cfg.block_size
    need = tokens * (16 + 8 * config.vocab_size + 4 * config.n_layer * config.d_model)
    have = device_memory(device)
    if need > have:
        raise ConfigError(f'--batch_size={cfg.batch_size} x --block_size={cfg.block_size} = {tokens:,} tokens a '
                          f'micro-batch need more than {need / 1e9:,.1f} GB, and {device} has {have / 1e9:,.1f} GB: '
                          f'lower --batch_size (raise --gradient_accumulation_steps to keep the step)')


def check_generation_fits(model, batch, prompt_len, max_new_tokens):
    """ConfigError, with the estimate, if the decoding buffers of batch rows (the state of every layer: a KV cache
    grows with the length, FM's and Mamba-2's memory do not; the new tokens; the logits) exceed the device's free
    memory."""
    device = model.embed.weight.device
    state = model.init_state(batch, prompt_len + max_new_tokens, 'meta')
    need = sum(t.numel() * t.element_size() for layer in state for t in layer.values())
    need += batch * (8 * max_new_tokens + 4 * 4 * model.config.vocab_size)
    free = torch.cuda.mem_get_info(device)[0] if device.type == 'cuda' else available_memory()
    if need > free:
        raise ConfigError(f'--num_samples={batch} x {prompt_len + max_new_tokens:,} tokens (prompt and '
                          f'--max_new_tokens) need about {need / 1e9:,.1f} GB of decoding buffers, and {device} has '
                          f'{free / 1e9:,.1f} GB free: lower --num_samples or --max_new_tokens')


def available_memory():
    """Bytes of RAM free for new allocations (Linux's MemAvailable; all of it elsewhere)."""
    try:
        with open('/proc/meminfo') as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith('MemAvailable:'))
    except (OSError, StopIteration):
        return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')


# ----------------------------------------------------------------------------- exact resume

def rng_states(batch_state, group):
    """Python, NumPy, torch CPU and CUDA random states, and every rank's batch generator state (gathered over the
    processes' CPU group under DDP)."""
    batch_states = [batch_state]
    if group is not None:
        batch_states = [None] * dist.get_world_size()
        dist.all_gather_object(batch_states, batch_state, group=group)
    np_state = np.random.get_state()
    return {'python': random.getstate(), 'numpy': (np_state[0], np_state[1].tolist(), *np_state[2:]),
            'torch': torch.get_rng_state(),
            'cuda': torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None, 'batch': batch_states}


def resume_states(ckpt, optimizer, scaler, gen, cfg, rank, world_size, train_tokens):
    """Load the optimizer's, the loss scaler's and every random state of ckpt -> this rank's batch generator, where
    the checkpoint's run left it (a new one, with a note, if the world size or the training data changed)."""
    optimizer.load_state_dict(ckpt['optimizer'])
    if ckpt.get('scaler') and scaler.is_enabled():  # float16 runs only; empty for bfloat16 / float32
        scaler.load_state_dict(ckpt['scaler'])
    set_rng_states(ckpt['rng'])
    if ckpt['data_state']['world_size'] == world_size and ckpt['data_state']['train_tokens'] == train_tokens:
        gen.bit_generator.state = ckpt['rng']['batch'][rank]
        return gen
    if cfg.master:
        print('resume: the world size or the training data changed, so the batches differ from an uninterrupted run')
    return np.random.default_rng([cfg.seed, rank, ckpt['iter_num']])


def set_rng_states(rng):
    random.setstate(rng['python'])
    np.random.set_state((rng['numpy'][0], np.array(rng['numpy'][1], dtype=np.uint32), *rng['numpy'][2:]))
    torch.set_rng_state(rng['torch'])
    if rng['cuda'] is not None and torch.cuda.is_available() and len(rng['cuda']) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng['cuda'])


def on_rank_0(step, group):
    """Run step() on rank 0 only -> its result on every rank. An error it raises is raised on every rank (under DDP
    the others would otherwise wait for rank 0 and die of a closed connection): on rank 0 a TrainError or
    CheckpointError as it is, anything else and on the other ranks a TrainError with its message."""
    result, error, failure = None, None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result = step()
        except Exception as e:  # any error: the other ranks must not wait for rank 0 forever
            user = isinstance(e, (TrainError, CheckpointError, ValueError, RuntimeError))  # e.g. a full disk
            failure, error = e, str(e) if user else f'{type(e).__name__}: {e}'
    if group is not None:
        shared = [result, error]
        dist.broadcast_object_list(shared, src=0, group=group)
        result, error = shared
    if isinstance(failure, (TrainError, CheckpointError)):
        raise failure
    if error is not None:
        raise TrainError(error)
    return result


# ----------------------------------------------------------------------------- the run folder

class RunFolder:
    """out_dir of one run, as a context manager: held, written and released by rank 0; group is the processes' CPU
    group under DDP (None alone). Nothing in it is replaced or saved that a resume or sample.py could take for
    another run or a diverged model."""

    def __init__(self, cfg, group=None):
        self.cfg, self.group, self.master = cfg, group, not dist.is_initialized() or dist.get_rank() == 0
        self.folder, self.lock_path = Path(cfg.out_dir), Path(cfg.out_dir) / 'train.lock'
        self.earlier = []  # an earlier run's checkpoints, replaced at this run's first save
        self.saved = {}  # name -> the step this run saved it at
        self.stop = False
        self.nonfinite_at = None  # (2,) the first step of a non-finite loss, gradient norm (device, no syncs)
        self.lrs = {}  # step -> its learning rate, since the last check

    def __enter__(self):
        self.created, self.lock, self.handlers = not self.folder.exists(), None, {}
        try:
            self.earlier = on_rank_0(self._claim, self.group)  # the same on every rank
        except BaseException:
            self._release()
            raise
        return self

    def catch_signals(self):
        """From now on (the training loop), Ctrl-C or SIGTERM stops the run after its step; a second Ctrl-C at once.
        Before, they stop it at once, leaving nothing."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.handlers[sig] = signal.signal(sig, self._request_stop)
            except ValueError:  # not the main thread: no handlers
                pass

    def __exit__(self, *exc):
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)
        self._release()

    def _release(self):
        if self.lock is not None:
            self.lock_path.unlink(missing_ok=True)  # while held: a run that locked the old file retries (_lock)
            self.lock.close()
        if self.master and self.created and self.folder.is_dir() and not any(self.folder.iterdir()):
            self.folder.rmdir()  # a refused run leaves no folder behind

    # ------------------------------------------------------------------- claim

    def _claim(self):
        """Hold out_dir/train.lock (the kernel drops the lock of a process that dies, so a later run takes it
        over), finish or undo an interrupted replacement, and refuse a scratch run into an out_dir that holds
        checkpoints unless --overwrite=True -> the names of the earlier run's checkpoints this run replaces."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            reason = 'it is a file' if self.folder.is_file() else e.strerror
            raise TrainError(f'cannot write to --out_dir={self.folder} ({reason}): pass a folder you can write '
                             f'to') from None
        self.lock = self._lock()
        for name in CHECKPOINTS:  # of a run killed while saving; this run holds the lock
            (self.folder / f'{name}.tmp').unlink(missing_ok=True)
        self._restore_earlier()
        earlier = [name for name in CHECKPOINTS if (self.folder / name).exists()]
        if self.cfg.init_from == 'scratch' and earlier and not self.cfg.overwrite:
            raise TrainError(f'{self.folder} holds {" and ".join(earlier)} of an earlier run, which this new run '
                             f'would replace: continue that run with --init_from=resume, start this one in a new '
                             f'--out_dir, or pass --overwrite=True to replace it')
        return earlier if self.cfg.init_from == 'scratch' else []

    def _lock(self):
        """The open lock file, locked by this process (or unlocked where the file system has no locks)."""
        while True:
            try:
                lock = open(self.lock_path, 'a+')
            except OSError as e:
                raise TrainError(f'cannot write to --out_dir={self.folder} ({e.strerror}): pass a folder you can '
                                 f'write to') from None
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                holder = lock.read().strip() or 'a process that is starting'
                lock.close()
                raise TrainError(f'{self.folder} is in use by another training run ({holder}; lock file '
                                 f'{self.lock_path}): wait for it to finish or stop it, or train in another '
                                 f'--out_dir') from None
            except OSError as e:  # a file system without locks, e.g. Lustre mounted without flock
                print(f'warning: cannot lock {self.lock_path} ({e.strerror}): nothing stops a second run in '
                      f'{self.folder}')
            try:
                if os.stat(self.lock_path).st_ino == os.fstat(lock.fileno()).st_ino:
                    break
            except FileNotFoundError:
                pass
            lock.close()  # the run before removed the file as we locked it: lock the new one
        lock.truncate(0)
        lock.write(f'process {os.getpid()} on {socket.gethostname()}, started {time.strftime("%Y-%m-%d %H:%M:%S")}\n')
        lock.flush()
        return lock

    def _restore_earlier(self, quiet=False):
        """Undo a replacement that a kill or a failed write interrupted (the new run's first save did not finish):
        the earlier run's files go back, any of the new run's go."""
        aside = self.folder / ASIDE
        shutil.rmtree(self.folder / f'{ASIDE}.removed', ignore_errors=True)
        if not aside.exists():
            return
        if (aside / 'moved').exists():  # every checkpoint in out_dir is the new run's
            for name in CHECKPOINTS:
                (self.folder / name).unlink(missing_ok=True)
            (aside / 'moved').unlink()  # so that a kill from here on leaves the earlier run's files alone
        for name in CHECKPOINTS:
            if (aside / name).exists():
                os.replace(aside / name, self.folder / name)
        shutil.rmtree(aside)
        restored = ' and '.join(name for name in CHECKPOINTS if (self.folder / name).exists()) or 'none left'
        if not quiet:
            print(f'note: a run started with --overwrite=True in {self.folder} was stopped before its first '
                  f'checkpoint was written; the earlier run\'s checkpoints ({restored}) are back in place')

    # ------------------------------------------------------------------- save

    def save(self, ckpt, names, step):
        """Write ckpt to out_dir/name for each of names (every rank calls; rank 0 writes), after checking on every
        rank that its weights and optimizer state are finite. The first save of an --overwrite run moves the
        earlier run's files aside, writes, then removes them."""
        self.check_finite(step)
        optimizer_state = {f"the optimizer's {key} of parameter {i}": value
                           for i, state in ckpt['optimizer']['state'].items() for key, value in state.items()}
        broken = nonfinite({**ckpt['model'], **optimizer_state})
        if broken:
            self.diverged(f'{broken[0]} is not finite (NaN or infinity)', step)
        on_rank_0(lambda: self._write(ckpt, names), self.group)
        self.earlier = []
        self.saved.update({name: step for name in names})

    def _write(self, ckpt, names):
        """Rank 0's part of save. A write that fails (a full disk) puts the earlier run back."""
        if not self.earlier:
            for name in names:
                save_checkpoint(ckpt, self.folder / name)
            return
        aside = self._move_earlier_aside()
        try:
            for name in names:
                save_checkpoint(ckpt, self.folder / name, then='start this run again with --overwrite=True (the '
                                                               'earlier run is back in place)')
        except BaseException:
            self._restore_earlier(quiet=True)
            raise
        os.replace(aside, self.folder / f'{ASIDE}.removed')  # atomic: the earlier run is gone as a whole
        shutil.rmtree(self.folder / f'{ASIDE}.removed')
        print(f'replaced the earlier run\'s {" and ".join(self.earlier)} in {self.folder}')

    def _move_earlier_aside(self):
        aside = self.folder / ASIDE
        aside.mkdir(exist_ok=True)
        for name in self.earlier:
            os.replace(self.folder / name, aside / name)
        (aside / 'moved').touch()
        return aside

    def stop_requested(self):
        """Whether Ctrl-C or SIGTERM came (on any rank: every rank stops at the same step)."""
        if self.group is None:
            return self.stop
        flag = torch.tensor([float(self.stop)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def save_on_stop(self, ckpt, step):
        """The last step's ckpt.pt of a run stopped by a signal, unless it would replace an earlier run that the
        --overwrite run has not replaced yet (then nothing of it is kept)."""
        if self.earlier:
            if self.master:
                print(f'stopped at step {step}, before this run\'s first checkpoint: nothing of it was saved, and the '
                      f'earlier run\'s {" and ".join(self.earlier)} in {self.folder} stay as they were')
            return
        if self.saved.get('ckpt.pt') != step:
            self.save(ckpt, ['ckpt.pt'], step)
        if self.master:
            print(f'saved {self.folder / "ckpt.pt"} at step {step}; continue with --init_from=resume')

    def _request_stop(self, signum, frame):
        self.stop = True
        signal.signal(signum, self.handlers[signum])  # a second Ctrl-C stops at once
        if self.master:
            print(f'\n{signal.Signals(signum).name}: stopping after this step (Ctrl-C again to quit now)', flush=True)

    # ------------------------------------------------------------------- divergence

    def watch(self, loss, grad_norm, step, lr):
        """Note, without a host sync, whether the loss and gradient norm of step (at learning rate lr) are finite (a
        float16 scaler skips a step of a non-finite gradient itself: pass grad_norm None then)."""
        self.lrs[step] = lr
        finite = torch.stack([loss.isfinite(), grad_norm.isfinite() if grad_norm is not None else loss.isfinite()])
        if self.nonfinite_at is None:
            self.nonfinite_at = torch.full((2,), _NEVER, device=loss.device)
        self.nonfinite_at = torch.where(~finite & (self.nonfinite_at == _NEVER), step, self.nonfinite_at)

    def check_finite(self, step):
        """Stop if a step so far had a non-finite loss or gradient norm on any rank (one sync)."""
        if self.nonfinite_at is None:
            return
        at = self.nonfinite_at.cpu()
        if self.group is not None:
            dist.all_reduce(at, op=dist.ReduceOp.MIN, group=self.group)
        if at.min() < _NEVER:
            self.diverged(f'the {"loss" if at[0] <= at[1] else "gradient norm"} is not finite (NaN or infinity)',
                          int(at.min()))
        self.lrs = {s: lr for s, lr in self.lrs.items() if s >= step}

    def check_val_loss(self, val_loss, untrained, step):
        """Stop if the validation loss is not finite or above untrained, the loss of the run's first evaluation."""
        if not math.isfinite(val_loss):
            self.diverged(f'the validation loss is {val_loss}', step)
        if val_loss > untrained:
            self.diverged(f'the validation loss {val_loss:.4f} is above the untrained model\'s {untrained:.4f}', step)

    def diverged(self, what, step):
        """Raise the TrainError of a diverged run: nothing is saved after it."""
        if self.saved:
            name = 'ckpt.pt' if 'ckpt.pt' in self.saved else 'best.pt'
            kept = f'{self.folder / name} (step {self.saved[name]}) is the last good checkpoint'
        elif self.earlier:
            kept = f'the earlier run\'s {" and ".join(self.earlier)} in {self.folder} stay as they were'
        else:
            kept = 'no checkpoint was written'
        lr = f' (learning rate {self.lrs[step]:.2e})' if step in self.lrs else ''
        raise TrainError(f'{what} at step {step}{lr}: training stopped without saving; {kept}. Likely causes: a '
                         f'learning rate too high for this model (--learning_rate, --warmup_iters, --grad_clip), bad '
                         f'values in the data, or a damaged checkpoint this run resumed from')

