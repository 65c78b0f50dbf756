"""What `specdraft train` keeps in -o DIR, and the head directories it makes, against damage and planted
files (tiny target): EAGLE-3's appended data keeps every complete row after a torn line; no file there is
unpickled into code; --resume after a run stopped between the checkpoint's renames ends as an
uninterrupted run; bad head directories, prompt files, --device and checkpoints give one error line."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_model_dir
from specdraft.cli import main
from specdraft.commands.train.eagle3_data import current_features
from specdraft.commands.train.eagle3_ttt import Eagle3Data
from specdraft.core.errors import SpecDraftError
from specdraft.core.jsonl import AppendedJsonl
from specdraft.core.prompts import load_prompts
from test_heads import PROMPTS, train, write_prompts


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny_target"))


def one_error(capsys, args) -> str:
    """The CLI's answer to bad input: exit 2 and one line ``error: ...`` (no traceback); -> that line."""
    capsys.readouterr()
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "Traceback" not in err and len(lines) == 1 and err.rstrip().endswith(lines[0]), err
    return lines[0]


# --- appended jsonl files ---------------------------------------------------------------------------
def test_appended_jsonl_cuts_a_torn_last_line(tmp_path):
    f = tmp_path / "a.jsonl"
    log = AppendedJsonl(f, need=("i",))
    assert log.rows == []
    log.append([{"i": 0}, {"i": 1}])
    f.write_bytes(f.read_bytes() + b'{"i": 2, "tok')  # a run stopped mid-write
    log = AppendedJsonl(f, need=("i",))
    assert log.rows == [{"i": 0}, {"i": 1}]
    log.append([{"i": 2}, {"i": 3}])
    assert AppendedJsonl(f).rows == [{"i": 0}, {"i": 1}, {"i": 2}, {"i": 3}] == log.rows
    f.write_bytes(b'{"i": 0}\n{"i": 1, "tok{"i": 2}\n{"i": 3}\n')  # damage inside: not an append's
    with pytest.raises(SpecDraftError, match=r"a.jsonl:2: not valid JSON"):
        AppendedJsonl(f)
    f.write_bytes(b'{"i": 0}\n{"j": 1}\n')
    with pytest.raises(SpecDraftError, match=r"a.jsonl:2: no i "):
        AppendedJsonl(f, need=("i",))


def eagle3(tiny_dir, data, out, steps=2, *extra):
    return [
        "train",
        "eagle3",
        "--target",
        tiny_dir,
        "--data",
        data,
        "-o",
        out,
        "--steps",
        steps,
        "--threads",
        1,
        "--max-new-tokens",
        8,
        "--gen-backend",
        "hf",
        "--intermediate-size",
        32,
        "--draft-vocab",
        300,
        "--ttt-steps",
        2,
        "--checkpoint-every",
        2,
        "--gen-batch",
        2,
        "--device",
        "cpu",
        *extra,
    ]


