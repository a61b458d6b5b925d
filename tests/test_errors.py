import tiergen  # noqa: F401  (first: sets the CPU safety guard before torch runs a kernel)

# Every bad input raises a TiergenError whose message says what is wrong.
#
# One tiny random Llama checkpoint is built per module; each broken variant is a copy of it
# with one thing changed, so each test shows that exactly that change is caught.

import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tiergen import LLM, SamplingParams, TiergenError
from tiergen.config import SUPPORTED_ARCHITECTURES
from tiny_models import BASE, build

VOCAB = BASE["vocab_size"]
GREEDY = SamplingParams(max_tokens=3, temperature=0)


# ---- fixtures ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A valid tiny checkpoint: config.json, generation_config.json, model.safetensors; no
    tokenizer files."""
    directory = tmp_path_factory.mktemp("tiny") / "llama"
    build("llama-mha", directory)
    return directory


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, dtype="float32", device="cpu")


@pytest.fixture
def copy_model(model_dir, tmp_path):
    """copy_model(**config_changes) -> a fresh copy of the tiny checkpoint (None removes a key)."""

    def make(**changes) -> Path:
        directory = tmp_path / "model"
        shutil.copytree(model_dir, directory)
        if changes:
            cfg = json.loads((directory / "config.json").read_text())
            for key, value in changes.items():
                if value is None:
                    cfg.pop(key)
                else:
                    cfg[key] = value
            (directory / "config.json").write_text(json.dumps(cfg))
        return directory

    return make


def add_word_tokenizer(directory: Path) -> None:
    """A word-level tokenizer.json over the tiny vocabulary, and no chat template anywhere."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0} | {f"w{i}": i for i in range(1, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def tok_llm(model_dir, tmp_path_factory) -> LLM:
    """The tiny model with a tokenizer but no chat template."""
    directory = tmp_path_factory.mktemp("tok") / "llama"
    shutil.copytree(model_dir, directory)
    add_word_tokenizer(directory)
    return LLM(directory, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def short_llm(model_dir, tmp_path_factory) -> LLM:
    """The tiny model with a context of 64 tokens."""
    directory = tmp_path_factory.mktemp("short") / "llama"
    shutil.copytree(model_dir, directory)
    cfg = json.loads((directory / "config.json").read_text())
    cfg["max_position_embeddings"] = 64
    (directory / "config.json").write_text(json.dumps(cfg))
    return LLM(directory, dtype="float32", device="cpu")


def write_gguf(path: Path) -> None:
    """A complete, tiny one-layer llama GGUF (F32) that tiergen loads."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_block_count(1)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(32)
    rng = np.random.default_rng(0)
    for name, shape in [("token_embd.weight", (32, 16)), ("output_norm.weight", (16,)),
                        ("blk.0.attn_norm.weight", (16,)), ("blk.0.attn_q.weight", (16, 16)),
                        ("blk.0.attn_k.weight", (16, 16)), ("blk.0.attn_v.weight", (16, 16)),
                        ("blk.0.attn_output.weight", (16, 16)), ("blk.0.ffn_norm.weight", (16,)),
                        ("blk.0.ffn_gate.weight", (32, 16)), ("blk.0.ffn_up.weight", (32, 16)),
                        ("blk.0.ffn_down.weight", (16, 32))]:
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---- finding the model ---------------------------------------------------------------------

def test_missing_model_path(tmp_path):
    with pytest.raises(TiergenError, match=r"'.*no_such_dir' not found"):
        LLM(tmp_path / "no_such_dir")


def test_unknown_short_name():
    with pytest.raises(TiergenError, match=r"'nosuchmodel' not found.*short name \(smollm2"):
        LLM("nosuchmodel")


def test_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.md").write_text("hello")
    with pytest.raises(TiergenError, match="is not a model directory: it has no config.json"):
        LLM(tmp_path)


def test_text_file_as_model(tmp_path):
    path = tmp_path / "model.txt"
    path.write_text("not a model")
    with pytest.raises(TiergenError, match=r"model\.txt is a file but not a \.gguf"):
        LLM(path)


def test_directory_without_weights(copy_model):
    directory = copy_model()
    (directory / "model.safetensors").unlink()
    with pytest.raises(TiergenError, match=r"holds no \*\.safetensors files"):
        LLM(directory)


# ---- config.json -----------------------------------------------------------------------------

def test_unsupported_architecture_lists_supported_ones(copy_model):
    with pytest.raises(TiergenError, match="unsupported architecture 'GPT2LMHeadModel'") as e:
        LLM(copy_model(architectures=["GPT2LMHeadModel"]))
    for arch in ("LlamaForCausalLM", *SUPPORTED_ARCHITECTURES):
        assert arch in str(e.value)


@pytest.mark.parametrize("method", ["awq", "mxfp4"])
def test_quantised_checkpoints_are_refused_not_misread(copy_model, method):
    """Checkpoints quantised in a form tiergen does not read (FP8 is tests/test_fp8.py's;
    MXFP4 only as gpt-oss has it) are refused, not read as plain tensors."""
    with pytest.raises(TiergenError, match=f"quantised with '{method}' are not supported"):
        LLM(copy_model(quantization_config={"quant_method": method}))


def test_config_without_architectures(copy_model):
    with pytest.raises(TiergenError, match="names no architecture.*LlamaForCausalLM"):
        LLM(copy_model(architectures=None))


@pytest.mark.parametrize("field", ["hidden_size", "intermediate_size", "num_attention_heads",
                                   "num_hidden_layers", "vocab_size"])
def test_config_missing_required_field(copy_model, field):
    with pytest.raises(TiergenError, match=f"config.json lacks the required field '{field}'"):
        LLM(copy_model(**{field: None}))


@pytest.mark.parametrize("change, match", [
    (dict(hidden_size="64"), "hidden_size must be a positive integer, got '64'"),
    (dict(num_attention_heads=0), "num_heads must be a positive integer, got 0"),
    (dict(num_key_value_heads=3), r"num_attention_heads \(4\) must be a multiple of "
                                  r"num_key_value_heads \(3\)"),
    (dict(rms_norm_eps="small"), "config.json has a field of the wrong type"),
])
def test_config_bad_values(copy_model, change, match):
    with pytest.raises(TiergenError, match=match):
        LLM(copy_model(**change))


@pytest.mark.parametrize("filename", ["config.json", "generation_config.json"])
@pytest.mark.parametrize("content, match", [("{not json", "cannot read .*json"),
                                            ("[1, 2]", "should hold a JSON object, not a list")])
def test_unreadable_json_files(copy_model, filename, content, match):
    directory = copy_model()
    (directory / filename).write_text(content)
    with pytest.raises(TiergenError, match=match):
        LLM(directory)


# ---- safetensors -----------------------------------------------------------------------------

def test_truncated_safetensors(copy_model):
    path = copy_model() / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(TiergenError, match=r"model\.safetensors is not a readable safetensors "
                                           r"file .*truncated or corrupt"):
        LLM(path.parent)


@pytest.mark.parametrize("corrupt", [
    lambda data: b"\xde\xad\xbe\xef" * 64,  # garbage: absurd header length
    lambda data: data[:8] + b"}garbage" + data[16:],  # right length, broken JSON header
])
def test_corrupt_safetensors_header(copy_model, corrupt):
    path = copy_model() / "model.safetensors"
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(TiergenError, match="not a readable safetensors file.*header"):
        LLM(path.parent)


@pytest.mark.parametrize("index, match", [
    ('{"weight_map": {"model.norm.weight": "model-00002.safetensors"}}',
     r"shard .*model-00002\.safetensors named in the index is missing"),
    ('{"metadata": {}}', "is not a valid safetensors index"),
    ("[]", "is not a valid safetensors index"),
    ('{"weight_map": ["model.safetensors"]}', "is not a valid safetensors index"),
])
def test_bad_safetensors_index(copy_model, index, match):
    directory = copy_model()
    (directory / "model.safetensors.index.json").write_text(index)
    with pytest.raises(TiergenError, match=match):
        LLM(directory)


def test_tensor_shape_disagrees_with_config(copy_model):
    intermediate = BASE["intermediate_size"]
    hidden = BASE["hidden_size"]
    with pytest.raises(TiergenError, match=re.escape(
            f"has shape ({intermediate}, {hidden}) but the model config implies (80, {hidden})")):
        LLM(copy_model(intermediate_size=80))


# ---- GGUF ------------------------------------------------------------------------------------

def test_truncated_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path)
    assert LLM(path, dtype="float32", device="cpu").config.num_layers == 1  # intact: loads
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])  # the last tensor loses its tail
    with pytest.raises(TiergenError, match="cut.gguf: the file is truncated: tensor"):
        LLM(cut)
    cut.write_bytes(data[:200])  # the header itself is cut
    with pytest.raises(TiergenError, match="the file is truncated: reading metadata"):
        LLM(cut)


def test_gguf_that_is_not_gguf(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_text("this is a text file with a .gguf suffix")
    with pytest.raises(TiergenError, match="does not start with the GGUF magic"):
        LLM(path)


# ---- loading options -------------------------------------------------------------------------

def test_unknown_dtype(model_dir):
    with pytest.raises(TiergenError, match="unknown dtype 'float8'; choose one of auto, float32"):
        LLM(model_dir, dtype="float8")


@pytest.mark.parametrize("device, match", [("nonsense", "unknown device 'nonsense'"),
                                           ("meta", "device type 'meta' is not supported")])
def test_bad_device(model_dir, device, match):
    with pytest.raises(TiergenError, match=match):
        LLM(model_dir, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_cuda_without_gpu(model_dir):
    with pytest.raises(TiergenError, match="torch sees no CUDA GPU"):
        LLM(model_dir, device="cuda")


# ---- prompts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("prompts", [5, None])
def test_prompts_of_wrong_type(llm, prompts):
    with pytest.raises(TiergenError, match="prompts must be a string, a list of token ids"):
        llm.generate(prompts, GREEDY)


def test_params_of_wrong_type(llm):
    with pytest.raises(TiergenError, match="params must be a SamplingParams"):
        llm.generate([[1, 2]], {"temperature": 0})


def test_model_without_tokenizer_generates_from_token_ids(llm):
    assert llm.tokenizer is None
    results = llm.generate([[1, 2, 3], [5, 6]], GREEDY)
    assert [r.prompt_token_ids for r in results] == [[1, 2, 3], [5, 6]]
    for r in results:
        assert r.prompt is None
        assert r.text == ""
        assert len(r.token_ids) == 3 and r.finish_reason == "length"
        assert all(0 <= t < VOCAB for t in r.token_ids)
    # a single list of ids is one prompt; streaming yields ids with empty text
    events = list(llm.stream([1, 2, 3], GREEDY))
    assert [e.token_id for e in events] == results[0].token_ids
    assert all(e.text == "" for e in events)


def test_string_prompt_without_tokenizer(llm):
    with pytest.raises(TiergenError, match="has no tokenizer files: pass prompts as lists of "
                                           "token ids"):
        llm.generate(["Hello"], GREEDY)


def test_prompt_longer_than_context(short_llm):
    assert short_llm.config.context_length == 64
    with pytest.raises(TiergenError, match="prompt of 100 tokens .* exceeds the model's context "
                                           "of 64 tokens"):
        short_llm.generate([[1] * 100], SamplingParams(max_tokens=1))
    with pytest.raises(TiergenError, match="context of 64 tokens"):
        list(short_llm.stream([[1] * 100], SamplingParams(max_tokens=1)))


def test_prompt_plus_max_tokens_over_context(short_llm):
    with pytest.raises(TiergenError, match="prompt of 60 tokens plus max_tokens=10 exceeds the "
                                           "model's context of 64 tokens"):
        short_llm.generate([[1] * 60], SamplingParams(max_tokens=10, temperature=0))
    # exactly filling the context is allowed
    r = short_llm.generate([[1] * 60], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(r.token_ids) == 4


def test_empty_token_prompt(llm):
    with pytest.raises(TiergenError, match="a prompt is empty"):
        llm.generate([[1, 2], []], GREEDY)


def test_empty_string_prompt(tok_llm):
    assert tok_llm.generate(["w1 w2"], GREEDY)[0].prompt_token_ids == [1, 2]
    with pytest.raises(TiergenError, match="a prompt is empty"):
        tok_llm.generate([""], GREEDY)


@pytest.mark.parametrize("token", [VOCAB, 10**6, -1])
def test_token_id_outside_vocabulary(llm, token):
    with pytest.raises(TiergenError, match=f"token id {token} is outside the vocabulary "
                                           rf"\(0\.\.{VOCAB - 1}\)"):
        llm.generate([[1, token, 2]], GREEDY)


def test_prompt_of_wrong_type(llm):
    with pytest.raises(TiergenError, match="a prompt must be a string or a list of token ids"):
        llm.generate([[1.5, 2.0]], GREEDY)


# ---- sampling parameters ---------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.5), "temperature must be a number >= 0"),
    (dict(temperature="hot"), "temperature must be a number >= 0"),
    (dict(max_tokens=True), "max_tokens must be an integer >= 0, got True"),
    (dict(seed=True), "seed must be an integer, got True"),
    (dict(stop=3), "stop must be a string or a list of strings, got 3"),
    (dict(top_p=0), r"top_p must be in \(0, 1\], got 0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(top_k=2.5), "top_k must be an integer >= 0"),
    (dict(max_tokens=-3), "max_tokens must be an integer >= 0, got -3"),
    (dict(repetition_penalty=0), "repetition_penalty must be a number > 0"),
    (dict(seed=1.5), "seed must be an integer, got 1.5"),
    (dict(seed="42"), "seed must be an integer, got '42'"),
    (dict(stop=""), "stop strings must be non-empty strings"),
    (dict(stop=["ok", ""]), "stop strings must be non-empty strings"),
])
def test_invalid_sampling_parameters(kwargs, match):
    with pytest.raises(TiergenError, match="invalid sampling parameter: " + match):
        SamplingParams(**kwargs)


def test_valid_sampling_parameters_pass():
    SamplingParams(max_tokens=1, temperature=0, top_p=1.0, top_k=0, repetition_penalty=1.0,
                   seed=0, stop=["x"])
    SamplingParams(temperature=2.0, top_p=0.01, top_k=1, repetition_penalty=0.5, stop="x")


def test_mismatched_sampling_params_and_prompts(llm):
    with pytest.raises(TiergenError, match="got 3 SamplingParams for 2 prompts"):
        llm.generate([[1], [2]], [GREEDY] * 3)
    with pytest.raises(TiergenError, match="got 1 SamplingParams for 2 prompts"):
        llm.generate([[1], [2]], [GREEDY])


def test_stop_strings_without_tokenizer(llm):
    with pytest.raises(TiergenError, match="stop strings need a tokenizer"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2, stop="x"))


# ---- chat ------------------------------------------------------------------------------------

USER = [{"role": "user", "content": "w1 w2"}]
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def test_chat_without_tokenizer(llm):
    with pytest.raises(TiergenError, match="has no tokenizer, so it cannot chat"):
        llm.chat(USER, GREEDY)


def test_chat_without_chat_template(tok_llm):
    assert tok_llm.tokenizer.chat_template is None
    with pytest.raises(TiergenError, match="this model has no chat template; pass one"):
        tok_llm.chat(USER, GREEDY)
    # with a template passed explicitly it chats
    assert len(tok_llm.chat(USER, GREEDY, chat_template=TEMPLATE).token_ids) == 3


@pytest.mark.parametrize("messages, match", [
    ([], "messages is empty; give at least one message"),
    ([{"role": "user"}], "message 0 needs a string 'content'"),
    ("w1 w2", "messages must be a list"),
])
def test_chat_with_bad_messages(tok_llm, messages, match):
    with pytest.raises(TiergenError, match=match):
        tok_llm.chat(messages, GREEDY, chat_template=TEMPLATE)


def test_chat_with_invalid_template(tok_llm):
    with pytest.raises(TiergenError, match="the chat template is not valid Jinja"):
        tok_llm.chat(USER, GREEDY, chat_template="{% if %}")
