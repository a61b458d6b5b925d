import tiergen  # noqa: F401  (first: sets the CPU safety guard before torch runs a kernel)

import json
import random
import re
import shutil
from pathlib import Path

import gguf
import pytest

from tiergen.errors import TiergenError
from tiergen.tokenizer import IncrementalDetokenizer, Tokenizer
from tiergen.weights import _packaged_file
from tiergen.weights.gguf import GGUFFile

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # sum\n",
    "for (int i = 0; i < n; ++i) { x[i] *= 2; }",
    "12345 and 3.14159, 1,000,000 or 2024-01-31",
    "Café déjà vu, naïve résumé, Straße",
    "emoji 😀👍🏽 and family 👨‍👩‍👧",
    "中文测试：你好，世界。日本語のテキスト、한국어",
    "multiple    spaces   here",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\nthree\r\nfour\ttab",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll say it's fine, we've DONE it.",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Say hi in 中文 😀"}],
    [{"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke."}],
]


# ---- fixtures ----------------------------------------------------------------------------------

def _gguf_meta(path: Path) -> dict:
    with GGUFFile(path) as f:
        return dict(f.metadata)


def _tokenizer(meta: dict) -> Tokenizer:
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok is not None
    return tok


def _hf_tokenizer(path: Path):
    """transformers' own conversion of a GGUF tokenizer (slow: load once)."""
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def smollm_gguf() -> Path:
    try:
        return _packaged_file("smollm2")
    except TiergenError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smollm_meta(smollm_gguf: Path) -> dict:
    return _gguf_meta(smollm_gguf)


@pytest.fixture(scope="module")
def smollm(smollm_meta: dict) -> Tokenizer:
    return _tokenizer(smollm_meta)


@pytest.fixture(scope="module")
def smollm_hf(smollm_gguf: Path):
    return _hf_tokenizer(smollm_gguf)


