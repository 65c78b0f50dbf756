"""A reduced soak of the batch server (SmolLM2-135M fp32, prompt lookup and plain): mixed load at two
concurrency levels, every greedy answer against the same request alone, then 24 requests whose
clients leave at random points; afterwards nothing runs, nothing waits, the batch is empty and
resident memory has not grown past a bound. The full figures (16/32/64 clients, 1,000 disconnects)
are in docs/server.md, made by `specdraft loadtest --soak`."""

import pytest

from server_util import running_server
from specdraft.tools.soak import run_soak

pytestmark = [pytest.mark.slow, pytest.mark.long]


def test_reduced_soak(smol_f32, smol_draft4):
    from test_server import decoder

    with running_server(decoder(smol_f32, smol_draft4), max_batch=16, max_queue=256, timeout_s=300) as (url, app):
        out = run_soak(url, None, [8], 8, 24, ["prompt_lookup", "plain", "draft_model"], timeout=300, lengths=(8, 16))
    for row in out["levels"]:
        assert row["completed"] == row["requests"], row
    g = out["greedy"]
    assert g["greedy_checked"] > 0 and g["different"] == 0, g["examples"]
    d = out["disconnects"]
    assert d["errors"] == 0 and d["cut_mid_stream"] > 0, d
    h = out["health_after"]
    assert h["running"] == 0 and h["waiting"] == 0 and h["batch_rows"] == 0, h
    assert h["rss_mb"] - out["after_load"]["rss_mb"] < 150, (out["after_load"], h)
