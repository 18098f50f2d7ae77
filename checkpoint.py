"""train.py's checkpoints: atomic saves; loads that check torch.save's CRC-32s (0.5 s a GB) and the weights."""
import errno
import os
import shutil
import sys
import zipfile
from pathlib import Path

import torch

from model import Model, ModelConfig
from prepare_data import get_tokenizer

CKPT_KEYS = ('model', 'optimizer', 'model_config', 'train_config', 'iter_num', 'best_val_loss', 'rng', 'data_state',
             'tokenizer')


class CheckpointError(RuntimeError):
    """A checkpoint missing, unreadable or not of this code: the message says what to do."""


def save_checkpoint(ckpt, path, then='continue with --init_from=resume', rename=True):
    """ckpt whole to path.tmp, then renamed to path (rename=False: by the caller); CheckpointError if it fails."""
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
        kept = f'{path} is unchanged' if os.path.exists(path) else f'{Path(path).name} was not written'
        full = getattr(cause, 'errno', None) in (errno.ENOSPC, errno.EDQUOT)
        need = 3 * sum({t.untyped_storage().data_ptr(): t.nbytes for t in ckpt.get('model', {}).values()}.values())
        raise CheckpointError(f'could not write {path}' + (  # need: the weights (tied: once), AdamW's 2 moments
            f': the disk is full ({cause.strerror}). A checkpoint needs about {need / 1e6:,.1f} MB; {tmp.parent} has '
            f'{shutil.disk_usage(tmp.parent).free / 1e6:,.1f} MB free. {kept}: free some space' if full else
            f' ({getattr(cause, "strerror", None) or e}). {kept}: make {tmp.parent} writable') + f', then {then}'
        ) from None


def nonfinite(tensors):
    """Names of the float tensors of {name: tensor} holding a NaN or an infinity (a sum each, then exact)."""
    sums = {name: t.sum(dtype=torch.float32) for name, t in tensors.items() if t.is_floating_point()}
    return [name for name, total in sums.items() if not total.isfinite() and not tensors[name].isfinite().all()]


def load_checkpoint(path, advise=True):
    """The checkpoint at path; CheckpointError if missing, unreadable, damaged or not finite, naming what to use."""
    path = Path(path)
    partner = path.with_name('best.pt' if path.name == 'ckpt.pt' else 'ckpt.pt')  # the run's other one
    if path.is_dir():
        raise CheckpointError(f'{path} is a folder, not a checkpoint file: give the folder as --out_dir and a file in '
                              f'it as --ckpt (ckpt.pt or best.pt)')
    if not path.is_file() and path.name in ('ckpt.pt', 'best.pt') and partner.is_file():
        raise CheckpointError(f'no checkpoint at {path}, only {partner.name} beside it: pass --ckpt={partner.name}'
                              + ' (to resume from it, copy it to ckpt.pt)' * (partner.name == 'best.pt'))
    if not path.is_file():
        raise CheckpointError(f'no checkpoint at {path}: train one first ({training_command(path.parent)}), or point '
                              f'--out_dir at the folder that holds it')
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True, mmap=True)
        with zipfile.ZipFile(path) as archive:  # before the contents: damaged, they can be anything
            checked = any(record.CRC for record in archive.infolist() if record.file_size)  # torch.save wrote CRCs
            bad = archive.testzip() if checked else None
        if not checked:
            print(f'note: {path} carries no checksums: loaded unverified', file=sys.stderr)
        problem = None
        if bad:
            problem = f'is damaged: the bytes of its record {bad} do not match the checksum saved ' \
                      f'with them'
        missing = [key for key in CKPT_KEYS if not isinstance(ckpt, dict) or key not in ckpt]
        ours = 'is not a checkpoint of this train.py'
        if not problem and missing:
            problem = f'{ours} (missing {", ".join(missing)})'
        if not problem and not (isinstance(ckpt['iter_num'], int) and ckpt['iter_num'] >= 0):
            problem = f"{ours} (iter_num={ckpt['iter_num']!r}, not a step)"
        broken = [] if problem else nonfinite(ckpt['model'])
        if broken:
            problem = f'holds weights that are not finite (NaN or infinity in ' \
                      f'{", ".join(broken[:3])}): it was saved by a run that diverged'
    except Exception as e:  # a changed byte: torch.load or zipfile raise almost anything
        problem = f'is not a readable checkpoint: it is empty, cut short, damaged or not written by torch.save ' \
                  f'({type(e).__name__})'
    if problem is None:
        return ckpt
    way = ' Give --ckpt a checkpoint that train.py wrote (ckpt.pt or best.pt)'
    if advise and path.name in ('ckpt.pt', 'best.pt'):
        try:
            way = f' {partner} beside it loads (step {load_checkpoint(partner, False)["iter_num"]}): use it instead ' \
                  f'(--ckpt={partner.name}{"; to resume from it, copy it to ckpt.pt" * (partner.name == "best.pt")})'
        except CheckpointError:
            way = f' Start a new run: in a new --out_dir, or with --overwrite=True to replace {path.parent}'
    raise CheckpointError(f'{path} {problem}.{way}')


def training_command(out_dir):
    """The command whose run writes out_dir: train.py with the config that names it, else with --out_dir."""
    configs = [path for path in sorted((Path(__file__).parent / 'config').glob('*.py'))
               if f'\nout_dir = {str(out_dir)!r}' in '\n' + path.read_text(encoding='utf-8')]
    return f'python train.py config/{configs[0].name}' if configs else f'python train.py --out_dir={out_dir}'


def model_from_checkpoint(ckpt, path, device='cpu'):
    """A checkpoint's model (device 'meta': shapes only); CheckpointError if it cannot be built or loaded."""
    try:
        with torch.device(device):
            model = Model(ModelConfig(**ckpt['model_config']))
        keys = model.load_state_dict(ckpt['model'], strict=False) if device != 'meta' else ([], [])
        problem = '; '.join(f'{what} {", ".join(names[:3])}{", ..." * (len(names) > 3)}'
                            for what, names in zip(('missing', 'unexpected'), keys) if names)
    except (TypeError, ValueError, RuntimeError) as e:  # a setting model.py lacks, a weight of another shape
        problem = ' '.join(str(e).split())[:300]
    if problem:
        raise CheckpointError(f'{path} holds a model this model.py cannot build or load ({problem}): use the version '
                              f'of model.py that wrote it (git log), or train anew in a new --out_dir')
    return model


def tokenizer_of(ckpt, path):
    """A checkpoint's tokenizer; CheckpointError if it cannot be loaded here or holds ids past the model's vocab."""
    try:
        tok = get_tokenizer(ckpt['tokenizer'])
    except Exception as e:
        raise CheckpointError(f'{path} was trained with tokenizer {ckpt["tokenizer"]!r}, which cannot be loaded '
                              f'here ({e}); install what it needs (requirements.txt)') from None
    if tok.vocab_size > ckpt['model_config']['vocab_size']:
        raise CheckpointError(f"{path} names tokenizer {ckpt['tokenizer']!r} of {tok.vocab_size:,} tokens, more than "
                              f"its model's {ckpt['model_config']['vocab_size']:,}: use a checkpoint train.py wrote")
    return tok
