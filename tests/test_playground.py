"""The playground page (GET /) in a real browser: Debian's Chromium, headless, driven by Selenium
(scripts/install_browser.sh installs it; `make test` runs that first). A live `specdraft serve` on
SmolLM2-135M: the page's greedy answer is the API's, its accepted-coloured tokens are usage's
accepted count, a race shows both columns and marks identical greedy texts, and a bad request shows
the server's error. A second, in-process server on a tiny model checks the API-key prompt.

SPECDRAFT_SCREENSHOT=docs/playground.png saves the finished race's screenshot there (docs/ keeps one)."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_util import free_port, running_server, wait_until

pytestmark = pytest.mark.slow

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef add3(a, b, c):\n    return"
MAX_TOKENS = 24


def _browser():
    """A headless Chromium through chromedriver, or one clear failure line saying why not."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as e:
        pytest.fail(
            f"browser test: selenium is not installed ({e}); run `make setup` (requirements.txt pins it)", pytrace=False
        )
    chrome, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chrome or not driver:
        pytest.fail(
            "browser test: chromium or chromedriver is missing; run scripts/install_browser.sh "
            "(apt-get install chromium chromium-driver)",
            pytrace=False,
        )
    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1100,900"):
        opts.add_argument(a)
    try:
        return webdriver.Chrome(service=Service(driver), options=opts)
    except Exception as e:
        pytest.fail(
            f"browser test: Chromium did not start: {type(e).__name__}: {str(e).splitlines()[0]}", pytrace=False
        )


@pytest.fixture(scope="module")
def browser():
    b = _browser()
    b.set_script_timeout(120)
    yield b
    b.quit()


