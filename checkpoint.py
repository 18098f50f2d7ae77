"""Checkpoints of train.py: atomic writes, and loading with errors that say what to do.
sample.py, eval.py and bench.py load models through here without importing the training script.

A checkpoint is a torch.save archive, a zip file with one record per tensor storage (and one for the rest, pickled);
torch.save writes the CRC-32 of every record into it. Loading checks them all (about 0.5 s per GB), so a file whose
bytes changed after it was written is refused instead of loaded, and checks that the weights are finite."""
import errno
import math
import os
import shutil
import sys
import zipfile
from pathlib import Path

import torch

from model import Model, ModelConfig
from prepare_data import get_tokenizer

CKPT_KEYS = ('model', 'optimizer', 'model_config', 'train_config', 'iter_num', 'best_val_loss', 'rng',
             'data_state', 'tokenizer')


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or does not fit this code; the message says what to do."""


def save_checkpoint(ckpt, path, then='continue with --init_from=resume'):
    """Write atomically: to a temporary file beside path, then rename, so path is never half-written. If the write
    fails (disk full, no permission), remove the temporary file and raise CheckpointError; path stays as it was."""
    tmp = f'{path}.tmp'
    try:
        with open(tmp, 'wb') as f:
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, (OSError, RuntimeError)):  # torch.save reports a failed write as a RuntimeError
            raise CheckpointError(_write_error(ckpt, path, e, then)) from None
        raise


def _write_error(ckpt, path, error, then):
    """What went wrong writing path, and what to do."""
    cause = error if isinstance(error, OSError) else error.__context__
    folder = os.path.dirname(os.path.abspath(path))
    kept = f'{path} is unchanged' if os.path.exists(path) else f'Nothing was written to {path}'
    if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f'could not write {path}: the disk is full ({cause.strerror}). A checkpoint needs about '
                f'{checkpoint_bytes(ckpt) / 1e6:,.1f} MB; {folder} has {shutil.disk_usage(folder).free / 1e6:,.1f} MB '
                f'free. {kept}: free some space, then {then}')
    reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(error)[:200]
    return f'could not write {path} ({reason}). {kept}: make {folder} writable, then {then}'


def checkpoint_bytes(ckpt):
    """Bytes of the distinct tensor storages in ckpt (tied weights count once): about the size of its file."""
    storages, stack = {}, [ckpt]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return sum(storages.values())


def load_checkpoint(path):
    """Load a checkpoint onto the CPU; raise CheckpointError saying what is wrong and what to do if it is missing,
    unreadable, damaged or not finite (best.pt beside it is suggested only if it loads)."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f'{path} is a folder, not a checkpoint file: give the folder as --out_dir and a file in '
                              f'it as --ckpt (ckpt.pt, or best.pt)')
    if not path.exists():
        raise CheckpointError(f'no checkpoint at {path}: train one first (python train.py, which writes '
                              f'out/ckpt.pt), or point --out_dir at the folder that holds it')
    try:
        return _read(path)
    except CheckpointError as e:
        raise CheckpointError(f'{e}. {_way_on(path)}') from None


def _read(path):
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True, mmap=True)  # ranks share the pages
    except Exception as e:
        raise CheckpointError(f'{path} is not a readable checkpoint: {_damage(path, e)}') from None
    _verify_checksums(path)  # first: a damaged file can unpickle to anything
    missing = [k for k in CKPT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f'{path} is not a checkpoint of this train.py (missing {", ".join(missing)})')
    broken = nonfinite(ckpt['model'])
    if broken:
        raise CheckpointError(f'{path} holds weights that are not finite (NaN or infinity in {", ".join(broken[:3])}'
                              f'{", ..." if len(broken) > 3 else ""}): it was saved by a run that diverged')
    return ckpt


def _verify_checksums(path):
    """Check the CRC-32 of every record of the archive; CheckpointError saying what is damaged."""
    problem = _archive_damage(path, note=True)
    if problem:
        raise CheckpointError(f'{path} is damaged: {problem}')


def _archive_damage(path, note=False):
    """What the zip archive at path shows damaged (a record whose CRC-32 fails, an unreadable index), or None.
    note: say so when it carries no checksums to check."""
    try:
        with zipfile.ZipFile(path) as archive:
            if not any(record.CRC for record in archive.infolist() if record.file_size):
                if note:
                    print(f'note: {path} carries no checksums (saved with '
                          f'torch.serialization.set_crc32_options(False)): loaded unverified', file=sys.stderr)
                return None
            damaged = archive.testzip()
    except Exception as e:  # a changed byte in the index makes zipfile raise almost anything
        return f'its index of records cannot be read ({_brief(e)})'
    return _CHANGED.format(damaged) if damaged is not None else None


