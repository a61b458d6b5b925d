"""Text <-> token ids, chat templates and streaming detokenisation.

The encoding itself is done by the `tokenizers` library. This module only builds a
`tokenizers.Tokenizer` from what a model ships (a Hugging Face ``tokenizer.json``, or the
vocabulary stored in a GGUF file's metadata) and adds the pieces an inference engine needs
around it: BOS/EOS handling, chat templates rendered the way Hugging Face renders them, and
incremental decoding for streaming.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from tiergen.errors import TiergenError
from tiergen.paths import cache_dir, written_atomically

if TYPE_CHECKING:  # jinja2 loads with the first chat template (2 MB a process without one)
    import jinja2

logger = logging.getLogger(__name__)

# Special tokens that end a turn or a document. llama.cpp stops generation on any of these that
# a vocabulary has, whatever the metadata names as EOS; so do we.
_END_OF_GENERATION_TOKENS = frozenset({
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|end_of_text|>",
    "<end_of_turn>", "<end_of_utterance>", "<EOT>", "_<EOT>", "<|return|>", "<|call|>",
    "<｜end▁of▁sentence｜>",
})

_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """A model's tokenizer: encoding, decoding and its chat template.

    Build one with `from_hf_dir` or `from_gguf_metadata`. Whether `encode` adds BOS/EOS is
    decided by the backend's post-processor, which those constructors set up.
    `eos_token_ids` starts with the model's own EOS token (the one chat templates see as
    `eos_token`), followed by any other end-of-turn tokens the vocabulary has.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        pad_token_id: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids))
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        self._added = set(backend.get_added_tokens_decoder())  # spelled as they are
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        # token id -> its bytes alone, filled as log-probabilities name tokens (a scoring
        # request names every prompt token and its alternatives)
        self._bytes: dict[int, bytes] = {}

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; special tokens written in the text (e.g. ``<|im_start|>``)
        become their ids. `add_special_tokens` adds BOS/EOS where the model wants them."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int | None) -> str | None:
        """The vocabulary entry for an id, as the backend spells it (e.g. "Ġthe", "▁the")."""
        return None if token_id is None else self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, alone (OpenAI's ``bytes`` of a logprob): a byte-level
        vocabulary's entry read through GPT-2's byte alphabet; a SentencePiece entry with "▁"
        as a space and "<0xNN>" as its byte; an added or special token as its text."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = self._spell(int(token_id))
        return raw

    def _spell(self, token_id: int) -> bytes:
        text = self.backend.id_to_token(token_id)
        if text is None:
            return b""
        if token_id in self._added:
            return text.encode("utf-8")
        if self._byte_level:
            byte_of = _byte_values()
            return b"".join(bytes([byte_of[c]]) if c in byte_of else c.encode("utf-8") for c in text)
        if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            return bytes([int(text[3:5], 16)])
        return text.replace("\u2581", " ").encode("utf-8")

    def token_string(self, token_id: int) -> str:
        """A token's text alone (a byte that is part of a character reads as U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template: str | None = None,
    ) -> str:
        """Render a conversation to prompt text with `template` or the model's own template."""
        source = template if template is not None else self.chat_template
        if source is None:
            raise TiergenError(
                "this model has no chat template; pass one explicitly (a Jinja template string in "
                "the Hugging Face chat-template format, e.g. the 'chat_template' of a "
                "tokenizer_config.json), or send a plain-text prompt instead")
        _check_messages(messages)
        # As in transformers: keys set to None are dropped (templates test for their presence),
        # tools/documents are None, and the special tokens are strings or left undefined.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables: dict[str, Any] = {"tools": None, "documents": None}
        eos_id = self.eos_token_ids[0] if self.eos_token_ids else None
        for name, token_id in (("bos_token", self.bos_token_id), ("eos_token", eos_id)):
            text = self.token_text(token_id)
            if text is not None:
                variables[name] = text
        import jinja2

        try:
            return _compile_template(source).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise TiergenError(f"the chat template failed to render: {e}") from None

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer | None:
        """The tokenizer of a Hugging Face model directory, or None if it has no tokenizer.json."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            return None
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises a bare Exception for any parse error
            raise TiergenError(f"could not read {tokenizer_file}: {e}; the file is corrupt or was "
                               "written by an incompatible tokenizers version") from None
        config = _read_json_object(directory / "tokenizer_config.json")
        if "bos_token" not in config and "eos_token" not in config:
            config = {**_read_json_object(directory / "special_tokens_map.json"), **config}

        def token_id(key: str) -> int | None:
            text = _token_content(config.get(key))
            return None if text is None else backend.token_to_id(text)

        bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
        if "add_bos_token" in config or "add_eos_token" in config:
            _set_bos_eos(backend, bos_id if config.get("add_bos_token") else None,
                         eos_id if config.get("add_eos_token") else None)
        eos_ids = ([eos_id] if eos_id is not None else []) + _end_of_generation_ids(backend)
        return cls(backend, bos_token_id=bos_id, eos_token_ids=eos_ids,
                   pad_token_id=token_id("pad_token"),
                   chat_template=_hf_chat_template(directory, config))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer | None:
        """The tokenizer described by a GGUF file's metadata, or None if it stores none.

        `meta` maps keys to Python scalars, string arrays to ``list[str]`` and numeric arrays to
        numpy arrays (or lists).
        """
        model = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if (model is None and tokens is None) or model in ("none", "no_vocab"):
            return None
        if model is None or tokens is None:
            raise TiergenError("the GGUF tokenizer metadata is incomplete: it needs both "
                               "tokenizer.ggml.model and tokenizer.ggml.tokens")
        # llama.cpp renames empty tokens the same way, so that every token text is unique.
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = meta.get("tokenizer.ggml.token_type")
        types = [int(t) for t in types] if types is not None else [_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise TiergenError("the GGUF tokenizer metadata is inconsistent: "
                               f"{len(tokens)} tokens but {len(types)} token types")

        def optional_id(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            return None if value is None or not 0 <= int(value) < len(tokens) else int(value)

        if model == "gpt2":
            family = _pre_tokenizer_family(meta.get("tokenizer.ggml.pre"))
            backend = _byte_level_bpe(tokens, types, meta.get("tokenizer.ggml.merges"), family)
            add_bos_default = family.add_bos
        elif model == "llama":
            add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
            backend = _sentencepiece_bpe(tokens, types, meta.get("tokenizer.ggml.scores"),
                                         add_space_prefix)
            add_bos_default = True
        else:
            raise TiergenError(f"unsupported GGUF tokenizer model {model!r}: tiergen reads 'gpt2' "
                               "(byte-level BPE) and 'llama' (SentencePiece BPE) vocabularies")

        bos_id, eos_id = optional_id("bos_token_id"), optional_id("eos_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        _set_bos_eos(backend, bos_id if add_bos else None, eos_id if add_eos else None)
        eos_ids = [i for i in (eos_id, optional_id("eot_token_id"), optional_id("eom_token_id"))
                   if i is not None]
        return cls(backend, bos_token_id=bos_id,
                   eos_token_ids=eos_ids + _end_of_generation_ids(backend),
                   pad_token_id=optional_id("padding_token_id"),
                   chat_template=meta.get("tokenizer.chat_template"))


class IncrementalDetokenizer:
    """Turns token ids, fed one at a time, into text deltas for streaming.

    Decoding each token on its own is wrong twice over: a character may be split over several
    byte tokens, and SentencePiece decoders drop the leading space of the first token decoded.
    So each step decodes a short window of trailing tokens twice, without and with the new
    token, and emits only what the new token added; while the text ends in an incomplete
    character (U+FFFD) nothing is emitted. The deltas concatenate to ``decode(ids)`` -- unless
    the ids spell invalid UTF-8 through SentencePiece byte tokens, whose decoder then replaces
    the whole run of bytes, including text already emitted, by U+FFFDs.

    `context_ids` (e.g. the prompt) are decoded as context only, so a continuation keeps its
    leading space; the deltas then add up to ``decode(context + ids)`` minus ``decode(context)``.
    """

    _CONTEXT_TOKENS = 6  # enough for any multi-byte character and for the leading-space rule

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The window: _ids[:_read] was already emitted and is kept as decoding context only.
        self._ids = [int(i) for i in context_ids[-self._CONTEXT_TOKENS:]]
        self._read = len(self._ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        self._ids.append(int(token_id))
        before, after = self._window_texts()
        if len(after) <= len(before) or after.endswith(_REPLACEMENT_CHAR):
            return ""
        self._advance()
        return after[len(before):]

    def finish(self) -> str:
        """Flush text held back (e.g. an incomplete character at the end of the stream)."""
        before, after = self._window_texts()
        self._advance()
        return after[len(before):]

    def _window_texts(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        return (decode(self._ids[:self._read], self._skip_special_tokens),
                decode(self._ids, self._skip_special_tokens))

    def _advance(self) -> None:
        """Everything in the window is emitted; its unread part becomes the next context."""
        del self._ids[:self._read]
        self._read = len(self._ids)


# ---- chat templates -------------------------------------------------------------------------

def _check_messages(messages: object) -> None:
    if not isinstance(messages, list):
        raise TiergenError("messages must be a list of {'role': ..., 'content': ...} dicts, "
                           f"not {type(messages).__name__}")
    if not messages:
        raise TiergenError("messages is empty; give at least one message, "
                           "e.g. [{'role': 'user', 'content': 'Hello'}]")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TiergenError(f"message {i} must be a dict with 'role' and 'content', "
                               f"not {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                got = "nothing" if key not in message else type(message[key]).__name__
                raise TiergenError(f"message {i} needs a string '{key}', got {got}")


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment Hugging Face's `apply_chat_template` uses."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise TiergenError(f"the chat template is not valid Jinja: {e}") from None


# ---- Hugging Face directories -----------------------------------------------------------------

def _read_json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TiergenError(f"could not read {path}: {e}") from None
    if not isinstance(value, dict):
        raise TiergenError(f"{path} should hold a JSON object")
    return value


def _token_content(value: object) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialised AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    # Newer transformers save the template to its own file; it wins over the config entry.
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        template = _read_json_object(directory / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# ---- shared backend helpers ---------------------------------------------------------------------

def _set_bos_eos(backend: BackendTokenizer, bos_id: int | None, eos_id: int | None) -> None:
    """Make `encode(..., add_special_tokens=True)` add the given BOS/EOS ids (None: don't)."""
    single = ["$A"]
    special: dict[str, int] = {}
    if bos_id is not None:
        text = backend.id_to_token(bos_id)
        single.insert(0, text)
        special[text] = bos_id
    if eos_id is not None:
        text = backend.id_to_token(eos_id)
        single.append(text)
        special[text] = eos_id
    backend.post_processor = processors.TemplateProcessing(single=single,
                                                           special_tokens=list(special.items()))


def _end_of_generation_ids(backend: BackendTokenizer) -> list[int]:
    return sorted(i for i, t in backend.get_added_tokens_decoder().items()
                  if t.content in _END_OF_GENERATION_TOKENS)


# ---- GGUF vocabularies -------------------------------------------------------------------------

# tokenizer.ggml.token_type values; 5 (unused) and 6 (byte, "<0xXX>") stay ordinary vocabulary.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4


@dataclass(frozen=True)
class _PreTokenizerFamily:
    """How a byte-level BPE vocabulary cuts text into words before merging.

    `splits` are regexes applied in turn, each keeping both its matches and the text between
    them (llama.cpp's ``regex_exprs``); `gpt2_regex` finishes with the GPT-2 word regex.
    """

    splits: tuple[str, ...] = ()
    gpt2_regex: bool = False
    ignore_merges: bool = False  # a word that is itself a token is not merged from pieces
    add_bos: bool = False


_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CASED_WORDS = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+{s}"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{s}")
_GPT4O_SPLIT = (_CASED_WORDS.replace("{s}", r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?")
                + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (_CASED_WORDS.replace("{s}", "")
                 + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_GPT2 = _PreTokenizerFamily(gpt2_regex=True)
_DIGITS_THEN_GPT2 = _PreTokenizerFamily(splits=(r"\p{N}",), gpt2_regex=True)
_LLAMA3 = _PreTokenizerFamily(splits=(_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_QWEN2 = _PreTokenizerFamily(splits=(_QWEN2_SPLIT,))

# tokenizer.ggml.pre -> family, following llama.cpp's llama-vocab.cpp. Unknown names fall back
# to GPT-2's regex, as transformers does (llama.cpp's own fallback is a rarely right mix).
_PRE_TOKENIZER_FAMILIES: dict[str, _PreTokenizerFamily] = {
    **dict.fromkeys(["default", "gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "trillion",
                     "granite-docling", "exaone4", "mellum", "roberta-bpe"], _GPT2),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b"], _DIGITS_THEN_GPT2),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2"], _LLAMA3),
    **dict.fromkeys(["dbrx", "smaug-bpe"], _PreTokenizerFamily(splits=(_LLAMA3_SPLIT,))),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan"],
                    _QWEN2),
    "qwen35": _PreTokenizerFamily(splits=(_QWEN35_SPLIT,)),
    **dict.fromkeys(["gpt-4o", "llama4", "minimax-m2"],
                    _PreTokenizerFamily(splits=(_GPT4O_SPLIT,))),
    "tekken": _PreTokenizerFamily(splits=(_TEKKEN_SPLIT,), ignore_merges=True, add_bos=True),
}


def _pre_tokenizer_family(name: str | None) -> _PreTokenizerFamily:
    family = _PRE_TOKENIZER_FAMILIES.get(name or "default")
    if family is None:
        logger.warning("unknown GGUF pre-tokenizer %r; splitting text with GPT-2's regex, "
                       "which may tokenize some text differently from the original model", name)
        return _GPT2
    return family


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, in which byte-level vocabularies are spelled."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


@lru_cache(maxsize=1)
def _byte_values() -> dict[str, int]:
    return {c: b for b, c in _byte_alphabet().items()}


def _vocab_dict(tokens: Sequence[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    return vocab


def _add_gguf_special_tokens(backend: BackendTokenizer, tokens: Sequence[str],
                             types: Sequence[int]) -> None:
    """Control and unknown tokens become special (skipped when decoding); user-defined ones
    become plain added tokens. Either way llama.cpp matches them whole in input text."""
    special = [AddedToken(t, normalized=False, special=True)
               for t, k in zip(tokens, types) if k in (_CONTROL, _UNKNOWN)]
    user = [AddedToken(t, normalized=False, special=False)
            for t, k in zip(tokens, types) if k == _USER_DEFINED]
    backend.add_special_tokens(special)
    backend.add_tokens(user)


def _byte_level_bpe(tokens: Sequence[str], types: Sequence[int], merges: Sequence[str] | None,
                    family: _PreTokenizerFamily) -> BackendTokenizer:
    if merges is None:
        raise TiergenError("the GGUF vocabulary is byte-level BPE ('gpt2') but has no "
                           "tokenizer.ggml.merges; the file is incomplete")
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # Normal tokens are spelled in the byte alphabet. A few converters store some in plain
    # text; respell those. Added tokens keep their text: they are matched in raw input.
    tokens = [t if k in (_CONTROL, _USER_DEFINED, _UNKNOWN) or set(t) <= spelled
              else "".join(alphabet[b] for b in t.encode("utf-8"))
              for t, k in zip(tokens, types)]
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)  # the left part may itself be a space-like character
        pairs.append((merge[:cut], merge[cut + 1:]))
    backend = BackendTokenizer(models.BPE(_vocab_dict(tokens), pairs,
                                          ignore_merges=family.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in family.splits]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=family.gpt2_regex)])
    backend.decoder = decoders.ByteLevel()
    _add_gguf_special_tokens(backend, tokens, types)
    return backend


def _sentencepiece_merges(tokens: Sequence[str], types: Sequence[int],
                          scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's rule "merge the pair whose union scores best".

    Every normal token that splits into two normal tokens yields a merge, ranked by the score of
    the merged token (ties: longer left part first, as transformers orders them). Finding them
    takes seconds in Python for a vocabulary of 262k (Gemma 3), so they are kept in the cache
    directory under a hash of the vocabulary, as token ids, for the next load.
    """
    key = hashlib.sha256(b"sentencepiece-merges 1\0")
    key.update("\0".join(tokens).encode("utf-8", "surrogatepass"))
    key.update(np.asarray(types, dtype=np.int32).tobytes())
    key.update(np.asarray(scores, dtype=np.float32).tobytes())
    path = cache_dir() / "tokenizers" / f"merges-{key.hexdigest()[:32]}.npy"
    try:
        ids = np.load(path)
        if ids.ndim == 2 and ids.shape[1] == 2:
            return list(zip(map(tokens.__getitem__, ids[:, 0].tolist()),
                            map(tokens.__getitem__, ids[:, 1].tolist())))
    except (OSError, ValueError, IndexError):
        pass  # not there yet (or unreadable): found below, and kept
    normal = {t: i for t, i in _vocab_dict(tokens).items() if types[i] == _NORMAL}
    ranked = []
    for token, index in normal.items():
        pieces = sorted(((token[:cut], token[cut:]) for cut in range(1, len(token))
                         if token[:cut] in normal and token[cut:] in normal),
                        key=lambda p: (normal[p[0]], normal[p[1]]))
        ranked.extend((-float(scores[index]), -len(left), -len(right), left, right)
                      for left, right in pieces)
    ranked.sort(key=lambda r: r[:3])
    merges = [(left, right) for *_, left, right in ranked]
    try:
        with written_atomically(path, "the tokenizer's merges") as out:
            np.save(out, np.array([(normal[a], normal[b]) for a, b in merges],
                                  dtype=np.int32).reshape(-1, 2))
    except TiergenError as e:  # a cache that cannot be written costs the next load time only
        logger.debug("%s", e)
    return merges


def _sentencepiece_bpe(tokens: Sequence[str], types: Sequence[int],
                       scores: Sequence[float] | None, add_space_prefix: bool) -> BackendTokenizer:
    if scores is None or len(scores) != len(tokens):
        raise TiergenError("the GGUF vocabulary is SentencePiece ('llama') but its "
                           "tokenizer.ggml.scores are missing or do not match its tokens")
    unknown = next((t for t, k in zip(tokens, types) if k == _UNKNOWN), None)
    backend = BackendTokenizer(models.BPE(
        _vocab_dict(tokens), _sentencepiece_merges(tokens, types, scores),
        unk_token=unknown, fuse_unk=True, byte_fallback=True))
    # Spaces become "▁"; "first" adds one in front of the text but not after special tokens,
    # as Hugging Face's (non-legacy) Llama tokenizer does.
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    _add_gguf_special_tokens(backend, tokens, types)
    return backend