@pytest.fixture(scope="module")
def server():
    """`specdraft serve` in a child process, one request at a time, default method auto."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "SPECDRAFT_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "specdraft.cli",
        "serve",
        "--target",
        "smollm2-135m",
        "--backend",
        "hf",
        "--dtype",
        "float32",
        "--port",
        str(port),
        "--max-tokens",
        "64",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def up():
        if proc.poll() is not None:
            raise AssertionError(f"specdraft serve exited: {proc.stderr.read()[-2000:]}")
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, timeout=180, every=0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _q(b, css):
    from selenium.webdriver.common.by import By

    return b.find_elements(By.CSS_SELECTOR, css)


def _set(b, element_id, value):
    """Sets an input or select by id, firing its change event (as a user would)."""
    b.execute_script(
        "const e = document.getElementById(arguments[0]); e.value = arguments[1];e.dispatchEvent(new Event('change'))",
        element_id,
        value,
    )


def _form(b, url, mode, method, temperature=0, race=False):
    b.get(url + "/")
    wait_until(lambda: len(_q(b, "#method option")) > 1, timeout=30)
    assert [o.get_attribute("value") for o in _q(b, "#method option")][0] == "auto"
    _set(b, "mode", mode)
    _set(b, "method", method)
    _set(b, "prompt", PROMPT)
    _set(b, "max_tokens", str(MAX_TOKENS))
    _set(b, "temperature", str(temperature))
    if race != _q(b, "#race")[0].is_selected():
        _q(b, "#race")[0].click()


def _generate(b, ctrl_enter=False):
    from selenium.webdriver.common.keys import Keys

    if ctrl_enter:
        _q(b, "#prompt")[0].send_keys(Keys.CONTROL, Keys.ENTER)
    else:
        _q(b, "#generate")[0].click()
    wait_until(lambda: _q(b, "#cols[data-done]"), timeout=120, every=0.1)


def _spec_of_page(b) -> dict:
    return b.execute_script("return chosenSpec()")


def test_greedy_answer_and_accepted_tokens(browser, server):
    b = browser
    _form(b, server, "completion", "prompt_lookup")
    _generate(b, ctrl_enter=True)
    assert not _q(b, "#error")[0].is_displayed(), _q(b, "#error")[0].text
    shown = b.execute_script("return document.querySelector('#col-main .text').textContent")
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "top_p": 1, "spec": _spec_of_page(b)}
    api = httpx.post(server + "/v1/completions", json=body, timeout=120).json()
    assert shown == api["choices"][0]["text"]
    accepted = {s.get_attribute("data-i") for s in _q(b, "#col-main .t.acc")}
    assert api["usage"]["accepted"] > 0 and len(accepted) == api["usage"]["accepted"]
    tip = _q(b, "#col-main .t.acc")[0].get_attribute("title")
    assert tip.startswith("step ") and "accepted draft" in tip


def test_race_marks_identical_greedy_texts(browser, server):
    b = browser
    _form(b, server, "chat", "prompt_lookup", race=True)
    _generate(b)
    assert not _q(b, "#error")[0].is_displayed(), _q(b, "#error")[0].text
    main, plain = (
        b.execute_script(f"return document.querySelector('#{c} .text').textContent") for c in ("col-main", "col-plain")
    )
    assert main and main == plain
    assert _q(b, "#identical")[0].get_attribute("data-identical") == "true"
    assert all(t.text != "–" for t in _q(b, ".col .tps"))  # each column measured its own tokens/s
    assert _q(b, "#speedup")[0].text.endswith("×")
    shot = os.environ.get("SPECDRAFT_SCREENSHOT")
    if shot:
        b.set_window_size(1000, 760)
        b.save_screenshot(shot)
    # at phone width the columns stack and nothing scrolls sideways
    b.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride", {"width": 360, "height": 800, "deviceScaleFactor": 1, "mobile": True}
    )
    try:
        assert b.execute_script("return [innerWidth, document.documentElement.scrollWidth]") == [360, 360]
        left = [
            b.execute_script(f"return document.getElementById('{c}').getBoundingClientRect().left")
            for c in ("col-main", "col-plain")
        ]
        assert left[0] == left[1]  # one above the other
    finally:
        b.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_bad_request_shows_the_servers_error(browser, server):
    b = browser
    _form(b, server, "completion", "prompt_lookup", temperature=-1)
    _generate(b)
    err = _q(b, "#error")[0]
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": -1}
    api = httpx.post(server + "/v1/completions", json=body, timeout=30)
    assert api.status_code == 400 and err.is_displayed()
    assert api.json()["error"]["message"] in err.text and "temperature" in err.text


def test_api_key_is_asked_and_sent(browser):
    from test_server_fast import tiny_pair

    b = browser
    with running_server(
        tiny_pair(), model_name="tiny", default_spec={"method": "draft_model", "k": 3}, api_key="s3cret"
    ) as (url, _):
        b.get(url + "/")
        wait_until(lambda: _q(b, "#apikey")[0].is_displayed(), timeout=30)
        assert "API key" in _q(b, "#error")[0].text
        _set(b, "apikey", "s3cret")
        wait_until(lambda: len(_q(b, "#method option")) > 1, timeout=30)
        _set(b, "mode", "completion")
        _set(b, "prompt", "abcabc")
        _set(b, "max_tokens", "6")
        _generate(b)
        assert not _q(b, "#error")[0].is_displayed(), _q(b, "#error")[0].text
        assert len(b.execute_script("return document.querySelector('#col-main .text').textContent")) > 0


def _tiny_page(b, url):
    b.get(url + "/")
    wait_until(lambda: len(_q(b, "#method option")) > 1, timeout=30)
    _set(b, "mode", "completion")
    _set(b, "prompt", "abcabc")
    _set(b, "max_tokens", "6")


HOSTILE_ID = "<img src=x onerror=window.__xss=1>"


def test_server_text_is_never_markup_and_the_policy_forbids_inline_script(browser):
    """A method id from /v1/specdraft/methods went into innerHTML, under a policy allowing inline script: a
    plugin method named <img onerror=...> ran script. Every server string is a text node; the page's script
    is its own file, so the policy forbids inline script and framing."""
    from specdraft.core import methods
    from specdraft.drafters.factories import prompt_lookup
    from test_server_fast import tiny_pair

    b = browser
    methods.REGISTRY[HOSTILE_ID] = methods.Method(
        HOSTILE_ID, "a plugin " + HOSTILE_ID, prompt_lookup, params=methods.PromptLookupParams
    )
    try:
        with running_server(tiny_pair(), model_name="tiny", default_spec={"method": "draft_model", "k": 3}) as (url, _):
            csp = httpx.get(url + "/", timeout=30).headers["content-security-policy"]
            assert "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp and "script-src 'self'" in csp
            _tiny_page(b, url)
            _set(b, "method", HOSTILE_ID)
            if not _q(b, "#race")[0].is_selected():
                _q(b, "#race")[0].click()
            _generate(b)
            assert not _q(b, "#error")[0].is_displayed(), _q(b, "#error")[0].text
            assert HOSTILE_ID in _q(b, "#summary")[0].text and not _q(b, "#summary img, #cols img")
            # and were a string to reach markup, the policy would not run its handler
            b.execute_script(f"document.body.insertAdjacentHTML('beforeend', {HOSTILE_ID!r})")
            time.sleep(0.3)
            assert b.execute_script("return window.__xss") is None
    finally:
        del methods.REGISTRY[HOSTILE_ID]


@pytest.mark.parametrize("locked", [False, True])
def test_fixed_mode_server_streams_plain_text_with_a_note(browser, locked):
    """On --stream-mode fixed / fixed-only every Generate was a 400 (the page always asked include_steps).
    The page reads the server's mode and streams plain text, uncoloured, saying why."""
    from specdraft.server.pacing import StreamPacing
    from test_server_fast import tiny_pair

    b = browser
    pacing = StreamPacing(chunk_tokens=2, interval_s=0.02, pad_bytes=64, locked=locked)
    with running_server(
        tiny_pair(),
        model_name="tiny",
        default_spec={"method": "draft_model", "k": 3},
        stream_mode="fixed",
        stream_pacing=pacing,
    ) as (url, _):
        _tiny_page(b, url)
        assert "fixed mode" in _q(b, "#note")[0].text and not _q(b, "#legend")[0].is_displayed()
        _generate(b)
        assert not _q(b, "#error")[0].is_displayed(), _q(b, "#error")[0].text
        shown = b.execute_script("return document.querySelector('#col-main .text').textContent")
        body = {"prompt": "abcabc", "max_tokens": 6, "temperature": 0, "top_p": 1, "spec": _spec_of_page(b)}
        assert shown == httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        assert shown and not _q(b, "#col-main .t") and _q(b, "#col-main .ntok")[0].text == "6"


