"""Batched decoding, a step one CUDA-graph replay on a GPU; sample.py is its command line.
    generator = Generator(model, Sampling(temperature=0.8, top_p=0.95), eot=tokenizer.eot)
    new_tokens = generator.generate([prompt_ids_1, prompt_ids_2], max_new_tokens=200)
"""
import math
from dataclasses import dataclass, replace

import torch

from configurator import ConfigError
from model import write_state


@dataclass
class Sampling:
    """How the next token is drawn; ConfigError if a field is out of range."""
    temperature: float = 1.0  # 0: greedy
    top_k: int | None = None  # only the k most likely tokens
    top_p: float = 1.0  # nucleus: the fewest likeliest tokens reaching top_p
    n_tokens: int | None = None  # only ids below this (the tokenizer's size, of a padded vocab)

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ConfigError(f'temperature={self.temperature!r}: must be >= 0 (0: greedy)')
        if self.top_k is not None and not self.top_k >= 1:
            raise ConfigError(f'top_k={self.top_k!r}: must be >= 1 (None: every token)')
        if not 0 < self.top_p <= 1:
            raise ConfigError(f'top_p={self.top_p!r}: must be in (0, 1] (1: every token)')


def nucleus(logits, top_p):
    """logits (B, V), -inf but for the fewest most likely tokens reaching probability top_p."""
    ranked, order = logits.sort(-1, descending=True)
    probs = torch.softmax(ranked, -1)
    dropped = probs.cumsum(-1) - probs >= top_p  # the mass before it reaches top_p
    return logits.scatter(-1, order, ranked.masked_fill(dropped, -math.inf))


def sample_next(logits, sampling):
    """logits (B, V) -> ids (B,), by torch's default generator; no host sync (a CUDA graph)."""
    logits = logits[:, :sampling.n_tokens]
    if sampling.temperature == 0:
        return logits.argmax(-1)
    logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if sampling.top_p < 1:
        logits = nucleus(logits, sampling.top_p)
    probs = torch.softmax(logits, dim=-1)
    race = torch.empty_like(probs).exponential_().clamp_(min=torch.finfo(probs.dtype).tiny)
    return (probs / race).argmax(-1)  # argmax p_i / E_i, E_i ~ Exp(1), is i with probability p_i


# coordinate descent (gpt-fast's): batch 1's products as reductions tuned for the GPU,
# not cuBLAS GEMVs whose 64-row tiles idle most SMs (docs/kernel_log.md)
STEP_COMPILE_OPTIONS = {'coordinate_descent_tuning': True}


