"""What keeps a training run from losing work, each behind one call of train.py: settings and
data checked before any work (the device's memory too: sample.py, eval.py and research/recall.py
check theirs here), the out_dir held by one run, saves whole and in pairs, resumes checked,
signals that stop after a step, every rank agreeing, values not finite stopping the run unsaved."""
import contextlib
import fcntl
import importlib.util
import json
import math
import os
import random
import resource
import shlex
import signal
import threading
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from checkpoint import CheckpointError, nonfinite, save_checkpoint
from configurator import ConfigError, check_training
from model import Model, ModelConfig
from prepare_data import get_tokenizer

DTYPES = ('auto', 'float32', 'bfloat16', 'float16')  # --dtype's choices
AT_LEAST = dict(batch_size=1, block_size=1, gradient_accumulation_steps=1, max_iters=1,
                warmup_iters=0, eval_interval=1, eval_iters=1, log_interval=1, lr_decay_iters=0,
                min_lr=0, vocab_multiple=1)
MAX_ACCUMULATION = 2 ** 14  # micro-batches a step: beyond, a larger --batch_size
# the files of a run (eval.py writes the routing ones)
RUN_FILES = ('ckpt.pt', 'best.pt', 'routing.json', 'routing.png')
NEVER = 2 ** 62  # the step of a loss or gradient norm not finite, while there is none
# nats above the untrained model's val loss: a blow-up (early noise moves ~0.1)
BLOW_UP = 0.5


class TrainError(RuntimeError):
    """A problem the user can fix (data, checkpoint, settings, divergence):
    the message says how."""


# ------------------------------------------------------------------- settings and data, checked


def model_args(cfg):
    """The ModelConfig fields of the settings cfg, but vocab_size."""
    return {f.name: getattr(cfg, f.name) for f in fields(ModelConfig) if f.name != 'vocab_size'}


def check_settings(cfg, defaults):
    """ConfigError naming the first setting out of range or beyond the device, and its fix; a
    warning for each setting likely wrong (ignored ones are recorded at their defaults)."""
    check_ranges(cfg)
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


def check_ranges(cfg):
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


def mixer_tags():
    """{setting: the mixers that read it}, from ModelConfig.MIXER_SETTINGS."""
    tags = {}
    for family, keys in ModelConfig.MIXER_SETTINGS.items():
        for key in keys:
            tags.setdefault(key, []).append(family)
    return tags


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


# ----------------------------------------------------------------------------- the machine


def resolve_dtype(dtype, device):
    """--dtype's 'auto': bfloat16 on CUDA, else float32."""
    if dtype != 'auto':
        return dtype
    if torch.device(device).type == 'cuda':
        return 'bfloat16'
    return 'float32'


def check_device(name):
    """ConfigError unless name is a device of this machine."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device={name} is not a device: use 'cpu', 'cuda', 'cuda:N' or "
                          f"'mps'") from None
    counts = {'cpu': 1, 'cuda': torch.cuda.device_count(),
              'mps': int(torch.backends.mps.is_available())}
    count, kind = counts.get(device.type, 0), device.type
    if (device.index or 0) < count:
        return
    has, use = f'{count} {kind} devices', f'{kind}:0 to {kind}:{count - 1}'
    if count == 1:
        has, use = f'1 {kind} device', kind
    if count == 0:
        has, use = f'no {kind} device', 'cpu'
    raise ConfigError(f'--device={name}, but this machine has {has}: use --device={use}')


def memory(device, free=False):
    """Bytes of a GPU's memory, or the machine's RAM (free: available to new allocations)."""
    if device.type == 'cuda' and free:
        return torch.cuda.mem_get_info(device)[0]
    if device.type == 'cuda':
        return torch.cuda.get_device_properties(device).total_memory
    if free:  # Linux's MemAvailable (page cache counts as free), else all of it
        with contextlib.suppress(OSError, IndexError), open('/proc/meminfo') as f:
            lines = [line for line in f if line.startswith('MemAvailable:')]
            return int(lines[0].split()[1]) * 1024
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')


def peak_memory(device):
    """GB: the peak memory allocated on a GPU, else the process's peak RSS (KiB on Linux)."""
    if device.type == 'cuda':
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def count_params(config):
    """The parameters of ModelConfig config, from 1- and 2-layer models on 'meta': a huge n_layer
    is refused by the memory check, not built; a mixer's own checks run."""
    with torch.device('meta'):
        one, two = (Model(replace(config, n_layer=n)).num_params(False) for n in (1, 2))
    return one + (config.n_layer - 1) * (two - one)


