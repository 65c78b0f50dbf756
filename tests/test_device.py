"""The device setting, checked on a machine without a GPU.

- The step path makes no tensor on torch's default device (device_util.ImplicitDevices): a batch of rows
  that drafts chains and token trees with a draft model, a layer view, trained-head shapes (Medusa, EAGLE,
  EAGLE-3) and the model-free methods, greedy and sampling, with penalties, bias, min_tokens and logprobs,
  is admitted and decoded to the end under the check. On a GPU such a tensor would sit on the CPU (or
  torch's default device) beside the model's. The check catches a planted one.
- The verifiers' decisions are read from the logits' device once per step.
- ``--device cuda`` where torch sees no GPU is one ``error:`` line and exit 2, before any model loads (each
  command that loads models); the library raises ConfigError. A backend that does not run on the device
  named says so (OpenVINO and CUDA, transformers and ``gpu``, a CPU-only llama.cpp build and ``cuda``).
- ``--device cpu`` named works, and the model and each request's random stream are on the CPU.
"""

import pytest
import torch

from conftest import tiny_llama, tiny_model_dir
from device_util import ImplicitDevices
from head_util import head_spec, random_eagle3_head
from specdraft import engine as engine_mod
from specdraft.api import SpecDecoder
from specdraft.cli import main
from specdraft.core.config import SpecConfig
from specdraft.core.device import device_kind, torch_device
from specdraft.core.errors import ConfigError
from specdraft.drafters.eagle import EagleDrafter
from specdraft.drafters.eagle3 import Eagle3Drafter
from specdraft.drafters.medusa import MedusaDrafter
from specdraft.engine import Engine
from specdraft.models.backends import load_model, placement
from specdraft.models.heads import EagleHead, MedusaHeads
from test_train_files import one_error  # exit 2 and one line `error: ...`

V = 12
GREEDY = {"max_new_tokens": 10, "ignore_eos": True}
SAMPLED = {**GREEDY, "temperature": 1.0, "top_k": 8, "top_p": 0.95}
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a CUDA GPU here")


@pytest.fixture(scope="module")
def dec():
    return SpecDecoder(tiny_llama(vocab=V, layers=4), tiny_llama(vocab=V, noise_seed=5, noise=0.25))


def rows(dec):
    """(prompt, sampling, drafter) for a batch that runs every kind of drafter and verifier."""
    t = dec.target
    spec = lambda **kw: SpecConfig.from_dict({"k": 3, **kw})  # noqa: E731
    head = lambda method, **kw: head_spec(method, k=3, **kw)  # noqa: E731  (the heads are made here)
    made = lambda sp, **kw: (sp, dec.make_drafter(spec(**kw)))  # noqa: E731
    tree = {"tree": "dynamic", "tree_topk": 2, "tree_budget": 6}
    return [
        made(
            {**GREEDY, "repetition_penalty": 1.3, "logit_bias": {3: 2.0}, "min_tokens": 4, "logprobs": 2},
            method="draft_model",
        ),
        made({**SAMPLED, "seed": 7}, method="draft_model", **tree),  # a seeded row: a lane of its own
        made({**SAMPLED, "presence_penalty": 0.5}, method="draft_model"),
        made(GREEDY, method="early_exit", exit_layer=1, tree="static", tree_branching=[2, 2]),
        made(SAMPLED, method="prompt_lookup", branches=2, max_ngram=2),
        made(GREEDY, method="token_recycling"),
        made(SAMPLED, method="lookahead"),
        made(GREEDY, method="suffix"),
        made(SAMPLED, method="plain"),
        (SAMPLED, dec.make_drafter(spec(method="draft_model", lossy="typical"))),
        (GREEDY, MedusaDrafter(t, MedusaHeads(32, 2), head("medusa", tree="static", tree_branching=[2, 2]))),
        (SAMPLED, MedusaDrafter(t, MedusaHeads(32, 2), head("medusa", tree="static", tree_branching=[2, 1]))),
        (SAMPLED, EagleDrafter(t, EagleHead(t.facts).eval(), head("eagle"))),
        (GREEDY, Eagle3Drafter(t, random_eagle3_head(t, torch.arange(V)), head("eagle3", **tree))),
        (SAMPLED, Eagle3Drafter(t, random_eagle3_head(t, torch.arange(V)), head("eagle3"))),
    ]


