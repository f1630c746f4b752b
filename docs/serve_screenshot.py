"""Save a screenshot of `txl serve`'s page (docs/serve_page.png) from a real headless Chromium.

Without --model it first trains a small character model on Tiny Shakespeare for --steps steps (a couple of
minutes on a CPU), so the colours mean something; a random model's would be noise. The page reads a passage
with and without memory (and the bits the memory saved on each token), then continues it.

    python docs/serve_screenshot.py [--model MODEL_DIR] [--steps 400] [--out docs/serve_page.png]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def train_small(directory: Path, steps: int) -> Path:
    import torch

    import txl
    from benchmarks.serve_common import corpus_text, make_model_dir
    from txl.data.tokenizer import load_model_tokenizer

    make_model_dir(directory, n_layer=3, d_model=128, mem_len=64)
    model = txl.from_pretrained(directory).train()
    tok = load_model_tokenizer(directory, vocab_size=model.config.vocab_size)
    ids = torch.tensor(tok.encode(corpus_text(1_000_000)), dtype=torch.long)
    B, T = 16, 64
    starts = torch.arange(B) * (len(ids) // B)  # B parallel streams, read in order so the memory is right
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    memory = None
    for step in range(steps):
        x = torch.stack([ids[s + step * T: s + step * T + T] for s in starts])  # (B, T)
        y = torch.stack([ids[s + step * T + 1: s + step * T + T + 1] for s in starts])  # (B, T)
        out = model(x, labels=y, memory=memory)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        memory = out.memory
        if step % 100 == 0:
            print(f"step {step}: loss {out.loss.item():.3f}", flush=True)
    txl.save_pretrained(model.eval(), directory)
    return directory


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--out", default=str(ROOT / "docs" / "serve_page.png"))
    args = p.parse_args()
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from benchmarks.serve_common import corpus_text, start_server

    work = Path(tempfile.mkdtemp(prefix="txl-serve-shot-"))
    model = Path(args.model) if args.model else train_small(work / "model", args.steps)
    proc, url = start_server(model, work / "serve.log", "--serve.state_dir", str(work / "state"),
                             "--serve.segment_len", "64", "--serve.durability", "shutdown")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1500,1250"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options,
                              service=webdriver.ChromeService(executable_path=shutil.which("chromedriver")))
    try:
        driver.get(url + "/")
        text = corpus_text(200_000)[100_000:]
        text = text[text.index("\n\n") + 2:][:900]
        driver.execute_script("document.getElementById('doc').value = arguments[0];", text)
        driver.find_element(By.ID, "read").click()
        WebDriverWait(driver, 300).until(lambda d: d.execute_script("return document.body.dataset.state") == "done")
        driver.find_element(By.ID, "continue").click()
        WebDriverWait(driver, 300).until(lambda d: d.execute_script("return document.body.dataset.state")
                                         == "continued")
        driver.save_screenshot(args.out)
        print(f"saved {args.out}: with memory {driver.find_element(By.ID, 'mem-bpc').text} bits/char, without "
              f"{driver.find_element(By.ID, 'nomem-bpc').text}; memory saved "
              f"{driver.find_element(By.ID, 'saved-bpt').text} bits/token")
    finally:
        driver.quit()
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
