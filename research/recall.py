"""
Train one model of model.py on multi-query associative recall (research/mqar.py) and test it: a
loop with train.py's optimiser (Model.configure_optimizers: AdamW, betas 0.9 / 0.95, weight decay
0.1 on matrices, gradient clip 1), Zoology's schedule by default (no warmup, cosine decay to 0 over
the steps; --warmup_steps and --decay_to give train.py's linear warmup and floor), bfloat16 autocast
on CUDA, no torch.compile. Each step is a batch of the next training shape (seq_len, n_pairs) of
mqar.TRAIN, batch_tokens / seq_len fresh examples; the loss is the cross-entropy at the answers only
(Model.forward's with targets -1 elsewhere; the head runs at the answers alone). Every stop_interval
steps the mean accuracy over held-out examples of the training shapes (not the test slices) is
measured; training stops early once it passes stop_accuracy (Zoology's rule, 0.99), else at steps.
Then the accuracy at the answers of the held-out examples of each test slice (mqar.TEST), appended
to --out (checked before training) as a row a slice as it ends, with how training ended (stopped:
early or budget, after steps), the bytes of a layer's state (the first layer's init_state buffers
for one sequence of the slice's length) and the bytes a decoding step reads and writes there
(step_state_bytes):
    python research/recall.py --mixer=fm --n_memory=64 --top_k=8 --fm_conv=4 --fm_gate=True
Any mixer of model.py (MIXER_CLASSES, or module:Class such as research.levers:RowRatesFM) and any
ModelConfig field. `bash research/reproduce.sh recall` runs the sweep.
"""
import csv
import fcntl
import math
import os
import re
import sys
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import asdict, fields
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

from configurator import (ConfigError, check_training, help_text, load_config, optional_types,
                          run_main)

import torch
import torch.nn.functional as F

from checkpoint import save_checkpoint
from run import check_device, check_model_fits
from model import Model, ModelConfig
from research.mqar import TRAIN, VOCAB, held_out, mqar

# The budget is Zoology's (HazyResearch/zoology, zoology/experiments/mqar_example_configs/
# original_mqar_configs.py at d88d6f5, whose train and test shapes mqar.TRAIN and TEST are; the loop
# in zoology/train.py): 100,000 training examples of 64/4 and 20,000 of each other shape, batches of
# 256 examples, 32 epochs = 32 x (391 + 4 x 79) = 22,624 steps and 5.76M examples; AdamW, cosine
# annealing to 0 over the epochs (CosineAnnealingLR, eta_min 0, stepped each epoch), no warmup;
# early stopping once the test accuracy passes 0.99, checked each epoch.
SETTINGS = dict(
    name='',  # the run's name ('': MIXER-dD_MODEL-lrLR-sSEED); its model: the name less -lr-s
    out='results/recall.csv',  # the rows are appended to this .csv (its header first when new)
    steps=50000,  # at most this many steps: 50,000 x (256 + 128 + 64 x 3) / 5 = 5.76M examples,
    # Zoology's (above), and more than its 22,624 steps (4,000 were too few: docs/kernel_log.md)
    batch_tokens=16384,  # tokens a training batch: batch_tokens / seq_len examples
    warmup_steps=0,  # linear warmup (Zoology: none), then cosine decay
    decay_to=0.0,  # the cosine ends at learning_rate x decay_to (Zoology: 0; train.py: 0.1)
    learning_rate=1e-3,  # the peak learning rate
    weight_decay=0.1,  # train.py's AdamW settings (Zoology: 0.1, betas 0.9 / 0.999, no clip)
    beta1=0.9,
    beta2=0.95,
    grad_clip=1.0,
    stop_accuracy=0.99,  # stop once the mean accuracy over the training shapes passes this
    # (Zoology: 0.99, on its test mean); 1: never
    stop_interval=707,  # steps between those checks (Zoology: an epoch, 707 batches)
    stop_examples=256,  # held-out examples a training shape for the check (apart from the test's)
    test_examples=512,  # held-out examples a test slice (the same for every run; Zoology: 1,000)
    seed=1,  # of the initial weights and the training examples
    device='cuda' if torch.cuda.is_available() else 'cpu',
    log_interval=250,  # steps between log lines
    checkpoint='',  # '' none; else the training state is saved to this file every stop_interval
    # steps, a run finding it there goes on from it, and it is deleted once the rows are written
)
UNSAVED = ('out', 'device', 'log_interval', 'checkpoint')  # settings a resumed run may change
MODEL_SETTINGS = {f.name: f.default for f in fields(ModelConfig)
                  if f.name not in ('vocab_size', 'block_size')}
