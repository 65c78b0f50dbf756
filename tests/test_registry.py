"""Adding a drafter is one drafter class plus one registry entry (docs/design.md, "Adding a drafter"):
a toy drafter registered at runtime is validated, decoded (greedy output = plain decoding), offered by
the CLI, admitted by the server and run by the bench, with no other change."""

import httpx
import pytest

from conftest import tiny_llama
from server_util import running_server
from specdraft import methods
from specdraft.api import SpecDecoder
from specdraft.cli import build_parser
from specdraft.config import SpecConfig
from specdraft.drafters.base import Drafter
from specdraft.errors import ConfigError
from specdraft.tree import DraftTree

PROMPT = [1, 2, 3, 3, 3]


class RepeatLastDrafter(Drafter):
    """Drafts the last token k times (the worked example of docs/design.md)."""

    name = "repeat_last"

    def __init__(self, spec):
        self.k = spec.k

    def max_draft_depth(self):
        return self.k

    def propose(self, tokens, max_tokens):
        return DraftTree.chain([tokens[-1]] * min(self.k, max_tokens))


@pytest.fixture
def repeat_last():
    assert "repeat_last" not in methods.REGISTRY
    methods.REGISTRY["repeat_last"] = methods.Method(
        "repeat_last", "draft the last token k times (a toy)", lambda dec, spec: RepeatLastDrafter(spec))
    try:
        yield
    finally:
        del methods.REGISTRY["repeat_last"]


class StubTok:
    """Token i decodes to chr(ord('a') + i) (the server decodes completions)."""

    chat_template = None
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + int(i)) for i in ids)


@pytest.fixture(scope="module")
def dec():
    target = tiny_llama(vocab=6)
    target.tokenizer = StubTok()
    return SpecDecoder(target, None)


def test_config_reads_the_registry(repeat_last):
    assert SpecConfig.from_dict({"method": "repeat_last", "k": 3, "schedule": "cost_aware"}).method == "repeat_last"
    # the entry's defaults: chains only, no heuristic schedule, needs nothing
    with pytest.raises(ConfigError, match="tree='static' is for methods draft_model, layer_skip"):
        SpecConfig(method="repeat_last", tree="static").validate()
    with pytest.raises(ConfigError, match="schedule 'heuristic' is not available for method 'repeat_last'"):
        SpecConfig(method="repeat_last", schedule="heuristic").validate()
    with pytest.raises(ConfigError, match="head is used by methods medusa and eagle only, not 'repeat_last'"):
        SpecConfig(method="repeat_last", head="h").validate()


def test_unregistered_is_unknown():
    with pytest.raises(ConfigError, match="unknown method 'repeat_last'; choose one of: plain, draft_model"):
        SpecConfig(method="repeat_last").validate()


def test_greedy_output_equals_plain(repeat_last, dec):
    sp = {"max_new_tokens": 16, "ignore_eos": True}
    plain = dec.generate(PROMPT, sampling=sp, spec={"method": "plain"})
    out = dec.generate(PROMPT, sampling=sp, spec={"method": "repeat_last", "k": 3})
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted > 0


def test_cli_offers_it(repeat_last):
    p = build_parser()
    a = p.parse_args(["generate", "--method", "repeat_last", "hi"])
    assert a.method == "repeat_last"
    assert "repeat_last: draft the last token k times (a toy)" in methods.help_text()
    assert "repeat_last" in p._subparsers._group_actions[0].choices["generate"].format_help()  # --method's help


def test_server_admits_it(repeat_last, dec):
    with running_server(dec, model_name="tiny", default_spec={"method": "plain"}) as (url, app):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        plain = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        r = httpx.post(url + "/v1/completions", json={**body, "spec": {"method": "repeat_last", "k": 2}}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["method"] == "repeat_last"
        assert r.json()["choices"][0]["text"] == plain["choices"][0]["text"]


def test_bench_takes_it(repeat_last):
    from specdraft.bench.harness import BenchOptions, build_variants

    opts = BenchOptions(k=3, sweep=[], methods="plain,repeat_last")
    assert [(n, k) for n, k, _ in build_variants(opts, {})] == [("plain", "plain"), ("repeat_last", "repeat_last")]