_CHANGED = ('the bytes of its record {} do not match the checksum saved with them (the file changed after it was '
            'written: a disk, copy or transfer error)')


def nonfinite(tensors):
    """The names of the floating-point tensors of a {name: tensor} dict that hold a NaN or an infinity. One sum a
    tensor (about 0.05 s per GB on a 2-core CPU), an exact check only where a sum is not finite."""
    floats = {name: t for name, t in tensors.items() if torch.is_floating_point(t)}
    sums = [t.sum(dtype=torch.float32) for t in floats.values()]  # all launched before the first .item() waits
    return [name for (name, t), s in zip(floats.items(), sums)
            if not math.isfinite(s.item()) and not torch.isfinite(t).all()]


def _damage(path, error):
    """What is wrong with a file torch.load could not read."""
    try:
        with open(path, 'rb') as f:
            head = f.read(4)
    except OSError as e:
        return f'it cannot be read ({e.strerror})'
    size = path.stat().st_size
    if size == 0:
        return 'it is empty'
    if head != b'PK\x03\x04':
        return 'it is not a file written by torch.save'
    try:
        has_end = zipfile.is_zipfile(path)
    except Exception:  # an end record, damaged: _archive_damage says so
        has_end = True
    if not has_end:
        return f'it is cut short ({size:,} bytes, the end of its archive is missing)'
    problem = _archive_damage(path)
    return f'it is damaged: {problem}' if problem else f'it is damaged ({_brief(error)})'


def _brief(error):
    """An exception as one short line."""
    return f'{type(error).__name__}: {" ".join(str(error).split())[:200]}'


def _way_on(path):
    best = path.with_name('best.pt')
    if best != path and best.exists():
        try:
            step = _read(best)['iter_num']
            return (f'{best} beside it loads (step {step}): use it instead (sample.py --ckpt=best.pt; to train on '
                    f'from it, copy it to {path} and resume)')
        except CheckpointError:
            pass
    return (f'Start a new run with --init_from=scratch: in a new --out_dir, or with --overwrite=True to replace '
            f'{path.parent}')


# research settings removed on 2026-11-25, at the values of the paper's layer
REMOVED_SETTINGS = {'router_init_std': None, 'eta_bias': 0.0, 'router_weight_decay': True, 'router_balance': 0.0,
                    'router_center': False}


def model_config_of(ckpt, path):
    """The ModelConfig of a checkpoint; CheckpointError if this model.py cannot build it. Checkpoints of before
    2026-11-25 name the removed research settings: at their defaults they are the model this code builds."""
    config = dict(ckpt['model_config'])
    removed = {key: config.pop(key, default) for key, default in REMOVED_SETTINGS.items()}
    changed = [f'{key}={value!r}' for key, value in removed.items() if value != REMOVED_SETTINGS[key]]
    try:
        if changed:
            raise ValueError(f'{", ".join(changed)}: research settings that model.py no longer has')
        return ModelConfig(**config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f'{path} holds a model config this model.py cannot build ({e}): use the model.py '
                              f'version that wrote it (git log), or train a new model in a new --out_dir') from None


def model_from_checkpoint(ckpt, path):
    """Rebuild the model of a checkpoint (on the CPU) with clear errors for a config or weights mismatch."""
    model = Model(model_config_of(ckpt, path))
    try:
        missing, unexpected = model.load_state_dict(ckpt['model'], strict=False)
        problem = '; '.join(f'{what} {", ".join(keys[:3])}{", ..." if len(keys) > 3 else ""}'
                            for what, keys in (('missing', missing), ('unexpected', unexpected)) if keys)
    except RuntimeError as e:  # a weight of another shape
        problem = ' '.join(str(e).split())[:300]
    if problem:
        raise CheckpointError(f'the weights in {path} do not fit the model they describe ({problem}): it was written '
                              f'by another version of model.py; use the version that wrote it, or train a new model '
                              f'in a new --out_dir')
    return model


def tokenizer_of(ckpt, path):
    """The tokenizer a checkpoint was trained with; CheckpointError if it cannot be loaded here."""
    try:
        return get_tokenizer(ckpt['tokenizer'])
    except Exception as e:
        raise CheckpointError(f'{path} was trained with tokenizer {ckpt["tokenizer"]!r}, which cannot be loaded '
                              f'here ({e}); install what it needs (see requirements.txt)') from None
