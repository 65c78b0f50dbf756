"""Adding a backend is one file plus one entry in the backend table (docs/design.md, "Adding a
backend"): a toy backend entered at runtime is offered to exactly the methods its ``offers`` allow, is
a choice of ``--backend``, decodes token-identically to plain decoding, is measured by doctor through
its own ``paths`` and ``check``, and is refused with a message naming it for a method it cannot run.
(Adding a drafter with a parameter, the other half: tests/test_registry.py.)"""

import pytest

from conftest import tiny_llama
from specdraft.api import SpecDecoder
from specdraft.cli import build_parser
from specdraft.core.errors import ConfigError
from specdraft.drafters import registry as methods
from specdraft.models import backends
from specdraft.models.base import Capabilities
from specdraft.models.hf import HFModel

PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
CHECKED = []  # reports the toy's own check was asked for (doctor)


class ToyModel(HFModel):
    """The toy backend's whole file: the transformers rows under another name, trees only."""

    backend = "toy"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(hidden=False, trees=True, layers=False)


class StubTok:
    eos_token_id = None

    def decode(self, ids, **_):
        return " ".join(map(str, ids))


def load_toy(name_or_path, dtype, num_layers):
    inner = tiny_llama(vocab=6)
    model = ToyModel(inner.model, StubTok(), name=name_or_path)
    return model


def check_toy(report):
    CHECKED.append(report)
    return True


@pytest.fixture
def toy():
    assert "toy" not in backends.BACKENDS
    backends.BACKENDS["toy"] = backends.Backend(
        "toy",
        "a toy: transformers rows under another name",
        load_toy,
        uses_dtype=False,
        offers=frozenset({"trees"}),
        paths=("toy",),
        check=check_toy,
    )
    try:
        yield backends.BACKENDS["toy"]
    finally:
        del backends.BACKENDS["toy"]


def test_methods_read_what_it_offers(toy):
    runs = {name for name, m in methods.REGISTRY.items() if "toy" in m.backends}
    assert {"plain", "prompt_lookup", "draft_model", "suffix", "token_recycling", "lookahead"} <= runs
    assert not runs & {"medusa", "eagle", "eagle3", "layer_skip", "early_exit"}  # hidden / views: not offered
    assert "toy" not in methods.REGISTRY["eagle"].backends and "toy" in methods.REGISTRY["suffix"].backends


def test_cli_offers_it(toy):
    args = build_parser().parse_args(["generate", "--target", "x", "--backend", "toy", "hi"])
    assert args.backend == "toy"


def test_it_decodes_losslessly(toy):
    dec = SpecDecoder.load("toy-model", backend="toy")
    assert dec.backend == "toy"
    sp = {"max_new_tokens": 16, "ignore_eos": True}
    plain = dec.generate(PROMPT, sampling=sp, spec={"method": "plain"})
    for spec in ({"method": "prompt_lookup", "k": 3}, {"method": "suffix"}, {"method": "token_recycling"}):
        out = dec.generate(PROMPT, sampling=sp, spec=spec)
        assert out.token_ids == plain.token_ids, spec


def test_a_method_it_cannot_run_names_it(toy):
    dec = SpecDecoder.load("toy-model", backend="toy")
    with pytest.raises(ConfigError, match="not available on the toy backend"):
        dec.generate(PROMPT, sampling={"max_new_tokens": 4}, spec={"method": "medusa", "head": "nowhere"})


def test_doctor_asks_its_check_and_measures_its_paths(toy, monkeypatch):
    from specdraft.commands import doctor

    measured = []
    monkeypatch.setattr(doctor, "measure", lambda r, model, paths: measured.append(paths) or {})
    monkeypatch.setattr(doctor, "recommend", lambda *a: None)
    doctor.main_doctor(model="toy-model", costs=True)
    assert CHECKED and measured and "toy" in measured[0]


def test_the_loop_verifiers_drafters_and_doctor_name_no_backend():
    """The entry is all anyone reads (docs/design.md, "Adding a backend"): no backend's name is written in
    the loop, the verifiers, the drafters or doctor (the bench and near_tie_bound do name some; the
    doc says where)."""
    import ast
    from pathlib import Path

    pkg = Path(backends.__file__).parent.parent
    files = [
        pkg / "engine.py",
        pkg / "core" / "verify.py",
        pkg / "commands" / "doctor.py",
        *sorted((pkg / "drafters").glob("*.py")),
    ]
    named = [
        f"{f.relative_to(pkg)}:{n.lineno} {n.value!r}"
        for f in files
        for n in ast.walk(ast.parse(f.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in backends.BACKENDS
    ]
    assert not named, named
