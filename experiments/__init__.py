"""Small-scale reproductions of the findings of Dai et al. 2019 (Transformer-XL), one command each.

    python -m experiments.ablation      # Table 6: recurrence x positional encoding, PPL vs attention length
    python -m experiments.recl          # Appendix C: relative effective context length of the ablation models
    python -m experiments.char          # bits per character against evaluation attention length
    python -m experiments.speedup       # evaluation speed-up (timed by benchmarks.run)
    python -m experiments.report        # docs/results.md from the JSON results

Checkpoints and cached per-position losses go under ``runs/`` (git-ignored); tables (markdown and
JSON) and plots go under ``docs/results/``.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).absolute().parents[1]
"""The repository root: experiments run against this checkout's library, not an installed copy."""

if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))
