"""Online learning of the EAGLE-3 head (specdraft/learning): decoding stays lossless while the head's
weights change under the engine every step (greedy token identity, the first two sampled tokens against
the exact distribution); a drafter feeds its context again after a change; weights are swapped only
between steps; the rollback guard undoes a planted bad update; what a finished request teaches; the
training path learns; suffix drafters search the outputs served before; seeded samples say they are not
pinned; an interrupted save never loads; the next start continues from the adapted head; `specdraft heads
reset`; serve's flags, the tenancy rule and the learner's views; the pacer holds its share; and, with the
real training process, greedy identity while updates land and its CPU share within the budget on a busy
loop. Tiny random models only."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import torch

from conftest import tiny_llama
from head_util import head_spec, random_eagle3_head, save_eagle3_head
from specdraft.api import SpecDecoder
from specdraft.cli import main
from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.core.metrics import GenerationStats, StepRecord
from specdraft.drafters.base import NoDrafter
from specdraft.drafters.eagle3 import Eagle3Drafter
from specdraft.engine import StepHook, generate
from specdraft.learning import LearnConfig
from specdraft.learning.learner import Learner, Update, served_sequence
from specdraft.learning.store import AdaptedStore, adapted_root, head_fingerprint, store_name
from specdraft.learning.trainer import HeadTrainer
from specdraft.learning.wire import Verdict
from specdraft.models.heads import load_head
from stat_util import fit_pvalue, sample_first_tokens

V = 64
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
CHAIN = head_spec("eagle3", k=4)
TREE = head_spec("eagle3", tree="dynamic", k=3, tree_topk=3, tree_budget=8)
PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 9, 2, 11, 3], [40, 41, 42]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=V, hidden=32, layers=4)


@pytest.fixture(scope="module")
def head_dir(target, tmp_path_factory):
    return save_eagle3_head(target, tmp_path_factory.mktemp("learn") / "head")


def loaded(target, head_dir):
    return load_head(head_dir, target, expect_type="eagle3")[0]


class Perturb(StepHook):
    """Changes the head's weights between every two steps, as the learner's updates could."""

    def __init__(self, head, scale=0.2, seed=0):
        self.head, self.scale, self.steps = head, scale, 0
        self.g = torch.Generator().manual_seed(seed)

    def after_step(self, rows, finished):
        with torch.no_grad():
            for p in self.head.parameters():
                p.add_(torch.randn(p.shape, generator=self.g) * self.scale)
        self.head.version = getattr(self.head, "version", 0) + 1
        self.steps += 1


# --- lossless while the weights change --------------------------------------------------------------
@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_is_plain_while_the_head_changes_every_step(target, spec):
    head = random_eagle3_head(target, torch.arange(V))
    accepted = 0
    for prompt in PROMPTS:
        hook = Perturb(head)
        out = generate(target, Eagle3Drafter(target, head, spec), prompt, GREEDY, eos_ids=set(), hook=hook)
        ref = generate(target, NoDrafter(), prompt, GREEDY, eos_ids=set())
        assert out.token_ids == ref.token_ids
        assert hook.steps == len(out.stats.steps) > 1
        accepted += out.stats.accepted
    assert accepted > 0  # drafts went through verification


def test_sampling_first_two_tokens_exact_while_the_head_changes_every_step():
    """test_eagle3's first-two-token test, with one head shared by every row and changed after every step."""
    from test_eagle3 import DRAFT_IDS, PROMPT, TRUNC, exact_first_two

    tiny = tiny_llama(vocab=6, hidden=32, layers=4)
    head = random_eagle3_head(tiny, DRAFT_IDS)
    hook = Perturb(head, scale=0.3)
    counts, drafted, accepted = sample_first_tokens(
        tiny, lambda: Eagle3Drafter(tiny, head, CHAIN), PROMPT, TRUNC, 3, 2, 1200, 6, seed0=31_000, hook=hook
    )
    assert 0 < accepted < drafted and hook.steps > 3
    assert fit_pvalue(counts, exact_first_two(tiny, TRUNC)) > 1e-3


