"""train.py's checkpoints: atomic saves; loads that check torch.save's CRC-32s (0.5 s a GB) and
the weights."""
import errno
import os
import shutil
import sys
import zipfile
from pathlib import Path

import torch

from model import Model, ModelConfig
from prepare_data import get_tokenizer

CKPT_KEYS = ('model', 'optimizer', 'model_config', 'train_config', 'iter_num', 'best_val_loss',
             'rng', 'data_state', 'tokenizer')


class CheckpointError(RuntimeError):
    """A checkpoint missing, unreadable or not of this code: the message says what to do."""


def save_checkpoint(ckpt, path, then='continue with --init_from=resume', rename=True):
    """ckpt whole to path.tmp, renamed to path (rename=False: by the caller); CheckpointError."""
    tmp = Path(f'{path}.tmp')
    try:
        with open(tmp, 'wb') as f:
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())
        if rename:
            os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save's failed write: a RuntimeError
        tmp.unlink(missing_ok=True)
        cause = e.__context__ or e
        kept = f'{Path(path).name} was not written'
        if os.path.exists(path):
            kept = f'{path} is unchanged'
        problem = f' ({getattr(cause, "strerror", None) or e}). {kept}: make {tmp.parent} writable'
        if getattr(cause, 'errno', None) in (errno.ENOSPC, errno.EDQUOT):
            problem = f': the disk is full ({cause.strerror}). A checkpoint needs about ' \
                      f'{checkpoint_mb(ckpt):,.1f} MB; {tmp.parent} has ' \
                      f'{shutil.disk_usage(tmp.parent).free / 1e6:,.1f} MB free. {kept}: free ' \
                      f'some space'
        raise CheckpointError(f'could not write {path}{problem}, then {then}') from None


def checkpoint_mb(ckpt):
    """MB of a checkpoint: the weights (tied: once) and AdamW's 2 moments."""
    weights = {t.untyped_storage().data_ptr(): t.nbytes for t in ckpt.get('model', {}).values()}
    return 3 * sum(weights.values()) / 1e6


def nonfinite(tensors):
    """Names of the float tensors of {name: tensor} with a NaN or infinity (a sum, then exact)."""
    floats = {name: t for name, t in tensors.items() if t.is_floating_point()}
    suspects = [name for name, t in floats.items() if not t.sum(dtype=torch.float32).isfinite()]
    return [name for name in suspects if not floats[name].isfinite().all()]


def load_checkpoint(path, advise=True):
    """The checkpoint at path; CheckpointError naming what to use if it is missing, unreadable,
    damaged or not finite."""
    path = Path(path)
    partner, copy = path.with_name('ckpt.pt'), ''  # the run's other one
    if path.name == 'ckpt.pt':
        partner, copy = path.with_name('best.pt'), 'to resume from it, copy it to ckpt.pt'
    if path.is_dir():
        raise CheckpointError(f'{path} is a folder, not a checkpoint file: give the folder as '
                              f'--out_dir and a file in it as --ckpt (ckpt.pt or best.pt)')
    if not path.is_file() and path.name in ('ckpt.pt', 'best.pt') and partner.is_file():
        hint = f' ({copy})' if copy else ''
        raise CheckpointError(f'no checkpoint at {path}, only {partner.name} beside it: pass '
                              f'--ckpt={partner.name}{hint}')
    if not path.is_file():
        raise CheckpointError(f'no checkpoint at {path}: train one first '
                              f'({training_command(path.parent)}), or point --out_dir at the '
                              f'folder that holds it')
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True, mmap=True)
        problem = checkpoint_problem(ckpt, path)
    except Exception as e:  # a changed byte: torch.load or zipfile raise almost anything
        problem = f'is not a readable checkpoint: it is empty, cut short, damaged or not written ' \
                  f'by torch.save ({type(e).__name__})'
    if problem is None:
        return ckpt
    way = ' Give --ckpt a checkpoint that train.py wrote (ckpt.pt or best.pt)'
    if advise and path.name in ('ckpt.pt', 'best.pt'):
        try:
            step = load_checkpoint(partner, False)['iter_num']
            hint = f'; {copy}' if copy else ''
            way = f' {partner} beside it loads (step {step}): use it instead ' \
                  f'(--ckpt={partner.name}{hint})'
        except CheckpointError:
            way = f' Start a new run: in a new --out_dir, or with --overwrite=True to replace ' \
                  f'{path.parent}'
    raise CheckpointError(f'{path} {problem}.{way}')