def _spm_vocabulary() -> tuple[list[str], list[int], list[float]]:
    """A small SentencePiece-style vocabulary: specials, 256 byte tokens, scored pieces."""
    words = ["▁the", "▁hello", "▁world", "▁quick", "▁fox", "▁café", "▁déjà", "▁vu", "ing",
             "▁thing", "▁in", "er", "he", "▁t", "▁a", "▁is", "▁test", "▁tokens"]
    pieces: list[str] = []
    for word in words:  # every prefix, so each piece is a merge of two others
        pieces += [word[:n] for n in range(2, len(word) + 1) if word[:n] not in pieces]
    chars = sorted({c for w in words for c in w} | set("abcdefghijklmnopqrstuvwxyz.,!?'\n"))
    tokens = (["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
              + ["<|end|>", "<tool>"])
    types = [2, 3, 3] + [6] * 256 + [3, 4]
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    for rank, char in enumerate(c for c in chars if c not in tokens):
        tokens.append(char)
        types.append(1)
        scores.append(-1000.0 - rank)
    return tokens, types, scores


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokens, types, scores = _spm_vocabulary()
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def spm_meta(spm_gguf: Path) -> dict:
    return _gguf_meta(spm_gguf)


@pytest.fixture(scope="module")
def spm(spm_meta: dict) -> Tokenizer:
    return _tokenizer(spm_meta)


@pytest.fixture(scope="module")
def spm_hf(spm_gguf: Path):
    return _hf_tokenizer(spm_gguf)


# ---- GGUF byte-level BPE (SmolLM2) ------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_smollm_encode_matches_transformers(smollm: Tokenizer, smollm_hf, text: str) -> None:
    assert smollm.encode(text) == smollm_hf(text).input_ids
    assert smollm.encode(text, add_special_tokens=False) == smollm_hf(
        text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("text", TEXTS)
def test_smollm_decode(smollm: Tokenizer, smollm_hf, text: str) -> None:
    ids = smollm.encode(text)
    assert smollm.decode(ids) == smollm_hf.decode(ids, skip_special_tokens=True)
    assert smollm.decode(ids, skip_special_tokens=False) == smollm_hf.decode(ids)
    if "<|" not in text:
        assert smollm.decode(ids) == text


def test_smollm_splits_digits_like_llama_cpp(smollm: Tokenizer) -> None:
    # pre "smollm" cuts digits apart before the GPT-2 regex (llama.cpp, and SmolLM's own
    # tokenizer.json). transformers' GGUF conversion skips that step and cuts "x  12" as
    # "x", " ", " 12", so here it would give ["x", "Ġ", "Ġ", "1", "2"].
    ids = smollm.encode("x  12")
    assert [smollm.backend.id_to_token(i) for i in ids] == ["x", "ĠĠ", "1", "2"]
    # Known ids of SmolLM2's tokenizer.
    assert smollm.encode("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]


@pytest.mark.parametrize(("pre", "pieces"), [
    ("gpt-2", ["x", "Ġ12345", "'ll", "ĠHi"]),
    ("smollm", ["x", "Ġ", "1", "2", "3", "4", "5", "'ll", "ĠHi"]),
    ("llama-bpe", ["x", "Ġ", "123", "45", "'ll", "ĠHi"]),
    ("qwen2", ["x", "Ġ", "1", "2", "3", "4", "5", "'ll", "ĠHi"]),
    ("qwen35", ["x", "Ġ", "1", "2", "3", "4", "5", "'ll", "ĠHi"]),
    ("gpt-4o", ["x", "Ġ", "123", "45", "'ll", "ĠHi"]),
    ("tekken", ["x", "Ġ", "1", "2", "3", "4", "5", "'ll", "ĠHi"]),
    ("no-such-pre", ["x", "Ġ12345", "'ll", "ĠHi"]),  # falls back to GPT-2's regex
])
def test_pre_tokenizer_families(smollm_meta: dict, pre: str, pieces: list[str]) -> None:
    tok = Tokenizer.from_gguf_metadata({**smollm_meta, "tokenizer.ggml.pre": pre})
    assert tok is not None
    text = "x 12345'll Hi"
    assert [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)] == pieces
    assert tok.decode(tok.encode(text)) == text


def test_smollm_special_ids(smollm: Tokenizer) -> None:
    assert smollm.vocab_size == 49152
    assert smollm.bos_token_id == 1
    assert smollm.eos_token_ids[0] == 2  # <|im_end|>, from the metadata
    assert set(smollm.eos_token_ids) == {0, 2}  # and <|endoftext|>, an end-of-text token
    assert smollm.pad_token_id == 2
    assert smollm.encode("hi")[0] != smollm.bos_token_id  # add_bos_token is false


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm_chat_template_matches_transformers(smollm: Tokenizer, smollm_hf,
                                                   messages: list[dict]) -> None:
    for add_generation_prompt in (True, False):
        expected = smollm_hf.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        assert smollm.apply_chat_template(messages, add_generation_prompt) == expected
    rendered = smollm.apply_chat_template(messages)
    assert smollm.encode(rendered, add_special_tokens=False) == smollm_hf(
        rendered, add_special_tokens=False).input_ids


def test_custom_template_features_match_transformers(spm: Tokenizer, spm_hf) -> None:
    template = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}\n"
        "  {{ m['role'] }}: {{ m | tojson }}\n"
        "{% endfor %}{{ ns.n }}{{ eos_token }}"
        "{% if add_generation_prompt %}[gen {{ strftime_now('%Y') }}]{% endif %}"
    )
    messages = [{"role": "user", "content": "<b>\"quoted\" & ünïcode 😀</b>"},
                {"role": "skip", "content": "x"}, {"role": "assistant", "content": "ok"}]
    expected = spm_hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                          add_generation_prompt=True)
    assert spm.apply_chat_template(messages, template=template) == expected
    assert expected.startswith("<s>") and "</s>[gen " in expected