def drafts_by_length(target, head, prompt, hook):
    """{len(tokens) when proposed: the chain proposed} over one greedy decode."""
    seen = {}
    d = Eagle3Drafter(target, head, CHAIN)
    real = d.propose

    def propose(tokens, max_tokens):
        tree = real(tokens, max_tokens)
        seen[len(tokens)] = tree.tokens.tolist()
        return tree

    d.propose = propose
    generate(target, d, prompt, GREEDY, eos_ids=set(), hook=hook)
    return seen


def test_a_drafter_feeds_its_context_again_after_the_weights_change(target):
    """After a change, a running request drafts as a request started with the new weights would: its head
    cache of the old weights' keys and values is rebuilt (before, the old cache stayed)."""
    head = random_eagle3_head(target, torch.arange(V))
    new = {
        k: v + 0.3 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
        for k, v in head.state_dict().items()
        if v.is_floating_point()
    }

    class ChangeOnce(StepHook):  # after the third step: the drafter's cache holds positions of the old weights
        steps = 0

        def after_step(self, rows, finished):
            self.steps += 1
            if self.steps == 3:
                head.load_state_dict(new, strict=False)
                head.version = 1
                self.at = len(rows[0].tokens)

    hook = ChangeOnce()
    changed = drafts_by_length(target, head, PROMPTS[0], hook)
    fresh = drafts_by_length(target, head, PROMPTS[0], StepHook())  # the new weights from the start
    later = [n for n in changed if n > hook.at and n in fresh]
    assert later and all(changed[n] == fresh[n] for n in later), (hook.at, changed, fresh)


def test_seeded_samples_of_a_learning_head_say_they_are_not_pinned(target, head_dir):
    """The seed pins a sample only while the drafts do not change with the traffic: with learning on,
    eagle3 (and auto's eagle3 arms) report reproducible false."""
    seeded = {"temperature": 1.0, "seed": 3, "max_new_tokens": 4}
    learning = SpecDecoder(target, learn=LearnConfig(persist=False))
    learning.learner.spawn = False
    learning.set_cost_curves({n: 0.01 * n for n in range(1, 40)})  # auto's: given, not measured
    for spec in ({"method": "eagle3", "head": str(head_dir)}, {"method": "auto", "head": str(head_dir)}):
        assert learning.generate(PROMPTS[0], sampling=seeded, spec=spec).stats.reproducible is False
        assert (
            SpecDecoder(target)
            .generate(PROMPTS[0], sampling=seeded, spec={**spec, "method": "eagle3"})
            .stats.reproducible
            is True
        )


# --- the learner between steps ------------------------------------------------------------------------
def bare_learner(target, head_dir, **cfg):
    """A learner bound to a loaded head, without a training process (updates are planted by the test)."""
    learner = Learner(target, LearnConfig(**{"window": 8, "persist": False, **cfg}), spawn=False)
    head = loaded(target, head_dir)
    learner.adopt(head, str(head_dir))
    return learner, head


def plant(learner, head, version, fn):
    """An update as the training process's reader hands it over."""
    learner._pending = Update(version, {k: fn(p.detach()) for k, p in head.named_parameters()})


def test_weights_are_swapped_only_between_steps(target, head_dir):
    learner, head = bare_learner(target, head_dir, window=1000)  # no verdict in this test
    learner.guard.observe(1000, 500)  # a full window before the update
    before = head.fc.weight.clone()
    plant(learner, head, 1, lambda p: p + 1.0)
    d = Eagle3Drafter(target, head, CHAIN)
    real, unchanged, updated = d.propose, [], []

    def propose(tokens, max_tokens):  # inside a step
        w = head.fc.weight.clone()
        learner.after_step([], [])  # as another thread's loop would, while this step runs
        unchanged.append(torch.equal(head.fc.weight, w))
        updated.append(torch.equal(w, before + 1.0))
        return real(tokens, max_tokens)

    d.propose = propose
    out = generate(target, d, PROMPTS[0], GREEDY, eos_ids=set(), hook=learner)
    assert all(unchanged) and updated[0] is False and all(updated[1:]) and learner.status().updates == 1
    assert out.token_ids == generate(target, NoDrafter(), PROMPTS[0], GREEDY, eos_ids=set()).token_ids
    with learner.stepping(), pytest.raises(RuntimeError, match="only between engine steps"):
        learner._swap({k: p.detach() for k, p in head.named_parameters()})


