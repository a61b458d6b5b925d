"""``tiergen perplexity``: the perplexity of a text, and the KL divergence of a run's next-token
distributions from a saved run's, measured as llama.cpp's ``llama-perplexity`` measures them.

The text is tokenised once and cut into consecutive windows of ``ctx`` tokens (a tail shorter
than a window is left out). Each window runs on its own from an empty cache, and only the
positions of its second half are scored: the logits after tokens ``ctx // 2`` to ``ctx - 2``
predict tokens ``ctx // 2 + 1`` to ``ctx - 1``, so each has at least half a window before it.
When the tokenizer starts a text with its BOS token, each window starts with BOS in place of
its first token, as llama.cpp does.

A run saved with ``--save-logits`` is a safetensors file: ``tokens`` (int64, the tokens of the
windows, BOS replacement not applied) and ``logprobs`` (float32, one row of log-probabilities
over the vocabulary per scored position, windows one after another), with the window size and
the model in its metadata.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from tiergen.errors import TiergenError

FORMAT = "tiergen-perplexity"
VERSION = "1"


def first_scored(ctx: int) -> int:
    """Index in a window of the first logits that are scored (they predict the next token)."""
    return ctx // 2


def scored_per_window(ctx: int) -> int:
    return ctx - 1 - first_scored(ctx)


def num_windows(n_tokens: int, ctx: int, chunks: int | None = None) -> int:
    """Windows of ``ctx`` tokens in ``n_tokens``, at most ``chunks`` of them."""
    if ctx < 3:
        raise TiergenError(f"--ctx must be at least 3 tokens (half a window of context and at "
                           f"least one scored token), got {ctx}")
    if chunks is not None and chunks < 1:
        raise TiergenError(f"--chunks must be a positive integer, got {chunks}")
    n = n_tokens // ctx
    if n == 0:
        raise TiergenError(f"the text has {n_tokens} tokens, fewer than one window of --ctx "
                           f"{ctx}; give a longer text or a smaller --ctx")
    return n if chunks is None else min(n, chunks)


def _check_ctx(llm, ctx: int) -> None:
    if ctx > llm.config.context_length:
        raise TiergenError(f"--ctx {ctx} is more than the model's context of "
                           f"{llm.config.context_length} tokens; pass a smaller --ctx")


def window_logprobs(llm, ids: list[int], ctx: int = 512, chunks: int | None = None,
                    progress: bool = False, bos: int | None = None
                    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """For each window: the scored target tokens (int64, ``scored_per_window(ctx)``) and the
    float32 log-probabilities that predict them (scored positions x vocabulary). ``bos``
    replaces each window's first token, as llama.cpp does when the tokenizer adds one."""
    _check_ctx(llm, ctx)
    n = num_windows(len(ids), ctx, chunks)
    first = first_scored(ctx)
    bar = tqdm(total=n, unit="window", disable=not progress, dynamic_ncols=True)
    started, nll, count = time.perf_counter(), 0.0, 0
    with bar:
        for w in range(n):
            window = list(ids[w * ctx:(w + 1) * ctx])
            if bos is not None:
                window[0] = bos
            logits = llm.logits(window)[first:ctx - 1]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            del logits
            targets = torch.tensor(ids[w * ctx + first + 1:(w + 1) * ctx], dtype=torch.int64)
            nll -= logprobs.gather(1, targets[:, None]).double().sum().item()
            count += len(targets)
            bar.set_postfix_str(f"{(w + 1) * ctx / (time.perf_counter() - started):.1f} tok/s, "
                                f"ppl {math.exp(nll / count):.4f}", refresh=False)
            bar.update(1)
            yield targets, logprobs


# -- statistics -------------------------------------------------------------------------------

@dataclass
class Perplexity:
    """exp(mean negative log-likelihood), and its uncertainty as llama.cpp gives it:
    ``ppl * sqrt(var(nll) / (n - 1))``."""

    value: float
    error: float
    positions: int

    @classmethod
    def of(cls, nll: torch.Tensor) -> Perplexity:
        nll = nll.double()
        n = nll.numel()
        mean = nll.mean().item()
        ppl = math.exp(mean)
        var = (nll.square().mean() - mean * mean).item()
        error = ppl * math.sqrt(var / (n - 1)) if n > 1 and var > 0 else 0.0
        return cls(ppl, error, n)

    def __str__(self) -> str:
        return f"{self.value:.4f} +/- {self.error:.4f}"