def checkpoint_problem(ckpt, path):
    """What is wrong with a checkpoint loaded from path (a sentence's end), or None."""
    with zipfile.ZipFile(path) as archive:  # before the contents: damaged, they can be anything
        records = [record for record in archive.infolist() if record.file_size]
        checked = any(record.CRC for record in records)  # torch.save wrote CRCs
        bad = archive.testzip() if checked else None
    if not checked:
        print(f'note: {path} carries no checksums: loaded unverified', file=sys.stderr)
    if bad:
        return f'is damaged: the bytes of its record {bad} do not match the checksum saved ' \
               f'with them'
    ours = 'is not a checkpoint of this train.py'
    missing = [key for key in CKPT_KEYS if not isinstance(ckpt, dict) or key not in ckpt]
    if missing:
        return f'{ours} (missing {", ".join(missing)})'
    step = ckpt['iter_num']
    if not (isinstance(step, int) and step >= 0):
        return f'{ours} (iter_num={step!r}, not a step)'
    broken = nonfinite(ckpt['model'])
    if broken:
        return f'holds weights that are not finite (NaN or infinity in ' \
               f'{", ".join(broken[:3])}): it was saved by a run that diverged'
    return None


def training_command(out_dir):
    """The train.py command that writes out_dir: with the config naming it, else --out_dir."""
    line = f'\nout_dir = {str(out_dir)!r}'
    for path in sorted((Path(__file__).parent / 'config').glob('*.py')):
        if line in '\n' + path.read_text(encoding='utf-8'):
            return f'python train.py config/{path.name}'
    return f'python train.py --out_dir={out_dir}'


def model_from_checkpoint(ckpt, path, device='cpu'):
    """A checkpoint's model (device 'meta': shapes only); CheckpointError if it cannot be."""
    try:
        with torch.device(device):
            model = Model(ModelConfig(**ckpt['model_config']))
        keys = ([], [])
        if device != 'meta':
            keys = model.load_state_dict(ckpt['model'], strict=False)
        problems = []
        for what, names in zip(('missing', 'unexpected'), keys):
            more = ', ...' if len(names) > 3 else ''
            if names:
                problems.append(f'{what} {", ".join(names[:3])}{more}')
        problem = '; '.join(problems)
    except (TypeError, ValueError, RuntimeError) as e:  # a setting model.py lacks, a weight's shape
        problem = ' '.join(str(e).split())[:300]
    if problem:
        raise CheckpointError(f'{path} holds a model this model.py cannot build or load '
                              f'({problem}): use the version of model.py that wrote it (git log), '
                              f'or train anew in a new --out_dir')
    return model


def tokenizer_of(ckpt, path):
    """A checkpoint's tokenizer; CheckpointError if it cannot load or outgrows the model's vocab."""
    name, vocab = ckpt['tokenizer'], ckpt['model_config']['vocab_size']
    try:
        tok = get_tokenizer(name)
    except Exception as e:
        raise CheckpointError(f'{path} was trained with tokenizer {name!r}, which cannot be loaded '
                              f'here ({e}); install what it needs (requirements.txt)') from None
    if tok.vocab_size > vocab:
        raise CheckpointError(f"{path} names tokenizer {name!r} of {tok.vocab_size:,} tokens, more "
                              f"than its model's {vocab:,}: use a checkpoint train.py wrote")
    return tok