def cut_in_row(f, row: int) -> None:
    """``f`` cut in the middle of line ``row`` (0-based): what a stopped run, or a full disk, leaves."""
    lines = f.read_bytes().split(b"\n")
    f.write_bytes(b"\n".join(lines[:row]) + b"\n" + lines[row][: len(lines[row]) // 2])


@pytest.mark.parametrize("torn", ["answers.jsonl", "features.jsonl"])
def test_eagle3_data_torn_then_rerun_keeps_every_row(tmp_path, tiny_dir, torn):
    data, out = write_prompts(tmp_path / "p.jsonl"), tmp_path / "head"
    args = [str(a) for a in eagle3(tiny_dir, data, out)]
    assert main(args) == 0
    d = out / "data"
    cut_in_row(d / torn, 2)
    assert main(args) == 0  # made again: the rows after the torn one are read, training runs
    answers = AppendedJsonl(d / "answers.jsonl").rows
    assert sorted(r["i"] for r in answers) == list(range(len(PROMPTS)))
    assert len(Eagle3Data(d, 3 * 32)) == len(PROMPTS)  # every sequence is trained on
    feats = current_features(AppendedJsonl(d / "features.jsonl").rows, {r["i"]: r for r in answers})
    assert sorted(feats) == list(range(len(PROMPTS)))
    before = {f.name: f.read_bytes() for f in d.iterdir()}
    assert main(args) == 0  # nothing is made again
    assert {f.name: f.read_bytes() for f in d.iterdir()} == before


def test_eagle3_features_of_a_changed_answer_are_made_again(tmp_path, tiny_dir):
    """An answer lost with a torn line is made again and can come out different: its old features no longer
    belong to it."""
    data, out = write_prompts(tmp_path / "p.jsonl", PROMPTS[:2]), tmp_path / "head"
    args = [str(a) for a in eagle3(tiny_dir, data, out, 2, "--data-only")]
    assert main(args) == 0
    f = out / "data" / "answers.jsonl"
    rows = AppendedJsonl(f).rows
    rows[1]["tokens"][-1] = (rows[1]["tokens"][-1] + 1) % 300
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(args) == 0
    index = AppendedJsonl(out / "data" / "features.jsonl").rows
    assert [r["i"] for r in index] == [0, 1, 1]
    assert current_features(index, {r["i"]: r for r in rows})[1] is index[2]


def _features_by_answer(d):
    """Answer i -> its current features (bf16 rows of features.bin, as float32)."""
    rows = {r["i"]: r for r in AppendedJsonl(d / "answers.jsonl").rows}
    index = current_features(AppendedJsonl(d / "features.jsonl").rows, rows)
    flat = torch.frombuffer(bytearray((d / "features.bin").read_bytes()), dtype=torch.bfloat16).float()
    n_rows = sum(r["n"] for r in AppendedJsonl(d / "features.jsonl").rows)
    width = flat.numel() // n_rows
    table = flat.view(-1, width)
    return {i: table[r["row"] : r["row"] + r["n"]] for i, r in index.items()}


def test_eagle3_token_ids_alone_get_their_features_from_a_prefill(tmp_path, tiny_dir):
    """A new machine given only the prompts and answers as token ids (what the repository keeps): the rerun
    answers nothing again and makes every answer's features, those made while answering."""
    data, out = write_prompts(tmp_path / "p.jsonl", PROMPTS[:3]), tmp_path / "head"
    args = [str(a) for a in eagle3(tiny_dir, data, out, 2, "--data-only")]
    assert main(args) == 0
    d = out / "data"
    answers = (d / "answers.jsonl").read_text()
    before = _features_by_answer(d)
    (d / "features.jsonl").unlink()
    (d / "features.bin").unlink()
    assert main(args) == 0
    assert (d / "answers.jsonl").read_text() == answers  # no answer made again
    after = _features_by_answer(d)
    assert sorted(after) == sorted(before) and len(before) == 3
    for i, x in before.items():
        torch.testing.assert_close(after[i], x, atol=2e-2, rtol=2e-2)  # bf16 rows, prefill vs step by step


# --- nothing in -o DIR is unpickled into code ----------------------------------------------------------
class Planted:
    """A pickle that runs a shell command when loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_planted_pickles_do_not_run(tmp_path, tiny_dir, capsys):
    data, out, marker = write_prompts(tmp_path / "p.jsonl", PROMPTS[:2]), tmp_path / "head", tmp_path / "ran"
    out.mkdir()
    torch.save(Planted(marker), out / "data.pt")
    common = ["--max-new-tokens", 4, "--batch-size", 8, "--heads", 2, "--threads", 1]
    args = ["train", "medusa", "--target", tiny_dir, "--data", data, "-o", out, "--steps", 1, *common]
    assert "could run code" in one_error(capsys, args)
    (out / "data.pt").unlink()
    assert main([str(a) for a in args]) == 0
    torch.save({"weights": Planted(marker), "step": 1}, out / "train_state.pt")
    assert "could run code" in one_error(capsys, args[: -len(common) - 2] + ["--steps", 2, "--resume", *common])
    assert not marker.exists()


# --- --resume after a run stopped between the checkpoint's renames ---------------------------------------
class Stopped(Exception):
    pass


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("medusa", ["--batch-size", 16, "--heads", 2, "--lr", 1e-2]),
        ("eagle", ["--batch-size", 1, "--lr", 3e-3, "--draft-vocab", 300]),
    ],
)
def test_resume_after_a_stop_between_renames_equals_an_uninterrupted_run(tmp_path, tiny_dir, monkeypatch, kind, extra):
    """Stopped at step 9 after head.safetensors was renamed into place and before train_state.pt was: the
    directory holds step 9's head and step 6's training state. --resume to 12 ends where 12 straight steps do."""
    data = write_prompts(tmp_path / "p.jsonl")
    common = ["--max-new-tokens", 12, "--checkpoint-every", 3, *extra]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train(kind, tiny_dir, data, straight, 12, *common)
    stopped.mkdir()
    shutil.copy(straight / "data.pt", stopped / "data.pt")
    real, renames = type(stopped).replace, []

    def replace(self, target):
        if self.name == "train_state.pt.tmp":
            renames.append(self)
            if len(renames) == 3:  # step 9's
                raise Stopped
        return real(self, target)

    with monkeypatch.context() as m:
        m.setattr(type(stopped), "replace", replace)
        with pytest.raises(Stopped):
            train(kind, tiny_dir, data, stopped, 9, *common)
    assert json.loads((stopped / "config.json").read_text())["step"] == 9
    assert train(kind, tiny_dir, data, stopped, 12, *common, "--resume")["step"] == 12
    a, b = load_file(str(straight / "head.safetensors")), load_file(str(stopped / "head.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


# --- bad head directories, prompt files, options, checkpoints: one error line ------------------------------
@pytest.fixture(scope="module")
def heads(tmp_path_factory, tiny_dir):
    """{"eagle": DIR, "eagle3": DIR}: heads trained one step on the tiny target."""
    d = tmp_path_factory.mktemp("heads")
    data = write_prompts(d / "p.jsonl", PROMPTS[:2])
    train("eagle", tiny_dir, data, d / "eagle", 1, "--max-new-tokens", 4, "--batch-size", 1, "--draft-vocab", 300)
    assert main([str(a) for a in eagle3(tiny_dir, data, d / "eagle3", 1)]) == 0
    return {"eagle": d / "eagle", "eagle3": d / "eagle3", "data": data}


def edit_config(d, **fields):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in fields.items():
        if v is None:
            del cfg[k]
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def edit_aux(d, ids):
    cfg = json.loads((d / "config.json").read_text())
    cfg["specdraft"]["aux_layers"] = ids
    (d / "config.json").write_text(json.dumps(cfg))


def past_vocab(d):
    st = load_file(str(d / "head.safetensors"))
    st["draft_ids"][-1] = 10**6
    save_file(st, str(d / "head.safetensors"))


BAD_HEADS = {  # kind, damage, what the error says
    "config random bytes": ("eagle", lambda d: (d / "config.json").write_bytes(bytes(range(256))), "not UTF-8"),
    "config a directory": (
        "eagle",
        lambda d: ((d / "config.json").unlink(), (d / "config.json").mkdir()),
        "needs config.json",
    ),
    "weights truncated": (
        "eagle",
        lambda d: (d / "head.safetensors").write_bytes((d / "head.safetensors").read_bytes()[:1000]),
        "holds no head weights",
    ),
    "weights /etc/passwd": (
        "eagle",
        lambda d: ((d / "head.safetensors").unlink(), (d / "head.safetensors").symlink_to("/etc/passwd")),
        "holds no head weights",
    ),
    "draft_vocab -1": ("eagle", lambda d: edit_config(d, draft_vocab=-1), "draft_vocab must be an integer >= 1"),
    "draft_vocab missing": (  # the full vocabulary is then assumed: the weights' shape says otherwise
        "eagle3",
        lambda d: edit_config(d, draft_vocab_size=None),
        "lm_head.weight has shape [300, 32], its config needs [49152, 32]",
    ),
    "layers abc": ("eagle3", lambda d: edit_aux(d, "abc"), "aux layer ids must be a list of 3 integers"),
    "layers past the target": ("eagle3", lambda d: edit_aux(d, [1, 2, 9]), "target of 2 layers does not have"),
    "draft ids past the vocabulary": ("eagle", past_vocab, "not ascending ids of the target's 49152 tokens"),
}


@pytest.mark.parametrize("case", list(BAD_HEADS))
def test_bad_head_directory_is_one_error_line(tmp_path, tiny_dir, heads, capsys, case):
    kind, damage, says = BAD_HEADS[case]
    d = tmp_path / "head"
    shutil.copytree(heads[kind], d, ignore=shutil.ignore_patterns("data*"))
    damage(d)
    args = [
        "generate",
        "--target",
        tiny_dir,
        "--dtype",
        "float32",
        "--method",
        kind,
        "--head",
        d,
        "--max-new-tokens",
        2,
        "hi",
    ]
    assert says in one_error(capsys, args)


RESUME_DAMAGE = {
    "train_state torn": (
        lambda d: (d / "train_state.pt").write_bytes((d / "train_state.pt").read_bytes()[:500]),
        "training state",
    ),
    "train_state of another version": (
        lambda d: torch.save({"optimizer": {}, "step": 1}, d / "train_state.pt"),
        "not a checkpoint of this specdraft version",
    ),
    "config not JSON": (lambda d: (d / "config.json").write_text("{not json"), "not valid JSON"),
    "config of no head type": (lambda d: edit_config(d, architectures=None), "no valid head type"),
}


@pytest.mark.parametrize("case", list(RESUME_DAMAGE))
def test_resume_from_a_damaged_checkpoint_is_one_error_line(tmp_path, tiny_dir, heads, capsys, case):
    damage, says = RESUME_DAMAGE[case]
    d = tmp_path / "head"
    shutil.copytree(heads["eagle3"], d)
    damage(d)
    assert says in one_error(capsys, eagle3(tiny_dir, heads["data"], d, 2, "--resume"))


@pytest.mark.parametrize("device", ["banana", "cuda:x", "cpu:1", "meta"])
def test_eagle3_bad_device_is_one_error_line(tmp_path, tiny_dir, capsys, device):
    data = write_prompts(tmp_path / "p.jsonl", PROMPTS[:1])
    args = eagle3(tiny_dir, data, tmp_path / "head")[:-2] + ["--device", device]
    assert "--device must be cpu, cuda, cuda:N or auto" in one_error(capsys, args)
    assert not (tmp_path / "head").exists()  # refused before anything loads


HOSTILE_PROMPTS = {
    "not UTF-8": (b'{"prompt": "caf\xe9"}\n', "not UTF-8"),
    "lone surrogate": (b'{"prompt": "a\\ud800b"}\n', "lone surrogate"),
    "deep nesting": (b'{"prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "nested too deeply"),
}


@pytest.mark.parametrize("case", list(HOSTILE_PROMPTS))
def test_hostile_prompt_files_are_one_error_line(tmp_path, tiny_dir, capsys, case):
    raw, says = HOSTILE_PROMPTS[case]
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'{"prompt": "fine"}\n' + raw)
    with pytest.raises(SpecDraftError, match=f"p.jsonl:2: .*{says}"):
        load_prompts(f)
    assert says in one_error(capsys, ["train", "medusa", "--target", tiny_dir, "--data", f, "-o", tmp_path / "h"])
    f.write_bytes(b'{"prompt": "a \\ud83d\\ude00 pair"}\n')  # an escaped pair is fine
    assert load_prompts(f)[0]["prompt"] == "a \U0001f600 pair"


def test_eagle3_train_only_trains_on_the_data_as_it_is(tmp_path, tiny_dir, capsys):
    """--data-only makes the data (a job of its own), --train-only trains on what DIR/data holds then and
    makes none; giving it a prompt source is one error line."""
    data, out = write_prompts(tmp_path / "p.jsonl", PROMPTS[:3]), tmp_path / "head"
    assert main([str(a) for a in eagle3(tiny_dir, data, out, 2, "--data-only")]) == 0
    before = {f.name: f.read_bytes() for f in (out / "data").iterdir()}
    train_only = [str(a) for a in eagle3(tiny_dir, data, out, 2)]
    i = train_only.index("--data")
    del train_only[i : i + 2]
    assert main(train_only + ["--train-only"]) == 0
    assert json.loads((out / "config.json").read_text())["specdraft"]["step"] == 2
    assert {f.name: f.read_bytes() for f in (out / "data").iterdir()} == before  # nothing made
    assert "--train-only trains on -o DIR/data as it is" in one_error(
        capsys, eagle3(tiny_dir, data, out, 2, "--train-only")
    )


def test_eagle3_threads_are_the_threads_asked(tmp_path, tiny_dir):
    """--threads sets the threads the data and training run on (llama.cpp's follow torch's)."""
    was = torch.get_num_threads()
    try:
        args = [
            str(a)
            for a in eagle3(
                tiny_dir, write_prompts(tmp_path / "p.jsonl", PROMPTS[:1]), tmp_path / "h", 1, "--data-only"
            )
        ]
        args[args.index("--threads") + 1] = "2"
        assert main(args) == 0 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(was)
