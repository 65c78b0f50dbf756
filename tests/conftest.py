import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch intra-op threads for real-model tests: SPECDRAFT_THREADS, else one. On the 2-core machine that
# runs CI (shared with other work) a second thread made SmolLM2 decoding 4-6x slower whenever another
# process held a core (OpenMP barriers wait for a descheduled thread: 800-1260 ms/token on two threads,
# 200 ms/token on one, measured in turns in one process); the whole suite on one thread, under load,
# stayed inside the CI budget. SPECDRAFT_THREADS=2 restores two threads on an idle machine.
THREADS = int(os.environ.get("SPECDRAFT_THREADS", "0")) or 1
torch.set_num_threads(THREADS)

# Fixtures that load a real model (SmolLM2, the Qwen pair); a test using none of them runs on tiny
# random models, whose ops are too small to gain from intra-op threads (a tiny generate call: 6 ms on
# one thread, 100+ ms on two under load), so such tests run on one thread whatever SPECDRAFT_THREADS
# says (SPECDRAFT_TINY_THREADS changes it).
REAL_MODEL_FIXTURES = {"smol_f32", "smol_variant", "qwen", "smol_gguf", "smol_ov"}
TINY_THREADS = int(os.environ.get("SPECDRAFT_TINY_THREADS", "1"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any of the test's fixtures (module- and session-scoped ones included) are set up, so
    that e.g. a module fixture training tiny heads runs on the tiny tests' thread count."""
    real = not REAL_MODEL_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))
    n = THREADS if real else TINY_THREADS
    os.environ["SPECDRAFT_THREADS"] = str(n)  # what the CLI's set_threads() reads (in-process and subprocesses)
    torch.set_num_threads(n)


def logits_of(model, ids, keep=1):
    """Plain decoding's float32 logits [keep, V] of the last ``keep`` positions of ``ids``, fed at once to
    fresh rows of ``model`` (any backend): the reference the decode loop is checked against."""
    rows = model.new_rows()
    rows.add_rows([[]])
    return rows.forward([[int(t) for t in torch.as_tensor(ids).reshape(-1)]], keep=keep)[0]


def tiny_llama(vocab=8, seed=0, layers=2, hidden=32, max_pos=256, scale=12.0, noise_seed=None, noise=0.0):
    """A random-weight Llama: for the mechanics only (real models are used for exactness)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdraft.models.hf import HFModel

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_pos,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    m = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # sharper distributions than the default init, so tokens matter
        m.lm_head.weight.mul_(scale)
        if noise_seed is not None:  # a related model: the same weights with a perturbed head
            g = torch.Generator().manual_seed(noise_seed)
            m.lm_head.weight.add_(noise * torch.randn(m.lm_head.weight.shape, generator=g))
    return HFModel(m, None, name=f"tiny-{seed}")


HOME_AT_START = os.environ.get("SPECDRAFT_HOME")  # where `make models` put the models (tests may move it)


def smol_files():
    """SmolLM2's provisioned directory in the models' home of the session's start: a test that points
    SPECDRAFT_HOME at a temporary directory must not provision SmolLM2 again there (40 s)."""
    from specdraft.models import catalog

    now = os.environ.pop("SPECDRAFT_HOME", None)
    if HOME_AT_START is not None:
        os.environ["SPECDRAFT_HOME"] = HOME_AT_START
    try:
        return catalog.pull("smollm2-135m")
    finally:
        os.environ.pop("SPECDRAFT_HOME", None)
        if now is not None:
            os.environ["SPECDRAFT_HOME"] = now


def tiny_model_dir(d, layers=2):
    """A tiny random Llama saved as a transformers directory with SmolLM2's tokenizer files
    (for CLI / harness tests that load models by path)."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=2,
        bos_token_id=1,
    )
    LlamaForCausalLM(cfg).save_pretrained(d)
    for f in smol_files().iterdir():  # only its tokenizer files are used
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, d / f.name)
    return d


@pytest.fixture(scope="session")
def smol_f32():
    from specdraft.models.backends import load_model

    return load_model("smollm2-135m", "float32")


@pytest.fixture(scope="session")
def smol_gguf():
    """SmolLM2-135M's Q4_1 GGUF on the llama.cpp backend (weights memory-mapped; contexts pooled)."""
    from specdraft.models.backends import load_model

    return load_model("smollm2-135m", backend="llama")


@pytest.fixture(scope="session")
def smol_variant():
    """load(dtype, num_layers) -> a SmolLM2-135M copy (e.g. a layer-truncated draft, a bf16 copy),
    loaded once per session and shared by every module (drafters reset its cache in begin())."""
    from specdraft.models.backends import load_model

    cache = {}

    def load(dtype="float32", num_layers=None):
        if (dtype, num_layers) not in cache:
            cache[dtype, num_layers] = load_model("smollm2-135m", dtype, num_layers=num_layers)
        return cache[dtype, num_layers]

    return load


@pytest.fixture(scope="session")
def smol_draft4(smol_variant):
    """SmolLM2-135M float32 truncated to its first 4 layers: the cheap draft of the batch and server tests."""
    return smol_variant("float32", 4)


@pytest.fixture(scope="session")
def smol_tok(smol_f32):
    return smol_f32.tokenizer


@pytest.fixture(scope="session")
def smol_dec(smol_f32):
    from specdraft.api import SpecDecoder

    return SpecDecoder(smol_f32, None)


@pytest.fixture(scope="session")
def smol_reference(smol_dec):
    """Plain greedy outputs (test_greedy_real.NEW = 32 new tokens, chat template, EOS ignored) of
    SmolLM2-135M float32 for test_greedy_real.PROMPTS: the one reference every real-model exactness
    test compares with (a shorter run is compared with a prefix of it)."""
    from specdraft.core.config import SamplingParams, SpecConfig
    from test_greedy_real import NEW, PROMPTS

    sp = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    return {p: smol_dec.generate(p, sampling=sp, spec=SpecConfig(method="plain"), chat=True).token_ids for p in PROMPTS}


# The longest test files first (measured: `make test`'s durations), so that with two xdist workers taking
# whole files (--dist loadfile) no long file starts last and leaves one worker alone at the end.
LONGEST_FIRST = [
    "test_greedy_real.py",
    "test_openvino_backend.py",
    "test_llama_backend.py",
    "test_auto.py",
    "test_heads.py",
    "test_batch.py",
    "test_structured_real.py",
    "test_server.py",
    "test_tree_stats.py",
    "test_processing.py",
    "test_model_free.py",
    "test_model_free_real.py",
    "test_errors.py",
    "test_eagle3.py",
    "test_fuzz.py",
    "test_engine_tiny.py",
]


def pytest_collection_modifyitems(session, config, items):
    """Stable: the order inside a file (some files' last test reads what the earlier ones counted) stays."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))
