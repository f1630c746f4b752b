"""The label convention shared by the data layer and the model (a leaf module: it imports nothing)."""

IGNORE_INDEX = -100
"""A label the loss skips (carried context, padding, the first half under ``loss_positions='last_half'``);
torch's ``cross_entropy`` default ``ignore_index``."""