class Row:
    """What the learner reads of an engine row (engine.Request)."""

    def __init__(self, drafter, tokens, n_prompt):
        self.drafter, self.tokens, self.prompt_ids, self.output = drafter, tokens, tokens[:n_prompt], tokens[n_prompt:]
        self.stats, self.error, self.tag = GenerationStats(), None, None


def test_the_rollback_guard_undoes_a_planted_bad_update(target, head_dir):
    learner, head = bare_learner(target, head_dir, window=20, max_drop=0.05)
    row = Row(Eagle3Drafter(target, head, CHAIN), list(range(10)), 5)
    original = {k: p.detach().clone() for k, p in head.named_parameters()}

    def steps(n, accepted):  # n steps of 4 drafted tokens
        for _ in range(n):
            row.stats.steps.append(StepRecord(4, accepted, accepted + 1))
            learner.after_step([row], [])

    steps(5, 3)  # 0.75 before
    plant(learner, head, 1, torch.zeros_like)  # a planted bad update
    steps(1, 3)
    assert learner.status().updates == 1 and float(head.fc.weight.abs().sum()) == 0.0
    steps(5, 1)  # 0.25 after it
    assert learner.status().rollbacks == 1
    assert all(torch.equal(p, original[k]) for k, p in head.named_parameters())
    assert learner._control.get(timeout=10) == Verdict(1, False)
    steps(5, 3)  # a window of the restored weights, then a harmless update is kept
    plant(learner, head, 2, lambda p: p * 1.001)
    steps(6, 3)
    s = learner.status()
    assert (s.updates, s.kept, s.rollbacks) == (2, 1, 1) and learner._control.get(timeout=10) == Verdict(2, True)


def test_what_a_finished_request_teaches(target):
    """The last max_len tokens, the features of their positions but the last, their embeddings, the prompt's
    share; nothing from a request with no answer to learn or no features."""
    tokens, feats = list(range(30)), torch.arange(29 * 3.0).reshape(29, 3)
    seq = served_sequence(tokens, 20, feats, target, max_len=16)
    assert seq.tokens.tolist() == tokens[14:] and seq.n_prompt == 6
    assert torch.equal(seq.feats.tensor(), feats[14:29])
    assert torch.equal(seq.embeds.tensor(), target.embed(torch.tensor(tokens[14:])))
    assert served_sequence(tokens, 29, feats, target, 16) is None  # one answer token: nothing to learn
    assert served_sequence(tokens, 20, feats[:3], target, 16) is None  # cancelled before its first step


def test_the_trainer_learns_from_served_sequences(target, head_dir):
    """The replay buffer's embeddings are the target's; the training-time test's loss falls on what it holds."""
    head = loaded(target, head_dir)
    cfg = LearnConfig(lr=3e-3, batch_size=2, max_len=40, buffer_tokens=200, seed=1)
    tr = HeadTrainer(head.shape, head.state_dict(), cfg)
    g = torch.Generator().manual_seed(3)
    for _ in range(6):  # a buffer of 200 tokens keeps the last 5 sequences of 40
        toks = torch.randint(0, V, (40,), generator=g).tolist()
        feats = torch.randn(39, tr.buffer.width, generator=g)
        tr.buffer.add(served_sequence(toks, 10, feats, target, cfg.max_len))
    assert len(tr.buffer) == 5 and tr.buffer.n_tokens == 200
    ids = torch.tensor([[3, 0, 5], [9, 9, 1]])
    lookup = tr.buffer.embedding([0, 1, 2, 3, 4])
    seen = torch.isin(ids, torch.cat(tr.buffer.tokens))
    assert torch.allclose(lookup(ids)[seen], target.embed(ids)[seen].float())
    losses = [tr.step().loss for _ in range(30)]
    assert sum(losses[-5:]) < 0.9 * sum(losses[:5]), losses