def decode_under_check(dec, reads=None) -> ImplicitDevices:
    """Admit the batch and decode it to the end with the check on; -> the check (what it found)."""
    eng = Engine(dec.target, eos_ids=set())
    batch = rows(dec)
    prompts = [[1, 2, 3, 1, 2, 4][: 3 + i % 4] for i in range(len(batch))]
    check = ImplicitDevices()
    with check:
        for p, (sp, drafter) in zip(prompts, batch):
            eng.add(p, sp, drafter)
        while eng.rows:
            n = reads[0] if reads else 0
            for row in eng.step():
                assert row.error is None, row.error
                assert row.finish == "length"
            if reads:
                reads.append(reads[0] - n)
    return check


def test_the_step_path_makes_no_tensor_on_the_default_device(dec):
    check = decode_under_check(dec)
    assert not check.found, "\n".join(f"{n} x {k}" for k, n in sorted(check.found.items()))


def test_the_check_catches_a_tensor_made_without_a_device(dec, monkeypatch):
    """A planted ``torch.zeros(3)`` in the step (the check's fail-before: the test above fails with it)."""
    fit = Engine._fit

    def planted(self, drafts):
        torch.zeros(3)
        return fit(self, drafts)

    monkeypatch.setattr(Engine, "_fit", planted)
    found = decode_under_check(dec).found
    assert [k for k in found if k.endswith("torch.zeros") and k.startswith("tests/test_device.py:")], found


def test_the_verifiers_decisions_are_read_once_per_step(dec, monkeypatch):
    real = engine_mod._read_once
    reads = [0]

    def counted(parts):
        reads[0] += 1
        return real(parts)

    monkeypatch.setattr(engine_mod, "_read_once", counted)
    decode_under_check(dec, reads)
    assert set(reads[1:]) == {1}, reads


def test_a_sampled_chain_without_a_token_fails_alone_after_the_one_read(dec):
    """Sampling with nothing to draw (NaN scores) is found in the step's one read, not by a read of its own:
    that row finishes "error" with sampling's message, the others decode as alone."""
    from specdraft.core.sampling import NO_TOKEN
    from specdraft.engine import generate

    sp = {**SAMPLED, "seed": 3}
    alone = generate(dec.target, dec.make_drafter(SpecConfig(method="draft_model", k=3)), [1, 2, 3], sp, set())
    eng = Engine(dec.target, eos_ids=set(), isolate_seeded=False)
    good = eng.add([1, 2, 3], sp, dec.make_drafter(SpecConfig(method="draft_model", k=3)))
    bad = eng.add([4, 5], SAMPLED, dec.make_drafter(SpecConfig(method="draft_model", k=3)))
    process = eng._process

    def nan_for_bad(rows, drafts, logits):
        logits = process(rows, drafts, logits).clone()
        if bad in rows:
            logits[rows.index(bad)] = float("nan")
        return logits

    eng._process = nan_for_bad
    while eng.rows:
        eng.step()
    assert bad.finish == "error" and str(bad.error) == NO_TOKEN
    assert good.result.token_ids == alone.token_ids


def test_a_request_draws_on_the_targets_device(dec):
    eng = Engine(dec.target, eos_ids=set())
    row = eng.add([1, 2, 3], {**SAMPLED, "seed": 1}, dec.make_drafter(SpecConfig(method="plain")))
    assert row.gen.device == dec.target.device == torch.device("cpu")


# --- the setting -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,kind", [("auto", "auto"), ("cpu", "cpu"), ("cuda", "cuda"), ("cuda:1", "cuda"), ("gpu", "gpu")]
)
def test_device_kinds(name, kind):
    assert device_kind(name) == kind


@pytest.mark.parametrize("name", ["banana", "cpu:1", "meta", "cuda:x", ""])
def test_a_bad_device_names_the_choices(name):
    with pytest.raises(ConfigError, match=r"--device must be cpu, cuda, cuda:N or auto \(or gpu"):
        device_kind(name)


@no_cuda
def test_cuda_without_a_gpu_is_a_config_error_naming_the_flag():
    with pytest.raises(
        ConfigError,
        match=r"--draft-device cuda: torch sees no such CUDA device here \(0 visible\); "
        r"use --draft-device cpu",
    ):
        torch_device("cuda", "--draft-device")
    assert torch_device("auto") == torch.device("cpu")