# ---- GGUF SentencePiece BPE -----------------------------------------------------------------

SPM_TEXTS = [
    "the quick fox",
    "hello world, the thing is a test!",
    "Hello World",  # upper case: not in the vocabulary, bytes fallback
    "café déjà vu",
    "emoji 😀 and 中文 and ☃",
    "hello  world",
    "  leading spaces",
    "line\nbreaks\n\nand\ttabs",
    "<|end|> after a control token<tool>user-defined",
    "<s>literal bos",
    "",
]


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_spm_encode_decode_match_transformers(spm: Tokenizer, spm_hf, text: str) -> None:
    ids = spm.encode(text)
    assert ids == spm_hf(text).input_ids
    assert ids[0] == spm.bos_token_id == 1  # SentencePiece vocabularies add BOS by default
    assert spm.encode(text, add_special_tokens=False) == ids[1:]
    assert spm.decode(ids) == spm_hf.decode(ids, skip_special_tokens=True)
    assert spm.decode(ids, skip_special_tokens=False) == spm_hf.decode(ids)


def test_spm_byte_fallback(spm: Tokenizer) -> None:
    ids = spm.encode("😀", add_special_tokens=False)
    pieces = [spm.backend.id_to_token(i) for i in ids]
    assert pieces == ["▁", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert spm.decode(ids) == "😀"


def test_spm_flags_and_ids(spm: Tokenizer, spm_meta: dict) -> None:
    assert spm.vocab_size == len(spm_meta["tokenizer.ggml.tokens"])
    assert spm.eos_token_ids == [2, 259]  # </s>, then <|end|>
    assert spm.chat_template is None
    no_bos = Tokenizer.from_gguf_metadata({**spm_meta, "tokenizer.ggml.add_bos_token": False,
                                           "tokenizer.ggml.add_eos_token": True})
    assert no_bos is not None
    assert no_bos.encode("the fox") == [*spm.encode("the fox")[1:], 2]


def test_spm_merges_are_kept_for_the_next_load(spm_meta: dict, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """SentencePiece merges, found once, are read back from the cache directory at the next
    load (the same tokens); a damaged file there is found again and replaced."""
    import numpy as np

    monkeypatch.setenv("TIERGEN_CACHE", str(tmp_path))
    want = [_tokenizer(spm_meta).encode(t) for t in SPM_TEXTS]
    [kept] = (tmp_path / "tokenizers").glob("merges-*.npy")
    merges = np.load(kept)
    assert len(merges) > 0
    assert [_tokenizer(spm_meta).encode(t) for t in SPM_TEXTS] == want
    np.save(kept, merges[:0])  # no merges at all: a load that reads the file shows it
    assert [_tokenizer(spm_meta).encode(t) for t in SPM_TEXTS] != want
    kept.write_bytes(b"not an array")
    assert [_tokenizer(spm_meta).encode(t) for t in SPM_TEXTS] == want
    assert np.array_equal(np.load(kept), merges)
    assert [p.name for p in kept.parent.iterdir()] == [kept.name]  # nothing half-written


def test_gguf_metadata_without_tokenizer() -> None:
    assert Tokenizer.from_gguf_metadata({"general.architecture": "llama"}) is None


def test_gguf_metadata_errors(spm_meta: dict) -> None:
    with pytest.raises(TiergenError, match="unsupported GGUF tokenizer model 'bert'"):
        Tokenizer.from_gguf_metadata({**spm_meta, "tokenizer.ggml.model": "bert"})
    with pytest.raises(TiergenError, match="incomplete"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(TiergenError, match=r"no tokenizer\.ggml\.merges"):
        Tokenizer.from_gguf_metadata({**spm_meta, "tokenizer.ggml.model": "gpt2"})


# ---- Hugging Face directories ---------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm_hf_dir(smollm_hf, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("smollm_hf")
    smollm_hf.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("text", [*TEXTS, "x  12"])
def test_hf_dir_matches_transformers(smollm_hf_dir: Path, smollm_hf, text: str) -> None:
    tok = Tokenizer.from_hf_dir(smollm_hf_dir)
    assert tok is not None
    ids = tok.encode(text)
    assert ids == smollm_hf(text).input_ids
    assert tok.decode(ids) == smollm_hf.decode(ids, skip_special_tokens=True)


def test_hf_dir_chat_template_and_special_ids(smollm_hf_dir: Path, smollm_hf,
                                              smollm: Tokenizer) -> None:
    tok = Tokenizer.from_hf_dir(smollm_hf_dir)
    assert tok is not None
    assert (tok.bos_token_id, tok.eos_token_ids[0], tok.pad_token_id) == (1, 2, 2)
    assert set(tok.eos_token_ids) == {0, 2}
    assert tok.chat_template == smollm.chat_template
    for messages in CONVERSATIONS:
        assert tok.apply_chat_template(messages) == smollm_hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)


def test_hf_dir_spm_adds_bos_like_transformers(spm_hf, tmp_path: Path) -> None:
    spm_hf.save_pretrained(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok is not None
    for text in SPM_TEXTS:
        assert tok.encode(text) == spm_hf(text).input_ids
        assert tok.decode(tok.encode(text)) == spm_hf.decode(spm_hf(text).input_ids,
                                                            skip_special_tokens=True)


def test_hf_dir_config_forms(smollm_hf_dir: Path, tmp_path: Path) -> None:
    """AddedToken dicts, an add_bos_token flag, and a template inside tokenizer_config.json."""
    shutil.copy(smollm_hf_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    added = {"lstrip": False, "rstrip": False, "normalized": False, "single_word": False,
             "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>", **added},
        "eos_token": {"content": "<|im_end|>", **added},
        "add_bos_token": True,
        "chat_template": "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}",
    }))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok is not None
    assert tok.bos_token_id == 1 and tok.eos_token_ids[0] == 2
    assert tok.encode("hi")[0] == 1
    assert tok.encode("hi", add_special_tokens=False)[0] != 1
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x<|im_end|>"


def test_hf_dir_without_tokenizer_json(tmp_path: Path) -> None:
    assert Tokenizer.from_hf_dir(tmp_path) is None


def test_hf_dir_corrupt_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", ')
    with pytest.raises(TiergenError, match=r"could not read .*tokenizer\.json.*corrupt"):
        Tokenizer.from_hf_dir(tmp_path)


def test_hf_dir_corrupt_config(smollm_hf_dir: Path, tmp_path: Path) -> None:
    shutil.copy(smollm_hf_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TiergenError, match=r"could not read .*tokenizer_config\.json"):
        Tokenizer.from_hf_dir(tmp_path)


# ---- incremental detokenisation ---------------------------------------------------------------

STREAM_TEXTS = [
    "emoji 😀👍🏽 family 👨‍👩‍👧 done",
    "中文测试：你好，世界。日本語、한국어",
    "Café déjà vu, naïve résumé — “quotes” ☃",
    "  spaces   and\nnew lines\n",
]


def _stream(tok: Tokenizer, ids: list[int], context: list[int] | None = None,
            skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, context or [], skip_special_tokens=skip_special_tokens)
    return [detok.push(i) for i in ids] + [detok.finish()]


@pytest.mark.parametrize("which", ["smollm", "spm"])
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_deltas_add_up(request: pytest.FixtureRequest, which: str, text: str) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    ids = tok.encode(text)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    if not text.isascii():
        assert "" in deltas[:-1]  # some character did arrive split over several tokens


@pytest.mark.parametrize("which", ["smollm", "spm"])
def test_stream_after_context_keeps_leading_space(request: pytest.FixtureRequest,
                                                  which: str) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    ids = tok.encode("hello world café 😀 the end")
    for cut in range(1, len(ids)):
        deltas = _stream(tok, ids[cut:], context=ids[:cut])
        assert "".join(deltas) == tok.decode(ids)[len(tok.decode(ids[:cut])):]
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("which", ["smollm", "spm"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_random_ids(request: pytest.FixtureRequest, which: str,
                           skip_special_tokens: bool) -> None:
    """Arbitrary tokens (specials, spaces, partial characters) mixed with multi-byte characters:
    the deltas still add up to decode().

    SentencePiece byte tokens are only drawn as whole characters: its decoder turns a run of
    bytes that is not valid UTF-8 into U+FFFDs as a whole, so no stream could match it.
    """
    tok: Tokenizer = request.getfixturevalue(which)
    pieces = [i for i in range(tok.vocab_size) if not re.fullmatch(r"<0x[0-9A-F]{2}>",
                                                                   tok.backend.id_to_token(i))]
    rng = random.Random(1234)
    for _ in range(40):
        ids: list[int] = []
        for _ in range(rng.randrange(1, 20)):
            if rng.random() < 0.2:
                ids += tok.encode(rng.choice("é中😀👍🏽☃"), add_special_tokens=False)
            else:
                ids.append(rng.choice(pieces))
        deltas = _stream(tok, ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip_special_tokens)


# ---- errors -----------------------------------------------------------------------------------

def test_no_chat_template(spm: Tokenizer) -> None:
    with pytest.raises(TiergenError, match="no chat template; pass one"):
        spm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert spm.apply_chat_template([{"role": "user", "content": "hi"}],
                                   template="{{ messages[0].content }}") == "hi"


@pytest.mark.parametrize(("messages", "message"), [
    ([], "messages is empty"),
    ("hello", "messages must be a list"),
    (["hello"], "message 0 must be a dict"),
    ([{"role": "user", "content": "a"}, {"content": "b"}],
     "message 1 needs a string 'role', got nothing"),
    ([{"role": "user", "content": None}], "message 0 needs a string 'content', got NoneType"),
    ([{"role": 3, "content": "x"}], "message 0 needs a string 'role', got int"),
])
def test_bad_messages(smollm: Tokenizer, messages: object, message: str) -> None:
    with pytest.raises(TiergenError, match=message):
        smollm.apply_chat_template(messages)  # type: ignore[arg-type]


def test_template_errors(smollm: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(TiergenError, match="failed to render: roles must alternate"):
        smollm.apply_chat_template(
            messages, template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TiergenError, match="not valid Jinja"):
        smollm.apply_chat_template(messages, template="{% for m in messages %}")


def test_a_loaded_gguf_model_keeps_its_vocabulary_once(smollm_gguf: Path) -> None:
    # The tokenizer holds the vocabulary; the file's metadata forgets its copy (about 10 MB
    # of Python strings) and the model still encodes and decodes.
    from tiergen.weights import open_model

    files = open_model(smollm_gguf)
    meta = files.source.file.metadata
    assert not [k for k in meta if k.startswith("tokenizer.ggml.") and isinstance(meta[k], list)]
    assert meta["tokenizer.ggml.model"] == "gpt2"
    ids = files.tokenizer.encode("The capital of France is Paris.")
    assert files.tokenizer.decode(ids) == "The capital of France is Paris."


def test_jinja2_loads_only_with_a_chat_template():
    """A generation from raw text never compiles a template: jinja2 stays out of the process
    (about 2 MB of resident memory)."""
    import subprocess
    import sys

    code = ("import sys; from tiergen import LLM, SamplingParams; llm = LLM('smollm2'); "
            "llm.generate(['Hi'], SamplingParams(max_tokens=1)); print('jinja2' in sys.modules); "
            "llm.tokenizer.apply_chat_template([{'role': 'user', 'content': 'Hi'}]); "
            "print('jinja2' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "True"]
