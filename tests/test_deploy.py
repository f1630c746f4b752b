"""The README's deployment section as written: its systemd unit passes `systemd-analyze verify`, its nginx block
passes `nginx -t`, and behind that very block (a real nginx, the prefix /txl/ stripped) the page reads a
document in headless Chromium. Each check is skipped where its tool is not installed."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def block(marker: str, lang: str) -> str:
    """The fenced block of ``lang`` right after the README comment ``<!-- marker ... -->``."""
    m = re.search(rf"<!-- {marker}\b.*?-->\n```{lang}\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)
    assert m, f"README has no ```{lang} block after <!-- {marker} -->"
    return m.group(1)


def nginx_conf(tmp_path: Path, port: int, upstream: int | None = None) -> Path:
    """A whole nginx configuration around the README's location block (listening on ``port``, its files in
    ``tmp_path``; the upstream's port replaced by ``upstream``)."""
    location = block("deploy-proxy", "nginx")
    if upstream is not None:
        assert "127.0.0.1:8000" in location
        location = location.replace("127.0.0.1:8000", f"127.0.0.1:{upstream}")
    conf = tmp_path / "nginx.conf"
    conf.write_text(f"""daemon off;
pid {tmp_path}/nginx.pid;
error_log {tmp_path}/error.log;
events {{}}
http {{
    access_log off;
    client_body_temp_path {tmp_path}/body;
    proxy_temp_path {tmp_path}/proxy;
    server {{
        listen 127.0.0.1:{port};
{location}
    }}
}}
""", encoding="utf-8")
    return conf


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze (systemd)")
def test_systemd_unit_verifies(tmp_path):
    unit = block("deploy-unit", "ini")
    assert "/opt/txl/venv/bin/txl serve" in unit
    txl = Path(sys.executable).parent / "txl"  # the unit's ExecStart must exist: this environment's txl
    path = tmp_path / "txl-serve.service"
    path.write_text(unit.replace("/opt/txl/venv/bin/txl", str(txl)), encoding="utf-8")
    out = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    complaints = [line for line in (out.stdout + out.stderr).splitlines() if path.name in line]
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr


@pytest.mark.skipif(shutil.which("nginx") is None, reason="needs nginx (apt-get install nginx-light)")
def test_nginx_block_is_valid(tmp_path):
    out = subprocess.run(["nginx", "-t", "-p", str(tmp_path), "-c", str(nginx_conf(tmp_path, free_port()))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "syntax is ok" in out.stderr, out.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nginx") is None or shutil.which("chromium") is None or
                    shutil.which("chromedriver") is None, reason="needs nginx, chromium and chromium-driver")
def test_page_behind_the_readme_proxy(tmp_path, one_thread):
    pytest.importorskip("fastapi")
    pytest.importorskip("selenium")
    import httpx
    from selenium.webdriver.common.by import By
    from serve_util import TEXT, loader, make_model_dir, running
    from test_serve_page import browser, wait_state

    from txl.serve import ServeConfig, create_app

    app = create_app(ServeConfig(state_dir=str(tmp_path / "state"), segment_len=16, durability="shutdown"),
                     loader(make_model_dir(tmp_path / "model")))
    with running(app) as url:
        port = free_port()
        proxy = subprocess.Popen(["nginx", "-p", str(tmp_path), "-c", str(nginx_conf(tmp_path, port, int(url.rsplit(
            ":", 1)[1])))], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        base = f"http://127.0.0.1:{port}/txl/"
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(base + "health", timeout=2).json()["status"] == "ok":
                        break
                except (httpx.TransportError, ValueError):
                    pass
                assert proxy.poll() is None and time.monotonic() < deadline, "nginx did not start"
                time.sleep(0.1)
            assert httpx.get(f"http://127.0.0.1:{port}/txl", timeout=5).status_code == 301  # to /txl/
            driver = browser()
            try:
                driver.get(base)
                assert wait_state(driver, {"ready"}) == "ready"
                driver.execute_script("document.getElementById('doc').value = arguments[0];", TEXT)
                driver.find_element(By.ID, "read").click()
                assert wait_state(driver, {"done", "error"}) == "done", driver.find_element(By.ID, "error").text
                assert driver.find_element(By.ID, "mem-tokens").text == str(len(TEXT))
                assert "model tiny" in driver.find_element(By.ID, "model").text  # /txl/health, relative
            finally:
                driver.quit()
        finally:
            proxy.terminate()
            proxy.wait(30)