def check_model_fits(config, device):
    """The parameters of config; ConfigError if the model, its gradients and AdamW's 2 moments
    (16 bytes a parameter) cannot fit on device."""
    n_params = count_params(config)
    need, have = 16 * n_params / 1e9, memory(device) / 1e9  # GB
    if need > have:
        raise ConfigError(f"the model's {n_params:,} parameters need {need:,.1f} GB (weights, "
                          f"gradients, AdamW's moments); {device} has {have:,.1f} GB: lower "
                          f"--n_layer or --d_model, or the mixer's --n_memory or --d_state")
    return n_params


def check_batch_fits(batch_size, block_size, config, n_params, device):
    """ConfigError if a micro-batch (tokens, float32 logits and gradient, an activation a layer)
    cannot fit beside the model (check_model_fits)."""
    model, have = 16 * n_params / 1e9, memory(device) / 1e9  # GB
    token = 16 + 8 * config.vocab_size + 4 * config.n_layer * config.d_model  # bytes
    need = batch_size * block_size * token / 1e9
    if model + need > have:
        raise ConfigError(f'--batch_size={batch_size} x --block_size={block_size} tokens a '
                          f'micro-batch need more than {need:,.1f} GB beside the model; {device} '
                          f'has {have - model:,.1f} GB left: lower --batch_size (raise '
                          f'--gradient_accumulation_steps to keep the step)')


# ----------------------------------------------------------------------------- the run