def test_a_learning_server_shows_its_acceptance_curve(browser, tmp_path):
    """`serve --learn`: the page draws the learner's acceptance curve (an SVG polyline, no inline style or
    script) and shows its state as text, whatever it holds; a server that does not learn shows no section."""
    from conftest import tiny_llama
    from head_util import save_eagle3_head
    from specdraft.api import SpecDecoder
    from specdraft.learning import LearnConfig
    from test_server_fast import StubTok, tiny_pair

    b = browser
    t = tiny_llama(vocab=64, hidden=32, layers=4)
    t.tokenizer = StubTok()
    head = save_eagle3_head(t, tmp_path / "head")
    dec = SpecDecoder(t, learn=LearnConfig(persist=False, window=8))
    dec.learner.spawn = False  # no training process: the test plants the curve
    spec = {"method": "eagle3", "head": str(head), "k": 3}
    with running_server(dec, model_name="tiny", default_spec=spec) as (url, _):
        dec.learner.guard.curve.extend([(1.0, 0.2), (2.0, 0.5), (3.0, 0.4)])
        dec.learner._status.state = "learning " + HOSTILE_ID
        b.get(url + "/")
        wait_until(lambda: _q(b, "#learning")[0].is_displayed(), timeout=30)
        assert HOSTILE_ID in _q(b, "#learnstate")[0].text and not _q(b, "#learning img")
        assert len(_q(b, "#learncurve polyline")[0].get_attribute("points").split()) == 3
    with running_server(tiny_pair(), model_name="tiny", default_spec={"method": "draft_model", "k": 3}) as (url, _):
        _tiny_page(b, url)
        assert not _q(b, "#learning")[0].is_displayed()