def token_nll(logprobs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood (float64) of each target under its row of log-probabilities."""
    return -logprobs.gather(1, targets[:, None].long())[:, 0].double()


def position_kl(ref_logprobs: torch.Tensor, logprobs: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(ref || this) of each position in nats (float64), and whether the likeliest tokens
    agree, from rows of log-probabilities."""
    kl, same = [], []
    for start in range(0, len(ref_logprobs), 64):  # rows at a time: vocabularies are large
        ref = ref_logprobs[start:start + 64].float()
        lp = logprobs[start:start + 64].float()
        p = ref.exp()
        terms = torch.where(p > 0, p * (ref - lp), torch.zeros_like(p))
        kl.append(terms.sum(-1, dtype=torch.float64).clamp_min(0.0))
        same.append(ref.argmax(-1) == lp.argmax(-1))
    if not kl:
        return torch.empty(0, dtype=torch.float64), torch.empty(0, dtype=torch.bool)
    return torch.cat(kl), torch.cat(same)


@dataclass
class KLStats:
    """KL(ref || this) per position (nats): mean, 99th percentile, maximum, median; the
    fraction of positions where the likeliest tokens agree."""

    mean: float
    p99: float
    max: float
    median: float
    same_top: float
    positions: int

    @classmethod
    def of(cls, kl: torch.Tensor, same_top: torch.Tensor) -> KLStats:
        values = kl.double().numpy()
        return cls(float(values.mean()), float(np.percentile(values, 99)), float(values.max()),
                   float(np.median(values)), float(same_top.double().mean()), len(values))


def kl_stats(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> KLStats:
    """KL statistics of two runs' log-probabilities (positions x vocabulary each)."""
    if ref_logprobs.shape != logprobs.shape:
        raise TiergenError(f"log-probabilities of shape {tuple(ref_logprobs.shape)} and "
                           f"{tuple(logprobs.shape)} cannot be compared")
    return KLStats.of(*position_kl(ref_logprobs, logprobs))


# -- saved runs -------------------------------------------------------------------------------

class LogitsWriter:
    """Writes a saved run as safetensors, window by window: to ``FILE.tmp`` first, renamed to
    FILE when complete, removed on any error or interrupt."""

    def __init__(self, path: str | Path, tokens: list[int], ctx: int, windows: int, vocab: int,
                 model: str, bos: int | None):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        rows = windows * scored_per_window(ctx)
        n_tok = 8 * len(tokens)
        header = {
            "__metadata__": {"format": FORMAT, "version": VERSION, "ctx": str(ctx),
                             "windows": str(windows), "vocab": str(vocab), "model": model,
                             "bos": "" if bos is None else str(bos)},
            "tokens": {"dtype": "I64", "shape": [len(tokens)], "data_offsets": [0, n_tok]},
            "logprobs": {"dtype": "F32", "shape": [rows, vocab],
                         "data_offsets": [n_tok, n_tok + 4 * rows * vocab]},
        }
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        self.expected = 4 * rows * vocab
        self.written = 0
        try:
            self.file = open(self.tmp, "wb")
        except OSError as e:
            raise TiergenError(f"cannot write {self.tmp}: {e.strerror or e}") from None
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.file.write(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())

    def write(self, logprobs: torch.Tensor) -> None:
        data = logprobs.float().contiguous().numpy()
        self.file.write(data.tobytes())
        self.written += data.nbytes

    def close(self, ok: bool) -> None:
        self.file.close()
        if ok and self.written == self.expected:
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)


class SavedRun:
    """A run saved with --save-logits, read window by window (memory-mapped)."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        try:
            self._file = safe_open(str(path), framework="pt")
            meta = self._file.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError("not a file written by tiergen perplexity --save-logits")
            if meta.get("version") != VERSION:
                raise ValueError(f"format version {meta.get('version')}, this tiergen reads "
                                 f"version {VERSION}")
            self.ctx, self.windows = int(meta["ctx"]), int(meta["windows"])
            self.vocab, self.model = int(meta["vocab"]), meta.get("model", "?")
            self.bos = int(meta["bos"]) if meta.get("bos") else None
            self.tokens = self._file.get_tensor("tokens").tolist()
            self._logprobs = self._file.get_slice("logprobs")
        except FileNotFoundError:
            raise TiergenError(f"{path}: no such file (write one with --save-logits)") from None
        except Exception as e:  # safetensors raises its own errors for broken files
            raise TiergenError(f"cannot read {path} as a saved perplexity run: {e}") from None

    def window(self, w: int) -> torch.Tensor:
        n = scored_per_window(self.ctx)
        return self._logprobs[w * n:(w + 1) * n]

    def check(self, tokens: list[int], ctx: int, chunks: int | None, vocab: int) -> int:
        """The number of windows to compare, or an error that says what differs and how to
        run alike."""
        where = f"{self.path} (saved from {self.model})"
        if ctx != self.ctx:
            raise TiergenError(f"{where} was made with --ctx {self.ctx}, this run has --ctx "
                               f"{ctx}; pass --ctx {self.ctx}")
        if chunks is not None and chunks > self.windows:
            raise TiergenError(f"{where} holds {self.windows} windows, --chunks asks for "
                               f"{chunks}; pass --chunks {self.windows} or less")
        if vocab != self.vocab:
            raise TiergenError(f"{where} has log-probabilities over {self.vocab} tokens, this "
                               f"model has {vocab}; compare models with the same tokenizer")
        windows = self.windows if chunks is None else chunks
        ours = tokens[:windows * ctx]
        theirs = self.tokens[:windows * ctx]
        if ours != theirs:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                      min(len(ours), len(theirs)))
            detail = (f"this text has {len(tokens)} tokens, the saved run {len(self.tokens)}"
                      if at >= min(len(ours), len(theirs)) else
                      f"token {at} is {theirs[at]} there and {ours[at]} here")
            raise TiergenError(f"{where} was made on other tokens than this run ({detail}); "
                               f"run on the same text file with a model that has the same "
                               f"tokenizer")
        return windows


# -- a run --------------------------------------------------------------------------------------

@dataclass
class Result:
    perplexity: Perplexity
    windows: int
    ctx: int
    reference: Perplexity | None = None  # the saved run's, on the same positions
    kl: KLStats | None = None


def tokenize(llm, text: str) -> tuple[list[int], int | None]:
    """The text's tokens, and the BOS id each window starts with (None when the tokenizer
    adds none)."""
    if llm.tokenizer is None:
        raise TiergenError(f"model {llm.name} has no tokenizer, so it cannot read a text")
    ids = llm.tokenizer.encode(text)
    bos = llm.tokenizer.bos_token_id
    return ids, bos if bos is not None and ids and ids[0] == bos else None


def evaluate(llm, ids: list[int], ctx: int = 512, chunks: int | None = None,
             progress: bool = False, bos: int | None = None, save: str | Path | None = None,
             reference: SavedRun | str | Path | None = None) -> Result:
    """Perplexity of ``ids`` in windows of ``ctx``; with ``save``, the run is written there;
    with ``reference`` (a saved run), KL statistics against it."""
    if reference is not None and not isinstance(reference, SavedRun):
        reference = SavedRun(reference)
    _check_ctx(llm, ctx)
    vocab = llm.config.vocab_size
    if reference is not None:
        chunks = reference.check(ids, ctx, chunks, vocab)
    windows = num_windows(len(ids), ctx, chunks)
    writer = None if save is None else LogitsWriter(
        save, ids[:windows * ctx], ctx, windows, vocab, llm.name, bos)
    nll, ref_nll, kls, same = [], [], [], []
    ok = False
    try:
        for w, (targets, logprobs) in enumerate(
                window_logprobs(llm, ids, ctx, windows, progress, bos)):
            if logprobs.shape[1] != vocab:
                raise TiergenError(f"the model gives {logprobs.shape[1]} logits per token, its "
                                   f"config says a vocabulary of {vocab}")
            nll.append(token_nll(logprobs, targets))
            if writer is not None:
                writer.write(logprobs)
            if reference is not None:
                ref = reference.window(w)
                ref_nll.append(token_nll(ref, targets))
                k, s = position_kl(ref, logprobs)
                kls.append(k)
                same.append(s)
        ok = True
    finally:
        if writer is not None:
            writer.close(ok)
    result = Result(Perplexity.of(torch.cat(nll)), windows, ctx)
    if reference is not None:
        result.reference = Perplexity.of(torch.cat(ref_nll))
        result.kl = KLStats.of(torch.cat(kls), torch.cat(same))
    return result


def report(result: Result, reference: str | None = None) -> str:
    lines = [f"perplexity: {result.perplexity}  ({result.perplexity.positions} tokens scored "
             f"in {result.windows} windows of {result.ctx})"]
    if result.kl is not None:
        k = result.kl
        lines += [f"saved run's perplexity: {result.reference}  ({reference})",
                  f"mean KLD: {k.mean:.6f}",
                  f"median KLD: {k.median:.6f}",
                  f"p99 KLD: {k.p99:.6f}",
                  f"max KLD: {k.max:.6f}",
                  f"same top token: {100 * k.same_top:.2f} %"]
    return "\n".join(lines)