def test_suffix_drafts_from_the_outputs_served_before(target):
    """On a decoder that learns, the suffix drafter also searches the outputs served lately: a request that
    repeats an earlier one drafts its answer from it (before, only from its own prompt); its seeded samples
    say they are not reproducible; a request that may not teach adds nothing."""
    spec = {"method": "suffix", "k": 8}
    plain = SpecDecoder(target)
    learning = SpecDecoder(target, learn=LearnConfig(persist=False))
    prompt = [35, 62, 11, 50, 55, 28]  # a greedy answer that does not repeat itself (19 drafts accepted vs 1)
    first = learning.generate(prompt, sampling=GREEDY, spec=spec)
    learning.learner.served.wait()  # its snapshot is built beside the serving loop
    again = learning.generate(prompt, sampling=GREEDY, spec=spec)
    alone = plain.generate(prompt, sampling=GREEDY, spec=spec)
    assert again.token_ids == first.token_ids == alone.token_ids
    assert again.stats.accepted >= 15 and alone.stats.accepted <= 5, (again.stats.accepted, alone.stats.accepted)
    assert learning.learner.status().served_tokens == 2 * (GREEDY.max_new_tokens + 1)
    learning.learner.served.wait()
    seeded = {"temperature": 1.0, "seed": 3, "max_new_tokens": 4}
    assert learning.generate(prompt, sampling=seeded, spec=spec).stats.reproducible is False
    assert plain.generate(prompt, sampling=seeded, spec=spec).stats.reproducible is True
    n = learning.learner.status().served_tokens
    untaught = Row(NoDrafter(), prompt + [1, 2, 3], len(prompt))
    untaught.tag = type("Job", (), {"learn": False})()
    learning.learner.after_step([], [untaught])
    assert learning.learner.status().served_tokens == n


# --- the adapted head on disk -------------------------------------------------------------------------
def test_an_interrupted_save_never_loads(target, head_dir, tmp_path, monkeypatch):
    from specdraft.models import head_formats

    head = loaded(target, head_dir)
    store = AdaptedStore(tmp_path / "adapted" / "x")
    assert store.load(target.facts.num_layers) is None
    state = head.state_dict()
    store.save(head.shape, state, {"type": "eagle3"}, torch.float32)
    v1 = store.current()
    bumped = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}
    real_write = head_formats.write

    def crash_after_the_weights(out, shape, st, *a, **kw):  # the weights file written, then the process dies
        real_write(out, shape, st, *a, **kw)
        (out / "config.json").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(head_formats, "write", crash_after_the_weights)
    with pytest.raises(KeyboardInterrupt):
        store.save(head.shape, bumped, {"type": "eagle3"}, torch.float32)
    monkeypatch.setattr(head_formats, "write", real_write)
    monkeypatch.setattr(AdaptedStore, "_point_to", lambda self, rel: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):  # a whole version written, the pointer not moved yet
        store.save(head.shape, bumped, {"type": "eagle3"}, torch.float32)
    monkeypatch.undo()
    assert store.current() == v1
    ck = store.load(target.facts.num_layers)
    assert all(torch.equal(ck.state[k], v) for k, v in state.items())
    assert store.save(head.shape, bumped, {"type": "eagle3"}, torch.float32).name == "000003"  # after the orphan
    assert torch.equal(store.load(target.facts.num_layers).state["fc.weight"], bumped["fc.weight"])