MODEL_SETTINGS.update(n_layer=2, d_model=128)  # the papers' 2 layers
FIELDS = ('run', 'model', 'mixer', 'd_model', 'n_memory', 'top_k', 'fm_conv', 'fm_gate', 'd_state',
          'parameters', 'learning_rate', 'seed', 'steps', 'stopped', 'train_accuracy', 'seq_len',
          'n_pairs', 'answers', 'accuracy', 'state_bytes', 'step_bytes', 'train_loss', 'seconds')
AT_LEAST = dict(steps=1, batch_tokens=1, test_examples=1, log_interval=1, warmup_steps=0,
                stop_interval=1, stop_examples=1)
STOP_SEED = 2 * 10 ** 6  # the stop check's held-out examples: STOP_SEED + the shape's index
RUN_NAME = re.compile(r'-lr([0-9.e+-]+)-s(\d+)$')  # NAME-lrLR-sSEED: the model is NAME


def check_schedule(cfg):
    """ConfigError for a decay floor or a stopping accuracy outside what they mean (shares of 1)."""
    if not 0 <= cfg['decay_to'] <= 1:
        raise ConfigError(f"--decay_to={cfg['decay_to']} is out of range: set it to at least 0 and "
                          f"at most 1 (a share of learning_rate; Zoology: 0)")
    if not 0 < cfg['stop_accuracy'] <= 1:
        raise ConfigError(f"--stop_accuracy={cfg['stop_accuracy']} is out of range: set it above 0 "
                          f"and at most 1 (1: never stop early; Zoology: 0.99)")


def learning_rate(step, cfg):
    """Linear warmup to learning_rate (none by default, as Zoology), then cosine decay to
    learning_rate x decay_to at step cfg['steps'] (one past the last)."""
    peak = cfg['learning_rate']
    if step < cfg['warmup_steps']:
        return peak * (step + 1) / cfg['warmup_steps']
    progress = (step - cfg['warmup_steps']) / max(1, cfg['steps'] - cfg['warmup_steps'])
    floor = peak * cfg['decay_to']
    return floor + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (peak - floor)


def answers(model, inputs, targets):
    """The logits at the answers (A, V), in at least float32, and their targets (A,): the head runs
    there alone."""
    hidden = model.hidden(inputs)[0]  # (B, T, d_model)
    asked = targets != -1  # (B, T)
    return model.logits(hidden[asked]), targets[asked]


def train_accuracy(model, checks, batch_tokens, autocast):
    """The mean accuracy over the training shapes' held-out examples (checks: held_out's dict);
    the model is left in training mode."""
    shares = [accuracy(model, *batch, batch_tokens, autocast)[0] for batch in checks.values()]
    model.train()
    return sum(shares) / len(shares)


def settings_of(cfg, model):
    """The settings a run's checkpoint must share with the run resuming it."""
    return {key: value for key, value in cfg.items() if key not in UNSAVED} | asdict(model.config)


def save_state(cfg, model, optimizer, generator, progress):
    """The training state to cfg['checkpoint'] (whole, then renamed): progress is steps done,
    the recent losses, the last check's accuracy and the seconds trained."""
    state = dict(settings=settings_of(cfg, model), model=model.state_dict(),
                 optimizer=optimizer.state_dict(), generator=generator.get_state(),
                 progress=progress)
    save_checkpoint(state, cfg['checkpoint'], then='run it again')


def load_state(cfg, model, optimizer, generator):
    """The progress saved at cfg['checkpoint'] (its weights, moments and examples' generator
    loaded), or None without one there; ConfigError if it holds another run."""
    path = cfg['checkpoint']
    if not path or not os.path.exists(path):
        return None
    state = torch.load(path, map_location=cfg['device'], weights_only=True)
    if state['settings'] != settings_of(cfg, model):
        raise ConfigError(f'--checkpoint={path} holds a run of other settings: pass this run its '
                          f'own --checkpoint, or delete that file to start over')
    model.load_state_dict(state['model'])
    optimizer.load_state_dict(state['optimizer'])
    generator.set_state(state['generator'].cpu())
    print(f"resumed from {path} at step {state['progress'][0]}", flush=True)
    return state['progress']