@no_cuda
def test_the_library_refuses_cuda_before_loading(tmp_path, monkeypatch):
    monkeypatch.setattr("specdraft.models.loading.load_hf", lambda *a, **k: pytest.fail("loaded a model"))
    for kw in (
        {"device": "cuda"},
        {"device": "cuda:0", "backend": "hf"},
        {"draft": "smollm2-135m", "draft_device": "cuda"},
    ):
        with pytest.raises(ConfigError, match="CUDA device"):
            SpecDecoder.load("smollm2-135m", **kw)
    with pytest.raises(ConfigError, match="CUDA device"):
        load_model(str(tmp_path), device="cuda")


def test_backends_name_the_devices_they_run_on():
    with pytest.raises(
        ConfigError,
        match=r"--device cuda: the openvino backend runs on cpu or gpu \(cuda: --backend "
        r"hf or llama\)",
    ):
        placement("openvino", "cuda")
    with pytest.raises(
        ConfigError,
        match=r"--device gpu: the hf backend runs on cpu or cuda \(gpu: --backend "
        r"openvino\)",
    ):
        placement("hf", "gpu")
    assert placement("openvino", "gpu") == "GPU" and placement("openvino", "auto") == "CPU"


def test_backend_auto_takes_transformers_where_torch_sees_a_cuda_gpu(monkeypatch, tmp_path):
    """(torch's count of CUDA devices stood in for: nothing runs on a GPU here)"""
    from specdraft.models import paths

    monkeypatch.setattr(paths, "file_for", lambda model: tmp_path / f"{model}.json")
    monkeypatch.setattr(paths, "measure_curves", lambda *a, **k: pytest.fail("measured CPU paths"))
    monkeypatch.setattr(paths, "cuda_count", lambda: 1)
    for device in ("auto", "cuda"):
        assert [str(p) for p, _ in paths.ranked("smollm2-135m", device=device)] == ["hf"]
    assert paths.allowed_for(None, [], None, "gpu").backends == ("openvino",)
    assert paths.allowed_for(None, [], None, "cuda").backends == ("hf", "llama")
    monkeypatch.setattr(paths, "cuda_count", lambda: 0)
    with pytest.raises(pytest.fail.Exception, match="measured CPU paths"):  # no GPU: auto measures, as before
        paths.ranked("smollm2-135m", device="auto")


def test_a_cpu_only_llama_build_refuses_cuda_naming_the_build_flag(monkeypatch):
    """The build's own answer decides (``llama_supports_gpu_offload``), set here both ways so the test holds
    on a CPU-only and on a CUDA build alike."""
    llama_cpp = pytest.importorskip("llama_cpp")
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: False)
    with pytest.raises(ConfigError, match=r'cannot offload to a GPU .* CMAKE_ARGS="-DGGML_CUDA=on"'):
        placement("llama", "cuda")
    assert placement("llama", "auto") is False and placement("llama", "cpu") is False
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)
    assert placement("llama", "auto") is True and placement("llama", "cpu") is False