def test_the_next_start_continues_from_the_adapted_head(target, head_dir, tmp_path, caplog):
    head = loaded(target, head_dir)
    root = adapted_root(tmp_path) / store_name(target.name, head_fingerprint(head_dir))
    adapted = {k: v * 0.5 if v.is_floating_point() else v for k, v in head.state_dict().items()}
    AdaptedStore(root).save(head.shape, adapted, {"type": "eagle3"}, torch.float32)
    learner = Learner(target, LearnConfig(), home=tmp_path, spawn=False)
    with caplog.at_level(logging.WARNING, logger="specdraft.learning"):
        learner.adopt(head, str(head_dir))
    assert torch.equal(head.fc.weight, adapted["fc.weight"])
    assert "continuing from the adapted head" in caplog.text and learner.status().adapted.endswith("000001")


def test_heads_reset_returns_to_the_shipped_heads(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDRAFT_HOME", str(tmp_path))
    root = adapted_root()
    for name in ("tiny-0-" + "a" * 16, "tiny-0-" + "b" * 16, "tiny-01-" + "c" * 16, "other-" + "d" * 16):
        (root / name / "versions").mkdir(parents=True)
    assert main(["heads", "reset", "--target", "tiny-0"]) == 0
    assert sorted(p.name for p in root.iterdir()) == ["other-" + "d" * 16, "tiny-01-" + "c" * 16]
    assert "2 adapted head(s) of tiny-0 removed" in capsys.readouterr().err
    assert main(["heads", "reset"]) == 0 and list(root.iterdir()) == []


# --- the server ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--learn-budget", "0.5"], "--learn-budget set how the server learns; add --learn"),
        (["--learn", "--learn-budget", "0"], "budget (--learn-budget) must be a share of the CPU in (0, 1]"),
        (["--learn", "--api-key", "a", "--api-key", "b"], "with several API keys, --learn learns only from"),
        (["--learn", "--stream-mode", "fixed"], "this server has no --api-key"),
        (["--learn", "--api-key", "a", "--learn-keys", "a,c"], "1 key(s) that are not among"),
        (["--learn", "--replicas", "2"], "each replica would learn a head of its own"),
        (["--learn", "--api-key", "a", "--api-key", "b", "--learn-keys", ","], "--learn-keys names no key"),
    ],
)
def test_serve_refuses_learning_it_cannot_do_as_asked(argv, fragment, capsys):
    assert main(["serve", "--target", "nowhere", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and fragment in err and "\n" not in err, err


def test_serve_loads_a_learning_decoder(tmp_path):
    """`serve --learn`'s settings reach the decoder it loads (they did not: ModelSettings.load refused them)."""
    from conftest import tiny_model_dir
    from specdraft.api import ModelSettings

    d = tiny_model_dir(tmp_path / "tiny")
    dec = ModelSettings(target=str(d), backend="hf", dtype="float32").load(learn=LearnConfig(budget=0.5))
    assert dec.learner is not None and dec.learner.cfg.budget == 0.5
    assert ModelSettings(target=str(d), backend="hf", dtype="float32").load().learner is None


def test_the_server_learns_from_the_keys_it_names_and_shows_the_learner(target, head_dir):
    """Two keys, learning from one: both are served, only the named key's requests reach the learner;
    /health, /metrics and /v1/specdraft/learning show its state."""
    import httpx

    from server_util import metric_samples, running_server
    from test_server_fast import StubTok

    served = tiny_llama(vocab=V, hidden=32, layers=4)  # the fixture's weights, with a tokenizer
    served.tokenizer = StubTok()
    dec = SpecDecoder(served, learn=LearnConfig(persist=False, window=8))
    dec.learner.spawn = False
    with running_server(
        dec,
        model_name="tiny",
        default_spec={"method": "eagle3", "head": str(head_dir), "k": 3},
        api_key=("teach", "other"),
        learn_keys=("teach",),
    ) as (url, _):
        assert dec.learner.status().state == "learning"  # the default spec's head was loaded at start
        for key in ("teach", "other", "other"):
            r = httpx.post(
                url + "/v1/completions",
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
                json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True},
            )
            assert r.status_code == 200, r.text
        assert (
            httpx.post(
                url + "/v1/completions", headers={"Authorization": "Bearer nope"}, json={"prompt": [1], "max_tokens": 1}
            ).status_code
            == 401
        )
        auth = {"Authorization": "Bearer other"}
        health = httpx.get(url + "/health", headers=auth).json()["learning"]
        assert health["sequences_sent"] == 1 and health["state"] == "learning"
        samples = metric_samples(httpx.get(url + "/metrics", headers=auth).text)
        assert samples[("specdraft_learn_sequences_total", (("outcome", "sent"),))] == 1.0
        assert samples[("specdraft_learn_acceptance", ())] == (health["acceptance"] or 0.0)
        view = httpx.get(url + "/v1/specdraft/learning", headers=auth).json()
        assert view["learning"] is True and view["window"] == 8 and isinstance(view["curve"], list)


# --- the real training process ------------------------------------------------------------------------
def test_the_pacer_keeps_work_within_its_share():
    """Busy work in the pacer's hands (a spinning loop, as a training process with always something to learn)
    uses at most its share of one CPU: it sleeps after each piece (before, nothing held it back)."""
    from specdraft.learning.process import Pacer

    pacer = Pacer(0.25, cpus=1)
    c0, t0 = time.process_time(), time.monotonic()
    while time.monotonic() - t0 < 1.5:
        with pacer.work():
            end = time.process_time() + 0.01
            while time.process_time() < end:
                pass
    share = (time.process_time() - c0) / (time.monotonic() - t0)
    assert share <= 0.25 * 1.15, share
    assert abs(pacer.share() - share) < 0.05


def test_learning_while_serving_is_lossless_and_stays_within_its_budget(target, head_dir, tmp_path, monkeypatch):
    """The spawned training process learns while requests decode back to back (a busy server); updates land
    in the head between steps, greedy output stays plain decoding's, and the process's CPU time stays
    within --learn-budget of the machine's (measured from its first optimizer step, bounded in time). It
    starts at normal priority and then runs at nice 19: here other processes keep both cores busy, so its
    share is far below the budget; test_the_pacer_keeps_work_within_its_share shows the pacing itself."""
    import psutil

    monkeypatch.setenv("SPECDRAFT_HOME", str(tmp_path))
    budget = 0.25
    cfg = LearnConfig(
        budget=budget, publish_every=2, window=8, max_drop=1.0, batch_size=2, max_len=64, buffer_tokens=1024, reuse=1000
    )
    dec = SpecDecoder(target, learn=cfg)
    spec = {"method": "eagle3", "head": str(head_dir), "k": 3}
    try:
        dec.head(SpecConfig.from_dict(spec))
        proc = psutil.Process(dec.learner._proc.pid)
        t0 = time.monotonic()
        measured, i = None, 0
        while time.monotonic() - t0 < 60:
            prompt = [(i * 7 + j) % V for j in range(6)]
            out = dec.generate(prompt, sampling=GREEDY, spec=spec)
            assert out.token_ids == generate(target, NoDrafter(), prompt, GREEDY, eos_ids=set()).token_ids
            i += 1
            s = dec.learner.status()
            if measured is None and s.progress.steps:
                measured = (time.monotonic(), sum(proc.cpu_times()[:2]))
            if measured and s.progress.saved_version and time.monotonic() - measured[0] > 5:
                break
        assert s.state == "learning" and s.kept >= 1, s
        wall = time.monotonic() - measured[0]
        share = (sum(proc.cpu_times()[:2]) - measured[1]) / (wall * len(os.sched_getaffinity(0)))
        assert share <= budget * 1.2 + 0.02, (share, wall, s.progress)
        assert s.progress.saved_path and (tmp_path / "adapted").is_dir()
        print(
            json.dumps(
                {
                    "cpu_share": round(share, 3),
                    "measured_s": round(wall, 1),
                    "requests": i,
                    "updates": s.updates,
                    "steps": s.progress.steps,
                }
            )
        )
    finally:
        dec.close()