class Run:
    """A run's hold on out_dir, its last saves and its stop (the signal, agreed by all ranks)."""

    def __init__(self, out_dir):
        self.folder, self.created = Path(out_dir), not os.path.exists(out_dir)
        # torchrun's values, which train.py sets
        self.rank, self.world_size, self.group = 0, 1, None
        self.master, self.lock, self.handlers = True, None, {}
        # {name: step}, files replaced, signal
        self.saved, self.earlier, self.stop = {}, [], 0
        # whether this process has trained a step (train.py's loop)
        self.stepped = False

    def claim(self, resume, overwrite):
        """out_dir locked by this run alone, an earlier save's renames finished; its files
        refused unless resumed or overwritten (the first save replaces them)."""
        self.earlier = self.on_rank_0(lambda: self._claim(resume, overwrite))

    def _claim(self, resume, overwrite):
        self._lock()
        # the new files are whole: finish the swap
        if (self.folder / 'replacing').exists():
            swap_in(self.folder, (self.folder / 'replacing').read_text().split())
        # the temporary files of a run killed before its journal
        for name in ('ckpt.pt', 'best.pt', 'replacing'):
            (self.folder / f'{name}.tmp').unlink(missing_ok=True)
        earlier = [name for name in RUN_FILES if (self.folder / name).exists()]
        checkpoints = [name for name in earlier if name.endswith('.pt')]
        if resume:
            return []
        if checkpoints and not overwrite:
            raise TrainError(f'{self.folder} holds {" and ".join(checkpoints)} of an earlier run: '
                             f'continue it (--init_from=resume), use a new --out_dir, or pass '
                             f'--overwrite=True')
        return earlier

    def _lock(self):
        lock = self.folder / 'train.lock'
        # till the file locked is the one at lock (an ending run unlinks)
        while self.lock is None:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                self.lock = open(lock, 'a+')
                fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.lock.seek(0)
                holder = self.lock.read().strip() or 'a process that is starting'
                self.lock = None
                raise TrainError(f'{self.folder} is in use by {holder}: wait for it, or use '
                                 f'another --out_dir') from None
            except OSError as e:  # no folder, or a file system without locks (Lustre's)
                if self.lock is None:
                    reason = 'it is a file' if self.folder.is_file() else e.strerror
                    raise TrainError(f'cannot write --out_dir={self.folder} ({reason}): pass a '
                                     f'writable folder') from None
                print(f'warning: cannot lock {lock} ({e.strerror}): nothing stops a second run '
                      f'in {self.folder}')
            if not lock.exists() or lock.stat().st_ino != os.fstat(self.lock.fileno()).st_ino:
                self.lock = self.lock.close()
        self.lock.truncate(0)
        since = time.strftime('%F %T')
        print(f'process {os.getpid()} on {os.uname().nodename}, since {since}', file=self.lock,
              flush=True)

    def release(self):
        """The signal handlers as they were, the lock removed,
        a folder this run left empty gone."""
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)
        # removed while held (a run that locked this file retries)
        if self.lock is not None:
            (self.folder / 'train.lock').unlink(missing_ok=True)
            self.lock.close()
        empty = self.folder.is_dir() and not any(self.folder.iterdir())
        if self.created and self.master and empty:
            self.folder.rmdir()  # a refused run leaves no folder behind

    def catch_signals(self, compiled):
        """Ctrl-C, SIGTERM or SIGHUP now stop the run after its step, saved (self.stop: the
        signal); a second Ctrl-C quits at once, as does the first before a compiled model's
        first step ends (self.stepped; its compiles can outlast torchrun's 30 s grace)."""
        def request_stop(signum, frame):
            name = signal.Signals(signum).name
            if compiled and not self.stepped:
                if self.master:
                    print(f'\n{name}: nothing trained yet to save: quitting now', flush=True)
                raise SystemExit(128 + signum)
            self.stop = signum
            signal.signal(signum, self.handlers[signum])
            if self.master:
                print(f'\n{name}: stopping after this step (Ctrl-C again to quit now)', flush=True)
        # only the main thread takes signals
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                self.handlers[sig] = signal.signal(sig, request_stop)

    def stopped(self):
        """The signal that stops the run (0: none): any rank's stops all."""
        if self.group is not None:
            stop = torch.tensor([float(self.stop)])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=self.group)
            self.stop = int(stop.item())
        return self.stop

    def on_rank_0(self, step):
        """step() on rank 0 -> its result, or its error raised, on every rank (else they hang)."""
        shared = [None, None]  # the result, the error
        if self.group is None or dist.get_rank() == 0:
            try:
                shared[0] = step()
            except (TrainError, CheckpointError) as e:
                shared[1] = e
            # e.g. a full disk preparing data
            except (OSError, ValueError, RuntimeError) as e:
                shared[1] = TrainError(str(e))
            except Exception as e:
                shared[1] = TrainError(repr(e))
        if self.group is not None:
            dist.broadcast_object_list(shared, src=0, group=self.group)
        if shared[1] is not None:
            raise shared[1]
        return shared[0]

    def save(self, ckpt, names):
        """ckpt written whole as names (ckpt.pt, best.pt) if finite, then renamed in together
        (a journal: a kill between the renames is finished by the next run)."""
        step, optimizer_state = ckpt['iter_num'], ckpt['optimizer']['state']
        state = {**ckpt['model'], **{f"the optimizer's {key} of parameter {i}": value
                                     for i, values in optimizer_state.items()
                                     for key, value in values.items()}}
        broken = nonfinite(state)
        if broken:
            self.diverged(f'{broken[0]} is not finite (NaN or infinity) at step {step}')
        then = 'continue with --init_from=resume'
        if 'ckpt.pt' not in self.saved:
            then = 'start this run again'
        if 'ckpt.pt' not in self.saved and self.earlier:
            then += ' with --overwrite=True (the earlier run is untouched)'
        # names[0] is renamed over
        gone = [name for name in self.earlier if name != names[0]]
        self.on_rank_0(lambda: write(ckpt, names, self.folder, gone, then))
        if self.earlier and self.master:
            print(f"replaced the earlier run's {' and '.join(self.earlier)} in {self.folder}")
        self.earlier = []
        self.saved.update(dict.fromkeys(names, step))

    def check_finite(self, bad, lr_at):
        """Stop the run if a step had a loss or gradient norm not finite, on any rank (one sync);
        bad: (loss, gradient norm) first bad steps, lr_at(step): its learning rate."""
        bad = bad.cpu()
        if self.group is not None:
            dist.all_reduce(bad, op=dist.ReduceOp.MIN, group=self.group)
        if bad.min() < NEVER:
            step = int(bad.min())
            what = 'loss'
            if bad[0] > bad[1]:
                what = 'gradient norm'
            self.diverged(f'the {what} is not finite (NaN or infinity) at step {step} (learning '
                          f'rate {lr_at(step - 1):.2e})')

    def check_blow_up(self, val_loss, untrained_loss, step):
        """Stop the run, unsaved, if the val loss is not finite
        or BLOW_UP above the untrained's."""
        at = f'the validation loss is {val_loss:.4f} at step {step}'
        if not math.isfinite(val_loss):
            self.diverged(f'{at}: not finite')
        if val_loss > untrained_loss + BLOW_UP:
            self.diverged(f"{at}, more than {BLOW_UP} above the untrained model's "
                          f'{untrained_loss:.4f}')

    def diverged(self, what):
        """The TrainError of a diverged run: nothing saved after it."""
        kept = 'no checkpoint was written'
        if self.earlier:
            files = ' and '.join(self.earlier)
            kept = f"the earlier run's {files} in {self.folder} stay as they were"
        if self.saved:
            name = 'ckpt.pt' if 'ckpt.pt' in self.saved else 'best.pt'
            kept = f'{self.folder / name} (step {self.saved[name]}) is the last good checkpoint'
        raise TrainError(f'{what}: training stopped without saving; {kept}. Likely causes: a '
                         f'learning rate too high (--learning_rate, --warmup_iters, --grad_clip), '
                         f'too strong a --weight_decay, bad data, or a damaged checkpoint resumed')

    def say_stopped(self, step, trained):
        """The line of a run a signal stopped: saved (trained), or what stays."""
        if not self.master:
            return
        if trained:
            print(f'saved {self.folder / "ckpt.pt"} at step {step}; continue with '
                  f'--init_from=resume')
        elif self.earlier:
            print(f'stopped at step {step}: nothing saved (the earlier run\'s '
                  f"{' and '.join(self.earlier)} in {self.folder} stay)")
        else:
            print(f'stopped at step {step}: nothing saved')

    def resume(self, cfg, ckpt, learner, data):
        """Go on from ckpt (optimizer, random states, batches) as if never stopped -> the progress
        (step, losses); TrainError if ckpt is not of the model asked or has no steps to go."""
        path, step = self.folder / 'ckpt.pt', ckpt['iter_num']
        asked = ModelConfig(**model_args(cfg), vocab_size=learner.model.config.vocab_size)
        notes = check_resume(cfg, ckpt, learner.model.config, asked, path)
        cfg.seed = ckpt['train_config']['seed']  # its random states are the run's
        progress = {key: ckpt.get(key) for key in ('iter_num', 'best_val_loss', 'untrained_loss')}
        progress['eval_cut'] = ckpt.get('eval_cut', False)
        self.saved = {'ckpt.pt': step}  # its last good checkpoint till a save
        # other validation data: the losses do not compare
        if ckpt['data_state'].get('val_set') != data.val_set:
            progress['best_val_loss'] = math.inf
            # the loss of a uniform model
            progress['untrained_loss'] = math.log(data.tok.vocab_size)
            notes.append("the validation set is not the checkpoint's (other data, block_size, "
                         'eval_iters or batch_size): the best loss starts over')
        learner.optimizer.load_state_dict(ckpt['optimizer'])
        if ckpt.get('scaler') and learner.scaler.is_enabled():  # float16 runs only
            learner.scaler.load_state_dict(ckpt['scaler'])
        restore_random_states(ckpt['rng'])
        saved = ckpt['data_state']
        if (saved['world_size'], saved['train_tokens']) == (self.world_size, len(data.train)):
            learner.batches.gen.bit_generator.state = ckpt['rng']['batch'][self.rank]
        else:
            learner.batches.gen = np.random.default_rng([cfg.seed, self.rank, step])
            notes.append('the world size or the training data changed: the batches differ from a '
                         'straight run')
        if self.master and notes:
            print(f"resume: {', '.join(notes)}")
        return progress

    def checkpoint(self, cfg, learner, data, progress):
        """This step's checkpoint: all a resume needs to go on bit for bit."""
        model_config = asdict(learner.model.config)
        return {
            'model': learner.model.state_dict(), 'optimizer': learner.optimizer.state_dict(),
            'scaler': learner.scaler.state_dict(), 'model_config': model_config,
            'tokenizer': cfg.tokenizer,
            'train_config': {k: model_config.get(k, v) for k, v in vars(cfg).items()},
            **progress,  # eval_cut: a stop cut this step's evaluation, a resume runs it
            'rng': random_states(learner.batches.state, self.group, self.world_size),
            'data_state': {'folder': str(data.folder), 'train_tokens': len(data.train),
                           'world_size': self.world_size, 'val_set': data.val_set,
                           'tokens_seen': progress['iter_num'] * learner.tokens}}


