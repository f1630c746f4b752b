"""The paper's numbers we compare with, transcribed by hand from Dai et al. 2019 (arXiv:1901.02860v3).

These are the only numbers in docs/results.md that our commands do not produce; the report labels them.
"""

TABLE6 = [
    # (remark, recurrence, encoding, loss, PPL init, PPL best, attn len); WikiText-103, about 128M-151M params.
    ("Transformer-XL (128M)", True, "relative", "Full", 27.02, 26.77, 500),
    ("-", True, "shaw", "Full", 27.94, 27.94, 256),
    ("-", True, "relative", "Half", 28.69, 28.33, 460),
    ("-", False, "relative", "Full", 29.59, 29.02, 260),
    ("-", False, "relative", "Half", 30.10, 30.10, 120),
    ("-", False, "shaw", "Full", 29.75, 29.75, 120),
    ("-", False, "shaw", "Half", 30.50, 30.50, 120),
    ("-", False, "absolute", "Half", 30.97, 30.97, 120),
    ("Transformer (128M)", False, "al_rfou", "Half", 31.16, 31.16, 120),
]
"""Table 6, the first block (ablation of recurrence and encoding on WikiText-103)."""

TABLE6_LONG_MEMORY = ("Transformer-XL (151M)", 23.43, 23.09, 640)
"""Table 6, second block, first row (WikiText-103): a recurrent model trained with a short memory, its PPL at
the training attention length (PPL init) and at the best longer one (PPL best, at that attention length)."""

TABLE8_GROUP2 = [
    # (model, RECL r=0.1, r=0.5, r=1.0): the ablation group of Table 8 (same parameter budget).
    ("Transformer-XL 128M", 700, 600, 500),
    ("- use Shaw et al. (2018) encoding", 400, 400, 300),
    ("- remove recurrence", 300, 300, 300),
    ("Transformer", 128, 128, 128),
]
"""Table 8, second model group (WikiText-103)."""

TABLE9_SPEEDUP = {800: 363, 1800: 773, 2800: 1409, 3800: 1874}
"""Table 9: evaluation speed-up over Al-Rfou et al. (2018) by attention length (GPU)."""
