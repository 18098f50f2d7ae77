"""Shared by test_fm.py and tests/ (pytest loads this file first): the TRITON_INTERPRET setup, each pytest-xdist
worker's share of the cores, markers (gpu: every test named *_gpu*), fixtures (data_dir, trained, default_bytes,
repo_corpus) and the helpers several test files use (`from conftest import ...`)."""

import contextlib
import fcntl
import os
import re
import subprocess
from types import SimpleNamespace

import torch

# The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them. torch counts them through NVML without starting
# CUDA, so a pytest-xdist worker can still be pinned to one of them below.
_names, _count = os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count()
ALL_GPUS = _names.split(",")[:_count] if _names else [str(i) for i in range(_count)]
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
GIB_PER_WORKER = 5  # a worker's peak GPU memory, its subprocesses' included, with headroom (docs/kernel_log.md)

if os.environ.get("PYTEST_XDIST_WORKER"):  # worker gwN: GPU N mod #GPUs, and workers x threads <= cores
    if ALL_GPUS:
        os.environ["CUDA_VISIBLE_DEVICES"] = ALL_GPUS[int(os.environ["PYTEST_XDIST_WORKER"][2:]) % len(ALL_GPUS)]
    _threads = max(1, CORES // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    torch.set_num_threads(_threads)
    os.environ["OMP_NUM_THREADS"] = str(_threads)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first Triton import


def default_workers():
    """pytest-xdist's worker count here: a worker a core; with GPUs, also no more than their free memory holds at
    GIB_PER_WORKER a worker (the workers are dealt to the GPUs in turn)."""
    if not ALL_GPUS:
        return CORES
    try:  # nvidia-smi starts no CUDA context here; without it, each GPU's whole memory
        query = subprocess.run(['nvidia-smi', '--query-gpu=index,uuid,memory.free', '--format=csv,noheader,nounits'],
                               capture_output=True, text=True, check=True).stdout.splitlines()
        free = {name: int(mib) / 1024 for line in query for i, uuid, mib in [line.split(', ')] for name in (i, uuid)}
        free = [free[gpu] for gpu in ALL_GPUS]
    except (OSError, subprocess.CalledProcessError, KeyError, ValueError):
        free = [torch.cuda.get_device_properties(i).total_memory / 2**30 for i in range(len(ALL_GPUS))]
    return max(1, min(CORES, int(min(free) // GIB_PER_WORKER) * len(ALL_GPUS)))


def gpus(n):
    """CUDA_VISIBLE_DEVICES for a test's subprocess that needs n GPUs (a worker itself sees one); skips with fewer."""
    if len(ALL_GPUS) < n:
        pytest.skip(f"needs {n} GPUs; {len(ALL_GPUS)} visible")
    return ",".join(ALL_GPUS[:n])

import pytest

import fm_kernel
import train
import checkpoint
from configurator import load_config, optional_types
import model as model_module
from model import Model, ModelConfig
from prepare_data import prepare


CUDA = torch.cuda.is_available()


def _interpret_bf16_as_on_gpu():
    """Two bfloat16 bugs of Triton 3.9's interpreter (private API, checked against that version): tl.dot
    multiplies the raw bits of bfloat16 operands (it stores bfloat16 as uint16), and float32 -> bfloat16 casts
    truncate. Hand tl.dot float32 copies (exact for bfloat16 values) and round casts to nearest even, as a GPU
    does, so CI runs the kernels' bfloat16 products."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    dot, cast = builder.create_dot, builder.cast_impl

    def as_float(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle(
            interpreter._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, as_float(a), as_float(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if not (src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16):
            return cast(self, src, dst_type)
        bits = src.data.astype(np.float32).view(np.uint32)
        nearest = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # carries into the exponent
        return interpreter.TensorHandle(np.where(np.isnan(src.data), np.uint16(0x7FC0), nearest), tl.bfloat16)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl


if fm_kernel.triton is not None and os.environ.get("TRITON_INTERPRET") == "1":
    _interpret_bf16_as_on_gpu()
needs_triton = pytest.mark.skipif(fm_kernel.triton is None, reason="Triton is not installed (Linux only)")
core = pytest.mark.core  # the checks a forker runs after every change: python test_fm.py -m core (a minute on a GPU)
DEVICE = "cuda" if CUDA else "cpu"


REPO = os.path.dirname(os.path.abspath(__file__))  # the repository's root, where this file lies


def rel_err(a, b):
    """||a - b|| / ||b|| in float64; NaN anywhere fails."""
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def tiny_config(**overrides):
    """2 layers, d_model 32, vocab 64, chunk 16: T = 37 spans three chunks, the last one partial."""
    config = dict(vocab_size=64, block_size=48, n_layer=2, d_model=32, n_memory=8, chunk_size=16,
                  n_head=4, n_kv_head=2, d_state=8, mamba_head_dim=16)
    config.update(overrides)
    return ModelConfig(**config)


def randomized(model, seed=0):
    """model with every parameter drawn at random (normal, std 0.3; norm gains about 1): no parameter at a neutral
    initial value (a zero bias, a unit gain) can hide a path that leaves it out. Returns model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(noise + (1.0 if 'norm' in name else 0.0))
    return model


def prefill(model, idx, lengths=None, max_len=None):
    """One parallel pass over right-padded prompts idx (B, T) of real lengths (B,) (None: all T) -> logits (B, V)
    after each row's last real token, and the decoding state, in buffers for max_len tokens a row (None: T)."""
    B, T = idx.shape
    x, states = model.hidden(idx, lengths=lengths)
    last = torch.full((B,), T - 1, device=idx.device) if lengths is None else lengths - 1
    state = model.init_state(B, T if max_len is None else max_len, idx.device)
    model_module.write_state(state, states)
    return model.logits(x[torch.arange(B, device=idx.device), last]), state


def apart(got, want, start=0):
    """Where two (B, T, ...) tensors differ most, in numbers: 'relative 2.1e-06, max |difference| 3.4e-05 at row
    0, position 37' (position: start + the index along T)."""
    diff = (got.double() - want.double()).abs()
    where = torch.unravel_index(diff.argmax(), diff.shape)
    row, position = int(where[0]), start + int(where[1])
    return f"relative {rel_err(got, want):.1e}, max |difference| {diff.max():.1e} at row {row}, position {position}"


DECODING = "decoding differs from training, a bug whatever was edited"


def assert_decodes_as_it_trains(model, idx, prompt, tol=1e-12):
    """model's forward logits = prefill(prompt tokens) + one step a token after them, to relative tol, or an
    AssertionError saying where they differ most."""
    logits, _ = model(idx)
    last, state = prefill(model, idx[:, :prompt], max_len=idx.shape[1])
    stepped = torch.stack([last] + [model.step(idx[:, t], state) for t in range(prompt, idx.shape[1])], 1)
    want = logits[:, prompt - 1:]
    assert rel_err(stepped, want) < tol, f"{DECODING}: {apart(stepped, want, prompt - 1)}"


@contextlib.contextmanager
def using_scan(scan):
    """Context in which the model's FM layers run `scan` (a function like fm_scan)."""
    with pytest.MonkeyPatch.context() as patch:
        def dense(x, idx, theta, phi, h0, n_memory, eps, chunk):
            return scan(x, *model_module.spread(idx, theta, phi, n_memory), h0, eps)
        patch.setattr(model_module, 'memory_scan', dense)
        yield


def save_model_checkpoint(model, out_dir, tokenizer='bytes', **fields):
    """A checkpoint of model as train.py writes one (without optimizer and random states) -> out_dir."""
    from dataclasses import asdict
    os.makedirs(out_dir, exist_ok=True)
    ckpt = {key: None for key in checkpoint.CKPT_KEYS}
    ckpt.update(model=model.state_dict(), model_config=asdict(model.config), train_config={'max_iters': 0},
                iter_num=0, best_val_loss=1.0, data_state={'tokens_seen': 0}, tokenizer=tokenizer)
    ckpt.update(fields)
    checkpoint.save_checkpoint(ckpt, os.path.join(out_dir, 'ckpt.pt'))
    return str(out_dir)


def defaults():
    return train.default_config(), optional_types(ModelConfig)


def build(*args):
    """train.py's settings from args (config files and --key=value) and the Model they make, on the meta device (no
    memory) -> (settings, model)."""
    config, types = defaults()
    c = load_config(config, list(args), types)
    vocab = 100288 if c['tokenizer'] == 'cl100k_base' else 256  # cl100k_base's 100,277 padded to a multiple of 64
    with torch.device('meta'):
        return c, Model(ModelConfig(**train.model_args(SimpleNamespace(**c)), vocab_size=vocab))


TEXT = "To be, or not to be: that is the question.\n\tCafé — ‘naïve’ 🎭 ends <|endoftext|> here\n"

# documents of the local corpora: ASCII, accents, emoji, CJK, blank lines, a literal special token
DOCUMENTS = [f"Document {i}: {TEXT * (i % 5 + 1)}{'世界' * i}\n\n{'x' * (i * 37 % 101)}" for i in range(40)]


def corrupt(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.fixture(autouse=True)
def float32_matmul_precision():
    """Each test starts and ends at the default float32 precision (no TF32): train.main on a GPU sets TF32 for its
    process, which would reach whichever tests pytest-xdist deals to that process next. It ends with the GPU memory
    it freed handed back (torch keeps freed blocks), so a worker holds no more than its current test needs."""
    torch.set_float32_matmul_precision('highest')
    yield
    torch.set_float32_matmul_precision('highest')
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture(scope='session')  # one for the suite, as when it was one module
def data_dir(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp('data')
    prepare(dataset='default', tokenizer='bytes', data_dir=str(data_dir))
    return str(data_dir)


@pytest.fixture(scope='session')
def repo_corpus(tmp_path_factory):
    """The default corpus prepared in the repository's data/, for the scripts a test runs as a user would (bash
    research/reproduce.sh prepares it there): prepared once, under a lock that the pytest-xdist workers of a run
    share, so that no script reads it while another process writes it."""
    with open(tmp_path_factory.getbasetemp().parent / 'repo_corpus.lock', 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return prepare(dataset='default', tokenizer='bytes')


def tiny(data_dir, out_dir, *extra):
    """Arguments for a tiny FM model that trains in about 20 ms a step."""
    return [f'--data_dir={data_dir}', f'--out_dir={out_dir}', '--n_layer=2', '--d_model=32', '--n_memory=8',
            '--top_k=2', '--chunk_size=16', '--block_size=48', '--batch_size=4', '--eval_iters=2',
            '--eval_interval=4', '--log_interval=1', '--warmup_iters=1', '--learning_rate=1e-2', '--min_lr=1e-3',
            *extra]


@pytest.fixture(scope='session')
def trained(data_dir, tmp_path_factory):
    """out_dir of a tiny model trained for 8 steps, and its history."""
    out_dir = str(tmp_path_factory.mktemp('out'))
    history = train.main(tiny(data_dir, out_dir, '--max_iters=8', '--lr_decay_iters=8'))
    return out_dir, history


@pytest.fixture(scope="module")
def default_bytes(tmp_path_factory):
    return prepare(data_dir=tmp_path_factory.mktemp("data"), num_proc=2)


def pytest_collection_modifyitems(items):
    """Every test named *_gpu* (it needs CUDA and is skipped without it) is marked gpu: python test_fm.py -m gpu. The
    slow tests (the longest) go first, a chunk apart: pytest-xdist hands each worker a chunk of consecutive tests
    first, so each starts at once on a worker of its own instead of queueing behind another."""
    for item in items:
        if '_gpu' in getattr(item, 'originalname', item.name):
            item.add_marker(pytest.mark.gpu)
    slow = [item for item in items if item.get_closest_marker('slow')]
    items[:] = [item for item in items if not item.get_closest_marker('slow')]
    chunk = max(2, len(items) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) // 4)  # xdist's first chunks
    for i, item in enumerate(slow):
        items.insert(i * chunk, item)


def reproduce_sh(call, **env):
    """The output of `call` in bash after the definitions of research/reproduce.sh's functions (not its main part)."""
    with open(os.path.join(REPO, 'research', 'reproduce.sh')) as f:
        functions = re.findall(r'^\w+\(\) \{.*?^\}$', f.read(), re.M | re.S)
    run = subprocess.run(['bash', '-c', '\n'.join(['set -euo pipefail', *functions, call])], cwd=REPO,
                         capture_output=True, text=True, env={**os.environ, **env})
    assert run.returncode == 0, run.stderr
    return run.stdout