def train(model, cfg, autocast):
    """At most cfg['steps'] steps on fresh examples, stopping early once the mean accuracy over the
    training shapes passes cfg['stop_accuracy'] (checked every stop_interval steps and at the end),
    going on from cfg['checkpoint'] if it is there -> (the mean loss of the last 10% of the steps
    trained, steps trained, 'early' or 'budget', the last check's accuracy, seconds trained)."""
    device = torch.device(cfg['device'])
    betas = (cfg['beta1'], cfg['beta2'])
    optimizer = model.configure_optimizers(cfg['weight_decay'], cfg['learning_rate'], betas,
                                           device.type)
    generator = torch.Generator(device).manual_seed(cfg['seed'])
    checks = held_out(cfg['stop_examples'], STOP_SEED, TRAIN)
    losses = deque(maxlen=max(1, cfg['steps'] // 10))
    fresh = (0, [], float('nan'), 0.0)
    done, recent, checked, before = load_state(cfg, model, optimizer, generator) or fresh
    losses.extend(torch.tensor(loss, device=device) for loss in recent)
    stopped, start = 'budget', time.time() - before
    model.train()
    for step in range(done, cfg['steps']):
        for group in optimizer.param_groups:
            group['lr'] = learning_rate(step, cfg)
        seq_len, n_pairs = TRAIN[step % len(TRAIN)]
        rows = max(1, cfg['batch_tokens'] // seq_len)
        inputs, targets = mqar(rows, seq_len, n_pairs, generator)
        with autocast:
            loss = F.cross_entropy(*answers(model, inputs, targets))
        loss.backward()
        if cfg['grad_clip']:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg['grad_clip'])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        last = step + 1 == cfg['steps']
        if (step + 1) % cfg['stop_interval'] == 0 or last:
            checked = train_accuracy(model, checks, 4 * cfg['batch_tokens'], autocast)
            print(f'step {step + 1}: training shapes accuracy {checked:.4f}', flush=True)
            if checked > cfg['stop_accuracy']:
                stopped = 'early' if not last else stopped
            if cfg['checkpoint'] and stopped == 'budget' and not last:
                recent = torch.stack(list(losses)).tolist()
                progress = (step + 1, recent, checked, time.time() - start)
                save_state(cfg, model, optimizer, generator, progress)
        if (step + 1) % cfg['log_interval'] == 0 or last or stopped == 'early':
            ms = (time.time() - start) / (step + 1) * 1e3
            print(f"step {step + 1}: loss {loss.item():.4f}, lr {group['lr']:.2e}, "
                  f"{ms:.1f} ms a step", flush=True)
        if stopped == 'early':
            print(f"stopped early at step {step + 1}: the training shapes' accuracy "
                  f"{checked:.4f} > {cfg['stop_accuracy']}", flush=True)
            break
    seconds = time.time() - start
    return torch.stack(list(losses)).mean().item(), step + 1, stopped, checked, seconds


@torch.no_grad()
def accuracy(model, inputs, targets, batch_tokens, autocast):
    """The share of answers whose argmax is the value asked for, and the number of answers."""
    model.eval()
    rows, correct, total = max(1, batch_tokens // inputs.shape[1]), 0, 0
    device = model.embed.weight.device
    for i in range(0, len(inputs), rows):
        with autocast:
            batch = inputs[i:i + rows].to(device), targets[i:i + rows].to(device)
            logits, wanted = answers(model, *batch)
        correct += (logits.argmax(-1) == wanted).sum().item()
        total += len(wanted)
    return correct / total, total


def state_bytes(layer, seq_len):
    """Bytes of a layer's decoding state for one sequence of seq_len tokens (its init_state
    buffers)."""
    return sum(t.numel() * t.element_size() for t in layer.init_state(1, seq_len, 'meta').values())


def check_out(path):
    """ConfigError unless rows can be appended to the .csv at path: a place to write, and
    research/recall.py's header if it holds any (it is created, empty, if new)."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, 'a+', encoding='utf-8') as f:
            f.seek(0)
            header = f.readline().rstrip('\n')
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, 'strerror', None) or 'not text'
        raise ConfigError(f'--out={path} cannot take the rows ({reason}): pass a .csv path in a '
                          f'writable folder') from None
    if header and header != ','.join(FIELDS):
        raise ConfigError(f'--out={path} holds other columns than research/recall.py writes: pass '
                          f'a new --out (or that of a run of it)')


def append_row(row, path):
    """Append row to the .csv at path (its header first when new), under a lock: many runs write
    to one file."""
    with open(path, 'a', newline='') as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        writer = csv.DictWriter(f, FIELDS, lineterminator='\n')
        if f.tell() == 0:
            writer.writeheader()
        writer.writerow(row)


def run(cfg, model_cfg):
    """Train, test each slice of mqar.TEST, append its row to cfg['out'] as it ends -> the rows."""
    torch.manual_seed(cfg['seed'])
    longest = max(seq_len for seq_len, _ in TRAIN)
    config = ModelConfig(vocab_size=VOCAB, block_size=longest, **model_cfg)
    model = Model(config).to(cfg['device'])
    cuda = torch.device(cfg['device']).type == 'cuda'
    if cuda:
        torch.set_float32_matmul_precision('high')
    autocast = torch.autocast('cuda', torch.bfloat16) if cuda else nullcontext()
    name = cfg['name'] or (f"{config.mixer}-d{config.d_model}-lr{cfg['learning_rate']:g}"
                           f"-s{cfg['seed']}")
    print(f'{name}: {model.num_params():,} parameters without the embedding', flush=True)
    train_loss, steps, stopped, checked, seconds = train(model, cfg, autocast)
    layer, rows = model.blocks[0].mixer, []
    for (seq_len, n_pairs), (inputs, targets) in held_out(cfg['test_examples']).items():
        share, total = accuracy(model, inputs, targets, 4 * cfg['batch_tokens'], autocast)
        model_fields = {key: getattr(config, key) for key in FIELDS[2:9]}  # mixer to d_state
        rows.append({'run': name, 'model': RUN_NAME.sub('', name), **model_fields,
                     'parameters': model.num_params(), 'learning_rate': cfg['learning_rate'],
                     'seed': cfg['seed'], 'steps': steps, 'stopped': stopped,
                     'train_accuracy': round(checked, 4), 'seq_len': seq_len,
                     'n_pairs': n_pairs, 'answers': total, 'accuracy': share,
                     'state_bytes': state_bytes(layer, seq_len),
                     'step_bytes': layer.step_state_bytes(seq_len), 'train_loss': train_loss,
                     'seconds': round(seconds, 1)})
        append_row(rows[-1], cfg['out'])
        print(f'{seq_len}/{n_pairs}: accuracy {share:.4f} of {total} answers', flush=True)
    if cfg['checkpoint']:
        Path(cfg['checkpoint']).unlink(missing_ok=True)
    print(f"{name}: trained {steps} steps ({stopped}) in {seconds:.0f} s, wrote {len(rows)} rows "
          f"to {cfg['out']}")
    return rows


def main(argv=()):
    """python research/recall.py --key=value ... -> the rows written (None for --help)."""
    argv = list(argv)
    if '-h' in argv or '--help' in argv:
        print(__doc__ + '\nsettings (--key=value; and every ModelConfig field of model.py):\n'
              + help_text(SETTINGS, __file__))
        return None
    cfg = load_config(SETTINGS | MODEL_SETTINGS, argv, optional_types(ModelConfig),
                      config_files=False, program='research/recall.py')
    check_training(cfg, AT_LEAST)
    check_schedule(cfg)
    check_device(cfg['device'])
    model_cfg = {key: cfg[key] for key in MODEL_SETTINGS}
    try:
        config = ModelConfig(vocab_size=VOCAB, **model_cfg)
        check_model_fits(config, torch.device(cfg['device']))
    except (ValueError, ImportError, RuntimeError) as e:
        raise ConfigError(str(e)) from None
    check_out(cfg['out'])
    return run({key: cfg[key] for key in SETTINGS}, model_cfg)


if __name__ == '__main__':
    run_main(main)