@no_cuda
@pytest.mark.parametrize(
    "args",
    [
        ["generate", "--device", "cuda", "hi"],
        ["generate", "--backend", "hf", "--device", "cuda:0", "hi"],
        [
            "generate",
            "--backend",
            "hf",
            "--draft",
            "qwen2.5-coder-0.5b",
            "--method",
            "draft_model",
            "--draft-device",
            "cuda",
            "hi",
        ],
        ["serve", "--device", "cuda"],
        ["demo", "--device", "cuda"],
        ["costs", "--device", "cuda"],
        ["batchbench", "--target", "smollm2-135m", "--methods", "plain", "--device", "cuda"],
        [
            "bench",
            "--target",
            "smollm2-135m",
            "--methods",
            "plain",
            "--tasks",
            "qa",
            "--n-per-task",
            "1",
            "--device",
            "cuda",
        ],
    ],
    ids=["generate", "generate-hf", "draft-device", "serve", "demo", "costs", "batchbench", "bench"],
)
def test_cli_cuda_without_a_gpu_is_one_error_line(capsys, monkeypatch, tmp_path, args):
    monkeypatch.setattr("specdraft.models.loading.load_hf", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.chdir(tmp_path)  # (bench would write its results under results/)
    line = one_error(capsys, args)
    assert "torch sees no such CUDA device here (0 visible)" in line, line


BENCH_QA = ["bench", "--target", "smollm2-135m", "--tasks", "qa", "--n-per-task", "1"]


@no_cuda
@pytest.mark.parametrize(
    "args,says",
    [
        (  # the bench refuses what generate and serve refuse, even where none of its methods would load the draft
            [*BENCH_QA, "--methods", "plain", "--draft", "smollm2-135m", "--draft-device", "cuda"],
            "--draft smollm2-135m: none of the methods measured (plain) uses a draft",
        ),
        (
            [*BENCH_QA, "--methods", "draft_model", "--draft", "smollm2-135m", "--draft-device", "cuda"],
            "--draft-device cuda: torch sees no such CUDA device here",
        ),
        ([*BENCH_QA, "--methods", "plain", "--draft-device", "cuda"], "--draft-device cuda: no draft model is given"),
        (["generate", "--draft-device", "cuda", "hi"], "--draft-device cuda: no draft model is given"),
        (["generate", "--draft-device", "cpu", "hi"], "--draft-device cpu: no draft model is given"),
        (["generate", "--draft-backend", "llama", "hi"], "--draft-backend llama: no draft model is given"),
        (
            ["generate", "--method", "prompt_lookup", "--draft", "smollm2-135m", "hi"],
            "--draft smollm2-135m: method prompt_lookup uses no draft model",
        ),
        (["serve", "--draft-device", "cuda"], "--draft-device cuda: no draft model is given"),
        (["batchbench", "--target", "smollm2-135m", "--methods", "plain", "--draft-device", "cpu"], "no draft model"),
    ],
    ids=[
        "bench-unused-draft",
        "bench-draft",
        "bench-no-draft",
        "generate",
        "generate-cpu",
        "draft-backend",
        "generate-unused-draft",
        "serve",
        "batchbench",
    ],
)
def test_an_option_for_a_draft_is_never_silently_ignored(capsys, monkeypatch, tmp_path, args, says):
    monkeypatch.setattr("specdraft.models.loading.load_hf", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.chdir(tmp_path)
    assert says in one_error(capsys, args)


def test_batchbench_takes_backend(capsys, monkeypatch):
    """--backend, which every other command takes: named, it is the backend loaded (not refused by argparse)."""
    from specdraft import api

    seen = {}

    def fake_load(*a, **k):
        seen.update(k)
        raise ConfigError("stop here")

    monkeypatch.setattr(api.SpecDecoder, "load", fake_load)
    assert "stop here" in one_error(
        capsys, ["batchbench", "--target", "smollm2-135m", "--methods", "plain", "--backend", "llama"]
    )
    assert seen["backend"] == "llama" and seen["dtype"] is None


@pytest.mark.parametrize(
    "args,says",
    [
        (["generate", "--backend", "openvino", "--device", "cuda", "hi"], "the openvino backend runs on cpu or gpu"),
        (["generate", "--backend", "hf", "--device", "gpu", "hi"], "the hf backend runs on cpu or cuda"),
        (["generate", "--device", "tpu", "hi"], "--device must be cpu, cuda, cuda:N or auto"),
        (["autotune", "--device", "cuda"], "autotune measures this CPU"),
    ],
    ids=["openvino-cuda", "hf-gpu", "unknown", "autotune"],
)
def test_cli_devices_a_backend_or_command_does_not_run_on(capsys, args, says):
    assert says in one_error(capsys, args)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny_target"))


def test_device_cpu_named_works(tiny_dir, capsys):
    dec = SpecDecoder.load(
        str(tiny_dir), draft=str(tiny_dir), draft_layers=1, dtype="float32", device="cpu", draft_device="cpu"
    )
    assert dec.target.device == dec.draft.device == torch.device("cpu")
    assert dec.target.source["device"] == "cpu"
    out = dec.generate([1, 2, 3], sampling=GREEDY, spec={"method": "draft_model", "k": 2})
    assert len(out.token_ids) == GREEDY["max_new_tokens"]
    capsys.readouterr()
    assert (
        main(
            [
                "generate",
                "--target",
                str(tiny_dir),
                "--device",
                "cpu",
                "--method",
                "plain",
                "--max-new-tokens",
                "3",
                "--dtype",
                "float32",
                "--json",
                "hi",
            ]
        )
        == 0
    )
