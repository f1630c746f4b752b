"""The page at / in a real headless Chromium (Debian's chromium and chromium-driver, driven by selenium):
it reads a document, colours every token, and shows the same numbers as the API, and the bits memory saved on
each token in a third view; it streams a continuation, shown apart, its tokens kept out of the document's figures."""

import math
import re
import shutil

import pytest

pytest.importorskip("fastapi")
webdriver = pytest.importorskip("selenium.webdriver")
import httpx  # noqa: E402
from serve_util import TEXT, loader, make_model_dir, running  # noqa: E402

from txl.serve import ServeConfig, create_app  # noqa: E402

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Debian's chromium and chromium-driver "
                                 "(apt-get install chromium chromium-driver; .ci/run installs them)")]


def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))


def _rgb(css: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", css)[:3])


def wait_state(driver, states, timeout=60):
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout).until(lambda d: d.execute_script("return document.body.dataset.state") in states)
    return driver.execute_script("return document.body.dataset.state")


def test_page_colours_a_document_with_the_apis_numbers(tmp_path):
    from selenium.webdriver.common.by import By

    model_dir = make_model_dir(tmp_path / "model")
    app = create_app(ServeConfig(state_dir=str(tmp_path / "state"), segment_len=16, durability="shutdown"),
                     loader(model_dir))
    with running(app) as url, httpx.Client(base_url=url, timeout=30) as api:
        want = {}
        for name, memory in (("mem", True), ("nomem", False)):
            sid = api.post("/v1/sessions", json={"memory": memory}).json()["id"]
            want[name] = api.post(f"/v1/sessions/{sid}/text", json={"text": TEXT, "final": True}).json()["session"]
        assert want["nomem"]["nll"] != want["mem"]["nll"]  # the two views differ
        driver = browser()
        try:
            driver.get(url + "/")
            assert wait_state(driver, {"ready"}) == "ready"
            driver.execute_script("document.getElementById('doc').value = arguments[0];", TEXT)
            driver.find_element(By.ID, "read").click()
            assert wait_state(driver, {"done", "error"}) == "done", driver.find_element(By.ID, "error").text
            for name in ("mem", "nomem"):
                assert driver.find_element(By.ID, f"{name}-bpt").text == f"{want[name]['bits_per_token']:.4f}"
                assert driver.find_element(By.ID, f"{name}-bpc").text == f"{want[name]['bits_per_char']:.4f}"
                assert driver.find_element(By.ID, f"{name}-tokens").text == str(len(TEXT))
                bits = driver.execute_script(
                    f"return [...document.querySelectorAll('#{name}-view span[data-bits]')].map(s => +s.dataset.bits)")
                assert len(bits) == want[name]["tokens_scored"] == len(TEXT)
                assert sum(bits) / len(bits) == pytest.approx(want[name]["bits_per_token"], abs=1e-5)
                spans = driver.find_elements(By.CSS_SELECTOR, f"#{name}-view span")
                assert "".join(s.get_attribute("textContent") for s in spans) == TEXT
            # The third view: per token, the bits without memory less the bits with it; in total the two NLLs' gap.
            saved = driver.execute_script(
                "return [...document.querySelectorAll('#saved-view span[data-saved]')].map(s => +s.dataset.saved)")
            total = (want["nomem"]["nll"] - want["mem"]["nll"]) / math.log(2)
            assert len(saved) == len(TEXT) and sum(saved) == pytest.approx(total, abs=1e-4)
            assert any(x > 0 for x in saved) and any(x < 0 for x in saved)  # both colours of the diverging scale
            assert driver.find_element(By.ID, "saved-total").text == f"{total:.2f}"
            assert driver.find_element(By.ID, "saved-bpt").text == f"{total / len(TEXT):.4f}"
            colours = driver.execute_script("return [...document.querySelectorAll('#saved-view span[data-saved]')]"
                                            ".map(s => [+s.dataset.saved, getComputedStyle(s).backgroundColor])")
            blue = [c for x, c in colours if x > 0]
            red = [c for x, c in colours if x < 0]
            assert blue and red and all(_rgb(c)[2] > _rgb(c)[0] for c in blue) and all(
                _rgb(c)[0] > _rgb(c)[2] for c in red)
            driver.find_element(By.ID, "max-tokens").clear()
            driver.find_element(By.ID, "max-tokens").send_keys("30")
            driver.find_element(By.ID, "continue").click()
            assert wait_state(driver, {"continued", "error"}) == "continued", driver.find_element(By.ID, "error").text
            generated = driver.find_element(By.ID, "continuation").get_attribute("value")
            assert generated
            # The document's figures stay the document's; the continuation is counted and marked apart.
            assert driver.find_element(By.ID, "mem-tokens").text == str(len(TEXT))
            assert driver.find_element(By.ID, "mem-bpt").text == f"{want['mem']['bits_per_token']:.4f}"
            assert driver.find_element(By.ID, "gen-tokens").text == "30"
            marked = driver.find_elements(By.CSS_SELECTOR, "#mem-view span.generated")
            assert len(marked) == 1 and marked[0].get_attribute("textContent") == generated
        finally:
            driver.quit()
