"""Adding a backend is one file plus one entry in the backend table (docs/design.md, "Adding a
backend"): a toy backend entered at runtime is offered to exactly the methods its ``offers`` allow, is
a choice of ``--backend``, decodes token-identically to plain decoding, is measured by doctor through
its own ``paths`` and ``check``, and is refused with a message naming it for a method it cannot run.
A backend written from scratch, with no transformers model inside (tests/table_model_util.py), that offers
the decoder layers' outputs, the embedding and the LM head runs a head drafter (EAGLE-3) through the
normal engine, losslessly. (Adding a drafter with a parameter, the other half: tests/test_registry.py.)"""

import pytest
import torch

from conftest import tiny_llama
from head_util import save_eagle3_head
from specdraft.api import SpecDecoder
from specdraft.cli import build_parser
from specdraft.core import methods
from specdraft.core.errors import ConfigError
from specdraft.drafters.runs_on import backends as method_backends
from specdraft.models import backends
from specdraft.models.base import Capabilities
from specdraft.models.hf import HFModel
from table_model_util import START, StubTok, TableModel

PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
CHECKED = []  # reports the toy's own check was asked for (doctor)


class ToyModel(HFModel):
    """The toy backend's whole file: the transformers rows under another name, trees only."""

    backend = "toy"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(hidden=False, trees=True, layers=False)


def load_toy(name_or_path, dtype, num_layers):
    inner = tiny_llama(vocab=6)
    model = ToyModel(inner.model, StubTok(), name=name_or_path)
    return model


def check_toy(report):
    CHECKED.append(report)
    return True


def entered(monkeypatch, entry: backends.Backend) -> backends.Backend:
    """``entry`` in the backend table for one test (monkeypatch takes it out again)."""
    assert entry.name not in backends.BACKENDS
    monkeypatch.setitem(backends.BACKENDS, entry.name, entry)
    return entry


@pytest.fixture
def toy(monkeypatch):
    return entered(
        monkeypatch,
        backends.Backend(
            "toy",
            "a toy: transformers rows under another name",
            load_toy,
            uses_dtype=False,
            offers=frozenset({"trees"}),
            paths=("toy",),
            check=check_toy,
        ),
    )


def test_methods_read_what_it_offers(toy):
    runs = {name for name, m in methods.REGISTRY.items() if "toy" in method_backends(m)}
    assert {"plain", "prompt_lookup", "draft_model", "suffix", "token_recycling", "lookahead"} <= runs
    assert not runs & {"medusa", "eagle", "eagle3", "layer_skip", "early_exit"}  # hidden / views: not offered
    assert "toy" not in method_backends(methods.REGISTRY["eagle"]) and "toy" in method_backends(
        methods.REGISTRY["suffix"]
    )


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


def load_table(name_or_path, dtype, num_layers):
    return TableModel(name_or_path)


@pytest.fixture
def table_backend(monkeypatch):
    """The table model entered as a backend offering token trees and decoder layers' outputs."""
    offers = frozenset({"trees", "layers"})
    return entered(monkeypatch, backends.Backend("table", "a table of logits", load_table, False, offers))


def greedy_walk(model: TableModel, prompt: list[int], n: int) -> list[int]:
    """The table's own greedy continuation, without the engine: each next token is the argmax after its pair."""
    toks = list(prompt)
    for _ in range(n):
        prev = toks[-2] if len(toks) > 1 else START
        toks.append(int(model.logit_table[prev, toks[-1]].argmax()))
    return toks[len(prompt) :]


def test_a_head_drafter_runs_on_a_backend_without_transformers(table_backend, tmp_path):
    """EAGLE-3 (chain and dynamic tree) on the table model, through SpecDecoder and the engine: the head
    reads the layer outputs the table hands over, and the output is the table's own greedy one."""
    dec = SpecDecoder.load("table-model", backend="table")
    assert not any(isinstance(v, torch.nn.Module) for v in vars(dec.target).values())  # no model inside
    sp = {"max_new_tokens": 32, "ignore_eos": True}
    plain = greedy_walk(dec.target, PROMPT, 32)
    assert dec.generate(PROMPT, sampling=sp, spec={"method": "plain"}).token_ids == plain
    # an untrained head (tests/head_util.py) whose draft vocabulary is the tokens the table emits: its drafts
    # are right now and then, wrong the rest of the time
    head = str(save_eagle3_head(dec.target, tmp_path / "head", torch.tensor(sorted(set(plain)))))
    tree = {"tree": "dynamic", "tree_topk": 2, "tree_budget": 6}
    for spec in ({"method": "eagle3", "head": head, "k": 3}, {"method": "eagle3", "head": head, "k": 3, **tree}):
        out = dec.generate(PROMPT, sampling=sp, spec=spec)
        assert out.token_ids == plain, spec
        assert 0 < out.stats.accepted < out.stats.drafted, spec  # the head drafted; verification kept some
    assert dec.target.feature_layers == (2, 4, 5)  # EAGLE-3's low, middle and high layers of 8


def test_a_model_not_declaring_its_layers_is_refused_for_eagle3(table_backend, tmp_path):
    """The backend's entry offers layer outputs, but this model does not declare them (Capabilities.layers):
    one clear error naming the model and its backend, not a head drafting on features it never gets."""
    target = TableModel("table-model", layers=False)
    head = str(save_eagle3_head(target, tmp_path / "head"))
    with pytest.raises(ConfigError, match="layer outputs, which table-model on the table backend does not hand over"):
        SpecDecoder(target).generate(PROMPT, sampling={"max_new_tokens": 4}, spec={"method": "eagle3", "head": head})


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