class Generator:
    """Prompts prefilled in parallel, then each step updates static buffers in place."""

    def __init__(self, model, sampling=Sampling(), eot=None, cuda_graph=None, compile=None,
                 prefill_tokens=16384):
        """compile: None, or a torch.compile mode of the step (STEP_COMPILE_OPTIONS), prefill."""
        self.model, self.eot = model, eot
        self.sampling = replace(sampling)  # a copy, checked again
        self.device = model.embed.weight.device
        self.cuda_graph = cuda_graph
        if cuda_graph is None:
            self.cuda_graph = self.device.type == 'cuda'
        self.compiled_step, self.hidden = self._step, model.hidden
        if compile is not None:  # inductor's import takes seconds
            import torch._inductor
            options = {**torch._inductor.list_mode_options(compile), **STEP_COMPILE_OPTIONS}
            self.compiled_step = torch.compile(self._step, options=options)
            self.hidden = torch.compile(model.hidden, mode=compile)
        # tokens a prefill pass, at least a prompt's (bounds memory)
        self.prefill_tokens = prefill_tokens
        self.shape = None

    def _allocate(self, batch_size, max_len):
        """Static buffers (state, next tokens, finished rows) of batch_size x max_len; the graph."""
        self.shape, self.replay = (batch_size, max_len), self.compiled_step
        self.state = self.model.init_state(batch_size, max_len, self.device)
        self.tokens = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.done = torch.zeros(batch_size, dtype=torch.bool, device=self.device)
        if self.cuda_graph:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            seeded = torch.random.fork_rng(devices=[self.device])  # the RNG kept
            with seeded, torch.cuda.stream(stream):
                for _ in range(2):  # warm-up, outside the capture
                    self.compiled_step()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.compiled_step()
            self.replay = graph.replay

    def _step(self):
        logits = self.model.step(self.tokens, self.state)  # (B, V)
        self.tokens.copy_(sample_next(logits, self.sampling))
        if self.eot is not None:
            self.done |= self.tokens == self.eot

    @torch.no_grad()
    def start(self, prompts, max_new_tokens):
        """Prefill prompts (lists of ids), room for max_new_tokens -> each first new token (B,)."""
        lengths = [len(p) for p in prompts]
        if min(lengths) < 1 or max_new_tokens < 1:
            raise ValueError('give every prompt a token or more, and max_new_tokens of 1 or more')
        vocab = self.model.config.vocab_size
        beyond = [t for p in prompts for t in p if not 0 <= t < vocab]
        if beyond:
            raise ValueError(f'prompt token {beyond[0]} is not an id of the model (0 to '
                             f"{vocab - 1}): encode the prompts with the model's tokenizer")
        shape = (len(prompts), max(lengths) + max_new_tokens)
        if shape != self.shape:
            self._allocate(*shape)
        rows_per_pass = max(1, self.prefill_tokens // max(lengths))
        for first in range(0, len(prompts), rows_per_pass):
            rows = slice(first, first + rows_per_pass)
            last, states = self._prefill(prompts[rows])
            write_state(self.state, states, rows)
            self.tokens[rows] = sample_next(self.model.logits(last), self.sampling)
        self.done.zero_()
        if self.eot is not None:
            self.done |= self.tokens == self.eot
        return self.tokens

    def _prefill(self, prompts):
        """Passes over right-padded prompts -> the hidden state at each end (B, d_model), states."""
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)  # (B,)
        width = int(lengths.max())
        padded = [p + [0] * (width - len(p)) for p in prompts]
        idx = torch.tensor(padded, device=self.device)  # (B, width)
        piece = self.prefill_tokens
        if self.model.config.family == 'attn':  # no parallel pass from a state
            piece = width
        states = None
        for start in range(0, width, piece):
            pieces = (lengths - start).clamp(max=piece)
            x, states = self.hidden(idx[:, start:start + piece], states, pieces)
        rows = torch.arange(len(prompts), device=self.device)
        return x[rows, lengths - 1 - start], states  # in the last piece

    @torch.no_grad()
    def step(self):
        """A token a row -> the next tokens (B,); at most max_new_tokens - 1 steps after a start."""
        self.replay()  # the CUDA graph or the step
        return self.tokens

    def generate(self, prompts, max_new_tokens, on_tokens=None, on_progress=None):
        """Up to max_new_tokens new tokens a prompt, cut at its end-of-text;
        on_tokens(B ids) each step, on_progress(n tokens so far) every 16."""
        if max_new_tokens < 1:
            return [[] for _ in prompts]
        shape = (len(prompts), max_new_tokens)
        out = torch.empty(shape, dtype=torch.long, device=self.device)
        out[:, 0] = self.start(prompts, max_new_tokens)
        for n in range(1, max_new_tokens + 1):
            if on_tokens is not None:
                on_tokens(out[:, n - 1].tolist())
            if on_progress is not None and n % 16 == 0:
                on_progress(n)
            if n == max_new_tokens:
                break
            if self.eot is not None and n % 16 == 0 and self.done.all():  # a sync every 16
                break
            out[:, n] = self.step()
        rows = out[:, :n].tolist()
        for i, row in enumerate(rows):
            if self.eot in row:
                rows[i] = row[:row.index(self.eot)]
        return rows