def write(ckpt, names, folder, gone, then):
    """Rank 0's part of a save: every name's .tmp whole, the journal, then the renames."""
    try:
        for name in names:
            save_checkpoint(ckpt, folder / name, then, rename=False)
    except CheckpointError:  # e.g. a full disk: no whole .tmp of this save stays either
        for name in names:
            (folder / f'{name}.tmp').unlink(missing_ok=True)
        raise
    (folder / 'replacing.tmp').write_text('\n'.join(gone))  # the journal: all are whole
    os.replace(folder / 'replacing.tmp', folder / 'replacing')
    swap_in(folder, gone)


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


def random_states(batch_states, group, world_size):
    """Every random state a resume restores: Python's, numpy's, torch's, CUDA's, each rank's
    batches (batch_states: this rank's)."""
    batches, np_state = [batch_states], np.random.get_state()
    if group is not None:
        batches = [None] * world_size
        dist.all_gather_object(batches, batch_states, group=group)
    cuda = None
    if torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state_all()
    return {'python': random.getstate(),
            'numpy': (np_state[0], np_state[1].tolist(), *np_state[2:]),
            'torch': torch.get_rng_state(), 'batch': batches, 'cuda': cuda}


def restore_random_states(rng):
    """Python's, numpy's, torch's and (same GPU count) CUDA's random states as rng holds them."""
    random.setstate(rng['python'])
    np_state = np.array(rng['numpy'][1], dtype=np.uint32)
    np.random.set_state((rng['numpy'][0], np_state, *rng['numpy'][2:]))
    torch.set_rng_state(rng['torch'])
    cuda = rng['cuda']
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def check_resume(cfg, ckpt, config, asked, path):
    """TrainError if ckpt (its model's config) is not the model asked or has no steps left
    before max_iters -> notes of the settings that changed."""
    saved = asdict(config) | {'tokenizer': ckpt['tokenizer']}
    asked = asdict(asked) | {'tokenizer': cfg.tokenizer}
    changed = [k for k, v in saved.items() if k != 'block_size' and asked[k] != v]
    if changed:
        has = ', '.join(f'{k}={saved[k]!r}' for k in changed)
        wants = ', '.join(f'{k}={asked[k]!r}' for k in changed)
        flags = ' '.join(f'--{k}={saved[k]}' for k in changed)
        raise TrainError(f'{path} holds a model with {has}; this run asks for {wants}: pass '
                         f'{flags} (or its config file), or use a new --out_dir')
    step = ckpt['iter_num']
    # a last evaluation cut short: run it
    if step >= cfg.max_iters and not ckpt.get('eval_cut'):
        raise TrainError(f'{path} is at step {step}, which --max_iters={cfg.max_iters} does not '
                         f'pass: set it higher')
    kept, notes = (*saved, 'init_from', 'out_dir', 'seed'), []  # seed: noted below
    for k, v in ckpt['train_config'].items():
        if vars(cfg).get(k, v) != v and (k == 'block_size' or k not in kept):
            notes.append(f'{k}={vars(cfg)[k]!r} (was {v!r})')
    seed = ckpt['train_config']['seed']
    if cfg.seed != seed:
        notes.append(f'--seed={cfg.seed} is not used: the random states are restored from the '
                     f'checkpoint (seed {seed})')
    return notes
